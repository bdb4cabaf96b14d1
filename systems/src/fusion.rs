//! The **fusion-sync** and **fuse** stages (the DPC++ kernel-fusion design, "Scheduler
//! Integration").
//!
//! Kernels submitted to a fusing queue are resolved like any command — they are in
//! the dependency graph and the memory records' leaves — but *held*: one extra blocker
//! keeps them from enqueue. While the list collects kernels it has no command: the
//! fusion's event, which `submit` returned, stands for the kernels listed so far (a
//! dependency on it is a dependency on them). A cancelled list spawns its fusion
//! command then (`fusion_command`): a marker, held the same way, with an edge from
//! each listed kernel, whose completion completes the fusion's event.
//!
//! **Fusion-sync** cancels a list early (as `cancel_fusion` would) when it must:
//! a command that is not fused depends on a held kernel, by a requirement or an event
//! (a host access, host task, copy, fill, barrier, a command on another queue, a
//! kernel released by another cancellation, a fused kernel); a listed kernel depends
//! on another fusing queue's list that (transitively) depends on this one (a cycle:
//! that other list is cancelled); or a message asked for it (cancel, a dropped buffer
//! or queue). Commands submitted after `complete_fusion` do not cancel: the fuse stage
//! moves their edges to the fused kernel. Cancelling releases the held kernels unfused,
//! in their original order and with their own edges.
//!
//! **Fuse** performs `complete_fusion`: it asks the fusion compiler for one kernel; on
//! failure the list is cancelled with a warning. On success the listed kernels are
//! replaced: the fused kernel gets the union of their requirements (one per buffer) and
//! of their edges, minus the edges among them; their memory-record leaves become the
//! fused kernel's; queue order follows it. The first listed kernel's entity becomes the
//! fused kernel and the list's command, with the fusion's event: a fused list spawns
//! nothing, since spawning a command for the fusion, turning it into the fused kernel
//! and retiring it is a good part of what fusing adds to a round's host cost (figures:
//! `docs/PERFORMANCE.md`). Replacing leaves in place is the same as the DPC++
//! kernel-fusion design's "restore the leaves and add the fused kernel": nothing
//! resolved between the listed kernels depends on them (it would have cancelled the
//! fusion), so the fused kernel stands exactly where they did. Last, fuse lets go of
//! the fusion command of every list that ended (fused or cancelled, in either stage)
//! once all the kernels its queue sent have been ingested.
//!
//! A queue's list entity outlives its fusion: the next `start_fusion` on the queue
//! resets it once it has ended and its command is gone. [`ListRef`]s between lists
//! carry the list's epoch, so a reference to an ended fusion never names the next.

use std::sync::Arc;

use bevy_ecs::entity::Entity;
use bevy_ecs::prelude::Local;
use bevy_ecs::world::World;
use gantry_components::{
    fuse_with, warn_fusion, ByteRange, CancelReason, Command, CommandKind, Devices, Edges, EventShared,
    Execution, FusionOutcome, FusionProps, Fusions, InFusion, Leaf, ListRef, ListStatus, Requirement,
    RequirementList, Requirements, Stats, Status, Successor, Work, WorkLists,
};
use gantry_driver::fusion::{Fused, FusionArg, FusionError, FusionKernel, FusionRequest};
use gantry_driver::AccessMode;
use smallvec::SmallVec;

use crate::queries::Queries;
use crate::resolve::{connect, Preds};
use crate::retire::unblock;

/// The fusion-sync stage system.
pub fn fusion_sync(world: &mut World, mut queries: Local<Queries>) {
    sync_pass(world, &mut queries);
}

