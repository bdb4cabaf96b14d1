//! Configuring and building a runtime: its devices (the defaults and registered
//! backends), its world and schedule, and its scheduler thread.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use gantry_components::{
    Device, Devices, Fusions, GraphPolicy, HandBack, Inbox, Linearizer, QueueCore, QueueFailures,
    SchedulerConfig, Timeline,
};
use gantry_cpu::{CpuConfig, CpuDriver};
use gantry_driver::fusion::FusionCompiler;
use gantry_driver::sync::atomic::Ordering;
use gantry_driver::sync::channel::unbounded;
use gantry_driver::sync::thread;
use gantry_driver::sync::{self, Condvar, Mutex};
use gantry_driver::{Completion, Driver, DriverContext, DriverFactory, MemSpace};
use gantry_host::ClosureFusion;

use super::scheduler::{Core, IdleState, Senders, Shared};
use super::{DeviceId, Runtime};
use crate::error::Result;

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
    profiling: Option<bool>,
    fusion_warnings: Option<usize>,
    fusion_compiler: Option<Compiler>,
    linearizer: Option<Policy>,
    spin: Duration,
    max_pending: usize,
    fusion_cache: usize,
    fuse_unprofitable: bool,
    fusion_window: Option<gantry_driver::fusion::WindowThresholds>,
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

