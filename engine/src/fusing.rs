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
//! no longer active (completed, cancelled) is never cancelled here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry_components::{
    ByteRange, CancelReason, EventShared, FusionShared, FusionStatus, Message, Requirement,
};
use gantry_driver::sync::Mutex;
use smallvec::SmallVec;

use crate::runtime::Shared;

/// An active fusion and what its listed kernels use: (buffer id, bytes, writes).
struct Entry {
    fusion: Arc<FusionShared>,
    uses: SmallVec<[(u64, ByteRange, bool); 8]>,
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
    /// Registers a fusion `start_fusion` began.
    pub(crate) fn start(&self, fusion: &Arc<FusionShared>) {
        let mut entries = self.entries.lock();
        entries.retain(|e| e.fusion.status() == FusionStatus::Active);
        entries.push(Entry { fusion: fusion.clone(), uses: SmallVec::new() });
        self.len.store(entries.len(), Ordering::Release);
    }

    /// Records the buffers of a kernel listed in `fusion`.
    pub(crate) fn listed(&self, fusion: &Arc<FusionShared>, requirements: &[Requirement]) {
        let mut entries = self.entries.lock();
        if let Some(e) = entries.iter_mut().find(|e| Arc::ptr_eq(&e.fusion, fusion)) {
            for r in requirements {
                let (id, writes) = (r.buffer.id, r.mode.writes());
                match e.uses.iter_mut().find(|u| u.0 == id && u.1 == r.range) {
                    Some(u) => u.2 |= writes,
                    None => e.uses.push((id, r.range, writes)),
                }
            }
        }
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
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let depends = |e: &Entry| {
            waits.iter().any(|w| Arc::ptr_eq(w, &e.fusion.event))
                || requirements.iter().any(|r| {
                    e.uses.iter().any(|&(id, range, writes)| {
                        id == r.buffer.id && range.overlaps(&r.range) && (writes || r.mode.writes())
                    })
                })
        };
        self.cancel_where(rt, depends, || CancelReason::Dependent { command: command.clone(), kind });
    }

    /// Cancels every active fusion whose kernels use buffer `id`, which was dropped.
    pub(crate) fn cancel_users_of(&self, rt: &Shared, id: u64) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let uses = |e: &Entry| e.uses.iter().any(|u| u.0 == id);
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
