//! The CUDA targets of the CUDA driver issue, measured against raw CUDA (the driver
//! API through cudarc) in the same run, on the same kernels (PTX written here, so
//! both sides load the same code):
//!
//! * eager launches: a chain of tiny kernels on one buffer, Gantry's in-order queue
//!   against `cuLaunchKernel` in a loop on one stream;
//! * graph replay: a 1,000-node chain as a Gantry command graph against a captured
//!   and instantiated CUDA graph, per node;
//! * 8 chained elementwise kernels (`x = a·x + b`) over 64M and 64K `f32`: Gantry's
//!   eager chain and graph against raw launches, and against a hand-fused kernel.
//!
//! Run on a machine with an NVIDIA GPU: `cargo run --release -p gantry-benches
//! --features cuda --bin cuda_bench` (the README shows how to build it here and run it
//! on the device machine). Each figure is the median of `--reps` timed repetitions
//! after one warm-up; ratios compare figures of this run only.

use std::ffi::{c_void, CString};
use std::ptr;
use std::time::Instant;

use clap::Parser;
use cudarc::driver::sys as cu;
use gantry::{
    AccessMode, Buffer, CodeImage, GraphProps, ImageKind, Kernel, KernelRef, Queue, Runtime, Signature,
};

#[derive(Parser)]
#[command(about = "Gantry's CUDA driver against raw CUDA, in one run")]
struct Args {
    /// Timed repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Launches in the eager chain.
    #[arg(long, default_value_t = 20_000)]
    eager: usize,
    /// Nodes in the graph chain.
    #[arg(long, default_value_t = 1_000)]
    nodes: usize,
    /// Replays of the graph chain per repetition.
    #[arg(long, default_value_t = 20)]
    replays: usize,
    /// How long Gantry's threads (scheduler, waiters, CUDA completion threads) spin
    /// before they block, in microseconds (default: the runtime's default).
    #[arg(long)]
    spin_us: Option<u64>,
    /// How long the CUDA completion threads poll between yields before they block,
    /// in microseconds (default: the driver's default).
    #[arg(long)]
    poll_us: Option<u64>,
}

/// The PTX module both sides load: three elementwise entries over `x[0..n]`, each
/// `x[i] = step(x[i])`. `tiny` adds 1; `axpb` is one `x = a·x + b`; `axpb8` applies it
/// 8 times (the hand-fused chain).
static PTX: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let fma = "    fma.rn.f32 %f1, %f1, %f3, %f4;\n";
    let mut module = String::from(".version 8.0\n.target sm_90\n.address_size 64\n");
    module += &ptx_entry("tiny", false, "    add.f32 %f1, %f1, 0f3F800000;\n");
    module += &ptx_entry("axpb", true, fma);
    module += &ptx_entry("axpb8", true, &fma.repeat(8));
    module
});

/// An entry `name(x, n[, a, b])` applying `step` (PTX on `%f1`, with `a` in `%f3`
/// and `b` in `%f4`) to `x[i]` for the work-item's `i < n`.
fn ptx_entry(name: &str, scalars: bool, step: &str) -> String {
    let (params, loads) = if scalars {
        (", .param .f32 p_a, .param .f32 p_b", "    ld.param.f32 %f3, [p_a];\n    ld.param.f32 %f4, [p_b];\n")
    } else {
        ("", "")
    };
    format!(
        "\n.visible .entry {name}(.param .u64 p_x, .param .u32 p_n{params})\n{{\n\
         \x20   .reg .pred %p;\n    .reg .b32 %r<5>;\n    .reg .f32 %f<5>;\n    .reg .b64 %rd<5>;\n\
         \x20   ld.param.u64 %rd1, [p_x];\n    ld.param.u32 %r1, [p_n];\n{loads}\
         \x20   mov.u32 %r2, %ctaid.x;\n    mov.u32 %r3, %ntid.x;\n    mov.u32 %r4, %tid.x;\n\
         \x20   mad.lo.s32 %r2, %r2, %r3, %r4;\n    setp.ge.u32 %p, %r2, %r1;\n    @%p bra DONE;\n\
         \x20   cvta.to.global.u64 %rd2, %rd1;\n    mul.wide.u32 %rd3, %r2, 4;\n    add.s64 %rd4, %rd2, %rd3;\n\
         \x20   ld.global.f32 %f1, [%rd4];\n{step}    st.global.f32 [%rd4], %f1;\nDONE:\n    ret;\n}}\n"
    )
}

