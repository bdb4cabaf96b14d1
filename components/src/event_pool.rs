//! Events drawn from a pool: a finished event whose last reference is let go on a
//! thread goes back to that thread's pool, and the next event made there reuses it.
//!
//! # Contract
//!
//! * Only an event nobody else holds is kept ([`recycle`]): its last reference is the
//!   one given, so no waiter, command or user handle can see it again, and
//!   the pool may make it a new pending event in place.
//! * The pool is per thread, so taking and keeping an event costs no locked
//!   operation. Events are made on the threads that submit commands, and their last
//!   references come back to those threads: from the user's handle, or from the
//!   scheduler through the hand-back ([`HandBack`](crate::HandBack)), or, in a manual
//!   runtime, from the stages that run on that thread.
//! * Bounded: a thread keeps at most [`KEPT`] events; past it they are freed.
//! * Under `--cfg shuttle` nothing is pooled: shuttle's locks belong to one
//!   execution of a test.

use std::sync::Arc;

use crate::event::EventShared;

/// Events a thread keeps for reuse (about 190 bytes each).
pub const KEPT: usize = 1024;

#[cfg(not(shuttle))]
thread_local! {
    static POOL: std::cell::RefCell<Vec<Arc<EventShared>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A pending event submitted at `submitted_ns`: made in the allocation of a pooled
/// one where this thread has one, else in a new allocation.
pub fn new_event(name: Arc<str>, runtime: u64, submitted_ns: u64) -> Arc<EventShared> {
    #[cfg(not(shuttle))]
    {
        let kept = POOL.try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.pop())).ok().flatten();
        if let Some(mut event) = kept {
            if let Some(e) = Arc::get_mut(&mut event) {
                *e = EventShared::new(name, runtime, submitted_ns);
                return event;
            }
        }
    }
    Arc::new(EventShared::new(name, runtime, submitted_ns))
}

/// Lets go of `event`: keeps it in this thread's pool if this is its last reference
/// (and the pool has room), else drops it.
pub fn recycle(event: Arc<EventShared>) {
    #[cfg(not(shuttle))]
    if Arc::strong_count(&event) == 1 && Arc::weak_count(&event) == 0 {
        let _ = POOL.try_with(move |p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < KEPT {
                    p.push(event);
                }
            }
        });
    }
}

/// Events this thread keeps.
pub fn kept() -> usize {
    #[cfg(not(shuttle))]
    return POOL.try_with(|p| p.try_borrow().map_or(0, |p| p.len())).unwrap_or(0);
    #[cfg(shuttle)]
    0
}

#[cfg(all(test, not(shuttle)))]
mod tests {
    use super::*;
    use crate::event::EventStatus;
    use bevy_ecs::entity::Entity;
    use gantry_driver::ExecError;

    /// Empties this thread's pool (tests may share a thread).
    fn drain() {
        POOL.with(|p| p.borrow_mut().clear());
    }

    fn failed(name: &str) -> Arc<EventShared> {
        let e = new_event(name.into(), 1, 10);
        e.command.set(Entity::from_raw_u32(7).expect("an index"));
        let error = ExecError::KernelPanicked { kernel: name.into(), message: "boom".into() };
        e.finish(Err(error), 20, 30);
        e
    }

    /// A last reference goes back to the pool; the next event made on the thread is
    /// the same allocation, made pending again with nothing of its last command.
    #[test]
    fn a_last_reference_is_reused_as_a_new_pending_event() {
        drain();
        let before = kept();
        let old = failed("old");
        let at = Arc::as_ptr(&old);
        recycle(old);
        assert_eq!(kept(), before + 1);
        let e = new_event("new".into(), 2, 40);
        assert_eq!(Arc::as_ptr(&e), at, "reused");
        assert_eq!(kept(), before);
        assert_eq!(e.status(), EventStatus::Pending);
        assert!(e.error().is_none());
        assert_eq!(e.timestamps(), crate::Timestamps { submitted_ns: 40, started_ns: 0, ended_ns: 0 });
        assert_eq!((&*e.name, e.runtime, e.command.get()), ("new", 2, None));
    }

    /// An event someone else still holds is only let go of: a user's handle or a
    /// waiter keeps seeing its command's outcome.
    #[test]
    fn an_event_held_elsewhere_is_not_kept() {
        drain();
        let before = kept();
        let e = failed("held");
        let held = e.clone();
        recycle(e);
        assert_eq!(kept(), before);
        assert_eq!((held.status(), &*held.name), (EventStatus::Failed, "held"));
        let weak = Arc::downgrade(&held);
        recycle(held);
        assert_eq!(kept(), before, "a weak reference could still reach it");
        assert!(weak.upgrade().is_none(), "dropped");
    }

    /// A thread keeps at most `KEPT` events; the rest are freed.
    #[test]
    fn a_thread_keeps_at_most_kept_events() {
        drain();
        let events: Vec<_> = (0..KEPT + 10).map(|_| new_event("e".into(), 1, 0)).collect();
        let last = Arc::downgrade(events.last().expect("events"));
        events.into_iter().for_each(recycle);
        assert_eq!(kept(), KEPT);
        assert!(last.upgrade().is_none(), "past the bound: freed");
        // Another thread's pool is its own.
        std::thread::spawn(|| assert_eq!(kept(), 0)).join().expect("thread");
    }
}
