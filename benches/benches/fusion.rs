//! Queue-level kernel fusion on the CPU driver: a chain of K elementwise kernels
//! (`tmp[i + 1][j] = step(tmp[i][j])`, `step(x) = x * 1.0001 + 0.5`) run these ways:
//!
//! * `hand_loop`: one serial Rust loop over the input applying `step` K times per
//!   element (the baseline a user would write by hand, measured in the same run);
//! * `hand_loop_parallel` (`threaded` set only): the same loop split over rayon's
//!   default pool (one thread per core, as many as the CPU driver's default workers)
//!   in chunks of 64K elements: the baseline for a multi-threaded runtime;
//! * `unfused`: K kernels submitted normally, then a wait on the last one;
//! * `fused`: `start_fusion`, the K kernels, `complete_fusion` (with barriers, the
//!   default), a wait on the fusion's event; the intermediate buffers stay in global
//!   memory. The eager `fused*` variants run the window as a user's would: where the
//!   CPU driver's `WindowThresholds` judge that fusing does not pay (a launch-bound
//!   first kernel; global intermediates the caches hold), the window runs its
//!   kernels as they are submitted, and the setup checks that reason instead;
//! * `fused_private`: the same with every intermediate buffer promoted to private
//!   memory, so the fused kernel only reads the input and writes the output;
//! * `fused_private_no_barriers`: `fused_private` fused without barriers
//!   (`FusionProps { barriers: false }`);
//! * `unfused_per_item`: `unfused` with per-work-item closures instead of elementwise
//!   kernels (see below);
//! * `fused_private_per_item`: `fused_private` with per-work-item closures. The fusion
//!   compiler refuses it (`Unprofitable::MappedAccess`, checked at setup), so it
//!   measures the refusal: the kernels run unfused, as `unfused_per_item`;
//! * `graph_unfused`, `graph_fused`, `graph_fused_private`: the K kernels recorded
//!   once into a command graph (as a frame is), finalized without fusion, with
//!   fusion (`GraphProps::fused`), and with fusion and the intermediates promoted to
//!   private memory; each round submits the graph and waits for it. A replay has no
//!   fusion window: the chain was fused once, at finalize. Where the CPU driver's
//!   thresholds judge the recorded chain not worth fusing (`judge_chain`: global
//!   intermediates whose whole chain the caches hold), `graph_fused` runs it
//!   unfused, and the setup checks that reason instead.
//!
//! Kernels are elementwise kernels, `cg.map(&input, &output, step)` over `cg.read`
//! and `cg.elements_out` accessors: the runtime owns the loop and runs each
//! work-group as one loop over contiguous memory (private memory of one element per
//! work-item included), which the compiler vectorizes. The per-item variants write
//! the same kernels as `cg.parallel_for(n, |it| *o.elem(it) = step(a.get(it, id)))`:
//! the closure is inlined into its group's loop, with a bounds check per access,
//! which is not vectorized; fused, every access to internalized memory would take
//! the `i % n` mapping out of line (before the compiler refused it, a fused chain
//! of 4 such kernels over 16M elements took 20x the unfused chain's time).
//!
//! The hand loops are compiled for the binary's target (SSE2 on a default x86-64
//! build); Gantry's elementwise loops run the widest instruction set the CPU has
//! (`gantry::isa`). `GANTRY_CPU_ISA=baseline` compares the two at the hand loop's
//! instruction set.
//!
//! The runtimes are built with `preserve_on_failure(false)`, as the hand loop keeps
//! no copy to restore on failure either (with it, each kernel first copies the
//! range it writes: 64 MiB per kernel at 16M).
//!
//! Sizes: 4,096 elements (one launch of one work-group: launch-bound), 64K, and 16M
//! (`1 << 24`, 64 MiB per buffer: memory-bound), K = 2, 4, 8. Two runtime sets, every
//! Gantry variant of a set on the same runtime:
//! * `inline`: manual mode, `worker_threads(0)` (everything on the benchmark thread,
//!   single-threaded like the hand loop);
//! * `threaded`: a scheduler thread and the default worker threads (one per core).
//!
//! Ids: `fusion_chain/{set}/{size}/K{k}/{variant}`; throughput is elements per second.
//! The `threaded` 16M cases run only with `GANTRY_BENCH_FUSION_THREADED_16M=1`: the
//! per-item variant is by far the slowest (figures: `docs/PERFORMANCE.md`), so the 16M
//! chains would take most of the run's time, and the inline set already covers that
//! size. (A full run takes about three minutes on 2 cores, most of it the 16M
//! per-item chains; `-- --quick` about one.)
//!
//! `fusion_overhead/{set}/fused` times one round of a tiny chain (2 kernels of one
//! work-item) with `start_fusion` + submits + `complete_fusion` + wait, fused whatever
//! its size (`fusion_window(WindowThresholds::ALWAYS)`), the plan coming from the
//! fusion cache (checked at setup: the second round is `Fused { cached: true, .. }`,
//! and after the benchmark every round after the first was a cache hit);
//! `fusion_overhead/{set}/passed_through` is the same round on the CPU driver's
//! thresholds, which run the window's kernels as they are submitted (checked:
//! `LaunchBound`, the compiler never asked); `fusion_overhead/{set}/unfused_overhead`
//! is the same two kernels submitted unfused and waited for. Their difference is the host cost of fusing,
//! which `fusion_overhead/inline/fused_minus_unfused` measures directly: each
//! iteration is a fused round's time minus an unfused round's, the two run in
//! alternating blocks of 64 (separate benchmarks, seconds apart, see different
//! machines on a shared VM).
//!
//! Every variant's output is checked once at setup, bit for bit, against a plain
//! serial loop, so no benchmark measures a broken path; `fused_private` also checks
//! that its intermediate buffers were not written back. After each benchmark no
//! command may be left alive, and every fused round must have reached the fusion
//! compiler (cache hits + misses = fused rounds: none ran unfused).

