//! Isolation: a failure reaches exactly the commands that depend on it, whatever the
//! scheduler's timing; a dropped queue leaves nothing behind; a fusion cancelled by a
//! dependent names the user's command.

mod common;

use gantry::{Error, EventStatus, ExecError, Mode, ReadWrite, Runtime};

fn quiet_panics() {
    common::quiet_panics(|msg| msg == "link exploded");
}

/// What the submitting thread does between a chain's failing link and the rest.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Between {
    /// Nothing: one burst.
    Nothing,
    /// It polls until the failure has retired (threaded mode), without waiting.
    Retired,
    /// It waits for the failing link: later links are independent of the failure.
    Waited,
}

/// A chain of `n` kernels on an in-order queue; kernel `i` adds 1 to its own slice
/// `i * width .. (i + 1) * width` of `counts` (so only queue order links them), and
/// kernel `bad` panics after writing. Every kernel before `bad` ran once; `bad` failed
/// and its writes were undone; unless the submitter waited for it (`Between::Waited`),
/// every successor failed with a dependency error and none of their writes happened.
fn in_order_chain(rt: &Runtime, n: usize, bad: usize, width: usize, between: Between, round: usize) {
    let q = rt.in_order_queue();
    let counts = rt.buffer_zeroed::<u32>(n * width);
    let mut events: Vec<gantry::Event> = Vec::with_capacity(n);
    for i in 0..n {
        if i == bad + 1 {
            match between {
                Between::Nothing => {}
                Between::Retired => {
                    while !events[bad].status().is_final() {
                        std::thread::yield_now();
                    }
                }
                Between::Waited => assert!(events[bad].wait().is_err()),
            }
        }
        let ev = q
            .submit(|cg| {
                cg.name(format!("link {i}"));
                let c = cg.access::<u32, ReadWrite>(&counts, i * width..(i + 1) * width);
                cg.parallel_for(width, move |it| {
                    let j = it.global_linear_id();
                    c.set(it, j, c.get(it, j) + 1);
                    if i == bad && j == width - 1 {
                        panic!("link exploded");
                    }
                });
            })
            .unwrap();
        events.push(ev);
    }
    let case = format!("round {round}, width {width}, {between:?}");
    let successors_run = between == Between::Waited;
    for (i, ev) in events.iter().enumerate() {
        let result = ev.wait();
        if i < bad || i > bad && successors_run {
            assert!(result.is_ok(), "{case}: link {i}: {result:?}");
        } else if i == bad {
            assert!(
                matches!(result, Err(Error::Exec(ExecError::KernelPanicked { .. }))),
                "{case}: {result:?}"
            );
        } else {
            assert_eq!(ev.status(), EventStatus::Failed, "{case}: link {i} ran");
            match result {
                Err(Error::Exec(e @ ExecError::DependencyFailed { .. })) => {
                    assert!(
                        matches!(e.root_cause(), ExecError::KernelPanicked { .. }),
                        "{case}: link {i}: {e:?}"
                    )
                }
                r => panic!("{case}: link {i}: {r:?}"),
            }
        }
    }
    let v = counts.to_vec().unwrap();
    for (i, slice) in v.chunks(width).enumerate() {
        let expected = u32::from(i < bad || i > bad && successors_run);
        assert!(slice.iter().all(|&x| x == expected), "{case}: link {i} wrote {slice:?}");
    }
    rt.wait_idle().unwrap();
}

/// Every in-order successor of a failed command fails, as in manual mode, where a
/// burst is resolved before anything runs: also when a threaded scheduler retires the
/// failure before some successors arrive, or before any of them is submitted. Waiting
/// for the failure ends it, as a wait in manual mode retires it: links submitted
/// after the wait run.
#[test]
fn in_order_successors_of_a_failure_fail_whatever_the_timing() {
    quiet_panics();
    for between in [Between::Nothing, Between::Waited] {
        let manual = Runtime::builder().mode(Mode::Manual).worker_threads(0).build();
        in_order_chain(&manual, 1000, 500, 1, between, 0);
    }
    for round in 0..20 {
        for between in [Between::Nothing, Between::Retired, Between::Waited] {
            // Small links run inline as the scheduler enqueues them; wide ones on the
            // pool, each waiting on its predecessor inside the driver.
            for (rt, width) in [(Runtime::new(), 1), (Runtime::builder().worker_threads(2).build(), 2048)] {
                in_order_chain(&rt, 1000, 500, width, between, round);
            }
        }
    }
}

/// Queues created, used and dropped leave nothing in the scheduler: the world holds
/// as many entities after 10,000 of them as after the first few.
#[test]
fn dropped_queues_leave_no_entities_behind() {
    for mode in [Mode::Manual, Mode::Threaded] {
        let rt = Runtime::builder().mode(mode).worker_threads(0).build();
        let buf = rt.buffer_zeroed::<u32>(4);
        let mut settled = 0;
        for i in 0..10_000u32 {
            let q = if i % 2 == 0 { rt.queue() } else { rt.in_order_queue() };
            q.submit(|cg| {
                let b = cg.read_write(&buf);
                cg.single_task(move |it| b.set(it, 0, b.get(it, 0) + 1));
            })
            .unwrap();
            drop(q);
            if i == 3 {
                rt.wait_idle().unwrap();
                settled = rt.with_world(|w| w.entity_count());
            }
        }
        rt.wait_idle().unwrap();
        rt.flush();
        let entities = rt.with_world(|w| w.entity_count());
        assert!(entities <= settled, "{mode:?}: {settled} entities after 4 queues, {entities} after 10,000");
        assert_eq!(buf.to_vec().unwrap(), vec![10_000, 0, 0, 0], "{mode:?}");
    }
}

