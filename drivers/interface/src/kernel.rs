//! Kernels: a signature (what a launch binds) plus the images drivers run.
//!
//! The signature follows the memory attribution of the GPU functions design: global
//! buffer arguments with their access modes, a block of scalar arguments, and the
//! work-group (local) and per-work-item (private) memory the kernel needs. The
//! scheduler reads only the signature; which image runs is the driver's business.
//!
//! A [`Kernel`] is generic over its native image so that a kernel whose native
//! image is a value of the host program (a closure kernel, `gantry_host`'s
//! `ClosureKernel`) is one allocation: `Arc<Kernel<ClosureKernel>>` coerces to
//! [`KernelRef`], whose native image is `dyn Any`, and a driver that knows the type
//! gets it back with [`Kernel::native`].

use std::any::Any;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::image::{CodeImage, ImageKind};
use crate::memory::AccessMode;

/// A kernel as the scheduler and drivers hold it.
pub type KernelRef = Arc<Kernel>;

/// The bytes of a launch's scalar arguments, laid out by
/// [`Signature::scalar_offset`] (inline up to 16 bytes).
pub type ScalarBlock = SmallVec<[u8; 16]>;

/// One scalar argument: its size and alignment in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScalarSlot {
    /// Bytes.
    pub size: u32,
    /// Alignment (a power of two).
    pub align: u32,
}

/// What a launch of a kernel binds: global buffers (one per accessor slot, in order),
/// scalars (addressable by index, so an update can change them as it changes
/// buffers), and scratch memory.
///
/// ```
/// use gantry_driver::{AccessMode, Signature};
/// let s = Signature::new().global(AccessMode::Read).global(AccessMode::ReadWrite).scalar::<u8>().scalar::<f32>();
/// assert_eq!((s.scalar_offset(0), s.scalar_offset(1)), (0, 4), "each scalar at its alignment");
/// assert_eq!(s.scalar_bytes(), 8);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Signature {
    /// Access mode of each global buffer argument.
    pub globals: SmallVec<[AccessMode; 4]>,
    /// The scalar arguments, in order.
    pub scalars: SmallVec<[ScalarSlot; 2]>,
    /// Local (per work-group) and private (per work-item) memory, in order.
    pub memory: SmallVec<[Scratch; 1]>,
}

impl Signature {
    /// No arguments.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a global buffer argument used in `mode`.
    pub fn global(mut self, mode: AccessMode) -> Self {
        self.globals.push(mode);
        self
    }
    /// Adds a scalar argument of type `T`.
    pub fn scalar<T: bytemuck::Pod>(mut self) -> Self {
        let (size, align) = (std::mem::size_of::<T>(), std::mem::align_of::<T>());
        self.scalars.push(ScalarSlot { size: size as u32, align: align as u32 });
        self
    }
    /// Adds `bytes` of local memory per work-group.
    pub fn local(mut self, bytes: usize) -> Self {
        self.memory.push(Scratch::new(ScratchKind::Local, bytes));
        self
    }
    /// Adds `bytes` of private memory per work-item.
    pub fn private(mut self, bytes: usize) -> Self {
        self.memory.push(Scratch::new(ScratchKind::Private, bytes));
        self
    }
    /// Byte offset of scalar `index` in the scalar block (the end of the block for
    /// `index == scalars.len()`).
    pub fn scalar_offset(&self, index: usize) -> usize {
        let mut offset = 0usize;
        for (i, s) in self.scalars.iter().enumerate() {
            offset = offset.next_multiple_of(s.align.max(1) as usize);
            if i == index {
                return offset;
            }
            offset += s.size as usize;
        }
        offset
    }
    /// Bytes of the scalar block.
    pub fn scalar_bytes(&self) -> usize {
        self.scalar_offset(self.scalars.len())
    }
    /// Total bytes of scratch of `kind` (saturating).
    pub fn memory_bytes(&self, kind: ScratchKind) -> usize {
        self.memory.iter().filter(|s| s.kind == kind).fold(0usize, |a, s| a.saturating_add(s.bytes))
    }
}

/// The virtual cost of one work-item on a simulated device: `ns` plus `default_items`
/// times the device's default per-item cost. A kernel that declares its cost has
/// `default_items == 0`; one that does not has `ns == 0, default_items == 1`; a fused
/// kernel sums its parts, weighted by their share of the fused grid.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ItemCost {
    /// Declared nanoseconds per work-item.
    pub ns: f64,
    /// How many work-items' worth of the device default to add.
    pub default_items: f64,
}

