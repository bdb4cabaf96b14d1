//! Kernel fusion (the DPC++ kernel-fusion design, "Fusion Process"): what the scheduler
//! hands a fusion compiler, the ND-range rules and work-item remapping,
//! internalization, and the compiler for closure kernels.
//!
//! The scheduler describes the listed kernels in a [`FusionRequest`]: each kernel with
//! its geometry and one [`FusionArg`] per accessor slot (buffer, byte range, element
//! size, promotion hint). A [`FusionCompiler`] answers with a [`Fused`] kernel —
//! its geometry, its arguments (one per buffer, the *identical-argument groups* of the
//! seed: every slot of every kernel on one buffer is passed once) and the buffers it
//! internalized — or a [`FusionError`] naming why the kernels cannot be fused.
//!
//! [`ClosureFusion`] fuses closure kernels: the fused kernel runs, per work-group,
//! each kernel's phases in list order (the group barrier between phases is the barrier
//! fusion inserts), or, without barriers, each work-item's bodies back to back. Its
//! plans are cached by the kernels' code, ranges and argument layout, so fusing the
//! same chain every frame costs a lookup; the cache holds a bounded number of plans
//! and evicts the least recently used one first
//! ([`ClosureFusion::with_capacity`]). Scalars are baked in already: a closure
//! captures its arguments by value, so the runtime constants that the DPC++
//! kernel-fusion design propagates have nothing left to propagate here; the LLVM JIT
//! will take them through this same request.
//!
//! ```
//! use std::sync::Arc;
//! use gantry_driver::fusion::{ClosureFusion, FusionArg, FusionCompiler, FusionKernel, FusionRequest};
//! use gantry_driver::{phase, AccessMode, Accessor, Arena, Binding, ClosureKernel, Geometry, ItemCost, Range, ReadWrite};
//!
//! // Two kernels over one buffer: x = x + 1, then x = x * 2.
//! let kernel = |tag: u64, f: fn(u32) -> u32| {
//!     let acc = Accessor::<u32, ReadWrite>::new(0, tag, 8);
//!     let closure = ClosureKernel {
//!         tag,
//!         phases: smallvec::smallvec![phase(move |it| {
//!             let i = it.global_linear_id();
//!             acc.set(it, i, f(acc.get(it, i)))
//!         })],
//!         global_slots: 1,
//!         scratch: vec![],
//!         unfused: None,
//!     };
//!     closure.into_kernel("step", [AccessMode::ReadWrite], ItemCost::default())
//! };
//! let geometry = Geometry::for_range(Range::d1(8)).unwrap();
//! let arg = FusionArg::new(1, 0..32, 4);
//! let request = FusionRequest {
//!     kernels: vec![
//!         FusionKernel {
//!             kernel: kernel(1, |x| x + 1),
//!             geometry,
//!             args: smallvec::smallvec![arg.clone()],
//!             deps: smallvec::smallvec![],
//!             scalars: Default::default(),
//!         },
//!         // It depends on the first kernel (through the buffer).
//!         FusionKernel {
//!             kernel: kernel(2, |x| x * 2),
//!             geometry,
//!             args: smallvec::smallvec![arg],
//!             deps: smallvec::smallvec![0],
//!             scalars: Default::default(),
//!         },
//!     ],
//!     barriers: true,
//! };
//! let fused = ClosureFusion::new().fuse(&request).unwrap();
//! assert_eq!(fused.args.len(), 1, "one argument per buffer");
//! let mut data = [1u32; 8];
//! let globals = [Binding::new(data.as_mut_ptr().cast(), 32)];
//! fused.kernel.closure().unwrap().run_group(&fused.geometry, 0, &globals, &mut Arena::default());
//! assert_eq!(data, [4; 8]);
//! ```

use rustc_hash::{FxHashMap, FxHasher};
use std::any::TypeId;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use crate::access::AccessMode;
use crate::closure::{
    ClosureKernel, Elementwise, ElementwisePhase, ItemCost, Phase, ResolvedMap, Scratch, ScratchKind,
};
use crate::elementwise::contiguous_run;
use crate::error::ExecError;
use crate::image::ImageKind;
use crate::item::GroupCtx;
use crate::kernel::{KernelRef, ScalarBlock};
use crate::memory::{Binding, HostStorage, Internal};
use crate::op::SnapshotPool;
use crate::range::{Geometry, NdRange, Range};

/// A hint that a buffer's contents are only needed inside the fused kernel (the DPC++
/// kernel-fusion design, "Internalization Behavior"): the user asserts each element is
/// touched by one work-group (local) or one work-item (private), and that the contents
/// are not needed afterwards. They are then not written back.
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
    fn bytes(&self) -> usize {
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
    /// them fails it. Only [`Unfused::rerun`] reads them, so that a failed fused
    /// kernel keeps what the kernels would have kept unfused.
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

/// Turns a fusion list into one kernel. The closure compiler is [`ClosureFusion`];
/// an LLVM JIT plugs in here for kernels with an IR image. A device's compilers are
/// tried in turn ([`Driver::fusion_compilers`](crate::Driver::fusion_compilers)):
/// the first whose [`image_kind`](FusionCompiler::image_kind) every listed kernel
/// has fuses the list.
pub trait FusionCompiler: Send + Sync {
    /// The image kind it fuses: it is asked only for kernels that all have one.
    fn image_kind(&self) -> ImageKind;
    /// Fuses the request's kernels, in order.
    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError>;
}

/// The closure image of a kernel [`ClosureFusion::fuse`] has checked.
fn closure_of(kernel: &KernelRef) -> &ClosureKernel {
    kernel.closure().expect("checked by ClosureFusion::fuse")
}

/// Where a kernel's accessor slot points inside the fused kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotSource {
    /// Bytes `offset..offset + len` of fused argument `index`.
    Arg { index: u32, offset: usize, len: usize },
    /// Internal (scratch) buffer `index`.
    Internal { index: u32 },
}

/// Everything about a fusion that does not depend on the kernels' captured data or
/// the buffers' identities: computed once per distinct chain and cached.
#[derive(Debug)]
struct Plan {
    geometry: Geometry,
    /// Per kernel: whether its ids are remapped from the fused grid.
    remap: Vec<bool>,
    /// Per kernel: whether it may run span by span with its neighbours (see
    /// [`streams`] and [`FusedBody::stream`]).
    streams: Vec<bool>,
    /// Per fused argument: (canonical buffer, start, end, uses).
    args: Vec<(usize, usize, usize, Uses)>,
    /// Per internal buffer: (canonical buffer, kind, bytes, uses).
    internal: Vec<(usize, Promotion, usize, Uses)>,
    /// Per internal buffer: the bytes of its slots' range (every slot on it has the
    /// same), which [`Unfused::rerun`] gives the kernels as memory of their own.
    internal_len: Vec<usize>,
    /// Per kernel, per slot, in one table: kernel `k`'s slots are
    /// `slots[slot_start[k]..slot_start[k + 1]]`.
    slots: Vec<SlotSource>,
    slot_start: Vec<usize>,
    /// Per kernel: index of its first own scratch slot in the fused kernel's scratch.
    scratch_base: Vec<usize>,
    scratch: Vec<Scratch>,
    cost: ItemCost,
    /// Warnings, with canonical buffer numbers.
    warnings: Vec<(usize, PromotionMismatch)>,
}

impl Plan {
    /// Whether a slot of a kernel in the streamed run `parts` is a span-local
    /// intermediate: private memory (one element per work-item) that only kernels of
    /// the run bind and that the first of them writes whole (so it is never cleared
    /// for a group). Streamed, each of its elements is written and read within one
    /// span, so every span can use the same span of the region: the chain's
    /// intermediates stay in the few kilobytes of L1 a span needs, where walking the
    /// group's region (16 KiB per intermediate in a group of 4,096, 256 KiB in one of
    /// 65,536) would send them to L2 and back between spans once a chain has several
    /// (figures: `docs/PERFORMANCE.md`).
    fn span_local(&self, source: SlotSource, parts: &std::ops::Range<usize>) -> bool {
        let SlotSource::Internal { index } = source else { return false };
        let (_, kind, _, uses) = &self.internal[index as usize];
        *kind == Promotion::Private
            && !self.scratch[index as usize].zeroed
            && uses.iter().all(|&(k, _)| parts.contains(&(k as usize)))
    }
}

/// Which slots an argument stands for: (kernel index, slot).
type Uses = SmallVec<[(u32, u32); 2]>;

/// One item of a plan's cache key. A request's key is the sequence [`key_parts`]
/// yields: the barrier flag, then per kernel its shape, its phases' code (with what
/// an elementwise phase touches), its geometry, its scratch, and per slot the
/// canonical buffer, byte range, element size and promotion. A lookup hashes and
/// collects that sequence on the stack, so a cache hit allocates nothing. (Hashed in
/// part, by [`key_hash`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyPart {
    Barriers(bool),
    Kernel { phases: usize, scratch: usize, slots: usize },
    Phase(TypeId, Option<Elementwise>),
    Geometry(Geometry),
    Scratch(Scratch),
    Slot { buffer: usize, start: usize, end: usize, elem_size: usize, promotion: Promotion },
}

/// The request's cache key, buffers numbered by `buffers` (see [`KeyPart`]), written
/// into `key`. (Plain loops: the same sequence as a chain of iterators costs several
/// times the instructions, a good part of a cache hit; figures: `docs/PERFORMANCE.md`.)
fn key_parts(request: &FusionRequest, buffers: &[u64], key: &mut SmallVec<[KeyPart; 16]>) {
    key.push(KeyPart::Barriers(request.barriers));
    for k in &request.kernels {
        let kernel = closure_of(&k.kernel);
        key.push(KeyPart::Kernel {
            phases: kernel.phases.len(),
            scratch: kernel.scratch.len(),
            slots: k.args.len(),
        });
        for p in &kernel.phases {
            key.push(KeyPart::Phase(p.code, p.elementwise.as_ref().map(|e| e.touches)));
        }
        key.push(KeyPart::Geometry(k.geometry));
        for &s in &kernel.scratch {
            key.push(KeyPart::Scratch(s));
        }
        for a in &k.args {
            let buffer = buffers.iter().position(|&x| x == a.buffer).expect("buffer numbered");
            key.push(KeyPart::Slot {
                buffer,
                start: a.start,
                end: a.end,
                elem_size: a.elem_size,
                promotion: a.promotion,
            });
        }
    }
}

/// The hash a key is filed under: its length, its phases' code and its slots' byte
/// ranges. Equal keys hash equally; keys that differ only elsewhere (geometry,
/// scratch, element sizes) share a bucket and are told apart by comparison, which
/// stops at the first differing part. Hashing every part, the 80-byte geometries
/// most of all, cost more than the comparison of a hit.
fn key_hash(key: &[KeyPart]) -> u64 {
    let mut h = FxHasher::default();
    h.write_usize(key.len());
    for part in key {
        match part {
            KeyPart::Phase(code, _) => code.hash(&mut h),
            KeyPart::Slot { start, end, .. } => {
                h.write_usize(*start);
                h.write_usize(*end);
            }
            _ => {}
        }
    }
    h.finish()
}

/// A cached plan, with the fused kernel's name for the kernel names it was last
/// asked for (names are not part of the key: the same code may run under others).
struct Cached {
    key: Box<[KeyPart]>,
    plan: Arc<Plan>,
    names: Vec<Arc<str>>,
    name: Arc<str>,
    /// The cache's tick when the plan was last inserted or hit: the plan with the
    /// smallest is the least recently used.
    used: u64,
}

