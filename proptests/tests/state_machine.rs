//! Model-based test of the public API with `proptest-state-machine`.
//!
//! Each transition submits work and waits for it; the reference state machine predicts
//! every buffer's contents and which operations fail. Transitions:
//!
//! * **Batch**: operations (kernels, elementwise kernels, kernels that fail, copies,
//!   fills, host tasks, host write guards) submitted together to CPU and
//!   simulated-device queues, in-order and out-of-order. A failing kernel's writes are
//!   undone, and an operation that depends on a failed one within the batch (through a
//!   buffer it wrote or read, or an in-order queue) fails too, without running.
//!   Queue 4 is on a second simulated device whose fault plan fails its `nth` kernel
//!   launches (`Fault::Kernel`): the model counts that device's launches and predicts
//!   the faulted kernel's failure and its dependents' like a failing kernel's. A batch
//!   has at most one kernel on that device, so the launch order is known.
//! * **Fusion**: a fusion window on one queue: `start_fusion`, elementwise kernels
//!   (and kernels that fail), optionally one synchronizing operation among them (a
//!   host write guard, a copy, fill or host task on any queue, or a kernel on another
//!   queue), then `complete_fusion` (with or without barriers) or `cancel_fusion`. The synchronizing operation cancels the fusion
//!   early if it depends on a listed kernel; if not, and it fails, a fused kernel
//!   that depends on it fails with it. The kernels' data flow is index-aligned
//!   (work-item `i` touches element `i` only), so fused results equal unfused ones.
//!   A fused window's event (every listed kernel's) fails if one of its kernels
//!   fails, but fusion does not change which results survive: the fused kernel's
//!   effects are the unfused kernels' under the batch rules (a failed kernel's
//!   writes are undone, its dependents in the window do not run, the others keep
//!   their writes). A cancelled window runs unfused, with the batch rules.
//!   The model also predicts each kernel's event (the fusion's, or its own after an
//!   early cancellation by a host access) and the fusion's outcome. A window on the
//!   faulty device is completed with no synchronizing operation: its fused kernel is
//!   one launch there, which a fault fails as a whole. (Unfused, its kernels would
//!   reach the driver in an order that depends on their dependencies.)
//! * **Graph**: a command graph on the CPU or the simulated device, built with `add`
//!   or recorded from one or two queues (of its device, or one of the other device,
//!   whose nodes get partitions of their own): kernels, elementwise kernels, fills,
//!   copies, host tasks; finalized plain or with graph fusion (with or without
//!   barriers, elementwise kernels only), replayed 1 to 3 times on any queue, with
//!   host write guards and eager operations between replays. Optionally a kernel
//!   reads a dynamic parameter, swapped between replays to another live buffer of
//!   its length or to a new one (which the model then keeps). The model is that many
//!   serial executions. Graphs hold no failing kernels: a failed node fails its
//!   dependents inside the replay, but its partition's event fails as a whole, so
//!   replays and eager work that were waiting on the partition through its
//!   requirements (the union of its nodes') fail too; the grouping of nodes into
//!   partitions is the scheduler's choice, which the model does not predict. For the
//!   same reason graphs stay off the faulty device.
//! * **Drop**: a buffer is dropped.
//!
//! Runs in manual mode, where all of this is deterministic. Shrinking gives a minimal
//! failing sequence of transitions.
//!
//! `GANTRY_PROPTEST_CASES=N` runs N sequences instead of the default.

use std::collections::BTreeSet;
use std::sync::Once;

