//! How an IR kernel's parameters map to a [`Signature`].
//!
//! The parameters, in declaration order, are matched to the signature's arguments:
//!
//! * a `ptr addrspace(1)` parameter (`__global`), or `ptr addrspace(2)`
//!   (`__constant`), is the next **global** argument;
//! * a `ptr addrspace(3)` parameter (`__local`) is the next
//!   [`ScratchKind::Local`] slot of [`Signature::memory`], whose `bytes` are the
//!   region each work-group gets;
//! * any other parameter is the next **scalar**, passed by value: its store size (by
//!   the module's data layout) must equal the scalar slot's size. The value is read
//!   from the scalar block at [`Signature::scalar_offset`], so the slot's alignment
//!   may differ from the IR type's.
//!
//! [`ScratchKind::Private`] slots have no parameter: an IR kernel's private memory is
//! its own `alloca`s, which the compiled code keeps per work-item; such slots are
//! accepted and unused. Pointer parameters in other address spaces and aggregates
//! passed `byval` are [`JitError::Unsupported`].
//!
//! [`signature_of`] derives a signature from the IR: a global is
//! [`AccessMode::Read`] when its parameter is `readonly` (clang infers this at `-O1`
//! for `const` pointers it only reads), [`AccessMode::Write`] when `writeonly`, and
//! [`AccessMode::ReadWrite`] otherwise; scalars get their IR type's store size and
//! ABI alignment; local slots get `bytes == 0`, since OpenCL sizes local memory at
//! launch: the caller sets each slot's bytes before compiling.

use gantry_driver::{AccessMode, CodeImage, ScalarSlot, Scratch, ScratchKind, Signature};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::targets::TargetData;
use inkwell::types::{AnyType, BasicTypeEnum};
use inkwell::values::FunctionValue;

use crate::error::JitError;
use crate::ir;
use crate::raw;

/// What one kernel parameter is, read from the IR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ParamKind {
    /// A global (or constant) buffer, with the access the IR allows.
    Global(AccessMode),
    /// A local-memory region.
    Local,
    /// A value of `size` bytes aligned to `align`.
    Scalar { size: u32, align: u32 },
}

/// Where one kernel parameter's value comes from at a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Binding {
    /// Global argument `index`.
    Global(usize),
    /// Local slot `slot` (counting local slots only) of `bytes` bytes, cleared for
    /// every work-group when `zeroed`.
    Local { slot: usize, bytes: usize, zeroed: bool },
    /// Scalar `index`, at `offset` in the scalar block, whose slot is aligned to
    /// `align`.
    Scalar { offset: usize, align: u32 },
}

/// The kinds of `function`'s parameters, sized by `module_layout` (the data layout
/// the IR was written for).
pub(crate) fn param_kinds(function: FunctionValue, layout: &TargetData) -> Result<Vec<ParamKind>, JitError> {
    let name = function.get_name().to_string_lossy().into_owned();
    let attr = |i: u32, what: &str| {
        function.get_enum_attribute(AttributeLoc::Param(i), Attribute::get_named_enum_kind_id(what)).is_some()
    };
    let mut kinds = Vec::new();
    for (i, param) in function.get_param_iter().enumerate() {
        let i32_ = i as u32;
        let ty = param.get_type();
        let kind = match ty {
            BasicTypeEnum::PointerType(p) => {
                let space = raw::address_space(p);
                if attr(i32_, "byval") {
                    return Err(JitError::Unsupported {
                        function: name,
                        what: format!("parameter {i} is an aggregate passed by value (byval)"),
                    });
                }
                match space {
                    1 | 2 => ParamKind::Global(if space == 2 || attr(i32_, "readonly") {
                        AccessMode::Read
                    } else if attr(i32_, "writeonly") {
                        AccessMode::Write
                    } else {
                        AccessMode::ReadWrite
                    }),
                    3 => ParamKind::Local,
                    other => {
                        return Err(JitError::Unsupported {
                            function: name,
                            what: format!(
                                "parameter {i} is a pointer in address space {other} \
                                 (kernel pointers are __global (1), __constant (2) or __local (3))"
                            ),
                        })
                    }
                }
            }
            other => ParamKind::Scalar {
                size: layout.get_store_size(&other.as_any_type_enum()) as u32,
                align: layout.get_abi_alignment(&other.as_any_type_enum()),
            },
        };
        kinds.push(kind);
    }
    Ok(kinds)
}

