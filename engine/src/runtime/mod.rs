//! The runtime: devices, the scheduler's world and schedule, and the thread (or the
//! caller, in manual mode) that runs it. `builder` makes one, `scheduler` runs its
//! flushes (the scheduler thread, waits, back-pressure, failure), and this module is
//! the public API.

mod builder;
mod scheduler;

pub use builder::{Mode, RuntimeBuilder};
pub(crate) use scheduler::Shared;

use std::sync::Arc;

use bevy_ecs::schedule::IntoScheduleConfigs;
use bevy_ecs::system::ScheduleSystem;
use bevy_ecs::world::World;
use bytemuck::Pod;
use gantry_components::{BufferCore, QueueCore, Stage, Stats, Timeline};
use gantry_driver::sync::thread::JoinHandle;
use gantry_driver::{DeviceInfo, HostStorage};
use gantry_host::CacheStats;

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::queue::{Queue, QueueOptions};

/// Index of a device: 0 is the CPU (host), further devices follow in the order the
/// builder added them.
pub type DeviceId = u32;

/// A Gantry runtime: its devices, queues and buffers, and the scheduler that runs
/// their commands.
///
/// Dropping it finishes all submitted work that can finish (anything blocked behind
/// a host access the user still holds fails with [`Error::RuntimeDropped`]), then
/// stops the drivers. Handles that outlive it report `RuntimeDropped`.
///
/// ```
/// use gantry::Runtime;
/// let rt = Runtime::new();
/// let q = rt.queue();
/// let data = rt.buffer(&vec![1.0f32; 1024]);
/// q.submit(|cg| {
///     let d = cg.read_write(&data);
///     cg.parallel_for(1024, move |it| {
///         let i = it.global_linear_id();
///         d.set(it, i, d.get(it, i) * 2.0);
///     });
/// })?;
/// assert!(data.to_vec()?.iter().all(|&x| x == 2.0));
/// # Ok::<(), gantry::Error>(())
/// ```
pub struct Runtime {
    pub(crate) shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    pub(crate) default_device: DeviceId,
    pub(crate) host_queue: Arc<QueueCore>,
}

impl Default for Runtime {
    fn default() -> Self {
        Self::new()
    }
}

impl Runtime {
    /// A threaded runtime with the CPU device.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The mode it runs in.
    pub fn mode(&self) -> Mode {
        self.shared.mode
    }

