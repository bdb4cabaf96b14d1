//! The simulated machine and its devices.
//!
//! Each device keeps its own queue of pending operations and its own engines; the
//! machine holds what makes their timelines one timeline: the virtual clock (the latest
//! end of anything executed on any device, which the scheduler stamps on new commands
//! as the earliest they may start), one allocation table, so that a device can copy
//! straight from a peer's memory over a device-to-device link, and the settings of the
//! modelled host thread pool.
//!
//! A device ([`SimDriver`]) resolves an operation's memory and its virtual start and
//! end when it is submitted, and executes it in [`Driver::poll`], in virtual-time
//! order, through `gantry_host`'s [`Runner`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use gantry_driver::sync::Mutex;
use gantry_driver::{
    fill_bytes, fill_fits, no_image, Accepted, AccessMode, AllocId, Binding, Capabilities, CommandBuffer,
    CommandBufferBuilder, CommandBufferDesc, Completion, DeviceInfo, DeviceKind, DeviceOp, Driver,
    DriverContext, ExecError, Geometry, HostFn, KernelLaunch, KernelRef, MemRef, OpPatch, ScratchKind,
    SimHint, Submission,
};
use gantry_host::{Arena, ClosureImage, KernelCall, Runner};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::clock::{Node, State};
use crate::config::{MachineConfig, SimConfig, MAX_LOCAL_MEMORY, MAX_PRIVATE_MEMORY};
use crate::cost::{CostModel, Engine, Link};
use crate::faults::{Fault, FaultPlan, Faulting};
use crate::memory::{Allocation, Region};
use crate::plans::PlanWork;

/// Distinguishes machines, so that peer groups of different machines never match.
static NEXT_MACHINE: AtomicU64 = AtomicU64::new(1);

/// A simulated machine: create it, then its devices with [`SimMachine::device`] and
/// [`SimMachine::host_pool`]. Devices of one machine share one virtual clock, so their
/// timestamps compare and dependencies between them cost the right time.
///
/// ```
/// use std::sync::Arc;
/// use gantry_sim::{MachineConfig, SimConfig, SimMachine};
/// let (tx, _rx) = gantry_driver::sync::channel::unbounded();
/// let ctx = gantry_driver::DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
/// let machine = SimMachine::new(MachineConfig { peer_bytes_per_ns: 25.0, host: None });
/// let gpu0 = machine.device(SimConfig { name: "gpu0".into(), ..Default::default() }, ctx.clone());
/// let gpu1 = machine.device(SimConfig { name: "gpu1".into(), ..Default::default() }, ctx);
/// use gantry_driver::Driver;
/// assert_eq!(gpu0.info().caps.peer_group, gpu1.info().caps.peer_group);
/// assert!(machine.host_pool(gantry_driver::DriverContext {
///     completions: gantry_driver::sync::channel::unbounded().0,
///     clock: gantry_driver::Clock::starting_now(true),
/// }).is_none());
/// ```
pub struct SimMachine {
    pub(crate) id: u64,
    pub(crate) config: MachineConfig,
    /// The latest virtual end of any executed operation.
    clock: AtomicU64,
    next_alloc: AtomicU64,
    /// Looked up for every device argument of every operation: Fx, not SipHash.
    pub(crate) memory: Mutex<FxHashMap<AllocId, Allocation>>,
}

impl SimMachine {
    /// A machine with no devices yet, its clock at zero.
    pub fn new(config: MachineConfig) -> Arc<Self> {
        Arc::new(Self {
            id: NEXT_MACHINE.fetch_add(1, Ordering::Relaxed),
            config,
            clock: AtomicU64::new(0),
            next_alloc: AtomicU64::new(0),
            memory: Mutex::new(FxHashMap::default()),
        })
    }

    /// Adds a simulated device.
    pub fn device(self: &Arc<Self>, config: SimConfig, ctx: DriverContext) -> SimDriver {
        SimDriver::on_machine(self.clone(), config, ctx, false)
    }

    /// The modelled host thread pool as a device, if the machine has one. It shares
    /// host memory and runs host tasks; give it to the runtime like any device.
    pub fn host_pool(self: &Arc<Self>, ctx: DriverContext) -> Option<SimDriver> {
        let host = self.config.host.clone()?;
        let config = SimConfig {
            name: "sim-host".into(),
            latency_ns: host.latency_ns,
            cost: CostModel {
                memory_bytes_per_ns: host.memory_bytes_per_ns,
                compute_engines: host.threads.max(1),
                ..Default::default()
            },
            ..Default::default()
        };
        Some(SimDriver::on_machine(self.clone(), config, ctx, true))
    }

    /// The virtual clock: the latest end of anything executed on the machine.
    pub fn now_ns(&self) -> u64 {
        self.clock.load(Ordering::Acquire)
    }

