//! The LLVM JIT on the host (feature `jit`): kernels written in OpenCL C, compiled by
//! clang and `gantry-jit` into native work-group functions, against hand-written Rust
//! loops doing the same arithmetic, on one thread (`HostKernel::run_groups` over every
//! group on the benchmark thread, no scheduler): what the compiled code costs.
//!
//! * `elementwise/16M`: `y[i] = a·x[i] + y[i]` over 16M `f32`, `rust_loop` against
//!   `jit` (work-groups of 4,096).
//! * `stencil/2048`: the main job's 5-point stencil (`frame_loop`) over a 2,048² grid,
//!   edges copied, `rust_loop` (the serial reference's loop) against `jit` (one
//!   work-group per row).
//! * `compile`: a cold compile of the elementwise kernel (a new compiler each time:
//!   parse, work-group function, O3, machine code) and a cache hit (the same image
//!   again through one compiler).
//!
//! The Rust loops are compiled for the binary's target (SSE2 on a default x86-64
//! build); the JIT compiles for the CPU it runs on. `RUSTFLAGS="-C target-cpu=native"`
//! compares them at the same instruction set.
//!
//! Needs clang 19 at run time (the kernels are OpenCL C): `cargo bench -p
//! gantry-benches --features jit --bench jit`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gantry::jit::{from_opencl_c, HostCompiler, HostLaunch};
use gantry::{AccessMode, Signature};

const SAXPY: &str = "kernel void saxpy(global const float* x, global float* y, float a) {
    size_t i = get_global_id(0);
    y[i] = a * x[i] + y[i];
}";

const STENCIL: &str = "#pragma OPENCL FP_CONTRACT OFF
kernel void stencil(global const float* cur, global float* next, uint h, uint w, float alpha) {
    uint x = get_global_id(0), y = get_global_id(1);
    uint i = y * w + x;
    float c = cur[i];
    if (y == 0 || x == 0 || y == h - 1 || x == w - 1) { next[i] = c; return; }
    next[i] = c + alpha * (cur[i - w] + cur[i + w] + cur[i - 1] + cur[i + 1] - 4.0f * c);
}";

const ALPHA: f32 = 0.2;

fn saxpy_signature() -> Signature {
    Signature::new().global(AccessMode::Read).global(AccessMode::ReadWrite).scalar::<f32>()
}

fn elementwise(c: &mut Criterion) {
    let n = 1usize << 24;
    let image = from_opencl_c(SAXPY, "saxpy").expect("clang 19 compiles the kernel");
    let kernel = HostCompiler::new().compile(&image, &saxpy_signature()).expect("the JIT compiles it");
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let mut y = vec![1f32; n];
    let mut g = c.benchmark_group("elementwise/16M");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(20);
    let a = black_box(0.5f32);
    g.bench_function("rust_loop", |b| {
        b.iter(|| {
            for (y, x) in y.iter_mut().zip(&x) {
                *y += a * *x;
            }
            black_box(&mut y);
        })
    });
    let scalars = a.to_ne_bytes();
    g.bench_function("jit", |b| {
        b.iter(|| {
            let globals = [x.as_ptr() as *mut u8, y.as_mut_ptr().cast()];
            let launch = HostLaunch::new(&globals, &scalars, &[], [n, 1, 1], [4096, 1, 1]);
            // SAFETY: both buffers hold the n floats the kernel touches; nothing else
            // uses them during the call.
            unsafe { kernel.run_groups(&launch, 0, launch.group_count()).expect("a valid launch") };
            black_box(&mut y);
        })
    });
    g.finish();
}

fn stencil(c: &mut Criterion) {
    let (h, w) = (2048usize, 2048usize);
    let image = from_opencl_c(STENCIL, "stencil").expect("clang 19 compiles the kernel");
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::DiscardWrite)
        .scalar::<u32>()
        .scalar::<u32>()
        .scalar::<f32>();
    let kernel = HostCompiler::new().compile(&image, &sig).expect("the JIT compiles it");
    let cur: Vec<f32> = (0..h * w).map(|i| (i % 977) as f32).collect();
    let mut next = vec![0f32; h * w];
    let mut g = c.benchmark_group("stencil/2048");
    g.throughput(Throughput::Elements((h * w) as u64));
    g.sample_size(20);
    g.bench_function("rust_loop", |b| {
        b.iter(|| {
            for y in 0..h {
                for x in 0..w {
                    let i = y * w + x;
                    let c = cur[i];
                    next[i] = if y == 0 || x == 0 || y == h - 1 || x == w - 1 {
                        c
                    } else {
                        c + ALPHA * (cur[i - w] + cur[i + w] + cur[i - 1] + cur[i + 1] - 4.0 * c)
                    };
                }
            }
            black_box(&mut next);
        })
    });
    let mut scalars = Vec::new();
    scalars.extend((h as u32).to_ne_bytes());
    scalars.extend((w as u32).to_ne_bytes());
    scalars.extend(ALPHA.to_ne_bytes());
    let reference = next.clone();
    g.bench_function("jit", |b| {
        b.iter(|| {
            let globals = [cur.as_ptr() as *mut u8, next.as_mut_ptr().cast()];
            let launch = HostLaunch::new(&globals, &scalars, &[], [w, h, 1], [w, 1, 1]);
            // SAFETY: both grids hold the h·w floats the kernel touches; nothing else
            // uses them during the call.
            unsafe { kernel.run_groups(&launch, 0, launch.group_count()).expect("a valid launch") };
            black_box(&mut next);
        })
    });
    g.finish();
    assert_eq!(next, reference, "the JIT stencil computes the Rust loop's grid, bit for bit");
}

fn compile(c: &mut Criterion) {
    let image = from_opencl_c(SAXPY, "saxpy").expect("clang 19 compiles the kernel");
    let sig = saxpy_signature();
    let mut g = c.benchmark_group("compile");
    g.sample_size(10);
    g.bench_function("cold", |b| b.iter(|| black_box(HostCompiler::new().compile(&image, &sig).unwrap())));
    let warm = HostCompiler::new();
    warm.compile(&image, &sig).unwrap();
    g.bench_function("cache_hit", |b| b.iter(|| black_box(warm.compile(&image, &sig).unwrap())));
    g.finish();
}

criterion_group!(benches, elementwise, stencil, compile);
criterion_main!(benches);
