//! Randomized schedules of the real runtime under [shuttle]: the scheduler thread,
//! the submission and completion channels, event waits, idle waits, host access
//! guards and runtime shutdown, each raced against user threads.
//!
//! Built only with `RUSTFLAGS="--cfg shuttle"`, which swaps `gantry_driver::sync`
//! (every lock, condition variable, channel and waited-on atomic of the runtime, and
//! the scheduler thread) for shuttle's primitives; otherwise this file is empty.
//! Shuttle runs all threads on one OS thread and picks which one runs at every
//! synchronization point: a missed wakeup shows up as a deadlock ("every thread is
//! blocked"), with the failing schedule printed for `shuttle::replay`. The CPU driver
//! runs inline under shuttle, so the threads are the test's own and the scheduler's.
//!
//! ```text
//! RUSTFLAGS="--cfg shuttle" CARGO_TARGET_DIR=target/shuttle \
//!     cargo test --release -p gantry --test shuttle
//! ```
//!
//! Each test runs [`DEFAULT_ITERATIONS`] schedules with a random scheduler and as many
//! with a PCT scheduler; `GANTRY_SHUTTLE_ITERATIONS=N` runs N of each instead. A
//! failure prints its schedule; `shuttle::replay(test_body, "<schedule>")` in place of
//! `check` replays it (`SHUTTLE_CAPTURE_BACKTRACE=1` adds every blocked thread's
//! backtrace to a deadlock report).
//!
//! [shuttle]: https://docs.rs/shuttle

#![cfg(shuttle)]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use gantry::{Buffer, Error, Event, EventStatus, ExecError, Mode, Queue, Runtime, WindowThresholds};
use shuttle::scheduler::{PctScheduler, RandomScheduler};
use shuttle::sync::mpsc;
use shuttle::{thread, Config, Runner};

/// Schedules per scheduler and test when `GANTRY_SHUTTLE_ITERATIONS` is unset: 8
/// tests times two schedulers times 500 is 8,000 schedules (a few seconds).
const DEFAULT_ITERATIONS: usize = 500;

fn iterations() -> usize {
    match std::env::var("GANTRY_SHUTTLE_ITERATIONS") {
        Ok(v) => v.parse().expect("GANTRY_SHUTTLE_ITERATIONS is a number of schedules"),
        Err(_) => DEFAULT_ITERATIONS,
    }
}

/// Runs `f` under a random and a PCT scheduler (PCT favours schedules where a few
/// threads are preempted at chosen points, which random schedules rarely hit).
fn check(f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let n = iterations();
    let config = || {
        let mut config = Config::new();
        // The scheduler thread runs bevy's schedule; shuttle's default 60 KiB stacks
        // are too small for it.
        config.stack_size = 1 << 20;
        // Shuttle treats every atomic ordering as SeqCst and says so once per run; the
        // event waits' ordering argument is in `EventShared`'s comments.
        config.silence_warnings = true;
        config
    };
    let g = f.clone();
    Runner::new(RandomScheduler::new(n), config()).run(move || g());
    Runner::new(PctScheduler::new(3, n), config()).run(move || f());
}

/// A threaded runtime whose only internal thread is the scheduler's.
fn runtime() -> Runtime {
    Runtime::builder().worker_threads(0).host_threads(0).build()
}

/// Submits `buf[i] += add` for every element, marking `ran` when the kernel runs.
fn add(q: &Queue, buf: &Buffer<u32>, add: u32, ran: &Arc<AtomicBool>) -> Event {
    let ran = ran.clone();
    q.submit(|cg| {
        let b = cg.read_write(buf);
        let n = b.len();
        cg.parallel_for(n, move |it| {
            let i = it.global_linear_id();
            b.set(it, i, b.get(it, i) + add);
            ran.store(true, Ordering::Relaxed);
        });
    })
    .unwrap()
}

