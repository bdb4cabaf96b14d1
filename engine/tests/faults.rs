//! Fault injection on the simulated device: a failed kernel, copy or allocation and a
//! lost device become typed errors on the failed command and its dependents;
//! independent work completes; buffers keep their last valid contents; after device
//! loss the runtime refuses new work on that device and keeps serving the others.

use gantry::{Error, ExecError, Fault, FaultPlan, Mode, Queue, QueueOptions, Runtime, SimConfig};

fn runtime(faults: FaultPlan) -> Runtime {
    Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .sim(SimConfig { faults, ..Default::default() })
        .build()
}

fn sim_queue(rt: &Runtime, in_order: bool) -> Queue {
    rt.queue_with(QueueOptions { device: 1, in_order }).unwrap()
}

fn add(q: &Queue, buf: &gantry::Buffer<u32>, k: u32) -> gantry::Event {
    q.submit(|cg| {
        let b = cg.elements_mut(buf);
        cg.parallel_for(buf.len(), move |it| *b.elem(it) += k);
    })
    .unwrap()
}

#[test]
fn kernel_fault_fails_it_and_its_dependents_only() {
    let rt = runtime(FaultPlan::default().with(Fault::Kernel { nth: 1 }));
    let q = sim_queue(&rt, true);
    let a = rt.buffer(&[1u32; 64]);
    let ok = add(&q, &a, 10); // kernel 0
    let bad = add(&q, &a, 100); // kernel 1: injected fault
    let dependent = add(&q, &a, 1000); // after it in an in-order queue
    assert!(ok.wait().is_ok());
    assert_eq!(
        bad.wait(),
        Err(Error::Exec(ExecError::Fault { device: "sim".into(), what: "kernel launch failed" }))
    );
    let err = dependent.wait().unwrap_err();
    assert!(matches!(&err, Error::Exec(e) if matches!(e.root_cause(), ExecError::Fault { .. })), "{err:?}");
    // Independent work on the same device completes, and the buffer holds the last
    // valid contents (after kernel 0 only).
    let other = rt.buffer(&[5u32; 8]);
    add(&sim_queue(&rt, false), &other, 1).wait().unwrap();
    assert_eq!(other.to_vec().unwrap(), vec![6; 8]);
    assert_eq!(a.to_vec().unwrap(), vec![11; 64]);
}

#[test]
fn copy_fault_fails_the_move_and_its_consumer() {
    let rt = runtime(FaultPlan::default().with(Fault::Copy { nth: 0 }));
    let q = sim_queue(&rt, false);
    let a = rt.buffer(&[3u32; 16]);
    let consumer = add(&q, &a, 1); // needs a host->sim move: copy 0 fails
    let err = consumer.wait().unwrap_err();
    assert!(
        matches!(&err, Error::Exec(ExecError::DependencyFailed { cause, .. })
            if matches!(**cause, ExecError::Fault { what: "copy failed", .. })),
        "{err:?}"
    );
    assert_eq!(a.to_vec().unwrap(), vec![3; 16], "host copy untouched");
    // The runtime keeps going: the next move succeeds.
    add(&q, &a, 1).wait().unwrap();
    assert_eq!(a.to_vec().unwrap(), vec![4; 16]);
}

#[test]
fn allocation_fault_is_out_of_memory_for_that_command() {
    let rt = runtime(FaultPlan::default().with(Fault::Alloc { nth: 0 }));
    let q = sim_queue(&rt, false);
    let a = rt.buffer(&[0u32; 4]);
    let b = rt.buffer(&[0u32; 4]);
    let err = add(&q, &a, 1).wait().unwrap_err();
    assert!(matches!(err, Error::Exec(ExecError::OutOfMemory { requested: 16, .. })), "{err:?}");
    add(&q, &b, 2).wait().unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![2; 4]);
    assert_eq!(a.to_vec().unwrap(), vec![0; 4]);
}

