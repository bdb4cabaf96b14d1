//! Kernel images: PTX loaded as a module (`cuModuleLoadDataEx`, which JIT-compiles it
//! for the device), CUDA C compiled by NVRTC to PTX first, and (feature `jit`) LLVM
//! IR compiled to PTX by `gantry-jit`. Each image is loaded once per driver, through
//! [`ImageCache`], into a module and its entry function.
//!
//! PTX from LLVM IR follows `gantry-jit`'s convention (its `ptx` module): after the
//! pointers and scalars come hidden parameters (the global size in OpenCL order and
//! the work dimension), which the launch appends ([`Hidden`]), and its local slots are
//! laid out in dynamic shared memory by `gantry_jit::ptx::shared_bytes`.

use std::ffi::{c_uint, c_void, CString};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUfunction, CUfunction_attribute, CUjit_option, CUmodule};
use gantry_driver::{no_image, CodeImage, ExecError, ImageCache, ImageKind, Kernel};

use crate::context::Context;
use crate::error::{check, CallError};
use crate::nvrtc::Nvrtc;

/// A loaded image: its module and entry function.
pub(crate) struct Loaded {
    module: CUmodule,
    pub(crate) function: CUfunction,
    /// The dynamic shared memory the function has been allowed past the default
    /// 48 KiB (`cuFuncSetAttribute`), so the attribute is set once per size.
    shared_allowed: AtomicUsize,
    /// The signature an LLVM IR image was compiled for (its PTX takes the hidden
    /// parameters); `None` for PTX and CUDA C images.
    jit: Option<gantry_driver::Signature>,
    ctx: Arc<Context>,
}

/// The hidden parameters of PTX compiled from LLVM IR: the global size in OpenCL
/// order (dimension 0 = the fastest, CUDA's `x`) and the work dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hidden {
    pub(crate) global: [u64; 3],
    pub(crate) work_dim: u32,
}

impl Hidden {
    /// The hidden parameters of a launch over `geometry`.
    pub(crate) fn of(geometry: &gantry_driver::Geometry) -> Self {
        let (d, global) = (geometry.dims(), geometry.global_range());
        let mut out = [1u64; 3];
        for (i, o) in out.iter_mut().enumerate().take(d) {
            *o = global[d - 1 - i] as u64;
        }
        Self { global: out, work_dim: d as u32 }
    }
}

// SAFETY: module and function handles are accepted by the driver API from any thread.
unsafe impl Send for Loaded {}
// SAFETY: see above; the one mutable field is atomic.
unsafe impl Sync for Loaded {}

/// Dynamic shared memory any kernel may use without opting in.
const DEFAULT_SHARED: usize = 48 << 10;

impl Loaded {
    /// Bytes of dynamic shared memory a launch with `signature` reserves.
    pub(crate) fn shared_bytes(&self, signature: &gantry_driver::Signature) -> usize {
        #[cfg(feature = "jit")]
        if self.jit.is_some() {
            return gantry_jit::ptx::shared_bytes(signature);
        }
        signature.memory_bytes(gantry_driver::ScratchKind::Local)
    }

    /// The hidden parameters a launch over `geometry` appends, for PTX from LLVM IR.
    pub(crate) fn hidden(&self, geometry: &gantry_driver::Geometry) -> Option<Hidden> {
        self.jit.as_ref().map(|_| Hidden::of(geometry))
    }

    /// Lets the function use `bytes` of dynamic shared memory.
    pub(crate) fn allow_shared(&self, bytes: usize) -> Result<(), CallError> {
        if bytes <= DEFAULT_SHARED || bytes <= self.shared_allowed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        let value = i32::try_from(bytes).unwrap_or(i32::MAX);
        // SAFETY: a live function of the current context.
        check("cuFuncSetAttribute", unsafe { sys::cuFuncSetAttribute(self.function, attr, value) })?;
        self.shared_allowed.fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: loaded in `load_ptx`, unloaded once; operations that launched the
        // function keep this value until they complete.
        unsafe {
            let _ = self.ctx.bind();
            let _ = sys::cuModuleUnload(self.module);
        }
    }
}

/// The driver's loaded images and the compiler for CUDA C.
pub(crate) struct Images {
    cache: ImageCache<Loaded>,
    /// Compiles LLVM IR images to PTX for the device's architecture.
    #[cfg(feature = "jit")]
    ptx: gantry_jit::PtxCompiler,
    nvrtc: Option<Nvrtc>,
    /// Why there is no NVRTC, for the error of a CUDA C launch.
    nvrtc_missing: String,
    /// The virtual architecture CUDA C compiles for.
    arch: i32,
    ctx: Arc<Context>,
    device: Arc<str>,
}

impl Images {
    pub(crate) fn new(ctx: &Arc<Context>, device: Arc<str>, cc: (i32, i32)) -> Self {
        let (nvrtc, nvrtc_missing) = match Nvrtc::load() {
            Ok(n) => (Some(n), String::new()),
            Err(why) => (None, why),
        };
        let arch = nvrtc.as_ref().map_or(cc.0 * 10 + cc.1, |n| n.arch_for(cc));
        Self {
            cache: ImageCache::default(),
            #[cfg(feature = "jit")]
            ptx: gantry_jit::PtxCompiler::for_target(&format!("sm_{}{}", cc.0, cc.1), "+ptx80"),
            nvrtc,
            nvrtc_missing,
            arch,
            ctx: ctx.clone(),
            device,
        }
    }

    /// Whether CUDA C images can be compiled.
    pub(crate) fn has_nvrtc(&self) -> bool {
        self.nvrtc.is_some()
    }

