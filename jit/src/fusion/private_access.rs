//! Barrier elision: which of the work-group barriers a fused kernel puts between
//! its kernels ([`FusionRequest::barriers`](gantry_driver::fusion::FusionRequest))
//! can be left out because no work-item of a group could observe the difference.
//!
//! The DPC++ kernel-fusion design ("User driven Kernel Fusion") puts a barrier
//! between the fused kernels so that a kernel sees what the previous one wrote,
//! as it would unfused — but a barrier orders only memory that one work-item
//! writes and *another* work-item of its group then reads or writes. Work-items
//! that each touch only their own elements need none: their program order already
//! orders each one's own accesses. For the common elementwise chain the barriers
//! are pure cost: on the host they turn the fused kernel into a per-work-item
//! state machine that does not vectorize, and on a GPU they keep every store and
//! the next kernel's load of it in global memory.
//!
//! # The rule
//!
//! [`analyze`] proves, for one loaded (flattened) kernel, where each of its buffer
//! parameters is accessed. A kernel is *analyzable* when
//!
//! * it has no barriers, no local memory (no local slots, no `addrspace(3)`
//!   access), no atomics and no fences, and calls nothing but work-item built-ins
//!   and LLVM intrinsics (an intrinsic's pointer arguments may only point at the
//!   work-item's private variables or at constants);
//! * every `load` and `store` goes through a pointer that derives (through
//!   `getelementptr`, address-space casts, bitcasts, and phis or selects whose
//!   incoming pointers derive from the same one) from a global buffer parameter, a
//!   private variable (`alloca`) or a constant global (loads only);
//! * it runs over the fused grid unremapped, and the grid is one-dimensional (the
//!   caller checks both: its `get_global_id(0)` is then the grid's, and unique per
//!   work-item).
//!
//! For each buffer parameter it records whether the kernel reads and writes it
//! and, where every access is at byte offset `stride * id + k` from the parameter
//! with `0 <= k` and `k + access size <= stride` (one stride for the parameter),
//! that stride: the work-item's *own element*. Any other offset (a neighbour's
//! element, a gather) leaves the parameter without one. `id` is `get_global_id(0)` itself,
//! possibly zero- or sign-extended or truncated to no fewer than 32 bits; offsets
//! combine it on 64 bits with constants (`add`, `sub`, `mul`, `shl`) and through
//! the `getelementptr`s' own scaling (element sizes, struct field offsets).
//!
//! [`elide`] then walks the list and leaves out the barrier between two adjacent
//! kernels when both are analyzable and, over the run of kernels since the last
//! barrier kept, every fused argument that any of them writes is accessed by all
//! of them in their own elements only, with one stride and one byte offset of the
//! slot in the argument. Each work-item then touches, in every kernel of the run,
//! the same `stride` bytes of each written argument, disjoint from every other
//! work-item's: no work-item reads or overwrites what another wrote, so the
//! results cannot differ. An argument only read in the run constrains nothing; a
//! privately internalized buffer is per work-item anyway; a locally internalized
//! one is local memory, and keeps the barriers around its kernels. Anything the
//! analysis cannot prove keeps the barrier.
//!
//! Why truncation to 32 bits is harmless: every id-derived value is congruent to
//! the id modulo 2^32, and two work-items of one group differ by less than a
//! group's size, far below 2^32, so their values differ; work-items of different
//! groups are never ordered by a work-group barrier anyway.

use std::collections::HashSet;

use inkwell::llvm_sys::core::*;
use inkwell::llvm_sys::prelude::*;
use inkwell::llvm_sys::target::{
    LLVMABISizeOfType, LLVMOffsetOfElement, LLVMStoreSizeOfType, LLVMTargetDataRef,
};
use inkwell::llvm_sys::{LLVMOpcode, LLVMTypeKind};
use inkwell::targets::TargetData;
use inkwell::values::{AsValueRef, FunctionValue};

use crate::builtins::{classify, Call};
use crate::raw;
use crate::signature::Binding;

/// How one kernel uses one of its buffer parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ParamAccess {
    /// Some load reads through it.
    pub reads: bool,
    /// Some store writes through it.
    pub writes: bool,
    /// `Some(stride)` when every access is within the work-item's own element of
    /// `stride` bytes (see the module docs); `None` when some access is not, or
    /// there is none.
    pub own: Option<u64>,
}

