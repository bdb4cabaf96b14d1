//! The driver interface: one trait every backend implements, shaped after GPU
//! runtimes (asynchronous submission with wait-lists, completions reported later and
//! possibly out of order, device memory and host↔device copies).

use std::sync::Arc;

use crate::sync::channel::Sender;

use crate::clock::Clock;
use crate::command_buffer::{CommandBuffer, CommandBufferBuilder, CommandBufferDesc, OpPatch};
use crate::error::ExecError;
use crate::fusion::{FusionCompiler, WindowThresholds};
use crate::image::ImageKind;
use crate::memory::AllocId;
use crate::op::{Accepted, Completion, Submission};

/// What kind of backend a device is. Open: a backend registered through a
/// [`DriverFactory`] names its own kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceKind {
    /// Host CPU threads.
    Cpu,
    /// The deterministic simulated device.
    Sim,
    /// A backend outside this crate, by its name (`"cuda"`, `"vulkan"`, a test's).
    Other(&'static str),
}

/// Makes a backend's driver when a runtime is built: how a backend plugs in
/// (`RuntimeBuilder::driver`). The driver reports completions through the context it
/// is given. A backend that cannot start here (no driver library, no device) returns
/// the error, which the builder reports; it must not panic.
///
/// Any `Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError>` is a factory.
pub trait DriverFactory: Send + Sync {
    /// Creates the driver.
    fn create(&self, ctx: DriverContext) -> Result<std::sync::Arc<dyn Driver>, ExecError>;
}

impl<F> DriverFactory for F
where
    F: Fn(DriverContext) -> Result<std::sync::Arc<dyn Driver>, ExecError> + Send + Sync,
{
    fn create(&self, ctx: DriverContext) -> Result<std::sync::Arc<dyn Driver>, ExecError> {
        self(ctx)
    }
}

/// What a driver can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Device memory is host memory: no allocations or moves are needed.
    pub shares_host_memory: bool,
    /// Wait-lists may name operations that have not finished: the driver orders them
    /// itself, so the scheduler can hand over a whole dependent batch at once.
    pub in_driver_waits: bool,
    /// The kinds of kernel image it runs ([`ImageKind::Closure`]: Rust closure
    /// kernels). The scheduler refuses a kernel with no image of these kinds.
    pub image_kinds: &'static [ImageKind],
    /// Runs host tasks.
    pub host_tasks: bool,
    /// Records host tasks into its command buffers
    /// ([`RecordedOp::HostTask`](crate::RecordedOp)), run in place at each replay:
    /// a command graph then keeps a host task in its neighbours' partition instead
    /// of giving it one of its own (a driver whose command buffers run on host
    /// threads).
    pub records_host_tasks: bool,
    /// Largest local (work-group) memory per group, in bytes.
    pub max_local_memory: usize,
    /// Largest private memory per work-group (each work-item's private bytes times
    /// the group's work-items), in bytes: a host driver allocates it per group.
    pub max_private_memory: usize,
    /// Timestamps are virtual time (the simulated machine), not real time: the
    /// scheduler passes each submission the virtual time its finished dependencies
    /// ended ([`SimHint::not_before_ns`](crate::SimHint)).
    pub virtual_time: bool,
    /// Devices with the same nonzero peer group copy between their memories directly
    /// (a device-to-device link); otherwise memory moves between them go through host
    /// memory.
    pub peer_group: u64,
    /// From which size a fusion window's kernels pay to fuse
    /// ([`WindowThresholds::ALWAYS`] where fusing saves launches at any size).
    pub fusion_window: WindowThresholds,
}

/// Name, kind and capabilities of a device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Human-readable name, used in errors.
    pub name: Arc<str>,
    /// Backend kind.
    pub kind: DeviceKind,
    /// Capabilities.
    pub caps: Capabilities,
}

/// Where a driver reports completions and reads time.
#[derive(Clone, Debug)]
pub struct DriverContext {
    /// The runtime's completion channel.
    pub completions: Sender<Completion>,
    /// The runtime's clock: real-time drivers report nanoseconds since its epoch, and
    /// stamp completions by its rule ([`Clock::stamp_ns`]: 0 unless the runtime
    /// profiles).
    pub clock: Clock,
}

impl DriverContext {
    /// Nanoseconds since the epoch.
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }
    /// A completion's timestamp: [`DriverContext::now_ns`] where the runtime
    /// profiles, else 0 ([`Clock::stamp_ns`]).
    pub fn stamp_ns(&self) -> u64 {
        self.clock.stamp_ns()
    }
    /// Reports a completion; a closed channel means the runtime is gone and the report
    /// has no reader.
    pub fn complete(&self, c: Completion) {
        let _ = self.completions.send(c);
    }
}

/// A device backend.
///
/// The scheduler calls [`Driver::submit`] only for operations whose dependencies are
/// complete, or (with [`Capabilities::in_driver_waits`]) submitted to this same driver
/// and named in the wait-list. Every submission accepted as pending produces exactly
/// one [`Completion`] on the context's channel, from any thread, in any order.
pub trait Driver: Send + Sync {
    /// Name, kind and capabilities.
    fn info(&self) -> &DeviceInfo;

    /// Allocates `bytes` of device memory (zeroed). Drivers that share host memory
    /// are never asked.
    fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError>;

    /// Frees an allocation once no submitted operation uses it.
    fn free(&self, id: AllocId);

    /// Accepts an operation. An `Err` means it was refused and will never complete.
    /// A driver that ran the operation to the end inside this call returns
    /// [`Accepted::Done`] and sends no completion.
    fn submit(&self, sub: Submission<'_>) -> Result<Accepted, ExecError>;

    /// Starts recording a command buffer (the SYCL graph extension's implementation
    /// design). Drivers without command buffers refuse, and finalizing a command graph
    /// for them fails with [`ExecError::Unsupported`].
    fn create_command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        let _ = desc;
        Err(ExecError::Unsupported { device: self.info().name.clone(), what: "command buffers" })
    }

    /// Patches `buffer` (recorded by this driver): operation `i` takes the kernel,
    /// host data or fill pattern of `patch[i]` over the same arguments and
    /// dependencies (patching with the payloads it had undoes the change). On error
    /// it does not change. The buffer changes in place where nothing else holds it,
    /// else it becomes a patched copy: submissions already made run the original.
    /// This is the fast path of a whole-graph update whose nodes changed only those
    /// and their buffers; the argument table is bound at each launch, so new buffers
    /// need no patch. Drivers without it refuse, and the update records the command
    /// buffer anew.
    fn patch_command_buffer(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        let _ = (buffer, patch);
        Err(ExecError::Unsupported { device: self.info().name.clone(), what: "patching command buffers" })
    }

    /// For drivers with [`Capabilities::virtual_time`]: the virtual time now. The
    /// scheduler stamps it on each new command as the earliest the command may start
    /// ([`SimHint::not_before_ns`](crate::SimHint)). Real-time drivers keep the default, 0.
    fn virtual_now_ns(&self) -> u64 {
        0
    }

    /// Fusion compilers for kernels of this device's image kinds other than closure
    /// kernels (an LLVM JIT for IR images, say); the runtime adds the closure
    /// compiler for devices that run closures. A fusion list is fused by the first
    /// compiler, this device's then the closure one, that every listed kernel has an
    /// image for ([`FusionCompiler::image_kind`]).
    fn fusion_compilers(&self) -> Vec<Arc<dyn FusionCompiler>> {
        Vec::new()
    }

    /// Makes progress on accepted work. Drivers that run on their own threads have
    /// nothing to do; the simulated device executes here, in virtual-time order.
    fn poll(&self) {}
}
