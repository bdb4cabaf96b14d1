//! Running a program through Gantry, op by op ([`Session`], under a [`Config`]), and
//! comparing the outcome with the model's ([`check`]).

use gantry::{
    Accessor, CpuConfig, DiscardWrite, Event, FusionOutcome, FusionProps, HostAccessor, Item, NdRange, Queue,
    QueueOptions, Read, ReadWrite, Readback, Runtime, SimConfig, Write,
};

use crate::arith::{host_data, item_seed, mix, out_value, rw_value, write_mask};
use crate::fusion;
use crate::model::{digest, run_model, Outcome};
use crate::program::{dev_name, Cmd, Dev, Launch, Op, Program, WMode};
use crate::watch::{hang_timeout, run_watched};

/// How to build the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Scheduler mode.
    pub mode: gantry::Mode,
    /// CPU kernel worker threads.
    pub workers: usize,
    /// CPU host-task threads.
    pub host_threads: usize,
    /// CPU `inline_items`: kernels of one group up to this size, and copies and fills
    /// up to 4× this many bytes, run inline (0: everything goes to the pools).
    pub inline_items: usize,
    /// Add a simulated device (device 1). Without it, `Dev::Sim` submissions go to
    /// the CPU.
    pub sim: bool,
    /// Every fusion window passes its kernels through, unfused, from its first kernel
    /// on (a window threshold no kernel reaches), as the CPU driver does with windows
    /// that would not pay: the window's kernels run as they are submitted, and its
    /// event must still cover them. Graph finalize likewise leaves every recorded
    /// chain that promotes no accessor unfused (a memory threshold no chain reaches).
    pub pass_windows: bool,
}

impl Config {
    /// Manual mode, everything inline.
    pub fn manual(sim: bool) -> Config {
        Config {
            mode: gantry::Mode::Manual,
            workers: 0,
            host_threads: 0,
            inline_items: 0,
            sim,
            pass_windows: false,
        }
    }
    /// Threaded mode with `workers` kernel threads, two host-task threads, nothing inline.
    pub fn threaded(workers: usize, sim: bool) -> Config {
        Config {
            mode: gantry::Mode::Threaded,
            workers,
            host_threads: 2,
            inline_items: 0,
            sim,
            pass_windows: false,
        }
    }
    /// Builds the runtime.
    pub fn build(&self) -> Runtime {
        self.builder().build()
    }
    /// The runtime builder of [`Config::build`] (to add options). It fuses every form
    /// the fusion compiler accepts, those it refuses by default as slower fused
    /// included: the properties are about what fusion computes, and the model
    /// predicts fusion by the fusion rules alone. With [`Config::pass_windows`], no
    /// window fuses, nor a recorded chain without a promoted accessor.
    pub fn builder(&self) -> gantry::RuntimeBuilder {
        let mut b = Runtime::builder().fuse_unprofitable(true).mode(self.mode).cpu(CpuConfig {
            worker_threads: self.workers,
            host_threads: self.host_threads,
            inline_items: self.inline_items,
            ..CpuConfig::default()
        });
        if self.sim {
            b = b.sim(SimConfig::default());
        }
        if self.pass_windows {
            b = b.fusion_window(gantry::WindowThresholds { min_items: u64::MAX, min_global_bytes: u64::MAX });
        }
        b
    }
}

#[derive(Clone, Copy)]
enum KW {
    W(Accessor<u32, Write>),
    Rw(Accessor<u32, ReadWrite>),
    D(Accessor<u32, DiscardWrite>),
}

enum HW {
    W(HostAccessor<u32, Write>),
    Rw(HostAccessor<u32, ReadWrite>),
    D(HostAccessor<u32, DiscardWrite>),
}

