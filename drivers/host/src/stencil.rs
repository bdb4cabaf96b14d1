//! Stencil kernels over a 2-D grid, `out[y][x] = f(neighbourhood of in[y][x])`: the
//! runtime owns the loop, as for [`map`](crate::elementwise), so the body runs
//! without a bounds check per access.
//!
//! # Contract
//!
//! * The grid is `rows × cols` elements, row-major, in the input's range and in the
//!   output's; work-item `(y, x)` writes `f(&n)` to output element `y * cols + x`,
//!   where `n` is the 3×3 [`Neighborhood`] of input element `(y, x)`.
//! * A neighbour outside the grid reads as the nearest cell inside it (clamped to the
//!   border), and [`Neighborhood::is_border`] tells the body it is at the border, so
//!   that fixed boundaries (`if n.is_border() { n.center() } else { .. }`) cost
//!   nothing inside.
//! * Interior cells of a work-group's row run as one loop over three contiguous rows
//!   of the input, with the body inlined, compiled for the widest instruction set the
//!   CPU has ([`isa`](crate::isa)): a neighbour is a load at a fixed offset from the
//!   cell, which the compiler vectorizes. Border cells read a 3×3 copy of their
//!   clamped neighbourhood.
//! * Groups of another shape (a kernel run under fusion's remapping, item by item, or
//!   over non-ordinary memory) run per work-item through the accessors, with the same
//!   results. Fusion refuses stencils
//!   ([`Unprofitable::Neighborhood`](gantry_driver::fusion::Unprofitable::Neighborhood)):
//!   a cell reads cells other work-groups write in a fused chain.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;

use crate::access::{Accessor, BufferSlot, ElemAccessor, Readable, Writable};
use crate::closure::Phase;
use crate::elementwise::contiguous;
use crate::isa::OwnedLoop;
use crate::item::{GroupCtx, Item};
use gantry_driver::Internal;

/// The 3×3 neighbourhood of one cell of a [stencil](crate::stencil) kernel's input,
/// which its body receives: [`Neighborhood::at`] reads a neighbour (clamped to the
/// grid at its border), [`Neighborhood::is_border`] tells whether the cell is on it.
pub struct Neighborhood<'a, T> {
    /// The cell: its neighbour `(dy, dx)` is at `center + dy * stride + dx`.
    center: *const T,
    /// Elements from one row to the next: the grid's width inside it, 3 in a border
    /// cell's copy of its neighbourhood.
    stride: isize,
    border: bool,
    y: usize,
    x: usize,
    _grid: PhantomData<&'a [T]>,
}

impl<'a, T: Pod> Neighborhood<'a, T> {
    /// An interior cell's neighbourhood, at `center` in rows of `stride` elements.
    ///
    /// # Safety
    /// Every element within one row and one column of `center` is live, initialized
    /// and not written while the neighbourhood lives.
    #[inline(always)]
    unsafe fn interior(center: *const T, stride: usize, y: usize, x: usize) -> Self {
        Self { center, stride: stride as isize, border: false, y, x, _grid: PhantomData }
    }

    /// A border cell's neighbourhood, from its clamped copy.
    #[inline(always)]
    fn gathered(copy: &'a [[T; 3]; 3], y: usize, x: usize) -> Self {
        Self { center: &copy[1][1], stride: 3, border: true, y, x, _grid: PhantomData }
    }

    /// The neighbour `dy` rows down and `dx` columns right (each -1, 0 or 1).
    ///
    /// # Panics
    /// If `dy` or `dx` is outside -1..=1 (with constant offsets the check is gone
    /// after compilation).
    #[inline(always)]
    pub fn at(&self, dy: isize, dx: isize) -> T {
        assert!(
            dy.unsigned_abs() <= 1 && dx.unsigned_abs() <= 1,
            "stencil neighbour ({dy}, {dx}) outside the 3×3 neighbourhood"
        );
        // SAFETY: within one row and one column of the center, which the constructors
        // guarantee to be readable for the neighbourhood's life.
        unsafe { self.center.offset(dy * self.stride + dx).read() }
    }

