//! What user handles share with the runtime, and the flushes that run its
//! schedule: on the scheduler thread, or on waiting threads in manual mode;
//! back-pressure on submission; stopping on the scheduler's own failure.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use bevy_ecs::world::World;
use gantry_components::{
    EventShared, EventStatus, FailureSync, HandBack, Mailbox, Message, Stats, WorkLists,
};
use gantry_driver::sync::atomic::Ordering;
use gantry_driver::sync::channel::{Receiver, Select, Sender};
use gantry_driver::sync::thread;
use gantry_driver::sync::{self, safety_net, spin_until, Condvar, Mutex};
use gantry_driver::{Completion, DeviceInfo, Driver};
use gantry_host::ClosureFusion;

use crate::error::{Error, Result};

use super::{DeviceId, Mode};

/// How often a submitter asleep for room in the mailbox looks whether the scheduler
/// stopped (failed, or the runtime is being dropped): a take wakes it otherwise.
const ROOM_RECHECK: Duration = Duration::from_millis(1);

/// The world and its stages.
pub(crate) struct Core {
    pub(crate) world: World,
    pub(crate) stages: gantry_systems::Stages,
}

/// What user handles share with the runtime.
pub(crate) struct Shared {
    pub(crate) id: u64,
    pub(crate) mode: Mode,
    /// User messages on their way to the ingest stage.
    pub(crate) mailbox: Arc<Mailbox>,
    /// What the stages give back to user threads to free (threaded mode): freed on
    /// every send and after every wait ([`Shared::release`]).
    pub(super) hand_back: Option<Arc<HandBack>>,
    /// `None` once the runtime has shut down.
    pub(crate) core: Mutex<Option<Core>>,
    /// Admits messages until the runtime drops, and counts them.
    pub(super) senders: Senders,
    /// The runtime's clock: events' submission times where it profiles.
    pub(crate) clock: gantry_driver::Clock,
    pub(crate) next_id: AtomicU64,
    pub(crate) devices: Vec<DeviceInfo>,
    /// The drivers, by device id, for work that needs no scheduler (patching a command
    /// graph's command buffers). Weak: the scheduler's world owns them and stops them
    /// when the runtime drops.
    pub(crate) drivers: Vec<std::sync::Weak<dyn Driver>>,
    /// Per device: set by the scheduler once the device is lost.
    pub(crate) lost: Vec<Arc<std::sync::atomic::AtomicBool>>,
    /// What the scheduler thread last saw (threaded mode).
    pub(super) idle: Mutex<IdleState>,
    pub(super) idle_cv: Condvar,
    pub(super) done_rx: Receiver<Completion>,
    pub(super) wake_tx: Sender<()>,
    /// Fusion warnings still to print (shared with the scheduler).
    pub(crate) fusion_warnings: Arc<std::sync::atomic::AtomicUsize>,
    /// The default fusion compiler, for its cache statistics.
    pub(super) closure_fusion: Option<Arc<ClosureFusion>>,
    /// How long a thread about to block spins first.
    pub(super) spin: Duration,
    /// Why the scheduler stopped, once it failed: then no flush runs again.
    pub(super) failure: std::sync::OnceLock<String>,
    /// Failures of user systems not yet taken by [`Runtime::take_system_errors`].
    pub(super) system_errors: Mutex<Vec<Error>>,
    /// Pending commands past which `submit` waits.
    pub(super) max_pending: u64,
    /// Per device, from which size a fusion window pays to fuse (every window, where
    /// the runtime fuses unprofitable chains), read by `submit` on the user's thread.
    /// The world holds the same values as `Fusions::thresholds`, for graph finalize.
    pub(crate) fusion_windows: Vec<gantry_driver::fusion::WindowThresholds>,
    /// The active fusions, for cancellations at the call.
    pub(crate) fusing: crate::fusing::Fusing,
    /// Failures kept on in-order queues; waits and flushes clear them (`synced`).
    pub(super) failures: Arc<FailureSync>,
}

/// What every message sent writes. On cache lines of its own: the scheduler thread
/// spins on the receivers beside it in [`Shared`] while it waits for the next
/// message, and a send's read-modify-writes would otherwise take that line away
/// from it, and back, three times per message.
#[derive(Default)]
#[repr(align(128))]
pub(super) struct Senders {
    pub(super) gate: Gate,
    /// Messages sent to the scheduler.
    pub(super) sent: sync::atomic::AtomicU64,
}

/// Admits senders until closed, and counts those between admission and the end of
/// their send. One word, so that admission and closing are ordered by the atomic
/// read-modify-writes themselves: a sender either is refused or is counted before
/// the close, and then [`Gate::wait_for_senders`] waits for its message.
#[derive(Default)]
pub(super) struct Gate(sync::atomic::AtomicU64);

impl Gate {
    const CLOSED: u64 = 1 << 63;

    /// Admits a sender (call [`Gate::leave`] after the send); false once closed.
    pub(super) fn enter(&self) -> bool {
        if self.0.fetch_add(1, Ordering::Acquire) & Self::CLOSED == 0 {
            return true;
        }
        self.leave();
        false
    }

    pub(super) fn leave(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }

    pub(super) fn close(&self) {
        self.0.fetch_or(Self::CLOSED, Ordering::AcqRel);
    }

    pub(super) fn is_closed(&self) -> bool {
        self.0.load(Ordering::Acquire) & Self::CLOSED != 0
    }

