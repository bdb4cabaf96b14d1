//! The runner every host driver executes operations with, once they are bound to
//! memory: a kernel over all its work-groups, with its snapshot and, for a fused
//! kernel that failed, the unfused rerun; a host task; one recorded operation of a
//! command buffer. What differs between drivers is only how a launch's work-groups
//! run ([`Groups`]): the CPU driver spreads them over its worker pool, the simulated
//! device runs them in order on its poller's [`Arena`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use gantry_driver::contain::take_drop_panic;
use gantry_driver::{
    fill_bytes, no_image, panic_message, AccessMode, Binding, ExecError, Geometry, HostCtx, HostFn,
    KernelRef, RecordedOp,
};

use crate::closure::{Arena, ClosureImage, ClosureKernel};
use crate::snapshot::SnapshotPool;

/// How a driver runs every work-group of a closure kernel's launch.
pub trait Groups {
    /// Runs every work-group of `geometry` with `kernel`'s phases over `bindings` (one
    /// per global slot), all phases of a group before its next, so a barrier between
    /// phases holds. A panic of the kernel propagates (the caller catches it).
    fn run(&mut self, kernel: &ClosureKernel, geometry: &Geometry, bindings: &[Binding]);

    /// Runs `f` over ranges of the group ids `0..groups` that together cover each
    /// id once (how compiled kernels, which run a range of groups per call, spread
    /// their groups); a panic of `f` propagates. By default: one range, on the
    /// calling thread.
    fn run_ranges(&mut self, groups: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        f(0..groups)
    }
}

/// The groups one after the other on the calling thread, in this arena.
impl Groups for Arena {
    fn run(&mut self, kernel: &ClosureKernel, geometry: &Geometry, bindings: &[Binding]) {
        for g in 0..geometry.group_count() {
            kernel.run_group(geometry, g, bindings, self);
        }
    }
}

/// A kernel as one launch calls it: the kernel, its iteration space and its scalar
/// block (laid out by its signature; closure kernels capture theirs and ignore it).
#[derive(Clone, Copy, Debug)]
pub struct KernelCall<'a> {
    /// The kernel.
    pub kernel: &'a KernelRef,
    /// Its iteration space.
    pub geometry: &'a Geometry,
    /// Its scalar arguments.
    pub scalars: &'a [u8],
}

/// What a host driver runs bound operations with: its name, for errors, and the
/// pool its snapshots (`preserve_on_failure`) take their memory from.
///
/// ```
/// use std::sync::Arc;
/// use gantry_driver::{AccessMode, Binding, ExecError, Geometry, ItemCost, Range};
/// use gantry_host::{phase, Accessor, Arena, ClosureKernel, KernelCall, ReadWrite, Runner};
/// let acc = Accessor::<u32, ReadWrite>::new(0, 1, 4);
/// let kernel = ClosureKernel {
///     tag: 1,
///     phases: smallvec::smallvec![phase(move |it| {
///         let i = it.global_linear_id();
///         acc.set(it, i, 9);
///         assert!(i < 2, "work-item {i} fails");
///     })],
///     global_slots: 1,
///     scratch: vec![],
///     unfused: None,
/// }
/// .into_kernel("nine", [AccessMode::ReadWrite], ItemCost::default());
/// let runner = Runner::new("doc".into());
/// let mut data = [1u32; 4];
/// let bindings = [Binding::new(data.as_mut_ptr().cast(), 16)];
/// let geometry = Geometry::for_range(Range::d1(4)).unwrap();
/// # let hook = std::panic::take_hook();
/// # std::panic::set_hook(Box::new(|_| {}));
/// // SAFETY: `data` is live and nothing else touches it.
/// let modes = [AccessMode::ReadWrite].into_iter();
/// let call = KernelCall { kernel: &kernel, geometry: &geometry, scalars: &[] };
/// let result =
///     unsafe { runner.run_kernel(call, modes, &bindings, true, &mut Arena::default()) };
/// # std::panic::set_hook(hook);
/// assert!(matches!(result, Err(ExecError::KernelPanicked { .. })));
/// assert_eq!(data, [1; 4], "preserved: what it wrote is undone");
/// ```
#[derive(Debug)]
pub struct Runner {
    device: Arc<str>,
    snapshots: Arc<SnapshotPool>,
    /// Compiles and runs LLVM IR kernels (feature `jit`).
    #[cfg(feature = "jit")]
    ir: crate::ir::IrKernels,
}

