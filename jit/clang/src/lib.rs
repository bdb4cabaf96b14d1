//! # gantry-jit-clang
//!
//! Runs clang to compile OpenCL C kernels to LLVM bitcode for the `spir64` target,
//! the input [`gantry-jit`](../gantry_jit/index.html) compiles to host code and PTX.
//!
//! This crate does not link LLVM: it only runs the `clang-19` binary. That keeps it
//! cheap to use from an application's `build.rs` ([`build_script`]), where linking
//! the ~60 MB of LLVM into the build script would cost every build seconds of link
//! time for no gain, and lets a shipped application carry its kernels as bitcode
//! (`include_bytes!`) so that it needs no clang at run time.
//!
//! The clang binary is `$GANTRY_CLANG` when that is set, otherwise `clang-19`
//! looked up on the `PATH`.
//!
//! ```no_run
//! let bitcode = gantry_jit_clang::compile_opencl("kernel void k(global int* a) { a[0] = 1; }")?;
//! assert!(bitcode.starts_with(b"BC"));
//! # Ok::<(), gantry_jit_clang::ClangError>(())
//! ```

#![warn(missing_docs)]

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The environment variable that names the clang binary to run.
pub const CLANG_ENV: &str = "GANTRY_CLANG";

/// The clang binary run when [`CLANG_ENV`] is not set.
pub const DEFAULT_CLANG: &str = "clang-19";

/// The arguments clang gets before the input: OpenCL C 2.0 with the default header
/// (the built-in declarations), for `spir64`, as bitcode, at `-O1` (promotes
/// variables to registers and infers `readonly`/`writeonly` on pointer parameters,
/// which the signature derivation reads, but does not unroll or vectorize: the JIT
/// optimizes again for the machine that runs the kernel).
pub const CLANG_ARGS: &[&str] = &[
    "-x",
    "cl",
    "-cl-std=CL2.0",
    "-target",
    "spir64-unknown-unknown",
    "-emit-llvm",
    "-c",
    "-O1",
    "-Xclang",
    "-finclude-default-header",
];

/// Why clang produced no bitcode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClangError {
    /// The clang binary could not be started.
    #[error("clang not found: could not run `{binary}` ({reason}); install clang-19 or set {CLANG_ENV} to a clang binary")]
    Missing {
        /// The binary looked for.
        binary: PathBuf,
        /// The operating system's answer.
        reason: String,
    },
    /// clang rejected the source.
    #[error("OpenCL C compile error:\n{stderr}")]
    Compile {
        /// clang's diagnostics.
        stderr: String,
    },
    /// Reading or writing a file (a build script's input or output) failed.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's answer.
        reason: String,
    },
}

/// The clang binary this process runs: `$GANTRY_CLANG`, else `clang-19`.
pub fn clang_binary() -> PathBuf {
    std::env::var_os(CLANG_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| DEFAULT_CLANG.into())
}

/// Compiles OpenCL C `source` to `spir64` LLVM bitcode (see [`CLANG_ARGS`]).
pub fn compile_opencl(source: &str) -> Result<Vec<u8>, ClangError> {
    run_clang(&[], Some(source.as_bytes()), "-")
}

/// Compiles the OpenCL C file `path` to `spir64` LLVM bitcode; `extra` arguments
/// (include directories, `-D` definitions) go before the input.
pub fn compile_opencl_file(path: &Path, extra: &[&str]) -> Result<Vec<u8>, ClangError> {
    run_clang(extra, None, path)
}

fn run_clang(
    extra: &[&str],
    stdin: Option<&[u8]>,
    input: impl Into<OsString>,
) -> Result<Vec<u8>, ClangError> {
    run_clang_at(clang_binary(), extra, stdin, input)
}

