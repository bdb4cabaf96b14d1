//! Internalization (the DPC++ kernel-fusion design, "Internalization Behavior"): a
//! kernel's accesses through a promoted buffer parameter go to the internal buffer
//! instead, at `base + (byte offset % bytes)`, where `bytes` is the internal
//! buffer's size per work-item (private) or per work-group (local).
//!
//! The rewrite follows the parameter's pointer through everything that derives a
//! pointer from it: `getelementptr`, `addrspacecast` (to the generic address
//! space and back), `bitcast`, and `phi`s and `select`s all of whose incoming
//! pointers derive from it. Each derived pointer gets its byte offset from the
//! parameter as an `i64` value (a `getelementptr`'s is its own indices applied to a
//! null base, which LLVM folds to the index arithmetic), and every `load`, `store`,
//! `atomicrmw` and `cmpxchg` through a derived pointer is pointed at the internal
//! buffer; a comparison of two derived pointers compares their offsets. Any other
//! use of a derived pointer (stored as a value, compared with another pointer,
//! converted to an integer, passed to a call) makes the buffer [`rewritable`]
//! answer no: it then stays in global memory, since rewriting only some accesses
//! would split one buffer in two.

use std::collections::HashMap;

use inkwell::llvm_sys::core::*;
use inkwell::llvm_sys::prelude::*;
use inkwell::llvm_sys::LLVMOpcode;

use crate::error::{codegen, JitError};

/// A derived pointer's role: how its offset is computed.
fn derives(user: LLVMValueRef) -> bool {
    // SAFETY: a live instruction.
    let op = unsafe { LLVMGetInstructionOpcode(user) };
    matches!(
        op,
        LLVMOpcode::LLVMGetElementPtr
            | LLVMOpcode::LLVMAddrSpaceCast
            | LLVMOpcode::LLVMBitCast
            | LLVMOpcode::LLVMPHI
            | LLVMOpcode::LLVMSelect
    )
}

/// The users of `v` (each once per use).
fn users(v: LLVMValueRef) -> Vec<(LLVMValueRef, u32)> {
    let mut out = Vec::new();
    // SAFETY: walking the use list of a live value.
    unsafe {
        let mut u = LLVMGetFirstUse(v);
        while !u.is_null() {
            let user = LLVMGetUser(u);
            // The operand index of this use.
            let n = LLVMGetNumOperands(user).max(0) as u32;
            let index = (0..n).find(|&i| LLVMGetOperandUse(user, i) == u).unwrap_or(u32::MAX);
            out.push((user, index));
            u = LLVMGetNextUse(u);
        }
    }
    out
}

/// Whether an instruction that uses a derived pointer as operand `index` accesses
/// memory through it (and only that way).
fn is_access(user: LLVMValueRef, index: u32) -> bool {
    // SAFETY: a live instruction.
    let op = unsafe { LLVMGetInstructionOpcode(user) };
    match op {
        LLVMOpcode::LLVMLoad => index == 0,
        LLVMOpcode::LLVMStore => index == 1,
        LLVMOpcode::LLVMAtomicRMW | LLVMOpcode::LLVMAtomicCmpXchg => index == 0,
        _ => false,
    }
}

/// Whether `user` is a lifetime marker (dropped by the rewrite).
fn is_lifetime(user: LLVMValueRef) -> bool {
    // SAFETY: a live instruction; the callee is read only for its name.
    unsafe {
        if LLVMGetInstructionOpcode(user) != LLVMOpcode::LLVMCall {
            return false;
        }
        let callee = LLVMGetCalledValue(user);
        if callee.is_null() || LLVMIsAFunction(callee).is_null() {
            return false;
        }
        let mut len = 0usize;
        let name = LLVMGetValueName2(callee, &mut len);
        let name = std::slice::from_raw_parts(name.cast::<u8>(), len);
        name.starts_with(b"llvm.lifetime.")
    }
}

