//! The scheduler's resources: inboxes, devices, work lists, configuration, counters.

use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bevy_ecs::entity::Entity;
use bevy_ecs::resource::Resource;
use gantry_driver::sync::channel::Receiver;
use gantry_driver::{Completion, DeviceInfo, Driver, ExecError, MemSpace};

use crate::command::CommandDesc;
use crate::fusion::{FusionProps, FusionShared};
use crate::handle::{BufferCore, QueueCore};

/// Index of a device in the runtime's device list.
pub type DeviceId = u32;

/// A message from user threads to the scheduler.
// Command groups are by far the most frequent message, and the mailbox keeps its
// storage: every slot having their size costs nothing, while boxing them would cost
// an allocation per command.
#[allow(clippy::large_enum_variant)]
pub enum Message {
    /// A command group. Not boxed: the mailbox keeps its storage, so a message costs
    /// a move into it rather than an allocation.
    Submit(CommandDesc),
    /// The user dropped the last handle to a buffer.
    DropBuffer(Arc<BufferCore>),
    /// The user dropped a queue.
    DropQueue(Arc<QueueCore>),
    /// The user released a host access guard (the command entity).
    ReleaseHostAccess(Entity),
    /// The user cancelled a fusion (the reason is in its shared state).
    CancelFusion(Arc<FusionShared>),
    /// The user completed a fusion.
    CompleteFusion(Arc<FusionShared>, FusionProps),
    /// The user finalized a command graph.
    FinalizeGraph(Arc<crate::graph::FinalizeJob>),
    /// The user submitted an executable command graph.
    SubmitGraph(crate::graph::GraphSubmission),
    /// A user wait or flush returned after this many failures were kept on queues:
    /// commands submitted after it do not inherit them (see
    /// [`FailureSync`](crate::FailureSync)).
    Synced(u64),
}

/// Fails what `msg` asked for with `error`, without a scheduler: for messages still
/// queued when the scheduler stops on a failure. Each event it carries reaches a
/// final status, so no wait on it hangs.
pub fn fail_message(msg: Message, error: &ExecError) {
    match msg {
        Message::Submit(desc) => desc.event.finish(Err(error.clone()), 0, 0),
        Message::SubmitGraph(submission) => submission.event.finish(Err(error.clone()), 0, 0),
        Message::CancelFusion(shared) | Message::CompleteFusion(shared, _) => {
            if !shared.event.status().is_final() {
                shared.event.finish(Err(error.clone()), 0, 0);
            }
        }
        Message::FinalizeGraph(job) => {
            *job.result.lock() = Some(Err(crate::graph::FinalizeError::Stopped(error.clone())));
            job.event.finish(Ok(()), 0, 0);
        }
        Message::DropBuffer(_)
        | Message::DropQueue(_)
        | Message::ReleaseHostAccess(_)
        | Message::Synced(_) => {}
    }
}

/// What the scheduler drains each flush.
#[derive(Resource)]
pub struct Inbox {
    /// Submissions and other user messages, in order.
    pub messages: Arc<crate::mailbox::Mailbox>,
    /// Driver completions.
    pub completions: Receiver<Completion>,
    /// Where the stages give back the last references to what user threads allocated
    /// (threaded runtimes; `None`: the stages drop them, on the thread that flushes).
    pub hand_back: Option<Arc<crate::hand_back::HandBack>>,
}

/// One device: its driver and memory space.
pub struct Device {
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// Its info (cached).
    pub info: DeviceInfo,
    /// Where its commands need their memory.
    pub space: MemSpace,
    /// Set when the device was lost; no new work is accepted. Shared with user
    /// handles, so submissions to a lost device are refused at once.
    pub lost: Arc<AtomicBool>,
}

impl Device {
    /// Whether the device was lost.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Its virtual time now (0 on a real-time device).
    pub fn virtual_now_ns(&self) -> u64 {
        if self.info.caps.virtual_time {
            self.driver.virtual_now_ns()
        } else {
            0
        }
    }
}

/// All devices; index = [`DeviceId`]. Device 0 is the host (CPU driver), which also
/// runs host tasks.
#[derive(Resource)]
pub struct Devices(pub Vec<Device>);

impl Devices {
    /// The virtual time now on each device, 0 on real-time ones: the earliest a
    /// command created now may start there.
    pub fn virtual_now_ns(&self) -> SmallVec<[u64; 4]> {
        self.0.iter().map(Device::virtual_now_ns).collect()
    }

