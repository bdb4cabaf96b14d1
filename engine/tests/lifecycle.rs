//! Lifetimes: dropped buffers, queues and runtimes; host access guards; flat memory.

use std::time::Duration;

mod common;

use gantry::{Error, EventStatus, ExecError, Mode, Runtime};

/// Dropping a buffer while commands use it is safe; its record goes when they finish.
#[test]
fn dropping_a_buffer_in_use_is_safe() {
    for mode in [Mode::Threaded, Mode::Manual] {
        let rt = Runtime::builder().mode(mode).build();
        let q = rt.queue();
        let keep = rt.buffer_zeroed::<u32>(1024);
        for _ in 0..10 {
            let tmp = rt.buffer(&vec![3u32; 1024]);
            q.submit(|cg| {
                let t = cg.read(&tmp);
                let k = cg.read_write(&keep);
                cg.parallel_for(1024, move |it| {
                    let i = it.global_linear_id();
                    k.set(it, i, k.get(it, i) + t.get(it, i))
                });
            })
            .unwrap();
            drop(tmp);
        }
        assert_eq!(keep.to_vec().unwrap(), vec![30; 1024]);
        rt.wait_idle().unwrap();
        drop(keep);
        rt.wait_idle().unwrap();
        rt.flush();
        let s = rt.stats();
        assert_eq!((s.live_commands, s.live_records), (0, 0), "{mode:?}: {s:?}");
    }
}

/// Finished commands are despawned: the world does not grow with the command count.
#[test]
fn memory_stays_flat_over_many_commands() {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).build();
    let q = rt.queue();
    let bufs: Vec<_> = (0..8).map(|_| rt.buffer_zeroed::<u32>(16)).collect();
    let mut peak_entities = 0;
    for round in 0..200 {
        for i in 0..100 {
            let (r, w) = (&bufs[i % 8], &bufs[(i * 3 + 1) % 8]);
            q.submit(|cg| {
                let r = cg.read(r);
                let w = cg.write(w);
                cg.single_task(move |it| w.set(it, 0, r.get(it, 0) + 1));
            })
            .unwrap();
        }
        rt.wait_idle().unwrap();
        let entities = rt.with_world(|w| w.entity_count());
        if round == 0 {
            peak_entities = entities;
        }
        assert!(entities <= peak_entities, "world grew from {peak_entities} to {entities}");
    }
    let s = rt.stats();
    assert_eq!(s.submitted, 20_000);
    assert_eq!(s.completed, 20_000);
    assert_eq!(s.live_commands, 0);
}

/// What a threaded runtime's stages would free of a command is handed back: freed on
/// a user thread, where it was allocated (here the submitting thread, at its wait),
/// and nothing is kept once the runtime is idle, also when no user thread calls in.
#[test]
fn a_threaded_runtime_frees_kernels_on_user_threads_and_keeps_nothing_once_idle() {
    use std::sync::{Arc, Mutex};
    use std::thread::{self, ThreadId};

    /// Records the thread its drop ran on.
    struct Probe(Arc<Mutex<Vec<ThreadId>>>);
    impl Drop for Probe {
        fn drop(&mut self) {
            self.0.lock().unwrap().push(thread::current().id());
        }
    }
    let drops = Arc::new(Mutex::new(Vec::new()));
    let submit = |q: &gantry::Queue| {
        let probe = Probe(drops.clone());
        q.submit(move |cg| {
            cg.single_task(move |_| {
                let _ = &probe;
            })
        })
        .unwrap()
    };
    // A scheduler that spins for the whole test never frees what it gave back.
    let rt = Runtime::builder().spin_before_blocking(Duration::from_secs(3600)).build();
    let q = rt.queue();
    submit(&q).wait().unwrap();
    assert_eq!(*drops.lock().unwrap(), [thread::current().id()], "freed by the wait, on this thread");
    drop(rt);

    // A scheduler that goes to sleep frees what no user thread took first.
    let rt = Runtime::builder().spin_before_blocking(Duration::ZERO).build();
    let q = rt.queue();
    let events: Vec<_> = (0..100).map(|_| submit(&q)).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while drops.lock().unwrap().len() < 101 {
        assert!(std::time::Instant::now() < deadline, "captures still alive with nobody calling in");
        thread::sleep(Duration::from_millis(1));
    }
    assert!(events.iter().all(|e| e.status() == EventStatus::Complete));
}

