//! Queue-level kernel fusion (the DPC++ kernel-fusion design) on real data: completion,
//! cancellation and every early-cancellation rule, event semantics, barriers,
//! internalization, ND-range remapping and the illegal combinations, the plan cache.

use gantry::{
    Buffer, CancelReason, Error, Event, EventStatus, FusionError, FusionOutcome, FusionProps, Mode, NdRange,
    Promotion, Queue, Range, Runtime, WindowThresholds,
};

/// A manual runtime whose fusion windows fuse whatever their size: these tests fuse
/// chains of a few dozen work-items, whose windows the CPU driver would otherwise run
/// unfused (`window_*` tests cover that).
fn manual() -> Runtime {
    Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .timeline(true)
        .fusion_warnings(0)
        .fusion_window(WindowThresholds::ALWAYS)
        .build()
}

/// [`manual`], fusing the forms measured slower fused (the fused semantics they
/// test are the same).
fn manual_fusing_all() -> Runtime {
    Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .timeline(true)
        .fusion_warnings(0)
        .fuse_unprofitable(true)
        .build()
}

/// `buf[i] = buf[i] * mul + add` over all of `buf`.
fn affine(q: &Queue, buf: &Buffer<u32>, mul: u32, add: u32) -> Event {
    q.submit(|cg| {
        let b = cg.elements_mut(buf);
        cg.parallel_for(buf.len(), move |it| *b.elem(it) = *b.elem(it) * mul + add);
    })
    .unwrap()
}

fn serial(v: &[u32], steps: &[(u32, u32)]) -> Vec<u32> {
    v.iter().map(|&x| steps.iter().fold(x, |x, &(m, a)| x * m + a)).collect()
}

/// Names of the kernels that ran, in order of completion.
fn kernels_run(rt: &Runtime) -> Vec<String> {
    let t = rt.timeline().unwrap();
    t.slices.iter().filter(|s| s.kind.name() == "kernel").map(|s| s.name.to_string()).collect()
}

fn cancelled(q: &Queue) -> CancelReason {
    match q.fusion_outcome() {
        Some(FusionOutcome::Cancelled(r)) => r,
        other => panic!("expected a cancelled fusion, got {other:?}"),
    }
}

#[test]
fn completed_fusion_runs_one_kernel_with_the_serial_result() {
    let rt = manual();
    let q = rt.queue();
    let data: Vec<u32> = (0..1000).collect();
    let (a, b) = (rt.buffer(&data), rt.buffer(&data));
    q.start_fusion().unwrap();
    assert!(q.is_in_fusion_mode());
    affine(&q, &a, 3, 1);
    affine(&q, &b, 5, 0);
    affine(&q, &a, 2, 7);
    let done = q.complete_fusion(FusionProps::default()).unwrap();
    assert!(!q.is_in_fusion_mode());
    done.wait().unwrap();
    assert_eq!(a.to_vec().unwrap(), serial(&data, &[(3, 1), (2, 7)]));
    assert_eq!(b.to_vec().unwrap(), serial(&data, &[(5, 0)]));
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 3, .. })));
    assert_eq!(kernels_run(&rt), vec!["fused(parallel_for+parallel_for+parallel_for)".to_string()]);
    rt.wait_idle().unwrap();
    assert_eq!(rt.stats().live_commands, 0);
}

#[test]
fn cancel_fusion_runs_the_kernels_unfused_in_order() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 64]);
    q.start_fusion().unwrap();
    affine(&q, &a, 2, 0);
    affine(&q, &a, 1, 3);
    q.cancel_fusion();
    assert!(!q.is_in_fusion_mode());
    assert_eq!(cancelled(&q), CancelReason::Requested);
    // complete_fusion after a cancellation still returns a valid, completing event.
    let ev = q.complete_fusion(FusionProps::default()).unwrap();
    ev.wait().unwrap();
    assert_eq!(a.to_vec().unwrap(), vec![5; 64]);
    assert_eq!(kernels_run(&rt).len(), 2);
    // Cancelling outside fusion mode only warns.
    q.cancel_fusion();
}

/// Fusion after fusion on one queue (its list is reset for each): a fused round runs
/// one command, the fused kernel, whose event is the one `submit` returned while
/// fusing; a cancelled round runs its kernels and then the fusion command. The
/// runtime counts both kinds of endings.
#[test]
fn fusions_in_a_row_are_counted_and_a_fused_one_is_one_command() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 64]);
    let fusion_commands =
        |rt: &Runtime| rt.timeline().unwrap().slices.iter().filter(|s| s.kind.name() == "fusion").count();
    let mut want = vec![1u32; 64];
    for (round, cancel) in [false, true, false, false].into_iter().enumerate() {
        q.start_fusion().unwrap();
        let listed = affine(&q, &a, 2, 1);
        affine(&q, &a, 3, 0);
        if cancel {
            q.cancel_fusion();
        }
        let done = q.complete_fusion(FusionProps::default()).unwrap();
        done.wait().unwrap();
        listed.wait().unwrap();
        want = serial(&want, &[(2, 1), (3, 0)]);
        assert_eq!(a.to_vec().unwrap(), want, "round {round}");
    }
    let stats = rt.stats();
    assert_eq!((stats.fusions_fused, stats.fusions_cancelled), (3, 1));
    let run = kernels_run(&rt);
    assert_eq!(run.iter().filter(|k| k.starts_with("fused(")).count(), 3);
    assert_eq!(run.len(), 3 + 2, "three fused kernels and the cancelled round's two");
    assert_eq!(fusion_commands(&rt), 1, "only the cancelled round has a fusion command of its own");
    rt.wait_idle().unwrap();
    assert_eq!(rt.stats().live_commands, 0);
}

