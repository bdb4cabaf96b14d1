//! # gantry-vulkan
//!
//! Gantry's Vulkan driver: device memory, copies and fills, and compute kernels from
//! SPIR-V or WGSL images (WGSL compiled in-process by naga), submitted with
//! timeline semaphores, through ash with the Vulkan loader opened at run time: the
//! crate builds without Vulkan, and a machine without it gets a typed error, never a
//! panic.
//!
//! ```no_run
//! # fn demo() -> Result<(), gantry_driver::ExecError> {
//! use std::sync::Arc;
//! use gantry_driver::{Driver, DriverContext};
//! // Registered on a runtime: `gantry::Runtime::builder().vulkan(0)`.
//! let (tx, _rx) = gantry_driver::sync::channel::unbounded();
//! let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
//! let driver: Arc<dyn Driver> = gantry_vulkan::factory(0)(ctx)?;
//! assert_eq!(driver.info().kind, gantry_driver::DeviceKind::Other("vulkan"));
//! # Ok(()) }
//! ```
//!
//! ## What works
//!
//! * **Availability**: [`factory`] and [`VulkanDriver::new`] return
//!   [`ExecError::Unsupported`] with `what` = `"Vulkan (…reason…)"` when there is no
//!   loader, no driver, no physical device (of the index asked for, or with a
//!   compute queue), or a device older than Vulkan 1.2 or without
//!   `VK_KHR_push_descriptor`. Failed API calls are [`ExecError::Backend`] with the
//!   call and the `VkResult`'s code and name ([`CallError`]). [`device_count`] asks
//!   without making a driver.
//! * **Device**: the physical device by index ([`Select::Index`]) or the first with
//!   a compute queue ([`Select::FirstWithCompute`]); one compute queue and, where
//!   the device has a family with transfer but neither compute nor graphics (a copy
//!   engine; [`choose_families`]) and [`VulkanConfig::transfer_queue`] is
//!   [`TransferQueue::Dedicated`] (the default), one transfer queue
//!   ([`VulkanDriver::transfer_family`]). One-by-one copies, fills, uploads and
//!   downloads run on the transfer queue, kernels and command buffers on the compute
//!   queue ([`VulkanDriver::queue_stats`] counts the batches); the timeline
//!   semaphores order the two queues' work as they order the lanes'. Buffers are
//!   then `VK_SHARING_MODE_CONCURRENT` over both families, so no queue-family
//!   ownership transfer is needed (the simplest correct choice; exclusive buffers
//!   with release/acquire barriers may be faster on some devices). Without such a
//!   family (lavapipe), or with [`TransferQueue::ComputeQueue`], everything runs on
//!   the compute queue over exclusive buffers.
//! * **Memory** (module `memory`): a device-local storage buffer per allocation
//!   (one `vkAllocateMemory` each, zeroed with `vkCmdFillBuffer` before `alloc`
//!   returns; the device's refusal is [`ExecError::OutOfMemory`]);
//!   [`Capabilities::shares_host_memory`] is false, so the scheduler moves buffers.
//!   Host ↔ device copies go through host-visible staging memory of each
//!   operation's own; device ↔ device copies are `vkCmdCopyBuffer` (overlapping
//!   ranges through scratch); fills take patterns of any width at any offset
//!   (module `transfer`).
//! * **Execution** (module `execution`): timeline semaphores, one per lane
//!   ([`VulkanConfig::lanes`]); a wait-list becomes semaphore waits of the batch
//!   ([`Capabilities::in_driver_waits`]), so a dependent batch is submitted at
//!   once; a completion thread per lane reports each operation exactly once. An
//!   operation whose wait-list names a failed one runs nothing and fails with
//!   [`ExecError::DependencyFailed`]; one the driver refuses when submitted (a
//!   kernel that does not compile, a local size the shader does not have, a
//!   malformed copy) runs nothing and carries its error; a lost device fails what
//!   follows with [`ExecError::DeviceLost`].
//! * **Kernels**: [`ImageKind::SpirV`] and [`ImageKind::Wgsl`] images, each loaded
//!   once per driver into its layouts and shader, with a pipeline per workgroup size
//!   ([`VulkanDriver::pipeline_stats`]). A WGSL image that does not compile fails
//!   its launch with naga's message ([`CompileError`]), as does one whose bindings
//!   or immediate block do not fit the kernel's signature (which Vulkan would leave
//!   undefined); SPIR-V images are trusted to match it.
//!
//! ## The kernel convention
//!
//! * **Buffers**: descriptor set 0, binding `i` is global argument `i`, a storage
//!   buffer over the argument's range (`var<storage, read>` in WGSL where the
//!   argument is only read, `var<storage, read_write>` otherwise). A range must
//!   start at a multiple of the device's `minStorageBufferOffsetAlignment`
//!   ([`Limits::storage_align`], 16 on lavapipe): a range that does not is refused
//!   with an error naming the alignment (binding the aligned-down range would shift
//!   the kernel's indexes).
//! * **Scalars**: a push-constant block laid out by `Signature::scalar_offset`
//!   (`var<immediate> s: S;` in WGSL with `S` the scalars in order: `u32`, `f32`
//!   and `i32` members lie at the same offsets), at most `maxPushConstantsSize`
//!   bytes.
//! * **Geometry**: the last (fastest) dimension of a range is Vulkan's `x` (a 2-D
//!   range `[rows, cols]` is `y = rows, x = cols`). An ND-range's local size must be
//!   the shader's workgroup size, or is set as it where the shader lets the launch
//!   set it: WGSL `override`s named in `@workgroup_size` (`override wx: u32;
//!   @compute @workgroup_size(wx)`), SPIR-V specialization constants of the
//!   `WorkgroupSize` built-in (GLSL `layout(local_size_x_id = 0) in;`). A local size
//!   that does not match a fixed size is refused with an error naming the kernel.
//!   A plain range dispatches `ceil(n / size)` groups of the shader's size
//!   ([`PLAIN_GROUP`] along `x` where the launch sets it), so **a kernel launched
//!   over a plain range must check its index against the range's size** (pass it
//!   as a scalar):
//!
//! ```text
//! struct S { n: u32, a: u32 }
//! var<immediate> s: S;
//! @group(0) @binding(0) var<storage, read_write> x: array<u32>;
//! @compute @workgroup_size(64)
//! fn scale(@builtin(global_invocation_id) id: vec3<u32>) {
//!     if id.x < s.n { x[id.x] = s.a * x[id.x]; }
//! }
//! ```
//!
//! * **Local memory** is the shader's own `var<workgroup>` variables; the
//!   signature's local bytes are checked against `maxComputeSharedMemorySize`
//!   ([`Capabilities::max_local_memory`]). Private memory is the shader's
//!   (`max_private_memory` is 0). A global offset is refused.
//! * WGSL kernels are compiled with naga's `ReadZeroSkipWrite` bounds checks: an
//!   index out of range reads zero and writes nothing, so it cannot fault the device.
//!
//! ## Failures and `preserve_on_failure`
//!
//! A Vulkan kernel does not fail part-way: it is refused before it runs (nothing to
//! restore), or the device is lost (nothing left to restore into). So the driver
//! takes no snapshot.
//!
//! ## Command buffers
//!
//! A finalized command graph's partition on a Vulkan device is recorded into a
//! Vulkan command buffer (module `command_buffer`) with a pipeline barrier exactly
//! where a dependency edge between two of its operations' buffer ranges needs one
//! ([`Barrier`], module `barriers`: masks from the read/write relation, none
//! between independent operations); finalize loads every kernel image, makes its
//! pipelines and plans one descriptor set per distinct (set layout, buffer slots)
//! pair (module `descriptors`). The commands are recorded at the first submission
//! with a binding of the argument table and kept per binding ([`INSTANCES`] of
//! them): the sets allocated from one pool and written with one call, then per
//! dispatch a pipeline bind where the pipeline changes, a set bind where the set
//! changes, push constants where they change. A replay over a binding seen before
//! is one `vkQueueSubmit`; another binding records anew while fewer than
//! [`INSTANCES`] are kept, and past that, for a buffer of kernels only, rewrites the
//! descriptor sets of an idle instance without recording
//! ([`VulkanCommandBuffer::rebinds`]); a patch ([`Driver::patch_command_buffer`])
//! changes the plan and records at the next replay (its scalars are push constants
//! in the commands). [`VulkanCommandBuffer::barriers`] lists the barriers a buffer
//! records.
//!
//! ## Not yet
//!
//! Host tasks ([`Capabilities::host_tasks`] is false: the scheduler runs them on
//! the CPU), command buffers of only copies and fills on the transfer queue (every
//! recorded command buffer replays on the compute queue), device timestamps (completions carry
//! host-observed times), a memory sub-allocator and a staging pool (each host copy
//! makes staging memory as long as itself), and host → device copies whose wait-list
//! is unfinished block `submit` until it finishes (their host bytes must be final
//! when they are staged).

