//! Property tests of `IrFusion` (issue #26, item 6): random chains of kernels from a
//! small menu, fused, run with the host compiler, against the same kernels run
//! unfused in order.
//!
//! A case ([`Case`]) is a grid (1..=3 work-groups of 64, or a plain range of 1, 1000
//! or 4099 work-items), a pool of 3..=6 buffers of `2 n` floats, a chain of 1..=6
//! kernels whose slots are drawn from the pool (so identical arguments, in-place
//! kernels, read-after-write and write-after-read all happen), each slot on the
//! lower or upper half of its buffer (a *view*), random scalar constants, optional
//! promotion hints, and the `barriers` flag.
//!
//! The property: [`IrFusion::fuse`] either refuses with a typed geometry reason (then
//! there is nothing to run), or its fused kernel leaves every buffer bit-identical to
//! the kernels run unfused (NaNs compared as NaNs), except the internalized buffers,
//! which it must not write at all; and every buffer with a hint is either
//! internalized or named by a warning, never both.
//!
//! The cases stay within what fusion promises (the DPC++ kernel-fusion design): a
//! promotion hint is a promise that the buffer's data flows only within a work-item
//! (private) or work-group (local) and is first written in the chain, and
//! `barriers: false` a promise that no work-item reads what another one writes.
//! [`Case::normalize`] makes every drawn case keep those promises (it drops hints
//! that would break them, asks for barriers where a kernel reads a neighbour's
//! element of data another kernel writes, and keeps `shift` from a remapped launch,
//! where its group-relative reads mean another thing); the compiler, not the test,
//! decides which hints it can follow.
//!
//! The menu is compiled once, with `FP_CONTRACT OFF` so every result is exact.
//! `GANTRY_PROPTEST_CASES=N` runs `N` cases instead of 64 (the proptests crate's
//! convention); the counts of fused, refused, internalized and elided are printed
//! (`--nocapture`).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::LazyLock;

use gantry_driver::fusion::{
    FusionArg, FusionCompiler, FusionError, FusionKernel, FusionRequest, FusionWarning, Promotion,
};
use gantry_driver::{
    AccessMode, Geometry, ImageKind, Kernel, KernelRef, NdRange, Range, ScratchKind, Signature,
};
use gantry_jit::{HostCompiler, HostLaunch, IrFusion};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

/// The menu. One translation unit, compiled once; exact arithmetic.
const MENU: &str = "#pragma OPENCL FP_CONTRACT OFF
kernel void axpb(global const float* in, global float* out, float a, float b) {
    size_t i = get_global_id(0);
    out[i] = a * in[i] + b;
}
kernel void add(global const float* x, global const float* y, global float* out) {
    size_t i = get_global_id(0);
    out[i] = x[i] + y[i];
}
kernel void square(global const float* in, global float* out) {
    size_t i = get_global_id(0);
    out[i] = in[i] * in[i];
}
/* The next work-item's element within the work-group (its own at the end of the
   group or of the range): needs the barrier after a kernel that wrote `in`. */
kernel void shift(global const float* in, global float* out) {
    size_t i = get_global_id(0);
    size_t j = get_local_id(0) + 1 < get_local_size(0) && i + 1 < get_global_size(0) ? i + 1 : i;
    out[i] = in[j];
}
kernel void inc(global float* x) {
    x[get_global_id(0)] += 1.0f;
}
/* Reverses each work-group's elements through local memory, with a barrier of its own. */
kernel void rev(global const float* in, global float* out, local float* tmp) {
    size_t l = get_local_id(0), n = get_local_size(0), i = get_global_id(0);
    tmp[l] = in[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    out[i] = tmp[n - 1 - l];
}
/* A 2-D kernel (its own linear element), remapped into a 1-D grid. */
kernel void grid2(global const float* in, global float* out) {
    size_t x = get_global_id(0), y = get_global_id(1), w = get_global_size(0);
    size_t i = y * w + x;
    out[i] = in[i] * 0.5f + (float)x - (float)y;
}
";

/// The work-group size of the nd-range grids.
const GROUP: usize = 64;

/// How a kernel's slot touches its view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// Reads its own element.
    Read,
    /// Reads a neighbour's element (in its work-group).
    ReadNeighbour,
    /// Writes its own element (reads nothing).
    Write,
    /// Reads, then writes, its own element.
    ReadWrite,
}

impl Access {
    fn reads(self) -> bool {
        self != Access::Write
    }
    fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Axpb,
    Add,
    Square,
    Shift,
    Inc,
    Rev,
    Grid2,
}

impl Op {
    const ALL: [Op; 7] = [Op::Axpb, Op::Add, Op::Square, Op::Shift, Op::Inc, Op::Rev, Op::Grid2];

