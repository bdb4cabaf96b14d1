//! Host cost per command, from `submit` to completion, with no-op kernels.
//!
//! Every benchmark submits N single-work-item kernels whose body does nothing, in
//! batches of [`BATCH`] commands each followed by a wait, so what is measured is the
//! scheduler: building the command group, ingesting it, resolving its dependencies,
//! handing it to the CPU driver, and retiring it. Criterion's throughput is commands
//! per second; `ns/command = 1e9 / throughput`.
//!
//! Shapes:
//! * `random_deps`: each kernel reads 1–2 and writes 1 of 64 small buffers chosen by a
//!   fixed-seed xorshift.
//! * `chain`: every kernel read-writes one buffer (one long dependency chain).
//! * `fan_out_in`: one writer, N-2 readers of its buffer each writing its own element
//!   of one large buffer (range accessors), and one kernel reading all of them.
//! * `baseline`: the same no-op closure called directly (through `black_box`), with
//!   the same random picks as `random_deps`: the harness's own cost.
//!
//! Each shape runs in threaded mode (scheduler thread, default CPU worker threads) and
//! in manual mode with `worker_threads(0)` (everything on the benchmark thread).
//! After each benchmark the runtime must have no command left alive
//! (`Stats::live_commands == 0`): finished commands are despawned, memory stays flat.
//!
//! `GANTRY_BENCH_WAIT=queue` waits with `Queue::wait` (a barrier) instead of
//! `Runtime::wait_idle` after each batch.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput,
};
mod common;

use common::XorShift;
use gantry::{Buffer, Mode, Queue, Runtime, Write};

/// Commands submitted between two waits.
const BATCH: usize = 1_000;
/// Command counts per benchmark iteration.
const SIZES: [usize; 4] = [1_000, 10_000, 100_000, 1_000_000];
/// Buffers `random_deps` picks from.
const BUFFERS: usize = 64;

/// One `random_deps` command: the buffer it writes, one or two it reads.
#[derive(Clone, Copy)]
struct Pick {
    write: usize,
    read1: usize,
    read2: Option<usize>,
}

impl Pick {
    fn draw(rng: &mut XorShift) -> Self {
        let write = rng.below(BUFFERS);
        let read1 = (write + 1 + rng.below(BUFFERS - 1)) % BUFFERS;
        let read2 = (rng.next() & 1 == 1).then(|| loop {
            let r = rng.below(BUFFERS);
            if r != write && r != read1 {
                break r;
            }
        });
        Self { write, read1, read2 }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    RandomDeps,
    Chain,
    FanOutIn,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::RandomDeps => "random_deps",
            Shape::Chain => "chain",
            Shape::FanOutIn => "fan_out_in",
        }
    }
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Threaded => "threaded",
        Mode::Manual => "manual",
    }
}

fn runtime(mode: Mode) -> Runtime {
    match mode {
        Mode::Threaded => Runtime::builder().mode(Mode::Threaded).build(),
        Mode::Manual => Runtime::builder().mode(Mode::Manual).worker_threads(0).build(),
    }
}

/// A runtime and the buffers one benchmark uses, kept across its iterations.
struct Fixture {
    rt: Runtime,
    q: Queue,
    /// `random_deps`' buffers; `chain` uses the first, `fan_out_in`'s writer too.
    small: Vec<Buffer<u32>>,
    /// `fan_out_in`'s per-reader slots (N-2 elements).
    slots: Option<Buffer<u32>>,
    rng: XorShift,
    wait_on_queue: bool,
}

impl Fixture {
    fn new(mode: Mode, shape: Shape, n: usize) -> Self {
        let rt = runtime(mode);
        let q = rt.queue();
        let small = (0..BUFFERS).map(|_| rt.buffer_zeroed::<u32>(16)).collect();
        let slots = (shape == Shape::FanOutIn).then(|| rt.buffer_zeroed::<u32>(n - 2));
        let wait_on_queue = std::env::var("GANTRY_BENCH_WAIT").is_ok_and(|v| v == "queue");
        Self { rt, q, small, slots, rng: XorShift::new(0x9E37_79B9_7F4A_7C15), wait_on_queue }
    }

    fn wait(&self) {
        if self.wait_on_queue {
            self.q.wait().expect("queue wait");
        } else {
            self.rt.wait_idle().expect("wait_idle");
        }
    }

