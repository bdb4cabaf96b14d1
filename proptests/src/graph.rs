//! Command graphs against the serial model: a program recorded into a graph and
//! replayed `R` times equals `R` serial executions of it.
//!
//! A [`GraphProgram`] has the buffers and queues of a [`Program`] and four parts:
//!
//! * a *prologue* of eager ops (as in any program);
//! * a *body*, recorded into one command graph (`begin_recording` on every queue the
//!   body's nodes use, submissions, `barrier()`s, `end_recording`), or added with
//!   explicit `graph.add(…, &deps)` calls: kernels, copies, fills, host tasks (which
//!   split partitions) and host-to-buffer copies, with `depends_on` edges between
//!   nodes; eager ops on queues that are not recording may come in between (they run
//!   at once, before any replay);
//! * `finalize` (plain, or with graph fusion, [`GraphProgram::fusion`]; a second,
//!   plain executable graph of the same graph where some replay uses it), and maybe
//!   dropping the `CommandGraph`; the runtime linearizes graphs in reverse
//!   depth-first order or breadth-first;
//! * a *schedule*: `R` (1 to 4) `submit_graph`s, on any queue, with eager ops
//!   between and after them that touch the same buffers: kernels, copies, fills, host
//!   tasks, transfers, event and queue waits (also on replays), `depends_on` a replay,
//!   snapshots, host writes, buffer drops (the graph keeps a dropped buffer alive and
//!   later replays still use it).
//!
//! The model ([`GraphProgram::flatten`]) is a plain [`Program`]: the prologue, the body's
//! eager ops, then for each replay a copy of the body's nodes, in recording order, and
//! the schedule's eager ops. Every final buffer (but dropped ones), snapshot,
//! readback and host-task read (each replay's own) must equal the model's
//! ([`check_graph`]). The graph's edges are checked too ([`check_edges`]): every pair
//! of conflicting nodes, every explicit dependency, in-order queue and barrier must be
//! ordered by them, whatever the data shows.
//!
//! Graphs cannot record `copy_to_host` (finalize refuses it) nor, on the simulated
//! device, `copy_from_host`: bodies have neither.
//!
//! Graph fusion fuses every kernel chain of a partition, whatever the accesses; like
//! queue fusion ([`fusion`]) it changes results unless the chain is safe to fuse. The
//! generator keeps bodies of fused programs safe ([`decode`]), and the Gantry run
//! checks each chain the finalize fused ([`fusion::fusion_safe`]).
//!
//! A [`GraphProgram`] prints (its `Debug` form) and parses back
//! ([`GraphProgram::parse`]), so a failing case can be pasted into a test.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex};

use gantry::{CommandGraph, Event, ExecutableGraph, GraphProps};

use super::*;

/// A step of a graph program's body.
#[derive(Clone, PartialEq, Eq)]
pub enum Rec {
    /// A node: a command group submitted to the recording Gantry queue of program
    /// queue `queue` on `dev` (explicit graphs: `graph.add`, on the graph's device),
    /// after the nodes `deps` (node indices).
    Node {
        /// Program queue.
        queue: usize,
        /// Device of the Gantry queue.
        dev: Dev,
        /// `depends_on` the events of these earlier nodes (explicit graphs: `add`'s
        /// dependencies).
        deps: Vec<usize>,
        /// The command (never a `copy_to_host`).
        cmd: Cmd,
    },
    /// `barrier()` on that recording queue (explicit graphs: an empty node after the
    /// previous node); a node too.
    Barrier {
        /// Program queue.
        queue: usize,
        /// Device of the Gantry queue.
        dev: Dev,
    },
    /// An eager op while recording (on a queue that is not recording, never host
    /// access to a buffer a recorded node uses).
    Eager(Op),
}

/// A step of a graph program's schedule (after `finalize`).
#[derive(Clone, PartialEq, Eq)]
pub enum Step {
    /// `submit_graph` on the Gantry queue of program queue `queue` on `dev`, of the
    /// executable graph `exec`: 0 is finalized with the program's properties, 1
    /// plainly (a second executable graph of the same graph).
    Replay {
        /// Program queue.
        queue: usize,
        /// Device of the Gantry queue.
        dev: Dev,
        /// Which executable graph.
        exec: usize,
    },
    /// An eager op.
    Eager(Op),
}

/// A program with a command graph (see the module documentation). Eager ops, and
/// replays, are numbered in one sequence (`#k`, what waits and `depends_on` name);
/// nodes in another (`nk`).
#[derive(Clone, PartialEq, Eq)]
pub struct GraphProgram {
    /// Buffers.
    pub buffers: Vec<BufferSpec>,
    /// Queues: whether each is in-order.
    pub queues: Vec<bool>,
    /// The graph's device (`rt.graph_on(1)` for the simulated device, when there is
    /// one): nodes of other devices get partitions of their own.
    pub graph_dev: Dev,
    /// Nodes are added with `graph.add` instead of being recorded from queues.
    pub explicit: bool,
    /// Graph fusion at `finalize`: `None`, `Some(true)` (`fused()`, with barriers),
    /// `Some(false)` (`fused_without_barriers()`).
    pub fusion: Option<bool>,
    /// The `CommandGraph` is dropped right after `finalize` (the executable graphs
    /// keep what they need alive).
    pub drop_graph: bool,
    /// The runtime linearizes graphs breadth-first (`BreadthFirst`), not in reverse
    /// depth-first order (the default): other orders, partitions and fused chains.
    pub breadth_first: bool,
    /// Eager ops before recording.
    pub prologue: Vec<Op>,
    /// The recorded part.
    pub body: Vec<Rec>,
    /// Replays and eager ops after `finalize`.
    pub schedule: Vec<Step>,
}