    /// The devices, indexed by [`DeviceId`].
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.shared.devices
    }

    /// An out-of-order queue on the default device.
    pub fn queue(&self) -> Queue {
        self.queue_with(QueueOptions { device: self.default_device, in_order: false })
            .expect("the default device exists")
    }

    /// An in-order queue on the default device: each command depends on the previous.
    pub fn in_order_queue(&self) -> Queue {
        self.queue_with(QueueOptions { device: self.default_device, in_order: true })
            .expect("the default device exists")
    }

    /// A queue with explicit options.
    pub fn queue_with(&self, options: QueueOptions) -> Result<Queue> {
        if options.device as usize >= self.shared.devices.len() {
            return Err(Error::UnknownDevice(options.device));
        }
        let core = Arc::new(QueueCore {
            id: self.shared.next_id(),
            device: options.device,
            in_order: options.in_order,
            entity: Default::default(),
        });
        Ok(Queue::new(core, self.shared.clone()))
    }

    /// A buffer holding a copy of `data`.
    ///
    /// # Panics
    /// If the host cannot allocate its memory ([`Runtime::try_buffer`] returns the
    /// error instead).
    pub fn buffer<T: Pod>(&self, data: &[T]) -> Buffer<T> {
        self.try_buffer(data).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A buffer holding a copy of `data`, or [`Error::OutOfHostMemory`].
    pub fn try_buffer<T: Pod>(&self, data: &[T]) -> Result<Buffer<T>> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let storage =
            HostStorage::try_zeroed(bytes.len()).ok_or(Error::OutOfHostMemory { bytes: bytes.len() })?;
        // SAFETY: at least `bytes.len()` fresh bytes, not yet shared.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), storage.as_ptr(), bytes.len()) };
        Ok(self.make_buffer(storage, data.len()))
    }

    /// A zero-filled buffer of `len` elements.
    ///
    /// # Panics
    /// If its size overflows or the host cannot allocate it
    /// ([`Runtime::try_buffer_zeroed`] returns the error instead).
    pub fn buffer_zeroed<T: Pod>(&self, len: usize) -> Buffer<T> {
        self.try_buffer_zeroed(len).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A zero-filled buffer of `len` elements, or a typed error: its byte size
    /// overflows ([`Error::SizeOverflow`]) or the host cannot allocate it
    /// ([`Error::OutOfHostMemory`]). Never aborts the process.
    ///
    /// ```
    /// let rt = gantry::Runtime::new();
    /// assert!(matches!(rt.try_buffer_zeroed::<u64>(usize::MAX / 2), Err(gantry::Error::SizeOverflow { .. })));
    /// assert_eq!(rt.try_buffer_zeroed::<u64>(4)?.to_vec()?, vec![0; 4]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn try_buffer_zeroed<T: Pod>(&self, len: usize) -> Result<Buffer<T>> {
        let elem_size = std::mem::size_of::<T>();
        let overflow = Error::SizeOverflow { what: "buffer", count: len, elem_size };
        let bytes = len.checked_mul(elem_size).filter(|&b| b <= isize::MAX as usize).ok_or(overflow)?;
        let storage = HostStorage::try_zeroed(bytes).ok_or(Error::OutOfHostMemory { bytes })?;
        Ok(self.make_buffer(storage, len))
    }

    fn make_buffer<T: Pod>(&self, storage: HostStorage, len: usize) -> Buffer<T> {
        let core = Arc::new(BufferCore {
            id: self.shared.next_id(),
            bytes: storage.len(),
            storage: Arc::new(storage),
            record: Default::default(),
            dropped: Default::default(),
            promotion: Default::default(),
            recorded: Default::default(),
        });
        Buffer::new(core, len, self.shared.clone(), self.host_queue.clone())
    }

    /// Runs the scheduler's stages once (any mode). In manual mode this is how work
    /// makes progress; waits also flush.
    pub fn flush(&self) {
        let _ = self.shared.flush_once();
        self.shared.synced();
    }

    /// [`Runtime::flush`], reporting what went wrong in it: the first failure of a
    /// system added with [`Runtime::add_system`] (the flush went on without it; all of
    /// them stay in [`Runtime::take_system_errors`]), or
    /// [`Error::SchedulerFailed`] if the scheduler has stopped.
    ///
    /// ```
    /// use gantry::{Error, Mode, Runtime, Stage};
    /// let rt = Runtime::builder().mode(Mode::Manual).build();
    /// rt.add_system(Stage::Retire, || panic!("policy bug"));
    /// assert!(matches!(rt.try_flush(), Err(Error::SystemFailed { stage: Stage::Retire, .. })));
    /// // The runtime goes on.
    /// let buf = rt.buffer_zeroed::<u32>(2);
    /// rt.queue().submit(|cg| cg.fill(&buf, 1))?.wait()?;
    /// assert_eq!(buf.to_vec()?, vec![1, 1]);
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn try_flush(&self) -> Result<()> {
        let before = self.shared.system_errors.lock().len();
        if self.shared.flush_once().is_none() {
            return Err(self.shared.stopped());
        }
        self.shared.synced();
        match self.shared.system_errors.lock().get(before) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The failures of systems added with [`Runtime::add_system`] since the last
    /// call, oldest first (each also counted in [`Stats::system_failures`]).
    pub fn take_system_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.shared.system_errors.lock())
    }

    /// Why the scheduler stopped, if it failed ([`Error::SchedulerFailed`]): every
    /// command pending then failed, and the runtime takes no more work.
    pub fn failure(&self) -> Option<Error> {
        self.shared.failure.get().map(|m| Error::SchedulerFailed(m.clone()))
    }

    /// Flushes until no submitted command is waiting or running. Inside one of this
    /// runtime's host tasks it is [`Error::SelfDeadlock`]: the runtime is not idle
    /// until the task returns.
    pub fn wait_idle(&self) -> Result<()> {
        if crate::task_scope::inside(self.shared.id) {
            return Err(Error::SelfDeadlock("wait_idle inside a host task of the same runtime".into()));
        }
        self.shared.drive_until_idle()
    }

    /// Scheduler counters.
    pub fn stats(&self) -> Stats {
        self.with_world(|w| *w.resource::<Stats>())
    }

    /// Runs `f` on the scheduler's world (between flushes), for inspection and research.
    pub fn with_world<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        let mut guard = self.shared.core.lock();
        f(&mut guard.as_mut().expect("runtime is alive while its handle exists").world)
    }

    /// Adds a system to a stage of the flush schedule: a custom policy, a tracing or
    /// statistics system. It runs after the stage's built-in system, so it sees that
    /// stage's results (a system in [`Stage::Resolve`] sees the new edges). If it
    /// panics or returns an error, the flush goes on without it and the failure is
    /// reported ([`Runtime::try_flush`], [`Runtime::take_system_errors`]).
    ///
    /// # Panics
    /// If the system's own ordering constraints make the schedule invalid (a cycle).
    ///
    /// ```
    /// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
    /// use gantry::{Runtime, Mode, Stage};
    /// use gantry::ecs::prelude::*;
    ///
    /// let rt = Runtime::builder().mode(Mode::Manual).build();
    /// let flushes = Arc::new(AtomicUsize::new(0));
    /// let f = flushes.clone();
    /// rt.add_system(Stage::Retire, move || { f.fetch_add(1, Ordering::Relaxed); });
    /// rt.flush();
    /// assert_eq!(flushes.load(Ordering::Relaxed), 1);
    /// ```
    pub fn add_system<M>(&self, stage: Stage, system: impl IntoScheduleConfigs<ScheduleSystem, M>) {
        let mut guard = self.shared.core.lock();
        let core = guard.as_mut().expect("runtime is alive while its handle exists");
        if let Err(e) = core.stages.add_system(&mut core.world, stage, system) {
            panic!("system added to {stage:?} breaks the flush schedule: {e}");
        }
    }

    /// The commands finished so far, if the runtime records a timeline
    /// ([`RuntimeBuilder::timeline`]).
    pub fn timeline(&self) -> Option<Timeline> {
        self.with_world(|w| w.get_resource::<Timeline>().cloned())
    }

    /// The recorded timeline as Chrome trace JSON (open it in Perfetto or
    /// `chrome://tracing`): a process per device, a track per driver thread or engine,
    /// a slice per command and a flow arrow per dependency edge. `None` if the
    /// runtime records no timeline.
    ///
    /// ```
    /// let rt = gantry::Runtime::builder().timeline(true).build();
    /// let buf = rt.buffer_zeroed::<u32>(4);
    /// let q = rt.queue();
    /// q.submit(|cg| cg.fill(&buf, 1))?;
    /// q.submit(|cg| cg.fill(&buf, 2))?.wait()?;
    /// let json = rt.chrome_trace().unwrap();
    /// assert!(json.contains("\"traceEvents\""));
    /// # Ok::<(), gantry::Error>(())
    /// ```
    pub fn chrome_trace(&self) -> Option<String> {
        self.timeline().map(|t| crate::trace::chrome_trace(&t, &self.shared.devices))
    }

    /// Writes [`Runtime::chrome_trace`] to `path`.
    pub fn write_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        let json = self.chrome_trace().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "the runtime records no timeline")
        })?;
        std::fs::write(path, json)
    }

    /// Hits, misses, evictions and size of the default fusion compiler's cache (`None` with a compiler
    /// set by [`RuntimeBuilder::fusion_compiler`]).
    pub fn fusion_cache_stats(&self) -> Option<CacheStats> {
        self.shared.closure_fusion.as_ref().map(|c| c.stats())
    }

    /// Nanoseconds since the runtime started (the clock of submission timestamps and
    /// of the CPU device).
    pub fn now_ns(&self) -> u64 {
        self.shared.clock.now_ns()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Refuse new work, so a thread that keeps submitting cannot keep the runtime
        // from going idle, then finish what can finish.
        self.shared.senders.gate.close();
        if crate::task_scope::inside(self.shared.id) {
            // Dropped inside one of its own host tasks (which owned it): waiting for
            // idle here would wait for this task. Another thread finishes the shutdown
            // once the task has returned.
            let (shared, thread) = (self.shared.clone(), self.thread.take());
            let spawned = std::thread::Builder::new()
                .name("gantry-shutdown".into())
                .spawn(move || shutdown(&shared, thread));
            if spawned.is_err() {
                tracing::error!("could not start a thread to finish the runtime's shutdown");
            }
            return;
        }
        shutdown(&self.shared, self.thread.take());
    }
}