impl Runner {
    /// The runner of the device named `device`, with a default [`SnapshotPool`].
    pub fn new(device: Arc<str>) -> Self {
        Self {
            device,
            snapshots: Arc::new(SnapshotPool::default()),
            #[cfg(feature = "jit")]
            ir: Default::default(),
        }
    }

    /// The device's name, as its errors give it.
    pub fn device(&self) -> &Arc<str> {
        &self.device
    }

    /// The pool its snapshots take their memory from.
    pub fn snapshots(&self) -> &Arc<SnapshotPool> {
        &self.snapshots
    }

    /// Runs `work` over `bindings` (`modes` says how it uses each, in order); with
    /// `preserve`, the written ranges are snapshotted first and restored if `work`
    /// fails, so buffers keep their last valid contents. What any host-side
    /// execution (a closure kernel, a host task, code of a driver's own image kind)
    /// fails with.
    ///
    /// # Safety
    /// The bindings must be live for the whole call and touched by nothing but `work`
    /// meanwhile (the scheduler orders conflicting commands).
    pub unsafe fn preserving(
        &self,
        modes: impl Iterator<Item = AccessMode>,
        bindings: &[Binding],
        preserve: bool,
        work: impl FnOnce() -> Result<(), ExecError>,
    ) -> Result<(), ExecError> {
        // SAFETY: forwarded.
        unsafe { self.preserving_ranges(modes.zip(bindings.iter().copied()), preserve, work) }
    }

    /// [`Runner::preserving`] over ranges and their modes: only memory `work` may
    /// write, since a failure writes the snapshot back over all of it.
    ///
    /// # Safety
    /// As [`Runner::preserving`].
    unsafe fn preserving_ranges(
        &self,
        ranges: impl Iterator<Item = (AccessMode, Binding)>,
        preserve: bool,
        work: impl FnOnce() -> Result<(), ExecError>,
    ) -> Result<(), ExecError> {
        if !preserve {
            // No snapshot to take or drop: the common path of replayed kernels.
            return work();
        }
        // SAFETY: live bindings that nothing else touches (the caller's contract).
        let snapshot = unsafe { self.snapshots.take_modes(ranges) };
        let result = work();
        if result.is_err() {
            // SAFETY: `work` has stopped; the memory is still alive and nothing else
            // touches it.
            unsafe { snapshot.restore() };
        }
        result
    }

    /// Runs a kernel over bound memory, all its work-groups as `groups` runs them; a
    /// panic stops it and is its error (what it wrote stays written). A kernel
    /// without a closure image fails with [`ExecError::NoImage`].
    pub fn launch(
        &self,
        kernel: &KernelRef,
        geometry: &Geometry,
        bindings: &[Binding],
        scalars: &[u8],
        groups: &mut impl Groups,
    ) -> Result<(), ExecError> {
        let Some(closure) = kernel.closure() else {
            #[cfg(feature = "jit")]
            if let Some(image) = kernel.image(gantry_driver::ImageKind::LlvmIr) {
                // SAFETY: the caller's bindings are live and exclusive (`run_kernel`'s
                // contract, which every caller of `launch` keeps).
                let call = KernelCall { kernel, geometry, scalars };
                return unsafe { self.ir.launch(&self.device, call, image, bindings, groups) };
            }
            let _ = scalars;
            return Err(no_image(&self.device, &kernel.name));
        };
        catch_unwind(AssertUnwindSafe(|| groups.run(closure, geometry, bindings))).map_err(|p| {
            ExecError::KernelPanicked { kernel: kernel.name.clone(), message: panic_message(&*p) }
        })
    }

