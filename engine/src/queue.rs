//! Queues: where command groups are submitted.

use std::sync::Arc;

use gantry_components::{CommandDesc, CommandKind, EventShared, Message, QueueCore, Work};
use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::event::Event;
use crate::handler::Handler;
use crate::runtime::{DeviceId, Shared};

/// How to make a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueOptions {
    /// The device its commands run on.
    pub device: DeviceId,
    /// Each command depends on the previous one.
    pub in_order: bool,
}

struct QueueHandle {
    core: Arc<QueueCore>,
    rt: Arc<Shared>,
}

impl Drop for QueueHandle {
    fn drop(&mut self) {
        let _ = self.rt.send(Message::DropQueue(self.core.clone()));
    }
}

/// Submits command groups to one device. Out-of-order by default: commands run as
/// soon as the buffers they use and the events they name allow. Clones share the
/// queue.
///
/// ```
/// let rt = gantry::Runtime::new();
/// let q = rt.in_order_queue();
/// let buf = rt.buffer_zeroed::<u32>(8);
/// q.submit(|cg| cg.fill(&buf, 7))?;
/// q.submit(|cg| {
///     let b = cg.elements_mut(&buf);
///     cg.parallel_for(8, move |it| *b.elem(it) += 1);
/// })?;
/// q.wait()?;
/// assert_eq!(buf.to_vec()?, vec![8; 8]);
/// # Ok::<(), gantry::Error>(())
/// ```
#[derive(Clone)]
pub struct Queue {
    handle: Arc<QueueHandle>,
}

impl Queue {
    pub(crate) fn new(core: Arc<QueueCore>, rt: Arc<Shared>) -> Self {
        Self { handle: Arc::new(QueueHandle { core, rt }) }
    }

    /// The device its commands run on.
    pub fn device(&self) -> DeviceId {
        self.handle.core.device
    }

    /// Whether each command depends on the previous one.
    pub fn is_in_order(&self) -> bool {
        self.handle.core.in_order
    }

    /// Builds a command group with `build` and submits it. Returns its event at once;
    /// the command runs asynchronously. Bad input is returned here and nothing runs.
    pub fn submit(&self, build: impl FnOnce(&mut Handler)) -> Result<Event> {
        let rt = &self.handle.rt;
        let mut cg = Handler::new(rt.id, rt.next_id());
        build(&mut cg);
        let device = &rt.devices[self.device() as usize];
        if rt.lost[self.device() as usize].load(std::sync::atomic::Ordering::Acquire) {
            return Err(Error::Exec(gantry_driver::ExecError::DeviceLost { device: device.name.clone() }));
        }
        let built = cg.finish(device)?;
        let on_host = built.kind == CommandKind::HostTask;
        self.send(built.kind, built.name, built.work, built.requirements, built.waits, on_host, |event| {
            if let Some((slot, storage)) = built.readback {
                *slot.lock() = Some((storage, event.clone()));
            }
        })
    }

    /// Submits a barrier: an event that completes when everything submitted to this
    /// queue before it has (and fails if one of those failed).
    pub fn barrier(&self) -> Result<Event> {
        self.send(
            CommandKind::Barrier,
            "barrier".into(),
            Work::Marker,
            SmallVec::new(),
            SmallVec::new(),
            false,
            |_| {},
        )
    }

    /// Blocks until everything submitted to this queue so far has finished; returns
    /// the first error among them, if any.
    pub fn wait(&self) -> Result<()> {
        self.barrier()?.wait()
    }

    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        kind: CommandKind,
        name: Arc<str>,
        work: Work,
        requirements: SmallVec<[gantry_components::Requirement; 4]>,
        waits: SmallVec<[Arc<EventShared>; 1]>,
        on_host: bool,
        with_event: impl FnOnce(&Arc<EventShared>),
    ) -> Result<Event> {
        let rt = &self.handle.rt;
        let event = Arc::new(EventShared::new(name.clone(), rt.id, rt.now_ns()));
        with_event(&event);
        // Host tasks run on the host device whatever the queue's device.
        let device = if on_host { 0 } else { self.device() };
        rt.send(Message::Submit(CommandDesc {
            kind,
            name,
            queue: self.handle.core.clone(),
            device,
            requirements,
            waits,
            work,
            event: event.clone(),
        }))
        .map_err(|_| Error::RuntimeDropped)?;
        Ok(Event { shared: event, rt: Arc::downgrade(rt) })
    }
}
