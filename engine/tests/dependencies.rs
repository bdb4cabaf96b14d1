//! Dependency semantics: buffer conflicts, sub-ranges, events, queue order, barriers.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gantry::{Mode, Read, ReadWrite, Runtime, Write};

fn log_task(cg: &mut gantry::Handler, log: &Arc<Mutex<Vec<u32>>>, v: u32) {
    let log = log.clone();
    cg.host_task(move |_| log.lock().unwrap().push(v));
}

/// Read-after-write, write-after-read and write-after-write on one buffer, submitted
/// to an out-of-order queue, give the results of serial execution.
#[test]
fn raw_war_waw_follow_submission_order() {
    for threads in [0, 1, 4] {
        let rt = Runtime::builder().worker_threads(threads).build();
        let q = rt.queue();
        let n = 10_000;
        let a = rt.buffer(&vec![1u32; n]);
        let b = rt.buffer_zeroed::<u32>(n);
        for round in 0..20u32 {
            // b = a + round (RAW on a, WAW on b)
            q.submit(|cg| {
                let a = cg.read(&a);
                let b = cg.discard_write(&b);
                cg.parallel_for(n, move |it| {
                    let i = it.global_linear_id();
                    b.set(it, i, a.get(it, i) + round)
                });
            })
            .unwrap();
            // a = b * 2 (RAW on b, WAR/WAW on a)
            q.submit(|cg| {
                let b = cg.read(&b);
                let a = cg.write(&a);
                cg.parallel_for(n, move |it| {
                    let i = it.global_linear_id();
                    a.set(it, i, b.get(it, i).wrapping_mul(2))
                });
            })
            .unwrap();
        }
        let mut expect = 1u32;
        for round in 0..20u32 {
            expect = (expect + round).wrapping_mul(2);
        }
        assert!(a.to_vec().unwrap().iter().all(|&x| x == expect), "threads={threads}");
    }
}

/// Two host tasks writing disjoint halves of one buffer are not ordered: each waits
/// for the other to start, which would time out if an edge serialized them.
#[test]
fn disjoint_sub_ranges_run_concurrently() {
    let rt = Runtime::builder().host_threads(2).build();
    let q = rt.queue();
    let buf = rt.buffer_zeroed::<u32>(8);
    let (tx1, rx1) = mpsc::channel::<()>();
    let (tx2, rx2) = mpsc::channel::<()>();
    let e1 = q
        .submit(|cg| {
            let mut lo = cg.host_access::<u32, Write>(&buf, 0..4);
            cg.host_task(move |ctx| {
                tx1.send(()).unwrap();
                rx2.recv_timeout(Duration::from_secs(10)).expect("other half ran concurrently");
                lo.as_mut_slice(ctx).fill(1);
            });
        })
        .unwrap();
    let e2 = q
        .submit(|cg| {
            let mut hi = cg.host_access::<u32, Write>(&buf, 4..8);
            cg.host_task(move |ctx| {
                tx2.send(()).unwrap();
                rx1.recv_timeout(Duration::from_secs(10)).expect("other half ran concurrently");
                hi.as_mut_slice(ctx).fill(2);
            });
        })
        .unwrap();
    e1.wait().unwrap();
    e2.wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![1, 1, 1, 1, 2, 2, 2, 2]);
}

/// Overlapping sub-ranges are ordered: the second write wins on the overlap.
#[test]
fn overlapping_sub_ranges_are_ordered() {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(2).build();
    let q = rt.queue();
    let buf = rt.buffer_zeroed::<u32>(16);
    q.submit(|cg| cg.fill_range(&buf, 0..10, 1)).unwrap();
    q.submit(|cg| cg.fill_range(&buf, 6..16, 2)).unwrap();
    q.submit(|cg| {
        let r = cg.access::<u32, ReadWrite>(&buf, 4..8);
        cg.parallel_for(4, move |it| r.set(it, it.global_linear_id(), r.get(it, it.global_linear_id()) + 10));
    })
    .unwrap();
    let expect: Vec<u32> = (0..16)
        .map(|i| match i {
            0..=3 => 1,
            4 | 5 => 11,
            6 | 7 => 12,
            8 | 9 => 2,
            _ => 2,
        })
        .collect();
    assert_eq!(buf.to_vec().unwrap(), expect);
}

/// An explicit event dependency orders commands that share no buffer, across queues.
#[test]
fn explicit_events_order_across_queues() {
    let rt = Runtime::builder().host_threads(2).build();
    let (q1, q2) = (rt.queue(), rt.queue());
    let log = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..50 {
        log.lock().unwrap().clear();
        let (tx, rx) = mpsc::channel::<()>();
        let first = q1
            .submit(|cg| {
                let log = log.clone();
                cg.host_task(move |_| {
                    // Give the second task every chance to overtake if unordered.
                    let _ = rx.recv_timeout(Duration::from_millis(2));
                    log.lock().unwrap().push(1);
                });
            })
            .unwrap();
        let second = q2
            .submit(|cg| {
                cg.depends_on(&first);
                log_task(cg, &log, 2);
            })
            .unwrap();
        second.wait().unwrap();
        drop(tx);
        assert_eq!(*log.lock().unwrap(), vec![1, 2]);
    }
}

