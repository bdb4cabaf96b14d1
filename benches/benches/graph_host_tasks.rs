//! Host tasks in a replayed command graph: host cost per node of a frame whose host
//! tasks are recorded into the CPU device's command buffers against the same frame
//! with each host task in a partition of its own (the SYCL graph extension's
//! implementation design), in the same run.
//!
//! A frame is a chain of N nodes over one one-element `u64` buffer, alternating a
//! one-work-item kernel (`x += 1`) and a host task (`x *= 3`, through a host
//! accessor): N / 2 host tasks, each between two kernels. Variants, per frame, with
//! `Throughput::Elements(N)` (`ns/node = 1e9 / throughput`):
//! * `recorded`: `CpuConfig::record_host_tasks` on (the default): one partition, one
//!   command buffer, the host tasks run in place;
//! * `isolated`: off: N / 2 host-task partitions and N / 2 kernel partitions, each a
//!   command of its own at every replay.
//!
//! Runtime sets: `cpu_inline` (manual mode, no worker threads) and `cpu_threaded`
//! (scheduler thread, default workers), with `preserve_on_failure(false)`. Before its
//! benchmark each fixture checks the buffer after one replay against the serial
//! result, and that the frame has the partitions its variant says. After each, no
//! command may be left alive and none may have failed.
//!
//! `cargo bench -p gantry-benches --bench graph_host_tasks` (under a minute on 2
//! cores).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gantry::{Buffer, ExecutableGraph, GraphProps, Mode, Queue, Runtime};

const SIZES: [usize; 2] = [100, 1000];

struct Frame {
    rt: Runtime,
    q: Queue,
    x: Buffer<u64>,
    exec: ExecutableGraph,
    n: usize,
}

impl Frame {
    fn new(threaded: bool, record: bool, n: usize) -> Self {
        let b = Runtime::builder().preserve_on_failure(false).record_host_tasks(record);
        let rt = match threaded {
            true => b.mode(Mode::Threaded).build(),
            false => b.mode(Mode::Manual).worker_threads(0).build(),
        };
        let x = rt.buffer(&[0u64]);
        let graph = rt.graph();
        let mut last = None;
        for i in 0..n {
            let deps: Vec<_> = last.into_iter().collect();
            let node = if i % 2 == 0 {
                graph.add(
                    |cg| {
                        let v = cg.elements_mut(&x);
                        cg.single_task(move |it| *v.elem(it) += 1);
                    },
                    &deps,
                )
            } else {
                graph.add(
                    |cg| {
                        let mut v = cg.host_read_write(&x);
                        cg.host_task(move |ctx| v.as_mut_slice(ctx)[0] *= 3);
                    },
                    &deps,
                )
            };
            last = Some(node.expect("a node"));
        }
        let exec = graph.finalize(GraphProps::default()).expect("finalize");
        let parts = exec.partitions();
        let want = if record { 1 } else { n };
        assert_eq!(
            parts.len(),
            want,
            "partitions of the {} frame",
            if record { "recorded" } else { "isolated" }
        );
        let q = rt.queue();
        Self { rt, q, x, exec, n }
    }

    fn replay(&self) {
        self.q.submit_graph(&self.exec).expect("submit").wait().expect("replay");
    }

    fn check(&self) {
        self.x.write().expect("host write")[0] = 0;
        self.replay();
        let want =
            (0..self.n).fold(0u64, |v, i| if i % 2 == 0 { v.wrapping_add(1) } else { v.wrapping_mul(3) });
        assert_eq!(self.x.to_vec().expect("read")[0], want, "one replay");
    }

    fn check_flat(&self, label: &str) {
        self.rt.wait_idle().expect("idle");
        let stats = self.rt.stats();
        assert_eq!(stats.live_commands, 0, "{label}: commands left alive: {stats:?}");
        assert_eq!(stats.failed, 0, "{label}: commands failed: {stats:?}");
    }
}

fn host_tasks(c: &mut Criterion) {
    for (set, threaded) in [("cpu_inline", false), ("cpu_threaded", true)] {
        let mut group = c.benchmark_group(format!("graph_host_tasks/{set}"));
        group
            .sample_size(20)
            .measurement_time(Duration::from_millis(800))
            .warm_up_time(Duration::from_millis(200));
        for n in SIZES {
            group.throughput(Throughput::Elements(n as u64));
            for (variant, record) in [("recorded", true), ("isolated", false)] {
                let frame = Frame::new(threaded, record, n);
                frame.check();
                let id = BenchmarkId::new(variant, n);
                group.bench_function(id, |b| b.iter(|| frame.replay()));
                frame.check_flat(&format!("graph_host_tasks/{set}/{variant}/{n}"));
            }
        }
        group.finish();
    }
}

criterion_group!(benches, host_tasks);
criterion_main!(benches);