    /// Which devices run on a virtual clock; `None` when none does.
    pub fn virtual_time(&self) -> Option<SmallVec<[bool; 4]>> {
        let flags: SmallVec<[bool; 4]> = self.0.iter().map(|d| d.info.caps.virtual_time).collect();
        flags.contains(&true).then_some(flags)
    }
}

/// A command finished outside a driver completion (markers, host accesses, commands
/// failed by the scheduler).
#[derive(Clone, Debug)]
pub struct Finished {
    /// The command.
    pub cmd: Entity,
    /// Its result.
    pub result: Result<(), ExecError>,
    /// Start time.
    pub started_ns: u64,
    /// End time.
    pub ended_ns: u64,
    /// The driver thread or engine that ran it.
    pub lane: u32,
}

/// Entities waiting for each stage, so stages never scan every command.
#[derive(Resource, Default)]
pub struct WorkLists {
    /// Newly ingested commands, in submission order.
    pub resolve: Vec<Entity>,
    /// Commands whose blockers are gone.
    pub ready: Vec<Entity>,
    /// Commands finished without a driver completion.
    pub finished: Vec<Finished>,
    /// Buffers whose records may be despawned.
    pub maybe_idle_records: Vec<Entity>,
    /// Records with leaves released this retire pass, removed at its end
    /// ([`ReleasedLeaves::remove_from`](crate::ReleasedLeaves::remove_from)).
    pub released_records: Vec<Entity>,
    /// Commands resolved this flush, kept for fusion-sync while a fusion is active.
    pub resolved: Vec<Entity>,
    /// Graph finalize requests for the partition stage.
    pub finalize: Vec<Entity>,
    /// Queues whose last handle was dropped: their state entities go at the end of the
    /// flush that ingested the drop, once every command sent before it is resolved.
    pub dropped_queues: Vec<Arc<QueueCore>>,
}

impl WorkLists {
    /// Puts back a list a stage took out of `slot` to work through, so that its
    /// allocation serves the next flush: what was added to `slot` meanwhile follows
    /// what `taken` still holds.
    ///
    /// ```
    /// let mut slot = vec![3];
    /// let taken = Vec::with_capacity(64);
    /// gantry_components::WorkLists::give_back(&mut slot, taken);
    /// assert!(slot == vec![3] && slot.capacity() >= 64);
    /// ```
    pub fn give_back<T>(slot: &mut Vec<T>, mut taken: Vec<T>) {
        taken.append(slot);
        *slot = taken;
    }

    /// Whether a further flush would make progress without new input.
    pub fn has_work(&self) -> bool {
        !(self.resolve.is_empty()
            && self.ready.is_empty()
            && self.finished.is_empty()
            && self.finalize.is_empty())
    }
}

/// Scheduler settings.
#[derive(Resource, Clone, Debug)]
pub struct SchedulerConfig {
    /// Ask drivers to restore written ranges when a command fails.
    pub preserve_on_failure: bool,
    /// The runtime's clock: the timestamps of events the scheduler makes or finishes.
    pub clock: gantry_driver::Clock,
    /// The most messages one flush ingests: a producer that never pauses must not
    /// keep a flush from reaching the stages that run and retire its work.
    pub ingest_limit: usize,
}

/// Counters, for monitoring and tests.
#[derive(Resource, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Commands ingested.
    pub submitted: u64,
    /// Messages ingested (submissions, drops, releases).
    pub messages: u64,
    /// Commands finished successfully.
    pub completed: u64,
    /// Commands finished with an error.
    pub failed: u64,
    /// Memory moves inserted.
    pub moves: u64,
    /// Dependency edges created.
    pub edges: u64,
    /// Requirements placed by resolution (orders placement snapshots).
    pub placements: u64,
    /// Commands alive in the world.
    pub live_commands: u64,
    /// Operations handed to drivers whose completion has not arrived yet.
    pub in_driver: u64,
    /// Memory records alive in the world.
    pub live_records: u64,
    /// Fusion lists replaced by a fused kernel.
    pub fusions_fused: u64,
    /// Fusion lists cancelled (explicitly, early, or by the fusion compiler): their
    /// kernels ran unfused.
    pub fusions_cancelled: u64,
    /// Systems users added that failed (panicked or returned an error); each is also
    /// reported by `Runtime::take_system_errors`.
    pub system_failures: u64,
}