/// `fused(a+b+…)` for the request's kernels.
fn fused_name(request: &FusionRequest) -> Arc<str> {
    let mut name = String::from("fused(");
    for (i, k) in request.kernels.iter().enumerate() {
        if i > 0 {
            name.push('+');
        }
        name.push_str(&k.kernel.name);
    }
    name.push(')');
    name.into()
}

/// Numbers the request's buffers in order of first appearance.
fn canonical_buffers(request: &FusionRequest) -> SmallVec<[u64; 8]> {
    let mut order = SmallVec::new();
    for a in request.kernels.iter().flat_map(|k| &k.args) {
        if !order.contains(&a.buffer) {
            order.push(a.buffer);
        }
    }
    order
}

fn range_of(dims: usize, e: [usize; 3]) -> Range {
    match dims {
        1 => Range::d1(e[0]),
        2 => Range::d2(e[0], e[1]),
        _ => Range::d3(e[0], e[1], e[2]),
    }
}

/// The fused grid (the DPC++ kernel-fusion design, "Fusing kernels with different
/// nd-ranges"): the largest kernel's global range, with the common work-group size if
/// any kernel has one; and per kernel whether its ids must be mapped from the grid.
fn fused_geometry(kernels: &[FusionKernel]) -> Result<(Geometry, Vec<bool>), FusionError> {
    let name = |k: &FusionKernel| k.kernel.name.to_string();
    let first = kernels.first().ok_or(FusionError::Empty)?;
    let offset = first.geometry.offset();
    for k in kernels {
        if k.geometry.offset() != offset {
            return Err(FusionError::DifferentOffsets {
                kernel: name(k),
                offset: k.geometry.offset(),
                fused: offset,
            });
        }
    }
    let nd = kernels.iter().find(|k| k.geometry.is_nd());
    if let Some(n) = nd {
        for k in kernels.iter().filter(|k| k.geometry.is_nd()) {
            if k.geometry.local_range() != n.geometry.local_range() {
                return Err(FusionError::DifferentLocalSizes {
                    first: name(n),
                    first_local: n.geometry.local_range(),
                    second: name(k),
                    second_local: k.geometry.local_range(),
                });
            }
        }
    }
    // The largest launch; the first of equals.
    let big =
        kernels
            .iter()
            .fold(first, |a, k| if k.geometry.global_size() > a.geometry.global_size() { k } else { a });
    let geometry = match nd {
        None => Geometry::for_range_with_offset(
            range_of(big.geometry.dims(), big.geometry.global_range()),
            offset,
        )
        .expect("a valid kernel's range is valid"),
        Some(n) => {
            if big.geometry.dims() != n.geometry.dims() {
                return Err(FusionError::DifferentDimensions {
                    kernel: name(n),
                    dims: n.geometry.dims(),
                    fused_dims: big.geometry.dims(),
                });
            }
            let dims = n.geometry.dims();
            let nd_range = NdRange {
                global: range_of(dims, big.geometry.global_range()),
                local: range_of(dims, n.geometry.local_range()),
                offset,
            };
            nd_range.geometry().map_err(|_| FusionError::NonUniformWorkGroups {
                global: big.geometry.global_range(),
                local: n.geometry.local_range(),
            })?
        }
    };
    let mut remap = Vec::with_capacity(kernels.len());
    for k in kernels {
        let (own, grid) = (k.geometry.global_range(), geometry.global_range());
        // Ids need real remapping (not just skipping work-items past the kernel's
        // range) when the shape differs beyond the slowest dimension.
        let reshaped = k.geometry.dims() != geometry.dims() || own[1..] != grid[1..];
        if reshaped && k.geometry.is_nd() {
            return Err(if k.geometry.dims() != geometry.dims() {
                FusionError::DifferentDimensions {
                    kernel: name(k),
                    dims: k.geometry.dims(),
                    fused_dims: geometry.dims(),
                }
            } else {
                FusionError::DifferentGlobalSizes { kernel: name(k), global: own, fused: grid }
            });
        }
        if reshaped && offset != [0; 3] {
            return Err(FusionError::DifferentOffsets { kernel: name(k), offset, fused: [0; 3] });
        }
        // Any other shape (a plain range's driver-chosen groups included) is run through
        // the grid's work-items.
        remap.push(
            own != grid
                || k.geometry.dims() != geometry.dims()
                || k.geometry.local_range() != geometry.local_range(),
        );
    }
    Ok((geometry, remap))
}

/// Decides whether the slots `uses` on one buffer can be internalized, and how large
/// the scratch is: bytes per work-group (local) or per work-item (private).
fn promotion_of(
    kernels: &[FusionKernel],
    uses: &[(u32, u32)],
) -> Result<Option<(Promotion, usize)>, PromotionMismatch> {
    let arg = |&(k, s): &(u32, u32)| &kernels[k as usize].args[s as usize];
    let hints: SmallVec<[Promotion; 4]> = uses.iter().map(|u| arg(u).promotion).collect();
    if hints.iter().all(|&h| h == Promotion::None) {
        return Ok(None);
    }
    if hints.contains(&Promotion::None) {
        return Err(PromotionMismatch::NotAllPromoted);
    }
    if hints.contains(&Promotion::Local) && hints.contains(&Promotion::Private) {
        return Err(PromotionMismatch::LocalAndPrivate);
    }
    let kind = hints[0];
    let first = arg(&uses[0]);
    let mut size = None;
    for u in uses {
        let a = arg(u);
        if (a.start, a.end) != (first.start, first.end) {
            return Err(PromotionMismatch::DifferentRanges);
        }
        let g = &kernels[u.0 as usize].geometry;
        let parts = match kind {
            Promotion::Local if !g.is_nd() => {
                return Err(PromotionMismatch::NoWorkGroupSize {
                    kernel: kernels[u.0 as usize].kernel.name.to_string(),
                })
            }
            Promotion::Local => g.group_count(),
            _ => g.global_size(),
        };
        let bytes = a.bytes();
        let elem = a.elem_size.max(1);
        if !bytes.is_multiple_of(parts) || !(bytes / parts).is_multiple_of(elem) || bytes / parts == 0 {
            return Err(PromotionMismatch::Sizes);
        }
        if *size.get_or_insert(bytes / parts) != bytes / parts {
            return Err(PromotionMismatch::Sizes);
        }
    }
    Ok(Some((kind, size.expect("at least one use"))))
}

fn plan(request: &FusionRequest, buffers: &[u64]) -> Result<Plan, FusionError> {
    let kernels = &request.kernels;
    let (geometry, remap) = fused_geometry(kernels)?;
    let mut slots: Vec<Vec<SlotSource>> =
        kernels.iter().map(|k| vec![SlotSource::Internal { index: u32::MAX }; k.args.len()]).collect();
    let (mut args, mut internal, mut warnings) = (Vec::new(), Vec::new(), Vec::new());
    let mut internal_len = Vec::new();
    let mut scratch = Vec::new();
    for (canon, &buffer) in buffers.iter().enumerate() {
        let uses: SmallVec<[(u32, u32); 2]> = kernels
            .iter()
            .enumerate()
            .flat_map(|(k, kd)| {
                kd.args
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.buffer == buffer)
                    .map(move |(s, _)| (k as u32, s as u32))
            })
            .collect();
        match promotion_of(kernels, &uses) {
            Ok(Some((kind, bytes))) => {
                let index = internal.len() as u32;
                for &(k, s) in &uses {
                    slots[k as usize][s as usize] = SlotSource::Internal { index };
                }
                let scratch_kind =
                    if kind == Promotion::Local { ScratchKind::Local } else { ScratchKind::Private };
                scratch.push(Scratch::new(scratch_kind, bytes));
                let (k, s) = uses[0];
                internal_len.push(kernels[k as usize].args[s as usize].bytes());
                internal.push((canon, kind, bytes, uses));
                continue;
            }
            Ok(None) => {}
            Err(reason) => warnings.push((canon, reason)),
        }
        let arg = |&(k, s): &(u32, u32)| &kernels[k as usize].args[s as usize];
        let start = uses.iter().map(|u| arg(u).start).min().expect("a buffer has a use");
        let end = uses.iter().map(|u| arg(u).end).max().expect("a buffer has a use");
        let index = args.len() as u32;
        for u in &uses {
            let a = arg(u);
            slots[u.0 as usize][u.1 as usize] =
                SlotSource::Arg { index, offset: a.start - start, len: a.bytes() };
        }
        args.push((canon, start, end, uses));
    }
    let mut scratch_base = Vec::with_capacity(kernels.len());
    let mut cost = ItemCost { ns: 0.0, default_items: 0.0 };
    let grid_size = geometry.global_size() as f64;
    for k in kernels {
        scratch_base.push(scratch.len());
        scratch.extend(closure_of(&k.kernel).scratch.iter().copied());
        let share = k.geometry.global_size() as f64 / grid_size;
        cost.ns += k.kernel.cost.ns * share;
        cost.default_items += k.kernel.cost.default_items * share;
    }
    for (index, region) in scratch.iter_mut().take(internal.len()).enumerate() {
        region.zeroed = !written_first(kernels, &remap, &slots, index as u32, region);
    }
    let mut slot_start = vec![0];
    slot_start.extend(slots.iter().scan(0, |end, s| {
        *end += s.len();
        Some(*end)
    }));
    let streams = streams(kernels, &geometry, &remap, &slots, &internal, args.len());
    Ok(Plan {
        geometry,
        remap,
        streams,
        args,
        internal,
        internal_len,
        slots: slots.concat(),
        slot_start,
        scratch_base,
        scratch,
        cost,
        warnings,
    })
}

/// Which kernels may run span by span ([`FusedBody::stream`]): elementwise ones on
/// the 1-D fused grid's own ids (a kernel over another range is remapped: it skips
/// work-items, which only its own phase knows). Span order equals kernel order only
/// if element `i` is the same memory for every kernel that touches it, so none
/// streams when two elementwise slots see one fused argument at different offsets
/// or element sizes (a kernel reading `x[i + 100]` after one wrote `x[i]` depends on
/// a work-item a later span runs), or use local memory (shared across the group).
/// Private memory is each work-item's own.
fn streams(
    kernels: &[FusionKernel],
    grid: &Geometry,
    remap: &[bool],
    slots: &[Vec<SlotSource>],
    internal: &[(usize, Promotion, usize, Uses)],
    args: usize,
) -> Vec<bool> {
    let one_d = grid.global_range()[1..] == [1, 1];
    let candidates: Vec<Option<Elementwise>> =
        kernels.iter().zip(remap).map(|(k, &r)| elementwise(k).filter(|_| one_d && !r)).collect();
    let mut seen: Vec<Option<(usize, u16)>> = vec![None; args];
    for (k, e) in candidates.iter().enumerate() {
        let Some(e) = e else { continue };
        for (slot, bytes) in [(e.input, e.input_bytes), (e.output, e.output_bytes)] {
            let consistent = match slots[k][slot as usize] {
                SlotSource::Arg { index, offset, .. } => {
                    *seen[index as usize].get_or_insert((offset, bytes)) == (offset, bytes)
                }
                SlotSource::Internal { index } => internal[index as usize].1 != Promotion::Local,
            };
            if !consistent {
                return vec![false; kernels.len()];
            }
        }
    }
    candidates.iter().map(Option::is_some).collect()
}

