//! # gantry-cpu
//!
//! The CPU driver: Gantry's default device. Closure kernels run work-group by
//! work-group on a thread pool (all phases of one group on one thread, so barriers
//! between phases hold), host tasks run on a separate pool of host threads, and copies
//! and fills run in place. Device memory is host memory.
//!
//! Operations may be submitted before the operations they wait on have finished; the
//! driver keeps a small dependency graph of its own and starts each operation when its
//! wait-list is done, on the thread that finished the last one. Work too small to be
//! worth a thread hop (a single small work-group, a small copy) runs inline there.
//!
//! With `worker_threads == 0` every operation runs inline on the submitting thread, in
//! submission order: fully deterministic, for tests and debugging.
//!
//! Once bound to host memory, kernels, host tasks and command-buffer replays run
//! through `gantry_host`'s [`Runner`], as on the simulated device: this driver decides
//! where and when an operation runs, and how a launch's work-groups spread over its
//! pool.

#![warn(missing_docs)]

mod window;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry_driver::sync::Mutex;
use gantry_driver::{
    fill_bytes, fill_fits, patch_buffer, Accepted, AllocId, Binding, Capabilities, CommandBuffer,
    CommandBufferBuilder, CommandBufferDesc, CommandBufferLaunch, Completion, DeviceInfo, DeviceKind,
    DeviceOp, Driver, DriverContext, ExecError, Geometry, KernelLaunch, MemArg, MemRef, MemSlice, OpHandle,
    OpId, OpPatch, PlanBuilder, RecordedArg, RecordedOp, Submission,
};
use gantry_host::{Arena, BoundOps, CachedPlan, ClosureImage, ClosureKernel, Groups, KernelCall, Runner};
use rayon::prelude::*;
use smallvec::SmallVec;

/// Configuration of the CPU driver.
///
/// ```
/// let config = gantry_cpu::CpuConfig { worker_threads: 2, ..Default::default() };
/// assert_eq!(config.host_threads, 2);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuConfig {
    /// Threads that run kernel work-groups, copies and fills; 0 runs everything inline
    /// on the submitting thread.
    pub worker_threads: usize,
    /// Threads that run host tasks; 0 runs them inline.
    pub host_threads: usize,
    /// Kernels with a single work-group of at most this many work-items, and copies
    /// and fills of at most `inline_items * 4` bytes, run inline on the thread that
    /// made them ready (often the scheduler's): work this small costs less than a
    /// thread hop. Keep it small; a long inline kernel delays scheduling.
    pub inline_items: usize,
    /// Whether command graphs keep host tasks in their neighbours' command buffers,
    /// run in place on the thread replaying the buffer (a host task then replays at
    /// the cost of a recorded operation), instead of giving each one a partition of
    /// its own that runs on the host-task threads like an eager host task (the SYCL
    /// graph extension's implementation design). Off suits host tasks that block
    /// for long: in a buffer they hold its thread.
    pub record_host_tasks: bool,
}

impl Default for CpuConfig {
    fn default() -> Self {
        Self {
            worker_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            host_threads: 2,
            inline_items: 256,
            record_host_tasks: true,
        }
    }
}

/// The CPU driver. See the crate docs.
pub struct CpuDriver {
    inner: Arc<Inner>,
}

struct Inner {
    info: DeviceInfo,
    ctx: DriverContext,
    workers: Option<rayon::ThreadPool>,
    hosts: Option<rayon::ThreadPool>,
    inline_items: usize,
    /// Runs bound operations, with the memory for the copies `preserve_on_failure`
    /// takes before each.
    runner: Runner,
}

/// One submitted operation in the driver's dependency graph.
struct OpNode {
    id: OpId,
    /// Unfinished predecessors, plus one while the submission is being registered.
    pending: AtomicUsize,
    state: Mutex<NodeState>,
}

struct NodeState {
    op: Option<(DeviceOp, bool)>,
    /// Set once the node has completed.
    done: Option<Result<(), ExecError>>,
    successors: SmallVec<[Arc<OpNode>; 2]>,
    dependency_failure: Option<ExecError>,
}

