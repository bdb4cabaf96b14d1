//! Command buffers: the plans this device records, their binding to an argument
//! table (cached for the next replay while the table's memory does not move), the
//! faults a replay draws at submission, and the replay. The operations run through
//! `gantry_host`'s [`Runner`](gantry_host::Runner); the virtual-time cost of a replay
//! is this device's.

use std::sync::Arc;

use gantry_driver::{
    patch_buffer, Binding, CommandBuffer, CommandBufferBuilder, CommandBufferDesc, CommandBufferLaunch,
    ExecError, HostStorage, MemRef, OpPatch, Plan, PlanBuilder, RecordedArg, RecordedOp,
};
use gantry_host::{Arena, BoundOps, CachedPlan};
use smallvec::SmallVec;

use crate::clock::State;
use crate::cost::Engine;
use crate::faults::Faulting;
use crate::machine::{OpWork, SimDriver};
use crate::memory::Region;

/// A command buffer recorded by this driver: the plan, and its operations bound to the
/// argument table of its latest replay. A graph's buffers rarely move between
/// replays, so a replay usually reuses the binding and costs per operation only its
/// fault draw and its own work.
pub(crate) type SimPlan = CachedPlan<BoundPlan>;

/// The command buffer, if this driver recorded it (so its plan passed the
/// [`PlanBuilder`]'s checks: dependencies on earlier operations, entries inside the
/// table, copy lengths, fill patterns).
pub(crate) fn sim_plan(buffer: &CommandBuffer) -> Option<&SimPlan> {
    buffer.downcast_ref::<SimPlan>()
}

/// Where an argument-table entry was bound: what a [`BoundPlan`] depends on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct EntryKey {
    /// Address of its first byte.
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) host: bool,
}

/// A plan's operations bound to one argument table. Valid for any replay on the same
/// driver whose entries have the same address, length and memory kind: the bindings
/// then point into that replay's memory, which its [`PlanWork`] keeps alive.
pub(crate) struct BoundPlan {
    /// The driver that bound it (its errors name the device).
    pub(crate) instance: u64,
    pub(crate) entries: SmallVec<[EntryKey; 8]>,
    /// Every operation's memory, with its engine and work time (none when it cannot
    /// run).
    pub(crate) ops: BoundOps<(Engine, u64)>,
    /// The kernel and the copy operations, in plan order: each draws a fault at every
    /// replay's submission.
    pub(crate) kernels: Vec<u32>,
    pub(crate) copies: Vec<u32>,
    /// Engine and work time of a replay in which no operation faults.
    pub(crate) cost: (Engine, u64),
}

/// A command-buffer replay: its plan bound to the launch's memory.
pub(crate) struct PlanWork {
    pub(crate) buffer: CommandBuffer,
    pub(crate) bound: Arc<BoundPlan>,
    /// The bound entries' memory, alive until the replay has executed (held, never
    /// read).
    pub(crate) _memory: SmallVec<[Arc<HostStorage>; 4]>,
    /// Operations that drew a fault at submission, with their errors, in plan order.
    pub(crate) faulted: Vec<(u32, ExecError)>,
    /// Engine and work time of the operations that can run.
    pub(crate) cost: (Engine, u64),
}

