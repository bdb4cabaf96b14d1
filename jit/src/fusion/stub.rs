//! The stub kernel: the fused kernel's entry, calling each listed kernel in order
//! (the DPC++ kernel-fusion design, "Fusion Process": the stub into which the
//! kernels are inlined).
//!
//! Its parameters are one `ptr addrspace(1)` per fused argument, then one
//! `ptr addrspace(3)` per local slot of the fused signature (the local internal
//! buffers, then each kernel's own local slots in list order); it has no scalars.
//! For each kernel it passes:
//!
//! * a global slot kept in global memory: its fused argument plus the slot's byte
//!   offset in the argument's hull;
//! * an internalized slot: a null pointer (the kernel's accesses through it were
//!   rewritten to the internal buffer, [`super::internalize`]);
//! * a local slot: its stub parameter;
//! * a scalar: its value from the kernel's scalar block, as a constant.
//!
//! A remapped kernel is called only by work-items whose global linear id in the
//! grid is below its own global size. Where the stub has barriers, every
//! work-item calls it (the PTX compiler does not guard kernels with barriers
//! against a plain range's overhanging last block), so each kernel without
//! barriers of its own is also guarded by the grid's bounds. A work-group barrier
//! follows each kernel the layout says (where the request asks for barriers and
//! [`super::private_access`] could not prove one unneeded).

use gantry_driver::fusion::rules::{InternalGroup, SlotPlace};
use gantry_driver::fusion::Promotion;
use inkwell::attributes::AttributeLoc;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::targets::TargetData;
use inkwell::types::{BasicMetadataTypeEnum, BasicType, BasicTypeEnum};
use inkwell::values::{BasicMetadataValueEnum, BasicValueEnum, FunctionValue, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

use super::remap::Builtins;
use crate::error::{codegen, JitError};
use crate::raw;
use crate::signature::Binding;

/// The stub entry's name in the fused image.
pub(super) const STUB: &str = "gantry_fused";

/// `barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE)`.
const BARRIER: &str = "_Z7barrierj";
const BOTH_FENCES: u64 = 3;

/// One call of the stub.
pub(super) struct Part<'a, 'ctx> {
    /// The kernel's entry in the fused module.
    pub function: FunctionValue<'ctx>,
    /// Where its parameters come from under its signature.
    pub bindings: &'a [Binding],
    /// Where its global slots point.
    pub slots: &'a [SlotPlace],
    /// Its scalar block.
    pub scalars: &'a [u8],
    /// The stub's local parameter (counted among local parameters) of its first
    /// own local slot.
    pub first_local: usize,
    /// `Some(global size)` when remapped: work-items at or past it skip the call.
    pub remapped: Option<u64>,
    /// Whether it has barriers of its own (then it is never bounds-guarded).
    pub barriers: bool,
}

/// What the stub needs beyond its parts.
pub(super) struct Layout<'a> {
    /// Fused arguments.
    pub args: usize,
    /// Local parameters in all.
    pub locals: usize,
    /// The internal buffers.
    pub internal: &'a [InternalGroup],
    /// The grid's global size, OpenCL order.
    pub grid: [u64; 3],
    /// Per kernel, whether a barrier follows it (never after the last).
    pub barriers: &'a [bool],
}

