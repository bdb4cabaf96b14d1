//! Closure kernels: the native image of a kernel written in Rust, a list of
//! barrier-separated phases plus the scratch memory (local and private) they declare,
//! and the one routine every host driver uses to run a work-group of them.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

use smallvec::SmallVec;

use gantry_driver::{
    AccessMode, Binding, Geometry, ImageKind, ItemCost, Kernel, KernelRef, Scratch, Signature,
};

use crate::fusion::Unfused;
use crate::item::{GroupCtx, Item};

/// A kernel's closure image: [`Kernel::native`] as a [`ClosureKernel`]. Import it to
/// call `kernel.closure()` on a [`Kernel`] or a [`KernelRef`].
///
/// ```
/// use std::sync::Arc;
/// use gantry_driver::{Kernel, KernelRef, Signature};
/// use gantry_host::ClosureImage;
/// let code_only: KernelRef = Arc::new(Kernel::new("code only", Signature::new()));
/// assert!(code_only.closure().is_none());
/// ```
pub trait ClosureImage {
    /// Its closure image, if it has one.
    fn closure(&self) -> Option<&ClosureKernel>;
}

impl ClosureImage for Kernel {
    #[inline]
    fn closure(&self) -> Option<&ClosureKernel> {
        self.native()
    }
}

/// One barrier-separated phase of a kernel, erased: a whole work-group loop (the
/// per-item loop is inside, made generic over the user's closure by [`phase`], so the
/// closure is inlined into it). Run with [`GroupCtx::only`] set, it runs one
/// work-item, which fusion without barriers uses to run several kernels' bodies
/// back to back.
#[derive(Clone)]
pub struct Phase {
    /// Runs the phase for every work-item of a group (or the one in `only`).
    pub group: Arc<dyn Fn(&GroupCtx<'_>) + Send + Sync>,
    /// Whether each work-item's work is independent of the group's other work-items
    /// within the phase (a closure per item), so it may run one item at a time.
    pub per_item: bool,
    /// The closure's type: equal for every submission of the same code, so fusion can
    /// cache by it.
    pub code: TypeId,
    /// Set for an elementwise kernel's phase (see [`ElementwisePhase`]).
    pub elementwise: Option<ElementwisePhase>,
    /// Set for a phase that makes any fused chain slower than its kernels unfused
    /// (a reduction's): the closure fusion compiler refuses the chain with this reason.
    pub unprofitable: Option<SlowerFused>,
    /// Whether the phase reaches its slots as contiguous runs where it can (a map's
    /// loop: ordinary memory, and private memory of one element per work-item), rather
    /// than one accessor call per access (a closure's). The closure fusion compiler
    /// refuses a chain that would bind a slot of a phase that does not to
    /// internalized or shared memory, or a slot of one that does to shared memory: each
    /// access would be mapped out of line
    /// ([`Unprofitable::MappedAccess`](gantry_driver::fusion::Unprofitable::MappedAccess)).
    pub runs: bool,
}

/// The forms of phase that make any fused chain slower than its kernels unfused: the
/// [`Unprofitable`](gantry_driver::fusion::Unprofitable) reasons a phase carries, in
/// one byte (phases are carried by value, and that enum's reasons about a window's
/// size carry figures).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlowerFused {
    /// [`Unprofitable::Reduction`](gantry_driver::fusion::Unprofitable::Reduction).
    Reduction,
    /// [`Unprofitable::Neighborhood`](gantry_driver::fusion::Unprofitable::Neighborhood).
    Neighborhood,
}

impl From<SlowerFused> for gantry_driver::fusion::Unprofitable {
    fn from(form: SlowerFused) -> Self {
        match form {
            SlowerFused::Reduction => Self::Reduction,
            SlowerFused::Neighborhood => Self::Neighborhood,
        }
    }
}

