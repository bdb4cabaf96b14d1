//! The Vulkan driver through the driver contract (feature `vulkan`), on Vulkan device
//! 0 (lavapipe on a machine without a GPU): what a dispatch and a recorded partition
//! cost the host.
//!
//! * `dispatch/submit_wait`: one trivial WGSL dispatch submitted and waited for, one
//!   at a time (the first dispatch, which makes the pipeline, is outside the
//!   measurement).
//! * `partition_10k`: a partition of 10,000 independent dispatches with 6 buffers
//!   each (the shape of gfx-rs/wgpu issue #5766), host time only (each iteration
//!   then waits for the device, untimed): `record` is finalize (validation, barrier
//!   planning) plus the submission of the first replay, which records the Vulkan
//!   commands; `replay` the submission of a later replay; `one_by_one` the same
//!   dispatches as 10,000 submissions. Throughput is in dispatches. With the feature
//!   `wgpu`, `wgpu_encode_submit` is the same 10,000 dispatches through wgpu's Vulkan
//!   backend on the same device (the adapter whose name is the driver's device's):
//!   the same WGSL, one bind group per dispatch made up front (as an engine would),
//!   then per iteration a command encoder with one compute pass (the pipeline and
//!   the immediate set once, a bind group and a dispatch per dispatch), `finish` and
//!   `queue.submit`, host time only like the others (the wait for the submission is
//!   untimed). Issue #28's target: `replay` ≥ 10× cheaper than `wgpu_encode_submit`.
//! * `fused_chain`: eight chained elementwise WGSL kernels (`y = a x + b`, 256-wide
//!   workgroups: `step_bandwidth` shows why) over
//!   `GANTRY_VULKAN_FUSION_N` `f32`s (default 64M; a CPU device such as lavapipe
//!   wants a few million at most), submitted one after another (`unfused`, each
//!   waiting on the previous in the driver) or fused by the driver's
//!   [`WgslFusion`](gantry::vulkan::WgslFusion) into one kernel with the seven
//!   intermediates in private memory (`fused`, and `fused_without_barriers` for what
//!   the barriers between the kernels cost); submission to the last
//!   completion, throughput in elements. The target: fused ≥ 6× unfused at 64M.
//! * `step_bandwidth`: one `y = a x + b` dispatch over the same size, submission to
//!   completion, as the chain's step is written (`scalar_wg64`), with 256-invocation
//!   workgroups (`scalar_wg256`), and over `vec4<f32>` (`vec4_wg64`): where the
//!   kernel's time goes when the chain runs below the memory's bandwidth.
//!
//! `cargo bench -p gantry-benches --features vulkan --bench vulkan` (`--features
//! vulkan,wgpu` for the wgpu comparison). On a machine without any Vulkan device it
//! says so and measures nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gantry::driver::fusion::{Fused, FusionArg, FusionCompiler, FusionKernel, FusionRequest, Promotion};
use gantry::driver::sync::channel::{unbounded, Receiver};
use gantry::driver::{
    Accepted, AccessMode, AllocId, CodeImage, CommandBuffer, CommandBufferDesc, CommandBufferLaunch,
    Completion, DeviceOp, Driver, DriverContext, Geometry, ImageKind, Kernel, KernelLaunch, KernelRef,
    MemArg, MemRef, MemSlice, OpHandle, OpId, Range, RecordedArg, RecordedOp, ScalarBlock, Signature,
    Submission,
};
use gantry::vulkan::{VulkanConfig, VulkanDriver};

const TRIVIAL: &str = "struct S { n: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read_write> x: array<u32>;
@compute @workgroup_size(64)
fn trivial(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { x[id.x] = x[id.x] + 1u; }
}";

const SIX: &str = "struct S { n: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> a: array<u32>;
@group(0) @binding(1) var<storage, read> b: array<u32>;
@group(0) @binding(2) var<storage, read> c: array<u32>;
@group(0) @binding(3) var<storage, read> d: array<u32>;
@group(0) @binding(4) var<storage, read> e: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn six(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { out[id.x] = out[id.x] + a[id.x] + b[id.x] + c[id.x] + d[id.x] + e[id.x]; }
}";

