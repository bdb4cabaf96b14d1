//! Memory: device allocations by [`AllocId`], the slices operations name resolved to
//! device addresses or host bytes, and pinned host memory for staging.

use std::collections::HashMap;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdeviceptr};
use gantry_driver::{AllocId, ExecError, HostStorage, MemRef, MemSlice};

use crate::context::Context;
use crate::error::{check, CallError};
use crate::execution::{lock, Stream};
use crate::peer::Table;

/// Pinned (page-locked) host memory: the device copies to and from it
/// asynchronously, which it cannot do with ordinary host memory.
pub(crate) struct Pinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: plain memory; who writes which bytes when is ordered by the stream that
// owns it (see `transfer`).
unsafe impl Send for Pinned {}
// SAFETY: see above.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `len` bytes of pinned memory.
    pub(crate) fn new(ctx: &Arc<Context>, len: usize) -> Result<Self, CallError> {
        let mut raw = ptr::null_mut();
        // SAFETY: the context is current; valid out-pointer.
        check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut raw, len.max(1), 0) })?;
        Ok(Self { ptr: raw.cast(), len, ctx: ctx.clone() })
    }
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once, after every use (holders keep it).
        unsafe {
            let _ = self.ctx.bind();
            let _ = sys::cuMemFreeHost(self.ptr.cast());
        }
    }
}

/// A device allocation, freed when dropped (scratch memory an operation keeps until
/// it completes).
pub(crate) struct DeviceBox {
    pub(crate) ptr: CUdeviceptr,
    ctx: Arc<Context>,
}

impl DeviceBox {
    /// `len` bytes of device memory, not initialized.
    pub(crate) fn new(ctx: &Arc<Context>, len: usize) -> Result<Self, CallError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; valid out-pointer.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) })?;
        Ok(Self { ptr, ctx: ctx.clone() })
    }
}

impl Drop for DeviceBox {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once, after the work that used it.
        unsafe {
            let _ = self.ctx.bind();
            let _ = sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Where a slice's bytes are.
pub(crate) enum Place {
    /// Device memory at this address.
    Device {
        /// Address of the slice's first byte.
        ptr: CUdeviceptr,
        /// The allocation it lies in.
        alloc: AllocId,
    },
    /// Another peer device's memory at this address (only the source or destination
    /// of a copy): its context.
    Peer {
        /// Address of the slice's first byte.
        ptr: CUdeviceptr,
        /// The other device's context.
        owner: Arc<Context>,
    },
    /// Host memory: the slice's first byte is at `offset` of the storage.
    Host(Arc<HostStorage>, usize),
}

/// The driver's device allocations. Ids are unique across the process's CUDA
/// drivers, so that a peer device's driver can name one ([`crate::peer`]).
pub(crate) struct Memory {
    table: Arc<Table>,
    /// Whether the device is in the peer group (its table is registered).
    peers: bool,
    ctx: Arc<Context>,
    device: Arc<str>,
}

/// The next allocation id of any CUDA driver of the process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Memory {
    /// The allocations of the device `device`; with `peers`, registered for the
    /// other peer devices.
    pub(crate) fn new(ctx: &Arc<Context>, device: Arc<str>, peers: bool) -> Self {
        let table = Arc::new(Table { ctx: ctx.clone(), allocs: Mutex::new(HashMap::new()) });
        if peers {
            crate::peer::register(&table);
        }
        Self { table, peers, ctx: ctx.clone(), device }
    }

    /// Allocates `bytes` of device memory and zeroes them on `zeroing` before
    /// returning. The device's refusal is [`ExecError::OutOfMemory`].
    pub(crate) fn alloc(&self, bytes: usize, zeroing: &Stream) -> Result<AllocId, ExecError> {
        let oom = || ExecError::OutOfMemory { device: self.device.clone(), requested: bytes };
        // Larger than any address space: CUDA's answer would be the same.
        if bytes > isize::MAX as usize {
            return Err(oom());
        }
        let fail = |e: CallError| {
            if e.is_out_of_memory() {
                oom()
            } else {
                e.into_exec(&self.device, format!("allocating {bytes} bytes"))
            }
        };
        self.ctx.bind().map_err(fail)?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the context is current; valid out-pointer. Zero bytes are one byte
        // (CUDA refuses empty allocations; an empty slice of it is never read).
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }).map_err(fail)?;
        let zeroed = check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(ptr, 0, bytes, zeroing.raw) })
            .and_then(|()| zeroing.synchronize());
        if let Err(e) = zeroed {
            // SAFETY: allocated above, not handed out.
            unsafe {
                let _ = sys::cuMemFree_v2(ptr);
            }
            return Err(fail(e));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        lock(&self.table.allocs).insert(id, (ptr, bytes));
        Ok(AllocId(id))
    }

    /// Frees an allocation (unknown ids are ignored: the contract has no error here).
    pub(crate) fn free(&self, id: AllocId) {
        if let Some((ptr, _)) = lock(&self.table.allocs).remove(&id.0) {
            // SAFETY: allocated by `alloc`, removed from the table, so freed once; the
            // scheduler frees only memory no submitted operation uses.
            unsafe {
                let _ = self.ctx.bind();
                let _ = sys::cuMemFree_v2(ptr);
            }
        }
    }

    /// Where `slice` is, checked to lie inside its memory.
    pub(crate) fn resolve(&self, slice: &MemSlice) -> Result<Place, String> {
        let end = slice.offset.checked_add(slice.len);
        match &slice.mem {
            MemRef::Device(id) => {
                let own = lock(&self.table.allocs).get(&id.0).copied();
                let Some((base, len)) = own else {
                    return self.resolve_peer(slice, id);
                };
                if end.is_none_or(|e| e > len) {
                    return Err(format!(
                        "bytes {}..+{} lie outside device allocation {} of {len} bytes",
                        slice.offset, slice.len, id.0
                    ));
                }
                Ok(Place::Device { ptr: base + slice.offset as CUdeviceptr, alloc: *id })
            }
            MemRef::Host(storage) => {
                if end.is_none_or(|e| e > storage.len()) {
                    return Err(format!(
                        "bytes {}..+{} lie outside host memory of {} bytes",
                        slice.offset,
                        slice.len,
                        storage.len()
                    ));
                }
                Ok(Place::Host(storage.clone(), slice.offset))
            }
        }
    }
}

impl Memory {
    /// Where `slice` of another peer device's allocation `id` is.
    fn resolve_peer(&self, slice: &MemSlice, id: &AllocId) -> Result<Place, String> {
        let found = if self.peers { crate::peer::find(id.0, &self.table) } else { None };
        let Some((owner, base, len)) = found else {
            return Err(format!("device allocation {} is not this driver's (or was freed)", id.0));
        };
        if slice.offset.checked_add(slice.len).is_none_or(|e| e > len) {
            return Err(format!(
                "bytes {}..+{} lie outside peer allocation {} of {len} bytes",
                slice.offset, slice.len, id.0
            ));
        }
        Ok(Place::Peer { ptr: base + slice.offset as CUdeviceptr, owner: owner.ctx.clone() })
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        for (_, (ptr, _)) in lock(&self.table.allocs).drain() {
            // SAFETY: allocated by `alloc`, never freed (still in the table); the
            // driver is going, with every operation completed.
            unsafe {
                let _ = sys::cuMemFree_v2(ptr);
            }
        }
    }
}
