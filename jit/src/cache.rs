//! The compile cache: compiling the same inputs again is a lookup.
//!
//! The key is every input of a compilation: the image's kind, entry and bytes, the
//! signature, the target and the options. It is hashed for the lookup and compared
//! in full on a hit, so two different inputs never share a result whatever their
//! hashes. Unlike a driver's [`ImageCache`](gantry_driver::ImageCache), which is
//! keyed by image identity, equal bytes in two separately made images hit.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gantry_driver::{CodeImage, Signature};
use parking_lot::Mutex;

/// Everything a compilation depends on.
#[derive(Clone, Debug)]
pub struct CacheKey {
    image: CodeImage,
    signature: Signature,
    target: String,
}

impl CacheKey {
    /// The key of compiling `image` with `signature` for `target` (the target's
    /// triple, CPU, features and any option that changes the output, as text).
    pub fn new(image: &CodeImage, signature: &Signature, target: impl Into<String>) -> Self {
        Self { image: image.clone(), signature: signature.clone(), target: target.into() }
    }

    fn hash64(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.image.kind().hash(&mut h);
        self.image.entry().hash(&mut h);
        self.image.code().hash(&mut h);
        self.signature.globals.hash(&mut h);
        self.signature.scalars.hash(&mut h);
        self.signature.memory.hash(&mut h);
        self.target.hash(&mut h);
        h.finish()
    }
}

impl PartialEq for CacheKey {
    fn eq(&self, other: &Self) -> bool {
        self.image.kind() == other.image.kind()
            && self.image.entry() == other.image.entry()
            && self.image.code() == other.image.code()
            && self.signature == other.signature
            && self.target == other.target
    }
}

/// The results whose keys share one hash.
type Bucket<V> = Vec<(CacheKey, Arc<V>)>;

/// Compiled results by [`CacheKey`]. Results are kept until the cache is dropped
/// or [`CompileCache::clear`]ed.
pub struct CompileCache<V> {
    entries: Mutex<HashMap<u64, Bucket<V>>>,
    compiles: AtomicU64,
}

impl<V> Default for CompileCache<V> {
    fn default() -> Self {
        Self { entries: Mutex::new(HashMap::new()), compiles: AtomicU64::new(0) }
    }
}

impl<V> CompileCache<V> {
    /// The result for `key`: the cached one, or `compile`'s (cached if it succeeds;
    /// a failure is not, so the next call tries again). The lock is not held while
    /// compiling: two threads compiling one key at once both compile, and the first
    /// result stored is the one both get.
    pub fn get_or_compile<E>(
        &self,
        key: CacheKey,
        compile: impl FnOnce() -> Result<V, E>,
    ) -> Result<Arc<V>, E> {
        let hash = key.hash64();
        if let Some(v) = self.lookup(hash, &key) {
            return Ok(v);
        }
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let value = Arc::new(compile()?);
        let mut entries = self.entries.lock();
        let bucket = entries.entry(hash).or_default();
        if let Some((_, v)) = bucket.iter().find(|(k, _)| *k == key) {
            return Ok(v.clone());
        }
        bucket.push((key, value.clone()));
        Ok(value)
    }

    fn lookup(&self, hash: u64, key: &CacheKey) -> Option<Arc<V>> {
        self.entries.lock().get(&hash)?.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    /// How many compilations ran (hits do not count).
    pub fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed)
    }

    /// How many results it holds.
    pub fn len(&self) -> usize {
        self.entries.lock().values().map(Vec::len).sum()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every result.
    pub fn clear(&self) {
        self.entries.lock().clear();
    }
}

impl<V> std::fmt::Debug for CompileCache<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileCache").field("len", &self.len()).field("compiles", &self.compiles()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::{AccessMode, ImageKind};

    /// Equal inputs hit (also through a separately made image with the same bytes);
    /// a different signature, target or entry compiles again; failures are retried.
    #[test]
    fn equal_inputs_compile_once() {
        let cache: CompileCache<usize> = CompileCache::default();
        let sig = Signature::new().global(AccessMode::Read);
        let a = CodeImage::new(ImageKind::LlvmIr, "k", b"bytes".to_vec());
        let a2 = CodeImage::new(ImageKind::LlvmIr, "k", b"bytes".to_vec());
        let run = |image: &CodeImage, sig: &Signature, target: &str| {
            *cache
                .get_or_compile(CacheKey::new(image, sig, target), || Ok::<_, ()>(image.code().len()))
                .unwrap()
        };
        assert_eq!(run(&a, &sig, "host"), 5);
        assert_eq!(run(&a2, &sig, "host"), 5);
        assert_eq!(cache.compiles(), 1);
        run(&a, &sig.clone().scalar::<u32>(), "host");
        run(&a, &sig, "sm_90");
        run(&CodeImage::new(ImageKind::LlvmIr, "other", b"bytes".to_vec()), &sig, "host");
        assert_eq!((cache.compiles(), cache.len()), (4, 4));
        let key = CacheKey::new(&a, &sig, "fails");
        assert_eq!(cache.get_or_compile(key.clone(), || Err::<usize, _>("no")).unwrap_err(), "no");
        assert_eq!(*cache.get_or_compile(key, || Ok::<_, &str>(9)).unwrap(), 9);
        assert_eq!(cache.compiles(), 6);
    }
}