    /// The cell itself.
    #[inline(always)]
    pub fn center(&self) -> T {
        self.at(0, 0)
    }

    /// Whether the cell is in the first or last row or column, where some neighbours
    /// are clamped copies of cells inside.
    #[inline(always)]
    pub fn is_border(&self) -> bool {
        self.border
    }

    /// The cell's row and column.
    #[inline(always)]
    pub fn position(&self) -> (usize, usize) {
        (self.y, self.x)
    }
}

/// The clamped 3×3 neighbourhood of cell `(y, x)` of the `rows × cols` grid at `grid`.
fn gather<T: Pod>(grid: *const T, rows: usize, cols: usize, y: usize, x: usize) -> [[T; 3]; 3] {
    gather_with(rows, cols, y, x, |i| {
        // SAFETY: callers pass a grid of `rows * cols` live elements; `i` is inside.
        unsafe { grid.add(i).read() }
    })
}

/// The clamped 3×3 neighbourhood of cell `(y, x)`, element `i` of the grid read by
/// `read`.
#[inline]
fn gather_with<T: Pod>(
    rows: usize,
    cols: usize,
    y: usize,
    x: usize,
    read: impl Fn(usize) -> T,
) -> [[T; 3]; 3] {
    let clamp = |v: usize, d: usize, n: usize| (v + d).saturating_sub(1).min(n - 1);
    std::array::from_fn(|dy| std::array::from_fn(|dx| read(clamp(y, dy, rows) * cols + clamp(x, dx, cols))))
}

/// The code identity of a stencil phase, for the fusion cache.
struct StencilCode<T, U, F>(PhantomData<fn(T, F) -> U>);