/// Whether `e` says the runtime was dropped: a refused submission, or a command the
/// drop failed (a host access, for example, can be either).
fn dropped(e: &Error) -> bool {
    matches!(e, Error::RuntimeDropped | Error::Exec(ExecError::RuntimeDropped))
}

/// Waits on `ev` and checks that it only returned once the kernel had run.
fn wait_ran(ev: &Event, ran: &AtomicBool) {
    ev.wait().unwrap();
    assert_eq!(ev.status(), EventStatus::Complete);
    assert!(ran.load(Ordering::Relaxed), "{} returned before its kernel ran", ev.name());
}

/// Two threads each submit a chain of kernels over a shared buffer and one of their
/// own, waiting on each event, while the scheduler thread runs them.
#[test]
fn two_threads_submit_and_wait_on_shared_buffers() {
    check(|| {
        let rt = runtime();
        let shared = rt.buffer(&[0u32; 4]);
        let threads: Vec<_> = (0..2u32)
            .map(|t| {
                let q = rt.queue();
                let shared = shared.clone();
                let own = rt.buffer(&[t; 2]);
                thread::spawn(move || {
                    for step in 1..=2 {
                        let ran = [Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false))];
                        let a = add(&q, &shared, 1 << (8 * t), &ran[0]);
                        let b = add(&q, &own, step, &ran[1]);
                        wait_ran(&b, &ran[1]);
                        wait_ran(&a, &ran[0]);
                    }
                    own.to_vec().unwrap()
                })
            })
            .collect();
        for (t, h) in threads.into_iter().enumerate() {
            assert_eq!(h.join().unwrap(), vec![t as u32 + 3; 2]);
        }
        assert_eq!(shared.to_vec().unwrap(), vec![0x202; 4]);
    });
}

/// Several threads wait on the same events while the scheduler completes them: each
/// waiter registers (the waiter count) while `EventShared::set_status` may be
/// storing the status, the race the Dekker pattern there must win.
#[test]
fn waiters_race_completion_of_the_event() {
    check(|| {
        let rt = runtime();
        let q = rt.queue();
        let buf = rt.buffer(&[1u32; 2]);
        let ran = [Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false))];
        let first = add(&q, &buf, 1, &ran[0]);
        // Depends on `first` through the buffer.
        let second = add(&q, &buf, 10, &ran[1]);
        let waiters: Vec<_> = [(first.clone(), ran[0].clone()), (second.clone(), ran[1].clone())]
            .into_iter()
            .map(|(ev, ran)| thread::spawn(move || wait_ran(&ev, &ran)))
            .collect();
        wait_ran(&second, &ran[1]);
        assert!(first.is_complete(), "a dependent finished before its dependency");
        for w in waiters {
            w.join().unwrap();
        }
        assert_eq!(buf.to_vec().unwrap(), vec![12; 2]);
    });
}

/// A thread waits on an event it receives from a thread that is still submitting
/// the command it depends on and more work behind it.
#[test]
fn wait_races_submission_of_its_dependency() {
    check(|| {
        let rt = runtime();
        let q = rt.queue();
        let buf = rt.buffer(&[0u32; 2]);
        let (tx, rx) = mpsc::channel::<(Event, Arc<AtomicBool>)>();
        let submitter = {
            let (q, buf) = (q.clone(), buf.clone());
            thread::spawn(move || {
                let ran = Arc::new(AtomicBool::new(false));
                let dep = add(&q, &buf, 1, &Arc::new(AtomicBool::new(false)));
                let ev = add(&q, &buf, 2, &ran);
                tx.send((ev, ran)).unwrap();
                let more = add(&q, &buf, 4, &Arc::new(AtomicBool::new(false)));
                dep.wait().unwrap();
                more
            })
        };
        let (ev, ran) = rx.recv().unwrap();
        wait_ran(&ev, &ran);
        let after = buf.to_vec().unwrap()[0];
        // The host read orders after `ev`; the third kernel may or may not be in.
        assert!(after == 3 || after == 7, "read {after}");
        submitter.join().unwrap().wait().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![7; 2]);
    });
}

