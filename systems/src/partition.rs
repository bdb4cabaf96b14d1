//! The **partition** stage: finalizes command graphs (the SYCL graph extension's implementation design, "Graph
//! Partitioning"). For each finalize request it
//!
//! 1. checks the edges for cycles and linearizes the nodes with the
//!    [`GraphPolicy`]'s [`Linearizer`] ([`ReverseDfs`] by default, [`BreadthFirst`]
//!    to compare);
//! 2. assigns partitions with the seed's two-step algorithm ([`assign_groups`]): host
//!    tasks (and nodes of another device) are isolated, their predecessors and
//!    successors grouped around them, and groups merged when a `make_edge` back edge
//!    reaches a host task that was already processed;
//! 3. tracks each partition's real predecessors, so independent roots run
//!    concurrently, and marks single-path partitions in-order;
//! 4. with the fusion property, fuses kernel chains inside each partition through the
//!    fusion compiler ([`fusion_chains`]);
//! 5. records one driver command buffer per partition over an argument table of the
//!    buffers it uses.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Arc;

use bevy_ecs::world::World;
use gantry_components::{
    fuse_with, warn_fusion, BufferCore, CommandKind, Compilers, Devices, Entry, EntrySource, ExecPlan,
    FinalizeError, FinalizeJob, Finalizing, FusedChain, Fusions, GraphNode, GraphNodes, GraphPolicy,
    Linearizer, NodeId, NodeList, NodeUse, NodeWork, PartitionBody, PartitionPlan, Requirement,
    SchedulerConfig, WorkLists,
};
use gantry_driver::fusion::{FusionKernel, FusionRequest};
use gantry_driver::{
    AccessMode, CommandBufferDesc, DeviceInfo, Driver, ExecError, OpPatch, RecordedArg, RecordedOp, SyncPoint,
};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::fusion::{fused_requirements, fusion_arg};

type Adjacency = Vec<NodeList>;

/// The SYCL graph extension's implementation design's default: reverse post-order of a depth-first walk from the roots (in
/// insertion order).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReverseDfs;

impl Linearizer for ReverseDfs {
    fn name(&self) -> &str {
        "reverse-dfs"
    }

    fn order(&self, preds: &[NodeList], succs: &[NodeList]) -> Vec<NodeId> {
        let n = preds.len();
        let mut visited = vec![false; n];
        let mut post = Vec::with_capacity(n);
        let mut stack: Vec<(NodeId, usize)> = Vec::new();
        for root in (0..n as NodeId).filter(|&i| preds[i as usize].is_empty()) {
            if visited[root as usize] {
                continue;
            }
            visited[root as usize] = true;
            stack.push((root, 0));
            while let Some((node, next)) = stack.last_mut() {
                let node = *node;
                match succs[node as usize].get(*next) {
                    Some(&s) => {
                        *next += 1;
                        if !visited[s as usize] {
                            visited[s as usize] = true;
                            stack.push((s, 0));
                        }
                    }
                    None => {
                        post.push(node);
                        stack.pop();
                    }
                }
            }
        }
        post.reverse();
        post
    }
}

/// Breadth-first (Kahn) order: a node as soon as all its predecessors are placed,
/// roots in insertion order. The alternative the seed names.
#[derive(Clone, Copy, Debug, Default)]
pub struct BreadthFirst;

impl Linearizer for BreadthFirst {
    fn name(&self) -> &str {
        "breadth-first"
    }

    fn order(&self, preds: &[NodeList], succs: &[NodeList]) -> Vec<NodeId> {
        let mut pending: Vec<usize> = preds.iter().map(|p| p.len()).collect();
        let mut queue: VecDeque<NodeId> =
            (0..preds.len() as NodeId).filter(|&i| pending[i as usize] == 0).collect();
        let mut order = Vec::with_capacity(preds.len());
        while let Some(n) = queue.pop_front() {
            order.push(n);
            for &s in &succs[n as usize] {
                pending[s as usize] -= 1;
                if pending[s as usize] == 0 {
                    queue.push_back(s);
                }
            }
        }
        order
    }
}