    /// The peer group its devices report (0 without device-to-device links).
    pub(crate) fn peer_group(&self) -> u64 {
        if self.config.peer_bytes_per_ns > 0.0 {
            self.id
        } else {
            0
        }
    }

    pub(crate) fn next_alloc(&self) -> AllocId {
        AllocId(self.next_alloc.fetch_add(1, Ordering::Relaxed))
    }

    /// An operation ended at `ended_ns`.
    pub(crate) fn advance(&self, ended_ns: u64) {
        self.clock.fetch_max(ended_ns, Ordering::AcqRel);
    }
}

/// Distinguishes driver instances, so a wait-list cannot name another driver's node.
pub(crate) static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(0);

/// The simulated device. See the crate docs.
pub struct SimDriver {
    pub(crate) info: DeviceInfo,
    pub(crate) ctx: DriverContext,
    pub(crate) instance: u64,
    /// The machine whose clock and memory it shares.
    pub(crate) machine: Arc<SimMachine>,
    /// The modelled host thread pool: host memory only, host tasks instead of kernels.
    pub(crate) host_pool: bool,
    pub(crate) latency_ns: u64,
    pub(crate) memory_bytes: usize,
    pub(crate) faults: FaultPlan,
    pub(crate) cost: CostModel,
    /// [`SimConfig::timing_only`].
    pub(crate) timing_only: bool,
    pub(crate) state: Mutex<State>,
    /// Held for the whole of a [`Driver::poll`], so polls never interleave; the arena
    /// is the scratch memory every kernel launch reuses.
    pub(crate) poller: Mutex<Arena>,
    /// Runs bound operations, with the memory for the copies `preserve_on_failure`
    /// takes before each.
    pub(crate) runner: Runner,
}

/// A kernel launch and the resolved memory of its global slots. Kept inline in its
/// [`Pending`](crate::pending::Pending) (whose box is reused, so recording a kernel
/// allocates nothing for it); four slots inline, like
/// [`gantry_driver::KernelLaunch::args`].
pub(crate) struct KernelWork {
    pub(crate) kernel: KernelRef,
    pub(crate) geometry: Geometry,
    /// Each slot's memory and how the kernel uses it, in slot order.
    pub(crate) args: SmallVec<[(Region, AccessMode); 4]>,
    /// Its scalar arguments, laid out by its signature.
    pub(crate) scalars: gantry_driver::ScalarBlock,
}

/// A host task with its host memory resolved at submission.
pub(crate) struct HostWork {
    pub(crate) name: Arc<str>,
    pub(crate) tag: u64,
    pub(crate) run: HostFn,
    pub(crate) modes: SmallVec<[AccessMode; 4]>,
    pub(crate) regions: SmallVec<[Region; 4]>,
    /// Its virtual duration.
    pub(crate) ns: u64,
}

/// An operation with its memory resolved at submission.
#[derive(Default)]
pub(crate) enum OpWork {
    #[default]
    Marker,
    Copy {
        src: Region,
        dst: Region,
        /// The link the bytes cross.
        link: Link,
    },
    Fill {
        dst: Region,
        pattern: SmallVec<[u8; 16]>,
    },
    Kernel(KernelWork),
    /// A command-buffer replay (never nested: its steps are single operations).
    Plan(Box<PlanWork>),
    /// A host task on the modelled host pool.
    Host(Box<HostWork>),
    /// An operation that cannot run; it fails with this error at its virtual time.
    Invalid(ExecError),
}

impl SimDriver {
    /// Creates a device with empty memory and its virtual clock at zero, alone on a
    /// machine of its own (see [`SimMachine`] for devices that share one).
    pub fn new(config: SimConfig, ctx: DriverContext) -> Self {
        SimMachine::new(MachineConfig::default()).device(config, ctx)
    }

    pub(crate) fn on_machine(
        machine: Arc<SimMachine>,
        config: SimConfig,
        ctx: DriverContext,
        host_pool: bool,
    ) -> Self {
        let info = DeviceInfo {
            name: config.name.into(),
            kind: DeviceKind::Sim,
            caps: Capabilities {
                shares_host_memory: host_pool,
                in_driver_waits: true,
                image_kinds: if host_pool { &[] } else { gantry_host::IMAGE_KINDS },
                host_tasks: host_pool,
                records_host_tasks: false,
                max_local_memory: if host_pool { 0 } else { MAX_LOCAL_MEMORY },
                max_private_memory: if host_pool { 0 } else { MAX_PRIVATE_MEMORY },
                virtual_time: true,
                peer_group: if host_pool { 0 } else { machine.peer_group() },
                fusion_window: gantry_driver::fusion::WindowThresholds::ALWAYS,
            },
        };
        let runner = Runner::new(info.name.clone());
        Self {
            info,
            ctx,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            machine,
            host_pool,
            latency_ns: config.latency_ns.max(1),
            memory_bytes: config.memory_bytes,
            faults: config.faults,
            cost: config.cost,
            timing_only: config.timing_only,
            state: Mutex::new(State {
                compute_free: vec![0; config.cost.compute_engines as usize],
                copy_free: vec![0; config.cost.copy_engines as usize],
                ..State::default()
            }),
            poller: Mutex::new(Arena::default()),
            runner,
        }
    }

