//! The dependency edges Gantry's resolution stage builds.
//!
//! In manual mode a random program (kernels, copies, fills, host tasks, host
//! transfers; CPU only; no waits) is submitted without flushing; a system added to
//! [`Stage::Resolve`] records, for every command, its predecessors (by submission
//! sequence number); then one flush runs. Checked:
//!
//! * edges point backwards in submission order;
//! * every conflicting pair (overlapping ranges of one buffer, at least one writes)
//!   is ordered: a path of edges leads from the earlier command to the later one;
//! * every explicit `depends_on` pair and every pair of commands on one in-order
//!   queue is ordered;
//! * a direct edge only joins commands that conflict, that name each other with
//!   `depends_on`, or that follow each other on an in-order queue (no spurious
//!   serialization);
//! * the program's results equal the model's.
//!
//! `GANTRY_PROPTEST_CASES` sets the number of cases of each property (see
//! `tests/model.rs`).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gantry::components::{Command, CommandKind, Edges};
use gantry::ecs::prelude::*;
use gantry::Stage;
use gantry_proptests::{run_model, Config, GenOptions, Op, Program, Session};
use proptest::prelude::*;

const CASES: u32 = 1000;
const MAX_OPS: usize = 40;

/// `seq -> (kind, preds as seqs)` of every user command.
type Recorded = BTreeMap<u64, (CommandKind, Vec<u64>)>;

/// Submits `p` to a manual CPU runtime, records the edges at the first flush, then
/// finishes the program and compares its outcome with the model's.
fn record(p: &Program) -> Result<Recorded, String> {
    let mut s = Session::new(p, Config::manual(false));
    let rec: Arc<Mutex<Recorded>> = Arc::default();
    let sink = rec.clone();
    s.runtime().add_system(Stage::Resolve, move |q: Query<(Entity, &Command, &Edges)>| {
        let seqs: BTreeMap<Entity, (CommandKind, u64)> =
            q.iter().map(|(e, c, _)| (e, (c.kind, c.seq))).collect();
        let mut rec = sink.lock().unwrap();
        for (_, c, edges) in q.iter() {
            if c.kind == CommandKind::MemoryMove || rec.contains_key(&c.seq) {
                continue;
            }
            let preds = edges
                .preds
                .iter()
                .map(|p| match seqs.get(p) {
                    Some((CommandKind::MemoryMove, _)) => panic!("memory move on a CPU-only runtime"),
                    Some((_, s)) => *s,
                    None => panic!("predecessor {p:?} of seq {} is not a live command", c.seq),
                })
                .collect();
            rec.insert(c.seq, (c.kind, preds));
        }
    });
    for (i, op) in p.ops.iter().enumerate() {
        assert!(matches!(op, Op::Submit { .. }), "edge programs only submit");
        s.step(i, op)?;
    }
    if !rec.lock().unwrap().is_empty() {
        return Err("the resolve stage ran before the flush".into());
    }
    s.runtime().flush();
    let recorded = std::mem::take(&mut *rec.lock().unwrap());
    let out = s.finish()?;
    if let Some(m) = run_model(p).mismatch(&out) {
        return Err(format!("results differ from the model:\n{m}"));
    }
    Ok(recorded)
}

/// `ancestors[j][i]`: a path of edges leads from `i` to `j`.
fn ancestors(n: usize, preds: &Recorded) -> Vec<Vec<bool>> {
    let mut anc: Vec<Vec<bool>> = Vec::with_capacity(n);
    // Sequence numbers are a topological order (checked before).
    for j in 0..n {
        let mut mine = vec![false; n];
        for &p in &preds[&(j as u64)].1 {
            mine[p as usize] = true;
            for (m, &a) in mine.iter_mut().zip(&anc[p as usize]) {
                *m |= a;
            }
        }
        anc.push(mine);
    }
    anc
}

/// Checks the recorded edges of `p` against its conflicts, explicit dependencies and
/// in-order queues.
fn check_edges(p: &Program) -> Result<(), String> {
    let rec = record(p)?;
    let n = p.ops.len();
    let seqs: Vec<u64> = rec.keys().copied().collect();
    if seqs != (0..n as u64).collect::<Vec<_>>() {
        return Err(format!("recorded sequence numbers {seqs:?}, expected 0..{n}"));
    }
    for (&s, (_, preds)) in &rec {
        if let Some(p) = preds.iter().find(|&&p| p >= s) {
            return Err(format!("#{s} depends on later or same #{p}"));
        }
    }
    let ancestors = ancestors(n, &rec);
    let sub = |i: usize| match &p.ops[i] {
        Op::Submit { queue, dev, deps, cmd } => (*queue, *dev, deps, cmd),
        _ => unreachable!(),
    };
    // The previous submission on the same in-order queue, if any.
    let prev_in_order = |j: usize| {
        let (qj, dj, _, _) = sub(j);
        if !p.queues[qj] {
            return None;
        }
        (0..j).rev().find(|&i| (sub(i).0, sub(i).1) == (qj, dj))
    };
    for j in 0..n {
        let (_, _, deps, cj) = sub(j);
        let preds = &rec[&(j as u64)].1;
        for (i, &ordered) in ancestors[j].iter().enumerate().take(j) {
            let ci = sub(i).3;
            let conflict = ci.conflicts_with(cj);
            let explicit = deps.contains(&i);
            let queue_order = prev_in_order(j) == Some(i);
            if (conflict || explicit || queue_order) && !ordered {
                let why = if conflict {
                    "they conflict"
                } else if explicit {
                    "of depends_on"
                } else {
                    "of in-order queue"
                };
                return Err(format!(
                    "#{i} and #{j} are not ordered, but must be because {why}; edges {rec:?}"
                ));
            }
            if preds.contains(&(i as u64)) && !(conflict || explicit || queue_order) {
                return Err(format!(
                    "spurious edge #{i} -> #{j}: no conflict, no depends_on, not queue order; edges {rec:?}"
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::config(CASES))]

    /// Out-of-order CPU queues, no explicit dependencies: exactly the memory
    /// conflicts order commands.
    #[test]
    fn implicit_edges(p in common::program(MAX_OPS, GenOptions::IMPLICIT_ONLY)) {
        check_edges(&p).map_err(TestCaseError::fail)?;
    }

    /// Explicit `depends_on` and in-order queues add ordering, and nothing else does.
    #[test]
    fn explicit_and_queue_edges(
        p in common::program(MAX_OPS, GenOptions { in_order: true, deps: true, ..GenOptions::IMPLICIT_ONLY })
    ) {
        check_edges(&p).map_err(TestCaseError::fail)?;
    }
}
