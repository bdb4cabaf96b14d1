//! Recorded operations waiting for [`Driver::poll`](gantry_driver::Driver::poll), in
//! order of (virtual end, submission).

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::clock::Node;
use crate::machine::OpWork;

/// A recorded operation waiting for [`Driver::poll`](gantry_driver::Driver::poll), in a
/// box that the queue reuses: executing it empties it (no node, [`OpWork::Marker`], no waits), so that nodes never
/// keep their predecessors alive, and the next operation fills it in place.
#[derive(Default)]
pub(crate) struct Pending {
    pub(crate) node: Option<Arc<Node>>,
    pub(crate) work: OpWork,
    pub(crate) preserve: bool,
    pub(crate) waits: SmallVec<[Arc<Node>; 4]>,
}

/// A bucket of [`PendingQueue`]: operations with one virtual end, in submission order.
pub(crate) type Bucket = VecDeque<Box<Pending>>;

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
pub(crate) struct PendingQueue {
    /// The distinct ends of queued operations: each has a non-empty bucket, in
    /// `buckets` or `front`.
    pub(crate) ends: BinaryHeap<Reverse<u64>>,
    /// The buckets by end, but for `front`'s.
    pub(crate) buckets: FxHashMap<u64, Bucket>,
    /// The bucket being drained and its end; empty when there is none.
    pub(crate) front: (u64, Bucket),
    /// Emptied buckets, for new ends.
    pub(crate) spare_buckets: Vec<Bucket>,
    /// The emptied boxes of executed operations (boxes, not values: they move to and
    /// from the buckets without copying their operations).
    #[allow(clippy::vec_box)]
    pub(crate) spare: Vec<Box<Pending>>,
}

impl PendingQueue {
    /// An empty box for an operation.
    pub(crate) fn vacant(&mut self) -> Box<Pending> {
        self.spare.pop().unwrap_or_default()
    }

    /// Empties a box and keeps it for a later operation.
    pub(crate) fn release(&mut self, mut op: Box<Pending>) {
        op.node = None;
        op.work = OpWork::Marker;
        op.waits.clear();
        self.spare.push(op);
    }

    /// Queues an operation that ends at `ended_ns`, after every queued one (it is the
    /// latest submitted).
    pub(crate) fn push(&mut self, ended_ns: u64, op: Box<Pending>) {
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
    pub(crate) fn pop(&mut self) -> Option<Box<Pending>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

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
                op.work = OpWork::Invalid(ExecError::RuntimeDropped);
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
}
