//! The **ingest** stage: drains user messages into entities, in submission order.

use bevy_ecs::prelude::Local;
use bevy_ecs::world::World;

use crate::queries::Queries;
use gantry_components::{
    Command, Edges, Execution, Finished, Inbox, Message, Requirements, SchedulerConfig, Stats, Status,
    WorkLists,
};

/// The ingest stage system.
pub fn ingest(world: &mut World, mut queries: Local<Queries>) {
    let q = &mut *queries;
    q.refresh(world);
    let rx = world.resource::<Inbox>().messages.clone();
    let first_seq = world.resource::<Stats>().submitted;
    let mut new_commands = Vec::new();
    let mut messages = 0u64;
    while let Ok(msg) = rx.try_recv() {
        messages += 1;
        match msg {
            Message::Submit(desc) => {
                let seq = first_seq + new_commands.len() as u64;
                let event = desc.event;
                let e = world
                    .spawn((
                        Command {
                            kind: desc.kind,
                            name: desc.name,
                            queue: Some(desc.queue),
                            device: desc.device,
                            seq,
                        },
                        Requirements(desc.requirements),
                        Edges::default(),
                        Execution {
                            status: Status::New,
                            work: Some(desc.work),
                            handle: None,
                            event: event.clone(),
                            waits: desc.waits,
                        },
                    ))
                    .id();
                q.refresh(world);
                event.command.set(e);
                new_commands.push(e);
            }
            Message::DropBuffer(buffer) => {
                // Marked here, in message order, so commands submitted before the drop
                // (maybe not resolved yet) still find the record. An idle record goes
                // at the end of this flush, a busy one when its last command retires.
                buffer.dropped.store(true, std::sync::atomic::Ordering::Release);
                if let Some(rec) = buffer.record.get() {
                    world.resource_mut::<WorkLists>().maybe_idle_records.push(rec);
                }
            }
            Message::DropQueue(queue) => {
                if let Some(qe) = queue.entity.get() {
                    if q.queue(world, qe).is_some() {
                        world.despawn(qe);
                    }
                    queue.entity.clear();
                }
            }
            Message::ReleaseHostAccess(e) => {
                let now = world.resource::<SchedulerConfig>().now_ns();
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
    let spawned = new_commands.len() as u64;
    if spawned > 0 {
        world.resource_mut::<WorkLists>().resolve.extend(new_commands);
    }
    if messages > 0 {
        let mut stats = world.resource_mut::<Stats>();
        stats.messages += messages;
        stats.submitted += spawned;
        stats.live_commands += spawned;
    }
}
