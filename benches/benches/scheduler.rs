//! Host cost per command, submit plus wait, with no-op kernels: the four shapes of
//! the eager-submission issue.
//!
//! Every benchmark submits N single-work-item kernels whose body does nothing, then
//! waits once on the queue (`Queue::wait`), so what is measured is the scheduler:
//! building each command group, handing it over, ingesting it, resolving its
//! dependencies, enqueueing it on the CPU driver and retiring it. Criterion's
//! throughput is commands per second; `ns/command = 1e9 / throughput`.
//!
//! Shapes:
//! * `indep`: kernels with no accessors (no dependencies at all).
//! * `chain`: every kernel read-writes one buffer (one long dependency chain).
//! * `fan`: one writer, N-2 readers of its buffer each writing its own element of
//!   one large buffer (element accessors), and one kernel reading all of them.
//! * `wavefront`: an S×S grid (N = S²) in one buffer; cell (i, j) reads cells
//!   (i-1, j) and (i, j-1) and writes its own, three element accessors, submitted
//!   row by row. Its parameter is N; S = √N.
//! * `baseline`: the harness alone, a no-op closure called N times through
//!   `black_box`.
//! * `round`: one `indep` command and its wait: a flush that carries one command, the
//!   fixed cost a frame pays at each point where it waits for its work.
//!
//! Each shape runs in threaded mode (scheduler thread, default CPU worker threads) and
//! in manual mode with `worker_threads(0)` (everything on the benchmark thread).
//! After each benchmark the runtime must have no command left alive
//! (`Stats::live_commands == 0`): finished commands are despawned, memory stays flat.
//!
//! `GANTRY_BENCH_MAX` caps N (default 1,000,000).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput,
};

use gantry::Mode;
use gantry_benches::eager::{mode_name, Fixture, Shape, SHAPES};

/// Command counts per benchmark iteration (wavefront: S² for S = 32, 100, 316, 1000).
const SIZES: [usize; 4] = [1_000, 10_000, 100_000, 1_000_000];

fn sizes() -> impl Iterator<Item = usize> {
    let max = std::env::var("GANTRY_BENCH_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    SIZES.into_iter().filter(move |&n| n <= max)
}

/// Per-N sampling: big N get few samples (one iteration each) so a full run takes a
/// few minutes.
fn configure(group: &mut BenchmarkGroup<'_, WallTime>, commands: usize) {
    group.throughput(Throughput::Elements(commands as u64));
    let (samples, measure, warm) = if commands <= 1_000 {
        (30, 1_000, 300)
    } else if commands <= 10_000 {
        (15, 1_500, 300)
    } else if commands <= 100_000 {
        (10, 2_000, 1)
    } else {
        (10, 3_000, 1)
    };
    group
        .sample_size(samples)
        .measurement_time(Duration::from_millis(measure))
        .warm_up_time(Duration::from_millis(warm))
        .sampling_mode(if commands >= 100_000 { SamplingMode::Flat } else { SamplingMode::Auto });
}

fn shape_bench(c: &mut Criterion, shape: Shape, mode: Mode) {
    let mut group = c.benchmark_group(format!("{}/{}", shape.name(), mode_name(mode)));
    for n in sizes() {
        configure(&mut group, shape.commands(n));
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
            fx.check_flat(&format!("{}/{}/{n}", shape.name(), mode_name(mode)));
        }
    }
    group.finish();
}

/// The harness alone: a direct call of a no-op closure per command.
fn baseline(c: &mut Criterion) {
    let mut group = c.benchmark_group("baseline");
    let noop = |i: usize| {
        let _ = i;
    };
    for n in sizes() {
        configure(&mut group, n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                for i in 0..n {
                    let f: &dyn Fn(usize) = black_box(&noop);
                    f(black_box(i));
                }
            });
        });
    }
    group.finish();
}

/// One command and its wait (`round/threaded`, `round/manual`).
fn round(c: &mut Criterion) {
    let mut group = c.benchmark_group("round");
    group.throughput(Throughput::Elements(1));
    group
        .sample_size(30)
        .measurement_time(Duration::from_millis(1_500))
        .warm_up_time(Duration::from_millis(300));
    for mode in [Mode::Threaded, Mode::Manual] {
        let mut fixture: Option<Fixture> = None;
        group.bench_function(mode_name(mode), |b| {
            let fx = fixture.get_or_insert_with(|| Fixture::new(mode, Shape::Indep, 1));
            b.iter(|| fx.run(Shape::Indep, 1));
        });
        if let Some(fx) = fixture {
            fx.check_flat(&format!("round/{}", mode_name(mode)));
        }
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    baseline(c);
    round(c);
    for shape in SHAPES {
        for mode in [Mode::Threaded, Mode::Manual] {
            shape_bench(c, shape, mode);
        }
    }
}

criterion_group!(scheduler, benches);
criterion_main!(scheduler);
