//! Device operations: what the scheduler hands a driver, and what comes back.

use std::any::Any;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::command_buffer::CommandBufferLaunch;
use crate::error::ExecError;
use crate::hint::SimHint;
use crate::kernel::{KernelRef, ScalarBlock};
use crate::memory::{AccessMode, Binding, MemSlice};
use crate::range::Geometry;

/// Identifies one submitted operation in completions (the scheduler's command id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpId(pub u64);

/// A driver's token for a submitted operation. Later submissions to the same driver
/// name it in their wait-lists; it keeps whatever the driver needs to answer "is it
/// done, and did it fail" alive for as long as the scheduler holds it.
pub type OpHandle = Arc<dyn Any + Send + Sync>;

/// A buffer range a kernel or host task uses, resolved to memory of the target device.
#[derive(Clone, Debug)]
pub struct MemArg {
    /// The memory.
    pub mem: MemSlice,
    /// How it is used.
    pub mode: AccessMode,
}

/// A kernel launch.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    /// The kernel.
    pub kernel: KernelRef,
    /// Its iteration space.
    pub geometry: Geometry,
    /// One argument per global accessor slot.
    pub args: SmallVec<[MemArg; 4]>,
    /// Its scalar arguments, laid out by its signature.
    pub scalars: ScalarBlock,
}

/// The context a host task receives: the resolved host memory of its accessors.
pub struct HostCtx<'a> {
    bindings: &'a [Binding],
    tag: u64,
}

impl<'a> HostCtx<'a> {
    /// Built by drivers when they run a host task.
    pub fn new(bindings: &'a [Binding], tag: u64) -> Self {
        Self { bindings, tag }
    }

    /// The memory of host accessor slot `slot`, checking that the accessor (of the
    /// command group tagged `tag`) belongs to this task's command group: what host
    /// accessors read and write through.
    ///
    /// # Panics
    /// If the tags differ (which fails the task), or there is no such slot.
    #[inline]
    pub fn binding(&self, slot: u32, tag: u64) -> Binding {
        assert!(tag == self.tag, "host accessor used in a host task of a different command group");
        self.bindings[slot as usize]
    }
}

/// A host task's closure. `FnMut`, not `FnOnce`: a command graph runs its host tasks
/// once per submission.
pub type HostFn = Box<dyn FnMut(&HostCtx<'_>) + Send>;

/// A host task's closure as a command graph keeps it: shared by the graph's node,
/// its partitions and every replay, each of which runs it under the lock.
pub type SharedHostFn = std::sync::Arc<crate::sync::Mutex<HostFn>>;

/// A host task: a closure run once on a host thread with host access to its arguments.
pub struct HostTask {
    /// Name used in errors and traces.
    pub name: Arc<str>,
    /// Tag of the command group whose host accessors the closure uses.
    pub tag: u64,
    /// The task.
    pub run: HostFn,
    /// One argument per host accessor slot, all in host memory.
    pub args: SmallVec<[MemArg; 4]>,
}

impl std::fmt::Debug for HostTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTask").field("name", &self.name).field("args", &self.args).finish()
    }
}

/// One unit of device work.
#[derive(Debug)]
pub enum DeviceOp {
    /// Run a kernel.
    Kernel(KernelLaunch),
    /// Copy `src` to `dst` (equal lengths; host or this device's memory on either side).
    Copy {
        /// Source bytes.
        src: MemSlice,
        /// Destination bytes.
        dst: MemSlice,
    },
    /// Fill `dst` with repetitions of `pattern` (`dst.len` is a multiple of its length).
    Fill {
        /// Destination bytes.
        dst: MemSlice,
        /// One element's bytes.
        pattern: SmallVec<[u8; 16]>,
    },
    /// Run a host task (drivers with [`Capabilities::host_tasks`](crate::Capabilities)).
    HostTask(HostTask),
    /// Nothing: completes when its wait-list has (barriers, empty command groups).
    Marker,
    /// Replay a command buffer (a partition of a command graph) with its argument
    /// table bound to memory.
    CommandBuffer(CommandBufferLaunch),
}

/// An operation handed to [`Driver::submit`](crate::Driver::submit).
pub struct Submission<'a> {
    /// Reported back in the completion.
    pub id: OpId,
    /// The work.
    pub op: DeviceOp,
    /// Operations previously submitted to the same driver that must finish first. If
    /// one of them failed, this operation must not run and completes with
    /// [`ExecError::DependencyFailed`].
    pub waits: &'a [OpHandle],
    /// Restore the previous contents of written ranges if the operation fails, so that
    /// buffers keep their last valid contents. Only what the operation itself may
    /// write: a fused kernel's argument is the hull of its kernels' slots, and other
    /// commands may write between the slots meanwhile.
    pub preserve_on_failure: bool,
    /// Timing for devices on a virtual clock
    /// ([`Capabilities::virtual_time`](crate::Capabilities)); `None` for real-time
    /// devices, which have nothing to read in it.
    pub hint: Option<SimHint>,
}

/// What a driver did with an accepted submission.
pub enum Accepted {
    /// Queued or running: its [`Completion`] arrives on the channel later, and later
    /// submissions name it in wait-lists by this handle.
    Pending(OpHandle),
    /// Already finished (it ran inline during `submit`); no completion is sent.
    Done(Completion),
}

impl Accepted {
    /// The handle of a pending operation.
    pub fn handle(self) -> Option<OpHandle> {
        match self {
            Accepted::Pending(h) => Some(h),
            Accepted::Done(_) => None,
        }
    }
}

impl std::fmt::Debug for Accepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Accepted::Pending(_) => f.write_str("Pending"),
            Accepted::Done(c) => f.debug_tuple("Done").field(c).finish(),
        }
    }
}

/// The outcome of an operation, sent to the runtime's completion channel.
#[derive(Clone, Debug)]
pub struct Completion {
    /// Which operation.
    pub op: OpId,
    /// Success, or why it failed.
    pub result: Result<(), ExecError>,
    /// When it started, in nanoseconds on the driver's clock.
    pub started_ns: u64,
    /// When it ended, in nanoseconds on the driver's clock.
    pub ended_ns: u64,
    /// Which of the driver's threads or engines ran it (0: the submitting thread),
    /// for timelines.
    pub lane: u32,
}

/// Whether a fill of `len` bytes is a whole, non-zero number of `pattern`s: the one
/// rule recorders and drivers check fills against. An empty pattern never fits, even
/// for an empty range (the sim driver once let that case through; the CPU driver
/// never did).
pub fn fill_fits(len: usize, pattern: &[u8]) -> bool {
    !pattern.is_empty() && len.is_multiple_of(pattern.len())
}

/// Fills `dst` with repetitions of `pattern`.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes, `len` a multiple of the pattern.
pub unsafe fn fill_bytes(dst: *mut u8, len: usize, pattern: &[u8]) {
    if pattern.is_empty() {
        return;
    }
    // SAFETY: caller guarantees validity for len bytes.
    let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
    if pattern.iter().all(|&b| b == pattern[0]) {
        out.fill(pattern[0]);
    } else {
        for chunk in out.chunks_exact_mut(pattern.len()) {
            chunk.copy_from_slice(pattern);
        }
    }
}
