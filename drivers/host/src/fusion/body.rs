//! A fused closure kernel's body: its kernels run per work-group as the plan says
//! (phase after phase, item by item without barriers, or span by span for elementwise
//! chains), and the kernels it stands for when it fails ([`Unfused`]).

use std::sync::{Arc, Mutex};

use gantry_driver::fusion::{FusionRequest, KeptOnFailure, Unprofitable};
use gantry_driver::{AccessMode, Binding, ExecError, Geometry, HostStorage, Internal, KernelRef};
use smallvec::SmallVec;

use super::closure_of;
use super::plan::{FusionPlan, SlotSource};
use crate::closure::{ClosureKernel, Elementwise, ElementwisePhase, ResolvedMap};
use crate::elementwise::contiguous_run;
use crate::item::GroupCtx;
use crate::snapshot::SnapshotPool;

/// One kernel inside a fused kernel.
pub(super) struct Part {
    pub(super) kernel: KernelRef,
    /// The ids and ranges its work-items see.
    pub(super) geometry: Geometry,
    /// The earlier parts it depends on ([`FusionKernel::deps`](gantry_driver::fusion::FusionKernel::deps)).
    pub(super) deps: SmallVec<[u32; 2]>,
    /// Per slot: whether it is on memory that one kernel of the chain reads while
    /// another may write it from other work-groups, bound as [`Internal::Shared`]
    /// ([`shared_reads`]).
    pub(super) shared: SmallVec<[bool; 4]>,
}

impl Part {
    #[inline]
    fn closure(&self) -> &ClosureKernel {
        closure_of(&self.kernel)
    }

    /// Whether the kernel may write through its slot `slot`, by its signature (a slot
    /// past it counts as written).
    fn writes(&self, slot: usize) -> bool {
        self.kernel.signature.globals.get(slot).is_none_or(|m| m.writes())
    }
}

/// The body of a fused closure kernel: the kernels and the (cached) plan that says
/// where their slots point.
pub(super) struct FusedBody {
    pub(super) parts: SmallVec<[Part; 4]>,
    pub(super) plan: Arc<FusionPlan>,
    pub(super) barriers: bool,
    /// Per part, whether the last [`Unfused::rerun`] completed it (`None` before one).
    pub(super) completed: Mutex<Option<SmallVec<[bool; 8]>>>,
}

