//! Whole-graph updates that keep a plan: the topology check ([`check_topology`]) and
//! patching the plan's command buffers with the new nodes ([`patch_plan`]).

use std::sync::Arc;

use gantry_components::{
    BufferCore, ExecPlan, GraphNode, GraphNodes, NodeWork, PartitionBody, PartitionPlan,
};
use gantry_driver::{Driver, OpPatch};

/// The SYCL graph extension's implementation design's whole-graph update check, plus
/// node kinds and the exact edges: the reason when `b` does not have `a`'s topology;
/// else whether each node also runs on the device of its counterpart (what, with the
/// same topology, decides the partitions).
pub fn check_topology(a: &[GraphNode], b: &[GraphNode]) -> Result<bool, String> {
    if a.len() != b.len() {
        return Err(format!("{} nodes, the update has {}", a.len(), b.len()));
    }
    let mut same_devices = true;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        same_devices &= same_node_topology(i, x, y)?;
    }
    Ok(same_devices)
}

/// [`check_topology`] for node `i`.
fn same_node_topology(i: usize, x: &GraphNode, y: &GraphNode) -> Result<bool, String> {
    if x.kind != y.kind {
        return Err(format!(
            "node {i} is of kind {}, in the update of kind {}",
            x.kind.name(),
            y.kind.name()
        ));
    }
    if x.preds != y.preds {
        return Err(format!("node {i} depends on {:?}, in the update on {:?}", x.preds, y.preds));
    }
    Ok(x.device == y.device)
}

/// What [`patch_plan`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum PatchOutcome {
    /// The plan runs the new nodes.
    Patched,
    /// The new nodes do not have the plan's topology ([`check_topology`]'s reason).
    Mismatch(String),
    /// The plan is as it was: the update must record (its topology is not checked
    /// to the end).
    Record,
}

/// The fastest whole-graph update: when the new nodes have the plan's topology and
/// devices and replace each of the plan's buffers by one buffer everywhere, with the
/// same ranges, modes and parameter slots, every argument table and recorded
/// argument stays as it is. (Two old buffers may become one: their entries then
/// bind the same memory, and submission merges their requirements, as it does for a
/// dynamic parameter bound to a buffer the partition also uses.) Then only the
/// plan's buffer list changes, and each command buffer is patched with the new
/// kernels, host data and fill patterns instead of recorded anew: in place where no
/// submission holds it. One comparison of the two node lists' shapes
/// ([`GraphShape`](gantry_components::GraphShape)) checks all that but buffers, and
/// one walk over the new nodes maps the buffers.
/// Otherwise, or when a driver cannot patch, `plan` stays as it was and the caller
/// records (a finalize with [`FinalizeJob::reuse`](gantry_components::FinalizeJob::reuse) when the layout holds).
///
/// It needs nothing of the scheduler's world but the drivers (by device id), so a
/// whole-graph update calls it on its own thread, without a round trip to the
/// scheduler.
pub fn patch_plan(
    drivers: &[Arc<dyn Driver>],
    nodes: &Arc<GraphNodes>,
    plan: &mut Arc<ExecPlan>,
) -> PatchOutcome {
    let PlanPatch { buffers, patches } = match plan_patches(nodes, plan) {
        Ok(Some(patch)) => patch,
        Ok(None) => return PatchOutcome::Record,
        Err(why) => return PatchOutcome::Mismatch(why),
    };
    // The nodes the command buffers run now: they hold the payloads that undo a
    // patch (kept alive by this clone while `plan` changes).
    let old_nodes = plan.nodes.clone();
    let plan = Arc::make_mut(plan);
    let mut part_patch: Vec<OpPatch<'_>> = Vec::new();
    for (p, part) in plan.partitions.iter_mut().enumerate() {
        let PartitionBody::Commands { buffer, .. } = &mut part.body else { continue };
        part_patch.clear();
        part_patch.extend(part.nodes.iter().map(|&n| patches[n as usize]));
        let patched = drivers
            .get(part.device as usize)
            .is_some_and(|d| d.patch_command_buffer(buffer, &part_patch).is_ok());
        if !patched {
            undo_patches(drivers, &old_nodes, &mut plan.partitions[..p]);
            return PatchOutcome::Record;
        }
    }
    plan.nodes = nodes.clone();
    let mut distinct: rustc_hash::FxHashSet<*const BufferCore> = Default::default();
    plan.aliased = !buffers.iter().all(|b| distinct.insert(Arc::as_ptr(b)));
    plan.buffers = buffers;
    PatchOutcome::Patched
}

