//! Buffers of plain data, host access guards and readbacks.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use bytemuck::Pod;
use gantry_components::{
    BufferCore, ByteRange, CommandDesc, CommandKind, EventShared, EventStatus, Message, QueueCore,
    Requirement, Work,
};
use gantry_driver::{AccessMode, HostStorage};
use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::runtime::Shared;

struct BufferHandle {
    core: Arc<BufferCore>,
    rt: Arc<Shared>,
    host_queue: Arc<QueueCore>,
}

impl Drop for BufferHandle {
    fn drop(&mut self) {
        // Commands still using the buffer keep its memory alive; the record goes once
        // they are done. A dropped runtime has nothing to tell. A fusion whose kernels
        // use it is cancelled now (the scheduler would, at its next flush).
        self.rt.fusing.cancel_users_of(&self.rt, self.core.id);
        let _ = self.rt.send(Message::DropBuffer(self.core.clone()));
    }
}

/// A buffer of `len` elements of plain data `T`, usable by every device of its
/// runtime. Clones share the buffer. Dropping the last handle while commands still
/// use it is safe: they finish first.
///
/// ```
/// let rt = gantry::Runtime::new();
/// let buf = rt.buffer(&[1u32, 2, 3, 4]);
/// {
///     let mut w = buf.write()?; // waits for pending work, then holds the data
///     w[0] = 10;
/// }
/// assert_eq!(&*buf.read()?, &[10, 2, 3, 4]);
/// # Ok::<(), gantry::Error>(())
/// ```
pub struct Buffer<T> {
    handle: Arc<BufferHandle>,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Buffer<T> {
    fn clone(&self) -> Self {
        Self { handle: self.handle.clone(), len: self.len, _t: PhantomData }
    }
}

impl<T> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer").field("id", &self.handle.core.id).field("len", &self.len).finish()
    }
}

impl<T> Buffer<T> {
    pub(crate) fn new(
        core: Arc<BufferCore>,
        len: usize,
        rt: Arc<Shared>,
        host_queue: Arc<QueueCore>,
    ) -> Self {
        Self { handle: Arc::new(BufferHandle { core, rt, host_queue }), len, _t: PhantomData }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Identifies the buffer in errors.
    pub fn id(&self) -> u64 {
        self.handle.core.id
    }

    /// Sets the promotion hint every accessor of this buffer inherits when its kernel
    /// is fused (see [`Handler::promote`](crate::Handler::promote)); an accessor's own
    /// hint overrides it.
    pub fn set_promotion(&self, promotion: gantry_driver::fusion::Promotion) {
        self.handle.core.set_promotion(promotion);
    }

    pub(crate) fn core(&self) -> &Arc<BufferCore> {
        &self.handle.core
    }

    /// A handle that keeps the buffer alive (graphs hold one per buffer they use).
    pub(crate) fn keep_alive(&self) -> crate::handler::KeepAlive {
        self.handle.clone()
    }

    pub(crate) fn runtime_id(&self) -> u64 {
        self.handle.rt.id
    }
}

impl<T: Pod> Buffer<T> {
    /// Reads the contents after all earlier work that writes them, holding off later
    /// writers while the guard lives.
    pub fn read(&self) -> Result<HostRead<T>> {
        let access = self.host_access(AccessMode::Read)?;
        Ok(HostRead { access, _t: PhantomData })
    }

    /// Holds the contents for reading and writing after all earlier work that uses
    /// them; later work waits for the guard to drop.
    pub fn write(&self) -> Result<HostWrite<T>> {
        let access = self.host_access(AccessMode::ReadWrite)?;
        Ok(HostWrite { access, _t: PhantomData })
    }

    /// Copies the contents out (after earlier writers).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        Ok(self.read()?.to_vec())
    }

    fn host_access(&self, mode: AccessMode) -> Result<HostAccess> {
        let rt = &self.handle.rt;
        let core = &self.handle.core;
        if core.recorded.load(std::sync::atomic::Ordering::Acquire) > 0 {
            return Err(Error::BufferRecorded(core.id));
        }
        let held = HeldGuard::take(core.id, mode.writes())?;
        let name: Arc<str> = format!("host access to buffer {}", core.id).into();
        let event = Arc::new(EventShared::new(name.clone(), rt.id, rt.clock.stamp_ns()));
        let req = Requirement::new(core.clone(), mode, ByteRange::new(0, core.bytes));
        rt.send(Message::Submit(CommandDesc {
            kind: CommandKind::HostAccess,
            name,
            queue: self.handle.host_queue.clone(),
            device: 0,
            requirements: SmallVec::from_iter([req]),
            work: Work::HostAccess,
            waits: SmallVec::new(),
            event: event.clone(),
            fusion: None,
        }))?;
        rt.wait_for(&event, EventStatus::Running)?;
        if let Some(e) = event.error() {
            return Err(Error::Exec(e.clone()));
        }
        Ok(HostAccess { storage: core.storage.clone(), event, rt: rt.clone(), _held: held })
    }
}

