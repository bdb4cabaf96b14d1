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
//!   Its [`Outcome`] holds the final buffers, every mid-program `to_vec` snapshot,
//!   every `copy_to_host` readback and a digest of what every host task read.
//! * [`run_gantry`] / [`run_gantry_watched`] / [`Session`]: executes it through Gantry
//!   under a [`Config`]; [`check`] compares the two, reporting a hang (with the
//!   scheduler's live commands) after [`hang_timeout`].
//! * [`Program::parse`]: reads a program back from its `Debug` form, so a failing
//!   case printed by a property can be pasted into a regression test.
//!
//! The arithmetic of kernels and host tasks is order-sensitive ([`mix`]): a missing
//! dependency, a stale device copy or a lost partial write shows up as wrong data.
//!
//! Environment: `GANTRY_PROPTEST_CASES=N` runs `N` cases per property (the tests'
//! defaults total about 10,000 cases); `GANTRY_PROPTEST_TIMEOUT_MS` sets the hang
//! timeout (default 10 s).

use std::collections::BTreeSet;
use std::fmt;

use gantry::{
    Accessor, CancelReason, CpuConfig, DiscardWrite, Event, FusionOutcome, FusionProps, HostAccessor, Item,
    NdRange, Promotion, Queue, QueueOptions, Read, ReadWrite, Readback, Runtime, SimConfig, Write,
};

pub mod fusion;
pub mod graph;

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
    /// An elementwise kernel, `cg.map(&read, &write, f)`: exactly one read range at
    /// least as long as the one write range, which is a discard-write. `f` sees only
    /// the element, so the work-item's seed is [`item_seed`]`(salt, 0)` for every `i`.
    Map,
}

impl Launch {
    /// `Map` if a kernel of these accesses can be one (see [`Launch::Map`]).
    pub fn map_fits(reads: &[Span], writes: &[(Span, WMode)]) -> bool {
        matches!((reads, writes), ([r], [(w, WMode::DiscardWrite)]) if r.len() >= w.len() && !w.is_empty())
    }
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
        /// Fusion promotion hints: every accessor of these buffers gets
        /// `cg.promote(&accessor, promotion)` (only in fusion programs, see [`fusion`]).
        promote: Vec<(usize, Promotion)>,
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
            Cmd::Kernel { reads, writes, salt, launch, promote } => {
                match launch {
                    Launch::Flat => write!(f, "kernel salt={salt:#x}")?,
                    Launch::Nd(l) => write!(f, "kernel(nd local {l}) salt={salt:#x}")?,
                    Launch::Map => write!(f, "kernel(map) salt={salt:#x}")?,
                }
                rw(f, reads, writes)?;
                if !promote.is_empty() {
                    write!(f, " promote [")?;
                    for (k, (b, p)) in promote.iter().enumerate() {
                        if k > 0 {
                            write!(f, ", ")?;
                        }
                        write!(f, "b{b} {}", promotion_name(*p))?;
                    }
                    write!(f, "]")?;
                }
                Ok(())
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
    /// `event.wait()` on an earlier submission's event (op index); printed `#k.wait()`.
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
    /// Drops the program's (only) handle of a buffer; commands submitted before still
    /// use it. Later ops do not name it; its final contents are not compared.
    Drop(usize),
    /// `start_fusion()` on the Gantry queue of program queue `queue` on `dev` (fusion
    /// programs only, see [`fusion`]).
    StartFusion {
        /// Program queue index.
        queue: usize,
        /// Device.
        dev: Dev,
    },
    /// `complete_fusion(FusionProps { barriers })` on that queue; its event becomes this
    /// op's (waits and `depends_on` may name it). With `wait`, the host then waits on
    /// it and checks the fusion's outcome.
    CompleteFusion {
        /// Program queue index.
        queue: usize,
        /// Device.
        dev: Dev,
        /// A work-group barrier between the fused kernels (`false`: `no_barriers`).
        barriers: bool,
        /// Wait on the fusion's event right away.
        wait: bool,
    },
    /// `cancel_fusion()` on that queue.
    CancelFusion {
        /// Program queue index.
        queue: usize,
        /// Device.
        dev: Dev,
    },
    /// `buf.set_promotion(promotion)`: the buffer's contents after a fusion that
    /// internalizes it are undefined, so its final contents are not compared.
    SetPromotion {
        /// Buffer.
        buf: usize,
        /// The hint.
        promotion: Promotion,
    },
}

fn dev_name(d: Dev) -> &'static str {
    match d {
        Dev::Cpu => "cpu",
        Dev::Sim => "sim",
    }
}

fn promotion_name(p: Promotion) -> &'static str {
    match p {
        Promotion::None => "none",
        Promotion::Local => "local",
        Promotion::Private => "private",
    }
}

