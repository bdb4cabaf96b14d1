//! Native host code: an IR kernel compiled for the machine the process runs on,
//! as a work-group function (`wrapper`) that runs a range of work-groups per call.
//!
//! ```no_run
//! use gantry_driver::{AccessMode, Signature};
//! use gantry_jit::{HostCompiler, HostLaunch};
//! let image = gantry_jit::from_opencl_c(
//!     "kernel void add(global const float* a, global float* b, float s) {
//!          size_t i = get_global_id(0); b[i] += s * a[i]; }",
//!     "add",
//! )?;
//! let sig = Signature::new().global(AccessMode::Read).global(AccessMode::ReadWrite).scalar::<f32>();
//! let kernel = HostCompiler::new().compile(&image, &sig)?;
//! let (a, mut b) = (vec![1.0f32; 1000], vec![0.0f32; 1000]);
//! let globals = [a.as_ptr() as *mut u8, b.as_mut_ptr().cast()];
//! let scalars = 2.0f32.to_ne_bytes();
//! let launch = HostLaunch::new(&globals, &scalars, &[], [1000, 1, 1], [100, 1, 1]);
//! // SAFETY: both buffers hold the 1000 floats the kernel touches; no other thread uses them.
//! unsafe { kernel.run_groups(&launch, 0, launch.group_count())? };
//! assert_eq!(b[999], 2.0);
//! # Ok::<(), gantry_jit::JitError>(())
//! ```

mod wrapper;

use std::cell::RefCell;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use gantry_driver::{CodeImage, Geometry, ScratchKind, Signature};
use inkwell::attributes::AttributeLoc;
use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::passes::PassBuilderOptions;
use inkwell::OptimizationLevel;

use crate::barrier;
use crate::cache::{CacheKey, CompileCache};
use crate::error::{codegen, JitError};
use crate::prepare::prepare;
use crate::raw;
use crate::target::HostTarget;
use crate::timings::{Clock, CompileTimings};
use wrapper::{RawLaunch, CTX_ALIGN};

/// Compiles LLVM IR kernels to host code, keeping each result in a
/// [`CompileCache`]. Shareable across threads.
#[derive(Debug)]
pub struct HostCompiler {
    target: HostTarget,
    cache: CompileCache<HostKernel>,
}

impl Default for HostCompiler {
    fn default() -> Self {
        Self::new()
    }
}

impl HostCompiler {
    /// A compiler for the machine this process runs on.
    pub fn new() -> Self {
        Self::for_target(HostTarget::detect())
    }

    /// A compiler for `target` (its code runs only on a machine that has the
    /// target's CPU features).
    pub fn for_target(target: HostTarget) -> Self {
        Self { target, cache: CompileCache::default() }
    }

    /// The target it compiles for.
    pub fn target(&self) -> &HostTarget {
        &self.target
    }

    /// The compiled kernel for `image` (an [`ImageKind::LlvmIr`](gantry_driver::ImageKind::LlvmIr)
    /// image) with `signature`: from the cache, or compiled now.
    pub fn compile(&self, image: &CodeImage, signature: &Signature) -> Result<Arc<HostKernel>, JitError> {
        let key = CacheKey::new(image, signature, self.key());
        self.cache.get_or_compile(key, || HostKernel::compile(&self.target, image, signature))
    }

    /// Its cache (for its counters).
    pub fn cache(&self) -> &CompileCache<HostKernel> {
        &self.cache
    }

    /// The optimized LLVM IR of the work-group function [`compile`](Self::compile)
    /// would generate machine code from (not cached): for inspection and tests.
    pub fn optimized_ir(&self, image: &CodeImage, signature: &Signature) -> Result<String, JitError> {
        let context = Context::create();
        let mut clock = Clock::start();
        let mut timings = CompileTimings::default();
        let module = build(&context, &self.target, image, signature, &mut clock, &mut timings)?.0;
        Ok(module.print_to_string().to_string())
    }

    fn key(&self) -> String {
        format!("host {} {} {}", self.target.triple, self.target.cpu, self.target.features)
    }
}

