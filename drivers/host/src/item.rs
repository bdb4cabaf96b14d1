//! The work-item a kernel closure receives, and the per-work-group context a driver
//! hands to each kernel phase. (A host task's context, [`HostCtx`], is part of the
//! driver contract: `gantry_driver`.)
//!
//! [`HostCtx`]: gantry_driver::HostCtx

use gantry_driver::{delinearize, linearize, Binding, Geometry, Internal, Range, RangeDims};

/// What a driver passes to a kernel phase for one work-group: the launch geometry,
/// which group this is, and the resolved memory of every accessor slot.
pub struct GroupCtx<'a> {
    /// The kernel's own geometry: the ids and ranges its work-items see.
    pub geometry: &'a Geometry,
    /// The grid whose group `group` is being run, when it is not `geometry`: a kernel
    /// fused with kernels of other ND-ranges (the DPC++ kernel-fusion design,
    /// "Work-item remapping"). Each work-item of the grid's group keeps its global
    /// linear id and is mapped to the kernel's global ids; work-items past the kernel's
    /// range skip it.
    pub remap: Option<&'a Geometry>,
    /// This group's 3-D id.
    pub group: [usize; 3],
    /// One binding per buffer accessor slot.
    pub bindings: &'a [Binding],
    /// One binding per scratch (local or private) slot.
    pub scratch: &'a [Binding],
    /// The command group's accessor tag; accessors from other command groups panic.
    pub tag: u64,
    /// Run only the work-item with this local id (in the grid). Fusion without
    /// barriers runs several kernels' bodies item by item this way.
    pub only: Option<[usize; 3]>,
    /// Run only the work-items with local ids `lo..hi` of a 1-D group (without
    /// `remap` or `only`). A fused chain of elementwise kernels runs each kernel
    /// over one such span after the other, so that the chain streams through memory
    /// (see `FusedBody::stream`).
    pub span: Option<(usize, usize)>,
}

impl<'a> GroupCtx<'a> {
    /// The context of group `group` of `geometry`.
    pub fn new(
        geometry: &'a Geometry,
        group: [usize; 3],
        bindings: &'a [Binding],
        scratch: &'a [Binding],
        tag: u64,
    ) -> Self {
        Self { geometry, remap: None, group, bindings, scratch, tag, only: None, span: None }
    }

    /// The grid the group's work-items come from.
    #[inline]
    pub fn grid(&self) -> &'a Geometry {
        self.remap.unwrap_or(self.geometry)
    }

    /// First global id (without offset) of this group in each dimension of the grid.
    #[inline]
    pub fn base(&self) -> [usize; 3] {
        let l = self.grid().local_range();
        [self.group[0] * l[0], self.group[1] * l[1], self.group[2] * l[2]]
    }

    /// Work-items of this group in each dimension of the grid: the local range,
    /// clipped at the global range for the partial last group of a plain range.
    #[inline]
    pub fn extent(&self) -> [usize; 3] {
        let grid = self.grid();
        let (l, g, b) = (grid.local_range(), grid.global_range(), self.base());
        [l[0].min(g[0] - b[0]), l[1].min(g[1] - b[1]), l[2].min(g[2] - b[2])]
    }

    /// Which of the group's work-items run, and how their ids map.
    #[inline(always)]
    fn ids(&self) -> Ids<'a> {
        let span = match (self.span, self.only) {
            (Some(span), None) => span,
            _ => (0, usize::MAX),
        };
        Ids { group: self.group, span, only: self.only, remap: self.remap }
    }

    /// Calls `f` for every work-item of the group, in local linear order. The item is
    /// built once and only its ids change, so the loop around an inlined kernel body
    /// is as tight as a hand-written one.
    #[inline(always)]
    pub fn for_each_item<F: Fn(&mut Item<'_>)>(&self, f: &F) {
        let ids = self.ids();
        let (table, copied, exact) = table_of(self.bindings);
        let (geometry, bindings, scratch, tag) = (self.geometry, self.bindings, self.scratch, self.tag);
        run_items::<F, ByGroup, Range>(f, geometry, ids, &table, copied, exact, bindings, scratch, tag)
    }

    /// [`GroupCtx::for_each_item`] with two copies of one kernel body (the same
    /// code, two closure types): `ordinary` runs the groups whose memory is all
    /// ordinary (bindings the loop's table holds) and whose grid is the kernel's own,
    /// in a loop where an access past its range can only panic, so that each copy of
    /// the body has one call site and the first, with nothing in its loop that calls
    /// out and goes on, is vectorized where its accesses allow (own elements:
    /// [`Accessor::at`], [`ElemAccessor::elem`]); `general` runs the others (fused
    /// kernels' internalized or shared memory, or remapped grids).
    ///
    /// `R` is the type of the kernel's range: where it tells the number of dimensions
    /// ([`RangeDims::DIMS`]), the ordinary loop runs along the fastest dimension, and
    /// the compiler sees every id of the other dimensions constant along a run: a
    /// body's row-wise work (`y * w`, a test of `y`) leaves the loop.
    ///
    /// [`Accessor::at`]: crate::Accessor::at
    /// [`ElemAccessor::elem`]: crate::ElemAccessor::elem
    #[inline(always)]
    pub fn for_each_item_twice<R: RangeDims, F: Fn(&mut Item<'_>), G: Fn(&mut Item<'_>)>(
        &self,
        ordinary: &F,
        general: &G,
    ) {
        let ids = self.ids();
        let (table, copied, exact) = table_of(self.bindings);
        let (geometry, bindings, scratch, tag) = (self.geometry, self.bindings, self.scratch, self.tag);
        // Each closure type is called from one copy of the loop only: a body with
        // two call sites is no longer inlined whatever its size.
        match exact || self.remap.is_some() {
            false => run_items::<F, Ordinary, R>(
                ordinary, geometry, ids, &table, copied, false, bindings, scratch, tag,
            ),
            true => run_items::<G, ByGroup, Range>(
                general, geometry, ids, &table, copied, exact, bindings, scratch, tag,
            ),
        }
    }
}

