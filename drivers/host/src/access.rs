//! Accessors: how kernels and host tasks reach buffer, local and private memory.
//!
//! # Soundness model
//!
//! Many work-items of one kernel run at once over shared buffers. Safe code cannot
//! create a data race through these types:
//!
//! * [`Accessor::get`] through a [`Read`] accessor, at an index inside its binding's
//!   ordinary range, is a plain load: nothing writes that memory while the kernel
//!   runs (no writable accessor of the command group overlaps a read-only one, the
//!   scheduler orders other writers, and a fused kernel binds a read-only slot that
//!   another of its kernels writes as shared memory, which has no ordinary range).
//! * Every other [`Accessor::get`] and every [`Accessor::set`] uses relaxed atomic
//!   loads and stores of the element's machine words (a plain `mov` on x86). Racing
//!   work-items may observe torn values of a multi-word `T`, which is harmless because
//!   `T: Pod` accepts every bit pattern; there is no undefined behaviour.
//! * [`ElemAccessor::elem`] hands each work-item a `&mut T` to *its own* element (the
//!   one at its global linear id). The command group rejects any other accessor that
//!   overlaps a writable one, and each work-item runs once per launch, so these
//!   references never alias.
//! * [`Accessor::as_slice_mut`] and friends are `unsafe`: the SYCL contract (distinct
//!   work-items write distinct elements, and nobody reads an element another work-item
//!   writes) is the caller's to keep.
//! * Host tasks get [`HostAccessor`]s, which are neither `Copy` nor `Clone`, so a
//!   `&mut [T]` borrowed from one is unique.
//!
//! Every accessor carries its command group's tag; using it in another command
//! group's kernel panics (which fails that command, not the runtime).

use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};

use bytemuck::Pod;

use gantry_driver::{AccessMode, Binding, HostCtx};

use crate::item::Item;

/// Type-level access mode of an accessor.
pub trait Mode: Send + Sync + 'static {
    /// The run-time mode.
    const MODE: AccessMode;
    /// Whether the mode only reads: an accessor of it in a command group has no
    /// writable accessor overlapping it, so where nothing else writes its memory
    /// meanwhile (ordinary memory; a fused slot that another kernel writes is bound
    /// as shared memory instead) its reads are plain loads.
    const READ_ONLY: bool = false;
}
/// Modes that allow reading.
pub trait Readable: Mode {}
/// Modes that allow writing.
pub trait Writable: Mode {}

/// Read-only access.
#[derive(Debug)]
pub struct Read;
/// Write access that keeps unwritten elements.
#[derive(Debug)]
pub struct Write;
/// Read and write access.
#[derive(Debug)]
pub struct ReadWrite;
/// Write access that discards previous contents.
#[derive(Debug)]
pub struct DiscardWrite;

impl Mode for Read {
    const MODE: AccessMode = AccessMode::Read;
    const READ_ONLY: bool = true;
}
impl Mode for Write {
    const MODE: AccessMode = AccessMode::Write;
}
impl Mode for ReadWrite {
    const MODE: AccessMode = AccessMode::ReadWrite;
}
impl Mode for DiscardWrite {
    const MODE: AccessMode = AccessMode::DiscardWrite;
}
impl Readable for Read {}
impl Readable for ReadWrite {}
impl Writable for Write {}
impl Writable for ReadWrite {}
impl Writable for DiscardWrite {}

/// Relaxed atomic load of a `Pod` value, word by word.
///
/// # Safety
/// `p` must be valid for reads of `T` and aligned for `T`.
#[inline(always)]
pub(crate) unsafe fn load_relaxed<T: Pod>(p: *const T) -> T {
    let mut out = T::zeroed();
    let dst = (&mut out as *mut T).cast::<u8>();
    // SAFETY (all arms): `p` is valid and aligned for T, so it is valid and aligned for
    // the word type chosen, which never has a larger alignment than T; `dst` is `out`.
    unsafe {
        if align_of::<T>() >= 8 && size_of::<T>().is_multiple_of(8) {
            for k in 0..size_of::<T>() / 8 {
                let w = (*p.cast::<AtomicU64>().add(k)).load(Relaxed);
                dst.cast::<u64>().add(k).write(w);
            }
        } else if align_of::<T>() >= 4 && size_of::<T>().is_multiple_of(4) {
            for k in 0..size_of::<T>() / 4 {
                let w = (*p.cast::<AtomicU32>().add(k)).load(Relaxed);
                dst.cast::<u32>().add(k).write(w);
            }
        } else if align_of::<T>() >= 2 && size_of::<T>().is_multiple_of(2) {
            for k in 0..size_of::<T>() / 2 {
                let w = (*p.cast::<AtomicU16>().add(k)).load(Relaxed);
                dst.cast::<u16>().add(k).write(w);
            }
        } else {
            for k in 0..size_of::<T>() {
                let w = (*p.cast::<AtomicU8>().add(k)).load(Relaxed);
                dst.add(k).write(w);
            }
        }
    }
    out
}

