//! Host tasks: a closure run once on a host thread with host access to its
//! arguments, ordered with the operations around it, and a typed error when it
//! panics. Only for drivers with [`Capabilities::host_tasks`](gantry_driver::Capabilities).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry_driver::{
    AccessMode, DeviceOp, ExecError, HostCtx, HostFn, HostStorage, HostTask, MemArg, MemSlice,
};
use gantry_host::{HostAccessor, Read, Write};

use super::copy;
use crate::harness::{bytes_u32, u32_bytes, Factory, Harness};
use crate::kernels::DELIBERATE;
use crate::Outcome;

/// The command-group tag of every host task's accessors.
const TAG: u64 = 0x4057;

/// Elements of a host task's arguments.
const N: usize = 256;

fn host_u32(values: &[u32]) -> Arc<HostStorage> {
    Arc::new(HostStorage::from_bytes(&u32_bytes(values)))
}

fn host_arg(storage: &Arc<HostStorage>, mode: AccessMode) -> MemArg {
    MemArg { mem: MemSlice::host(storage.clone()), mode }
}

fn task(name: &str, run: HostFn, args: impl IntoIterator<Item = MemArg>) -> DeviceOp {
    DeviceOp::HostTask(HostTask { name: name.into(), tag: TAG, run, args: args.into_iter().collect() })
}

/// The message [`panicking_task`]s panic with.
fn task_panic_message() -> String {
    format!("{DELIBERATE} in a host task")
}

/// A host task over the `n` `u32`s of `out` that writes 0xDEAD to the first half and
/// then panics.
pub(crate) fn panicking_task(name: &str, out: &Arc<HostStorage>, n: usize) -> DeviceOp {
    let mut acc = HostAccessor::<u32, Write>::new(0, TAG, n);
    let run = Box::new(move |ctx: &HostCtx<'_>| {
        acc.as_mut_slice(ctx)[..n / 2].fill(0xDEAD);
        panic!("{}", task_panic_message());
    });
    task(name, run, [host_arg(out, AccessMode::Write)])
}

fn skip(h: &Harness) -> Option<Outcome> {
    (!h.caps().host_tasks).then(|| Outcome::skipped("the driver runs no host tasks"))
}

/// A copy fills the input; a host task waiting on it reads the input and writes
/// `5x + 3` to its output through host accessors; a copy waiting on the task moves
/// the output on. The task ran exactly once (also after the harness listened for
/// stray completions), saw the copy's data, and the copy after it saw the task's.
pub fn host_task_runs_once(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if let Some(skip) = skip(&h) {
        return skip;
    }
    let values: Vec<u32> = (0..N as u32).map(|i| i * 2 + 1).collect();
    let source = host_u32(&values);
    let (input, output, last) = (host_u32(&[0; N]), host_u32(&[0; N]), host_u32(&[0; N]));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let (src, mut dst) =
        (HostAccessor::<u32, Read>::new(0, TAG, N), HostAccessor::<u32, Write>::new(1, TAG, N));
    let run = Box::new(move |ctx: &HostCtx<'_>| {
        counted.fetch_add(1, Ordering::Relaxed);
        let x: Vec<u32> = src.as_slice(ctx).to_vec();
        for (o, v) in dst.as_mut_slice(ctx).iter_mut().zip(x) {
            *o = v * 5 + 3;
        }
    });
    let fill_input = h.submit(copy(MemSlice::host(source), MemSlice::host(input.clone())), &[]);
    let t = h.submit(
        task(
            "conformance_host_task",
            run,
            [host_arg(&input, AccessMode::Read), host_arg(&output, AccessMode::Write)],
        ),
        &[&fill_input],
    );
    let move_on = h.submit(copy(MemSlice::host(output.clone()), MemSlice::host(last.clone())), &[&t]);
    h.expect_ok(&move_on);
    h.expect_ok(&t);
    let expected: Vec<u32> = values.iter().map(|v| v * 5 + 3).collect();
    let got = bytes_u32(&h.host_bytes(&last));
    assert_eq!(got, expected, "{}: the host task's output (after the copies around it) is wrong", h.name());
    let name = h.name().to_owned();
    let outcome = h.finish();
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{name}: the host task must run exactly once");
    outcome
}

/// A host task that writes half its output and panics fails with
/// [`ExecError::HostTaskPanicked`] naming it and carrying the message; under
/// `preserve_on_failure` its output is put back; the driver runs host tasks after it.
pub fn host_task_panic_is_reported(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if let Some(skip) = skip(&h) {
        return skip;
    }
    let before: Vec<u32> = (0..N as u32).collect();
    let out = host_u32(&before);
    let t = h.submit_with(panicking_task("conformance_exploding_task", &out, N), &[], true);
    match h.result(&t) {
        Err(ExecError::HostTaskPanicked { task, message }) => {
            assert_eq!(&*task, "conformance_exploding_task", "{}: the error names another task", h.name());
            assert_eq!(message, task_panic_message(), "{}: the panic's message is lost", h.name());
        }
        r => panic!("{}: a panicking host task must fail with HostTaskPanicked, not: {r:?}", h.name()),
    }
    let after = bytes_u32(&h.host_bytes(&out));
    assert_eq!(
        after,
        before,
        "{}: the host task wrote then panicked under preserve_on_failure; its output must be put back",
        h.name()
    );
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = ran.clone();
    let again = h.submit(
        task(
            "conformance_after_panic",
            Box::new(move |_| {
                counted.fetch_add(1, Ordering::Relaxed);
            }),
            [],
        ),
        &[],
    );
    h.expect_ok(&again);
    assert_eq!(ran.load(Ordering::Relaxed), 1, "{}: a host task after a panic did not run", h.name());
    h.finish()
}
