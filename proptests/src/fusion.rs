//! Programs with kernel-fusion windows, checked against the unfused serial model.
//!
//! A *window* is `qQ@DEV.start_fusion()`, then ops (kernels on that queue join the
//! fusion list; anything else in between may synchronize with them and cancel the
//! fusion early), then `complete_fusion(barriers | no_barriers)`, `cancel_fusion()`,
//! or nothing until the final waits. Whatever happens, every buffer, snapshot,
//! readback and host-task read must equal the serial model's ([`run_model`]), which
//! ignores fusion. The one exception is a buffer with a promotion hint: a fusion that
//! internalizes it does not write it back, so its final contents are not compared
//! ([`promoted_buffers`]).
//!
//! [`decode`] makes such programs from raw numbers, keeping them *fusion-safe*, so
//! that fusing cannot change results the model predicts:
//!
//! * a completed window's kernels must be safe to fuse ([`fusion_safe`]): with the
//!   barrier, any two accesses of one element by different kernels (one a write) are
//!   made by work-items of one work-group; without it (`no_barriers`), by the same
//!   work-item. Otherwise `no_barriers` becomes `barriers`, and an unsafe list is
//!   cancelled instead;
//! * a promoted buffer (the program's *scratch* buffer, if it has one) is only used by
//!   kernels of one window at a time, whole, first written whole (`discard`) in that
//!   window and never read outside windows: its contents are only needed inside;
//! * patterns that once hit Gantry bugs can be left out ([`Avoid`]) to bisect.
//!
//! The Gantry run also checks each fusion's outcome ([`check_outcome`]) where it is
//! known: right after `cancel_fusion`, after a `complete_fusion … wait`, and at the
//! end for each queue's last window. A *pure* window (only kernels of its queue
//! between its ends, no other window open) must fuse all its kernels, or be
//! cancelled as `Empty` or `Failed` when it has no kernel or illegal ND-ranges; in
//! any window, a fusion fuses all of the window's kernels or none.

use std::collections::{BTreeSet, HashMap};

use gantry::{CancelReason, FusionError, FusionOutcome, Promotion, Unprofitable};

use super::*;

/// A fusion window of a program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    /// Program queue.
    pub queue: usize,
    /// Device of the Gantry queue.
    pub dev: Dev,
    /// Index of the `start_fusion` op.
    pub start: usize,
    /// Index of its `complete_fusion` or `cancel_fusion` op (`None`: never ended).
    pub end: Option<usize>,
    /// Ended by `complete_fusion`.
    pub completed: bool,
    /// The kernels submitted to its queue in between (op indices).
    pub kernels: Vec<usize>,
    /// Only kernels of its queue in between, no other window open at its start, and
    /// ended: its outcome is predictable.
    pub pure: bool,
    /// Some kernel uses a buffer with a promotion hint (fusion may warn).
    pub promotes: bool,
}

/// The windows of a program, in order of their starts.
pub fn windows(p: &Program) -> Vec<Window> {
    let promoted = promoted_buffers(p);
    let mut out: Vec<Window> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    for (i, op) in p.ops.iter().enumerate() {
        match op {
            Op::StartFusion { queue, dev } => {
                open.push(out.len());
                out.push(Window {
                    queue: *queue,
                    dev: *dev,
                    start: i,
                    end: None,
                    completed: false,
                    kernels: vec![],
                    pure: open.len() == 1,
                    promotes: false,
                });
            }
            Op::CompleteFusion { queue, dev, .. } | Op::CancelFusion { queue, dev } => {
                if let Some(k) = open.iter().position(|&w| (out[w].queue, out[w].dev) == (*queue, *dev)) {
                    let w = &mut out[open.remove(k)];
                    w.end = Some(i);
                    w.completed = matches!(op, Op::CompleteFusion { .. });
                }
            }
            _ => {}
        }
        for &w in &open {
            let w = &mut out[w];
            if w.start == i {
                continue;
            }
            match op {
                Op::Submit { queue, dev, cmd: cmd @ Cmd::Kernel { .. }, .. }
                    if (*queue, *dev) == (w.queue, w.dev) =>
                {
                    w.kernels.push(i);
                    let (r, wr) = cmd.accesses();
                    w.promotes |= r.iter().chain(&wr).any(|s| promoted.contains(&s.buf));
                }
                _ => w.pure = false,
            }
        }
    }
    for w in &mut out {
        w.pure &= w.end.is_some();
    }
    out
}

