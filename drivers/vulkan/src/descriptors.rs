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

use std::sync::Arc;

use ash::vk;
use gantry_driver::{Plan, RecordedOp};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

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
        let mut known: FxHashMap<(vk::DescriptorSetLayout, SmallVec<[Slot; 8]>), u32> = FxHashMap::default();
        for (planned, ready) in plan.ops.iter().zip(kernels) {
            let (RecordedOp::Kernel { args, .. }, Some(ready)) = (&planned.op, ready) else {
                out.op_set.push(NO_SET);
                continue;
            };
            if args.is_empty() {
                out.op_set.push(NO_SET);
                continue;
            }
            let layout = ready.pipelines.set_layout(Bind::Sets);
            let slots: SmallVec<[Slot; 8]> = args.iter().map(|a| (a.entry, a.offset, a.len)).collect();
            let next = out.sets.len() as u32;
            let index = *known.entry((layout, slots)).or_insert_with_key(|(_, slots)| {
                let start = out.slots.len();
                out.slots.extend_from_slice(slots);
                out.sets.push(SetSpec { layout, slots: start..out.slots.len() });
                next
            });
            out.op_set.push(index);
        }
        out
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