/// A program being run through Gantry, op by op.
pub struct Session {
    pub(crate) config: Config,
    rt: std::sync::Arc<Runtime>,
    /// Buffers of the program (`None` once dropped).
    pub buffers: Vec<Option<gantry::Buffer<u32>>>,
    /// `queues[q]`: the Gantry queues of program queue `q`, per device.
    queues: Vec<Vec<(Dev, Queue)>>,
    pub(crate) events: Vec<Option<Event>>,
    readbacks: Vec<(usize, Readback<u32>)>,
    host_reads: std::sync::Arc<std::sync::Mutex<Vec<(usize, u32)>>>,
    snapshots: Vec<(usize, Vec<u32>)>,
    progress: std::sync::Arc<std::sync::Mutex<String>>,
    /// The program (for fusion outcome checks) and its fusion windows.
    program: Program,
    windows: Vec<fusion::Window>,
    /// `(op index, outcome)` of every fusion outcome checked (at a window's end, or at
    /// the end of the program for each queue's last window, with its start's index).
    fusions: Vec<(usize, FusionOutcome)>,
}

impl Session {
    /// Builds the runtime, buffers and queues of `p`.
    pub fn new(p: &Program, config: Config) -> Session {
        Session::with_runtime(p, config, config.build())
    }

    /// [`Session::new`] on `rt`, built from `config` with more options.
    pub fn with_runtime(p: &Program, config: Config, rt: Runtime) -> Session {
        let rt = std::sync::Arc::new(rt);
        let buffers = p.buffers.iter().map(|b| Some(rt.buffer(&b.contents()))).collect();
        let queues = p
            .queues
            .iter()
            .map(|&in_order| {
                [Dev::Cpu, Dev::Sim]
                    .into_iter()
                    .map(|d| {
                        let device = if d == Dev::Sim && config.sim { 1 } else { 0 };
                        (d, rt.queue_with(QueueOptions { device, in_order }).expect("device exists"))
                    })
                    .collect()
            })
            .collect();
        Session {
            config,
            rt,
            buffers,
            queues,
            events: vec![None; p.ops.len()],
            readbacks: vec![],
            snapshots: vec![],
            host_reads: Default::default(),
            progress: Default::default(),
            program: p.clone(),
            windows: fusion::windows(p),
            fusions: vec![],
        }
    }

    /// The window that ends (`end`) or starts at op `i`.
    fn window_at(&self, i: usize, end: bool) -> Result<&fusion::Window, String> {
        self.windows
            .iter()
            .find(|w| if end { w.end == Some(i) } else { w.start == i })
            .ok_or_else(|| format!("#{i}: no fusion window {} here", if end { "ends" } else { "starts" }))
    }

    /// Checks a window's outcome: by the fusion rules ([`fusion::check_outcome`]), or,
    /// where windows pass their kernels through, that none fused
    /// ([`fusion::check_passed_outcome`]).
    fn check_outcome(&self, w: &fusion::Window, o: &FusionOutcome) -> Result<(), String> {
        match self.config.pass_windows {
            true => fusion::check_passed_outcome(w, o),
            false => fusion::check_outcome(&self.program, w, o),
        }
    }

    fn fusion_outcome(&mut self, i: usize, q: &Queue) -> Result<FusionOutcome, String> {
        let o = q.fusion_outcome().ok_or_else(|| format!("#{i}: the fusion's outcome is unknown"))?;
        self.fusions.push((i, o.clone()));
        Ok(o)
    }

    /// The fusion outcomes checked so far: `(op index, outcome)` (see
    /// [`Session::finish_with_fusions`]).
    pub fn fusions(&self) -> &[(usize, FusionOutcome)] {
        &self.fusions
    }

    /// The runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// A shared handle to the runtime (for inspecting it from another thread).
    pub fn runtime_handle(&self) -> std::sync::Arc<Runtime> {
        self.rt.clone()
    }

    /// What the session is doing (the op it runs, the event it waits for), shared.
    pub fn progress_handle(&self) -> std::sync::Arc<std::sync::Mutex<String>> {
        self.progress.clone()
    }

    pub(crate) fn set_progress(&self, what: impl FnOnce() -> String) {
        *self.progress.lock().unwrap_or_else(|e| e.into_inner()) = what();
    }

    /// The event of submission `i`.
    pub fn event(&self, i: usize) -> Option<&Event> {
        self.events.get(i).and_then(Option::as_ref)
    }

    pub(crate) fn queue(&self, q: usize, dev: Dev) -> &Queue {
        &self.queues[q].iter().find(|(d, _)| *d == dev).expect("queue").1
    }