/// What a copy of the group loop knows of its groups.
trait CopyKind {
    /// Every binding is ordinary memory in the table (an access past its range can
    /// only panic) and the grid is the kernel's own (no remapping): constants of the
    /// copy. Otherwise the group decides ([`table_of`], [`GroupCtx::remap`]).
    const ORDINARY: bool;
}

/// The group decides.
struct ByGroup;
impl CopyKind for ByGroup {
    const ORDINARY: bool = false;
}

/// Ordinary memory, the kernel's own grid.
struct Ordinary;
impl CopyKind for Ordinary {
    const ORDINARY: bool = true;
}

/// Entries of the binding table [`items`] copies: the first `TABLE - 1` buffer slots
/// and an empty binding after them (an access to a slot past them takes the general
/// path). A power of two, so that an index masked with `TABLE - 1` is provably inside.
const TABLE: usize = 16;

/// Which work-items of a group [`items`] runs, and how their ids map.
#[derive(Clone, Copy)]
struct Ids<'a> {
    group: [usize; 3],
    /// Local ids `lo..hi` of dimension 0 ([`GroupCtx::span`]).
    span: (usize, usize),
    only: Option<[usize; 3]>,
    remap: Option<&'a Geometry>,
}

/// The binding table of a group loop ([`run_items`]), the bindings it holds, and
/// whether the loop must be exact.
///
/// The copy holds the first `TABLE - 1` bindings and empty ones after them (from
/// index `copied`). An access looks its slot up at `min(slot, copied)`, or at
/// `copied` for an accessor of another command group: a lookup that needs no flag
/// kept beside it, and that reaches an empty binding (whose ordinary range is empty,
/// so the general path reports the access) for every slot the table does not hold.
/// Exact where an access may need the general path and go on: internalized or shared
/// memory, or a slot past the table.
#[inline(always)]
fn table_of(bindings: &[Binding]) -> ([Binding; TABLE], usize, bool) {
    let copied = bindings.len().min(TABLE - 1);
    let mut table = [Binding::EMPTY; TABLE];
    table[..copied].copy_from_slice(&bindings[..copied]);
    let exact = copied < bindings.len() || bindings.iter().any(|b| b.internal != Internal::No);
    (table, copied, exact)
}