/// Buffers with a promotion hint (by `set_promotion` or an accessor's `promote`):
/// their final contents are undefined after a fusion that internalizes them.
pub fn promoted_buffers(p: &Program) -> Vec<usize> {
    let mut out = Vec::new();
    for op in &p.ops {
        match op {
            Op::SetPromotion { buf, promotion } if *promotion != Promotion::None => out.push(*buf),
            Op::Submit { cmd: Cmd::Kernel { promote, .. }, .. } => {
                out.extend(promote.iter().filter(|(_, p)| *p != Promotion::None).map(|(b, _)| *b))
            }
            _ => {}
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Work-items and launch of a kernel: `(n, global size, local size if ND)`.
fn launch_of(cmd: &Cmd) -> (usize, usize, Option<usize>) {
    let Cmd::Kernel { writes, launch, .. } = cmd else { panic!("not a kernel: {cmd:?}") };
    let n = writes.iter().map(|(s, _)| s.len()).max().unwrap_or(1);
    match launch {
        Launch::Flat | Launch::Map => (n, n, None),
        Launch::Nd(l) => (n, n.div_ceil(*l) * l, Some(*l)),
    }
}

/// The fused grid's work-group size (`None`: plain ranges only, one group of at most
/// [`MAX_LEN`] work-items), or `Err` if the closure compiler refuses the kernels
/// (no kernel, different local sizes, a grid the local size does not divide).
#[allow(clippy::result_unit_err)] // the refusal carries no detail the model needs
pub fn fused_local(kernels: &[&Cmd]) -> Result<Option<usize>, ()> {
    if kernels.is_empty() {
        return Err(());
    }
    let launches: Vec<_> = kernels.iter().map(|k| launch_of(k)).collect();
    let mut locals: Vec<usize> = launches.iter().filter_map(|l| l.2).collect();
    locals.sort_unstable();
    locals.dedup();
    match locals[..] {
        [] => Ok(None),
        [l] => {
            let grid = launches.iter().map(|l| l.1).max().expect("a kernel");
            if grid.is_multiple_of(l) {
                Ok(Some(l))
            } else {
                Err(())
            }
        }
        _ => Err(()),
    }
}

fn kernel_cmds<'a>(p: &'a Program, kernels: &[usize]) -> Vec<&'a Cmd> {
    kernels
        .iter()
        .map(|&k| match &p.ops[k] {
            Op::Submit { cmd, .. } => cmd,
            op => panic!("#{k} {op:?} is not a submission"),
        })
        .collect()
}

/// Whether fusing `kernels` (in order) cannot change results: any two accesses of one
/// element by different kernels, at least one a write, come from work-items of one
/// work-group (`barriers`) or from the same work-item (`!barriers`). Kernels the
/// compiler refuses are safe (they run unfused).
pub fn fusion_safe(kernels: &[&Cmd], barriers: bool) -> bool {
    let Ok(local) = fused_local(kernels) else { return true };
    let group = |i: usize| local.map_or(0, |l| i / l);
    // Element -> (kernel, work-item, writes).
    type Touches = Vec<(usize, usize, bool)>;
    let mut touched: HashMap<(usize, usize), Touches> = HashMap::new();
    for (k, cmd) in kernels.iter().enumerate() {
        let Cmd::Kernel { reads, writes, .. } = cmd else { unreachable!() };
        let (n, _, _) = launch_of(cmd);
        for i in 0..n {
            for r in reads {
                touched.entry((r.buf, r.start + i % r.len())).or_default().push((k, i, false));
            }
            for (w, _) in writes {
                if i < w.len() {
                    touched.entry((w.buf, w.start + i)).or_default().push((k, i, true));
                }
            }
        }
    }
    touched.values().all(|uses| {
        uses.iter().all(|a| {
            uses.iter().filter(|b| a.0 < b.0 && (a.2 || b.2)).all(|b| {
                if barriers {
                    group(a.1) == group(b.1)
                } else {
                    a.1 == b.1
                }
            })
        })
    })
}

/// What a pure window's fusion must end as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    /// `Fused { kernels: n, .. }`.
    Fused(usize),
    /// `Cancelled(Requested)`.
    Requested,
    /// `Cancelled(Empty)`.
    Empty,
    /// `Cancelled(Failed(_))`.
    Failed,
}

