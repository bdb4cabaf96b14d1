//! Command graphs (the SYCL graph extension's implementation design): the nodes of a
//! modifiable graph, the finalize request the partition stage serves, and the
//! executable plan it produces.
//!
//! A modifiable graph is plain data owned by its user handle; the scheduler sees it
//! once, when it is finalized: the request becomes an entity carrying [`Finalizing`],
//! and the partition stage (`gantry_systems::partition`) linearizes it, assigns
//! partitions, fuses kernel chains if asked, and records one driver command buffer
//! per partition. Each submission of the executable graph then becomes one command
//! per partition, resolved against the memory records like any other command.

use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::resource::Resource;
use gantry_driver::fusion::{FusionWarning, Promotion};
use gantry_driver::sync::Mutex;
use gantry_driver::{
    AccessMode, CommandBuffer, ExecError, Geometry, HostFn, HostStorage, KernelRef, ScalarBlock,
};
use smallvec::SmallVec;

use crate::command::{CommandDesc, CommandKind, Requirement, RequirementList, SyncCell, Work};
use crate::event::EventShared;
use crate::handle::{BufferCore, QueueCore};
use crate::memory::ByteRange;
use crate::resources::DeviceId;

/// Index of a node in its graph, in insertion order.
pub type NodeId = u32;

/// A node's predecessors or successors (derefs to `[NodeId]`).
pub type NodeList = SmallVec<[NodeId; 4]>;

/// A host task a graph runs once per submission: it must be callable again.
pub type GraphHostFn = gantry_driver::SharedHostFn;

/// What a node does.
#[derive(Clone)]
pub enum NodeWork {
    /// Launch a kernel; one requirement per global accessor slot.
    Kernel {
        /// The kernel.
        kernel: KernelRef,
        /// Its iteration space.
        geometry: Geometry,
        /// Its scalar arguments.
        scalars: ScalarBlock,
    },
    /// Run a host task; one requirement per host accessor slot.
    HostTask {
        /// The closure.
        run: GraphHostFn,
        /// Its command group's tag.
        tag: u64,
        /// Its declared duration on a simulated host pool, in nanoseconds.
        cost_ns: Option<f64>,
    },
    /// Copy requirement 0 into requirement 1.
    Copy,
    /// Copy these bytes (captured when recorded) into requirement 0.
    CopyFromHost(Arc<HostStorage>),
    /// Copy requirement 0 into this host storage.
    CopyToHost(Arc<HostStorage>),
    /// Fill requirement 0 with this element pattern.
    Fill(SmallVec<[u8; 16]>),
    /// Nothing: an empty node, a barrier, or a sub-graph's entry or exit.
    Empty,
}

/// One buffer range a graph node uses: what a [`Requirement`] says before resolution
/// places it. A node is resolved anew at each submission, so it carries none of the
/// resolution state: half a requirement's size, which counts when an update reads
/// every node of two graphs.
#[derive(Clone, Debug)]
pub struct NodeUse {
    /// The buffer.
    pub buffer: Arc<BufferCore>,
    /// Which bytes.
    pub range: ByteRange,
    /// Bytes per element of the accessor.
    pub elem_size: u32,
    /// How it is used.
    pub mode: AccessMode,
    /// The accessor's promotion hint for fusion.
    pub promotion: Promotion,
    /// Ordering only (see [`Requirement::internal`]).
    pub internal: bool,
}

// Half a requirement (see `Requirement`'s own size check).
const _: () = assert!(std::mem::size_of::<NodeUse>() <= 32);

impl From<Requirement> for NodeUse {
    /// What `r` says of its use (not where resolution placed it).
    fn from(r: Requirement) -> Self {
        let Requirement { buffer, range, elem_size, mode, promotion, internal, .. } = r;
        Self { buffer, range, elem_size, mode, promotion, internal }
    }
}

impl NodeUse {
    /// A requirement for this use, not yet placed.
    pub fn requirement(&self) -> Requirement {
        let mut r = Requirement::new(self.buffer.clone(), self.mode, self.range);
        (r.elem_size, r.promotion, r.internal) = (self.elem_size, self.promotion, self.internal);
        r
    }
}

