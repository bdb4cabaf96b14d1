//! The simulated machine: several simulated devices on one virtual clock, direct
//! device-to-device links, and host tasks on a modelled host thread pool.
//!
//! Every run is in manual mode, where virtual time is deterministic, so the tests
//! assert exact timestamps where the cost model makes them easy to compute.

use gantry::{
    Buffer, CostModel, Event, HostPoolConfig, MachineConfig, Mode, Queue, QueueOptions, Runtime, SimConfig,
};

/// 4 bytes per ns over the host link, 100 over a device-to-device link, 1 ns per
/// work-item on one lane: easy numbers.
fn gpu(name: &str) -> SimConfig {
    SimConfig {
        name: name.into(),
        latency_ns: 100,
        cost: CostModel {
            item_ns: 1.0,
            compute_units: 1,
            link_bytes_per_ns: 4.0,
            compute_engines: 1,
            copy_engines: 1,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn two_gpus(machine: MachineConfig) -> Runtime {
    Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .host_threads(0)
        .sim(gpu("gpu0"))
        .sim(gpu("gpu1"))
        .sim_machine(machine)
        .timeline(true)
        .build()
}

/// A recorded manual runtime: one simulated GPU (device 1) and a host pool of
/// `threads` threads, 1 µs per task by default (device 2).
fn gpu_and_pool(threads: u32) -> Runtime {
    let host = HostPoolConfig { threads, task_ns: 1_000, latency_ns: 0, memory_bytes_per_ns: 0.0 };
    Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .host_threads(0)
        .sim(gpu("gpu0"))
        .sim_machine(MachineConfig { peer_bytes_per_ns: 0.0, host: Some(host) })
        .timeline(true)
        .build()
}

fn queue(rt: &Runtime, device: u32) -> Queue {
    rt.queue_with(QueueOptions { device, in_order: false }).unwrap()
}

/// `dst[i] = src[i] * 2 + k` over `n` items (src may be dst).
fn scale(q: &Queue, src: &Buffer<u32>, dst: &Buffer<u32>, n: usize, k: u32) -> Event {
    q.submit(|cg| {
        let s = (!std::ptr::eq(src, dst)).then(|| cg.read(src));
        let d = cg.read_write(dst);
        cg.parallel_for(n, move |it| {
            let i = it.global_linear_id();
            let x = match &s {
                Some(s) => s.get(it, i),
                None => d.get(it, i),
            };
            d.set(it, i, x * 2 + k);
        });
    })
    .unwrap()
}

fn span(ev: &Event) -> (u64, u64) {
    let t = ev.timestamps().expect("a runtime with a simulated device profiles");
    (t.started_ns, t.ended_ns)
}

/// Moves recorded in the timeline: (name, device, start, end).
fn moves(rt: &Runtime) -> Vec<(String, u32, u64, u64)> {
    let t = rt.timeline().unwrap();
    t.slices
        .iter()
        .filter(|s| s.kind.name() == "memory_move")
        .map(|s| (s.name.to_string(), s.device, s.start_ns, s.end_ns))
        .collect()
}

/// A kernel on one device feeds a kernel on another: with a device-to-device link
/// the data crosses once, straight from peer memory, at the link's bandwidth; without
/// one it goes through host memory, over both devices' host links. Either way the
/// consumer starts only after the producer and the moves, on the shared clock.
#[test]
fn cross_device_dependencies_use_peer_links_when_there_are_some() {
    let n = 4000; // 16,000 bytes
    let mut makespans = Vec::new();
    for peer in [0.0, 100.0] {
        let rt = two_gpus(MachineConfig { peer_bytes_per_ns: peer, host: None });
        let (q0, q1) = (queue(&rt, 1), queue(&rt, 2));
        let a = rt.buffer_zeroed::<u32>(n);
        let b = rt.buffer_zeroed::<u32>(n);
        let produce = scale(&q0, &a, &a, n, 1);
        let consume = scale(&q1, &a, &b, n, 3);
        rt.wait_idle().unwrap();
        assert_eq!(b.to_vec().unwrap(), vec![5; n], "peer {peer}");
        let (p, c) = (span(&produce), span(&consume));
        // The moves of the producer's output, between the two kernels.
        let between: Vec<_> = moves(&rt).into_iter().filter(|m| m.2 >= p.1 && m.3 <= c.0).collect();
        if peer > 0.0 {
            // gpu0→gpu1 directly, run by the destination's copy engine: latency +
            // 16,000 B / 100 B/ns, right when the producer ends.
            assert_eq!(between.len(), 1, "{between:?}");
            let m = &between[0];
            assert!(m.0.ends_with("Device(1)->Device(2)") && m.1 == 2, "{m:?}");
            assert_eq!((m.2, m.3 - m.2), (p.1, 100 + 160));
            assert_eq!(c.0, m.3);
        } else {
            // Through the host: gpu0→host, then host→gpu1, each latency + 16,000 / 4.
            assert_eq!(between.len(), 2, "{between:?}");
            let (out, back) = (&between[0], &between[1]);
            assert!(out.0.ends_with("Device(1)->Host") && back.0.ends_with("Host->Device(2)"), "{between:?}");
            assert_eq!((out.2, out.3 - out.2), (p.1, 100 + 4000));
            assert_eq!((back.2, back.3 - back.2), (out.3, 100 + 4000));
            assert_eq!(c.0, back.3);
        }
        makespans.push(c.1);
    }
    assert!(makespans[1] < makespans[0], "the link is faster than two host hops: {makespans:?}");
}

/// Independent work on two devices overlaps on the shared clock, and a command that
/// reacts to an early completion on one device starts then, not after unrelated
/// later work that device finished in the same poll.
#[test]
fn devices_share_one_clock_and_reactions_start_when_their_dependency_ended() {
    let rt = two_gpus(MachineConfig { peer_bytes_per_ns: 100.0, host: None });
    let (q0, q1) = (queue(&rt, 1), queue(&rt, 2));
    let small = rt.buffer_zeroed::<u32>(10);
    let big = rt.buffer_zeroed::<u32>(100_000);
    let other = rt.buffer_zeroed::<u32>(1_000);
    let out = rt.buffer_zeroed::<u32>(10);
    // Device-resident first, so the timed part has no host transfers.
    let fills: Vec<Event> = [(&q0, &small), (&q0, &big), (&q1, &other), (&q1, &out)]
        .into_iter()
        .map(|(q, b)| q.submit(|cg| cg.fill(b, 0)).unwrap())
        .collect();
    rt.wait_idle().unwrap();
    let start = fills.iter().map(|f| span(f).1).max().unwrap();
    // Now: a short kernel and a long one on gpu0, independent work on gpu1, and a
    // gpu1 kernel that needs only the short one's output.
    let short = scale(&q0, &small, &small, 10, 1);
    let long = scale(&q0, &big, &big, 100_000, 1);
    let side = scale(&q1, &other, &other, 1_000, 1);
    let react = scale(&q1, &small, &out, 10, 0);
    rt.wait_idle().unwrap();
    let (s, l, o, r) = (span(&short), span(&long), span(&side), span(&react));
    assert!(s.0 >= start && o.0 >= start, "a new frame starts after the last: {start} {s:?} {o:?}");
    assert_eq!(o.0, start, "gpu1's independent work starts at once: {o:?}");
    assert!(l.0 >= s.1, "one compute engine on gpu0: {s:?} {l:?}");
    assert!(r.0 > s.1, "after its producer and the move: {s:?} {r:?}");
    assert!(r.1 < l.1, "but long before gpu0's long kernel ends: {r:?} {l:?}");
    assert_eq!(out.to_vec().unwrap(), small.to_vec().unwrap().iter().map(|x| x * 2).collect::<Vec<_>>());
}

/// Host tasks submitted to the modelled host pool run in virtual time: each takes
/// its declared duration (or the pool's default), at most `threads` at once, after
/// the device work they read has been copied back to host memory.
#[test]
fn host_tasks_run_on_the_modelled_pool_in_virtual_time() {
    let rt = gpu_and_pool(2);
    let pool_device = 2;
    assert_eq!(&*rt.devices()[pool_device as usize].name, "sim-host");
    let (gpu, pool) = (queue(&rt, 1), queue(&rt, pool_device));
    let data = rt.buffer_zeroed::<u32>(100);
    let produced = scale(&gpu, &data, &data, 100, 7);
    let sums: Vec<_> = (0..4).map(|_| rt.buffer_zeroed::<u32>(1)).collect();
    let tasks: Vec<Event> = sums
        .iter()
        .enumerate()
        .map(|(i, sum)| {
            pool.submit(|cg| {
                if i == 3 {
                    cg.item_cost_ns(2_500.0);
                }
                let d = cg.host_read(&data);
                let mut s = cg.host_read_write(sum);
                cg.host_task(move |ctx| s.as_mut_slice(ctx)[0] = d.as_slice(ctx).iter().sum());
            })
            .unwrap()
        })
        .collect();
    rt.wait_idle().unwrap();
    for sum in &sums {
        assert_eq!(sum.to_vec().unwrap(), vec![700]);
    }
    let back = moves(&rt).into_iter().find(|m| m.0.contains("Device(1)->Host")).expect("copied back");
    let spans: Vec<_> = tasks.iter().map(span).collect();
    assert!(spans.iter().all(|s| s.0 >= back.3 && back.3 > span(&produced).1), "{spans:?} {back:?}");
    let durations: Vec<_> = spans.iter().map(|s| s.1 - s.0).collect();
    // Latency 0 counts as 1 ns.
    assert_eq!(durations, [1_001, 1_001, 1_001, 2_501]);
    // Two threads: the first two overlap, the next two wait for a free thread.
    let first = spans[0].0;
    assert_eq!(spans[1].0, first);
    assert_eq!(spans[2].0, first + 1_001);
    assert_eq!(spans[3].0, first + 1_001);
    let lanes: std::collections::BTreeSet<u32> =
        rt.timeline().unwrap().slices.iter().filter(|s| s.device == pool_device).map(|s| s.lane).collect();
    assert_eq!(lanes.into_iter().collect::<Vec<_>>(), [1, 2], "one lane per host thread");
}

/// A queue of the host pool refuses what the pool cannot do, with a typed error,
/// and the runtime keeps working.
#[test]
fn the_host_pool_refuses_kernels() {
    let rt = Runtime::builder()
        .mode(Mode::Manual)
        .sim_machine(MachineConfig { peer_bytes_per_ns: 0.0, host: Some(HostPoolConfig::default()) })
        .build();
    let pool = queue(&rt, 1);
    let b = rt.buffer(&[1u32; 8]);
    let refused = pool.submit(|cg| {
        let d = cg.read_write(&b);
        cg.parallel_for(8, move |it| d.set(it, it.global_linear_id(), 0));
    });
    let err = refused.unwrap_err();
    assert!(err.to_string().contains("kernels"), "{err}");
    assert_eq!(b.to_vec().unwrap(), vec![1; 8]);
    let ok = pool.submit(|cg| {
        let mut w = cg.host_read_write(&b);
        cg.host_task(move |ctx| w.as_mut_slice(ctx).fill(9));
    });
    ok.unwrap().wait().unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![9; 8]);
}

/// The same program on the same machine gives the same timeline, bit for bit.
#[test]
fn machine_timelines_are_deterministic() {
    let run = || {
        let host = HostPoolConfig { threads: 3, task_ns: 700, latency_ns: 50, memory_bytes_per_ns: 10.0 };
        let rt = two_gpus(MachineConfig { peer_bytes_per_ns: 30.0, host: Some(host) });
        let (q0, q1, pool) = (queue(&rt, 1), queue(&rt, 2), queue(&rt, 3));
        let bufs: Vec<_> = (0..4).map(|i| rt.buffer(&vec![i as u32; 500])).collect();
        for round in 0..6u32 {
            let (a, b) = (&bufs[round as usize % 4], &bufs[(round as usize + 1) % 4]);
            scale(if round % 2 == 0 { &q0 } else { &q1 }, a, b, 500, round);
            pool.submit(|cg| {
                let r = cg.host_read(b);
                let mut w = cg.host_read_write(&bufs[(round as usize + 2) % 4]);
                cg.host_task(move |ctx| w.as_mut_slice(ctx)[0] += r.as_slice(ctx)[0]);
            })
            .unwrap();
        }
        rt.wait_idle().unwrap();
        let data: Vec<Vec<u32>> = bufs.iter().map(|b| b.to_vec().unwrap()).collect();
        let mut slices: Vec<_> = rt
            .timeline()
            .unwrap()
            .slices
            .iter()
            .filter(|s| s.device > 0) // the CPU's host accesses run in real time
            .map(|s| (s.name.to_string(), s.device, s.lane, s.start_ns, s.end_ns))
            .collect();
        slices.sort();
        (data, slices)
    };
    let first = run();
    assert!(first.1.iter().any(|s| s.1 == 3), "host tasks ran on the pool");
    assert_eq!(first, run());
}

/// A host task recorded into a command graph from a host-pool queue replays on the
/// pool, in virtual time, at its declared duration, after the kernel it reads.
#[test]
fn graph_host_tasks_replay_on_the_pool() {
    let rt = gpu_and_pool(1);
    let (gpu, pool) = (queue(&rt, 1), queue(&rt, 2));
    let data = rt.buffer(&[1u32; 16]);
    let total = rt.buffer_zeroed::<u32>(1);
    let graph = rt.graph_on(1);
    graph.begin_recording(&gpu).unwrap();
    graph.begin_recording(&pool).unwrap();
    scale(&gpu, &data, &data, 16, 0);
    pool.submit(|cg| {
        cg.item_cost_ns(3_000.0);
        let d = cg.host_read(&data);
        let mut t = cg.host_read_write(&total);
        cg.host_task(move |ctx| t.as_mut_slice(ctx)[0] += d.as_slice(ctx).iter().sum::<u32>());
    })
    .unwrap();
    graph.end_recording(&gpu).unwrap();
    graph.end_recording(&pool).unwrap();
    let exec = graph.finalize(gantry::GraphProps::default()).unwrap();
    for _ in 0..2 {
        gpu.submit_graph(&exec).unwrap().wait().unwrap();
    }
    assert_eq!(total.to_vec().unwrap(), vec![16 * 2 + 16 * 4]);
    let t = rt.timeline().unwrap();
    let tasks: Vec<_> = t.slices.iter().filter(|s| s.kind.name() == "host_task").collect();
    assert_eq!(tasks.len(), 2);
    for task in &tasks {
        assert_eq!((task.device, task.end_ns - task.start_ns), (2, 3_001), "{task:?}");
    }
    let kernels: Vec<_> =
        t.slices.iter().filter(|s| s.device == 1 && s.kind.name() == "command_buffer").collect();
    assert!(tasks.iter().zip(&kernels).all(|(h, k)| h.start_ns > k.end_ns), "{tasks:?} {kernels:?}");
}
