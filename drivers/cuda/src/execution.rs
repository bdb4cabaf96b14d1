//! Execution: a small pool of streams ("lanes"), one event per operation, and one
//! completion thread per lane that waits for its lane's operations in order and
//! reports each exactly once.
//!
//! An operation goes to the lane of the latest unfinished operation it waits on (so
//! a dependent chain stays in one stream and needs no cross-stream waits), or, with
//! nothing to wait on, to the next lane in turn (so independent work overlaps).
//! Waits on other lanes become `cuStreamWaitEvent` on the waited operation's event.
//! After its work the operation records its event; the lane's completion thread
//! first waits for the results of the operations it waited on (their lanes report
//! them), then for its event (`cuEventSynchronize` on a blocking-sync event: the
//! thread sleeps, it does not spin), and reports the completion.
//!
//! Failures. An operation that fails when it is submitted (a launch the device
//! refuses, a kernel that does not compile, a malformed copy) runs nothing and
//! carries its error; an operation whose wait-list names a failed one runs nothing
//! and fails with [`ExecError::DependencyFailed`]. A fault while a kernel runs is
//! *sticky*: CUDA reports it for the whole context, from every later call, and not
//! for the kernel that caused it. The first operation whose completion reveals it
//! gets the [`ExecError::Backend`] error (an operation that waited on a failed one
//! gets `DependencyFailed` instead); the device is marked lost, and everything after
//! fails with [`ExecError::DeviceLost`].

use std::any::Any;
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::sys::{self, CUevent, CUevent_flags, CUstream, CUstream_flags};
use gantry_driver::sync::channel::{unbounded, Receiver, Sender, TryRecvError};
use gantry_driver::sync::spin_until;
use gantry_driver::{Completion, DriverContext, ExecError, OpHandle, OpId};

use crate::context::Context;
use crate::error::{check, CallError};
use crate::memory::Pinned;

/// Locks `m`, whatever a panicking holder left (the data here stays consistent: every
/// critical section is a few assignments).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A CUDA stream, destroyed when dropped.
pub(crate) struct Stream {
    pub(crate) raw: CUstream,
    ctx: Arc<Context>,
}

// SAFETY: a CUstream is a handle the driver API accepts from any thread.
unsafe impl Send for Stream {}
// SAFETY: see above; the driver serializes what it enqueues.
unsafe impl Sync for Stream {}

impl Stream {
    /// A stream that does not synchronize with the legacy default stream.
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Self, CallError> {
        let mut raw: CUstream = ptr::null_mut();
        let flags = CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the context is current (callers bind it); valid out-pointer.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
        Ok(Self { raw, ctx: ctx.clone() })
    }

    /// Waits until everything enqueued has run.
    pub(crate) fn synchronize(&self) -> Result<(), CallError> {
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.raw) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; CUDA lets enqueued work finish.
        unsafe {
            let _ = self.ctx.bind();
            let _ = sys::cuStreamDestroy_v2(self.raw);
        }
    }
}

/// An event recorded after one operation's work.
pub(crate) struct Event {
    raw: CUevent,
    ctx: Arc<Context>,
}

// SAFETY: a CUevent is a handle the driver API accepts from any thread.
unsafe impl Send for Event {}
// SAFETY: see above.
unsafe impl Sync for Event {}

impl Event {
    /// Records a new event on `stream`: it completes when everything enqueued on the
    /// stream before it has.
    pub(crate) fn record(ctx: &Arc<Context>, stream: &Stream) -> Result<Self, CallError> {
        let mut raw: CUevent = ptr::null_mut();
        // Blocking sync: a completion thread waiting on it sleeps instead of spinning;
        // no timing: cheaper to record and to wait on across streams.
        let flags =
            CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32 | CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: the context is current; valid out-pointer.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        let event = Self { raw, ctx: ctx.clone() };
        // SAFETY: a live event and stream of the same context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.raw, stream.raw) })?;
        Ok(event)
    }

