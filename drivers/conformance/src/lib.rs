//! # gantry-conformance
//!
//! The [`Driver`] contract as a test suite that any backend runs with one line:
//!
//! ```
//! // tests/conformance.rs of a driver's crate
//! use std::sync::Arc;
//! use gantry_conformance::{Driver, DriverContext};
//! gantry_conformance::suite!(cpu, |ctx: DriverContext| -> Arc<dyn Driver> {
//!     Arc::new(gantry_cpu::CpuDriver::new(Default::default(), ctx))
//! });
//! # fn main() {}
//! ```
//!
//! [`suite!`] expands to a module of ordinary `#[test]` functions, one per property of
//! the contract, so a failure is reported by the property's name. Each calls the check
//! of the same name in [`checks`], which builds a fresh driver through the factory,
//! drives it through a [`Harness`] and panics with a message naming the driver, the
//! operation and what the contract asked for.
//!
//! * [`harness`]: the driver under test, its completion channel and memory; it
//!   submits the way the scheduler does for the driver's [`Capabilities`](gantry_driver::Capabilities)
//!   and checks that every pending operation completes exactly once;
//! * [`checks`]: the checks, one module per area of the contract;
//! * [`suite!`] and [`run_check`]: the macro and what its tests call;
//! * [`device`]: a driver of a known type under test, for a backend's own tests;
//! * the kernels the checks launch are built in one private module (`kernels`), each
//!   with three images: a closure (host drivers), CUDA C (the CUDA driver) and WGSL
//!   (the Vulkan driver), so the same checks run on the CPU, the simulated device,
//!   CUDA and Vulkan.
//!
//! A factory may also be fallible (a `DriverFactory`, returning
//! `Result<Arc<dyn Driver>, ExecError>`): where it fails, as a GPU backend's does on a
//! machine without the GPU, every check says it was skipped and why.
//!
//! A check that asks for something the driver does not offer (host tasks without
//! [`Capabilities::host_tasks`](gantry_driver::Capabilities::host_tasks), device
//! allocations on a driver that shares host memory, command buffers refused with
//! [`ExecError::Unsupported`]) returns
//! [`Outcome::Skipped`] with the reason; the suite prints it, or, given the list of
//! checks a driver is expected to skip (`skips = [..]`), fails on any difference.
//!
//! The checks' kernels panic on purpose in a few places; the harness silences those
//! panics' messages (they start with [`DELIBERATE`]) and lets every other panic print.
//! A driver that aborts the process (an allocation failure it does not catch) takes
//! the test binary with it: that is a failure too, if a less readable one.

#![warn(missing_docs)]
// Under `--cfg shuttle` the sync primitives are shuttle's, whose channels have no
// timed receive: the suite, which waits on real drivers in real time, is not built
// (the shuttle tests build the engine's dev-dependencies, this crate among them).
#![cfg(not(shuttle))]

pub mod checks;
pub mod device;
pub mod harness;
mod kernels;
pub mod step_chain;
mod suite;

pub use gantry_driver::{Driver, DriverContext, ExecError};
pub use harness::{Buf, Factory, Harness, Ticket, DEADLINE};
pub use kernels::DELIBERATE;
pub use suite::{run_check, MadeDriver, MakeDriver, Outcome};
