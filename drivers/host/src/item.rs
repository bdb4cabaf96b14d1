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
        if self.remap.is_none() && self.only.is_none() {
            let span = self.span.unwrap_or((0, usize::MAX));
            items(f, self.geometry, self.group, span, self.bindings, self.scratch, self.tag)
        } else {
            // Fused kernels only: through `dyn`, so the body keeps one direct caller
            // (`items`) and stays inlined there.
            mapped_items(f, self)
        }
    }
}

/// The loop of [`GroupCtx::for_each_item`]. The binding tables are separate `&[_]`
/// arguments so the compiler knows nothing in the loop writes them and can keep an
/// accessor's pointer in a register instead of reloading it after every store. It
/// stays a call (once per group) so those argument guarantees hold, and it is the
/// kernel body's only direct caller, so the body is inlined into it.
#[inline(never)]
fn items<F: Fn(&mut Item<'_>)>(
    f: &F,
    geometry: &Geometry,
    group: [usize; 3],
    (lo, hi): (usize, usize),
    bindings: &[Binding],
    scratch: &[Binding],
    tag: u64,
) {
    let ctx = GroupCtx::new(geometry, group, bindings, scratch, tag);
    let base = ctx.base();
    let ext = ctx.extent();
    let mut item = Item { rel: base, local: [0; 3], grid: geometry, group, geometry, bindings, scratch, tag };
    if ext[1] == 1 && ext[2] == 1 {
        // A 1-D group (every plain 1-D range): one loop, only dimension 0 changes.
        for i0 in lo..hi.min(ext[0]) {
            item.rel[0] = base[0] + i0;
            item.local[0] = i0;
            f(&mut item);
        }
        return;
    }
    debug_assert!((lo, hi) == (0, usize::MAX), "a span is for 1-D groups");
    for i0 in 0..ext[0] {
        for i1 in 0..ext[1] {
            for i2 in 0..ext[2] {
                item.rel = [base[0] + i0, base[1] + i1, base[2] + i2];
                item.local = [i0, i1, i2];
                f(&mut item);
            }
        }
    }
}

/// The loop for a kernel fused into a grid of another shape, or for one work-item
/// (`GroupCtx::only`): global ids are mapped through the global linear id (the DPC++
/// kernel-fusion design: `global_id(0) = GLID / (GS(1) * GS(2))`, and so on), and
/// work-items past the kernel's range skip it; local and group ids are the grid's,
/// which the fusion rules keep unchanged for kernels with a work-group size.
#[inline(never)]
fn mapped_items(f: &dyn Fn(&mut Item<'_>), ctx: &GroupCtx<'_>) {
    let base = ctx.base();
    let (first, ext) = match ctx.only {
        None => ([0; 3], ctx.extent()),
        Some(local) => (local, [1; 3]),
    };
    let grid_global = ctx.grid().global_range();
    let (own, total) = (ctx.geometry.global_range(), ctx.geometry.global_size());
    let (geometry, group, bindings, scratch, tag) =
        (ctx.geometry, ctx.group, ctx.bindings, ctx.scratch, ctx.tag);
    let grid = ctx.grid();
    let mut item = Item { rel: base, local: first, grid, group, geometry, bindings, scratch, tag };
    for i0 in first[0]..first[0] + ext[0] {
        for i1 in first[1]..first[1] + ext[1] {
            for i2 in first[2]..first[2] + ext[2] {
                let rel = [base[0] + i0, base[1] + i1, base[2] + i2];
                let glid = linearize(rel, grid_global);
                if glid < total {
                    item.rel = if ctx.remap.is_some() { delinearize(glid, own) } else { rel };
                    item.local = [i0, i1, i2];
                    f(&mut item);
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
    /// The grid being run, whose work-group shape indexes per-work-item scratch.
    grid: &'a Geometry,
    group: [usize; 3],
    geometry: &'a Geometry,
    bindings: &'a [Binding],
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
        linearize(self.rel, self.geometry.global_range())
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
        assert!(tag == self.tag, "accessor used in a kernel of a different command group");
        self.bindings[slot as usize]
    }

    /// Element `i` of buffer accessor slot `slot`, for elements of `size` bytes:
    /// bounds-checked in ordinary memory, `i % n` in internalized memory of `n`
    /// elements (the DPC++ kernel-fusion design, "Internalization").
    #[inline(always)]
    pub(crate) fn element_ptr<T>(&self, slot: u32, tag: u64, i: usize) -> *mut T {
        let b = self.binding(slot, tag);
        let n = b.len / std::mem::size_of::<T>().max(1);
        if i < n {
            // SAFETY: i < n, so the offset stays inside the binding.
            unsafe { b.ptr.cast::<T>().add(i) }
        } else {
            self.outside(b, i, std::mem::size_of::<T>()).cast()
        }
    }

    /// [`Item::element_ptr`] past the ordinary range: internalized memory (whose `len`
    /// is 0, so the hot path is one compare, as without fusion), or out of bounds.
    #[cold]
    #[inline(never)]
    fn outside(&self, b: Binding, i: usize, size: usize) -> *mut u8 {
        let n = (b.wrap / size.max(1)).max(1);
        // SAFETY (both): the scratch region holds `n` elements per group (local) or per
        // work-item (private), and the local linear id is below the grid's local size.
        match b.internal {
            Internal::No => panic!("accessor index {i} out of bounds for {} elements", b.len / size.max(1)),
            Internal::Local => unsafe { b.ptr.add((i % n) * size) },
            Internal::Private => unsafe { b.ptr.add((self.local_linear_id() * n + i % n) * size) },
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
            Internal::Local => Binding { len: b.wrap, ..b },
        }
    }

    /// The binding of scratch slot `slot`.
    #[inline]
    pub(crate) fn scratch_binding(&self, slot: u32, tag: u64) -> Binding {
        assert!(tag == self.tag, "accessor used in a kernel of a different command group");
        self.scratch[slot as usize]
    }
}
