//! The flush: Gantry's stages in their order, and the systems users add to them.
//!
//! # Contract
//!
//! * While no user system has been added, a flush calls the built-in stages one after
//!   the other as plain functions, sharing one set of cached queries. A bevy schedule
//!   run pays its executor and a system call per stage whatever the stages do, which
//!   is a large part of a flush that carries one command (`docs/PERFORMANCE.md`,
//!   "Flushes without a schedule").
//! * The first system a user adds builds the flush schedule: the [`Stage`] sets
//!   chained in one bevy schedule, a built-in system in each (set [`Builtin`]), and the
//!   user sections of `faults`. It runs every later flush.
//! * Both run the same stage functions (each built-in system calls its stage's
//!   function), so a flush has the same effect either way. No stage keeps state
//!   across flushes outside the world: the queries are caches, and ingest's buffer of
//!   taken messages is empty between passes (what a pass leaves is put back in the
//!   mailbox).

use std::collections::VecDeque;

use bevy_ecs::prelude::*;
use bevy_ecs::schedule::{ScheduleBuildError, ScheduleConfigs, SingleThreadedExecutor};
use bevy_ecs::system::ScheduleSystem;
use gantry_components::{Flush, Message, Stage};

use crate::faults::{self, FlushReport};
use crate::queries::Queries;

/// The built-in system of a stage. Systems users add to a stage run after it, so
/// they see its results.
#[derive(SystemSet, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Builtin(pub Stage);

/// Builds the flush schedule: the stages chained in their order ([`Stage::ALL`], the
/// order a flush without a schedule calls them in), with the built-in systems.
fn flush_schedule() -> Schedule {
    let mut schedule = Schedule::new(Flush);
    schedule.set_executor(SingleThreadedExecutor::new());
    for pair in Stage::ALL.windows(2) {
        schedule.configure_sets(pair[0].before(pair[1]));
    }
    schedule.add_systems((
        crate::ingest::ingest.in_set(Stage::Ingest).in_set(Builtin(Stage::Ingest)),
        crate::resolve::resolve.in_set(Stage::Resolve).in_set(Builtin(Stage::Resolve)),
        crate::fusion::fusion_sync.in_set(Stage::FusionSync).in_set(Builtin(Stage::FusionSync)),
        crate::fusion::fuse.in_set(Stage::Fuse).in_set(Builtin(Stage::Fuse)),
        crate::graph::partition.in_set(Stage::Partition).in_set(Builtin(Stage::Partition)),
        crate::enqueue::enqueue.in_set(Stage::Enqueue).in_set(Builtin(Stage::Enqueue)),
        crate::retire::retire.in_set(Stage::Retire).in_set(Builtin(Stage::Retire)),
    ));
    schedule
}

/// The flush of one scheduler world (see the module's contract).
///
/// ```
/// # use gantry_systems::Stages;
/// # use gantry_components::Stage;
/// # use bevy_ecs::world::World;
/// let mut world = World::new();
/// let mut stages = Stages::new(&mut world);
/// assert!(!stages.has_schedule());
/// stages.add_system(&mut world, Stage::Retire, || {}).unwrap();
/// assert!(stages.has_schedule());
/// ```
pub struct Stages {
    /// The built-in stages' caches, for flushes without a schedule.
    queries: Queries,
    /// Ingest's buffer of taken messages (empty between passes).
    taken: VecDeque<Message>,
    /// The flush schedule, once a user system has been added.
    schedule: Option<Schedule>,
    /// The stages whose user section the schedule has (a bit per stage).
    user_sections: u32,
}

impl Stages {
    /// The stages of `world`, with no user system.
    pub fn new(world: &mut World) -> Self {
        Self { queries: Queries::from_world(world), taken: VecDeque::new(), schedule: None, user_sections: 0 }
    }

    /// Whether flushes run the flush schedule (a user system has been added).
    pub fn has_schedule(&self) -> bool {
        self.schedule.is_some()
    }

    /// Adds a user's system to `stage`: it runs after the stage's built-in system, in
    /// the stage's user section. An error if the system's own ordering constraints
    /// break the schedule (a cycle); the schedule then holds the system but fails to
    /// build, as bevy's does.
    pub fn add_system<M>(
        &mut self,
        world: &mut World,
        stage: Stage,
        system: impl IntoScheduleConfigs<ScheduleSystem, M>,
    ) -> Result<(), ScheduleBuildError> {
        let schedule = self.schedule.get_or_insert_with(flush_schedule);
        let bit = 1 << stage as u32;
        if self.user_sections & bit == 0 {
            faults::add_user_section(schedule, stage);
            self.user_sections |= bit;
        }
        let system: ScheduleConfigs<ScheduleSystem> = system.into_configs();
        schedule.add_systems(system.in_set(stage).in_set(faults::UserSection(stage)));
        schedule.initialize(world).map(drop)
    }

    /// Runs one flush; a panic unwinds out of it (see [`Stages::flush`]).
    pub fn run(&mut self, world: &mut World) {
        if let Some(schedule) = &mut self.schedule {
            return schedule.run(world);
        }
        // As a schedule run does: keeps components' change ticks from wrapping around
        // (a load and a compare, except every few hundred million ticks).
        world.check_change_ticks();
        let q = &mut self.queries;
        for stage in Stage::ALL {
            match stage {
                Stage::Ingest => crate::ingest::pass(world, q, &mut self.taken),
                Stage::Resolve => crate::resolve::pass(world, q),
                Stage::FusionSync => crate::fusion::sync_pass(world, q),
                Stage::Fuse => crate::fusion::fuse_pass(world, q),
                Stage::Partition => crate::graph::partition(world),
                Stage::Enqueue => crate::enqueue::pass(world, q),
                Stage::Retire => crate::retire::pass(world, q),
            }
        }
    }

    /// Runs one flush, catching whatever fails in it ([`faults::run_flush`]).
    pub fn flush(&mut self, world: &mut World) -> FlushReport {
        faults::run_flush(world, |world| self.run(world))
    }
}
