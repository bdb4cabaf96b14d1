//! Iteration spaces: [`Range`] (1–3 dimensions), [`NdRange`] (global + local size)
//! and the validated [`Geometry`] a driver executes.
//!
//! Linearization follows SYCL: the last dimension varies fastest, so the linear id of
//! `(i0, i1, i2)` in a range `(r0, r1, r2)` is `(i0 * r1 + i1) * r2 + i2`.

use crate::error::RangeError;

/// Fewest work-items a plain (non-ND) range kernel puts in one driver work-group
/// (fewer only when the range is smaller): along its fastest dimension, and where
/// that is shorter, whole rows of it. Plain ranges carry no work-group semantics; a
/// group is only the unit of parallel scheduling, and each has a fixed cost that
/// this many elementwise items outweigh (figures: `docs/PERFORMANCE.md`).
pub const RANGE_CHUNK: usize = 4096;

/// Most work-items a plain range kernel puts in one group: ranges long enough to
/// keep [`RANGE_GROUPS`] groups of more items get groups of up to this many, which
/// spreads each group's fixed cost (its bindings, a fused kernel's plan walk and
/// stream set-up) over more items. That cost is more than its instructions where
/// memory is the limit (figures: `docs/PERFORMANCE.md`). A streamed chain touches
/// one span of each private region whatever the group's size
/// (`Plan::span_local`), so the larger groups cost it no cache.
pub const MAX_RANGE_CHUNK: usize = 64 * 1024;

/// Groups a long plain range keeps at least (see [`MAX_RANGE_CHUNK`]), so that every
/// worker of a many-core CPU still has several to take.
pub const RANGE_GROUPS: usize = 64;

/// A 1-, 2- or 3-dimensional extent. Unused trailing dimensions are 1.
///
/// ```
/// use gantry_driver::Range;
/// let r = Range::d2(4, 8);
/// assert_eq!(r.dims(), 2);
/// assert_eq!(r.size(), 32);
/// assert_eq!(Range::from(10).size(), 10);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Range {
    dims: u8,
    extent: [usize; 3],
}

impl Range {
    /// A one-dimensional range of `x` items.
    pub const fn d1(x: usize) -> Self {
        Self { dims: 1, extent: [x, 1, 1] }
    }
    /// A two-dimensional range; `y` varies fastest.
    pub const fn d2(x: usize, y: usize) -> Self {
        Self { dims: 2, extent: [x, y, 1] }
    }
    /// A three-dimensional range; `z` varies fastest.
    pub const fn d3(x: usize, y: usize, z: usize) -> Self {
        Self { dims: 3, extent: [x, y, z] }
    }
    /// Number of dimensions (1–3).
    pub const fn dims(&self) -> usize {
        self.dims as usize
    }
    /// Extent in dimension `d` (1 for `d >= dims`).
    pub const fn get(&self, d: usize) -> usize {
        if d < 3 {
            self.extent[d]
        } else {
            1
        }
    }
    /// All three extents, trailing ones padded with 1.
    pub const fn extent(&self) -> [usize; 3] {
        self.extent
    }
    /// Total number of items, or `None` on overflow.
    pub fn checked_size(&self) -> Option<usize> {
        self.extent[0].checked_mul(self.extent[1])?.checked_mul(self.extent[2])
    }
    /// Total number of items.
    pub fn size(&self) -> usize {
        self.extent[0] * self.extent[1] * self.extent[2]
    }
    /// Rejects empty extents and sizes that overflow `usize`.
    pub fn validate(&self) -> Result<(), RangeError> {
        for d in 0..self.dims() {
            if self.extent[d] == 0 {
                return Err(RangeError::ZeroExtent { dim: d });
            }
        }
        self.checked_size().map(|_| ()).ok_or(RangeError::Overflow)
    }
}

