//! CUDA graphs: a command buffer's plan as a graph of kernel, memcpy, memset, host
//! and empty nodes, instantiated once and replayed with one `cuGraphLaunch`.
//!
//! Each recorded operation becomes a chain of nodes; the chain's first node follows
//! the last node of each operation it depends on:
//!
//! * a kernel: one kernel node, with the parameters of the launch convention
//!   ([`crate::launch`]);
//! * a copy: a device-to-device memcpy node, or two through scratch device memory
//!   where the ranges overlap (CUDA's copies do not allow overlap);
//! * a fill: the steps of [`plan_fill`], as memset and memcpy nodes;
//! * a memory buffer write: a memcpy node from its pinned bytes;
//! * a memory buffer read: a memcpy node into pinned staging memory, then a host node
//!   that copies the staging memory out;
//! * a marker, or an empty copy or fill: an empty node.
//!
//! The nodes hold device addresses, which a submission's argument table gives, so the
//! graph is built and instantiated at the first submission. A later submission with
//! the same addresses and payloads launches it as it is. Otherwise the nodes the
//! submission needs are described anew and compared with the instance's: where only
//! kernel nodes differ, each is set in the instance
//! (`cuGraphExecKernelNodeSetParams`); where other nodes differ but the topology is
//! the same, a graph built for the new nodes updates the instance whole
//! (`cuGraphExecUpdate`); where CUDA refuses that, or the topology changed, the new
//! graph is instantiated. CUDA applies an update to launches made after it only, and
//! orders launches of one instance, so submissions in flight are not affected.

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{
    self, CUdeviceptr, CUgraph, CUgraphExec, CUgraphNode, CUmemorytype, CUDA_HOST_NODE_PARAMS,
    CUDA_KERNEL_NODE_PARAMS, CUDA_MEMCPY3D, CUDA_MEMSET_NODE_PARAMS,
};
use gantry_driver::{Plan, RecordedArg, RecordedOp, ScalarBlock};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::command_buffer::{CudaCommandBuffer, Payload, ReadBack};
use crate::context::Context;
use crate::error::{check, CallError};
use crate::execution::Stream;
use crate::launch::Params;
use crate::memory::DeviceBox;
use crate::module::Hidden;
use crate::transfer::{plan_fill, FillStep};

/// One argument-table entry as a submission binds it: its device address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) len: usize,
}

/// Memory a memcpy node reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mem {
    Device(CUdeviceptr),
    /// Pinned host memory, by address.
    Host(usize),
}

/// What one node does.
#[derive(Clone, Debug, PartialEq)]
enum NodeSpec {
    Kernel {
        /// The operation, whose kernel's signature lays out the scalars.
        op: u32,
        /// The `CUfunction`, by address.
        func: usize,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        pointers: SmallVec<[CUdeviceptr; 4]>,
        scalars: ScalarBlock,
        hidden: Option<Hidden>,
    },
    Memset {
        dst: CUdeviceptr,
        value: u32,
        size: u32,
        count: usize,
    },
    Copy {
        src: Mem,
        dst: Mem,
        len: usize,
    },
    /// Copies a read's staging memory out: the [`ReadBack`], by address.
    Host(usize),
    Empty,
}

/// A node and the nodes it follows (indexes of earlier nodes).
#[derive(Clone, Debug, PartialEq)]
struct Node {
    spec: NodeSpec,
    after: SmallVec<[u32; 4]>,
}

impl Node {
    /// Whether `other` has the same place in the graph: same kind, same
    /// predecessors. Graphs whose nodes all have are updatable into each other.
    fn same_place(&self, other: &Node) -> bool {
        std::mem::discriminant(&self.spec) == std::mem::discriminant(&other.spec) && self.after == other.after
    }
}

/// A command buffer's instantiated graph, and what it was made for. Shared by the
/// command buffer and the copies made when it is patched.
#[derive(Default)]
pub(crate) struct ExecSlot {
    instance: Option<Arc<Instance>>,
    /// The payloads (the command buffer's `content`) and addresses its nodes hold.
    content: u64,
    bound: SmallVec<[Entry; 4]>,
    nodes: Vec<Node>,
    /// Scratch memory of copies whose ranges overlap, by operation.
    scratch: FxHashMap<usize, (DeviceBox, usize)>,
}

