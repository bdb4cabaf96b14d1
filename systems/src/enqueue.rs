//! The **enqueue** stage: hands every ready command to its driver, with a wait-list of
//! the predecessors that driver is still running (markers and barriers included);
//! host accesses start running (their user is woken).

use std::sync::Arc;

use bevy_ecs::entity::Entity;
use bevy_ecs::prelude::Local;
use bevy_ecs::world::World;

use crate::queries::Queries;
use gantry_components::{
    CommandKind, Devices, Finished, Inbox, Requirement, Returning, SchedulerConfig, Stats, Status, Work,
    WorkLists,
};
use gantry_driver::{
    Accepted, CommandBufferLaunch, DeviceOp, Driver, HostTask, KernelLaunch, MemArg, MemRef, MemSlice,
    MemSpace, OpHandle, OpId, SimHint, Submission,
};
use smallvec::SmallVec;

/// What one run of the stage reads once instead of once per command, and what it
/// writes back once at the end.
struct Pass {
    /// Each device's driver, and whether it runs on a virtual clock (its submissions
    /// then carry a [`SimHint`]).
    drivers: SmallVec<[(Arc<dyn Driver>, bool); 4]>,
    preserve_on_failure: bool,
    /// Commands that finished inside `submit` (or were refused): the finished list,
    /// taken to be appended to and given back (its allocation kept across flushes).
    finished: Vec<Finished>,
    /// Commands now running on a driver.
    in_driver: u64,
    /// Where kernels go whose last reference a driver left to this stage (it ran them
    /// inside `submit`): freed by user threads, where they were allocated (threaded
    /// mode; see `HandBack`).
    returning: Returning,
}

/// The enqueue stage system.
pub fn enqueue(world: &mut World, mut queries: Local<Queries>) {
    pass(world, &mut queries);
}

/// One pass of the enqueue stage.
pub(crate) fn pass(world: &mut World, q: &mut Queries) {
    // Most flushes of a threaded runtime (one per message) have nothing ready.
    if world.resource::<WorkLists>().ready.is_empty() {
        return;
    }
    q.refresh(world);
    let mut pass = Pass {
        drivers: world
            .resource::<Devices>()
            .0
            .iter()
            .map(|d| (d.driver.clone(), d.info.caps.virtual_time))
            .collect(),
        preserve_on_failure: world.resource::<SchedulerConfig>().preserve_on_failure,
        finished: std::mem::take(&mut world.resource_mut::<WorkLists>().finished),
        in_driver: 0,
        returning: Returning::to(world.resource::<Inbox>().hand_back.clone()),
    };
    // The ready list and this buffer swap places each round, so both keep their
    // allocations across flushes.
    let mut ready = Vec::new();
    loop {
        std::mem::swap(&mut ready, &mut world.resource_mut::<WorkLists>().ready);
        if ready.is_empty() {
            break;
        }
        for e in ready.drain(..) {
            enqueue_command(world, q, &mut pass, e);
        }
    }
    if pass.in_driver > 0 {
        world.resource_mut::<Stats>().in_driver += pass.in_driver;
    }
    WorkLists::give_back(&mut world.resource_mut::<WorkLists>().finished, pass.finished);
    pass.returning.give();
}

/// The memory a placed requirement names.
fn slice(r: &Requirement) -> MemSlice {
    let mem = match r.space {
        MemSpace::Host => MemRef::Host(r.buffer.storage.clone()),
        MemSpace::Device(_) => MemRef::Device(r.alloc.expect("device requirement without allocation")),
    };
    MemSlice { mem, offset: r.range.start, len: r.range.len() }
}

fn args(reqs: &[Requirement]) -> SmallVec<[MemArg; 4]> {
    reqs.iter().filter(|r| !r.internal).map(|r| MemArg { mem: slice(r), mode: r.mode }).collect()
}

/// The device operation for `work`, and a host task's declared duration; `name` is
/// needed (and given) for host tasks only.
fn build_op(work: Work, reqs: &[Requirement], name: Option<Arc<str>>) -> (DeviceOp, Option<f64>) {
    let op = match work {
        Work::Kernel { kernel, geometry, scalars } => {
            DeviceOp::Kernel(KernelLaunch { kernel, geometry, args: args(reqs), scalars })
        }
        Work::HostTask { run, tag, cost_ns } => {
            let name = name.expect("host tasks are built with their name");
            return (
                DeviceOp::HostTask(HostTask { name, tag, run: run.into_inner(), args: args(reqs) }),
                cost_ns,
            );
        }
        Work::Copy | Work::Move { .. } => DeviceOp::Copy { src: slice(&reqs[0]), dst: slice(&reqs[1]) },
        Work::CopyFromHost(data) => DeviceOp::Copy { src: MemSlice::host(data), dst: slice(&reqs[0]) },
        Work::CopyToHost(out) => DeviceOp::Copy { src: slice(&reqs[0]), dst: MemSlice::host(out) },
        Work::Fill(pattern) => DeviceOp::Fill { dst: slice(&reqs[0]), pattern },
        Work::CommandBuffer { buffer, entries } => {
            let args = entries
                .iter()
                .map(|&(r, mode)| {
                    let r = &reqs[r as usize];
                    MemArg { mem: MemSlice { offset: 0, len: r.buffer.bytes, ..slice(r) }, mode }
                })
                .collect();
            DeviceOp::CommandBuffer(CommandBufferLaunch { buffer, args })
        }
        Work::Marker | Work::HostAccess => DeviceOp::Marker,
    };
    (op, None)
}

