//! Command graphs (the SYCL graph extension's implementation design): record & replay,
//! explicit nodes, partitions, updates, graph fusion and every typed error, on real
//! data.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use gantry::{
    BreadthFirst, Buffer, CommandGraph, Error, EventStatus, ExecError, FinalizeError, FusionError,
    GraphProps, Mode, Promotion, Runtime, SimConfig, Unprofitable, WindowThresholds,
};

/// Messages a manual runtime's scheduler has taken in, after a flush: a whole-graph
/// update that patches on the caller's thread sends none; one that records sends its
/// finalize request.
fn messages(rt: &Runtime) -> u64 {
    rt.flush();
    rt.stats().messages
}

fn manual() -> Runtime {
    Runtime::builder().mode(Mode::Manual).worker_threads(0).profiling(true).build()
}

/// [`manual`] whose CPU device gives host tasks partitions of their own (the SYCL
/// graph extension's implementation design), as a device that cannot record them
/// does: what the partitioning tests check.
fn manual_isolating() -> Runtime {
    Runtime::builder().mode(Mode::Manual).worker_threads(0).record_host_tasks(false).build()
}

/// Adds `tmp = x + 1` and `out = tmp * 10` as two `map` nodes, the second after the
/// first, with `tmp`'s accessors promoted to private memory if `private`.
fn add_chain(graph: &CommandGraph, [x, tmp, out]: [&Buffer<u32>; 3], private: bool) {
    let promotion = if private { Promotion::Private } else { Promotion::None };
    let k1 = graph
        .add(
            |cg| {
                let (x, t) = (cg.read(x), cg.elements_out(tmp));
                cg.promote(&t, promotion);
                cg.map(&x, &t, |v| v + 1);
            },
            &[],
        )
        .unwrap();
    graph
        .add(
            |cg| {
                let (t, o) = (cg.read(tmp), cg.elements_out(out));
                cg.promote(&t, promotion);
                cg.map(&t, &o, |v| v * 10);
            },
            &[k1],
        )
        .unwrap();
}

/// [`manual`] whose fusions pay from `thresholds` on the CPU.
fn manual_with(thresholds: WindowThresholds) -> Runtime {
    Runtime::builder().mode(Mode::Manual).worker_threads(0).fusion_window(thresholds).build()
}

/// [`manual`] with a simulated device (device 1).
fn manual_sim() -> Runtime {
    Runtime::builder().mode(Mode::Manual).worker_threads(0).sim(SimConfig::default()).build()
}

/// Adds a node `buf[i] = buf[i] * mul + add` (wrapping: replays run it hundreds of
/// times).
fn affine(
    graph: &CommandGraph,
    buf: &Buffer<u32>,
    mul: u32,
    add: u32,
    deps: &[gantry::Node],
) -> gantry::Node {
    graph
        .add(
            |cg| {
                let b = cg.elements_mut(buf);
                cg.parallel_for(buf.len(), move |it| {
                    *b.elem(it) = b.elem(it).wrapping_mul(mul).wrapping_add(add)
                });
            },
            deps,
        )
        .unwrap()
}

/// A host task node that counts its runs and adds 1 to every element of `buf`.
fn counting_host(
    graph: &CommandGraph,
    buf: &Buffer<u32>,
    runs: &Arc<AtomicUsize>,
    deps: &[gantry::Node],
) -> gantry::Node {
    let runs = runs.clone();
    graph
        .add(
            |cg| {
                let mut b = cg.host_read_write(buf);
                cg.host_task(move |ctx| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    b.as_mut_slice(ctx).iter_mut().for_each(|x| *x += 1);
                });
            },
            deps,
        )
        .unwrap()
}

#[test]
fn state_advances_once_per_submission_not_at_add_or_finalize() {
    for rt in [manual(), Runtime::new()] {
        let buf = rt.buffer(&[1u32; 300]);
        let graph = rt.graph();
        let a = affine(&graph, &buf, 2, 0, &[]);
        affine(&graph, &buf, 1, 3, &[a]);
        assert_eq!(buf.to_vec().unwrap(), vec![1; 300], "adding runs nothing");
        let exec = graph.finalize(GraphProps::default()).unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![1; 300], "finalizing runs nothing");
        let q = rt.queue();
        let mut expect = 1u32;
        for _ in 0..5 {
            q.submit_graph(&exec).unwrap().wait().unwrap();
            expect = expect * 2 + 3;
            assert_eq!(buf.to_vec().unwrap(), vec![expect; 300]);
        }
        // Many replays without waiting in between: serialized, each applied once.
        for _ in 0..200 {
            q.submit_graph(&exec).unwrap();
            expect = expect.wrapping_mul(2).wrapping_add(3);
        }
        q.wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![expect; 300]);
    }
}

#[test]
fn record_and_replay_in_order_queue_records_a_chain_with_barriers() {
    let rt = manual();
    let q = rt.in_order_queue();
    let (a, b) = (rt.buffer(&[1u32; 64]), rt.buffer(&[0u32; 64]));
    let graph = rt.graph();
    graph.begin_recording(&q).unwrap();
    assert!(q.is_recording() && graph.is_recording());
    q.submit(|cg| {
        let x = cg.elements_mut(&a);
        cg.parallel_for(64, move |it| *x.elem(it) += 1);
    })
    .unwrap();
    q.submit(|cg| {
        let (x, y) = (cg.read(&a), cg.elements_out(&b));
        cg.parallel_for(64, move |it| *y.elem(it) = x.get(it, it.global_linear_id()) * 10);
    })
    .unwrap();
    q.barrier().unwrap();
    q.submit(|_| {}).unwrap(); // an empty command group: an empty node
    graph.end_recording(&q).unwrap();
    assert!(!q.is_recording());
    assert_eq!(graph.edges(), vec![vec![], vec![0], vec![1], vec![2]]);
    let exec = graph.finalize(GraphProps::default()).unwrap();
    let parts = exec.partitions();
    assert_eq!(parts.len(), 1);
    assert!(parts[0].in_order, "a recorded in-order queue is one path");
    for i in 1..=3u32 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(a.to_vec().unwrap(), vec![1 + i; 64]);
        assert_eq!(b.to_vec().unwrap(), vec![(1 + i) * 10; 64]);
    }
}

#[test]
fn out_of_order_recording_derives_edges_from_buffers_and_events() {
    let rt = manual();
    let q = rt.queue();
    let (a, b, c) = (rt.buffer(&[2u32; 16]), rt.buffer(&[0u32; 16]), rt.buffer(&[0u32; 16]));
    let graph = rt.graph();
    graph.begin_recording(&q).unwrap();
    let first = q.submit(|cg| cg.fill(&b, 5)).unwrap();
    q.submit(|cg| cg.fill(&c, 7)).unwrap();
    q.submit(|cg| {
        let (x, y) = (cg.read(&a), cg.elements_mut(&b));
        cg.parallel_for(16, move |it| *y.elem(it) += x.get(it, it.global_linear_id()));
    })
    .unwrap();
    // An explicit dependency on a recorded event becomes an edge.
    q.submit(|cg| {
        cg.depends_on(&first);
        let y = cg.elements_mut(&c);
        cg.parallel_for(16, move |it| *y.elem(it) *= 3);
    })
    .unwrap();
    graph.end_recording(&q).unwrap();
    assert_eq!(graph.edges(), vec![vec![], vec![], vec![0], vec![0, 1]]);
    let exec = graph.finalize(GraphProps::default()).unwrap();
    assert!(!exec.partitions()[0].in_order, "two independent chains are not one path");
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![7; 16]);
    assert_eq!(c.to_vec().unwrap(), vec![21; 16]);
}

