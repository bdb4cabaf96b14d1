//! A backend defined outside Gantry: a driver written in this file registers on the
//! builder through a factory, gets the next device id, passes the driver conformance
//! suite, and runs kernels, host tasks, copies and fills that the scheduler hands it,
//! with failures reaching dependents. Besides closure kernels it runs kernels of an
//! image kind of its own, a tiny stack machine the engine knows nothing about: the
//! scheduler carries those images, their signatures and scalar arguments without
//! looking inside. A factory that fails makes `try_build` a typed error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry::driver::fusion::FusionError;
use gantry::driver::{
    fill_fits, Accepted, AllocId, Binding, Capabilities, Completion, DeviceInfo, DeviceKind, DeviceOp,
    Driver, DriverContext, ExecError, ImageCache, KernelLaunch, MemArg, MemRef, MemSlice, Submission,
};
use gantry::host::{Arena, ClosureImage, KernelCall, Runner};
use gantry::{
    AccessMode, CancelReason, CodeImage, Error, FusionOutcome, FusionProps, ImageKind, Kernel, KernelRef,
    Mode, QueueOptions, Runtime, Signature,
};

/// The image kind this file's driver defines.
const STACK_VM: ImageKind = ImageKind::Other("stack-vm");

/// One instruction of the stack machine; each work-item `i` runs the whole program
/// over `u32` values, wrapping on overflow.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// Push element `i` of global argument `slot`.
    Load(u8),
    /// Push scalar argument `index`.
    Scalar(u8),
    /// Push `i`.
    Id,
    /// Pop two, push their sum.
    Add,
    /// Pop two, push their product.
    Mul,
    /// Pop into element `i` of global argument `slot`.
    Store(u8),
}

/// Decodes an image: two bytes an instruction (opcode, operand). What a real backend
/// does once per image (compile a module, build a pipeline), done once here too.
fn decode(image: &CodeImage) -> Result<Vec<Op>, ExecError> {
    let invalid = |message: String| ExecError::Driver { device: "inline".into(), message };
    if !image.code().len().is_multiple_of(2) {
        return Err(invalid(format!("image `{}` has an odd length", image.entry())));
    }
    image
        .code()
        .chunks(2)
        .map(|c| match c[0] {
            0 => Ok(Op::Load(c[1])),
            1 => Ok(Op::Scalar(c[1])),
            2 => Ok(Op::Id),
            3 => Ok(Op::Add),
            4 => Ok(Op::Mul),
            5 => Ok(Op::Store(c[1])),
            other => Err(invalid(format!("unknown opcode {other} in image `{}`", image.entry()))),
        })
        .collect()
}

/// Assembles a program into an image of [`STACK_VM`].
fn assemble(entry: &str, program: &[Op]) -> CodeImage {
    let bytes: Vec<u8> = program
        .iter()
        .flat_map(|op| match *op {
            Op::Load(s) => [0, s],
            Op::Scalar(s) => [1, s],
            Op::Id => [2, 0],
            Op::Add => [3, 0],
            Op::Mul => [4, 0],
            Op::Store(s) => [5, s],
        })
        .collect();
    CodeImage::new(STACK_VM, entry, bytes)
}

/// Runs every operation inline, in host memory, when the scheduler hands it over (no
/// in-driver waits: only ready operations arrive). Counts what it ran and how often
/// it decoded a stack-machine image.
struct Inline {
    info: DeviceInfo,
    ctx: DriverContext,
    ran: Arc<AtomicUsize>,
    images: ImageCache<Vec<Op>>,
    loads: Arc<AtomicUsize>,
    /// Closure kernels and host tasks run through the host execution core every
    /// host driver shares.
    runner: Runner,
}

impl Inline {
    fn invalid(&self, message: String) -> ExecError {
        ExecError::Driver { device: self.info.name.clone(), message }
    }

    /// The host bytes of `mem`, checked to lie inside their storage.
    fn bind(&self, mem: &MemSlice) -> Result<Binding, ExecError> {
        match &mem.mem {
            MemRef::Host(storage) if mem.offset.checked_add(mem.len).is_some_and(|e| e <= storage.len()) => {
                // SAFETY: inside the storage (checked), which the slice keeps alive.
                Ok(Binding::new(unsafe { storage.as_ptr().add(mem.offset) }, mem.len))
            }
            MemRef::Host(storage) => Err(self.invalid(format!(
                "slice {}..+{} outside host storage of {} bytes",
                mem.offset,
                mem.len,
                storage.len()
            ))),
            MemRef::Device(_) => Err(self.invalid("a driver sharing host memory got device memory".into())),
        }
    }