/// A graph program as a plain [`Program`] (what the model runs) and where its parts
/// went.
#[derive(Clone, Debug)]
pub struct Flat {
    /// The flattened program: eager ops as they are (their references renumbered),
    /// each replay a `flush` (its placeholder: waits and dependencies on the replay
    /// name it) then the body's nodes (without dependencies; barriers left out).
    pub program: Program,
    /// Index in `program` of each eager op or replay, by its number.
    pub at: Vec<usize>,
    /// `node_at[k][j]`: index in `program` of node `j` in replay `k` (barriers: the
    /// replay's placeholder).
    pub node_at: Vec<Vec<usize>>,
}

impl GraphProgram {
    /// The nodes: `(node index, body step)`.
    pub fn nodes(&self) -> impl Iterator<Item = (usize, &Rec)> {
        self.body.iter().filter(|r| !matches!(r, Rec::Eager(_))).enumerate()
    }

    /// The queues the body records from (`(program queue, device)`, sorted); none for
    /// explicit graphs.
    pub fn recording_queues(&self) -> Vec<(usize, Dev)> {
        if self.explicit {
            return vec![];
        }
        let mut out: Vec<(usize, Dev)> = self
            .body
            .iter()
            .filter_map(|r| match r {
                Rec::Node { queue, dev, .. } | Rec::Barrier { queue, dev } => Some((*queue, *dev)),
                Rec::Eager(_) => None,
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Number of replays.
    pub fn replays(&self) -> usize {
        self.schedule.iter().filter(|s| matches!(s, Step::Replay { .. })).count()
    }

    /// The flattened program the model runs (see [`Flat`]).
    pub fn flatten(&self) -> Flat {
        let mut ops: Vec<Op> = Vec::new();
        let mut at: Vec<usize> = Vec::new();
        let mut node_at = Vec::new();
        fn eager(op: &Op, ops: &mut Vec<Op>, at: &mut Vec<usize>) {
            let op = match op {
                Op::Submit { queue, dev, deps, cmd } => Op::Submit {
                    queue: *queue,
                    dev: *dev,
                    deps: deps.iter().map(|&d| at[d]).collect(),
                    cmd: cmd.clone(),
                },
                Op::Wait(k) => Op::Wait(at[*k]),
                op => op.clone(),
            };
            at.push(ops.len());
            ops.push(op);
        }
        for op in &self.prologue {
            eager(op, &mut ops, &mut at);
        }
        for r in &self.body {
            if let Rec::Eager(op) = r {
                eager(op, &mut ops, &mut at);
            }
        }
        for s in &self.schedule {
            match s {
                Step::Eager(op) => eager(op, &mut ops, &mut at),
                Step::Replay { .. } => {
                    let placeholder = ops.len();
                    at.push(placeholder);
                    ops.push(Op::Flush);
                    let mut nodes = Vec::new();
                    for (_, r) in self.nodes() {
                        match r {
                            Rec::Node { queue, dev, cmd, .. } => {
                                nodes.push(ops.len());
                                ops.push(Op::Submit {
                                    queue: *queue,
                                    dev: *dev,
                                    deps: vec![],
                                    cmd: cmd.clone(),
                                });
                            }
                            _ => nodes.push(placeholder),
                        }
                    }
                    node_at.push(nodes);
                }
            }
        }
        Flat {
            program: Program { buffers: self.buffers.clone(), queues: self.queues.clone(), ops },
            at,
            node_at,
        }
    }

    /// Checks what the generator promises and Gantry requires (for hand-written
    /// programs): references to earlier ops only, no eager op on a recording queue nor
    /// host access to a buffer a node recorded before it uses, no `copy_to_host` node,
    /// no `copy_from_host` node on the simulated device, no drop before `finalize`
    /// nor use of a dropped buffer, at least one replay.
    pub fn validate(&self) -> Result<(), String> {
        let recording = self.recording_queues();
        let mut t = 0;
        let mut n = 0;
        let mut marked: Vec<usize> = vec![];
        let mut dropped: Vec<usize> = vec![];
        let names = |op: &Op| -> Vec<usize> {
            match op {
                Op::Submit { cmd, .. } => {
                    let (r, w) = cmd.accesses();
                    r.iter().chain(&w).map(|s| s.buf).collect()
                }
                Op::Snapshot(b) | Op::HostUpdate { buf: b, .. } | Op::Drop(b) => vec![*b],
                _ => vec![],
            }
        };
        let mut eager = |op: &Op, t: usize, during: bool, marked: &[usize]| -> Result<(), String> {
            let bad = |why: &str| Err(format!("#{t} {op:?}: {why}"));
            if names(op).iter().any(|b| *b >= self.buffers.len() || dropped.contains(b)) {
                return bad("names a dropped or unknown buffer");
            }
            match op {
                Op::Submit { deps, .. } if deps.iter().any(|&d| d >= t) => {
                    return bad("depends on a later op")
                }
                Op::Wait(k) if *k >= t => return bad("waits on a later op"),
                Op::Submit { queue, dev, .. } if during && recording.contains(&(*queue, *dev)) => {
                    return bad("submitted to a recording queue")
                }
                Op::QueueWait(q) if during && recording.iter().any(|r| r.0 == *q) => {
                    return bad("waits on a recording queue")
                }
                Op::Snapshot(b) | Op::HostUpdate { buf: b, .. } if during && marked.contains(b) => {
                    return bad("host access to a recorded buffer")
                }
                Op::Drop(b) if during || t < self.prologue.len() => {
                    return bad("drops a buffer before finalize")
                }
                Op::Drop(b) => dropped.push(*b),
                _ => {}
            }
            Ok(())
        };
        for op in &self.prologue {
            eager(op, t, false, &marked)?;
            t += 1;
        }
        for r in &self.body {
            match r {
                Rec::Eager(op) => {
                    eager(op, t, !self.explicit, &marked)?;
                    t += 1;
                }
                Rec::Node { dev, deps, cmd, .. } => {
                    let node_dev = if self.explicit { self.graph_dev } else { *dev };
                    let bad = |why: &str| Err(format!("n{n} {r:?}: {why}"));
                    match cmd {
                        _ if deps.iter().any(|&d| d >= n) => return bad("depends on a later node"),
                        Cmd::ReadBack { .. } => return bad("graphs cannot record copy_to_host"),
                        Cmd::CopyFromHost { .. } if node_dev == Dev::Sim => {
                            return bad("the simulated device cannot record copy_from_host")
                        }
                        _ => {}
                    }
                    let (reads, writes) = cmd.accesses();
                    if reads
                        .iter()
                        .chain(&writes)
                        .any(|s| s.buf >= self.buffers.len() || s.end > self.buffers[s.buf].len)
                    {
                        return bad("out of bounds");
                    }
                    marked.extend(reads.iter().chain(&writes).map(|s| s.buf));
                    n += 1;
                }
                Rec::Barrier { .. } => n += 1,
            }
        }
        for s in &self.schedule {
            if let Step::Eager(op) = s {
                eager(op, t, false, &marked)?;
            }
            t += 1;
        }
        if self.replays() == 0 {
            return Err("no replay".into());
        }
        Ok(())
    }

    /// The finalize properties of executable graph 0.
    pub fn props(&self) -> GraphProps {
        match self.fusion {
            None => GraphProps::default(),
            Some(true) => GraphProps::default().fused(),
            Some(false) => GraphProps::default().fused_without_barriers(),
        }
    }
}

// ---------------------------------------------------------------------------------
// Printing and parsing
// ---------------------------------------------------------------------------------

fn fusion_name(f: Option<bool>) -> &'static str {
    match f {
        None => "plain",
        Some(true) => "fused(barriers)",
        Some(false) => "fused(no_barriers)",
    }
}

impl fmt::Debug for Rec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rec::Node { queue, dev, deps, cmd } => {
                write!(f, "q{queue}@{} {cmd:?}", dev_name(*dev))?;
                if !deps.is_empty() {
                    let deps: Vec<String> = deps.iter().map(|d| format!("n{d}")).collect();
                    write!(f, " after [{}]", deps.join(", "))?;
                }
                Ok(())
            }
            Rec::Barrier { queue, dev } => write!(f, "q{queue}@{}.barrier()", dev_name(*dev)),
            Rec::Eager(op) => write!(f, "{op:?}"),
        }
    }
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Replay { queue, dev, exec } => {
                write!(f, "q{queue}@{}.submit_graph(exec{exec})", dev_name(*dev))
            }
            Step::Eager(op) => write!(f, "{op:?}"),
        }
    }
}

