//! The generator itself: every raw program decodes to a valid program that respects
//! its options, and the `Debug` form of a program parses back to it (so a failing
//! case printed by a property can be pasted into a regression test).
//!
//! `GANTRY_PROPTEST_CASES` sets the number of cases (see `tests/model.rs`).

mod common;

use gantry_proptests::{Cmd, Dev, GenOptions, Op, Program, Span};
use proptest::prelude::*;

const CASES: u32 = 1000;

fn options() -> impl Strategy<Value = GenOptions> {
    any::<[bool; 6]>().prop_map(|[sim, in_order, deps, host_sync, transfers, drops]| GenOptions {
        sim,
        in_order,
        deps,
        host_sync,
        transfers,
        drops,
    })
}

fn valid(p: &Program, o: &GenOptions) -> Result<(), String> {
    let span_ok = |s: &Span| s.buf < p.buffers.len() && s.start < s.end && s.end <= p.buffers[s.buf].len;
    if p.buffers.is_empty() || p.buffers.iter().any(|b| b.len == 0) || p.queues.is_empty() {
        return Err("no buffers, an empty buffer or no queues".into());
    }
    if !o.in_order && p.queues.iter().any(|&q| q) {
        return Err("in-order queue without the option".into());
    }
    let is_submit = |k: usize| matches!(p.ops.get(k), Some(Op::Submit { .. }));
    let mut dropped = vec![false; p.buffers.len()];
    for (i, op) in p.ops.iter().enumerate() {
        let bad = |what: &str| Err(format!("#{i} {op:?}: {what}"));
        let named: Vec<usize> = match op {
            Op::Submit { cmd, .. } => {
                let (r, w) = cmd.accesses();
                r.iter().chain(&w).map(|s| s.buf).collect()
            }
            Op::Snapshot(b) | Op::HostUpdate { buf: b, .. } | Op::Drop(b) => vec![*b],
            _ => vec![],
        };
        if named.iter().any(|&b| b >= p.buffers.len() || dropped[b]) {
            return bad("unknown or dropped buffer");
        }
        if let Op::Drop(b) = op {
            if !o.drops {
                return bad("drop without the option");
            }
            dropped[*b] = true;
            if dropped.iter().all(|&d| d) {
                return bad("every buffer dropped");
            }
            continue;
        }
        match op {
            Op::Submit { queue, dev, deps, cmd } => {
                if *queue >= p.queues.len() {
                    return bad("unknown queue");
                }
                if *dev == Dev::Sim && !o.sim {
                    return bad("sim without the option");
                }
                if !deps.is_empty() && !o.deps {
                    return bad("dependencies without the option");
                }
                if deps.iter().any(|&d| d >= i || !is_submit(d)) || deps.windows(2).any(|w| w[0] >= w[1]) {
                    return bad("dependency on a later op, a non-submission, or repeated");
                }
                let (reads, writes) = cmd.accesses();
                if !reads.iter().chain(&writes).all(span_ok) {
                    return bad("range out of bounds or empty");
                }
                for (k, w) in writes.iter().enumerate() {
                    if writes[k + 1..].iter().chain(&reads).any(|x| x.overlaps(w)) {
                        return bad("a write overlaps another accessor");
                    }
                }
                match cmd {
                    Cmd::Copy { src, dst } if src.len() != dst.len() => return bad("copy lengths differ"),
                    Cmd::Kernel { writes, .. } if writes.is_empty() => return bad("kernel without writes"),
                    Cmd::CopyFromHost { .. } | Cmd::ReadBack { .. } if !o.transfers => {
                        return bad("transfer without the option")
                    }
                    _ => {}
                }
            }
            Op::Wait(k) if !(*k < i && is_submit(*k)) => {
                return bad("wait on a later op or a non-submission")
            }
            Op::QueueWait(q) if *q >= p.queues.len() => return bad("unknown queue"),
            _ => {}
        }
        if !o.host_sync && !matches!(op, Op::Submit { .. }) {
            return bad("host synchronization without the option");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::config(CASES))]

    #[test]
    fn decoded_programs_are_valid(raw in common::raw_program(48), o in options()) {
        let p = Program::decode(&raw, &o);
        valid(&p, &o).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn debug_form_parses_back(p in common::program(48, GenOptions::ALL)) {
        let text = format!("{p:?}");
        prop_assert_eq!(Program::parse(&text), Ok(p.clone()));
        // As stored in a .proptest-regressions file: one line, with a suffix.
        let line = format!("{}, h = 1", text.split_whitespace().collect::<Vec<_>>().join(" "));
        prop_assert_eq!(Program::parse(&line), Ok(p));
    }
}
