//! The runtime's active fusions, so a call that cancels one does so before it
//! returns.
//!
//! The scheduler's fusion-sync stage cancels a fusion list when a command that is not
//! fused depends on a listed kernel, or when a buffer a listed kernel uses is dropped;
//! but it runs later, and meanwhile `is_in_fusion_mode` would still say yes and new
//! kernels would join a list that is already doomed. So the submitting thread applies
//! the same rules at the call, from what the active fusions' kernels use: a command
//! whose byte range of a buffer overlaps one a listed kernel uses, where either one
//! writes, or one waiting on a fusion's event, depends on the list. A fusion that is
//! no longer active (completed, cancelled) is never cancelled here. A kernel listed
//! in one fusion that depends on another's kernels makes the first depend on the
//! second; if the second already depends on the first, fusing both would form a
//! cycle, and the second is cancelled, as the scheduler does.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry_components::{CancelReason, EventShared, FusionShared, FusionStatus, Message, Requirement};
use gantry_driver::sync::Mutex;
use smallvec::SmallVec;

use crate::buffer_use::BufferUse;
use crate::runtime::Shared;

/// An active fusion and what its listed kernels use.
struct Entry {
    fusion: Arc<FusionShared>,
    uses: SmallVec<[BufferUse; 8]>,
    /// The fusions whose kernels some of its kernels depend on.
    deps: SmallVec<[Arc<FusionShared>; 2]>,
}

impl Entry {
    /// Whether a command with these requirements depends on this fusion's kernels.
    fn conflicts(&self, requirements: &[Requirement]) -> bool {
        requirements.iter().any(|r| {
            let other = BufferUse::of(r);
            self.uses.iter().any(|u| u.conflicts(&other))
        })
    }
}

/// The active fusions of one runtime.
#[derive(Default)]
pub(crate) struct Fusing {
    /// Entries held, read without the lock so that a runtime with no fusion pays one
    /// load per submission.
    len: AtomicUsize,
    entries: Mutex<Vec<Entry>>,
}

impl Fusing {
    /// Records the buffers of a kernel listed in `fusion`, and what it depends on:
    /// another fusion's kernels. Returns the other fusions that already depend on
    /// this one: fusing both would form a cycle, so the caller cancels them with
    /// [`Fusing::cancel_cycles`] (once it no longer holds `fusion`'s lock: a
    /// cancellation takes the other fusion's).
    ///
    /// A fusion is registered at its first listed kernel, not at `start_fusion`:
    /// until then nothing can depend on it (its event is handed out with its first
    /// kernel), and a window that passes its kernels through never is.
    #[must_use]
    pub(crate) fn listed(
        &self,
        fusion: &Arc<FusionShared>,
        requirements: &[Requirement],
    ) -> SmallVec<[Arc<FusionShared>; 1]> {
        let mut cycles: SmallVec<[Arc<FusionShared>; 1]> = SmallVec::new();
        let mut entries = self.entries.lock();
        if fusion.sent() == 0 {
            entries.retain(|e| e.fusion.status() == FusionStatus::Active);
            entries.push(Entry { fusion: fusion.clone(), uses: SmallVec::new(), deps: SmallVec::new() });
            self.len.store(entries.len(), Ordering::Release);
        }
        if entries.len() > 1 {
            let others: SmallVec<[Arc<FusionShared>; 2]> = entries
                .iter()
                .filter(|o| !Arc::ptr_eq(&o.fusion, fusion) && o.fusion.status() == FusionStatus::Active)
                .filter(|o| o.conflicts(requirements))
                .map(|o| o.fusion.clone())
                .collect();
            for other in others {
                if depends_on(&entries, &other, fusion) {
                    cycles.push(other);
                } else if let Some(e) = entries.iter_mut().find(|e| Arc::ptr_eq(&e.fusion, fusion)) {
                    if !e.deps.iter().any(|d| Arc::ptr_eq(d, &other)) {
                        e.deps.push(other);
                    }
                }
            }
        }
        if let Some(e) = entries.iter_mut().find(|e| Arc::ptr_eq(&e.fusion, fusion)) {
            for r in requirements {
                let new = BufferUse::of(r);
                match e.uses.iter_mut().find(|u| (u.buffer, u.range) == (new.buffer, new.range)) {
                    Some(u) => u.writes |= new.writes,
                    None => e.uses.push(new),
                }
            }
        }
        cycles
    }

    /// Cancels the fusions [`Fusing::listed`] found in a cycle with `fusion`.
    pub(crate) fn cancel_cycles(
        &self,
        rt: &Shared,
        fusion: &FusionShared,
        cycles: SmallVec<[Arc<FusionShared>; 1]>,
    ) {
        for other in cycles {
            let reason = CancelReason::Cycle { other_queue: fusion.queue.id };
            other.cancel(reason, || {
                let _ = rt.send(Message::CancelFusion(other.clone()));
            });
        }
    }

    /// Whether any fusion may be active: one load, so that a runtime with none pays
    /// nothing more per submission.
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.len.load(Ordering::Acquire) != 0
    }

    /// Cancels every active fusion a command with these requirements and waits
    /// depends on, naming the command.
    pub(crate) fn cancel_dependencies(
        &self,
        rt: &Shared,
        requirements: &[Requirement],
        waits: &[Arc<EventShared>],
        command: &Arc<str>,
        kind: &'static str,
    ) {
        let depends =
            |e: &Entry| waits.iter().any(|w| Arc::ptr_eq(w, &e.fusion.event)) || e.conflicts(requirements);
        self.cancel_where(rt, depends, || CancelReason::Dependent { command: command.clone(), kind });
    }

    /// Cancels every active fusion whose kernels use buffer `id`, which was dropped.
    pub(crate) fn cancel_users_of(&self, rt: &Shared, id: u64) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let uses = |e: &Entry| e.uses.iter().any(|u| u.buffer == id);
        self.cancel_where(rt, uses, || CancelReason::BufferDropped { buffer: id });
    }

    fn cancel_where(&self, rt: &Shared, hit: impl Fn(&Entry) -> bool, reason: impl Fn() -> CancelReason) {
        let doomed: SmallVec<[Arc<FusionShared>; 2]> = {
            let mut entries = self.entries.lock();
            entries.retain(|e| e.fusion.status() == FusionStatus::Active);
            self.len.store(entries.len(), Ordering::Release);
            entries.iter().filter(|e| hit(e)).map(|e| e.fusion.clone()).collect()
        };
        for f in doomed {
            f.cancel(reason(), || {
                let _ = rt.send(Message::CancelFusion(f.clone()));
            });
        }
    }
}

/// Whether active fusion `from` depends, directly or through other active fusions,
/// on `to`.
fn depends_on(entries: &[Entry], from: &Arc<FusionShared>, to: &Arc<FusionShared>) -> bool {
    let mut stack: SmallVec<[Arc<FusionShared>; 4]> = smallvec::smallvec![from.clone()];
    let mut seen: SmallVec<[*const FusionShared; 4]> = SmallVec::new();
    while let Some(f) = stack.pop() {
        if Arc::ptr_eq(&f, to) {
            return true;
        }
        if seen.contains(&Arc::as_ptr(&f)) || f.status() != FusionStatus::Active {
            continue;
        }
        seen.push(Arc::as_ptr(&f));
        if let Some(e) = entries.iter().find(|e| Arc::ptr_eq(&e.fusion, &f)) {
            stack.extend(e.deps.iter().cloned());
        }
    }
    false
}
