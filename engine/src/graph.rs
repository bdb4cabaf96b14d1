//! Command graphs (the SYCL graph extension's implementation design): record a frame
//! once, replay it every frame. See [`CommandGraph`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytemuck::Pod;
use gantry_components::BufferCore;
use gantry_components::{
    Accesses, CommandKind, EventShared, EventStatus, ExecPlan, FinalizeJob, GraphLaunch, GraphNode,
    GraphNodes, GraphOrder, GraphProps, GraphSubmission, Message, NodeId, NodeUse, NodeWork, ParamTable,
    PartitionBody, QueueCore, QueueOrder, Work,
};
use gantry_driver::sync::Mutex;
use smallvec::SmallVec;

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::handler::{Built, Handler, KeepAlive};
use crate::runtime::{DeviceId, Runtime, Shared};

/// A node of a [`CommandGraph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub(crate) graph: u64,
    pub(crate) index: NodeId,
}

impl Node {
    /// Its index in the graph (insertion order), as partition reports name it.
    pub fn index(&self) -> u32 {
        self.index
    }
}

/// A dynamic parameter's state in its graph.
struct Param {
    /// The runtime of its first buffer: another runtime's cannot be bound.
    runtime: u64,
    buffer: Arc<BufferCore>,
    keep: KeepAlive,
    elem_size: usize,
}

/// A queue recording into the graph.
struct Recorder {
    queue: u64,
    /// Its queue order (the scheduler's rule, with the recording semantics).
    order: QueueOrder<NodeId>,
}

#[derive(Default)]
struct GraphState {
    /// Copy on write: finalize and update share the list with the plans they make,
    /// and the next modification copies it only while a plan still holds it.
    nodes: Arc<GraphNodes>,
    /// Copy on write, shared with the executable graphs like `nodes`.
    keep: Arc<Vec<KeepAlive>>,
    accesses: HashMap<u64, Accesses<NodeId>>,
    recorders: Vec<Recorder>,
    /// Buffers marked as recorded (host access refused) until recording ends.
    marked: Vec<Arc<BufferCore>>,
    params: Vec<Param>,
}

pub(crate) struct GraphShared {
    id: u64,
    rt: Arc<Shared>,
    /// Its nodes' device; `Err` names an unknown device `graph_on` was given, which
    /// every later call on the graph reports.
    device: Result<DeviceId, DeviceId>,
    state: Mutex<GraphState>,
}

/// A modifiable command graph (the SYCL graph extension's implementation design):
/// record a frame once, replay it every frame. Clones share the graph.
///
/// A [`CommandGraph`] is built with explicit [`CommandGraph::add`] calls or by
/// recording queues ([`CommandGraph::begin_recording`]). Edges come from the
/// dependencies given, from events of recorded commands, from in-order queues and
/// barriers, and — like eager submissions — from the buffer ranges the nodes access.
/// [`CommandGraph::finalize`] turns it into an [`ExecutableGraph`] in the scheduler's
/// partition stage: one driver command buffer per partition. Each
/// [`Queue::submit_graph`](crate::Queue::submit_graph) resolves the partitions' buffer
/// ranges against the memory records like any command, so eager work and graph work
/// on the same buffer are ordered both ways.
///
/// ```
/// use gantry::{GraphProps, Runtime};
/// let rt = Runtime::new();
/// let q = rt.in_order_queue();
/// let buf = rt.buffer(&[0u32; 64]);
/// let graph = rt.graph();
/// graph.begin_recording(&q)?;
/// q.submit(|cg| {
///     let b = cg.elements_mut(&buf);
///     cg.parallel_for(64, move |it| *b.elem(it) += 1);
/// })?;
/// q.submit(|cg| {
///     let b = cg.elements_mut(&buf);
///     cg.parallel_for(64, move |it| *b.elem(it) *= 2);
/// })?;
/// graph.end_recording(&q)?;
/// assert_eq!(buf.to_vec()?, vec![0; 64], "recording runs nothing");
/// let exec = graph.finalize(GraphProps::default())?;
/// for _ in 0..3 {
///     q.submit_graph(&exec)?;
/// }
/// q.wait()?;
/// assert_eq!(buf.to_vec()?, vec![14; 64]); // ((0+1)*2+1)*2+1)*2
/// # Ok::<(), gantry::Error>(())
/// ```
#[derive(Clone)]
pub struct CommandGraph {
    pub(crate) inner: Arc<GraphShared>,
}

