//! Fusion lists (the DPC++ kernel-fusion design, "Scheduler Integration"): one entity
//! per fusing queue, holding its kernel commands in order and, once the fusion has
//! ended, the fusion command whose event `submit` returned while fusing (the fused
//! kernel, or a marker after the kernels of a cancelled list); the shared state a queue
//! and the scheduler both change.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::entity::Entity;
use bevy_ecs::resource::Resource;
use gantry_driver::fusion::{
    Fused, FusionCompiler, FusionError, FusionRequest, FusionWarning, KeptOnFailure, WindowThresholds,
};
use gantry_driver::sync::atomic::{AtomicU64, AtomicU8};
use gantry_driver::sync::Mutex;
use smallvec::SmallVec;

use crate::event::EventShared;
use crate::handle::{EntitySlot, QueueCore};

/// Where a fusion is, as its queue sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FusionStatus {
    /// Kernels submitted to the queue join the list.
    Active,
    /// Cancelled (explicitly or early): the kernels run unfused, in order.
    Cancelled,
    /// `complete_fusion` was called; the outcome says whether the kernels were fused.
    Completed,
    /// By the window's first kernel, fusing would not pay on its device
    /// ([`WindowThresholds`]: launch-bound, or global memory the caches hold): the
    /// queue is still in fusion mode, but its kernels run as they are submitted, and
    /// the outcome says why. The scheduler never hears of the fusion.
    PassingThrough,
}

impl FusionStatus {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => FusionStatus::Active,
            1 => FusionStatus::Cancelled,
            2 => FusionStatus::Completed,
            _ => FusionStatus::PassingThrough,
        }
    }

    /// Whether the queue is in fusion mode: between `start_fusion` and
    /// `complete_fusion`, unless cancelled.
    pub fn is_open(self) -> bool {
        matches!(self, FusionStatus::Active | FusionStatus::PassingThrough)
    }
}

/// Why a fusion was cancelled.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelReason {
    /// `cancel_fusion` was called.
    Requested,
    /// The host waited on an event returned in fusion mode.
    HostWait,
    /// The host waited on the fusing queue.
    QueueWait,
    /// A command that is not fused depends on a listed kernel (by a requirement or an
    /// event): a host access, a host task, a copy, a fill, a barrier, a command on
    /// another queue, or a kernel released by another fusion's cancellation.
    Dependent {
        /// The dependent command: the user's, also where the scheduler's memory move
        /// for it is what depends on the kernel.
        command: Arc<str>,
        /// Its kind.
        kind: &'static str,
    },
    /// The user dropped a buffer a listed kernel uses.
    BufferDropped {
        /// The buffer.
        buffer: u64,
    },
    /// The user dropped the queue.
    QueueDropped,
    /// A kernel fusing on another queue depends on this list while this list depends
    /// on that queue's: fusing both would form a cycle, so this one is cancelled.
    Cycle {
        /// The other fusing queue.
        other_queue: u64,
    },
    /// A listed kernel failed before it could be fused.
    KernelFailed,
    /// The fusion compiler refused the kernels.
    Failed(FusionError),
    /// `complete_fusion` found no kernel to fuse.
    Empty,
}

impl std::fmt::Display for CancelReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CancelReason::Requested => write!(f, "cancel_fusion was called"),
            CancelReason::HostWait => write!(f, "the host waited on an event returned in fusion mode"),
            CancelReason::QueueWait => write!(f, "the host waited on the queue"),
            CancelReason::Dependent { command, kind } => {
                write!(f, "{kind} `{command}` depends on a kernel in the fusion list")
            }
            CancelReason::BufferDropped { buffer } => {
                write!(f, "buffer {buffer}, used by a listed kernel, was dropped")
            }
            CancelReason::QueueDropped => write!(f, "the queue was dropped"),
            CancelReason::Cycle { other_queue } => {
                write!(f, "fusing queue {other_queue} depends on this fusion and this one on it (a cycle)")
            }
            CancelReason::KernelFailed => write!(f, "a listed kernel failed before fusion"),
            CancelReason::Failed(e) => write!(f, "the kernels cannot be fused: {e}"),
            CancelReason::Empty => write!(f, "the fusion list is empty"),
        }
    }
}

/// How a fusion ended.
#[derive(Clone, Debug, PartialEq)]
pub enum FusionOutcome {
    /// The kernels ran as one fused kernel.
    Fused {
        /// How many kernels were fused.
        kernels: usize,
        /// Whether the fusion compiler answered from its cache.
        cached: bool,
        /// What was not done as asked (dropped promotions).
        warnings: Vec<FusionWarning>,
    },
    /// The kernels ran unfused.
    Cancelled(CancelReason),
}

