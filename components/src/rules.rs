//! The dependency rules, stated once: the resolve stage applies them to commands as
//! they are submitted, and a command graph applies them to nodes as they are added
//! or recorded, over the same leaf-set index ([`LeafSet`]), so building a graph is
//! linear in its nodes for every access pattern, as resolution is.
//!
//! * **Memory** ([`Accesses::access`]): a reader follows every earlier writer of an
//!   overlapping byte range (read-after-write); a writer follows every earlier
//!   reader and writer of an overlapping range (write-after-read, write-after-write)
//!   and then replaces the leaves its range covers, which stay reachable through it.
//!   Disjoint ranges of one buffer never conflict.
//! * **Queue order** ([`QueueOrder::next`]): a command of an in-order queue follows
//!   the previous one; a barrier follows everything submitted to its queue since the
//!   previous barrier. Recorded into a graph, a barrier also precedes what is
//!   recorded after it (the recording semantics of the SYCL graph extension), and an
//!   in-order queue records a chain (its barrier follows the previous node only);
//!   submitted eagerly, a barrier is waited on through its event.

use crate::memory::{ByteRange, Leaf, LeafKey, LeafSet};

/// The unfinished accesses to one buffer that later ones may conflict with: the
/// reads, and the writes no later write covers, each by range.
#[derive(Clone, Debug, Default)]
pub struct Accesses<K: LeafKey> {
    /// Reads not yet covered by a later write.
    pub reads: LeafSet<K>,
    /// Writes not yet covered by a later write.
    pub writes: LeafSet<K>,
}

impl<K: LeafKey> Accesses<K> {
    /// No access.
    pub fn new() -> Self {
        Self { reads: LeafSet::default(), writes: LeafSet::default() }
    }

    /// The memory rule: `who` accesses `range` (writing if `writes`). Calls `follow`
    /// for each earlier access it must wait for (never `who` itself; a command
    /// reached through several leaves is named once per leaf), then records the
    /// access.
    ///
    /// ```
    /// use gantry_components::{Accesses, ByteRange};
    /// let mut buf = Accesses::<u32>::new();
    /// let deps = |buf: &mut Accesses<u32>, who, (s, e), writes| {
    ///     let mut d = vec![];
    ///     buf.access(who, &ByteRange::new(s, e), writes, |p| d.push(p));
    ///     d.sort();
    ///     d
    /// };
    /// assert_eq!(deps(&mut buf, 1, (0, 8), true), [0u32; 0], "the first writer follows nothing");
    /// assert_eq!(deps(&mut buf, 2, (0, 4), false), [1], "read after write");
    /// assert_eq!(deps(&mut buf, 3, (4, 8), false), [1], "another range, the same writer");
    /// assert_eq!(deps(&mut buf, 4, (0, 8), true), [1, 2, 3], "write after read and write");
    /// assert_eq!(deps(&mut buf, 5, (0, 2), false), [4], "the covered leaves are gone");
    /// ```
    #[inline]
    pub fn access(&mut self, who: K, range: &ByteRange, writes: bool, mut follow: impl FnMut(K)) {
        let mut edge = |leaf: &Leaf<K>| {
            if leaf.cmd != who {
                follow(leaf.cmd);
            }
        };
        if writes {
            self.writes.overlap_and_cover(range, who, &mut edge);
            self.reads.overlap_and_cover(range, who, &mut edge);
            self.writes.push(Leaf { cmd: who, range: *range });
        } else {
            self.writes.for_each_overlapping(range, &mut edge);
            self.reads.push(Leaf { cmd: who, range: *range });
        }
    }

    /// How many accesses are recorded.
    pub fn len(&self) -> usize {
        self.reads.len() + self.writes.len()
    }

    /// Whether either set is in an index rather than a short list.
    pub fn is_indexed(&self) -> bool {
        self.reads.is_indexed() || self.writes.is_indexed()
    }

    /// Whether no access is recorded.
    pub fn is_empty(&self) -> bool {
        self.reads.is_empty() && self.writes.is_empty()
    }
}