    /// The loaded form of `kernel`'s PTX image, else of its CUDA C image, else (feature
    /// `jit`) of its LLVM IR image.
    pub(crate) fn load(&self, kernel: &Kernel) -> Result<Arc<Loaded>, ExecError> {
        if let Some(image) = kernel.image(ImageKind::Ptx) {
            return self.cache.get_or_load(image, |i| {
                let mut ptx = i.code().to_vec();
                ptx.push(0);
                self.load_ptx(&ptx, i, &kernel.name, None)
            });
        }
        #[cfg(feature = "jit")]
        if let (None, Some(image)) = (kernel.image(ImageKind::CudaC), kernel.image(ImageKind::LlvmIr)) {
            return self.load_llvm_ir(kernel, image);
        }
        let Some(image) = kernel.image(ImageKind::CudaC) else {
            return Err(no_image(&self.device, &kernel.name));
        };
        self.cache.get_or_load(image, |i| {
            let Some(nvrtc) = &self.nvrtc else {
                return Err(ExecError::Unsupported {
                    device: self.device.clone(),
                    what: "CUDA C images (NVRTC could not be loaded)",
                });
            };
            let ptx = nvrtc.compile(i.code(), &format!("{}.cu", kernel.name), self.arch).map_err(|e| {
                ExecError::Backend {
                    device: self.device.clone(),
                    call: e.call,
                    status: gantry_driver::BackendStatus { code: e.code as i64, name: e.name.clone().into() },
                    message: format!(
                        "compiling the CUDA C image of kernel `{}` for compute_{}: {}",
                        kernel.name, self.arch, e.log
                    ),
                }
            })?;
            self.load_ptx(&ptx, i, &kernel.name, None)
        })
    }

    /// An LLVM IR image compiled to PTX for `kernel`'s signature. The PTX depends on
    /// the signature (its local slots' offsets): an image loaded for one signature is
    /// refused for another rather than run with the wrong layout.
    #[cfg(feature = "jit")]
    fn load_llvm_ir(&self, kernel: &Kernel, image: &CodeImage) -> Result<Arc<Loaded>, ExecError> {
        let loaded = self.cache.get_or_load(image, |i| {
            let compiled = self.ptx.compile(i, &kernel.signature).map_err(|e| ExecError::Driver {
                device: self.device.clone(),
                message: format!("compiling the LLVM IR image of kernel `{}` to PTX: {e}", kernel.name),
            })?;
            let mut ptx = compiled.ptx.as_bytes().to_vec();
            ptx.push(0);
            self.load_ptx(&ptx, i, &kernel.name, Some(kernel.signature.clone()))
        })?;
        if loaded.jit.as_ref() != Some(&kernel.signature) {
            return Err(ExecError::Driver {
                device: self.device.clone(),
                message: format!(
                    "kernel `{}`: its LLVM IR image was compiled for another signature; give each signature                      its own image",
                    kernel.name
                ),
            });
        }
        Ok(loaded)
    }

    /// How many images are loaded.
    pub(crate) fn loaded(&self) -> usize {
        self.cache.len()
    }

    /// Why CUDA C images cannot be compiled ("" where they can).
    pub(crate) fn nvrtc_missing(&self) -> &str {
        &self.nvrtc_missing
    }

    /// Loads NUL-terminated PTX and finds `image`'s entry point in it.
    fn load_ptx(
        &self,
        ptx: &[u8],
        image: &CodeImage,
        kernel: &str,
        jit: Option<gantry_driver::Signature>,
    ) -> Result<Loaded, ExecError> {
        let fail = |e: CallError, what: String| e.into_exec(&self.device, what);
        self.ctx.bind().map_err(|e| fail(e, format!("loading kernel `{kernel}`")))?;
        let mut log = vec![0u8; 16 << 10];
        let mut options =
            [CUjit_option::CU_JIT_ERROR_LOG_BUFFER, CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
        let mut module: CUmodule = ptr::null_mut();
        // SAFETY: NUL-terminated PTX; the option arrays and the log buffer outlive the
        // call (the size option is passed by value in the pointer, as CUDA documents).
        let loaded = check("cuModuleLoadDataEx", unsafe {
            sys::cuModuleLoadDataEx(
                &mut module,
                ptx.as_ptr().cast(),
                options.len() as c_uint,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
            )
        });
        if let Err(e) = loaded {
            let text = log.split(|&b| b == 0).next().unwrap_or_default();
            let text = String::from_utf8_lossy(text);
            return Err(fail(e, format!("loading the PTX of kernel `{kernel}`: {}", text.trim_end())));
        }
        let unload = |module: CUmodule| {
            // SAFETY: loaded above and not handed out.
            unsafe {
                let _ = sys::cuModuleUnload(module);
            }
        };
        let Ok(entry) = CString::new(image.entry()) else {
            unload(module);
            return Err(ExecError::Driver {
                device: self.device.clone(),
                message: format!("kernel `{kernel}`: its entry point name contains a NUL byte"),
            });
        };
        let mut function: CUfunction = ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        let found = check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut function, module, entry.as_ptr())
        });
        if let Err(e) = found {
            unload(module);
            return Err(fail(
                e,
                format!(
                    "kernel `{kernel}`: no entry point `{}` in its image (a CUDA C kernel must be \
                     `extern \"C\" __global__`)",
                    image.entry()
                ),
            ));
        }
        Ok(Loaded {
            module,
            function,
            shared_allowed: AtomicUsize::new(DEFAULT_SHARED),
            jit,
            ctx: self.ctx.clone(),
        })
    }
}
