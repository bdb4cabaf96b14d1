//! A frame loop on Gantry's CPU driver: 2-D heat diffusion on a W×H grid.
//!
//! Each frame submits
//! 1. the stencil kernel: `cg.stencil` over the `[h, w]` grid, each cell reading its
//!    neighbourhood in the current grid and writing the next one (two grids,
//!    ping-ponged),
//! 2. a per-row reduction kernel (sum and max of each row of the new grid),
//! 3. a copy of the probe row (the middle row) into a ring of history rows,
//! 4. a host task folding the row results into the frame's total heat and maximum
//!    temperature, recorded in a `Vec` behind a `Mutex`,
//!
//! and every `SNAPSHOT_EVERY` frames a copy of the whole grid into a snapshot buffer.
//! Nobody states a dependency: Gantry derives them from the buffers each command uses.
//! At most `--inflight` frames are in flight (the loop waits for frame `f - inflight`
//! before submitting frame `f`), as a renderer would.
//!
//! At the end everything (final grid, history ring, snapshot, per-frame values) is
//! checked against a plain serial implementation using the same `f32` operations in
//! the same order, so the results must be bit-identical.
//!
//! `--fusion` runs the loop twice, unfused and then with each frame's two kernels
//! (stencil, row reduction: back to back on one queue) fused into one, and prints both
//! mean frame times. Fusing runs, per work-group, one kernel's work-items after the
//! other's, so a kernel may only read what the earlier one wrote *in its own
//! work-group*: in both runs the two kernels are 2-D ND-ranges over `[h, w]` whose
//! work-groups are whole rows (`ROWS_PER_GROUP × w`), and the reduction's first
//! work-item of each row sums that row. Both runs are verified against the serial
//! run. No buffer is internalized: every buffer the kernels write is read later.
//!
//! `--graph` runs the loop eagerly, then with each frame's stencil, row reduction and
//! host task recorded once into a command graph (`begin_recording` on the frame's
//! queue, the three submissions, `end_recording`), finalized once and replayed with
//! `submit_graph` every frame. The grids ping-pong, so two graphs are recorded, one
//! per grid parity, and frame `f` replays graph `f % 2`; the recorded host task takes
//! its frame number from a counter, since it runs once per replay. The probe copy
//! (into ring row `f % HISTORY`) and the snapshot vary from frame to frame: they are
//! submitted eagerly after the replay, ordered after the graph's kernels through the
//! buffers they share. Both runs are verified against the serial run and against each
//! other, bit for bit, and their mean frame times are printed. With `--fusion` too,
//! all runs use the row-group kernels of `--fusion`, and a third run finalizes the
//! graphs with `GraphProps::default().fused()`, which fuses each graph's stencil and
//! row reduction (graph fusion); the fused chains are printed, or why a chain was
//! not fused (on the CPU, a chain fusion would not speed up is a valid outcome).
//!
//! `--device cuda` (feature `cuda`) runs the frame's kernels as CUDA C on an NVIDIA GPU
//! (`kernels.rs`), its copies on the GPU and its host task on the CPU, verified against
//! the same serial run; with `--graph` the recorded frames replay as CUDA graphs.
//! `--device vulkan` (feature `vulkan`) does the same with the kernels in WGSL.
//! `--kernels opencl` (feature `jit`) writes the two kernels in OpenCL C instead,
//! compiled by clang and the JIT: native work-group functions on the CPU, PTX on a
//! CUDA device.
//!
//! ```text
//! cargo run --release --example frame_loop -- [--frames N] [--size N] [--threads N]
//!     [--inflight N] [--report N] [--no-preserve] [--fusion] [--graph] [--device cpu|cuda|vulkan]
//!     [--kernels closure|cuda-c|wgsl|opencl]
//! ```

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod kernels;

use gantry::{
    Accessor, Buffer, CacheStats, DeviceId, Event, ExecutableGraph, FusionOutcome, FusionProps, GraphProps,
    Item, NdRange, Queue, QueueOptions, Read, Runtime,
};

/// Diffusion coefficient (stable for ≤ 0.25).
const ALPHA: f32 = 0.2;
/// Temperature of the hot top edge and of the initial hot square.
const HOT: f32 = 100.0;
/// Rows of probe history kept (a ring).
const HISTORY: usize = 64;
/// A snapshot of the grid is copied every this many frames.
const SNAPSHOT_EVERY: usize = 50;
/// Work-items per work-group of the row reduction (so its rows spread over workers).
const ROWS_PER_GROUP: usize = 8;

struct Options {
    frames: usize,
    size: usize,
    threads: Option<usize>,
    inflight: usize,
    report: usize,
    preserve: bool,
    fusion: bool,
    graph: bool,
    /// Run the frame's kernels and copies on the first CUDA device.
    cuda: bool,
    /// Run them on the first Vulkan device.
    vulkan: bool,
    /// What the frame's two kernels are written in.
    kernels: KernelSource,
}

/// What the frame's two kernels are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KernelSource {
    /// Rust closures (the CPU driver's).
    Closure,
    /// CUDA C (`--device cuda` only).
    CudaC,
    /// WGSL (`--device vulkan` only).
    Wgsl,
    /// OpenCL C through the JIT (feature `jit`).
    OpenCl,
}