    /// Runs op `i` of the program.
    pub fn step(&mut self, i: usize, op: &Op) -> Result<(), String> {
        self.set_progress(|| format!("op #{i} ({op:?})"));
        match op {
            Op::Submit { queue, dev, deps, cmd } => {
                let deps: Vec<Event> = deps
                    .iter()
                    .map(|&d| self.events[d].clone().expect("dependency on a submission"))
                    .collect();
                let q = self.queue(*queue, *dev).clone();
                let bufs = &Bufs(&self.buffers);
                let host_reads = (i, self.host_reads.clone());
                let mut readback = None;
                let ev = q
                    .submit(|cg| {
                        for d in &deps {
                            cg.depends_on(d);
                        }
                        build(cg, bufs, cmd, &mut readback, host_reads);
                    })
                    .map_err(|e| format!("#{i}: submit failed: {e}"))?;
                if let Some(rb) = readback {
                    self.readbacks.push((i, rb));
                }
                self.events[i] = Some(ev);
            }
            Op::Wait(k) => {
                let ev =
                    self.events[*k].as_ref().ok_or_else(|| format!("#{i}: wait on non-submission #{k}"))?;
                ev.wait().map_err(|e| format!("#{i}: waiting on #{k} failed: {e}"))?;
                if !ev.is_complete() {
                    return Err(format!("#{i}: #{k} not complete after wait: {:?}", ev.status()));
                }
            }
            Op::QueueWait(q) => {
                for (_, queue) in &self.queues[*q] {
                    queue.wait().map_err(|e| format!("#{i}: q{q}.wait() failed: {e}"))?;
                }
            }
            Op::Flush => self.rt.flush(),
            Op::Snapshot(b) => {
                let v = Bufs(&self.buffers)[*b].to_vec().map_err(|e| format!("#{i}: to_vec failed: {e}"))?;
                self.snapshots.push((i, v));
            }
            Op::Drop(b) => {
                self.buffers[*b].take().ok_or_else(|| format!("#{i}: b{b} dropped twice"))?;
            }
            Op::HostUpdate { buf, salt } => {
                let mut w =
                    Bufs(&self.buffers)[*buf].write().map_err(|e| format!("#{i}: write() failed: {e}"))?;
                for (k, x) in w.iter_mut().enumerate() {
                    *x = mix(item_seed(*salt, k), *x);
                }
            }
            Op::StartFusion { queue, dev } => {
                let q = self.queue(*queue, *dev);
                q.start_fusion().map_err(|e| format!("#{i}: start_fusion failed: {e}"))?;
                if !q.is_in_fusion_mode() {
                    return Err(format!("#{i}: not in fusion mode after start_fusion"));
                }
            }
            Op::CompleteFusion { queue, dev, barriers, wait } => {
                let q = self.queue(*queue, *dev).clone();
                let ev = q
                    .complete_fusion(FusionProps { barriers: *barriers })
                    .map_err(|e| format!("#{i}: complete_fusion failed: {e}"))?;
                if q.is_in_fusion_mode() {
                    return Err(format!("#{i}: still in fusion mode after complete_fusion"));
                }
                self.events[i] = Some(ev.clone());
                if *wait {
                    self.set_progress(|| format!("#{i}: waiting on the completed fusion's event"));
                    ev.wait().map_err(|e| format!("#{i}: waiting on the fusion failed: {e}"))?;
                    let o = self.fusion_outcome(i, &q)?;
                    self.check_outcome(self.window_at(i, true)?, &o).map_err(|e| format!("#{i}: {e}"))?;
                }
            }
            Op::CancelFusion { queue, dev } => {
                let q = self.queue(*queue, *dev).clone();
                q.cancel_fusion();
                if q.is_in_fusion_mode() {
                    return Err(format!("#{i}: still in fusion mode after cancel_fusion"));
                }
                let o = self.fusion_outcome(i, &q)?;
                if !matches!(o, FusionOutcome::Cancelled(_)) {
                    return Err(format!("#{i}: outcome {o:?} after cancel_fusion"));
                }
                self.check_outcome(self.window_at(i, true)?, &o).map_err(|e| format!("#{i}: {e}"))?;
            }
            Op::SetPromotion { buf, promotion } => Bufs(&self.buffers)[*buf].set_promotion(*promotion),
        }
        Ok(())
    }

