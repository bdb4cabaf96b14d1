//! NVRTC, the runtime CUDA C++ compiler: loaded from the process's library path (or a
//! CUDA installation's `lib64`) when the driver starts, and used to compile
//! [`ImageKind::CudaC`](gantry_driver::ImageKind::CudaC) images to PTX for the device.
//!
//! The library is loaded here rather than through cudarc's bindings: those look for
//! `libnvrtc.so` and the sonames of CUDA 12 and older, and a CUDA 13 installation
//! without its development links has only `libnvrtc.so.13`. A driver without NVRTC
//! still runs PTX images; it just does not declare CUDA C.

use std::ffi::{c_char, c_int, CStr, CString};
use std::ptr;

use libloading::Library;

/// `nvrtcResult`: 0 is success.
type Status = c_int;
/// `nvrtcProgram`.
type Program = *mut std::ffi::c_void;

/// A compilation that failed: the NVRTC call, its status and the compiler's log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with {name} ({code}){}", if .log.is_empty() { String::new() } else { format!(":\n{}", .log) })]
pub struct CompileError {
    /// The NVRTC call (`nvrtcCompileProgram`).
    pub call: &'static str,
    /// Its `nvrtcResult`.
    pub code: i32,
    /// The status's name (`NVRTC_ERROR_COMPILATION`).
    pub name: String,
    /// What the compiler said (the errors with their lines), possibly empty.
    pub log: String,
}

/// The loaded compiler.
pub(crate) struct Nvrtc {
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    /// The virtual architectures it compiles for (`compute_XY` as `XY`), ascending.
    archs: Vec<i32>,
    /// Keeps the functions above loaded.
    _lib: Library,
}