enum Started {
    /// Ran inline with this result and these timestamps.
    Finished(Result<(), ExecError>, u64, u64),
    /// Handed to a pool; it completes the node itself.
    Spawned,
}

fn pool(threads: usize, name: &'static str) -> Option<rayon::ThreadPool> {
    // Under shuttle (`--cfg shuttle`, see `gantry_driver::sync`) every thread must be
    // one of shuttle's, and rayon's are not: the driver runs everything inline, which
    // it may always do.
    let threads = if cfg!(shuttle) { 0 } else { threads };
    (threads > 0).then(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("gantry-{name}-{i}"))
            .build()
            .expect("failed to start CPU driver threads")
    })
}

impl CpuDriver {
    /// Starts the driver's thread pools.
    pub fn new(config: CpuConfig, ctx: DriverContext) -> Self {
        let info = DeviceInfo {
            name: "cpu".into(),
            kind: DeviceKind::Cpu,
            caps: Capabilities {
                shares_host_memory: true,
                in_driver_waits: true,
                image_kinds: gantry_host::IMAGE_KINDS,
                host_tasks: true,
                records_host_tasks: config.record_host_tasks,
                max_local_memory: 1 << 20,
                max_private_memory: MAX_PRIVATE_MEMORY,
                virtual_time: false,
                peer_group: 0,
                fusion_window: window::thresholds(),
            },
        };
        let runner = Runner::new(info.name.clone());
        let inner = Inner {
            info,
            ctx,
            workers: pool(config.worker_threads, "worker"),
            hosts: pool(config.host_threads, "host"),
            inline_items: config.inline_items,
            runner,
        };
        Self { inner: Arc::new(inner) }
    }
}

impl Driver for CpuDriver {
    fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    fn alloc(&self, _bytes: usize) -> Result<AllocId, ExecError> {
        Err(self.inner.unsupported("device allocations (it shares host memory)"))
    }

    fn free(&self, _id: AllocId) {}

    /// Command buffers are [`Plan`](gantry_driver::Plan)s replayed in order on one
    /// thread (kernels still fan out over the pool). Reads into host memory are not
    /// recordable (the "memory buffer read" of the SYCL graph extension's
    /// implementation design, unsupported like on OpenCL backends).
    fn create_command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        let accepts = |op: &RecordedOp| !matches!(op, RecordedOp::Read { .. });
        let wrap = |plan| -> CommandBuffer { Arc::new(CpuPlan::new(plan)) };
        Ok(Box::new(PlanBuilder::new(desc, self.inner.info.name.clone(), accepts, wrap)))
    }

    fn patch_command_buffer(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        // The bound arguments depend only on the argument table and the operations'
        // arguments, which a patch keeps: the next replay need not bind them again.
        let copy = CpuPlan::with_binding;
        let swap = |cpu: &mut CpuPlan| cpu.plan.apply_patches(patch);
        patch_buffer(buffer, copy, swap)
            .ok_or_else(|| self.inner.invalid("a command buffer recorded by another driver".into()))?
            .map_err(|e| self.inner.invalid(e))
    }

    /// LLVM IR kernels' fusion compiler with the feature `jit` (the runtime adds the
    /// closure one).
    fn fusion_compilers(&self) -> Vec<Arc<dyn gantry_driver::fusion::FusionCompiler>> {
        gantry_host::fusion_compilers()
    }

    fn submit(&self, sub: Submission<'_>) -> Result<Accepted, ExecError> {
        let mut waits_done = true;
        for wait in sub.waits {
            let pred = self.inner.node_of(wait)?;
            waits_done &= matches!(pred.state.lock().done, Some(Ok(())));
        }
        // Fast path: nothing to wait for and too small for a thread hop. It runs here,
        // and the scheduler learns the result from the return value: no graph node,
        // no completion message.
        if waits_done && self.inner.pool_for(&sub.op).is_none() {
            let t0 = self.inner.ctx.stamp_ns();
            let result = self.inner.execute(sub.op, sub.preserve_on_failure);
            let t1 = self.inner.ctx.stamp_ns();
            return Ok(Accepted::Done(Completion {
                op: sub.id,
                result,
                started_ns: t0,
                ended_ns: t1,
                lane: 0,
            }));
        }
        let node = Arc::new(OpNode {
            id: sub.id,
            pending: AtomicUsize::new(1),
            state: Mutex::new(NodeState {
                op: Some((sub.op, sub.preserve_on_failure)),
                done: None,
                successors: SmallVec::new(),
                dependency_failure: None,
            }),
        });
        for wait in sub.waits {
            let pred = self.inner.node_of(wait)?;
            let mut ps = pred.state.lock();
            match &ps.done {
                Some(Ok(())) => {}
                Some(Err(e)) => {
                    let failure = e.as_dependency_of(format!("op {}", pred.id.0).into());
                    node.state.lock().dependency_failure.get_or_insert(failure);
                }
                None => {
                    node.pending.fetch_add(1, Ordering::AcqRel);
                    ps.successors.push(node.clone());
                }
            }
        }
        if node.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            Inner::run_ready(&self.inner, node.clone());
        }
        Ok(Accepted::Pending(node))
    }
}