/// How often a driver's command buffers were instantiated, updated and launched.
///
/// ```
/// let counts = gantry_cuda::GraphCounts::default();
/// assert_eq!(counts.instantiated + counts.updated + counts.kernel_nodes_set, 0);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Graphs instantiated (`cuGraphInstantiateWithFlags`): the first submission of
    /// each command buffer, and updates CUDA refused.
    pub instantiated: u64,
    /// Whole-graph updates (`cuGraphExecUpdate`).
    pub updated: u64,
    /// Kernel nodes set in an instance (`cuGraphExecKernelNodeSetParams`).
    pub kernel_nodes_set: u64,
    /// Graph launches (`cuGraphLaunch`).
    pub launched: u64,
}

/// The driver's [`GraphCounts`], counted as it goes.
#[derive(Default)]
pub(crate) struct Counters {
    instantiated: AtomicU64,
    updated: AtomicU64,
    kernel_nodes_set: AtomicU64,
    launched: AtomicU64,
}

impl Counters {
    pub(crate) fn get(&self) -> GraphCounts {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        GraphCounts {
            instantiated: l(&self.instantiated),
            updated: l(&self.updated),
            kernel_nodes_set: l(&self.kernel_nodes_set),
            launched: l(&self.launched),
        }
    }
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Why a submission of a command buffer failed.
pub(crate) enum LaunchError {
    /// The bound memory does not fit the recording.
    Invalid(String),
    /// A CUDA call failed, doing what the message says.
    Call(CallError, &'static str),
}

/// Launches `buffer` on `stream` with its argument table bound to `bound`, bringing
/// the instantiated graph up to date first (see the module docs). Returns the
/// instance, which the submission keeps until it completes.
pub(crate) fn launch(
    ctx: &Arc<Context>,
    counters: &Counters,
    stream: &Stream,
    buffer: &CudaCommandBuffer,
    bound: &[Entry],
) -> Result<Arc<Instance>, LaunchError> {
    let mut slot = crate::execution::lock(&buffer.exec);
    let current = slot.instance.is_some() && slot.content == buffer.content && slot.bound[..] == *bound;
    if !current {
        let nodes = describe(ctx, buffer, bound, &mut slot.scratch)?;
        let instance = match slot.instance.take() {
            Some(old) => update(ctx, counters, &buffer.plan, old, &slot.nodes, &nodes)?,
            None => {
                Counters::add(&counters.instantiated, 1);
                Arc::new(Instance::new(ctx, &buffer.plan, &nodes)?)
            }
        };
        slot.instance = Some(instance);
        slot.nodes = nodes;
        slot.content = buffer.content;
        slot.bound = bound.into();
    }
    let instance = slot.instance.clone().expect("set above");
    // SAFETY: a live instance and stream of the current context.
    check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(instance.exec, stream.raw) })
        .map_err(|e| LaunchError::Call(e, "launching the command buffer's graph"))?;
    Counters::add(&counters.launched, 1);
    Ok(instance)
}

/// Brings `old` (made for `was`) up to `nodes`: kernel nodes set one by one where
/// only they differ, else a whole-graph update, else a new instance.
fn update(
    ctx: &Arc<Context>,
    counters: &Counters,
    plan: &Plan,
    old: Arc<Instance>,
    was: &[Node],
    nodes: &[Node],
) -> Result<Arc<Instance>, LaunchError> {
    let same_topology = was.len() == nodes.len() && was.iter().zip(nodes).all(|(a, b)| a.same_place(b));
    if same_topology {
        let only_kernels =
            was.iter().zip(nodes).all(|(a, b)| a == b || matches!(b.spec, NodeSpec::Kernel { .. }));
        if only_kernels {
            if let Ok(set) = old.set_kernels(plan, was, nodes) {
                Counters::add(&counters.kernel_nodes_set, set);
                return Ok(old);
            }
        }
        let graph =
            Graph::build(ctx, plan, nodes).map_err(|e| LaunchError::Call(e, "building a graph update"))?;
        let mut info = sys::CUgraphExecUpdateResultInfo {
            result: sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS,
            errorNode: ptr::null_mut(),
            errorFromNode: ptr::null_mut(),
        };
        // SAFETY: a live instance and graph of the current context; valid out-pointer.
        let updated = unsafe { sys::cuGraphExecUpdate_v2(old.exec, graph.raw, &mut info) };
        if updated == sys::CUresult::CUDA_SUCCESS {
            Counters::add(&counters.updated, 1);
            return Ok(old);
        }
    }
    Counters::add(&counters.instantiated, 1);
    Ok(Arc::new(Instance::new(ctx, plan, nodes)?))
}

