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
//! let ctx = DriverContext { completions: tx, epoch: std::time::Instant::now() };
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
//!   a compute queue ([`Select::FirstWithCompute`]); one compute queue. A
//!   transfer-only queue family is found where one exists
//!   ([`VulkanDriver::transfer_family`]) but not used yet: every batch goes to the
//!   compute queue.
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
//!   ([`VulkanDriver::pipeline_stats`]).
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
//! ## Not yet
//!
//! Command buffers (`create_command_buffer` refuses; the scheduler replays command
//! graphs as single submissions), host tasks ([`Capabilities::host_tasks`] is false:
//! the scheduler runs them on the CPU), the transfer queue, fusion, device
//! timestamps (completions carry host-observed times), a memory sub-allocator and a
//! staging pool (each host copy makes staging memory as long as itself), and
//! host → device copies whose wait-list is unfinished block `submit` until it
//! finishes (their host bytes must be final when they are staged).

#![warn(missing_docs)]

mod device;
mod error;
mod execution;
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
    fill_fits, no_image, Accepted, AllocId, Capabilities, DeviceInfo, DeviceKind, DeviceOp, Driver,
    DriverContext, ExecError, ImageCache, ImageKind, KernelLaunch, KernelRef, ScalarBlock, ScratchKind,
    Submission,
};

pub use ash;
pub use device::Limits;
pub use error::CallError;
pub use launch::PLAIN_GROUP;
pub use pipeline::PipelineStats;
pub use probe::{device_count, Select};
pub use wgsl::CompileError;

use error::invalid;
use execution::{lock, Lanes, Op, Planned};
use launch::Shape;
use memory::{Buffer, Memory, Place};
use pipeline::{LoadError, Pipelines};
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
}