/// One pass of the fusion-sync stage.
pub(crate) fn sync_pass(world: &mut World, q: &mut Queries) {
    q.refresh(world);
    let resolved = std::mem::take(&mut world.resource_mut::<WorkLists>().resolved);
    if world.get_resource::<Fusions>().is_none_or(|f| f.active.is_empty() && f.pending.is_empty()) {
        return;
    }
    for e in resolved {
        sync_command(world, q, e);
    }
    // Cancellations asked for by messages. (Cancelling adds the list to `pending`;
    // the fuse stage, next in the flush, lets go of the commands of lists that ended.)
    let asked: SmallVec<[Entity; 4]> = pushed(world.resource::<Fusions>().pending.iter().copied());
    for list in asked {
        let reason = q.list_mut(world, list).and_then(|mut l| l.cancel.take());
        if let Some(reason) = reason {
            cancel(world, q, list, reason);
        }
    }
}

/// The fuse stage system.
pub fn fuse(world: &mut World, mut queries: Local<Queries>) {
    fuse_pass(world, &mut queries);
}

/// One pass of the fuse stage.
pub(crate) fn fuse_pass(world: &mut World, q: &mut Queries) {
    q.refresh(world);
    let Some(mut fusions) = world.get_resource_mut::<Fusions>() else {
        return;
    };
    if fusions.pending.is_empty() {
        return;
    }
    let pending = std::mem::take(&mut fusions.pending);
    for &list in &pending {
        let asked =
            q.list(world, list).and_then(|l| (l.status == ListStatus::Active).then_some(l.complete)?);
        if let Some((_, props)) = asked {
            complete(world, q, list, props);
        }
    }
    release_commands(world, q, pending);
}

/// Despawns the lists a newer fusion of their queue replaced (`Fusions::deleting`)
/// whose command has finished. The retire stage calls it after freeing the pass's
/// commands, so a list goes in the flush its command does, and a runtime that has
/// finished its work holds only each queue's current list.
pub(crate) fn delete_replaced_lists(world: &mut World, q: &mut Queries) {
    let Some(mut fusions) = world.get_resource_mut::<Fusions>() else {
        return;
    };
    if fusions.deleting.is_empty() {
        return;
    }
    let deleting = std::mem::take(&mut fusions.deleting);
    let mut keep = Vec::new();
    for list in deleting {
        let Some(mut l) = q.list_mut(world, list) else { continue };
        if l.status == ListStatus::Active {
            keep.push(list); // superseded before its completion was processed
            continue;
        }
        l.status = ListStatus::Delete;
        let command = l.command;
        if command.is_some_and(|c| q.command(world, c).is_some()) {
            keep.push(list);
        } else {
            world.despawn(list);
        }
    }
    world.resource_mut::<Fusions>().deleting = keep;
}

/// The list whose held kernel `e` is, if that list is still collecting kernels.
fn held_in(world: &World, q: &mut Queries, e: Entity) -> Option<Entity> {
    let list = q.in_fusion(world, e)?;
    holds(world, q, list, e).then_some(list)
}

/// Whether `list` is collecting kernels and holds `e`.
fn holds(world: &World, q: &mut Queries, list: Entity, e: Entity) -> bool {
    q.list(world, list).is_some_and(|l| l.status == ListStatus::Active && l.held.contains(&e))
}

/// Whether a command numbered `seq` depending on `list` cancels it: not if it was
/// submitted after `complete_fusion`.
fn cancels(world: &World, q: &mut Queries, list: Entity, seq: u64) -> bool {
    q.list(world, list).is_some_and(|l| l.complete.is_none_or(|(from, _)| seq < from))
}

/// The active lists `list` depends on, directly or through other active lists.
fn upstream(world: &World, q: &mut Queries, list: Entity) -> SmallVec<[Entity; 4]> {
    let mut found = SmallVec::<[Entity; 4]>::new();
    let mut stack: SmallVec<[ListRef; 4]> = SmallVec::new();
    if let Some(l) = q.list(world, list).filter(|l| l.status == ListStatus::Active) {
        stack.extend(l.deps.iter().copied());
    }
    while let Some(r) = stack.pop() {
        if found.contains(&r.list) {
            continue;
        }
        // (A list that ended may have been reset for a newer fusion of its queue.)
        let current = q.list(world, r.list).filter(|l| l.status == ListStatus::Active && l.epoch == r.epoch);
        if let Some(dep) = current {
            found.push(r.list);
            stack.extend(dep.deps.iter().copied());
        }
    }
    found
}