/// `start_fusion` sends no message: the scheduler starts the list with the first
/// message about the fusion, whichever it is (a kernel, the completion, or a
/// cancellation before any kernel), and each of those ends as it should.
#[test]
fn a_fusion_starts_with_its_first_message() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 64]);
    let messages = |rt: &Runtime| rt.stats().messages;
    rt.wait_idle().unwrap();
    let before = messages(&rt);
    q.start_fusion().unwrap();
    rt.wait_idle().unwrap();
    assert_eq!(messages(&rt), before, "start_fusion sent a message");
    affine(&q, &a, 2, 1);
    affine(&q, &a, 3, 0);
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert_eq!(messages(&rt) - before, 3, "two kernels and the completion");
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
    assert_eq!(a.to_vec().unwrap(), serial(&[1; 64], &[(2, 1), (3, 0)]));

    // Cancelled before any kernel: the cancellation starts (and ends) the list, and
    // `complete_fusion` still returns an event that completes.
    q.start_fusion().unwrap();
    q.cancel_fusion();
    assert_eq!(cancelled(&q), CancelReason::Requested);
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    // Completed with no kernel: the completion starts the list, which warns it is empty.
    q.start_fusion().unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert_eq!(cancelled(&q), CancelReason::Empty);
    rt.wait_idle().unwrap();
    assert_eq!(rt.stats().live_commands, 0);
}

#[test]
fn misuse_is_a_typed_error() {
    let rt = manual();
    let q = rt.queue();
    assert!(matches!(q.complete_fusion(FusionProps::default()), Err(Error::NotFusing(_))));
    q.start_fusion().unwrap();
    assert!(matches!(q.start_fusion(), Err(Error::AlreadyFusing(_))));
    let ev = q.complete_fusion(FusionProps::default()).unwrap();
    ev.wait().unwrap();
    assert_eq!(cancelled(&q), CancelReason::Empty, "an empty list warns and completes");
    // A new fusion may start once the last one ended.
    q.start_fusion().unwrap();
    q.cancel_fusion();
}

/// Every kernel submitted in fusion mode returns the one fusion event; it completes
/// after the fused kernel, as does the event `complete_fusion` returns.
#[test]
fn events_in_fusion_mode() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 16]);
    q.start_fusion().unwrap();
    let e1 = affine(&q, &a, 2, 0);
    let e2 = affine(&q, &a, 2, 0);
    assert_eq!(e1.name(), "fusion");
    assert_eq!(e2.name(), "fusion");
    assert_eq!(e1.status(), EventStatus::Pending);
    rt.flush();
    rt.flush();
    assert_eq!(e1.status(), EventStatus::Pending, "held while the queue is fusing");
    assert!(a.to_vec().is_ok());
    // The host access cancelled the fusion (it depends on the listed kernels).
    assert!(matches!(cancelled(&q), CancelReason::Dependent { kind: "host_access", .. }));
    assert_eq!(e2.status(), EventStatus::Complete);
    assert_eq!(a.to_vec().unwrap(), vec![4; 16]);

    q.start_fusion().unwrap();
    let during = affine(&q, &a, 2, 0);
    let done = q.complete_fusion(FusionProps::default()).unwrap();
    done.wait().unwrap();
    assert_eq!(during.status(), EventStatus::Complete);
    let t = done.timestamps().expect("a runtime with a timeline profiles");
    assert!(t.ended_ns >= t.started_ns);
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 1, .. })));
}

#[test]
fn early_cancellation_on_host_waits() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 32]);
    q.start_fusion().unwrap();
    let ev = affine(&q, &a, 3, 0);
    ev.wait().unwrap();
    assert_eq!(cancelled(&q), CancelReason::HostWait);
    assert_eq!(a.to_vec().unwrap(), vec![3; 32]);

    q.start_fusion().unwrap();
    affine(&q, &a, 3, 0);
    q.wait().unwrap();
    assert_eq!(cancelled(&q), CancelReason::QueueWait);
    assert_eq!(a.to_vec().unwrap(), vec![9; 32]);
}

