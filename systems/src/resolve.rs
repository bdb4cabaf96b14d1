//! The **resolve** stage: dependency resolution.
//!
//! For each new command, in submission order:
//!
//! * **Memory** — per requirement, against the buffer's [`MemoryRecord`] leaves, by
//!   the memory rule ([`Accesses::access`](gantry_components::Accesses::access),
//!   which command graphs apply too): a reader depends on every unfinished writer of
//!   an overlapping range; a writer on every unfinished reader and writer of one, and
//!   then replaces the leaves its range covers. Non-overlapping ranges of one buffer
//!   never conflict.
//! * **Placement** — a command needs the buffer's contents in its device's memory
//!   space. If that copy is not valid, a memory move is inserted: straight from a
//!   device in the same peer group (a device-to-device link), else through host
//!   memory; a discard-write of the whole buffer needs no move. After a write, only
//!   the writer's space holds valid contents.
//! * **Events** — an explicit dependency on an unfinished event is an edge to its
//!   command; on a failed event, the command fails without running.
//! * **Queue order** — an in-order queue's command depends on the previous one; a
//!   barrier depends on everything submitted to its queue since the last barrier. If
//!   the previous command has already failed and retired, the command fails as its
//!   dependent (retire keeps the failure on the queue) unless the user has waited or
//!   flushed since (`FailureSync`): a failure reaches the in-order successors
//!   submitted before the user's next synchronization, as in manual mode, whatever
//!   the scheduler's timing.
//!
//! Commands with no conflict and no event or queue dependency get no edge.
//!
//! An edge between two commands on one driver that orders wait-lists itself stops
//! blocking when the predecessor is *submitted* (the driver waits); other edges stop
//! blocking when it completes.

use std::sync::Arc;

use bevy_ecs::entity::Entity;
use bevy_ecs::prelude::Local;
use bevy_ecs::world::World;

use crate::queries::Queries;
use gantry_components::{
    ByteRange, Command, CommandKind, Devices, Edges, EventShared, EventStatus, Execution, Finished,
    FusionOutcome, Fusions, ListStatus, Location, MemoryRecord, QueueState, Requirement, Requirements,
    SchedulerConfig, Stats, Status, Successor, Work, WorkLists,
};
use gantry_driver::{AccessMode, ExecError, MemSpace};
use smallvec::SmallVec;

pub(crate) type Preds = SmallVec<[Entity; 8]>;

/// The resolve stage system.
pub fn resolve(world: &mut World, mut queries: Local<Queries>) {
    pass(world, &mut queries);
}

/// One pass of the resolve stage.
pub(crate) fn pass(world: &mut World, q: &mut Queries) {
    if world.resource::<WorkLists>().resolve.is_empty() {
        return;
    }
    q.refresh(world);
    let mut list = std::mem::take(&mut world.resource_mut::<WorkLists>().resolve);
    // Lists start at ingest and end in later stages: read once per run.
    let (fusing, ending) = world
        .get_resource::<Fusions>()
        .map_or((false, false), |f| (!f.active.is_empty(), !f.pending.is_empty()));
    for &e in &list {
        resolve_command(world, q, e, fusing);
    }
    // Fusion-sync looks at what was resolved while a fusion is collecting kernels, or
    // has ended with kernels still to come: a kernel sent while its fusion was active
    // may arrive after the scheduler cancelled it, and the fusion's command must
    // then wait for it too.
    if fusing || ending {
        world.resource_mut::<WorkLists>().resolved.extend_from_slice(&list);
    }
    list.clear();
    WorkLists::give_back(&mut world.resource_mut::<WorkLists>().resolve, list);
}

/// Collects a predecessor; duplicates are removed once, in [`connect`], so a command
/// with thousands of predecessors (a fan-in) stays O(n log n).
fn push_unique(preds: &mut Preds, e: Entity, this: Entity) {
    if e != this {
        preds.push(e);
    }
}

fn is_live(world: &World, q: &mut Queries, e: Entity) -> bool {
    q.execution(world, e).is_some()
}

fn fail_now(world: &mut World, q: &mut Queries, e: Entity, error: ExecError) {
    // (A listed kernel fails on its own, not with its fusion's event.)
    crate::fusion::own_event(world, q, e);
    let now = world.resource::<SchedulerConfig>().clock.stamp_ns();
    world.resource_mut::<WorkLists>().finished.push(Finished {
        cmd: e,
        result: Err(error),
        started_ns: now,
        ended_ns: now,
        lane: 0,
    });
}

