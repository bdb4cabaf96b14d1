//! A record of finished commands, for timelines (Chrome trace / Perfetto) and
//! research. Present only when the runtime was asked to record one.

use std::sync::Arc;

use bevy_ecs::resource::Resource;
use smallvec::SmallVec;

use crate::command::CommandKind;
use crate::resources::DeviceId;

/// One finished command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    /// Unique id of the command within the run.
    pub id: u64,
    /// Its name.
    pub name: Arc<str>,
    /// Its kind.
    pub kind: CommandKind,
    /// The device that ran it.
    pub device: DeviceId,
    /// The queue it was submitted to (none for inserted memory moves).
    pub queue: Option<u64>,
    /// The driver thread or engine that ran it (0: the submitting thread).
    pub lane: u32,
    /// Start on the device's clock, in nanoseconds.
    pub start_ns: u64,
    /// End on the device's clock, in nanoseconds.
    pub end_ns: u64,
    /// Ids of the commands it depended on (those still unfinished when it was
    /// resolved).
    pub preds: SmallVec<[u64; 4]>,
    /// Bytes it moved (copies, fills and memory moves: the destination's size).
    pub bytes: u64,
    /// Its error, if it failed.
    pub error: Option<String>,
}

/// The finished commands of a run, in retirement order.
#[derive(Resource, Clone, Debug, Default)]
pub struct Timeline {
    /// The slices.
    pub slices: Vec<Slice>,
}