/// One node of a command graph.
#[derive(Clone)]
pub struct GraphNode {
    /// Kind (`Kernel`, `HostTask`, `Copy`, `CopyFromHost`, `CopyToHost`, `Fill`,
    /// `Marker` for empty nodes, `Barrier`).
    pub kind: CommandKind,
    /// Name, for errors and traces.
    pub name: Arc<str>,
    /// The device that runs it (host tasks: the host).
    pub device: DeviceId,
    /// The buffer ranges it uses, in argument order.
    pub uses: SmallVec<[NodeUse; 4]>,
    /// Argument slots bound to dynamic parameters: (slot, parameter index).
    pub params: SmallVec<[(u32, u32); 1]>,
    /// What it does.
    pub work: NodeWork,
    /// The nodes it depends on.
    pub preds: SmallVec<[NodeId; 4]>,
}

impl GraphNode {
    /// Whether partitioning isolates it on a device whose command buffers do not
    /// record host tasks (the SYCL graph extension's implementation design: host
    /// tasks get a partition of their own; `records_host_tasks` says whether the
    /// device's driver keeps them in its command buffers instead). Nodes of other
    /// devices are not isolated: partitions split where the device changes instead,
    /// so a chain recorded from one device's queue stays one command buffer (and one
    /// chain for graph fusion) whichever device the graph was made for.
    pub fn is_isolated(&self, records_host_tasks: bool) -> bool {
        self.kind == CommandKind::HostTask && !records_host_tasks
    }
}

/// A graph's nodes, in index order, and their [`GraphShape`], computed at most once
/// per version of the list: a list is shared (as `Arc<GraphNodes>`) between a graph
/// and the plans finalized from it, and any change goes through
/// [`GraphNodes::edit`], which forgets the shape.
#[derive(Clone, Default)]
pub struct GraphNodes {
    nodes: Vec<GraphNode>,
    shape: std::sync::OnceLock<GraphShape>,
}

impl GraphNodes {
    /// The list, to change: its shape is computed again when next asked for.
    pub fn edit(&mut self) -> &mut Vec<GraphNode> {
        self.shape = std::sync::OnceLock::new();
        &mut self.nodes
    }

    /// The shape of the nodes as they are.
    pub fn shape(&self) -> &GraphShape {
        self.shape.get_or_init(|| GraphShape::of(&self.nodes))
    }
}

impl From<Vec<GraphNode>> for GraphNodes {
    fn from(nodes: Vec<GraphNode>) -> Self {
        Self { nodes, shape: Default::default() }
    }
}

impl std::ops::Deref for GraphNodes {
    type Target = [GraphNode];
    fn deref(&self) -> &[GraphNode] {
        &self.nodes
    }
}

/// What a whole-graph update must find unchanged in every node to keep a plan's
/// partitions, argument tables and recorded arguments: kinds, devices, edges, each
/// use's range, element size, mode and ordering flag, and the dynamic parameters'
/// slots. Buffers, kernels and host data are not part of it. Encoded as LEB128
/// numbers, each variable-length part behind its length, so that equal shapes are
/// equal bytes (about 25 per node), and two graphs of thousands of nodes compare in
/// one slice comparison instead of a walk over both node lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphShape(Vec<u8>);

impl GraphShape {
    /// The shape of `nodes`.
    pub fn of(nodes: &[GraphNode]) -> Self {
        let mut shape = Self(Vec::with_capacity(nodes.len() * 32));
        for n in nodes {
            shape.put(n.kind as u64);
            shape.put(n.device.into());
            shape.put(n.preds.len() as u64);
            for &p in &n.preds {
                shape.put(p.into());
            }
            shape.put(n.uses.len() as u64);
            for u in &n.uses {
                shape.put(u.mode as u64 | (u64::from(u.internal) << 8));
                shape.put(u.elem_size.into());
                shape.put(u.range.start as u64);
                shape.put(u.range.end as u64);
            }
            shape.put(n.params.len() as u64);
            for &(slot, param) in &n.params {
                shape.put(slot.into());
                shape.put(param.into());
            }
        }
        shape
    }

    /// Appends `x`, seven bits a byte, low bits first; the high bit of each byte
    /// but the last is set.
    fn put(&mut self, mut x: u64) {
        while x >= 0x80 {
            self.0.push(x as u8 | 0x80);
            x >>= 7;
        }
        self.0.push(x as u8);
    }
}

