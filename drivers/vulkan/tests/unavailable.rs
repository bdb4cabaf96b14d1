//! The typed "unavailable" error, for real: with the loader pointed at no driver
//! (`VK_ICD_FILENAMES` / `VK_DRIVER_FILES` naming a file that does not exist), or
//! with no loader at all, making the driver is `ExecError::Unsupported` naming why,
//! and never a panic. Its own test binary, since the variables apply to the process.

use gantry_driver::sync::channel::unbounded;
use gantry_driver::{DriverContext, ExecError};

#[test]
fn no_vulkan_driver_is_a_typed_unsupported_error() {
    for var in ["VK_ICD_FILENAMES", "VK_DRIVER_FILES"] {
        std::env::set_var(var, "/nonexistent/gantry-no-such-icd.json");
    }
    let (tx, _rx) = unbounded();
    let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
    match gantry_vulkan::factory(0)(ctx) {
        Err(ExecError::Unsupported { device, what }) => {
            assert_eq!(&*device, "vulkan:0");
            assert!(what.starts_with("Vulkan (") && what.ends_with(')'), "{what}");
            eprintln!("without a Vulkan driver: {what}");
        }
        Err(e) => panic!("expected Unsupported, got {e}"),
        Ok(_) => panic!("a driver opened with no Vulkan driver installed"),
    }
    match gantry_vulkan::device_count() {
        Ok(0) | Err(ExecError::Unsupported { .. }) => {}
        other => panic!("device_count without a driver: {other:?}"),
    }
}