/// One fusion of one queue, shared by the queue (user threads) and the scheduler.
/// Transitions happen under its lock, and the queue sends a kernel to the list while
/// holding it, so both sides agree on which kernels belong to the list.
///
/// The status and the kernel count are atomics, written under the lock and read
/// without it: every kernel submit and every host wait asks for the status, and a
/// lock and an unlock are two locked operations (their cost: `docs/PERFORMANCE.md`).
/// A read without the lock sees the value before or after a concurrent transition,
/// as a read under the lock would.
#[derive(Debug)]
pub struct FusionShared {
    /// The queue. `start_fusion` sends no message of its own: the scheduler starts
    /// the fusion's list when the first message about it arrives (its first kernel,
    /// or its completion or cancellation), so a fusion costs one message, and one
    /// scheduler wake-up, fewer. Nothing can concern the list before that message.
    pub queue: Arc<QueueCore>,
    /// The fusion's event: what `submit` returns while fusing, and `complete_fusion`
    /// after; the fused kernel's, or the marker's of a cancelled list.
    pub event: Arc<EventShared>,
    /// The fusion-list entity, once ingested.
    pub list: EntitySlot,
    /// The outcome, once known; its lock orders the transitions.
    outcome: Mutex<Option<FusionOutcome>>,
    /// The [`FusionStatus`], as its discriminant.
    status: AtomicU8,
    /// Kernels the queue sent to the list.
    sent: AtomicU64,
}

impl FusionShared {
    /// A new, active fusion.
    pub fn new(queue: Arc<QueueCore>, event: Arc<EventShared>) -> Self {
        Self {
            queue,
            event,
            list: EntitySlot::default(),
            outcome: Mutex::new(None),
            status: AtomicU8::new(FusionStatus::Active as u8),
            sent: AtomicU64::new(0),
        }
    }

    /// Makes `fusion` a new, active fusion whose event is pending, submitted at
    /// `submitted_ns`, in place, where nothing else holds it or its event (a window
    /// that passed its kernels through is never handed to the scheduler, and its event
    /// to nobody); returns whether it did. `start_fusion` then allocates nothing, as
    /// pooled events ([`event_pool`](crate::event_pool)) do not.
    pub fn renew(fusion: &mut Arc<FusionShared>, submitted_ns: u64) -> bool {
        let Some(f) = Arc::get_mut(fusion) else { return false };
        let Some(event) = Arc::get_mut(&mut f.event) else { return false };
        *event = EventShared::new(event.name.clone(), event.runtime, submitted_ns);
        let (queue, event) = (f.queue.clone(), f.event.clone());
        *f = FusionShared::new(queue, event);
        true
    }

    /// The status.
    pub fn status(&self) -> FusionStatus {
        FusionStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    /// Sets the status; the caller holds the outcome's lock.
    fn set_status(&self, status: FusionStatus) {
        self.status.store(status as u8, Ordering::Release);
    }

    /// The outcome, once known.
    pub fn outcome(&self) -> Option<FusionOutcome> {
        self.outcome.lock().clone()
    }

    /// Kernels sent to the list so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Acquire)
    }

    /// Runs `send(item)` (which sends a kernel to the list) if the fusion is active,
    /// counting the kernel; hands `item` back (and runs nothing) otherwise.
    pub fn send_kernel<T, R>(&self, item: T, send: impl FnOnce(T) -> R) -> Result<R, T> {
        let _transitions = self.outcome.lock();
        if self.status() != FusionStatus::Active {
            return Err(item);
        }
        let r = send(item);
        // (A plain store: only this lock's holder writes it.)
        self.sent.store(self.sent.load(Ordering::Relaxed) + 1, Ordering::Release);
        Ok(r)
    }

    /// Runs `send` (which sends the completion) and marks the fusion completed, if it is
    /// active.
    pub fn complete<R>(&self, send: impl FnOnce() -> R) -> Option<R> {
        let _transitions = self.outcome.lock();
        if self.status() != FusionStatus::Active {
            return None;
        }
        let r = send();
        self.set_status(FusionStatus::Completed);
        Some(r)
    }

    /// Turns an active fusion that has no kernel yet into one that passes its kernels
    /// through ([`FusionStatus::PassingThrough`]), with `outcome`; returns whether it
    /// did. Its event completes now: the fusion never has a command, and the kernels
    /// it passes through carry events of their own.
    pub fn pass_through(&self, outcome: FusionOutcome) -> bool {
        let mut slot = self.outcome.lock();
        if self.status() != FusionStatus::Active || self.sent() != 0 {
            return false;
        }
        *slot = Some(outcome);
        self.set_status(FusionStatus::PassingThrough);
        self.event.finish(Ok(()), 0, 0);
        true
    }