/// One fused argument a kernel touches, for [`elide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Touch {
    /// The fused argument.
    pub arg: u32,
    /// The byte offset of the kernel's slot in the argument.
    pub offset: usize,
    /// How the kernel accesses it.
    pub access: ParamAccess,
}

/// `id * get_global_id(0) + k`, exactly (`i128`: no overflow for 64-bit inputs
/// scaled by type sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Affine {
    id: i128,
    k: i128,
}

impl Affine {
    const ID: Affine = Affine { id: 1, k: 0 };

    fn constant(k: i128) -> Self {
        Affine { id: 0, k }
    }

    fn add(self, o: Affine) -> Option<Affine> {
        Some(Affine { id: self.id.checked_add(o.id)?, k: self.k.checked_add(o.k)? })
    }

    fn scale(self, s: i128) -> Option<Affine> {
        Some(Affine { id: self.id.checked_mul(s)?, k: self.k.checked_mul(s)? })
    }
}

/// What a pointer points into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Root {
    /// Global buffer parameter `param`, at a byte offset from it (`None`: one the
    /// analysis cannot express, such as a gather's).
    Param { param: u32, offset: Option<Affine> },
    /// A private variable of the work-item (an `alloca`).
    Private,
    /// A constant global (read-only data).
    Constant,
}

/// Deeper expressions than this are not analyzed (they keep the barrier).
const MAX_DEPTH: u32 = 64;

struct Analysis<'a> {
    function: LLVMValueRef,
    bindings: &'a [Binding],
    data: LLVMTargetDataRef,
    /// Pointer phis being evaluated (a cycle is not analyzed).
    visiting: HashSet<LLVMValueRef>,
}

/// How `function` (a loaded kernel, flattened, whose parameters are bound as
/// `bindings` say) accesses each of its parameters, by parameter index (non-buffer
/// parameters have the default); `None` when it is not analyzable (see the module
/// docs; the caller checks remapping, the grid's dimensions and local slots).
pub(super) fn analyze(
    function: FunctionValue,
    bindings: &[Binding],
    data: &TargetData,
) -> Option<Vec<ParamAccess>> {
    let mut a = Analysis {
        function: function.as_value_ref(),
        bindings,
        data: data.as_mut_ptr(),
        visiting: HashSet::new(),
    };
    let mut params = vec![ParamAccess::default(); function.count_params() as usize];
    // Per parameter: whether some access was outside its own element.
    let mut strays = vec![false; params.len()];
    for inst in raw::instructions(function) {
        let v = inst.as_value_ref();
        // SAFETY: instructions of a live function, read only.
        let op = unsafe { LLVMGetInstructionOpcode(v) };
        let (pointer, write, size) = match op {
            // SAFETY: a load's type and a store's value operand.
            LLVMOpcode::LLVMLoad => {
                (unsafe { LLVMGetOperand(v, 0) }, false, a.store_size(unsafe { LLVMTypeOf(v) }))
            }
            LLVMOpcode::LLVMStore => unsafe {
                (LLVMGetOperand(v, 1), true, a.store_size(LLVMTypeOf(LLVMGetOperand(v, 0))))
            },
            LLVMOpcode::LLVMCall => {
                a.call(v)?;
                continue;
            }
            LLVMOpcode::LLVMAtomicRMW
            | LLVMOpcode::LLVMAtomicCmpXchg
            | LLVMOpcode::LLVMFence
            | LLVMOpcode::LLVMInvoke
            | LLVMOpcode::LLVMCallBr
            | LLVMOpcode::LLVMVAArg => return None,
            _ => continue,
        };
        match a.pointer(pointer, 0)? {
            Root::Private => {}
            Root::Constant if !write => {}
            Root::Constant => return None,
            Root::Param { param, offset } => {
                let p = &mut params[param as usize];
                if write {
                    p.writes = true;
                } else {
                    p.reads = true;
                }
                let own = offset.filter(|o| o.id > 0 && o.k >= 0 && o.k + i128::from(size) <= o.id);
                match (own, p.own) {
                    (Some(o), None) if !strays[param as usize] => p.own = Some(o.id as u64),
                    (Some(o), Some(s)) if i128::from(s) == o.id => {}
                    _ => {
                        strays[param as usize] = true;
                        p.own = None;
                    }
                }
            }
        }
    }
    Some(params)
}