#[test]
fn eager_and_graph_submissions_are_ordered_both_ways() {
    for rt in [manual(), Runtime::new()] {
        let q = rt.queue();
        let buf = rt.buffer(&[0u32; 4096]);
        let graph = rt.graph();
        let n = affine(&graph, &buf, 3, 0, &[]);
        affine(&graph, &buf, 1, 1, &[n]);
        let exec = graph.finalize(GraphProps::default()).unwrap();
        let mut expect = 0u32;
        for i in 0..20u32 {
            // Eager write, then the graph (which must see it), then an eager reader.
            q.submit(|cg| cg.fill(&buf, i)).unwrap();
            q.submit_graph(&exec).unwrap();
            expect = i * 3 + 1;
            let seen = Arc::new(Mutex::new(0u32));
            let s = seen.clone();
            q.submit(|cg| {
                let b = cg.host_read(&buf);
                cg.host_task(move |ctx| *s.lock().unwrap() = b.as_slice(ctx)[4095]);
            })
            .unwrap()
            .wait()
            .unwrap();
            assert_eq!(*seen.lock().unwrap(), expect, "iteration {i}");
        }
        assert_eq!(buf.to_vec().unwrap(), vec![expect; 4096]);
    }
}

#[test]
fn fills_empty_nodes_and_copies_replay() {
    let rt = manual();
    let (a, b) = (rt.buffer_zeroed::<u32>(32), rt.buffer_zeroed::<u32>(32));
    let graph = rt.graph();
    let fill = graph.add(|cg| cg.fill_range(&a, 8..24, 9), &[]).unwrap();
    let join = graph.add_empty(&[fill]).unwrap();
    let bump = affine(&graph, &a, 1, 1, &[join]);
    graph.add(|cg| cg.copy(&a, &b), &[bump]).unwrap();
    let exec = graph.finalize(GraphProps::default()).unwrap();
    let q = rt.queue();
    for round in 1..=3u32 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        let expect: Vec<u32> = (0..32).map(|i| if (8..24).contains(&i) { 10 } else { round }).collect();
        assert_eq!(a.to_vec().unwrap(), expect);
        assert_eq!(b.to_vec().unwrap(), expect);
    }
}

#[test]
fn multiple_roots_with_host_tasks_run_as_independent_partitions() {
    for rt in [manual_isolating(), Runtime::builder().record_host_tasks(false).build()] {
        let (x, y) = (rt.buffer(&[0u32; 128]), rt.buffer(&[0u32; 128]));
        let (rx, ry) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let graph = rt.graph();
        // Two roots, a host task in each branch: x*2 → host(+1) → x+5, y*3 → host(+1) → y+7.
        let a = affine(&graph, &x, 2, 0, &[]);
        let b = affine(&graph, &y, 3, 0, &[]);
        let hx = counting_host(&graph, &x, &rx, &[a]);
        let hy = counting_host(&graph, &y, &ry, &[b]);
        affine(&graph, &x, 1, 5, &[hx]);
        affine(&graph, &y, 1, 7, &[hy]);
        let exec = graph.finalize(GraphProps::default()).unwrap();
        let parts = exec.partitions();
        assert_eq!(parts.len(), 6);
        let roots: Vec<usize> = (0..parts.len()).filter(|&p| parts[p].preds.is_empty()).collect();
        assert_eq!(roots.len(), 2, "each branch starts on its own: {parts:?}");
        assert_eq!(parts.iter().filter(|p| p.host_task).count(), 2);
        let q = rt.queue();
        let (mut ex, mut ey) = (0u32, 0u32);
        for i in 0..4 {
            let ev = q.submit_graph(&exec).unwrap();
            ev.wait().unwrap();
            assert_eq!(ev.status(), EventStatus::Complete);
            ex = (ex * 2 + 1) + 5;
            ey = (ey * 3 + 1) + 7;
            assert_eq!(rx.load(Ordering::SeqCst), i + 1);
            assert_eq!(ry.load(Ordering::SeqCst), i + 1);
            assert_eq!(x.to_vec().unwrap(), vec![ex; 128]);
            assert_eq!(y.to_vec().unwrap(), vec![ey; 128]);
        }
    }
}

/// On the CPU device a host task is recorded into its neighbours' command buffer and
/// runs in place at each replay, in order with the kernels around it: the six
/// partitions of `multiple_roots_with_host_tasks_run_as_independent_partitions` become
/// one, with the same results. Between a simulated device's kernels the host task
/// (which runs on the host, the CPU device) is a CPU command buffer of its own.
#[test]
fn host_tasks_run_inside_cpu_command_buffers() {
    for rt in [manual(), Runtime::new()] {
        let (x, y) = (rt.buffer(&[0u32; 128]), rt.buffer(&[0u32; 128]));
        let runs = Arc::new(AtomicUsize::new(0));
        let exec = branches(&rt, 0, &x, &y, &runs).finalize(GraphProps::default()).unwrap();
        let parts = exec.partitions();
        assert_eq!(parts.len(), 1, "no host task splits the graph: {parts:?}");
        assert!(!parts[0].host_task && parts[0].nodes.len() == 6, "{parts:?}");
        let q = rt.queue();
        let (mut ex, mut ey) = (0u32, 0u32);
        for i in 0..4 {
            q.submit_graph(&exec).unwrap().wait().unwrap();
            ex = (ex * 2 + 1) + 5;
            ey = (ey * 3 + 1) + 7;
            assert_eq!(runs.load(Ordering::SeqCst), 2 * (i + 1));
            assert_eq!(x.to_vec().unwrap(), vec![ex; 128]);
            assert_eq!(y.to_vec().unwrap(), vec![ey; 128]);
        }
    }
    let rt = manual_sim();
    let x = rt.buffer(&[0u32; 128]);
    let runs = Arc::new(AtomicUsize::new(0));
    let graph = rt.graph_on(1);
    let a = affine(&graph, &x, 2, 0, &[]);
    let h = counting_host(&graph, &x, &runs, &[a]);
    affine(&graph, &x, 1, 5, &[h]);
    let exec = graph.finalize(GraphProps::default()).unwrap();
    let parts = exec.partitions();
    assert_eq!(
        parts.iter().map(|p| (p.device, p.host_task)).collect::<Vec<_>>(),
        [(1, false), (0, false), (1, false)]
    );
    rt.queue_with(gantry::QueueOptions { device: 1, in_order: false })
        .unwrap()
        .submit_graph(&exec)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(x.to_vec().unwrap(), vec![6; 128]);
}

