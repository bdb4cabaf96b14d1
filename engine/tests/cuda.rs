//! The CUDA driver behind the scheduler (feature `cuda`): registered on the builder,
//! it runs CUDA C kernels with scalars, fills and copies the scheduler hands it, moves
//! buffers between its memory and the host's, fails a refused launch's dependents,
//! and host tasks submitted to its queues run on the CPU. On a machine without CUDA,
//! building the runtime is a typed error and the GPU tests say they were skipped.

mod gpu_scenarios;

use std::io::Write;

use gantry::driver::ExecError;
use gantry::{
    AccessMode, CodeImage, DeviceKind, Error, ImageKind, Kernel, KernelRef, QueueOptions, Runtime, Signature,
};

/// A runtime with CUDA device 0 and a queue on it, or `None` after saying why not.
fn cuda_runtime(test: &str) -> Option<(Runtime, gantry::Queue)> {
    gpu_scenarios::gpu_runtime("CUDA", test, || Runtime::builder().cuda(0).try_build())
}

const SAXPY: &str = r#"
extern "C" __global__ void saxpy(const unsigned int* x, unsigned int* y, unsigned int n, unsigned int a) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

fn saxpy() -> KernelRef {
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::ReadWrite)
        .scalar::<u32>()
        .scalar::<u32>();
    Kernel::new("saxpy", sig)
        .with_image(CodeImage::new(ImageKind::CudaC, "saxpy", SAXPY.as_bytes()))
        .into_ref()
}

#[test]
fn building_without_cuda_is_a_typed_error_and_with_it_registers_a_cuda_device() {
    match Runtime::builder().driver(gantry::cuda::factory(0)).try_build() {
        Ok(rt) => assert_eq!(rt.devices().last().map(|d| d.kind), Some(DeviceKind::Other("cuda"))),
        Err(Error::Exec(ExecError::Unsupported { what, .. })) => {
            assert!(what.starts_with("CUDA ("), "{what}")
        }
        Err(e) => panic!("CUDA is present but the runtime did not build: {e}"),
    }
}

/// Kernels with scalars over a plain range (several blocks and a guarded tail), a fill
/// and a copy on the CUDA queue; a closure kernel on the CPU and a host task (which the
/// scheduler runs on the CPU) read what they wrote: the scheduler moves the buffers.
#[test]
fn kernels_fills_copies_and_host_tasks_through_the_scheduler() {
    let Some((rt, q)) = cuda_runtime("kernels_fills_copies_and_host_tasks_through_the_scheduler") else {
        return;
    };
    gpu_scenarios::kernels_fills_copies_and_host_tasks(&rt, &q, &saxpy());
}

const REFUSED: &str = r#"
extern "C" __global__ void __launch_bounds__(32) refused(unsigned int* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 0xBAD;
}
"#;

/// A launch of a kernel bounded to 32 threads per block over a block of 64 is refused
/// by `cuLaunchKernel`; see the scenario.
#[test]
fn a_refused_launch_fails_its_dependents_and_keeps_the_buffer() {
    let Some((rt, q)) = cuda_runtime("a_refused_launch_fails_its_dependents_and_keeps_the_buffer") else {
        return;
    };
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
    let refused = Kernel::new("refused", sig)
        .with_image(CodeImage::new(ImageKind::CudaC, "refused", REFUSED.as_bytes()))
        .into_ref();
    let by_launch = |e: &ExecError| matches!(e, ExecError::Backend { call: "cuLaunchKernel", .. });
    gpu_scenarios::a_refused_launch_fails_its_dependents(&rt, &q, &refused, by_launch);
}

/// The command graph scenario: on the CUDA device it replays as a CUDA graph.
#[test]
fn a_command_graph_replays_as_a_cuda_graph_and_updates() {
    let Some((rt, q)) = cuda_runtime("a_command_graph_replays_as_a_cuda_graph_and_updates") else {
        return;
    };
    gpu_scenarios::a_command_graph_replays_and_updates(&rt, &q, &saxpy());
}

/// OpenCL C kernels compiled ahead of time to LLVM IR (`kernels/jit_kernels.ll`).
#[cfg(feature = "jit")]
const JIT_KERNELS: &str = include_str!("kernels/jit_kernels.ll");

