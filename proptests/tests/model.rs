//! Gantry against the reference model.
//!
//! Random programs (kernels, host tasks, copies, fills, host transfers, event and
//! queue waits, flushes, host accesses, explicit `depends_on`, in-order and
//! out-of-order queues, CPU and simulated device) must leave every buffer, every
//! mid-program `to_vec` snapshot and every `copy_to_host` readback exactly as the
//! serial model does, under each runtime configuration:
//!
//! * manual mode, `worker_threads(0)`, `host_threads(0)`;
//! * threaded mode with 1, 2 and 8 worker threads (random `host_threads` in 0..=2 and
//!   random CPU `inline_items` in {0, 16, 4096}, so work goes to the pools or runs
//!   inline on the scheduler thread);
//!
//! each on a CPU-only runtime (sim submissions go to the CPU) and on a CPU + sim one.
//!
//! # Case counts
//! Each property runs 600 cases by default (4,800 in this file). Set the environment
//! variable `GANTRY_PROPTEST_CASES=N` to run `N` cases per property instead, in every
//! test file of this crate, e.g. `GANTRY_PROPTEST_CASES=5000 cargo test -p
//! gantry-proptests --release`.

mod common;

use gantry_proptests::{check, Config, GenOptions};
use proptest::prelude::*;

const CASES: u32 = 600;
const MAX_OPS: usize = 32;

fn threaded(workers: usize, sim: bool, host_threads: usize, inline: usize) -> Config {
    Config { host_threads, inline_items: inline, ..Config::threaded(workers, sim) }
}

fn inline_items() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(16), Just(4096)]
}

proptest! {
    #![proptest_config(common::config(CASES))]

    #[test]
    fn manual_cpu(p in common::program(MAX_OPS, GenOptions::ALL)) {
        check(&p, Config::manual(false)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn manual_sim(p in common::program(MAX_OPS, GenOptions::ALL)) {
        check(&p, Config::manual(true)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn threaded1_cpu(p in common::program(MAX_OPS, GenOptions::ALL), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(1, false, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn threaded1_sim(p in common::program(MAX_OPS, GenOptions::ALL), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(1, true, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn threaded2_cpu(p in common::program(MAX_OPS, GenOptions::ALL), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(2, false, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn threaded2_sim(p in common::program(MAX_OPS, GenOptions::ALL), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(2, true, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn threaded8_cpu(p in common::program(MAX_OPS, GenOptions::ALL), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(8, false, h, inl)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn threaded8_sim(p in common::program(MAX_OPS, GenOptions::ALL), h in 0..=2usize, inl in inline_items()) {
        check(&p, threaded(8, true, h, inl)).map_err(TestCaseError::fail)?;
    }
}
