//! The command-group builder: accessors, one action, dependencies. Everything is
//! validated when the group is submitted; the first problem is returned as an
//! [`Error`] and nothing is enqueued.

use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use bytemuck::Pod;
use gantry_components::{ByteRange, CommandKind, EventShared, Requirement, RequirementList, SyncCell, Work};
use gantry_driver::fusion::Promotion;
use gantry_driver::{
    AccessMode, Geometry, HostCtx, HostStorage, ImageKind, KernelRef, NdRange, Range, RangeDims, ScalarArgs,
    ScalarBlock, ScalarMismatch, Scratch, ScratchKind,
};
use gantry_host::{
    phase, phase_twice, Accessor, BufferSlot, ClosureKernel, DiscardWrite, ElemAccessor, HostAccessor, Item,
    LocalAccessor, Mode, Phase, PrivateAccessor, Read, ReadWrite, Write,
};
use smallvec::SmallVec;

use crate::buffer::{Buffer, Readback, ReadbackSlot};
use crate::error::{Error, Result};
use crate::event::Event;

/// A shared `Arc<str>` for a fixed name, allocated once per process, so default
/// command names cost a reference count, not an allocation.
macro_rules! static_name {
    ($s:literal) => {{
        static NAME: std::sync::OnceLock<Arc<str>> = std::sync::OnceLock::new();
        NAME.get_or_init(|| Arc::from($s)).clone()
    }};
}

pub(crate) use gantry_components::KeepAlive;

/// The action a command group performs.
// One per command group, built and consumed by its submission and never stored in
// bulk: boxing the kernel variant would cost an allocation per submission to save
// stack space.
#[allow(clippy::large_enum_variant)]
enum Action {
    Kernel {
        name: Arc<str>,
        geometry: std::result::Result<Geometry, Error>,
        phases: SmallVec<[Phase; 2]>,
    },
    Launch {
        kernel: KernelRef,
        geometry: std::result::Result<Geometry, Error>,
        scalars: ScalarArgs,
        refused: Option<ScalarMismatch>,
    },
    HostTask {
        name: Arc<str>,
        run: gantry_components::command::HostFn,
    },
    Copy,
    CopyFromHost(Arc<HostStorage>),
    CopyToHost(Arc<HostStorage>),
    Fill(SmallVec<[u8; 16]>),
}

impl Action {
    fn label(&self) -> &'static str {
        match self {
            Action::Kernel { .. } | Action::Launch { .. } => "kernel",
            Action::HostTask { .. } => "host_task",
            Action::Copy | Action::CopyFromHost(_) | Action::CopyToHost(_) => "copy",
            Action::Fill(_) => "fill",
        }
    }
}

/// An exclusive element accessor's slot, checked against the kernel size at submit.
struct ElemCheck {
    slot: usize,
    len: usize,
}

/// Builds one command group: declare the memory it uses (accessors), at most one
/// action (a kernel, host task, copy or fill; none makes an empty command that
/// completes after its dependencies), and extra event dependencies.
///
/// ```
/// use gantry::{Runtime, NdRange};
/// let rt = Runtime::new();
/// let q = rt.queue();
/// let input = rt.buffer(&(0..64).map(|i| i as f32).collect::<Vec<_>>());
/// let sums = rt.buffer_zeroed::<f32>(4);
/// // Work-group reduction: phase 1 loads a tile into local memory, phase 2 (after
/// // the implicit group barrier) sums it.
/// q.submit(|cg| {
///     let x = cg.read(&input);
///     let out = cg.write(&sums);
///     let tile = cg.local::<f32>(16);
///     cg.parallel_for_work_group(NdRange::new(64, 16))
///         .phase(move |it| tile.set(it, it.local_id(0), x.get(it, it.global_id(0))))
///         .phase(move |it| {
///             if it.local_id(0) == 0 {
///                 let s: f32 = (0..16).map(|i| tile.get(it, i)).sum();
///                 out.set(it, it.group_id(0), s);
///             }
///         });
/// })?;
/// let expect: Vec<f32> = (0..4).map(|g| (g * 16..g * 16 + 16).map(|i| i as f32).sum()).collect();
/// assert_eq!(sums.to_vec()?, expect);
/// # Ok::<(), gantry::Error>(())
/// ```
pub struct Handler {
    runtime: u64,
    tag: u64,
    pub(crate) requirements: RequirementList,
    scratch: Vec<Scratch>,
    elems: SmallVec<[ElemCheck; 2]>,
    pub(crate) waits: SmallVec<[Arc<EventShared>; 1]>,
    action: Option<Action>,
    error: Option<Error>,
    name: Option<Arc<str>>,
    readback: Option<(ReadbackSlot, Arc<HostStorage>)>,
    item_cost_ns: Option<f64>,
    /// The graph this group becomes a node of (explicit `add` or recording).
    graph: Option<u64>,
    /// Buffer handles a graph node keeps alive.
    pub(crate) keep: Vec<KeepAlive>,
    /// Recorded events named by `depends_on`: graph edges.
    pub(crate) graph_waits: SmallVec<[crate::graph::Node; 1]>,
    /// The queue it is submitted to (not for graph nodes): a host task's scope.
    pub(crate) queue: Option<u64>,
}

/// Resolves a range expression over `len` elements to `start..end`.
fn bounds(r: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start, end)
}

