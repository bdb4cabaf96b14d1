//! The one error type of the crate.

use std::path::PathBuf;

use gantry_jit_clang::ClangError;

/// Why an image could not be made, read, or compiled, or a launch not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JitError {
    /// The clang binary could not be started.
    #[error("clang not found: could not run `{binary}` ({reason}); install clang-19 or set {env} to a clang binary")]
    MissingTool {
        /// The binary looked for.
        binary: PathBuf,
        /// The environment variable that overrides it.
        env: &'static str,
        /// The operating system's answer.
        reason: String,
    },
    /// clang rejected the OpenCL C source.
    #[error("OpenCL C compile error:\n{stderr}")]
    OpenClCompile {
        /// clang's diagnostics.
        stderr: String,
    },
    /// A file clang needed or wrote could not be read or written.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's answer.
        reason: String,
    },
    /// The bytes are neither LLVM bitcode nor LLVM IR text LLVM 19 reads.
    #[error("LLVM IR parse error: {message}")]
    IrParse {
        /// LLVM's diagnostic.
        message: String,
    },
    /// The module has no function definition of the entry's name.
    #[error("entry point `{entry}` not found; the module defines {available:?}")]
    EntryNotFound {
        /// The name looked for.
        entry: String,
        /// The functions the module does define.
        available: Vec<String>,
    },
    /// A kernel parameter does not match the signature it is compiled against.
    #[error("parameter {param}: the signature expects {expected}, the kernel has {found}")]
    SignatureMismatch {
        /// The parameter's index in the kernel's declaration (the parameter count
        /// where the signature has more arguments than the kernel).
        param: usize,
        /// What the signature has there.
        expected: String,
        /// What the kernel has.
        found: String,
    },
    /// The kernel uses something the compiler does not translate.
    #[error("unsupported in `{function}`: {what}")]
    Unsupported {
        /// The function (the kernel, or the callee) concerned.
        function: String,
        /// What it is.
        what: String,
    },
    /// LLVM failed to verify, optimize or generate code for the transformed module.
    #[error("LLVM code generation failed: {message}")]
    Codegen {
        /// LLVM's diagnostic.
        message: String,
    },
    /// A launch's arguments do not fit the kernel.
    #[error("launch: {what}")]
    Launch {
        /// What does not fit.
        what: String,
    },
}

impl From<ClangError> for JitError {
    fn from(e: ClangError) -> Self {
        match e {
            ClangError::Missing { binary, reason } => {
                JitError::MissingTool { binary, env: gantry_jit_clang::CLANG_ENV, reason }
            }
            ClangError::Compile { stderr } => JitError::OpenClCompile { stderr },
            ClangError::Io { path, reason } => JitError::Io { path, reason },
            other => JitError::Io { path: PathBuf::new(), reason: other.to_string() },
        }
    }
}

pub(crate) fn codegen(what: impl std::fmt::Display) -> JitError {
    JitError::Codegen { message: what.to_string() }
}
