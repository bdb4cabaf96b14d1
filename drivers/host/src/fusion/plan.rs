//! Planning a fusion: the fused grid (the ND-range rules and which kernels' ids are
//! remapped), internalization, where each kernel's slots point in the fused kernel,
//! and which kernels stream span by span. A plan depends only on the kernels' code,
//! geometries and argument layout, so it is cached.

use gantry_driver::fusion::rules::{self, FusedGrid, SlotPlace};
use gantry_driver::fusion::{FusionError, FusionKernel, FusionRequest, Promotion, PromotionMismatch};
use gantry_driver::{Binding, Geometry, Internal, ItemCost, Scratch, ScratchKind};

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
pub(super) use gantry_driver::fusion::rules::Uses;

impl From<SlotPlace> for SlotSource {
    fn from(p: SlotPlace) -> Self {
        match p {
            SlotPlace::Arg { index, offset, len } => SlotSource::Arg { index, offset, len },
            SlotPlace::Internal { index } => SlotSource::Internal { index },
        }
    }
}

pub(super) fn plan(request: &FusionRequest, buffers: &[u64]) -> Result<FusionPlan, FusionError> {
    let kernels = &request.kernels;
    // The shared rules (`gantry_driver::fusion::rules`): the grid, the remapped
    // kernels, and the identical-argument groups with their promotions.
    let FusedGrid { geometry, remap } = rules::fused_geometry(kernels)?;
    let groups = rules::group_slots(kernels, buffers, |_| false);
    let slots: Vec<Vec<SlotSource>> =
        groups.slots.iter().map(|k| k.iter().map(|&p| SlotSource::from(p)).collect()).collect();
    let args: Vec<_> = groups.args.into_iter().map(|a| (a.buffer, a.start, a.end, a.uses)).collect();
    let mut scratch = Vec::with_capacity(groups.internal.len());
    let mut internal_len = Vec::with_capacity(groups.internal.len());
    let mut internal = Vec::with_capacity(groups.internal.len());
    for g in groups.internal {
        let scratch_kind = if g.kind == Promotion::Local { ScratchKind::Local } else { ScratchKind::Private };
        scratch.push(Scratch::new(scratch_kind, g.bytes));
        internal_len.push(g.len);
        internal.push((g.buffer, g.kind, g.bytes, g.uses));
    }
    let warnings = groups.warnings;
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
