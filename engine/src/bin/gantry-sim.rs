//! `gantry-sim`: runs a workload file on a simulated machine and reports what the
//! scheduler made of it.
//!
//! ```text
//! gantry-sim WORKLOAD.json MACHINE.json [--frames N] [--ready fifo|lifo] [--trace OUT.json]
//! ```
//!
//! The machine file lists simulated devices (latency, memory, cost model); the
//! workload file lists buffers, queues (each on one of those devices) and one frame's
//! commands, repeated for `frames` frames. Kernels do real, deterministic work on the
//! buffers they name and cost virtual time by their work-item count; host tasks run on
//! the CPU (the host) and pull their buffers back from the devices.
//!
//! The report (makespan, per-device utilization, bytes moved, command counts) is in the
//! devices' virtual time, so the same files give the same report, byte for byte.
//! `--ready lifo` adds a policy system to the resolve stage that hands ready commands
//! to the drivers newest first instead of oldest first: a way to compare two
//! scheduling policies on one workload. Progress goes to stderr on long runs.

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;

use gantry::components::WorkLists;
use gantry::ecs::prelude::ResMut;
use gantry::{Buffer, CostModel, Mode, Queue, QueueOptions, Runtime, SimConfig, Stage};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Machine {
    devices: Vec<DeviceSpec>,
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
    commands: Vec<CommandSpec>,
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
    },
    Barrier {
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

/// Submits one command of the frame.
fn submit(w: &World<'_>, cmd: &CommandSpec, frame: u32) -> Result<(), String> {
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
                    let mut v = frame.wrapping_add(i as u32);
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
        CommandSpec::HostTask { name, reads, writes } => {
            let reads: Vec<&Buffer<u32>> = reads
                .iter()
                .filter(|r| !writes.contains(r))
                .map(|r| w.buffer(r))
                .collect::<Result<_, _>>()?;
            let writes: Vec<&Buffer<u32>> = writes.iter().map(|r| w.buffer(r)).collect::<Result<_, _>>()?;
            w.host.submit(|cg| {
                cg.name(name.clone());
                let ins: Vec<_> = reads.iter().map(|b| cg.host_read(b)).collect();
                let mut outs: Vec<_> = writes.iter().map(|b| cg.host_read_write(b)).collect();
                cg.host_task(move |ctx| {
                    let sum = ins.iter().flat_map(|a| a.as_slice(ctx)).fold(frame, |s, &x| s.wrapping_add(x));
                    for o in &mut outs {
                        if let Some(first) = o.as_mut_slice(ctx).first_mut() {
                            *first = first.wrapping_add(sum);
                        }
                    }
                });
            })
        }
        CommandSpec::Barrier { queue } => w.queue(queue)?.barrier(),
    };
    result.map(|_| ()).map_err(|e| e.to_string())
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

fn run(args: &[String]) -> Result<String, String> {
    let mut positional = Vec::new();
    let (mut frames, mut lifo, mut trace) = (None, false, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--frames" => {
                frames = Some(it.next().and_then(|v| v.parse().ok()).ok_or("--frames needs a number")?)
            }
            "--ready" => match it.next().map(String::as_str) {
                Some("fifo") => lifo = false,
                Some("lifo") => lifo = true,
                _ => return Err("--ready takes fifo or lifo".into()),
            },
            "--trace" => trace = Some(it.next().ok_or("--trace needs a path")?.clone()),
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            path => positional.push(path.to_owned()),
        }
    }
    let [workload_path, machine_path] = positional.as_slice() else {
        return Err("usage: gantry-sim WORKLOAD.json MACHINE.json [--frames N] [--ready fifo|lifo] [--trace OUT.json]".into());
    };
    let workload: Workload = read_json(workload_path)?;
    let machine: Machine = read_json(machine_path)?;
    if machine.devices.is_empty() {
        return Err(format!("{machine_path}: no devices"));
    }
    let frames = frames.unwrap_or(workload.frames);

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
            ..Default::default()
        });
    }
    let rt = builder.build();
    if lifo {
        rt.add_system(Stage::Resolve, |mut lists: ResMut<WorkLists>| lists.ready.reverse());
    }
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
    let world = World { buffers, queues, host: rt.queue() };
    let report_every = (frames / 10).max(1);
    for frame in 0..frames {
        for cmd in &workload.commands {
            submit(&world, cmd, frame as u32)?;
        }
        rt.wait_idle().map_err(|e| e.to_string())?;
        if frames >= 100 && (frame + 1) % report_every == 0 {
            eprintln!("gantry-sim: frame {}/{frames}", frame + 1);
        }
    }
    drop(world);
    rt.wait_idle().map_err(|e| e.to_string())?;
    if let Some(path) = &trace {
        rt.write_chrome_trace(path).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(report(&rt, &machine, workload_path, machine_path, frames, lifo))
}

fn report(
    rt: &Runtime,
    machine: &Machine,
    workload: &str,
    machine_path: &str,
    frames: usize,
    lifo: bool,
) -> String {
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
    let policy = if lifo { "lifo" } else { "fifo" };
    out += &format!("workload {workload} on {machine_path}: {frames} frames, ready order {policy}\n");
    let counts: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    out += &format!("commands: {} ({}), failed {}\n", timeline.slices.len(), counts.join(", "), stats.failed);
    out += &format!("makespan: {:.3} us (virtual)\n", makespan as f64 / 1e3);
    let percent = |busy: u64| if makespan > 0 { 100.0 * busy as f64 / makespan as f64 } else { 0.0 };
    for (i, d) in machine.devices.iter().enumerate() {
        let device = i as u32 + 1;
        let mine: Vec<_> = on_devices.iter().filter(|s| s.device == device).collect();
        out += &format!("device {device} {}: {} commands\n", d.name, mine.len());
        // Lanes are engines: compute engines first, then copy engines (the sim's
        // numbering); lane 0 holds work that needs no engine or unlimited engines.
        let lanes: std::collections::BTreeSet<u32> = mine.iter().map(|s| s.lane).collect();
        for lane in lanes {
            let busy =
                busy_ns(mine.iter().filter(|s| s.lane == lane).map(|s| (s.start_ns, s.end_ns)).collect());
            let engine = match lane {
                0 => "no engine (markers, or unlimited engines)".to_owned(),
                l if l <= d.cost.compute_engines => format!("compute engine {}", l - 1),
                l => format!("copy engine {}", l - 1 - d.cost.compute_engines),
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}
