//! Command-buffer replay on a host driver: a recorded [`Plan`] with a cache of its
//! operations bound to the argument table of its latest replay ([`CachedPlan`]), the
//! bound operations ([`BoundOps`]), and the replay itself ([`Runner::replay`],
//! [`Runner::replay_steps`]).
//!
//! A graph's buffers rarely move between replays, so a replay usually reuses the
//! binding: a replayed operation then costs its own work and nothing else. Each
//! driver decides what a binding depends on (the CPU driver: each entry's address
//! and length; the simulated device: also its memory kind and the device) and what
//! it keeps beside each operation (the simulated device: its virtual cost).

use std::sync::Arc;

use gantry_driver::sync::Mutex;
use gantry_driver::{Binding, CommandBufferLaunch, ExecError, Plan, RecordedOp};

use crate::runner::{Groups, Runner};

/// A command buffer a host driver recorded: the plan, and `T`, the driver's binding
/// of its operations to the argument table of its latest replay, if any.
pub struct CachedPlan<T> {
    /// The recorded operations.
    pub plan: Plan,
    /// The latest binding.
    bound: Mutex<Option<Arc<T>>>,
}

impl<T: Send + Sync + 'static> CachedPlan<T> {
    /// The command buffer `launch` replays, if it is a `CachedPlan<T>` (recorded by
    /// the driver named `device`) and the launch binds its whole argument table; else
    /// the error the replay fails with.
    pub fn launched<'a>(launch: &'a CommandBufferLaunch, device: &Arc<str>) -> Result<&'a Self, ExecError> {
        let invalid = |message| ExecError::Driver { device: device.clone(), message };
        let cached = launch
            .buffer
            .downcast_ref::<Self>()
            .ok_or_else(|| invalid("a command buffer recorded by another driver".into()))?;
        let entries = cached.plan.entries;
        if launch.args.len() != entries {
            let bound = launch.args.len();
            return Err(invalid(format!(
                "command buffer has {entries} argument entries but {bound} were bound"
            )));
        }
        Ok(cached)
    }
}

impl<T> CachedPlan<T> {
    /// A plan with nothing bound yet.
    pub fn new(plan: Plan) -> Self {
        Self { plan, bound: Mutex::new(None) }
    }

    /// The same plan with the same binding (shared): a copy for a patch that keeps
    /// what is bound.
    pub fn with_binding(&self) -> Self {
        Self { plan: self.plan.clone(), bound: Mutex::new(self.bound.lock().clone()) }
    }

    /// Forgets the binding (a patch changed what it depends on).
    pub fn unbind(&mut self) {
        *self.bound.get_mut() = None;
    }

    /// The latest binding if `fits` says it still holds for this replay; else the one
    /// `bind` makes, which becomes the latest. Bound under the cache's lock, so
    /// concurrent replays bind once.
    pub fn bound(&self, fits: impl FnOnce(&T) -> bool, bind: impl FnOnce() -> T) -> Arc<T> {
        let mut slot = self.bound.lock();
        match &*slot {
            Some(b) if fits(b) => b.clone(),
            _ => {
                let b = Arc::new(bind());
                *slot = Some(b.clone());
                b
            }
        }
    }
}

/// A plan's operations bound to memory: each one's arguments (in
/// [`RecordedOp::args`] order, all in one table) or why they cannot be bound, and
/// what the driver keeps beside it (`S`).
#[derive(Debug)]
pub struct BoundOps<S = ()> {
    /// One per operation, in plan order.
    steps: Vec<BoundStep<S>>,
    /// Every operation's bindings, in plan and argument order.
    bindings: Vec<Binding>,
}

/// One operation of [`BoundOps`].
#[derive(Debug)]
pub struct BoundStep<S> {
    /// Where its arguments start in [`BoundOps`]' table, or why it cannot run.
    args: Result<u32, ExecError>,
    /// What the driver keeps beside it (the default when it cannot run).
    pub data: S,
}

impl<S: Default> BoundOps<S> {
    /// Binds every operation of `plan` with `bind`, which appends an operation's
    /// arguments to the table and returns what the driver keeps beside it, or why
    /// the operation cannot run (at replay it then fails with that error, and its
    /// dependents with it).
    pub fn bind(
        plan: &Plan,
        mut bind: impl FnMut(&RecordedOp, &mut Vec<Binding>) -> Result<S, ExecError>,
    ) -> Self {
        let mut ops = Self { steps: Vec::with_capacity(plan.ops.len()), bindings: Vec::new() };
        for planned in &plan.ops {
            let start = ops.bindings.len();
            let step = match bind(&planned.op, &mut ops.bindings) {
                Ok(data) => BoundStep { args: Ok(start as u32), data },
                Err(e) => {
                    ops.bindings.truncate(start);
                    BoundStep { args: Err(e), data: S::default() }
                }
            };
            ops.steps.push(step);
        }
        ops
    }
}

impl<S> BoundOps<S> {
    /// The operations, in plan order.
    pub fn steps(&self) -> &[BoundStep<S>] {
        &self.steps
    }
}

impl Runner {
    /// Replays `plan`, bound by `ops`: its operations in plan order, each over its
    /// bound arguments ([`Runner::run_recorded`]), and returns each one's error (empty
    /// when none failed). `fault(i)` is an error that operation `i` fails with
    /// instead of running (a driver's injected fault), if any; an operation that
    /// could not be bound fails with why. A failed operation fails the operations
    /// that depend on it, directly or not, with a dependency error naming it;
    /// independent ones still run ([`Plan::replay`]). Each follows the failure rules
    /// of its single operation (a panicking kernel restores what it wrote when
    /// `preserve` is set).
    ///
    /// # Safety
    /// `ops`' bindings must point into live memory (the replay's argument table),
    /// touched by nothing else during the call.
    pub unsafe fn replay_steps<S>(
        &self,
        plan: &Plan,
        ops: &BoundOps<S>,
        preserve: bool,
        groups: &mut impl Groups,
        fault: impl Fn(usize) -> Option<ExecError>,
    ) -> Vec<Option<ExecError>> {
        plan.replay(|i, op| {
            if let Some(e) = fault(i) {
                return Err(e);
            }
            let start = match &ops.steps[i].args {
                Ok(start) => *start as usize,
                Err(e) => return Err(e.clone()),
            };
            // SAFETY: the caller's contract; the operation was bound by `ops`, so its
            // copies and fills passed the plan's checks.
            unsafe { self.run_recorded(op, &ops.bindings[start..], preserve, groups) }
        })
    }

    /// [`Runner::replay_steps`], whose first error is the replay's.
    ///
    /// # Safety
    /// As for [`Runner::replay_steps`].
    pub unsafe fn replay<S>(
        &self,
        plan: &Plan,
        ops: &BoundOps<S>,
        preserve: bool,
        groups: &mut impl Groups,
        fault: impl Fn(usize) -> Option<ExecError>,
    ) -> Result<(), ExecError> {
        // SAFETY: forwarded.
        let failed = unsafe { self.replay_steps(plan, ops, preserve, groups, fault) };
        failed.into_iter().flatten().next().map_or(Ok(()), Err)
    }
}
