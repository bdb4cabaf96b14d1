//! The errors of Gantry's public API.

use gantry_driver::{ExecError, RangeError};
use thiserror::Error;

/// Everything that can go wrong in Gantry's API.
///
/// Submission-time problems (bad ranges, conflicting accessors, out-of-bounds copies)
/// are returned by `submit` before anything runs. Execution failures reach the event
/// of the failed command and of every command that depended on it as
/// [`Error::Exec`].
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// `start_fusion` on a queue that is already fusing.
    #[error("queue {0} is already in fusion mode")]
    AlreadyFusing(u64),
    /// `complete_fusion` on a queue that never started a fusion.
    #[error("queue {0} has no fusion to complete")]
    NotFusing(u64),
    /// A range or ND-range is invalid (zero extent, local size not dividing, …).
    #[error("invalid range: {0}")]
    Range(#[from] RangeError),
    /// A buffer range lies outside its buffer.
    #[error("{what}: range {start}..{end} is out of bounds for buffer {buffer} of {len} elements")]
    OutOfBounds {
        /// What the range was for.
        what: &'static str,
        /// The buffer's id.
        buffer: u64,
        /// First element.
        start: usize,
        /// One past the last element.
        end: usize,
        /// The buffer's length.
        len: usize,
    },
    /// An empty buffer range.
    #[error("{what}: empty range of buffer {buffer}")]
    EmptyRange {
        /// What the range was for.
        what: &'static str,
        /// The buffer's id.
        buffer: u64,
    },
    /// Two accessors in one command group overlap on a buffer and one of them writes.
    #[error("accessors {first} and {second} overlap on buffer {buffer} and one of them writes")]
    AccessorConflict {
        /// The buffer's id.
        buffer: u64,
        /// Slot of the first accessor.
        first: usize,
        /// Slot of the second accessor.
        second: usize,
    },
    /// A command group asked for more than one action (kernel, copy, fill, host task).
    #[error("a command group holds one action, but `{second}` follows `{first}`")]
    MultipleActions {
        /// The first action.
        first: &'static str,
        /// The second action.
        second: &'static str,
    },
    /// An elementwise kernel ([`Handler::map`](crate::Handler::map)) whose input is
    /// shorter than its output.
    #[error("map input has {input} elements, fewer than the {output} of its output")]
    MapInputTooShort {
        /// Input elements.
        input: usize,
        /// Output elements.
        output: usize,
    },
    /// A stencil ([`Handler::stencil`](crate::Handler::stencil)) whose output does
    /// not hold its grid exactly, or whose input holds less.
    #[error("stencil grid of {rows} × {cols} cells needs exactly that many output elements (has {output}) and at least as many input elements (has {input})")]
    StencilGrid {
        /// Rows of the grid.
        rows: usize,
        /// Columns of the grid.
        cols: usize,
        /// Input elements.
        input: usize,
        /// Output elements.
        output: usize,
    },
    /// A copy between ranges of different lengths.
    #[error("copy of {src} elements into a range of {dst}")]
    LengthMismatch {
        /// Source elements.
        src: usize,
        /// Destination elements.
        dst: usize,
    },
    /// An exclusive element accessor whose range differs from the kernel's size.
    #[error("element accessor on buffer {buffer} has {len} elements but the kernel has {global} work-items")]
    ElementAccessorSize {
        /// The buffer's id.
        buffer: u64,
        /// Elements in the accessor's range.
        len: usize,
        /// Work-items of the kernel.
        global: usize,
    },
    /// Local memory in a kernel without an ND-range (work-groups are undefined there).
    #[error("local memory needs an ND-range kernel")]
    LocalMemoryNeedsNdRange,
    /// More local memory than the device offers per work-group.
    #[error("kernel asks for {requested} bytes of local memory; the device offers {max}")]
    LocalMemoryTooLarge {
        /// Bytes requested.
        requested: usize,
        /// Bytes available.
        max: usize,
    },
    /// A work-group kernel with no phase.
    #[error("work-group kernel `{0}` has no phase")]
    NoPhases(String),
    /// The device cannot run this kind of command.
    #[error("device {device} does not support {what}")]
    Unsupported {
        /// Device name.
        device: String,
        /// What was asked for.
        what: &'static str,
    },
    /// The kernel has no image of a kind the device runs.
    #[error("kernel `{kernel}` has no image that device {device} runs (it has: {kinds})")]
    NoImageForDevice {
        /// The kernel.
        kernel: String,
        /// The device.
        device: String,
        /// The kinds of its images.
        kinds: String,
    },
    /// A launch binds another number of buffers than the kernel's signature has.
    #[error("kernel `{kernel}` takes {expected} buffer arguments; the command group has {got} accessors")]
    KernelArguments {
        /// The kernel.
        kernel: String,
        /// Buffer arguments in its signature.
        expected: usize,
        /// Accessors in the group.
        got: usize,
    },
    /// A launch's accessor has another access mode than the signature's argument.
    #[error("kernel `{kernel}` argument {index} is {expected:?} in its signature; the accessor is {got:?}")]
    KernelArgumentMode {
        /// The kernel.
        kernel: String,
        /// The argument.
        index: usize,
        /// Its mode in the signature.
        expected: gantry_driver::AccessMode,
        /// The accessor's.
        got: gantry_driver::AccessMode,
    },
    /// A scalar argument that does not fit the signature.
    #[error("kernel `{kernel}`: {source}")]
    ScalarArgument {
        /// The kernel.
        kernel: String,
        /// What does not fit.
        source: gantry_driver::ScalarMismatch,
    },
    /// A scalar argument the launch did not set.
    #[error("kernel `{kernel}`: scalar argument {index} is not set")]
    ScalarNotSet {
        /// The kernel.
        kernel: String,
        /// The scalar.
        index: usize,
    },
    /// No device with this id.
    #[error("no device {0}")]
    UnknownDevice(u32),
    /// A buffer or event of another runtime.
    #[error("{0} belongs to another runtime")]
    ForeignObject(&'static str),
    /// The runtime was dropped.
    #[error("the runtime was dropped")]
    RuntimeDropped,
    /// [`Event::timestamps`](crate::Event::timestamps) of a runtime that does not
    /// record them.
    #[error("event timestamps are recorded only by a runtime that profiles: build it with RuntimeBuilder::profiling(true)")]
    ProfilingDisabled,
    /// A call that would wait for the calling thread itself: a host access to a
    /// buffer this thread holds a conflicting guard on.
    #[error("self-deadlock: {0}")]
    SelfDeadlock(String),
    /// The scheduler stopped on a failure of its own; the runtime takes no more work
    /// and everything pending failed with [`ExecError::SchedulerFailed`].
    #[error("the scheduler failed and stopped: {0}")]
    SchedulerFailed(String),
    /// A system added with [`Runtime::add_system`](crate::Runtime::add_system) failed
    /// (panicked or returned an error) during a flush; the flush went on without it.
    #[error("a system added to stage {stage:?} failed: {message}")]
    SystemFailed {
        /// Its stage.
        stage: gantry_components::Stage,
        /// The panic message or the error.
        message: String,
    },
    /// A size computation overflowed (elements times element size, or per work-item
    /// memory times work-items).
    #[error("{what}: {count} elements of {elem_size} bytes overflow the address space")]
    SizeOverflow {
        /// What was sized.
        what: &'static str,
        /// Elements asked for.
        count: usize,
        /// Bytes per element.
        elem_size: usize,
    },
    /// The host could not allocate a buffer's memory.
    #[error("out of host memory: a buffer of {bytes} bytes could not be allocated")]
    OutOfHostMemory {
        /// Bytes asked for.
        bytes: usize,
    },
    /// More private memory than the device offers per work-group.
    #[error("kernel asks for {requested} bytes of private memory per work-group; the device offers {max}")]
    PrivateMemoryTooLarge {
        /// Bytes requested (per work-item bytes times work-items per group).
        requested: usize,
        /// Bytes available.
        max: usize,
    },
    /// A command failed while executing (or a command it depended on did).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// `begin_recording` on a queue that already records into a graph.
    #[error("queue {0} is already recording into a graph")]
    AlreadyRecording(u64),
    /// `end_recording` on a queue that does not record into this graph.
    #[error("queue {queue} is not recording into graph {graph}")]
    NotRecording {
        /// The queue.
        queue: u64,
        /// The graph.
        graph: u64,
    },
    /// Adding a node explicitly to, or finalizing, a graph while queues record into it.
    #[error("graph {0} is recording; end the recording first")]
    GraphRecording(u64),
    /// Waiting on a queue while it records: its commands do not run.
    #[error("queue {0} is recording into a graph; its commands run when the graph is submitted")]
    QueueRecording(u64),
    /// Waiting on, or depending from outside its graph on, the event of a recorded
    /// command: it never runs by itself.
    #[error("event `{0}` belongs to a command recorded into a graph; it never runs by itself")]
    RecordedEvent(String),
    /// A graph node depending on an event of a command outside the graph.
    #[error("a graph node cannot depend on event `{0}` from outside the graph")]
    EventOutsideGraph(String),
    /// Host access to a buffer that a recording graph uses.
    #[error("buffer {0} is used by a graph being recorded; end the recording before host access")]
    BufferRecorded(u64),
    /// An edge from a node to itself.
    #[error("make_edge from node {0} to itself")]
    SelfEdge(u32),
    /// An edge that would close a cycle.
    #[error("make_edge {from} → {to} would create a cycle")]
    CycleEdge {
        /// Source node.
        from: u32,
        /// Target node.
        to: u32,
    },
    /// A node of another graph.
    #[error("node {node} belongs to graph {graph}, not to graph {this}")]
    ForeignNode {
        /// The node.
        node: u32,
        /// Its graph.
        graph: u64,
        /// The graph it was given to.
        this: u64,
    },
    /// Finalizing a graph failed.
    #[error("finalize: {0}")]
    Finalize(#[from] gantry_components::FinalizeError),
    /// An update of an executable graph finalized without `updatable`.
    #[error("executable graph {0} was not finalized as updatable")]
    NotUpdatable(u64),
    /// A whole-graph update from a graph of another topology.
    #[error("graph topology differs: {0}")]
    TopologyMismatch(String),
    /// A dynamic parameter bound to or updated with a buffer of another size or
    /// element type, or to a slot that does not exist.
    #[error("dynamic parameter {param}: {why}")]
    ParamMismatch {
        /// The parameter's index in its graph.
        param: u32,
        /// What does not fit.
        why: String,
    },
}

/// Gantry's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
