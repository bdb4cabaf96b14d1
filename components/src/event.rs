//! Events: completion state shared between the scheduler and user threads.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

// The atomics threads wait on come from `sync` (shuttle's under `--cfg shuttle`);
// the timestamps nobody waits on are plain.
use gantry_driver::sync::atomic::{self as waited, AtomicU8, Ordering};
use gantry_driver::sync::{Condvar, Mutex};
use gantry_driver::ExecError;

use crate::handle::EntitySlot;

/// Where a command is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventStatus {
    /// Submitted to the runtime, waiting for dependencies.
    Pending = 0,
    /// Handed to a driver.
    Submitted = 1,
    /// Running (host accesses: the user holds the data).
    Running = 2,
    /// Finished successfully.
    Complete = 3,
    /// Finished with an error.
    Failed = 4,
}

impl EventStatus {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Pending,
            1 => Self::Submitted,
            2 => Self::Running,
            3 => Self::Complete,
            _ => Self::Failed,
        }
    }
    /// Complete or failed.
    pub fn is_final(self) -> bool {
        self >= EventStatus::Complete
    }
}

/// Profiling timestamps in nanoseconds: submission on the runtime's clock, start and
/// end on the executing device's clock (real time for the CPU driver, virtual time
/// for the simulated device).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timestamps {
    /// When `submit` was called.
    pub submitted_ns: u64,
    /// When execution started.
    pub started_ns: u64,
    /// When execution ended.
    pub ended_ns: u64,
}

/// The shared state of one event.
#[derive(Debug)]
pub struct EventShared {
    status: AtomicU8,
    error: OnceLock<ExecError>,
    times: [AtomicU64; 3],
    /// Threads blocked in [`EventShared::block_until`], counted per awaited status
    /// (see [`Waiters`]): a status change wakes only those it satisfies, so a host
    /// waiting for completion sleeps through the submission.
    waiters: waited::AtomicU64,
    lock: Mutex<()>,
    cond: Condvar,
    /// Name of the command, for errors.
    pub name: Arc<str>,
    /// The command entity while it is alive.
    pub command: EntitySlot,
    /// Which runtime it belongs to.
    pub runtime: u64,
}

impl EventShared {
    /// A pending event submitted at `submitted_ns`.
    pub fn new(name: Arc<str>, runtime: u64, submitted_ns: u64) -> Self {
        Self {
            status: AtomicU8::new(EventStatus::Pending as u8),
            error: OnceLock::new(),
            times: [AtomicU64::new(submitted_ns), AtomicU64::new(0), AtomicU64::new(0)],
            waiters: waited::AtomicU64::new(0),
            lock: Mutex::new(()),
            cond: Condvar::new(),
            name,
            command: EntitySlot::default(),
            runtime,
        }
    }

    /// Current status.
    #[inline]
    pub fn status(&self) -> EventStatus {
        EventStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    fn status_seqcst(&self) -> EventStatus {
        EventStatus::from_u8(self.status.load(Ordering::SeqCst))
    }

    /// The error, once failed.
    pub fn error(&self) -> Option<&ExecError> {
        self.error.get()
    }

    /// Profiling timestamps (zero until known).
    pub fn timestamps(&self) -> Timestamps {
        Timestamps {
            submitted_ns: self.times[0].load(Ordering::Relaxed),
            started_ns: self.times[1].load(Ordering::Relaxed),
            ended_ns: self.times[2].load(Ordering::Relaxed),
        }
    }

    // The status store and the waiter count load here, and the count increment and
    // the status load in `block_until`, must be sequentially consistent: with weaker
    // orderings each side may see the other's old value, nobody notifies, and a
    // waiter sleeps on a finished event.
    fn set_status(&self, s: EventStatus) {
        self.status.store(s as u8, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) & Waiters::satisfied_by(s) != 0 {
            let _g = self.lock.lock();
            self.cond.notify_all();
        }
    }

    /// Marks it handed to a driver.
    pub fn mark_submitted(&self) {
        self.set_status(EventStatus::Submitted);
    }

    /// Marks it running at `started_ns`.
    pub fn mark_running(&self, started_ns: u64) {
        self.times[1].store(started_ns, Ordering::Relaxed);
        self.set_status(EventStatus::Running);
    }

    /// Completes it with `result` and the device timestamps.
    pub fn finish(&self, result: Result<(), ExecError>, started_ns: u64, ended_ns: u64) {
        self.times[1].store(started_ns, Ordering::Relaxed);
        self.times[2].store(ended_ns, Ordering::Relaxed);
        match result {
            Ok(()) => self.set_status(EventStatus::Complete),
            Err(e) => {
                let _ = self.error.set(e);
                self.set_status(EventStatus::Failed);
            }
        }
    }

    /// Blocks until the status is at least `at_least`, spinning for up to `spin`
    /// first (see [`gantry_driver::sync::spin_until`]).
    pub fn block_until(&self, at_least: EventStatus, spin: std::time::Duration) {
        self.block_until_or(at_least, spin, None, || false);
    }

    /// [`block_until`](Self::block_until), but every `check` (when given) it asks
    /// `give_up` and returns `false` if that says so; `true` once the status is
    /// reached. For waits on a scheduler that may stop without finishing the event.
    pub fn block_until_or(
        &self,
        at_least: EventStatus,
        spin: std::time::Duration,
        check: Option<std::time::Duration>,
        give_up: impl Fn() -> bool,
    ) -> bool {
        if gantry_driver::sync::spin_until(spin, || self.status() >= at_least) {
            return true;
        }
        let one = Waiters::one(at_least);
        self.waiters.fetch_add(one, Ordering::SeqCst);
        let mut g = self.lock.lock();
        let mut reached = true;
        while self.status_seqcst() < at_least {
            match check {
                Some(every) => {
                    self.cond.wait_for(&mut g, every);
                    if self.status_seqcst() < at_least && give_up() {
                        reached = false;
                        break;
                    }
                }
                None => self.cond.wait(&mut g),
            }
        }
        drop(g);
        self.waiters.fetch_sub(one, Ordering::AcqRel);
        reached
    }
}

/// The layout of [`EventShared`]'s waiter word: one 21-bit count per status a thread
/// can wait for that is not already true at creation (submitted, running, final),
/// so one atomic load tells a status change whether anyone it satisfies is asleep.
struct Waiters;

impl Waiters {
    const BITS: u32 = 21;

