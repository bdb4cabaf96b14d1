//! The runtime: devices, the scheduler's world and schedule, and the thread (or the
//! caller, in manual mode) that runs it.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bevy_ecs::schedule::{IntoScheduleConfigs, Schedule};
use bevy_ecs::system::ScheduleSystem;
use bevy_ecs::world::World;
use bytemuck::Pod;
use gantry_components::{
    BufferCore, Device, Devices, EventShared, EventStatus, FailureSync, Fusions, GraphPolicy, Inbox,
    Linearizer, Message, QueueCore, QueueFailures, SchedulerConfig, Stage, Stats, Timeline, WorkLists,
};
use gantry_cpu::{CpuConfig, CpuDriver};
use gantry_driver::fusion::{CacheStats, ClosureFusion, FusionCompiler};
use gantry_driver::sync::atomic::Ordering;
use gantry_driver::sync::channel::{unbounded, Receiver, Select, Sender};
use gantry_driver::sync::thread::{self, JoinHandle};
use gantry_driver::sync::{self, safety_net, spin_until, Condvar, Mutex};
use gantry_driver::{Completion, DeviceInfo, Driver, DriverContext, DriverFactory, HostStorage, MemSpace};

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::queue::{Queue, QueueOptions};

/// Index of a device: 0 is the CPU (host), further devices follow in the order the
/// builder added them.
pub type DeviceId = u32;

static NEXT_RUNTIME: AtomicU64 = AtomicU64::new(1);

/// Who runs the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A scheduler thread flushes whenever submissions or completions arrive.
    Threaded,
    /// The caller runs [`Runtime::flush`]; waits and host accesses drive the scheduler
    /// on the waiting thread. Deterministic with a deterministic driver.
    Manual,
}

/// Configures and builds a [`Runtime`].
///
/// ```
/// use gantry::{Runtime, Mode};
/// let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).build();
/// assert_eq!(rt.devices().len(), 1);
/// ```
#[derive(Clone, Debug)]
pub struct RuntimeBuilder {
    mode: Mode,
    cpu: CpuConfig,
    #[cfg(feature = "sim")]
    sims: Vec<gantry_sim::SimConfig>,
    #[cfg(feature = "sim")]
    machine: gantry_sim::MachineConfig,
    preserve_on_failure: bool,
    default_device: DeviceId,
    timeline: bool,
    fusion_warnings: Option<usize>,
    fusion_compiler: Option<Compiler>,
    linearizer: Option<Policy>,
    spin: Duration,
    max_pending: usize,
    fusion_cache: usize,
    factories: Vec<Factory>,
}

/// A backend registered on the builder.
#[derive(Clone)]
struct Factory(Arc<dyn DriverFactory>);

impl std::fmt::Debug for Factory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DriverFactory")
    }
}

/// A graph linearization policy chosen by the user.
#[derive(Clone)]
struct Policy(Arc<dyn Linearizer>);

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name())
    }
}

/// A fusion compiler chosen by the user.
#[derive(Clone)]
struct Compiler(Arc<dyn FusionCompiler>);

impl std::fmt::Debug for Compiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FusionCompiler")
    }
}

/// How many fusion warnings appear when neither the builder nor
/// `GANTRY_FUSION_WARNINGS` says.
const DEFAULT_FUSION_WARNINGS: usize = 16;

/// How many submitted commands may wait for the scheduler before `submit` waits.
const DEFAULT_MAX_PENDING: usize = 1 << 16;

/// The most messages one flush ingests.
const INGEST_LIMIT: usize = 4096;

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            mode: Mode::Threaded,
            cpu: CpuConfig::default(),
            #[cfg(feature = "sim")]
            sims: Vec::new(),
            #[cfg(feature = "sim")]
            machine: gantry_sim::MachineConfig::default(),
            preserve_on_failure: true,
            default_device: 0,
            timeline: false,
            fusion_warnings: None,
            fusion_compiler: None,
            linearizer: None,
            spin: sync::SPIN_WINDOW,
            max_pending: DEFAULT_MAX_PENDING,
            fusion_cache: ClosureFusion::DEFAULT_CAPACITY,
            factories: Vec::new(),
        }
    }
}

