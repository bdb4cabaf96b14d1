//! # gantry-sim
//!
//! The simulated device: a deterministic virtual device with memory of its own and a
//! virtual clock, for testing the scheduler against a backend that behaves like a
//! discrete GPU (separate memory, explicit host↔device copies, asynchronous
//! completions that may arrive out of submission order) while staying reproducible.
//!
//! # Model
//!
//! * **Memory.** [`Driver::alloc`] creates a zeroed allocation in the driver's own
//!   table; [`MemRef::Device`] names one. Copies may move bytes between host and
//!   device memory in either direction (or within either); kernels and fills may only
//!   bind device memory. The total of live allocations is capped by
//!   [`SimConfig::memory_bytes`].
//! * **Time.** An operation takes [`SimConfig::latency_ns`] plus what the
//!   [`CostModel`] charges for its work: work-items over compute units (at the
//!   kernel's declared per-item cost or the device's default), bytes over memory or
//!   link bandwidth, whichever is slower. It starts at the latest of: its
//!   [`Submission::not_before_ns`] (the scheduler's stamp: when the dependencies
//!   outside its wait-list ended, and the machine's clock when it was submitted), the
//!   device's clock when the latest poll began, the end of everything in its
//!   wait-list, and the moment an engine of its class (compute for kernels and fills,
//!   copy for copies) is free. With the default model (no per-item or per-byte cost,
//!   unlimited engines) every operation takes exactly the latency and independent ones
//!   overlap freely.
//! * **Machine.** Devices of one [`SimMachine`] share its clock, so their timestamps
//!   compare and a dependency between devices costs what it should. With
//!   [`MachineConfig::peer_bytes_per_ns`] they also share a peer group: a copy reads a
//!   peer's memory straight over the device-to-device link. A [`HostPoolConfig`] adds
//!   the modelled host thread pool, a device in host memory that runs host tasks (at
//!   their declared duration or the pool's default) on its threads in virtual time.
//! * **Execution.** [`Driver::submit`] only records an operation. [`Driver::poll`] runs
//!   every recorded operation on the calling thread in order of (virtual end time,
//!   submission order), advancing the virtual clock to each one's end and reporting
//!   its completion with its virtual start and end. A waiter always ends strictly after
//!   what it waits on, so this order respects every wait-list, and completion order
//!   can differ from submission order.
//! * **Command buffers.** [`Driver::create_command_buffer`] records a [`Plan`]
//!   (kernels, device copies, fills and markers; host↔buffer writes and reads are
//!   refused). A replay ([`DeviceOp::CommandBuffer`]) is one operation to the rest of
//!   the driver: it resolves its argument table at submission, occupies one engine
//!   (compute if the plan has a kernel or fill, else copy) and takes the latency
//!   *once* plus the sum of what the cost model charges each recorded operation, then
//!   runs the operations in plan order with the memory rules of individual operations.
//!
//! Nothing depends on wall-clock time or thread scheduling: the same submissions and
//! polls produce the same completions, in the same order, with the same timestamps.

#![warn(missing_docs)]

mod machine;

pub use machine::{HostPoolConfig, MachineConfig, SimMachine};

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use gantry_driver::sync::{Mutex, MutexGuard};
use gantry_driver::{
    fill_bytes, fill_fits, no_image, patch_buffer, Accepted, AccessMode, AllocId, Binding, Capabilities,
    CommandBuffer, CommandBufferBuilder, CommandBufferDesc, CommandBufferLaunch, Completion, DeviceInfo,
    DeviceKind, DeviceOp, Driver, DriverContext, ExecError, Geometry, HostFn, HostStorage, ImageKind,
    KernelLaunch, KernelRef, MemRef, MemSlice, OpId, OpPatch, Plan, PlanBuilder, RecordedArg, RecordedOp,
    ScratchKind, Submission,
};
use gantry_host::{Arena, BoundOps, CachedPlan, ClosureImage, Runner};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

/// Configuration of the simulated device.
///
/// ```
/// let config = gantry_sim::SimConfig { latency_ns: 250, ..Default::default() };
/// assert_eq!(config.name, "sim");
/// assert_eq!(config.memory_bytes, 1 << 30);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Device name, reported in [`DeviceInfo::name`] and in errors.
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

/// The simulated device's cost model. Zero means free (costs) or unlimited (engines).
///
/// ```
/// use gantry_sim::CostModel;
/// // A small discrete GPU: 64 lanes at 1 ns per work-item, 500 GB/s of memory,
/// // a 25 GB/s host link, one compute and two copy engines.
/// let gpu = CostModel {
///     item_ns: 1.0,
///     compute_units: 64,
///     memory_bytes_per_ns: 500.0,
///     link_bytes_per_ns: 25.0,
///     compute_engines: 1,
///     copy_engines: 2,
/// };
/// assert_eq!(gpu.kernel_ns(6400, &gantry_driver::ItemCost::default(), 0), 100);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostModel {
    /// Cost of one work-item when the kernel declares none, in nanoseconds.
    pub item_ns: f64,
    /// Work-items that run at once.
    pub compute_units: u32,
    /// Device memory bandwidth, in bytes per nanosecond (GB/s): bounds kernels (by the
    /// bytes their arguments span), fills and device-to-device copies.
    pub memory_bytes_per_ns: f64,
    /// Host↔device link bandwidth, in bytes per nanosecond: bounds copies with one
    /// side in host memory.
    pub link_bytes_per_ns: f64,
    /// Kernels and fills that may run at once.
    pub compute_engines: u32,
    /// Copies that may run at once.
    pub copy_engines: u32,
}

fn per(bytes: usize, bytes_per_ns: f64) -> f64 {
    if bytes_per_ns > 0.0 {
        bytes as f64 / bytes_per_ns
    } else {
        0.0
    }
}

impl CostModel {
    /// Virtual time of a kernel's work (beyond the fixed latency): compute or memory,
    /// whichever bounds it.
    pub fn kernel_ns(&self, items: usize, cost: &gantry_driver::ItemCost, bytes: usize) -> u64 {
        let lanes = self.compute_units.max(1) as f64;
        let compute = items as f64 * cost.resolve(self.item_ns) / lanes;
        compute.max(per(bytes, self.memory_bytes_per_ns)).ceil() as u64
    }
    /// Virtual time of a copy of `bytes`, over the link when one side is host memory.
    pub fn copy_ns(&self, bytes: usize, over_link: bool) -> u64 {
        let bw = if over_link { self.link_bytes_per_ns } else { self.memory_bytes_per_ns };
        per(bytes, bw).ceil() as u64
    }
    /// Virtual time of a fill of `bytes`.
    pub fn fill_ns(&self, bytes: usize) -> u64 {
        per(bytes, self.memory_bytes_per_ns).ceil() as u64
    }
}

/// Which engines an operation occupies.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Engine {
    Compute,
    Copy,
    #[default]
    None,
}

/// One planned fault. Counts start at 0 and count only this device's operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The `nth` kernel submitted fails without running. Kernels recorded in a command
    /// buffer count once per replay, at the replay's submission, in plan order; the
    /// faulted kernel fails inside the replay like a panicking one would.
    Kernel {
        /// Which kernel.
        nth: u64,
    },
    /// The `nth` copy (including memory moves) fails without copying. Copies recorded
    /// in a command buffer count like kernels recorded in one.
    Copy {
        /// Which copy.
        nth: u64,
    },
    /// The `nth` allocation fails with [`ExecError::OutOfMemory`].
    Alloc {
        /// Which allocation.
        nth: u64,
    },
    /// The device is lost when its `nth` operation executes: that operation and every
    /// later one fail with [`ExecError::DeviceLost`], and so do later submissions and
    /// allocations. A command-buffer replay is one operation.
    DeviceLost {
        /// Which operation.
        nth: u64,
    },
}

/// The classes of operations that fail by count (each with its own counter and its
/// own random draws).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Faulting {
    Kernel = 0,
    Copy = 1,
}

impl Faulting {
    /// The planned fault of the `nth` operation of the class.
    fn fault(self, nth: u64) -> Fault {
        match self {
            Faulting::Kernel => Fault::Kernel { nth },
            Faulting::Copy => Fault::Copy { nth },
        }
    }
    /// Whether a planned fault targets an operation of this class.
    fn targeted_by(self, fault: Fault) -> bool {
        matches!(
            (self, fault),
            (Faulting::Kernel, Fault::Kernel { .. }) | (Faulting::Copy, Fault::Copy { .. })
        )
    }
    fn what(self) -> &'static str {
        match self {
            Faulting::Kernel => "kernel launch failed",
            Faulting::Copy => "copy failed",
        }
    }
}

/// Which faults a simulated device injects: an explicit list, and optionally random
/// kernel and copy failures drawn from a seed (the same seed fails the same
/// operations).
///
/// ```
/// use gantry_sim::{Fault, FaultPlan};
/// let plan = FaultPlan::default().with(Fault::Kernel { nth: 2 }).seeded(7, 10, 0);
/// assert_eq!(plan.faults.len(), 1);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Planned faults.
    pub faults: Vec<Fault>,
    /// Seed of the random faults.
    pub seed: u64,
    /// Chance, in thousandths, that a kernel fails.
    pub kernel_per_mille: u32,
    /// Chance, in thousandths, that a copy fails.
    pub copy_per_mille: u32,
}

