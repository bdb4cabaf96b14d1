//! Memory records: one entity per buffer, holding the leaves dependency resolution
//! reads (the unfinished commands that last read or wrote each range) and where valid
//! copies of the contents live.

use std::collections::BTreeMap;
use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::entity::Entity;
use bevy_platform::collections::HashMap;
use gantry_driver::{AllocId, MemSpace};
use smallvec::SmallVec;

use crate::handle::BufferCore;
use crate::resources::DeviceId;

/// A half-open byte range `[start, end)` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ByteRange {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl ByteRange {
    /// `[start, start + len)`.
    pub fn new(start: usize, len: usize) -> Self {
        Self { start, end: start + len }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
    /// Whether the two ranges share a byte.
    #[inline]
    pub fn overlaps(&self, other: &ByteRange) -> bool {
        self.start < other.end && other.start < self.end
    }
    /// Whether `self` contains all of `other`.
    #[inline]
    pub fn covers(&self, other: &ByteRange) -> bool {
        self.start <= other.start && other.end <= self.end
    }
    /// The smallest range containing both.
    #[inline]
    pub fn hull(&self, other: &ByteRange) -> ByteRange {
        ByteRange { start: self.start.min(other.start), end: self.end.max(other.end) }
    }
}

/// What a leaf names: a command entity (the scheduler's memory records) or a graph
/// node (a command graph being built). Its bits order leaves of one range start.
pub trait LeafKey: Copy + Eq {
    /// A number unique to the key.
    fn bits(self) -> u64;
}

impl LeafKey for Entity {
    #[inline]
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

impl LeafKey for u32 {
    #[inline]
    fn bits(self) -> u64 {
        u64::from(self)
    }
}

/// An unfinished command (or a graph node) that read or wrote a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf<K = Entity> {
    /// The command.
    pub cmd: K,
    /// The range it accessed.
    pub range: ByteRange,
}

/// Leaves beyond this many are kept in an index instead of a short list.
const INDEX_AT: usize = 32;

/// The unfinished readers (or writers) of a buffer, by range: of commands in the
/// scheduler's memory records, of nodes while a command graph is built, so both
/// apply the dependency rules over the same index.
///
/// Few leaves live in a short list. Many leaves — thousands of commands touching
/// disjoint ranges of one buffer — move to an index, so that overlap queries,
/// covered-leaf removal and release cost O(log n + k) or O(k) rather than O(n), and a
/// large batch (or graph) does not make resolution quadratic:
/// - a grid while every leaf is one aligned granule (element accessors of one element
///   type, as in a wavefront): a hash map from granule to its leaves, where a query
///   probes the granules its range spans;
/// - else a B-tree keyed by range start.
#[derive(Clone, Debug)]
pub struct LeafSet<K = Entity> {
    repr: Repr<K>,
}

#[derive(Clone, Debug)]
enum Repr<K> {
    List(SmallVec<[Leaf<K>; 4]>),
    Grid(Grid<K>),
    Tree(Tree<K>),
}

/// Leaves ordered by range start.
#[derive(Clone, Debug)]
struct Tree<K> {
    index: BTreeMap<(usize, u64), Leaf<K>>,
    /// Longest range in the index: an overlap query looks back this far.
    max_len: usize,
}

/// Leaves that each cover exactly one aligned granule, by granule. Its hash map's
/// hasher is fixed, so walks over it run in the same order in every run.
#[derive(Clone, Debug)]
struct Grid<K> {
    granule: usize,
    cells: HashMap<usize, SmallVec<[Leaf<K>; 2]>>,
    len: usize,
}

impl<K> Default for LeafSet<K> {
    fn default() -> Self {
        Self { repr: Repr::List(SmallVec::new()) }
    }
}

impl<K: LeafKey> Tree<K> {
    fn of(leaves: impl Iterator<Item = Leaf<K>>) -> Self {
        let mut tree = Self { index: BTreeMap::new(), max_len: 0 };
        leaves.for_each(|l| tree.insert(l));
        tree
    }

