//! Snapshots: copies of an operation's writable ranges, taken before it runs so that
//! a failure can put them back (`preserve_on_failure`), and the pool their memory
//! comes from.

use std::sync::Arc;

use gantry_driver::{AccessMode, Binding, MemArg};
use smallvec::SmallVec;

/// Copies of the writable ranges of an operation, taken before it runs so that a
/// failure can put them back. Taken from a [`SnapshotPool`], to which it hands its
/// copies back when dropped.
pub struct Snapshot {
    saved: SmallVec<[(Binding, SavedBytes); 2]>,
    /// Where its copies go back; `None` when none is large enough to be pooled.
    pool: Option<Arc<SnapshotPool>>,
}

/// One saved range: inline up to 64 bytes (a small buffer's whole contents), so that
/// the snapshot of a small kernel's output costs no allocation.
type SavedBytes = SmallVec<[u8; SAVED_INLINE]>;
const SAVED_INLINE: usize = 64;

impl Snapshot {
    /// Writes the saved bytes back.
    ///
    /// # Safety
    /// The bindings must still be valid and not accessed concurrently.
    pub unsafe fn restore(self) {
        for (b, bytes) in &self.saved {
            // SAFETY: same binding as at `take`, caller guarantees exclusivity.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.ptr, b.len) };
        }
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            for (_, bytes) in self.saved.drain(..) {
                pool.put(bytes.into_vec());
            }
        }
    }
}

/// Reusable snapshot memory for one driver. A snapshot of a large range costs a copy
/// either way, but in fresh memory it also costs a page fault per 4 KiB touched and an
/// unmap when it is freed (several times the copy: `docs/PERFORMANCE.md`), so
/// finished snapshots of at least [`SnapshotPool::MIN_POOLED`] bytes keep their memory
/// here for the next operation: at most [`SnapshotPool::MAX_POOLED`] of them and
/// [`SnapshotPool::DEFAULT_LIMIT`] bytes (or the limit given), the most recent first.
/// Smaller snapshots come from the allocator, which serves them without faults or a
/// lock.
///
/// ```
/// # use std::sync::Arc;
/// # use gantry_driver::{AccessMode, Binding};
/// # use gantry_host::SnapshotPool;
/// let pool = Arc::new(SnapshotPool::default());
/// let n = SnapshotPool::MIN_POOLED;
/// let mut data = vec![1u8; n];
/// let b = Binding::new(data.as_mut_ptr(), n);
/// // SAFETY: `data` is live and nothing else touches it.
/// let snap = unsafe { pool.take_modes([(AccessMode::ReadWrite, b)]) };
/// data.fill(9);
/// unsafe { snap.restore() };
/// assert!(data.iter().all(|&x| x == 1));
/// assert_eq!(pool.pooled_bytes(), n, "the copy's memory went back to the pool");
/// ```
#[derive(Debug)]
pub struct SnapshotPool {
    /// The pooled vectors and their total capacity.
    free: parking_lot::Mutex<(Vec<Vec<u8>>, usize)>,
    limit: usize,
}

impl Default for SnapshotPool {
    fn default() -> Self {
        Self::with_limit(Self::DEFAULT_LIMIT)
    }
}

impl SnapshotPool {
    /// Bytes a default pool keeps at most.
    pub const DEFAULT_LIMIT: usize = 256 << 20;
    /// Smallest snapshot whose memory is pooled.
    pub const MIN_POOLED: usize = 64 << 10;
    /// Most vectors a pool keeps.
    pub const MAX_POOLED: usize = 16;

    /// A pool that keeps at most `limit` bytes of finished snapshots.
    pub fn with_limit(limit: usize) -> Self {
        Self { free: parking_lot::Mutex::new((Vec::new(), 0)), limit }
    }

    /// Saves every writable binding (`bindings[i]` belongs to `args[i]`) in pooled
    /// memory.
    ///
    /// # Safety
    /// The bindings must be valid and not written concurrently.
    pub unsafe fn take(self: &Arc<Self>, args: &[MemArg], bindings: &[Binding]) -> Snapshot {
        // SAFETY: forwarded.
        unsafe { self.take_modes(args.iter().map(|a| a.mode).zip(bindings.iter().copied())) }
    }

