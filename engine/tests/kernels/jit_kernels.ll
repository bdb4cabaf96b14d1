; Generated from jit_kernels.cl (beside it) by
;   clang-19 -x cl -cl-std=CL2.0 -target spir64-unknown-unknown -emit-llvm -S -O1 -Xclang -finclude-default-header -o jit_kernels.ll jit_kernels.cl
; and embedded in the CUDA tests (the device machine has no clang): the build-time route of gantry-jit.
; ModuleID = 'jit_kernels.cl'
source_filename = "jit_kernels.cl"
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"

; Function Attrs: convergent mustprogress nofree norecurse nounwind willreturn memory(argmem: readwrite)
define dso_local spir_kernel void @saxpy(ptr addrspace(1) nocapture noundef readonly align 4 %0, ptr addrspace(1) nocapture noundef align 4 %1, i32 noundef %2, float noundef %3) local_unnamed_addr #0 !kernel_arg_addr_space !4 !kernel_arg_access_qual !5 !kernel_arg_type !6 !kernel_arg_base_type !6 !kernel_arg_type_qual !7 {
  %5 = tail call spir_func i64 @_Z13get_global_idj(i32 noundef 0) #5
  %6 = zext i32 %2 to i64
  %7 = icmp ult i64 %5, %6
  br i1 %7, label %8, label %14

8:                                                ; preds = %4
  %9 = getelementptr inbounds float, ptr addrspace(1) %0, i64 %5
  %10 = load float, ptr addrspace(1) %9, align 4, !tbaa !8
  %11 = getelementptr inbounds float, ptr addrspace(1) %1, i64 %5
  %12 = load float, ptr addrspace(1) %11, align 4, !tbaa !8
  %13 = tail call float @llvm.fmuladd.f32(float %3, float %10, float %12)
  store float %13, ptr addrspace(1) %11, align 4, !tbaa !8
  br label %14

14:                                               ; preds = %8, %4
  ret void
}

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func i64 @_Z13get_global_idj(i32 noundef) local_unnamed_addr #1

; Function Attrs: mustprogress nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.fmuladd.f32(float, float, float) #2

; Function Attrs: convergent norecurse nounwind
define dso_local spir_kernel void @group_sums(ptr addrspace(1) nocapture noundef readonly align 4 %0, ptr addrspace(1) nocapture noundef writeonly align 4 %1, ptr addrspace(3) nocapture noundef align 4 %2) local_unnamed_addr #3 !kernel_arg_addr_space !12 !kernel_arg_access_qual !13 !kernel_arg_type !14 !kernel_arg_base_type !14 !kernel_arg_type_qual !15 {
  %4 = tail call spir_func i64 @_Z12get_local_idj(i32 noundef 0) #5
  %5 = tail call spir_func i64 @_Z13get_global_idj(i32 noundef 0) #5
  %6 = getelementptr inbounds i32, ptr addrspace(1) %0, i64 %5
  %7 = load i32, ptr addrspace(1) %6, align 4, !tbaa !16
  %8 = getelementptr inbounds i32, ptr addrspace(3) %2, i64 %4
  store i32 %7, ptr addrspace(3) %8, align 4, !tbaa !16
  tail call spir_func void @_Z7barrierj(i32 noundef 1) #6
  %9 = tail call spir_func i64 @_Z14get_local_sizej(i32 noundef 0) #5
  %10 = icmp ult i64 %9, 2
  br i1 %10, label %11, label %13

11:                                               ; preds = %22, %3
  %12 = icmp eq i64 %4, 0
  br i1 %12, label %24, label %28

13:                                               ; preds = %3, %22
  %14 = phi i64 [ %15, %22 ], [ %9, %3 ]
  %15 = lshr i64 %14, 1
  %16 = icmp ult i64 %4, %15
  br i1 %16, label %17, label %22

17:                                               ; preds = %13
  %18 = getelementptr i32, ptr addrspace(3) %8, i64 %15
  %19 = load i32, ptr addrspace(3) %18, align 4, !tbaa !16
  %20 = load i32, ptr addrspace(3) %8, align 4, !tbaa !16
  %21 = add nsw i32 %20, %19
  store i32 %21, ptr addrspace(3) %8, align 4, !tbaa !16
  br label %22

