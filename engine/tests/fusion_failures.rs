//! A kernel that fails inside a fusion (a queue's fusion window, or a graph's fused
//! chain) keeps exactly the results the same kernels would have kept unfused: its
//! dependents do not run, independent kernels keep their writes. Fusion never changes
//! which results survive a failure.
//!
//! The runtimes fuse every form the compiler accepts
//! ([`fuse_unprofitable`](gantry::RuntimeBuilder::fuse_unprofitable)): the failure
//! semantics are the fused kernel's whatever its speed.

mod common;

use gantry::{
    Buffer, Error, Event, ExecError, FusionOutcome, FusionProps, GraphProps, Mode, NdRange, Promotion, Queue,
    QueueOptions, Runtime,
};

fn quiet_panics() {
    common::quiet_panics(|msg| msg.starts_with("kernel exploded"));
}

/// Elements per buffer: several work-groups, so the threaded CPU driver runs the
/// kernels on its pool.
const N: usize = 5000;

/// How a test builds its runtime, and the device its queues use.
#[derive(Clone, Copy, Debug)]
enum Setup {
    /// CPU driver with worker threads, threaded scheduler.
    Threaded,
    /// CPU driver inline, manual scheduler.
    Inline,
    /// Simulated device 1, manual scheduler.
    Sim,
}

const SETUPS: [Setup; 3] = [Setup::Threaded, Setup::Inline, Setup::Sim];

impl Setup {
    fn runtime(self) -> Runtime {
        let b = Runtime::builder().fusion_warnings(0).fuse_unprofitable(true);
        match self {
            Setup::Threaded => b.mode(Mode::Threaded).worker_threads(2).build(),
            Setup::Inline => b.mode(Mode::Manual).worker_threads(0).build(),
            Setup::Sim => b.mode(Mode::Manual).sim(gantry::SimConfig::default()).build(),
        }
    }

    fn device(self) -> u32 {
        match self {
            Setup::Sim => 1,
            _ => 0,
        }
    }
}

/// `buf[i] += add` for every element; with `fail`, panics after the last element's
/// write (so its writes must be undone).
fn add(q: &Queue, name: &str, buf: &Buffer<u32>, add: u32, fail: bool) -> Event {
    q.submit(|cg| {
        cg.name(name);
        let b = cg.elements_mut(buf);
        cg.parallel_for(buf.len(), move |it| {
            *b.elem(it) += add;
            if fail && it.global_linear_id() == N - 1 {
                panic!("kernel exploded");
            }
        });
    })
    .unwrap()
}

/// `dst[i] = src[i] + add`.
fn add_from(
    q: &Queue,
    name: &str,
    src: &Buffer<u32>,
    dst: &Buffer<u32>,
    add: u32,
    after: &[&Event],
) -> Event {
    q.submit(|cg| {
        cg.name(name);
        for e in after {
            cg.depends_on(e);
        }
        let s = cg.read(src);
        let d = cg.elements_mut(dst);
        cg.parallel_for(dst.len(), move |it| *d.elem(it) = s.get(it, it.global_linear_id()) + add);
    })
    .unwrap()
}

/// The first element of each buffer (every element of one buffer is equal).
fn firsts(bufs: &[&Buffer<u32>]) -> Vec<u32> {
    bufs.iter()
        .map(|b| {
            let v = b.to_vec().unwrap();
            assert!(v.iter().all(|&x| x == v[0]), "one value per buffer");
            v[0]
        })
        .collect()
}

