//! Deterministic regression tests: hand-written cases that are interesting on their
//! own, programs found by the properties (in the `Debug` form a failing property
//! prints, parsed back with `Program::parse`), and known bugs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gantry::components::{EventShared, EventStatus};
use gantry::{Mode, QueueOptions, Read, ReadWrite, Runtime, SimConfig, Write};
use gantry_proptests::{check, run_gantry, run_model, Config, Program};

/// Every configuration the model properties use (threaded ones with their defaults).
fn configs() -> Vec<Config> {
    let mut v = Vec::new();
    for sim in [false, true] {
        v.push(Config::manual(sim));
        for w in [1, 2, 8] {
            v.push(Config::threaded(w, sim));
            v.push(Config { inline_items: 4096, host_threads: 0, ..Config::threaded(w, sim) });
        }
    }
    v
}

fn check_everywhere(text: &str) {
    let p = Program::parse(text).unwrap_or_else(|e| panic!("bad program: {e}"));
    for c in configs() {
        if let Err(e) = check(&p, c) {
            panic!("{e}\n{p:?}");
        }
    }
}

fn runtimes() -> Vec<(&'static str, Runtime)> {
    let sim = |mode: Mode, w: usize| {
        Runtime::builder().mode(mode).worker_threads(w).sim(SimConfig::default()).build()
    };
    vec![("manual", sim(Mode::Manual, 0)), ("threaded", sim(Mode::Threaded, 2))]
}

// ---------------------------------------------------------------------------------
// Hand-written cases on the plain API (expectations computed by hand, not by the model)
// ---------------------------------------------------------------------------------

/// Sub-range writes on the simulated device (a kernel and a fill, on disjoint parts of
/// one buffer), then a CPU kernel reading the whole buffer: the CPU must see both
/// device writes merged with the untouched host contents.
#[test]
fn sim_subrange_writes_then_cpu_read() {
    for (name, rt) in runtimes() {
        let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
        let cpu = rt.queue();
        let a = rt.buffer(&(0..16u32).collect::<Vec<_>>());
        let out = rt.buffer_zeroed::<u32>(16);
        sim.submit(|cg| {
            let w = cg.access::<u32, ReadWrite>(&a, 4..8);
            cg.parallel_for(4, move |it| {
                let i = it.global_linear_id();
                w.set(it, i, w.get(it, i) * 100);
            });
        })
        .unwrap();
        sim.submit(|cg| cg.fill_range(&a, 10..12, 7)).unwrap();
        cpu.submit(|cg| {
            let r = cg.access::<u32, Read>(&a, ..);
            let o = cg.access::<u32, Write>(&out, ..);
            cg.parallel_for(16, move |it| {
                let i = it.global_linear_id();
                o.set(it, i, r.get(it, i) + 1);
            });
        })
        .unwrap();
        let mut expect: Vec<u32> = (0..16).collect();
        for x in &mut expect[4..8] {
            *x *= 100;
        }
        expect[10..12].fill(7);
        assert_eq!(a.to_vec().unwrap(), expect, "{name}");
        let plus1: Vec<u32> = expect.iter().map(|x| x + 1).collect();
        assert_eq!(out.to_vec().unwrap(), plus1, "{name}");
    }
}

/// A fill on the simulated device followed by a host task (which runs on the host,
/// even when submitted to the device's queue) reading the filled range and writing
/// the rest of the buffer.
#[test]
fn sim_fill_then_host_task() {
    for (name, rt) in runtimes() {
        for in_order in [false, true] {
            let sim = rt.queue_with(QueueOptions { device: 1, in_order }).unwrap();
            let b = rt.buffer(&[1u32; 12]);
            let seen = Arc::new(Mutex::new(Vec::new()));
            sim.submit(|cg| cg.fill_range(&b, 2..6, 9)).unwrap();
            let s = seen.clone();
            sim.submit(|cg| {
                let r = cg.host_access::<u32, Read>(&b, 0..6);
                let mut w = cg.host_access::<u32, Write>(&b, 6..12);
                cg.host_task(move |ctx| {
                    let r = r.as_slice(ctx);
                    *s.lock().unwrap() = r.to_vec();
                    for (k, x) in w.as_mut_slice(ctx).iter_mut().enumerate() {
                        *x = r[k] + 10;
                    }
                });
            })
            .unwrap();
            sim.wait().unwrap();
            assert_eq!(*seen.lock().unwrap(), [1, 1, 9, 9, 9, 9], "{name} in_order={in_order}");
            assert_eq!(b.to_vec().unwrap(), [1, 1, 9, 9, 9, 9, 11, 11, 19, 19, 19, 19], "{name}");
        }
    }
}