    fn name(self) -> &'static str {
        match self {
            Op::Axpb => "axpb",
            Op::Add => "add",
            Op::Square => "square",
            Op::Shift => "shift",
            Op::Inc => "inc",
            Op::Rev => "rev",
            Op::Grid2 => "grid2",
        }
    }

    fn slots(self) -> &'static [Access] {
        use Access::*;
        match self {
            Op::Axpb | Op::Square | Op::Rev | Op::Grid2 => &[Read, Write],
            Op::Add => &[Read, Read, Write],
            Op::Shift => &[ReadNeighbour, Write],
            Op::Inc => &[ReadWrite],
        }
    }

    fn scalars(self) -> usize {
        if self == Op::Axpb {
            2
        } else {
            0
        }
    }

    /// Whether it needs an nd-range (its local memory is one work-group's).
    fn needs_groups(self) -> bool {
        self == Op::Rev
    }

    fn signature(self) -> Signature {
        let mut sig = Signature::new();
        for a in self.slots() {
            sig = sig.global(match a {
                Access::Read | Access::ReadNeighbour => AccessMode::Read,
                Access::Write => AccessMode::Write,
                Access::ReadWrite => AccessMode::ReadWrite,
            });
        }
        for _ in 0..self.scalars() {
            sig = sig.scalar::<f32>();
        }
        if self == Op::Rev {
            sig = sig.local(GROUP * 4);
        }
        sig
    }
}

/// The menu's kernels, compiled once (clang is slow).
static KERNELS: LazyLock<Vec<KernelRef>> = LazyLock::new(|| {
    let bitcode = gantry_jit_clang::compile_opencl(MENU).unwrap_or_else(|e| panic!("{e}"));
    Op::ALL
        .iter()
        .map(|op| {
            let image = gantry_jit::from_llvm_ir(&bitcode, op.name()).unwrap_or_else(|e| panic!("{e}"));
            Kernel::new(op.name(), op.signature()).with_image(image).into_ref()
        })
        .collect()
});

/// One host compiler for every case: the unfused kernels compile once.
static HOST: LazyLock<HostCompiler> = LazyLock::new(HostCompiler::new);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grid {
    /// `groups` work-groups of [`GROUP`].
    Nd(usize),
    /// A plain range (driver-chosen groups; 4099 has a partial last one).
    Plain(usize),
}

impl Grid {
    fn n(self) -> usize {
        match self {
            Grid::Nd(groups) => groups * GROUP,
            Grid::Plain(n) => n,
        }
    }

    /// The geometry a kernel `op` of the chain runs over: the grid's, or for
    /// `grid2` a plain 2-D range of the same work-items.
    fn geometry(self, op: Op) -> Geometry {
        let n = self.n();
        if op == Op::Grid2 {
            let cols = [40, 16, 1].into_iter().find(|c| n.is_multiple_of(*c)).unwrap();
            return Geometry::for_range(Range::d2(n / cols, cols)).unwrap();
        }
        match self {
            Grid::Nd(_) => NdRange::new(n, GROUP).geometry().unwrap(),
            Grid::Plain(_) => Geometry::for_range(Range::d1(n)).unwrap(),
        }
    }
}

/// A kernel's slot: a buffer of the pool, which half of it, and its hint.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Slot {
    buffer: usize,
    upper: bool,
    hint: Promotion,
}

impl Slot {
    fn region(&self) -> (usize, bool) {
        (self.buffer, self.upper)
    }
}

#[derive(Clone, PartialEq)]
struct Step {
    op: Op,
    slots: Vec<Slot>,
    scalars: Vec<f32>,
}

/// A drawn case, after [`Case::normalize`]. Its `Debug` is the chain, one kernel a
/// line: `k2 shift(b0^!L, b1)` is kernel 2, `shift` reading the upper half (`^`) of
/// buffer 0 with a local hint (`!L`; `!P` private) and writing buffer 1's lower half.
#[derive(Clone, PartialEq)]
struct Case {
    grid: Grid,
    buffers: usize,
    barriers: bool,
    steps: Vec<Step>,
    /// What `normalize` changed, for the failure message.
    notes: Vec<String>,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let grid = match self.grid {
            Grid::Nd(g) => format!("nd({}, {GROUP})", g * GROUP),
            Grid::Plain(n) => format!("range({n})"),
        };
        writeln!(
            f,
            "{grid}, barriers: {}, {} buffers of 2x{} floats:",
            self.barriers,
            self.buffers,
            self.grid.n()
        )?;
        for (k, s) in self.steps.iter().enumerate() {
            let slots: Vec<String> = s
                .slots
                .iter()
                .map(|sl| {
                    let hint = match sl.hint {
                        Promotion::None => "",
                        Promotion::Local => "!L",
                        Promotion::Private => "!P",
                    };
                    format!("b{}{}{hint}", sl.buffer, if sl.upper { "^" } else { "" })
                })
                .collect();
            let scalars: Vec<String> = s.scalars.iter().map(|v| format!("{v}")).collect();
            let sep = if scalars.is_empty() { "" } else { "; " };
            writeln!(f, "  k{k} {}({}{sep}{})", s.op.name(), slots.join(", "), scalars.join(", "))?;
        }
        for n in &self.notes {
            writeln!(f, "  (normalized: {n})")?;
        }
        Ok(())
    }
}

