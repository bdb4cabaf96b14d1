//! The **ingest** stage: drains user messages into entities, in submission order.

use bevy_ecs::prelude::Local;
use bevy_ecs::world::World;

use std::collections::VecDeque;
use std::sync::Arc;

use bevy_ecs::entity::Entity;
use smallvec::SmallVec;

use crate::queries::Queries;
use gantry_components::{
    CancelReason, Command, CommandDesc, Devices, Edges, Execution, Finished, FusionList, FusionOutcome,
    FusionShared, Fusions, InFusion, Inbox, ListStatus, Message, QueueFailures, Requirements,
    SchedulerConfig, Stats, Status, WorkLists,
};

/// The commands one ingest pass spawns, in submission order.
struct NewCommands {
    /// The sequence number of the pass's first command.
    first_seq: u64,
    /// Commands spawned this pass.
    count: u64,
    /// The resolve list, taken to be appended to and given back: its allocation is
    /// kept across flushes (resolve gives it back emptied).
    spawned: Vec<Entity>,
    /// Virtual clocks only move when drivers poll (the retire stage), so one reading
    /// serves every command of the pass.
    clocks: Option<SmallVec<[u64; 4]>>,
}

impl NewCommands {
    fn new(world: &mut World) -> Self {
        let first_seq = world.resource::<Stats>().submitted;
        let spawned = std::mem::take(&mut world.resource_mut::<WorkLists>().resolve);
        Self { first_seq, count: 0, spawned, clocks: None }
    }

    /// The sequence number of the next command (fusion requests are ordered by it).
    fn next_seq(&self) -> u64 {
        self.first_seq + self.count
    }

    /// Gives the resolve list back, with this pass's commands at its end.
    fn give_back(self, world: &mut World) {
        WorkLists::give_back(&mut world.resource_mut::<WorkLists>().resolve, self.spawned);
    }

    /// Spawns the command `desc` describes; a kernel of a fusing queue joins its list.
    fn spawn(&mut self, world: &mut World, q: &mut Queries, desc: CommandDesc) {
        let seq = self.next_seq();
        let CommandDesc { kind, name, queue, device, requirements, work, waits, event, fusion } = desc;
        // A kernel sent to a fusion carries the fusion's event, which names no command
        // while its kernels are listed; any other command's event names it.
        let carries_fusion = fusion.as_ref().is_some_and(|f| Arc::ptr_eq(&f.event, &event));
        let slot = (!carries_fusion).then(|| event.clone());
        let list = fusion.and_then(|f| f.list.get());
        let buffers: SmallVec<[u64; 4]> = match list {
            Some(_) => requirements.iter().map(|r| r.buffer.id).collect(),
            None => SmallVec::new(),
        };
        let clocks = self.clocks.get_or_insert_with(|| world.resource::<Devices>().virtual_now_ns());
        let bundle = (
            Command { kind, name, queue: Some(queue), device, seq },
            Requirements(requirements),
            Edges::default(),
            Execution {
                status: Status::New,
                work: Some(work),
                handle: None,
                event,
                waits,
                not_before_ns: clocks[device as usize],
            },
        );
        let e = match list {
            None => world.spawn(bundle).id(),
            Some(list) => world.spawn((bundle, InFusion { list })).id(),
        };
        q.refresh(world);
        self.spawned.push(e);
        self.count += 1;
        if let Some(event) = slot {
            event.command.set(e);
        }
        let Some(list) = list else { return };
        // A listed kernel keeps its fusion's event while its list collects kernels,
        // and gets one of its own if the list has already ended (cancelled by the
        // scheduler before the kernel arrived), as it will run unfused.
        let mut l = q.list_mut(world, list).expect("fusion list");
        let active = l.status == ListStatus::Active;
        l.kernels.push(e);
        for b in buffers {
            if !l.buffers.contains(&b) {
                l.buffers.push(b);
            }
        }
        if !active {
            crate::fusion::own_event(world, q, e);
        }
    }
}

/// The ingest stage system.
pub fn ingest(world: &mut World, mut queries: Local<Queries>, mut taken: Local<VecDeque<Message>>) {
    pass(world, &mut queries, &mut taken);
}