impl Analysis<'_> {
    fn store_size(&self, ty: LLVMTypeRef) -> u64 {
        // SAFETY: a sized type of the module; the target data outlives the analysis.
        unsafe { LLVMStoreSizeOfType(self.data, ty) }
    }

    /// `Some(())` when call `v` is a work-item built-in, or an intrinsic whose
    /// pointer arguments point only at private variables or constants.
    fn call(&mut self, v: LLVMValueRef) -> Option<()> {
        match classify(&raw::callee_name_of(v)?) {
            Call::WorkItem(_) => Some(()),
            Call::Intrinsic => {
                // SAFETY: the operands of a live call (its callee last).
                let args = unsafe { LLVMGetNumArgOperands(v) };
                for i in 0..args {
                    // SAFETY: as above.
                    let arg = unsafe { LLVMGetOperand(v, i) };
                    // SAFETY: the type of a live value.
                    let kind = unsafe { LLVMGetTypeKind(LLVMTypeOf(arg)) };
                    if kind == LLVMTypeKind::LLVMPointerTypeKind
                        && !matches!(self.pointer(arg, 0)?, Root::Private | Root::Constant)
                    {
                        return None;
                    }
                }
                Some(())
            }
            Call::Barrier | Call::Fence | Call::Unknown => None,
        }
    }

    /// Where pointer `v` points (see [`Root`]); `None` if not provable.
    fn pointer(&mut self, v: LLVMValueRef, depth: u32) -> Option<Root> {
        if depth > MAX_DEPTH {
            return None;
        }
        // SAFETY: values of the live function and module, read only.
        unsafe {
            if !LLVMIsAArgument(v).is_null() {
                if LLVMGetParamParent(v) != self.function {
                    return None;
                }
                let n = LLVMCountParams(self.function);
                let param = (0..n).find(|&i| LLVMGetParam(self.function, i) == v)?;
                return match self.bindings.get(param as usize)? {
                    Binding::Global(_) => Some(Root::Param { param, offset: Some(Affine::constant(0)) }),
                    _ => None,
                };
            }
            if !LLVMIsAGlobalVariable(v).is_null() {
                let space = LLVMGetPointerAddressSpace(LLVMTypeOf(v));
                return (LLVMIsGlobalConstant(v) != 0 && space != 3).then_some(Root::Constant);
            }
            if !LLVMIsAConstantExpr(v).is_null() {
                // A constant address: only into constants (a constant expression of
                // a parameter or an alloca does not exist).
                return match LLVMGetConstOpcode(v) {
                    LLVMOpcode::LLVMGetElementPtr
                    | LLVMOpcode::LLVMAddrSpaceCast
                    | LLVMOpcode::LLVMBitCast => match self.pointer(LLVMGetOperand(v, 0), depth + 1)? {
                        Root::Constant => Some(Root::Constant),
                        _ => None,
                    },
                    _ => None,
                };
            }
            if LLVMIsAInstruction(v).is_null() {
                return None;
            }
            match LLVMGetInstructionOpcode(v) {
                LLVMOpcode::LLVMAlloca => Some(Root::Private),
                LLVMOpcode::LLVMAddrSpaceCast | LLVMOpcode::LLVMBitCast => {
                    self.pointer(LLVMGetOperand(v, 0), depth + 1)
                }
                LLVMOpcode::LLVMGetElementPtr => {
                    let base = self.pointer(LLVMGetOperand(v, 0), depth + 1)?;
                    match base {
                        Root::Param { param, offset } => {
                            let offset = offset.zip(self.gep_offset(v, depth)).and_then(|(a, b)| a.add(b));
                            Some(Root::Param { param, offset })
                        }
                        other => Some(other),
                    }
                }
                LLVMOpcode::LLVMPHI | LLVMOpcode::LLVMSelect => {
                    if !self.visiting.insert(v) {
                        return None; // a pointer recurrence: not analyzed
                    }
                    let incoming: Vec<LLVMValueRef> = if LLVMGetInstructionOpcode(v) == LLVMOpcode::LLVMPHI {
                        (0..LLVMCountIncoming(v)).map(|k| LLVMGetIncomingValue(v, k)).collect()
                    } else {
                        vec![LLVMGetOperand(v, 1), LLVMGetOperand(v, 2)]
                    };
                    // One root for all; a parameter's offset where they agree on it.
                    let mut root = None;
                    for value in incoming {
                        let r = self.pointer(value, depth + 1);
                        let agree = match (r, root) {
                            (None, _) => false,
                            (Some(r), None) => {
                                root = Some(r);
                                true
                            }
                            (
                                Some(Root::Param { param: p, offset: a }),
                                Some(Root::Param { param: q, offset: b }),
                            ) if p == q => {
                                let offset = if a == b { a } else { None };
                                root = Some(Root::Param { param: p, offset });
                                true
                            }
                            (Some(r), Some(old)) => r == old,
                        };
                        if !agree {
                            self.visiting.remove(&v);
                            return None;
                        }
                    }
                    self.visiting.remove(&v);
                    root
                }
                _ => None,
            }
        }
    }

    /// The byte offset `getelementptr` `v` adds to its base.
    fn gep_offset(&mut self, v: LLVMValueRef, depth: u32) -> Option<Affine> {
        // SAFETY: a live GEP instruction: its source type, its indices (operands
        // 1..) and the types it steps through, sized by the module's data layout.
        unsafe {
            let mut ty = LLVMGetGEPSourceElementType(v);
            let indices = LLVMGetNumIndices(v);
            let mut total = Affine::constant(0);
            for i in 0..indices {
                let index = LLVMGetOperand(v, i + 1);
                if i == 0 {
                    let size = LLVMABISizeOfType(self.data, ty);
                    total = total.add(self.integer(index, depth + 1)?.scale(i128::from(size))?)?;
                    continue;
                }
                match LLVMGetTypeKind(ty) {
                    LLVMTypeKind::LLVMStructTypeKind => {
                        if LLVMIsAConstantInt(index).is_null() {
                            return None;
                        }
                        let field = LLVMConstIntGetZExtValue(index) as u32;
                        let at = LLVMOffsetOfElement(self.data, ty, field);
                        total = total.add(Affine::constant(i128::from(at)))?;
                        ty = LLVMStructGetTypeAtIndex(ty, field);
                    }
                    LLVMTypeKind::LLVMArrayTypeKind => {
                        ty = LLVMGetElementType(ty);
                        let size = LLVMABISizeOfType(self.data, ty);
                        total = total.add(self.integer(index, depth + 1)?.scale(i128::from(size))?)?;
                    }
                    _ => return None,
                }
            }
            Some(total)
        }
    }

    /// Integer `v` as an affine function of `get_global_id(0)`; `None` if not one
    /// the module docs allow.
    fn integer(&mut self, v: LLVMValueRef, depth: u32) -> Option<Affine> {
        if depth > MAX_DEPTH {
            return None;
        }
        // SAFETY: values of the live function, read only.
        unsafe {
            let ty = LLVMTypeOf(v);
            if LLVMGetTypeKind(ty) != LLVMTypeKind::LLVMIntegerTypeKind {
                return None;
            }
            let width = LLVMGetIntTypeWidth(ty);
            if !LLVMIsAConstantInt(v).is_null() {
                return Some(Affine::constant(i128::from(LLVMConstIntGetSExtValue(v))));
            }
            if LLVMIsAInstruction(v).is_null() {
                return None; // a scalar parameter, a constant expression
            }
            let op = LLVMGetInstructionOpcode(v);
            let operand = |i| LLVMGetOperand(v, i);
            match op {
                LLVMOpcode::LLVMCall => {
                    let global_id = raw::callee_name_of(v).as_deref() == Some("_Z13get_global_idj");
                    (global_id && raw::const_operand(v, 0) == Some(0)).then_some(Affine::ID)
                }
                // Casts of the id itself only (see the module docs); constants are
                // folded by then.
                LLVMOpcode::LLVMZExt | LLVMOpcode::LLVMSExt | LLVMOpcode::LLVMTrunc => {
                    (width >= 32 && self.integer(operand(0), depth + 1)? == Affine::ID).then_some(Affine::ID)
                }
                // Arithmetic on 64 bits only: narrower arithmetic may wrap.
                _ if width != 64 => None,
                LLVMOpcode::LLVMAdd => {
                    self.integer(operand(0), depth + 1)?.add(self.integer(operand(1), depth + 1)?)
                }
                LLVMOpcode::LLVMSub => {
                    let b = self.integer(operand(1), depth + 1)?.scale(-1)?;
                    self.integer(operand(0), depth + 1)?.add(b)
                }
                LLVMOpcode::LLVMMul => {
                    let (a, b) = (self.integer(operand(0), depth + 1)?, self.integer(operand(1), depth + 1)?);
                    match (a.id, b.id) {
                        (0, _) => b.scale(a.k),
                        (_, 0) => a.scale(b.k),
                        _ => None,
                    }
                }
                LLVMOpcode::LLVMShl => {
                    let a = self.integer(operand(0), depth + 1)?;
                    let s = self.integer(operand(1), depth + 1)?;
                    (s.id == 0 && (0..63).contains(&s.k)).then(|| a.scale(1i128 << s.k)).flatten()
                }
                _ => None,
            }
        }
    }
}