/// A command that is not fused and depends on a listed kernel cancels the fusion:
/// host tasks, copies, fills and barriers on the fusing queue, and commands on other
/// queues (by buffer or by event). Each gets the serial result.
#[test]
fn dependents_cancel_fusion_and_see_the_kernels_results() {
    type Dependent = fn(&Runtime, &Queue, &Queue, &Buffer<u32>, &Buffer<u32>, &Event);
    let cases: [(&str, Dependent); 6] = [
        ("host_task", |_, q, _, a, out, _| {
            q.submit(|cg| {
                let (x, mut o) = (cg.host_read(a), cg.host_discard_write(out));
                cg.host_task(move |ctx| o.as_mut_slice(ctx).copy_from_slice(x.as_slice(ctx)));
            })
            .unwrap();
        }),
        ("copy", |_, q, _, a, out, _| {
            q.submit(|cg| cg.copy(a, out)).unwrap();
        }),
        ("fill", |_, q, _, a, _, _| {
            q.submit(|cg| cg.fill_range(a, 0..4, 0)).unwrap();
        }),
        ("barrier", |_, q, _, _, _, _| {
            q.barrier().unwrap();
        }),
        ("kernel", |_, _, other, a, out, _| {
            other
                .submit(|cg| {
                    let (x, o) = (cg.read(a), cg.elements_out(out));
                    cg.parallel_for(out.len(), move |it| *o.elem(it) = x.get(it, it.global_linear_id()));
                })
                .unwrap();
        }),
        ("kernel", |_, _, other, _, out, ev| {
            // By event only: the fusion event stands for the listed kernels.
            other
                .submit(|cg| {
                    cg.depends_on(ev);
                    let o = cg.elements_out(out);
                    cg.parallel_for(out.len(), move |it| *o.elem(it) = 77);
                })
                .unwrap();
        }),
    ];
    for (kind, dependent) in cases {
        let rt = manual();
        let (q, other) = (rt.queue(), rt.queue());
        let (a, out) = (rt.buffer(&[2u32; 8]), rt.buffer_zeroed::<u32>(8));
        q.start_fusion().unwrap();
        let ev = affine(&q, &a, 5, 0);
        dependent(&rt, &q, &other, &a, &out, &ev);
        rt.wait_idle().unwrap();
        match cancelled(&q) {
            CancelReason::Dependent { kind: k, .. } => assert_eq!(k, kind),
            r => panic!("{kind}: cancelled for {r}"),
        }
        let got = a.to_vec().unwrap();
        assert!(got[4..].iter().all(|&x| x == 10), "{kind}: {got:?}");
        let out = out.to_vec().unwrap();
        match kind {
            "host_task" | "copy" => assert_eq!(out, vec![10; 8], "{kind}"),
            "fill" => assert_eq!(&got[..4], &[0; 4]),
            _ => {}
        }
        rt.wait_idle().unwrap();
        assert_eq!(rt.stats().live_commands, 0, "{kind}");
    }
}

/// Copies, fills and host tasks on a fusing queue that do not depend on a listed
/// kernel run on their own; the kernels are still fused.
#[test]
fn independent_commands_on_a_fusing_queue_do_not_cancel() {
    let rt = manual();
    let q = rt.queue();
    let (a, b, c) = (rt.buffer(&[1u32; 8]), rt.buffer(&[0u32; 8]), rt.buffer(&[4u32; 8]));
    q.start_fusion().unwrap();
    affine(&q, &a, 2, 0);
    q.submit(|cg| cg.fill(&b, 9)).unwrap();
    q.submit(|cg| cg.copy(&c, &b)).unwrap();
    affine(&q, &a, 2, 0);
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
    assert_eq!(a.to_vec().unwrap(), vec![4; 8]);
    assert_eq!(b.to_vec().unwrap(), vec![4; 8]);
}

/// Commands submitted after `complete_fusion` wait for the fused kernel; they do not
/// cancel it, even when ingested in the same flush.
#[test]
fn commands_after_completion_depend_on_the_fused_kernel() {
    let rt = manual();
    let q = rt.in_order_queue();
    let other = rt.queue();
    let a = rt.buffer(&[1u32; 8]);
    let out = rt.buffer_zeroed::<u32>(8);
    q.start_fusion().unwrap();
    affine(&q, &a, 3, 0);
    affine(&q, &a, 3, 0);
    q.complete_fusion(FusionProps::default()).unwrap();
    affine(&q, &a, 1, 1); // in order after the fused kernel
    other.submit(|cg| cg.copy(&a, &out)).unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![10; 8]);
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
}

#[test]
fn dropping_a_buffer_or_the_queue_cancels() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 8]);
    let keep = rt.buffer(&[0u32; 8]);
    q.start_fusion().unwrap();
    affine(&q, &a, 2, 0);
    q.submit(|cg| {
        let (x, o) = (cg.read(&a), cg.elements_out(&keep));
        cg.parallel_for(8, move |it| *o.elem(it) = x.get(it, it.global_linear_id()) + 1);
    })
    .unwrap();
    drop(a);
    rt.flush();
    assert!(matches!(cancelled(&q), CancelReason::BufferDropped { .. }));
    assert_eq!(keep.to_vec().unwrap(), vec![3; 8]);

    let q2 = rt.queue();
    q2.start_fusion().unwrap();
    let ev = affine(&q2, &keep, 2, 0);
    drop(q2);
    rt.wait_idle().unwrap();
    assert_eq!(ev.status(), EventStatus::Complete, "the kernels ran unfused");
    assert_eq!(keep.to_vec().unwrap(), vec![6; 8]);
    assert_eq!(kernels_run(&rt).iter().filter(|n| n.starts_with("fused")).count(), 0);
}