/// A range value whose number of dimensions its type tells (`usize` and `[usize; N]`),
/// or that only the value tells (`Range`: `DIMS` 0). A host loop over work-items
/// specialized for a known dimensionality runs along the fastest dimension with ids
/// the compiler sees are constant along it.
///
/// ```
/// use gantry_driver::RangeDims;
/// assert_eq!(<[usize; 2] as RangeDims>::DIMS, 2);
/// assert_eq!(<gantry_driver::Range as RangeDims>::DIMS, 0);
/// ```
pub trait RangeDims: Into<Range> {
    /// The number of dimensions, or 0 where only the value knows it.
    const DIMS: usize;
}
impl RangeDims for usize {
    const DIMS: usize = 1;
}
impl<const N: usize> RangeDims for [usize; N]
where
    [usize; N]: Into<Range>,
{
    const DIMS: usize = N;
}
impl RangeDims for Range {
    const DIMS: usize = 0;
}

impl From<usize> for Range {
    fn from(x: usize) -> Self {
        Self::d1(x)
    }
}
impl From<[usize; 1]> for Range {
    fn from(v: [usize; 1]) -> Self {
        Self::d1(v[0])
    }
}
impl From<[usize; 2]> for Range {
    fn from(v: [usize; 2]) -> Self {
        Self::d2(v[0], v[1])
    }
}
impl From<[usize; 3]> for Range {
    fn from(v: [usize; 3]) -> Self {
        Self::d3(v[0], v[1], v[2])
    }
}

/// An ND-range: a global range split into work-groups of a local range.
///
/// ```
/// use gantry_driver::{NdRange, Range};
/// let nd = NdRange::new([64, 64], [8, 16]);
/// let g = nd.geometry().unwrap();
/// assert_eq!(g.group_range(), [8, 4, 1]);
/// assert!(NdRange::new(10, 3).geometry().is_err()); // 3 does not divide 10
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NdRange {
    /// Total work-items per dimension.
    pub global: Range,
    /// Work-items per work-group per dimension; must divide `global`.
    pub local: Range,
    /// Added to every global id (SYCL's global offset).
    pub offset: [usize; 3],
}

impl NdRange {
    /// An ND-range with zero offset.
    pub fn new(global: impl Into<Range>, local: impl Into<Range>) -> Self {
        Self { global: global.into(), local: local.into(), offset: [0; 3] }
    }
    /// Sets the global offset.
    pub fn with_offset(mut self, offset: [usize; 3]) -> Self {
        self.offset = offset;
        self
    }
    /// Validates the range and returns the geometry drivers execute.
    pub fn geometry(&self) -> Result<Geometry, RangeError> {
        self.global.validate()?;
        self.local.validate()?;
        if self.global.dims() != self.local.dims() {
            return Err(RangeError::DimensionMismatch {
                global: self.global.dims(),
                local: self.local.dims(),
            });
        }
        for d in 0..3 {
            let (g, l) = (self.global.get(d), self.local.get(d));
            if g % l != 0 {
                return Err(RangeError::LocalDoesNotDivide { dim: d, global: g, local: l });
            }
        }
        Ok(Geometry {
            dims: self.global.dims,
            global: self.global.extent,
            local: self.local.extent,
            offset: self.offset,
            nd: true,
        })
    }
}

/// The validated iteration space of one launch: global extent, work-group extent and
/// offset (the group count follows). Plain ranges get a driver-chosen local extent and
/// may have a partial last group (`nd == false`); ND-ranges always divide evenly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    dims: u8,
    global: [usize; 3],
    local: [usize; 3],
    offset: [usize; 3],
    nd: bool,
}

// Recorded operations, graph nodes and patches each hold one.
const _: () = assert!(std::mem::size_of::<Geometry>() <= 80);

impl Geometry {
    /// The geometry of a plain range kernel: groups of [`RANGE_CHUNK`] items, or of a
    /// multiple of it up to [`MAX_RANGE_CHUNK`] where that still leaves
    /// [`RANGE_GROUPS`] groups (fewer items where the range is smaller), taken along
    /// the fastest dimension and, where it is shorter than a group, as whole rows.
    pub fn for_range(global: Range) -> Result<Self, RangeError> {
        Self::for_range_with_offset(global, [0; 3])
    }