    /// Makes `stream` wait for this event before running what is enqueued next.
    pub(crate) fn wait_on(&self, stream: &Stream) -> Result<(), CallError> {
        // SAFETY: a live event and stream of the same context.
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream.raw, self.raw, 0) })
    }

    /// Whether the event has completed (an error counts as completed: `synchronize`
    /// reports it).
    fn query_done(&self) -> bool {
        // SAFETY: a live, recorded event.
        unsafe { sys::cuEventQuery(self.raw) != sys::CUresult::CUDA_ERROR_NOT_READY }
    }

    /// Waits until the event has completed: polls it for `wait.spin`, then polls it
    /// between yields of the thread until `wait.poll` has passed, then blocks (a
    /// blocking wait wakes tens of microseconds after the device finishes). The
    /// error is a fault of the context.
    fn synchronize(&self, wait: &Waiting) -> Result<(), CallError> {
        if !spin_until(wait.spin, || self.query_done()) && !wait.poll.is_zero() {
            let start = std::time::Instant::now();
            while !self.query_done() && start.elapsed() < wait.poll {
                std::thread::yield_now();
            }
        }
        // SAFETY: a live, recorded event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `record`, destroyed once; CUDA defers the release of an
        // event still pending.
        unsafe {
            let _ = self.ctx.bind();
            let _ = sys::cuEventDestroy_v2(self.raw);
        }
    }
}

/// One submitted operation: what the scheduler's handle points to.
pub(crate) struct Op {
    id: OpId,
    /// The operation, for the errors of its dependents: `kernel `name``, `copy`, ….
    pub(crate) label: Arc<str>,
    pub(crate) lane: usize,
    /// Submission order, to pick the latest of several waits.
    seq: u64,
    submitted_ns: u64,
    /// Recorded after its work; `None` where nothing was enqueued.
    event: Option<Event>,
    state: Mutex<OpState>,
    done: Condvar,
}

#[derive(Default)]
struct OpState {
    /// The operations it waits on, until its completion (then dropped, so a long
    /// chain does not keep every predecessor alive).
    waits: Vec<Arc<Op>>,
    /// Its error where it failed when submitted. Kept until the op is gone: a
    /// submission that waits on it reads it (`Op::failure`) to run nothing, and
    /// taking it before the result is set would let one in between see no failure
    /// and run.
    preset: Option<ExecError>,
    /// What must outlive its work (a loaded module, scratch memory).
    keep: Vec<Box<dyn Any + Send + Sync>>,
    /// Its result and end time, once reported.
    result: Option<(Result<(), ExecError>, u64)>,
}

impl Op {
    /// Its failure, where it is known to have failed (when submitted, or since).
    pub(crate) fn failure(&self) -> Option<ExecError> {
        let s = lock(&self.state);
        s.preset.clone().or_else(|| s.result.as_ref().and_then(|(r, _)| r.clone().err()))
    }

    /// Whether it has completed successfully (a wait on it needs nothing enqueued).
    pub(crate) fn succeeded(&self) -> bool {
        matches!(lock(&self.state).result, Some((Ok(()), _)))
    }

    /// The event recorded after its work, if any was enqueued.
    pub(crate) fn event(&self) -> Option<&Event> {
        self.event.as_ref()
    }