use std::cell::Cell;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use gantry::{
    Buffer, CancelReason, Event, ExecutableGraph, FusionError, FusionOutcome, FusionProps, GraphProps, Mode,
    NotFused, Promotion, Queue, Runtime, RuntimeBuilder, Unprofitable, WindowThresholds,
};

/// Launch-bound size: elements per buffer.
const SMALL: usize = 4096;
/// A size in between (256 KiB of `f32` per buffer: the chain stays in L2).
const MEDIUM: usize = 1 << 16;
/// Memory-bound size: elements per buffer (64 MiB of `f32`).
const LARGE: usize = 1 << 24;
/// Chain lengths.
const CHAINS: [usize; 3] = [2, 4, 8];

/// One kernel's arithmetic.
#[inline(always)]
fn step(x: f32) -> f32 {
    x * 1.0001 + 0.5
}

/// The hand-written baseline: `out[j] = step^K(input[j])` in one serial pass.
fn hand_loop_k<const K: usize>(input: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(input) {
        let mut v = x;
        for _ in 0..K {
            v = step(v);
        }
        *o = v;
    }
}

/// Elements per task of [`hand_loop_parallel`].
const PARALLEL_CHUNK: usize = 1 << 16;

/// [`hand_loop`] over rayon's default pool, in chunks of [`PARALLEL_CHUNK`].
fn hand_loop_parallel(k: usize, input: &[f32], out: &mut [f32]) {
    use rayon::prelude::*;
    out.par_chunks_mut(PARALLEL_CHUNK)
        .zip(input.par_chunks(PARALLEL_CHUNK))
        .for_each(|(o, i)| hand_loop(k, i, o));
}

fn hand_loop(k: usize, input: &[f32], out: &mut [f32]) {
    match k {
        2 => hand_loop_k::<2>(input, out),
        4 => hand_loop_k::<4>(input, out),
        8 => hand_loop_k::<8>(input, out),
        _ => unreachable!("chain length {k} is not benchmarked"),
    }
}

/// The reference the outputs are checked against: one kernel's pass at a time.
fn reference(k: usize, input: &[f32]) -> Vec<f32> {
    let mut v = input.to_vec();
    for _ in 0..k {
        for x in &mut v {
            *x = step(*x);
        }
    }
    v
}

/// Bit-for-bit equality, with the first difference in the panic message.
fn assert_bits(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!("{label}: element {i} is {} but should be {}", got[i], want[i]);
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    HandLoop,
    HandLoopParallel,
    Unfused,
    Fused,
    FusedPrivate,
    FusedPrivateNoBarriers,
    UnfusedPerItem,
    FusedPrivatePerItem,
    GraphUnfused,
    GraphFused,
    GraphFusedPrivate,
}

