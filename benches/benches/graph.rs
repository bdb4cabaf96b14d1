//! Command graphs against eager submission: host cost per node of one frame of N
//! tiny kernels, N = 100, 1,000, 10,000.
//!
//! A frame is N one-work-item kernels over [`BUFFERS`] one-element buffers. Node `i`
//! reads a shared input `src` (argument slot 0), reads buffer `r` (slot 1) and writes
//! buffer `w != r` (slot 2), with `r`, `w` drawn by a fixed-seed xorshift; its body is
//! `bufs[w][0] = bufs[r][0] + src[0]` (wrapping). So every node has real dependency
//! edges (read-after-write on `r`; write-after-read and write-after-write on `w`):
//! chains and fans across the buffers, derived from the accesses as Gantry does for
//! eager work.
//!
//! Variants, all per frame, with `Throughput::Elements(N)` (criterion's
//! "elem/s" is nodes per second; `ns/node = 1e9 / throughput`):
//! * `eager`: the N command groups submitted to an out-of-order queue, then
//!   `Queue::wait`;
//! * `replay`: `submit_graph` of the finalized graph, then a wait on its event;
//! * `replay_submit`: the `submit_graph` call alone (timed per call; the wait after
//!   each call is not timed);
//! * `build`: `CommandGraph::add` of the frame's N nodes into a new graph (edges
//!   derived from their accesses; the graph's drop is not timed);
//! * `finalize`: `CommandGraph::finalize` of the already-built graph (the executable
//!   graph's drop is not timed);
//! * `update_param`: `ExecutableGraph::update_param` of a dynamic parameter bound to
//!   slot 0 of all N nodes, alternating between two input buffers;
//! * `update`: whole-graph `ExecutableGraph::update` from a second graph of identical
//!   topology over a second set of buffers, alternating between the two graphs.
//!
//! Runtime sets (every variant of a set on the same runtime, with
//! `preserve_on_failure(false)` so no kernel copies its written range first):
//! * `cpu_threaded`: scheduler thread, default CPU worker threads;
//! * `cpu_inline`: manual mode, `worker_threads(0)`: everything on the benchmark
//!   thread;
//! * `sim`: manual mode, the graph and queue on a simulated device (device 1).
//!
//! Ids: `graph/{set}/{N}/{variant}`. Before its benchmarks each fixture checks, bit
//! for bit, that one graph replay leaves the buffers as one eager frame does, also
//! after `update_param` and after a whole-graph `update` (which must then leave the
//! first buffer set alone). After each group no command may be left alive and none
//! may have failed. On 2 cores the whole file takes about 1.5 minutes, `-- --quick`
//! about one (most of it the N = 10,000 eager frames and finalizes).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, SamplingMode, Throughput};
mod common;

use common::XorShift;
use gantry::{
    Buffer, CommandGraph, DynamicBuffer, ExecutableGraph, GraphProps, Handler, Mode, Queue, QueueOptions,
    Runtime,
};

/// Nodes per frame.
const SIZES: [usize; 3] = [100, 1_000, 10_000];
/// Buffers the nodes read and write.
const BUFFERS: usize = 16;

/// One node's buffers: it reads `read` and writes `write`.
#[derive(Clone, Copy)]
struct Pick {
    read: usize,
    write: usize,
}

fn picks(n: usize) -> Vec<Pick> {
    let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            let write = rng.below(BUFFERS);
            let read = (write + 1 + rng.below(BUFFERS - 1)) % BUFFERS;
            Pick { read, write }
        })
        .collect()
}

/// One node's command group: `bufs[w][0] = bufs[r][0] + src[0]`.
fn node(cg: &mut Handler, src: &Buffer<u32>, bufs: &[Buffer<u32>], p: Pick) {
    let s = cg.read(src);
    let r = cg.read(&bufs[p.read]);
    let w = cg.write(&bufs[p.write]);
    cg.single_task(move |it| w.set(it, 0, r.get(it, 0).wrapping_add(s.get(it, 0))));
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    CpuThreaded,
    CpuInline,
    Sim,
}

