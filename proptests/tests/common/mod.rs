//! Proptest strategies shared by the test files: raw programs, decoded with
//! [`Program::decode`], and the case counts.

#![allow(dead_code)]

use gantry_proptests::fusion::FusionGen;
use gantry_proptests::{GenOptions, Program, RawOp, RawProgram, RawSpan};
use proptest::collection::vec;
use proptest::prelude::*;

/// The environment variable that overrides the number of cases of every property.
pub const CASES_VAR: &str = "GANTRY_PROPTEST_CASES";

/// `GANTRY_PROPTEST_CASES` if set (and a number), else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var(CASES_VAR).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// A proptest configuration with `cases(default)` cases.
pub fn config(default: u32) -> ProptestConfig {
    ProptestConfig { cases: cases(default), max_shrink_iters: 4096, ..ProptestConfig::default() }
}

/// The runtimes deterministic cases run on: manual, two workers, and eight workers
/// with large inline work, each without and with the simulated device.
pub fn configs() -> Vec<gantry_proptests::Config> {
    use gantry_proptests::Config;
    let mut v = Vec::new();
    for sim in [false, true] {
        v.push(Config::manual(sim));
        v.push(Config::threaded(2, sim));
        v.push(Config { inline_items: 4096, host_threads: 0, ..Config::threaded(8, sim) });
    }
    v
}

pub fn raw_span() -> impl Strategy<Value = RawSpan> {
    (any::<u8>(), any::<u8>(), any::<u8>(), prop::bool::weighted(0.25))
        .prop_map(|(buf, start, len, whole)| RawSpan { buf, start, len, whole })
}

pub fn raw_op() -> impl Strategy<Value = RawOp> {
    (
        any::<u8>(),
        any::<u8>(),
        any::<bool>(),
        vec(any::<u8>(), 0..=2),
        [raw_span(), raw_span(), raw_span(), raw_span()],
        any::<[u8; 2]>(),
        any::<u8>(),
        any::<u32>(),
        any::<u8>(),
    )
        .prop_map(|(kind, queue, sim, deps, spans, modes, counts, salt, aux)| RawOp {
            kind,
            queue,
            sim,
            deps,
            spans,
            modes,
            counts,
            salt,
            aux,
        })
}

pub fn raw_program(max_ops: usize) -> impl Strategy<Value = RawProgram> {
    (vec((any::<u8>(), any::<u32>()), 1..=4), vec(any::<bool>(), 1..=3), vec(raw_op(), 1..=max_ops))
        .prop_map(|(buffers, queues, ops)| RawProgram { buffers, queues, ops })
}

/// Valid programs of up to `max_ops` ops under `opts`.
pub fn program(max_ops: usize, opts: GenOptions) -> impl Strategy<Value = Program> {
    raw_program(max_ops).prop_map(move |raw| Program::decode(&raw, &opts))
}

/// Valid fusion programs of up to `max_ops` ops under `opts` (see
/// `gantry_proptests::fusion`).
pub fn fusion_program(max_ops: usize, gen: FusionGen) -> impl Strategy<Value = Program> {
    raw_program(max_ops).prop_map(move |raw| gantry_proptests::fusion::decode(&raw, &gen))
}