/// A CPU command buffer: the plan, and the bindings of its operations for the argument
/// table it was last replayed with. Host memory does not move, so every replay of a
/// graph after the first reuses them: a replayed operation costs its own work and
/// nothing else.
type CpuPlan = CachedPlan<BoundPlan>;

/// A plan's operations bound to one argument table.
struct BoundPlan {
    /// The table (the key).
    entries: SmallVec<[Binding; 8]>,
    /// Each operation's arguments, or why they cannot be bound.
    ops: BoundOps,
}

/// Resolves host memory to a raw binding.
fn bind(inner: &Inner, mem: &MemSlice) -> Result<Binding, ExecError> {
    match &mem.mem {
        MemRef::Host(storage) => {
            if mem.offset.checked_add(mem.len).is_none_or(|end| end > storage.len()) {
                let (offset, len, size) = (mem.offset, mem.len, storage.len());
                return Err(inner
                    .invalid(format!("slice {offset}..+{len} outside a host allocation of {size} bytes")));
            }
            // SAFETY: offset is within the allocation (checked above).
            Ok(Binding::new(unsafe { storage.as_ptr().add(mem.offset) }, mem.len))
        }
        MemRef::Device(_) => Err(inner.unsupported("device memory")),
    }
}

fn bind_all(inner: &Inner, args: &[MemArg]) -> Result<SmallVec<[Binding; 8]>, ExecError> {
    args.iter().map(|a| bind(inner, &a.mem)).collect()
}

impl Inner {
    fn invalid(&self, message: String) -> ExecError {
        ExecError::Driver { device: self.info.name.clone(), message }
    }