use gantry::{
    Buffer, CancelReason, Event, Fault, FaultPlan, FusionOutcome, FusionProps, GraphProps, Handler, Mode,
    Queue, QueueOptions, Runtime, SimConfig,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

/// Queues: 0 CPU out-of-order, 1 CPU in-order, 2 sim out-of-order, 3 sim in-order,
/// 4 out-of-order on the simulated device with injected kernel faults.
const QUEUES: usize = 5;
const IN_ORDER: [bool; QUEUES] = [false, true, false, true, false];
const DEVICE: [u32; QUEUES] = [0, 0, 1, 1, 2];
const FAULTY: usize = 4;
/// Buffers a sequence may create in all (graph updates add some).
const MAX_BUFFERS: usize = 9;

#[derive(Clone, Debug)]
enum Op {
    /// `dst[i] = src[i % len] * 3 + k` for every element of `dst` (src may be dst).
    Kernel {
        queue: usize,
        src: usize,
        dst: usize,
        k: u32,
    },
    /// `dst[i] = (src[i] if i < len(src) else i) * 3 + k`: each work-item touches its
    /// own index only, so fusing it with barriers or without changes nothing.
    Elementwise {
        queue: usize,
        src: usize,
        dst: usize,
        k: u32,
    },
    /// Writes `dst[0]`, then panics: the writes are undone.
    FailingKernel {
        queue: usize,
        dst: usize,
    },
    Fill {
        queue: usize,
        dst: usize,
        value: u32,
    },
    /// `dst[..n] = src[..n]`, n the shorter length (src != dst).
    Copy {
        queue: usize,
        src: usize,
        dst: usize,
    },
    /// `dst[0] += sum(src)` on a host thread (src may be dst).
    HostTask {
        queue: usize,
        src: usize,
        dst: usize,
    },
    /// Host write guard: `buf[idx % len] = value`, after everything submitted before
    /// it has finished (in a batch, a full synchronization point: earlier failures are
    /// retired, so they fail nothing after it).
    Guard {
        buf: usize,
        idx: usize,
        value: u32,
    },
}

impl Op {
    fn queue(&self) -> Option<usize> {
        match *self {
            Op::Kernel { queue, .. }
            | Op::Elementwise { queue, .. }
            | Op::FailingKernel { queue, .. }
            | Op::Fill { queue, .. }
            | Op::Copy { queue, .. }
            | Op::HostTask { queue, .. } => Some(queue),
            Op::Guard { .. } => None,
        }
    }

    fn set_queue(&mut self, q: usize) {
        match self {
            Op::Kernel { queue, .. }
            | Op::Elementwise { queue, .. }
            | Op::FailingKernel { queue, .. }
            | Op::Fill { queue, .. }
            | Op::Copy { queue, .. }
            | Op::HostTask { queue, .. } => *queue = q,
            Op::Guard { .. } => {}
        }
    }

    fn is_kernel(&self) -> bool {
        matches!(self, Op::Kernel { .. } | Op::Elementwise { .. } | Op::FailingKernel { .. })
    }

    /// The buffers it reads and the buffers it writes.
    fn access(&self) -> (Vec<usize>, Vec<usize>) {
        match *self {
            Op::Kernel { src, dst, .. }
            | Op::Elementwise { src, dst, .. }
            | Op::Copy { src, dst, .. }
            | Op::HostTask { src, dst, .. } => (vec![src], vec![dst]),
            Op::FailingKernel { dst, .. } => (vec![dst], vec![dst]),
            Op::Fill { dst, .. } => (vec![], vec![dst]),
            Op::Guard { buf, .. } => (vec![], vec![buf]),
        }
    }

    /// Whether one of the two must wait for the other (a buffer both use, one writing
    /// it; every access starts at element 0, so any two of one buffer overlap).
    fn conflicts(&self, other: &Op) -> bool {
        let ((ra, wa), (rb, wb)) = (self.access(), other.access());
        wa.iter().any(|b| rb.contains(b) || wb.contains(b)) || ra.iter().any(|b| wb.contains(b))
    }

    fn buffers(&self) -> Vec<usize> {
        let (mut r, w) = self.access();
        r.extend(w);
        r
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Complete { no_barriers: bool },
    Cancel,
}

/// A fusion window on `queue`: `start_fusion`, the kernels (all on `queue`), with
/// `sync` submitted before kernel `pos` (or after all of them), then `end`.
#[derive(Clone, Debug)]
struct Window {
    queue: usize,
    kernels: Vec<Op>,
    sync: Option<(usize, Op)>,
    end: End,
}

/// What replaces a dynamic parameter's buffer.
#[derive(Clone, Debug)]
enum Target {
    Live(usize),
    /// A new buffer with these contents (the model adds it).
    Fresh(Vec<u32>),
}

#[derive(Clone, Debug)]
struct Between {
    guard: Option<(usize, usize, u32)>,
    /// An eager operation (that cannot fail) on a queue of the CPU or the simulated
    /// device, after the guard.
    eager: Option<Op>,
    swap: Option<Target>,
}

/// A graph whose node `pos` (in recording order) is `kernel` (an [`Op::Kernel`],
/// src != dst), with its `src` argument a dynamic parameter.
#[derive(Clone, Debug)]
struct Dynamic {
    pos: usize,
    kernel: Op,
}

#[derive(Clone, Debug)]
struct GraphRun {
    device: u32,
    /// The queues that record the nodes, or none: `add` calls.
    record: Vec<usize>,
    ops: Vec<Op>,
    /// Graph fusion: `Some(barriers)`.
    fused: Option<bool>,
    dynamic: Option<Dynamic>,
    /// The queue that submits the replays.
    submit: usize,
    replays: usize,
    /// Before replays 1.. (one fewer than `replays`).
    between: Vec<Between>,
}

impl GraphRun {
    /// The nodes in recording order.
    fn nodes(&self) -> Vec<Op> {
        let mut nodes = self.ops.clone();
        if let Some(d) = &self.dynamic {
            nodes.insert(d.pos.min(nodes.len()), d.kernel.clone());
        }
        nodes
    }

    fn fresh(&self) -> usize {
        self.between.iter().filter(|b| matches!(b.swap, Some(Target::Fresh(_)))).count()
    }
}

#[derive(Clone, Debug)]
enum Transition {
    Batch(Vec<Op>),
    Fusion(Window),
    Graph(Box<GraphRun>),
    Drop(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FusionExpect {
    Fused(usize),
    CancelledByDependent,
    CancelledByRequest,
}

/// What the last transition should have done besides the buffers' contents.
#[derive(Clone, Debug, Default)]
struct Expect {
    /// Per outcome, in the order the system under test collects them: whether it fails.
    failed: Vec<bool>,
    /// Fusion windows: per kernel, whether its event is the fusion's.
    listed: Vec<bool>,
    fusion: Option<FusionExpect>,
}

#[derive(Clone, Debug)]
struct Model {
    buffers: Vec<Option<Vec<u32>>>,
    /// The faulty device's fault plan (the kernel launches it fails) and its launches
    /// so far.
    faults: BTreeSet<u64>,
    launches: u64,
    expect: Expect,
}

/// Which buffers and in-order queues failed commands poison, within one transition.
struct Poison {
    wrote: Vec<bool>,
    read: Vec<bool>,
    queue: [bool; QUEUES],
}

impl Poison {
    fn new(n: usize) -> Self {
        Poison { wrote: vec![false; n], read: vec![false; n], queue: [false; QUEUES] }
    }

    /// A failed command's writes make later accesses fail; its reads make later writes
    /// fail; its queue, if in-order, fails what follows.
    fn hits(&self, op: &Op) -> bool {
        let (reads, writes) = op.access();
        op.queue().is_some_and(|q| IN_ORDER[q] && self.queue[q])
            || reads.iter().any(|&b| self.wrote[b])
            || writes.iter().any(|&b| self.wrote[b] || self.read[b])
    }

    fn mark(&mut self, op: &Op) {
        let (reads, writes) = op.access();
        for b in writes {
            self.wrote[b] = true;
        }
        for b in reads {
            self.read[b] = true;
        }
        if let Some(q) = op.queue() {
            self.queue[q] = true;
        }
    }
}

impl Model {
    fn live(&self) -> Vec<usize> {
        (0..self.buffers.len()).filter(|&b| self.buffers[b].is_some()).collect()
    }

    fn is_live(&self, b: usize) -> bool {
        self.buffers.get(b).is_some_and(Option::is_some)
    }

    fn len(&self, b: usize) -> usize {
        self.buffers[b].as_ref().map_or(0, Vec::len)
    }

    /// Runs `op` as an eager submission after the failures in `p`; returns whether it
    /// fails.
    fn run(&mut self, p: &mut Poison, op: &Op) -> bool {
        let poisoned = p.hits(op);
        let mut fails = poisoned || matches!(op, Op::FailingKernel { .. });
        // A kernel on the faulty device reaches its driver unless a failure on another
        // device poisons it first (then it is never launched).
        if !poisoned && op.is_kernel() && op.queue() == Some(FAULTY) {
            fails |= self.faults.contains(&self.launches);
            self.launches += 1;
        }
        if fails {
            p.mark(op);
        } else {
            self.effect(op);
        }
        fails
    }

    /// The effect of `op` on the buffers.
    fn effect(&mut self, op: &Op) {
        let bufs = &mut self.buffers;
        match *op {
            Op::Kernel { src, dst, k, .. } => {
                let s = bufs[src].clone().unwrap();
                for (i, x) in bufs[dst].as_mut().unwrap().iter_mut().enumerate() {
                    *x = s[i % s.len()].wrapping_mul(3).wrapping_add(k);
                }
            }
            Op::Elementwise { src, dst, k, .. } => {
                let s = bufs[src].clone().unwrap();
                for (i, x) in bufs[dst].as_mut().unwrap().iter_mut().enumerate() {
                    *x = s.get(i).copied().unwrap_or(i as u32).wrapping_mul(3).wrapping_add(k);
                }
            }
            Op::Fill { dst, value, .. } => bufs[dst].as_mut().unwrap().fill(value),
            Op::Copy { src, dst, .. } => {
                let s = bufs[src].clone().unwrap();
                let d = bufs[dst].as_mut().unwrap();
                let len = s.len().min(d.len());
                d[..len].copy_from_slice(&s[..len]);
            }
            Op::HostTask { src, dst, .. } => {
                let sum = bufs[src].as_ref().unwrap().iter().fold(0u32, |a, &x| a.wrapping_add(x));
                let d = bufs[dst].as_mut().unwrap();
                d[0] = d[0].wrapping_add(sum);
            }
            Op::Guard { buf, idx, value } => {
                let d = bufs[buf].as_mut().unwrap();
                let len = d.len();
                d[idx % len] = value;
            }
            Op::FailingKernel { .. } => unreachable!("a failing kernel has no effect"),
        }
    }

    fn batch(&mut self, ops: &[Op]) {
        let mut p = Poison::new(self.buffers.len());
        for op in ops {
            if matches!(op, Op::Guard { .. }) {
                p = Poison::new(self.buffers.len());
            }
            let failed = self.run(&mut p, op);
            self.expect.failed.push(failed);
        }
    }

    /// Outcomes in submission order: the kernels and the synchronizing operation, then
    /// the event `complete_fusion` returns.
    fn window(&mut self, w: &Window) {
        let pos = w.sync.as_ref().map_or(w.kernels.len(), |s| s.0);
        let pre = &w.kernels[..pos];
        let sync = w.sync.as_ref().map(|s| &s.1);
        // The synchronizing operation depends on a listed kernel: it cancels the fusion.
        let early = sync.is_some_and(|s| {
            let queued = s.queue().is_some_and(|q| q == w.queue && IN_ORDER[q]);
            pre.iter().any(|k| s.conflicts(k)) || (queued && !pre.is_empty())
        });
        // Every synchronizing operation cancels the fusion when its call returns:
        // the kernels after it are not listed.
        let guard = matches!(sync, Some(Op::Guard { .. }));
        let listed = if early { pos } else { w.kernels.len() };
        let fused = !early && matches!(w.end, End::Complete { .. });
        let n = self.buffers.len();
        let mut failed = Vec::new();
        let fusion_failed = if fused {
            // One kernel, one event: if any part fails, the fused kernel fails. The
            // synchronizing operation is independent of the kernels listed before it
            // and runs on its own (first: the kernels are held until
            // `complete_fusion`); if it fails, so does the fused kernel, without
            // running, if a kernel listed after it depends on it.
            let mut p = Poison::new(n);
            let sync_failed = sync.map(|s| self.run(&mut p, s));
            let poisoned = w.kernels[pos..].iter().any(|k| p.hits(k));
            // On the faulty device the fused kernel is one launch, which a fault
            // fails without running.
            let mut faulted = false;
            if !poisoned && w.queue == FAULTY {
                faulted = self.faults.contains(&self.launches);
                self.launches += 1;
            }
            let panics = w.kernels.iter().any(|k| matches!(k, Op::FailingKernel { .. }));
            let fails = poisoned || faulted || panics;
            if !poisoned && !faulted {
                // It ran: its effects are the unfused kernels' (a failed kernel's
                // writes undone, its dependents in the window skipped, independent
                // kernels' writes kept), whether one failed or none did. A rerun
                // after a failure is not a launch of its own.
                let mut listed = Poison::new(n);
                for k in &w.kernels {
                    if listed.hits(k) || matches!(k, Op::FailingKernel { .. }) {
                        listed.mark(k);
                    } else {
                        self.effect(k);
                    }
                }
            }
            for _ in &w.kernels {
                failed.push(fails);
            }
            if let Some(f) = sync_failed {
                failed.insert(pos, f);
            }
            fails
        } else {
            let mut p = Poison::new(n);
            let mut listed_failed = false;
            for (i, k) in w.kernels.iter().enumerate() {
                if i == pos {
                    let s = sync.unwrap();
                    failed.push(self.run(&mut p, s));
                    if guard && early {
                        // The guard waited for the kernels it cancelled the fusion
                        // for, and the wait after it retired them.
                        p = Poison::new(n);
                    }
                }
                let f = self.run(&mut p, k);
                listed_failed |= f && i < listed;
                failed.push(f);
            }
            if pos == w.kernels.len() {
                if let Some(s) = sync {
                    failed.push(self.run(&mut p, s));
                }
            }
            // The kernels listed share the fusion's event.
            let mut k = 0;
            for (i, f) in failed.iter_mut().enumerate() {
                let is_sync = sync.is_some() && i == pos;
                if !is_sync {
                    if k < listed {
                        *f = listed_failed;
                    }
                    k += 1;
                }
            }
            listed_failed
        };
        if matches!(w.end, End::Complete { .. }) {
            failed.push(fusion_failed);
        }
        self.expect.failed = failed;
        self.expect.listed = (0..w.kernels.len()).map(|i| i < listed).collect();
        // The synchronizing operation cancelled the fusion before `cancel_fusion`.
        let by_dependent = early;
        self.expect.fusion = Some(if fused {
            FusionExpect::Fused(w.kernels.len())
        } else if by_dependent {
            FusionExpect::CancelledByDependent
        } else {
            FusionExpect::CancelledByRequest
        });
    }

    /// `replays` serial executions of the graph's nodes; nothing fails.
    fn graph(&mut self, g: &GraphRun) {
        let mut nodes = g.nodes();
        for r in 0..g.replays {
            if r > 0 {
                let b = &g.between[r - 1];
                if let Some((buf, idx, value)) = b.guard {
                    self.effect(&Op::Guard { buf, idx, value });
                }
                if let Some(op) = &b.eager {
                    self.effect(op);
                }
                if let (Some(target), Some(d)) = (&b.swap, &g.dynamic) {
                    let to = match target {
                        Target::Live(t) => *t,
                        Target::Fresh(v) => {
                            self.buffers.push(Some(v.clone()));
                            self.buffers.len() - 1
                        }
                    };
                    if let Op::Kernel { src, .. } = &mut nodes[d.pos.min(g.ops.len())] {
                        *src = to;
                    }
                }
            }
            for op in &nodes {
                self.effect(op);
            }
        }
        let between: usize = g.between.iter().map(|b| b.guard.iter().count() + b.eager.iter().count()).sum();
        self.expect.failed = vec![false; g.replays + between];
    }
}

fn op(live: Vec<usize>, queues: std::ops::Range<usize>) -> impl Strategy<Value = Op> {
    let pick = proptest::sample::select(live);
    let queue = queues;
    prop_oneof![
        3 => (queue.clone(), pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(queue, src, dst, k)| Op::Kernel { queue, src, dst, k }),
        1 => (queue.clone(), pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(queue, src, dst, k)| Op::Elementwise { queue, src, dst, k }),
        1 => (queue.clone(), pick.clone()).prop_map(|(queue, dst)| Op::FailingKernel { queue, dst }),
        2 => (queue.clone(), pick.clone(), 0..1000u32).prop_map(|(queue, dst, value)| Op::Fill { queue, dst, value }),
        2 => (queue.clone(), pick.clone(), pick.clone()).prop_map(|(queue, src, dst)| Op::Copy { queue, src, dst }),
        2 => (queue, pick.clone(), pick.clone()).prop_map(|(queue, src, dst)| Op::HostTask { queue, src, dst }),
        1 => (pick, 0..64usize, 0..1000u32).prop_map(|(buf, idx, value)| Op::Guard { buf, idx, value }),
    ]
}

/// A fusion window's synchronizing operation (kernels go to another queue than the
/// window's).
fn sync_op(live: Vec<usize>) -> impl Strategy<Value = Op> {
    let pick = proptest::sample::select(live);
    prop_oneof![
        1 => (0..QUEUES, pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(queue, src, dst, k)| Op::Kernel { queue, src, dst, k }),
        1 => (0..QUEUES, pick.clone()).prop_map(|(queue, dst)| Op::FailingKernel { queue, dst }),
        2 => (pick.clone(), 0..64usize, 0..1000u32).prop_map(|(buf, idx, value)| Op::Guard { buf, idx, value }),
        1 => (0..QUEUES, pick.clone(), 0..1000u32).prop_map(|(queue, dst, value)| Op::Fill { queue, dst, value }),
        2 => (0..QUEUES, pick.clone(), pick.clone()).prop_map(|(queue, src, dst)| Op::Copy { queue, src, dst }),
        1 => (0..QUEUES, pick.clone(), pick).prop_map(|(queue, src, dst)| Op::HostTask { queue, src, dst }),
    ]
}

/// At most one kernel of a batch on the faulty device: with several, the order in
/// which they reach its driver (and so which one a fault hits) would depend on when
/// their dependencies on other devices complete.
fn one_faulty_kernel(mut ops: Vec<Op>) -> Vec<Op> {
    let mut seen = false;
    for op in &mut ops {
        if op.is_kernel() && op.queue() == Some(FAULTY) {
            if seen {
                op.set_queue(2);
            }
            seen = true;
        }
    }
    ops
}

fn window(live: Vec<usize>) -> impl Strategy<Value = Window> {
    let pick = proptest::sample::select(live.clone());
    let kernel = prop_oneof![
        5 => (pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(src, dst, k)| Op::Elementwise { queue: 0, src, dst, k }),
        1 => pick.prop_map(|dst| Op::FailingKernel { queue: 0, dst }),
    ];
    let end = prop_oneof![
        3 => any::<bool>().prop_map(|no_barriers| End::Complete { no_barriers }),
        1 => Just(End::Cancel),
    ];
    (
        0..QUEUES,
        proptest::collection::vec(kernel, 1..5),
        proptest::option::of((0..5usize, sync_op(live))),
        end,
    )
        .prop_map(|(queue, mut kernels, mut sync, mut end)| {
            if queue == FAULTY {
                // Fused, so that the launches are known: one.
                sync = None;
                if end == End::Cancel {
                    end = End::Complete { no_barriers: false };
                }
            }
            for k in &mut kernels {
                k.set_queue(queue);
            }
            let sync = sync.map(|(pos, mut op)| {
                if op.is_kernel() && op.queue() == Some(queue) {
                    op.set_queue((queue + 1) % QUEUES);
                }
                (pos.min(kernels.len()), op)
            });
            Window { queue, kernels, sync, end }
        })
}

/// Operations that cannot fail (graph nodes and eager work between replays).
fn plain_op(live: Vec<usize>, queues: std::ops::Range<usize>) -> impl Strategy<Value = Op> {
    let pick = proptest::sample::select(live);
    let queue = queues;
    prop_oneof![
        2 => (queue.clone(), pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(queue, src, dst, k)| Op::Kernel { queue, src, dst, k }),
        2 => (queue.clone(), pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(queue, src, dst, k)| Op::Elementwise { queue, src, dst, k }),
        1 => (queue.clone(), pick.clone(), 0..1000u32).prop_map(|(queue, dst, value)| Op::Fill { queue, dst, value }),
        1 => (queue.clone(), pick.clone(), pick.clone()).prop_map(|(queue, src, dst)| Op::Copy { queue, src, dst }),
        1 => (queue, pick.clone(), pick).prop_map(|(queue, src, dst)| Op::HostTask { queue, src, dst }),
    ]
}

fn graph(state: &Model) -> impl Strategy<Value = GraphRun> {
    let live = state.live();
    let lens: Vec<usize> = (0..state.buffers.len()).map(|b| state.len(b)).collect();
    let room = MAX_BUFFERS.saturating_sub(state.buffers.len());
    let pick = proptest::sample::select(live.clone());
    let guard = proptest::option::weighted(0.3, (pick, 0..64usize, 0..1000u32));
    let swap = proptest::option::weighted(
        0.7,
        (any::<Index>(), any::<bool>(), proptest::collection::vec(0..50u32, 24)),
    );
    let dynamic = proptest::option::weighted(
        0.5,
        (any::<Index>(), any::<Index>(), any::<Index>(), 0..2usize, 0..100u32),
    );
    let eager = proptest::option::weighted(0.3, plain_op(live.clone(), 0..FAULTY));
    (
        (0..2u32, 0..6usize, 0..2usize, 0..4usize, 0..4usize, 1..4usize),
        proptest::collection::vec(plain_op(live.clone(), 0..2), 0..6),
        dynamic,
        proptest::collection::vec((guard, eager, swap), 3),
    )
        .prop_map(move |((device, record, other, fusion, submit, replays), ops, dynamic, between)| {
            let queues = [2 * device as usize, 2 * device as usize + 1];
            // A queue of the other device records nodes that get partitions of their own.
            let other = 2 * (1 - device as usize) + other;
            let record = match record {
                0 => vec![],
                1 => vec![queues[0]],
                2 => vec![queues[1]],
                3 => queues.to_vec(),
                4 => vec![queues[0], other],
                _ => vec![other],
            };
            let fused = [None, None, Some(true), Some(false)][fusion];
            let on = |q: usize| record.get(q % record.len().max(1)).copied().unwrap_or(queues[0]);
            let ops: Vec<Op> = ops
                .into_iter()
                .filter(|op| !matches!(op, Op::Copy { src, dst, .. } if src == dst))
                .map(|mut op| {
                    op.set_queue(on(op.queue().unwrap()));
                    match op {
                        // Graph fusion fuses every kernel chain with work-group
                        // barriers at most: only index-aligned kernels stay exact.
                        Op::Kernel { queue, src, dst, k } if fused.is_some() => {
                            Op::Elementwise { queue, src, dst, k }
                        }
                        op => op,
                    }
                })
                .collect();
            // The parameter's buffers are read only: no node has an edge to the
            // kernel through them (edges are those of the buffer it was built with).
            let written: Vec<usize> = ops.iter().flat_map(|op| op.access().1).collect();
            let unwritten: Vec<usize> = live.iter().copied().filter(|b| !written.contains(b)).collect();
            let dynamic = dynamic.filter(|_| !unwritten.is_empty()).and_then(|(src, dst, pos, queue, k)| {
                let src = *src.get(&unwritten);
                let dsts: Vec<usize> = live.iter().copied().filter(|&b| b != src).collect();
                (!dsts.is_empty()).then(|| Dynamic {
                    pos: pos.index(ops.len() + 1),
                    kernel: Op::Kernel { queue: on(queue), src, dst: *dst.get(&dsts), k },
                })
            });
            let mut fresh = 0;
            let between = between
                .into_iter()
                .take(replays - 1)
                .map(|(guard, eager, swap)| {
                    let swap = dynamic.as_ref().zip(swap).and_then(|(d, (to, new, values))| {
                        let Op::Kernel { src, dst, .. } = d.kernel else { unreachable!() };
                        let len = lens[src];
                        let targets: Vec<usize> =
                            unwritten.iter().copied().filter(|&b| lens[b] == len && b != dst).collect();
                        if (new || targets.is_empty()) && fresh < room {
                            fresh += 1;
                            Some(Target::Fresh(values[..len].to_vec()))
                        } else {
                            (!targets.is_empty()).then(|| Target::Live(*to.get(&targets)))
                        }
                    });
                    let eager = eager.filter(|op| !matches!(op, Op::Copy { src, dst, .. } if src == dst));
                    Between { guard, eager, swap }
                })
                .collect();
            GraphRun { device, record, ops, fused, dynamic, submit, replays, between }
        })
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        (
            proptest::collection::vec(proptest::collection::vec(0..50u32, 1..24), 2..5),
            proptest::collection::btree_set(0..8u64, 0..3),
        )
            .prop_map(|(bufs, faults)| Model {
                buffers: bufs.into_iter().map(Some).collect(),
                faults,
                launches: 0,
                expect: Expect::default(),
            })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Transition> {
        let live = state.live();
        let batch = proptest::collection::vec(op(live.clone(), 0..QUEUES), 1..8)
            .prop_map(|ops| Transition::Batch(one_faulty_kernel(ops)));
        let fusion = window(live.clone()).prop_map(Transition::Fusion);
        let graph = graph(state).prop_map(|g| Transition::Graph(Box::new(g)));
        if live.len() > 2 {
            prop_oneof![
                5 => batch,
                3 => fusion,
                3 => graph,
                1 => proptest::sample::select(live).prop_map(Transition::Drop),
            ]
            .boxed()
        } else {
            prop_oneof![5 => batch, 3 => fusion, 3 => graph].boxed()
        }
    }

    fn preconditions(state: &Model, t: &Transition) -> bool {
        let valid = |op: &Op| {
            op.buffers().iter().all(|&b| state.is_live(b))
                && !matches!(op, Op::Copy { src, dst, .. } if src == dst)
        };
        match t {
            Transition::Drop(b) => state.is_live(*b) && state.live().len() > 2,
            Transition::Batch(ops) => {
                ops.iter().all(valid)
                    && ops.iter().filter(|op| op.is_kernel() && op.queue() == Some(FAULTY)).count() <= 1
            }
            Transition::Fusion(w) => {
                w.queue < QUEUES
                    && (w.queue != FAULTY || (w.sync.is_none() && w.end != End::Cancel))
                    && !w.kernels.is_empty()
                    && w.kernels.iter().all(|k| {
                        valid(k)
                            && k.queue() == Some(w.queue)
                            && matches!(k, Op::Elementwise { .. } | Op::FailingKernel { .. })
                    })
                    && w.sync.as_ref().is_none_or(|(pos, s)| {
                        *pos <= w.kernels.len() && valid(s) && !(s.is_kernel() && s.queue() == Some(w.queue))
                    })
            }
            Transition::Graph(g) => graph_valid(state, g),
        }
    }

    fn apply(mut state: Model, t: &Transition) -> Model {
        state.expect = Expect::default();
        match t {
            Transition::Drop(b) => state.buffers[*b] = None,
            Transition::Batch(ops) => state.batch(ops),
            Transition::Fusion(w) => state.window(w),
            Transition::Graph(g) => state.graph(g),
        }
        state
    }
}

fn graph_valid(state: &Model, g: &GraphRun) -> bool {
    let on_device = |q: usize| q < FAULTY && DEVICE[q] == g.device;
    let nodes = g.nodes();
    let plain = |op: &Op| {
        op.buffers().iter().all(|&b| state.is_live(b))
            && match op {
                Op::Kernel { .. } | Op::Elementwise { .. } | Op::Fill { .. } | Op::HostTask { .. } => true,
                Op::Copy { src, dst, .. } => src != dst,
                Op::FailingKernel { .. } | Op::Guard { .. } => false,
            }
    };
    let node_ok = |op: &Op| {
        plain(op)
            && !(g.fused.is_some() && matches!(op, Op::Kernel { .. }))
            && op
                .queue()
                .is_some_and(|q| if g.record.is_empty() { on_device(q) } else { g.record.contains(&q) })
    };
    let basic = g.device < 2
        && g.record.iter().all(|&q| q < FAULTY)
        && (g.record.len() < 2 || g.record[0] != g.record[1])
        && g.submit < FAULTY
        && (1..4).contains(&g.replays)
        && g.between.len() == g.replays - 1
        && g.between.iter().all(|b| {
            b.guard.is_none_or(|(buf, ..)| state.is_live(buf))
                && b.eager.as_ref().is_none_or(|op| plain(op) && op.queue() < Some(FAULTY))
        })
        && state.buffers.len() + g.fresh() <= MAX_BUFFERS
        && nodes.iter().all(node_ok);
    if !basic {
        return false;
    }
    let written: Vec<usize> = g.ops.iter().flat_map(|op| op.access().1).collect();
    match &g.dynamic {
        None => g.between.iter().all(|b| b.swap.is_none()),
        Some(Dynamic { kernel: Op::Kernel { src, dst, .. }, .. }) => {
            let len = state.len(*src);
            src != dst
                && !written.contains(src)
                && g.between.iter().all(|b| match &b.swap {
                    None => true,
                    Some(Target::Live(t)) => {
                        state.is_live(*t) && state.len(*t) == len && !written.contains(t) && t != dst
                    }
                    Some(Target::Fresh(v)) => v.len() == len,
                })
        }
        Some(_) => false,
    }
}

struct Gantry {
    rt: Runtime,
    queues: Vec<Queue>,
    buffers: Vec<Option<Buffer<u32>>>,
}

/// An operation's outcome: an event to wait on, or (host write guards) whether it
/// failed at once.
enum Outcome {
    Event(Event),
    Done { failed: bool },
}

impl Outcome {
    fn failed(&self) -> bool {
        match self {
            Outcome::Event(ev) => ev.wait().is_err(),
            Outcome::Done { failed } => *failed,
        }
    }
}

/// Builds the command group of `op` (not a guard).
fn build(cg: &mut Handler, g: &Gantry, op: &Op) {
    let buf = |b: usize| g.buffers[b].as_ref().unwrap();
    match *op {
        Op::Kernel { src, dst, k, .. } => {
            let d = buf(dst);
            if src == dst {
                let a = cg.read_write(d);
                cg.parallel_for(d.len(), move |it| {
                    let i = it.global_linear_id();
                    a.set(it, i, a.get(it, i).wrapping_mul(3).wrapping_add(k))
                });
            } else {
                // The source is argument 0 (a graph's dynamic parameter binds it).
                let (s, slen) = (cg.read(buf(src)), buf(src).len());
                let o = cg.elements_out(d);
                cg.parallel_for(d.len(), move |it| {
                    *o.elem(it) = s.get(it, it.global_linear_id() % slen).wrapping_mul(3).wrapping_add(k)
                });
            }
        }
        Op::Elementwise { src, dst, k, .. } => {
            let d = buf(dst);
            if src == dst {
                let a = cg.elements_mut(d);
                cg.parallel_for(d.len(), move |it| {
                    let x = a.elem(it);
                    *x = x.wrapping_mul(3).wrapping_add(k);
                });
            } else {
                let (s, slen) = (cg.read(buf(src)), buf(src).len());
                let o = cg.elements_out(d);
                cg.parallel_for(d.len(), move |it| {
                    let i = it.global_linear_id();
                    let x = if i < slen { s.get(it, i) } else { i as u32 };
                    *o.elem(it) = x.wrapping_mul(3).wrapping_add(k);
                });
            }
        }
        Op::FailingKernel { dst, .. } => {
            let o = cg.read_write(buf(dst));
            cg.single_task(move |it| {
                o.set(it, 0, 12345);
                panic!("{INTENDED}");
            });
        }
        Op::Fill { dst, value, .. } => cg.fill(buf(dst), value),
        Op::Copy { src, dst, .. } => {
            let len = buf(src).len().min(buf(dst).len());
            cg.copy_range(buf(src), 0, buf(dst), 0, len);
        }
        Op::HostTask { src, dst, .. } => {
            if src == dst {
                let mut d = cg.host_read_write(buf(dst));
                cg.host_task(move |ctx| {
                    let d = d.as_mut_slice(ctx);
                    let sum = d.iter().fold(0u32, |a, &x| a.wrapping_add(x));
                    d[0] = d[0].wrapping_add(sum);
                });
            } else {
                let s = cg.host_read(buf(src));
                let mut d = cg.host_read_write(buf(dst));
                cg.host_task(move |ctx| {
                    let sum = s.as_slice(ctx).iter().fold(0u32, |a, &x| a.wrapping_add(x));
                    let d = d.as_mut_slice(ctx);
                    d[0] = d[0].wrapping_add(sum);
                });
            }
        }
        Op::Guard { .. } => unreachable!("guards are not command groups"),
    }
}

/// Holds `buf` for writing and sets one element; whether that failed.
fn guard(g: &Gantry, buf: usize, idx: usize, value: u32) -> bool {
    match g.buffers[buf].as_ref().unwrap().write() {
        Ok(mut guard) => {
            let len = guard.len();
            guard[idx % len] = value;
            false
        }
        Err(_) => true,
    }
}

fn submit(g: &Gantry, op: &Op) -> Outcome {
    if let Op::Guard { buf, idx, value } = *op {
        g.rt.wait_idle().unwrap();
        return Outcome::Done { failed: guard(g, buf, idx, value) };
    }
    let q = &g.queues[op.queue().unwrap()];
    Outcome::Event(q.submit(|cg| build(cg, g, op)).expect("valid command group"))
}

fn check_failures(outcomes: &[Outcome], expect: &Expect, what: &dyn Fn(usize) -> String) {
    assert_eq!(outcomes.len(), expect.failed.len());
    for (i, (outcome, expect_fail)) in outcomes.iter().zip(&expect.failed).enumerate() {
        assert_eq!(outcome.failed(), *expect_fail, "outcome {i} ({})", what(i));
    }
}

fn run_window(g: &Gantry, w: &Window, expect: &Expect) {
    let q = &g.queues[w.queue];
    q.start_fusion().unwrap();
    assert!(q.is_in_fusion_mode());
    let mut outcomes = Vec::new();
    let mut names = Vec::new();
    let pos = w.sync.as_ref().map_or(usize::MAX, |s| s.0);
    for i in 0..=w.kernels.len() {
        if i == pos {
            let s = &w.sync.as_ref().unwrap().1;
            outcomes.push(submit(g, s));
            if matches!(s, Op::Guard { .. }) {
                // Retire whatever the guard released.
                g.rt.wait_idle().unwrap();
            }
        }
        if let Some(k) = w.kernels.get(i) {
            let Outcome::Event(ev) = submit(g, k) else { unreachable!("kernels have events") };
            names.push(ev.name().to_string());
            outcomes.push(Outcome::Event(ev));
        }
    }
    match w.end {
        End::Complete { no_barriers } => {
            let done = q.complete_fusion(FusionProps { barriers: !no_barriers }).unwrap();
            outcomes.push(Outcome::Event(done));
        }
        End::Cancel => q.cancel_fusion(),
    }
    g.rt.wait_idle().unwrap();
    assert!(!q.is_in_fusion_mode());
    let listed: Vec<bool> = names.iter().map(|n| n == "fusion").collect();
    assert_eq!(listed, expect.listed, "kernels that returned the fusion's event");
    let outcome = q.fusion_outcome();
    let ok = match (expect.fusion.unwrap(), &outcome) {
        (FusionExpect::Fused(n), Some(FusionOutcome::Fused { kernels, .. })) => *kernels == n,
        (
            FusionExpect::CancelledByDependent,
            Some(FusionOutcome::Cancelled(CancelReason::Dependent { .. })),
        )
        | (FusionExpect::CancelledByRequest, Some(FusionOutcome::Cancelled(CancelReason::Requested))) => true,
        _ => false,
    };
    assert!(ok, "fusion outcome {outcome:?}, expected {:?}", expect.fusion);
    let mut items: Vec<String> = w.kernels.iter().map(|k| format!("{k:?}")).collect();
    if let Some((pos, s)) = &w.sync {
        items.insert(*pos, format!("sync {s:?}"));
    }
    items.push("complete_fusion".into());
    check_failures(&outcomes, expect, &|i| items[i].clone());
}

fn run_graph(g: &mut Gantry, run: &GraphRun, expect: &Expect) {
    let graph = g.rt.graph_on(run.device);
    for &q in &run.record {
        graph.begin_recording(&g.queues[q]).unwrap();
    }
    let mut dynamic = None;
    for (i, op) in run.nodes().iter().enumerate() {
        let node = if run.record.is_empty() {
            graph.add(|cg| build(cg, g, op), &[]).unwrap()
        } else {
            let q = &g.queues[op.queue().unwrap()];
            q.submit(|cg| build(cg, g, op)).unwrap().node().expect("a recorded event names its node")
        };
        if let Some(d) = run.dynamic.as_ref().filter(|d| d.pos.min(run.ops.len()) == i) {
            dynamic = Some((node, d));
        }
    }
    for &q in &run.record {
        graph.end_recording(&g.queues[q]).unwrap();
    }
    let param = dynamic.map(|(node, d)| {
        let Op::Kernel { src, .. } = d.kernel else { unreachable!() };
        let param = graph.dynamic_buffer(g.buffers[src].as_ref().unwrap());
        graph.set_arg(node, 0, &param).unwrap();
        param
    });
    let props = GraphProps { fusion: run.fused, updatable: param.is_some() };
    let exec = graph.finalize(props).unwrap();
    let mut outcomes = Vec::new();
    for r in 0..run.replays {
        if r > 0 {
            let b = &run.between[r - 1];
            if let Some((buf, idx, value)) = b.guard {
                outcomes.push(Outcome::Done { failed: guard(g, buf, idx, value) });
            }
            if let Some(op) = &b.eager {
                outcomes.push(submit(g, op));
            }
            if let (Some(target), Some(param)) = (&b.swap, &param) {
                let to = match target {
                    Target::Live(t) => *t,
                    Target::Fresh(v) => {
                        g.buffers.push(Some(g.rt.buffer(v)));
                        g.buffers.len() - 1
                    }
                };
                exec.update_param(param, g.buffers[to].as_ref().unwrap()).unwrap();
            }
        }
        outcomes.push(Outcome::Event(g.queues[run.submit].submit_graph(&exec).unwrap()));
    }
    g.rt.wait_idle().unwrap();
    check_failures(&outcomes, expect, &|i| format!("replay, guard or eager operation {i}"));
}

const INTENDED: &str = "intended state-machine failure";

impl StateMachineTest for Gantry {
    type SystemUnderTest = Gantry;
    type Reference = Reference;

    fn init_test(model: &Model) -> Gantry {
        static QUIET: Once = Once::new();
        QUIET.call_once(|| {
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                if info.payload().downcast_ref::<String>().is_none_or(|m| m != INTENDED) {
                    default(info)
                }
            }));
        });
        let faults = FaultPlan {
            faults: model.faults.iter().map(|&nth| Fault::Kernel { nth }).collect(),
            ..FaultPlan::default()
        };
        // The reference model fuses by the fusion rules alone, forms slower fused on
        // the CPU included.
        let rt = Runtime::builder()
            .fuse_unprofitable(true)
            .mode(Mode::Manual)
            .worker_threads(0)
            .host_threads(0)
            .fusion_warnings(0)
            .sim(SimConfig::default())
            .sim(SimConfig { name: "faulty".into(), faults, ..SimConfig::default() })
            .build();
        let queues = (0..QUEUES)
            .map(|q| rt.queue_with(QueueOptions { device: DEVICE[q], in_order: IN_ORDER[q] }).unwrap())
            .collect();
        let buffers = model.buffers.iter().map(|b| b.as_ref().map(|v| rt.buffer(v))).collect();
        Gantry { rt, queues, buffers }
    }

    fn apply(mut g: Gantry, model: &Model, t: Transition) -> Gantry {
        let expect = &model.expect;
        match t {
            Transition::Drop(b) => {
                g.buffers[b] = None;
            }
            Transition::Batch(ops) => {
                let outcomes: Vec<Outcome> = ops.iter().map(|op| submit(&g, op)).collect();
                g.rt.wait_idle().unwrap();
                check_failures(&outcomes, expect, &|i| format!("{:?}", ops[i]));
            }
            Transition::Fusion(w) => run_window(&g, &w, expect),
            Transition::Graph(run) => run_graph(&mut g, &run, expect),
        }
        assert_eq!(g.buffers.len(), model.buffers.len());
        g
    }

    fn check_invariants(g: &Gantry, model: &Model) {
        for (b, expect) in model.buffers.iter().enumerate() {
            if let (Some(buf), Some(expect)) = (&g.buffers[b], expect) {
                assert_eq!(&buf.to_vec().unwrap(), expect, "buffer {b}");
            }
        }
        g.rt.wait_idle().unwrap();
        let stats = g.rt.stats();
        let live = model.buffers.iter().filter(|b| b.is_some()).count() as u64;
        assert_eq!(stats.live_commands, 0);
        assert!(stats.live_records <= live, "records of dropped buffers are released: {stats:?}");
    }
}

fn cases() -> u32 {
    std::env::var("GANTRY_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1024)
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn api_matches_the_reference_state_machine(sequential 1..16 => Gantry);
}