impl RuntimeBuilder {
    /// Scheduler thread or manual flushing.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }
    /// Threads running kernel work-groups on the CPU device (0: inline, deterministic).
    pub fn worker_threads(mut self, n: usize) -> Self {
        self.cpu.worker_threads = n;
        self
    }
    /// Threads running host tasks (0: inline).
    pub fn host_threads(mut self, n: usize) -> Self {
        self.cpu.host_threads = n;
        self
    }
    /// The whole CPU driver configuration.
    pub fn cpu(mut self, config: CpuConfig) -> Self {
        self.cpu = config;
        self
    }
    /// Adds a simulated device; it gets the next device id (the first one is 1).
    /// All simulated devices of a runtime share one virtual clock (a
    /// [`SimMachine`](gantry_sim::SimMachine)).
    #[cfg(feature = "sim")]
    pub fn sim(mut self, config: gantry_sim::SimConfig) -> Self {
        self.sims.push(config);
        self
    }
    /// What the simulated devices share: device-to-device links, and a modelled host
    /// thread pool. With a pool, it is the device after the last simulated one, and
    /// host tasks submitted to its queues run there in virtual time.
    ///
    /// ```
    /// use gantry::{HostPoolConfig, MachineConfig, Mode, QueueOptions, Runtime, SimConfig};
    /// let rt = Runtime::builder()
    ///     .mode(Mode::Manual)
    ///     .sim(SimConfig { latency_ns: 1_000, ..Default::default() })
    ///     .sim_machine(MachineConfig {
    ///         host: Some(HostPoolConfig { threads: 2, task_ns: 5_000, latency_ns: 500, ..Default::default() }),
    ///         ..Default::default()
    ///     })
    ///     .timeline(true)
    ///     .build();
    /// let gpu = rt.queue_with(QueueOptions { device: 1, in_order: true })?;
    /// let host = rt.queue_with(QueueOptions { device: 2, in_order: false })?;
    /// let data = rt.buffer(&[1u32; 4]);
    /// let kernel = gpu.submit(|cg| {
    ///     let d = cg.read_write(&data);
    ///     cg.parallel_for(4, move |it| d.set(it, it.global_linear_id(), 2));
    /// })?;
    /// let done = host.submit(|cg| {
    ///     let d = cg.host_read(&data);
    ///     cg.host_task(move |ctx| assert_eq!(d.as_slice(ctx), &[2, 2, 2, 2]));
    /// })?;
    /// done.wait()?;
    /// // The task ran on the modelled pool, in virtual time, after the kernel and the
    /// // copy back to host memory: its latency plus its default duration.
    /// let t = done.timestamps();
    /// assert!(t.started_ns > kernel.timestamps().ended_ns);
    /// assert_eq!(t.ended_ns - t.started_ns, 5_500);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn sim_machine(mut self, config: gantry_sim::MachineConfig) -> Self {
        self.machine = config;
        self
    }
    /// Whether a failed command's written ranges are restored, so buffers keep their
    /// last valid contents (default: yes). Turning it off saves a copy of each
    /// command's writable ranges; a failed command then leaves them unspecified.
    pub fn preserve_on_failure(mut self, yes: bool) -> Self {
        self.preserve_on_failure = yes;
        self
    }
    /// How long a thread about to block spins first (default 20 µs): an
    /// [`Event::wait`](crate::Event::wait) in threaded mode, and the scheduler
    /// thread when it runs out of work. Spinning, as GPU runtimes do on a stream,
    /// saves a kernel wake-up on each hand-off of a short frame, at the cost of up to
    /// this much CPU each time a thread would sleep; `Duration::ZERO` blocks at once.
    ///
    /// ```
    /// use std::time::Duration;
    /// let rt = gantry::Runtime::builder().spin_before_blocking(Duration::ZERO).build();
    /// let q = rt.queue();
    /// q.submit(|cg| cg.single_task(|_| {}))?.wait()?;
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn spin_before_blocking(mut self, window: Duration) -> Self {
        self.spin = window;
        self
    }
    /// Records every finished command for [`Runtime::timeline`] and
    /// [`Runtime::chrome_trace`] (default: off; recording costs memory per command).
    pub fn timeline(mut self, record: bool) -> Self {
        self.timeline = record;
        self
    }
    /// How many fusion warnings (early cancellations, refused fusions, dropped
    /// promotions) are printed through `tracing`; 0 silences them. Default: the
    /// `GANTRY_FUSION_WARNINGS` environment variable, else 16.
    pub fn fusion_warnings(mut self, limit: usize) -> Self {
        self.fusion_warnings = Some(limit);
        self
    }
    /// How many fused plans the default fusion compiler caches (default
    /// [`ClosureFusion::DEFAULT_CAPACITY`]); the least recently used goes first, and 0
    /// turns the cache off. [`Runtime::fusion_cache_stats`] counts hits, misses and
    /// evictions.
    pub fn fusion_cache_capacity(mut self, plans: usize) -> Self {
        self.fusion_cache = plans;
        self
    }
    /// The fusion compiler (default: [`ClosureFusion`], which fuses closure kernels).
    pub fn fusion_compiler(mut self, compiler: Arc<dyn FusionCompiler>) -> Self {
        self.fusion_compiler = Some(Compiler(compiler));
        self
    }
    /// How command graphs order their nodes at finalize (default:
    /// [`ReverseDfs`](crate::ReverseDfs), the SYCL graph extension's implementation design's reverse depth-first order;
    /// [`BreadthFirst`](crate::BreadthFirst) is the alternative it names).
    pub fn linearizer(mut self, policy: Arc<dyn Linearizer>) -> Self {
        self.linearizer = Some(Policy(policy));
        self
    }
    /// How many commands may be submitted and not yet finished before `submit` waits
    /// for the scheduler to catch up (default 65,536): a producer that submits faster
    /// than the devices run keeps memory bounded instead of queueing without end.
    /// Submissions from inside a host task or kernel never wait (the work they wait
    /// for could be blocked behind that very task).
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().max_pending_commands(64).build();
    /// let q = rt.queue();
    /// let buf = rt.buffer_zeroed::<u32>(1);
    /// for _ in 0..1_000 {
    ///     q.submit(|cg| cg.fill(&buf, 1))?;
    /// }
    /// q.wait()?;
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn max_pending_commands(mut self, limit: usize) -> Self {
        self.max_pending = limit.max(1);
        self
    }
    /// Registers a backend: its driver is created when the runtime is built and gets
    /// the next device id, after the CPU and the simulated devices, in the order
    /// registered. A factory that fails makes [`RuntimeBuilder::try_build`] return its
    /// error.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use gantry::driver::{Driver, DriverContext, ExecError};
    /// let no_gpu = |_: DriverContext| -> Result<Arc<dyn Driver>, ExecError> {
    ///     Err(ExecError::Unsupported { device: "gpu".into(), what: "this machine" })
    /// };
    /// assert!(gantry::Runtime::builder().driver(no_gpu).try_build().is_err());
    /// ```
    pub fn driver(mut self, factory: impl DriverFactory + 'static) -> Self {
        self.factories.push(Factory(Arc::new(factory)));
        self
    }
    /// The device [`Runtime::queue`] uses (default 0, the CPU).
    pub fn default_device(mut self, device: DeviceId) -> Self {
        self.default_device = device;
        self
    }

    /// Starts the drivers (and the scheduler thread in threaded mode).
    ///
    /// # Panics
    /// If a backend registered with [`RuntimeBuilder::driver`] fails to start
    /// ([`RuntimeBuilder::try_build`] returns the error instead).
    pub fn build(self) -> Runtime {
        self.try_build().unwrap_or_else(|e| panic!("a registered backend failed to start: {e}"))
    }

    /// Starts the drivers (and the scheduler thread in threaded mode), or returns the
    /// error of a registered backend that could not start.
    pub fn try_build(self) -> Result<Runtime> {
        let epoch = Instant::now();
        let (msg_tx, msg_rx) = unbounded::<Message>();
        let (done_tx, done_rx) = unbounded::<Completion>();
        let ctx = DriverContext { completions: done_tx, epoch };
        let mut drivers: Vec<Arc<dyn Driver>> = vec![Arc::new(CpuDriver::new(self.cpu.clone(), ctx.clone()))];
        #[cfg(feature = "sim")]
        if !self.sims.is_empty() || self.machine.host.is_some() {
            let machine = gantry_sim::SimMachine::new(self.machine.clone());
            for config in &self.sims {
                drivers.push(Arc::new(machine.device(config.clone(), ctx.clone())));
            }
            if let Some(pool) = machine.host_pool(ctx.clone()) {
                drivers.push(Arc::new(pool));
            }
        }
        for Factory(factory) in &self.factories {
            drivers.push(factory.create(ctx.clone())?);
        }
        let weak_drivers = drivers.iter().map(Arc::downgrade).collect();
        let devices: Vec<Device> = drivers
            .into_iter()
            .enumerate()
            .map(|(i, driver)| {
                let info = driver.info().clone();
                let space =
                    if info.caps.shares_host_memory { MemSpace::Host } else { MemSpace::Device(i as u32) };
                Device { driver, info, space, lost: Default::default() }
            })
            .collect();
        let infos = devices.iter().map(|d| d.info.clone()).collect();
        let lost = devices.iter().map(|d| d.lost.clone()).collect();
        let inbox = Inbox { messages: msg_rx.clone(), completions: done_rx.clone() };
        let config = SchedulerConfig {
            preserve_on_failure: self.preserve_on_failure,
            epoch,
            ingest_limit: INGEST_LIMIT,
        };
        let mut world = gantry_systems::scheduler_world(Devices(devices), inbox, config);
        if self.timeline {
            world.insert_resource(Timeline::default());
        }
        let warnings = self.fusion_warnings.unwrap_or_else(|| {
            std::env::var("GANTRY_FUSION_WARNINGS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_FUSION_WARNINGS)
        });
        let fusion_warnings = Arc::new(std::sync::atomic::AtomicUsize::new(warnings));
        let closure_fusion = Arc::new(ClosureFusion::with_capacity(self.fusion_cache));
        let compiler = match &self.fusion_compiler {
            Some(c) => c.0.clone(),
            None => closure_fusion.clone(),
        };
        world.insert_resource(Fusions::new(compiler, fusion_warnings.clone()));
        if let Some(Policy(linearizer)) = &self.linearizer {
            world.insert_resource(GraphPolicy { linearizer: linearizer.clone() });
        }
        let failures = world.resource::<QueueFailures>().sync.clone();
        let (wake_tx, wake_rx) = unbounded::<()>();
        let shared = Arc::new(Shared {
            id: NEXT_RUNTIME.fetch_add(1, Ordering::Relaxed),
            mode: self.mode,
            tx: msg_tx,
            core: Mutex::new(Some(Core {
                world,
                schedule: gantry_systems::flush_schedule(),
                user_sections: 0,
            })),
            senders: Senders::default(),
            epoch,
            next_id: AtomicU64::new(1),
            devices: infos,
            drivers: weak_drivers,
            lost,
            idle: Mutex::new(IdleState { ingested: 0, idle: true }),
            idle_cv: Condvar::new(),
            msg_rx,
            done_rx,
            wake_tx,
            fusion_warnings,
            closure_fusion: self.fusion_compiler.is_none().then_some(closure_fusion),
            spin: self.spin,
            failure: std::sync::OnceLock::new(),
            system_errors: Mutex::new(Vec::new()),
            live: AtomicU64::new(0),
            max_pending: self.max_pending as u64,
            fusing: Default::default(),
            failures,
        });
        let default_device = self.default_device.min(shared.devices.len() as u32 - 1);
        let host_queue =
            Arc::new(QueueCore { id: 0, device: 0, in_order: false, entity: Default::default() });
        let thread = (self.mode == Mode::Threaded).then(|| {
            let s = shared.clone();
            thread::Builder::new()
                .name("gantry-scheduler".into())
                .spawn(move || s.scheduler_loop(wake_rx))
                .expect("failed to start the scheduler thread")
        });
        Ok(Runtime { shared, thread, default_device, host_queue })
    }
}

