//! Several devices: the simulated device's separate memory, memory moves inserted
//! by dependency resolution, and work alternating between devices.

use gantry::{DeviceKind, Mode, QueueOptions, Runtime, SimConfig};

fn sim_runtime(mode: Mode) -> Runtime {
    Runtime::builder().mode(mode).sim(SimConfig::default()).build()
}

/// A buffer used on the sim device is moved there and back; results are right only
/// if every move and dependency is in place.
#[test]
fn work_alternating_between_cpu_and_sim() {
    for mode in [Mode::Manual, Mode::Threaded] {
        let rt = sim_runtime(mode);
        assert_eq!(rt.devices()[1].kind, DeviceKind::Sim);
        let cpu = rt.queue();
        let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
        let n = 3000;
        let buf = rt.buffer(&vec![1u32; n]);
        let add = |q: &gantry::Queue, k: u32| {
            q.submit(|cg| {
                let b = cg.read_write(&buf);
                cg.parallel_for(n, move |it| {
                    let i = it.global_linear_id();
                    b.set(it, i, b.get(it, i) * 3 + k)
                });
            })
            .unwrap()
        };
        let mut expect = 1u32;
        for k in 0..6 {
            add(if k % 2 == 0 { &sim } else { &cpu }, k);
            expect = expect * 3 + k;
        }
        assert_eq!(buf.to_vec().unwrap(), vec![expect; n], "{mode:?}");
        // host→sim, sim→host three times each.
        assert_eq!(rt.stats().moves, 6);
    }
}

/// Reads on the sim device do not move data back; a host read after a sim write
/// moves it once; a whole-buffer discard-write on the sim needs no move in.
#[test]
fn moves_only_when_needed() {
    let rt = sim_runtime(Mode::Manual);
    let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
    let a = rt.buffer(&[2u32; 64]);
    let b = rt.buffer_zeroed::<u32>(64);
    sim.submit(|cg| {
        let a = cg.read(&a);
        let b = cg.discard_write(&b);
        cg.parallel_for(64, move |it| b.set(it, it.global_linear_id(), a.get(it, it.global_linear_id()) + 1));
    })
    .unwrap();
    sim.submit(|cg| {
        let a = cg.read(&a);
        let b = cg.read_write(&b);
        cg.parallel_for(64, move |it| {
            b.set(it, it.global_linear_id(), b.get(it, it.global_linear_id()) * a.get(it, 0))
        });
    })
    .unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![6; 64]);
    assert_eq!(a.to_vec().unwrap(), vec![2; 64]);
    // a: host→sim once (host copy stays valid); b: no move in, one move out.
    assert_eq!(rt.stats().moves, 2);
}

/// Host data copied straight to the sim device, and sim data read back with a copy.
#[test]
fn copies_to_and_from_the_sim_device() {
    let rt = sim_runtime(Mode::Threaded);
    let sim = rt.queue_with(QueueOptions { device: 1, in_order: true }).unwrap();
    let buf = rt.buffer_zeroed::<f32>(16);
    sim.submit(|cg| cg.copy_from_host(&[1.5f32; 16], &buf, 0)).unwrap();
    sim.submit(|cg| cg.fill_range(&buf, 8..16, -2.0)).unwrap();
    let out = gantry::Readback::new();
    sim.submit(|cg| cg.copy_to_host(&buf, 6..10, &out)).unwrap().wait().unwrap();
    assert_eq!(out.take(), Some(vec![1.5, 1.5, -2.0, -2.0]));
}

/// Host tasks submitted to a sim queue run on the host, after the sim work they
/// depend on has been moved back.
#[test]
fn host_task_after_sim_kernel() {
    let rt = sim_runtime(Mode::Threaded);
    let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
    let buf = rt.buffer_zeroed::<u64>(100);
    sim.submit(|cg| {
        let b = cg.elements_out(&buf);
        cg.parallel_for(100, move |it| *b.elem(it) = it.global_linear_id() as u64);
    })
    .unwrap();
    let total = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let t = total.clone();
    sim.submit(|cg| {
        let b = cg.host_read(&buf);
        cg.host_task(move |ctx| t.store(b.as_slice(ctx).iter().sum(), std::sync::atomic::Ordering::Relaxed));
    })
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(total.load(std::sync::atomic::Ordering::Relaxed), 4950);
}

/// Sim timestamps are virtual and deterministic.
#[test]
fn sim_timestamps_are_deterministic() {
    let run = || {
        let rt = Runtime::builder()
            .mode(Mode::Manual)
            .sim(SimConfig { latency_ns: 500, ..Default::default() })
            .build();
        let sim = rt.queue_with(QueueOptions { device: 1, in_order: true }).unwrap();
        let buf = rt.buffer_zeroed::<u32>(8);
        let evs: Vec<_> = (0..4).map(|v| sim.submit(|cg| cg.fill(&buf, v)).unwrap()).collect();
        evs.last().unwrap().wait().unwrap();
        evs.iter().map(|e| e.timestamps().unwrap()).map(|t| (t.started_ns, t.ended_ns)).collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run());
    assert!(a.windows(2).all(|w| w[1].0 >= w[0].1), "an in-order chain does not overlap: {a:?}");
}

/// The sim's cost model through the public API: a kernel's declared per-item cost,
/// one compute engine serializing independent kernels, a copy overlapping them on a
/// copy engine. Virtual times are exact.
#[test]
fn cost_model_times_commands() {
    use gantry::CostModel;
    let cost = CostModel {
        item_ns: 1.0,
        compute_units: 100,
        link_bytes_per_ns: 4.0,
        compute_engines: 1,
        copy_engines: 1,
        ..Default::default()
    };
    let rt = Runtime::builder()
        .mode(Mode::Manual)
        .sim(SimConfig { latency_ns: 5, cost, ..Default::default() })
        .build();
    let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
    let (a, b) = (rt.buffer_zeroed::<u32>(1000), rt.buffer_zeroed::<u32>(1000));
    let k = |buf: &gantry::Buffer<u32>, cost: Option<f64>| {
        sim.submit(|cg| {
            if let Some(c) = cost {
                cg.item_cost_ns(c);
            }
            let out = cg.elements_out(buf);
            cg.parallel_for(1000, move |it| *out.elem(it) = 1);
        })
        .unwrap()
    };
    let ka = k(&a, None); // 1000 items / 100 lanes * 1 ns = 10 ns (+5)
    let kb = k(&b, Some(3.0)); // 30 ns (+5), after ka on the single compute engine
    let up = sim.submit(|cg| cg.copy_from_host(&[7u32; 100], &a, 0)).unwrap(); // 400 B / 4 = 100 ns (+5)
    up.wait().unwrap();
    kb.wait().unwrap();
    let span = |e: &gantry::Event| e.timestamps().map(|t| (t.started_ns, t.ended_ns)).unwrap();
    assert_eq!(span(&ka), (0, 15));
    assert_eq!(span(&kb), (15, 50));
    assert_eq!(span(&up), (15, 120), "the copy waits for ka (WAW on a), not for the compute engine");
    assert_eq!(a.to_vec().unwrap()[..3], [7, 7, 7]);
}