#[test]
fn device_loss_refuses_new_work_and_keeps_the_cpu_serving() {
    // Operations on the sim: 0 move a in, 1 kernel on a, 2 move a out (lost here).
    let rt = runtime(FaultPlan::default().with(Fault::DeviceLost { nth: 3 }));
    let sim = sim_queue(&rt, true);
    let a = rt.buffer(&[1u32; 32]);
    let b = rt.buffer(&[7u32; 32]);
    add(&sim, &a, 1).wait().unwrap(); // ops 0, 1
    assert_eq!(a.to_vec().unwrap(), vec![2; 32]); // op 2: move out
    let lost = add(&sim, &a, 1); // op 3: the device is lost
    let err = lost.wait().unwrap_err();
    assert!(matches!(err, Error::Exec(ExecError::DeviceLost { .. })), "{err:?}");
    // New work on the lost device is refused at submission, with a clear error.
    let refused = sim.submit(|cg| cg.fill(&b, 0)).unwrap_err();
    assert_eq!(refused, Error::Exec(ExecError::DeviceLost { device: "sim".into() }));
    // The CPU keeps serving, with the last valid contents of `a`.
    let cpu = rt.queue();
    add(&cpu, &a, 100).wait().unwrap();
    add(&cpu, &b, 1).wait().unwrap();
    assert_eq!(a.to_vec().unwrap(), vec![102; 32]);
    assert_eq!(b.to_vec().unwrap(), vec![8; 32]);
}

#[test]
fn seeded_faults_are_deterministic() {
    let run = || {
        let rt = runtime(FaultPlan::default().seeded(42, 300, 0));
        let q = sim_queue(&rt, true);
        let bufs: Vec<_> = (0..40).map(|i| rt.buffer(&[i as u32; 4])).collect();
        let events: Vec<_> = bufs.iter().map(|b| add(&q, b, 1)).collect();
        let failed: Vec<usize> =
            events.iter().enumerate().filter(|(_, e)| e.wait().is_err()).map(|(i, _)| i).collect();
        let contents: Vec<u32> = bufs.iter().map(|b| b.to_vec().unwrap()[0]).collect();
        (failed, contents)
    };
    let (failed, contents) = run();
    assert!(!failed.is_empty() && failed.len() < 40, "{failed:?}");
    for (i, c) in contents.iter().enumerate() {
        let expect = if failed.contains(&i) { i as u32 } else { i as u32 + 1 };
        assert_eq!(*c, expect, "buffer {i} keeps its last valid contents");
    }
    assert_eq!(run(), (failed, contents));
}

/// Found by the state-machine test: a kernel on the CPU reading a buffer whose last
/// writer (a fill on the sim) was poisoned by an earlier failure must fail too.
#[test]
fn poisoned_device_writer_poisons_host_readers() {
    let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).sim(SimConfig::default()).build();
    let cpu = rt.queue();
    let sim = sim_queue(&rt, false);
    let a = rt.buffer(&[0u32]);
    let b = rt.buffer(&[1u32]);
    let fk = cpu
        .submit(|cg| {
            let o = cg.read_write(&b);
            cg.single_task(move |it| {
                o.set(it, 0, 9);
                panic!("x")
            });
        })
        .unwrap();
    let fill = sim.submit(|cg| cg.fill(&b, 0)).unwrap();
    let k = cpu
        .submit(|cg| {
            let s = cg.read(&b);
            let o = cg.elements_out(&a);
            cg.parallel_for(1, move |it| *o.elem(it) = s.get(it, 0));
        })
        .unwrap();
    rt.wait_idle().unwrap();
    assert!(fk.wait().is_err());
    assert!(fill.wait().is_err(), "{:?}", fill.wait());
    assert!(k.wait().is_err(), "{:?}", k.wait());
    assert_eq!(b.to_vec().unwrap(), vec![1]);
    assert_eq!(a.to_vec().unwrap(), vec![0]);
}
