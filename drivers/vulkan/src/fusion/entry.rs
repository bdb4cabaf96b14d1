//! The fused module's own text: the buffers declared once (fused arguments as
//! storage buffers of group 0 in fused-argument order, internal buffers as
//! private or workgroup arrays), its workgroup size as overrides the launch sets
//! (as for any WGSL kernel), and the entry point calling each kernel's part in
//! list order with barriers between.

use std::fmt::Write as _;

use naga::{AddressSpace, BuiltIn};

use super::kernel::{arg_name, internal_name, Element, Part};

/// The fused module's entry point.
pub(super) const ENTRY: &str = "gantry_fused";

/// A fused argument's declaration.
pub(super) struct ArgDecl {
    pub element: Element,
    pub writes: bool,
}

/// An internal buffer's declaration.
pub(super) struct InternalDecl {
    pub element: Element,
    pub elements: u32,
    pub space: AddressSpace,
}

/// How a part is called.
pub(super) struct Call {
    /// Work-items at or past this linear id (Vulkan's `x` fastest) skip it, by
    /// global id where `by_group` is false, else by work-group (its barriers then
    /// stay in uniform control flow; the group count is whole, checked by the
    /// caller).
    pub guard: Option<Guard>,
    /// Whether barriers follow it.
    pub barrier_after: bool,
}

/// A part's guard: it runs where the grid's index along dimension `dim` (Vulkan
/// order) is below `limit`, counted in work-items or, `by_group`, in groups.
pub(super) struct Guard {
    pub dim: usize,
    pub limit: u32,
    pub by_group: bool,
}

/// The fused module's text: the parts, then the declarations and the entry point.
pub(super) fn module_text(
    args: &[ArgDecl],
    internal: &[InternalDecl],
    parts: &[Part],
    calls: &[Call],
) -> String {
    let mut enables: Vec<&str> = Vec::new();
    let mut body = String::new();
    for p in parts {
        for line in p.text.lines() {
            if line.starts_with("enable ") {
                if !enables.contains(&line) {
                    enables.push(line);
                }
            } else {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    let mut out = String::new();
    for e in enables {
        out.push_str(e);
        out.push('\n');
    }
    out.push_str(&body);
    for (j, a) in args.iter().enumerate() {
        let access = if a.writes { "read_write" } else { "read" };
        let _ = writeln!(
            out,
            "@group(0) @binding({j}) var<storage, {access}> {}: array<{}>;",
            arg_name(j as u32),
            a.element.wgsl
        );
    }
    for (j, g) in internal.iter().enumerate() {
        let space = if g.space == AddressSpace::WorkGroup { "workgroup" } else { "private" };
        let _ = writeln!(
            out,
            "var<{space}> {}: array<{}, {}>;",
            internal_name(j as u32),
            g.element.wgsl,
            g.elements
        );
    }
    out.push_str(
        "override gantry_wx: u32 = 64;\noverride gantry_wy: u32 = 1;\noverride gantry_wz: u32 = 1;\n\
         @compute @workgroup_size(gantry_wx, gantry_wy, gantry_wz)\n\
         fn gantry_fused(@builtin(global_invocation_id) gantry_gid: vec3<u32>, \
         @builtin(local_invocation_id) gantry_lid: vec3<u32>, \
         @builtin(local_invocation_index) gantry_lidx: u32, \
         @builtin(workgroup_id) gantry_wid: vec3<u32>, \
         @builtin(num_workgroups) gantry_nwg: vec3<u32>) {\n",
    );
    for (p, c) in parts.iter().zip(calls) {
        let params: Vec<&str> = p
            .builtins
            .iter()
            .map(|b| match b {
                BuiltIn::GlobalInvocationId => "gantry_gid",
                BuiltIn::LocalInvocationId => "gantry_lid",
                BuiltIn::LocalInvocationIndex => "gantry_lidx",
                BuiltIn::WorkGroupId => "gantry_wid",
                _ => "gantry_nwg",
            })
            .collect();
        let call = format!("{}({});", p.function, params.join(", "));
        match &c.guard {
            Some(g) => {
                let of = if g.by_group { "gantry_wid" } else { "gantry_gid" };
                let axis = ["x", "y", "z"][g.dim];
                let _ = writeln!(out, "    if {of}.{axis} < {}u {{ {call} }}", g.limit);
            }
            None => {
                let _ = writeln!(out, "    {call}");
            }
        }
        if c.barrier_after {
            out.push_str("    storageBarrier();\n    workgroupBarrier();\n");
        }
    }
    out.push_str("}\n");
    out
}