fn usage() -> ! {
    eprintln!(
        "usage: frame_loop [--frames N] [--size N] [--threads N] [--inflight N] [--report N] [--no-preserve] [--fusion] [--graph] [--device cpu|cuda|vulkan] [--kernels closure|cuda-c|wgsl|opencl]\n\
         \x20 --frames N     frames to simulate (default 200)\n\
         \x20 --size N       grid is N×N (default 512, at least 3)\n\
         \x20 --threads N    CPU driver worker threads (default: one per core; 0 runs kernels inline)\n\
         \x20 --inflight N   frames submitted ahead of the oldest unfinished one (default 2)\n\
         \x20 --report N     print a table row every N frames (default frames/10)\n\
         \x20 --no-preserve  skip the copy of written ranges kept to restore them on failure\n\
         \x20 --fusion       run the frames unfused, then with each frame's stencil and row\n\
         \x20                reduction fused into one kernel, and compare the frame times\n\
         \x20 --graph        run the frames eagerly, then by replaying a command graph recorded\n\
         \x20                once (stencil, row reduction, host task), and compare the frame\n\
         \x20                times; with --fusion also a fused graph (GraphProps::fused)\n\
         \x20 --device D     cpu (default), cuda or vulkan: the kernels (CUDA C or WGSL) and the\n\
         \x20                copies on GPU 0, the host task on the CPU (needs the feature cuda\n\
         \x20                or vulkan)\n\
         \x20 --kernels K    closure (default on the CPU), cuda-c (default on CUDA), wgsl (Vulkan)\n\
         \x20                or opencl\n\
         \x20                (OpenCL C through clang and the JIT; needs the feature jit)"
    );
    std::process::exit(2)
}

fn parse_options() -> Options {
    let mut o = Options {
        frames: 200,
        size: 512,
        threads: None,
        inflight: 2,
        report: 0,
        preserve: true,
        fusion: false,
        graph: false,
        cuda: false,
        vulkan: false,
        kernels: KernelSource::Closure,
    };
    let mut kernels = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || -> usize {
            let v = args.next().unwrap_or_else(|| usage());
            v.parse().unwrap_or_else(|_| {
                eprintln!("{flag}: not a number: {v}");
                usage()
            })
        };
        match flag.as_str() {
            "--frames" => o.frames = value(),
            "--size" => o.size = value(),
            "--threads" => o.threads = Some(value()),
            "--inflight" => o.inflight = value(),
            "--report" => o.report = value(),
            "--no-preserve" => o.preserve = false,
            "--fusion" => o.fusion = true,
            "--graph" => o.graph = true,
            "--device" => match args.next().as_deref() {
                Some("cpu") => (o.cuda, o.vulkan) = (false, false),
                Some("cuda") => (o.cuda, o.vulkan) = (true, false),
                Some("vulkan") => (o.cuda, o.vulkan) = (false, true),
                other => {
                    eprintln!("--device: expected cpu, cuda or vulkan, got {other:?}");
                    usage()
                }
            },
            "--kernels" => {
                kernels = Some(match args.next().as_deref() {
                    Some("closure") => KernelSource::Closure,
                    Some("cuda-c") => KernelSource::CudaC,
                    Some("wgsl") => KernelSource::Wgsl,
                    Some("opencl") => KernelSource::OpenCl,
                    other => {
                        eprintln!("--kernels: expected closure, cuda-c, wgsl or opencl, got {other:?}");
                        usage()
                    }
                })
            }
            "-h" | "--help" => usage(),
            _ => {
                eprintln!("unknown argument: {flag}");
                usage()
            }
        }
    }
    if o.size < 3 || o.frames == 0 {
        usage();
    }
    o.kernels = kernels.unwrap_or(if o.cuda {
        KernelSource::CudaC
    } else if o.vulkan {
        KernelSource::Wgsl
    } else {
        KernelSource::Closure
    });
    let refuse = |why: &str| -> ! {
        eprintln!("{why}");
        std::process::exit(2)
    };
    match (o.kernels, o.cuda) {
        (KernelSource::Closure, true) => {
            refuse("--kernels closure: closure kernels run on the CPU, not on CUDA")
        }
        (KernelSource::CudaC, false) => refuse("--kernels cuda-c: CUDA C kernels need --device cuda"),
        (KernelSource::OpenCl, _) if !cfg!(feature = "jit") => refuse(
            "--kernels opencl: this example was built without the feature jit \
             (cargo run --release --features jit --example frame_loop -- --kernels opencl)",
        ),
        _ => {}
    }
    if o.kernels != KernelSource::Closure && o.fusion {
        refuse("--fusion: only the closure kernels are fused here");
    }
    if o.vulkan && !cfg!(feature = "vulkan") {
        eprintln!(
            "--device vulkan: this example was built without the feature vulkan \
             (cargo run --release --features vulkan --example frame_loop -- --device vulkan)"
        );
        std::process::exit(2);
    }
    if o.cuda && !cfg!(feature = "cuda") {
        eprintln!(
            "--device cuda: this example was built without the feature cuda \
             (cargo run --release --features cuda --example frame_loop -- --device cuda)"
        );
        std::process::exit(2);
    }
    o.inflight = o.inflight.max(1);
    if o.report == 0 {
        o.report = o.frames.div_ceil(10);
    }
    o
}

// ---------------------------------------------------------------------------------
// The arithmetic, shared by the kernels and the serial reference so both perform the
// same f32 operations in the same order.

/// The next temperature of an interior cell from itself and its four neighbours.
#[inline(always)]
fn stencil(c: f32, north: f32, south: f32, west: f32, east: f32) -> f32 {
    c + ALPHA * (north + south + west + east - 4.0 * c)
}

/// Whether `(y, x)` is on the grid's edge (fixed temperature).
#[inline(always)]
fn is_edge(y: usize, x: usize, h: usize, w: usize) -> bool {
    y == 0 || x == 0 || y == h - 1 || x == w - 1
}