impl Default for VulkanConfig {
    fn default() -> Self {
        Self { select: Select::Index(0), lanes: 4, spin_before_blocking: gantry_driver::sync::SPIN_WINDOW }
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
    images: ImageCache<Pipelines>,
    counters: Arc<pipeline::Counters>,
    dev: Arc<device::Device>,
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
        let dev = device::Device::open(config.select, name.clone())?;
        let lanes = Lanes::new(&dev, config.lanes, config.spin_before_blocking, dctx.clone())?;
        let caps = Capabilities {
            shares_host_memory: false,
            in_driver_waits: true,
            image_kinds: IMAGE_KINDS,
            host_tasks: false,
            max_local_memory: dev.limits.max_shared,
            max_private_memory: 0,
            virtual_time: false,
            peer_group: 0,
        };
        Ok(Self {
            info: DeviceInfo { name, kind: KIND, caps },
            dctx,
            lanes,
            memory: Memory::new(&dev),
            images: ImageCache::default(),
            counters: Arc::default(),
            dev,
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

    /// The queue family the driver submits to.
    pub fn compute_family(&self) -> u32 {
        self.dev.compute_family
    }

    /// A transfer-only queue family of the device, where it has one (not used yet).
    pub fn transfer_family(&self) -> Option<u32> {
        self.dev.transfer_family
    }

    /// How many pipelines the driver made, and the time that took.
    pub fn pipeline_stats(&self) -> PipelineStats {
        self.counters.get()
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
            DeviceOp::CommandBuffer(_) => {
                Err(ExecError::Unsupported { device: self.info.name.clone(), what: "command buffers" })
            }
        }
    }

    /// The loaded image of `kernel` (SPIR-V preferred over WGSL).
    fn load(&self, kernel: &KernelRef) -> Result<Arc<Pipelines>, ExecError> {
        let image = kernel
            .image(ImageKind::SpirV)
            .or_else(|| kernel.image(ImageKind::Wgsl))
            .ok_or_else(|| no_image(&self.info.name, &kernel.name))?;
        self.images
            .get_or_load(image, |i| Pipelines::load(&self.dev, i, &kernel.signature, &self.counters))
            .map_err(|e| self.load_error(kernel, image.kind(), e))
    }

    fn load_error(&self, kernel: &KernelRef, kind: ImageKind, e: LoadError) -> ExecError {
        match e {
            LoadError::Compile(e) => {
                self.invalid(format!("the {kind} image of kernel `{}` does not load: {e}", kernel.name))
            }
            LoadError::Call(e) => {
                e.into_exec(&self.info.name, format!("loading the {kind} image of kernel `{}`", kernel.name))
            }
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
        if launch.geometry.offset() != [0; 3] {
            return Err(ExecError::Unsupported {
                device: self.info.name.clone(),
                what: "global offsets in Vulkan kernel launches",
            });
        }
        let local = signature.memory_bytes(ScratchKind::Local);
        if local > limits.max_shared {
            return Err(self.invalid(format!(
                "kernel `{name}` declares {local} bytes of local memory; the device has {} (maxComputeSharedMemorySize)",
                limits.max_shared
            )));
        }
        if launch.scalars.len() > limits.max_push as usize {
            return Err(self.invalid(format!(
                "kernel `{name}` takes {} bytes of scalars; the device's push constants hold {}",
                launch.scalars.len(),
                limits.max_push
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
        let pipelines = self.load(kernel)?;
        if pipelines.globals != args.len() {
            return Err(self.invalid(format!(
                "kernel `{name}` has {} buffer slots but its image was loaded for {}",
                args.len(),
                pipelines.globals
            )));
        }
        let shape = launch::shape(&launch.geometry, &pipelines.dims, limits)
            .map_err(|e| self.invalid(format!("kernel `{name}`: {e}")))?;
        let pipeline =
            pipelines.pipeline(shape.size).map_err(|e| self.load_error(kernel, ImageKind::Wgsl, e))?;
        Ok(Prepared::Kernel { pipelines, pipeline, shape, args, scalars: launch.scalars.clone() })
    }

    /// Records `work` into a command buffer of `planned`.
    fn record(&self, work: Prepared, planned: &mut Planned) -> Result<(), ExecError> {
        if let Prepared::Nothing = work {
            return Ok(());
        }
        let reporter = self.lanes.reporter();
        let label = planned.label.clone();
        let mut commands = lock(&self.lanes.commands);
        let cmd = self
            .lanes
            .begin(&mut commands)
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
            Prepared::Kernel { pipelines, pipeline, shape, args, scalars } => {
                let infos: Vec<[vk::DescriptorBufferInfo; 1]> = args
                    .iter()
                    .map(|(b, offset, len)| {
                        let range = if *len == 0 { vk::WHOLE_SIZE } else { *len as u64 };
                        [vk::DescriptorBufferInfo { buffer: b.raw, offset: *offset as u64, range }]
                    })
                    .collect();
                let writes: Vec<vk::WriteDescriptorSet> = infos
                    .iter()
                    .enumerate()
                    .map(|(i, info)| {
                        vk::WriteDescriptorSet::default()
                            .dst_binding(i as u32)
                            .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                            .buffer_info(info)
                    })
                    .collect();
                let mut push = scalars.to_vec();
                push.resize(pipelines.push_bytes as usize, 0);
                let d = &self.dev.raw;
                // SAFETY: a recording command buffer; the pipeline and layout are the
                // image's (kept with the operation); the descriptors name live
                // buffers (kept) over checked, aligned ranges; the push constants
                // fit the layout's range.
                unsafe {
                    d.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
                    if !writes.is_empty() {
                        self.dev.push.cmd_push_descriptor_set(
                            cmd,
                            vk::PipelineBindPoint::COMPUTE,
                            pipelines.layout,
                            0,
                            &writes,
                        );
                    }
                    if !push.is_empty() {
                        d.cmd_push_constants(cmd, pipelines.layout, vk::ShaderStageFlags::COMPUTE, 0, &push);
                    }
                    d.cmd_dispatch(cmd, shape.groups[0], shape.groups[1], shape.groups[2]);
                }
                let mut out = Recorded { device_work: true, ..Default::default() };
                out.keep.push(Box::new(pipelines));
                for (b, _, _) in args {
                    out.keep.push(Box::new(b));
                }
                Ok(out)
            }
        }
    }
}

/// An operation checked and resolved, ready to record.
enum Prepared {
    Nothing,
    Copy {
        src: Place,
        dst: Place,
        len: usize,
    },
    Fill {
        dst: Place,
        len: usize,
        pattern: Vec<u8>,
    },
    Kernel {
        pipelines: Arc<Pipelines>,
        pipeline: vk::Pipeline,
        shape: Shape,
        args: Vec<(Arc<Buffer>, usize, usize)>,
        scalars: ScalarBlock,
    },
}

impl Prepared {
    /// Whether recording it reads or writes host memory on the host (which must
    /// wait for what the operation waits on). A device → host copy writes its host
    /// memory later, after its device work, so it does not.
    fn touches_host_now(&self) -> bool {
        match self {
            Prepared::Copy { src: Place::Host(..), .. } => true,
            Prepared::Fill { dst: Place::Host(..), .. } => true,
            _ => false,
        }
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
        let submitted_ns = self.dctx.now_ns();
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
            cmd: None,
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
        let ctx = DriverContext { completions: tx, epoch: std::time::Instant::now() };
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
