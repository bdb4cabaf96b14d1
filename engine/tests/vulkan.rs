//! The Vulkan driver behind the scheduler (feature `vulkan`; lavapipe in CI): registered
//! on the builder, it runs WGSL kernels with scalars, fills and copies the scheduler
//! hands it, moves buffers between its memory and the host's, fails a refused launch's
//! dependents, replays command graphs as recorded Vulkan command buffers, and host
//! tasks submitted to its queues run on the CPU; chains of WGSL kernels fuse on the
//! queue and, recorded into a command graph, at finalize (graph fusion), and a refused
//! fusion runs them unfused. On a machine without Vulkan, building
//! the runtime is a typed error and the tests say they were skipped.

mod gpu_scenarios;

use gantry::driver::ExecError;
use gantry::{AccessMode, CodeImage, DeviceKind, Error, ImageKind, Kernel, KernelRef, Runtime, Signature};

/// A runtime with Vulkan device 0 and a queue on it, or `None` after saying why not.
fn vulkan_runtime(test: &str) -> Option<(Runtime, gantry::Queue)> {
    gpu_scenarios::gpu_runtime("Vulkan", test, || Runtime::builder().vulkan(0).try_build())
}

const SAXPY: &str = "
struct S { n: u32, a: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<u32>;
@group(0) @binding(1) var<storage, read_write> y: array<u32>;
@compute @workgroup_size(64)
fn saxpy(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = s.a * x[id.x] + y[id.x]; }
}";

fn saxpy() -> KernelRef {
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::ReadWrite)
        .scalar::<u32>()
        .scalar::<u32>();
    Kernel::new("saxpy", sig)
        .with_image(CodeImage::new(ImageKind::Wgsl, "saxpy", SAXPY.as_bytes()))
        .into_ref()
}

#[test]
fn building_without_vulkan_is_a_typed_error_and_with_it_registers_a_vulkan_device() {
    match Runtime::builder().driver(gantry::vulkan::factory(0)).try_build() {
        Ok(rt) => assert_eq!(rt.devices().last().map(|d| d.kind), Some(DeviceKind::Other("vulkan"))),
        Err(Error::Exec(ExecError::Unsupported { what, .. })) => {
            assert!(what.starts_with("Vulkan ("), "{what}")
        }
        Err(e) => panic!("Vulkan is present but the runtime did not build: {e}"),
    }
}

/// Kernels with scalars over a plain range (several groups and a guarded tail), a fill
/// and a copy on the Vulkan queue; a closure kernel on the CPU and a host task (which the
/// scheduler runs on the CPU) read what they wrote: the scheduler moves the buffers.
#[test]
fn kernels_fills_copies_and_host_tasks_through_the_scheduler() {
    let Some((rt, q)) = vulkan_runtime("kernels_fills_copies_and_host_tasks_through_the_scheduler") else {
        return;
    };
    gpu_scenarios::kernels_fills_copies_and_host_tasks(&rt, &q, &saxpy());
}

const REFUSED: &str = "
struct S { n: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read_write> y: array<u32>;
@compute @workgroup_size(32)
fn refused(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = 0xBADu; }
}";

/// A launch the driver refuses (an ND-range of 64 over a shader of workgroups of 32)
/// fails with the driver's error naming the kernel; see the scenario.
#[test]
fn a_refused_launch_fails_its_dependents_and_keeps_the_buffer() {
    let Some((rt, q)) = vulkan_runtime("a_refused_launch_fails_its_dependents_and_keeps_the_buffer") else {
        return;
    };
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
    let refused = Kernel::new("refused", sig)
        .with_image(CodeImage::new(ImageKind::Wgsl, "refused", REFUSED.as_bytes()))
        .into_ref();
    let by_driver = |e: &ExecError| {
        matches!(e, ExecError::Driver { message, .. }
            if message.contains("kernel `refused`") && message.contains("does not match"))
    };
    gpu_scenarios::a_refused_launch_fails_its_dependents(&rt, &q, &refused, by_driver);
}

/// The command graph scenario: on the Vulkan device it replays as a recorded
/// Vulkan command buffer.
#[test]
fn a_command_graph_replays_as_a_vulkan_command_buffer_and_updates() {
    let Some((rt, q)) = vulkan_runtime("a_command_graph_replays_as_a_vulkan_command_buffer_and_updates")
    else {
        return;
    };
    gpu_scenarios::a_command_graph_replays_and_updates(&rt, &q, &saxpy());
}

use gantry_conformance::step_chain::{coefficients, reference as chain_reference};