/// The partition stage system: serves every finalize request of this flush.
pub fn partition(world: &mut World) {
    let jobs = std::mem::take(&mut world.resource_mut::<WorkLists>().finalize);
    for e in jobs {
        let Some(job) = world.get::<Finalizing>(e).map(|f| f.0.clone()) else { continue };
        world.despawn(e);
        let result = {
            let devices: Vec<(Arc<dyn Driver>, DeviceInfo)> =
                world.resource::<Devices>().0.iter().map(|d| (d.driver.clone(), d.info.clone())).collect();
            let linearizer = world.resource::<GraphPolicy>().linearizer.clone();
            let fusions = world.resource::<Fusions>();
            let ctx = Finalize {
                devices: &devices,
                linearizer: &*linearizer,
                compilers: &fusions.compilers,
                warnings: &fusions.warnings,
            };
            // The linearizer and the fusion compiler may be user code: a panic in
            // them fails this finalize only.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.run(&job)))
                .unwrap_or_else(|p| Err(FinalizeError::Panicked(gantry_driver::panic_message(&*p))))
        };
        *job.result.lock() = Some(result);
        let now = world.resource::<SchedulerConfig>().now_ns();
        job.event.finish(Ok(()), now, now);
    }
}

/// What finalizing reads from the world.
struct Finalize<'a> {
    devices: &'a [(Arc<dyn Driver>, DeviceInfo)],
    linearizer: &'a dyn Linearizer,
    compilers: &'a [Compilers],
    warnings: &'a std::sync::atomic::AtomicUsize,
}

/// The successor lists of `nodes`.
fn successors(nodes: &[GraphNode]) -> Adjacency {
    let mut succs: Adjacency = vec![SmallVec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        for &p in &n.preds {
            succs[p as usize].push(i as NodeId);
        }
    }
    succs
}

/// A node on a cycle, if the edges have one (Kahn's algorithm leaves it unplaced).
fn find_cycle(preds: &Adjacency, succs: &Adjacency) -> Option<NodeId> {
    let order = BreadthFirst.order(preds, succs);
    if order.len() == preds.len() {
        return None;
    }
    let mut placed = vec![false; preds.len()];
    for n in order {
        placed[n as usize] = true;
    }
    placed.iter().position(|p| !p).map(|n| n as NodeId)
}

/// Checks that `order` is a topological order of every node.
fn check_order(order: &[NodeId], preds: &Adjacency) -> Result<(), String> {
    if order.len() != preds.len() {
        return Err(format!("{} nodes ordered, the graph has {}", order.len(), preds.len()));
    }
    let mut pos = vec![usize::MAX; preds.len()];
    for (i, &n) in order.iter().enumerate() {
        match pos.get_mut(n as usize) {
            Some(p) if *p == usize::MAX => *p = i,
            _ => return Err(format!("node {n} is out of range or placed twice")),
        }
    }
    for (n, ps) in preds.iter().enumerate() {
        if let Some(p) = ps.iter().find(|&&p| pos[p as usize] > pos[n]) {
            return Err(format!("node {n} is placed before its predecessor {p}"));
        }
    }
    Ok(())
}