    /// Submits `n` commands of `shape`, waiting after every [`BATCH`].
    fn run(&mut self, shape: Shape, n: usize) {
        for i in 0..n {
            match shape {
                Shape::RandomDeps => self.random_deps_one(),
                Shape::Chain => self.chain_one(),
                Shape::FanOutIn => self.fan_out_in_one(i, n),
            }
            if (i + 1) % BATCH == 0 || i + 1 == n {
                self.wait();
            }
        }
    }

    fn random_deps_one(&mut self) {
        let p = Pick::draw(&mut self.rng);
        let b = &self.small;
        self.q
            .submit(|cg| {
                let _r1 = cg.read(&b[p.read1]);
                if let Some(r2) = p.read2 {
                    let _r2 = cg.read(&b[r2]);
                }
                let _w = cg.write(&b[p.write]);
                cg.single_task(|_| {});
            })
            .expect("submit");
    }

    fn chain_one(&mut self) {
        let b = &self.small[0];
        self.q
            .submit(|cg| {
                let _rw = cg.read_write(b);
                cg.single_task(|_| {});
            })
            .expect("submit");
    }

    fn fan_out_in_one(&mut self, i: usize, n: usize) {
        let src = &self.small[0];
        let slots = self.slots.as_ref().expect("fan_out_in slots");
        self.q
            .submit(|cg| {
                if i == 0 {
                    let _w = cg.write(src);
                } else if i == n - 1 {
                    let _all = cg.read(slots);
                } else {
                    let _r = cg.read(src);
                    let _slot = cg.access::<u32, Write>(slots, i - 1..i);
                }
                cg.single_task(|_| {});
            })
            .expect("submit");
    }

    /// Memory stays flat: nothing is left alive once the last batch was waited for.
    fn check_flat(&self, label: &str, n: usize) {
        let stats = self.rt.stats();
        assert_eq!(stats.live_commands, 0, "{label}: commands left alive: {stats:?}");
        assert_eq!(stats.in_driver, 0, "{label}: operations left in the driver: {stats:?}");
        assert!(stats.live_records <= BUFFERS as u64 + 1, "{label}: records grew: {stats:?}");
        assert_eq!(stats.failed, 0, "{label}: commands failed: {stats:?}");
        if n >= 1_000_000 {
            eprintln!(
                "{label}: memory flat: live_commands={} live_records={} after {} commands (all iterations)",
                stats.live_commands, stats.live_records, stats.completed
            );
        }
    }
}

/// Per-N sampling: big N get few samples (one iteration each) so a full run takes a
/// few minutes.
fn configure(group: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    group.throughput(Throughput::Elements(n as u64));
    let (samples, measure, warm) = if n <= 1_000 {
        (30, 1_000, 300)
    } else if n <= 10_000 {
        (15, 1_500, 300)
    } else if n <= 100_000 {
        (10, 2_000, 1)
    } else {
        (10, 3_000, 1)
    };
    group
        .sample_size(samples)
        .measurement_time(Duration::from_millis(measure))
        .warm_up_time(Duration::from_millis(warm))
        .sampling_mode(if n >= 100_000 { SamplingMode::Flat } else { SamplingMode::Auto });
}

fn shape_bench(c: &mut Criterion, shape: Shape, mode: Mode) {
    let mut group = c.benchmark_group(format!("{}/{}", shape.name(), mode_name(mode)));
    for n in SIZES {
        configure(&mut group, n);
        let mut fixture: Option<Fixture> = None;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            let fx = fixture.get_or_insert_with(|| Fixture::new(mode, shape, n));
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    fx.run(shape, n);
                }
                start.elapsed()
            });
        });
        if let Some(fx) = fixture {
            fx.check_flat(&format!("{}/{}/{n}", shape.name(), mode_name(mode)), n);
        }
    }
    group.finish();
}

/// The harness alone: the same picks and a direct call of a no-op closure.
fn baseline(c: &mut Criterion) {
    let mut group = c.benchmark_group("baseline");
    let noop = |p: Pick| {
        let _ = p;
    };
    for n in SIZES {
        configure(&mut group, n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            let mut rng = XorShift::new(0x9E37_79B9_7F4A_7C15);
            b.iter(|| {
                for _ in 0..n {
                    let p = Pick::draw(&mut rng);
                    let f: &dyn Fn(Pick) = black_box(&noop);
                    f(black_box(p));
                }
            });
        });
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    baseline(c);
    for shape in [Shape::RandomDeps, Shape::Chain, Shape::FanOutIn] {
        for mode in [Mode::Threaded, Mode::Manual] {
            shape_bench(c, shape, mode);
        }
    }
}

criterion_group!(scheduler, benches);
criterion_main!(scheduler);
