//! Events: handles to a submitted command's completion.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Weak};

use gantry_components::{
    CancelReason, EventShared, EventStatus, FusionShared, FusionStatus, Message, Timestamps,
};
use gantry_driver::ExecError;

use crate::error::{Error, Result};
use crate::runtime::Shared;

/// A submitted command's completion: wait for it, poll its status, read its error and
/// (where the runtime profiles) its timestamps. Cheap to clone.
///
/// ```
/// # use gantry::{Runtime, EventStatus};
/// let rt = Runtime::builder().profiling(true).build();
/// let q = rt.queue();
/// let buf = rt.buffer(&[1u32, 2, 3]);
/// let ev = q.submit(|cg| {
///     let b = cg.read_write(&buf);
///     cg.parallel_for(3, move |it| b.set(it, it.global_linear_id(), b.get(it, it.global_linear_id()) * 10));
/// })?;
/// ev.wait()?;
/// assert_eq!(ev.status(), EventStatus::Complete);
/// let t = ev.timestamps()?;
/// assert!(t.ended_ns >= t.started_ns);
/// assert_eq!(buf.to_vec()?, vec![10, 20, 30]);
/// # Ok::<(), gantry::Error>(())
/// ```
#[derive(Clone)]
pub struct Event {
    source: Source,
    rt: Weak<Shared>,
    /// Set for the event of a command recorded into a graph: it never runs by itself.
    pub(crate) node: Option<crate::graph::Node>,
    /// Whether its runtime records timestamps.
    profiled: bool,
}

/// Whose completion an [`Event`] stands for.
#[derive(Clone)]
enum Source {
    /// Dropped by [`Event`]'s `Drop`, which gives a last reference back to the
    /// thread's event pool.
    Command(ManuallyDrop<Arc<EventShared>>),
    /// A fusion, whose event is its fusion command's (`FusionShared::event`): waiting
    /// on it while the fusion is collecting kernels cancels the fusion (the DPC++
    /// kernel-fusion design). Held once, not next to a clone of its event: a fused
    /// round hands out an event per submit, and each shared count taken and dropped is
    /// two locked operations.
    Fusion(Arc<FusionShared>),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("name", &self.shared().name).field("status", &self.status()).finish()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Source::Command(e) = &mut self.source {
            // SAFETY: dropped once, here; the field is not used after.
            let e = unsafe { ManuallyDrop::take(e) };
            gantry_components::event_pool::recycle(e);
        }
    }
}

impl Event {
    /// The event of a command.
    pub(crate) fn of_command(shared: Arc<EventShared>, rt: &Arc<Shared>) -> Self {
        Self {
            source: Source::Command(ManuallyDrop::new(shared)),
            rt: Arc::downgrade(rt),
            node: None,
            profiled: rt.clock.profiling,
        }
    }

    /// The event of a command recorded into a graph as `node`.
    pub(crate) fn of_node(shared: Arc<EventShared>, rt: &Arc<Shared>, node: crate::graph::Node) -> Self {
        Self {
            source: Source::Command(ManuallyDrop::new(shared)),
            rt: Arc::downgrade(rt),
            node: Some(node),
            profiled: rt.clock.profiling,
        }
    }

    /// The event of a fusion.
    pub(crate) fn of_fusion(fusion: Arc<FusionShared>, rt: &Arc<Shared>) -> Self {
        Self {
            source: Source::Fusion(fusion),
            rt: Arc::downgrade(rt),
            node: None,
            profiled: rt.clock.profiling,
        }
    }

    /// The state the scheduler completes.
    pub(crate) fn shared(&self) -> &Arc<EventShared> {
        match &self.source {
            Source::Command(e) => e,
            Source::Fusion(f) => &f.event,
        }
    }

    /// Blocks until the command has finished. Returns its error, or that of a command
    /// it depended on, if it failed. In manual mode the calling thread runs the
    /// scheduler until then.
    ///
    /// Waiting on an event returned while its queue is fusing cancels the fusion: the
    /// collected kernels run unfused. Waiting on the event of a command recorded into
    /// a graph is an error ([`Error::RecordedEvent`]): it runs with the graph.
    pub fn wait(&self) -> Result<()> {
        if self.node.is_some() {
            return Err(Error::RecordedEvent(self.name().to_string()));
        }
        if let Source::Fusion(f) = &self.source {
            if f.status() == FusionStatus::Active {
                if let Some(rt) = self.rt.upgrade() {
                    f.cancel(CancelReason::HostWait, || {
                        let _ = rt.send(Message::CancelFusion(f.clone()));
                    });
                }
            }
        }
        match self.rt.upgrade() {
            // (A synchronization point even when already final.)
            Some(rt) => rt.wait_for(self.shared(), EventStatus::Complete)?,
            None if !self.status().is_final() => return Err(Error::RuntimeDropped),
            None => {}
        }
        self.result()
    }

    /// The outcome if finished: `Ok` on success, the error on failure; `None` while
    /// pending.
    pub fn try_result(&self) -> Option<Result<()>> {
        self.status().is_final().then(|| self.result())
    }

    fn result(&self) -> Result<()> {
        match self.shared().error() {
            Some(e) => Err(Error::Exec(e.clone())),
            None => Ok(()),
        }
    }

    /// Current status, without blocking.
    pub fn status(&self) -> EventStatus {
        self.shared().status()
    }

    /// Whether it finished successfully.
    pub fn is_complete(&self) -> bool {
        self.status() == EventStatus::Complete
    }

    /// The execution error, once failed.
    pub fn error(&self) -> Option<ExecError> {
        self.shared().error().cloned()
    }

    /// When the command was submitted, started and ended, in nanoseconds (each zero
    /// until known): submission on the runtime's clock ([`Runtime::now_ns`]), start
    /// and end on the device's (real time, or a simulated device's virtual time).
    /// [`Error::ProfilingDisabled`] unless the runtime records them
    /// ([`RuntimeBuilder::profiling`](crate::RuntimeBuilder::profiling)).
    ///
    /// [`Runtime::now_ns`]: crate::Runtime::now_ns
    pub fn timestamps(&self) -> Result<Timestamps> {
        match self.profiled {
            true => Ok(self.shared().timestamps()),
            false => Err(Error::ProfilingDisabled),
        }
    }

    /// The graph node this event's command was recorded as (while a queue records
    /// into a graph), for [`CommandGraph::set_arg`](crate::CommandGraph::set_arg) and
    /// [`CommandGraph::make_edge`](crate::CommandGraph::make_edge).
    pub fn node(&self) -> Option<crate::Node> {
        self.node
    }

    /// The command's name.
    pub fn name(&self) -> &str {
        &self.shared().name
    }
}