    fn node_of<'h>(&self, handle: &'h OpHandle) -> Result<&'h OpNode, ExecError> {
        handle.downcast_ref::<OpNode>().ok_or_else(|| ExecError::Driver {
            device: self.info.name.clone(),
            message: "wait-list names an operation of another driver".into(),
        })
    }

    /// The pool an operation runs on, or `None` to run it inline.
    fn pool_for(&self, op: &DeviceOp) -> Option<&rayon::ThreadPool> {
        match op {
            DeviceOp::Marker => None,
            DeviceOp::HostTask(_) => self.hosts.as_ref(),
            DeviceOp::Kernel(k) => {
                let small = k.geometry.group_count() == 1 && k.geometry.global_size() <= self.inline_items;
                if small {
                    None
                } else {
                    self.workers.as_ref()
                }
            }
            DeviceOp::CommandBuffer(launch) => match launch.buffer.downcast_ref::<CpuPlan>() {
                Some(cpu) if cpu.plan.work_items <= self.inline_items => None,
                _ => self.workers.as_ref(),
            },
            DeviceOp::Copy { dst, .. } | DeviceOp::Fill { dst, .. } => {
                if dst.len <= self.inline_items * 4 {
                    None
                } else {
                    self.workers.as_ref()
                }
            }
        }
    }

    /// The timeline lane of the current thread: 0 off the pools, `1 + i` for worker
    /// `i`, `1 + workers + j` for host thread `j`.
    fn lane(&self) -> u32 {
        let workers = self.workers.as_ref().map_or(0, |p| p.current_num_threads());
        if let Some(i) = self.workers.as_ref().and_then(|p| p.current_thread_index()) {
            return 1 + i as u32;
        }
        if let Some(j) = self.hosts.as_ref().and_then(|p| p.current_thread_index()) {
            return 1 + (workers + j) as u32;
        }
        0
    }

    fn unsupported(&self, what: &'static str) -> ExecError {
        ExecError::Unsupported { device: self.info.name.clone(), what }
    }

    /// Starts `first` and, iteratively, everything its inline completion makes ready.
    fn run_ready(this: &Arc<Inner>, first: Arc<OpNode>) {
        let mut ready: SmallVec<[Arc<OpNode>; 8]> = SmallVec::new();
        ready.push(first);
        while let Some(node) = ready.pop() {
            if let Started::Finished(result, t0, t1) = Inner::start(this, &node) {
                this.finish(&node, result, t0, t1, &mut ready);
            }
        }
    }

    /// Records the result, reports it and collects successors that became ready.
    fn finish(
        &self,
        node: &OpNode,
        result: Result<(), ExecError>,
        t0: u64,
        t1: u64,
        ready: &mut SmallVec<[Arc<OpNode>; 8]>,
    ) {
        let successors = {
            let mut s = node.state.lock();
            s.done = Some(result.clone());
            std::mem::take(&mut s.successors)
        };
        let lane = self.lane();
        self.ctx.complete(Completion {
            op: node.id,
            result: result.clone(),
            started_ns: t0,
            ended_ns: t1,
            lane,
        });
        for succ in successors {
            if let Err(e) = &result {
                let failure = e.as_dependency_of(format!("op {}", node.id.0).into());
                succ.state.lock().dependency_failure.get_or_insert(failure);
            }
            if succ.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                ready.push(succ);
            }
        }
    }

    /// Runs a node whose wait-list is done, inline or on a pool.
    fn start(this: &Arc<Inner>, node: &Arc<OpNode>) -> Started {
        let (op, preserve, failed) = {
            let mut s = node.state.lock();
            let (op, preserve) = s.op.take().expect("operation started twice");
            (op, preserve, s.dependency_failure.take())
        };
        let t0 = this.ctx.stamp_ns();
        if let Some(e) = failed {
            return Started::Finished(Err(e), t0, t0);
        }
        let spawn_on = this.pool_for(&op);
        match spawn_on {
            None => {
                let result = this.execute(op, preserve);
                Started::Finished(result, t0, this.ctx.stamp_ns())
            }
            Some(pool) => {
                let (this2, node2) = (this.clone(), node.clone());
                pool.spawn(move || {
                    let t0 = this2.ctx.stamp_ns();
                    let result = this2.execute(op, preserve);
                    let mut ready = SmallVec::new();
                    this2.finish(&node2, result, t0, this2.ctx.stamp_ns(), &mut ready);
                    for r in ready {
                        Inner::run_ready(&this2, r);
                    }
                });
                Started::Spawned
            }
        }
    }

    /// Executes one operation on the current thread (kernels fan out over the pool).
    fn execute(&self, op: DeviceOp, preserve: bool) -> Result<(), ExecError> {
        match op {
            DeviceOp::Marker => Ok(()),
            DeviceOp::Copy { src, dst } => {
                let (s, d) = (bind(self, &src)?, bind(self, &dst)?);
                if s.len != d.len {
                    return Err(self.invalid(format!("copy of {} bytes into {} bytes", s.len, d.len)));
                }
                // SAFETY: both ranges are live host memory of the given length; the
                // scheduler orders conflicting commands, and `copy` tolerates overlap.
                unsafe { std::ptr::copy(s.ptr, d.ptr, s.len) };
                Ok(())
            }
            DeviceOp::Fill { dst, pattern } => {
                let d = bind(self, &dst)?;
                if !fill_fits(d.len, &pattern) {
                    return Err(self.invalid(format!(
                        "fill of {} bytes with a {}-byte pattern",
                        d.len,
                        pattern.len()
                    )));
                }
                // SAFETY: live host memory, exclusive by scheduling.
                unsafe { fill_bytes(d.ptr, d.len, &pattern) };
                Ok(())
            }
            DeviceOp::Kernel(launch) => self.run_kernel(&launch, preserve),
            DeviceOp::CommandBuffer(launch) => self.run_plan(&launch, preserve),
            DeviceOp::HostTask(task) => {
                let bindings = bind_all(self, &task.args)?;
                let modes = task.args.iter().map(|a| a.mode);
                // The task's closure is dropped after it ran: a capture whose destructor
                // panics fails the task like a panic in its body.
                // SAFETY: bindings are live host memory (the task's arguments hold it),
                // exclusive to this task by scheduling.
                unsafe {
                    self.runner.run_host_task(task.name, task.tag, task.run, modes, &bindings, preserve)
                }
            }
        }
    }

    fn run_kernel(&self, launch: &KernelLaunch, preserve: bool) -> Result<(), ExecError> {
        let bindings = bind_all(self, &launch.args)?;
        let slots = launch.kernel.closure().map(|c| c.global_slots);
        if slots.is_some_and(|n| n != bindings.len()) {
            return Err(self.invalid(format!(
                "kernel `{}` has {} buffer slots but {} arguments",
                launch.kernel.name,
                slots.unwrap_or_default(),
                bindings.len()
            )));
        }
        let (modes, groups) = (launch.args.iter().map(|a| a.mode), &mut self.workers());
        // SAFETY: bindings are live (the launch's arguments hold the memory) and
        // ordered against other commands by scheduling.
        unsafe {
            let call =
                KernelCall { kernel: &launch.kernel, geometry: &launch.geometry, scalars: &launch.scalars };
            self.runner.run_kernel(call, modes, &bindings, preserve, groups)
        }
    }

    /// Replays a command buffer: its operations in order, each bound to the argument
    /// table. A failed operation skips the operations that depend on it (they fail
    /// with a dependency error) and restores its own written ranges; independent ones
    /// still run. The first error is the replay's.
    fn run_plan(&self, launch: &CommandBufferLaunch, preserve: bool) -> Result<(), ExecError> {
        let cpu = CpuPlan::launched(launch, &self.info.name)?;
        let plan = &cpu.plan;
        let entries = bind_all(self, &launch.args)?;
        let same = |b: &BoundPlan| {
            b.entries.len() == entries.len()
                && b.entries.iter().zip(&entries).all(|(x, y)| x.ptr == y.ptr && x.len == y.len)
        };
        let bound = cpu.bound(same, || {
            let ops = BoundOps::bind(plan, |op, out| {
                for a in op.args() {
                    out.push(self.bind_recorded(&entries, a)?);
                }
                Ok(())
            });
            BoundPlan { entries: entries.clone(), ops }
        });
        // SAFETY: the bindings point into the launch's argument table, whose memory
        // the launch holds, ordered against other commands by scheduling.
        unsafe { self.runner.replay(plan, &bound.ops, preserve, &mut self.workers(), |_| None) }
    }

    fn bind_recorded(&self, entries: &[Binding], a: &RecordedArg) -> Result<Binding, ExecError> {
        a.bind(entries[a.entry as usize]).map_err(|e| self.invalid(e))
    }

    /// How this driver runs a launch's work-groups.
    fn workers(&self) -> Workers<'_> {
        Workers(self.workers.as_ref())
    }
}