/// The pointers derived from `param`, `param` first, in discovery order; `None` if
/// some use cannot be rewritten (see the module docs).
fn derived(param: LLVMValueRef) -> Option<(Vec<LLVMValueRef>, Vec<LLVMValueRef>)> {
    let mut order = vec![param];
    let mut compares = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let v = order[i];
        i += 1;
        for (user, index) in users(v) {
            if is_access(user, index) || is_lifetime(user) {
                continue;
            }
            // SAFETY: a live instruction.
            let op = unsafe { LLVMGetInstructionOpcode(user) };
            let through = match op {
                LLVMOpcode::LLVMGetElementPtr => index == 0,
                LLVMOpcode::LLVMSelect => index != 0,
                // A comparison of two derived pointers compares their offsets
                // (checked below); it derives no pointer.
                LLVMOpcode::LLVMICmp => {
                    compares.push(user);
                    continue;
                }
                _ => derives(user),
            };
            if !through {
                return None;
            }
            if !order.contains(&user) {
                order.push(user);
            }
        }
    }
    // A phi or select merging this buffer's pointer with another one cannot move to
    // the internal buffer alone.
    for &v in &order[1..] {
        // SAFETY: a live instruction and its operands.
        unsafe {
            match LLVMGetInstructionOpcode(v) {
                LLVMOpcode::LLVMPHI => {
                    for k in 0..LLVMCountIncoming(v) {
                        if !order.contains(&LLVMGetIncomingValue(v, k)) {
                            return None;
                        }
                    }
                }
                LLVMOpcode::LLVMSelect => {
                    for k in 1..3 {
                        if !order.contains(&LLVMGetOperand(v, k)) {
                            return None;
                        }
                    }
                }
                _ => {}
            }
        }
    }
    for &c in &compares {
        // SAFETY: a live comparison instruction.
        if (0..2).any(|k| !order.contains(&unsafe { LLVMGetOperand(c, k) })) {
            return None;
        }
    }
    compares.sort();
    compares.dedup();
    Some((order, compares))
}

/// Whether every access through parameter `param` of `function` can be rewritten.
pub(super) fn rewritable(function: inkwell::values::FunctionValue, param: u32) -> bool {
    use inkwell::values::AsValueRef;
    let Some(p) = function.get_nth_param(param) else { return false };
    derived(p.as_value_ref()).is_some()
}

