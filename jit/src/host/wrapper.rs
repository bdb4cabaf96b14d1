//! The work-group function: the kernel body inside loops over a range of groups
//! and over each group's work-items.
//!
//! ```text
//! void gantry.work_groups(const RawLaunch* launch, u64 first_group, u64 groups)
//!   for g in first_group .. first_group + groups        (linear, dimension 0 fastest)
//!     clear the zeroed local slots
//!     state = 0                                         (kernels with barriers)
//!     loop:
//!       for z, y, x over this group's work-items        (x = dimension 0, innermost)
//!         run region `state` of the kernel body for work-item (x, y, z)
//!       state = the barrier the work-items stopped at; exit the loop at the end
//! ```
//!
//! Built-ins become the loop counters and the launch's sizes. A kernel without
//! barriers has one region and no state: its body is the innermost loop's body, so
//! LLVM's loop vectorizer sees consecutive work-items as consecutive iterations.
//! In a kernel with barriers ([`crate::barrier`]), every stack slot (the kernel's
//! private variables and the values `reg2mem` demoted) lives in a per-work-item
//! context record: work-item `i` of the group uses bytes
//! `[i * ctx_bytes, (i + 1) * ctx_bytes)` of the context area the launch passes.

use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::types::{BasicTypeEnum, StructType};
use inkwell::values::{BasicValue, BasicValueEnum, IntValue, PointerValue};
use inkwell::{AddressSpace, IntPredicate};

use crate::barrier::Cut;
use crate::builtins::WorkItem;
use crate::error::{codegen, JitError};
use crate::prepare::Prepared;
use crate::raw;
use crate::signature::Binding;
use crate::transplant::{replace_work_items, select_dimension, transplant, Site};

/// The generated function's name.
pub(crate) const ENTRY: &str = "gantry.work_groups";

/// The launch record the generated function reads (its layout is the LLVM struct
/// [`launch_type`] builds). Sizes are in OpenCL dimension order.
#[repr(C)]
pub(crate) struct RawLaunch {
    pub globals: *const *mut u8,
    pub scalars: *const u8,
    pub locals: *const *mut u8,
    pub ctx: *mut u8,
    pub global: [u64; 3],
    pub local: [u64; 3],
    pub offset: [u64; 3],
    pub groups: [u64; 3],
    pub work_dim: u32,
}

/// Field indexes of [`RawLaunch`].
const GLOBALS: u32 = 0;
const SCALARS: u32 = 1;
const LOCALS: u32 = 2;
const CTX: u32 = 3;
const GLOBAL: u32 = 4;
const LOCAL: u32 = 5;
const OFFSET: u32 = 6;
const GROUPS: u32 = 7;
const WORK_DIM: u32 = 8;

/// The state a region ends in when the work-item returns.
const EXIT: u64 = u32::MAX as u64;

/// The most alignment a context slot may ask for: the context area's alignment.
pub(crate) const CTX_ALIGN: usize = 64;

fn launch_type(context: &Context) -> StructType<'_> {
    let ptr = context.ptr_type(AddressSpace::default()).into();
    let arr: BasicTypeEnum = context.i64_type().array_type(3).into();
    context.struct_type(&[ptr, ptr, ptr, ptr, arr, arr, arr, arr, context.i32_type().into()], false)
}

