//! # gantry-driver
//!
//! The interface between Gantry's scheduler and its device backends, and the kernel
//! vocabulary both sides share:
//!
//! * [`range`]: [`Range`], [`NdRange`] and the validated [`Geometry`] of a launch;
//! * [`item`]: the [`Item`] a kernel closure receives for each work-item;
//! * [`access`]: accessors and the soundness model of closure kernels;
//! * [`kernel`]: kernels as a signature plus images, and their scalar arguments;
//! * [`image`]: code images (LLVM IR, PTX, SPIR-V, WGSL, ...) and the cache drivers
//!   load them into;
//! * [`closure`]: closure kernels (the host drivers' native image) as
//!   barrier-separated phases with scratch memory;
//! * [`memory`]: host storage, device allocations and slices;
//! * [`op`]: the [`DeviceOp`]s a driver runs and the [`Completion`]s it reports;
//! * [`driver`]: the [`Driver`] trait itself;
//! * [`command_buffer`]: command buffers recorded once and replayed (command graphs);
//! * [`fusion`]: the fusion-compiler interface and the closure-kernel fusion compiler;
//! * [`isa`]: the vector instruction set the runtime's own loops run with, and their
//!   prefetch policy;
//! * [`sync`]: the locks, channels, atomics and threads every crate synchronizes
//!   with (swapped for `shuttle`'s under `--cfg shuttle`).
//!
//! Backends live beside this crate (`gantry-cpu`, `gantry-sim`). The scheduler reaches
//! them only through [`Driver`].

#![warn(missing_docs)]

pub mod access;
pub mod closure;
pub mod command_buffer;
pub mod contain;
pub mod driver;
pub mod elementwise;
pub mod error;
pub mod fusion;
pub mod image;
pub mod isa;
pub mod item;
pub mod kernel;
pub mod memory;
pub mod op;
pub mod range;
pub mod sync;

pub use access::{
    AccessMode, Accessor, BufferSlot, DiscardWrite, ElemAccessor, HostAccessor, LocalAccessor, Mode,
    PrivateAccessor, Read, ReadWrite, Readable, Writable, Write,
};
pub use bytemuck::{Pod, Zeroable};
pub use closure::{
    phase, Arena, ClosureKernel, Elementwise, ElementwisePhase, ItemCost, MapLoop, Phase, ResolvedMap,
    Scratch, ScratchKind,
};
pub use command_buffer::{
    patch_buffer, CommandBuffer, CommandBufferBuilder, CommandBufferDesc, CommandBufferLaunch, OpPatch, Plan,
    PlanBuilder, PlannedOp, RecordedArg, RecordedOp, SyncPoint,
};
pub use driver::{Capabilities, DeviceInfo, DeviceKind, Driver, DriverContext, DriverFactory};
pub use elementwise::map_phase;
pub use error::{panic_message, BackendStatus, ExecError, RangeError};
pub use image::{no_image, CodeImage, ImageCache, ImageId, ImageKind};
pub use item::{GroupCtx, HostCtx, Item};
pub use kernel::{Kernel, KernelRef, ScalarArgs, ScalarBlock, ScalarMismatch, ScalarSlot, Signature};
pub use memory::{AllocId, Binding, HostStorage, Internal, MemRef, MemSlice, MemSpace, HOST_ALIGN};
pub use op::{
    fill_bytes, fill_fits, Accepted, Completion, DeviceOp, HostFn, HostTask, KernelLaunch, MemArg, OpHandle,
    OpId, Snapshot, SnapshotPool, Submission,
};
pub use range::{
    delinearize, linearize, Geometry, NdRange, Range, MAX_RANGE_CHUNK, RANGE_CHUNK, RANGE_GROUPS,
};
