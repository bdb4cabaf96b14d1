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
//! Hashing the images' bytes (kilobytes of IR per kernel) would cost a hit more
//! than everything else, so a lookup goes first by [`IdKey`]: the same inputs with
//! each image by its [`ImageId`] (clones share it, and ids are never reused), hashed
//! without the bytes. Only where no cached module was reached by those identities
//! is the [`FusionKey`] built and its bytes hashed; a module found that way (equal
//! bytes in new images) is then reached by the new identities too. Each module
//! keeps at most [`MAX_ALIASES`] identity keys, the oldest dropped first.
//!
//! The cache is bounded: it keeps at most its capacity of modules and evicts the
//! least recently used (built or hit) one to make room, with its identity keys.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use gantry_driver::fusion::{FusionKernel, FusionRequest, Promotion};
use gantry_driver::{CodeImage, Geometry, ImageId, ScalarBlock, Signature};
use rustc_hash::FxHasher;

/// The identity keys a cached module keeps (see the module docs).
pub(super) const MAX_ALIASES: usize = 8;

/// A slot as the key holds it: (buffer number, start, end, element size, promotion).
type SlotKey = (usize, usize, usize, usize, Promotion);

/// `kernel`'s slots with buffers numbered by `buffers`, one by one.
fn slots<'a>(kernel: &'a FusionKernel, buffers: &'a [u64]) -> impl Iterator<Item = SlotKey> + 'a {
    kernel.args.iter().map(|a| {
        let buffer = buffers.iter().position(|&b| b == a.buffer).expect("buffer numbered");
        (buffer, a.start, a.end, a.elem_size, a.promotion)
    })
}

/// One kernel's part of a [`FusionKey`].
#[derive(Clone, Debug)]
struct KernelKey {
    image: CodeImage,
    signature: Signature,
    geometry: Geometry,
    slots: Vec<SlotKey>,
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
                let slots = slots(k, buffers).collect::<Vec<_>>();
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

/// One kernel's part of an [`IdKey`].
#[derive(Clone, Debug, PartialEq, Eq)]
struct IdKernel {
    image: ImageId,
    signature: Signature,
    geometry: Geometry,
    slots: Vec<SlotKey>,
    scalars: ScalarBlock,
}

/// A [`FusionKey`] with each image by its identity (see the module docs): equal
/// identity keys mean equal fusion keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct IdKey {
    barriers: bool,
    kernels: Vec<IdKernel>,
    hash: u64,
}

impl IdKey {
    /// The hash of `request`'s identity key (as [`FusionKey::new`] takes it),
    /// computed without building the key.
    pub(super) fn hash_of(request: &FusionRequest, images: &[&CodeImage], buffers: &[u64]) -> u64 {
        let mut h = FxHasher::default();
        request.barriers.hash(&mut h);
        for (k, image) in request.kernels.iter().zip(images) {
            image.id().hash(&mut h);
            k.kernel.signature.globals.hash(&mut h);
            k.kernel.signature.scalars.hash(&mut h);
            k.kernel.signature.memory.hash(&mut h);
            k.geometry.hash(&mut h);
            for slot in slots(k, buffers) {
                slot.hash(&mut h);
            }
            k.scalars.hash(&mut h);
        }
        h.finish()
    }

    /// `request`'s identity key, whose hash is `hash` ([`IdKey::hash_of`]).
    pub(super) fn new(request: &FusionRequest, images: &[&CodeImage], buffers: &[u64], hash: u64) -> Self {
        let kernels = request
            .kernels
            .iter()
            .zip(images)
            .map(|(k, image)| IdKernel {
                image: image.id(),
                signature: k.kernel.signature.clone(),
                geometry: k.geometry,
                slots: slots(k, buffers).collect(),
                scalars: k.scalars.clone(),
            })
            .collect();
        Self { barriers: request.barriers, kernels, hash }
    }

