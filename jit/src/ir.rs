//! LLVM IR kernel images: made from OpenCL C (clang at run time) or from IR bytes
//! (text or bitcode, e.g. compiled by a build script), and read back into LLVM.
//!
//! An image's kernel is a function with OpenCL's work-item built-ins (as clang-19
//! names them for `spir64`: `_Z13get_global_idj`, `_Z7barrierj`, ...) whose
//! parameters map to a [`Signature`](gantry_driver::Signature) as
//! [`crate::signature`] describes. Everything else the entry calls must be defined
//! in the module (it is inlined) or be an LLVM intrinsic.

use gantry_driver::{CodeImage, ImageKind};
use inkwell::context::Context;
use inkwell::memory_buffer::MemoryBuffer;
use inkwell::module::Module;
use inkwell::values::FunctionValue;

use crate::error::JitError;

/// Compiles OpenCL C `source` with clang-19 (`$GANTRY_CLANG` overrides the binary;
/// the arguments are [`gantry_jit_clang::CLANG_ARGS`]) into an
/// [`ImageKind::LlvmIr`] image (bitcode) whose entry is `entry`.
///
/// ```no_run
/// let image = gantry_jit::from_opencl_c(
///     "kernel void twice(global float* a) { size_t i = get_global_id(0); a[i] *= 2.0f; }",
///     "twice",
/// )?;
/// assert_eq!(image.entry(), "twice");
/// # Ok::<(), gantry_jit::JitError>(())
/// ```
pub fn from_opencl_c(source: &str, entry: &str) -> Result<CodeImage, JitError> {
    let bitcode = gantry_jit_clang::compile_opencl(source)?;
    from_llvm_ir(&bitcode, entry)
}

/// An [`ImageKind::LlvmIr`] image of `bytes` (LLVM IR text or bitcode) whose entry
/// is `entry`, after checking that LLVM 19 reads the bytes and that they define
/// `entry`. The route for kernels compiled ahead of time:
///
/// ```ignore
/// static SAXPY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/saxpy.bc"));
/// let image = gantry_jit::from_llvm_ir(SAXPY, "saxpy")?;
/// ```
pub fn from_llvm_ir(bytes: &[u8], entry: &str) -> Result<CodeImage, JitError> {
    let context = Context::create();
    let module = parse(&context, bytes, "image")?;
    entry_function(&module, entry)?;
    Ok(CodeImage::new(ImageKind::LlvmIr, entry, bytes.to_vec()))
}

/// Reads `bytes` (text or bitcode) into a module of `context`.
pub(crate) fn parse<'ctx>(
    context: &'ctx Context,
    bytes: &[u8],
    name: &str,
) -> Result<Module<'ctx>, JitError> {
    let buffer = MemoryBuffer::create_from_memory_range_copy(bytes, name);
    context.create_module_from_ir(buffer).map_err(|e| JitError::IrParse { message: e.to_string() })
}

/// Reads an [`ImageKind::LlvmIr`] image into `context`.
pub(crate) fn parse_image<'ctx>(context: &'ctx Context, image: &CodeImage) -> Result<Module<'ctx>, JitError> {
    if image.kind() != ImageKind::LlvmIr {
        return Err(JitError::IrParse { message: format!("a {} image is not LLVM IR", image.kind()) });
    }
    parse(context, image.code(), image.entry())
}

/// The definition of `entry` in `module`.
pub(crate) fn entry_function<'ctx>(
    module: &Module<'ctx>,
    entry: &str,
) -> Result<FunctionValue<'ctx>, JitError> {
    match module.get_function(entry) {
        Some(f) if f.count_basic_blocks() > 0 => Ok(f),
        _ => Err(JitError::EntryNotFound {
            entry: entry.to_owned(),
            available: module
                .get_functions()
                .filter(|f| f.count_basic_blocks() > 0)
                .map(|f| f.get_name().to_string_lossy().into_owned())
                .collect(),
        }),
    }
}
