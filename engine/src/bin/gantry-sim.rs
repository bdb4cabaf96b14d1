//! `gantry-sim`: runs a workload file on a simulated machine and reports what the
//! scheduler made of it.
//!
//! ```text
//! gantry-sim WORKLOAD.json MACHINE.json [--frames N] [--mode eager|graph|fused-graph]
//!            [--ready fifo|lifo] [--linearizer reverse-dfs|breadth-first] [--trace OUT.json]
//!            [--timing-only]
//! ```
//!
//! The machine file lists simulated devices (latency, memory, cost model), the
//! bandwidth of the links between them (`peer_bytes_per_ns`; without it, moves between
//! devices go through host memory) and optionally a modelled host thread pool
//! (`host`: threads, default task duration). The workload file lists buffers, queues
//! (each on one of those devices) and one frame's commands, repeated for `frames`
//! frames: kernels, copies, fills, barriers, host tasks, and fusion windows
//! (`start_fusion`, then kernels, then `complete_fusion` or `cancel_fusion`). Kernels
//! do real, deterministic work on the buffers they name and cost virtual time by their
//! work-item count; host tasks run on the host pool in virtual time if the machine has
//! one (else on the CPU, taking none) and pull their buffers back from the devices.
//!
//! `mode` (or `--mode`) runs the frame eagerly, or records it once into a command graph
//! (finalized plain or with graph fusion; fusion windows are skipped there) and
//! replays that every frame. Every mode computes the same data: the report's checksum
//! says so.
//!
//! The report (makespan, per-device utilization, bytes moved, command counts) is in the
//! devices' virtual time, so the same files give the same report, byte for byte. Two
//! policies to compare on one workload: `--ready lifo` adds a policy system to the
//! resolve stage that hands ready commands to the drivers newest first instead of
//! oldest first, and `--linearizer breadth-first` orders graph nodes breadth-first
//! instead of reverse depth-first at finalize. Progress goes to stderr on long runs,
//! and so does the wall time the run took.
//!
//! `--timing-only` models time without computing data (`SimConfig::timing_only`):
//! kernels, copies and fills take their virtual time on the devices but do not run, so
//! the report is the full run's but for the checksum, which is left out; a policy
//! study of many frames of large kernels runs orders of magnitude faster.
//!
//! The command line is clap's: `--help` lists the options and their values,
//! `--version` prints the version, and a missing file argument, an unknown option or
//! a bad value exits with status 2 and an error naming it. A file that cannot be read
//! or holds an invalid workload or machine also exits with status 2.

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use gantry::components::WorkLists;
use gantry::ecs::prelude::ResMut;
use gantry::{
    BreadthFirst, Buffer, CostModel, ExecutableGraph, FusionProps, GraphProps, HostPoolConfig, MachineConfig,
    Mode, Queue, QueueOptions, Runtime, SimConfig, Stage,
};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Machine {
    devices: Vec<DeviceSpec>,
    /// Device-to-device link bandwidth, bytes per ns (0: through host memory).
    #[serde(default)]
    peer_bytes_per_ns: f64,
    /// The modelled host thread pool.
    #[serde(default)]
    host: Option<HostSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostSpec {
    #[serde(default = "one_thread")]
    threads: u32,
    #[serde(default = "default_task")]
    task_ns: u64,
    #[serde(default)]
    latency_ns: u64,
    #[serde(default)]
    memory_bytes_per_ns: f64,
}

// Absent fields take the pool's own defaults.
fn one_thread() -> u32 {
    HostPoolConfig::default().threads
}
fn default_task() -> u64 {
    HostPoolConfig::default().task_ns
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceSpec {
    name: String,
    #[serde(default = "default_latency")]
    latency_ns: u64,
    #[serde(default = "default_memory")]
    memory_bytes: usize,
    #[serde(default)]
    cost: CostSpec,
}

fn default_latency() -> u64 {
    1_000
}
fn default_memory() -> usize {
    1 << 30
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CostSpec {
    #[serde(default)]
    item_ns: f64,
    #[serde(default)]
    compute_units: u32,
    #[serde(default)]
    memory_bytes_per_ns: f64,
    #[serde(default)]
    link_bytes_per_ns: f64,
    #[serde(default)]
    compute_engines: u32,
    #[serde(default)]
    copy_engines: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Workload {
    buffers: Vec<BufferSpec>,
    queues: Vec<QueueSpec>,
    #[serde(default = "one")]
    frames: usize,
    #[serde(default)]
    mode: RunMode,
    commands: Vec<CommandSpec>,
}

/// How frames are submitted (the workload's `mode`, in snake case, or `--mode`, in
/// kebab case).
#[derive(Deserialize, ValueEnum, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum RunMode {
    /// Every command, every frame.
    #[default]
    Eager,
    /// The frame recorded once into a command graph, replayed each frame.
    Graph,
    /// The same, finalized with graph fusion.
    #[value(alias = "fused_graph")]
    FusedGraph,
}

/// The order the resolve stage hands ready commands to the drivers (`--ready`).
#[derive(ValueEnum, Clone, Copy, PartialEq, Eq)]
enum ReadyOrder {
    /// Oldest first.
    Fifo,
    /// Newest first (a policy system reverses the ready list).
    Lifo,
}

/// The order graph nodes are linearized in at finalize (`--linearizer`).
#[derive(ValueEnum, Clone, Copy, PartialEq, Eq)]
enum Linearizer {
    /// Reverse depth-first.
    ReverseDfs,
    /// Breadth-first.
    BreadthFirst,
}

/// The name a value goes by on the command line and in the report.
fn value_name(value: impl ValueEnum) -> String {
    value.to_possible_value().expect("no variant is skipped").get_name().to_owned()
}

fn one() -> usize {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BufferSpec {
    name: String,
    /// Elements (u32).
    len: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueueSpec {
    name: String,
    /// Index into the machine's devices.
    device: usize,
    #[serde(default)]
    in_order: bool,
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum CommandSpec {
    Kernel {
        name: String,
        queue: String,
        items: usize,
        #[serde(default)]
        item_cost_ns: Option<f64>,
        #[serde(default)]
        reads: Vec<String>,
        #[serde(default)]
        writes: Vec<String>,
    },
    Copy {
        queue: String,
        src: String,
        dst: String,
    },
    Fill {
        queue: String,
        dst: String,
        value: u32,
    },
    HostTask {
        name: String,
        #[serde(default)]
        reads: Vec<String>,
        #[serde(default)]
        writes: Vec<String>,
        /// Duration on the host pool, ns (default: the pool's).
        #[serde(default)]
        cost_ns: Option<f64>,
    },
    Barrier {
        queue: String,
    },
    StartFusion {
        queue: String,
    },
    CompleteFusion {
        queue: String,
        #[serde(default)]
        no_barriers: bool,
    },
    CancelFusion {
        queue: String,
    },
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("gantry-sim: {msg}");
    ExitCode::from(2)
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &str) -> Result<T, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))
}

struct World<'a> {
    buffers: HashMap<&'a str, Buffer<u32>>,
    queues: HashMap<&'a str, Queue>,
    host: Queue,
}

impl World<'_> {
    fn buffer(&self, name: &str) -> Result<&Buffer<u32>, String> {
        self.buffers.get(name).ok_or_else(|| format!("unknown buffer `{name}`"))
    }
    fn queue(&self, name: &str) -> Result<&Queue, String> {
        self.queues.get(name).ok_or_else(|| format!("unknown queue `{name}`"))
    }
}

/// Submits one command of the frame (a fusion-window step applies to its queue;
/// `recording` skips those, since a recording queue cannot fuse).
fn submit(w: &World<'_>, cmd: &CommandSpec, recording: bool) -> Result<(), String> {
    let result = match cmd {
        CommandSpec::Kernel { name, queue, items, item_cost_ns, reads, writes } => {
            let reads: Vec<&Buffer<u32>> = reads
                .iter()
                .filter(|r| !writes.contains(r))
                .map(|r| w.buffer(r))
                .collect::<Result<_, _>>()?;
            let read_writes: Vec<&Buffer<u32>> =
                writes.iter().map(|r| w.buffer(r)).collect::<Result<_, _>>()?;
            let items = *items;
            w.queue(queue)?.submit(|cg| {
                cg.name(name.clone());
                if let Some(c) = item_cost_ns {
                    cg.item_cost_ns(*c);
                }
                let ins: Vec<_> = reads.iter().map(|b| (cg.read(b), b.len())).collect();
                let outs: Vec<_> = read_writes.iter().map(|b| (cg.read_write(b), b.len())).collect();
                cg.parallel_for(items.max(1), move |it| {
                    let i = it.global_linear_id();
                    let mut v = i as u32;
                    for (a, len) in &ins {
                        v = v.wrapping_mul(31).wrapping_add(a.get(it, i % len));
                    }
                    for (a, len) in &outs {
                        if i < *len {
                            a.set(it, i, a.get(it, i).wrapping_add(v));
                        }
                    }
                });
            })
        }
        CommandSpec::Copy { queue, src, dst } => {
            let (s, d) = (w.buffer(src)?, w.buffer(dst)?);
            let len = s.len().min(d.len());
            w.queue(queue)?.submit(|cg| cg.copy_range(s, 0, d, 0, len))
        }
        CommandSpec::Fill { queue, dst, value } => {
            let d = w.buffer(dst)?;
            w.queue(queue)?.submit(|cg| cg.fill(d, *value))
        }
        CommandSpec::HostTask { name, reads, writes, cost_ns } => {
            let reads: Vec<&Buffer<u32>> = reads
                .iter()
                .filter(|r| !writes.contains(r))
                .map(|r| w.buffer(r))
                .collect::<Result<_, _>>()?;
            let writes: Vec<&Buffer<u32>> = writes.iter().map(|r| w.buffer(r)).collect::<Result<_, _>>()?;
            w.host.submit(|cg| {
                cg.name(name.clone());
                if let Some(c) = cost_ns {
                    cg.item_cost_ns(*c);
                }
                let ins: Vec<_> = reads.iter().map(|b| cg.host_read(b)).collect();
                let mut outs: Vec<_> = writes.iter().map(|b| cg.host_read_write(b)).collect();
                cg.host_task(move |ctx| {
                    let sum = ins.iter().flat_map(|a| a.as_slice(ctx)).fold(1u32, |s, &x| s.wrapping_add(x));
                    for o in &mut outs {
                        if let Some(first) = o.as_mut_slice(ctx).first_mut() {
                            *first = first.wrapping_add(sum);
                        }
                    }
                });
            })
        }
        CommandSpec::Barrier { queue } => w.queue(queue)?.barrier(),
        CommandSpec::StartFusion { queue }
        | CommandSpec::CompleteFusion { queue, .. }
        | CommandSpec::CancelFusion { queue }
            if recording =>
        {
            w.queue(queue)?;
            return Ok(());
        }
        CommandSpec::StartFusion { queue } => {
            return w.queue(queue)?.start_fusion().map_err(|e| e.to_string())
        }
        CommandSpec::CompleteFusion { queue, no_barriers } => {
            w.queue(queue)?.complete_fusion(FusionProps { barriers: !no_barriers })
        }
        CommandSpec::CancelFusion { queue } => {
            w.queue(queue)?.cancel_fusion();
            return Ok(());
        }
    };
    result.map(|_| ()).map_err(|e| e.to_string())
}

/// Records one frame into a command graph on the first queue's device and finalizes
/// it.
fn record(
    w: &World<'_>,
    rt: &Runtime,
    workload: &Workload,
    mode: RunMode,
) -> Result<ExecutableGraph, String> {
    let first = w.queue(&workload.queues[0].name)?;
    let graph = rt.graph_on(first.device());
    let mut queues: Vec<&Queue> = w.queues.values().collect();
    queues.push(&w.host);
    queues.sort_by_key(|q| q.id());
    for q in &queues {
        graph.begin_recording(q).map_err(|e| e.to_string())?;
    }
    for cmd in &workload.commands {
        submit(w, cmd, true)?;
    }
    for q in &queues {
        graph.end_recording(q).map_err(|e| e.to_string())?;
    }
    let props =
        if mode == RunMode::FusedGraph { GraphProps::default().fused() } else { GraphProps::default() };
    graph.finalize(props).map_err(|e| e.to_string())
}

/// FNV-1a over every buffer's contents, in the workload's order.
fn checksum(w: &World<'_>, workload: &Workload) -> Result<u64, String> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in &workload.buffers {
        for x in w.buffer(&b.name)?.to_vec().map_err(|e| e.to_string())? {
            for byte in x.to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    Ok(h)
}

/// Total length of the union of `[start, end)` intervals.
fn busy_ns(mut spans: Vec<(u64, u64)>) -> u64 {
    spans.sort_unstable();
    let (mut total, mut cur) = (0, None::<(u64, u64)>);
    for (s, e) in spans {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    total + cur.map_or(0, |(s, e)| e - s)
}

/// Runs a workload file on a simulated machine and reports what the scheduler made
/// of it, in the devices' virtual time.
#[derive(Parser)]
#[command(name = "gantry-sim", version)]
struct Options {
    /// The workload: buffers, queues and one frame's commands.
    #[arg(value_name = "WORKLOAD.json")]
    workload: String,
    /// The machine: simulated devices, their links and an optional host pool.
    #[arg(value_name = "MACHINE.json")]
    machine: String,
    /// Frames to run [default: the workload's `frames`].
    #[arg(long, value_name = "N")]
    frames: Option<usize>,
    /// How frames are submitted [default: the workload's `mode`].
    #[arg(long, value_enum)]
    mode: Option<RunMode>,
    /// The order ready commands go to the drivers.
    #[arg(long, value_enum, default_value_t = ReadyOrder::Fifo)]
    ready: ReadyOrder,
    /// The order graph nodes are linearized in at finalize.
    #[arg(long, value_enum, default_value_t = Linearizer::ReverseDfs)]
    linearizer: Linearizer,
    /// Writes the run's timeline as a Chrome trace.
    #[arg(long, value_name = "OUT.json")]
    trace: Option<String>,
    /// Models time without computing data (the report leaves out the checksum).
    #[arg(long)]
    timing_only: bool,
}

/// The runtime the machine file describes: device 0 the CPU, then the simulated
/// devices in file order, then the host pool if there is one.
fn build(machine: &Machine, opts: &Options) -> Runtime {
    let mut builder = Runtime::builder().mode(Mode::Manual).worker_threads(0).host_threads(0).timeline(true);
    for d in &machine.devices {
        let c = &d.cost;
        let cost = CostModel {
            item_ns: c.item_ns,
            compute_units: c.compute_units,
            memory_bytes_per_ns: c.memory_bytes_per_ns,
            link_bytes_per_ns: c.link_bytes_per_ns,
            compute_engines: c.compute_engines,
            copy_engines: c.copy_engines,
        };
        builder = builder.sim(SimConfig {
            name: d.name.clone(),
            latency_ns: d.latency_ns,
            memory_bytes: d.memory_bytes,
            cost,
            timing_only: opts.timing_only,
            ..Default::default()
        });
    }
    let host = machine.host.as_ref().map(|h| HostPoolConfig {
        threads: h.threads,
        task_ns: h.task_ns,
        latency_ns: h.latency_ns,
        memory_bytes_per_ns: h.memory_bytes_per_ns,
    });
    builder = builder.sim_machine(MachineConfig { peer_bytes_per_ns: machine.peer_bytes_per_ns, host });
    if opts.linearizer == Linearizer::BreadthFirst {
        builder = builder.linearizer(std::sync::Arc::new(BreadthFirst));
    }
    let rt = builder.build();
    if opts.ready == ReadyOrder::Lifo {
        rt.add_system(Stage::Resolve, |mut lists: ResMut<WorkLists>| lists.ready.reverse());
    }
    rt
}

fn run(opts: &Options) -> Result<String, String> {
    let workload: Workload = read_json(&opts.workload)?;
    let machine: Machine = read_json(&opts.machine)?;
    if machine.devices.is_empty() {
        return Err(format!("{}: no devices", opts.machine));
    }
    if workload.queues.is_empty() {
        return Err(format!("{}: no queues", opts.workload));
    }
    let frames = opts.frames.unwrap_or(workload.frames);
    let mode = opts.mode.unwrap_or(workload.mode);

    let rt = build(&machine, opts);
    let mut queues = HashMap::new();
    for q in &workload.queues {
        if q.device >= machine.devices.len() {
            return Err(format!("queue `{}`: no device {}", q.name, q.device));
        }
        let options = QueueOptions { device: q.device as u32 + 1, in_order: q.in_order };
        queues.insert(q.name.as_str(), rt.queue_with(options).map_err(|e| e.to_string())?);
    }
    let buffers =
        workload.buffers.iter().map(|b| (b.name.as_str(), rt.buffer_zeroed::<u32>(b.len.max(1)))).collect();
    // Host tasks go to the host pool when the machine models one.
    let pool = machine.host.as_ref().map(|_| machine.devices.len() as u32 + 1);
    let host = match pool {
        Some(device) => rt.queue_with(QueueOptions { device, in_order: false }).map_err(|e| e.to_string())?,
        None => rt.queue(),
    };
    let world = World { buffers, queues, host };
    let graph = match mode {
        RunMode::Eager => None,
        _ => Some(record(&world, &rt, &workload, mode)?),
    };
    let report_every = (frames / 10).max(1);
    let started = std::time::Instant::now();
    let completed_before = rt.stats().completed;
    for frame in 0..frames {
        match &graph {
            None => {
                for cmd in &workload.commands {
                    submit(&world, cmd, false)?;
                }
            }
            Some(exec) => {
                world.queue(&workload.queues[0].name)?.submit_graph(exec).map_err(|e| e.to_string())?;
            }
        }
        rt.wait_idle().map_err(|e| e.to_string())?;
        if frames >= 100 && (frame + 1) % report_every == 0 {
            eprintln!("gantry-sim: frame {}/{frames}", frame + 1);
        }
    }
    // Wall time varies from run to run: it goes to stderr, beside the progress lines,
    // so the report itself stays deterministic.
    let wall = started.elapsed().as_secs_f64();
    let simulated = rt.stats().completed - completed_before;
    eprintln!(
        "gantry-sim: {simulated} commands simulated in {wall:.3} s of wall time ({:.0} per second)",
        simulated as f64 / wall.max(1e-9)
    );
    if let Some(path) = &opts.trace {
        rt.write_chrome_trace(path).map_err(|e| format!("{path}: {e}"))?;
    }
    let mut out = report(&rt, &machine, opts, frames, mode);
    if let Some(g) = &graph {
        let chains: Vec<String> = g.fused_chains().into_iter().map(|(_, name)| name).collect();
        out += &format!(
            "graph: {} partitions, {} fused chains {chains:?}\n",
            g.partitions().len(),
            chains.len()
        );
    }
    // Read back after reporting, so the report holds only the workload's commands.
    if opts.timing_only {
        out += "checksum: none (timing only: no data was computed)\n";
    } else {
        out += &format!("checksum: {:016x}\n", checksum(&world, &workload)?);
    }
    Ok(out)
}

fn report(rt: &Runtime, machine: &Machine, opts: &Options, frames: usize, mode: RunMode) -> String {
    let timeline = rt.timeline().expect("recording");
    let stats = rt.stats();
    let on_devices: Vec<_> = timeline.slices.iter().filter(|s| s.device > 0).collect();
    let start = on_devices.iter().map(|s| s.start_ns).min().unwrap_or(0);
    let end = on_devices.iter().map(|s| s.end_ns).max().unwrap_or(0);
    let makespan = end - start;
    let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
    for s in &timeline.slices {
        *kinds.entry(s.kind.name()).or_default() += 1;
    }
    let mut out = String::new();
    let (mode, policy, order) = (value_name(mode), value_name(opts.ready), value_name(opts.linearizer));
    out += &format!(
        "workload {} on {}: {frames} frames, {mode}, ready order {policy}, graph order {order}\n",
        opts.workload, opts.machine
    );
    let counts: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    out += &format!("commands: {} ({}), failed {}\n", timeline.slices.len(), counts.join(", "), stats.failed);
    out += &format!("fusions: {} fused, {} cancelled\n", stats.fusions_fused, stats.fusions_cancelled);
    out += &format!("makespan: {:.3} us (virtual)\n", makespan as f64 / 1e3);
    let percent = |busy: u64| if makespan > 0 { 100.0 * busy as f64 / makespan as f64 } else { 0.0 };
    let mut devices: Vec<(&str, u32, &str)> =
        machine.devices.iter().map(|d| (d.name.as_str(), d.cost.compute_engines, "compute engine")).collect();
    if let Some(h) = &machine.host {
        devices.push(("host pool", h.threads.max(1), "thread"));
    }
    for (i, (name, compute_engines, unit)) in devices.into_iter().enumerate() {
        let device = i as u32 + 1;
        let mine: Vec<_> = on_devices.iter().filter(|s| s.device == device).collect();
        out += &format!("device {device} {name}: {} commands\n", mine.len());
        // Lanes are engines: compute engines first, then copy engines (the sim's
        // numbering; a host pool's threads are its compute engines); lane 0 holds
        // work that needs no engine or unlimited engines.
        let lanes: std::collections::BTreeSet<u32> = mine.iter().map(|s| s.lane).collect();
        for lane in lanes {
            let busy =
                busy_ns(mine.iter().filter(|s| s.lane == lane).map(|s| (s.start_ns, s.end_ns)).collect());
            let engine = match lane {
                0 => "no engine (markers, or unlimited engines)".to_owned(),
                l if l <= compute_engines => format!("{unit} {}", l - 1),
                l => format!("copy engine {}", l - 1 - compute_engines),
            };
            out += &format!("  {engine}: busy {:.3} us ({:.1}%)\n", busy as f64 / 1e3, percent(busy));
        }
    }
    let moved: u64 = timeline.slices.iter().filter(|s| s.kind.name() == "memory_move").map(|s| s.bytes).sum();
    let copied: u64 =
        timeline.slices.iter().filter(|s| s.kind.name().starts_with("copy")).map(|s| s.bytes).sum();
    out += &format!("bytes moved: {moved} between memories, {copied} by copies\n");
    out
}

fn main() -> ExitCode {
    // Help and version exit 0 here, a bad command line exits 2 with clap's error.
    let opts = Options::parse();
    match run(&opts) {
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}