/// The outcome of a pure window (`None` for other windows).
pub fn predicted(p: &Program, w: &Window) -> Option<Expected> {
    if !w.pure {
        return None;
    }
    let kernels = kernel_cmds(p, &w.kernels);
    Some(match (w.completed, fused_local(&kernels)) {
        (false, _) => Expected::Requested,
        (true, _) if kernels.is_empty() => Expected::Empty,
        (true, Err(())) => Expected::Failed,
        (true, Ok(_)) => Expected::Fused(kernels.len()),
    })
}

/// Checks a window's fusion outcome: what [`predicted`] says for a pure window; for any
/// window, a fusion of all its kernels (never some), a refusal only of kernels the
/// compiler refuses, `Empty` only without kernels, warnings only about promotions.
pub fn check_outcome(p: &Program, w: &Window, o: &FusionOutcome) -> Result<(), String> {
    let kernels = kernel_cmds(p, &w.kernels);
    let fusable = fused_local(&kernels).is_ok();
    let n = kernels.len();
    let bad = |what: String| Err(format!("window #{} ({} kernels): outcome {o:?}: {what}", w.start, n));
    match o {
        FusionOutcome::Fused { kernels: k, warnings, .. } => {
            if !w.completed {
                return bad("fused a window that was not completed".into());
            }
            if *k != n {
                return bad(format!("fused {k} kernels, not the window's {n}"));
            }
            if !fusable {
                return bad("fused kernels the compiler should refuse".into());
            }
            if !warnings.is_empty() && !w.promotes {
                return bad("warnings without promotion hints".into());
            }
        }
        FusionOutcome::Cancelled(r) => match r {
            CancelReason::Empty if n != 0 => return bad("cancelled as empty".into()),
            CancelReason::Failed(_) if fusable => return bad("the compiler refused fusable kernels".into()),
            CancelReason::Empty | CancelReason::Failed(_) if !w.completed => {
                return bad("an empty or failed fusion that was not completed".into())
            }
            _ => {}
        },
    }
    let ok = match (predicted(p, w), o) {
        (None, _) => true,
        (Some(Expected::Fused(n)), FusionOutcome::Fused { kernels, .. }) => *kernels == n,
        (Some(Expected::Requested), FusionOutcome::Cancelled(CancelReason::Requested))
        | (Some(Expected::Empty), FusionOutcome::Cancelled(CancelReason::Empty))
        | (Some(Expected::Failed), FusionOutcome::Cancelled(CancelReason::Failed(_))) => true,
        _ => false,
    };
    if !ok {
        return bad(format!("a pure window must end as {:?}", predicted(p, w)));
    }
    Ok(())
}

/// Checks the outcome `o` of window `w` on a runtime whose windows pass their kernels
/// through ([`Config::pass_windows`](crate::Config::pass_windows)): never fused; a
/// window that took a kernel while open says it ran it unfused as launch-bound; other
/// endings are the ordinary cancellations (before any kernel, or a completion with
/// none).
pub fn check_passed_outcome(w: &Window, o: &FusionOutcome) -> Result<(), String> {
    let bad =
        |what: &str| Err(format!("window #{} ({} kernels): outcome {o:?}: {what}", w.start, w.kernels.len()));
    match o {
        FusionOutcome::Fused { .. } => bad("fused, where every window passes its kernels through"),
        FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
            reason: Unprofitable::LaunchBound { .. },
            ..
        })) if !w.kernels.is_empty() => Ok(()),
        FusionOutcome::Cancelled(CancelReason::Failed(_)) => bad("refused for another reason"),
        FusionOutcome::Cancelled(CancelReason::Empty) if !w.completed => bad("empty, yet not completed"),
        FusionOutcome::Cancelled(_) => Ok(()),
    }
}

// ---------------------------------------------------------------------------------
// The generator
// ---------------------------------------------------------------------------------

