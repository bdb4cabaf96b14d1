//! Failures: panics become errors on the failed command and its dependents only;
//! buffers keep their last valid contents; the runtime keeps running.

mod common;

use gantry::{Error, EventStatus, ExecError, Mode, Runtime};

fn quiet_panics() {
    common::quiet_panics(|msg| {
        ["kernel exploded", "host task failed", "no", "x"].iter().any(|m| msg.starts_with(m))
            || msg.contains("out of bounds")
    });
}

#[test]
fn kernel_panic_fails_only_dependents() {
    quiet_panics();
    for mode in [Mode::Threaded, Mode::Manual] {
        let rt = Runtime::builder().mode(mode).worker_threads(2).build();
        let q = rt.queue();
        let n = 5000;
        let a = rt.buffer(&vec![7u32; n]);
        let b = rt.buffer(&vec![1u32; n]);
        let bad = q
            .submit(|cg| {
                cg.name("bad kernel");
                let a = cg.read_write(&a);
                cg.parallel_for(n, move |it| {
                    let i = it.global_linear_id();
                    a.set(it, i, 0);
                    if i == n / 2 {
                        panic!("kernel exploded");
                    }
                });
            })
            .unwrap();
        let dependent = q
            .submit(|cg| {
                cg.name("dependent");
                let a = cg.read(&a);
                let b2 = cg.write(&b);
                cg.parallel_for(n, move |it| b2.set(it, it.global_linear_id(), a.get(it, 0)));
            })
            .unwrap();
        let transitive = q.submit(|cg| cg.fill(&b, 5)).unwrap();
        let other = rt.buffer(&[1u32; 4]);
        let independent = q.submit(|cg| cg.fill(&other, 9)).unwrap();

        match bad.wait() {
            Err(Error::Exec(ExecError::KernelPanicked { kernel, message })) => {
                assert_eq!(&*kernel, "bad kernel");
                assert_eq!(message, "kernel exploded");
            }
            r => panic!("unexpected {r:?}"),
        }
        let err = dependent.wait().unwrap_err();
        match &err {
            Error::Exec(e @ ExecError::DependencyFailed { dependency, .. }) => {
                assert_eq!(&**dependency, "bad kernel");
                assert!(matches!(e.root_cause(), ExecError::KernelPanicked { .. }));
            }
            e => panic!("unexpected {e:?}"),
        }
        assert!(transitive.wait().is_err(), "fill depends on the dependent through b");
        assert_eq!(transitive.status(), EventStatus::Failed);
        assert!(matches!(transitive.error().unwrap().root_cause(), ExecError::KernelPanicked { .. }));
        independent.wait().unwrap();
        assert_eq!(other.to_vec().unwrap(), vec![9; 4]);
        // Last valid contents: the panicking kernel's partial writes were undone.
        assert_eq!(a.to_vec().unwrap(), vec![7; n]);
        assert_eq!(b.to_vec().unwrap(), vec![1; n]);
        // The runtime keeps running.
        q.submit(|cg| cg.fill(&a, 3)).unwrap().wait().unwrap();
        assert_eq!(a.to_vec().unwrap(), vec![3; n]);
        assert_eq!(rt.stats().failed, 3);
    }
}

#[test]
fn host_task_panic_is_an_error_and_restores() {
    quiet_panics();
    let rt = Runtime::new();
    let q = rt.queue();
    let buf = rt.buffer(&[1u8, 2, 3]);
    let ev = q
        .submit(|cg| {
            let mut b = cg.host_read_write(&buf);
            cg.host_task(move |ctx| {
                b.as_mut_slice(ctx).fill(0);
                panic!("host task failed: {}", 42);
            });
        })
        .unwrap();
    assert!(matches!(
        ev.wait(),
        Err(Error::Exec(ExecError::HostTaskPanicked { message, .. })) if message == "host task failed: 42"
    ));
    assert_eq!(buf.to_vec().unwrap(), vec![1, 2, 3]);
}

/// A command depending on an already-failed event fails without running.
#[test]
fn depending_on_a_failed_event_fails() {
    quiet_panics();
    let rt = Runtime::new();
    let q = rt.queue();
    let bad = q.submit(|cg| cg.single_task(|_| panic!("no"))).unwrap();
    assert!(bad.wait().is_err());
    let buf = rt.buffer(&[0u32]);
    let later = q
        .submit(|cg| {
            cg.depends_on(&bad);
            cg.fill(&buf, 1);
        })
        .unwrap();
    assert!(matches!(later.wait(), Err(Error::Exec(ExecError::DependencyFailed { .. }))));
    assert_eq!(buf.to_vec().unwrap(), vec![0]);
}