#![warn(missing_docs)]

mod barriers;
mod command_buffer;
mod descriptors;
mod device;
mod error;
mod exact;
mod execution;
mod families;
mod fusion;
mod launch;
mod memory;
mod pipeline;
mod probe;
mod spirv;
mod transfer;
mod wgsl;

use std::sync::{Arc, Mutex};

use ash::vk;
use gantry_driver::{
    fill_fits, patch_buffer, Accepted, AllocId, Capabilities, CommandBuffer, CommandBufferBuilder,
    CommandBufferDesc, CommandBufferLaunch, DeviceInfo, DeviceKind, DeviceOp, Driver, DriverContext,
    ExecError, ImageKind, KernelLaunch, OpPatch, ScalarBlock, Submission,
};

pub use ash;
pub use barriers::{Barrier, Hazard};
pub use command_buffer::{VulkanCommandBuffer, INSTANCES};
pub use device::Limits;
pub use error::CallError;
pub use execution::QueueStats;
pub use families::{choose_families, QueueFamilies, TransferQueue};
pub use fusion::{WgslFusion, WgslFusionStats};
pub use launch::PLAIN_GROUP;
pub use pipeline::PipelineStats;
pub use probe::{device_count, Select};
pub use wgsl::CompileError;

use command_buffer::{Instance, Recorder};
use error::invalid;
use execution::{lock, Lanes, Op, Planned, QueueKind};
use memory::{Buffer, Memory, Place};
use pipeline::{Images, Ready};
use transfer::{Recorded, TransferError};