/// The next temperature of the work-item's cell `(global_id(0), global_id(1))`.
#[inline(always)]
fn diffuse_at(src: &Accessor<f32, Read>, it: &Item<'_>, h: usize, w: usize) -> f32 {
    let (y, x) = (it.global_id(0), it.global_id(1));
    let i = y * w + x;
    let c = src.get(it, i);
    if is_edge(y, x, h, w) {
        c
    } else {
        stencil(c, src.get(it, i - w), src.get(it, i + w), src.get(it, i - 1), src.get(it, i + 1))
    }
}

/// Sum and maximum of one row, left to right.
#[inline(always)]
fn row_stat(values: impl Iterator<Item = f32>) -> [f32; 2] {
    values.fold([0.0, f32::MIN], |[sum, max], v| [sum + v, max.max(v)])
}

/// Total heat and maximum temperature from the rows' results, top to bottom.
fn fold_rows(rows: &[[f32; 2]]) -> (f32, f32) {
    rows.iter().fold((0.0, f32::MIN), |(heat, max), r| (heat + r[0], max.max(r[1])))
}

/// The initial grid: a hot top edge and a hot square in the middle.
fn initial_grid(h: usize, w: usize) -> Vec<f32> {
    let mut g = vec![0.0f32; h * w];
    g[..w].fill(HOT);
    let (cy, cx, r) = (h / 2, w / 2, (h.min(w) / 8).max(1));
    for y in cy.saturating_sub(r)..(cy + r).min(h - 1) {
        for x in cx.saturating_sub(r)..(cx + r).min(w - 1) {
            g[y * w + x] = HOT;
        }
    }
    g
}

// ---------------------------------------------------------------------------------
// The Gantry version.

/// What one frame's host task records.
#[derive(Clone, Copy, Debug, PartialEq)]
struct FrameStat {
    frame: usize,
    heat: f32,
    max: f32,
}

/// How a frame's two kernels (stencil, row reduction) are shaped and submitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernels {
    /// A plain 2-D stencil and a 1-D ND-range reduction of `ROWS_PER_GROUP` rows per
    /// work-group (the default loop).
    Default,
    /// Both as 2-D ND-ranges over `[h, w]` with whole-row work-groups, so the
    /// reduction of a row only reads what the stencil wrote in the same work-group:
    /// the shape that can be fused. Submitted unfused.
    RowGroups,
    /// The same kernels, submitted between `start_fusion` and `complete_fusion`.
    Fused,
}

/// The simulation's buffers and where frames are submitted.
struct Sim {
    q: Queue,
    /// The device the frame's kernels and copies run on.
    device: DeviceId,
    /// The frame's kernels as code images (`--kernels cuda-c|opencl`), instead of
    /// closures.
    images: Option<kernels::ImageKernels>,
    kernels: Kernels,
    h: usize,
    w: usize,
    /// The two grids; frame `f` reads `grids[f % 2]` and writes the other.
    grids: [Buffer<f32>; 2],
    /// Sum and max of each row of the newest grid.
    rows: Buffer<[f32; 2]>,
    /// The probe row of the last `HISTORY` frames; frame `f` writes row `f % HISTORY`.
    history: Buffer<f32>,
    /// The grid as of the last snapshot frame (every `SNAPSHOT_EVERY`-th: 49, 99, ...).
    snapshot: Buffer<f32>,
    log: Arc<Mutex<Vec<FrameStat>>>,
    /// With `--graph`: the recorded frame for each grid parity; frame `f` replays
    /// `graphs[f % 2]`.
    graphs: Option<[ExecutableGraph; 2]>,
    /// Frames the recorded host task has run (its frame number).
    replays: Arc<AtomicUsize>,
}

