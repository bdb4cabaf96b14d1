//! Pieces the benchmark binaries share (each bench file includes this module).

#![allow(dead_code)]

use gantry::{CostModel, SimConfig};

/// A tiny xorshift64* generator: deterministic, no dependency.
pub struct XorShift(u64);

impl XorShift {
    /// A generator from `seed` (0 is replaced: xorshift never leaves it).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform-ish in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
}

/// The simulated GPU the benchmarks run on: 2 µs launch latency, 128 compute units,
/// two compute engines and one copy engine.
pub fn sim_gpu() -> SimConfig {
    let cost = CostModel {
        item_ns: 0.5,
        compute_units: 128,
        memory_bytes_per_ns: 500.0,
        link_bytes_per_ns: 25.0,
        compute_engines: 2,
        copy_engines: 1,
    };
    SimConfig { latency_ns: 2_000, cost, ..Default::default() }
}