    /// Whether the device is lost.
    pub fn is_lost(&self) -> bool {
        self.state.lock().lost
    }

    pub(crate) fn unsupported(&self, what: &'static str) -> ExecError {
        ExecError::Unsupported { device: self.info.name.clone(), what }
    }

    pub(crate) fn lost(&self) -> ExecError {
        ExecError::DeviceLost { device: self.info.name.clone() }
    }

    pub(crate) fn fault(&self, what: &'static str) -> ExecError {
        ExecError::Fault { device: self.info.name.clone(), what }
    }

    pub(crate) fn driver_error(&self, message: String) -> ExecError {
        ExecError::Driver { device: self.info.name.clone(), message }
    }

    /// Checks a kernel's argument count and local memory against the device.
    pub(crate) fn check_kernel(&self, kernel: &KernelRef, args: usize) -> Result<(), ExecError> {
        if !kernel.runs_on(gantry_host::IMAGE_KINDS) {
            return Err(no_image(&self.info.name, &kernel.name));
        }
        // A closure says what it binds; a kernel of another image, its signature.
        let (slots, scratch) = match kernel.closure() {
            Some(closure) => (closure.global_slots, &closure.scratch[..]),
            None => (kernel.signature.globals.len(), &kernel.signature.memory[..]),
        };
        if args != slots {
            return Err(self.driver_error(format!(
                "kernel `{}` has {slots} global slots but {args} arguments",
                kernel.name
            )));
        }
        let local: usize = scratch.iter().filter(|s| s.kind == ScratchKind::Local).map(|s| s.bytes).sum();
        if local > MAX_LOCAL_MEMORY {
            return Err(self.driver_error(format!(
                "kernel `{}` needs {local} bytes of local memory, the device has {}",
                kernel.name, MAX_LOCAL_MEMORY
            )));
        }
        Ok(())
    }

    /// Checks that a fill's length is a whole number of patterns.
    pub(crate) fn check_fill(&self, len: usize, pattern: &[u8]) -> Result<(), ExecError> {
        if fill_fits(len, pattern) {
            Ok(())
        } else {
            Err(self.driver_error(format!("fill of {len} bytes with a {}-byte pattern", pattern.len())))
        }
    }

    /// Resolves an operation's memory against the allocation table into `work` (an
    /// emptied [`Pending`](crate::pending::Pending)'s), or records why it cannot run.
    /// A kernel's work is built in place; `op` is taken by reference so that a
    /// kernel launch is not moved
    /// (copied) first.
    pub(crate) fn prepare_into(
        &self,
        state: &mut State,
        op: &mut DeviceOp,
        hint: SimHint,
        work: &mut OpWork,
    ) {
        let result = match op {
            DeviceOp::Kernel(launch) if !self.host_pool => self.prepare_kernel(state, launch, work),
            _ => self
                .prepare(state, std::mem::replace(op, DeviceOp::Marker), hint)
                .map(|prepared| *work = prepared),
        };
        if let Err(e) = result {
            *work = OpWork::Invalid(e);
        }
    }

    /// Resolves a kernel launch's arguments into `work` (which may be left half-built
    /// on error).
    pub(crate) fn prepare_kernel(
        &self,
        state: &mut State,
        launch: &KernelLaunch,
        work: &mut OpWork,
    ) -> Result<(), ExecError> {
        self.count_fault(state, Faulting::Kernel)?;
        self.check_kernel(&launch.kernel, launch.args.len())?;
        *work = OpWork::Kernel(KernelWork {
            kernel: launch.kernel.clone(),
            geometry: launch.geometry,
            args: SmallVec::new(),
            scalars: launch.scalars.clone(),
        });
        let OpWork::Kernel(kernel) = work else { unreachable!("just set") };
        // One look-up in the allocation table for all the arguments.
        let mut memory = None;
        for a in &launch.args {
            let host = Some("kernel arguments in host memory");
            kernel.args.push((self.locate_in(&mut memory, &a.mem, host, false)?.0, a.mode));
        }
        Ok(())
    }