impl Sim {
    /// The simulation on `device`, its kernels given by `images` where there are.
    fn new(
        rt: &Runtime,
        (h, w): (usize, usize),
        kernels: Kernels,
        device: DeviceId,
        images: Option<kernels::ImageKernels>,
    ) -> Self {
        let init = initial_grid(h, w);
        Sim {
            q: rt.queue_with(QueueOptions { device, in_order: false }).expect("a queue on the device"),
            device,
            images,
            kernels,
            h,
            w,
            grids: [rt.buffer(&init), rt.buffer(&init)],
            rows: rt.buffer_zeroed(h),
            history: rt.buffer_zeroed(HISTORY * w),
            snapshot: rt.buffer_zeroed(h * w),
            log: Arc::new(Mutex::new(Vec::new())),
            graphs: None,
            replays: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Records the frame's kernels and host task once per grid parity into a command
    /// graph and finalizes it with `props`; later frames replay them.
    fn record_graphs(&mut self, rt: &Runtime, props: GraphProps) -> gantry::Result<()> {
        assert!(self.kernels != Kernels::Fused, "a graph records unfused kernels");
        let mut execs = Vec::with_capacity(2);
        for parity in 0..2 {
            let graph = rt.graph_on(self.device);
            graph.begin_recording(&self.q)?;
            let mut recorded = Vec::new();
            let submitted = self
                .submit_kernel_pair(parity, &mut recorded)
                .and_then(|()| self.submit_frame_stats(None).map(|_| ()));
            graph.end_recording(&self.q)?;
            submitted?;
            execs.push(graph.finalize(props)?);
        }
        let [even, odd] = <[ExecutableGraph; 2]>::try_from(execs).expect("two graphs");
        self.graphs = Some([even, odd]);
        Ok(())
    }

    /// Submits frame `f` and returns the events of its commands, in submission order;
    /// the last is the host task's. A fused frame's two kernels have one event, the
    /// fusion's.
    ///
    /// With recorded graphs, the frame's graph is replayed, then the probe copy and
    /// snapshot are submitted; the replay's event comes last.
    fn submit_frame(&self, f: usize) -> gantry::Result<Vec<Event>> {
        let mut events = Vec::with_capacity(5);
        if let Some(graphs) = &self.graphs {
            let replay = self.q.submit_graph(&graphs[f % 2])?;
            self.submit_copies(f, &mut events)?;
            events.push(replay);
            return Ok(events);
        }
        self.submit_kernel_pair(f, &mut events)?;
        self.submit_copies(f, &mut events)?;
        // 4. Host task: fold the rows into the frame's totals.
        events.push(self.submit_frame_stats(Some(f))?);
        Ok(events)
    }

    /// 1., 2.: frame `f`'s two kernels, as `self.kernels` says.
    fn submit_kernel_pair(&self, f: usize, events: &mut Vec<Event>) -> gantry::Result<()> {
        let (cur, next) = (&self.grids[f % 2], &self.grids[(f + 1) % 2]);
        match self.kernels {
            Kernels::Default => self.submit_kernels(cur, next, events)?,
            Kernels::RowGroups => {
                events.push(self.submit_row_group_stencil(cur, next)?);
                events.push(self.submit_row_group_stats(next)?);
            }
            Kernels::Fused => {
                // The two kernels run back to back on this queue: fuse them (with a
                // work-group barrier between them, the default).
                self.q.start_fusion()?;
                self.submit_row_group_stencil(cur, next)?;
                self.submit_row_group_stats(next)?;
                events.push(self.q.complete_fusion(FusionProps::default())?);
            }
        }
        Ok(())
    }

    /// 3. and the snapshot: frame `f`'s copies of the new grid.
    fn submit_copies(&self, f: usize, events: &mut Vec<Event>) -> gantry::Result<()> {
        let (h, w) = (self.h, self.w);
        let next = &self.grids[(f + 1) % 2];

        // 3. The probe row into the history ring.
        events.push(self.q.submit(|cg| {
            cg.name("probe_copy");
            cg.copy_range(next, probe_row(h) * w, &self.history, (f % HISTORY) * w, w);
        })?);

        // Every SNAPSHOT_EVERY frames, the whole grid.
        if takes_snapshot(f) {
            events.push(self.q.submit(|cg| {
                cg.name("snapshot");
                cg.copy(next, &self.snapshot);
            })?);
        }
        Ok(())
    }

    /// 4. The host task folding the rows into frame `frame`'s totals; a recorded one
    ///    (`None`) numbers its runs with `self.replays`.
    fn submit_frame_stats(&self, frame: Option<usize>) -> gantry::Result<Event> {
        let log = self.log.clone();
        let replays = self.replays.clone();
        self.q.submit(|cg| {
            cg.name("frame_stats");
            let rows = cg.host_read(&self.rows);
            cg.host_task(move |ctx| {
                let frame = frame.unwrap_or_else(|| replays.fetch_add(1, Ordering::Relaxed));
                let (heat, max) = fold_rows(rows.as_slice(ctx));
                log.lock().unwrap().push(FrameStat { frame, heat, max });
            });
        })
    }

    /// The default frame's kernels: 1. the stencil, 2. the row reduction.
    fn submit_kernels(
        &self,
        cur: &Buffer<f32>,
        next: &Buffer<f32>,
        events: &mut Vec<Event>,
    ) -> gantry::Result<()> {
        let (h, w) = (self.h, self.w);
        if let Some(images) = &self.images {
            return images.submit(&self.q, (cur, next, &self.rows), (h, w), ALPHA, events);
        }

        // 1. Stencil: next = diffuse(cur). A stencil kernel: the runtime runs each
        //    row's interior cells as one vectorized loop over three rows of `cur`.
        events.push(self.q.submit(|cg| {
            cg.name("stencil");
            let src = cg.read(cur);
            let dst = cg.elements_out(next);
            cg.stencil(&src, &dst, [h, w], |n| {
                let c = n.center();
                match n.is_border() {
                    true => c,
                    false => stencil(c, n.at(-1, 0), n.at(1, 0), n.at(0, -1), n.at(0, 1)),
                }
            });
        })?);

        // 2. Per-row sum and max of the new grid. An ND-range with small groups: a
        //    plain 1-D range of h ≤ 1024 rows would be a single work-group, run on one
        //    thread.
        events.push(self.q.submit(|cg| {
            cg.name("row_stats");
            let grid = cg.read(next);
            let out = cg.elements_out(&self.rows);
            let local = if h.is_multiple_of(ROWS_PER_GROUP) { ROWS_PER_GROUP } else { 1 };
            cg.parallel_for_nd(NdRange::new(h, local), move |it| {
                let y = it.global_id(0);
                let s = row_stat((0..w).map(|x| grid.get(it, y * w + x)));
                *out.elem(it) = s;
            });
        })?);
        Ok(())
    }

    /// The ND-range of the row-group kernels: work-groups of `ROWS_PER_GROUP` (or
    /// one) whole rows.
    fn row_group_range(h: usize, w: usize) -> NdRange {
        let rows = if h.is_multiple_of(ROWS_PER_GROUP) { ROWS_PER_GROUP } else { 1 };
        NdRange::new([h, w], [rows, w])
    }

    /// 1. Stencil, as a 2-D ND-range of whole-row work-groups: next = diffuse(cur).
    fn submit_row_group_stencil(&self, cur: &Buffer<f32>, next: &Buffer<f32>) -> gantry::Result<Event> {
        let (h, w) = (self.h, self.w);
        let nd = Self::row_group_range(h, w);
        self.q.submit(|cg| {
            cg.name("stencil");
            let src = cg.read(cur);
            let dst = cg.elements_out(next);
            cg.parallel_for_nd(nd, move |it| {
                *dst.elem(it) = diffuse_at(&src, it, h, w);
            });
        })
    }

    /// 2. The row reduction over the same ND-range: the first work-item of each row
    ///    sums and maximizes that row, left to right. Its work-group is the one whose
    ///    stencil work-items wrote the row, so fused (with a barrier between the
    ///    kernels) it reads finished values.
    fn submit_row_group_stats(&self, next: &Buffer<f32>) -> gantry::Result<Event> {
        let (h, w) = (self.h, self.w);
        let nd = Self::row_group_range(h, w);
        self.q.submit(|cg| {
            cg.name("row_stats");
            let grid = cg.read(next);
            let out = cg.discard_write(&self.rows);
            cg.parallel_for_nd(nd, move |it| {
                if it.global_id(1) == 0 {
                    let y = it.global_id(0);
                    out.set(it, y, row_stat((0..w).map(|x| grid.get(it, y * w + x))));
                }
            });
        })
    }
}

fn probe_row(h: usize) -> usize {
    h / 2
}

fn takes_snapshot(f: usize) -> bool {
    (f + 1).is_multiple_of(SNAPSHOT_EVERY)
}

// ---------------------------------------------------------------------------------
// The serial reference.

struct Reference {
    grid: Vec<f32>,
    history: Vec<f32>,
    snapshot: Vec<f32>,
    log: Vec<FrameStat>,
}

fn reference(h: usize, w: usize, frames: usize) -> Reference {
    let mut cur = initial_grid(h, w);
    let mut next = cur.clone();
    let mut history = vec![0.0f32; HISTORY * w];
    let mut snapshot = vec![0.0f32; h * w];
    let mut log = Vec::with_capacity(frames);
    for f in 0..frames {
        for y in 0..h {
            for x in 0..w {
                let i = y * w + x;
                let c = cur[i];
                next[i] = if is_edge(y, x, h, w) {
                    c
                } else {
                    stencil(c, cur[i - w], cur[i + w], cur[i - 1], cur[i + 1])
                };
            }
        }
        let rows: Vec<[f32; 2]> = next.chunks_exact(w).map(|r| row_stat(r.iter().copied())).collect();
        let p = probe_row(h) * w;
        history[(f % HISTORY) * w..][..w].copy_from_slice(&next[p..p + w]);
        if takes_snapshot(f) {
            snapshot.copy_from_slice(&next);
        }
        let (heat, max) = fold_rows(&rows);
        log.push(FrameStat { frame: f, heat, max });
        std::mem::swap(&mut cur, &mut next);
    }
    Reference { grid: cur, history, snapshot, log }
}

// ---------------------------------------------------------------------------------

/// Number of differing elements and the largest absolute difference.
fn compare(got: &[f32], want: &[f32]) -> (usize, f32) {
    got.iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .fold((0, 0.0f32), |(n, d), (a, b)| (n + 1, d.max((a - b).abs())))
}

/// A device that flushes `f32` denormals to zero (a Vulkan driver may, where the
/// device cannot keep them) computes other bits than the host wherever a denormal
/// took part: the difference spreads through the grid over the frames, but stays
/// below the denormals' own size, far below 2^-100 (this bound).
const FLUSHED: f32 = 7.888_609e-31;

/// [`compare`], counting apart the elements whose difference is below [`FLUSHED`]:
/// (differing by more, the largest difference among those, differing by less).
fn compare_flushed(got: &[f32], want: &[f32]) -> (usize, f32, usize) {
    let pairs = || got.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits());
    let small = |a: f32, b: f32| (a - b).abs() < FLUSHED;
    let below = pairs().filter(|(a, b)| small(**a, **b)).count();
    let (bigger, max) = pairs()
        .filter(|(a, b)| !small(**a, **b))
        .fold((0, 0.0f32), |(n, d), (a, b)| (n + 1, d.max((a - b).abs())));
    (bigger, max, below)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// What one run of the loop measured, for `--fusion`'s and `--graph`'s comparisons.
struct Pass {
    mean_frame_ms: f64,
    /// The queue's last fusion.
    outcome: Option<FusionOutcome>,
    cache: Option<CacheStats>,
    /// Kernel chains graph fusion fused, over the recorded graphs.
    fused_chains: Vec<(Vec<u32>, String)>,
    /// Why graph fusion fused no more, over the recorded graphs.
    not_fused: Vec<gantry::NotFused>,
    /// What the run left: final grid, probe history, snapshot, frame stats.
    outputs: Outputs,
}

/// A run's results, for comparing runs with each other.
struct Outputs {
    grid: Vec<f32>,
    history: Vec<f32>,
    snapshot: Vec<f32>,
    log: Vec<FrameStat>,
}

/// Checks a run's results against the eager run's, bit for bit; prints what differs.
fn same_outputs(label: &str, got: &Outputs, eager: &Outputs) -> bool {
    let mut ok = true;
    for (what, a, b) in [
        ("final grid", &got.grid, &eager.grid),
        ("probe history", &got.history, &eager.history),
        ("snapshot", &got.snapshot, &eager.snapshot),
    ] {
        let (n, max_diff) = compare(a, b);
        if n > 0 {
            eprintln!("{label}: FAILED: {what}: {n} elements differ from the eager run, max difference {max_diff:e}");
            ok = false;
        }
    }
    let bits = |l: &[FrameStat]| -> Vec<(usize, u32, u32)> {
        l.iter().map(|s| (s.frame, s.heat.to_bits(), s.max.to_bits())).collect()
    };
    if bits(&got.log) != bits(&eager.log) {
        eprintln!("{label}: FAILED: frame stats differ from the eager run");
        ok = false;
    }
    if ok {
        println!(
            "{label}: bit-identical to the eager run (grid, probe history, snapshot, {} frame stats)",
            got.log.len()
        );
    }
    ok
}

/// `--graph` (and `--graph --fusion`): eager, graph and (with fusion) fused-graph runs.
fn graph_main(o: &Options, want: &mut Option<(Reference, f64)>) -> ExitCode {
    let (h, w) = (o.size, o.size);
    let kernels = if o.fusion { Kernels::RowGroups } else { Kernels::Default };
    if o.fusion {
        let groups = Sim::row_group_range(h, w);
        let (gl, gw) = (groups.local.get(0), groups.local.get(1));
        println!(
            "\n--graph --fusion: stencil and row_stats as 2-D ND-ranges [{h}, {w}] with {gl}x{gw} work-groups \
             (whole rows) in every run"
        );
    }
    println!("\neager run (each frame: stencil, row_stats, probe_copy, [snapshot], frame_stats):");
    let Some(eager) = run(o, kernels, None, want) else { return ExitCode::FAILURE };
    println!(
        "\ngraph run (stencil, row_stats, frame_stats recorded once per grid parity; each frame: \
         submit_graph, probe_copy, [snapshot]):"
    );
    let Some(graph) = run(o, kernels, Some(GraphProps::default()), want) else { return ExitCode::FAILURE };
    let mut ok = same_outputs("graph", &graph.outputs, &eager.outputs);
    let fused = if o.fusion {
        println!("\nfused graph run (the same graphs finalized with GraphProps::default().fused()):");
        let Some(fused) = run(o, kernels, Some(GraphProps::default().fused()), want) else {
            return ExitCode::FAILURE;
        };
        ok &= same_outputs("fused graph", &fused.outputs, &eager.outputs);
        Some(fused)
    } else {
        None
    };

    let ratio = |p: &Pass| p.mean_frame_ms / eager.mean_frame_ms;
    match &fused {
        None => println!(
            "\ngraph: mean frame time eager {:.3} ms, graph {:.3} ms: graph/eager {:.3}x",
            eager.mean_frame_ms,
            graph.mean_frame_ms,
            ratio(&graph)
        ),
        Some(f) => {
            println!(
                "\ngraph: mean frame time eager {:.3} ms, graph {:.3} ms, fused graph {:.3} ms: \
                 graph/eager {:.3}x, fused graph/eager {:.3}x",
                eager.mean_frame_ms,
                graph.mean_frame_ms,
                f.mean_frame_ms,
                ratio(&graph),
                ratio(f)
            );
            let chains: Vec<String> =
                f.fused_chains.iter().map(|(nodes, name)| format!("nodes {nodes:?} as `{name}`")).collect();
            println!(
                "graph fusion: {} chain(s) fused over the 2 graphs{}{}",
                f.fused_chains.len(),
                if chains.is_empty() { String::new() } else { format!(": {}", chains.join("; ")) },
                if f.not_fused.is_empty() {
                    String::new()
                } else {
                    format!("; not fused: {:?}", f.not_fused)
                },
            );
            // A chain the CPU judges not to pay (global intermediates the caches hold
            // whole) stays unfused and says so: a valid result.
            let refused = f.not_fused.iter().any(|n| {
                matches!(
                    n,
                    gantry::NotFused::Refused { reason: gantry::FusionError::Unprofitable { .. }, .. }
                )
            });
            if f.fused_chains.is_empty() && !refused {
                eprintln!("graph fusion: FAILED: no chain was fused");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let o = parse_options();
    let (h, w) = (o.size, o.size);
    println!(
        "frame_loop: {w}x{h} heat diffusion on the {}, kernels {:?}, {} frames, CPU worker threads: {}, {} in flight{}",
        if o.cuda {
            "CUDA device"
        } else if o.vulkan {
            "Vulkan device"
        } else {
            "CPU"
        },
        o.kernels,
        o.frames,
        o.threads.map_or("default".to_string(), |t| t.to_string()),
        o.inflight,
        if o.preserve { "" } else { ", no failure snapshots" },
    );
    // The serial run, made once and shared by the runs it verifies.
    let mut want = None;
    if o.graph {
        return graph_main(&o, &mut want);
    }
    if !o.fusion {
        return match run(&o, Kernels::Default, None, &mut want) {
            Some(_) => ExitCode::SUCCESS,
            None => ExitCode::FAILURE,
        };
    }

    let groups = Sim::row_group_range(h, w);
    let (gl, gw) = (groups.local.get(0), groups.local.get(1));
    println!(
        "\n--fusion: stencil and row_stats as 2-D ND-ranges [{h}, {w}] with {gl}x{gw} work-groups (whole rows)\n\
         unfused run:"
    );
    let Some(unfused) = run(&o, Kernels::RowGroups, None, &mut want) else { return ExitCode::FAILURE };
    println!("\nfused run (each frame: start_fusion, stencil, row_stats, complete_fusion):");
    let Some(fused) = run(&o, Kernels::Fused, None, &mut want) else { return ExitCode::FAILURE };

    println!(
        "\nfusion: mean frame time unfused {:.3} ms, fused {:.3} ms: fused/unfused {:.3}x",
        unfused.mean_frame_ms,
        fused.mean_frame_ms,
        fused.mean_frame_ms / unfused.mean_frame_ms
    );
    let last = match &fused.outcome {
        Some(FusionOutcome::Fused { kernels, cached, warnings }) => format!(
            "fused {kernels} kernels, plan {}{}",
            if *cached { "from the cache" } else { "built (cache miss)" },
            if warnings.is_empty() { String::new() } else { format!(", warnings: {warnings:?}") }
        ),
        Some(FusionOutcome::Cancelled(reason)) => format!("cancelled: {reason}"),
        None => "undecided".to_string(),
    };
    let cache = fused.cache.unwrap_or_default();
    // Every fusion the compiler answered is a cache hit or a miss; a cancelled one
    // never reaches it.
    let fused_frames = cache.hits + cache.misses;
    println!(
        "fusion: last frame {last}; fusion cache {} hits, {} misses: {fused_frames} of {} frames fused",
        cache.hits, cache.misses, o.frames
    );
    // A window the CPU judges not to pay runs its kernels unfused from its first kernel
    // on, and says so (on a core whose L2 holds the grid twice over): a valid result.
    let refused = matches!(
        &fused.outcome,
        Some(FusionOutcome::Cancelled(gantry::CancelReason::Failed(
            gantry::FusionError::Unprofitable { .. }
        )))
    );
    if fused_frames == 0 && !refused {
        eprintln!("fusion: FAILED: no frame was fused");
        return ExitCode::FAILURE;
    }
    if fused_frames == 0 {
        return ExitCode::SUCCESS;
    }
    if fused_frames < o.frames as u64 {
        // Seen when the scheduler thread ingests a frame's complete_fusion and the
        // next frame's start_fusion in one flush (typically frames 0 and 1): the
        // earlier list is replaced before the fuse stage runs, and its kernels run
        // unfused with no warning and no outcome. Results are unaffected.
        println!(
            "fusion: warning: {} frame(s) ran unfused without a cancellation (a fusion completed and \
             replaced by the next start_fusion before the scheduler fused it)",
            o.frames as u64 - fused_frames
        );
    }
    ExitCode::SUCCESS
}

/// Runs the frame loop with `kernels` on a new runtime, prints its frame times and
/// verifies it against the serial run (made on first use into `want`). With `graph`,
/// the frame's kernels and host task are recorded into graphs finalized with those
/// properties, and replayed. `None` if it failed or differs.
fn run(
    o: &Options,
    kernels: Kernels,
    graph: Option<GraphProps>,
    want: &mut Option<(Reference, f64)>,
) -> Option<Pass> {
    let (h, w) = (o.size, o.size);
    // Profiling: the report's frame times, latencies and per-command run times are
    // the events' timestamps.
    let mut builder = Runtime::builder().preserve_on_failure(o.preserve).profiling(true);
    if let Some(t) = o.threads {
        builder = builder.worker_threads(t);
    }
    #[cfg(feature = "cuda")]
    if o.cuda {
        builder = builder.cuda(0);
    }
    #[cfg(feature = "vulkan")]
    if o.vulkan {
        builder = builder.vulkan(0);
    }
    let rt = match builder.try_build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("the runtime did not start: {e}");
            return None;
        }
    };
    // The GPU is the last device registered.
    let gpu = o.cuda || o.vulkan;
    let device = if gpu { rt.devices().len() as DeviceId - 1 } else { 0 };
    if gpu {
        println!("kernels and copies on {}", rt.devices()[device as usize].name);
    }
    let images = match o.kernels {
        KernelSource::Closure => None,
        KernelSource::CudaC => Some(kernels::ImageKernels::cuda_c()),
        KernelSource::Wgsl => Some(kernels::ImageKernels::wgsl()),
        #[cfg(feature = "jit")]
        KernelSource::OpenCl => match kernels::ImageKernels::opencl_c() {
            Ok(k) => Some(k),
            Err(e) => {
                eprintln!("the OpenCL C kernels did not compile: {e}");
                return None;
            }
        },
        #[cfg(not(feature = "jit"))]
        KernelSource::OpenCl => unreachable!("refused when the options were read"),
    };
    let mut sim = Sim::new(&rt, (h, w), kernels, device, images);
    let (mut fused_chains, mut not_fused) = (Vec::new(), Vec::new());
    if let Some(props) = graph {
        let t = Instant::now();
        if let Err(e) = sim.record_graphs(&rt, props) {
            eprintln!("recording the frame graphs failed: {e}");
            return None;
        }
        let graphs = sim.graphs.as_ref().expect("recorded");
        for exec in graphs {
            fused_chains.extend(exec.fused_chains());
            not_fused.extend(exec.not_fused());
        }
        let parts = graphs[0].partitions();
        println!(
            "recorded and finalized 2 graphs in {:.3} ms: {} nodes each, in {} partitions ({} host task){}",
            t.elapsed().as_secs_f64() * 1e3,
            graphs[0].order().len(),
            parts.len(),
            parts.iter().filter(|p| p.host_task).count(),
            if props.fusion.is_some() {
                format!(", {} chain(s) fused", fused_chains.len())
            } else {
                String::new()
            },
        );
    }

    // The loop: wait for frame f - inflight, submit frame f.
    let mut submitted_ns = Vec::with_capacity(o.frames);
    let mut frames: Vec<Vec<Event>> = Vec::with_capacity(o.frames);
    let start = Instant::now();
    for f in 0..o.frames {
        if f >= o.inflight {
            let oldest = frames[f - o.inflight].last().expect("a frame has commands");
            if let Err(e) = oldest.wait() {
                eprintln!("frame {}: {e}", f - o.inflight);
                return None;
            }
        }
        submitted_ns.push(rt.now_ns());
        match sim.submit_frame(f) {
            Ok(events) => frames.push(events),
            Err(e) => {
                eprintln!("frame {f}: submit failed: {e}");
                return None;
            }
        }
    }
    if let Err(e) = sim.q.wait() {
        eprintln!("frame loop failed: {e}");
        return None;
    }
    let wall = start.elapsed();

    // Frame time: from one frame's completion to the next's (the first: from its
    // submission). Latency: from a frame's submission to its completion.
    let ended: Vec<u64> =
        frames.iter().map(|ev| ev.last().map_or(0, |e| e.timestamps().map_or(0, |t| t.ended_ns))).collect();
    let commands: usize = frames.iter().map(Vec::len).sum();
    let frame_ms: Vec<f64> = (0..o.frames)
        .map(|f| {
            let from = if f == 0 { submitted_ns[0] } else { ended[f - 1] };
            ended[f].saturating_sub(from) as f64 / 1e6
        })
        .collect();
    let latency_ms: Vec<f64> =
        (0..o.frames).map(|f| ended[f].saturating_sub(submitted_ns[f]) as f64 / 1e6).collect();
    let log = sim.log.lock().unwrap().clone();

    println!(
        "{:>11}  {:>10}  {:>10}  {:>12}  {:>9}",
        "frames", "mean ms", "max ms", "total heat", "max temp"
    );
    for start in (0..o.frames).step_by(o.report) {
        let end = (start + o.report).min(o.frames);
        let window = &frame_ms[start..end];
        let mean = window.iter().sum::<f64>() / window.len() as f64;
        let max = window.iter().copied().fold(0.0, f64::max);
        let last = log.iter().find(|s| s.frame == end - 1);
        let (heat, temp) = last.map_or((f32::NAN, f32::NAN), |s| (s.heat, s.max));
        println!("{:>11}  {mean:>10.3}  {max:>10.3}  {heat:>12.1}  {temp:>9.2}", format!("{start}..{end}"));
    }
    let mut sorted = frame_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let mean = frame_ms.iter().sum::<f64>() / o.frames as f64;
    let mean_latency = latency_ms.iter().sum::<f64>() / o.frames as f64;
    println!(
        "frame time: mean {mean:.3} ms, p50 {:.3} ms, p99 {:.3} ms; latency (submit to done) mean {mean_latency:.3} ms",
        percentile(&sorted, 0.5),
        percentile(&sorted, 0.99),
    );
    // Where a frame's time goes: each kind of command's mean run time.
    let mut busy: Vec<(String, f64, usize)> = Vec::new();
    // (A fused frame's kernels have no events of their own, only the fusion's, which
    // ends when the fused kernel does: the frame time covers them. A replay's event,
    // a frame's last with graphs, is that of the graph's last partition, the host task.)
    let replayed = sim.graphs.is_some();
    for ev in &frames {
        for (i, e) in ev.iter().enumerate().filter(|(_, e)| e.name() != "fusion") {
            let t = e.timestamps().unwrap_or_default();
            let ms = t.ended_ns.saturating_sub(t.started_ns) as f64 / 1e6;
            let name = if replayed && i + 1 == ev.len() { "replay's frame_stats" } else { e.name() };
            match busy.iter_mut().find(|(n, ..)| n == name) {
                Some((_, total, n)) => (*total, *n) = (*total + ms, *n + 1),
                None => busy.push((name.to_string(), ms, 1)),
            }
        }
    }
    let parts: Vec<String> =
        busy.iter().map(|(name, total, n)| format!("{name} {:.3}", total / *n as f64)).collect();
    println!("mean run time per command, ms: {}", parts.join(", "));
    let secs = wall.as_secs_f64();
    println!(
        "{commands} {} in {:.3} s: {:.0} commands/s, {:.1} frames/s",
        if replayed { "submissions (a replay counts as one)" } else { "commands" },
        secs,
        commands as f64 / secs,
        o.frames as f64 / secs
    );

    // Verification against the serial run.
    let (want, serial) = want.get_or_insert_with(|| {
        let t = Instant::now();
        let r = reference(h, w, o.frames);
        (r, t.elapsed().as_secs_f64())
    });
    let read = |b: &Buffer<f32>| b.to_vec().expect("reading back a buffer");
    // On Vulkan, values may differ by less than 2^-100 where the device flushes
    // denormals.
    let checked = |got: &[f32], want: &[f32]| {
        if o.vulkan {
            compare_flushed(got, want)
        } else {
            let (n, d) = compare(got, want);
            (n, d, 0)
        }
    };
    let checks = [
        ("final grid", checked(&read(&sim.grids[o.frames % 2]), &want.grid)),
        ("probe history", checked(&read(&sim.history), &want.history)),
        ("snapshot", checked(&read(&sim.snapshot), &want.snapshot)),
    ];
    let mut ok = true;
    let mut flushed = 0;
    for (what, (n, max_diff, below)) in checks {
        flushed += below;
        if n > 0 {
            eprintln!("verified: FAILED: {what}: {n} elements differ, max difference {max_diff:e}");
            ok = false;
        }
    }
    if log != want.log {
        let max_diff = log
            .iter()
            .zip(&want.log)
            .map(|(a, b)| (a.heat - b.heat).abs().max((a.max - b.max).abs()))
            .fold(if log.len() == want.log.len() { 0.0f32 } else { f32::INFINITY }, f32::max);
        eprintln!(
            "verified: FAILED: frame stats differ ({} recorded, {} expected), max difference {max_diff:e}",
            log.len(),
            want.log.len()
        );
        ok = false;
    }
    if !ok {
        return None;
    }
    println!(
        "verified: OK (grid, probe history, snapshot and {} frame stats bit-identical to the serial run{}: {:.3} ms/frame)",
        log.len(),
        if flushed > 0 {
            format!(" except {flushed} values off by less than 2^-100: the device flushes denormals to zero")
        } else {
            String::new()
        },
        *serial * 1e3 / o.frames as f64
    );
    let outputs = Outputs {
        grid: read(&sim.grids[o.frames % 2]),
        history: read(&sim.history),
        snapshot: read(&sim.snapshot),
        log,
    };
    Some(Pass {
        mean_frame_ms: mean,
        outcome: sim.q.fusion_outcome(),
        cache: rt.fusion_cache_stats(),
        fused_chains,
        not_fused,
        outputs,
    })
}
