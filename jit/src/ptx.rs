//! PTX: an IR kernel compiled for NVIDIA GPUs (`nvptx64-nvidia-cuda`), with the
//! parameter convention of Gantry's CUDA driver.
//!
//! The PTX entry is named as the image's entry and takes, in order:
//!
//! 1. one device pointer (`.u64`) per global argument, in signature order;
//! 2. each scalar of the signature by value, in order, as its IR type;
//! 3. hidden parameters: the global size as three `.u64` in OpenCL order
//!    (dimension 0 = CUDA `x` first), then `get_work_dim()` as a `.u32`.
//!
//! There is no global offset (the CUDA driver refuses one): `get_global_offset` is
//! 0. Built-ins read CUDA's special registers, OpenCL dimension `d` = CUDA axis `d`
//! (`x`, `y`, `z`): `get_local_id` = `%tid`, `get_group_id` = `%ctaid`,
//! `get_local_size` and `get_enqueued_local_size` = `%ntid`, `get_num_groups` =
//! `%nctaid`, `get_global_id` = `%ctaid * %ntid + %tid`, `get_global_size` = the
//! hidden sizes. Barriers are `bar.sync 0`.
//!
//! **Overhang**: a plain range's last block may run past the range's end. A kernel
//! *without* barriers is guarded: a work-item whose global id is outside the
//! global size in any dimension returns at once. A kernel *with* barriers is not
//! guarded, since work-items leaving early would leave the others waiting at the
//! barrier: launch it over an ND-range (whose blocks divide the range) or let it
//! check `get_global_size` itself.
//!
//! **Local memory**: the signature's local slots are consecutive regions of the
//! block's dynamic shared memory (`extern __shared__`, symbol `gantry_shared`), as
//! the DPC++ architecture design lowers local accessors for CUDA; each slot starts
//! at a multiple of [`LOCAL_ALIGN`] bytes. A launch reserves
//! [`shared_bytes`] of dynamic shared memory (more than the sum of the slots when
//! a slot's size is not a multiple of the alignment). It is not cleared.
//!
//! ```no_run
//! use gantry_driver::{AccessMode, Signature};
//! let image = gantry_jit::from_opencl_c(
//!     "kernel void twice(global float* a) { size_t i = get_global_id(0); a[i] *= 2.0f; }",
//!     "twice",
//! )?;
//! let sig = Signature::new().global(AccessMode::ReadWrite);
//! let ptx = gantry_jit::PtxCompiler::new().compile(&image, &sig)?;
//! std::fs::write("twice.ptx", &ptx.ptx).unwrap();
//! # Ok::<(), gantry_jit::JitError>(())
//! ```

use std::sync::Arc;

use gantry_driver::{CodeImage, ScratchKind, Signature};
use inkwell::attributes::AttributeLoc;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::FileType;
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum};
use inkwell::values::{BasicValueEnum, IntValue};
use inkwell::{AddressSpace, IntPredicate};

use crate::builtins::{classify, Call, WorkItem};
use crate::cache::{CacheKey, CompileCache};
use crate::error::{codegen, JitError};
use crate::prepare::prepare;
use crate::raw;
use crate::signature::Binding;
use crate::target::nvptx_machine;
use crate::timings::{Clock, CompileTimings};
use crate::transplant::{replace_work_items, select_dimension, transplant, Site};

/// The PTX_Kernel calling convention.
const PTX_KERNEL: u32 = 71;

/// The alignment of each local slot in shared memory.
pub const LOCAL_ALIGN: usize = 16;

/// The byte offset of each local slot of `signature` in dynamic shared memory.
pub fn local_offsets(signature: &Signature) -> Vec<usize> {
    let mut at = 0usize;
    let mut out = Vec::new();
    for s in signature.memory.iter().filter(|s| s.kind == ScratchKind::Local) {
        at = at.next_multiple_of(LOCAL_ALIGN);
        out.push(at);
        at = at.saturating_add(s.bytes);
    }
    out
}

/// The dynamic shared memory a launch of a kernel with `signature` needs.
pub fn shared_bytes(signature: &Signature) -> usize {
    let mut locals = signature.memory.iter().filter(|s| s.kind == ScratchKind::Local);
    match (local_offsets(signature).last(), locals.next_back()) {
        (Some(at), Some(last)) => at.saturating_add(last.bytes),
        _ => 0,
    }
}

