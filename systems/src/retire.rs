//! The **retire** stage: lets drivers make progress, applies their completions and the
//! scheduler's own, completes events, releases memory-record leaves, propagates
//! failures to dependents, despawns finished commands and idle records, and clears
//! the world's change trackers (once per flush).

use std::sync::Arc;

use bevy_ecs::entity::Entity;
use bevy_ecs::prelude::Local;
use bevy_ecs::world::{FromWorld, World};

use crate::queries::Queries;
use gantry_components::{
    CommandKind, DeviceId, Devices, EventShared, Execution, Finished, FusionList, Inbox, KeptFailure,
    MemoryRecord, QueueFailure, QueueFailures, Requirement, Returning, Slice, Stats, Status, Timeline,
    WorkLists,
};
use gantry_driver::fusion::KeptOnFailure;
use gantry_driver::{ExecError, MemSpace};
use smallvec::SmallVec;

/// The retire stage system.
pub fn retire(world: &mut World, mut queries: Local<Queries>) {
    pass(world, &mut queries);
}

/// One pass of the retire stage.
pub(crate) fn pass(world: &mut World, q: &mut Queries) {
    q.refresh(world);
    for d in &world.resource::<Devices>().0 {
        d.driver.poll();
    }
    let rx = world.resource::<Inbox>().completions.clone();
    let mut finished = std::mem::take(&mut world.resource_mut::<WorkLists>().finished);
    let before = finished.len();
    finished.extend(rx.try_iter().map(|c| Finished {
        cmd: Entity::from_bits(c.op.0),
        result: c.result,
        started_ns: c.started_ns,
        ended_ns: c.ended_ns,
        lane: c.lane,
    }));
    if !finished.is_empty() {
        world.resource_mut::<Stats>().in_driver -= (finished.len() - before) as u64;
        let mut timeline = world.remove_resource::<Timeline>();
        let virtual_time = world.resource::<Devices>().virtual_time();
        // The events whose last reference retiring drops, freed where they were
        // allocated (see `HandBack`).
        let mut returning = Returning::to(world.resource::<Inbox>().hand_back.clone());
        for f in finished.drain(..) {
            finish(world, q, f, &mut timeline, virtual_time.as_deref(), &mut returning);
        }
        if let Some(t) = timeline {
            world.insert_resource(t);
        }
        returning.give();
    }
    WorkLists::give_back(&mut world.resource_mut::<WorkLists>().finished, finished);
    remove_released_leaves(world, q);
    crate::fusion::delete_replaced_lists(world, q);
    release_idle_records(world, q);
    release_dropped_queues(world, q);
    // Bevy keeps a removal message for each component of every despawned entity
    // (here, every retired command) until the world's trackers are cleared; never
    // cleared, they grew by about 60 bytes a command. Cleared once per flush, as a game
    // clears them once per frame: the messages are double-buffered, so a system added
    // to any stage still reads this flush's removals in its next run.
    world.clear_trackers();
}

/// One blocker of `e` is gone; it becomes ready when none remain.
pub(crate) fn unblock(world: &mut World, q: &mut Queries, e: Entity) {
    let Some(mut edges) = q.edges_mut(world, e) else {
        return;
    };
    edges.blockers = edges.blockers.saturating_sub(1);
    if edges.blockers > 0 {
        return;
    }
    let mut exec = q.execution_mut(world, e).expect("execution");
    if exec.status == Status::Waiting {
        exec.status = Status::Ready;
        world.resource_mut::<WorkLists>().ready.push(e);
    }
}

