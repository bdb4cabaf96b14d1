//! Scenarios every GPU driver behind the scheduler runs (`tests/cuda.rs`,
//! `tests/vulkan.rs`), each given a runtime whose last device is the GPU, a queue on
//! it and the driver's kernels.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gantry::driver::ExecError;
use gantry::{Error, GraphProps, KernelRef, NdRange, Queue, QueueOptions, Runtime};

/// The runtime `build` makes and an in-order queue on its last device (the GPU), or
/// `None` after saying that `test` was skipped because `backend` is unavailable; a
/// runtime that fails otherwise fails the test.
pub fn gpu_runtime(
    backend: &str,
    test: &str,
    build: impl FnOnce() -> Result<Runtime, Error>,
) -> Option<(Runtime, Queue)> {
    match build() {
        Ok(rt) => {
            let device = rt.devices().len() as u32 - 1;
            let q = rt.queue_with(QueueOptions { device, in_order: true }).expect("a queue on the GPU");
            Some((rt, q))
        }
        Err(e) => {
            assert!(
                matches!(e, Error::Exec(ExecError::Unsupported { .. })),
                "{backend} is present but failed: {e}"
            );
            eprintln!("`{test}` skipped: no {backend} device: {e}");
            None
        }
    }
}

/// Kernels with scalars over a plain range (several work-groups and a guarded tail),
/// a fill and a copy on the GPU queue `q`; a closure kernel on the CPU and a host task
/// (which the scheduler runs on the CPU) read what they wrote: the scheduler moves the
/// buffers. A closure kernel submitted to the GPU queue is refused. `saxpy` computes
/// `y = a·x + y` on `u32`, scalars `n` then `a`.
pub fn kernels_fills_copies_and_host_tasks(rt: &Runtime, q: &Queue, saxpy: &KernelRef) {
    let n = 100_003usize;
    let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
    let y = rt.buffer(&vec![1u32; n]);
    let (z, w, u) = (rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    let kernel = saxpy;
    for a in [2u32, 3, 5] {
        q.submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(kernel, n).scalar(0, n as u32).scalar(1, a);
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
    assert_eq!(w.to_vec().unwrap(), expected, "the copy on the GPU");
    assert_eq!(z.to_vec().unwrap(), vec![0xC0FFEE; n], "the fill on the GPU");
    assert_eq!(u.to_vec().unwrap(), expected.iter().map(|v| v + 1).collect::<Vec<_>>(), "read on the CPU");
    assert_eq!(sum.load(Ordering::Relaxed), expected.iter().map(|&v| v as u64).sum::<u64>(), "host task");
    // A closure kernel has no image the GPU runs: refused at submit.
    let err = q
        .submit(|cg| {
            let y = cg.elements_mut(&y);
            cg.parallel_for(n, move |it| *y.elem(it) += 1);
        })
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. } | Error::NoImageForDevice { .. }), "{err}");
}

/// A launch of `refused` (one buffer slot and a `u32` scalar, launched over an
/// ND-range of one group of 64) that the device refuses fails its command with the
/// error `refusal` accepts, its dependents with a dependency error; the buffer
/// keeps its contents and the runtime goes on.
pub fn a_refused_launch_fails_its_dependents(
    rt: &Runtime,
    q: &Queue,
    refused: &KernelRef,
    refusal: impl Fn(&ExecError) -> bool,
) {
    let y = rt.buffer(&vec![5u32; 64]);
    let bad = q
        .submit(|cg| {
            cg.read_write(&y);
            cg.launch_nd(refused, NdRange::new(64, 64)).scalar(0, 64u32);
        })
        .unwrap();
    let after = q.submit(|cg| cg.fill(&y, 9u32)).unwrap();
    match bad.wait() {
        Err(Error::Exec(e)) if refusal(&e) => {}
        other => panic!("a launch the device refuses: {other:?}"),
    }
    assert!(matches!(after.wait(), Err(Error::Exec(ExecError::DependencyFailed { .. }))));
    assert_eq!(y.to_vec().unwrap(), vec![5; 64], "nothing ran");
    q.submit(|cg| cg.fill(&y, 3u32)).unwrap().wait().unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![3; 64], "the device goes on");
}

/// A command graph on the GPU (the runtime's last device) replays as the driver's
/// command buffer: a host write, a fill, `saxpy` with scalars and a copy, finalized
/// once and replayed; a whole-graph update with another scalar and a dynamic
/// parameter pointed at another buffer take effect at the next replay.
pub fn a_command_graph_replays_and_updates(rt: &Runtime, q: &Queue, saxpy: &KernelRef) {
    let device = rt.devices().len() as u32 - 1;
    let n = 10_007usize;
    let input: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let other: Vec<u32> = (0..n as u32).map(|i| i ^ 0x00FF_00FF).collect();
    let (x, x2) = (rt.buffer(&input), rt.buffer(&other));
    let (y, w, z) = (rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n), rt.buffer_zeroed::<u32>(n));
    let kernel = saxpy;
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
                    cg.launch(kernel, n).scalar(0, n as u32).scalar(1, a);
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
    assert_eq!(exec.partitions().len(), 1, "one partition on the GPU");
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