/// Rewrites every access through parameter `param` of `function` to `base +
/// (offset % bytes)`, where `base` is what `base_at` builds at the start of the
/// function (an `i8` pointer in the internal buffer's address space).
///
/// The parameter itself is left unused but for offset arithmetic that folds away
/// once the caller passes a null pointer.
pub(super) fn rewrite(
    function: inkwell::values::FunctionValue,
    param: u32,
    bytes: u64,
    base: LLVMValueRef,
) -> Result<(), JitError> {
    use inkwell::values::AsValueRef;
    let p = function.get_nth_param(param).ok_or_else(|| codegen("no such parameter"))?.as_value_ref();
    let (order, compares) =
        derived(p).ok_or_else(|| codegen("the parameter's accesses cannot be rewritten"))?;
    // SAFETY: every value below is an instruction (or the parameter) of `function`,
    // alive for the whole rewrite; new instructions are inserted where the values
    // they use dominate them (see each case).
    unsafe {
        let context = LLVMGetTypeContext(LLVMTypeOf(p));
        let i64t = LLVMInt64TypeInContext(context);
        let i8t = LLVMInt8TypeInContext(context);
        let builder = LLVMCreateBuilderInContext(context);
        let zero = LLVMConstInt(i64t, 0, 0);
        let mut offset: HashMap<LLVMValueRef, LLVMValueRef> = HashMap::new();
        offset.insert(p, zero);
        // Phis first (as empty i64 phis), so that loops through them resolve.
        for &v in &order[1..] {
            if LLVMGetInstructionOpcode(v) == LLVMOpcode::LLVMPHI {
                LLVMPositionBuilderBefore(builder, v);
                offset.insert(v, LLVMBuildPhi(builder, i64t, c"".as_ptr()));
            }
        }
        // Then the rest in discovery order: each one's source was discovered first.
        // (A select's two operands may be discovered after it: resolved below.)
        let mut pending: Vec<LLVMValueRef> = order[1..].to_vec();
        let mut progress = true;
        while !pending.is_empty() && progress {
            progress = false;
            pending.retain(|&v| {
                let op = LLVMGetInstructionOpcode(v);
                let done = match op {
                    LLVMOpcode::LLVMPHI => true,
                    LLVMOpcode::LLVMGetElementPtr => match offset.get(&LLVMGetOperand(v, 0)) {
                        Some(&base_off) => {
                            // The GEP's own indices over a null base of its pointer
                            // type, as an integer: its byte offset.
                            let clone = LLVMInstructionClone(v);
                            LLVMSetOperand(clone, 0, LLVMConstNull(LLVMTypeOf(LLVMGetOperand(v, 0))));
                            LLVMSetIsInBounds(clone, 0);
                            LLVMPositionBuilderBefore(builder, v);
                            LLVMInsertIntoBuilder(builder, clone);
                            let own = LLVMBuildPtrToInt(builder, clone, i64t, c"".as_ptr());
                            offset.insert(v, LLVMBuildAdd(builder, base_off, own, c"".as_ptr()));
                            true
                        }
                        None => false,
                    },
                    LLVMOpcode::LLVMAddrSpaceCast | LLVMOpcode::LLVMBitCast => {
                        match offset.get(&LLVMGetOperand(v, 0)) {
                            Some(&o) => {
                                offset.insert(v, o);
                                true
                            }
                            None => false,
                        }
                    }
                    LLVMOpcode::LLVMSelect => {
                        match (offset.get(&LLVMGetOperand(v, 1)), offset.get(&LLVMGetOperand(v, 2))) {
                            (Some(&a), Some(&b)) => {
                                LLVMPositionBuilderBefore(builder, v);
                                let s = LLVMBuildSelect(builder, LLVMGetOperand(v, 0), a, b, c"".as_ptr());
                                offset.insert(v, s);
                                true
                            }
                            _ => false,
                        }
                    }
                    _ => true,
                };
                progress |= done;
                !done
            });
        }
        if !pending.is_empty() {
            LLVMDisposeBuilder(builder);
            return Err(codegen("a derived pointer's offset could not be resolved"));
        }
        for &v in &order[1..] {
            if LLVMGetInstructionOpcode(v) == LLVMOpcode::LLVMPHI {
                let phi = offset[&v];
                for k in 0..LLVMCountIncoming(v) {
                    let mut value = offset[&LLVMGetIncomingValue(v, k)];
                    let mut block = LLVMGetIncomingBlock(v, k);
                    LLVMAddIncoming(phi, &mut value, &mut block, 1);
                }
            }
        }
        // Comparisons of derived pointers compare their offsets.
        for &c in &compares {
            LLVMPositionBuilderBefore(builder, c);
            let (a, b) = (offset[&LLVMGetOperand(c, 0)], offset[&LLVMGetOperand(c, 1)]);
            let by_offset = LLVMBuildICmp(builder, LLVMGetICmpPredicate(c), a, b, c"".as_ptr());
            LLVMReplaceAllUsesWith(c, by_offset);
            LLVMInstructionEraseFromParent(c);
        }
        // Every access through a derived pointer goes to the internal buffer.
        let size = LLVMConstInt(i64t, bytes, 0);
        for &v in &order {
            for (user, index) in users(v) {
                if is_lifetime(user) {
                    LLVMInstructionEraseFromParent(user);
                    continue;
                }
                if !is_access(user, index) {
                    continue;
                }
                LLVMPositionBuilderBefore(builder, user);
                let wrapped = LLVMBuildURem(builder, offset[&v], size, c"".as_ptr());
                let mut index_value = wrapped;
                let at = LLVMBuildGEP2(builder, i8t, base, &mut index_value, 1, c"internal".as_ptr());
                LLVMSetOperand(user, index, at);
            }
        }
        LLVMDisposeBuilder(builder);
    }
    Ok(())
}