impl fmt::Debug for GraphProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "GraphProgram {{")?;
        crate::write_header(f, &self.buffers, &self.queues)?;
        writeln!(
            f,
            "  graph: {} {} {}{}{}",
            dev_name(self.graph_dev),
            if self.explicit { "explicit" } else { "recorded" },
            fusion_name(self.fusion),
            if self.drop_graph { " dropped" } else { "" },
            if self.breadth_first { " breadth-first" } else { "" }
        )?;
        let mut t = 0;
        for op in &self.prologue {
            writeln!(f, "  #{t:<3} {op:?}")?;
            t += 1;
        }
        writeln!(f, "  record")?;
        let mut n = 0;
        for r in &self.body {
            if let Rec::Eager(_) = r {
                writeln!(f, "  #{t:<3} {r:?}")?;
                t += 1;
            } else {
                writeln!(f, "  n{n:<3} {r:?}")?;
                n += 1;
            }
        }
        writeln!(f, "  end")?;
        for s in &self.schedule {
            writeln!(f, "  #{t:<3} {s:?}")?;
            t += 1;
        }
        write!(f, "}}")
    }
}

fn parse_dev(d: &str) -> Result<Dev, String> {
    match d {
        "cpu" => Ok(Dev::Cpu),
        "sim" => Ok(Dev::Sim),
        _ => Err(format!("unknown device `{d}`")),
    }
}

/// `qQ@DEV.method` → `(Q, DEV, method)`.
fn queue_method(w: &str) -> Option<(usize, Dev, &str)> {
    let (qd, method) = w.split_once('.')?;
    let (q, d) = qd.split_once('@')?;
    Some((num(q.trim_start_matches('q')).ok()? as usize, parse_dev(d).ok()?, method))
}

fn parse_node(w: &[&str]) -> Result<Rec, String> {
    let first = *w.first().ok_or("empty node")?;
    if let Some((queue, dev, "barrier()")) = queue_method(first) {
        return Ok(Rec::Barrier { queue, dev });
    }
    let after = w.iter().position(|&x| x == "after").unwrap_or(w.len());
    let deps = if after < w.len() {
        parse_list(&w[after + 1..].join(" "))
            .into_iter()
            .map(|d| num(d.trim_start_matches('n')).map(|d| d as usize))
            .collect::<Result<_, _>>()?
    } else {
        vec![]
    };
    match parse_op(&w[..after])? {
        Op::Submit { queue, dev, cmd, .. } => Ok(Rec::Node { queue, dev, deps, cmd }),
        op => Err(format!("`{op:?}` is not a node")),
    }
}

fn parse_step(w: &[&str]) -> Result<Step, String> {
    if let Some((queue, dev, method)) = w.first().and_then(|f| queue_method(f)) {
        if let Some(e) = method.strip_prefix("submit_graph(exec").and_then(|m| m.strip_suffix(')')) {
            return Ok(Step::Replay { queue, dev, exec: num(e)? as usize });
        }
    }
    parse_op(w).map(Step::Eager)
}