/// Parses, transforms and optimizes; returns the module and the context bytes.
fn build<'ctx>(
    context: &'ctx Context,
    target: &HostTarget,
    image: &CodeImage,
    signature: &Signature,
    clock: &mut Clock,
    timings: &mut CompileTimings,
) -> Result<(inkwell::module::Module<'ctx>, usize), JitError> {
    let machine = target.machine()?;
    // Parsing is part of `prepare`; its share is measured separately by parsing
    // first (the cost is small next to the rest, and it reports IR errors early).
    crate::ir::parse_image(context, image)?;
    timings.parse = clock.lap();
    let prepared = prepare(context, image, signature, &machine)?;
    let builder = context.create_builder();
    let cuts = if prepared.barriers > 0 {
        let cuts = barrier::split(context, &builder, prepared.kernel)?;
        barrier::demote(&prepared.module, &machine)?;
        cuts
    } else {
        Vec::new()
    };
    let ctx_bytes = wrapper::build(context, &builder, &prepared, &cuts)?;
    let module = prepared.module;
    let f =
        module.get_function(wrapper::ENTRY).ok_or_else(|| codegen("the work-group function is missing"))?;
    f.add_attribute(AttributeLoc::Function, context.create_string_attribute("target-cpu", &target.cpu));
    f.add_attribute(
        AttributeLoc::Function,
        context.create_string_attribute("target-features", &target.features),
    );
    let nounwind = inkwell::attributes::Attribute::get_named_enum_kind_id("nounwind");
    f.add_attribute(AttributeLoc::Function, context.create_enum_attribute(nounwind, 0));
    module.verify().map_err(|e| codegen(format!("the generated work-group function is invalid: {e}")))?;
    timings.transform = clock.lap();
    module
        .run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(|e| codegen(format!("optimizing: {}", raw::text(&e))))?;
    timings.optimize = clock.lap();
    Ok((module, ctx_bytes))
}

/// A kernel compiled to host code: runs work-groups on the calling thread. Owns its
/// code (freed when dropped); `Send + Sync`, so one compiled kernel serves every
/// worker thread at once.
pub struct HostKernel {
    run: unsafe extern "C" fn(*const RawLaunch, u64, u64),
    ctx_bytes: usize,
    globals: usize,
    scalar_bytes: usize,
    locals: usize,
    timings: CompileTimings,
    _code: Code,
}

/// The LLVM context and execution engine that own a kernel's machine code. The
/// engine borrows the context: it is dropped first.
struct Code {
    engine: ManuallyDrop<ExecutionEngine<'static>>,
    context: *mut Context,
}

impl Drop for Code {
    fn drop(&mut self) {
        // SAFETY: the engine (and the module it owns) borrow the context, which was
        // leaked from a box in `HostKernel::compile` and is freed only here, after
        // them.
        unsafe {
            ManuallyDrop::drop(&mut self.engine);
            drop(Box::from_raw(self.context));
        }
    }
}

// SAFETY: after compilation nothing uses the context or the engine but `Drop`,
// which has exclusive access; LLVM contexts are not tied to a thread, only not safe
// for concurrent use, and there is none. The machine code itself is immutable and
// reentrant (its state is the launch record, the context area and its stack).
unsafe impl Send for Code {}
unsafe impl Sync for Code {}