impl Set {
    fn name(self) -> &'static str {
        match self {
            Set::CpuThreaded => "cpu_threaded",
            Set::CpuInline => "cpu_inline",
            Set::Sim => "sim",
        }
    }

    fn runtime(self) -> Runtime {
        let b = Runtime::builder().preserve_on_failure(false);
        match self {
            Set::CpuThreaded => b.mode(Mode::Threaded).build(),
            Set::CpuInline => b.mode(Mode::Manual).worker_threads(0).build(),
            Set::Sim => b.mode(Mode::Manual).worker_threads(0).sim(common::sim_gpu()).build(),
        }
    }

    fn device(self) -> u32 {
        if self == Set::Sim {
            1
        } else {
            0
        }
    }
}

/// A runtime, its queue, two buffer sets with their inputs, the two graphs (set `k`
/// over `bufs[k]`, `src[k]`) and the executable graphs, kept across a group.
struct Fixture {
    rt: Runtime,
    q: Queue,
    picks: Vec<Pick>,
    src: [Buffer<u32>; 2],
    bufs: [Vec<Buffer<u32>>; 2],
    graphs: [CommandGraph; 2],
    /// Graph 0's parameter, bound to slot 0 (`src`) of every node.
    param: DynamicBuffer<u32>,
    /// Graph 0 finalized with default properties.
    exec: ExecutableGraph,
    /// Graph 0 finalized as updatable.
    updatable: ExecutableGraph,
    /// Which input `update_param` / graph `update` switches to next.
    flip: bool,
}

impl Fixture {
    fn new(set: Set, n: usize) -> Self {
        let rt = set.runtime();
        let q = rt.queue_with(QueueOptions { device: set.device(), in_order: false }).expect("queue");
        let picks = picks(n);
        let src = [rt.buffer(&[1u32]), rt.buffer(&[3u32])];
        let bufs = [0, 1].map(|_| (0..BUFFERS).map(|_| rt.buffer_zeroed::<u32>(1)).collect::<Vec<_>>());
        let build = |k: usize| {
            let g = rt.graph_on(set.device());
            let nodes: Vec<_> = picks
                .iter()
                .map(|&p| g.add(|cg| node(cg, &src[k], &bufs[k], p), &[]).expect("add"))
                .collect();
            let param = g.dynamic_buffer(&src[k]);
            for &nd in &nodes {
                g.set_arg(nd, 0, &param).expect("set_arg");
            }
            (g, param)
        };
        let (g0, param) = build(0);
        let (g1, _) = build(1);
        let exec = g0.finalize(GraphProps::default()).expect("finalize");
        let updatable = g0.finalize(GraphProps::default().updatable()).expect("finalize updatable");
        let edges: usize = g0.edges().iter().map(Vec::len).sum();
        eprintln!(
            "graph/{}/{n}: {n} nodes, {edges} edges, {} partition(s)",
            set.name(),
            exec.partitions().len()
        );
        let fx = Fixture { rt, q, picks, src, bufs, graphs: [g0, g1], param, exec, updatable, flip: false };
        fx.verify(set, n);
        fx
    }

    /// One eager frame over buffer set `k` with input `src[s]`, waited for.
    fn eager(&self, k: usize, s: usize) {
        for &p in &self.picks {
            self.q.submit(|cg| node(cg, &self.src[s], &self.bufs[k], p)).expect("submit");
        }
        self.q.wait().expect("queue wait");
    }

    fn replay(&self, exec: &ExecutableGraph) {
        self.q.submit_graph(exec).expect("submit_graph").wait().expect("replay");
    }

    fn values(&self, k: usize) -> Vec<u32> {
        self.bufs[k].iter().map(|b| b.to_vec().expect("read back")[0]).collect()
    }

    fn reset(&self) {
        for b in self.bufs.iter().flatten() {
            b.write().expect("host write")[0] = 0;
        }
    }