/// A host task that panics inside a CPU command buffer fails the graph's submission
/// with the task's name and message; the kernel before it keeps its result and the one
/// after it does not run, as eager commands would; the next replay runs them all.
#[test]
fn a_failing_recorded_host_task_fails_its_partition() {
    let rt = manual();
    let x = rt.buffer(&[1u32; 16]);
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let graph = rt.graph();
    let a = affine(&graph, &x, 2, 0, &[]);
    let f = fail.clone();
    let h = graph
        .add(
            |cg| {
                cg.name("check");
                let b = cg.host_read(&x);
                cg.host_task(move |ctx| {
                    assert!(!f.load(Ordering::SeqCst), "check failed at {}", b.as_slice(ctx)[0]);
                });
            },
            &[a],
        )
        .unwrap();
    affine(&graph, &x, 1, 5, &[h]);
    let exec = graph.finalize(GraphProps::default()).unwrap();
    assert_eq!(exec.partitions().len(), 1);
    let q = rt.queue();
    let err = q.submit_graph(&exec).unwrap().wait().unwrap_err().to_string();
    assert!(err.contains("check") && err.contains("check failed at 2"), "{err}");
    assert_eq!(x.to_vec().unwrap(), vec![2; 16], "the kernel before it ran, the one after it did not");
    fail.store(false, Ordering::SeqCst);
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(x.to_vec().unwrap(), vec![9; 16]);
}

/// The SYCL graph extension's implementation design's worked examples (reconstructed
/// from the algorithm they illustrate): A → HT1 → B and C → HT2 → E give six
/// partitions; adding `make_edge(E, HT1)` makes HT1 depend on the second branch, HT1 is
/// processed again, and the group holding HT2's predecessors (C) is merged into the
/// group of HT1's (A).
#[test]
fn partitions_of_the_seed_worked_examples() {
    let rt = manual_isolating();
    let bufs: Vec<Buffer<u32>> = (0..6).map(|_| rt.buffer(&[1u32; 8])).collect();
    let runs = Arc::new(AtomicUsize::new(0));
    let build = || {
        let g = rt.graph();
        let a = affine(&g, &bufs[0], 2, 0, &[]);
        let ht1 = counting_host(&g, &bufs[1], &runs, &[a]);
        let b = affine(&g, &bufs[2], 2, 0, &[ht1]);
        let c = affine(&g, &bufs[3], 2, 0, &[]);
        let ht2 = counting_host(&g, &bufs[4], &runs, &[c]);
        let e = affine(&g, &bufs[5], 2, 0, &[ht2]);
        (g, [a, ht1, b, c, ht2, e])
    };
    let (g, _) = build();
    let exec = g.finalize(GraphProps::default()).unwrap();
    //                            A  HT1 B  C  HT2 E
    assert_eq!(exec.partition_of(), vec![0, 1, 2, 3, 4, 5]);

    let (g, [_, ht1, _, _, _, e]) = build();
    g.make_edge(e, ht1).unwrap();
    let exec = g.finalize(GraphProps::default()).unwrap();
    //                            A  HT1 B  C  HT2 E
    assert_eq!(exec.partition_of(), vec![0, 3, 4, 0, 1, 2]);
    let parts = exec.partitions();
    assert_eq!(parts[0].nodes.len(), 2, "A and C merged");
    assert_eq!(parts[3].preds, vec![0, 2], "HT1 waits for A's group and for E");
    rt.queue().submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    for (i, expect) in [2u32; 6].into_iter().enumerate() {
        assert_eq!(bufs[i].to_vec().unwrap(), vec![expect; 8], "buffer {i}");
    }
}

#[test]
fn a_breadth_first_linearizer_can_be_plugged_in() {
    let rt =
        Runtime::builder().mode(Mode::Manual).worker_threads(0).linearizer(Arc::new(BreadthFirst)).build();
    let bufs: Vec<Buffer<u32>> = (0..4).map(|_| rt.buffer(&[1u32; 4])).collect();
    let g = rt.graph();
    let r = affine(&g, &bufs[0], 2, 0, &[]);
    let a = affine(&g, &bufs[1], 2, 0, &[r]);
    affine(&g, &bufs[2], 2, 0, &[a]);
    affine(&g, &bufs[3], 2, 0, &[r]);
    let exec = g.finalize(GraphProps::default()).unwrap();
    assert_eq!(exec.order(), vec![0, 1, 3, 2]);
    let dfs = manual();
    let g2 = dfs.graph();
    let bufs2: Vec<Buffer<u32>> = (0..4).map(|_| dfs.buffer(&[1u32; 4])).collect();
    let r = affine(&g2, &bufs2[0], 2, 0, &[]);
    let a = affine(&g2, &bufs2[1], 2, 0, &[r]);
    affine(&g2, &bufs2[2], 2, 0, &[a]);
    affine(&g2, &bufs2[3], 2, 0, &[r]);
    assert_eq!(g2.finalize(GraphProps::default()).unwrap().order(), vec![0, 3, 1, 2]);
    rt.queue().submit_graph(&exec).unwrap().wait().unwrap();
    assert!(bufs.iter().all(|b| b.to_vec().unwrap() == vec![2; 4]));
}

/// A linearizer that ignores the edges (insertion order reversed).
struct Backwards;

impl gantry::Linearizer for Backwards {
    fn name(&self) -> &str {
        "backwards"
    }
    fn order(&self, preds: &[gantry::NodeList], _: &[gantry::NodeList]) -> Vec<u32> {
        (0..preds.len() as u32).rev().collect()
    }
}

#[test]
fn a_linearizer_that_breaks_edges_fails_finalize() {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).linearizer(Arc::new(Backwards)).build();
    let buf = rt.buffer(&[1u32; 4]);
    let g = rt.graph();
    let a = affine(&g, &buf, 2, 0, &[]);
    affine(&g, &buf, 2, 0, &[a]);
    match g.finalize(GraphProps::default()) {
        Err(Error::Finalize(FinalizeError::BadOrder { policy, why })) => {
            assert_eq!(policy, "backwards");
            assert!(why.contains("before its predecessor"), "{why}");
        }
        other => panic!("expected a bad-order error, got {:?}", other.err()),
    }
    // A single node has only one order: the policy's answer is valid.
    let one = rt.graph();
    affine(&one, &buf, 3, 0, &[]);
    rt.queue().submit_graph(&one.finalize(GraphProps::default()).unwrap()).unwrap().wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![3; 4]);
}

#[test]
fn sub_graphs_added_twice_run_twice() {
    let rt = manual();
    let buf = rt.buffer(&[1u32; 16]);
    let inner = rt.graph();
    let n = affine(&inner, &buf, 2, 0, &[]);
    affine(&inner, &buf, 1, 1, &[n]);
    let sub = inner.finalize(GraphProps::default()).unwrap();
    let outer = rt.graph();
    let first = outer.add_graph(&sub, &[]).unwrap();
    let second = outer.add_graph(&sub, &[first]).unwrap();
    affine(&outer, &buf, 10, 0, &[second]);
    let exec = outer.finalize(GraphProps::default()).unwrap();
    rt.queue().submit_graph(&exec).unwrap().wait().unwrap();
    // ((1*2+1)*2+1)*10
    assert_eq!(buf.to_vec().unwrap(), vec![70; 16]);
    // Edges from buffer accesses link sub-graphs added without explicit deps too.
    let outer2 = rt.graph();
    outer2.add_graph(&sub, &[]).unwrap();
    outer2.add_graph(&sub, &[]).unwrap();
    rt.queue().submit_graph(&outer2.finalize(GraphProps::default()).unwrap()).unwrap().wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![(70 * 2 + 1) * 2 + 1; 16]);
    // Submitting an executable graph to a recording queue records it as a sub-graph.
    let q = rt.in_order_queue();
    let rec = rt.graph();
    rec.begin_recording(&q).unwrap();
    q.submit_graph(&sub).unwrap();
    q.submit_graph(&sub).unwrap();
    rec.end_recording(&q).unwrap();
    assert_eq!(rec.node_count(), 2 * (2 + 2));
    let before = buf.to_vec().unwrap()[0];
    q.submit_graph(&rec.finalize(GraphProps::default()).unwrap()).unwrap().wait().unwrap();
    assert_eq!(buf.to_vec().unwrap()[0], ((before * 2 + 1) * 2 + 1));
}

