//! # gantry-host
//!
//! The execution core every host-side driver shares: the CPU driver, the simulated
//! device, and later JIT-compiled native code. `gantry-driver` is the contract
//! between the scheduler and its backends; this crate is how a backend that runs
//! work on the host's cores runs it, so that no driver implements it again:
//!
//! * [`item`]: the [`Item`] a kernel closure receives for each work-item, and the
//!   per-work-group context a driver hands each phase;
//! * [`access`]: accessors and the soundness model of closure kernels;
//! * [`closure`]: closure kernels (the host drivers' native image) as
//!   barrier-separated phases with scratch memory, the arena work-groups run in, and
//!   [`ClosureImage`] to reach a kernel's closure image;
//! * [`elementwise`]: elementwise kernels, whose loop the runtime owns;
//! * [`multimap`]: elementwise kernels of two to four inputs;
//! * [`reduce`]: reductions of a range into one element, optionally of a map;
//! * [`stencil`]: kernels over a 2-D grid that read each cell's 3×3 neighbourhood;
//! * [`isa`]: the vector instruction set the runtime's own loops run with, and their
//!   prefetch policy;
//! * [`snapshot`]: copies of an operation's writable ranges, for
//!   `preserve_on_failure`, and the pool their memory comes from;
//! * [`fusion`]: the fusion compiler for closure kernels ([`ClosureFusion`]) and the
//!   unfused rerun of a failed fused kernel;
//! * [`runner`]: the [`Runner`] drivers run bound operations with: a kernel with its
//!   snapshot and unfused rerun, a host task, a recorded operation; drivers differ
//!   only in how a launch's work-groups run ([`Groups`]);
//! * [`replay`]: command buffers with a cache of their operations bound to memory,
//!   and their replay;
//! * `ir` (feature `jit`): LLVM IR kernels compiled to native work-group functions
//!   by `gantry-jit`, which the runner runs where a kernel has no closure image.
//!
//! [`IMAGE_KINDS`] are the image kinds a host driver built from this crate runs.

#![warn(missing_docs)]

pub mod access;
pub mod closure;
pub mod elementwise;
pub mod fusion;
#[cfg(feature = "jit")]
mod ir;
pub mod isa;
pub mod item;
pub mod multimap;
pub mod reduce;
pub mod replay;
pub mod runner;
pub mod snapshot;
pub mod stencil;

pub use access::{
    Accessor, BufferSlot, DiscardWrite, ElemAccessor, HostAccessor, LocalAccessor, Mode, PrivateAccessor,
    Read, ReadWrite, Readable, Writable, Write,
};
pub use closure::{
    phase, phase_twice, Arena, ClosureImage, ClosureKernel, Elementwise, ElementwisePhase, MapLoop, Phase,
    ResolvedMap, SlowerFused,
};
pub use elementwise::map_phase;
pub use fusion::{CacheStats, ClosureFusion, Unfused};
pub use item::{GroupCtx, Item};
pub use multimap::{map2_phase, map3_phase, map4_phase};
pub use reduce::{reduce_phase, Custom, Max, Min, Reduction, Sum};
pub use replay::{BoundOps, BoundStep, CachedPlan};
pub use runner::{Groups, KernelCall, Runner};
pub use snapshot::{Snapshot, SnapshotPool};
pub use stencil::{stencil_phase, Neighborhood};

/// The fusion compilers a host driver offers besides the closure one (which the
/// runtime adds): with the feature `jit`, `gantry-jit`'s compiler of LLVM IR kernels,
/// whose fused kernels the [`Runner`] runs like any other IR kernel.
pub fn fusion_compilers() -> Vec<std::sync::Arc<dyn gantry_driver::fusion::FusionCompiler>> {
    #[cfg(feature = "jit")]
    return vec![std::sync::Arc::new(gantry_jit::IrFusion::new())];
    #[cfg(not(feature = "jit"))]
    Vec::new()
}

/// The kernel image kinds the [`Runner`] runs: closures, and LLVM IR with the
/// feature `jit`.
pub const IMAGE_KINDS: &[gantry_driver::ImageKind] = if cfg!(feature = "jit") {
    &[gantry_driver::ImageKind::Closure, gantry_driver::ImageKind::LlvmIr]
} else {
    &[gantry_driver::ImageKind::Closure]
};
