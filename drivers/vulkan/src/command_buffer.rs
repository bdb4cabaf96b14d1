//! Command buffers: a partition of a finalized command graph recorded into a Vulkan
//! command buffer and replayed as one `vkQueueSubmit`.
//!
//! Finalize validates the plan (`gantry_driver::PlanBuilder`), loads every kernel
//! image and makes its pipeline, places the pipeline barriers (module `barriers`:
//! exactly where a dependency edge between two operations' buffer ranges needs
//! one) and plans the descriptor sets (module `descriptors`: one per distinct
//! layout and slot tuple). The Vulkan command buffer itself is recorded at the
//! first submission with an argument table bound to memory, because copies and
//! fills name their buffers in the commands: an *instance* per binding (up to
//! [`INSTANCES`] kept, each in a pool of its own so it can be freed from any
//! thread), recorded with `SIMULTANEOUS_USE` so replays may overlap. Recording
//! allocates the instance's descriptor sets in bulk and writes them with one call,
//! then records each dispatch as a pipeline bind where the pipeline changes, a set
//! bind where the set changes, push constants where they change, and the dispatch.
//!
//! A replay over a binding seen before is one submit with nothing recorded. Another
//! binding records a new instance while fewer than [`INSTANCES`] are kept; at that
//! count, a plan of kernels only (whose commands name no buffer: copies and fills
//! do) *rebinds* the least recently made idle instance instead: its descriptor sets
//! are rewritten for the new binding and its commands kept
//! ([`VulkanCommandBuffer::rebinds`]). An instance in flight is never rewritten
//! (that would need update-after-bind descriptor sets); if every one is, another is
//! recorded. An instance with memory buffer reads is not replayed while a replay of
//! it is in flight (its staging memory is its own), so overlapping replays of such
//! a buffer record another instance. Patching
//! ([`Driver::patch_command_buffer`](gantry_driver::Driver::patch_command_buffer))
//! changes the plan and drops the instances: a patch changes kernels, geometries,
//! scalars (push constants, recorded in the commands), fill patterns or host memory,
//! never which entries a dispatch binds, so there is nothing to rebind.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ash::vk;
use gantry_driver::{
    CommandBuffer, CommandBufferBuilder, CommandBufferDesc, ExecError, HostStorage, OpPatch, Plan,
    PlanBuilder, RecordedArg, RecordedOp, SyncPoint,
};

use crate::barriers::{plan_barriers, Barrier};
use crate::descriptors::{SetPlan, Sets, NO_SET};
use crate::device::Device;
use crate::error::{invalid, CallError, Check};
use crate::execution::{lock, Finish};
use crate::memory::{Buffer, MakeError, Place};
use crate::pipeline::{Bind, Images, Ready};
use crate::transfer::{self, TransferError};

/// Instances (recordings for one argument binding) a command buffer keeps.
pub const INSTANCES: usize = 4;

/// Starts recordings for a driver.
pub(crate) struct Recorder {
    pub images: Arc<Images>,
    pub dev: Arc<Device>,
}

/// The plan a `PlanBuilder` finalizes, before the driver makes it its own.
struct PlanOnly(Plan);

impl Recorder {
    pub(crate) fn start(&self, desc: CommandBufferDesc) -> Box<dyn CommandBufferBuilder> {
        // Host tasks are not recorded: a graph gives each one a partition of its own.
        let accepts = |op: &RecordedOp| !matches!(op, RecordedOp::HostTask { .. });
        let inner = PlanBuilder::new(desc, self.dev.name.clone(), accepts, |p| Arc::new(PlanOnly(p)));
        Box::new(Builder { inner: Box::new(inner), images: self.images.clone(), dev: self.dev.clone() })
    }

    /// Patches `buffer`'s plan; its instances are dropped (the next replay records).
    pub(crate) fn patch(
        &self,
        buffer: &mut VulkanCommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        let mut plan = buffer.plan.clone();
        plan.apply_patches(patch)
            .map_err(|e| invalid(&self.dev.name, format!("patching a command buffer: {e}")))?;
        let kernels = ready_all(&self.images, &plan)?;
        buffer.sets = SetPlan::new(&plan, &kernels);
        buffer.rebindable = rebindable(&self.dev, &plan);
        buffer.plan = plan;
        buffer.kernels = kernels;
        lock(&buffer.instances).clear();
        Ok(())
    }
}

struct Builder {
    inner: Box<dyn CommandBufferBuilder>,
    images: Arc<Images>,
    dev: Arc<Device>,
}