/// Applies the synchronization rules to one resolved command.
fn sync_command(world: &mut World, q: &mut Queries, e: Entity) {
    let Some(cmd) = q.command(world, e) else {
        return;
    };
    let (kind, seq) = (cmd.kind, cmd.seq);
    let preds = q.edges(world, e).map(|x| x.preds.clone()).unwrap_or_default();
    let own = q.in_fusion(world, e).filter(|_| kind == CommandKind::Kernel);
    let held = own.filter(|&l| holds(world, q, l, e));
    if let (Some(list), None) = (own, held) {
        // A listed kernel that runs unfused: the fusion command completes after it.
        // (Held kernels get that edge when their list is cancelled, maybe already.)
        if q.list(world, list).is_some() {
            let command = fusion_command(world, q, list);
            if !q.edges(world, command).is_some_and(|x| x.preds.contains(&e)) {
                add_edge(world, q, e, command);
            }
        }
    }
    match held {
        Some(list) => {
            for p in preds {
                let Some(other) = held_in(world, q, p).filter(|&o| o != list) else {
                    continue;
                };
                if upstream(world, q, other).contains(&list) {
                    let queue = q.list(world, list).map_or(0, |l| l.queue.id);
                    cancel(world, q, other, CancelReason::Cycle { other_queue: queue });
                } else {
                    let other = ListRef { list: other, epoch: q.list(world, other).map_or(0, |o| o.epoch) };
                    let mut l = q.list_mut(world, list).expect("list");
                    if !l.deps.contains(&other) {
                        l.deps.push(other);
                    }
                }
            }
        }
        None => dependent_cancels(world, q, &preds, seq, e, kind.name()),
    }
}

/// A command `e` that is not a held kernel, depending on `preds`, cancels every list
/// holding one of them (unless it came after that list's completion).
fn dependent_cancels(
    world: &mut World,
    q: &mut Queries,
    preds: &[Entity],
    seq: u64,
    e: Entity,
    kind: &'static str,
) {
    // (The name is looked up only for a cancellation: most commands cancel nothing.)
    // A memory move is the scheduler's, not the user's: the reason names the command
    // it was inserted for.
    let reason = |world: &World, q: &mut Queries| {
        let cmd = q.command(world, e).expect("command");
        if cmd.kind == CommandKind::MemoryMove {
            let user = moved_for(world, q, e);
            let user = q.command(world, user).expect("command");
            return CancelReason::Dependent { command: user.name.clone(), kind: user.kind.name() };
        }
        CancelReason::Dependent { command: cmd.name.clone(), kind }
    };
    for &p in preds {
        let Some(list) = held_in(world, q, p) else { continue };
        if cancels(world, q, list, seq) {
            let reason = reason(world, q);
            cancel(world, q, list, reason);
            continue;
        }
        // Submitted after `list`'s completion, the command will wait for its fused
        // kernel, and so for every list that one depends on: those are dependencies of
        // the command too (otherwise a kernel listed there after it would close a cycle).
        for dep in upstream(world, q, list) {
            if cancels(world, q, dep, seq) {
                let reason = reason(world, q);
                cancel(world, q, dep, reason);
            }
        }
    }
}

/// The command memory move `m` was inserted for: the successor that carries the move's
/// sequence number (resolution gives a move the number of the command that needs it),
/// found through further moves (a move between devices through host memory is two).
/// `m` itself if that command has no edge to it (it failed while being resolved).
fn moved_for(world: &World, q: &mut Queries, m: Entity) -> Entity {
    let mut at = m;
    loop {
        let Some(seq) = q.command(world, at).map(|c| c.seq) else { return at };
        let Some(edges) = q.edges(world, at) else { return at };
        let mut next_move = None;
        for s in &edges.succs {
            match q.command(world, s.entity) {
                Some(c) if c.seq == seq && c.kind == CommandKind::MemoryMove => next_move = Some(s.entity),
                Some(c) if c.seq == seq => return s.entity,
                _ => {}
            }
        }
        match next_move {
            Some(n) => at = n,
            None => return at,
        }
    }
}

