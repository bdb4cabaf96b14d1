//! The runtime never dies, never hangs and never grows on input it accepts: the
//! adversarial inputs of the reliability issue, each through the public API. Every
//! test here failed (panicked, hung, aborted or gave a wrong answer) before its fix.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gantry::{
    Error, EventStatus, ExecError, FusionProps, GraphProps, Mode, Runtime, Stage, WindowThresholds,
};

/// Runs `f` on a thread and fails the test if it does not return within `secs`: a
/// hang is a failure, not a stuck CI job.
fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).expect("hung")
}

fn runtimes() -> [Runtime; 2] {
    [Runtime::new(), Runtime::builder().mode(Mode::Manual).worker_threads(0).build()]
}

/// A value whose destructor panics, captured by user closures.
struct PanicOnDrop(bool);

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        if self.0 && !std::thread::panicking() {
            panic!("destructor of a captured value panicked");
        }
    }
}

// ---- 1. Foreign objects and unknown devices are refused at the call ----

#[test]
fn foreign_executable_graph_is_refused_at_submit() {
    within(30, || {
        let (a, b) = (Runtime::new(), Runtime::new());
        let buf = a.buffer_zeroed::<u32>(4);
        let g = a.graph();
        g.add(|cg| cg.fill(&buf, 1), &[]).unwrap();
        let exec = g.finalize(GraphProps::default()).unwrap();
        let q = b.queue();
        assert_eq!(q.submit_graph(&exec).unwrap_err(), Error::ForeignObject("an executable graph"));
        // Both runtimes go on.
        q.submit(|cg| cg.single_task(|_| {})).unwrap().wait().unwrap();
        a.queue().submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![1; 4]);
    });
}

#[test]
fn foreign_objects_in_a_graph_are_refused_at_the_call() {
    within(30, || {
        let (a, b) = (Runtime::new(), Runtime::new());
        let foreign = b.buffer_zeroed::<u32>(4);
        let g = a.graph();
        let e = g.add(|cg| cg.fill(&foreign, 1), &[]).unwrap_err();
        assert_eq!(e, Error::ForeignObject("a buffer"));
        // A dynamic parameter made from a foreign buffer cannot be bound.
        let mine = a.buffer_zeroed::<u32>(4);
        let node = g
            .add(
                |cg| {
                    let m = cg.read_write(&mine);
                    cg.single_task(move |it| m.set(it, 0, 1));
                },
                &[],
            )
            .unwrap();
        let param = g.dynamic_buffer(&foreign);
        assert_eq!(g.set_arg(node, 0, &param).unwrap_err(), Error::ForeignObject("a buffer"));
        // A foreign queue cannot record into the graph.
        assert_eq!(g.begin_recording(&b.queue()).unwrap_err(), Error::ForeignObject("a queue"));
        // A foreign sub-graph.
        let sub = b.graph();
        sub.add(|cg| cg.fill(&foreign, 2), &[]).unwrap();
        let sub = sub.finalize(GraphProps::default()).unwrap();
        assert_eq!(g.add_graph(&sub, &[]).unwrap_err(), Error::ForeignObject("an executable graph"));
        // Another runtime's graph cannot update this one's executable graph.
        let exec = g.finalize(GraphProps { updatable: true, ..Default::default() }).unwrap();
        let other = b.graph();
        other.add(|cg| cg.fill(&foreign, 2), &[]).unwrap();
        assert_eq!(exec.update(&other).unwrap_err(), Error::ForeignObject("a command graph"));
        // The graph still works.
        g.add(|cg| cg.fill(&mine, 3), &[node]).unwrap();
        a.queue().submit_graph(&g.finalize(GraphProps::default()).unwrap()).unwrap().wait().unwrap();
        assert_eq!(mine.to_vec().unwrap(), vec![3; 4]);
    });
}

#[test]
fn graph_on_an_unknown_device_is_refused() {
    within(30, || {
        let rt = Runtime::new();
        assert_eq!(rt.try_graph_on(99).unwrap_err(), Error::UnknownDevice(99));
        assert!(rt.try_graph_on(0).is_ok());
        // The infallible constructor's graph reports the device at every call.
        let g = rt.graph_on(99);
        assert_eq!(g.add_empty(&[]).unwrap_err(), Error::UnknownDevice(99));
        assert_eq!(g.finalize(GraphProps::default()).unwrap_err(), Error::UnknownDevice(99));
        let q = rt.queue();
        assert_eq!(g.begin_recording(&q).unwrap_err(), Error::UnknownDevice(99));
        q.submit(|cg| cg.single_task(|_| {})).unwrap().wait().unwrap();
    });
}