/// The world and its schedule.
pub(crate) struct Core {
    pub(crate) world: World,
    pub(crate) schedule: Schedule,
    /// The stages whose user section the schedule has (a bit per stage).
    user_sections: u32,
}

/// What user handles share with the runtime.
pub(crate) struct Shared {
    pub(crate) id: u64,
    pub(crate) mode: Mode,
    pub(crate) tx: Sender<Message>,
    /// `None` once the runtime has shut down.
    pub(crate) core: Mutex<Option<Core>>,
    /// Admits messages until the runtime drops, and counts them.
    senders: Senders,
    pub(crate) epoch: Instant,
    pub(crate) next_id: AtomicU64,
    pub(crate) devices: Vec<DeviceInfo>,
    /// The drivers, by device id, for work that needs no scheduler (patching a command
    /// graph's command buffers). Weak: the scheduler's world owns them and stops them
    /// when the runtime drops.
    pub(crate) drivers: Vec<std::sync::Weak<dyn Driver>>,
    /// Per device: set by the scheduler once the device is lost.
    pub(crate) lost: Vec<Arc<std::sync::atomic::AtomicBool>>,
    /// What the scheduler thread last saw (threaded mode).
    idle: Mutex<IdleState>,
    idle_cv: Condvar,
    msg_rx: Receiver<Message>,
    done_rx: Receiver<Completion>,
    wake_tx: Sender<()>,
    /// Fusion warnings still to print (shared with the scheduler).
    pub(crate) fusion_warnings: Arc<std::sync::atomic::AtomicUsize>,
    /// The default fusion compiler, for its cache statistics.
    closure_fusion: Option<Arc<ClosureFusion>>,
    /// How long a thread about to block spins first.
    spin: Duration,
    /// Why the scheduler stopped, once it failed: then no flush runs again.
    failure: std::sync::OnceLock<String>,
    /// Failures of user systems not yet taken by [`Runtime::take_system_errors`].
    system_errors: Mutex<Vec<Error>>,
    /// Commands alive in the scheduler after its last flush.
    live: AtomicU64,
    /// Pending commands past which `submit` waits.
    max_pending: u64,
    /// The active fusions, for cancellations at the call.
    pub(crate) fusing: crate::fusing::Fusing,
    /// Failures kept on in-order queues; waits and flushes clear them (`synced`).
    failures: Arc<FailureSync>,
}