/// Every work-item of a group, in local linear order.
///
/// It is the kernel body's only caller, and its one call site: a function with a
/// single call site is inlined whatever its size, so the body, the accessors'
/// address arithmetic and their bounds checks sit in the loop, where the compiler
/// hoists what does not change from item to item (a body reached through two loops or
/// a `dyn` call stays out of line once it has a few accesses, and each work-item pays
/// a call and reloads every binding). (A second copy of the loop for groups whose
/// memory is all ordinary would let the compiler vectorize bodies of own-element
/// accesses, but a body with two call sites is no longer inlined: measured, the
/// particle step then ran at half the speed.)
///
/// Unless `exact` (every binding is ordinary memory the table holds), an access past
/// an ordinary range can only be an error and panics where it is; otherwise the
/// general path, out of line, serves internalized memory (`i % n`), shared memory and
/// slots past the table.
///
/// The binding tables are shared reference arguments of this function: the compiler
/// knows that nothing the loop stores reaches them (their memory is unchanged while
/// the function runs), and that every entry of `table` (a fixed-size array, indexed
/// through a mask) may be loaded anywhere. So an accessor's pointer and length are
/// loaded once, before the loop, and stay in registers, even for an access behind
/// another access's out-of-line path. The paths out of line (an
/// access past an ordinary range) take values only, never the item, so that nothing
/// of the item is kept in memory; the work-item's local ids, which internalized
/// private memory needs there, are recomputed there from its linear id.
///
/// The innermost loop runs along the fastest dimension of the group that has more
/// than one work-item (the only one in every plain range, whose groups are runs along
/// the fastest dimension of the range, and in most ND-ranges), so the body sits in a
/// loop whose trip count is the run's length; the item's ids are affine in its
/// counter. Work-items of a kernel fused into a grid of another shape are mapped
/// through the global linear id (the DPC++ kernel-fusion design: `global_id(0) = GLID
/// / (GS(1) * GS(2))`, and so on), and those past the kernel's range skip it; their
/// local and group ids are the grid's, which the fusion rules keep unchanged for
/// kernels with a work-group size.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn run_items<F: Fn(&mut Item<'_>), E: CopyKind, R: RangeDims>(
    f: &F,
    geometry: &Geometry,
    ids: Ids<'_>,
    table: &[Binding; TABLE],
    copied: usize,
    exact: bool,
    bindings: &[Binding],
    scratch: &[Binding],
    tag: u64,
) {
    let grid = ids.remap.unwrap_or(geometry);
    let local_range = grid.local_range();
    let base = [ids.group[0] * local_range[0], ids.group[1] * local_range[1], ids.group[2] * local_range[2]];
    let (first, mut ext) = match ids.only {
        None => {
            let g = grid.global_range();
            ([0; 3], [0, 1, 2].map(|d| local_range[d].min(g[d] - base[d])))
        }
        Some(local) => (local, [1; 3]),
    };
    let mut first = first;
    if ids.span != (0, usize::MAX) {
        // A span of a 1-D group: local ids `lo..hi` of dimension 0.
        let (lo, hi) = (ids.span.0.min(ext[0]), ids.span.1.min(ext[0]));
        first[0] = lo;
        ext[0] = hi.saturating_sub(lo);
    }
    if ext.contains(&0) {
        return;
    }
    let (grid_global, total) = (grid.global_range(), geometry.global_size());
    // The inner dimension and the grid's linear-id step along it: the fastest
    // dimension with more than one work-item, or the kernel's fastest where the copy
    // knows it. There the other ids are constant along a run, and the linear id steps
    // by 1 (a unit stride the compiler vectorizes), as the compiler sees: the
    // dimensions past it are 1, a range's unused ones.
    let (inner, glid_step) = match (E::ORDINARY, R::DIMS) {
        (true, dims @ 1..=3) => {
            assert!(grid_global[dims..].iter().all(|&e| e == 1), "a {dims}-D range type for a larger range");
            (dims - 1, 1)
        }
        _ => {
            let inner = (0..3).rev().find(|&d| ext[d] > 1).unwrap_or(2);
            (inner, [grid_global[1] * grid_global[2], grid_global[2], 1][inner])
        }
    };
    let unit = [0, 1, 2].map(|d| usize::from(d == inner));
    let mut outer_ext = ext;
    outer_ext[inner] = 1;
    let remapped = !E::ORDINARY && ids.remap.is_some();
    let mut item = Item {
        run_rel: base,
        run_local: first,
        unit,
        k: 0,
        glid: 0,
        remapped,
        grid,
        group: ids.group,
        geometry,
        table,
        empty: copied,
        exact: !E::ORDINARY && exact,
        total,
        all: bindings,
        scratch,
        tag,
    };
    let add = |a: [usize; 3], b: [usize; 3]| [a[0] + b[0], a[1] + b[1], a[2] + b[2]];
    for o0 in 0..outer_ext[0] {
        for o1 in 0..outer_ext[1] {
            for o2 in 0..outer_ext[2] {
                // A run along the inner dimension: the item's ids are its first ids
                // plus `k` along `unit`, so the loop carries only `k` and the linear id.
                let local = add(first, [o0, o1, o2]);
                let rel = add(base, local);
                let mut glid = linearize(rel, grid_global);
                // Without remapping the grid is the kernel's own, and every id is in
                // range. With it, the run's linear ids grow, so those in the kernel's
                // range are a prefix of the run.
                let run = match remapped {
                    false => ext[inner],
                    true => ext[inner].min(total.saturating_sub(glid).div_ceil(glid_step)),
                };
                item.run_rel = rel;
                item.run_local = local;
                for k in 0..run {
                    // One call site of the body (see above), reached by every iteration.
                    item.k = k;
                    item.glid = glid;
                    f(&mut item);
                    glid += glid_step;
                }
            }
        }
    }
}