impl GraphProgram {
    /// Parses the `Debug` form of a graph program (also with its line breaks
    /// collapsed, as in a `.proptest-regressions` file). Anything after the closing
    /// brace is ignored.
    pub fn parse(text: &str) -> Result<GraphProgram, String> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let pos = |w: &str| words.iter().position(|&x| x == w).ok_or_else(|| format!("missing `{w}`"));
        let (b, q, g) = (pos("buffers:")?, pos("queues:")?, pos("graph:")?);
        let is_marker =
            |w: &str, c: char| w.len() > 1 && w.starts_with(c) && w[1..].bytes().all(|c| c.is_ascii_digit());
        let is_any = |w: &str| is_marker(w, '#') || is_marker(w, 'n') || w == "record" || w == "end";
        let end = words.iter().position(|w| w.starts_with('}')).unwrap_or(words.len());
        let (buffers, queues) = crate::parse_header(&words[b + 1..q], &words[q + 1..g])?;
        let [dev, mode, fusion] = words.get(g + 1..g + 4).ok_or("graph: what")? else { unreachable!() };
        let fusion = match *fusion {
            "plain" => None,
            "fused(barriers)" => Some(true),
            "fused(no_barriers)" => Some(false),
            f => return Err(format!("unknown fusion `{f}`")),
        };
        let options: Vec<&str> =
            words[g + 4..].iter().take_while(|w| ["dropped", "breadth-first"].contains(w)).copied().collect();
        let mut p = GraphProgram {
            buffers,
            queues,
            graph_dev: parse_dev(dev)?,
            explicit: *mode == "explicit",
            fusion,
            drop_graph: options.contains(&"dropped"),
            breadth_first: options.contains(&"breadth-first"),
            prologue: vec![],
            body: vec![],
            schedule: vec![],
        };
        // 0: prologue, 1: body, 2: schedule.
        let mut part = 0;
        let (mut t, mut n) = (0, 0);
        let mut i = g + 4 + options.len();
        while i < end {
            let next = (i + 1..end).find(|&j| is_any(words[j])).unwrap_or(end);
            let (marker, w) = (words[i], &words[i + 1..next]);
            match marker {
                "record" if part == 0 => part = 1,
                "end" if part == 1 => part = 2,
                m if is_marker(m, 'n') && part == 1 => {
                    if num(&m[1..])? as usize != n {
                        return Err(format!("node {m} out of order"));
                    }
                    p.body.push(parse_node(w).map_err(|e| format!("node {m}: {e}"))?);
                    n += 1;
                }
                m if is_marker(m, '#') => {
                    if num(&m[1..])? as usize != t {
                        return Err(format!("op {m} out of order"));
                    }
                    let err = |e: String| format!("op {m}: {e}");
                    match part {
                        0 => p.prologue.push(parse_op(w).map_err(err)?),
                        1 => p.body.push(Rec::Eager(parse_op(w).map_err(err)?)),
                        _ => p.schedule.push(parse_step(w).map_err(err)?),
                    }
                    t += 1;
                }
                m => return Err(format!("unexpected `{m}`")),
            }
            i = next;
        }
        Ok(p)
    }
}

// ---------------------------------------------------------------------------------
// The generator
// ---------------------------------------------------------------------------------

/// A raw graph program: what proptest generates and shrinks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawGraphProgram {
    /// Buffers, queues, and the body's raw ops.
    pub base: RawProgram,
    /// The prologue's raw ops.
    pub prologue: Vec<RawOp>,
    /// Each replay (its `queue`, `sim` and `kind` fields) and the raw eager ops after it.
    pub replays: Vec<(RawOp, Vec<RawOp>)>,
    /// Graph device, explicit or recorded, fusion shape, graph dropped.
    pub flags: u32,
}

/// What a generated graph program may contain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphGen {
    /// Eager ops and nodes, as for [`Program::decode`] (drops only come after
    /// `finalize`, transfers in the body only on the CPU).
    pub opts: GenOptions,
    /// Finalize with graph fusion (keeping the body safe to fuse).
    pub fuse: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BodyKind {
    Node(Kind),
    Barrier,
    Eager,
}

/// Body kinds and weights (the simplest first).
const BODY_KINDS: [(BodyKind, u8); 7] = [
    (BodyKind::Node(Kind::Fill), 2),
    (BodyKind::Node(Kind::Kernel), 6),
    (BodyKind::Node(Kind::Copy), 3),
    (BodyKind::Node(Kind::HostTask), 3),
    (BodyKind::Node(Kind::CopyFromHost), 1),
    (BodyKind::Barrier, 1),
    (BodyKind::Eager, 2),
];

fn kernel_cmd(r: &RawOp, live: &Live<'_>) -> Cmd {
    let (reads, writes) = accessors(r, live, r.counts as usize % 3, 1 + (r.counts as usize / 3) % 2);
    let launch = match r.aux % 5 {
        0 => Launch::Flat,
        k => Launch::Nd(1 << (k - 1)),
    };
    Cmd::Kernel { reads, writes, salt: r.salt, launch, promote: vec![] }
}

/// Where an eager op goes: what it may not touch.
struct Limits<'a> {
    /// Recording queues (no submissions, no queue waits there).
    recording: &'a [(usize, Dev)],
    /// Buffers recorded nodes use (no host access).
    marked: &'a [usize],
    /// Buffer drops allowed.
    drops: bool,
}

/// The state of the generator along the timeline of eager ops and replays.
struct Timeline<'a> {
    opts: &'a GenOptions,
    nq: usize,
    live: Live<'a>,
    /// Numbers of eager submissions and replays.
    submits: Vec<usize>,
    /// Number of the next eager op or replay.
    next: usize,
}

