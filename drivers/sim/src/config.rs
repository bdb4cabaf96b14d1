//! Configuration: of a simulated device ([`SimConfig`]), of the machine its devices
//! share ([`MachineConfig`]) and of the machine's modelled host thread pool
//! ([`HostPoolConfig`]), and the device's fixed limits.

use crate::cost::CostModel;
use crate::faults::FaultPlan;

/// Configuration of the simulated device.
///
/// ```
/// let config = gantry_sim::SimConfig { latency_ns: 250, ..Default::default() };
/// assert_eq!(config.name, "sim");
/// assert_eq!(config.memory_bytes, 1 << 30);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Device name, reported in [`DeviceInfo::name`](gantry_driver::DeviceInfo::name) and in errors.
    pub name: String,
    /// Virtual duration of every operation, in nanoseconds. Zero is treated as one, so
    /// that a waiter always ends strictly after what it waits on.
    pub latency_ns: u64,
    /// Capacity of device memory: the most bytes live allocations may hold in total.
    pub memory_bytes: usize,
    /// Faults to inject.
    pub faults: FaultPlan,
    /// How long work takes and how much of it can overlap.
    pub cost: CostModel,
    /// Model time only: kernels, copies, fills and command-buffer replays take their
    /// virtual time and complete (or fail by the fault plan) without running, so
    /// device memory keeps what it held and no kernel closure is called. Timelines,
    /// makespans and failures are those of a full run; a scheduling study of
    /// workloads whose kernels have many work-items runs orders of magnitude faster.
    /// Host tasks on a modelled host pool still run.
    ///
    /// ```
    /// use gantry_sim::SimConfig;
    /// let fast = SimConfig { timing_only: true, ..Default::default() };
    /// assert!(!SimConfig::default().timing_only);
    /// # let _ = fast;
    /// ```
    pub timing_only: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            name: "sim".into(),
            latency_ns: 1_000,
            memory_bytes: 1 << 30,
            faults: FaultPlan::default(),
            cost: CostModel::default(),
            timing_only: false,
        }
    }
}

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
/// let ctx = DriverContext { completions: unbounded().0, clock: gantry_driver::Clock::starting_now(true) };
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

/// Largest local (work-group) memory per group, in bytes.
pub(crate) const MAX_LOCAL_MEMORY: usize = 64 << 10;

/// Private memory per work-group the simulated device offers (its kernels run on the
/// host, which allocates it per group).
pub(crate) const MAX_PRIVATE_MEMORY: usize = 1 << 30;