    /// Like [`Geometry::for_range`] with a global offset.
    pub fn for_range_with_offset(global: Range, offset: [usize; 3]) -> Result<Self, RangeError> {
        global.validate()?;
        let dims = global.dims();
        let mut local = [1; 3];
        let chunk =
            (global.size() / RANGE_GROUPS / RANGE_CHUNK * RANGE_CHUNK).clamp(RANGE_CHUNK, MAX_RANGE_CHUNK);
        // A group takes `chunk` items along the fastest dimension, and where that
        // dimension fits whole, as many of its rows (then planes) as fit in `chunk`:
        // a short fastest dimension does not make many tiny groups.
        let mut items = 1;
        for d in (0..dims).rev() {
            let extent = global.get(d);
            local[d] = (chunk / items).clamp(1, extent);
            items *= local[d];
            if local[d] < extent {
                break;
            }
        }
        Ok(Self { dims: global.dims, global: global.extent, local, offset, nd: false })
    }

    /// Number of dimensions.
    pub fn dims(&self) -> usize {
        self.dims as usize
    }
    /// Global extent.
    pub fn global_range(&self) -> [usize; 3] {
        self.global
    }
    /// Work-group extent.
    pub fn local_range(&self) -> [usize; 3] {
        self.local
    }
    /// Number of work-groups in dimension `d` (the last one partial for a plain range
    /// that the local extent does not divide).
    #[inline]
    pub fn groups(&self, d: usize) -> usize {
        match self.local[d] {
            // Most launches have extent 1 in most dimensions (a single task in all
            // three): no division there, which costs more than the rest of a tiny
            // kernel's group loop.
            1 => self.global[d],
            l => self.global[d].div_ceil(l),
        }
    }
    /// Number of work-groups per dimension.
    #[inline]
    pub fn group_range(&self) -> [usize; 3] {
        [self.groups(0), self.groups(1), self.groups(2)]
    }
    /// Global offset.
    pub fn offset(&self) -> [usize; 3] {
        self.offset
    }
    /// Whether this came from an ND-range (user-chosen, evenly dividing local size).
    pub fn is_nd(&self) -> bool {
        self.nd
    }
    /// Total number of work-items.
    pub fn global_size(&self) -> usize {
        self.global[0] * self.global[1] * self.global[2]
    }
    /// Work-items in a full work-group.
    pub fn local_size(&self) -> usize {
        self.local[0] * self.local[1] * self.local[2]
    }
    /// Total number of work-groups.
    #[inline]
    pub fn group_count(&self) -> usize {
        let n = self.group_range();
        n[0] * n[1] * n[2]
    }
    /// The 3-D group id of linear group `g`.
    #[inline]
    pub fn group_id(&self, g: usize) -> [usize; 3] {
        if self.dims == 1 {
            return [g, 0, 0]; // every 1-D launch: once per group, no division
        }
        // (`delinearize` does not read the slowest dimension's extent.)
        delinearize(g, [1, self.groups(1), self.groups(2)])
    }
}

/// Linear id of `id` in `extent` (last dimension fastest).
#[inline]
pub fn linearize(id: [usize; 3], extent: [usize; 3]) -> usize {
    (id[0] * extent[1] + id[1]) * extent[2] + id[2]
}