#[test]
fn event_status_follows_the_whole_execution() {
    let rt = manual();
    let buf = rt.buffer(&[0u32; 8]);
    let graph = rt.graph();
    affine(&graph, &buf, 1, 1, &[]);
    let exec = graph.finalize(GraphProps::default()).unwrap();
    // Hold the buffer on the host: the graph cannot start.
    let guard = buf.write().unwrap();
    let q = rt.queue();
    let ev = q.submit_graph(&exec).unwrap();
    rt.flush();
    assert!(!ev.status().is_final(), "blocked behind a host access");
    drop(guard);
    ev.wait().unwrap();
    assert_eq!(ev.status(), EventStatus::Complete);
    let t = ev.timestamps().expect("the test runtime profiles");
    assert!(t.ended_ns >= t.started_ns);
}

#[test]
fn whole_graph_update_between_submissions_without_waits() {
    for rt in [manual(), Runtime::new()] {
        let buf = rt.buffer(&[1u32; 512]);
        let build = |mul: u32, add: u32| {
            let g = rt.graph();
            let n = affine(&g, &buf, mul, 0, &[]);
            affine(&g, &buf, 1, add, &[n]);
            g
        };
        let exec = build(2, 0).finalize(GraphProps::default().updatable()).unwrap();
        let q = rt.queue();
        let mut expect = 1u32;
        for round in 0..30u32 {
            q.submit_graph(&exec).unwrap();
            expect = expect.wrapping_mul(2 + round % 3).wrapping_add(round);
            // Update for the next submission while this one may still run.
            exec.update(&build(2 + (round + 1) % 3, round + 1)).unwrap();
        }
        q.wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![expect; 512]);
    }
}

/// Each submission's commands belong to the queue it was made through, also when
/// submissions alternate between queues, and they still run one after another.
#[test]
fn submissions_through_several_queues_belong_to_their_queue() {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).timeline(true).build();
    let buf = rt.buffer(&[1u32; 64]);
    let g = rt.graph();
    affine(&g, &buf, 3, 1, &[]);
    let exec = g.finalize(GraphProps::default()).unwrap();
    let (q1, q2) = (rt.queue(), rt.queue());
    let order = [&q1, &q2, &q2, &q1, &q2];
    let events: Vec<_> = order.iter().map(|q| q.submit_graph(&exec).unwrap()).collect();
    for e in &events {
        e.wait().unwrap();
    }
    assert_eq!(buf.to_vec().unwrap(), vec![(0..5).fold(1u32, |x, _| x * 3 + 1); 64]);
    let timeline = rt.timeline().unwrap();
    let replays: Vec<_> = timeline.slices.iter().filter(|s| s.kind.name() == "command_buffer").collect();
    let queues: Vec<_> = replays.iter().map(|s| s.queue).collect();
    assert_eq!(queues, order.map(|q| Some(q.id())));
    for pair in replays.windows(2) {
        assert!(pair[1].start_ns >= pair[0].end_ns, "serialized: {pair:?}");
    }
}

/// Two branches with a host task each, on `device` (six partitions): x*2 → host(+1)
/// → x+5 and y*3 → host(+1) → y+7.
fn branches(
    rt: &Runtime,
    device: u32,
    x: &Buffer<u32>,
    y: &Buffer<u32>,
    runs: &Arc<AtomicUsize>,
) -> CommandGraph {
    let graph = rt.graph_on(device);
    let a = affine(&graph, x, 2, 0, &[]);
    let b = affine(&graph, y, 3, 0, &[]);
    let hx = counting_host(&graph, x, runs, &[a]);
    let hy = counting_host(&graph, y, runs, &[b]);
    affine(&graph, x, 1, 5, &[hx]);
    affine(&graph, y, 1, 7, &[hy]);
    graph
}

/// An update from a graph of the same topology over other buffers (the partitions
/// are kept, the command buffers patched: no message to the scheduler) runs as that
/// graph freshly finalized does, host-task partitions included, on the CPU and the
/// simulated device; the first graph's buffers are left alone.
#[test]
fn an_update_over_other_buffers_runs_as_a_fresh_finalize() {
    // (Host tasks run on the CPU device, which here gives each a partition.)
    let sim = Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .sim(SimConfig::default())
        .record_host_tasks(false)
        .build();
    for (rt, device) in [(manual_isolating(), 0), (sim, 1)] {
        let sets: Vec<[Buffer<u32>; 2]> =
            (0..2).map(|_| [rt.buffer(&[1u32; 64]), rt.buffer(&[2u32; 64])]).collect();
        let runs = Arc::new(AtomicUsize::new(0));
        let graphs: Vec<CommandGraph> =
            sets.iter().map(|[x, y]| branches(&rt, device, x, y, &runs)).collect();
        let exec = graphs[0].finalize(GraphProps::default().updatable()).unwrap();
        assert_eq!(exec.partitions().len(), 6);
        let sent = messages(&rt);
        exec.update(&graphs[1]).unwrap();
        assert_eq!(messages(&rt), sent, "patched, not recorded anew");
        let fresh = graphs[1].finalize(GraphProps::default()).unwrap();
        assert_eq!(exec.partitions(), fresh.partitions());
        assert_eq!(exec.partition_of(), fresh.partition_of());
        assert_eq!(exec.order(), fresh.order());
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: true }).unwrap();
        let [x, y] = &sets[1];
        for (i, graph) in [&exec, &fresh].into_iter().enumerate() {
            q.submit(|cg| cg.fill(x, 1)).unwrap();
            q.submit(|cg| cg.fill(y, 2)).unwrap();
            q.submit_graph(graph).unwrap().wait().unwrap();
            assert_eq!(runs.load(Ordering::SeqCst), 2 * (i + 1), "graph {i}: both host tasks ran");
            assert_eq!(x.to_vec().unwrap(), vec![(2 + 1) + 5; 64], "graph {i}");
            assert_eq!(y.to_vec().unwrap(), vec![(2 * 3 + 1) + 7; 64], "graph {i}");
        }
        assert_eq!(sets[0][0].to_vec().unwrap(), vec![1; 64]);
        assert_eq!(sets[0][1].to_vec().unwrap(), vec![2; 64]);
    }
}

/// An update from a graph whose nodes run on other devices than the current ones
/// partitions anew: it gets the partitions of that graph freshly finalized.
#[test]
fn an_update_with_nodes_on_other_devices_partitions_anew() {
    let rt = manual_sim();
    let buf = rt.buffer(&[1u32; 64]);
    let record = |device: u32| {
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: true }).unwrap();
        let graph = rt.graph();
        graph.begin_recording(&q).unwrap();
        for add in 1..=3u32 {
            q.submit(|cg| {
                let b = cg.elements_mut(&buf);
                cg.parallel_for(64, move |it| *b.elem(it) = *b.elem(it) * 2 + add);
            })
            .unwrap();
        }
        graph.end_recording(&q).unwrap();
        graph
    };
    let (on_sim, on_cpu) = (record(1), record(0));
    let exec = on_sim.finalize(GraphProps::default().updatable()).unwrap();
    // Nodes of another device than the graph's share a partition on their device
    // (partitions split only where the device changes).
    let parts = exec.partitions();
    assert_eq!((parts.len(), parts[0].device, parts[0].nodes.len()), (1, 1, 3), "{parts:?}");
    exec.update(&on_cpu).unwrap();
    let fresh = on_cpu.finalize(GraphProps::default()).unwrap();
    assert_eq!(exec.partitions(), fresh.partitions());
    assert_eq!(exec.partitions().len(), 1);
    rt.queue().submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![((2 + 1) * 2 + 2) * 2 + 3; 64]);
    exec.update(&on_sim).unwrap();
    assert_eq!(exec.partitions(), on_sim.finalize(GraphProps::default()).unwrap().partitions());
}

