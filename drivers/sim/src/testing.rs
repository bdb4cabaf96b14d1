//! Helpers of the crate's unit tests.

// What the tests of every module use (as the single test module's `use super::*`
// gave them before the crate was split).
pub(crate) use std::sync::atomic::AtomicBool;
pub(crate) use std::sync::{Arc, OnceLock};

pub(crate) use gantry_driver::sync::channel::{unbounded, Receiver};
pub(crate) use gantry_driver::{
    AccessMode, AllocId, Completion, DeviceOp, Driver, DriverContext, ExecError, Geometry, HostStorage,
    HostTask, KernelLaunch, KernelRef, MemArg, MemRef, MemSlice, OpHandle, OpId, Range, Scratch, Submission,
    SyncPoint,
};
pub(crate) use gantry_host::{phase, Accessor, ClosureImage, ClosureKernel, ReadWrite};

pub(crate) use crate::{CostModel, Fault, FaultPlan, MachineConfig, SimConfig, SimDriver, SimMachine};

pub(crate) fn driver(config: SimConfig) -> (SimDriver, Receiver<Completion>) {
    let (tx, rx) = unbounded();
    let d = SimDriver::new(
        config,
        DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) },
    );
    (d, rx)
}

pub(crate) fn sim() -> (SimDriver, Receiver<Completion>) {
    driver(SimConfig::default())
}

pub(crate) fn host_u32(values: &[u32]) -> Arc<HostStorage> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    Arc::new(HostStorage::from_bytes(&bytes))
}

pub(crate) fn read_u32(storage: &HostStorage) -> Vec<u32> {
    // SAFETY: every submitted operation has executed (or none touches it).
    let bytes = unsafe { storage.bytes() };
    bytes.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect()
}

pub(crate) fn dev(id: AllocId, offset: usize, len: usize) -> MemSlice {
    MemSlice { mem: MemRef::Device(id), offset, len }
}

pub(crate) fn host(storage: &Arc<HostStorage>, offset: usize, len: usize) -> MemSlice {
    MemSlice { mem: MemRef::Host(storage.clone()), offset, len }
}

pub(crate) fn copy(src: MemSlice, dst: MemSlice) -> DeviceOp {
    DeviceOp::Copy { src, dst }
}

/// The same closure kernel with another declared cost.
pub(crate) fn with_cost(kernel: &KernelRef, cost: gantry_driver::ItemCost) -> KernelRef {
    let closure = kernel.closure().unwrap().clone();
    closure.into_kernel(kernel.name.clone(), kernel.signature.globals.clone(), cost)
}

/// A kernel over the `n` u32s of `mem` that sets each element to `f(old, index)`.
pub(crate) fn map_kernel(
    name: &str,
    n: usize,
    mem: MemSlice,
    f: impl Fn(u32, usize) -> u32 + Send + Sync + 'static,
) -> DeviceOp {
    let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
    DeviceOp::Kernel(KernelLaunch {
        kernel: ClosureKernel {
            tag: 1,
            phases: smallvec::smallvec![phase(move |it| {
                let i = it.global_linear_id();
                acc.set(it, i, f(acc.get(it, i), i))
            })],
            global_slots: 1,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel(name, vec![AccessMode::ReadWrite; 1], gantry_driver::ItemCost::default()),
        geometry: Geometry::for_range(Range::d1(n)).unwrap(),
        args: smallvec::smallvec![MemArg { mem, mode: AccessMode::ReadWrite }],
        scalars: Default::default(),
    })
}

pub(crate) fn add(n: usize, mem: MemSlice, k: u32) -> DeviceOp {
    map_kernel("add", n, mem, move |x, _| x + k)
}

pub(crate) fn submit(d: &SimDriver, id: u64, op: DeviceOp, waits: &[OpHandle]) -> OpHandle {
    d.submit(Submission { id: OpId(id), op, waits, preserve_on_failure: false, hint: None })
        .unwrap()
        .handle()
        .unwrap()
}

pub(crate) fn drain(rx: &Receiver<Completion>) -> Vec<Completion> {
    rx.try_iter().collect()
}

pub(crate) fn order(done: &[Completion]) -> Vec<u64> {
    done.iter().map(|c| c.op.0).collect()
}

/// (start, end) of every completion, by op id.
pub(crate) fn spans(rx: &Receiver<Completion>) -> Vec<(u64, u64, u64)> {
    let mut v: Vec<_> = drain(rx).into_iter().map(|c| (c.op.0, c.started_ns, c.ended_ns)).collect();
    v.sort();
    v
}

pub(crate) fn costed(cost: CostModel) -> (SimDriver, Receiver<Completion>) {
    driver(SimConfig { latency_ns: 10, cost, ..Default::default() })
}
