//! Planning a fusion: the fused grid (the ND-range rules and which kernels' ids are
//! remapped), internalization, where each kernel's slots point in the fused kernel,
//! and which kernels stream span by span. A plan depends only on the kernels' code,
//! geometries and argument layout, so it is cached.

use gantry_driver::fusion::{FusionError, FusionKernel, FusionRequest, Promotion, PromotionMismatch};
use gantry_driver::{Binding, Geometry, Internal, ItemCost, NdRange, Range, Scratch, ScratchKind};
use smallvec::SmallVec;

use super::closure_of;
use crate::closure::Elementwise;

/// Where a kernel's accessor slot points inside the fused kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotSource {
    /// Bytes `offset..offset + len` of fused argument `index`.
    Arg { index: u32, offset: usize, len: usize },
    /// Internal (scratch) buffer `index`.
    Internal { index: u32 },
}

/// Everything about a fusion that does not depend on the kernels' captured data or
/// the buffers' identities: computed once per distinct chain and cached.
#[derive(Debug)]
pub(super) struct FusionPlan {
    pub(super) geometry: Geometry,
    /// Per kernel: whether its ids are remapped from the fused grid.
    pub(super) remap: Vec<bool>,
    /// Per kernel: whether it may run span by span with its neighbours (see
    /// [`streams`] and [`FusedBody::stream`]).
    pub(super) streams: Vec<bool>,
    /// Per fused argument: (canonical buffer, start, end, uses).
    pub(super) args: Vec<(usize, usize, usize, Uses)>,
    /// Per internal buffer: (canonical buffer, kind, bytes, uses).
    pub(super) internal: Vec<(usize, Promotion, usize, Uses)>,
    /// Per internal buffer: the bytes of its slots' range (every slot on it has the
    /// same), which [`Unfused::rerun`] gives the kernels as memory of their own.
    pub(super) internal_len: Vec<usize>,
    /// Per kernel, per slot, in one table: kernel `k`'s slots are
    /// `slots[slot_start[k]..slot_start[k + 1]]`.
    pub(super) slots: Vec<SlotSource>,
    pub(super) slot_start: Vec<usize>,
    /// Per kernel: index of its first own scratch slot in the fused kernel's scratch.
    pub(super) scratch_base: Vec<usize>,
    pub(super) scratch: Vec<Scratch>,
    pub(super) cost: ItemCost,
    /// Warnings, with canonical buffer numbers.
    pub(super) warnings: Vec<(usize, PromotionMismatch)>,
}

impl FusionPlan {
    /// Whether a slot of a kernel in the streamed run `parts` is a span-local
    /// intermediate: private memory (one element per work-item) that only kernels of
    /// the run bind and that the first of them writes whole (so it is never cleared
    /// for a group). Streamed, each of its elements is written and read within one
    /// span, so every span can use the same span of the region: the chain's
    /// intermediates stay in the few kilobytes of L1 a span needs, where walking the
    /// group's region (16 KiB per intermediate in a group of 4,096, 256 KiB in one of
    /// 65,536) would send them to L2 and back between spans once a chain has several
    /// (figures: `docs/PERFORMANCE.md`).
    pub(super) fn span_local(&self, source: SlotSource, parts: &std::ops::Range<usize>) -> bool {
        let SlotSource::Internal { index } = source else { return false };
        let (_, kind, _, uses) = &self.internal[index as usize];
        *kind == Promotion::Private
            && !self.scratch[index as usize].zeroed
            && uses.iter().all(|&(k, _)| parts.contains(&(k as usize)))
    }
}

/// Which slots an argument stands for: (kernel index, slot).
pub(super) type Uses = SmallVec<[(u32, u32); 2]>;

fn range_of(dims: usize, e: [usize; 3]) -> Range {
    match dims {
        1 => Range::d1(e[0]),
        2 => Range::d2(e[0], e[1]),
        _ => Range::d3(e[0], e[1], e[2]),
    }
}