/// What an elementwise phase touches, so fusion knows which internalized buffers it
/// writes whole before anything reads them, and its loop over contiguous runs of
/// elements, so a fused chain can run it span by span without going through
/// [`Phase::group`].
#[derive(Clone)]
pub struct ElementwisePhase {
    /// What it touches.
    pub touches: Elementwise,
    /// Its loop.
    pub map: MapLoop,
}

/// The elementwise loop of a map phase, with its element types erased: `f` of
/// `count` input elements at `src` into `count` output elements at `dst`. It shares
/// the phase's allocation.
#[derive(Clone)]
pub struct MapLoop(pub(crate) Arc<dyn MapRun>);

/// What [`MapLoop`] resolves: implemented by the map phase's body.
pub(crate) trait MapRun: Send + Sync {
    /// The loop compiled for the instruction set in use, and the closure it takes.
    fn resolve(&self) -> (crate::isa::LoopFn, *const ());
}

impl MapLoop {
    /// The loop for the instruction set in use ([`isa`](crate::isa)), bound to its
    /// closure: resolved once, then one indirect call per run of elements. A fused
    /// chain calls each kernel's loop once per span of a few hundred elements, where
    /// a virtual call, the instruction-set dispatch and a slice-building layer per
    /// call would be more instructions than an AVX-512 span's arithmetic (figures:
    /// `docs/PERFORMANCE.md`).
    #[inline]
    pub fn resolve(&self) -> ResolvedMap<'_> {
        let (call, f) = self.0.resolve();
        ResolvedMap { call, f, _loop: PhantomData }
    }
}

/// A [`MapLoop`] bound to its closure and instruction set ([`MapLoop::resolve`]).
#[derive(Clone, Copy)]
pub struct ResolvedMap<'a> {
    call: crate::isa::LoopFn,
    f: *const (),
    _loop: PhantomData<&'a MapLoop>,
}

impl ResolvedMap<'_> {
    /// Maps `count` elements.
    ///
    /// # Safety
    /// `src` must point to `count` live, aligned input elements and `dst` to `count`
    /// live, aligned output elements that nothing else reads or writes meanwhile
    /// (the input may be read concurrently), of the phase's element types.
    #[inline(always)]
    pub unsafe fn run(self, src: *const u8, dst: *mut u8, count: usize) {
        // SAFETY: the caller's contract; `f` is the closure `call` was compiled for,
        // alive while the `MapLoop` is borrowed.
        unsafe { (self.call)(self.f, src, dst, count) }
    }
}

/// What an elementwise phase touches: work-item `i` (its global linear id) reads
/// element `i` (`input_bytes` bytes) of slot `input` and writes element `i`
/// (`output_bytes` bytes) of slot `output`, and nothing else. Sixteen bits each keep
/// a [`Phase`] small (command groups carry them by value); a phase whose numbers do
/// not fit declares nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Elementwise {
    /// The slot read.
    pub input: u16,
    /// The slot written.
    pub output: u16,
    /// Bytes of an input element.
    pub input_bytes: u16,
    /// Bytes of an output element.
    pub output_bytes: u16,
}

impl Elementwise {
    /// The declaration, if every number fits.
    pub fn new(input: u32, output: u32, input_bytes: usize, output_bytes: usize) -> Option<Self> {
        Some(Self {
            input: input.try_into().ok()?,
            output: output.try_into().ok()?,
            input_bytes: input_bytes.try_into().ok()?,
            output_bytes: output_bytes.try_into().ok()?,
        })
    }
}

// Command groups carry phases by value: one cache line each.
const _: () = assert!(std::mem::size_of::<Phase>() <= 64);