/// Two fusing queues whose kernels depend on each other both ways: fusing both would
/// form a cycle, so one is cancelled (and names the other); results are serial.
#[test]
fn fusing_queues_depending_on_each_other_both_ways() {
    let rt = manual();
    let (qa, qb) = (rt.queue(), rt.queue());
    let (x, y) = (rt.buffer(&[1u32; 8]), rt.buffer(&[2u32; 8]));
    qa.start_fusion().unwrap();
    qb.start_fusion().unwrap();
    affine(&qa, &x, 2, 0); // x = 2
    qb.submit(|cg| {
        // y += x: B depends on A
        let (xs, ys) = (cg.read(&x), cg.elements_mut(&y));
        cg.parallel_for(8, move |it| *ys.elem(it) += xs.get(it, it.global_linear_id()));
    })
    .unwrap();
    qa.submit(|cg| {
        // x += y: A depends on B
        let (ys, xs) = (cg.read(&y), cg.elements_mut(&x));
        cg.parallel_for(8, move |it| *xs.elem(it) += ys.get(it, it.global_linear_id()));
    })
    .unwrap();
    let (ea, eb) = (
        qa.complete_fusion(FusionProps::default()).unwrap(),
        qb.complete_fusion(FusionProps::default()).unwrap(),
    );
    ea.wait().unwrap();
    eb.wait().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![4; 8]);
    assert_eq!(x.to_vec().unwrap(), vec![6; 8]);
    let reasons = [qa.fusion_outcome(), qb.fusion_outcome()];
    assert!(
        reasons.iter().any(|r| matches!(r, Some(FusionOutcome::Cancelled(CancelReason::Cycle { .. })))),
        "{reasons:?}"
    );
}