/// The nodes `buffer` needs with its argument table bound to `bound`.
fn describe(
    ctx: &Arc<Context>,
    buffer: &CudaCommandBuffer,
    bound: &[Entry],
    scratch: &mut FxHashMap<usize, (DeviceBox, usize)>,
) -> Result<Vec<Node>, LaunchError> {
    let plan = &buffer.plan;
    if bound.len() != plan.entries {
        return Err(LaunchError::Invalid(format!(
            "{} arguments bound for an argument table of {}",
            bound.len(),
            plan.entries
        )));
    }
    let addr = |a: &RecordedArg| -> Result<CUdeviceptr, LaunchError> {
        let entry = bound[a.entry as usize];
        match a.offset.checked_add(a.len) {
            Some(end) if end <= entry.len => Ok(entry.ptr + a.offset as CUdeviceptr),
            _ => Err(LaunchError::Invalid(format!(
                "recorded range {}..+{} outside argument entry {} of {} bytes",
                a.offset, a.len, a.entry, entry.len
            ))),
        }
    };
    let mut nodes: Vec<Node> = Vec::with_capacity(plan.ops.len());
    // The last node of each operation.
    let mut exits: Vec<u32> = Vec::with_capacity(plan.ops.len());
    for (i, (planned, payload)) in plan.ops.iter().zip(&buffer.payloads).enumerate() {
        // The operation's chain of nodes.
        let mut chain: SmallVec<[NodeSpec; 2]> = SmallVec::new();
        let mut push = |spec: NodeSpec| chain.push(spec);
        match (&planned.op, payload) {
            (RecordedOp::Kernel { args, scalars, .. }, Payload::Kernel { loaded, dims, shared, hidden }) => {
                push(NodeSpec::Kernel {
                    op: i as u32,
                    func: loaded.function as usize,
                    grid: dims.grid,
                    block: dims.block,
                    shared: *shared,
                    pointers: args.iter().map(addr).collect::<Result<_, _>>()?,
                    scalars: scalars.clone(),
                    hidden: *hidden,
                });
            }
            (RecordedOp::Copy { src, dst }, _) => {
                let (s, d, len) = (addr(src)?, addr(dst)?, src.len);
                let overlap = s < d + len as CUdeviceptr && d < s + len as CUdeviceptr;
                if len == 0 {
                } else if !overlap {
                    push(NodeSpec::Copy { src: Mem::Device(s), dst: Mem::Device(d), len });
                } else {
                    let fits = scratch.get(&i).is_some_and(|(_, l)| *l >= len);
                    if !fits {
                        let memory = DeviceBox::new(ctx, len).map_err(|e| {
                            LaunchError::Call(e, "allocating scratch memory for an overlapping copy")
                        })?;
                        scratch.insert(i, (memory, len));
                    }
                    let via = scratch[&i].0.ptr;
                    push(NodeSpec::Copy { src: Mem::Device(s), dst: Mem::Device(via), len });
                    push(NodeSpec::Copy { src: Mem::Device(via), dst: Mem::Device(d), len });
                }
            }
            (RecordedOp::Fill { dst, pattern }, _) => {
                let at = addr(dst)?;
                for step in plan_fill(at, dst.len, pattern) {
                    let memset = |o: usize, value: u32, size: u32, count| NodeSpec::Memset {
                        dst: at + o as CUdeviceptr,
                        value,
                        size,
                        count,
                    };
                    push(match step {
                        FillStep::D8 { at: o, value, count } => memset(o, value as u32, 1, count),
                        FillStep::D16 { at: o, value, count } => memset(o, value as u32, 2, count),
                        FillStep::D32 { at: o, value, count } => memset(o, value, 4, count),
                        FillStep::Double { at: o, len } => NodeSpec::Copy {
                            src: Mem::Device(at),
                            dst: Mem::Device(at + o as CUdeviceptr),
                            len,
                        },
                    });
                }
            }
            (RecordedOp::Write { dst, .. }, Payload::Write(pinned)) => {
                if dst.len > 0 {
                    let src = Mem::Host(pinned.as_ptr() as usize);
                    push(NodeSpec::Copy { src, dst: Mem::Device(addr(dst)?), len: dst.len });
                }
            }
            (RecordedOp::Read { src, .. }, Payload::Read(back)) => {
                if src.len > 0 {
                    let dst = Mem::Host(back.staging.as_ptr() as usize);
                    push(NodeSpec::Copy { src: Mem::Device(addr(src)?), dst, len: src.len });
                    push(NodeSpec::Host(Arc::as_ptr(back) as usize));
                }
            }
            (RecordedOp::Marker, _) => {}
            (op, _) => {
                return Err(LaunchError::Invalid(format!(
                    "operation {i} ({}) was recorded without its payload",
                    op.label()
                )))
            }
        }
        if chain.is_empty() {
            chain.push(NodeSpec::Empty);
        }
        for (k, spec) in chain.into_iter().enumerate() {
            let after = match k {
                0 => planned.deps.iter().map(|&d| exits[d as usize]).collect(),
                _ => SmallVec::from_slice(&[nodes.len() as u32 - 1]),
            };
            nodes.push(Node { spec, after });
        }
        exits.push(nodes.len() as u32 - 1);
    }
    Ok(nodes)
}