    /// Resolves an operation's memory against the allocation table (`hint`: its
    /// submission's timing).
    pub(crate) fn prepare(
        &self,
        state: &mut State,
        op: DeviceOp,
        hint: SimHint,
    ) -> Result<OpWork, ExecError> {
        match op {
            DeviceOp::Marker => Ok(OpWork::Marker),
            DeviceOp::Copy { src, dst } => {
                self.count_fault(state, Faulting::Copy)?;
                if src.len != dst.len {
                    return Err(
                        self.driver_error(format!("copy from {} bytes to {} bytes", src.len, dst.len))
                    );
                }
                let over_host_link = matches!(src.mem, MemRef::Host(_)) || matches!(dst.mem, MemRef::Host(_));
                let (src, from_peer) = self.locate(&src, None, true)?;
                let dst = self.resolve(&dst, None)?;
                let link = if self.host_pool {
                    Link::Local
                } else if over_host_link {
                    Link::Host
                } else if from_peer {
                    Link::Peer
                } else {
                    Link::Local
                };
                Ok(OpWork::Copy { src, dst, link })
            }
            DeviceOp::Fill { dst, pattern } => {
                self.check_fill(dst.len, &pattern)?;
                let host = (!self.host_pool).then_some("fills of host memory");
                let dst = self.resolve(&dst, host)?;
                Ok(OpWork::Fill { dst, pattern })
            }
            DeviceOp::Kernel(_) if self.host_pool => Err(self.unsupported("kernels")),
            DeviceOp::CommandBuffer(_) if self.host_pool => Err(self.unsupported("command buffers")),
            DeviceOp::Kernel(launch) => {
                let mut work = OpWork::Marker;
                self.prepare_kernel(state, &launch, &mut work)?;
                Ok(work)
            }
            DeviceOp::CommandBuffer(launch) => self.prepare_plan(state, launch),
            DeviceOp::HostTask(task) if self.host_pool => {
                let regions =
                    task.args.iter().map(|a| self.resolve(&a.mem, None)).collect::<Result<_, _>>()?;
                let default_ns = self.machine.config.host.as_ref().map_or(0, |h| h.task_ns);
                let ns = hint.host_task_ns.map_or(default_ns, |c| c.max(0.0).ceil() as u64);
                Ok(OpWork::Host(Box::new(HostWork {
                    name: task.name,
                    tag: task.tag,
                    run: task.run,
                    modes: task.args.iter().map(|a| a.mode).collect(),
                    regions,
                    ns,
                })))
            }
            DeviceOp::HostTask(_) => Err(self.unsupported("host tasks")),
        }
    }

    /// Runs one operation on the calling thread.
    pub(crate) fn execute(
        &self,
        work: &mut OpWork,
        preserve: bool,
        arena: &mut Arena,
    ) -> Result<(), ExecError> {
        if self.timing_only && !matches!(work, OpWork::Host(_)) {
            return Self::outcome_without_running(work);
        }
        match work {
            OpWork::Invalid(e) => Err(e.clone()),
            OpWork::Marker => Ok(()),
            OpWork::Copy { src, dst, .. } => {
                let (s, d) = (src.binding(), dst.binding());
                // SAFETY: both regions are bounds-checked, of equal length, and kept
                // alive by their `Arc`s; the scheduler orders conflicting commands and
                // this is the only thread executing on the device. `copy` tolerates
                // overlap (a copy within one allocation).
                unsafe { std::ptr::copy(s.ptr, d.ptr, s.len) };
                Ok(())
            }
            OpWork::Fill { dst, pattern } => {
                let d = dst.binding();
                // SAFETY: bounds-checked live region, its length a multiple of the
                // pattern's (checked at submission); exclusive by scheduling.
                unsafe { fill_bytes(d.ptr, d.len, pattern) };
                Ok(())
            }
            OpWork::Kernel(KernelWork { kernel, geometry, args, scalars }) => {
                let mut bindings = SmallVec::<[Binding; 4]>::new();
                for (region, _) in args.iter() {
                    bindings.push(region.binding());
                }
                let modes = args.iter().map(|&(_, mode)| mode);
                // SAFETY: the bindings are live (held by `args`), and nothing else runs on
                // the device while this kernel does.
                unsafe {
                    let call = KernelCall { kernel, geometry, scalars };
                    self.runner.run_kernel(call, modes, &bindings, preserve, arena)
                }
            }
            OpWork::Plan(plan) => self.replay(plan, preserve, arena),
            OpWork::Host(_) => {
                // The task's closure is dropped after it ran: a capture whose destructor
                // panics fails the task like a panic in its body.
                let OpWork::Host(task) = std::mem::take(work) else { unreachable!("matched") };
                let HostWork { name, tag, run, modes, regions, .. } = *task;
                let bindings: SmallVec<[Binding; 4]> = regions.iter().map(Region::binding).collect();
                // SAFETY: live regions (held by `regions`), exclusive to this task by
                // scheduling.
                unsafe { self.runner.run_host_task(name, tag, run, modes.into_iter(), &bindings, preserve) }
            }
        }
    }