/// x += 10, y += 1 then panics, z += 100, on three buffers holding 1, 2 and 3; then
/// d = y + 1000 (depends on the failed kernel by a buffer), e = e + 7 waiting for the
/// event `submit` returned for y (while fusing: the fusion's, standing for x and y).
/// Returns the buffers' values (x, y, z, d, e) and whether the window's event failed.
fn window(setup: Setup, in_order: bool, fused: bool) -> (Vec<u32>, bool) {
    let rt = setup.runtime();
    let q = rt.queue_with(QueueOptions { device: setup.device(), in_order }).unwrap();
    let bufs: Vec<Buffer<u32>> = (1..=5u32).map(|v| rt.buffer(&vec![v; N])).collect();
    let [x, y, z, d, e] = [&bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4]];
    if fused {
        q.start_fusion().unwrap();
    }
    add(&q, "x", x, 10, false);
    let after_y = add(&q, "y", y, 1, true);
    add(&q, "z", z, 100, false);
    add_from(&q, "d", y, d, 1000, &[]);
    add(&q, "e", e, 7, false);
    let waits_on_y = q.submit(|cg| {
        cg.name("e2");
        cg.depends_on(&after_y);
        let b = cg.elements_mut(e);
        cg.parallel_for(N, move |it| *b.elem(it) += 7);
    });
    waits_on_y.unwrap();
    let failed = if fused {
        let ev = q.complete_fusion(FusionProps::default()).unwrap();
        let failed = ev.wait().is_err();
        assert!(
            matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 6, .. })),
            "{setup:?} in_order={in_order}: {:?}",
            q.fusion_outcome()
        );
        failed
    } else {
        q.wait().is_err()
    };
    rt.wait_idle().unwrap();
    (firsts(&[x, y, z, d, e]), failed)
}

/// A panicking kernel in a queue's fusion window keeps the independent kernels'
/// writes and skips its dependents, as unfused: on an out-of-order queue x and z
/// (and e, before the wait on y's event) keep theirs; on an in-order queue every
/// kernel after y depends on it by queue order. The window's event fails.
#[test]
fn a_failing_kernel_in_a_fusion_window_keeps_what_unfused_would() {
    quiet_panics();
    for setup in SETUPS {
        for in_order in [false, true] {
            let unfused = window(setup, in_order, false);
            let fused = window(setup, in_order, true);
            let want = if in_order { vec![11, 2, 3, 4, 5] } else { vec![11, 2, 103, 4, 12] };
            assert_eq!(unfused, (want.clone(), true), "{setup:?} in_order={in_order}: unfused");
            assert_eq!(fused, (want, true), "{setup:?} in_order={in_order}: fused");
        }
    }
}

/// The window's event reports the failed kernel's own error.
#[test]
fn a_failed_fusion_reports_the_failing_kernel() {
    quiet_panics();
    for setup in SETUPS {
        let rt = setup.runtime();
        let q = rt.queue_with(QueueOptions { device: setup.device(), in_order: false }).unwrap();
        let (a, b) = (rt.buffer(&vec![1u32; N]), rt.buffer(&vec![2u32; N]));
        q.start_fusion().unwrap();
        add(&q, "fine", &a, 1, false);
        add(&q, "bad", &b, 1, true);
        let err = q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap_err();
        match err {
            Error::Exec(ExecError::KernelPanicked { kernel, message }) => {
                assert_eq!((&*kernel, &*message), ("bad", "kernel exploded"), "{setup:?}");
            }
            e => panic!("{setup:?}: {e:?}"),
        }
        assert_eq!(firsts(&[&a, &b]), vec![2, 2], "{setup:?}");
    }
}

/// Without `preserve_on_failure` nothing is snapshotted, so nothing can run again:
/// a failed fused kernel leaves its ranges unspecified, as any failed kernel does,
/// and the runtime keeps going.
#[test]
fn without_preserve_on_failure_a_failed_fusion_just_fails() {
    quiet_panics();
    let rt = Runtime::builder()
        .fuse_unprofitable(true)
        .mode(Mode::Manual)
        .worker_threads(0)
        .preserve_on_failure(false)
        .build();
    let q = rt.queue();
    let (a, b) = (rt.buffer(&vec![1u32; N]), rt.buffer(&vec![2u32; N]));
    q.start_fusion().unwrap();
    add(&q, "fine", &a, 1, false);
    add(&q, "bad", &b, 1, true);
    assert!(q.complete_fusion(FusionProps::default()).unwrap().wait().is_err());
    q.submit(|cg| cg.fill(&a, 9)).unwrap().wait().unwrap();
    assert_eq!(firsts(&[&a]), vec![9]);
}

