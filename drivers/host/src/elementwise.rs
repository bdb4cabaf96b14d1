//! Elementwise kernels, `out[i] = f(in[i])`: the runtime owns the loop, so a
//! work-group's elements run as one loop over contiguous memory that the compiler
//! vectorizes, alone or inside a fused kernel whose intermediate buffers were
//! internalized (a private slot of one element per work-item is a contiguous array
//! over the group).
//!
//! A phase declares what it touches ([`Elementwise`]), so fusion knows that a
//! private intermediate it writes first needs no clearing for every work-group.
//!
//! Where the group's elements are not one contiguous run (a kernel fused into a grid
//! of another shape, fusion without barriers running one work-item at a time, or an
//! internalized region of another shape) the same closure runs per work-item through
//! the accessors, with their bounds checks and `i % n` mapping: the result is the
//! same, only slower.

use std::any::TypeId;
use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::Arc;

use bytemuck::Pod;

use crate::access::{Accessor, BufferSlot, ElemAccessor, Readable, Writable};
use crate::closure::{Elementwise, ElementwisePhase, MapLoop, MapRun, Phase};
use crate::isa::{copy_for, Isa, LoopFn, OwnedLoop};
use crate::item::{GroupCtx, Item};
use gantry_driver::{Binding, Internal};

/// The code identity of a map phase, for the fusion cache.
struct MapCode<T, U, F>(PhantomData<fn(T, F) -> U>);

/// The phase of an elementwise kernel: work-item `i` (its global linear id) writes
/// `f(input[i])` to its own element of `output`.
///
/// ```
/// # use gantry_driver::{Binding, NdRange};
/// # use gantry_host::{elementwise::map_phase, Accessor, ElemAccessor, ClosureKernel, Arena, Read,
/// #     DiscardWrite};
/// let input: Vec<f32> = (0..2048).map(|i| i as f32).collect();
/// let mut out = vec![0f32; 2048];
/// let (a, o) = (Accessor::<f32, Read>::new(0, 1, 2048), ElemAccessor::<f32, DiscardWrite>::new(1, 1, 2048));
/// let kernel = ClosureKernel {
///     tag: 1,
///     phases: smallvec::smallvec![map_phase(a, o, |x: f32| x * 2.0)],
///     global_slots: 2,
///     scratch: vec![],
///     unfused: None,
/// };
/// let geometry = NdRange::new(2048, 256).geometry().unwrap();
/// let globals = [Binding::new(input.as_ptr() as *mut u8, 8192), Binding::new(out.as_mut_ptr().cast(), 8192)];
/// for g in 0..geometry.group_count() {
///     kernel.run_group(&geometry, g, &globals, &mut Arena::default());
/// }
/// assert!(out.iter().enumerate().all(|(i, &x)| x == 2.0 * i as f32));
/// ```
pub fn map_phase<T, U, MI, MO, F>(input: Accessor<T, MI>, output: ElemAccessor<U, MO>, f: F) -> Phase
where
    T: Pod,
    U: Pod,
    MI: Readable,
    MO: Writable,
    F: Fn(T) -> U + Send + Sync + 'static,
{
    let touches =
        Elementwise::new(input.slot_and_tag().0, output.slot_and_tag().0, size_of::<T>(), size_of::<U>());
    let body = Arc::new(MapBody { input, output, f: gantry_driver::contain::Contained::new(f) });
    let elementwise = touches.map(|touches| ElementwisePhase { touches, map: MapLoop(body.clone()) });
    Phase {
        group: Arc::new(move |ctx: &GroupCtx<'_>| body.group(ctx)),
        per_item: true,
        code: TypeId::of::<MapCode<T, U, F>>(),
        elementwise,
        unprofitable: None,
        runs: true,
    }
}

/// A map phase's accessors and function: the phase runs [`MapBody::group`], and its
/// [`MapLoop`] is the same object.
struct MapBody<T, U, MI, MO, F> {
    input: Accessor<T, MI>,
    output: ElemAccessor<U, MO>,
    /// Dropped wherever its last command lets go of it: a panicking capture must not
    /// unwind there.
    f: gantry_driver::contain::Contained<F>,
}

impl<T, U, MI, MO, F> MapBody<T, U, MI, MO, F>
where
    T: Pod,
    U: Pod,
    MI: Readable,
    MO: Writable,
    F: Fn(T) -> U,
{
    fn group(&self, ctx: &GroupCtx<'_>) {
        let (input, output, f) = (&self.input, &self.output, &*self.f);
        let runs = group_run(ctx).and_then(|(first, local, count)| {
            let src = contiguous::<T>(ctx, input, first, local, count)?;
            let dst = contiguous::<U>(ctx, output, first, local, count)?;
            Some((src, dst, count))
        });
        match runs {
            // SAFETY: `contiguous` checked that both runs hold `count` elements of
            // live, aligned memory. The output run is the group's own elements of an
            // element accessor (one per work-item, no other accessor of the command
            // group overlaps it), and nothing writes the input run while the kernel
            // runs: the scheduler orders other writers, and in a fused kernel each
            // group touches only its own work-items' elements of an elementwise chain.
            Some((src, dst, count)) => unsafe {
                let src = std::slice::from_raw_parts(src.cast_const(), count);
                map_slice(f, src, std::slice::from_raw_parts_mut(dst, count));
            },
            None => ctx.for_each_item(&|it: &mut Item<'_>| {
                let x = input.get(it, it.global_linear_id());
                *output.elem(it) = f(x);
            }),
        }
    }
}