    fn insert(&mut self, leaf: Leaf<K>) {
        self.max_len = self.max_len.max(leaf.range.len());
        self.index.insert((leaf.range.start, leaf.cmd.bits()), leaf);
    }

    /// The leaves whose start an overlap with `range` allows.
    fn near(&self, range: &ByteRange) -> impl Iterator<Item = (&(usize, u64), &Leaf<K>)> {
        self.index.range((range.start.saturating_sub(self.max_len), 0)..(range.end, 0))
    }
}

impl<K: LeafKey> Grid<K> {
    /// A grid of `leaves` if every one is the same aligned, non-empty granule.
    fn of(leaves: &[Leaf<K>]) -> Option<Self> {
        let granule = leaves.first()?.range.len();
        let mut grid = Grid { granule, cells: HashMap::default(), len: 0 };
        if granule == 0 || !leaves.iter().all(|l| grid.fits(l)) {
            return None;
        }
        for l in leaves {
            grid.push(*l);
        }
        Some(grid)
    }

    fn fits(&self, leaf: &Leaf<K>) -> bool {
        leaf.range.len() == self.granule && leaf.range.start.is_multiple_of(self.granule)
    }

    fn push(&mut self, leaf: Leaf<K>) {
        self.cells.entry(leaf.range.start / self.granule).or_default().push(leaf);
        self.len += 1;
    }

    /// The granules `range` spans, if probing them is cheaper than a walk of all.
    fn span(&self, range: &ByteRange) -> Option<std::ops::Range<usize>> {
        let cells = range.start / self.granule..range.end.div_ceil(self.granule);
        (cells.len() <= self.cells.len()).then_some(cells)
    }

    /// Calls `f` for every leaf overlapping `range`, then keeps those `keep` allows.
    fn visit(&mut self, range: &ByteRange, mut f: impl FnMut(&Leaf<K>), keep: impl Fn(&Leaf<K>) -> bool) {
        let span = self.span(range);
        self.retain_in(span, |l| {
            if !l.range.overlaps(range) {
                return true;
            }
            f(l);
            keep(l)
        });
    }

    /// Keeps the leaves `keep` allows, of the granules `span` (`None`: of all),
    /// dropping the granules left empty.
    fn retain_in(&mut self, span: Option<std::ops::Range<usize>>, mut keep: impl FnMut(&Leaf<K>) -> bool) {
        let len = &mut self.len;
        let mut cell = |leaves: &mut SmallVec<[Leaf<K>; 2]>| {
            leaves.retain(|l| {
                let kept = keep(l);
                *len -= usize::from(!kept);
                kept
            });
            !leaves.is_empty()
        };
        match span {
            Some(span) => {
                for c in span {
                    if self.cells.get_mut(&c).is_some_and(|leaves| !cell(leaves)) {
                        self.cells.remove(&c);
                    }
                }
            }
            None => self.cells.retain(|_, leaves| cell(leaves)),
        }
    }
}

impl<K: LeafKey> LeafSet<K> {
    /// Number of leaves.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::List(list) => list.len(),
            Repr::Grid(grid) => grid.len,
            Repr::Tree(tree) => tree.index.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds a leaf.
    #[inline]
    pub fn push(&mut self, leaf: Leaf<K>) {
        match &mut self.repr {
            Repr::List(list) => {
                list.push(leaf);
                if list.len() > INDEX_AT {
                    self.repr = match Grid::of(list) {
                        Some(grid) => Repr::Grid(grid),
                        None => Repr::Tree(Tree::of(list.drain(..))),
                    };
                }
            }
            Repr::Grid(grid) if grid.fits(&leaf) => grid.push(leaf),
            Repr::Grid(grid) => {
                // A leaf of another size or alignment: the grid no longer describes
                // the set.
                let mut tree = Tree::of(grid.cells.drain().flat_map(|(_, leaves)| leaves));
                tree.insert(leaf);
                self.repr = Repr::Tree(tree);
            }
            Repr::Tree(tree) => tree.insert(leaf),
        }
    }