impl Timeline<'_> {
    fn dev_of(&self, r: &RawOp) -> Dev {
        if self.opts.sim && r.sim {
            Dev::Sim
        } else {
            Dev::Cpu
        }
    }

    /// An eager op from `r` under `limits`, if one fits; numbers it.
    fn eager(&mut self, r: &RawOp, limits: &Limits<'_>) -> Option<Op> {
        let kinds: Vec<(Kind, u8)> = KINDS.iter().copied().filter(|(k, _)| k.allowed(self.opts)).collect();
        let kind = pick(&kinds, r.kind);
        let cmd = match kind {
            Kind::Kernel => Some(kernel_cmd(r, &self.live)),
            _ => plain_cmd(kind, r, &self.live),
        };
        let op = match (kind, cmd) {
            (_, Some(cmd)) => {
                let devs: &[Dev] = if self.opts.sim { &[Dev::Cpu, Dev::Sim] } else { &[Dev::Cpu] };
                let (q0, d0) = (r.queue as usize % self.nq, self.dev_of(r));
                // The chosen queue, or the next one that is not recording.
                let start = q0 * devs.len() + devs.iter().position(|&d| d == d0).unwrap_or(0);
                let n = self.nq * devs.len();
                let (queue, dev) = (0..n)
                    .map(|k| ((start + k) % n / devs.len(), devs[(start + k) % devs.len()]))
                    .find(|qd| !limits.recording.contains(qd))?;
                let mut deps = BTreeSet::new();
                if self.opts.deps && !self.submits.is_empty() {
                    for &d in &r.deps {
                        deps.insert(self.submits[d as usize % self.submits.len()]);
                    }
                }
                Op::Submit { queue, dev, deps: deps.into_iter().collect(), cmd }
            }
            (Kind::Drop, _) => {
                if !limits.drops || self.live.live.len() < 2 {
                    return None;
                }
                let b = self.live.pick(r.spans[0].buf);
                self.live.live.retain(|&x| x != b);
                Op::Drop(b)
            }
            (kind, None) => host_op(kind, r, &self.submits, self.nq, &self.live)?,
        };
        match &op {
            Op::QueueWait(q) if limits.recording.iter().any(|&(rq, _)| rq == *q) => return None,
            Op::Snapshot(b) | Op::HostUpdate { buf: b, .. } if limits.marked.contains(b) => return None,
            Op::Submit { .. } => self.submits.push(self.next),
            _ => {}
        }
        self.next += 1;
        Some(op)
    }
}

/// Makes the body's kernels safe to fuse (see [`fusion::fusion_safe`]) and returns the
/// fusion property: every ND-range kernel gets one local size `l`; then without
/// barriers if `flags` asks and that is safe, else with them; if that is not safe
/// either, every kernel becomes a plain range (one work-group: always safe with
/// barriers).
///
/// Graph fusion may fuse any subset of the body's kernels (a partition's chain), in an
/// order its edges allow; [`fusion::fusion_safe`] looks at pairs, but whether the
/// compiler accepts a chain (and so which work-groups there are) depends on the
/// subset: plain kernels whose size `l` does not divide make the whole body
/// refused, not a chain without them. So the check is on the body with every kernel
/// an ND-range of `l`: pairwise safe with groups of `l` work-items, hence safe for
/// every subset (which has groups of `l`, or one group, or is refused).
fn make_fusable(body: &mut [Rec], flags: u32) -> bool {
    let local = 1usize << ((flags >> 4) % 4);
    let all_plain = (flags >> 6).is_multiple_of(4);
    let no_barriers = (flags >> 8).is_multiple_of(3);
    let relaunch = |body: &mut [Rec], plain: bool| {
        for r in body.iter_mut() {
            if let Rec::Node { cmd: Cmd::Kernel { launch, .. }, .. } = r {
                if plain {
                    *launch = Launch::Flat;
                } else if let Launch::Nd(l) = launch {
                    *l = local;
                }
            }
        }
    };
    relaunch(body, all_plain);
    // Every kernel as an ND-range of `local` (see above).
    let ks: Vec<Cmd> = body
        .iter()
        .filter_map(|r| match r {
            Rec::Node { cmd: Cmd::Kernel { reads, writes, salt, .. }, .. } => Some(Cmd::Kernel {
                reads: reads.clone(),
                writes: writes.clone(),
                salt: *salt,
                launch: Launch::Nd(local),
                promote: vec![],
            }),
            _ => None,
        })
        .collect();
    let refs: Vec<&Cmd> = ks.iter().collect();
    if no_barriers && fusion::fusion_safe(&refs, false) {
        return false;
    }
    let has_nd =
        body.iter().any(|r| matches!(r, Rec::Node { cmd: Cmd::Kernel { launch: Launch::Nd(_), .. }, .. }));
    if has_nd && !fusion::fusion_safe(&refs, true) {
        relaunch(body, true);
    }
    true
}

