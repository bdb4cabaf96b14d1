//! Peer devices: the CUDA devices of one process whose memories copy into each other
//! directly (`cuMemcpyPeerAsync` over NVLink or PCIe), so the scheduler moves a buffer
//! from one GPU to another without a round trip through host memory.
//!
//! A device whose every other device can access it, and it them
//! (`cuDeviceCanAccessPeer`), is in the peer group [`PEER_GROUP`]; the scheduler then
//! hands the target device's driver a copy whose source is the other device's
//! allocation. Allocation ids are unique across the process's CUDA drivers, and each
//! driver's allocation table is registered here, so a driver resolves another's id
//! ([`find`]). Peer access is enabled for a pair of contexts, both ways, before their
//! first copy ([`enable`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys::{self, CUdevice, CUdeviceptr, CUresult};

use crate::context::Context;
use crate::error::{check, CallError};
use crate::execution::lock;

/// The peer group of CUDA devices that reach every other device of the process.
pub const PEER_GROUP: u64 = 0xC0DA_0000_0000_0001;

/// One driver's allocations: id → (address, bytes).
pub(crate) struct Table {
    pub(crate) ctx: Arc<Context>,
    pub(crate) allocs: Mutex<HashMap<u64, (CUdeviceptr, usize)>>,
}

fn tables() -> &'static Mutex<Vec<Weak<Table>>> {
    static TABLES: OnceLock<Mutex<Vec<Weak<Table>>>> = OnceLock::new();
    TABLES.get_or_init(|| Mutex::new(Vec::new()))
}

/// Registers a peer device's table (dropped tables are swept as others register).
pub(crate) fn register(table: &Arc<Table>) {
    let mut t = lock(tables());
    t.retain(|w| w.strong_count() > 0);
    t.push(Arc::downgrade(table));
}

/// The table, address and length of allocation `id` of another peer device's driver.
pub(crate) fn find(id: u64, except: &Arc<Table>) -> Option<(Arc<Table>, CUdeviceptr, usize)> {
    let t = lock(tables());
    t.iter().filter_map(Weak::upgrade).filter(|table| !Arc::ptr_eq(table, except)).find_map(|table| {
        let found = lock(&table.allocs).get(&id).copied();
        found.map(|(ptr, len)| (table, ptr, len))
    })
}

/// Whether device `dev` and every other of the `count` devices can access each other.
pub(crate) fn reaches_all(dev: CUdevice, count: usize) -> Result<bool, CallError> {
    if count < 2 {
        return Ok(false);
    }
    for other in 0..count as i32 {
        let mut peer: CUdevice = 0;
        // SAFETY: an initialized driver, `other` < count, valid out-pointer.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut peer, other) })?;
        if peer == dev {
            continue;
        }
        for (a, b) in [(dev, peer), (peer, dev)] {
            let mut can = 0;
            // SAFETY: valid devices and out-pointer.
            check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) })?;
            if can == 0 {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Enables peer access between the contexts of `a` and `b`, both ways, once per
/// pair; leaves `current` bound.
pub(crate) fn enable(a: &Context, b: &Context, current: &Context) -> Result<(), CallError> {
    static ENABLED: OnceLock<Mutex<HashSet<(usize, usize)>>> = OnceLock::new();
    let key = (a.raw() as usize, b.raw() as usize);
    let key = (key.0.min(key.1), key.0.max(key.1));
    let mut enabled = lock(ENABLED.get_or_init(Default::default));
    if enabled.contains(&key) {
        return Ok(());
    }
    for (from, to) in [(a, b), (b, a)] {
        from.bind()?;
        // SAFETY: `from` is current; `to` is a live context of another device.
        let r = unsafe { sys::cuCtxEnablePeerAccess(to.raw(), 0) };
        if r != CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            check("cuCtxEnablePeerAccess", r)?;
        }
    }
    current.bind()?;
    enabled.insert(key);
    Ok(())
}
