//! # gantry-cuda
//!
//! Gantry's CUDA driver: device memory, copies and fills, and kernels from PTX or
//! CUDA C images, run on an NVIDIA GPU through the CUDA driver API (cudarc's raw
//! bindings, with `libcuda` loaded at run time: the crate builds without a CUDA
//! toolkit, and a machine without CUDA gets a typed error, never a panic).
//!
//! ```no_run
//! # fn demo() -> Result<(), gantry_driver::ExecError> {
//! use std::sync::Arc;
//! use gantry_driver::{Driver, DriverContext};
//! // Registered on a runtime: `gantry::Runtime::builder().driver(gantry_cuda::factory(0))`.
//! let (tx, _rx) = gantry_driver::sync::channel::unbounded();
//! let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
//! let driver: Arc<dyn Driver> = gantry_cuda::factory(0)(ctx)?;
//! assert_eq!(driver.info().kind, gantry_driver::DeviceKind::Other("cuda"));
//! # Ok(()) }
//! ```
//!
//! ## What works
//!
//! * **Availability**: [`factory`] and [`CudaDriver::new`] return
//!   [`ExecError::Unsupported`] when `libcuda` is missing (`"CUDA (libcuda not
//!   found)"`), lacks an entry point, or has no device of the ordinal asked for, and
//!   [`ExecError::Backend`] (call `cuInit`) when the driver fails to initialize.
//!   [`device_count`] asks without making a driver.
//! * **Memory**: device allocations (`cuMemAlloc`, zeroed; the device's refusal is
//!   [`ExecError::OutOfMemory`]); copies host ↔ device through pinned staging memory
//!   in stream order, device ↔ device (overlapping ranges through scratch memory),
//!   host ↔ host; fills with patterns of any width (module `transfer`).
//!   [`Capabilities::shares_host_memory`] is false: the scheduler moves buffers.
//! * **Execution**: a pool of streams ([`CudaConfig::streams`]); a wait-list becomes
//!   `cuStreamWaitEvent` on the waited operations' events
//!   ([`Capabilities::in_driver_waits`]), so a whole dependent batch is enqueued at
//!   once; a completion thread per stream reports each operation exactly once.
//!   Every accepted operation is pending; one that fails when submitted (a refused
//!   launch, a kernel that does not compile, a malformed copy) or whose wait-list
//!   names a failed operation ([`ExecError::DependencyFailed`]) runs nothing and
//!   reports its error. API failures are [`ExecError::Backend`] with the call and
//!   the `CUresult`'s code and name.
//! * **Kernels**: [`ImageKind::Ptx`] images, [`ImageKind::CudaC`] images compiled
//!   by NVRTC (when `libnvrtc` can be loaded) for the device's compute capability,
//!   and with the feature `jit` [`ImageKind::LlvmIr`] images compiled to PTX by
//!   `gantry-jit` (OpenCL work-item built-ins on CUDA's registers, local memory in
//!   dynamic shared memory, hidden parameters the launch appends); each image is
//!   loaded once per driver.
//!
//! ## The kernel convention
//!
//! A kernel image's entry point is a `__global__` function (`extern "C"` in CUDA C,
//! so that its name is the image's entry) with these parameters, in order:
//!
//! 1. one device pointer per global argument, in slot order, pointing at the first
//!    byte of the argument's range (`T*`, any `T`);
//! 2. each scalar of the signature, in order, by value (`Signature::scalar::<u32>()`
//!    is an `unsigned int` parameter).
//!
//! The launch's geometry is the grid: the fastest-varying (last) dimension of a range
//! is CUDA's `x` (a 2-D range `[rows, cols]` is `y = rows, x = cols`). An ND-range's
//! local range is the block and its group counts the grid. A plain range gets blocks
//! of [`PLAIN_BLOCK`] work-items along `x` and a grid that covers the range rounded
//! up, so **a kernel launched over a plain range must check its index against the
//! range's size** (pass the size as a scalar):
//!
//! ```text
//! extern "C" __global__ void scale(float* x, unsigned int n, float a) {
//!     unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
//!     if (i < n) x[i] *= a;
//! }
//! ```
//!
//! The signature's local memory is the block's dynamic shared memory (`extern
//! __shared__`), up to the device's opt-in maximum
//! ([`Capabilities::max_local_memory`]). Private memory is the kernel's own (its
//! local variables): the driver provides none, so `max_private_memory` is 0. A
//! global offset is refused ([`ExecError::Unsupported`]).
//!
//! ## Failures and `preserve_on_failure`
//!
//! A CUDA kernel fails in one of two ways. Its launch is refused (a block larger than
//! the kernel allows, too much shared memory, an image that does not load): nothing
//! ran, so nothing needs restoring. Or it faults while running (an illegal address,
//! a trap): that error is sticky, the context and every allocation in it are
//! unusable, and there is nothing left to restore into. So the driver takes no
//! snapshot: no failure leaves a range half-written on a device that still works. A
//! fault marks the device lost: the first operation whose completion reveals it gets
//! the [`ExecError::Backend`] error (CUDA does not say which kernel faulted, so it may
//! be another operation in flight), the operations waiting on it fail with
//! [`ExecError::DependencyFailed`], and everything else fails with
//! [`ExecError::DeviceLost`], then and after.
//!
//! ## Command buffers
//!
//! A finalized command graph's partition on a CUDA device is a CUDA graph
//! (modules `command_buffer` and `graph`): kernels become kernel nodes, copies memcpy
//! nodes, fills memset nodes (patterns of other widths a few memsets and doubling
//! copies), memory buffer writes memcpy nodes from pinned memory filled at finalize,
//! memory buffer reads memcpy nodes into pinned staging and a host node that copies
//! it out; dependencies are the recorded sync points. Finalize loads every kernel
//! image; the graph is built and instantiated at the first submission, when the
//! argument table is bound to memory. A replay over the same memory is one
//! `cuGraphLaunch`; other memory, or a patch ([`Driver::patch_command_buffer`]),
//! brings the instance up to date before the launch: kernel nodes one by one with
//! `cuGraphExecKernelNodeSetParams` where only they changed, else a whole-graph
//! `cuGraphExecUpdate`, else a new instance. [`CudaDriver::graph_counts`] says how
//! often each happened.
//!
//! ## Not yet
//!
//! * Host tasks ([`Capabilities::host_tasks`] is false: the scheduler runs host
//!   tasks submitted to a CUDA queue on the CPU, moving their buffers to host memory
//!   and back), fusion of CUDA kernels, timestamps from the device (completions
//!   carry host-observed times: an operation starts no earlier than its submission
//!   and its dependencies' ends, and ends when its completion thread sees its event),
//!   and memory pools: `free` is `cuMemFree`, which may wait for the device.
//!
//! ## Several GPUs
//!
//! Devices that can all access each other's memory (`cuDeviceCanAccessPeer`, NVLink
//! or PCIe) share the peer group [`PEER_GROUP`] (module `peer`): the scheduler moves a
//! buffer from one to another with a copy submitted to the target's driver, which
//! resolves the other driver's allocation (ids are unique across the process's CUDA
//! drivers) and runs `cuMemcpyPeerAsync`, with peer access enabled for the pair first.