/// `fusing`: some fusion list is collecting kernels.
fn resolve_command(world: &mut World, q: &mut Queries, e: Entity, fusing: bool) {
    let Some(cmd) = q.command(world, e) else {
        return;
    };
    let (device, kind, queue) = (cmd.device, cmd.kind, cmd.queue.clone());
    let mut preds = Preds::new();
    // Queue order first: a command that fails below is still its queue's last one, so
    // its failure reaches the next in-order command like any other.
    let queue_failure = queue.and_then(|queue| queue_order(world, q, e, kind, &queue, &mut preds));
    let d = &world.resource::<Devices>().0[device as usize];
    let (space, in_driver_waits) = (d.space, d.info.caps.in_driver_waits);
    if d.is_lost() {
        let name = d.info.name.clone();
        return fail_now(world, q, e, ExecError::DeviceLost { device: name });
    }
    if let Some(error) = queue_failure {
        return fail_now(world, q, e, error);
    }
    let mut reqs = std::mem::take(&mut q.requirements_mut(world, e).expect("command").0);
    let waits = std::mem::take(&mut q.execution_mut(world, e).expect("command").waits);

    // Explicit event dependencies.
    for ev in &waits {
        match ev.status() {
            EventStatus::Complete => {}
            EventStatus::Failed => {
                let cause = ev.error().cloned().unwrap_or(ExecError::RuntimeDropped);
                q.requirements_mut(world, e).expect("command").0 = reqs;
                return fail_now(world, q, e, cause.as_dependency_of(ev.name.clone()));
            }
            _ => match ev.command.get() {
                Some(p) => {
                    if is_live(world, q, p) {
                        event_preds(world, q, p, &mut preds, e);
                    }
                }
                // A fusion's event before the fusion has a command: it stands for the
                // kernels listed so far.
                None => {
                    if let Some(list) = collecting(world, q, ev) {
                        listed_before(world, q, list, &mut preds, e);
                    }
                }
            },
        }
    }

    // Memory requirements.
    let mut kept = None;
    for i in 0..reqs.len() {
        if let Err(err) = resolve_requirement(world, q, e, &mut reqs[i], space, &mut preds, &mut kept) {
            q.requirements_mut(world, e).expect("command").0 = reqs;
            return fail_now(world, q, e, err);
        }
    }
    q.requirements_mut(world, e).expect("command").0 = reqs;
    // A failure kept on a buffer fails the command once it holds its leaves on every
    // range: commands resolved after it in this pass depend on it, and its failure is
    // kept in turn on every buffer it uses.
    if let Some(err) = kept {
        return fail_now(world, q, e, err);
    }

    // A kernel joining an active fusion list is withheld from enqueue.
    let list = if fusing && kind == CommandKind::Kernel { q.in_fusion(world, e) } else { None };
    let hold = match list {
        Some(list) => {
            let mut list = q.list_mut(world, list).expect("fusion list");
            let active = list.status == ListStatus::Active;
            if active {
                list.held.push(e);
            }
            active
        }
        None => false,
    };
    connect(world, q, e, preds, in_driver_waits, hold);
}

/// Queue order: an in-order queue's command depends on the previous one, a barrier on
/// everything since the last barrier; `e` becomes the queue's last command. Returns
/// the error `e` fails with if the previous command of its in-order queue (or, for a
/// barrier, a command since the last barrier) has already failed and retired, and the
/// user has not synchronized since: the failure reaches it as it would have had that
/// command still been alive.
fn queue_order(
    world: &mut World,
    q: &mut Queries,
    e: Entity,
    kind: CommandKind,
    queue: &Arc<gantry_components::QueueCore>,
    preds: &mut Preds,
) -> Option<ExecError> {
    let qe = queue_entity(world, q, queue);
    let mut state = q.queue_mut(world, qe).expect("queue state");
    let barrier = kind == CommandKind::Barrier;
    let last = state.order.next(e, queue.in_order, barrier, |p| push_unique(preds, p, e));
    // A failure is kept only for a command that has retired (rarely), so the common
    // path neither copies it nor asks whether `last` lives (`connect` skips an edge
    // to a command that is gone).
    let kept = state.last_failure.take();
    let mut failed = None;
    if barrier {
        failed = state.barrier_failure.take().map(|f| f.root.as_dependency_of(f.command.clone()));
    } else {
        let since = state.order.since_barrier.len();
        if since >= 256 && since.is_power_of_two() {
            // Forget the commands since the barrier that have finished.
            let mut since = std::mem::take(&mut state.order.since_barrier);
            since.retain(|&p| is_live(world, q, p));
            q.queue_mut(world, qe).expect("queue state").order.since_barrier = since;
        }
    }
    if let Some(last) = last {
        match kept {
            Some(f) if !is_live(world, q, last) => {
                failed = Some(f.root.as_dependency_of(f.command.clone()));
            }
            _ => push_unique(preds, last, e),
        }
    }
    failed
}

