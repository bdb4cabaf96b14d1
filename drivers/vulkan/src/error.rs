//! Failed Vulkan calls: the call and its `VkResult`, turned into the driver
//! contract's [`ExecError`]s.

use std::sync::Arc;

use ash::vk;
use gantry_driver::{BackendStatus, ExecError};

/// A Vulkan call that returned an error `VkResult`.
///
/// ```
/// use ash::vk;
/// use gantry_vulkan::CallError;
/// let e = CallError { call: "vkAllocateMemory", code: vk::Result::ERROR_OUT_OF_DEVICE_MEMORY };
/// assert_eq!(e.to_string(), "vkAllocateMemory failed with VK_ERROR_OUT_OF_DEVICE_MEMORY (-2)");
/// assert!(e.is_out_of_memory() && !e.is_device_lost());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with {}", self.status())]
pub struct CallError {
    /// The API call (`vkQueueSubmit`).
    pub call: &'static str,
    /// What it returned.
    pub code: vk::Result,
}

impl CallError {
    /// The status as the driver contract keeps it: the `VkResult`'s number and its
    /// name as `vulkan_core.h` spells it.
    pub fn status(&self) -> BackendStatus {
        BackendStatus { code: self.code.as_raw() as i64, name: format!("VK_{:?}", self.code).into() }
    }

    /// Whether the device is gone: nothing submitted after it runs.
    pub fn is_device_lost(&self) -> bool {
        self.code == vk::Result::ERROR_DEVICE_LOST
    }

    /// Whether device (or host) memory ran out.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self.code, vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY)
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

/// Attaches the call's name to an ash result.
pub(crate) trait Check<T> {
    /// `Ok`, or the call's [`CallError`].
    fn call(self, call: &'static str) -> Result<T, CallError>;
}

impl<T> Check<T> for Result<T, vk::Result> {
    fn call(self, call: &'static str) -> Result<T, CallError> {
        self.map_err(|code| CallError { call, code })
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

    /// The contract's error keeps the call, the code and its name.
    #[test]
    fn a_failed_call_becomes_a_backend_error_with_its_status() {
        let device: Arc<str> = "vulkan:0".into();
        let e = CallError { call: "vkQueueSubmit", code: vk::Result::ERROR_DEVICE_LOST };
        assert!(e.is_device_lost());
        let exec = e.into_exec(&device, "kernel `k`");
        assert_eq!(
            exec.to_string(),
            "vulkan:0: vkQueueSubmit failed with VK_ERROR_DEVICE_LOST (-4): kernel `k`"
        );
        assert_eq!(
            Err::<(), _>(vk::Result::ERROR_INITIALIZATION_FAILED).call("vkCreateInstance").unwrap_err().call,
            "vkCreateInstance"
        );
    }
}