/// Properties of `finalize`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphProps {
    /// Accept updates (dynamic parameters, whole-graph updates) after finalizing.
    pub updatable: bool,
    /// Fuse kernel chains inside each partition; `Some(barriers)` inserts a
    /// work-group barrier between fused kernels when `barriers` is true.
    pub fusion: Option<bool>,
}

impl GraphProps {
    /// The graph may be updated after finalizing.
    pub fn updatable(mut self) -> Self {
        self.updatable = true;
        self
    }
    /// Fuse kernel chains inside partitions, with work-group barriers between them.
    pub fn fused(mut self) -> Self {
        self.fusion = Some(true);
        self
    }
    /// Fuse kernel chains inside partitions without barriers between them.
    pub fn fused_without_barriers(mut self) -> Self {
        self.fusion = Some(false);
        self
    }
}

/// Why a graph could not be finalized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FinalizeError {
    /// The edges form a cycle (possible only with unchecked `make_edge`).
    #[error("the graph has a cycle through node {node}")]
    Cycle {
        /// A node on the cycle.
        node: NodeId,
    },
    /// A linearization policy returned something that is not a topological order.
    #[error("linearizer `{policy}` returned an invalid order: {why}")]
    BadOrder {
        /// The policy's name.
        policy: String,
        /// What is wrong.
        why: String,
    },
    /// A node's device cannot record it into a command buffer (the SYCL graph
    /// extension's implementation design's `feature_not_supported`).
    #[error("node {node} (`{name}`): {what} is not supported in command buffers by device `{device}`")]
    Unsupported {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// The device.
        device: String,
        /// What it asked for.
        what: String,
    },
    /// The driver failed otherwise while recording.
    #[error("recording a command buffer for partition {partition} failed: {error}")]
    Driver {
        /// The partition.
        partition: u32,
        /// The driver's error.
        error: ExecError,
    },
    /// User code run by finalize (a linearizer, a fusion compiler) panicked.
    #[error("finalize panicked: {0}")]
    Panicked(String),
    /// The scheduler stopped before the graph was finalized.
    #[error("the scheduler stopped before finalize: {0}")]
    Stopped(ExecError),
}

/// Where an argument-table entry's memory comes from at each submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntrySource {
    /// A fixed buffer: an index into [`ExecPlan::buffers`].
    Buffer(u32),
    /// A dynamic parameter's current buffer: an index into the executable graph's
    /// parameter table.
    Param(u32),
}

/// One entry of a partition's argument table: a buffer range the partition uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Whose memory.
    pub source: EntrySource,
    /// The union of its uses' modes.
    pub mode: AccessMode,
    /// The hull of its uses' ranges.
    pub range: ByteRange,
}

/// Keeps a user's buffer handle alive while a graph refers to its buffer.
pub type KeepAlive = Arc<dyn std::any::Any + Send + Sync>;

/// The buffers an executable graph's dynamic parameters point at, indexed by
/// [`EntrySource::Param`], each with what keeps it alive.
pub type ParamTable = Arc<[(Arc<BufferCore>, KeepAlive)]>;

/// What every submission of an executable graph through one queue shares: the plan,
/// the parameters' buffers and the queue of that moment. The submitting thread keeps
/// one until one of them changes, and a submission hands the scheduler a reference
/// to it and the submission's event; the scheduler's thread makes the partitions'
/// commands ([`GraphSubmission::commands`]). So submitting costs its caller the same
/// for ten nodes as for ten thousand, and the reference counts of the plan, the
/// parameters, the partitions' names and the queue are touched by the scheduler's
/// thread only, not moved between the caller's core and the scheduler's every frame.
pub struct GraphLaunch {
    /// The executable plan.
    pub plan: Arc<ExecPlan>,
    /// The parameters' buffers.
    pub params: ParamTable,
    /// The queue submitted to.
    pub queue: Arc<QueueCore>,
    /// Where and under what name the completion marker of a plan with several tail
    /// partitions (or none) runs.
    pub marker: (DeviceId, Arc<str>),
    /// The previous submission of the executable graph (through any launch).
    pub order: Arc<GraphOrder>,
    /// The name of each submission's event: that of the partition it completes with,
    /// or the marker's. A copy: the submitting thread clones it, and the original's
    /// count belongs to the scheduler's thread.
    pub event_name: Arc<str>,
}