/// One pass of the ingest stage. `taken` is a buffer kept across passes (empty
/// between them).
pub(crate) fn pass(world: &mut World, q: &mut Queries, taken: &mut VecDeque<Message>) {
    q.refresh(world);
    let mailbox = world.resource::<Inbox>().messages.clone();
    let limit = world.resource::<SchedulerConfig>().ingest_limit;
    // Before the take: what fails here leaves the messages in the mailbox, where a
    // failed scheduler fails them.
    let mut commands = NewCommands::new(world);
    let mut messages = 0u64;
    if let Some(n) = world.resource_mut::<QueueFailures>().pending.take() {
        apply_sync(world, q, n);
    }
    // One lock for everything posted since the last pass (up to the limit).
    mailbox.take(limit, taken);
    while let Some(msg) = taken.pop_front() {
        messages += 1;
        match msg {
            Message::Submit(desc) => {
                if let Some(shared) = &desc.fusion {
                    start_fusion(world, q, shared, commands.next_seq());
                }
                commands.spawn(world, q, desc)
            }
            Message::SubmitGraph(submission) => submission.commands(|desc| commands.spawn(world, q, desc)),
            Message::CancelFusion(shared) => {
                start_fusion(world, q, &shared, commands.next_seq());
                let reason = match shared.outcome() {
                    Some(FusionOutcome::Cancelled(r)) => r,
                    _ => CancelReason::Requested,
                };
                request_for(world, q, &shared, |l| {
                    l.cancel.get_or_insert(reason);
                });
            }
            Message::CompleteFusion(shared, props) => {
                let seq = commands.next_seq();
                start_fusion(world, q, &shared, seq);
                request_for(world, q, &shared, |l| l.complete = Some((seq, props)));
            }
            Message::FinalizeGraph(job) => {
                let e = world.spawn(gantry_components::Finalizing(job)).id();
                world.resource_mut::<WorkLists>().finalize.push(e);
            }
            Message::DropBuffer(buffer) => {
                // Marked here, in message order, so commands submitted before the drop
                // (maybe not resolved yet) still find the record. An idle record goes
                // at the end of this flush, a busy one when its last command retires.
                buffer.dropped.store(true, std::sync::atomic::Ordering::Release);
                let active = world.get_resource::<Fusions>().map(|f| f.active.clone()).unwrap_or_default();
                for list in active {
                    // After `complete_fusion` the kernels keep the buffer alive: no cancel.
                    if q.list(world, list)
                        .is_some_and(|l| l.complete.is_none() && l.buffers.contains(&buffer.id))
                    {
                        request(world, q, list, |l| {
                            l.cancel.get_or_insert(CancelReason::BufferDropped { buffer: buffer.id });
                        });
                    }
                }
                if let Some(rec) = buffer.record.get() {
                    world.resource_mut::<WorkLists>().maybe_idle_records.push(rec);
                }
            }
            Message::DropQueue(queue) => {
                // The queue's list goes once its command has (no fusion will reuse it).
                let list = world.get_resource_mut::<Fusions>().and_then(|mut f| f.by_queue.remove(&queue.id));
                if let Some(list) = list {
                    request(world, q, list, |l| {
                        if l.status == ListStatus::Active && l.complete.is_none() {
                            l.cancel.get_or_insert(CancelReason::QueueDropped);
                        }
                    });
                    world.resource_mut::<Fusions>().deleting.push(list);
                }
                // Its state goes at the end of the flush (retire): commands sent before
                // the drop, maybe ingested in this same pass, are resolved first, in
                // order, against it (despawned now, it would be spawned again for them
                // without their predecessors, and never despawned).
                world.resource_mut::<WorkLists>().dropped_queues.push(queue);
            }
            Message::Synced(n) => {
                // Commands ingested before it still inherit the failures it clears:
                // with some in this pass, it waits until they have been resolved, and
                // the pass ends here.
                if commands.count == 0 {
                    apply_sync(world, q, n);
                } else {
                    world.resource_mut::<QueueFailures>().pending = Some(n);
                    // The rest stays first in line for the next pass.
                    mailbox.put_back(taken);
                    break;
                }
            }
            Message::ReleaseHostAccess(e) => {
                let now = world.resource::<SchedulerConfig>().clock.stamp_ns();
                let started = q.execution(world, e).map(|x| x.event.timestamps().started_ns);
                if let Some(started_ns) = started {
                    world.resource_mut::<WorkLists>().finished.push(Finished {
                        cmd: e,
                        result: Ok(()),
                        started_ns,
                        ended_ns: now,
                        lane: 0,
                    });
                }
            }
        }
    }
    // Kept for the next pass, but not a burst's worth.
    taken.shrink_to(gantry_components::mailbox::RETAINED);
    let spawned = commands.count;
    commands.give_back(world);
    if messages > 0 {
        let mut stats = world.resource_mut::<Stats>();
        stats.messages += messages;
        stats.submitted += spawned;
        stats.live_commands += spawned;
    }
}