    /// Saves every binding whose mode writes, in pooled memory when large.
    ///
    /// # Safety
    /// The bindings must be valid and not written concurrently.
    pub unsafe fn take_modes(
        self: &Arc<Self>,
        args: impl IntoIterator<Item = (AccessMode, Binding)>,
    ) -> Snapshot {
        let saved: SmallVec<[(Binding, SavedBytes); 2]> = args
            .into_iter()
            .filter(|(mode, _)| mode.writes())
            .map(|(_, b)| {
                // SAFETY: the caller guarantees validity.
                let bytes = unsafe { std::slice::from_raw_parts(b.ptr, b.len) };
                if bytes.len() <= SAVED_INLINE {
                    return (b, SavedBytes::from_slice(bytes));
                }
                let mut copy = self.get(b.len);
                copy.extend_from_slice(bytes);
                (b, SavedBytes::from_vec(copy))
            })
            .collect();
        let pooled = saved.iter().any(|(_, c)| c.capacity() >= Self::MIN_POOLED);
        Snapshot { saved, pool: pooled.then(|| self.clone()) }
    }

    /// Bytes of memory the pool holds now.
    pub fn pooled_bytes(&self) -> usize {
        self.free.lock().1
    }

    /// An empty vector with room for `len` bytes: the smallest pooled one that fits.
    fn get(&self, len: usize) -> Vec<u8> {
        if len < Self::MIN_POOLED {
            return Vec::with_capacity(len);
        }
        let mut guard = self.free.lock();
        let (free, total) = &mut *guard;
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => {
                let v = free.remove(i);
                *total -= v.capacity();
                v
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `bytes`' memory if it is large enough to be worth it and fits under the
    /// limits (dropping the oldest to make room).
    fn put(&self, mut bytes: Vec<u8>) {
        if bytes.capacity() < Self::MIN_POOLED || bytes.capacity() > self.limit {
            return;
        }
        bytes.clear();
        let mut guard = self.free.lock();
        let (free, total) = &mut *guard;
        *total += bytes.capacity();
        free.push(bytes);
        while *total > self.limit || free.len() > Self::MAX_POOLED {
            *total -= free.remove(0).capacity();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Snapshots restore their ranges, reuse pooled memory, and the pool stays under
    /// its limits: oldest memory goes first; copies larger than the limit, or too small
    /// to be worth pooling, are not kept.
    #[test]
    fn snapshot_pool_reuses_memory_within_its_limit() {
        const U: usize = SnapshotPool::MIN_POOLED;
        let pool = Arc::new(SnapshotPool::with_limit(10 * U));
        let mut a = vec![7u8; 6 * U];
        let mut b = vec![3u8; 3 * U];
        let (ba, bb) = (Binding::new(a.as_mut_ptr(), 6 * U), Binding::new(b.as_mut_ptr(), 3 * U));
        // SAFETY (all): the vectors are live and touched only between the calls.
        let s = unsafe { pool.take_modes([(AccessMode::Write, ba), (AccessMode::Read, bb)]) };
        a.fill(0);
        unsafe { s.restore() };
        assert_eq!(a, vec![7u8; 6 * U], "restored");
        assert_eq!(pool.pooled_bytes(), 6 * U, "only the written range was copied, and its memory kept");
        // The next snapshot of a smaller range takes that memory instead of allocating.
        let s = unsafe { pool.take_modes([(AccessMode::DiscardWrite, bb)]) };
        assert_eq!(pool.pooled_bytes(), 0);
        drop(s);
        assert_eq!(pool.pooled_bytes(), 6 * U);
        // Two copies alive at once: the second allocates; both come back, and the pool
        // drops the oldest to stay under its limit.
        let mut c = vec![5u8; 5 * U];
        let s1 = unsafe { pool.take_modes([(AccessMode::ReadWrite, ba)]) };
        let s2 = unsafe { pool.take_modes([(AccessMode::ReadWrite, Binding::new(c.as_mut_ptr(), 5 * U))]) };
        drop(s1);
        drop(s2);
        assert_eq!(pool.pooled_bytes(), 5 * U, "6 + 5 units > 10: the older 6 went");
        c.fill(0);
        // A copy larger than the limit is freed, not kept; so is a small one.
        let mut big = vec![1u8; 20 * U];
        let s = unsafe { pool.take_modes([(AccessMode::Write, Binding::new(big.as_mut_ptr(), 20 * U))]) };
        drop(s);
        let mut small = vec![1u8; 64];
        let s = unsafe { pool.take_modes([(AccessMode::Write, Binding::new(small.as_mut_ptr(), 64))]) };
        drop(s);
        assert_eq!(pool.pooled_bytes(), 5 * U);
        // At most MAX_POOLED vectors.
        let pool = Arc::new(SnapshotPool::default());
        let mut many: Vec<Vec<u8>> = (0..SnapshotPool::MAX_POOLED + 4).map(|_| vec![0u8; U]).collect();
        let snaps: Vec<Snapshot> = many
            .iter_mut()
            .map(|v| unsafe { pool.take_modes([(AccessMode::Write, Binding::new(v.as_mut_ptr(), U))]) })
            .collect();
        drop(snaps);
        assert_eq!(pool.pooled_bytes(), SnapshotPool::MAX_POOLED * U);
    }
}