impl GraphLaunch {
    /// The launch of `plan` with `params` through `queue`.
    pub fn new(
        plan: Arc<ExecPlan>,
        params: ParamTable,
        queue: Arc<QueueCore>,
        marker: (DeviceId, Arc<str>),
        order: Arc<GraphOrder>,
    ) -> Self {
        let event_name = match plan.only_tail() {
            Some(only) => &plan.partitions[only].name,
            None => &marker.1,
        };
        let event_name = Arc::from(&**event_name);
        Self { plan, params, queue, marker, order, event_name }
    }
}

/// The completion of an executable graph's latest submission: the next submission
/// starts after it. Only the scheduler's thread locks it.
#[derive(Default)]
pub struct GraphOrder(Mutex<Option<Arc<EventShared>>>);

/// One submission of an executable graph.
pub struct GraphSubmission {
    /// What it runs.
    pub launch: Arc<GraphLaunch>,
    /// Completes when every partition has (named [`GraphLaunch::event_name`]).
    pub event: Arc<EventShared>,
    /// When it was submitted.
    pub submitted_ns: u64,
}

impl GraphSubmission {
    /// Passes `submit` the submission's commands, dependencies first: one per
    /// partition (its command buffer, or its host task), each waiting for the
    /// partitions it depends on and the first ones for the previous submission; then,
    /// unless one partition is the only tail, a marker after the tails. The last one
    /// completes the submission's event.
    pub fn commands(self, mut submit: impl FnMut(CommandDesc)) {
        let GraphSubmission { launch, event: done, submitted_ns } = self;
        let GraphLaunch { plan, params, queue, marker, order, .. } = &*launch;
        // The previous submission orders this one; it must not poison it: a finished
        // (even failed) one is no dependency.
        let prev = order.0.lock().replace(done.clone());
        let prev = prev.filter(|e| !e.status().is_final());
        let only_tail = plan.only_tail();
        let mut events: SmallVec<[Arc<EventShared>; 4]> = SmallVec::with_capacity(plan.partitions.len());
        for (i, part) in plan.partitions.iter().enumerate() {
            let event = match only_tail == Some(i) {
                true => done.clone(),
                false => Arc::new(EventShared::new(part.name.clone(), done.runtime, submitted_ns)),
            };
            let mut waits: SmallVec<[Arc<EventShared>; 1]> =
                part.preds.iter().map(|&p| events[p as usize].clone()).collect();
            if part.preds.is_empty() {
                waits.extend(prev.iter().cloned());
            }
            let (kind, name, device, (requirements, work)) = match &part.body {
                PartitionBody::Commands { .. } => (
                    CommandKind::CommandBuffer,
                    part.name.clone(),
                    part.device,
                    partition_command_buffer(plan, params, i),
                ),
                PartitionBody::HostTask { node } => {
                    let n = &plan.nodes[*node as usize];
                    let NodeWork::HostTask { run, tag, cost_ns } = &n.work else {
                        unreachable!("host-task partitions hold host tasks")
                    };
                    // (Only kernels take dynamic parameters: the requirements are fixed.)
                    let reqs = n.uses.iter().map(NodeUse::requirement).collect();
                    let run = run.clone();
                    let replay: HostFn = Box::new(move |ctx| (run.lock())(ctx));
                    let work = Work::HostTask { run: SyncCell::new(replay), tag: *tag, cost_ns: *cost_ns };
                    (CommandKind::HostTask, n.name.clone(), n.device, (reqs, work))
                }
            };
            let queue = queue.clone();
            submit(CommandDesc {
                kind,
                name,
                queue,
                device,
                requirements,
                work,
                waits,
                event: event.clone(),
                fusion: None,
            });
            events.push(event);
        }
        if only_tail.is_none() {
            // Several tails (or none): one marker completes after all of them.
            let mut waits: SmallVec<[Arc<EventShared>; 1]> =
                plan.tails.iter().map(|&t| events[t as usize].clone()).collect();
            if plan.tails.is_empty() {
                waits.extend(prev);
            }
            submit(CommandDesc {
                kind: CommandKind::Marker,
                name: marker.1.clone(),
                queue: queue.clone(),
                device: marker.0,
                requirements: SmallVec::new(),
                work: Work::Marker,
                waits,
                event: done,
                fusion: None,
            });
        }
    }
}