/// A buffer argument that can be swapped in an executable graph without re-finalizing
/// (the SYCL graph extension's implementation design, "Graph Update": kernel arguments
/// by index). Bind it to argument slots of kernel nodes with [`CommandGraph::set_arg`];
/// change it with [`ExecutableGraph::update_param`].
pub struct DynamicBuffer<T> {
    graph: u64,
    index: u32,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T> Clone for DynamicBuffer<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DynamicBuffer<T> {}

impl<T> DynamicBuffer<T> {
    /// Its index in its graph.
    pub fn index(&self) -> u32 {
        self.index
    }
}

impl Runtime {
    /// A new, empty command graph whose nodes run on the default device.
    pub fn graph(&self) -> CommandGraph {
        self.graph_on(self.default_device)
    }

    /// A new, empty command graph whose nodes run on `device` (nodes recorded from
    /// queues of other devices get partitions of their own). If no such device
    /// exists, every call on the graph returns [`Error::UnknownDevice`];
    /// [`Runtime::try_graph_on`] says so at once.
    pub fn graph_on(&self, device: DeviceId) -> CommandGraph {
        let shared = &self.shared;
        let known = (device as usize) < shared.devices.len();
        let inner = GraphShared {
            id: shared.next_id(),
            rt: shared.clone(),
            device: if known { Ok(device) } else { Err(device) },
            state: Mutex::new(GraphState::default()),
        };
        CommandGraph { inner: Arc::new(inner) }
    }

    /// [`Runtime::graph_on`], refusing a device that does not exist.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// assert_eq!(rt.try_graph_on(7).unwrap_err(), gantry::Error::UnknownDevice(7));
    /// assert!(rt.try_graph_on(0).is_ok());
    /// ```
    pub fn try_graph_on(&self, device: DeviceId) -> Result<CommandGraph> {
        if device as usize >= self.shared.devices.len() {
            return Err(Error::UnknownDevice(device));
        }
        Ok(self.graph_on(device))
    }
}

impl std::fmt::Debug for CommandGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandGraph").field("id", &self.inner.id).field("nodes", &self.node_count()).finish()
    }
}

impl std::fmt::Debug for ExecutableGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutableGraph")
            .field("id", &self.inner.id)
            .field("graph", &self.inner.graph)
            .finish()
    }
}

impl GraphState {
    /// Edges from the buffer accesses of `reqs` to earlier conflicting ones, recorded
    /// as accesses of `node`.
    /// The memory rule is the scheduler's, over its leaf index per buffer, so nodes
    /// touching disjoint ranges of one buffer find their conflicts in O(log n + k).
    fn access_edges(&mut self, node: NodeId, reqs: &[NodeUse], preds: &mut SmallVec<[NodeId; 4]>) {
        for r in reqs {
            let acc = self.accesses.entry(r.buffer.id).or_default();
            acc.access(node, &r.range, r.mode.writes(), |p| preds.push(p));
        }
        // A node reached through several ranges or buffers is one edge.
        preds.sort_unstable();
        preds.dedup();
    }

    fn mark_recorded(&mut self, reqs: &[NodeUse]) {
        for r in reqs {
            if !self.marked.iter().any(|b| Arc::ptr_eq(b, &r.buffer)) {
                r.buffer.recorded.fetch_add(1, Ordering::AcqRel);
                self.marked.push(r.buffer.clone());
            }
        }
    }