/// Patches `partitions` back to the payloads of `nodes`, which they were recorded
/// or last patched with (so each patch fits).
fn undo_patches(drivers: &[Arc<dyn Driver>], nodes: &[GraphNode], partitions: &mut [PartitionPlan]) {
    for part in partitions {
        let PartitionBody::Commands { buffer, .. } = &mut part.body else { continue };
        let patch: Vec<_> = part.nodes.iter().map(|&n| op_patch(&nodes[n as usize].work)).collect();
        if let Some(driver) = drivers.get(part.device as usize) {
            let _ = driver.patch_command_buffer(buffer, &patch);
        }
    }
}

/// The patch that gives an operation recorded for a node the payload of `work`.
fn op_patch(work: &NodeWork) -> OpPatch<'_> {
    match work {
        NodeWork::Kernel { kernel, geometry, scalars } => OpPatch::Kernel { kernel, geometry, scalars },
        NodeWork::CopyFromHost(data) => OpPatch::Write(data),
        NodeWork::CopyToHost(out) => OpPatch::Read(out),
        NodeWork::Fill(pattern) => OpPatch::Fill(pattern),
        // (A host task runs from its own partition, the node the plan holds.)
        NodeWork::Copy | NodeWork::Empty | NodeWork::HostTask { .. } => OpPatch::Keep,
    }
}

/// What [`patch_plan`] changes.
struct PlanPatch<'a> {
    /// The plan's new buffer list.
    buffers: Vec<Arc<BufferCore>>,
    /// Each node's patch, by node index.
    patches: Vec<OpPatch<'a>>,
}

/// The [`PlanPatch`] that makes `old` run `nodes`; `None` when the nodes do not fit
/// the plan that way, the reason when their topology differs. Every node is
/// checked before any driver is asked to patch: at once, by comparing the two lists'
/// [`GraphShape`](gantry_components::GraphShape)s; node by node only when they
/// differ, for the reason.
fn plan_patches<'a>(nodes: &'a GraphNodes, old: &ExecPlan) -> Result<Option<PlanPatch<'a>>, String> {
    if old.nodes.shape() != nodes.shape() {
        // Other edges or kinds are an error; other devices, ranges, modes or
        // parameter slots keep no argument table: the caller records.
        check_topology(&old.nodes, nodes)?;
        return Ok(None);
    }
    if !old.fused.is_empty() {
        return Ok(None);
    }
    let mut buffers: Vec<Option<&Arc<BufferCore>>> = vec![None; old.buffers.len()];
    // Node by node in index order (memory order: partitions list them in execution
    // order); gathered into each partition's operation order by the caller.
    let mut patches: Vec<OpPatch<'a>> = Vec::with_capacity(nodes.len());
    let mut slot_buffers = old.slot_buffers.as_slice();
    for b in nodes.iter() {
        // (The same shape: the plan numbered as many slots for the node it holds.)
        let Some((slots, rest)) = slot_buffers.split_at_checked(b.uses.len()) else {
            return Ok(None); // (the plan lists every node's slots)
        };
        slot_buffers = rest;
        for (rb, &k) in b.uses.iter().zip(slots) {
            // None for `u32::MAX`: a dynamic parameter's slot or a host task's (its
            // partition runs the node the plan holds), bound at submission.
            if let Some(slot) = buffers.get_mut(k as usize) {
                match slot {
                    None => *slot = Some(&rb.buffer),
                    Some(mapped) if Arc::ptr_eq(mapped, &rb.buffer) => {}
                    Some(_) => return Ok(None),
                }
            }
        }
        patches.push(op_patch(&b.work));
    }
    let Some(buffers) = buffers.into_iter().map(|b| b.cloned()).collect() else {
        return Ok(None); // (each of the plan's buffers is some checked slot's)
    };
    Ok(Some(PlanPatch { buffers, patches }))
}

