//! # gantry-sim
//!
//! The simulated device: a deterministic virtual device with memory of its own and a
//! virtual clock, for testing the scheduler against a backend that behaves like a
//! discrete GPU (separate memory, explicit host↔device copies, asynchronous
//! completions that may arrive out of submission order) while staying reproducible.
//!
//! # Model
//!
//! * **Memory.** [`Driver::alloc`] creates a zeroed allocation in the driver's own
//!   table; [`MemRef::Device`] names one. Copies may move bytes between host and
//!   device memory in either direction (or within either); kernels and fills may only
//!   bind device memory. The total of live allocations is capped by
//!   [`SimConfig::memory_bytes`].
//! * **Time.** An operation takes [`SimConfig::latency_ns`] plus what the
//!   [`CostModel`] charges for its work: work-items over compute units (at the
//!   kernel's declared per-item cost or the device's default), bytes over memory or
//!   link bandwidth, whichever is slower. It starts at the latest of: its
//!   [`SimHint::not_before_ns`] (the scheduler's stamp: when the dependencies
//!   outside its wait-list ended, and the machine's clock when it was submitted), the
//!   device's clock when the latest poll began, the end of everything in its
//!   wait-list, and the moment an engine of its class (compute for kernels and fills,
//!   copy for copies) is free. With the default model (no per-item or per-byte cost,
//!   unlimited engines) every operation takes exactly the latency and independent ones
//!   overlap freely.
//! * **Machine.** Devices of one [`SimMachine`] share its clock, so their timestamps
//!   compare and a dependency between devices costs what it should. With
//!   [`MachineConfig::peer_bytes_per_ns`] they also share a peer group: a copy reads a
//!   peer's memory straight over the device-to-device link. A [`HostPoolConfig`] adds
//!   the modelled host thread pool, a device in host memory that runs host tasks (at
//!   their declared duration or the pool's default) on its threads in virtual time.
//! * **Execution.** [`Driver::submit`] only records an operation. [`Driver::poll`] runs
//!   every recorded operation on the calling thread in order of (virtual end time,
//!   submission order), advancing the virtual clock to each one's end and reporting
//!   its completion with its virtual start and end. A waiter always ends strictly after
//!   what it waits on, so this order respects every wait-list, and completion order
//!   can differ from submission order.
//! * **Command buffers.** [`Driver::create_command_buffer`] records a [`Plan`]
//!   (kernels, device copies, fills and markers; host↔buffer writes and reads are
//!   refused). A replay ([`DeviceOp::CommandBuffer`]) is one operation to the rest of
//!   the driver: it resolves its argument table at submission, occupies one engine
//!   (compute if the plan has a kernel or fill, else copy) and takes the latency
//!   *once* plus the sum of what the cost model charges each recorded operation, then
//!   runs the operations in plan order with the memory rules of individual operations.
//!
//! Nothing depends on wall-clock time or thread scheduling: the same submissions and
//! polls produce the same completions, in the same order, with the same timestamps.
//!
//! Its modules follow the model: `config` (the device's, the machine's and the host
//! pool's configuration), `cost` (the cost model, engines and links), `faults` (the
//! fault plan), `clock` (the device's state and timeline) and `pending` (operations
//! waiting for a poll), `memory` (allocations and regions), `plans` (command buffers)
//! and `machine` (the machine, and its devices' submission and execution). Kernels,
//! host tasks and replays run through `gantry_host`'s runner, as on the CPU driver.
//!
//! [`Driver::alloc`]: gantry_driver::Driver::alloc
//! [`Driver::submit`]: gantry_driver::Driver::submit
//! [`Driver::poll`]: gantry_driver::Driver::poll
//! [`Driver::create_command_buffer`]: gantry_driver::Driver::create_command_buffer
//! [`MemRef::Device`]: gantry_driver::MemRef::Device
//! [`SimHint::not_before_ns`]: gantry_driver::SimHint::not_before_ns
//! [`Plan`]: gantry_driver::Plan
//! [`DeviceOp::CommandBuffer`]: gantry_driver::DeviceOp::CommandBuffer

#![warn(missing_docs)]

mod clock;
mod config;
mod cost;
mod faults;
mod machine;
mod memory;
mod pending;
mod plans;
#[cfg(test)]
mod testing;

pub use config::{HostPoolConfig, MachineConfig, SimConfig};
pub use cost::CostModel;
pub use faults::{Fault, FaultPlan};
pub use machine::{SimDriver, SimMachine};
