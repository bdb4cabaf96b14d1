//! # gantry-systems
//!
//! The systems of Gantry's scheduler, one module per stage of the flush schedule
//! ([`Stage`](gantry_components::Stage)), run in order by [`Stages`]:
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
//! is reported by [`faults::run_flush`] ([`Stages::flush`]), never unwound out of
//! the flush.

#![warn(missing_docs)]

pub mod enqueue;
pub mod faults;
pub mod fusion;
pub mod graph;
pub mod ingest;
mod queries;
pub mod resolve;
pub mod retire;
mod stages;

// The partition stage's module under its name from before it became a folder:
// `gantry_systems::partition::…` paths keep working.
pub use graph as partition;
pub use stages::{Builtin, Stages};

#[cfg(test)]
mod testing;

use bevy_ecs::prelude::*;
use gantry_components::{Devices, Fusions, GraphPolicy, Inbox, SchedulerConfig, Stats, WorkLists};

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
    let (compilers, thresholds) = {
        let devices = world.resource::<Devices>();
        let compilers =
            devices.0.iter().map(|d| gantry_components::device_compilers(&*d.driver, &closure)).collect();
        (compilers, devices.0.iter().map(|d| d.info.caps.fusion_window).collect())
    };
    world.insert_resource(Fusions::new(
        compilers,
        thresholds,
        std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(16)),
    ));
    world
}