/// What every message sent writes. On cache lines of its own: the scheduler thread
/// spins on the receivers beside it in [`Shared`] while it waits for the next
/// message, and a send's read-modify-writes would otherwise take that line away
/// from it, and back, three times per message.
#[derive(Default)]
#[repr(align(128))]
struct Senders {
    gate: Gate,
    /// Messages sent to the scheduler.
    sent: sync::atomic::AtomicU64,
}

/// Admits senders until closed, and counts those between admission and the end of
/// their send. One word, so that admission and closing are ordered by the atomic
/// read-modify-writes themselves: a sender either is refused or is counted before
/// the close, and then [`Gate::wait_for_senders`] waits for its message.
#[derive(Default)]
struct Gate(sync::atomic::AtomicU64);

impl Gate {
    const CLOSED: u64 = 1 << 63;

    /// Admits a sender (call [`Gate::leave`] after the send); false once closed.
    fn enter(&self) -> bool {
        if self.0.fetch_add(1, Ordering::Acquire) & Self::CLOSED == 0 {
            return true;
        }
        self.leave();
        false
    }

    fn leave(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }

    fn close(&self) {
        self.0.fetch_or(Self::CLOSED, Ordering::AcqRel);
    }

    fn is_closed(&self) -> bool {
        self.0.load(Ordering::Acquire) & Self::CLOSED != 0
    }

    /// After [`Gate::close`]: returns once every admitted send has finished. Sends
    /// do not block (the channels are unbounded), so this waits a few instructions.
    fn wait_for_senders(&self) {
        while self.0.load(Ordering::Acquire) != Self::CLOSED {
            thread::yield_now();
        }
    }
}

/// The scheduler thread's last report: messages ingested, and whether it was idle.
struct IdleState {
    ingested: u64,
    idle: bool,
}

/// How one flush left things (read while holding the world).
#[derive(Clone, Copy)]
struct Progress {
    /// Another flush would make progress without new input.
    has_work: bool,
    /// Nothing queued, running on a driver, or waiting in a channel.
    idle: bool,
    /// Messages ingested so far.
    ingested: u64,
}