impl<T, U, MI, MO, F> MapRun for MapBody<T, U, MI, MO, F>
where
    T: Pod,
    U: Pod,
    MI: Readable + Send + Sync,
    MO: Writable + Send + Sync,
    F: Fn(T) -> U + Send + Sync,
{
    fn resolve(&self) -> (LoopFn, *const ()) {
        (copy_for::<MapOver<T, U, F>>(crate::isa::active()), std::ptr::from_ref::<F>(&self.f).cast())
    }
}

/// `dst[i] = f(src[i])`, by the loop compiled for the instruction set in use.
fn map_slice<T: Copy, U, F: Fn(T) -> U>(f: &F, src: &[T], dst: &mut [U]) {
    // SAFETY: the active instruction set is one the CPU runs.
    unsafe { map_slice_with(crate::isa::active(), f, src, dst) }
}

/// `dst[i] = f(src[i])`, by the loop compiled for `isa`.
///
/// # Safety
/// The CPU must run `isa`.
unsafe fn map_slice_with<T: Copy, U, F: Fn(T) -> U>(isa: Isa, f: &F, src: &[T], dst: &mut [U]) {
    let count = src.len().min(dst.len());
    // SAFETY: `count` elements of each slice, which cannot overlap (one is `&mut`),
    // `f` is an `F`, as `MapOver<T, U, F>` takes, and the caller's contract.
    unsafe {
        copy_for::<MapOver<T, U, F>>(isa)(
            std::ptr::from_ref(f).cast(),
            src.as_ptr().cast(),
            dst.as_mut_ptr().cast(),
            count,
        )
    }
}

/// The map loop over raw runs, one copy per instruction set ([`copy_for`]), `f`
/// inlined into each: the widest the CPU has runs ([`isa`](crate::isa)); on an
/// AVX-512 machine a default build's loop would use a quarter of the vector width. A
/// call of its own (through a [`LoopFn`]), it is not inlined into the phase, where
/// the compiler does not vectorize it (`docs/PERFORMANCE.md`). The compiler cannot
/// see that the runs are apart, so each call first compares the two addresses (a few
/// instructions) and then runs the vector loop.
struct MapOver<T, U, F>(PhantomData<fn(T, F) -> U>);

impl<T: Copy, U, F: Fn(T) -> U> OwnedLoop for MapOver<T, U, F> {
    /// # Safety
    /// `f` points to an `F`; `src` to `count` live, aligned `T`s and `dst` to `count`
    /// live, aligned `U`s that nothing else reads or writes meanwhile.
    #[inline(always)]
    unsafe fn run(f: *const (), src: *const u8, dst: *mut u8, count: usize) {
        // SAFETY: the caller's contract.
        let (f, src, dst) = unsafe {
            (
                &*f.cast::<F>(),
                std::slice::from_raw_parts(src.cast::<T>(), count),
                std::slice::from_raw_parts_mut(dst.cast::<U>(), count),
            )
        };
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = f(x);
        }
    }
}

/// The group's work-items (or its span's) as one run: global linear ids
/// `first..first + count` with local linear ids `local..local + count`, for a 1-D
/// kernel run on its own grid.
pub(crate) fn group_run(ctx: &GroupCtx<'_>) -> Option<(usize, usize, usize)> {
    let global = ctx.geometry.global_range();
    if ctx.remap.is_some() || ctx.only.is_some() || global[1] != 1 || global[2] != 1 {
        return None;
    }
    let ext = ctx.extent()[0];
    let (lo, hi) = ctx.span.map_or((0, ext), |(lo, hi)| (lo.min(ext), hi.min(ext)));
    Some((ctx.base()[0] + lo, lo, hi - lo))
}

/// Where elements `first..first + count` (local ids from `local`) of `slot` lie, if
/// contiguously: in ordinary memory at `first`; in private memory of one element per
/// work-item at the group's region, indexed by local id; in local memory of `n`
/// elements at `first % n` when the run does not wrap.
pub(crate) fn contiguous<E>(
    ctx: &GroupCtx<'_>,
    slot: &impl BufferSlot,
    first: usize,
    local: usize,
    count: usize,
) -> Option<*mut E> {
    let (slot, tag) = slot.slot_and_tag();
    assert!(tag == ctx.tag, "accessor used in a kernel of a different command group");
    contiguous_run(ctx.bindings[slot as usize], first, local, count, size_of::<E>()).map(|p| p.cast())
}

