//! What a flush reports when a system fails.
//!
//! bevy_ecs catches a panicking system and hands it, like a system's returned error,
//! to the world's error handler, whose default panics again: out of the middle of
//! the schedule, which then skips the systems it had already run on every later run.
//! The flush schedule's handler (`record_fault`, set by [`install`]) never unwinds; it records the
//! failure, and [`run_flush`] returns it with the flush.
//!
//! Contract: a failure inside the systems a user added ([`UserSection`]) concerns
//! that flush only: the stage's built-in system had finished, and every later stage
//! still runs. A failure anywhere else (a built-in system, the schedule itself) means
//! the scheduler's own state can no longer be trusted: the caller stops the runtime
//! and fails what is pending, so no wait hangs on it.

use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};

use bevy_ecs::error::{BevyError, ErrorContext, FallbackErrorHandler};
use bevy_ecs::schedule::{IntoScheduleConfigs, Schedule, SystemSet};
use bevy_ecs::world::World;
use gantry_components::Stage;

/// The systems a user added to a stage: they run after the stage's built-in system,
/// between two markers that tell the error handler whose code failed.
#[derive(SystemSet, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UserSection(pub Stage);

/// The marker that opens a stage's [`UserSection`].
#[derive(SystemSet, Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct EnterUser(Stage);

/// The marker that closes a stage's [`UserSection`].
#[derive(SystemSet, Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct LeaveUser(Stage);

/// A system a user added that failed during a flush.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemFault {
    /// Its stage.
    pub stage: Stage,
    /// What it said: the panic message, or the error it returned.
    pub message: String,
}

/// What one flush reported.
#[derive(Debug, Default)]
pub struct FlushReport {
    /// Failures of systems users added: the runtime goes on.
    pub user: Vec<SystemFault>,
    /// A failure of Gantry's own systems or of the schedule: the scheduler's state
    /// is suspect and the runtime must stop.
    pub fatal: Option<String>,
}

thread_local! {
    /// The user section running on this thread, if any.
    static IN_USER: Cell<Option<Stage>> = const { Cell::new(None) };
    /// Failures recorded during the flush running on this thread: the user section
    /// they happened in (`None`: Gantry's own systems) and the message.
    static FAULTS: RefCell<Vec<(Option<Stage>, String)>> = const { RefCell::new(Vec::new()) };
}

/// The flush schedule's error handler: records, never unwinds.
fn record_fault(mut error: BevyError, _ctx: ErrorContext) {
    let message = match error.take_payload() {
        Some(payload) => gantry_driver::panic_message(&*payload),
        None => error.to_string().trim_end().to_owned(),
    };
    let section = IN_USER.with(Cell::get);
    FAULTS.with(|f| f.borrow_mut().push((section, message)));
}

/// Installs the recording error handler on the scheduler's world.
pub fn install(world: &mut World) {
    world.insert_resource(FallbackErrorHandler(record_fault));
}

/// Adds the markers of `stage`'s user section to the schedule (once per stage; a
/// second call adds nothing). User systems go `in_set(UserSection(stage))`.
pub fn add_user_section(schedule: &mut Schedule, stage: Stage) {
    let enter = move || IN_USER.with(|s| s.set(Some(stage)));
    let leave = || IN_USER.with(|s| s.set(None));
    schedule.configure_sets(
        (
            EnterUser(stage).in_set(stage).after(crate::Builtin(stage)),
            UserSection(stage).in_set(stage).after(EnterUser(stage)),
            LeaveUser(stage).in_set(stage).after(UserSection(stage)),
        )
            .chain(),
    );
    schedule.add_systems((enter.in_set(EnterUser(stage)), leave.in_set(LeaveUser(stage))));
}

/// Runs one flush (`flush`: the stages, [`Stages::run`](crate::Stages::run)),
/// catching whatever fails in it.
pub fn run_flush(world: &mut World, flush: impl FnOnce(&mut World)) -> FlushReport {
    FAULTS.with(|f| f.borrow_mut().clear());
    let ran = catch_unwind(AssertUnwindSafe(|| flush(world)));
    IN_USER.with(|s| s.set(None));
    let faults = FAULTS.with(|f| std::mem::take(&mut *f.borrow_mut()));
    let mut report = FlushReport::default();
    if let Err(payload) = ran {
        report.fatal = Some(gantry_driver::panic_message(&*payload));
    }
    for (section, message) in faults {
        match section {
            Some(stage) => report.user.push(SystemFault { stage, message }),
            None if report.fatal.is_none() => report.fatal = Some(message),
            None => {}
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world() -> World {
        let mut world = World::new();
        install(&mut world);
        world
    }

    /// A user system that panics is reported with its stage; the stages after it
    /// still run, in this flush and the next.
    #[test]
    fn a_user_failure_concerns_its_flush_only() {
        let mut schedule = Schedule::new(gantry_components::Flush);
        schedule.set_executor(bevy_ecs::schedule::SingleThreadedExecutor::new());
        schedule.configure_sets((Stage::Resolve, Stage::Retire).chain());
        schedule.add_systems((|| {}).in_set(Stage::Resolve).in_set(crate::Builtin(Stage::Resolve)));
        add_user_section(&mut schedule, Stage::Resolve);
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = runs.clone();
        schedule.add_systems((|| panic!("boom")).in_set(UserSection(Stage::Resolve)));
        schedule.add_systems(
            (move || {
                r.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .in_set(Stage::Retire),
        );
        let mut world = world();
        for flush in 1..=2 {
            let report = run_flush(&mut world, |w| schedule.run(w));
            assert!(report.fatal.is_none());
            assert_eq!(report.user, vec![SystemFault { stage: Stage::Resolve, message: "boom".into() }]);
            assert_eq!(runs.load(std::sync::atomic::Ordering::Relaxed), flush);
        }
    }

    /// A built-in stage that fails is fatal, whether the flush calls it directly or
    /// through the schedule a user system brings: here, one whose resource is gone.
    #[test]
    fn a_builtin_failure_is_fatal() {
        for with_user_system in [false, true] {
            let mut world = world();
            let mut stages = crate::Stages::new(&mut world);
            if with_user_system {
                stages.add_system(&mut world, Stage::Retire, || {}).expect("a valid schedule");
            }
            assert_eq!(stages.has_schedule(), with_user_system);
            let report = stages.flush(&mut world);
            assert!(report.fatal.is_some(), "{report:?}");
            assert!(report.user.is_empty());
        }
    }
}
