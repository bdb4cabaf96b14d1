//! # gantry-proptests
//!
//! Property tests of Gantry against a reference model.
//!
//! * [`Program`]: buffers of `u32` and a list of [`Op`]s (kernels, host tasks, copies,
//!   fills, host transfers, waits, host accesses), each submission on one of a few
//!   queues and on the CPU or the simulated device, optionally with explicit
//!   `depends_on` edges to earlier submissions.
//! * [`RawProgram`] + [`Program::decode`]: the generator. A raw program is plain
//!   numbers (what proptest generates and shrinks); decoding turns any raw program into
//!   a *valid* program (ranges in bounds, no conflicting accessors in one command
//!   group, waits only on earlier submissions), under [`GenOptions`].
//! * [`run_model`]: executes a program serially, in submission order, on plain `Vec`s.
//! * [`run_gantry`] / [`Session`]: executes it through Gantry under a [`Config`].
//!
//! The arithmetic of kernels and host tasks is order-sensitive ([`mix`]): a missing
//! dependency, a stale device copy or a lost partial write shows up as wrong data.

use std::collections::BTreeSet;
use std::fmt;

use gantry::{
    Accessor, CpuConfig, DiscardWrite, Event, HostAccessor, Item, NdRange, Queue,
    QueueOptions, Read, ReadWrite, Readback, Runtime, SimConfig, Write,
};

/// Maximal number of buffers of a program.
pub const MAX_BUFFERS: usize = 4;
/// Maximal buffer length (elements).
pub const MAX_LEN: usize = 64;
/// Maximal number of queues of a program.
pub const MAX_QUEUES: usize = 3;

// ---------------------------------------------------------------------------------
// Arithmetic shared by the model and the Gantry closures
// ---------------------------------------------------------------------------------

/// An order-sensitive (non-commutative) 32-bit mixing step.
#[inline]
pub fn mix(a: u32, b: u32) -> u32 {
    let x = (a.rotate_left(5) ^ b).wrapping_mul(0x9E37_79B1);
    x ^ (x >> 15)
}

/// Initial contents of a buffer of `len` elements made from `seed`.
pub fn initial_contents(seed: u32, len: usize) -> Vec<u32> {
    (0..len).map(|i| mix(seed ^ 0x1234_5678, i as u32)).collect()
}

/// Work-item `i`'s starting value in an op with `salt`.
#[inline]
pub fn item_seed(salt: u32, i: usize) -> u32 {
    mix(salt, i as u32 ^ 0xA5A5_0000)
}

/// The value a `Write`/`DiscardWrite` accessor number `k` gets from accumulator `acc`.
#[inline]
pub fn out_value(acc: u32, k: usize) -> u32 {
    mix(acc, k as u32 + 1)
}

/// The value a `ReadWrite` accessor number `k` gets from `acc` and its old value.
#[inline]
pub fn rw_value(acc: u32, k: usize, old: u32) -> u32 {
    mix(out_value(acc, k), old)
}

/// Whether a `Write` accessor number `k` writes element `i` (it skips every third
/// element, so the unwritten elements must keep their values).
#[inline]
pub fn write_mask(salt: u32, k: usize, i: usize) -> bool {
    !(salt as usize).wrapping_add(k).wrapping_add(i).is_multiple_of(3)
}

/// Element `i` of a host-to-device copy's data with `salt`.
#[inline]
pub fn host_data(salt: u32, i: usize) -> u32 {
    mix(salt ^ 0x0F0F_0F0F, i as u32)
}

// ---------------------------------------------------------------------------------
// Programs
// ---------------------------------------------------------------------------------

/// Where a submission runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dev {
    /// Device 0.
    Cpu,
    /// Device 1 when the runtime has a simulated device, device 0 otherwise.
    Sim,
}

/// A range `start..end` of buffer `buf`, in elements.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Buffer index.
    pub buf: usize,
    /// First element.
    pub start: usize,
    /// One past the last element.
    pub end: usize,
}

impl Span {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    /// Whether it is empty (never, in generated programs).
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
    /// Whether the two spans share an element of one buffer.
    pub fn overlaps(&self, other: &Span) -> bool {
        self.buf == other.buf && self.start < other.end && other.start < self.end
    }
}

impl fmt::Debug for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b{}[{}..{}]", self.buf, self.start, self.end)
    }
}

/// Mode of a writing accessor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WMode {
    /// `Write`: writes the elements selected by [`write_mask`], keeps the others.
    Write,
    /// `ReadWrite`: every element becomes [`rw_value`] of its old value.
    ReadWrite,
    /// `DiscardWrite`: every element is overwritten.
    DiscardWrite,
}

impl WMode {
    fn short(self) -> &'static str {
        match self {
            WMode::Write => "w",
            WMode::ReadWrite => "rw",
            WMode::DiscardWrite => "discard",
        }
    }
}

