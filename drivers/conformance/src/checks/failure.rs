//! Failures: a panicking kernel fails its operation with a typed error naming it,
//! the operations waiting on it fail without running, and `preserve_on_failure`
//! puts back what a failed operation wrote.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry_driver::AccessMode::{ReadWrite, Write};
use gantry_driver::{DeviceOp, ExecError, HostStorage, MemArg};

use super::{fill_u32, host_tasks, needs_kernels};
use crate::harness::{Factory, Harness, Ticket};
use crate::kernels;
use crate::Outcome;

/// Elements a failing kernel writes: one work-group, more than a threaded driver
/// runs inline by default, so it is handed over as pending where a driver can.
const N: usize = 1024;

/// The error of `t`, which must have failed.
fn failure(h: &mut Harness, t: &Ticket) -> ExecError {
    match h.result(t) {
        Err(e) => e,
        Ok(()) => panic!("{}: {} succeeded; it was meant to fail", h.name(), t.label()),
    }
}

/// A kernel that panics fails with [`ExecError::KernelPanicked`] naming it and
/// carrying the panic's message, and the driver goes on running kernels after it. A
/// driver running the kernel's CUDA C image instead refuses its launch (a GPU kernel
/// cannot fail part-way and leave the device usable): the error is the driver's own,
/// naming the kernel, and the driver goes on.
pub fn kernel_panic_is_reported(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if let Some(skip) = needs_kernels(&h) {
        return skip;
    }
    let x = h.alloc(N * 4);
    let boom = kernels::write_then_panic("conformance_exploding_kernel", N, 7);
    let t = h.submit(boom.launch([x.arg(Write)]), &[]);
    let error = failure(&mut h, &t);
    if let Err(what) = kernels::expected_failure(&boom, &h.caps(), &error) {
        panic!("{}: {what}", h.name());
    }
    let y = h.buffer_u32(&[5; N]);
    let after = h.submit(kernels::affine("conformance_after_panic", N, 1, 1).launch([y.arg(ReadWrite)]), &[]);
    h.expect_ok(&after);
    assert_eq!(
        h.download_u32(&y),
        vec![6; N],
        "{}: a kernel after a panic computed the wrong thing",
        h.name()
    );
    h.finish()
}

/// An operation that fails (a panicking kernel, or host task where the driver runs
/// no kernels) fails everything waiting on it, directly or through another waiter,
/// with [`ExecError::DependencyFailed`] whose root cause is its error, whether the
/// waiter was submitted before it failed or after; none of them runs (a waiting
/// kernel calls no work-item, waiting fills write nothing).
///
/// Only for drivers with in-driver waits: for the others the scheduler fails the
/// dependents of a failed operation itself, and none reaches the driver.
pub fn dependency_failure_propagates(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if !h.caps().in_driver_waits {
        return Outcome::skipped(
            "no in-driver waits: the scheduler fails the dependents of a failed operation itself",
        );
    }
    let kernels = kernels::runnable(&h.caps());
    let failing = if kernels {
        let x = h.alloc(N * 4);
        kernels::write_then_panic("conformance_failing_dependency", N, 7).launch([x.arg(Write)])
    } else if h.caps().host_tasks {
        let out = Arc::new(HostStorage::zeroed(N * 4));
        host_tasks::panicking_task("conformance_failing_dependency", &out, N)
    } else {
        return Outcome::skipped("the driver runs neither closure kernels nor host tasks: nothing can fail");
    };
    let a = h.submit(failing, &[]);
    if !a.is_pending() {
        return Outcome::skipped(
            "the driver ran the failing operation inside submit (Accepted::Done): no handle to wait on",
        );
    }
    let ran = Arc::new(AtomicUsize::new(0));
    let (y, z, w) = (h.alloc(N * 4), h.alloc(N * 4), h.alloc(N * 4));
    let dependent = |name: &str, buf: &crate::Buf| -> DeviceOp {
        if kernels {
            kernels::counted_store(name, N, 0xBAD, ran.clone()).launch([buf.arg(Write)])
        } else {
            fill_u32(buf, 0xBAD)
        }
    };
    let b = h.submit(dependent("conformance_direct_dependent", &y), &[&a]);
    let c = h.submit(dependent("conformance_indirect_dependent", &z), &[&b]);
    let cause = failure(&mut h, &a);
    let d = h.submit(dependent("conformance_late_dependent", &w), &[&a]);
    for t in [&b, &c, &d] {
        match failure(&mut h, t) {
            ExecError::DependencyFailed { cause: got, .. } if got.root_cause() == &cause => {}
            e => panic!(
                "{}: {} waits (directly or not) on {}, which failed with `{cause}`; it must fail with \
                 DependencyFailed caused by that, not: {e:?}",
                h.name(),
                t.label(),
                a.label()
            ),
        }
    }
    assert_eq!(ran.load(Ordering::Relaxed), 0, "{}: a kernel waiting on a failed operation ran", h.name());
    for (buf, t) in [(&y, &b), (&z, &c), (&w, &d)] {
        let got = h.download_u32(buf);
        let written = got.iter().enumerate().find(|&(_, &v)| v != 0);
        assert!(
            written.is_none(),
            "{}: {} waits on a failed operation but wrote its output (element {:?} of {})",
            h.name(),
            t.label(),
            written.map(|(i, v)| (i, format!("{v:#x}"))),
            got.len()
        );
    }
    h.finish()
}

/// With `preserve_on_failure`, a kernel that writes its whole output and then
/// panics leaves the output as it was before. (Run from its CUDA C image, the
/// kernel's launch is refused before it writes anything: the output must still be
/// as it was.)
pub fn failure_preserves_written_ranges(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if let Some(skip) = needs_kernels(&h) {
        return skip;
    }
    let before: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(3) + 1).collect();
    let x = h.buffer_u32(&before);
    let partial = kernels::write_then_panic("conformance_partial_writer", N, 0xDEAD);
    let arg = MemArg { mem: x.whole(), mode: Write };
    let t = h.submit_with(partial.launch([arg]), &[], true);
    failure(&mut h, &t);
    let after = h.download_u32(&x);
    let changed = (0..N).filter(|&i| after[i] != before[i]).count();
    assert!(
        changed == 0,
        "{}: {} wrote then panicked under preserve_on_failure; the range it wrote must be put back, \
         but {changed} of {N} elements kept its writes",
        h.name(),
        t.label()
    );
    h.finish()
}
