//! The work-item a kernel closure receives, and the per-work-group context a driver
//! hands to each kernel phase. (A host task's context, [`HostCtx`], is part of the
//! driver contract: `gantry_driver`.)
//!
//! [`HostCtx`]: gantry_driver::HostCtx

use gantry_driver::{delinearize, linearize, Binding, Geometry, Internal};

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

    /// Calls `f` for every work-item of the group, in local linear order. The item is
    /// built once and only its ids change, so the loop around an inlined kernel body
    /// is as tight as a hand-written one.
    #[inline(always)]
    pub fn for_each_item<F: Fn(&mut Item<'_>)>(&self, f: &F) {
        let span = match (self.span, self.only) {
            (Some(span), None) => span,
            _ => (0, usize::MAX),
        };
        let ids = Ids { group: self.group, span, only: self.only, remap: self.remap };
        items(f, self.geometry, ids, self.bindings, self.scratch, self.tag)
    }
}

/// Buffer slots whose bindings [`items`] copies into an array on its stack (an
/// access to a slot past them takes the general path).
const LOCAL_SLOTS: usize = 16;

/// Which work-items of a group [`items`] runs, and how their ids map.
#[derive(Clone, Copy)]
struct Ids<'a> {
    group: [usize; 3],
    /// Local ids `lo..hi` of dimension 0 ([`GroupCtx::span`]).
    span: (usize, usize),
    only: Option<[usize; 3]>,
    remap: Option<&'a Geometry>,
}