    /// Ends a fusion that passes its kernels through, as `status` (completed, or
    /// cancelled: its outcome stays the reason it passed them through); returns
    /// whether it was one.
    pub fn end_passing(&self, status: FusionStatus) -> bool {
        let _transitions = self.outcome.lock();
        if self.status() != FusionStatus::PassingThrough {
            return false;
        }
        self.set_status(status);
        true
    }

    /// Cancels the fusion unless it has already ended, running `send` (which tells the
    /// scheduler) under the lock. A completed fusion not yet fused can still be
    /// cancelled (by the scheduler). Returns whether this call cancelled it. (A fusion
    /// that passes its kernels through ends with [`FusionShared::end_passing`].)
    pub fn cancel(&self, reason: CancelReason, send: impl FnOnce()) -> bool {
        let mut outcome = self.outcome.lock();
        if self.status() == FusionStatus::Cancelled || outcome.is_some() {
            return false;
        }
        send();
        self.set_status(FusionStatus::Cancelled);
        *outcome = Some(FusionOutcome::Cancelled(reason));
        true
    }

    /// Records a successful fusion.
    pub fn fused(&self, outcome: FusionOutcome) {
        *self.outcome.lock() = Some(outcome);
    }
}

/// What `complete_fusion` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusionProps {
    /// Insert a work-group barrier between the fused kernels (off: `no_barriers`).
    pub barriers: bool,
}

impl Default for FusionProps {
    fn default() -> Self {
        Self { barriers: true }
    }
}

/// Where a fusion list is, as the scheduler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListStatus {
    /// Collecting kernels; they are withheld from enqueue.
    Active,
    /// Its kernels were released unfused.
    Cancelled,
    /// Its kernels were replaced by the fused kernel.
    Completed,
    /// A newer fusion started on the queue: the list goes once its command has.
    Delete,
}

/// A fusion list: one per fusing queue (the DPC++ kernel-fusion design, `KernelFusionCommand`).
#[derive(Component, Debug)]
pub struct FusionList {
    /// The shared state.
    pub shared: Arc<FusionShared>,
    /// The queue.
    pub queue: Arc<QueueCore>,
    /// Where it is.
    pub status: ListStatus,
    /// The fusion command, once there is one: a fused list's first kernel becomes the
    /// fused kernel and stands for it; a cancelled list spawns a marker that completes
    /// after the listed kernels. (None while the list collects kernels: a fusion that
    /// is fused never spawns a command of its own.)
    pub command: Option<Entity>,
    /// The sequence number of the first message about the fusion (its command's, if
    /// one is spawned).
    pub seq: u64,
    /// Whether the fusion command is still held back (until the list ends and every
    /// kernel the queue sent has been ingested).
    pub command_held: bool,
    /// The listed kernel commands, in submission order.
    pub kernels: Vec<Entity>,
    /// Listed kernels withheld from enqueue (released on cancel, replaced on fuse).
    pub held: Vec<Entity>,
    /// Buffers the listed kernels use.
    pub buffers: SmallVec<[u64; 8]>,
    /// Other active lists some listed kernel depends on.
    pub deps: SmallVec<[ListRef; 2]>,
    /// Which fusion of its queue this list holds: [`FusionList::restart`] counts up,
    /// so a [`ListRef`] to an earlier fusion no longer matches.
    pub epoch: u32,
    /// `complete_fusion` was ingested: commands submitted from this sequence number on
    /// come after the fusion and do not cancel it.
    pub complete: Option<(u64, FusionProps)>,
    /// A cancellation asked for by a message (user cancel, buffer or queue dropped).
    pub cancel: Option<CancelReason>,
    /// What a failure of the fused kernel keeps, when it could undo a placement one
    /// of its kernels made (see `retire`): a driver that reran them unfused says
    /// which arguments they still wrote ([`KeptOnFailure::kept`]).
    pub unfused: Option<Arc<dyn KeptOnFailure>>,
}

impl FusionList {
    /// A list for the fusion `shared` of `queue`, started by message number `seq`.
    pub fn new(shared: Arc<FusionShared>, queue: Arc<QueueCore>, seq: u64) -> Self {
        Self {
            shared,
            queue,
            status: ListStatus::Active,
            command: None,
            seq,
            command_held: true,
            kernels: Vec::new(),
            held: Vec::new(),
            buffers: SmallVec::new(),
            deps: SmallVec::new(),
            epoch: 0,
            complete: None,
            cancel: None,
            unfused: None,
        }
    }