impl Shared {
    pub(crate) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Where a host task submitted for `device` runs: there if the device runs host
    /// tasks (the CPU, a simulated host pool), else on the CPU.
    pub(crate) fn host_task_device(&self, device: DeviceId) -> DeviceId {
        if self.devices.get(device as usize).is_some_and(|d| d.caps.host_tasks) {
            device
        } else {
            0
        }
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends a message to the scheduler. A submission waits first while more than
    /// the pending limit of messages wait for the scheduler.
    pub(crate) fn send(&self, msg: Message) -> Result<()> {
        if matches!(msg, Message::Submit(_) | Message::SubmitGraph(_)) {
            self.throttle();
        }
        if !self.senders.gate.enter() {
            return Err(self.stopped());
        }
        let sent = self.tx.send(msg).map_err(|_| self.stopped());
        if sent.is_ok() {
            self.senders.sent.fetch_add(1, Ordering::AcqRel);
        }
        self.senders.gate.leave();
        sent
    }

    /// The error for work the runtime no longer takes: why the scheduler failed, or
    /// that the runtime was dropped.
    pub(crate) fn stopped(&self) -> Error {
        match self.failure.get() {
            Some(message) => Error::SchedulerFailed(message.clone()),
            None => Error::RuntimeDropped,
        }
    }

    /// Waits while more submitted messages than the pending limit wait for the
    /// scheduler. Only messages count, not commands the scheduler holds: ingest
    /// takes messages whatever the devices do, so the wait always ends, while a
    /// command may wait for the very thread that submits (a fusion it has yet to
    /// complete, a host access it holds).
    fn throttle(&self) {
        // Measuring the channel costs more than a send: look every 64 messages, so
        // the limit holds within 64.
        if !self.senders.sent.load(Ordering::Relaxed).is_multiple_of(64) {
            return;
        }
        let over = || self.msg_rx.len() as u64 >= self.max_pending;
        if !over() {
            return;
        }
        match self.mode {
            // Nobody else may flush: the submitter does, unless a flush is already
            // running (on another thread, or this one: a host task run inline).
            Mode::Manual => {
                while over() {
                    let Some(mut guard) = self.core.try_lock() else { return };
                    if self.flush_locked(&mut guard).is_none() {
                        return;
                    }
                }
            }
            Mode::Threaded => {
                while over() && self.failure.get().is_none() && !self.senders.gate.is_closed() {
                    thread::yield_now();
                }
            }
        }
    }

    /// Runs the schedule once. `None` if the runtime has shut down or failed.
    fn flush_once(&self) -> Option<Progress> {
        let mut guard = self.core.lock();
        self.flush_locked(&mut guard)
    }

    /// [`Shared::flush_once`] with the core's lock held. A user system that fails is
    /// reported and the flush goes on; a failure of the scheduler's own systems stops
    /// it for good ([`Shared::fail`]).
    fn flush_locked(&self, guard: &mut Option<Core>) -> Option<Progress> {
        if self.failure.get().is_some() {
            return None;
        }
        let core = guard.as_mut()?;
        let report = gantry_systems::faults::run_flush(&mut core.schedule, &mut core.world);
        if !report.user.is_empty() {
            core.world.resource_mut::<Stats>().system_failures += report.user.len() as u64;
            let mut errors = self.system_errors.lock();
            for fault in report.user {
                let stage = fault.user_stage.expect("a user fault names its stage");
                tracing::error!(?stage, "a system added to the flush schedule failed: {}", fault.message);
                errors.push(Error::SystemFailed { stage, message: fault.message });
            }
        }
        if let Some(message) = report.fatal {
            self.fail(&mut core.world, message);
            return None;
        }
        let has_work = core.world.resource::<WorkLists>().has_work() || !self.msg_rx.is_empty();
        let stats = core.world.resource::<Stats>();
        let idle = !has_work && stats.in_driver == 0 && self.done_rx.is_empty();
        self.live.store(stats.live_commands, Ordering::Relaxed);
        Some(Progress { has_work, idle, ingested: stats.messages })
    }

    /// Stops the scheduler after a failure of its own: refuses new work, fails every
    /// command it holds and every message still queued, and wakes every waiter. The
    /// world stays for inspection ([`Runtime::stats`], [`Runtime::with_world`]); no
    /// flush runs on it again.
    fn fail(&self, world: &mut World, message: String) {
        tracing::error!("the Gantry scheduler failed and stops: {message}");
        let _ = self.failure.set(message.clone());
        self.senders.gate.close();
        self.senders.gate.wait_for_senders();
        let error = gantry_driver::ExecError::SchedulerFailed { message };
        let abandoned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gantry_systems::retire::abandon_all(world, error.clone())
        }));
        if abandoned.is_err() {
            tracing::error!(
                "failing the scheduler's commands failed too; waits end on the scheduler's failure"
            );
        }
        while let Ok(msg) = self.msg_rx.try_recv() {
            gantry_components::fail_message(msg, &error);
        }
        let mut state = self.idle.lock();
        state.idle = true;
        state.ingested = u64::MAX;
        self.idle_cv.notify_all();
    }

    /// Blocks until a message or completion (or a wake-up) arrives, or `timeout`
    /// passes; `None` waits for input without a timeout.
    fn block_for_input(&self, wake: Option<&Receiver<()>>, timeout: Option<Duration>) {
        let mut sel = Select::new();
        sel.recv(&self.msg_rx);
        sel.recv(&self.done_rx);
        if let Some(w) = wake {
            sel.recv(w);
        }
        match timeout {
            Some(t) => {
                let _ = sel.ready_timeout(t);
            }
            None => {
                sel.ready();
            }
        }
    }

    /// Blocks until `ev` reaches `status`, driving the scheduler in manual mode; a
    /// synchronization point ([`Shared::synced`]).
    pub(crate) fn wait_for(&self, ev: &EventShared, status: EventStatus) -> Result<()> {
        let waited = self.block_for(ev, status);
        self.synced();
        waited
    }

    /// After a user wait or flush: failures kept on in-order queues reach no command
    /// submitted from now on, as in manual mode, where they retired in a flush before
    /// it (see [`FailureSync`]). Two atomic loads unless some failure is kept.
    pub(crate) fn synced(&self) {
        if let Some(n) = self.failures.unsynced() {
            let _ = self.send(Message::Synced(n));
        }
    }

    fn block_for(&self, ev: &EventShared, status: EventStatus) -> Result<()> {
        if self.mode == Mode::Threaded {
            // A scheduler that fails finishes the events it knows; the check covers
            // one it could not reach, so the wait ends either way.
            let check = safety_net(Duration::from_millis(100));
            if !ev.block_until_or(status, self.spin, check, || self.failure.get().is_some()) {
                return Err(self.stopped());
            }
            return Ok(());
        }
        while ev.status() < status {
            let Some(progress) = self.flush_once() else {
                return if ev.status() >= status { Ok(()) } else { Err(self.stopped()) };
            };
            if ev.status() >= status {
                break;
            }
            if !progress.has_work {
                // Wait for a driver completion or another thread's message. The
                // timeout is needed: another thread's flush may finish our event and
                // consume the input that would have woken us, and nothing else
                // notifies this wait.
                self.block_for_input(None, Some(Duration::from_millis(1)));
            }
        }
        Ok(())
    }

    /// Returns once nothing is queued or running (commands blocked behind a held host
    /// access do not count as running). In threaded mode this waits for the scheduler
    /// thread's report; in manual mode the caller flushes. A synchronization point
    /// ([`Shared::synced`]).
    pub(crate) fn drive_until_idle(&self) -> Result<()> {
        let idle = self.until_idle();
        self.synced();
        idle
    }

    fn until_idle(&self) -> Result<()> {
        if self.failure.get().is_some() {
            return Err(self.stopped());
        }
        if self.mode == Mode::Threaded {
            let target = self.senders.sent.load(Ordering::Acquire);
            let mut state = self.idle.lock();
            while !(state.idle && state.ingested >= target) {
                // Never the core's lock under this one: a failing flush takes this
                // one under the core's.
                if self.failure.get().is_some() {
                    return Err(self.stopped());
                }
                // The scheduler thread updates `state` under this lock after every
                // flush and notifies when idle; once idle it has ingested every
                // message counted in `target` (they were in its channel). The core
                // cannot go meanwhile (`wait_idle` borrows the runtime, and its drop
                // waits here before taking the core), so the timeout is only a
                // safety net.
                match safety_net(Duration::from_millis(50)) {
                    Some(timeout) => {
                        self.idle_cv.wait_for(&mut state, timeout);
                    }
                    None => self.idle_cv.wait(&mut state),
                }
            }
            return Ok(());
        }
        loop {
            let progress = self.flush_once().ok_or_else(|| self.stopped())?;
            if progress.idle {
                return Ok(());
            }
            if !progress.has_work {
                // As in `wait_for`: another thread's flush may take our input.
                self.block_for_input(None, Some(Duration::from_millis(1)));
            }
        }
    }

    fn scheduler_loop(self: Arc<Self>, wake: Receiver<()>) {
        let looped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.flush_loop(&wake)));
        if let Err(payload) = looped {
            // Nothing in the loop outside a flush is expected to panic; if it does,
            // the runtime stops as on a failed flush rather than leave waits hanging.
            let message = gantry_driver::panic_message(&*payload);
            let mut guard = self.core.lock();
            if let Some(core) = guard.as_mut() {
                self.fail(&mut core.world, message);
            }
        }
    }

    fn flush_loop(&self, wake: &Receiver<()>) {
        loop {
            let Some(progress) = self.flush_once() else {
                return;
            };
            {
                let mut state = self.idle.lock();
                state.ingested = progress.ingested;
                state.idle = progress.idle;
                if progress.idle {
                    self.idle_cv.notify_all();
                }
            }
            if progress.has_work {
                continue;
            }
            if self.senders.gate.is_closed() && progress.idle {
                // The flush that found it idle may have run before the last messages
                // admitted before the close: stop only once they are in and taken.
                self.senders.gate.wait_for_senders();
                if self.msg_rx.is_empty() && self.done_rx.is_empty() {
                    return;
                }
                continue;
            }
            // Everything that lets a flush make progress arrives on one of these
            // channels (user messages, driver completions, the shutdown wake-up), and
            // the select returns at once for input sent before it started: the
            // timeout is only a safety net. Input that comes within a short spin
            // (the completion of the work just enqueued, the next submission of a
            // frame) is taken without a sleep and a wake-up.
            let input = || !(self.msg_rx.is_empty() && self.done_rx.is_empty() && wake.is_empty());
            if !spin_until(self.spin, input) {
                self.block_for_input(Some(wake), safety_net(Duration::from_millis(100)));
            }
            while wake.try_recv().is_ok() {}
        }
    }
}

