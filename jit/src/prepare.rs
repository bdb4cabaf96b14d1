//! Preparing an IR kernel for a target: one flat function.
//!
//! Both compilers start here: the image is parsed, its entry's parameters bound to
//! the signature, the module retargeted (triple and data layout; spir calling
//! conventions reset to C, since call sites and callees must agree and neither host
//! nor NVPTX code has spir conventions), and every function the entry calls is
//! inlined into it (clang marks OpenCL functions `noinline` at some levels: that is
//! removed first). The math built-ins that are exactly an LLVM intrinsic (`fmax`,
//! `sqrt`, `fma`…) then become that intrinsic ([`crate::math`]). What is left calls
//! only work-item built-ins, barriers, fences and intrinsics; anything else (`exp`,
//! `sin`…) is reported, naming the function, rather than left to fail at link time.
//!
//! A later fusion step builds its stub kernel (calling several kernels) in one
//! module and hands it here like any other entry.

use gantry_driver::{CodeImage, Signature};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{TargetData, TargetMachine};
use inkwell::values::{FunctionValue, InstructionOpcode};

use crate::builtins::{classify, Call};
use crate::error::{codegen, JitError};
use crate::ir;
use crate::math;
use crate::raw;
use crate::signature::{bind, param_kinds, Binding};

/// A kernel flattened into one function of a module retargeted to `target`.
pub(crate) struct Prepared<'ctx> {
    pub module: Module<'ctx>,
    pub kernel: FunctionValue<'ctx>,
    pub bindings: Vec<Binding>,
    pub barriers: usize,
}

/// The C calling convention.
const C_CONV: u32 = 0;

/// Prepares `image` (an LLVM IR image) with `signature` for `target`.
pub(crate) fn prepare<'ctx>(
    context: &'ctx Context,
    image: &CodeImage,
    signature: &Signature,
    target: &TargetMachine,
) -> Result<Prepared<'ctx>, JitError> {
    let module = ir::parse_image(context, image)?;
    let kernel = ir::entry_function(&module, image.entry())?;
    let layout = TargetData::create(&module.get_data_layout().as_str().to_string_lossy());
    let bindings = bind(&param_kinds(kernel, &layout)?, signature)?;

    module.set_triple(&target.get_triple());
    module.set_data_layout(&target.get_target_data().get_data_layout());
    let kind = Attribute::get_named_enum_kind_id;
    for f in module.get_functions() {
        f.set_call_conventions(C_CONV);
        f.remove_enum_attribute(AttributeLoc::Function, kind("noinline"));
        f.remove_enum_attribute(AttributeLoc::Function, kind("optnone"));
        f.remove_string_attribute(AttributeLoc::Function, "frame-pointer");
        if f.count_basic_blocks() > 0 && f != kernel {
            f.add_attribute(AttributeLoc::Function, context.create_enum_attribute(kind("alwaysinline"), 0));
            f.set_linkage(Linkage::Internal);
        }
        for inst in raw::instructions(f) {
            if inst.get_opcode() == InstructionOpcode::Call {
                raw::set_call_conv(inst, C_CONV);
            }
        }
    }
    module
        .run_passes("always-inline,globaldce", target, PassBuilderOptions::create())
        .map_err(|e| codegen(format!("inlining: {}", raw::text(&e))))?;
    math::translate(context, &module, kernel)?;

    let name = raw::name(kernel);
    let mut barriers = 0;
    for inst in raw::instructions(kernel) {
        match inst.get_opcode() {
            InstructionOpcode::Call => {}
            InstructionOpcode::Alloca => {
                if raw::alloca_count(inst).is_none() {
                    return Err(JitError::Unsupported {
                        function: name,
                        what: "a variable-sized stack allocation".into(),
                    });
                }
                continue;
            }
            InstructionOpcode::Invoke | InstructionOpcode::CallBr => {
                return Err(JitError::Unsupported { function: name, what: "exception handling".into() })
            }
            _ => continue,
        }
        if raw::calls_definition(inst) {
            let callee = raw::callee_name(inst).unwrap_or_default();
            return Err(JitError::Unsupported {
                function: callee,
                what: format!("a call from `{name}` that cannot be inlined (recursion)"),
            });
        }
        let Some(callee) = raw::callee_name(inst) else {
            return Err(JitError::Unsupported { function: name, what: "an indirect call".into() });
        };
        match classify(&callee) {
            Call::Barrier => barriers += 1,
            Call::WorkItem(_) | Call::Fence | Call::Intrinsic => {}
            Call::Unknown => {
                return Err(JitError::Unsupported {
                    function: callee,
                    what: format!(
                        "called from `{name}` but neither defined in the module nor a built-in the JIT translates"
                    ),
                })
            }
        }
    }
    Ok(Prepared { module, kernel, bindings, barriers })
}
