//! Memory as drivers see it: host storage, device allocations, slices of either, how
//! a command uses them, and the raw bindings a kernel's accessors resolve to at
//! execution time.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

/// Alignment of every host allocation (a cache line, and enough for any SIMD type).
pub const HOST_ALIGN: usize = 64;

/// A memory space: the host, or the private memory of one device.
/// Devices whose driver shares host memory (the CPU driver) use [`MemSpace::Host`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemSpace {
    /// Host memory.
    Host,
    /// The memory of device `n` (an index into the runtime's device list).
    Device(u32),
}

/// A driver's handle to one of its device allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocId(pub u64);

/// A zero-initialized, cache-line aligned host allocation whose bytes are written by
/// kernels, copies and host tasks running on other threads.
///
/// It hands out raw pointers only: who may touch which bytes when is decided by the
/// scheduler's dependency edges, never by this type.
pub struct HostStorage {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostStorage is a plain heap allocation; concurrent access to its bytes is
// ordered by the scheduler (conflicting commands are connected by dependency edges)
// and kernels access shared elements only through relaxed atomics or exclusive views.
unsafe impl Send for HostStorage {}
// SAFETY: see above.
unsafe impl Sync for HostStorage {}

impl HostStorage {
    /// Allocates `len` zeroed bytes.
    ///
    /// # Panics
    /// Only on allocation failure of the global allocator (as `Vec` does).
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    /// [`HostStorage::zeroed`], or `None` where the size does not fit a layout, exceeds
    /// the machine's physical memory ([`physical_memory`]), or the allocator refuses
    /// it: never aborts the process.
    ///
    /// The size check comes first because an aligned zeroed allocation is zeroed by
    /// writing every byte: where the kernel overcommits memory, a request no machine
    /// can hold would be granted and then killed by the kernel while being zeroed.
    pub fn try_zeroed(len: usize) -> Option<Self> {
        let size = len.max(1).checked_next_multiple_of(HOST_ALIGN)?;
        if size > physical_memory() {
            return None;
        }
        let layout = Layout::from_size_align(size, HOST_ALIGN).ok()?;
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        NonNull::new(raw).map(|ptr| Self { ptr, len })
    }

    /// Allocates a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let s = Self::zeroed(bytes.len());
        // SAFETY: fresh allocation of at least bytes.len() bytes, not yet shared.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), s.ptr.as_ptr(), bytes.len()) };
        s
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1).next_multiple_of(HOST_ALIGN), HOST_ALIGN)
            .expect("host allocation size overflows")
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the allocation holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Base pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Reads the whole allocation.
    ///
    /// # Safety
    /// No command may be writing these bytes concurrently.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: caller guarantees no concurrent writer; the allocation is live.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Mutable view of the whole allocation.
    ///
    /// # Safety
    /// No command may be reading or writing these bytes concurrently, and no other
    /// reference to them may be live.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: caller guarantees exclusivity; the allocation is live.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// The machine's physical memory in bytes (`usize::MAX` where the platform does not
/// say): no host allocation can be larger.
pub fn physical_memory() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: `sysconf` reads configuration values; it has no preconditions.
            let (pages, page) =
                unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
            if pages > 0 && page > 0 {
                return (pages as usize).saturating_mul(page as usize);
            }
        }
        usize::MAX
    })
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with the same layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::fmt::Debug for HostStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStorage").field("len", &self.len).finish()
    }
}

/// Where a slice's bytes live.
#[derive(Clone, Debug)]
pub enum MemRef {
    /// Host memory, kept alive by the operation that uses it.
    Host(Arc<HostStorage>),
    /// An allocation of the driver the operation is submitted to.
    Device(AllocId),
}

/// A byte range of host or device memory.
#[derive(Clone, Debug)]
pub struct MemSlice {
    /// The memory.
    pub mem: MemRef,
    /// First byte.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl MemSlice {
    /// The whole of a host allocation.
    pub fn host(storage: Arc<HostStorage>) -> Self {
        let len = storage.len();
        Self { mem: MemRef::Host(storage), offset: 0, len }
    }
}