/// Finishes a runtime's shutdown once its gate is closed: drains what can finish,
/// stops the scheduler thread and the drivers, fails what can never run, and frees
/// what the stages gave back (a kernel there may hold a handle of this runtime).
fn shutdown(shared: &Shared, thread: Option<JoinHandle<()>>) {
    stop(shared, thread);
    shared.release();
}

fn stop(shared: &Shared, thread: Option<JoinHandle<()>>) {
    shared.senders.gate.wait_for_senders();
    let _ = shared.drive_until_idle();
    let _ = shared.wake_tx.send(());
    if let Some(t) = thread {
        let _ = t.join();
    }
    // A send admitted before the close may still be on its way into the channel
    // (the scheduler thread may have stopped before it arrived): the final flush
    // below must see it, or its command would neither run nor fail, and a wait
    // on its event would never return.
    shared.senders.gate.wait_for_senders();
    let mut guard = shared.core.lock();
    if shared.failure.get().is_some() {
        // The scheduler failed: it already failed everything pending.
        return;
    }
    if let Some(mut core) = guard.take() {
        // Apply anything that raced with shutdown, then fail what can never run.
        let report = core.stages.flush(&mut core.world);
        if let Some(message) = report.fatal {
            shared.fail(&mut core.world, message);
            return;
        }
        gantry_systems::retire::abandon_all(&mut core.world, gantry_driver::ExecError::RuntimeDropped);
    }
}
