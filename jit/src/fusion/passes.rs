//! Running LLVM passes on the fused module, which is still target-independent
//! (`spir64`): no target machine, so no target-specific transformation (no
//! vectorization, no lowering) happens before a compiler retargets it.

use std::ffi::CString;

use inkwell::llvm_sys::error::{LLVMDisposeErrorMessage, LLVMGetErrorMessage};
use inkwell::llvm_sys::transforms::pass_builder::{
    LLVMCreatePassBuilderOptions, LLVMDisposePassBuilderOptions, LLVMRunPasses,
};
use inkwell::module::Module;

use crate::error::{codegen, JitError};

/// The fusion pipeline after inlining (the DPC++ kernel-fusion design, "Fusion
/// Process": its post-fusion passes): scalar replacement of the kernels' private
/// variables, constant propagation of the scalars now baked in, and clean-up.
/// Loops are left for the target's own `O3` (unrolling and vectorizing there know
/// the target).
pub(super) const FUSION_PIPELINE: &str = "function(sroa,sccp,instcombine,simplifycfg,sroa,\
                                          instcombine,simplifycfg,adce,early-cse),globaldce";

/// Runs `passes` (the new pass manager's syntax) over `module`, with no target.
pub(super) fn run(module: &Module, passes: &str) -> Result<(), JitError> {
    let text = CString::new(passes).expect("pass names have no NUL");
    // SAFETY: a live module; the options are created and disposed here; a null
    // target machine is allowed (the pass builder then has no target information).
    unsafe {
        let options = LLVMCreatePassBuilderOptions();
        let error = LLVMRunPasses(module.as_mut_ptr(), text.as_ptr(), std::ptr::null_mut(), options);
        LLVMDisposePassBuilderOptions(options);
        if error.is_null() {
            return Ok(());
        }
        let message = LLVMGetErrorMessage(error);
        let text = std::ffi::CStr::from_ptr(message).to_string_lossy().into_owned();
        LLVMDisposeErrorMessage(message);
        Err(codegen(format!("running `{passes}`: {text}")))
    }
}