const VARIANTS: [Variant; 11] = [
    Variant::HandLoop,
    Variant::HandLoopParallel,
    Variant::Unfused,
    Variant::Fused,
    Variant::FusedPrivate,
    Variant::FusedPrivateNoBarriers,
    Variant::UnfusedPerItem,
    Variant::FusedPrivatePerItem,
    Variant::GraphUnfused,
    Variant::GraphFused,
    Variant::GraphFusedPrivate,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::HandLoop => "hand_loop",
            Variant::HandLoopParallel => "hand_loop_parallel",
            Variant::Unfused => "unfused",
            Variant::Fused => "fused",
            Variant::FusedPrivate => "fused_private",
            Variant::FusedPrivateNoBarriers => "fused_private_no_barriers",
            Variant::UnfusedPerItem => "unfused_per_item",
            Variant::FusedPrivatePerItem => "fused_private_per_item",
            Variant::GraphUnfused => "graph_unfused",
            Variant::GraphFused => "graph_fused",
            Variant::GraphFusedPrivate => "graph_fused_private",
        }
    }
    fn index(self) -> usize {
        self as usize
    }
    /// Index into [`Chain::graphs`] of a graph variant.
    fn graph(self) -> Option<usize> {
        match self {
            Variant::GraphUnfused => Some(0),
            Variant::GraphFused => Some(1),
            Variant::GraphFusedPrivate => Some(2),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    Inline,
    Threaded,
}

impl Set {
    fn name(self) -> &'static str {
        match self {
            Set::Inline => "inline",
            Set::Threaded => "threaded",
        }
    }
    fn runtime(self) -> Runtime {
        self.builder().build()
    }
    fn builder(self) -> RuntimeBuilder {
        let b = Runtime::builder().preserve_on_failure(false).fusion_warnings(0);
        match self {
            Set::Inline => b.mode(Mode::Manual).worker_threads(0),
            Set::Threaded => b.mode(Mode::Threaded),
        }
    }
}

