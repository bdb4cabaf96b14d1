//! Thin helpers over LLVM's C API for the IR surgery inkwell has no call for
//! (moving blocks between functions, call conventions of call sites, callees).
//!
//! Every helper takes values of a live module; none outlives the call.

use std::ffi::CStr;

use inkwell::basic_block::BasicBlock;
use inkwell::llvm_sys::core;
use inkwell::values::{AsValueRef, FunctionValue, InstructionOpcode, InstructionValue};

/// The instructions of `function`, block by block (a snapshot: editing the function
/// while walking it is safe).
pub(crate) fn instructions<'ctx>(function: FunctionValue<'ctx>) -> Vec<InstructionValue<'ctx>> {
    function.get_basic_block_iter().flat_map(|b| b.get_instructions()).collect()
}

/// The instructions of `blocks`, in order (a snapshot).
pub(crate) fn instructions_of<'ctx>(blocks: &[BasicBlock<'ctx>]) -> Vec<InstructionValue<'ctx>> {
    blocks.iter().flat_map(|b| b.get_instructions()).collect()
}

/// The name of the function `call` calls directly; `None` for an indirect call or
/// an instruction that is not a call.
pub(crate) fn callee_name(call: InstructionValue) -> Option<String> {
    if call.get_opcode() != InstructionOpcode::Call {
        return None;
    }
    callee_name_of(call.as_value_ref())
}

/// [`callee_name`] of a call instruction given by its raw value.
pub(crate) fn callee_name_of(call: inkwell::llvm_sys::prelude::LLVMValueRef) -> Option<String> {
    // SAFETY: `call` is a call instruction of a live module (the caller checks).
    unsafe {
        let callee = core::LLVMGetCalledValue(call);
        if callee.is_null() || core::LLVMIsAFunction(callee).is_null() {
            return None;
        }
        let mut len = 0usize;
        let name = core::LLVMGetValueName2(callee, &mut len);
        Some(String::from_utf8_lossy(std::slice::from_raw_parts(name.cast::<u8>(), len)).into_owned())
    }
}

/// Whether `call` is a call whose callee is a function defined in the module.
pub(crate) fn calls_definition(call: InstructionValue) -> bool {
    // SAFETY: as in `callee_name`.
    unsafe {
        let callee = core::LLVMGetCalledValue(call.as_value_ref());
        !callee.is_null()
            && !core::LLVMIsAFunction(callee).is_null()
            && core::LLVMCountBasicBlocks(callee) > 0
    }
}

/// Sets the calling convention of call site `call`.
pub(crate) fn set_call_conv(call: InstructionValue, conv: u32) {
    // SAFETY: `call` is a call instruction of a live module.
    unsafe { core::LLVMSetInstructionCallConv(call.as_value_ref(), conv) }
}

/// Moves `block` (with its instructions) to the end of `function`.
pub(crate) fn move_block(block: BasicBlock, function: FunctionValue) {
    // SAFETY: a block of a live function, unlinked from it and appended to another
    // function of the same module; its uses stay (they refer to the block itself).
    unsafe {
        core::LLVMRemoveBasicBlockFromParent(block.as_mut_ptr());
        core::LLVMAppendExistingBasicBlock(function.as_value_ref(), block.as_mut_ptr());
    }
}

/// Deletes `function`, which must have no uses and no blocks left.
pub(crate) fn delete_function(function: FunctionValue) {
    // SAFETY: the caller moved the body out and replaced every use.
    unsafe { core::LLVMDeleteFunction(function.as_value_ref()) }
}

/// The constant integer value of `call`'s argument `index`, if it is constant.
pub(crate) fn const_arg(call: InstructionValue, index: u32) -> Option<u64> {
    const_operand(call.as_value_ref(), index)
}

/// [`const_arg`] of an instruction given by its raw value.
pub(crate) fn const_operand(call: inkwell::llvm_sys::prelude::LLVMValueRef, index: u32) -> Option<u64> {
    // SAFETY: operands of a live instruction.
    unsafe {
        let v = core::LLVMGetOperand(call, index);
        if v.is_null() || core::LLVMIsAConstantInt(v).is_null() {
            return None;
        }
        Some(core::LLVMConstIntGetZExtValue(v))
    }
}

/// The element count of `alloca` if constant.
pub(crate) fn alloca_count(alloca: InstructionValue) -> Option<u64> {
    const_arg(alloca, 0)
}

/// A function's name as text.
pub(crate) fn name(function: FunctionValue) -> String {
    function.get_name().to_string_lossy().into_owned()
}

/// The address space of pointer type `ty`.
pub(crate) fn address_space(ty: inkwell::types::PointerType) -> u32 {
    use inkwell::types::AsTypeRef;
    // SAFETY: a pointer type of a live context.
    unsafe { core::LLVMGetPointerAddressSpace(ty.as_type_ref()) }
}

/// Turns an LLVM message into text.
pub(crate) fn text(s: &CStr) -> String {
    s.to_string_lossy().into_owned()
}

/// Replaces every use of `old` with `new` (of the same type).
pub(crate) fn replace_uses(old: impl inkwell::values::AsValueRef, new: impl inkwell::values::AsValueRef) {
    // SAFETY: values of one live function; the caller gives them one type.
    unsafe { core::LLVMReplaceAllUsesWith(old.as_value_ref(), new.as_value_ref()) }
}