/// The kind of every Vulkan device.
pub const KIND: DeviceKind = DeviceKind::Other("vulkan");

/// The image kinds the driver runs.
const IMAGE_KINDS: &[ImageKind] = &[ImageKind::SpirV, ImageKind::Wgsl];

/// Configuration of a Vulkan driver.
///
/// ```
/// let config = gantry_vulkan::VulkanConfig { select: gantry_vulkan::Select::Index(1), ..Default::default() };
/// assert_eq!(config.lanes, 4);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VulkanConfig {
    /// Which physical device.
    pub select: Select,
    /// Lanes (timeline semaphores, each with a completion thread) operations are
    /// spread over (at least 1): independent operations on different lanes may
    /// overlap on the device.
    pub lanes: usize,
    /// How long a completion thread polls before it blocks in `vkWaitSemaphores`
    /// (a wake-up from a blocking wait costs tens of microseconds); zero never
    /// polls.
    pub spin_before_blocking: std::time::Duration,
    /// Where one-by-one copies, fills, uploads and downloads run: a transfer-only
    /// queue where the device has one ([`TransferQueue::Dedicated`], the default),
    /// or always the compute queue.
    pub transfer_queue: TransferQueue,
}

impl Default for VulkanConfig {
    fn default() -> Self {
        Self {
            select: Select::Index(0),
            lanes: 4,
            spin_before_blocking: gantry_driver::sync::SPIN_WINDOW,
            transfer_queue: TransferQueue::Dedicated,
        }
    }
}

/// The factory `RuntimeBuilder::driver` takes for physical device `index` with the
/// default configuration: it fails with a typed error where Vulkan or the device is
/// missing.
pub fn factory(index: usize) -> impl Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError> + Send + Sync {
    factory_with(VulkanConfig { select: Select::Index(index), ..Default::default() })
}

/// [`factory`] with a configuration.
pub fn factory_with(
    config: VulkanConfig,
) -> impl Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError> + Send + Sync {
    move |ctx| Ok(Arc::new(VulkanDriver::new(config.clone(), ctx)?) as Arc<dyn Driver>)
}

