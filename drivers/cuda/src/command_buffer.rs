//! Command buffers: a finalized command graph's partition recorded as a CUDA graph.
//!
//! Recording validates each operation into the contract's generic [`Plan`] (through
//! [`PlanBuilder`]) and, at finalize, prepares what the graph's nodes will need:
//! each kernel's module is loaded (a CUDA C image compiled) and its launch shape
//! checked, each memory buffer write's host bytes are copied into pinned memory,
//! and each memory buffer read gets pinned staging memory. Nothing of this happens
//! again at a replay.
//!
//! The CUDA graph itself is built at the first submission ([`crate::graph`]): its
//! nodes hold device addresses, and a command buffer's memory is bound per
//! submission (the argument table), so the addresses are known only then.
//!
//! Patching ([`Driver::patch_command_buffer`](gantry_driver::Driver)) applies the
//! patch to the plan and prepares the changed operations' payloads anew; the next
//! submission brings the instantiated graph up to date (kernel nodes one by one with
//! `cuGraphExecKernelNodeSetParams`, other changes by a whole-graph update). A copy
//! made because a submission still holds the buffer shares the instantiated graph:
//! CUDA applies updates to launches made after them only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gantry_driver::{
    CommandBuffer, CommandBufferBuilder, CommandBufferDesc, ExecError, HostStorage, OpPatch, Plan,
    PlanBuilder, RecordedOp, SyncPoint,
};

use crate::context::Context;
use crate::error::invalid;
use crate::graph::ExecSlot;
use crate::launch::{self, Dims};
use crate::memory::Pinned;
use crate::module::{Hidden, Images, Loaded};

/// What one recorded operation needs besides the plan.
#[derive(Clone)]
pub(crate) enum Payload {
    /// A kernel's loaded image and launch shape.
    Kernel { loaded: Arc<Loaded>, dims: Dims, shared: u32, hidden: Option<Hidden> },
    /// A memory buffer write's bytes, in pinned memory.
    Write(Arc<Pinned>),
    /// A memory buffer read's staging memory and destination.
    Read(Arc<ReadBack>),
    /// A copy, fill or marker: the plan says everything.
    Plain,
}

/// Where a memory buffer read lands: the device copies into `staging`, then a host
/// node copies `staging` into `dst`.
pub(crate) struct ReadBack {
    pub(crate) staging: Pinned,
    pub(crate) dst: Arc<HostStorage>,
}

/// A CUDA command buffer: the plan, each operation's payload, and the instantiated
/// graph (shared with copies made for patching).
#[derive(Clone)]
pub(crate) struct CudaCommandBuffer {
    pub(crate) plan: Plan,
    pub(crate) payloads: Vec<Payload>,
    /// Identifies the plan's payloads: a patch gives a new one, so a submission
    /// knows whether the instantiated graph reflects them.
    pub(crate) content: u64,
    pub(crate) exec: Arc<Mutex<ExecSlot>>,
}

fn next_content() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What recording and patching need of the driver.
#[derive(Clone)]
pub(crate) struct Recorder {
    pub(crate) ctx: Arc<Context>,
    pub(crate) images: Arc<Images>,
    pub(crate) device: Arc<str>,
}

impl Recorder {
    /// Starts recording a command buffer.
    pub(crate) fn start(&self, desc: CommandBufferDesc) -> Box<dyn CommandBufferBuilder> {
        // Host tasks are not recorded: a graph gives each one a partition of its own.
        let accepts = |op: &RecordedOp| !matches!(op, RecordedOp::HostTask { .. });
        let plan = PlanBuilder::new(desc, self.device.clone(), accepts, |plan| Arc::new(plan));
        Box::new(Recording { plan, recorder: self.clone() })
    }

