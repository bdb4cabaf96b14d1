//! Execution: operation lanes, each a timeline semaphore, and one completion thread
//! per lane that waits for its lane's operations in order and reports each exactly
//! once.
//!
//! Every accepted operation is one `vkQueueSubmit` batch that signals the next value
//! of its lane's timeline semaphore: on the transfer queue for a one-by-one copy or
//! fill where the driver uses one ([`QueueKind`]), else on the compute queue. The
//! lanes span both queues: a timeline semaphore is the device's, so a batch on one
//! queue waits on values signalled on the other, and the waits below order the two
//! queues' work (with their memory dependencies) exactly as on one queue. The batch waits on the
//! lane's previous value (a lane runs in order, as a CUDA stream does, so its
//! timeline's values are signalled in increasing order, as Vulkan requires) and on
//! the `(lane, value)` of each operation in its wait-list that has not finished
//! ([`Capabilities::in_driver_waits`](gantry_driver::Capabilities)). An operation
//! goes to the lane of the latest unfinished operation it waits on (a dependent chain
//! stays on one lane and waits on nothing else), or, with nothing to wait on, to the
//! next lane in turn (independent work may overlap). An operation that runs nothing
//! (a marker, one that failed when submitted, a dependent of a failed one) is an
//! empty batch, so its lane's timeline still advances.
//!
//! The lane's completion thread first waits for the results of the operations it
//! waited on (for `DependencyFailed` and start times), then for its value
//! (`vkGetSemaphoreCounterValue` for a short spin, then `vkWaitSemaphores`), runs its
//! host-side finish (a device → host copy's read-back from staging memory), and
//! reports the completion. A failed `vkQueueSubmit` or a `VK_ERROR_DEVICE_LOST`
//! while waiting marks the device lost: that operation carries the Vulkan error, and
//! every later one fails with [`ExecError::DeviceLost`] without being submitted.

use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use ash::vk;
use gantry_driver::sync::channel::{unbounded, Receiver, Sender, TryRecvError};
use gantry_driver::sync::spin_until;
use gantry_driver::{Completion, DriverContext, ExecError, OpHandle, OpId};

use crate::device::Device;
use crate::error::{CallError, Check};

/// Locks `m`, whatever a panicking holder left (every critical section here leaves
/// its data consistent).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A host-side step an operation runs after its device work (a read-back).
pub(crate) type Finish = Box<dyn FnOnce() + Send>;

/// The queue a batch goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QueueKind {
    /// The compute queue: kernels, command buffers, batches that run nothing, and
    /// transfers where there is no transfer queue.
    Compute = 0,
    /// The transfer-only family's queue: one-by-one copies and fills.
    Transfer = 1,
}

/// How many batches went to each queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Batches submitted to the compute queue.
    pub compute_batches: u64,
    /// Batches submitted to the transfer queue (zero where none is used).
    pub transfer_batches: u64,
}

/// One submitted operation: what the scheduler's handle points to.
pub(crate) struct Op {
    id: OpId,
    /// The operation, for the errors of its dependents: `kernel `name``, `copy`, ….
    pub(crate) label: Arc<str>,
    pub(crate) lane: usize,
    /// The value of its lane's timeline that its batch signals.
    pub(crate) value: u64,
    /// Whether a batch signalling `value` was submitted (false only where the device
    /// was lost first).
    pub(crate) submitted: bool,
    /// Submission order, to pick the latest of several waits.
    seq: u64,
    submitted_ns: u64,
    state: Mutex<OpState>,
    done: Condvar,
}

#[derive(Default)]
struct OpState {
    /// The operations it waits on, until its completion.
    waits: Vec<Arc<Op>>,
    /// Its error where it failed when submitted. Kept until the op is gone: a
    /// submission that waits on it reads it (`Op::failure`) to run nothing, and
    /// taking it before the result is set would let one in between see no failure
    /// and run.
    preset: Option<ExecError>,
    /// What must outlive its work (buffers, a pipeline, staging memory).
    keep: Vec<Box<dyn Any + Send + Sync>>,
    /// Its host-side finish, run after its device work succeeded.
    finish: Option<Finish>,
    /// Its command buffer and the queue (pool) it belongs to, returned to the pool
    /// once it ran.
    cmd: Option<(QueueKind, vk::CommandBuffer)>,
    /// Its result and end time, once reported.
    result: Option<(Result<(), ExecError>, u64)>,
}