/// Per kernel of the list, whether the barrier after it stays (the last kernel's
/// is always `false`), given the barriers the request asks for and, per kernel,
/// the fused arguments it touches when it is analyzable (`None` when not): see
/// the module docs.
pub(super) fn elide(barriers: bool, kernels: &[Option<Vec<Touch>>]) -> Vec<bool> {
    let mut keep = vec![false; kernels.len()];
    if !barriers {
        return keep;
    }
    // The touches of the run of analyzable kernels since the last barrier kept.
    let mut run: Option<Vec<Touch>> = None;
    for (k, touches) in kernels.iter().enumerate() {
        let joined = match (&run, touches) {
            (Some(run), Some(t)) => {
                let mut joined = run.clone();
                joined.extend_from_slice(t);
                private(&joined).then_some(joined)
            }
            _ => None,
        };
        if k > 0 {
            keep[k - 1] = joined.is_none();
        }
        run = joined.or_else(|| touches.clone());
    }
    keep
}

/// Whether every fused argument that `touches` write is touched in own elements
/// only, with one stride and one slot offset.
fn private(touches: &[Touch]) -> bool {
    touches.iter().filter(|t| t.access.writes).all(|w| {
        touches
            .iter()
            .filter(|t| t.arg == w.arg)
            .all(|t| t.access.own.is_some() && t.access.own == w.access.own && t.offset == w.offset)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use inkwell::context::Context;
    use inkwell::memory_buffer::MemoryBuffer;

    const HEAD: &str = r#"
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"
%pair = type { float, float }
@table = internal addrspace(2) constant [4 x float] zeroinitializer
@shared = internal addrspace(1) global float 0.0
declare i64 @_Z13get_global_idj(i32)
declare i64 @_Z12get_local_idj(i32)
declare void @_Z7barrierj(i32)
declare void @llvm.memcpy.p0.p1.i64(ptr, ptr addrspace(1), i64, i1)
"#;

    /// `analyze` of kernel `k` of `body` (parameters: global buffers, then one
    /// `i64` scalar where it has one).
    fn analyzed(body: &str) -> Option<Vec<ParamAccess>> {
        let context = Context::create();
        let text = format!("{HEAD}{body}");
        let buffer = MemoryBuffer::create_from_memory_range_copy(text.as_bytes(), "test");
        let module = context.create_module_from_ir(buffer).unwrap_or_else(|e| panic!("{e}"));
        let function = module.get_function("k").expect("a kernel named k");
        let bindings: Vec<Binding> = function
            .get_param_iter()
            .enumerate()
            .map(|(i, p)| {
                if p.is_pointer_value() {
                    Binding::Global(i)
                } else {
                    Binding::Scalar { offset: 0, align: 8 }
                }
            })
            .collect();
        let data = TargetData::create(&module.get_data_layout().as_str().to_string_lossy());
        analyze(function, &bindings, &data)
    }

    fn own(reads: bool, writes: bool, stride: u64) -> ParamAccess {
        ParamAccess { reads, writes, own: Some(stride) }
    }

    fn stray(reads: bool, writes: bool) -> ParamAccess {
        ParamAccess { reads, writes, own: None }
    }

    /// The id through casts (down to 32 bits), byte GEPs over a shifted id, a
    /// struct field inside its own element, a vector as one element, private
    /// variables and constant tables: own elements.
    #[test]
    fn own_elements() {
        let got = analyzed(
            r#"define void @k(ptr addrspace(1) %x, ptr addrspace(1) %y, ptr addrspace(1) %p, ptr addrspace(1) %v) {
  %g = call i64 @_Z13get_global_idj(i32 0)
  %t = trunc i64 %g to i32
  %s = sext i32 %t to i64
  %xi = getelementptr inbounds float, ptr addrspace(1) %x, i64 %s
  %a = load float, ptr addrspace(1) %xi
  %b4 = shl i64 %g, 2
  %yi = getelementptr inbounds i8, ptr addrspace(1) %y, i64 %b4
  %gen = addrspacecast ptr addrspace(1) %yi to ptr addrspace(4)
  store float %a, ptr addrspace(4) %gen
  %pf = getelementptr inbounds %pair, ptr addrspace(1) %p, i64 %g, i32 1
  store float %a, ptr addrspace(1) %pf
  %vi = getelementptr inbounds <4 x float>, ptr addrspace(1) %v, i64 %g
  %vv = load <4 x float>, ptr addrspace(1) %vi
  %priv = alloca [2 x float]
  %pe = getelementptr [2 x float], ptr %priv, i64 0, i64 1
  store float %a, ptr %pe
  %te = getelementptr [4 x float], ptr addrspace(2) @table, i64 0, i64 2
  %c = load float, ptr addrspace(2) %te
  ret void
}"#,
        );
        assert_eq!(
            got,
            Some(vec![own(true, false, 4), own(false, true, 4), own(false, true, 8), own(true, false, 16)])
        );
    }

    /// A neighbour's element, a gather, two strides, an access wider than its
    /// element, an id of another dimension and 32-bit arithmetic on the id: the
    /// parameter is touched outside its own elements (the kernel is still
    /// analyzable).
    #[test]
    fn strays() {
        let got = analyzed(
            r#"define void @k(ptr addrspace(1) %x, ptr addrspace(1) %y, ptr addrspace(1) %z, ptr addrspace(1) %w, i64 %n) {
  %g = call i64 @_Z13get_global_idj(i32 0)
  %g1 = add i64 %g, 1
  %xn = getelementptr inbounds float, ptr addrspace(1) %x, i64 %g1
  %a = load float, ptr addrspace(1) %xn
  %j = load i64, ptr addrspace(1) %z
  %yj = getelementptr inbounds float, ptr addrspace(1) %y, i64 %j
  store float %a, ptr addrspace(1) %yj
  %zi = getelementptr inbounds double, ptr addrspace(1) %z, i64 %g
  store double 0.0, ptr addrspace(1) %zi
  %wi = getelementptr inbounds float, ptr addrspace(1) %w, i64 %g
  %wide = load i64, ptr addrspace(1) %wi
  ret void
}"#,
        );
        assert_eq!(
            got,
            Some(vec![
                stray(true, false),
                stray(false, true),
                stray(true, true),
                stray(true, false),
                ParamAccess::default()
            ])
        );
        let other = |body: &str| {
            analyzed(&format!(
                "define void @k(ptr addrspace(1) %x, i64 %n) {{\n{body}\n  %xi = getelementptr float, ptr \
                 addrspace(1) %x, i64 %i\n  store float 0.0, ptr addrspace(1) %xi\n  ret void\n}}"
            ))
        };
        let w = |p| Some(vec![p, ParamAccess::default()]);
        assert_eq!(other("  %i = call i64 @_Z13get_global_idj(i32 0)"), w(own(false, true, 4)));
        assert_eq!(other("  %i = call i64 @_Z13get_global_idj(i32 1)"), w(stray(false, true)));
        assert_eq!(other("  %i = call i64 @_Z12get_local_idj(i32 0)"), w(stray(false, true)));
        assert_eq!(
            other("  %g = call i64 @_Z13get_global_idj(i32 0)\n  %i = add i64 %g, %n"),
            w(stray(false, true))
        );
        let narrow = "  %g = call i64 @_Z13get_global_idj(i32 0)\n  %t = trunc i64 %g to i32\n  \
                      %d = shl i32 %t, 1\n  %i = zext i32 %d to i64";
        assert_eq!(other(narrow), w(stray(false, true)));
        let short = "  %g = call i64 @_Z13get_global_idj(i32 0)\n  %t = trunc i64 %g to i16\n  \
                     %i = zext i16 %t to i64";
        assert_eq!(other(short), w(stray(false, true)));
    }

    /// Barriers, atomics, a global variable written, a pointer loaded from memory,
    /// a memory intrinsic on a buffer and an unknown call: not analyzable.
    #[test]
    fn not_analyzable() {
        let body = |b: &str| {
            format!(
                "define void @k(ptr addrspace(1) %x) {{\n  %g = call i64 @_Z13get_global_idj(i32 0)\n  \
                 %xi = getelementptr float, ptr addrspace(1) %x, i64 %g\n{b}\n  ret void\n}}"
            )
        };
        assert!(analyzed(&body("  store float 1.0, ptr addrspace(1) %xi")).is_some());
        for bad in [
            "  call void @_Z7barrierj(i32 2)",
            "  %o = atomicrmw fadd ptr addrspace(1) %xi, float 1.0 monotonic",
            "  fence acquire",
            "  store float 1.0, ptr addrspace(1) @shared",
            "  %q = load ptr addrspace(1), ptr addrspace(1) %xi\n  store float 1.0, ptr addrspace(1) %q",
            "  %m = alloca float\n  call void @llvm.memcpy.p0.p1.i64(ptr %m, ptr addrspace(1) %xi, i64 4, i1 false)",
            "  %s = call float @_Z4sqrtf(float 2.0)",
        ] {
            let text = body(bad).replace("ret void\n}", "ret void\n}\ndeclare float @_Z4sqrtf(float)");
            assert_eq!(analyzed(&text), None, "{bad}");
        }
    }

    fn touch(arg: u32, offset: usize, writes: bool, own: Option<u64>) -> Touch {
        Touch { arg, offset, access: ParamAccess { reads: true, writes, own } }
    }

    /// Runs of kernels in own elements lose their barriers; a stray access to a
    /// written argument, another slot offset or stride, or a kernel that is not
    /// analyzable keeps them; an argument only read constrains nothing.
    #[test]
    fn runs_and_breaks() {
        let own = |arg| Some(vec![touch(arg, 0, true, Some(4))]);
        assert_eq!(elide(true, &[own(0), own(0), own(0)]), [false, false, false]);
        assert_eq!(elide(false, &[None, None]), [false, false]);
        assert_eq!(elide(true, &[own(0), None, own(0), own(0)]), [true, true, false, false]);
        let stray = Some(vec![touch(0, 0, false, None)]);
        // Both ways: a read of a neighbour's element after its write, and before
        // its overwrite.
        assert_eq!(elide(true, &[own(0), stray.clone(), own(0)]), [true, true, false]);
        assert_eq!(elide(true, &[stray.clone(), stray]), [false, false], "only read");
        let shifted = Some(vec![touch(0, 4, false, Some(4))]);
        assert_eq!(elide(true, &[own(0), shifted]), [true, false]);
        let wider = Some(vec![touch(0, 0, false, Some(8))]);
        assert_eq!(elide(true, &[own(0), wider]), [true, false]);
        // Argument 1 is only read (through strays): no constraint.
        let reads = |arg| Some(vec![touch(1, 0, false, None), touch(arg, 0, true, Some(4))]);
        assert_eq!(elide(true, &[reads(0), reads(2), own(0)]), [false, false, false]);
        // A stray reader joined the run, so a later writer of its argument breaks it.
        assert_eq!(elide(true, &[reads(0), own(1)]), [true, false]);
    }
}