/// A graph of three kernels on buffers a, b, c (1, 2, 3): k1 a += 10, k2 b = a + 100
/// (depends on k1), k3 c += 1000 (independent); `fail` names the kernel that panics
/// after writing. Returns the buffers' values and whether the replay failed.
fn chain(setup: Setup, fused: bool, fail: usize) -> (Vec<u32>, bool) {
    let rt = setup.runtime();
    let bufs: Vec<Buffer<u32>> = (1..=3u32).map(|v| rt.buffer(&vec![v; N])).collect();
    let [a, b, c] = [&bufs[0], &bufs[1], &bufs[2]];
    let graph = rt.graph_on(setup.device());
    let k1 = graph
        .add(
            |cg| {
                let x = cg.elements_mut(a);
                cg.parallel_for(N, move |it| {
                    *x.elem(it) += 10;
                    if fail == 1 && it.global_linear_id() == N - 1 {
                        panic!("kernel exploded");
                    }
                });
            },
            &[],
        )
        .unwrap();
    graph
        .add(
            |cg| {
                let x = cg.read(a);
                let y = cg.elements_mut(b);
                cg.parallel_for(N, move |it| {
                    *y.elem(it) = x.get(it, it.global_linear_id()) + 100;
                    if fail == 2 && it.global_linear_id() == N - 1 {
                        panic!("kernel exploded");
                    }
                });
            },
            &[k1],
        )
        .unwrap();
    graph
        .add(
            |cg| {
                let z = cg.elements_mut(c);
                cg.parallel_for(N, move |it| {
                    *z.elem(it) += 1000;
                    if fail == 3 && it.global_linear_id() == N - 1 {
                        panic!("kernel exploded");
                    }
                });
            },
            &[],
        )
        .unwrap();
    let props = if fused { GraphProps::default().fused() } else { GraphProps::default() };
    let exec = graph.finalize(props).unwrap();
    if fused {
        assert_eq!(exec.fused_chains().len(), 1, "{setup:?}: one fused chain");
    }
    let q = rt.queue_with(QueueOptions { device: setup.device(), in_order: false }).unwrap();
    let failed = q.submit_graph(&exec).unwrap().wait().is_err();
    rt.wait_idle().unwrap();
    (firsts(&[a, b, c]), failed)
}

/// In a fused graph chain, a later kernel's failure keeps an earlier kernel's
/// writes, and an earlier kernel's failure skips its dependents only, as unfused.
#[test]
fn a_failing_kernel_in_a_fused_graph_chain_keeps_what_unfused_would() {
    quiet_panics();
    for setup in SETUPS {
        for (fail, want) in [(1, [1, 2, 1003]), (2, [11, 2, 1003]), (3, [11, 111, 3])] {
            let unfused = chain(setup, false, fail);
            let fused = chain(setup, true, fail);
            assert_eq!(unfused, (want.to_vec(), true), "{setup:?}: kernel {fail} fails, unfused");
            assert_eq!(fused, (want.to_vec(), true), "{setup:?}: kernel {fail} fails, fused");
        }
    }
}