    /// Whether this is `request`'s identity key (compared without building that).
    fn is_of(&self, request: &FusionRequest, images: &[&CodeImage], buffers: &[u64]) -> bool {
        self.barriers == request.barriers
            && self.kernels.len() == request.kernels.len()
            && self.kernels.iter().zip(&request.kernels).zip(images).all(|((mine, k), image)| {
                mine.image == image.id()
                    && mine.signature == k.kernel.signature
                    && mine.geometry == k.geometry
                    && mine.scalars == k.scalars
                    && mine.slots.len() == k.args.len()
                    && mine.slots.iter().copied().eq(slots(k, buffers))
            })
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
    /// Of the hits, those found by comparing image bytes, not identities: the
    /// request's images were new, with the bytes of cached ones.
    pub by_bytes: u64,
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
    /// The hashes of the identity keys that reach it, oldest first.
    aliases: VecDeque<u64>,
}

/// Values by [`FusionKey`], reached first by [`IdKey`], least recently used out
/// first.
pub(super) struct Lru<V> {
    capacity: usize,
    /// The values, by a serial number of their own.
    entries: HashMap<u64, Entry<V>>,
    /// Serial numbers by the hash of their [`FusionKey`].
    by_key: HashMap<u64, Vec<u64>>,
    /// Identity keys with the serial number they reach, by their hash.
    by_id: HashMap<u64, Vec<(IdKey, u64)>>,
    serial: u64,
    tick: u64,
    pub(super) stats: FusionCacheStats,
}

impl<V> Lru<V> {
    /// An empty cache of at most `capacity` values (0 keeps none).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: HashMap::new(),
            by_key: HashMap::new(),
            by_id: HashMap::new(),
            serial: 0,
            tick: 0,
            stats: FusionCacheStats::default(),
        }
    }

    /// The most values it keeps.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Counts a hit of entry `serial` and makes it the most recently used.
    fn hit(&mut self, serial: u64) -> Arc<V> {
        self.tick += 1;
        let entry = self.entries.get_mut(&serial).expect("a live serial");
        entry.used = self.tick;
        self.stats.hits += 1;
        entry.value.clone()
    }

    /// The value `request`'s identity key (of hash `id_hash`) reaches, counted as a
    /// hit.
    pub(super) fn get_by_identity(
        &mut self,
        id_hash: u64,
        request: &FusionRequest,
        images: &[&CodeImage],
        buffers: &[u64],
    ) -> Option<Arc<V>> {
        let serial = self.by_id.get(&id_hash)?.iter().find(|(k, _)| k.is_of(request, images, buffers))?.1;
        Some(self.hit(serial))
    }

    /// The value for `key`, counted as a hit (one by bytes) and made the most
    /// recently used; `ids` reaches it from now on.
    pub(super) fn get(&mut self, key: &FusionKey, ids: IdKey) -> Option<Arc<V>> {
        let serial = *self
            .by_key
            .get(&key.hash)?
            .iter()
            .find(|s| self.entries.get(s).is_some_and(|e| e.key == *key))?;
        self.stats.by_bytes += 1;
        self.alias(serial, ids);
        Some(self.hit(serial))
    }

    /// Makes `ids` reach entry `serial`, dropping its oldest identity key if it has
    /// [`MAX_ALIASES`].
    fn alias(&mut self, serial: u64, ids: IdKey) {
        let entry = self.entries.get_mut(&serial).expect("a live serial");
        if entry.aliases.len() >= MAX_ALIASES {
            let oldest = entry.aliases.pop_front().expect("a full list");
            Self::unlink(&mut self.by_id, oldest, serial);
        }
        entry.aliases.push_back(ids.hash);
        self.by_id.entry(ids.hash).or_default().push((ids, serial));
    }

    /// Removes the identity keys of hash `hash` that reach `serial`.
    fn unlink(by_id: &mut HashMap<u64, Vec<(IdKey, u64)>>, hash: u64, serial: u64) {
        if let Some(bucket) = by_id.get_mut(&hash) {
            bucket.retain(|(_, s)| *s != serial);
            if bucket.is_empty() {
                by_id.remove(&hash);
            }
        }
    }

    /// Counts a fusion that was not a hit.
    pub(super) fn miss(&mut self) {
        self.stats.misses += 1;
    }

    /// Stores `value` under `key`, reached by `ids` (unless present: another
    /// thread may have built it meanwhile), evicting the least recently used value
    /// if full.
    pub(super) fn insert(&mut self, key: FusionKey, ids: IdKey, value: Arc<V>) {
        if self.capacity == 0 {
            return;
        }
        let present = self
            .by_key
            .get(&key.hash)
            .and_then(|b| b.iter().copied().find(|s| self.entries.get(s).is_some_and(|e| e.key == key)));
        if let Some(serial) = present {
            if !self.by_id.get(&ids.hash).is_some_and(|b| b.iter().any(|(k, s)| *s == serial && *k == ids)) {
                self.alias(serial, ids);
            }
            return;
        }
        if self.stats.len >= self.capacity {
            let oldest = self.entries.iter().map(|(&s, e)| (e.used, s)).min();
            if let Some((_, serial)) = oldest {
                let entry = self.entries.remove(&serial).expect("the oldest entry");
                if let Some(bucket) = self.by_key.get_mut(&entry.key.hash) {
                    bucket.retain(|&s| s != serial);
                    if bucket.is_empty() {
                        self.by_key.remove(&entry.key.hash);
                    }
                }
                for hash in entry.aliases {
                    Self::unlink(&mut self.by_id, hash, serial);
                }
                self.stats.len -= 1;
                self.stats.evictions += 1;
            }
        }
        self.tick += 1;
        self.serial += 1;
        let serial = self.serial;
        self.by_key.entry(key.hash).or_default().push(serial);
        self.entries.insert(serial, Entry { key, value, used: self.tick, aliases: VecDeque::new() });
        self.alias(serial, ids);
        self.stats.len += 1;
    }
}