/// Patterns that hit Gantry bugs the generator found, all fixed (the `regression_*`
/// tests in `tests/fusion.rs`). By default every pattern is generated;
/// [`FusionGen::from_env`] can leave some out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Avoid {
    /// No `depends_on` naming a kernel of a window that is still open (its event is the
    /// fusion's): the dependency stands for every kernel in the list when the dependent
    /// command is *resolved*, kernels submitted after it included, so a later listed
    /// kernel that depends on that command makes a cycle (a hang).
    /// `regression_depending_on_a_fusion_event_waits_for_later_kernels`. Fixed for a
    /// list still collecting; not yet for one the scheduler cancelled meanwhile (a race
    /// of threaded mode): the dependency is then the fusion command, which waits for
    /// every kernel sent to the list, later ones included.
    /// `regression_depending_on_the_event_of_a_list_cancelled_meanwhile`.
    pub event_of_open_window: bool,
    /// No plain-range kernel in a window with ND-range kernels (window kernels are all
    /// ND-ranges, or all plain): the fused kernel runs the plain kernel, unremapped,
    /// per work-group of the ND grid with its own single-group geometry. Without
    /// barriers its work-items past the grid's first work-group never run (lost
    /// writes); with barriers they all run in work-group 0, plus ids past its range
    /// (`Geometry` extent underflow: a panic in debug builds).
    /// `regression_plain_kernel_fused_with_an_nd_range_loses_work_items`.
    pub plain_with_nd: bool,
    /// No command on one side (CPU and host, or the simulated device) that touches a
    /// buffer a kernel of an open window on the other side writes, unless it conflicts
    /// with one of that window's kernels: it needs the buffer moved (whole) from the
    /// other side, the move waits for the held kernel, and since neither the move nor
    /// the command names a held kernel the fusion is not cancelled (a host wait on the
    /// command hangs). `regression_move_behind_a_held_kernel_is_not_a_dependent`. Fixed,
    /// but not when the window's `complete_fusion` is ingested in the same flush as the
    /// command: the move's sequence number is then past the completion, so it does not
    /// cancel, and a later listed kernel that depends on the command makes a cycle.
    /// `regression_move_resolved_with_the_completion_does_not_cancel`.
    pub move_behind_held: bool,
    /// When a window with kernels is completed while other windows are open, those are
    /// completed right after it: a kernel listed later in another window could depend
    /// on a command that waits for the completed window's kernels, which may depend on
    /// that other window's — a cycle through a command submitted after a completion,
    /// which fusion-sync does not see (a hang).
    /// `regression_cycle_through_a_command_after_a_completion`.
    pub complete_with_others_open: bool,
    /// A `flush` before a buffer drop (if a window was completed since the last flush):
    /// a drop ingested in the same flush as a completion cancels the fusion (a wrong
    /// outcome, not wrong data; dropping the queue does the same).
    /// `regression_dropping_after_complete_fusion_cancels_it`.
    pub drop_after_complete: bool,
}

impl Avoid {
    /// Leave out every pattern that once hit a bug.
    pub const ALL: Avoid = Avoid {
        event_of_open_window: true,
        plain_with_nd: true,
        move_behind_held: true,
        complete_with_others_open: true,
        drop_after_complete: true,
    };
    /// Generate everything.
    pub const NONE: Avoid = Avoid {
        event_of_open_window: false,
        plain_with_nd: false,
        move_behind_held: false,
        complete_with_others_open: false,
        drop_after_complete: false,
    };
}

/// Options of the fusion generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionGen {
    /// What programs may contain besides fusion.
    pub opts: GenOptions,
    /// Patterns left out.
    pub avoid: Avoid,
}

impl FusionGen {
    /// `opts`, generating every pattern unless `GANTRY_PROPTEST_FUSION_AVOID` names some
    /// to leave out: `all`, or a comma-separated list of [`Avoid`]'s field names. The
    /// seven bugs these patterns hit are fixed (the `regression_*` tests); leaving a
    /// pattern out helps bisect a new failure.
    ///
    /// # Panics
    /// On an unknown name.
    pub fn from_env(opts: GenOptions) -> FusionGen {
        let names = std::env::var("GANTRY_PROPTEST_FUSION_AVOID").unwrap_or_default();
        let mut avoid = Avoid::NONE;
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty() && *n != "none") {
            match name {
                "all" => avoid = Avoid::ALL,
                "event_of_open_window" => avoid.event_of_open_window = true,
                "plain_with_nd" => avoid.plain_with_nd = true,
                "move_behind_held" => avoid.move_behind_held = true,
                "complete_with_others_open" => avoid.complete_with_others_open = true,
                "drop_after_complete" => avoid.drop_after_complete = true,
                _ => panic!("GANTRY_PROPTEST_FUSION_AVOID: unknown pattern `{name}`"),
            }
        }
        FusionGen { opts, avoid }
    }
}

