//! The suite on a driver that offers little, to show that the harness asks it for no
//! more than the scheduler would: the CPU driver behind a wrapper that declares no
//! in-driver waits and no host tasks, keeps the default refusal of command buffers,
//! and fails the test when it is asked to wait on an unfinished operation, to run a
//! host task, or to allocate (it shares host memory).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use gantry_conformance::{Driver, DriverContext};
use gantry_cpu::{CpuConfig, CpuDriver};
use gantry_driver::sync::channel::unbounded;
use gantry_driver::{Accepted, AllocId, DeviceInfo, DeviceOp, ExecError, OpHandle, Submission};

struct Restricted {
    inner: CpuDriver,
    info: DeviceInfo,
    /// Operations that completed, on the channel or inside `submit`.
    completed: Arc<Mutex<HashSet<u64>>>,
    /// The operation behind each pending handle, by the handle's address.
    handles: Mutex<HashMap<usize, u64>>,
}

fn address(h: &OpHandle) -> usize {
    Arc::as_ptr(h) as *const () as usize
}

impl Restricted {
    fn new(ctx: DriverContext) -> Self {
        let (tx, rx) = unbounded();
        let config = CpuConfig { worker_threads: 2, host_threads: 1, ..Default::default() };
        let inner = CpuDriver::new(config, DriverContext { completions: tx, clock: ctx.clock });
        let completed = Arc::new(Mutex::new(HashSet::new()));
        let seen = completed.clone();
        // Notes each completion before passing it on; ends when the inner driver goes.
        std::thread::spawn(move || {
            for c in rx {
                seen.lock().unwrap().insert(c.op.0);
                ctx.complete(c);
            }
        });
        let mut info = inner.info().clone();
        info.name = "restricted".into();
        info.caps.in_driver_waits = false;
        info.caps.host_tasks = false;
        Self { inner, info, completed, handles: Mutex::new(HashMap::new()) }
    }
}

impl Driver for Restricted {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError> {
        panic!("the harness asked a driver that shares host memory to allocate {bytes} bytes");
    }

    fn free(&self, _id: AllocId) {}

    fn submit(&self, sub: Submission<'_>) -> Result<Accepted, ExecError> {
        assert!(
            !matches!(sub.op, DeviceOp::HostTask(_)),
            "the harness submitted a host task to a driver without host tasks"
        );
        for wait in sub.waits {
            let id = self.handles.lock().unwrap()[&address(wait)];
            assert!(
                self.completed.lock().unwrap().contains(&id),
                "the harness made op {} wait on unfinished op {id} without in-driver waits",
                sub.id.0
            );
        }
        let id = sub.id.0;
        let accepted = self.inner.submit(sub)?;
        match &accepted {
            Accepted::Pending(h) => {
                self.handles.lock().unwrap().insert(address(h), id);
            }
            Accepted::Done(_) => {
                self.completed.lock().unwrap().insert(id);
            }
        }
        Ok(accepted)
    }
}

gantry_conformance::suite!(
    restricted,
    |ctx: DriverContext| -> Arc<dyn Driver> { Arc::new(Restricted::new(ctx)) },
    skips = [
        dependency_failure_propagates,
        allocation_limits,
        host_task_runs_once,
        host_task_panic_is_reported,
        command_buffer_replay,
        command_buffer_patch
    ]
);