    fn unmark_recorded(&mut self) {
        for b in self.marked.drain(..) {
            b.recorded.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for GraphShared {
    fn drop(&mut self) {
        self.state.get_mut().unmark_recorded();
    }
}

impl CommandGraph {
    /// Identifies the graph in errors.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.inner.state.lock().nodes.len()
    }

    /// Each node's predecessors, by node index.
    pub fn edges(&self) -> Vec<Vec<u32>> {
        self.inner.state.lock().nodes.iter().map(|n| n.preds.to_vec()).collect()
    }

    fn node(&self, index: NodeId) -> Node {
        Node { graph: self.inner.id, index }
    }

    fn check_nodes(&self, nodes: &[Node], len: usize) -> Result<()> {
        for n in nodes {
            if n.graph != self.inner.id || n.index as usize >= len {
                return Err(Error::ForeignNode { node: n.index, graph: n.graph, this: self.inner.id });
            }
        }
        Ok(())
    }

    /// The device of its nodes, or the unknown device it was made for.
    fn device(&self) -> Result<DeviceId> {
        self.inner.device.map_err(Error::UnknownDevice)
    }

    /// Refuses an object of another runtime.
    fn check_runtime(&self, runtime: u64, what: &'static str) -> Result<()> {
        if runtime != self.inner.rt.id {
            return Err(Error::ForeignObject(what));
        }
        Ok(())
    }

    fn device_info(&self, device: DeviceId) -> &gantry_driver::DeviceInfo {
        &self.inner.rt.devices[device as usize]
    }

    /// Adds a node built by `build` (a command group, as for `Queue::submit`) that
    /// depends on `deps` and on earlier nodes whose buffer accesses conflict with its
    /// own. A command group without an action is an empty node.
    ///
    /// ```
    /// use gantry::{GraphProps, Runtime};
    /// let rt = Runtime::new();
    /// let buf = rt.buffer_zeroed::<u32>(16);
    /// let graph = rt.graph();
    /// let fill = graph.add(|cg| cg.fill(&buf, 3), &[])?;
    /// let double = graph.add(|cg| {
    ///     let b = cg.elements_mut(&buf);
    ///     cg.parallel_for(16, move |it| *b.elem(it) *= 2);
    /// }, &[fill])?;
    /// assert_eq!(graph.edges()[double.index() as usize], vec![fill.index()]);
    /// rt.queue().submit_graph(&graph.finalize(GraphProps::default())?)?.wait()?;
    /// assert_eq!(buf.to_vec()?, vec![6; 16]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn add(&self, build: impl FnOnce(&mut Handler), deps: &[Node]) -> Result<Node> {
        if !self.inner.state.lock().recorders.is_empty() {
            return Err(Error::GraphRecording(self.inner.id));
        }
        let device = self.device()?;
        let rt = &self.inner.rt;
        let mut cg = Handler::for_graph(rt.id, crate::handler::next_tag(), self.inner.id);
        build(&mut cg);
        let built = cg.finish(self.device_info(device))?;
        let mut st = self.inner.state.lock();
        self.check_nodes(deps, st.nodes.len())?;
        let index = self.push(&mut st, built, device, deps.iter().map(|d| d.index).collect(), false)?;
        Ok(self.node(index))
    }

    /// Adds an empty node that depends on `deps`: a join point.
    pub fn add_empty(&self, deps: &[Node]) -> Result<Node> {
        self.add(|_| {}, deps)
    }

    /// Appends a built command group as a node.
    fn push(
        &self,
        st: &mut GraphState,
        mut built: Built,
        device: DeviceId,
        mut preds: SmallVec<[NodeId; 4]>,
        recording: bool,
    ) -> Result<NodeId> {
        if let Some(w) = built.waits.first() {
            return Err(Error::EventOutsideGraph(w.name.to_string()));
        }
        for w in &built.graph_waits {
            if w.graph != self.inner.id || w.index as usize >= st.nodes.len() {
                return Err(Error::EventOutsideGraph(format!("node {} of graph {}", w.index, w.graph)));
            }
            if !preds.contains(&w.index) {
                preds.push(w.index);
            }
        }
        let index = st.nodes.len() as NodeId;
        let uses: SmallVec<[NodeUse; 4]> =
            std::mem::take(&mut built.requirements).into_iter().map(NodeUse::from).collect();
        st.access_edges(index, &uses, &mut preds);
        if recording {
            st.mark_recorded(&uses);
        }
        let work = match std::mem::replace(&mut built.work, Work::Marker) {
            Work::HostTask { run, tag, cost_ns } => {
                NodeWork::HostTask { run: Arc::new(Mutex::new(run.into_inner())), tag, cost_ns }
            }
            Work::Kernel { kernel, geometry, scalars } => NodeWork::Kernel { kernel, geometry, scalars },
            Work::Copy => NodeWork::Copy,
            Work::CopyFromHost(data) => NodeWork::CopyFromHost(data),
            Work::CopyToHost(out) => NodeWork::CopyToHost(out),
            Work::Fill(pattern) => NodeWork::Fill(pattern),
            _ => NodeWork::Empty,
        };
        let device =
            if built.kind == CommandKind::HostTask { self.inner.rt.host_task_device(device) } else { device };
        preds.sort_unstable();
        Arc::make_mut(&mut st.keep).append(&mut built.keep);
        Arc::make_mut(&mut st.nodes).edit().push(GraphNode {
            kind: built.kind,
            name: built.name,
            device,
            uses,
            params: SmallVec::new(),
            work,
            preds,
        });
        Ok(index)
    }

    /// Adds an edge `from → to`: `to` runs after `from`. A self edge, a node of
    /// another graph and an edge that closes a cycle are errors.
    pub fn make_edge(&self, from: Node, to: Node) -> Result<()> {
        self.edge(from, to, true)
    }

    /// [`make_edge`](Self::make_edge) without the cycle check (the SYCL graph
    /// extension's implementation design's opt-out, for large graphs built by trusted
    /// code); a cycle is then reported by `finalize`.
    pub fn make_edge_unchecked(&self, from: Node, to: Node) -> Result<()> {
        self.edge(from, to, false)
    }

    fn edge(&self, from: Node, to: Node, check: bool) -> Result<()> {
        let mut st = self.inner.state.lock();
        if !st.recorders.is_empty() {
            return Err(Error::GraphRecording(self.inner.id));
        }
        self.check_nodes(&[from, to], st.nodes.len())?;
        if from.index == to.index {
            return Err(Error::SelfEdge(from.index));
        }
        if check && reaches(&st.nodes, to.index, from.index) {
            return Err(Error::CycleEdge { from: from.index, to: to.index });
        }
        if !st.nodes[to.index as usize].preds.contains(&from.index) {
            let preds = &mut Arc::make_mut(&mut st.nodes).edit()[to.index as usize].preds;
            preds.push(from.index);
            preds.sort_unstable();
        }
        Ok(())
    }

    /// Adds `sub`'s nodes as a sub-graph that runs after `deps` (and after earlier
    /// nodes whose buffer accesses conflict with the sub-graph's). Returns the node
    /// that completes after the whole sub-graph; later nodes depend on it. Adding the
    /// same graph twice copies it twice.
    pub fn add_graph(&self, sub: &ExecutableGraph, deps: &[Node]) -> Result<Node> {
        self.check_runtime(sub.runtime_id(), "an executable graph")?;
        let device = self.device()?;
        let mut st = self.inner.state.lock();
        if !st.recorders.is_empty() {
            return Err(Error::GraphRecording(self.inner.id));
        }
        self.check_nodes(deps, st.nodes.len())?;
        let exit = self.insert_subgraph(&mut st, sub, device, deps.iter().map(|d| d.index).collect(), false);
        Ok(self.node(exit))
    }

    /// Copies `sub`'s nodes in between an entry node (depending on `deps`) and an exit
    /// node, which it returns.
    fn insert_subgraph(
        &self,
        st: &mut GraphState,
        sub: &ExecutableGraph,
        device: DeviceId,
        mut entry_preds: SmallVec<[NodeId; 4]>,
        recording: bool,
    ) -> NodeId {
        let (plan, params, sub_keep) = {
            let s = sub.inner.state.lock();
            (s.plan.clone(), s.params.clone(), s.keep.clone())
        };
        let empty = |name: &str, preds: SmallVec<[NodeId; 4]>| GraphNode {
            kind: CommandKind::Marker,
            name: name.into(),
            device,
            uses: SmallVec::new(),
            params: SmallVec::new(),
            work: NodeWork::Empty,
            preds,
        };
        let entry = st.nodes.len() as NodeId;
        // The sub-graph's accesses, with parameters resolved to their buffers.
        let sub_nodes: Vec<GraphNode> = plan
            .nodes
            .iter()
            .map(|n| {
                let mut n = n.clone();
                for &(slot, p) in &n.params {
                    n.uses[slot as usize].buffer = params[p as usize].0.clone();
                }
                n.params.clear();
                n
            })
            .collect();
        let all_reqs: Vec<NodeUse> = sub_nodes.iter().flat_map(|n| n.uses.iter().cloned()).collect();
        let exit = entry + 1 + sub_nodes.len() as NodeId;
        st.access_edges(exit, &all_reqs, &mut entry_preds);
        if recording {
            st.mark_recorded(&all_reqs);
        }
        entry_preds.retain(|p| *p != exit);
        entry_preds.sort_unstable();
        let nodes = Arc::make_mut(&mut st.nodes).edit();
        nodes.push(empty("subgraph_entry", entry_preds));
        let mut has_succ = vec![false; sub_nodes.len()];
        for mut n in sub_nodes {
            for p in n.preds.iter_mut() {
                has_succ[*p as usize] = true;
                *p += entry + 1;
            }
            if n.preds.is_empty() {
                n.preds.push(entry);
            }
            nodes.push(n);
        }
        let leaves: SmallVec<[NodeId; 4]> =
            (0..has_succ.len()).filter(|&i| !has_succ[i]).map(|i| entry + 1 + i as NodeId).collect();
        let leaves = if leaves.is_empty() { smallvec::smallvec![entry] } else { leaves };
        nodes.push(empty("subgraph_exit", leaves));
        let keep = Arc::make_mut(&mut st.keep);
        keep.extend(sub_keep.iter().cloned());
        keep.extend(params.iter().map(|p| p.1.clone()));
        exit
    }

    /// Sends `queue`'s submissions into this graph instead of running them, until
    /// [`end_recording`](Self::end_recording). An in-order queue records a chain;
    /// `Queue::barrier` records a barrier node; an empty command group an empty node.
    /// While recording, waiting on the queue or on a recorded event, and host access to
    /// a recorded buffer, are errors.
    pub fn begin_recording(&self, queue: &crate::Queue) -> Result<()> {
        self.check_runtime(queue.runtime_id(), "a queue")?;
        self.device()?;
        let mut st = self.inner.state.lock();
        queue.start_recording(self)?;
        st.recorders.push(Recorder { queue: queue.id(), order: QueueOrder::recorded() });
        Ok(())
    }

    /// Stops recording `queue` into this graph.
    pub fn end_recording(&self, queue: &crate::Queue) -> Result<()> {
        let not = || Error::NotRecording { queue: queue.id(), graph: self.inner.id };
        let mut st = self.inner.state.lock();
        let i = st.recorders.iter().position(|r| r.queue == queue.id()).ok_or_else(not)?;
        queue.stop_recording(self).ok_or_else(not)?;
        st.recorders.remove(i);
        if st.recorders.is_empty() {
            st.unmark_recorded();
        }
        Ok(())
    }

    /// Whether a queue records into this graph.
    pub fn is_recording(&self) -> bool {
        !self.inner.state.lock().recorders.is_empty()
    }

    /// Records a submission of a recording queue.
    pub(crate) fn record(&self, queue: &Arc<QueueCore>, built: Built) -> Result<Event> {
        let name = built.name.clone();
        let barrier = built.kind == CommandKind::Barrier;
        self.record_with(queue, name, barrier, |g, st, preds| g.push(st, built, queue.device, preds, true))
    }

    /// Records a barrier of a recording queue: a node after everything the queue
    /// recorded since its previous barrier.
    pub(crate) fn record_barrier(&self, queue: &Arc<QueueCore>) -> Result<Event> {
        let built = Built {
            kind: CommandKind::Barrier,
            work: Work::Marker,
            name: "barrier".into(),
            requirements: SmallVec::new(),
            waits: SmallVec::new(),
            readback: None,
            keep: Vec::new(),
            graph_waits: SmallVec::new(),
        };
        self.record(queue, built)
    }

    /// Records the submission of an executable graph to a recording queue: a
    /// sub-graph node.
    pub(crate) fn add_graph_recorded(&self, sub: &ExecutableGraph, queue: &Arc<QueueCore>) -> Result<Event> {
        self.check_runtime(sub.runtime_id(), "an executable graph")?;
        let device = self.device()?;
        self.record_with(queue, "subgraph".into(), false, |g, st, preds| {
            Ok(g.insert_subgraph(st, sub, device, preds, true))
        })
    }

    fn record_with(
        &self,
        queue: &Arc<QueueCore>,
        name: Arc<str>,
        barrier: bool,
        add: impl FnOnce(&Self, &mut GraphState, SmallVec<[NodeId; 4]>) -> Result<NodeId>,
    ) -> Result<Event> {
        let mut st = self.inner.state.lock();
        let r =
            st.recorders.iter().position(|r| r.queue == queue.id).ok_or(Error::QueueRecording(queue.id))?;
        let mut preds: SmallVec<[NodeId; 4]> = SmallVec::new();
        let last = st.recorders[r].order.preds(queue.in_order, barrier, |p| preds.push(p));
        preds.extend(last);
        preds.sort_unstable();
        preds.dedup();
        // The queue order advances only once the node is added.
        let index = add(self, &mut st, preds)?;
        st.recorders[r].order.push(index, barrier);
        let shared = Arc::new(EventShared::new(name, self.inner.rt.id, self.inner.rt.clock.stamp_ns()));
        Ok(Event::of_node(shared, &self.inner.rt, self.node(index)))
    }

    /// A dynamic parameter whose value starts as `buffer`.
    ///
    /// A buffer of another runtime makes a parameter that [`CommandGraph::set_arg`]
    /// refuses ([`Error::ForeignObject`]).
    pub fn dynamic_buffer<T: Pod>(&self, buffer: &Buffer<T>) -> DynamicBuffer<T> {
        let mut st = self.inner.state.lock();
        let index = st.params.len() as u32;
        st.params.push(Param {
            runtime: buffer.runtime_id(),
            buffer: buffer.core().clone(),
            keep: buffer.keep_alive(),
            elem_size: std::mem::size_of::<T>(),
        });
        DynamicBuffer { graph: self.inner.id, index, _t: std::marker::PhantomData }
    }

    /// Binds argument `slot` (accessor order) of kernel `node` to `param`: the node
    /// uses the parameter's buffer, over the same range, from now on and after every
    /// [`ExecutableGraph::update_param`]. The slot's buffer must have the parameter's
    /// size and element type. Edges stay those of the buffers the node was built with.
    pub fn set_arg<T: Pod>(&self, node: Node, slot: u32, param: &DynamicBuffer<T>) -> Result<()> {
        let mut st = self.inner.state.lock();
        self.check_nodes(&[node], st.nodes.len())?;
        let mismatch = |why: String| Error::ParamMismatch { param: param.index, why };
        if param.graph != self.inner.id {
            return Err(mismatch(format!("belongs to graph {}, not {}", param.graph, self.inner.id)));
        }
        let p = &st.params[param.index as usize];
        self.check_runtime(p.runtime, "a buffer")?;
        let (bytes, elem, buffer) = (p.buffer.bytes, p.elem_size, p.buffer.clone());
        let n = &st.nodes[node.index as usize];
        if n.kind != CommandKind::Kernel {
            return Err(mismatch(format!("node {} is a {}, not a kernel", node.index, n.kind.name())));
        }
        let Some(req) = n.uses.get(slot as usize) else {
            return Err(mismatch(format!("node {} has no argument slot {slot}", node.index)));
        };
        if req.buffer.bytes != bytes || req.elem_size as usize != elem {
            return Err(mismatch(format!(
                "slot {slot} of node {} uses a buffer of {} bytes of {}-byte elements; the parameter's has {bytes} of {elem}",
                node.index, req.buffer.bytes, req.elem_size
            )));
        }
        let n = &mut Arc::make_mut(&mut st.nodes).edit()[node.index as usize];
        n.uses[slot as usize].buffer = buffer;
        n.params.retain(|(s, _)| *s != slot);
        n.params.push((slot, param.index));
        Ok(())
    }

    /// Finalizes the graph into an executable graph (in the scheduler's partition
    /// stage): linearization, partitions, graph fusion if `props` asks, and one
    /// command buffer per partition. The graph stays modifiable.
    pub fn finalize(&self, props: GraphProps) -> Result<ExecutableGraph> {
        let device = self.device()?;
        let Taken { nodes, keep, params } = self.take()?;
        let plan = finalize_nodes(&self.inner.rt, nodes, device, props, None)?;
        let state = ExecState { plan: Arc::new(plan), keep, params, launch: None };
        let id = self.inner.rt.next_id();
        let exec = ExecShared {
            id,
            name: format!("graph {id}").into(),
            graph: self.inner.id,
            device,
            rt: self.inner.rt.clone(),
            props,
            order: Default::default(),
            state: Mutex::new(state),
        };
        Ok(ExecutableGraph { inner: Arc::new(exec) })
    }

    /// What finalize and whole-graph update take from the graph as it is now;
    /// refused while it records.
    fn take(&self) -> Result<Taken> {
        let st = self.inner.state.lock();
        if !st.recorders.is_empty() {
            return Err(Error::GraphRecording(self.inner.id));
        }
        let params = st.params.iter().map(|p| (p.buffer.clone(), p.keep.clone())).collect();
        Ok(Taken { nodes: st.nodes.clone(), keep: st.keep.clone(), params })
    }
}

/// A graph's nodes, the handles that keep its buffers alive, and its dynamic
/// parameters' current buffers.
struct Taken {
    nodes: Arc<GraphNodes>,
    keep: Arc<Vec<KeepAlive>>,
    params: ParamTable,
}

/// Runs a finalize request through the scheduler and waits for it (`reuse`: see
/// [`FinalizeJob::reuse`]).
fn finalize_nodes(
    rt: &Arc<Shared>,
    nodes: Arc<GraphNodes>,
    device: DeviceId,
    props: GraphProps,
    reuse: Option<Arc<ExecPlan>>,
) -> Result<ExecPlan> {
    let job = Arc::new(FinalizeJob {
        nodes,
        device,
        props,
        reuse,
        event: Arc::new(EventShared::new("finalize".into(), rt.id, rt.clock.stamp_ns())),
        result: Mutex::new(None),
    });
    rt.send(Message::FinalizeGraph(job.clone()))?;
    rt.wait_for(&job.event, EventStatus::Complete)?;
    let result = job.result.lock().take().ok_or(Error::RuntimeDropped)?;
    Ok(result?)
}

/// Whether `to` is reachable from `from` along edges (predecessor lists reversed).
fn reaches(nodes: &[GraphNode], from: NodeId, to: NodeId) -> bool {
    // Walk predecessors from `to` back towards `from`.
    let mut seen = vec![false; nodes.len()];
    let mut stack = vec![to];
    while let Some(n) = stack.pop() {
        if n == from {
            return true;
        }
        if std::mem::replace(&mut seen[n as usize], true) {
            continue;
        }
        stack.extend(nodes[n as usize].preds.iter().copied());
    }
    false
}

struct ExecState {
    plan: Arc<ExecPlan>,
    /// Handles that keep the buffers of the graph the plan came from alive (that of
    /// the latest whole-graph update).
    keep: Arc<Vec<KeepAlive>>,
    /// Current buffers of the dynamic parameters.
    params: ParamTable,
    /// What submissions through the queue of the latest one share; `None` once the
    /// plan or the parameters change (it holds them: a patch of a plan it still held
    /// would copy the plan).
    launch: Option<Arc<GraphLaunch>>,
}

impl ExecState {
    /// The plan, to change.
    fn plan_mut(&mut self) -> &mut Arc<ExecPlan> {
        self.launch = None;
        &mut self.plan
    }