/// The SYCL graph extension's implementation design's partition annotation ("Graph Partitioning", the worked examples):
/// returns a group number per node; nodes with equal numbers share a partition and
/// groups run in increasing order. `isolated[n]` marks host tasks (and nodes of
/// another device).
///
/// Isolated nodes are processed in insertion order. For each, its predecessors
/// (upwards, stopping at isolated nodes and at nodes already in a lower group) take a
/// new group, the node takes the next, and its successors (downwards, stopping at
/// isolated nodes) the one after. A successor walk that reaches an isolated node
/// already processed (possible only through a `make_edge` back edge) queues it again
/// at the front, and the predecessors of the node just processed are merged into the
/// group of that node's predecessors, so both feed it together.
///
/// Unlike the seed's recursive version, the walks are iterative (no stack overflow on
/// long chains), the downward walk visits each node once per pass, and a node is
/// queued again only once at a time.
pub fn assign_groups(preds: &Adjacency, succs: &Adjacency, isolated: &[bool]) -> Vec<i64> {
    let n = preds.len();
    let mut group = vec![-1i64; n];
    let mut queue: VecDeque<NodeId> = (0..n as NodeId).filter(|&i| isolated[i as usize]).collect();
    let mut current = -1i64;
    let mut seen = vec![u64::MAX; n];
    let mut pass = 0u64;
    let mut stack: Vec<NodeId> = Vec::new();
    while let Some(ht) = queue.pop_front() {
        let h = ht as usize;
        current += 1;
        stack.extend(preds[h].iter().copied());
        while let Some(x) = stack.pop() {
            let x = x as usize;
            if isolated[x] || (group[x] != -1 && group[x] <= current) {
                continue;
            }
            group[x] = current;
            stack.extend(preds[x].iter().copied());
        }
        current += 1;
        group[h] = current;
        current += 1;
        pass += 1;
        let queued_before = queue.len();
        stack.extend(succs[h].iter().copied());
        while let Some(x) = stack.pop() {
            let xi = x as usize;
            if seen[xi] == pass {
                continue;
            }
            seen[xi] = pass;
            if isolated[xi] {
                if group[xi] != -1 && !queue.contains(&x) {
                    queue.push_front(x);
                }
                continue;
            }
            group[xi] = current;
            stack.extend(succs[xi].iter().copied());
        }
        if queue.len() > queued_before {
            // Merge: this node's predecessors join the group of the predecessors of
            // each already-processed node it reached (which runs again).
            let from = group[h] - 1;
            for &other in queue.iter() {
                let g = group[other as usize];
                if g == -1 {
                    break;
                }
                for x in group.iter_mut() {
                    if *x == from {
                        *x = g - 1;
                    }
                }
            }
        }
    }
    group
}

/// Partitions of contiguous runs of `order`, split around isolated nodes: the
/// fallback when group merging produced partitions that depend on each other both
/// ways (the seed leaves that case open).
fn contiguous_groups(order: &[NodeId], isolated: &[bool]) -> Vec<i64> {
    let mut group = vec![0i64; order.len()];
    let (mut g, mut open) = (0i64, false);
    for &n in order {
        if isolated[n as usize] {
            g += i64::from(open);
            group[n as usize] = g;
            g += 1;
            open = false;
        } else {
            group[n as usize] = g;
            open = true;
        }
    }
    group
}

/// Partitions built from group numbers.
struct Partitions {
    /// Each partition's nodes, in execution order.
    members: Vec<Vec<NodeId>>,
    /// Each partition's predecessor partitions.
    preds: Vec<SmallVec<[u32; 2]>>,
    /// The partition of each node.
    part_of: Vec<u32>,
}

/// Partitions from group numbers: nodes grouped by number (in increasing order), each
/// partition's nodes in `order`; then the partitions' predecessors. `None` if the
/// partitions depend on each other in a cycle.
fn build_partitions(group: &[i64], order: &[NodeId], preds: &Adjacency) -> Option<Partitions> {
    let mut numbers: Vec<i64> = group.to_vec();
    numbers.sort_unstable();
    numbers.dedup();
    let count = numbers.len();
    let mut part_of: Vec<u32> =
        group.iter().map(|g| numbers.binary_search(g).expect("a group number") as u32).collect();
    let mut part_preds: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); count];
    for (n, ps) in preds.iter().enumerate() {
        for &p in ps {
            let (a, b) = (part_of[p as usize], part_of[n]);
            if a != b && !part_preds[b as usize].contains(&a) {
                part_preds[b as usize].push(a);
            }
        }
    }
    // Topological order of the partitions, stable by group number.
    let mut succ: Vec<Vec<u32>> = vec![Vec::new(); count];
    let mut pending: Vec<usize> = part_preds.iter().map(|p| p.len()).collect();
    for (b, ps) in part_preds.iter().enumerate() {
        for &a in ps {
            succ[a as usize].push(b as u32);
        }
    }
    let mut ready: std::collections::BTreeSet<u32> =
        (0..count as u32).filter(|&p| pending[p as usize] == 0).collect();
    let mut rank = vec![u32::MAX; count];
    let mut next = 0u32;
    while let Some(p) = ready.pop_first() {
        rank[p as usize] = next;
        next += 1;
        for &s in &succ[p as usize] {
            pending[s as usize] -= 1;
            if pending[s as usize] == 0 {
                ready.insert(s);
            }
        }
    }
    if (next as usize) < count {
        return None;
    }
    for p in part_of.iter_mut() {
        *p = rank[*p as usize];
    }
    let mut parts: Vec<Vec<NodeId>> = vec![Vec::new(); count];
    for &n in order {
        parts[part_of[n as usize] as usize].push(n);
    }
    let mut ranked_preds: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); count];
    for (old, ps) in part_preds.into_iter().enumerate() {
        let mut ps: SmallVec<[u32; 2]> = ps.into_iter().map(|p| rank[p as usize]).collect();
        ps.sort_unstable();
        ranked_preds[rank[old] as usize] = ps;
    }
    Some(Partitions { members: parts, preds: ranked_preds, part_of })
}