// ---- 2. User code that panics outside its kernel body ----

#[test]
fn kernel_capture_whose_destructor_panics_does_not_kill_the_scheduler() {
    within(60, || {
        for rt in runtimes() {
            let q = rt.queue();
            let guard = PanicOnDrop(true);
            let ev = q
                .submit(move |cg| {
                    cg.single_task(move |_| {
                        let _ = &guard;
                    })
                })
                .unwrap();
            let _ = ev.wait();
            // The runtime goes on.
            let buf = rt.buffer_zeroed::<u32>(8);
            q.submit(|cg| cg.fill(&buf, 5)).unwrap().wait().unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![5; 8]);
            assert!(rt.stats().submitted >= 2);
        }
    });
}

#[test]
fn host_task_capture_whose_destructor_panics_fails_only_its_command() {
    within(60, || {
        let manual = Runtime::builder().mode(Mode::Manual).worker_threads(0).host_threads(0).build();
        for rt in [Runtime::new(), Runtime::builder().host_threads(2).build(), manual] {
            let q = rt.queue();
            let ev = submit_task_with_panicking_capture(&q);
            let err = ev.wait().unwrap_err();
            assert!(matches!(err, Error::Exec(ExecError::HostTaskPanicked { .. })), "{err:?}");
            let buf = rt.buffer_zeroed::<u32>(8);
            q.submit(|cg| cg.fill(&buf, 6)).unwrap().wait().unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![6; 8]);
        }
    });
}

/// Submits a host task whose captured value panics when dropped.
fn submit_task_with_panicking_capture(q: &gantry::Queue) -> gantry::Event {
    let guard = PanicOnDrop(true);
    q.submit(move |cg| {
        cg.host_task(move |_| {
            let _ = &guard;
        })
    })
    .unwrap()
}

/// A host task that never runs (its dependency failed) drops its closure on the
/// scheduler's thread: a panicking capture there must not stop the scheduler.
#[test]
fn a_host_task_that_never_runs_drops_its_panicking_capture_safely() {
    within(60, || {
        for rt in runtimes() {
            let q = rt.in_order_queue();
            q.submit(|cg| cg.single_task(|_| panic!("first fails"))).unwrap();
            let ev = submit_task_with_panicking_capture(&q);
            let err = ev.wait().unwrap_err();
            assert!(matches!(err, Error::Exec(ExecError::DependencyFailed { .. })), "{err:?}");
            assert!(rt.failure().is_none());
            let buf = rt.buffer_zeroed::<u32>(2);
            rt.queue().submit(|cg| cg.fill(&buf, 3)).unwrap().wait().unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![3; 2]);
        }
    });
}

#[test]
fn a_system_that_panics_once_is_reported_and_the_runtime_goes_on() {
    within(60, || {
        for rt in runtimes() {
            let fired = Arc::new(AtomicBool::new(false));
            let f = fired.clone();
            rt.add_system(Stage::Resolve, move || {
                if !f.swap(true, Ordering::Relaxed) {
                    panic!("user system failed");
                }
            });
            let q = rt.queue();
            let buf = rt.buffer_zeroed::<u32>(4);
            q.submit(|cg| cg.fill(&buf, 9)).unwrap().wait().unwrap();
            assert_eq!(buf.to_vec().unwrap(), vec![9; 4]);
            assert!(fired.load(Ordering::Relaxed));
            let errors = rt.take_system_errors();
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(
                matches!(&errors[0], Error::SystemFailed { stage: Stage::Resolve, message } if message.contains("user system failed"))
            );
            assert_eq!(rt.stats().system_failures, 1);
            assert!(rt.failure().is_none());
        }
    });
}

#[test]
fn a_panicking_linearizer_fails_finalize_and_the_runtime_goes_on() {
    struct Broken;
    impl gantry::Linearizer for Broken {
        fn name(&self) -> &str {
            "broken"
        }
        fn order(&self, _preds: &[gantry::NodeList], _succs: &[gantry::NodeList]) -> Vec<u32> {
            panic!("linearizer bug")
        }
    }
    within(60, || {
        let rt = Runtime::builder().linearizer(Arc::new(Broken)).build();
        let buf = rt.buffer_zeroed::<u32>(4);
        let g = rt.graph();
        g.add(|cg| cg.fill(&buf, 1), &[]).unwrap();
        let err = g.finalize(GraphProps::default()).unwrap_err();
        assert!(
            matches!(&err, Error::Finalize(gantry::FinalizeError::Panicked(m)) if m.contains("linearizer bug")),
            "{err:?}"
        );
        rt.queue().submit(|cg| cg.fill(&buf, 2)).unwrap().wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![2; 4]);
    });
}