    /// Points the dynamic parameters at `params`.
    fn set_params(&mut self, params: ParamTable) {
        self.launch = None;
        self.params = params;
    }

    /// Takes the buffers of the graph a whole-graph update came from.
    fn set_graph(&mut self, keep: Arc<Vec<KeepAlive>>, params: ParamTable) {
        self.keep = keep;
        if !params.is_empty() {
            self.set_params(params);
        }
    }

    /// The launch for a submission through `queue`: the current one, or a new one.
    fn launch(&mut self, queue: &Arc<QueueCore>, exec: &ExecShared) -> Arc<GraphLaunch> {
        match &self.launch {
            Some(launch) if Arc::ptr_eq(&launch.queue, queue) => launch.clone(),
            _ => {
                let marker = (exec.device, exec.name.clone());
                let (plan, params, queue, order) =
                    (self.plan.clone(), self.params.clone(), queue.clone(), exec.order.clone());
                self.launch.insert(Arc::new(GraphLaunch::new(plan, params, queue, marker, order))).clone()
            }
        }
    }
}

struct ExecShared {
    id: u64,
    graph: u64,
    device: DeviceId,
    rt: Arc<Shared>,
    props: GraphProps,
    /// The name of the marker a submission with several tail partitions ends with.
    name: Arc<str>,
    /// The latest submission, which the next one waits for.
    order: Arc<GraphOrder>,
    state: Mutex<ExecState>,
}

/// A finalized command graph: submit it with
/// [`Queue::submit_graph`](crate::Queue::submit_graph) as often as needed. Clones
/// share it.
#[derive(Clone)]
pub struct ExecutableGraph {
    inner: Arc<ExecShared>,
}

/// One partition of an executable graph, for inspection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionInfo {
    /// Its nodes (indexes of the modifiable graph), in execution order.
    pub nodes: Vec<u32>,
    /// The partitions that run first.
    pub preds: Vec<u32>,
    /// Whether its nodes form one path.
    pub in_order: bool,
    /// Whether it is a host task.
    pub host_task: bool,
    /// The device it runs on.
    pub device: DeviceId,
}