impl HostKernel {
    fn compile(target: &HostTarget, image: &CodeImage, signature: &Signature) -> Result<Self, JitError> {
        let mut clock = Clock::start();
        let mut timings = CompileTimings::default();
        let context: &'static Context = Box::leak(Box::new(Context::create()));
        let context_ptr = context as *const Context as *mut Context;
        // Frees the context on every error path below; disarmed once `Code` owns it.
        struct Guard(*mut Context, bool);
        impl Drop for Guard {
            fn drop(&mut self) {
                if self.1 {
                    // SAFETY: nothing borrowing the context outlives this point on
                    // the error paths (the module is dropped before the guard).
                    unsafe { drop(Box::from_raw(self.0)) }
                }
            }
        }
        let mut guard = Guard(context_ptr, true);
        let (module, ctx_bytes) = build(context, target, image, signature, &mut clock, &mut timings)?;
        let engine = module
            .create_jit_execution_engine(OptimizationLevel::Aggressive)
            .map_err(|e| codegen(format!("creating the JIT: {e}")))?;
        let address = engine
            .get_function_address(wrapper::ENTRY)
            .map_err(|e| codegen(format!("the work-group function has no address: {e}")))?;
        drop(module);
        timings.codegen = clock.lap();
        guard.1 = false;
        // SAFETY: the address is the generated function, whose signature is this one
        // (see `wrapper`); it stays valid while the engine lives, which `Code` keeps.
        let run = unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const RawLaunch, u64, u64)>(address)
        };
        Ok(Self {
            run,
            ctx_bytes,
            globals: signature.globals.len(),
            scalar_bytes: signature.scalar_bytes(),
            locals: signature.memory.iter().filter(|s| s.kind == ScratchKind::Local).count(),
            timings,
            _code: Code { engine: ManuallyDrop::new(engine), context: context_ptr },
        })
    }

    /// Where its compilation's time went.
    pub fn timings(&self) -> CompileTimings {
        self.timings
    }

    /// Bytes of per-work-item context a work-group needs per work-item (0 for a kernel
    /// without barriers); `run_groups` provides it from a per-thread buffer.
    pub fn context_bytes(&self) -> usize {
        self.ctx_bytes
    }

    /// Checks that `launch` fits the kernel's signature.
    pub fn check(&self, launch: &HostLaunch) -> Result<(), JitError> {
        let what = if launch.globals.len() != self.globals {
            format!("{} global pointers for {} globals", launch.globals.len(), self.globals)
        } else if launch.scalars.len() < self.scalar_bytes {
            format!(
                "a scalar block of {} bytes, the signature needs {}",
                launch.scalars.len(),
                self.scalar_bytes
            )
        } else if launch.locals.len() != self.locals {
            format!("{} local pointers for {} local slots", launch.locals.len(), self.locals)
        } else if launch.global_size.contains(&0) || launch.local_size.contains(&0) {
            format!("an empty range: global {:?}, local {:?}", launch.global_size, launch.local_size)
        } else if !(1..=3).contains(&launch.work_dim) {
            format!("work_dim {}", launch.work_dim)
        } else {
            return Ok(());
        };
        Err(JitError::Launch { what })
    }

    /// Runs work-groups `first_group .. first_group + groups` (linear group ids,
    /// dimension 0 fastest; ids past [`HostLaunch::group_count`] are skipped) of
    /// `launch` on this thread, one after the other.
    ///
    /// # Safety
    ///
    /// * each global pointer is valid for every read and write the kernel makes
    ///   through it for these groups (its indexes are the kernel's business: the
    ///   compiled code does not check them);
    /// * each local pointer points at the slot's bytes (the signature's) of
    ///   writable memory, aligned for what the kernel stores there, used by no other
    ///   thread during the call;
    /// * no other thread writes memory these groups read or write during the call,
    ///   except where the kernel itself synchronizes (atomics);
    /// * the kernel is correct OpenCL: every work-item of a group reaches the same
    ///   barriers, and the signature's scalars hold values of the kernel's types.
    pub unsafe fn run_groups(
        &self,
        launch: &HostLaunch,
        first_group: usize,
        groups: usize,
    ) -> Result<(), JitError> {
        self.check(launch)?;
        let total = launch.group_count();
        let first = first_group.min(total);
        let groups = groups.min(total - first);
        if groups == 0 {
            return Ok(());
        }
        let u = |v: [usize; 3]| v.map(|x| x as u64);
        let mut raw = RawLaunch {
            globals: launch.globals.as_ptr(),
            scalars: launch.scalars.as_ptr(),
            locals: launch.locals.as_ptr(),
            ctx: std::ptr::null_mut(),
            global: u(launch.global_size),
            local: u(launch.local_size),
            offset: u(launch.offset),
            groups: u(launch.groups()),
            work_dim: launch.work_dim,
        };
        if self.ctx_bytes == 0 {
            // SAFETY: the record matches the generated function; the caller vouches
            // for the memory (see above).
            unsafe { (self.run)(&raw, first as u64, groups as u64) };
            return Ok(());
        }
        let items: usize = launch.local_size.iter().product();
        let bytes = items
            .checked_mul(self.ctx_bytes)
            .ok_or_else(|| JitError::Launch { what: "the work-group's context overflows".into() })?;
        CONTEXT.with(|area| {
            let mut area = area.borrow_mut();
            let blocks = bytes.div_ceil(CTX_ALIGN);
            if area.len() < blocks {
                area.resize(blocks, CtxBlock([0; CTX_ALIGN]));
            }
            raw.ctx = area.as_mut_ptr().cast();
            // SAFETY: as above, and the context area holds `bytes` bytes, aligned to
            // CTX_ALIGN, owned by this thread for the call.
            unsafe { (self.run)(&raw, first as u64, groups as u64) };
        });
        Ok(())
    }
}