#![warn(missing_docs)]

mod command_buffer;
mod context;
mod error;
mod execution;
mod graph;
mod launch;
mod memory;
mod module;
mod nvrtc;
mod peer;
mod probe;
mod transfer;

use std::sync::{Arc, Mutex};

use gantry_driver::{
    fill_fits, patch_buffer, Accepted, AllocId, Capabilities, CommandBuffer, CommandBufferBuilder,
    CommandBufferDesc, CommandBufferLaunch, DeviceInfo, DeviceKind, DeviceOp, Driver, DriverContext,
    ExecError, ImageKind, KernelLaunch, KernelRef, OpPatch, Submission,
};

pub use cudarc::driver::sys::CUresult;
pub use error::CallError;
pub use graph::GraphCounts;
pub use launch::PLAIN_BLOCK;
pub use nvrtc::CompileError;
pub use peer::PEER_GROUP;
pub use probe::{device_count, Unavailable};

use command_buffer::{CudaCommandBuffer, Recorder};
use context::Context;
use error::invalid;
use execution::{lock, Event, Lanes, Op, Planned, Stream};
use memory::{Memory, Place};
use module::{Images, Loaded};

/// The kind of every CUDA device.
pub const KIND: DeviceKind = DeviceKind::Other("cuda");

/// Image kinds with NVRTC, and without (LLVM IR with the feature `jit`).
#[cfg(not(feature = "jit"))]
const WITH_NVRTC: &[ImageKind] = &[ImageKind::Ptx, ImageKind::CudaC];
#[cfg(not(feature = "jit"))]
const PTX_ONLY: &[ImageKind] = &[ImageKind::Ptx];
#[cfg(feature = "jit")]
const WITH_NVRTC: &[ImageKind] = &[ImageKind::Ptx, ImageKind::CudaC, ImageKind::LlvmIr];
#[cfg(feature = "jit")]
const PTX_ONLY: &[ImageKind] = &[ImageKind::Ptx, ImageKind::LlvmIr];

