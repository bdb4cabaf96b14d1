//! The descriptor sets of a recorded command buffer: which set each dispatch binds
//! (planned once at finalize, as data) and, per recording, the sets themselves,
//! allocated in bulk from one pool and written with one `vkUpdateDescriptorSets`.
//!
//! Dispatches whose pipeline layouts share a set layout and whose buffer slots name
//! the same (argument-table entry, offset, length) tuples in the same order share
//! one set: whatever binding the table gets, they bind the same buffers. The plan
//! depends only on the command buffer's plan, never on a binding, so a recording
//! can be pointed at another binding by rewriting its sets' buffers
//! ([`Sets::write`]) without recording its commands again.

use std::collections::hash_map::Entry;
use std::hash::Hasher;
use std::sync::Arc;

use ash::vk::{self, Handle};
use gantry_driver::{Plan, RecordedArg, RecordedOp};
use rustc_hash::{FxHashMap, FxHasher};

use crate::command_buffer::Bound;
use crate::device::Device;
use crate::error::{CallError, Check};
use crate::pipeline::{Bind, Ready};

/// An operation that binds no descriptor set (not a kernel, or a kernel without
/// buffers).
pub(crate) const NO_SET: u32 = u32::MAX;

/// A buffer slot as the plan names it: (argument-table entry, offset in the entry,
/// length).
type Slot = (u32, usize, usize);

/// `arg`'s slot.
fn slot(arg: &RecordedArg) -> Slot {
    (arg.entry, arg.offset, arg.len)
}

/// The key under which [`SetIndex`] files the set of `layout` over `args`' slots:
/// a hash of both, so equal keys are compared slot by slot.
fn set_key(layout: vk::DescriptorSetLayout, args: &[RecordedArg]) -> u64 {
    let mut h = FxHasher::default();
    h.write_u64(layout.as_raw());
    for a in args {
        h.write_u32(a.entry);
        h.write_usize(a.offset);
        h.write_usize(a.len);
    }
    h.finish()
}

/// The sets found so far while planning, for [`SetPlan::intern`].
struct SetIndex {
    /// Per key: the last set made with it.
    head: FxHashMap<u64, u32>,
    /// Per set: the set made before it with the same key, or [`NO_SET`].
    next: Vec<u32>,
    /// The previous dispatch's set, or [`NO_SET`].
    last: u32,
}

impl Default for SetIndex {
    fn default() -> Self {
        Self { head: FxHashMap::default(), next: Vec::new(), last: NO_SET }
    }
}

/// One distinct descriptor set: its layout and its slots (`slots[range]` of the
/// plan), in binding order.
#[derive(Clone, Debug)]
struct SetSpec {
    layout: vk::DescriptorSetLayout,
    slots: std::ops::Range<usize>,
}

/// Which descriptor set each dispatch of a plan binds (see the module docs).
#[derive(Clone, Debug, Default)]
pub(crate) struct SetPlan {
    /// Per plan operation: the index of its set, or [`NO_SET`].
    pub op_set: Vec<u32>,
    sets: Vec<SetSpec>,
    slots: Vec<Slot>,
}

impl SetPlan {
    /// The sets of `plan`, whose kernels are made ready (`kernels[i]` for
    /// operation `i`) with [`Bind::Sets`].
    pub(crate) fn new(plan: &Plan, kernels: &[Option<Ready>]) -> Self {
        let mut out =
            SetPlan { op_set: Vec::with_capacity(plan.ops.len()), sets: Vec::new(), slots: Vec::new() };
        let mut index = SetIndex::default();
        for (planned, ready) in plan.ops.iter().zip(kernels) {
            let (RecordedOp::Kernel { args, .. }, Some(ready)) = (&planned.op, ready) else {
                out.op_set.push(NO_SET);
                continue;
            };
            if args.is_empty() {
                out.op_set.push(NO_SET);
                continue;
            }
            let set = out.intern(&mut index, ready.pipelines.set_layout(Bind::Sets), args);
            out.op_set.push(set);
        }
        out
    }