/// The commands an event dependency on `p` stands for: `p` itself, or, for the command
/// of a fusion list that is not fused, the kernels listed before the dependent (the
/// fusion command completes after them; depending on it is depending on them, with
/// fusion's rules).
fn event_preds(world: &World, q: &mut Queries, p: Entity, preds: &mut Preds, this: Entity) {
    if q.command(world, p).is_some_and(|c| c.kind == CommandKind::Fusion) {
        if let Some(list) = q.in_fusion(world, p) {
            // Unless the list was fused (its command then waits for the fused kernel),
            // the command waits for every kernel sent to the list, maybe `this` too:
            // the event stands for the kernels submitted before `this`, which is what
            // it stood for when it was named.
            if listed_before(world, q, list, preds, this) {
                return;
            }
        }
    }
    push_unique(preds, p, this);
}

/// The list collecting kernels whose fusion's event is `ev` (which has no command
/// while it does).
fn collecting(world: &World, q: &mut Queries, ev: &Arc<EventShared>) -> Option<Entity> {
    let active = &world.get_resource::<Fusions>()?.active;
    active.iter().copied().find(|&l| q.list(world, l).is_some_and(|l| Arc::ptr_eq(&l.shared.event, ev)))
}

/// Adds the kernels of `list` submitted before `this` to `preds`, unless the list was
/// fused; returns whether it did.
fn listed_before(world: &World, q: &mut Queries, list: Entity, preds: &mut Preds, this: Entity) -> bool {
    let Some(l) = q.list(world, list) else { return false };
    if matches!(l.shared.outcome(), Some(FusionOutcome::Fused { .. })) {
        return false;
    }
    let seq = q.command(world, this).map_or(u64::MAX, |c| c.seq);
    let kernels = l.kernels.clone();
    for k in kernels {
        if q.command(world, k).is_some_and(|c| c.seq < seq) {
            push_unique(preds, k, this);
        }
    }
    true
}

/// The queue-state entity of `q`, spawned at first use.
fn queue_entity(world: &mut World, q: &mut Queries, queue: &Arc<gantry_components::QueueCore>) -> Entity {
    if let Some(qe) = queue.entity.get() {
        return qe;
    }
    let qe = world.spawn(QueueState::new(queue.clone())).id();
    q.refresh(world);
    queue.entity.set(qe);
    qe
}

/// The memory record of a requirement's buffer, spawned at first use.
fn record_entity(world: &mut World, q: &mut Queries, req: &Requirement) -> Entity {
    if let Some(r) = req.buffer.record.get() {
        return r;
    }
    let r = world.spawn(MemoryRecord::new(req.buffer.clone())).id();
    q.refresh(world);
    req.buffer.record.set(r);
    world.resource_mut::<Stats>().live_records += 1;
    r
}