impl Case {
    /// Makes the case keep fusion's promises (see the module docs):
    ///
    /// 1. `shift` never reads and writes one view (a race even unfused);
    /// 2. `shift` never runs remapped (a plain grid whose first kernel is `grid2`
    ///    is `grid2`'s 2-D range): its reads are relative to its own work-groups,
    ///    which remapping replaces by the grid's; it becomes `square`;
    /// 3. `barriers` is on where a `shift` reads a view another kernel writes;
    /// 4. a buffer whose hints all agree (and so could be followed) keeps them only
    ///    if each work-item's (private) or work-group's (local) data stays its own:
    ///    the first kernel that touches it only writes it, and no kernel reads a
    ///    neighbour's element of it unless local memory and barriers make that
    ///    right. Disagreeing hints stay (the compiler must drop them).
    fn normalize(mut self) -> Self {
        let nbuf = self.buffers;
        for s in &mut self.steps {
            if s.op == Op::Shift && s.slots[0].region() == s.slots[1].region() {
                s.slots[1].buffer = (s.slots[1].buffer + 1) % nbuf;
            }
        }
        if matches!(self.grid, Grid::Plain(_)) && self.steps[0].op == Op::Grid2 {
            for (k, s) in self.steps.iter_mut().enumerate() {
                if s.op == Op::Shift {
                    s.op = Op::Square;
                    self.notes.push(format!("k{k} shift -> square: it would run remapped"));
                }
            }
        }
        let writes = |case: &Case, region: (usize, bool), except: usize| {
            case.steps.iter().enumerate().any(|(k, s)| {
                k != except
                    && s.op.slots().iter().zip(&s.slots).any(|(a, sl)| a.writes() && sl.region() == region)
            })
        };
        if !self.barriers {
            let needed = self.steps.iter().enumerate().any(|(k, s)| {
                s.op.slots()
                    .iter()
                    .zip(&s.slots)
                    .any(|(a, sl)| *a == Access::ReadNeighbour && writes(&self, sl.region(), k))
            });
            if needed {
                self.barriers = true;
                self.notes.push("barriers on: a shift reads what another kernel writes".into());
            }
        }
        for b in 0..nbuf {
            let on_b: Vec<(usize, Access, Slot)> = self
                .steps
                .iter()
                .enumerate()
                .flat_map(|(k, s)| s.op.slots().iter().zip(&s.slots).map(move |(a, sl)| (k, *a, *sl)))
                .filter(|(_, _, sl)| sl.buffer == b)
                .collect();
            let Some(&(first, _, first_slot)) = on_b.first() else { continue };
            let kind = first_slot.hint;
            let agree = kind != Promotion::None
                && on_b.iter().all(|(_, _, sl)| sl.hint == kind && sl.upper == first_slot.upper);
            if !agree {
                continue;
            }
            let written_first = on_b.iter().filter(|(k, ..)| *k == first).all(|(_, a, _)| !a.reads());
            let neighbours = on_b.iter().any(|(_, a, _)| *a == Access::ReadNeighbour);
            let keeps = written_first && (!neighbours || (kind == Promotion::Local && self.barriers));
            if !keeps {
                for s in &mut self.steps {
                    for sl in s.slots.iter_mut().filter(|sl| sl.buffer == b) {
                        sl.hint = Promotion::None;
                    }
                }
                self.notes.push(format!("b{b}'s hints dropped: its data is not the work-item's/group's own"));
            }
        }
        self
    }

    fn request(&self) -> FusionRequest {
        let n = self.grid.n();
        let kernels = self
            .steps
            .iter()
            .map(|s| FusionKernel {
                kernel: KERNELS[s.op as usize].clone(),
                geometry: self.grid.geometry(s.op),
                args: s
                    .slots
                    .iter()
                    .map(|sl| {
                        let start = if sl.upper { n * 4 } else { 0 };
                        FusionArg::new(sl.buffer as u64, start..start + n * 4, 4).promoted(sl.hint)
                    })
                    .collect(),
                scalars: s.scalars.iter().flat_map(|v| v.to_ne_bytes()).collect(),
                deps: Default::default(),
            })
            .collect();
        FusionRequest { kernels, barriers: self.barriers }
    }
}

