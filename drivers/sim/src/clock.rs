//! The device's timeline: its mutable state (the virtual clock and the horizon of
//! the latest poll, the engines' next free times, the fault counters, the pending
//! queue), and the nodes the scheduler holds for submitted operations.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use gantry_driver::{ExecError, OpId};

use crate::machine::SimDriver;
use crate::pending::PendingQueue;

/// Everything that changes on submission, allocation and execution.
#[derive(Default)]
pub(crate) struct State {
    /// The device's clock: the end of the last operation it executed.
    pub(crate) clock: u64,
    /// The clock when the latest poll began: an operation submitted since then reacts
    /// to completions reported no earlier, so it never starts before it.
    pub(crate) horizon: u64,
    /// Bytes held by live allocations (in the machine's table).
    pub(crate) allocated: usize,
    /// Recorded, not yet executed operations, in order of (virtual end, submission).
    pub(crate) queue: PendingQueue,
    /// Kernels and copies (indexed by [`Faulting`](crate::faults::Faulting)) and
    /// allocations so far, and operations executed (fault plans count these).
    pub(crate) counted: [u64; 2],
    pub(crate) allocs: u64,
    pub(crate) executed: u64,
    /// Set once the device is lost.
    pub(crate) lost: bool,
    /// When each compute and copy engine is next free (empty: unlimited engines).
    pub(crate) compute_free: Vec<u64>,
    pub(crate) copy_free: Vec<u64>,
    /// Executed nodes, oldest first, whose allocations new submissions reuse once
    /// nothing else holds them (the scheduler drops its handle when it retires the
    /// command): a submission then allocates nothing.
    pub(crate) spare: VecDeque<Arc<Node>>,
}

/// One submitted operation, as the scheduler holds it (its [`gantry_driver::OpHandle`]).
pub(crate) struct Node {
    /// The driver instance it was submitted to.
    pub(crate) instance: u64,
    pub(crate) id: OpId,
    pub(crate) started_ns: u64,
    pub(crate) ended_ns: u64,
    /// The engine that runs it: 1.. for compute engines, then copy engines; 0 when
    /// engines are unlimited or it needs none.
    pub(crate) lane: u32,
    /// Set once the operation has executed (or failed without running).
    pub(crate) done: AtomicBool,
    /// Why it failed, if it did: set before `done`.
    pub(crate) failure: OnceLock<ExecError>,
}

/// Executed nodes kept for reuse (see [`State::spare`]) at most.
pub(crate) const SPARE_NODES: usize = 4096;

impl State {
    /// `node` in an allocation of its own: the oldest spare one if nothing else holds
    /// it any more (else that one goes to the back, to be looked at again later), or
    /// a new one.
    pub(crate) fn node(&mut self, node: Node) -> Arc<Node> {
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
    pub(crate) fn recycle(&mut self, node: Arc<Node>) {
        if self.spare.len() < SPARE_NODES {
            self.spare.push_back(node);
        }
    }
}

impl SimDriver {
    /// The virtual clock, in nanoseconds: the end of the last executed operation.
    pub fn now_ns(&self) -> u64 {
        self.state.lock().clock
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

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

    /// A submission starts at the latest of its hint's `not_before_ns` (which the scheduler
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
                hint: Some(gantry_driver::SimHint { not_before_ns, host_task_ns: None }),
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
}
