//! The affine step chain that the fusion tests of several backends fuse: kernel `k`
//! of a chain computes `y[i] = a_k * x[i] + b_k` for `i < n`, over arguments
//! (`x` read, `y` discarded and written) and scalars (`n: u32`, `a: f32`, `b: f32`),
//! with `(a_k, b_k)` from [`coefficients`]. Every backend's image of it (WGSL here,
//! OpenCL C or LLVM IR in the JIT's tests) computes the [`reference()`]'s bits: one
//! multiply and one add per step, never contracted.
//!
//! ```
//! use gantry_conformance::step_chain;
//! assert_eq!(step_chain::reference(&[2.0], 2), vec![(2.0 - 3.5) * 1.125 - 2.5]);
//! assert_eq!(step_chain::signature().globals.len(), 2);
//! ```

use gantry_driver::{AccessMode, Signature};

/// The step in WGSL, workgroups of 64, entry point `step`.
pub const WGSL: &str = "
struct S { n: u32, a: f32, b: f32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn step(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = s.a * x[id.x] + s.b; }
}";

/// A step's signature: `x` read, `y` discarded and written, then `n`, `a`, `b`.
pub fn signature() -> Signature {
    Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::DiscardWrite)
        .scalar::<u32>()
        .scalar::<f32>()
        .scalar::<f32>()
}

/// Step `k`'s `(a, b)`.
pub fn coefficients(k: usize) -> (f32, f32) {
    (1.0 + k as f32 / 8.0, k as f32 - 3.5)
}

/// The first `steps` steps of the chain applied to each element of `x`, serially.
pub fn reference(x: &[f32], steps: usize) -> Vec<f32> {
    x.iter()
        .map(|&v| {
            (0..steps).fold(v, |v, k| {
                let (a, b) = coefficients(k);
                a * v + b
            })
        })
        .collect()
}