impl CommandBufferBuilder for Builder {
    fn append(&mut self, op: RecordedOp, deps: &[SyncPoint]) -> Result<SyncPoint, ExecError> {
        self.inner.append(op, deps)
    }

    fn finalize(self: Box<Self>) -> Result<CommandBuffer, ExecError> {
        let made = self.inner.finalize()?;
        let plan = match made.downcast::<PlanOnly>().map(Arc::try_unwrap) {
            Ok(Ok(PlanOnly(plan))) => plan,
            _ => return Err(invalid(&self.dev.name, "the plan builder made something else".into())),
        };
        let kernels = ready_all(&self.images, &plan)?;
        let barriers = plan_barriers(&plan);
        let sets = SetPlan::new(&plan, &kernels);
        Ok(Arc::new(VulkanCommandBuffer {
            rebindable: rebindable(&self.dev, &plan),
            plan,
            barriers,
            kernels,
            sets,
            instances: Mutex::new(Vec::new()),
            counts: Counts::default(),
            dev: self.dev.clone(),
        }))
    }
}

/// Each kernel of `plan` loaded and made ready (`None` for other operations); a
/// kernel and geometry like the previous kernel's reuse its answer.
fn ready_all(images: &Images, plan: &Plan) -> Result<Vec<Option<Ready>>, ExecError> {
    let mut last: Option<(&gantry_driver::KernelRef, &gantry_driver::Geometry, Ready)> = None;
    let mut out = Vec::with_capacity(plan.ops.len());
    for p in &plan.ops {
        let RecordedOp::Kernel { kernel, geometry, .. } = &p.op else {
            out.push(None);
            continue;
        };
        let ready = match &last {
            Some((k, g, r)) if Arc::ptr_eq(k, kernel) && *g == geometry => r.clone(),
            _ => images.ready(kernel, geometry, Bind::Sets)?,
        };
        last = Some((kernel, geometry, ready.clone()));
        out.push(Some(ready));
    }
    Ok(out)
}

/// Whether a recording of `plan` can be pointed at another binding by rewriting its
/// descriptor sets: the device lets sets be updated after they were bound
/// ([`Device::update_after_bind`]), and its commands name no buffer (only kernels and
/// markers).
fn rebindable(dev: &Device, plan: &Plan) -> bool {
    dev.update_after_bind
        && plan.ops.iter().all(|p| matches!(p.op, RecordedOp::Kernel { .. } | RecordedOp::Marker))
}

/// How often a command buffer was recorded and rebound.
#[derive(Default)]
struct Counts {
    recordings: AtomicUsize,
    rebinds: AtomicUsize,
}

/// A bound argument-table entry: the buffer, the offset of the entry's memory in
/// it, and its length.
pub(crate) type Bound = (Arc<Buffer>, usize, usize);

/// What an instance was recorded for: each entry's buffer, offset and length.
type Key = Vec<(vk::Buffer, usize, usize)>;

/// A recorded command buffer (see the module docs).
pub struct VulkanCommandBuffer {
    plan: Plan,
    barriers: Vec<Barrier>,
    kernels: Vec<Option<Ready>>,
    sets: SetPlan,
    rebindable: bool,
    instances: Mutex<Vec<(Key, Arc<Instance>)>>,
    counts: Counts,
    dev: Arc<Device>,
}

impl Clone for VulkanCommandBuffer {
    /// The same plan with no instances (a patched copy records its own).
    fn clone(&self) -> Self {
        Self {
            plan: self.plan.clone(),
            barriers: self.barriers.clone(),
            kernels: self.kernels.clone(),
            sets: self.sets.clone(),
            rebindable: self.rebindable,
            instances: Mutex::new(Vec::new()),
            counts: Counts::default(),
            dev: self.dev.clone(),
        }
    }
}

impl VulkanCommandBuffer {
    /// The pipeline barriers recorded before its operations, in order.
    pub fn barriers(&self) -> &[Barrier] {
        &self.barriers
    }

    /// How many instances (recordings for one binding) it holds.
    pub fn instances(&self) -> usize {
        lock(&self.instances).len()
    }

    /// How many times its commands were recorded (an instance made).
    pub fn recordings(&self) -> usize {
        self.counts.recordings.load(Ordering::Relaxed)
    }

    /// How many times an instance was pointed at another binding by rewriting its
    /// descriptor sets, without recording (see the module docs).
    pub fn rebinds(&self) -> usize {
        self.counts.rebinds.load(Ordering::Relaxed)
    }