/// The names NVRTC goes by: the development link, then the sonames of recent
/// releases, each also under the usual installation directories.
fn candidates() -> Vec<String> {
    let names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"];
    let mut dirs: Vec<String> = ["CUDA_PATH", "CUDA_HOME"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .map(|d| format!("{d}/lib64"))
        .collect();
    dirs.push("/usr/local/cuda/lib64".into());
    let mut all: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    for d in &dirs {
        all.extend(names.iter().map(|n| format!("{d}/{n}")));
    }
    all
}

impl Nvrtc {
    /// Loads NVRTC, or says why it could not.
    pub(crate) fn load() -> Result<Self, String> {
        let tried = candidates();
        // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
        let lib = tried
            .iter()
            .find_map(|name| unsafe { Library::new(name) }.ok())
            .ok_or_else(|| format!("NVRTC not found (tried {})", tried.join(", ")))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is NVRTC's documented signature.
                *unsafe { lib.get($name) }.map_err(|e| format!("NVRTC lacks {}: {e}", stringify!($name)))?
            };
        }
        let mut this = Self {
            create: sym!(b"nvrtcCreateProgram"),
            compile: sym!(b"nvrtcCompileProgram"),
            ptx_size: sym!(b"nvrtcGetPTXSize"),
            ptx: sym!(b"nvrtcGetPTX"),
            log_size: sym!(b"nvrtcGetProgramLogSize"),
            log: sym!(b"nvrtcGetProgramLog"),
            destroy: sym!(b"nvrtcDestroyProgram"),
            error_string: sym!(b"nvrtcGetErrorString"),
            archs: Vec::new(),
            _lib: lib,
        };
        this.archs = this.supported_archs();
        Ok(this)
    }

    /// The architectures NVRTC lists (none where it cannot say: older releases).
    fn supported_archs(&self) -> Vec<i32> {
        type Count = unsafe extern "C" fn(*mut c_int) -> Status;
        type List = unsafe extern "C" fn(*mut c_int) -> Status;
        // SAFETY: documented signatures (NVRTC 11.2 and later).
        let (count, list) = unsafe {
            match (
                self._lib.get::<Count>(b"nvrtcGetNumSupportedArchs"),
                self._lib.get::<List>(b"nvrtcGetSupportedArchs"),
            ) {
                (Ok(c), Ok(l)) => (*c, *l),
                _ => return Vec::new(),
            }
        };
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        if unsafe { count(&mut n) } != 0 || n <= 0 {
            return Vec::new();
        }
        let mut archs = vec![0 as c_int; n as usize];
        // SAFETY: the buffer holds the `n` entries NVRTC said it has.
        if unsafe { list(archs.as_mut_ptr()) } != 0 {
            return Vec::new();
        }
        archs.sort_unstable();
        archs
    }

    /// The virtual architecture to compile for on a device of compute capability
    /// `cc`: the newest NVRTC supports that the device runs.
    pub(crate) fn arch_for(&self, cc: (i32, i32)) -> i32 {
        let device = cc.0 * 10 + cc.1;
        self.archs.iter().copied().filter(|&a| a <= device).max().unwrap_or(device)
    }

    fn status_name(&self, status: Status) -> String {
        // SAFETY: NVRTC returns a static NUL-terminated string for any status.
        let p = unsafe { (self.error_string)(status) };
        if p.is_null() {
            return format!("NVRTC status {status}");
        }
        // SAFETY: non-null, static, NUL-terminated.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn error(&self, call: &'static str, code: Status, log: String) -> CompileError {
        CompileError { call, code, name: self.status_name(code), log }
    }

    /// Compiles CUDA C++ `source` (named `name` in messages) to PTX for
    /// `compute_{arch}`: the PTX text, NUL-terminated.
    pub(crate) fn compile(&self, source: &[u8], name: &str, arch: i32) -> Result<Vec<u8>, CompileError> {
        let invalid = |what: &str| CompileError {
            call: "nvrtcCreateProgram",
            code: 3,
            name: "NVRTC_ERROR_INVALID_INPUT".into(),
            log: format!("the {what} contains a NUL byte"),
        };
        let source = CString::new(source).map_err(|_| invalid("source"))?;
        let name = CString::new(name).map_err(|_| invalid("image name"))?;
        let mut prog: Program = ptr::null_mut();
        // SAFETY: NUL-terminated strings that outlive the call; no headers.
        let s =
            unsafe { (self.create)(&mut prog, source.as_ptr(), name.as_ptr(), 0, ptr::null(), ptr::null()) };
        if s != 0 {
            return Err(self.error("nvrtcCreateProgram", s, String::new()));
        }
        let result = self.compile_program(prog, arch);
        // SAFETY: created above, destroyed once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn compile_program(&self, prog: Program, arch: i32) -> Result<Vec<u8>, CompileError> {
        let option = CString::new(format!("--gpu-architecture=compute_{arch}")).expect("no NUL");
        let options = [option.as_ptr()];
        // SAFETY: a live program; the options outlive the call.
        let s = unsafe { (self.compile)(prog, options.len() as c_int, options.as_ptr()) };
        if s != 0 {
            return Err(self.error("nvrtcCompileProgram", s, self.program_log(prog)));
        }
        let mut size = 0usize;
        // SAFETY: a compiled program; valid out-pointer.
        let s = unsafe { (self.ptx_size)(prog, &mut size) };
        if s != 0 {
            return Err(self.error("nvrtcGetPTXSize", s, String::new()));
        }
        let mut ptx = vec![0u8; size.max(1)];
        // SAFETY: the buffer holds the `size` bytes NVRTC asked for (its NUL included).
        let s = unsafe { (self.ptx)(prog, ptx.as_mut_ptr().cast()) };
        if s != 0 {
            return Err(self.error("nvrtcGetPTX", s, String::new()));
        }
        if ptx.last() != Some(&0) {
            ptx.push(0);
        }
        Ok(ptx)
    }

    /// The compiler's log, for messages ("" where it cannot be read).
    fn program_log(&self, prog: Program) -> String {
        let mut size = 0usize;
        // SAFETY: a live program; valid out-pointer.
        if unsafe { (self.log_size)(prog, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes NVRTC asked for.
        if unsafe { (self.log)(prog, log.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        let text = log.split(|&b| b == 0).next().unwrap_or_default();
        String::from_utf8_lossy(text).trim_end().to_owned()
    }
}
