//! The harness a check drives a driver through: the driver made by the suite's
//! factory, its completion channel, memory of the kind its operations take, and
//! submissions made the way the scheduler makes them for the driver's
//! [`Capabilities`].
//!
//! What it checks on every operation, whatever the check: a submission accepted as
//! [`Accepted::Pending`] completes exactly once, with its own id, before
//! [`DEADLINE`]; one finished inline ([`Accepted::Done`]) reports its own id and
//! sends nothing on the channel; no completion names an operation never accepted;
//! an operation ends no earlier than it started. [`Harness::finish`] listens a while
//! after the last completion for reports that should not come.

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use gantry_driver::sync::channel::{unbounded, Receiver};
use gantry_driver::{
    panic_message, Accepted, AccessMode, AllocId, Capabilities, Completion, DeviceOp, Driver, DriverContext,
    ExecError, HostStorage, MemArg, MemRef, MemSlice, OpHandle, OpId, SimHint, Submission,
};

use crate::kernels::DELIBERATE;
use crate::Outcome;

/// What makes the driver under test: called once per check, with a fresh context.
pub type Factory<'a> = dyn Fn(DriverContext) -> Arc<dyn Driver> + 'a;

/// How long the harness waits for any one completion (polling the driver meanwhile)
/// before it fails the check.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// How long [`Harness::finish`] listens for completions that should not come.
const QUIET: Duration = Duration::from_millis(20);

/// One accepted submission.
pub struct Ticket {
    id: OpId,
    /// The driver's handle, for an operation accepted as pending.
    handle: Option<OpHandle>,
    /// The operation, for messages: `kernel `name``, `fill`, ….
    label: String,
}

impl Ticket {
    /// The operation's id.
    pub fn id(&self) -> OpId {
        self.id
    }
    /// Whether the driver accepted it as pending (it then has a handle for wait-lists)
    /// rather than running it inside `submit`.
    pub fn is_pending(&self) -> bool {
        self.handle.is_some()
    }
    /// What it was, for messages.
    pub fn label(&self) -> &str {
        &self.label
    }
}

/// Memory of the kind the driver's operations take: a device allocation where the
/// driver has memory of its own, host memory where it shares it.
pub struct Buf {
    mem: MemRef,
    len: usize,
}

impl Buf {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether it is device memory.
    pub fn is_device(&self) -> bool {
        matches!(self.mem, MemRef::Device(_))
    }
    /// `len` bytes from `offset`.
    pub fn slice(&self, offset: usize, len: usize) -> MemSlice {
        MemSlice { mem: self.mem.clone(), offset, len }
    }
    /// All of it.
    pub fn whole(&self) -> MemSlice {
        self.slice(0, self.len)
    }
    /// All of it, as an argument used in `mode`.
    pub fn arg(&self, mode: AccessMode) -> MemArg {
        MemArg { mem: self.whole(), mode }
    }
}

/// The driver under test and what the harness knows of its operations.
pub struct Harness {
    driver: Arc<dyn Driver>,
    caps: Capabilities,
    name: Arc<str>,
    rx: Receiver<Completion>,
    next: u64,
    /// Accepted as pending, not completed yet: id → label.
    pending: HashMap<u64, String>,
    /// Finished inside `submit`.
    inline: HashSet<u64>,
    /// Every completion, by id.
    results: HashMap<u64, Completion>,
    /// Device allocations, freed when the harness goes.
    allocs: Vec<AllocId>,
}