impl ExecutableGraph {
    /// The runtime it belongs to.
    pub(crate) fn runtime_id(&self) -> u64 {
        self.inner.rt.id
    }

    /// Identifies the executable graph in errors.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    fn plan(&self) -> Arc<ExecPlan> {
        self.inner.state.lock().plan.clone()
    }

    /// The partitions, in the order they were numbered.
    pub fn partitions(&self) -> Vec<PartitionInfo> {
        self.plan()
            .partitions
            .iter()
            .map(|p| PartitionInfo {
                nodes: p.nodes.clone(),
                preds: p.preds.to_vec(),
                in_order: p.in_order,
                host_task: matches!(p.body, PartitionBody::HostTask { .. }),
                device: p.device,
            })
            .collect()
    }

    /// The partition of each node.
    pub fn partition_of(&self) -> Vec<u32> {
        self.plan().partition_of.clone()
    }

    /// The linearization: node indexes in execution order.
    pub fn order(&self) -> Vec<u32> {
        self.plan().order.clone()
    }

    /// The kernel chains graph fusion fused: each chain's nodes and fused name.
    pub fn fused_chains(&self) -> Vec<(Vec<u32>, String)> {
        self.plan().fused.iter().map(|c| (c.nodes.clone(), c.name.to_string())).collect()
    }

    /// Why chains graph fusion considered were not fused.
    pub fn not_fused(&self) -> Vec<gantry_components::NotFused> {
        self.plan().not_fused.clone()
    }

    fn check_updatable(&self) -> Result<()> {
        if self.inner.props.updatable {
            Ok(())
        } else {
            Err(Error::NotUpdatable(self.inner.id))
        }
    }

    /// Points dynamic parameter `param` at `buffer` for every later submission
    /// (submissions already made keep the buffer they were made with). The graph must
    /// be finalized as updatable; the buffer must have the parameter's size.
    pub fn update_param<T: Pod>(&self, param: &DynamicBuffer<T>, buffer: &Buffer<T>) -> Result<()> {
        self.check_updatable()?;
        let mismatch = |why: String| Error::ParamMismatch { param: param.index, why };
        if param.graph != self.inner.graph {
            return Err(mismatch(format!("belongs to graph {}, not to this graph's", param.graph)));
        }
        if buffer.runtime_id() != self.inner.rt.id {
            return Err(Error::ForeignObject("a buffer"));
        }
        let mut st = self.inner.state.lock();
        let Some(current) = st.params.get(param.index as usize) else {
            return Err(mismatch("was created after this graph was finalized".into()));
        };
        if current.0.bytes != buffer.core().bytes {
            return Err(mismatch(format!(
                "new buffer has {} bytes, the parameter {}",
                buffer.core().bytes,
                current.0.bytes
            )));
        }
        let mut params = st.params.to_vec();
        params[param.index as usize] = (buffer.core().clone(), buffer.keep_alive());
        st.set_params(params.into());
        Ok(())
    }

    /// Replaces the nodes' commands with those of `graph`, which must have the same
    /// topology (node count, node kinds, edges), for every later submission. The graph
    /// must be finalized as updatable. `graph` is finalized with this graph's
    /// properties.
    pub fn update(&self, graph: &CommandGraph) -> Result<()> {
        if graph.inner.rt.id != self.inner.rt.id {
            return Err(Error::ForeignObject("a command graph"));
        }
        self.check_updatable()?;
        let Taken { nodes, keep, params } = graph.take()?;
        let mut st = self.inner.state.lock();
        use gantry_systems::partition::{check_topology, patch_plan, PatchOutcome};
        if self.inner.props.fusion.is_none() {
            // Buffers one to one: patch the command buffers here (in place unless a
            // submission holds them), no scheduler round trip.
            let drivers: Option<Vec<_>> =
                self.inner.rt.drivers.iter().map(std::sync::Weak::upgrade).collect();
            match patch_plan(&drivers.ok_or(Error::RuntimeDropped)?, &nodes, st.plan_mut()) {
                PatchOutcome::Patched => {
                    st.set_graph(keep, params);
                    return Ok(());
                }
                PatchOutcome::Mismatch(why) => return Err(Error::TopologyMismatch(why)),
                PatchOutcome::Record => {}
            }
        }
        let same_devices = check_topology(&st.plan.nodes, &nodes).map_err(Error::TopologyMismatch)?;
        // Same edges and kinds; with the same devices too, the partitions are the
        // current ones (graph fusion may fuse other chains: it redoes it all).
        let same_layout = self.inner.props.fusion.is_none() && same_devices;
        let reuse = same_layout.then(|| st.plan.clone());
        drop(st); // the scheduler records; submissions go on meanwhile
        let plan = finalize_nodes(&self.inner.rt, nodes, self.inner.device, self.inner.props, reuse)?;
        let mut st = self.inner.state.lock();
        *st.plan_mut() = Arc::new(plan);
        st.set_graph(keep, params);
        Ok(())
    }

    /// Submits one execution (see [`Queue::submit_graph`](crate::Queue::submit_graph)):
    /// one message, whose partition commands the scheduler's thread makes. Submissions
    /// of one graph run one after another, in the order their messages arrive.
    pub(crate) fn submit(&self, queue: &Arc<QueueCore>) -> Result<Event> {
        let rt = &self.inner.rt;
        let launch = self.inner.state.lock().launch(queue, &self.inner);
        let submitted_ns = rt.clock.stamp_ns();
        let event = Arc::new(EventShared::new(launch.event_name.clone(), rt.id, submitted_ns));
        let submission = GraphSubmission { launch, event: event.clone(), submitted_ns };
        rt.send(Message::SubmitGraph(submission))?;
        Ok(Event::of_command(event, rt))
    }
}