/// An update reads the graph as it is now: a graph updated from, then modified, and
/// updated from again brings its modification along.
#[test]
fn an_update_sees_modifications_since_an_earlier_update() {
    let rt = manual();
    let (a, b, c) = (rt.buffer(&[10u32; 16]), rt.buffer(&[20u32; 16]), rt.buffer(&[30u32; 16]));
    let (out, other) = (rt.buffer_zeroed::<u32>(16), rt.buffer_zeroed::<u32>(16));
    let build = |src: &Buffer<u32>| {
        let g = rt.graph();
        let copy = g
            .add(
                |cg| {
                    let (s, o) = (cg.read(src), cg.elements_out(&out));
                    cg.parallel_for(16, move |it| *o.elem(it) = s.get(it, it.global_linear_id()) + 1);
                },
                &[],
            )
            .unwrap();
        let bump = affine(&g, &other, 1, 1, &[]);
        (g, copy, bump)
    };
    let ((g0, _, _), (g1, copy, bump)) = (build(&a), build(&b));
    let exec = g0.finalize(GraphProps::default().updatable()).unwrap();
    let q = rt.queue();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![11; 16]);
    exec.update(&g1).unwrap();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![21; 16]);
    // Rebind the copy's source: the next update reads `c`.
    let param = g1.dynamic_buffer(&c);
    g1.set_arg(copy, 0, &param).unwrap();
    exec.update(&g1).unwrap();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![31; 16]);
    // A new edge: the topology differs from the executable graph's now.
    g1.make_edge(copy, bump).unwrap();
    assert!(matches!(exec.update(&g1), Err(Error::TopologyMismatch(_))));
    assert_eq!(other.to_vec().unwrap(), vec![3; 16]);
}

#[test]
fn dynamic_parameter_updates_affect_only_later_submissions() {
    let rt = Runtime::new();
    let (a, b, out) = (rt.buffer(&[1u32; 1024]), rt.buffer(&[100u32; 1024]), rt.buffer_zeroed::<u32>(1024));
    let graph = rt.graph();
    let param = graph.dynamic_buffer(&a);
    let n = graph
        .add(
            |cg| {
                let (x, o) = (cg.read(&a), cg.elements_mut(&out));
                cg.parallel_for(1024, move |it| *o.elem(it) += x.get(it, it.global_linear_id()));
            },
            &[],
        )
        .unwrap();
    graph.set_arg(n, 0, &param).unwrap();
    let exec = graph.finalize(GraphProps::default().updatable()).unwrap();
    let q = rt.queue();
    // On the threaded runtime the first submission may still run when the update
    // comes; it reads `a` whatever happens next.
    q.submit_graph(&exec).unwrap();
    exec.update_param(&param, &b).unwrap();
    q.submit_graph(&exec).unwrap();
    q.submit_graph(&exec).unwrap();
    exec.update_param(&param, &a).unwrap();
    q.submit_graph(&exec).unwrap();
    q.wait().unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![1 + 100 + 100 + 1; 1024]);
    // Eager writes to the parameter's current buffer order before the next replay.
    q.submit(|cg| cg.fill(&a, 5)).unwrap();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![207; 1024]);
}