    fn bind_all(&self, args: &[MemArg]) -> Result<Vec<Binding>, ExecError> {
        args.iter().map(|a| self.bind(&a.mem)).collect()
    }

    fn run_kernel(
        &self,
        launch: &KernelLaunch,
        bindings: &[Binding],
        preserve: bool,
    ) -> Result<(), ExecError> {
        let name = &launch.kernel.name;
        if bindings.len() != launch.kernel.signature.globals.len() {
            return Err(self.invalid(format!(
                "kernel `{name}` has {} buffer slots but {} arguments",
                launch.kernel.signature.globals.len(),
                bindings.len()
            )));
        }
        if launch.kernel.closure().is_some() {
            let modes = launch.args.iter().map(|a| a.mode);
            // SAFETY: live bindings, ordered against other work by the scheduler.
            return unsafe {
                self.runner.run_kernel(
                    KernelCall {
                        kernel: &launch.kernel,
                        geometry: &launch.geometry,
                        scalars: &launch.scalars,
                    },
                    modes,
                    bindings,
                    preserve,
                    &mut Arena::default(),
                )
            };
        }
        let Some(image) = launch.kernel.image(STACK_VM) else {
            return Err(gantry::driver::no_image(&self.info.name, name));
        };
        let program = self.images.get_or_load(image, |image| {
            self.loads.fetch_add(1, Ordering::Relaxed);
            decode(image)
        })?;
        let modes = launch.args.iter().map(|a| a.mode);
        let interpret = || {
            self.interpret(&launch.kernel, &program, &launch.scalars, bindings, launch.geometry.global_size())
        };
        // SAFETY: as above.
        unsafe { self.runner.preserving(modes, bindings, preserve, interpret) }
    }

    /// Runs `program` for work-items `0..items`.
    fn interpret(
        &self,
        kernel: &KernelRef,
        program: &[Op],
        scalars: &[u8],
        bindings: &[Binding],
        items: usize,
    ) -> Result<(), ExecError> {
        let fault = |what: String| ExecError::Driver { device: self.info.name.clone(), message: what };
        let element = |slot: u8, i: usize| -> Result<*mut u32, ExecError> {
            let b = bindings.get(slot as usize).ok_or_else(|| fault(format!("no argument {slot}")))?;
            if (i + 1) * 4 > b.len {
                return Err(fault(format!("work-item {i} outside argument {slot} of {} bytes", b.len)));
            }
            // SAFETY: inside the binding (checked); the scheduler orders the launch
            // against every other use of these ranges.
            Ok(unsafe { b.ptr.add(i * 4).cast::<u32>() })
        };
        let mut stack: Vec<u32> = Vec::with_capacity(8);
        for i in 0..items {
            stack.clear();
            for op in program {
                let pop = |stack: &mut Vec<u32>| stack.pop().ok_or_else(|| fault("stack underflow".into()));
                match *op {
                    // SAFETY (load, store): `element` returned a pointer inside the
                    // argument; u32 reads and writes need no alignment here.
                    Op::Load(s) => stack.push(unsafe { element(s, i)?.read_unaligned() }),
                    Op::Scalar(s) => {
                        let at = kernel.signature.scalar_offset(s as usize);
                        let bytes = scalars.get(at..at + 4).ok_or_else(|| fault(format!("no scalar {s}")))?;
                        stack.push(u32::from_ne_bytes(bytes.try_into().expect("four bytes")));
                    }
                    Op::Id => stack.push(i as u32),
                    Op::Add => {
                        let (a, b) = (pop(&mut stack)?, pop(&mut stack)?);
                        stack.push(a.wrapping_add(b));
                    }
                    Op::Mul => {
                        let (a, b) = (pop(&mut stack)?, pop(&mut stack)?);
                        stack.push(a.wrapping_mul(b));
                    }
                    Op::Store(s) => {
                        let v = pop(&mut stack)?;
                        unsafe { element(s, i)?.write_unaligned(v) };
                    }
                }
            }
        }
        Ok(())
    }