/// The error of a kernel node whose parameters do not fit its kernel: never made,
/// since recording checked them, but reported as CUDA would rather than panicking.
fn inconsistent(call: &'static str) -> CallError {
    CallError { call, code: sys::CUresult::CUDA_ERROR_INVALID_VALUE }
}

/// A kernel node's parameters, valid while the value lives.
struct KernelParams {
    raw: CUDA_KERNEL_NODE_PARAMS,
    _params: Params,
    _addresses: Vec<*mut c_void>,
}

fn kernel_params(plan: &Plan, spec: &NodeSpec) -> Option<KernelParams> {
    let NodeSpec::Kernel { op, func, grid, block, shared, pointers, scalars, hidden } = spec else {
        return None;
    };
    let RecordedOp::Kernel { kernel, .. } = &plan.ops[*op as usize].op else {
        return None;
    };
    let mut params = Params::new(&kernel.signature, pointers.to_vec(), scalars, *hidden).ok()?;
    let mut addresses = params.addresses();
    let raw = CUDA_KERNEL_NODE_PARAMS {
        func: *func as sys::CUfunction,
        gridDimX: grid[0],
        gridDimY: grid[1],
        gridDimZ: grid[2],
        blockDimX: block[0],
        blockDimY: block[1],
        blockDimZ: block[2],
        sharedMemBytes: *shared,
        kernelParams: addresses.as_mut_ptr(),
        extra: ptr::null_mut(),
        kern: ptr::null_mut(),
        ctx: ptr::null_mut(),
    };
    Some(KernelParams { raw, _params: params, _addresses: addresses })
}

fn memcpy_params(src: Mem, dst: Mem, len: usize) -> CUDA_MEMCPY3D {
    use CUmemorytype::{CU_MEMORYTYPE_DEVICE as DEVICE, CU_MEMORYTYPE_HOST as HOST};
    let (src_type, src_host, src_device) = match src {
        Mem::Device(d) => (DEVICE, ptr::null(), d),
        Mem::Host(h) => (HOST, h as *const c_void, 0),
    };
    let (dst_type, dst_host, dst_device) = match dst {
        Mem::Device(d) => (DEVICE, ptr::null_mut(), d),
        Mem::Host(h) => (HOST, h as *mut c_void, 0),
    };
    CUDA_MEMCPY3D {
        srcXInBytes: 0,
        srcY: 0,
        srcZ: 0,
        srcLOD: 0,
        srcMemoryType: src_type,
        srcHost: src_host,
        srcDevice: src_device,
        srcArray: ptr::null_mut(),
        reserved0: ptr::null_mut(),
        srcPitch: 0,
        srcHeight: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstZ: 0,
        dstLOD: 0,
        dstMemoryType: dst_type,
        dstHost: dst_host,
        dstDevice: dst_device,
        dstArray: ptr::null_mut(),
        reserved1: ptr::null_mut(),
        dstPitch: 0,
        dstHeight: 0,
        WidthInBytes: len,
        Height: 1,
        Depth: 1,
    }
}

unsafe extern "C" fn read_back(data: *mut c_void) {
    // SAFETY: `data` is a `ReadBack` its command buffer keeps alive while a launch
    // that reaches this node is in flight; staging and destination hold its bytes.
    unsafe {
        let back = &*data.cast::<ReadBack>();
        ptr::copy_nonoverlapping(back.staging.as_ptr(), back.dst.as_ptr(), back.staging.len());
    }
}

/// A CUDA graph, destroyed when dropped, and its nodes in description order.
struct Graph {
    raw: CUgraph,
    handles: Vec<usize>,
    ctx: Arc<Context>,
}

