//! The mailbox: user messages on their way to the ingest stage, handed over in
//! batches.
//!
//! # Contract
//!
//! * Messages leave in the order they were posted, from every thread together (one
//!   lock orders them), so a command group is never overtaken by a later message.
//! * A post costs one uncontended lock and a move of the message into a ring buffer
//!   whose storage is kept (up to [`RETAINED`] messages): no allocation per message,
//!   no box, no per-message hand-over. The ingest stage takes everything posted since
//!   its last pass in one lock ([`Mailbox::take`]), so a busy scheduler picks up
//!   submissions in batches as large as the submitter got ahead, and an idle one still
//!   sees each at once.
//! * A post into an empty mailbox rings the bell (one token on a channel), so a
//!   scheduler blocked on its inputs wakes. Only the ingest stage empties the mailbox,
//!   and it drains the bell as it takes, so at most a token or two wait between passes:
//!   the bell never grows with the number of messages.
//! * A submitter over its window waits for room ([`Mailbox::wait_for_room`]) asleep,
//!   and the take that makes room wakes it: a producer held back by the scheduler
//!   costs no core while it waits.

use std::collections::VecDeque;
use std::time::Duration;

use gantry_driver::sync::atomic::{AtomicUsize, Ordering};
use gantry_driver::sync::channel::{unbounded, Receiver, Sender};
use gantry_driver::sync::{Condvar, Mutex};

use crate::resources::Message;

/// Messages' worth of storage a mailbox keeps once drained; a backlog beyond it is
/// returned to the allocator, so a burst does not pin its peak for the runtime's life.
pub const RETAINED: usize = 4096;

/// User messages in posting order, shared by every user handle and the scheduler.
pub struct Mailbox {
    queue: Mutex<VecDeque<Message>>,
    /// The queue's length, readable without the lock (emptiness checks while
    /// spinning, back-pressure). Written under the lock.
    len: AtomicUsize,
    bell: Sender<()>,
    bell_rx: Receiver<()>,
    /// Submitters asleep in [`Mailbox::wait_for_room`] (counted under the lock), and
    /// where they sleep.
    waiting: AtomicUsize,
    room: Condvar,
}

impl Default for Mailbox {
    fn default() -> Self {
        let (bell, bell_rx) = unbounded();
        Self {
            queue: Mutex::new(VecDeque::new()),
            len: AtomicUsize::new(0),
            bell,
            bell_rx,
            waiting: AtomicUsize::new(0),
            room: Condvar::new(),
        }
    }
}

impl Mailbox {
    /// An empty mailbox.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `msg`; rings the bell if the mailbox was empty.
    pub fn post(&self, msg: Message) {
        let was_empty = {
            let mut queue = self.queue.lock();
            queue.push_back(msg);
            self.len.store(queue.len(), Ordering::Release);
            queue.len() == 1
        };
        if was_empty {
            let _ = self.bell.send(());
        }
    }