    fn run(&self, op: DeviceOp, preserve: bool) -> Result<(), ExecError> {
        match op {
            DeviceOp::Kernel(launch) => {
                let bindings = self.bind_all(&launch.args)?;
                self.run_kernel(&launch, &bindings, preserve)
            }
            DeviceOp::HostTask(task) => {
                let bindings = self.bind_all(&task.args)?;
                let modes = task.args.iter().map(|a| a.mode);
                // SAFETY: live host bindings, ordered against other work by the scheduler.
                unsafe {
                    self.runner.run_host_task(task.name, task.tag, task.run, modes, &bindings, preserve)
                }
            }
            DeviceOp::Fill { dst, pattern } => {
                if !fill_fits(dst.len, &pattern) {
                    return Err(self.invalid(format!(
                        "fill of {} bytes with a {}-byte pattern",
                        dst.len,
                        pattern.len()
                    )));
                }
                let d = self.bind(&dst)?;
                for i in 0..d.len {
                    // SAFETY: inside the slice, exclusive by scheduling.
                    unsafe { *d.ptr.add(i) = pattern[i % pattern.len()] };
                }
                Ok(())
            }
            DeviceOp::Copy { src, dst } => {
                let (s, d) = (self.bind(&src)?, self.bind(&dst)?);
                if s.len != d.len {
                    return Err(self.invalid(format!("copy of {} bytes into {} bytes", s.len, d.len)));
                }
                // SAFETY: equal lengths inside their storage; `copy` tolerates overlap.
                unsafe { std::ptr::copy(s.ptr, d.ptr, s.len) };
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
        let result = self.run(sub.op, sub.preserve_on_failure);
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

/// What a test reads back from the driver it registered.
#[derive(Clone, Default)]
struct Counters {
    ran: Arc<AtomicUsize>,
    loads: Arc<AtomicUsize>,
}

fn inline_driver(
    counters: Counters,
) -> impl Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError> + Send + Sync {
    move |ctx| {
        let caps = Capabilities {
            shares_host_memory: true,
            in_driver_waits: false,
            image_kinds: &[ImageKind::Closure, STACK_VM],
            host_tasks: true,
            records_host_tasks: false,
            max_local_memory: 64 << 10,
            max_private_memory: 1 << 20,
            virtual_time: false,
            peer_group: 0,
            fusion_window: gantry::driver::fusion::WindowThresholds::ALWAYS,
        };
        let info = DeviceInfo { name: "inline".into(), kind: DeviceKind::Other("inline"), caps };
        Ok(Arc::new(Inline {
            info,
            ctx,
            ran: counters.ran.clone(),
            images: ImageCache::default(),
            loads: counters.loads.clone(),
            runner: Runner::new("inline".into()),
        }) as Arc<dyn Driver>)
    }
}

// The contract every driver keeps, on this one. It runs everything inside `submit`,
// so a failed operation leaves no handle to wait on; it has no memory of its own and
// records no command buffers.
gantry_conformance::suite!(
    inline,
    |ctx: DriverContext| -> Arc<dyn Driver> { inline_driver(Counters::default())(ctx).expect("a driver") },
    skips = [allocation_limits, dependency_failure_propagates, command_buffer_replay, command_buffer_patch]
);

/// `y[i] = a * x[i] + y[i]`, as a stack-machine kernel: its only image is a kind the
/// engine does not know.
fn saxpy() -> KernelRef {
    use Op::*;
    let signature = Signature::new().global(AccessMode::Read).global(AccessMode::ReadWrite).scalar::<u32>();
    let program = [Load(0), Scalar(0), Mul, Load(1), Add, Store(1)];
    Kernel::new("saxpy", signature).with_image(assemble("saxpy", &program)).into_ref()
}

fn inline_queue(rt: &Runtime) -> gantry::Queue {
    let id = rt.devices().len() as u32 - 1;
    rt.queue_with(QueueOptions { device: id, in_order: true }).unwrap()
}

#[test]
fn a_driver_registered_by_a_factory_runs_what_the_scheduler_hands_it() {
    for mode in [Mode::Threaded, Mode::Manual] {
        let counters = Counters::default();
        let rt = Runtime::builder().mode(mode).driver(inline_driver(counters.clone())).build();
        assert_eq!(rt.devices().last().unwrap().kind, DeviceKind::Other("inline"));
        let q = inline_queue(&rt);
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
        assert!(counters.ran.load(Ordering::Relaxed) >= 5, "{mode:?}");
    }
}

/// The scheduler carries an image it cannot read, with its scalars, to the driver
/// that runs it; the driver decodes the image once however many launches carry it.
#[test]
fn a_kernel_whose_only_image_is_a_kind_the_engine_does_not_know_runs_end_to_end() {
    for mode in [Mode::Threaded, Mode::Manual] {
        let counters = Counters::default();
        let rt = Runtime::builder().mode(mode).driver(inline_driver(counters.clone())).build();
        let q = inline_queue(&rt);
        let n = 1000;
        let x = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
        let y = rt.buffer(&vec![1u32; n]);
        let kernel = saxpy();
        for a in [2u32, 3, 5] {
            q.submit(|cg| {
                cg.read(&x);
                cg.read_write(&y);
                cg.launch(&kernel, n).scalar(0, a);
            })
            .unwrap();
        }
        let expect: Vec<u32> = (0..n as u32).map(|i| 1 + 10 * i).collect();
        assert_eq!(y.to_vec().unwrap(), expect, "{mode:?}");
        assert_eq!(counters.loads.load(Ordering::Relaxed), 1, "decoded once for three launches");

        // A bad image is the driver's typed error at the launch, and its dependents
        // fail; the runtime goes on.
        let broken = Kernel::new("broken", Signature::new().global(AccessMode::ReadWrite))
            .with_image(CodeImage::new(STACK_VM, "broken", vec![9, 9]))
            .into_ref();
        let e = q
            .submit(|cg| {
                cg.read_write(&y);
                cg.launch(&broken, n);
            })
            .unwrap();
        let err = e.wait().unwrap_err();
        assert!(err.to_string().contains("unknown opcode 9"), "{err}");
        assert_eq!(y.to_vec().unwrap(), expect, "the failed launch changed nothing");
    }
}

/// A launch is checked against its kernel's signature and its device at submit, with
/// a typed error naming the problem; nothing is enqueued.
#[test]
fn launches_are_checked_against_the_signature_and_the_device() {
    let rt = Runtime::builder().driver(inline_driver(Counters::default())).build();
    let (x, y) = (rt.buffer(&[1u32; 8]), rt.buffer(&[0u32; 8]));
    let kernel = saxpy();
    // The CPU device (0) runs closures only.
    let cpu = rt.queue();
    let err = cpu
        .submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, 8).scalar(0, 1u32);
        })
        .unwrap_err();
    assert!(matches!(&err, Error::NoImageForDevice { kinds, .. } if kinds == "stack-vm"), "{err}");

    let q = inline_queue(&rt);
    let err = q
        .submit(|cg| {
            cg.read(&x);
            cg.launch(&kernel, 8).scalar(0, 1u32);
        })
        .unwrap_err();
    assert!(matches!(err, Error::KernelArguments { expected: 2, got: 1, .. }), "{err}");
    let err = q
        .submit(|cg| {
            cg.read(&x);
            cg.write(&y);
            cg.launch(&kernel, 8).scalar(0, 1u32);
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::KernelArgumentMode {
                index: 1,
                expected: AccessMode::ReadWrite,
                got: AccessMode::Write,
                ..
            }
        ),
        "{err}"
    );
    let err = q
        .submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, 8).scalar(0, 1u64);
        })
        .unwrap_err();
    assert!(matches!(&err, Error::ScalarArgument { source, .. } if source.got == 8), "{err}");
    let err = q
        .submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, 8);
        })
        .unwrap_err();
    assert!(matches!(err, Error::ScalarNotSet { index: 0, .. }), "{err}");
    assert_eq!(y.to_vec().unwrap(), [0; 8], "nothing ran");
}

