//! # gantry-systems
//!
//! The systems of Gantry's scheduler, one module per stage of the flush schedule
//! ([`Stage`]):
//!
//! | stage | module |
//! | --- | --- |
//! | ingest | [`ingest`] |
//! | resolve | [`resolve`] — the dependency rules |
//! | fusion-sync, fuse | [`fusion`] — early cancellation and `complete_fusion` |
//! | partition | [`graph`] — command-graph finalize: linearize, partition, fuse, record |
//! | enqueue | [`enqueue`] |
//! | retire | [`retire`] |
//!
//! Systems reach drivers only through [`gantry_driver::Driver`]. A system that fails
//! is reported by [`faults::run_flush`], never unwound out of the schedule.

#![warn(missing_docs)]

pub mod enqueue;
pub mod faults;
pub mod fusion;
pub mod graph;
pub mod ingest;
mod queries;
pub mod resolve;
pub mod retire;

// The partition stage's module under its name from before it became a folder:
// `gantry_systems::partition::…` paths keep working.
pub use graph as partition;

#[cfg(test)]
mod testing;

use bevy_ecs::prelude::*;
use bevy_ecs::schedule::{Schedule, SingleThreadedExecutor};
use gantry_components::{
    Devices, Flush, Fusions, GraphPolicy, Inbox, SchedulerConfig, Stage, Stats, WorkLists,
};

/// The built-in system of a stage. Systems users add to a stage run after it, so
/// they see its results.
#[derive(SystemSet, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Builtin(pub Stage);

/// Builds the flush schedule: the stages chained in order, with the built-in systems.
pub fn flush_schedule() -> Schedule {
    let mut schedule = Schedule::new(Flush);
    schedule.set_executor(SingleThreadedExecutor::new());
    schedule.configure_sets(
        (
            Stage::Ingest,
            Stage::Resolve,
            Stage::FusionSync,
            Stage::Fuse,
            Stage::Partition,
            Stage::Enqueue,
            Stage::Retire,
        )
            .chain(),
    );
    schedule.add_systems((
        ingest::ingest.in_set(Stage::Ingest).in_set(Builtin(Stage::Ingest)),
        resolve::resolve.in_set(Stage::Resolve).in_set(Builtin(Stage::Resolve)),
        fusion::fusion_sync.in_set(Stage::FusionSync).in_set(Builtin(Stage::FusionSync)),
        fusion::fuse.in_set(Stage::Fuse).in_set(Builtin(Stage::Fuse)),
        graph::partition.in_set(Stage::Partition).in_set(Builtin(Stage::Partition)),
        enqueue::enqueue.in_set(Stage::Enqueue).in_set(Builtin(Stage::Enqueue)),
        retire::retire.in_set(Stage::Retire).in_set(Builtin(Stage::Retire)),
    ));
    schedule
}

/// A world holding the scheduler's resources.
pub fn scheduler_world(devices: Devices, inbox: Inbox, config: SchedulerConfig) -> World {
    let mut world = World::new();
    faults::install(&mut world);
    world.insert_resource(devices);
    world.insert_resource(inbox);
    world.insert_resource(config);
    world.insert_resource(WorkLists::default());
    world.insert_resource(Stats::default());
    world.insert_resource(gantry_components::QueueFailures::default());
    world.insert_resource(GraphPolicy { linearizer: std::sync::Arc::new(graph::ReverseDfs) });
    let closure: std::sync::Arc<dyn gantry_driver::fusion::FusionCompiler> =
        std::sync::Arc::new(gantry_host::ClosureFusion::new());
    let compilers = {
        let devices = world.resource::<Devices>();
        devices.0.iter().map(|d| gantry_components::device_compilers(&*d.driver, &closure)).collect()
    };
    world.insert_resource(Fusions::new(
        compilers,
        std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(16)),
    ));
    world
}