/// How a kernel is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launch {
    /// `parallel_for(n)`.
    Flat,
    /// `parallel_for_nd` over `n` rounded up to a multiple of `local` (work-items past
    /// `n` do nothing); several work-groups run in parallel on CPU workers.
    Nd(usize),
}

/// The command of a submission.
#[derive(Clone, PartialEq, Eq)]
pub enum Cmd {
    /// A kernel of `max(write lengths)` work-items. Work-item `i` starts from
    /// [`item_seed`]`(salt, i)`, mixes in element `i % len` of each read range in
    /// order, then writes element `i` of each write range that long.
    Kernel {
        /// Read ranges (may overlap each other, never a write range).
        reads: Vec<Span>,
        /// Write ranges (pairwise disjoint).
        writes: Vec<(Span, WMode)>,
        /// Salt.
        salt: u32,
        /// Launch shape.
        launch: Launch,
    },
    /// A host task with the same arithmetic as a kernel, on host accessors.
    HostTask {
        /// Read ranges.
        reads: Vec<Span>,
        /// Write ranges.
        writes: Vec<(Span, WMode)>,
        /// Salt.
        salt: u32,
    },
    /// `copy_range(src, src_off, dst, dst_off, len)` (same buffer: disjoint ranges).
    Copy {
        /// Source range.
        src: Span,
        /// Destination range (same length).
        dst: Span,
    },
    /// `fill_range(span, value)`.
    Fill {
        /// Filled range.
        span: Span,
        /// Value.
        value: u32,
    },
    /// `copy_from_host(data, buf, start)` with `data[i] = host_data(salt, i)`.
    CopyFromHost {
        /// Destination range.
        dst: Span,
        /// Salt of the data.
        salt: u32,
    },
    /// `copy_to_host(buf, range, readback)`; the readback is checked at the end.
    ReadBack {
        /// Source range.
        src: Span,
    },
}

impl Cmd {
    /// The ranges it reads and the ranges it writes.
    pub fn accesses(&self) -> (Vec<Span>, Vec<Span>) {
        match self {
            Cmd::Kernel { reads, writes, .. } | Cmd::HostTask { reads, writes, .. } => {
                (reads.clone(), writes.iter().map(|w| w.0).collect())
            }
            Cmd::Copy { src, dst } => (vec![*src], vec![*dst]),
            Cmd::Fill { span, .. } => (vec![], vec![*span]),
            Cmd::CopyFromHost { dst, .. } => (vec![], vec![*dst]),
            Cmd::ReadBack { src } => (vec![*src], vec![]),
        }
    }

    /// Whether this and `other` conflict: they touch a common element of one buffer
    /// and at least one of them writes it.
    pub fn conflicts_with(&self, other: &Cmd) -> bool {
        let (ra, wa) = self.accesses();
        let (rb, wb) = other.accesses();
        let any = |xs: &[Span], ys: &[Span]| xs.iter().any(|x| ys.iter().any(|y| x.overlaps(y)));
        any(&wa, &wb) || any(&wa, &rb) || any(&ra, &wb)
    }
}

impl fmt::Debug for Cmd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn rw(f: &mut fmt::Formatter<'_>, reads: &[Span], writes: &[(Span, WMode)]) -> fmt::Result {
            write!(f, " reads {reads:?} writes [")?;
            for (k, (s, m)) in writes.iter().enumerate() {
                if k > 0 {
                    write!(f, ", ")?;
                }
                write!(f, "{s:?} {}", m.short())?;
            }
            write!(f, "]")
        }
        match self {
            Cmd::Kernel { reads, writes, salt, launch } => {
                match launch {
                    Launch::Flat => write!(f, "kernel salt={salt:#x}")?,
                    Launch::Nd(l) => write!(f, "kernel(nd local {l}) salt={salt:#x}")?,
                }
                rw(f, reads, writes)
            }
            Cmd::HostTask { reads, writes, salt } => {
                write!(f, "host_task salt={salt:#x}")?;
                rw(f, reads, writes)
            }
            Cmd::Copy { src, dst } => write!(f, "copy {src:?} -> {dst:?}"),
            Cmd::Fill { span, value } => write!(f, "fill {span:?} = {value:#x}"),
            Cmd::CopyFromHost { dst, salt } => write!(f, "copy_from_host salt={salt:#x} -> {dst:?}"),
            Cmd::ReadBack { src } => write!(f, "copy_to_host {src:?}"),
        }
    }
}