    /// What an operation comes to on a timing-only device: an operation that cannot
    /// run fails as it would, a replay fails with its first injected fault (as its
    /// first failed step would end it), anything else succeeds untouched.
    pub(crate) fn outcome_without_running(work: &OpWork) -> Result<(), ExecError> {
        match work {
            OpWork::Invalid(e) => Err(e.clone()),
            OpWork::Plan(plan) => plan.faulted.first().map_or(Ok(()), |(_, e)| Err(e.clone())),
            _ => Ok(()),
        }
    }
}

impl Driver for SimDriver {
    /// LLVM IR kernels' fusion compiler with the feature `jit` (the runtime adds the
    /// closure one).
    fn fusion_compilers(&self) -> Vec<Arc<dyn gantry_driver::fusion::FusionCompiler>> {
        if self.host_pool {
            return Vec::new();
        }
        gantry_host::fusion_compilers()
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The machine's clock: the latest end of anything executed on any of its devices.
    fn virtual_now_ns(&self) -> u64 {
        self.machine.now_ns()
    }

    fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError> {
        self.allocate(bytes)
    }

    /// Releases `id` at once: it stops counting against the device's capacity and
    /// later submissions cannot name it. Operations already submitted keep the bytes
    /// alive until they have executed. Unknown ids are ignored.
    fn free(&self, id: AllocId) {
        self.release(id)
    }

    /// Command buffers are [`Plan`](gantry_driver::Plan)s of kernels, device copies, fills and markers,
    /// replayed as one operation (see the crate docs). Host↔buffer writes and reads
    /// (the "memory buffer write/read" of the SYCL graph extension's implementation
    /// design) are refused as unsupported, like on that design's OpenCL backend.
    fn create_command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        self.command_buffer(desc)
    }

    fn patch_command_buffer(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        self.patch_plan(buffer, patch)
    }

    fn submit(&self, mut sub: Submission<'_>) -> Result<Accepted, ExecError> {
        if matches!(sub.op, DeviceOp::HostTask(_)) && !self.host_pool {
            return Err(self.unsupported("host tasks"));
        }
        let mut state = self.state.lock();
        // The operation is recorded in place, in an executed one's box.
        let mut op = state.queue.vacant();
        for wait in sub.waits {
            match Arc::clone(wait).downcast::<Node>() {
                Ok(node) if node.instance == self.instance => op.waits.push(node),
                _ => {
                    state.queue.release(op);
                    return Err(self.driver_error("wait-list names an operation of another driver".into()));
                }
            }
        }
        if state.lost {
            state.queue.release(op);
            return Err(self.lost());
        }
        let hint = sub.hint.unwrap_or_default();
        let floor = state.horizon.max(hint.not_before_ns);
        let ready_ns = op.waits.iter().map(|w| w.ended_ns).fold(floor, u64::max);
        self.prepare_into(&mut state, &mut sub.op, hint, &mut op.work);
        let (engine, work_ns) = self.cost_of(&op.work);
        let engines = match engine {
            Engine::Compute => &mut state.compute_free,
            Engine::Copy => &mut state.copy_free,
            Engine::None => &mut Vec::new(),
        };
        // The engine of this class that frees first (ties: the lowest index).
        let slot = (0..engines.len()).min_by_key(|&i| engines[i]);
        let started_ns = slot.map_or(ready_ns, |i| ready_ns.max(engines[i]));
        let ended_ns = started_ns.saturating_add(self.latency_ns).saturating_add(work_ns);
        if let Some(i) = slot {
            engines[i] = ended_ns;
        }
        let lane = match (engine, slot) {
            (Engine::Compute, Some(i)) => 1 + i as u32,
            (Engine::Copy, Some(i)) => 1 + self.cost.compute_engines + i as u32,
            _ => 0,
        };
        let node = state.node(Node {
            instance: self.instance,
            id: sub.id,
            started_ns,
            ended_ns,
            lane,
            done: AtomicBool::new(false),
            failure: OnceLock::new(),
        });
        op.node = Some(node.clone());
        op.preserve = sub.preserve_on_failure;
        state.queue.push(ended_ns, op);
        Ok(Accepted::Pending(node))
    }