    /// Replays match eager frames bit for bit, before and after both kinds of update.
    fn verify(&self, set: Set, n: usize) {
        let label = format!("graph/{}/{n}", set.name());
        let frame = |run: &dyn Fn()| {
            self.reset();
            run();
            (self.values(0), self.values(1))
        };
        let eager0 = frame(&|| self.eager(0, 0));
        assert!(eager0.0.iter().any(|&v| v != 0), "{label}: the eager frame wrote nothing");
        assert_eq!(frame(&|| self.replay(&self.exec)), eager0, "{label}: replay");
        assert_eq!(frame(&|| self.replay(&self.updatable)), eager0, "{label}: updatable replay");

        // update_param: slot 0 of every node reads src[1] instead.
        let eager_src1 = frame(&|| self.eager(0, 1));
        assert_ne!(eager_src1, eager0, "{label}: the input makes no difference");
        self.updatable.update_param(&self.param, &self.src[1]).expect("update_param");
        assert_eq!(frame(&|| self.replay(&self.updatable)), eager_src1, "{label}: after update_param");
        self.updatable.update_param(&self.param, &self.src[0]).expect("update_param back");
        assert_eq!(frame(&|| self.replay(&self.updatable)), eager0, "{label}: after update_param back");

        // Whole-graph update: graph 1 writes buffer set 1 (reading src[1]) only.
        let eager1 = frame(&|| self.eager(1, 1));
        assert!(eager1.0.iter().all(|&v| v == 0), "{label}: eager set 1 touched set 0");
        self.updatable.update(&self.graphs[1]).expect("update");
        assert_eq!(frame(&|| self.replay(&self.updatable)), eager1, "{label}: after update");
        self.updatable.update(&self.graphs[0]).expect("update back");
        assert_eq!(frame(&|| self.replay(&self.updatable)), eager0, "{label}: after update back");
        self.reset();
    }

    /// Nothing left alive, nothing failed.
    fn check_flat(&self, label: &str) {
        self.rt.wait_idle().expect("wait_idle");
        let stats = self.rt.stats();
        assert_eq!(stats.live_commands, 0, "{label}: commands left alive: {stats:?}");
        assert_eq!(stats.in_driver, 0, "{label}: operations left in the driver: {stats:?}");
        assert_eq!(stats.failed, 0, "{label}: commands failed: {stats:?}");
    }
}

/// Short sampling: 10 samples; big frames sample flat.
fn configure(group: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    group
        .throughput(Throughput::Elements(n as u64))
        .sample_size(10)
        .measurement_time(Duration::from_millis(if n >= 10_000 { 1_500 } else { 700 }))
        .warm_up_time(Duration::from_millis(if n >= 10_000 { 100 } else { 200 }))
        .sampling_mode(if n >= 10_000 { SamplingMode::Flat } else { SamplingMode::Auto });
}

fn set_bench(c: &mut Criterion, set: Set, n: usize) {
    let label = format!("graph/{}/{n}", set.name());
    let mut group = c.benchmark_group(&label);
    configure(&mut group, n);
    // Built on first use, so a filtered run does not build the others.
    let mut fixture: Option<Fixture> = None;

    group.bench_function("eager", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                fx.eager(0, 0);
            }
            start.elapsed()
        });
    });
    group.bench_function("replay", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                fx.replay(&fx.exec);
            }
            start.elapsed()
        });
    });
    group.bench_function("replay_submit", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter_custom(|iters| {
            let mut submitting = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let ev = fx.q.submit_graph(&fx.exec).expect("submit_graph");
                submitting += start.elapsed();
                ev.wait().expect("replay");
            }
            submitting
        });
    });
    group.bench_function("build", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter_with_large_drop(|| {
            let g = fx.rt.graph_on(set.device());
            for &p in &fx.picks {
                g.add(|cg| node(cg, &fx.src[0], &fx.bufs[0], p), &[]).expect("add");
            }
            g
        });
    });
    group.bench_function("finalize", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter_with_large_drop(|| fx.graphs[0].finalize(GraphProps::default()).expect("finalize"));
    });
    group.bench_function("update_param", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter(|| {
            fx.flip = !fx.flip;
            let src = &fx.src[usize::from(fx.flip)];
            fx.updatable.update_param(&fx.param, black_box(src)).expect("update_param");
        });
    });
    group.bench_function("update", |b| {
        let fx = fixture.get_or_insert_with(|| Fixture::new(set, n));
        b.iter(|| {
            fx.flip = !fx.flip;
            fx.updatable.update(&fx.graphs[usize::from(fx.flip)]).expect("update");
        });
    });
    group.finish();
    if let Some(fx) = &fixture {
        fx.check_flat(&label);
    }
}

fn benches(c: &mut Criterion) {
    for set in [Set::CpuThreaded, Set::CpuInline, Set::Sim] {
        for n in SIZES {
            set_bench(c, set, n);
        }
    }
}

criterion_group!(graph, benches);
criterion_main!(graph);