fn step_kernel() -> KernelRef {
    let image = CodeImage::new(ImageKind::Wgsl, "step", gantry_conformance::step_chain::WGSL.as_bytes());
    Kernel::new("step", gantry_conformance::step_chain::signature()).with_image(image).into_ref()
}

/// Submits `buffers.len() - 1` chained steps, promoting the intermediates to
/// private memory where `promote`.
fn submit_chain(
    q: &gantry::Queue,
    step: &KernelRef,
    buffers: &[gantry::Buffer<f32>],
    n: usize,
    promote: bool,
) {
    let steps = buffers.len() - 1;
    for k in 0..steps {
        let (a, b) = coefficients(k);
        q.submit(|cg| {
            let input = cg.read(&buffers[k]);
            let output = cg.discard_write(&buffers[k + 1]);
            if promote && k > 0 {
                cg.promote(&input, gantry::Promotion::Private);
            }
            if promote && k + 1 < steps {
                cg.promote(&output, gantry::Promotion::Private);
            }
            cg.launch(step, n).scalar(0, n as u32).scalar(1, a).scalar(2, b);
        })
        .unwrap();
    }
}

/// Eight WGSL kernels fused by the queue on the Vulkan device (the driver's
/// `WgslFusion`), with and without barriers: one fused kernel, the intermediates
/// internalized (never written back), the output bit-identical to the host
/// reference and to the unfused chain.
#[test]
fn a_chain_of_wgsl_kernels_fuses_on_vulkan() {
    let Some((rt, q)) = vulkan_runtime("a_chain_of_wgsl_kernels_fuses_on_vulkan") else { return };
    let n = 100_003usize;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 / 7.0).collect();
    let expected = chain_reference(&x, 8);
    let step = step_kernel();
    for barriers in [true, false] {
        let mut buffers = vec![rt.buffer(&x)];
        buffers.extend((0..8).map(|_| rt.buffer(&vec![-1f32; n])));
        q.start_fusion().unwrap();
        submit_chain(&q, &step, &buffers, n, true);
        q.complete_fusion(gantry::FusionProps { barriers }).unwrap().wait().unwrap();
        match q.fusion_outcome() {
            Some(gantry::FusionOutcome::Fused { kernels: 8, .. }) => {}
            other => panic!("barriers {barriers}: {other:?}"),
        }
        let got = buffers[8].to_vec().unwrap();
        let wrong = (0..n).filter(|&i| got[i].to_bits() != expected[i].to_bits()).count();
        assert_eq!(wrong, 0, "barriers {barriers}: {wrong} elements differ from the reference");
        // Internalized, the intermediate is not written back: it holds no step-4
        // values (a device copy of a discarded buffer starts zeroed).
        let middle = buffers[4].to_vec().unwrap();
        let step4 = chain_reference(&x, 4);
        let written = (0..n).filter(|&i| middle[i] == step4[i]).count();
        assert!(written < n / 100, "an internalized intermediate holds {written} computed values");
    }
    let unfused: Vec<gantry::Buffer<f32>> =
        std::iter::once(rt.buffer(&x)).chain((0..8).map(|_| rt.buffer_zeroed(n))).collect();
    submit_chain(&q, &step, &unfused, n, false);
    q.wait().unwrap();
    assert_eq!(unfused[8].to_vec().unwrap(), expected, "unfused");
}

/// `y = 2y + 1` in WGSL, its workgroup width an override the launch sets.
fn scale_kernel() -> KernelRef {
    const SCALE: &str = "
        override wx: u32 = 64;
        @group(0) @binding(0) var<storage, read_write> y: array<f32>;
        @compute @workgroup_size(wx)
        fn scale(@builtin(global_invocation_id) id: vec3<u32>) { y[id.x] = 2.0 * y[id.x] + 1.0; }";
    Kernel::new("scale", Signature::new().global(AccessMode::ReadWrite))
        .with_image(CodeImage::new(ImageKind::Wgsl, "scale", SCALE.as_bytes()))
        .into_ref()
}