/// One direction only: both fuse.
#[test]
fn fusing_queues_depending_one_way_both_fuse() {
    let rt = manual();
    let (qa, qb) = (rt.queue(), rt.queue());
    let (x, y) = (rt.buffer(&[1u32; 8]), rt.buffer(&[2u32; 8]));
    qa.start_fusion().unwrap();
    qb.start_fusion().unwrap();
    affine(&qa, &x, 2, 0);
    qb.submit(|cg| {
        let (xs, ys) = (cg.read(&x), cg.elements_mut(&y));
        cg.parallel_for(8, move |it| *ys.elem(it) += xs.get(it, it.global_linear_id()));
    })
    .unwrap();
    affine(&qb, &y, 10, 0);
    qa.complete_fusion(FusionProps::default()).unwrap();
    qb.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![40; 8]);
    assert!(matches!(qa.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 1, .. })));
    assert!(matches!(qb.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
}

/// A kernel pair exchanging data inside a work-group: with the fusion barrier the
/// second sees all of the first's writes; without it, each work-item runs both
/// bodies before the next, so only the group's last work-item finds its neighbour
/// written.
#[test]
fn barrier_and_no_barrier_results() {
    let run = |barriers: bool| {
        let rt = manual_fusing_all();
        let q = rt.queue();
        let (a, b) = (rt.buffer_zeroed::<u32>(16), rt.buffer_zeroed::<u32>(16));
        q.start_fusion().unwrap();
        q.submit(|cg| {
            let a = cg.write(&a);
            cg.parallel_for_nd(NdRange::new(16, 4), move |it| {
                a.set(it, it.global_linear_id(), it.global_linear_id() as u32 + 1)
            });
        })
        .unwrap();
        q.submit(|cg| {
            let (a, b) = (cg.read(&a), cg.write(&b));
            cg.parallel_for_nd(NdRange::new(16, 4), move |it| {
                let l = it.local_range(0);
                let j = it.group_id(0) * l + (it.local_id(0) + 1) % l;
                b.set(it, it.global_linear_id(), a.get(it, j));
            });
        })
        .unwrap();
        q.complete_fusion(FusionProps { barriers }).unwrap().wait().unwrap();
        assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
        b.to_vec().unwrap()
    };
    let with: Vec<u32> = (0..16).map(|i| (i / 4 * 4 + (i % 4 + 1) % 4) as u32 + 1).collect();
    assert_eq!(run(true), with);
    let without: Vec<u32> = (0..16).map(|i| if i % 4 == 3 { (i - 3) as u32 + 1 } else { 0 }).collect();
    assert_eq!(run(false), without);
}

/// x -> tmp -> out with tmp internalized, privately (accessor hints) or locally
/// (buffer hint): the output is right and tmp is never written.
#[test]
fn private_and_local_internalization() {
    for promotion in [Promotion::Private, Promotion::Local] {
        let rt = Runtime::builder().worker_threads(2).fusion_warnings(0).fuse_unprofitable(true).build();
        let q = rt.queue();
        let n = 4096;
        let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
        let (tmp, out) = (rt.buffer(&vec![7u32; n]), rt.buffer_zeroed::<u32>(n));
        if promotion == Promotion::Local {
            tmp.set_promotion(Promotion::Local);
        }
        let nd = NdRange::new(n, 64);
        q.start_fusion().unwrap();
        q.submit(|cg| {
            let (x, t) = (cg.read(&x), cg.write(&tmp));
            cg.promote(&t, promotion);
            cg.parallel_for_nd(nd, move |it| {
                t.set(it, it.global_linear_id(), x.get(it, it.global_linear_id()) * 2)
            });
        })
        .unwrap();
        q.submit(|cg| {
            let (t, o) = (cg.read(&tmp), cg.write(&out));
            cg.promote(&t, promotion);
            cg.parallel_for_nd(nd, move |it| {
                o.set(it, it.global_linear_id(), t.get(it, it.global_linear_id()) + 1)
            });
        })
        .unwrap();
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        match q.fusion_outcome() {
            Some(FusionOutcome::Fused { kernels: 2, warnings, .. }) => {
                assert!(warnings.is_empty(), "{warnings:?}")
            }
            o => panic!("{o:?}"),
        }
        assert_eq!(out.to_vec().unwrap(), (0..n as u32).map(|v| v * 2 + 1).collect::<Vec<_>>());
        assert_eq!(tmp.to_vec().unwrap(), vec![7; n], "{promotion:?}: internalized, not written back");
    }
}

/// By default, per-work-item closures that would reach internalized memory one
/// mapped access at a time, or run item by item without barriers, are not fused:
/// the outcome names the kernel and the reason, and the kernels run unfused with
/// the same results.
#[test]
fn chains_slower_fused_run_unfused_and_say_why() {
    use gantry::Unprofitable;
    for (promote, barriers, reason) in
        [(true, true, Unprofitable::MappedAccess), (false, false, Unprofitable::ItemByItem)]
    {
        let rt = manual();
        let q = rt.queue();
        let n = 256;
        let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
        let (tmp, out) = (rt.buffer(&vec![7u32; n]), rt.buffer_zeroed::<u32>(n));
        q.start_fusion().unwrap();
        q.submit(|cg| {
            let (x, t) = (cg.read(&x), cg.elements_out(&tmp));
            if promote {
                cg.promote(&t, Promotion::Private);
            }
            cg.parallel_for(n, move |it| *t.elem(it) = x.get(it, it.global_linear_id()) * 2);
        })
        .unwrap();
        q.submit(|cg| {
            let (t, o) = (cg.elements_mut(&tmp), cg.elements_out(&out));
            if promote {
                cg.promote(&t, Promotion::Private);
            }
            cg.parallel_for(n, move |it| *o.elem(it) = *t.elem(it) + 1);
        })
        .unwrap();
        q.complete_fusion(FusionProps { barriers }).unwrap().wait().unwrap();
        match cancelled(&q) {
            CancelReason::Failed(FusionError::Unprofitable { kernel, reason: r }) => {
                assert_eq!((kernel.as_str(), r), ("parallel_for", reason))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(kernels_run(&rt), vec!["parallel_for".to_string(); 2]);
        assert_eq!(out.to_vec().unwrap(), (0..n as u32).map(|v| v * 2 + 1).collect::<Vec<_>>());
        assert_eq!(tmp.to_vec().unwrap(), (0..n as u32).map(|v| v * 2).collect::<Vec<_>>(), "run unfused");
    }
}

/// A promotion that cannot be honoured (one accessor not promoted) falls back to
/// global memory with a warning, never a wrong result.
#[test]
fn mismatched_promotion_falls_back() {
    let rt = manual_fusing_all();
    let q = rt.queue();
    let (tmp, out) = (rt.buffer(&[0u32; 64]), rt.buffer_zeroed::<u32>(64));
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let t = cg.elements_out(&tmp);
        cg.promote(&t, Promotion::Private);
        cg.parallel_for(64, move |it| *t.elem(it) = 5);
    })
    .unwrap();
    q.submit(|cg| {
        let (t, o) = (cg.read(&tmp), cg.elements_out(&out));
        cg.parallel_for(64, move |it| *o.elem(it) = t.get(it, it.global_linear_id()) * 2);
    })
    .unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    match q.fusion_outcome() {
        Some(FusionOutcome::Fused { warnings, .. }) => assert_eq!(warnings.len(), 1),
        o => panic!("{o:?}"),
    }
    assert_eq!(out.to_vec().unwrap(), vec![10; 64]);
    assert_eq!(tmp.to_vec().unwrap(), vec![5; 64], "not internalized: written as usual");
}

/// Kernels of 1, 2 and 3 dimensions and different sizes fuse into the largest grid;
/// each sees its own ids.
#[test]
fn different_nd_ranges_fuse_with_remapped_ids() {
    let rt = manual();
    let q = rt.queue();
    let (l1, l2, l3) =
        (rt.buffer_zeroed::<u32>(30), rt.buffer_zeroed::<u32>(6 * 8), rt.buffer_zeroed::<u32>(24));
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let o = cg.write(&l1);
        cg.parallel_for(30, move |it| o.set(it, it.global_id(0), it.global_id(0) as u32 + 1));
    })
    .unwrap();
    q.submit(|cg| {
        let o = cg.write(&l2);
        cg.parallel_for(Range::d2(6, 8), move |it| {
            o.set(it, it.global_id(0) * 8 + it.global_id(1), (it.global_id(0) * 100 + it.global_id(1)) as u32)
        });
    })
    .unwrap();
    q.submit(|cg| {
        let o = cg.write(&l3);
        cg.parallel_for(Range::d3(2, 3, 4), move |it| {
            let [a, b, c] = it.global_ids();
            o.set(it, it.global_linear_id(), (a * 100 + b * 10 + c) as u32)
        });
    })
    .unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 3, .. })));
    assert_eq!(l1.to_vec().unwrap(), (1..=30).collect::<Vec<u32>>());
    let e2: Vec<u32> = (0..6).flat_map(|r| (0..8).map(move |c| r * 100 + c)).collect();
    assert_eq!(l2.to_vec().unwrap(), e2);
    let e3: Vec<u32> =
        (0..2).flat_map(|a| (0..3).flat_map(move |b| (0..4).map(move |c| a * 100 + b * 10 + c))).collect();
    assert_eq!(l3.to_vec().unwrap(), e3);
}