fn size_name(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n > SMALL && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// One chain: a runtime, its queue, the K + 1 buffers (`bufs[0]` the input,
/// `bufs[k]` the output), the host copies for the hand loop, and the expected output.
struct Chain {
    rt: Runtime,
    q: Queue,
    k: usize,
    n: usize,
    bufs: Vec<Buffer<f32>>,
    input: Vec<f32>,
    out: Vec<f32>,
    want: Vec<f32>,
    verified: [bool; VARIANTS.len()],
    /// Fused rounds run so far (each must reach the fusion compiler).
    fused_rounds: Cell<u64>,
    /// The recorded chain of each graph variant, finalized on first use.
    graphs: [Option<ExecutableGraph>; 3],
    /// Lookups of the fusion compiler's cache made by finalizing those graphs (not
    /// rounds: a replay does not fuse again).
    graph_fusions: Cell<u64>,
}

impl Chain {
    fn new(set: Set, k: usize, n: usize) -> Self {
        let rt = set.runtime();
        let q = rt.queue();
        let input: Vec<f32> = (0..n).map(|j| (j % 1000) as f32 * 0.001 - 0.25).collect();
        let mut bufs = vec![rt.buffer(&input)];
        bufs.extend((0..k).map(|_| rt.buffer_zeroed::<f32>(n)));
        let want = reference(k, &input);
        Self {
            rt,
            q,
            k,
            n,
            bufs,
            input,
            out: vec![0.0; n],
            want,
            verified: [false; VARIANTS.len()],
            fused_rounds: Cell::new(0),
            graphs: [None, None, None],
            graph_fusions: Cell::new(0),
        }
    }

    /// Submits the K kernels; with `private`, every intermediate accessor is
    /// promoted to private memory; with `per_item`, the kernels are per-work-item
    /// closures instead of elementwise kernels. Returns the last submission's event.
    fn submit_kernels(&self, private: bool, per_item: bool) -> gantry::Result<Event> {
        let mut last = None;
        for i in 0..self.k {
            let (src, dst) = (&self.bufs[i], &self.bufs[i + 1]);
            let n = self.n;
            let inner_in = i > 0;
            let inner_out = i + 1 < self.k;
            last = Some(self.q.submit(|cg| {
                cg.name("step");
                let a = cg.read(src);
                let o = cg.elements_out(dst);
                if private && inner_in {
                    cg.promote(&a, Promotion::Private);
                }
                if private && inner_out {
                    cg.promote(&o, Promotion::Private);
                }
                if per_item {
                    cg.parallel_for(n, move |it| *o.elem(it) = step(a.get(it, it.global_linear_id())));
                } else {
                    cg.map(&a, &o, step);
                }
            })?);
        }
        Ok(last.expect("a chain has kernels"))
    }

    /// Records the chain into a command graph and finalizes it for graph variant `v`
    /// (once), checking that the fused variants fused the whole chain.
    fn finalize_graph(&mut self, label: &str, v: Variant) {
        let i = v.graph().expect("a graph variant");
        if self.graphs[i].is_none() {
            let lookups = || self.rt.fusion_cache_stats().map_or(0, |c| c.hits + c.misses);
            let before = lookups();
            let g = self.rt.graph();
            g.begin_recording(&self.q).expect("begin recording");
            self.submit_kernels(v == Variant::GraphFusedPrivate, false).expect("record the chain");
            g.end_recording(&self.q).expect("end recording");
            let props = match v {
                Variant::GraphUnfused => GraphProps::default(),
                _ => GraphProps::default().fused(),
            };
            let exec = g.finalize(props).expect("finalize");
            let fused = exec.fused_chains();
            let refused = self.graph_refusal(v).filter(|_| v != Variant::GraphUnfused);
            match v {
                Variant::GraphUnfused => assert!(fused.is_empty(), "{label}: fused {fused:?}"),
                _ if refused.is_some() => {
                    assert!(fused.is_empty(), "{label}: fused {fused:?}, expected {refused:?}");
                    assert!(
                        matches!(
                            &exec.not_fused()[..],
                            [NotFused::Refused { reason: FusionError::Unprofitable { reason, .. }, .. }]
                                if Some(*reason) == refused
                        ),
                        "{label}: expected the chain refused ({refused:?}): {:?}",
                        exec.not_fused()
                    );
                }
                _ => assert!(
                    fused.len() == 1 && fused[0].0.len() == self.k,
                    "{label}: the chain was not fused whole: {fused:?}, not fused: {:?}",
                    exec.not_fused()
                ),
            }
            self.graph_fusions.set(self.graph_fusions.get() + lookups() - before);
            self.graphs[i] = Some(exec);
        }
    }

    /// One round of a Gantry variant, waited for.
    fn run(&self, v: Variant) -> gantry::Result<()> {
        match v {
            Variant::GraphUnfused | Variant::GraphFused | Variant::GraphFusedPrivate => {
                let g =
                    self.graphs[v.graph().expect("a graph variant")].as_ref().expect("finalized at setup");
                self.q.submit_graph(g)?.wait()
            }
            Variant::HandLoop | Variant::HandLoopParallel => {
                unreachable!("the hand loops run on the host copies")
            }
            Variant::Unfused => self.submit_kernels(false, false)?.wait(),
            Variant::UnfusedPerItem => self.submit_kernels(false, true)?.wait(),
            Variant::Fused
            | Variant::FusedPrivate
            | Variant::FusedPrivateNoBarriers
            | Variant::FusedPrivatePerItem => {
                if self.window_refusal(v).is_none() {
                    self.fused_rounds.set(self.fused_rounds.get() + 1);
                }
                self.q.start_fusion()?;
                self.submit_kernels(v != Variant::Fused, v == Variant::FusedPrivatePerItem)?;
                let barriers = v != Variant::FusedPrivateNoBarriers;
                self.q.complete_fusion(FusionProps { barriers })?.wait()
            }
        }
    }

    /// Why the runtime runs eager variant `v`'s window unfused on the CPU (its first
    /// kernel judged by the device's `WindowThresholds`: launch-bound, or global
    /// intermediates the caches hold), if it does.
    fn window_refusal(&self, v: Variant) -> Option<Unprofitable> {
        let promotes = v != Variant::Fused && self.k > 1;
        let elements = if promotes { self.n } else { 2 * self.n };
        let bytes = (elements * std::mem::size_of::<f32>()) as u64;
        self.rt.devices()[0].caps.fusion_window.judge(self.n as u64, bytes, promotes)
    }

    /// Why graph finalize leaves graph variant `v`'s chain unfused on the CPU (the
    /// whole chain judged by the device's `WindowThresholds`: global intermediates
    /// the caches hold), if it does.
    fn graph_refusal(&self, v: Variant) -> Option<Unprofitable> {
        let promotes = v == Variant::GraphFusedPrivate && self.k > 1;
        let footprint = ((self.k + 1) * self.n * std::mem::size_of::<f32>()) as u64;
        self.rt.devices()[0].caps.fusion_window.judge_chain(footprint, promotes)
    }

    /// One round of `v`, timed by the caller.
    fn round(&mut self, v: Variant) {
        match v {
            Variant::HandLoop => hand_loop(self.k, black_box(&self.input), black_box(&mut self.out)),
            Variant::HandLoopParallel => {
                hand_loop_parallel(self.k, black_box(&self.input), black_box(&mut self.out))
            }
            _ => self.run(v).expect("a round"),
        }
    }

    /// Runs `v` once and checks its output (and, for fused variants, the outcome).
    fn verify(&mut self, label: &str, v: Variant) {
        if self.verified[v.index()] {
            return;
        }
        match v {
            Variant::HandLoop | Variant::HandLoopParallel => {
                self.out.fill(0.0);
                self.round(v);
                assert_bits(label, &self.out, &self.want);
            }
            _ => {
                if v.graph().is_some() {
                    self.finalize_graph(label, v);
                }
                let sentinel = -7.0f32;
                let inner = &self.bufs[1..self.k];
                // Intermediates and output set to a sentinel, so a stale output or a
                // written-back intermediate shows.
                for b in &self.bufs[1..] {
                    self.q.submit(|cg| cg.fill(b, sentinel)).expect("fill");
                }
                self.q.wait().expect("fill wait");
                self.run(v).expect("verification round");
                let got = self.bufs[self.k].to_vec().expect("read the output");
                assert_bits(label, &got, &self.want);
                let outcome = self.q.fusion_outcome();
                let eager = matches!(
                    v,
                    Variant::Fused
                        | Variant::FusedPrivate
                        | Variant::FusedPrivateNoBarriers
                        | Variant::FusedPrivatePerItem
                );
                let refused = self.window_refusal(v).filter(|_| eager);
                match v {
                    // A window that does not pay: its kernels ran as submitted.
                    _ if refused.is_some() => match outcome {
                        Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
                            reason,
                            ..
                        }))) if Some(reason) == refused => {}
                        other => panic!("{label}: expected the window refused ({refused:?}): {other:?}"),
                    },
                    // Graph variants: checked when finalized; a replay sets no outcome.
                    Variant::Unfused
                    | Variant::UnfusedPerItem
                    | Variant::GraphUnfused
                    | Variant::GraphFused
                    | Variant::GraphFusedPrivate => {}
                    // Refused: its kernels ran unfused.
                    Variant::FusedPrivatePerItem => match outcome {
                        Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
                            reason: Unprofitable::MappedAccess,
                            ..
                        }))) => {}
                        other => panic!("{label}: not refused as unprofitable: {other:?}"),
                    },
                    _ => match outcome {
                        Some(FusionOutcome::Fused { kernels, warnings, .. }) => {
                            assert_eq!(kernels, self.k, "{label}: kernels fused");
                            assert!(warnings.is_empty(), "{label}: fusion warnings: {warnings:?}");
                        }
                        other => panic!("{label}: not fused: {other:?}"),
                    },
                }
                let internalized = matches!(
                    v,
                    Variant::FusedPrivate | Variant::FusedPrivateNoBarriers | Variant::GraphFusedPrivate
                );
                if internalized && refused.is_none() {
                    for (i, b) in inner.iter().enumerate() {
                        let t = b.to_vec().expect("read an intermediate");
                        assert!(
                            t.iter().all(|x| x.to_bits() == sentinel.to_bits()),
                            "{label}: intermediate buffer {} was written back",
                            i + 1
                        );
                    }
                } else {
                    for (i, b) in inner.iter().enumerate() {
                        let want = reference(i + 1, &self.input);
                        assert_bits(&format!("{label}: tmp{}", i + 1), &b.to_vec().expect("read"), &want);
                    }
                }
            }
        }
        self.verified[v.index()] = true;
    }

    /// Nothing left alive once a benchmark's rounds were waited for, and every fused
    /// round was fused (a cancelled fusion never reaches the compiler's cache).
    fn check_flat(&self, label: &str) {
        self.rt.wait_idle().expect("wait_idle");
        let stats = self.rt.stats();
        assert_eq!(stats.live_commands, 0, "{label}: commands left alive: {stats:?}");
        assert_eq!(stats.failed, 0, "{label}: commands failed: {stats:?}");
        let cache = self.rt.fusion_cache_stats().expect("closure fusion cache");
        assert_eq!(
            cache.hits + cache.misses,
            self.fused_rounds.get() + self.graph_fusions.get(),
            "{label}: not every fused round was fused: {cache:?}"
        );
    }
}

