//! A backend defined outside Gantry: a driver written in this file registers on the
//! builder through a factory, gets the next device id, and runs kernels, host tasks,
//! copies and fills that the scheduler hands it, with failures reaching dependents.
//! A factory that fails makes `try_build` a typed error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry::driver::{
    panic_message, Accepted, AllocId, Binding, Capabilities, Completion, DeviceInfo, DeviceKind, DeviceOp,
    Driver, DriverContext, ExecError, HostCtx, MemRef, MemSlice, Submission,
};
use gantry::host::{Arena, ClosureImage};
use gantry::{Error, Mode, QueueOptions, Runtime};

/// Runs every operation inline, in host memory, when the scheduler hands it over (no
/// in-driver waits: only ready operations arrive). Counts what it ran.
struct Inline {
    info: DeviceInfo,
    ctx: DriverContext,
    ran: Arc<AtomicUsize>,
}

fn bind(mem: &MemSlice) -> Binding {
    match &mem.mem {
        // SAFETY: the scheduler hands over slices inside their allocation.
        MemRef::Host(storage) => Binding::new(unsafe { storage.as_ptr().add(mem.offset) }, mem.len),
        MemRef::Device(_) => unreachable!("a driver sharing host memory gets host slices"),
    }
}

impl Inline {
    fn run(&self, op: DeviceOp) -> Result<(), ExecError> {
        match op {
            DeviceOp::Kernel(launch) => {
                let bindings: Vec<Binding> = launch.args.iter().map(|a| bind(&a.mem)).collect();
                let mut arena = Arena::default();
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    for g in 0..launch.geometry.group_count() {
                        launch.kernel.closure().expect("a closure image").run_group(
                            &launch.geometry,
                            g,
                            &bindings,
                            &mut arena,
                        );
                    }
                }))
                .map_err(|p| ExecError::KernelPanicked {
                    kernel: launch.kernel.name.clone(),
                    message: panic_message(&*p),
                })
            }
            DeviceOp::HostTask(mut task) => {
                let bindings: Vec<Binding> = task.args.iter().map(|a| bind(&a.mem)).collect();
                let tag = task.tag;
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    (task.run)(&HostCtx::new(&bindings, tag))
                }))
                .map_err(|p| ExecError::HostTaskPanicked {
                    task: task.name.clone(),
                    message: panic_message(&*p),
                })
            }
            DeviceOp::Fill { dst, pattern } => {
                let d = bind(&dst);
                for i in 0..d.len {
                    // SAFETY: inside the slice, exclusive by scheduling.
                    unsafe { *d.ptr.add(i) = pattern[i % pattern.len()] };
                }
                Ok(())
            }
            DeviceOp::Copy { src, dst } => {
                let (s, d) = (bind(&src), bind(&dst));
                // SAFETY: equal lengths inside their slices; distinct ranges by scheduling.
                unsafe { std::ptr::copy(s.ptr, d.ptr, s.len.min(d.len)) };
                Ok(())
            }
            DeviceOp::Marker => Ok(()),
            _ => Err(ExecError::Unsupported { device: self.info.name.clone(), what: "this operation" }),
        }
    }
}

impl Driver for Inline {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn alloc(&self, _bytes: usize) -> Result<AllocId, ExecError> {
        Err(ExecError::Unsupported { device: self.info.name.clone(), what: "device memory" })
    }
    fn free(&self, _id: AllocId) {}
    fn submit(&self, sub: Submission<'_>) -> Result<Accepted, ExecError> {
        let started_ns = self.ctx.now_ns();
        let result = self.run(sub.op);
        self.ran.fetch_add(1, Ordering::Relaxed);
        Ok(Accepted::Done(Completion {
            op: sub.id,
            result,
            started_ns,
            ended_ns: self.ctx.now_ns(),
            lane: 0,
        }))
    }
}

fn inline_driver(
    ran: Arc<AtomicUsize>,
) -> impl Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError> + Send + Sync {
    move |ctx| {
        let caps = Capabilities {
            shares_host_memory: true,
            in_driver_waits: false,
            image_kinds: &[gantry::ImageKind::Closure],
            host_tasks: true,
            max_local_memory: 64 << 10,
            max_private_memory: 1 << 20,
            virtual_time: false,
            peer_group: 0,
        };
        let info = DeviceInfo { name: "inline".into(), kind: DeviceKind::Other("inline"), caps };
        Ok(Arc::new(Inline { info, ctx, ran: ran.clone() }) as Arc<dyn Driver>)
    }
}

#[test]
fn a_driver_registered_by_a_factory_runs_what_the_scheduler_hands_it() {
    for mode in [Mode::Threaded, Mode::Manual] {
        let ran = Arc::new(AtomicUsize::new(0));
        let rt = Runtime::builder().mode(mode).driver(inline_driver(ran.clone())).build();
        let id = rt.devices().len() as u32 - 1;
        assert_eq!(rt.devices()[id as usize].kind, DeviceKind::Other("inline"));
        let q = rt.queue_with(QueueOptions { device: id, in_order: true }).unwrap();
        let (a, b) = (rt.buffer_zeroed::<u32>(64), rt.buffer_zeroed::<u32>(64));
        q.submit(|cg| cg.fill(&a, 3)).unwrap();
        q.submit(|cg| {
            let x = cg.elements_mut(&a);
            cg.parallel_for(64, move |it| *x.elem(it) *= 7);
        })
        .unwrap();
        q.submit(|cg| cg.copy(&a, &b)).unwrap();
        let sum = Arc::new(AtomicUsize::new(0));
        let s = sum.clone();
        q.submit(|cg| {
            let y = cg.host_read(&b);
            cg.host_task(move |ctx| s.store(y.as_slice(ctx).iter().sum::<u32>() as usize, Ordering::Relaxed));
        })
        .unwrap();
        // A failure on the custom device reaches its dependents; buffers stay valid.
        let bad = q.submit(|cg| {
            let x = cg.elements_mut(&a);
            cg.parallel_for(64, move |_| panic!("custom kernel failed"));
            let _ = x;
        });
        let after = q.submit(|cg| cg.fill(&b, 1)).unwrap();
        assert!(matches!(after.wait(), Err(Error::Exec(ExecError::DependencyFailed { .. }))));
        assert!(bad.unwrap().wait().is_err());
        assert_eq!(sum.load(Ordering::Relaxed), 64 * 21);
        assert_eq!(a.to_vec().unwrap(), vec![21; 64]);
        assert!(ran.load(Ordering::Relaxed) >= 5, "{mode:?}");
    }
}

#[test]
fn a_factory_that_fails_is_a_typed_error_at_build() {
    let unavailable = |_ctx: DriverContext| -> Result<Arc<dyn Driver>, ExecError> {
        Err(ExecError::Unsupported { device: "gpu".into(), what: "this machine (no driver library)" })
    };
    let err = Runtime::builder().driver(unavailable).try_build().err().expect("refused");
    assert!(matches!(err, Error::Exec(ExecError::Unsupported { .. })), "{err:?}");
}