/// Decodes a raw graph program (see the module documentation). Every raw program
/// decodes; raw ops that make no valid op where they are are dropped.
pub fn decode(raw: &RawGraphProgram, gen: &GraphGen) -> GraphProgram {
    let opts = &gen.opts;
    let buffers = crate::decode_buffers(&raw.base.buffers);
    let mut queues: Vec<bool> =
        raw.base.queues.iter().take(MAX_QUEUES).map(|&q| q && opts.in_order).collect();
    if queues.is_empty() {
        queues.push(false);
    }
    let nq = queues.len();
    let flags = raw.flags;
    let graph_dev = if opts.sim && flags & 1 != 0 { Dev::Sim } else { Dev::Cpu };
    let explicit = (flags >> 1).is_multiple_of(4);
    let mut tl = Timeline {
        opts,
        nq,
        live: Live { specs: &buffers, live: (0..buffers.len()).collect() },
        submits: vec![],
        next: 0,
    };
    let free = Limits { recording: &[], marked: &[], drops: false };
    let prologue: Vec<Op> = raw.prologue.iter().filter_map(|r| tl.eager(r, &free)).collect();

    // The body. Its queues first (a superset: some raw nodes make no node).
    let body_kinds: Vec<(BodyKind, u8)> = BODY_KINDS
        .iter()
        .copied()
        .filter(|(k, _)| match k {
            BodyKind::Node(Kind::CopyFromHost) => opts.transfers,
            _ => true,
        })
        .collect();
    // Fused graphs are mostly recorded on the graph's device only (so that partitions
    // are longer).
    let one_device = gen.fuse && !(flags >> 10).is_multiple_of(4);
    let rec_dev = |r: &RawOp, tl: &Timeline<'_>| if one_device { graph_dev } else { tl.dev_of(r) };
    let mut recording: Vec<(usize, Dev)> = Vec::new();
    if !explicit {
        for r in &raw.base.ops {
            if pick(&body_kinds, r.kind) != BodyKind::Eager {
                recording.push((r.queue as usize % nq, rec_dev(r, &tl)));
            }
        }
    }
    let mut marked: Vec<usize> = Vec::new();
    let mut body: Vec<Rec> = Vec::new();
    let mut nodes = 0usize;
    for r in &raw.base.ops {
        let kind = pick(&body_kinds, r.kind);
        let (queue, dev) = (r.queue as usize % nq, rec_dev(r, &tl));
        let node_dev = if explicit { graph_dev } else { dev };
        let cmd = match kind {
            BodyKind::Eager => {
                let limits = Limits { recording: &recording, marked: &marked, drops: false };
                if let Some(op) = tl.eager(r, &limits) {
                    body.push(Rec::Eager(op));
                }
                continue;
            }
            BodyKind::Barrier => {
                body.push(Rec::Barrier { queue, dev });
                nodes += 1;
                continue;
            }
            // The simulated device cannot record host-to-buffer writes.
            BodyKind::Node(Kind::CopyFromHost) if node_dev == Dev::Sim => continue,
            BodyKind::Node(Kind::Kernel) => kernel_cmd(r, &tl.live),
            BodyKind::Node(k) => match plain_cmd(k, r, &tl.live) {
                Some(cmd) => cmd,
                None => continue,
            },
        };
        let mut deps = BTreeSet::new();
        if opts.deps && nodes > 0 {
            for &d in &r.deps {
                deps.insert(d as usize % nodes);
            }
        }
        let (reads, writes) = cmd.accesses();
        marked.extend(reads.iter().chain(&writes).map(|s| s.buf));
        body.push(Rec::Node { queue, dev, deps: deps.into_iter().collect(), cmd });
        nodes += 1;
    }
    let fusion = gen.fuse.then(|| make_fusable(&mut body, flags));

    // The schedule.
    let after = Limits { recording: &[], marked: &[], drops: opts.drops };
    let mut schedule = Vec::new();
    for (r, ops) in raw.replays.iter().take(4) {
        let (queue, dev) = (r.queue as usize % nq, tl.dev_of(r));
        let exec = usize::from(r.kind % 4 == 3);
        tl.submits.push(tl.next);
        tl.next += 1;
        schedule.push(Step::Replay { queue, dev, exec });
        schedule.extend(ops.iter().filter_map(|r| tl.eager(r, &after)).map(Step::Eager));
    }
    if schedule.is_empty() {
        schedule.push(Step::Replay { queue: 0, dev: Dev::Cpu, exec: 0 });
    }
    let drop_graph = (flags >> 12).is_multiple_of(4);
    let breadth_first = (flags >> 14) & 1 == 1;
    GraphProgram {
        buffers,
        queues,
        graph_dev,
        explicit,
        fusion,
        drop_graph,
        breadth_first,
        prologue,
        body,
        schedule,
    }
}

// ---------------------------------------------------------------------------------
// Checks of the graph itself
// ---------------------------------------------------------------------------------

/// Checks `edges` (each node's predecessors, from `CommandGraph::edges`) against the
/// program: nodes are numbered in body order, edges only go forward, and every pair
/// that must be ordered is (through a path): conflicting nodes (one writes an
/// element the other uses), explicit dependencies, nodes of one in-order recording
/// queue, and a recorded barrier with every node of its queue.
pub fn check_edges(p: &GraphProgram, edges: &[Vec<u32>]) -> Result<(), String> {
    let nodes: Vec<&Rec> = p.nodes().map(|n| n.1).collect();
    if edges.len() != nodes.len() {
        return Err(format!("the graph has {} nodes, the program {}", edges.len(), nodes.len()));
    }
    // reach[b][a]: a path from a to b (a < b).
    let n = nodes.len();
    let mut reach = vec![vec![false; n]; n];
    for (b, preds) in edges.iter().enumerate() {
        for &a in preds {
            let a = a as usize;
            if a >= b {
                return Err(format!("node n{b} depends on the later node n{a}"));
            }
            let (earlier, rest) = reach.split_at_mut(b);
            rest[0][a] = true;
            for (r, &x) in rest[0].iter_mut().zip(&earlier[a]) {
                *r |= x;
            }
        }
    }
    let on = |r: &Rec| match r {
        Rec::Node { queue, dev, .. } | Rec::Barrier { queue, dev } => (*queue, *dev),
        Rec::Eager(_) => unreachable!(),
    };
    for b in 0..n {
        for a in 0..b {
            let why = match (nodes[a], nodes[b]) {
                (Rec::Node { cmd: ca, .. }, Rec::Node { cmd: cb, deps, .. }) => {
                    if deps.contains(&a) {
                        Some("an explicit dependency")
                    } else if ca.conflicts_with(cb) {
                        Some("conflicting accesses")
                    } else {
                        None
                    }
                }
                (_, Rec::Node { deps, .. }) if deps.contains(&a) => Some("an explicit dependency"),
                _ => None,
            };
            let why = why.or_else(|| {
                let same = on(nodes[a]) == on(nodes[b]) && !p.explicit;
                let barrier =
                    matches!(nodes[a], Rec::Barrier { .. }) || matches!(nodes[b], Rec::Barrier { .. });
                if same && barrier {
                    Some("a barrier of their queue")
                } else if same && p.queues[on(nodes[a]).0] {
                    Some("their in-order queue")
                } else {
                    None
                }
            });
            if let (Some(why), false) = (why, reach[b][a]) {
                return Err(format!("no path from n{a} to n{b}, which {why} order\nedges: {edges:?}"));
            }
        }
    }
    Ok(())
}