/// Each illegal ND-range combination aborts fusion naming the reason; the kernels
/// run unfused with correct results.
#[test]
fn illegal_nd_range_combinations_fall_back() {
    type Check = fn(&FusionError) -> bool;
    let cases: [(NdRange, NdRange, Check); 4] = [
        (NdRange::new(16, 4), NdRange::new(16, 8), |e| matches!(e, FusionError::DifferentLocalSizes { .. })),
        (NdRange::new([4, 8], [2, 2]), NdRange::new([2, 4], [2, 2]), |e| {
            matches!(e, FusionError::DifferentGlobalSizes { .. })
        }),
        // Equal local arrays ([4, 1, 1]) but two dimensions against one.
        (NdRange::new([4, 4], [4, 1]), NdRange::new(16, 4), |e| {
            matches!(e, FusionError::DifferentDimensions { .. })
        }),
        (NdRange::new(16, 4), NdRange::new(16, 4).with_offset([4, 0, 0]), |e| {
            matches!(e, FusionError::DifferentOffsets { .. })
        }),
    ];
    for (first, second, check) in cases {
        let rt = manual();
        let q = rt.queue();
        let size = |nd: &NdRange| nd.global.size();
        let (a, b) = (rt.buffer_zeroed::<u32>(size(&first)), rt.buffer_zeroed::<u32>(size(&second)));
        q.start_fusion().unwrap();
        for (nd, buf) in [(first, &a), (second, &b)] {
            q.submit(|cg| {
                let o = cg.write(buf);
                cg.parallel_for_nd(nd, move |it| {
                    o.set(it, it.global_linear_id(), it.global_linear_id() as u32 + 1)
                });
            })
            .unwrap();
        }
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        match cancelled(&q) {
            CancelReason::Failed(e) => assert!(check(&e), "{e}"),
            r => panic!("{r}"),
        }
        assert_eq!(a.to_vec().unwrap(), (1..=size(&first) as u32).collect::<Vec<_>>());
        assert_eq!(b.to_vec().unwrap(), (1..=size(&second) as u32).collect::<Vec<_>>());
    }
    // Non-uniform work-groups: a plain range of 18 with groups of 4.
    let rt = manual();
    let q = rt.queue();
    let (a, b) = (rt.buffer_zeroed::<u32>(16), rt.buffer_zeroed::<u32>(18));
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let o = cg.elements_out(&a);
        cg.parallel_for_nd(NdRange::new(16, 4), move |it| *o.elem(it) = 1);
    })
    .unwrap();
    q.submit(|cg| {
        let o = cg.elements_out(&b);
        cg.parallel_for(18, move |it| *o.elem(it) = 2);
    })
    .unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert!(matches!(cancelled(&q), CancelReason::Failed(FusionError::NonUniformWorkGroups { .. })));
    assert_eq!(a.to_vec().unwrap(), vec![1; 16]);
    assert_eq!(b.to_vec().unwrap(), vec![2; 18]);
}

/// Fusing the same chain again (new closures, same code and layout) hits the cache.
#[test]
fn the_same_chain_is_fused_from_the_cache() {
    let rt = manual();
    let q = rt.queue();
    let a = rt.buffer(&[1u32; 32]);
    for round in 0..3 {
        q.start_fusion().unwrap();
        affine(&q, &a, 2, 0);
        affine(&q, &a, 1, 1);
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        match q.fusion_outcome() {
            Some(FusionOutcome::Fused { cached, .. }) => assert_eq!(cached, round > 0),
            o => panic!("{o:?}"),
        }
    }
    assert_eq!(rt.fusion_cache_stats().unwrap().hits, 2);
    // Each start_fusion marks the previous list for deletion; only the latest stays.
    rt.wait_idle().unwrap();
    let lists = rt.with_world(|w| w.query::<&gantry::components::FusionList>().iter(w).count());
    assert_eq!(lists, 1);
    assert_eq!(a.to_vec().unwrap(), vec![15; 32]);
}

