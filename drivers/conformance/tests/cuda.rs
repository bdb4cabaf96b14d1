//! The conformance suite on the CUDA driver (device 0), with its kernels' CUDA C
//! images compiled by NVRTC. On a machine without CUDA every check says it was
//! skipped and why. The driver declares no host tasks (the scheduler runs host tasks
//! of CUDA queues on the CPU), so the host-task checks are skipped.

gantry_conformance::suite!(
    cuda,
    gantry_cuda::factory(0),
    skips = [host_task_runs_once, host_task_panic_is_reported]
);