/// The queue-order state of one queue: its last command and those since its last
/// barrier.
#[derive(Clone, Debug)]
pub struct QueueOrder<K> {
    /// The last command submitted.
    pub last: Option<K>,
    /// Commands since the last barrier (that barrier first, once there is one): a
    /// barrier follows all of them and then replaces them.
    pub since_barrier: Vec<K>,
    /// The last barrier, where later commands follow it ([`QueueOrder::recorded`]).
    pub barrier: Option<K>,
    /// Recording into a command graph.
    recorded: bool,
}

impl<K: Copy> QueueOrder<K> {
    /// The order of an eagerly submitted queue: a barrier is waited on through its
    /// event.
    pub fn eager() -> Self {
        Self { last: None, since_barrier: Vec::new(), barrier: None, recorded: false }
    }

    /// The order of a queue recording into a command graph: what is recorded after a
    /// barrier follows it.
    pub fn recorded() -> Self {
        Self { last: None, since_barrier: Vec::new(), barrier: None, recorded: true }
    }

    /// The queue-order rule for `who`, the queue's next command (a barrier if
    /// `barrier`): calls `follow` for the commands since the last barrier (for a
    /// barrier; recorded on an in-order queue, the previous node suffices) and for
    /// the last recorded barrier, and returns the previous command of an in-order
    /// queue, which `who` follows too: the caller adds that edge, as the previous
    /// command may have gone with a failure to pass on.
    ///
    /// ```
    /// use gantry_components::QueueOrder;
    /// let mut q = QueueOrder::<u32>::eager();
    /// let mut d = vec![];
    /// assert_eq!(q.next(1, false, false, |p| d.push(p)), None);
    /// assert_eq!(q.next(2, false, false, |p| d.push(p)), None, "out of order: no edge");
    /// q.next(3, false, true, |p| d.push(p));
    /// assert_eq!(d, [1, 2], "a barrier follows everything since the last one");
    /// assert_eq!(q.next(4, true, false, |p| d.push(p)), Some(3), "in order: the previous command");
    /// ```
    pub fn next(&mut self, who: K, in_order: bool, barrier: bool, follow: impl FnMut(K)) -> Option<K> {
        let last = self.preds(in_order, barrier, follow);
        self.push(who, barrier);
        last
    }

    /// [`QueueOrder::next`] in two steps, for a caller that learns `who` only once
    /// the command is added: what the next command follows, without changing the
    /// state ...
    pub fn preds(&self, in_order: bool, barrier: bool, mut follow: impl FnMut(K)) -> Option<K> {
        let last = self.last.filter(|_| in_order);
        if barrier {
            if !(self.recorded && last.is_some()) {
                self.since_barrier.iter().copied().for_each(&mut follow);
            }
        } else if let Some(b) = self.barrier {
            follow(b);
        }
        last
    }

    /// ... and then the command itself, `who`, becoming the queue's last.
    pub fn push(&mut self, who: K, barrier: bool) {
        self.last = Some(who);
        if barrier {
            self.since_barrier.clear();
            self.since_barrier.push(who);
            if self.recorded {
                self.barrier = Some(who);
            }
        } else {
            self.since_barrier.push(who);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recorded into a graph, what follows a barrier follows it; eagerly it does not.
    /// A recorded in-order queue is a chain; eagerly, its barrier also names what
    /// came since the previous barrier.
    #[test]
    fn recorded_barriers_order_later_commands_and_in_order_queues_chain() {
        for (mut q, later) in [(QueueOrder::<u32>::eager(), vec![]), (QueueOrder::recorded(), vec![2])] {
            q.next(1, false, false, |_| {});
            q.next(2, false, true, |_| {});
            let mut d = vec![];
            q.next(3, false, false, |p| d.push(p));
            assert_eq!(d, later);
        }
        for (mut q, since) in [(QueueOrder::<u32>::recorded(), vec![]), (QueueOrder::eager(), vec![1])] {
            q.next(1, true, false, |_| {});
            let mut d = vec![];
            assert_eq!(q.next(2, true, true, |p| d.push(p)), Some(1));
            assert_eq!(d, since);
        }
    }
}