/// Places one requirement, inserting memory moves, and collects its memory edges.
fn resolve_requirement(
    world: &mut World,
    q: &mut Queries,
    e: Entity,
    req: &mut Requirement,
    space: MemSpace,
    preds: &mut Preds,
    kept: &mut Option<ExecError>,
) -> Result<(), ExecError> {
    let rec = record_entity(world, q, req);
    req.space = space;
    req.alloc = ensure_location(world, q, rec, space)?;
    let whole = ByteRange::new(0, req.buffer.bytes);
    let needs_contents = req.mode.needs_contents() || !req.range.covers(&whole);
    if needs_contents {
        let seq = q.command(world, e).map_or(0, |c| c.seq);
        ensure_valid(world, q, rec, space, seq)?;
    }

    let mut record = q.record_mut(world, rec).expect("memory record");
    // A failed command that used the range and retired before the user synchronized:
    // this command depends on it (see `MemoryRecord::failures`) and fails with it.
    if kept.is_none() {
        *kept = record
            .kept_failure(&req.range, req.mode.writes())
            .map(|f| f.root.as_dependency_of(f.command.clone()));
    }
    if needs_contents {
        if let Some(p) = record.location(space).and_then(|l| l.producer) {
            push_unique(preds, p, e);
        }
    }
    // The memory rule: read-after-write, write-after-read, write-after-write.
    let writes = req.mode.writes();
    record.leaves.access(e, &req.range, writes, |p| push_unique(preds, p, e));
    if writes {
        // Only this space now holds the current contents. Its producer (a move still
        // filling it) stays: readers of other ranges must still wait for the move.
        // The writer itself is found through the write leaves, per range.
        let placed_over_nothing = !record.location(space).is_some_and(|l| l.valid);
        let before: SmallVec<[MemSpace; 2]> =
            record.locations.iter().filter(|l| l.valid).map(|l| l.space).collect();
        for loc in record.locations.iter_mut() {
            if loc.space == space {
                loc.valid = true;
            } else {
                loc.valid = false;
                loc.producer = None;
            }
        }
        if placed_over_nothing {
            req.valid_before = Some(Box::new((next_placement(world), before)));
        }
    }
    Ok(())
}

/// Makes sure the buffer has a location (and allocation) in `space`.
fn ensure_location(
    world: &mut World,
    q: &mut Queries,
    rec: Entity,
    space: MemSpace,
) -> Result<Option<gantry_driver::AllocId>, ExecError> {
    let record = q.record(world, rec).expect("memory record");
    if let Some(loc) = record.location(space) {
        return Ok(loc.alloc);
    }
    let MemSpace::Device(d) = space else {
        return Ok(None);
    };
    let bytes = record.buffer.bytes;
    let alloc = world.resource::<Devices>().0[d as usize].driver.alloc(bytes)?;
    q.record_mut(world, rec).expect("memory record").locations.push(Location {
        space,
        alloc: Some(alloc),
        valid: false,
        producer: None,
    });
    Ok(Some(alloc))
}

/// Makes the contents valid in `space`, inserting memory moves as needed.
/// `seq`: the sequence number of the command that needs the contents (moves carry it).
fn ensure_valid(
    world: &mut World,
    q: &mut Queries,
    rec: Entity,
    space: MemSpace,
    seq: u64,
) -> Result<(), ExecError> {
    let record = q.record(world, rec).expect("memory record");
    if record.location(space).is_some_and(|l| l.valid) {
        return Ok(());
    }
    let host_valid = record.location(MemSpace::Host).is_some_and(|l| l.valid);
    if let (MemSpace::Device(to), false) = (space, host_valid) {
        // A peer device's valid copy moves over the device-to-device link.
        let devices = &world.resource::<Devices>().0;
        let group = devices[to as usize].info.caps.peer_group;
        let peer = record.locations.iter().find(|l| {
            l.valid
                && l.device().is_some_and(|d| group != 0 && devices[d as usize].info.caps.peer_group == group)
        });
        if let Some(peer) = peer {
            let from = peer.space;
            return insert_move(world, q, rec, from, space, seq);
        }
    }
    let source = if host_valid || space != MemSpace::Host {
        // Device targets are fed from the host; make the host valid first if needed.
        if !host_valid {
            ensure_valid(world, q, rec, MemSpace::Host, seq)?;
        }
        MemSpace::Host
    } else {
        // Host target: take any valid device copy.
        record.locations.iter().find(|l| l.valid).map(|l| l.space).ok_or(ExecError::Driver {
            device: "scheduler".into(),
            message: "buffer has no valid copy".into(),
        })?
    };
    insert_move(world, q, rec, source, space, seq)
}

/// The resolution order of a placement snapshot (see `Requirement::valid_before`).
fn next_placement(world: &mut World) -> u64 {
    let mut stats = world.resource_mut::<Stats>();
    stats.placements += 1;
    stats.placements
}