/// A slot as drawn: a buffer index (modulo the pool), the upper half (rarely), and
/// whether it deviates from its buffer's hint (rarely: none, or the other kind).
fn raw_slot() -> impl Strategy<Value = (usize, bool, u8)> {
    (0..6usize, prop::bool::weighted(0.2), prop_oneof![18 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)])
}

fn case() -> impl Strategy<Value = Case> {
    let grid = prop_oneof![
        (1..=3usize).prop_map(Grid::Nd),
        Just(Grid::Plain(1000)),
        Just(Grid::Plain(4099)),
        Just(Grid::Plain(1))
    ];
    let hint =
        prop_oneof![3 => Just(Promotion::None), 2 => Just(Promotion::Private), 2 => Just(Promotion::Local)];
    let step = (0..Op::ALL.len(), vec(raw_slot(), 3), vec(-16i8..=16, 2));
    (grid, 3..=6usize, any::<bool>(), vec(hint, 6), vec(step, 1..=6)).prop_map(
        |(grid, buffers, barriers, hints, steps)| {
            let menu: Vec<Op> =
                Op::ALL.into_iter().filter(|op| !op.needs_groups() || matches!(grid, Grid::Nd(_))).collect();
            let steps = steps
                .into_iter()
                .map(|(op, slots, scalars)| {
                    let op = menu[op % menu.len()];
                    let slots = op
                        .slots()
                        .iter()
                        .zip(slots)
                        .map(|(_, (buffer, upper, deviate))| {
                            let buffer = buffer % buffers;
                            let hint = match (deviate, hints[buffer]) {
                                (0, h) => h,
                                (1, _) => Promotion::None,
                                (_, Promotion::Local) => Promotion::Private,
                                (_, _) => Promotion::Local,
                            };
                            Slot { buffer, upper, hint }
                        })
                        .collect();
                    let scalars = scalars[..op.scalars()].iter().map(|&v| v as f32 / 4.0).collect();
                    Step { op, slots, scalars }
                })
                .collect();
            Case { grid, buffers, barriers, steps, notes: Vec::new() }.normalize()
        },
    )
}

type Buffers = HashMap<u64, Vec<f32>>;

fn run(kernel: &KernelRef, geometry: &Geometry, globals: &[*mut u8], scalars: &[u8]) {
    let sig = &kernel.signature;
    let compiled =
        HOST.compile(kernel.image(ImageKind::LlvmIr).unwrap(), sig).unwrap_or_else(|e| panic!("{e}"));
    let mut local: Vec<Vec<u128>> = sig
        .memory
        .iter()
        .filter(|s| s.kind == ScratchKind::Local)
        .map(|s| vec![0u128; s.bytes.div_ceil(16).max(1)])
        .collect();
    let local_ptrs: Vec<*mut u8> = local.iter_mut().map(|l| l.as_mut_ptr().cast()).collect();
    let launch = HostLaunch::from_geometry(geometry, globals, scalars, &local_ptrs);
    // SAFETY: every global points at a view of `n` floats of a live buffer of `2 n`,
    // which the menu's kernels index within; the locals hold their slots' bytes.
    unsafe { compiled.run_groups(&launch, 0, launch.group_count()).unwrap() };
}

fn at(bufs: &mut Buffers, buffer: u64, start: usize) -> *mut u8 {
    let b = bufs.get_mut(&buffer).expect("a buffer of the pool");
    assert!(start < b.len() * 4);
    // SAFETY: within the buffer (checked above).
    unsafe { b.as_mut_ptr().cast::<u8>().add(start) }
}

/// Bit-identical, except that any NaN equals any NaN (a NaN's payload may depend on
/// operand order, which the optimizer may commute).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Counts over the run (printed).
#[derive(Default)]
struct Counts {
    cases: AtomicUsize,
    fused: AtomicUsize,
    refused: AtomicUsize,
    internalized: AtomicUsize,
    warned: AtomicUsize,
    barriers: AtomicUsize,
    elided: AtomicUsize,
}

