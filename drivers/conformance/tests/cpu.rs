//! The conformance suite on the CPU driver: threaded (kernels, copies and host tasks
//! handed to its pools, completions on the channel) and inline (everything run inside
//! `submit`, reported as `Accepted::Done`). It shares host memory, so it is never
//! asked to allocate; inline, a failing operation has no handle to wait on.

use std::sync::Arc;

use gantry_conformance::{Driver, DriverContext};
use gantry_cpu::{CpuConfig, CpuDriver};

gantry_conformance::suite!(
    cpu,
    |ctx: DriverContext| -> Arc<dyn Driver> {
        Arc::new(CpuDriver::new(CpuConfig { worker_threads: 4, ..Default::default() }, ctx))
    },
    skips = [allocation_limits]
);

gantry_conformance::suite!(
    cpu_inline,
    |ctx: DriverContext| -> Arc<dyn Driver> {
        Arc::new(CpuDriver::new(CpuConfig { worker_threads: 0, host_threads: 0, ..Default::default() }, ctx))
    },
    skips = [allocation_limits, dependency_failure_propagates]
);