#[test]
fn graph_fusion_fuses_a_chain_with_an_internalized_buffer() {
    let rt = manual();
    let n = 256;
    let (x, tmp, out) = (rt.buffer(&vec![3u32; n]), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    let graph = rt.graph();
    add_chain(&graph, [&x, &tmp, &out], true);
    let fused = graph.finalize(GraphProps::default().fused()).unwrap();
    assert_eq!(fused.fused_chains().len(), 1);
    assert_eq!(fused.fused_chains()[0].0, vec![0, 1]);
    let q = rt.queue();
    for _ in 0..3 {
        q.submit_graph(&fused).unwrap().wait().unwrap();
        assert_eq!(out.to_vec().unwrap(), vec![40; n]);
        assert_eq!(tmp.to_vec().unwrap(), vec![0; n], "internalized: never written back");
    }
    // Unfused, the same graph writes the temporary.
    let plain = graph.finalize(GraphProps::default()).unwrap();
    assert!(plain.fused_chains().is_empty());
    q.submit_graph(&plain).unwrap().wait().unwrap();
    assert_eq!(tmp.to_vec().unwrap(), vec![4; n]);
}

/// Two fused chains of one partition internalize the same temporary: the partition's
/// command orders against it once (one ordering-only requirement), and both chains
/// give their results without writing it back.
#[test]
fn two_chains_internalizing_one_buffer_order_against_it_once() {
    use gantry::components::{Command, CommandKind, Requirements};
    let rt = manual();
    let n = 128;
    let (x, tmp) = (rt.buffer(&vec![3u32; n]), rt.buffer_zeroed::<u32>(n));
    let (o1, y, o2) = (rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    let graph = rt.graph();
    // src -> tmp (private) -> dst * 10, a chain of two kernels.
    let chain = |src: &Buffer<u32>, dst: &Buffer<u32>, deps: &[gantry::Node]| {
        let k = graph
            .add(
                |cg| {
                    let (s, t) = (cg.read(src), cg.elements_out(&tmp));
                    cg.promote(&t, Promotion::Private);
                    cg.map(&s, &t, |v| v + 1);
                },
                deps,
            )
            .unwrap();
        graph
            .add(
                |cg| {
                    let (t, o) = (cg.read(&tmp), cg.elements_out(dst));
                    cg.promote(&t, Promotion::Private);
                    cg.map(&t, &o, |v| v * 10);
                },
                &[k],
            )
            .unwrap()
    };
    let first = chain(&x, &o1, &[]);
    let copy = graph.add(|cg| cg.copy(&o1, &y), &[first]).unwrap();
    chain(&y, &o2, &[copy]);
    let exec = graph.finalize(GraphProps::default().fused()).unwrap();
    assert_eq!((exec.fused_chains().len(), exec.partitions().len()), (2, 1));

    // Held back by a host access, the submission stays in the world to look at.
    let guard = x.write().unwrap();
    let done = rt.queue().submit_graph(&exec).unwrap();
    rt.flush();
    let internal_on_tmp = rt.with_world(|w| {
        let mut q = w.query::<(&Command, &Requirements)>();
        let (_, reqs) = q.iter(w).find(|(c, _)| c.kind == CommandKind::CommandBuffer).expect("the partition");
        reqs.0.iter().filter(|r| r.internal && r.buffer.id == tmp.id()).count()
    });
    assert_eq!(internal_on_tmp, 1);
    drop(guard);
    done.wait().unwrap();
    assert_eq!(o1.to_vec().unwrap(), vec![40; n]);
    assert_eq!(o2.to_vec().unwrap(), vec![410; n]);
    assert_eq!(tmp.to_vec().unwrap(), vec![0; n], "internalized: never written back");
}

/// A recorded chain whose intermediates stay in global memory fuses only where its
/// memory outgrows what the device's caches hold
/// ([`WindowThresholds::judge_chain`]): on the CPU, a small one stays unfused and
/// `not_fused` says why; the same chain with its intermediate promoted, or over
/// more memory than the threshold, fuses; results are the same each way.
#[test]
fn graph_fusion_leaves_cache_resident_global_chains_unfused() {
    let n = 4096;
    // A 64 KiB threshold: the chain over 4,096 `u32` (three 16 KiB buffers) is below
    // it; over 8,192 (three 32 KiB buffers) above.
    let small = WindowThresholds { min_items: 1 << 20, min_global_bytes: 64 << 10 };
    let cases = [
        ("the CPU's own thresholds", manual(), n, false),
        ("a 64 KiB threshold", manual_with(small), n, false),
        ("a 64 KiB threshold, over twice the memory", manual_with(small), 2 * n, false),
        ("a 64 KiB threshold, the intermediate promoted", manual_with(small), n, true),
    ];
    for (label, rt, len, private) in cases {
        let threshold = match label {
            "the CPU's own thresholds" => rt.devices()[0].caps.fusion_window.min_global_bytes,
            _ => small.min_global_bytes,
        };
        let (x, tmp, out) =
            (rt.buffer(&vec![3u32; len]), rt.buffer_zeroed::<u32>(len), rt.buffer_zeroed::<u32>(len));
        let graph = rt.graph();
        add_chain(&graph, [&x, &tmp, &out], private);
        let exec = graph.finalize(GraphProps::default().fused()).unwrap();
        let bytes = (3 * len * 4) as u64;
        if !private && bytes < threshold {
            assert!(exec.fused_chains().is_empty(), "{label}: {:?}", exec.fused_chains());
            let why = exec.not_fused();
            assert!(
                matches!(
                    &why[..],
                    [gantry::NotFused::Refused {
                        reason: FusionError::Unprofitable {
                            reason: Unprofitable::CacheResident { bytes: b, min_bytes: m },
                            ..
                        },
                        ..
                    }] if *b == bytes && *m == threshold
                ),
                "{label}: {why:?}"
            );
        } else {
            assert_eq!(exec.fused_chains().len(), 1, "{label}: {:?}", exec.not_fused());
        }
        for _ in 0..2 {
            rt.queue().submit_graph(&exec).unwrap().wait().unwrap();
            assert_eq!(out.to_vec().unwrap(), vec![40; len], "{label}");
        }
        let written = if private && !exec.fused_chains().is_empty() { 0 } else { 4 };
        assert_eq!(tmp.to_vec().unwrap(), vec![written; len], "{label}: the intermediate");
    }
}

#[test]
fn graph_fusion_does_not_fuse_across_a_copy_between_kernels() {
    // Fusion's mechanics, not its thresholds: the chains fuse at any size.
    let rt = manual_with(WindowThresholds::ALWAYS);
    let (a, b, c) = (rt.buffer(&[1u32; 64]), rt.buffer_zeroed::<u32>(64), rt.buffer_zeroed::<u32>(64));
    let graph = rt.graph();
    let k1 = affine(&graph, &a, 2, 0, &[]);
    let copy = graph.add(|cg| cg.copy(&a, &b), &[k1]).unwrap();
    let k2 = graph
        .add(
            |cg| {
                let (x, y) = (cg.read(&b), cg.elements_out(&c));
                cg.parallel_for(64, move |it| *y.elem(it) = x.get(it, it.global_linear_id()) + 1);
            },
            &[copy],
        )
        .unwrap();
    affine(&graph, &c, 3, 0, &[k2]);
    let exec = graph.finalize(GraphProps::default().fused()).unwrap();
    assert_eq!(exec.not_fused().len(), 1, "{:?}", exec.not_fused());
    assert!(
        matches!(&exec.not_fused()[0], gantry::NotFused::OrderedBetween { between, .. } if between.contains("copy")),
        "{:?}",
        exec.not_fused()
    );
    assert_eq!(exec.fused_chains().len(), 1, "the two kernels after the copy still fuse");
    rt.queue().submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![2; 64]);
    assert_eq!(c.to_vec().unwrap(), vec![9; 64]);
}

#[test]
fn graphs_replay_on_the_simulated_device() {
    let rt = manual_sim();
    let q = rt.queue_with(gantry::QueueOptions { device: 1, in_order: true }).unwrap();
    let buf = rt.buffer(&[1u32; 64]);
    let graph = rt.graph_on(1);
    graph.begin_recording(&q).unwrap();
    for _ in 0..3 {
        q.submit(|cg| {
            let b = cg.elements_mut(&buf);
            cg.parallel_for(64, move |it| *b.elem(it) *= 2);
        })
        .unwrap();
    }
    graph.end_recording(&q).unwrap();
    let exec = graph.finalize(GraphProps::default()).unwrap();
    assert_eq!(exec.partitions()[0].device, 1);
    for round in 1..=3u32 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![1 << (3 * round); 64]);
    }
}

#[test]
fn a_failing_node_fails_the_execution_and_its_dependents_only() {
    let rt = manual();
    let (a, b) = (rt.buffer(&[1u32; 8]), rt.buffer(&[1u32; 8]));
    let graph = rt.graph();
    let bad = graph
        .add(
            |cg| {
                let x = cg.elements_mut(&a);
                cg.parallel_for(8, move |it| {
                    *x.elem(it) = 99;
                    if it.global_linear_id() == 7 {
                        panic!("boom");
                    }
                });
            },
            &[],
        )
        .unwrap();
    affine(&graph, &a, 2, 0, &[bad]);
    affine(&graph, &b, 2, 0, &[]);
    let exec = graph.finalize(GraphProps::default()).unwrap();
    let err = rt.queue().submit_graph(&exec).unwrap().wait().unwrap_err();
    assert!(matches!(err, Error::Exec(ExecError::KernelPanicked { .. })), "{err}");
    assert_eq!(a.to_vec().unwrap(), vec![1; 8], "last valid contents kept");
    assert_eq!(b.to_vec().unwrap(), vec![2; 8], "independent node ran");
    // The runtime keeps going.
    rt.queue().submit(|cg| cg.fill(&a, 4)).unwrap().wait().unwrap();
    assert_eq!(a.to_vec().unwrap(), vec![4; 8]);
}

/// A failed replay fails only itself: the next submission of the same graph, made
/// after it finished, runs (the edge between submissions orders, it does not poison).
#[test]
fn a_failed_replay_does_not_fail_later_replays() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let rt = manual();
    let buf = rt.buffer(&[1u32; 8]);
    let fail = Arc::new(AtomicBool::new(true));
    let graph = rt.graph();
    let armed = fail.clone();
    graph
        .add(
            |cg| {
                let x = cg.elements_mut(&buf);
                cg.parallel_for(8, move |it| {
                    *x.elem(it) *= 3;
                    if armed.load(Ordering::Relaxed) && it.global_linear_id() == 7 {
                        panic!("first replay fails");
                    }
                });
            },
            &[],
        )
        .unwrap();
    let exec = graph.finalize(GraphProps::default()).unwrap();
    let q = rt.queue();
    assert!(q.submit_graph(&exec).unwrap().wait().is_err());
    assert_eq!(buf.to_vec().unwrap(), vec![1; 8], "restored");
    fail.store(false, Ordering::Relaxed);
    for round in 1..=2 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![3u32.pow(round); 8]);
    }
}