fn parse_promotion(s: &str) -> Result<Promotion, String> {
    match s {
        "none" => Ok(Promotion::None),
        "local" => Ok(Promotion::Local),
        "private" => Ok(Promotion::Private),
        _ => Err(format!("bad promotion `{s}`")),
    }
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Submit { queue, dev, deps, cmd } => {
                write!(f, "q{queue}@{} {cmd:?}", dev_name(*dev))?;
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
            Op::Wait(k) => write!(f, "#{k}.wait()"),
            Op::QueueWait(q) => write!(f, "q{q}.wait()"),
            Op::Flush => write!(f, "flush"),
            Op::Snapshot(b) => write!(f, "b{b}.to_vec()"),
            Op::HostUpdate { buf, salt } => write!(f, "b{buf}.write() salt={salt:#x}"),
            Op::Drop(b) => write!(f, "drop b{b}"),
            Op::StartFusion { queue, dev } => write!(f, "q{queue}@{}.start_fusion()", dev_name(*dev)),
            Op::CompleteFusion { queue, dev, barriers, wait } => write!(
                f,
                "q{queue}@{}.complete_fusion({}){}",
                dev_name(*dev),
                if *barriers { "barriers" } else { "no_barriers" },
                if *wait { " wait" } else { "" }
            ),
            Op::CancelFusion { queue, dev } => write!(f, "q{queue}@{}.cancel_fusion()", dev_name(*dev)),
            Op::SetPromotion { buf, promotion } => {
                write!(f, "b{buf}.set_promotion({})", promotion_name(*promotion))
            }
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

/// Writes the `buffers:` and `queues:` lines of a program's `Debug` form.
pub(crate) fn write_header(
    f: &mut fmt::Formatter<'_>,
    buffers: &[BufferSpec],
    queues: &[bool],
) -> fmt::Result {
    write!(f, "  buffers:")?;
    for (i, b) in buffers.iter().enumerate() {
        write!(f, " b{i}[{}] (seed {:#x});", b.len, b.seed)?;
    }
    writeln!(f)?;
    write!(f, "  queues:")?;
    for (i, q) in queues.iter().enumerate() {
        write!(f, " q{i} {};", if *q { "in-order" } else { "out-of-order" })?;
    }
    writeln!(f)
}

/// Parses what [`write_header`] wrote: the words after `buffers:` up to `queues:`, and
/// the words after `queues:` up to the next section.
pub(crate) fn parse_header(
    buffers: &[&str],
    queues: &[&str],
) -> Result<(Vec<BufferSpec>, Vec<bool>), String> {
    let mut specs = Vec::new();
    for chunk in buffers.chunks(3) {
        let [name, _, seed] = chunk else { return Err(format!("bad buffer `{chunk:?}`")) };
        let len = name.split_once('[').ok_or("buffer length")?.1.trim_end_matches(']');
        specs.push(BufferSpec { len: num(len)? as usize, seed: num(seed)? as u32 });
    }
    Ok((specs, queues.chunks(2).map(|c| c.get(1) == Some(&"in-order;")).collect()))
}

impl fmt::Debug for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Program {{")?;
        write_header(f, &self.buffers, &self.queues)?;
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
    /// Dropping buffer handles while commands still use them.
    pub drops: bool,
}

impl GenOptions {
    /// Everything.
    pub const ALL: GenOptions =
        GenOptions { sim: true, in_order: true, deps: true, host_sync: true, transfers: true, drops: true };
    /// Device commands only, on out-of-order CPU queues, no explicit dependencies.
    pub const IMPLICIT_ONLY: GenOptions = GenOptions {
        sim: false,
        in_order: false,
        deps: false,
        host_sync: false,
        transfers: true,
        drops: false,
    };
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
    Drop,
}

/// Kinds and their weights; the simplest first, so shrinking a kind goes there.
const KINDS: [(Kind, u8); 12] = [
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
    (Kind::Drop, 1),
];

impl Kind {
    fn allowed(self, o: &GenOptions) -> bool {
        match self {
            Kind::CopyFromHost | Kind::ReadBack => o.transfers,
            Kind::Wait | Kind::QueueWait | Kind::Flush | Kind::Snapshot | Kind::HostUpdate => o.host_sync,
            Kind::Drop => o.drops,
            _ => true,
        }
    }
}

/// The live buffers of a program being decoded: their specs and which are not dropped.
struct Live<'a> {
    specs: &'a [BufferSpec],
    live: Vec<usize>,
}

impl Live<'_> {
    /// The `raw`-th live buffer (modulo their number).
    fn pick(&self, raw: u8) -> usize {
        self.live[raw as usize % self.live.len()]
    }
}

fn span(raw: &RawSpan, buffers: &Live<'_>) -> Span {
    let buf = buffers.pick(raw.buf);
    let buffers = buffers.specs;
    let len = buffers[buf].len;
    if raw.whole {
        return Span { buf, start: 0, end: len };
    }
    let start = raw.start as usize % len;
    let n = 1 + raw.len as usize % (len - start);
    Span { buf, start, end: start + n }
}

/// Write modes: half `ReadWrite` (accumulating: keeps earlier writes observable).
fn wmode(m: u8) -> WMode {
    match m % 4 {
        0 => WMode::Write,
        1 | 2 => WMode::ReadWrite,
        _ => WMode::DiscardWrite,
    }
}

/// Decodes accessors: writes first (each dropped if it overlaps an earlier write),
/// then reads (each dropped if it overlaps a write).
fn accessors(
    raw: &RawOp,
    buffers: &Live<'_>,
    nreads: usize,
    nwrites: usize,
) -> (Vec<Span>, Vec<(Span, WMode)>) {
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

/// The command of a submitting kind other than a kernel (generators differ on kernels).
fn plain_cmd(kind: Kind, r: &RawOp, live: &Live<'_>) -> Option<Cmd> {
    match kind {
        Kind::Fill => Some(Cmd::Fill { span: span(&r.spans[0], live), value: r.salt }),
        Kind::HostTask => {
            // Mostly one or two writes: a host task that writes nothing checks little.
            let nwrites = [0, 1, 1, 2, 2][(r.counts as usize / 3) % 5];
            let (reads, writes) = accessors(r, live, r.counts as usize % 3, nwrites);
            Some(Cmd::HostTask { reads, writes, salt: r.salt })
        }
        Kind::Copy => copy(r, live),
        Kind::CopyFromHost => Some(Cmd::CopyFromHost { dst: span(&r.spans[0], live), salt: r.salt }),
        Kind::ReadBack => Some(Cmd::ReadBack { src: span(&r.spans[0], live) }),
        _ => None,
    }
}

/// The op of a host-side kind that submits nothing (waits, flushes, snapshots, host
/// updates; drops are the generators' own), if it applies.
fn host_op(kind: Kind, r: &RawOp, submits: &[usize], nq: usize, live: &Live<'_>) -> Option<Op> {
    Some(match kind {
        Kind::Wait if !submits.is_empty() => {
            // Counted back from the latest submission (shrinks towards it).
            let back = r.aux as usize % submits.len();
            Op::Wait(submits[submits.len() - 1 - back])
        }
        Kind::QueueWait => Op::QueueWait(r.queue as usize % nq),
        Kind::Flush => Op::Flush,
        Kind::Snapshot => Op::Snapshot(live.pick(r.spans[0].buf)),
        Kind::HostUpdate => Op::HostUpdate { buf: live.pick(r.spans[0].buf), salt: r.salt },
        _ => return None,
    })
}

fn copy(raw: &RawOp, live: &Live<'_>) -> Option<Cmd> {
    let (a, b) = (&raw.spans[0], &raw.spans[1]);
    let buffers = live.specs;
    let src = live.pick(a.buf);
    let mut dst = live.pick(b.buf);
    if src == dst && buffers[src].len < 2 {
        if live.live.len() == 1 {
            return None;
        }
        dst = live.pick(a.buf.wrapping_add(1));
        if dst == src {
            // Still one single-element buffer: no room for a copy within it.
            return None;
        }
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

/// The kind a raw byte picks from `kinds`, each as likely as its weight.
pub(crate) fn pick<K: Copy>(kinds: &[(K, u8)], raw: u8) -> K {
    let total: u32 = kinds.iter().map(|&(_, w)| w as u32).sum();
    let mut pick = raw as u32 % total;
    for &(k, w) in kinds {
        if pick < w as u32 {
            return k;
        }
        pick -= w as u32;
    }
    kinds[0].0
}

/// The buffers of a raw program: at most `MAX_BUFFERS`, 1 to `MAX_LEN` elements each,
/// at least one.
pub(crate) fn decode_buffers(raw: &[(u8, u32)]) -> Vec<BufferSpec> {
    let mut buffers: Vec<BufferSpec> = raw
        .iter()
        .take(MAX_BUFFERS)
        .map(|&(l, seed)| BufferSpec { len: 1 + l as usize % MAX_LEN, seed })
        .collect();
    if buffers.is_empty() {
        buffers.push(BufferSpec { len: 1, seed: 0 });
    }
    buffers
}

impl Program {
    /// Decodes a raw program into a valid one. Every raw program decodes; raw ops that
    /// cannot make a valid op (a wait before any submission) are dropped.
    pub fn decode(raw: &RawProgram, opts: &GenOptions) -> Program {
        let buffers = decode_buffers(&raw.buffers);
        let mut queues: Vec<bool> = raw.queues.iter().take(MAX_QUEUES).map(|&q| q && opts.in_order).collect();
        if queues.is_empty() {
            queues.push(false);
        }
        let kinds: Vec<(Kind, u8)> = KINDS.iter().copied().filter(|(k, _)| k.allowed(opts)).collect();
        let mut live = Live { specs: &buffers, live: (0..buffers.len()).collect() };
        let mut ops = Vec::new();
        let mut submits: Vec<usize> = Vec::new();
        for r in &raw.ops {
            let kind = pick(&kinds, r.kind);
            let nq = queues.len();
            let cmd = match kind {
                Kind::Kernel => {
                    let (reads, writes) =
                        accessors(r, &live, r.counts as usize % 3, 1 + (r.counts as usize / 3) % 2);
                    let launch = match r.aux % 5 {
                        0 if r.salt % 3 == 0 && Launch::map_fits(&reads, &writes) => Launch::Map,
                        0 => Launch::Flat,
                        k => Launch::Nd(1 << (k - 1)),
                    };
                    Some(Cmd::Kernel { reads, writes, salt: r.salt, launch, promote: vec![] })
                }
                _ => plain_cmd(kind, r, &live),
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
                (Kind::Drop, _) if live.live.len() > 1 => {
                    let b = live.pick(r.spans[0].buf);
                    live.live.retain(|&x| x != b);
                    Op::Drop(b)
                }
                (kind, None) => match host_op(kind, r, &submits, nq, &live) {
                    Some(op) => op,
                    None => continue,
                },
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
    /// Final contents of every buffer (empty for dropped ones).
    pub buffers: Vec<Vec<u32>>,
    /// `(op index, contents)` of every [`Op::Snapshot`].
    pub snapshots: Vec<(usize, Vec<u32>)>,
    /// `(op index, data)` of every [`Cmd::ReadBack`].
    pub readbacks: Vec<(usize, Vec<u32>)>,
    /// `(op index, digest)` of what every [`Cmd::HostTask`] read ([`digest`] of its
    /// read ranges, in order), sorted by op index.
    pub host_reads: Vec<(usize, u32)>,
}

fn first_diff(a: &[u32], b: &[u32]) -> String {
    if a.len() != b.len() {
        return format!("lengths {} vs {}", a.len(), b.len());
    }
    let bad: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
    let shown: Vec<String> =
        bad.iter().take(6).map(|&i| format!("[{i}] model {:#010x} gantry {:#010x}", a[i], b[i])).collect();
    format!(
        "{} of {} elements differ at {:?}: {}",
        bad.len(),
        a.len(),
        &bad[..bad.len().min(16)],
        shown.join(", ")
    )
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
        if self.host_reads != got.host_reads {
            let bad: Vec<String> = self
                .host_reads
                .iter()
                .zip(&got.host_reads)
                .filter(|(m, g)| m != g)
                .map(|(m, g)| if m.0 == g.0 { format!("#{}", m.0) } else { format!("#{} vs #{}", m.0, g.0) })
                .collect();
            out.push(format!(
                "host tasks read different data: {} (model {} tasks, gantry {})",
                bad.join(", "),
                self.host_reads.len(),
                got.host_reads.len()
            ));
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

/// Order-sensitive digest of the read ranges of a host task.
pub fn digest<'a>(reads: impl IntoIterator<Item = &'a [u32]>) -> u32 {
    reads.into_iter().fold(0x5EED, |acc, r| r.iter().fold(mix(acc, r.len() as u32), |a, &x| mix(a, x)))
}

/// Kernel/host-task semantics on plain vectors.
/// What a kernel or host task computes; a [`Launch::Map`] kernel seeds every
/// work-item with `item_seed(salt, 0)`.
fn model_compute(bufs: &mut [Vec<u32>], reads: &[Span], writes: &[(Span, WMode)], salt: u32, map: bool) {
    let read_data: Vec<Vec<u32>> = reads.iter().map(|s| bufs[s.buf][s.start..s.end].to_vec()).collect();
    for (k, (w, mode)) in writes.iter().enumerate() {
        for i in 0..w.len() {
            let mut acc = item_seed(salt, if map { 0 } else { i });
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
    let mut dropped = Vec::new();
    for (i, op) in p.ops.iter().enumerate() {
        match op {
            Op::Submit { cmd, .. } => match cmd {
                Cmd::Kernel { reads, writes, salt, launch, .. } => {
                    model_compute(&mut bufs, reads, writes, *salt, *launch == Launch::Map)
                }
                Cmd::HostTask { reads, writes, salt } => {
                    out.host_reads.push((i, digest(reads.iter().map(|s| &bufs[s.buf][s.start..s.end]))));
                    model_compute(&mut bufs, reads, writes, *salt, false)
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
            Op::Drop(b) => dropped.push(*b),
            Op::Wait(_)
            | Op::QueueWait(_)
            | Op::Flush
            | Op::StartFusion { .. }
            | Op::CompleteFusion { .. }
            | Op::CancelFusion { .. }
            | Op::SetPromotion { .. } => {}
        }
    }
    for b in dropped {
        bufs[b].clear();
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
        self.builder().build()
    }
    /// The runtime builder of [`Config::build`] (to add options).
    pub fn builder(&self) -> gantry::RuntimeBuilder {
        let mut b = Runtime::builder().mode(self.mode).cpu(CpuConfig {
            worker_threads: self.workers,
            host_threads: self.host_threads,
            inline_items: self.inline_items,
        });
        if self.sim {
            b = b.sim(SimConfig::default());
        }
        b
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
    rt: std::sync::Arc<Runtime>,
    /// Buffers of the program (`None` once dropped).
    pub buffers: Vec<Option<gantry::Buffer<u32>>>,
    /// `queues[q]`: the Gantry queues of program queue `q`, per device.
    queues: Vec<Vec<(Dev, Queue)>>,
    events: Vec<Option<Event>>,
    readbacks: Vec<(usize, Readback<u32>)>,
    host_reads: std::sync::Arc<std::sync::Mutex<Vec<(usize, u32)>>>,
    snapshots: Vec<(usize, Vec<u32>)>,
    progress: std::sync::Arc<std::sync::Mutex<String>>,
    /// The program (for fusion outcome checks) and its fusion windows.
    program: Program,
    windows: Vec<fusion::Window>,
    /// `(op index, outcome)` of every fusion outcome checked (at a window's end, or at
    /// the end of the program for each queue's last window, with its start's index).
    fusions: Vec<(usize, FusionOutcome)>,
}

impl Session {
    /// Builds the runtime, buffers and queues of `p`.
    pub fn new(p: &Program, config: Config) -> Session {
        Session::with_runtime(p, config, config.build())
    }

    /// [`Session::new`] on `rt`, built from `config` with more options.
    pub fn with_runtime(p: &Program, config: Config, rt: Runtime) -> Session {
        let rt = std::sync::Arc::new(rt);
        let buffers = p.buffers.iter().map(|b| Some(rt.buffer(&b.contents()))).collect();
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
        Session {
            config,
            rt,
            buffers,
            queues,
            events: vec![None; p.ops.len()],
            readbacks: vec![],
            snapshots: vec![],
            host_reads: Default::default(),
            progress: Default::default(),
            program: p.clone(),
            windows: fusion::windows(p),
            fusions: vec![],
        }
    }

    /// The window that ends (`end`) or starts at op `i`.
    fn window_at(&self, i: usize, end: bool) -> Result<&fusion::Window, String> {
        self.windows
            .iter()
            .find(|w| if end { w.end == Some(i) } else { w.start == i })
            .ok_or_else(|| format!("#{i}: no fusion window {} here", if end { "ends" } else { "starts" }))
    }

    fn fusion_outcome(&mut self, i: usize, q: &Queue) -> Result<FusionOutcome, String> {
        let o = q.fusion_outcome().ok_or_else(|| format!("#{i}: the fusion's outcome is unknown"))?;
        self.fusions.push((i, o.clone()));
        Ok(o)
    }

    /// The fusion outcomes checked so far: `(op index, outcome)` (see
    /// [`Session::finish_with_fusions`]).
    pub fn fusions(&self) -> &[(usize, FusionOutcome)] {
        &self.fusions
    }

    /// The runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// A shared handle to the runtime (for inspecting it from another thread).
    pub fn runtime_handle(&self) -> std::sync::Arc<Runtime> {
        self.rt.clone()
    }

    /// What the session is doing (the op it runs, the event it waits for), shared.
    pub fn progress_handle(&self) -> std::sync::Arc<std::sync::Mutex<String>> {
        self.progress.clone()
    }

    fn set_progress(&self, what: impl FnOnce() -> String) {
        *self.progress.lock().unwrap_or_else(|e| e.into_inner()) = what();
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
        self.set_progress(|| format!("op #{i} ({op:?})"));
        match op {
            Op::Submit { queue, dev, deps, cmd } => {
                let deps: Vec<Event> = deps
                    .iter()
                    .map(|&d| self.events[d].clone().expect("dependency on a submission"))
                    .collect();
                let q = self.queue(*queue, *dev).clone();
                let bufs = &Bufs(&self.buffers);
                let host_reads = (i, self.host_reads.clone());
                let mut readback = None;
                let ev = q
                    .submit(|cg| {
                        for d in &deps {
                            cg.depends_on(d);
                        }
                        build(cg, bufs, cmd, &mut readback, host_reads);
                    })
                    .map_err(|e| format!("#{i}: submit failed: {e}"))?;
                if let Some(rb) = readback {
                    self.readbacks.push((i, rb));
                }
                self.events[i] = Some(ev);
            }
            Op::Wait(k) => {
                let ev =
                    self.events[*k].as_ref().ok_or_else(|| format!("#{i}: wait on non-submission #{k}"))?;
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
                let v = Bufs(&self.buffers)[*b].to_vec().map_err(|e| format!("#{i}: to_vec failed: {e}"))?;
                self.snapshots.push((i, v));
            }
            Op::Drop(b) => {
                self.buffers[*b].take().ok_or_else(|| format!("#{i}: b{b} dropped twice"))?;
            }
            Op::HostUpdate { buf, salt } => {
                let mut w =
                    Bufs(&self.buffers)[*buf].write().map_err(|e| format!("#{i}: write() failed: {e}"))?;
                for (k, x) in w.iter_mut().enumerate() {
                    *x = mix(item_seed(*salt, k), *x);
                }
            }
            Op::StartFusion { queue, dev } => {
                let q = self.queue(*queue, *dev);
                q.start_fusion().map_err(|e| format!("#{i}: start_fusion failed: {e}"))?;
                if !q.is_in_fusion_mode() {
                    return Err(format!("#{i}: not in fusion mode after start_fusion"));
                }
            }
            Op::CompleteFusion { queue, dev, barriers, wait } => {
                let q = self.queue(*queue, *dev).clone();
                let ev = q
                    .complete_fusion(FusionProps { barriers: *barriers })
                    .map_err(|e| format!("#{i}: complete_fusion failed: {e}"))?;
                if q.is_in_fusion_mode() {
                    return Err(format!("#{i}: still in fusion mode after complete_fusion"));
                }
                self.events[i] = Some(ev.clone());
                if *wait {
                    self.set_progress(|| format!("#{i}: waiting on the completed fusion's event"));
                    ev.wait().map_err(|e| format!("#{i}: waiting on the fusion failed: {e}"))?;
                    let o = self.fusion_outcome(i, &q)?;
                    fusion::check_outcome(&self.program, self.window_at(i, true)?, &o)
                        .map_err(|e| format!("#{i}: {e}"))?;
                }
            }
            Op::CancelFusion { queue, dev } => {
                let q = self.queue(*queue, *dev).clone();
                q.cancel_fusion();
                if q.is_in_fusion_mode() {
                    return Err(format!("#{i}: still in fusion mode after cancel_fusion"));
                }
                let o = self.fusion_outcome(i, &q)?;
                if !matches!(o, FusionOutcome::Cancelled(_)) {
                    return Err(format!("#{i}: outcome {o:?} after cancel_fusion"));
                }
                fusion::check_outcome(&self.program, self.window_at(i, true)?, &o)
                    .map_err(|e| format!("#{i}: {e}"))?;
            }
            Op::SetPromotion { buf, promotion } => Bufs(&self.buffers)[*buf].set_promotion(*promotion),
        }
        Ok(())
    }

    /// Waits for everything, checks every event succeeded and returns the outcome.
    pub fn finish(self) -> Result<Outcome, String> {
        self.finish_with_fusions().map(|o| o.0)
    }

    /// [`Session::finish`], also returning the fusion outcomes checked: at each
    /// window's end where known, and for each queue's last window at the end (with the
    /// index of its start).
    pub fn finish_with_fusions(mut self) -> Result<(Outcome, Vec<(usize, FusionOutcome)>), String> {
        for (i, ev) in self.events.iter().enumerate() {
            if let Some(ev) = ev {
                self.set_progress(|| format!("the final wait on #{i}'s event"));
                ev.wait().map_err(|e| format!("#{i} failed: {e}"))?;
            }
        }
        // Windows left open with no kernel to wait on: the queue wait cancels them.
        for (q, queues) in self.queues.iter().enumerate() {
            for (d, queue) in queues {
                if queue.is_in_fusion_mode() {
                    self.set_progress(|| format!("the final q{q}@{}.wait()", dev_name(*d)));
                    queue.wait().map_err(|e| format!("final wait on a fusing queue failed: {e}"))?;
                }
            }
        }
        // Each queue's last fusion has ended: check its outcome.
        for (q, queues) in self.queues.iter().enumerate() {
            for (d, queue) in queues {
                let Some(w) = self.windows.iter().rev().find(|w| (w.queue, w.dev) == (q, *d)) else {
                    continue;
                };
                let o = queue.fusion_outcome().ok_or_else(|| {
                    format!("the outcome of the window at #{} is unknown after the final waits", w.start)
                })?;
                fusion::check_outcome(&self.program, w, &o).map_err(|e| format!("at the end: {e}"))?;
                if w.end.is_none() && !matches!(o, FusionOutcome::Cancelled(_)) {
                    return Err(format!("the window at #{} was never ended, yet {o:?}", w.start));
                }
                if !self.fusions.iter().any(|f| Some(f.0) == w.end) {
                    self.fusions.push((w.start, o));
                }
            }
        }
        let mut out = Outcome { snapshots: std::mem::take(&mut self.snapshots), ..Default::default() };
        out.host_reads = std::mem::take(&mut *self.host_reads.lock().unwrap_or_else(|e| e.into_inner()));
        out.host_reads.sort_unstable();
        for (i, b) in self.buffers.iter().enumerate() {
            self.set_progress(|| format!("the final b{i}.to_vec()"));
            out.buffers.push(match b {
                Some(b) => b.to_vec().map_err(|e| format!("final to_vec of b{i} failed: {e}"))?,
                None => vec![],
            });
        }
        for (i, rb) in &self.readbacks {
            let data =
                rb.take().ok_or_else(|| format!("readback of #{i} is empty after its event completed"))?;
            out.readbacks.push((*i, data));
        }
        self.set_progress(|| "the final wait_idle()".into());
        self.rt.wait_idle().map_err(|e| format!("wait_idle failed: {e}"))?;
        let stats = self.rt.stats();
        if stats.live_commands != 0 || stats.in_driver != 0 || stats.failed != 0 {
            return Err(format!("after wait_idle ({:?}): {stats:?}", self.config));
        }
        Ok((out, std::mem::take(&mut self.fusions)))
    }
}

/// The program's buffers, indexed by program buffer index.
struct Bufs<'a>(&'a [Option<gantry::Buffer<u32>>]);

impl std::ops::Index<usize> for Bufs<'_> {
    type Output = gantry::Buffer<u32>;
    fn index(&self, b: usize) -> &gantry::Buffer<u32> {
        self.0[b].as_ref().unwrap_or_else(|| panic!("b{b} used after its drop"))
    }
}

type HostReads = (usize, std::sync::Arc<std::sync::Mutex<Vec<(usize, u32)>>>);

fn build(
    cg: &mut gantry::Handler,
    bufs: &Bufs<'_>,
    cmd: &Cmd,
    readback: &mut Option<Readback<u32>>,
    host_reads: HostReads,
) {
    match cmd {
        Cmd::Kernel { reads, writes, salt, launch: Launch::Map, promote } => {
            let seed = item_seed(*salt, 0);
            let (r, (w, _)) = (&reads[0], &writes[0]);
            let a = cg.access::<u32, Read>(&bufs[r.buf], r.start..r.end);
            let o = cg.elements::<u32, DiscardWrite>(&bufs[w.buf], w.start..w.end);
            let hint = |b: usize| promote.iter().find(|(x, _)| *x == b).map(|(_, p)| *p);
            if let Some(p) = hint(r.buf) {
                cg.promote(&a, p);
            }
            if let Some(p) = hint(w.buf) {
                cg.promote(&o, p);
            }
            cg.map(&a, &o, move |x| out_value(mix(seed, x), 0));
        }
        Cmd::Kernel { reads, writes, salt, launch, promote } => {
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
            let hint = |b: usize| promote.iter().find(|(x, _)| *x == b).map(|(_, p)| *p);
            for (a, s) in ra.iter().zip(reads) {
                if let Some(p) = hint(s.buf) {
                    cg.promote(a, p);
                }
            }
            for (w, (s, _)) in wa.iter().zip(writes) {
                if let Some(p) = hint(s.buf) {
                    match w {
                        KW::W(a) => cg.promote(a, p),
                        KW::Rw(a) => cg.promote(a, p),
                        KW::D(a) => cg.promote(a, p),
                    };
                }
            }
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
                        KW::W(a) if i < a.len() && write_mask(salt, k, i) => a.set(it, i, out_value(acc, k)),
                        KW::D(a) if i < a.len() => a.set(it, i, out_value(acc, k)),
                        KW::Rw(a) if i < a.len() => a.set(it, i, rw_value(acc, k, a.get(it, i))),
                        _ => {}
                    }
                }
            };
            match launch {
                Launch::Flat => cg.parallel_for(n, body),
                Launch::Nd(local) => {
                    cg.parallel_for_nd(NdRange::new(n.div_ceil(*local) * local, *local), body)
                }
                Launch::Map => unreachable!("map kernels are built above"),
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
                let (op, sink) = &host_reads;
                sink.lock().unwrap_or_else(|e| e.into_inner()).push((*op, digest(read_data.iter().copied())));
                let acc_of =
                    |i: usize| read_data.iter().fold(item_seed(salt, i), |acc, r| mix(acc, r[i % r.len()]));
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
        Cmd::Copy { src, dst } => {
            cg.copy_range(&bufs[src.buf], src.start, &bufs[dst.buf], dst.start, src.len())
        }
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

/// How long [`check`] lets one program run before it reports a hang: 10 s (programs
/// take milliseconds), or `GANTRY_PROPTEST_TIMEOUT_MS` milliseconds.
pub fn hang_timeout() -> std::time::Duration {
    let ms = std::env::var("GANTRY_PROPTEST_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(10_000);
    std::time::Duration::from_millis(ms)
}

/// Runs `p` through Gantry on a helper thread; a run that takes longer than `timeout`
/// is reported as a hang naming the step it is blocked in (the helper thread and its
/// runtime are leaked).
pub fn run_gantry_watched(
    p: &Program,
    config: Config,
    timeout: std::time::Duration,
) -> Result<Outcome, String> {
    let p2 = p.clone();
    let start = move || Session::new(&p2, config);
    let ops = p.ops.clone();
    let run = move |mut s: Session| {
        for (i, op) in ops.iter().enumerate() {
            s.step(i, op)?;
        }
        s.finish()
    };
    run_watched(config, timeout, "gantry-proptest-run", start, run, String::new)
}

/// Runs a session on a helper thread: `start` builds it, `run` drives it to its
/// outcome. A run that takes longer than `timeout` is reported as a hang naming the
/// step it is blocked in, the live commands and `context()` (the helper thread and
/// its runtime are leaked).
pub(crate) fn run_watched(
    config: Config,
    timeout: std::time::Duration,
    thread: &str,
    start: impl FnOnce() -> Session + Send + 'static,
    run: impl FnOnce(Session) -> Result<Outcome, String> + Send + 'static,
    context: impl FnOnce() -> String,
) -> Result<Outcome, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (rt_tx, rt_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let s = start();
                let progress = s.progress_handle();
                let _ = rt_tx.send((s.runtime_handle(), progress.clone()));
                let out = run(s);
                *progress.lock().unwrap_or_else(|e| e.into_inner()) = "dropping the runtime".into();
                out
            }));
            let _ = tx.send(result.unwrap_or_else(|e| Err(format!("panicked: {}", panic_text(&*e)))));
        })
        .expect("spawn");
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(_) => {
            let Ok((rt, progress)) = rt_rx.try_recv() else {
                return Err(format!("{config:?}: hang: building the runtime took over {timeout:?}"));
            };
            let at = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let world = dump_world(&rt);
            let stats = rt.stats();
            let diagnosis = if stats.live_commands == 0 && stats.in_driver == 0 {
                "\nnothing is left in the scheduler: the blocked call waits for an event that has already \
                 finished (a lost wakeup, see regressions::event_wait_never_misses_completion)"
            } else {
                ""
            };
            Err(format!(
                "{config:?}: hang: blocked for {timeout:?} in {at}{diagnosis}\nlive commands:\n{world}{}",
                context()
            ))
        }
    }
}

/// The scheduler's live commands (kind, name, device, status, blockers, predecessors
/// and successors by sequence number) and counters, for hang reports.
pub fn dump_world(rt: &Runtime) -> String {
    use gantry::components::{Command, CommandKind, Edges, Execution};
    use gantry::ecs::entity::Entity;
    rt.with_world(|w| {
        let mut q = w.query::<(Entity, &Command, &Edges, &Execution)>();
        // User commands (host accesses and barriers included) by sequence number,
        // memory moves by entity.
        let label_of: std::collections::HashMap<Entity, String> = q
            .iter(w)
            .map(|(e, c, _, _)| {
                (
                    e,
                    if c.kind == CommandKind::MemoryMove {
                        format!("move {e}")
                    } else {
                        format!("seq {}", c.seq)
                    },
                )
            })
            .collect();
        let label = |e: &Entity| label_of.get(e).cloned().unwrap_or_else(|| format!("gone {e}"));
        let mut rows: Vec<((u64, bool), String)> = Vec::new();
        for (e, c, ed, x) in q.iter(w) {
            let preds: Vec<String> = ed.preds.iter().map(label).collect();
            let succs: Vec<String> = ed
                .succs
                .iter()
                .map(|s| format!("{}{}", label(&s.entity), if s.on_submit { " (on submit)" } else { "" }))
                .collect();
            rows.push((
                (c.seq, c.kind == CommandKind::MemoryMove),
                format!(
                    "  {} {:?} `{}` device {} {:?}, event {:?}, blockers {}, preds [{}], succs [{}]",
                    label(&e),
                    c.kind,
                    c.name,
                    c.device,
                    x.status,
                    x.event.status(),
                    ed.blockers,
                    preds.join(", "),
                    succs.join(", ")
                ),
            ));
        }
        rows.sort_by_key(|r| r.0);
        let stats = *w.resource::<gantry::Stats>();
        rows.into_iter().map(|r| r.1).chain([format!("  {stats:?}")]).collect::<Vec<_>>().join("\n")
    })
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

/// Checks that Gantry under `config` produces the model's outcome for `p` (within
/// [`hang_timeout`]).
pub fn check(p: &Program, config: Config) -> Result<(), String> {
    let mut model = run_model(p);
    let mut got = run_gantry_watched(p, config, hang_timeout())?;
    // A fusion that internalizes a promoted buffer does not write it back.
    for b in fusion::promoted_buffers(p) {
        model.buffers[b].clear();
        got.buffers[b].clear();
    }
    match model.mismatch(&got) {
        None => Ok(()),
        Some(m) => Err(format!("{config:?}: Gantry differs from the model:\n{m}")),
    }
}

// ---------------------------------------------------------------------------------
// Parsing the Debug form back (for regression tests)
// ---------------------------------------------------------------------------------

fn num(s: &str) -> Result<u64, String> {
    let s = s.trim_end_matches([',', ';', ')']);
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("bad number `{s}`: {e}"))
}

fn parse_span(s: &str) -> Result<Span, String> {
    let s = s.trim_end_matches([',', ';']);
    let err = || format!("bad range `{s}`");
    let rest = s.strip_prefix('b').ok_or_else(err)?;
    let (b, rest) = rest.split_once('[').ok_or_else(err)?;
    let (a, e) = rest.trim_end_matches(']').split_once("..").ok_or_else(err)?;
    Ok(Span { buf: num(b)? as usize, start: num(a)? as usize, end: num(e)? as usize })
}

fn parse_list(s: &str) -> Vec<&str> {
    let inner = s.trim().strip_prefix('[').and_then(|s| s.strip_suffix(']')).unwrap_or(s).trim();
    if inner.is_empty() {
        vec![]
    } else {
        inner.split(", ").map(str::trim).collect()
    }
}

fn parse_salt(w: &str) -> Result<u32, String> {
    Ok(num(w.strip_prefix("salt=").ok_or_else(|| format!("expected salt=, got `{w}`"))?)? as u32)
}

fn parse_cmd(w: &[&str]) -> Result<Cmd, String> {
    let (kind, rest) = w.split_first().ok_or("empty command")?;
    let words = |from: usize, to: usize| rest[from.min(rest.len())..to.min(rest.len())].join(" ");
    match *kind {
        "kernel" | "kernel(nd" | "kernel(map)" | "host_task" => {
            let (launch, rest) = match *kind {
                "kernel(nd" => (Launch::Nd(num(rest.get(1).ok_or("nd local")?)? as usize), &rest[2..]),
                "kernel(map)" => (Launch::Map, rest),
                _ => (Launch::Flat, rest),
            };
            let salt = parse_salt(rest.first().ok_or("salt")?)?;
            let r = rest.iter().position(|&x| x == "reads").ok_or("reads")?;
            let wr = rest.iter().position(|&x| x == "writes").ok_or("writes")?;
            let pr = rest.iter().position(|&x| x == "promote").unwrap_or(rest.len());
            let reads = parse_list(&rest[r + 1..wr].join(" "))
                .into_iter()
                .map(parse_span)
                .collect::<Result<_, _>>()?;
            let promote = parse_list(&rest[(pr + 1).min(rest.len())..].join(" "))
                .into_iter()
                .map(|x| {
                    let (b, p) = x.split_once(' ').ok_or_else(|| format!("bad promotion `{x}`"))?;
                    Ok((num(b.trim_start_matches('b'))? as usize, parse_promotion(p)?))
                })
                .collect::<Result<_, String>>()?;
            let writes = parse_list(&rest[wr + 1..pr].join(" "))
                .into_iter()
                .map(|x| {
                    let (s, m) = x.split_once(' ').ok_or_else(|| format!("bad write `{x}`"))?;
                    let m = match m {
                        "w" => WMode::Write,
                        "rw" => WMode::ReadWrite,
                        "discard" => WMode::DiscardWrite,
                        _ => return Err(format!("bad mode `{m}`")),
                    };
                    Ok((parse_span(s)?, m))
                })
                .collect::<Result<_, String>>()?;
            Ok(if *kind == "host_task" {
                Cmd::HostTask { reads, writes, salt }
            } else {
                Cmd::Kernel { reads, writes, salt, launch, promote }
            })
        }
        "copy" => Ok(Cmd::Copy { src: parse_span(&words(0, 1))?, dst: parse_span(&words(2, 3))? }),
        "fill" => Ok(Cmd::Fill { span: parse_span(&words(0, 1))?, value: num(&words(2, 3))? as u32 }),
        "copy_from_host" => {
            Ok(Cmd::CopyFromHost { salt: parse_salt(&words(0, 1))?, dst: parse_span(&words(2, 3))? })
        }
        "copy_to_host" => Ok(Cmd::ReadBack { src: parse_span(&words(0, 1))? }),
        k => Err(format!("unknown command `{k}`")),
    }
}

fn parse_op(w: &[&str]) -> Result<Op, String> {
    let first = *w.first().ok_or("empty op")?;
    let target = |s: &str| num(s.trim_start_matches('#'));
    if first == "flush" {
        return Ok(Op::Flush);
    }
    let parse_dev = |d: &str| match d {
        "cpu" => Ok(Dev::Cpu),
        "sim" => Ok(Dev::Sim),
        _ => Err(format!("unknown device `{d}`")),
    };
    if let Some((qd, method)) = first.split_once('.').filter(|(qd, _)| qd.contains('@')) {
        let (q, d) = qd.split_once('@').expect("checked");
        let (queue, dev) = (num(q.trim_start_matches('q'))? as usize, parse_dev(d)?);
        return match method {
            "start_fusion()" => Ok(Op::StartFusion { queue, dev }),
            "cancel_fusion()" => Ok(Op::CancelFusion { queue, dev }),
            "complete_fusion(barriers)" | "complete_fusion(no_barriers)" => Ok(Op::CompleteFusion {
                queue,
                dev,
                barriers: method == "complete_fusion(barriers)",
                wait: w.get(1) == Some(&"wait"),
            }),
            _ => Err(format!("unknown queue method `{method}`")),
        };
    }
    if let Some((b, p)) = first.split_once(".set_promotion(") {
        return Ok(Op::SetPromotion {
            buf: num(b.trim_start_matches('b'))? as usize,
            promotion: parse_promotion(p.trim_end_matches(')'))?,
        });
    }
    if first == "drop" {
        return Ok(Op::Drop(num(w.get(1).ok_or("drop what")?.trim_start_matches('b'))? as usize));
    }
    if let Some(x) = first.strip_suffix(".wait()") {
        return Ok(match x.strip_prefix('#') {
            Some(k) => Op::Wait(num(k)? as usize),
            None => Op::QueueWait(num(x.trim_start_matches('q'))? as usize),
        });
    }
    if let Some(b) = first.strip_suffix(".to_vec()") {
        return Ok(Op::Snapshot(num(b.trim_start_matches('b'))? as usize));
    }
    if let Some(b) = first.strip_suffix(".write()") {
        let salt = parse_salt(w.get(1).ok_or("salt")?)?;
        return Ok(Op::HostUpdate { buf: num(b.trim_start_matches('b'))? as usize, salt });
    }
    let (q, d) = first.split_once('@').ok_or_else(|| format!("unknown op `{first}`"))?;
    let queue = num(q.trim_start_matches('q'))? as usize;
    let dev = match d {
        "cpu" => Dev::Cpu,
        "sim" => Dev::Sim,
        _ => return Err(format!("unknown device `{d}`")),
    };
    let after = w.iter().position(|&x| x == "after").unwrap_or(w.len());
    let deps = if after < w.len() {
        parse_list(&w[after + 1..].join(" "))
            .into_iter()
            .map(|d| target(d).map(|d| d as usize))
            .collect::<Result<_, _>>()?
    } else {
        vec![]
    };
    Ok(Op::Submit { queue, dev, deps, cmd: parse_cmd(&w[1..after])? })
}

impl Program {
    /// Parses the `Debug` form of a program (as printed by a failing property, also
    /// with its line breaks collapsed, as in a `.proptest-regressions` file). Anything
    /// after the closing brace is ignored.
    pub fn parse(text: &str) -> Result<Program, String> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let pos = |w: &str| words.iter().position(|&x| x == w).ok_or_else(|| format!("missing `{w}`"));
        let (b, q) = (pos("buffers:")?, pos("queues:")?);
        let is_marker =
            |w: &str| w.len() > 1 && w.starts_with('#') && w[1..].bytes().all(|c| c.is_ascii_digit());
        let end = words.iter().position(|w| w.starts_with('}')).unwrap_or(words.len());
        let first_op = words.iter().position(|&w| is_marker(w)).unwrap_or(end);
        let (buffers, queues) = parse_header(&words[b + 1..q], &words[q + 1..first_op])?;
        let mut ops = Vec::new();
        let mut i = first_op;
        while i < end {
            let next = (i + 1..end).find(|&j| is_marker(words[j])).unwrap_or(end);
            let index = num(&words[i][1..])? as usize;
            if index != ops.len() {
                return Err(format!("op #{index} out of order"));
            }
            ops.push(parse_op(&words[i + 1..next]).map_err(|e| format!("op #{index}: {e}"))?);
            i = next;
        }
        Ok(Program { buffers, queues, ops })
    }
}