/// The phase of a stencil kernel over a `rows × cols` grid (see the module's
/// contract): work-item `(y, x)` writes `f(&neighbourhood)` to its own element of
/// `output`. The kernel's range must be `[rows, cols]`, and `input` must hold the grid.
///
/// ```
/// # use gantry_driver::{Binding, Geometry, Range};
/// # use gantry_host::{stencil_phase, Accessor, Arena, ClosureKernel, DiscardWrite, ElemAccessor, Read};
/// let (rows, cols) = (4, 5);
/// let input: Vec<u32> = (0..20).collect();
/// let mut out = vec![0u32; 20];
/// let (a, o) = (Accessor::<u32, Read>::new(0, 1, 20), ElemAccessor::<u32, DiscardWrite>::new(1, 1, 20));
/// let phase = stencil_phase(a, o, [rows, cols], |n| if n.is_border() { 0 } else { n.at(-1, 0) + n.at(1, 0) });
/// let kernel = ClosureKernel { tag: 1, phases: smallvec::smallvec![phase], global_slots: 2, scratch: vec![], unfused: None };
/// let geometry = Geometry::for_range(Range::d2(rows, cols)).unwrap();
/// let globals = [Binding::new(input.as_ptr() as *mut u8, 80), Binding::new(out.as_mut_ptr().cast(), 80)];
/// for g in 0..geometry.group_count() {
///     kernel.run_group(&geometry, g, &globals, &mut Arena::default());
/// }
/// assert_eq!(out[6], 1 + 11);
/// assert_eq!(out[0], 0);
/// ```
pub fn stencil_phase<T, U, MI, MO, F>(
    input: Accessor<T, MI>,
    output: ElemAccessor<U, MO>,
    [rows, cols]: [usize; 2],
    f: F,
) -> Phase
where
    T: Pod,
    U: Pod,
    MI: Readable,
    MO: Writable,
    F: Fn(&Neighborhood<'_, T>) -> U + Send + Sync + 'static,
{
    let body = StencilBody { input, output, rows, cols, f: gantry_driver::contain::Contained::new(f) };
    Phase {
        group: Arc::new(move |ctx: &GroupCtx<'_>| body.group(ctx)),
        per_item: true,
        code: TypeId::of::<StencilCode<T, U, F>>(),
        elementwise: None,
        unprofitable: Some(crate::closure::SlowerFused::Neighborhood),
        runs: false,
    }
}

struct StencilBody<T, U, MI, MO, F> {
    input: Accessor<T, MI>,
    output: ElemAccessor<U, MO>,
    rows: usize,
    cols: usize,
    /// Dropped wherever its last command lets go of it: a panicking capture must not
    /// unwind there.
    f: gantry_driver::contain::Contained<F>,
}

impl<T, U, MI, MO, F> StencilBody<T, U, MI, MO, F>
where
    T: Pod,
    U: Pod,
    MI: Readable,
    MO: Writable,
    F: Fn(&Neighborhood<'_, T>) -> U,
{
    fn group(&self, ctx: &GroupCtx<'_>) {
        let (rows, cols, f) = (self.rows, self.cols, &*self.f);
        match self.ordinary(ctx) {
            // SAFETY: `ordinary` checked that `grid` holds the whole grid and `out`
            // the group's cells, both live ordinary memory. Nothing writes the input
            // while the kernel runs (the scheduler orders other writers; the kernel
            // writes only its output, which no other accessor of its command group
            // overlaps), and each work-item writes only its own output element.
            Some((grid, out)) => unsafe {
                let ([y0, x0, _], [ny, nx, _]) = (ctx.base(), ctx.extent());
                for y in y0..y0 + ny {
                    let row_out = out.add((y - y0) * cols);
                    run_row(f, grid, rows, cols, y, x0, nx, row_out);
                }
            },
            None => ctx.for_each_item(&|it: &mut Item<'_>| {
                let (y, x) = (it.global_id(0), it.global_id(1));
                let copy = gather_with(rows, cols, y, x, |i| self.input.get(it, i));
                let border = y == 0 || x == 0 || y + 1 == rows || x + 1 == cols;
                let n = Neighborhood { border, ..Neighborhood::gathered(&copy, y, x) };
                let v = f(&n);
                *self.output.elem(it) = v;
            }),
        }
    }

    /// The input grid and the output at the group's first cell, if the group runs on
    /// its own grid over ordinary memory that holds them.
    fn ordinary(&self, ctx: &GroupCtx<'_>) -> Option<(*const T, *mut U)> {
        let g = ctx.geometry.global_range();
        if ctx.remap.is_some() || ctx.only.is_some() || ctx.span.is_some() || g != [self.rows, self.cols, 1] {
            return None;
        }
        // The whole grid, in ordinary memory (a private or local region holds only a
        // group's cells).
        let cells = self.rows.checked_mul(self.cols)?;
        let grid = contiguous::<T>(ctx, &self.input, 0, 0, cells)
            .filter(|_| ctx.bindings[self.input.slot_and_tag().0 as usize].internal == Internal::No)?;
        // The group's rows are whole or it is one run of a row: either way its output
        // is one run from its first cell.
        let ([y0, x0, _], [ny, nx, _]) = (ctx.base(), ctx.extent());
        let count = if ny > 1 { (ny - 1) * self.cols + nx } else { nx };
        if ny > 1 && nx != self.cols {
            return None;
        }
        let out = contiguous::<U>(ctx, &self.output, y0 * self.cols + x0, 0, count)?;
        Some((grid.cast_const(), out))
    }
}

/// One row's cells `x0..x0 + nx` of row `y`: the border cells through their clamped
/// copies, the interior ones through the loop for the instruction set in use.
///
/// # Safety
/// `grid` holds the `rows × cols` grid and `out` the `nx` output cells, as in
/// [`StencilBody::group`].
#[allow(clippy::too_many_arguments)]
unsafe fn run_row<T: Pod, U, F: Fn(&Neighborhood<'_, T>) -> U>(
    f: &F,
    grid: *const T,
    rows: usize,
    cols: usize,
    y: usize,
    x0: usize,
    nx: usize,
    out: *mut U,
) {
    let border_cell = |x: usize| {
        let copy = gather(grid, rows, cols, y, x);
        // SAFETY: `x` is one of the row's cells, whose output the caller gives.
        unsafe { out.add(x - x0).write(f(&Neighborhood::gathered(&copy, y, x))) };
    };
    let end = x0 + nx;
    if y == 0 || y + 1 == rows {
        (x0..end).for_each(border_cell);
        return;
    }
    let (lo, hi) = (x0.max(1), end.min(cols - 1));
    if x0 == 0 {
        border_cell(0);
    }
    if lo < hi {
        let row = Row { f, cols, y, x: lo };
        // SAFETY: cells `lo..hi` of an interior row are interior: their neighbours are
        // in the grid; their outputs are the caller's. The active instruction set is
        // one the CPU runs.
        unsafe {
            crate::isa::copy_for::<Interior<T, U, F>>(crate::isa::active())(
                std::ptr::from_ref(&row).cast(),
                grid.add(y * cols + lo).cast(),
                out.add(lo - x0).cast(),
                hi - lo,
            )
        };
    }
    if end == cols && cols > 1 {
        border_cell(cols - 1);
    }
}

/// What the interior loop of one row takes besides its runs: the body, the grid's
/// width, and the row and column of its first cell.
struct Row<'f, F> {
    f: &'f F,
    cols: usize,
    y: usize,
    x: usize,
}

/// The loop over a row's interior cells, one copy per instruction set
/// ([`copy_for`](crate::isa::copy_for)), the body inlined into each: cell `k`'s center
/// is element `k` of the source run, its output element `k` of the destination.
struct Interior<T, U, F>(PhantomData<fn(T, F) -> U>);

impl<T: Pod, U, F: Fn(&Neighborhood<'_, T>) -> U> OwnedLoop for Interior<T, U, F> {
    /// # Safety
    /// `ctx` points to a `Row<F>`; every one of the `count` cells from `center` is
    /// interior to a grid of `cols` columns whose memory is live and unwritten during
    /// the call; `out` holds `count` `U`s that nothing else reads or writes meanwhile.
    #[inline(always)]
    unsafe fn run(ctx: *const (), center: *const u8, out: *mut u8, count: usize) {
        // SAFETY: the caller's contract.
        let (row, center, out) = unsafe {
            (
                &*ctx.cast::<Row<'_, F>>(),
                center.cast::<T>(),
                std::slice::from_raw_parts_mut(out.cast::<U>(), count),
            )
        };
        let (f, cols, y, x) = (row.f, row.cols, row.y, row.x);
        for (k, o) in out.iter_mut().enumerate() {
            // SAFETY: cell `k` is interior (the caller's contract).
            *o = f(&unsafe { Neighborhood::interior(center.add(k), cols, y, x + k) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{DiscardWrite, Read};
    use crate::closure::{Arena, ClosureKernel};
    use crate::isa::Isa;
    use gantry_driver::{Binding, Geometry, Range};

    /// The heat-diffusion step of the main job, with fixed borders.
    fn diffuse(n: &Neighborhood<'_, f32>) -> f32 {
        let c = n.center();
        if n.is_border() {
            return c;
        }
        c + 0.1 * (n.at(-1, 0) + n.at(1, 0) + n.at(0, -1) + n.at(0, 1) - 4.0 * c)
    }

    /// The same body over every neighbour, clamped, as a serial reference: it weighs
    /// all nine cells, so a wrong neighbour anywhere shows.
    fn weigh(n: &Neighborhood<'_, f32>) -> f32 {
        let mut s = 0.0;
        for dy in -1..=1isize {
            for dx in -1..=1isize {
                s += n.at(dy, dx) * (3 * (dy + 1) + dx + 2) as f32;
            }
        }
        s
    }

    fn grid(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 * 0.01).collect()
    }

    /// `f` of every cell's clamped neighbourhood, serially.
    fn reference(
        input: &[f32],
        rows: usize,
        cols: usize,
        f: impl Fn(&Neighborhood<'_, f32>) -> f32,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * cols);
        for y in 0..rows {
            for x in 0..cols {
                let copy = gather(input.as_ptr(), rows, cols, y, x);
                let border = y == 0 || x == 0 || y + 1 == rows || x + 1 == cols;
                out.push(f(&Neighborhood { border, ..Neighborhood::gathered(&copy, y, x) }));
            }
        }
        out
    }

    fn kernel(phase: Phase) -> ClosureKernel {
        ClosureKernel {
            tag: 3,
            phases: smallvec::smallvec![phase],
            global_slots: 2,
            scratch: vec![],
            unfused: None,
        }
    }

    fn run<F>(input: &[f32], rows: usize, cols: usize, f: F) -> Vec<f32>
    where
        F: Fn(&Neighborhood<'_, f32>) -> f32 + Send + Sync + 'static,
    {
        let n = rows * cols;
        let mut out = vec![f32::NAN; n];
        let (a, o) = (Accessor::<f32, Read>::new(0, 3, n), ElemAccessor::<f32, DiscardWrite>::new(1, 3, n));
        let k = kernel(stencil_phase(a, o, [rows, cols], f));
        let geometry = Geometry::for_range(Range::d2(rows, cols)).unwrap();
        let globals =
            [Binding::new(input.as_ptr() as *mut u8, n * 4), Binding::new(out.as_mut_ptr().cast(), n * 4)];
        let mut arena = Arena::default();
        for g in 0..geometry.group_count() {
            k.run_group(&geometry, g, &globals, &mut arena);
        }
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every cell, border and interior, gets `f` of its clamped neighbourhood, bit
    /// for bit: grids of one row or column, grids narrower than the neighbourhood,
    /// groups of whole rows with a partial last group, and rows longer than a group
    /// (each row split over several groups).
    #[test]
    fn every_cell_gets_its_clamped_neighbourhood() {
        for (rows, cols) in [(1, 1), (1, 6), (6, 1), (2, 2), (3, 3), (5, 7), (37, 130), (3, 9000)] {
            let input = grid(rows, cols);
            let geometry = Geometry::for_range(Range::d2(rows, cols)).unwrap();
            if cols == 9000 {
                assert!(geometry.local_range()[1] < cols, "a row over several groups");
            }
            assert_eq!(
                bits(&run(&input, rows, cols, diffuse)),
                bits(&reference(&input, rows, cols, diffuse))
            );
            assert_eq!(bits(&run(&input, rows, cols, weigh)), bits(&reference(&input, rows, cols, weigh)));
        }
    }

    /// Groups of a plain 2-D range over ordinary memory take the row loop, so the
    /// results above are the row loop's; a group run item by item, or an input that
    /// does not hold the grid, take the per-item path.
    #[test]
    fn plain_groups_take_the_row_loop() {
        for (rows, cols) in [(1, 1), (37, 130), (3, 9000)] {
            let n = rows * cols;
            let input = grid(rows, cols);
            let mut out = vec![0f32; n];
            let (a, o) =
                (Accessor::<f32, Read>::new(0, 3, n), ElemAccessor::<f32, DiscardWrite>::new(1, 3, n));
            let body = StencilBody {
                input: a,
                output: o,
                rows,
                cols,
                f: gantry_driver::contain::Contained::new(diffuse),
            };
            let geometry = Geometry::for_range(Range::d2(rows, cols)).unwrap();
            let globals = [
                Binding::new(input.as_ptr() as *mut u8, n * 4),
                Binding::new(out.as_mut_ptr().cast(), n * 4),
            ];
            let short = [Binding::new(input.as_ptr() as *mut u8, n * 4 - 4), globals[1]];
            for g in 0..geometry.group_count() {
                let ctx = GroupCtx::new(&geometry, geometry.group_id(g), &globals, &[], 3);
                assert!(body.ordinary(&ctx).is_some(), "{rows} × {cols}, group {g}");
                let one = GroupCtx {
                    only: Some([0, 0, 0]),
                    ..GroupCtx::new(&geometry, geometry.group_id(g), &globals, &[], 3)
                };
                assert!(body.ordinary(&one).is_none());
                assert!(body
                    .ordinary(&GroupCtx::new(&geometry, geometry.group_id(g), &short, &[], 3))
                    .is_none());
            }
        }
    }

    /// Every instruction set's copy of the interior loop gives the baseline's results
    /// bit for bit (no contraction into fused multiply-adds), with and without a
    /// vector tail.
    #[test]
    fn every_instruction_set_runs_the_interior_bit_for_bit() {
        let (rows, cols) = (3, 70);
        let input = grid(rows, cols);
        for count in [1usize, 7, 16, 17, 31, 68] {
            let row = |isa: Isa| {
                let mut out = vec![0f32; count];
                type Body = fn(&Neighborhood<'_, f32>) -> f32;
                let ctx = Row { f: &(diffuse as Body), cols, y: 1, x: 1 };
                // SAFETY: cells 1..=count of row 1 are interior to the 3 × 70 grid; the
                // tests only name instruction sets the CPU runs.
                unsafe {
                    crate::isa::copy_for::<Interior<f32, f32, Body>>(isa)(
                        std::ptr::from_ref(&ctx).cast(),
                        input.as_ptr().add(cols + 1).cast(),
                        out.as_mut_ptr().cast(),
                        count,
                    )
                };
                bits(&out)
            };
            let want = bits(&reference(&input, rows, cols, diffuse)[cols + 1..cols + 1 + count]);
            for isa in [Isa::Baseline, Isa::Avx2, Isa::Avx512] {
                if isa <= Isa::detected() {
                    assert_eq!(row(isa), want, "{isa}, {count} cells");
                }
            }
        }
    }

    /// A group run one work-item at a time (fusion's way) takes the per-item path,
    /// through the accessors, with the same results.
    #[test]
    fn one_work_item_at_a_time_matches() {
        let (rows, cols) = (4, 6);
        let n = rows * cols;
        let input = grid(rows, cols);
        let mut out = vec![f32::NAN; n];
        let (a, o) = (Accessor::<f32, Read>::new(0, 3, n), ElemAccessor::<f32, DiscardWrite>::new(1, 3, n));
        let phase = stencil_phase(a, o, [rows, cols], weigh);
        let geometry = Geometry::for_range(Range::d2(rows, cols)).unwrap();
        assert_eq!(geometry.group_count(), 1);
        let globals =
            [Binding::new(input.as_ptr() as *mut u8, n * 4), Binding::new(out.as_mut_ptr().cast(), n * 4)];
        for y in 0..rows {
            for x in 0..cols {
                let ctx = GroupCtx {
                    only: Some([y, x, 0]),
                    ..GroupCtx::new(&geometry, [0, 0, 0], &globals, &[], 3)
                };
                (phase.group)(&ctx);
            }
        }
        assert_eq!(bits(&out), bits(&reference(&input, rows, cols, weigh)));
    }

    /// A neighbour outside the 3×3 neighbourhood is refused where it is asked for, on
    /// the interior loop's path and on the border's.
    #[test]
    fn a_neighbour_past_the_neighbourhood_panics() {
        let input = grid(5, 5);
        for (dy, dx) in [(2isize, 0isize), (0, -2)] {
            let r = std::panic::catch_unwind(|| run(&input, 5, 5, move |n| n.at(dy, dx)));
            let message = r.expect_err("out of the neighbourhood");
            let message = gantry_driver::panic_message(&*message);
            assert!(message.contains("outside the 3×3 neighbourhood"), "{message}");
        }
    }

    /// Fusion refuses the phase with its typed reason.
    #[test]
    fn fusion_is_refused_with_its_reason() {
        let (a, o) = (Accessor::<f32, Read>::new(0, 3, 4), ElemAccessor::<f32, DiscardWrite>::new(1, 3, 4));
        let phase = stencil_phase(a, o, [2, 2], diffuse);
        assert_eq!(phase.unprofitable, Some(crate::closure::SlowerFused::Neighborhood));
    }
}