/// Relaxed atomic store of a `Pod` value, word by word.
///
/// # Safety
/// `p` must be valid for writes of `T` and aligned for `T`.
#[inline(always)]
pub(crate) unsafe fn store_relaxed<T: Pod>(p: *mut T, v: T) {
    let src = (&v as *const T).cast::<u8>();
    // SAFETY (all arms): as in `load_relaxed`.
    unsafe {
        if align_of::<T>() >= 8 && size_of::<T>().is_multiple_of(8) {
            for k in 0..size_of::<T>() / 8 {
                (*p.cast::<AtomicU64>().add(k)).store(src.cast::<u64>().add(k).read(), Relaxed);
            }
        } else if align_of::<T>() >= 4 && size_of::<T>().is_multiple_of(4) {
            for k in 0..size_of::<T>() / 4 {
                (*p.cast::<AtomicU32>().add(k)).store(src.cast::<u32>().add(k).read(), Relaxed);
            }
        } else if align_of::<T>() >= 2 && size_of::<T>().is_multiple_of(2) {
            for k in 0..size_of::<T>() / 2 {
                (*p.cast::<AtomicU16>().add(k)).store(src.cast::<u16>().add(k).read(), Relaxed);
            }
        } else {
            for k in 0..size_of::<T>() {
                (*p.cast::<AtomicU8>().add(k)).store(src.add(k).read(), Relaxed);
            }
        }
    }
}

#[inline(always)]
fn element<T>(b: Binding, i: usize) -> *mut T {
    let n = b.len / size_of::<T>().max(1);
    assert!(i < n, "accessor index {i} out of bounds for {n} elements");
    // SAFETY: i < n, so the offset stays inside the binding.
    unsafe { b.ptr.cast::<T>().add(i) }
}

/// A kernel's view of a buffer range, in mode `M`. `Copy`, so kernel closures capture
/// it by value; it reaches memory only through the [`Item`] of a running kernel.
///
/// Indexes are relative to the accessor's range.
pub struct Accessor<T, M> {
    slot: u32,
    tag: u64,
    len: usize,
    _p: PhantomData<fn() -> (T, M)>,
}

impl<T, M> Clone for Accessor<T, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T, M> Copy for Accessor<T, M> {}
impl<T, M> std::fmt::Debug for Accessor<T, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accessor").field("slot", &self.slot).field("len", &self.len).finish()
    }
}

impl<T: Pod, M: Mode> Accessor<T, M> {
    /// Slot `slot` of the command group tagged `tag`, `len` elements long. Made by
    /// the command-group builder; drivers' tests build them directly.
    pub fn new(slot: u32, tag: u64, len: usize) -> Self {
        Self { slot, tag, len, _p: PhantomData }
    }
    /// Number of elements in the accessor's range.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Raw pointer to the first element of the range.
    ///
    /// # Safety
    /// Dereferencing it is subject to the SYCL contract: no element may be written by
    /// one work-item while another reads or writes it without atomics.
    pub unsafe fn as_ptr(&self, it: &Item<'_>) -> *mut T {
        it.region(self.slot, self.tag).ptr.cast()
    }
}

