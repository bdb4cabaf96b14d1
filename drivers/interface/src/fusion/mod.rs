//! Kernel fusion (the DPC++ kernel-fusion design, "Fusion Process"): what the scheduler
//! hands a fusion compiler and what it gets back.
//!
//! The scheduler describes the listed kernels in a [`FusionRequest`]: each kernel with
//! its geometry and one [`FusionArg`] per accessor slot (buffer, byte range, element
//! size, promotion hint). A [`FusionCompiler`] answers with a [`Fused`] kernel —
//! its geometry, its arguments (one per buffer, the *identical-argument groups* of the
//! seed: every slot of every kernel on one buffer is passed once) and the buffers it
//! internalized — or a [`FusionError`] naming why the kernels cannot be fused.
//!
//! The rules that decide the fused grid, which kernels are remapped, what is
//! internalized and how slots group into arguments are shared by every compiler
//! ([`rules`]), so a list fuses, or is refused for the same reason, whatever its
//! kernels' code is. The compiler for closure kernels (work-item remapping,
//! internalization and its plan cache) is `gantry_host`'s `ClosureFusion`; the one
//! for LLVM IR kernels is `gantry_jit`'s `IrFusion`.

use std::sync::Arc;

use smallvec::SmallVec;

mod module;
pub mod rules;
mod window;

pub use module::{fused_name, merged_mode, FusedModule};
pub use window::WindowThresholds;

use crate::image::ImageKind;
use crate::kernel::{KernelRef, ScalarBlock};
use crate::range::Geometry;

/// A hint that a buffer's contents are only needed inside the fused kernel (the DPC++ kernel-fusion design,
/// "Internalization Behavior"): the user asserts each element is touched by one
/// work-group (local) or one work-item (private), and that the contents are not needed
/// afterwards. They are then not written back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Promotion {
    /// Keep the buffer in global memory.
    #[default]
    None,
    /// Promote to work-group local memory of `elements / work-groups` elements.
    Local,
    /// Promote to per-work-item private memory of `elements / global size` elements.
    Private,
}

/// One accessor slot of a kernel to fuse.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FusionArg {
    /// The buffer's identity: slots with equal ids are one argument of the fused kernel.
    pub buffer: u64,
    /// First byte of the slot's range in the buffer.
    pub start: usize,
    /// One past its last byte.
    pub end: usize,
    /// Bytes per element.
    pub elem_size: usize,
    /// The promotion hint (from the accessor, or inherited from the buffer).
    pub promotion: Promotion,
}

impl FusionArg {
    /// A slot over bytes `range` of `buffer`, with no promotion.
    pub fn new(buffer: u64, range: std::ops::Range<usize>, elem_size: usize) -> Self {
        Self { buffer, start: range.start, end: range.end, elem_size, promotion: Promotion::None }
    }
    /// The same slot with a promotion hint.
    pub fn promoted(mut self, promotion: Promotion) -> Self {
        self.promotion = promotion;
        self
    }
    /// Bytes of the slot's range.
    pub fn bytes(&self) -> usize {
        self.end - self.start
    }
}

/// One kernel of a fusion list.
#[derive(Clone, Debug)]
pub struct FusionKernel {
    /// The kernel.
    pub kernel: KernelRef,
    /// Its geometry.
    pub geometry: Geometry,
    /// One per global slot, in slot order.
    pub args: SmallVec<[FusionArg; 4]>,
    /// Its scalar arguments (a closure kernel captures its own, and has none).
    pub scalars: ScalarBlock,
    /// The earlier kernels of the list (by index) it depends on directly, by any of
    /// the scheduler's rules (a buffer, queue order, an event): a failure of one of
    /// them fails it. Only a driver that reruns a failed fused kernel's kernels one by
    /// one reads them (the closure compiler's `Unfused::rerun`, in `gantry_host`), so
    /// that a failed fused kernel keeps what the kernels would have kept unfused.
    pub deps: SmallVec<[u32; 2]>,
}

