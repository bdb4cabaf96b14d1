//! LLVM IR kernels through the scheduler (feature `jit`): OpenCL C compiled by clang
//! at run time, run as native work-group functions by the CPU driver (groups over its
//! worker pool) and the simulated device, ordered against closure kernels and host
//! tasks by the buffers they use, with scalars and local memory; a kernel that does
//! not compile fails its command and its dependents with the reason, and the runtime
//! goes on.

use std::sync::Arc;

use gantry::driver::ExecError;
use gantry::jit::{from_llvm_ir, from_opencl_c, signature_of};
use gantry::{AccessMode, Error, Kernel, KernelRef, NdRange, QueueOptions, Runtime, Signature};
use gantry_conformance::step_chain;

const SAXPY: &str = "kernel void saxpy(global const float* x, global float* y, uint n, float a) {
    size_t i = get_global_id(0);
    if (i < n) y[i] = a * x[i] + y[i];
}";

fn saxpy() -> KernelRef {
    let image = from_opencl_c(SAXPY, "saxpy").unwrap_or_else(|e| panic!("{e}"));
    let signature = signature_of(&image).unwrap();
    assert_eq!(
        signature,
        Signature::new()
            .global(AccessMode::Read)
            .global(AccessMode::ReadWrite)
            .scalar::<u32>()
            .scalar::<f32>()
    );
    Kernel::new("saxpy", signature).with_image(image).into_ref()
}

const REDUCE: &str = "kernel void group_sums(global const int* in, global int* out, local int* tmp) {
    size_t l = get_local_id(0);
    tmp[l] = in[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (l < s) tmp[l] += tmp[l + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (l == 0) out[get_group_id(0)] = tmp[0];
}";

/// A closure kernel writes `x`, the IR kernel computes `y = a·x + y` over many
/// work-groups (spread over the CPU driver's workers), a host task reads `y`: each
/// sees the one before, and the IR kernel's result is the reference's.
#[test]
fn an_opencl_c_kernel_runs_between_closure_kernels_and_host_tasks() {
    let rt = Runtime::builder().worker_threads(2).build();
    let q = rt.in_order_queue();
    let n = 1_000_003usize;
    let (x, y) = (rt.buffer_zeroed::<f32>(n), rt.buffer(&vec![1f32; n]));
    q.submit(|cg| {
        let x = cg.elements_out(&x);
        cg.parallel_for(n, move |it| *x.elem(it) = (it.global_linear_id() % 1000) as f32);
    })
    .unwrap();
    let kernel = saxpy();
    for a in [2f32, 0.5] {
        q.submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, n).scalar(0, n as u32).scalar(1, a);
        })
        .unwrap();
    }
    let sum = Arc::new(std::sync::Mutex::new(0f64));
    let s = sum.clone();
    q.submit(|cg| {
        let y = cg.host_read(&y);
        cg.host_task(move |ctx| *s.lock().unwrap() = y.as_slice(ctx).iter().map(|&v| v as f64).sum());
    })
    .unwrap()
    .wait()
    .unwrap();
    let expected: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).map(|v| 0.5 * v + (2.0 * v + 1.0)).collect();
    assert_eq!(y.to_vec().unwrap(), expected);
    assert_eq!(*sum.lock().unwrap(), expected.iter().map(|&v| v as f64).sum::<f64>());
}

/// A work-group reduction with local memory and barriers in a loop, over an
/// ND-range, on the CPU driver and on the simulated device: both give the sums.
#[test]
fn local_memory_and_barriers_on_the_cpu_and_the_simulated_device() {
    let group = 128usize;
    let groups = 301usize;
    let input: Vec<i32> = (0..(group * groups) as i32).map(|i| (i * 7919) % 1000 - 500).collect();
    let expected: Vec<i32> = input.chunks(group).map(|c| c.iter().sum()).collect();
    let image = from_opencl_c(REDUCE, "group_sums").unwrap();
    let signature = Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(group * 4);
    let kernel = Kernel::new("group_sums", signature).with_image(image).into_ref();
    let rt = Runtime::builder().worker_threads(2).sim(gantry::SimConfig::default()).build();
    for device in [0, 1] {
        let q = rt.queue_with(QueueOptions { device, in_order: true }).unwrap();
        let (data, out) = (rt.buffer(&input), rt.buffer_zeroed::<i32>(groups));
        q.submit(|cg| {
            cg.read(&data);
            cg.write(&out);
            cg.launch_nd(&kernel, NdRange::new(group * groups, group));
        })
        .unwrap()
        .wait()
        .unwrap();
        assert_eq!(out.to_vec().unwrap(), expected, "device {device}");
    }
}