/// The fusion command of `list`, spawned if the list has none yet: a marker that
/// completes after the kernels released to it (a cancelled list's), held until every
/// kernel the queue sent has been ingested, whose event is the fusion's.
pub(crate) fn fusion_command(world: &mut World, q: &mut Queries, list: Entity) -> Entity {
    let l = q.list(world, list).expect("fusion list");
    if let Some(command) = l.command {
        return command;
    }
    let (shared, seq) = (l.shared.clone(), l.seq);
    let queue = shared.queue.clone();
    let command = world
        .spawn((
            Command {
                kind: CommandKind::Fusion,
                name: shared.event.name.clone(),
                device: queue.device,
                queue: Some(queue),
                seq,
            },
            Requirements::default(),
            Edges { blockers: 1, ..Default::default() },
            Execution {
                status: Status::Waiting,
                work: Some(Work::Marker),
                handle: None,
                event: shared.event.clone(),
                waits: SmallVec::new(),
                not_before_ns: 0,
            },
            InFusion { list },
        ))
        .id();
    q.refresh(world);
    shared.event.command.set(command);
    q.list_mut(world, list).expect("fusion list").command = Some(command);
    world.resource_mut::<Stats>().live_commands += 1;
    command
}

/// Gives listed kernel `k` an event of its own if it carries its fusion's: a kernel
/// carries the fusion's event (which `submit` returned) while it is listed, and gets
/// one of its own only when it runs unfused (its list was cancelled, or had ended
/// when it arrived) or fails before its list took it. Nobody sees that event: it
/// completes the kernel, after which the fusion's command completes. A fused list
/// makes none (two allocations and six locked operations a kernel).
pub(crate) fn own_event(world: &mut World, q: &mut Queries, k: Entity) {
    let Some(list) = q.in_fusion(world, k) else { return };
    let Some(fusion_event) = q.list(world, list).map(|l| l.shared.event.clone()) else { return };
    let Some(name) = q.command(world, k).filter(|c| c.kind == CommandKind::Kernel).map(|c| c.name.clone())
    else {
        return;
    };
    let Some(mut exec) = q.execution_mut(world, k) else { return };
    if Arc::ptr_eq(&exec.event, &fusion_event) {
        let submitted_ns = fusion_event.timestamps().submitted_ns;
        let own = Arc::new(EventShared::new(name, fusion_event.runtime, submitted_ns));
        own.command.set(k);
        exec.event = own;
    }
}

/// An edge `from -> to` added after resolution (`to` is not yet enqueued).
fn add_edge(world: &mut World, q: &mut Queries, from: Entity, to: Entity) {
    let (Some(a), Some(b)) = (q.command(world, from), q.command(world, to)) else {
        return;
    };
    let same = a.device == b.device && a.kind.runs_on_driver() && b.kind.runs_on_driver();
    let waits = world.resource::<Devices>().0[b.device as usize].info.caps.in_driver_waits;
    let on_submit = same && waits;
    let submitted = q.execution(world, from).is_some_and(|x| x.status == Status::Submitted);
    q.edges_mut(world, from).expect("edges").succs.push(Successor { entity: to, on_submit });
    let mut edges = q.edges_mut(world, to).expect("edges");
    edges.preds.push(from);
    if !(on_submit && submitted) {
        edges.blockers += 1;
    }
    world.resource_mut::<Stats>().edges += 1;
}

