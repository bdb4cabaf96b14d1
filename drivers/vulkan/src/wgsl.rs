//! WGSL images compiled in-process by naga: WGSL → naga IR → validation →
//! SPIR-V. A shader whose `@workgroup_size` names pipeline-overridable constants
//! (`override wx: u32; @compute @workgroup_size(wx)`) gets them set to the launch's
//! local size, one SPIR-V module per size; other overrides keep their defaults.
//!
//! Out-of-range indexes into storage buffers and arrays read zero and skip the
//! write (naga's `ReadZeroSkipWrite` bounds checks): a WGSL kernel cannot fault the
//! device, which on Vulkan would lose it. Floating-point arithmetic is exact as
//! written: no driver contracts it into FMAs, and `f32` denormals are kept where
//! the device can (`exact`).

use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Why a WGSL image does not compile, with naga's message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// The source does not parse (naga's diagnostic, with the source line).
    #[error("WGSL does not parse: {0}")]
    Parse(String),
    /// It parses but is not valid.
    #[error("WGSL does not validate: {0}")]
    Validate(String),
    /// It has no compute entry point of the image's entry name.
    #[error("no compute entry point `{0}`")]
    NoEntry(String),
    /// Its workgroup size is an override expression other than a plain override.
    #[error(
        "workgroup size dimension {0} is an expression, not a plain `override` (set it from the launch)"
    )]
    WorkgroupExpression(usize),
    /// Setting its overrides failed.
    #[error("overrides: {0}")]
    Overrides(String),
    /// naga's SPIR-V writer failed.
    #[error("SPIR-V output: {0}")]
    Write(String),
    /// The shader's resources do not match the kernel's signature: a buffer
    /// binding the launch does not provide, or a larger scalar block.
    #[error("the shader does not match the kernel's signature: {0}")]
    Interface(String),
    /// A SPIR-V image is malformed (see the `spirv` module).
    #[error("SPIR-V: {0}")]
    SpirV(String),
}

/// A parsed and validated WGSL compute shader.
pub(crate) struct Wgsl {
    module: naga::Module,
    info: naga::valid::ModuleInfo,
    entry: String,
    /// The workgroup size (Vulkan order: x first); overridable dimensions hold
    /// their default, if any.
    pub size: [u32; 3],
    /// The pipeline-constant key of each overridable dimension.
    overridable: [Option<String>; 3],
}

impl Wgsl {
    /// Parses and validates `source` with compute entry point `entry`.
    pub(crate) fn parse(source: &str, entry: &str) -> Result<Self, CompileError> {
        let module = naga::front::wgsl::parse_str(source)
            .map_err(|e| CompileError::Parse(e.emit_to_string(source)))?;
        let info = Validator::new(ValidationFlags::all(), Capabilities::IMMEDIATES)
            .validate(&module)
            .map_err(|e| CompileError::Validate(e.emit_to_string(source)))?;
        let ep = module
            .entry_points
            .iter()
            .find(|e| e.name == entry && e.stage == naga::ShaderStage::Compute)
            .ok_or_else(|| CompileError::NoEntry(entry.to_owned()))?;
        let mut overridable: [Option<String>; 3] = Default::default();
        if let Some(exprs) = &ep.workgroup_size_overrides {
            for (d, e) in exprs.iter().enumerate() {
                let Some(e) = e else { continue };
                match module.global_expressions[*e] {
                    naga::Expression::Override(h) => {
                        let o = &module.overrides[h];
                        overridable[d] = Some(match (o.id, &o.name) {
                            (Some(id), _) => id.to_string(),
                            (None, Some(name)) => name.clone(),
                            (None, None) => return Err(CompileError::WorkgroupExpression(d)),
                        });
                    }
                    _ => return Err(CompileError::WorkgroupExpression(d)),
                }
            }
        }
        let size = ep.workgroup_size;
        Ok(Self { entry: entry.to_owned(), size, overridable, module, info })
    }