/// Builds the work-group function around `prepared`'s kernel, cut at `cuts` (empty
/// for a kernel without barriers). Returns the bytes of one work-item's context
/// record (0 without barriers).
pub(crate) fn build<'ctx>(
    context: &'ctx Context,
    builder: &Builder<'ctx>,
    prepared: &Prepared<'ctx>,
    cuts: &[Cut<'ctx>],
) -> Result<usize, JitError> {
    let e = codegen;
    let module = &prepared.module;
    let i64t = context.i64_type();
    let i32t = context.i32_type();
    let i8t = context.i8_type();
    let ptr = context.ptr_type(AddressSpace::default());
    let launch_ty = launch_type(context);
    let f = module.add_function(
        ENTRY,
        context.void_type().fn_type(&[ptr.into(), i64t.into(), i64t.into()], false),
        None,
    );
    let block = |name| context.append_basic_block(f, name);
    let entry = block("entry");
    let group_head = block("group.head");
    let state_head = block("state.head");
    let z_head = block("z.head");
    let y_head = block("y.head");
    let x_head = block("x.head");
    let dispatch = block("dispatch");
    let x_latch = block("x.latch");
    let y_latch = block("y.latch");
    let z_latch = block("z.latch");
    let state_check = block("state.check");
    let group_latch = block("group.latch");
    let exit = block("exit");
    let barriers = !cuts.is_empty();

    // entry: the launch's fields, the kernel's arguments.
    builder.position_at_end(entry);
    let launch = f.get_nth_param(0).unwrap().into_pointer_value();
    let (first, count) =
        (f.get_nth_param(1).unwrap().into_int_value(), f.get_nth_param(2).unwrap().into_int_value());
    let field = |index: u32| -> Result<PointerValue<'ctx>, JitError> {
        builder.build_struct_gep(launch_ty, launch, index, "").map_err(e)
    };
    let load_ptr = |index: u32| -> Result<PointerValue<'ctx>, JitError> {
        Ok(builder.build_load(ptr, field(index)?, "").map_err(e)?.into_pointer_value())
    };
    let triple = |index: u32| -> Result<[IntValue<'ctx>; 3], JitError> {
        let mut out = [i64t.const_zero(); 3];
        for (d, v) in out.iter_mut().enumerate() {
            let p = unsafe {
                builder.build_in_bounds_gep(
                    launch_ty,
                    launch,
                    &[
                        i32t.const_zero(),
                        i32t.const_int(index as u64, false),
                        i32t.const_int(d as u64, false),
                    ],
                    "",
                )
            }
            .map_err(e)?;
            *v = builder.build_load(i64t, p, "").map_err(e)?.into_int_value();
        }
        Ok(out)
    };
    let globals = load_ptr(GLOBALS)?;
    let scalars = load_ptr(SCALARS)?;
    let locals = load_ptr(LOCALS)?;
    let ctx_base = load_ptr(CTX)?;
    let gsize = triple(GLOBAL)?;
    let lsize = triple(LOCAL)?;
    let offset = triple(OFFSET)?;
    let ngroups = triple(GROUPS)?;
    let work_dim = builder.build_load(i32t, field(WORK_DIM)?, "").map_err(e)?.into_int_value();
    let kernel = prepared.kernel;
    let mut args: Vec<BasicValueEnum> = Vec::new();
    let mut zeroed_locals = Vec::new();
    for (binding, param) in prepared.bindings.iter().zip(kernel.get_param_iter()) {
        let ty = param.get_type();
        let (base, index, elem) = match *binding {
            Binding::Global(i) => (globals, i, ptr),
            Binding::Local { slot, .. } => (locals, slot, ptr),
            Binding::Scalar { offset, .. } => (scalars, offset, ptr),
        };
        let at = match binding {
            Binding::Scalar { .. } => unsafe {
                builder.build_in_bounds_gep(i8t, base, &[i64t.const_int(index as u64, false)], "")
            },
            _ => unsafe {
                builder.build_in_bounds_gep(elem, base, &[i64t.const_int(index as u64, false)], "")
            },
        }
        .map_err(e)?;
        let v = builder.build_load(ty, at, "").map_err(e)?;
        if let Binding::Scalar { align, .. } = *binding {
            v.as_instruction_value().unwrap().set_alignment(align.max(1)).map_err(codegen)?;
        }
        if let Binding::Local { bytes, zeroed: true, .. } = *binding {
            if bytes > 0 {
                zeroed_locals.push((v.into_pointer_value(), bytes));
            }
        }
        args.push(v);
    }
    let next = if barriers { Some(builder.build_alloca(i32t, "next").map_err(e)?) } else { None };
    let end = builder.build_int_add(first, count, "end").map_err(e)?;
    let empty = builder.build_int_compare(IntPredicate::EQ, count, i64t.const_zero(), "").map_err(e)?;
    builder.build_conditional_branch(empty, exit, group_head).map_err(e)?;

    // group.head: this group's id and extent; its local memory cleared.
    builder.position_at_end(group_head);
    let g = builder.build_phi(i64t, "g").map_err(e)?;
    let gv = g.as_basic_value().into_int_value();
    let gid0 = builder.build_int_unsigned_rem(gv, ngroups[0], "").map_err(e)?;
    let t = builder.build_int_unsigned_div(gv, ngroups[0], "").map_err(e)?;
    let gid1 = builder.build_int_unsigned_rem(t, ngroups[1], "").map_err(e)?;
    let gid2 = builder.build_int_unsigned_div(t, ngroups[1], "").map_err(e)?;
    let gid = [gid0, gid1, gid2];
    let mut base = [i64t.const_zero(); 3];
    let mut extent = [i64t.const_zero(); 3];
    for d in 0..3 {
        base[d] = builder.build_int_mul(gid[d], lsize[d], "").map_err(e)?;
        let left = builder.build_int_sub(gsize[d], base[d], "").map_err(e)?;
        let short = builder.build_int_compare(IntPredicate::ULT, left, lsize[d], "").map_err(e)?;
        extent[d] = builder.build_select(short, left, lsize[d], "").map_err(e)?.into_int_value();
    }
    for &(p, bytes) in &zeroed_locals {
        builder.build_memset(p, 1, i8t.const_zero(), i64t.const_int(bytes as u64, false)).map_err(e)?;
    }
    builder.build_unconditional_branch(state_head).map_err(e)?;

    builder.position_at_end(state_head);
    let state = builder.build_phi(i32t, "state").map_err(e)?;
    builder.build_unconditional_branch(z_head).map_err(e)?;
    let mut counters = Vec::new();
    for (head, inner) in [(z_head, y_head), (y_head, x_head), (x_head, dispatch)] {
        builder.position_at_end(head);
        let phi = builder.build_phi(i64t, "").map_err(e)?;
        phi.add_incoming(&[(
            &i64t.const_zero(),
            if head == z_head {
                state_head
            } else if head == y_head {
                z_head
            } else {
                y_head
            },
        )]);
        builder.build_unconditional_branch(inner).map_err(e)?;
        counters.push(phi);
    }
    let lid = [
        counters[2].as_basic_value().into_int_value(),
        counters[1].as_basic_value().into_int_value(),
        counters[0].as_basic_value().into_int_value(),
    ];

    // The kernel body.
    let body = transplant(kernel, f, &args);
    let wd = work_dim;
    let values = Values { gid, base, extent, lsize, gsize, ngroups, offset, lid, work_dim: wd };
    replace_work_items(&body, builder, |b, site| values.of(b, site))?;

    // dispatch: the context record, the region to run.
    builder.position_at_end(dispatch);
    let mut ctx_bytes = 0usize;
    if barriers {
        let td = inkwell::targets::TargetData::create(&raw::text(module.get_data_layout().as_str()));
        let mut slots = Vec::new();
        for &a in &body.allocas {
            let ty = a.get_allocated_type().map_err(codegen)?;
            let n = raw::alloca_count(a).unwrap_or(1);
            let size = td.get_abi_size(&ty) as usize * n as usize;
            let align = (a.get_alignment().map_err(codegen)? as usize).max(1);
            if align > CTX_ALIGN {
                return Err(JitError::Unsupported {
                    function: raw::name(f),
                    what: format!("a private variable aligned to {align} bytes"),
                });
            }
            ctx_bytes = ctx_bytes.next_multiple_of(align);
            slots.push((a, ctx_bytes));
            ctx_bytes += size;
        }
        ctx_bytes = ctx_bytes.next_multiple_of(16);
        let row = builder.build_int_mul(lid[2], lsize[1], "").map_err(e)?;
        let row = builder.build_int_add(row, lid[1], "").map_err(e)?;
        let idx = builder.build_int_mul(row, lsize[0], "").map_err(e)?;
        let idx = builder.build_int_add(idx, lid[0], "").map_err(e)?;
        let at = builder.build_int_mul(idx, i64t.const_int(ctx_bytes as u64, false), "").map_err(e)?;
        let item = unsafe { builder.build_in_bounds_gep(i8t, ctx_base, &[at], "item") }.map_err(e)?;
        // Lifetime markers describe a stack slot within one call; a context slot
        // lives across regions, so its markers would let LLVM drop values that
        // cross a barrier.
        for call in raw::instructions_of(&body.blocks) {
            if raw::callee_name(call).is_some_and(|n| n.starts_with("llvm.lifetime.")) {
                call.erase_from_basic_block();
            }
        }
        for (a, off) in slots {
            let p =
                unsafe { builder.build_in_bounds_gep(i8t, item, &[i64t.const_int(off as u64, false)], "") }
                    .map_err(e)?;
            raw::replace_uses(a, p);
            a.erase_from_basic_block();
        }
        let cases: Vec<_> =
            cuts.iter().enumerate().map(|(k, c)| (i32t.const_int(k as u64 + 1, false), c.after)).collect();
        builder.build_switch(state.as_basic_value().into_int_value(), body.blocks[0], &cases).map_err(e)?;
        for (k, cut) in cuts.iter().enumerate() {
            cut.before.get_terminator().unwrap().erase_from_basic_block();
            builder.position_at_end(cut.before);
            builder.build_store(next.unwrap(), i32t.const_int(k as u64 + 1, false)).map_err(e)?;
            builder.build_unconditional_branch(x_latch).map_err(e)?;
        }
    } else {
        // Private variables: one per work-item at a time, in the function's frame.
        let first_inst = entry.get_first_instruction().unwrap();
        for &a in &body.allocas {
            a.remove_from_basic_block();
            builder.position_before(&first_inst);
            builder.insert_instruction(&a, None);
        }
        builder.position_at_end(dispatch);
        builder.build_unconditional_branch(body.blocks[0]).map_err(e)?;
    }
    for &r in &body.returns {
        let block = r.get_parent().unwrap();
        r.erase_from_basic_block();
        builder.position_at_end(block);
        if let Some(next) = next {
            builder.build_store(next, i32t.const_int(EXIT, false)).map_err(e)?;
        }
        builder.build_unconditional_branch(x_latch).map_err(e)?;
    }

    // The latches: x, y, z over the group's extent, then the next state or group.
    let one = i64t.const_int(1, false);
    let mut latch_from =
        [(x_latch, x_head, y_latch), (y_latch, y_head, z_latch), (z_latch, z_head, state_check)];
    for (i, (latch, head, out)) in latch_from.iter_mut().enumerate() {
        builder.position_at_end(*latch);
        let counter = counters[2 - i];
        let v = builder.build_int_add(counter.as_basic_value().into_int_value(), one, "").map_err(e)?;
        counter.add_incoming(&[(&v, *latch)]);
        let more = builder.build_int_compare(IntPredicate::ULT, v, extent[i], "").map_err(e)?;
        builder.build_conditional_branch(more, *head, *out).map_err(e)?;
    }
    builder.position_at_end(state_check);
    match next {
        Some(next) => {
            let n = builder.build_load(i32t, next, "").map_err(e)?.into_int_value();
            let done =
                builder.build_int_compare(IntPredicate::EQ, n, i32t.const_int(EXIT, false), "").map_err(e)?;
            builder.build_conditional_branch(done, group_latch, state_head).map_err(e)?;
            state.add_incoming(&[(&i32t.const_zero(), group_head), (&n, state_check)]);
        }
        None => {
            builder.build_unconditional_branch(group_latch).map_err(e)?;
            state.add_incoming(&[(&i32t.const_zero(), group_head)]);
        }
    }
    builder.position_at_end(group_latch);
    let g1 = builder.build_int_add(gv, one, "").map_err(e)?;
    g.add_incoming(&[(&first, entry), (&g1, group_latch)]);
    let more = builder.build_int_compare(IntPredicate::ULT, g1, end, "").map_err(e)?;
    builder.build_conditional_branch(more, group_head, exit).map_err(e)?;
    builder.position_at_end(exit);
    builder.build_return(None).map_err(e)?;
    Ok(ctx_bytes)
}