/// Sampling per size: the 16M cases get 10 samples of one round each.
fn configure(group: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    group.throughput(Throughput::Elements(n as u64));
    if n >= LARGE {
        group
            .sample_size(10)
            .measurement_time(Duration::from_millis(1_500))
            .warm_up_time(Duration::from_millis(1))
            .sampling_mode(SamplingMode::Flat);
    } else {
        group
            .sample_size(20)
            .measurement_time(Duration::from_millis(800))
            .warm_up_time(Duration::from_millis(200))
            .sampling_mode(SamplingMode::Auto);
    }
}

fn chain_bench(c: &mut Criterion, set: Set, n: usize) {
    let mut group = c.benchmark_group(format!("fusion_chain/{}/{}", set.name(), size_name(n)));
    configure(&mut group, n);
    for k in CHAINS {
        // One runtime and buffer set per chain, shared by its variants; built on
        // first use so a filtered run does not allocate the others.
        let mut chain: Option<Chain> = None;
        for v in VARIANTS {
            if v == Variant::HandLoopParallel && set == Set::Inline {
                continue; // single-threaded like the inline runtime: `hand_loop` is its baseline
            }
            let id = format!("K{k}/{}", v.name());
            let label = format!("fusion_chain/{}/{}/{id}", set.name(), size_name(n));
            group.bench_function(BenchmarkId::from_parameter(&id), |b| {
                let ch = chain.get_or_insert_with(|| Chain::new(set, k, n));
                ch.verify(&label, v);
                b.iter(|| ch.round(v));
            });
            if let Some(ch) = &chain {
                ch.check_flat(&label);
            }
        }
    }
    group.finish();
}