impl Harness {
    /// Makes the driver with a fresh context (a new completion channel, the epoch now).
    pub fn new(factory: &Factory) -> Self {
        quiet_deliberate_panics();
        let (tx, rx) = unbounded();
        let driver =
            factory(DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) });
        let info = driver.info();
        let (caps, name) = (info.caps, info.name.clone());
        Self {
            driver,
            caps,
            name,
            rx,
            next: 0,
            pending: HashMap::new(),
            inline: HashSet::new(),
            results: HashMap::new(),
            allocs: Vec::new(),
        }
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }
    /// Its capabilities.
    pub fn caps(&self) -> Capabilities {
        self.caps
    }
    /// Its name, for messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Ids are spread out and do not start at 0, so a driver that numbers
    /// operations itself instead of reporting the ids it was given is caught.
    fn next_id(&mut self) -> OpId {
        self.next += 1;
        OpId(0x5EED_0000 + self.next * 7)
    }

    /// Submits `op` after `deps`, as the scheduler would: with in-driver waits, the
    /// handles of pending dependencies go in the wait-list whether or not they have
    /// completed; without, the harness first waits for them to complete and the
    /// wait-list stays empty. A virtual-time driver gets the end of the completed
    /// dependencies (and its clock) as its hint's `not_before_ns`. `Err` is the driver's refusal.
    ///
    /// # Panics
    /// When the driver panics inside `submit`, or reports an inline completion under
    /// another id.
    pub fn try_submit(
        &mut self,
        op: DeviceOp,
        deps: &[&Ticket],
        preserve_on_failure: bool,
    ) -> Result<Ticket, ExecError> {
        let mut waits: Vec<OpHandle> = Vec::new();
        for dep in deps {
            match &dep.handle {
                Some(h) if self.caps.in_driver_waits => waits.push(h.clone()),
                Some(_) => {
                    self.completion(dep);
                }
                None => {}
            }
        }
        let hint = self.caps.virtual_time.then(|| {
            let ended = deps.iter().filter_map(|d| self.results.get(&d.id.0)).map(|c| c.ended_ns);
            SimHint { not_before_ns: ended.fold(self.driver.virtual_now_ns(), u64::max), host_task_ns: None }
        });
        let id = self.next_id();
        let label = describe(&op);
        let sub = Submission { id, op, waits: &waits, preserve_on_failure, hint };
        let driver = &self.driver;
        let accepted = match catch_unwind(AssertUnwindSafe(|| driver.submit(sub))) {
            Ok(accepted) => accepted?,
            Err(p) => panic!(
                "{}: submit of {label} panicked ({}); a driver refuses what it cannot run with an Err",
                self.name,
                panic_message(&*p)
            ),
        };
        let handle = match accepted {
            Accepted::Pending(h) => {
                self.pending.insert(id.0, label.clone());
                Some(h)
            }
            Accepted::Done(c) => {
                assert_eq!(
                    c.op, id,
                    "{}: {label} finished inline, but its completion names another operation",
                    self.name
                );
                self.check_times(&c, &label);
                self.inline.insert(id.0);
                self.results.insert(id.0, c);
                None
            }
        };
        Ok(Ticket { id, handle, label })
    }

    /// [`Harness::try_submit`] without `preserve_on_failure`, which must be accepted.
    pub fn submit(&mut self, op: DeviceOp, deps: &[&Ticket]) -> Ticket {
        self.submit_with(op, deps, false)
    }

    /// [`Harness::try_submit`], which must be accepted.
    pub fn submit_with(&mut self, op: DeviceOp, deps: &[&Ticket], preserve_on_failure: bool) -> Ticket {
        let label = describe(&op);
        self.try_submit(op, deps, preserve_on_failure)
            .unwrap_or_else(|e| panic!("{}: submit of {label} was refused: {e}", self.name))
    }

    /// The completion of `t`, waiting (and polling the driver) for it.
    pub fn completion(&mut self, t: &Ticket) -> Completion {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(c) = self.results.get(&t.id.0) {
                return c.clone();
            }
            self.pump(deadline);
        }
    }

    /// The result of `t`.
    pub fn result(&mut self, t: &Ticket) -> Result<(), ExecError> {
        self.completion(t).result
    }

    /// Waits for `t`, which must succeed.
    pub fn expect_ok(&mut self, t: &Ticket) -> Completion {
        let c = self.completion(t);
        if let Err(e) = &c.result {
            panic!("{}: {} failed: {e}", self.name, t.label);
        }
        c
    }

    /// Waits until every pending operation has completed.
    pub fn settle(&mut self) {
        let deadline = Instant::now() + DEADLINE;
        while !self.pending.is_empty() {
            self.pump(deadline);
        }
    }

    /// Ends a check: settles, then listens a while for completions that should not
    /// come (a second report of an operation, one finished inline also reported).
    pub fn finish(mut self) -> Outcome {
        self.settle();
        let until = Instant::now() + QUIET;
        while Instant::now() < until {
            self.poll();
            if let Ok(c) = self.rx.recv_timeout(Duration::from_millis(1)) {
                self.record(c);
            }
        }
        Outcome::Checked
    }

    fn poll(&self) {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| self.driver.poll())) {
            panic!("{}: poll panicked: {}", self.name, panic_message(&*p));
        }
    }

    /// Polls the driver and takes what completed; fails the check past `deadline`.
    fn pump(&mut self, deadline: Instant) {
        self.poll();
        let mut got = false;
        while let Ok(c) = self.rx.try_recv() {
            self.record(c);
            got = true;
        }
        if got {
            return;
        }
        if Instant::now() > deadline {
            let mut waiting: Vec<_> = self.pending.iter().map(|(id, l)| format!("{l} (op {id})")).collect();
            waiting.sort();
            let more = waiting.len().saturating_sub(4);
            waiting.truncate(4);
            panic!(
                "{}: no completion within {DEADLINE:?}; still pending: {}{}. Every operation \
                 accepted as pending must complete exactly once (the harness calls poll() while it \
                 waits)",
                self.name,
                waiting.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            );
        }
        if let Ok(c) = self.rx.recv_timeout(Duration::from_millis(1)) {
            self.record(c);
        }
    }

    fn record(&mut self, c: Completion) {
        let id = c.op.0;
        if let Some(label) = self.pending.remove(&id) {
            self.check_times(&c, &label);
            self.results.insert(id, c);
        } else if self.inline.contains(&id) {
            panic!(
                "{}: op {id} finished inside submit (Accepted::Done) and was also reported on the \
                 channel: {c:?}",
                self.name
            );
        } else if self.results.contains_key(&id) {
            panic!("{}: op {id} completed twice; the second report: {c:?}", self.name);
        } else {
            panic!("{}: a completion names op {id}, which was never accepted as pending: {c:?}", self.name);
        }
    }

    fn check_times(&self, c: &Completion, label: &str) {
        assert!(
            c.started_ns <= c.ended_ns,
            "{}: {label} ended ({} ns) before it started ({} ns)",
            self.name,
            c.ended_ns,
            c.started_ns
        );
    }

    /// `len` zeroed bytes of the memory the driver's operations take: a device
    /// allocation, or host memory where the driver shares it (it is then never asked
    /// to allocate).
    pub fn alloc(&mut self, len: usize) -> Buf {
        if self.caps.shares_host_memory {
            return Buf { mem: MemRef::Host(Arc::new(HostStorage::zeroed(len))), len };
        }
        let id = self.driver.alloc(len).unwrap_or_else(|e| panic!("{}: alloc({len}) failed: {e}", self.name));
        self.allocs.push(id);
        Buf { mem: MemRef::Device(id), len }
    }

    /// A buffer holding `bytes`.
    pub fn buffer(&mut self, bytes: &[u8]) -> Buf {
        let b = self.alloc(bytes.len());
        self.upload(&b, 0, bytes);
        b
    }

    /// A buffer holding `values`.
    pub fn buffer_u32(&mut self, values: &[u32]) -> Buf {
        self.buffer(&u32_bytes(values))
    }

    /// Writes `bytes` at `offset` of `buf` once everything pending has completed:
    /// directly into host memory, with a copy from host memory into device memory.
    pub fn upload(&mut self, buf: &Buf, offset: usize, bytes: &[u8]) {
        self.settle();
        match &buf.mem {
            // SAFETY: nothing is pending, so no operation touches the storage.
            MemRef::Host(s) => unsafe { s.bytes_mut()[offset..offset + bytes.len()].copy_from_slice(bytes) },
            MemRef::Device(_) => {
                let src = MemSlice::host(Arc::new(HostStorage::from_bytes(bytes)));
                let t = self.submit(DeviceOp::Copy { src, dst: buf.slice(offset, bytes.len()) }, &[]);
                self.expect_ok(&t);
            }
        }
    }

    /// The contents of `buf` once everything pending has completed.
    pub fn download(&mut self, buf: &Buf) -> Vec<u8> {
        self.settle();
        match &buf.mem {
            MemRef::Host(s) => self.host_bytes(s),
            MemRef::Device(_) => {
                let dst = Arc::new(HostStorage::zeroed(buf.len));
                let t =
                    self.submit(DeviceOp::Copy { src: buf.whole(), dst: MemSlice::host(dst.clone()) }, &[]);
                self.expect_ok(&t);
                self.host_bytes(&dst)
            }
        }
    }

    /// The contents of `buf` as `u32`s once everything pending has completed.
    pub fn download_u32(&mut self, buf: &Buf) -> Vec<u32> {
        bytes_u32(&self.download(buf))
    }

    /// The contents of host memory once everything pending has completed.
    pub fn host_bytes(&mut self, storage: &HostStorage) -> Vec<u8> {
        self.settle();
        // SAFETY: nothing is pending, so no operation writes the storage.
        unsafe { storage.bytes() }.to_vec()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        for id in self.allocs.drain(..) {
            self.driver.free(id);
        }
    }
}