/// Internalized buffers have no global memory: when a fused chain through one fails,
/// its kernels run again on memory of the buffer's size, still not written back. A
/// producer of `tmp` (`tmp = x * 2`, internalized), its consumer (`out = tmp + 1`)
/// and an independent kernel (`side += 1`); `fail` names the one that panics.
#[test]
fn a_failing_kernel_beside_an_internalized_chain_keeps_what_unfused_would() {
    quiet_panics();
    let n = 4096;
    for setup in SETUPS {
        for promotion in [Promotion::Private, Promotion::Local] {
            for fail in 1..=3 {
                let rt = setup.runtime();
                let q = rt.queue_with(QueueOptions { device: setup.device(), in_order: false }).unwrap();
                let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
                let (tmp, out, side) =
                    (rt.buffer(&vec![7u32; n]), rt.buffer(&vec![5u32; n]), rt.buffer(&vec![9u32; n]));
                let nd = NdRange::new(n, 64);
                let last = move |it: &gantry::Item<'_>, k| {
                    if fail == k && it.global_linear_id() == n - 1 {
                        panic!("kernel exploded");
                    }
                };
                q.start_fusion().unwrap();
                q.submit(|cg| {
                    let (x, t) = (cg.read(&x), cg.write(&tmp));
                    cg.promote(&t, promotion);
                    cg.parallel_for_nd(nd, move |it| {
                        t.set(it, it.global_linear_id(), x.get(it, it.global_linear_id()) * 2);
                        last(it, 1);
                    });
                })
                .unwrap();
                q.submit(|cg| {
                    let (t, o) = (cg.read(&tmp), cg.write(&out));
                    cg.promote(&t, promotion);
                    cg.parallel_for_nd(nd, move |it| {
                        o.set(it, it.global_linear_id(), t.get(it, it.global_linear_id()) + 1);
                        last(it, 2);
                    });
                })
                .unwrap();
                q.submit(|cg| {
                    let s = cg.elements_mut(&side);
                    cg.parallel_for_nd(nd, move |it| {
                        *s.elem(it) += 1;
                        last(it, 3);
                    });
                })
                .unwrap();
                let failed = q.complete_fusion(FusionProps::default()).unwrap().wait().is_err();
                let label = format!("{setup:?} {promotion:?}: kernel {fail} fails");
                assert!(failed, "{label}");
                assert!(
                    matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 3, ref warnings, .. }) if warnings.is_empty()),
                    "{label}: {:?}",
                    q.fusion_outcome()
                );
                let computed: Vec<u32> = (0..n as u32).map(|v| v * 2 + 1).collect();
                let want_out = if fail == 3 { computed } else { vec![5; n] };
                assert_eq!(out.to_vec().unwrap(), want_out, "{label}");
                assert_eq!(side.to_vec().unwrap(), vec![if fail == 3 { 9 } else { 10 }; n], "{label}");
                assert_eq!(tmp.to_vec().unwrap(), vec![7; n], "{label}: internalized, not written back");
            }
        }
    }
}

/// An output written whole without its contents (`elements_out`) into memory that
/// holds no valid copy (on the simulated device: the buffer's only copy is on the
/// host) is valid only once its kernel has run. When the fused kernel fails, the
/// output a kernel that still ran wrote stays valid, as unfused, and later work on
/// the device reads it; the output of the kernel that failed keeps its last valid
/// contents.
#[test]
fn a_discarded_output_written_before_a_failure_stays_valid() {
    quiet_panics();
    for setup in SETUPS {
        for failing in [0, 1] {
            let rt = setup.runtime();
            let q = rt.queue_with(QueueOptions { device: setup.device(), in_order: false }).unwrap();
            let input = rt.buffer(&vec![40u32; N]);
            let outs = [rt.buffer(&vec![5u32; N]), rt.buffer(&vec![6u32; N])];
            q.start_fusion().unwrap();
            for (k, out) in outs.iter().enumerate() {
                q.submit(|cg| {
                    let (i, o) = (cg.read(&input), cg.elements_out(out));
                    cg.parallel_for(N, move |it| {
                        *o.elem(it) = i.get(it, it.global_linear_id()) + k as u32;
                        if k == failing && it.global_linear_id() == N - 1 {
                            panic!("kernel exploded");
                        }
                    });
                })
                .unwrap();
            }
            assert!(q.complete_fusion(FusionProps::default()).unwrap().wait().is_err());
            // Later work on the device starts from the outputs' valid copies.
            for out in &outs {
                add(&q, "after", out, 100, false).wait().unwrap();
            }
            let want = |k: usize| if k == failing { [105, 106][k] } else { 140 + k as u32 };
            assert_eq!(
                firsts(&[&outs[0], &outs[1]]),
                vec![want(0), want(1)],
                "{setup:?}: kernel {failing} fails"
            );
        }
    }
}