    /// Calls `f` for every leaf whose range overlaps `range`.
    #[inline]
    pub fn for_each_overlapping(&self, range: &ByteRange, mut f: impl FnMut(&Leaf<K>)) {
        match &self.repr {
            Repr::List(list) => list.iter().filter(|l| l.range.overlaps(range)).for_each(f),
            Repr::Grid(grid) => {
                let each = |leaves: &SmallVec<[Leaf<K>; 2]>| {
                    leaves.iter().filter(|l| l.range.overlaps(range)).for_each(&mut f)
                };
                match grid.span(range) {
                    Some(span) => span.filter_map(|c| grid.cells.get(&c)).for_each(each),
                    None => grid.cells.values().for_each(each),
                }
            }
            Repr::Tree(tree) => {
                tree.near(range).map(|(_, l)| l).filter(|l| l.range.overlaps(range)).for_each(f)
            }
        }
    }

    /// A writer of `range`: calls `f` for every leaf `range` overlaps, then removes
    /// the ones it covers (except those of `keep`), in one walk of the index.
    pub fn overlap_and_cover(&mut self, range: &ByteRange, keep: K, mut f: impl FnMut(&Leaf<K>)) {
        match &mut self.repr {
            Repr::List(list) => {
                list.retain(|l| {
                    if l.range.overlaps(range) {
                        f(l);
                    }
                    l.cmd == keep || !range.covers(&l.range)
                });
                return;
            }
            Repr::Grid(grid) => grid.visit(range, f, |l| l.cmd == keep || !range.covers(&l.range)),
            Repr::Tree(tree) => {
                let mut covered: SmallVec<[(usize, u64); 8]> = SmallVec::new();
                for (k, leaf) in tree.near(range) {
                    if leaf.range.overlaps(range) {
                        f(leaf);
                        if leaf.cmd != keep && range.covers(&leaf.range) {
                            covered.push(*k);
                        }
                    }
                }
                for k in covered {
                    tree.index.remove(&k);
                }
            }
        }
        self.shrink();
    }

    /// Calls `f` for every leaf.
    pub fn for_each(&self, mut f: impl FnMut(&Leaf<K>)) {
        match &self.repr {
            Repr::List(list) => list.iter().for_each(f),
            Repr::Grid(grid) => grid.cells.values().flatten().for_each(f),
            Repr::Tree(tree) => tree.index.values().for_each(&mut f),
        }
    }

    /// Removes every leaf that `range` covers, except those of `keep`.
    #[inline]
    pub fn remove_covered(&mut self, range: &ByteRange, keep: K) {
        match &mut self.repr {
            Repr::List(list) => return list.retain(|l| l.cmd == keep || !range.covers(&l.range)),
            Repr::Grid(grid) => grid.visit(range, |_| {}, |l| l.cmd == keep || !range.covers(&l.range)),
            Repr::Tree(tree) => {
                let covered: SmallVec<[(usize, u64); 8]> = tree
                    .index
                    .range((range.start, 0)..(range.end, 0))
                    .filter(|(_, l)| l.cmd != keep && range.covers(&l.range))
                    .map(|(k, _)| *k)
                    .collect();
                for k in covered {
                    tree.index.remove(&k);
                }
            }
        }
        self.shrink();
    }

    /// Removes the leaves of `cmd` that start where `range` starts.
    #[inline]
    pub fn remove(&mut self, cmd: K, range: &ByteRange) {
        match &mut self.repr {
            Repr::List(list) => return list.retain(|l| l.cmd != cmd),
            Repr::Grid(grid) => {
                let c = range.start / grid.granule;
                grid.retain_in(Some(c..c + 1), |l| !(l.cmd == cmd && l.range.start == range.start));
            }
            Repr::Tree(tree) => {
                tree.index.remove(&(range.start, cmd.bits()));
            }
        }
        self.shrink();
    }

    /// Removes every leaf whose command `gone` names; returns the hull of their ranges,
    /// if any was removed. For a few leaves among many (an index's tree is edited in
    /// place).
    pub fn remove_commands(&mut self, gone: impl Fn(K) -> bool) -> Option<ByteRange> {
        let mut hull: Option<ByteRange> = None;
        self.retain_all(false, |l| {
            if !gone(l.cmd) {
                return true;
            }
            let h = hull.get_or_insert(l.range);
            *h = h.hull(&l.range);
            false
        });
        hull
    }