/// Configuration of a CUDA driver.
///
/// ```
/// let config = gantry_cuda::CudaConfig { ordinal: 1, ..Default::default() };
/// assert_eq!(config.streams, 4);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    /// Which device (`cuDeviceGet`'s ordinal).
    pub ordinal: usize,
    /// Streams operations are spread over (at least 1): independent operations on
    /// different streams may run at once.
    pub streams: usize,
    /// How long a completion thread polls an operation's event (and its stream's
    /// queue) without yielding before it yields or sleeps: a wake-up from a blocking
    /// wait costs tens of microseconds, which a short kernel's completion would pay
    /// on top of its run. Zero never spins.
    pub spin_before_blocking: std::time::Duration,
    /// How long it then goes on polling the event between yields of its thread
    /// before it blocks in `cuEventSynchronize` (as CUDA's own spin-then-yield
    /// scheduling does): an operation that ends within it is reported without a
    /// blocking wake-up, and a yielding thread gives its core to any thread that
    /// wants it. Zero blocks right after the spin.
    pub poll_before_blocking: std::time::Duration,
}

impl Default for CudaConfig {
    fn default() -> Self {
        Self {
            ordinal: 0,
            streams: 4,
            spin_before_blocking: gantry_driver::sync::SPIN_WINDOW,
            poll_before_blocking: std::time::Duration::from_millis(2),
        }
    }
}

/// The factory [`RuntimeBuilder::driver`](https://docs.rs/gantry) takes for device
/// `ordinal` with the default configuration: it fails with a typed error where CUDA
/// or the device is missing.
pub fn factory(ordinal: usize) -> impl Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError> + Send + Sync {
    factory_with(CudaConfig { ordinal, ..Default::default() })
}

/// [`factory`] with a configuration.
pub fn factory_with(
    config: CudaConfig,
) -> impl Fn(DriverContext) -> Result<Arc<dyn Driver>, ExecError> + Send + Sync {
    move |ctx| Ok(Arc::new(CudaDriver::new(config.clone(), ctx)?) as Arc<dyn Driver>)
}

/// A CUDA device. See the crate docs.
pub struct CudaDriver {
    info: DeviceInfo,
    device_name: String,
    cc: (i32, i32),
    dctx: DriverContext,
    // Dropped in this order: the lanes first (their threads report everything still
    // in flight), then memory and modules; the context when its last holder goes.
    lanes: Lanes,
    zeroing: Stream,
    memory: Memory,
    images: Arc<Images>,
    recorder: Recorder,
    graphs: graph::Counters,
    ctx: Arc<Context>,
    /// Serializes submissions (lane choice, enqueueing, hand-over).
    submitting: Mutex<()>,
}

impl CudaDriver {
    /// Opens device `config.ordinal` and starts its streams and completion threads;
    /// a typed error where CUDA or the device is missing.
    pub fn new(config: CudaConfig, dctx: DriverContext) -> Result<Self, ExecError> {
        let name: Arc<str> = format!("cuda:{}", config.ordinal).into();
        let props = probe::open(config.ordinal, &name)?;
        let fail = |e: CallError| e.into_exec(&name, "starting the driver");
        let ctx = Context::retain(props.dev).map_err(fail)?;
        let wait =
            execution::Waiting { spin: config.spin_before_blocking, poll: config.poll_before_blocking };
        let lanes = Lanes::new(&ctx, config.streams.max(1), wait, name.clone(), dctx.clone())?;
        let zeroing = Stream::new(&ctx).map_err(fail)?;
        let images = Arc::new(Images::new(&ctx, name.clone(), props.cc));
        let caps = Capabilities {
            shares_host_memory: false,
            in_driver_waits: true,
            image_kinds: if images.has_nvrtc() { WITH_NVRTC } else { PTX_ONLY },
            host_tasks: false,
            records_host_tasks: false,
            max_local_memory: props.max_shared,
            max_private_memory: 0,
            virtual_time: false,
            peer_group: if props.peers { PEER_GROUP } else { 0 },
            fusion_window: gantry_driver::fusion::WindowThresholds::ALWAYS,
        };
        Ok(Self {
            info: DeviceInfo { name: name.clone(), kind: KIND, caps },
            device_name: props.name,
            cc: props.cc,
            dctx,
            lanes,
            zeroing,
            memory: Memory::new(&ctx, name.clone(), props.peers),
            recorder: Recorder { ctx: ctx.clone(), images: images.clone(), device: name },
            images,
            graphs: graph::Counters::default(),
            ctx,
            submitting: Mutex::new(()),
        })
    }