/// Completes one command and despawns it; failures poison its dependents.
/// `virtual_time`: which devices run on a virtual clock (`None`: none does, and no
/// virtual time needs handing on).
fn finish(
    world: &mut World,
    q: &mut Queries,
    f: Finished,
    timeline: &mut Option<Timeline>,
    virtual_time: Option<&[bool]>,
    returning: &mut Returning,
) {
    let Some(name) = world_name(world, q, f.cmd) else {
        return;
    };
    // Only the command that met the loss marks its device (dependents fail through
    // DependencyFailed and may run elsewhere).
    if let Err(ExecError::DeviceLost { .. }) = &f.result {
        let device = q.command(world, f.cmd).expect("command").device;
        device_lost(world, q, device);
    }
    let virtual_end = virtual_time.map_or(0, |v| virtual_end(world, q, &f, v));
    let mut undos = Vec::new();
    // A failure's events, and its dependents', finish once the whole cascade has been
    // retired: a user whose wait on one of them returns then finds every failure of
    // the cascade recorded on its queue, to be cleared by its sync (`FailureSync`), as
    // a wait in manual mode returns after the flush that retired the cascade.
    let mut events = Vec::new();
    let defer = f.result.is_err().then_some(&mut events);
    let Some(succs) = retire_entity(world, q, &f, timeline, &mut undos, defer, returning) else {
        return;
    };
    match f.result {
        Ok(()) => {
            for s in succs.iter().filter(|s| !s.on_submit) {
                if virtual_end > 0 {
                    if let Some(mut exec) = q.execution_mut(world, s.entity) {
                        exec.not_before_ns = exec.not_before_ns.max(virtual_end);
                    }
                }
                unblock(world, q, s.entity);
            }
        }
        Err(error) => {
            // Each dependent's error names the command it depended on.
            let mut stack: Vec<(Entity, ExecError)> =
                succs.iter().map(|s| (s.entity, error.as_dependency_of(name.clone()))).collect();
            while let Some((e, err)) = stack.pop() {
                let Some(name) = world_name(world, q, e) else {
                    continue;
                };
                let poisoned = Finished {
                    cmd: e,
                    result: Err(err.clone()),
                    started_ns: f.ended_ns,
                    ended_ns: f.ended_ns,
                    lane: 0,
                };
                if let Some(next) =
                    retire_entity(world, q, &poisoned, timeline, &mut undos, Some(&mut events), returning)
                {
                    stack.extend(next.iter().map(|s| (s.entity, err.as_dependency_of(name.clone()))));
                }
            }
            apply_undos(world, q, undos);
            for (event, result, started_ns, ended_ns) in events {
                event.finish(result, started_ns, ended_ns);
            }
        }
    }
}

/// When a finished command ended in virtual time, for its dependents' `not_before_ns`:
/// its end on a device with a virtual clock; on a real-time device (the CPU, host
/// accesses), what its own dependencies handed it, so virtual time flows through.
fn virtual_end(world: &World, q: &mut Queries, f: &Finished, virtual_time: &[bool]) -> u64 {
    let Some(device) = q.command(world, f.cmd).map(|c| c.device) else {
        return 0;
    };
    if virtual_time[device as usize] {
        f.ended_ns
    } else {
        q.execution(world, f.cmd).map_or(0, |x| x.not_before_ns)
    }
}

fn world_name(world: &World, q: &mut Queries, e: Entity) -> Option<std::sync::Arc<str>> {
    q.command(world, e).map(|c| c.name.clone())
}

/// An event to finish once a failure's cascade has been retired: the event, the
/// result, the start and end times.
type Deferred = (Arc<EventShared>, Result<(), ExecError>, u64, u64);