    /// Runs a kernel over `bindings` (`modes` says how it uses each, in order); with
    /// `preserve`, it snapshots the written ranges first and restores them if the
    /// kernel fails. A fused kernel saves only its kernels' written slots
    /// ([`Unfused::written`](crate::fusion::Unfused::written)), restored so then runs
    /// its kernels one by one ([`Unfused::rerun`](crate::fusion::Unfused::rerun)), so
    /// that its failure keeps what they would have kept unfused; without `preserve`
    /// nothing was restored, and nothing runs again.
    ///
    /// # Safety
    /// The bindings must be live for the whole call, and what the kernel writes of
    /// them touched by nothing else meanwhile (the scheduler orders conflicting
    /// commands; other commands may write between a fused kernel's slots).
    pub unsafe fn run_kernel(
        &self,
        call: KernelCall<'_>,
        modes: impl Iterator<Item = AccessMode>,
        bindings: &[Binding],
        preserve: bool,
        groups: &mut impl Groups,
    ) -> Result<(), ExecError> {
        let KernelCall { kernel, geometry, scalars } = call;
        let launch = || self.launch(kernel, geometry, bindings, scalars, groups);
        let closure = kernel.closure();
        // A kernel without a closure (an LLVM IR image) fails only before it runs:
        // nothing to restore.
        let preserve = preserve && closure.is_some();
        let unfused = closure.and_then(|c| c.unfused.as_ref());
        // A fused kernel's arguments are the hulls of its kernels' slots, whose gaps
        // other commands may write meanwhile: it saves only the slots it writes.
        let written = unfused.filter(|_| preserve).and_then(|u| u.written(bindings));
        // SAFETY: forwarded; a fused kernel writes only its slots.
        let result = unsafe {
            match &written {
                Some(slots) => {
                    self.preserving_ranges(slots.iter().map(|&b| (AccessMode::ReadWrite, b)), true, launch)
                }
                None => self.preserving(modes, bindings, preserve, launch),
            }
        };
        let Err(error) = result else {
            return Ok(());
        };
        if !preserve {
            // Nothing was restored, and nothing runs again.
            return Err(error);
        }
        let Some(unfused) = unfused else { return Err(error) };
        // The kernels of a fused closure kernel are closures: no scalars.
        let launch = |k: &KernelRef, g: &Geometry, b: &[Binding]| self.launch(k, g, b, &[], groups);
        // SAFETY: as above; the fused kernel's writes were just undone.
        unsafe { unfused.rerun(bindings, &self.snapshots, launch) }.unwrap_or(Err(error))
    }

    /// Runs host task `name` (its accessors tagged `tag`) over `bindings` (`modes`
    /// says how it uses each, in order) on the calling thread. Its closure is
    /// dropped right after it ran: a panic in its body, or in a destructor of what
    /// it captured (which [`Contained`](gantry_driver::contain::Contained) caught),
    /// fails it with [`ExecError::HostTaskPanicked`]; with `preserve`, its written
    /// ranges are then restored.
    ///
    /// # Safety
    /// The bindings must be live host memory for the whole call, touched by nothing
    /// else meanwhile.
    pub unsafe fn run_host_task(
        &self,
        name: Arc<str>,
        tag: u64,
        mut run: HostFn,
        modes: impl Iterator<Item = AccessMode>,
        bindings: &[Binding],
        preserve: bool,
    ) -> Result<(), ExecError> {
        let body = move || {
            run(&HostCtx::new(bindings, tag));
            drop(run);
        };
        // SAFETY: the caller's contract.
        unsafe { self.host_task(name, body, modes, bindings, preserve) }
    }