/// `wait_idle` on one thread while another submits: it returns, and once the
/// submitter is done, a `wait_idle` sees every command finished without waiting on
/// any of them.
#[test]
fn wait_idle_races_submissions() {
    check(|| {
        let rt = Arc::new(runtime());
        let buf = rt.buffer(&[0u32; 2]);
        let submitter = {
            let (q, buf) = (rt.queue(), buf.clone());
            thread::spawn(move || {
                (0..3).map(|_| add(&q, &buf, 1, &Arc::new(AtomicBool::new(false)))).collect::<Vec<_>>()
            })
        };
        let idler = {
            let rt = rt.clone();
            thread::spawn(move || rt.wait_idle().unwrap())
        };
        rt.wait_idle().unwrap();
        let events = submitter.join().unwrap();
        idler.join().unwrap();
        rt.wait_idle().unwrap();
        for ev in &events {
            assert_eq!(ev.try_result(), Some(Ok(())), "{} unfinished after wait_idle", ev.name());
        }
        assert_eq!(buf.to_vec().unwrap(), vec![3; 2]);
    });
}

/// A host write guard held by one thread while another thread's kernel on the same
/// buffer waits for it: the kernel runs only after the guard drops, and sees its
/// writes.
#[test]
fn host_write_guard_holds_off_another_threads_kernel() {
    check(|| {
        let rt = runtime();
        let buf = rt.buffer(&[1u32; 2]);
        let released = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<()>();
        let holder = {
            let (buf, released) = (buf.clone(), released.clone());
            thread::spawn(move || {
                let mut guard = buf.write().unwrap();
                tx.send(()).unwrap();
                thread::yield_now();
                guard[0] += 5;
                guard[1] += 5;
                released.store(true, Ordering::Relaxed);
                drop(guard);
            })
        };
        rx.recv().unwrap();
        let q = rt.queue();
        let ev = {
            let released = released.clone();
            q.submit(|cg| {
                let b = cg.read_write(&buf);
                cg.parallel_for(2, move |it| {
                    assert!(released.load(Ordering::Relaxed), "kernel ran while the guard was held");
                    let i = it.global_linear_id();
                    b.set(it, i, b.get(it, i) * 2);
                });
            })
            .unwrap()
        };
        ev.wait().unwrap();
        holder.join().unwrap();
        assert_eq!(buf.to_vec().unwrap(), vec![12; 2]);
    });
}

