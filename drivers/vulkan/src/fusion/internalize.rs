//! Internalization (the DPC++ kernel-fusion design, "Internalization Behavior"): a
//! buffer the rules promote becomes, in naga IR, a fixed-size array of the promoted
//! size in private (per work-item) or workgroup memory, and every index into it
//! becomes `index % elements` ([`wrap_indices`], on the part's text).
//!
//! Only a buffer the kernel reaches by indexing it directly (`buf[i]`, `buf[3]`)
//! is rewritten: a load or store of the whole array, `arrayLength`, a pointer
//! passed to a function or used by an atomic keep the buffer in global memory
//! ([`rewritable`] says no, and the compiler warns with
//! `PromotionMismatch::AccessNotRewritable`), as the LLVM IR compiler does for
//! pointers it cannot follow.

use naga::{AddressSpace, Block, Expression, Handle, Module, Span, Statement, TypeInner};

/// The expressions that are `global` itself, per function (including entry points).
fn global_exprs(f: &naga::Function, global: Handle<naga::GlobalVariable>) -> Vec<Handle<Expression>> {
    f.expressions
        .iter()
        .filter(|(_, e)| matches!(e, Expression::GlobalVariable(g) if *g == global))
        .map(|(h, _)| h)
        .collect()
}

fn functions(module: &Module) -> impl Iterator<Item = &naga::Function> {
    module.functions.iter().map(|(_, f)| f).chain(module.entry_points.iter().map(|e| &e.function))
}

/// Whether every use of `global` in `module` indexes it directly (see the module
/// docs).
pub(super) fn rewritable(module: &Module, global: Handle<naga::GlobalVariable>) -> bool {
    functions(module).all(|f| {
        let mine = global_exprs(f, global);
        if mine.is_empty() {
            return true;
        }
        let is = |h: &Handle<Expression>| mine.contains(h);
        let expressions_ok = f.expressions.iter().all(|(_, e)| match e {
            Expression::Access { index, .. } => !is(index),
            Expression::AccessIndex { .. } => true,
            Expression::Load { pointer } => !is(pointer),
            Expression::ArrayLength(p) => !is(p),
            _ => true,
        });
        expressions_ok && block_ok(&f.body, &is)
    })
}

/// Whether no statement of `block` uses one of the global's own expressions
/// directly (a whole-array store, a call argument, an atomic).
fn block_ok(block: &Block, is: &dyn Fn(&Handle<Expression>) -> bool) -> bool {
    block.iter().all(|s| match s {
        Statement::Block(b) => block_ok(b, is),
        Statement::If { accept, reject, .. } => block_ok(accept, is) && block_ok(reject, is),
        Statement::Switch { cases, .. } => cases.iter().all(|c| block_ok(&c.body, is)),
        Statement::Loop { body, continuing, .. } => block_ok(body, is) && block_ok(continuing, is),
        Statement::Store { pointer, value } => !is(pointer) && !is(value),
        Statement::Call { arguments, .. } => !arguments.iter().any(is),
        Statement::Atomic { pointer, .. } => !is(pointer),
        Statement::WorkGroupUniformLoad { pointer, .. } => !is(pointer),
        Statement::Return { value } => !value.as_ref().is_some_and(is),
        _ => true,
    })
}

/// Whether `block` has a work-group or memory barrier.
pub(super) fn has_barriers(block: &Block) -> bool {
    block.iter().any(|s| match s {
        Statement::ControlBarrier(_)
        | Statement::MemoryBarrier(_)
        | Statement::WorkGroupUniformLoad { .. } => true,
        Statement::Block(b) => has_barriers(b),
        Statement::If { accept, reject, .. } => has_barriers(accept) || has_barriers(reject),
        Statement::Switch { cases, .. } => cases.iter().any(|c| has_barriers(&c.body)),
        Statement::Loop { body, continuing, .. } => has_barriers(body) || has_barriers(continuing),
        _ => false,
    })
}

/// Makes `global` (a runtime-sized storage array, [`rewritable`]) an array of
/// `elements` in `space` named `name`, each index taken modulo `elements`.
pub(super) fn internalize(
    module: &mut Module,
    global: Handle<naga::GlobalVariable>,
    elements: u32,
    space: AddressSpace,
    name: String,
) -> Result<(), String> {
    let old = module.global_variables[global].ty;
    let TypeInner::Array { base, stride, .. } = module.types[old].inner else {
        return Err("an internalized buffer is not an array".into());
    };
    let count = std::num::NonZeroU32::new(elements).ok_or("an internal buffer of no elements")?;
    let ty = module.types.insert(
        naga::Type {
            name: None,
            inner: TypeInner::Array { base, size: naga::ArraySize::Constant(count), stride },
        },
        Span::UNDEFINED,
    );
    let var = &mut module.global_variables[global];
    var.ty = ty;
    var.space = space;
    var.binding = None;
    var.init = None;
    var.name = Some(name);
    Ok(())
}

/// Wraps every index into internal buffer `name` in naga's WGSL text of a part:
/// `name[i]` becomes `name[u32(i) % elements]` (naga's arena must stay in
/// dependency order, which rules out appending the new expressions in IR). The
/// buffer was checked [`rewritable`], so naga writes it only indexed; an
/// occurrence that is not is refused rather than left unwrapped.
pub(super) fn wrap_indices(text: &str, name: &str, elements: u32) -> Result<String, String> {
    let mut out = String::with_capacity(text.len() + 64);
    let mut rest = text;
    while let Some(at) = rest.find(name) {
        let end = at + name.len();
        let boundary = |c: Option<char>| c.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        if !boundary(rest[..at].chars().next_back()) || !boundary(rest[end..].chars().next()) {
            out.push_str(&rest[..end]);
            rest = &rest[end..];
            continue;
        }
        if !rest[end..].starts_with('[') {
            return Err(format!(
                "the internalized buffer is used other than indexed: `{}`",
                &rest[at..(end + 16).min(rest.len())]
            ));
        }
        let open = end + 1;
        let mut depth = 1usize;
        let mut close = None;
        for (i, c) in rest[open..].char_indices() {
            match c {
                '[' => depth += 1,
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(open + i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let close = close.ok_or("an unbalanced index into an internalized buffer")?;
        out.push_str(&rest[..open]);
        out.push_str("u32(");
        out.push_str(&wrap_indices(&rest[open..close], name, elements)?);
        out.push_str(&format!(") % {elements}u]"));
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