    /// Whether a new binding past [`INSTANCES`] rewrites an idle recording's
    /// descriptor sets instead of recording again: the device supports updating
    /// storage-buffer descriptors after bind, and the plan's commands name no buffer.
    pub fn rebindable(&self) -> bool {
        self.rebindable
    }

    /// How many distinct descriptor sets a recording of it holds.
    pub fn descriptor_sets(&self) -> usize {
        self.sets.len()
    }

    /// The instance for `bound`, recorded if there is none; the error says what is
    /// wrong with the binding.
    pub(crate) fn instance(&self, bound: &[Bound]) -> Result<Arc<Instance>, ExecError> {
        let name = &self.dev.name;
        if bound.len() != self.plan.entries {
            return Err(invalid(
                name,
                format!(
                    "a command buffer of {} entries bound to {} arguments",
                    self.plan.entries,
                    bound.len()
                ),
            ));
        }
        let key: Key = bound.iter().map(|(b, o, l)| (b.raw, *o, *l)).collect();
        let mut instances = lock(&self.instances);
        // An instance with memory buffer reads copies them out of its own staging
        // memory after each replay: one in flight (held by its operation) is not
        // replayed again before that, so such a replay records another instance.
        let reusable = |i: &Arc<Instance>| i.reads.is_empty() || Arc::strong_count(i) == 1;
        if let Some((_, i)) = instances.iter().find(|(k, i)| *k == key && reusable(i)) {
            return Ok(i.clone());
        }
        self.check(bound)?;
        if self.rebindable && instances.len() >= INSTANCES {
            // The oldest idle instance: only the list holds it (every other holder
            // clones it under this lock), so nothing pending uses its sets.
            if let Some(at) = instances.iter().position(|(_, i)| Arc::strong_count(i) == 1) {
                let (_, mut instance) = instances.remove(at);
                let idle = Arc::get_mut(&mut instance).expect("only the list holds an idle instance");
                idle.sets.write(&self.sets, bound);
                idle.bound = bound.iter().map(|(b, _, _)| b.clone()).collect();
                self.counts.rebinds.fetch_add(1, Ordering::Relaxed);
                instances.push((key, instance.clone()));
                return Ok(instance);
            }
        }
        let instance = Arc::new(self.record(bound)?);
        self.counts.recordings.fetch_add(1, Ordering::Relaxed);
        // The oldest not in flight make room (in flight ones are held by their
        // operations, and go at a later recording).
        while instances.len() >= INSTANCES {
            match instances.iter().position(|(_, i)| Arc::strong_count(i) == 1) {
                Some(at) => drop(instances.remove(at)),
                None => break,
            }
        }
        instances.push((key, instance.clone()));
        Ok(instance)
    }