// ---- 6. Sizes are checked, never abort ----

#[test]
fn huge_buffers_are_typed_errors() {
    let rt = Runtime::new();
    assert!(matches!(rt.try_buffer_zeroed::<u8>(1 << 46), Err(Error::OutOfHostMemory { .. })));
    assert!(matches!(rt.try_buffer_zeroed::<u64>(usize::MAX / 2), Err(Error::SizeOverflow { .. })));
    let b = rt.try_buffer_zeroed::<u64>(16).unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![0; 16]);
}

#[test]
fn huge_scratch_memory_is_refused_at_submit() {
    let rt = Runtime::new();
    let q = rt.queue();
    let e = q
        .submit(|cg| {
            let p = cg.private::<u8>(1 << 40);
            cg.parallel_for(64, move |it| p.set(it, 0, 1));
        })
        .unwrap_err();
    assert!(matches!(e, Error::PrivateMemoryTooLarge { .. }), "{e:?}");
    let e = q
        .submit(|cg| {
            let l = cg.local::<u64>((1usize << 61) + 1);
            cg.parallel_for_nd(gantry::NdRange::new([64], [64]), move |it| l.set(it, 0, 1));
        })
        .unwrap_err();
    assert!(matches!(e, Error::SizeOverflow { .. }), "{e:?}");
    q.submit(|cg| cg.single_task(|_| {})).unwrap().wait().unwrap();
}

// ---- 9. Accessors of another runtime's command group ----

#[test]
fn an_accessor_from_another_runtime_never_reaches_its_buffer() {
    within(30, || {
        let (a, b) = (Runtime::new(), Runtime::new());
        let wide = a.buffer_zeroed::<u64>(4);
        let narrow = b.buffer(&[7u32; 4]);
        let stolen = Arc::new(std::sync::Mutex::new(None));
        let s = stolen.clone();
        a.queue()
            .submit(|cg| {
                *s.lock().unwrap() = Some(cg.read_write(&wide));
                cg.single_task(|_| {});
            })
            .unwrap()
            .wait()
            .unwrap();
        let acc = stolen.lock().unwrap().take().unwrap();
        let ev = b
            .queue()
            .submit(|cg| {
                let _mine = cg.read_write(&narrow);
                cg.single_task(move |it| acc.set(it, 0, u64::MAX));
            })
            .unwrap();
        assert!(ev.wait().is_err());
        assert_eq!(narrow.to_vec().unwrap(), vec![7; 4]);
    });
}

// ---- 12, 14. Recording ----

#[test]
fn dropping_a_recording_graph_ends_its_recordings() {
    within(30, || {
        let rt = Runtime::new();
        let q = rt.queue();
        let buf = rt.buffer_zeroed::<u32>(4);
        {
            let g = rt.graph();
            g.begin_recording(&q).unwrap();
            q.submit(|cg| cg.fill(&buf, 1)).unwrap();
        }
        assert!(!q.is_recording());
        q.submit(|cg| cg.fill(&buf, 4)).unwrap();
        q.wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![4; 4]);
    });
}

#[test]
fn make_edge_while_recording_is_refused() {
    let rt = Runtime::new();
    let q = rt.queue();
    let g = rt.graph();
    let a = g.add_empty(&[]).unwrap();
    let b = g.add_empty(&[]).unwrap();
    g.begin_recording(&q).unwrap();
    assert_eq!(g.make_edge(a, b).unwrap_err(), Error::GraphRecording(g.id()));
    assert_eq!(g.make_edge_unchecked(a, b).unwrap_err(), Error::GraphRecording(g.id()));
    g.end_recording(&q).unwrap();
    g.make_edge(a, b).unwrap();
}

// ---- 13. Fusion is cancelled when the cancelling call returns ----

/// A runtime whose fusion windows fuse whatever their size: the CPU driver would run
/// these small kernels as they are submitted, with nothing to cancel.
fn fusing_runtime() -> Runtime {
    Runtime::builder().fusion_window(WindowThresholds::ALWAYS).build()
}

