//! The kernels a fusion window ran as they were submitted, because fusing them would
//! not pay on their device ([`WindowThresholds`](gantry_driver::fusion::WindowThresholds)),
//! and the event that completes after all of them: what `complete_fusion` returns for
//! such a window.
//!
//! Only the kernels no later kernel of the window depends on are kept (the window's
//! *sinks*): a kernel completes after every kernel it depends on, and fails when one
//! of them fails, so the sinks' completion is the window's. A kernel depends on an
//! earlier one where their uses of a buffer conflict ([`BufferUse::conflicts`]), or,
//! on an in-order queue, always. A chain therefore ends with one sink, whose own
//! event is the window's; a window of independent kernels ends with several, and a
//! marker waiting on them stands for the window.
//!
//! An event the sinks let go of goes back to the thread's event pool, as a user's
//! handle's would: the sinks often hold a kernel's last reference.

use std::sync::Arc;

use gantry_components::{event_pool, EventShared, Requirement};
use smallvec::SmallVec;

use crate::buffer_use::BufferUse;

/// What a kernel's requirements use.
type Uses = SmallVec<[BufferUse; 4]>;

/// A passed kernel no later passed kernel depends on.
struct Sink {
    event: Arc<EventShared>,
    uses: Uses,
}

/// The sinks of a window's passed kernels.
#[derive(Default)]
pub(crate) struct PassedKernels {
    sinks: SmallVec<[Sink; 2]>,
}

impl PassedKernels {
    /// What `requirements` use, taken before they are sent: what decides whether a
    /// later kernel depends on this one. Nothing on an in-order queue, which orders
    /// every later kernel after it anyway ([`PassedKernels::push`]).
    pub(crate) fn uses(requirements: &[Requirement], in_order: bool) -> Uses {
        match in_order {
            true => Uses::new(),
            false => requirements.iter().map(BufferUse::of).collect(),
        }
    }

    /// Adds a kernel passed through after every kernel already added, with its event
    /// and what it uses; `in_order`: its queue orders it after all of them.
    pub(crate) fn push(&mut self, event: Arc<EventShared>, uses: Uses, in_order: bool) {
        if in_order {
            self.clear();
        } else {
            let mut i = 0;
            while i < self.sinks.len() {
                if conflicts(&self.sinks[i].uses, &uses) {
                    event_pool::recycle(self.sinks.remove(i).event);
                } else {
                    i += 1;
                }
            }
        }
        self.sinks.push(Sink { event, uses });
    }

    /// The events of the sinks: every passed kernel has finished once they have.
    pub(crate) fn sinks(&self) -> SmallVec<[Arc<EventShared>; 2]> {
        self.sinks.iter().map(|s| s.event.clone()).collect()
    }

    /// Replaces the sinks by one event that completes after all of them (a marker
    /// waiting on them), so a later call finds it alone.
    pub(crate) fn join(&mut self, event: Arc<EventShared>) {
        self.clear();
        self.sinks.push(Sink { event, uses: Uses::new() });
    }

    /// Forgets every kernel (a new window starts).
    pub(crate) fn clear(&mut self) {
        for sink in self.sinks.drain(..) {
            event_pool::recycle(sink.event);
        }
    }
}

/// Whether a kernel using `later` depends on one using `earlier`.
fn conflicts(earlier: &Uses, later: &Uses) -> bool {
    earlier.iter().any(|u| later.iter().any(|v| u.conflicts(v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_components::ByteRange;

    fn event(name: &str) -> Arc<EventShared> {
        Arc::new(EventShared::new(name.into(), 0, 0))
    }

    /// (buffer, first byte, one past the last, writes) per requirement.
    fn uses(list: &[(u64, usize, usize, bool)]) -> Uses {
        let use_ =
            |&(buffer, start, end, writes)| BufferUse { buffer, range: ByteRange { start, end }, writes };
        list.iter().map(use_).collect()
    }

    fn names(p: &PassedKernels) -> Vec<String> {
        p.sinks().iter().map(|e| e.name.to_string()).collect()
    }

    /// A chain (each kernel reads what the one before wrote) ends with one sink; so
    /// does any window on an in-order queue.
    #[test]
    fn a_chain_ends_with_its_last_kernel() {
        let mut p = PassedKernels::default();
        p.push(event("a"), uses(&[(1, 0, 64, false), (2, 0, 64, true)]), false);
        p.push(event("b"), uses(&[(2, 0, 64, false), (3, 0, 64, true)]), false);
        p.push(event("c"), uses(&[(3, 0, 64, false), (4, 0, 64, true)]), false);
        assert_eq!(names(&p), ["c"]);

        let mut q = PassedKernels::default();
        q.push(event("x"), uses(&[(1, 0, 64, true)]), true);
        q.push(event("y"), uses(&[(9, 0, 64, true)]), true);
        assert_eq!(names(&q), ["y"]);
    }

    /// Kernels that only read a buffer, or write ranges that do not overlap, do not
    /// depend on each other: each stays a sink until a later kernel depends on it.
    #[test]
    fn independent_kernels_stay_sinks_until_one_depends_on_them() {
        let mut p = PassedKernels::default();
        p.push(event("a"), uses(&[(1, 0, 64, false), (2, 0, 32, true)]), false);
        p.push(event("b"), uses(&[(1, 0, 64, false), (2, 32, 64, true)]), false);
        assert_eq!(names(&p), ["a", "b"]);
        // Reads the first half a wrote: depends on a only.
        p.push(event("c"), uses(&[(2, 0, 16, false), (5, 0, 64, true)]), false);
        assert_eq!(names(&p), ["b", "c"]);
        // Overwrites what b and c read or wrote (a write after a read is an edge too).
        p.push(event("d"), uses(&[(2, 0, 64, true), (5, 0, 64, true)]), false);
        assert_eq!(names(&p), ["d"]);
        p.join(event("marker"));
        assert_eq!(names(&p), ["marker"]);
        p.clear();
        assert!(p.sinks().is_empty());
    }
}