/// A fusion list the WGSL compiler refuses (different local sizes) is cancelled
/// with the shared rules' typed reason, and the kernels run unfused, correctly.
#[test]
fn a_refused_wgsl_fusion_runs_the_kernels_unfused() {
    let Some((rt, q)) = vulkan_runtime("a_refused_wgsl_fusion_runs_the_kernels_unfused") else { return };
    let scale = scale_kernel();
    let y = rt.buffer(&[1f32; 256]);
    q.start_fusion().unwrap();
    for local in [64, 32] {
        q.submit(|cg| {
            cg.read_write(&y);
            cg.launch_nd(&scale, gantry::NdRange::new(256, local));
        })
        .unwrap();
    }
    q.complete_fusion(gantry::FusionProps::default()).unwrap().wait().unwrap();
    match q.fusion_outcome() {
        Some(gantry::FusionOutcome::Cancelled(reason)) => {
            assert!(reason.to_string().contains("different local sizes"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(y.to_vec().unwrap(), vec![7f32; 256], "2(2·1+1)+1, unfused");
}

/// The WGSL chain recorded from the Vulkan queue into a graph made for the default
/// device (the CPU) and finalized with graph fusion: the eight kernels form one
/// partition on the Vulkan device and one fused chain (before partitions split only
/// where the device changes, each node of another device than the graph's was a
/// partition of its own, so there was no chain to fuse and no reason given). Two
/// replays (the outputs scrambled in between, so the second one must write them)
/// give every step's output bit for bit as the unfused chain run on the queue.
#[test]
fn graph_fusion_fuses_a_wgsl_chain_recorded_on_the_vulkan_queue() {
    let Some((rt, q)) = vulkan_runtime("graph_fusion_fuses_a_wgsl_chain_recorded_on_the_vulkan_queue") else {
        return;
    };
    let n = 100_003usize;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 / 7.0).collect();
    let step = step_kernel();
    let unfused: Vec<gantry::Buffer<f32>> =
        std::iter::once(rt.buffer(&x)).chain((0..8).map(|_| rt.buffer_zeroed(n))).collect();
    submit_chain(&q, &step, &unfused, n, false);
    q.wait().unwrap();
    let reference: Vec<Vec<u32>> =
        unfused[1..].iter().map(|b| b.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()).collect();
    assert_eq!(unfused[8].to_vec().unwrap(), chain_reference(&x, 8), "the unfused chain");

    let buffers: Vec<gantry::Buffer<f32>> =
        std::iter::once(rt.buffer(&x)).chain((0..8).map(|_| rt.buffer(&vec![-1f32; n]))).collect();
    let graph = rt.graph();
    graph.begin_recording(&q).unwrap();
    submit_chain(&q, &step, &buffers, n, false);
    graph.end_recording(&q).unwrap();
    let exec = graph.finalize(gantry::GraphProps::default().fused()).unwrap();
    assert_eq!(exec.fused_chains().len(), 1, "{:?} / not fused: {:?}", exec.fused_chains(), exec.not_fused());
    assert_eq!(exec.fused_chains()[0].0, (0..8).collect::<Vec<u32>>());
    assert!(exec.not_fused().is_empty(), "{:?}", exec.not_fused());
    assert_eq!(exec.partitions().len(), 1, "one Vulkan command buffer");
    for replay in 0..2 {
        q.submit_graph(&exec).unwrap().wait().unwrap();
        for (k, (b, want)) in buffers[1..].iter().zip(&reference).enumerate() {
            let got: Vec<u32> = b.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            let wrong = got.iter().zip(want).filter(|(g, w)| g != w).count();
            assert_eq!(wrong, 0, "replay {replay}, step {k}: {wrong} elements differ from the unfused chain");
        }
        for b in &buffers[1..] {
            b.write().unwrap().iter_mut().for_each(|v| *v = f32::NAN);
        }
    }
}

/// A graph chain the WGSL compiler refuses (different local sizes) keeps the typed
/// reason in the executable graph, naming the chain's nodes, and its kernels run
/// unfused, correctly, at each replay.
#[test]
fn a_refused_graph_chain_on_vulkan_keeps_the_typed_reason_and_runs_unfused() {
    let Some((rt, q)) =
        vulkan_runtime("a_refused_graph_chain_on_vulkan_keeps_the_typed_reason_and_runs_unfused")
    else {
        return;
    };
    let scale = scale_kernel();
    let y = rt.buffer(&[1f32; 256]);
    let graph = rt.graph();
    graph.begin_recording(&q).unwrap();
    for local in [64, 32] {
        q.submit(|cg| {
            cg.read_write(&y);
            cg.launch_nd(&scale, gantry::NdRange::new(256, local));
        })
        .unwrap();
    }
    graph.end_recording(&q).unwrap();
    let exec = graph.finalize(gantry::GraphProps::default().fused()).unwrap();
    assert!(exec.fused_chains().is_empty(), "{:?}", exec.fused_chains());
    match &exec.not_fused()[..] {
        [gantry::NotFused::Refused {
            nodes, reason: gantry::FusionError::DifferentLocalSizes { .. }, ..
        }] => {
            assert_eq!(nodes, &[0, 1])
        }
        other => panic!("{other:?}"),
    }
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![7f32; 256], "2(2·1+1)+1, unfused");
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![31f32; 256], "2(2·7+1)+1, replayed");
}