/// Work-items per dispatch.
const N: usize = 64;
/// Dispatches per partition.
const COUNT: usize = 10_000;

/// The driver and its completions.
struct Gpu {
    driver: VulkanDriver,
    rx: Receiver<Completion>,
}

static NEXT: AtomicU64 = AtomicU64::new(1);

impl Gpu {
    fn open() -> Option<Self> {
        let (tx, rx) = unbounded();
        let ctx = DriverContext { completions: tx, clock: gantry::driver::Clock::starting_now(true) };
        match VulkanDriver::new(VulkanConfig::default(), ctx) {
            Ok(driver) => Some(Self { driver, rx }),
            Err(e) => {
                eprintln!("vulkan bench: no Vulkan device ({e}); nothing measured");
                None
            }
        }
    }

    /// Submits `op`; its id.
    fn submit(&self, op: DeviceOp) -> u64 {
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let sub = Submission { id: OpId(id), op, waits: &[], preserve_on_failure: false, hint: None };
        match self.driver.submit(sub).expect("the driver accepts the operation") {
            Accepted::Pending(_) => id,
            Accepted::Done(c) => {
                c.result.expect("the operation ran");
                0
            }
        }
    }

    /// Waits for `count` completions, all successful.
    fn wait(&self, count: usize) {
        for _ in 0..count {
            let c = self.rx.recv_timeout(Duration::from_secs(60)).expect("a completion within a minute");
            c.result.expect("the operation ran");
        }
    }

    /// Submits `op` waiting on `waits`; its handle (`None` where it ran inside
    /// `submit`).
    fn submit_after(&self, op: DeviceOp, waits: &[OpHandle]) -> Option<OpHandle> {
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let sub = Submission { id: OpId(id), op, waits, preserve_on_failure: false, hint: None };
        match self.driver.submit(sub).expect("the driver accepts the operation") {
            Accepted::Pending(h) => Some(h),
            Accepted::Done(c) => {
                c.result.expect("the operation ran");
                None
            }
        }
    }

    fn alloc(&self, bytes: usize) -> AllocId {
        self.driver.alloc(bytes).expect("device memory")
    }
}

fn wgsl_kernel(name: &str, source: &str, signature: Signature) -> KernelRef {
    Kernel::new(name, signature)
        .with_image(CodeImage::new(ImageKind::Wgsl, name, source.as_bytes()))
        .into_ref()
}

fn scalars(n: usize) -> ScalarBlock {
    (n as u32).to_ne_bytes().into_iter().collect()
}

fn whole(id: AllocId) -> MemSlice {
    MemSlice { mem: MemRef::Device(id), offset: 0, len: 4 * N }
}

fn dispatch(c: &mut Criterion) {
    let Some(gpu) = Gpu::open() else { return };
    let kernel =
        wgsl_kernel("trivial", TRIVIAL, Signature::new().global(AccessMode::ReadWrite).scalar::<u32>());
    let x = gpu.alloc(4 * N);
    let launch = || {
        DeviceOp::Kernel(KernelLaunch {
            kernel: kernel.clone(),
            geometry: Geometry::for_range(Range::d1(N)).expect("a valid range"),
            args: [MemArg { mem: whole(x), mode: AccessMode::ReadWrite }].into_iter().collect(),
            scalars: scalars(N),
        })
    };
    let id = gpu.submit(launch());
    gpu.wait(usize::from(id != 0)); // makes the pipeline
    let mut g = c.benchmark_group(format!("dispatch/{}", gpu.driver.device_name()));
    g.bench_function("submit_wait", |b| {
        b.iter(|| {
            let id = gpu.submit(launch());
            gpu.wait(usize::from(id != 0));
        })
    });
    g.finish();
}