    /// Moves up to `limit` of the oldest messages to the back of `out`, in order,
    /// and drains the bell. Returns how many moved. Taking everything swaps the
    /// storage (no copy); a partial take copies `limit` messages.
    pub fn take(&self, limit: usize, out: &mut VecDeque<Message>) -> usize {
        while self.bell_rx.try_recv().is_ok() {}
        if self.is_empty() {
            return 0;
        }
        let mut queue = self.queue.lock();
        let n = queue.len().min(limit);
        if n == queue.len() && out.is_empty() {
            std::mem::swap(&mut *queue, out);
        } else {
            out.extend(queue.drain(..n));
        }
        if queue.is_empty() {
            queue.shrink_to(RETAINED);
        }
        self.len.store(queue.len(), Ordering::Release);
        // A waiter counts itself under the lock this take holds, so none is missed.
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.room.notify_all();
        }
        n
    }

    /// Sleeps while `limit` or more messages wait, until a take makes room or
    /// `timeout` passes (the caller re-checks whatever else may end its wait: a
    /// stopped scheduler takes nothing). Returns whether there is room.
    pub fn wait_for_room(&self, limit: usize, timeout: Duration) -> bool {
        let mut queue = self.queue.lock();
        if queue.len() >= limit {
            self.waiting.fetch_add(1, Ordering::Relaxed);
            self.room.wait_for(&mut queue, timeout);
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        queue.len() < limit
    }

    /// Returns the messages of `taken` (all taken by [`Mailbox::take`] and not
    /// processed) to the front of the mailbox, ahead of anything posted since, in
    /// their order. Leaves `taken` empty.
    pub fn put_back(&self, taken: &mut VecDeque<Message>) {
        if taken.is_empty() {
            return;
        }
        let mut queue = self.queue.lock();
        while let Some(msg) = taken.pop_back() {
            queue.push_front(msg);
        }
        self.len.store(queue.len(), Ordering::Release);
    }

    /// Messages waiting.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Whether none wait.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bell: a token arrives when a message is posted into an empty mailbox.
    /// Select on it to block until there is input.
    pub fn bell(&self) -> &Receiver<()> {
        &self.bell_rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synced(n: u64) -> Message {
        Message::Synced(n)
    }

    fn numbers(out: &VecDeque<Message>) -> Vec<u64> {
        out.iter()
            .map(|m| match m {
                Message::Synced(n) => *n,
                _ => unreachable!("only Synced messages are posted here"),
            })
            .collect()
    }

    #[test]
    fn messages_leave_in_posting_order_across_partial_takes() {
        let mailbox = Mailbox::new();
        (0..10).for_each(|i| mailbox.post(synced(i)));
        assert_eq!(mailbox.len(), 10);
        let mut out = VecDeque::new();
        assert_eq!(mailbox.take(4, &mut out), 4);
        assert_eq!(numbers(&out), [0, 1, 2, 3]);
        mailbox.post(synced(10));
        assert_eq!(mailbox.take(usize::MAX, &mut out), 7);
        assert_eq!(numbers(&out), (0..=10).collect::<Vec<_>>());
        assert!(mailbox.is_empty());
        assert_eq!(mailbox.take(usize::MAX, &mut out), 0);
    }

    #[test]
    fn put_back_returns_unprocessed_messages_ahead_of_later_posts() {
        let mailbox = Mailbox::new();
        (0..5).for_each(|i| mailbox.post(synced(i)));
        let mut out = VecDeque::new();
        mailbox.take(usize::MAX, &mut out);
        out.pop_front();
        out.pop_front();
        mailbox.post(synced(5));
        mailbox.put_back(&mut out);
        assert!(out.is_empty());
        assert_eq!(mailbox.len(), 4);
        mailbox.take(usize::MAX, &mut out);
        assert_eq!(numbers(&out), [2, 3, 4, 5]);
    }

    #[test]
    fn the_bell_rings_once_per_empty_to_busy_transition_and_take_drains_it() {
        let mailbox = Mailbox::new();
        (0..1000).for_each(|i| mailbox.post(synced(i)));
        assert_eq!(mailbox.bell().len(), 1, "one token for a thousand posts into a busy mailbox");
        let mut out = VecDeque::new();
        mailbox.take(usize::MAX, &mut out);
        assert_eq!(mailbox.bell().len(), 0);
        mailbox.post(synced(0));
        assert_eq!(mailbox.bell().len(), 1, "posting into an empty mailbox rings again");
    }

    /// A submitter waiting for room sleeps until a take makes it, and not longer.
    #[test]
    fn a_take_wakes_a_submitter_waiting_for_room() {
        let mailbox = std::sync::Arc::new(Mailbox::new());
        (0..8).for_each(|i| mailbox.post(synced(i)));
        assert!(!mailbox.wait_for_room(8, Duration::from_millis(1)), "full, and nobody takes");
        assert!(mailbox.wait_for_room(9, Duration::ZERO), "room below a larger limit");
        let waiter = {
            let m = mailbox.clone();
            std::thread::spawn(move || {
                let start = std::time::Instant::now();
                (m.wait_for_room(8, Duration::from_secs(60)), start.elapsed())
            })
        };
        while mailbox.waiting.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        let mut out = VecDeque::new();
        assert_eq!(mailbox.take(3, &mut out), 3);
        let (room, waited) = waiter.join().unwrap();
        assert!(room && waited < Duration::from_secs(30), "woken by the take ({waited:?})");
    }

    #[test]
    fn posts_from_many_threads_all_arrive_each_thread_in_order() {
        let mailbox = std::sync::Arc::new(Mailbox::new());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let m = mailbox.clone();
                std::thread::spawn(move || (0..1000).for_each(|i| m.post(synced(t * 1_000_000 + i))))
            })
            .collect();
        let mut out = VecDeque::new();
        threads.into_iter().for_each(|t| t.join().unwrap());
        mailbox.take(usize::MAX, &mut out);
        let got = numbers(&out);
        assert_eq!(got.len(), 4000);
        for t in 0..4u64 {
            let mine: Vec<u64> = got.iter().copied().filter(|n| n / 1_000_000 == t).collect();
            assert!(mine.windows(2).all(|w| w[0] < w[1]), "thread {t}'s messages reordered");
        }
    }
}