/// Cancels `list` (if still active), releases its kernels unfused, and cancels the
/// lists those kernels now depend on as ordinary commands.
pub(crate) fn cancel(world: &mut World, q: &mut Queries, list: Entity, reason: CancelReason) {
    let mut work = vec![(list, reason)];
    while let Some((list, reason)) = work.pop() {
        let Some(mut l) = q.list_mut(world, list) else { continue };
        if l.status != ListStatus::Active {
            continue;
        }
        l.status = ListStatus::Cancelled;
        l.deps.clear();
        world.resource_mut::<Stats>().fusions_cancelled += 1;
        let mut l = q.list_mut(world, list).expect("list");
        let held = std::mem::take(&mut l.held);
        let (shared, queue) = (l.shared.clone(), l.queue.id);
        let command = fusion_command(world, q, list);
        shared.cancel(reason.clone(), || {});
        let mut fusions = world.resource_mut::<Fusions>();
        warn_fusion(&fusions.warnings, format_args!("fusion on queue {queue} cancelled: {reason}"));
        fusions.active.retain(|&a| a != list);
        fusions.pending.push(list);
        // The fusion command completes after every released kernel.
        for &k in &held {
            own_event(world, q, k);
            add_edge(world, q, k, command);
            unblock(world, q, k);
        }
        for &k in &held {
            let Some(cmd) = q.command(world, k) else { continue };
            let (seq, name) = (cmd.seq, cmd.name.clone());
            let preds = q.edges(world, k).map(|x| x.preds.clone()).unwrap_or_default();
            for p in preds {
                if let Some(other) = held_in(world, q, p) {
                    if cancels(world, q, other, seq) {
                        work.push((other, CancelReason::Dependent { command: name.clone(), kind: "kernel" }));
                    }
                }
            }
        }
    }
}

/// Lets go of the fusion commands of ended lists once every kernel their queue sent
/// has been ingested (and so has an edge to the command). `pending` is what the
/// caller took out of [`Fusions::pending`] (walked while the stage adds to it, not
/// copied); the lists added since join it, and all that still wait are put back
/// (releasing a command adds none).
fn release_commands(world: &mut World, q: &mut Queries, mut pending: Vec<Entity>) {
    pending.append(&mut world.resource_mut::<Fusions>().pending);
    let mut kept = 0;
    for i in 0..pending.len() {
        let list = pending[i];
        if pending[..kept].contains(&list) {
            continue;
        }
        let Some(l) = q.list(world, list) else { continue };
        if !l.command_held {
            continue;
        }
        if l.status != ListStatus::Active && l.kernels.len() as u64 >= l.shared.sent() {
            let command = l.command.expect("an ended list has its command");
            q.list_mut(world, list).expect("list").command_held = false;
            unblock(world, q, command);
        } else {
            pending[kept] = list;
            kept += 1;
        }
    }
    pending.truncate(kept);
    world.resource_mut::<Fusions>().pending = pending;
}

/// Performs `complete_fusion` on an active list.
fn complete(world: &mut World, q: &mut Queries, list: Entity, props: FusionProps) {
    // The kernel list is lent out (not copied) and put back after.
    let kernels = std::mem::take(&mut q.list_mut(world, list).expect("list").kernels);
    match fusion_request(world, q, list, &kernels, props) {
        Err(reason) => cancel(world, q, list, reason),
        Ok(request) => match fuse_on_device(world, q, kernels[0], &request) {
            Err(e) => {
                give_back(world, q, &kernels, request);
                cancel(world, q, list, CancelReason::Failed(e));
            }
            Ok(fused) => replace(world, q, list, &kernels, fused),
        },
    }
    q.list_mut(world, list).expect("list").kernels = kernels;
}

/// Fuses `request` with the compilers of the device of `first`, its first kernel.
fn fuse_on_device(
    world: &World,
    q: &mut Queries,
    first: Entity,
    request: &FusionRequest,
) -> Result<Fused, FusionError> {
    let device = q.command(world, first).expect("command").device as usize;
    let name = &world.resource::<Devices>().0[device].info.name;
    let compilers = &world.resource::<Fusions>().compilers;
    // Every device has its entry (empty where nothing fuses its kernels).
    fuse_with(&compilers[device], name, request)
}