/// The requirements (one per distinct buffer of the argument table, then the
/// ordering-only ones of internalized buffers) and the work of command-buffer
/// partition `partition` of `plan` with the parameters' buffers `params`.
///
/// # Panics
/// If the partition is not a command buffer.
fn partition_command_buffer(
    plan: &ExecPlan,
    params: &ParamTable,
    partition: usize,
) -> (RequirementList, Work) {
    let PartitionBody::Commands { buffer, entries, internal } = &plan.partitions[partition].body else {
        panic!("partition {} is not a command buffer", partition)
    };
    let mut reqs: RequirementList = SmallVec::with_capacity(entries.len() + internal.len());
    let mut args: SmallVec<[(u32, AccessMode); 4]> = SmallVec::with_capacity(entries.len());
    let core = |s: EntrySource| match s {
        EntrySource::Buffer(b) => &plan.buffers[b as usize],
        EntrySource::Param(p) => &params[p as usize].0,
    };
    // Entries have distinct sources; two are one buffer only through a parameter
    // or an update that merged buffers.
    let is_param = |e: &Entry| matches!(e.source, EntrySource::Param(_));
    let may_alias = plan.aliased || entries.iter().chain(internal).any(is_param);
    let mut add = |e: &Entry, internal| {
        add_requirement(&mut reqs, core(e.source), e.mode, e.range, internal, may_alias)
    };
    for e in entries {
        args.push((add(e, false), e.mode));
    }
    for e in internal {
        add(e, true);
    }
    (reqs, Work::CommandBuffer { buffer: buffer.clone(), entries: args })
}

/// Adds a requirement on `buffer` or widens the one already there (looked for only
/// when `may_alias`); returns its index. Ordering-only (`internal`) requirements come
/// after all the others.
fn add_requirement(
    reqs: &mut RequirementList,
    buffer: &Arc<BufferCore>,
    mode: AccessMode,
    range: ByteRange,
    internal: bool,
    may_alias: bool,
) -> u32 {
    let found = if may_alias { reqs.iter().position(|r| Arc::ptr_eq(&r.buffer, buffer)) } else { None };
    match found {
        Some(i) => {
            let r = &mut reqs[i];
            if !internal && (r.mode != mode || r.range != range) {
                r.mode = if r.mode == AccessMode::Read && mode == AccessMode::Read {
                    AccessMode::Read
                } else {
                    AccessMode::ReadWrite
                };
            }
            r.range = r.range.hull(&range);
            i as u32
        }
        None => {
            let mut r = Requirement::new(buffer.clone(), mode, range);
            r.internal = internal;
            reqs.push(r);
            (reqs.len() - 1) as u32
        }
    }
}

/// What a partition runs at each submission.
#[derive(Clone)]
pub enum PartitionBody {
    /// A recorded command buffer over an argument table.
    Commands {
        /// The driver's command buffer.
        buffer: CommandBuffer,
        /// Its argument table.
        entries: Vec<Entry>,
        /// Ranges it orders against without binding them (buffers a fused kernel
        /// internalized).
        internal: Vec<Entry>,
    },
    /// One host task node, run as a host task command.
    HostTask {
        /// The node.
        node: NodeId,
    },
}

/// One partition of an executable graph.
#[derive(Clone)]
pub struct PartitionPlan {
    /// Its name in traces and errors (`partition 3`).
    pub name: Arc<str>,
    /// The device it runs on.
    pub device: DeviceId,
    /// Its nodes, in execution order (after graph fusion: the nodes it stands for).
    pub nodes: Vec<NodeId>,
    /// The partitions that must finish first (indexes into [`ExecPlan::partitions`]).
    pub preds: SmallVec<[u32; 2]>,
    /// Whether its nodes form one path (the SYCL graph extension's implementation
    /// design, "In-Order Graph Partitions").
    pub in_order: bool,
    /// What it runs.
    pub body: PartitionBody,
}