impl<T: Pod, M: Readable> Accessor<T, M> {
    /// Reads element `i`.
    ///
    /// # Panics
    /// If `i` is out of range (the panic fails the command).
    #[inline(always)]
    pub fn get(&self, it: &Item<'_>, i: usize) -> T {
        match it.direct_element::<T>(self.slot, self.tag, i) {
            // SAFETY: in bounds and aligned (ranges start at element boundaries of an
            // aligned allocation). A direct element is ordinary memory that no other
            // work-group writes while this one runs: no writable accessor of the
            // command group overlaps a read-only one, the scheduler orders other
            // commands' writes, and a fused kernel binds a slot that one kernel reads
            // and another writes as shared memory, which is never direct. So a plain
            // load races with nothing.
            Some(p) if M::READ_ONLY => unsafe { p.read() },
            // SAFETY: in bounds and aligned; relaxed atomics make concurrent access
            // race-free.
            Some(p) => unsafe { load_relaxed(p) },
            // SAFETY: as above (the general path returns an element in bounds).
            None => unsafe { load_relaxed(it.general_element::<T>(self.slot, self.tag, i).0) },
        }
    }

    /// Reads this work-item's own element: element [`Item::global_linear_id`] of the
    /// range, as `get(it, it.global_linear_id())`, with the range's length checked
    /// once per launch instead of per access. In a kernel whose body runs as two
    /// copies (`parallel_for!`), a body of such reads and of
    /// [`ElemAccessor::elem`] writes compiles to a loop the compiler vectorizes.
    ///
    /// # Panics
    /// If the range holds no element at the linear id (the panic fails the command).
    ///
    /// ```
    /// # use gantry_host::{Accessor, ElemAccessor, DiscardWrite, Read, GroupCtx};
    /// # use gantry_driver::{Binding, Geometry, Range};
    /// let (mut x, mut y) = ([1.0f32, 2.0, 3.0], [0.0f32; 3]);
    /// let bindings = [Binding::new(x.as_mut_ptr().cast(), 12), Binding::new(y.as_mut_ptr().cast(), 12)];
    /// let (a, o) = (Accessor::<f32, Read>::new(0, 7, 3), ElemAccessor::<f32, DiscardWrite>::new(1, 7, 3));
    /// let geometry = Geometry::for_range(Range::d1(3)).unwrap();
    /// GroupCtx::new(&geometry, [0; 3], &bindings, &[], 7).for_each_item(&|it| *o.elem(it) = 2.0 * a.at(it));
    /// assert_eq!(y, [2.0, 4.0, 6.0]);
    /// ```
    #[inline(always)]
    pub fn at(&self, it: &Item<'_>) -> T {
        let glid = it.global_linear_id();
        let direct = it
            .own_element::<T>(self.slot, self.tag)
            .or_else(|| it.direct_element::<T>(self.slot, self.tag, glid));
        match direct {
            // SAFETY: as in `get`.
            Some(p) if M::READ_ONLY => unsafe { p.read() },
            // SAFETY: in bounds and aligned; relaxed atomics make concurrent access
            // race-free.
            Some(p) => unsafe { load_relaxed(p) },
            // SAFETY: as above (the general path returns an element in bounds).
            None => unsafe { load_relaxed(it.general_element::<T>(self.slot, self.tag, glid).0) },
        }
    }

    /// The whole range as a slice.
    ///
    /// # Safety
    /// No work-item may write any element of the range while the slice lives.
    pub unsafe fn as_slice<'a>(&self, it: &Item<'a>) -> &'a [T] {
        let b = it.region(self.slot, self.tag);
        // SAFETY: the binding is live for the launch ('a); exclusivity is the caller's.
        unsafe { std::slice::from_raw_parts(b.ptr.cast(), b.len / size_of::<T>().max(1)) }
    }
}

impl<T: Pod, M: Writable> Accessor<T, M> {
    /// Writes element `i`.
    ///
    /// # Panics
    /// If `i` is out of range (the panic fails the command).
    #[inline(always)]
    pub fn set(&self, it: &Item<'_>, i: usize, v: T) {
        let p = match it.direct_element::<T>(self.slot, self.tag, i) {
            Some(p) => p,
            None => it.general_element::<T>(self.slot, self.tag, i).0,
        };
        // SAFETY: in bounds and aligned; relaxed atomics make concurrent access race-free.
        unsafe { store_relaxed(p, v) }
    }