/// A write guard holds off later commands on the buffer until it drops.
#[test]
fn host_write_guard_blocks_later_work() {
    let rt = Runtime::new();
    let q = rt.queue();
    let buf = rt.buffer(&[1u32; 4]);
    let mut guard = buf.write().unwrap();
    let ev = q
        .submit(|cg| {
            let b = cg.read_write(&buf);
            cg.parallel_for(4, move |it| {
                b.set(it, it.global_linear_id(), b.get(it, it.global_linear_id()) * 10)
            });
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(ev.status(), EventStatus::Pending, "kernel must wait for the guard");
    guard[2] = 5;
    drop(guard);
    ev.wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![10, 10, 50, 10]);
}

/// A read guard waits for earlier writers.
#[test]
fn host_read_guard_sees_earlier_writes() {
    let rt = Runtime::builder().mode(Mode::Manual).build();
    let q = rt.queue();
    let buf = rt.buffer_zeroed::<u16>(3);
    q.submit(|cg| cg.fill(&buf, 9)).unwrap();
    assert_eq!(&*buf.read().unwrap(), &[9, 9, 9]);
}

/// Waiting on an event whose runtime is gone is an error, not a hang; so is
/// submitting to a queue of a dropped runtime.
#[test]
fn dropped_runtime() {
    let rt = Runtime::new();
    let q = rt.queue();
    let buf = rt.buffer(&[1u32; 4]);
    let guard = buf.write().unwrap();
    // Blocked behind the guard: can never run once the runtime goes.
    let blocked = q.submit(|cg| cg.fill(&buf, 2)).unwrap();
    let done = {
        let other = rt.buffer_zeroed::<u8>(2);
        q.submit(|cg| cg.fill(&other, 1)).unwrap()
    };
    drop(rt);
    assert!(done.is_complete(), "work that could finish did");
    assert_eq!(blocked.wait(), Err(Error::Exec(ExecError::RuntimeDropped)));
    assert_eq!(q.submit(|cg| cg.fill(&buf, 3)).unwrap_err(), Error::RuntimeDropped);
    drop(guard);
    assert_eq!(buf.read().err(), Some(Error::RuntimeDropped));
}

/// A fusion still collecting kernels when its runtime drops fails its event (which
/// has no command of its own yet) instead of leaving a wait on it to hang. (The
/// window fuses whatever its size: the CPU driver would run this small kernel as it
/// was submitted.)
#[test]
fn dropped_runtime_fails_a_collecting_fusion() {
    let rt = Runtime::builder().fusion_window(gantry::WindowThresholds::ALWAYS).build();
    let q = rt.queue();
    let buf = rt.buffer(&[1u32; 4]);
    q.start_fusion().unwrap();
    let fusion = q
        .submit(|cg| {
            let b = cg.elements_mut(&buf);
            cg.parallel_for(4, move |it| *b.elem(it) += 1);
        })
        .unwrap();
    rt.wait_idle().unwrap();
    drop(rt);
    assert_eq!(fusion.wait(), Err(Error::Exec(ExecError::RuntimeDropped)));
}

/// A pending event of a never-flushed manual runtime is finished when it drops.
#[test]
fn manual_runtime_drop_finishes_work() {
    let rt = Runtime::builder().mode(Mode::Manual).build();
    let buf = rt.buffer_zeroed::<u32>(4);
    let ev = rt.queue().submit(|cg| cg.fill(&buf, 4)).unwrap();
    assert_eq!(ev.status(), EventStatus::Pending);
    drop(rt);
    assert_eq!(ev.wait(), Ok(()));
}

/// Dropping a queue with work in flight is safe; the work completes.
#[test]
fn dropping_a_queue_keeps_its_work() {
    let rt = Runtime::new();
    let buf = rt.buffer_zeroed::<u32>(64);
    let ev = {
        let q = rt.in_order_queue();
        q.submit(|cg| cg.fill(&buf, 1)).unwrap();
        q.submit(|cg| {
            let b = cg.elements_mut(&buf);
            cg.parallel_for(64, move |it| *b.elem(it) += 1);
        })
        .unwrap()
    };
    ev.wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![2; 64]);
}

/// Profiling timestamps are ordered.
#[test]
fn timestamps_are_ordered() {
    let rt = Runtime::builder().profiling(true).build();
    let buf = rt.buffer_zeroed::<u32>(1 << 16);
    let ev = rt
        .queue()
        .submit(|cg| {
            let b = cg.elements_out(&buf);
            cg.parallel_for(1 << 16, move |it| *b.elem(it) = 1);
        })
        .unwrap();
    ev.wait().unwrap();
    let t = ev.timestamps().unwrap();
    assert!(t.submitted_ns <= t.started_ns && t.started_ns <= t.ended_ns, "{t:?}");
    assert!(rt.now_ns() >= t.ended_ns);
}

