//! Reductions: every element of a range folded into one element with an associative
//! operator ([`Reduction`]: [`Sum`], [`Min`], [`Max`] or any associative function with
//! an identity, [`Custom`]), optionally of a map of each element first.
//!
//! A reduction runs as one work-group over its whole range, whose phase folds the
//! range in chunks of [`CHUNK`] elements: each chunk into [`LANES`] partials (element
//! `j` into partial `j % LANES`, so the loop vectorizes where the operator is one
//! instruction), the lanes in order into the chunk's partial, and the chunks'
//! partials in order into the result. On a worker pool the chunks run in parallel;
//! inline they run one after the other; either way the result is the same, bit for
//! bit, whatever the number of threads, since the order of every combination is
//! fixed by the range's length alone. It is not the order of a serial left fold, so
//! a floating-point sum may differ from one in its last bits.
//!
//! Fusing a reduction into a chain would make the chain share its one work-group,
//! so the closure fusion compiler refuses such a chain
//! ([`Unprofitable::Reduction`](gantry_driver::fusion::Unprofitable::Reduction)); a
//! map in front of a reduction is fused by writing it as one `map_reduce`.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use rayon::prelude::*;

use crate::access::{store_relaxed, Accessor, Readable, Writable};
use crate::closure::Phase;
use crate::elementwise::contiguous;
use crate::item::{GroupCtx, Item};

/// Elements folded one after the other into one chunk's partials.
pub const CHUNK: usize = 1 << 15;
/// Partials per chunk (element `j` of a chunk goes into partial `j % LANES`).
pub const LANES: usize = 16;

/// An associative operator with an identity: `combine(identity(), x) == x` and
/// `combine(a, combine(b, c)) == combine(combine(a, b), c)` (for floating point, up to
/// rounding: the order of combination is fixed, not the serial one).
///
/// ```
/// use gantry_host::reduce::{Custom, Reduction, Sum, Max};
/// assert_eq!(Reduction::<u32>::combine(&Sum, 2, 3), 5);
/// assert_eq!(Reduction::<f32>::identity(&Max), f32::NEG_INFINITY);
/// let product = Custom::new(1u64, |a: u64, b: u64| a.wrapping_mul(b));
/// assert_eq!(product.combine(6, 7), 42);
/// ```
pub trait Reduction<T>: Send + Sync + 'static {
    /// The identity: combined with any `x`, gives `x`.
    fn identity(&self) -> T;
    /// Combines two partial results.
    fn combine(&self, a: T, b: T) -> T;
}

/// A reduction by an associative function of the caller's with its identity.
#[derive(Clone, Copy, Debug)]
pub struct Custom<T, F> {
    identity: T,
    f: F,
}

impl<T: Copy, F> Custom<T, F> {
    /// The reduction by associative `f` with identity `identity`.
    pub fn new(identity: T, f: F) -> Self {
        Self { identity, f }
    }
}

impl<T, F> Reduction<T> for Custom<T, F>
where
    T: Copy + Send + Sync + 'static,
    F: Fn(T, T) -> T + Send + Sync + 'static,
{
    #[inline(always)]
    fn identity(&self) -> T {
        self.identity
    }
    #[inline(always)]
    fn combine(&self, a: T, b: T) -> T {
        (self.f)(a, b)
    }
}

/// The numbers [`Sum`], [`Min`] and [`Max`] reduce.
pub trait Number: Pod + PartialOrd + Send + Sync {
    /// 0.
    const ZERO: Self;
    /// The identity of [`Min`]: the largest value (infinity for floats).
    const TOP: Self;
    /// The identity of [`Max`]: the smallest value (negative infinity for floats).
    const BOTTOM: Self;
    /// The sum (wrapping for integers, as a release build's `+`).
    fn add(self, other: Self) -> Self;
    /// The smaller (for floats, `f32::min`: a NaN loses to a number).
    fn min_of(self, other: Self) -> Self;
    /// The larger (for floats, `f32::max`).
    fn max_of(self, other: Self) -> Self;
}