22:                                               ; preds = %17, %13
  tail call spir_func void @_Z7barrierj(i32 noundef 1) #6
  %23 = icmp ult i64 %14, 4
  br i1 %23, label %11, label %13, !llvm.loop !18

24:                                               ; preds = %11
  %25 = load i32, ptr addrspace(3) %2, align 4, !tbaa !16
  %26 = tail call spir_func i64 @_Z12get_group_idj(i32 noundef 0) #5
  %27 = getelementptr inbounds i32, ptr addrspace(1) %1, i64 %26
  store i32 %25, ptr addrspace(1) %27, align 4, !tbaa !16
  br label %28

28:                                               ; preds = %24, %11
  ret void
}

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func i64 @_Z12get_local_idj(i32 noundef) local_unnamed_addr #1

; Function Attrs: convergent nounwind
declare dso_local spir_func void @_Z7barrierj(i32 noundef) local_unnamed_addr #4

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func i64 @_Z14get_local_sizej(i32 noundef) local_unnamed_addr #1

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func i64 @_Z12get_group_idj(i32 noundef) local_unnamed_addr #1

; Function Attrs: convergent mustprogress nofree norecurse nounwind willreturn memory(argmem: readwrite)
define dso_local spir_kernel void @axpb(ptr addrspace(1) nocapture noundef align 4 %0, i32 noundef %1, float noundef %2, float noundef %3) local_unnamed_addr #0 !kernel_arg_addr_space !20 !kernel_arg_access_qual !5 !kernel_arg_type !21 !kernel_arg_base_type !21 !kernel_arg_type_qual !22 {
  %5 = tail call spir_func i64 @_Z13get_global_idj(i32 noundef 0) #5
  %6 = zext i32 %1 to i64
  %7 = icmp ult i64 %5, %6
  br i1 %7, label %8, label %12

8:                                                ; preds = %4
  %9 = getelementptr inbounds float, ptr addrspace(1) %0, i64 %5
  %10 = load float, ptr addrspace(1) %9, align 4, !tbaa !8
  %11 = tail call float @llvm.fmuladd.f32(float %2, float %10, float %3)
  store float %11, ptr addrspace(1) %9, align 4, !tbaa !8
  br label %12

12:                                               ; preds = %8, %4
  ret void
}

; Function Attrs: convergent mustprogress nofree norecurse nounwind willreturn memory(argmem: readwrite)
define dso_local spir_kernel void @step(ptr addrspace(1) nocapture noundef readonly align 4 %0, ptr addrspace(1) nocapture noundef writeonly align 4 %1, i32 noundef %2, float noundef %3, float noundef %4) local_unnamed_addr #0 !kernel_arg_addr_space !23 !kernel_arg_access_qual !24 !kernel_arg_type !25 !kernel_arg_base_type !25 !kernel_arg_type_qual !26 {
  %6 = tail call spir_func i64 @_Z13get_global_idj(i32 noundef 0) #5
  %7 = zext i32 %2 to i64
  %8 = icmp ult i64 %6, %7
  br i1 %8, label %9, label %15

9:                                                ; preds = %5
  %10 = getelementptr inbounds float, ptr addrspace(1) %0, i64 %6
  %11 = load float, ptr addrspace(1) %10, align 4, !tbaa !8
  %12 = fmul float %11, %3
  %13 = fadd float %12, %4
  %14 = getelementptr inbounds float, ptr addrspace(1) %1, i64 %6
  store float %13, ptr addrspace(1) %14, align 4, !tbaa !8
  br label %15

15:                                               ; preds = %9, %5
  ret void
}

; Function Attrs: convergent mustprogress nofree norecurse nounwind willreturn memory(argmem: readwrite)
define dso_local spir_kernel void @clamp_sqrt(ptr addrspace(1) nocapture noundef align 4 %0, i32 noundef %1) local_unnamed_addr #0 !kernel_arg_addr_space !27 !kernel_arg_access_qual !28 !kernel_arg_type !29 !kernel_arg_base_type !29 !kernel_arg_type_qual !30 {
  %3 = tail call spir_func i64 @_Z13get_global_idj(i32 noundef 0) #5
  %4 = zext i32 %1 to i64
  %5 = icmp ult i64 %3, %4
  br i1 %5, label %6, label %12