/// What the fusion compiler is asked for `kernels`, or why they cannot be fused. The
/// request borrows the kernels' work, taken from their commands (cloning each
/// kernel's handle and dropping it after is two locked operations): a fused list's
/// commands are replaced, and a failed fusion gives the work back ([`give_back`])
/// before its kernels run unfused.
fn fusion_request(
    world: &mut World,
    q: &mut Queries,
    list: Entity,
    kernels: &[Entity],
    props: FusionProps,
) -> Result<FusionRequest, CancelReason> {
    if kernels.is_empty() {
        return Err(CancelReason::Empty);
    }
    let l = q.list(world, list).expect("list");
    if kernels.iter().any(|k| !l.held.contains(k)) {
        return Err(CancelReason::KernelFailed);
    }
    let mut request = FusionRequest { kernels: Vec::with_capacity(kernels.len()), barriers: props.barriers };
    for (i, &k) in kernels.iter().enumerate() {
        let args = pushed(q.requirements(world, k).expect("requirements").0.iter().map(fusion_arg));
        // The listed kernels it depends on (by a buffer, queue order or an event), all
        // listed before it: a driver that runs the list unfused after the fused
        // kernel failed skips it if one of them failed. (The most recent first: on an
        // in-order queue, the previous kernel.)
        let earlier = &kernels[..i];
        let deps = pushed(
            q.edges(world, k)
                .expect("edges")
                .preds
                .iter()
                .filter_map(|p| earlier.iter().rposition(|e| e == p).map(|j| j as u32)),
        );
        let mut exec = q.execution_mut(world, k).expect("execution");
        match exec.work.take() {
            Some(Work::Kernel { kernel, geometry, scalars }) => {
                request.kernels.push(FusionKernel { kernel, geometry, args, deps, scalars })
            }
            other => {
                exec.work = other;
                give_back(world, q, &kernels[..i], request);
                return Err(CancelReason::KernelFailed);
            }
        }
    }
    Ok(request)
}

/// Puts the work [`fusion_request`] took back into the listed kernels' commands.
fn give_back(world: &mut World, q: &mut Queries, kernels: &[Entity], request: FusionRequest) {
    for (&k, FusionKernel { kernel, geometry, scalars, .. }) in kernels.iter().zip(request.kernels) {
        q.execution_mut(world, k).expect("listed kernel").work =
            Some(Work::Kernel { kernel, geometry, scalars });
    }
}

/// `items` collected by pushes. `SmallVec`'s `extend` (so `collect`) reserves first,
/// which for the few items of a fusion's lists costs more than pushing them; a fused
/// round collects a dozen such lists.
fn pushed<A: smallvec::Array>(items: impl Iterator<Item = A::Item>) -> SmallVec<A> {
    let mut out = SmallVec::new();
    for item in items {
        out.push(item);
    }
    out
}

pub(crate) fn fusion_arg(r: &Requirement) -> FusionArg {
    FusionArg::new(r.buffer.id, r.range.start..r.range.end, r.elem_size as usize).promoted(r.promotion)
}

/// The fused kernel's requirement standing for the slots `uses` on one buffer.
fn union_requirement(reqs: &[&Requirement], start: usize, end: usize, internal: bool) -> Requirement {
    let first = reqs[0];
    let writes = reqs.iter().any(|r| r.mode.writes());
    let reads = reqs.iter().any(|r| r.mode.reads());
    let mode = if internal || !writes {
        AccessMode::Read
    } else if reqs
        .iter()
        .all(|r| r.mode == AccessMode::DiscardWrite && (r.range.start, r.range.end) == (start, end))
    {
        AccessMode::DiscardWrite
    } else if reads {
        AccessMode::ReadWrite
    } else {
        AccessMode::Write
    };
    let valid_before = reqs.iter().filter_map(|r| r.valid_before.as_ref()).min_by_key(|v| v.0).cloned();
    Requirement {
        buffer: first.buffer.clone(),
        mode,
        range: ByteRange { start, end },
        space: first.space,
        alloc: first.alloc,
        valid_before,
        elem_size: first.elem_size,
        promotion: Default::default(),
        internal,
    }
}

