; Kernels for fusion, each a few lines:
;  scale(x, a):     x[i] = a * x[i]                  (in place, one scalar)
;  next(x, y):      y[i] = x[i + 1] within the group (a neighbour's element)
;  tile(in, t):     t[i] = 3 * in[i]
;  rotate(t, out):  out[i] = t[g * n + (l + 1) % n]  (a neighbour in the group)
;  twice(x, t):     t[i] = 2 * x[i]
;  grid2(x, z):     z[y * w + c] = x[y * w + c] + c  (2-D ids)
; The golden tests fuse chains of them through IrFusion.
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"

declare i64 @_Z13get_global_idj(i32)
declare i64 @_Z15get_global_sizej(i32)
declare i64 @_Z12get_local_idj(i32)
declare i64 @_Z14get_local_sizej(i32)
declare i64 @_Z12get_group_idj(i32)

define spir_kernel void @scale(ptr addrspace(1) %x, float %a) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %p = getelementptr inbounds float, ptr addrspace(1) %x, i64 %i
  %v = load float, ptr addrspace(1) %p, align 4
  %r = fmul float %a, %v
  store float %r, ptr addrspace(1) %p, align 4
  ret void
}

define spir_kernel void @next(ptr addrspace(1) %x, ptr addrspace(1) %y) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %l = call i64 @_Z12get_local_idj(i32 0)
  %n = call i64 @_Z14get_local_sizej(i32 0)
  %l1 = add i64 %l, 1
  %in = icmp ult i64 %l1, %n
  %i1 = add i64 %i, 1
  %j = select i1 %in, i64 %i1, i64 %i
  %xj = getelementptr inbounds float, ptr addrspace(1) %x, i64 %j
  %v = load float, ptr addrspace(1) %xj, align 4
  %yi = getelementptr inbounds float, ptr addrspace(1) %y, i64 %i
  store float %v, ptr addrspace(1) %yi, align 4
  ret void
}

define spir_kernel void @tile(ptr addrspace(1) %in, ptr addrspace(1) %t) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %ini = getelementptr inbounds float, ptr addrspace(1) %in, i64 %i
  %v = load float, ptr addrspace(1) %ini, align 4
  %r = fmul float %v, 3.0
  %ti = getelementptr inbounds float, ptr addrspace(1) %t, i64 %i
  store float %r, ptr addrspace(1) %ti, align 4
  ret void
}

define spir_kernel void @rotate(ptr addrspace(1) %t, ptr addrspace(1) %out) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %l = call i64 @_Z12get_local_idj(i32 0)
  %n = call i64 @_Z14get_local_sizej(i32 0)
  %g = call i64 @_Z12get_group_idj(i32 0)
  %base = mul i64 %g, %n
  %l1 = add i64 %l, 1
  %lw = urem i64 %l1, %n
  %j = add i64 %base, %lw
  %tj = getelementptr inbounds float, ptr addrspace(1) %t, i64 %j
  %v = load float, ptr addrspace(1) %tj, align 4
  %oi = getelementptr inbounds float, ptr addrspace(1) %out, i64 %i
  store float %v, ptr addrspace(1) %oi, align 4
  ret void
}

define spir_kernel void @twice(ptr addrspace(1) %x, ptr addrspace(1) %t) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %xi = getelementptr inbounds float, ptr addrspace(1) %x, i64 %i
  %v = load float, ptr addrspace(1) %xi, align 4
  %r = fmul float %v, 2.0
  %ti = getelementptr inbounds float, ptr addrspace(1) %t, i64 %i
  store float %r, ptr addrspace(1) %ti, align 4
  ret void
}

define spir_kernel void @grid2(ptr addrspace(1) %x, ptr addrspace(1) %z) {
entry:
  %c = call i64 @_Z13get_global_idj(i32 0)
  %y = call i64 @_Z13get_global_idj(i32 1)
  %w = call i64 @_Z15get_global_sizej(i32 0)
  %row = mul i64 %y, %w
  %e = add i64 %row, %c
  %xe = getelementptr inbounds float, ptr addrspace(1) %x, i64 %e
  %v = load float, ptr addrspace(1) %xe, align 4
  %cf = uitofp i64 %c to float
  %r = fadd float %v, %cf
  %ze = getelementptr inbounds float, ptr addrspace(1) %z, i64 %e
  store float %r, ptr addrspace(1) %ze, align 4
  ret void
}
