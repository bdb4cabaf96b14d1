//! Recording: a partition's steps (its nodes, or fused chains) recorded into one
//! command buffer of its device, over an argument table of the buffers it uses.

use std::borrow::Cow;

use gantry_components::{
    Entry, EntrySource, ExecPlan, FinalizeError, FinalizeJob, GraphNode, NodeId, NodeUse, NodeWork,
    PartitionBody, PartitionPlan,
};
use gantry_driver::{
    AccessMode, CommandBufferDesc, ExecError, RecordedArg, RecordedHostFn, RecordedOp, SyncPoint,
};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::partition::{Laid, Layout};
use super::Finalize;

/// One operation of a partition's command buffer: a node or a fused chain. A node's
/// step borrows the node.
pub(super) struct Step<'a> {
    /// The nodes it stands for (one, or a fused chain).
    pub(super) nodes: SmallVec<[NodeId; 1]>,
    /// Its buffer uses in argument order (internal ones last, not bound).
    pub(super) uses: Cow<'a, [NodeUse]>,
    /// Slots bound to dynamic parameters.
    pub(super) params: &'a [(u32, u32)],
    /// What it runs.
    pub(super) op: StepOp<'a>,
    /// Earlier steps it depends on.
    pub(super) deps: SmallVec<[SyncPoint; 4]>,
}

pub(super) enum StepOp<'a> {
    Node(&'a NodeWork),
    Fused {
        kernel: gantry_driver::KernelRef,
        geometry: gantry_driver::Geometry,
        scalars: gantry_driver::ScalarBlock,
    },
}

