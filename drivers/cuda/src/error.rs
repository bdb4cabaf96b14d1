//! Failed CUDA calls: the call and its `CUresult`, turned into the driver contract's
//! [`ExecError`]s, and which failures leave the context unusable.

use std::sync::Arc;

use cudarc::driver::sys::CUresult;
use gantry_driver::{BackendStatus, ExecError};

/// A CUDA driver API call that returned something other than `CUDA_SUCCESS`.
///
/// ```
/// use cudarc::driver::sys::CUresult;
/// use gantry_cuda::CallError;
/// let e = CallError { call: "cuMemAlloc", code: CUresult::CUDA_ERROR_OUT_OF_MEMORY };
/// assert_eq!(e.to_string(), "cuMemAlloc failed with CUDA_ERROR_OUT_OF_MEMORY (2)");
/// assert!(!e.is_sticky());
/// let e = CallError { call: "cuEventSynchronize", code: CUresult::CUDA_ERROR_ILLEGAL_ADDRESS };
/// assert!(e.is_sticky());
/// assert_eq!(e.status().name.as_ref(), "CUDA_ERROR_ILLEGAL_ADDRESS");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with {}", self.status())]
pub struct CallError {
    /// The API call (`cuLaunchKernel`).
    pub call: &'static str,
    /// What it returned.
    pub code: CUresult,
}

impl CallError {
    /// The status as the driver contract keeps it: the `CUresult`'s number and its
    /// name as `cuda.h` spells it.
    pub fn status(&self) -> BackendStatus {
        BackendStatus { code: self.code as i64, name: format!("{:?}", self.code).into() }
    }

    /// Whether the context is unusable after it: a fault inside a kernel (an illegal
    /// address, a trap, an assertion), a hardware error, or a destroyed context.
    /// CUDA reports these from every later call in the process's context, so the
    /// driver marks its device lost.
    pub fn is_sticky(&self) -> bool {
        use CUresult::*;
        matches!(
            self.code,
            CUDA_ERROR_ILLEGAL_ADDRESS
                | CUDA_ERROR_LAUNCH_TIMEOUT
                | CUDA_ERROR_ASSERT
                | CUDA_ERROR_HARDWARE_STACK_ERROR
                | CUDA_ERROR_ILLEGAL_INSTRUCTION
                | CUDA_ERROR_MISALIGNED_ADDRESS
                | CUDA_ERROR_INVALID_ADDRESS_SPACE
                | CUDA_ERROR_INVALID_PC
                | CUDA_ERROR_LAUNCH_FAILED
                | CUDA_ERROR_ECC_UNCORRECTABLE
                | CUDA_ERROR_NVLINK_UNCORRECTABLE
                | CUDA_ERROR_CONTEXT_IS_DESTROYED
                | CUDA_ERROR_DEINITIALIZED
                | CUDA_ERROR_EXTERNAL_DEVICE
                | CUDA_ERROR_UNKNOWN
        )
    }

    /// Whether the device ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }

    /// The contract's error for this failure on `device`, with what the driver adds.
    pub fn into_exec(self, device: &Arc<str>, message: impl Into<String>) -> ExecError {
        ExecError::Backend {
            device: device.clone(),
            call: self.call,
            status: self.status(),
            message: message.into(),
        }
    }
}

/// `Ok` for `CUDA_SUCCESS`, else the call's error.
pub(crate) fn check(call: &'static str, code: CUresult) -> Result<(), CallError> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CallError { call, code })
    }
}

/// The error of an operation the driver refuses as malformed (lengths that do not
/// match, a range outside its memory): what the other drivers report for the same.
pub(crate) fn invalid(device: &Arc<str>, message: String) -> ExecError {
    ExecError::Driver { device: device.clone(), message }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contract's error keeps the call, the code and its name, and reads as one
    /// sentence naming them.
    #[test]
    fn a_failed_call_becomes_a_backend_error_with_its_status() {
        let device: Arc<str> = "cuda:0".into();
        let e = CallError { call: "cuLaunchKernel", code: CUresult::CUDA_ERROR_INVALID_VALUE };
        let exec = e.into_exec(&device, "kernel `k`");
        assert_eq!(
            exec.to_string(),
            "cuda:0: cuLaunchKernel failed with CUDA_ERROR_INVALID_VALUE (1): kernel `k`"
        );
        match exec {
            ExecError::Backend { call, status, .. } => {
                assert_eq!(
                    (call, status.code, status.name.as_ref()),
                    ("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE")
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
        assert!(!e.is_sticky(), "a launch refused for its configuration leaves the context usable");
        assert!(CallError { call: "x", code: CUresult::CUDA_ERROR_LAUNCH_FAILED }.is_sticky());
    }
}