fn partition(c: &mut Criterion) {
    let Some(gpu) = Gpu::open() else { return };
    let sig = (0..5).fold(Signature::new(), |s, _| s.global(AccessMode::Read)).global(AccessMode::ReadWrite);
    let kernel = wgsl_kernel("six", SIX, sig.scalar::<u32>());
    let entries = 5 + COUNT; // five shared inputs, one output per dispatch
    let op = |i: usize| RecordedOp::Kernel {
        kernel: kernel.clone(),
        geometry: Geometry::for_range(Range::d1(N)).expect("a valid range"),
        args: (0..5)
            .map(|e| RecordedArg { entry: e, offset: 0, len: 4 * N, mode: AccessMode::Read })
            .chain([RecordedArg {
                entry: (5 + i) as u32,
                offset: 0,
                len: 4 * N,
                mode: AccessMode::ReadWrite,
            }])
            .collect(),
        scalars: scalars(N),
    };
    let table: Vec<AllocId> = (0..entries).map(|_| gpu.alloc(4 * N)).collect();
    let args: smallvec::SmallVec<[MemArg; 4]> =
        table.iter().map(|&id| MemArg { mem: whole(id), mode: AccessMode::ReadWrite }).collect();
    let record = || -> CommandBuffer {
        let desc = CommandBufferDesc { entries, in_order: false, ops: COUNT };
        let mut b = gpu.driver.create_command_buffer(desc).expect("command buffers");
        for i in 0..COUNT {
            b.append(op(i), &[]).expect("a valid operation");
        }
        b.finalize().expect("finalize")
    };
    // Submits a replay of `buffer`: its id, to wait for.
    let replay = |buffer: &CommandBuffer| {
        gpu.submit(DeviceOp::CommandBuffer(CommandBufferLaunch {
            buffer: buffer.clone(),
            args: args.clone(),
        }))
    };
    // Host time of `submit` (which returns how many completions to wait for), the
    // device's work waited for outside it.
    let host_time = |iters: u64, submit: &mut dyn FnMut() -> usize| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let start = Instant::now();
            let pending = submit();
            total += start.elapsed();
            gpu.wait(pending);
        }
        total
    };
    let mut g = c.benchmark_group(format!("partition_10k/{}", gpu.driver.device_name()));
    g.throughput(Throughput::Elements(COUNT as u64));
    g.sample_size(10);
    g.bench_function("record", |b| {
        b.iter_custom(|iters| host_time(iters, &mut || usize::from(replay(&record()) != 0)))
    });
    let buffer = record();
    let first = replay(&buffer);
    gpu.wait(usize::from(first != 0));
    g.bench_function("replay", |b| {
        b.iter_custom(|iters| host_time(iters, &mut || usize::from(replay(&buffer) != 0)))
    });
    #[cfg(feature = "wgpu")]
    wgpu_frame::encode_submit(&mut g, gpu.driver.device_name());
    g.bench_function("one_by_one", |b| {
        b.iter_custom(|iters| {
            host_time(iters, &mut || {
                let mut pending = 0;
                for i in 0..COUNT {
                    let launch = DeviceOp::Kernel(KernelLaunch {
                        kernel: kernel.clone(),
                        geometry: Geometry::for_range(Range::d1(N)).expect("a valid range"),
                        args: (0..5)
                            .map(|e| MemArg { mem: whole(table[e]), mode: AccessMode::Read })
                            .chain([MemArg { mem: whole(table[5 + i]), mode: AccessMode::ReadWrite }])
                            .collect(),
                        scalars: scalars(N),
                    });
                    pending += usize::from(gpu.submit(launch) != 0);
                }
                pending
            })
        })
    });
    g.finish();
}

