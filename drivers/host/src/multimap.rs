//! Elementwise kernels of two to four inputs, `out[i] = f(a[i], b[i], …)`: like
//! [`map_phase`](crate::elementwise::map_phase), the runtime owns the loop, so where a
//! work-group's elements are one contiguous run of every input and of the output the
//! group is one loop over slices, compiled once per instruction set
//! ([`isa`](crate::isa)) with `f` inlined, which the compiler vectorizes where the
//! arithmetic allows. Elements may be any `Pod` type, structs included.
//!
//! Where a run is not contiguous (a kernel fused into a grid of another shape, fusion
//! without barriers, internalized or shared memory) the same closure runs per
//! work-item through the accessors: the same results, more slowly.
//!
//! Such a phase fuses like any per-work-item phase (group by group, with a barrier
//! between kernels), but does not stream span by span: fusion's span streaming
//! ([`Elementwise`](crate::Elementwise)) follows one input.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;

use crate::access::{Accessor, ElemAccessor, Readable, Writable};
use crate::closure::Phase;
use crate::elementwise::{contiguous, group_run};
use crate::isa::Isa;
use crate::item::{GroupCtx, Item};

/// One arity: the phase constructor, its body, its code identity and its loop.
macro_rules! map_n {
    (
        $(#[$doc:meta])*
        $phase:ident, $body:ident, $code:ident, $slices:ident, $ptrs:ident;
        $($T:ident $M:ident $a:ident $s:ident),+
    ) => {
        /// The code identity of the phase, for the fusion cache.
        struct $code<$($T,)+ U, F>(PhantomData<fn($($T,)+ F) -> U>);

        $(#[$doc])*
        pub fn $phase<$($T, $M,)+ U, MO, F>(
            $($a: Accessor<$T, $M>,)+
            output: ElemAccessor<U, MO>,
            f: F,
        ) -> Phase
        where
            $($T: Pod, $M: Readable,)+
            U: Pod,
            MO: Writable,
            F: Fn($($T),+) -> U + Send + Sync + 'static,
        {
            let body = $body { $($a,)+ output, f: gantry_driver::contain::Contained::new(f) };
            Phase {
                group: Arc::new(move |ctx: &GroupCtx<'_>| body.group(ctx)),
                per_item: true,
                code: TypeId::of::<$code<$($T,)+ U, F>>(),
                elementwise: None,
                unprofitable: None,
                runs: true,
            }
        }

        struct $body<$($T, $M,)+ U, MO, F> {
            $($a: Accessor<$T, $M>,)+
            output: ElemAccessor<U, MO>,
            /// Dropped wherever its last command lets go of it: a panicking capture
            /// must not unwind there.
            f: gantry_driver::contain::Contained<F>,
        }

        impl<$($T, $M,)+ U, MO, F> $body<$($T, $M,)+ U, MO, F>
        where
            $($T: Pod, $M: Readable,)+
            U: Pod,
            MO: Writable,
            F: Fn($($T),+) -> U,
        {
            fn group(&self, ctx: &GroupCtx<'_>) {
                let f = &*self.f;
                let runs = group_run(ctx).and_then(|(first, local, count)| {
                    Some((
                        ($(contiguous::<$T>(ctx, &self.$a, first, local, count)?,)+),
                        contiguous::<U>(ctx, &self.output, first, local, count)?,
                        count,
                    ))
                });
                match runs {
                    // SAFETY: `contiguous` checked that every run holds `count` live,
                    // aligned elements. The output run is the group's own elements of
                    // an element accessor (no other accessor of the command group
                    // overlaps it, so it overlaps no input), and nothing writes the
                    // inputs meanwhile: the scheduler orders other writers, and fusion
                    // binds an input that another kernel writes as shared memory,
                    // which is never contiguous. The active instruction set is one
                    // the CPU runs.
                    Some((($($s,)+), dst, count)) => unsafe {
                        $slices(
                            crate::isa::active(),
                            f,
                            ($(std::slice::from_raw_parts($s.cast_const(), count),)+),
                            std::slice::from_raw_parts_mut(dst, count),
                        )
                    },
                    None => {
                        let ($($a,)+ output) = ($(&self.$a,)+ &self.output);
                        ctx.for_each_item(&|it: &mut Item<'_>| {
                            let i = it.global_linear_id();
                            *output.elem(it) = f($($a.get(it, i)),+);
                        })
                    }
                }
            }
        }

        /// `dst[i] = f(a[i], …)` by the loop compiled for `isa`.
        ///
        /// # Safety
        /// The CPU must run `isa`.
        unsafe fn $slices<$($T: Copy,)+ U, F: Fn($($T),+) -> U>(
            isa: Isa,
            f: &F,
            ($($s,)+): ($(&[$T],)+),
            dst: &mut [U],
        ) {
            let count = dst.len()$(.min($s.len()))+;
            let ctx = (f, ($($s.as_ptr(),)+));
            // SAFETY: `ctx` is the closure and the inputs' runs of `count` elements
            // each; the output is a `&mut` slice, so apart from the inputs; the
            // caller's contract for `isa`.
            unsafe {
                crate::isa::copy_for::<$ptrs<$($T,)+ U, F>>(isa)(
                    std::ptr::from_ref(&ctx).cast(),
                    std::ptr::null(),
                    dst.as_mut_ptr().cast(),
                    count,
                )
            }
        }

        /// The loop over raw runs, one copy per instruction set, `f` inlined into
        /// each: its context is the closure and the inputs' runs.
        struct $ptrs<$($T,)+ U, F>(PhantomData<fn($($T,)+ F) -> U>);

        impl<$($T: Copy,)+ U, F: Fn($($T),+) -> U> crate::isa::OwnedLoop for $ptrs<$($T,)+ U, F> {
            /// # Safety
            /// `ctx` points to an `(&F, (input runs))` whose runs hold `count` live,
            /// aligned elements each; `dst` holds `count` `U`s that overlap no input,
            /// and nothing else touches them meanwhile.
            #[inline(always)]
            unsafe fn run(ctx: *const (), _: *const u8, dst: *mut u8, count: usize) {
                // SAFETY: the caller's contract.
                let (f, dst, $($s,)+) = unsafe {
                    let (f, ($($s,)+)) = *ctx.cast::<(&F, ($(*const $T,)+))>();
                    (
                        f,
                        std::slice::from_raw_parts_mut(dst.cast::<U>(), count),
                        $(std::slice::from_raw_parts($s, count),)+
                    )
                };
                for i in 0..count {
                    dst[i] = f($($s[i]),+);
                }
            }
        }
    };
}

map_n! {
    /// The phase of a two-input elementwise kernel: work-item `i` (its global linear
    /// id) writes `f(a[i], b[i])` to its own element of `output`.
    ///
    /// ```
    /// # use gantry_driver::{Binding, NdRange};
    /// # use gantry_host::{multimap::map2_phase, Accessor, ElemAccessor, ClosureKernel, Arena, Read,
    /// #     DiscardWrite};
    /// let (x, y): (Vec<f32>, Vec<f32>) = ((0..1024).map(|i| i as f32).collect(), vec![0.5; 1024]);
    /// let mut out = vec![0f32; 1024];
    /// let (a, b) = (Accessor::<f32, Read>::new(0, 1, 1024), Accessor::<f32, Read>::new(1, 1, 1024));
    /// let o = ElemAccessor::<f32, DiscardWrite>::new(2, 1, 1024);
    /// let kernel = ClosureKernel {
    ///     tag: 1,
    ///     phases: smallvec::smallvec![map2_phase(a, b, o, |x: f32, y: f32| x * y)],
    ///     global_slots: 3,
    ///     scratch: vec![],
    ///     unfused: None,
    /// };
    /// let geometry = NdRange::new(1024, 256).geometry().unwrap();
    /// let globals = [
    ///     Binding::new(x.as_ptr() as *mut u8, 4096),
    ///     Binding::new(y.as_ptr() as *mut u8, 4096),
    ///     Binding::new(out.as_mut_ptr().cast(), 4096),
    /// ];
    /// for g in 0..geometry.group_count() {
    ///     kernel.run_group(&geometry, g, &globals, &mut Arena::default());
    /// }
    /// assert!(out.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.5));
    /// ```
    map2_phase, Map2Body, Map2Code, map2_slices, Map2Loop;
    A MA a sa, B MB b sb
}

map_n! {
    /// The phase of a three-input elementwise kernel: work-item `i` writes
    /// `f(a[i], b[i], c[i])` to its own element of `output` (see [`map2_phase`]).
    map3_phase, Map3Body, Map3Code, map3_slices, Map3Loop;
    A MA a sa, B MB b sb, C MC c sc
}

map_n! {
    /// The phase of a four-input elementwise kernel: work-item `i` writes
    /// `f(a[i], b[i], c[i], d[i])` to its own element of `output` (see [`map2_phase`]).
    map4_phase, Map4Body, Map4Code, map4_slices, Map4Loop;
    A MA a sa, B MB b sb, C MC c sc, D MD d sd
}