    /// Makes this list, ended and its command gone, the list of a new fusion: as
    /// [`FusionList::new`], keeping the vectors' memory.
    pub fn restart(&mut self, shared: Arc<FusionShared>, queue: &Arc<QueueCore>, seq: u64) {
        self.shared = shared;
        // (The same queue, whose list this is, in all but odd cases: a handle cloned
        // and dropped is two locked operations.)
        if !Arc::ptr_eq(&self.queue, queue) {
            self.queue = queue.clone();
        }
        self.status = ListStatus::Active;
        self.command = None;
        self.seq = seq;
        self.command_held = true;
        self.kernels.clear();
        self.held.clear();
        self.buffers.clear();
        self.deps.clear();
        self.epoch = self.epoch.wrapping_add(1);
        self.complete = None;
        self.unfused = None;
        self.cancel = None;
    }
}

/// A reference to one fusion's list: the entity and its epoch (a queue's list entity
/// is reset for the queue's next fusion once it has ended).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListRef {
    /// The list entity.
    pub list: Entity,
    /// Its [`FusionList::epoch`] when referred to.
    pub epoch: u32,
}

/// Marks a kernel command submitted to a fusion list.
#[derive(Component, Clone, Copy, Debug)]
pub struct InFusion {
    /// The list.
    pub list: Entity,
}

/// A device's fusion compilers, tried in order.
pub type Compilers = SmallVec<[Arc<dyn FusionCompiler>; 1]>;

/// The fusion machinery: the compilers, the lists and how many warnings may still be
/// printed.
#[derive(Resource)]
pub struct Fusions {
    /// Turns fusion lists into kernels: each device's compilers (by device id; one entry
    /// per device, empty where nothing fuses its kernels).
    pub compilers: Vec<Compilers>,
    /// From which size fusing pays on each device (by device id): its driver's
    /// [`Capabilities::fusion_window`](gantry_driver::Capabilities::fusion_window) or the
    /// runtime's override. Graph finalize judges recorded chains by it.
    pub thresholds: Vec<WindowThresholds>,
    /// The current list of each queue (by queue id).
    pub by_queue: HashMap<u64, Entity>,
    /// Lists still collecting kernels.
    pub active: Vec<Entity>,
    /// Lists with a pending action (a completion or a message-driven cancellation) or a
    /// held fusion command.
    pub pending: Vec<Entity>,
    /// Lists marked for deletion, despawned once their command has finished.
    pub deleting: Vec<Entity>,
    /// Warnings still to print (shared with the runtime's user-side warnings).
    pub warnings: Arc<AtomicUsize>,
}

impl Fusions {
    /// No lists yet.
    pub fn new(
        compilers: Vec<Compilers>,
        thresholds: Vec<WindowThresholds>,
        warnings: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            compilers,
            thresholds,
            by_queue: HashMap::new(),
            active: Vec::new(),
            pending: Vec::new(),
            deleting: Vec::new(),
            warnings,
        }
    }
}

/// A device's fusion compilers: its driver's own, then `closure` if it runs closure
/// kernels.
pub fn device_compilers(driver: &dyn gantry_driver::Driver, closure: &Arc<dyn FusionCompiler>) -> Compilers {
    let mut compilers: Compilers = driver.fusion_compilers().into_iter().collect();
    if driver.info().caps.image_kinds.contains(&gantry_driver::ImageKind::Closure) {
        compilers.push(closure.clone());
    }
    compilers
}

/// Fuses `request` with the first of `compilers` (a device's, `device` names it in
/// errors) whose image kind every listed kernel has; none is a typed reason.
pub fn fuse_with(
    compilers: &[Arc<dyn FusionCompiler>],
    device: &str,
    request: &FusionRequest,
) -> Result<Fused, FusionError> {
    let takes = |c: &Arc<dyn FusionCompiler>| {
        request.kernels.iter().all(|k| k.kernel.kinds().any(|i| i == c.image_kind()))
    };
    match compilers.iter().find(|c| takes(c)) {
        Some(c) => c.fuse(request),
        None => {
            let first_kind = compilers.first().map(|c| c.image_kind());
            let missing = request
                .kernels
                .iter()
                .find(|k| first_kind.is_none_or(|kind| !k.kernel.kinds().any(|i| i == kind)))
                .or(request.kernels.first())
                .ok_or(FusionError::Empty)?;
            let kinds: Vec<String> = missing.kernel.kinds().map(|k| k.to_string()).collect();
            Err(FusionError::NoCompiler {
                device: device.to_string(),
                kernel: missing.kernel.name.to_string(),
                kinds: if kinds.is_empty() { "no image".into() } else { kinds.join(", ") },
            })
        }
    }
}

