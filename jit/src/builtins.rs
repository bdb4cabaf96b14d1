//! The OpenCL built-ins the compilers translate, by the names clang-19 gives them
//! for `spir64` (Itanium-mangled OpenCL C overloads). The math built-ins that are
//! exactly an LLVM intrinsic are translated before any call is classified
//! ([`crate::math`]); the rest (`exp`, `sin`…) are [`Call::Unknown`].
//!
//! Dimension `0` is the fastest-varying one, as OpenCL defines it. For a dimension
//! `>= 3` the id functions return 0 and the size functions 1, as OpenCL specifies
//! for dimensions past `get_work_dim()`.

/// A work-item function: a value the compiled code supplies per work-item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum WorkItem {
    GlobalId,
    LocalId,
    GroupId,
    /// The size of this work-group (smaller for the last group of a range the local
    /// size does not divide, as OpenCL 2.0's non-uniform groups).
    LocalSize,
    /// The local size the launch asked for.
    EnqueuedLocalSize,
    GlobalSize,
    NumGroups,
    GlobalOffset,
    /// `get_work_dim()`: no dimension argument.
    WorkDim,
    /// `get_global_linear_id()`: no dimension argument.
    GlobalLinearId,
    /// `get_local_linear_id()`: no dimension argument.
    LocalLinearId,
}

impl WorkItem {
    /// Whether it takes a dimension argument.
    pub(crate) fn has_dim(self) -> bool {
        !matches!(self, WorkItem::WorkDim | WorkItem::GlobalLinearId | WorkItem::LocalLinearId)
    }
    /// Whether its value for an out-of-range dimension is 1 (sizes) rather than 0.
    pub(crate) fn is_size(self) -> bool {
        matches!(
            self,
            WorkItem::LocalSize | WorkItem::EnqueuedLocalSize | WorkItem::GlobalSize | WorkItem::NumGroups
        )
    }
}

/// What a call to a function the module does not define is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    /// A work-item function.
    WorkItem(WorkItem),
    /// A work-group barrier: every work-item of the group reaches it before any
    /// passes it.
    Barrier,
    /// A memory fence with no execution barrier: sequential work-items on one host
    /// thread need none, and on the GPU it becomes a no-op too (the compilers keep
    /// memory operations in order around calls they cannot see through; a fence
    /// between work-items of one group needs a barrier anyway).
    Fence,
    /// An LLVM intrinsic: left to LLVM.
    Intrinsic,
    /// Anything else: the kernel cannot be compiled.
    Unknown,
}

/// Classifies a call to `name`.
pub(crate) fn classify(name: &str) -> Call {
    use WorkItem::*;
    let item = match name {
        "_Z13get_global_idj" => GlobalId,
        "_Z12get_local_idj" => LocalId,
        "_Z12get_group_idj" => GroupId,
        "_Z14get_local_sizej" => LocalSize,
        "_Z23get_enqueued_local_sizej" => EnqueuedLocalSize,
        "_Z15get_global_sizej" => GlobalSize,
        "_Z14get_num_groupsj" => NumGroups,
        "_Z17get_global_offsetj" => GlobalOffset,
        "_Z12get_work_dimv" => WorkDim,
        "_Z20get_global_linear_idv" => GlobalLinearId,
        "_Z19get_local_linear_idv" => LocalLinearId,
        "_Z7barrierj" | "_Z18work_group_barrierj" | "_Z18work_group_barrierj12memory_scope" => {
            return Call::Barrier
        }
        "_Z9mem_fencej"
        | "_Z14read_mem_fencej"
        | "_Z15write_mem_fencej"
        | "_Z22atomic_work_item_fencej12memory_order12memory_scope" => return Call::Fence,
        n if n.starts_with("llvm.") => return Call::Intrinsic,
        _ => return Call::Unknown,
    };
    Call::WorkItem(item)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_classify() {
        assert_eq!(classify("_Z13get_global_idj"), Call::WorkItem(WorkItem::GlobalId));
        assert_eq!(classify("_Z12get_work_dimv"), Call::WorkItem(WorkItem::WorkDim));
        assert_eq!(classify("_Z18work_group_barrierj12memory_scope"), Call::Barrier);
        assert_eq!(classify("llvm.fmuladd.f32"), Call::Intrinsic);
        assert_eq!(classify("_Z4sqrtf"), Call::Unknown);
        assert!(WorkItem::NumGroups.is_size() && !WorkItem::GroupId.is_size());
        assert!(!WorkItem::WorkDim.has_dim() && WorkItem::LocalId.has_dim());
    }
}
