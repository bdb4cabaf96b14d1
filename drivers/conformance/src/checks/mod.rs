//! The checks: one public function per property of the [`Driver`](gantry_driver::Driver)
//! contract, each taking the suite's [`Factory`](crate::Factory), making a fresh
//! driver and panicking with a message that names what the contract asked for when
//! the driver breaks it. Each works on real data and compares it with what the
//! operations, run one after the other in dependency order, compute.
//!
//! By area:
//!
//! * [`ordering`]: wait-lists order dependent operations; independent ones complete
//!   exactly once each, in any order;
//! * [`failure`]: kernel panics, their dependents, and `preserve_on_failure`;
//! * [`memory`]: copies, fills, malformed operations and allocation limits;
//! * [`host_tasks`]: host tasks run once with their arguments, and their panics;
//! * [`command_buffers`]: recording, replay with other argument tables, patching.

pub mod command_buffers;
pub mod failure;
pub mod host_tasks;
pub mod memory;
pub mod ordering;

pub use command_buffers::{command_buffer_patch, command_buffer_replay};
pub use failure::{
    dependency_failure_propagates, failure_preserves_written_ranges, kernel_panic_is_reported,
};
pub use host_tasks::{host_task_panic_is_reported, host_task_runs_once};
pub use memory::{
    allocation_limits, copy_round_trip, copy_within_device_memory, fill_length_mismatch, fill_patterns,
    malformed_ops_are_errors,
};
pub use ordering::{dependent_chain, independent_ops_complete_once, wait_list_order};

use std::panic::{catch_unwind, AssertUnwindSafe};

use gantry_driver::{panic_message, DeviceOp, ExecError, MemSlice};
use smallvec::SmallVec;

use crate::harness::{Buf, Harness};
use crate::Outcome;

/// A fill of `dst` with `pattern`.
pub(crate) fn fill(dst: MemSlice, pattern: &[u8]) -> DeviceOp {
    DeviceOp::Fill { dst, pattern: SmallVec::from_slice(pattern) }
}

/// A fill of all of `buf` with the `u32` `value`.
pub(crate) fn fill_u32(buf: &Buf, value: u32) -> DeviceOp {
    fill(buf.whole(), &value.to_ne_bytes())
}

/// A copy.
pub(crate) fn copy(src: MemSlice, dst: MemSlice) -> DeviceOp {
    DeviceOp::Copy { src, dst }
}

/// The skip of a check that launches kernels, where the driver runs none of their
/// images.
pub(crate) fn needs_kernels(h: &Harness) -> Option<Outcome> {
    (!crate::kernels::runnable(&h.caps())).then(|| {
        Outcome::skipped("the driver runs none of the suite's kernel images (closure, CUDA C, WGSL)")
    })
}

/// Submits `op` with `preserve_on_failure` and returns its error: it must be refused
/// (`submit` returns `Err`) or fail, with a typed error and without panicking.
/// `what` says what was wrong with it, for the message.
pub(crate) fn expect_typed_error(h: &mut Harness, op: DeviceOp, what: &str) -> ExecError {
    let name = h.name().to_owned();
    let outcome = catch_unwind(AssertUnwindSafe(|| match h.try_submit(op, &[], true) {
        Err(refused) => Err(refused),
        Ok(t) => h.result(&t),
    }));
    match outcome {
        Ok(Err(e)) => e,
        Ok(Ok(())) => panic!("{name}: {what} succeeded; it must be refused or fail with an ExecError"),
        Err(p) => panic!(
            "{name}: {what} panicked ({}); it must be refused or fail with an ExecError",
            panic_message(&*p)
        ),
    }
}