/// Disjoint writes to one buffer on both devices, neither depending on the other:
/// the final contents merge both, whichever copy each write went to.
#[test]
fn disjoint_writes_on_both_devices_merge() {
    for (name, rt) in runtimes() {
        let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
        let cpu = rt.queue();
        let b = rt.buffer(&[0u32; 8]);
        for round in 0..4u32 {
            sim.submit(|cg| cg.fill_range(&b, 0..4, round * 10 + 1)).unwrap();
            cpu.submit(|cg| cg.fill_range(&b, 4..8, round * 10 + 2)).unwrap();
        }
        assert_eq!(b.to_vec().unwrap(), [31, 31, 31, 31, 32, 32, 32, 32], "{name}");
    }
}

/// A device copy reads what a host `write()` guard wrote, and a readback taken on the
/// device after a partial `copy_from_host` sees both.
#[test]
fn host_guard_then_device_copy_and_readback() {
    for (name, rt) in runtimes() {
        let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
        let a = rt.buffer(&[0u32; 6]);
        let b = rt.buffer(&[5u32; 6]);
        sim.submit(|cg| cg.fill(&a, 3)).unwrap();
        a.write().unwrap()[1] = 42;
        sim.submit(|cg| cg.copy_range(&a, 0, &b, 2, 3)).unwrap();
        sim.submit(|cg| cg.copy_from_host(&[8u32, 9], &b, 0)).unwrap();
        let rb = gantry::Readback::new();
        sim.submit(|cg| cg.copy_to_host(&b, .., &rb)).unwrap().wait().unwrap();
        assert_eq!(rb.take().unwrap(), [8, 9, 3, 42, 3, 5], "{name}");
    }
}

// ---------------------------------------------------------------------------------
// Programs (checked against the model in every configuration)
// ---------------------------------------------------------------------------------

/// The two hand-written cases above as programs, plus partial `Write` accessors
/// (which keep the elements they skip) on the device.
#[test]
fn sim_subranges_as_programs() {
    check_everywhere(
        "Program {
          buffers: b0[16] (seed 0x1); b1[16] (seed 0x2);
          queues: q0 out-of-order;
          #0 q0@sim kernel salt=0x1 reads [] writes [b0[4..8] rw]
          #1 q0@sim fill b0[10..12] = 0x7
          #2 q0@sim kernel salt=0x2 reads [b0[0..3]] writes [b0[12..16] w]
          #3 q0@cpu kernel salt=0x3 reads [b0[0..16]] writes [b1[0..16] discard]
          #4 q0@sim fill b1[0..4] = 0x9
          #5 q0@cpu host_task salt=0x4 reads [b1[0..8]] writes [b0[0..2] rw]
        }",
    );
}

/// In-order queue mixing device commands and host tasks submitted to the device's
/// queue, with explicit dependencies across queues and a whole-buffer discard-write
/// on the device followed by a partial CPU read.
#[test]
fn in_order_sim_queue_with_host_tasks() {
    check_everywhere(
        "Program {
          buffers: b0[9] (seed 0x10); b1[5] (seed 0x11);
          queues: q0 in-order; q1 out-of-order;
          #0 q0@sim kernel(nd local 4) salt=0x5 reads [b1[0..5]] writes [b0[0..9] discard]
          #1 q0@sim host_task salt=0x6 reads [b0[2..5]] writes [b1[0..5] rw]
          #2 q1@cpu copy b1[1..4] -> b0[5..8] after [#0]
          #3 q0@sim fill b0[0..2] = 0xabc
          #4 q1@cpu copy_to_host b0[0..9]
          #5 q1@sim copy_from_host salt=0x7 -> b1[3..5] after [#1]
          #6 q1.wait()
          #7 b0.to_vec()
        }",
    );
}