/// [`contiguous`] for a binding and an element size: where elements
/// `first..first + count` (local ids from `local`) lie, if in one run.
pub(crate) fn contiguous_run(
    b: Binding,
    first: usize,
    local: usize,
    count: usize,
    size: usize,
) -> Option<*mut u8> {
    let size = size.max(1);
    let start = match b.internal {
        Internal::No => (first + count <= b.len / size).then_some(first)?,
        // Other groups may write it: read per work-item, with relaxed atomics.
        Internal::Shared => return None,
        Internal::Private => (b.wrap == size).then_some(local)?,
        Internal::Local => {
            let n = b.wrap / size;
            (n > 0 && first % n + count <= n).then_some(first % n)?
        }
    };
    // SAFETY: `start + count` elements fit the region, checked above.
    Some(unsafe { b.ptr.add(start * size) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{DiscardWrite, Read};
    use crate::closure::{Arena, ClosureKernel};
    use gantry_driver::{Geometry, NdRange, Range};

    fn kernel(phase: Phase) -> ClosureKernel {
        ClosureKernel {
            tag: 3,
            phases: smallvec::smallvec![phase],
            global_slots: 2,
            scratch: vec![],
            unfused: None,
        }
    }

    fn run(k: &ClosureKernel, geometry: &Geometry, globals: &[Binding]) {
        let mut arena = Arena::default();
        for g in 0..geometry.group_count() {
            k.run_group(geometry, g, globals, &mut arena);
        }
    }

    /// Every instruction set's copy of the loop gives the baseline's results bit for
    /// bit (float arithmetic included: no contraction into fused multiply-adds), over
    /// lengths with and without a vector tail, for same-size and widening maps.
    #[test]
    fn every_instruction_set_maps_bit_for_bit() {
        let step = |x: f32| x * 1.0001 + 0.5;
        let widen = |x: u32| u64::from(x) * 0x1_0000_0001 + 7;
        let floats: Vec<f32> = (0..1000).map(|i| (i % 97) as f32 * 0.013 - 0.4).collect();
        let ints: Vec<u32> = (0..1000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        /// `src` mapped by the copy of the loop for `isa` into a fresh vector.
        fn mapped<T: Copy, U: Copy + Default, F: Fn(T) -> U>(isa: Isa, f: &F, src: &[T]) -> Vec<U> {
            let mut dst = vec![U::default(); src.len()];
            // SAFETY: callers only name instruction sets the CPU runs.
            unsafe { map_slice_with(isa, f, src, &mut dst) };
            dst
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in [0usize, 1, 7, 15, 16, 17, 63, 255, 1000] {
            let want_f: Vec<f32> = floats[..n].iter().map(|&x| step(x)).collect();
            let want_i: Vec<u64> = ints[..n].iter().map(|&x| widen(x)).collect();
            let mut got_f = vec![0f32; n];
            let mut got_i = vec![0u64; n];
            map_slice(&step, &floats[..n], &mut got_f);
            map_slice(&widen, &ints[..n], &mut got_i);
            assert_eq!(bits(&got_f), bits(&want_f), "active, n = {n}");
            assert_eq!(got_i, want_i, "active, n = {n}");
            for isa in [Isa::Baseline, Isa::Avx2, Isa::Avx512] {
                if isa > Isa::detected() {
                    continue;
                }
                assert_eq!(bits(&mapped(isa, &step, &floats[..n])), bits(&want_f), "{isa}, n = {n}");
                assert_eq!(mapped(isa, &widen, &ints[..n]), want_i, "{isa}, n = {n}");
            }
        }
    }

    /// The contiguous path, including a partial last group, gives `f` of each element.
    #[test]
    fn maps_every_element_of_a_plain_range() {
        let n = 10_000;
        let input: Vec<u32> = (0..n as u32).collect();
        let mut out = vec![0u64; n];
        let a = Accessor::<u32, Read>::new(0, 3, n);
        let o = ElemAccessor::<u64, DiscardWrite>::new(1, 3, n);
        let k = kernel(map_phase(a, o, |x: u32| u64::from(x) * 3 + 1));
        let geometry = Geometry::for_range(Range::d1(n)).unwrap();
        assert!(geometry.group_count() > 1, "several groups, the last partial");
        let globals =
            [Binding::new(input.as_ptr() as *mut u8, n * 4), Binding::new(out.as_mut_ptr().cast(), n * 8)];
        run(&k, &geometry, &globals);
        assert!(out.iter().enumerate().all(|(i, &x)| x == i as u64 * 3 + 1));
    }

    /// Private memory of one element per work-item is read and written as the group's
    /// contiguous array; a wider private region falls back to per-item `i % n`
    /// addressing. Both give the per-item results. Local memory of a group's size is
    /// contiguous too; a smaller one wraps, and the per-item path gives what per-item
    /// accesses give: the last work-item to write an element wins.
    #[test]
    fn internalized_slots_map_like_per_item_accesses() {
        let n = 512;
        let input: Vec<u32> = (0..n as u32).map(|x| x * 7).collect();
        // Phase 1 maps slot 0 into slot 1, internalized in a region of `scratch`
        // elements with `wrap` bytes per group (local) or work-item (private); phase 2
        // copies each work-item's value back into slot 0 through per-item accessors,
        // to observe what the map wrote where. Groups of 128.
        let run = |internal: Internal, scratch: usize, wrap: usize| -> Vec<u32> {
            let a = Accessor::<u32, Read>::new(0, 3, n);
            let o = ElemAccessor::<u32, DiscardWrite>::new(1, 3, n);
            let back = Accessor::<u32, crate::access::Write>::new(0, 3, n);
            let phases = [
                map_phase(a, o, |x: u32| x + 5),
                crate::closure::phase(move |it| {
                    let v = *o.elem(it);
                    back.set(it, it.global_linear_id(), v);
                }),
            ];
            let geometry = NdRange::new(n, 128).geometry().unwrap();
            let mut data = input.clone();
            let mut scratch = vec![0u32; scratch];
            for g in 0..geometry.group_count() {
                let region = Binding { ptr: scratch.as_mut_ptr().cast(), len: 0, internal, wrap };
                let globals = [Binding::new(data.as_mut_ptr().cast(), n * 4), region];
                let ctx = GroupCtx::new(&geometry, geometry.group_id(g), &globals, &[], 3);
                for phase in &phases {
                    (phase.group)(&ctx);
                }
            }
            data
        };
        for elems in [128usize, 64] {
            let data = run(Internal::Local, elems, 4 * elems);
            // Work-item `i` reads element `i % elems`, last written by the group's
            // last work-item with that remainder.
            let last_writer = |i: usize| i - i % 128 + 128 - elems + i % elems;
            let want: Vec<u32> = (0..n).map(|i| input[last_writer(i)] + 5).collect();
            assert_eq!(data, want, "local region of {elems} elements");
        }
        for wrap_elems in [1usize, 2] {
            let data = run(Internal::Private, 128 * wrap_elems, 4 * wrap_elems);
            let want: Vec<u32> = input.iter().map(|x| x + 5).collect();
            assert_eq!(data, want, "private region of {wrap_elems} element(s) per work-item");
        }
    }

    /// Each kernel fused without barriers runs one work-item at a time (`only`):
    /// the map takes the per-item path for exactly that work-item.
    #[test]
    fn one_work_item_at_a_time() {
        let n = 64;
        let input: Vec<u32> = (0..n as u32).collect();
        let mut out = vec![0u32; n];
        let a = Accessor::<u32, Read>::new(0, 3, n);
        let o = ElemAccessor::<u32, DiscardWrite>::new(1, 3, n);
        let phase = map_phase(a, o, |x: u32| x * x);
        let geometry = NdRange::new(n, 16).geometry().unwrap();
        let globals =
            [Binding::new(input.as_ptr() as *mut u8, n * 4), Binding::new(out.as_mut_ptr().cast(), n * 4)];
        let ctx = GroupCtx { only: Some([5, 0, 0]), ..GroupCtx::new(&geometry, [2, 0, 0], &globals, &[], 3) };
        (phase.group)(&ctx);
        let want: Vec<u32> = (0..n as u32).map(|i| if i == 37 { 37 * 37 } else { 0 }).collect();
        assert_eq!(out, want);
    }

    /// An input accessor shorter than the kernel fails like a per-item access would.
    #[test]
    fn a_short_input_panics_instead_of_reading_past_it() {
        let n = 100;
        let input: Vec<u32> = vec![1; n - 1];
        let mut out = vec![0u32; n];
        let a = Accessor::<u32, Read>::new(0, 3, n - 1);
        let o = ElemAccessor::<u32, DiscardWrite>::new(1, 3, n);
        let k = kernel(map_phase(a, o, |x: u32| x));
        let geometry = Geometry::for_range(Range::d1(n)).unwrap();
        let globals = [
            Binding::new(input.as_ptr() as *mut u8, (n - 1) * 4),
            Binding::new(out.as_mut_ptr().cast(), n * 4),
        ];
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&k, &geometry, &globals)));
        assert!(r.is_err(), "reading element {} of {} must panic", n - 1, n - 1);
    }
}