/// Compiles LLVM IR kernels to PTX, keeping each result in a [`CompileCache`].
#[derive(Debug)]
pub struct PtxCompiler {
    cpu: String,
    features: String,
    cache: CompileCache<PtxKernel>,
}

impl Default for PtxCompiler {
    fn default() -> Self {
        Self::new()
    }
}

impl PtxCompiler {
    /// A compiler for `sm_90` with PTX ISA 8.0.
    pub fn new() -> Self {
        Self::for_target("sm_90", "+ptx80")
    }

    /// A compiler for GPU architecture `cpu` (`sm_80`, ...) with LLVM NVPTX
    /// `features` (`+ptx80`, ...).
    pub fn for_target(cpu: &str, features: &str) -> Self {
        Self { cpu: cpu.into(), features: features.into(), cache: CompileCache::default() }
    }

    /// The PTX for `image` with `signature`: from the cache, or compiled now.
    pub fn compile(&self, image: &CodeImage, signature: &Signature) -> Result<Arc<PtxKernel>, JitError> {
        let key = CacheKey::new(image, signature, format!("nvptx64 {} {}", self.cpu, self.features));
        self.cache.get_or_compile(key, || self.compile_uncached(image, signature))
    }

    /// Its cache (for its counters).
    pub fn cache(&self) -> &CompileCache<PtxKernel> {
        &self.cache
    }

    fn compile_uncached(&self, image: &CodeImage, signature: &Signature) -> Result<PtxKernel, JitError> {
        let mut clock = Clock::start();
        let mut timings = CompileTimings::default();
        let machine = nvptx_machine(&self.cpu, &self.features)?;
        let context = Context::create();
        crate::ir::parse_image(&context, image)?;
        timings.parse = clock.lap();
        let prepared = prepare(&context, image, signature, &machine)?;
        let builder = context.create_builder();
        let guarded = prepared.barriers == 0;
        let params = entry(&context, &builder, &prepared, signature, image.entry())?;
        prepared.module.verify().map_err(|e| codegen(format!("the generated PTX entry is invalid: {e}")))?;
        timings.transform = clock.lap();
        prepared
            .module
            .run_passes("default<O3>", &machine, PassBuilderOptions::create())
            .map_err(|e| codegen(format!("optimizing: {}", raw::text(&e))))?;
        timings.optimize = clock.lap();
        let buffer = machine
            .write_to_memory_buffer(&prepared.module, FileType::Assembly)
            .map_err(|e| codegen(format!("emitting PTX: {e}")))?;
        let ptx = String::from_utf8_lossy(buffer.as_slice()).into_owned();
        timings.codegen = clock.lap();
        Ok(PtxKernel {
            ptx,
            entry: image.entry().into(),
            params,
            shared_bytes: shared_bytes(signature),
            guarded,
            timings,
        })
    }
}

/// A kernel compiled to PTX.
#[derive(Clone, Debug)]
pub struct PtxKernel {
    /// The PTX module's text.
    pub ptx: String,
    /// The entry's name (the image's).
    pub entry: String,
    /// The entry's parameter count, hidden ones included.
    pub params: usize,
    /// The dynamic shared memory a launch needs.
    pub shared_bytes: usize,
    /// Whether work-items past the global size return at once (kernels without
    /// barriers).
    pub guarded: bool,
    /// Where its compilation's time went.
    pub timings: CompileTimings,
}

