//! # gantry-components
//!
//! The data of Gantry's scheduler, as ECS components and resources. Commands and
//! memory records (one per buffer) and queues are entities; the systems in
//! `gantry-systems` transform them stage by stage.
//!
//! | entity | components |
//! | --- | --- |
//! | command | [`Command`], [`Requirements`], [`Edges`], [`Execution`] (holds its event) |
//! | memory record | [`MemoryRecord`] |
//! | queue | [`QueueState`] |
//! | fusion list | [`FusionList`] (its kernels carry [`InFusion`]) |
//! | graph finalize request | [`Finalizing`] |
//!
//! A user-facing event is the shared half of a command's [`Execution`]: its
//! [`EventShared`] outlives the command entity, so waiting never needs the world, and
//! it is freed when neither the scheduler nor the user holds it.

#![warn(missing_docs)]

pub mod command;
pub mod event;
pub mod event_pool;
pub mod fusion;
pub mod graph;
pub mod hand_back;
pub mod handle;
pub mod mailbox;
pub mod memory;
pub mod not_fused;
pub mod queue;
pub mod resources;
pub mod rules;
pub mod stage;
pub mod timeline;

pub use command::{
    Command, CommandDesc, CommandKind, Edges, Execution, Requirement, RequirementList, Requirements, Status,
    Successor, SyncCell, Work,
};
pub use event::{EventShared, EventStatus, Timestamps};
pub use fusion::{
    device_compilers, fuse_with, warn_fusion, CancelReason, Compilers, FusionList, FusionOutcome,
    FusionProps, FusionShared, FusionStatus, Fusions, InFusion, ListRef, ListStatus,
};
pub use graph::{
    Entry, EntrySource, ExecPlan, FinalizeError, FinalizeJob, Finalizing, FusedChain, GraphHostFn,
    GraphLaunch, GraphNode, GraphNodes, GraphOrder, GraphPolicy, GraphProps, GraphShape, GraphSubmission,
    KeepAlive, Linearizer, NodeId, NodeList, NodeUse, NodeWork, ParamTable, PartitionBody, PartitionPlan,
};
pub use hand_back::{HandBack, Returning};
pub use handle::{BufferCore, EntitySlot, QueueCore};
pub use mailbox::Mailbox;
pub use memory::{ByteRange, KeptFailure, Leaf, LeafKey, LeafSet, Location, MemoryRecord, ReleasedLeaves};
pub use not_fused::NotFused;
pub use queue::{FailureSync, QueueFailure, QueueFailures, QueueState};
pub use resources::{
    fail_message, Device, DeviceId, Devices, Finished, Inbox, Message, SchedulerConfig, Stats, WorkLists,
};
pub use rules::{Accesses, QueueOrder};
pub use stage::{Flush, Stage};
pub use timeline::{Slice, Timeline};
