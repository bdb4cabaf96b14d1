//! The Vulkan driver behind the scheduler (feature `vulkan`; lavapipe in CI): registered
//! on the builder, it runs WGSL kernels with scalars, fills and copies the scheduler
//! hands it, moves buffers between its memory and the host's, fails a refused launch's
//! dependents, replays command graphs as recorded Vulkan command buffers, and host
//! tasks submitted to its queues run on the CPU. On a machine without Vulkan, building
//! the runtime is a typed error and the tests say they were skipped.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gantry::driver::ExecError;
use gantry::{
    AccessMode, CodeImage, DeviceKind, Error, GraphProps, ImageKind, Kernel, KernelRef, NdRange,
    QueueOptions, Runtime, Signature,
};

/// A runtime with Vulkan device 0 and a queue on it, or `None` after saying why not.
fn vulkan_runtime(test: &str) -> Option<(Runtime, gantry::Queue)> {
    match Runtime::builder().vulkan(0).try_build() {
        Ok(rt) => {
            let device = rt.devices().len() as u32 - 1;
            let q =
                rt.queue_with(QueueOptions { device, in_order: true }).expect("a queue on the Vulkan device");
            Some((rt, q))
        }
        Err(e) => {
            assert!(
                matches!(e, Error::Exec(ExecError::Unsupported { .. })),
                "Vulkan is present but failed: {e}"
            );
            let _ = writeln!(std::io::stderr(), "`{test}` skipped: no Vulkan device: {e}");
            None
        }
    }
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
    let n = 100_003usize;
    let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
    let y = rt.buffer(&vec![1u32; n]);
    let (z, w, u) = (rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    let kernel = saxpy();
    for a in [2u32, 3, 5] {
        q.submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, n).scalar(0, n as u32).scalar(1, a);
        })
        .unwrap();
    }
    q.submit(|cg| cg.fill(&z, 0xC0FFEE_u32)).unwrap();
    q.submit(|cg| cg.copy(&y, &w)).unwrap();
    let sum = Arc::new(AtomicU64::new(0));
    let s = sum.clone();
    q.submit(|cg| {
        let w = cg.host_read(&w);
        cg.host_task(move |ctx| s.store(w.as_slice(ctx).iter().map(|&v| v as u64).sum(), Ordering::Relaxed));
    })
    .unwrap()
    .wait()
    .unwrap();
    rt.queue()
        .submit(|cg| {
            let y = cg.read(&y);
            let u = cg.elements_out(&u);
            cg.parallel_for(n, move |it| *u.elem(it) = y.get(it, it.global_linear_id()) + 1);
        })
        .unwrap()
        .wait()
        .unwrap();
    let expected: Vec<u32> = (0..n as u32).map(|i| 1 + 10 * i).collect();
    assert_eq!(y.to_vec().unwrap(), expected);
    assert_eq!(w.to_vec().unwrap(), expected, "the copy on the Vulkan device");
    assert_eq!(z.to_vec().unwrap(), vec![0xC0FFEE; n], "the fill on the Vulkan device");
    assert_eq!(u.to_vec().unwrap(), expected.iter().map(|v| v + 1).collect::<Vec<_>>(), "read on the CPU");
    assert_eq!(sum.load(Ordering::Relaxed), expected.iter().map(|&v| v as u64).sum::<u64>(), "host task");
    // A closure kernel has no image the Vulkan device runs: refused at submit.
    let err = q
        .submit(|cg| {
            let y = cg.elements_mut(&y);
            cg.parallel_for(n, move |it| *y.elem(it) += 1);
        })
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. } | Error::NoImageForDevice { .. }), "{err}");
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
/// fails its command with the driver's error naming the kernel, its dependents with a
/// dependency error; the buffer keeps its contents and the
/// runtime goes on.
#[test]
fn a_refused_launch_fails_its_dependents_and_keeps_the_buffer() {
    let Some((rt, q)) = vulkan_runtime("a_refused_launch_fails_its_dependents_and_keeps_the_buffer") else {
        return;
    };
    let y = rt.buffer(&vec![5u32; 64]);
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
    let refused = Kernel::new("refused", sig)
        .with_image(CodeImage::new(ImageKind::Wgsl, "refused", REFUSED.as_bytes()))
        .into_ref();
    let bad = q
        .submit(|cg| {
            cg.read_write(&y);
            cg.launch_nd(&refused, NdRange::new(64, 64)).scalar(0, 64u32);
        })
        .unwrap();
    let after = q.submit(|cg| cg.fill(&y, 9u32)).unwrap();
    match bad.wait() {
        Err(Error::Exec(ExecError::Driver { message, .. }))
            if message.contains("kernel `refused`") && message.contains("does not match") => {}
        other => panic!("a launch of groups of 64 work-items of a kernel of groups of 32: {other:?}"),
    }
    assert!(matches!(after.wait(), Err(Error::Exec(ExecError::DependencyFailed { .. }))));
    assert_eq!(y.to_vec().unwrap(), vec![5; 64], "nothing ran");
    q.submit(|cg| cg.fill(&y, 3u32)).unwrap().wait().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![3; 64], "the device goes on");
}

