//! The LLVM targets the crate compiles for: the machine it runs on, and NVPTX.

use std::sync::Once;

use inkwell::targets::{CodeModel, InitializationConfig, RelocMode, Target, TargetMachine, TargetTriple};
use inkwell::OptimizationLevel;

use crate::error::{codegen, JitError};
use crate::raw;

/// The host: its triple, CPU name and feature string, as LLVM detects them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostTarget {
    /// The target triple.
    pub triple: String,
    /// The CPU (`target-cpu`).
    pub cpu: String,
    /// The features (`target-features`).
    pub features: String,
}

impl HostTarget {
    /// The machine this process runs on.
    pub fn detect() -> Self {
        Self {
            triple: raw::text(TargetMachine::get_default_triple().as_str()),
            cpu: TargetMachine::get_host_cpu_name().to_string(),
            features: TargetMachine::get_host_cpu_features().to_string(),
        }
    }

    /// A target machine for it.
    pub(crate) fn machine(&self) -> Result<TargetMachine, JitError> {
        static INIT: Once = Once::new();
        let mut failed = None;
        INIT.call_once(|| failed = Target::initialize_native(&InitializationConfig::default()).err());
        if let Some(e) = failed {
            return Err(codegen(format!("initializing the native target: {e}")));
        }
        machine(&self.triple, &self.cpu, &self.features, CodeModel::JITDefault)
    }
}

/// The NVPTX machine PTX is emitted for.
pub(crate) fn nvptx_machine(cpu: &str, features: &str) -> Result<TargetMachine, JitError> {
    static INIT: Once = Once::new();
    INIT.call_once(|| Target::initialize_nvptx(&InitializationConfig::default()));
    machine("nvptx64-nvidia-cuda", cpu, features, CodeModel::Default)
}

fn machine(triple: &str, cpu: &str, features: &str, model: CodeModel) -> Result<TargetMachine, JitError> {
    let triple = TargetTriple::create(triple);
    let target = Target::from_triple(&triple).map_err(|e| codegen(format!("no LLVM target: {e}")))?;
    target
        .create_target_machine(
            &triple,
            cpu,
            features,
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            model,
        )
        .ok_or_else(|| codegen(format!("LLVM cannot make a target machine for {cpu}")))
}