#[test]
fn typed_errors_for_misuse() {
    let rt = manual();
    let q = rt.queue();
    let buf = rt.buffer(&[0u32; 4]);
    let graph = rt.graph();
    let a = affine(&graph, &buf, 1, 1, &[]);
    let b = affine(&graph, &buf, 1, 1, &[a]);
    assert_eq!(graph.make_edge(a, a), Err(Error::SelfEdge(0)));
    assert_eq!(graph.make_edge(b, a), Err(Error::CycleEdge { from: 1, to: 0 }));
    let other = rt.graph();
    let foreign = other.add_empty(&[]).unwrap();
    assert!(matches!(graph.make_edge(foreign, a), Err(Error::ForeignNode { .. })));
    assert!(matches!(graph.add_empty(&[foreign]), Err(Error::ForeignNode { .. })));
    // The opt-out of the cycle check: finalize finds the cycle.
    let cyclic = rt.graph();
    let x = cyclic.add_empty(&[]).unwrap();
    let y = cyclic.add_empty(&[x]).unwrap();
    cyclic.make_edge_unchecked(y, x).unwrap();
    assert!(matches!(
        cyclic.finalize(GraphProps::default()),
        Err(Error::Finalize(FinalizeError::Cycle { .. }))
    ));

    // Recording.
    let eager = q.submit(|cg| cg.fill(&buf, 1)).unwrap();
    graph.begin_recording(&q).unwrap();
    assert_eq!(graph.begin_recording(&q), Err(Error::AlreadyRecording(q.id())));
    assert_eq!(other.begin_recording(&q), Err(Error::AlreadyRecording(q.id())));
    assert_eq!(q.wait(), Err(Error::QueueRecording(q.id())));
    assert!(matches!(graph.add_empty(&[]), Err(Error::GraphRecording(_))));
    assert!(matches!(graph.finalize(GraphProps::default()), Err(Error::GraphRecording(_))));
    let recorded = q.submit(|cg| cg.fill(&buf, 2)).unwrap();
    assert!(matches!(recorded.wait(), Err(Error::RecordedEvent(_))));
    assert!(matches!(buf.to_vec(), Err(Error::BufferRecorded(_))));
    assert!(matches!(
        q.submit(|cg| {
            cg.depends_on(&eager);
        }),
        Err(Error::EventOutsideGraph(_))
    ));
    assert!(matches!(q.start_fusion(), Err(Error::QueueRecording(_))));
    graph.end_recording(&q).unwrap();
    assert_eq!(graph.end_recording(&q), Err(Error::NotRecording { queue: q.id(), graph: graph.id() }));
    // After recording: host access works again, and a recorded event is still not
    // something eager work can depend on.
    assert_eq!(buf.to_vec().unwrap(), vec![1; 4]);
    assert!(matches!(
        q.submit(|cg| {
            cg.depends_on(&recorded);
        }),
        Err(Error::RecordedEvent(_))
    ));

    // Updates.
    let exec = graph.finalize(GraphProps::default()).unwrap();
    assert!(matches!(exec.update(&graph), Err(Error::NotUpdatable(_))));
    let updatable = graph.finalize(GraphProps::default().updatable()).unwrap();
    let smaller = rt.graph();
    affine(&smaller, &buf, 1, 1, &[]);
    let mismatch = |g: &CommandGraph| match updatable.update(g) {
        Err(Error::TopologyMismatch(why)) => why,
        other => panic!("{other:?}"),
    };
    assert_eq!(mismatch(&smaller), "3 nodes, the update has 1");
    let rewired = rt.graph();
    let other_buf = rt.buffer(&[0u32; 4]);
    affine(&rewired, &buf, 1, 1, &[]);
    affine(&rewired, &other_buf, 1, 1, &[]); // no edge to the first
    rewired.add(|cg| cg.fill(&other_buf, 3), &[]).unwrap();
    assert_eq!(mismatch(&rewired), "node 1 depends on [0], in the update on []");
    // Node 0 over another range (no patch), node 2 of another kind: still found.
    let late = rt.graph();
    let longer = rt.buffer(&[0u32; 8]);
    let first = affine(&late, &longer, 1, 1, &[]);
    affine(&late, &other_buf, 1, 1, &[first]);
    late.add_empty(&[]).unwrap();
    assert_eq!(mismatch(&late), "node 2 is of kind fill, in the update of kind empty");
    let p = graph.dynamic_buffer(&buf);
    assert!(matches!(updatable.update_param(&p, &longer), Err(Error::ParamMismatch { .. })));
    assert!(matches!(graph.set_arg(a, 3, &p), Err(Error::ParamMismatch { .. })));
    let q2 = other.dynamic_buffer(&longer);
    assert!(matches!(graph.set_arg(a, 0, &q2), Err(Error::ParamMismatch { .. })));
}

#[test]
fn a_node_the_driver_cannot_record_fails_finalize_as_unsupported() {
    let rt = manual();
    let buf = rt.buffer(&[7u32; 4]);
    let out = gantry::Readback::new();
    let graph = rt.graph();
    graph.add(|cg| cg.copy_to_host(&buf, .., &out), &[]).unwrap();
    match graph.finalize(GraphProps::default()) {
        Err(Error::Finalize(FinalizeError::Unsupported { node: 0, what, .. })) => {
            assert_eq!(what, "memory buffer read")
        }
        other => panic!("expected an unsupported-feature error, got {:?}", other.err()),
    }
    // The simulated device cannot record host-to-buffer writes either.
    let rt = manual_sim();
    let buf = rt.buffer(&[0u32; 4]);
    let graph = rt.graph_on(1);
    graph.add(|cg| cg.copy_from_host(&[1u32, 2, 3, 4], &buf, 0), &[]).unwrap();
    assert!(matches!(
        graph.finalize(GraphProps::default()),
        Err(Error::Finalize(FinalizeError::Unsupported { .. }))
    ));
}

