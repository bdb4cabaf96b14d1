//! The synchronization primitives every Gantry crate uses where threads block on or
//! wake each other: mutexes and condition variables, the channels between user
//! threads, drivers and the scheduler, the atomics of event waits, and the scheduler
//! thread itself.
//!
//! In normal builds these are plain re-exports (`parking_lot`'s `Mutex` and
//! `Condvar`, `crossbeam-channel`, `std::thread`, `std::sync::atomic`): nothing costs
//! more than before.
//!
//! Built with `RUSTFLAGS="--cfg shuttle"` they map onto [shuttle]'s primitives, which
//! run all threads of a test on one OS thread and explore their interleavings under
//! a randomized scheduler (`engine/tests/shuttle.rs`). Small wrappers keep the API the
//! code uses (`lock()` returns the guard, `Condvar::wait(&mut guard)`), channels are
//! a minimal unbounded channel built on shuttle's `Mutex` and `Condvar`, and
//! [`channel::Select`] covers the one multi-channel wait. A `cfg`, not a Cargo
//! feature: features unify across `cargo test --workspace` and would swap the
//! primitives under the normal tests.
//!
//! Timed waits: shuttle does not model time. Under shuttle a timed wait
//! ([`Condvar::wait_for`], [`channel::Select::ready_timeout`]) returns after one
//! context switch, as if its timeout had fired at that point (the caller re-checks
//! whatever it waits for). A timeout that exists only as a safety net goes through
//! [`safety_net`], which removes it under shuttle: the wait blocks until notified,
//! so a lost wakeup behind it shows up as a deadlock instead of a 50 ms stall.
//!
//! [shuttle]: https://docs.rs/shuttle

use std::time::Duration;

/// The timeout of a wait that is woken by a notification in every correct schedule
/// and times out only as a safety net. `Some(timeout)` in normal builds; `None`
/// under shuttle, where the caller waits without a timeout so that shuttle reports a
/// missed notification as a deadlock.
#[inline]
pub const fn safety_net(timeout: Duration) -> Option<Duration> {
    if cfg!(shuttle) {
        None
    } else {
        Some(timeout)
    }
}

/// How long a thread about to block spins first by default (see [`spin_until`]).
pub const SPIN_WINDOW: Duration = Duration::from_micros(20);

/// Spins for up to `window` until `ready()` holds; returns whether it did.
///
/// A thread that is about to sleep on a condition variable or a channel calls this
/// first, as GPU runtimes spin on a stream before they block: a wake-up through the
/// kernel costs microseconds on each side (tens in a virtual machine), and the
/// scheduler's hand-offs (message to scheduler, completion to scheduler, event to
/// waiter) each pay one, which is most of a short frame's latency. The default
/// window ([`SPIN_WINDOW`]) is short enough that an idle thread gives its core back
/// quickly; a zero window checks once. Between rounds of polls the spinner offers
/// its core (`yield_now`): the thread it waits for (a worker running the kernel, the
/// scheduler) may need that very core, and where threads outnumber cores a pure spin
/// kept it from running (figures: `docs/PERFORMANCE.md`, "Spinning that yields").
///
/// Under shuttle it checks once and does not spin: the blocking path behind it is
/// the one whose interleavings matter.
#[inline]
pub fn spin_until(window: Duration, mut ready: impl FnMut() -> bool) -> bool {
    if ready() {
        return true;
    }
    if cfg!(shuttle) || window.is_zero() {
        return false;
    }
    let start = std::time::Instant::now();
    loop {
        // Read the clock once per round of polls: it costs more than one poll.
        for _ in 0..32 {
            std::hint::spin_loop();
            if ready() {
                return true;
            }
        }
        if start.elapsed() >= window {
            return false;
        }
        std::thread::yield_now();
    }
}

#[cfg(not(shuttle))]
pub use parking_lot::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};

/// Atomics that threads wait on or hand off work through (`std::sync::atomic`, or
/// shuttle's under `--cfg shuttle`, where each access is a scheduling point).
/// Counters nobody waits on use `std::sync::atomic` directly.
pub mod atomic {
    #[cfg(shuttle)]
    pub use shuttle::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    #[cfg(not(shuttle))]
    pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
}

/// Threads that take part in the runtime's synchronization (the scheduler thread).
pub mod thread {
    #[cfg(shuttle)]
    pub use shuttle::thread::{spawn, yield_now, Builder, JoinHandle};
    #[cfg(not(shuttle))]
    pub use std::thread::{spawn, yield_now, Builder, JoinHandle};
}

