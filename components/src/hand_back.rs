//! The hand-back: what a user thread allocated for a command and the scheduler
//! thread would free, returned to user threads to be freed there.
//!
//! # Contract
//!
//! * A command's kernel (its closure included) and its event are allocated on the
//!   thread that submits it. In a threaded runtime the scheduler's thread holds their
//!   last references once the command ran, and a free there goes back to the
//!   submitting thread's allocator arena, under that arena's lock, while the submitter
//!   allocates from it: the two threads then contend for one lock several times per
//!   command. Instead the scheduler gives those last references back (a stage's pass
//!   collects them in a [`Returning`] and gives them in one lock as it ends), and user
//!   threads free them ([`HandBack::release`], from their sends and waits), where they
//!   were allocated: kernels are dropped, events go to the thread's event pool
//!   ([`event_pool`](crate::event_pool)) for its next commands.
//! * Only last references are given back: a kernel or event someone else still holds
//!   is dropped at once, which only decrements it.
//! * Bounded: past [`LIMIT`] waiting items, the scheduler frees a batch itself. A
//!   scheduler that goes idle frees what waits ([`HandBack::release`] on its thread),
//!   so once the runtime is idle nothing of a finished command is kept but the
//!   bounded event pools.
//! * The thread that frees them goes on past a destructor that panics: closures
//!   contain their captures' panics (`Contained`); any other destructor's panic (a
//!   native image of the user's type) is reported, and the other items are still
//!   freed.
//! * Manual runtimes run the scheduler on user threads and have no hand-back.

use std::sync::Arc;

use gantry_driver::sync::atomic::{AtomicBool, Ordering};
use gantry_driver::sync::Mutex;
use gantry_driver::KernelRef;

use crate::event::EventShared;

/// Items that may wait to be freed by user threads; past it the scheduler frees them.
pub const LIMIT: usize = 16 * 1024;

/// Last references collected by one pass of a stage.
#[derive(Default)]
struct Returned {
    kernels: Vec<KernelRef>,
    events: Vec<Arc<EventShared>>,
}

impl Returned {
    /// Keeps `kernel` if this is its last reference; otherwise drops it (a decrement).
    fn kernel(&mut self, kernel: KernelRef) {
        if Arc::strong_count(&kernel) == 1 {
            self.kernels.push(kernel);
        }
    }

    /// Keeps `event` if this is its last reference; otherwise drops it.
    fn event(&mut self, event: Arc<EventShared>) {
        if Arc::strong_count(&event) == 1 {
            self.events.push(event);
        }
    }

    /// Items kept.
    fn len(&self) -> usize {
        self.kernels.len() + self.events.len()
    }

    /// Whether none are kept.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn append(&mut self, other: &mut Returned) {
        if self.is_empty() {
            std::mem::swap(self, other);
        } else {
            self.kernels.append(&mut other.kernels);
            self.events.append(&mut other.events);
        }
    }

    /// Drops every item, each on its own (events go to this thread's event pool): a
    /// kernel whose destructor panics is reported, and the rest are still dropped.
    fn free(self) {
        let Returned { kernels, events } = self;
        events.into_iter().for_each(crate::event_pool::recycle);
        for kernel in kernels {
            if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(kernel))) {
                let message = gantry_driver::panic_message(&*payload);
                tracing::error!("the destructor of a kernel's closure panicked: {message}");
            }
        }
    }
}

/// Last references on their way from the scheduler back to user threads.
#[derive(Default)]
pub struct HandBack {
    given: Mutex<Returned>,
    /// Whether `given` holds anything: a user thread's check costs a load, not a lock.
    waiting: AtomicBool,
}

impl HandBack {
    /// An empty hand-back.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scheduler side: moves `batch` in (one lock). Past [`LIMIT`], frees what waited
    /// here instead, on this thread.
    fn give(&self, batch: &mut Returned) {
        if batch.is_empty() {
            return;
        }
        let overflow = {
            let mut given = self.given.lock();
            given.append(batch);
            let over = given.len() > LIMIT;
            self.waiting.store(!over, Ordering::Release);
            over.then(|| std::mem::take(&mut *given))
        };
        if let Some(overflow) = overflow {
            overflow.free();
        }
    }

    /// Frees everything given so far, on this thread; a load when nothing waits. The
    /// lock is not held while items are dropped (a kernel's capture may send a
    /// message, which releases again).
    pub fn release(&self) {
        if !self.waiting.load(Ordering::Acquire) {
            return;
        }
        let taken = {
            let mut given = self.given.lock();
            self.waiting.store(false, Ordering::Release);
            std::mem::take(&mut *given)
        };
        taken.free();
    }

