//! Queue entities: the state in-order queues and barriers depend on, and the failures
//! in-order queues keep until the user next synchronizes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::entity::Entity;
use bevy_ecs::resource::Resource;
use gantry_driver::ExecError;

use crate::handle::QueueCore;
use crate::rules::QueueOrder;

/// Per-queue scheduling state.
#[derive(Component, Debug)]
pub struct QueueState {
    /// The queue.
    pub core: Arc<QueueCore>,
    /// The queue-order rule's state: the last command submitted (in-order queues
    /// depend on it) and the commands since the last barrier that may still be
    /// unfinished (a barrier depends on all of them and then replaces them).
    pub order: QueueOrder<Entity>,
    /// Set when `last` failed and retired (in-order queues only), until the user
    /// synchronizes (see [`FailureSync`]): the next command depends on a command that
    /// is gone, and fails as it would have had `last` still been alive.
    pub last_failure: Option<QueueFailure>,
    /// Set when a command submitted since the last barrier failed and retired (any
    /// queue), until the user synchronizes or a barrier takes it: the next barrier
    /// depends on that command and fails with it, as it would have had the command
    /// still been alive.
    pub barrier_failure: Option<QueueFailure>,
    /// Whether the queue is in [`QueueFailures::queues`].
    pub failure_listed: bool,
}

impl QueueState {
    /// Fresh state for a queue.
    pub fn new(core: Arc<QueueCore>) -> Self {
        Self {
            core,
            order: QueueOrder::eager(),
            last_failure: None,
            barrier_failure: None,
            failure_listed: false,
        }
    }
}

/// A failed command's failure, kept after it retired until the user synchronizes
/// (see [`FailureSync`]): on its queue ([`QueueState`]) and on the records of the
/// buffers it used ([`MemoryRecord::failures`](crate::MemoryRecord::failures)).
#[derive(Clone, Debug)]
pub struct QueueFailure {
    /// The failed command's name (the next command's error names it).
    pub command: Arc<str>,
    /// The root cause (only it is kept, so the errors of a long chain of failures do
    /// not nest ever deeper).
    pub root: ExecError,
    /// Its number in [`FailureSync::recorded`] order.
    pub seq: u64,
}

/// When failures stop reaching in-order successors, shared by the scheduler and user
/// threads.
///
/// In manual mode a failure retires in the flush of some wait (or explicit flush) of
/// the user's: commands submitted before that were resolved while it lived and fail
/// with it; commands submitted after it are independent of it. A threaded scheduler
/// retires failures whenever it gets to them, so the same rule is kept by what the
/// user does, not by when the scheduler runs: retire numbers each failed command
/// (`recorded`) and keeps its failure on its queue and its buffers, where commands
/// resolved later that would have depended on it fail with it, and a user wait or
/// flush that returns while some are not
/// cleared yet sends [`Message::Synced`](crate::Message::Synced) with the count, in
/// order with that thread's later submissions; ingest clears them (`applied`).
#[derive(Debug, Default)]
pub struct FailureSync {
    /// Failures recorded on queues so far (written by the scheduler).
    pub recorded: AtomicU64,
    /// Failures cleared by a sync (written by the scheduler).
    pub applied: AtomicU64,
}

impl FailureSync {
    /// Numbers a failure kept on a queue.
    pub fn record(&self) -> u64 {
        self.recorded.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// After a user wait or flush: the count of failures recorded so far, if some are
    /// not cleared yet (then the caller sends a sync, even if another thread's is on its
    /// way: its own must precede its later submissions). Two atomic loads.
    pub fn unsynced(&self) -> Option<u64> {
        let recorded = self.recorded.load(Ordering::Acquire);
        (recorded > self.applied.load(Ordering::Acquire)).then_some(recorded)
    }
}

/// The scheduler's side of [`FailureSync`].
#[derive(Resource, Debug, Default)]
pub struct QueueFailures {
    /// Shared with the runtime's user threads.
    pub sync: Arc<FailureSync>,
    /// Queues that may hold a failure.
    pub queues: Vec<Entity>,
    /// Memory records that may hold a failure
    /// ([`MemoryRecord::failures`](crate::MemoryRecord::failures)).
    pub records: Vec<Entity>,
    /// A sync that arrived after commands of its ingest pass: applied before the next
    /// pass, once those commands have been resolved.
    pub pending: Option<u64>,
}