/// A chain of kernels graph fusion turned into one.
#[derive(Clone, Debug)]
pub struct FusedChain {
    /// The fused nodes, in order.
    pub nodes: Vec<NodeId>,
    /// The fused kernel's name.
    pub name: Arc<str>,
    /// What the fusion compiler did not do as asked.
    pub warnings: Vec<FusionWarning>,
}

/// The executable form of a graph.
#[derive(Clone)]
pub struct ExecPlan {
    /// The graph's nodes (kept for sub-graphs, host tasks and whole-graph updates);
    /// shared with the modifiable graph until it changes.
    pub nodes: Arc<GraphNodes>,
    /// The fixed buffers its partitions bind.
    pub buffers: Vec<Arc<BufferCore>>,
    /// Where each node's requirements are in [`ExecPlan::buffers`], node by node,
    /// slot by slot (`u32::MAX` for a dynamic parameter's slot, a host task's, or a
    /// fused kernel's): a whole-graph update maps the old buffers to the new ones
    /// with it.
    pub slot_buffers: Vec<u32>,
    /// Whether two of [`ExecPlan::buffers`] are one buffer (a whole-graph update
    /// merged them): submission then merges their requirements.
    pub aliased: bool,
    /// The linearization: every node once, dependencies first.
    pub order: Vec<NodeId>,
    /// The partition of each node.
    pub partition_of: Vec<u32>,
    /// The partitions, dependencies first.
    pub partitions: Vec<PartitionPlan>,
    /// The kernel chains graph fusion fused.
    pub fused: Vec<FusedChain>,
    /// Why chains that graph fusion considered were not fused.
    pub not_fused: Vec<crate::NotFused>,
    /// Partitions no other partition depends on: a submission completes after them.
    pub tails: Vec<u32>,
}

impl ExecPlan {
    /// Computes [`ExecPlan::tails`] from the partitions' predecessors.
    pub fn find_tails(&mut self) {
        let mut has_succ = vec![false; self.partitions.len()];
        for p in &self.partitions {
            for &q in &p.preds {
                has_succ[q as usize] = true;
            }
        }
        self.tails = (0..self.partitions.len() as u32).filter(|&p| !has_succ[p as usize]).collect();
    }

    /// The partition a submission completes with, if one is the only tail (else a
    /// marker after the tails completes it).
    pub fn only_tail(&self) -> Option<usize> {
        match self.tails.as_slice() {
            [only] => Some(*only as usize),
            _ => None,
        }
    }
}

/// A request to finalize a graph, served by the partition stage.
pub struct FinalizeJob {
    /// The nodes.
    pub nodes: Arc<GraphNodes>,
    /// The device of the graph's non-isolated nodes.
    pub device: DeviceId,
    /// Finalize properties.
    pub props: GraphProps,
    /// A plan finalized with the same device and properties from nodes with the same
    /// edges, kinds and devices (a whole-graph update's current plan): its
    /// linearization and partitions depend on nothing else, so they are kept and only
    /// the partitions' command buffers are recorded again. Not for graph fusion.
    pub reuse: Option<Arc<ExecPlan>>,
    /// Completed when the result is in.
    pub event: Arc<EventShared>,
    /// The result.
    pub result: Mutex<Option<Result<ExecPlan, FinalizeError>>>,
}

/// Marks a finalize request entity.
#[derive(Component, Clone)]
pub struct Finalizing(pub Arc<FinalizeJob>);

/// Orders a graph's nodes for execution (the SYCL graph extension's implementation
/// design, "Execution Order"). The partition stage asks it for a topological order;
/// reverse depth-first is the default, and researchers plug in others with
/// `RuntimeBuilder::linearizer`.
pub trait Linearizer: Send + Sync {
    /// A short name, for reports and errors.
    fn name(&self) -> &str;
    /// Every node once, each after its predecessors. `preds[n]` and `succs[n]` are
    /// node `n`'s edges.
    fn order(&self, preds: &[NodeList], succs: &[NodeList]) -> Vec<NodeId>;
}

/// The graph policies the partition stage uses.
#[derive(Resource, Clone)]
pub struct GraphPolicy {
    /// How nodes are linearized.
    pub linearizer: Arc<dyn Linearizer>,
}