/// Builds the PTX entry around the prepared kernel; returns its parameter count.
fn entry<'ctx>(
    context: &'ctx Context,
    builder: &Builder<'ctx>,
    prepared: &crate::prepare::Prepared<'ctx>,
    signature: &Signature,
    name: &str,
) -> Result<usize, JitError> {
    let e = codegen;
    let module = &prepared.module;
    let kernel = prepared.kernel;
    kernel.as_global_value().set_name(&format!("{name}.body"));
    let i64t = context.i64_type();
    let i32t = context.i32_type();
    let global_ptr = context.ptr_type(AddressSpace::from(1u16));
    let kernel_params: Vec<BasicValueEnum> = kernel.get_param_iter().collect();
    let scalar_types: Vec<BasicTypeEnum> = prepared
        .bindings
        .iter()
        .zip(&kernel_params)
        .filter(|(b, _)| matches!(b, Binding::Scalar { .. }))
        .map(|(_, p)| p.get_type())
        .collect();
    for (b, p) in prepared.bindings.iter().zip(&kernel_params) {
        if let (Binding::Global(_), BasicTypeEnum::PointerType(t)) = (b, p.get_type()) {
            if raw::address_space(t) != 1 {
                return Err(JitError::Unsupported {
                    function: raw::name(kernel),
                    what: "a __constant pointer parameter in PTX (pass it as __global const)".into(),
                });
            }
        }
    }
    let mut types: Vec<BasicMetadataTypeEnum> = vec![global_ptr.into(); signature.globals.len()];
    types.extend(scalar_types.iter().map(|t| BasicMetadataTypeEnum::from(*t)));
    types.extend::<[BasicMetadataTypeEnum; 4]>([i64t.into(), i64t.into(), i64t.into(), i32t.into()]);
    let f = module.add_function(name, context.void_type().fn_type(&types, false), Some(Linkage::External));
    f.set_call_conventions(PTX_KERNEL);
    let nglobals = signature.globals.len();
    let nscalars = scalar_types.len();
    let hidden = |i: usize| f.get_nth_param((nglobals + nscalars + i) as u32).unwrap().into_int_value();
    let gsize = [hidden(0), hidden(1), hidden(2)];
    let work_dim = hidden(3);

    let shared =
        module.add_global(context.i8_type().array_type(0), Some(AddressSpace::from(3u16)), "gantry_shared");
    shared.set_linkage(Linkage::External);
    shared.set_alignment(LOCAL_ALIGN as u32);
    let offsets = local_offsets(signature);

    let entry = context.append_basic_block(f, "entry");
    builder.position_at_end(entry);
    let mut args = Vec::new();
    let mut s = 0;
    for b in &prepared.bindings {
        args.push(match *b {
            Binding::Global(i) => f.get_nth_param(i as u32).unwrap(),
            Binding::Scalar { .. } => {
                s += 1;
                f.get_nth_param((nglobals + s - 1) as u32).unwrap()
            }
            Binding::Local { slot, .. } => unsafe {
                builder
                    .build_in_bounds_gep(
                        context.i8_type(),
                        shared.as_pointer_value(),
                        &[i64t.const_int(offsets[slot] as u64, false)],
                        "",
                    )
                    .map_err(e)?
                    .into()
            },
        });
    }
    let sreg = Sregs { module, context };
    let body_block = context.append_basic_block(f, "guarded");
    if prepared.barriers == 0 {
        let out = context.append_basic_block(f, "overhang");
        let mut outside = context.bool_type().const_zero();
        for (d, size) in gsize.iter().enumerate() {
            let id = sreg.global_id(builder, d)?;
            let past = builder.build_int_compare(IntPredicate::UGE, id, *size, "").map_err(e)?;
            outside = builder.build_or(outside, past, "").map_err(e)?;
        }
        builder.build_conditional_branch(outside, out, body_block).map_err(e)?;
        builder.position_at_end(out);
        builder.build_return(None).map_err(e)?;
    } else {
        builder.build_unconditional_branch(body_block).map_err(e)?;
    }
    let body = transplant(kernel, f, &args);
    builder.position_at_end(body_block);
    builder.build_unconditional_branch(body.blocks[0]).map_err(e)?;
    // Private variables: in the entry's frame (allocas elsewhere would be dynamic).
    let first = entry.get_first_instruction().unwrap();
    for &a in &body.allocas {
        a.remove_from_basic_block();
        builder.position_before(&first);
        builder.insert_instruction(&a, None);
    }
    replace_work_items(&body, builder, |b, site| sreg.value(b, site, gsize, work_dim))?;
    let barrier = module.add_function("llvm.nvvm.barrier0", context.void_type().fn_type(&[], false), None);
    for call in raw::instructions_of(&body.blocks) {
        if raw::callee_name(call).is_some_and(|n| classify(&n) == Call::Barrier) {
            builder.position_before(&call);
            builder.build_call(barrier, &[], "").map_err(e)?;
            call.erase_from_basic_block();
        }
    }
    let nounwind = inkwell::attributes::Attribute::get_named_enum_kind_id("nounwind");
    f.add_attribute(AttributeLoc::Function, context.create_enum_attribute(nounwind, 0));
    Ok(types.len())
}