    /// The payload of `op` (see the module docs), or why it cannot be recorded.
    fn payload(&self, op: &RecordedOp) -> Result<Payload, ExecError> {
        let device = &self.device;
        match op {
            RecordedOp::Kernel { kernel, geometry, .. } => {
                let dims = launch::dims(geometry)
                    .map_err(|e| invalid(device, format!("kernel `{}`: {e}", kernel.name)))?;
                let loaded = self.images.load(kernel)?;
                let shared = loaded.shared_bytes(&kernel.signature);
                loaded.allow_shared(shared).map_err(|e| {
                    e.into_exec(
                        device,
                        format!("allowing kernel `{}` {shared} bytes of shared memory", kernel.name),
                    )
                })?;
                let hidden = loaded.hidden(geometry);
                Ok(Payload::Kernel {
                    loaded,
                    dims,
                    shared: u32::try_from(shared).unwrap_or(u32::MAX),
                    hidden,
                })
            }
            RecordedOp::Write { src, dst } => {
                if src.len() != dst.len {
                    return Err(invalid(
                        device,
                        format!("memory buffer write of {} host bytes into {} bytes", src.len(), dst.len),
                    ));
                }
                let pinned = Pinned::new(&self.ctx, src.len())
                    .map_err(|e| e.into_exec(device, "pinning a memory buffer write's bytes"))?;
                // SAFETY: both hold `src.len()` bytes; the pinned memory is new, so
                // nothing else reads or writes it.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), pinned.as_ptr(), src.len()) };
                Ok(Payload::Write(Arc::new(pinned)))
            }
            RecordedOp::Read { src, dst } => {
                if src.len != dst.len() {
                    return Err(invalid(
                        device,
                        format!("memory buffer read of {} bytes into {} host bytes", src.len, dst.len()),
                    ));
                }
                let staging = Pinned::new(&self.ctx, src.len)
                    .map_err(|e| e.into_exec(device, "pinning a memory buffer read's staging memory"))?;
                Ok(Payload::Read(Arc::new(ReadBack { staging, dst: dst.clone() })))
            }
            RecordedOp::Copy { .. } | RecordedOp::Fill { .. } | RecordedOp::Marker => Ok(Payload::Plain),
            RecordedOp::HostTask { .. } => Err(invalid(device, "a host task in a command buffer".into())),
        }
    }

    /// Patches `buffer` (see the module docs): every check and every payload is
    /// prepared before anything changes, so a refused patch changes nothing.
    pub(crate) fn patch(
        &self,
        buffer: &mut CudaCommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        self.ctx.bind().map_err(|e| e.into_exec(&self.device, "patching a command buffer"))?;
        let mut plan = buffer.plan.clone();
        plan.apply_patches(patch).map_err(|e| invalid(&self.device, e))?;
        let mut payloads = buffer.payloads.clone();
        for (i, change) in patch.iter().enumerate() {
            if !matches!(change, OpPatch::Keep) {
                payloads[i] = self.payload(&plan.ops[i].op)?;
            }
        }
        buffer.plan = plan;
        buffer.payloads = payloads;
        buffer.content = next_content();
        Ok(())
    }
}

/// A command buffer being recorded.
struct Recording {
    plan: PlanBuilder,
    recorder: Recorder,
}

impl CommandBufferBuilder for Recording {
    fn append(&mut self, op: RecordedOp, deps: &[SyncPoint]) -> Result<SyncPoint, ExecError> {
        self.plan.append(op, deps)
    }

    fn finalize(self: Box<Self>) -> Result<CommandBuffer, ExecError> {
        let Recording { plan, recorder } = *self;
        let device = recorder.device.clone();
        let plan = Box::new(plan).finalize()?;
        let plan = plan
            .downcast::<Plan>()
            .ok()
            .and_then(|p| Arc::try_unwrap(p).ok())
            .ok_or_else(|| invalid(&device, "the recorded plan is shared".into()))?;
        recorder.ctx.bind().map_err(|e| e.into_exec(&device, "finalizing a command buffer"))?;
        let payloads = plan.ops.iter().map(|o| recorder.payload(&o.op)).collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(CudaCommandBuffer {
            plan,
            payloads,
            content: next_content(),
            exec: Arc::new(Mutex::new(ExecSlot::default())),
        }))
    }
}