    /// Waits for everything, checks every event succeeded and returns the outcome.
    pub fn finish(self) -> Result<Outcome, String> {
        self.finish_with_fusions().map(|o| o.0)
    }

    /// [`Session::finish`], also returning the fusion outcomes checked: at each
    /// window's end where known, and for each queue's last window at the end (with the
    /// index of its start).
    pub fn finish_with_fusions(mut self) -> Result<(Outcome, Vec<(usize, FusionOutcome)>), String> {
        for (i, ev) in self.events.iter().enumerate() {
            if let Some(ev) = ev {
                self.set_progress(|| format!("the final wait on #{i}'s event"));
                ev.wait().map_err(|e| format!("#{i} failed: {e}"))?;
            }
        }
        // Windows left open with no kernel to wait on: the queue wait cancels them.
        for (q, queues) in self.queues.iter().enumerate() {
            for (d, queue) in queues {
                if queue.is_in_fusion_mode() {
                    self.set_progress(|| format!("the final q{q}@{}.wait()", dev_name(*d)));
                    queue.wait().map_err(|e| format!("final wait on a fusing queue failed: {e}"))?;
                }
            }
        }
        // Each queue's last fusion has ended: check its outcome.
        for (q, queues) in self.queues.iter().enumerate() {
            for (d, queue) in queues {
                let Some(w) = self.windows.iter().rev().find(|w| (w.queue, w.dev) == (q, *d)) else {
                    continue;
                };
                let o = queue.fusion_outcome().ok_or_else(|| {
                    format!("the outcome of the window at #{} is unknown after the final waits", w.start)
                })?;
                self.check_outcome(w, &o).map_err(|e| format!("at the end: {e}"))?;
                if w.end.is_none() && !matches!(o, FusionOutcome::Cancelled(_)) {
                    return Err(format!("the window at #{} was never ended, yet {o:?}", w.start));
                }
                if !self.fusions.iter().any(|f| Some(f.0) == w.end) {
                    self.fusions.push((w.start, o));
                }
            }
        }
        let mut out = Outcome { snapshots: std::mem::take(&mut self.snapshots), ..Default::default() };
        out.host_reads = std::mem::take(&mut *self.host_reads.lock().unwrap_or_else(|e| e.into_inner()));
        out.host_reads.sort_unstable();
        for (i, b) in self.buffers.iter().enumerate() {
            self.set_progress(|| format!("the final b{i}.to_vec()"));
            out.buffers.push(match b {
                Some(b) => b.to_vec().map_err(|e| format!("final to_vec of b{i} failed: {e}"))?,
                None => vec![],
            });
        }
        for (i, rb) in &self.readbacks {
            let data =
                rb.take().ok_or_else(|| format!("readback of #{i} is empty after its event completed"))?;
            out.readbacks.push((*i, data));
        }
        self.set_progress(|| "the final wait_idle()".into());
        self.rt.wait_idle().map_err(|e| format!("wait_idle failed: {e}"))?;
        let stats = self.rt.stats();
        if stats.live_commands != 0 || stats.in_driver != 0 || stats.failed != 0 {
            return Err(format!("after wait_idle ({:?}): {stats:?}", self.config));
        }
        Ok((out, std::mem::take(&mut self.fusions)))
    }
}

/// The program's buffers, indexed by program buffer index.
pub(crate) struct Bufs<'a>(pub(crate) &'a [Option<gantry::Buffer<u32>>]);

impl std::ops::Index<usize> for Bufs<'_> {
    type Output = gantry::Buffer<u32>;
    fn index(&self, b: usize) -> &gantry::Buffer<u32> {
        self.0[b].as_ref().unwrap_or_else(|| panic!("b{b} used after its drop"))
    }
}

type HostReads = (usize, std::sync::Arc<std::sync::Mutex<Vec<(usize, u32)>>>);