/// One work-item of a running kernel: its ids and ranges, and the capability to reach
/// the command group's memory through accessors.
///
/// Items are created only by drivers; an accessor needs one to touch memory, so
/// memory is reachable only while the kernel runs.
///
/// ```
/// # use gantry_driver::{Geometry, Range};
/// # use gantry_host::GroupCtx;
/// let geometry = Geometry::for_range(Range::d2(2, 3)).unwrap(); // one group of 2 × 3
/// let group = GroupCtx::new(&geometry, [0, 0, 0], &[], &[], 0);
/// let ids = std::cell::RefCell::new(Vec::new());
/// group.for_each_item(&|it| ids.borrow_mut().push((it.global_id(0), it.global_id(1), it.global_linear_id())));
/// let ids = ids.into_inner();
/// assert_eq!(ids, vec![(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4), (1, 2, 5)]);
/// ```
pub struct Item<'a> {
    /// Global ids (without offset) of the first work-item of the run along `unit`
    /// this item belongs to, in the grid.
    run_rel: [usize; 3],
    /// Local ids of the run's first work-item.
    run_local: [usize; 3],
    /// The run's dimension: 1 in it, 0 in the others.
    unit: [usize; 3],
    /// The item's place in its run.
    k: usize,
    /// The item's global linear id in the grid (kept alongside, one add per item).
    glid: usize,
    /// Whether the grid is not the kernel's own: its global ids then come from the
    /// linear id.
    remapped: bool,
    /// The grid being run, whose work-group shape indexes per-work-item scratch.
    grid: &'a Geometry,
    group: [usize; 3],
    geometry: &'a Geometry,
    /// The first bindings of the launch, and empty ones after them.
    table: &'a [Binding; TABLE],
    /// The index of the first empty binding of `table`.
    empty: usize,
    /// Whether an access past an ordinary range takes the general path (internalized
    /// or shared memory, slots past the table) instead of panicking: a constant of
    /// each copy of the group loop.
    exact: bool,
    /// The kernel's global size: every work-item's global linear id is below it.
    total: usize,
    /// Every binding of the launch.
    all: &'a [Binding],
    scratch: &'a [Binding],
    tag: u64,
}

impl<'a> Item<'a> {
    /// Number of dimensions of the launch.
    #[inline]
    pub fn dims(&self) -> usize {
        self.geometry.dims()
    }
    /// Global ids without the offset.
    #[inline(always)]
    fn rel(&self) -> [usize; 3] {
        if self.remapped {
            return delinearize(self.glid, self.geometry.global_range());
        }
        let (r, u, k) = (self.run_rel, self.unit, self.k);
        [r[0] + u[0] * k, r[1] + u[1] * k, r[2] + u[2] * k]
    }
    /// Global id in dimension `d`, including the launch offset.
    #[inline]
    pub fn global_id(&self, d: usize) -> usize {
        self.rel()[d] + self.geometry.offset()[d]
    }
    /// Global ids in all three dimensions (unused ones are 0), including the offset.
    #[inline]
    pub fn global_ids(&self) -> [usize; 3] {
        let (r, o) = (self.rel(), self.geometry.offset());
        [r[0] + o[0], r[1] + o[1], r[2] + o[2]]
    }
    /// Local ids in the grid's group.
    #[inline(always)]
    fn local(&self) -> [usize; 3] {
        let (l, u, k) = (self.run_local, self.unit, self.k);
        [l[0] + u[0] * k, l[1] + u[1] * k, l[2] + u[2] * k]
    }
    /// Linear id over the global range, not counting the offset: 0..global size.
    #[inline]
    pub fn global_linear_id(&self) -> usize {
        self.glid
    }
    /// Global extent in dimension `d`.
    #[inline]
    pub fn global_range(&self, d: usize) -> usize {
        self.geometry.global_range()[d]
    }
    /// Id within the work-group in dimension `d`.
    #[inline]
    pub fn local_id(&self, d: usize) -> usize {
        self.local()[d]
    }
    /// Linear id within the work-group.
    #[inline]
    pub fn local_linear_id(&self) -> usize {
        linearize(self.local(), self.grid.local_range())
    }
    /// Work-group extent in dimension `d`.
    #[inline]
    pub fn local_range(&self, d: usize) -> usize {
        self.geometry.local_range()[d]
    }
    /// Work-group id in dimension `d`.
    #[inline]
    pub fn group_id(&self, d: usize) -> usize {
        self.group[d]
    }
    /// Linear work-group id.
    #[inline]
    pub fn group_linear_id(&self) -> usize {
        // (`linearize` does not read the slowest dimension's extent: no division for it.)
        linearize(self.group, [1, self.geometry.groups(1), self.geometry.groups(2)])
    }
    /// Number of work-groups in dimension `d`.
    #[inline]
    pub fn group_range(&self, d: usize) -> usize {
        self.geometry.groups(d)
    }