    /// The device's name as CUDA reports it (`NVIDIA H100 80GB HBM3`).
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// Why CUDA C images cannot be compiled (NVRTC could not be loaded), or `None`
    /// where they can.
    pub fn cuda_c_unavailable(&self) -> Option<&str> {
        (!self.images.has_nvrtc()).then(|| self.images.nvrtc_missing())
    }

    /// How many kernel images the driver holds loaded (each once, however many
    /// launches carry it; an image's module goes some time after its last clone).
    pub fn loaded_images(&self) -> usize {
        self.images.loaded()
    }

    /// How often its command buffers' graphs were instantiated, updated and
    /// launched.
    pub fn graph_counts(&self) -> GraphCounts {
        self.graphs.get()
    }

    fn invalid(&self, message: String) -> ExecError {
        invalid(&self.info.name, message)
    }

    /// Checks an operation and resolves its memory and kernel, enqueueing nothing.
    fn prepare(&self, op: &DeviceOp) -> Result<Prepared, ExecError> {
        let resolve = |m| self.memory.resolve(m).map_err(|e| self.invalid(e));
        match op {
            DeviceOp::Marker => Ok(Prepared::Nothing),
            DeviceOp::Copy { src, dst } => {
                let src_len = src.len;
                if src.len != dst.len {
                    return Err(self.invalid(format!("copy of {} bytes into {} bytes", src.len, dst.len)));
                }
                let (src, dst) = (resolve(src)?, resolve(dst)?);
                let peer_and_own = matches!(
                    (&src, &dst),
                    (Place::Peer { .. }, Place::Device { .. }) | (Place::Device { .. }, Place::Peer { .. })
                );
                if !peer_and_own && matches!((&src, &dst), (Place::Peer { .. }, _) | (_, Place::Peer { .. }))
                {
                    return Err(self.invalid(
                        "a copy of another device's memory must go to or come from this device's".into(),
                    ));
                }
                Ok(Prepared::Copy { src, dst, len: src_len })
            }
            DeviceOp::Fill { dst, pattern } => {
                if !fill_fits(dst.len, pattern) {
                    return Err(self.invalid(format!(
                        "fill of {} bytes with a {}-byte pattern",
                        dst.len,
                        pattern.len()
                    )));
                }
                let place = resolve(dst)?;
                if matches!(place, Place::Peer { .. }) {
                    return Err(self.invalid("a fill of another device's memory".into()));
                }
                Ok(Prepared::Fill { dst: place, len: dst.len, pattern: pattern.to_vec() })
            }
            DeviceOp::Kernel(launch) => self.prepare_kernel(launch),
            DeviceOp::HostTask(_) => {
                Err(ExecError::Unsupported { device: self.info.name.clone(), what: "host tasks" })
            }
            DeviceOp::CommandBuffer(launch) => self.prepare_command_buffer(launch),
        }
    }

    fn prepare_command_buffer(&self, launch: &CommandBufferLaunch) -> Result<Prepared, ExecError> {
        if !launch.buffer.is::<CudaCommandBuffer>() {
            return Err(self.invalid("a command buffer recorded by another driver".into()));
        }
        let mut bound = smallvec::SmallVec::with_capacity(launch.args.len());
        for (i, arg) in launch.args.iter().enumerate() {
            match self.memory.resolve(&arg.mem) {
                Ok(Place::Device { ptr, .. }) => bound.push(graph::Entry { ptr, len: arg.mem.len }),
                Ok(Place::Peer { .. }) => {
                    return Err(
                        self.invalid(format!("command buffer argument {i} is another device's memory"))
                    )
                }
                Ok(Place::Host(..)) => {
                    return Err(self.invalid(format!(
                        "command buffer argument {i} is host memory: CUDA graphs take device memory"
                    )))
                }
                Err(e) => return Err(self.invalid(format!("command buffer argument {i}: {e}"))),
            }
        }
        Ok(Prepared::Graph { buffer: launch.buffer.clone(), bound })
    }