impl SimDriver {
    /// [`Driver::create_command_buffer`](gantry_driver::Driver::create_command_buffer):
    /// a [`PlanBuilder`] that refuses host↔buffer
    /// writes and reads; the host pool records none.
    pub(crate) fn command_buffer(
        &self,
        desc: CommandBufferDesc,
    ) -> Result<Box<dyn CommandBufferBuilder>, ExecError> {
        if self.host_pool {
            return Err(self.unsupported("command buffers"));
        }
        let accepts = |op: &RecordedOp| {
            !matches!(op, RecordedOp::Write { .. } | RecordedOp::Read { .. } | RecordedOp::HostTask { .. })
        };
        let wrap = |plan| -> CommandBuffer { Arc::new(SimPlan::new(plan)) };
        Ok(Box::new(PlanBuilder::new(desc, self.info.name.clone(), accepts, wrap)))
    }
    /// [`Driver::patch_command_buffer`](gantry_driver::Driver::patch_command_buffer): a
    /// patched plan binds anew.
    pub(crate) fn patch_plan(
        &self,
        buffer: &mut CommandBuffer,
        patch: &[OpPatch<'_>],
    ) -> Result<(), ExecError> {
        // A fresh binding cache: it holds each step's virtual cost, which depends on
        // the kernels the patch replaces.
        let copy = |sim: &SimPlan| SimPlan::new(sim.plan.clone());
        let swap = |sim: &mut SimPlan| {
            sim.plan.apply_patches(patch)?;
            sim.unbind();
            Ok(())
        };
        patch_buffer(buffer, copy, swap)
            .ok_or_else(|| self.driver_error("a command buffer recorded by another driver".into()))?
            .map_err(|e| self.driver_error(e))
    }
    /// Resolves a command-buffer launch: its argument table against the allocation
    /// table, then every recorded operation against the table (reusing the command
    /// buffer's binding when the table's memory has not moved), and draws the faults
    /// of its kernels and copies. An operation that cannot run fails at replay (its
    /// dependents with it, independent ones still run); a launch that cannot run at
    /// all is an error.
    pub(crate) fn prepare_plan(
        &self,
        state: &mut State,
        launch: CommandBufferLaunch,
    ) -> Result<OpWork, ExecError> {
        let sim = SimPlan::launched(&launch, &self.info.name)?;
        let plan = &sim.plan;
        let entries: SmallVec<[(Region, bool); 4]> = launch
            .args
            .iter()
            .map(|a| Ok((self.resolve(&a.mem, None)?, matches!(a.mem.mem, MemRef::Host(_)))))
            .collect::<Result<_, ExecError>>()?;
        let keys: SmallVec<[EntryKey; 8]> = entries
            .iter()
            .map(|(r, host)| EntryKey { addr: r.binding().ptr as usize, len: r.len, host: *host })
            .collect();
        let fits = |b: &BoundPlan| b.instance == self.instance && b.entries == keys;
        let bound = sim.bound(fits, || self.bind_plan(plan, &entries, keys.clone()));
        // Kernels, then copies: separate counters, each drawn in plan order.
        let mut faulted = Vec::new();
        for (class, ops) in [(Faulting::Kernel, &bound.kernels), (Faulting::Copy, &bound.copies)] {
            if !self.faults.may_fail(class) {
                state.counted[class as usize] += ops.len() as u64;
                continue;
            }
            for &i in ops {
                if let Err(e) = self.count_fault(state, class) {
                    faulted.push((i, e));
                }
            }
        }
        let cost = if faulted.is_empty() {
            bound.cost
        } else {
            faulted.sort_unstable_by_key(|&(i, _)| i);
            let mut skip = faulted.iter().map(|&(i, _)| i as usize).peekable();
            let steps = bound.ops.steps().iter().enumerate();
            let runs = steps.filter(|&(i, _)| skip.next_if_eq(&i).is_none());
            Self::replay_cost(runs.map(|(_, step)| step.data))
        };
        let memory = entries.into_iter().map(|(r, _)| r.storage).collect();
        let buffer = launch.buffer.clone();
        Ok(OpWork::Plan(Box::new(PlanWork { buffer, bound, _memory: memory, faulted, cost })))
    }

    /// Binds every operation of `plan` to the resolved argument table `entries` (each
    /// with whether it is host memory), whose keys are `keys`.
    pub(crate) fn bind_plan(
        &self,
        plan: &Plan,
        entries: &[(Region, bool)],
        keys: SmallVec<[EntryKey; 8]>,
    ) -> BoundPlan {
        let (mut kernels, mut copies) = (Vec::new(), Vec::new());
        for (i, planned) in plan.ops.iter().enumerate() {
            match planned.op {
                RecordedOp::Kernel { .. } => kernels.push(i as u32),
                RecordedOp::Copy { .. } => copies.push(i as u32),
                _ => {}
            }
        }
        let ops = BoundOps::bind(plan, |op, out| self.bind_recorded(op, entries, out));
        let cost = Self::replay_cost(ops.steps().iter().map(|step| step.data));
        BoundPlan { instance: self.instance, entries: keys, ops, kernels, copies, cost }
    }

    /// Binds one recorded operation to the resolved argument table (each entry with
    /// whether it is host memory), appending its arguments' memory to `out`, with the
    /// rules of the matching single operation: kernels and fills need device memory,
    /// copies may cross the link. Returns its engine and work time.
    pub(crate) fn bind_recorded(
        &self,
        op: &RecordedOp,
        entries: &[(Region, bool)],
        out: &mut Vec<Binding>,
    ) -> Result<(Engine, u64), ExecError> {
        let bind = |a: &RecordedArg, host: Option<&'static str>| -> Result<(Binding, bool), ExecError> {
            // Inside the table: checked when recorded, and the launch binds all of it.
            let (entry, is_host) = &entries[a.entry as usize];
            if let (true, Some(what)) = (*is_host, host) {
                return Err(self.unsupported(what));
            }
            let sub = a.bind(entry.binding()).map_err(|e| self.driver_error(e))?;
            Ok((sub, *is_host))
        };
        match op {
            RecordedOp::Marker => Ok((Engine::None, 0)),
            RecordedOp::HostTask { .. } => Err(self.unsupported("host tasks in command buffers")),
            RecordedOp::Kernel { kernel, geometry, args, .. } => {
                self.check_kernel(kernel, args.len())?;
                for a in args {
                    out.push(bind(a, Some("kernel arguments in host memory"))?.0);
                }
                let bytes = args.iter().map(|a| a.len).sum();
                Ok((Engine::Compute, self.cost.kernel_ns(geometry.global_size(), &kernel.cost, bytes)))
            }
            RecordedOp::Copy { src, dst } => {
                let (s, src_host) = bind(src, None)?;
                let (d, dst_host) = bind(dst, None)?;
                out.extend([s, d]);
                Ok((Engine::Copy, self.cost.copy_ns(src.len, src_host || dst_host)))
            }
            RecordedOp::Fill { dst, .. } => {
                out.push(bind(dst, Some("fills of host memory"))?.0);
                Ok((Engine::Compute, self.cost.fill_ns(dst.len)))
            }
            RecordedOp::Write { .. } | RecordedOp::Read { .. } => Err(self.unsupported(op.label())),
        }
    }