/// The single elementwise phase of a kernel that has one.
fn elementwise(kernel: &FusionKernel) -> Option<Elementwise> {
    match closure_of(&kernel.kernel).phases.as_slice() {
        [phase] => phase.elementwise.as_ref().map(|e| e.touches),
        _ => None,
    }
}

/// Whether internal buffer `index` (private, in `region`) is written whole before
/// anything reads it: the first kernel that binds it is an elementwise kernel over
/// the whole grid whose output fills each work-item's region and whose input is
/// another buffer. Then the region need not be cleared for every group.
fn written_first(
    kernels: &[FusionKernel],
    remap: &[bool],
    slots: &[Vec<SlotSource>],
    index: u32,
    region: &Scratch,
) -> bool {
    let internal = SlotSource::Internal { index };
    let Some(k) = slots.iter().position(|s| s.contains(&internal)) else { return false };
    let Some(e) = elementwise(&kernels[k]) else { return false };
    region.kind == ScratchKind::Private
        && !remap[k]
        && usize::from(e.output_bytes) == region.bytes
        && slots[k].get(e.output as usize) == Some(&internal)
        && slots[k].get(e.input as usize) != Some(&internal)
}

impl SlotSource {
    /// The slot's binding for one group, from the fused kernel's arguments and
    /// scratch and the plan's internal buffers.
    #[inline]
    fn bind(
        self,
        globals: &[Binding],
        scratch: &[Binding],
        internal: &[(usize, Promotion, usize, Uses)],
    ) -> Binding {
        match self {
            SlotSource::Arg { index, offset, len } => {
                let b = globals[index as usize];
                // SAFETY: the fused argument is the hull of this slot's range.
                Binding::new(unsafe { b.ptr.add(offset) }, len)
            }
            SlotSource::Internal { index } => {
                // `len` 0: every access takes the mapped (`i % n`) path.
                let (_, kind, wrap, _) = internal[index as usize];
                let internal = if kind == Promotion::Local { Internal::Local } else { Internal::Private };
                Binding { ptr: scratch[index as usize].ptr, len: 0, internal, wrap }
            }
        }
    }
}

/// One kernel inside a fused kernel.
struct Part {
    kernel: KernelRef,
    /// The ids and ranges its work-items see.
    geometry: Geometry,
    /// The earlier parts it depends on ([`FusionKernel::deps`]).
    deps: SmallVec<[u32; 2]>,
}

impl Part {
    #[inline]
    fn closure(&self) -> &ClosureKernel {
        closure_of(&self.kernel)
    }
}

/// The body of a fused closure kernel: the kernels and the (cached) plan that says
/// where their slots point.
struct FusedBody {
    parts: SmallVec<[Part; 4]>,
    plan: Arc<Plan>,
    barriers: bool,
    /// Per part, whether the last [`Unfused::rerun`] completed it (`None` before one).
    completed: Mutex<Option<SmallVec<[bool; 8]>>>,
}

impl FusedBody {
    fn run_group(&self, grid: &GroupCtx<'_>) {
        let plan = &*self.plan;
        // Every kernel's bindings, in one table built once per group.
        let mut table: SmallVec<[Binding; 16]> = SmallVec::from_elem(Binding::EMPTY, plan.slots.len());
        for (binding, s) in table.iter_mut().zip(&plan.slots) {
            *binding = s.bind(grid.bindings, grid.scratch, &plan.internal);
        }
        let ctx = |k: usize| {
            let (part, base) = (&self.parts[k], plan.scratch_base[k]);
            GroupCtx {
                geometry: &part.geometry,
                remap: plan.remap[k].then_some(grid.geometry),
                group: grid.group,
                bindings: &table[plan.slot_start[k]..plan.slot_start[k + 1]],
                scratch: &grid.scratch[base..base + part.closure().scratch.len()],
                tag: part.closure().tag,
                only: None,
                span: None,
            }
        };
        let streams = |from: usize| plan.streams[from..].iter().take_while(|&&s| s).count();
        let interleave =
            |p: &Part| !self.barriers && p.closure().phases.len() == 1 && p.closure().phases[0].per_item;
        let mut k = 0;
        while k < self.parts.len() {
            let run = streams(k);
            if run > 1 {
                self.stream(grid, k..k + run, &table, &ctx);
                k += run;
                continue;
            }
            let run = self.parts[k..].iter().take_while(|p| interleave(p)).count();
            if run > 1 {
                // Without barriers: each work-item runs the single-phase kernels' bodies
                // back to back.
                let subs: SmallVec<[GroupCtx<'_>; 4]> = (k..k + run).map(ctx).collect();
                let ext = grid.extent();
                for i0 in 0..ext[0] {
                    for i1 in 0..ext[1] {
                        for i2 in 0..ext[2] {
                            for (sub, part) in subs.iter().zip(&self.parts[k..]) {
                                let one = GroupCtx { only: Some([i0, i1, i2]), ..*sub };
                                (part.closure().phases[0].group)(&one);
                            }
                        }
                    }
                }
                k += run;
                continue;
            }
            let sub = ctx(k);
            for phase in &self.parts[k].closure().phases {
                (phase.group)(&sub);
            }
            k += 1;
        }
    }

    /// Runs the elementwise kernels `parts` (whose plan entries stream) span by
    /// span: each kernel over a span of work-items ([`span_within`] of
    /// [`isa::stream_span`](crate::isa::stream_span)), then the next kernel over the
    /// same ones, then the next span. Work-item `i` of each touches only element
    /// `i`, so this gives what kernel after kernel over the whole group gives,
    /// barriers or not. Where every kernel's input and output are one run over the
    /// group, each span is one call of the kernel's loop, resolved once per group
    /// ([`MapLoop::resolve`](crate::MapLoop::resolve)); otherwise each kernel's phase
    /// runs with [`GroupCtx::span`] set.
    ///
    /// Why spans: a chain run kernel after kernel over a whole group reads its input
    /// and writes its output in bursts between passes over the intermediates, and
    /// the hardware prefetcher, which follows a steady stream, misses the start of
    /// each burst; short spans, with the memory [`PREFETCH_AHEAD`] bytes on requested
    /// first where that pays, stream like one loop (figures: `docs/PERFORMANCE.md`).
    fn stream<'a>(
        &self,
        grid: &GroupCtx<'_>,
        parts: std::ops::Range<usize>,
        table: &[Binding],
        ctx: &impl Fn(usize) -> GroupCtx<'a>,
    ) {
        let plan = &*self.plan;
        let (base, ext) = (grid.base()[0], grid.extent()[0]);
        let mut runs: SmallVec<[StreamRun; 8]> = SmallVec::new();
        let mut calls: SmallVec<[SpanCall<'_>; 8]> = SmallVec::new();
        // Bytes per work-item of the span-local intermediates (each counted where it
        // is written), which a span keeps in L1.
        let mut local_bytes = 0;
        for k in parts.clone() {
            let phase = self.parts[k].closure().phases[0].elementwise.as_ref();
            let ElementwisePhase { touches: e, map } = phase.expect("a streaming kernel is elementwise");
            let e = *e;
            let own = &table[plan.slot_start[k]..plan.slot_start[k + 1]];
            let (input, output) = (own[e.input as usize], own[e.output as usize]);
            let src = contiguous_run(input, base, 0, ext, e.input_bytes.into());
            let dst = contiguous_run(output, base, 0, ext, e.output_bytes.into());
            // A span-local intermediate lives in the region's first span: every span
            // starts there.
            let step = |slot: u16, bytes: u16| {
                let local = plan.span_local(plan.slots[plan.slot_start[k] + usize::from(slot)], &parts);
                if local {
                    0
                } else {
                    usize::from(bytes)
                }
            };
            let dst_step = step(e.output, e.output_bytes);
            if dst_step == 0 {
                local_bytes += usize::from(e.output_bytes);
            }
            if let Some((src, dst)) = src.zip(dst) {
                let src_step = step(e.input, e.input_bytes);
                calls.push(SpanCall { map: map.resolve(), src, dst, src_step, dst_step });
            }
            runs.push(StreamRun { input, output, e });
        }
        let contiguous = calls.len() == runs.len();
        let prefetch = crate::isa::stream_prefetch();
        let span = span_within(crate::isa::stream_span(), local_bytes);
        for lo in (0..ext).step_by(span) {
            let count = span.min(ext - lo);
            if prefetch {
                let mut previous_output = std::ptr::null_mut();
                for r in &runs {
                    if r.input.ptr != previous_output {
                        prefetch_ahead(r.input, base + lo, count, r.e.input_bytes.into(), false);
                    }
                    prefetch_ahead(r.output, base + lo, count, r.e.output_bytes.into(), true);
                    previous_output = r.output.ptr;
                }
            }
            if contiguous {
                for c in &calls {
                    // SAFETY: `contiguous_run` found `ext` elements at `src` and `dst`
                    // for the group; this span is `lo..lo + count` of them (or, for a
                    // span-local intermediate, the first `count`). The output run is
                    // the group's own elements of the kernel's element accessor, as in
                    // `map_phase`.
                    unsafe { c.map.run(c.src.add(lo * c.src_step), c.dst.add(lo * c.dst_step), count) };
                }
            } else {
                // Some run is not contiguous (an internalized region of another
                // shape): each kernel's own phase over the span, per work-item.
                for k in parts.clone() {
                    let sub = GroupCtx { span: Some((lo, lo + count)), ..ctx(k) };
                    (self.parts[k].closure().phases[0].group)(&sub);
                }
            }
        }
    }
}

/// The kernels a fused closure kernel stands for, and where its arguments bind
/// their slots ([`ClosureKernel::unfused`]): what a driver needs to run them one by
/// one when the fused kernel fails ([`Unfused::rerun`]), so that the failure keeps
/// exactly the results the kernels would have kept unfused.
#[derive(Clone)]
pub struct Unfused(Arc<FusedBody>);

impl std::fmt::Debug for Unfused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.0.parts.iter().map(|p| &*p.kernel.name).collect();
        f.debug_tuple("Unfused").field(&names).finish()
    }
}

impl Unfused {
    /// How many kernels the fused kernel stands for.
    pub fn len(&self) -> usize {
        self.0.parts.len()
    }

    /// Whether it stands for none (never, for a kernel [`ClosureFusion`] built).
    pub fn is_empty(&self) -> bool {
        self.0.parts.is_empty()
    }