/// A queue dropped while its last command waits behind a host write guard: the
/// command still runs, in queue order, once the guard goes, and then the queue's
/// entity goes too.
#[test]
fn a_queue_dropped_with_pending_work_runs_it_in_order_then_goes() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    for mode in [Mode::Manual, Mode::Threaded] {
        let rt = Runtime::builder().mode(mode).worker_threads(0).build();
        let (held, other) = (rt.buffer(&[1u32; 4]), rt.buffer_zeroed::<u32>(4));
        // (Their records, and the state of the queue host accesses use, stay.)
        held.to_vec().unwrap();
        other.to_vec().unwrap();
        rt.wait_idle().unwrap();
        let before = rt.with_world(|w| w.entity_count());
        let mut guard = held.write().unwrap();
        let q = rt.in_order_queue();
        // Each kernel takes the next ticket: the order they ran in.
        let tickets = Arc::new(AtomicU32::new(0));
        let first = {
            let t = tickets.clone();
            q.submit(|cg| {
                let b = cg.read_write(&held);
                cg.single_task(move |it| b.set(it, 0, b.get(it, 0) * 10 + t.fetch_add(1, Ordering::SeqCst)));
            })
            .unwrap()
        };
        // The first kernel is resolved (and blocked) before the second arrives.
        rt.flush();
        let second = {
            let t = tickets.clone();
            q.submit(|cg| {
                let o = cg.write(&other);
                cg.single_task(move |it| o.set(it, 0, 100 + t.fetch_add(1, Ordering::SeqCst)));
            })
            .unwrap()
        };
        drop(q);
        rt.flush();
        std::thread::sleep(std::time::Duration::from_millis(20));
        rt.flush();
        assert_eq!(first.status(), EventStatus::Pending, "{mode:?}: the guard holds the first kernel");
        assert_eq!(second.status(), EventStatus::Pending, "{mode:?}: queue order holds the second");
        guard[0] = 5;
        drop(guard);
        second.wait().unwrap();
        first.wait().unwrap();
        assert_eq!(held.to_vec().unwrap(), vec![50, 1, 1, 1], "{mode:?}: first ran first");
        assert_eq!(other.to_vec().unwrap(), vec![101, 0, 0, 0], "{mode:?}: second ran second");
        rt.wait_idle().unwrap();
        rt.flush();
        let after = rt.with_world(|w| w.entity_count());
        assert_eq!(after, before, "{mode:?}: the dropped queue's entity is gone");
    }
}

/// On a simulated device, a command reading a buffer a listed kernel writes elsewhere
/// needs a memory move, which depends on the kernel: the fusion is cancelled, and the
/// reason names the user's command, not the move. Cases: a host task on the fusing
/// queue, one on a CPU queue (a move back to host memory), and a kernel on a second
/// simulated device (two moves, through host memory).
#[test]
fn a_fusion_cancelled_through_a_memory_move_names_the_users_command() {
    use gantry::{CancelReason, FusionOutcome, QueueOptions};
    for case in ["host task, fusing queue", "host task, CPU queue", "kernel, other device"] {
        let rt = Runtime::builder()
            .mode(Mode::Manual)
            .sim(gantry::SimConfig::default())
            .sim(gantry::SimConfig::default())
            .fusion_warnings(0)
            .build();
        let q = rt.queue_with(QueueOptions { device: 1, in_order: true }).unwrap();
        let (b, out) = (rt.buffer(&[1u32; 16]), rt.buffer_zeroed::<u32>(16));
        q.start_fusion().unwrap();
        q.submit(|cg| {
            let b = cg.elements_mut(&b);
            cg.parallel_for(16, move |it| *b.elem(it) += 2);
        })
        .unwrap();
        let host_task = |reader: &gantry::Queue| {
            reader.submit(|cg| {
                cg.name("reader");
                let (x, mut o) = (cg.host_read(&b), cg.host_discard_write(&out));
                cg.host_task(move |ctx| o.as_mut_slice(ctx).copy_from_slice(x.as_slice(ctx)));
            })
        };
        let expected_kind = match case {
            "host task, fusing queue" => host_task(&q).map(|_| "host_task"),
            "host task, CPU queue" => host_task(&rt.queue()).map(|_| "host_task"),
            _ => rt
                .queue_with(QueueOptions { device: 2, in_order: false })
                .unwrap()
                .submit(|cg| {
                    cg.name("reader");
                    let (x, o) = (cg.read(&b), cg.elements_out(&out));
                    cg.parallel_for(16, move |it| *o.elem(it) = x.get(it, it.global_linear_id()));
                })
                .map(|_| "kernel"),
        }
        .unwrap();
        rt.wait_idle().unwrap();
        match q.fusion_outcome() {
            Some(FusionOutcome::Cancelled(CancelReason::Dependent { command, kind })) => {
                assert_eq!((&*command, kind), ("reader", expected_kind), "{case}")
            }
            o => panic!("{case}: {o:?}"),
        }
        assert_eq!(out.to_vec().unwrap(), vec![3; 16], "{case}");
        assert_eq!(b.to_vec().unwrap(), vec![3; 16], "{case}");
    }
}