/// A command graph on the Vulkan device runs as a recorded Vulkan command buffer: a
/// host write, a fill, a kernel with scalars and a copy, finalized once and replayed; a whole-graph update
/// with another scalar and a dynamic parameter pointed at another buffer take effect
/// at the next replay.
#[test]
fn a_command_graph_replays_as_a_vulkan_command_buffer_and_updates() {
    let Some((rt, q)) = vulkan_runtime("a_command_graph_replays_as_a_vulkan_command_buffer_and_updates")
    else {
        return;
    };
    let device = rt.devices().len() as u32 - 1;
    let n = 10_007usize;
    let input: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let other: Vec<u32> = (0..n as u32).map(|i| i ^ 0x00FF_00FF).collect();
    let (x, x2) = (rt.buffer(&input), rt.buffer(&other));
    let (y, w, z) = (rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    let kernel = saxpy();
    let record = |a: u32| {
        let graph = rt.graph_on(device);
        let source = graph.dynamic_buffer(&x);
        let write = graph.add(|cg| cg.copy_from_host(&other, &z, 0), &[]).unwrap();
        let fill = graph.add(|cg| cg.fill(&y, 1u32), &[]).unwrap();
        let axpy = graph
            .add(
                |cg| {
                    cg.read(&x);
                    cg.read_write(&y);
                    cg.launch(&kernel, n).scalar(0, n as u32).scalar(1, a);
                },
                &[write, fill],
            )
            .unwrap();
        graph.set_arg(axpy, 0, &source).unwrap();
        graph.add(|cg| cg.copy(&y, &w), &[axpy]).unwrap();
        (graph, source)
    };
    let expect =
        |from: &[u32], a: u32| from.iter().map(|&v| a.wrapping_mul(v).wrapping_add(1)).collect::<Vec<u32>>();
    let (graph, source) = record(3);
    let exec = graph.finalize(GraphProps::default().updatable()).unwrap();
    assert_eq!(exec.partitions().len(), 1, "one partition on the Vulkan device");
    for _ in 0..5 {
        q.submit_graph(&exec).unwrap();
    }
    q.wait().unwrap();
    assert_eq!(w.to_vec().unwrap(), expect(&input, 3), "five replays");
    assert_eq!(z.to_vec().unwrap(), other, "the host write");

    let (again, _) = record(5);
    exec.update(&again).unwrap();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(w.to_vec().unwrap(), expect(&input, 5), "after a whole-graph update");

    exec.update_param(&source, &x2).unwrap();
    q.submit_graph(&exec).unwrap().wait().unwrap();
    assert_eq!(w.to_vec().unwrap(), expect(&other, 5), "the dynamic parameter's new buffer");
    assert_eq!(x.to_vec().unwrap(), input, "the old one is left as it was");
}