/// Finishes the event (or hands it to `defer`), releases leaves and despawns; returns
/// the successors, or `None` if the entity was already gone. A finished event goes to
/// `returning`.
fn retire_entity(
    world: &mut World,
    q: &mut Queries,
    f: &Finished,
    timeline: &mut Option<Timeline>,
    undos: &mut Vec<Undo>,
    defer: Option<&mut Vec<Deferred>>,
    returning: &mut Returning,
) -> Option<smallvec::SmallVec<[gantry_components::Successor; 4]>> {
    let e = f.cmd;
    let exec = q.execution(world, e)?;
    let event = exec.event.clone();
    let ok = f.result.is_ok();
    if let Some(t) = timeline {
        let cmd = q.command(world, e).expect("command");
        let preds = q.edges(world, e).expect("edges").preds.iter().map(|p| p.to_bits()).collect();
        let reqs = &q.requirements(world, e).expect("requirements").0;
        let bytes = match cmd.kind {
            CommandKind::Copy | CommandKind::MemoryMove => reqs.get(1).map_or(0, |r| r.range.len()),
            CommandKind::CopyFromHost | CommandKind::CopyToHost | CommandKind::Fill => {
                reqs.first().map_or(0, |r| r.range.len())
            }
            _ => 0,
        } as u64;
        t.slices.push(Slice {
            id: e.to_bits(),
            name: cmd.name.clone(),
            kind: cmd.kind,
            device: cmd.device,
            queue: cmd.queue.as_ref().map(|q| q.id),
            lane: f.lane,
            start_ns: f.started_ns,
            end_ns: f.ended_ns,
            preds,
            bytes,
            error: f.result.as_ref().err().map(|e| e.to_string()),
        });
    }
    let succs = std::mem::take(&mut q.edges_mut(world, e).expect("edges").succs);
    let reqs = std::mem::take(&mut q.requirements_mut(world, e).expect("requirements").0);
    if let Err(error) = &f.result {
        let unfused = fused_kernels(world, q, e);
        undos_of(&reqs, unfused.as_ref(), undos);
        // One number per failed command, wherever it is kept (its queue, its buffers).
        if let Some(command) = q.command(world, e).map(|c| c.name.clone()) {
            let seq = world.resource::<QueueFailures>().sync.record();
            let failure = QueueFailure { command, root: error.root_cause().clone(), seq };
            record_queue_failure(world, q, e, &failure);
            record_buffer_failures(world, q, &reqs, &failure);
        }
    }
    for r in &reqs {
        if let Some(rec) = r.buffer.record.get() {
            if let Some(mut record) = q.record_mut(world, rec) {
                let first = record.release(e, &r.range);
                let dropped = record.buffer.is_dropped();
                // (A scheduler that failed may have lost its lists; `abandon_all` then
                // finds the records itself.)
                if let Some(mut lists) =
                    (first || dropped).then(|| world.get_resource_mut::<WorkLists>()).flatten()
                {
                    if first {
                        lists.released_records.push(rec);
                    }
                    if dropped {
                        lists.maybe_idle_records.push(rec);
                    }
                }
            }
        }
    }
    world.despawn(e);
    event.command.clear();
    match defer {
        Some(events) => events.push((event, f.result.clone(), f.started_ns, f.ended_ns)),
        None => {
            event.finish(f.result.clone(), f.started_ns, f.ended_ns);
            returning.event(event);
        }
    }
    let mut stats = world.resource_mut::<Stats>();
    stats.live_commands -= 1;
    if ok {
        stats.completed += 1;
    } else {
        stats.failed += 1;
    }
    Some(succs)
}

/// If failed command `e` is the last command of an in-order queue, or the first to
/// fail since its queue's last barrier, records its failure there (before its event
/// finishes): the queue's next command, or next barrier, depends on it and fails with
/// it even if it arrives after `e` is gone, unless the user has synchronized since
/// (see `FailureSync`).
fn record_queue_failure(world: &mut World, q: &mut Queries, e: Entity, failure: &QueueFailure) {
    let Some(cmd) = q.command(world, e) else { return };
    let Some(queue) = cmd.queue.clone() else { return };
    let Some(qe) = queue.entity.get() else { return };
    let Some(state) = q.queue(world, qe) else { return };
    let last = queue.in_order && state.order.last == Some(e);
    // The first failure since the last barrier is the one the barrier names.
    let before_barrier = cmd.kind != CommandKind::Barrier
        && state.barrier_failure.is_none()
        && state.order.since_barrier.contains(&e);
    if !(last || before_barrier) {
        return;
    }
    let listed = state.failure_listed;
    let mut state = q.queue_mut(world, qe).expect("queue state");
    if before_barrier {
        state.barrier_failure = Some(failure.clone());
    }
    if last {
        state.last_failure = Some(failure.clone());
    }
    state.failure_listed = true;
    if !listed {
        world.resource_mut::<QueueFailures>().queues.push(qe);
    }
}

/// Keeps a failed command's failure on the records of the buffers it used (`reqs`), until the
/// user synchronizes: a command resolved meanwhile that would have depended on it
/// fails with it (see `MemoryRecord::failures`), whenever the scheduler got to run it.
fn record_buffer_failures(world: &mut World, q: &mut Queries, reqs: &[Requirement], failure: &QueueFailure) {
    for r in reqs.iter().filter(|r| !r.internal) {
        let Some(rec) = r.buffer.record.get() else { continue };
        let Some(mut record) = q.record_mut(world, rec) else { continue };
        let first = record.failures.is_empty();
        record.failures.push(KeptFailure {
            range: r.range,
            writes: r.mode.writes(),
            failure: failure.clone(),
        });
        if first {
            world.resource_mut::<QueueFailures>().records.push(rec);
        }
    }
}

/// A validity state to restore after a failure: (resolution order, buffer, the
/// spaces holding its last valid contents).
type Undo = (u64, Arc<gantry_components::BufferCore>, SmallVec<[MemSpace; 2]>);

