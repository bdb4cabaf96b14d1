//! The fusion rules every fusion compiler applies, whatever its kernels' code is
//! (closure kernels in `gantry_host`, LLVM IR in `gantry-jit`), so that one list
//! fuses, or is refused for the same typed reason, on every compiler:
//!
//! * [`fused_geometry`]: the fused grid and which kernels' work-item ids are
//!   remapped (the DPC++ kernel-fusion design, "Fusing kernels with different
//!   nd-ranges": its restrictions, simplified to four checks);
//! * [`promotion_of`]: whether the slots on one buffer can be internalized, and how
//!   large the scratch is (the design's "Internalization Behavior");
//! * [`group_slots`]: the identical-argument groups (every slot on one buffer is one
//!   argument of the fused kernel, over the hull of the slots' ranges, or one
//!   internal buffer), and where each kernel's slot points.

use smallvec::SmallVec;

use super::{FusionError, FusionKernel, Promotion, PromotionMismatch};
use crate::range::{Geometry, NdRange, Range};

/// Which slots an argument or internal buffer stands for: (kernel index, slot).
pub type Uses = SmallVec<[(u32, u32); 2]>;

/// The fused grid of a fusion list and, per kernel, whether its work-items see ids
/// other than the grid's own (see [`fused_geometry`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedGrid {
    /// The grid the fused kernel is launched over.
    pub geometry: Geometry,
    /// Per kernel, in list order: whether it runs remapped, i.e. its geometry is not
    /// the grid's. A remapped kernel's work-items keep their global linear id in the
    /// grid; work-items at or past its own global size skip it, and where it is
    /// [`reshaped`] its global ids are that linear id delinearized in its own range.
    pub remap: Vec<bool>,
}

fn range_of(dims: usize, e: [usize; 3]) -> Range {
    match dims {
        1 => Range::d1(e[0]),
        2 => Range::d2(e[0], e[1]),
        _ => Range::d3(e[0], e[1], e[2]),
    }
}

/// Whether a kernel over `own` needs its global ids delinearized from the grid's
/// linear id (not just work-items past its range skipped): its dimension count, or
/// its extent in any dimension but the slowest (Gantry's dimension 0), differs from
/// the grid's.
pub fn reshaped(own: &Geometry, grid: &Geometry) -> bool {
    own.dims() != grid.dims() || own.global_range()[1..] != grid.global_range()[1..]
}

/// The fused grid (the DPC++ kernel-fusion design, "Fusing kernels with different
/// nd-ranges"): the largest kernel's global range (the first of equals), with the
/// common work-group size if any kernel has one, and per kernel whether its ids are
/// remapped from the grid.
///
/// The design's restrictions, as checked here, in this order:
///
/// * every kernel has the same offset ([`FusionError::DifferentOffsets`]);
/// * no two kernels with a work-group size have different ones
///   ([`FusionError::DifferentLocalSizes`]);
/// * with a work-group size, the largest kernel has that kernel's dimension count
///   ([`FusionError::DifferentDimensions`]) and the group size divides its range
///   ([`FusionError::NonUniformWorkGroups`]);
/// * a kernel with a work-group size is never [`reshaped`]
///   ([`FusionError::DifferentDimensions`], [`FusionError::DifferentGlobalSizes`]):
///   its local and group ids stay the grid's, so its groups stay groups;
/// * a reshaped kernel needs offset zero ([`FusionError::DifferentOffsets`]).
///
/// # Errors
///
/// [`FusionError::Empty`] for an empty list, or the first restriction broken.
pub fn fused_geometry(kernels: &[FusionKernel]) -> Result<FusedGrid, FusionError> {
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
        let reshaped = reshaped(&k.geometry, &geometry);
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
    Ok(FusedGrid { geometry, remap })
}