/// The kernels of a fusion list, in order, and the fusion properties.
#[derive(Clone, Debug)]
pub struct FusionRequest {
    /// The kernels, in list order (a kernel may appear more than once).
    pub kernels: Vec<FusionKernel>,
    /// Insert a work-group barrier between the kernels (`false`: the `no_barriers`
    /// property).
    pub barriers: bool,
}

/// Why kernels cannot be fused. The scheduler then cancels the fusion and runs them
/// unfused, with correct results.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FusionError {
    /// The fusion list holds no kernel.
    #[error("the fusion list is empty")]
    Empty,
    /// Two kernels give different work-group sizes.
    #[error("different local sizes: `{first}` has {first_local:?}, `{second}` has {second_local:?}")]
    DifferentLocalSizes {
        /// The first kernel with a local size.
        first: String,
        /// Its local range.
        first_local: [usize; 3],
        /// A kernel with another one.
        second: String,
        /// That kernel's local range.
        second_local: [usize; 3],
    },
    /// The fused grid's global size is not a multiple of the work-group size.
    #[error(
        "non-uniform work-group sizes: global range {global:?} is not a multiple of local range {local:?}"
    )]
    NonUniformWorkGroups {
        /// The fused global range.
        global: [usize; 3],
        /// The work-group size.
        local: [usize; 3],
    },
    /// A kernel with a work-group size would need its global ids remapped because its
    /// dimension count differs from the fused grid's.
    #[error("different dimension counts: `{kernel}` has {dims} dimensions, the fused grid {fused_dims}")]
    DifferentDimensions {
        /// The kernel.
        kernel: String,
        /// Its dimension count.
        dims: usize,
        /// The fused grid's.
        fused_dims: usize,
    },
    /// A kernel with a work-group size would need its global ids remapped because its
    /// global size differs from the fused grid's in dimensions 2..N.
    #[error(
        "different global sizes in dimensions 2..N: `{kernel}` has {global:?}, the fused grid {fused:?}"
    )]
    DifferentGlobalSizes {
        /// The kernel.
        kernel: String,
        /// Its global range.
        global: [usize; 3],
        /// The fused grid's.
        fused: [usize; 3],
    },
    /// A listed kernel has no image of the kind the compiler fuses.
    #[error("kernel `{kernel}` has no {kind} image to fuse")]
    MissingImage {
        /// The kernel.
        kernel: String,
        /// The kind the compiler fuses.
        kind: ImageKind,
    },
    /// No fusion compiler of the device fuses every listed kernel: none takes an
    /// image kind they all have.
    #[error(
        "no fusion compiler of {device} takes an image kind every listed kernel has (`{kernel}` has {kinds})"
    )]
    NoCompiler {
        /// The device.
        device: String,
        /// A kernel the compilers' kinds miss.
        kernel: String,
        /// Its image kinds.
        kinds: String,
    },
    /// A kernel with work-group barriers would run for only some work-items of a
    /// fused work-group (its range is smaller than the grid and does not end at a
    /// group boundary, or is reshaped and smaller): the skipped work-items would
    /// never reach its barriers.
    #[error("kernel `{kernel}` has barriers but would run for only part of a fused work-group")]
    BarriersInPartialGroups {
        /// The kernel.
        kernel: String,
    },
    /// The chain fuses only into a kernel measured to run slower than the kernels
    /// unfused on the host drivers, so it is not fused: the kernels run unfused, with
    /// the same results.
    #[error("not fused: `{kernel}` {reason}")]
    Unprofitable {
        /// The kernel that makes it lose.
        kernel: String,
        /// Why fusing loses.
        reason: Unprofitable,
    },
    /// The fusion compiler could not read or transform a kernel's code (for the
    /// LLVM IR compiler: unparsable IR, an entry that does not match the kernel's
    /// signature, a construct the JIT does not translate).
    #[error("kernel `{kernel}` cannot be fused: {reason}")]
    Code {
        /// The kernel.
        kernel: String,
        /// Why.
        reason: String,
    },
    /// The kernels' global offsets differ, or are non-zero where ids must be remapped.
    #[error("different offsets: `{kernel}` has {offset:?}, the fused grid {fused:?}")]
    DifferentOffsets {
        /// The kernel.
        kernel: String,
        /// Its offset.
        offset: [usize; 3],
        /// The fused grid's (all zero when remapping is needed).
        fused: [usize; 3],
    },
}