    fn prepare_kernel(&self, launch: &KernelLaunch) -> Result<Prepared, ExecError> {
        let kernel = &launch.kernel;
        let signature = &kernel.signature;
        if launch.args.len() != signature.globals.len() {
            return Err(self.invalid(format!(
                "kernel `{}` has {} buffer slots but {} arguments",
                kernel.name,
                signature.globals.len(),
                launch.args.len()
            )));
        }
        if launch.geometry.offset() != [0; 3] {
            return Err(ExecError::Unsupported {
                device: self.info.name.clone(),
                what: "global offsets in CUDA kernel launches",
            });
        }
        let mut pointers = Vec::with_capacity(launch.args.len());
        for (i, arg) in launch.args.iter().enumerate() {
            match self.memory.resolve(&arg.mem) {
                Ok(Place::Device { ptr, .. }) => pointers.push(ptr),
                Ok(Place::Peer { .. }) => {
                    return Err(self.invalid(format!(
                        "argument {i} of kernel `{}` is another device's memory",
                        kernel.name
                    )))
                }
                Ok(Place::Host(..)) => {
                    return Err(self.invalid(format!(
                        "argument {i} of kernel `{}` is host memory: CUDA kernels take device memory",
                        kernel.name
                    )))
                }
                Err(e) => return Err(self.invalid(format!("argument {i} of kernel `{}`: {e}", kernel.name))),
            }
        }
        let dims = launch::dims(&launch.geometry)
            .map_err(|e| self.invalid(format!("kernel `{}`: {e}", kernel.name)))?;
        let loaded = self.images.load(kernel)?;
        let params =
            launch::Params::new(signature, pointers, &launch.scalars, loaded.hidden(&launch.geometry))
                .map_err(|e| self.invalid(format!("kernel `{}`: {e}", kernel.name)))?;
        Ok(Prepared::Kernel { loaded, dims, params, kernel: kernel.clone() })
    }

    /// Enqueues `op` on its lane after the waits on other lanes, then records its
    /// event (also after a failure part-way, so its completion waits for what was
    /// enqueued).
    fn enqueue(&self, op: &DeviceOp, planned: &mut Planned) -> Result<(), ExecError> {
        let reporter = self.lanes.reporter();
        self.ctx.bind().map_err(|e| reporter.failed(e, format!("submitting {}", planned.label)))?;
        let work = self.prepare(op)?;
        let lane = &self.lanes.lanes[planned.lane];
        for w in &planned.waits {
            if w.lane != planned.lane && !w.succeeded() {
                if let Some(event) = w.event() {
                    event.wait_on(&lane.stream).map_err(|e| {
                        reporter.failed(e, format!("ordering {} after {}", planned.label, w.label))
                    })?;
                }
            }
        }
        let result = self.encode(work, lane, planned);
        match Event::record(&self.ctx, &lane.stream) {
            Ok(event) => planned.event = Some(event),
            Err(e) if result.is_ok() => {
                return Err(reporter.failed(e, format!("recording the completion of {}", planned.label)))
            }
            Err(_) => {}
        }
        result
    }

    fn encode(&self, work: Prepared, lane: &execution::Lane, planned: &mut Planned) -> Result<(), ExecError> {
        let reporter = self.lanes.reporter();
        let label = &planned.label;
        match work {
            Prepared::Nothing => Ok(()),
            Prepared::Copy { src, dst, len } => {
                let kept = transfer::copy(&self.ctx, lane, src, dst, len)
                    .map_err(|e| reporter.failed(e, format!("{label}")))?;
                planned.keep.extend(kept);
                Ok(())
            }
            Prepared::Fill { dst, len, pattern } => transfer::fill(&lane.stream, dst, len, &pattern)
                .map_err(|e| reporter.failed(e, format!("{label}"))),
            Prepared::Kernel { loaded, dims, params, kernel } => {
                let signature = &kernel.signature;
                let shared = loaded.shared_bytes(signature);
                launch::launch(&lane.stream, &loaded, dims, signature, params).map_err(|e| {
                    reporter.failed(
                        e,
                        format!(
                            "launching kernel `{}` with a grid of {:?} blocks of {:?} and {shared} bytes of \
                             shared memory",
                            kernel.name, dims.grid, dims.block
                        ),
                    )
                })?;
                planned.keep.push(Box::new(loaded));
                Ok(())
            }
            Prepared::Graph { buffer, bound } => {
                let recorded = buffer.downcast_ref::<CudaCommandBuffer>().expect("checked in prepare");
                let instance = graph::launch(&self.ctx, &self.graphs, &lane.stream, recorded, &bound)
                    .map_err(|e| match e {
                        graph::LaunchError::Invalid(message) => self.invalid(format!("{label}: {message}")),
                        graph::LaunchError::Call(e, doing) => reporter.failed(e, format!("{label}: {doing}")),
                    })?;
                // Its payloads (pinned bytes, read-back targets) and graph stay until
                // the launch completes.
                planned.keep.push(Box::new(instance));
                planned.keep.push(Box::new(buffer));
                Ok(())
            }
        }
    }
}

