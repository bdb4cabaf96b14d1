//! Moving a flattened kernel's body into the function that runs it.
//!
//! Both compilers generate a function around the kernel (the host's work-group
//! loop, the PTX entry with its parameter convention) and move the kernel's blocks
//! into it rather than calling it: the built-ins then become values of the
//! surrounding function (loop counters, special registers, hidden parameters)
//! without threading them through a call.

use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::values::{BasicValueEnum, FunctionValue, InstructionOpcode, InstructionValue, IntValue};
use inkwell::IntPredicate;

use crate::builtins::{classify, Call, WorkItem};
use crate::error::{codegen, JitError};
use crate::raw;

/// A kernel body inside its new function.
pub(crate) struct Body<'ctx> {
    /// Its blocks, the entry first.
    pub blocks: Vec<BasicBlock<'ctx>>,
    /// Its `ret` instructions.
    pub returns: Vec<InstructionValue<'ctx>>,
    /// Its stack allocations.
    pub allocas: Vec<InstructionValue<'ctx>>,
}

/// Moves `kernel`'s blocks to the end of `into`, replaces each parameter `i` with
/// `args[i]` (values that dominate the body where it lands), and deletes `kernel`.
pub(crate) fn transplant<'ctx>(
    kernel: FunctionValue<'ctx>,
    into: FunctionValue<'ctx>,
    args: &[BasicValueEnum<'ctx>],
) -> Body<'ctx> {
    let blocks: Vec<_> = kernel.get_basic_block_iter().collect();
    for (param, arg) in kernel.get_param_iter().zip(args) {
        raw::replace_uses(param, *arg);
    }
    for &b in &blocks {
        raw::move_block(b, into);
    }
    raw::delete_function(kernel);
    let all = raw::instructions_of(&blocks);
    let of = |op| all.iter().copied().filter(|i| i.get_opcode() == op).collect();
    Body { returns: of(InstructionOpcode::Return), allocas: of(InstructionOpcode::Alloca), blocks }
}

/// A built-in call site: what it asks for and its dimension argument (`None` for a
/// non-constant dimension; `Some(0)` for functions without one).
pub(crate) struct Site<'ctx> {
    pub call: InstructionValue<'ctx>,
    pub item: WorkItem,
    pub dim: Option<u64>,
}

/// Replaces every work-item built-in call of `body` with what `value` builds for it
/// (the builder is placed before the call), and removes fences. `value` returns an
/// integer of the call's type.
pub(crate) fn replace_work_items<'ctx>(
    body: &Body<'ctx>,
    builder: &Builder<'ctx>,
    mut value: impl FnMut(&Builder<'ctx>, &Site<'ctx>) -> Result<BasicValueEnum<'ctx>, JitError>,
) -> Result<(), JitError> {
    for call in raw::instructions_of(&body.blocks) {
        let Some(name) = raw::callee_name(call) else { continue };
        match classify(&name) {
            Call::WorkItem(item) => {
                let dim = if item.has_dim() { raw::const_arg(call, 0) } else { Some(0) };
                builder.position_before(&call);
                let v = value(builder, &Site { call, item, dim })?;
                replace(call, v)?;
            }
            Call::Fence => call.erase_from_basic_block(),
            _ => {}
        }
    }
    Ok(())
}

/// The value of a per-dimension built-in `call` whose dimension argument is known
/// only at run time: `per_dim(d)` where it is `d` < 3, `outside` otherwise, chosen
/// by selects. Every compiler that lowers built-ins uses it for that case.
pub(crate) fn select_dimension<'ctx>(
    b: &Builder<'ctx>,
    call: InstructionValue<'ctx>,
    outside: IntValue<'ctx>,
    mut per_dim: impl FnMut(usize) -> Result<IntValue<'ctx>, JitError>,
) -> Result<IntValue<'ctx>, JitError> {
    let Some(inkwell::values::Operand::Value(dim)) = call.get_operand(0) else {
        return Err(codegen("a built-in call without its dimension"));
    };
    let dim = dim.into_int_value();
    let mut v = outside;
    for d in (0..3u64).rev() {
        let is = b
            .build_int_compare(IntPredicate::EQ, dim, dim.get_type().const_int(d, false), "")
            .map_err(codegen)?;
        v = b.build_select(is, per_dim(d as usize)?, v, "").map_err(codegen)?.into_int_value();
    }
    Ok(v)
}

/// Replaces every use of `call` with `v` and erases it.
fn replace<'ctx>(call: InstructionValue<'ctx>, v: BasicValueEnum<'ctx>) -> Result<(), JitError> {
    use inkwell::values::AsValueRef;
    // SAFETY: `v` has the call's type (the caller's contract), both live in one
    // function.
    unsafe { inkwell::llvm_sys::core::LLVMReplaceAllUsesWith(call.as_value_ref(), v.as_value_ref()) };
    if call.get_first_use().is_some() {
        return Err(codegen("a built-in call kept its uses"));
    }
    call.erase_from_basic_block();
    Ok(())
}