impl ItemCost {
    /// `Some(ns)`: that cost; `None`: the device's default.
    pub fn of(ns: Option<f64>) -> Self {
        match ns {
            Some(ns) => Self { ns, default_items: 0.0 },
            None => Self { ns: 0.0, default_items: 1.0 },
        }
    }
    /// The cost per work-item on a device whose default is `default_ns`.
    pub fn resolve(&self, default_ns: f64) -> f64 {
        self.ns + self.default_items * default_ns
    }
}

impl Default for ItemCost {
    fn default() -> Self {
        Self::of(None)
    }
}

/// Which kind of scratch memory a slot is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScratchKind {
    /// Shared by the work-items of a group (address space 3).
    Local,
    /// Owned by one work-item, kept across phases (address space 5).
    Private,
}

/// A scratch slot: `bytes` per work-group (local) or per work-item (private).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Scratch {
    /// Local or private.
    pub kind: ScratchKind,
    /// Bytes per group (local) or per work-item (private).
    pub bytes: usize,
    /// Whether the region is cleared for every group, so that what a kernel reads
    /// before writing does not depend on which groups ran on the thread before. Only
    /// a region the kernel provably writes whole before reading skips it.
    pub zeroed: bool,
}

impl Scratch {
    /// A region cleared for every group.
    pub fn new(kind: ScratchKind, bytes: usize) -> Self {
        Self { kind, bytes, zeroed: true }
    }

    /// Bytes of the slot's region for one work-group of `local_size` work-items.
    pub fn group_bytes(&self, local_size: usize) -> usize {
        match self.kind {
            ScratchKind::Local => self.bytes,
            ScratchKind::Private => self.bytes * local_size,
        }
    }
}

/// A kernel: its name, signature and images. `N` is the native image (a value of the
/// host program that drivers knowing its type run), `()` when there is none; code
/// images (IR, PTX, SPIR-V, WGSL, ...) are in [`Kernel::code`]. Share it as a
/// [`KernelRef`].
///
/// ```
/// use gantry_driver::{AccessMode, CodeImage, ImageKind, Kernel, KernelRef, Signature};
/// let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<f32>();
/// let k: KernelRef =
///     Kernel::new("scale", sig).with_image(CodeImage::new(ImageKind::Wgsl, "main", b"...".to_vec())).into_ref();
/// assert_eq!(k.kinds().collect::<Vec<_>>(), [ImageKind::Wgsl]);
/// assert!(k.image(ImageKind::Ptx).is_none());
/// assert!(k.native::<u32>().is_none());
/// ```
pub struct Kernel<N: ?Sized = dyn Any + Send + Sync> {
    /// Name used in errors, traces and profiles.
    pub name: Arc<str>,
    /// What a launch binds.
    pub signature: Signature,
    /// Code images.
    pub code: SmallVec<[CodeImage; 1]>,
    /// Virtual cost of one work-item on simulated devices.
    pub cost: ItemCost,
    /// The native image's kind; `None` when there is no native image.
    native_kind: Option<ImageKind>,
    /// The native image (last: it is the unsized part of a [`KernelRef`]).
    native: N,
}

impl Kernel<()> {
    /// A kernel with no image yet: add code images with [`Kernel::with_image`].
    pub fn new(name: impl Into<Arc<str>>, signature: Signature) -> Self {
        Self::with_native(name, signature, None, ())
    }
}

impl<N> Kernel<N> {
    /// A kernel whose native image, of `kind` (`None`: no native image), is `native`.
    pub fn with_native(
        name: impl Into<Arc<str>>,
        signature: Signature,
        kind: Option<ImageKind>,
        native: N,
    ) -> Self {
        Self {
            name: name.into(),
            signature,
            code: SmallVec::new(),
            cost: ItemCost::default(),
            native_kind: kind,
            native,
        }
    }
}