/// An operation checked and resolved, ready to enqueue.
enum Prepared {
    Nothing,
    Copy { src: Place, dst: Place, len: usize },
    Fill { dst: Place, len: usize, pattern: Vec<u8> },
    Kernel { loaded: Arc<Loaded>, dims: launch::Dims, params: launch::Params, kernel: KernelRef },
    Graph { buffer: CommandBuffer, bound: smallvec::SmallVec<[graph::Entry; 4]> },
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

impl Driver for CudaDriver {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError> {
        if self.lanes.reporter().is_lost() {
            return Err(self.lanes.reporter().lost_error());
        }
        self.memory.alloc(bytes, &self.zeroing)
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
        let mut planned =
            Planned { id: sub.id, label, lane, waits, event: None, preset: None, keep: Vec::new() };
        let failed = planned.waits.iter().find_map(|w| w.failure().map(|e| (w.label.clone(), e)));
        planned.preset = if let Some((dependency, cause)) = failed {
            Some(cause.as_dependency_of(dependency))
        } else if self.lanes.reporter().is_lost() {
            Some(self.lanes.reporter().lost_error())
        } else {
            self.enqueue(&sub.op, &mut planned).err()
        };
        Ok(Accepted::Pending(self.lanes.hand_over(planned, submitted_ns)))
    }

    /// With the feature `jit`: the fusion compiler of LLVM IR kernels, whose fused
    /// kernels run as PTX like any other IR kernel.
    fn fusion_compilers(&self) -> Vec<Arc<dyn gantry_driver::fusion::FusionCompiler>> {
        #[cfg(feature = "jit")]
        return vec![Arc::new(gantry_jit::IrFusion::new())];
        #[cfg(not(feature = "jit"))]
        Vec::new()
    }

    /// Records a CUDA graph: see the crate docs.
    fn create_command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        Ok(self.recorder.start(desc))
    }

    /// Patches the plan and payloads; the next submission updates the instantiated
    /// graph (see the crate docs).
    fn patch_command_buffer(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        patch_buffer(buffer, CudaCommandBuffer::clone, |b| self.recorder.patch(b, patch)).unwrap_or_else(
            || Err(self.invalid("patching a command buffer recorded by another driver".into())),
        )
    }
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("name", &self.info.name)
            .field("device", &self.device_name)
            .field("compute_capability", &self.cc)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::sync::channel::unbounded;

    /// Without CUDA (this crate's CI machine) the driver is a typed error naming
    /// what is missing; with it, device 0 opens and says what it is.
    #[test]
    fn unavailable_cuda_is_a_typed_error_and_available_cuda_opens() {
        let (tx, _rx) = unbounded();
        let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
        match CudaDriver::new(CudaConfig::default(), ctx.clone()) {
            Ok(d) => {
                assert_eq!(d.info().kind, KIND);
                assert!(!d.info().caps.shares_host_memory && d.info().caps.in_driver_waits);
                eprintln!("cuda:0 is {} (compute capability {:?})", d.device_name(), d.compute_capability());
                let past = CudaDriver::new(CudaConfig { ordinal: 4096, ..Default::default() }, ctx);
                assert!(
                    matches!(&past, Err(ExecError::Unsupported { what, .. }) if what.contains("ordinal")),
                    "{past:?}"
                );
            }
            Err(ExecError::Unsupported { device, what }) => {
                assert_eq!(&*device, "cuda:0");
                assert!(what.starts_with("CUDA ("), "{what}");
                eprintln!("no CUDA on this machine: {what}");
                assert!(device_count().is_err() || device_count() == Ok(0));
            }
            Err(e) => panic!("CUDA is present but did not start: {e}"),
        }
    }
}