6:                                                ; preds = %2
  %7 = getelementptr inbounds float, ptr addrspace(1) %0, i64 %3
  %8 = load float, ptr addrspace(1) %7, align 4, !tbaa !8
  %9 = tail call spir_func float @_Z4fabsf(float noundef %8) #5
  %10 = tail call spir_func float @_Z4fmaxff(float noundef %9, float noundef 2.500000e-01) #5
  %11 = tail call spir_func float @_Z4sqrtf(float noundef %10) #5, !fpmath !31
  store float %11, ptr addrspace(1) %7, align 4, !tbaa !8
  br label %12

12:                                               ; preds = %6, %2
  ret void
}

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func float @_Z4sqrtf(float noundef) local_unnamed_addr #1

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func float @_Z4fmaxff(float noundef, float noundef) local_unnamed_addr #1

; Function Attrs: convergent mustprogress nofree nounwind willreturn memory(none)
declare dso_local spir_func float @_Z4fabsf(float noundef) local_unnamed_addr #1

attributes #0 = { convergent mustprogress nofree norecurse nounwind willreturn memory(argmem: readwrite) "frame-pointer"="all" "no-trapping-math"="true" "stack-protector-buffer-size"="8" "uniform-work-group-size"="false" }
attributes #1 = { convergent mustprogress nofree nounwind willreturn memory(none) "frame-pointer"="all" "no-trapping-math"="true" "stack-protector-buffer-size"="8" }
attributes #2 = { mustprogress nocallback nofree nosync nounwind speculatable willreturn memory(none) }
attributes #3 = { convergent norecurse nounwind "frame-pointer"="all" "no-trapping-math"="true" "stack-protector-buffer-size"="8" "uniform-work-group-size"="false" }
attributes #4 = { convergent nounwind "frame-pointer"="all" "no-trapping-math"="true" "stack-protector-buffer-size"="8" }
attributes #5 = { convergent nounwind willreturn memory(none) }
attributes #6 = { convergent nounwind }

!llvm.module.flags = !{!0, !1}
!opencl.ocl.version = !{!2}
!opencl.spir.version = !{!2}
!llvm.ident = !{!3}

!0 = !{i32 1, !"wchar_size", i32 4}
!1 = !{i32 7, !"frame-pointer", i32 2}
!2 = !{i32 2, i32 0}
!3 = !{!"Debian clang version 19.1.7 (3~deb12u1)"}
!4 = !{i32 1, i32 1, i32 0, i32 0}
!5 = !{!"none", !"none", !"none", !"none"}
!6 = !{!"float*", !"float*", !"uint", !"float"}
!7 = !{!"const", !"", !"", !""}
!8 = !{!9, !9, i64 0}
!9 = !{!"float", !10, i64 0}
!10 = !{!"omnipotent char", !11, i64 0}
!11 = !{!"Simple C/C++ TBAA"}
!12 = !{i32 1, i32 1, i32 3}
!13 = !{!"none", !"none", !"none"}
!14 = !{!"int*", !"int*", !"int*"}
!15 = !{!"const", !"", !""}
!16 = !{!17, !17, i64 0}
!17 = !{!"int", !10, i64 0}
!18 = distinct !{!18, !19}
!19 = !{!"llvm.loop.unroll.disable"}
!20 = !{i32 1, i32 0, i32 0, i32 0}
!21 = !{!"float*", !"uint", !"float", !"float"}
!22 = !{!"", !"", !"", !""}
!23 = !{i32 1, i32 1, i32 0, i32 0, i32 0}
!24 = !{!"none", !"none", !"none", !"none", !"none"}
!25 = !{!"float*", !"float*", !"uint", !"float", !"float"}
!26 = !{!"const", !"", !"", !"", !""}
!27 = !{i32 1, i32 0}
!28 = !{!"none", !"none"}
!29 = !{!"float*", !"uint"}
!30 = !{!"", !""}
!31 = !{float 3.000000e+00}