/// One step of a program.
#[derive(Clone, PartialEq, Eq)]
pub enum Op {
    /// Submit a command group.
    Submit {
        /// Program queue index.
        queue: usize,
        /// Device.
        dev: Dev,
        /// Explicit `depends_on` edges to earlier submissions (op indices).
        deps: Vec<usize>,
        /// What it does.
        cmd: Cmd,
    },
    /// `event.wait()` on an earlier submission's event (op index).
    Wait(usize),
    /// `queue.wait()` on every Gantry queue of a program queue.
    QueueWait(usize),
    /// `rt.flush()`.
    Flush,
    /// `buf.to_vec()`; the snapshot is compared with the model at this point.
    Snapshot(usize),
    /// `buf.write()` and, on the host, `x[i] = mix(item_seed(salt, i), x[i])`.
    HostUpdate {
        /// Buffer.
        buf: usize,
        /// Salt.
        salt: u32,
    },
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Submit { queue, dev, deps, cmd } => {
                let d = match dev {
                    Dev::Cpu => "cpu",
                    Dev::Sim => "sim",
                };
                write!(f, "q{queue}@{d} {cmd:?}")?;
                if !deps.is_empty() {
                    write!(f, " after [")?;
                    for (k, d) in deps.iter().enumerate() {
                        if k > 0 {
                            write!(f, ", ")?;
                        }
                        write!(f, "#{d}")?;
                    }
                    write!(f, "]")?;
                }
                Ok(())
            }
            Op::Wait(k) => write!(f, "wait #{k}"),
            Op::QueueWait(q) => write!(f, "q{q}.wait()"),
            Op::Flush => write!(f, "flush"),
            Op::Snapshot(b) => write!(f, "b{b}.to_vec()"),
            Op::HostUpdate { buf, salt } => write!(f, "b{buf}.write() salt={salt:#x}"),
        }
    }
}

/// A buffer of a program.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BufferSpec {
    /// Elements.
    pub len: usize,
    /// Seed of its initial contents ([`initial_contents`]).
    pub seed: u32,
}

impl BufferSpec {
    /// Its initial contents.
    pub fn contents(&self) -> Vec<u32> {
        initial_contents(self.seed, self.len)
    }
}

/// A program: buffers, queues (their in-order flags) and ops.
#[derive(Clone, PartialEq, Eq)]
pub struct Program {
    /// Buffers.
    pub buffers: Vec<BufferSpec>,
    /// Queues: whether each is in-order.
    pub queues: Vec<bool>,
    /// Ops, in program order.
    pub ops: Vec<Op>,
}

impl fmt::Debug for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Program {{")?;
        write!(f, "  buffers:")?;
        for (i, b) in self.buffers.iter().enumerate() {
            write!(f, " b{i}[{}] (seed {:#x});", b.len, b.seed)?;
        }
        writeln!(f)?;
        write!(f, "  queues:")?;
        for (i, q) in self.queues.iter().enumerate() {
            write!(f, " q{i} {};", if *q { "in-order" } else { "out-of-order" })?;
        }
        writeln!(f)?;
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  #{i:<3} {op:?}")?;
        }
        write!(f, "}}")
    }
}

impl Program {
    /// Indices of the submissions.
    pub fn submissions(&self) -> impl Iterator<Item = (usize, &Op)> {
        self.ops.iter().enumerate().filter(|(_, op)| matches!(op, Op::Submit { .. }))
    }
}

// ---------------------------------------------------------------------------------
// The generator: raw numbers -> valid program
// ---------------------------------------------------------------------------------

/// What a generated program may contain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenOptions {
    /// Submissions may go to the simulated device.
    pub sim: bool,
    /// Queues may be in-order.
    pub in_order: bool,
    /// Submissions may carry explicit `depends_on` edges.
    pub deps: bool,
    /// Host-side synchronization: event and queue waits, flushes, `to_vec`, `write`.
    pub host_sync: bool,
    /// Host transfers: `copy_from_host`, `copy_to_host`.
    pub transfers: bool,
}

impl GenOptions {
    /// Everything.
    pub const ALL: GenOptions = GenOptions { sim: true, in_order: true, deps: true, host_sync: true, transfers: true };
    /// Device commands only, on out-of-order CPU queues, no explicit dependencies.
    pub const IMPLICIT_ONLY: GenOptions =
        GenOptions { sim: false, in_order: false, deps: false, host_sync: false, transfers: true };
}

/// A raw range: decoded against the buffers' lengths.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawSpan {
    /// Buffer (modulo the buffer count).
    pub buf: u8,
    /// Start (modulo the length).
    pub start: u8,
    /// Length - 1 (modulo the room left).
    pub len: u8,
    /// The whole buffer.
    pub whole: bool,
}

/// A raw op: decoded against the program so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawOp {
    /// Which op (weighted, see [`Program::decode`]).
    pub kind: u8,
    /// Queue (modulo the queue count).
    pub queue: u8,
    /// On the simulated device.
    pub sim: bool,
    /// Explicit dependencies (each modulo the earlier submissions).
    pub deps: Vec<u8>,
    /// Ranges: writes come from the first two, reads from the last two.
    pub spans: [RawSpan; 4],
    /// Write modes.
    pub modes: [u8; 2],
    /// Read and write counts.
    pub counts: u8,
    /// Salt or value.
    pub salt: u32,
    /// Launch shape, copy direction, wait target.
    pub aux: u8,
}