/// Checks an executable graph's plan: the order is a topological order of `edges`,
/// each node is in the partition `partition_of` says, partitions only follow earlier
/// ones, and (for `p`'s fused executable graph) every fused chain is a chain of
/// kernels that is safe to fuse.
pub fn check_plan(
    p: &GraphProgram,
    edges: &[Vec<u32>],
    exec: &ExecutableGraph,
    fused: bool,
) -> Result<(), String> {
    let n = edges.len();
    let order = exec.order();
    let mut pos = vec![usize::MAX; n];
    for (i, &x) in order.iter().enumerate() {
        let slot = pos.get_mut(x as usize).ok_or_else(|| format!("order {order:?} names node {x}"))?;
        if *slot != usize::MAX {
            return Err(format!("order {order:?} names node {x} twice"));
        }
        *slot = i;
    }
    if order.len() != n {
        return Err(format!("order {order:?} of {n} nodes"));
    }
    for (b, preds) in edges.iter().enumerate() {
        if let Some(a) = preds.iter().find(|&&a| pos[a as usize] > pos[b]) {
            return Err(format!("order {order:?} puts n{b} before its predecessor n{a}"));
        }
    }
    let parts = exec.partitions();
    let part_of = exec.partition_of();
    for (x, &q) in part_of.iter().enumerate() {
        if !parts.get(q as usize).is_some_and(|part| part.nodes.contains(&(x as u32))) {
            return Err(format!("n{x} is not in its partition {q}: {parts:?}"));
        }
    }
    for (i, part) in parts.iter().enumerate() {
        if part.preds.iter().any(|&q| q as usize >= i) {
            return Err(format!("partition {i} follows a later one: {parts:?}"));
        }
    }
    let chains = exec.fused_chains();
    if !fused {
        return if chains.is_empty() { Ok(()) } else { Err(format!("a plain graph fused {chains:?}")) };
    }
    let nodes: Vec<&Rec> = p.nodes().map(|n| n.1).collect();
    for (chain, name) in chains {
        let cmds = chain
            .iter()
            .map(|&x| match nodes.get(x as usize) {
                Some(Rec::Node { cmd: cmd @ Cmd::Kernel { .. }, .. }) => Ok(cmd),
                _ => Err(format!("fused chain `{name}` {chain:?} has n{x}, not a kernel")),
            })
            .collect::<Result<Vec<&Cmd>, String>>()?;
        if !fusion::fusion_safe(&cmds, p.fusion != Some(false)) {
            return Err(format!("the generator made an unsafe chain: `{name}` {chain:?}"));
        }
    }
    Ok(())
}

/// Under a memory threshold no chain reaches ([`Config::pass_windows`]), graph
/// fusion fuses only chains with a promoted accessor, so every fused chain touches a
/// buffer some kernel or `set_promotion` gave a hint. (The other chains stay unfused,
/// refused as `CacheResident`: [`Stats`] counts those.)
pub fn check_unpromoted_chains_unfused(p: &GraphProgram, exec: &ExecutableGraph) -> Result<(), String> {
    let promoted = fusion::promoted_buffers(&p.flatten().program);
    let nodes: Vec<&Rec> = p.nodes().map(|n| n.1).collect();
    for (chain, name) in exec.fused_chains() {
        let touches_promoted = chain.iter().any(|&x| match nodes.get(x as usize) {
            Some(Rec::Node { cmd, .. }) => {
                let (reads, writes) = cmd.accesses();
                reads.iter().chain(&writes).any(|s| promoted.contains(&s.buf))
            }
            _ => false,
        });
        if !touches_promoted {
            return Err(format!(
                "fused chain `{name}` {chain:?} promotes nothing, under a memory threshold no chain reaches"
            ));
        }
    }
    Ok(())
}

/// Whether graph fusion left a chain unfused because the caches hold its memory.
fn cache_resident(why: &gantry::NotFused) -> bool {
    matches!(
        why,
        gantry::NotFused::Refused {
            reason: gantry::FusionError::Unprofitable {
                reason: gantry::Unprofitable::CacheResident { .. },
                ..
            },
            ..
        }
    )
}

// ---------------------------------------------------------------------------------
// Running through Gantry
// ---------------------------------------------------------------------------------

/// What the executable graphs of the programs run so far (in this process) looked
/// like, for coverage reports: `[graphs, partitions, host-task partitions,
/// partitions on the simulated device, graphs with a fused chain, fused chains, fused
/// kernels, chains left unfused as cache-resident]`.
pub struct Stats([std::sync::atomic::AtomicUsize; 8]);

/// The counters of [`Stats`].
pub static STATS: Stats = Stats([const { std::sync::atomic::AtomicUsize::new(0) }; 8]);

