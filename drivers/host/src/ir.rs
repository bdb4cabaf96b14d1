//! LLVM IR kernels on the host (feature `jit`): a kernel's
//! [`ImageKind::LlvmIr`](gantry_driver::ImageKind::LlvmIr) image compiled once by
//! `gantry-jit` into a native work-group function, whose groups a driver spreads
//! like a closure kernel's ([`Groups::run_ranges`]).
//!
//! Each range of groups runs with its own local memory: one region per local slot
//! of the signature, allocated once per range and reused by its groups (the compiled
//! function clears the slots that are `zeroed` for every group). A kernel's private
//! memory is its own stack.
//!
//! Native code is not checked as closure kernels are: a kernel that indexes past its
//! buffers reads or writes other memory, as it would on a GPU. Its launches are
//! checked against its signature before it runs, and a kernel that does not compile
//! fails its command with the reason.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use gantry_driver::{Binding, CodeImage, ExecError, Geometry, ImageCache, ScratchKind, Signature};
use gantry_jit::{HostCompiler, HostKernel, HostLaunch};
use smallvec::SmallVec;

use crate::runner::{Groups, KernelCall};

/// A runner's compiler of IR kernels, made on first use (most runtimes run none),
/// and the kernels it compiled by image identity: a launch looks its image up as
/// drivers look up any image (`ImageCache`) instead of hashing the IR's bytes for
/// the compiler's own cache, which stays for a clone-less image of equal bytes.
#[derive(Debug, Default)]
pub(crate) struct IrKernels {
    compiler: OnceLock<HostCompiler>,
    /// Each image's compiled kernel and the signature it was compiled for.
    loaded: ImageCache<(Signature, Arc<HostKernel>)>,
}

/// Pointers a launch hands every thread that runs its groups.
struct Shared<'a> {
    globals: SmallVec<[*mut u8; 8]>,
    scalars: &'a [u8],
    local_bytes: SmallVec<[usize; 2]>,
    geometry: &'a Geometry,
    kernel: &'a HostKernel,
}

// SAFETY: the pointers are the launch's bindings, which the caller of `launch`
// guarantees live and exclusive for the call; the groups the threads run touch
// them as the kernel's own work-items would on a GPU.
unsafe impl Sync for Shared<'_> {}

impl Shared<'_> {
    /// Runs `groups` with local memory of their own.
    fn run(&self, groups: Range<usize>) {
        // 16-byte aligned regions, as OpenCL's largest scalar types need.
        let mut regions: SmallVec<[Vec<u128>; 2]> =
            self.local_bytes.iter().map(|&b| vec![0u128; b.div_ceil(16).max(1)]).collect();
        let locals: SmallVec<[*mut u8; 2]> = regions.iter_mut().map(|r| r.as_mut_ptr().cast()).collect();
        let launch = HostLaunch::from_geometry(self.geometry, &self.globals, self.scalars, &locals);
        // SAFETY: the globals are live and exclusive (see `Shared`); each local
        // pointer is this range's own region of the slot's size; `launch` was checked
        // against the kernel before any range ran.
        let _ = unsafe { self.kernel.run_groups(&launch, groups.start, groups.len()) };
    }
}

impl IrKernels {
    /// Runs `call`'s kernel from its LLVM IR `image` with `bindings` (one per global
    /// slot), compiling it on its first launch.
    ///
    /// # Safety
    /// The bindings must be live for the whole call and touched by nothing else
    /// meanwhile; the kernel must stay inside them.
    pub(crate) unsafe fn launch(
        &self,
        device: &Arc<str>,
        call: KernelCall<'_>,
        image: &CodeImage,
        bindings: &[Binding],
        groups: &mut impl Groups,
    ) -> Result<(), ExecError> {
        let KernelCall { kernel, geometry, scalars } = call;
        let fail = |message: String| ExecError::Driver { device: device.clone(), message };
        let compiler = self.compiler.get_or_init(HostCompiler::new);
        let compile = |signature: &Signature| {
            compiler
                .compile(image, signature)
                .map_err(|e| fail(format!("compiling the LLVM IR image of kernel `{}`: {e}", kernel.name)))
        };
        let loaded = self
            .loaded
            .get_or_load(image, |_| Ok((kernel.signature.clone(), compile(&kernel.signature)?)))?;
        // One image launched with another signature (other local sizes) is another
        // compilation: the compiler's cache keys it by both.
        let compiled =
            if loaded.0 == kernel.signature { loaded.1.clone() } else { compile(&kernel.signature)? };
        let shared = Shared {
            globals: bindings.iter().map(|b| b.ptr).collect(),
            scalars,
            local_bytes: kernel
                .signature
                .memory
                .iter()
                .filter(|s| s.kind == ScratchKind::Local)
                .map(|s| s.bytes)
                .collect(),
            geometry,
            kernel: &compiled,
        };
        let locals: SmallVec<[*mut u8; 2]> =
            shared.local_bytes.iter().map(|_| std::ptr::null_mut()).collect();
        let probe = HostLaunch::from_geometry(geometry, &shared.globals, scalars, &locals);
        compiled.check(&probe).map_err(|e| fail(format!("kernel `{}`: {e}", kernel.name)))?;
        groups.run_ranges(probe.group_count(), &|range| shared.run(range));
        Ok(())
    }
}