    /// The set of `layout` over `args`' slots: an existing one where there is one,
    /// else a new one. Sets are numbered in order of first use.
    ///
    /// The previous dispatch's set is tried first, since consecutive dispatches
    /// commonly share one; then the sets whose key ([`set_key`]) is the same,
    /// compared slot by slot, so no slot list is copied or hashed as a whole key.
    fn intern(&mut self, index: &mut SetIndex, layout: vk::DescriptorSetLayout, args: &[RecordedArg]) -> u32 {
        if index.last != NO_SET && self.is(index.last, layout, args) {
            return index.last;
        }
        let set = self.sets.len() as u32;
        let same_key = match index.head.entry(set_key(layout, args)) {
            Entry::Occupied(mut e) => {
                let mut at = *e.get();
                while at != NO_SET {
                    if self.is(at, layout, args) {
                        index.last = at;
                        return at;
                    }
                    at = index.next[at as usize];
                }
                e.insert(set)
            }
            Entry::Vacant(e) => {
                e.insert(set);
                NO_SET
            }
        };
        index.next.push(same_key);
        index.last = set;
        let start = self.slots.len();
        self.slots.extend(args.iter().map(slot));
        self.sets.push(SetSpec { layout, slots: start..self.slots.len() });
        set
    }

    /// Whether set `set` is `layout` over `args`' slots.
    fn is(&self, set: u32, layout: vk::DescriptorSetLayout, args: &[RecordedArg]) -> bool {
        let spec = &self.sets[set as usize];
        spec.layout == layout && self.slots[spec.slots.clone()].iter().copied().eq(args.iter().map(slot))
    }

    /// How many distinct sets the plan binds.
    pub(crate) fn len(&self) -> usize {
        self.sets.len()
    }
}

/// A recording's descriptor sets: one pool holding every set of its [`SetPlan`].
pub(crate) struct Sets {
    pool: vk::DescriptorPool,
    pub sets: Vec<vk::DescriptorSet>,
    dev: Arc<Device>,
}

impl Sets {
    /// Allocates the sets of `plan` (written by [`Sets::write`]).
    pub(crate) fn new(dev: &Arc<Device>, plan: &SetPlan) -> Result<Self, CallError> {
        let mut this = Self { pool: vk::DescriptorPool::null(), sets: Vec::new(), dev: dev.clone() };
        if plan.sets.is_empty() {
            return Ok(this);
        }
        let sizes = [vk::DescriptorPoolSize {
            ty: vk::DescriptorType::STORAGE_BUFFER,
            descriptor_count: plan.slots.len() as u32,
        }];
        let flags = if dev.update_after_bind {
            vk::DescriptorPoolCreateFlags::UPDATE_AFTER_BIND
        } else {
            vk::DescriptorPoolCreateFlags::empty()
        };
        let info = vk::DescriptorPoolCreateInfo::default()
            .flags(flags)
            .max_sets(plan.sets.len() as u32)
            .pool_sizes(&sizes);
        // SAFETY: a live device and a valid create info.
        this.pool = unsafe { dev.raw.create_descriptor_pool(&info, None) }.call("vkCreateDescriptorPool")?;
        let layouts: Vec<vk::DescriptorSetLayout> = plan.sets.iter().map(|s| s.layout).collect();
        let alloc = vk::DescriptorSetAllocateInfo::default().descriptor_pool(this.pool).set_layouts(&layouts);
        // SAFETY: the pool was sized for exactly these sets and descriptors; the
        // layouts are live (the plan's kernels hold their images).
        this.sets = unsafe { dev.raw.allocate_descriptor_sets(&alloc) }.call("vkAllocateDescriptorSets")?;
        Ok(this)
    }