impl Stats {
    fn count(&self, exec: &ExecutableGraph) {
        let parts = exec.partitions();
        let chains = exec.fused_chains();
        let values = [
            1,
            parts.len(),
            parts.iter().filter(|p| p.host_task).count(),
            parts.iter().filter(|p| p.device == 1).count(),
            usize::from(!chains.is_empty()),
            chains.len(),
            chains.iter().map(|c| c.0.len()).sum(),
            exec.not_fused().iter().filter(|w| cache_resident(w)).count(),
        ];
        for (c, v) in self.0.iter().zip(values) {
            c.fetch_add(v, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The counters now.
    pub fn get(&self) -> [usize; 8] {
        self.0.each_ref().map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Host-task digests of one node, in the order of its runs.
type Sink = Arc<Mutex<Vec<(usize, u32)>>>;

/// What [`drive`] leaves: the graph objects (kept alive until the end) and each
/// host-task node's digests (by node index).
struct Driven {
    _graph: Option<CommandGraph>,
    _execs: Vec<ExecutableGraph>,
    sinks: Vec<(usize, Sink)>,
}

/// Runs everything but the final waits: the prologue, recording, finalize (checking
/// the graph and plans), the schedule.
fn drive(p: &GraphProgram, flat: &Flat, s: &mut Session) -> Result<Driven, String> {
    let mut t = 0;
    let eager = |s: &mut Session, t: &mut usize| {
        let i = flat.at[*t];
        *t += 1;
        s.step(i, &flat.program.ops[i])
    };
    for _ in &p.prologue {
        eager(s, &mut t)?;
    }
    let rt = s.runtime_handle();
    let graph = match (p.graph_dev, s.config.sim) {
        (Dev::Sim, true) => rt.graph_on(1),
        _ => rt.graph(),
    };
    let recording = p.recording_queues();
    for &(q, d) in &recording {
        graph
            .begin_recording(s.queue(q, d))
            .map_err(|e| format!("q{q}@{}: begin_recording: {e}", dev_name(d)))?;
    }
    let mut events: Vec<Event> = Vec::new();
    let mut handles: Vec<gantry::Node> = Vec::new();
    let mut sinks: Vec<(usize, Sink)> = Vec::new();
    for r in &p.body {
        let j = events.len().max(handles.len());
        s.set_progress(|| format!("recording n{j}"));
        let fail = |e: gantry::Error| format!("n{j} ({r:?}): {e}");
        match r {
            Rec::Eager(_) => eager(s, &mut t)?,
            Rec::Barrier { queue, dev } if !p.explicit => {
                events.push(s.queue(*queue, *dev).barrier().map_err(fail)?)
            }
            Rec::Barrier { .. } => {
                let deps: Vec<gantry::Node> = handles.last().copied().into_iter().collect();
                handles.push(graph.add_empty(&deps).map_err(fail)?);
            }
            Rec::Node { queue, dev, deps, cmd } => {
                let sink: Sink = Default::default();
                if matches!(cmd, Cmd::HostTask { .. }) {
                    sinks.push((j, sink.clone()));
                }
                let bufs = &Bufs(&s.buffers);
                let mut readback = None;
                let build_it = |cg: &mut gantry::Handler| build(cg, bufs, cmd, &mut readback, (j, sink));
                if p.explicit {
                    let deps: Vec<gantry::Node> = deps.iter().map(|&d| handles[d]).collect();
                    handles.push(graph.add(build_it, &deps).map_err(fail)?);
                } else {
                    let deps: Vec<Event> = deps.iter().map(|&d| events[d].clone()).collect();
                    let ev = s
                        .queue(*queue, *dev)
                        .submit(|cg| {
                            for d in &deps {
                                cg.depends_on(d);
                            }
                            build_it(cg);
                        })
                        .map_err(fail)?;
                    events.push(ev);
                }
                if readback.is_some() {
                    return Err(format!("n{j}: a readback in a graph"));
                }
            }
        }
    }
    for &(q, d) in &recording {
        graph
            .end_recording(s.queue(q, d))
            .map_err(|e| format!("q{q}@{}: end_recording: {e}", dev_name(d)))?;
    }
    s.set_progress(|| "finalize".into());
    let edges = graph.edges();
    check_edges(p, &edges)?;
    let mut execs = vec![graph.finalize(p.props()).map_err(|e| format!("finalize: {e}"))?];
    check_plan(p, &edges, &execs[0], p.fusion.is_some())?;
    if s.config.pass_windows {
        check_unpromoted_chains_unfused(p, &execs[0])?;
    }
    STATS.count(&execs[0]);
    if p.schedule.iter().any(|s| matches!(s, Step::Replay { exec: 1, .. })) {
        execs.push(graph.finalize(GraphProps::default()).map_err(|e| format!("plain finalize: {e}"))?);
        check_plan(p, &edges, &execs[1], false)?;
    }
    let graph = (!p.drop_graph).then_some(graph);
    for step in &p.schedule {
        match step {
            Step::Eager(_) => eager(s, &mut t)?,
            Step::Replay { queue, dev, exec } => {
                let i = flat.at[t];
                t += 1;
                s.set_progress(|| format!("#{} (flat #{i}): {step:?}", t - 1));
                let ev = s
                    .queue(*queue, *dev)
                    .submit_graph(&execs[*exec])
                    .map_err(|e| format!("#{}: submit_graph failed: {e}", t - 1))?;
                s.events[i] = Some(ev);
            }
        }
    }
    Ok(Driven { _graph: graph, _execs: execs, sinks })
}

/// Runs `p` through Gantry under `config` and returns its outcome, or the first error,
/// with the op indices of [`GraphProgram::flatten`]'s program.
pub fn run_graph(p: &GraphProgram, config: Config) -> Result<Outcome, String> {
    run_graph_in(p, session(p, config))
}

/// The session of `p`'s flattened program, on a runtime with `p`'s linearizer.
fn session(p: &GraphProgram, config: Config) -> Session {
    let mut b = config.builder();
    if p.breadth_first {
        b = b.linearizer(Arc::new(gantry::BreadthFirst));
    }
    Session::with_runtime(&p.flatten().program, config, b.build())
}

fn run_graph_in(p: &GraphProgram, mut s: Session) -> Result<Outcome, String> {
    let flat = p.flatten();
    let driven = drive(p, &flat, &mut s)?;
    let mut out = s.finish()?;
    // Each node's k-th run is replay k's: submissions of a graph run one after another.
    for (j, sink) in driven.sinks {
        let runs = sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (k, (_, digest)) in runs.into_iter().enumerate() {
            out.host_reads.push((flat.node_at.get(k).map_or(usize::MAX, |n| n[j]), digest));
        }
    }
    out.host_reads.sort_unstable();
    Ok(out)
}

/// [`run_graph`] on a helper thread; a run that takes longer than `timeout` is
/// reported as a hang (see [`run_gantry_watched`]).
pub fn run_graph_watched(
    p: &GraphProgram,
    config: Config,
    timeout: std::time::Duration,
) -> Result<Outcome, String> {
    let (p1, p2) = (p.clone(), p.clone());
    let start = move || session(&p1, config);
    let run = move |s: Session| run_graph_in(&p2, s);
    let context = || format!("\nflattened:\n{:?}", p.flatten().program);
    crate::run_watched(config, timeout, "gantry-proptest-graph", start, run, context)
}

/// Checks that Gantry under `config` produces the model's outcome for `p`: `R`
/// replays equal `R` serial executions of the body (within [`hang_timeout`]). Also
/// checks the graph's edges and plans (see [`check_edges`], [`check_plan`]).
pub fn check_graph(p: &GraphProgram, config: Config) -> Result<(), String> {
    p.validate()?;
    let flat = p.flatten();
    let model = run_model(&flat.program);
    let got = run_graph_watched(p, config, hang_timeout())?;
    match model.mismatch(&got) {
        None => Ok(()),
        Some(m) => Err(format!(
            "{config:?}: Gantry differs from the model:\n{m}\n(op numbers of the flattened program: {:?})",
            flat.program
        )),
    }
}
