//! # gantry-jit
//!
//! Gantry's kernel JIT: kernels as LLVM IR ([`ImageKind::LlvmIr`](gantry_driver::ImageKind::LlvmIr)
//! images, from OpenCL C or IR bytes), compiled to native code for the host CPU
//! ([`HostCompiler`]) or to PTX for NVIDIA GPUs ([`PtxCompiler`]), each result kept in
//! a [`CompileCache`].
//!
//! * [`ir`]: making images ([`from_opencl_c`], [`from_llvm_ir`]); the build-time
//!   route is [`gantry_jit_clang::build_script`];
//! * [`signature`]: how a kernel's parameters map to a [`Signature`](gantry_driver::Signature),
//!   and [`signature_of`];
//! * [`host`]: work-group functions on the host, barriers included;
//! * [`ptx`]: PTX with the CUDA driver's parameter convention;
//! * [`cache`]: the compile cache;
//! * [`fusion`]: kernel fusion on LLVM IR ([`IrFusion`]), whose fused kernels
//!   both compilers take like any other.
//!
//! Builds need LLVM 19 (`LLVM_SYS_191_PREFIX=/usr/lib/llvm-19`); making images from
//! OpenCL C at run time needs clang-19 (or `$GANTRY_CLANG`).

#![warn(missing_docs)]

mod barrier;
mod builtins;
pub mod cache;
mod error;
pub mod fusion;
pub mod host;
pub mod ir;
mod math;
mod prepare;
pub mod ptx;
mod raw;
pub mod signature;
mod target;
mod timings;
mod transplant;

pub use cache::{CacheKey, CompileCache};
pub use error::JitError;
pub use fusion::{FusionCacheStats, FusionTimings, IrFusion};
pub use host::{HostCompiler, HostKernel, HostLaunch};
pub use ir::{from_llvm_ir, from_opencl_c};
pub use ptx::{PtxCompiler, PtxKernel};
pub use signature::signature_of;
pub use target::HostTarget;
pub use timings::CompileTimings;