/// Why a chain is not fused because fusing it would make it slower
/// ([`FusionError::Unprofitable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum Unprofitable {
    /// A reduction runs as one work-group over its whole range (it splits the range
    /// over the worker pool itself); fused, every kernel of the chain would share
    /// that one group, and one thread.
    #[error("is a reduction, which runs as one work-group over its whole range")]
    Reduction,
    /// Fused without barriers, per-work-item kernels that cannot run span by span
    /// (closures) would run one work-item at a time, each work-item's bodies back to
    /// back: every work-item pays a kernel launch's set-up on the CPU.
    #[error("would run one work-item at a time with the chain's other per-work-item kernels (fusion without barriers)")]
    ItemByItem,
    /// A kernel reaches memory that fusion would internalize, or that another kernel
    /// of the chain writes, one access at a time (a closure's accessors): every such
    /// access would be mapped out of line, a call where the kernel unfused does a
    /// load. (Elementwise kernels reach private memory as contiguous runs instead.)
    #[error("would reach internalized or shared memory one mapped access at a time")]
    MappedAccess,
    /// A stencil reads its neighbours' elements, which other work-groups of a fused
    /// chain would write while it reads them: only unfused are they all written first.
    #[error("is a stencil, which reads cells other work-groups of a fused chain write")]
    Neighborhood,
    /// The window's first kernel has fewer work-items than fusing pays for on its
    /// device ([`WindowThresholds::min_items`]): the window runs its kernels as they
    /// are submitted.
    #[error(
        "has {items} work-items, fewer than the {min_items} from which a fusion window pays on its device"
    )]
    LaunchBound {
        /// The kernel's work-items.
        items: u64,
        /// The device's threshold.
        min_items: u64,
    },
    /// No accessor is promoted and the memory touched is less than fusing pays for
    /// on its device ([`WindowThresholds::min_global_bytes`]): the caches hold what
    /// fusing would keep on chip. In a fusion window this is the first kernel's
    /// memory, and the window runs its kernels as they are submitted; in a recorded
    /// graph, the whole chain's ([`WindowThresholds::judge_chain`]), and the chain's
    /// kernels stay unfused.
    #[error("promotes no accessor and touches {bytes} bytes of global memory, fewer than the {min_bytes} from which fusing pays on its device")]
    CacheResident {
        /// The bytes its accessors' ranges cover.
        bytes: u64,
        /// The device's threshold.
        min_bytes: u64,
    },
}

/// Why a promotion hint was not followed (the buffer stays in global memory).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PromotionMismatch {
    /// Some accessors of the buffer carry no hint (none + anything = none).
    NotAllPromoted,
    /// Some accessors ask for local and others for private memory.
    LocalAndPrivate,
    /// Local promotion of an accessor in a kernel without a work-group size.
    NoWorkGroupSize {
        /// The kernel.
        kernel: String,
    },
    /// The accessors cover different ranges of the buffer.
    DifferentRanges,
    /// The promoted size (elements / work-groups or / work-items) is not whole, or not
    /// the same for every kernel using the buffer.
    Sizes,
    /// A kernel reaches the buffer through accesses the compiler cannot rewrite to
    /// the internal buffer (its pointer is stored, compared, passed to a call, or
    /// merged with another buffer's): keeping the buffer in global memory is
    /// correct where a guessed rewrite might not be.
    AccessNotRewritable {
        /// The kernel.
        kernel: String,
    },
}