/// A hang found by `model::threaded8_sim` (the lost wakeup below): replayed here, it
/// passes almost always, since the race is rare.
#[test]
fn found_by_threaded8_sim() {
    check_everywhere(
        "Program {
          buffers: b0[23] (seed 0x1622a7bb); b1[34] (seed 0x6a0a8117);
          queues: q0 out-of-order; q1 in-order; q2 out-of-order;
          #0   q2@sim host_task salt=0x76217fd reads [] writes [b1[16..29] w, b0[5..18] rw]
          #1   b0.to_vec()
          #2   q0@sim copy_from_host salt=0xd0096cd2 -> b1[29..30] after [#0]
          #3   q1@sim copy_from_host salt=0xdb12e638 -> b0[7..14] after [#0]
          #4   q2@cpu copy b0[2..19] -> b1[9..26] after [#0]
          #5   q1@cpu host_task salt=0xf65f81e reads [b0[0..23]] writes [b1[12..26] rw]
          #6   q2@cpu fill b0[0..23] = 0x2bf43ac6 after [#4]
          #7   q0@cpu copy b0[18..22] -> b1[2..6] after [#5]
          #8   q0@cpu fill b0[0..23] = 0xf9bbcae8 after [#5]
          #9   q0@sim kernel(nd local 1) salt=0x5bbccb61 reads [] writes [b1[12..32] rw, b0[18..22] w] after [#0]
          #10  q1@cpu kernel(nd local 1) salt=0x9161591a reads [] writes [b1[18..34] discard, b0[18..19] rw] after [#3, #8]
          #11  b1.write() salt=0x102c9cb
          #12  q0@sim fill b1[0..34] = 0x5c73cfda after [#0, #5]
          #13  q0@sim kernel salt=0x77725d9a reads [] writes [b1[32..33] w, b0[3..17] discard] after [#12]
          #14  q1.wait()
          #15  q2@sim fill b0[7..14] = 0x6f3e47da
          #16  q2@sim copy b1[16..19] -> b0[12..15]
        }",
    );
}

/// `run_gantry` returns the final buffers, equal to the model's.
#[test]
fn run_gantry_returns_final_buffers() {
    let p = Program::parse(
        "Program { buffers: b0[4] (seed 0x0); queues: q0 out-of-order;
           #0 q0@sim kernel salt=0x1 reads [] writes [b0[0..4] rw] }",
    )
    .unwrap();
    assert_eq!(run_gantry(&p, Config::threaded(2, true)), run_model(&p).buffers);
}

// ---------------------------------------------------------------------------------
// Known bugs
// ---------------------------------------------------------------------------------

fn spin_until(c: &AtomicUsize, v: usize) {
    let mut n = 0u32;
    while c.load(SeqCst) < v {
        n += 1;
        if n.is_multiple_of(64) {
            std::thread::yield_now()
        } else {
            std::hint::spin_loop()
        }
    }
}

/// **Gantry bug: lost wakeup in `EventShared::block_until` / `set_status`**
/// (`components/src/event.rs`), which `Event::wait`, `Queue::wait` and host accesses
/// (`Buffer::to_vec`, `read`, `write`) use in threaded mode.
///
/// `set_status` stores the status (`Release`) and then loads `waiters` (`Acquire`)
/// to decide whether to notify; `block_until` increments `waiters` and then loads the
/// status under the lock. That is a store-then-load handshake on two locations on
/// each side, which acquire/release does not order (x86 reorders a store with a later
/// load): the finisher can read `waiters == 0` while the waiter reads the old status,
/// so nobody notifies and the waiter sleeps forever on a complete event. The model
/// properties hit it as hangs in threaded mode (CPU-only and with the simulated
/// device) with nothing left in the scheduler (`live_commands: 0, in_driver: 0`),
/// once per few thousand programs.
///
/// Here one thread waits and another finishes fresh events, released together each
/// round. A round fails if its event is `Complete` but the waiter has not returned
/// 500 ms later. It typically fails within a few seconds; it stops and passes after
/// 8 s without a failure. (The same harness run on a copy of the two functions with
/// `SeqCst` on the four accesses passed 300,000 rounds, twice; the copy with the
/// original orderings hung within 60,000 and 200,000 rounds.) A fix: `SeqCst` on
/// the status store and `waiters` load in `set_status` and on the `waiters`
/// increment and status load in `block_until` (or notify under the lock always).
#[test]
fn event_wait_never_misses_completion() {
    const BUDGET: Duration = Duration::from_secs(8);
    let slots: Arc<[Mutex<Arc<EventShared>>; 2]> =
        Arc::new([(); 2].map(|_| Mutex::new(Arc::new(EventShared::new("e".into(), 1, 0)))));
    // Per round: two arrivals, then one release by this thread.
    let go = Arc::new(AtomicUsize::new(0));
    let woke = Arc::new(AtomicUsize::new(0));
    let stop = usize::MAX / 4;
    let (g, w, s) = (go.clone(), woke.clone(), slots.clone());
    let waiter = std::thread::spawn(move || {
        for i in 0.. {
            g.fetch_add(1, SeqCst);
            spin_until(&g, 3 * i + 3);
            let ev = s[i % 2].lock().unwrap().clone();
            if ev.name.as_ref() == "stop" {
                return;
            }
            ev.block_until(EventStatus::Complete, std::time::Duration::ZERO);
            w.fetch_add(1, SeqCst);
        }
    });
    let (g, s) = (go.clone(), slots.clone());
    let finisher = std::thread::spawn(move || {
        for i in 0.. {
            g.fetch_add(1, SeqCst);
            spin_until(&g, 3 * i + 3);
            let ev = s[i % 2].lock().unwrap().clone();
            if ev.name.as_ref() == "stop" {
                return;
            }
            ev.finish(Ok(()), 0, 0);
        }
    });
    let t0 = Instant::now();
    for i in 0..stop {
        let name = if t0.elapsed() > BUDGET { "stop" } else { "e" };
        *slots[i % 2].lock().unwrap() = Arc::new(EventShared::new(name.into(), 1, 0));
        spin_until(&go, 3 * i + 2);
        go.fetch_add(1, SeqCst);
        if name == "stop" {
            waiter.join().unwrap();
            finisher.join().unwrap();
            return;
        }
        let mut since = Instant::now();
        while woke.load(SeqCst) <= i {
            if slots[i % 2].lock().unwrap().status() != EventStatus::Complete {
                since = Instant::now();
            } else if since.elapsed() > Duration::from_millis(500) {
                // The waiter thread stays blocked forever; it is leaked.
                panic!(
                    "lost wakeup: round {i}: the event is Complete but block_until(Complete) has not returned \
                     after 500 ms"
                );
            }
            std::thread::yield_now();
        }
    }
}