/// Wraps a per-work-item closure as a phase.
pub fn phase<F>(f: F) -> Phase
where
    F: Fn(&mut Item<'_>) + Send + Sync + 'static,
{
    // Dropped wherever its last command lets go of it: a panicking capture must not
    // unwind there.
    let f = gantry_driver::contain::Contained::new(f);
    Phase {
        group: Arc::new(move |ctx: &GroupCtx<'_>| ctx.for_each_item(&*f)),
        per_item: true,
        code: TypeId::of::<F>(),
        elementwise: None,
        unprofitable: None,
        runs: false,
    }
}

/// Wraps one per-work-item body given twice (the same code, two closure types) as a
/// phase: `ordinary` runs the groups whose memory is all ordinary, `general` the
/// others ([`GroupCtx::for_each_item_twice`]). Each copy has one call site, so each
/// is inlined into its loop, and the first is vectorized where its accesses allow.
/// `R`: the type of the kernel's range, which may tell its number of dimensions.
/// Made by `parallel_for!` in the engine.
pub fn phase_twice<R: gantry_driver::RangeDims, F, G>(ordinary: F, general: G) -> Phase
where
    F: Fn(&mut Item<'_>) + Send + Sync + 'static,
    G: Fn(&mut Item<'_>) + Send + Sync + 'static,
{
    let (f, g) =
        (gantry_driver::contain::Contained::new(ordinary), gantry_driver::contain::Contained::new(general));
    Phase {
        group: Arc::new(move |ctx: &GroupCtx<'_>| ctx.for_each_item_twice::<R, F, G>(&*f, &*g)),
        per_item: true,
        code: TypeId::of::<F>(),
        elementwise: None,
        unprofitable: None,
        runs: false,
    }
}

/// A kernel image that is Rust code: its phases run in order for a whole work-group,
/// so a barrier between them holds. Cloning shares the phases. A [`Kernel`] carries
/// it as its native image ([`ClosureKernel::into_kernel`], [`ClosureImage::closure`]).
#[derive(Clone)]
pub struct ClosureKernel {
    /// Tag of the command group whose accessors the phases use.
    pub tag: u64,
    /// The phases, in order.
    pub phases: SmallVec<[Phase; 2]>,
    /// Number of accessor slots bound to buffer memory (slots `0..global_slots`).
    pub global_slots: usize,
    /// Scratch slots (local and private accessors number these from 0).
    pub scratch: Vec<Scratch>,
    /// Set on a fused kernel ([`ClosureFusion`](crate::fusion::ClosureFusion) sets
    /// it): the kernels it stands for, which a driver that undid the fused kernel's
    /// failed launch runs one by one, so that the failure keeps what they would have
    /// kept unfused ([`Unfused::rerun`]). `None` for any other kernel.
    pub unfused: Option<Unfused>,
}

impl std::fmt::Debug for ClosureKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClosureKernel")
            .field("phases", &self.phases.len())
            .field("global_slots", &self.global_slots)
            .field("scratch", &self.scratch)
            .field("unfused", &self.unfused)
            .finish()
    }
}

const LINE: usize = 64;
/// Extra bytes after each scratch region: consecutive regions of a page's size would
/// otherwise start at the same offset within a page, and a loop that reads one while
/// writing the next (an elementwise chain through private memory) stalls on 4K
/// aliasing of its loads with its own earlier stores. 17 lines put the next region
/// about a quarter page further on.
const REGION_GAP: usize = 17 * LINE;

/// Bytes from one scratch region's start to the next one's.
fn region_stride(len: usize) -> usize {
    len.next_multiple_of(LINE) + REGION_GAP
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// Reusable, cache-line aligned scratch for running work-groups on one thread.
#[derive(Default)]
pub struct Arena {
    lines: Vec<Line>,
}

impl Arena {
    /// Bytes of scratch it holds (what its largest work-group so far needed).
    pub fn bytes(&self) -> usize {
        self.lines.len() * LINE
    }

    /// At least `bytes` of scratch (initialized, not cleared).
    fn reserve(&mut self, bytes: usize) -> *mut u8 {
        let lines = bytes.div_ceil(LINE);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; LINE]));
        }
        self.lines.as_mut_ptr().cast()
    }
}

