//! One listed kernel made a part of a fused module, on naga IR: its WGSL parsed,
//! every module-level name prefixed with its place in the list, its buffers named
//! after the fused argument or internal buffer they become (whose declarations the
//! fused module makes once, `entry`), its scalars folded into a private variable
//! initialized with their values, its workgroup-size overrides given the launch's
//! values, and its entry point made a plain function taking its built-ins; then
//! written back as WGSL text.

use naga::{
    AddressSpace, BuiltIn, Expression, Handle, Literal, Module, ScalarKind, Span, TypeInner, VectorSize,
};

use super::internalize;

/// What a buffer slot of the kernel becomes.
#[derive(Clone, Copy, Debug)]
pub(super) enum SlotAs {
    /// Fused argument `index`.
    Arg(u32),
    /// Internal buffer `index` of `elements` elements in `space` (private or
    /// workgroup).
    Internal { index: u32, elements: u32, space: AddressSpace },
}

/// A kernel's module, parsed, with its entry point.
pub(super) struct Parsed {
    pub module: Module,
    pub entry: usize,
}

/// The element type of a buffer, in WGSL, and its size in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Element {
    pub wgsl: String,
    pub bytes: usize,
}

/// A kernel's part of the fused module.
pub(super) struct Part {
    /// Its module as WGSL text, without the declarations of its buffers.
    pub text: String,
    /// The function its entry point became.
    pub function: String,
    /// Its parameters' built-ins, in order.
    pub builtins: Vec<BuiltIn>,
    /// Whether it has work-group or storage barriers.
    pub barriers: bool,
    /// Whether it uses work-group built-ins, workgroup memory or barriers: its
    /// work-groups matter.
    pub uses_groups: bool,
}

/// The name a fused argument's buffer has in every part.
pub(super) fn arg_name(index: u32) -> String {
    format!("gantry_arg{index}_buf")
}

/// The name an internal buffer has in every part.
pub(super) fn internal_name(index: u32) -> String {
    format!("gantry_internal{index}_mem")
}

/// The function kernel `i`'s entry point becomes.
pub(super) fn function_name(i: usize) -> String {
    format!("k{i}_body")
}

/// Parses `source` and finds compute entry point `entry`.
pub(super) fn parse(source: &[u8], entry: &str) -> Result<Parsed, String> {
    let text = std::str::from_utf8(source).map_err(|e| format!("the WGSL is not UTF-8: {e}"))?;
    let module = naga::front::wgsl::parse_str(text).map_err(|e| e.emit_to_string(text))?;
    let entry = module
        .entry_points
        .iter()
        .position(|e| e.name == entry && e.stage == naga::ShaderStage::Compute)
        .ok_or_else(|| format!("no compute entry point `{entry}`"))?;
    Ok(Parsed { module, entry })
}

/// The storage buffer of slot `slot` (binding `slot` of group 0), if declared.
pub(super) fn slot_global(module: &Module, slot: u32) -> Option<Handle<naga::GlobalVariable>> {
    module.global_variables.iter().find_map(|(h, v)| {
        let b = v.binding.as_ref()?;
        (v.space.is_storage_buffer() && b.group == 0 && b.binding == slot).then_some(h)
    })
}

trait StorageSpace {
    fn is_storage_buffer(&self) -> bool;
}
impl StorageSpace for AddressSpace {
    fn is_storage_buffer(&self) -> bool {
        matches!(self, AddressSpace::Storage { .. })
    }
}

/// The element of buffer `global`: it must be a runtime-sized array of 32-bit
/// scalars or vectors of them.
pub(super) fn element(module: &Module, global: Handle<naga::GlobalVariable>) -> Result<Element, String> {
    let var = &module.global_variables[global];
    let name = var.name.as_deref().unwrap_or("?");
    let TypeInner::Array { base, size: naga::ArraySize::Dynamic, .. } = module.types[var.ty].inner else {
        return Err(format!("buffer `{name}` is not a runtime-sized array (`array<T>`)"));
    };
    let scalar = |s: naga::Scalar| match (s.kind, s.width) {
        (ScalarKind::Float, 4) => Some("f32"),
        (ScalarKind::Uint, 4) => Some("u32"),
        (ScalarKind::Sint, 4) => Some("i32"),
        _ => None,
    };
    let found = match module.types[base].inner {
        TypeInner::Scalar(s) => scalar(s).map(|t| (t.to_owned(), 4)),
        TypeInner::Vector { size, scalar: s } => {
            let n = match size {
                VectorSize::Bi => 2,
                VectorSize::Tri => 3,
                VectorSize::Quad => 4,
            };
            // vec3's array stride is 16 bytes.
            scalar(s).map(|t| (format!("vec{n}<{t}>"), if n == 3 { 16 } else { 4 * n }))
        }
        _ => None,
    };
    let (wgsl, bytes) = found
        .ok_or_else(|| format!("buffer `{name}` holds elements other than 32-bit scalars or vectors"))?;
    Ok(Element { wgsl, bytes })
}