/// Kinds of the fusion generator: the base kinds, window starts and ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FKind {
    Base(Kind),
    Start,
    End,
}

/// An open window while decoding.
struct Open {
    queue: usize,
    dev: Dev,
    /// `None`: the raw launch; `Some(0)`: plain ranges; `Some(l)`: ND-ranges of local
    /// size `l` (or plain ranges).
    launch: Option<usize>,
    /// All ranges are whole buffers.
    aligned: bool,
    /// Uses the scratch buffer: its promotion, and whether kernels name it per
    /// accessor (else the buffer's hint is set).
    promote: Option<(Promotion, bool)>,
    /// The scratch buffer has been written (whole) in this window.
    scratch_written: bool,
    /// Kernels (op indices).
    kernels: Vec<usize>,
    /// Forced kernels left, then the end op (a burst makes a pure window).
    burst: Option<(usize, End)>,
}

#[derive(Clone, Copy)]
enum End {
    Complete { barriers: bool, wait: bool },
    Cancel,
}

fn end_of(r: &RawOp) -> End {
    if r.modes[1].is_multiple_of(4) {
        End::Cancel
    } else {
        End::Complete { barriers: r.modes[0] & 1 == 0, wait: r.modes[0] & 2 != 0 }
    }
}

/// The end op of window `w`: a completion made fusion-safe (`no_barriers` only where
/// safe, else `barriers`, else cancelled).
fn end_op(ops: &[Op], w: &Open, end: End) -> Op {
    let (queue, dev) = (w.queue, w.dev);
    let End::Complete { barriers, wait } = end else { return Op::CancelFusion { queue, dev } };
    let kernels: Vec<&Cmd> = w
        .kernels
        .iter()
        .map(|&k| match &ops[k] {
            Op::Submit { cmd, .. } => cmd,
            _ => unreachable!(),
        })
        .collect();
    if !barriers && fusion_safe(&kernels, false) {
        Op::CompleteFusion { queue, dev, barriers: false, wait }
    } else if fusion_safe(&kernels, true) {
        Op::CompleteFusion { queue, dev, barriers: true, wait }
    } else {
        Op::CancelFusion { queue, dev }
    }
}

/// Ends window `w` with `end` (see [`end_op`]), and, if it is completed with kernels
/// while other windows are open and `avoid.complete_with_others_open`, completes those
/// too. Returns whether a completion was pushed.
fn close(
    ops: &mut Vec<Op>,
    submits: &mut Vec<usize>,
    open: &mut Vec<Open>,
    w: Open,
    end: End,
    avoid: &Avoid,
) -> bool {
    let op = end_op(ops, &w, end);
    let completed = matches!(op, Op::CompleteFusion { .. });
    if completed {
        submits.push(ops.len());
    }
    ops.push(op);
    if completed && !w.kernels.is_empty() && avoid.complete_with_others_open {
        for other in std::mem::take(open) {
            close(ops, submits, open, other, End::Complete { barriers: true, wait: false }, avoid);
        }
    }
    completed
}

/// Where an op's data must be: the simulated device for its submissions other than
/// host tasks, else the host.
fn side(op: &Op) -> Dev {
    match op {
        Op::Submit { dev: Dev::Sim, cmd, .. } if !matches!(cmd, Cmd::HostTask { .. }) => Dev::Sim,
        _ => Dev::Cpu,
    }
}

/// Whether `op` touches a buffer that a kernel of an open window on the other side
/// writes, without conflicting with any of that window's kernels (see
/// [`Avoid::move_behind_held`]).
fn behind_held(ops: &[Op], open: &[Open], op: &Op, len: impl Fn(usize) -> usize) -> bool {
    let cmd = match op {
        Op::Submit { cmd, .. } => cmd.clone(),
        Op::Snapshot(b) => Cmd::ReadBack { src: Span { buf: *b, start: 0, end: len(*b) } },
        Op::HostUpdate { buf, salt } => {
            let whole = Span { buf: *buf, start: 0, end: len(*buf) };
            Cmd::HostTask { reads: vec![], writes: vec![(whole, WMode::ReadWrite)], salt: *salt }
        }
        _ => return false,
    };
    let (r, w) = cmd.accesses();
    let bufs: Vec<usize> = r.iter().chain(&w).map(|s| s.buf).collect();
    open.iter().filter(|win| win.dev != side(op)).any(|win| {
        let held: Vec<&Cmd> = win
            .kernels
            .iter()
            .filter_map(|&k| match &ops[k] {
                Op::Submit { cmd, .. } => Some(cmd),
                _ => None,
            })
            .collect();
        let writes_ours = held.iter().any(|k| k.accesses().1.iter().any(|s| bufs.contains(&s.buf)));
        writes_ours && !held.iter().any(|k| k.conflicts_with(&cmd))
    })
}