/// A raw program.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawProgram {
    /// Buffers: (length - 1 modulo [`MAX_LEN`], seed). At least one is used.
    pub buffers: Vec<(u8, u32)>,
    /// Queues' in-order flags. At least one is used.
    pub queues: Vec<bool>,
    /// Ops.
    pub ops: Vec<RawOp>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fill,
    Kernel,
    Copy,
    HostTask,
    CopyFromHost,
    ReadBack,
    Wait,
    QueueWait,
    Flush,
    Snapshot,
    HostUpdate,
}

/// Kinds and their weights; the simplest first, so shrinking a kind goes there.
const KINDS: [(Kind, u8); 11] = [
    (Kind::Fill, 2),
    (Kind::Kernel, 6),
    (Kind::Copy, 3),
    (Kind::HostTask, 3),
    (Kind::CopyFromHost, 1),
    (Kind::ReadBack, 1),
    (Kind::Wait, 1),
    (Kind::QueueWait, 1),
    (Kind::Flush, 1),
    (Kind::Snapshot, 1),
    (Kind::HostUpdate, 1),
];

impl Kind {
    fn allowed(self, o: &GenOptions) -> bool {
        match self {
            Kind::CopyFromHost | Kind::ReadBack => o.transfers,
            Kind::Wait | Kind::QueueWait | Kind::Flush | Kind::Snapshot | Kind::HostUpdate => o.host_sync,
            _ => true,
        }
    }
}

fn span(raw: &RawSpan, buffers: &[BufferSpec]) -> Span {
    let buf = raw.buf as usize % buffers.len();
    let len = buffers[buf].len;
    if raw.whole {
        return Span { buf, start: 0, end: len };
    }
    let start = raw.start as usize % len;
    let n = 1 + raw.len as usize % (len - start);
    Span { buf, start, end: start + n }
}

fn wmode(m: u8) -> WMode {
    match m % 3 {
        0 => WMode::Write,
        1 => WMode::ReadWrite,
        _ => WMode::DiscardWrite,
    }
}

/// Decodes accessors: writes first (each dropped if it overlaps an earlier write),
/// then reads (each dropped if it overlaps a write).
fn accessors(raw: &RawOp, buffers: &[BufferSpec], nreads: usize, nwrites: usize) -> (Vec<Span>, Vec<(Span, WMode)>) {
    let mut writes: Vec<(Span, WMode)> = Vec::new();
    for k in 0..nwrites {
        let s = span(&raw.spans[k], buffers);
        if writes.iter().all(|(w, _)| !w.overlaps(&s)) {
            writes.push((s, wmode(raw.modes[k])));
        }
    }
    let mut reads = Vec::new();
    for k in 0..nreads {
        let s = span(&raw.spans[2 + k], buffers);
        if writes.iter().all(|(w, _)| !w.overlaps(&s)) {
            reads.push(s);
        }
    }
    (reads, writes)
}

fn copy(raw: &RawOp, buffers: &[BufferSpec]) -> Option<Cmd> {
    let (a, b) = (&raw.spans[0], &raw.spans[1]);
    let nb = buffers.len();
    let src = a.buf as usize % nb;
    let mut dst = b.buf as usize % nb;
    if src == dst && buffers[src].len < 2 {
        if nb == 1 {
            return None;
        }
        dst = (src + 1) % nb;
    }
    if src == dst {
        let l = buffers[src].len;
        let len = 1 + a.len as usize % (l / 2);
        let free = l - 2 * len;
        let p = a.start as usize % (free + 1);
        let q = b.start as usize % (free - p + 1);
        let (lo, hi) = (p, p + len + q);
        let (so, dof) = if raw.aux & 1 == 0 { (lo, hi) } else { (hi, lo) };
        return Some(Cmd::Copy {
            src: Span { buf: src, start: so, end: so + len },
            dst: Span { buf: dst, start: dof, end: dof + len },
        });
    }
    let (ls, ld) = (buffers[src].len, buffers[dst].len);
    let m = ls.min(ld);
    let len = if a.whole { m } else { 1 + a.len as usize % m };
    let so = a.start as usize % (ls - len + 1);
    let dof = if b.whole { 0 } else { b.start as usize % (ld - len + 1) };
    Some(Cmd::Copy {
        src: Span { buf: src, start: so, end: so + len },
        dst: Span { buf: dst, start: dof, end: dof + len },
    })
}