/// Something fusion did differently from what was asked, without failing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FusionWarning {
    /// A buffer's promotion hint was dropped.
    PromotionDropped {
        /// The buffer.
        buffer: u64,
        /// Why.
        reason: PromotionMismatch,
    },
}

impl std::fmt::Display for FusionWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FusionWarning::PromotionDropped { buffer, reason } => {
                write!(f, "buffer {buffer} is not internalized: ")?;
                match reason {
                    PromotionMismatch::NotAllPromoted => write!(f, "not every accessor asks for promotion"),
                    PromotionMismatch::LocalAndPrivate => {
                        write!(f, "accessors ask for local and for private")
                    }
                    PromotionMismatch::NoWorkGroupSize { kernel } => {
                        write!(f, "kernel `{kernel}` has no work-group size for local memory")
                    }
                    PromotionMismatch::DifferentRanges => write!(f, "accessors cover different ranges"),
                    PromotionMismatch::Sizes => write!(f, "the promoted sizes differ or are not whole"),
                    PromotionMismatch::AccessNotRewritable { kernel } => {
                        write!(f, "kernel `{kernel}` accesses it in a way that cannot be internalized")
                    }
                }
            }
        }
    }
}

/// An argument of the fused kernel: the union of the slots on one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedArg {
    /// The buffer.
    pub buffer: u64,
    /// First byte of the union (hull) of the slots' ranges.
    pub start: usize,
    /// One past its last byte.
    pub end: usize,
    /// The slots it stands for: (kernel index, slot).
    pub uses: SmallVec<[(u32, u32); 2]>,
}

/// A buffer the fused kernel keeps in scratch memory instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InternalArg {
    /// The buffer.
    pub buffer: u64,
    /// Local or private.
    pub kind: Promotion,
    /// Bytes per work-group (local) or per work-item (private).
    pub bytes: usize,
    /// The slots it stands for: (kernel index, slot).
    pub uses: SmallVec<[(u32, u32); 2]>,
}

/// A fused kernel and how to call it.
#[derive(Clone, Debug)]
pub struct Fused {
    /// The kernel; its global slots are `args`, in order.
    pub kernel: KernelRef,
    /// The fused grid.
    pub geometry: Geometry,
    /// Its scalar arguments, laid out by its signature.
    pub scalars: ScalarBlock,
    /// Its arguments, one per buffer kept in global memory (inline up to four: a
    /// fusion from the cache allocates no list of its own).
    pub args: SmallVec<[FusedArg; 4]>,
    /// The internalized buffers (not arguments; not written back).
    pub internal: SmallVec<[InternalArg; 2]>,
    /// What was not done as asked.
    pub warnings: Vec<FusionWarning>,
    /// Whether the plan came from the cache.
    pub cached: bool,
    /// Which arguments a failed launch of the fused kernel keeps written, for the
    /// scheduler's failure rules; `None` when a failure keeps none.
    pub kept_on_failure: Option<Arc<dyn KeptOnFailure>>,
}

/// What a fused kernel's failed launch kept: a driver may run the listed kernels
/// one by one after the fused form failed, so that the ones that succeed keep their
/// results, as they would have unfused.
pub trait KeptOnFailure: Send + Sync + std::fmt::Debug {
    /// Whether the last failed launch left fused argument `arg` holding what its
    /// kernels wrote.
    fn kept(&self, arg: usize) -> bool;
}

/// Turns a fusion list into one kernel. The closure compiler is `gantry_host`'s
/// `ClosureFusion`; an LLVM JIT plugs in here for kernels with an IR image. A device's compilers are
/// tried in turn ([`Driver::fusion_compilers`](crate::Driver::fusion_compilers)):
/// the first whose [`image_kind`](FusionCompiler::image_kind) every listed kernel
/// has fuses the list.
pub trait FusionCompiler: Send + Sync {
    /// The image kind it fuses: it is asked only for kernels that all have one.
    fn image_kind(&self) -> ImageKind;
    /// Fuses the request's kernels, in order.
    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError>;
}