/// Inverse of [`linearize`].
#[inline]
pub fn delinearize(mut linear: usize, extent: [usize; 3]) -> [usize; 3] {
    let z = linear % extent[2];
    linear /= extent[2];
    let y = linear % extent[1];
    [linear / extent[1], y, z]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linearization_round_trips() {
        let e = [3, 4, 5];
        for l in 0..60 {
            assert_eq!(linearize(delinearize(l, e), e), l);
        }
        assert_eq!(linearize([1, 2, 3], e), 20 + 10 + 3);
    }

    #[test]
    fn nd_validation_names_the_problem() {
        assert_eq!(NdRange::new(0, 1).geometry(), Err(RangeError::ZeroExtent { dim: 0 }));
        assert_eq!(
            NdRange::new([8, 6], [4, 4]).geometry(),
            Err(RangeError::LocalDoesNotDivide { dim: 1, global: 6, local: 4 })
        );
        assert_eq!(
            NdRange::new([8, 8], 4).geometry(),
            Err(RangeError::DimensionMismatch { global: 2, local: 1 })
        );
        assert_eq!(Range::d2(usize::MAX, 2).validate(), Err(RangeError::Overflow));
    }

    #[test]
    fn plain_ranges_chunk_the_fastest_dimension() {
        let g = Geometry::for_range(Range::d1(10_000)).unwrap();
        assert_eq!(g.local_range(), [RANGE_CHUNK, 1, 1]);
        assert_eq!(g.group_range(), [3, 1, 1]);
        let g = Geometry::for_range(Range::d2(7, 5)).unwrap();
        assert_eq!(g.local_range(), [7, 5, 1]);
        assert_eq!(g.group_count(), 1);
        // A short fastest dimension: whole rows per group, as many as fit.
        let g = Geometry::for_range(Range::d2(4000, 500)).unwrap();
        assert_eq!((g.local_range(), g.group_count()), ([57, 500, 1], 71));
        let g = Geometry::for_range(Range::d2(512, 512)).unwrap();
        assert_eq!((g.local_range(), g.group_count()), ([8, 512, 1], 64));
        let g = Geometry::for_range(Range::d3(40, 30, 20)).unwrap();
        assert_eq!((g.local_range(), g.group_count()), ([6, 30, 20], 7));
        let g = Geometry::for_range(Range::d3(4000, 30, 20)).unwrap();
        assert_eq!((g.local_range(), g.group_count()), ([61, 30, 20], 66));
        assert!(!g.is_nd());
        // Long ranges get larger groups while they keep `RANGE_GROUPS` of them.
        let chunk = |n: usize| Geometry::for_range(Range::d1(n)).unwrap().local_range()[0];
        assert_eq!(chunk(RANGE_GROUPS * RANGE_CHUNK * 2 - 1), RANGE_CHUNK);
        assert_eq!(chunk(RANGE_GROUPS * RANGE_CHUNK * 2), 2 * RANGE_CHUNK);
        assert_eq!(chunk(RANGE_GROUPS * RANGE_CHUNK * 3 + 5), 3 * RANGE_CHUNK);
        assert_eq!(chunk(1 << 24), MAX_RANGE_CHUNK);
        let g = Geometry::for_range(Range::d2(3, 1 << 24)).unwrap();
        assert_eq!(
            (g.local_range(), g.group_count()),
            ([1, MAX_RANGE_CHUNK, 1], 3 * ((1 << 24) / MAX_RANGE_CHUNK))
        );
    }

    /// Group ids (computed, not stored) enumerate the group grid in linear order for
    /// plain and ND-ranges of 1 to 3 dimensions, partial last groups included.
    #[test]
    fn group_ids_walk_the_group_grid() {
        let geometries = [
            (Geometry::for_range(Range::d1(10_000)).unwrap(), [3, 1, 1]),
            (Geometry::for_range(Range::d2(3, 9000)).unwrap(), [3, 3, 1]),
            (Geometry::for_range(Range::d3(2, 3, 6000)).unwrap(), [2, 3, 2]),
            (NdRange::new([8, 6], [2, 3]).geometry().unwrap(), [4, 2, 1]),
            (NdRange::new([4, 6, 8], [2, 3, 4]).geometry().unwrap(), [2, 2, 2]),
        ];
        for (g, groups) in geometries {
            let n = g.group_range();
            assert_eq!(n, groups, "{g:?}");
            let mut expected = Vec::new();
            for a in 0..n[0] {
                for b in 0..n[1] {
                    for c in 0..n[2] {
                        expected.push([a, b, c]);
                    }
                }
            }
            let ids: Vec<_> = (0..g.group_count()).map(|i| g.group_id(i)).collect();
            assert_eq!(ids, expected, "{g:?}");
        }
    }
}
