//! Command entities: what a command is, what memory it needs, how it is connected to
//! other commands, and where it is in its execution.

use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::entity::Entity;
use gantry_driver::fusion::Promotion;
use gantry_driver::{AccessMode, AllocId, Geometry, HostStorage, KernelRef, MemSpace, OpHandle, ScalarBlock};
use smallvec::SmallVec;

use crate::event::EventShared;
use crate::handle::{BufferCore, QueueCore};
use crate::memory::ByteRange;
use crate::resources::DeviceId;

/// What kind of command an entity is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommandKind {
    /// A kernel launch.
    Kernel,
    /// A host task.
    HostTask,
    /// A buffer-to-buffer copy.
    Copy,
    /// A host-to-buffer copy.
    CopyFromHost,
    /// A buffer-to-host copy.
    CopyToHost,
    /// A fill.
    Fill,
    /// A memory move between memory spaces, inserted by dependency resolution.
    MemoryMove,
    /// An empty command group: completes when its dependencies have.
    Marker,
    /// A queue barrier: depends on everything submitted to its queue before it.
    Barrier,
    /// A host access guard: runs while the user holds the data.
    HostAccess,
    /// A cancelled fusion list's command (the DPC++ kernel-fusion design): completes
    /// after the kernels of its list, which ran unfused. (A fused list's command is its
    /// fused kernel.)
    Fusion,
    /// One partition of a command-graph submission: a recorded command buffer.
    CommandBuffer,
}

impl CommandKind {
    /// A short, stable name (`kernel`, `memory_move`, …) for traces and reports.
    pub fn name(self) -> &'static str {
        match self {
            CommandKind::Kernel => "kernel",
            CommandKind::HostTask => "host_task",
            CommandKind::Copy => "copy",
            CommandKind::CopyFromHost => "copy_from_host",
            CommandKind::CopyToHost => "copy_to_host",
            CommandKind::Fill => "fill",
            CommandKind::MemoryMove => "memory_move",
            CommandKind::Marker => "empty",
            CommandKind::Barrier => "barrier",
            CommandKind::HostAccess => "host_access",
            CommandKind::Fusion => "fusion",
            CommandKind::CommandBuffer => "command_buffer",
        }
    }

    /// Whether a driver executes it. Markers and barriers go to their device's driver
    /// (as GPU runtimes record stream events) so they complete on its clock; host
    /// accesses are run by the scheduler and the user.
    pub fn runs_on_driver(self) -> bool {
        !matches!(self, CommandKind::HostAccess)
    }
}

pub use gantry_driver::HostFn;

/// Makes a `Send` value `Sync` by allowing access only through `&mut` or by value, so
/// components can own closures that are not `Sync` (host tasks).
pub struct SyncCell<T>(T);

// SAFETY: a shared reference gives no access to the inner value.
unsafe impl<T: Send> Sync for SyncCell<T> {}

impl<T> SyncCell<T> {
    /// Wraps a value.
    pub fn new(v: T) -> Self {
        Self(v)
    }
    /// Unwraps it.
    pub fn into_inner(self) -> T {
        self.0
    }
}

/// The work a command carries until it is enqueued. Memory arguments are its
/// [`Requirements`], in order.
pub enum Work {
    /// Launch a kernel; one requirement per global accessor slot.
    Kernel {
        /// The kernel.
        kernel: KernelRef,
        /// Its iteration space.
        geometry: Geometry,
        /// Its scalar arguments.
        scalars: ScalarBlock,
    },
    /// Run a host task; one requirement per host accessor slot.
    HostTask {
        /// The closure.
        run: SyncCell<HostFn>,
        /// Its command group's tag.
        tag: u64,
        /// Its declared duration on a simulated host pool, in nanoseconds.
        cost_ns: Option<f64>,
    },
    /// Copy requirement 0 into requirement 1.
    Copy,
    /// Copy these bytes into requirement 0.
    CopyFromHost(Arc<HostStorage>),
    /// Copy requirement 0 into this host storage.
    CopyToHost(Arc<HostStorage>),
    /// Fill requirement 0 with this element pattern.
    Fill(SmallVec<[u8; 16]>),
    /// Copy the whole buffer of requirement 0 from one memory space to another.
    Move {
        /// Where the valid copy is.
        from: MemSpace,
        /// Where it is needed.
        to: MemSpace,
    },
    /// Replay a command buffer. Argument-table entry `i` is the whole buffer of
    /// requirement `entries[i].0`, used in mode `entries[i].1`.
    CommandBuffer {
        /// The recorded command buffer.
        buffer: gantry_driver::CommandBuffer,
        /// Requirement index and mode of each argument-table entry.
        entries: SmallVec<[(u32, AccessMode); 4]>,
    },
    /// Nothing to run.
    Marker,
    /// A host access guard.
    HostAccess,
}