/// Fusion on a simulated device with its own memory: the fused kernel's arguments
/// are moved there and back like any kernel's.
#[test]
fn fusion_on_the_simulated_device() {
    let rt =
        Runtime::builder().mode(Mode::Manual).sim(gantry::SimConfig::default()).fusion_warnings(0).build();
    let q = rt.queue_with(gantry::QueueOptions { device: 1, in_order: true }).unwrap();
    let a = rt.buffer(&(0..100u32).collect::<Vec<_>>());
    q.start_fusion().unwrap();
    affine(&q, &a, 2, 1);
    affine(&q, &a, 3, 0);
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
    assert_eq!(a.to_vec().unwrap(), serial(&(0..100).collect::<Vec<_>>(), &[(2, 1), (3, 0)]));
}

/// Threaded mode: fusion windows every frame, with readbacks right after completion.
#[test]
fn threaded_frames_fuse_every_time() {
    let rt = Runtime::builder()
        .worker_threads(2)
        .fusion_warnings(0)
        .fusion_window(WindowThresholds::ALWAYS)
        .build();
    let q = rt.in_order_queue();
    let a = rt.buffer(&[0u32; 1024]);
    for frame in 1..=20u32 {
        q.start_fusion().unwrap();
        affine(&q, &a, 1, 1);
        affine(&q, &a, 2, 0);
        q.complete_fusion(FusionProps::default()).unwrap();
        let v = a.to_vec().unwrap();
        assert!(v.iter().all(|&x| x == v[0]));
        assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })), "frame {frame}");
    }
    rt.wait_idle().unwrap();
    assert_eq!(rt.stats().live_commands, 0);
}

/// A fusion completed and the next one started before the scheduler ran: the first
/// is still fused (regression: the new start marked the pending list for deletion).
#[test]
fn back_to_back_fusions_in_one_flush_both_fuse() {
    let rt = manual();
    let q = rt.in_order_queue();
    let buf = rt.buffer(&[1u32; 64]);
    for _ in 0..2 {
        q.start_fusion().unwrap();
        for _ in 0..2 {
            affine(&q, &buf, 2, 0);
        }
        q.complete_fusion(FusionProps::default()).unwrap();
    }
    q.wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![16; 64]);
    let stats = rt.fusion_cache_stats().unwrap();
    assert_eq!((stats.hits, stats.misses), (1, 1), "both windows fused");
    assert_eq!(kernels_run(&rt).iter().filter(|n| n.starts_with("fused")).count(), 2);
}

/// A list a newer fusion of its queue replaced goes in the flush whose retire stage
/// frees its fused kernel: a runtime that has finished its work keeps only the
/// queue's current list. (Regression: the fuse stage, which runs before retire,
/// deleted it, so it stayed until some later flush; a threaded runtime that went idle
/// kept a timing-dependent number of them.)
#[test]
fn a_replaced_fusion_list_goes_with_its_fused_kernel() {
    let rt = manual();
    let q = rt.in_order_queue();
    let buf = rt.buffer(&[1u32; 64]);
    let mut last = None;
    for _ in 0..3 {
        q.start_fusion().unwrap();
        for _ in 0..2 {
            affine(&q, &buf, 2, 0);
        }
        last = Some(q.complete_fusion(FusionProps::default()).unwrap());
    }
    // One flush runs all three windows; the wait returns after it.
    last.unwrap().wait().unwrap();
    let lists = rt.with_world(|w| w.query::<&gantry::components::FusionList>().iter(w).count());
    assert_eq!(lists, 1, "only the queue's current list");
    assert_eq!(buf.to_vec().unwrap(), vec![64; 64]);
}

/// A fusion compiler set on the builder is the one asked; a refusal runs the kernels
/// unfused with the compiler's reason.
#[test]
fn a_custom_fusion_compiler_is_used() {
    use gantry::{ClosureFusion, FusionCompiler};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Counting {
        calls: AtomicUsize,
        refuse: bool,
        inner: ClosureFusion,
    }
    impl FusionCompiler for Counting {
        fn image_kind(&self) -> gantry::ImageKind {
            gantry::ImageKind::Closure
        }
        fn fuse(&self, request: &gantry::FusionRequest) -> std::result::Result<gantry::Fused, FusionError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.refuse {
                return Err(FusionError::Empty);
            }
            self.inner.fuse(request)
        }
    }
    for refuse in [false, true] {
        let compiler = Arc::new(Counting { calls: AtomicUsize::new(0), refuse, inner: ClosureFusion::new() });
        let rt = Runtime::builder()
            .mode(Mode::Manual)
            .fusion_compiler(compiler.clone())
            .fusion_warnings(0)
            .fusion_window(WindowThresholds::ALWAYS)
            .build();
        assert!(rt.fusion_cache_stats().is_none(), "the default compiler is not in use");
        let q = rt.queue();
        let a = rt.buffer(&[1u32; 16]);
        q.start_fusion().unwrap();
        affine(&q, &a, 2, 1);
        affine(&q, &a, 3, 0);
        q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
        assert_eq!(compiler.calls.load(Ordering::Relaxed), 1);
        assert_eq!(a.to_vec().unwrap(), vec![9; 16]);
        match q.fusion_outcome() {
            Some(FusionOutcome::Fused { kernels: 2, .. }) => assert!(!refuse),
            Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Empty))) => assert!(refuse),
            o => panic!("{o:?}"),
        }
    }
}