impl FusedBody {
    pub(super) fn run_group(&self, grid: &GroupCtx<'_>) {
        let plan = &*self.plan;
        // Every kernel's bindings, in one table built once per group.
        let mut table: SmallVec<[Binding; 16]> = SmallVec::from_elem(Binding::EMPTY, plan.slots.len());
        for (binding, s) in table.iter_mut().zip(&plan.slots) {
            *binding = s.bind(grid.bindings, grid.scratch, &plan.internal);
        }
        for (k, part) in self.parts.iter().enumerate() {
            for (slot, _) in part.shared.iter().enumerate().filter(|(_, &shared)| shared) {
                let b = &mut table[plan.slot_start[k] + slot];
                if b.internal == Internal::No {
                    *b = Binding { len: 0, internal: Internal::Shared, wrap: b.len, ..*b };
                }
            }
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
        let mut k = 0;
        while k < self.parts.len() {
            let (run, how) = next_run(&self.parts, plan, self.barriers, k);
            match how {
                How::Stream => self.stream(grid, k..k + run, &table, &ctx),
                How::ItemByItem => {
                    // Without barriers: each work-item runs the single-phase kernels'
                    // bodies back to back.
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
                }
                How::Phases => {
                    let sub = ctx(k);
                    for phase in &self.parts[k].closure().phases {
                        (phase.group)(&sub);
                    }
                }
            }
            k += run;
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
        // Requests ahead pay only for a chain whose global memory the caches do not
        // hold; over memory they hold, they are instructions for nothing.
        let footprint: usize = runs.iter().map(|r| r.input.len + r.output.len).sum();
        let prefetch = crate::isa::stream_prefetch() && footprint >= PREFETCH_FOOTPRINT;
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

/// How a fused body runs a run of its kernels in each work-group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum How {
    /// Elementwise kernels, span by span ([`FusedBody::stream`]).
    Stream,
    /// Single-phase per-work-item kernels without barriers, one work-item at a time,
    /// each running every kernel's body.
    ItemByItem,
    /// One kernel, phase after phase over the whole group.
    Phases,
}

/// The run of kernels from `k` a fused body runs together, and how: its length
/// (at least 1) and [`How`].
pub(super) fn next_run(parts: &[Part], plan: &FusionPlan, barriers: bool, k: usize) -> (usize, How) {
    let streams = plan.streams[k..].iter().take_while(|&&s| s).count();
    if streams > 1 {
        return (streams, How::Stream);
    }
    let interleaves = |p: &Part| !barriers && p.closure().phases.len() == 1 && p.closure().phases[0].per_item;
    let items = parts[k..].iter().take_while(|p| interleaves(p)).count();
    if items > 1 {
        return (items, How::ItemByItem);
    }
    (1, How::Phases)
}

/// The first kernel that makes the fused body slower than the kernels unfused, if
/// one does, and why (the closure fusion compiler then refuses the chain):
///
/// * a kernel that would run item by item with others ([`How::ItemByItem`]): each
///   work-item's body becomes a group loop of one work-item, its bindings looked up
///   again for every work-item;
/// * a kernel with a phase that reaches a slot through accessors
///   ([`Phase::runs`](crate::Phase::runs) false) where the slot is internalized or
///   shared, or through runs where it is shared: every access to it is mapped out of
///   line, a call per access where the kernel unfused does a load.
pub(super) fn unprofitable(
    parts: &[Part],
    plan: &FusionPlan,
    barriers: bool,
) -> Option<(usize, Unprofitable)> {
    let mut k = 0;
    while k < parts.len() {
        let (run, how) = next_run(parts, plan, barriers, k);
        if how == How::ItemByItem {
            return Some((k, Unprofitable::ItemByItem));
        }
        k += run;
    }
    parts.iter().enumerate().find_map(|(k, part)| {
        let slots = &plan.slots[plan.slot_start[k]..plan.slot_start[k + 1]];
        let internal = slots.iter().any(|s| matches!(s, SlotSource::Internal { .. }));
        let shared = part.shared.iter().any(|&s| s);
        let mapped = |p: &crate::closure::Phase| shared || (internal && !p.runs);
        part.closure().phases.iter().any(mapped).then_some((k, Unprofitable::MappedAccess))
    })
}

/// Per kernel of a fusion, per slot: whether it is a read-only slot (by the kernel's
/// signature) on a fused argument that another slot of the chain writes, unless both
/// kernels stream ([`FusionPlan::streams`]: elementwise kernels whose work-item `i`
/// touches only element `i` of the argument, at one offset and element size, so a
/// group reads only what its own work-items write). Other work-groups of the fused
/// kernel may write what such a slot reads, so every slot on that argument (its
/// writers' too) is bound as shared memory ([`Internal::Shared`]): reads and writes
/// through it are relaxed atomics, and an element accessor, whose `&mut` would race
/// with them, panics there. Internal (scratch) slots are each group's own and are not
/// shared.
pub(super) fn shared_reads(request: &FusionRequest, plan: &FusionPlan) -> SmallVec<[SmallVec<[bool; 4]>; 4]> {
    let mode = |k: u32, s: u32| {
        let sig = &request.kernels[k as usize].kernel.signature;
        sig.globals.get(s as usize).copied().unwrap_or(AccessMode::ReadWrite)
    };
    let mut shared: SmallVec<[SmallVec<[bool; 4]>; 4]> = request
        .kernels
        .iter()
        .enumerate()
        .map(|(k, _)| SmallVec::from_elem(false, plan.slot_start[k + 1] - plan.slot_start[k]))
        .collect();
    for (.., uses) in &plan.args {
        let read_while_written = uses.iter().any(|&(k, s)| {
            let own_elements = |k2: u32| plan.streams[k as usize] && plan.streams[k2 as usize];
            let racing =
                |&(k2, s2): &(u32, u32)| (k2, s2) != (k, s) && mode(k2, s2).writes() && !own_elements(k2);
            !mode(k, s).writes() && uses.iter().any(racing)
        });
        // Every slot on such an argument, its writers' included: a write that another
        // work-group may read meanwhile must be atomic too.
        if read_while_written {
            for &(k, s) in uses.iter() {
                shared[k as usize][s as usize] = true;
            }
        }
    }
    shared
}

/// The kernels a fused closure kernel stands for, and where its arguments bind
/// their slots ([`ClosureKernel::unfused`]): what a driver needs to run them one by
/// one when the fused kernel fails ([`Unfused::rerun`]), so that the failure keeps
/// exactly the results the kernels would have kept unfused.
#[derive(Clone)]
pub struct Unfused(pub(super) Arc<FusedBody>);

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

    /// Whether it stands for none (never, for a kernel [`ClosureFusion`](super::ClosureFusion) built).
    pub fn is_empty(&self) -> bool {
        self.0.parts.is_empty()
    }

    /// Runs the kernels of a fused kernel that failed one by one, unfused, in list
    /// order, each over its own geometry and its own slots of the fused kernel's
    /// arguments, as the scheduler would have run them: a kernel whose dependency
    /// ([`FusionKernel::deps`](gantry_driver::fusion::FusionKernel::deps)) failed or was
    /// skipped is skipped; one that fails has its writes undone (from a snapshot of its own); independent kernels keep
    /// theirs. An internalized buffer, which has no global memory, is zeroed memory
    /// of its range's size for the rerun, dropped after (internalized contents are
    /// not written back, as in the fused kernel).
    ///
    /// `globals` are the fused launch's bindings (one per argument; only the slots a
    /// kernel writes are snapshotted), and `launch` runs one kernel over all its
    /// work-groups, its panic caught and returned as its error, leaving its writes.
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
        snapshots: &Arc<SnapshotPool>,
        mut launch: impl FnMut(&KernelRef, &Geometry, &[Binding]) -> Result<(), ExecError>,
    ) -> Option<Result<(), ExecError>> {
        let FusedBody { parts, plan, .. } = &*self.0;
        if !self.fits(globals) {
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
            for (s, &slot) in slots.iter().enumerate() {
                match slot {
                    SlotSource::Arg { index, offset, len } => {
                        // SAFETY: the arguments have the fused kernel's sizes (checked
                        // above).
                        let b = unsafe { slot_of(globals, index, offset, len) };
                        if part.writes(s) {
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

    /// The memory the fused kernel may write, given its launch's bindings `globals`
    /// (one per argument): its kernels' writable slots, overlapping ones merged.
    /// An argument is the hull of its slots, and other commands may write its gaps
    /// while the fused kernel runs (the scheduler orders commands by the kernels'
    /// own ranges), so a snapshot for [`Unfused::rerun`] takes these ranges, never
    /// the arguments whole. `None` if `globals` do not have the fused kernel's
    /// arguments' sizes.
    pub fn written(&self, globals: &[Binding]) -> Option<SmallVec<[Binding; 4]>> {
        if !self.fits(globals) {
            return None;
        }
        let FusedBody { parts, plan, .. } = &*self.0;
        let mut ranges: SmallVec<[(usize, usize); 8]> = SmallVec::new();
        for (k, part) in parts.iter().enumerate() {
            let slots = &plan.slots[plan.slot_start[k]..plan.slot_start[k + 1]];
            for (s, &slot) in slots.iter().enumerate() {
                if let (true, SlotSource::Arg { index, offset, len }) = (part.writes(s), slot) {
                    // SAFETY: the arguments have the fused kernel's sizes (checked
                    // above).
                    let start = unsafe { slot_of(globals, index, offset, len) }.ptr as usize;
                    ranges.push((start, start + len));
                }
            }
        }
        ranges.sort_unstable();
        let mut merged: SmallVec<[Binding; 4]> = SmallVec::new();
        let mut open: Option<(usize, usize)> = None;
        for (start, end) in ranges {
            match &mut open {
                Some((_, e)) if start <= *e => *e = (*e).max(end),
                _ => {
                    let done = open.replace((start, end));
                    merged.extend(done.map(|(s, e)| Binding::new(s as *mut u8, e - s)));
                }
            }
        }
        merged.extend(open.map(|(s, e)| Binding::new(s as *mut u8, e - s)));
        Some(merged)
    }

    /// Whether `globals` have the fused kernel's arguments' sizes, one per argument.
    fn fits(&self, globals: &[Binding]) -> bool {
        let args = &self.0.plan.args;
        globals.len() == args.len()
            && globals.iter().zip(args).all(|(g, &(_, start, end, _))| g.len == end - start)
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

/// Slot `offset..offset + len` of argument `index` of `globals`.
///
/// # Safety
/// The range must lie inside the argument's binding.
unsafe fn slot_of(globals: &[Binding], index: u32, offset: usize, len: usize) -> Binding {
    let g = globals[index as usize];
    // SAFETY: the caller's contract.
    Binding::new(unsafe { g.ptr.add(offset) }, len)
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
/// element size, or 0 for a span-local intermediate ([`FusionPlan::span_local`]), which
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
pub(super) fn span_within(span: usize, local_bytes: usize) -> usize {
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

/// The least global memory (bytes of the runs' input and output ranges, counting a
/// buffer each time a kernel reads or writes it) for which a streamed chain requests
/// memory ahead: less stays in the caches, where the requests only cost (figures:
/// `docs/PERFORMANCE.md`).
const PREFETCH_FOOTPRINT: usize = 16 << 20;

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