    /// Keeps only the leaves of commands `live` names, in one walk: what removing
    /// many leaves one by one costs in index searches, this pays once per leaf held.
    pub fn retain_live(&mut self, live: impl Fn(K) -> bool) {
        self.retain_all(true, |l| live(l.cmd));
    }

    /// Keeps the leaves `keep` allows, walking all of them. With `rebuild`, a tree is
    /// rebuilt from its survivors, already in key order (one bulk build, where
    /// removing in place rebalances the tree after every removal): for removing many.
    fn retain_all(&mut self, rebuild: bool, mut keep: impl FnMut(&Leaf<K>) -> bool) {
        match &mut self.repr {
            Repr::List(list) => list.retain(|l| keep(l)),
            Repr::Grid(grid) => grid.retain_in(None, keep),
            Repr::Tree(tree) if rebuild => {
                tree.index = std::mem::take(&mut tree.index).into_iter().filter(|(_, l)| keep(l)).collect();
            }
            Repr::Tree(tree) => tree.index.retain(|_, l| keep(l)),
        }
        self.shrink();
    }

    /// Whether the leaves are in an index (a grid or a tree) rather than a short list.
    pub fn is_indexed(&self) -> bool {
        !matches!(self.repr, Repr::List(_))
    }

    /// Which index holds the leaves, if any.
    #[cfg(test)]
    fn indexed(&self) -> Option<&'static str> {
        match &self.repr {
            Repr::List(_) => None,
            Repr::Grid(_) => Some("grid"),
            Repr::Tree(_) => Some("tree"),
        }
    }

    /// Back to the short list once the index is small again.
    fn shrink(&mut self) {
        if matches!(self.repr, Repr::List(_)) || self.len() > INDEX_AT / 2 {
            return;
        }
        let mut list = SmallVec::new();
        self.for_each(|l| list.push(*l));
        self.repr = Repr::List(list);
    }
}

/// One memory space's copy of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The memory space.
    pub space: MemSpace,
    /// The allocation (none for host memory).
    pub alloc: Option<AllocId>,
    /// Whether it holds the current contents (once `producer` has finished).
    pub valid: bool,
    /// The unfinished memory move that fills it, if any.
    pub producer: Option<Entity>,
}

impl Location {
    /// The device owning the allocation (none for host memory).
    pub fn device(&self) -> Option<DeviceId> {
        match self.space {
            MemSpace::Device(d) => Some(d),
            MemSpace::Host => None,
        }
    }
}

/// The memory record of one buffer.
#[derive(Component, Debug)]
pub struct MemoryRecord {
    /// The buffer.
    pub buffer: Arc<BufferCore>,
    /// Unfinished readers and writers, by range (the memory rule's leaves:
    /// [`Accesses`](crate::rules::Accesses)).
    pub leaves: crate::rules::Accesses<Entity>,
    /// Copies of the contents; the host copy is always first.
    pub locations: SmallVec<[Location; 2]>,
    /// Leaves of finished commands not yet removed: see [`MemoryRecord::release`].
    pub released: ReleasedLeaves,
    /// Failures of commands that used the buffer, kept after they retired until the
    /// user synchronizes (see [`FailureSync`](crate::FailureSync)): a command
    /// resolved meanwhile that would have depended on one fails with it
    /// ([`MemoryRecord::kept_failure`]), as it would have had the failed command still
    /// been alive. Empty but for failures: the common path checks one length. The
    /// record is in [`QueueFailures::records`](crate::QueueFailures) exactly while
    /// this is not empty.
    pub failures: Vec<KeptFailure>,
}

/// A failed command's use of a buffer range, kept on the buffer's record.
#[derive(Clone, Debug)]
pub struct KeptFailure {
    /// The range it used.
    pub range: ByteRange,
    /// Whether it wrote the range.
    pub writes: bool,
    /// Its failure (numbered in [`FailureSync`](crate::FailureSync) order).
    pub failure: crate::QueueFailure,
}