macro_rules! number_int {
    ($($t:ty),*) => {$(
        impl Number for $t {
            const ZERO: Self = 0;
            const TOP: Self = <$t>::MAX;
            const BOTTOM: Self = <$t>::MIN;
            #[inline(always)]
            fn add(self, other: Self) -> Self { self.wrapping_add(other) }
            #[inline(always)]
            fn min_of(self, other: Self) -> Self { Ord::min(self, other) }
            #[inline(always)]
            fn max_of(self, other: Self) -> Self { Ord::max(self, other) }
        }
    )*};
}
number_int!(i32, i64, u32, u64);

macro_rules! number_float {
    ($($t:ty),*) => {$(
        impl Number for $t {
            const ZERO: Self = 0.0;
            const TOP: Self = <$t>::INFINITY;
            const BOTTOM: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn add(self, other: Self) -> Self { self + other }
            #[inline(always)]
            fn min_of(self, other: Self) -> Self { self.min(other) }
            #[inline(always)]
            fn max_of(self, other: Self) -> Self { self.max(other) }
        }
    )*};
}
number_float!(f32, f64);

/// The sum.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sum;
/// The minimum.
#[derive(Clone, Copy, Debug, Default)]
pub struct Min;
/// The maximum.
#[derive(Clone, Copy, Debug, Default)]
pub struct Max;

impl<T: Number + 'static> Reduction<T> for Sum {
    #[inline(always)]
    fn identity(&self) -> T {
        T::ZERO
    }
    #[inline(always)]
    fn combine(&self, a: T, b: T) -> T {
        a.add(b)
    }
}
impl<T: Number + 'static> Reduction<T> for Min {
    #[inline(always)]
    fn identity(&self) -> T {
        T::TOP
    }
    #[inline(always)]
    fn combine(&self, a: T, b: T) -> T {
        a.min_of(b)
    }
}
impl<T: Number + 'static> Reduction<T> for Max {
    #[inline(always)]
    fn identity(&self) -> T {
        T::BOTTOM
    }
    #[inline(always)]
    fn combine(&self, a: T, b: T) -> T {
        a.max_of(b)
    }
}