impl std::fmt::Debug for HostKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKernel")
            .field("globals", &self.globals)
            .field("scalar_bytes", &self.scalar_bytes)
            .field("locals", &self.locals)
            .field("context_bytes", &self.ctx_bytes)
            .field("timings", &self.timings)
            .finish()
    }
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct CtxBlock([u8; CTX_ALIGN]);

thread_local! {
    /// The per-work-item context records of the group a kernel with barriers runs.
    static CONTEXT: RefCell<Vec<CtxBlock>> = const { RefCell::new(Vec::new()) };
}

/// One launch of a [`HostKernel`]: its arguments and iteration space, sizes in
/// OpenCL dimension order (dimension 0 fastest; Gantry's [`Geometry`] is the other
/// way round: [`HostLaunch::from_geometry`] converts).
#[derive(Clone, Copy, Debug)]
pub struct HostLaunch<'a> {
    /// One pointer per global argument, in signature order.
    pub globals: &'a [*mut u8],
    /// The scalar block, laid out by [`Signature::scalar_offset`].
    pub scalars: &'a [u8],
    /// One pointer per local slot of the signature, in order: the work-group's
    /// region (reused by each group the call runs, cleared per group where the slot
    /// is `zeroed`).
    pub locals: &'a [*mut u8],
    /// Work-items per dimension.
    pub global_size: [usize; 3],
    /// Work-items per work-group per dimension; a size it does not divide gets a
    /// smaller last group (OpenCL 2.0 non-uniform groups: `get_local_size` is the
    /// group's own size there, `get_enqueued_local_size` this one).
    pub local_size: [usize; 3],
    /// Added to every global id.
    pub offset: [usize; 3],
    /// `get_work_dim()`.
    pub work_dim: u32,
}

impl<'a> HostLaunch<'a> {
    /// A launch with no offset, of as many dimensions as `global_size` has before
    /// its trailing 1s.
    pub fn new(
        globals: &'a [*mut u8],
        scalars: &'a [u8],
        locals: &'a [*mut u8],
        global_size: [usize; 3],
        local_size: [usize; 3],
    ) -> Self {
        let work_dim = 3 - global_size.iter().rev().take_while(|&&s| s == 1).count().min(2);
        Self { globals, scalars, locals, global_size, local_size, offset: [0; 3], work_dim: work_dim as u32 }
    }

    /// The launch of a Gantry [`Geometry`]: its last (fastest) dimension becomes
    /// OpenCL dimension 0.
    pub fn from_geometry(
        geometry: &Geometry,
        globals: &'a [*mut u8],
        scalars: &'a [u8],
        locals: &'a [*mut u8],
    ) -> Self {
        let d = geometry.dims();
        let flip = |v: [usize; 3]| {
            let mut out = [1usize; 3];
            for i in 0..d {
                out[i] = v[d - 1 - i];
            }
            out
        };
        let mut offset = flip(geometry.offset());
        offset[d..].fill(0);
        Self {
            globals,
            scalars,
            locals,
            global_size: flip(geometry.global_range()),
            local_size: flip(geometry.local_range()),
            offset,
            work_dim: d as u32,
        }
    }

    /// The same launch with a global offset.
    pub fn with_offset(mut self, offset: [usize; 3]) -> Self {
        self.offset = offset;
        self
    }

    /// Work-groups per dimension.
    pub fn groups(&self) -> [usize; 3] {
        [0, 1, 2].map(|d| self.global_size[d].div_ceil(self.local_size[d].max(1)))
    }

    /// Work-groups in all.
    pub fn group_count(&self) -> usize {
        self.groups().iter().product()
    }
}