pub(crate) fn build(
    cg: &mut gantry::Handler,
    bufs: &Bufs<'_>,
    cmd: &Cmd,
    readback: &mut Option<Readback<u32>>,
    host_reads: HostReads,
) {
    match cmd {
        Cmd::Kernel { reads, writes, salt, launch: Launch::Map, promote } => {
            let seed = item_seed(*salt, 0);
            let (r, (w, _)) = (&reads[0], &writes[0]);
            let a = cg.access::<u32, Read>(&bufs[r.buf], r.start..r.end);
            let o = cg.elements::<u32, DiscardWrite>(&bufs[w.buf], w.start..w.end);
            let hint = |b: usize| promote.iter().find(|(x, _)| *x == b).map(|(_, p)| *p);
            if let Some(p) = hint(r.buf) {
                cg.promote(&a, p);
            }
            if let Some(p) = hint(w.buf) {
                cg.promote(&o, p);
            }
            cg.map(&a, &o, move |x| out_value(mix(seed, x), 0));
        }
        Cmd::Kernel { reads, writes, salt, launch, promote } => {
            let salt = *salt;
            let ra: Vec<Accessor<u32, Read>> =
                reads.iter().map(|s| cg.access::<u32, Read>(&bufs[s.buf], s.start..s.end)).collect();
            let wa: Vec<KW> = writes
                .iter()
                .map(|(s, m)| {
                    let (b, r) = (&bufs[s.buf], s.start..s.end);
                    match m {
                        WMode::Write => KW::W(cg.access::<u32, Write>(b, r)),
                        WMode::ReadWrite => KW::Rw(cg.access::<u32, ReadWrite>(b, r)),
                        WMode::DiscardWrite => KW::D(cg.access::<u32, DiscardWrite>(b, r)),
                    }
                })
                .collect();
            let hint = |b: usize| promote.iter().find(|(x, _)| *x == b).map(|(_, p)| *p);
            for (a, s) in ra.iter().zip(reads) {
                if let Some(p) = hint(s.buf) {
                    cg.promote(a, p);
                }
            }
            for (w, (s, _)) in wa.iter().zip(writes) {
                if let Some(p) = hint(s.buf) {
                    match w {
                        KW::W(a) => cg.promote(a, p),
                        KW::Rw(a) => cg.promote(a, p),
                        KW::D(a) => cg.promote(a, p),
                    };
                }
            }
            let n = writes.iter().map(|(s, _)| s.len()).max().unwrap_or(1);
            let body = move |it: &mut Item<'_>| {
                let i = it.global_linear_id();
                if i >= n {
                    return;
                }
                let mut acc = item_seed(salt, i);
                for r in &ra {
                    acc = mix(acc, r.get(it, i % r.len()));
                }
                for (k, w) in wa.iter().enumerate() {
                    match *w {
                        KW::W(a) if i < a.len() && write_mask(salt, k, i) => a.set(it, i, out_value(acc, k)),
                        KW::D(a) if i < a.len() => a.set(it, i, out_value(acc, k)),
                        KW::Rw(a) if i < a.len() => a.set(it, i, rw_value(acc, k, a.get(it, i))),
                        _ => {}
                    }
                }
            };
            match launch {
                Launch::Flat => cg.parallel_for(n, body),
                Launch::Nd(local) => {
                    cg.parallel_for_nd(NdRange::new(n.div_ceil(*local) * local, *local), body)
                }
                Launch::Map => unreachable!("map kernels are built above"),
            }
        }
        Cmd::HostTask { reads, writes, salt } => {
            let salt = *salt;
            let ra: Vec<HostAccessor<u32, Read>> =
                reads.iter().map(|s| cg.host_access::<u32, Read>(&bufs[s.buf], s.start..s.end)).collect();
            let mut wa: Vec<HW> = writes
                .iter()
                .map(|(s, m)| {
                    let (b, r) = (&bufs[s.buf], s.start..s.end);
                    match m {
                        WMode::Write => HW::W(cg.host_access::<u32, Write>(b, r)),
                        WMode::ReadWrite => HW::Rw(cg.host_access::<u32, ReadWrite>(b, r)),
                        WMode::DiscardWrite => HW::D(cg.host_access::<u32, DiscardWrite>(b, r)),
                    }
                })
                .collect();
            cg.host_task(move |ctx| {
                let read_data: Vec<&[u32]> = ra.iter().map(|a| a.as_slice(ctx)).collect();
                let (op, sink) = &host_reads;
                sink.lock().unwrap_or_else(|e| e.into_inner()).push((*op, digest(read_data.iter().copied())));
                let acc_of =
                    |i: usize| read_data.iter().fold(item_seed(salt, i), |acc, r| mix(acc, r[i % r.len()]));
                for (k, w) in wa.iter_mut().enumerate() {
                    match w {
                        HW::W(a) => {
                            for (i, x) in a.as_mut_slice(ctx).iter_mut().enumerate() {
                                if write_mask(salt, k, i) {
                                    *x = out_value(acc_of(i), k);
                                }
                            }
                        }
                        HW::D(a) => {
                            for (i, x) in a.as_mut_slice(ctx).iter_mut().enumerate() {
                                *x = out_value(acc_of(i), k);
                            }
                        }
                        HW::Rw(a) => {
                            for (i, x) in a.as_mut_slice(ctx).iter_mut().enumerate() {
                                *x = rw_value(acc_of(i), k, *x);
                            }
                        }
                    }
                }
            });
        }
        Cmd::Copy { src, dst } => {
            cg.copy_range(&bufs[src.buf], src.start, &bufs[dst.buf], dst.start, src.len())
        }
        Cmd::Fill { span, value } => cg.fill_range(&bufs[span.buf], span.start..span.end, *value),
        Cmd::CopyFromHost { dst, salt } => {
            let data: Vec<u32> = (0..dst.len()).map(|k| host_data(*salt, k)).collect();
            cg.copy_from_host(&data, &bufs[dst.buf], dst.start);
        }
        Cmd::ReadBack { src } => {
            let rb = Readback::new();
            cg.copy_to_host(&bufs[src.buf], src.start..src.end, &rb);
            *readback = Some(rb);
        }
    }
}