/// The fold of one chunk: its elements mapped, into [`LANES`] partials, then the
/// lanes in order.
#[inline(always)]
fn fold_chunk<T: Copy, U: Copy, M: Fn(T) -> U, R: Reduction<U>>(map: &M, op: &R, chunk: &[T]) -> U {
    let mut lanes = [op.identity(); LANES];
    // Blocks as arrays: their length is in the type, so each block's lanes are
    // straight-line code the compiler turns into whole-vector loads.
    let (blocks, rest) = chunk.as_chunks::<LANES>();
    for block in blocks {
        for (lane, &x) in lanes.iter_mut().zip(block) {
            *lane = op.combine(*lane, map(x));
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(rest) {
        *lane = op.combine(*lane, map(x));
    }
    lanes.into_iter().fold(op.identity(), |a, b| op.combine(a, b))
}

/// The reduction of `map` of every element of `input`, in the fixed order this
/// module describes: on the current rayon pool's threads if the caller is one of
/// them, else on the calling thread, with the same result.
///
/// ```
/// use gantry_host::reduce::{reduce_slice, Sum};
/// let x: Vec<u64> = (1..=100_000).collect();
/// assert_eq!(reduce_slice(&x, &|v: u64| v, &Sum), 5_000_050_000);
/// ```
pub fn reduce_slice<T, U, M, R>(input: &[T], map: &M, op: &R) -> U
where
    T: Copy + Sync,
    U: Copy + Send,
    M: Fn(T) -> U + Sync,
    R: Reduction<U>,
{
    let fold = |chunk: &[T]| fold_chunk(map, op, chunk);
    if input.len() > CHUNK && rayon::current_thread_index().is_some() {
        let partials: Vec<U> = input.par_chunks(CHUNK).map(fold).collect();
        partials.into_iter().fold(op.identity(), |a, b| op.combine(a, b))
    } else {
        input.chunks(CHUNK).map(fold).fold(op.identity(), |a, b| op.combine(a, b))
    }
}

/// The code identity of a reduction phase, for the fusion cache.
struct ReduceCode<T, U, M, R>(PhantomData<fn(T, M, R) -> U>);

/// The phase of a reduction kernel: element 0 of `output` becomes the reduction by
/// `op` of `map` of every element of `input` (previous contents replaced). Run as
/// one work-group over the input's range (an ND-range of one group), its phase does
/// the whole fold ([`reduce_slice`]).
///
/// ```
/// # use gantry_driver::{Binding, NdRange};
/// # use gantry_host::{reduce::{reduce_phase, Max}, Accessor, ClosureKernel, Arena, Read, Write};
/// let x: Vec<f32> = (0..5000).map(|i| (i % 777) as f32).collect();
/// let mut out = [0f32];
/// let (a, o) = (Accessor::<f32, Read>::new(0, 1, 5000), Accessor::<f32, Write>::new(1, 1, 1));
/// let kernel = ClosureKernel {
///     tag: 1,
///     phases: smallvec::smallvec![reduce_phase(a, o, |v: f32| v * 2.0, Max)],
///     global_slots: 2,
///     scratch: vec![],
///     unfused: None,
/// };
/// let geometry = NdRange::new(5000, 5000).geometry().unwrap();
/// let globals = [Binding::new(x.as_ptr() as *mut u8, 20000), Binding::new(out.as_mut_ptr().cast(), 4)];
/// kernel.run_group(&geometry, 0, &globals, &mut Arena::default());
/// assert_eq!(out[0], 1552.0);
/// ```
pub fn reduce_phase<T, U, MI, MO, M, R>(
    input: Accessor<T, MI>,
    output: Accessor<U, MO>,
    map: M,
    op: R,
) -> Phase
where
    T: Pod + Sync,
    U: Pod + Send,
    MI: Readable,
    MO: Writable,
    M: Fn(T) -> U + Send + Sync + 'static,
    R: Reduction<U>,
{
    let map = gantry_driver::contain::Contained::new(map);
    let op = gantry_driver::contain::Contained::new(op);
    Phase {
        group: Arc::new(move |ctx: &GroupCtx<'_>| {
            let (map, op) = (&*map, &*op);
            let n = input.len();
            // SAFETY: `contiguous` checked the run; nothing writes the input while the
            // kernel runs (the scheduler orders other writers; a reduction is never
            // fused, so it has no other kernel's writes to meet).
            let result = match contiguous::<T>(ctx, &input, 0, 0, n) {
                Some(p) => reduce_slice(unsafe { std::slice::from_raw_parts(p.cast_const(), n) }, map, op),
                None => {
                    // Not one run (never for a launch of its own): element by element.
                    let acc = std::cell::Cell::new(op.identity());
                    ctx.for_each_item(&|it: &mut Item<'_>| {
                        if it.global_linear_id() == 0 {
                            for i in 0..n {
                                acc.set(op.combine(acc.get(), map(input.get(it, i))));
                            }
                        }
                    });
                    acc.get()
                }
            };
            match contiguous::<U>(ctx, &output, 0, 0, 1) {
                // SAFETY: one live, aligned element; relaxed atomics race with nothing.
                Some(p) => unsafe { store_relaxed(p, result) },
                None => ctx.for_each_item(&|it: &mut Item<'_>| {
                    if it.global_linear_id() == 0 {
                        output.set(it, 0, result)
                    }
                }),
            }
        }),
        per_item: false,
        code: TypeId::of::<ReduceCode<T, U, M, R>>(),
        elementwise: None,
        unprofitable: Some(crate::closure::SlowerFused::Reduction),
        runs: true,
    }
}