/// The CPU driver's work-groups: spread over the worker pool when there is one and
/// the launch has more than one group, else in order on the calling thread, with the thread's arena.
struct Workers<'a>(Option<&'a rayon::ThreadPool>);

impl Groups for Workers<'_> {
    fn run(&mut self, closure: &ClosureKernel, geometry: &Geometry, bindings: &[Binding]) {
        let groups = geometry.group_count();
        match self.0 {
            Some(pool) if groups != 1 => {
                let run = || {
                    (0..groups).into_par_iter().for_each(|g| {
                        with_arena(closure, |arena| closure.run_group(geometry, g, bindings, arena))
                    })
                };
                match rayon::current_thread_index() {
                    None => pool.install(run),
                    Some(_) => run(),
                }
            }
            _ => with_arena(closure, |arena| {
                for g in 0..groups {
                    closure.run_group(geometry, g, bindings, arena);
                }
            }),
        }
    }

    /// Ranges of about a quarter of the groups per worker, so that uneven groups
    /// still balance, spread over the pool; one range inline.
    fn run_ranges(&mut self, groups: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        match self.0 {
            Some(pool) if groups > 1 => {
                let chunk = groups.div_ceil(pool.current_num_threads().max(1) * 4).max(1);
                let run = || {
                    (0..groups.div_ceil(chunk))
                        .into_par_iter()
                        .for_each(|c| f(c * chunk..((c + 1) * chunk).min(groups)))
                };
                match rayon::current_thread_index() {
                    None => pool.install(run),
                    Some(_) => run(),
                }
            }
            _ => f(0..groups),
        }
    }
}