/// Matches `kinds` (a kernel's parameters) to `signature`: the binding of each
/// parameter, or the first mismatch.
pub(crate) fn bind(kinds: &[ParamKind], signature: &Signature) -> Result<Vec<Binding>, JitError> {
    let locals: Vec<&Scratch> = signature.memory.iter().filter(|s| s.kind == ScratchKind::Local).collect();
    let (mut g, mut l, mut s) = (0usize, 0usize, 0usize);
    let mut out = Vec::with_capacity(kinds.len());
    for (param, kind) in kinds.iter().enumerate() {
        let mismatch = |expected: String, found: &str| JitError::SignatureMismatch {
            param,
            expected,
            found: found.to_owned(),
        };
        match *kind {
            ParamKind::Global(_) => {
                if g >= signature.globals.len() {
                    return Err(mismatch(
                        format!("no more globals (it has {})", signature.globals.len()),
                        "a global pointer",
                    ));
                }
                out.push(Binding::Global(g));
                g += 1;
            }
            ParamKind::Local => {
                let Some(slot) = locals.get(l) else {
                    return Err(mismatch(
                        format!("no more local slots (it has {})", locals.len()),
                        "a __local pointer",
                    ));
                };
                out.push(Binding::Local { slot: l, bytes: slot.bytes, zeroed: slot.zeroed });
                l += 1;
            }
            ParamKind::Scalar { size, .. } => {
                let Some(slot) = signature.scalars.get(s) else {
                    return Err(mismatch(
                        format!("no more scalars (it has {})", signature.scalars.len()),
                        &format!("a {size}-byte scalar"),
                    ));
                };
                if slot.size != size {
                    return Err(mismatch(
                        format!("scalar {s} of {} bytes", slot.size),
                        &format!("{size} bytes"),
                    ));
                }
                out.push(Binding::Scalar { offset: signature.scalar_offset(s), align: slot.align });
                s += 1;
            }
        }
    }
    let extra = |what: &str, n: usize| JitError::SignatureMismatch {
        param: kinds.len(),
        expected: format!("{n} {what}"),
        found: "no more parameters".to_owned(),
    };
    if g < signature.globals.len() {
        return Err(extra("globals", signature.globals.len()));
    }
    if s < signature.scalars.len() {
        return Err(extra("scalars", signature.scalars.len()));
    }
    if l < locals.len() {
        return Err(extra("local slots", locals.len()));
    }
    Ok(out)
}

/// The signature an [`ImageKind::LlvmIr`](gantry_driver::ImageKind::LlvmIr) image's
/// entry implies (see the [module docs](self)): set the bytes of each local slot
/// before compiling.
///
/// ```no_run
/// use gantry_driver::{AccessMode, Signature};
/// let image = gantry_jit::from_opencl_c(
///     "kernel void k(global const float* a, global float* b, float s) { b[0] = a[0] * s; }",
///     "k",
/// )?;
/// let sig = gantry_jit::signature_of(&image)?;
/// assert_eq!(sig, Signature::new().global(AccessMode::Read).global(AccessMode::Write).scalar::<f32>());
/// # Ok::<(), gantry_jit::JitError>(())
/// ```
pub fn signature_of(image: &CodeImage) -> Result<Signature, JitError> {
    let context = Context::create();
    let module = ir::parse_image(&context, image)?;
    let function = ir::entry_function(&module, image.entry())?;
    let layout = TargetData::create(&module.get_data_layout().as_str().to_string_lossy());
    let mut signature = Signature::new();
    for kind in param_kinds(function, &layout)? {
        match kind {
            ParamKind::Global(mode) => signature = signature.global(mode),
            ParamKind::Local => signature.memory.push(Scratch::new(ScratchKind::Local, 0)),
            ParamKind::Scalar { size, align } => signature.scalars.push(ScalarSlot { size, align }),
        }
    }
    Ok(signature)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds() -> Vec<ParamKind> {
        vec![
            ParamKind::Global(AccessMode::Read),
            ParamKind::Scalar { size: 4, align: 4 },
            ParamKind::Local,
            ParamKind::Global(AccessMode::Write),
            ParamKind::Scalar { size: 8, align: 8 },
        ]
    }

    /// Parameters take globals, locals and scalars in order, each by its own count.
    #[test]
    fn parameters_bind_in_declaration_order() {
        let sig = Signature::new()
            .global(AccessMode::Read)
            .global(AccessMode::ReadWrite)
            .scalar::<f32>()
            .scalar::<u64>()
            .local(256);
        let b = bind(&kinds(), &sig).unwrap();
        assert_eq!(
            b,
            [
                Binding::Global(0),
                Binding::Scalar { offset: 0, align: 4 },
                Binding::Local { slot: 0, bytes: 256, zeroed: true },
                Binding::Global(1),
                Binding::Scalar { offset: 8, align: 8 },
            ]
        );
    }

    /// Each kind of mismatch names the parameter.
    #[test]
    fn mismatches_name_the_parameter() {
        let full = Signature::new()
            .global(AccessMode::Read)
            .global(AccessMode::Read)
            .scalar::<f32>()
            .scalar::<u64>();
        let param = |sig: &Signature| match bind(&kinds(), sig) {
            Err(JitError::SignatureMismatch { param, .. }) => param,
            other => panic!("expected a mismatch, got {other:?}"),
        };
        assert_eq!(param(&full), 2, "no local slot");
        let wrong_size = Signature::new().global(AccessMode::Read).scalar::<f64>();
        assert_eq!(param(&wrong_size), 1);
        let extra = full.clone().local(4).scalar::<u8>();
        assert_eq!(param(&extra), 5, "a scalar the kernel does not have");
        let one_global = Signature::new().global(AccessMode::Read).scalar::<f32>().local(4);
        assert_eq!(param(&one_global), 3);
    }
}