/// The fused kernel's requirements: one per argument (the union of the slots it
/// stands for), then one ordering-only requirement per internalized buffer.
/// `reqs[k]` are kernel `k`'s requirements.
pub(crate) fn fused_requirements(fused: &Fused, reqs: &[&[Requirement]]) -> RequirementList {
    let pick = |uses: &[(u32, u32)]| -> SmallVec<[&Requirement; 4]> {
        pushed(uses.iter().map(|&(k, s)| &reqs[k as usize][s as usize]))
    };
    let mut out: RequirementList =
        pushed(fused.args.iter().map(|a| union_requirement(&pick(&a.uses), a.start, a.end, false)));
    for i in &fused.internal {
        let uses = pick(&i.uses);
        let start = uses.iter().map(|r| r.range.start).min().expect("a use");
        let end = uses.iter().map(|r| r.range.end).max().expect("a use");
        out.push(union_requirement(&uses, start, end, true));
    }
    out
}

/// Replaces the listed kernels by the fused kernel. The first listed kernel's entity
/// becomes the fused kernel and the list's fusion command, and the fusion's event,
/// which `submit` returned while fusing and the kernel carried while listed, is the
/// fused kernel's (one entity and one event, where a command spawned for the fusion
/// would be spawned and retired as well; a fusion spawns one only if it is
/// cancelled).
fn replace(world: &mut World, q: &mut Queries, list: Entity, kernels: &[Entity], fused: Fused) {
    let listed = |e: Entity| kernels.contains(&e);
    let reqs = {
        let all: SmallVec<[&[Requirement]; 8]> =
            pushed(kernels.iter().map(|&k| &q.requirements(world, k).expect("requirements").0[..]));
        fused_requirements(&fused, &all)
    };
    // A placement (a whole-buffer discard-write into a space with no valid copy) is
    // undone when its command fails; a fused kernel's failure keeps what its kernels
    // still wrote when run unfused, so retire asks them (only then: most fusions
    // place nothing).
    let unfused =
        if reqs.iter().any(|r| r.valid_before.is_some()) { fused.kept_on_failure.clone() } else { None };

    // The union of the kernels' edges, minus those among them.
    let mut preds = Preds::new();
    let mut succs: SmallVec<[Entity; 4]> = SmallVec::new();
    for &k in kernels {
        let edges = q.edges(world, k).expect("edges");
        for &p in edges.preds.iter().filter(|&&p| !listed(p)) {
            preds.push(p);
        }
        for s in edges.succs.iter().filter(|s| !listed(s.entity)) {
            if !succs.contains(&s.entity) {
                succs.push(s.entity);
            }
        }
    }
    let e = kernels[0];
    let (device, queue) = {
        let first = q.command(world, e).expect("command");
        (first.device, first.queue.as_ref().and_then(|q| q.entity.get()))
    };
    let (fusion_event, command_held) = {
        let l = q.list(world, list).expect("list");
        debug_assert!(l.command.is_none(), "a list collecting kernels has no command");
        (Arc::as_ptr(&l.shared.event), l.command_held)
    };
    let (not_before_ns, waits) = {
        let d = &world.resource::<Devices>().0[device as usize];
        (d.virtual_now_ns(), d.info.caps.in_driver_waits)
    };
    {
        let mut command = world.get_mut::<Command>(e).expect("first listed kernel");
        command.name = fused.kernel.name.clone();
    }
    q.requirements_mut(world, e).expect("requirements").0 = reqs;
    {
        // The kernel already carries the fusion's event (see `own_event`), which is
        // the fused kernel's from now on.
        let mut exec = q.execution_mut(world, e).expect("execution");
        debug_assert!(Arc::as_ptr(&exec.event) == fusion_event, "a listed kernel carries its fusion's event");
        exec.work =
            Some(Work::Kernel { kernel: fused.kernel, geometry: fused.geometry, scalars: fused.scalars });
        exec.not_before_ns = not_before_ns;
        exec.event.command.set(e);
    }
    // Its own edges go with the other listed kernels' (below, and by `connect`).
    *q.edges_mut(world, e).expect("edges") = Edges::default();

    // Predecessors forget the listed kernels; `connect` gives them the fused one.
    for &p in &preds {
        if let Some(mut edges) = q.edges_mut(world, p) {
            edges.succs.retain(|s| !listed(s.entity));
        }
    }
    // Successors wait for the fused kernel instead (every listed kernel was held, so
    // each of their edges was blocking).
    for &s in &succs {
        let Some(mut edges) = q.edges_mut(world, s) else { continue };
        let before = edges.preds.len();
        edges.preds.retain(|p| !listed(*p));
        let removed = (before - edges.preds.len()) as u32;
        let new = !edges.preds.contains(&e);
        if new {
            edges.preds.push(e);
        }
        edges.blockers = edges.blockers - removed + new as u32;
        if new {
            let on_submit =
                waits && q.command(world, s).is_some_and(|c| c.device == device && c.kind.runs_on_driver());
            q.edges_mut(world, e).expect("edges").succs.push(Successor { entity: s, on_submit });
        }
    }

    // The listed kernels' leaves become the fused kernel's. (By record entity, not
    // buffer handle: each handle cloned and dropped is two locked operations.)
    let placed: SmallVec<[(Option<Entity>, ByteRange); 4]> = pushed(
        q.requirements(world, e).expect("requirements").0.iter().map(|r| (r.buffer.record.get(), r.range)),
    );
    for (record, range) in placed {
        let Some(mut record) = record.and_then(|r| q.record_mut(world, r)) else { continue };
        if record.leaves.writes.remove_commands(listed).is_some() {
            record.leaves.writes.push(Leaf { cmd: e, range });
        }
        if record.leaves.reads.remove_commands(listed).is_some() {
            record.leaves.reads.push(Leaf { cmd: e, range });
        }
    }
    // Queue order follows the fused kernel.
    if let Some(qe) = queue {
        if let Some(mut state) = q.queue_mut(world, qe) {
            if state.order.last.is_some_and(listed) {
                state.order.last = Some(e);
            }
            // The listed kernels are all in `since_barrier` (a barrier after one of
            // them would have cancelled the fusion), the first as the fused kernel, the
            // others despawned like retired commands, which the next barrier and the
            // periodic pruning skip.
        }
    }
    // Still held (as the fusion command was) until every kernel the queue sent to
    // the list has been ingested.
    connect(world, q, e, preds, waits, command_held);

    for &k in &kernels[1..] {
        world.despawn(k);
    }
    {
        let mut stats = world.resource_mut::<Stats>();
        stats.live_commands -= kernels.len() as u64 - 1;
        stats.fusions_fused += 1;
    }
    let mut l = q.list_mut(world, list).expect("list");
    l.command = Some(e);
    l.unfused = unfused;
    l.status = ListStatus::Completed;
    l.held.clear();
    l.deps.clear();
    let queue_id = l.queue.id;
    l.shared.fused(FusionOutcome::Fused {
        kernels: kernels.len(),
        cached: fused.cached,
        warnings: fused.warnings.clone(),
    });
    let mut fusions = world.resource_mut::<Fusions>();
    for w in &fused.warnings {
        warn_fusion(&fusions.warnings, format_args!("fusion on queue {queue_id}: {w}"));
    }
    fusions.active.retain(|&a| a != list);
    fusions.pending.push(list);
    // The fused kernel may itself depend on kernels still held by another list.
    let preds = q.edges(world, e).map(|x| x.preds.clone()).unwrap_or_default();
    // (It comes after every completion already asked for: those lists fuse too.)
    dependent_cancels(world, q, &preds, u64::MAX, e, "fused kernel");
}