    /// Checks every recorded range against the bound entries, and kernel ranges
    /// against the device's storage-buffer alignment.
    fn check(&self, bound: &[Bound]) -> Result<(), ExecError> {
        let limits = &self.dev.limits;
        for (i, planned) in self.plan.ops.iter().enumerate() {
            for a in planned.op.args() {
                let (_, base, len) = &bound[a.entry as usize];
                if a.offset.checked_add(a.len).is_none_or(|end| end > *len) {
                    return Err(invalid(
                        &self.dev.name,
                        format!(
                            "operation {i} ({}): recorded range {}..+{} outside argument entry {} of {len} bytes",
                            planned.op.label(),
                            a.offset,
                            a.len,
                            a.entry
                        ),
                    ));
                }
                let at = (base + a.offset) as u64;
                if matches!(planned.op, RecordedOp::Kernel { .. }) && !at.is_multiple_of(limits.storage_align)
                {
                    return Err(invalid(
                        &self.dev.name,
                        format!(
                            "operation {i} (kernel): its range starts at byte {at} of its buffer, not a multiple of \
                             the device's minStorageBufferOffsetAlignment ({})",
                            limits.storage_align
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn record(&self, bound: &[Bound]) -> Result<Instance, ExecError> {
        let name = &self.dev.name;
        let fail = |e: CallError| e.into_exec(name, "recording a command buffer");
        let mut instance = Instance::new(&self.dev, &self.sets).map_err(fail)?;
        instance.sets.write(&self.sets, bound);
        let cmd = instance.cmd;
        let dev = &self.dev;
        let place = |a: &RecordedArg| {
            let (b, base, _) = &bound[a.entry as usize];
            Place::Device(b.clone(), base + a.offset)
        };
        let transfer_error = |e: TransferError| match e {
            TransferError::OutOfMemory(n) => ExecError::OutOfMemory { device: name.clone(), requested: n },
            TransferError::Call(e) => fail(e),
        };
        let mut barriers = self.barriers.iter().peekable();
        // What the command buffer has bound: pipeline, descriptor set (with the
        // layout it was bound through), push constants (likewise).
        let mut pipeline = vk::Pipeline::null();
        let mut set = (vk::PipelineLayout::null(), NO_SET);
        let mut pushed: (vk::PipelineLayout, smallvec::SmallVec<[u8; 64]>) =
            (vk::PipelineLayout::null(), smallvec::SmallVec::new());
        // The images its dispatches use, each kept once.
        let mut images: Vec<&Arc<crate::pipeline::Pipelines>> = Vec::new();
        for ready in self.kernels.iter().flatten() {
            if !images.last().is_some_and(|p| Arc::ptr_eq(p, &ready.pipelines)) {
                images.push(&ready.pipelines);
            }
        }
        images.sort_by_key(|p| Arc::as_ptr(p));
        images.dedup_by_key(|p| Arc::as_ptr(p));
        instance.keep.extend(images.into_iter().map(|p| Box::new(p.clone()) as Box<dyn Any + Send + Sync>));
        let recorded: Result<(), ExecError> = (|| {
            for (i, planned) in self.plan.ops.iter().enumerate() {
                while let Some(b) = barriers.next_if(|b| b.before as usize == i) {
                    let memory = [vk::MemoryBarrier::default()
                        .src_access_mask(b.src_access)
                        .dst_access_mask(b.dst_access)];
                    // SAFETY: a recording command buffer.
                    unsafe {
                        dev.raw.cmd_pipeline_barrier(
                            cmd,
                            b.src_stage,
                            b.dst_stage,
                            vk::DependencyFlags::empty(),
                            &memory,
                            &[],
                            &[],
                        )
                    };
                }
                match &planned.op {
                    RecordedOp::Kernel { scalars, .. } => {
                        let ready = self.kernels[i].as_ref().expect("made ready at finalize");
                        let layout = ready.layout;
                        let groups = ready.shape.groups;
                        let want = self.sets.op_set[i];
                        let push_bytes = ready.pipelines.push_bytes as usize;
                        let push_changed = push_bytes > 0
                            && (pushed.0 != layout
                                || pushed.1.len() != push_bytes
                                || pushed.1[..scalars.len()] != scalars[..]);
                        if push_changed {
                            pushed.0 = layout;
                            pushed.1.clear();
                            pushed.1.extend_from_slice(scalars);
                            pushed.1.resize(push_bytes, 0);
                        }
                        // SAFETY: a recording command buffer; the pipeline and layout
                        // are the image's (the instance keeps the image); the set is
                        // the instance's, written over checked, aligned ranges; the
                        // push constants fill the layout's range.
                        unsafe {
                            if pipeline != ready.pipeline {
                                dev.raw.cmd_bind_pipeline(
                                    cmd,
                                    vk::PipelineBindPoint::COMPUTE,
                                    ready.pipeline,
                                );
                                pipeline = ready.pipeline;
                            }
                            if want != NO_SET && set != (layout, want) {
                                dev.raw.cmd_bind_descriptor_sets(
                                    cmd,
                                    vk::PipelineBindPoint::COMPUTE,
                                    layout,
                                    0,
                                    &instance.sets.sets[want as usize..=want as usize],
                                    &[],
                                );
                                set = (layout, want);
                            }
                            if push_changed {
                                dev.raw.cmd_push_constants(
                                    cmd,
                                    layout,
                                    vk::ShaderStageFlags::COMPUTE,
                                    0,
                                    &pushed.1,
                                );
                            }
                            dev.raw.cmd_dispatch(cmd, groups[0], groups[1], groups[2]);
                        }
                    }
                    RecordedOp::Copy { src, dst } => {
                        let r = transfer::copy(dev, cmd, place(src), place(dst), src.len)
                            .map_err(transfer_error)?;
                        instance.keep.extend(r.keep);
                    }
                    RecordedOp::Fill { dst, pattern } => {
                        let r =
                            transfer::fill(dev, cmd, place(dst), dst.len, pattern).map_err(transfer_error)?;
                        instance.keep.extend(r.keep);
                    }
                    RecordedOp::Write { src, dst } => {
                        let stage = staging(dev, dst.len).map_err(transfer_error)?;
                        // SAFETY: the captured host bytes hold `dst.len` (checked when
                        // appended); the staging buffer is fresh and as long.
                        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), stage.mapped(), dst.len) };
                        let (b, base, _) = &bound[dst.entry as usize];
                        let region = [vk::BufferCopy {
                            src_offset: 0,
                            dst_offset: (base + dst.offset) as u64,
                            size: dst.len as u64,
                        }];
                        if dst.len > 0 {
                            // SAFETY: both ranges checked; recording.
                            unsafe { dev.raw.cmd_copy_buffer(cmd, stage.raw, b.raw, &region) };
                        }
                        instance.keep.push(Box::new(stage));
                    }
                    RecordedOp::Read { src, dst } => {
                        let stage = Arc::new(staging(dev, src.len).map_err(transfer_error)?);
                        let (b, base, _) = &bound[src.entry as usize];
                        let region = [vk::BufferCopy {
                            src_offset: (base + src.offset) as u64,
                            dst_offset: 0,
                            size: src.len as u64,
                        }];
                        if src.len > 0 {
                            // SAFETY: both ranges checked; recording.
                            unsafe { dev.raw.cmd_copy_buffer(cmd, b.raw, stage.raw, &region) };
                        }
                        instance.reads.push((stage, dst.clone(), src.len.min(dst.len())));
                    }
                    // Refused when recorded.
                    RecordedOp::Marker | RecordedOp::HostTask { .. } => {}
                }
            }
            if !instance.reads.is_empty() {
                transfer::after_transfer(dev, cmd, vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ);
            }
            Ok(())
        })();
        // SAFETY: recording (ended also after a failure; the instance is dropped then).
        let ended = unsafe { dev.raw.end_command_buffer(cmd) }.call("vkEndCommandBuffer");
        recorded?;
        ended.map_err(fail)?;
        instance.bound = bound.iter().map(|(b, _, _)| b.clone()).collect();
        Ok(instance)
    }
}

fn staging(dev: &Arc<Device>, len: usize) -> Result<Buffer, TransferError> {
    Buffer::new(dev, len, true).map_err(|e| match e {
        MakeError::OutOfMemory => TransferError::OutOfMemory(len),
        MakeError::Call(e) => TransferError::Call(e),
    })
}

/// One recording of a command buffer for one argument binding: its own pool (so the
/// last holder, a completion thread included, frees it), the command buffer, and
/// what its commands use.
pub(crate) struct Instance {
    pool: vk::CommandPool,
    pub cmd: vk::CommandBuffer,
    /// Its descriptor sets (see module `descriptors`).
    sets: Sets,
    /// The buffers of the binding it was recorded or last rebound for.
    bound: Vec<Arc<Buffer>>,
    keep: Vec<Box<dyn Any + Send + Sync>>,
    /// Memory buffer reads: staging memory, the host memory it is copied to after
    /// each replay, and the length.
    reads: Vec<(Arc<Buffer>, Arc<HostStorage>, usize)>,
    dev: Arc<Device>,
}

impl Instance {
    fn new(dev: &Arc<Device>, sets: &SetPlan) -> Result<Self, CallError> {
        let sets = Sets::new(dev, sets)?;
        let info = vk::CommandPoolCreateInfo::default().queue_family_index(dev.families.compute);
        // SAFETY: a live device and one of its families.
        let pool = unsafe { dev.raw.create_command_pool(&info, None) }.call("vkCreateCommandPool")?;
        let mut this = Self {
            pool,
            cmd: vk::CommandBuffer::null(),
            sets,
            bound: Vec::new(),
            keep: Vec::new(),
            reads: Vec::new(),
            dev: dev.clone(),
        };
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: the instance's own pool.
        this.cmd = unsafe { dev.raw.allocate_command_buffers(&alloc) }.call("vkAllocateCommandBuffers")?[0];
        let begin =
            vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::SIMULTANEOUS_USE);
        // SAFETY: a fresh command buffer of the instance's own pool.
        unsafe { dev.raw.begin_command_buffer(this.cmd, &begin) }.call("vkBeginCommandBuffer")?;
        Ok(this)
    }

    /// The host-side finish of a replay: its memory buffer reads copied out.
    pub(crate) fn finish(self: &Arc<Self>) -> Option<Finish> {
        if self.reads.is_empty() {
            return None;
        }
        let me = self.clone();
        Some(Box::new(move || {
            for (stage, host, len) in &me.reads {
                // SAFETY: the replay wrote the staging bytes and made them visible to
                // the host; the host memory holds `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(stage.mapped(), host.as_ptr(), *len) };
            }
        }))
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: no replay is in flight (each holds the instance until it
        // completes); destroying the pool frees its command buffer.
        unsafe { self.dev.raw.destroy_command_pool(self.pool, None) };
    }
}