/// The leaves of finished commands that a record still holds, to be removed together:
/// each one while they are few against the leaves held, then only that a sweep is
/// due. Empty between retire passes, so only leaves of unfinished commands are ever
/// read.
#[derive(Debug, Default)]
pub struct ReleasedLeaves {
    leaves: Vec<(Entity, ByteRange)>,
    sweep: bool,
}

/// A sweep replaces one-by-one removal once the released leaves are more than this
/// fraction (1 / `SWEEP_AT`) of the leaves held.
const SWEEP_AT: usize = 8;

impl ReleasedLeaves {
    /// Notes that `cmd`'s leaf at `range` goes, of `held` leaves; returns whether
    /// nothing was pending before.
    pub fn push(&mut self, cmd: Entity, range: ByteRange, held: usize) -> bool {
        let first = self.is_empty();
        if !self.sweep {
            self.leaves.push((cmd, range));
            if self.leaves.len() * SWEEP_AT > held {
                self.sweep = true;
                self.leaves.clear();
            }
        }
        first
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        !self.sweep && self.leaves.is_empty()
    }

    /// Removes the pending leaves from `leaves`: one by one, or in one sweep that
    /// keeps only the leaves of commands `live` names (a finished command is not).
    pub fn remove_from(
        &mut self,
        leaves: &mut crate::rules::Accesses<Entity>,
        live: impl Fn(Entity) -> bool,
    ) {
        if std::mem::take(&mut self.sweep) {
            leaves.reads.retain_live(&live);
            leaves.writes.retain_live(&live);
        } else {
            for (cmd, range) in self.leaves.drain(..) {
                leaves.reads.remove(cmd, &range);
                leaves.writes.remove(cmd, &range);
            }
        }
    }
}

impl MemoryRecord {
    /// A record whose only (valid) copy is the host storage.
    pub fn new(buffer: Arc<BufferCore>) -> Self {
        Self {
            buffer,
            leaves: crate::rules::Accesses::new(),
            locations: SmallVec::from_iter([Location {
                space: MemSpace::Host,
                alloc: None,
                valid: true,
                producer: None,
            }]),
            released: ReleasedLeaves::default(),
            failures: Vec::new(),
        }
    }

    /// The kept failure that a command using `range` (writing it if `writes`) depends
    /// on by the memory rule (overlapping ranges, one side writing), if any.
    pub fn kept_failure(&self, range: &ByteRange, writes: bool) -> Option<&crate::QueueFailure> {
        self.failures.iter().find(|f| (writes || f.writes) && f.range.overlaps(range)).map(|f| &f.failure)
    }

    /// The location for `space`, if any.
    pub fn location(&self, space: MemSpace) -> Option<&Location> {
        self.locations.iter().find(|l| l.space == space)
    }

    /// The location for `space`, mutably.
    pub fn location_mut(&mut self, space: MemSpace) -> Option<&mut Location> {
        self.locations.iter_mut().find(|l| l.space == space)
    }

    /// `cmd`, which used `range`, finished: it is no longer a producer, and its leaf
    /// goes. From short lists it goes at once; from an index it joins
    /// [`released`](Self::released), which the caller must remove before anything
    /// reads the leaves again. Returns whether it joined an empty `released` (the
    /// caller then lists the record).
    ///
    /// Deferred from an index so that a pass retiring many commands of one buffer
    /// removes their leaves in one sweep instead of two index searches each; a short
    /// list's removal is a short walk, cheaper than noting it and coming back.
    pub fn release(&mut self, cmd: Entity, range: &ByteRange) -> bool {
        for loc in &mut self.locations {
            if loc.producer == Some(cmd) {
                loc.producer = None;
            }
        }
        if !self.leaves.is_indexed() {
            self.leaves.reads.remove(cmd, range);
            self.leaves.writes.remove(cmd, range);
            return false;
        }
        self.released.push(cmd, *range, self.leaves.len())
    }