/// A kernel of window `w` (or of no window) from raw op `r`.
fn kernel(r: &RawOp, live: &Live<'_>, w: Option<&mut Open>, scratch: Option<usize>, avoid: &Avoid) -> Cmd {
    let mut raw = r.clone();
    if w.as_ref().is_some_and(|w| w.aligned) {
        for s in &mut raw.spans {
            s.whole = true;
        }
    }
    let (mut reads, mut writes) =
        accessors(&raw, live, r.counts as usize % 3, 1 + (r.counts as usize / 3) % 2);
    let raw_launch = match r.aux % 5 {
        0 => Launch::Flat,
        k => Launch::Nd(1 << (k - 1)),
    };
    let mut promote = vec![];
    let nd_only = avoid.plain_with_nd && w.is_some();
    let launch = match w.as_ref().and_then(|w| w.launch) {
        None if nd_only && raw_launch == Launch::Flat => Launch::Nd(1),
        None => raw_launch,
        Some(0) => Launch::Flat,
        Some(l) if nd_only => Launch::Nd(l),
        Some(_) if raw_launch == Launch::Flat => Launch::Flat,
        Some(l) => Launch::Nd(l),
    };
    if let (Some(w), Some(t)) = (w, scratch) {
        if let Some((p, per_accessor)) = w.promote {
            let len = live.specs[t].len;
            let whole = Span { buf: t, start: 0, end: len };
            let access = match (r.modes[1] >> 4) % 4 {
                _ if !w.scratch_written => Some(WMode::DiscardWrite),
                0 => None,
                1 => Some(WMode::ReadWrite),
                2 => Some(WMode::DiscardWrite),
                _ => Some(WMode::Write),
            };
            // Local memory holds `len / work-groups` elements per work-group, so work-item
            // `i` may only touch element `i` of a local scratch buffer if the ND-range is
            // exactly `len` work-items (else its group's share is not where it reaches:
            // a broken promise, not a Gantry bug). Private memory needs the same, which
            // Gantry checks itself (sizes); plain ranges cannot be local (it falls back).
            let n = writes.iter().map(|(s, _)| s.len()).chain(access.map(|_| len)).max().unwrap_or(1);
            let fits = match launch {
                Launch::Flat | Launch::Map => true,
                Launch::Nd(l) => n.div_ceil(l) * l == len,
            };
            if (r.modes[1] >> 2) & 3 != 0 && fits {
                match access {
                    None => reads.push(whole),
                    Some(m) => writes.push((whole, m)),
                }
                w.scratch_written = true;
                // Now and then one accessor without the hint: the fusion falls back.
                if per_accessor && !r.salt.is_multiple_of(16) {
                    promote.push((t, p));
                }
            }
        }
    }
    // Two thirds of the plain-range kernels with a read and a write become elementwise
    // kernels (`map`: the vectorized path, private and local slots included): one read
    // and one write (the scratch buffer's access if it has one), the write a
    // discard-write no longer than the read. The scratch buffer's accesses are kept
    // whole, or the kernel stays per-item.
    let mut launch = launch;
    if launch == Launch::Flat && r.salt % 3 != 1 && !reads.is_empty() && !writes.is_empty() {
        let is_scratch = |b: usize| scratch == Some(b);
        let kr = reads.iter().position(|s| is_scratch(s.buf)).unwrap_or(0);
        let kw = writes.iter().position(|(s, _)| is_scratch(s.buf)).unwrap_or(0);
        let dropped = reads.iter().enumerate().filter(|&(i, _)| i != kr).map(|(_, s)| s.buf);
        let dropped =
            dropped.chain(writes.iter().enumerate().filter(|&(i, _)| i != kw).map(|(_, (s, _))| s.buf));
        let (read, (w, _)) = (reads[kr], writes[kw]);
        let scratch_cut = w.len() > read.len() && is_scratch(w.buf);
        if !scratch_cut && !dropped.into_iter().any(is_scratch) {
            let mut w = w;
            w.end = w.start + w.len().min(read.len());
            reads = vec![read];
            writes = vec![(w, WMode::DiscardWrite)];
            launch = Launch::Map;
        }
    }
    Cmd::Kernel { reads, writes, salt: r.salt, launch, promote }
}