fn enqueue_command(world: &mut World, q: &mut Queries, pass: &mut Pass, e: Entity) {
    let Some(mut exec) = q.execution_mut(world, e) else {
        return;
    };
    if exec.status != Status::Ready {
        return;
    }
    exec.status = Status::Submitted;
    let work = exec.work.take().expect("work enqueued twice");
    let event = exec.event.clone();
    let not_before_ns = exec.not_before_ns;
    let cmd = q.command(world, e).expect("command");
    let (kind, device) = (cmd.kind, cmd.device);
    let name = (kind == CommandKind::HostTask).then(|| cmd.name.clone());
    if kind == CommandKind::HostAccess {
        event.mark_running(world.resource::<SchedulerConfig>().clock.stamp_ns());
        return;
    }

    // Wait on predecessors this driver is still running.
    let preds = q.edges(world, e).expect("edges").preds.clone();
    let waits: SmallVec<[OpHandle; 4]> = preds
        .iter()
        .filter_map(|&p| {
            let same_device = q.command(world, p)?.device == device;
            let exec = q.execution(world, p)?;
            (same_device && exec.status == Status::Submitted).then(|| exec.handle.clone()).flatten()
        })
        .collect();
    // A driver that runs the kernel inside `submit` (it waits for nothing) drops its
    // reference there; the stage's copy is then the last one, and goes back to user
    // threads.
    let kept = match &work {
        Work::Kernel { kernel, .. } if pass.returning.collects() && waits.is_empty() => Some(kernel.clone()),
        _ => None,
    };
    let (op, host_task_ns) = build_op(work, &q.requirements(world, e).expect("requirements").0, name);
    let preserve_on_failure = pass.preserve_on_failure;
    let (driver, virtual_time) = &pass.drivers[device as usize];
    let hint = virtual_time.then_some(SimHint { not_before_ns, host_task_ns });
    let submission = Submission { id: OpId(e.to_bits()), op, waits: &waits, preserve_on_failure, hint };
    let accepted = driver.submit(submission);
    if let Some(kernel) = kept {
        pass.returning.kernel(kernel);
    }
    match accepted {
        Ok(Accepted::Pending(handle)) => {
            q.execution_mut(world, e).expect("execution").handle = Some(handle);
            pass.in_driver += 1;
            event.mark_submitted();
            unblock_on_submit(world, q, e);
        }
        Ok(Accepted::Done(c)) => {
            // Only a success releases same-driver successors now; after a failure they
            // must not run, and retire fails them with the dependency's error.
            let ok = c.result.is_ok();
            let done = Finished {
                cmd: e,
                result: c.result,
                started_ns: c.started_ns,
                ended_ns: c.ended_ns,
                lane: c.lane,
            };
            pass.finished.push(done);
            event.mark_submitted();
            if ok {
                unblock_on_submit(world, q, e);
            }
        }
        Err(err) => {
            let now = world.resource::<SchedulerConfig>().clock.stamp_ns();
            let failed = Finished { cmd: e, result: Err(err), started_ns: now, ended_ns: now, lane: 0 };
            pass.finished.push(failed);
        }
    }
}

/// Successors on the same driver stop being blocked once this command is submitted.
fn unblock_on_submit(world: &mut World, q: &mut Queries, e: Entity) {
    let succs = &q.edges(world, e).expect("edges").succs;
    let released: SmallVec<[Entity; 4]> = succs.iter().filter(|s| s.on_submit).map(|s| s.entity).collect();
    for s in released {
        crate::retire::unblock(world, q, s);
    }
}

#[cfg(test)]
mod tests {
    use gantry_driver::AccessMode::ReadWrite;

    use crate::testing::{entity, Harness};

    /// With in-driver waits, a dependent chain is handed over in one flush, each link
    /// naming its predecessor in the wait-list.
    #[test]
    fn same_driver_chain_is_submitted_at_once_with_waits() {
        let mut h = Harness::new(true);
        let b = h.buffer(8);
        let evs: Vec<_> = (0..4).map(|_| h.submit(&[(&b, ReadWrite, 0..8)])).collect();
        h.flush();
        let order: Vec<_> = evs.iter().map(|e| entity(e)).collect();
        assert_eq!(h.host.submitted_entities(), order);
        for w in order.windows(2) {
            assert_eq!(h.host.waits_of(w[1]), vec![w[0]]);
        }
    }

    /// Without them, each link waits for its predecessor's completion.
    #[test]
    fn without_driver_waits_dependents_wait_for_completion() {
        let mut h = Harness::new(false);
        let b = h.buffer(8);
        let first = h.submit(&[(&b, ReadWrite, 0..8)]);
        let second = h.submit(&[(&b, ReadWrite, 0..8)]);
        h.flush();
        let (first_e, second_e) = (entity(&first), entity(&second));
        assert_eq!(h.host.submitted_entities(), vec![first_e]);
        h.host.complete(first_e, Ok(()));
        h.flush(); // retire unblocks
        h.flush(); // enqueue submits
        assert_eq!(h.host.submitted_entities(), vec![first_e, second_e]);
        assert!(h.host.waits_of(second_e).is_empty());
    }
}