    /// Executes every recorded operation, in order of (virtual end, submission), on
    /// the calling thread, including any submitted while it runs.
    fn poll(&self) {
        let mut arena = self.poller.lock();
        let mut state = self.state.lock();
        state.horizon = state.clock;
        while let Some(mut op) = state.queue.pop() {
            let node = op.node.take().expect("queued operations are recorded");
            state.clock = state.clock.max(node.ended_ns);
            self.machine.advance(node.ended_ns);
            let nth = state.executed;
            state.executed += 1;
            if self.faults.has(Fault::DeviceLost { nth }) {
                state.lost = true;
            }
            let lost = state.lost;
            drop(state);
            let failed = op.waits.iter().find_map(|w| {
                assert!(w.done.load(Ordering::Acquire), "a wait-list entry ends before its waiter");
                let e = w.failure.get()?;
                Some(e.as_dependency_of(format!("op {}", w.id.0).into()))
            });
            op.waits.clear();
            let result = match (lost, failed) {
                (true, _) => Err(self.lost()),
                (false, Some(e)) => Err(e),
                (false, None) => self.execute(&mut op.work, op.preserve, &mut arena),
            };
            // The work and its memory go before the completion is reported.
            op.work = OpWork::Marker;
            if let Err(e) = &result {
                let _ = node.failure.set(e.clone());
            }
            node.done.store(true, Ordering::Release);
            self.ctx.complete(Completion {
                op: node.id,
                result,
                started_ns: node.started_ns,
                ended_ns: node.ended_ns,
                lane: node.lane,
            });
            state = self.state.lock();
            // Already empty: no node, no waits, no work.
            state.queue.spare.push(op);
            state.recycle(node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn info_and_config() {
        let (d, _rx) = driver(SimConfig { name: "gpu0".into(), ..Default::default() });
        let info = d.info();
        assert_eq!(&*info.name, "gpu0");
        assert_eq!(info.kind, DeviceKind::Sim);
        assert!(!info.caps.shares_host_memory && !info.caps.host_tasks);
        assert!(
            info.caps.in_driver_waits && info.caps.image_kinds.contains(&gantry_driver::ImageKind::Closure)
        );
        assert_eq!(info.caps.max_local_memory, 64 * 1024);
        assert_eq!(d.now_ns(), 0);
    }

    /// A timing-only device gives the timeline and the failures of a full one (an
    /// injected kernel fault included) without running anything: no kernel closure is
    /// called and no copy or fill touches memory.
    #[test]
    fn timing_only_times_without_running() {
        use std::sync::atomic::AtomicUsize;
        let run = |timing_only: bool| {
            let calls = Arc::new(AtomicUsize::new(0));
            let cost =
                CostModel { item_ns: 2.0, compute_units: 4, link_bytes_per_ns: 8.0, ..Default::default() };
            let faults = FaultPlan::default().with(Fault::Kernel { nth: 1 });
            let (d, rx) = driver(SimConfig { cost, faults, timing_only, ..Default::default() });
            let n = 1000;
            let input = host_u32(&vec![3; n]);
            let output = Arc::new(HostStorage::zeroed(n * 4));
            let buf = d.alloc(n * 4).unwrap();
            let up = submit(&d, 0, copy(host(&input, 0, n * 4), dev(buf, 0, n * 4)), &[]);
            let counted = calls.clone();
            let square = map_kernel("square", n, dev(buf, 0, n * 4), move |x, _| {
                counted.fetch_add(1, Ordering::Relaxed);
                x * x
            });
            let k = submit(&d, 1, square, &[up]);
            // Kernel 1 of the fault plan: it fails without running.
            submit(&d, 2, add(n, dev(buf, 0, n * 4), 1), std::slice::from_ref(&k));
            let fill = DeviceOp::Fill { dst: dev(buf, 0, 16), pattern: smallvec::smallvec![7, 0, 0, 0] };
            let f = submit(&d, 3, fill, &[k]);
            // The read-back does not wait for the faulted kernel (it would fail with it).
            submit(&d, 4, copy(dev(buf, 0, n * 4), host(&output, 0, n * 4)), &[f]);
            d.poll();
            let done: Vec<_> = drain(&rx)
                .into_iter()
                .map(|c| (c.op.0, c.started_ns, c.ended_ns, c.result.is_ok()))
                .collect();
            (done, calls.load(Ordering::Relaxed), read_u32(&output))
        };
        let (full, full_calls, full_out) = run(false);
        let (timed, timed_calls, timed_out) = run(true);
        assert_eq!(timed, full, "same timeline and outcomes");
        assert_eq!(
            full.iter().filter(|c| !c.3).count(),
            1,
            "the injected fault fails kernel 1 alone: {full:?}"
        );
        assert!(full.iter().any(|c| c.2 > 1_000), "the cost model shaped the times: {full:?}");
        assert_eq!((full_calls, timed_calls), (1000, 0), "only the full run called the kernel");
        assert_eq!(&full_out[4..8], &[9, 9, 9, 9]);
        assert_eq!(full_out[0], 7, "the fill ran");
        assert!(timed_out.iter().all(|&x| x == 0), "nothing reached host memory");
    }

    /// A dependent chain handed over in one batch runs link by link, each starting
    /// where the previous one ended.
    #[test]
    fn chain_in_one_batch_runs_in_order() {
        let (d, rx) = sim();
        let n = 64;
        let buf = d.alloc(n * 4).unwrap();
        let mut prev: Vec<OpHandle> = vec![];
        for i in 0..10u64 {
            // Each link multiplies by 2 and adds its index: order-sensitive.
            let k = map_kernel("link", n, dev(buf, 0, n * 4), move |x, _| x * 2 + i as u32);
            prev = vec![submit(&d, i, k, &prev)];
        }
        let out = Arc::new(HostStorage::zeroed(n * 4));
        submit(&d, 10, copy(dev(buf, 0, n * 4), host(&out, 0, n * 4)), &prev);
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), (0..=10).collect::<Vec<_>>());
        for (i, c) in done.iter().enumerate() {
            assert_eq!((c.started_ns, c.ended_ns), (i as u64 * 1000, (i as u64 + 1) * 1000));
        }
        let expect = (0..10u32).fold(0, |x, i| x * 2 + i);
        assert!(read_u32(&out).iter().all(|&x| x == expect));
    }

    /// What a run reports: (op, result, start, end) per completion, and the output data.
    type Run = (Vec<(u64, Result<(), ExecError>, u64, u64)>, Vec<u32>);

    fn scenario() -> Run {
        let (d, rx) = driver(SimConfig { latency_ns: 777, ..Default::default() });
        let n = 100;
        let input = host_u32(&(0..n as u32).collect::<Vec<_>>());
        let out = Arc::new(HostStorage::zeroed(n * 4));
        let buf = d.alloc(n * 4).unwrap();
        let other = d.alloc(n * 4).unwrap();
        let up = submit(&d, 0, copy(host(&input, 0, n * 4), dev(buf, 0, n * 4)), &[]);
        let fill = submit(
            &d,
            1,
            DeviceOp::Fill { dst: dev(other, 0, n * 4), pattern: 7u32.to_ne_bytes().into_iter().collect() },
            &[],
        );
        let k1 = submit(&d, 2, add(n, dev(buf, 0, n * 4), 3), std::slice::from_ref(&up));
        let k2 = submit(&d, 3, add(n, dev(other, 0, n * 4), 1), &[fill, up]);
        submit(&d, 4, DeviceOp::Marker, &[]);
        d.poll();
        let k3 = submit(&d, 5, copy(dev(other, 0, 40), dev(buf, 0, 40)), &[k1, k2]);
        submit(&d, 6, DeviceOp::Marker, &[]);
        submit(&d, 7, copy(dev(buf, 0, n * 4), host(&out, 0, n * 4)), &[k3]);
        d.poll();
        let done = drain(&rx).into_iter().map(|c| (c.op.0, c.result, c.started_ns, c.ended_ns)).collect();
        (done, read_u32(&out))
    }

    /// Two identical runs give identical completions, timestamps and data.
    #[test]
    fn runs_are_deterministic() {
        let first = scenario();
        let second = scenario();
        assert_eq!(first, second);
        assert_eq!(first.0.len(), 8);
        assert!(first.0.iter().all(|c| c.1.is_ok()), "{:?}", first.0);
        let expect: Vec<u32> = (0..100).map(|i| if i < 10 { 8 } else { i + 3 }).collect();
        assert_eq!(first.1, expect);
    }

    #[test]
    fn host_tasks_are_refused() {
        let (d, rx) = sim();
        let task = HostTask { name: "t".into(), tag: 0, run: Box::new(|_| {}), args: smallvec::smallvec![] };
        let r = d.submit(Submission {
            id: OpId(0),
            op: DeviceOp::HostTask(task),
            waits: &[],
            preserve_on_failure: false,
            hint: None,
        });
        assert!(matches!(r, Err(ExecError::Unsupported { what: "host tasks", .. })));
        d.poll();
        assert!(drain(&rx).is_empty(), "a refused submission never completes");
    }

    /// On the host pool, a host task's closure is dropped right after it ran (as on the
    /// CPU driver: both run host tasks through `gantry_host::Runner`): a captured
    /// value whose destructor panics fails the task, the panic contained.
    #[test]
    fn a_host_task_whose_capture_panics_on_drop_fails() {
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("bomb");
            }
        }
        let machine = SimMachine::new(MachineConfig { host: Some(Default::default()), ..Default::default() });
        let (tx, rx) = unbounded();
        let pool = machine
            .host_pool(DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) })
            .unwrap();
        let bomb = Bomb;
        let body = gantry_driver::contain::Contained::new(move |_: &gantry_driver::HostCtx<'_>| {
            let _ = &bomb;
        });
        let task = HostTask {
            name: "t".into(),
            tag: 0,
            run: Box::new(move |ctx| (*body)(ctx)),
            args: smallvec::smallvec![],
        };
        submit(&pool, 0, DeviceOp::HostTask(task), &[]);
        pool.poll();
        let done = drain(&rx);
        match &done[0].result {
            Err(ExecError::HostTaskPanicked { task, message }) => {
                assert_eq!((&**task, &**message), ("t", "bomb"))
            }
            other => panic!("expected HostTaskPanicked, got {other:?}"),
        }
    }

    /// Wait-lists must name this driver's operations.
    #[test]
    fn foreign_handles_are_refused() {
        let (d, _rx) = sim();
        let (other, _rx2) = sim();
        let theirs = submit(&other, 0, DeviceOp::Marker, &[]);
        let not_a_node: OpHandle = Arc::new(5u32);
        for bad in [theirs, not_a_node] {
            let r = d.submit(Submission {
                id: OpId(1),
                op: DeviceOp::Marker,
                waits: &[bad],
                preserve_on_failure: false,
                hint: None,
            });
            assert!(matches!(r, Err(ExecError::Driver { .. })));
        }
    }

    /// A panicking kernel reports `KernelPanicked`, restores the device range it wrote
    /// (with `preserve_on_failure`), and fails its dependents, which do not run. The
    /// failure is still seen by an operation that waits on it after it executed.
    #[test]
    fn kernel_panic_restores_and_propagates() {
        let (d, rx) = sim();
        let n = 2500;
        let input = host_u32(&vec![5; n]);
        let out = Arc::new(HostStorage::zeroed(n * 4));
        let buf = d.alloc(n * 4).unwrap();
        let up = submit(&d, 0, copy(host(&input, 0, n * 4), dev(buf, 0, n * 4)), &[]);
        let bad = map_kernel("bad", n, dev(buf, 0, n * 4), move |_, i| {
            if i == n - 1 {
                panic!("boom");
            }
            99
        });
        let bad = d
            .submit(Submission { id: OpId(1), op: bad, waits: &[up], preserve_on_failure: true, hint: None })
            .unwrap()
            .handle()
            .unwrap();
        submit(&d, 2, add(n, dev(buf, 0, n * 4), 1), std::slice::from_ref(&bad));
        d.poll();
        let done = drain(&rx);
        assert!(done[0].result.is_ok());
        match &done[1].result {
            Err(ExecError::KernelPanicked { kernel, message }) => {
                assert_eq!((&**kernel, message.as_str()), ("bad", "boom"));
            }
            other => panic!("expected KernelPanicked, got {other:?}"),
        }
        match &done[2].result {
            Err(e @ ExecError::DependencyFailed { dependency, .. }) => {
                assert_eq!(&**dependency, "op 1");
                assert!(matches!(e.root_cause(), ExecError::KernelPanicked { .. }));
            }
            other => panic!("expected DependencyFailed, got {other:?}"),
        }
        // Waiting on the failed kernel after it executed also fails.
        submit(&d, 3, copy(dev(buf, 0, n * 4), host(&out, 0, n * 4)), &[bad]);
        submit(&d, 4, copy(dev(buf, 0, n * 4), host(&out, 0, n * 4)), &[]);
        d.poll();
        let mut done = drain(&rx);
        done.sort_by_key(|c| c.op.0);
        assert!(matches!(&done[0].result, Err(ExecError::DependencyFailed { .. })));
        assert!(done[1].result.is_ok());
        assert!(read_u32(&out).iter().all(|&x| x == 5), "restored, dependent did not run");
    }

    /// Without `preserve_on_failure`, a panicking kernel leaves what it wrote.
    #[test]
    fn kernel_panic_without_preserve_keeps_partial_writes() {
        let (d, rx) = sim();
        let n = 8;
        let out = Arc::new(HostStorage::zeroed(n * 4));
        let buf = d.alloc(n * 4).unwrap();
        let bad = map_kernel("bad", n, dev(buf, 0, n * 4), |_, i| if i == 4 { panic!("half") } else { 1 });
        let k = submit(&d, 0, bad, &[]);
        drop(k);
        submit(&d, 1, copy(dev(buf, 0, n * 4), host(&out, 0, n * 4)), &[]);
        d.poll();
        let done = drain(&rx);
        assert!(matches!(&done[0].result, Err(ExecError::KernelPanicked { .. })));
        assert_eq!(read_u32(&out), [1, 1, 1, 1, 0, 0, 0, 0]);
    }

    /// Kernels asking for more local memory than the device has fail.
    #[test]
    fn local_memory_limit() {
        let (d, rx) = sim();
        let buf = d.alloc(16).unwrap();
        for (id, bytes) in [(0, 64 * 1024), (1, 64 * 1024 + 1)] {
            let DeviceOp::Kernel(mut launch) = add(4, dev(buf, 0, 16), 1) else { unreachable!() };
            launch.kernel = ClosureKernel {
                tag: 1,
                phases: launch.kernel.closure().unwrap().phases.clone(),
                global_slots: 1,
                scratch: vec![Scratch::new(ScratchKind::Local, bytes)],
                unfused: None,
            }
            .into_kernel(
                "tiled",
                vec![AccessMode::ReadWrite; 1],
                gantry_driver::ItemCost::default(),
            );
            submit(&d, id, DeviceOp::Kernel(launch), &[]);
        }
        d.poll();
        let done = drain(&rx);
        assert!(done[0].result.is_ok());
        assert!(matches!(&done[1].result, Err(ExecError::Driver { .. })));
    }
}