/// Rounds per block of `fusion_overhead/inline/fused_minus_unfused`.
const BLOCK: u64 = 64;

/// The tiny chain of `fusion_overhead`: two one-element `map` kernels (a form the
/// fusion compiler fuses; per-work-item closures it refuses). Its window fuses
/// (`fusion_window(WindowThresholds::ALWAYS)`: what fusing costs the host), or, with
/// `passing`, runs on the CPU driver's thresholds, which pass a window of one-element
/// kernels through.
struct Tiny {
    rt: Runtime,
    q: Queue,
    bufs: [Buffer<f32>; 3],
    passing: bool,
    checked: bool,
    /// Fused rounds run so far.
    rounds: u64,
}

impl Tiny {
    fn new(set: Set, passing: bool) -> Self {
        let b = set.builder();
        let rt = if passing { b.build() } else { b.fusion_window(WindowThresholds::ALWAYS).build() };
        let q = rt.queue();
        let bufs = [rt.buffer(&[1.0f32]), rt.buffer_zeroed(1), rt.buffer_zeroed(1)];
        Self { rt, q, bufs, passing, checked: false, rounds: 0 }
    }

    fn submit(&self) -> gantry::Result<Event> {
        let mut last = None;
        for i in 0..2 {
            let (src, dst) = (&self.bufs[i], &self.bufs[i + 1]);
            last = Some(self.q.submit(|cg| {
                let a = cg.read(src);
                let o = cg.elements_out(dst);
                cg.map(&a, &o, step);
            })?);
        }
        Ok(last.expect("two kernels"))
    }

    fn fused(&mut self) -> gantry::Result<()> {
        self.rounds += 1;
        self.q.start_fusion()?;
        self.submit()?;
        self.q.complete_fusion(FusionProps::default())?.wait()
    }

    fn unfused(&self) -> gantry::Result<()> {
        self.submit()?.wait()
    }

    /// The time `rounds` fused rounds take beyond as many unfused ones, run in
    /// alternating blocks of [`BLOCK`] rounds so that both kinds see the same
    /// machine: on a shared VM one round's time drifts within a minute by more than
    /// the difference measured (figures: `docs/PERFORMANCE.md`). (Zero if fusing were
    /// cheaper.)
    fn difference(&mut self, rounds: u64) -> Duration {
        let (mut fused, mut unfused) = (Duration::ZERO, Duration::ZERO);
        let mut left = rounds;
        while left > 0 {
            let n = left.min(BLOCK);
            let start = Instant::now();
            for _ in 0..n {
                self.fused().expect("fused round");
            }
            fused += start.elapsed();
            let start = Instant::now();
            for _ in 0..n {
                self.unfused().expect("unfused round");
            }
            unfused += start.elapsed();
            left -= n;
        }
        fused.saturating_sub(unfused)
    }