impl FaultPlan {
    /// Adds a planned fault.
    pub fn with(mut self, fault: Fault) -> Self {
        self.faults.push(fault);
        self
    }
    /// Adds random kernel and copy failures drawn from `seed`.
    pub fn seeded(mut self, seed: u64, kernel_per_mille: u32, copy_per_mille: u32) -> Self {
        self.seed = seed;
        self.kernel_per_mille = kernel_per_mille;
        self.copy_per_mille = copy_per_mille;
        self
    }
    fn has(&self, fault: Fault) -> bool {
        self.faults.contains(&fault)
    }
    /// Whether any operation of `class` can fail (else a replay only counts them).
    fn may_fail(&self, class: Faulting) -> bool {
        self.per_mille(class) > 0 || self.faults.iter().any(|&f| class.targeted_by(f))
    }
    fn per_mille(&self, class: Faulting) -> u32 {
        match class {
            Faulting::Kernel => self.kernel_per_mille,
            Faulting::Copy => self.copy_per_mille,
        }
    }
    /// Whether the `nth` operation of `class` fails: planned, or drawn.
    fn strikes(&self, class: Faulting, nth: u64) -> bool {
        self.has(class.fault(nth)) || self.draws(class as u64 + 1, nth, self.per_mille(class))
    }
    /// Whether the `nth` operation of a class (`salt`) draws a failure at `per_mille`.
    fn draws(&self, salt: u64, nth: u64, per_mille: u32) -> bool {
        if per_mille == 0 {
            return false;
        }
        // splitmix64 of (seed, class, index): independent, reproducible draws.
        let mut z =
            self.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ nth.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        z % 1000 < per_mille as u64
    }
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

/// Largest local (work-group) memory per group, in bytes.
const MAX_LOCAL_MEMORY: usize = 64 << 10;

/// Private memory per work-group the simulated device offers (its kernels run on the
/// host, which allocates it per group).
const MAX_PRIVATE_MEMORY: usize = 1 << 30;

/// Distinguishes driver instances, so a wait-list cannot name another driver's node.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(0);

/// The simulated device. See the crate docs.
pub struct SimDriver {
    info: DeviceInfo,
    ctx: DriverContext,
    instance: u64,
    /// The machine whose clock and memory it shares.
    machine: Arc<SimMachine>,
    /// The modelled host thread pool: host memory only, host tasks instead of kernels.
    host_pool: bool,
    latency_ns: u64,
    memory_bytes: usize,
    faults: FaultPlan,
    cost: CostModel,
    /// [`SimConfig::timing_only`].
    timing_only: bool,
    state: Mutex<State>,
    /// Held for the whole of a [`Driver::poll`], so polls never interleave; the arena
    /// is the scratch memory every kernel launch reuses.
    poller: Mutex<Arena>,
    /// Runs bound operations, with the memory for the copies `preserve_on_failure`
    /// takes before each.
    runner: Runner,
}

/// Everything that changes on submission, allocation and execution.
#[derive(Default)]
struct State {
    /// The device's clock: the end of the last operation it executed.
    clock: u64,
    /// The clock when the latest poll began: an operation submitted since then reacts
    /// to completions reported no earlier, so it never starts before it.
    horizon: u64,
    /// Bytes held by live allocations (in the machine's table).
    allocated: usize,
    /// Recorded, not yet executed operations, in order of (virtual end, submission).
    queue: PendingQueue,
    /// Kernels and copies (indexed by [`Faulting`]) and allocations so far, and
    /// operations executed (fault plans count these).
    counted: [u64; 2],
    allocs: u64,
    executed: u64,
    /// Set once the device is lost.
    lost: bool,
    /// When each compute and copy engine is next free (empty: unlimited engines).
    compute_free: Vec<u64>,
    copy_free: Vec<u64>,
    /// Executed nodes, oldest first, whose allocations new submissions reuse once
    /// nothing else holds them (the scheduler drops its handle when it retires the
    /// command): a submission then allocates nothing.
    spare: VecDeque<Arc<Node>>,
}

/// One submitted operation, as the scheduler holds it (its [`gantry_driver::OpHandle`]).
struct Node {
    /// The driver instance it was submitted to.
    instance: u64,
    id: OpId,
    started_ns: u64,
    ended_ns: u64,
    /// The engine that runs it: 1.. for compute engines, then copy engines; 0 when
    /// engines are unlimited or it needs none.
    lane: u32,
    /// Set once the operation has executed (or failed without running).
    done: AtomicBool,
    /// Why it failed, if it did: set before `done`.
    failure: OnceLock<ExecError>,
}

/// Executed nodes kept for reuse (see [`State::spare`]) at most.
const SPARE_NODES: usize = 4096;

impl State {
    /// `node` in an allocation of its own: the oldest spare one if nothing else holds
    /// it any more (else that one goes to the back, to be looked at again later), or
    /// a new one.
    fn node(&mut self, node: Node) -> Arc<Node> {
        if let Some(mut spare) = self.spare.pop_front() {
            if let Some(slot) = Arc::get_mut(&mut spare) {
                *slot = node;
                return spare;
            }
            self.spare.push_back(spare);
        }
        Arc::new(node)
    }

    /// Keeps an executed node for reuse, once the scheduler and its waiters let go of
    /// it; up to [`SPARE_NODES`] of them.
    fn recycle(&mut self, node: Arc<Node>) {
        if self.spare.len() < SPARE_NODES {
            self.spare.push_back(node);
        }
    }
}

/// A recorded operation waiting for [`Driver::poll`], in a box that the queue reuses:
/// executing it empties it (no node, [`Work::Marker`], no waits), so that nodes never
/// keep their predecessors alive, and the next operation fills it in place.
#[derive(Default)]
struct Pending {
    node: Option<Arc<Node>>,
    work: Work,
    preserve: bool,
    waits: SmallVec<[Arc<Node>; 4]>,
}

/// A bucket of [`PendingQueue`]: operations with one virtual end, in submission order.
type Bucket = VecDeque<Box<Pending>>;

/// Recorded operations, taken in order of (virtual end, submission). Each waits in a
/// box of its own, so that queueing it moves a pointer and executing it moves none
/// of it; executed operations leave their boxes for new ones (once the queue has been
/// as long before, recording an operation allocates nothing).
///
/// Operations with the same virtual end share a bucket, a FIFO in submission order
/// (submissions push under the state lock, so appending keeps it in order), and a
/// min-heap orders the distinct ends. With the default cost model every operation
/// takes the latency and a batch ends at few distinct times, so the bucket being
/// drained is kept out of the map and taking the next operation usually pops a deque,
/// where a heap of all the operations cost a sift through all its levels.
#[derive(Default)]
struct PendingQueue {
    /// The distinct ends of queued operations: each has a non-empty bucket, in
    /// `buckets` or `front`.
    ends: BinaryHeap<Reverse<u64>>,
    /// The buckets by end, but for `front`'s.
    buckets: FxHashMap<u64, Bucket>,
    /// The bucket being drained and its end; empty when there is none.
    front: (u64, Bucket),
    /// Emptied buckets, for new ends.
    spare_buckets: Vec<Bucket>,
    /// The emptied boxes of executed operations (boxes, not values: they move to and
    /// from the buckets without copying their operations).
    #[allow(clippy::vec_box)]
    spare: Vec<Box<Pending>>,
}

impl PendingQueue {
    /// An empty box for an operation.
    fn vacant(&mut self) -> Box<Pending> {
        self.spare.pop().unwrap_or_default()
    }

    /// Empties a box and keeps it for a later operation.
    fn release(&mut self, mut op: Box<Pending>) {
        op.node = None;
        op.work = Work::Marker;
        op.waits.clear();
        self.spare.push(op);
    }

    /// Queues an operation that ends at `ended_ns`, after every queued one (it is the
    /// latest submitted).
    fn push(&mut self, ended_ns: u64, op: Box<Pending>) {
        let (front_ns, front) = &mut self.front;
        if *front_ns == ended_ns && !front.is_empty() {
            front.push_back(op);
            return;
        }
        match self.buckets.entry(ended_ns) {
            Entry::Occupied(mut bucket) => bucket.get_mut().push_back(op),
            Entry::Vacant(slot) => {
                let mut bucket = self.spare_buckets.pop().unwrap_or_default();
                bucket.push_back(op);
                slot.insert(bucket);
                self.ends.push(Reverse(ended_ns));
            }
        }
    }

    /// The operation with the earliest end, the first submitted among equals.
    fn pop(&mut self) -> Option<Box<Pending>> {
        let &Reverse(first) = self.ends.peek()?;
        if self.front.0 != first || self.front.1.is_empty() {
            // The earliest end's bucket becomes the front; the old front goes back to
            // the map if something ends earlier (submitted while it was drained).
            let bucket = self.buckets.remove(&first).expect("every queued end has a bucket");
            let (old_ns, old) = std::mem::replace(&mut self.front, (first, bucket));
            if old.is_empty() {
                self.spare_buckets.push(old);
            } else {
                self.buckets.insert(old_ns, old);
            }
        }
        let op = self.front.1.pop_front();
        if self.front.1.is_empty() {
            self.ends.pop();
        }
        op
    }
}

/// A byte range of memory, bounds-checked when resolved. The `Arc` keeps it alive
/// until the operation that uses it has executed, even if it is freed meanwhile.
struct Region {
    storage: Arc<HostStorage>,
    offset: usize,
    len: usize,
}

impl Region {
    fn binding(&self) -> Binding {
        // SAFETY: `offset + len <= storage.len()` was checked when the region was
        // resolved, so the pointer stays within (or one past the end of) the allocation.
        let ptr = unsafe { self.storage.as_ptr().add(self.offset) };
        Binding::new(ptr, self.len)
    }
}

/// A kernel launch and the resolved memory of its global slots. Kept inline in its
/// [`Pending`] (whose box is reused, so recording a kernel allocates nothing for it);
/// four slots inline, like [`gantry_driver::KernelLaunch::args`].
struct KernelWork {
    kernel: KernelRef,
    geometry: Geometry,
    /// Each slot's memory and how the kernel uses it, in slot order.
    args: SmallVec<[(Region, AccessMode); 4]>,
}

/// A command buffer recorded by this driver: the plan, and its operations bound to the
/// argument table of its latest replay. A graph's buffers rarely move between
/// replays, so a replay usually reuses the binding and costs per operation only its
/// fault draw and its own work.
type SimPlan = CachedPlan<BoundPlan>;

/// The command buffer, if this driver recorded it (so its plan passed the
/// [`PlanBuilder`]'s checks: dependencies on earlier operations, entries inside the
/// table, copy lengths, fill patterns).
fn sim_plan(buffer: &CommandBuffer) -> Option<&SimPlan> {
    buffer.downcast_ref::<SimPlan>()
}

/// Where an argument-table entry was bound: what a [`BoundPlan`] depends on.
#[derive(Clone, Copy, PartialEq, Eq)]
struct EntryKey {
    /// Address of its first byte.
    addr: usize,
    len: usize,
    host: bool,
}

/// A plan's operations bound to one argument table. Valid for any replay on the same
/// driver whose entries have the same address, length and memory kind: the bindings
/// then point into that replay's memory, which its [`PlanWork`] keeps alive.
struct BoundPlan {
    /// The driver that bound it (its errors name the device).
    instance: u64,
    entries: SmallVec<[EntryKey; 8]>,
    /// Every operation's memory, with its engine and work time (none when it cannot
    /// run).
    ops: BoundOps<(Engine, u64)>,
    /// The kernel and the copy operations, in plan order: each draws a fault at every
    /// replay's submission.
    kernels: Vec<u32>,
    copies: Vec<u32>,
    /// Engine and work time of a replay in which no operation faults.
    cost: (Engine, u64),
}

/// What a copy's bytes cross, which sets its bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// Within one device's memory (or within host memory on the host pool).
    Local,
    /// Between host and device memory.
    Host,
    /// From a peer device's memory, over the device-to-device link.
    Peer,
}

/// A host task with its host memory resolved at submission.
struct HostWork {
    name: Arc<str>,
    tag: u64,
    run: HostFn,
    modes: SmallVec<[AccessMode; 4]>,
    regions: SmallVec<[Region; 4]>,
    /// Its virtual duration.
    ns: u64,
}

/// A command-buffer replay: its plan bound to the launch's memory.
struct PlanWork {
    buffer: CommandBuffer,
    bound: Arc<BoundPlan>,
    /// The bound entries' memory, alive until the replay has executed (held, never
    /// read).
    _memory: SmallVec<[Arc<HostStorage>; 4]>,
    /// Operations that drew a fault at submission, with their errors, in plan order.
    faulted: Vec<(u32, ExecError)>,
    /// Engine and work time of the operations that can run.
    cost: (Engine, u64),
}

/// An operation with its memory resolved at submission.
#[derive(Default)]
enum Work {
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

