//! The scheduler's stages, in the order one flush runs them.

use bevy_ecs::schedule::{ScheduleLabel, SystemSet};

/// The schedule one flush runs.
#[derive(ScheduleLabel, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Flush;

/// A stage of the flush schedule. Stages run in declaration order; a user may add
/// systems to any of them (a tracing system, a custom policy).
#[derive(SystemSet, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Drain submissions and other messages into entities.
    Ingest,
    /// Dependency resolution: edges from memory records, events and queue order;
    /// memory moves between devices.
    Resolve,
    /// Cancel fusion on synchronization (filled by the fusion feature).
    FusionSync,
    /// Complete fusion (filled by the fusion feature).
    Fuse,
    /// Partition graphs being finalized (filled by the graph feature).
    Partition,
    /// Hand ready commands to drivers.
    Enqueue,
    /// Apply completions, complete events, release leaves, despawn finished commands.
    Retire,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 7] = [
        Stage::Ingest,
        Stage::Resolve,
        Stage::FusionSync,
        Stage::Fuse,
        Stage::Partition,
        Stage::Enqueue,
        Stage::Retire,
    ];
}
