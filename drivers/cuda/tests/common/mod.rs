//! What the GPU tests share: the conformance crate's device harness on CUDA device 0
//! (or the reason there is none).

#![allow(dead_code, unused_imports)]

pub use gantry_conformance::device::{bytes, kernel, scalars, u32s, whole};
use gantry_cuda::{CudaConfig, CudaDriver};

/// The CUDA driver under test and its completions.
pub type Gpu = gantry_conformance::device::DeviceUnderTest<CudaDriver>;

/// Device 0, or `None` after saying on standard error that `test` was skipped and why.
pub fn gpu(test: &str) -> Option<Gpu> {
    Gpu::open("CUDA", test, |ctx| CudaDriver::new(CudaConfig::default(), ctx))
}