    /// Runs a replay's steps in plan order (see [`SimDriver::replay_steps`]); its
    /// result is the first step's error.
    pub(crate) fn replay(&self, plan: &PlanWork, preserve: bool, arena: &mut Arena) -> Result<(), ExecError> {
        self.replay_steps(plan, preserve, arena).into_iter().flatten().next().map_or(Ok(()), Err)
    }

    /// Runs a replay's steps in plan order and returns each step's error (empty when
    /// none failed). A failed step fails the steps that depend on it, directly or not,
    /// with a dependency error naming it; independent steps still run. Each step
    /// follows the failure rules of its single operation (a panicking kernel restores
    /// what it wrote when `preserve` is set).
    pub(crate) fn replay_steps(
        &self,
        plan: &PlanWork,
        preserve: bool,
        arena: &mut Arena,
    ) -> Vec<Option<ExecError>> {
        // `plan._memory` keeps the bindings' memory alive until every step has run.
        let PlanWork { buffer, bound, faulted, .. } = plan;
        let recorded = &sim_plan(buffer).expect("checked at submission").plan;
        // `faulted` is sorted by step: an injected fault fails its step.
        let fault = |i: usize| {
            let f = faulted.binary_search_by_key(&(i as u32), |&(f, _)| f).ok()?;
            Some(faulted[f].1.clone())
        };
        // SAFETY: the bindings point into `plan._memory`, as the bound plan's key is
        // this replay's table; nothing else runs on the device meanwhile.
        unsafe { self.runner.replay_steps(recorded, &bound.ops, preserve, arena, fault) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    fn rarg(entry: u32, offset: usize, len: usize) -> RecordedArg {
        RecordedArg { entry, offset, len, mode: AccessMode::ReadWrite }
    }

    /// A recorded kernel over the `n` u32s of `arg` that sets each to `f(old, index)`.
    fn rec_map(
        name: &str,
        n: usize,
        arg: RecordedArg,
        f: impl Fn(u32, usize) -> u32 + Send + Sync + 'static,
    ) -> RecordedOp {
        let DeviceOp::Kernel(launch) = map_kernel(name, n, dev(AllocId(u64::MAX), 0, 0), f) else {
            unreachable!()
        };
        RecordedOp::Kernel {
            kernel: launch.kernel,
            geometry: launch.geometry,
            args: smallvec::smallvec![arg],
            scalars: Default::default(),
        }
    }

    fn rec_add(n: usize, arg: RecordedArg, k: u32) -> RecordedOp {
        rec_map("add", n, arg, move |x, _| x + k)
    }

    fn rec_fill(arg: RecordedArg, value: u32) -> RecordedOp {
        RecordedOp::Fill { dst: arg, pattern: value.to_ne_bytes().into_iter().collect() }
    }

    /// Records `ops` (each with the sync points it depends on) into a command buffer.
    fn record(d: &SimDriver, entries: usize, ops: Vec<(RecordedOp, Vec<u32>)>) -> CommandBuffer {
        let mut b = d.create_command_buffer(CommandBufferDesc { entries, in_order: false, ops: 0 }).unwrap();
        for (i, (op, deps)) in ops.into_iter().enumerate() {
            let deps: Vec<SyncPoint> = deps.into_iter().map(SyncPoint).collect();
            assert_eq!(b.append(op, &deps), Ok(SyncPoint(i as u32)));
        }
        b.finalize().unwrap()
    }

    /// A replay of `buffer` with entry `i` bound to the whole of `entries[i]`.
    fn replay_op(buffer: &CommandBuffer, entries: &[MemSlice]) -> DeviceOp {
        let args = entries.iter().map(|m| MemArg { mem: m.clone(), mode: AccessMode::ReadWrite }).collect();
        DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args })
    }