/// Whether `nodes` (in order) form one path: each depends on the one before, and on
/// nothing else inside the partition.
fn is_single_path(nodes: &[NodeId], preds: &Adjacency, part_of: &[u32]) -> bool {
    nodes.windows(2).all(|w| {
        let mut inside =
            preds[w[1] as usize].iter().filter(|&&p| part_of[p as usize] == part_of[w[1] as usize]);
        inside.next() == Some(&w[0]) && inside.next().is_none()
    })
}

/// One operation of a partition's command buffer: a node or a fused chain. A node's
/// step borrows the node.
struct Step<'a> {
    /// The nodes it stands for (one, or a fused chain).
    nodes: SmallVec<[NodeId; 1]>,
    /// Its buffer uses in argument order (internal ones last, not bound).
    uses: Cow<'a, [NodeUse]>,
    /// Slots bound to dynamic parameters.
    params: &'a [(u32, u32)],
    /// What it runs.
    op: StepOp<'a>,
    /// Earlier steps it depends on.
    deps: SmallVec<[SyncPoint; 4]>,
}

enum StepOp<'a> {
    Node(&'a NodeWork),
    Fused {
        kernel: gantry_driver::KernelRef,
        geometry: gantry_driver::Geometry,
        scalars: gantry_driver::ScalarBlock,
    },
}

/// A partition laid out but not recorded yet.
struct Laid {
    name: Arc<str>,
    nodes: Vec<NodeId>,
    preds: SmallVec<[u32; 2]>,
    in_order: bool,
}

/// Where every node runs, before anything is recorded.
struct Layout {
    /// The linearization.
    order: Vec<NodeId>,
    /// The partition of each node.
    part_of: Vec<u32>,
    /// The partitions, dependencies first.
    parts: Vec<Laid>,
}

impl Layout {
    /// The layout of an earlier plan (see [`FinalizeJob::reuse`]).
    fn of(plan: &ExecPlan) -> Self {
        let parts = plan
            .partitions
            .iter()
            .map(|p| Laid {
                name: p.name.clone(),
                nodes: p.nodes.clone(),
                preds: p.preds.clone(),
                in_order: p.in_order,
            })
            .collect();
        Layout { order: plan.order.clone(), part_of: plan.partition_of.clone(), parts }
    }
}

/// The SYCL graph extension's implementation design's whole-graph update check, plus node kinds and the exact edges: the
/// reason when `b` does not have `a`'s topology; else whether each node also runs on
/// the device of its counterpart (what, with the same topology, decides the
/// partitions).
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
/// records (a finalize with [`FinalizeJob::reuse`] when the layout holds).
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

/// Groups a partition's kernels into chains to fuse (in execution order). A copy,
/// fill or empty node that depends on a chain's kernel and that a later kernel
/// depends on ends the chain; one that does not depend on the chain is moved before
/// it. Returns the chains and, per chain end, why it ended early.
pub fn fusion_chains(nodes: &[NodeId], graph: &[GraphNode]) -> (Vec<Vec<NodeId>>, Vec<String>) {
    let mut chains: Vec<Vec<NodeId>> = Vec::new();
    let mut why = Vec::new();
    let mut current: Vec<NodeId> = Vec::new();
    let mut after: FxHashMap<NodeId, bool> = FxHashMap::default();
    for &n in nodes {
        let node = &graph[n as usize];
        let in_chain = |p: &NodeId| current.contains(p);
        let depends_on_chain =
            node.preds.iter().any(|p| in_chain(p) || after.get(p).copied().unwrap_or(false));
        // Kernels with dynamic parameters stay unfused (their arguments change).
        if node.kind == CommandKind::Kernel && node.params.is_empty() {
            let through_other = node.preds.iter().find(|p| after.get(p).copied().unwrap_or(false));
            if let Some(&other) = through_other {
                why.push(format!(
                    "`{}` orders between the kernels `{}` and `{}`",
                    graph[other as usize].name, graph[current[0] as usize].name, node.name
                ));
                chains.push(std::mem::take(&mut current));
                after.clear();
            }
            current.push(n);
        } else {
            if node.kind == CommandKind::Kernel {
                why.push(format!("kernel `{}` has dynamic parameters and is not fused", node.name));
            }
            after.insert(n, depends_on_chain);
        }
    }
    chains.push(current);
    chains.retain(|c| c.len() > 1);
    (chains, why)
}