/// A Vulkan device. See the crate docs.
pub struct VulkanDriver {
    info: DeviceInfo,
    dctx: DriverContext,
    // Dropped in this order: the lanes first (their threads report everything in
    // flight), then memory and pipelines, the device with its last holder.
    lanes: Lanes,
    memory: Memory,
    images: Arc<Images>,
    recorder: Recorder,
    dev: Arc<device::Device>,
    /// The fusion compiler of its WGSL kernels, shared so its cache lasts.
    fusion: Arc<WgslFusion>,
    /// Serializes submissions (lane choice, recording, hand-over).
    submitting: Mutex<()>,
}

impl VulkanDriver {
    /// Opens the device `config.select` names and starts its lanes; a typed error
    /// where Vulkan or the device is missing.
    pub fn new(config: VulkanConfig, dctx: DriverContext) -> Result<Self, ExecError> {
        let name: Arc<str> = match config.select {
            Select::Index(i) => format!("vulkan:{i}").into(),
            Select::FirstWithCompute => "vulkan".into(),
        };
        let dev = device::Device::open(config.select, config.transfer_queue, name.clone())?;
        let lanes = Lanes::new(&dev, config.lanes, config.spin_before_blocking, dctx.clone())?;
        let images = Arc::new(Images::new(&dev));
        let caps = Capabilities {
            shares_host_memory: false,
            in_driver_waits: true,
            image_kinds: IMAGE_KINDS,
            host_tasks: false,
            records_host_tasks: false,
            max_local_memory: dev.limits.max_shared,
            max_private_memory: 0,
            virtual_time: false,
            peer_group: 0,
            fusion_window: gantry_driver::fusion::WindowThresholds::ALWAYS,
        };
        Ok(Self {
            info: DeviceInfo { name, kind: KIND, caps },
            dctx,
            lanes,
            memory: Memory::new(&dev),
            recorder: Recorder { images: images.clone(), dev: dev.clone() },
            images,
            dev,
            fusion: Arc::new(WgslFusion::new()),
            submitting: Mutex::new(()),
        })
    }