/// How a command uses a buffer range. Drives dependency resolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessMode {
    /// Reads the range.
    Read,
    /// Writes (some of) the range; elements not written keep their values.
    Write,
    /// Reads and writes the range.
    ReadWrite,
    /// Overwrites the range; its previous contents need not be made available.
    DiscardWrite,
}

impl AccessMode {
    /// Whether the command observes the range's previous contents.
    pub const fn reads(self) -> bool {
        matches!(self, AccessMode::Read | AccessMode::ReadWrite)
    }
    /// Whether the command may change the range.
    pub const fn writes(self) -> bool {
        !matches!(self, AccessMode::Read)
    }
    /// Whether the previous contents of the buffer must be present where the command
    /// runs: everything except a discard-write.
    pub const fn needs_contents(self) -> bool {
        !matches!(self, AccessMode::DiscardWrite)
    }
}

/// Where an accessor slot's memory lives inside a fused kernel that internalized it
/// (the DPC++ kernel-fusion design, "Internalization"): element `i` is found at
/// `i % (wrap / size_of::<T>())`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Internal {
    /// Ordinary memory: `ptr` is the first element, indexes are bounds-checked.
    #[default]
    No,
    /// Work-group scratch shared by the group's work-items.
    Local,
    /// Per-work-item scratch: `ptr` is the group's region, `len` bytes per work-item.
    Private,
    /// Ordinary memory of `wrap` bytes at `ptr` that other work-groups of the launch may
    /// write while this one reads it (a fused kernel's argument that one kernel reads
    /// and another writes): `len` is 0, so every access takes the general path, whose
    /// reads are relaxed atomics.
    Shared,
}

/// A resolved pointer and length (bytes) for one accessor slot of one launch.
#[derive(Clone, Copy, Debug)]
pub struct Binding {
    /// First byte of the accessor's range.
    pub ptr: *mut u8,
    /// Bytes available from `ptr` for ordinary indexing (0 for internalized memory,
    /// so every access takes the bounds check's slow path, which maps it).
    pub len: usize,
    /// Whether fusion moved the slot into scratch memory.
    pub internal: Internal,
    /// Bytes of internalized memory per work-group (local) or per work-item (private).
    pub wrap: usize,
}

// SAFETY: a Binding is an address handed to the threads executing one launch; the
// memory it names outlives the launch (the operation holds it) and element access
// goes through the accessor types, which are data-race free.
unsafe impl Send for Binding {}
// SAFETY: see above.
unsafe impl Sync for Binding {}

impl Binding {
    /// A binding for no memory (an unused slot).
    pub const EMPTY: Binding = Binding { ptr: std::ptr::null_mut(), len: 0, internal: Internal::No, wrap: 0 };

    /// Ordinary memory of `len` bytes at `ptr`.
    #[inline]
    pub const fn new(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len, internal: Internal::No, wrap: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_classify_reads_and_writes() {
        assert!(AccessMode::Read.reads() && !AccessMode::Read.writes());
        assert!(AccessMode::ReadWrite.reads() && AccessMode::ReadWrite.writes());
        assert!(!AccessMode::DiscardWrite.needs_contents());
        assert!(AccessMode::Write.needs_contents() && !AccessMode::Write.reads());
    }

    /// A host allocation larger than the machine is refused before anything is
    /// allocated or written (where memory is overcommitted, zeroing it would have the
    /// process killed); one that fits is zeroed.
    #[test]
    fn storage_larger_than_the_machine_is_refused() {
        let physical = physical_memory();
        assert!(physical > 1 << 20, "{physical}");
        if physical < usize::MAX / 2 {
            assert!(HostStorage::try_zeroed(physical + HOST_ALIGN).is_none());
        }
        assert!(HostStorage::try_zeroed(usize::MAX - 8).is_none());
        let small = HostStorage::try_zeroed(100).expect("100 bytes");
        // SAFETY: 100 bytes allocated just above, not shared.
        assert!(unsafe { std::slice::from_raw_parts(small.ptr.as_ptr(), 100) }.iter().all(|&b| b == 0));
    }
}
