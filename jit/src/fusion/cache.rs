//! The fusion cache: fusing the same chain again returns the module built the
//! first time.
//!
//! The key is every input of a fusion: the barrier flag and, per kernel, its
//! image (kind, entry, bytes), its signature, its geometry, its slots (buffer
//! numbered by first appearance, byte range, element size, promotion) and its
//! scalar block (the scalars are constants in the fused code). Buffer identities
//! and kernel names are not part of it: the same chain over other buffers of the
//! same layout is the same module. A hit compares the whole key (image bytes
//! only where two images are not clones of one), so unequal inputs never share a
//! module whatever their hashes.
//!
//! The cache is bounded: it keeps at most its capacity of modules and evicts the
//! least recently used (built or hit) one to make room.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use gantry_driver::fusion::{FusionRequest, Promotion};
use gantry_driver::{CodeImage, Geometry, ScalarBlock, Signature};

/// One kernel's part of a [`FusionKey`].
#[derive(Clone, Debug)]
struct KernelKey {
    image: CodeImage,
    signature: Signature,
    geometry: Geometry,
    slots: Vec<(usize, usize, usize, usize, Promotion)>,
    scalars: ScalarBlock,
}

impl PartialEq for KernelKey {
    fn eq(&self, other: &Self) -> bool {
        let same_image = self.image.id() == other.image.id()
            || (self.image.kind() == other.image.kind()
                && self.image.entry() == other.image.entry()
                && self.image.code() == other.image.code());
        same_image
            && self.signature == other.signature
            && self.geometry == other.geometry
            && self.slots == other.slots
            && self.scalars == other.scalars
    }
}

/// Everything a fused module depends on (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct FusionKey {
    barriers: bool,
    kernels: Vec<KernelKey>,
    hash: u64,
}

impl FusionKey {
    /// The key of `request`, whose kernels' images are `images` and whose buffers
    /// are numbered by `buffers`.
    pub(super) fn new(request: &FusionRequest, images: &[&CodeImage], buffers: &[u64]) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        request.barriers.hash(&mut h);
        let kernels = request
            .kernels
            .iter()
            .zip(images)
            .map(|(k, &image)| {
                let slots = k
                    .args
                    .iter()
                    .map(|a| {
                        let buffer = buffers.iter().position(|&b| b == a.buffer).expect("buffer numbered");
                        (buffer, a.start, a.end, a.elem_size, a.promotion)
                    })
                    .collect::<Vec<_>>();
                image.kind().hash(&mut h);
                image.entry().hash(&mut h);
                image.code().hash(&mut h);
                k.kernel.signature.globals.hash(&mut h);
                k.kernel.signature.scalars.hash(&mut h);
                k.kernel.signature.memory.hash(&mut h);
                k.geometry.hash(&mut h);
                slots.hash(&mut h);
                k.scalars.hash(&mut h);
                KernelKey {
                    image: image.clone(),
                    signature: k.kernel.signature.clone(),
                    geometry: k.geometry,
                    slots,
                    scalars: k.scalars.clone(),
                }
            })
            .collect();
        Self { barriers: request.barriers, kernels, hash: h.finish() }
    }
}

/// Counters of an [`IrFusion`](super::IrFusion)'s cache.
///
/// Non-exhaustive: read its fields; more counters may be added.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FusionCacheStats {
    /// Fusions answered from the cache.
    pub hits: u64,
    /// Fusions built anew (refusals included).
    pub misses: u64,
    /// Modules evicted to keep the cache within its capacity.
    pub evictions: u64,
    /// Modules cached now (at most the capacity).
    pub len: usize,
}

struct Entry<V> {
    key: FusionKey,
    value: Arc<V>,
    /// The tick of its last insertion or hit: the smallest is the least recently used.
    used: u64,
}

/// Values by [`FusionKey`], least recently used out first.
pub(super) struct Lru<V> {
    capacity: usize,
    entries: HashMap<u64, Vec<Entry<V>>>,
    tick: u64,
    pub(super) stats: FusionCacheStats,
}

impl<V> Lru<V> {
    /// An empty cache of at most `capacity` values (0 keeps none).
    pub(super) fn new(capacity: usize) -> Self {
        Self { capacity, entries: HashMap::new(), tick: 0, stats: FusionCacheStats::default() }
    }

    /// The most values it keeps.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The value for `key`, counted as a hit and made the most recently used.
    pub(super) fn get(&mut self, key: &FusionKey) -> Option<Arc<V>> {
        let entry = self.entries.get_mut(&key.hash)?.iter_mut().find(|e| e.key == *key)?;
        self.tick += 1;
        entry.used = self.tick;
        self.stats.hits += 1;
        Some(entry.value.clone())
    }

    /// Counts a fusion that was not a hit.
    pub(super) fn miss(&mut self) {
        self.stats.misses += 1;
    }

    /// Stores `value` under `key` (unless present: another thread may have built it
    /// meanwhile), evicting the least recently used value if full.
    pub(super) fn insert(&mut self, key: FusionKey, value: Arc<V>) {
        if self.capacity == 0 || self.entries.get(&key.hash).is_some_and(|b| b.iter().any(|e| e.key == key)) {
            return;
        }
        if self.stats.len >= self.capacity {
            let oldest = self
                .entries
                .iter()
                .flat_map(|(&h, b)| b.iter().enumerate().map(move |(i, e)| (e.used, h, i)))
                .min();
            if let Some((_, h, i)) = oldest {
                let bucket = self.entries.get_mut(&h).expect("bucket of the oldest entry");
                bucket.swap_remove(i);
                if bucket.is_empty() {
                    self.entries.remove(&h);
                }
                self.stats.len -= 1;
                self.stats.evictions += 1;
            }
        }
        self.tick += 1;
        let hash = key.hash;
        self.entries.entry(hash).or_default().push(Entry { key, value, used: self.tick });
        self.stats.len += 1;
    }
}
