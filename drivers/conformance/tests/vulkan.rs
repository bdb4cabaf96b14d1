//! The conformance suite on the Vulkan driver (physical device 0; on a machine with
//! only Mesa's lavapipe, the CPU), with its kernels' WGSL images compiled by naga.
//! On a machine without a Vulkan loader or device every check says it was skipped
//! and why. The driver declares no host tasks (the scheduler runs host tasks of
//! Vulkan queues on the CPU), so those checks are skipped.

gantry_conformance::suite!(
    vulkan,
    gantry_vulkan::factory(0),
    skips = [host_task_runs_once, host_task_panic_is_reported]
);