impl Program {
    /// Decodes a raw program into a valid one. Every raw program decodes; raw ops that
    /// cannot make a valid op (a wait before any submission) are dropped.
    pub fn decode(raw: &RawProgram, opts: &GenOptions) -> Program {
        let mut buffers: Vec<BufferSpec> = raw
            .buffers
            .iter()
            .take(MAX_BUFFERS)
            .map(|&(l, seed)| BufferSpec { len: 1 + l as usize % MAX_LEN, seed })
            .collect();
        if buffers.is_empty() {
            buffers.push(BufferSpec { len: 1, seed: 0 });
        }
        let mut queues: Vec<bool> = raw.queues.iter().take(MAX_QUEUES).map(|&q| q && opts.in_order).collect();
        if queues.is_empty() {
            queues.push(false);
        }
        let kinds: Vec<(Kind, u8)> = KINDS.iter().copied().filter(|(k, _)| k.allowed(opts)).collect();
        let total: u32 = kinds.iter().map(|&(_, w)| w as u32).sum();
        let mut ops = Vec::new();
        let mut submits: Vec<usize> = Vec::new();
        for r in &raw.ops {
            let mut pick = r.kind as u32 % total;
            let mut kind = kinds[0].0;
            for &(k, w) in &kinds {
                if pick < w as u32 {
                    kind = k;
                    break;
                }
                pick -= w as u32;
            }
            let nq = queues.len();
            let cmd = match kind {
                Kind::Fill => Some(Cmd::Fill { span: span(&r.spans[0], &buffers), value: r.salt }),
                Kind::Kernel => {
                    let (reads, writes) =
                        accessors(r, &buffers, r.counts as usize % 3, 1 + (r.counts as usize / 3) % 2);
                    let launch = match r.aux % 5 {
                        0 => Launch::Flat,
                        k => Launch::Nd(1 << (k - 1)),
                    };
                    Some(Cmd::Kernel { reads, writes, salt: r.salt, launch })
                }
                Kind::HostTask => {
                    let (reads, writes) = accessors(r, &buffers, r.counts as usize % 3, (r.counts as usize / 3) % 3);
                    Some(Cmd::HostTask { reads, writes, salt: r.salt })
                }
                Kind::Copy => copy(r, &buffers),
                Kind::CopyFromHost => Some(Cmd::CopyFromHost { dst: span(&r.spans[0], &buffers), salt: r.salt }),
                Kind::ReadBack => Some(Cmd::ReadBack { src: span(&r.spans[0], &buffers) }),
                _ => None,
            };
            let op = match (kind, cmd) {
                (_, Some(cmd)) => {
                    let mut deps = BTreeSet::new();
                    if opts.deps && !submits.is_empty() {
                        for &d in &r.deps {
                            deps.insert(submits[d as usize % submits.len()]);
                        }
                    }
                    let dev = if opts.sim && r.sim { Dev::Sim } else { Dev::Cpu };
                    Op::Submit { queue: r.queue as usize % nq, dev, deps: deps.into_iter().collect(), cmd }
                }
                (Kind::Wait, _) if !submits.is_empty() => {
                    // Favour recent submissions.
                    let back = r.aux as usize % submits.len();
                    Op::Wait(submits[submits.len() - 1 - back])
                }
                (Kind::QueueWait, _) => Op::QueueWait(r.queue as usize % nq),
                (Kind::Flush, _) => Op::Flush,
                (Kind::Snapshot, _) => Op::Snapshot(r.spans[0].buf as usize % buffers.len()),
                (Kind::HostUpdate, _) => Op::HostUpdate { buf: r.spans[0].buf as usize % buffers.len(), salt: r.salt },
                _ => continue,
            };
            if matches!(op, Op::Submit { .. }) {
                submits.push(ops.len());
            }
            ops.push(op);
        }
        Program { buffers, queues, ops }
    }
}

// ---------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------

/// What a run of a program produces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Final contents of every buffer.
    pub buffers: Vec<Vec<u32>>,
    /// `(op index, contents)` of every [`Op::Snapshot`].
    pub snapshots: Vec<(usize, Vec<u32>)>,
    /// `(op index, data)` of every [`Cmd::ReadBack`].
    pub readbacks: Vec<(usize, Vec<u32>)>,
}

fn first_diff(a: &[u32], b: &[u32]) -> String {
    if a.len() != b.len() {
        return format!("lengths {} vs {}", a.len(), b.len());
    }
    let bad: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
    let shown: Vec<String> =
        bad.iter().take(6).map(|&i| format!("[{i}] model {:#010x} gantry {:#010x}", a[i], b[i])).collect();
    format!("{} of {} elements differ at {:?}: {}", bad.len(), a.len(), &bad[..bad.len().min(16)], shown.join(", "))
}

impl Outcome {
    /// `None` if `got` equals this (the model's) outcome, else a readable description
    /// of the differences.
    pub fn mismatch(&self, got: &Outcome) -> Option<String> {
        let mut out = Vec::new();
        for (i, (m, g)) in self.buffers.iter().zip(&got.buffers).enumerate() {
            if m != g {
                out.push(format!("final b{i}: {}", first_diff(m, g)));
            }
        }
        for ((op, m), (_, g)) in self.snapshots.iter().zip(&got.snapshots) {
            if m != g {
                out.push(format!("snapshot at #{op}: {}", first_diff(m, g)));
            }
        }
        for ((op, m), (_, g)) in self.readbacks.iter().zip(&got.readbacks) {
            if m != g {
                out.push(format!("readback of #{op}: {}", first_diff(m, g)));
            }
        }
        if self.buffers.len() != got.buffers.len()
            || self.snapshots.len() != got.snapshots.len()
            || self.readbacks.len() != got.readbacks.len()
        {
            out.push("different numbers of buffers, snapshots or readbacks".into());
        }
        (!out.is_empty()).then(|| out.join("\n"))
    }
}