    /// The count's lowest bit for threads waiting until at least `status` (waits for
    /// `Failed` count as waits for a final status: they end on `Complete` too).
    fn one(status: EventStatus) -> u64 {
        let level = (status as u32).clamp(1, 3) - 1;
        1 << (level * Self::BITS)
    }

    /// The counts of the waits `status` ends.
    fn satisfied_by(status: EventStatus) -> u64 {
        match status {
            EventStatus::Pending => 0,
            s => {
                let level = (s as u32).min(3);
                (1u64 << (level * Self::BITS)) - 1
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiters_wake_on_completion() {
        let ev = Arc::new(EventShared::new("k".into(), 1, 5));
        let ev2 = ev.clone();
        let t = std::thread::spawn(move || {
            ev2.block_until(EventStatus::Complete, std::time::Duration::ZERO);
            ev2.status()
        });
        std::thread::sleep(std::time::Duration::from_millis(10));
        ev.finish(Err(ExecError::RuntimeDropped), 7, 9);
        assert_eq!(t.join().unwrap(), EventStatus::Failed);
        assert_eq!(ev.timestamps(), Timestamps { submitted_ns: 5, started_ns: 7, ended_ns: 9 });
        assert_eq!(ev.error(), Some(&ExecError::RuntimeDropped));
    }

    /// A waiter spins for its window before it registers and sleeps: with a long
    /// window it is not counted among the sleepers while the event is pending; with
    /// none, it is.
    #[test]
    fn waiters_spin_for_their_window_before_sleeping() {
        use std::time::{Duration, Instant};
        for (spin, sleeps) in [(Duration::from_secs(30), false), (Duration::ZERO, true)] {
            let ev = Arc::new(EventShared::new("k".into(), 1, 0));
            let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (ev2, started2) = (ev.clone(), started.clone());
            let t = std::thread::spawn(move || {
                started2.store(true, Ordering::SeqCst);
                ev2.block_until(EventStatus::Complete, spin);
            });
            while !started.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            // A sleeper registers within moments; give a spinner as long.
            let deadline = Instant::now() + Duration::from_millis(if sleeps { 10_000 } else { 50 });
            while ev.waiters.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
                std::thread::yield_now();
            }
            assert_eq!(
                ev.waiters.load(Ordering::SeqCst) == Waiters::one(EventStatus::Complete),
                sleeps,
                "window {spin:?}"
            );
            ev.finish(Ok(()), 1, 2);
            t.join().unwrap();
        }
    }

    /// A status change wakes the sleepers it satisfies and only those: a host waiting
    /// for completion is not woken by the submission or the start.
    #[test]
    fn a_status_wakes_only_the_waits_it_ends() {
        use EventStatus::*;
        for (waits_for, woken_by) in [
            (Submitted, [Submitted, Running, Complete, Failed].as_slice()),
            (Running, &[Running, Complete, Failed]),
            (Complete, &[Complete, Failed]),
            (Failed, &[Complete, Failed]),
        ] {
            for s in [Pending, Submitted, Running, Complete, Failed] {
                let wakes = Waiters::satisfied_by(s) & Waiters::one(waits_for) != 0;
                assert_eq!(wakes, woken_by.contains(&s), "{s:?} for a wait until {waits_for:?}");
            }
        }

        // Two sleepers, for running and for completion: the start ends the first wait
        // and leaves the second registered.
        let ev = Arc::new(EventShared::new("k".into(), 1, 0));
        let sleeper = |status| {
            let ev = ev.clone();
            std::thread::spawn(move || ev.block_until(status, std::time::Duration::ZERO))
        };
        let (running, complete) = (sleeper(Running), sleeper(Complete));
        let both = Waiters::one(Running) + Waiters::one(Complete);
        while ev.waiters.load(Ordering::SeqCst) != both {
            std::thread::yield_now();
        }
        ev.mark_submitted();
        ev.mark_running(1);
        running.join().unwrap();
        assert_eq!(ev.waiters.load(Ordering::SeqCst), Waiters::one(Complete));
        ev.finish(Ok(()), 1, 2);
        complete.join().unwrap();
        assert_eq!(ev.waiters.load(Ordering::SeqCst), 0);
    }
}
