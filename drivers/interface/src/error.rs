//! Errors shared by every driver: range validation and command execution failures.

use std::sync::Arc;
use thiserror::Error;

/// A range or ND-range that cannot be executed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RangeError {
    /// An extent of zero work-items.
    #[error("range has zero extent in dimension {dim}")]
    ZeroExtent {
        /// The empty dimension.
        dim: usize,
    },
    /// The number of work-items does not fit in `usize`.
    #[error("range size overflows usize")]
    Overflow,
    /// Global and local ranges have different dimension counts.
    #[error("global range has {global} dimensions but local range has {local}")]
    DimensionMismatch {
        /// Dimensions of the global range.
        global: usize,
        /// Dimensions of the local range.
        local: usize,
    },
    /// The local size does not divide the global size.
    #[error("local size {local} does not divide global size {global} in dimension {dim}")]
    LocalDoesNotDivide {
        /// The offending dimension.
        dim: usize,
        /// Global extent in that dimension.
        global: usize,
        /// Local extent in that dimension.
        local: usize,
    },
}

/// Why a command failed while executing. Cloned onto the events of the failed command
/// and of every command that depended on it.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecError {
    /// A closure kernel panicked.
    #[error("kernel `{kernel}` panicked: {message}")]
    KernelPanicked {
        /// Kernel name.
        kernel: Arc<str>,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// A host task panicked.
    #[error("host task `{task}` panicked: {message}")]
    HostTaskPanicked {
        /// Task name.
        task: Arc<str>,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// A command this one depended on failed, so this one did not run.
    #[error("dependency `{dependency}` failed: {cause}")]
    DependencyFailed {
        /// Name of the failed command.
        dependency: Arc<str>,
        /// Its error.
        cause: Arc<ExecError>,
    },
    /// The device could not allocate memory.
    #[error("out of device memory on {device}: {requested} bytes requested")]
    OutOfMemory {
        /// Device name.
        device: Arc<str>,
        /// Bytes asked for.
        requested: usize,
    },
    /// The device was lost; no further work runs on it.
    #[error("device {device} was lost")]
    DeviceLost {
        /// Device name.
        device: Arc<str>,
    },
    /// The driver cannot run this kind of work.
    #[error("{device} does not support {what}")]
    Unsupported {
        /// Device name.
        device: Arc<str>,
        /// What was asked for.
        what: &'static str,
    },
    /// The kernel has no image of a kind the device runs.
    #[error("kernel `{kernel}` has no image that {device} runs")]
    NoImage {
        /// Device name.
        device: Arc<str>,
        /// Kernel name.
        kernel: Arc<str>,
    },
    /// A fault injected on purpose: by a test, or by a simulated device's fault plan.
    #[error("injected fault on {device}: {what}")]
    Fault {
        /// Device name.
        device: Arc<str>,
        /// What failed.
        what: &'static str,
    },
    /// The runtime shut down before the command could run.
    #[error("the runtime was dropped before the command completed")]
    RuntimeDropped,
    /// The scheduler stopped on an internal failure before the command could finish;
    /// the runtime takes no more work.
    #[error("the scheduler failed before the command completed: {message}")]
    SchedulerFailed {
        /// What failed.
        message: String,
    },
    /// A backend API call failed with a status code of its own (a `CUresult`, a
    /// `VkResult`): the code and its name are kept, so a caller can tell a launch
    /// failure from an out-of-memory without parsing text.
    #[error("{device}: {call} failed with {status}: {message}")]
    Backend {
        /// Device name.
        device: Arc<str>,
        /// The API call that failed (`cuLaunchKernel`, `vkQueueSubmit2`).
        call: &'static str,
        /// The backend's status.
        status: BackendStatus,
        /// What the driver adds (the kernel, the sizes involved).
        message: String,
    },
    /// Any other driver-reported failure.
    #[error("driver error on {device}: {message}")]
    Driver {
        /// Device name.
        device: Arc<str>,
        /// The driver's message.
        message: String,
    },
}

/// A backend API's status: its number and its name, as the API spells it.
///
/// ```
/// use gantry_driver::BackendStatus;
/// let s = BackendStatus { code: 700, name: "CUDA_ERROR_ILLEGAL_ADDRESS".into() };
/// assert_eq!(s.to_string(), "CUDA_ERROR_ILLEGAL_ADDRESS (700)");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackendStatus {
    /// The status number (`CUresult`, `VkResult`).
    pub code: i64,
    /// Its name.
    pub name: Arc<str>,
}

impl std::fmt::Display for BackendStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.code)
    }
}

impl ExecError {
    /// Wraps `self` as the cause of a dependent's failure.
    pub fn as_dependency_of(&self, dependency: Arc<str>) -> ExecError {
        ExecError::DependencyFailed { dependency, cause: Arc::new(self.clone()) }
    }

    /// The first error in a chain of [`ExecError::DependencyFailed`].
    pub fn root_cause(&self) -> &ExecError {
        match self {
            ExecError::DependencyFailed { cause, .. } => cause.root_cause(),
            other => other,
        }
    }
}

/// Turns a caught panic payload into a message.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend's status survives the dependency chain that carries it to
    /// dependents, and the message names the call, the status and its code.
    #[test]
    fn a_backend_status_reaches_dependents_whole() {
        let status = BackendStatus { code: 2, name: "CUDA_ERROR_OUT_OF_MEMORY".into() };
        let root = ExecError::Backend {
            device: "cuda:0".into(),
            call: "cuMemAlloc",
            status: status.clone(),
            message: "1 GiB".into(),
        };
        assert_eq!(root.to_string(), "cuda:0: cuMemAlloc failed with CUDA_ERROR_OUT_OF_MEMORY (2): 1 GiB");
        let dependent = root.as_dependency_of("upload".into()).as_dependency_of("draw".into());
        match dependent.root_cause() {
            ExecError::Backend { status: s, call, .. } => assert_eq!((s, *call), (&status, "cuMemAlloc")),
            other => panic!("root cause {other:?}"),
        }
    }
}