/// Fusing kernels whose images no fusion compiler of the device takes cancels the
/// fusion with a typed reason naming the kernel and its image kinds; the kernels run
/// unfused, with the right results.
#[test]
fn a_fusion_no_compiler_of_the_device_takes_is_cancelled_with_its_reason() {
    let rt = Runtime::builder().driver(inline_driver(Counters::default())).build();
    let q = inline_queue(&rt);
    let x = rt.buffer(&[1u32, 2, 3, 4]);
    let y = rt.buffer(&[0u32; 4]);
    let kernel = saxpy();
    q.start_fusion().unwrap();
    for a in [1u32, 10] {
        q.submit(|cg| {
            cg.read(&x);
            cg.read_write(&y);
            cg.launch(&kernel, 4).scalar(0, a);
        })
        .unwrap();
    }
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    match q.fusion_outcome() {
        Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::NoCompiler {
            kernel,
            kinds,
            ..
        }))) => {
            assert_eq!((kernel.as_str(), kinds.as_str()), ("saxpy", "stack-vm"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(y.to_vec().unwrap(), [11, 22, 33, 44]);
}

#[test]
fn a_factory_that_fails_is_a_typed_error_at_build() {
    let unavailable = |_ctx: DriverContext| -> Result<Arc<dyn Driver>, ExecError> {
        Err(ExecError::Unsupported { device: "gpu".into(), what: "this machine (no driver library)" })
    };
    let err = Runtime::builder().driver(unavailable).try_build().err().expect("refused");
    assert!(matches!(err, Error::Exec(ExecError::Unsupported { .. })), "{err:?}");
}