    /// Runs the kernels of a fused kernel that failed one by one, unfused, in list
    /// order, each over its own geometry and its own slots of the fused kernel's
    /// arguments, as the scheduler would have run them: a kernel whose dependency
    /// ([`FusionKernel::deps`]) failed or was skipped is skipped; one that fails has
    /// its writes undone (from a snapshot of its own); independent kernels keep
    /// theirs. An internalized buffer, which has no global memory, is zeroed memory
    /// of its range's size for the rerun, dropped after (internalized contents are
    /// not written back, as in the fused kernel).
    ///
    /// `globals` are the fused launch's bindings (one per argument), `writes(i)`
    /// whether argument `i` is bound writable (only those ranges are snapshotted),
    /// and `launch` runs one kernel over all its work-groups, its panic caught and
    /// returned as its error, leaving its writes.
    ///
    /// Returns `None`, having run nothing, if `globals` do not have the fused
    /// kernel's arguments' sizes or the internalized buffers' memory cannot be
    /// allocated; otherwise the first failed kernel's error, or success if every
    /// kernel ran (a failure only the fused form met).
    ///
    /// # Safety
    /// The bindings must be live and touched by nothing else during the call, and
    /// the fused kernel's writes must have been undone first (its snapshot
    /// restored): the kernels run again from the contents it started from.
    pub unsafe fn rerun(
        &self,
        globals: &[Binding],
        writes: impl Fn(usize) -> bool,
        snapshots: &Arc<SnapshotPool>,
        mut launch: impl FnMut(&KernelRef, &Geometry, &[Binding]) -> Result<(), ExecError>,
    ) -> Option<Result<(), ExecError>> {
        let FusedBody { parts, plan, .. } = &*self.0;
        let sized = |(g, (_, start, end, _)): (&Binding, &(usize, usize, usize, Uses))| g.len == end - start;
        if globals.len() != plan.args.len() || !globals.iter().zip(&plan.args).all(sized) {
            return None;
        }
        let internal: Option<Vec<HostStorage>> =
            plan.internal_len.iter().map(|&len| HostStorage::try_zeroed(len)).collect();
        let internal = internal?;
        let mut failed: SmallVec<[bool; 8]> = SmallVec::from_elem(false, parts.len());
        let mut first_error = None;
        for (k, part) in parts.iter().enumerate() {
            if part.deps.iter().any(|&d| failed.get(d as usize).copied().unwrap_or(false)) {
                failed[k] = true;
                continue;
            }
            let slots = &plan.slots[plan.slot_start[k]..plan.slot_start[k + 1]];
            let mut bindings: SmallVec<[Binding; 8]> = SmallVec::with_capacity(slots.len());
            let mut saved: SmallVec<[(AccessMode, Binding); 8]> = SmallVec::new();
            for &slot in slots {
                match slot {
                    SlotSource::Arg { index, offset, len } => {
                        let g = globals[index as usize];
                        // SAFETY: the fused argument (its size checked above) is the
                        // hull of this slot's range.
                        let b = Binding::new(unsafe { g.ptr.add(offset) }, len);
                        if writes(index as usize) {
                            saved.push((AccessMode::ReadWrite, b));
                        }
                        bindings.push(b);
                    }
                    SlotSource::Internal { index } => {
                        let m = &internal[index as usize];
                        bindings.push(Binding::new(m.as_ptr(), m.len()));
                    }
                }
            }
            // SAFETY: live bindings, touched by nothing else (the caller's contract).
            let snapshot = unsafe { snapshots.take_modes(saved) };
            if let Err(e) = launch(&part.kernel, &part.geometry, &bindings) {
                // SAFETY: the kernel has stopped; nothing else touches the ranges.
                unsafe { snapshot.restore() };
                failed[k] = true;
                first_error.get_or_insert(e);
            }
        }
        *self.0.completed.lock().expect("rerun outcome") = Some(failed.iter().map(|&f| !f).collect());
        Some(first_error.map_or(Ok(()), Err))
    }

    /// Whether the last [`Unfused::rerun`] completed a kernel bound to the fused
    /// kernel's argument `arg`: its range then holds what the kernels wrote (a failed
    /// kernel's writes undone), which a scheduler keeps although the fused command
    /// failed. False before any rerun, and for an argument no completed kernel binds.
    ///
    /// Its answer is the last rerun's: meaningful for a kernel launched once (a
    /// queue's fusion), read after that launch completed.
    pub fn kept(&self, arg: usize) -> bool {
        self.0.kept(arg)
    }
}

impl std::fmt::Debug for FusedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.parts.iter().map(|p| &*p.kernel.name).collect();
        f.debug_struct("FusedBody").field("kernels", &names).field("barriers", &self.barriers).finish()
    }
}

impl KeptOnFailure for FusedBody {
    fn kept(&self, arg: usize) -> bool {
        let completed = self.completed.lock().expect("rerun outcome");
        let (Some(completed), Some((.., uses))) = (completed.as_ref(), self.plan.args.get(arg)) else {
            return false;
        };
        uses.iter().any(|&(k, _)| completed.get(k as usize).copied().unwrap_or(false))
    }
}

/// One kernel of a streamed chain, for one group: its input and output bindings,
/// and what it touches of them.
struct StreamRun {
    input: Binding,
    output: Binding,
    e: Elementwise,
}

/// A streamed kernel's loop, when its input and output are each one run over the
/// group, and where its spans are: span `lo..lo + count` of the group maps `count`
/// elements from `src + lo * src_step` to `dst + lo * dst_step`. A step is the
/// element size, or 0 for a span-local intermediate ([`Plan::span_local`]), which
/// every span reads or writes at the region's start.
#[derive(Clone, Copy)]
struct SpanCall<'a> {
    map: ResolvedMap<'a>,
    src: *mut u8,
    dst: *mut u8,
    src_step: usize,
    dst_step: usize,
}

/// How many bytes a span's span-local intermediates may take: half of a 32 KiB L1
/// data cache, the rest left to the global input and output streaming through:
/// intermediates that spill to L2 between spans cost more than the shorter spans
/// (figures: `docs/PERFORMANCE.md`).
const SPAN_LOCAL_BUDGET: usize = 16 << 10;

/// The span a streamed chain runs: `span` (a power of two), halved while its
/// span-local intermediates, `local_bytes` per work-item, would take more than
/// [`SPAN_LOCAL_BUDGET`], down to 64 work-items.
fn span_within(span: usize, local_bytes: usize) -> usize {
    let mut span = span;
    while span > 64 && span * local_bytes > SPAN_LOCAL_BUDGET {
        span /= 2;
    }
    span
}

/// How far ahead of a span a streamed chain requests global memory (where it does:
/// [`isa::stream_prefetch`](crate::isa::stream_prefetch)): 32 KiB per stream (of
/// input or output), about what the hardware prefetcher runs ahead of a steady stream.
const PREFETCH_AHEAD: usize = 32 << 10;

/// Requests the cache lines of a span of `count` elements, `PREFETCH_AHEAD` bytes
/// on from element `first` of `b` (for writing if `write`), where `b` is ordinary
/// memory: internalized memory is already close.
#[inline]
fn prefetch_ahead(b: Binding, first: usize, count: usize, elem_bytes: usize, write: bool) {
    if b.internal != Internal::No {
        return;
    }
    let start = first * elem_bytes + PREFETCH_AHEAD;
    let end = (start + count * elem_bytes).min(b.len);
    for offset in (start..end).step_by(64) {
        prefetch(b.ptr.wrapping_add(offset), write);
    }
}

/// A cache-line prefetch hint (nothing where the architecture has none here).
#[inline(always)]
fn prefetch(p: *const u8, write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        if write {
            _mm_prefetch::<_MM_HINT_ET0>(p.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, write);
}

/// Counters of a [`ClosureFusion`]'s plan cache.
///
/// Non-exhaustive: read its fields; more counters may be added.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Fusions answered from the cache.
    pub hits: u64,
    /// Fusions planned anew.
    pub misses: u64,
    /// Plans evicted to keep the cache within its capacity.
    pub evictions: u64,
    /// Plans cached now (at most the capacity).
    pub len: usize,
}

/// The fusion compiler for closure kernels, with a plan cache bounded to a number
/// of plans ([`ClosureFusion::with_capacity`]).
pub struct ClosureFusion {
    /// The most plans `cache` keeps; 0 keeps none.
    capacity: usize,
    cache: Mutex<PlanCache>,
}

/// A [`ClosureFusion`]'s cached plans and counters (counted under the cache's lock,
/// which a fusion takes anyway: an atomic counter would add a locked operation).
///
/// Least recently used first out: a hit stamps its plan with the next tick (no
/// allocation, no reordering), and an insertion into a full cache scans the plans
/// for the oldest stamp. The scan is linear in the capacity but only runs on a miss,
/// which plans a chain anyway.
struct PlanCache {
    /// Plans by the Fx hash of their key (hashed on every fusion, hit or not; no
    /// untrusted keys here), equal hashes compared part by part.
    plans: FxHashMap<u64, SmallVec<[Cached; 1]>>,
    /// `stats.len` counts the plans in `plans`.
    stats: CacheStats,
    /// Advanced on every hit and insertion: the recency order of [`Cached::used`].
    tick: u64,
}

impl PlanCache {
    /// Removes the least recently used plan, if any.
    fn evict_oldest(&mut self) {
        let oldest = self
            .plans
            .iter()
            .flat_map(|(&hash, entries)| entries.iter().enumerate().map(move |(i, c)| (c.used, hash, i)))
            .min();
        let Some((_, hash, i)) = oldest else { return };
        let entries = self.plans.get_mut(&hash).expect("bucket of the oldest plan");
        entries.swap_remove(i);
        if entries.is_empty() {
            self.plans.remove(&hash);
        }
        self.stats.len -= 1;
        self.stats.evictions += 1;
    }
}