impl Op {
    /// Its failure, where it is known to have failed (when submitted, or since).
    pub(crate) fn failure(&self) -> Option<ExecError> {
        let s = lock(&self.state);
        s.preset.clone().or_else(|| s.result.as_ref().and_then(|(r, _)| r.clone().err()))
    }

    /// Whether it has completed successfully (a wait on it needs no semaphore wait).
    pub(crate) fn succeeded(&self) -> bool {
        matches!(lock(&self.state).result, Some((Ok(()), _)))
    }

    /// Its result and end time, waiting for its completion thread to report it.
    pub(crate) fn outcome(&self) -> (Result<(), ExecError>, u64) {
        let mut s = lock(&self.state);
        loop {
            if let Some((r, t)) = &s.result {
                return (r.clone(), *t);
            }
            s = self.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What a submission becomes, before it is handed to its lane.
pub(crate) struct Planned {
    pub(crate) id: OpId,
    pub(crate) label: Arc<str>,
    pub(crate) lane: usize,
    pub(crate) waits: Vec<Arc<Op>>,
    pub(crate) preset: Option<ExecError>,
    pub(crate) keep: Vec<Box<dyn Any + Send + Sync>>,
    pub(crate) finish: Option<Finish>,
    /// The queue its batch goes to (that of `cmd`'s pool where it has one).
    pub(crate) queue: QueueKind,
    /// A command buffer of the lanes' pool for `queue`, returned to it once the
    /// batch ran.
    pub(crate) cmd: Option<vk::CommandBuffer>,
    /// A recorded command buffer the batch replays (kept by its owner, not returned).
    pub(crate) replay: Option<vk::CommandBuffer>,
}

/// The device-wide state completion threads share: where completions go, and
/// whether the device was lost.
pub(crate) struct Reporter {
    pub(crate) device: Arc<str>,
    ctx: DriverContext,
    lost: OnceLock<()>,
    spin: Duration,
}

impl Reporter {
    /// Whether the device was lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.get().is_some()
    }

    /// The error of an operation that `e` failed, with `message`. A lost device (or
    /// a queue that refused a batch, after which its timelines cannot advance) is
    /// reported as the Vulkan error once, then as [`ExecError::DeviceLost`].
    pub(crate) fn failed(&self, e: CallError, message: impl Into<String>, loses_device: bool) -> ExecError {
        if !(loses_device || e.is_device_lost()) {
            return e.into_exec(&self.device, message);
        }
        if self.lost.set(()).is_ok() {
            e.into_exec(&self.device, format!("{}; the device is lost", message.into()))
        } else {
            self.lost_error()
        }
    }

    /// The error of an operation submitted after the device was lost.
    pub(crate) fn lost_error(&self) -> ExecError {
        ExecError::DeviceLost { device: self.device.clone() }
    }
}

/// One lane: its timeline semaphore, the value its last batch signals, and the
/// channel to its completion thread.
struct Lane {
    sem: vk::Semaphore,
    last: AtomicU64,
    tx: Option<Sender<Arc<Op>>>,
}

/// Command buffers for operations, reused once they ran: a pool per queue used
/// (indexed by [`QueueKind`]; a command buffer runs only on a queue of its pool's
/// family), touched only on the submitting path (under its lock), which Vulkan
/// requires of recording.
pub(crate) struct Commands {
    pools: Vec<(vk::CommandPool, Vec<vk::CommandBuffer>)>,
}

/// The lanes, their completion threads, and the command buffers operations record.
pub(crate) struct Lanes {
    lanes: Vec<Lane>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
    seq: AtomicU64,
    reporter: Arc<Reporter>,
    pub(crate) commands: Arc<Mutex<Commands>>,
    /// Batches submitted per queue ([`QueueKind`] order).
    batches: [AtomicU64; 2],
    dev: Arc<Device>,
}

impl Lanes {
    /// `count` lanes, each with a completion thread reporting to `dctx`.
    pub(crate) fn new(
        dev: &Arc<Device>,
        count: usize,
        spin: Duration,
        dctx: DriverContext,
    ) -> Result<Self, ExecError> {
        let device = dev.name.clone();
        let reporter = Arc::new(Reporter { device: device.clone(), ctx: dctx, lost: OnceLock::new(), spin });
        let mut pools = Vec::new();
        for family in dev.families.sharing() {
            let info = vk::CommandPoolCreateInfo::default()
                .queue_family_index(family)
                .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
            // SAFETY: a live device and one of its families.
            match unsafe { dev.raw.create_command_pool(&info, None) }.call("vkCreateCommandPool") {
                Ok(pool) => pools.push((pool, Vec::new())),
                Err(e) => {
                    for (pool, _) in pools {
                        // SAFETY: created above, unused.
                        unsafe { dev.raw.destroy_command_pool(pool, None) };
                    }
                    return Err(e.into_exec(&device, "creating a command pool"));
                }
            }
        }
        let commands = Arc::new(Mutex::new(Commands { pools }));
        let mut this = Self {
            lanes: Vec::new(),
            threads: Vec::new(),
            next: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            reporter: reporter.clone(),
            commands: commands.clone(),
            batches: [AtomicU64::new(0), AtomicU64::new(0)],
            dev: dev.clone(),
        };
        for index in 0..count.max(1) {
            let mut kind = vk::SemaphoreTypeCreateInfo::default().semaphore_type(vk::SemaphoreType::TIMELINE);
            let info = vk::SemaphoreCreateInfo::default().push_next(&mut kind);
            // SAFETY: a live device; timeline semaphores are enabled.
            let sem = unsafe { dev.raw.create_semaphore(&info, None) }
                .call("vkCreateSemaphore")
                .map_err(|e| e.into_exec(&device, "creating a timeline semaphore"))?;
            let (tx, rx) = unbounded::<Arc<Op>>();
            let (d, r, c) = (dev.clone(), reporter.clone(), commands.clone());
            // A lane without its thread would accept work that never completes:
            // refuse the driver instead (the lanes made so far are dropped).
            let thread = std::thread::Builder::new()
                .name(format!("gantry-{device}-{index}"))
                .spawn(move || complete_in_order(d, sem, r, c, rx))
                .map_err(|e| ExecError::Driver {
                    device: device.clone(),
                    message: format!("could not start a completion thread: {e}"),
                });
            this.lanes.push(Lane { sem, last: AtomicU64::new(0), tx: None });
            let thread = thread?;
            this.lanes.last_mut().expect("just pushed").tx = Some(tx);
            this.threads.push(thread);
        }
        Ok(this)
    }

    pub(crate) fn reporter(&self) -> &Reporter {
        &self.reporter
    }

    /// The lane for an operation waiting on `waits` (see the module docs).
    pub(crate) fn pick(&self, waits: &[Arc<Op>]) -> usize {
        let latest = waits.iter().filter(|w| !w.succeeded()).max_by_key(|w| w.seq);
        match latest {
            Some(w) => w.lane,
            None => self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len(),
        }
    }

    /// The queue transfers (one-by-one copies and fills) go to.
    pub(crate) fn transfer_queue(&self) -> QueueKind {
        if self.dev.transfer_queue.is_some() {
            QueueKind::Transfer
        } else {
            QueueKind::Compute
        }
    }

    /// How many batches went to each queue so far.
    pub(crate) fn stats(&self) -> QueueStats {
        QueueStats {
            compute_batches: self.batches[QueueKind::Compute as usize].load(Ordering::Relaxed),
            transfer_batches: self.batches[QueueKind::Transfer as usize].load(Ordering::Relaxed),
        }
    }

    /// A command buffer, begun, from the (locked) pool of `queue` (which must be
    /// [`QueueKind::Compute`] or [`Lanes::transfer_queue`]).
    pub(crate) fn begin(
        &self,
        commands: &mut Commands,
        queue: QueueKind,
    ) -> Result<vk::CommandBuffer, CallError> {
        let (pool, free) = &mut commands.pools[queue as usize];
        let cmd = match free.pop() {
            Some(c) => c,
            None => {
                let info = vk::CommandBufferAllocateInfo::default()
                    .command_pool(*pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1);
                // SAFETY: the pool is locked by the caller.
                unsafe { self.dev.raw.allocate_command_buffers(&info) }.call("vkAllocateCommandBuffers")?[0]
            }
        };
        let begin = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: a command buffer of the locked pool, not in use (it was returned
        // after it ran, or is new); beginning resets it.
        match unsafe { self.dev.raw.begin_command_buffer(cmd, &begin) }.call("vkBeginCommandBuffer") {
            Ok(()) => Ok(cmd),
            Err(e) => {
                free.push(cmd);
                Err(e)
            }
        }
    }

    /// Submits `planned`'s batch (its command buffer, if any, after its lane's
    /// previous value and its unfinished waits) signalling its lane's next value,
    /// and hands it to the lane's completion thread. Returns its handle.
    pub(crate) fn submit(&self, mut planned: Planned, submitted_ns: u64) -> OpHandle {
        let lane = &self.lanes[planned.lane];
        let value = lane.last.load(Ordering::Relaxed) + 1;
        let mut submitted = false;
        if !self.reporter.is_lost() {
            let mut sems = vec![lane.sem];
            let mut values = vec![value - 1];
            if planned.preset.is_none() {
                for w in
                    planned.waits.iter().filter(|w| w.submitted && w.lane != planned.lane && !w.succeeded())
                {
                    sems.push(self.lanes[w.lane].sem);
                    values.push(w.value);
                }
            }
            let stages = vec![vk::PipelineStageFlags::ALL_COMMANDS; sems.len()];
            // A batch that failed when submitted runs nothing (its command buffer
            // may be half-recorded): it only advances the lane.
            let cmds: Vec<vk::CommandBuffer> = if planned.preset.is_none() {
                planned.cmd.or(planned.replay).into_iter().collect()
            } else {
                Vec::new()
            };
            let signal = [lane.sem];
            let signal_values = [value];
            let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
                .wait_semaphore_values(&values)
                .signal_semaphore_values(&signal_values);
            let batch = [vk::SubmitInfo::default()
                .wait_semaphores(&sems)
                .wait_dst_stage_mask(&stages)
                .command_buffers(&cmds)
                .signal_semaphores(&signal)
                .push_next(&mut timeline)];
            // A batch running nothing may go to either queue: the compute queue.
            let kind = if cmds.is_empty() { QueueKind::Compute } else { planned.queue };
            let queue = match (kind, &self.dev.transfer_queue) {
                (QueueKind::Transfer, Some(transfer)) => lock(transfer),
                _ => lock(&self.dev.queue),
            };
            // SAFETY: the queue is locked; the command buffer (if any) is recorded
            // and ended, from the pool of this queue's family; every semaphore is a
            // timeline of this device.
            match unsafe { self.dev.raw.queue_submit(*queue, &batch, vk::Fence::null()) }
                .call("vkQueueSubmit")
            {
                Ok(()) => {
                    submitted = true;
                    self.batches[kind as usize].fetch_add(1, Ordering::Relaxed);
                    lane.last.store(value, Ordering::Relaxed);
                }
                Err(e) => {
                    let error = self.reporter.failed(e, format!("submitting {}", planned.label), true);
                    planned.preset.get_or_insert(error);
                }
            }
        } else if planned.preset.is_none() {
            planned.preset = Some(self.reporter.lost_error());
        }
        let op = Arc::new(Op {
            id: planned.id,
            label: planned.label,
            lane: planned.lane,
            value,
            submitted,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            submitted_ns,
            state: Mutex::new(OpState {
                waits: planned.waits,
                preset: planned.preset,
                keep: planned.keep,
                finish: planned.finish,
                cmd: planned.cmd.map(|c| (planned.queue, c)),
                result: None,
            }),
            done: Condvar::new(),
        });
        let sent = lane.tx.as_ref().map(|tx| tx.send(op.clone()));
        if !matches!(sent, Some(Ok(()))) {
            // Only while the driver shuts down, when no one submits.
            finish(&self.dev, lane.sem, &self.reporter, &self.commands, &op, 0);
        }
        op
    }
}

impl Drop for Lanes {
    /// Closes the lanes and waits until every operation handed over has completed
    /// and been reported, then destroys the semaphores and the pool.
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            lane.tx = None;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let commands = lock(&self.commands);
        // SAFETY: nothing is in flight (every completion thread has finished, and a
        // lost device runs nothing); each object is destroyed once.
        unsafe {
            let _ = self.dev.raw.device_wait_idle();
            for lane in &self.lanes {
                self.dev.raw.destroy_semaphore(lane.sem, None);
            }
            for (pool, _) in &commands.pools {
                self.dev.raw.destroy_command_pool(*pool, None);
            }
        }
    }
}

/// A completion thread: reports its lane's operations in the order they were
/// submitted (the order they complete in), until the lane closes.
fn complete_in_order(
    dev: Arc<Device>,
    sem: vk::Semaphore,
    reporter: Arc<Reporter>,
    commands: Arc<Mutex<Commands>>,
    rx: Receiver<Arc<Op>>,
) {
    let mut last_ended = 0;
    loop {
        let mut next = Err(TryRecvError::Empty);
        spin_until(reporter.spin, || {
            next = rx.try_recv();
            next.is_ok()
        });
        let op = match next {
            Ok(op) => op,
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => match rx.recv() {
                Ok(op) => op,
                Err(_) => break,
            },
        };
        last_ended = finish(&dev, sem, &reporter, &commands, &op, last_ended);
    }
}

/// Waits until `sem` reaches `value`, polling for the spin window first.
fn wait_value(dev: &Device, sem: vk::Semaphore, value: u64, spin: Duration) -> Result<(), CallError> {
    // SAFETY (both calls): a live timeline semaphore of this device.
    let reached = || unsafe { dev.raw.get_semaphore_counter_value(sem) }.map_or(true, |v| v >= value);
    if spin_until(spin, reached) {
        // A lost device reads as reached: the wait below says so.
        if unsafe { dev.raw.get_semaphore_counter_value(sem) }.is_ok_and(|v| v >= value) {
            return Ok(());
        }
    }
    let (sems, values) = ([sem], [value]);
    let info = vk::SemaphoreWaitInfo::default().semaphores(&sems).values(&values);
    // SAFETY: as above.
    unsafe { dev.raw.wait_semaphores(&info, u64::MAX) }.call("vkWaitSemaphores")
}

/// Waits for `op` (its waits' results, then its value), runs its finish, sets its
/// result, wakes who waits on it, and sends its completion. Returns its end time.
fn finish(
    dev: &Device,
    sem: vk::Semaphore,
    reporter: &Reporter,
    commands: &Mutex<Commands>,
    op: &Op,
    last_ended: u64,
) -> u64 {
    let waits = std::mem::take(&mut lock(&op.state).waits);
    let mut started = op.submitted_ns.max(last_ended);
    let mut dependency: Option<(Arc<str>, ExecError)> = None;
    for w in &waits {
        let (result, ended) = w.outcome();
        started = started.max(ended);
        if let (Err(e), None) = (result, &dependency) {
            dependency = Some((w.label.clone(), e));
        }
    }
    drop(waits);
    let waited = op.submitted.then(|| wait_value(dev, sem, op.value, reporter.spin));
    let (preset, keep, finish, cmd) = {
        let mut s = lock(&op.state);
        (s.preset.clone(), std::mem::take(&mut s.keep), s.finish.take(), s.cmd.take())
    };
    let result = match (preset, dependency, waited) {
        (Some(e), _, _) => Err(e),
        (None, Some((label, cause)), _) => Err(cause.as_dependency_of(label)),
        (None, None, Some(Err(e))) => Err(reporter.failed(e, format!("waiting for {}", op.label), false)),
        (None, None, _) => {
            if let Some(f) = finish {
                f();
            }
            Ok(())
        }
    };
    if let Some((queue, cmd)) = cmd {
        // It ran (or was never submitted): the submitting path may reuse it.
        lock(commands).pools[queue as usize].1.push(cmd);
    }
    drop(keep);
    let ended = reporter.ctx.stamp_ns().max(started);
    lock(&op.state).result = Some((result.clone(), ended));
    op.done.notify_all();
    reporter.ctx.complete(Completion {
        op: op.id,
        result,
        started_ns: started,
        ended_ns: ended,
        lane: op.lane as u32 + 1,
    });
    ended
}