    const CB_N: usize = 64;

    fn cb_model() -> CostModel {
        // 64 items / 16 lanes = 4 ns; 256 bytes / 64 B/ns = 4 ns: every kernel and fill
        // of CB_N u32s takes 4 ns, a copy of half of them 2 ns.
        CostModel {
            item_ns: 1.0,
            compute_units: 16,
            memory_bytes_per_ns: 64.0,
            compute_engines: 1,
            ..Default::default()
        }
    }

    /// One replay's (start, end, lane) and the two entries' data after it.
    type ReplayRun = ((u64, u64, u32), Vec<u32>, Vec<u32>);

    /// Three replays of fill → three increments → copy into another entry, with an
    /// independent accumulating kernel; returns every replay's (start, end, lane) and
    /// the data read back after it.
    fn replay_scenario() -> Vec<ReplayRun> {
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), ..Default::default() });
        let (n, bytes, half) = (CB_N, CB_N * 4, CB_N * 2);
        let a = d.alloc(bytes).unwrap();
        let b = d.alloc(bytes).unwrap();
        let buffer = record(
            &d,
            2,
            vec![
                (rec_fill(rarg(0, 0, bytes), 5), vec![]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![0]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![1]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![2]),
                (rec_add(n, rarg(1, 0, bytes), 10), vec![]),
                // b[n/2..] = a[..n/2], after both writers of a and b.
                (RecordedOp::Copy { src: rarg(0, 0, half), dst: rarg(1, half, half) }, vec![3, 4]),
                (RecordedOp::Marker, vec![5]),
            ],
        );
        let (out_a, out_b) = (Arc::new(HostStorage::zeroed(bytes)), Arc::new(HostStorage::zeroed(bytes)));
        let mut runs = Vec::new();
        for r in 0..3u64 {
            let rep = submit(&d, 10 * r, replay_op(&buffer, &[dev(a, 0, bytes), dev(b, 0, bytes)]), &[]);
            submit(
                &d,
                10 * r + 1,
                copy(dev(a, 0, bytes), host(&out_a, 0, bytes)),
                std::slice::from_ref(&rep),
            );
            submit(&d, 10 * r + 2, copy(dev(b, 0, bytes), host(&out_b, 0, bytes)), &[rep]);
            d.poll();
            let done = drain(&rx);
            assert_eq!(done.len(), 3, "one completion per replay: {done:?}");
            assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
            let c = done.iter().find(|c| c.op.0 == 10 * r).unwrap();
            runs.push(((c.started_ns, c.ended_ns, c.lane), read_u32(&out_a), read_u32(&out_b)));
        }
        runs
    }

    /// Reads `n` u32s of device allocation `id` back through a copy.
    fn read_dev(d: &SimDriver, rx: &Receiver<Completion>, id: AllocId, n: usize) -> Vec<u32> {
        let out = Arc::new(HostStorage::zeroed(n * 4));
        submit(d, 1000, copy(dev(id, 0, n * 4), host(&out, 0, n * 4)), &[]);
        d.poll();
        assert!(drain(rx).iter().all(|c| c.result.is_ok()));
        read_u32(&out)
    }

    /// A recorded plan replays three times against device allocations with the data
    /// of its operations run one by one, as one operation that takes the launch
    /// latency once: shorter than launching its kernels separately.
    #[test]
    fn command_buffer_replays_against_device_memory() {
        let runs = replay_scenario();
        let n = CB_N;
        for (r, (span, a, b)) in runs.iter().enumerate() {
            let r = r as u32 + 1;
            assert_eq!(a, &vec![8; n], "replay {r}: fill then three increments");
            let expect_b: Vec<u32> = (0..n).map(|i| if i < n / 2 { 10 * r } else { 8 }).collect();
            assert_eq!(b, &expect_b, "replay {r}");
            // latency once + fill 4 + 4 kernels × 4 + copy 2.
            assert_eq!(span.1 - span.0, 100 + 4 + 4 * 4 + 2, "replay {r}");
            assert_eq!(span.2, 1, "on the (only) compute engine");
        }
        assert_eq!(runs, replay_scenario(), "same program, same timeline");

        // The same four kernels launched separately, as a chain: latency each time.
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), ..Default::default() });
        let a = d.alloc(n * 4).unwrap();
        let mut prev: Vec<OpHandle> = vec![];
        for i in 0..4 {
            prev = vec![submit(&d, i, add(n, dev(a, 0, n * 4), 1), &prev)];
        }
        d.poll();
        let separate = drain(&rx).last().unwrap().ended_ns;
        assert_eq!(separate, 4 * (100 + 4));
        let replay = runs[0].0 .1 - runs[0].0 .0;
        assert!(replay < separate, "replay {replay} ns, separate launches {separate} ns");
    }

    /// Host↔buffer writes and reads cannot be recorded; kernels, copies, fills and
    /// markers can.
    #[test]
    fn command_buffers_refuse_host_writes_and_reads() {
        let (d, _rx) = sim();
        let mut b =
            d.create_command_buffer(CommandBufferDesc { entries: 2, in_order: true, ops: 0 }).unwrap();
        let host_data = Arc::new(HostStorage::zeroed(16));
        let write = RecordedOp::Write { src: host_data.clone(), dst: rarg(0, 0, 16) };
        let read = RecordedOp::Read { src: rarg(0, 0, 16), dst: host_data };
        assert!(matches!(
            b.append(write, &[]),
            Err(ExecError::Unsupported { what: "memory buffer write", device }) if &*device == "sim"
        ));
        assert!(matches!(
            b.append(read, &[]),
            Err(ExecError::Unsupported { what: "memory buffer read", .. })
        ));
        assert_eq!(b.append(rec_fill(rarg(0, 0, 16), 1), &[]), Ok(SyncPoint(0)));
        assert_eq!(b.append(rec_add(4, rarg(0, 0, 16), 1), &[]), Ok(SyncPoint(1)));
        assert_eq!(
            b.append(RecordedOp::Copy { src: rarg(0, 0, 16), dst: rarg(1, 0, 16) }, &[]),
            Ok(SyncPoint(2))
        );
        assert_eq!(b.append(RecordedOp::Marker, &[]), Ok(SyncPoint(3)));
        let plan = b.finalize().unwrap();
        assert_eq!(sim_plan(&plan).unwrap().plan.ops.len(), 4);
    }

    /// A panicking kernel inside a plan fails the operations that depend on it,
    /// directly or not, restores what it wrote (with `preserve_on_failure`), and
    /// leaves independent operations to run; the replay reports the kernel's error.
    #[test]
    fn failing_kernel_in_a_plan_fails_only_its_dependents() {
        let (d, rx) = sim();
        let n = 2500; // several work-groups: some are written before the panic
        let bytes = n * 4;
        let (a, b, c) = (d.alloc(bytes).unwrap(), d.alloc(bytes).unwrap(), d.alloc(bytes).unwrap());
        let input = host_u32(&vec![5; n]);
        let up = submit(&d, 0, copy(host(&input, 0, bytes), dev(a, 0, bytes)), &[]);
        let bad =
            rec_map("bad", n, rarg(0, 0, bytes), move |_, i| if i == n - 1 { panic!("boom") } else { 99 });
        let buffer = record(
            &d,
            3,
            vec![
                (bad, vec![]),
                (rec_add(n, rarg(0, 0, bytes), 1), vec![0]),
                (RecordedOp::Copy { src: rarg(0, 0, bytes), dst: rarg(1, 0, bytes) }, vec![1]),
                (rec_add(n, rarg(2, 0, bytes), 7), vec![]),
            ],
        );
        let launch = replay_op(&buffer, &[dev(a, 0, bytes), dev(b, 0, bytes), dev(c, 0, bytes)]);
        let rep = d
            .submit(Submission {
                id: OpId(1),
                op: launch,
                waits: &[up],
                preserve_on_failure: true,
                hint: None,
            })
            .unwrap()
            .handle()
            .unwrap();
        submit(&d, 2, DeviceOp::Marker, &[rep]);
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2], "one completion for the replay");
        match &done[1].result {
            Err(ExecError::KernelPanicked { kernel, message }) => {
                assert_eq!((&**kernel, message.as_str()), ("bad", "boom"));
            }
            other => panic!("expected KernelPanicked, got {other:?}"),
        }
        assert!(matches!(&done[2].result, Err(ExecError::DependencyFailed { .. })));
        let outs: Vec<Arc<HostStorage>> = (0..3).map(|_| Arc::new(HostStorage::zeroed(bytes))).collect();
        for (i, (id, out)) in [a, b, c].into_iter().zip(&outs).enumerate() {
            submit(&d, 10 + i as u64, copy(dev(id, 0, bytes), host(out, 0, bytes)), &[]);
        }
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert!(read_u32(&outs[0]).iter().all(|&x| x == 5), "restored; the dependent add did not run");
        assert!(read_u32(&outs[1]).iter().all(|&x| x == 0), "the transitive dependent copy did not run");
        assert!(read_u32(&outs[2]).iter().all(|&x| x == 7), "the independent add ran");
    }

    /// Kernel faults count recorded kernels, once per replay: the faulted kernel fails
    /// inside the replay (its dependents with it) and the replay reports the fault.
    #[test]
    fn kernel_faults_target_kernels_inside_plans() {
        // Kernel 1 of this device fails by plan: the second recorded kernel.
        let faults = FaultPlan::default().with(Fault::Kernel { nth: 1 });
        let (d, rx) = driver(SimConfig { faults, ..Default::default() });
        let buf = d.alloc(16).unwrap();
        let buffer = record(
            &d,
            1,
            vec![
                (rec_add(4, rarg(0, 0, 16), 1), vec![]),
                (rec_add(4, rarg(0, 0, 16), 2), vec![0]),
                (rec_add(4, rarg(0, 0, 16), 4), vec![1]),
                (rec_add(4, rarg(0, 0, 16), 8), vec![0]),
            ],
        );
        submit(&d, 0, replay_op(&buffer, &[dev(buf, 0, 16)]), &[]);
        let out = Arc::new(HostStorage::zeroed(16));
        submit(&d, 1, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[]);
        d.poll();
        let done = drain(&rx);
        assert!(matches!(&done[0].result, Err(ExecError::Fault { what: "kernel launch failed", .. })));
        assert_eq!(read_u32(&out), [9; 4], "the first and the fourth kernel ran");
        // The next replay counts kernels 4.. and runs all of them.
        submit(&d, 2, replay_op(&buffer, &[dev(buf, 0, 16)]), &[]);
        submit(&d, 3, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[]);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [24; 4]);
    }

    /// Inside a replay, a failed step's dependents fail with dependency errors naming
    /// the step they depend on, down to the root cause; independent steps run.
    #[test]
    fn plan_failures_chain_as_dependency_errors() {
        let (d, _rx) = sim();
        let buf = d.alloc(16).unwrap();
        let buffer = record(
            &d,
            1,
            vec![
                (rec_fill(rarg(0, 0, 16), 3), vec![]),
                (rec_map("bad", 4, rarg(0, 0, 16), |_, _| panic!("boom")), vec![0]),
                (rec_add(4, rarg(0, 0, 16), 1), vec![1]),
                (RecordedOp::Marker, vec![2]),
                (rec_add(4, rarg(0, 0, 16), 10), vec![0]),
            ],
        );
        let launch = replay_op(&buffer, &[dev(buf, 0, 16)]);
        let work = {
            let mut state = d.state.lock();
            d.prepare(&mut state, launch, gantry_driver::SimHint::default()).unwrap()
        };
        let errors = d.replay_steps(
            match &work {
                OpWork::Plan(plan) => plan,
                _ => unreachable!("a replay prepares to a plan"),
            },
            true,
            &mut Arena::default(),
        );
        assert_eq!(errors.len(), 5);
        assert!(errors[0].is_none() && errors[4].is_none(), "{errors:?}");
        assert!(matches!(&errors[1], Some(ExecError::KernelPanicked { kernel, .. }) if &**kernel == "bad"));
        match &errors[2] {
            Some(e @ ExecError::DependencyFailed { dependency, .. }) => {
                assert_eq!(&**dependency, "bad");
                assert_eq!(Some(e.root_cause()), errors[1].as_ref());
            }
            other => panic!("expected DependencyFailed, got {other:?}"),
        }
        match &errors[3] {
            Some(e @ ExecError::DependencyFailed { dependency, .. }) => {
                assert_eq!(&**dependency, "add", "named after its direct dependency");
                assert_eq!(Some(e.root_cause()), errors[1].as_ref());
            }
            other => panic!("expected DependencyFailed, got {other:?}"),
        }
        let storage = d.machine.memory.lock()[&buf].storage.clone();
        assert_eq!(read_u32(&storage), [13; 4], "fill and the independent add ran, the rest did not");
    }

    /// Malformed launches complete with an error instead of panicking: a wrong number
    /// of bound entries, a buffer of another driver (a plan this driver did not record
    /// among them), freed memory, kernels bound to host memory.
    #[test]
    fn bad_command_buffer_launches_fail_without_panicking() {
        let (d, rx) = sim();
        let buf = d.alloc(16).unwrap();
        let buffer = record(&d, 2, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        submit(&d, 0, replay_op(&buffer, &[dev(buf, 0, 16)]), &[]); // one entry of two
        let foreign: CommandBuffer = Arc::new(5u32);
        submit(&d, 1, replay_op(&foreign, &[]), &[]);
        let hand_built: CommandBuffer =
            Arc::new(Plan { entries: 1, in_order: false, ops: vec![], work_items: 0 });
        submit(&d, 2, replay_op(&hand_built, &[dev(buf, 0, 16)]), &[]);
        let gone = d.alloc(16).unwrap();
        d.free(gone);
        let one = record(&d, 1, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        submit(&d, 3, replay_op(&one, &[dev(gone, 0, 16)]), &[]);
        let host_mem = host_u32(&[1, 2, 3, 4]);
        submit(&d, 4, replay_op(&one, &[host(&host_mem, 0, 16)]), &[]);
        // Copies may use host entries, over the link.
        let up = record(&d, 2, vec![(RecordedOp::Copy { src: rarg(0, 0, 16), dst: rarg(1, 0, 16) }, vec![])]);
        submit(&d, 5, replay_op(&up, &[host(&host_mem, 0, 16), dev(buf, 0, 16)]), &[]);
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2, 3, 4, 5]);
        for c in &done[..4] {
            assert!(matches!(&c.result, Err(ExecError::Driver { .. })), "{c:?}");
        }
        assert!(matches!(
            &done[4].result,
            Err(ExecError::Unsupported { what: "kernel arguments in host memory", .. })
        ));
        assert!(done[5].result.is_ok(), "{:?}", done[5]);
        assert_eq!(read_u32(&host_mem), [1, 2, 3, 4]);
        let out = Arc::new(HostStorage::zeroed(16));
        submit(&d, 7, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[]);
        d.poll();
        assert_eq!(read_u32(&out), [1, 2, 3, 4], "only the host-to-device copy changed the buffer");
    }

    /// A replay reuses the binding of the previous one only while its table's memory
    /// is where it was: rebound to another allocation, a reallocated one, another
    /// offset or a shorter range, it reads and writes (or refuses) the new memory.
    #[test]
    fn replays_follow_their_table_when_buffers_move() {
        let (d, rx) = sim();
        let buffer = record(&d, 1, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        let run = |entry: MemSlice| {
            submit(&d, 0, replay_op(&buffer, &[entry]), &[]);
            d.poll();
            drain(&rx).pop().unwrap().result
        };
        let (a, b) = (d.alloc(16).unwrap(), d.alloc(32).unwrap());
        run(dev(a, 0, 16)).unwrap();
        run(dev(a, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, a, 4), [2; 4]);
        run(dev(b, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, a, 4), [2; 4], "moved: the old memory is left alone");
        assert_eq!(read_dev(&d, &rx, b, 8), [1, 1, 1, 1, 0, 0, 0, 0]);
        run(dev(b, 16, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, b, 8), [1; 8], "another offset of the same allocation");
        assert!(matches!(run(dev(b, 16, 8)), Err(ExecError::Driver { .. })), "the entry got too short");
        d.free(a);
        let c = d.alloc(16).unwrap(); // may reuse a's address: its bytes are c's now
        run(dev(c, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, c, 4), [1; 4]);
        run(dev(b, 0, 16)).unwrap();
        assert_eq!(read_dev(&d, &rx, b, 8), [2, 2, 2, 2, 1, 1, 1, 1]);
    }

    /// Faults are drawn at every replay, bound or not: the nth kernel and copy fail in
    /// whichever replay they fall, and a faulted step costs no time (a replay whose
    /// every step faulted occupies no engine).
    #[test]
    fn faults_and_costs_are_per_replay_with_a_reused_binding() {
        let faults = FaultPlan::default()
            .with(Fault::Kernel { nth: 0 })
            .with(Fault::Kernel { nth: 1 })
            .with(Fault::Kernel { nth: 3 })
            .with(Fault::Copy { nth: 3 }); // copy 0 is the read-back below
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), faults, ..Default::default() });
        let bytes = CB_N * 4;
        let (a, b) = (d.alloc(bytes).unwrap(), d.alloc(bytes).unwrap());
        let kernels = record(
            &d,
            1,
            vec![
                (rec_add(CB_N, rarg(0, 0, bytes), 1), vec![]),
                (rec_add(CB_N, rarg(0, 0, bytes), 2), vec![]),
            ],
        );
        let copy_ab = record(
            &d,
            2,
            vec![(RecordedOp::Copy { src: rarg(0, 0, bytes), dst: rarg(1, 0, bytes) }, vec![])],
        );
        let mut spans = Vec::new();
        for _ in 0..3 {
            submit(&d, 0, replay_op(&kernels, &[dev(a, 0, bytes)]), &[]);
            d.poll();
            let c = drain(&rx).pop().unwrap();
            spans.push((c.ended_ns - c.started_ns, c.lane, c.result.is_ok()));
        }
        // Kernels 0, 1 fault (both steps), then 3 (the second step), then none.
        assert_eq!(spans, [(100, 0, false), (104, 1, false), (108, 1, true)]);
        assert_eq!(read_dev(&d, &rx, a, CB_N), vec![1 + 1 + 2; CB_N]);
        let copies: Vec<bool> = (0..3)
            .map(|_| {
                submit(&d, 0, replay_op(&copy_ab, &[dev(a, 0, bytes), dev(b, 0, bytes)]), &[]);
                d.poll();
                drain(&rx).pop().unwrap().result.is_ok()
            })
            .collect();
        assert_eq!(
            copies,
            [true, true, false],
            "the third replay's copy (copies count apart from kernels) faults"
        );
    }

    /// A patched command buffer runs its new kernels at their virtual cost: its
    /// binding (which holds each step's cost) starts afresh, while the original keeps
    /// its own.
    #[test]
    fn patched_buffers_run_their_new_kernels_at_their_cost() {
        let (d, rx) = driver(SimConfig { latency_ns: 100, cost: cb_model(), ..Default::default() });
        let bytes = CB_N * 4;
        let a = d.alloc(bytes).unwrap();
        let original = record(&d, 1, vec![(rec_add(CB_N, rarg(0, 0, bytes), 1), vec![])]);
        let run = |buffer: &CommandBuffer| {
            submit(&d, 0, replay_op(buffer, &[dev(a, 0, bytes)]), &[]);
            d.poll();
            let c = drain(&rx).pop().unwrap();
            assert!(c.result.is_ok(), "{c:?}");
            c.ended_ns - c.started_ns
        };
        assert_eq!((run(&original), run(&original)), (104, 104), "bound once, then reused");
        // A kernel adding 10 that declares twice the default cost per work-item.
        let RecordedOp::Kernel { kernel, geometry, .. } = rec_add(CB_N, rarg(0, 0, bytes), 10) else {
            unreachable!()
        };
        let dearer = with_cost(&kernel, gantry_driver::ItemCost::of(Some(2.0)));
        // `original` is still held here: the patch makes a copy.
        let mut patched = original.clone();
        d.patch_command_buffer(
            &mut patched,
            &[OpPatch::Kernel { kernel: &dearer, geometry: &geometry, scalars: &[] }],
        )
        .unwrap();
        assert!(!Arc::ptr_eq(&patched, &original));
        assert_eq!(run(&patched), 108);
        assert_eq!(read_dev(&d, &rx, a, CB_N), vec![1 + 1 + 10; CB_N]);
        assert_eq!(run(&original), 104, "the original is unchanged");
        assert_eq!(read_dev(&d, &rx, a, CB_N), vec![1 + 1 + 10 + 1; CB_N]);
        // Held by nothing else, `patched` is patched in place: patching a kernel of the
        // default cost back must also drop the binding that holds the dearer one's.
        drop(original);
        let before = Arc::as_ptr(&patched);
        d.patch_command_buffer(
            &mut patched,
            &[OpPatch::Kernel { kernel: &kernel, geometry: &geometry, scalars: &[] }],
        )
        .unwrap();
        assert!(std::ptr::eq(Arc::as_ptr(&patched), before), "in place");
        assert_eq!(run(&patched), 104);
    }

    /// A command buffer bound on one device is rebound on another, even over the
    /// same memory: its errors name the device that ran it.
    #[test]
    fn bindings_belong_to_one_device() {
        let machine = SimMachine::new(MachineConfig::default());
        let device = |name: &'static str| {
            let (tx, rx) = unbounded();
            let config = SimConfig { name: name.into(), ..Default::default() };
            (
                machine.device(
                    config,
                    DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) },
                ),
                rx,
            )
        };
        let ((d1, rx1), (d2, rx2)) = (device("one"), device("two"));
        let buffer = record(&d1, 1, vec![(rec_add(4, rarg(0, 0, 16), 1), vec![])]);
        let mem = host_u32(&[0; 4]);
        for (d, rx, name) in [(&d1, &rx1, "one"), (&d2, &rx2, "two")] {
            submit(d, 0, replay_op(&buffer, &[host(&mem, 0, 16)]), &[]);
            d.poll();
            let done = drain(rx);
            assert!(
                matches!(&done[0].result, Err(ExecError::Unsupported { device, .. }) if &**device == name),
                "{done:?}"
            );
        }
    }
}
