//! Fusion windows that would not pay on their device (the CPU driver's
//! `WindowThresholds`): judged at their first kernel, they run their kernels as they
//! are submitted, say why in the fusion outcome, and `complete_fusion`'s event still
//! completes after every kernel of the window, failures included.

use std::time::Duration;

use gantry::{
    Buffer, CancelReason, CpuConfig, Event, EventStatus, FusionError, FusionOutcome, FusionProps, Mode,
    Promotion, Queue, QueueOptions, Runtime, Unprofitable, WindowThresholds,
};

/// A manual runtime and a threaded one, both on the CPU driver's thresholds.
fn runtimes() -> [Runtime; 2] {
    [
        Runtime::builder().mode(Mode::Manual).worker_threads(0).fusion_warnings(0).build(),
        Runtime::builder().worker_threads(2).fusion_warnings(0).build(),
    ]
}

fn cpu_thresholds(rt: &Runtime) -> WindowThresholds {
    rt.devices()[0].caps.fusion_window
}

/// `out[i] = in[i] * 2 + 1`, as a `map`, promoting the input and the output as asked.
fn step(q: &Queue, input: &Buffer<u32>, output: &Buffer<u32>, promote: (bool, bool)) -> Event {
    q.submit(|cg| {
        let (a, o) = (cg.read(input), cg.elements_out(output));
        if promote.0 {
            cg.promote(&a, Promotion::Private);
        }
        if promote.1 {
            cg.promote(&o, Promotion::Private);
        }
        cg.map(&a, &o, |x: u32| x * 2 + 1);
    })
    .unwrap()
}

/// The reason a window was not fused for.
fn refusal(q: &Queue) -> Unprofitable {
    match q.fusion_outcome() {
        Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
            reason, ..
        }))) => reason,
        other => panic!("expected a window refused as unprofitable, got {other:?}"),
    }
}

/// A chain of launch-bound kernels: the window says so from its first kernel on and
/// stays in fusion mode, each kernel runs unfused with an event of its own (the
/// promoted intermediates are written like any buffer), `complete_fusion`'s event
/// completes after the last one, and the scheduler never saw a fusion list.
#[test]
fn a_launch_bound_window_runs_its_kernels_as_submitted() {
    for rt in runtimes() {
        for in_order in [false, true] {
            let min_items = cpu_thresholds(&rt).min_items;
            let n = 64;
            assert!(min_items > n as u64, "the CPU driver does not fuse windows of {n} work-items");
            let q = rt.queue_with(QueueOptions { device: 0, in_order }).unwrap();
            let bufs: Vec<Buffer<u32>> = (0..4).map(|i| rt.buffer(&vec![i; n])).collect();
            q.start_fusion().unwrap();
            let first = step(&q, &bufs[0], &bufs[1], (false, true));
            assert!(q.is_in_fusion_mode());
            assert_eq!(refusal(&q), Unprofitable::LaunchBound { items: n as u64, min_items });
            let second = step(&q, &bufs[1], &bufs[2], (true, true));
            let third = step(&q, &bufs[2], &bufs[3], (true, false));
            let done = q.complete_fusion(FusionProps::default()).unwrap();
            assert!(!q.is_in_fusion_mode());
            done.wait().unwrap();
            for (i, e) in [&first, &second, &third].into_iter().enumerate() {
                assert_eq!(
                    e.status(),
                    EventStatus::Complete,
                    "kernel {i} finished before the window's event"
                );
            }
            assert_eq!(bufs[1].to_vec().unwrap(), vec![1; n], "the intermediate was written: run unfused");
            assert_eq!(bufs[3].to_vec().unwrap(), vec![7; n]);
            let stats = rt.stats();
            assert_eq!((stats.fusions_fused, stats.fusions_cancelled), (0, 0), "no fusion list");
            let lookups = rt.fusion_cache_stats().map_or(0, |c| c.hits + c.misses);
            assert_eq!(lookups, 0, "the fusion compiler was not asked");
        }
    }
}

/// Past the item threshold, a chain whose intermediates stay in global memory the
/// caches hold is not fused either; the same chain with private intermediates is.
#[test]
fn only_chains_that_save_memory_traffic_fuse_at_cache_resident_sizes() {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).fusion_warnings(0).build();
    let t = cpu_thresholds(&rt);
    let n = t.min_items as usize;
    let bytes = 2 * 4 * n as u64;
    assert!(t.min_items <= n as u64 && bytes < t.min_global_bytes, "{t:?}: the case this test checks");
    let q = rt.queue();
    let bufs: Vec<Buffer<u32>> = (0..3).map(|_| rt.buffer_zeroed(n)).collect();
    for private in [false, true] {
        q.start_fusion().unwrap();
        step(&q, &bufs[0], &bufs[1], (false, private));
        step(&q, &bufs[1], &bufs[2], (private, false));
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        match (private, q.fusion_outcome()) {
            (true, Some(FusionOutcome::Fused { kernels: 2, .. })) => {}
            (false, _) => {
                assert_eq!(refusal(&q), Unprofitable::CacheResident { bytes, min_bytes: t.min_global_bytes })
            }
            (_, other) => panic!("private intermediates: {other:?}"),
        }
        assert_eq!(bufs[2].to_vec().unwrap(), vec![3; n]);
    }
}