    /// The whole range as a mutable slice.
    ///
    /// # Safety
    /// The SYCL contract: distinct work-items write distinct elements and nobody reads
    /// an element another work-item writes, and no two slices from this call alias
    /// within one work-item.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_slice_mut<'a>(&self, it: &Item<'a>) -> &'a mut [T] {
        let b = it.region(self.slot, self.tag);
        // SAFETY: the binding is live for the launch; exclusivity is the caller's.
        unsafe { std::slice::from_raw_parts_mut(b.ptr.cast(), b.len / size_of::<T>().max(1)) }
    }
}

/// An accessor of a buffer range in a command group: its slot, for settings such as a
/// fusion promotion hint.
pub trait BufferSlot {
    /// The slot and the command group's tag.
    fn slot_and_tag(&self) -> (u32, u64);
}

impl<T, M> BufferSlot for Accessor<T, M> {
    fn slot_and_tag(&self) -> (u32, u64) {
        (self.slot, self.tag)
    }
}

impl<T, M> BufferSlot for ElemAccessor<T, M> {
    fn slot_and_tag(&self) -> (u32, u64) {
        (self.inner.slot, self.inner.tag)
    }
}

/// An exclusive per-work-item view: each work-item may borrow the element at its own
/// global linear id mutably. The accessor's range has exactly one element per
/// work-item (checked when the kernel is submitted).
pub struct ElemAccessor<T, M> {
    inner: Accessor<T, M>,
}
impl<T, M> Clone for ElemAccessor<T, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T, M> Copy for ElemAccessor<T, M> {}

impl<T: Pod, M: Writable> ElemAccessor<T, M> {
    #[doc(hidden)]
    pub fn new(slot: u32, tag: u64, len: usize) -> Self {
        Self { inner: Accessor::new(slot, tag, len) }
    }
    /// Number of elements (equal to the kernel's global size).
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// This work-item's element. Borrowing the item mutably keeps the reference unique.
    ///
    /// # Panics
    /// In a kernel fused with kernels that read this memory from other work-groups
    /// meanwhile (bound as shared memory, which only the runtime's
    /// `fuse_unprofitable` setting fuses): the fused kernel fails, and the driver runs
    /// its kernels unfused.
    #[inline(always)]
    pub fn elem<'i>(&self, it: &'i mut Item<'_>) -> &'i mut T {
        let (slot, tag) = (self.inner.slot, self.inner.tag);
        let glid = it.global_linear_id();
        let p = match it.own_element::<T>(slot, tag).or_else(|| it.direct_element::<T>(slot, tag, glid)) {
            Some(p) => p,
            None => it.exclusive_element::<T>(slot, tag, glid),
        };
        // SAFETY: each work-item has a distinct global linear id and runs once per
        // launch; no other accessor of this command group overlaps a writable range;
        // `it` stays mutably borrowed while the reference lives. Internalized memory
        // (fusion) may map two work-items of one group to one element, but a group's
        // work-items run one at a time on one thread and the borrow ends with the item.
        // Memory other work-groups of a fused kernel read meanwhile is bound as shared
        // memory, which gives no reference (`exclusive_element` panics).
        unsafe { &mut *p }
    }
}

/// Work-group local memory of `len` elements of `T`, shared by the work-items of one
/// group and zeroed when the group starts (the MLIR GPU functions and memory modelling RFC's workgroup attribution).
pub struct LocalAccessor<T> {
    slot: u32,
    tag: u64,
    len: usize,
    _p: PhantomData<fn() -> T>,
}
impl<T> Clone for LocalAccessor<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for LocalAccessor<T> {}

