//! Building a command graph: host cost per node by access pattern, N = 1,000 and
//! 10,000 nodes.
//!
//! * `chain`: every node read-writes all of one buffer (each node depends on the
//!   previous one);
//! * `disjoint`: node `i` writes element `i` of one buffer of N elements (no node
//!   depends on another, and every earlier write stays a leaf of the buffer);
//! * `readers`: every node reads all of one buffer and writes its own element of a
//!   second (a buffer every node reads).
//!
//! Each node is a one-work-item kernel added with `CommandGraph::add`, its edges
//! derived from its accesses; the graph's drop is not timed. Building is linear in
//! the nodes for every pattern when the per-node cost does not grow from N = 1,000 to
//! N = 10,000 and `disjoint` stays within 1.5 times `chain`. Ids:
//! `graph_build/{pattern}/{N}`, throughput in nodes.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gantry::{Mode, ReadWrite, Runtime};

#[derive(Clone, Copy)]
enum Pattern {
    Chain,
    Disjoint,
    Readers,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Chain => "chain",
            Pattern::Disjoint => "disjoint",
            Pattern::Readers => "readers",
        }
    }
}

fn build(
    rt: &Runtime,
    pattern: Pattern,
    n: usize,
    a: &gantry::Buffer<u32>,
    b: &gantry::Buffer<u32>,
) -> Duration {
    let graph = rt.graph();
    let start = Instant::now();
    for i in 0..n {
        match pattern {
            Pattern::Chain => graph.add(
                |cg| {
                    let x = cg.read_write(a);
                    cg.single_task(move |it| x.set(it, 0, x.get(it, 0) + 1));
                },
                &[],
            ),
            Pattern::Disjoint => graph.add(
                |cg| {
                    let x = cg.elements::<u32, ReadWrite>(a, i..i + 1);
                    cg.single_task(move |it| *x.elem(it) += 1);
                },
                &[],
            ),
            Pattern::Readers => graph.add(
                |cg| {
                    let (x, y) = (cg.read(a), cg.elements::<u32, ReadWrite>(b, i..i + 1));
                    cg.single_task(move |it| *y.elem(it) += x.get(it, 0));
                },
                &[],
            ),
        }
        .expect("node");
    }
    let elapsed = start.elapsed();
    let edges: usize = graph.edges().iter().map(Vec::len).sum();
    let expected = match pattern {
        Pattern::Chain => n - 1,
        Pattern::Disjoint | Pattern::Readers => 0,
    };
    assert_eq!(edges, expected, "{} edges", pattern.name());
    elapsed
}

fn benches(c: &mut Criterion) {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).build();
    for pattern in [Pattern::Chain, Pattern::Disjoint, Pattern::Readers] {
        let mut group = c.benchmark_group(format!("graph_build/{}", pattern.name()));
        for n in [1_000usize, 10_000] {
            let (a, b) = (rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
            group.throughput(Throughput::Elements(n as u64)).sample_size(20);
            group.bench_function(BenchmarkId::from_parameter(n), |bench| {
                bench.iter_custom(|iters| (0..iters).map(|_| build(&rt, pattern, n, &a, &b)).sum());
            });
        }
        group.finish();
    }
}

criterion_group!(graph_build, benches);
criterion_main!(graph_build);
