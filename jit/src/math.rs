//! The OpenCL C math built-ins that are exactly one LLVM intrinsic, which both
//! targets lower natively: each call becomes that intrinsic on the same types.
//!
//! | OpenCL C            | LLVM intrinsic   |
//! |---------------------|------------------|
//! | `fabs`              | `llvm.fabs`      |
//! | `fmin`, `fmax`      | `llvm.minnum`, `llvm.maxnum` (OpenCL's rule: a NaN operand yields the other one) |
//! | `sqrt`              | `llvm.sqrt` (correctly rounded: `sqrt.rn` on NVPTX) |
//! | `floor`, `ceil`, `trunc`, `rint` | the same-named intrinsics |
//! | `round`             | `llvm.round` (halfway cases away from zero) |
//! | `fma`               | `llvm.fma`       |
//! | `copysign`          | `llvm.copysign`  |
//! | `mad`               | `llvm.fmuladd` (OpenCL lets `mad` be fused or not) |
//!
//! on `float` and `double` scalars and their 2-, 3-, 4-, 8- and 16-element vectors;
//! `fmin`/`fmax` of a vector and a scalar splat the scalar. Calls are recognised by
//! the Itanium-mangled names clang-19 gives these overloads for `spir64` (as it
//! emits them: `_Z4fmaxff`, `_Z4fmaxDv4_fS_`, `_Z4fmaxDv4_ff`, `_Z3fmaDv2_dS_S_`…),
//! and only where the call's types are the ones the name says. Every other
//! built-in (`exp`, `log`, `sin`, `pow`…, which would need libm on the host and
//! libdevice on NVPTX) is left alone, and preparation refuses it by name.

use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::Module;
use inkwell::types::{BasicType, BasicTypeEnum};
use inkwell::values::{
    BasicMetadataValueEnum, BasicValue, BasicValueEnum, FunctionValue, InstructionValue, Operand,
};

use crate::error::{codegen, JitError};
use crate::raw;

/// The translated built-ins: the mangled name's `<length><identifier>`, the
/// intrinsic, and the argument count.
const BUILTINS: &[(&str, &str, usize)] = &[
    ("4fabs", "llvm.fabs", 1),
    ("4sqrt", "llvm.sqrt", 1),
    ("5floor", "llvm.floor", 1),
    ("4ceil", "llvm.ceil", 1),
    ("5trunc", "llvm.trunc", 1),
    ("4rint", "llvm.rint", 1),
    ("5round", "llvm.round", 1),
    ("4fmin", "llvm.minnum", 2),
    ("4fmax", "llvm.maxnum", 2),
    ("8copysign", "llvm.copysign", 2),
    ("3fma", "llvm.fma", 3),
    ("3mad", "llvm.fmuladd", 3),
];

/// The vector widths OpenCL C has (`Dv<n>_` in a mangled name).
const WIDTHS: &[u32] = &[2, 3, 4, 8, 16];

/// A math built-in the JIT translates, as its mangled name describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Builtin {
    /// The LLVM intrinsic it becomes (overloaded on the call's type).
    pub intrinsic: &'static str,
    /// Its argument count.
    pub arity: usize,
    /// `double` rather than `float`.
    pub double: bool,
    /// The vector width; `None` for a scalar.
    pub width: Option<u32>,
    /// Whether the last argument is a scalar to splat (`fmin`/`fmax(gentype, float)`).
    pub splat_last: bool,
}

/// The built-in `name` is, if it is one the JIT translates.
///
/// Parameter encodings (clang-19, `spir64`): scalars repeat the type letter
/// (`_Z3fmafff`); vectors name the first parameter and refer back to it with the
/// substitution `S_` (`_Z3fmaDv4_fS_S_`); `fmin`/`fmax` also take a vector and a
/// scalar (`_Z4fminDv4_ff`).
pub(crate) fn builtin(name: &str) -> Option<Builtin> {
    let rest = name.strip_prefix("_Z")?;
    let &(base, intrinsic, arity) = BUILTINS.iter().find(|(base, ..)| rest.starts_with(base))?;
    let params = &rest[base.len()..];
    let two_arg_minmax = matches!(base, "4fmin" | "4fmax");
    for (letter, double) in [("f", false), ("d", true)] {
        if params == letter.repeat(arity) {
            return Some(Builtin { intrinsic, arity, double, width: None, splat_last: false });
        }
        for &n in WIDTHS {
            let first = format!("Dv{n}_{letter}");
            let Some(tail) = params.strip_prefix(&first) else { continue };
            let width = Some(n);
            if tail == "S_".repeat(arity - 1) {
                return Some(Builtin { intrinsic, arity, double, width, splat_last: false });
            }
            if two_arg_minmax && tail == letter {
                return Some(Builtin { intrinsic, arity, double, width, splat_last: true });
            }
        }
    }
    None
}