    /// The binding of accessor slot `slot`, checking that the accessor belongs to this
    /// launch's command group.
    #[inline]
    pub(crate) fn binding(&self, slot: u32, tag: u64) -> Binding {
        if tag != self.tag || slot as usize >= self.all.len() {
            invalid_accessor(tag == self.tag, slot, self.all.len())
        }
        self.all[slot as usize]
    }

    /// The table's binding of slot `slot`: the empty binding (whose ordinary range is
    /// empty) for a foreign tag or a slot the table does not hold. No branch: the same
    /// for every work-item, so computed once, before the group loop.
    #[inline(always)]
    fn table_binding(&self, slot: u32, tag: u64) -> Binding {
        let at = if tag == self.tag { (slot as usize).min(self.empty) } else { self.empty };
        self.table[at & (TABLE - 1)]
    }

    /// Element `i` of buffer accessor slot `slot` if it is *direct*: in the binding's
    /// ordinary range (`i < len / size`), which only ordinary memory that no other
    /// work-group writes while this one reads it has (internalized and shared memory
    /// bind `len` 0). Direct elements are one compare and an add away; everything
    /// else (internalized memory's `i % n`, shared memory, an index out of bounds,
    /// which panics) takes [`Item::general_element`], out of line.
    #[inline(always)]
    pub(crate) fn direct_element<T>(&self, slot: u32, tag: u64, i: usize) -> Option<*mut T> {
        let b = self.table_binding(slot, tag);
        // SAFETY: i < len / size, so the offset stays inside the binding.
        (i < b.len / std::mem::size_of::<T>().max(1)).then(|| unsafe { b.ptr.cast::<T>().add(i) })
    }

    /// This work-item's own element of buffer accessor slot `slot` (the one at its
    /// global linear id) if it is direct, as [`Item::direct_element`]. Where the
    /// slot's ordinary range holds an element for every work-item of the kernel (one
    /// check that is the same for every work-item, instead of one per item), it is
    /// the range's element at the linear id.
    #[inline(always)]
    pub(crate) fn own_element<T>(&self, slot: u32, tag: u64) -> Option<*mut T> {
        let b = self.table_binding(slot, tag);
        // SAFETY: glid < total <= len / size, so the offset stays inside the binding.
        (self.total <= b.len / std::mem::size_of::<T>().max(1))
            .then(|| unsafe { b.ptr.cast::<T>().add(self.glid) })
    }

    /// Element `i` of slot `slot` that is not direct ([`Item::direct_element`]): in a
    /// loop that is not exact, a panic (only an error gets here); otherwise the
    /// general path, out of line and of values only (a call that took the item would
    /// keep it in memory). Also the kind of memory it is in (`Internal::No` for a
    /// direct element of a slot past the table).
    #[inline(always)]
    pub(crate) fn general_element<T>(&self, slot: u32, tag: u64, i: usize) -> (*mut T, Internal) {
        let own = tag == self.tag;
        if !self.exact {
            let n = self.table_binding(slot, tag).len / std::mem::size_of::<T>().max(1);
            access_error(own, slot, self.all.len(), i, n)
        }
        let local = (self.glid, self.grid, self.group);
        let (p, internal) = far_element(self.all, own, slot, i, std::mem::size_of::<T>(), local);
        (p.cast(), internal)
    }

    /// [`Item::general_element`] for a reference only this work-item holds: shared
    /// memory, which other work-groups read meanwhile, cannot give one (the panic
    /// fails the fused kernel, and the driver runs its kernels unfused).
    #[inline(always)]
    pub(crate) fn exclusive_element<T>(&self, slot: u32, tag: u64, i: usize) -> *mut T {
        match self.general_element::<T>(slot, tag, i) {
            (_, Internal::Shared) => shared_exclusive(slot),
            (p, _) => p,
        }
    }

    /// The memory of buffer accessor slot `slot` this work-item sees: the whole range,
    /// or the internalized region (a private one is this work-item's own).
    #[inline]
    pub(crate) fn region(&self, slot: u32, tag: u64) -> Binding {
        let b = self.binding(slot, tag);
        match b.internal {
            Internal::No => b,
            // SAFETY: the group's region holds `wrap` bytes per work-item.
            Internal::Private => {
                Binding { ptr: unsafe { b.ptr.add(self.local_linear_id() * b.wrap) }, len: b.wrap, ..b }
            }
            Internal::Local | Internal::Shared => Binding { len: b.wrap, ..b },
        }
    }