/// Whole-graph updates that replace each current buffer by one new buffer patch the
/// command buffers (new kernels, fill patterns), also when two current buffers become
/// one (their entries then bind the same memory). Both give the results of the
/// update graph freshly finalized, on the CPU and the simulated device, and leave the
/// current graph's buffers alone.
#[test]
fn updates_with_one_to_one_and_merged_buffers_run_the_new_graph() {
    let sim = manual_sim();
    for (rt, device) in [(manual(), 0), (sim, 1)] {
        // out1 = fill(f) then in1 * m + 1; out2 = in2 * m + 2 (the two reads are
        // independent, so in1 == in2 keeps the topology).
        let build =
            |in1: &Buffer<u32>, in2: &Buffer<u32>, out1: &Buffer<u32>, out2: &Buffer<u32>, f: u32, m: u32| {
                let g = rt.graph_on(device);
                let fill = g.add(|cg| cg.fill(out1, f), &[]).unwrap();
                for (i, (src, dst)) in [(in1, out1), (in2, out2)].into_iter().enumerate() {
                    let deps = if i == 0 { vec![fill] } else { vec![] };
                    g.add(
                        |cg| {
                            let (s, o) = (cg.read(src), cg.read_write(dst));
                            let add = i as u32 + 1;
                            cg.parallel_for(16, move |it| {
                                let k = it.global_linear_id();
                                o.set(it, k, o.get(it, k) + s.get(it, k) * m + add)
                            });
                        },
                        &deps,
                    )
                    .unwrap();
                }
                g
            };
        let buf = |v: u32| rt.buffer(&[v; 16]);
        let (a1, a2, a3, a4) = (buf(1), buf(2), buf(0), buf(0));
        let exec = build(&a1, &a2, &a3, &a4, 10, 2).finalize(GraphProps::default().updatable()).unwrap();
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: true }).unwrap();
        let patch_and_run = |g: &CommandGraph| {
            let sent = messages(&rt);
            exec.update(g).unwrap();
            assert_eq!(messages(&rt), sent, "patched, not recorded (device {device})");
            q.submit_graph(&exec).unwrap().wait().unwrap();
        };
        // One to one: other buffers, kernels and fill value.
        let (b1, b2, b3, b4) = (buf(3), buf(4), buf(0), buf(0));
        let g = build(&b1, &b2, &b3, &b4, 100, 5);
        patch_and_run(&g);
        assert_eq!(b3.to_vec().unwrap(), vec![100 + 3 * 5 + 1; 16], "device {device}");
        assert_eq!(b4.to_vec().unwrap(), vec![4 * 5 + 2; 16], "device {device}");
        assert_eq!(exec.partitions(), g.finalize(GraphProps::default()).unwrap().partitions());
        // Merged: both kernels read one buffer where the plan has two.
        let (c1, c3, c4) = (buf(6), buf(0), buf(0));
        patch_and_run(&build(&c1, &c1, &c3, &c4, 1000, 7));
        assert_eq!(c3.to_vec().unwrap(), vec![1000 + 6 * 7 + 1; 16], "device {device}");
        assert_eq!(c4.to_vec().unwrap(), vec![6 * 7 + 2; 16], "device {device}");
        assert_eq!(a3.to_vec().unwrap(), vec![0; 16], "the first graph's buffers are left alone");
        assert_eq!(b3.to_vec().unwrap(), vec![100 + 3 * 5 + 1; 16]);
    }
}

/// An update may merge a buffer one node writes with one a later node reads (ordered
/// by an explicit edge in the first graph): the partition's requirements on the
/// merged buffer become one, and the reader sees the writer's data, on the CPU and
/// the simulated device, replay after replay.
#[test]
fn an_update_that_merges_a_written_and_a_read_buffer_orders_them() {
    let sim = manual_sim();
    for (rt, device) in [(manual(), 0), (sim, 1)] {
        // produce: dst = 7 * k; consume: out += src (after produce).
        let build = |dst: &Buffer<u32>, src: &Buffer<u32>, out: &Buffer<u32>, k: u32| {
            let g = rt.graph_on(device);
            let produce = g
                .add(
                    |cg| {
                        let d = cg.elements_out(dst);
                        cg.parallel_for(dst.len(), move |it| *d.elem(it) = 7 * k);
                    },
                    &[],
                )
                .unwrap();
            g.add(
                |cg| {
                    let (s, o) = (cg.read(src), cg.elements_mut(out));
                    cg.parallel_for(out.len(), move |it| {
                        let i = it.global_linear_id();
                        *o.elem(it) += s.get(it, i)
                    });
                },
                &[produce],
            )
            .unwrap();
            g
        };
        let buf = |v: u32| rt.buffer(&[v; 32]);
        let (a, b, out1) = (buf(0), buf(1), buf(0));
        let exec = build(&a, &b, &out1, 1).finalize(GraphProps::default().updatable()).unwrap();
        let (c, out2) = (buf(0), buf(0));
        let update = build(&c, &c, &out2, 3);
        let sent = messages(&rt);
        exec.update(&update).unwrap();
        assert_eq!(messages(&rt), sent, "patched, not recorded anew");
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: false }).unwrap();
        for round in 1..=3 {
            q.submit_graph(&exec).unwrap().wait().unwrap();
            assert_eq!(out2.to_vec().unwrap(), vec![21 * round; 32], "device {device}, replay {round}");
        }
        assert_eq!(c.to_vec().unwrap(), vec![21; 32]);
        assert_eq!((a.to_vec().unwrap(), out1.to_vec().unwrap()), (vec![0; 32], vec![0; 32]));
    }
}

/// An executable graph keeps the buffers of the graph it was last updated from
/// alive: after the update graph and the handle of its accumulator are dropped, the
/// accumulator keeps its value on the simulated device from replay to replay.
#[test]
fn an_update_keeps_the_new_buffers_alive() {
    let rt = manual_sim();
    let out = rt.buffer_zeroed::<u32>(8);
    // acc += 1 on the device; out = acc.
    let build = |acc: &Buffer<u32>| {
        let g = rt.graph_on(1);
        let bump = affine(&g, acc, 1, 1, &[]);
        g.add(
            |cg| {
                let (a, o) = (cg.read(acc), cg.elements_out(&out));
                cg.parallel_for(8, move |it| *o.elem(it) = a.get(it, it.global_linear_id()));
            },
            &[bump],
        )
        .unwrap();
        g
    };
    let first = rt.buffer(&[0u32; 8]);
    let exec = build(&first).finalize(GraphProps::default().updatable()).unwrap();
    {
        let second = rt.buffer(&[10u32; 8]);
        exec.update(&build(&second)).unwrap();
        // The update graph and `second`'s handle drop here.
    }
    let q = rt.queue_with(gantry::QueueOptions { device: 1, in_order: true }).unwrap();
    for _ in 0..3 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        rt.flush();
    }
    assert_eq!(out.to_vec().unwrap(), vec![13; 8], "the accumulator lived through all three replays");
    assert_eq!(first.to_vec().unwrap(), vec![0; 8]);
}

/// An update whose nodes use other ranges than the plan's cannot patch the recorded
/// arguments: it keeps the partitions and records the command buffers again, and
/// runs as the update graph freshly finalized does.
#[test]
fn an_update_over_other_ranges_records_anew() {
    for (rt, device) in [(manual(), 0), (manual_sim(), 1)] {
        let src = rt.buffer(&(0..16u32).collect::<Vec<_>>());
        let out = rt.buffer_zeroed::<u32>(8);
        // out[i] = src[from + i] * 2, then + 1.
        let build = |from: usize| {
            let g = rt.graph_on(device);
            let copy = g
                .add(
                    |cg| {
                        let (s, o) =
                            (cg.access::<u32, gantry::Read>(&src, from..from + 8), cg.elements_out(&out));
                        cg.parallel_for(8, move |it| *o.elem(it) = s.get(it, it.global_linear_id()) * 2);
                    },
                    &[],
                )
                .unwrap();
            affine(&g, &out, 1, 1, &[copy]);
            g
        };
        let exec = build(0).finalize(GraphProps::default().updatable()).unwrap();
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: true }).unwrap();
        q.submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(out.to_vec().unwrap(), (0..8).map(|i| i * 2 + 1).collect::<Vec<u32>>());
        let g = build(8);
        let sent = messages(&rt);
        exec.update(&g).unwrap();
        assert!(messages(&rt) > sent, "recorded by the scheduler (device {device})");
        assert_eq!(exec.partitions(), g.finalize(GraphProps::default()).unwrap().partitions());
        q.submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(
            out.to_vec().unwrap(),
            (8..16).map(|i| i * 2 + 1).collect::<Vec<u32>>(),
            "device {device}"
        );
    }
}
