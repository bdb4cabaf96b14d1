//! Barrier elision: which kernels touch only their own elements.
//!
//! A barrier between two fused kernels orders one work-item's accesses against the
//! others' of its work-group. If every kernel of the list runs over the fused grid
//! unremapped and reaches memory (storage, workgroup or private) only at index
//! `global_invocation_id.x`, each work-item reads and writes only elements no other
//! work-item touches, in list order, so the barriers change nothing and are left
//! out, as the LLVM IR compiler does (its `private_access` analysis). The check is
//! conservative: anything it does not recognize keeps the barriers.

use naga::{AddressSpace, BuiltIn, Expression, Handle, Module, Statement};

/// Whether the entry point `entry` of `module` reaches memory only at its own
/// global invocation id's `x` (see the module docs): it calls no function and no
/// atomic, has no barrier, and every index into a memory global is that
/// expression.
pub(super) fn own_elements_only(module: &Module, entry: usize) -> bool {
    let f = &module.entry_points[entry].function;
    let Some(id_arg) = f
        .arguments
        .iter()
        .position(|a| matches!(a.binding, Some(naga::Binding::BuiltIn(BuiltIn::GlobalInvocationId))))
    else {
        return false;
    };
    let own = |h: Handle<Expression>| {
        matches!(f.expressions[h], Expression::AccessIndex { base, index: 0 }
            if matches!(f.expressions[base], Expression::FunctionArgument(a) if a as usize == id_arg))
    };
    let memory = |h: Handle<Expression>| match f.expressions[h] {
        Expression::GlobalVariable(g) => matches!(
            module.global_variables[g].space,
            AddressSpace::Storage { .. } | AddressSpace::WorkGroup | AddressSpace::Private
        ),
        _ => false,
    };
    let expressions_ok = f.expressions.iter().all(|(_, e)| match *e {
        // `buf[i]` only at the own index, and only directly on the buffer.
        Expression::Access { base, index } => !memory(base) || own(index),
        // `buf[3]` (a constant index into memory).
        Expression::AccessIndex { base, .. } => !memory(base),
        // The whole buffer loaded.
        Expression::Load { pointer } => !memory(pointer),
        Expression::CallResult(_) | Expression::AtomicResult { .. } => false,
        _ => true,
    });
    expressions_ok && block_ok(&f.body, &memory)
}

/// Whether no statement of `block` calls, synchronizes, uses an atomic or stores to
/// a whole memory global.
fn block_ok(block: &naga::Block, memory: &dyn Fn(Handle<Expression>) -> bool) -> bool {
    block.iter().all(|s| match s {
        Statement::Block(b) => block_ok(b, memory),
        Statement::If { accept, reject, .. } => block_ok(accept, memory) && block_ok(reject, memory),
        Statement::Switch { cases, .. } => cases.iter().all(|c| block_ok(&c.body, memory)),
        Statement::Loop { body, continuing, .. } => block_ok(body, memory) && block_ok(continuing, memory),
        Statement::Store { pointer, .. } => !memory(*pointer),
        Statement::Call { .. }
        | Statement::Atomic { .. }
        | Statement::ControlBarrier(_)
        | Statement::MemoryBarrier(_)
        | Statement::WorkGroupUniformLoad { .. } => false,
        _ => true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(source: &str) -> bool {
        let module = naga::front::wgsl::parse_str(source).expect("valid WGSL");
        own_elements_only(&module, 0)
    }

    const HEAD: &str = "struct S { n: u32, a: f32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {";

    #[test]
    fn an_elementwise_step_touches_only_its_own_elements() {
        assert!(check(&format!("{HEAD} if id.x < s.n {{ y[id.x] = s.a * x[id.x]; }} }}")));
    }

    #[test]
    fn a_neighbour_a_constant_index_a_barrier_or_a_call_keeps_the_barriers() {
        assert!(
            !check(&format!("{HEAD} if id.x + 1u < s.n {{ y[id.x] = x[id.x + 1u]; }} }}")),
            "a neighbour"
        );
        assert!(!check(&format!("{HEAD} y[id.x] = x[0]; }}")), "a constant index");
        assert!(!check(&format!("{HEAD} y[id.x] = x[id.x]; workgroupBarrier(); }}")), "a barrier");
        assert!(!check(&format!("{HEAD} y[id.y] = x[id.y]; }}")), "another dimension");
        let call = "@group(0) @binding(0) var<storage, read_write> y: array<f32>;
fn twice(v: f32) -> f32 { return 2.0 * v; }
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) { y[id.x] = twice(y[id.x]); }";
        assert!(!check(call), "a call");
        let no_id = "@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) { y[i] = 1.0; }";
        assert!(!check(no_id), "no global id");
    }
}