/// Kernel/host-task semantics on plain vectors.
fn model_compute(bufs: &mut [Vec<u32>], reads: &[Span], writes: &[(Span, WMode)], salt: u32) {
    let read_data: Vec<Vec<u32>> = reads.iter().map(|s| bufs[s.buf][s.start..s.end].to_vec()).collect();
    for (k, (w, mode)) in writes.iter().enumerate() {
        for i in 0..w.len() {
            let mut acc = item_seed(salt, i);
            for r in &read_data {
                acc = mix(acc, r[i % r.len()]);
            }
            let slot = &mut bufs[w.buf][w.start + i];
            match mode {
                WMode::Write => {
                    if write_mask(salt, k, i) {
                        *slot = out_value(acc, k);
                    }
                }
                WMode::DiscardWrite => *slot = out_value(acc, k),
                WMode::ReadWrite => *slot = rw_value(acc, k, *slot),
            }
        }
    }
}

/// Runs a program serially, in program order, on plain vectors.
pub fn run_model(p: &Program) -> Outcome {
    let mut bufs: Vec<Vec<u32>> = p.buffers.iter().map(BufferSpec::contents).collect();
    let mut out = Outcome::default();
    for (i, op) in p.ops.iter().enumerate() {
        match op {
            Op::Submit { cmd, .. } => match cmd {
                Cmd::Kernel { reads, writes, salt, .. } | Cmd::HostTask { reads, writes, salt } => {
                    model_compute(&mut bufs, reads, writes, *salt)
                }
                Cmd::Copy { src, dst } => {
                    let data = bufs[src.buf][src.start..src.end].to_vec();
                    bufs[dst.buf][dst.start..dst.end].copy_from_slice(&data);
                }
                Cmd::Fill { span, value } => bufs[span.buf][span.start..span.end].fill(*value),
                Cmd::CopyFromHost { dst, salt } => {
                    for k in 0..dst.len() {
                        bufs[dst.buf][dst.start + k] = host_data(*salt, k);
                    }
                }
                Cmd::ReadBack { src } => out.readbacks.push((i, bufs[src.buf][src.start..src.end].to_vec())),
            },
            Op::Snapshot(b) => out.snapshots.push((i, bufs[*b].clone())),
            Op::HostUpdate { buf, salt } => {
                for (k, x) in bufs[*buf].iter_mut().enumerate() {
                    *x = mix(item_seed(*salt, k), *x);
                }
            }
            Op::Wait(_) | Op::QueueWait(_) | Op::Flush => {}
        }
    }
    out.buffers = bufs;
    out
}

// ---------------------------------------------------------------------------------
// Running through Gantry
// ---------------------------------------------------------------------------------

/// How to build the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Scheduler mode.
    pub mode: gantry::Mode,
    /// CPU kernel worker threads.
    pub workers: usize,
    /// CPU host-task threads.
    pub host_threads: usize,
    /// CPU `inline_items`: kernels of one group up to this size, and copies and fills
    /// up to 4× this many bytes, run inline (0: everything goes to the pools).
    pub inline_items: usize,
    /// Add a simulated device (device 1). Without it, `Dev::Sim` submissions go to
    /// the CPU.
    pub sim: bool,
}

impl Config {
    /// Manual mode, everything inline.
    pub fn manual(sim: bool) -> Config {
        Config { mode: gantry::Mode::Manual, workers: 0, host_threads: 0, inline_items: 0, sim }
    }
    /// Threaded mode with `workers` kernel threads, two host-task threads, nothing inline.
    pub fn threaded(workers: usize, sim: bool) -> Config {
        Config { mode: gantry::Mode::Threaded, workers, host_threads: 2, inline_items: 0, sim }
    }
    /// Builds the runtime.
    pub fn build(&self) -> Runtime {
        let mut b = Runtime::builder().mode(self.mode).cpu(CpuConfig {
            worker_threads: self.workers,
            host_threads: self.host_threads,
            inline_items: self.inline_items,
        });
        if self.sim {
            b = b.sim(SimConfig::default());
        }
        b.build()
    }
}

#[derive(Clone, Copy)]
enum KW {
    W(Accessor<u32, Write>),
    Rw(Accessor<u32, ReadWrite>),
    D(Accessor<u32, DiscardWrite>),
}

enum HW {
    W(HostAccessor<u32, Write>),
    Rw(HostAccessor<u32, ReadWrite>),
    D(HostAccessor<u32, DiscardWrite>),
}

/// A program being run through Gantry, op by op.
pub struct Session {
    config: Config,
    rt: Runtime,
    /// Buffers of the program.
    pub buffers: Vec<gantry::Buffer<u32>>,
    /// `queues[q]`: the Gantry queues of program queue `q`, per device.
    queues: Vec<Vec<(Dev, Queue)>>,
    events: Vec<Option<Event>>,
    readbacks: Vec<(usize, Readback<u32>)>,
    snapshots: Vec<(usize, Vec<u32>)>,
}