/// The loop of [`GroupCtx::for_each_item`]: every work-item of a group, in local
/// linear order.
///
/// It is the kernel body's only caller, and its one call site: a function with a
/// single call site is inlined whatever its size, so the body, the accessors'
/// address arithmetic and their bounds checks sit in the loop, where the
/// compiler hoists what does not change from item to item (a body reached through
/// two loops or a `dyn` call stays out of line once it has a few accesses, and each
/// work-item pays a call and reloads every binding). The binding tables are separate
/// `&[_]` arguments so the compiler knows nothing in the loop writes them and can keep
/// an accessor's pointer and length in registers instead of reloading them after
/// every store. It stays a call (once per group) so those argument guarantees hold.
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
fn items<F: Fn(&mut Item<'_>)>(
    f: &F,
    geometry: &Geometry,
    ids: Ids<'_>,
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
    // The inner dimension: the fastest with more than one work-item; its step.
    let inner = (0..3).rev().find(|&d| ext[d] > 1).unwrap_or(2);
    let unit = [0, 1, 2].map(|d| usize::from(d == inner));
    let mut outer_ext = ext;
    outer_ext[inner] = 1;
    let (grid_global, own, total) = (grid.global_range(), geometry.global_range(), geometry.global_size());
    let remapped = ids.remap.is_some();
    // The grid's linear id advances by this per step along the inner dimension.
    let glid_step = [grid_global[1] * grid_global[2], grid_global[2], 1][inner];
    // The binding table, copied into memory of this loop's own whose address nothing
    // else sees, padded to a power of two: an access loads its binding at `slot &
    // mask` (no bounds check), and since no store of the loop can reach this copy,
    // the compiler loads each accessor's pointer and length once, before the loop.
    // (A plain array on the stack, filled by a copy: the address of a collection
    // whose growth is a call would escape into it. Slots past `LOCAL_SLOTS` are
    // reached through the general path.)
    // Only the entries used are written: fusion without barriers runs this loop
    // for one work-item at a time.
    let copied = bindings.len().min(LOCAL_SLOTS);
    let padded = copied.next_power_of_two().max(1);
    let mut local = [std::mem::MaybeUninit::<Binding>::uninit(); LOCAL_SLOTS];
    let entries = bindings[..copied].iter().chain(std::iter::repeat(&Binding::EMPTY));
    for (slot, b) in local[..padded].iter_mut().zip(entries) {
        slot.write(*b);
    }
    // SAFETY: the first `padded` entries (at most `LOCAL_SLOTS`) were written above.
    let table: &[Binding] = unsafe { std::slice::from_raw_parts(local.as_ptr().cast(), padded) };
    let mut item = Item {
        rel: base,
        local: first,
        glid: 0,
        grid,
        group: ids.group,
        geometry,
        bindings: table,
        all: bindings,
        slots: copied,
        scratch,
        tag,
    };
    let add = |a: [usize; 3], b: [usize; 3]| [a[0] + b[0], a[1] + b[1], a[2] + b[2]];
    for o0 in 0..outer_ext[0] {
        for o1 in 0..outer_ext[1] {
            for o2 in 0..outer_ext[2] {
                // Ids advance by `unit` and the linear id by its step (adds only, so
                // the item's fields stay in registers).
                let mut local = add(first, [o0, o1, o2]);
                let mut rel = add(base, local);
                let mut glid = linearize(rel, grid_global);
                for _ in 0..ext[inner] {
                    // One call site of the body (see above). Without remapping the grid
                    // is the kernel's own, and every id is in range.
                    if glid < total {
                        item.rel = if remapped { delinearize(glid, own) } else { rel };
                        item.local = local;
                        item.glid = glid;
                        f(&mut item);
                    }
                    local = add(local, unit);
                    rel = add(rel, unit);
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
/// let geometry = Geometry::for_range(Range::d2(2, 3)).unwrap();
/// let group = GroupCtx::new(&geometry, [1, 0, 0], &[], &[], 0);
/// let ids = std::cell::RefCell::new(Vec::new());
/// group.for_each_item(&|it| ids.borrow_mut().push((it.global_id(0), it.global_id(1), it.global_linear_id())));
/// let ids = ids.into_inner();
/// assert_eq!(ids, vec![(1, 0, 3), (1, 1, 4), (1, 2, 5)]);
/// ```
pub struct Item<'a> {
    rel: [usize; 3],
    local: [usize; 3],
    /// The global linear id of `rel` (kept alongside, one add per work-item).
    glid: usize,
    /// The grid being run, whose work-group shape indexes per-work-item scratch.
    grid: &'a Geometry,
    group: [usize; 3],
    geometry: &'a Geometry,
    /// The first [`LOCAL_SLOTS`] bindings of the launch, padded with empty ones to a
    /// power of two.
    bindings: &'a [Binding],
    /// Every binding of the launch.
    all: &'a [Binding],
    /// The unpadded length of `bindings`.
    slots: usize,
    scratch: &'a [Binding],
    tag: u64,
}

impl<'a> Item<'a> {
    /// Number of dimensions of the launch.
    #[inline]
    pub fn dims(&self) -> usize {
        self.geometry.dims()
    }
    /// Global id in dimension `d`, including the launch offset.
    #[inline]
    pub fn global_id(&self, d: usize) -> usize {
        self.rel[d] + self.geometry.offset()[d]
    }
    /// Global ids in all three dimensions (unused ones are 0), including the offset.
    #[inline]
    pub fn global_ids(&self) -> [usize; 3] {
        let o = self.geometry.offset();
        [self.rel[0] + o[0], self.rel[1] + o[1], self.rel[2] + o[2]]
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
        self.local[d]
    }
    /// Linear id within the work-group.
    #[inline]
    pub fn local_linear_id(&self) -> usize {
        linearize(self.local, self.grid.local_range())
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

    /// Element `i` of buffer accessor slot `slot`, for elements of `size` bytes, and
    /// whether it is *direct*: in the binding's ordinary range (`i < len / size`),
    /// which only ordinary memory that no other work-group writes while this one
    /// reads it has (internalized and shared memory bind `len` 0). Direct elements
    /// are one compare and an add away; everything else (internalized memory's
    /// `i % n`, shared memory, an index out of bounds, which panics) takes the
    /// general path, out of line ([`general_element`]).
    #[inline(always)]
    pub(crate) fn element<T>(&self, slot: u32, tag: u64, i: usize) -> (*mut T, bool) {
        // No branch before the bounds check: the binding is read at `slot & mask`
        // (inside the padded table whatever the slot), and a foreign tag or a slot
        // past the launch's makes the ordinary range empty, so that the general path
        // reports it. All of it is the same for every work-item: computed once, before
        // the group loop.
        let at = slot as usize & (self.bindings.len().wrapping_sub(1));
        debug_assert!(at < self.bindings.len(), "the table is never empty");
        // SAFETY: the group loop pads the table to a power of two, at least 1, so
        // `at` is below its length.
        let b = unsafe { *self.bindings.get_unchecked(at) };
        let valid = tag == self.tag && (slot as usize) < self.slots;
        let size = std::mem::size_of::<T>();
        let n = if valid { b.len / size.max(1) } else { 0 };
        if i < n {
            // SAFETY: i < n, so the offset stays inside the binding.
            (unsafe { b.ptr.cast::<T>().add(i) }, true)
        } else {
            if !valid {
                let (p, direct) =
                    far_element(self.all, tag == self.tag, slot, i, size, self.local_linear_id());
                return (p.cast(), direct);
            }
            let fields = (b.ptr, b.len, b.wrap, b.internal);
            (general_element(fields, i, size, self.local_linear_id()).cast(), false)
        }
    }

    /// [`Item::element`]'s pointer.
    #[inline(always)]
    pub(crate) fn element_ptr<T>(&self, slot: u32, tag: u64, i: usize) -> *mut T {
        self.element::<T>(slot, tag, i).0
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
fn general_element(
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

/// The panic of an accessor of another command group (`own_tag` false), or of a slot
/// past the launch's (it fails the command). Of values only, like [`general_element`].
#[cold]
#[inline(never)]
fn invalid_accessor(own_tag: bool, slot: u32, slots: usize) -> ! {
    if !own_tag {
        panic!("accessor used in a kernel of a different command group")
    }
    panic!("accessor slot {slot} of a launch of {slots} slots")
}

/// [`Item::element`] of a slot outside the loop's table: past [`LOCAL_SLOTS`], or not
/// the launch's (which panics). Of values only, like [`general_element`].
#[cold]
#[inline(never)]
fn far_element(
    all: &[Binding],
    own_tag: bool,
    slot: u32,
    i: usize,
    size: usize,
    local_linear_id: usize,
) -> (*mut u8, bool) {
    let Some(&b) = all.get(slot as usize).filter(|_| own_tag) else {
        invalid_accessor(own_tag, slot, all.len())
    };
    if i < b.len / size.max(1) {
        // SAFETY: in the binding's ordinary range.
        return (unsafe { b.ptr.add(i * size) }, true);
    }
    (general_element((b.ptr, b.len, b.wrap, b.internal), i, size, local_linear_id), false)
}