/// Whether kernel code reaches `global` only by indexing it (so internalizing
/// can rewrite the index); see module `internalize`.
pub(super) fn rewritable(module: &Module, global: Handle<naga::GlobalVariable>) -> bool {
    internalize::rewritable(module, global)
}

/// Makes kernel `i` (parsed) a part: see the module docs. `slots` says what each
/// buffer slot becomes, `scalars` are its scalar bytes, `local` its work-group
/// size (Vulkan order) as the launch would set it.
pub(super) fn make_part(
    i: usize,
    mut parsed: Parsed,
    slots: &[SlotAs],
    scalars: &[u8],
    local: [u32; 3],
) -> Result<Part, String> {
    let module = &mut parsed.module;
    let prefix =
        |name: &Option<String>, fallback: &str| Some(format!("k{i}_{}", name.as_deref().unwrap_or(fallback)));
    // Named types (structs).
    let named: Vec<(Handle<naga::Type>, naga::Type)> = module
        .types
        .iter()
        .filter(|(_, t)| t.name.is_some())
        .map(|(h, t)| (h, naga::Type { name: prefix(&t.name, "type"), inner: t.inner.clone() }))
        .collect();
    for (h, t) in named {
        module.types.replace(h, t);
    }
    for (_, c) in module.constants.iter_mut() {
        c.name = prefix(&c.name, "constant");
    }
    for (_, f) in module.functions.iter_mut() {
        f.name = prefix(&f.name, "function");
    }
    // Workgroup-size overrides take the launch's size; the others keep their
    // defaults (or fail validation below, naming them, as unfused).
    let entry = module.entry_points.swap_remove(parsed.entry);
    module.entry_points.clear();
    if let Some(dims) = entry.workgroup_size_overrides {
        for (d, e) in dims.iter().enumerate() {
            let Some(e) = e else { continue };
            if let Expression::Override(o) = module.global_expressions[*e] {
                let value = module
                    .global_expressions
                    .append(Expression::Literal(Literal::U32(local[d])), Span::UNDEFINED);
                module.overrides[o].init = Some(value);
            }
        }
    }
    for (_, o) in module.overrides.iter_mut() {
        o.name = prefix(&o.name, "override");
        o.id = None;
    }
    // The entry point as a function of its built-ins.
    let mut function = entry.function;
    let mut builtins = Vec::with_capacity(function.arguments.len());
    for a in function.arguments.iter_mut() {
        match a.binding.take() {
            Some(naga::Binding::BuiltIn(b)) => builtins.push(b),
            _ => return Err("an entry-point parameter that is not a built-in".into()),
        }
    }
    let name = function_name(i);
    function.name = Some(name.clone());
    let uses_groups_builtin = builtins.iter().any(|b| {
        matches!(
            b,
            BuiltIn::LocalInvocationId
                | BuiltIn::LocalInvocationIndex
                | BuiltIn::WorkGroupId
                | BuiltIn::NumWorkGroups
        )
    });
    for b in &builtins {
        if !matches!(
            b,
            BuiltIn::GlobalInvocationId
                | BuiltIn::LocalInvocationId
                | BuiltIn::LocalInvocationIndex
                | BuiltIn::WorkGroupId
                | BuiltIn::NumWorkGroups
        ) {
            return Err(format!("built-in {b:?} is not one the fused entry point passes on"));
        }
    }
    module.functions.append(function, Span::UNDEFINED);
    // Buffers, scalars and other globals.
    let mut internal = Vec::new();
    let globals: Vec<Handle<naga::GlobalVariable>> = module.global_variables.iter().map(|(h, _)| h).collect();
    for g in globals {
        let var = &module.global_variables[g];
        match (var.space, &var.binding) {
            (AddressSpace::Storage { .. }, Some(b)) if b.group == 0 && (b.binding as usize) < slots.len() => {
                match slots[b.binding as usize] {
                    SlotAs::Arg(index) => {
                        let var = &mut module.global_variables[g];
                        var.name = Some(arg_name(index));
                        var.binding = Some(naga::ResourceBinding { group: 0, binding: index });
                    }
                    SlotAs::Internal { index, elements, space } => internal.push((g, index, elements, space)),
                }
            }
            (AddressSpace::Immediate, _) => fold_scalars(module, g, scalars, i)?,
            (_, Some(b)) => {
                return Err(format!(
                    "`{}` is @group({}) @binding({}), not one of the kernel's {} buffer slots",
                    var.name.as_deref().unwrap_or("?"),
                    b.group,
                    b.binding,
                    slots.len()
                ))
            }
            _ => {
                let name = prefix(&var.name, "global");
                module.global_variables[g].name = name;
            }
        }
    }
    for &(g, index, elements, space) in &internal {
        internalize::internalize(module, g, elements, space, internal_name(index))?;
    }
    let barriers = module.functions.iter().any(|(_, f)| internalize::has_barriers(&f.body));
    let workgroup_memory = module.global_variables.iter().any(|(_, v)| v.space == AddressSpace::WorkGroup);
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::IMMEDIATES,
    )
    .validate(module)
    .map_err(|e| format!("the kernel does not validate once made a part: {}", e.as_inner()))?;
    let mut text = naga::back::wgsl::write_string(module, &info, naga::back::wgsl::WriterFlags::empty())
        .map_err(|e| format!("writing the part: {e}"))?;
    for (_, v) in module.global_variables.iter() {
        if let Some(n) = &v.name {
            if n.starts_with("gantry_") {
                strip_declaration(&mut text, n)?;
            }
        }
    }
    for &(_, index, elements, _) in &internal {
        text = internalize::wrap_indices(&text, &internal_name(index), elements)?;
    }
    Ok(Part {
        text,
        function: name,
        builtins,
        barriers,
        uses_groups: uses_groups_builtin || barriers || workgroup_memory,
    })
}