impl Finalize<'_> {
    fn run(&self, job: &FinalizeJob) -> Result<ExecPlan, FinalizeError> {
        let layout = match &job.reuse {
            // The update that sent it checked the topology, devices and properties,
            // and tried `patch_plan` first.
            Some(plan) => {
                debug_assert_eq!(plan.nodes.len(), job.nodes.len(), "a reused layout has the job's nodes");
                Layout::of(plan)
            }
            _ => self.layout(job)?,
        };
        self.record_all(job, layout)
    }

    /// Linearizes the nodes and assigns partitions.
    fn layout(&self, job: &FinalizeJob) -> Result<Layout, FinalizeError> {
        let nodes = &job.nodes;
        let preds: Adjacency = nodes.iter().map(|n| n.preds.clone()).collect();
        let succs = successors(nodes);
        let order = self.linearizer.order(&preds, &succs);
        if let Err(why) = check_order(&order, &preds) {
            // No order is valid on a cycle: name a node on it; otherwise the policy erred.
            return Err(match find_cycle(&preds, &succs) {
                Some(node) => FinalizeError::Cycle { node },
                None => FinalizeError::BadOrder { policy: self.linearizer.name().to_string(), why },
            });
        }
        let isolated: Vec<bool> = nodes.iter().map(|n| n.is_isolated(job.device)).collect();
        let groups = assign_groups(&preds, &succs, &isolated);
        let Partitions { members, preds: part_preds, part_of } =
            match build_partitions(&groups, &order, &preds) {
                Some(p) => p,
                None => {
                    tracing::warn!(
                        "graph partitions formed a cycle after group merging; using contiguous partitions"
                    );
                    build_partitions(&contiguous_groups(&order, &isolated), &order, &preds)
                        .expect("contiguous partitions of a topological order are acyclic")
                }
            };
        let parts = members
            .into_iter()
            .zip(part_preds)
            .enumerate()
            .map(|(p, (nodes, preds_of))| Laid {
                name: format!("partition {p}").into(),
                in_order: is_single_path(&nodes, &preds, &part_of),
                nodes,
                preds: preds_of,
            })
            .collect();
        Ok(Layout { order, part_of, parts })
    }

    /// Records the partitions of `layout` (host-task partitions run their node).
    fn record_all(&self, job: &FinalizeJob, layout: Layout) -> Result<ExecPlan, FinalizeError> {
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
            let body = if nodes[first].kind == CommandKind::HostTask {
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

    /// The steps of a partition with kernel chains fused (into `steps`, which is
    /// empty).
    fn fused_steps<'a>(
        &self,
        members: &[NodeId],
        nodes: &'a [GraphNode],
        barriers: bool,
        plan: &mut ExecPlan,
        steps: &mut Vec<Step<'a>>,
        node_step: impl Fn(NodeId) -> Step<'a>,
    ) {
        // Which chain (by index) each fused node belongs to.
        let mut chain_of: FxHashMap<NodeId, usize> = FxHashMap::default();
        // The fused steps (their `nodes` are the chain), until emitted.
        let mut fused: Vec<Option<Step<'a>>> = Vec::new();
        let (chains, why) = fusion_chains(members, nodes);
        for w in why {
            warn_fusion(self.warnings, format_args!("graph fusion: chain not fused further: {w}"));
            plan.not_fused.push(w);
        }
        for chain in chains {
            match self.fuse(&chain, nodes, barriers) {
                Ok((step, chain_info)) => {
                    for &n in &chain {
                        chain_of.insert(n, fused.len());
                    }
                    fused.push(Some(step));
                    plan.fused.push(chain_info);
                }
                Err(why) => {
                    let names: Vec<&str> = chain.iter().map(|&n| &*nodes[n as usize].name).collect();
                    let msg = format!("kernels {names:?} not fused: {why}");
                    warn_fusion(self.warnings, format_args!("graph fusion: {msg}"));
                    plan.not_fused.push(msg);
                }
            }
        }

        // Emit in order: a fused chain at its last kernel; a node that depends on
        // chains not emitted yet waits until all of them are (then in order).
        let mut depends_on: FxHashMap<NodeId, SmallVec<[usize; 2]>> = FxHashMap::default();
        for &n in members {
            if chain_of.contains_key(&n) {
                continue;
            }
            let mut chains: SmallVec<[usize; 2]> = SmallVec::new();
            for p in &nodes[n as usize].preds {
                let via: SmallVec<[usize; 2]> = match chain_of.get(p) {
                    Some(&c) => smallvec::smallvec![c],
                    None => depends_on.get(p).cloned().unwrap_or_default(),
                };
                for c in via {
                    if !chains.contains(&c) {
                        chains.push(c);
                    }
                }
            }
            if !chains.is_empty() {
                depends_on.insert(n, chains);
            }
        }
        let mut pending: Vec<NodeId> = Vec::new();
        let last_of: Vec<NodeId> =
            fused.iter().map(|f| *f.as_ref().expect("chain").nodes.last().expect("kernel")).collect();
        let mut emitted = vec![false; fused.len()];
        let ready =
            |n: &NodeId, emitted: &[bool]| depends_on.get(n).is_none_or(|cs| cs.iter().all(|&c| emitted[c]));
        for &n in members {
            if let Some(&c) = chain_of.get(&n) {
                if n == last_of[c] {
                    let step = fused[c].take().expect("chain emitted once");
                    steps.push(step);
                    emitted[c] = true;
                    // Waiting nodes whose chains are all out now follow, in order (a
                    // waiting node's own waiting predecessors wait for a subset).
                    let waiting = std::mem::take(&mut pending);
                    for d in waiting {
                        if ready(&d, &emitted) {
                            steps.push(node_step(d));
                        } else {
                            pending.push(d);
                        }
                    }
                }
                continue;
            }
            if ready(&n, &emitted) {
                steps.push(node_step(n));
            } else {
                pending.push(n);
            }
        }
        // Every chain is emitted at its last kernel, so nothing is left waiting; should
        // a node be, it still runs (the driver checks its sync points).
        steps.extend(pending.into_iter().map(node_step));
    }

    /// Fuses one chain through the fusion compiler.
    fn fuse(
        &self,
        chain: &[NodeId],
        nodes: &[GraphNode],
        barriers: bool,
    ) -> Result<(Step<'static>, FusedChain), String> {
        // The fusion rules read requirements (placed nowhere: no resolution state).
        let reqs: Vec<Vec<Requirement>> = chain
            .iter()
            .map(|&n| nodes[n as usize].uses.iter().map(NodeUse::requirement).collect())
            .collect();
        let mut request = FusionRequest { kernels: Vec::with_capacity(chain.len()), barriers };
        for (i, (&n, reqs)) in chain.iter().zip(&reqs).enumerate() {
            let node = &nodes[n as usize];
            let NodeWork::Kernel { kernel, geometry, scalars } = &node.work else {
                return Err(format!("`{}` is not a kernel", node.name));
            };
            let args = reqs.iter().map(fusion_arg).collect();
            // Its predecessors in the chain (a chain has no path between its kernels
            // through other nodes: `fusion_chains` ends it before one).
            let earlier = &chain[..i];
            let deps = node
                .preds
                .iter()
                .filter_map(|p| earlier.iter().position(|e| e == p).map(|j| j as u32))
                .collect();
            request.kernels.push(FusionKernel {
                kernel: kernel.clone(),
                geometry: *geometry,
                args,
                deps,
                scalars: scalars.clone(),
            });
        }
        let device = nodes[chain[0] as usize].device as usize;
        let (compilers, name) =
            (self.compilers.get(device).map_or(&[][..], |c| &c[..]), &self.devices[device].1.name);
        let fused = fuse_with(compilers, name, &request).map_err(|e| e.to_string())?;
        let reqs: Vec<&[Requirement]> = reqs.iter().map(|r| &r[..]).collect();
        let uses = fused_requirements(&fused, &reqs).into_iter().map(NodeUse::from).collect();
        let info =
            FusedChain { nodes: chain.to_vec(), name: fused.kernel.name.clone(), warnings: fused.warnings };
        let step = Step {
            nodes: chain.iter().copied().collect(),
            uses: Cow::Owned(uses),
            params: &[],
            op: StepOp::Fused { kernel: fused.kernel, geometry: fused.geometry, scalars: fused.scalars },
            deps: SmallVec::new(),
        };
        Ok((step, info))
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

        let (driver, info) = &self.devices[device as usize];
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
                    NodeWork::HostTask { .. } => {
                        return Err(FinalizeError::Unsupported {
                            node: step.nodes[0],
                            name: nodes[step.nodes[0] as usize].name.to_string(),
                            device: info.name.to_string(),
                            what: "a host task inside a device partition".into(),
                        })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn adjacency(n: usize, edges: &[(NodeId, NodeId)]) -> (Adjacency, Adjacency) {
        let mut preds: Adjacency = vec![SmallVec::new(); n];
        let mut succs: Adjacency = vec![SmallVec::new(); n];
        for &(a, b) in edges {
            preds[b as usize].push(a);
            succs[a as usize].push(b);
        }
        (preds, succs)
    }

    /// Normalizes group numbers to partition indexes in increasing order.
    fn partitions(groups: &[i64]) -> Vec<u32> {
        let mut g: Vec<i64> = groups.to_vec();
        g.sort_unstable();
        g.dedup();
        groups.iter().map(|x| g.iter().position(|y| y == x).unwrap() as u32).collect()
    }

    #[test]
    fn linearizers_give_topological_orders() {
        // 0 → 1 → 3, 0 → 2 → 3, 4 alone.
        let (p, s) = adjacency(5, &[(0, 1), (0, 2), (1, 3), (2, 3)]);
        let dfs = ReverseDfs.order(&p, &s);
        let bfs = BreadthFirst.order(&p, &s);
        assert!(check_order(&dfs, &p).is_ok(), "{dfs:?}");
        assert!(check_order(&bfs, &p).is_ok(), "{bfs:?}");
        assert_eq!(bfs, vec![0, 4, 1, 2, 3]);
        assert_eq!(dfs, vec![4, 0, 2, 1, 3]);
        assert!(check_order(&[1, 0, 2, 3, 4], &p).is_err());
        assert!(check_order(&[0, 1, 2, 3], &p).is_err());
    }

    #[test]
    fn a_host_task_splits_before_itself_and_after() {
        // A → B → HT → C → D, E → HT
        let (p, s) = adjacency(6, &[(0, 1), (1, 2), (2, 3), (3, 4), (5, 2)]);
        let iso = [false, false, true, false, false, false];
        assert_eq!(partitions(&assign_groups(&p, &s, &iso)), vec![0, 0, 1, 2, 2, 0]);
    }

    #[test]
    fn cycles_are_found() {
        let (p, s) = adjacency(3, &[(0, 1), (1, 2), (2, 1)]);
        assert!(find_cycle(&p, &s).is_some());
        let (p, s) = adjacency(3, &[(0, 1), (1, 2)]);
        assert_eq!(find_cycle(&p, &s), None);
    }

    #[test]
    fn contiguous_fallback_splits_around_isolated_nodes() {
        let iso = [false, true, false, false];
        let g = contiguous_groups(&[0, 1, 2, 3], &iso);
        assert_eq!(partitions(&g), vec![0, 1, 2, 2]);
    }
}

/// `patch_plan` on a hand-built plan of two single-kernel partitions, recorded by a
/// driver that can be told to refuse patches.
#[cfg(test)]
mod patch_tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use gantry_driver::{
        patch_buffer, phase, Accepted, AllocId, Capabilities, ClosureKernel, CommandBufferBuilder,
        DeviceInfo, DeviceKind, Geometry, ItemCost, Plan, PlanBuilder, Range, Submission,
    };

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
            max_local_memory: 0,
            max_private_memory: 0,
            virtual_time: false,
            peer_group: 0,
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