/// [`runtimes`], fusing every window.
fn fusing_runtimes() -> [Runtime; 2] {
    let manual = Runtime::builder().mode(Mode::Manual).worker_threads(0);
    [fusing_runtime(), manual.fusion_window(WindowThresholds::ALWAYS).build()]
}

#[test]
fn dropping_a_listed_buffer_cancels_the_fusion_at_once() {
    let rt = fusing_runtime();
    let q = rt.queue();
    let buf = rt.buffer_zeroed::<u32>(64);
    let other = rt.buffer_zeroed::<u32>(64);
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let b = cg.elements_mut(&buf);
        cg.parallel_for(64, move |it| *b.elem(it) += 1);
    })
    .unwrap();
    drop(buf);
    assert!(!q.is_in_fusion_mode());
    q.submit(|cg| {
        let b = cg.elements_mut(&other);
        cg.parallel_for(64, move |it| *b.elem(it) += 1);
    })
    .unwrap();
    q.wait().unwrap();
    assert_eq!(other.to_vec().unwrap(), vec![1; 64]);
}

#[test]
fn a_dependent_command_elsewhere_cancels_the_fusion_at_once() {
    let rt = fusing_runtime();
    let (q, other_q) = (rt.queue(), rt.queue());
    let buf = rt.buffer_zeroed::<u32>(64);
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let b = cg.elements_mut(&buf);
        cg.parallel_for(64, move |it| *b.elem(it) += 1);
    })
    .unwrap();
    other_q.submit(|cg| cg.fill(&buf, 10)).unwrap();
    assert!(!q.is_in_fusion_mode());
    let ev = q.complete_fusion(FusionProps::default()).unwrap();
    ev.wait().unwrap();
    q.wait().unwrap();
    other_q.wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![10; 64]);
}

/// The call applies the scheduler's rule, byte ranges included: a command on a
/// range no listed kernel touches leaves the fusion alone.
#[test]
fn an_independent_command_elsewhere_leaves_the_fusion_alone() {
    let rt = fusing_runtime();
    let (q, other_q) = (rt.queue(), rt.queue());
    let buf = rt.buffer_zeroed::<u32>(128);
    q.start_fusion().unwrap();
    for _ in 0..2 {
        q.submit(|cg| {
            let b = cg.elements::<u32, gantry::ReadWrite>(&buf, ..64);
            cg.parallel_for(64, move |it| *b.elem(it) += 1);
        })
        .unwrap();
    }
    other_q.submit(|cg| cg.fill_range(&buf, 64.., 7)).unwrap();
    assert!(q.is_in_fusion_mode());
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    other_q.wait().unwrap();
    assert!(matches!(q.fusion_outcome(), Some(gantry::FusionOutcome::Fused { kernels: 2, .. })));
    let v = buf.to_vec().unwrap();
    assert_eq!((&v[..64], &v[64..]), (&[2; 64][..], &[7; 64][..]));
}

/// Two fusing queues that come to depend on each other both ways: the kernel that
/// closes the cycle cancels the other fusion before its submit returns.
#[test]
fn a_cycle_between_fusing_queues_cancels_one_at_the_call() {
    for rt in fusing_runtimes() {
        let (qa, qb) = (rt.queue(), rt.queue());
        let (x, y) = (rt.buffer(&[1u32; 8]), rt.buffer(&[2u32; 8]));
        qa.start_fusion().unwrap();
        qb.start_fusion().unwrap();
        qa.submit(|cg| {
            let xs = cg.elements_mut(&x);
            cg.parallel_for(8, move |it| *xs.elem(it) *= 2);
        })
        .unwrap();
        qb.submit(|cg| {
            let (xs, ys) = (cg.read(&x), cg.elements_mut(&y));
            cg.parallel_for(8, move |it| *ys.elem(it) += xs.get(it, it.global_linear_id()));
        })
        .unwrap();
        assert!(qb.is_in_fusion_mode());
        qa.submit(|cg| {
            let (ys, xs) = (cg.read(&y), cg.elements_mut(&x));
            cg.parallel_for(8, move |it| *xs.elem(it) += ys.get(it, it.global_linear_id()));
        })
        .unwrap();
        assert!(!qb.is_in_fusion_mode());
        assert!(qa.is_in_fusion_mode());
        assert!(matches!(
            qb.fusion_outcome(),
            Some(gantry::FusionOutcome::Cancelled(gantry::CancelReason::Cycle { other_queue })) if other_queue == qa.id()
        ));
        let ea = qa.complete_fusion(FusionProps::default()).unwrap();
        ea.wait().unwrap();
        qb.wait().unwrap();
        assert_eq!(y.to_vec().unwrap(), vec![4; 8]);
        assert_eq!(x.to_vec().unwrap(), vec![6; 8]);
    }
}

