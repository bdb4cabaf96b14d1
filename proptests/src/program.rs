//! Programs: buffers, queues and [`Op`]s (each submission's [`Cmd`] with its
//! [`Span`]s), and their `Debug` form, which [`Program::parse`] reads back.

use std::fmt;

use gantry::Promotion;

use crate::arith::initial_contents;

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
    /// `Write`: writes the elements selected by [`write_mask`](crate::write_mask), keeps the others.
    Write,
    /// `ReadWrite`: every element becomes [`rw_value`](crate::rw_value) of its old value.
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
    /// the element, so the work-item's seed is [`item_seed`](crate::item_seed)`(salt, 0)` for every `i`.
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
    /// [`item_seed`](crate::item_seed)`(salt, i)`, mixes in element `i % len` of each read range in
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
        /// `cg.promote(&accessor, promotion)` (only in fusion programs, see [`fusion`](crate::fusion)).
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
    /// programs only, see [`fusion`](crate::fusion)).
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

pub(crate) fn dev_name(d: Dev) -> &'static str {
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