/// What a failed command's failure means for its buffers' validity.
///
/// Resolution marks a space valid before the command that fills it has run: a memory
/// move, or a whole-buffer discard-write into a space that held no valid copy. When
/// such a command fails (or is failed by a dependency), its target holds garbage.
/// Every command resolved after it that relied on that placement depended on it and
/// failed in the same cascade, so the valid set from before the *earliest* such
/// placement in the cascade is the truth again ([`apply_undos`]).
///
/// A failed fused kernel whose driver ran its kernels again unfused
/// ([`Unfused::rerun`](gantry_host::Unfused::rerun)) is the exception: a
/// placement one of them completed holds what it wrote (`unfused` says which
/// argument, the fused kernel's requirement of the same index), as it would have
/// unfused, and stays valid.
fn undos_of(
    reqs: &[gantry_components::Requirement],
    unfused: Option<&Arc<dyn KeptOnFailure>>,
    out: &mut Vec<Undo>,
) {
    for (i, r) in reqs.iter().enumerate() {
        if let Some((order, before)) = r.valid_before.as_deref() {
            if unfused.is_some_and(|u| u.kept(i)) {
                continue;
            }
            out.push((*order, r.buffer.clone(), before.clone()));
        }
    }
}

/// The kernels of `e`, if it is a fused kernel whose failure may have to keep some
/// of its placements ([`FusionList::unfused`]).
fn fused_kernels(world: &World, q: &mut Queries, e: Entity) -> Option<Arc<dyn KeptOnFailure>> {
    let list = q.in_fusion(world, e)?;
    let l = q.list(world, list)?;
    if l.command != Some(e) {
        return None;
    }
    l.unfused.clone()
}

fn apply_undos(world: &mut World, q: &mut Queries, mut undos: Vec<Undo>) {
    undos.sort_by_key(|u| u.0);
    let mut done: SmallVec<[u64; 4]> = SmallVec::new();
    for (_, buffer, valid) in undos {
        if done.contains(&buffer.id) {
            continue;
        }
        done.push(buffer.id);
        let Some(mut record) = buffer.record.get().and_then(|rec| q.record_mut(world, rec)) else { continue };
        for loc in record.locations.iter_mut() {
            loc.valid = valid.contains(&loc.space);
        }
    }
}

/// Marks a device lost and forgets its copies of every buffer. A buffer whose only
/// valid copy was there falls back to its host copy: the last contents the runtime
/// still has.
fn device_lost(world: &mut World, q: &mut Queries, device: DeviceId) {
    let flag = world.resource::<Devices>().0[device as usize].lost.clone();
    if flag.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return;
    }
    tracing::warn!(device, "device lost: its buffer copies are dropped and new work is refused");
    let mut records = world.query::<&mut MemoryRecord>();
    for mut record in records.iter_mut(world) {
        record.locations.retain(|l| l.device() != Some(device));
        if !record.locations.iter().any(|l| l.valid) {
            let host = record.location_mut(gantry_driver::MemSpace::Host).expect("host copy");
            host.valid = true;
            host.producer = None;
        }
    }
    q.refresh(world);
}

/// Removes the leaves of the commands retired this pass from their records, a
/// record's many at once ([`MemoryRecord::release`]); nothing reads leaves between.
fn remove_released_leaves(world: &mut World, q: &mut Queries) {
    if world.resource::<WorkLists>().released_records.is_empty() {
        return;
    }
    let records = std::mem::take(&mut world.resource_mut::<WorkLists>().released_records);
    remove_released(world, q, &records);
    // The list's storage is kept for the next pass.
    let mut records = records;
    records.clear();
    world.resource_mut::<WorkLists>().released_records = records;
}

/// Removes the released leaves of `records`.
fn remove_released(world: &mut World, q: &mut Queries, records: &[Entity]) {
    for &rec in records {
        let Some(mut record) = q.record_mut(world, rec) else {
            continue;
        };
        // Taken out while the sweep asks the world which commands are still alive.
        let mut leaves = std::mem::replace(&mut record.leaves, gantry_components::Accesses::new());
        let mut released = std::mem::take(&mut record.released);
        let entities = world.entities();
        released.remove_from(&mut leaves, |e| entities.contains_spawned(e));
        let mut record = q.record_mut(world, rec).expect("record");
        record.leaves = leaves;
        record.released = released;
    }
}