    /// Whether any unfinished command still uses the buffer.
    pub fn is_idle(&self) -> bool {
        self.leaves.is_empty() && self.locations.iter().all(|l| l.producer.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(i: u32, start: usize, len: usize) -> Leaf {
        Leaf { cmd: Entity::from_raw_u32(i + 1).unwrap(), range: ByteRange::new(start, len) }
    }

    fn overlapping(set: &LeafSet, start: usize, len: usize) -> Vec<Entity> {
        let mut v = Vec::new();
        set.for_each_overlapping(&ByteRange::new(start, len), |l| v.push(l.cmd));
        v.sort();
        v
    }

    /// The list and the index answer the same queries.
    #[test]
    fn leaf_set_indexes_many_disjoint_leaves() {
        let mut set = LeafSet::default();
        for i in 0..1000 {
            set.push(leaf(i, i as usize * 8, 8));
        }
        assert_eq!(set.indexed(), Some("grid"), "equal aligned ranges");
        assert_eq!(set.len(), 1000);
        let mut expect = vec![leaf(2, 0, 0).cmd, leaf(3, 0, 0).cmd];
        expect.sort();
        assert_eq!(overlapping(&set, 20, 8), expect);
        set.push(leaf(5000, 0, 8000)); // one wide leaf widens the look-back window
        assert_eq!(overlapping(&set, 7996, 2).len(), 2);
        set.remove_covered(&ByteRange::new(0, 400), leaf(5000, 0, 0).cmd);
        assert_eq!(set.len(), 1001 - 50);
        for i in 50..1000 {
            set.remove(leaf(i, 0, 0).cmd, &ByteRange::new(i as usize * 8, 8));
        }
        assert_eq!(set.indexed(), None, "shrinks back to a list");
        assert_eq!(set.len(), 1);
        assert_eq!(overlapping(&set, 100, 1), vec![leaf(5000, 0, 0).cmd]);
    }

    /// Random operations on a leaf set answer as a plain list does, through every
    /// representation: the short list, the grid of aligned granules and the tree.
    #[test]
    fn every_representation_answers_as_a_plain_list() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        let mut seen = std::collections::BTreeSet::new();
        for round in 0..40 {
            let mut set: LeafSet<u32> = LeafSet::default();
            let mut model: Vec<Leaf<u32>> = Vec::new();
            // Even rounds keep to 4-byte elements (a grid), odd ones mix in wider
            // ranges (a tree) after a while.
            let wide = round % 2 == 1;
            for step in 0..600u32 {
                let range = match wide && next(8) == 0 {
                    true => ByteRange::new(next(400), 1 + next(40)),
                    false => ByteRange::new(next(100) * 4, 4),
                };
                // Queries also over ranges that are not whole granules, empty ones
                // included.
                let query = match next(2) {
                    0 => range,
                    _ => ByteRange::new(next(404), next(24)),
                };
                let sorted = |mut v: Vec<(u32, usize, usize)>| {
                    v.sort();
                    v
                };
                let key = |l: &Leaf<u32>| (l.cmd, l.range.start, l.range.end);
                match next(10) {
                    0..=4 => {
                        let l = Leaf { cmd: step, range };
                        set.push(l);
                        model.push(l);
                    }
                    5 => {
                        let mut got = Vec::new();
                        set.for_each_overlapping(&query, |l| got.push(key(l)));
                        let want = model.iter().filter(|l| l.range.overlaps(&query)).map(key).collect();
                        assert_eq!(sorted(got), sorted(want), "overlapping {query:?}");
                    }
                    6 => {
                        let keep = model.get(next(model.len() as u64 + 1)).map_or(u32::MAX, |l| l.cmd);
                        let mut got = Vec::new();
                        set.overlap_and_cover(&query, keep, |l| got.push(key(l)));
                        let want = model.iter().filter(|l| l.range.overlaps(&query)).map(key).collect();
                        assert_eq!(sorted(got), sorted(want), "overlap_and_cover {query:?}");
                        model.retain(|l| l.cmd == keep || !query.covers(&l.range));
                    }
                    7 => {
                        set.remove_covered(&query, u32::MAX);
                        model.retain(|l| !query.covers(&l.range));
                    }
                    8 if !model.is_empty() => {
                        let l = model.swap_remove(next(model.len() as u64));
                        set.remove(l.cmd, &l.range);
                    }
                    _ => {
                        let cut = step.saturating_sub(next(50) as u32);
                        let hull = set.remove_commands(|c| c.is_multiple_of(7) && c < cut);
                        let gone = |l: &Leaf<u32>| l.cmd.is_multiple_of(7) && l.cmd < cut;
                        let want =
                            model.iter().filter(|l| gone(l)).map(|l| l.range).reduce(|a, b| a.hull(&b));
                        assert_eq!(hull, want);
                        model.retain(|l| !gone(l));
                        set.retain_live(|c| !c.is_multiple_of(11) || c >= cut);
                        model.retain(|l| !l.cmd.is_multiple_of(11) || l.cmd >= cut);
                    }
                }
                let mut got = Vec::new();
                set.for_each(|l| got.push(key(l)));
                assert_eq!(sorted(got), sorted(model.iter().map(key).collect()), "round {round} step {step}");
                assert_eq!(set.len(), model.len());
                seen.insert(set.indexed());
            }
        }
        assert_eq!(seen.len(), 3, "every representation was exercised: {seen:?}");
    }

    /// A writer finds what it overlaps and removes what it covers in one walk, the
    /// same in the list and in the index; its own leaves stay.
    #[test]
    fn a_writer_overlaps_and_covers_in_one_walk() {
        for n in [8u32, 1000] {
            let mut set: LeafSet<u32> = LeafSet::default();
            for i in 0..n {
                set.push(Leaf { cmd: i, range: ByteRange::new(i as usize * 8, 8) });
            }
            set.push(Leaf { cmd: 7777, range: ByteRange::new(16, 16) });
            let mut seen = Vec::new();
            // Bytes 12..36: overlaps leaves 1..=4 and 7777; covers 2, 3 and 7777's own.
            set.overlap_and_cover(&ByteRange::new(12, 24), 7777, |l| seen.push(l.cmd));
            seen.sort();
            assert_eq!(seen, vec![1, 2, 3, 4, 7777], "n = {n}");
            let mut left = Vec::new();
            set.for_each_overlapping(&ByteRange::new(0, 48), |l| left.push(l.cmd));
            left.sort();
            assert_eq!(left, vec![0, 1, 4, 5, 7777], "n = {n}");
            assert_eq!(set.len(), n as usize + 1 - 2);
        }
    }

    fn leaves_of(set: &LeafSet) -> Vec<(Entity, usize)> {
        let mut v = Vec::new();
        set.for_each(|l| v.push((l.cmd, l.range.start)));
        v.sort_by_key(|&(_, start)| start);
        v
    }

    /// Released leaves go one by one while they are few against the leaves held, and
    /// in one sweep once they are many: either way the record is left with exactly
    /// the leaves of the commands that have not finished, reads and writes.
    #[test]
    fn released_leaves_go_one_by_one_or_in_one_sweep() {
        for (held, finished) in [(1000u32, 10u32), (1000, 900), (20, 1), (20, 20)] {
            let mut acc = crate::rules::Accesses::<Entity>::new();
            for i in 0..held {
                let l = leaf(i, i as usize * 8, 8);
                acc.access(l.cmd, &l.range, i % 3 == 0, |_| {});
            }
            let mut released = ReleasedLeaves::default();
            assert!(released.is_empty());
            let gone = |e: Entity| e.index_u32() <= finished;
            for i in 0..finished {
                let l = leaf(i, i as usize * 8, 8);
                assert_eq!(released.push(l.cmd, l.range, acc.len()), i == 0, "only the first is new");
            }
            assert_eq!(released.sweep, finished as usize * SWEEP_AT > held as usize, "{held}, {finished}");
            released.remove_from(&mut acc, |e| !gone(e));
            assert!(released.is_empty(), "nothing pending after removal");
            let want_reads: Vec<_> = (finished..held)
                .filter(|i| i % 3 != 0)
                .map(|i| (leaf(i, 0, 0).cmd, i as usize * 8))
                .collect();
            let want_writes: Vec<_> = (finished..held)
                .filter(|i| i % 3 == 0)
                .map(|i| (leaf(i, 0, 0).cmd, i as usize * 8))
                .collect();
            assert_eq!(leaves_of(&acc.reads), want_reads, "{held}, {finished}");
            assert_eq!(leaves_of(&acc.writes), want_writes, "{held}, {finished}");
        }
    }

    /// The record of a fresh buffer of `bytes` bytes.
    fn record_of(bytes: usize) -> MemoryRecord {
        let buffer = crate::handle::BufferCore {
            id: 1,
            storage: Arc::new(gantry_driver::HostStorage::zeroed(bytes)),
            bytes,
            record: Default::default(),
            dropped: Default::default(),
            promotion: Default::default(),
            recorded: Default::default(),
        };
        MemoryRecord::new(Arc::new(buffer))
    }

    /// A record no longer names a finished command as the producer of a copy at once;
    /// its leaf waits for the removal.
    #[test]
    fn a_release_clears_the_producer_at_once() {
        let record = || record_of(8 * 40);
        // An index: 40 disjoint writes of one command.
        let cmd = leaf(0, 0, 8);
        let mut indexed = record();
        for i in 0..40 {
            indexed.leaves.access(cmd.cmd, &ByteRange::new(i * 8, 8), true, |_| {});
        }
        assert!(indexed.leaves.is_indexed());
        indexed.locations[0].producer = Some(cmd.cmd);
        assert!(!indexed.is_idle());
        assert!(indexed.release(cmd.cmd, &cmd.range));
        assert_eq!(indexed.locations[0].producer, None);
        assert_eq!(indexed.leaves.len(), 40, "the leaf stays until it is removed");
        for i in 1..40 {
            assert!(!indexed.release(cmd.cmd, &ByteRange::new(i * 8, 8)), "only the first is new");
        }
        let mut released = std::mem::take(&mut indexed.released);
        released.remove_from(&mut indexed.leaves, |_| false);
        assert!(indexed.is_idle());
        // A short list: the leaf goes at once, and nothing is pending.
        let mut short = record();
        short.leaves.access(cmd.cmd, &cmd.range, true, |_| {});
        assert!(!short.release(cmd.cmd, &cmd.range));
        assert!(short.is_idle() && short.released.is_empty());
    }

    /// A kept failure reaches a later use of the buffer by the memory rule: an
    /// overlapping range with one side writing. Reads after a failed read, and
    /// disjoint ranges, do not depend on it.
    #[test]
    fn a_kept_failure_reaches_what_the_memory_rule_orders_after_it() {
        let mut record = record_of(64);
        let failure = |seq| crate::QueueFailure {
            command: "bad".into(),
            root: gantry_driver::ExecError::RuntimeDropped,
            seq,
        };
        assert!(record.kept_failure(&ByteRange::new(0, 64), true).is_none());
        record.failures.push(KeptFailure { range: ByteRange::new(0, 16), writes: true, failure: failure(1) });
        record.failures.push(KeptFailure {
            range: ByteRange::new(32, 16),
            writes: false,
            failure: failure(2),
        });
        let seq = |range, writes| record.kept_failure(&range, writes).map(|f| f.seq);
        assert_eq!(seq(ByteRange::new(8, 4), false), Some(1), "read after a failed write");
        assert_eq!(seq(ByteRange::new(8, 4), true), Some(1), "write after a failed write");
        assert_eq!(seq(ByteRange::new(40, 4), true), Some(2), "write after a failed read");
        assert_eq!(seq(ByteRange::new(40, 4), false), None, "read after a failed read");
        assert_eq!(seq(ByteRange::new(16, 16), true), None, "between the two ranges");
    }

    #[test]
    fn ranges_overlap_and_cover() {
        let a = ByteRange::new(0, 8);
        let b = ByteRange::new(8, 8);
        assert!(!a.overlaps(&b));
        assert!(a.overlaps(&ByteRange::new(7, 2)));
        assert!(ByteRange::new(0, 16).covers(&b));
        assert!(!b.covers(&a));
    }
}
