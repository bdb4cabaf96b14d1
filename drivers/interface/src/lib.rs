//! # gantry-driver
//!
//! The contract between Gantry's scheduler and its device backends:
//!
//! * [`driver`]: the [`Driver`] trait itself, its capabilities and its factory;
//! * [`op`]: the [`DeviceOp`]s a driver runs, the [`Completion`]s it reports, and a
//!   host task's context;
//! * [`command_buffer`]: command buffers recorded once and replayed (command graphs);
//! * [`memory`]: host storage, device allocations, slices, access modes and the raw
//!   bindings kernels run over;
//! * [`kernel`]: kernels as a signature (buffers, scalars, local and private
//!   memory, a cost hint) plus images, and their scalar arguments;
//! * [`image`]: code images (LLVM IR, PTX, SPIR-V, WGSL, ...) and the cache drivers
//!   load them into;
//! * [`range`]: [`Range`], [`NdRange`] and the validated [`Geometry`] of a launch;
//! * [`fusion`]: what the scheduler asks a fusion compiler and what it answers;
//! * [`error`]: [`ExecError`] and its parts;
//! * [`contain`]: user closures whose destructors may panic;
//! * [`sync`]: the locks, channels, atomics and threads every crate synchronizes
//!   with (swapped for `shuttle`'s under `--cfg shuttle`).
//!
//! Backends live beside this crate (`gantry-cpu`, `gantry-sim`); the execution core
//! the host-side ones share (work-items, accessors, closure kernels, snapshots, the
//! closure fusion compiler, the runner) is `gantry-host`. The scheduler reaches
//! backends only through [`Driver`].

#![warn(missing_docs)]

mod clock;
pub mod command_buffer;
pub mod contain;
pub mod driver;
pub mod error;
pub mod fusion;
pub mod hint;
pub mod image;
pub mod kernel;
pub mod memory;
pub mod op;
pub mod range;
pub mod sync;

pub use bytemuck::{Pod, Zeroable};
pub use clock::Clock;
pub use command_buffer::{
    patch_buffer, CommandBuffer, CommandBufferBuilder, CommandBufferDesc, CommandBufferLaunch, OpPatch, Plan,
    PlanBuilder, PlannedOp, RecordedArg, RecordedHostFn, RecordedOp, SyncPoint,
};
pub use driver::{Capabilities, DeviceInfo, DeviceKind, Driver, DriverContext, DriverFactory};
pub use error::{panic_message, BackendStatus, ExecError, RangeError};
pub use hint::SimHint;
pub use image::{no_image, CodeImage, ImageCache, ImageId, ImageKind};
pub use kernel::{
    ItemCost, Kernel, KernelRef, ScalarArgs, ScalarBlock, ScalarMismatch, ScalarSlot, Scratch, ScratchKind,
    Signature,
};
pub use memory::{
    AccessMode, AllocId, Binding, HostStorage, Internal, MemRef, MemSlice, MemSpace, HOST_ALIGN,
};
pub use op::{
    fill_bytes, fill_fits, Accepted, Completion, DeviceOp, HostCtx, HostFn, HostTask, KernelLaunch, MemArg,
    OpHandle, OpId, SharedHostFn, Submission,
};
pub use range::{
    delinearize, linearize, Geometry, NdRange, Range, RangeDims, MAX_RANGE_CHUNK, RANGE_CHUNK, RANGE_GROUPS,
};