/// `partition_10k`'s dispatches through wgpu (feature `wgpu`).
#[cfg(feature = "wgpu")]
mod wgpu_frame {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};
    use std::time::{Duration, Instant};

    use criterion::measurement::WallTime;
    use criterion::BenchmarkGroup;

    use super::{COUNT, N, SIX};

    /// `future`'s output: wgpu-core's futures are ready when first polled, so no
    /// executor is needed.
    fn block_on<F: Future>(future: F) -> F::Output {
        let mut future = pin!(future);
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
                return v;
            }
            std::thread::yield_now();
        }
    }

    /// Measures `wgpu_encode_submit` in `g` on the Vulkan adapter named `device`;
    /// where wgpu has no such adapter it says so and measures nothing.
    pub fn encode_submit(g: &mut BenchmarkGroup<'_, WallTime>, device: &str) {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapters = block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
        let Some(adapter) = adapters.into_iter().find(|a| a.get_info().name == device) else {
            eprintln!("vulkan bench: wgpu has no Vulkan adapter named {device:?}; wgpu not measured");
            return;
        };
        let immediate_size = size_of::<u32>() as u32;
        let (dev, queue) = block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("gantry-bench"),
            required_features: wgpu::Features::IMMEDIATES,
            required_limits: wgpu::Limits { max_immediate_size: immediate_size, ..wgpu::Limits::default() },
            ..Default::default()
        }))
        .expect("a wgpu device with immediates");
        let module = dev.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("six"),
            source: wgpu::ShaderSource::Wgsl(SIX.into()),
        });
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let entries: Vec<_> = (0..6).map(|b| storage(b, b < 5)).collect();
        let layout = dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("six"),
            entries: &entries,
        });
        let pipeline_layout = dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("six"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size,
        });
        let pipeline = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("six"),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some("six"),
            compilation_options: Default::default(),
            cache: None,
        });
        let buffer = || {
            dev.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: (4 * N) as u64,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        };
        // Five shared inputs, one output per dispatch, as in the partition.
        let inputs: Vec<wgpu::Buffer> = (0..5).map(|_| buffer()).collect();
        let groups: Vec<wgpu::BindGroup> = (0..COUNT)
            .map(|_| {
                let out = buffer();
                let entries: Vec<_> = inputs
                    .iter()
                    .chain([&out])
                    .enumerate()
                    .map(|(b, buf)| wgpu::BindGroupEntry {
                        binding: b as u32,
                        resource: buf.as_entire_binding(),
                    })
                    .collect();
                dev.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &layout,
                    entries: &entries,
                })
            })
            .collect();
        let n = (N as u32).to_ne_bytes();
        let workgroups = N.div_ceil(64) as u32;
        let frame = || {
            let mut encoder = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                pass.set_pipeline(&pipeline);
                pass.set_immediates(0, &n);
                for group in &groups {
                    pass.set_bind_group(0, group, &[]);
                    pass.dispatch_workgroups(workgroups, 1, 1);
                }
            }
            queue.submit([encoder.finish()])
        };
        let wait = |index: wgpu::SubmissionIndex| {
            dev.poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
                .expect("the frame ran");
        };
        wait(frame()); // the first submission, outside the measurement
        g.bench_function("wgpu_encode_submit", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let index = frame();
                    total += start.elapsed();
                    wait(index);
                }
                total
            })
        });
    }
}

use gantry_conformance::step_chain::{self, WGSL as STEP};