/// A runtime that does not profile (the default, without a simulated device) says so
/// instead of giving timestamps; one with a timeline, or a simulated device, does
/// profile unless told not to.
#[test]
fn timestamps_need_a_profiling_runtime() {
    let profiles = |rt: Runtime| {
        let ev = rt.queue().submit(|cg| cg.single_task(|_| {})).unwrap();
        ev.wait().unwrap();
        match ev.timestamps() {
            Ok(t) => {
                assert!(t.submitted_ns <= t.started_ns && t.started_ns <= t.ended_ns, "{t:?}");
                true
            }
            Err(e) => {
                assert!(matches!(e, gantry::Error::ProfilingDisabled), "{e}");
                false
            }
        }
    };
    assert!(!profiles(Runtime::new()));
    assert!(profiles(Runtime::builder().profiling(true).build()));
    assert!(profiles(Runtime::builder().timeline(true).build()));
    assert!(profiles(Runtime::builder().sim(gantry::SimConfig::default()).build()));
    assert!(!profiles(Runtime::builder().sim(gantry::SimConfig::default()).profiling(false).build()));
    assert!(profiles(Runtime::builder().timeline(true).profiling(false).build()), "a timeline needs times");
}

/// Non-blocking results, queue properties and the default device.
#[test]
fn try_result_default_device_and_queue_properties() {
    let rt =
        Runtime::builder().mode(Mode::Manual).sim(gantry::SimConfig::default()).default_device(1).build();
    let q = rt.in_order_queue();
    assert!(q.is_in_order() && !rt.queue().is_in_order());
    assert_eq!(q.device(), 1, "queues go to the default device");
    let buf = rt.buffer_zeroed::<u32>(4);
    let ev = q.submit(|cg| cg.fill(&buf, 3)).unwrap();
    assert_eq!(ev.try_result(), None, "pending until a flush in manual mode");
    ev.wait().unwrap();
    assert_eq!(ev.try_result(), Some(Ok(())));
    let bad = q
        .submit(|cg| {
            let b = cg.read_write(&buf);
            cg.single_task(move |it| b.set(it, 9, 1)); // out of bounds: fails
        })
        .unwrap();
    assert!(bad.wait().is_err());
    assert!(matches!(bad.try_result(), Some(Err(Error::Exec(ExecError::KernelPanicked { .. })))));
    assert_eq!(buf.to_vec().unwrap(), vec![3; 4]);
}

/// Finished events go back to the submitting thread's pool and later commands reuse
/// them (`gantry_components::event_pool`), but never one a handle still holds: kept
/// events report their own command's outcome after thousands of later commands.
#[test]
fn kept_events_keep_their_outcome_while_finished_events_are_reused() {
    common::quiet_panics(|msg| msg.starts_with("kept kernel exploded"));
    for mode in [Mode::Manual, Mode::Threaded] {
        let rt = Runtime::builder().mode(mode).build();
        let q = rt.queue();
        let buf = rt.buffer(&[0u32; 4]);
        let ok = q
            .submit(|cg| {
                cg.name("kept ok");
                let b = cg.elements_mut(&buf);
                cg.parallel_for(4, move |it| *b.elem(it) += 1);
            })
            .unwrap();
        let failed = q
            .submit(|cg| {
                cg.name("kept failed");
                cg.single_task(|_| panic!("kept kernel exploded"));
            })
            .unwrap();
        // Their events are dropped at once: finished, they go to the pool and come back.
        for round in 0..3 {
            for _ in 0..1_000 {
                q.submit(|cg| {
                    let b = cg.elements_mut(&buf);
                    cg.parallel_for(4, move |it| *b.elem(it) += 1);
                })
                .unwrap();
            }
            let _ = q.wait();
            assert!(gantry::components::event_pool::kept() > 0, "{mode:?}, round {round}: nothing pooled");
        }
        assert_eq!((ok.name(), ok.status()), ("kept ok", EventStatus::Complete));
        assert!(ok.wait().is_ok());
        assert_eq!((failed.name(), failed.status()), ("kept failed", EventStatus::Failed));
        match failed.error() {
            Some(ExecError::KernelPanicked { kernel, message }) => {
                assert_eq!((&*kernel, message.as_str()), ("kept failed", "kept kernel exploded"))
            }
            other => panic!("{mode:?}: {other:?}"),
        }
        assert_eq!(buf.to_vec().unwrap(), vec![3_001; 4]);
    }
}