impl Session {
    /// Builds the runtime, buffers and queues of `p`.
    pub fn new(p: &Program, config: Config) -> Session {
        let rt = config.build();
        let buffers = p.buffers.iter().map(|b| rt.buffer(&b.contents())).collect();
        let queues = p
            .queues
            .iter()
            .map(|&in_order| {
                [Dev::Cpu, Dev::Sim]
                    .into_iter()
                    .map(|d| {
                        let device = if d == Dev::Sim && config.sim { 1 } else { 0 };
                        (d, rt.queue_with(QueueOptions { device, in_order }).expect("device exists"))
                    })
                    .collect()
            })
            .collect();
        Session { config, rt, buffers, queues, events: vec![None; p.ops.len()], readbacks: vec![], snapshots: vec![] }
    }

    /// The runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The event of submission `i`.
    pub fn event(&self, i: usize) -> Option<&Event> {
        self.events.get(i).and_then(Option::as_ref)
    }

    fn queue(&self, q: usize, dev: Dev) -> &Queue {
        &self.queues[q].iter().find(|(d, _)| *d == dev).expect("queue").1
    }

    /// Runs op `i` of the program.
    pub fn step(&mut self, i: usize, op: &Op) -> Result<(), String> {
        match op {
            Op::Submit { queue, dev, deps, cmd } => {
                let deps: Vec<Event> =
                    deps.iter().map(|&d| self.events[d].clone().expect("dependency on a submission")).collect();
                let q = self.queue(*queue, *dev).clone();
                let bufs = &self.buffers;
                let mut readback = None;
                let ev = q
                    .submit(|cg| {
                        for d in &deps {
                            cg.depends_on(d);
                        }
                        build(cg, bufs, cmd, &mut readback);
                    })
                    .map_err(|e| format!("#{i}: submit failed: {e}"))?;
                if let Some(rb) = readback {
                    self.readbacks.push((i, rb));
                }
                self.events[i] = Some(ev);
            }
            Op::Wait(k) => {
                let ev = self.events[*k].as_ref().ok_or_else(|| format!("#{i}: wait on non-submission #{k}"))?;
                ev.wait().map_err(|e| format!("#{i}: waiting on #{k} failed: {e}"))?;
                if !ev.is_complete() {
                    return Err(format!("#{i}: #{k} not complete after wait: {:?}", ev.status()));
                }
            }
            Op::QueueWait(q) => {
                for (_, queue) in &self.queues[*q] {
                    queue.wait().map_err(|e| format!("#{i}: q{q}.wait() failed: {e}"))?;
                }
            }
            Op::Flush => self.rt.flush(),
            Op::Snapshot(b) => {
                let v = self.buffers[*b].to_vec().map_err(|e| format!("#{i}: to_vec failed: {e}"))?;
                self.snapshots.push((i, v));
            }
            Op::HostUpdate { buf, salt } => {
                let mut w = self.buffers[*buf].write().map_err(|e| format!("#{i}: write() failed: {e}"))?;
                for (k, x) in w.iter_mut().enumerate() {
                    *x = mix(item_seed(*salt, k), *x);
                }
            }
        }
        Ok(())
    }

    /// Waits for everything, checks every event succeeded and returns the outcome.
    pub fn finish(self) -> Result<Outcome, String> {
        for (i, ev) in self.events.iter().enumerate() {
            if let Some(ev) = ev {
                ev.wait().map_err(|e| format!("#{i} failed: {e}"))?;
            }
        }
        let mut out = Outcome { snapshots: self.snapshots, ..Default::default() };
        for (i, b) in self.buffers.iter().enumerate() {
            out.buffers.push(b.to_vec().map_err(|e| format!("final to_vec of b{i} failed: {e}"))?);
        }
        for (i, rb) in &self.readbacks {
            let data = rb.take().ok_or_else(|| format!("readback of #{i} is empty after its event completed"))?;
            out.readbacks.push((*i, data));
        }
        self.rt.wait_idle().map_err(|e| format!("wait_idle failed: {e}"))?;
        let stats = self.rt.stats();
        if stats.live_commands != 0 || stats.in_driver != 0 || stats.failed != 0 {
            return Err(format!("after wait_idle ({:?}): {stats:?}", self.config));
        }
        Ok(out)
    }
}