fn run_clang_at(
    binary: PathBuf,
    extra: &[&str],
    stdin: Option<&[u8]>,
    input: impl Into<OsString>,
) -> Result<Vec<u8>, ClangError> {
    let mut command = Command::new(&binary);
    command.args(CLANG_ARGS).args(extra).arg("-o").arg("-").arg(input.into());
    command.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child =
        command.spawn().map_err(|e| ClangError::Missing { binary: binary.clone(), reason: e.to_string() })?;
    if let Some(bytes) = stdin {
        // Clang reads all of its input before it writes anything, so writing it whole
        // before reading the output cannot deadlock; dropping the pipe ends the input.
        let mut pipe = child.stdin.take().expect("stdin was piped");
        let written = pipe.write_all(bytes);
        drop(pipe);
        if let Err(e) = written {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ClangError::Io { path: "<clang stdin>".into(), reason: e.to_string() });
        }
    }
    let output = child
        .wait_with_output()
        .map_err(|e| ClangError::Io { path: "<clang output>".into(), reason: e.to_string() })?;
    if !output.status.success() || output.stdout.is_empty() {
        let mut stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        if stderr.is_empty() {
            stderr = format!("{} exited with {}", binary.display(), output.status);
        }
        return Err(ClangError::Compile { stderr });
    }
    Ok(output.stdout)
}

/// Compiling kernels from an application's `build.rs`, so that the application
/// ships bitcode and needs no clang at run time.
///
/// ```no_run
/// // build.rs, in `fn main()`:
/// gantry_jit_clang::build_script::compile("kernels/saxpy.cl", "saxpy.bc").unwrap();
/// // src/main.rs:
/// // static SAXPY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/saxpy.bc"));
/// // let image = gantry_jit::from_llvm_ir(SAXPY, "saxpy")?;
/// ```
pub mod build_script {
    use super::*;

    /// Compiles the OpenCL C file `source` (relative to the package root) to
    /// `$OUT_DIR/<output>` and tells cargo to rerun when the source, `$GANTRY_CLANG`
    /// changes. Returns the output's path. Call it only from a build script (it reads
    /// `OUT_DIR` and prints `cargo:` directives).
    pub fn compile(source: impl AsRef<Path>, output: &str) -> Result<PathBuf, ClangError> {
        let source = source.as_ref();
        let out_dir = std::env::var_os("OUT_DIR").map(PathBuf::from).ok_or_else(|| ClangError::Io {
            path: "OUT_DIR".into(),
            reason: "not set: not run from a build script".into(),
        })?;
        println!("cargo:rerun-if-changed={}", source.display());
        println!("cargo:rerun-if-env-changed={CLANG_ENV}");
        let bitcode = compile_opencl_file(source, &[])?;
        let path = out_dir.join(output);
        std::fs::write(&path, bitcode)
            .map_err(|e| ClangError::Io { path: path.clone(), reason: e.to_string() })?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A missing binary names itself and the override variable.
    #[test]
    fn missing_clang_names_the_binary_and_the_override() {
        let binary = PathBuf::from("/nonexistent/clang-for-gantry-test");
        let err = run_clang_at(binary, &[], Some(b"kernel void k() {}"), "-").unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ClangError::Missing { .. }), "{err:?}");
        assert!(text.contains("/nonexistent/clang-for-gantry-test") && text.contains(CLANG_ENV), "{text}");
    }

    /// Real clang (where installed) turns OpenCL C into bitcode and reports a syntax
    /// error with its diagnostics.
    #[test]
    fn clang_compiles_and_reports_errors() {
        if Command::new(clang_binary()).arg("--version").output().is_err() {
            eprintln!("skipped: no {}", clang_binary().display());
            return;
        }
        let bitcode = compile_opencl("kernel void k(global int* a) { a[get_global_id(0)] = 1; }").unwrap();
        assert!(bitcode.starts_with(b"BC\xC0\xDE"), "bitcode magic");
        match compile_opencl("kernel void k(global int* a) { a[0] = ; }") {
            Err(ClangError::Compile { stderr }) => assert!(stderr.contains("error"), "{stderr}"),
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