// ---- 15. q.wait() means every event of the queue is final ----

#[test]
fn after_queue_wait_every_event_is_final() {
    within(120, || {
        let rt = Runtime::new();
        for round in 0..50 {
            let q = rt.in_order_queue();
            let buf = rt.buffer_zeroed::<u32>(64);
            q.start_fusion().unwrap();
            let events: Vec<_> = (0..4)
                .map(|_| {
                    q.submit(|cg| {
                        let b = cg.elements_mut(&buf);
                        cg.parallel_for(64, move |it| *b.elem(it) += 1);
                    })
                    .unwrap()
                })
                .collect();
            q.wait().unwrap();
            for e in &events {
                assert!(e.status().is_final(), "round {round}: {:?}", e.status());
            }
        }
    });
}

#[test]
fn after_queue_wait_every_graph_submission_is_final() {
    within(120, || {
        let rt = Runtime::new();
        let buf = rt.buffer_zeroed::<u32>(64);
        let g = rt.graph();
        let a = g
            .add(
                |cg| {
                    let b = cg.elements::<u32, gantry::ReadWrite>(&buf, ..32);
                    cg.parallel_for(32, move |it| *b.elem(it) += 1);
                },
                &[],
            )
            .unwrap();
        g.add(
            |cg| {
                let b = cg.elements::<u32, gantry::ReadWrite>(&buf, 32..);
                cg.parallel_for(32, move |it| *b.elem(it) += 1);
            },
            &[],
        )
        .unwrap();
        g.add_empty(&[a]).unwrap();
        let exec = g.finalize(GraphProps::default()).unwrap();
        let q = rt.queue();
        for round in 0..400 {
            let events: Vec<_> = (0..3).map(|_| q.submit_graph(&exec).unwrap()).collect();
            q.wait().unwrap();
            for e in &events {
                assert!(e.status().is_final(), "round {round}: {:?}", e.status());
            }
        }
        assert_eq!(buf.to_vec().unwrap(), vec![1200; 64]);
    });
}

// ---- 11. Failures reach what was submitted before the next wait, whatever the timing ----