/// `out = f(input)` through [`Handler::map`](gantry::Handler::map).
fn map_step(q: &Queue, input: &Buffer<f32>, out: &Buffer<f32>, promote: (bool, bool), mul: f32) -> Event {
    q.submit(|cg| {
        let (x, y) = (cg.read(input), cg.elements_out(out));
        if promote.0 {
            cg.promote(&x, Promotion::Private);
        }
        if promote.1 {
            cg.promote(&y, Promotion::Private);
        }
        cg.map(&x, &y, move |v| v * mul + 1.0);
    })
    .unwrap()
}

/// Elementwise kernels fused with private intermediates (the vectorized path): the
/// chain's result, bit for bit, and the intermediates never written back; fused
/// without barriers and fused with a per-item kernel of another shape (which takes
/// the per-item path) give the same output.
#[test]
fn map_chains_fuse_with_private_intermediates() {
    let n = 4992; // five plain-range groups, the last partial; a multiple of 32
    let input: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
    let want: Vec<f32> = input.iter().map(|&v| ((v * 2.0 + 1.0) * 3.0 + 1.0) * 0.5 + 1.0).collect();
    for (label, barriers, odd) in
        [("barriers", true, false), ("no_barriers", false, false), ("odd", true, true)]
    {
        let rt = manual();
        let q = rt.queue();
        let x = rt.buffer(&input);
        let (t1, t2, y) =
            (rt.buffer(&vec![-1.0f32; n]), rt.buffer(&vec![-1.0f32; n]), rt.buffer_zeroed::<f32>(n));
        let other = rt.buffer(&[5u32; 96]);
        q.start_fusion().unwrap();
        map_step(&q, &x, &t1, (false, true), 2.0);
        if odd {
            // A per-item kernel of another ND-range: the fused grid remaps ids, so the
            // maps cannot take their contiguous path.
            q.submit(|cg| {
                let o = cg.elements_mut(&other);
                cg.parallel_for_nd(NdRange::new(96, 32), move |it| *o.elem(it) += it.local_id(0) as u32);
            })
            .unwrap();
        }
        map_step(&q, &t1, &t2, (true, true), 3.0);
        map_step(&q, &t2, &y, (true, false), 0.5);
        let props = FusionProps { barriers };
        q.complete_fusion(props).unwrap().wait().unwrap();
        match q.fusion_outcome() {
            Some(FusionOutcome::Fused { kernels, warnings, .. }) => {
                assert_eq!(kernels, if odd { 4 } else { 3 }, "{label}");
                assert!(warnings.is_empty(), "{label}: {warnings:?}");
            }
            other => panic!("{label}: not fused: {other:?}"),
        }
        let got = y.to_vec().unwrap();
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{label}: wrong output");
        assert_eq!(t1.to_vec().unwrap(), vec![-1.0; n], "{label}: t1 written back");
        assert_eq!(t2.to_vec().unwrap(), vec![-1.0; n], "{label}: t2 written back");
        let o = other.to_vec().unwrap();
        assert_eq!(o, (0..96).map(|i| 5 + if odd { i % 32 } else { 0 }).collect::<Vec<u32>>(), "{label}");
    }
}

/// `map` on both drivers, unfused, with a typed error for an input shorter than the
/// output.
#[test]
fn map_runs_on_every_driver_and_checks_lengths() {
    for sim in [false, true] {
        let b = Runtime::builder().mode(Mode::Manual).worker_threads(0);
        let (rt, device) =
            if sim { (b.sim(gantry::SimConfig::default()).build(), 1) } else { (b.build(), 0) };
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: true }).unwrap();
        let x = rt.buffer(&(0..3000u32).collect::<Vec<_>>());
        let y = rt.buffer_zeroed::<u64>(3000);
        q.submit(|cg| {
            let (x, y) = (cg.read(&x), cg.elements_out(&y));
            cg.map(&x, &y, |v| u64::from(v) << 33);
        })
        .unwrap()
        .wait()
        .unwrap();
        assert_eq!(y.to_vec().unwrap(), (0..3000u64).map(|v| v << 33).collect::<Vec<_>>(), "sim {sim}");
        let short = rt.buffer_zeroed::<u32>(10);
        let z = rt.buffer_zeroed::<u32>(11);
        let err = q
            .submit(|cg| {
                let (x, z) = (cg.read(&short), cg.elements_out(&z));
                cg.map(&x, &z, |v| v);
            })
            .unwrap_err();
        assert!(matches!(err, Error::MapInputTooShort { input: 10, output: 11 }), "{err}");
    }
}