/// Builds the stub in `module`; returns, per internal buffer, its base pointer in
/// the stub (a private buffer's per-work-item `alloca`, a local one's parameter).
pub(super) fn build<'ctx>(
    context: &'ctx Context,
    module: &Module<'ctx>,
    layout: &Layout,
    parts: &[Part<'_, 'ctx>],
) -> Result<Vec<PointerValue<'ctx>>, JitError> {
    let e = codegen;
    let global = context.ptr_type(AddressSpace::from(1u16));
    let local = context.ptr_type(AddressSpace::from(3u16));
    let mut params: Vec<BasicMetadataTypeEnum> = vec![global.into(); layout.args];
    params.extend(std::iter::repeat_n(BasicMetadataTypeEnum::from(local), layout.locals));
    let stub = module.add_function(STUB, context.void_type().fn_type(&params, false), None);
    let builder = context.create_builder();
    let b = &builder;
    let entry = context.append_basic_block(stub, "entry");
    b.position_at_end(entry);
    let (i8t, i64t) = (context.i8_type(), context.i64_type());
    let data = TargetData::create(&module.get_data_layout().as_str().to_string_lossy());

    // Internal buffers: private ones live in the stub's frame (one copy per
    // work-item), cleared so that nothing read before it is written depends on
    // what ran before; local ones are the first local parameters.
    let mut bases = Vec::with_capacity(layout.internal.len());
    let mut local_internal = 0;
    for g in layout.internal {
        bases.push(match g.kind {
            Promotion::Local => {
                local_internal += 1;
                stub.get_nth_param((layout.args + local_internal - 1) as u32).unwrap().into_pointer_value()
            }
            _ => {
                let array = i8t.array_type(g.bytes as u32);
                let a = b.build_alloca(array, "private.internal").map_err(e)?;
                a.as_instruction().unwrap().set_alignment(16).map_err(codegen)?;
                b.build_memset(a, 16, i8t.const_zero(), i64t.const_int(g.bytes as u64, false)).map_err(e)?;
                a
            }
        });
    }

    let builtins = Builtins { module, context };
    let stub_has_barriers = layout.barriers.iter().any(|&b| b) || parts.iter().any(|p| p.barriers);
    let in_grid = if stub_has_barriers && parts.iter().any(|p| !p.barriers) {
        let mut inside = context.bool_type().const_all_ones();
        for d in 0..3u64 {
            let id = builtins.call(b, "_Z13get_global_idj", d)?;
            let offset = builtins.call(b, "_Z17get_global_offsetj", d)?;
            let rel = b.build_int_sub(id, offset, "").map_err(e)?;
            let size = i64t.const_int(layout.grid[d as usize], false);
            let ok = b.build_int_compare(IntPredicate::ULT, rel, size, "").map_err(e)?;
            inside = b.build_and(inside, ok, "").map_err(e)?;
        }
        Some(inside)
    } else {
        None
    };
    let linear = if parts.iter().any(|p| p.remapped.is_some()) {
        Some(builtins.linear_id(b, layout.grid)?)
    } else {
        None
    };
    let barrier = module.get_function(BARRIER).unwrap_or_else(|| {
        module.add_function(BARRIER, context.void_type().fn_type(&[context.i32_type().into()], false), None)
    });
    // Convergent (as clang declares it): no pass may duplicate a barrier into
    // branches or move it across control flow.
    let convergent = inkwell::attributes::Attribute::get_named_enum_kind_id("convergent");
    barrier.add_attribute(AttributeLoc::Function, context.create_enum_attribute(convergent, 0));

    for (k, part) in parts.iter().enumerate() {
        let mut guard: Option<IntValue> = if part.barriers { None } else { in_grid };
        if let (Some(total), Some(glid)) = (part.remapped, linear) {
            let below =
                b.build_int_compare(IntPredicate::ULT, glid, i64t.const_int(total, false), "").map_err(e)?;
            guard = Some(match guard {
                Some(g) => b.build_and(g, below, "").map_err(e)?,
                None => below,
            });
        }
        let after = context.append_basic_block(stub, &format!("after.{k}"));
        if let Some(guard) = guard {
            let call = context.append_basic_block(stub, &format!("call.{k}"));
            b.build_conditional_branch(guard, call, after).map_err(e)?;
            b.position_at_end(call);
        }
        let args = arguments(context, b, &data, stub, layout, part)?;
        b.build_call(part.function, &args, "").map_err(e)?;
        b.build_unconditional_branch(after).map_err(e)?;
        b.position_at_end(after);
        if layout.barriers.get(k).copied().unwrap_or(false) && k + 1 < parts.len() {
            b.build_call(barrier, &[context.i32_type().const_int(BOTH_FENCES, false).into()], "")
                .map_err(e)?;
        }
    }
    b.build_return(None).map_err(e)?;
    Ok(bases)
}