/// LLVM IR kernels on the GPU (feature `jit`): compiled to PTX by the JIT when first
/// launched. A guarded elementwise kernel over a plain range whose last block
/// overhangs it, a work-group reduction in shared memory with barriers in a loop over
/// an ND-range, and the same kernel in a command graph replayed as a CUDA graph.
#[cfg(feature = "jit")]
#[test]
fn llvm_ir_kernels_run_on_the_gpu_through_the_jit() {
    let Some((rt, q)) = cuda_runtime("llvm_ir_kernels_run_on_the_gpu_through_the_jit") else { return };
    let device = rt.devices().len() as u32 - 1;
    let ir = |entry: &str, signature: Signature| {
        let image = gantry::jit::from_llvm_ir(JIT_KERNELS.as_bytes(), entry).unwrap();
        Kernel::new(entry, signature).with_image(image).into_ref()
    };
    let saxpy = ir(
        "saxpy",
        Signature::new()
            .global(AccessMode::Read)
            .global(AccessMode::ReadWrite)
            .scalar::<u32>()
            .scalar::<f32>(),
    );
    let n = 100_003usize;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let (xb, yb) = (rt.buffer(&x), rt.buffer(&vec![1f32; n]));
    q.submit(|cg| {
        cg.read(&xb);
        cg.read_write(&yb);
        cg.launch(&saxpy, n).scalar(0, n as u32).scalar(1, 3f32);
    })
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(yb.to_vec().unwrap(), x.iter().map(|v| 3.0 * v + 1.0).collect::<Vec<_>>(), "saxpy");

    let group = 256usize;
    let groups = 509usize;
    let sums = ir(
        "group_sums",
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(group * 4),
    );
    let input: Vec<i32> = (0..(group * groups) as i32).map(|i| (i * 7919) % 1000 - 500).collect();
    let (data, out) = (rt.buffer(&input), rt.buffer_zeroed::<i32>(groups));
    q.submit(|cg| {
        cg.read(&data);
        cg.write(&out);
        cg.launch_nd(&sums, gantry::NdRange::new(group * groups, group));
    })
    .unwrap()
    .wait()
    .unwrap();
    let expected: Vec<i32> = input.chunks(group).map(|c| c.iter().sum()).collect();
    assert_eq!(out.to_vec().unwrap(), expected, "work-group sums in shared memory");

    let axpb = ir(
        "axpb",
        Signature::new().global(AccessMode::ReadWrite).scalar::<u32>().scalar::<f32>().scalar::<f32>(),
    );
    let z = rt.buffer(&vec![0f32; n]);
    let graph = rt.graph_on(device);
    for _ in 0..4 {
        graph
            .add(
                |cg| {
                    cg.read_write(&z);
                    cg.launch(&axpb, n).scalar(0, n as u32).scalar(1, 2f32).scalar(2, 1f32);
                },
                &[],
            )
            .unwrap();
    }
    let exec = graph.finalize(gantry::GraphProps::default()).unwrap();
    q.submit_graph(&exec).unwrap();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    // Eight steps of z = 2z + 1 from 0: 2^8 - 1.
    assert_eq!(z.to_vec().unwrap(), vec![255f32; n], "a graph of IR kernels, replayed twice");
}

/// Two GPUs: a kernel on the first writes a buffer, a kernel on the second reads it:
/// the scheduler moves it between the devices (over the peer link where they have
/// one). Skipped with fewer than two CUDA devices.
#[test]
fn a_buffer_moves_between_two_gpus() {
    let count = gantry::cuda::device_count().unwrap_or(0);
    if count < 2 {
        let _ =
            writeln!(std::io::stderr(), "`a_buffer_moves_between_two_gpus` skipped: {count} CUDA device(s)");
        return;
    }
    let rt = Runtime::builder().cuda(0).cuda(1).try_build().expect("two CUDA devices");
    let devices = rt.devices();
    let (d0, d1) = (devices.len() as u32 - 2, devices.len() as u32 - 1);
    let groups = (devices[d0 as usize].caps.peer_group, devices[d1 as usize].caps.peer_group);
    eprintln!("peer groups: {groups:x?}");
    let q0 = rt.queue_with(QueueOptions { device: d0, in_order: true }).unwrap();
    let q1 = rt.queue_with(QueueOptions { device: d1, in_order: true }).unwrap();
    let n = 1 << 20;
    let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
    let y = rt.buffer(&vec![1u32; n]);
    let kernel = saxpy();
    for (q, a) in [(&q0, 2u32), (&q1, 3), (&q0, 5)] {
        q.submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, n).scalar(0, n as u32).scalar(1, a);
        })
        .unwrap();
    }
    q0.wait().unwrap();
    q1.wait().unwrap();
    let expected: Vec<u32> = (0..n as u32).map(|i| 1 + 10 * i).collect();
    assert_eq!(y.to_vec().unwrap(), expected, "y moved GPU 0 → GPU 1 → GPU 0");
}