    /// The device's name as its driver reports it (`llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub fn device_name(&self) -> &str {
        &self.dev.device_name
    }

    /// The limits the driver checks launches against.
    pub fn limits(&self) -> &Limits {
        &self.dev.limits
    }

    /// The queue family kernels and command buffers are submitted to.
    pub fn compute_family(&self) -> u32 {
        self.dev.families.compute
    }

    /// The transfer-only queue family one-by-one copies and fills are submitted to,
    /// where the device has one and the configuration uses it.
    pub fn transfer_family(&self) -> Option<u32> {
        self.dev.families.transfer
    }

    /// How many batches went to the compute and the transfer queue so far.
    pub fn queue_stats(&self) -> QueueStats {
        self.lanes.stats()
    }

    /// How many pipelines the driver made, and the time that took.
    pub fn pipeline_stats(&self) -> PipelineStats {
        self.images.counters.get()
    }

    /// The driver's fusion compiler for WGSL kernels (its cache's counters).
    pub fn wgsl_fusion(&self) -> &Arc<WgslFusion> {
        &self.fusion
    }

    /// How many kernel images the driver holds loaded.
    pub fn loaded_images(&self) -> usize {
        self.images.len()
    }

    fn invalid(&self, message: String) -> ExecError {
        invalid(&self.info.name, message)
    }

    /// Checks an operation and resolves its memory and kernel, recording nothing.
    fn prepare(&self, op: &DeviceOp) -> Result<Prepared, ExecError> {
        let resolve = |m| self.memory.resolve(m).map_err(|e| self.invalid(e));
        match op {
            DeviceOp::Marker => Ok(Prepared::Nothing),
            DeviceOp::Copy { src, dst } => {
                if src.len != dst.len {
                    return Err(self.invalid(format!("copy of {} bytes into {} bytes", src.len, dst.len)));
                }
                Ok(Prepared::Copy { src: resolve(src)?, dst: resolve(dst)?, len: src.len })
            }
            DeviceOp::Fill { dst, pattern } => {
                if !fill_fits(dst.len, pattern) {
                    return Err(self.invalid(format!(
                        "fill of {} bytes with a {}-byte pattern",
                        dst.len,
                        pattern.len()
                    )));
                }
                Ok(Prepared::Fill { dst: resolve(dst)?, len: dst.len, pattern: pattern.to_vec() })
            }
            DeviceOp::Kernel(launch) => self.prepare_kernel(launch),
            DeviceOp::HostTask(_) => {
                Err(ExecError::Unsupported { device: self.info.name.clone(), what: "host tasks" })
            }
            DeviceOp::CommandBuffer(launch) => self.prepare_replay(launch),
        }
    }

    fn prepare_kernel(&self, launch: &KernelLaunch) -> Result<Prepared, ExecError> {
        let kernel = &launch.kernel;
        let name = &kernel.name;
        let signature = &kernel.signature;
        let limits = &self.dev.limits;
        if launch.args.len() != signature.globals.len() {
            return Err(self.invalid(format!(
                "kernel `{name}` has {} buffer slots but {} arguments",
                signature.globals.len(),
                launch.args.len()
            )));
        }
        let mut args = Vec::with_capacity(launch.args.len());
        for (i, arg) in launch.args.iter().enumerate() {
            match self.memory.resolve(&arg.mem) {
                Ok(Place::Device(buffer, offset)) => {
                    if !(offset as u64).is_multiple_of(limits.storage_align) {
                        return Err(self.invalid(format!(
                            "argument {i} of kernel `{name}` starts at byte {offset}, not a multiple of the device's \
                             minStorageBufferOffsetAlignment ({})",
                            limits.storage_align
                        )));
                    }
                    if arg.mem.len as u64 > limits.max_storage_range {
                        return Err(self.invalid(format!(
                            "argument {i} of kernel `{name}` is {} bytes; the device binds at most {} \
                             (maxStorageBufferRange)",
                            arg.mem.len, limits.max_storage_range
                        )));
                    }
                    args.push((buffer, offset, arg.mem.len));
                }
                Ok(Place::Host(..)) => {
                    return Err(self.invalid(format!(
                        "argument {i} of kernel `{name}` is host memory: Vulkan kernels take device memory"
                    )))
                }
                Err(e) => return Err(self.invalid(format!("argument {i} of kernel `{name}`: {e}"))),
            }
        }
        if launch.scalars.len() != signature.scalar_bytes() {
            return Err(self.invalid(format!(
                "kernel `{name}` takes {} bytes of scalars but {} are given",
                signature.scalar_bytes(),
                launch.scalars.len()
            )));
        }
        let ready = self.images.ready(kernel, &launch.geometry, pipeline::Bind::Push)?;
        Ok(Prepared::Kernel { ready, args, scalars: launch.scalars.clone() })
    }

    fn prepare_replay(&self, launch: &CommandBufferLaunch) -> Result<Prepared, ExecError> {
        let Some(recorded) = launch.buffer.downcast_ref::<VulkanCommandBuffer>() else {
            return Err(self.invalid("a command buffer recorded by another driver".into()));
        };
        let mut bound = Vec::with_capacity(launch.args.len());
        for (i, arg) in launch.args.iter().enumerate() {
            match self.memory.resolve(&arg.mem) {
                Ok(Place::Device(buffer, offset)) => bound.push((buffer, offset, arg.mem.len)),
                Ok(Place::Host(..)) => {
                    return Err(self.invalid(format!(
                    "command buffer argument {i} is host memory: Vulkan command buffers take device memory"
                )))
                }
                Err(e) => return Err(self.invalid(format!("command buffer argument {i}: {e}"))),
            }
        }
        let instance = recorded.instance(&bound)?;
        Ok(Prepared::Replay { instance, buffer: launch.buffer.clone() })
    }

    /// Records `work` into a command buffer of `planned`.
    fn record(&self, work: Prepared, planned: &mut Planned) -> Result<(), ExecError> {
        let work = match work {
            Prepared::Nothing => return Ok(()),
            Prepared::Replay { instance, buffer } => {
                planned.replay = Some(instance.cmd);
                planned.finish = instance.finish();
                planned.keep.push(Box::new(instance));
                planned.keep.push(Box::new(buffer));
                return Ok(());
            }
            work => work,
        };
        // Copies and fills use only transfer commands (and barriers of the transfer
        // and host stages), which a transfer-only queue runs.
        planned.queue = match work {
            Prepared::Copy { .. } | Prepared::Fill { .. } => self.lanes.transfer_queue(),
            _ => QueueKind::Compute,
        };
        let reporter = self.lanes.reporter();
        let label = planned.label.clone();
        let mut commands = lock(&self.lanes.commands);
        let cmd = self
            .lanes
            .begin(&mut commands, planned.queue)
            .map_err(|e| reporter.failed(e, format!("recording {label}"), false))?;
        planned.cmd = Some(cmd);
        let recorded = self.encode(work, cmd);
        // SAFETY: a recording command buffer of the locked pool (ended also after a
        // failure, so that it can be begun again).
        let ended = unsafe { self.dev.raw.end_command_buffer(cmd) }
            .map_err(|code| CallError { call: "vkEndCommandBuffer", code });
        let recorded = recorded?;
        ended.map_err(|e| reporter.failed(e, format!("recording {label}"), false))?;
        planned.keep.extend(recorded.keep);
        planned.finish = recorded.finish;
        Ok(())
    }

    fn encode(&self, work: Prepared, cmd: vk::CommandBuffer) -> Result<Recorded, ExecError> {
        let transfer_error = |e: TransferError| match e {
            TransferError::OutOfMemory(n) => {
                ExecError::OutOfMemory { device: self.info.name.clone(), requested: n }
            }
            TransferError::Call(e) => e.into_exec(&self.info.name, "recording a transfer"),
        };
        match work {
            Prepared::Nothing => Ok(Recorded::default()),
            Prepared::Copy { src, dst, len } => {
                transfer::copy(&self.dev, cmd, src, dst, len).map_err(transfer_error)
            }
            Prepared::Fill { dst, len, pattern } => {
                transfer::fill(&self.dev, cmd, dst, len, &pattern).map_err(transfer_error)
            }
            Prepared::Kernel { ready, args, scalars } => {
                let resolved: Vec<(vk::Buffer, usize, usize)> =
                    args.iter().map(|(b, o, l)| (b.raw, *o, *l)).collect();
                pipeline::record_dispatch(
                    &self.dev,
                    cmd,
                    &ready,
                    &resolved,
                    &scalars,
                    &mut vk::Pipeline::null(),
                );
                let mut out = Recorded { device_work: true, ..Default::default() };
                out.keep.push(Box::new(ready.pipelines));
                for (b, _, _) in args {
                    out.keep.push(Box::new(b));
                }
                Ok(out)
            }
            Prepared::Replay { .. } => unreachable!("replays are not recorded"),
        }
    }
}

