//! The generator: [`RawProgram`]s (plain numbers, what proptest generates and
//! shrinks) decoded into valid [`Program`]s under [`GenOptions`].

use std::collections::BTreeSet;

use crate::program::{BufferSpec, Cmd, Dev, Launch, Op, Program, Span, WMode};

/// Maximal number of buffers of a program.
pub const MAX_BUFFERS: usize = 4;
/// Maximal buffer length (elements).
pub const MAX_LEN: usize = 64;
/// Maximal number of queues of a program.
pub const MAX_QUEUES: usize = 3;

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
pub(crate) enum Kind {
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
pub(crate) const KINDS: [(Kind, u8); 12] = [
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
    pub(crate) fn allowed(self, o: &GenOptions) -> bool {
        match self {
            Kind::CopyFromHost | Kind::ReadBack => o.transfers,
            Kind::Wait | Kind::QueueWait | Kind::Flush | Kind::Snapshot | Kind::HostUpdate => o.host_sync,
            Kind::Drop => o.drops,
            _ => true,
        }
    }
}

/// The live buffers of a program being decoded: their specs and which are not dropped.
pub(crate) struct Live<'a> {
    pub(crate) specs: &'a [BufferSpec],
    pub(crate) live: Vec<usize>,
}

impl Live<'_> {
    /// The `raw`-th live buffer (modulo their number).
    pub(crate) fn pick(&self, raw: u8) -> usize {
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
pub(crate) fn accessors(
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
pub(crate) fn plain_cmd(kind: Kind, r: &RawOp, live: &Live<'_>) -> Option<Cmd> {
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
pub(crate) fn host_op(kind: Kind, r: &RawOp, submits: &[usize], nq: usize, live: &Live<'_>) -> Option<Op> {
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