/// A barrier fails if a command submitted before it (since the previous barrier)
/// failed, also when the scheduler retired that failure before the barrier arrived;
/// after the user has waited, a new barrier is independent of it.
#[test]
fn a_barrier_after_a_retired_failure_fails_until_the_user_waits() {
    within(60, || {
        for rt in runtimes() {
            let q = rt.queue();
            let bad = q.submit(|cg| cg.single_task(|_| panic!("first fails"))).unwrap();
            if rt.mode() == Mode::Threaded {
                // Let the scheduler retire it without a wait of ours.
                while !bad.status().is_final() {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let err = q.barrier().unwrap().wait().unwrap_err();
            assert!(matches!(err, Error::Exec(ExecError::DependencyFailed { .. })), "{err:?}");
            q.barrier().unwrap().wait().unwrap();
            q.wait().unwrap();
        }
    });
}

// ---- 4, 5. Sustained submission ----

#[test]
fn work_keeps_completing_under_sustained_submission() {
    within(120, || {
        let rt = Arc::new(Runtime::new());
        let stop = Arc::new(AtomicBool::new(false));
        let submitted = Arc::new(AtomicUsize::new(0));
        let producer = {
            let (rt, stop, submitted) = (rt.clone(), stop.clone(), submitted.clone());
            std::thread::spawn(move || {
                let q = rt.queue();
                let buf = rt.buffer_zeroed::<u32>(1);
                while !stop.load(Ordering::Relaxed) {
                    if q.submit(|cg| cg.fill(&buf, 1)).is_err() {
                        break;
                    }
                    submitted.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // Once the producer is going, another queue's work completes while it goes on,
        // and stats answer.
        while submitted.load(Ordering::Relaxed) < 10_000 {
            std::thread::yield_now();
        }
        let q = rt.queue();
        let mine = rt.buffer_zeroed::<u32>(4);
        for i in 0..20 {
            q.submit(|cg| cg.fill(&mine, i)).unwrap().wait().unwrap();
        }
        let stats = rt.stats();
        assert!(stats.completed > 20);
        stop.store(true, Ordering::Relaxed);
        producer.join().unwrap();
    });
}

#[test]
fn dropping_the_runtime_while_another_thread_submits_returns() {
    within(60, || {
        let rt = Runtime::new();
        let q = rt.queue();
        let buf = rt.buffer_zeroed::<u32>(1);
        let producer = std::thread::spawn(move || {
            let mut refused = None;
            for _ in 0..50_000_000u64 {
                if let Err(e) = q.submit(|cg| cg.fill(&buf, 1)) {
                    refused = Some(e);
                    break;
                }
            }
            refused
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(rt);
        assert_eq!(producer.join().unwrap(), Some(Error::RuntimeDropped));
    });
}

// ---- 3. A scheduler that stops never leaves a wait hanging ----

/// The scheduler's own state broken through the research API (a resource its systems
/// need, removed): its systems fail, the scheduler stops, and every wait, `stats` and
/// `drop` return with a typed error.
#[test]
fn a_scheduler_that_fails_fails_what_is_pending_and_never_hangs() {
    within(60, || {
        for rt in runtimes() {
            let q = rt.queue();
            let buf = rt.buffer_zeroed::<u32>(4);
            let guard = buf.write().unwrap();
            let blocked = q.submit(|cg| cg.fill(&buf, 1)).unwrap();
            rt.with_world(|w| w.remove_resource::<gantry::components::WorkLists>());
            drop(guard);
            let err = blocked.wait().unwrap_err();
            assert!(
                matches!(&err, Error::Exec(ExecError::SchedulerFailed { .. }) | Error::SchedulerFailed(_)),
                "{err:?}"
            );
            assert!(matches!(rt.failure(), Some(Error::SchedulerFailed(_))));
            assert!(matches!(q.submit(|cg| cg.fill(&buf, 2)), Err(Error::SchedulerFailed(_))));
            assert!(rt.wait_idle().is_err());
            let _ = rt.stats();
            assert_eq!(blocked.status(), EventStatus::Failed);
        }
    });
}

// ---- 17. Self-deadlocks are reported ----

#[test]
fn a_thread_asking_for_a_buffer_it_holds_gets_an_error() {
    within(30, || {
        for rt in runtimes() {
            let buf = rt.buffer(&[1u32; 4]);
            let w = buf.write().unwrap();
            assert!(matches!(buf.read(), Err(Error::SelfDeadlock(_))));
            assert!(matches!(buf.to_vec(), Err(Error::SelfDeadlock(_))));
            drop(w);
            let (r1, r2) = (buf.read().unwrap(), buf.read().unwrap());
            assert!(matches!(buf.write(), Err(Error::SelfDeadlock(_))));
            drop((r1, r2));
            assert_eq!(buf.to_vec().unwrap(), vec![1; 4]);
        }
    });
}

#[test]
fn waiting_for_itself_inside_a_host_task_is_an_error() {
    within(60, || {
        for rt in [Runtime::builder().host_threads(2).build(), Runtime::builder().host_threads(0).build()] {
            let rt = Arc::new(rt);
            let q = rt.queue();
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let (r, qq, s) = (rt.clone(), q.clone(), seen.clone());
            q.submit(move |cg| {
                cg.host_task(move |_| {
                    let mut seen = s.lock().unwrap();
                    seen.push(r.wait_idle());
                    seen.push(qq.wait());
                })
            })
            .unwrap()
            .wait()
            .unwrap();
            let seen = seen.lock().unwrap();
            assert!(seen.iter().all(|r| matches!(r, Err(Error::SelfDeadlock(_)))), "{seen:?}");
            // Another queue's wait is fine inside the task's runtime's own work.
            rt.wait_idle().unwrap();
        }
    });
}

#[test]
fn dropping_the_runtime_inside_its_own_host_task_returns() {
    within(60, || {
        for host_threads in [2, 0] {
            let rt = Runtime::builder().host_threads(host_threads).build();
            let q = rt.queue();
            let buf = rt.buffer_zeroed::<u32>(4);
            q.submit(|cg| cg.fill(&buf, 8)).unwrap();
            let holder = std::sync::Mutex::new(Some(rt));
            let ev = q
                .submit(move |cg| {
                    cg.host_task(move |_| drop(holder.lock().unwrap().take()));
                })
                .unwrap();
            ev.wait().unwrap();
            assert!(matches!(q.submit(|cg| cg.fill(&buf, 1)), Err(Error::RuntimeDropped)));
        }
    });
}