fn fused_chain(c: &mut Criterion) {
    let Some(gpu) = Gpu::open() else { return };
    let n: usize =
        std::env::var("GANTRY_VULKAN_FUSION_N").ok().and_then(|v| v.parse().ok()).unwrap_or(64 << 20);
    let step = wgsl_kernel("step", &step_wg256(), step_chain::signature());
    let geometry = Geometry::for_range(Range::d1(n)).expect("a valid range");
    let table: Vec<AllocId> = (0..9).map(|_| gpu.alloc(4 * n)).collect();
    let coefficients = |k: usize| -> ScalarBlock {
        let (a, b) = step_chain::coefficients(k);
        [(n as u32).to_ne_bytes(), a.to_ne_bytes(), b.to_ne_bytes()].concat().into_iter().collect()
    };
    let slot = |buffer: usize, internal: bool| {
        let a = FusionArg::new(buffer as u64, 0..4 * n, 4);
        if internal {
            a.promoted(Promotion::Private)
        } else {
            a
        }
    };
    let request = FusionRequest {
        kernels: (0..8)
            .map(|k| FusionKernel {
                kernel: step.clone(),
                geometry,
                args: [slot(k, k > 0), slot(k + 1, k < 7)].into_iter().collect(),
                scalars: coefficients(k),
                deps: Default::default(),
            })
            .collect(),
        barriers: true,
    };
    let fused = gpu.driver.wgsl_fusion().fuse(&request).expect("the chain fuses");
    // The same list fused without barriers (each work-item touches only its own
    // elements, so they change nothing here): what the barriers cost.
    let request = FusionRequest { barriers: false, ..request };
    let fused_without_barriers = gpu.driver.wgsl_fusion().fuse(&request).expect("the chain fuses");
    let mem = |id: AllocId| MemArg {
        mem: MemSlice { mem: MemRef::Device(id), offset: 0, len: 4 * n },
        mode: AccessMode::ReadWrite,
    };
    let unfused = || {
        let mut last: Option<OpHandle> = None;
        for k in 0..8 {
            let op = DeviceOp::Kernel(KernelLaunch {
                kernel: step.clone(),
                geometry,
                args: [mem(table[k]), mem(table[k + 1])].into_iter().collect(),
                scalars: coefficients(k),
            });
            let waits: Vec<OpHandle> = last.iter().cloned().collect();
            last = gpu.submit_after(op, &waits);
        }
        gpu.wait(8);
    };
    let run = |fused: &Fused| {
        let op = DeviceOp::Kernel(KernelLaunch {
            kernel: fused.kernel.clone(),
            geometry: fused.geometry,
            args: fused.args.iter().map(|a| mem(table[a.buffer as usize])).collect(),
            scalars: fused.scalars.clone(),
        });
        let id = gpu.submit(op);
        gpu.wait(usize::from(id != 0));
    };
    unfused(); // makes the pipelines
    run(&fused);
    run(&fused_without_barriers);
    let mut g = c.benchmark_group(format!("fused_chain/{n}/{}", gpu.driver.device_name()));
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(10);
    g.bench_function("unfused", |b| b.iter(unfused));
    g.bench_function("fused", |b| b.iter(|| run(&fused)));
    g.bench_function("fused_without_barriers", |b| b.iter(|| run(&fused_without_barriers)));
    g.finish();
}

/// The step chain's kernel in workgroups of 256.
fn step_wg256() -> String {
    let wide = STEP.replace("@workgroup_size(64)", "@workgroup_size(256)");
    assert_ne!(wide, STEP, "the step's workgroup size is spelled as expected");
    wide
}

const STEP_VEC4: &str = "struct S { n: u32, a: f32, b: f32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> y: array<vec4<f32>>;
@compute @workgroup_size(64)
fn step(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = s.a * x[id.x] + s.b; }
}";

fn step_bandwidth(c: &mut Criterion) {
    let Some(gpu) = Gpu::open() else { return };
    let n: usize =
        std::env::var("GANTRY_VULKAN_FUSION_N").ok().and_then(|v| v.parse().ok()).unwrap_or(64 << 20);
    let (x, y) = (gpu.alloc(4 * n), gpu.alloc(4 * n));
    let mem = |id: AllocId| MemArg {
        mem: MemSlice { mem: MemRef::Device(id), offset: 0, len: 4 * n },
        mode: AccessMode::ReadWrite,
    };
    let variants =
        [("scalar_wg64", STEP, n), ("scalar_wg256", &step_wg256(), n), ("vec4_wg64", STEP_VEC4, n / 4)];
    let mut g = c.benchmark_group(format!("step_bandwidth/{n}/{}", gpu.driver.device_name()));
    g.throughput(Throughput::Bytes(8 * n as u64));
    g.sample_size(10);
    for (name, source, items) in variants {
        let kernel = wgsl_kernel("step", source, step_chain::signature());
        let scalars: ScalarBlock = [(items as u32).to_ne_bytes(), 1.5f32.to_ne_bytes(), 0.5f32.to_ne_bytes()]
            .concat()
            .into_iter()
            .collect();
        let geometry = Geometry::for_range(Range::d1(items)).expect("a valid range");
        let run = || {
            let op = DeviceOp::Kernel(KernelLaunch {
                kernel: kernel.clone(),
                geometry,
                args: [mem(x), mem(y)].into_iter().collect(),
                scalars: scalars.clone(),
            });
            let id = gpu.submit(op);
            gpu.wait(usize::from(id != 0));
        };
        run(); // makes the pipeline
        g.bench_function(name, |b| b.iter(run));
    }
    g.finish();
}

criterion_group!(benches, dispatch, partition, fused_chain, step_bandwidth);
criterion_main!(benches);