/// Prints a fusion warning through `tracing` while the budget lasts (set by
/// `GANTRY_FUSION_WARNINGS` or the runtime builder).
pub fn warn_fusion(budget: &AtomicUsize, message: std::fmt::Arguments<'_>) {
    let left = budget.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    if left.is_ok() {
        tracing::warn!("{message}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Warnings stop once the budget is spent; the budget never wraps.
    #[test]
    fn warnings_are_capped_by_the_budget() {
        let budget = AtomicUsize::new(2);
        for _ in 0..5 {
            warn_fusion(&budget, format_args!("fusion warning"));
        }
        assert_eq!(budget.load(Ordering::Relaxed), 0);
    }

    /// Kernels are counted only while the fusion is active; a cancelled one hands the
    /// kernel back, and a fused outcome is final.
    #[test]
    fn shared_state_transitions() {
        let queue = Arc::new(QueueCore { id: 1, device: 0, in_order: false, entity: Default::default() });
        let f = FusionShared::new(queue, Arc::new(EventShared::new("fusion".into(), 0, 0)));
        assert_eq!(f.send_kernel(7, |k| k * 2), Ok(14));
        assert_eq!(f.sent(), 1);
        assert!(f.cancel(CancelReason::Requested, || {}));
        assert!(!f.cancel(CancelReason::HostWait, || {}), "already cancelled");
        assert_eq!(f.send_kernel(7, |k| k * 2), Err(7));
        assert_eq!(f.sent(), 1);
        assert_eq!(f.outcome(), Some(FusionOutcome::Cancelled(CancelReason::Requested)));
    }

    /// A fusion nobody else holds is renewed in place, pending and active again; one
    /// whose event someone holds is not.
    #[test]
    fn only_a_fusion_nobody_holds_is_renewed() {
        let queue = Arc::new(QueueCore { id: 1, device: 0, in_order: false, entity: Default::default() });
        let mut f = Arc::new(FusionShared::new(queue, Arc::new(EventShared::new("fusion".into(), 0, 5))));
        assert!(f.pass_through(FusionOutcome::Cancelled(CancelReason::Empty)));
        assert!(f.end_passing(FusionStatus::Completed));
        let before = Arc::as_ptr(&f);
        assert!(FusionShared::renew(&mut f, 9));
        assert_eq!(Arc::as_ptr(&f), before, "in place");
        assert_eq!((f.status(), f.sent(), f.outcome()), (FusionStatus::Active, 0, None));
        assert_eq!((f.event.status(), f.event.timestamps().submitted_ns), (crate::EventStatus::Pending, 9));

        let held = f.event.clone();
        assert!(!FusionShared::renew(&mut f, 10), "its event is held");
        drop(held);
        let other = f.clone();
        assert!(!FusionShared::renew(&mut f, 10), "the fusion is held");
        drop(other);
        assert!(FusionShared::renew(&mut f, 10));
    }

    /// Only an active fusion with no kernel yet passes its kernels through; its event
    /// completes at once, it stays open (in fusion mode) until it ends, takes no
    /// kernel, and keeps the reason it passed them through as its outcome.
    #[test]
    fn passing_through_is_decided_before_the_first_kernel() {
        let queue = Arc::new(QueueCore { id: 1, device: 0, in_order: false, entity: Default::default() });
        let new = || FusionShared::new(queue.clone(), Arc::new(EventShared::new("fusion".into(), 0, 0)));
        let reason = FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Empty));

        let listed = new();
        assert_eq!(listed.send_kernel(1, |k| k), Ok(1));
        assert!(!listed.pass_through(reason.clone()), "a kernel is listed already");
        assert_eq!(listed.status(), FusionStatus::Active);

        let f = new();
        assert!(!f.end_passing(FusionStatus::Completed), "not passing yet");
        assert!(f.pass_through(reason.clone()));
        assert_eq!(f.status(), FusionStatus::PassingThrough);
        assert!(f.status().is_open());
        assert_eq!(f.event.status(), crate::EventStatus::Complete);
        assert_eq!(f.send_kernel(7, |k| k), Err(7), "its kernels are not listed");
        assert!(!f.cancel(CancelReason::Requested, || panic!("nothing to tell the scheduler")));
        assert!(f.end_passing(FusionStatus::Cancelled));
        assert!(!f.status().is_open());
        assert!(!f.end_passing(FusionStatus::Completed), "ended once");
        assert_eq!(f.outcome(), Some(reason));
    }
}