    fn on_machine(machine: Arc<SimMachine>, config: SimConfig, ctx: DriverContext, host_pool: bool) -> Self {
        let info = DeviceInfo {
            name: config.name.into(),
            kind: DeviceKind::Sim,
            caps: Capabilities {
                shares_host_memory: host_pool,
                in_driver_waits: true,
                image_kinds: if host_pool { &[] } else { &[ImageKind::Closure] },
                host_tasks: host_pool,
                max_local_memory: if host_pool { 0 } else { MAX_LOCAL_MEMORY },
                max_private_memory: if host_pool { 0 } else { MAX_PRIVATE_MEMORY },
                virtual_time: true,
                peer_group: if host_pool { 0 } else { machine.peer_group() },
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

    /// The virtual clock, in nanoseconds: the end of the last executed operation.
    pub fn now_ns(&self) -> u64 {
        self.state.lock().clock
    }

    /// Bytes held by live (allocated and not freed) device allocations.
    pub fn allocated_bytes(&self) -> usize {
        self.state.lock().allocated
    }

    fn unsupported(&self, what: &'static str) -> ExecError {
        ExecError::Unsupported { device: self.info.name.clone(), what }
    }

    fn lost(&self) -> ExecError {
        ExecError::DeviceLost { device: self.info.name.clone() }
    }

    fn fault(&self, what: &'static str) -> ExecError {
        ExecError::Fault { device: self.info.name.clone(), what }
    }

    /// Whether the device is lost.
    pub fn is_lost(&self) -> bool {
        self.state.lock().lost
    }

    fn driver_error(&self, message: String) -> ExecError {
        ExecError::Driver { device: self.info.name.clone(), message }
    }

    /// Resolves a slice to a bounds-checked region. Host memory is accepted only when
    /// `host` is `None`; otherwise it is refused as unsupported `host`. Device memory
    /// must be this device's; the host pool has none.
    fn resolve(&self, slice: &MemSlice, host: Option<&'static str>) -> Result<Region, ExecError> {
        self.locate(slice, host, false).map(|(region, _)| region)
    }

    /// [`SimDriver::resolve`], where device memory may also be a peer's when `peer`
    /// (the source of a copy over a device-to-device link); says whether it was.
    fn locate(
        &self,
        slice: &MemSlice,
        host: Option<&'static str>,
        peer: bool,
    ) -> Result<(Region, bool), ExecError> {
        self.locate_in(&mut None, slice, host, peer)
    }

    /// [`SimDriver::locate`] with the machine's allocation table locked in `memory`
    /// (locked here if it is not yet), so that an operation with several arguments
    /// locks it once.
    fn locate_in<'m>(
        &'m self,
        memory: &mut Option<MutexGuard<'m, FxHashMap<AllocId, machine::Allocation>>>,
        slice: &MemSlice,
        host: Option<&'static str>,
        peer: bool,
    ) -> Result<(Region, bool), ExecError> {
        let mut from_peer = false;
        let storage = match &slice.mem {
            MemRef::Host(storage) => match host {
                None => storage.clone(),
                Some(what) => return Err(self.unsupported(what)),
            },
            MemRef::Device(_) if self.host_pool => return Err(self.unsupported("device memory")),
            MemRef::Device(id) => {
                let memory = memory.get_or_insert_with(|| self.machine.memory.lock());
                let unknown = || self.driver_error(format!("unknown allocation {}", id.0));
                let a = memory.get(id).ok_or_else(unknown)?;
                from_peer = a.owner != self.instance;
                if from_peer && !(peer && self.info.caps.peer_group != 0) {
                    return Err(unknown());
                }
                a.storage.clone()
            }
        };
        if slice.offset.checked_add(slice.len).is_none_or(|end| end > storage.len()) {
            return Err(self.driver_error(format!(
                "slice of {} bytes at offset {} is outside its {}-byte allocation",
                slice.len,
                slice.offset,
                storage.len()
            )));
        }
        Ok((Region { storage, offset: slice.offset, len: slice.len }, from_peer))
    }

    /// The engine class an operation occupies and its virtual work time.
    fn cost_of(&self, work: &Work) -> (Engine, u64) {
        match work {
            Work::Marker | Work::Invalid(_) => (Engine::None, 0),
            Work::Copy { src, link: Link::Peer, .. } => {
                (Engine::Copy, per(src.len, self.machine.config.peer_bytes_per_ns).ceil() as u64)
            }
            Work::Copy { src, link, .. } => (Engine::Copy, self.cost.copy_ns(src.len, *link == Link::Host)),
            Work::Host(task) => (Engine::Compute, task.ns),
            Work::Fill { dst, .. } => (Engine::Compute, self.cost.fill_ns(dst.len)),
            Work::Kernel(k) => {
                let bytes = k.args.iter().map(|(r, _)| r.len).sum();
                let items = k.geometry.global_size();
                (Engine::Compute, self.cost.kernel_ns(items, &k.kernel.cost, bytes))
            }
            Work::Plan(plan) => plan.cost,
        }
    }

    /// The cost of a replay of these steps: one engine for the whole replay (compute if
    /// anything needs it) and the sum of their times.
    fn replay_cost(steps: impl Iterator<Item = (Engine, u64)>) -> (Engine, u64) {
        steps.fold((Engine::None, 0u64), |(engine, ns), (e, t)| {
            let engine = match (engine, e) {
                (Engine::Compute, _) | (_, Engine::Compute) => Engine::Compute,
                (Engine::Copy, _) | (_, Engine::Copy) => Engine::Copy,
                _ => Engine::None,
            };
            (engine, ns.saturating_add(t))
        })
    }

    /// Counts a kernel or copy against the fault plan and fails it if a fault targets
    /// it.
    fn count_fault(&self, state: &mut State, class: Faulting) -> Result<(), ExecError> {
        let nth = &mut state.counted[class as usize];
        *nth += 1;
        if self.faults.strikes(class, *nth - 1) {
            return Err(self.fault(class.what()));
        }
        Ok(())
    }

    /// Checks a kernel's argument count and local memory against the device.
    fn check_kernel(&self, kernel: &KernelRef, args: usize) -> Result<(), ExecError> {
        let Some(closure) = kernel.closure() else { return Err(no_image(&self.info.name, &kernel.name)) };
        if args != closure.global_slots {
            return Err(self.driver_error(format!(
                "kernel `{}` has {} global slots but {} arguments",
                kernel.name, closure.global_slots, args
            )));
        }
        let local: usize =
            closure.scratch.iter().filter(|s| s.kind == ScratchKind::Local).map(|s| s.bytes).sum();
        if local > MAX_LOCAL_MEMORY {
            return Err(self.driver_error(format!(
                "kernel `{}` needs {local} bytes of local memory, the device has {}",
                kernel.name, MAX_LOCAL_MEMORY
            )));
        }
        Ok(())
    }

    /// Checks that a fill's length is a whole number of patterns.
    fn check_fill(&self, len: usize, pattern: &[u8]) -> Result<(), ExecError> {
        if fill_fits(len, pattern) {
            Ok(())
        } else {
            Err(self.driver_error(format!("fill of {len} bytes with a {}-byte pattern", pattern.len())))
        }
    }

    /// Resolves a command-buffer launch: its argument table against the allocation
    /// table, then every recorded operation against the table (reusing the command
    /// buffer's binding when the table's memory has not moved), and draws the faults
    /// of its kernels and copies. An operation that cannot run fails at replay (its
    /// dependents with it, independent ones still run); a launch that cannot run at
    /// all is an error.
    fn prepare_plan(&self, state: &mut State, launch: CommandBufferLaunch) -> Result<Work, ExecError> {
        let sim = sim_plan(&launch.buffer)
            .ok_or_else(|| self.driver_error("a command buffer recorded by another driver".into()))?;
        let plan = &sim.plan;
        if launch.args.len() != plan.entries {
            return Err(self.driver_error(format!(
                "command buffer has {} argument entries but {} were bound",
                plan.entries,
                launch.args.len()
            )));
        }
        let entries: SmallVec<[(Region, bool); 4]> = launch
            .args
            .iter()
            .map(|a| Ok((self.resolve(&a.mem, None)?, matches!(a.mem.mem, MemRef::Host(_)))))
            .collect::<Result<_, ExecError>>()?;
        let keys: SmallVec<[EntryKey; 8]> = entries
            .iter()
            .map(|(r, host)| EntryKey { addr: r.binding().ptr as usize, len: r.len, host: *host })
            .collect();
        let fits = |b: &BoundPlan| b.instance == self.instance && b.entries == keys;
        let bound = sim.bound(fits, || self.bind_plan(plan, &entries, keys.clone()));
        // Kernels, then copies: separate counters, each drawn in plan order.
        let mut faulted = Vec::new();
        for (class, ops) in [(Faulting::Kernel, &bound.kernels), (Faulting::Copy, &bound.copies)] {
            if !self.faults.may_fail(class) {
                state.counted[class as usize] += ops.len() as u64;
                continue;
            }
            for &i in ops {
                if let Err(e) = self.count_fault(state, class) {
                    faulted.push((i, e));
                }
            }
        }
        let cost = if faulted.is_empty() {
            bound.cost
        } else {
            faulted.sort_unstable_by_key(|&(i, _)| i);
            let mut skip = faulted.iter().map(|&(i, _)| i as usize).peekable();
            let steps = bound.ops.steps().iter().enumerate();
            let runs = steps.filter(|&(i, _)| skip.next_if_eq(&i).is_none());
            Self::replay_cost(runs.map(|(_, step)| step.data))
        };
        let memory = entries.into_iter().map(|(r, _)| r.storage).collect();
        let buffer = launch.buffer.clone();
        Ok(Work::Plan(Box::new(PlanWork { buffer, bound, _memory: memory, faulted, cost })))
    }

    /// Binds every operation of `plan` to the resolved argument table `entries` (each
    /// with whether it is host memory), whose keys are `keys`.
    fn bind_plan(&self, plan: &Plan, entries: &[(Region, bool)], keys: SmallVec<[EntryKey; 8]>) -> BoundPlan {
        let (mut kernels, mut copies) = (Vec::new(), Vec::new());
        for (i, planned) in plan.ops.iter().enumerate() {
            match planned.op {
                RecordedOp::Kernel { .. } => kernels.push(i as u32),
                RecordedOp::Copy { .. } => copies.push(i as u32),
                _ => {}
            }
        }
        let ops = BoundOps::bind(plan, |op, out| self.bind_recorded(op, entries, out));
        let cost = Self::replay_cost(ops.steps().iter().map(|step| step.data));
        BoundPlan { instance: self.instance, entries: keys, ops, kernels, copies, cost }
    }

    /// Binds one recorded operation to the resolved argument table (each entry with
    /// whether it is host memory), appending its arguments' memory to `out`, with the
    /// rules of the matching single operation: kernels and fills need device memory,
    /// copies may cross the link. Returns its engine and work time.
    fn bind_recorded(
        &self,
        op: &RecordedOp,
        entries: &[(Region, bool)],
        out: &mut Vec<Binding>,
    ) -> Result<(Engine, u64), ExecError> {
        let bind = |a: &RecordedArg, host: Option<&'static str>| -> Result<(Binding, bool), ExecError> {
            // Inside the table: checked when recorded, and the launch binds all of it.
            let (entry, is_host) = &entries[a.entry as usize];
            if let (true, Some(what)) = (*is_host, host) {
                return Err(self.unsupported(what));
            }
            let sub = a.bind(entry.binding()).map_err(|e| self.driver_error(e))?;
            Ok((sub, *is_host))
        };
        match op {
            RecordedOp::Marker => Ok((Engine::None, 0)),
            RecordedOp::Kernel { kernel, geometry, args, .. } => {
                self.check_kernel(kernel, args.len())?;
                for a in args {
                    out.push(bind(a, Some("kernel arguments in host memory"))?.0);
                }
                let bytes = args.iter().map(|a| a.len).sum();
                Ok((Engine::Compute, self.cost.kernel_ns(geometry.global_size(), &kernel.cost, bytes)))
            }
            RecordedOp::Copy { src, dst } => {
                let (s, src_host) = bind(src, None)?;
                let (d, dst_host) = bind(dst, None)?;
                out.extend([s, d]);
                Ok((Engine::Copy, self.cost.copy_ns(src.len, src_host || dst_host)))
            }
            RecordedOp::Fill { dst, .. } => {
                out.push(bind(dst, Some("fills of host memory"))?.0);
                Ok((Engine::Compute, self.cost.fill_ns(dst.len)))
            }
            RecordedOp::Write { .. } | RecordedOp::Read { .. } => Err(self.unsupported(op.label())),
        }
    }

    /// Resolves an operation's memory against the allocation table into `work` (an
    /// emptied [`Pending`]'s), or records why it cannot run. A kernel's work is built
    /// in place; `op` is taken by reference so that a kernel launch is not moved
    /// (copied) first.
    fn prepare_into(&self, state: &mut State, op: &mut DeviceOp, work: &mut Work) {
        let result = match op {
            DeviceOp::Kernel(launch) if !self.host_pool => self.prepare_kernel(state, launch, work),
            _ => {
                self.prepare(state, std::mem::replace(op, DeviceOp::Marker)).map(|prepared| *work = prepared)
            }
        };
        if let Err(e) = result {
            *work = Work::Invalid(e);
        }
    }

    /// Resolves a kernel launch's arguments into `work` (which may be left half-built
    /// on error).
    fn prepare_kernel(
        &self,
        state: &mut State,
        launch: &KernelLaunch,
        work: &mut Work,
    ) -> Result<(), ExecError> {
        self.count_fault(state, Faulting::Kernel)?;
        self.check_kernel(&launch.kernel, launch.args.len())?;
        *work = Work::Kernel(KernelWork {
            kernel: launch.kernel.clone(),
            geometry: launch.geometry,
            args: SmallVec::new(),
        });
        let Work::Kernel(kernel) = work else { unreachable!("just set") };
        // One look-up in the allocation table for all the arguments.
        let mut memory = None;
        for a in &launch.args {
            let host = Some("kernel arguments in host memory");
            kernel.args.push((self.locate_in(&mut memory, &a.mem, host, false)?.0, a.mode));
        }
        Ok(())
    }

    /// Resolves an operation's memory against the allocation table.
    fn prepare(&self, state: &mut State, op: DeviceOp) -> Result<Work, ExecError> {
        match op {
            DeviceOp::Marker => Ok(Work::Marker),
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
                Ok(Work::Copy { src, dst, link })
            }
            DeviceOp::Fill { dst, pattern } => {
                self.check_fill(dst.len, &pattern)?;
                let host = (!self.host_pool).then_some("fills of host memory");
                let dst = self.resolve(&dst, host)?;
                Ok(Work::Fill { dst, pattern })
            }
            DeviceOp::Kernel(_) if self.host_pool => Err(self.unsupported("kernels")),
            DeviceOp::CommandBuffer(_) if self.host_pool => Err(self.unsupported("command buffers")),
            DeviceOp::Kernel(launch) => {
                let mut work = Work::Marker;
                self.prepare_kernel(state, &launch, &mut work)?;
                Ok(work)
            }
            DeviceOp::CommandBuffer(launch) => self.prepare_plan(state, launch),
            DeviceOp::HostTask(task) if self.host_pool => {
                let regions =
                    task.args.iter().map(|a| self.resolve(&a.mem, None)).collect::<Result<_, _>>()?;
                let default_ns = self.machine.config.host.as_ref().map_or(0, |h| h.task_ns);
                let ns = task.cost_ns.map_or(default_ns, |c| c.max(0.0).ceil() as u64);
                Ok(Work::Host(Box::new(HostWork {
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
    fn execute(&self, work: &mut Work, preserve: bool, arena: &mut Arena) -> Result<(), ExecError> {
        if self.timing_only && !matches!(work, Work::Host(_)) {
            return Self::outcome_without_running(work);
        }
        match work {
            Work::Invalid(e) => Err(e.clone()),
            Work::Marker => Ok(()),
            Work::Copy { src, dst, .. } => {
                let (s, d) = (src.binding(), dst.binding());
                // SAFETY: both regions are bounds-checked, of equal length, and kept
                // alive by their `Arc`s; the scheduler orders conflicting commands and
                // this is the only thread executing on the device. `copy` tolerates
                // overlap (a copy within one allocation).
                unsafe { std::ptr::copy(s.ptr, d.ptr, s.len) };
                Ok(())
            }
            Work::Fill { dst, pattern } => {
                let d = dst.binding();
                // SAFETY: bounds-checked live region, its length a multiple of the
                // pattern's (checked at submission); exclusive by scheduling.
                unsafe { fill_bytes(d.ptr, d.len, pattern) };
                Ok(())
            }
            Work::Kernel(KernelWork { kernel, geometry, args }) => {
                let mut bindings = SmallVec::<[Binding; 4]>::new();
                for (region, _) in args.iter() {
                    bindings.push(region.binding());
                }
                let modes = args.iter().map(|&(_, mode)| mode);
                // SAFETY: the bindings are live (held by `args`), and nothing else runs on
                // the device while this kernel does.
                unsafe { self.runner.run_kernel(kernel, geometry, modes, &bindings, preserve, arena) }
            }
            Work::Plan(plan) => self.replay(plan, preserve, arena),
            Work::Host(_) => {
                // The task's closure is dropped after it ran: a capture whose destructor
                // panics fails the task like a panic in its body.
                let Work::Host(task) = std::mem::take(work) else { unreachable!("matched") };
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
    fn outcome_without_running(work: &Work) -> Result<(), ExecError> {
        match work {
            Work::Invalid(e) => Err(e.clone()),
            Work::Plan(plan) => plan.faulted.first().map_or(Ok(()), |(_, e)| Err(e.clone())),
            _ => Ok(()),
        }
    }

    /// Runs a replay's steps in plan order (see [`SimDriver::replay_steps`]); its
    /// result is the first step's error.
    fn replay(&self, plan: &PlanWork, preserve: bool, arena: &mut Arena) -> Result<(), ExecError> {
        self.replay_steps(plan, preserve, arena).into_iter().flatten().next().map_or(Ok(()), Err)
    }

    /// Runs a replay's steps in plan order and returns each step's error (empty when
    /// none failed). A failed step fails the steps that depend on it, directly or not,
    /// with a dependency error naming it; independent steps still run. Each step
    /// follows the failure rules of its single operation (a panicking kernel restores
    /// what it wrote when `preserve` is set).
    fn replay_steps(&self, plan: &PlanWork, preserve: bool, arena: &mut Arena) -> Vec<Option<ExecError>> {
        // `plan._memory` keeps the bindings' memory alive until every step has run.
        let PlanWork { buffer, bound, faulted, .. } = plan;
        let recorded = &sim_plan(buffer).expect("checked at submission").plan;
        // `faulted` is sorted by step: an injected fault fails its step.
        let fault = |i: usize| {
            let f = faulted.binary_search_by_key(&(i as u32), |&(f, _)| f).ok()?;
            Some(faulted[f].1.clone())
        };
        // SAFETY: the bindings point into `plan._memory`, as the bound plan's key is
        // this replay's table; nothing else runs on the device meanwhile.
        unsafe { self.runner.replay_steps(recorded, &bound.ops, preserve, arena, fault) }
    }
}

impl Driver for SimDriver {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The machine's clock: the latest end of anything executed on any of its devices.
    fn virtual_now_ns(&self) -> u64 {
        self.machine.now_ns()
    }

    fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError> {
        let mut state = self.state.lock();
        if state.lost {
            return Err(self.lost());
        }
        let nth = state.allocs;
        state.allocs += 1;
        if self.faults.has(Fault::Alloc { nth }) {
            return Err(ExecError::OutOfMemory { device: self.info.name.clone(), requested: bytes });
        }
        let total = state.allocated.checked_add(bytes);
        if total.is_none_or(|t| t > self.memory_bytes) {
            return Err(ExecError::OutOfMemory { device: self.info.name.clone(), requested: bytes });
        }
        let id = self.machine.next_alloc();
        state.allocated += bytes;
        let allocation =
            machine::Allocation { owner: self.instance, storage: Arc::new(HostStorage::zeroed(bytes)) };
        self.machine.memory.lock().insert(id, allocation);
        Ok(id)
    }

    /// Releases `id` at once: it stops counting against the device's capacity and
    /// later submissions cannot name it. Operations already submitted keep the bytes
    /// alive until they have executed. Unknown ids are ignored.
    fn free(&self, id: AllocId) {
        let mut state = self.state.lock();
        let mut memory = self.machine.memory.lock();
        if memory.get(&id).is_some_and(|a| a.owner == self.instance) {
            let freed = memory.remove(&id).expect("checked above");
            state.allocated -= freed.storage.len();
        }
    }

    /// Command buffers are [`Plan`]s of kernels, device copies, fills and markers,
    /// replayed as one operation (see the crate docs). Host↔buffer writes and reads
    /// (the seed's "memory buffer write/read") are refused as unsupported, like on the
    /// seed's OpenCL backend.
    fn create_command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        if self.host_pool {
            return Err(self.unsupported("command buffers"));
        }
        let accepts = |op: &RecordedOp| !matches!(op, RecordedOp::Write { .. } | RecordedOp::Read { .. });
        let wrap = |plan| -> CommandBuffer { Arc::new(SimPlan::new(plan)) };
        Ok(Box::new(PlanBuilder::new(desc, self.info.name.clone(), accepts, wrap)))
    }

    fn patch_command_buffer(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        // A fresh binding cache: it holds each step's virtual cost, which depends on
        // the kernels the patch replaces.
        let copy = |sim: &SimPlan| SimPlan::new(sim.plan.clone());
        let swap = |sim: &mut SimPlan| {
            sim.plan.apply_patches(patch)?;
            sim.unbind();
            Ok(())
        };
        patch_buffer(buffer, copy, swap)
            .ok_or_else(|| self.driver_error("a command buffer recorded by another driver".into()))?
            .map_err(|e| self.driver_error(e))
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
        let floor = state.horizon.max(sub.not_before_ns);
        let ready_ns = op.waits.iter().map(|w| w.ended_ns).fold(floor, u64::max);
        self.prepare_into(&mut state, &mut sub.op, &mut op.work);
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
            op.work = Work::Marker;
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
    use gantry_driver::sync::channel::{unbounded, Receiver};
    use gantry_driver::{
        AccessMode, CommandBuffer, Geometry, HostTask, KernelLaunch, MemArg, OpHandle, Range, Scratch,
        SyncPoint,
    };
    use gantry_host::{phase, Accessor, ClosureKernel, ReadWrite};
    use std::time::Instant;

    fn driver(config: SimConfig) -> (SimDriver, Receiver<Completion>) {
        let (tx, rx) = unbounded();
        let d = SimDriver::new(config, DriverContext { completions: tx, epoch: Instant::now() });
        (d, rx)
    }

    fn sim() -> (SimDriver, Receiver<Completion>) {
        driver(SimConfig::default())
    }

    fn host_u32(values: &[u32]) -> Arc<HostStorage> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        Arc::new(HostStorage::from_bytes(&bytes))
    }

    fn read_u32(storage: &HostStorage) -> Vec<u32> {
        // SAFETY: every submitted operation has executed (or none touches it).
        let bytes = unsafe { storage.bytes() };
        bytes.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect()
    }

    fn dev(id: AllocId, offset: usize, len: usize) -> MemSlice {
        MemSlice { mem: MemRef::Device(id), offset, len }
    }

    fn host(storage: &Arc<HostStorage>, offset: usize, len: usize) -> MemSlice {
        MemSlice { mem: MemRef::Host(storage.clone()), offset, len }
    }

    fn copy(src: MemSlice, dst: MemSlice) -> DeviceOp {
        DeviceOp::Copy { src, dst }
    }

    /// The same closure kernel with another declared cost.
    fn with_cost(kernel: &KernelRef, cost: gantry_driver::ItemCost) -> KernelRef {
        let closure = kernel.closure().unwrap().clone();
        closure.into_kernel(kernel.name.clone(), kernel.signature.globals.clone(), cost)
    }

    /// A kernel over the `n` u32s of `mem` that sets each element to `f(old, index)`.
    fn map_kernel(
        name: &str,
        n: usize,
        mem: MemSlice,
        f: impl Fn(u32, usize) -> u32 + Send + Sync + 'static,
    ) -> DeviceOp {
        let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
        DeviceOp::Kernel(KernelLaunch {
            kernel: ClosureKernel {
                tag: 1,
                phases: smallvec::smallvec![phase(move |it| {
                    let i = it.global_linear_id();
                    acc.set(it, i, f(acc.get(it, i), i))
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
            args: smallvec::smallvec![MemArg { mem, mode: AccessMode::ReadWrite }],
            scalars: Default::default(),
        })
    }

    fn add(n: usize, mem: MemSlice, k: u32) -> DeviceOp {
        map_kernel("add", n, mem, move |x, _| x + k)
    }

    fn submit(d: &SimDriver, id: u64, op: DeviceOp, waits: &[OpHandle]) -> OpHandle {
        d.submit(Submission { id: OpId(id), op, waits, preserve_on_failure: false, not_before_ns: 0 })
            .unwrap()
            .handle()
            .unwrap()
    }

    fn drain(rx: &Receiver<Completion>) -> Vec<Completion> {
        rx.try_iter().collect()
    }

    fn order(done: &[Completion]) -> Vec<u64> {
        done.iter().map(|c| c.op.0).collect()
    }

    #[test]
    fn info_and_config() {
        let (d, _rx) = driver(SimConfig { name: "gpu0".into(), ..Default::default() });
        let info = d.info();
        assert_eq!(&*info.name, "gpu0");
        assert_eq!(info.kind, DeviceKind::Sim);
        assert!(!info.caps.shares_host_memory && !info.caps.host_tasks);
        assert!(info.caps.in_driver_waits && info.caps.image_kinds.contains(&ImageKind::Closure));
        assert_eq!(info.caps.max_local_memory, 64 * 1024);
        assert_eq!(d.now_ns(), 0);
    }

    /// Host → device, a kernel on device memory, device → host: the host output holds
    /// the result, and nothing moves before `poll`.
    #[test]
    fn round_trip_through_device_memory() {
        let (d, rx) = sim();
        let n = 3000; // three work-groups
        let input = host_u32(&(0..n as u32).collect::<Vec<_>>());
        let output = Arc::new(HostStorage::zeroed(n * 4));
        let buf = d.alloc(n * 4).unwrap();
        let up = submit(&d, 0, copy(host(&input, 0, n * 4), dev(buf, 0, n * 4)), &[]);
        let k = submit(&d, 1, map_kernel("square", n, dev(buf, 0, n * 4), |x, _| x * x), &[up]);
        submit(&d, 2, copy(dev(buf, 0, n * 4), host(&output, 0, n * 4)), &[k]);

        assert!(drain(&rx).is_empty(), "nothing runs before poll");
        assert!(read_u32(&output).iter().all(|&x| x == 0), "host untouched before poll");

        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2]);
        assert!(done.iter().all(|c| c.result.is_ok()));
        let expect: Vec<u32> = (0..n as u32).map(|x| x * x).collect();
        assert_eq!(read_u32(&output), expect);
        assert_eq!(read_u32(&input), (0..n as u32).collect::<Vec<_>>(), "input unchanged");
        assert_eq!(d.now_ns(), 3_000);
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

    /// Independent operations of one batch complete in submission order; an operation
    /// waiting on a long chain completes after an independent one submitted later.
    #[test]
    fn completion_order_differs_from_submission_order() {
        let (d, rx) = sim();
        let buf = d.alloc(16).unwrap();
        let c1 = submit(&d, 1, add(4, dev(buf, 0, 16), 1), &[]);
        let c2 = submit(&d, 2, add(4, dev(buf, 0, 16), 1), &[c1]);
        let c3 = submit(&d, 3, add(4, dev(buf, 0, 16), 1), &[c2]);
        submit(&d, 10, DeviceOp::Marker, &[c3]); // A
        submit(&d, 11, DeviceOp::Marker, &[]); // B
        submit(&d, 12, DeviceOp::Marker, &[]); // C
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [1, 11, 12, 2, 3, 10]);
        let a = done.iter().find(|c| c.op.0 == 10).unwrap();
        assert_eq!((a.started_ns, a.ended_ns), (3000, 4000));
        let b = done.iter().find(|c| c.op.0 == 11).unwrap();
        assert_eq!((b.started_ns, b.ended_ns), (0, 1000));
    }

    /// Operations submitted after a poll start at the advanced clock; a wait on an
    /// operation that already executed is honoured.
    #[test]
    fn later_batches_start_at_the_clock() {
        let (d, rx) = driver(SimConfig { latency_ns: 0, ..Default::default() });
        let a = submit(&d, 0, DeviceOp::Marker, &[]);
        d.poll();
        assert_eq!(d.now_ns(), 1, "latency 0 counts as 1");
        let b = submit(&d, 1, DeviceOp::Marker, std::slice::from_ref(&a));
        let c = submit(&d, 2, DeviceOp::Marker, &[a]);
        submit(&d, 3, DeviceOp::Marker, &[b, c]);
        d.poll();
        let ts: Vec<_> = drain(&rx).iter().map(|c| (c.op.0, c.started_ns, c.ended_ns)).collect();
        assert_eq!(ts, [(0, 0, 1), (1, 1, 2), (2, 1, 2), (3, 2, 3)]);
    }

    /// The pending queue hands operations out in order of (end, submission) however
    /// pushes and pops interleave, including pushes that end before the bucket being
    /// drained (a submission made during a poll).
    #[test]
    fn pending_queue_orders_by_end_then_submission() {
        let mut queue = PendingQueue::default();
        let mut reference = std::collections::BTreeSet::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = 0u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 5 < 3 {
                // Few distinct ends, as with the default cost model.
                let end = (x >> 8) % 16;
                let mut op = queue.vacant();
                op.work = Work::Invalid(ExecError::RuntimeDropped);
                op.node = Some(Arc::new(Node {
                    instance: 0,
                    id: OpId(next),
                    started_ns: 0,
                    ended_ns: end,
                    lane: 0,
                    done: AtomicBool::new(false),
                    failure: OnceLock::new(),
                }));
                queue.push(end, op);
                reference.insert((end, next));
                next += 1;
            } else {
                let got = queue.pop().map(|mut op| {
                    let node = op.node.take().unwrap();
                    queue.release(op);
                    (node.ended_ns, node.id.0)
                });
                assert_eq!(got, reference.pop_first());
            }
        }
        while let Some(mut op) = queue.pop() {
            let node = op.node.take().unwrap();
            assert_eq!(Some((node.ended_ns, node.id.0)), reference.pop_first());
        }
        assert!(reference.is_empty());
    }

    /// A submission starts at the latest of its `not_before_ns` (which the scheduler
    /// sets to when its dependencies outside the wait-list ended) and the clock when
    /// the latest poll began. Not the current clock: an operation submitted in
    /// reaction to an early completion of a poll starts right after that completion,
    /// even though the poll ran later work too.
    #[test]
    fn submissions_start_at_their_floor() {
        let (d, rx) = driver(SimConfig { latency_ns: 10, ..Default::default() });
        let at = |id, not_before_ns| {
            d.submit(Submission {
                id: OpId(id),
                op: DeviceOp::Marker,
                waits: &[],
                preserve_on_failure: false,
                not_before_ns,
            })
            .unwrap();
        };
        at(0, 0);
        at(1, 100);
        d.poll();
        assert_eq!(d.now_ns(), 110);
        at(2, 10); // reacts to op 0's completion
        d.poll(); // begins at clock 110
        at(3, 0);
        at(4, 500);
        d.poll();
        let ts: Vec<_> = drain(&rx).iter().map(|c| (c.op.0, c.started_ns, c.ended_ns)).collect();
        assert_eq!(ts, [(0, 0, 10), (1, 100, 110), (2, 10, 20), (3, 110, 120), (4, 500, 510)]);
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

    /// Allocations beyond the device's capacity fail; freeing makes room again.
    #[test]
    fn out_of_memory() {
        let (d, _rx) = driver(SimConfig { memory_bytes: 1000, ..Default::default() });
        let a = d.alloc(600).unwrap();
        assert_eq!(d.allocated_bytes(), 600);
        match d.alloc(500) {
            Err(ExecError::OutOfMemory { device, requested }) => {
                assert_eq!(&*device, "sim");
                assert_eq!(requested, 500);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert!(matches!(d.alloc(usize::MAX), Err(ExecError::OutOfMemory { .. })));
        let b = d.alloc(400).unwrap();
        assert_ne!(a, b);
        assert_eq!(d.allocated_bytes(), 1000);
        d.free(a);
        assert_eq!(d.allocated_bytes(), 400);
        d.alloc(600).unwrap();
    }

    #[test]
    fn host_tasks_are_refused() {
        let (d, rx) = sim();
        let task = HostTask {
            name: "t".into(),
            tag: 0,
            run: Box::new(|_| {}),
            args: smallvec::smallvec![],
            cost_ns: None,
        };
        let r = d.submit(Submission {
            id: OpId(0),
            op: DeviceOp::HostTask(task),
            waits: &[],
            preserve_on_failure: false,
            not_before_ns: 0,
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
        let pool = machine.host_pool(DriverContext { completions: tx, epoch: Instant::now() }).unwrap();
        let bomb = Bomb;
        let body = gantry_driver::contain::Contained::new(move |_: &gantry_driver::HostCtx<'_>| {
            let _ = &bomb;
        });
        let task = HostTask {
            name: "t".into(),
            tag: 0,
            run: Box::new(move |ctx| (*body)(ctx)),
            args: smallvec::smallvec![],
            cost_ns: None,
        };
        submit(&pool, 0, DeviceOp::HostTask(task), &[]);
        pool.poll();
        let done = drain(&rx);
        assert!(
            matches!(&done[0].result, Err(ExecError::HostTaskPanicked { task, message }) if &**task == "t" && message == "bomb"),
            "{:?}",
            done[0].result
        );
    }

    /// Devices of one machine share an allocation table, but a device reaches another's
    /// memory only as the source of a copy, and only over a peer link.
    #[test]
    fn peer_memory_is_reachable_only_by_copies_over_a_link() {
        for peer_bytes_per_ns in [0.0, 8.0] {
            let (tx, rx) = unbounded();
            let ctx = DriverContext { completions: tx, epoch: Instant::now() };
            let machine = SimMachine::new(MachineConfig { peer_bytes_per_ns, host: None });
            let a = machine.device(SimConfig { latency_ns: 10, ..Default::default() }, ctx.clone());
            let b = machine.device(SimConfig { latency_ns: 10, ..Default::default() }, ctx);
            let (src, dst) = (a.alloc(64).unwrap(), b.alloc(64).unwrap());
            let input = host_u32(&[7; 16]);
            submit(&a, 0, copy(host(&input, 0, 64), dev(src, 0, 64)), &[]);
            a.poll();
            submit(&b, 1, copy(dev(src, 0, 64), dev(dst, 0, 64)), &[]);
            submit(&b, 2, add(16, dev(src, 0, 64), 1), &[]);
            b.poll();
            let done = drain(&rx);
            assert!(done[0].result.is_ok());
            let by_id = |id| done.iter().find(|c| c.op.0 == id).unwrap();
            let unknown = |c: &Completion| matches!(&c.result, Err(ExecError::Driver { message, .. }) if message.contains("unknown allocation"));
            assert!(unknown(by_id(2)), "kernels never bind a peer's memory: {:?}", by_id(2));
            if peer_bytes_per_ns > 0.0 {
                let c = by_id(1);
                assert!(c.result.is_ok(), "{c:?}");
                assert_eq!(c.ended_ns - c.started_ns, 10 + 8, "64 bytes at 8 B/ns, plus latency");
                let out = Arc::new(HostStorage::zeroed(64));
                submit(&b, 3, copy(dev(dst, 0, 64), host(&out, 0, 64)), &[]);
                b.poll();
                assert_eq!(read_u32(&out), [7; 16]);
            } else {
                assert!(unknown(by_id(1)), "no link: {:?}", by_id(1));
            }
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
                not_before_ns: 0,
            });
            assert!(matches!(r, Err(ExecError::Driver { .. })));
        }
    }

    /// Kernels and fills may bind only device memory; the failure is the operation's
    /// completion result and its dependents do not run.
    #[test]
    fn kernels_and_fills_refuse_host_memory() {
        let (d, rx) = sim();
        let storage = host_u32(&[1, 2, 3, 4]);
        let k = submit(&d, 0, add(4, host(&storage, 0, 16), 1), &[]);
        submit(&d, 1, DeviceOp::Fill { dst: host(&storage, 0, 16), pattern: [9].into_iter().collect() }, &[]);
        submit(&d, 2, DeviceOp::Marker, &[k]);
        d.poll();
        let done = drain(&rx);
        assert!(matches!(
            &done[0].result,
            Err(ExecError::Unsupported { what: "kernel arguments in host memory", .. })
        ));
        assert!(matches!(&done[1].result, Err(ExecError::Unsupported { what: "fills of host memory", .. })));
        assert!(matches!(&done[2].result, Err(ExecError::DependencyFailed { .. })));
        assert_eq!(read_u32(&storage), [1, 2, 3, 4]);
    }

    /// Bad slices fail their operation at its virtual time instead of being refused.
    #[test]
    fn invalid_memory_fails_the_operation() {
        let (d, rx) = sim();
        let buf = d.alloc(16).unwrap();
        let gone = d.alloc(16).unwrap();
        d.free(gone);
        submit(&d, 0, copy(dev(buf, 0, 16), dev(buf, 8, 16)), &[]); // out of bounds
        submit(&d, 1, copy(dev(buf, 0, 8), dev(buf, 0, 16)), &[]); // lengths differ
        submit(&d, 2, copy(dev(gone, 0, 16), dev(buf, 0, 16)), &[]); // freed
        submit(
            &d,
            3,
            DeviceOp::Fill { dst: dev(buf, 0, 10), pattern: [1, 2, 3, 4].into_iter().collect() },
            &[],
        );
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2, 3]);
        assert!(done.iter().all(|c| matches!(c.result, Err(ExecError::Driver { .. }))), "{done:?}");
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
            .submit(Submission {
                id: OpId(1),
                op: bad,
                waits: &[up],
                preserve_on_failure: true,
                not_before_ns: 0,
            })
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

    /// Copies of sub-ranges in every direction move exactly the bytes named.
    #[test]
    fn sub_range_copies() {
        let (d, rx) = sim();
        let input = host_u32(&(1..=8).collect::<Vec<_>>());
        let out = host_u32(&[0xff; 8]);
        let a = d.alloc(32).unwrap();
        let b = d.alloc(32).unwrap();
        // a[2..6] = input[1..5]
        let h2d = submit(&d, 0, copy(host(&input, 4, 16), dev(a, 8, 16)), &[]);
        // b[0..3] = a[3..6] = input[2..5]
        let d2d = submit(&d, 1, copy(dev(a, 12, 12), dev(b, 0, 12)), std::slice::from_ref(&h2d));
        // within one allocation, overlapping: a[1..5] = a[2..6]
        let inner = submit(&d, 2, copy(dev(a, 8, 16), dev(a, 4, 16)), std::slice::from_ref(&d2d));
        // out[4..8] = b[0..4]; out[0..2] = a[0..2]
        submit(&d, 3, copy(dev(b, 0, 16), host(&out, 16, 16)), &[d2d]);
        submit(&d, 4, copy(dev(a, 0, 8), host(&out, 0, 8)), &[inner]);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [0, 2, 0xff, 0xff, 3, 4, 5, 0]);
        assert_eq!(read_u32(&input), (1..=8).collect::<Vec<_>>());
    }

    /// Fills write repetitions of the pattern to a device range.
    #[test]
    fn fill_device_range() {
        let (d, rx) = sim();
        let out = Arc::new(HostStorage::zeroed(32));
        let buf = d.alloc(32).unwrap();
        let pattern = 0xdead_beef_u32.to_ne_bytes().into_iter().collect();
        let f = submit(&d, 0, DeviceOp::Fill { dst: dev(buf, 8, 16), pattern }, &[]);
        submit(&d, 1, copy(dev(buf, 0, 32), host(&out, 0, 32)), &[f]);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [0, 0, 0xdead_beef, 0xdead_beef, 0xdead_beef, 0xdead_beef, 0, 0]);
    }

    /// Memory freed while a submitted operation still uses it stays valid for that
    /// operation.
    #[test]
    fn free_keeps_memory_of_submitted_work() {
        let (d, rx) = sim();
        let input = host_u32(&[1, 2, 3, 4]);
        let out = Arc::new(HostStorage::zeroed(16));
        let buf = d.alloc(16).unwrap();
        let up = submit(&d, 0, copy(host(&input, 0, 16), dev(buf, 0, 16)), &[]);
        let k = submit(&d, 1, add(4, dev(buf, 0, 16), 10), &[up]);
        submit(&d, 2, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[k]);
        d.free(buf);
        assert_eq!(d.allocated_bytes(), 0);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [11, 12, 13, 14]);
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

    /// (start, end) of every completion, by op id.
    fn spans(rx: &Receiver<Completion>) -> Vec<(u64, u64, u64)> {
        let mut v: Vec<_> = drain(rx).into_iter().map(|c| (c.op.0, c.started_ns, c.ended_ns)).collect();
        v.sort();
        v
    }

    fn costed(cost: CostModel) -> (SimDriver, Receiver<Completion>) {
        driver(SimConfig { latency_ns: 10, cost, ..Default::default() })
    }

    /// Copies cross the link at its bandwidth; one copy engine serializes independent
    /// copies, two let them overlap.
    #[test]
    fn copy_engines_limit_overlap() {
        for (engines, second) in [(1, (110, 220)), (2, (0, 110))] {
            let (d, rx) =
                costed(CostModel { link_bytes_per_ns: 10.0, copy_engines: engines, ..Default::default() });
            let a = d.alloc(1000).unwrap();
            let b = d.alloc(1000).unwrap();
            let src = HostStorage::zeroed(1000);
            let src = Arc::new(src);
            submit(&d, 1, copy(host(&src, 0, 1000), dev(a, 0, 1000)), &[]);
            submit(&d, 2, copy(host(&src, 0, 1000), dev(b, 0, 1000)), &[]);
            d.poll();
            assert_eq!(spans(&rx), vec![(1, 0, 110), (2, second.0, second.1)], "{engines} engines");
        }
    }

    /// Kernels take work-items over compute units at the declared or default per-item
    /// cost, or bytes over memory bandwidth when that is slower; kernels and copies use
    /// different engines and overlap.
    #[test]
    fn kernels_are_compute_or_memory_bound() {
        let model = CostModel {
            item_ns: 1.0,
            compute_units: 64,
            memory_bytes_per_ns: 100.0,
            link_bytes_per_ns: 10.0,
            compute_engines: 1,
            copy_engines: 1,
        };
        let (d, rx) = costed(model);
        let n = 6400;
        let buf = d.alloc(n * 4).unwrap();
        // 6,400 items / 64 lanes = 100 ns of compute; 25,600 bytes / 100 = 256 ns of memory.
        submit(&d, 1, add(n, dev(buf, 0, n * 4), 1), &[]);
        let mut heavy = add(n, dev(buf, 0, n * 4), 1);
        if let DeviceOp::Kernel(launch) = &mut heavy {
            // 1,000 ns of compute: compute-bound.
            launch.kernel = with_cost(&launch.kernel, gantry_driver::ItemCost::of(Some(10.0)));
        }
        submit(&d, 2, heavy, &[]);
        let other = d.alloc(100).unwrap();
        let src = Arc::new(HostStorage::zeroed(100));
        submit(&d, 3, copy(host(&src, 0, 100), dev(other, 0, 100)), &[]);
        d.poll();
        assert_eq!(spans(&rx), vec![(1, 0, 266), (2, 266, 1276), (3, 0, 20)]);
        assert_eq!(model.kernel_ns(n, &gantry_driver::ItemCost::default(), 0), 100);
    }

    /// A dependent operation waits for its predecessor even with free engines.
    #[test]
    fn dependencies_outrank_free_engines() {
        let (d, rx) =
            costed(CostModel { memory_bytes_per_ns: 1.0, compute_engines: 4, ..Default::default() });
        let buf = d.alloc(400).unwrap();
        let first = submit(&d, 1, add(100, dev(buf, 0, 400), 1), &[]);
        submit(&d, 2, add(100, dev(buf, 0, 400), 1), &[first]);
        d.poll();
        assert_eq!(spans(&rx), vec![(1, 0, 410), (2, 410, 820)]);
    }

    // ---- Command buffers -------------------------------------------------------------

    fn rarg(entry: u32, offset: usize, len: usize) -> RecordedArg {
        RecordedArg { entry, offset, len, mode: AccessMode::ReadWrite }
    }

    /// A recorded kernel over the `n` u32s of `arg` that sets each to `f(old, index)`.
    fn rec_map(
        name: &str,
        n: usize,
        arg: RecordedArg,
        f: impl Fn(u32, usize) -> u32 + Send + Sync + 'static,
    ) -> RecordedOp {
        let DeviceOp::Kernel(launch) = map_kernel(name, n, dev(AllocId(u64::MAX), 0, 0), f) else {
            unreachable!()
        };
        RecordedOp::Kernel {
            kernel: launch.kernel,
            geometry: launch.geometry,
            args: smallvec::smallvec![arg],
            scalars: Default::default(),
        }
    }

    fn rec_add(n: usize, arg: RecordedArg, k: u32) -> RecordedOp {
        rec_map("add", n, arg, move |x, _| x + k)
    }

    fn rec_fill(arg: RecordedArg, value: u32) -> RecordedOp {
        RecordedOp::Fill { dst: arg, pattern: value.to_ne_bytes().into_iter().collect() }
    }

    /// Records `ops` (each with the sync points it depends on) into a command buffer.
    fn record(d: &SimDriver, entries: usize, ops: Vec<(RecordedOp, Vec<u32>)>) -> CommandBuffer {
        let mut b = d.create_command_buffer(CommandBufferDesc { entries, in_order: false, ops: 0 }).unwrap();
        for (i, (op, deps)) in ops.into_iter().enumerate() {
            let deps: Vec<SyncPoint> = deps.into_iter().map(SyncPoint).collect();
            assert_eq!(b.append(op, &deps), Ok(SyncPoint(i as u32)));
        }
        b.finalize().unwrap()
    }

    /// A replay of `buffer` with entry `i` bound to the whole of `entries[i]`.
    fn replay_op(buffer: &CommandBuffer, entries: &[MemSlice]) -> DeviceOp {
        let args = entries.iter().map(|m| MemArg { mem: m.clone(), mode: AccessMode::ReadWrite }).collect();
        DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args })
    }

    const CB_N: usize = 64;

    fn cb_model() -> CostModel {
        // 64 items / 16 lanes = 4 ns; 256 bytes / 64 B/ns = 4 ns: every kernel and fill
        // of CB_N u32s takes 4 ns, a copy of half of them 2 ns.
        CostModel {
            item_ns: 1.0,
            compute_units: 16,
            memory_bytes_per_ns: 64.0,
            compute_engines: 1,
            ..Default::default()
        }
    }

    /// One replay's (start, end, lane) and the two entries' data after it.
    type ReplayRun = ((u64, u64, u32), Vec<u32>, Vec<u32>);

    /// Three replays of fill → three increments → copy into another entry, with an
    /// independent accumulating kernel; returns every replay's (start, end, lane) and
    /// the data read back after it.
    fn replay_scenario() -> Vec<ReplayRun> {
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), ..Default::default() });
        let (n, bytes, half) = (CB_N, CB_N * 4, CB_N * 2);
        let a = d.alloc(bytes).unwrap();
        let b = d.alloc(bytes).unwrap();
        let buffer = record(
            &d,
            2,
            vec![
                (rec_fill(rarg(0, 0, bytes), 5), vec![]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![0]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![1]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![2]),
                (rec_add(n, rarg(1, 0, bytes), 10), vec![]),
                // b[n/2..] = a[..n/2], after both writers of a and b.
                (RecordedOp::Copy { src: rarg(0, 0, half), dst: rarg(1, half, half) }, vec![3, 4]),
                (RecordedOp::Marker, vec![5]),
            ],
        );
        let (out_a, out_b) = (Arc::new(HostStorage::zeroed(bytes)), Arc::new(HostStorage::zeroed(bytes)));
        let mut runs = Vec::new();
        for r in 0..3u64 {
            let rep = submit(&d, 10 * r, replay_op(&buffer, &[dev(a, 0, bytes), dev(b, 0, bytes)]), &[]);
            submit(
                &d,
                10 * r + 1,
                copy(dev(a, 0, bytes), host(&out_a, 0, bytes)),
                std::slice::from_ref(&rep),
            );
            submit(&d, 10 * r + 2, copy(dev(b, 0, bytes), host(&out_b, 0, bytes)), &[rep]);
            d.poll();
            let done = drain(&rx);
            assert_eq!(done.len(), 3, "one completion per replay: {done:?}");
            assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
            let c = done.iter().find(|c| c.op.0 == 10 * r).unwrap();
            runs.push(((c.started_ns, c.ended_ns, c.lane), read_u32(&out_a), read_u32(&out_b)));
        }
        runs
    }

    /// A recorded plan replays three times against device allocations with the data
    /// of its operations run one by one, as one operation that takes the launch
    /// latency once: shorter than launching its kernels separately.
    #[test]
    fn command_buffer_replays_against_device_memory() {
        let runs = replay_scenario();
        let n = CB_N;
        for (r, (span, a, b)) in runs.iter().enumerate() {
            let r = r as u32 + 1;
            assert_eq!(a, &vec![8; n], "replay {r}: fill then three increments");
            let expect_b: Vec<u32> = (0..n).map(|i| if i < n / 2 { 10 * r } else { 8 }).collect();
            assert_eq!(b, &expect_b, "replay {r}");
            // latency once + fill 4 + 4 kernels × 4 + copy 2.
            assert_eq!(span.1 - span.0, 100 + 4 + 4 * 4 + 2, "replay {r}");
            assert_eq!(span.2, 1, "on the (only) compute engine");
        }
        assert_eq!(runs, replay_scenario(), "same program, same timeline");

        // The same four kernels launched separately, as a chain: latency each time.
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), ..Default::default() });
        let a = d.alloc(n * 4).unwrap();
        let mut prev: Vec<OpHandle> = vec![];
        for i in 0..4 {
            prev = vec![submit(&d, i, add(n, dev(a, 0, n * 4), 1), &prev)];
        }
        d.poll();
        let separate = drain(&rx).last().unwrap().ended_ns;
        assert_eq!(separate, 4 * (100 + 4));
        let replay = runs[0].0 .1 - runs[0].0 .0;
        assert!(replay < separate, "replay {replay} ns, separate launches {separate} ns");
    }

    /// Host↔buffer writes and reads cannot be recorded; kernels, copies, fills and
    /// markers can.
    #[test]
    fn command_buffers_refuse_host_writes_and_reads() {
        let (d, _rx) = sim();
        let mut b =
            d.create_command_buffer(CommandBufferDesc { entries: 2, in_order: true, ops: 0 }).unwrap();
        let host_data = Arc::new(HostStorage::zeroed(16));
        let write = RecordedOp::Write { src: host_data.clone(), dst: rarg(0, 0, 16) };
        let read = RecordedOp::Read { src: rarg(0, 0, 16), dst: host_data };
        assert!(matches!(
            b.append(write, &[]),
            Err(ExecError::Unsupported { what: "memory buffer write", device }) if &*device == "sim"
        ));
        assert!(matches!(
            b.append(read, &[]),
            Err(ExecError::Unsupported { what: "memory buffer read", .. })
        ));
        assert_eq!(b.append(rec_fill(rarg(0, 0, 16), 1), &[]), Ok(SyncPoint(0)));
        assert_eq!(b.append(rec_add(4, rarg(0, 0, 16), 1), &[]), Ok(SyncPoint(1)));
        assert_eq!(
            b.append(RecordedOp::Copy { src: rarg(0, 0, 16), dst: rarg(1, 0, 16) }, &[]),
            Ok(SyncPoint(2))
        );
        assert_eq!(b.append(RecordedOp::Marker, &[]), Ok(SyncPoint(3)));
        let plan = b.finalize().unwrap();
        assert_eq!(sim_plan(&plan).unwrap().plan.ops.len(), 4);
    }

    /// A panicking kernel inside a plan fails the operations that depend on it,
    /// directly or not, restores what it wrote (with `preserve_on_failure`), and
    /// leaves independent operations to run; the replay reports the kernel's error.
    #[test]
    fn failing_kernel_in_a_plan_fails_only_its_dependents() {
        let (d, rx) = sim();
        let n = 2500; // several work-groups: some are written before the panic
        let bytes = n * 4;
        let (a, b, c) = (d.alloc(bytes).unwrap(), d.alloc(bytes).unwrap(), d.alloc(bytes).unwrap());
        let input = host_u32(&vec![5; n]);
        let up = submit(&d, 0, copy(host(&input, 0, bytes), dev(a, 0, bytes)), &[]);
        let bad =
            rec_map("bad", n, rarg(0, 0, bytes), move |_, i| if i == n - 1 { panic!("boom") } else { 99 });
        let buffer = record(
            &d,
            3,
            vec![
                (bad, vec![]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![0]),
                (RecordedOp::Copy { src: rarg(0, 0, bytes), dst: rarg(1, 0, bytes) }, vec![1]),
                (rec_add(n, rarg(2, 0, bytes), 7), vec![]),
            ],
        );
        let launch = replay_op(&buffer, &[dev(a, 0, bytes), dev(b, 0, bytes), dev(c, 0, bytes)]);
        let rep = d
            .submit(Submission {
                id: OpId(1),
                op: launch,
                waits: &[up],
                preserve_on_failure: true,
                not_before_ns: 0,
            })
            .unwrap()
            .handle()
            .unwrap();
        submit(&d, 2, DeviceOp::Marker, &[rep]);
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2], "one completion for the replay");
        match &done[1].result {
            Err(ExecError::KernelPanicked { kernel, message }) => {
                assert_eq!((&**kernel, message.as_str()), ("bad", "boom"));
            }
            other => panic!("expected KernelPanicked, got {other:?}"),
        }
        assert!(matches!(&done[2].result, Err(ExecError::DependencyFailed { .. })));
        let outs: Vec<Arc<HostStorage>> = (0..3).map(|_| Arc::new(HostStorage::zeroed(bytes))).collect();
        for (i, (id, out)) in [a, b, c].into_iter().zip(&outs).enumerate() {
            submit(&d, 10 + i as u64, copy(dev(id, 0, bytes), host(out, 0, bytes)), &[]);
        }
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert!(read_u32(&outs[0]).iter().all(|&x| x == 5), "restored; the dependent add did not run");
        assert!(read_u32(&outs[1]).iter().all(|&x| x == 0), "the transitive dependent copy did not run");
        assert!(read_u32(&outs[2]).iter().all(|&x| x == 7), "the independent add ran");
    }

    /// Kernel faults count recorded kernels, once per replay: the faulted kernel fails
    /// inside the replay (its dependents with it) and the replay reports the fault.
    #[test]
    fn kernel_faults_target_kernels_inside_plans() {
        // Kernel 1 of this device fails by plan: the second recorded kernel.
        let faults = FaultPlan::default().with(Fault::Kernel { nth: 1 });
        let (d, rx) = driver(SimConfig { faults, ..Default::default() });
        let buf = d.alloc(16).unwrap();
        let buffer = record(
            &d,
            1,
            vec![
                (rec_add(4, rarg(0, 0, 16), 1), vec![]),
                (rec_add(4, rarg(0, 0, 16), 2), vec![0]),
                (rec_add(4, rarg(0, 0, 16), 4), vec![1]),
                (rec_add(4, rarg(0, 0, 16), 8), vec![0]),
            ],
        );
        submit(&d, 0, replay_op(&buffer, &[dev(buf, 0, 16)]), &[]);
        let out = Arc::new(HostStorage::zeroed(16));
        submit(&d, 1, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[]);
        d.poll();
        let done = drain(&rx);
        assert!(matches!(&done[0].result, Err(ExecError::Fault { what: "kernel launch failed", .. })));
        assert_eq!(read_u32(&out), [9; 4], "the first and the fourth kernel ran");
        // The next replay counts kernels 4.. and runs all of them.
        submit(&d, 2, replay_op(&buffer, &[dev(buf, 0, 16)]), &[]);
        submit(&d, 3, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[]);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [24; 4]);
    }

    /// Inside a replay, a failed step's dependents fail with dependency errors naming
    /// the step they depend on, down to the root cause; independent steps run.
    #[test]
    fn plan_failures_chain_as_dependency_errors() {
        let (d, _rx) = sim();
        let buf = d.alloc(16).unwrap();
        let buffer = record(
            &d,
            1,
            vec![
                (rec_fill(rarg(0, 0, 16), 3), vec![]),
                (rec_map("bad", 4, rarg(0, 0, 16), |_, _| panic!("boom")), vec![0]),
                (rec_add(4, rarg(0, 0, 16), 1), vec![1]),
                (RecordedOp::Marker, vec![2]),
                (rec_add(4, rarg(0, 0, 16), 10), vec![0]),
            ],
        );
        let launch = replay_op(&buffer, &[dev(buf, 0, 16)]);
        let work = {
            let mut state = d.state.lock();
            d.prepare(&mut state, launch).unwrap()
        };
        let errors = d.replay_steps(
            match &work {
                Work::Plan(plan) => plan,
                _ => unreachable!("a replay prepares to a plan"),
            },
            true,
            &mut Arena::default(),
        );
        assert_eq!(errors.len(), 5);
        assert!(errors[0].is_none() && errors[4].is_none(), "{errors:?}");
        assert!(matches!(&errors[1], Some(ExecError::KernelPanicked { kernel, .. }) if &**kernel == "bad"));
        match &errors[2] {
            Some(e @ ExecError::DependencyFailed { dependency, .. }) => {
                assert_eq!(&**dependency, "bad");
                assert_eq!(Some(e.root_cause()), errors[1].as_ref());
            }
            other => panic!("expected DependencyFailed, got {other:?}"),
        }
        match &errors[3] {
            Some(e @ ExecError::DependencyFailed { dependency, .. }) => {
                assert_eq!(&**dependency, "add", "named after its direct dependency");
                assert_eq!(Some(e.root_cause()), errors[1].as_ref());
            }
            other => panic!("expected DependencyFailed, got {other:?}"),
        }
        let storage = d.machine.memory.lock()[&buf].storage.clone();
        assert_eq!(read_u32(&storage), [13; 4], "fill and the independent add ran, the rest did not");
    }

    /// Malformed launches complete with an error instead of panicking: a wrong number
    /// of bound entries, a buffer of another driver (a plan this driver did not record
    /// among them), freed memory, kernels bound to host memory.
    #[test]
    fn bad_command_buffer_launches_fail_without_panicking() {
        let (d, rx) = sim();
        let buf = d.alloc(16).unwrap();
        let buffer = record(&d, 2, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        submit(&d, 0, replay_op(&buffer, &[dev(buf, 0, 16)]), &[]); // one entry of two
        let foreign: CommandBuffer = Arc::new(5u32);
        submit(&d, 1, replay_op(&foreign, &[]), &[]);
        let hand_built: CommandBuffer =
            Arc::new(Plan { entries: 1, in_order: false, ops: vec![], work_items: 0 });
        submit(&d, 2, replay_op(&hand_built, &[dev(buf, 0, 16)]), &[]);
        let gone = d.alloc(16).unwrap();
        d.free(gone);
        let one = record(&d, 1, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        submit(&d, 3, replay_op(&one, &[dev(gone, 0, 16)]), &[]);
        let host_mem = host_u32(&[1, 2, 3, 4]);
        submit(&d, 4, replay_op(&one, &[host(&host_mem, 0, 16)]), &[]);
        // Copies may use host entries, over the link.
        let up = record(&d, 2, vec![(RecordedOp::Copy { src: rarg(0, 0, 16), dst: rarg(1, 0, 16) }, vec![])]);
        submit(&d, 5, replay_op(&up, &[host(&host_mem, 0, 16), dev(buf, 0, 16)]), &[]);
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2, 3, 4, 5]);
        for c in &done[..4] {
            assert!(matches!(&c.result, Err(ExecError::Driver { .. })), "{c:?}");
        }
        assert!(matches!(
            &done[4].result,
            Err(ExecError::Unsupported { what: "kernel arguments in host memory", .. })
        ));
        assert!(done[5].result.is_ok(), "{:?}", done[5]);
        assert_eq!(read_u32(&host_mem), [1, 2, 3, 4]);
        let out = Arc::new(HostStorage::zeroed(16));
        submit(&d, 7, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[]);
        d.poll();
        assert_eq!(read_u32(&out), [1, 2, 3, 4], "only the host-to-device copy changed the buffer");
    }

    /// Reads `n` u32s of device allocation `id` back through a copy.
    fn read_dev(d: &SimDriver, rx: &Receiver<Completion>, id: AllocId, n: usize) -> Vec<u32> {
        let out = Arc::new(HostStorage::zeroed(n * 4));
        submit(d, 1000, copy(dev(id, 0, n * 4), host(&out, 0, n * 4)), &[]);
        d.poll();
        assert!(drain(rx).iter().all(|c| c.result.is_ok()));
        read_u32(&out)
    }

    /// A replay reuses the binding of the previous one only while its table's memory
    /// is where it was: rebound to another allocation, a reallocated one, another
    /// offset or a shorter range, it reads and writes (or refuses) the new memory.
    #[test]
    fn replays_follow_their_table_when_buffers_move() {
        let (d, rx) = sim();
        let buffer = record(&d, 1, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        let run = |entry: MemSlice| {
            submit(&d, 0, replay_op(&buffer, &[entry]), &[]);
            d.poll();
            drain(&rx).pop().unwrap().result
        };
        let (a, b) = (d.alloc(16).unwrap(), d.alloc(32).unwrap());
        run(dev(a, 0, 16)).unwrap();
        run(dev(a, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, a, 4), [2; 4]);
        run(dev(b, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, a, 4), [2; 4], "moved: the old memory is left alone");
        assert_eq!(read_dev(&d, &rx, b, 8), [1, 1, 1, 1, 0, 0, 0, 0]);
        run(dev(b, 16, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, b, 8), [1; 8], "another offset of the same allocation");
        assert!(matches!(run(dev(b, 16, 8)), Err(ExecError::Driver { .. })), "the entry got too short");
        d.free(a);
        let c = d.alloc(16).unwrap(); // may reuse a's address: its bytes are c's now
        run(dev(c, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, c, 4), [1; 4]);
        run(dev(b, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, b, 8), [2, 2, 2, 2, 1, 1, 1, 1]);
    }

    /// Faults are drawn at every replay, bound or not: the nth kernel and copy fail in
    /// whichever replay they fall, and a faulted step costs no time (a replay whose
    /// every step faulted occupies no engine).
    #[test]
    fn faults_and_costs_are_per_replay_with_a_reused_binding() {
        let faults = FaultPlan::default()
            .with(Fault::Kernel { nth: 0 })
            .with(Fault::Kernel { nth: 1 })
            .with(Fault::Kernel { nth: 3 })
            .with(Fault::Copy { nth: 3 }); // copy 0 is the read-back below
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), faults, ..Default::default() });
        let bytes = CB_N * 4;
        let (a, b) = (d.alloc(bytes).unwrap(), d.alloc(bytes).unwrap());
        let kernels = record(
            &d,
            1,
            vec![
                (rec_add(CB_N, rarg(0, 0, bytes), 1), vec![]),
                (rec_add(CB_N, rarg(0, 0, bytes), 2), vec![]),
            ],
        );
        let copy_ab = record(
            &d,
            2,
            vec![(RecordedOp::Copy { src: rarg(0, 0, bytes), dst: rarg(1, 0, bytes) }, vec![])],
        );
        let mut spans = Vec::new();
        for _ in 0..3 {
            submit(&d, 0, replay_op(&kernels, &[dev(a, 0, bytes)]), &[]);
            d.poll();
            let c = drain(&rx).pop().unwrap();
            spans.push((c.ended_ns - c.started_ns, c.lane, c.result.is_ok()));
        }
        // Kernels 0, 1 fault (both steps), then 3 (the second step), then none.
        assert_eq!(spans, [(100, 0, false), (104, 1, false), (108, 1, true)]);
        assert_eq!(read_dev(&d, &rx, a, CB_N), vec![1 + 1 + 2; CB_N]);
        let copies: Vec<bool> = (0..3)
            .map(|_| {
                submit(&d, 0, replay_op(&copy_ab, &[dev(a, 0, bytes), dev(b, 0, bytes)]), &[]);
                d.poll();
                drain(&rx).pop().unwrap().result.is_ok()
            })
            .collect();
        assert_eq!(
            copies,
            [true, true, false],
            "the third replay's copy (copies count apart from kernels) faults"
        );
    }

    /// A patched command buffer runs its new kernels at their virtual cost: its
    /// binding (which holds each step's cost) starts afresh, while the original keeps
    /// its own.
    #[test]
    fn patched_buffers_run_their_new_kernels_at_their_cost() {
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), ..Default::default() });
        let bytes = CB_N * 4;
        let a = d.alloc(bytes).unwrap();
        let original = record(&d, 1, vec![(rec_add(CB_N, rarg(0, 0, bytes), 1), vec![])]);
        let run = |buffer: &CommandBuffer| {
            submit(&d, 0, replay_op(buffer, &[dev(a, 0, bytes)]), &[]);
            d.poll();
            let c = drain(&rx).pop().unwrap();
            assert!(c.result.is_ok(), "{c:?}");
            c.ended_ns - c.started_ns
        };
        assert_eq!((run(&original), run(&original)), (104, 104), "bound once, then reused");
        // A kernel adding 10 that declares twice the default cost per work-item.
        let RecordedOp::Kernel { kernel, geometry, .. } = rec_add(CB_N, rarg(0, 0, bytes), 10) else {
            unreachable!()
        };
        let dearer = with_cost(&kernel, gantry_driver::ItemCost::of(Some(2.0)));
        // `original` is still held here: the patch makes a copy.
        let mut patched = original.clone();
        d.patch_command_buffer(
            &mut patched,
            &[OpPatch::Kernel { kernel: &dearer, geometry: &geometry, scalars: &[] }],
        )
        .unwrap();
        assert!(!Arc::ptr_eq(&patched, &original));
        assert_eq!(run(&patched), 108);
        assert_eq!(read_dev(&d, &rx, a, CB_N), vec![1 + 1 + 10; CB_N]);
        assert_eq!(run(&original), 104, "the original is unchanged");
        assert_eq!(read_dev(&d, &rx, a, CB_N), vec![1 + 1 + 10 + 1; CB_N]);
        // Held by nothing else, `patched` is patched in place: patching a kernel of the
        // default cost back must also drop the binding that holds the dearer one's.
        drop(original);
        let before = Arc::as_ptr(&patched);
        d.patch_command_buffer(
            &mut patched,
            &[OpPatch::Kernel { kernel: &kernel, geometry: &geometry, scalars: &[] }],
        )
        .unwrap();
        assert!(std::ptr::eq(Arc::as_ptr(&patched), before), "in place");
        assert_eq!(run(&patched), 104);
    }

    /// A command buffer bound on one device is rebound on another, even over the
    /// same memory: its errors name the device that ran it.
    #[test]
    fn bindings_belong_to_one_device() {
        let machine = SimMachine::new(MachineConfig::default());
        let device = |name: &'static str| {
            let (tx, rx) = unbounded();
            let config = SimConfig { name: name.into(), ..Default::default() };
            (machine.device(config, DriverContext { completions: tx, epoch: Instant::now() }), rx)
        };
        let ((d1, rx1), (d2, rx2)) = (device("one"), device("two"));
        let buffer = record(&d1, 1, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        let mem = host_u32(&[0; 4]);
        for (d, rx, name) in [(&d1, &rx1, "one"), (&d2, &rx2, "two")] {
            submit(d, 0, replay_op(&buffer, &[host(&mem, 0, 16)]), &[]);
            d.poll();
            let done = drain(rx);
            assert!(
                matches!(&done[0].result, Err(ExecError::Unsupported { device, .. }) if &**device == name),
                "{done:?}"
            );
        }
    }
}
