//! Memory: device-local storage buffers by [`AllocId`] (one `vkAllocateMemory` per
//! allocation: simple, and enough for the milestone; a sub-allocator such as
//! `gpu-allocator` earns its place once allocations are many and small, which the
//! scheduler's buffer-sized allocations are not yet), host-visible staging buffers
//! for host ↔ device copies, and the slices operations name resolved to either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ash::vk;
use gantry_driver::{AllocId, ExecError, HostStorage, MemRef, MemSlice};

use crate::device::Device;
use crate::error::{CallError, Check};
use crate::execution::lock;

/// A buffer and its memory, freed when the last holder (the table, or an operation
/// in flight) lets go.
pub(crate) struct Buffer {
    pub raw: vk::Buffer,
    memory: vk::DeviceMemory,
    /// The bytes asked for (the buffer itself is rounded up to 4).
    pub len: usize,
    /// The mapped bytes of a host-visible buffer.
    mapped: *mut u8,
    dev: Arc<Device>,
}

// SAFETY: Vulkan handles are usable from any thread; the mapped pointer's bytes are
// touched only in the order the driver's submissions set (see `transfer`).
unsafe impl Send for Buffer {}
// SAFETY: see above.
unsafe impl Sync for Buffer {}

/// Why a buffer could not be made.
pub(crate) enum MakeError {
    /// The device has no room (or no memory type) for it.
    OutOfMemory,
    /// Any other failure.
    Call(CallError),
}

impl Buffer {
    /// `len` bytes of device-local memory (`host == false`) or host-visible, coherent
    /// memory (`host == true`, mapped), usable as storage and as copy source and
    /// destination, on every queue the driver uses: concurrent sharing over the
    /// compute and transfer families where it uses both, so no queue-family
    /// ownership transfer is ever needed (the timeline semaphores order the queues'
    /// accesses), exclusive otherwise.
    pub(crate) fn new(dev: &Arc<Device>, len: usize, host: bool) -> Result<Self, MakeError> {
        let size = (len.max(4) as u64).checked_next_multiple_of(4).ok_or(MakeError::OutOfMemory)?;
        let usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST;
        let families = dev.families.sharing();
        let info = vk::BufferCreateInfo::default().size(size).usage(usage);
        let info = if families.len() > 1 {
            info.sharing_mode(vk::SharingMode::CONCURRENT).queue_family_indices(&families)
        } else {
            info.sharing_mode(vk::SharingMode::EXCLUSIVE)
        };
        let call =
            |e: CallError| if e.is_out_of_memory() { MakeError::OutOfMemory } else { MakeError::Call(e) };
        // SAFETY: a valid create info on a live device.
        let raw = unsafe { dev.raw.create_buffer(&info, None) }.call("vkCreateBuffer").map_err(call)?;
        let destroy = |e| {
            // SAFETY: created above, unused.
            unsafe { dev.raw.destroy_buffer(raw, None) };
            e
        };
        // SAFETY: a live buffer.
        let req = unsafe { dev.raw.get_buffer_memory_requirements(raw) };
        let (want, fallback) = if host {
            let f = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
            (f | vk::MemoryPropertyFlags::HOST_CACHED, f)
        } else {
            (vk::MemoryPropertyFlags::DEVICE_LOCAL, vk::MemoryPropertyFlags::empty())
        };
        let Some(kind) = dev.memory_type(req.memory_type_bits, want, fallback) else {
            return Err(destroy(MakeError::OutOfMemory));
        };
        if req.size > dev.heap_size(kind) {
            return Err(destroy(MakeError::OutOfMemory));
        }
        let alloc = vk::MemoryAllocateInfo::default().allocation_size(req.size).memory_type_index(kind);
        // SAFETY: a valid allocate info.
        let memory = match unsafe { dev.raw.allocate_memory(&alloc, None) }.call("vkAllocateMemory") {
            Ok(m) => m,
            Err(e) => return Err(destroy(call(e))),
        };
        let release = |e| {
            // SAFETY: created above, unused.
            unsafe { dev.raw.free_memory(memory, None) };
            destroy(e)
        };
        // SAFETY: memory of a type the buffer allows, large enough.
        if let Err(e) = unsafe { dev.raw.bind_buffer_memory(raw, memory, 0) }.call("vkBindBufferMemory") {
            return Err(release(call(e)));
        }
        let mapped = if host {
            // SAFETY: host-visible memory, mapped once for its life.
            match unsafe { dev.raw.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()) }
                .call("vkMapMemory")
            {
                Ok(p) => p.cast(),
                Err(e) => return Err(release(call(e))),
            }
        } else {
            std::ptr::null_mut()
        };
        Ok(Self { raw, memory, len, mapped, dev: dev.clone() })
    }

    /// The mapped bytes of a host-visible buffer.
    pub(crate) fn mapped(&self) -> *mut u8 {
        debug_assert!(!self.mapped.is_null(), "only staging buffers are mapped");
        self.mapped
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: made in `new`, destroyed once, after every operation that used it
        // (they hold it); freeing memory unmaps it.
        unsafe {
            self.dev.raw.destroy_buffer(self.raw, None);
            self.dev.raw.free_memory(self.memory, None);
        }
    }
}

