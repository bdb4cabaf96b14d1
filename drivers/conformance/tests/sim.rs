//! The conformance suite on the simulated device (memory of its own, everything run
//! in `poll`, a cost model under which larger work ends later, so a wait-list it
//! ignored would show) and on the simulated machine's host thread pool (host memory,
//! host tasks, no kernels or command buffers).

use std::sync::Arc;

use gantry_conformance::{Driver, DriverContext};
use gantry_sim::{CostModel, HostPoolConfig, MachineConfig, SimConfig, SimDriver, SimMachine};

gantry_conformance::suite!(
    sim,
    |ctx: DriverContext| -> Arc<dyn Driver> {
        Arc::new(SimDriver::new(
            SimConfig {
                cost: CostModel {
                    item_ns: 1.0,
                    compute_units: 32,
                    memory_bytes_per_ns: 64.0,
                    link_bytes_per_ns: 16.0,
                    compute_engines: 2,
                    copy_engines: 2,
                },
                ..Default::default()
            },
            ctx,
        ))
    },
    skips = [host_task_runs_once, host_task_panic_is_reported]
);

gantry_conformance::suite!(
    sim_host_pool,
    |ctx: DriverContext| -> Arc<dyn Driver> {
        Arc::new(
            SimMachine::new(MachineConfig {
                host: Some(HostPoolConfig { threads: 2, ..Default::default() }),
                ..Default::default()
            })
            .host_pool(ctx)
            .expect("the machine has a host pool"),
        )
    },
    skips = [
        kernel_panic_is_reported,
        failure_preserves_written_ranges,
        allocation_limits,
        command_buffer_replay,
        command_buffer_patch
    ]
);