impl<N: ?Sized> Kernel<N> {
    /// The same kernel with one more code image.
    pub fn with_image(mut self, image: CodeImage) -> Self
    where
        N: Sized,
    {
        self.code.push(image);
        self
    }
    /// Shares it as a [`KernelRef`].
    pub fn into_ref(self) -> KernelRef
    where
        N: Any + Send + Sync + Sized,
    {
        Arc::new(self)
    }
    /// The same kernel with a declared virtual cost per work-item.
    pub fn with_cost(mut self, cost: ItemCost) -> Self
    where
        N: Sized,
    {
        self.cost = cost;
        self
    }
    /// The kinds of its images: the native one first.
    pub fn kinds(&self) -> impl Iterator<Item = ImageKind> + '_ {
        self.native_kind.into_iter().chain(self.code.iter().map(|c| c.kind()))
    }
    /// Whether it has an image of one of `kinds`.
    pub fn runs_on(&self, kinds: &[ImageKind]) -> bool {
        self.kinds().any(|k| kinds.contains(&k))
    }
    /// Its code image of `kind`, if any.
    pub fn image(&self, kind: ImageKind) -> Option<&CodeImage> {
        self.code.iter().find(|c| c.kind() == kind)
    }
    /// Its native image's kind.
    pub fn native_kind(&self) -> Option<ImageKind> {
        self.native_kind
    }
}

impl Kernel {
    /// Its native image, if it is a `T`.
    #[inline]
    pub fn native<T: Any>(&self) -> Option<&T> {
        self.native.downcast_ref()
    }
}

impl<N: ?Sized> std::fmt::Debug for Kernel<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel")
            .field("name", &self.name)
            .field("signature", &self.signature)
            .field("native", &self.native_kind)
            .field("code", &self.code)
            .finish()
    }
}

/// A launch's scalar block, filled one scalar at a time against its kernel's
/// signature.
///
/// ```
/// use gantry_driver::{ScalarArgs, Signature};
/// let sig = Signature::new().scalar::<u16>().scalar::<f64>();
/// let mut args = ScalarArgs::new(&sig);
/// assert!(args.set(&sig, 1, 2.5f64).is_ok());
/// assert_eq!(args.unset(&sig), Some(0));
/// assert!(args.set(&sig, 0, 1u32).is_err(), "scalar 0 is 2 bytes");
/// args.set(&sig, 0, 7u16).unwrap();
/// assert_eq!(args.unset(&sig), None);
/// assert_eq!(args.into_block().len(), 16);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ScalarArgs {
    block: ScalarBlock,
    set: u64,
}

/// A scalar that does not fit its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("scalar {index}: {got} bytes given, the signature has {expected:?}")]
pub struct ScalarMismatch {
    /// Which scalar.
    pub index: usize,
    /// Its size in the signature (`None`: the signature has no such scalar).
    pub expected: Option<u32>,
    /// The size given.
    pub got: usize,
}

impl ScalarArgs {
    /// A zeroed block for `signature`, with no scalar set.
    pub fn new(signature: &Signature) -> Self {
        Self { block: SmallVec::from_elem(0, signature.scalar_bytes()), set: 0 }
    }
    /// Sets scalar `index` of `signature` (the one the block was made for) to
    /// `value`, whose size must be the slot's.
    pub fn set<T: bytemuck::Pod>(
        &mut self,
        signature: &Signature,
        index: usize,
        value: T,
    ) -> Result<(), ScalarMismatch> {
        let bytes = bytemuck::bytes_of(&value);
        let slot = signature.scalars.get(index);
        let at = signature.scalar_offset(index);
        let fits =
            slot.is_some_and(|s| s.size as usize == bytes.len()) && at + bytes.len() <= self.block.len();
        if !fits {
            return Err(ScalarMismatch { index, expected: slot.map(|s| s.size), got: bytes.len() });
        }
        self.block[at..at + bytes.len()].copy_from_slice(bytes);
        if index < 64 {
            self.set |= 1 << index;
        }
        Ok(())
    }
    /// The first scalar of `signature` not set yet, if any (scalars past the 64th
    /// count as set).
    pub fn unset(&self, signature: &Signature) -> Option<usize> {
        (0..signature.scalars.len().min(64)).find(|i| self.set & (1 << i) == 0)
    }
    /// The block.
    pub fn into_block(self) -> ScalarBlock {
        self.block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A native image comes back as its own type through the erased reference, and
    /// not as another type.
    #[test]
    fn native_image_survives_erasure() {
        let k: KernelRef = Arc::new(Kernel::with_native(
            "k",
            Signature::new().global(AccessMode::Read),
            Some(ImageKind::Other("test")),
            vec![1u32, 2, 3],
        ));
        assert_eq!(k.native::<Vec<u32>>(), Some(&vec![1, 2, 3]));
        assert!(k.native::<Vec<u8>>().is_none());
        assert!(k.runs_on(&[ImageKind::Closure, ImageKind::Other("test")]));
        assert!(!k.runs_on(&[ImageKind::Closure]));
        let bare: KernelRef = Arc::new(Kernel::new("bare", Signature::new()));
        assert_eq!(bare.kinds().count(), 0);
    }
}