/// Runs a program through Gantry and returns its outcome, or the first error.
pub fn run_gantry_outcome(p: &Program, config: Config) -> Result<Outcome, String> {
    let mut s = Session::new(p, config);
    for (i, op) in p.ops.iter().enumerate() {
        s.step(i, op)?;
    }
    s.finish()
}

/// Runs a program through Gantry and returns all buffers' final contents.
///
/// # Panics
/// If a submission is refused or a command fails.
pub fn run_gantry(p: &Program, config: Config) -> Vec<Vec<u32>> {
    match run_gantry_outcome(p, config) {
        Ok(o) => o.buffers,
        Err(e) => panic!("{e}"),
    }
}

/// Runs `p` through Gantry on a helper thread; a run that takes longer than `timeout`
/// is reported as a hang naming the step it is blocked in (the helper thread and its
/// runtime are leaked).
pub fn run_gantry_watched(
    p: &Program,
    config: Config,
    timeout: std::time::Duration,
) -> Result<Outcome, String> {
    let p2 = p.clone();
    let start = move || Session::new(&p2, config);
    let ops = p.ops.clone();
    let run = move |mut s: Session| {
        for (i, op) in ops.iter().enumerate() {
            s.step(i, op)?;
        }
        s.finish()
    };
    run_watched(config, timeout, "gantry-proptest-run", start, run, String::new)
}

/// Checks that Gantry under `config` produces the model's outcome for `p` (within
/// [`hang_timeout`]).
pub fn check(p: &Program, config: Config) -> Result<(), String> {
    let mut model = run_model(p);
    let mut got = run_gantry_watched(p, config, hang_timeout())?;
    // A fusion that internalizes a promoted buffer does not write it back.
    for b in fusion::promoted_buffers(p) {
        model.buffers[b].clear();
        got.buffers[b].clear();
    }
    match model.mismatch(&got) {
        None => Ok(()),
        Some(m) => Err(format!("{config:?}: Gantry differs from the model:\n{m}")),
    }
}