/// CUDA's special registers.
struct Sregs<'a, 'ctx> {
    module: &'a Module<'ctx>,
    context: &'ctx Context,
}

impl<'ctx> Sregs<'_, 'ctx> {
    /// `%<reg>.<axis>` as a 64-bit value.
    fn read(&self, b: &Builder<'ctx>, reg: &str, d: usize) -> Result<IntValue<'ctx>, JitError> {
        let name = format!("llvm.nvvm.read.ptx.sreg.{reg}.{}", ["x", "y", "z"][d]);
        let i32t = self.context.i32_type();
        let f = self
            .module
            .get_function(&name)
            .unwrap_or_else(|| self.module.add_function(&name, i32t.fn_type(&[], false), None));
        let v = b.build_call(f, &[], "").map_err(codegen)?.try_as_basic_value().basic();
        let v = v.ok_or_else(|| codegen("a special register read has no value"))?.into_int_value();
        b.build_int_z_extend(v, self.context.i64_type(), "").map_err(codegen)
    }

    fn global_id(&self, b: &Builder<'ctx>, d: usize) -> Result<IntValue<'ctx>, JitError> {
        let group = self.read(b, "ctaid", d)?;
        let size = self.read(b, "ntid", d)?;
        let local = self.read(b, "tid", d)?;
        let v = b.build_int_mul(group, size, "").map_err(codegen)?;
        b.build_int_add(v, local, "").map_err(codegen)
    }

    fn value(
        &self,
        b: &Builder<'ctx>,
        site: &Site<'ctx>,
        gsize: [IntValue<'ctx>; 3],
        work_dim: IntValue<'ctx>,
    ) -> Result<BasicValueEnum<'ctx>, JitError> {
        let e = codegen;
        let i64t = self.context.i64_type();
        let ret = site.call.get_type().into_int_type();
        let per_dim = |d: usize| -> Result<IntValue<'ctx>, JitError> {
            match site.item {
                WorkItem::GlobalId => self.global_id(b, d),
                WorkItem::LocalId => self.read(b, "tid", d),
                WorkItem::GroupId => self.read(b, "ctaid", d),
                WorkItem::LocalSize | WorkItem::EnqueuedLocalSize => self.read(b, "ntid", d),
                WorkItem::NumGroups => self.read(b, "nctaid", d),
                WorkItem::GlobalSize => Ok(gsize[d]),
                _ => Ok(i64t.const_zero()),
            }
        };
        let v = match site.item {
            WorkItem::WorkDim => work_dim,
            WorkItem::GlobalLinearId => {
                let v = b.build_int_mul(self.global_id(b, 2)?, gsize[1], "").map_err(e)?;
                let v = b.build_int_add(v, self.global_id(b, 1)?, "").map_err(e)?;
                let v = b.build_int_mul(v, gsize[0], "").map_err(e)?;
                b.build_int_add(v, self.global_id(b, 0)?, "").map_err(e)?
            }
            WorkItem::LocalLinearId => {
                let v = b.build_int_mul(self.read(b, "tid", 2)?, self.read(b, "ntid", 1)?, "").map_err(e)?;
                let v = b.build_int_add(v, self.read(b, "tid", 1)?, "").map_err(e)?;
                let v = b.build_int_mul(v, self.read(b, "ntid", 0)?, "").map_err(e)?;
                b.build_int_add(v, self.read(b, "tid", 0)?, "").map_err(e)?
            }
            item => {
                let outside = i64t.const_int(item.is_size() as u64, false);
                match site.dim {
                    Some(d) if d < 3 => per_dim(d as usize)?,
                    Some(_) => outside,
                    None => select_dimension(b, site.call, outside, per_dim)?,
                }
            }
        };
        Ok(b.build_int_cast(v, ret, "").map_err(e)?.into())
    }
}
