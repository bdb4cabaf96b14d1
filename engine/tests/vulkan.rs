//! The Vulkan driver behind the scheduler (feature `vulkan`; lavapipe in CI): registered
//! on the builder, it runs WGSL kernels with scalars, fills and copies the scheduler
//! hands it, moves buffers between its memory and the host's, fails a refused launch's
//! dependents, replays command graphs as recorded Vulkan command buffers, and host
//! tasks submitted to its queues run on the CPU. On a machine without Vulkan, building
//! the runtime is a typed error and the tests say they were skipped.

mod gpu_scenarios;

use gantry::driver::ExecError;
use gantry::{AccessMode, CodeImage, DeviceKind, Error, ImageKind, Kernel, KernelRef, Runtime, Signature};

/// A runtime with Vulkan device 0 and a queue on it, or `None` after saying why not.
fn vulkan_runtime(test: &str) -> Option<(Runtime, gantry::Queue)> {
    gpu_scenarios::gpu_runtime("Vulkan", test, || Runtime::builder().vulkan(0).try_build())
}

const SAXPY: &str = "
struct S { n: u32, a: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<u32>;
@group(0) @binding(1) var<storage, read_write> y: array<u32>;
@compute @workgroup_size(64)
fn saxpy(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = s.a * x[id.x] + y[id.x]; }
}";

fn saxpy() -> KernelRef {
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::ReadWrite)
        .scalar::<u32>()
        .scalar::<u32>();
    Kernel::new("saxpy", sig)
        .with_image(CodeImage::new(ImageKind::Wgsl, "saxpy", SAXPY.as_bytes()))
        .into_ref()
}

#[test]
fn building_without_vulkan_is_a_typed_error_and_with_it_registers_a_vulkan_device() {
    match Runtime::builder().driver(gantry::vulkan::factory(0)).try_build() {
        Ok(rt) => assert_eq!(rt.devices().last().map(|d| d.kind), Some(DeviceKind::Other("vulkan"))),
        Err(Error::Exec(ExecError::Unsupported { what, .. })) => {
            assert!(what.starts_with("Vulkan ("), "{what}")
        }
        Err(e) => panic!("Vulkan is present but the runtime did not build: {e}"),
    }
}

/// Kernels with scalars over a plain range (several groups and a guarded tail), a fill
/// and a copy on the Vulkan queue; a closure kernel on the CPU and a host task (which the
/// scheduler runs on the CPU) read what they wrote: the scheduler moves the buffers.
#[test]
fn kernels_fills_copies_and_host_tasks_through_the_scheduler() {
    let Some((rt, q)) = vulkan_runtime("kernels_fills_copies_and_host_tasks_through_the_scheduler") else {
        return;
    };
    gpu_scenarios::kernels_fills_copies_and_host_tasks(&rt, &q, &saxpy());
}

const REFUSED: &str = "
struct S { n: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read_write> y: array<u32>;
@compute @workgroup_size(32)
fn refused(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = 0xBADu; }
}";

/// A launch the driver refuses (an ND-range of 64 over a shader of workgroups of 32)
/// fails with the driver's error naming the kernel; see the scenario.
#[test]
fn a_refused_launch_fails_its_dependents_and_keeps_the_buffer() {
    let Some((rt, q)) = vulkan_runtime("a_refused_launch_fails_its_dependents_and_keeps_the_buffer") else {
        return;
    };
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
    let refused = Kernel::new("refused", sig)
        .with_image(CodeImage::new(ImageKind::Wgsl, "refused", REFUSED.as_bytes()))
        .into_ref();
    let by_driver = |e: &ExecError| {
        matches!(e, ExecError::Driver { message, .. }
            if message.contains("kernel `refused`") && message.contains("does not match"))
    };
    gpu_scenarios::a_refused_launch_fails_its_dependents(&rt, &q, &refused, by_driver);
}

/// The command graph scenario: on the Vulkan device it replays as a recorded
/// Vulkan command buffer.
#[test]
fn a_command_graph_replays_as_a_vulkan_command_buffer_and_updates() {
    let Some((rt, q)) = vulkan_runtime("a_command_graph_replays_as_a_vulkan_command_buffer_and_updates")
    else {
        return;
    };
    gpu_scenarios::a_command_graph_replays_and_updates(&rt, &q, &saxpy());
}