/// Decides whether the slots `uses` (kernel index, slot) on one buffer can be
/// internalized, and how large the scratch is: `Ok(Some((kind, bytes)))` with bytes
/// per work-group (local) or per work-item (private), `Ok(None)` when no slot asks
/// for promotion, `Err` with the reason a hint is dropped (the buffer then stays in
/// global memory).
///
/// Every slot must ask for the same promotion, cover the same byte range, and give
/// the same whole, non-zero number of elements per work-group (local: range bytes /
/// the kernel's group count, and every kernel needs a work-group size) or per
/// work-item (private: range bytes / the kernel's global size).
pub fn promotion_of(
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

/// The request's buffers, numbered in order of first appearance (kernel by kernel,
/// slot by slot): the numbering [`group_slots`] and the compilers' cache keys use,
/// so that a chain over other buffers of the same layout is the same chain.
pub fn buffers_in_order(kernels: &[FusionKernel]) -> SmallVec<[u64; 8]> {
    let mut order = SmallVec::new();
    for a in kernels.iter().flat_map(|k| &k.args) {
        if !order.contains(&a.buffer) {
            order.push(a.buffer);
        }
    }
    order
}

/// Where a kernel's accessor slot points inside the fused kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotPlace {
    /// Bytes `offset..offset + len` of fused argument `index` (the slot's range
    /// relative to the argument's hull).
    Arg {
        /// The fused argument.
        index: u32,
        /// Where the slot's range starts in the argument.
        offset: usize,
        /// The slot's bytes.
        len: usize,
    },
    /// Internal buffer `index`.
    Internal {
        /// The internal buffer.
        index: u32,
    },
}

/// A fused argument: the slots on one buffer kept in global memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgGroup {
    /// The buffer, by its number in [`buffers_in_order`].
    pub buffer: usize,
    /// First byte of the hull of the slots' ranges.
    pub start: usize,
    /// One past its last byte.
    pub end: usize,
    /// The slots.
    pub uses: Uses,
}

/// An internalized buffer: the slots on one buffer that [`promotion_of`] promotes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InternalGroup {
    /// The buffer, by its number in [`buffers_in_order`].
    pub buffer: usize,
    /// Local or private.
    pub kind: Promotion,
    /// Bytes per work-group (local) or per work-item (private).
    pub bytes: usize,
    /// Bytes of the slots' range (every slot on it has the same).
    pub len: usize,
    /// The slots.
    pub uses: Uses,
}

/// The identical-argument groups of a fusion list (see [`group_slots`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotGroups {
    /// The fused kernel's arguments, in order of their buffers' first appearance.
    pub args: Vec<ArgGroup>,
    /// The internalized buffers, in the same order.
    pub internal: Vec<InternalGroup>,
    /// Per kernel, per slot: where it points.
    pub slots: Vec<Vec<SlotPlace>>,
    /// Promotion hints not followed: (buffer number, reason).
    pub warnings: Vec<(usize, PromotionMismatch)>,
}

