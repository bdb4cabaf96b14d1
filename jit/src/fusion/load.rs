//! Loading one listed kernel into the fused module: its image parsed, every
//! definition renamed after its place in the list (a kernel may appear more than
//! once, and two images may define functions of one name), its calls inlined into
//! its entry, and what the fusion needs to know about it read from the IR.

use gantry_driver::{CodeImage, Signature};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::targets::TargetData;
use inkwell::values::InstructionOpcode;

use super::passes::run;
use crate::builtins::{classify, Call};
use crate::error::JitError;
use crate::ir;
use crate::raw;
use crate::signature::{bind, param_kinds, Binding};

/// One listed kernel in a module of its own, ready to be linked into the fused one.
pub(super) struct Loaded<'ctx> {
    pub module: Module<'ctx>,
    /// Its entry's name after renaming.
    pub entry: String,
    /// Where each parameter's value comes from under its kernel's signature.
    pub bindings: Vec<Binding>,
    /// Barrier calls left in its entry after inlining.
    pub barriers: usize,
}

/// The prefix of every definition of list entry `index`.
pub(super) fn prefix(index: usize) -> String {
    format!("gantry_fuse_{index}_")
}

/// Loads `image` (list entry `index`, whose kernel has `signature`).
pub(super) fn load<'ctx>(
    context: &'ctx Context,
    image: &CodeImage,
    signature: &Signature,
    index: usize,
) -> Result<Loaded<'ctx>, JitError> {
    let module = ir::parse_image(context, image)?;
    let entry = ir::entry_function(&module, image.entry())?;
    let layout = TargetData::create(&module.get_data_layout().as_str().to_string_lossy());
    let kinds = param_kinds(entry, &layout)?;
    let bindings = bind(&kinds, signature)?;
    let prefix = prefix(index);
    let kind = Attribute::get_named_enum_kind_id;
    for f in module.get_functions() {
        // Call sites and callees must agree on conventions, and a spir_kernel may
        // not be called at all: everything becomes C, as `prepare` does.
        f.set_call_conventions(0);
        for inst in raw::instructions(f) {
            if inst.get_opcode() == InstructionOpcode::Call {
                raw::set_call_conv(inst, 0);
            }
        }
        if f.count_basic_blocks() == 0 {
            continue; // built-ins and intrinsics keep their names: they link
        }
        let name = raw::name(f);
        f.as_global_value().set_name(&format!("{prefix}{name}"));
        f.remove_enum_attribute(AttributeLoc::Function, kind("noinline"));
        f.remove_enum_attribute(AttributeLoc::Function, kind("optnone"));
        // The entry stays external until the stub calls it (an unused internal
        // function would be deleted by the inliner); the rest inline into it.
        if f != entry {
            f.set_linkage(Linkage::Internal);
            f.add_attribute(AttributeLoc::Function, context.create_enum_attribute(kind("alwaysinline"), 0));
        }
    }
    for g in module.get_globals() {
        if g.get_initializer().is_some() {
            let name = g.get_name().to_string_lossy().into_owned();
            g.set_name(&format!("{prefix}{name}"));
            g.set_linkage(Linkage::Internal);
        }
    }
    // Flatten the entry, so that its built-in calls, barriers and buffer accesses
    // are all in one function for the passes that follow.
    run(&module, "always-inline")?;
    // Math built-ins become intrinsics here already, so that the analyses of the
    // fused kernel (barrier elision) see arithmetic, not unknown calls.
    crate::math::translate(context, &module, entry)?;
    let name = raw::name(entry);
    let mut barriers = 0;
    for inst in raw::instructions(entry) {
        if inst.get_opcode() != InstructionOpcode::Call {
            continue;
        }
        if raw::calls_definition(inst) {
            return Err(JitError::Unsupported {
                function: raw::callee_name(inst).unwrap_or_default(),
                what: format!("a call from `{name}` that cannot be inlined (recursion)"),
            });
        }
        if raw::callee_name(inst).is_some_and(|n| classify(&n) == Call::Barrier) {
            barriers += 1;
        }
    }
    Ok(Loaded { module, entry: name, bindings, barriers })
}
