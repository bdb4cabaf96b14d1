//! Simulator speed: simulated commands per second of wall time.
//!
//! A deterministic runtime (manual mode, CPU driver inline) with one simulated device
//! runs N kernels with random dependencies over 64 device-resident buffers, under a
//! cost model with limited engines, in batches of 1,000. The figure is wall time per
//! simulated command (throughput: simulated commands per second); the `baseline`
//! group of the `scheduler` benchmark is the same loop's cost without Gantry.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
mod common;

use gantry::{Mode, QueueOptions, Runtime};

const BATCH: usize = 1_000;
const BUFFERS: usize = 64;

fn simulate(n: usize) -> u64 {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).sim(common::sim_gpu()).build();
    let q = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
    let bufs: Vec<_> = (0..BUFFERS).map(|_| rt.buffer_zeroed::<u32>(16)).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for batch in 0..n.div_ceil(BATCH) {
        for _ in 0..BATCH.min(n - batch * BATCH) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let r = (x % BUFFERS as u64) as usize;
            let w = (r + 1 + (x >> 8) as usize % (BUFFERS - 1)) % BUFFERS;
            q.submit(|cg| {
                let r = cg.read(&bufs[r]);
                let w = cg.write(&bufs[w]);
                cg.single_task(move |it| w.set(it, 0, r.get(it, 0) + 1));
            })
            .unwrap();
        }
        rt.wait_idle().unwrap();
    }
    let stats = rt.stats();
    assert_eq!(stats.live_commands, 0, "memory flat");
    stats.completed
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
    group.finish();
}

criterion_group!(simulator, bench);
criterion_main!(simulator);
