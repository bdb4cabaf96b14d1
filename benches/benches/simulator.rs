//! Simulator speed: simulated commands per second of wall time.
//!
//! `simulator/sim_commands/N`: a deterministic runtime (manual mode, CPU driver
//! inline) with one simulated device runs N kernels with random dependencies over 64
//! device-resident buffers, under a cost model with limited engines, submitted eagerly
//! in batches of 1,000: every command goes through every stage of the scheduler. The
//! `baseline` group of the `scheduler` benchmark is the same loop's cost without
//! Gantry.
//!
//! `simulator/sim_graph_replay/N`: the same 1,000 kernels recorded once as a command
//! graph (one frame) and replayed N / 1,000 times, as `gantry-sim --mode graph` runs a
//! workload: the simulated device still runs and times every kernel, while the
//! scheduler sees one command per partition. Checked at setup: three replays leave
//! the buffers bit for bit as three eager passes of the same kernels do.
//!
//! The figure is wall time per simulated kernel (throughput: simulated commands per
//! second).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
mod common;

use gantry::{Buffer, ExecutableGraph, GraphProps, Handler, Mode, Queue, QueueOptions, Runtime};

const BATCH: usize = 1_000;
const BUFFERS: usize = 64;

/// A runtime with one simulated device, a queue on it and the 64 buffers.
fn sim_runtime() -> (Runtime, Queue, Vec<Buffer<u32>>) {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).sim(common::sim_gpu()).build();
    let q = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
    let bufs = (0..BUFFERS).map(|_| rt.buffer_zeroed::<u32>(16)).collect();
    (rt, q, bufs)
}

/// The buffers (read, written) of the next random kernel.
fn next_kernel(x: &mut u64) -> (usize, usize) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    let r = (*x % BUFFERS as u64) as usize;
    let w = (r + 1 + (*x >> 8) as usize % (BUFFERS - 1)) % BUFFERS;
    (r, w)
}

/// The kernel: `bufs[w][0] = bufs[r][0] + 1`.
fn kernel(cg: &mut Handler, bufs: &[Buffer<u32>], (r, w): (usize, usize)) {
    let r = cg.read(&bufs[r]);
    let w = cg.write(&bufs[w]);
    cg.single_task(move |it| w.set(it, 0, r.get(it, 0) + 1));
}

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// `n` random kernels submitted eagerly on `q`, in batches of [`BATCH`].
fn submit_eager(rt: &Runtime, q: &Queue, bufs: &[Buffer<u32>], n: usize) {
    let mut x = SEED;
    for batch in 0..n.div_ceil(BATCH) {
        for _ in 0..BATCH.min(n - batch * BATCH) {
            let rw = next_kernel(&mut x);
            q.submit(|cg| kernel(cg, bufs, rw)).unwrap();
        }
        rt.wait_idle().unwrap();
    }
}

fn simulate(n: usize) -> u64 {
    let (rt, q, bufs) = sim_runtime();
    submit_eager(&rt, &q, &bufs, n);
    let stats = rt.stats();
    assert_eq!(stats.live_commands, 0, "memory flat");
    stats.completed
}

/// A frame of [`BATCH`] random kernels recorded as a graph and finalized.
struct Frame {
    rt: Runtime,
    q: Queue,
    bufs: Vec<Buffer<u32>>,
    exec: ExecutableGraph,
}

impl Frame {
    fn new() -> Self {
        let (rt, q, bufs) = sim_runtime();
        let graph = rt.graph();
        let mut x = SEED;
        for _ in 0..BATCH {
            let rw = next_kernel(&mut x);
            graph.add(|cg| kernel(cg, &bufs, rw), &[]).unwrap();
        }
        let exec = graph.finalize(GraphProps::default()).unwrap();
        Self { rt, q, bufs, exec }
    }

    /// `frames` replays, waited for.
    fn replay(&self, frames: usize) {
        for _ in 0..frames {
            self.q.submit_graph(&self.exec).unwrap();
        }
        self.rt.wait_idle().unwrap();
    }

    fn values(bufs: &[Buffer<u32>]) -> Vec<u32> {
        bufs.iter().map(|b| b.to_vec().unwrap()[0]).collect()
    }

    /// Three replays give what three eager passes of the same kernels give.
    fn verify(&self) {
        self.replay(3);
        let (rt, q, bufs) = sim_runtime();
        for _ in 0..3 {
            submit_eager(&rt, &q, &bufs, BATCH);
        }
        let (got, want) = (Self::values(&self.bufs), Self::values(&bufs));
        assert_eq!(got, want, "graph replay differs from eager submission");
        assert!(want.iter().any(|&v| v > 1), "the kernels ran");
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("simulator");
    for n in [10_000usize, 100_000, 1_000_000] {
        group.throughput(Throughput::Elements(n as u64));
        if n >= 1_000_000 {
            group.sample_size(10).measurement_time(Duration::from_secs(20));
        } else {
            group.sample_size(10).measurement_time(Duration::from_secs(5));
        }
        group.bench_with_input(BenchmarkId::new("sim_commands", n), &n, |b, &n| {
            b.iter(|| black_box(simulate(n)))
        });
    }
    let frame = Frame::new();
    frame.verify();
    for n in [10_000usize, 100_000, 1_000_000] {
        group.throughput(Throughput::Elements(n as u64));
        group.sample_size(10).measurement_time(Duration::from_secs(5));
        group.bench_with_input(BenchmarkId::new("sim_graph_replay", n), &n, |b, &n| {
            b.iter(|| frame.replay(n / BATCH))
        });
    }
    // The last replay's read-back returns when its copy completes, which the
    // scheduler retires in a later flush: wait for that before counting.
    frame.rt.wait_idle().unwrap();
    let stats = frame.rt.stats();
    assert_eq!(stats.live_commands, 0, "memory flat");
    assert_eq!(stats.failed, 0);
    group.finish();
}

criterion_group!(simulator, bench);
criterion_main!(simulator);