/// An operation checked and resolved, ready to record.
enum Prepared {
    Nothing,
    Copy { src: Place, dst: Place, len: usize },
    Fill { dst: Place, len: usize, pattern: Vec<u8> },
    Kernel { ready: Ready, args: Vec<(Arc<Buffer>, usize, usize)>, scalars: ScalarBlock },
    Replay { instance: Arc<Instance>, buffer: CommandBuffer },
}

impl Prepared {
    /// Whether recording it reads or writes host memory on the host (which must
    /// wait for what the operation waits on). A device → host copy writes its host
    /// memory later, after its device work, so it does not.
    fn touches_host_now(&self) -> bool {
        matches!(
            self,
            Prepared::Copy { src: Place::Host(..), .. } | Prepared::Fill { dst: Place::Host(..), .. }
        )
    }
}

/// A short description of an operation, for errors.
fn describe(op: &DeviceOp) -> Arc<str> {
    match op {
        DeviceOp::Kernel(k) => format!("kernel `{}`", k.kernel.name).into(),
        DeviceOp::Copy { src, .. } => format!("copy of {} bytes", src.len).into(),
        DeviceOp::Fill { dst, pattern } => {
            format!("fill of {} bytes with a {}-byte pattern", dst.len, pattern.len()).into()
        }
        DeviceOp::HostTask(t) => format!("host task `{}`", t.name).into(),
        DeviceOp::Marker => "marker".into(),
        DeviceOp::CommandBuffer(_) => "command buffer".into(),
    }
}