/// Spawns a memory move from `from` to `to` of a buffer's whole contents.
fn insert_move(
    world: &mut World,
    q: &mut Queries,
    rec: Entity,
    from: MemSpace,
    to: MemSpace,
    seq: u64,
) -> Result<(), ExecError> {
    ensure_location(world, q, rec, to)?;
    let record = q.record(world, rec).expect("memory record");
    let buffer = record.buffer.clone();
    let whole = ByteRange::new(0, buffer.bytes);
    let loc = |space: MemSpace| record.location(space).expect("location").clone();
    let (src, dst) = (loc(from), loc(to));
    let device = match (from, to) {
        (_, MemSpace::Device(d)) | (MemSpace::Device(d), MemSpace::Host) => d,
        (MemSpace::Host, MemSpace::Host) => unreachable!("host-to-host move"),
    };
    let name: Arc<str> = format!("move buffer {} {:?}->{:?}", buffer.id, from, to).into();
    let config = world.resource::<SchedulerConfig>();
    let event = Arc::new(EventShared::new(name.clone(), 0, config.clock.stamp_ns()));
    let not_before_ns = world.resource::<Devices>().0[device as usize].virtual_now_ns();
    let mut src_req = Requirement::new(buffer.clone(), AccessMode::Read, whole);
    (src_req.space, src_req.alloc) = (from, src.alloc);
    let mut dst_req = Requirement::new(buffer, AccessMode::DiscardWrite, whole);
    (dst_req.space, dst_req.alloc) = (to, dst.alloc);
    // The move makes `to` valid: remember what was valid before, to restore if the
    // move fails or is failed by a dependency (its target then holds garbage).
    let before = record.locations.iter().filter(|l| l.valid).map(|l| l.space).collect();
    dst_req.valid_before = Some(Box::new((next_placement(world), before)));
    let m = world
        .spawn((
            Command { kind: CommandKind::MemoryMove, name, queue: None, device, seq },
            Requirements(SmallVec::from_iter([src_req, dst_req])),
            Edges::default(),
            Execution {
                status: Status::New,
                work: Some(Work::Move { from, to }),
                handle: None,
                event,
                waits: SmallVec::new(),
                not_before_ns,
            },
        ))
        .id();
    q.refresh(world);
    event_slot(world, q, m);
    {
        let mut stats = world.resource_mut::<Stats>();
        stats.moves += 1;
        stats.live_commands += 1;
    }
    let mut preds = Preds::new();
    let mut record = q.record_mut(world, rec).expect("memory record");
    if let Some(p) = src.producer {
        push_unique(&mut preds, p, m);
    }
    // It reads the whole buffer.
    record.leaves.access(m, &whole, false, |p| push_unique(&mut preds, p, m));
    let target = record.location_mut(to).expect("location");
    target.valid = true;
    target.producer = Some(m);
    let in_driver_waits = world.resource::<Devices>().0[device as usize].info.caps.in_driver_waits;
    connect(world, q, m, preds, in_driver_waits, false);
    // A move waiting on a held kernel is a dependent like any other (fusion-sync).
    if world.get_resource::<Fusions>().is_some_and(|f| !f.active.is_empty()) {
        world.resource_mut::<WorkLists>().resolved.push(m);
    }
    Ok(())
}

fn event_slot(world: &mut World, q: &mut Queries, e: Entity) {
    let ev = q.execution(world, e).expect("command").event.clone();
    ev.command.set(e);
}

