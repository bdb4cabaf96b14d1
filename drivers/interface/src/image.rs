//! Kernel images: the code a driver runs for a kernel, in a form the scheduler
//! never looks inside.
//!
//! A kernel ([`Kernel`](crate::Kernel)) carries one or more images. Code images
//! ([`CodeImage`]: LLVM IR, PTX, CUDA C, SPIR-V, WGSL, or a kind a backend defines) are
//! bytes plus an entry point; a driver compiles or loads each one once into its own
//! handle (a module and function, a pipeline) and keeps it in an [`ImageCache`].
//! A native image is a value of the host program (a Rust closure kernel), which
//! only drivers that understand its type run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use rustc_hash::FxHashMap;

use crate::error::ExecError;
use crate::sync::Mutex;

/// What an image is. Drivers declare the kinds they run
/// ([`Capabilities::image_kinds`](crate::Capabilities)); the scheduler sends a
/// kernel only to a device that runs one of its images' kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ImageKind {
    /// A Rust closure kernel (the host drivers' native image).
    Closure,
    /// LLVM IR, text or bitcode, with the OpenCL work-item built-ins.
    LlvmIr,
    /// NVIDIA PTX assembly.
    Ptx,
    /// CUDA C++ source, compiled at run time (NVRTC) for the device that runs it.
    /// Its entry point is an `extern "C" __global__` function.
    CudaC,
    /// A SPIR-V module.
    SpirV,
    /// WGSL source.
    Wgsl,
    /// A kind defined by a backend outside this crate, by its name.
    Other(&'static str),
}

impl std::fmt::Display for ImageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageKind::Closure => f.write_str("closure"),
            ImageKind::LlvmIr => f.write_str("LLVM IR"),
            ImageKind::Ptx => f.write_str("PTX"),
            ImageKind::CudaC => f.write_str("CUDA C"),
            ImageKind::SpirV => f.write_str("SPIR-V"),
            ImageKind::Wgsl => f.write_str("WGSL"),
            ImageKind::Other(name) => f.write_str(name),
        }
    }
}

/// Identifies a [`CodeImage`] for as long as the process runs: two images with equal
/// ids are clones of one image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageId(u64);

struct ImageData {
    id: ImageId,
    kind: ImageKind,
    entry: Arc<str>,
    code: Box<[u8]>,
}

/// Device code: bytes of one [`ImageKind`] and the name of the entry point in them.
/// Cloning shares the bytes, and clones keep the image's [`ImageId`], so a driver
/// loads an image once however many launches carry it.
///
/// ```
/// use gantry_driver::{CodeImage, ImageKind};
/// let ptx = CodeImage::new(ImageKind::Ptx, "scale", b".version 8.0\n...".to_vec());
/// assert_eq!(ptx.kind(), ImageKind::Ptx);
/// assert_eq!(ptx.entry(), "scale");
/// assert_eq!(ptx.clone().id(), ptx.id());
/// ```
#[derive(Clone)]
pub struct CodeImage(Arc<ImageData>);

impl CodeImage {
    /// An image of `kind` whose entry point is `entry`.
    pub fn new(kind: ImageKind, entry: impl Into<Arc<str>>, code: impl Into<Box<[u8]>>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = ImageId(NEXT.fetch_add(1, Ordering::Relaxed));
        Self(Arc::new(ImageData { id, kind, entry: entry.into(), code: code.into() }))
    }
    /// Its kind.
    pub fn kind(&self) -> ImageKind {
        self.0.kind
    }
    /// The entry point's name.
    pub fn entry(&self) -> &str {
        &self.0.entry
    }
    /// The bytes (text images are their UTF-8 source).
    pub fn code(&self) -> &[u8] {
        &self.0.code
    }
    /// Its identity, shared by its clones.
    pub fn id(&self) -> ImageId {
        self.0.id
    }
}