/// Dropping the runtime while another thread submits and waits: every wait returns
/// (completed, or `RuntimeDropped`), every submission either is accepted or fails
/// with `RuntimeDropped`, and nothing hangs.
#[test]
fn dropping_the_runtime_while_a_thread_waits() {
    check(|| {
        let rt = runtime();
        let q = rt.queue();
        let buf = rt.buffer(&[0u32; 2]);
        let finished = Arc::new(AtomicU32::new(0));
        let user = {
            let finished = finished.clone();
            thread::spawn(move || {
                for _ in 0..3 {
                    let ran = Arc::new(AtomicBool::new(false));
                    let ev = match q.submit(|cg| {
                        let b = cg.read_write(&buf);
                        let ran = ran.clone();
                        cg.parallel_for(2, move |it| {
                            let i = it.global_linear_id();
                            b.set(it, i, b.get(it, i) + 1);
                            ran.store(true, Ordering::Relaxed);
                        });
                    }) {
                        Ok(ev) => ev,
                        Err(e) => {
                            assert!(dropped(&e), "{e}");
                            break;
                        }
                    };
                    match ev.wait() {
                        Ok(()) => {
                            assert!(ran.load(Ordering::Relaxed));
                            finished.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => assert!(dropped(&e), "{e}"),
                    }
                }
                // Whatever ran is in the buffer (or the runtime is gone).
                match buf.to_vec() {
                    Ok(v) => assert_eq!(v[0], finished.load(Ordering::Relaxed)),
                    Err(e) => assert!(dropped(&e), "{e}"),
                }
            })
        };
        thread::yield_now();
        drop(rt);
        user.join().unwrap();
    });
}

/// Dropping the runtime while another thread holds a host write guard and a third
/// waits on a kernel blocked behind it: the blocked kernel fails with
/// `RuntimeDropped`, or completes if the guard dropped first.
#[test]
fn dropping_the_runtime_under_a_held_guard() {
    check(|| {
        let rt = runtime();
        let buf = rt.buffer(&[1u32; 2]);
        let guard = buf.write().unwrap();
        let q = rt.queue();
        let blocked = add(&q, &buf, 1, &Arc::new(AtomicBool::new(false)));
        let waiter = thread::spawn(move || blocked.wait());
        let holder = thread::spawn(move || {
            thread::yield_now();
            drop(guard);
        });
        drop(rt);
        if let Err(e) = waiter.join().unwrap() {
            assert!(dropped(&e), "{e}");
        }
        holder.join().unwrap();
    });
}

/// Manual mode: two threads each drive the scheduler from their own waits. A wait
/// may find its event finished by the other thread's flush (the timed wait in
/// `Shared::wait_for` covers that).
#[test]
fn manual_mode_waits_on_two_threads() {
    check(|| {
        let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).host_threads(0).build();
        let threads: Vec<_> = (0..2u32)
            .map(|t| {
                let q = rt.queue();
                let buf = rt.buffer(&[t; 2]);
                thread::spawn(move || {
                    let ran = Arc::new(AtomicBool::new(false));
                    let ev = add(&q, &buf, 1, &ran);
                    wait_ran(&ev, &ran);
                    buf.to_vec().unwrap()
                })
            })
            .collect();
        for (t, h) in threads.into_iter().enumerate() {
            assert_eq!(h.join().unwrap(), vec![t as u32 + 1; 2]);
        }
    });
}

/// One thread fills a fusion with three kernels and completes it while another reads
/// the buffer they update, which cancels the fusion if it arrives while a kernel is
/// listed. Kernels sent to the fusion before the user side saw the cancellation but
/// taken by the scheduler after it run unfused on events of their own; those sent
/// after it are ordinary kernels. The fusion's event completes only after every
/// kernel sent to the fusion (those whose `submit` returned it), and the read sees
/// the buffer between two kernels.
#[test]
fn a_fusion_cancelled_while_its_kernels_arrive() {
    check(|| {
        // Fusing whatever its size: the CPU driver would run these kernels unfused.
        let rt = Runtime::builder()
            .worker_threads(0)
            .host_threads(0)
            .fusion_window(WindowThresholds::ALWAYS)
            .build();
        let q = rt.queue();
        let buf = rt.buffer(&[0u32; 4]);
        q.start_fusion().unwrap();
        let reader = {
            let buf = buf.clone();
            thread::spawn(move || buf.to_vec().unwrap())
        };
        let ran: Vec<_> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
        // (Every fusion's event is named "fusion"; a kernel's is named after it.)
        let listed: Vec<bool> =
            (1..=3).zip(&ran).map(|(k, ran)| add(&q, &buf, k, ran).name() == "fusion").collect();
        assert!(listed[0], "the first kernel joins the fusion");
        q.complete_fusion(gantry::FusionProps::default()).unwrap().wait().unwrap();
        for (k, ran) in ran.iter().enumerate().filter(|&(k, _)| listed[k]) {
            assert!(ran.load(Ordering::Relaxed), "the fusion's event completed before its kernel {k} ran");
        }
        let seen = reader.join().unwrap();
        assert!([0, 1, 3, 6].contains(&seen[0]), "the read saw {seen:?}");
        assert_eq!(buf.to_vec().unwrap(), vec![6; 4]);
    });
}