    /// Two fused rounds: the second must come from the cache, with the right result.
    /// Passing through: both refused as launch-bound, with the right result, and the
    /// compiler never asked.
    fn check(&mut self, label: &str) {
        if self.checked {
            return;
        }
        let want = reference(2, &[1.0]);
        for round in 0..2 {
            self.bufs[2].write().expect("host write")[0] = 0.0;
            self.fused().expect("fused round");
            assert_bits(label, &self.bufs[2].to_vec().expect("read"), &want);
            match (self.passing, self.q.fusion_outcome()) {
                (false, Some(FusionOutcome::Fused { kernels: 2, cached, .. })) => {
                    assert_eq!(cached, round == 1, "{label}: round {round} cached")
                }
                (
                    true,
                    Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
                        reason: Unprofitable::LaunchBound { items: 1, .. },
                        ..
                    }))),
                ) => {}
                (_, other) => panic!("{label}: round {round}: {other:?}"),
            }
        }
        let stats = self.rt.fusion_cache_stats().expect("closure fusion cache");
        let want = if self.passing { (0, 0) } else { (1, 1) };
        assert_eq!((stats.hits, stats.misses), want, "{label}: cache after two rounds");
        self.checked = true;
    }
}

fn overhead_bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("fusion_overhead");
    group
        .sample_size(30)
        .measurement_time(Duration::from_millis(1_000))
        .warm_up_time(Duration::from_millis(300));
    for set in [Set::Inline, Set::Threaded] {
        let mut tiny = Tiny::new(set, false);
        let label = format!("fusion_overhead/{}/fused", set.name());
        group.bench_function(BenchmarkId::from_parameter(format!("{}/fused", set.name())), |b| {
            tiny.check(&label);
            b.iter(|| tiny.fused().expect("fused round"));
        });
        let mut passing = Tiny::new(set, true);
        let passed_label = format!("fusion_overhead/{}/passed_through", set.name());
        group.bench_function(BenchmarkId::from_parameter(format!("{}/passed_through", set.name())), |b| {
            passing.check(&passed_label);
            b.iter(|| passing.fused().expect("passed-through round"));
        });
        if passing.checked {
            let stats = passing.rt.fusion_cache_stats().expect("closure fusion cache");
            assert_eq!(stats.hits + stats.misses, 0, "{passed_label}: a window reached the compiler");
        }
        group.bench_function(BenchmarkId::from_parameter(format!("{}/unfused_overhead", set.name())), |b| {
            b.iter(|| tiny.unfused().expect("unfused round"));
        });
        // Inline only: threaded, a round's time is mostly hand-offs between threads,
        // whose spread exceeds the difference, so a block's difference can come out
        // negative, which criterion cannot record.
        if set == Set::Inline {
            group.bench_function(BenchmarkId::from_parameter("inline/fused_minus_unfused"), |b| {
                tiny.check(&label);
                b.iter_custom(|rounds| tiny.difference(rounds));
            });
        }
        if tiny.checked {
            // Every fused round after the first was a cache hit.
            let stats = tiny.rt.fusion_cache_stats().expect("closure fusion cache");
            assert_eq!(
                (stats.hits, stats.misses),
                (tiny.rounds - 1, 1),
                "{label}: {} rounds were not all cache hits",
                tiny.rounds
            );
        }
        tiny.rt.wait_idle().expect("wait_idle");
        let stats = tiny.rt.stats();
        assert_eq!(stats.live_commands, 0, "{label}: commands left alive: {stats:?}");
    }
    group.finish();
}

fn benches(c: &mut Criterion) {
    overhead_bench(c);
    let threaded_large = std::env::var("GANTRY_BENCH_FUSION_THREADED_16M").is_ok_and(|v| v == "1");
    for set in [Set::Inline, Set::Threaded] {
        for n in [SMALL, MEDIUM, LARGE] {
            if set == Set::Threaded && n == LARGE && !threaded_large {
                continue;
            }
            chain_bench(c, set, n);
        }
    }
}

criterion_group!(fusion, benches);
criterion_main!(fusion);