/// A tag no other command group of any runtime in this process has: an accessor
/// carries its group's tag, and a kernel or host task reaches memory only through
/// accessors whose tag is its own, so one taken out of its group (even into another
/// runtime) never reaches a buffer.
pub(crate) fn next_tag() -> u64 {
    static NEXT_TAG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT_TAG.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Handler {
    pub(crate) fn new(runtime: u64, tag: u64) -> Self {
        Self {
            runtime,
            tag,
            requirements: SmallVec::new(),
            scratch: Vec::new(),
            elems: SmallVec::new(),
            waits: SmallVec::new(),
            action: None,
            error: None,
            name: None,
            readback: None,
            item_cost_ns: None,
            graph: None,
            keep: Vec::new(),
            graph_waits: SmallVec::new(),
            queue: None,
        }
    }

    /// A builder for a node of graph `graph`.
    pub(crate) fn for_graph(runtime: u64, tag: u64, graph: u64) -> Self {
        Self { graph: Some(graph), ..Self::new(runtime, tag) }
    }

    fn fail(&mut self, e: Error) {
        self.error.get_or_insert(e);
    }

    fn set_action(&mut self, a: Action) {
        match &self.action {
            Some(prev) => self.fail(Error::MultipleActions { first: prev.label(), second: a.label() }),
            None => self.action = Some(a),
        }
    }

    /// Adds a requirement and returns its slot and element count (0 after an error).
    fn require<T: Pod>(
        &mut self,
        buf: &Buffer<T>,
        mode: AccessMode,
        range: impl RangeBounds<usize>,
        what: &'static str,
    ) -> (u32, usize) {
        if buf.runtime_id() != self.runtime {
            self.fail(Error::ForeignObject("a buffer"));
            return (0, 0);
        }
        let (start, end) = bounds(range, buf.len());
        if start > end || end > buf.len() {
            self.fail(Error::OutOfBounds { what, buffer: buf.id(), start, end, len: buf.len() });
            return (0, 0);
        }
        if start == end {
            self.fail(Error::EmptyRange { what, buffer: buf.id() });
            return (0, 0);
        }
        if self.graph.is_some() {
            self.keep.push(buf.keep_alive());
        }
        let size = std::mem::size_of::<T>();
        let range = ByteRange { start: start * size, end: end * size };
        let slot = self.requirements.len();
        let mut req = Requirement::new(buf.core().clone(), mode, range);
        req.elem_size = size as u32;
        req.promotion = buf.core().promotion();
        self.requirements.push(req);
        (slot as u32, end - start)
    }

    /// Names the command (errors, traces and profiles use it).
    pub fn name(&mut self, name: impl Into<Arc<str>>) -> &mut Self {
        self.name = Some(name.into());
        self
    }

    /// Declares the virtual cost of one work-item of this command group's kernel, in
    /// nanoseconds, for simulated devices' cost models (ignored elsewhere). For a host
    /// task it is the task's whole duration on a simulated host pool.
    pub fn item_cost_ns(&mut self, ns: f64) -> &mut Self {
        self.item_cost_ns = Some(ns);
        self
    }

    /// Hints that, when this kernel is fused, the accessor's buffer range is only
    /// needed inside the fused kernel (the DPC++ kernel-fusion design,
    /// "Internalization"): each element is touched by one work-group
    /// ([`Promotion::Local`]) or one work-item ([`Promotion::Private`]), and the
    /// contents are not needed afterwards, so they are kept in scratch memory and not
    /// written back. Overrides the buffer's hint ([`Buffer::set_promotion`]). Outside
    /// fusion it has no effect.
    ///
    /// On the CPU, elementwise kernels (`map`..`map4`) reach private memory as
    /// contiguous runs; per-work-item closures would reach it one mapped access at a
    /// time, so a chain of them is refused as unprofitable
    /// ([`RuntimeBuilder::fuse_unprofitable`](crate::RuntimeBuilder::fuse_unprofitable)).
    ///
    /// ```
    /// use gantry::{Promotion, Runtime, FusionProps};
    /// let rt = Runtime::new();
    /// let q = rt.in_order_queue();
    /// let n = 1 << 16; // the CPU runs windows of launch-bound kernels unfused
    /// let (x, tmp, out) = (rt.buffer(&vec![1u32; n]), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    /// q.start_fusion()?;
    /// q.submit(|cg| {
    ///     let (x, t) = (cg.read(&x), cg.elements_out(&tmp));
    ///     cg.promote(&t, Promotion::Private);
    ///     cg.map(&x, &t, |v| v + 1);
    /// })?;
    /// q.submit(|cg| {
    ///     let (t, o) = (cg.read(&tmp), cg.elements_out(&out));
    ///     cg.promote(&t, Promotion::Private);
    ///     cg.map(&t, &o, |v| v * 10);
    /// })?;
    /// q.complete_fusion(FusionProps::default())?.wait()?;
    /// assert_eq!(out.to_vec()?, vec![20; n]);
    /// assert_eq!(tmp.to_vec()?, vec![0; n], "internalized: never written back");
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn promote(&mut self, accessor: &impl BufferSlot, promotion: Promotion) -> &mut Self {
        let (slot, tag) = accessor.slot_and_tag();
        match self.requirements.get_mut(slot as usize) {
            Some(r) if tag == self.tag => r.promotion = promotion,
            _ => self.fail(Error::ForeignObject("an accessor")),
        }
        self
    }

    /// The command also waits for `event` (which may belong to any queue). While
    /// recording into a graph, `event` must be the event of a node of that graph (the
    /// dependency becomes an edge); an event of a recorded node is an error anywhere
    /// else.
    pub fn depends_on(&mut self, event: &Event) -> &mut Self {
        if event.shared().runtime != self.runtime {
            self.fail(Error::ForeignObject("an event"));
            return self;
        }
        match (event.node, self.graph) {
            (Some(node), Some(g)) if node.graph == g => self.graph_waits.push(node),
            (Some(_), _) => self.fail(Error::RecordedEvent(event.name().to_string())),
            (None, Some(_)) => self.fail(Error::EventOutsideGraph(event.name().to_string())),
            (None, None) => self.waits.push(event.shared().clone()),
        }
        self
    }

    /// A kernel accessor in mode `M` over `range` of `buf`.
    pub fn access<T: Pod, M: Mode>(
        &mut self,
        buf: &Buffer<T>,
        range: impl RangeBounds<usize>,
    ) -> Accessor<T, M> {
        let (slot, len) = self.require(buf, M::MODE, range, "accessor");
        Accessor::new(slot, self.tag, len)
    }
    /// Reads all of `buf`.
    pub fn read<T: Pod>(&mut self, buf: &Buffer<T>) -> Accessor<T, Read> {
        self.access(buf, ..)
    }
    /// Writes (some of) `buf`; unwritten elements keep their values.
    pub fn write<T: Pod>(&mut self, buf: &Buffer<T>) -> Accessor<T, Write> {
        self.access(buf, ..)
    }
    /// Reads and writes `buf`.
    pub fn read_write<T: Pod>(&mut self, buf: &Buffer<T>) -> Accessor<T, ReadWrite> {
        self.access(buf, ..)
    }
    /// Overwrites `buf`; its previous contents are not made available.
    pub fn discard_write<T: Pod>(&mut self, buf: &Buffer<T>) -> Accessor<T, DiscardWrite> {
        self.access(buf, ..)
    }

    /// An exclusive per-work-item accessor over `range` of `buf`, one element per
    /// work-item (work-item `i` gets element `i` of the range), in mode `M`.
    pub fn elements<T: Pod, M: gantry_host::Writable>(
        &mut self,
        buf: &Buffer<T>,
        range: impl RangeBounds<usize>,
    ) -> ElemAccessor<T, M> {
        let (slot, len) = self.require(buf, M::MODE, range, "element accessor");
        self.elems.push(ElemCheck { slot: slot as usize, len });
        ElemAccessor::new(slot, self.tag, len)
    }
    /// Exclusive read-write access to each work-item's own element of `buf`.
    pub fn elements_mut<T: Pod>(&mut self, buf: &Buffer<T>) -> ElemAccessor<T, ReadWrite> {
        self.elements(buf, ..)
    }
    /// Exclusive write-only access to each work-item's own element of `buf`, whose
    /// previous contents are discarded.
    pub fn elements_out<T: Pod>(&mut self, buf: &Buffer<T>) -> ElemAccessor<T, DiscardWrite> {
        self.elements(buf, ..)
    }

    /// A host-task accessor in mode `M` over `range` of `buf`.
    pub fn host_access<T: Pod, M: Mode>(
        &mut self,
        buf: &Buffer<T>,
        range: impl RangeBounds<usize>,
    ) -> HostAccessor<T, M> {
        let (slot, len) = self.require(buf, M::MODE, range, "host accessor");
        HostAccessor::new(slot, self.tag, len)
    }
    /// A host task reads all of `buf`.
    pub fn host_read<T: Pod>(&mut self, buf: &Buffer<T>) -> HostAccessor<T, Read> {
        self.host_access(buf, ..)
    }
    /// A host task reads and writes all of `buf`.
    pub fn host_read_write<T: Pod>(&mut self, buf: &Buffer<T>) -> HostAccessor<T, ReadWrite> {
        self.host_access(buf, ..)
    }
    /// A host task overwrites all of `buf`.
    pub fn host_discard_write<T: Pod>(&mut self, buf: &Buffer<T>) -> HostAccessor<T, DiscardWrite> {
        self.host_access(buf, ..)
    }

    /// Work-group local memory of `len` elements (ND-range kernels only).
    pub fn local<T: Pod>(&mut self, len: usize) -> LocalAccessor<T> {
        let slot = self.scratch.len() as u32;
        let bytes = self.scratch_bytes::<T>(len, "local memory");
        self.scratch.push(Scratch::new(ScratchKind::Local, bytes));
        LocalAccessor::new(slot, self.tag, len)
    }

    /// `len` elements of `T` in bytes; an overflow fails the command group.
    fn scratch_bytes<T: Pod>(&mut self, len: usize, what: &'static str) -> usize {
        let elem_size = std::mem::size_of::<T>();
        len.checked_mul(elem_size).unwrap_or_else(|| {
            self.fail(Error::SizeOverflow { what, count: len, elem_size });
            0
        })
    }

    /// Private memory of `len` elements per work-item, kept across phases.
    pub fn private<T: Pod>(&mut self, len: usize) -> PrivateAccessor<T> {
        let slot = self.scratch.len() as u32;
        let bytes = self.scratch_bytes::<T>(len, "private memory");
        self.scratch.push(Scratch::new(ScratchKind::Private, bytes));
        PrivateAccessor::new(slot, self.tag, len)
    }

    fn kernel_name(&self, default: Arc<str>) -> Arc<str> {
        self.name.clone().unwrap_or(default)
    }

    /// Runs `f` once per work-item of `range` (1–3 dimensions).
    pub fn parallel_for<F>(&mut self, range: impl Into<Range>, f: F)
    where
        F: Fn(&mut Item<'_>) + Send + Sync + 'static,
    {
        let geometry = Geometry::for_range(range.into()).map_err(Error::from);
        self.set_action(Action::Kernel {
            name: self.kernel_name(static_name!("parallel_for")),
            geometry,
            phases: smallvec::smallvec![phase(f)],
        });
    }

    /// [`Handler::parallel_for`] with the body given twice, the same code as two
    /// closures: [`parallel_for!`](crate::parallel_for) writes it. On the CPU the
    /// first copy runs the work-groups whose memory is all ordinary, in a loop with
    /// nothing that calls out and goes on, so that a body of own-element accesses
    /// ([`Accessor::at`], [`ElemAccessor::elem`]) is vectorized; the second runs the
    /// rest (a fused kernel's internalized or shared memory). Each copy has one call
    /// site, so each is inlined into its loop: a single closure in two loops would
    /// not be.
    pub fn parallel_for_twice<R, F, G>(&mut self, range: R, ordinary: F, general: G)
    where
        R: RangeDims,
        F: Fn(&mut Item<'_>) + Send + Sync + 'static,
        G: Fn(&mut Item<'_>) + Send + Sync + 'static,
    {
        let geometry = Geometry::for_range(range.into()).map_err(Error::from);
        self.set_action(Action::Kernel {
            name: self.kernel_name(static_name!("parallel_for")),
            geometry,
            phases: smallvec::smallvec![phase_twice::<R, F, G>(ordinary, general)],
        });
    }

    /// Runs `f` once per work-item of an ND-range (with work-group ids and sizes).
    pub fn parallel_for_nd<F>(&mut self, nd: NdRange, f: F)
    where
        F: Fn(&mut Item<'_>) + Send + Sync + 'static,
    {
        let geometry = nd.geometry().map_err(Error::from);
        self.set_action(Action::Kernel {
            name: self.kernel_name(static_name!("parallel_for_nd")),
            geometry,
            phases: smallvec::smallvec![phase(f)],
        });
    }

    /// A work-group kernel: add phases with [`Phases::phase`]; each phase runs for
    /// every work-item of a group before the next starts (a group barrier between).
    pub fn parallel_for_work_group(&mut self, nd: NdRange) -> Phases<'_> {
        let geometry = nd.geometry().map_err(Error::from);
        let active = self.action.is_none();
        self.set_action(Action::Kernel {
            name: self.kernel_name(static_name!("work_group_kernel")),
            geometry,
            phases: SmallVec::new(),
        });
        Phases { handler: self, active }
    }

    /// Runs `f` once, as a kernel of one work-item.
    pub fn single_task<F>(&mut self, f: F)
    where
        F: Fn(&mut Item<'_>) + Send + Sync + 'static,
    {
        let geometry = Geometry::for_range(Range::d1(1)).map_err(Error::from);
        self.set_action(Action::Kernel {
            name: self.kernel_name(static_name!("single_task")),
            geometry,
            phases: smallvec::smallvec![phase(f)],
        });
    }

    /// An elementwise kernel: work-item `i` writes `f(input[i])` to element `i` of
    /// `output`, for every element of `output`. The runtime owns the loop, so each
    /// work-group runs as one loop over contiguous memory that the compiler vectorizes,
    /// also inside a fused kernel whose intermediate buffers were promoted to private
    /// memory (one element per work-item). `input` must have at least as many
    /// elements as `output`.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// let (x, y) = (rt.buffer(&[1.0f32, 2.0, 3.0]), rt.buffer_zeroed::<f32>(3));
    /// rt.queue().submit(|cg| {
    ///     let (x, y) = (cg.read(&x), cg.elements_out(&y));
    ///     cg.map(&x, &y, |v| v * 0.5 + 1.0);
    /// })?.wait()?;
    /// assert_eq!(y.to_vec()?, vec![1.5, 2.0, 2.5]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn map<T, U, MI, MO, F>(&mut self, input: &Accessor<T, MI>, output: &ElemAccessor<U, MO>, f: F)
    where
        T: Pod,
        U: Pod,
        MI: gantry_host::Readable,
        MO: gantry_host::Writable,
        F: Fn(T) -> U + Send + Sync + 'static,
    {
        let phase = gantry_host::map_phase(*input, *output, f);
        self.elementwise(static_name!("map"), &[(input.slot_and_tag().1, input.len())], output, phase);
    }

    /// A two-input elementwise kernel: work-item `i` writes `f(a[i], b[i])` to element
    /// `i` of `output`, for every element of `output`. Like [`Handler::map`], the runtime
    /// owns the loop (one loop over contiguous memory per work-group, vectorized where
    /// the arithmetic allows); elements may be any `Pod` type, structs included. Every
    /// input must have at least as many elements as `output`.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// let (x, y) = (rt.buffer(&[1.0f32, 2.0, 3.0]), rt.buffer(&[[0.5f32, 1.0]; 3]));
    /// let out = rt.buffer_zeroed::<f32>(3);
    /// rt.queue().submit(|cg| {
    ///     let (x, y, o) = (cg.read(&x), cg.read(&y), cg.elements_out(&out));
    ///     cg.map2(&x, &y, &o, |x, [a, b]: [f32; 2]| x * a + b);
    /// })?.wait()?;
    /// assert_eq!(out.to_vec()?, vec![1.5, 2.0, 2.5]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn map2<A, B, U, MA, MB, MO, F>(
        &mut self,
        a: &Accessor<A, MA>,
        b: &Accessor<B, MB>,
        output: &ElemAccessor<U, MO>,
        f: F,
    ) where
        A: Pod,
        B: Pod,
        U: Pod,
        MA: gantry_host::Readable,
        MB: gantry_host::Readable,
        MO: gantry_host::Writable,
        F: Fn(A, B) -> U + Send + Sync + 'static,
    {
        let inputs = [(a.slot_and_tag().1, a.len()), (b.slot_and_tag().1, b.len())];
        let phase = gantry_host::map2_phase(*a, *b, *output, f);
        self.elementwise(static_name!("map2"), &inputs, output, phase);
    }

    /// A three-input elementwise kernel: `output[i] = f(a[i], b[i], c[i])` (see
    /// [`Handler::map2`]).
    pub fn map3<A, B, C, U, MA, MB, MC, MO, F>(
        &mut self,
        a: &Accessor<A, MA>,
        b: &Accessor<B, MB>,
        c: &Accessor<C, MC>,
        output: &ElemAccessor<U, MO>,
        f: F,
    ) where
        A: Pod,
        B: Pod,
        C: Pod,
        U: Pod,
        MA: gantry_host::Readable,
        MB: gantry_host::Readable,
        MC: gantry_host::Readable,
        MO: gantry_host::Writable,
        F: Fn(A, B, C) -> U + Send + Sync + 'static,
    {
        let inputs =
            [(a.slot_and_tag().1, a.len()), (b.slot_and_tag().1, b.len()), (c.slot_and_tag().1, c.len())];
        let phase = gantry_host::map3_phase(*a, *b, *c, *output, f);
        self.elementwise(static_name!("map3"), &inputs, output, phase);
    }

    /// A four-input elementwise kernel: `output[i] = f(a[i], b[i], c[i], d[i])` (see
    /// [`Handler::map2`]).
    #[allow(clippy::too_many_arguments)]
    pub fn map4<A, B, C, D, U, MA, MB, MC, MD, MO, F>(
        &mut self,
        a: &Accessor<A, MA>,
        b: &Accessor<B, MB>,
        c: &Accessor<C, MC>,
        d: &Accessor<D, MD>,
        output: &ElemAccessor<U, MO>,
        f: F,
    ) where
        A: Pod,
        B: Pod,
        C: Pod,
        D: Pod,
        U: Pod,
        MA: gantry_host::Readable,
        MB: gantry_host::Readable,
        MC: gantry_host::Readable,
        MD: gantry_host::Readable,
        MO: gantry_host::Writable,
        F: Fn(A, B, C, D) -> U + Send + Sync + 'static,
    {
        let inputs = [
            (a.slot_and_tag().1, a.len()),
            (b.slot_and_tag().1, b.len()),
            (c.slot_and_tag().1, c.len()),
            (d.slot_and_tag().1, d.len()),
        ];
        let phase = gantry_host::map4_phase(*a, *b, *c, *d, *output, f);
        self.elementwise(static_name!("map4"), &inputs, output, phase);
    }

    /// A stencil over a `rows × cols` grid (row-major): work-item `(y, x)` writes
    /// `f(&n)` to element `y * cols + x` of `output`, where `n` is the 3×3
    /// [`Neighborhood`](crate::Neighborhood) of input element `(y, x)`:
    /// `n.at(dy, dx)` reads a neighbour (`dy`, `dx` in -1..=1), clamped to the grid at
    /// its border, and `n.is_border()` tells whether the cell is on it. The runtime
    /// owns the loop: a work-group's interior cells run as one loop over three rows of
    /// the input with no bounds check per neighbour, vectorized where the arithmetic
    /// allows (`docs/PERFORMANCE.md` compares it with a serial loop and with
    /// `parallel_for!`). `output` must have exactly `rows × cols` elements and `input`
    /// at least that many ([`Error::StencilGrid`] otherwise). A stencil is not fused
    /// with other kernels
    /// ([`Unprofitable::Neighborhood`](gantry_driver::fusion::Unprofitable::Neighborhood)):
    /// its cells read what other work-groups of a fused chain would write.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// let (rows, cols) = (4, 5);
    /// let heat = rt.buffer(&(0..20).map(|i| i as f32).collect::<Vec<_>>());
    /// let next = rt.buffer_zeroed::<f32>(rows * cols);
    /// rt.queue().submit(|cg| {
    ///     let (src, dst) = (cg.read(&heat), cg.elements_out(&next));
    ///     // Diffusion with fixed borders.
    ///     cg.stencil(&src, &dst, [rows, cols], |n| {
    ///         let c = n.center();
    ///         if n.is_border() { c } else { c + 0.1 * (n.at(-1, 0) + n.at(1, 0) + n.at(0, -1) + n.at(0, 1) - 4.0 * c) }
    ///     });
    /// })?.wait()?;
    /// let out = next.to_vec()?;
    /// assert_eq!((out[0], out[6]), (0.0, 6.0)); // a border cell; an interior one of a linear ramp
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn stencil<T, U, MI, MO, F>(
        &mut self,
        input: &Accessor<T, MI>,
        output: &ElemAccessor<U, MO>,
        [rows, cols]: [usize; 2],
        f: F,
    ) where
        T: Pod,
        U: Pod,
        MI: gantry_host::Readable,
        MO: gantry_host::Writable,
        F: Fn(&gantry_host::Neighborhood<'_, T>) -> U + Send + Sync + 'static,
    {
        let (input_len, output_len) = (input.len(), output.len());
        let geometry = match rows.checked_mul(cols) {
            Some(cells) if cells == output_len && input_len >= cells => {
                Geometry::for_range(Range::d2(rows, cols)).map_err(Error::from)
            }
            _ => Err(Error::StencilGrid { rows, cols, input: input_len, output: output_len }),
        };
        let phase = gantry_host::stencil_phase(*input, *output, [rows, cols], f);
        let tags = [input.slot_and_tag().1, output.slot_and_tag().1];
        self.owned_loop(static_name!("stencil"), &tags, geometry, phase);
    }

    /// Sets an elementwise kernel `name` running `phase` over `output` with `inputs`
    /// (tag, length): a plain range of the output's length; a foreign accessor or a
    /// short input fails the group.
    fn elementwise<U, MO>(
        &mut self,
        name: Arc<str>,
        inputs: &[(u64, usize)],
        output: &ElemAccessor<U, MO>,
        phase: gantry_host::Phase,
    ) where
        U: Pod,
        MO: gantry_host::Writable,
    {
        let geometry = match inputs.iter().find(|&&(_, len)| len < output.len()) {
            Some(&(_, len)) => Err(Error::MapInputTooShort { input: len, output: output.len() }),
            None => Geometry::for_range(Range::d1(output.len())).map_err(Error::from),
        };
        let mut tags: SmallVec<[u64; 5]> = inputs.iter().map(|&(tag, _)| tag).collect();
        tags.push(output.slot_and_tag().1);
        self.owned_loop(name, &tags, geometry, phase);
    }

    /// Sets a kernel whose loop the runtime owns: `phase` alone, over `geometry`,
    /// named `name` unless the user named it; an accessor of another command group
    /// (`tags`: those of its accessors) fails the group.
    fn owned_loop(
        &mut self,
        name: Arc<str>,
        tags: &[u64],
        geometry: Result<Geometry>,
        phase: gantry_host::Phase,
    ) {
        if tags.iter().any(|&tag| tag != self.tag) {
            self.fail(Error::ForeignObject("an accessor"));
        }
        self.set_action(Action::Kernel {
            name: self.kernel_name(name),
            geometry,
            phases: smallvec::smallvec![phase],
        });
    }

    /// A reduction: element 0 of `output` becomes the combination by `op` of every
    /// element of `input` ([`Sum`](gantry_host::Sum), [`Min`](gantry_host::Min),
    /// [`Max`](gantry_host::Max), or any associative function with its identity,
    /// [`Custom`](gantry_host::Custom)); its previous contents are replaced. The input
    /// is folded in fixed-size chunks, spread over the worker threads, and the
    /// partials combined in a fixed order (`gantry_host::reduce`), so the result does
    /// not depend on the number of threads; for floats it may differ in its last bits
    /// from a serial left fold. A reduction is not fused with other kernels
    /// ([`Unprofitable::Reduction`](gantry_driver::fusion::Unprofitable::Reduction)):
    /// put a map in front with [`Handler::map_reduce`].
    ///
    /// ```
    /// use gantry::host::{Max, Sum};
    /// let rt = gantry::Runtime::new();
    /// let x = rt.buffer(&(1..=1000).map(|i| i as f32).collect::<Vec<_>>());
    /// let out = rt.buffer_zeroed::<f32>(2);
    /// let q = rt.queue();
    /// q.submit(|cg| {
    ///     let (x, o) = (cg.read(&x), cg.access::<f32, gantry::Write>(&out, 0..1));
    ///     cg.reduce(&x, &o, Sum);
    /// })?;
    /// q.submit(|cg| {
    ///     let (x, o) = (cg.read(&x), cg.access::<f32, gantry::Write>(&out, 1..2));
    ///     cg.map_reduce(&x, &o, |v| v * v, Max);
    /// })?;
    /// assert_eq!(out.to_vec()?, vec![500_500.0, 1_000_000.0]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn reduce<T, MI, MO, R>(&mut self, input: &Accessor<T, MI>, output: &Accessor<T, MO>, op: R)
    where
        T: Pod + Sync + Send,
        MI: gantry_host::Readable,
        MO: gantry_host::Writable,
        R: gantry_host::Reduction<T>,
    {
        self.map_reduce(input, output, |x: T| x, op);
    }

    /// A reduction of a map: element 0 of `output` becomes the combination by `op` of
    /// `map(x)` for every element `x` of `input` (see [`Handler::reduce`]); the map
    /// runs inside the reduction's loop, as one kernel.
    pub fn map_reduce<T, U, MI, MO, M, R>(
        &mut self,
        input: &Accessor<T, MI>,
        output: &Accessor<U, MO>,
        map: M,
        op: R,
    ) where
        T: Pod + Sync,
        U: Pod + Send,
        MI: gantry_host::Readable,
        MO: gantry_host::Writable,
        M: Fn(T) -> U + Send + Sync + 'static,
        R: gantry_host::Reduction<U>,
    {
        // One work-group over the whole input: its phase splits the range over the
        // worker pool itself (`gantry_host::reduce`).
        let n = input.len();
        let geometry = NdRange::new(n, n).geometry().map_err(Error::from);
        let phase = gantry_host::reduce_phase(*input, *output, map, op);
        let tags = [input.slot_and_tag().1, output.slot_and_tag().1];
        self.owned_loop(static_name!("reduce"), &tags, geometry, phase);
    }

    /// Runs `f` once on a host thread, after the command's dependencies, with host
    /// access to its host accessors.
    ///
    /// A host task must not wait on its own runtime (events, queues, buffer guards):
    /// with inline host execution the scheduler itself is running it.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// let buf = rt.buffer(&[1i64, 2, 3]);
    /// rt.queue().submit(|cg| {
    ///     let mut b = cg.host_read_write(&buf);
    ///     cg.host_task(move |ctx| b.as_mut_slice(ctx).reverse());
    /// })?.wait()?;
    /// assert_eq!(buf.to_vec()?, vec![3, 2, 1]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    ///
    /// The closure is `FnMut` because a host task recorded into a command graph runs
    /// once per submission of the graph.
    pub fn host_task<F>(&mut self, f: F)
    where
        F: FnMut(&HostCtx<'_>) + Send + 'static,
    {
        let name = self.kernel_name(static_name!("host_task"));
        // Dropped wherever its command lets go of it (after running, or on the
        // scheduler's thread if it never runs): a panicking capture must not unwind
        // there.
        let scope = crate::task_scope::TaskScope { runtime: self.runtime, queue: self.queue };
        let mut f = crate::task_scope::Scoped::new(gantry_driver::contain::Contained::new(f), scope);
        self.set_action(Action::HostTask {
            name,
            run: Box::new(move |ctx: &HostCtx<'_>| f.with(|f| (**f)(ctx))),
        });
    }

    /// Copies all of `src` into `dst` (equal lengths).
    pub fn copy<T: Pod>(&mut self, src: &Buffer<T>, dst: &Buffer<T>) {
        if src.len() != dst.len() {
            return self.fail(Error::LengthMismatch { src: src.len(), dst: dst.len() });
        }
        self.copy_range(src, 0, dst, 0, src.len());
    }

    /// Copies `len` elements from `src[src_offset..]` to `dst[dst_offset..]`.
    pub fn copy_range<T: Pod>(
        &mut self,
        src: &Buffer<T>,
        src_offset: usize,
        dst: &Buffer<T>,
        dst_offset: usize,
        len: usize,
    ) {
        self.require(src, AccessMode::Read, src_offset..src_offset.saturating_add(len), "copy source");
        let whole = dst_offset == 0 && len == dst.len();
        let mode = if whole { AccessMode::DiscardWrite } else { AccessMode::Write };
        self.require(dst, mode, dst_offset..dst_offset.saturating_add(len), "copy destination");
        self.set_action(Action::Copy);
    }

    /// Copies `data` into `dst[dst_offset..]` (the data is copied at submission).
    pub fn copy_from_host<T: Pod>(&mut self, data: &[T], dst: &Buffer<T>, dst_offset: usize) {
        let whole = dst_offset == 0 && data.len() == dst.len();
        let mode = if whole { AccessMode::DiscardWrite } else { AccessMode::Write };
        self.require(dst, mode, dst_offset..dst_offset.saturating_add(data.len()), "copy destination");
        let storage = Arc::new(HostStorage::from_bytes(bytemuck::cast_slice(data)));
        self.set_action(Action::CopyFromHost(storage));
    }

    /// Copies `range` of `src` into `out`, readable once the event completes.
    pub fn copy_to_host<T: Pod>(
        &mut self,
        src: &Buffer<T>,
        range: impl RangeBounds<usize>,
        out: &Readback<T>,
    ) {
        let (_, len) = self.require(src, AccessMode::Read, range, "copy source");
        let storage = Arc::new(HostStorage::zeroed(len * std::mem::size_of::<T>()));
        self.readback = Some((out.slot.clone(), storage.clone()));
        self.set_action(Action::CopyToHost(storage));
    }

    /// Sets every element of `dst` to `value`.
    pub fn fill<T: Pod>(&mut self, dst: &Buffer<T>, value: T) {
        self.fill_range(dst, .., value);
    }

    /// Sets every element of `range` of `dst` to `value`.
    pub fn fill_range<T: Pod>(&mut self, dst: &Buffer<T>, range: impl RangeBounds<usize>, value: T) {
        let (start, end) = bounds(range, dst.len());
        let mode = if start == 0 && end == dst.len() { AccessMode::DiscardWrite } else { AccessMode::Write };
        self.require(dst, mode, start..end, "fill");
        self.set_action(Action::Fill(SmallVec::from_slice(bytemuck::bytes_of(&value))));
    }

    /// Launches `kernel`, given by its signature and images, over `range`: the
    /// accessors made in this group are its global arguments, in order, and must
    /// have the signature's access modes. Set its scalars on the returned [`Launch`].
    /// The group's device must run one of the kernel's images.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use gantry::driver::{AccessMode, ItemCost, Signature};
    /// use gantry::host::ClosureKernel;
    /// use gantry::{phase, Accessor, ReadWrite, Runtime};
    /// // A closure kernel built by hand: its native image is Rust code.
    /// let acc = Accessor::<u32, ReadWrite>::new(0, 0, 4);
    /// let closure = ClosureKernel {
    ///     tag: 0,
    ///     phases: smallvec::smallvec![phase(move |it| acc.set(it, it.global_linear_id(), 7))],
    ///     global_slots: 1,
    ///     scratch: vec![],
    ///     unfused: None,
    /// };
    /// let kernel = closure.into_kernel("seven", [AccessMode::ReadWrite], ItemCost::default());
    /// let rt = Runtime::new();
    /// let data = rt.buffer_zeroed::<u32>(4);
    /// rt.queue().submit(|cg| {
    ///     cg.read_write(&data);
    ///     cg.launch(&kernel, 4);
    /// })?;
    /// assert_eq!(data.to_vec()?, [7; 4]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn launch(&mut self, kernel: &KernelRef, range: impl Into<Range>) -> Launch<'_> {
        let geometry = Geometry::for_range(range.into()).map_err(Error::from);
        self.launch_geometry(kernel, geometry)
    }

    /// [`Handler::launch`] over an ND-range (work-groups of its local size).
    pub fn launch_nd(&mut self, kernel: &KernelRef, nd: NdRange) -> Launch<'_> {
        let geometry = nd.geometry().map_err(Error::from);
        self.launch_geometry(kernel, geometry)
    }

    fn launch_geometry(
        &mut self,
        kernel: &KernelRef,
        geometry: std::result::Result<Geometry, Error>,
    ) -> Launch<'_> {
        let scalars = ScalarArgs::new(&kernel.signature);
        self.set_action(Action::Launch { kernel: kernel.clone(), geometry, scalars, refused: None });
        let active = matches!(&self.action, Some(Action::Launch { kernel: k, .. }) if Arc::ptr_eq(k, kernel));
        Launch { handler: self, active }
    }

    /// Checks a launch against its kernel's signature and the device.
    fn check_launch(
        &self,
        kernel: &KernelRef,
        geometry: &Geometry,
        scalars: &ScalarArgs,
        refused: Option<ScalarMismatch>,
        device: &gantry_driver::DeviceInfo,
    ) -> Result<()> {
        let name = || kernel.name.to_string();
        if !kernel.runs_on(device.caps.image_kinds) {
            let kinds: Vec<String> = kernel.kinds().map(|k| k.to_string()).collect();
            return Err(Error::NoImageForDevice {
                kernel: name(),
                device: device.name.to_string(),
                kinds: kinds.join(", "),
            });
        }
        let sig = &kernel.signature;
        if sig.globals.len() != self.requirements.len() {
            return Err(Error::KernelArguments {
                kernel: name(),
                expected: sig.globals.len(),
                got: self.requirements.len(),
            });
        }
        for (index, (r, &mode)) in self.requirements.iter().zip(&sig.globals).enumerate() {
            if r.mode != mode {
                return Err(Error::KernelArgumentMode { kernel: name(), index, expected: mode, got: r.mode });
            }
        }
        if let Some(source) = refused {
            return Err(Error::ScalarArgument { kernel: name(), source });
        }
        if let Some(index) = scalars.unset(sig) {
            return Err(Error::ScalarNotSet { kernel: name(), index });
        }
        let local = sig.memory_bytes(ScratchKind::Local);
        if local > 0 && !geometry.is_nd() {
            return Err(Error::LocalMemoryNeedsNdRange);
        }
        if local > device.caps.max_local_memory {
            return Err(Error::LocalMemoryTooLarge { requested: local, max: device.caps.max_local_memory });
        }
        let private = sig.memory_bytes(ScratchKind::Private).saturating_mul(geometry.local_size());
        if private > device.caps.max_private_memory {
            return Err(Error::PrivateMemoryTooLarge {
                requested: private,
                max: device.caps.max_private_memory,
            });
        }
        Ok(())
    }

    /// Rejects overlapping accessors of which one writes.
    fn check_conflicts(&self) -> Result<()> {
        let r = &self.requirements;
        for i in 0..r.len() {
            for j in i + 1..r.len() {
                let (a, b) = (&r[i], &r[j]);
                if Arc::ptr_eq(&a.buffer, &b.buffer)
                    && a.range.overlaps(&b.range)
                    && (a.mode.writes() || b.mode.writes())
                {
                    return Err(Error::AccessorConflict { buffer: a.buffer.id, first: i, second: j });
                }
            }
        }
        Ok(())
    }

    /// Validates the group and turns it into the command's kind and work.
    pub(crate) fn finish(mut self, device: &gantry_driver::DeviceInfo) -> Result<Built> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.check_conflicts()?;
        let unsupported = |what| Error::Unsupported { device: device.name.to_string(), what };
        let (kind, work, name) = match self.action.take() {
            None => (CommandKind::Marker, Work::Marker, self.kernel_name(static_name!("empty"))),
            Some(Action::Kernel { name, geometry, phases }) => {
                let geometry = geometry?;
                if !device.caps.image_kinds.contains(&ImageKind::Closure) {
                    return Err(unsupported("closure kernels"));
                }
                if phases.is_empty() {
                    return Err(Error::NoPhases(name.to_string()));
                }
                let sum = |kind| {
                    self.scratch
                        .iter()
                        .filter(|s| s.kind == kind)
                        .try_fold(0usize, |a, s| a.checked_add(s.bytes))
                };
                let local_bytes = sum(ScratchKind::Local).unwrap_or(usize::MAX);
                if local_bytes > 0 && !geometry.is_nd() {
                    return Err(Error::LocalMemoryNeedsNdRange);
                }
                if local_bytes > device.caps.max_local_memory {
                    return Err(Error::LocalMemoryTooLarge {
                        requested: local_bytes,
                        max: device.caps.max_local_memory,
                    });
                }
                // A host driver allocates every work-item's private memory of a group
                // at once.
                let private_bytes = sum(ScratchKind::Private)
                    .and_then(|b| b.checked_mul(geometry.local_size()))
                    .unwrap_or(usize::MAX);
                if private_bytes > device.caps.max_private_memory {
                    return Err(Error::PrivateMemoryTooLarge {
                        requested: private_bytes,
                        max: device.caps.max_private_memory,
                    });
                }
                for e in &self.elems {
                    if e.len != geometry.global_size() {
                        let buffer = self.requirements[e.slot].buffer.id;
                        return Err(Error::ElementAccessorSize {
                            buffer,
                            len: e.len,
                            global: geometry.global_size(),
                        });
                    }
                }
                let closure = ClosureKernel {
                    tag: self.tag,
                    phases,
                    global_slots: self.requirements.len(),
                    scratch: std::mem::take(&mut self.scratch),
                    unfused: None,
                };
                let modes = self.requirements.iter().map(|r| r.mode);
                let kernel =
                    closure.into_kernel(name.clone(), modes, gantry_driver::ItemCost::of(self.item_cost_ns));
                (CommandKind::Kernel, Work::Kernel { kernel, geometry, scalars: ScalarBlock::new() }, name)
            }
            Some(Action::Launch { kernel, geometry, scalars, refused }) => {
                let geometry = geometry?;
                let name = kernel.name.clone();
                self.check_launch(&kernel, &geometry, &scalars, refused, device)?;
                let scalars = scalars.into_block();
                (CommandKind::Kernel, Work::Kernel { kernel, geometry, scalars }, name)
            }
            Some(Action::HostTask { name, run }) => (
                CommandKind::HostTask,
                Work::HostTask { run: SyncCell::new(run), tag: self.tag, cost_ns: self.item_cost_ns },
                name,
            ),
            Some(Action::Copy) => (CommandKind::Copy, Work::Copy, self.kernel_name(static_name!("copy"))),
            Some(Action::CopyFromHost(data)) => (
                CommandKind::CopyFromHost,
                Work::CopyFromHost(data),
                self.kernel_name(static_name!("copy_from_host")),
            ),
            Some(Action::CopyToHost(out)) => (
                CommandKind::CopyToHost,
                Work::CopyToHost(out),
                self.kernel_name(static_name!("copy_to_host")),
            ),
            Some(Action::Fill(pattern)) => {
                (CommandKind::Fill, Work::Fill(pattern), self.kernel_name(static_name!("fill")))
            }
        };
        Ok(Built {
            kind,
            work,
            name,
            requirements: self.requirements,
            waits: self.waits,
            readback: self.readback,
            keep: self.keep,
            graph_waits: self.graph_waits,
        })
    }
}

/// A validated command group.
pub(crate) struct Built {
    pub(crate) kind: CommandKind,
    pub(crate) work: Work,
    pub(crate) name: Arc<str>,
    pub(crate) requirements: RequirementList,
    pub(crate) waits: SmallVec<[Arc<EventShared>; 1]>,
    /// Where a copy to the host delivers, once its event exists.
    pub(crate) readback: Option<(ReadbackSlot, Arc<HostStorage>)>,
    /// Buffer handles a graph node keeps alive.
    pub(crate) keep: Vec<KeepAlive>,
    /// Edges to nodes of the graph being built.
    pub(crate) graph_waits: SmallVec<[crate::graph::Node; 1]>,
}

/// Sets the scalar arguments of a launch. See [`Handler::launch`].
pub struct Launch<'h> {
    handler: &'h mut Handler,
    /// False when the launch was refused (a second action): scalars go nowhere.
    active: bool,
}

impl Launch<'_> {
    /// Sets scalar argument `index` to `value`, whose size must be the signature's
    /// (checked at submit, with every other scalar set).
    pub fn scalar<T: Pod>(self, index: usize, value: T) -> Self {
        if let (true, Some(Action::Launch { kernel, scalars, refused, .. })) =
            (self.active, &mut self.handler.action)
        {
            if let Err(e) = scalars.set(&kernel.signature, index, value) {
                refused.get_or_insert(e);
            }
        }
        self
    }
}

/// Adds phases to a work-group kernel. See [`Handler::parallel_for_work_group`].
pub struct Phases<'h> {
    handler: &'h mut Handler,
    /// False when the kernel was refused (a second action): phases go nowhere.
    active: bool,
}

impl Phases<'_> {
    /// Adds a phase: `f` runs for every work-item of the group, after every work-item
    /// has finished the previous phase.
    pub fn phase<F>(self, f: F) -> Self
    where
        F: Fn(&mut Item<'_>) + Send + Sync + 'static,
    {
        if let (true, Some(Action::Kernel { phases, .. })) = (self.active, &mut self.handler.action) {
            phases.push(phase(f));
        }
        self
    }
}
