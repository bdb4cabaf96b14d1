//! The simulated machine: what the simulated devices of one runtime share.
//!
//! Each device keeps its own queue of pending operations and its own engines; the
//! machine holds what makes their timelines one timeline: the virtual clock (the latest
//! end of anything executed on any device, which the scheduler stamps on new commands
//! as the earliest they may start), one allocation table, so that a device can copy
//! straight from a peer's memory over a device-to-device link, and the settings of the
//! modelled host thread pool.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gantry_driver::sync::Mutex;
use gantry_driver::{AllocId, DriverContext, HostStorage};
use rustc_hash::FxHashMap;

use crate::{SimConfig, SimDriver};

/// Distinguishes machines, so that peer groups of different machines never match.
static NEXT_MACHINE: AtomicU64 = AtomicU64::new(1);

/// What the devices of one simulated machine share.
///
/// ```
/// use gantry_driver::{sync::channel::unbounded, Driver, DriverContext};
/// use gantry_sim::{HostPoolConfig, MachineConfig, SimConfig, SimMachine};
/// // GPUs joined by a 50 GB/s link, and four host threads for host tasks that take
/// // 5 µs unless they declare otherwise.
/// let machine = SimMachine::new(MachineConfig {
///     peer_bytes_per_ns: 50.0,
///     host: Some(HostPoolConfig { threads: 4, task_ns: 5_000, ..Default::default() }),
/// });
/// let ctx = DriverContext { completions: unbounded().0, epoch: std::time::Instant::now() };
/// let gpu = machine.device(SimConfig::default(), ctx.clone());
/// let pool = machine.host_pool(ctx).expect("the machine has a host pool");
/// assert_ne!(gpu.info().caps.peer_group, 0, "the link puts the GPUs in a peer group");
/// assert!(pool.info().caps.host_tasks && !gpu.info().caps.host_tasks);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MachineConfig {
    /// Bandwidth of the links between devices, in bytes per nanosecond. Zero: no
    /// direct links, and moves between devices go through host memory.
    pub peer_bytes_per_ns: f64,
    /// The modelled host thread pool that runs host tasks in virtual time, if any
    /// (without one, host tasks run on the real CPU and take no virtual time).
    pub host: Option<HostPoolConfig>,
}

/// The modelled host thread pool: a simulated device that shares host memory, runs
/// host tasks (and host-memory copies and fills) on `threads` threads in virtual time.
#[derive(Clone, Debug, PartialEq)]
pub struct HostPoolConfig {
    /// Threads: how many host tasks run at once.
    pub threads: u32,
    /// Duration of a host task that declares none, in nanoseconds.
    pub task_ns: u64,
    /// Cost of starting a task on a thread, in nanoseconds.
    pub latency_ns: u64,
    /// Host memory bandwidth for copies and fills, in bytes per nanosecond (0: free).
    pub memory_bytes_per_ns: f64,
}

impl Default for HostPoolConfig {
    fn default() -> Self {
        Self { threads: 1, task_ns: 1_000, latency_ns: 0, memory_bytes_per_ns: 0.0 }
    }
}

/// One device allocation, reachable from every device of the machine.
pub(crate) struct Allocation {
    /// The device instance that allocated it.
    pub(crate) owner: u64,
    pub(crate) storage: Arc<HostStorage>,
}

/// A simulated machine: create it, then its devices with [`SimMachine::device`] and
/// [`SimMachine::host_pool`]. Devices of one machine share one virtual clock, so their
/// timestamps compare and dependencies between them cost the right time.
///
/// ```
/// use std::sync::Arc;
/// use gantry_sim::{MachineConfig, SimConfig, SimMachine};
/// let (tx, _rx) = gantry_driver::sync::channel::unbounded();
/// let ctx = gantry_driver::DriverContext { completions: tx, epoch: std::time::Instant::now() };
/// let machine = SimMachine::new(MachineConfig { peer_bytes_per_ns: 25.0, host: None });
/// let gpu0 = machine.device(SimConfig { name: "gpu0".into(), ..Default::default() }, ctx.clone());
/// let gpu1 = machine.device(SimConfig { name: "gpu1".into(), ..Default::default() }, ctx);
/// use gantry_driver::Driver;
/// assert_eq!(gpu0.info().caps.peer_group, gpu1.info().caps.peer_group);
/// assert!(machine.host_pool(gantry_driver::DriverContext {
///     completions: gantry_driver::sync::channel::unbounded().0,
///     epoch: std::time::Instant::now(),
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
            cost: crate::CostModel {
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