impl std::fmt::Debug for ClosureFusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClosureFusion")
            .field("capacity", &self.capacity)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for ClosureFusion {
    /// [`ClosureFusion::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl ClosureFusion {
    /// The plan capacity of [`ClosureFusion::new`]: room for the distinct chains a
    /// program fuses again and again, while a program that fuses ever new ranges
    /// holds a bounded amount of memory.
    pub const DEFAULT_CAPACITY: usize = 1_024;

    /// A compiler with an empty cache of [`ClosureFusion::DEFAULT_CAPACITY`] plans.
    pub fn new() -> Self {
        Self::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// A compiler with an empty cache that keeps at most `plans` plans, evicting the
    /// least recently used (planned or hit) one to make room for a new one. A
    /// capacity of 0 caches nothing: every fusion is planned anew.
    pub fn with_capacity(plans: usize) -> Self {
        let cache = PlanCache { plans: FxHashMap::default(), stats: CacheStats::default(), tick: 0 };
        Self { capacity: plans, cache: Mutex::new(cache) }
    }

    /// The most plans the cache keeps (0: caching is off).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The cache's counters so far, and the plans it holds now.
    pub fn stats(&self) -> CacheStats {
        self.cache.lock().expect("fusion cache").stats
    }

    /// The request's plan and fused kernel name, and whether the plan was cached.
    fn plan_for(
        &self,
        request: &FusionRequest,
        buffers: &[u64],
    ) -> Result<(Arc<Plan>, Arc<str>, bool), FusionError> {
        let mut key: SmallVec<[KeyPart; 16]> = SmallVec::new();
        key_parts(request, buffers, &mut key);
        let hash = key_hash(&key);
        let same_names =
            |names: &[Arc<str>]| names.iter().zip(&request.kernels).all(|(n, k)| *n == k.kernel.name);
        let mut guard = self.cache.lock().expect("fusion cache");
        let cache = &mut *guard;
        if let Some(hit) =
            cache.plans.get_mut(&hash).and_then(|entries| entries.iter_mut().find(|c| c.key[..] == key[..]))
        {
            cache.stats.hits += 1;
            cache.tick += 1;
            hit.used = cache.tick;
            if !same_names(&hit.names) {
                hit.names = request.kernels.iter().map(|k| k.kernel.name.clone()).collect();
                hit.name = fused_name(request);
            }
            return Ok((hit.plan.clone(), hit.name.clone(), true));
        }
        drop(guard);
        let plan = Arc::new(plan(request, buffers)?);
        let name = fused_name(request);
        // Built before the lock is taken again, so other fusions wait on none of it.
        let cached = (self.capacity > 0).then(|| Cached {
            key: key.into_iter().collect(),
            plan: plan.clone(),
            names: request.kernels.iter().map(|k| k.kernel.name.clone()).collect(),
            name: name.clone(),
            used: 0,
        });
        let mut guard = self.cache.lock().expect("fusion cache");
        let cache = &mut *guard;
        cache.stats.misses += 1;
        if let Some(mut cached) = cached {
            // (Another thread may have planned the same chain meanwhile.)
            let present =
                cache.plans.get(&hash).is_some_and(|entries| entries.iter().any(|c| c.key == cached.key));
            if !present {
                if cache.stats.len >= self.capacity {
                    cache.evict_oldest();
                }
                cache.tick += 1;
                cached.used = cache.tick;
                cache.plans.entry(hash).or_default().push(cached);
                cache.stats.len += 1;
            }
        }
        Ok((plan, name, false))
    }
}

impl FusionCompiler for ClosureFusion {
    fn image_kind(&self) -> ImageKind {
        ImageKind::Closure
    }

    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError> {
        if let Some(k) = request.kernels.iter().find(|k| k.kernel.closure().is_none()) {
            return Err(FusionError::MissingImage {
                kernel: k.kernel.name.to_string(),
                kind: ImageKind::Closure,
            });
        }
        let buffers = canonical_buffers(request);
        let (plan, name, cached) = self.plan_for(request, &buffers)?;
        // Plain loops: collecting these short lists through `SmallVec`'s `extend` cost
        // more than the pushes themselves (a cache hit builds all of them).
        let mut parts = SmallVec::new();
        for k in &request.kernels {
            parts.push(Part { kernel: k.kernel.clone(), geometry: k.geometry, deps: k.deps.clone() });
        }
        let mut args = SmallVec::new();
        for (c, start, end, uses) in &plan.args {
            args.push(FusedArg { buffer: buffers[*c], start: *start, end: *end, uses: uses.clone() });
        }
        let mut internal = SmallVec::new();
        for (c, kind, bytes, uses) in &plan.internal {
            internal.push(InternalArg {
                buffer: buffers[*c],
                kind: *kind,
                bytes: *bytes,
                uses: uses.clone(),
            });
        }
        let warnings = plan
            .warnings
            .iter()
            .map(|(c, reason)| FusionWarning::PromotionDropped {
                buffer: buffers[*c],
                reason: reason.clone(),
            })
            .collect();
        let (global_slots, scratch, cost, geometry) =
            (plan.args.len(), plan.scratch.clone(), plan.cost, plan.geometry);
        // The closure and the kernel's fallback share the body, and the body owns the
        // plan.
        // Each argument's mode in the fused kernel's signature: whether any slot on it
        // reads, and whether any writes.
        let modes = args.iter().map(|a: &FusedArg| {
            let mode = |&(k, s): &(u32, u32)| {
                let sig = &request.kernels[k as usize].kernel.signature;
                sig.globals.get(s as usize).copied().unwrap_or(AccessMode::ReadWrite)
            };
            let (reads, writes) =
                (a.uses.iter().any(|u| mode(u).reads()), a.uses.iter().any(|u| mode(u).writes()));
            match (reads, writes) {
                (true, true) => AccessMode::ReadWrite,
                (false, true) => AccessMode::Write,
                _ => AccessMode::Read,
            }
        });
        let modes: SmallVec<[AccessMode; 4]> = modes.collect();
        let body =
            Arc::new(FusedBody { parts, plan, barriers: request.barriers, completed: Mutex::new(None) });
        let unfused = Unfused(body.clone());
        let kept_on_failure: Arc<dyn KeptOnFailure> = body.clone();
        let kernel = ClosureKernel {
            tag: 0,
            phases: smallvec::smallvec![Phase {
                group: Arc::new(move |ctx: &GroupCtx<'_>| body.run_group(ctx)),
                per_item: false,
                code: TypeId::of::<FusedBody>(),
                elementwise: None,
            }],
            global_slots,
            scratch,
            unfused: Some(unfused),
        };
        let kernel = kernel.into_kernel(name, modes, cost);
        Ok(Fused {
            kernel,
            geometry,
            scalars: ScalarBlock::new(),
            args,
            internal,
            warnings,
            cached,
            kept_on_failure: Some(kept_on_failure),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::*;
    use crate::access::{Accessor, DiscardWrite, ElemAccessor, LocalAccessor, Read, ReadWrite, Write};
    use crate::closure::{phase, Arena};
    use crate::elementwise::map_phase;
    use crate::item::Item;

    /// A single-phase kernel named `name` whose one-slot-per-buffer accessors are
    /// built by the test.
    fn kernel(
        name: &str,
        tag: u64,
        slots: usize,
        f: impl Fn(&mut Item<'_>) + Send + Sync + 'static,
    ) -> KernelRef {
        ClosureKernel {
            tag,
            phases: smallvec::smallvec![phase(f)],
            global_slots: slots,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel(name, vec![AccessMode::ReadWrite; slots], ItemCost::default())
    }

    fn range(n: usize) -> Geometry {
        Geometry::for_range(Range::d1(n)).unwrap()
    }

    fn nd(global: impl Into<Range>, local: impl Into<Range>) -> Geometry {
        NdRange::new(global, local).geometry().unwrap()
    }

    /// Runs a fused kernel over host vectors, one per buffer id.
    fn run(fused: &Fused, buffers: &mut HashMap<u64, Vec<u32>>) {
        run_with(fused, buffers, &mut Arena::default())
    }

    /// [`run`] on a thread's arena that earlier kernels used.
    fn run_with(fused: &Fused, buffers: &mut HashMap<u64, Vec<u32>>, arena: &mut Arena) {
        let globals: Vec<Binding> = fused
            .args
            .iter()
            .map(|a| {
                let v = buffers.get_mut(&a.buffer).unwrap();
                // SAFETY: the hull lies inside the vector.
                Binding::new(unsafe { v.as_mut_ptr().cast::<u8>().add(a.start) }, a.end - a.start)
            })
            .collect();
        for g in 0..fused.geometry.group_count() {
            fused.kernel.closure().unwrap().run_group(&fused.geometry, g, &globals, arena);
        }
    }

    fn request(kernels: Vec<FusionKernel>) -> FusionRequest {
        FusionRequest { kernels, barriers: true }
    }

    fn whole(buffer: u64, n: usize) -> FusionArg {
        FusionArg::new(buffer, 0..n * 4, 4)
    }

    fn error_of(geometries: &[Geometry]) -> FusionError {
        let kernels = geometries
            .iter()
            .enumerate()
            .map(|(i, g)| FusionKernel {
                kernel: kernel(&format!("k{i}"), i as u64, 0, |_| {}),
                geometry: *g,
                args: smallvec::smallvec![],
                deps: Default::default(),
                scalars: Default::default(),
            })
            .collect();
        ClosureFusion::new().fuse(&request(kernels)).unwrap_err()
    }

    #[test]
    fn illegal_nd_range_combinations_name_the_reason() {
        assert_eq!(ClosureFusion::new().fuse(&request(vec![])).unwrap_err(), FusionError::Empty);
        assert!(matches!(error_of(&[nd(16, 4), nd(16, 8)]), FusionError::DifferentLocalSizes { .. }));
        // A plain range of 18 is the largest launch: 18 items in groups of 4 do not divide.
        assert!(matches!(error_of(&[nd(16, 4), range(18)]), FusionError::NonUniformWorkGroups { .. }));
        assert!(matches!(
            error_of(&[nd([4, 4], [2, 2]), nd([2, 4], [2, 2]), range(32)]),
            FusionError::DifferentDimensions { .. }
        ));
        assert!(matches!(
            error_of(&[nd([4, 8], [2, 2]), nd([2, 4], [2, 2])]),
            FusionError::DifferentGlobalSizes { .. }
        ));
        let shifted = NdRange::new(16, 4).with_offset([4, 0, 0]).geometry().unwrap();
        assert!(matches!(error_of(&[nd(16, 4), shifted]), FusionError::DifferentOffsets { .. }));
        // Equal non-zero offsets are fine when no ids are remapped.
        let plain_shifted = Geometry::for_range_with_offset(Range::d1(8), [2, 0, 0]).unwrap();
        let ok = [plain_shifted, plain_shifted];
        let kernels = ok.iter().map(|g| FusionKernel {
            kernel: kernel("k", 0, 0, |_| {}),
            geometry: *g,
            args: smallvec::smallvec![],
            deps: Default::default(),
            scalars: Default::default(),
        });
        assert!(ClosureFusion::new().fuse(&request(kernels.collect())).is_ok());
        // Remapping a reshaped plain kernel with non-zero offsets is not.
        let a = Geometry::for_range_with_offset(Range::d2(2, 4), [1, 1, 0]).unwrap();
        let b = Geometry::for_range_with_offset(Range::d1(8), [1, 1, 0]).unwrap();
        assert!(matches!(error_of(&[a, b]), FusionError::DifferentOffsets { .. }));
    }

    /// Kernels of different shapes fuse into the largest grid; each sees its own ids
    /// and ranges, and work-items past a kernel's range skip it.
    #[test]
    fn work_items_are_remapped_per_kernel() {
        type Seen = Vec<(usize, [usize; 3], usize, usize)>;
        let seen: Arc<Mutex<Seen>> = Default::default();
        let log = |k: usize| {
            let seen = seen.clone();
            move |it: &mut Item<'_>| {
                seen.lock().unwrap().push((
                    k,
                    [it.global_id(0), if it.dims() > 1 { it.global_id(1) } else { 0 }, 0],
                    it.global_linear_id(),
                    it.global_range(0),
                ))
            }
        };
        let kernels = vec![
            FusionKernel {
                kernel: kernel("line", 1, 0, log(0)),
                geometry: range(10),
                args: smallvec::smallvec![],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: kernel("grid", 2, 0, log(1)),
                geometry: Geometry::for_range(Range::d2(3, 8)).unwrap(),
                args: smallvec::smallvec![],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: kernel("cube", 3, 0, log(2)),
                geometry: Geometry::for_range(Range::d3(2, 2, 3)).unwrap(),
                args: smallvec::smallvec![],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
        assert_eq!(fused.geometry.global_range(), [3, 8, 1], "the largest kernel's grid");
        run(&fused, &mut HashMap::new());
        let seen = seen.lock().unwrap();
        for (k, total, dims_range0) in [(0, 10, 10), (1, 24, 3), (2, 12, 2)] {
            let mut lin: Vec<usize> = seen.iter().filter(|s| s.0 == k).map(|s| s.2).collect();
            lin.sort();
            assert_eq!(lin, (0..total).collect::<Vec<_>>(), "kernel {k} runs each of its items once");
            assert!(seen.iter().filter(|s| s.0 == k).all(|s| s.3 == dims_range0));
        }
        // The 1-D kernel's global id is the global linear id.
        assert!(seen.iter().filter(|s| s.0 == 0).all(|s| s.1[0] == s.2));
        // The 2-D kernel keeps its own (row, column).
        assert!(seen.iter().filter(|s| s.0 == 1).all(|s| s.1[0] * 8 + s.1[1] == s.2));
    }

    /// x -> tmp -> out with tmp private: the output is right and tmp is not touched.
    #[test]
    fn private_internalization_keeps_values_per_work_item() {
        let n = 2048;
        let (x, tmp, out) = (
            Accessor::<u32, Read>::new(0, 1, n),
            Accessor::<u32, Write>::new(1, 1, n),
            Accessor::<u32, Write>::new(1, 2, n),
        );
        let tmp_in = Accessor::<u32, Read>::new(0, 2, n);
        let k1 = kernel("double", 1, 2, move |it| {
            let i = it.global_linear_id();
            tmp.set(it, i, x.get(it, i) * 2)
        });
        let k2 = kernel("inc", 2, 2, move |it| {
            let i = it.global_linear_id();
            out.set(it, i, tmp_in.get(it, i) + 1)
        });
        let kernels = vec![
            FusionKernel {
                kernel: k1,
                geometry: range(n),
                args: smallvec::smallvec![whole(10, n), whole(11, n).promoted(Promotion::Private)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: k2,
                geometry: range(n),
                args: smallvec::smallvec![whole(11, n).promoted(Promotion::Private), whole(12, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
        assert_eq!(fused.internal.len(), 1);
        assert_eq!(
            (fused.internal[0].buffer, fused.internal[0].kind, fused.internal[0].bytes),
            (11, Promotion::Private, 4)
        );
        assert_eq!(fused.args.iter().map(|a| a.buffer).collect::<Vec<_>>(), vec![10, 12]);
        let mut bufs = HashMap::from([(10, (0..n as u32).collect()), (11, vec![7; n]), (12, vec![0; n])]);
        run(&fused, &mut bufs);
        assert_eq!(bufs[&12], (0..n as u32).map(|v| v * 2 + 1).collect::<Vec<_>>());
        assert_eq!(bufs[&11], vec![7; n], "not written back");
    }

    /// A private intermediate that an elementwise kernel writes whole before anything
    /// reads it is not cleared for every group; one that a kernel may read first is,
    /// so what that kernel reads is zero, not what earlier kernels left in the
    /// thread's arena.
    #[test]
    fn only_private_buffers_written_first_skip_clearing() {
        let n = 2048;
        let map = |name: &str, tag: u64, f: fn(u32) -> u32| {
            let (input, output) =
                (Accessor::<u32, Read>::new(0, tag, n), ElemAccessor::<u32, DiscardWrite>::new(1, tag, n));
            ClosureKernel {
                tag,
                phases: smallvec::smallvec![map_phase(input, output, f)],
                global_slots: 2,
                scratch: vec![],
                unfused: None,
            }
            .into_kernel(name, vec![AccessMode::ReadWrite; 2], ItemCost::default())
        };
        let (peek_in, peek_out) = (Accessor::<u32, Read>::new(0, 3, n), Accessor::<u32, Write>::new(1, 3, n));
        let peek = kernel("peek", 3, 2, move |it| {
            let i = it.global_linear_id();
            peek_out.set(it, i, peek_in.get(it, i))
        });
        let private = |b: u64| whole(b, n).promoted(Promotion::Private);
        // x -> 11 -> 12 through maps; `peek` copies 13 to 14 before a map writes 13.
        let kernels = vec![
            FusionKernel {
                kernel: map("double", 1, |v| v * 2),
                geometry: range(n),
                args: smallvec::smallvec![whole(10, n), private(11)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: map("inc", 2, |v| v + 1),
                geometry: range(n),
                args: smallvec::smallvec![private(11), whole(12, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: peek,
                geometry: range(n),
                args: smallvec::smallvec![private(13), whole(14, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: map("triple", 4, |v| v * 3),
                geometry: range(n),
                args: smallvec::smallvec![whole(10, n), private(13)],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
        assert_eq!(fused.internal.iter().map(|i| i.buffer).collect::<Vec<_>>(), vec![11, 13]);
        let zeroed: Vec<bool> = fused.kernel.closure().unwrap().scratch.iter().map(|s| s.zeroed).collect();
        assert_eq!(zeroed, vec![false, true]);

        // An arena that a kernel with a large local region filled with ones.
        let mut arena = Arena::default();
        let tile = LocalAccessor::<u32>::new(0, 5, 1 << 14);
        let dirty = ClosureKernel {
            tag: 5,
            phases: smallvec::smallvec![phase(move |it| (0..tile.len()).for_each(|j| tile.set(it, j, !0)))],
            global_slots: 0,
            scratch: vec![Scratch::new(ScratchKind::Local, 4 << 14)],
            unfused: None,
        };
        dirty.run_group(&range(1), 0, &[], &mut arena);

        let mut bufs = HashMap::from([
            (10, (0..n as u32).collect()),
            (11, vec![7; n]),
            (12, vec![0; n]),
            (13, vec![9; n]),
            (14, vec![5; n]),
        ]);
        run_with(&fused, &mut bufs, &mut arena);
        assert_eq!(bufs[&12], (0..n as u32).map(|v| v * 2 + 1).collect::<Vec<_>>());
        assert_eq!(bufs[&14], vec![0; n], "read before written: cleared");
        assert_eq!((&bufs[&11], &bufs[&13]), (&vec![7; n], &vec![9; n]), "not written back");
    }

    /// Element counters shared by the kernels of [`counted_map`]: per kernel, how many
    /// elements it mapped, and how many its predecessor had mapped when it started.
    #[derive(Default)]
    struct Counters {
        calls: [std::sync::atomic::AtomicUsize; 4],
        started: [std::sync::atomic::AtomicUsize; 4],
    }

    impl Counters {
        fn reset(&self) {
            use std::sync::atomic::Ordering::Relaxed;
            self.calls.iter().chain(&self.started).for_each(|c| c.store(0, Relaxed));
        }
        fn calls(&self) -> Vec<usize> {
            self.calls.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect()
        }
        fn started(&self) -> Vec<usize> {
            self.started.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect()
        }
    }

    /// Map kernel `k` (tag `k`, `n` elements, slots 0 and 1) of `f`, counted in `counters`.
    fn counted_map(k: usize, n: usize, f: fn(u32) -> u32, counters: &Arc<Counters>) -> KernelRef {
        use std::sync::atomic::Ordering::Relaxed;
        let (input, output) = (
            Accessor::<u32, Read>::new(0, k as u64, n),
            ElemAccessor::<u32, DiscardWrite>::new(1, k as u64, n),
        );
        let c = counters.clone();
        let counted = move |v: u32| {
            if k > 0 && c.calls[k].load(Relaxed) == 0 {
                c.started[k].store(c.calls[k - 1].load(Relaxed), Relaxed);
            }
            c.calls[k].fetch_add(1, Relaxed);
            f(v)
        };
        ClosureKernel {
            tag: k as u64,
            phases: smallvec::smallvec![map_phase(input, output, counted)],
            global_slots: 2,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel(format!("k{k}"), vec![AccessMode::ReadWrite; 2], ItemCost::default())
    }

    /// A chain of elementwise kernels runs span by span (`FusedBody::stream`), with
    /// or without barriers, over global and private intermediates, a partial last
    /// group and a partial last span: each kernel maps each element exactly once and
    /// the results are the serial ones. With a private intermediate of two elements
    /// per work-item, its runs are not contiguous and each kernel's own phase runs
    /// per span instead (over one run for kernels 0 and 1, per work-item for 2 and
    /// 3); the same holds.
    #[test]
    fn elementwise_chains_stream_span_by_span() {
        let n = 2500; // groups of 1,024: the last holds 452, a partial last span
        let counters = Arc::new(Counters::default());
        // `wide`: private buffer 13 holds two elements per work-item.
        let kernels = |wide: usize| {
            let private = |b: u64| {
                let elems = if b == 13 { wide * n } else { n };
                FusionArg::new(b, 0..elems * 4, 4).promoted(Promotion::Private)
            };
            // 10 -> 11 (private) -> 12 -> 13 (private) -> 14
            let fs: [fn(u32) -> u32; 4] = [|v| v * 2, |v| v + 1, |v| v * 3, |v| v + 7];
            let args = [
                vec![whole(10, n), private(11)],
                vec![private(11), whole(12, n)],
                vec![whole(12, n), private(13)],
                vec![private(13), whole(14, n)],
            ];
            fs.into_iter()
                .zip(args)
                .enumerate()
                .map(|(k, (f, args))| FusionKernel {
                    kernel: counted_map(k, n, f, &counters),
                    geometry: range(n),
                    args: args.into(),
                    deps: Default::default(),
                    scalars: Default::default(),
                })
                .collect::<Vec<_>>()
        };
        for (wide, barriers) in [(1, true), (1, false), (2, true)] {
            let fused = ClosureFusion::new().fuse(&FusionRequest { kernels: kernels(wide), barriers });
            let fused = fused.unwrap();
            assert_eq!(fused.internal.iter().map(|i| i.buffer).collect::<Vec<_>>(), vec![11, 13]);
            counters.reset();
            let mut bufs = HashMap::from([
                (10, (0..n as u32).collect()),
                (11, vec![5; n]),
                (12, vec![0; n]),
                (13, vec![6; wide * n]),
                (14, vec![0; n]),
            ]);
            run(&fused, &mut bufs);
            let label = format!("{wide} private element(s) per work-item in 13, barriers {barriers}");
            assert_eq!(counters.calls(), vec![n; 4], "{label}: each kernel maps each element once");
            let started = counters.started();
            // (Spans of 1,024 at most here: a group holds two at the default ones.)
            let span = span_within(crate::isa::stream_span(), if wide == 1 { 8 } else { 4 }).min(1024);
            assert_eq!(started[1..], [span; 3], "{label}: each kernel starts one span after the last");
            let want12: Vec<u32> = (0..n as u32).map(|v| v * 2 + 1).collect();
            let want14: Vec<u32> = want12.iter().map(|v| v * 3 + 7).collect();
            assert!(bufs[&12] == want12 && bufs[&14] == want14, "{label}: wrong results");
            assert!(bufs[&11] == vec![5; n] && bufs[&13] == vec![6; wide * n], "{label}: written back");
        }
    }

    /// A chain's span-local intermediates keep to the L1 budget: the span halves
    /// until they fit, never below 64 work-items.
    #[test]
    fn spans_shrink_to_keep_intermediates_in_l1() {
        assert_eq!(span_within(512, 0), 512, "no intermediate");
        assert_eq!(span_within(512, 4), 512, "one f32 intermediate: 2 KiB");
        assert_eq!(span_within(512, 7 * 4), 512, "seven: 14 KiB");
        assert_eq!(span_within(1024, 7 * 4), 512, "seven in 1,024 would take 28 KiB");
        assert_eq!(span_within(512, 15 * 4), 256, "fifteen: 30 KiB at 512");
        assert_eq!(span_within(256, 15 * 4), 256);
        assert_eq!(span_within(512, 1 << 12), 64, "never below 64");
    }

    /// Streamed private intermediates live in one span of their region
    /// (`Plan::span_local`), except one that a kernel outside the streamed run also
    /// reads: that one keeps a whole region per group, or the later kernel would read
    /// elements no span left there. Both give the serial results, on an arena that an
    /// earlier run filled (so nothing passes by finding zeros).
    #[test]
    fn a_private_intermediate_read_after_the_stream_keeps_its_whole_region() {
        let n = 2500; // groups of 1,024, the last group and span partial
        let counters = Arc::new(Counters::default());
        let private = |b: u64| FusionArg::new(b, 0..n * 4, 4).promoted(Promotion::Private);
        // 10 -> 11 (private) -> 12 (private) -> 13, streamed; then a per-item kernel
        // reads 11 again and writes 14.
        let late = Accessor::<u32, Read>::new(0, 9, n);
        let out = Accessor::<u32, crate::access::Write>::new(1, 9, n);
        let reader = kernel("late", 9, 2, move |it| {
            let i = it.global_linear_id();
            out.set(it, i, late.get(it, i) + 1000)
        });
        let kernels = vec![
            FusionKernel {
                kernel: counted_map(0, n, |v| v * 2, &counters),
                geometry: range(n),
                args: smallvec::smallvec![whole(10, n), private(11)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: counted_map(1, n, |v| v + 1, &counters),
                geometry: range(n),
                args: smallvec::smallvec![private(11), private(12)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: counted_map(2, n, |v| v * 3, &counters),
                geometry: range(n),
                args: smallvec::smallvec![private(12), whole(13, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: reader,
                geometry: range(n),
                args: smallvec::smallvec![private(11), whole(14, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
        assert_eq!(fused.internal.iter().map(|i| i.buffer).collect::<Vec<_>>(), vec![11, 12]);
        let mut arena = Arena::default();
        for round in 0..2 {
            let mut bufs = HashMap::from([
                (10, (0..n as u32).collect()),
                (11, vec![5; n]),
                (12, vec![6; n]),
                (13, vec![0; n]),
                (14, vec![0; n]),
            ]);
            run_with(&fused, &mut bufs, &mut arena);
            let want13: Vec<u32> = (0..n as u32).map(|v| (v * 2 + 1) * 3).collect();
            let want14: Vec<u32> = (0..n as u32).map(|v| v * 2 + 1000).collect();
            assert_eq!(bufs[&13], want13, "round {round}: the streamed chain");
            assert_eq!(bufs[&14], want14, "round {round}: the kernel after the stream reads every element");
            assert!(bufs[&11] == vec![5; n] && bufs[&12] == vec![6; n], "round {round}: written back");
        }
    }

    /// A kernel that reads a shifted view of what the kernel before it wrote
    /// (`x[i + 100]` after `x[i]`) depends on other work-items of the group: the
    /// chain runs kernel after kernel over the group, not span by span, and gives
    /// the serial result.
    #[test]
    fn chains_over_shifted_views_do_not_stream() {
        let (n, shift) = (1024, 100); // one group
        let counters = Arc::new(Counters::default());
        // 10 -> 11 (doubled, n elements), then `m` elements of 11 from `args` -> 12 (+ 1).
        let chain = |n: usize, m: usize, args: Vec<FusionArg>| {
            let kernels = vec![
                FusionKernel {
                    kernel: counted_map(0, n, |v| v * 2, &counters),
                    geometry: range(n),
                    args: smallvec::smallvec![whole(10, n), whole(11, n)],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
                FusionKernel {
                    kernel: counted_map(1, m, |v| v + 1, &counters),
                    geometry: range(m),
                    args: args.into(),
                    deps: Default::default(),
                    scalars: Default::default(),
                },
            ];
            ClosureFusion::new().fuse(&request(kernels)).unwrap()
        };
        // 11[shift..shift + n] -> 12
        let fused = chain(n, n, vec![FusionArg::new(11, shift * 4..(shift + n) * 4, 4), whole(12, n)]);
        let mut bufs =
            HashMap::from([(10, (0..n as u32).collect()), (11, vec![7; n + shift]), (12, vec![0; n])]);
        run(&fused, &mut bufs);
        assert_eq!(counters.started()[1], n, "kernel 1 starts after kernel 0's whole group");
        let x: Vec<u32> = (0..n as u32).map(|v| v * 2).chain([7; 100]).collect();
        let want: Vec<u32> = (0..n).map(|i| x[i + shift] + 1).collect();
        assert!(bufs[&12] == want, "the serial result");

        // Nor does a kernel over a smaller range than the grid's (remapped: it skips
        // work-items).
        let (n, short) = (2048, 1500);
        let fused = chain(n, short, vec![whole(11, short), whole(12, short)]);
        let mut bufs = HashMap::from([(10, (0..n as u32).collect()), (11, vec![7; n]), (12, vec![0; short])]);
        counters.reset();
        run(&fused, &mut bufs);
        assert_eq!(counters.started()[1], 1024, "a shorter kernel starts after the whole group");
        assert_eq!(counters.calls()[1], short, "and maps only its range");
        assert!(bufs[&12] == (0..short as u32).map(|v| v * 2 + 1).collect::<Vec<_>>(), "the serial result");
    }

    /// Local internalization of an ND-range chain: each group's slice lives in local
    /// memory of elements / groups.
    #[test]
    fn local_internalization_uses_group_scratch() {
        let n = 64;
        let (x, tmp) = (Accessor::<u32, Read>::new(0, 1, n), Accessor::<u32, Write>::new(1, 1, n));
        let (tmp_in, out) = (Accessor::<u32, Read>::new(0, 2, n), Accessor::<u32, Write>::new(1, 2, n));
        let k1 = kernel("load", 1, 2, move |it| {
            let i = it.global_linear_id();
            tmp.set(it, i, x.get(it, i) + 100)
        });
        // Reads a neighbour inside the group: needs the barrier and group-shared memory.
        let k2 = kernel("rotate", 2, 2, move |it| {
            let l = it.local_range(0);
            let j = it.group_id(0) * l + (it.local_id(0) + 1) % l;
            out.set(it, it.global_linear_id(), tmp_in.get(it, j))
        });
        let kernels = vec![
            FusionKernel {
                kernel: k1,
                geometry: nd(n, 8),
                args: smallvec::smallvec![whole(1, n), whole(2, n).promoted(Promotion::Local)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: k2,
                geometry: nd(n, 8),
                args: smallvec::smallvec![whole(2, n).promoted(Promotion::Local), whole(3, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
        assert_eq!(
            (fused.internal[0].kind, fused.internal[0].bytes),
            (Promotion::Local, 32),
            "64 elements / 8 groups"
        );
        let mut bufs = HashMap::from([(1, (0..n as u32).collect()), (2, vec![0; n]), (3, vec![0; n])]);
        run(&fused, &mut bufs);
        let expect: Vec<u32> = (0..n).map(|i| (i / 8 * 8 + (i % 8 + 1) % 8) as u32 + 100).collect();
        assert_eq!(bufs[&3], expect);
        assert_eq!(bufs[&2], vec![0; n], "not written back");
    }

    /// Mismatched hints fall back to global memory with a warning naming the reason.
    #[test]
    fn promotion_mismatches_fall_back_with_warnings() {
        let n = 16;
        let noop = || kernel("k", 0, 1, |_| {});
        let case = |a: FusionArg, ga: Geometry, b: FusionArg, gb: Geometry| {
            let kernels = vec![
                FusionKernel {
                    kernel: noop(),
                    geometry: ga,
                    args: smallvec::smallvec![a],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
                FusionKernel {
                    kernel: noop(),
                    geometry: gb,
                    args: smallvec::smallvec![b],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
            ];
            let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
            assert!(fused.internal.is_empty());
            assert_eq!(fused.args.len(), 1);
            match &fused.warnings[..] {
                [FusionWarning::PromotionDropped { buffer: 5, reason }] => reason.clone(),
                w => panic!("expected one warning, got {w:?}"),
            }
        };
        let (p, l) = (whole(5, n).promoted(Promotion::Private), whole(5, n).promoted(Promotion::Local));
        assert_eq!(case(p.clone(), range(n), whole(5, n), range(n)), PromotionMismatch::NotAllPromoted);
        assert_eq!(case(p.clone(), nd(n, 4), l.clone(), nd(n, 4)), PromotionMismatch::LocalAndPrivate);
        assert!(matches!(
            case(l.clone(), range(n), l.clone(), range(n)),
            PromotionMismatch::NoWorkGroupSize { .. }
        ));
        assert_eq!(case(p.clone(), range(n), p.clone(), range(8)), PromotionMismatch::Sizes);
        let half = FusionArg::new(5, 0..32, 4).promoted(Promotion::Private);
        assert_eq!(case(p, range(n), half, range(n)), PromotionMismatch::DifferentRanges);
        assert_eq!(
            case(
                whole(5, 6).promoted(Promotion::Private),
                range(4),
                whole(5, 6).promoted(Promotion::Private),
                range(4)
            ),
            PromotionMismatch::Sizes
        );
    }

    /// A pair exchanging data inside a work-group: with the fusion barrier the second
    /// kernel sees the first's writes of other work-items; without it, each work-item
    /// runs both bodies before the next work-item starts.
    #[test]
    fn no_barriers_runs_bodies_back_to_back() {
        let n = 16;
        let make = |barriers: bool| {
            let a = Accessor::<u32, Write>::new(0, 1, n);
            let (a_in, b) = (Accessor::<u32, Read>::new(0, 2, n), Accessor::<u32, Write>::new(1, 2, n));
            let k1 = kernel("write", 1, 1, move |it| {
                a.set(it, it.global_linear_id(), 1 + it.global_linear_id() as u32)
            });
            let k2 = kernel("neighbour", 2, 2, move |it| {
                let l = it.local_range(0);
                let j = it.group_id(0) * l + (it.local_id(0) + 1) % l;
                b.set(it, it.global_linear_id(), a_in.get(it, j))
            });
            let kernels = vec![
                FusionKernel {
                    kernel: k1,
                    geometry: nd(n, 4),
                    args: smallvec::smallvec![whole(1, n)],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
                FusionKernel {
                    kernel: k2,
                    geometry: nd(n, 4),
                    args: smallvec::smallvec![whole(1, n), whole(2, n)],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
            ];
            let fused = ClosureFusion::new().fuse(&FusionRequest { kernels, barriers }).unwrap();
            let mut bufs = HashMap::from([(1, vec![0; n]), (2, vec![0; n])]);
            run(&fused, &mut bufs);
            bufs.remove(&2).unwrap()
        };
        let with: Vec<u32> = (0..n).map(|i| (i / 4 * 4 + (i % 4 + 1) % 4) as u32 + 1).collect();
        assert_eq!(make(true), with);
        // Without the barrier only the last work-item of each group finds its
        // neighbour (the group's first) already written.
        let without: Vec<u32> = (0..n).map(|i| if i % 4 == 3 { (i - 3) as u32 + 1 } else { 0 }).collect();
        assert_eq!(make(false), without);
    }

    /// The same chain (same code, ranges and layout; new closures and buffers) is
    /// planned once.
    #[test]
    fn plans_are_cached_by_code_and_layout() {
        let fusion = ClosureFusion::new();
        let chain = |tag: u64, b: u64| {
            let acc = Accessor::<u32, ReadWrite>::new(0, tag, 8);
            let k = kernel("inc", tag, 1, move |it| {
                acc.set(it, it.global_linear_id(), acc.get(it, it.global_linear_id()) + 1)
            });
            request(vec![
                FusionKernel {
                    kernel: k.clone(),
                    geometry: range(8),
                    args: smallvec::smallvec![whole(b, 8)],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
                FusionKernel {
                    kernel: k,
                    geometry: range(8),
                    args: smallvec::smallvec![whole(b, 8)],
                    deps: Default::default(),
                    scalars: Default::default(),
                },
            ])
        };
        let first = fusion.fuse(&chain(1, 100)).unwrap();
        let second = fusion.fuse(&chain(2, 200)).unwrap();
        assert!(!first.cached && second.cached);
        assert_eq!(fusion.stats(), CacheStats { hits: 1, misses: 1, evictions: 0, len: 1 });
        let mut bufs = HashMap::from([(200, vec![5; 8])]);
        run(&second, &mut bufs);
        assert_eq!(bufs[&200], vec![7; 8], "the cached plan runs the new closures on the new buffer");
        let other_range = request(vec![FusionKernel {
            kernel: kernel("inc", 3, 1, |_| {}),
            geometry: range(16),
            args: smallvec::smallvec![whole(1, 16)],
            deps: Default::default(),
            scalars: Default::default(),
        }]);
        assert!(!fusion.fuse(&other_range).unwrap().cached);
    }

    /// `Unfused::rerun` runs the listed kernels one by one: a failed kernel's writes
    /// are undone and its dependents (by `deps`, transitively) skipped, independent
    /// kernels keep their writes, and an internalized buffer is memory of its own
    /// for the rerun. Without a failure it gives the serial result.
    #[test]
    fn a_rerun_keeps_what_unfused_kernels_would() {
        let n = 8;
        let one = |tag: u64, name: &str, f: fn(u32) -> u32| {
            let acc = Accessor::<u32, ReadWrite>::new(0, tag, n);
            kernel(name, tag, 1, move |it| {
                acc.set(it, it.global_linear_id(), f(acc.get(it, it.global_linear_id())))
            })
        };
        // `dst = f(src)`; with `fail`, panics after the last work-item's write.
        let two = |tag: u64, name: &str, f: fn(u32) -> u32, fail: bool| {
            let src = Accessor::<u32, Read>::new(0, tag, n);
            let dst = Accessor::<u32, Write>::new(1, tag, n);
            kernel(name, tag, 2, move |it| {
                let i = it.global_linear_id();
                dst.set(it, i, f(src.get(it, i)));
                if fail && i == n - 1 {
                    panic!("rerun test");
                }
            })
        };
        let private = |b| whole(b, n).promoted(Promotion::Private);
        for fail in [true, false] {
            let k = |kernel, args: &[FusionArg], deps: &[u32]| FusionKernel {
                kernel,
                geometry: range(n),
                args: args.iter().cloned().collect(),
                deps: deps.iter().copied().collect(),
                scalars: Default::default(),
            };
            let fused = ClosureFusion::new()
                .fuse(&request(vec![
                    k(one(1, "inc", |v| v + 1), &[whole(1, n)], &[]),
                    k(two(2, "double", |v| v * 2, false), &[whole(1, n), private(2)], &[0]),
                    k(two(3, "add", |v| v + 10, fail), &[private(2), whole(3, n)], &[1]),
                    k(two(4, "copy", |v| v, false), &[whole(3, n), whole(4, n)], &[2]),
                    k(one(5, "side", |v| v + 5), &[whole(5, n)], &[]),
                ]))
                .unwrap();
            assert_eq!(fused.internal.len(), 1);
            let mut bufs: HashMap<u64, Vec<u32>> = (1..=5).map(|b| (b, vec![b as u32; n])).collect();
            let globals: Vec<Binding> = fused
                .args
                .iter()
                .map(|a| Binding::new(bufs.get_mut(&a.buffer).unwrap().as_mut_ptr().cast(), a.end - a.start))
                .collect();
            let launch = |k: &KernelRef, g: &Geometry, b: &[Binding]| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    for group in 0..g.group_count() {
                        k.closure().unwrap().run_group(g, group, b, &mut Arena::default());
                    }
                }))
                .map_err(|p| ExecError::KernelPanicked {
                    kernel: k.name.clone(),
                    message: crate::error::panic_message(&*p),
                })
            };
            let unfused =
                fused.kernel.closure().unwrap().unfused.as_ref().expect("a fused kernel can run unfused");
            assert_eq!(unfused.len(), 5);
            let pool = Arc::new(SnapshotPool::default());
            // SAFETY (both): the vectors outlive the call, and nothing else touches them.
            let short = unsafe { unfused.rerun(&globals[1..], |_| true, &pool, launch) };
            assert!(short.is_none(), "bindings that are not the fused kernel's run nothing");
            assert!(!unfused.kept(0), "no rerun yet");
            let result = unsafe { unfused.rerun(&globals, |_| true, &pool, launch) }.unwrap();
            let got: Vec<u32> = (1..=5).map(|b| bufs[&b][0]).collect();
            let kept: Vec<(u64, bool)> =
                fused.args.iter().enumerate().map(|(i, a)| (a.buffer, unfused.kept(i))).collect();
            if fail {
                match result {
                    Err(ExecError::KernelPanicked { kernel, .. }) => assert_eq!(&*kernel, "add"),
                    r => panic!("{r:?}"),
                }
                assert_eq!(got, vec![2, 2, 3, 4, 10], "add undone, copy skipped, side kept");
                assert_eq!(kept, vec![(1, true), (3, false), (4, false), (5, true)]);
            } else {
                result.unwrap();
                assert_eq!(got, vec![2, 2, 14, 14, 10], "the serial result; the intermediate stays");
            }
        }
    }

    /// Everything in a plan's key tells plans apart; kernel names are not in it, and
    /// a hit names the fused kernel after the request's kernels.
    #[test]
    fn cache_keys_cover_the_layout_and_names_follow_the_request() {
        let fusion = ClosureFusion::new();
        let acc = Accessor::<u32, ReadWrite>::new(0, 1, 8);
        let inc = move |it: &mut Item<'_>| {
            acc.set(it, it.global_linear_id(), acc.get(it, it.global_linear_id()) + 1)
        };
        let chain =
            |names: [&str; 2], buffers: [u64; 2], promotion: Promotion, barriers: bool| FusionRequest {
                kernels: names
                    .iter()
                    .zip(buffers)
                    .map(|(name, b)| FusionKernel {
                        kernel: kernel(name, 1, 1, inc),
                        geometry: range(8),
                        args: smallvec::smallvec![whole(b, 8).promoted(promotion)],
                        deps: Default::default(),
                        scalars: Default::default(),
                    })
                    .collect(),
                barriers,
            };
        let fuse = |r: &FusionRequest| {
            let f = fusion.fuse(r).unwrap();
            (f.cached, f.kernel.name.to_string())
        };
        let none = Promotion::None;
        assert_eq!(fuse(&chain(["a", "b"], [1, 1], none, true)), (false, "fused(a+b)".into()));
        assert_eq!(fuse(&chain(["a", "b"], [5, 5], none, true)), (true, "fused(a+b)".into()));
        assert_eq!(fuse(&chain(["c", "d"], [5, 5], none, true)), (true, "fused(c+d)".into()));
        assert!(!fuse(&chain(["a", "b"], [1, 2], none, true)).0, "two buffers, not one");
        assert!(!fuse(&chain(["a", "b"], [1, 1], Promotion::Private, true)).0, "promoted");
        assert!(!fuse(&chain(["a", "b"], [1, 1], none, false)).0, "without barriers");
        assert_eq!(fusion.stats(), CacheStats { hits: 2, misses: 4, evictions: 0, len: 4 });
        // Those keys differ only in parts the hash leaves out, so they share a bucket:
        // each hit must still find its own plan.
        let layout = |r: &FusionRequest| {
            let f = fusion.fuse(r).unwrap();
            (f.cached, f.args.len(), f.internal.len())
        };
        assert_eq!(layout(&chain(["a", "b"], [1, 2], none, true)), (true, 2, 0));
        assert_eq!(layout(&chain(["a", "b"], [1, 1], Promotion::Private, true)), (true, 0, 1));
        assert_eq!(layout(&chain(["a", "b"], [3, 3], none, true)), (true, 1, 0));
        assert_eq!(fusion.stats(), CacheStats { hits: 5, misses: 4, evictions: 0, len: 4 });
    }

    /// A one-kernel request over `n` elements of buffer `b` that adds 1 to each:
    /// requests of different `n` have different plans.
    fn inc_over(n: usize, b: u64) -> FusionRequest {
        let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
        let k = kernel("inc", 1, 1, move |it| {
            acc.set(it, it.global_linear_id(), acc.get(it, it.global_linear_id()) + 1)
        });
        request(vec![FusionKernel {
            kernel: k,
            geometry: range(n),
            args: smallvec::smallvec![whole(b, n)],
            deps: Default::default(),
            scalars: Default::default(),
        }])
    }

    /// More distinct plans than the capacity: the cache keeps at most its capacity,
    /// counting each plan it evicts, and the oldest plans are the ones gone.
    #[test]
    fn the_cache_keeps_at_most_its_capacity() {
        let fusion = ClosureFusion::with_capacity(4);
        assert_eq!(fusion.capacity(), 4);
        for n in 1..=10 {
            assert!(!fusion.fuse(&inc_over(n, 1)).unwrap().cached, "{n}: a new plan");
            let stats = fusion.stats();
            assert_eq!(stats.len, n.min(4), "{n}");
            assert_eq!(stats.evictions, n.saturating_sub(4) as u64, "{n}");
        }
        assert!(fusion.fuse(&inc_over(10, 2)).unwrap().cached, "the newest plan is kept");
        assert!(!fusion.fuse(&inc_over(1, 2)).unwrap().cached, "the oldest plan was evicted");
        let stats = fusion.stats();
        assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len), (1, 11, 7, 4));
        assert_eq!(ClosureFusion::new().capacity(), ClosureFusion::DEFAULT_CAPACITY);
    }

    /// Eviction takes the least recently used plan, not the oldest inserted: a plan
    /// hit since survives while one inserted after it but not used since goes.
    #[test]
    fn a_recently_hit_plan_survives_eviction() {
        let fusion = ClosureFusion::with_capacity(2);
        let (a, b, c) = (inc_over(8, 1), inc_over(16, 1), inc_over(32, 1));
        assert!(!fusion.fuse(&a).unwrap().cached);
        assert!(!fusion.fuse(&b).unwrap().cached);
        assert!(fusion.fuse(&a).unwrap().cached, "a, hit: b is now the least recently used");
        assert!(!fusion.fuse(&c).unwrap().cached, "c evicts b");
        assert!(fusion.fuse(&a).unwrap().cached, "a survived");
        assert!(fusion.fuse(&c).unwrap().cached, "c was kept");
        assert!(!fusion.fuse(&b).unwrap().cached, "b was evicted");
        let stats = fusion.stats();
        assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len), (3, 4, 2, 2));
    }

    /// A capacity of 0 caches nothing, and every fusion is still planned and runs
    /// correctly.
    #[test]
    fn capacity_zero_never_caches_but_still_fuses() {
        let fusion = ClosureFusion::with_capacity(0);
        let twice = |b: u64| {
            let mut r = inc_over(8, b);
            let again = r.kernels[0].clone();
            r.kernels.push(again);
            r
        };
        for round in 0..3u32 {
            let fused = fusion.fuse(&twice(7)).unwrap();
            assert!(!fused.cached, "round {round}");
            let mut bufs = HashMap::from([(7, vec![round; 8])]);
            run(&fused, &mut bufs);
            assert_eq!(bufs[&7], vec![round + 2; 8], "round {round}: both kernels ran");
        }
        let stats = fusion.stats();
        assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len), (0, 3, 0, 0));
    }
}