    /// The binding of scratch slot `slot`.
    #[inline]
    pub(crate) fn scratch_binding(&self, slot: u32, tag: u64) -> Binding {
        assert!(tag == self.tag, "accessor used in a kernel of a different command group");
        self.scratch[slot as usize]
    }
}

/// The panic of an access past an accessor's range (it fails the command).
#[cold]
#[inline(never)]
fn out_of_bounds(i: usize, n: usize) -> ! {
    panic!("accessor index {i} out of bounds for {n} elements")
}

/// Element `i` (of `size` bytes) past the ordinary range of binding `b` (given by its
/// fields): internalized memory (`i % n` of the group's region, or of this
/// work-item's, `local_linear_id`), shared memory (bounds-checked against `wrap`), or
/// out of bounds (a panic). Cold and out of line, and a function of values only: a
/// call that took the item, or the binding table, by reference would keep the item in
/// memory and every binding reloaded after each call in the group loop.
#[cold]
#[inline(never)]
fn mapped_element(
    (ptr, len, wrap, internal): (*mut u8, usize, usize, Internal),
    i: usize,
    size: usize,
    local_linear_id: usize,
) -> *mut u8 {
    let size = size.max(1);
    let n = (wrap / size).max(1);
    // SAFETY (all): the scratch region holds `n` elements per group (local) or per
    // work-item (private), and the local linear id is below the grid's local size; a
    // shared binding holds `wrap` bytes.
    match internal {
        Internal::No => out_of_bounds(i, len / size),
        Internal::Shared if i < wrap / size => unsafe { ptr.add(i * size) },
        Internal::Shared => out_of_bounds(i, wrap / size),
        Internal::Local => unsafe { ptr.add((i % n) * size) },
        Internal::Private => unsafe { ptr.add((local_linear_id * n + i % n) * size) },
    }
}

/// The panic of an access past the ordinary range of the slot (`n` elements) of a
/// group loop that is not exact: an accessor of another command group, a slot past
/// the launch's `slots`, or an index out of bounds. Of values only, like
/// [`mapped_element`].
#[cold]
#[inline(never)]
fn access_error(own_tag: bool, slot: u32, slots: usize, i: usize, n: usize) -> ! {
    if !own_tag || slot as usize >= slots {
        invalid_accessor(own_tag, slot, slots)
    }
    out_of_bounds(i, n)
}

/// The panic of an accessor of another command group (`own_tag` false), or of a slot
/// past the launch's (it fails the command). Of values only, like [`mapped_element`].
#[cold]
#[inline(never)]
fn invalid_accessor(own_tag: bool, slot: u32, slots: usize) -> ! {
    if !own_tag {
        panic!("accessor used in a kernel of a different command group")
    }
    panic!("accessor slot {slot} of a launch of {slots} slots")
}

/// [`Item::element`] past the table binding's ordinary range: a slot the table does
/// not hold or that is not the launch's (which panics), internalized or shared memory,
/// or an index out of bounds (which panics). Of values only, like
/// [`mapped_element`]: `local` is the work-item's grid linear id, the grid and its
/// group, from which it recomputes the local linear id only where private memory needs
/// it.
#[cold]
#[inline(never)]
fn far_element(
    all: &[Binding],
    own_tag: bool,
    slot: u32,
    i: usize,
    size: usize,
    local: (usize, &Geometry, [usize; 3]),
) -> (*mut u8, Internal) {
    let Some(&b) = all.get(slot as usize).filter(|_| own_tag) else {
        invalid_accessor(own_tag, slot, all.len())
    };
    if i < b.len / size.max(1) {
        // SAFETY: in the binding's ordinary range.
        return (unsafe { b.ptr.add(i * size) }, Internal::No);
    }
    let local_linear_id = match b.internal {
        Internal::Private => local_linear_id_of(local),
        _ => 0,
    };
    (mapped_element((b.ptr, b.len, b.wrap, b.internal), i, size, local_linear_id), b.internal)
}

/// The panic of an element accessor ([`ElemAccessor::elem`](crate::ElemAccessor::elem))
/// whose slot fusion bound as shared memory.
#[cold]
#[inline(never)]
fn shared_exclusive(slot: u32) -> ! {
    panic!(
        "element accessor slot {slot} is memory other work-groups of the fused kernel read meanwhile; \
         a reference to it would race with them"
    )
}