/// IR whose kernel calls a function the JIT cannot translate fails its command
/// when it runs, naming the kernel and the function; its dependent fails with a
/// dependency error; the buffer keeps its contents and the next command runs.
#[test]
fn a_kernel_that_does_not_compile_fails_its_command_and_dependents() {
    const IR: &str = r#"
target triple = "spir64-unknown-unknown"
declare float @mystery(float)
define spir_kernel void @broken(ptr addrspace(1) %x) {
  %v = load float, ptr addrspace(1) %x
  %w = call float @mystery(float %v)
  store float %w, ptr addrspace(1) %x
  ret void
}
"#;
    let image = from_llvm_ir(IR.as_bytes(), "broken").unwrap();
    let kernel =
        Kernel::new("broken", Signature::new().global(AccessMode::ReadWrite)).with_image(image).into_ref();
    let rt = Runtime::new();
    let q = rt.in_order_queue();
    let x = rt.buffer(&[3f32; 16]);
    let bad = q
        .submit(|cg| {
            cg.read_write(&x);
            cg.launch(&kernel, 16);
        })
        .unwrap();
    let after = q.submit(|cg| cg.fill(&x, 9f32)).unwrap();
    match bad.wait() {
        Err(Error::Exec(ExecError::Driver { message, .. })) => {
            assert!(message.contains("broken") && message.contains("mystery"), "{message}")
        }
        other => panic!("a kernel calling an unknown function: {other:?}"),
    }
    assert!(matches!(after.wait(), Err(Error::Exec(ExecError::DependencyFailed { .. }))));
    assert_eq!(x.to_vec().unwrap(), vec![3f32; 16], "nothing ran");
    q.submit(|cg| cg.fill(&x, 1f32)).unwrap().wait().unwrap();
    assert_eq!(x.to_vec().unwrap(), vec![1f32; 16], "the runtime goes on");
}

const STEP: &str = "#pragma OPENCL FP_CONTRACT OFF
kernel void step(global const float* in, global float* out, uint n, float a, float b) {
    size_t i = get_global_id(0);
    if (i < n) out[i] = a * in[i] + b;
}";

fn step_kernel() -> KernelRef {
    let image = from_opencl_c(STEP, "step").unwrap_or_else(|e| panic!("{e}"));
    Kernel::new("step", step_chain::signature()).with_image(image).into_ref()
}

/// `out = step7(…step0(x))` with `step_k(v) = a_k·v + b_k`, through `buffers` (the
/// input, seven intermediates, the output), each intermediate hinted private.
fn submit_chain(q: &gantry::Queue, kernel: &KernelRef, buffers: &[gantry::Buffer<f32>], n: usize) {
    for k in 0..buffers.len() - 1 {
        let (a, b) = step_chain::coefficients(k);
        q.submit(|cg| {
            let input = cg.read(&buffers[k]);
            let output = cg.discard_write(&buffers[k + 1]);
            if k > 0 {
                cg.promote(&input, gantry::Promotion::Private);
            }
            if k + 2 < buffers.len() {
                cg.promote(&output, gantry::Promotion::Private);
            }
            cg.launch(kernel, n).scalar(0, n as u32).scalar(1, a).scalar(2, b);
        })
        .unwrap();
    }
}