    /// Runs a host task's `body` over `bindings`: a panic in it, or in a destructor
    /// it ran (which [`Contained`](gantry_driver::contain::Contained) caught), fails
    /// it with [`ExecError::HostTaskPanicked`]; with `preserve`, its written ranges are
    /// then restored.
    ///
    /// # Safety
    /// As [`Runner::run_host_task`].
    unsafe fn host_task(
        &self,
        name: Arc<str>,
        body: impl FnOnce(),
        modes: impl Iterator<Item = AccessMode>,
        bindings: &[Binding],
        preserve: bool,
    ) -> Result<(), ExecError> {
        let task = move || {
            // A destructor panic another closure left on this thread is not this task's.
            let _ = take_drop_panic();
            catch_unwind(AssertUnwindSafe(body))
                .map_err(|p| panic_message(&*p))
                .and_then(|()| take_drop_panic().map_or(Ok(()), Err))
                .map_err(|message| ExecError::HostTaskPanicked { task: name, message })
        };
        // SAFETY: live bindings, exclusive to this task (the caller's contract).
        unsafe { self.preserving(modes, bindings, preserve, task) }
    }

    /// Runs one recorded operation of a command buffer over its bound arguments
    /// (in [`RecordedOp::args`] order; `bindings` may run on past them): a kernel as
    /// [`Runner::run_kernel`] runs it, a host task as [`Runner::run_host_task`] runs it
    /// (in place, on this thread), copies, writes of recorded host data, fills and
    /// markers. Reads into host memory are not run (no host driver records them).
    ///
    /// # Safety
    /// As for [`Runner::run_kernel`]; a copy's two ranges must have equal lengths and
    /// a fill's length must be a multiple of its pattern's (as a
    /// [`PlanBuilder`](gantry_driver::PlanBuilder) records them).
    pub unsafe fn run_recorded(
        &self,
        op: &RecordedOp,
        bindings: &[Binding],
        preserve: bool,
        groups: &mut impl Groups,
    ) -> Result<(), ExecError> {
        match op {
            RecordedOp::Kernel { kernel, geometry, args, scalars } => {
                let (bindings, modes) = (&bindings[..args.len()], args.iter().map(|a| a.mode));
                let call = KernelCall { kernel, geometry, scalars };
                // SAFETY: forwarded.
                unsafe { self.run_kernel(call, modes, bindings, preserve, groups) }
            }
            RecordedOp::Copy { .. } => {
                let (s, d) = (bindings[0], bindings[1]);
                // SAFETY: live ranges of equal length (the caller's contract); `copy`
                // tolerates overlap (a copy within one buffer).
                unsafe { std::ptr::copy(s.ptr, d.ptr, s.len) };
                Ok(())
            }
            RecordedOp::Write { src, .. } => {
                let d = bindings[0];
                if src.len() != d.len {
                    let message = format!("write of {} bytes into {} bytes", src.len(), d.len);
                    return Err(ExecError::Driver { device: self.device.clone(), message });
                }
                // SAFETY: live, exclusive by scheduling; the host data is immutable.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), d.ptr, d.len) };
                Ok(())
            }
            RecordedOp::Fill { pattern, .. } => {
                let d = bindings[0];
                // SAFETY: live, exclusive by scheduling; the length is a multiple of the
                // pattern's (the caller's contract).
                unsafe { fill_bytes(d.ptr, d.len, pattern) };
                Ok(())
            }
            RecordedOp::Marker => Ok(()),
            RecordedOp::HostTask { name, run, tag, args } => {
                let (bindings, modes) = (&bindings[..args.len()], args.iter().map(|a| a.mode));
                let body = || (run.0.lock())(&HostCtx::new(bindings, *tag));
                // SAFETY: live bindings, exclusive to this task by scheduling (the
                // caller's contract).
                unsafe { self.host_task(name.clone(), body, modes, bindings, preserve) }
            }
            RecordedOp::Read { .. } => {
                Err(ExecError::Unsupported { device: self.device.clone(), what: op.label() })
            }
        }
    }
}