    /// Items waiting.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.given.lock().len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One pass of a stage giving back what it would free: collects last references
/// where the runtime has a hand-back, and drops them at once where it has none
/// (manual runtimes), so that those pay nothing per command.
pub struct Returning {
    to: Option<Arc<HandBack>>,
    batch: Returned,
}

impl Returning {
    /// A pass giving back to `to` (`None`: nothing is collected).
    pub fn to(to: Option<Arc<HandBack>>) -> Self {
        Self { to, batch: Returned::default() }
    }

    /// Whether it collects: where not, a stage need not keep a reference to give.
    pub fn collects(&self) -> bool {
        self.to.is_some()
    }

    /// Keeps `kernel` to give back if this is its last reference (otherwise drops it,
    /// a decrement); dropped at once where nothing is collected.
    pub fn kernel(&mut self, kernel: KernelRef) {
        if self.collects() {
            self.batch.kernel(kernel);
        }
    }

    /// Keeps `event` to give back if this is its last reference (otherwise drops it);
    /// where nothing is collected (the stages run on a user thread), it goes to this
    /// thread's event pool at once.
    pub fn event(&mut self, event: Arc<EventShared>) {
        if self.collects() {
            self.batch.event(event);
        } else {
            crate::event_pool::recycle(event);
        }
    }

    /// Ends the pass: gives what it collected to the hand-back, in one lock.
    pub fn give(mut self) {
        if let Some(to) = &self.to {
            to.give(&mut self.batch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::{Kernel, Signature};

    fn event() -> Arc<EventShared> {
        Arc::new(EventShared::new("e".into(), 0, 0))
    }

    fn kernel() -> KernelRef {
        Kernel::new("k", Signature::default()).into_ref()
    }

    #[test]
    fn only_last_references_are_kept() {
        let mut batch = Returned::default();
        let shared = kernel();
        batch.kernel(shared.clone());
        assert!(batch.is_empty(), "a kernel held elsewhere is only decremented");
        assert_eq!(Arc::strong_count(&shared), 1);
        batch.kernel(shared);
        let event = event();
        batch.event(event.clone());
        assert_eq!(batch.len(), 1);
        batch.event(event);
        assert_eq!(batch.len(), 2);
    }

    #[test]
    fn a_release_frees_what_was_given_on_its_own_thread() {
        let hand_back = Arc::new(HandBack::new());
        let probe = kernel();
        let weak = Arc::downgrade(&probe);
        let mut batch = Returned::default();
        batch.kernel(probe);
        hand_back.give(&mut batch);
        assert!(batch.is_empty() && hand_back.len() == 1);
        assert!(weak.upgrade().is_some(), "kept until a user thread releases it");
        let h = hand_back.clone();
        std::thread::spawn(move || h.release()).join().unwrap();
        assert!(weak.upgrade().is_none() && hand_back.is_empty());
        hand_back.release();
    }

    /// A pass without a hand-back (a manual runtime) keeps nothing; one with a
    /// hand-back gives what it collected when it ends.
    #[test]
    fn a_pass_collects_only_for_a_hand_back() {
        let probe = kernel();
        let weak = Arc::downgrade(&probe);
        let mut pass = Returning::to(None);
        assert!(!pass.collects());
        pass.kernel(probe);
        assert!(weak.upgrade().is_none(), "dropped at once");
        let hand_back = Arc::new(HandBack::new());
        let probe = kernel();
        let weak = Arc::downgrade(&probe);
        let mut pass = Returning::to(Some(hand_back.clone()));
        pass.kernel(probe);
        pass.event(event());
        pass.give();
        assert_eq!(hand_back.len(), 2);
        assert!(weak.upgrade().is_some(), "kept until a release");
        hand_back.release();
        assert!(weak.upgrade().is_none());
    }

    #[test]
    fn past_the_limit_the_giver_frees_them() {
        let hand_back = HandBack::new();
        let mut batch = Returned::default();
        (0..LIMIT + 1).for_each(|_| batch.event(event()));
        hand_back.give(&mut batch);
        assert!(hand_back.is_empty(), "freed by the giver");
    }

    /// A kernel whose closure's destructor panics: the other items are still freed
    /// and the releasing thread goes on.
    #[test]
    fn a_panicking_destructor_does_not_stop_the_release() {
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("capture destructor");
            }
        }
        let hand_back = HandBack::new();
        let mut batch = Returned::default();
        batch.kernel(Kernel::with_native("bomb", Signature::default(), None, Bomb).into_ref());
        let survivor = kernel();
        let weak = Arc::downgrade(&survivor);
        batch.kernel(survivor);
        hand_back.give(&mut batch);
        hand_back.release();
        assert!(weak.upgrade().is_none(), "the kernel after the panicking one was freed");
    }
}