impl ClosureKernel {
    /// The kernel `name` with this closure as its only image; `modes` are its global
    /// slots' access modes, in slot order.
    pub fn into_kernel(
        self,
        name: impl Into<Arc<str>>,
        modes: impl IntoIterator<Item = AccessMode>,
        cost: ItemCost,
    ) -> KernelRef {
        let signature = Signature {
            globals: modes.into_iter().collect(),
            scalars: SmallVec::new(),
            memory: self.scratch.iter().copied().collect(),
        };
        Kernel::with_native(name, signature, Some(ImageKind::Closure), self).with_cost(cost).into_ref()
    }

    /// Bytes of scratch one work-group of `local_size` work-items needs.
    pub fn scratch_bytes(&self, local_size: usize) -> usize {
        self.scratch.iter().map(|s| region_stride(s.group_bytes(local_size))).sum()
    }

    /// Runs every phase of work-group `group` (linear id), one phase for all its
    /// work-items before the next. `globals` holds one binding per global slot.
    #[inline]
    pub fn run_group(&self, geometry: &Geometry, group: usize, globals: &[Binding], arena: &mut Arena) {
        if self.scratch.is_empty() {
            // Inlined into the driver's group loop: a tiny kernel (a graph node of one
            // work-item) pays for its body, not for layers of calls around it.
            self.run_phases(geometry, group, globals, &[])
        } else {
            self.run_group_with_scratch(geometry, group, globals, arena)
        }
    }

    #[inline(never)]
    fn run_group_with_scratch(
        &self,
        geometry: &Geometry,
        group: usize,
        globals: &[Binding],
        arena: &mut Arena,
    ) {
        let mut table: SmallVec<[Binding; 16]> = SmallVec::from_elem(Binding::EMPTY, self.scratch.len());
        let local_size = geometry.local_size();
        let mut p = arena.reserve(self.scratch_bytes(local_size));
        for (binding, s) in table.iter_mut().zip(&self.scratch) {
            let len = s.group_bytes(local_size);
            // SAFETY (both): the arena holds the sum of all regions and their gaps.
            if s.zeroed {
                unsafe { std::ptr::write_bytes(p, 0, len) };
            }
            *binding = Binding::new(p, len);
            p = unsafe { p.add(region_stride(len)) };
        }
        self.run_phases(geometry, group, globals, &table)
    }

    #[inline(always)]
    fn run_phases(&self, geometry: &Geometry, group: usize, globals: &[Binding], scratch: &[Binding]) {
        let ctx = GroupCtx::new(geometry, geometry.group_id(group), globals, scratch, self.tag);
        for phase in &self.phases {
            (phase.group)(&ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{Accessor, LocalAccessor, ReadWrite};
    use gantry_driver::{NdRange, ScratchKind};

    /// A two-phase kernel that reverses each work-group's slice through local memory:
    /// correct only if phase 1 finished for the whole group before phase 2.
    #[test]
    fn phases_are_separated_by_a_group_barrier() {
        let data: Vec<u32> = (0..16).collect();
        let mut buf = data.clone();
        let acc = Accessor::<u32, ReadWrite>::new(0, 7, 16);
        let tile = LocalAccessor::<u32>::new(0, 7, 4);
        let kernel = ClosureKernel {
            tag: 7,
            phases: smallvec::smallvec![
                phase(move |it| tile.set(it, it.local_id(0), acc.get(it, it.global_linear_id()))),
                phase(move |it| {
                    let l = it.local_range(0);
                    acc.set(it, it.global_linear_id(), tile.get(it, l - 1 - it.local_id(0)))
                }),
            ],
            global_slots: 1,
            scratch: vec![Scratch::new(ScratchKind::Local, 16)],
            unfused: None,
        };
        let geometry = NdRange::new(16, 4).geometry().unwrap();
        let globals = [Binding::new(buf.as_mut_ptr().cast(), 64)];
        let mut arena = Arena::default();
        for g in 0..geometry.group_count() {
            kernel.run_group(&geometry, g, &globals, &mut arena);
        }
        let expect: Vec<u32> = data.chunks(4).flat_map(|c| c.iter().rev().copied()).collect();
        assert_eq!(buf, expect);
    }
}
