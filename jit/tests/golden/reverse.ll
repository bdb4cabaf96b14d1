; Reverses each work-group's elements through local memory with one barrier:
; tmp[l] = in[i]; barrier; out[i] = tmp[n - 1 - l].
; Exercises barrier region splitting on the host (two regions, no barrier call
; left, a value live across the barrier kept per work-item) and bar.sync in PTX.
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"

declare i64 @_Z13get_global_idj(i32)
declare i64 @_Z12get_local_idj(i32)
declare i64 @_Z14get_local_sizej(i32)
declare void @_Z7barrierj(i32)

define spir_kernel void @rev(ptr addrspace(1) %in, ptr addrspace(1) %out, ptr addrspace(3) %tmp) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %l = call i64 @_Z12get_local_idj(i32 0)
  %n = call i64 @_Z14get_local_sizej(i32 0)
  %ini = getelementptr inbounds float, ptr addrspace(1) %in, i64 %i
  %v = load float, ptr addrspace(1) %ini, align 4
  %tl = getelementptr inbounds float, ptr addrspace(3) %tmp, i64 %l
  store float %v, ptr addrspace(3) %tl, align 4
  call void @_Z7barrierj(i32 1)
  %n1 = sub i64 %n, 1
  %j = sub i64 %n1, %l
  %tj = getelementptr inbounds float, ptr addrspace(3) %tmp, i64 %j
  %w = load float, ptr addrspace(3) %tj, align 4
  %outi = getelementptr inbounds float, ptr addrspace(1) %out, i64 %i
  store float %w, ptr addrspace(1) %outi, align 4
  ret void
}