impl std::fmt::Debug for CodeImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodeImage")
            .field("kind", &self.0.kind)
            .field("entry", &self.0.entry)
            .field("bytes", &self.0.code.len())
            .finish()
    }
}

/// A driver's loaded images (modules, functions, pipelines), each loaded once and
/// kept while any clone of its image lives: an entry whose image is gone is dropped
/// when the cache next grows.
///
/// ```
/// use gantry_driver::{CodeImage, ExecError, ImageCache, ImageKind};
/// let cache: ImageCache<usize> = ImageCache::default();
/// let image = CodeImage::new(ImageKind::Other("bytes"), "main", vec![1, 2, 3]);
/// let mut loads = 0;
/// for _ in 0..3 {
///     let loaded = cache.get_or_load(&image, |i| {
///         loads += 1;
///         Ok::<_, ExecError>(i.code().len())
///     })?;
///     assert_eq!(*loaded, 3);
/// }
/// assert_eq!(loads, 1, "loaded once");
/// # Ok::<(), ExecError>(())
/// ```
pub struct ImageCache<H> {
    loaded: Mutex<Loaded<H>>,
}

struct Loaded<H> {
    entries: FxHashMap<ImageId, (Weak<ImageData>, Arc<H>)>,
    /// The entry count after the last sweep of dead images: the next sweep runs when
    /// the count has doubled, so sweeping costs O(1) per insertion.
    swept: usize,
}

impl<H> Default for ImageCache<H> {
    fn default() -> Self {
        Self { loaded: Mutex::new(Loaded { entries: FxHashMap::default(), swept: 0 }) }
    }
}

impl<H> ImageCache<H> {
    /// The loaded form of `image`, loading it with `load` if this cache has not. The
    /// load runs without the cache's lock held (a compile may take long); if two
    /// threads load one image at once, the first to finish is kept. A failed load is
    /// not cached: the next launch tries again.
    pub fn get_or_load<E>(
        &self,
        image: &CodeImage,
        load: impl FnOnce(&CodeImage) -> Result<H, E>,
    ) -> Result<Arc<H>, E> {
        if let Some((_, h)) = self.loaded.lock().entries.get(&image.id()) {
            return Ok(h.clone());
        }
        let handle = Arc::new(load(image)?);
        let mut loaded = self.loaded.lock();
        if loaded.entries.len() >= 2 * loaded.swept.max(8) {
            loaded.entries.retain(|_, (image, _)| image.strong_count() > 0);
            loaded.swept = loaded.entries.len();
        }
        let entry = loaded.entries.entry(image.id()).or_insert((Arc::downgrade(&image.0), handle));
        Ok(entry.1.clone())
    }

    /// How many loaded images the cache holds.
    pub fn len(&self) -> usize {
        self.loaded.lock().entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<H> std::fmt::Debug for ImageCache<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageCache").field("len", &self.len()).finish()
    }
}

/// The error a driver returns for a kernel with no image it runs.
pub fn no_image(device: &Arc<str>, kernel: &Arc<str>) -> ExecError {
    ExecError::NoImage { device: device.clone(), kernel: kernel.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed load is not cached; images that are gone leave the cache as it grows.
    #[test]
    fn cache_retries_failures_and_forgets_dropped_images() {
        let cache: ImageCache<u8> = ImageCache::default();
        let image = CodeImage::new(ImageKind::SpirV, "main", vec![7]);
        assert_eq!(cache.get_or_load(&image, |_| Err("no compiler")), Err("no compiler"));
        assert!(cache.is_empty());
        assert_eq!(*cache.get_or_load(&image, |i| Ok::<_, ()>(i.code()[0])).unwrap(), 7);
        drop(image);
        for n in 0..40u8 {
            let other = CodeImage::new(ImageKind::SpirV, "main", vec![n]);
            cache.get_or_load(&other, |i| Ok::<_, ()>(i.code()[0])).unwrap();
        }
        assert!(cache.len() < 16, "dropped images are swept, {} left", cache.len());
    }
}