    /// Points every set at the buffers of `bound` (the argument table's binding,
    /// checked against the plan's ranges). The sets must not be in use by a
    /// command buffer that is pending: the caller's contract.
    pub(crate) fn write(&self, plan: &SetPlan, bound: &[Bound]) {
        if self.sets.is_empty() {
            return;
        }
        let infos: Vec<vk::DescriptorBufferInfo> = plan
            .slots
            .iter()
            .map(|&(entry, offset, len)| {
                let (buffer, base, _) = &bound[entry as usize];
                let range = if len == 0 { vk::WHOLE_SIZE } else { len as u64 };
                vk::DescriptorBufferInfo { buffer: buffer.raw, offset: (base + offset) as u64, range }
            })
            .collect();
        // One write per set: its bindings are consecutive, of one type and stage,
        // so one write covers them all.
        let writes: Vec<vk::WriteDescriptorSet> = plan
            .sets
            .iter()
            .zip(&self.sets)
            .map(|(spec, &set)| {
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(0)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(&infos[spec.slots.clone()])
            })
            .collect();
        // SAFETY: live sets of this device, none in use by a pending command buffer
        // (the caller's contract); the buffers are live and the ranges checked.
        unsafe { self.dev.raw.update_descriptor_sets(&writes, &[]) };
    }
}

impl Drop for Sets {
    fn drop(&mut self) {
        if self.pool != vk::DescriptorPool::null() {
            // SAFETY: no command buffer using the sets is pending (the recording that
            // owns them is dropped only when idle); destroying the pool frees them.
            unsafe { self.dev.raw.destroy_descriptor_pool(self.pool, None) };
        }
    }
}

#[cfg(test)]
mod tests {
    use gantry_driver::AccessMode;

    use super::*;

    fn args(entries: &[u32]) -> Vec<RecordedArg> {
        entries
            .iter()
            .map(|&entry| RecordedArg { entry, offset: 0, len: 256, mode: AccessMode::Read })
            .collect()
    }

    #[test]
    fn sets_are_shared_by_layout_and_slots_and_numbered_in_order_of_first_use() {
        let (a, b) = (vk::DescriptorSetLayout::from_raw(1), vk::DescriptorSetLayout::from_raw(2));
        let mut plan = SetPlan::default();
        let mut index = SetIndex::default();
        let ops = [
            (a, args(&[0, 1, 2])),
            (a, args(&[0, 1, 2])), // the previous set
            (a, args(&[0, 1, 3])),
            (b, args(&[0, 1, 2])), // another layout
            (a, args(&[0, 1, 2])), // an earlier set, not the previous
            (a, args(&[0, 1])),    // a prefix
            (a, args(&[0, 1, 3])),
        ];
        let sets: Vec<u32> = ops.iter().map(|(l, s)| plan.intern(&mut index, *l, s)).collect();
        assert_eq!(sets, [0, 0, 1, 2, 0, 3, 1]);
        assert_eq!(plan.len(), 4);
        assert_eq!(plan.slots.len(), 3 + 3 + 3 + 2);
        let mut offset = args(&[0, 1, 2]);
        offset[2].offset = 4;
        assert_eq!(plan.intern(&mut index, a, &offset), 4);
    }

    #[test]
    fn sets_with_the_same_key_are_told_apart_by_their_slots() {
        let layout = vk::DescriptorSetLayout::from_raw(7);
        let mut plan = SetPlan::default();
        let mut index = SetIndex::default();
        // Forge a collision: both sets filed under one key.
        let (x, y) = (args(&[1]), args(&[2]));
        assert_eq!(plan.intern(&mut index, layout, &x), 0);
        index.head.insert(set_key(layout, &y), 0);
        index.last = NO_SET;
        assert_eq!(plan.intern(&mut index, layout, &y), 1);
        assert_eq!(index.next, [NO_SET, 0]);
        index.head.insert(set_key(layout, &x), 1);
        index.last = NO_SET;
        assert_eq!(plan.intern(&mut index, layout, &x), 0, "found behind the other set");
        assert_eq!(plan.len(), 2);
    }
}
