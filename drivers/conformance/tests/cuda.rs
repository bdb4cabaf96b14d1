//! The conformance suite on the CUDA driver (device 0), with its kernels' CUDA C
//! images compiled by NVRTC. On a machine without CUDA every check says it was
//! skipped and why. Host tasks and command buffers are not in the driver's first
//! milestone: it declares no host tasks and refuses command buffers.

gantry_conformance::suite!(
    cuda,
    gantry_cuda::factory(0),
    skips = [host_task_runs_once, host_task_panic_is_reported, command_buffer_replay, command_buffer_patch]
);