/// The fused grid (the DPC++ kernel-fusion design, "Fusing kernels with different
/// nd-ranges"): the largest
/// kernel's global range, with the common work-group size if any kernel has one; and
/// per kernel whether its ids must be mapped from the grid.
fn fused_geometry(kernels: &[FusionKernel]) -> Result<(Geometry, Vec<bool>), FusionError> {
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
        // Ids need real remapping (not just skipping work-items past the kernel's
        // range) when the shape differs beyond the slowest dimension.
        let reshaped = k.geometry.dims() != geometry.dims() || own[1..] != grid[1..];
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
    Ok((geometry, remap))
}

/// Decides whether the slots `uses` on one buffer can be internalized, and how large
/// the scratch is: bytes per work-group (local) or per work-item (private).
fn promotion_of(
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

pub(super) fn plan(request: &FusionRequest, buffers: &[u64]) -> Result<FusionPlan, FusionError> {
    let kernels = &request.kernels;
    let (geometry, remap) = fused_geometry(kernels)?;
    let mut slots: Vec<Vec<SlotSource>> =
        kernels.iter().map(|k| vec![SlotSource::Internal { index: u32::MAX }; k.args.len()]).collect();
    let (mut args, mut internal, mut warnings) = (Vec::new(), Vec::new(), Vec::new());
    let mut internal_len = Vec::new();
    let mut scratch = Vec::new();
    for (canon, &buffer) in buffers.iter().enumerate() {
        let uses: SmallVec<[(u32, u32); 2]> = kernels
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
        match promotion_of(kernels, &uses) {
            Ok(Some((kind, bytes))) => {
                let index = internal.len() as u32;
                for &(k, s) in &uses {
                    slots[k as usize][s as usize] = SlotSource::Internal { index };
                }
                let scratch_kind =
                    if kind == Promotion::Local { ScratchKind::Local } else { ScratchKind::Private };
                scratch.push(Scratch::new(scratch_kind, bytes));
                let (k, s) = uses[0];
                internal_len.push(kernels[k as usize].args[s as usize].bytes());
                internal.push((canon, kind, bytes, uses));
                continue;
            }
            Ok(None) => {}
            Err(reason) => warnings.push((canon, reason)),
        }
        let arg = |&(k, s): &(u32, u32)| &kernels[k as usize].args[s as usize];
        let start = uses.iter().map(|u| arg(u).start).min().expect("a buffer has a use");
        let end = uses.iter().map(|u| arg(u).end).max().expect("a buffer has a use");
        let index = args.len() as u32;
        for u in &uses {
            let a = arg(u);
            slots[u.0 as usize][u.1 as usize] =
                SlotSource::Arg { index, offset: a.start - start, len: a.bytes() };
        }
        args.push((canon, start, end, uses));
    }
    let mut scratch_base = Vec::with_capacity(kernels.len());
    let mut cost = ItemCost { ns: 0.0, default_items: 0.0 };
    let grid_size = geometry.global_size() as f64;
    for k in kernels {
        scratch_base.push(scratch.len());
        scratch.extend(closure_of(&k.kernel).scratch.iter().copied());
        let share = k.geometry.global_size() as f64 / grid_size;
        cost.ns += k.kernel.cost.ns * share;
        cost.default_items += k.kernel.cost.default_items * share;
    }
    for (index, region) in scratch.iter_mut().take(internal.len()).enumerate() {
        region.zeroed = !written_first(kernels, &remap, &slots, index as u32, region);
    }
    let mut slot_start = vec![0];
    slot_start.extend(slots.iter().scan(0, |end, s| {
        *end += s.len();
        Some(*end)
    }));
    let streams = streams(kernels, &geometry, &remap, &slots, &internal, args.len());
    Ok(FusionPlan {
        geometry,
        remap,
        streams,
        args,
        internal,
        internal_len,
        slots: slots.concat(),
        slot_start,
        scratch_base,
        scratch,
        cost,
        warnings,
    })
}

/// Which kernels may run span by span ([`FusedBody::stream`]): elementwise ones on
/// the 1-D fused grid's own ids (a kernel over another range is remapped: it skips
/// work-items, which only its own phase knows). Span order equals kernel order only
/// if element `i` is the same memory for every kernel that touches it, so none
/// streams when two elementwise slots see one fused argument at different offsets
/// or element sizes (a kernel reading `x[i + 100]` after one wrote `x[i]` depends on
/// a work-item a later span runs), or use local memory (shared across the group).
/// Private memory is each work-item's own.
fn streams(
    kernels: &[FusionKernel],
    grid: &Geometry,
    remap: &[bool],
    slots: &[Vec<SlotSource>],
    internal: &[(usize, Promotion, usize, Uses)],
    args: usize,
) -> Vec<bool> {
    let one_d = grid.global_range()[1..] == [1, 1];
    let candidates: Vec<Option<Elementwise>> =
        kernels.iter().zip(remap).map(|(k, &r)| elementwise(k).filter(|_| one_d && !r)).collect();
    let mut seen: Vec<Option<(usize, u16)>> = vec![None; args];
    for (k, e) in candidates.iter().enumerate() {
        let Some(e) = e else { continue };
        for (slot, bytes) in [(e.input, e.input_bytes), (e.output, e.output_bytes)] {
            let consistent = match slots[k][slot as usize] {
                SlotSource::Arg { index, offset, .. } => {
                    *seen[index as usize].get_or_insert((offset, bytes)) == (offset, bytes)
                }
                SlotSource::Internal { index } => internal[index as usize].1 != Promotion::Local,
            };
            if !consistent {
                return vec![false; kernels.len()];
            }
        }
    }
    candidates.iter().map(Option::is_some).collect()
}

/// The single elementwise phase of a kernel that has one.
fn elementwise(kernel: &FusionKernel) -> Option<Elementwise> {
    match closure_of(&kernel.kernel).phases.as_slice() {
        [phase] => phase.elementwise.as_ref().map(|e| e.touches),
        _ => None,
    }
}

/// Whether internal buffer `index` (private, in `region`) is written whole before
/// anything reads it: the first kernel that binds it is an elementwise kernel over
/// the whole grid whose output fills each work-item's region and whose input is
/// another buffer. Then the region need not be cleared for every group.
fn written_first(
    kernels: &[FusionKernel],
    remap: &[bool],
    slots: &[Vec<SlotSource>],
    index: u32,
    region: &Scratch,
) -> bool {
    let internal = SlotSource::Internal { index };
    let Some(k) = slots.iter().position(|s| s.contains(&internal)) else { return false };
    let Some(e) = elementwise(&kernels[k]) else { return false };
    region.kind == ScratchKind::Private
        && !remap[k]
        && usize::from(e.output_bytes) == region.bytes
        && slots[k].get(e.output as usize) == Some(&internal)
        && slots[k].get(e.input as usize) != Some(&internal)
}

impl SlotSource {
    /// The slot's binding for one group, from the fused kernel's arguments and
    /// scratch and the plan's internal buffers.
    #[inline]
    pub(super) fn bind(
        self,
        globals: &[Binding],
        scratch: &[Binding],
        internal: &[(usize, Promotion, usize, Uses)],
    ) -> Binding {
        match self {
            SlotSource::Arg { index, offset, len } => {
                let b = globals[index as usize];
                // SAFETY: the fused argument is the hull of this slot's range.
                Binding::new(unsafe { b.ptr.add(offset) }, len)
            }
            SlotSource::Internal { index } => {
                // `len` 0: every access takes the mapped (`i % n`) path.
                let (_, kind, wrap, _) = internal[index as usize];
                let internal = if kind == Promotion::Local { Internal::Local } else { Internal::Private };
                Binding { ptr: scratch[index as usize].ptr, len: 0, internal, wrap }
            }
        }
    }
}