/// A running host access: the scheduler holds later conflicting work until drop.
struct HostAccess {
    storage: Arc<HostStorage>,
    event: Arc<EventShared>,
    rt: Arc<Shared>,
    _held: HeldGuard,
}

/// The host guards each thread holds, by buffer: a thread that asks for access to a
/// buffer it holds a conflicting guard on would wait for itself forever, so that is
/// an error instead. A guard counts for the thread that took it, also if it is
/// moved to another thread.
static HELD: std::sync::Mutex<Vec<(u64, std::thread::ThreadId, bool, u64)>> =
    std::sync::Mutex::new(Vec::new());

/// One entry of [`HELD`], removed on drop.
struct HeldGuard(u64);

impl HeldGuard {
    /// Registers a guard on `buffer` for this thread, unless this thread already
    /// holds one that conflicts (either writes).
    fn take(buffer: u64, writes: bool) -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let me = std::thread::current().id();
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if held.iter().any(|&(b, t, w, _)| b == buffer && t == me && (w || writes)) {
            return Err(Error::SelfDeadlock(format!(
                "this thread holds a host guard on buffer {buffer}; a second {} access would wait for it forever",
                if writes { "write" } else { "read" }
            )));
        }
        let token = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        held.push((buffer, me, writes, token));
        Ok(Self(token))
    }
}

impl Drop for HeldGuard {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|e| e.3 != self.0);
    }
}

impl Drop for HostAccess {
    fn drop(&mut self) {
        if let Some(e) = self.event.command.get() {
            let _ = self.rt.send(gantry_components::Message::ReleaseHostAccess(e));
        }
    }
}

/// Read access to a buffer's contents on the host. See [`Buffer::read`].
pub struct HostRead<T> {
    access: HostAccess,
    _t: PhantomData<fn() -> T>,
}

impl<T: Pod> Deref for HostRead<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the scheduler runs no command that writes the buffer while this
        // access is running, and the storage lives as long as the guard.
        bytemuck::cast_slice(unsafe { self.access.storage.bytes() })
    }
}

/// Read-write access to a buffer's contents on the host. See [`Buffer::write`].
pub struct HostWrite<T> {
    access: HostAccess,
    _t: PhantomData<fn() -> T>,
}

impl<T: Pod> Deref for HostWrite<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: no other command touches the buffer while this access is running.
        bytemuck::cast_slice(unsafe { self.access.storage.bytes() })
    }
}

impl<T: Pod> DerefMut for HostWrite<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        bytemuck::cast_slice_mut(unsafe { self.access.storage.bytes_mut() })
    }
}

/// The shared state of a [`Readback`]: the destination and the copy's event.
pub(crate) type ReadbackSlot = Arc<gantry_driver::sync::Mutex<Option<(Arc<HostStorage>, Arc<EventShared>)>>>;

/// The destination of a buffer-to-host copy: filled when the copy's event completes.
///
/// ```
/// use gantry::{Runtime, Readback};
/// let rt = Runtime::new();
/// let buf = rt.buffer(&[5u16, 6, 7, 8]);
/// let out = Readback::new();
/// rt.queue().submit(|cg| cg.copy_to_host(&buf, 1..3, &out))?.wait()?;
/// assert_eq!(out.take(), Some(vec![6, 7]));
/// # Ok::<(), gantry::Error>(())
/// ```
pub struct Readback<T> {
    pub(crate) slot: ReadbackSlot,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Readback<T> {
    fn clone(&self) -> Self {
        Self { slot: self.slot.clone(), _t: PhantomData }
    }
}

impl<T: Pod> Default for Readback<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Pod> Readback<T> {
    /// An empty readback.
    pub fn new() -> Self {
        Self { slot: Default::default(), _t: PhantomData }
    }

    /// The copied elements once the copy has completed successfully, taken out;
    /// `None` before that, and after a take until another copy fills it.
    pub fn take(&self) -> Option<Vec<T>> {
        let mut slot = self.slot.lock();
        if slot.as_ref()?.1.status() != EventStatus::Complete {
            return None;
        }
        let (storage, _) = slot.take()?;
        // SAFETY: the copy has completed; the storage is private to this readback.
        let bytes = unsafe { storage.bytes() };
        Some(bytemuck::cast_slice::<u8, T>(bytes).to_vec())
    }
}