/// Queue::wait reports failures among the queue's earlier commands.
#[test]
fn queue_wait_reports_failures() {
    quiet_panics();
    let rt = Runtime::new();
    let q = rt.queue();
    q.submit(|cg| cg.single_task(|_| panic!("x"))).unwrap();
    assert!(q.wait().is_err());
    // Later waits are clean once the failure has been reported.
    q.submit(|cg| cg.single_task(|_| {})).unwrap();
    q.wait().unwrap();
}

/// An out-of-bounds index inside a kernel is a panic, so an error, not UB.
#[test]
fn out_of_bounds_index_in_kernel_fails_the_command() {
    quiet_panics();
    let rt = Runtime::new();
    let buf = rt.buffer_zeroed::<u32>(4);
    let ev = rt
        .queue()
        .submit(|cg| {
            let b = cg.write(&buf);
            cg.parallel_for(8, move |it| b.set(it, it.global_linear_id(), 1));
        })
        .unwrap();
    match ev.wait() {
        Err(Error::Exec(ExecError::KernelPanicked { message, .. })) => {
            assert!(message.contains("out of bounds"))
        }
        r => panic!("unexpected {r:?}"),
    }
    assert_eq!(buf.to_vec().unwrap(), vec![0; 4]);
}

/// Submits a one-work-item kernel that writes `buf[0] = 50` and then panics: its
/// write is undone and its event fails.
fn write_then_panic(q: &gantry::Queue, buf: &gantry::Buffer<u32>) -> gantry::Event {
    q.submit(|cg| {
        let b = cg.read_write(buf);
        cg.single_task(move |it| {
            b.set(it, 0, 50);
            panic!("x")
        });
    })
    .unwrap()
}

/// A command that fails while running inline (small work on the submitting thread)
/// must not let its dependents run: they fail with the dependency's error instead.
#[test]
fn inline_failure_does_not_release_dependents() {
    quiet_panics();
    for mode in [Mode::Manual, Mode::Threaded] {
        let rt = Runtime::builder().mode(mode).worker_threads(0).build();
        let q = rt.queue();
        let buf = rt.buffer(&[1u32; 4]);
        let bad = write_then_panic(&q, &buf);
        let dependent = q
            .submit(|cg| {
                let b = cg.read_write(&buf);
                cg.single_task(move |it| b.set(it, 1, b.get(it, 0) + 1));
            })
            .unwrap();
        assert!(bad.wait().is_err());
        let err = dependent.wait().unwrap_err();
        assert!(matches!(err, Error::Exec(ExecError::DependencyFailed { .. })), "{mode:?}: {err:?}");
        assert_eq!(buf.to_vec().unwrap(), vec![1; 4], "{mode:?}: the dependent did not run");
    }
}

/// A failure the scheduler retired before a later command of the same buffer was
/// resolved still reaches that command, until the user synchronizes: which commands
/// depend on a failure follows the user's waits, not when the scheduler ran.
#[test]
fn a_retired_failure_reaches_later_users_of_its_buffer_until_a_wait() {
    quiet_panics();
    let rt = Runtime::builder().mode(Mode::Threaded).worker_threads(0).build();
    let q = rt.queue();
    let (buf, other, apart) = (rt.buffer(&[1u32; 4]), rt.buffer(&[0u32; 4]), rt.buffer(&[0u32; 4]));
    let bad = write_then_panic(&q, &buf);
    // Retired without a wait of the user's (polling the status is none).
    while !bad.status().is_final() {
        std::thread::yield_now();
    }
    let reader = q
        .submit(|cg| {
            let (b, o) = (cg.read(&buf), cg.read_write(&other));
            cg.single_task(move |it| o.set(it, 0, b.get(it, 0)));
        })
        .unwrap();
    let unrelated = q.submit(|cg| cg.fill(&apart, 7)).unwrap();
    let err = reader.wait().unwrap_err();
    assert!(matches!(&err, Error::Exec(ExecError::DependencyFailed { .. })), "{err:?}");
    unrelated.wait().unwrap();
    // The wait synchronized: the failures no longer reach new commands.
    let after = q
        .submit(|cg| {
            let b = cg.read_write(&buf);
            cg.single_task(move |it| b.set(it, 1, b.get(it, 0) + 1));
        })
        .unwrap();
    after.wait().unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![1, 2, 1, 1], "the failed write was undone");
    assert_eq!(other.to_vec().unwrap(), vec![0; 4], "the reader did not run");
    assert_eq!(apart.to_vec().unwrap(), vec![7; 4]);
}
