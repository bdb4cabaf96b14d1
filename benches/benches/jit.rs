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
//! * `fusion/16M`: a chain of 8 `out = a_k·in + b_k` kernels over 16M `f32` with its 7
//!   intermediates promoted to private memory: `rust_hand_fused` (one loop applying
//!   the 8 steps), `jit_unfused` (the 8 kernels one after the other through real
//!   intermediate buffers), `jit_fused` (fused by `IrFusion` with the default
//!   barriers between kernels) and `jit_fused_no_barriers`.
//! * `fusion_compile`: fusing and compiling the 8 kernels cold (new compilers each
//!   time), and a fusion cache hit.
//!
//! The Rust loops are compiled for the binary's target (SSE2 on a default x86-64
//! build); the JIT compiles for the CPU it runs on. `RUSTFLAGS="-C target-cpu=native"`
//! compares them at the same instruction set.
//!
//! Needs clang 19 at run time (the kernels are OpenCL C): `cargo bench -p
//! gantry-benches --features jit --bench jit`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gantry::driver::fusion::{FusionArg, FusionCompiler, FusionKernel, FusionRequest, Promotion};
use gantry::driver::{Geometry, ImageKind, Range};
use gantry::jit::{from_opencl_c, HostCompiler, HostLaunch, IrFusion};
use gantry::{AccessMode, Kernel, KernelRef, Signature};

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

const STEP: &str = "kernel void step(global const float* in, global float* out, float a, float b) {
    size_t i = get_global_id(0);
    out[i] = a * in[i] + b;
}";

/// Kernel `k`'s coefficients.
fn coefficients(k: usize) -> (f32, f32) {
    (1.0 + k as f32 / 64.0, k as f32 / 8.0 - 0.5)
}

/// The chain as a fusion request over buffers 0 (input) … 8 (output), the
/// intermediates promoted to private memory.
fn chain_request(step: &KernelRef, n: usize, barriers: bool) -> FusionRequest {
    let geometry = Geometry::for_range(Range::d1(n)).expect("a valid range");
    let arg = |buffer: usize| {
        let a = FusionArg::new(buffer as u64, 0..n * 4, 4);
        if (1..8).contains(&buffer) {
            a.promoted(Promotion::Private)
        } else {
            a
        }
    };
    let kernels = (0..8)
        .map(|k| {
            let (a, b) = coefficients(k);
            FusionKernel {
                kernel: step.clone(),
                geometry,
                args: [arg(k), arg(k + 1)].into_iter().collect(),
                scalars: [a.to_ne_bytes(), b.to_ne_bytes()].concat().into_iter().collect(),
                deps: Default::default(),
            }
        })
        .collect();
    FusionRequest { kernels, barriers }
}

fn fusion(c: &mut Criterion) {
    let n = 1usize << 24;
    let sig =
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).scalar::<f32>().scalar::<f32>();
    let image = from_opencl_c(STEP, "step").expect("clang 19 compiles the kernel");
    let step = Kernel::new("step", sig.clone()).with_image(image.clone()).into_ref();
    let host = HostCompiler::new();
    let unfused = host.compile(&image, &sig).expect("the JIT compiles it");
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 / 100.0).collect();
    let mut bufs: Vec<Vec<f32>> = (0..9).map(|_| vec![0f32; n]).collect();
    bufs[0].copy_from_slice(&x);
    let mut g = c.benchmark_group("fusion/16M");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    let mut out = vec![0f32; n];
    g.bench_function("rust_hand_fused", |b| {
        b.iter(|| {
            for (o, &v) in out.iter_mut().zip(&x) {
                *o = (0..8).fold(v, |v, k| {
                    let (a, b) = coefficients(k);
                    a * v + b
                });
            }
            black_box(&mut out);
        })
    });
    g.bench_function("jit_unfused", |b| {
        b.iter(|| {
            for k in 0..8 {
                let (a, bb) = coefficients(k);
                let scalars = [a.to_ne_bytes(), bb.to_ne_bytes()].concat();
                let globals = [bufs[k].as_ptr() as *mut u8, bufs[k + 1].as_mut_ptr().cast()];
                let launch = HostLaunch::new(&globals, &scalars, &[], [n, 1, 1], [4096, 1, 1]);
                // SAFETY: both buffers hold n floats; nothing else uses them.
                unsafe { unfused.run_groups(&launch, 0, launch.group_count()).expect("a valid launch") };
            }
            black_box(&mut bufs);
        })
    });
    for (name, barriers) in [("jit_fused", true), ("jit_fused_no_barriers", false)] {
        let fused = IrFusion::new().fuse(&chain_request(&step, n, barriers)).expect("the chain fuses");
        let image = fused.kernel.image(ImageKind::LlvmIr).expect("an IR image");
        let kernel = host.compile(image, &fused.kernel.signature).expect("the JIT compiles the fused kernel");
        let mut y = vec![0f32; n];
        g.bench_function(name, |b| {
            b.iter(|| {
                let globals = [x.as_ptr() as *mut u8, y.as_mut_ptr().cast()];
                let launch = HostLaunch::from_geometry(&fused.geometry, &globals, &[], &[]);
                // SAFETY: the fused arguments are the input and the output, n floats each.
                unsafe { kernel.run_groups(&launch, 0, launch.group_count()).expect("a valid launch") };
                black_box(&mut y);
            })
        });
        assert_eq!(y, bufs[8], "{name}: the fused chain computes the unfused one, bit for bit");
    }
    g.finish();

    let mut g = c.benchmark_group("fusion_compile");
    g.sample_size(10);
    g.bench_function("cold_fuse_and_compile_8", |b| {
        b.iter(|| {
            let fused = IrFusion::new().fuse(&chain_request(&step, n, true)).expect("the chain fuses");
            let image = fused.kernel.image(ImageKind::LlvmIr).expect("an IR image");
            black_box(HostCompiler::new().compile(image, &fused.kernel.signature).expect("compiles"))
        })
    });
    let warm = IrFusion::new();
    let request = chain_request(&step, n, true);
    warm.fuse(&request).expect("the chain fuses");
    g.bench_function("fusion_cache_hit_8", |b| b.iter(|| black_box(warm.fuse(&request).expect("a hit"))));
    g.finish();
}

criterion_group!(benches, elementwise, stencil, compile, fusion);
criterion_main!(benches);