/// How many submitted messages may wait for the scheduler before `submit` waits
/// (in manual mode, flushes): a batch whose records stay in cache until the stages
/// reach them.
const DEFAULT_MAX_PENDING: usize = 1024;

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
            profiling: None,
            fusion_warnings: None,
            fusion_compiler: None,
            linearizer: None,
            spin: sync::SPIN_WINDOW,
            max_pending: DEFAULT_MAX_PENDING,
            fusion_cache: ClosureFusion::DEFAULT_CAPACITY,
            fuse_unprofitable: false,
            fusion_window: None,
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
    /// Whether command graphs keep host tasks in the CPU device's command buffers,
    /// run in place (default `true`), or give each a partition of its own
    /// ([`CpuConfig::record_host_tasks`]).
    pub fn record_host_tasks(mut self, on: bool) -> Self {
        self.cpu.record_host_tasks = on;
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
    /// let t = done.timestamps()?;
    /// assert!(t.started_ns > kernel.timestamps()?.ended_ns);
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
    /// A timeline needs the commands' times: it turns [`RuntimeBuilder::profiling`]
    /// on.
    pub fn timeline(mut self, record: bool) -> Self {
        self.timeline = record;
        self
    }
    /// Whether events record when their commands were submitted, started and ended
    /// ([`Event::timestamps`](crate::Event::timestamps); without it that is
    /// [`Error::ProfilingDisabled`](crate::Error::ProfilingDisabled)), as a SYCL
    /// queue does with `enable_profiling`. Off by default: the clock reads cost 7–11%
    /// of an eager command's host time on the development VM (`docs/PERFORMANCE.md`,
    /// "Timestamps only when profiling"). On by default where a simulated device is configured,
    /// whose times are virtual and cost no clock read, and always with a timeline.
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().profiling(true).build();
    /// let ev = rt.queue().submit(|cg| cg.single_task(|_| {}))?;
    /// ev.wait()?;
    /// let t = ev.timestamps()?;
    /// assert!(t.submitted_ns <= t.started_ns && t.started_ns <= t.ended_ns);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn profiling(mut self, on: bool) -> Self {
        self.profiling = Some(on);
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
    /// Whether the default fusion compiler fuses closure chains it otherwise refuses
    /// as slower fused than unfused (default `false`: the fusion is cancelled with
    /// [`FusionError::Unprofitable`](crate::FusionError::Unprofitable) and the
    /// kernels run unfused, with the same results). On: per-work-item closures fuse
    /// through internalized and shared memory and without barriers, as the DPC++
    /// kernel-fusion design describes, at a cost per access
    /// ([`ClosureFusion::fusing_unprofitable`]). On, every fusion window fuses too,
    /// whatever its size, unless [`RuntimeBuilder::fusion_window`] says otherwise.
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().fuse_unprofitable(true).build();
    /// # drop(rt);
    /// ```
    pub fn fuse_unprofitable(mut self, on: bool) -> Self {
        self.fuse_unprofitable = on;
        self
    }
    /// From which size a fusion window fuses, on every device (default: each
    /// driver's [`Capabilities::fusion_window`](gantry_driver::Capabilities::fusion_window);
    /// on the CPU driver, windows whose first kernel is launch-bound, or keeps its
    /// intermediates in global memory the caches hold, run their kernels as they are
    /// submitted). [`WindowThresholds::ALWAYS`](crate::WindowThresholds::ALWAYS) fuses
    /// every window. Set, it holds whether or not the runtime
    /// [fuses unprofitable forms](RuntimeBuilder::fuse_unprofitable).
    ///
    /// ```
    /// use gantry::{FusionOutcome, FusionProps, Runtime, WindowThresholds};
    /// let rt = Runtime::builder().fusion_window(WindowThresholds::ALWAYS).build();
    /// let q = rt.queue();
    /// let buf = rt.buffer(&[1u32; 64]);
    /// q.start_fusion()?;
    /// for _ in 0..2 {
    ///     q.submit(|cg| {
    ///         let b = cg.elements_mut(&buf);
    ///         cg.parallel_for(64, move |it| *b.elem(it) += 1);
    ///     })?;
    /// }
    /// q.complete_fusion(FusionProps::default())?.wait()?;
    /// assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn fusion_window(mut self, thresholds: gantry_driver::fusion::WindowThresholds) -> Self {
        self.fusion_window = Some(thresholds);
        self
    }
    /// A fusion compiler tried first on every device, for kernels that all have an
    /// image of its kind; each device then tries its driver's compilers
    /// ([`Driver::fusion_compilers`](gantry_driver::Driver::fusion_compilers)) and,
    /// if it runs closure kernels, [`ClosureFusion`].
    pub fn fusion_compiler(mut self, compiler: Arc<dyn FusionCompiler>) -> Self {
        self.fusion_compiler = Some(Compiler(compiler));
        self
    }
    /// How command graphs order their nodes at finalize (default:
    /// [`ReverseDfs`](crate::ReverseDfs), the SYCL graph extension's implementation
    /// design's reverse depth-first order; [`BreadthFirst`](crate::BreadthFirst) is the
    /// alternative it names).
    pub fn linearizer(mut self, policy: Arc<dyn Linearizer>) -> Self {
        self.linearizer = Some(Policy(policy));
        self
    }
    /// How many submitted messages may wait for the scheduler to ingest them before
    /// `submit` waits for it (in manual mode, runs a flush itself), default 1,024: a
    /// producer that submits faster than the scheduler keeps memory bounded instead
    /// of queueing without end, and the stages take its commands in batches that stay
    /// in cache. A larger window lets a bursty producer run further ahead, at a higher
    /// cost per command once the batch outgrows the caches.
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
    /// Registers CUDA device `ordinal` (feature `cuda`): the same as
    /// `.driver(gantry::cuda::factory(ordinal))`. Its queues run kernels with PTX or
    /// CUDA C images; [`RuntimeBuilder::try_build`] returns a typed error where CUDA
    /// or the device is missing.
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().cuda(0).try_build();
    /// if let Err(e) = &rt {
    ///     println!("no CUDA device here: {e}");
    /// }
    /// ```
    #[cfg(feature = "cuda")]
    pub fn cuda(self, ordinal: usize) -> Self {
        self.driver(gantry_cuda::factory(ordinal))
    }
    /// Registers Vulkan physical device `index` (feature `vulkan`): the same as
    /// `.driver(gantry::vulkan::factory(index))`. Its queues run kernels with SPIR-V
    /// or WGSL images; [`RuntimeBuilder::try_build`] returns a typed error where
    /// Vulkan or the device is missing.
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().vulkan(0).try_build();
    /// if let Err(e) = &rt {
    ///     println!("no Vulkan device here: {e}");
    /// }
    /// ```
    #[cfg(feature = "vulkan")]
    pub fn vulkan(self, index: usize) -> Self {
        self.driver(gantry_vulkan::factory(index))
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
        let mailbox = Arc::new(gantry_components::Mailbox::new());
        let (done_tx, done_rx) = unbounded::<Completion>();
        #[cfg(feature = "sim")]
        let simulated = !self.sims.is_empty() || self.machine.host.is_some();
        #[cfg(not(feature = "sim"))]
        let simulated = false;
        // One clock, one profiling rule, for the runtime, the scheduler and every driver.
        let clock = gantry_driver::Clock::starting_now(self.timeline || self.profiling.unwrap_or(simulated));
        let ctx = DriverContext { completions: done_tx, clock };
        let mut drivers: Vec<Arc<dyn Driver>> = vec![Arc::new(CpuDriver::new(self.cpu.clone(), ctx.clone()))];
        #[cfg(feature = "sim")]
        if simulated {
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
        let infos: Vec<_> = devices.iter().map(|d| d.info.clone()).collect();
        let lost = devices.iter().map(|d| d.lost.clone()).collect();
        // Only a scheduler thread of its own frees what user threads allocated.
        let hand_back = (self.mode == Mode::Threaded).then(|| Arc::new(HandBack::new()));
        let inbox =
            Inbox { messages: mailbox.clone(), completions: done_rx.clone(), hand_back: hand_back.clone() };
        let config = SchedulerConfig {
            preserve_on_failure: self.preserve_on_failure,
            clock,
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
        let closure_fusion = ClosureFusion::with_capacity(self.fusion_cache);
        let closure_fusion = Arc::new(if self.fuse_unprofitable {
            closure_fusion.fusing_unprofitable()
        } else {
            closure_fusion
        });
        let closure: Arc<dyn FusionCompiler> = closure_fusion.clone();
        // The forms refused as slower fused were measured on the host's threads; a
        // device whose time is not the host's (the simulated GPU) fuses them all.
        let every_form = ClosureFusion::every_form(&closure_fusion);
        let compilers = world
            .resource::<gantry_components::Devices>()
            .0
            .iter()
            .map(|d| {
                let closure = match d.driver.info().kind {
                    gantry_driver::DeviceKind::Cpu => &closure,
                    _ => &every_form,
                };
                let mut compilers = gantry_components::device_compilers(&*d.driver, closure);
                if let Some(user) = &self.fusion_compiler {
                    compilers.insert(0, user.0.clone());
                }
                compilers
            })
            .collect();
        let fusion_windows: Vec<_> = infos
            .iter()
            .map(|i| match (self.fusion_window, self.fuse_unprofitable) {
                (Some(thresholds), _) => thresholds,
                (None, true) => gantry_driver::fusion::WindowThresholds::ALWAYS,
                (None, false) => i.caps.fusion_window,
            })
            .collect();
        world.insert_resource(Fusions::new(compilers, fusion_windows.clone(), fusion_warnings.clone()));
        if let Some(Policy(linearizer)) = &self.linearizer {
            world.insert_resource(GraphPolicy { linearizer: linearizer.clone() });
        }
        let failures = world.resource::<QueueFailures>().sync.clone();
        let (wake_tx, wake_rx) = unbounded::<()>();
        let shared = Arc::new(Shared {
            id: NEXT_RUNTIME.fetch_add(1, Ordering::Relaxed),
            mode: self.mode,
            mailbox,
            hand_back,
            core: Mutex::new(Some(Core { stages: gantry_systems::Stages::new(&mut world), world })),
            senders: Senders::default(),
            clock,
            next_id: AtomicU64::new(1),
            devices: infos,
            drivers: weak_drivers,
            lost,
            idle: Mutex::new(IdleState { ingested: 0, idle: true }),
            idle_cv: Condvar::new(),
            done_rx,
            wake_tx,
            fusion_warnings,
            closure_fusion: self.fusion_compiler.is_none().then_some(closure_fusion),
            spin: self.spin,
            failure: std::sync::OnceLock::new(),
            system_errors: Mutex::new(Vec::new()),
            max_pending: self.max_pending as u64,
            fusion_windows,
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
