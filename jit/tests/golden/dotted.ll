; A kernel whose helper and private constant table have names with `.` (as
; LLVM's passes and clang name them: `.str`, `foo.cold`), with two barriers.
; Exercises the PTX lowering: ptxas takes no `.` in identifiers, and each
; barrier is one bar.sync.
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"

@table.0 = internal addrspace(1) global [4 x float] [float 1.0, float 2.0, float 3.0, float 4.0]

declare i64 @_Z13get_global_idj(i32)
declare void @_Z7barrierj(i32)

define internal float @pick.cold(i64 %i) noinline {
entry:
  %k = and i64 %i, 3
  %p = getelementptr inbounds [4 x float], ptr addrspace(1) @table.0, i64 0, i64 %k
  %v = load float, ptr addrspace(1) %p, align 4
  ret float %v
}

define spir_kernel void @dotted(ptr addrspace(1) %x) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %p = getelementptr inbounds float, ptr addrspace(1) %x, i64 %i
  %v = load float, ptr addrspace(1) %p, align 4
  call void @_Z7barrierj(i32 2)
  %t = call float @pick.cold(i64 %i)
  %r = fadd float %v, %t
  store float %r, ptr addrspace(1) %p, align 4
  call void @_Z7barrierj(i32 2)
  ret void
}