/// Adds edges from `preds` to `e` and decides whether `e` is ready. `in_driver_waits`:
/// `e`'s driver orders wait-lists itself; `hold`: one more blocker, released by
/// whoever holds the command (a fusion list).
pub(crate) fn connect(
    world: &mut World,
    q: &mut Queries,
    e: Entity,
    mut preds: Preds,
    in_driver_waits: bool,
    hold: bool,
) {
    if preds.len() > 1 {
        preds.sort_unstable();
        preds.dedup();
    }
    let (device, kind) = {
        let c = q.command(world, e).expect("command");
        (c.device, c.kind)
    };
    let mut blockers = hold as u32;
    let mut live = SmallVec::<[Entity; 4]>::new();
    for p in preds {
        let Some((p_device, p_kind)) = q.command(world, p).map(|c| (c.device, c.kind)) else {
            continue;
        };
        let on_submit =
            in_driver_waits && p_device == device && p_kind.runs_on_driver() && kind.runs_on_driver();
        let mut p_exec_submitted = false;
        if let Some(exec) = q.execution(world, p) {
            p_exec_submitted = exec.status == Status::Submitted;
        }
        q.edges_mut(world, p).expect("edges").succs.push(Successor { entity: e, on_submit });
        if !(on_submit && p_exec_submitted) {
            blockers += 1;
        }
        live.push(p);
    }
    if !live.is_empty() {
        world.resource_mut::<Stats>().edges += live.len() as u64;
    }
    let mut edges = q.edges_mut(world, e).expect("edges");
    edges.preds = live;
    edges.blockers = blockers;
    let ready = blockers == 0;
    q.execution_mut(world, e).expect("execution").status =
        if ready { Status::Ready } else { Status::Waiting };
    if ready {
        world.resource_mut::<WorkLists>().ready.push(e);
    }
}

#[cfg(test)]
mod tests {
    use gantry_components::{CommandKind, QueueCore};
    use gantry_driver::AccessMode::{DiscardWrite, Read, ReadWrite, Write};

    use crate::testing::{entity, Harness};

    #[test]
    fn read_after_write_write_after_read_write_after_write() {
        let mut h = Harness::new(false);
        let b = h.buffer(64);
        let w1 = h.submit(&[(&b, Write, 0..64)]);
        let r1 = h.submit(&[(&b, Read, 0..32)]);
        let r2 = h.submit(&[(&b, Read, 16..48)]);
        let w2 = h.submit(&[(&b, Write, 8..24)]);
        let w3 = h.submit(&[(&b, DiscardWrite, 0..64)]);
        h.flush();
        assert_eq!(h.preds(&r1), vec![entity(&w1)], "RAW");
        assert_eq!(h.preds(&r2), vec![entity(&w1)], "RAW; readers are independent");
        let mut war = vec![entity(&w1), entity(&r1), entity(&r2)];
        war.sort();
        assert_eq!(h.preds(&w2), war, "WAR on both readers, WAW on w1");
        // w3 covers everything: it depends on the remaining leaves. r1 and r2 are
        // covered by w2 only partly, so they stay leaves.
        let mut all = vec![entity(&w1), entity(&r1), entity(&r2), entity(&w2)];
        all.sort();
        assert_eq!(h.preds(&w3), all);
    }

    #[test]
    fn covered_leaves_are_replaced() {
        let mut h = Harness::new(false);
        let b = h.buffer(64);
        let r = h.submit(&[(&b, Read, 0..8)]);
        let w = h.submit(&[(&b, Write, 0..64)]);
        let after = h.submit(&[(&b, ReadWrite, 0..8)]);
        h.flush();
        assert_eq!(h.preds(&w), vec![entity(&r)]);
        assert_eq!(h.preds(&after), vec![entity(&w)], "the reader is reachable through the writer");
    }

    #[test]
    fn disjoint_ranges_and_readers_get_no_edges() {
        let mut h = Harness::new(false);
        let b = h.buffer(64);
        let c = h.buffer(64);
        let w_lo = h.submit(&[(&b, Write, 0..32)]);
        let w_hi = h.submit(&[(&b, Write, 32..64)]);
        let other = h.submit(&[(&c, ReadWrite, 0..64)]);
        h.flush();
        assert!(h.preds(&w_lo).is_empty() && h.preds(&w_hi).is_empty() && h.preds(&other).is_empty());
        assert_eq!(h.host.submitted_entities().len(), 3, "all three enqueued at once");
    }

    #[test]
    fn in_order_queues_barriers_and_events() {
        let mut h = Harness::new(false);
        let b = h.buffer(16);
        let c = h.buffer(16);
        let ordered =
            std::sync::Arc::new(QueueCore { id: 2, device: 0, in_order: true, entity: Default::default() });
        let a1 = h.submit_on(&ordered, 0, CommandKind::Fill, &[(&b, Read, 0..16)], &[]);
        let a2 = h.submit_on(&ordered, 0, CommandKind::Fill, &[(&c, Read, 0..16)], &[]);
        let x = h.submit(&[(&c, Read, 0..4)]);
        let y = h.submit(&[(&b, Read, 0..4)]);
        let barrier = h.submit_on(&h.queue.clone(), 0, CommandKind::Barrier, &[], &[]);
        let z = h.submit_on(&h.queue.clone(), 0, CommandKind::Fill, &[], &[&a2]);
        h.flush();
        assert_eq!(h.preds(&a2), vec![entity(&a1)], "in-order queue");
        let mut xy = vec![entity(&x), entity(&y)];
        xy.sort();
        assert_eq!(h.preds(&barrier), xy, "barrier waits for its own queue only");
        assert_eq!(h.preds(&z), vec![entity(&a2)], "explicit event");
    }

