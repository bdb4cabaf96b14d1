//! Kernel fusion against the unfused serial model.
//!
//! Random programs with fusion windows (see `gantry_proptests::fusion`): a queue starts
//! fusion, kernels join its list, other commands (copies, fills, host tasks,
//! transfers, host reads and writes, waits, buffer drops, kernels on other queues, a
//! second fusing queue) may synchronize with them and cancel the fusion early, and the
//! window ends in `complete_fusion` (with or without barriers, where either is safe),
//! `cancel_fusion`, or not at all. Every buffer (but the promoted scratch buffer, which
//! an internalizing fusion does not write back), snapshot, readback and host-task read
//! must equal the serial model's, which ignores fusion; and fusion outcomes must be
//! sane (a window fuses all its kernels or none; a *pure* window — only kernels between
//! its ends — fuses, or is refused as empty or for its ND-ranges, as predicted).
//!
//! Configurations: manual mode, and threaded mode with 2 workers (random
//! `host_threads` and `inline_items`), each on a CPU-only runtime and on a CPU + sim
//! one (where `@sim` queues are on the simulated device, so buffers move between
//! memories around fused kernels).
//!
//! # Case counts
//! Each property runs 400 cases by default (about 2 s in all on 2 cores, release).
//! `GANTRY_PROPTEST_CASES=N` runs `N` per property, as everywhere in this crate.
//!
//! # Bugs found
//! Four bugs the generator found are fixed; their minimal reproductions are the
//! `regression_*` tests below. Their patterns ([`Avoid`]) are still left out of the
//! random programs by default: with all of them generated
//! (`GANTRY_PROPTEST_FUSION_AVOID=none`), threaded programs found a further hang that
//! is not yet minimized.
//!
//! [`Avoid`]: gantry_proptests::fusion::Avoid

mod common;

use std::time::Duration;

use gantry::{CancelReason, FusionOutcome, FusionProps, Mode, NdRange, ReadWrite, Runtime};
use gantry_proptests::fusion::{self, FusionGen};
use gantry_proptests::{
    check, run_gantry_watched, run_model, Cmd, Config, GenOptions, Launch, Op, Program, Session, Span, WMode,
};
use proptest::prelude::*;

const CASES: u32 = 1000;
const MAX_OPS: usize = 32;

fn gen() -> FusionGen {
    FusionGen::from_env(GenOptions::ALL)
}

fn threaded(sim: bool, host_threads: usize, inline_items: usize) -> Config {
    Config { host_threads, inline_items, ..Config::threaded(2, sim) }
}

fn inline_items() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(16), Just(4096)]
}