/// Eight OpenCL C kernels fused by the queue (the JIT's fusion compiler, with a
/// barrier between kernels and without): one fused kernel, the intermediates
/// internalized (never written back), the output bit-identical to the unfused chain
/// and to the Rust reference; fusing the same chain again is a cache hit.
#[test]
fn a_chain_of_opencl_c_kernels_fuses_on_the_cpu() {
    let n = 100_003usize;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 / 7.0).collect();
    let expected = step_chain::reference(&x, 8);
    let kernel = step_kernel();
    let rt = Runtime::builder().worker_threads(2).build();
    let q = rt.in_order_queue();
    for barriers in [true, false, true] {
        let mut buffers = vec![rt.buffer(&x)];
        buffers.extend((0..8).map(|_| rt.buffer(&vec![-1f32; n])));
        q.start_fusion().unwrap();
        submit_chain(&q, &kernel, &buffers, n);
        q.complete_fusion(gantry::FusionProps { barriers }).unwrap().wait().unwrap();
        match q.fusion_outcome() {
            Some(gantry::FusionOutcome::Fused { kernels: 8, .. }) => {}
            other => panic!("barriers {barriers}: {other:?}"),
        }
        assert_eq!(buffers[8].to_vec().unwrap(), expected, "barriers {barriers}");
        for t in &buffers[1..8] {
            assert_eq!(t.to_vec().unwrap(), vec![-1f32; n], "an internalized intermediate is never written");
        }
    }
    let unfused: Vec<gantry::Buffer<f32>> =
        std::iter::once(rt.buffer(&x)).chain((0..8).map(|_| rt.buffer_zeroed(n))).collect();
    submit_chain(&q, &kernel, &unfused, n);
    q.wait().unwrap();
    assert_eq!(unfused[8].to_vec().unwrap(), expected, "unfused");
}

/// A command graph of the same chain, finalized with graph fusion: the chain is
/// fused into one node and the replays compute the reference.
#[test]
fn graph_fusion_fuses_opencl_c_kernels() {
    let n = 4096usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 / 3.0).collect();
    let kernel = step_kernel();
    // Fusion's mechanics, not its thresholds: the CPU's would leave a chain whose
    // global memory its caches hold unfused.
    let rt = Runtime::builder().fusion_window(gantry::WindowThresholds::ALWAYS).build();
    let q = rt.in_order_queue();
    let buffers: Vec<gantry::Buffer<f32>> =
        std::iter::once(rt.buffer(&x)).chain((0..4).map(|_| rt.buffer_zeroed(n))).collect();
    let graph = rt.graph();
    graph.begin_recording(&q).unwrap();
    submit_chain(&q, &kernel, &buffers, n);
    graph.end_recording(&q).unwrap();
    let exec = graph.finalize(gantry::GraphProps::default().fused()).unwrap();
    assert_eq!(exec.fused_chains().len(), 1, "{:?} / not fused: {:?}", exec.fused_chains(), exec.not_fused());
    for _ in 0..3 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        assert_eq!(buffers[4].to_vec().unwrap(), step_chain::reference(&x, 4));
    }
}

/// A fusion list mixing a closure kernel and an OpenCL C kernel has no compiler that
/// takes both: it is cancelled with the typed reason, and the kernels run unfused.
#[test]
fn a_list_mixing_closure_and_ir_kernels_is_cancelled_with_the_reason() {
    let n = 1024usize;
    // A window this small would run unfused before it reached the compilers.
    let rt = Runtime::builder().fusion_window(gantry::WindowThresholds::ALWAYS).build();
    let q = rt.in_order_queue();
    let (x, y, z) = (rt.buffer(&vec![2f32; n]), rt.buffer_zeroed::<f32>(n), rt.buffer_zeroed::<f32>(n));
    let kernel = step_kernel();
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let (x, y) = (cg.read(&x), cg.elements_out(&y));
        cg.parallel_for(n, move |it| *y.elem(it) = x.get(it, it.global_linear_id()) + 1.0);
    })
    .unwrap();
    q.submit(|cg| {
        cg.read(&y);
        cg.discard_write(&z);
        cg.launch(&kernel, n).scalar(0, n as u32).scalar(1, 2f32).scalar(2, 0f32);
    })
    .unwrap();
    q.complete_fusion(gantry::FusionProps::default()).unwrap().wait().unwrap();
    match q.fusion_outcome() {
        Some(gantry::FusionOutcome::Cancelled(reason)) => {
            let text = reason.to_string();
            assert!(text.contains("compiler"), "{text}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(z.to_vec().unwrap(), vec![6f32; n]);
}