/// The local linear id of the work-item with grid linear id `glid` in group `group`
/// of `grid`.
fn local_linear_id_of((glid, grid, group): (usize, &Geometry, [usize; 3])) -> usize {
    let (rel, l) = (delinearize(glid, grid.global_range()), grid.local_range());
    let local = [0, 1, 2].map(|d| rel[d] - group[d] * l[d]);
    linearize(local, l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{Accessor, ElemAccessor, Read, ReadWrite, Write};
    use gantry_driver::{NdRange, Range};

    fn panic_message(f: impl FnOnce()) -> String {
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("should panic");
        err.downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap()
    }

    /// A launch of more slots than the table holds: the slots past it take the
    /// general path and still reach their memory.
    #[test]
    fn slots_past_the_table_reach_their_memory() {
        const SLOTS: usize = TABLE + 4;
        let mut data: Vec<[u32; 4]> = (0..SLOTS).map(|s| [s as u32; 4]).collect();
        let bindings: Vec<Binding> =
            data.iter_mut().map(|d| Binding::new(d.as_mut_ptr().cast(), 16)).collect();
        let accessors: Vec<Accessor<u32, ReadWrite>> =
            (0..SLOTS).map(|s| Accessor::new(s as u32, 3, 4)).collect();
        let geometry = Geometry::for_range(Range::d1(4)).unwrap();
        GroupCtx::new(&geometry, [0; 3], &bindings, &[], 3).for_each_item(&|it| {
            let i = it.global_linear_id();
            for a in &accessors {
                a.set(it, i, a.get(it, i) * 10 + i as u32);
            }
        });
        for (s, d) in data.iter().enumerate() {
            assert_eq!(*d, [0, 1, 2, 3].map(|i| s as u32 * 10 + i), "slot {s}");
        }
    }

    /// Errors of a launch whose memory is all ordinary panic where they happen,
    /// naming the problem.
    #[test]
    fn bad_accesses_panic_with_their_reason() {
        let mut data = [0u32; 4];
        let bindings = [Binding::new(data.as_mut_ptr().cast(), 16)];
        let geometry = Geometry::for_range(Range::d1(4)).unwrap();
        let run =
            |f: &dyn Fn(&mut Item<'_>)| GroupCtx::new(&geometry, [0; 3], &bindings, &[], 5).for_each_item(&f);
        let past = Accessor::<u32, Read>::new(0, 5, 4);
        assert!(panic_message(|| run(&|it| _ = past.get(it, 4))).contains("index 4 out of bounds for 4"));
        let foreign = Accessor::<u32, Write>::new(0, 6, 4);
        assert!(panic_message(|| run(&|it| foreign.set(it, 0, 1))).contains("different command group"));
        let missing = Accessor::<u32, Read>::new(3, 5, 4);
        assert!(panic_message(|| run(&|it| _ = missing.get(it, 0))).contains("slot 3 of a launch of 1 slots"));
        let short = ElemAccessor::<u32, ReadWrite>::new(0, 5, 4);
        let wide = Geometry::for_range(Range::d1(8)).unwrap();
        let message = panic_message(|| {
            GroupCtx::new(&wide, [0; 3], &bindings, &[], 5).for_each_item(&|it| *short.elem(it) += 1)
        });
        assert!(message.contains("index 4 out of bounds for 4"), "{message}");
    }

    /// Private memory bound in place of a buffer (fusion's internalization) is this
    /// work-item's own, reached through the local id recomputed from the linear id.
    #[test]
    fn internalized_private_memory_is_each_work_items_own() {
        let mut region = [0u32; 8];
        let mut out = [0u32; 16];
        let private =
            Binding { ptr: region.as_mut_ptr().cast(), len: 0, internal: Internal::Private, wrap: 4 };
        let bindings = [private, Binding::new(out.as_mut_ptr().cast(), 64)];
        let (tmp, o) = (Accessor::<u32, ReadWrite>::new(0, 1, 16), Accessor::<u32, Write>::new(1, 1, 16));
        let geometry = NdRange::new([2, 8], [2, 4]).geometry().unwrap();
        for group in 0..geometry.group_count() {
            GroupCtx::new(&geometry, geometry.group_id(group), &bindings, &[], 1).for_each_item(&|it| {
                let i = it.global_linear_id();
                tmp.set(it, i, i as u32 + 100);
                assert_eq!(it.local_linear_id(), it.local_id(0) * 4 + it.local_id(1));
                o.set(it, i, tmp.get(it, i) + it.local_linear_id() as u32 * 1000);
            });
        }
        let want: Vec<u32> = (0..16).map(|i| i + 100 + ((i / 8) * 4 + i % 4) * 1000).collect();
        assert_eq!(out.to_vec(), want);
    }

    /// A body given twice runs its first copy where every binding is ordinary memory
    /// the table holds, and its second elsewhere, for every work-item.
    #[test]
    fn a_body_given_twice_runs_the_copy_its_memory_asks_for() {
        let mut data = [0u32; 8];
        let ordinary = [Binding::new(data.as_mut_ptr().cast(), 32)];
        let mut region = [0u32; 8];
        let private =
            [Binding { ptr: region.as_mut_ptr().cast(), len: 0, internal: Internal::Private, wrap: 4 }];
        let many: Vec<Binding> = (0..TABLE).map(|_| Binding::new(data.as_mut_ptr().cast(), 32)).collect();
        let geometry = Geometry::for_range(Range::d1(8)).unwrap();
        for (bindings, want) in [(&ordinary[..], (8, 0)), (&private[..], (0, 8)), (&many[..], (0, 8))] {
            let (first, second) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
            let ctx = GroupCtx::new(&geometry, [0; 3], bindings, &[], 0);
            ctx.for_each_item_twice::<usize, _, _>(&|_| first.set(first.get() + 1), &|_| {
                second.set(second.get() + 1)
            });
            assert_eq!((first.get(), second.get()), want);
        }
    }

    /// A kernel run on a larger grid (fusion's remapping) sees its own global ids,
    /// and the grid's work-items past its range skip it.
    #[test]
    fn remapped_items_see_their_own_ids_and_stop_at_the_range() {
        let own = Geometry::for_range(Range::d2(3, 3)).unwrap();
        let grid = Geometry::for_range(Range::d1(16)).unwrap();
        let seen = std::cell::RefCell::new(Vec::new());
        let mut ctx = GroupCtx::new(&own, [0; 3], &[], &[], 0);
        ctx.remap = Some(&grid);
        ctx.for_each_item(&|it| {
            seen.borrow_mut().push((it.global_linear_id(), it.global_id(0), it.global_id(1)))
        });
        let want: Vec<_> = (0..9).map(|i| (i, i / 3, i % 3)).collect();
        assert_eq!(seen.into_inner(), want);
    }

    /// Every id a work-item reads (global, local, group, linear ones).
    fn ids_of(it: &Item<'_>) -> [usize; 11] {
        let g = it.global_ids();
        let l = [0, 1, 2].map(|d| if d < it.dims() { it.local_id(d) } else { 0 });
        [
            g[0],
            g[1],
            g[2],
            l[0],
            l[1],
            l[2],
            it.group_id(0),
            it.group_id(1),
            it.global_linear_id(),
            it.local_linear_id(),
            it.group_linear_id(),
        ]
    }

    /// The ordinary copy of a body whose range's type tells its dimensions runs
    /// along the fastest dimension even where a group's extent there is 1; every
    /// work-item still runs once, with the ids the general loop gives it.
    #[test]
    fn a_known_dimensionality_runs_every_item_with_its_ids() {
        fn check<R: RangeDims>(geometry: Geometry) {
            let (mut ordinary, mut general) = (Vec::new(), Vec::new());
            for group in 0..geometry.group_count() {
                let ctx = GroupCtx::new(&geometry, geometry.group_id(group), &[], &[], 0);
                let seen = std::cell::RefCell::new(Vec::new());
                ctx.for_each_item_twice::<R, _, _>(
                    &|it| seen.borrow_mut().push(ids_of(it)),
                    &|_| unreachable!(),
                );
                ordinary.extend(seen.into_inner());
                let seen = std::cell::RefCell::new(Vec::new());
                ctx.for_each_item(&|it| seen.borrow_mut().push(ids_of(it)));
                general.extend(seen.into_inner());
            }
            ordinary.sort_unstable();
            general.sort_unstable();
            assert_eq!(ordinary.len(), geometry.global_size());
            assert_eq!(ordinary, general);
        }
        check::<usize>(Geometry::for_range(Range::d1(2500)).unwrap());
        check::<[usize; 2]>(Geometry::for_range(Range::d2(7, 5)).unwrap());
        check::<[usize; 2]>(Geometry::for_range(Range::d2(300, 700)).unwrap());
        check::<[usize; 3]>(Geometry::for_range_with_offset(Range::d3(5, 3, 9), [1, 2, 3]).unwrap());
        check::<[usize; 2]>(gantry_driver::NdRange::new([8, 6], [4, 1]).geometry().unwrap());
        check::<[usize; 3]>(gantry_driver::NdRange::new([4, 6, 8], [2, 3, 1]).geometry().unwrap());
        check::<Range>(gantry_driver::NdRange::new([4, 6, 8], [2, 1, 1]).geometry().unwrap());
    }
}