    /// Checks the shader's resources against a signature of `globals` buffers and
    /// `scalar_bytes` of scalars: every resource is in group 0 at a binding below
    /// `globals`, and its immediate (push-constant) block is no larger than the
    /// scalars (a larger one would read past what the launch pushes).
    pub(crate) fn check_interface(&self, globals: usize, scalar_bytes: usize) -> Result<(), CompileError> {
        for (_, var) in self.module.global_variables.iter() {
            let name = var.name.as_deref().unwrap_or("?");
            if let Some(b) = &var.binding {
                if b.group != 0 || b.binding as usize >= globals {
                    return Err(CompileError::Interface(format!(
                        "`{name}` is @group({}) @binding({}); the kernel binds group 0, bindings 0..{globals}",
                        b.group, b.binding
                    )));
                }
            }
            if var.space == naga::AddressSpace::Immediate {
                let size = self.module.types[var.ty].inner.size(self.module.to_ctx()) as usize;
                if size > scalar_bytes.next_multiple_of(4) {
                    return Err(CompileError::Interface(format!(
                        "the immediate block `{name}` is {size} bytes; the kernel's scalars are {scalar_bytes}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Which dimensions (Vulkan order) the launch sets.
    pub(crate) fn overridable(&self) -> [bool; 3] {
        [0, 1, 2].map(|d| self.overridable[d].is_some())
    }

    /// The SPIR-V words for workgroup size `size` (its overridable dimensions set),
    /// with `f32` denormals preserved where the device can (`preserve_denormals`).
    pub(crate) fn spirv(&self, size: [u32; 3], preserve_denormals: bool) -> Result<Vec<u32>, CompileError> {
        let mut constants = naga::back::PipelineConstants::default();
        for (d, key) in self.overridable.iter().enumerate() {
            if let Some(key) = key {
                constants.insert(key.clone(), size[d] as f64);
            }
        }
        let (module, info) = naga::back::pipeline_constants::process_overrides(
            &self.module,
            &self.info,
            Some((naga::ShaderStage::Compute, &self.entry)),
            &constants,
        )
        .map_err(|e| CompileError::Overrides(e.to_string()))?;
        let policy = naga::proc::BoundsCheckPolicy::ReadZeroSkipWrite;
        let options = spv::Options {
            lang_version: (1, 3),
            bounds_check_policies: naga::proc::BoundsCheckPolicies {
                index: policy,
                buffer: policy,
                ..Default::default()
            },
            ..Default::default()
        };
        let pipeline = spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: self.entry.clone(),
        };
        let mut words = spv::write_vec(&module, &info, &options, Some(&pipeline))
            .map_err(|e| CompileError::Write(e.to_string()))?;
        crate::exact::forbid_contraction(&mut words);
        if preserve_denormals {
            crate::exact::preserve_denormals(&mut words);
        }
        Ok(words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCALE: &str = "
        struct S { n: u32, a: u32 }
        var<immediate> s: S;
        @group(0) @binding(0) var<storage, read_write> x: array<u32>;
        override wx: u32 = 64;
        @compute @workgroup_size(wx)
        fn main(@builtin(global_invocation_id) id: vec3<u32>) {
            if id.x < s.n { x[id.x] = x[id.x] * s.a; }
        }";

    /// A shader with an overridable workgroup size compiles for any size; a broken
    /// one is a parse error carrying naga's message.
    #[test]
    fn wgsl_compiles_per_workgroup_size_and_errors_name_the_problem() {
        let w = Wgsl::parse(SCALE, "main").unwrap();
        assert_eq!(w.overridable(), [true, false, false]);
        let words = w.spirv([128, 1, 1], false).unwrap();
        assert_eq!(words[0], 0x0723_0203, "SPIR-V magic");
        let broken = Wgsl::parse("@compute @workgroup_size(1) fn main() { let x: u32 = ; }", "main");
        assert!(
            matches!(&broken, Err(CompileError::Parse(m)) if m.contains("expected")),
            "{:?}",
            broken.err()
        );
        assert!(matches!(Wgsl::parse(SCALE, "other"), Err(CompileError::NoEntry(_))));
        assert!(w.check_interface(1, 8).is_ok());
        assert!(
            matches!(w.check_interface(0, 8), Err(CompileError::Interface(m)) if m.contains("binding(0)"))
        );
        assert!(matches!(w.check_interface(1, 4), Err(CompileError::Interface(m)) if m.contains("8 bytes")));
    }

    /// The module with no contraction and preserved denormals is valid SPIR-V for
    /// Vulkan 1.2 (checked by `spirv-val` from SPIRV-Tools, which CI installs; the
    /// test says it skipped where the tool is missing).
    #[test]
    fn exact_arithmetic_modules_validate() {
        let source = "struct P { a: f32 }
            var<immediate> p: P;
            @group(0) @binding(0) var<storage, read_write> x: array<f32>;
            @compute @workgroup_size(64)
            fn main(@builtin(global_invocation_id) id: vec3<u32>) { x[id.x] = p.a * x[id.x] + 1.0; }";
        let words = Wgsl::parse(source, "main").unwrap().spirv([64, 1, 1], true).unwrap();
        let path = std::env::temp_dir().join(format!("gantry-exact-{}.spv", std::process::id()));
        std::fs::write(&path, words.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let checked =
            std::process::Command::new("spirv-val").args(["--target-env", "vulkan1.2"]).arg(&path).output();
        let _ = std::fs::remove_file(&path);
        match checked {
            Ok(out) => assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => eprintln!("`exact_arithmetic_modules_validate` skipped: no spirv-val ({e})"),
        }
    }
}
