//! # Gantry
//!
//! A data-oriented GPU/CPU command scheduler. Programs submit *command groups*
//! (kernels, copies, fills, host tasks) to [`Queue`]s; Gantry derives their
//! dependencies from the [`Buffer`] ranges they read and write and the [`Event`]s
//! they name, and runs them on driver backends: the CPU (default) and a deterministic
//! simulated device.
//!
//! ```
//! use gantry::Runtime;
//!
//! let rt = Runtime::new();
//! let q = rt.queue();
//! let a = rt.buffer(&[1.0f32, 2.0, 3.0, 4.0]);
//! let b = rt.buffer_zeroed::<f32>(4);
//!
//! // b = a * 2, then a host task reads b. The host task depends on the kernel
//! // through `b`; nobody had to say so.
//! q.submit(|cg| {
//!     let a = cg.read(&a);
//!     let b = cg.elements_out(&b);
//!     cg.parallel_for(4, move |it| *b.elem(it) = a.get(it, it.global_linear_id()) * 2.0);
//! })?;
//! let sum = std::sync::Arc::new(std::sync::Mutex::new(0.0));
//! let s = sum.clone();
//! q.submit(|cg| {
//!     let b = cg.host_read(&b);
//!     cg.host_task(move |ctx| *s.lock().unwrap() = b.as_slice(ctx).iter().sum());
//! })?.wait()?;
//! assert_eq!(*sum.lock().unwrap(), 20.0);
//! # Ok::<(), gantry::Error>(())
//! ```
//!
//! ## Architecture
//! Internally Gantry is an ECS (bevy_ecs): commands, memory records and queues are
//! entities, and one flush runs the stages of [`Stage`] in order. See `ARCHITECTURE.md`
//! in the repository.
//!
//! ## Closure kernels and soundness
//! Kernel closures run many work-items at once over shared memory; the accessor types
//! keep safe code free of data races. See [`gantry_host::access`].

#![warn(missing_docs)]

mod buffer;
mod buffer_use;
mod error;
mod event;
mod fusing;
mod graph;
mod handler;
mod passing;
mod queue;
mod runtime;
mod task_scope;
mod trace;

pub use buffer::{Buffer, HostRead, HostWrite, Readback};
pub use error::{Error, Result};
pub use event::Event;
pub use graph::{CommandGraph, DynamicBuffer, ExecutableGraph, Node, PartitionInfo};
pub use handler::{Handler, Launch, Phases};
pub use queue::{Queue, QueueOptions};
pub use runtime::{DeviceId, Mode, Runtime, RuntimeBuilder};

pub use gantry_components::{
    CancelReason, EventStatus, FinalizeError, FusionOutcome, FusionProps, GraphProps, Linearizer, NodeList,
    NotFused, Slice, Stage, Stats, Timeline, Timestamps,
};
pub use gantry_cpu::CpuConfig;
pub use gantry_driver::fusion::{
    Fused, FusionCompiler, FusionError, FusionRequest, FusionWarning, Promotion, PromotionMismatch,
    Unprofitable, WindowThresholds,
};
pub use gantry_driver::{
    AccessMode, BackendStatus, CodeImage, DeviceInfo, DeviceKind, ExecError, HostCtx, ImageKind, Kernel,
    KernelRef, NdRange, Pod, Range, RangeDims, Signature, Zeroable,
};
pub use gantry_host::fusion::{CacheStats, ClosureFusion};
pub use gantry_host::{
    phase, Accessor, DiscardWrite, ElemAccessor, HostAccessor, Item, LocalAccessor, Neighborhood,
    PrivateAccessor, Read, ReadWrite, Write,
};
#[cfg(feature = "sim")]
pub use gantry_sim::{CostModel, Fault, FaultPlan, HostPoolConfig, MachineConfig, SimConfig, SimMachine};
pub use gantry_systems::partition::{BreadthFirst, ReverseDfs};

/// The CPU choices Gantry's own loops (elementwise kernels, fused or not) make at run
/// time: their vector instruction set (capped by `GANTRY_CPU_ISA`) and whether a
/// streamed chain prefetches in software (`GANTRY_STREAM_PREFETCH`).
pub use gantry_host::isa;

/// The CUDA driver (feature `cuda`): register it with [`RuntimeBuilder::cuda`] or
/// `Runtime::builder().driver(gantry::cuda::factory(ordinal))`.
#[cfg(feature = "cuda")]
pub use gantry_cuda as cuda;

/// The Vulkan driver (feature `vulkan`): register it with [`RuntimeBuilder::vulkan`]
/// or `Runtime::builder().driver(gantry::vulkan::factory(index))`.
#[cfg(feature = "vulkan")]
pub use gantry_vulkan as vulkan;

/// The driver contract, for backends written outside Gantry and registered with
/// [`RuntimeBuilder::driver`].
pub use gantry_driver as driver;
/// The execution core host-side drivers share (work-items, accessors, closure
/// kernels, snapshots, the closure fusion compiler, the runner), for backends that
/// run work on the host's cores.
pub use gantry_host as host;
/// The LLVM JIT (feature `jit`): kernels as LLVM IR images, from OpenCL C
/// ([`jit::from_opencl_c`]) or IR bytes ([`jit::from_llvm_ir`]), which the CPU and
/// simulated drivers run as native work-group functions and CUDA devices as PTX.
#[cfg(feature = "jit")]
pub use gantry_jit as jit;

/// The ECS crate Gantry's scheduler is built on, for adding systems to its stages.
pub use bevy_ecs as ecs;
/// Gantry's ECS components and resources, for systems added to its stages.
pub use gantry_components as components;

/// The README's example, compiled and run as a doc test.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// `parallel_for!(cg, range, closure)`: [`Handler::parallel_for`] whose per-work-item
/// body the CPU runs at loop speed where it can. The closure is expanded twice
/// ([`Handler::parallel_for_twice`]): one copy for work-groups whose memory is all
/// ordinary, compiled to a loop with no call in it, which the compiler vectorizes when
/// the body reads its own elements ([`Accessor::at`]) and writes them
/// ([`ElemAccessor::elem`]); one for the rest. The closure must be a closure
/// expression whose captures are `Copy` (accessors, numbers): each copy moves them.
/// Give the range as a `usize` or `[usize; N]` (not a [`Range`] value): its type then
/// tells the loop the kernel's dimensions, and a multi-dimensional body's row work
/// (`y * w`, tests of `y`) runs once per row instead of per work-item.
///
/// ```
/// let rt = gantry::Runtime::new();
/// let q = rt.queue();
/// let (x, y) = (rt.buffer(&[1.0f32; 4096]), rt.buffer_zeroed::<f32>(4096));
/// q.submit(|cg| {
///     let (x, y) = (cg.read(&x), cg.elements_out(&y));
///     gantry::parallel_for!(cg, 4096, move |it| *y.elem(it) = x.at(it) * 2.0 + 1.0);
/// })?
/// .wait()?;
/// assert_eq!(y.to_vec()?, vec![3.0; 4096]);
/// # Ok::<(), gantry::Error>(())
/// ```
#[macro_export]
macro_rules! parallel_for {
    ($cg:expr, $range:expr, $body:expr $(,)?) => {
        $cg.parallel_for_twice($range, $body, $body)
    };
}