fn check(case: &Case, counts: &Counts) -> Result<(), TestCaseError> {
    counts.cases.fetch_add(1, Ordering::Relaxed);
    let request = case.request();
    let fusion = IrFusion::new();
    let fused = match fusion.fuse(&request) {
        Ok(f) => f,
        Err(e @ FusionError::Code { .. }) => {
            // Every kernel of the menu is translatable: a code error is a fusion bug
            // (an invalid fused module, an access it could not rewrite).
            return Err(TestCaseError::fail(format!("fusion failed: {e}")));
        }
        Err(_) => {
            counts.refused.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
    };
    counts.fused.fetch_add(1, Ordering::Relaxed);
    counts.internalized.fetch_add(fused.internal.len(), Ordering::Relaxed);
    counts.warned.fetch_add(fused.warnings.len(), Ordering::Relaxed);
    if case.barriers {
        counts.barriers.fetch_add(case.steps.len() - 1, Ordering::Relaxed);
    }
    if let Some(t) = fusion.last_timings() {
        counts.elided.fetch_add(t.barriers_elided, Ordering::Relaxed);
    }

    // Every hinted buffer is internalized or warned about, never both; a buffer no
    // slot hints is never internalized.
    for b in 0..case.buffers as u64 {
        let hinted = request
            .kernels
            .iter()
            .flat_map(|k| &k.args)
            .any(|a| a.buffer == b && a.promotion != Promotion::None);
        let internal = fused.internal.iter().any(|i| i.buffer == b);
        let warned = fused
            .warnings
            .iter()
            .any(|w| matches!(w, FusionWarning::PromotionDropped { buffer, .. } if *buffer == b));
        prop_assert!(
            if hinted { internal != warned } else { !internal && !warned },
            "b{b}: hinted {hinted}, internalized {internal}, warned {warned}: {:?}",
            fused.warnings
        );
    }

    let n = case.grid.n();
    let initial: Buffers = (0..case.buffers as u64)
        .map(|b| {
            let v = (0..2 * n)
                .map(|i| {
                    ((i as u32).wrapping_mul(2654435761).wrapping_add(b as u32 * 7919) % 1000) as f32 / 100.0
                        - 5.0
                })
                .collect();
            (b, v)
        })
        .collect();
    let mut unfused = initial.clone();
    for k in &request.kernels {
        let globals: Vec<*mut u8> = k.args.iter().map(|a| at(&mut unfused, a.buffer, a.start)).collect();
        run(&k.kernel, &k.geometry, &globals, &k.scalars);
    }
    let mut out = initial.clone();
    prop_assert!(fused.scalars.is_empty() && fused.kernel.signature.scalars.is_empty());
    let globals: Vec<*mut u8> = fused.args.iter().map(|a| at(&mut out, a.buffer, a.start)).collect();
    run(&fused.kernel, &fused.geometry, &globals, &[]);

    for b in 0..case.buffers as u64 {
        let internal = fused.internal.iter().find(|i| i.buffer == b);
        let (want, what) = match internal {
            Some(i) => (
                &initial[&b],
                format!("internalized ({:?}) b{b}, which the fused kernel must not write", i.kind),
            ),
            None => (&unfused[&b], format!("b{b}")),
        };
        let got = &out[&b];
        let bad: Vec<usize> = (0..2 * n).filter(|&i| !same(got[i], want[i])).collect();
        if let Some(&i) = bad.first() {
            return Err(TestCaseError::fail(format!(
                "{what}: {} of {} elements differ; first at [{i}]: fused {} vs expected {} (fused kernel `{}`, {} \
                 barrier(s) elided)",
                bad.len(),
                2 * n,
                got[i],
                want[i],
                fused.kernel.name,
                fusion.last_timings().map_or(0, |t| t.barriers_elided),
            )));
        }
    }
    Ok(())
}

/// `GANTRY_PROPTEST_CASES` if set, else `default` (the proptests crate's variable).
fn cases(default: u32) -> u32 {
    std::env::var("GANTRY_PROPTEST_CASES").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// Random chains fused equal them unfused (see the module docs).
#[test]
fn fused_chains_equal_unfused_chains() {
    LazyLock::force(&KERNELS);
    let config = ProptestConfig {
        cases: cases(64),
        failure_persistence: None,
        max_shrink_iters: 2048,
        ..ProptestConfig::default()
    };
    let counts = Counts::default();
    let result = TestRunner::new(config).run(&case(), |c| check(&c, &counts));
    let c = |a: &AtomicUsize| a.load(Ordering::Relaxed);
    println!(
        "{} cases: {} fused, {} refused (geometry); {} buffers internalized, {} hints dropped with a warning; \
         {} barriers asked for, {} elided",
        c(&counts.cases),
        c(&counts.fused),
        c(&counts.refused),
        c(&counts.internalized),
        c(&counts.warned),
        c(&counts.barriers),
        c(&counts.elided),
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}