/// The values the built-ins read inside the work-item loops.
struct Values<'ctx> {
    gid: [IntValue<'ctx>; 3],
    base: [IntValue<'ctx>; 3],
    extent: [IntValue<'ctx>; 3],
    lsize: [IntValue<'ctx>; 3],
    gsize: [IntValue<'ctx>; 3],
    ngroups: [IntValue<'ctx>; 3],
    offset: [IntValue<'ctx>; 3],
    lid: [IntValue<'ctx>; 3],
    work_dim: IntValue<'ctx>,
}

impl<'ctx> Values<'ctx> {
    fn of(&self, b: &Builder<'ctx>, site: &Site<'ctx>) -> Result<BasicValueEnum<'ctx>, JitError> {
        let e = codegen;
        let ret = site.call.get_type().into_int_type();
        let i64t = self.gid[0].get_type();
        let per_dim = |d: usize| -> Result<IntValue<'ctx>, JitError> {
            Ok(match site.item {
                WorkItem::GlobalId => {
                    let v = b.build_int_add(self.base[d], self.lid[d], "").map_err(e)?;
                    b.build_int_add(v, self.offset[d], "").map_err(e)?
                }
                WorkItem::LocalId => self.lid[d],
                WorkItem::GroupId => self.gid[d],
                WorkItem::LocalSize => self.extent[d],
                WorkItem::EnqueuedLocalSize => self.lsize[d],
                WorkItem::GlobalSize => self.gsize[d],
                WorkItem::NumGroups => self.ngroups[d],
                WorkItem::GlobalOffset => self.offset[d],
                _ => i64t.const_zero(),
            })
        };
        let v = match site.item {
            WorkItem::WorkDim => self.work_dim,
            WorkItem::GlobalLinearId => {
                let id = |d: usize| b.build_int_add(self.base[d], self.lid[d], "").map_err(e);
                let v = b.build_int_mul(id(2)?, self.gsize[1], "").map_err(e)?;
                let v = b.build_int_add(v, id(1)?, "").map_err(e)?;
                let v = b.build_int_mul(v, self.gsize[0], "").map_err(e)?;
                b.build_int_add(v, id(0)?, "").map_err(e)?
            }
            WorkItem::LocalLinearId => {
                let v = b.build_int_mul(self.lid[2], self.extent[1], "").map_err(e)?;
                let v = b.build_int_add(v, self.lid[1], "").map_err(e)?;
                let v = b.build_int_mul(v, self.extent[0], "").map_err(e)?;
                b.build_int_add(v, self.lid[0], "").map_err(e)?
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