    /// After [`Gate::close`]: returns once every admitted send has finished. Sends
    /// do not block (the channels are unbounded), so this waits a few instructions.
    pub(super) fn wait_for_senders(&self) {
        while self.0.load(Ordering::Acquire) != Self::CLOSED {
            thread::yield_now();
        }
    }
}

/// The scheduler thread's last report: messages ingested, and whether it was idle.
pub(super) struct IdleState {
    pub(super) ingested: u64,
    pub(super) idle: bool,
}

/// How one flush left things (read while holding the world).
#[derive(Clone, Copy)]
pub(super) struct Progress {
    /// Another flush would make progress without new input.
    pub(super) has_work: bool,
    /// Nothing queued, running on a driver, or waiting in a channel.
    pub(super) idle: bool,
    /// Messages ingested so far.
    pub(super) ingested: u64,
}

impl Shared {
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
        self.mailbox.post(msg);
        self.senders.sent.fetch_add(1, Ordering::AcqRel);
        self.senders.gate.leave();
        self.release();
        Ok(())
    }

    /// Frees, on this thread, what the stages gave back (a load when nothing waits).
    pub(super) fn release(&self) {
        if let Some(hand_back) = &self.hand_back {
            hand_back.release();
        }
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
    pub(super) fn throttle(&self) {
        // Measuring the channel costs more than a send: look every 64 messages, so
        // the limit holds within 64.
        if !self.senders.sent.load(Ordering::Relaxed).is_multiple_of(64) {
            return;
        }
        let over = || self.mailbox.len() as u64 >= self.max_pending;
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
            // Asleep until the scheduler's next take makes room; the timeout only
            // lets it see a scheduler that stopped taking.
            Mode::Threaded => {
                while over() && self.failure.get().is_none() && !self.senders.gate.is_closed() {
                    self.mailbox.wait_for_room(self.max_pending as usize, ROOM_RECHECK);
                }
            }
        }
    }

    /// Runs the schedule once. `None` if the runtime has shut down or failed.
    pub(super) fn flush_once(&self) -> Option<Progress> {
        let mut guard = self.core.lock();
        self.flush_locked(&mut guard)
    }

    /// [`Shared::flush_once`] with the core's lock held. A user system that fails is
    /// reported and the flush goes on; a failure of the scheduler's own systems stops
    /// it for good ([`Shared::fail`]).
    pub(super) fn flush_locked(&self, guard: &mut Option<Core>) -> Option<Progress> {
        if self.failure.get().is_some() {
            return None;
        }
        let core = guard.as_mut()?;
        let report = core.stages.flush(&mut core.world);
        if !report.user.is_empty() {
            core.world.resource_mut::<Stats>().system_failures += report.user.len() as u64;
            let mut errors = self.system_errors.lock();
            for fault in report.user {
                let (stage, message) = (fault.stage, fault.message);
                tracing::error!(?stage, "a system added to the flush schedule failed: {message}");
                errors.push(Error::SystemFailed { stage, message });
            }
        }
        if let Some(message) = report.fatal {
            self.fail(&mut core.world, message);
            return None;
        }
        let has_work = core.world.resource::<WorkLists>().has_work() || !self.mailbox.is_empty();
        let stats = core.world.resource::<Stats>();
        let idle = !has_work && stats.in_driver == 0 && self.done_rx.is_empty();
        Some(Progress { has_work, idle, ingested: stats.messages })
    }

    /// Stops the scheduler after a failure of its own: refuses new work, fails every
    /// command it holds and every message still queued, and wakes every waiter. The
    /// world stays for inspection ([`Runtime::stats`], [`Runtime::with_world`]); no
    /// flush runs on it again.
    pub(super) fn fail(&self, world: &mut World, message: String) {
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
        let mut queued = std::collections::VecDeque::new();
        self.mailbox.take(usize::MAX, &mut queued);
        for msg in queued {
            gantry_components::fail_message(msg, &error);
        }
        let mut state = self.idle.lock();
        state.idle = true;
        state.ingested = u64::MAX;
        self.idle_cv.notify_all();
    }

    /// Blocks until a message or completion (or a wake-up) arrives, or `timeout`
    /// passes; `None` waits for input without a timeout.
    pub(super) fn block_for_input(&self, wake: Option<&Receiver<()>>, timeout: Option<Duration>) {
        let mut sel = Select::new();
        sel.recv(self.mailbox.bell());
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
        self.release();
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

    pub(super) fn block_for(&self, ev: &EventShared, status: EventStatus) -> Result<()> {
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
        self.release();
        idle
    }

    pub(super) fn until_idle(&self) -> Result<()> {
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

    pub(super) fn scheduler_loop(self: Arc<Self>, wake: Receiver<()>) {
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

    pub(super) fn flush_loop(&self, wake: &Receiver<()>) {
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
                if self.mailbox.is_empty() && self.done_rx.is_empty() {
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
            let input = || !(self.mailbox.is_empty() && self.done_rx.is_empty() && wake.is_empty());
            if !spin_until(self.spin, input) {
                // Nobody submits: what no user thread took is freed here, before the
                // scheduler sleeps.
                self.release();
                self.block_for_input(Some(wake), safety_net(Duration::from_millis(100)));
            }
            while wake.try_recv().is_ok() {}
        }
    }
}
