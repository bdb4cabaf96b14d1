//! The work-item a kernel closure receives, and the per-work-group context a driver
//! hands to each kernel phase.

use crate::memory::Binding;
use crate::range::{linearize, Geometry};

/// What a driver passes to a kernel phase for one work-group: the launch geometry,
/// which group this is, and the resolved memory of every accessor slot.
pub struct GroupCtx<'a> {
    /// The launch geometry.
    pub geometry: &'a Geometry,
    /// This group's 3-D id.
    pub group: [usize; 3],
    /// One binding per buffer accessor slot.
    pub bindings: &'a [Binding],
    /// One binding per scratch (local or private) slot.
    pub scratch: &'a [Binding],
    /// The command group's accessor tag; accessors from other command groups panic.
    pub tag: u64,
}

impl GroupCtx<'_> {
    /// First global id (without offset) of this group in each dimension.
    #[inline]
    pub fn base(&self) -> [usize; 3] {
        let l = self.geometry.local_range();
        [self.group[0] * l[0], self.group[1] * l[1], self.group[2] * l[2]]
    }

    /// Work-items of this group in each dimension: the local range, clipped at the
    /// global range for the partial last group of a plain range.
    #[inline]
    pub fn extent(&self) -> [usize; 3] {
        let (l, g, b) = (self.geometry.local_range(), self.geometry.global_range(), self.base());
        [l[0].min(g[0] - b[0]), l[1].min(g[1] - b[1]), l[2].min(g[2] - b[2])]
    }

    /// Calls `f` for every work-item of the group, in local linear order. The item is
    /// built once and only its ids change, so the loop around an inlined kernel body
    /// is as tight as a hand-written one.
    #[inline(always)]
    pub fn for_each_item<F: Fn(&mut Item<'_>)>(&self, f: &F) {
        items(f, self.geometry, self.group, self.bindings, self.scratch, self.tag)
    }
}

/// The loop of [`GroupCtx::for_each_item`]. The binding tables are separate `&[_]`
/// arguments so the compiler knows nothing in the loop writes them and can keep an
/// accessor's pointer in a register instead of reloading it after every store. It
/// stays a call (once per group) so those argument guarantees hold.
#[inline(never)]
fn items<F: Fn(&mut Item<'_>)>(
    f: &F,
    geometry: &Geometry,
    group: [usize; 3],
    bindings: &[Binding],
    scratch: &[Binding],
    tag: u64,
) {
    let ctx = GroupCtx { geometry, group, bindings, scratch, tag };
    let base = ctx.base();
    let ext = ctx.extent();
    let mut item = Item { rel: base, local: [0; 3], group, geometry, bindings, scratch, tag };
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

/// One work-item of a running kernel: its ids and ranges, and the capability to reach
/// the command group's memory through accessors.
///
/// Items are created only by drivers; an accessor needs one to touch memory, so
/// memory is reachable only while the kernel runs.
///
/// ```
/// # use gantry_driver::{Geometry, GroupCtx, Range};
/// let geometry = Geometry::for_range(Range::d2(2, 3)).unwrap();
/// let group = GroupCtx { geometry: &geometry, group: [1, 0, 0], bindings: &[], scratch: &[], tag: 0 };
/// let ids = std::cell::RefCell::new(Vec::new());
/// group.for_each_item(&|it| ids.borrow_mut().push((it.global_id(0), it.global_id(1), it.global_linear_id())));
/// let ids = ids.into_inner();
/// assert_eq!(ids, vec![(1, 0, 3), (1, 1, 4), (1, 2, 5)]);
/// ```
pub struct Item<'a> {
    rel: [usize; 3],
    local: [usize; 3],
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
        linearize(self.local, self.geometry.local_range())
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
        linearize(self.group, self.geometry.group_range())
    }
    /// Number of work-groups in dimension `d`.
    #[inline]
    pub fn group_range(&self, d: usize) -> usize {
        self.geometry.group_range()[d]
    }

    /// The binding of accessor slot `slot`, checking that the accessor belongs to this
    /// launch's command group.
    #[inline]
    pub(crate) fn binding(&self, slot: u32, tag: u64) -> Binding {
        assert!(tag == self.tag, "accessor used in a kernel of a different command group");
        self.bindings[slot as usize]
    }

    /// The binding of scratch slot `slot`.
    #[inline]
    pub(crate) fn scratch_binding(&self, slot: u32, tag: u64) -> Binding {
        assert!(tag == self.tag, "accessor used in a kernel of a different command group");
        self.scratch[slot as usize]
    }
}

/// The context a host task receives: the resolved host memory of its accessors.
pub struct HostCtx<'a> {
    pub(crate) bindings: &'a [Binding],
    pub(crate) tag: u64,
}

impl<'a> HostCtx<'a> {
    /// Built by drivers when they run a host task.
    pub fn new(bindings: &'a [Binding], tag: u64) -> Self {
        Self { bindings, tag }
    }

    #[inline]
    pub(crate) fn binding(&self, slot: u32, tag: u64) -> Binding {
        assert!(tag == self.tag, "host accessor used in a host task of a different command group");
        self.bindings[slot as usize]
    }
}
