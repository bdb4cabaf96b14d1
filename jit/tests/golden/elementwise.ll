; An elementwise kernel without barriers: y[i] = a * x[i] + y[i].
; Exercises the host work-group loop: the work-item built-ins become loop
; counters and the loop over work-items vectorizes (host optimized_ir).
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"

declare i64 @_Z13get_global_idj(i32)

define spir_kernel void @saxpy(ptr addrspace(1) %x, ptr addrspace(1) %y, float %a) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %xi = getelementptr inbounds float, ptr addrspace(1) %x, i64 %i
  %yi = getelementptr inbounds float, ptr addrspace(1) %y, i64 %i
  %xv = load float, ptr addrspace(1) %xi, align 4
  %yv = load float, ptr addrspace(1) %yi, align 4
  %m = fmul float %a, %xv
  %r = fadd float %m, %yv
  store float %r, ptr addrspace(1) %yi, align 4
  ret void
}
