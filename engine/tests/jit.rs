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