/// `patch_plan` on a hand-built plan of two single-kernel partitions, recorded by a
/// driver that can be told to refuse patches.
#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use gantry_components::{CommandKind, Entry, EntrySource, NodeUse, Requirement};
    use gantry_driver::{
        patch_buffer, Accepted, AccessMode, AllocId, Capabilities, CommandBufferBuilder, CommandBufferDesc,
        DeviceInfo, DeviceKind, ExecError, Geometry, ItemCost, Plan, PlanBuilder, Range, RecordedArg,
        RecordedOp, Submission,
    };
    use gantry_host::{phase, ClosureKernel};
    use smallvec::SmallVec;

    use super::*;
    use crate::testing::Harness;

    /// Records plans; refuses the patch call numbered `refuse` (counting from 1).
    struct Patchy {
        info: DeviceInfo,
        calls: AtomicUsize,
        refuse: usize,
    }

    impl Driver for Patchy {
        fn info(&self) -> &DeviceInfo {
            &self.info
        }
        fn alloc(&self, _bytes: usize) -> Result<AllocId, ExecError> {
            Ok(AllocId(1))
        }
        fn free(&self, _id: AllocId) {}
        fn submit(&self, _sub: Submission<'_>) -> Result<Accepted, ExecError> {
            Err(ExecError::Unsupported { device: self.info.name.clone(), what: "submissions" })
        }
        fn patch_command_buffer(
            &self,
            buffer: &mut gantry_driver::CommandBuffer,
            patch: &[OpPatch<'_>],
        ) -> Result<(), ExecError> {
            if self.calls.fetch_add(1, Ordering::Relaxed) + 1 == self.refuse {
                return Err(ExecError::Unsupported { device: self.info.name.clone(), what: "this patch" });
            }
            let swap = |plan: &mut Plan| plan.apply_patches(patch);
            let invalid = |message| ExecError::Driver { device: self.info.name.clone(), message };
            patch_buffer(buffer, Plan::clone, swap).expect("a plan").map_err(invalid)
        }
    }

    fn patchy(refuse: usize) -> Arc<dyn Driver> {
        let caps = Capabilities {
            shares_host_memory: true,
            in_driver_waits: false,
            image_kinds: &[gantry_driver::ImageKind::Closure],
            host_tasks: true,
            records_host_tasks: false,
            max_local_memory: 0,
            max_private_memory: 0,
            virtual_time: false,
            peer_group: 0,
            fusion_window: gantry_driver::fusion::WindowThresholds::ALWAYS,
        };
        let info = DeviceInfo { name: "patchy".into(), kind: DeviceKind::Sim, caps };
        Arc::new(Patchy { info, calls: AtomicUsize::new(0), refuse })
    }

    fn kernel(name: &str) -> gantry_driver::KernelRef {
        ClosureKernel {
            tag: 0,
            phases: smallvec::smallvec![phase(|_| {})],
            global_slots: 1,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel(name, vec![AccessMode::ReadWrite; 1], ItemCost::default())
    }

    /// Node `i` runs kernel `names[i]` over all of `buffers[i]`; node 1 follows node 0.
    fn nodes(names: [&str; 2], buffers: [&Arc<BufferCore>; 2]) -> Arc<GraphNodes> {
        let node = |i: usize| GraphNode {
            kind: CommandKind::Kernel,
            name: names[i].into(),
            device: 0,
            uses: smallvec::smallvec![NodeUse::from(Requirement::new(
                buffers[i].clone(),
                AccessMode::ReadWrite,
                gantry_components::ByteRange { start: 0, end: buffers[i].bytes },
            ))],
            params: SmallVec::new(),
            work: NodeWork::Kernel {
                kernel: kernel(names[i]),
                geometry: Geometry::for_range(Range::d1(4)).unwrap(),
                scalars: Default::default(),
            },
            preds: if i == 0 { SmallVec::new() } else { smallvec::smallvec![0] },
        };
        Arc::new(vec![node(0), node(1)].into())
    }

    /// The plan: one partition per node, each a recorded kernel over entry 0.
    fn plan(nodes: &Arc<GraphNodes>) -> Arc<ExecPlan> {
        let partition = |i: u32| {
            let desc = CommandBufferDesc { entries: 1, in_order: true, ops: 1 };
            let mut b = PlanBuilder::new(desc, "patchy".into(), |_| true, |plan| Arc::new(plan));
            let NodeWork::Kernel { kernel, geometry, .. } = &nodes[i as usize].work else { unreachable!() };
            let bytes = nodes[i as usize].uses[0].buffer.bytes;
            let args = smallvec::smallvec![RecordedArg {
                entry: 0,
                offset: 0,
                len: bytes,
                mode: AccessMode::ReadWrite
            }];
            b.append(
                RecordedOp::Kernel {
                    kernel: kernel.clone(),
                    geometry: *geometry,
                    args,
                    scalars: Default::default(),
                },
                &[],
            )
            .unwrap();
            let range = gantry_components::ByteRange { start: 0, end: bytes };
            let entries = vec![Entry { source: EntrySource::Buffer(i), mode: AccessMode::ReadWrite, range }];
            PartitionPlan {
                name: format!("partition {i}").into(),
                device: 0,
                nodes: vec![i],
                preds: if i == 0 { SmallVec::new() } else { smallvec::smallvec![0] },
                in_order: true,
                body: PartitionBody::Commands {
                    buffer: Box::new(b).finalize().unwrap(),
                    entries,
                    internal: vec![],
                },
            }
        };
        Arc::new(ExecPlan {
            nodes: nodes.clone(),
            buffers: nodes.iter().map(|n| n.uses[0].buffer.clone()).collect(),
            slot_buffers: vec![0, 1],
            aliased: false,
            order: vec![0, 1],
            partition_of: vec![0, 1],
            partitions: vec![partition(0), partition(1)],
            fused: vec![],
            not_fused: vec![],
            tails: vec![1],
        })
    }

    /// Each partition's kernel name.
    fn kernels(plan: &ExecPlan) -> Vec<String> {
        let name = |p: &PartitionPlan| match &p.body {
            PartitionBody::Commands { buffer, .. } => match &buffer.downcast_ref::<Plan>().unwrap().ops[0].op
            {
                RecordedOp::Kernel { kernel, .. } => kernel.name.to_string(),
                op => panic!("{op:?}"),
            },
            PartitionBody::HostTask { .. } => panic!("no host tasks here"),
        };
        plan.partitions.iter().map(name).collect()
    }

    /// Shapes are equal across other buffers and kernels, and differ with any
    /// change of kind, device, edges, a use's range, mode, ordering flag or element
    /// size, or a parameter binding; an edit forgets the shape computed before it.
    #[test]
    fn shapes_hold_everything_an_update_keeps_but_buffers_and_kernels() {
        let h = Harness::new(false);
        let (a, b) = (h.buffer(16), h.buffer(16));
        let base = nodes(["a", "b"], [&a, &b]);
        assert_eq!(base.shape(), nodes(["c", "d"], [&b, &a]).shape());
        type Change = fn(&mut GraphNode);
        let changes: [(&str, Change); 9] = [
            ("kind", |n| n.kind = CommandKind::Fill),
            ("device", |n| n.device = 1),
            ("edges", |n| n.preds.push(0)),
            ("range", |n| n.uses[0].range.start = 4),
            ("mode", |n| n.uses[0].mode = AccessMode::Read),
            ("ordering flag", |n| n.uses[0].internal = true),
            ("element size", |n| n.uses[0].elem_size = 8),
            ("uses", |n| n.uses.push(n.uses[0].clone())),
            ("parameters", |n| n.params.push((0, 0))),
        ];
        for (what, change) in changes {
            let mut changed = (*base).clone();
            assert_eq!(changed.shape(), base.shape());
            change(&mut changed.edit()[1]);
            assert_ne!(changed.shape(), base.shape(), "another {what}");
        }
    }

    /// A patch lands in place (nothing else holds the plan); a refusal by the driver
    /// on the second partition patches the first one back and leaves the plan as it
    /// was; a topology change is reported, not patched.
    #[test]
    fn patches_land_in_place_or_not_at_all() {
        let h = Harness::new(false);
        // 16 bytes each (equal ranges), ids 1 to 4.
        let buffer = |id| Arc::new(BufferCore { id, ..Arc::into_inner(h.buffer(16)).unwrap() });
        let (a0, a1, b0, b1) = (buffer(1), buffer(2), buffer(3), buffer(4));
        let old = nodes(["a", "b"], [&a0, &a1]);
        let new = nodes(["c", "d"], [&b0, &b1]);
        let ids = |plan: &ExecPlan| plan.buffers.iter().map(|b| b.id).collect::<Vec<_>>();

        let mut current = plan(&old);
        assert_eq!(patch_plan(&[patchy(2)], &new, &mut current), PatchOutcome::Record);
        assert_eq!(kernels(&current), ["a", "b"], "the first partition's patch is undone");
        assert_eq!((ids(&current), Arc::ptr_eq(&current.nodes, &old)), (vec![1, 2], true));

        let buffer_at = |plan: &ExecPlan| match &plan.partitions[0].body {
            PartitionBody::Commands { buffer, .. } => Arc::as_ptr(buffer) as *const u8,
            PartitionBody::HostTask { .. } => unreachable!(),
        };
        let (plan_at, first_at) = (Arc::as_ptr(&current), buffer_at(&current));
        assert_eq!(patch_plan(&[patchy(0)], &new, &mut current), PatchOutcome::Patched);
        assert_eq!(kernels(&current), ["c", "d"]);
        assert_eq!((ids(&current), Arc::ptr_eq(&current.nodes, &new)), (vec![3, 4], true));
        assert_eq!((Arc::as_ptr(&current), buffer_at(&current)), (plan_at, first_at), "in place");

        let held = current.clone(); // a submission holding the plan
        assert_eq!(patch_plan(&[patchy(0)], &old, &mut current), PatchOutcome::Patched);
        assert_eq!(
            (kernels(&current), kernels(&held)),
            (vec!["a".to_string(), "b".into()], vec!["c".into(), "d".into()])
        );

        let mut unordered = (*nodes(["e", "f"], [&b0, &b1])).clone();
        unordered.edit()[1].preds.clear();
        let why = patch_plan(&[patchy(0)], &Arc::new(unordered), &mut current);
        assert_eq!(why, PatchOutcome::Mismatch("node 1 depends on [0], in the update on []".into()));
        assert_eq!(kernels(&current), ["a", "b"]);
    }
}