/// Where a slice's bytes are.
#[derive(Clone)]
pub(crate) enum Place {
    /// Device memory: `offset` bytes into the buffer.
    Device(Arc<Buffer>, usize),
    /// Host memory: the slice's first byte is at `offset` of the storage.
    Host(Arc<HostStorage>, usize),
}

/// The driver's device allocations.
pub(crate) struct Memory {
    allocs: Mutex<HashMap<u64, Arc<Buffer>>>,
    next: AtomicU64,
    dev: Arc<Device>,
}

impl Memory {
    pub(crate) fn new(dev: &Arc<Device>) -> Self {
        Self { allocs: Mutex::new(HashMap::new()), next: AtomicU64::new(1), dev: dev.clone() }
    }

    /// Allocates `bytes` of device memory, zeroed before it returns. The device's
    /// refusal is [`ExecError::OutOfMemory`].
    pub(crate) fn alloc(&self, bytes: usize) -> Result<AllocId, ExecError> {
        let name = &self.dev.name;
        let oom = || ExecError::OutOfMemory { device: name.clone(), requested: bytes };
        if bytes > isize::MAX as usize {
            return Err(oom());
        }
        let buffer = Buffer::new(&self.dev, bytes, false).map_err(|e| match e {
            MakeError::OutOfMemory => oom(),
            MakeError::Call(e) => e.into_exec(name, format!("allocating {bytes} bytes")),
        })?;
        // SAFETY (the recorded command): a live buffer of this device, whole.
        self.dev
            .run_now(|cmd| unsafe { self.dev.raw.cmd_fill_buffer(cmd, buffer.raw, 0, vk::WHOLE_SIZE, 0) })
            .map_err(|e| e.into_exec(name, format!("zeroing a new allocation of {bytes} bytes")))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.allocs).insert(id, Arc::new(buffer));
        Ok(AllocId(id))
    }

    /// Frees an allocation (unknown ids are ignored: the contract has no error here);
    /// operations still holding its buffer keep it until they complete.
    pub(crate) fn free(&self, id: AllocId) {
        lock(&self.allocs).remove(&id.0);
    }

    /// Where `slice` is, checked to lie inside its memory.
    pub(crate) fn resolve(&self, slice: &MemSlice) -> Result<Place, String> {
        let end = slice.offset.checked_add(slice.len);
        match &slice.mem {
            MemRef::Device(id) => {
                let Some(buffer) = lock(&self.allocs).get(&id.0).cloned() else {
                    return Err(format!("device allocation {} is not this driver's (or was freed)", id.0));
                };
                if end.is_none_or(|e| e > buffer.len) {
                    return Err(format!(
                        "bytes {}..+{} lie outside device allocation {} of {} bytes",
                        slice.offset, slice.len, id.0, buffer.len
                    ));
                }
                Ok(Place::Device(buffer, slice.offset))
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