/// What the generator promises beyond validity: completed windows are safe to fuse
/// with the barriers they ask for, the scratch buffer is used as internalization
/// requires, and the known-bug patterns are left out.
fn fusion_safe_program(p: &Program, gen: &FusionGen) -> Result<(), String> {
    let windows = fusion::windows(p);
    let promoted = fusion::promoted_buffers(p);
    let kernel_of = |k: usize| match &p.ops[k] {
        Op::Submit { cmd, .. } => cmd,
        op => panic!("#{k} {op:?} is not a submission"),
    };
    for w in &windows {
        let kernels: Vec<&Cmd> = w.kernels.iter().map(|&k| kernel_of(k)).collect();
        if let Some(Op::CompleteFusion { barriers, .. }) = w.end.map(|e| &p.ops[e]) {
            if !fusion::fusion_safe(&kernels, *barriers) {
                return Err(format!("window #{}: unsafe to fuse with barriers={barriers}", w.start));
            }
        }
        let nd = kernels.iter().filter(|k| matches!(k, Cmd::Kernel { launch: Launch::Nd(_), .. })).count();
        if gen.avoid.plain_with_nd && nd != 0 && nd != kernels.len() {
            return Err(format!("window #{}: plain and ND-range kernels", w.start));
        }
    }
    // The scratch buffer: only in kernels of windows, whole, first written whole.
    for &t in &promoted {
        let len = p.buffers[t].len;
        let mut written_in: Option<usize> = None;
        for (i, op) in p.ops.iter().enumerate() {
            let (reads, writes) = match op {
                Op::Submit { cmd, .. } => {
                    let (r, w) = cmd.accesses();
                    (r, w)
                }
                Op::Snapshot(b) | Op::HostUpdate { buf: b, .. } | Op::Drop(b) if *b == t => {
                    return Err(format!("#{i}: the scratch buffer b{t} outside a kernel"))
                }
                _ => continue,
            };
            let uses = |v: &[Span]| v.iter().any(|s| s.buf == t);
            if !uses(&reads) && !uses(&writes) {
                continue;
            }
            let Some(w) = windows.iter().find(|w| w.kernels.contains(&i)) else {
                return Err(format!("#{i}: the scratch buffer b{t} outside a window"));
            };
            if reads.iter().chain(&writes).any(|s| s.buf == t && (s.start, s.end) != (0, len)) {
                return Err(format!("#{i}: part of the scratch buffer b{t}"));
            }
            if written_in != Some(w.start) {
                let Cmd::Kernel { writes, .. } = kernel_of(i) else { unreachable!() };
                if !writes.iter().any(|(s, m)| s.buf == t && *m == WMode::DiscardWrite) {
                    return Err(format!("#{i}: the scratch buffer b{t} is not first written whole"));
                }
                written_in = Some(w.start);
            }
        }
    }
    if gen.avoid.event_of_open_window {
        for (i, op) in p.ops.iter().enumerate() {
            let Op::Submit { deps, .. } = op else { continue };
            for &d in deps {
                if windows.iter().any(|w| w.kernels.contains(&d) && w.end.is_none_or(|e| e > i)) {
                    return Err(format!("#{i} depends on #{d}, a kernel of an open window"));
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::config(CASES))]

    #[test]
    fn fusion_manual_cpu(p in common::fusion_program(MAX_OPS, gen())) {
        check(&p, Config::manual(false)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn fusion_manual_sim(p in common::fusion_program(MAX_OPS, gen())) {
        check(&p, Config::manual(true)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn fusion_threaded2_cpu(p in common::fusion_program(MAX_OPS, gen()), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(false, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn fusion_threaded2_sim(p in common::fusion_program(MAX_OPS, gen()), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(true, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn fusion_programs_are_fusion_safe(p in common::fusion_program(MAX_OPS, gen())) {
        fusion_safe_program(&p, &gen()).map_err(|e| TestCaseError::fail(format!("{e}\n{p:?}")))?;
    }

    #[test]
    fn fusion_programs_parse_back(p in common::fusion_program(MAX_OPS, gen())) {
        let text = format!("{p:?}");
        prop_assert_eq!(Program::parse(&text), Ok(p.clone()));
        let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
        prop_assert_eq!(Program::parse(&line), Ok(p));
    }
}

// ---------------------------------------------------------------------------------
// Deterministic cases
// ---------------------------------------------------------------------------------

fn configs() -> Vec<Config> {
    let mut v = Vec::new();
    for sim in [false, true] {
        v.push(Config::manual(sim));
        v.push(Config::threaded(2, sim));
        v.push(Config { inline_items: 4096, host_threads: 0, ..Config::threaded(8, sim) });
    }
    v
}

fn parse(text: &str) -> Program {
    Program::parse(text).unwrap_or_else(|e| panic!("bad program: {e}"))
}

fn check_everywhere(p: &Program) {
    for c in configs() {
        if let Err(e) = check(p, c) {
            panic!("{e}\n{p:?}");
        }
    }
}

/// Runs `p` under `config`; returns the final buffers and the fusion outcomes the
/// session checked, by op index.
fn run_with_fusions(p: &Program, config: Config) -> (Vec<Vec<u32>>, Vec<(usize, FusionOutcome)>) {
    let mut s = Session::new(p, config);
    for (i, op) in p.ops.iter().enumerate() {
        s.step(i, op).unwrap_or_else(|e| panic!("{config:?}: {e}\n{p:?}"));
    }
    let (out, fusions) = s.finish_with_fusions().unwrap_or_else(|e| panic!("{config:?}: {e}\n{p:?}"));
    (out.buffers, fusions)
}

fn fused(kernels: usize) -> impl Fn(&FusionOutcome) -> bool {
    move |o| matches!(o, FusionOutcome::Fused { kernels: k, warnings, .. } if *k == kernels && warnings.is_empty())
}

fn cancelled(pred: impl Fn(&CancelReason) -> bool) -> impl Fn(&FusionOutcome) -> bool {
    move |o| matches!(o, FusionOutcome::Cancelled(r) if pred(r))
}

/// Pure windows end as predicted: fused (without barriers where each work-item only
/// touches its own elements, with them where a kernel reads what other work-items of
/// its single group wrote), refused for different local sizes, empty, cancelled.
#[test]
fn pure_windows_fuse_or_are_refused_as_predicted() {
    let p = parse(
        "Program {
          buffers: b0[16] (seed 0x11); b1[16] (seed 0x22); b2[16] (seed 0x33);
          queues: q0 in-order; q1 out-of-order;
          #0  q0@cpu.start_fusion()
          #1  q0@cpu kernel salt=0x1 reads [b0[0..16]] writes [b1[0..16] rw]
          #2  q0@cpu kernel salt=0x2 reads [b1[0..16]] writes [b2[0..16] w]
          #3  q0@cpu kernel salt=0x3 reads [b2[0..16]] writes [b0[0..16] discard]
          #4  q0@cpu.complete_fusion(no_barriers) wait
          #5  q1@sim.start_fusion()
          #6  q1@sim kernel salt=0x4 reads [b0[0..16]] writes [b1[0..16] rw]
          #7  q1@sim kernel salt=0x5 reads [b1[0..4]] writes [b2[0..16] rw]
          #8  q1@sim.complete_fusion(barriers) wait
          #9  q0@cpu.start_fusion()
          #10 q0@cpu kernel(nd local 4) salt=0x6 reads [] writes [b0[0..16] rw]
          #11 q0@cpu kernel(nd local 8) salt=0x7 reads [] writes [b1[0..16] rw]
          #12 q0@cpu.complete_fusion(barriers) wait
          #13 q1@cpu.start_fusion()
          #14 q1@cpu.complete_fusion(barriers) wait
          #15 q1@cpu.start_fusion()
          #16 q1@cpu kernel(nd local 8) salt=0x8 reads [b2[0..8]] writes [b0[0..16] rw]
          #17 q1@cpu.cancel_fusion()
        }",
    );
    assert!(!fusion::fusion_safe(&[&cmd(&p, 6), &cmd(&p, 7)], false), "#7 reads other work-items' writes");
    check_everywhere(&p);
    for c in configs() {
        let (_, fusions) = run_with_fusions(&p, c);
        let at =
            |i: usize| &fusions.iter().find(|f| f.0 == i).unwrap_or_else(|| panic!("no outcome at #{i}")).1;
        assert!(fused(3)(at(4)), "{c:?}: {:?}", at(4));
        assert!(fused(2)(at(8)), "{c:?}: {:?}", at(8));
        assert!(cancelled(|r| matches!(r, CancelReason::Failed(_)))(at(12)), "{c:?}: {:?}", at(12));
        assert!(cancelled(|r| *r == CancelReason::Empty)(at(14)), "{c:?}: {:?}", at(14));
        assert!(cancelled(|r| *r == CancelReason::Requested)(at(17)), "{c:?}: {:?}", at(17));
    }
}

fn cmd(p: &Program, i: usize) -> Cmd {
    match &p.ops[i] {
        Op::Submit { cmd, .. } => cmd.clone(),
        op => panic!("#{i} {op:?}"),
    }
}

/// A scratch buffer promoted to private (accessor hints) and then local memory (the
/// buffer's hint) is internalized: no warning, never written back (the CPU driver
/// leaves it as it was), and everything computed through it is right.
#[test]
fn internalized_scratch_buffer_is_not_written_back() {
    let p = parse(
        "Program {
          buffers: b0[16] (seed 0x11); b1[16] (seed 0x22); b2[16] (seed 0x33);
          queues: q0 out-of-order;
          #0  q0@cpu.start_fusion()
          #1  q0@cpu kernel salt=0x1 reads [b0[0..16]] writes [b2[0..16] discard] promote [b2 private]
          #2  q0@cpu kernel salt=0x2 reads [b2[0..16]] writes [b1[0..16] rw] promote [b2 private]
          #3  q0@cpu kernel salt=0x3 reads [] writes [b2[0..16] rw, b0[0..16] w] promote [b2 private]
          #4  q0@cpu kernel salt=0x4 reads [b2[0..16]] writes [b0[0..16] rw] promote [b2 private]
          #5  q0@cpu.complete_fusion(no_barriers) wait
          #6  b2.set_promotion(local)
          #7  q0@sim.start_fusion()
          #8  q0@sim kernel(nd local 4) salt=0x5 reads [b1[0..16]] writes [b2[0..16] discard]
          #9  q0@sim kernel(nd local 4) salt=0x6 reads [b2[0..16]] writes [b0[0..16] rw]
          #10 q0@sim.complete_fusion(barriers) wait
        }",
    );
    check_everywhere(&p);
    let model = run_model(&p);
    let initial = p.buffers[2].contents();
    for c in configs() {
        let (buffers, fusions) = run_with_fusions(&p, c);
        assert_eq!(fusions.len(), 2, "{c:?}: {fusions:?}");
        assert!(fused(4)(&fusions[0].1) && fused(2)(&fusions[1].1), "{c:?}: {fusions:?}");
        assert_eq!(buffers[..2], model.buffers[..2], "{c:?}");
        assert_ne!(buffers[2], model.buffers[2], "{c:?}: the scratch buffer was written back");
        if !c.sim {
            assert_eq!(buffers[2], initial, "{c:?}");
        }
    }
}

/// Commands that depend on a listed kernel cancel the fusion early — a copy on another
/// queue, a host read, a host task on the fusing queue (seen by the scheduler before
/// `cancel_fusion`, thanks to the flush) — as do host waits on its event and on its
/// queue; an independent fill does not. Results are serial throughout.
#[test]
fn synchronizing_commands_cancel_early_with_serial_results() {
    let p = parse(
        "Program {
          buffers: b0[16] (seed 0x11); b1[16] (seed 0x22); b2[16] (seed 0x33);
          queues: q0 out-of-order; q1 in-order;
          #0  q0@cpu.start_fusion()
          #1  q0@cpu kernel salt=0x1 reads [b0[0..16]] writes [b1[0..8] rw]
          #2  q0@cpu fill b2[0..16] = 0x5
          #3  q0@cpu kernel salt=0x2 reads [b2[0..16]] writes [b1[8..16] w]
          #4  q1@sim copy b1[0..8] -> b0[8..16]
          #5  q0@cpu.complete_fusion(barriers) wait
          #6  q0@sim.start_fusion()
          #7  q0@sim kernel salt=0x3 reads [b1[0..16]] writes [b2[0..16] rw]
          #8  b2.to_vec()
          #9  q0@sim kernel salt=0x4 reads [b2[0..16]] writes [b0[0..16] rw]
          #10 q0@sim.complete_fusion(barriers) wait
          #11 q1@cpu.start_fusion()
          #12 q1@cpu kernel salt=0x5 reads [] writes [b0[0..16] rw]
          #13 #12.wait()
          #14 q1@cpu kernel salt=0x6 reads [] writes [b1[0..16] rw]
          #15 q1@cpu.complete_fusion(barriers) wait
          #16 q0@cpu.start_fusion()
          #17 q0@cpu kernel salt=0x7 reads [] writes [b2[0..16] rw]
          #18 q0.wait()
          #19 q0@cpu.complete_fusion(barriers) wait
          #20 q0@cpu.start_fusion()
          #21 q0@cpu kernel salt=0x8 reads [b0[0..16]] writes [b1[0..16] rw]
          #22 q0@cpu host_task salt=0x9 reads [b1[0..4]] writes [b2[0..4] rw]
          #23 flush
          #24 q0@cpu kernel salt=0xa reads [b2[0..16]] writes [b0[0..16] rw]
          #25 q0@cpu.cancel_fusion()
        }",
    );
    check_everywhere(&p);
    // On a simulated device the memory move inserted for the dependent may be what
    // depends on the held kernel first.
    let dependent = |kind: &'static str| {
        cancelled(
            move |r| matches!(r, CancelReason::Dependent { kind: k, .. } if *k == kind || *k == "memory_move"),
        )
    };
    for c in configs() {
        let (_, fusions) = run_with_fusions(&p, c);
        let at =
            |i: usize| &fusions.iter().find(|f| f.0 == i).unwrap_or_else(|| panic!("no outcome at #{i}")).1;
        assert!(dependent("copy")(at(5)), "{c:?}: {:?}", at(5));
        assert!(dependent("host_access")(at(10)), "{c:?}: {:?}", at(10));
        assert!(cancelled(|r| *r == CancelReason::HostWait)(at(15)), "{c:?}: {:?}", at(15));
        assert!(cancelled(|r| *r == CancelReason::QueueWait)(at(19)), "{c:?}: {:?}", at(19));
        assert!(dependent("host_task")(at(25)), "{c:?}: {:?}", at(25));
    }
}

/// Two fusing queues: depending on each other both ways one list is cancelled (a
/// cycle) and the other follows; one way only, both fuse.
#[test]
fn two_fusing_queues() {
    let both_ways = parse(
        "Program {
          buffers: b0[8] (seed 0x1); b1[8] (seed 0x2); b2[8] (seed 0x3);
          queues: q0 out-of-order; q1 out-of-order;
          #0 q0@cpu.start_fusion()
          #1 q1@sim.start_fusion()
          #2 q0@cpu kernel salt=0x1 reads [] writes [b0[0..8] rw]
          #3 q1@sim kernel salt=0x2 reads [b0[0..8]] writes [b1[0..8] rw]
          #4 q0@cpu kernel salt=0x3 reads [b1[0..8]] writes [b2[0..8] rw]
          #5 q0@cpu.complete_fusion(barriers)
          #6 q1@sim.complete_fusion(barriers)
        }",
    );
    check_everywhere(&both_ways);
    for c in configs() {
        let (_, fusions) = run_with_fusions(&both_ways, c);
        assert!(
            fusions.iter().any(|f| cancelled(|r| matches!(r, CancelReason::Cycle { .. }))(&f.1)),
            "{c:?}: {fusions:?}"
        );
    }
    let one_way = parse(
        "Program {
          buffers: b0[8] (seed 0x1); b1[8] (seed 0x2); b2[8] (seed 0x3);
          queues: q0 out-of-order; q1 out-of-order;
          #0 q0@cpu.start_fusion()
          #1 q1@sim.start_fusion()
          #2 q0@cpu kernel salt=0x1 reads [] writes [b0[0..8] rw]
          #3 q1@sim kernel salt=0x2 reads [b0[0..8]] writes [b1[0..8] rw]
          #4 q0@cpu kernel salt=0x3 reads [] writes [b2[0..8] rw]
          #5 q1@sim kernel salt=0x4 reads [b1[0..8]] writes [b2[0..8] w]
          #6 q0@cpu.complete_fusion(barriers)
          #7 q1@sim.complete_fusion(no_barriers)
        }",
    );
    check_everywhere(&one_way);
    for c in configs() {
        let (_, fusions) = run_with_fusions(&one_way, c);
        assert!(fusions.iter().all(|f| fused(2)(&f.1)), "{c:?}: {fusions:?}");
    }
}

/// Found by the properties (before c84e5f1): a queue's next `start_fusion` ingested
/// with its previous window's end, after that window's kernels were held, dropped the
/// end and left them held forever. Both ends, both orders of flushes.
#[test]
fn window_end_and_next_start_in_one_flush() {
    for end in ["cancel_fusion()", "complete_fusion(barriers)"] {
        let p = parse(&format!(
            "Program {{
              buffers: b0[8] (seed 0x1);
              queues: q0 out-of-order;
              #0 q0@cpu.start_fusion()
              #1 q0@cpu kernel salt=0x1 reads [] writes [b0[0..8] rw]
              #2 flush
              #3 q0@cpu.{end}
              #4 q0@cpu.start_fusion()
              #5 q0@cpu kernel salt=0x2 reads [] writes [b0[0..8] rw]
              #6 q0@cpu.complete_fusion(barriers)
              #7 q0@sim.start_fusion()
              #8 q0@sim kernel salt=0x3 reads [] writes [b0[0..8] rw]
              #9 q0@sim.{end}
              #10 q0@sim.start_fusion()
            }}"
        ));
        check_everywhere(&p);
    }
}

// ---------------------------------------------------------------------------------
// Known bugs (ignored until fixed; see `fusion::Avoid`)
// ---------------------------------------------------------------------------------

fn check_within(p: &Program, c: Config, timeout: Duration) -> Result<(), String> {
    let model = run_model(p);
    let got = run_gantry_watched(p, c, timeout)?;
    model.mismatch(&got).map_or(Ok(()), |m| Err(format!("{c:?}: differs from the model:\n{m}")))
}

/// `Avoid::plain_with_nd`. A plain-range kernel fused with an ND-range kernel is run
/// per work-group of the ND grid with its own (one-group) geometry and no remapping:
/// without barriers its work-items 2..8 never run; with barriers all 8 run in
/// work-group 0 and ids 16..32 (past its range) run too.
#[test]
fn regression_plain_kernel_fused_with_an_nd_range_loses_work_items() {
    for barriers in [false, true] {
        for mode in [Mode::Manual, Mode::Threaded] {
            let rt = Runtime::builder().mode(mode).worker_threads(2).build();
            let q = rt.in_order_queue();
            let a = rt.buffer_zeroed::<u32>(8);
            let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            q.start_fusion().unwrap();
            let s = seen.clone();
            q.submit(|cg| {
                let w = cg.access::<u32, ReadWrite>(&a, ..);
                cg.parallel_for(8, move |it| {
                    let i = it.global_linear_id();
                    s.lock().unwrap().push(i);
                    if i < 8 {
                        w.set(it, i, w.get(it, i) + 1)
                    }
                })
            })
            .unwrap();
            q.submit(|cg| {
                let w = cg.access::<u32, ReadWrite>(&a, ..);
                cg.parallel_for_nd(NdRange::new(8, 2), move |it| {
                    let i = it.global_linear_id();
                    w.set(it, i, w.get(it, i) * 10)
                })
            })
            .unwrap();
            q.complete_fusion(FusionProps { barriers }).unwrap().wait().unwrap();
            let mut ids = seen.lock().unwrap().clone();
            ids.sort_unstable();
            let what = format!("barriers={barriers} {mode:?}: {:?}", q.fusion_outcome());
            assert_eq!(a.to_vec().unwrap(), vec![10; 8], "{what}");
            assert_eq!(ids, (0..8).collect::<Vec<_>>(), "{what}: the plain kernel's work-items");
        }
    }
    // As the properties found it: the elements the masked `w` kernel skips lose the
    // plain kernel's update.
    let p = parse(
        "Program {
          buffers: b0[8] (seed 0x2d61c288);
          queues: q0 out-of-order;
          #0 q0@cpu.start_fusion()
          #1 q0@cpu kernel salt=0x9ba76cb4 reads [] writes [b0[0..8] rw]
          #2 q0@cpu kernel(nd local 2) salt=0x762fc417 reads [] writes [b0[0..8] w]
          #3 q0@cpu.complete_fusion(no_barriers)
        }",
    );
    check_everywhere(&p);
}

/// `Avoid::event_of_open_window`. `#2` (another queue) depends on the event of `#1`, a
/// kernel listed by a fusing queue: the fusion's event. `#3`, listed after `#2`, writes
/// what `#2` reads, so it depends on `#2`. Resolved in one flush, `#2`'s dependency
/// stands for every listed kernel, `#3` included: `#2` and `#3` wait for each other
/// and `#2.wait()` hangs (all configurations). It should stand for the kernels listed
/// before `#2`, as it does when `#2` is resolved before `#3` is submitted.
#[test]
fn regression_depending_on_a_fusion_event_waits_for_later_kernels() {
    let p = parse(
        "Program {
          buffers: b0[4] (seed 0x1); b1[4] (seed 0x2); b2[4] (seed 0x3);
          queues: q0 out-of-order; q1 out-of-order;
          #0 q0@cpu.start_fusion()
          #1 q0@cpu kernel salt=0x1 reads [] writes [b0[0..4] rw]
          #2 q1@cpu kernel salt=0x2 reads [b1[0..4]] writes [b2[0..4] rw] after [#1]
          #3 q0@cpu kernel salt=0x3 reads [] writes [b1[0..4] rw]
          #4 #2.wait()
        }",
    );
    for c in configs() {
        check_within(&p, c, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// `Avoid::move_behind_held`. With a simulated device: `#1` (held in `q0@sim`'s list)
/// writes `b0[0..6]` there; the CPU fill of `b0[6..8]` needs the buffer moved back to
/// the host, and the move waits for `#1`. Neither the fill nor the move names a listed
/// kernel, so the fusion is not cancelled and `#2.wait()` hangs.
#[test]
fn regression_move_behind_a_held_kernel_is_not_a_dependent() {
    let p = parse(
        "Program {
          buffers: b0[8] (seed 0x1);
          queues: q0 out-of-order;
          #0 q0@sim.start_fusion()
          #1 q0@sim kernel salt=0x1 reads [] writes [b0[0..6] rw]
          #2 q0@cpu fill b0[6..8] = 0x7
          #3 #2.wait()
          #4 q0@sim.complete_fusion(barriers)
        }",
    );
    for sim in [false, true] {
        for c in [Config::manual(sim), Config::threaded(2, sim)] {
            check_within(&p, c, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// `Avoid::drop_after_complete`. Dropping a buffer the kernels use, or the queue,
/// right after `complete_fusion` (before the scheduler has fused the list) cancels
/// the fusion: `BufferDropped` / `QueueDropped` instead of `Fused`. Results are right.
#[test]
fn regression_dropping_after_complete_fusion_cancels_it() {
    let p = parse(
        "Program {
          buffers: b0[8] (seed 0x1); b1[8] (seed 0x2);
          queues: q0 out-of-order;
          #0 q0@cpu.start_fusion()
          #1 q0@cpu kernel salt=0x1 reads [] writes [b0[0..8] rw]
          #2 q0@cpu kernel salt=0x2 reads [b0[0..8]] writes [b1[0..8] rw]
          #3 q0@cpu.complete_fusion(barriers)
          #4 drop b0
        }",
    );
    check_everywhere(&p);
    // The queue: the compiler is never asked.
    for mode in [Mode::Manual, Mode::Threaded] {
        let rt = Runtime::builder().mode(mode).build();
        let a = rt.buffer_zeroed::<u32>(8);
        let q = rt.queue();
        q.start_fusion().unwrap();
        for _ in 0..2 {
            q.submit(|cg| {
                let w = cg.access::<u32, ReadWrite>(&a, ..);
                cg.parallel_for(8, move |it| {
                    w.set(it, it.global_linear_id(), w.get(it, it.global_linear_id()) + 1)
                })
            })
            .unwrap();
        }
        let ev = q.complete_fusion(FusionProps::default()).unwrap();
        drop(q);
        ev.wait().unwrap();
        assert_eq!(a.to_vec().unwrap(), vec![2; 8]);
        assert_eq!(rt.fusion_cache_stats().map(|s| s.misses), Some(1), "{mode:?}: never fused");
    }
}

// ---------------------------------------------------------------------------------
// Coverage
// ---------------------------------------------------------------------------------

/// What the generator's programs exercise (run with `--ignored --nocapture`): windows,
/// how they end, fusion outcomes (every completion waited on, for the count), fused
/// kernels, internalized scratch buffers.
#[test]
#[ignore = "a report, not a test"]
fn coverage_report() {
    use proptest::strategy::ValueTree;
    use std::collections::BTreeMap;
    let n = common::cases(1000) as usize;
    let sim = std::env::var("GANTRY_PROPTEST_SIM").is_ok();
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = common::fusion_program(MAX_OPS, gen());
    let mut c: BTreeMap<String, usize> = BTreeMap::new();
    let mut add = |k: &str, v: usize| *c.entry(k.to_string()).or_default() += v;
    for _ in 0..n {
        let mut p = strategy.new_tree(&mut runner).expect("program").current();
        for op in &mut p.ops {
            if let Op::CompleteFusion { wait, .. } = op {
                *wait = true;
            }
        }
        let windows = fusion::windows(&p);
        add("ops", p.ops.len());
        add("windows", windows.len());
        add("windows: completed", windows.iter().filter(|w| w.completed).count());
        add(
            "windows: completed without barriers",
            p.ops.iter().filter(|o| matches!(o, Op::CompleteFusion { barriers: false, .. })).count(),
        );
        add("windows: cancelled", windows.iter().filter(|w| w.end.is_some() && !w.completed).count());
        add("windows: never ended", windows.iter().filter(|w| w.end.is_none()).count());
        add("windows: pure", windows.iter().filter(|w| w.pure).count());
        add("windows: kernels", windows.iter().map(|w| w.kernels.len()).sum());
        let (buffers, fusions) = run_with_fusions(&p, Config::manual(sim));
        for (_, o) in &fusions {
            match o {
                FusionOutcome::Fused { kernels, warnings, .. } => {
                    add("outcome: fused", 1);
                    add("outcome: fused, kernels", *kernels);
                    add(
                        &format!(
                            "outcome: fused {} kernels",
                            if *kernels >= 4 { "4+".into() } else { kernels.to_string() }
                        ),
                        1,
                    );
                    add("outcome: fused, promotion dropped", (!warnings.is_empty()) as usize);
                }
                FusionOutcome::Cancelled(r) => {
                    let r = format!("{r:?}");
                    add(&format!("outcome: cancelled, {}", r.split(['(', ' ', '{']).next().unwrap_or("")), 1);
                }
            }
        }
        let model = run_model(&p);
        for b in fusion::promoted_buffers(&p) {
            add("programs promoting", 1);
            add(
                "programs internalizing (scratch not written back)",
                (model.buffers[b] != buffers[b]) as usize,
            );
        }
    }
    println!("{n} programs, manual mode{}:", if sim { ", with a simulated device" } else { "" });
    for (k, v) in c {
        println!("  {k:55} {v}");
    }
}