/// A Gantry runtime: its devices, queues and buffers, and the scheduler that runs
/// their commands.
///
/// Dropping it finishes all submitted work that can finish (anything blocked behind
/// a host access the user still holds fails with [`Error::RuntimeDropped`]), then
/// stops the drivers. Handles that outlive it report `RuntimeDropped`.
///
/// ```
/// use gantry::Runtime;
/// let rt = Runtime::new();
/// let q = rt.queue();
/// let data = rt.buffer(&vec![1.0f32; 1024]);
/// q.submit(|cg| {
///     let d = cg.read_write(&data);
///     cg.parallel_for(1024, move |it| {
///         let i = it.global_linear_id();
///         d.set(it, i, d.get(it, i) * 2.0);
///     });
/// })?;
/// assert!(data.to_vec()?.iter().all(|&x| x == 2.0));
/// # Ok::<(), gantry::Error>(())
/// ```
pub struct Runtime {
    pub(crate) shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    pub(crate) default_device: DeviceId,
    pub(crate) host_queue: Arc<QueueCore>,
}

impl Default for Runtime {
    fn default() -> Self {
        Self::new()
    }
}

impl Runtime {
    /// A threaded runtime with the CPU device.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The mode it runs in.
    pub fn mode(&self) -> Mode {
        self.shared.mode
    }