/// Clears the failures kept on queues and buffers (see `QueueFailures`) up to the
/// `n`th recorded: a user wait or flush returned after them, so later commands do not
/// inherit them. A queue or record stays listed while it keeps one.
fn apply_sync(world: &mut World, q: &mut Queries, n: u64) {
    let (mut queues, mut records) = {
        let mut failures = world.resource_mut::<QueueFailures>();
        (std::mem::take(&mut failures.queues), std::mem::take(&mut failures.records))
    };
    let later = |f: &Option<gantry_components::QueueFailure>| f.as_ref().is_some_and(|f| f.seq > n);
    queues.retain(|&qe| {
        let Some(mut state) = q.queue_mut(world, qe) else { return false };
        if !later(&state.last_failure) {
            state.last_failure = None;
        }
        if !later(&state.barrier_failure) {
            state.barrier_failure = None;
        }
        state.failure_listed = state.last_failure.is_some() || state.barrier_failure.is_some();
        state.failure_listed
    });
    records.retain(|&rec| {
        let Some(mut record) = q.record_mut(world, rec) else { return false };
        record.failures.retain(|f| f.failure.seq > n);
        !record.failures.is_empty()
    });
    let mut failures = world.resource_mut::<QueueFailures>();
    (failures.queues, failures.records) = (queues, records);
    failures.sync.applied.fetch_max(n, std::sync::atomic::Ordering::AcqRel);
}

/// Puts `shared`'s queue in fusion mode, if this is the first message about the
/// fusion (see [`FusionShared::queue`]): gives it a list, which spawns no command
/// (see `fusion::fusion_command`). The queue's previous list
/// is reset for this fusion once it has ended and its command is gone (the common
/// case: a frame's fusion after the last one's was waited for); otherwise it is
/// marked for deletion and a new list is spawned.
fn start_fusion(world: &mut World, q: &mut Queries, shared: &Arc<FusionShared>, seq: u64) {
    if shared.list.get().is_some() {
        return;
    }
    let queue = &shared.queue;
    let previous = world.resource::<Fusions>().by_queue.get(&queue.id).copied();
    let mut reused = None;
    if let Some(old) = previous {
        // A list still waiting for its `complete_fusion` (ingested in this same flush)
        // is fused first; the fuse stage marks it for deletion after. (An ended list
        // has its command: the fused kernel or the cancelled list's marker.)
        if let Some((status, command)) = q.list(world, old).map(|l| (l.status, l.command)) {
            let done = command.is_some_and(|c| q.command(world, c).is_none());
            if status != ListStatus::Active && done {
                reused = Some(old);
            } else {
                if status != ListStatus::Active {
                    q.list_mut(world, old).expect("list").status = ListStatus::Delete;
                }
                world.resource_mut::<Fusions>().deleting.push(old);
            }
        }
    }
    // No command yet: the fusion's event stands for the listed kernels until the list
    // is fused (its first kernel becomes the fused kernel) or cancelled (a marker is
    // spawned then).
    let list = match reused {
        Some(list) => {
            q.list_mut(world, list).expect("fusion list").restart(shared.clone(), queue, seq);
            list
        }
        None => {
            let list = world.spawn(FusionList::new(shared.clone(), queue.clone(), seq)).id();
            q.refresh(world);
            world.resource_mut::<Fusions>().by_queue.insert(queue.id, list);
            list
        }
    };
    shared.list.set(list);
    world.resource_mut::<Fusions>().active.push(list);
}

/// Records a message-driven action on a list for the fusion stages.
fn request(world: &mut World, q: &mut Queries, list: Entity, f: impl FnOnce(&mut FusionList)) {
    if let Some(mut l) = q.list_mut(world, list) {
        f(&mut l);
        world.resource_mut::<Fusions>().pending.push(list);
    }
}

/// [`request`] for a message about the fusion `shared`, if its list still holds that
/// fusion (a queue's ended list is reset for its next fusion).
fn request_for(
    world: &mut World,
    q: &mut Queries,
    shared: &Arc<FusionShared>,
    f: impl FnOnce(&mut FusionList),
) {
    let list =
        shared.list.get().filter(|&l| q.list(world, l).is_some_and(|l| Arc::ptr_eq(&l.shared, shared)));
    if let Some(list) = list {
        request(world, q, list, f);
    }
}