/// Unbounded multi-producer multi-consumer channels.
pub mod channel {
    #[cfg(not(shuttle))]
    pub use crossbeam_channel::{unbounded, Receiver, Select, Sender};
    pub use crossbeam_channel::{ReadyTimeoutError, RecvError, SendError, TryRecvError};

    #[cfg(shuttle)]
    pub use super::shuttle_impl::{unbounded, Receiver, Select, Sender};
}

#[cfg(shuttle)]
pub use shuttle_impl::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};

#[cfg(shuttle)]
mod shuttle_impl {
    use std::collections::VecDeque;
    use std::fmt;
    use std::ops::{Deref, DerefMut};
    use std::sync::{Arc, PoisonError};
    use std::time::Duration;

    use crossbeam_channel::{ReadyTimeoutError, RecvError, SendError, TryRecvError};

    /// A mutex with `parking_lot`'s API over shuttle's (poisoning is ignored).
    #[derive(Default)]
    pub struct Mutex<T: ?Sized>(shuttle::sync::Mutex<T>);

    /// The guard of a [`Mutex`].
    pub struct MutexGuard<'a, T: ?Sized> {
        mutex: &'a shuttle::sync::Mutex<T>,
        /// `None` only inside a [`Condvar`] wait.
        guard: Option<shuttle::sync::MutexGuard<'a, T>>,
    }

    impl<T> Mutex<T> {
        /// A mutex holding `value`.
        pub const fn new(value: T) -> Self {
            Self(shuttle::sync::Mutex::new(value))
        }
        /// The value.
        pub fn into_inner(self) -> T {
            self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
        }
    }

    impl<T: ?Sized> Mutex<T> {
        /// Locks it (a scheduling point).
        pub fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard { mutex: &self.0, guard: Some(self.0.lock().unwrap_or_else(PoisonError::into_inner)) }
        }
        /// Locks it if free.
        pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            let guard = match self.0.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return None,
            };
            Some(MutexGuard { mutex: &self.0, guard: Some(guard) })
        }
        /// The value, through exclusive access.
        pub fn get_mut(&mut self) -> &mut T {
            self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
        }
    }

    impl<T: ?Sized> fmt::Debug for Mutex<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            // Locking here would add a scheduling point to every `{:?}`.
            f.debug_struct("Mutex").finish_non_exhaustive()
        }
    }

    impl<T: ?Sized> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.guard.as_ref().expect("guard is held")
        }
    }

    impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.guard.as_mut().expect("guard is held")
        }
    }

    /// Whether a timed wait timed out.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct WaitTimeoutResult(bool);

    impl WaitTimeoutResult {
        /// Whether the wait timed out.
        pub fn timed_out(self) -> bool {
            self.0
        }
    }

    /// A condition variable with `parking_lot`'s API over shuttle's.
    #[derive(Default)]
    pub struct Condvar(shuttle::sync::Condvar);

    impl fmt::Debug for Condvar {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("Condvar").finish_non_exhaustive()
        }
    }

    impl Condvar {
        /// A condition variable.
        pub fn new() -> Self {
            Self(shuttle::sync::Condvar::new())
        }
        /// Releases the guard's lock, blocks until notified, and locks again.
        pub fn wait<T>(&self, guard: &mut MutexGuard<'_, T>) {
            let g = guard.guard.take().expect("guard is held");
            guard.guard = Some(self.0.wait(g).unwrap_or_else(PoisonError::into_inner));
        }
        /// A timed wait. Shuttle does not model time: this releases the lock, lets
        /// other threads run, and reports a timeout, as if the timeout had fired at
        /// that point. Waits whose timeout is only a safety net use [`Condvar::wait`]
        /// under shuttle (see [`super::safety_net`]).
        pub fn wait_for<T>(&self, guard: &mut MutexGuard<'_, T>, _timeout: Duration) -> WaitTimeoutResult {
            drop(guard.guard.take().expect("guard is held"));
            shuttle::thread::yield_now();
            guard.guard = Some(guard.mutex.lock().unwrap_or_else(PoisonError::into_inner));
            WaitTimeoutResult(true)
        }
        /// Wakes one waiter.
        pub fn notify_one(&self) {
            self.0.notify_one();
        }
        /// Wakes all waiters.
        pub fn notify_all(&self) {
            self.0.notify_all();
        }
    }

    /// Wakes a [`Select`] blocked on several channels.
    #[derive(Default)]
    struct Signal {
        fired: shuttle::sync::Mutex<bool>,
        cond: shuttle::sync::Condvar,
    }

    impl Signal {
        fn fire(&self) {
            *self.fired.lock().unwrap_or_else(PoisonError::into_inner) = true;
            self.cond.notify_all();
        }
        fn wait(&self) {
            let mut fired = self.fired.lock().unwrap_or_else(PoisonError::into_inner);
            while !*fired {
                fired = self.cond.wait(fired).unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    struct State<T> {
        queue: VecDeque<T>,
        senders: usize,
        receivers: usize,
        /// Selects blocked on this channel.
        watchers: Vec<Arc<Signal>>,
    }

    struct Chan<T> {
        state: shuttle::sync::Mutex<State<T>>,
        /// Notified on every send and on the last sender's drop.
        cond: shuttle::sync::Condvar,
    }

    impl<T> Chan<T> {
        fn state(&self) -> shuttle::sync::MutexGuard<'_, State<T>> {
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        }
        /// Wakes blocked receivers and selects (call without the state lock).
        fn wake(&self, watchers: Vec<Arc<Signal>>) {
            self.cond.notify_all();
            for w in watchers {
                w.fire();
            }
        }
    }

    /// An unbounded channel: `crossbeam_channel::unbounded` under shuttle.
    pub fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
        let chan = Arc::new(Chan {
            state: shuttle::sync::Mutex::new(State {
                queue: VecDeque::new(),
                senders: 1,
                receivers: 1,
                watchers: Vec::new(),
            }),
            cond: shuttle::sync::Condvar::new(),
        });
        (Sender(chan.clone()), Receiver(chan))
    }

    /// The sending side of [`unbounded`].
    pub struct Sender<T>(Arc<Chan<T>>);

    /// The receiving side of [`unbounded`].
    pub struct Receiver<T>(Arc<Chan<T>>);

    impl<T> fmt::Debug for Sender<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Sender { .. }")
        }
    }

    impl<T> fmt::Debug for Receiver<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("Receiver { .. }")
        }
    }

    impl<T> Clone for Sender<T> {
        fn clone(&self) -> Self {
            self.0.state().senders += 1;
            Self(self.0.clone())
        }
    }

    impl<T> Clone for Receiver<T> {
        fn clone(&self) -> Self {
            self.0.state().receivers += 1;
            Self(self.0.clone())
        }
    }

    impl<T> Drop for Sender<T> {
        fn drop(&mut self) {
            let mut st = self.0.state();
            st.senders -= 1;
            if st.senders == 0 {
                let watchers = st.watchers.clone();
                drop(st);
                self.0.wake(watchers);
            }
        }
    }

    impl<T> Drop for Receiver<T> {
        fn drop(&mut self) {
            self.0.state().receivers -= 1;
        }
    }

    impl<T> Sender<T> {
        /// Sends `msg`; fails once every receiver is gone.
        pub fn send(&self, msg: T) -> Result<(), SendError<T>> {
            let mut st = self.0.state();
            if st.receivers == 0 {
                return Err(SendError(msg));
            }
            st.queue.push_back(msg);
            let watchers = st.watchers.clone();
            drop(st);
            self.0.wake(watchers);
            Ok(())
        }
        /// Whether the channel holds no message.
        pub fn is_empty(&self) -> bool {
            self.0.state().queue.is_empty()
        }
        /// Messages in the channel.
        pub fn len(&self) -> usize {
            self.0.state().queue.len()
        }
    }

    impl<T> Receiver<T> {
        /// The next message, if any.
        pub fn try_recv(&self) -> Result<T, TryRecvError> {
            let mut st = self.0.state();
            match st.queue.pop_front() {
                Some(msg) => Ok(msg),
                None if st.senders == 0 => Err(TryRecvError::Disconnected),
                None => Err(TryRecvError::Empty),
            }
        }
        /// Blocks until a message arrives or every sender is gone.
        pub fn recv(&self) -> Result<T, RecvError> {
            let mut st = self.0.state();
            loop {
                if let Some(msg) = st.queue.pop_front() {
                    return Ok(msg);
                }
                if st.senders == 0 {
                    return Err(RecvError);
                }
                st = self.0.cond.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        }
        /// The messages already in the channel.
        pub fn try_iter(&self) -> impl Iterator<Item = T> + '_ {
            std::iter::from_fn(move || self.try_recv().ok())
        }
        /// Whether the channel holds no message.
        pub fn is_empty(&self) -> bool {
            self.0.state().queue.is_empty()
        }
        /// Messages in the channel.
        pub fn len(&self) -> usize {
            self.0.state().queue.len()
        }
    }

    /// A channel a [`Select`] waits on, whatever its message type.
    trait Watched {
        /// Whether a receive would not block; if not, and `signal` is given, registers
        /// it (under the same lock, so no send slips between the check and the
        /// registration).
        fn ready_or_watch(&self, signal: Option<&Arc<Signal>>) -> bool;
        fn unwatch(&self, signal: &Arc<Signal>);
    }

    impl<T> Watched for Chan<T> {
        fn ready_or_watch(&self, signal: Option<&Arc<Signal>>) -> bool {
            let mut st = self.state();
            let ready = !st.queue.is_empty() || st.senders == 0;
            if let (false, Some(s)) = (ready, signal) {
                st.watchers.push(s.clone());
            }
            ready
        }
        fn unwatch(&self, signal: &Arc<Signal>) {
            self.state().watchers.retain(|w| !Arc::ptr_eq(w, signal));
        }
    }

    /// Waits until one of several receivers is ready: the subset of
    /// `crossbeam_channel::Select` the runtime uses.
    #[derive(Default)]
    pub struct Select<'a> {
        chans: Vec<&'a dyn Watched>,
    }

    impl fmt::Debug for Select<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("Select").field("receivers", &self.chans.len()).finish()
        }
    }

    impl<'a> Select<'a> {
        /// No receivers yet.
        pub fn new() -> Self {
            Self { chans: Vec::new() }
        }
        /// Adds a receiver; returns its index.
        pub fn recv<T>(&mut self, r: &'a Receiver<T>) -> usize {
            self.chans.push(&*r.0);
            self.chans.len() - 1
        }
        fn first_ready(&self) -> Option<usize> {
            self.chans.iter().position(|c| c.ready_or_watch(None))
        }
        /// Blocks until a receiver holds a message or is disconnected; its index.
        pub fn ready(&mut self) -> usize {
            loop {
                let signal = Arc::new(Signal::default());
                let mut ready = None;
                for (i, c) in self.chans.iter().enumerate() {
                    if c.ready_or_watch(Some(&signal)) {
                        ready = Some(i);
                        break;
                    }
                }
                if ready.is_none() {
                    signal.wait();
                }
                for c in &self.chans {
                    c.unwatch(&signal);
                }
                // Another receiver may have taken the message that fired the signal.
                if let Some(i) = ready.or_else(|| self.first_ready()) {
                    return i;
                }
            }
        }
        /// A timed [`Select::ready`]. Shuttle does not model time: if nothing is ready,
        /// this lets other threads run once and then reports a timeout, as if the
        /// timeout had fired at that point.
        pub fn ready_timeout(&mut self, _timeout: Duration) -> Result<usize, ReadyTimeoutError> {
            if let Some(i) = self.first_ready() {
                return Ok(i);
            }
            shuttle::thread::yield_now();
            self.first_ready().ok_or(ReadyTimeoutError)
        }
    }
}

#[cfg(all(test, not(shuttle)))]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Ready at the 20th poll: before the first clock reading (after 33), so the
    /// answer does not depend on how long the thread was preempted.
    #[test]
    fn spin_until_sees_a_condition_that_turns_true_while_it_spins() {
        let polls = Cell::new(0);
        let ready = || {
            polls.set(polls.get() + 1);
            polls.get() == 20
        };
        assert!(spin_until(SPIN_WINDOW, ready));
        assert_eq!(polls.get(), 20, "it stops polling once ready");
    }

    #[test]
    fn a_zero_window_checks_once() {
        let polls = Cell::new(0);
        assert!(!spin_until(Duration::ZERO, || {
            polls.set(polls.get() + 1);
            false
        }));
        assert_eq!(polls.get(), 1);
    }

    #[test]
    fn spin_until_gives_up_after_its_window() {
        let polls = Cell::new(0u64);
        let start = std::time::Instant::now();
        assert!(!spin_until(SPIN_WINDOW, || {
            polls.set(polls.get() + 1);
            false
        }));
        assert!(start.elapsed() >= SPIN_WINDOW);
        assert!(polls.get() > 32, "it polled through the window, not once");
    }
}