    /// The devices, indexed by [`DeviceId`].
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.shared.devices
    }

    /// An out-of-order queue on the default device.
    pub fn queue(&self) -> Queue {
        self.queue_with(QueueOptions { device: self.default_device, in_order: false })
            .expect("the default device exists")
    }

    /// An in-order queue on the default device: each command depends on the previous.
    pub fn in_order_queue(&self) -> Queue {
        self.queue_with(QueueOptions { device: self.default_device, in_order: true })
            .expect("the default device exists")
    }

    /// A queue with explicit options.
    pub fn queue_with(&self, options: QueueOptions) -> Result<Queue> {
        if options.device as usize >= self.shared.devices.len() {
            return Err(Error::UnknownDevice(options.device));
        }
        let core = Arc::new(QueueCore {
            id: self.shared.next_id(),
            device: options.device,
            in_order: options.in_order,
            entity: Default::default(),
        });
        Ok(Queue::new(core, self.shared.clone()))
    }

    /// A buffer holding a copy of `data`.
    ///
    /// # Panics
    /// If the host cannot allocate its memory ([`Runtime::try_buffer`] returns the
    /// error instead).
    pub fn buffer<T: Pod>(&self, data: &[T]) -> Buffer<T> {
        self.try_buffer(data).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A buffer holding a copy of `data`, or [`Error::OutOfHostMemory`].
    pub fn try_buffer<T: Pod>(&self, data: &[T]) -> Result<Buffer<T>> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let storage =
            HostStorage::try_zeroed(bytes.len()).ok_or(Error::OutOfHostMemory { bytes: bytes.len() })?;
        // SAFETY: at least `bytes.len()` fresh bytes, not yet shared.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), storage.as_ptr(), bytes.len()) };
        Ok(self.make_buffer(storage, data.len()))
    }

    /// A zero-filled buffer of `len` elements.
    ///
    /// # Panics
    /// If its size overflows or the host cannot allocate it
    /// ([`Runtime::try_buffer_zeroed`] returns the error instead).
    pub fn buffer_zeroed<T: Pod>(&self, len: usize) -> Buffer<T> {
        self.try_buffer_zeroed(len).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A zero-filled buffer of `len` elements, or a typed error: its byte size
    /// overflows ([`Error::SizeOverflow`]) or the host cannot allocate it
    /// ([`Error::OutOfHostMemory`]). Never aborts the process.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// assert!(matches!(rt.try_buffer_zeroed::<u64>(usize::MAX / 2), Err(gantry::Error::SizeOverflow { .. })));
    /// assert_eq!(rt.try_buffer_zeroed::<u64>(4)?.to_vec()?, vec![0; 4]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn try_buffer_zeroed<T: Pod>(&self, len: usize) -> Result<Buffer<T>> {
        let elem_size = std::mem::size_of::<T>();
        let overflow = Error::SizeOverflow { what: "buffer", count: len, elem_size };
        let bytes = len.checked_mul(elem_size).filter(|&b| b <= isize::MAX as usize).ok_or(overflow)?;
        let storage = HostStorage::try_zeroed(bytes).ok_or(Error::OutOfHostMemory { bytes })?;
        Ok(self.make_buffer(storage, len))
    }

    fn make_buffer<T: Pod>(&self, storage: HostStorage, len: usize) -> Buffer<T> {
        let core = Arc::new(BufferCore {
            id: self.shared.next_id(),
            bytes: storage.len(),
            storage: Arc::new(storage),
            record: Default::default(),
            dropped: Default::default(),
            promotion: Default::default(),
            recorded: Default::default(),
        });
        Buffer::new(core, len, self.shared.clone(), self.host_queue.clone())
    }

    /// Runs the scheduler's stages once (any mode). In manual mode this is how work
    /// makes progress; waits also flush.
    pub fn flush(&self) {
        let _ = self.shared.flush_once();
        self.shared.synced();
    }

    /// [`Runtime::flush`], reporting what went wrong in it: the first failure of a
    /// system added with [`Runtime::add_system`] (the flush went on without it; all of
    /// them stay in [`Runtime::take_system_errors`]), or
    /// [`Error::SchedulerFailed`] if the scheduler has stopped.
    ///
    /// ```
    /// use gantry::{Error, Mode, Runtime, Stage};
    /// let rt = Runtime::builder().mode(Mode::Manual).build();
    /// rt.add_system(Stage::Retire, || panic!("policy bug"));
    /// assert!(matches!(rt.try_flush(), Err(Error::SystemFailed { stage: Stage::Retire, .. })));
    /// // The runtime goes on.
    /// let buf = rt.buffer_zeroed::<u32>(2);
    /// rt.queue().submit(|cg| cg.fill(&buf, 1))?.wait()?;
    /// assert_eq!(buf.to_vec()?, vec![1, 1]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn try_flush(&self) -> Result<()> {
        let before = self.shared.system_errors.lock().len();
        if self.shared.flush_once().is_none() {
            return Err(self.shared.stopped());
        }
        self.shared.synced();
        match self.shared.system_errors.lock().get(before) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The failures of systems added with [`Runtime::add_system`] since the last
    /// call, oldest first (each also counted in [`Stats::system_failures`]).
    pub fn take_system_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.shared.system_errors.lock())
    }

    /// Why the scheduler stopped, if it failed ([`Error::SchedulerFailed`]): every
    /// command pending then failed, and the runtime takes no more work.
    pub fn failure(&self) -> Option<Error> {
        self.shared.failure.get().map(|m| Error::SchedulerFailed(m.clone()))
    }

    /// Flushes until no submitted command is waiting or running. Inside one of this
    /// runtime's host tasks it is [`Error::SelfDeadlock`]: the runtime is not idle
    /// until the task returns.
    pub fn wait_idle(&self) -> Result<()> {
        if crate::task_scope::inside(self.shared.id) {
            return Err(Error::SelfDeadlock("wait_idle inside a host task of the same runtime".into()));
        }
        self.shared.drive_until_idle()
    }

    /// Scheduler counters.
    pub fn stats(&self) -> Stats {
        self.with_world(|w| *w.resource::<Stats>())
    }

    /// Runs `f` on the scheduler's world (between flushes), for inspection and research.
    pub fn with_world<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        let mut guard = self.shared.core.lock();
        f(&mut guard.as_mut().expect("runtime is alive while its handle exists").world)
    }

    /// Adds a system to a stage of the flush schedule: a custom policy, a tracing or
    /// statistics system. It runs after the stage's built-in system, so it sees that
    /// stage's results (a system in [`Stage::Resolve`] sees the new edges). If it
    /// panics or returns an error, the flush goes on without it and the failure is
    /// reported ([`Runtime::try_flush`], [`Runtime::take_system_errors`]).
    ///
    /// # Panics
    /// If the system's own ordering constraints make the schedule invalid (a cycle).
    ///
    /// ```
    /// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
    /// use gantry::{Runtime, Mode, Stage};
    /// use gantry::ecs::prelude::*;
    ///
    /// let rt = Runtime::builder().mode(Mode::Manual).build();
    /// let flushes = Arc::new(AtomicUsize::new(0));
    /// let f = flushes.clone();
    /// rt.add_system(Stage::Retire, move || { f.fetch_add(1, Ordering::Relaxed); });
    /// rt.flush();
    /// assert_eq!(flushes.load(Ordering::Relaxed), 1);
    /// ```
    pub fn add_system<M>(&self, stage: Stage, system: impl IntoScheduleConfigs<ScheduleSystem, M>) {
        let mut guard = self.shared.core.lock();
        let core = guard.as_mut().expect("runtime is alive while its handle exists");
        let bit = 1 << stage as u32;
        if core.user_sections & bit == 0 {
            gantry_systems::faults::add_user_section(&mut core.schedule, stage);
            core.user_sections |= bit;
        }
        core.schedule.add_systems(system.in_set(stage).in_set(gantry_systems::faults::UserSection(stage)));
        if let Err(e) = core.schedule.initialize(&mut core.world) {
            panic!("system added to {stage:?} breaks the flush schedule: {e}");
        }
    }

    /// The commands finished so far, if the runtime records a timeline
    /// ([`RuntimeBuilder::timeline`]).
    pub fn timeline(&self) -> Option<Timeline> {
        self.with_world(|w| w.get_resource::<Timeline>().cloned())
    }

    /// The recorded timeline as Chrome trace JSON (open it in Perfetto or
    /// `chrome://tracing`): a process per device, a track per driver thread or engine,
    /// a slice per command and a flow arrow per dependency edge. `None` if the
    /// runtime records no timeline.
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().timeline(true).build();
    /// let buf = rt.buffer_zeroed::<u32>(4);
    /// let q = rt.queue();
    /// q.submit(|cg| cg.fill(&buf, 1))?;
    /// q.submit(|cg| cg.fill(&buf, 2))?.wait()?;
    /// let json = rt.chrome_trace().unwrap();
    /// assert!(json.contains("\"traceEvents\""));
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn chrome_trace(&self) -> Option<String> {
        self.timeline().map(|t| crate::trace::chrome_trace(&t, &self.shared.devices))
    }

    /// Writes [`Runtime::chrome_trace`] to `path`.
    pub fn write_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        let json = self.chrome_trace().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "the runtime records no timeline")
        })?;
        std::fs::write(path, json)
    }

    /// Hits, misses, evictions and size of the default fusion compiler's cache (`None` with a compiler
    /// set by [`RuntimeBuilder::fusion_compiler`]).
    pub fn fusion_cache_stats(&self) -> Option<CacheStats> {
        self.shared.closure_fusion.as_ref().map(|c| c.stats())
    }

    /// Nanoseconds since the runtime started (the clock of submission timestamps and
    /// of the CPU device).
    pub fn now_ns(&self) -> u64 {
        self.shared.now_ns()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Refuse new work, so a thread that keeps submitting cannot keep the runtime
        // from going idle, then finish what can finish.
        self.shared.senders.gate.close();
        if crate::task_scope::inside(self.shared.id) {
            // Dropped inside one of its own host tasks (which owned it): waiting for
            // idle here would wait for this task. Another thread finishes the shutdown
            // once the task has returned.
            let (shared, thread) = (self.shared.clone(), self.thread.take());
            let spawned = std::thread::Builder::new()
                .name("gantry-shutdown".into())
                .spawn(move || shutdown(&shared, thread));
            if spawned.is_err() {
                tracing::error!("could not start a thread to finish the runtime's shutdown");
            }
            return;
        }
        shutdown(&self.shared, self.thread.take());
    }
}

/// Finishes a runtime's shutdown once its gate is closed: drains what can finish,
/// stops the scheduler thread and the drivers, and fails what can never run.
fn shutdown(shared: &Shared, thread: Option<JoinHandle<()>>) {
    shared.senders.gate.wait_for_senders();
    let _ = shared.drive_until_idle();
    let _ = shared.wake_tx.send(());
    if let Some(t) = thread {
        let _ = t.join();
    }
    // A send admitted before the close may still be on its way into the channel
    // (the scheduler thread may have stopped before it arrived): the final flush
    // below must see it, or its command would neither run nor fail, and a wait
    // on its event would never return.
    shared.senders.gate.wait_for_senders();
    let mut guard = shared.core.lock();
    if shared.failure.get().is_some() {
        // The scheduler failed: it already failed everything pending.
        return;
    }
    if let Some(mut core) = guard.take() {
        // Apply anything that raced with shutdown, then fail what can never run.
        let report = gantry_systems::faults::run_flush(&mut core.schedule, &mut core.world);
        if let Some(message) = report.fatal {
            shared.fail(&mut core.world, message);
            return;
        }
        gantry_systems::retire::abandon_all(&mut core.world, gantry_driver::ExecError::RuntimeDropped);
    }
}
