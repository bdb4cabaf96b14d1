//! What the Vulkan tests share: the conformance crate's device harness on physical
//! device 0 (or the reason there is none).

#![allow(dead_code, unused_imports)]

pub use gantry_conformance::device::{bytes, kernel, scalars, u32s, whole};
use gantry_vulkan::{VulkanConfig, VulkanDriver};

/// The Vulkan driver under test and its completions.
pub type Gpu = gantry_conformance::device::DeviceUnderTest<VulkanDriver>;

/// Physical device 0, or `None` after saying on standard error that `test` was
/// skipped and why.
pub fn gpu(test: &str) -> Option<Gpu> {
    Gpu::open("Vulkan", test, |ctx| VulkanDriver::new(VulkanConfig::default(), ctx))
}