/// Kernels of a window that do not depend on each other: its event completes after
/// all of them (the first, slow one included, which runs beside the others on a
/// worker thread), and a command depending on it sees every result.
#[test]
fn the_event_of_a_window_of_independent_kernels_waits_for_every_kernel() {
    let workers = CpuConfig { worker_threads: 3, inline_items: 0, ..CpuConfig::default() };
    let rt = Runtime::builder().cpu(workers).fusion_warnings(0).build();
    let q = rt.queue();
    let n = 64;
    let outs: Vec<Buffer<u32>> = (0..3).map(|_| rt.buffer_zeroed(n)).collect();
    q.start_fusion().unwrap();
    let events: Vec<Event> = outs
        .iter()
        .enumerate()
        .map(|(k, out)| {
            q.submit(|cg| {
                let o = cg.elements_out(out);
                cg.parallel_for(n, move |it| {
                    if k == 0 && it.global_linear_id() == 0 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    *o.elem(it) = k as u32 + 1;
                });
            })
            .unwrap()
        })
        .collect();
    let done = q.complete_fusion(FusionProps::default()).unwrap();
    assert!(matches!(refusal(&q), Unprofitable::LaunchBound { .. }));
    let sum = rt.buffer_zeroed::<u32>(1);
    q.submit(|cg| {
        cg.depends_on(&done);
        let (a, b, c) = (cg.read(&outs[0]), cg.read(&outs[1]), cg.read(&outs[2]));
        let s = cg.read_write(&sum);
        cg.single_task(move |it| s.set(it, 0, a.get(it, 5) + b.get(it, 5) + c.get(it, 5)));
    })
    .unwrap();
    done.wait().unwrap();
    for e in &events {
        assert_eq!(e.status(), EventStatus::Complete);
    }
    assert_eq!(sum.to_vec().unwrap(), vec![6]);
    // A second `complete_fusion` warns, and returns an event for the same kernels.
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
}

/// A kernel of the window that fails fails the window's event, in a chain and among
/// independent kernels; the runtime keeps running.
#[test]
fn a_failed_kernel_fails_the_window_event() {
    for rt in runtimes() {
        for chain in [true, false] {
            let q = rt.queue();
            let n = 64;
            let (a, b) = (rt.buffer(&vec![1u32; n]), rt.buffer_zeroed::<u32>(n));
            let c = rt.buffer_zeroed::<u32>(n);
            q.start_fusion().unwrap();
            q.submit(|cg| {
                let o = cg.elements_mut(&a);
                cg.parallel_for(n, move |it| {
                    if it.global_linear_id() == 3 {
                        panic!("kernel exploded");
                    }
                    *o.elem(it) += 1;
                });
            })
            .unwrap();
            let source = if chain { &a } else { &c };
            let last = step(&q, source, &b, (false, false));
            let done = q.complete_fusion(FusionProps::default()).unwrap();
            let err = done.wait().expect_err("the window's event fails with its kernel");
            assert!(err.to_string().contains("kernel exploded"), "{err}");
            let last_status = last.wait().map(|()| EventStatus::Complete).unwrap_or(EventStatus::Failed);
            assert_eq!(last_status, if chain { EventStatus::Failed } else { EventStatus::Complete });
            assert!(matches!(refusal(&q), Unprofitable::LaunchBound { .. }));
            let _ = q.wait();
            step(&q, &c, &b, (false, false)).wait().unwrap();
        }
    }
}

/// `cancel_fusion` and a wait on the queue end a window that passes its kernels
/// through (its outcome stays the reason); `complete_fusion` after a cancellation
/// still returns an event that waits for the window's kernels.
#[test]
fn cancelling_or_waiting_ends_a_passing_window() {
    for rt in runtimes() {
        let q = rt.queue();
        let n = 64;
        let (a, b) = (rt.buffer(&vec![2u32; n]), rt.buffer_zeroed::<u32>(n));
        q.start_fusion().unwrap();
        step(&q, &a, &b, (false, false));
        assert!(matches!(q.start_fusion(), Err(gantry::Error::AlreadyFusing(_))));
        q.cancel_fusion();
        assert!(!q.is_in_fusion_mode());
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![5; n]);
        assert!(matches!(refusal(&q), Unprofitable::LaunchBound { .. }));

        q.start_fusion().unwrap();
        step(&q, &b, &a, (false, false));
        q.wait().unwrap();
        assert!(!q.is_in_fusion_mode());
        assert_eq!(a.to_vec().unwrap(), vec![11; n]);
    }
}

/// `fusion_window(WindowThresholds::ALWAYS)` and `fuse_unprofitable` fuse every
/// window, whatever its size; the device still reports its own thresholds. An explicit
/// `fusion_window` holds with `fuse_unprofitable` too.
#[test]
fn every_window_fuses_when_the_runtime_says_so() {
    let never = WindowThresholds { min_items: u64::MAX, min_global_bytes: 0 };
    let rt = Runtime::builder().fuse_unprofitable(true).fusion_window(never).mode(Mode::Manual).build();
    let q = rt.queue();
    let bufs: Vec<Buffer<u32>> = (0..3).map(|_| rt.buffer_zeroed(1 << 16)).collect();
    q.start_fusion().unwrap();
    step(&q, &bufs[0], &bufs[1], (false, true));
    step(&q, &bufs[1], &bufs[2], (true, false));
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert!(matches!(refusal(&q), Unprofitable::LaunchBound { items: 65_536, min_items: u64::MAX }));

    let builders = [
        Runtime::builder().fusion_window(WindowThresholds::ALWAYS),
        Runtime::builder().fuse_unprofitable(true),
    ];
    for builder in builders {
        let rt = builder.mode(Mode::Manual).worker_threads(0).fusion_warnings(0).build();
        assert_ne!(cpu_thresholds(&rt), WindowThresholds::ALWAYS);
        let q = rt.queue();
        let bufs: Vec<Buffer<u32>> = (0..3).map(|_| rt.buffer_zeroed(64)).collect();
        q.start_fusion().unwrap();
        step(&q, &bufs[0], &bufs[1], (false, true));
        step(&q, &bufs[1], &bufs[2], (true, false));
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
        assert_eq!(bufs[2].to_vec().unwrap(), vec![3; 64]);
    }
}