/// The most scratch a thread keeps between launches; a launch that needed more gives
/// it back when it ends.
const KEPT_ARENA_BYTES: usize = 8 << 20;

/// Private memory per work-group a kernel may ask for: the arena holds a group's
/// private regions at once, so a request past this is refused at submit rather than
/// failing (or aborting) the allocation when the kernel runs.
const MAX_PRIVATE_MEMORY: usize = 1 << 30;

thread_local! {
    /// This thread's scratch for work-groups (local and private memory), kept from
    /// launch to launch: a kernel with scratch would otherwise allocate, zero and
    /// fault in its arena anew for every launch inline, and on the pool for every
    /// split of its groups among the workers (hundreds per launch of a 16M-item
    /// fused chain).
    static ARENA: std::cell::RefCell<Arena> = std::cell::RefCell::new(Arena::default());
}

/// Runs `f` with this thread's arena, or with a fresh one where that is in use (a
/// kernel that drives a runtime from inside itself). A kernel without scratch never
/// touches an arena: it gets an empty one, which costs nothing, and most launches (a
/// frame's small kernels) skip the thread-local look-up.
fn with_arena<R>(kernel: &ClosureKernel, f: impl FnOnce(&mut Arena) -> R) -> R {
    if kernel.scratch.is_empty() {
        return f(&mut Arena::default());
    }
    ARENA.with(|cell| match cell.try_borrow_mut() {
        Ok(mut arena) => {
            let out = f(&mut arena);
            if arena.bytes() > KEPT_ARENA_BYTES {
                *arena = Arena::default();
            }
            out
        }
        Err(_) => f(&mut Arena::default()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::sync::channel::unbounded;
    use gantry_driver::{AccessMode, Geometry, HostStorage, NdRange, Range, Scratch, ScratchKind};
    use gantry_host::{phase, Accessor, ClosureKernel, LocalAccessor, ReadWrite};

    fn driver(workers: usize) -> (CpuDriver, gantry_driver::sync::channel::Receiver<Completion>) {
        let (tx, rx) = unbounded();
        let d = CpuDriver::new(
            CpuConfig { worker_threads: workers, host_threads: 1, inline_items: 64, ..Default::default() },
            DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) },
        );
        (d, rx)
    }

    fn add_one(n: usize, storage: &Arc<HostStorage>, name: &str) -> DeviceOp {
        let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
        DeviceOp::Kernel(KernelLaunch {
            kernel: ClosureKernel {
                tag: 1,
                phases: smallvec::smallvec![phase(move |it| {
                    let i = it.global_linear_id();
                    acc.set(it, i, acc.get(it, i) + 1)
                })],
                global_slots: 1,
                scratch: vec![],
                unfused: None,
            }
            .into_kernel(
                name,
                vec![AccessMode::ReadWrite; 1],
                gantry_driver::ItemCost::default(),
            ),
            geometry: Geometry::for_range(Range::d1(n)).unwrap(),
            args: smallvec::smallvec![MemArg {
                mem: MemSlice::host(storage.clone()),
                mode: AccessMode::ReadWrite
            }],
            scalars: Default::default(),
        })
    }

    /// A chain submitted all at once, each link waiting on the previous one in the
    /// driver, applies every increment exactly once, in order.
    #[test]
    fn in_driver_waits_order_a_chain() {
        for workers in [0, 1, 3] {
            let (d, rx) = driver(workers);
            let n = 5000;
            let storage = Arc::new(HostStorage::zeroed(n * 4));
            let mut prev: Option<OpHandle> = None;
            let mut done = Vec::new();
            for i in 0..20 {
                let waits: Vec<OpHandle> = prev.iter().cloned().collect();
                let accepted = d
                    .submit(Submission {
                        id: OpId(i),
                        op: add_one(n, &storage, "inc"),
                        waits: &waits,
                        preserve_on_failure: false,
                        hint: None,
                    })
                    .unwrap();
                prev = match accepted {
                    Accepted::Pending(h) => Some(h),
                    Accepted::Done(c) => {
                        done.push(c.op.0);
                        None
                    }
                };
            }
            assert_eq!(done.is_empty(), workers > 0, "inline only without worker threads");
            while done.len() < 20 {
                done.push(rx.recv().unwrap().op.0);
            }
            assert_eq!(done, (0..20).collect::<Vec<_>>(), "a chain completes in order");
            let v: &[u32] = bytemuck_cast(unsafe { storage.bytes() });
            assert!(v.iter().all(|&x| x == 20), "workers={workers}");
        }
    }

    /// A kernel of 4 groups of 64 over `out` with one local region of `local` u32s:
    /// each work-item stores `local[local_id]` (before writing it) to its element,
    /// then writes 7 there.
    fn local_probe(out: &Arc<HostStorage>, local: usize) -> DeviceOp {
        let n = 256;
        let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
        let tile = LocalAccessor::<u32>::new(0, 1, local);
        DeviceOp::Kernel(KernelLaunch {
            kernel: ClosureKernel {
                tag: 1,
                phases: smallvec::smallvec![phase(move |it| {
                    let (i, l) = (it.global_linear_id(), it.local_id(0));
                    acc.set(it, i, tile.get(it, l));
                    tile.set(it, l, 7);
                })],
                global_slots: 1,
                scratch: vec![Scratch::new(ScratchKind::Local, local * 4)],
                unfused: None,
            }
            .into_kernel(
                "probe",
                vec![AccessMode::ReadWrite; 1],
                gantry_driver::ItemCost::default(),
            ),
            geometry: NdRange::new(n, 64).geometry().unwrap(),
            args: smallvec::smallvec![MemArg {
                mem: MemSlice::host(out.clone()),
                mode: AccessMode::ReadWrite
            }],
            scalars: Default::default(),
        })
    }

    /// Scratch comes from the thread's arena, which outlives a launch: the next launch
    /// still finds its local memory cleared for each group (not the 7s the last one
    /// left), and an arena grown past the cap is given back when its launch ends.
    #[test]
    fn the_thread_arena_is_kept_between_launches_cleared_and_capped() {
        let (d, _rx) = driver(0); // inline: every launch runs on this thread
        let run = |op: DeviceOp| {
            let sub = Submission { id: OpId(1), op, waits: &[], preserve_on_failure: false, hint: None };
            match d.submit(sub).unwrap() {
                Accepted::Done(c) => c.result.unwrap(),
                Accepted::Pending(_) => panic!("without workers a kernel runs inside submit"),
            }
        };
        let out = Arc::new(HostStorage::zeroed(256 * 4));
        for _ in 0..2 {
            run(local_probe(&out, 64));
            let v = bytemuck_cast(unsafe { out.bytes() });
            assert!(v.iter().all(|&x| x == 0), "local memory read before written is zero: {v:?}");
        }
        let kept = ARENA.with(|a| a.borrow().bytes());
        assert!(kept >= 64 * 4, "the arena outlives its launch ({kept} bytes)");
        // A local region larger than the cap: the arena goes when the launch ends.
        let big = KEPT_ARENA_BYTES / 4 + 1024;
        run(local_probe(&out, big));
        assert!(bytemuck_cast(unsafe { out.bytes() }).iter().all(|&x| x == 0));
        assert_eq!(ARENA.with(|a| a.borrow().bytes()), 0, "an arena over the cap is given back");
    }

    fn bytemuck_cast(b: &[u8]) -> &[u32] {
        unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len() / 4) }
    }

    /// A panicking kernel restores its written range and fails its dependents, which
    /// do not run.
    #[test]
    fn failure_restores_and_propagates() {
        let (d, rx) = driver(2);
        let n = 3000;
        let storage = Arc::new(HostStorage::zeroed(n * 4));
        let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
        let bad = DeviceOp::Kernel(KernelLaunch {
            kernel: ClosureKernel {
                tag: 1,
                phases: smallvec::smallvec![phase(move |it| {
                    let i = it.global_linear_id();
                    acc.set(it, i, 99);
                    if i == n - 1 {
                        panic!("boom");
                    }
                })],
                global_slots: 1,
                scratch: vec![],
                unfused: None,
            }
            .into_kernel(
                "bad",
                vec![AccessMode::ReadWrite; 1],
                gantry_driver::ItemCost::default(),
            ),
            geometry: Geometry::for_range(Range::d1(n)).unwrap(),
            args: smallvec::smallvec![MemArg {
                mem: MemSlice::host(storage.clone()),
                mode: AccessMode::ReadWrite
            }],
            scalars: Default::default(),
        });
        let h = d
            .submit(Submission { id: OpId(1), op: bad, waits: &[], preserve_on_failure: true, hint: None })
            .unwrap()
            .handle()
            .expect("a multi-group kernel runs on the pool");
        d.submit(Submission {
            id: OpId(2),
            op: add_one(n, &storage, "after"),
            waits: &[h],
            preserve_on_failure: true,
            hint: None,
        })
        .unwrap();
        let mut results: Vec<Completion> = (0..2).map(|_| rx.recv().unwrap()).collect();
        results.sort_by_key(|c| c.op.0);
        assert!(
            matches!(&results[0].result, Err(ExecError::KernelPanicked { message, .. }) if message == "boom")
        );
        assert!(matches!(&results[1].result, Err(ExecError::DependencyFailed { .. })));
        let v = bytemuck_cast(unsafe { storage.bytes() });
        assert!(v.iter().all(|&x| x == 0), "contents restored, dependent did not run");
    }

    /// A dependent submitted after its predecessor has already failed (the scheduler
    /// hands over a dependent once its predecessor is submitted, and may do so after
    /// it finished) fails with a dependency error naming it, and does not run, whether
    /// it would have run inline or on the pool.
    #[test]
    fn a_dependent_of_an_already_failed_operation_does_not_run() {
        let (d, rx) = driver(2);
        let n = 3000;
        let storage = Arc::new(HostStorage::zeroed(n * 4));
        let bad = DeviceOp::Kernel(KernelLaunch {
            kernel: ClosureKernel {
                tag: 1,
                phases: smallvec::smallvec![phase(move |it| {
                    if it.global_linear_id() == n - 1 {
                        panic!("boom");
                    }
                })],
                global_slots: 0,
                scratch: vec![],
                unfused: None,
            }
            .into_kernel(
                "bad",
                vec![AccessMode::ReadWrite; 0],
                gantry_driver::ItemCost::default(),
            ),
            geometry: Geometry::for_range(Range::d1(n)).unwrap(),
            args: smallvec::smallvec![],
            scalars: Default::default(),
        });
        let sub = Submission { id: OpId(1), op: bad, waits: &[], preserve_on_failure: true, hint: None };
        let h = d.submit(sub).unwrap().handle().expect("a multi-group kernel runs on the pool");
        assert!(rx.recv().unwrap().result.is_err(), "the predecessor failed");
        for (id, items) in [(2, 16), (3, n)] {
            let sub = Submission {
                id: OpId(id),
                op: add_one(items, &storage, "after"),
                waits: std::slice::from_ref(&h),
                preserve_on_failure: true,
                hint: None,
            };
            let result = match d.submit(sub).unwrap() {
                Accepted::Done(c) => c.result,
                Accepted::Pending(_) => rx.recv().unwrap().result,
            };
            match result {
                Err(ExecError::DependencyFailed { dependency, cause }) => {
                    assert_eq!(&*dependency, "op 1");
                    assert!(
                        matches!(&*cause, ExecError::KernelPanicked { message, .. } if message == "boom")
                    );
                }
                r => panic!("{items} items: {r:?}"),
            }
        }
        let v = bytemuck_cast(unsafe { storage.bytes() });
        assert!(v.iter().all(|&x| x == 0), "no dependent ran");
    }
}