/// **Gantry bug: dropping a buffer's last handle can lose its device contents.**
///
/// `BufferHandle::drop` (`engine/src/buffer.rs`) sets `BufferCore::dropped` at once,
/// on the user's thread, before the scheduler has ingested the submissions sent
/// before the drop. Retirement (`systems/src/retire.rs`: `retire_entity` queues a
/// dropped buffer's record as maybe idle, `release_idle_records` despawns an idle
/// one, frees its device allocations and clears `buffer.record`) can therefore run
/// between the drop and the ingestion of a command that still uses the buffer. The
/// record goes although that command needs it; when the command is resolved, a fresh
/// record assumes the host copy is valid, no device-to-host move is made, and the
/// command reads stale contents: what the device wrote is lost, silently.
///
/// Here a simulated-device kernel writes `b[4..8]` and, while it runs (inside the
/// scheduler's flush), a host task reading `b` (and depending on the kernel) is
/// submitted and the last handle of `b` is dropped. The host task must see the
/// kernel's result; it sees the initial contents. (With a clone of `b` kept alive
/// until the end, it passes.) The model properties find it as mismatches in threaded
/// mode with the simulated device after a `drop bN` op.
#[test]
fn dropping_a_buffer_keeps_its_device_contents_for_earlier_submissions() {
    let rt = Runtime::builder().mode(Mode::Threaded).worker_threads(1).sim(SimConfig::default()).build();
    let sim = rt.queue_with(QueueOptions { device: 1, in_order: false }).unwrap();
    let cpu = rt.queue();
    let b = rt.buffer(&[1u32; 8]);
    let started = Arc::new(AtomicBool::new(false));
    let go = Arc::new(AtomicBool::new(false));
    let (s, g) = (started.clone(), go.clone());
    let kernel = sim
        .submit(|cg| {
            let w = cg.access::<u32, ReadWrite>(&b, 4..8);
            cg.parallel_for(4, move |it| {
                let i = it.global_linear_id();
                if i == 0 {
                    // Hold the scheduler's flush until the host task is submitted and
                    // the handle dropped (at most 2 s).
                    s.store(true, SeqCst);
                    let t = Instant::now();
                    while !g.load(SeqCst) && t.elapsed() < Duration::from_secs(2) {
                        std::hint::spin_loop();
                    }
                }
                w.set(it, i, w.get(it, i) + 100);
            });
        })
        .unwrap();
    while !started.load(SeqCst) {
        std::thread::yield_now();
    }
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = seen.clone();
    let task = cpu
        .submit(|cg| {
            cg.depends_on(&kernel);
            let r = cg.host_access::<u32, Read>(&b, ..);
            cg.host_task(move |ctx| *out.lock().unwrap() = r.as_slice(ctx).to_vec());
        })
        .unwrap();
    drop(b);
    go.store(true, SeqCst);
    task.wait().unwrap();
    assert_eq!(*seen.lock().unwrap(), [1, 1, 1, 1, 101, 101, 101, 101], "the kernel's writes were lost");
}
