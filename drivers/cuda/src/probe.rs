//! Finding CUDA: the driver library, its initialization and the device's properties.
//!
//! cudarc loads `libcuda` on first use and panics where it is missing, so every path
//! into CUDA starts here: [`init`] looks for the library first, then initializes it
//! with any panic inside the bindings (an entry point the installed library lacks)
//! caught, and answers with a typed error a caller can act on.

use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUdevice, CUdevice_attribute};
use gantry_driver::ExecError;

use crate::error::{check, CallError};

/// What the process found when it first looked for CUDA: `Ok` once `cuInit` has
/// succeeded. Kept, so later drivers see the same answer without loading again.
static INIT: OnceLock<Result<(), Unavailable>> = OnceLock::new();

/// Why CUDA cannot be used in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// No CUDA driver library (`libcuda.so`) could be loaded.
    #[error("libcuda not found")]
    NoLibrary,
    /// The library lacks an entry point the bindings need (a driver too old).
    #[error("libcuda lacks an entry point this driver needs")]
    MissingEntryPoint,
    /// `cuInit` failed (no device, a driver/kernel-module mismatch, ...).
    #[error("{0}")]
    Init(CallError),
}

impl Unavailable {
    /// The contract's error, naming the device asked for.
    pub(crate) fn into_exec(self, device: &Arc<str>) -> ExecError {
        match self {
            Unavailable::NoLibrary => {
                ExecError::Unsupported { device: device.clone(), what: "CUDA (libcuda not found)" }
            }
            Unavailable::MissingEntryPoint => ExecError::Unsupported {
                device: device.clone(),
                what: "CUDA (libcuda lacks an entry point this driver needs)",
            },
            Unavailable::Init(e) => e.into_exec(device, "initializing the CUDA driver"),
        }
    }
}

/// Runs `f`, turning a panic inside the bindings into [`Unavailable::MissingEntryPoint`]
/// (the only reason cudarc's loader panics once the library is found).
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, Unavailable> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|_| Unavailable::MissingEntryPoint)
}

/// Loads and initializes the CUDA driver once per process.
pub(crate) fn init() -> Result<(), Unavailable> {
    *INIT.get_or_init(|| {
        // SAFETY: probing loads the library and unloads it; nothing else is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(Unavailable::NoLibrary);
        }
        // SAFETY: the library is present; looking a symbol up calls nothing.
        let lib = guarded(|| unsafe { sys::culib() })?;
        // SAFETY: only the presence of each symbol is asked.
        if ENTRY_POINTS.iter().any(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()) {
            return Err(Unavailable::MissingEntryPoint);
        }
        // SAFETY: cuInit with flags 0 is always a valid call.
        guarded(|| check("cuInit", unsafe { sys::cuInit(0) }))?.map_err(Unavailable::Init)
    })
}

/// Every driver API entry point the driver calls: looked up before the first call,
/// so that a library too old for one is [`Unavailable::MissingEntryPoint`] here rather
/// than a panic inside the bindings later.
const ENTRY_POINTS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuModuleLoadDataEx",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuFuncSetAttribute",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
];

/// How many CUDA devices this process sees, or why it sees none.
///
/// ```
/// // On a machine without a CUDA driver this is a typed error, never a panic.
/// match gantry_cuda::device_count() {
///     Ok(n) => println!("{n} CUDA devices"),
///     Err(e) => println!("no CUDA: {e}"),
/// }
/// ```
pub fn device_count() -> Result<usize, ExecError> {
    let device: Arc<str> = "cuda".into();
    init().map_err(|e| e.into_exec(&device))?;
    let mut n: c_int = 0;
    // SAFETY: initialized; `n` is a valid out-pointer.
    guarded(|| check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) }))
        .map_err(|e| e.into_exec(&device))?
        .map_err(|e| e.into_exec(&device, "counting devices"))?;
    Ok(n.max(0) as usize)
}

/// The properties of one device the driver reads once, when it starts.
#[derive(Clone, Debug)]
pub(crate) struct DeviceProps {
    pub dev: CUdevice,
    /// The device's marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability, major and minor.
    pub cc: (i32, i32),
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub max_shared: usize,
    /// Whether it and every other device can access each other's memory.
    pub peers: bool,
}

/// Opens device `ordinal`: a typed error where CUDA is missing or has no such device.
pub(crate) fn open(ordinal: usize, device: &Arc<str>) -> Result<DeviceProps, ExecError> {
    init().map_err(|e| e.into_exec(device))?;
    guarded(|| properties(ordinal, device)).map_err(|e| e.into_exec(device))?
}

fn properties(ordinal: usize, device: &Arc<str>) -> Result<DeviceProps, ExecError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(ExecError::Unsupported {
            device: device.clone(),
            what: if count == 0 { "CUDA (no CUDA device)" } else { "CUDA (no device with this ordinal)" },
        });
    }
    let fail = |e: CallError| e.into_exec(device, format!("reading the properties of device {ordinal}"));
    let mut dev: CUdevice = 0;
    // SAFETY: initialized, ordinal < count, valid out-pointer.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal as c_int) }).map_err(fail)?;
    let attribute = |a: CUdevice_attribute| -> Result<i32, ExecError> {
        let mut v: c_int = 0;
        // SAFETY: a valid device and out-pointer.
        check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) }).map_err(fail)?;
        Ok(v)
    };
    use CUdevice_attribute::*;
    let cc = (
        attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let max_shared = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as usize;
    let mut raw = [0 as c_char; 256];
    // SAFETY: the buffer holds `len` bytes; CUDA writes a NUL-terminated name.
    check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(raw.as_mut_ptr(), raw.len() as c_int, dev) })
        .map_err(fail)?;
    raw[raw.len() - 1] = 0;
    // SAFETY: NUL-terminated (set above).
    let name = unsafe { CStr::from_ptr(raw.as_ptr()) }.to_string_lossy().into_owned();
    let peers = crate::peer::reaches_all(dev, count).map_err(fail)?;
    Ok(DeviceProps { dev, name, cc, max_shared, peers })
}