    /// Its result and end time, waiting for its completion thread to report it.
    fn outcome(&self) -> (Result<(), ExecError>, u64) {
        let mut s = lock(&self.state);
        loop {
            if let Some((r, t)) = &s.result {
                return (r.clone(), *t);
            }
            s = self.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What a submission becomes, before it is handed to its lane.
pub(crate) struct Planned {
    pub(crate) id: OpId,
    pub(crate) label: Arc<str>,
    pub(crate) lane: usize,
    pub(crate) waits: Vec<Arc<Op>>,
    pub(crate) event: Option<Event>,
    pub(crate) preset: Option<ExecError>,
    pub(crate) keep: Vec<Box<dyn Any + Send + Sync>>,
}

/// The device-wide state completion threads share: where completions go, and
/// whether the device was lost.
pub(crate) struct Reporter {
    pub(crate) device: Arc<str>,
    ctx: DriverContext,
    /// Set by the first sticky error.
    lost: OnceLock<()>,
    /// How a completion thread waits.
    wait: Waiting,
}

/// How a completion thread waits for the next operation and for an operation's
/// event (see [`CudaConfig`](crate::CudaConfig)).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Waiting {
    /// Polling without yielding.
    pub(crate) spin: Duration,
    /// Polling between yields of the thread, after the spin, before blocking.
    pub(crate) poll: Duration,
}

impl Reporter {
    /// Whether a sticky error has made the device unusable.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.get().is_some()
    }

    /// The error of an operation that `e` failed, with `message`: the first sticky
    /// error marks the device lost and is reported as is; later ones, which CUDA
    /// repeats from every call, are [`ExecError::DeviceLost`].
    pub(crate) fn failed(&self, e: CallError, message: impl Into<String>) -> ExecError {
        if !e.is_sticky() {
            return e.into_exec(&self.device, message);
        }
        if self.lost.set(()).is_ok() {
            e.into_exec(&self.device, format!("{}; the device is lost", message.into()))
        } else {
            self.lost_error()
        }
    }

    /// The error of an operation submitted after the device was lost.
    pub(crate) fn lost_error(&self) -> ExecError {
        ExecError::DeviceLost { device: self.device.clone() }
    }
}

/// One stream and what goes with it.
pub(crate) struct Lane {
    pub(crate) stream: Stream,
    /// Pinned memory host copies go through, made on first use.
    staging: Mutex<Option<Arc<Pinned>>>,
    /// Hands operations to the completion thread; `None` once the driver shuts down.
    tx: Option<Sender<Arc<Op>>>,
}

impl Lane {
    /// The lane's staging memory of `bytes`, allocated on first use.
    pub(crate) fn staging(&self, ctx: &Arc<Context>, bytes: usize) -> Result<Arc<Pinned>, CallError> {
        let mut slot = lock(&self.staging);
        if let Some(p) = &*slot {
            return Ok(p.clone());
        }
        let p = Arc::new(Pinned::new(ctx, bytes)?);
        *slot = Some(p.clone());
        Ok(p)
    }
}

/// The lanes, their completion threads, and the choice of lane per operation.
pub(crate) struct Lanes {
    pub(crate) lanes: Vec<Lane>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
    seq: AtomicU64,
    reporter: Arc<Reporter>,
    ctx: Arc<Context>,
}

impl Lanes {
    /// `count` streams, each with a completion thread reporting to `dctx`.
    pub(crate) fn new(
        ctx: &Arc<Context>,
        count: usize,
        wait: Waiting,
        device: Arc<str>,
        dctx: DriverContext,
    ) -> Result<Self, ExecError> {
        let reporter = Arc::new(Reporter { device: device.clone(), ctx: dctx, lost: OnceLock::new(), wait });
        let mut lanes = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for index in 0..count.max(1) {
            let stream = Stream::new(ctx).map_err(|e| e.into_exec(&device, "creating a stream"))?;
            let (tx, rx) = unbounded::<Arc<Op>>();
            let (c, r) = (ctx.clone(), reporter.clone());
            let name = format!("gantry-{device}-{index}");
            // A thread that cannot start would leave its lane without a reporter:
            // refuse the driver rather than accept work that never completes.
            let thread = std::thread::Builder::new()
                .name(name)
                .spawn(move || complete_in_order(c, r, rx))
                .map_err(|e| ExecError::Driver {
                    device: device.clone(),
                    message: format!("could not start a completion thread: {e}"),
                })?;
            lanes.push(Lane { stream, staging: Mutex::new(None), tx: Some(tx) });
            threads.push(thread);
        }
        Ok(Self {
            lanes,
            threads,
            next: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            reporter,
            ctx: ctx.clone(),
        })
    }

    pub(crate) fn reporter(&self) -> &Reporter {
        &self.reporter
    }

    /// The lane for an operation waiting on `waits` (see the module docs).
    pub(crate) fn pick(&self, waits: &[Arc<Op>]) -> usize {
        let latest = waits.iter().filter(|w| !w.succeeded()).max_by_key(|w| w.seq);
        match latest {
            Some(w) => w.lane,
            None => self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len(),
        }
    }

    /// Hands `planned` to its lane's completion thread and returns its handle.
    pub(crate) fn hand_over(&self, planned: Planned, submitted_ns: u64) -> OpHandle {
        let op = Arc::new(Op {
            id: planned.id,
            label: planned.label,
            lane: planned.lane,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            submitted_ns,
            event: planned.event,
            state: Mutex::new(OpState {
                waits: planned.waits,
                preset: planned.preset,
                keep: planned.keep,
                result: None,
            }),
            done: Condvar::new(),
        });
        let sent = self.lanes[op.lane].tx.as_ref().map(|tx| tx.send(op.clone()));
        if !matches!(sent, Some(Ok(()))) {
            // Only while the driver shuts down, when no one submits: report it here.
            finish(&self.reporter, &op, 0);
        }
        op
    }
}

impl Drop for Lanes {
    /// Closes the lanes and waits until every operation handed over has completed
    /// and been reported, then lets the streams go.
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            lane.tx = None;
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = self.ctx.bind();
        for lane in &self.lanes {
            // Host copies whose operation failed when submitted may still be queued.
            let _ = lane.stream.synchronize();
        }
    }
}