/// Host memory holding `bytes`.
pub fn host_storage(bytes: &[u8]) -> Arc<HostStorage> {
    Arc::new(HostStorage::from_bytes(bytes))
}

/// `values` as native-endian bytes.
pub fn u32_bytes(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// Native-endian bytes as `u32`s (a trailing partial word is dropped).
pub fn bytes_u32(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().expect("4 bytes"))).collect()
}

/// A short description of an operation, for messages.
fn describe(op: &DeviceOp) -> String {
    match op {
        DeviceOp::Kernel(k) => format!("kernel `{}`", crate::kernels::name_of(k)),
        DeviceOp::Copy { src, dst } => format!("copy of {} bytes into {} bytes", src.len, dst.len),
        DeviceOp::Fill { dst, pattern } => {
            format!("fill of {} bytes with a {}-byte pattern", dst.len, pattern.len())
        }
        DeviceOp::HostTask(t) => format!("host task `{}`", t.name),
        DeviceOp::Marker => "marker".into(),
        DeviceOp::CommandBuffer(_) => "command buffer replay".into(),
    }
}

/// Silences the panics the checks cause on purpose (their messages start with
/// [`DELIBERATE`]); every other panic prints as before. Installed once per process.
fn quiet_deliberate_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let msg = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            if !msg.starts_with(DELIBERATE) {
                default(info);
            }
        }));
    });
}