impl Finalize<'_> {
    /// Records the partitions of `layout` (host-task partitions run their node).
    pub(super) fn record_all(&self, job: &FinalizeJob, layout: Layout) -> Result<ExecPlan, FinalizeError> {
        let nodes = &job.nodes;
        let Layout { order, part_of, parts } = layout;
        let mut plan = ExecPlan {
            nodes: nodes.clone(),
            buffers: Vec::new(),
            slot_buffers: Vec::new(),
            aliased: false, // `record` numbers buffers by id
            order,
            partition_of: Vec::new(),
            partitions: Vec::with_capacity(parts.len()),
            fused: Vec::new(),
            not_fused: Vec::new(),
            tails: Vec::new(),
        };
        let mut slot_start = Vec::with_capacity(nodes.len());
        let mut slots = 0;
        for node in nodes.iter() {
            slot_start.push(slots);
            slots += node.uses.len() as u32;
        }
        plan.slot_buffers = vec![u32::MAX; slots as usize];
        let mut scratch = Scratch {
            step_of: vec![0; nodes.len()],
            buffer_index: FxHashMap::default(),
            entry_of: FxHashMap::default(),
            slot_start,
        };
        for (p, Laid { name, nodes: members, preds, in_order }) in parts.into_iter().enumerate() {
            let first = members[0] as usize;
            let device = nodes[first].device;
            // A host task isolated in its partition: one the device does not record.
            let body = if nodes[first].is_isolated(self.devices[device as usize].1.caps.records_host_tasks) {
                PartitionBody::HostTask { node: members[0] }
            } else {
                let steps = self.steps(job, p as u32, &members, &part_of, &mut plan, &mut scratch.step_of);
                self.record(p as u32, device, in_order, &steps, &mut plan, &mut scratch)?
            };
            plan.partitions.push(PartitionPlan { name, device, nodes: members, preds, in_order, body });
        }
        plan.partition_of = part_of;
        plan.find_tails();
        Ok(plan)
    }

    /// The partition's operations: its nodes in order, with kernel chains fused when
    /// the fusion property asks for it. `step_of` is scratch space: an entry per node,
    /// meaningful only for the nodes of this partition.
    fn steps<'a>(
        &self,
        job: &'a FinalizeJob,
        partition: u32,
        members: &[NodeId],
        part_of: &[u32],
        plan: &mut ExecPlan,
        step_of: &mut [u32],
    ) -> Vec<Step<'a>> {
        let nodes: &'a [GraphNode] = &job.nodes;
        let node_step = |n: NodeId| {
            let node = &nodes[n as usize];
            Step {
                nodes: smallvec::smallvec![n],
                uses: Cow::Borrowed(&node.uses[..]),
                params: &node.params,
                op: StepOp::Node(&node.work),
                deps: SmallVec::new(),
            }
        };
        let mut steps: Vec<Step<'a>> = Vec::with_capacity(members.len());
        match job.props.fusion {
            None => steps.extend(members.iter().map(|&n| node_step(n))),
            Some(barriers) => self.fused_steps(members, nodes, barriers, plan, &mut steps, node_step),
        }
        // Dependencies between steps: on the steps of predecessors in this partition.
        for (i, step) in steps.iter().enumerate() {
            for &n in &step.nodes {
                step_of[n as usize] = i as u32;
            }
        }
        for (i, step) in steps.iter_mut().enumerate() {
            let mut deps: SmallVec<[SyncPoint; 4]> = SmallVec::new();
            for &n in &step.nodes {
                for &p in &nodes[n as usize].preds {
                    if part_of[p as usize] == partition {
                        let s = SyncPoint(step_of[p as usize]);
                        if s.0 as usize != i && !deps.contains(&s) {
                            deps.push(s);
                        }
                    }
                }
            }
            deps.sort_unstable();
            step.deps = deps;
        }
        steps
    }

    /// Records a partition's steps into a command buffer of its device.
    fn record(
        &self,
        partition: u32,
        device: u32,
        in_order: bool,
        steps: &[Step],
        plan: &mut ExecPlan,
        scratch: &mut Scratch,
    ) -> Result<PartitionBody, FinalizeError> {
        let ExecPlan { nodes, buffers, slot_buffers, .. } = plan;
        let nodes: &[GraphNode] = nodes;
        let mut entries: Vec<Entry> = Vec::new();
        let mut internal: Vec<Entry> = Vec::new();
        let Scratch { buffer_index, entry_of, slot_start, .. } = scratch;
        entry_of.clear();
        let mut source = |r: &NodeUse, param: Option<u32>| match param {
            Some(p) => EntrySource::Param(p),
            None => {
                let next = buffers.len() as u32;
                let i = *buffer_index.entry(r.buffer.id).or_insert(next);
                if i == next {
                    buffers.push(r.buffer.clone());
                }
                EntrySource::Buffer(i)
            }
        };
        // Argument lists per step, built before the table is final.
        let mut step_args: Vec<SmallVec<[RecordedArg; 4]>> = Vec::with_capacity(steps.len());
        for step in steps {
            let mut args = SmallVec::new();
            // A node's slots (a fused step's requirements are no node's).
            let node_slots = match step.op {
                StepOp::Node(_) => Some(slot_start[step.nodes[0] as usize] as usize),
                StepOp::Fused { .. } => None,
            };
            for (slot, r) in step.uses.iter().enumerate() {
                let param = step.params.iter().find(|(s, _)| *s as usize == slot).map(|&(_, p)| p);
                let src = source(r, param);
                let at = node_slots.and_then(|start| slot_buffers.get_mut(start + slot));
                if let (Some(at), EntrySource::Buffer(i)) = (at, src) {
                    *at = i;
                }
                if r.internal {
                    // One per source, like `entries` (two fused chains may internalize
                    // one buffer): submission relies on distinct sources.
                    match internal.iter_mut().find(|i| i.source == src) {
                        Some(i) => i.range = i.range.hull(&r.range),
                        None => internal.push(Entry { source: src, mode: AccessMode::Read, range: r.range }),
                    }
                    continue;
                }
                let next = entries.len() as u32;
                let e = *entry_of.entry(src).or_insert(next);
                if e == next {
                    entries.push(Entry { source: src, mode: r.mode, range: r.range });
                } else {
                    let entry = &mut entries[e as usize];
                    entry.mode = merge_modes(entry.mode, entry.range, r.mode, r.range);
                    entry.range = entry.range.hull(&r.range);
                }
                args.push(RecordedArg { entry: e, offset: r.range.start, len: r.range.len(), mode: r.mode });
            }
            step_args.push(args);
        }
        internal.retain(|i| !entry_of.contains_key(&i.source));

        let (driver, _) = &self.devices[device as usize];
        let first_node = steps.first().map_or(0, |s| s.nodes[0]);
        let unsupported = |node: NodeId, e: ExecError| match e {
            ExecError::Unsupported { device, what } => FinalizeError::Unsupported {
                node,
                name: nodes[node as usize].name.to_string(),
                device: device.to_string(),
                what: what.to_string(),
            },
            error => FinalizeError::Driver { partition, error },
        };
        let mut builder = driver
            .create_command_buffer(CommandBufferDesc { entries: entries.len(), in_order, ops: steps.len() })
            .map_err(|e| unsupported(first_node, e))?;
        for (step, args) in steps.iter().zip(step_args) {
            let op = match &step.op {
                StepOp::Fused { kernel, geometry, scalars } => RecordedOp::Kernel {
                    kernel: kernel.clone(),
                    geometry: *geometry,
                    args,
                    scalars: scalars.clone(),
                },
                StepOp::Node(work) => match *work {
                    NodeWork::Kernel { kernel, geometry, scalars } => RecordedOp::Kernel {
                        kernel: kernel.clone(),
                        geometry: *geometry,
                        args,
                        scalars: scalars.clone(),
                    },
                    NodeWork::Copy => RecordedOp::Copy { src: args[0], dst: args[1] },
                    NodeWork::CopyFromHost(data) => RecordedOp::Write { src: data.clone(), dst: args[0] },
                    NodeWork::CopyToHost(out) => RecordedOp::Read { src: args[0], dst: out.clone() },
                    NodeWork::Fill(pattern) => RecordedOp::Fill { dst: args[0], pattern: pattern.clone() },
                    NodeWork::Empty => RecordedOp::Marker,
                    NodeWork::HostTask { run, tag, .. } => {
                        let name = nodes[step.nodes[0] as usize].name.clone();
                        RecordedOp::HostTask { name, run: RecordedHostFn(run.clone()), tag: *tag, args }
                    }
                },
            };
            builder.append(op, &step.deps).map_err(|e| unsupported(step.nodes[0], e))?;
        }
        let buffer = builder.finalize().map_err(|e| unsupported(first_node, e))?;
        Ok(PartitionBody::Commands { buffer, entries, internal })
    }
}

/// Maps reused from partition to partition of one finalize.
struct Scratch {
    /// The step of each node of the partition being recorded.
    step_of: Vec<u32>,
    /// The index of each buffer (by id) in [`ExecPlan::buffers`].
    buffer_index: FxHashMap<u64, u32>,
    /// The argument-table entry of each source, in the partition being recorded.
    entry_of: FxHashMap<EntrySource, u32>,
    /// Where each node's slots start in [`ExecPlan::slot_buffers`].
    slot_start: Vec<u32>,
}

/// The mode of an entry used first as `(a, ra)` and then as `(b, rb)`.
fn merge_modes(
    a: AccessMode,
    ra: gantry_components::ByteRange,
    b: AccessMode,
    rb: gantry_components::ByteRange,
) -> AccessMode {
    use AccessMode::*;
    match (a, b) {
        (Read, Read) => Read,
        // A discard-write first that covers every later use keeps discarding.
        (DiscardWrite, _) if ra.covers(&rb) => DiscardWrite,
        _ => ReadWrite,
    }
}