impl<T: Pod> LocalAccessor<T> {
    #[doc(hidden)]
    pub fn new(slot: u32, tag: u64, len: usize) -> Self {
        Self { slot, tag, len, _p: PhantomData }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Reads element `i` of this group's local memory.
    #[inline(always)]
    pub fn get(&self, it: &Item<'_>, i: usize) -> T {
        let p = element::<T>(it.scratch_binding(self.slot, self.tag), i);
        // SAFETY: in bounds, aligned scratch owned by this group.
        unsafe { load_relaxed(p) }
    }
    /// Writes element `i` of this group's local memory.
    #[inline(always)]
    pub fn set(&self, it: &Item<'_>, i: usize, v: T) {
        let p = element::<T>(it.scratch_binding(self.slot, self.tag), i);
        // SAFETY: in bounds, aligned scratch owned by this group.
        unsafe { store_relaxed(p, v) }
    }
}

/// Private memory: `len` elements of `T` per work-item, kept across the phases of a
/// work-group kernel (the MLIR GPU functions and memory modelling RFC's private attribution).
pub struct PrivateAccessor<T> {
    slot: u32,
    tag: u64,
    len: usize,
    _p: PhantomData<fn() -> T>,
}
impl<T> Clone for PrivateAccessor<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for PrivateAccessor<T> {}

impl<T: Pod> PrivateAccessor<T> {
    #[doc(hidden)]
    pub fn new(slot: u32, tag: u64, len: usize) -> Self {
        Self { slot, tag, len, _p: PhantomData }
    }
    /// Elements per work-item.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    #[inline(always)]
    fn at(&self, it: &Item<'_>, i: usize) -> *mut T {
        assert!(i < self.len, "private index {i} out of bounds for {} elements", self.len);
        element::<T>(it.scratch_binding(self.slot, self.tag), it.local_linear_id() * self.len + i)
    }
    /// Reads this work-item's element `i`.
    #[inline(always)]
    pub fn get(&self, it: &Item<'_>, i: usize) -> T {
        // SAFETY: in bounds of this work-item's region of the group's scratch.
        unsafe { load_relaxed(self.at(it, i)) }
    }
    /// Writes this work-item's element `i`.
    #[inline(always)]
    pub fn set(&self, it: &Item<'_>, i: usize, v: T) {
        // SAFETY: in bounds of this work-item's region of the group's scratch.
        unsafe { store_relaxed(self.at(it, i), v) }
    }
}

/// A host task's view of a buffer range. Not `Copy`: a mutable slice borrowed from it
/// is the only reference to those elements.
pub struct HostAccessor<T, M> {
    slot: u32,
    tag: u64,
    len: usize,
    _p: PhantomData<fn() -> (T, M)>,
}

impl<T: Pod, M: Mode> HostAccessor<T, M> {
    #[doc(hidden)]
    pub fn new(slot: u32, tag: u64, len: usize) -> Self {
        Self { slot, tag, len, _p: PhantomData }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: Pod, M: Readable> HostAccessor<T, M> {
    /// The range, for reading.
    pub fn as_slice<'a>(&'a self, ctx: &'a HostCtx<'_>) -> &'a [T] {
        let b = ctx.binding(self.slot, self.tag);
        assert!(b.len >= self.len * size_of::<T>(), "host accessor binding too short");
        // SAFETY: the scheduler runs the host task only when no other command may
        // write the range, the binding lives for the task, and overlapping writable
        // accessors in one command group are rejected.
        unsafe { std::slice::from_raw_parts(b.ptr.cast(), self.len) }
    }
}

impl<T: Pod, M: Writable> HostAccessor<T, M> {
    /// The range, for writing.
    pub fn as_mut_slice<'a>(&'a mut self, ctx: &'a HostCtx<'_>) -> &'a mut [T] {
        let b = ctx.binding(self.slot, self.tag);
        assert!(b.len >= self.len * size_of::<T>(), "host accessor binding too short");
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique because the
        // accessor cannot be copied or cloned.
        unsafe { std::slice::from_raw_parts_mut(b.ptr.cast(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, PartialEq, Debug, bytemuck::Zeroable, bytemuck::Pod)]
    #[repr(C)]
    struct Odd {
        a: u8,
        b: [u8; 2],
    }

    #[test]
    fn relaxed_round_trip_every_word_size() {
        unsafe {
            let mut x = 0u64;
            store_relaxed(&mut x, 0xDEAD_BEEF_0123_4567u64);
            assert_eq!(load_relaxed(&x), 0xDEAD_BEEF_0123_4567);
            let mut f = [0f32; 3];
            store_relaxed(&mut f, [1.0f32, 2.0, 3.0]);
            assert_eq!(load_relaxed(&f), [1.0, 2.0, 3.0]);
            let mut h = 0u16;
            store_relaxed(&mut h, 7u16);
            assert_eq!(load_relaxed(&h), 7);
            let mut o = Odd { a: 0, b: [0; 2] };
            store_relaxed(&mut o, Odd { a: 1, b: [2, 3] });
            assert_eq!(load_relaxed(&o), Odd { a: 1, b: [2, 3] });
        }
    }
}