/// Despawns records of dropped buffers that no command uses, freeing device memory.
fn release_idle_records(world: &mut World, q: &mut Queries) {
    let candidates = std::mem::take(&mut world.resource_mut::<WorkLists>().maybe_idle_records);
    for rec in candidates {
        let Some(record) = q.record(world, rec) else {
            continue;
        };
        if !(record.buffer.is_dropped() && record.is_idle()) {
            continue;
        }
        let allocs: Vec<_> = record.locations.iter().filter_map(|l| Some((l.device()?, l.alloc?))).collect();
        let buffer = record.buffer.clone();
        for (d, a) in allocs {
            world.resource::<Devices>().0[d as usize].driver.free(a);
        }
        buffer.record.clear();
        world.despawn(rec);
        world.resource_mut::<Stats>().live_records -= 1;
    }
}

/// Despawns the state entities of queues dropped this flush. Nothing needs them any
/// more: every command sent to the queue was ingested before the drop and has been
/// resolved. Its commands still alive reach the entity only through the queue's slot,
/// cleared here (a failure of theirs then has no next command to record it for).
fn release_dropped_queues(world: &mut World, q: &mut Queries) {
    let dropped = std::mem::take(&mut world.resource_mut::<WorkLists>().dropped_queues);
    for queue in dropped {
        if let Some(qe) = queue.entity.get() {
            if q.queue(world, qe).is_some() {
                world.despawn(qe);
            }
            queue.entity.clear();
        }
    }
}