/// Decodes a raw program into a fusion program (see the module documentation).
/// Every raw program decodes; raw ops that cannot make a valid op are dropped.
pub fn decode(raw: &RawProgram, gen: &FusionGen) -> Program {
    let (opts, avoid) = (&gen.opts, &gen.avoid);
    let mut buffers = crate::decode_buffers(&raw.buffers);
    // The scratch buffer (promoted in some windows): the longest, so that kernels
    // writing it whole have one work-item per element; sometimes every buffer is as
    // long, so that whole-buffer kernels all have that many work-items.
    let seed0 = raw.buffers.first().map_or(0, |b| b.1);
    let scratch = (buffers.len() >= 2 && seed0 & 1 == 1).then(|| {
        let t = (0..buffers.len()).max_by_key(|&b| (buffers[b].len, b)).expect("buffers");
        if seed0 & 6 != 0 {
            let len = buffers[t].len;
            for b in &mut buffers {
                b.len = len;
            }
        }
        t
    });
    let mut queues: Vec<bool> = raw.queues.iter().take(MAX_QUEUES).map(|&q| q && opts.in_order).collect();
    if queues.is_empty() {
        queues.push(false);
    }
    let nq = queues.len();
    let mut kinds: Vec<(FKind, u8)> = KINDS
        .iter()
        .filter(|(k, _)| k.allowed(opts))
        .map(|&(k, w)| (FKind::Base(k), if k == Kind::Kernel { 10 } else { w }))
        .collect();
    kinds.extend([(FKind::Start, 3), (FKind::End, 4)]);
    // Everything but the scratch buffer, for ops outside its windows.
    let mut live =
        Live { specs: &buffers, live: (0..buffers.len()).filter(|&b| Some(b) != scratch).collect() };
    let mut ops: Vec<Op> = Vec::new();
    let mut submits: Vec<usize> = Vec::new();
    let mut open: Vec<Open> = Vec::new();
    // Whether a window was completed since the last flush.
    let mut completed = false;
    let deps_of = |r: &RawOp, submits: &[usize], open: &[Open]| -> Vec<usize> {
        let mut deps = BTreeSet::new();
        let submits: Vec<usize> = submits
            .iter()
            .copied()
            .filter(|s| !avoid.event_of_open_window || !open.iter().any(|w| w.kernels.contains(s)))
            .collect();
        if opts.deps && !submits.is_empty() {
            for &d in &r.deps {
                deps.insert(submits[d as usize % submits.len()]);
            }
        }
        deps.into_iter().collect()
    };
    let dev_of = |r: &RawOp| if opts.sim && r.sim { Dev::Sim } else { Dev::Cpu };
    for r in &raw.ops {
        // A burst: this raw op is the next kernel of the latest window.
        if open.last().is_some_and(|w| w.burst.is_some_and(|b| b.0 > 0)) {
            let deps = deps_of(r, &submits, &open);
            let w = open.last_mut().expect("window");
            let cmd = kernel(r, &live, Some(w), scratch, avoid);
            let (queue, dev) = (w.queue, w.dev);
            w.kernels.push(ops.len());
            let (left, end) = w.burst.expect("burst");
            w.burst = Some((left - 1, end));
            submits.push(ops.len());
            ops.push(Op::Submit { queue, dev, deps, cmd });
            if left == 1 {
                let w = open.pop().expect("window");
                completed |= close(&mut ops, &mut submits, &mut open, w, end, avoid);
            }
            continue;
        }
        let kind = pick(&kinds, r.kind);
        let op = match kind {
            FKind::Start => {
                let (queue, dev) = (r.queue as usize % nq, dev_of(r));
                if open.iter().any(|w| (w.queue, w.dev) == (queue, dev)) {
                    continue;
                }
                let mut launch = match r.salt % 6 {
                    0 => None,
                    1 => Some(0),
                    k => Some(1 << (k - 2)),
                };
                let claimed = open.iter().any(|w| w.promote.is_some());
                let promote = (scratch.is_some() && !claimed && (r.salt >> 5) & 1 == 1).then(|| {
                    let p = if (r.salt >> 6) & 1 == 1 { Promotion::Local } else { Promotion::Private };
                    (p, (r.salt >> 7) & 1 == 0)
                });
                // Mostly what internalization needs: one work-item per element of the
                // scratch buffer (whole ranges), ND-ranges dividing it for local memory.
                let shaped = promote.is_some() && (r.salt >> 8) & 7 != 0;
                let aligned = (r.salt >> 4) & 1 == 1 || shaped;
                if let (true, Some(t)) = (shaped, scratch) {
                    let mut l = 1 << ((r.salt >> 11) % 4);
                    while !buffers[t].len.is_multiple_of(l) {
                        l /= 2;
                    }
                    // Private memory also works with plain ranges, and half of those
                    // windows run plain: their kernels are often elementwise (`map`).
                    launch = match (launch, promote) {
                        (Some(0), Some((Promotion::Private, _))) => Some(0),
                        (_, Some((Promotion::Private, _))) if (r.salt >> 14) & 1 == 1 => Some(0),
                        _ => Some(l),
                    };
                }
                let bursts = if promote.is_some() { r.aux % 4 != 0 } else { r.aux % 3 == 0 };
                let burst = bursts.then(|| ([0, 1, 2, 2, 3, 3, 4, 5][r.counts as usize % 8], end_of(r)));
                if let (Some((p, false)), Some(t)) = (promote, scratch) {
                    ops.push(Op::SetPromotion { buf: t, promotion: p });
                }
                let w = Open {
                    queue,
                    dev,
                    launch,
                    aligned,
                    promote,
                    scratch_written: false,
                    kernels: vec![],
                    burst,
                };
                ops.push(Op::StartFusion { queue, dev });
                if let Some((0, end)) = w.burst {
                    completed |= close(&mut ops, &mut submits, &mut open, w, end, avoid);
                } else {
                    open.push(w);
                }
                continue;
            }
            FKind::End => {
                if open.is_empty() {
                    continue;
                }
                let w = open.remove(r.queue as usize % open.len());
                completed |= close(&mut ops, &mut submits, &mut open, w, end_of(r), avoid);
                continue;
            }
            FKind::Base(Kind::Kernel) => {
                let (queue, dev) = if !open.is_empty() && (r.queue >> 4) & 3 != 0 {
                    let w = &open[(r.queue >> 6) as usize % open.len()];
                    (w.queue, w.dev)
                } else {
                    (r.queue as usize % nq, dev_of(r))
                };
                let deps = deps_of(r, &submits, &open);
                let w = open.iter_mut().find(|w| (w.queue, w.dev) == (queue, dev));
                let in_window = w.is_some();
                let written = w.as_ref().is_some_and(|w| w.scratch_written);
                let cmd = kernel(r, &live, w, scratch, avoid);
                let op = Op::Submit { queue, dev, deps, cmd };
                if avoid.move_behind_held && behind_held(&ops, &open, &op, |b| buffers[b].len) {
                    if let Some(w) = open.iter_mut().find(|w| (w.queue, w.dev) == (queue, dev)) {
                        w.scratch_written = written;
                    }
                    continue;
                }
                if in_window {
                    let w = open.iter_mut().find(|w| (w.queue, w.dev) == (queue, dev)).expect("window");
                    w.kernels.push(ops.len());
                }
                op
            }
            FKind::Base(kind) => match (kind, plain_cmd(kind, r, &live)) {
                (_, Some(cmd)) => Op::Submit {
                    queue: r.queue as usize % nq,
                    dev: dev_of(r),
                    deps: deps_of(r, &submits, &open),
                    cmd,
                },
                (Kind::Drop, _) if live.live.len() > 1 => {
                    if avoid.drop_after_complete && completed {
                        ops.push(Op::Flush);
                        completed = false;
                    }
                    let b = live.pick(r.spans[0].buf);
                    live.live.retain(|&x| x != b);
                    Op::Drop(b)
                }
                (kind, None) => match host_op(kind, r, &submits, nq, &live) {
                    Some(op) => op,
                    None => continue,
                },
            },
        };
        if avoid.move_behind_held && behind_held(&ops, &open, &op, |b| buffers[b].len) {
            continue;
        }
        if matches!(op, Op::Submit { .. } | Op::CompleteFusion { .. }) {
            submits.push(ops.len());
        }
        if matches!(op, Op::Flush) {
            completed = false;
        }
        ops.push(op);
    }
    Program { buffers, queues, ops }
}