/// An in-order queue runs commands one after another even without shared buffers.
#[test]
fn in_order_queue_serializes() {
    let rt = Runtime::builder().host_threads(4).build();
    let q = rt.in_order_queue();
    let log = Arc::new(Mutex::new(Vec::new()));
    for v in 0..200 {
        q.submit(|cg| log_task(cg, &log, v)).unwrap();
    }
    q.wait().unwrap();
    assert_eq!(*log.lock().unwrap(), (0..200).collect::<Vec<_>>());
}

/// A barrier completes only after everything before it on its queue.
#[test]
fn barrier_waits_for_earlier_work() {
    let rt = Runtime::builder().host_threads(4).build();
    let q = rt.queue();
    let log = Arc::new(Mutex::new(Vec::new()));
    for v in 0..20 {
        q.submit(|cg| {
            let log = log.clone();
            cg.host_task(move |_| {
                std::thread::sleep(Duration::from_micros(200));
                log.lock().unwrap().push(v);
            });
        })
        .unwrap();
    }
    let barrier = q.barrier().unwrap();
    let after = q
        .submit(|cg| {
            cg.depends_on(&barrier);
            log_task(cg, &log, 999);
        })
        .unwrap();
    after.wait().unwrap();
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 21);
    assert_eq!(*log.last().unwrap(), 999);
}

/// An empty command group is an empty node: it completes after its dependencies.
#[test]
fn empty_command_group_completes_after_dependencies() {
    let rt = Runtime::builder().mode(Mode::Manual).build();
    let q = rt.queue();
    let buf = rt.buffer_zeroed::<u32>(4);
    let fill = q.submit(|cg| cg.fill(&buf, 3)).unwrap();
    let empty = q
        .submit(|cg| {
            cg.depends_on(&fill);
        })
        .unwrap();
    assert!(!empty.is_complete(), "nothing runs before a flush in manual mode");
    empty.wait().unwrap();
    assert!(fill.is_complete());
}

/// Readers of one buffer get no edges between them: many readers complete even when
/// each waits for all of them to have started.
#[test]
fn readers_do_not_depend_on_each_other() {
    let rt = Runtime::builder().host_threads(3).build();
    let q = rt.queue();
    let buf = rt.buffer(&[5u32; 4]);
    let barrier = Arc::new(std::sync::Barrier::new(3));
    let events: Vec<_> = (0..3)
        .map(|_| {
            q.submit(|cg| {
                let r = cg.host_access::<u32, Read>(&buf, ..);
                let barrier = barrier.clone();
                cg.host_task(move |ctx| {
                    assert_eq!(r.as_slice(ctx)[0], 5);
                    barrier.wait();
                });
            })
            .unwrap()
        })
        .collect();
    for e in events {
        e.wait().unwrap();
    }
}

/// A user system in the resolve stage sees the edges resolution created.
#[test]
fn user_system_observes_resolved_edges() {
    use gantry::components::{Command, Edges};
    use gantry::ecs::prelude::*;
    use gantry::Stage;

    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).build();
    let seen: Arc<Mutex<Vec<(u64, usize)>>> = Arc::default();
    let s = seen.clone();
    rt.add_system(Stage::Resolve, move |q: Query<(&Command, &Edges)>| {
        for (c, e) in &q {
            s.lock().unwrap().push((c.seq, e.preds.len()));
        }
    });
    let q = rt.queue();
    let (a, b) = (rt.buffer_zeroed::<u32>(4), rt.buffer_zeroed::<u32>(4));
    q.submit(|cg| cg.fill(&a, 1)).unwrap(); // 0
    q.submit(|cg| cg.fill(&b, 1)).unwrap(); // 1: independent of 0
    q.submit(|cg| cg.copy(&a, &b)).unwrap(); // 2: after 0 (RAW a) and 1 (WAW b)
    rt.flush();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![(0, 0), (1, 0), (2, 2)]);
    assert_eq!(b.to_vec().unwrap(), vec![1; 4]);
}

/// Flushes call the stages directly until a user system is added; then the schedule
/// runs them. A system added between flushes sees the next one, and a command still
/// in the mailbox across the switch runs in order.
#[test]
fn a_system_added_between_flushes_sees_the_next_flush() {
    use gantry::components::{Command, Edges};
    use gantry::ecs::prelude::*;
    use gantry::Stage;

    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).build();
    let q = rt.queue();
    let (a, b) = (rt.buffer_zeroed::<u32>(4), rt.buffer_zeroed::<u32>(4));
    q.submit(|cg| cg.fill(&a, 1)).unwrap().wait().unwrap(); // 0: run and retired
    q.submit(|cg| cg.fill(&b, 2)).unwrap(); // 1: not ingested before the switch
    let seen: Arc<Mutex<Vec<(u64, usize)>>> = Arc::default();
    let s = seen.clone();
    rt.add_system(Stage::Resolve, move |q: Query<(&Command, &Edges)>| {
        for (c, e) in &q {
            s.lock().unwrap().push((c.seq, e.preds.len()));
        }
    });
    q.submit(|cg| cg.copy(&a, &b)).unwrap(); // 2: after 1 (WAW b); 0 is gone
    rt.flush();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![(1, 0), (2, 1)]);
    assert_eq!(b.to_vec().unwrap(), vec![1; 4]);
}