/// Fails every command still alive with `error`: used at shutdown
/// ([`ExecError::RuntimeDropped`]), once drivers are idle, for commands that can never
/// run (blocked behind a host access the user still holds), and when the scheduler
/// fails ([`ExecError::SchedulerFailed`]). A fusion still collecting kernels has no
/// command yet: its held kernels carry its event, which failing them fails; the last
/// loop fails the event of a list that holds none (its kernels failed before it took
/// them), which would otherwise stay pending.
pub fn abandon_all(world: &mut World, error: ExecError) {
    let q = &mut Queries::from_world(world);
    q.refresh(world);
    let mut all = world.query::<(Entity, &Execution)>();
    let live: Vec<Entity> = all.iter(world).map(|(e, _)| e).collect();
    let mut timeline = world.remove_resource::<Timeline>();
    for e in live {
        let f = Finished { cmd: e, result: Err(error.clone()), started_ns: 0, ended_ns: 0, lane: 0 };
        // Dropped here: the scheduler is stopping.
        retire_entity(world, q, &f, &mut timeline, &mut Vec::new(), None, &mut Returning::to(None));
    }
    let mut records = world.query::<(Entity, &MemoryRecord)>();
    let released: Vec<Entity> =
        records.iter(world).filter(|(_, r)| !r.released.is_empty()).map(|(e, _)| e).collect();
    remove_released(world, q, &released);
    if let Some(t) = timeline {
        world.insert_resource(t);
    }
    let mut lists = world.query::<&FusionList>();
    for l in lists.iter(world).filter(|l| l.command.is_none() && !l.shared.event.status().is_final()) {
        l.shared.event.finish(Err(error.clone()), 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gantry_components::{BufferCore, EventShared, EventStatus, MemoryRecord, Stats};
    use gantry_driver::AccessMode::{Read, ReadWrite};
    use gantry_driver::ExecError;

    use crate::testing::{entity, Harness};

    /// A failure reaches every transitive dependent, naming the chain; independent
    /// work completes; the failed commands are despawned and their leaves released.
    #[test]
    fn failure_poisons_transitive_dependents_only() {
        let mut h = Harness::new(false);
        let (a, b, c) = (h.buffer(8), h.buffer(8), h.buffer(8));
        let root = h.submit(&[(&a, ReadWrite, 0..8)]);
        let child = h.submit(&[(&a, Read, 0..8), (&b, ReadWrite, 0..8)]);
        let grandchild = h.submit(&[(&b, Read, 0..8)]);
        let independent = h.submit(&[(&c, ReadWrite, 0..8)]);
        h.flush();
        h.host.complete(entity(&independent), Ok(()));
        h.host.complete(entity(&root), Err(ExecError::RuntimeDropped));
        h.flush();
        assert_eq!(independent.status(), EventStatus::Complete);
        assert_eq!(root.error(), Some(&ExecError::RuntimeDropped));
        for ev in [&child, &grandchild] {
            assert_eq!(ev.status(), EventStatus::Failed);
            assert_eq!(ev.error().unwrap().root_cause(), &ExecError::RuntimeDropped);
        }
        assert!(matches!(
            grandchild.error(),
            Some(ExecError::DependencyFailed { cause, .. }) if matches!(**cause, ExecError::DependencyFailed { .. })
        ));
        assert_eq!(h.world.resource::<Stats>().live_commands, 0);
        let rec = a.record.get().unwrap();
        let record = h.world.get::<MemoryRecord>(rec).unwrap();
        assert!(record.leaves.reads.is_empty() && record.leaves.writes.is_empty());
    }

    /// Retired commands leave no trace: after thousands of flushes the world holds
    /// only the removal messages of the last two.
    #[test]
    fn retired_commands_leave_no_removal_messages_behind() {
        let mut h = Harness::new(false);
        let a = h.buffer(8);
        let held =
            |w: &bevy_ecs::world::World| w.removed_components().iter().map(|(_, m)| m.len()).sum::<usize>();
        let mut most = 0;
        for _ in 0..2_000 {
            let cmd = h.submit(&[(&a, ReadWrite, 0..8)]);
            h.flush();
            h.host.complete(entity(&cmd), Ok(()));
            h.flush();
            assert_eq!(cmd.status(), EventStatus::Complete);
            most = most.max(held(&h.world));
        }
        assert_eq!(h.world.resource::<Stats>().completed, 2_000);
        assert!(most > 0, "despawns are recorded");
        assert!(most <= 8, "{most} removal messages held: the trackers are not cleared");
    }

    /// `n` commands each writing its own 4-byte element of one buffer, resolved.
    fn element_writers(n: usize) -> (Harness, Arc<BufferCore>, Vec<Arc<EventShared>>) {
        let mut h = Harness::new(false);
        let a = h.buffer(4 * n);
        let cmds = (0..n).map(|i| h.submit(&[(&a, ReadWrite, i * 4..i * 4 + 4)])).collect();
        h.flush();
        (h, a, cmds)
    }

    /// Many commands of one buffer retired in one pass (their leaves go in one
    /// sweep) and a few (one by one) leave the record with exactly the leaves of the
    /// commands still running, which later commands still depend on.
    #[test]
    fn leaves_of_a_pass_go_together_and_only_theirs() {
        let (mut h, a, cmds) = element_writers(1000);
        let leaves = |h: &Harness| {
            let record = h.world.get::<MemoryRecord>(a.record.get().unwrap()).unwrap();
            assert!(record.released.is_empty(), "nothing pending between passes");
            record.leaves.len()
        };
        assert_eq!(leaves(&h), 1000);
        // 900 in one pass: a sweep; then 10 of the 100 left: one by one.
        for (done, n) in [(0..900, 100), (900..910, 90)] {
            for ev in &cmds[done] {
                h.host.complete(entity(ev), Ok(()));
            }
            h.flush();
            assert_eq!(leaves(&h), n);
        }
        let late = h.submit(&[(&a, Read, 3800..4000)]);
        h.flush();
        let mut preds = h.preds(&late);
        preds.sort();
        let mut want: Vec<_> = cmds[950..].iter().map(|ev| entity(ev)).collect();
        want.sort();
        assert_eq!(preds, want, "a later reader waits for the writers left, and only them");
    }

    /// Commands abandoned (a scheduler that stops) leave their records without
    /// leaves, so the records of dropped buffers can go.
    #[test]
    fn abandoned_commands_release_their_leaves() {
        let (mut h, a, cmds) = element_writers(100);
        super::abandon_all(&mut h.world, ExecError::RuntimeDropped);
        assert!(cmds.iter().all(|ev| ev.status() == EventStatus::Failed));
        let record = h.world.get::<MemoryRecord>(a.record.get().unwrap()).unwrap();
        assert!(record.is_idle() && record.released.is_empty());
    }

    /// A dropped buffer's record goes once its last command retires.
    #[test]
    fn dropped_buffer_record_is_despawned_when_idle() {
        let mut h = Harness::new(false);
        let a = h.buffer(8);
        let cmd = h.submit(&[(&a, ReadWrite, 0..8)]);
        h.flush();
        a.dropped.store(true, std::sync::atomic::Ordering::Release);
        h.tx.post(gantry_components::Message::DropBuffer(a.clone()));
        h.flush();
        assert!(a.record.get().is_some(), "still in use");
        h.host.complete(entity(&cmd), Ok(()));
        h.flush();
        assert!(a.record.get().is_none());
        assert_eq!(h.world.resource::<Stats>().live_records, 0);
    }
}