/// Identity of a command.
#[derive(Component, Debug)]
pub struct Command {
    /// Kind.
    pub kind: CommandKind,
    /// Name, for errors and traces.
    pub name: Arc<str>,
    /// The queue it was submitted to (none for inserted memory moves).
    pub queue: Option<Arc<QueueCore>>,
    /// The device that executes it.
    pub device: DeviceId,
    /// Submission order of user commands (0, 1, …). A memory move carries the number
    /// of the command it was inserted for (fusion-sync compares it with a list's
    /// completion), so it shares a value with that command; timelines identify
    /// commands by entity instead.
    pub seq: u64,
}

/// One buffer range a command uses.
#[derive(Clone, Debug)]
pub struct Requirement {
    /// The buffer.
    pub buffer: Arc<BufferCore>,
    /// How it is used.
    pub mode: AccessMode,
    /// Which bytes.
    pub range: ByteRange,
    /// Where the command needs them (set by resolution).
    pub space: MemSpace,
    /// The device allocation in `space`, if it is not host memory (set by resolution).
    pub alloc: Option<AllocId>,
    /// Set by resolution when this write made `space` the valid copy although it held
    /// none before (a whole-buffer discard-write): the resolution order and the spaces
    /// that were valid, to restore if the command fails and leaves garbage behind.
    /// Boxed: rare, and a requirement then fits a cache line.
    pub valid_before: Option<Box<(u64, SmallVec<[MemSpace; 2]>)>>,
    /// Bytes per element of the accessor (fusion sizes promoted memory with it).
    pub elem_size: u32,
    /// The accessor's promotion hint for fusion.
    pub promotion: Promotion,
    /// Ordering only: the command holds the range's leaves but does not bind its memory
    /// (a buffer a fused kernel internalized).
    pub internal: bool,
}

// Every command and graph node holds a few: one cache line each.
const _: () = assert!(std::mem::size_of::<Requirement>() <= 64);

impl Requirement {
    /// A requirement not yet placed in a memory space.
    pub fn new(buffer: Arc<BufferCore>, mode: AccessMode, range: ByteRange) -> Self {
        Self {
            buffer,
            mode,
            range,
            space: MemSpace::Host,
            alloc: None,
            valid_before: None,
            elem_size: 1,
            promotion: Promotion::None,
            internal: false,
        }
    }
}

/// A command's buffer ranges, in argument order: inline up to the count most
/// commands use, since the list moves with the command from stage to stage.
pub type RequirementList = SmallVec<[Requirement; REQUIREMENTS_INLINE]>;

/// Requirements a [`RequirementList`] holds without allocating.
pub const REQUIREMENTS_INLINE: usize = 4;

/// The buffer ranges a command uses, in argument order.
#[derive(Component, Debug, Default)]
pub struct Requirements(pub RequirementList);

/// An outgoing dependency edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Successor {
    /// The dependent command.
    pub entity: Entity,
    /// The edge stops blocking when this command is *submitted* (both on one driver
    /// that orders wait-lists itself); otherwise when it completes.
    pub on_submit: bool,
}

/// Dependency edges of a command.
#[derive(Component, Debug, Default)]
pub struct Edges {
    /// Commands this one depends on (possibly finished and despawned since).
    pub preds: SmallVec<[Entity; 4]>,
    /// Commands that depend on this one.
    pub succs: SmallVec<[Successor; 4]>,
    /// Incoming edges that still block enqueueing.
    pub blockers: u32,
}

/// Where a command is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Waiting for dependency resolution.
    New,
    /// Waiting for its blockers.
    Waiting,
    /// Ready to be enqueued.
    Ready,
    /// Handed to a driver (or, for a host access, held by the user).
    Submitted,
}

/// Execution state of a command.
#[derive(Component)]
pub struct Execution {
    /// Status.
    pub status: Status,
    /// The work, until enqueued.
    pub work: Option<Work>,
    /// The driver's handle once submitted.
    pub handle: Option<OpHandle>,
    /// The event users wait on.
    pub event: Arc<EventShared>,
    /// Events this command was asked to depend on, until resolved.
    pub waits: SmallVec<[Arc<EventShared>; 1]>,
    /// When its finished dependencies ended in virtual time (see
    /// [`Submission::not_before_ns`](gantry_driver::Submission)); commands on real-time
    /// devices pass it through to their dependents unchanged.
    pub not_before_ns: u64,
}

/// Everything a submission carries from a user thread to the ingest stage.
pub struct CommandDesc {
    /// Kind.
    pub kind: CommandKind,
    /// Name.
    pub name: Arc<str>,
    /// The queue.
    pub queue: Arc<QueueCore>,
    /// The executing device.
    pub device: DeviceId,
    /// Buffer ranges used, in argument order.
    pub requirements: RequirementList,
    /// The work.
    pub work: Work,
    /// Explicit event dependencies.
    pub waits: SmallVec<[Arc<EventShared>; 1]>,
    /// Its event.
    pub event: Arc<EventShared>,
    /// The fusion list a kernel joins (submitted while its queue was fusing).
    pub fusion: Option<Arc<crate::fusion::FusionShared>>,
}