impl Driver for VulkanDriver {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError> {
        if self.lanes.reporter().is_lost() {
            return Err(self.lanes.reporter().lost_error());
        }
        self.memory.alloc(bytes)
    }

    fn free(&self, id: AllocId) {
        self.memory.free(id)
    }

    /// Every accepted operation is pending; see the crate docs for how it runs and
    /// fails. A wait-list naming another driver's operation is refused.
    fn submit(&self, sub: Submission<'_>) -> Result<Accepted, ExecError> {
        let _serial = lock(&self.submitting);
        let submitted_ns = self.dctx.stamp_ns();
        let mut waits = Vec::with_capacity(sub.waits.len());
        for h in sub.waits {
            let op = h.clone().downcast::<Op>().map_err(|_| {
                self.invalid(format!("op {} waits on an operation of another driver", sub.id.0))
            })?;
            waits.push(op);
        }
        let label = describe(&sub.op);
        let lane = self.lanes.pick(&waits);
        let mut planned = Planned {
            id: sub.id,
            label,
            lane,
            waits,
            preset: None,
            keep: Vec::new(),
            finish: None,
            queue: QueueKind::Compute,
            cmd: None,
            replay: None,
        };
        let failed = |waits: &[Arc<Op>]| {
            waits.iter().find_map(|w| w.failure().map(|e| e.as_dependency_of(w.label.clone())))
        };
        planned.preset = if let Some(e) = failed(&planned.waits) {
            Some(e)
        } else if self.lanes.reporter().is_lost() {
            Some(self.lanes.reporter().lost_error())
        } else {
            match self.prepare(&sub.op) {
                Err(e) => Some(e),
                Ok(work) => {
                    if work.touches_host_now() {
                        // Its host bytes must be final: wait for what it waits on.
                        planned.waits.iter().for_each(|w| drop(w.outcome()));
                    }
                    match failed(&planned.waits) {
                        Some(e) => Some(e),
                        None => self.record(work, &mut planned).err(),
                    }
                }
            }
        };
        Ok(Accepted::Pending(self.lanes.submit(planned, submitted_ns)))
    }

    /// The fusion compiler of WGSL kernels ([`WgslFusion`]), whose fused kernels
    /// are WGSL images like any other.
    fn fusion_compilers(&self) -> Vec<Arc<dyn gantry_driver::fusion::FusionCompiler>> {
        vec![self.fusion.clone()]
    }

    /// Records a command buffer: see the module docs of `command_buffer`.
    fn create_command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        Ok(self.recorder.start(desc))
    }

    /// Patches the plan; the next replay records it anew.
    fn patch_command_buffer(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        patch_buffer(buffer, VulkanCommandBuffer::clone, |b| self.recorder.patch(b, patch)).unwrap_or_else(
            || Err(self.invalid("patching a command buffer recorded by another driver".into())),
        )
    }
}

impl std::fmt::Debug for VulkanDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VulkanDriver")
            .field("name", &self.info.name)
            .field("device", &self.dev.device_name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::sync::channel::unbounded;

    /// Without Vulkan the driver is a typed error naming what is missing; with it,
    /// device 0 opens and says what it is, and an index past the last device is a
    /// typed error.
    #[test]
    fn unavailable_vulkan_is_a_typed_error_and_available_vulkan_opens() {
        let (tx, _rx) = unbounded();
        let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
        match VulkanDriver::new(VulkanConfig::default(), ctx.clone()) {
            Ok(d) => {
                assert_eq!(d.info().kind, KIND);
                assert!(!d.info().caps.shares_host_memory && d.info().caps.in_driver_waits);
                eprintln!("vulkan:0 is {} ({:?})", d.device_name(), d.limits());
                let past = VulkanDriver::new(
                    VulkanConfig { select: Select::Index(4096), ..Default::default() },
                    ctx,
                );
                assert!(
                    matches!(&past, Err(ExecError::Unsupported { what, .. }) if what.contains("index")),
                    "{past:?}"
                );
            }
            Err(ExecError::Unsupported { device, what }) => {
                assert_eq!(&*device, "vulkan:0");
                assert!(what.starts_with("Vulkan ("), "{what}");
                eprintln!("no Vulkan on this machine: {what}");
            }
            Err(e) => panic!("Vulkan is present but did not start: {e}"),
        }
    }
}