/// The arguments of one kernel's call (see the module docs).
fn arguments<'ctx>(
    context: &'ctx Context,
    b: &Builder<'ctx>,
    data: &TargetData,
    stub: FunctionValue<'ctx>,
    layout: &Layout,
    part: &Part<'_, 'ctx>,
) -> Result<Vec<BasicMetadataValueEnum<'ctx>>, JitError> {
    let e = codegen;
    let i8t = context.i8_type();
    let i64t = context.i64_type();
    let mut out = Vec::with_capacity(part.bindings.len());
    for (param, binding) in part.function.get_param_iter().zip(part.bindings) {
        let ty = param.get_type();
        let value: BasicValueEnum = match *binding {
            Binding::Global(slot) => {
                let BasicTypeEnum::PointerType(pt) = ty else {
                    return Err(codegen("a global parameter that is not a pointer"));
                };
                match part.slots[slot] {
                    SlotPlace::Internal { .. } => pt.const_null().into(),
                    SlotPlace::Arg { index, offset, .. } => {
                        let arg = stub.get_nth_param(index).unwrap().into_pointer_value();
                        // SAFETY (of the in-bounds claim): the argument is the hull of
                        // the slot's range, which starts `offset` bytes in.
                        let at = unsafe {
                            b.build_in_bounds_gep(i8t, arg, &[i64t.const_int(offset as u64, false)], "")
                        }
                        .map_err(e)?;
                        if raw::address_space(pt) == 1 {
                            at.into()
                        } else {
                            b.build_address_space_cast(at, pt, "").map_err(e)?.into()
                        }
                    }
                }
            }
            Binding::Local { slot, .. } => {
                let index = layout.args + part.first_local + slot;
                stub.get_nth_param(index as u32).unwrap()
            }
            Binding::Scalar { offset, .. } => constant(context, b, data, ty, part.scalars, offset)?,
        };
        out.push(value.into());
    }
    Ok(out)
}

/// The scalar of type `ty` at `offset` of `block` (native byte order), as a value
/// LLVM folds to a constant.
fn constant<'ctx>(
    context: &'ctx Context,
    b: &Builder<'ctx>,
    data: &TargetData,
    ty: BasicTypeEnum<'ctx>,
    block: &[u8],
    offset: usize,
) -> Result<BasicValueEnum<'ctx>, JitError> {
    let size = data.get_store_size(&ty) as usize;
    let bits = data.get_bit_size(&ty) as u32;
    let bytes = block
        .get(offset..offset + size)
        .ok_or_else(|| codegen(format!("the scalar block ends before byte {}", offset + size)))?;
    let mut words = vec![0u64; size.div_ceil(8)];
    for (i, byte) in bytes.iter().enumerate() {
        let byte = if cfg!(target_endian = "little") { *byte } else { bytes[size - 1 - i] };
        words[i / 8] |= u64::from(byte) << (8 * (i % 8));
    }
    let int = |bits: u32| {
        std::num::NonZeroU32::new(bits)
            .ok_or("a zero-sized scalar")
            .and_then(|n| context.custom_width_int_type(n))
            .map_err(codegen)
    };
    let wide = int(size as u32 * 8)?.const_int_arbitrary_precision(&words);
    let exact = if bits == size as u32 * 8 {
        wide
    } else {
        b.build_int_truncate(wide, int(bits)?, "").map_err(codegen)?
    };
    match ty {
        BasicTypeEnum::IntType(t) if t.get_bit_width() == bits => Ok(exact.into()),
        BasicTypeEnum::FloatType(_) | BasicTypeEnum::VectorType(_) | BasicTypeEnum::IntType(_) => {
            b.build_bit_cast(exact, ty.as_basic_type_enum(), "").map_err(codegen)
        }
        other => Err(JitError::Unsupported {
            function: STUB.into(),
            what: format!("a scalar parameter of type {other} cannot be baked in as a constant"),
        }),
    }
}