/// Eight IR kernels fused by the queue on the GPU (the JIT's fusion compiler, then
/// PTX), the intermediates internalized in registers: one fused kernel, the output
/// bit-identical to the Rust reference, the intermediates never written back.
#[cfg(feature = "jit")]
#[test]
fn a_chain_of_ir_kernels_fuses_on_the_gpu() {
    let Some((rt, q)) = cuda_runtime("a_chain_of_ir_kernels_fuses_on_the_gpu") else { return };
    let image = gantry::jit::from_llvm_ir(JIT_KERNELS.as_bytes(), "step").unwrap();
    use gantry_conformance::step_chain::{self, coefficients};
    let step = Kernel::new("step", step_chain::signature()).with_image(image).into_ref();
    let n = 1_000_003usize;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 / 7.0).collect();
    let expected = step_chain::reference(&x, 8);
    for barriers in [true, false] {
        let mut buffers = vec![rt.buffer(&x)];
        buffers.extend((0..8).map(|_| rt.buffer(&vec![-1f32; n])));
        q.start_fusion().unwrap();
        for k in 0..8 {
            let (a, b) = coefficients(k);
            q.submit(|cg| {
                let input = cg.read(&buffers[k]);
                let output = cg.discard_write(&buffers[k + 1]);
                if k > 0 {
                    cg.promote(&input, gantry::Promotion::Private);
                }
                if k < 7 {
                    cg.promote(&output, gantry::Promotion::Private);
                }
                cg.launch(&step, n).scalar(0, n as u32).scalar(1, a).scalar(2, b);
            })
            .unwrap();
        }
        q.complete_fusion(gantry::FusionProps { barriers }).unwrap().wait().unwrap();
        match q.fusion_outcome() {
            Some(gantry::FusionOutcome::Fused { kernels: 8, .. }) => {}
            other => panic!("barriers {barriers}: {other:?}"),
        }
        let got = buffers[8].to_vec().unwrap();
        let wrong = (0..n).find(|&i| got[i].to_bits() != expected[i].to_bits());
        assert!(
            wrong.is_none(),
            "barriers {barriers}: element {wrong:?} is {:?}, expected {:?}",
            wrong.map(|i| got[i]),
            wrong.map(|i| expected[i])
        );
        // Internalized, the intermediate is not written back: the buffer holds no
        // step-4 values (a device copy of a discarded buffer starts zeroed).
        let middle = buffers[4].to_vec().unwrap();
        let step4 = step_chain::reference(&x, 4);
        let written = (0..n).filter(|&i| middle[i] == step4[i]).count();
        assert!(written < n / 100, "an internalized intermediate holds {written} computed values");
    }
}

/// Math built-ins in an IR kernel on the GPU: `sqrt` (correctly rounded, `sqrt.rn`),
/// `fmax` and `fabs` are exact, so the GPU computes the Rust reference's bits.
#[cfg(feature = "jit")]
#[test]
fn math_built_ins_compute_exact_results_on_the_gpu() {
    let Some((rt, q)) = cuda_runtime("math_built_ins_compute_exact_results_on_the_gpu") else { return };
    let image = gantry::jit::from_llvm_ir(JIT_KERNELS.as_bytes(), "clamp_sqrt").unwrap();
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
    let kernel = Kernel::new("clamp_sqrt", sig).with_image(image).into_ref();
    let n = 100_003usize;
    let input: Vec<f32> = (0..n).map(|i| (i as f32 - 50_000.0) * 0.37).collect();
    let x = rt.buffer(&input);
    q.submit(|cg| {
        cg.read_write(&x);
        cg.launch(&kernel, n).scalar(0, n as u32);
    })
    .unwrap()
    .wait()
    .unwrap();
    let want: Vec<f32> = input.iter().map(|v| v.abs().max(0.25).sqrt()).collect();
    assert_eq!(x.to_vec().unwrap(), want);
}