/// Groups every slot of every kernel by buffer (`buffers`, as [`buffers_in_order`]
/// numbers them): each buffer becomes one internal buffer where [`promotion_of`]
/// allows, else one fused argument over the hull of its slots' ranges (with a
/// warning where a hint was dropped). `keep_global(buffer number)` forces a buffer
/// into global memory: a compiler that cannot internalize some buffer's accesses
/// says so there (its own warning then explains why).
pub fn group_slots(
    kernels: &[FusionKernel],
    buffers: &[u64],
    keep_global: impl Fn(usize) -> bool,
) -> SlotGroups {
    let mut slots: Vec<Vec<SlotPlace>> =
        kernels.iter().map(|k| vec![SlotPlace::Internal { index: u32::MAX }; k.args.len()]).collect();
    let (mut args, mut internal, mut warnings) = (Vec::new(), Vec::new(), Vec::new());
    for (canon, &buffer) in buffers.iter().enumerate() {
        let uses: Uses = kernels
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
        if uses.is_empty() {
            continue;
        }
        let arg = |&(k, s): &(u32, u32)| &kernels[k as usize].args[s as usize];
        match promotion_of(kernels, &uses) {
            Ok(Some((kind, bytes))) if !keep_global(canon) => {
                let index = internal.len() as u32;
                for &(k, s) in &uses {
                    slots[k as usize][s as usize] = SlotPlace::Internal { index };
                }
                let len = arg(&uses[0]).bytes();
                internal.push(InternalGroup { buffer: canon, kind, bytes, len, uses });
                continue;
            }
            Ok(_) => {}
            Err(reason) => warnings.push((canon, reason)),
        }
        let start = uses.iter().map(|u| arg(u).start).min().expect("a buffer has a use");
        let end = uses.iter().map(|u| arg(u).end).max().expect("a buffer has a use");
        let index = args.len() as u32;
        for u in &uses {
            let a = arg(u);
            slots[u.0 as usize][u.1 as usize] =
                SlotPlace::Arg { index, offset: a.start - start, len: a.bytes() };
        }
        args.push(ArgGroup { buffer: canon, start, end, uses });
    }
    SlotGroups { args, internal, slots, warnings }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fusion::FusionArg;
    use crate::kernel::{Kernel, KernelRef, Signature};

    fn kernel(name: &str) -> KernelRef {
        Kernel::new(name, Signature::new()).into_ref()
    }

    fn k(name: &str, geometry: Geometry, args: &[FusionArg]) -> FusionKernel {
        FusionKernel {
            kernel: kernel(name),
            geometry,
            args: args.iter().cloned().collect(),
            scalars: Default::default(),
            deps: Default::default(),
        }
    }

    fn range(r: impl Into<Range>) -> Geometry {
        Geometry::for_range(r.into()).unwrap()
    }

    fn nd(g: impl Into<Range>, l: impl Into<Range>) -> Geometry {
        NdRange::new(g, l).geometry().unwrap()
    }

    /// The largest range wins; smaller and reshaped plain kernels are remapped.
    #[test]
    fn grid_is_the_largest_range_and_others_remap() {
        let a = FusionArg::new(1, 0..64, 4);
        let grid = fused_geometry(&[
            k("small", range(8), std::slice::from_ref(&a)),
            k("big", range(16), std::slice::from_ref(&a)),
            k("square", range([4, 4]), std::slice::from_ref(&a)),
        ])
        .unwrap();
        assert_eq!(grid.geometry.global_range(), [16, 1, 1]);
        assert!(!grid.geometry.is_nd());
        assert_eq!(grid.remap, [true, false, true]);
        assert!(reshaped(&range([4, 4]), &grid.geometry) && !reshaped(&range(8), &grid.geometry));
    }

    /// Each restriction gives its typed reason.
    #[test]
    fn restrictions_give_typed_reasons() {
        let err = |ks: &[FusionKernel]| fused_geometry(ks).unwrap_err();
        assert_eq!(fused_geometry(&[]).unwrap_err(), FusionError::Empty);
        assert!(matches!(
            err(&[k("a", nd(64, 8), &[]), k("b", nd(64, 16), &[])]),
            FusionError::DifferentLocalSizes { first_local: [8, 1, 1], second_local: [16, 1, 1], .. }
        ));
        // The grid is plain `12` with the ND kernel's local size 8: not uniform.
        assert!(matches!(
            err(&[k("a", nd(8, 8), &[]), k("b", range(12), &[])]),
            FusionError::NonUniformWorkGroups { global: [12, 1, 1], local: [8, 1, 1] }
        ));
        assert!(matches!(
            err(&[k("a", nd(8, 8), &[]), k("b", range([4, 4]), &[])]),
            FusionError::DifferentDimensions { dims: 1, fused_dims: 2, .. }
        ));
        assert!(matches!(
            err(&[k("a", nd([2, 8], [1, 8]), &[]), k("b", range([2, 16]), &[])]),
            FusionError::DifferentGlobalSizes { global: [2, 8, 1], fused: [2, 16, 1], .. }
        ));
        let off = Geometry::for_range_with_offset(Range::d1(8), [2, 0, 0]).unwrap();
        assert!(matches!(
            err(&[k("a", off, &[]), k("b", range(8), &[])]),
            FusionError::DifferentOffsets { .. }
        ));
        let off2 = Geometry::for_range_with_offset(Range::d2(2, 2), [2, 0, 0]).unwrap();
        assert!(matches!(
            err(&[k("a", off, &[]), k("b", off2, &[])]),
            FusionError::DifferentOffsets { fused: [0, 0, 0], .. }
        ));
    }

    /// Sizes per group or item; mismatched hints are dropped with their reason.
    #[test]
    fn promotion_sizes_and_mismatches() {
        let g = nd(64, 16);
        let local = FusionArg::new(1, 0..256, 4).promoted(Promotion::Local);
        let private = FusionArg::new(1, 0..256, 4).promoted(Promotion::Private);
        let plain = FusionArg::new(1, 0..256, 4);
        let ks = [
            k("a", g, &[local.clone(), private.clone(), plain]),
            k("b", range(64), std::slice::from_ref(&local)),
        ];
        assert_eq!(promotion_of(&ks, &[(0, 0)]), Ok(Some((Promotion::Local, 64))));
        assert_eq!(promotion_of(&ks, &[(0, 1)]), Ok(Some((Promotion::Private, 4))));
        assert_eq!(promotion_of(&ks, &[(0, 2)]), Ok(None));
        assert_eq!(promotion_of(&ks, &[(0, 0), (0, 2)]), Err(PromotionMismatch::NotAllPromoted));
        assert_eq!(promotion_of(&ks, &[(0, 0), (0, 1)]), Err(PromotionMismatch::LocalAndPrivate));
        assert!(matches!(promotion_of(&ks, &[(1, 0)]), Err(PromotionMismatch::NoWorkGroupSize { .. })));
        let other = FusionArg::new(1, 0..128, 4).promoted(Promotion::Private);
        let ks = [k("a", range(64), std::slice::from_ref(&private)), k("b", range(64), &[other])];
        assert_eq!(promotion_of(&ks, &[(0, 0), (1, 0)]), Err(PromotionMismatch::DifferentRanges));
        // 256 bytes over 128 work-items: 2 bytes, not a whole 4-byte element.
        let ks = [k("a", range(128), &[private])];
        assert_eq!(promotion_of(&ks, &[(0, 0)]), Err(PromotionMismatch::Sizes));
    }

    /// One argument per buffer over the hull of its slots; internal buffers and
    /// forced-global ones; slots point into them.
    #[test]
    fn slots_group_by_buffer() {
        let g = range(16);
        let x = FusionArg::new(7, 64..128, 4);
        let x2 = FusionArg::new(7, 0..64, 4);
        let t = FusionArg::new(9, 0..64, 4).promoted(Promotion::Private);
        let ks = [k("a", g, &[x.clone(), t.clone()]), k("b", g, &[t, x2]), k("c", g, &[x])];
        let buffers = buffers_in_order(&ks);
        assert_eq!(buffers.as_slice(), [7, 9]);
        let groups = group_slots(&ks, &buffers, |_| false);
        assert_eq!(groups.args.len(), 1);
        assert_eq!((groups.args[0].start, groups.args[0].end), (0, 128));
        assert_eq!(groups.args[0].uses.as_slice(), [(0, 0), (1, 1), (2, 0)]);
        assert_eq!(groups.internal.len(), 1);
        assert_eq!((groups.internal[0].bytes, groups.internal[0].len), (4, 64));
        assert_eq!(
            groups.slots[0],
            [SlotPlace::Arg { index: 0, offset: 64, len: 64 }, SlotPlace::Internal { index: 0 }]
        );
        assert_eq!(groups.slots[1][1], SlotPlace::Arg { index: 0, offset: 0, len: 64 });
        let forced = group_slots(&ks, &buffers, |b| b == 1);
        assert!(forced.internal.is_empty() && forced.warnings.is_empty());
        assert_eq!(forced.args.len(), 2);
        assert_eq!(forced.slots[1][0], SlotPlace::Arg { index: 1, offset: 0, len: 64 });
    }
}
