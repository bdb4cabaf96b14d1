//! The host task running on this thread, so that a call that would wait for that
//! very task is refused instead of hanging.
//!
//! A host task that waits for its runtime to go idle, or for the queue it was
//! submitted to, waits for itself: the runtime is not idle and the queue's barrier
//! is not reached until the task returns. The task's closure runs, and is dropped,
//! inside its scope ([`Scoped`]), so such calls see it and return
//! [`Error::SelfDeadlock`](crate::Error::SelfDeadlock); dropping the runtime inside its
//! own host task (a task that owned it) hands the shutdown to another thread instead
//! of waiting. What the runtime cannot see (a task waiting on the event of a command
//! that depends on it; a kernel waiting on anything) stays a documented rule: host
//! tasks and kernels must not wait on work of their own runtime that is not finished.

use std::cell::Cell;
use std::mem::ManuallyDrop;

/// Where the running host task came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TaskScope {
    /// Its runtime.
    pub(crate) runtime: u64,
    /// The queue it was submitted to (`None` for a graph node, which runs on the
    /// queue of each submission).
    pub(crate) queue: Option<u64>,
}

thread_local! {
    static CURRENT: Cell<Option<TaskScope>> = const { Cell::new(None) };
}

/// The host task running on this thread, if any.
pub(crate) fn current() -> Option<TaskScope> {
    CURRENT.with(Cell::get)
}

/// Whether this thread runs a host task of runtime `runtime`.
pub(crate) fn inside(runtime: u64) -> bool {
    current().is_some_and(|s| s.runtime == runtime)
}

/// Restores the previous scope when dropped (also when the task unwinds).
struct Enter(Option<TaskScope>);

impl Enter {
    fn new(scope: TaskScope) -> Self {
        Self(CURRENT.with(|c| c.replace(Some(scope))))
    }
}

impl Drop for Enter {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

/// A host task's closure that runs, and is dropped, inside its scope.
pub(crate) struct Scoped<F> {
    f: ManuallyDrop<F>,
    scope: TaskScope,
}

impl<F> Scoped<F> {
    pub(crate) fn new(f: F, scope: TaskScope) -> Self {
        Self { f: ManuallyDrop::new(f), scope }
    }

    /// Runs `call` on the closure inside its scope.
    pub(crate) fn with<R>(&mut self, call: impl FnOnce(&mut F) -> R) -> R {
        let _enter = Enter::new(self.scope);
        call(&mut self.f)
    }
}

impl<F> Drop for Scoped<F> {
    fn drop(&mut self) {
        let _enter = Enter::new(self.scope);
        // SAFETY: dropped once, here; the field is never used again.
        unsafe { ManuallyDrop::drop(&mut self.f) }
    }
}