/// A completion thread: reports its lane's operations in the order they were
/// enqueued (the order they complete in), until the lane closes. It polls for the
/// next operation, as for each event, for the reporter's spin window before it
/// blocks.
fn complete_in_order(ctx: Arc<Context>, reporter: Arc<Reporter>, rx: Receiver<Arc<Op>>) {
    let bound = ctx.bind();
    let mut last_ended = 0;
    loop {
        let mut next = Err(TryRecvError::Empty);
        spin_until(reporter.wait.spin, || {
            next = rx.try_recv();
            next.is_ok()
        });
        let op = match next {
            Ok(op) => op,
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => match rx.recv() {
                Ok(op) => op,
                Err(_) => break,
            },
        };
        if let Err(e) = bound {
            lock(&op.state).preset.get_or_insert_with(|| reporter.failed(e, "binding the completion thread"));
        }
        last_ended = finish(&reporter, &op, last_ended);
    }
}

/// Waits for `op` (its waits' results, then its event), sets its result, wakes who
/// waits on it, and sends its completion. Returns its end time.
fn finish(reporter: &Reporter, op: &Op, last_ended: u64) -> u64 {
    let waits = std::mem::take(&mut lock(&op.state).waits);
    let mut started = op.submitted_ns.max(last_ended);
    let mut dependency: Option<(Arc<str>, ExecError)> = None;
    for w in &waits {
        let (result, ended) = w.outcome();
        started = started.max(ended);
        if let (Err(e), None) = (result, &dependency) {
            dependency = Some((w.label.clone(), e));
        }
    }
    drop(waits);
    let synced = op.event.as_ref().map(|e| e.synchronize(&reporter.wait));
    let (preset, keep) = {
        let mut s = lock(&op.state);
        (s.preset.clone(), std::mem::take(&mut s.keep))
    };
    let result = match (preset, dependency, synced) {
        (Some(e), _, _) => Err(e),
        (None, Some((label, cause)), _) => Err(cause.as_dependency_of(label)),
        (None, None, Some(Err(e))) => Err(reporter.failed(
            e,
            format!(
                "{} failed on the device (CUDA reports a fault for the whole context, so this is the \
                 first operation found failed, not necessarily the one that faulted)",
                op.label
            ),
        )),
        (None, None, _) => Ok(()),
    };
    drop(keep);
    let ended = reporter.ctx.stamp_ns().max(started);
    {
        let mut s = lock(&op.state);
        s.result = Some((result.clone(), ended));
    }
    op.done.notify_all();
    reporter.ctx.complete(Completion {
        op: op.id,
        result,
        started_ns: started,
        ended_ns: ended,
        lane: op.lane as u32 + 1,
    });
    ended
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure known when the op was submitted stays visible while its completion
    /// thread reports it, and after: a submission that waits on the op in between
    /// must see it and run nothing. (The completion once took the failure out before
    /// setting the result, and a dependent submitted in that window saw neither and
    /// ran: the conformance check `dependency_failure_propagates` failed about one
    /// run in twenty on the H100.) Needs no GPU: the op enqueued nothing.
    #[test]
    fn a_failure_known_at_submission_stays_visible_through_its_completion() {
        let (tx, rx) = unbounded();
        let reporter = Reporter {
            device: "cuda:test".into(),
            ctx: DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) },
            lost: OnceLock::new(),
            wait: Waiting { spin: Duration::ZERO, poll: Duration::ZERO },
        };
        let refused = ExecError::Driver { device: "cuda:test".into(), message: "launch refused".into() };
        for i in 0..200 {
            let op = Arc::new(Op {
                id: OpId(i),
                label: "kernel `refused`".into(),
                lane: 0,
                seq: i,
                submitted_ns: 0,
                event: None,
                state: Mutex::new(OpState { preset: Some(refused.clone()), ..Default::default() }),
                done: Condvar::new(),
            });
            let reader = {
                let op = op.clone();
                std::thread::spawn(move || (0..2_000).all(|_| op.failure().is_some()))
            };
            finish(&reporter, &op, 0);
            assert!(reader.join().unwrap(), "a reader saw the failed op as not failed");
            assert_eq!(op.failure(), Some(refused.clone()));
            assert!(lock(&op.state).preset.is_some(), "the completion cleared the failure");
            assert_eq!(rx.try_recv().expect("one completion").result, Err(refused.clone()));
        }
    }
}