/// Folds the immediate (push-constant) block `g` into a private variable
/// initialized with the launch's scalar bytes: constants of the fused module.
fn fold_scalars(
    module: &mut Module,
    g: Handle<naga::GlobalVariable>,
    scalars: &[u8],
    i: usize,
) -> Result<(), String> {
    let ty = module.global_variables[g].ty;
    let init = constant(module, ty, scalars, 0)?;
    let var = &mut module.global_variables[g];
    var.space = AddressSpace::Private;
    var.init = Some(init);
    var.name = Some(format!("k{i}_scalars"));
    Ok(())
}

/// The constant of type `ty` read from `bytes` at `at`.
fn constant(
    module: &mut Module,
    ty: Handle<naga::Type>,
    bytes: &[u8],
    at: usize,
) -> Result<Handle<Expression>, String> {
    let word = |at: usize| -> Result<[u8; 4], String> {
        bytes
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| format!("the scalars end before byte {}", at + 4))
    };
    let literal = |s: naga::Scalar, at: usize| -> Result<Literal, String> {
        let w = word(at)?;
        Ok(match (s.kind, s.width) {
            (ScalarKind::Float, 4) => Literal::F32(f32::from_ne_bytes(w)),
            (ScalarKind::Uint, 4) => Literal::U32(u32::from_ne_bytes(w)),
            (ScalarKind::Sint, 4) => Literal::I32(i32::from_ne_bytes(w)),
            _ => return Err(format!("a scalar of kind {:?} and width {}", s.kind, s.width)),
        })
    };
    let inner = module.types[ty].inner.clone();
    let exprs = &mut module.global_expressions;
    Ok(match inner {
        TypeInner::Scalar(s) => exprs.append(Expression::Literal(literal(s, at)?), Span::UNDEFINED),
        TypeInner::Vector { size, scalar } => {
            let mut components = Vec::new();
            for k in 0..size as usize {
                components
                    .push(exprs.append(Expression::Literal(literal(scalar, at + 4 * k)?), Span::UNDEFINED));
            }
            exprs.append(Expression::Compose { ty, components }, Span::UNDEFINED)
        }
        TypeInner::Struct { members, .. } => {
            let mut components = Vec::new();
            for m in members {
                components.push(constant(module, m.ty, bytes, at + m.offset as usize)?);
            }
            module.global_expressions.append(Expression::Compose { ty, components }, Span::UNDEFINED)
        }
        _ => return Err("the immediate block holds something other than 32-bit scalars and vectors".into()),
    })
}

/// Removes the declaration of module-level variable `name` (its attributes up to
/// its `;`) from WGSL text written by naga.
fn strip_declaration(text: &mut String, name: &str) -> Result<(), String> {
    let missing = || format!("the part's text has no declaration of `{name}`");
    let at = text.find(&format!(" {name}: ")).ok_or_else(missing)?;
    let start = text[..at].rfind(['}', ';']).map_or(0, |p| p + 1);
    let end = at + text[at..].find(';').ok_or_else(missing)? + 1;
    text.replace_range(start..end, "");
    Ok(())
}