    #[test]
    fn a_failed_event_fails_its_dependent() {
        let mut h = Harness::new(false);
        let b = h.buffer(16);
        let first = h.submit(&[(&b, Write, 0..16)]);
        h.flush();
        h.host.complete(entity(&first), Err(gantry_driver::ExecError::RuntimeDropped));
        h.flush();
        let later = h.submit_on(&h.queue.clone(), 0, CommandKind::Fill, &[], &[&first]);
        h.flush();
        assert!(matches!(later.error(), Some(gantry_driver::ExecError::DependencyFailed { .. })));
        assert_eq!(h.host.submitted_entities().len(), 1, "the dependent never reached the driver");
    }

    /// A failure kept on an in-order queue fails the queue's next command, unless a
    /// sync covering it came first, in message order: a command ingested in the same
    /// pass before the sync still fails.
    #[test]
    fn kept_failures_reach_in_order_commands_sent_before_the_sync() {
        use gantry_components::{Message, QueueFailures};
        let mut h = Harness::new(false);
        let queue =
            |id| std::sync::Arc::new(QueueCore { id, device: 0, in_order: true, entity: Default::default() });
        let (a, b) = (queue(2), queue(3));
        // (Each command fills a buffer of its own: only queue order links them.)
        let fill = |h: &Harness, q, bytes| {
            let buf = h.buffer(bytes);
            h.submit_on(q, 0, CommandKind::Fill, &[(&buf, DiscardWrite, 0..bytes)], &[])
        };
        let bad = [fill(&h, &a, 8), fill(&h, &b, 16)];
        h.flush();
        for ev in &bad {
            h.host.complete(entity(ev), Err(gantry_driver::ExecError::RuntimeDropped));
        }
        h.flush();
        let kept = h.world.resource::<QueueFailures>().sync.unsynced();
        assert_eq!(kept, Some(2), "both failures are kept");
        let before = fill(&h, &a, 24);
        h.tx.post(Message::Synced(2));
        let after = fill(&h, &b, 32);
        h.flush();
        assert!(matches!(before.error(), Some(gantry_driver::ExecError::DependencyFailed { .. })));
        h.flush();
        assert!(after.error().is_none());
        assert_eq!(h.host.submitted_entities().len(), 3, "the sent-after command reached the driver");
    }

    #[test]
    fn device_without_host_memory_gets_moves() {
        let mut h = Harness::new(false);
        let b = h.buffer(32);
        let q1 =
            std::sync::Arc::new(QueueCore { id: 3, device: 1, in_order: false, entity: Default::default() });
        let on_dev = h.submit_on(&q1, 1, CommandKind::Fill, &[(&b, ReadWrite, 0..16)], &[]);
        h.flush();
        let moves = h.dev.submitted_entities();
        assert_eq!(moves.len(), 1, "host->device move submitted first");
        assert_eq!(h.preds(&on_dev), vec![moves[0]]);
        h.dev.complete(moves[0], Ok(()));
        h.flush(); // retire: the move completes, the command becomes ready
        h.flush(); // enqueue
        assert_eq!(h.dev.submitted_entities().len(), 2);
        // A host reader now needs the data back.
        let on_host = h.submit(&[(&b, Read, 0..32)]);
        h.flush();
        let preds = h.preds(&on_host);
        let kinds: Vec<_> =
            preds.iter().map(|&p| h.world.get::<gantry_components::Command>(p).unwrap().kind).collect();
        assert!(preds.contains(&entity(&on_dev)), "RAW on the device writer");
        assert!(kinds.contains(&CommandKind::MemoryMove), "and the move back: {kinds:?}");
        assert_eq!(preds.len(), 2);
    }
}