/// Work-items per block of every launch here (the CUDA driver's plain-range block).
const BLOCK: u32 = gantry::cuda::PLAIN_BLOCK as u32;
/// `a` and `b` of the elementwise chain: values stay finite over any number of steps.
const A: f32 = 0.5;
const B: f32 = 1.0;

/// Fails the run with the call's name where a CUDA call fails.
fn ok(call: &str, r: cu::CUresult) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{call}");
}

/// Raw CUDA: the module, its functions and a stream on device 0's primary context.
struct Raw {
    stream: cu::CUstream,
    tiny: cu::CUfunction,
    axpb: cu::CUfunction,
    axpb8: cu::CUfunction,
}

impl Raw {
    fn new() -> Self {
        // SAFETY (all calls here): the documented driver API sequence, valid
        // out-pointers, a NUL-terminated image and names.
        unsafe {
            ok("cuInit", cu::cuInit(0));
            let mut dev = 0;
            ok("cuDeviceGet", cu::cuDeviceGet(&mut dev, 0));
            let mut ctx = ptr::null_mut();
            ok("cuDevicePrimaryCtxRetain", cu::cuDevicePrimaryCtxRetain(&mut ctx, dev));
            ok("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx));
            let image = CString::new(PTX.as_str()).unwrap();
            let mut module = ptr::null_mut();
            ok("cuModuleLoadData", cu::cuModuleLoadData(&mut module, image.as_ptr().cast()));
            let function = |name: &str| {
                let mut f = ptr::null_mut();
                let name = CString::new(name).unwrap();
                ok("cuModuleGetFunction", cu::cuModuleGetFunction(&mut f, module, name.as_ptr()));
                f
            };
            let mut stream = ptr::null_mut();
            ok("cuStreamCreate", cu::cuStreamCreate(&mut stream, 1));
            Self { stream, tiny: function("tiny"), axpb: function("axpb"), axpb8: function("axpb8") }
        }
    }

    fn alloc(&self, bytes: usize) -> cu::CUdeviceptr {
        let mut p = 0;
        // SAFETY: a current context; valid out-pointer.
        unsafe {
            ok("cuMemAlloc", cu::cuMemAlloc_v2(&mut p, bytes));
            ok("cuMemsetD8", cu::cuMemsetD8_v2(p, 0, bytes));
        }
        p
    }

    /// Launches `f` over `n` items of `x` with `(n, a, b)` (the tiny kernel reads `n`
    /// only).
    fn launch(&self, f: cu::CUfunction, x: cu::CUdeviceptr, n: u32, a: f32, b: f32) {
        let (mut x, mut n, mut a, mut b) = (x, n, a, b);
        let mut params: [*mut c_void; 4] = [
            (&mut x as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
            (&mut a as *mut f32).cast(),
            (&mut b as *mut f32).cast(),
        ];
        let grid = n.div_ceil(BLOCK);
        // SAFETY: a live function and stream; `params` holds one address per parameter
        // (extra ones are not read), valid through the call.
        unsafe {
            ok(
                "cuLaunchKernel",
                cu::cuLaunchKernel(
                    f,
                    grid,
                    1,
                    1,
                    BLOCK.min(n),
                    1,
                    1,
                    0,
                    self.stream,
                    params.as_mut_ptr(),
                    ptr::null_mut(),
                ),
            )
        }
    }

    fn sync(&self) {
        // SAFETY: a live stream.
        unsafe { ok("cuStreamSynchronize", cu::cuStreamSynchronize(self.stream)) }
    }

    /// A graph of what `record` enqueues on the stream, captured and instantiated.
    fn capture(&self, record: impl FnOnce(&Self)) -> cu::CUgraphExec {
        // SAFETY: capture on a live stream, then instantiation of the captured graph.
        unsafe {
            let mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            ok("cuStreamBeginCapture", cu::cuStreamBeginCapture_v2(self.stream, mode));
            record(self);
            let mut graph = ptr::null_mut();
            ok("cuStreamEndCapture", cu::cuStreamEndCapture(self.stream, &mut graph));
            let mut exec = ptr::null_mut();
            ok("cuGraphInstantiate", cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0));
            exec
        }
    }

    fn replay(&self, exec: cu::CUgraphExec) {
        // SAFETY: a live instance and stream.
        unsafe { ok("cuGraphLaunch", cu::cuGraphLaunch(exec, self.stream)) }
    }
}

/// The median of `reps` timings (seconds) of `run`, after one untimed run.
fn median(reps: usize, mut run: impl FnMut()) -> f64 {
    run();
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn ptx_kernel(name: &str, signature: Signature) -> KernelRef {
    Kernel::new(name, signature).with_image(CodeImage::new(ImageKind::Ptx, name, PTX.as_bytes())).into_ref()
}

/// Gantry's side: a runtime with the CUDA device, an in-order queue on it, the
/// kernels.
struct Gantry {
    rt: Runtime,
    q: Queue,
    device: u32,
    tiny: KernelRef,
    axpb: KernelRef,
    axpb8: KernelRef,
}

impl Gantry {
    fn new(spin: Option<std::time::Duration>, poll: Option<std::time::Duration>) -> Self {
        let mut config = gantry::cuda::CudaConfig::default();
        if let Some(poll) = poll {
            config.poll_before_blocking = poll;
        }
        let mut builder = Runtime::builder();
        if let Some(spin) = spin {
            config.spin_before_blocking = spin;
            builder = builder.spin_before_blocking(spin);
        }
        let rt = builder
            .driver(gantry::cuda::factory_with(config))
            .try_build()
            .expect("a runtime with CUDA device 0");
        let device = rt.devices().len() as u32 - 1;
        let q = rt.queue_with(gantry::QueueOptions { device, in_order: true }).expect("a CUDA queue");
        let rw = || Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
        Self {
            tiny: ptx_kernel("tiny", rw()),
            axpb: ptx_kernel("axpb", rw().scalar::<f32>().scalar::<f32>()),
            axpb8: ptx_kernel("axpb8", rw().scalar::<f32>().scalar::<f32>()),
            rt,
            q,
            device,
        }
    }

    fn submit(&self, q: &Queue, kernel: &KernelRef, x: &Buffer<f32>) {
        let n = x.len();
        q.submit(|cg| {
            cg.read_write(x);
            cg.launch(kernel, n).scalar(0, n as u32).scalar(1, A).scalar(2, B);
        })
        .expect("submit");
    }

    fn submit_tiny(&self, x: &Buffer<f32>) {
        self.q
            .submit(|cg| {
                cg.read_write(x);
                cg.launch(&self.tiny, x.len()).scalar(0, x.len() as u32);
            })
            .expect("submit");
    }

    /// [`Gantry::chain_graph`] finalized with graph fusion.
    #[cfg(feature = "jit")]
    fn chain_graph_fused(
        &self,
        kernel: &KernelRef,
        x: &Buffer<f32>,
        count: usize,
    ) -> gantry::ExecutableGraph {
        self.chain(kernel, x, count).finalize(GraphProps::default().fused()).expect("finalize")
    }

    /// A finalized graph of `count` launches of `kernel` on `x` (a chain: each
    /// reads and writes `x`).
    fn chain_graph(&self, kernel: &KernelRef, x: &Buffer<f32>, count: usize) -> gantry::ExecutableGraph {
        self.chain(kernel, x, count).finalize(GraphProps::default()).expect("finalize")
    }

    /// A graph of `count` launches of `kernel` on `x`.
    fn chain(&self, kernel: &KernelRef, x: &Buffer<f32>, count: usize) -> gantry::CommandGraph {
        let graph = self.rt.graph_on(self.device);
        let n = x.len();
        let tiny = kernel.signature.scalars.len() == 1;
        for _ in 0..count {
            graph
                .add(
                    |cg| {
                        cg.read_write(x);
                        let launch = cg.launch(kernel, n).scalar(0, n as u32);
                        if !tiny {
                            launch.scalar(1, A).scalar(2, B);
                        }
                    },
                    &[],
                )
                .expect("add");
        }
        graph
    }
}

/// `axpb` from OpenCL C, as LLVM IR the JIT compiles to PTX (the IR is the
/// engine's CUDA test kernels, compiled ahead of time: no clang at run time).
#[cfg(feature = "jit")]
fn jit_axpb() -> KernelRef {
    const IR: &str = include_str!("../../../engine/tests/kernels/jit_kernels.ll");
    let image = gantry::jit::from_llvm_ir(IR.as_bytes(), "axpb").expect("the IR parses");
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>().scalar::<f32>().scalar::<f32>();
    Kernel::new("axpb_jit", sig).with_image(image).into_ref()
}

/// One line of the report.
fn row(what: &str, unit: &str, gantry: f64, raw: f64, target: &str) {
    println!("{what:<52} {gantry:>10.3} {unit:<3} {raw:>10.3} {unit:<3} {:>7.3}x  {target}", gantry / raw);
}

fn main() {
    let args = Args::parse();
    // SAFETY: probing loads nothing it cannot find.
    if !unsafe { cu::is_culib_present() } {
        eprintln!("cuda_bench: libcuda is not present on this machine; nothing measured");
        std::process::exit(2);
    }
    let micros = std::time::Duration::from_micros;
    let g = Gantry::new(args.spin_us.map(micros), args.poll_us.map(micros));
    let raw = Raw::new();
    let name = g.rt.devices().last().map(|d| d.name.clone()).unwrap_or_default();
    let spin = args.spin_us.map_or("the default".to_string(), |us| format!("{us} us"));
    let poll = args.poll_us.map_or("the default".to_string(), |us| format!("{us} us"));
    println!(
        "device: {name}; median of {} repetitions each; Gantry spins {spin}, CUDA completions poll {poll} before blocking",
        args.reps
    );
    println!("{:<52} {:>14} {:>14} {:>8}  target", "measurement", "gantry", "raw CUDA", "ratio");

    // Eager: a chain of tiny launches on one small buffer.
    let (count, small) = (args.eager, 32usize);
    let x = g.rt.buffer(&vec![0f32; small]);
    let gantry_eager = median(args.reps, || {
        for _ in 0..count {
            g.submit_tiny(&x);
        }
        g.q.wait().expect("wait");
    });
    let rx = raw.alloc(small * 4);
    let raw_eager = median(args.reps, || {
        for _ in 0..count {
            raw.launch(raw.tiny, rx, small as u32, 0.0, 0.0);
        }
        raw.sync();
    });
    let us = |s: f64, per: usize| s * 1e6 / per as f64;
    row(
        "eager chain of tiny kernels, per launch",
        "us",
        us(gantry_eager, count),
        us(raw_eager, count),
        "<= 1.3x",
    );

    // Graph replay: a chain of tiny kernels as one graph.
    let exec = g.chain_graph(&g.tiny, &x, args.nodes);
    let gantry_graph = median(args.reps, || {
        for _ in 0..args.replays {
            g.q.submit_graph(&exec).expect("submit_graph");
        }
        g.q.wait().expect("wait");
    });
    let raw_exec = raw.capture(|r| {
        for _ in 0..args.nodes {
            r.launch(r.tiny, rx, small as u32, 0.0, 0.0);
        }
    });
    let raw_graph = median(args.reps, || {
        for _ in 0..args.replays {
            raw.replay(raw_exec);
        }
        raw.sync();
    });
    let per_node = args.nodes * args.replays;
    row(
        &format!("{}-node graph replay, per node", args.nodes),
        "us",
        us(gantry_graph, per_node),
        us(raw_graph, per_node),
        "<= 1.05x",
    );

    // 8 chained elementwise kernels, unfused and hand-fused.
    for n in [64usize << 20, 64 << 10] {
        let label = if n >= 1 << 20 { format!("{}M", n >> 20) } else { format!("{}K", n >> 10) };
        let x = g.rt.buffer(&vec![1f32; n]);
        let rx = raw.alloc(n * 4);
        let t = |f: &mut dyn FnMut()| median(args.reps, f) * 1e6;
        let gantry_unfused = t(&mut || {
            for _ in 0..8 {
                g.submit(&g.q, &g.axpb, &x);
            }
            g.q.wait().expect("wait");
        });
        let raw_unfused = t(&mut || {
            for _ in 0..8 {
                raw.launch(raw.axpb, rx, n as u32, A, B);
            }
            raw.sync();
        });
        let exec = g.chain_graph(&g.axpb, &x, 8);
        let gantry_graph = t(&mut || {
            g.q.submit_graph(&exec).expect("submit_graph");
            g.q.wait().expect("wait");
        });
        let raw_exec = raw.capture(|r| {
            for _ in 0..8 {
                r.launch(r.axpb, rx, n as u32, A, B);
            }
        });
        let raw_graph = t(&mut || {
            raw.replay(raw_exec);
            raw.sync();
        });
        let gantry_fused = t(&mut || {
            g.submit(&g.q, &g.axpb8, &x);
            g.q.wait().expect("wait");
        });
        let raw_fused = t(&mut || {
            raw.launch(raw.axpb8, rx, n as u32, A, B);
            raw.sync();
        });
        row(
            &format!("8-kernel chain over {label} f32, eager unfused"),
            "us",
            gantry_unfused,
            raw_unfused,
            "",
        );
        #[cfg(feature = "jit")]
        {
            // The same kernel from OpenCL C, compiled to PTX by Gantry's JIT.
            let jit = jit_axpb();
            let gantry_jit = t(&mut || {
                for _ in 0..8 {
                    g.submit(&g.q, &jit, &x);
                }
                g.q.wait().expect("wait");
            });
            row(
                &format!("8-kernel chain over {label} f32, eager, JIT PTX"),
                "us",
                gantry_jit,
                raw_unfused,
                "",
            );
            // The 8 JIT kernels fused by the queue (the JIT's fusion compiler: one PTX
            // kernel), with and without barriers, and by graph fusion.
            for barriers in [true, false] {
                let fused = t(&mut || {
                    g.q.start_fusion().expect("start_fusion");
                    for _ in 0..8 {
                        g.submit(&g.q, &jit, &x);
                    }
                    g.q.complete_fusion(gantry::FusionProps { barriers }).expect("complete_fusion");
                    g.q.wait().expect("wait");
                });
                let what = if barriers { "with barriers" } else { "no barriers" };
                let target = if n >= 1 << 20 { ">= 0.95x hand-fused, >= 7x unfused" } else { "" };
                row(
                    &format!("8-kernel chain over {label} f32, JIT-fused ({what})"),
                    "us",
                    fused,
                    raw_fused,
                    target,
                );
                println!(
                    "  {label}: JIT-fused ({what}) is {:.2}x faster than the unfused JIT chain",
                    gantry_jit / fused
                );
                if let Some(gantry::FusionOutcome::Cancelled(why)) = g.q.fusion_outcome() {
                    println!("  {label}: fusion cancelled: {why}");
                }
            }
            let again = t(&mut || {
                g.submit(&g.q, &g.axpb8, &x);
                g.q.wait().expect("wait");
            });
            let stats = g.rt.stats();
            println!(
                "  {label}: hand-fused through Gantry again after the fused runs: {again:.1} us (before: {gantry_fused:.1}); \
                 moves so far {}",
                stats.moves
            );
            let exec = g.chain_graph_fused(&jit, &x, 8);
            let graph_fused = t(&mut || {
                g.q.submit_graph(&exec).expect("submit_graph");
                g.q.wait().expect("wait");
            });
            let target = if n < 1 << 20 { "<= 1.2x hand-fused" } else { "" };
            row(
                &format!("8-kernel chain over {label} f32, fused graph"),
                "us",
                graph_fused,
                raw_fused,
                target,
            );
            println!("  {label}: graph fusion fused {:?}", exec.fused_chains());
        }
        row(&format!("8-kernel chain over {label} f32, graph unfused"), "us", gantry_graph, raw_graph, "");
        row(
            &format!("8-kernel chain over {label} f32, hand-fused kernel"),
            "us",
            gantry_fused,
            raw_fused,
            "",
        );
        println!(
            "  {label}: raw unfused / raw hand-fused = {:.2}x; gantry graph unfused / raw hand-fused = {:.2}x",
            raw_unfused / raw_fused,
            gantry_graph / raw_fused
        );
        // Both sides computed the same chain from the same start: compare a sample.
        let got = x.to_vec().expect("read back");
        let mut host = vec![0f32; 4];
        // SAFETY: a synchronized stream; 16 bytes of a live allocation.
        unsafe { ok("cuMemcpyDtoH", cu::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), rx, 16)) };
        println!("  {label}: first element gantry {} raw {} (both converge to b/(1-a) = 2)", got[0], host[0]);
    }
}
