//! Queues: where command groups are submitted.

use std::sync::{Arc, LazyLock, Weak};

use gantry_components::{
    warn_fusion, CancelReason, CommandDesc, CommandKind, EventShared, FusionOutcome, FusionProps,
    FusionShared, FusionStatus, Message, QueueCore, Work,
};
use gantry_driver::fusion::{FusionError, Promotion};
use gantry_driver::sync::{Mutex, MutexGuard};
use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::event::Event;
use crate::graph::{CommandGraph, ExecutableGraph, GraphShared};
use crate::handler::{Built, Handler};
use crate::passing::PassedKernels;
use crate::runtime::{DeviceId, Shared};
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// The queue's latest fusion, and the kernels it passed through.
    fusion: Mutex<FusionSlot>,
    /// The graph this queue records into, if any (checked first through `recording`).
    /// Weak: a recording ends when the user drops the graph.
    graph: Mutex<Option<Weak<GraphShared>>>,
    recording: AtomicBool,
    /// The event of the latest graph submission: its last partition may finish after
    /// a barrier submitted behind it, which `wait` must not return before.
    last_graph: Mutex<Option<Event>>,
}

/// A queue's latest fusion (the DPC++ kernel-fusion design: kept until the next
/// `start_fusion`, so a late `complete_fusion` still finds its event), and, where it
/// passes its kernels through, those kernels.
#[derive(Default)]
struct FusionSlot {
    current: Option<Arc<FusionShared>>,
    passed: PassedKernels,
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
        let handle = QueueHandle {
            core,
            rt,
            fusion: Mutex::new(FusionSlot::default()),
            graph: Mutex::new(None),
            recording: AtomicBool::new(false),
            last_graph: Mutex::new(None),
        };
        Self { handle: Arc::new(handle) }
    }

    /// Identifies the queue in errors.
    pub fn id(&self) -> u64 {
        self.handle.core.id
    }

    /// The graph this queue records into. A graph dropped meanwhile ends the
    /// recording.
    fn recording_graph(&self) -> Option<CommandGraph> {
        if !self.handle.recording.load(Ordering::Acquire) {
            return None;
        }
        let mut slot = self.handle.graph.lock();
        match slot.as_ref().and_then(Weak::upgrade) {
            Some(inner) => Some(CommandGraph { inner }),
            None => {
                *slot = None;
                self.handle.recording.store(false, Ordering::Release);
                None
            }
        }
    }

    /// Whether the queue records into a graph (a recording ends with its graph).
    pub fn is_recording(&self) -> bool {
        self.recording_graph().is_some()
    }

    /// The runtime the queue belongs to.
    pub(crate) fn runtime_id(&self) -> u64 {
        self.handle.rt.id
    }

    /// A lost device takes no new work.
    fn check_device(&self) -> Result<()> {
        let rt = &self.handle.rt;
        if rt.lost[self.device() as usize].load(Ordering::Acquire) {
            let device = &rt.devices[self.device() as usize];
            return Err(Error::Exec(gantry_driver::ExecError::DeviceLost { device: device.name.clone() }));
        }
        Ok(())
    }

    pub(crate) fn start_recording(&self, graph: &CommandGraph) -> Result<()> {
        if self.recording_graph().is_some() {
            return Err(Error::AlreadyRecording(self.id()));
        }
        let mut slot = self.handle.graph.lock();
        if self.active_fusion().is_some() {
            return Err(Error::AlreadyFusing(self.id()));
        }
        *slot = Some(Arc::downgrade(&graph.inner));
        self.handle.recording.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn stop_recording(&self, graph: &CommandGraph) -> Option<()> {
        let mut slot = self.handle.graph.lock();
        if !slot.as_ref().is_some_and(|g| std::ptr::eq(g.as_ptr(), Arc::as_ptr(&graph.inner))) {
            return None;
        }
        *slot = None;
        self.handle.recording.store(false, Ordering::Release);
        Some(())
    }

    /// Submits one execution of `graph` and returns its event, which completes when
    /// every partition has (and fails if one did). Submissions of one executable graph
    /// run one after another; its partitions' buffer ranges are resolved against
    /// earlier and later work like any command's.
    ///
    /// ```
    /// use gantry::{GraphProps, Runtime};
    /// let rt = Runtime::new();
    /// let counter = rt.buffer(&[0u64]);
    /// let graph = rt.graph();
    /// graph.add(|cg| {
    ///     let c = cg.read_write(&counter);
    ///     cg.single_task(move |it| c.set(it, 0, c.get(it, 0) + 1));
    /// }, &[])?;
    /// let exec = graph.finalize(GraphProps::default())?;
    /// let q = rt.queue();
    /// for _ in 0..100 {
    ///     q.submit_graph(&exec)?;
    /// }
    /// q.wait()?;
    /// assert_eq!(counter.to_vec()?, vec![100]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn submit_graph(&self, graph: &ExecutableGraph) -> Result<Event> {
        if graph.runtime_id() != self.handle.rt.id {
            return Err(Error::ForeignObject("an executable graph"));
        }
        self.check_device()?;
        if let Some(g) = self.recording_graph() {
            let node = g.add_graph_recorded(graph, &self.handle.core)?;
            return Ok(node);
        }
        let event = graph.submit(&self.handle.core)?;
        *self.handle.last_graph.lock() = Some(event.clone());
        Ok(event)
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
        let recording = self.recording_graph();
        let mut cg = match &recording {
            Some(g) => Handler::for_graph(rt.id, crate::handler::next_tag(), g.id()),
            None => Handler::new(rt.id, crate::handler::next_tag()),
        };
        cg.queue = Some(self.id());
        build(&mut cg);
        self.check_device()?;
        let mut built = cg.finish(&rt.devices[self.device() as usize])?;
        if let Some(graph) = recording {
            return graph.record(&self.handle.core, built);
        }
        let on_host = built.kind == CommandKind::HostTask;
        // A kernel of a window that passes its kernels through: its fusion, and what it
        // uses, for the window's event.
        let mut passing = None;
        let slot = (built.kind == CommandKind::Kernel).then(|| self.handle.fusion.lock());
        if let Some(fusion) = slot.as_ref().and_then(|s| s.current.as_ref()) {
            let mut status = fusion.status();
            if status == FusionStatus::Active && fusion.sent() == 0 {
                status = self.judge_window(fusion, &built);
            }
            if status == FusionStatus::PassingThrough {
                let uses = PassedKernels::uses(&built.requirements, self.handle.core.in_order);
                passing = Some((fusion.clone(), uses));
            } else if status == FusionStatus::Active {
                // Sent under the fusion's lock, so the scheduler counts it in the list;
                // if the fusion was cancelled meanwhile, it is submitted as an ordinary
                // kernel. `submit` returns the fusion's event, which the kernel carries
                // while listed: the scheduler gives it one of its own only if it runs
                // unfused (nobody sees that one; a fused kernel never needs it).
                let sent = fusion.send_kernel(built, |b| {
                    let cycles = rt.fusing.listed(fusion, &b.requirements);
                    let (fusion, event) = (Some(fusion.clone()), fusion.event.clone());
                    (self.send(b.kind, b.name, b.work, b.requirements, b.waits, false, fusion, event), cycles)
                });
                match sent {
                    Ok((sent, cycles)) => {
                        rt.fusing.cancel_cycles(rt, fusion, cycles);
                        return sent.map(|()| Event::of_fusion(fusion.clone(), rt));
                    }
                    Err(b) => built = b,
                }
            }
        }
        drop(slot);
        // A command that depends on a listed kernel cancels its fusion now, not when
        // the scheduler sees it: by queue order, or by a buffer or an event.
        if rt.fusing.any() {
            if self.handle.core.in_order {
                self.cancel_for_dependent(&built.name, built.kind);
            }
            rt.fusing.cancel_dependencies(
                rt,
                &built.requirements,
                &built.waits,
                &built.name,
                built.kind.name(),
            );
        }
        let event = self.new_event(&built.name);
        if let Some((slot, storage)) = built.readback {
            *slot.lock() = Some((storage, event.clone()));
        }
        let (kind, name, work, reqs, waits) =
            (built.kind, built.name, built.work, built.requirements, built.waits);
        self.send(kind, name, work, reqs, waits, on_host, None, event.clone())?;
        if let Some((fusion, uses)) = passing {
            let mut slot = self.handle.fusion.lock();
            if slot.current.as_ref().is_some_and(|f| Arc::ptr_eq(f, &fusion)) {
                slot.passed.push(event.clone(), uses, self.handle.core.in_order);
            }
        }
        Ok(Event::of_command(event, rt))
    }

    /// At a window's first kernel: if fusing the window would not pay on the queue's
    /// device ([`WindowThresholds`](gantry_driver::fusion::WindowThresholds), unless
    /// the runtime fuses unprofitable chains), the fusion passes its kernels through,
    /// this one first, and says why. Returns the fusion's status after.
    fn judge_window(&self, fusion: &Arc<FusionShared>, built: &Built) -> FusionStatus {
        let rt = &self.handle.rt;
        let Work::Kernel { geometry, .. } = &built.work else { return fusion.status() };
        let (mut global_bytes, mut promotes) = (0u64, false);
        for r in &built.requirements {
            match r.promotion {
                Promotion::None => global_bytes += r.range.len() as u64,
                _ => promotes = true,
            }
        }
        let items = geometry.global_size() as u64;
        let Some(reason) = rt.fusion_windows[self.device() as usize].judge(items, global_bytes, promotes)
        else {
            return fusion.status();
        };
        let error = FusionError::Unprofitable { kernel: built.name.to_string(), reason };
        if fusion.pass_through(FusionOutcome::Cancelled(CancelReason::Failed(error))) {
            let (id, kernel) = (self.id(), &built.name);
            warn_fusion(
                &rt.fusion_warnings,
                format_args!("fusion on queue {id}: not fused: `{kernel}` {reason}; its kernels run unfused"),
            );
        }
        fusion.status()
    }

    fn active_fusion(&self) -> Option<Arc<FusionShared>> {
        // Every kernel submit asks: clone the handle only when the fusion is open.
        self.handle.fusion.lock().current.as_ref().filter(|f| f.status().is_open()).cloned()
    }

    /// Puts the queue in fusion mode (the DPC++ kernel-fusion design): kernels
    /// submitted from now on are collected, not run, and `submit` returns the fusion's
    /// event, which completes after them. Other commands (copies, fills, host tasks,
    /// barriers) are not fused; if one depends on a collected kernel, the fusion is
    /// cancelled early. Where fusing would not pay on the device (on the CPU, a
    /// launch-bound first kernel), the window runs its kernels as they are submitted
    /// instead, and [`Queue::fusion_outcome`] says why.
    ///
    /// ```
    /// use gantry::{FusionOutcome, FusionProps, Promotion, Runtime};
    /// let rt = Runtime::new();
    /// let q = rt.queue();
    /// let n = 1 << 16;
    /// let input = rt.buffer(&vec![1.0f32; n]);
    /// let (tmp, out) = (rt.buffer_zeroed::<f32>(n), rt.buffer_zeroed::<f32>(n));
    /// q.start_fusion()?;
    /// q.submit(|cg| {
    ///     let (a, t) = (cg.read(&input), cg.elements_out(&tmp));
    ///     cg.promote(&t, Promotion::Private); // only the fused kernel needs it
    ///     cg.map(&a, &t, |x: f32| x * 2.0);
    /// })?;
    /// q.submit(|cg| {
    ///     let (t, o) = (cg.read(&tmp), cg.elements_out(&out));
    ///     cg.promote(&t, Promotion::Private);
    ///     cg.map(&t, &o, |x: f32| x + 1.0);
    /// })?;
    /// q.complete_fusion(FusionProps::default())?.wait()?;
    /// assert!(matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })));
    /// assert!(out.to_vec()?.iter().all(|&x| x == 3.0));
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn start_fusion(&self) -> Result<()> {
        if self.is_recording() {
            return Err(Error::QueueRecording(self.id()));
        }
        let mut slot = self.handle.fusion.lock();
        if slot.current.as_ref().is_some_and(|f| f.status().is_open()) {
            return Err(Error::AlreadyFusing(self.handle.core.id));
        }
        let rt = &self.handle.rt;
        slot.passed.clear();
        // No message: the scheduler starts the list at the first one about it.
        let stamp = rt.clock.stamp_ns();
        if !slot.current.as_mut().is_some_and(|f| FusionShared::renew(f, stamp)) {
            // Every fusion's event shares one name (a fusion is one allocation fewer).
            static NAME: LazyLock<Arc<str>> = LazyLock::new(|| CommandKind::Fusion.name().into());
            let event = Arc::new(EventShared::new(NAME.clone(), rt.id, stamp));
            slot.current = Some(Arc::new(FusionShared::new(self.handle.core.clone(), event)));
        }
        Ok(())
    }

    /// Whether the queue is in fusion mode: between `start_fusion` and
    /// `complete_fusion`, unless the fusion was cancelled (early, or by
    /// `cancel_fusion`). A window whose kernels would not pay to fuse on the device is
    /// in fusion mode too, but runs its kernels as they are submitted
    /// ([`Queue::fusion_outcome`] says why from its first kernel on).
    pub fn is_in_fusion_mode(&self) -> bool {
        self.active_fusion().is_some()
    }

    /// Ends fusion mode; the collected kernels run unfused, in order. Warns if the
    /// queue is not in fusion mode.
    pub fn cancel_fusion(&self) {
        match self.active_fusion() {
            Some(f) => self.cancel(&f, CancelReason::Requested),
            None => self.warn_not_fusing("cancel_fusion"),
        }
    }

    /// Cancels the queue's fusion for a command that follows its listed kernels in
    /// queue order (on an in-order queue, or a barrier).
    fn cancel_for_dependent(&self, name: &Arc<str>, kind: CommandKind) {
        if let Some(f) = self.active_fusion().filter(|f| f.sent() > 0) {
            self.cancel(&f, CancelReason::Dependent { command: name.clone(), kind: kind.name() });
        }
    }

    fn cancel(&self, f: &Arc<FusionShared>, reason: CancelReason) {
        // A window that passes its kernels through has nothing to cancel: it ends, and
        // keeps the reason it passed them through.
        if f.end_passing(FusionStatus::Cancelled) {
            return;
        }
        let rt = &self.handle.rt;
        f.cancel(reason, || {
            let _ = rt.send(Message::CancelFusion(f.clone()));
        });
    }

    fn warn_not_fusing(&self, what: &str) {
        let id = self.handle.core.id;
        let why = match self.fusion_outcome() {
            Some(FusionOutcome::Cancelled(reason)) => format!(" (its fusion was cancelled: {reason})"),
            _ => String::new(),
        };
        warn_fusion(
            &self.handle.rt.fusion_warnings,
            format_args!("{what} on queue {id}, which is not in fusion mode{why}"),
        );
    }

    /// Ends fusion mode by fusing the collected kernels into one (in order, with a
    /// work-group barrier between them unless `props.barriers` is off) and returns the
    /// event of the fusion, which completes after the fused kernel. If the kernels
    /// cannot be fused, they run unfused (with a warning); if the fusion was cancelled
    /// early, this warns and returns that fusion's event, which completes after its
    /// kernels.
    pub fn complete_fusion(&self, props: FusionProps) -> Result<Event> {
        let rt = &self.handle.rt;
        let slot = self.handle.fusion.lock();
        let fusion = slot.current.clone().ok_or(Error::NotFusing(self.handle.core.id))?;
        if fusion.end_passing(FusionStatus::Completed) {
            return self.passed_event(slot, &fusion);
        }
        match fusion.complete(|| rt.send(Message::CompleteFusion(fusion.clone(), props))) {
            Some(sent) => {
                drop(slot);
                sent?;
                Ok(Event::of_fusion(fusion, rt))
            }
            // Cancelled: early, or after it passed its kernels through.
            None => {
                let event = self.passed_event(slot, &fusion)?;
                self.warn_not_fusing("complete_fusion");
                Ok(event)
            }
        }
    }

    /// The event of a window that passed its kernels through: one that completes after
    /// all of them ([`PassedKernels`]), or, where it passed none, the fusion's own,
    /// which is complete. Unlocks the slot before it sends anything.
    fn passed_event(&self, slot: MutexGuard<'_, FusionSlot>, fusion: &Arc<FusionShared>) -> Result<Event> {
        let rt = &self.handle.rt;
        let mut sinks = slot.passed.sinks();
        if sinks.len() < 2 {
            return Ok(match sinks.pop() {
                Some(sink) => Event::of_command(sink, rt),
                None => Event::of_fusion(fusion.clone(), rt),
            });
        }
        drop(slot);
        let name = fusion.event.name.clone();
        let marker = self.new_event(&name);
        let waits = sinks.into_iter().collect();
        self.send(
            CommandKind::Marker,
            name,
            Work::Marker,
            SmallVec::new(),
            waits,
            false,
            None,
            marker.clone(),
        )?;
        let mut slot = self.handle.fusion.lock();
        if slot.current.as_ref().is_some_and(|f| Arc::ptr_eq(f, fusion)) {
            slot.passed.join(marker.clone());
        }
        Ok(Event::of_command(marker, rt))
    }

    /// How the queue's latest fusion ended: fused (with the compiler's warnings) or
    /// cancelled (with the reason); `None` while it is active or undecided. A window
    /// whose kernels would not pay to fuse says so from its first kernel on
    /// (`Cancelled(Failed(FusionError::Unprofitable { .. }))`, with a
    /// [`LaunchBound`](crate::Unprofitable::LaunchBound) or
    /// [`CacheResident`](crate::Unprofitable::CacheResident) reason).
    ///
    /// ```
    /// use gantry::{CancelReason, FusionError, FusionOutcome, FusionProps, Runtime, Unprofitable};
    /// let rt = Runtime::new();
    /// let q = rt.queue();
    /// let buf = rt.buffer(&[1u32; 64]);
    /// q.start_fusion()?;
    /// for _ in 0..3 {
    ///     q.submit(|cg| {
    ///         let b = cg.elements_mut(&buf);
    ///         cg.parallel_for(64, move |it| *b.elem(it) *= 2);
    ///     })?;
    /// }
    /// q.complete_fusion(FusionProps::default())?.wait()?;
    /// assert_eq!(buf.to_vec()?, vec![8; 64]);
    /// // 64 work-items: on the CPU, the window costs more than fusing would save.
    /// let Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable { reason, .. }))) =
    ///     q.fusion_outcome()
    /// else {
    ///     panic!("fused")
    /// };
    /// assert!(matches!(reason, Unprofitable::LaunchBound { items: 64, .. }));
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn fusion_outcome(&self) -> Option<FusionOutcome> {
        self.handle.fusion.lock().current.as_ref().and_then(|f| f.outcome())
    }

    /// Submits a barrier: an event that completes when everything submitted to this
    /// queue before it has (and fails if one of those failed).
    pub fn barrier(&self) -> Result<Event> {
        if let Some(graph) = self.recording_graph() {
            return graph.record_barrier(&self.handle.core);
        }
        let name: Arc<str> = "barrier".into();
        if self.handle.rt.fusing.any() {
            self.cancel_for_dependent(&name, CommandKind::Barrier);
        }
        let event = self.new_event(&name);
        let (kind, work) = (CommandKind::Barrier, Work::Marker);
        self.send(kind, name, work, SmallVec::new(), SmallVec::new(), false, None, event.clone())?;
        Ok(Event::of_command(event, &self.handle.rt))
    }

    /// Blocks until everything submitted to this queue so far has finished; returns
    /// the first error among them, if any. When it returns, every event its submits
    /// returned has its final status (the events of a fusion it cancelled, of a
    /// fusion completed before it, of graph submissions).
    pub fn wait(&self) -> Result<()> {
        if self.is_recording() {
            return Err(Error::QueueRecording(self.id()));
        }
        let rt = &self.handle.rt;
        if crate::task_scope::current().is_some_and(|s| s.runtime == rt.id && s.queue == Some(self.id())) {
            return Err(Error::SelfDeadlock(format!(
                "a host task of queue {} waits on that queue, which waits for the task",
                self.id()
            )));
        }
        if let Some(f) = self.active_fusion() {
            self.cancel(&f, CancelReason::QueueWait);
        }
        let result = self.barrier()?.wait();
        // A fusion's event completes after its fused kernel, or after the marker a
        // cancelled list spawns; a graph submission's after its last partition. The
        // barrier orders the commands themselves (and reports their errors) but may
        // finish before those events do. A stopped runtime is the one error here.
        let fusion = self.handle.fusion.lock().current.clone().filter(|f| !f.event.status().is_final());
        if let Some(f) = fusion {
            rt.wait_for(&f.event, gantry_components::EventStatus::Complete)?;
        }
        let graph = self.handle.last_graph.lock().take();
        if let Some(e) = graph.filter(|e| !e.status().is_final()) {
            rt.wait_for(e.shared(), gantry_components::EventStatus::Complete)?;
        }
        result
    }

    /// The event of a new command named `name`.
    fn new_event(&self, name: &Arc<str>) -> Arc<EventShared> {
        let rt = &self.handle.rt;
        gantry_components::event_pool::new_event(name.clone(), rt.id, rt.clock.stamp_ns())
    }

    /// Sends a command, whose event is `event`, to the scheduler.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        kind: CommandKind,
        name: Arc<str>,
        work: Work,
        requirements: gantry_components::RequirementList,
        waits: SmallVec<[Arc<EventShared>; 1]>,
        on_host: bool,
        fusion: Option<Arc<FusionShared>>,
        event: Arc<EventShared>,
    ) -> Result<()> {
        let rt = &self.handle.rt;
        let device = if on_host { rt.host_task_device(self.device()) } else { self.device() };
        rt.send(Message::Submit(CommandDesc {
            kind,
            name,
            queue: self.handle.core.clone(),
            device,
            requirements,
            work,
            waits,
            event,
            fusion,
        }))
    }
}