impl Graph {
    /// A graph of `nodes` (each after its predecessors).
    fn build(ctx: &Arc<Context>, plan: &Plan, nodes: &[Node]) -> Result<Self, CallError> {
        let mut raw: CUgraph = ptr::null_mut();
        // SAFETY: valid out-pointer; flags must be 0.
        check("cuGraphCreate", unsafe { sys::cuGraphCreate(&mut raw, 0) })?;
        let mut graph = Graph { raw, handles: Vec::with_capacity(nodes.len()), ctx: ctx.clone() };
        for node in nodes {
            let deps: SmallVec<[CUgraphNode; 4]> =
                node.after.iter().map(|&a| graph.handles[a as usize] as CUgraphNode).collect();
            let (g, d, n) = (graph.raw, deps.as_ptr(), deps.len());
            let mut h: CUgraphNode = ptr::null_mut();
            // SAFETY (all): a live graph; `deps` are nodes of it; the parameter
            // structs live through the call, which copies them.
            match &node.spec {
                spec @ NodeSpec::Kernel { .. } => {
                    let p = kernel_params(plan, spec).ok_or(inconsistent("cuGraphAddKernelNode"))?;
                    check("cuGraphAddKernelNode", unsafe {
                        sys::cuGraphAddKernelNode_v2(&mut h, g, d, n, &p.raw)
                    })
                }
                NodeSpec::Memset { dst, value, size, count } => {
                    let p = CUDA_MEMSET_NODE_PARAMS {
                        dst: *dst,
                        pitch: count * *size as usize,
                        value: *value,
                        elementSize: *size,
                        width: *count,
                        height: 1,
                    };
                    check("cuGraphAddMemsetNode", unsafe {
                        sys::cuGraphAddMemsetNode(&mut h, g, d, n, &p, ctx.raw())
                    })
                }
                NodeSpec::Copy { src, dst, len } => {
                    let p = memcpy_params(*src, *dst, *len);
                    check("cuGraphAddMemcpyNode", unsafe {
                        sys::cuGraphAddMemcpyNode(&mut h, g, d, n, &p, ctx.raw())
                    })
                }
                NodeSpec::Host(back) => {
                    let p = CUDA_HOST_NODE_PARAMS { fn_: Some(read_back), userData: *back as *mut c_void };
                    check("cuGraphAddHostNode", unsafe { sys::cuGraphAddHostNode(&mut h, g, d, n, &p) })
                }
                NodeSpec::Empty => {
                    check("cuGraphAddEmptyNode", unsafe { sys::cuGraphAddEmptyNode(&mut h, g, d, n) })
                }
            }?;
            graph.handles.push(h as usize);
        }
        Ok(graph)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created in `build`, destroyed once; an instance made from it does
        // not need it.
        unsafe {
            let _ = self.ctx.bind();
            let _ = sys::cuGraphDestroy(self.raw);
        }
    }
}

/// An instantiated graph. Its nodes are named by the graph it was instantiated from,
/// which it keeps: kernel nodes are set through them.
pub(crate) struct Instance {
    exec: CUgraphExec,
    graph: Graph,
}

// SAFETY: graph and instance handles are accepted by the driver API from any thread;
// changes to an instance are serialized by its command buffer's slot.
unsafe impl Send for Instance {}
// SAFETY: see above.
unsafe impl Sync for Instance {}

impl Instance {
    fn new(ctx: &Arc<Context>, plan: &Plan, nodes: &[Node]) -> Result<Self, LaunchError> {
        let graph = Graph::build(ctx, plan, nodes)
            .map_err(|e| LaunchError::Call(e, "building the command buffer's graph"))?;
        let mut exec: CUgraphExec = ptr::null_mut();
        // SAFETY: a live graph; valid out-pointer.
        check("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph.raw, 0)
        })
        .map_err(|e| LaunchError::Call(e, "instantiating the command buffer's graph"))?;
        Ok(Self { exec, graph })
    }

    /// Sets each kernel node that differs between `was` and `nodes` (same topology);
    /// how many it set.
    fn set_kernels(&self, plan: &Plan, was: &[Node], nodes: &[Node]) -> Result<u64, CallError> {
        let mut set = 0;
        for (i, (a, b)) in was.iter().zip(nodes).enumerate() {
            if a == b {
                continue;
            }
            let p = kernel_params(plan, &b.spec).ok_or(inconsistent("cuGraphExecKernelNodeSetParams"))?;
            let node = self.graph.handles[i] as CUgraphNode;
            // SAFETY: a live instance and a kernel node of the graph it came from.
            check("cuGraphExecKernelNodeSetParams", unsafe {
                sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node, &p.raw)
            })?;
            set += 1;
        }
        Ok(set)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: instantiated in `new`, destroyed once, after every launch that
        // used it completed (each keeps it until then).
        unsafe {
            let _ = self.graph.ctx.bind();
            let _ = sys::cuGraphExecDestroy(self.exec);
        }
    }
}