fn build(cg: &mut gantry::Handler, bufs: &[gantry::Buffer<u32>], cmd: &Cmd, readback: &mut Option<Readback<u32>>) {
    match cmd {
        Cmd::Kernel { reads, writes, salt, launch } => {
            let salt = *salt;
            let ra: Vec<Accessor<u32, Read>> =
                reads.iter().map(|s| cg.access::<u32, Read>(&bufs[s.buf], s.start..s.end)).collect();
            let wa: Vec<KW> = writes
                .iter()
                .map(|(s, m)| {
                    let (b, r) = (&bufs[s.buf], s.start..s.end);
                    match m {
                        WMode::Write => KW::W(cg.access::<u32, Write>(b, r)),
                        WMode::ReadWrite => KW::Rw(cg.access::<u32, ReadWrite>(b, r)),
                        WMode::DiscardWrite => KW::D(cg.access::<u32, DiscardWrite>(b, r)),
                    }
                })
                .collect();
            let n = writes.iter().map(|(s, _)| s.len()).max().unwrap_or(1);
            let body = move |it: &mut Item<'_>| {
                let i = it.global_linear_id();
                if i >= n {
                    return;
                }
                let mut acc = item_seed(salt, i);
                for r in &ra {
                    acc = mix(acc, r.get(it, i % r.len()));
                }
                for (k, w) in wa.iter().enumerate() {
                    match *w {
                        KW::W(a) if i < a.len() => {
                            if write_mask(salt, k, i) {
                                a.set(it, i, out_value(acc, k));
                            }
                        }
                        KW::D(a) if i < a.len() => a.set(it, i, out_value(acc, k)),
                        KW::Rw(a) if i < a.len() => a.set(it, i, rw_value(acc, k, a.get(it, i))),
                        _ => {}
                    }
                }
            };
            match launch {
                Launch::Flat => cg.parallel_for(n, body),
                Launch::Nd(local) => cg.parallel_for_nd(NdRange::new(n.div_ceil(*local) * local, *local), body),
            }
        }
        Cmd::HostTask { reads, writes, salt } => {
            let salt = *salt;
            let ra: Vec<HostAccessor<u32, Read>> =
                reads.iter().map(|s| cg.host_access::<u32, Read>(&bufs[s.buf], s.start..s.end)).collect();
            let mut wa: Vec<HW> = writes
                .iter()
                .map(|(s, m)| {
                    let (b, r) = (&bufs[s.buf], s.start..s.end);
                    match m {
                        WMode::Write => HW::W(cg.host_access::<u32, Write>(b, r)),
                        WMode::ReadWrite => HW::Rw(cg.host_access::<u32, ReadWrite>(b, r)),
                        WMode::DiscardWrite => HW::D(cg.host_access::<u32, DiscardWrite>(b, r)),
                    }
                })
                .collect();
            cg.host_task(move |ctx| {
                let read_data: Vec<&[u32]> = ra.iter().map(|a| a.as_slice(ctx)).collect();
                let acc_of = |i: usize| read_data.iter().fold(item_seed(salt, i), |acc, r| mix(acc, r[i % r.len()]));
                for (k, w) in wa.iter_mut().enumerate() {
                    match w {
                        HW::W(a) => {
                            for (i, x) in a.as_mut_slice(ctx).iter_mut().enumerate() {
                                if write_mask(salt, k, i) {
                                    *x = out_value(acc_of(i), k);
                                }
                            }
                        }
                        HW::D(a) => {
                            for (i, x) in a.as_mut_slice(ctx).iter_mut().enumerate() {
                                *x = out_value(acc_of(i), k);
                            }
                        }
                        HW::Rw(a) => {
                            for (i, x) in a.as_mut_slice(ctx).iter_mut().enumerate() {
                                *x = rw_value(acc_of(i), k, *x);
                            }
                        }
                    }
                }
            });
        }
        Cmd::Copy { src, dst } => cg.copy_range(&bufs[src.buf], src.start, &bufs[dst.buf], dst.start, src.len()),
        Cmd::Fill { span, value } => cg.fill_range(&bufs[span.buf], span.start..span.end, *value),
        Cmd::CopyFromHost { dst, salt } => {
            let data: Vec<u32> = (0..dst.len()).map(|k| host_data(*salt, k)).collect();
            cg.copy_from_host(&data, &bufs[dst.buf], dst.start);
        }
        Cmd::ReadBack { src } => {
            let rb = Readback::new();
            cg.copy_to_host(&bufs[src.buf], src.start..src.end, &rb);
            *readback = Some(rb);
        }
    }
}

/// Runs a program through Gantry and returns its outcome, or the first error.
pub fn run_gantry_outcome(p: &Program, config: Config) -> Result<Outcome, String> {
    let mut s = Session::new(p, config);
    for (i, op) in p.ops.iter().enumerate() {
        s.step(i, op)?;
    }
    s.finish()
}

/// Runs a program through Gantry and returns all buffers' final contents.
///
/// # Panics
/// If a submission is refused or a command fails.
pub fn run_gantry(p: &Program, config: Config) -> Vec<Vec<u32>> {
    match run_gantry_outcome(p, config) {
        Ok(o) => o.buffers,
        Err(e) => panic!("{e}"),
    }
}

/// Checks that Gantry under `config` produces the model's outcome for `p`.
pub fn check(p: &Program, config: Config) -> Result<(), String> {
    let model = run_model(p);
    let got = run_gantry_outcome(p, config)?;
    match model.mismatch(&got) {
        None => Ok(()),
        Some(m) => Err(format!("{config:?}: Gantry differs from the model:\n{m}")),
    }
}