/// Replaces every call in `function` to a built-in [`builtin`] knows by its
/// intrinsic, and deletes the built-ins' declarations left unused. A call whose
/// types do not match its name is left as it is (preparation then refuses it).
pub(crate) fn translate<'ctx>(
    context: &'ctx Context,
    module: &Module<'ctx>,
    function: FunctionValue<'ctx>,
) -> Result<(), JitError> {
    let builder = context.create_builder();
    let mut callees = Vec::new();
    for call in raw::instructions(function) {
        let Some(name) = raw::callee_name(call) else { continue };
        let Some(b) = builtin(&name) else { continue };
        let Some(args) = typed_args(context, call, b) else { continue };
        let ty = args[0].get_type();
        builder.position_before(&call);
        let mut margs: Vec<BasicMetadataValueEnum> = args.iter().map(|&a| a.into()).collect();
        if b.splat_last {
            margs[b.arity - 1] = splat(context, &builder, args[b.arity - 1], ty)?.into();
        }
        let declaration = Intrinsic::find(b.intrinsic)
            .and_then(|i| i.get_declaration(module, &[ty]))
            .ok_or_else(|| codegen(format!("no declaration of `{}` for {ty}", b.intrinsic)))?;
        let new = builder.build_call(declaration, &margs, "").map_err(codegen)?;
        if let Ok(flags) = call.get_fast_math_flags() {
            if let Some(inst) = new.try_as_basic_value().basic().and_then(|v| v.as_instruction_value()) {
                let _ = inst.set_fast_math_flags(flags);
            }
        }
        raw::replace_uses(call, new);
        call.erase_from_basic_block();
        if let Some(callee) = module.get_function(&name) {
            if !callees.contains(&callee) {
                callees.push(callee);
            }
        }
    }
    for callee in callees {
        if callee.as_global_value().as_pointer_value().get_first_use().is_none()
            && callee.count_basic_blocks() == 0
        {
            raw::delete_function(callee);
        }
    }
    Ok(())
}

/// The arguments of `call` if its types are the ones `b`'s name says: the result
/// and every argument the same `float`/`double` scalar or vector (the last argument
/// that vector's element when it is splat).
fn typed_args<'ctx>(
    context: &'ctx Context,
    call: InstructionValue<'ctx>,
    b: Builtin,
) -> Option<Vec<BasicValueEnum<'ctx>>> {
    let element: BasicTypeEnum = if b.double {
        context.f64_type().as_basic_type_enum()
    } else {
        context.f32_type().as_basic_type_enum()
    };
    let ty = match b.width {
        None => element,
        Some(n) => match element {
            BasicTypeEnum::FloatType(f) => f.vec_type(n).as_basic_type_enum(),
            _ => return None,
        },
    };
    // A call's operands are its arguments, then the callee.
    if call.get_num_operands() as usize != b.arity + 1 || BasicTypeEnum::try_from(call.get_type()).ok()? != ty
    {
        return None;
    }
    let args: Vec<BasicValueEnum> = (0..b.arity as u32)
        .map(|i| match call.get_operand(i) {
            Some(Operand::Value(v)) => Some(v),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let expected = |i: usize| if b.splat_last && i == b.arity - 1 { element } else { ty };
    args.iter().enumerate().all(|(i, a)| a.get_type() == expected(i)).then_some(args)
}

/// `scalar` in every element of a vector of type `ty`.
fn splat<'ctx>(
    context: &'ctx Context,
    builder: &Builder<'ctx>,
    scalar: BasicValueEnum<'ctx>,
    ty: BasicTypeEnum<'ctx>,
) -> Result<BasicValueEnum<'ctx>, JitError> {
    let BasicTypeEnum::VectorType(vector) = ty else { return Ok(scalar) };
    let i32t = context.i32_type();
    let one =
        builder.build_insert_element(vector.get_poison(), scalar, i32t.const_zero(), "").map_err(codegen)?;
    let mask = i32t.vec_type(vector.get_size()).const_zero();
    Ok(builder.build_shuffle_vector(one, vector.get_poison(), mask, "").map_err(codegen)?.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names as clang-19 emits them for `spir64` (compiled from a kernel calling
    /// every overload with `-S`).
    #[test]
    fn clang_names_demangle() {
        let b = |name| builtin(name).unwrap_or_else(|| panic!("{name}"));
        let s = b("_Z4fmaxff");
        assert_eq!(
            (s.intrinsic, s.arity, s.double, s.width, s.splat_last),
            ("llvm.maxnum", 2, false, None, false)
        );
        let v = b("_Z3fmaDv16_dS_S_");
        assert_eq!((v.intrinsic, v.arity, v.double, v.width), ("llvm.fma", 3, true, Some(16)));
        let m = b("_Z4fminDv4_ff");
        assert_eq!((m.intrinsic, m.width, m.splat_last), ("llvm.minnum", Some(4), true));
        assert!(b("_Z4fmaxDv2_dd").splat_last && b("_Z4fmaxDv2_dd").double);
        for name in [
            "_Z4fabsf",
            "_Z4sqrtd",
            "_Z5floorDv3_f",
            "_Z4ceilDv8_d",
            "_Z5truncf",
            "_Z4rintDv2_f",
            "_Z5roundd",
            "_Z8copysignDv4_fS_",
            "_Z3madfff",
            "_Z3madDv8_fS_S_",
            "_Z8copysigndd",
        ] {
            b(name);
        }
        for other in [
            "_Z3expf",
            "_Z4sqrtDh",
            "_Z4fmaxfd",
            "_Z4fabsDv5_f",
            "_Z4fabsff",
            "_Z3fmaDv4_fS_",
            "_Z4sqrtDv4_ff",
            "_Z8copysignDv4_ff",
            "_Z13get_global_idj",
            "fabsf",
        ] {
            assert_eq!(builtin(other), None, "{other}");
        }
    }
}
