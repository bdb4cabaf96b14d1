//! The device's primary context: retained while the driver, or anything it handed
//! out (an operation handle holding an event, a loaded module), lives, and made
//! current on each thread before that thread calls CUDA.

use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUcontext, CUdevice};

use crate::error::{check, CallError};

/// A retained primary context. The process shares it with any other CUDA user of
/// the device (the runtime API does the same), which is what libraries linked into
/// one program expect.
pub(crate) struct Context {
    dev: CUdevice,
    ctx: CUcontext,
}

// SAFETY: a CUcontext is a handle the driver API accepts from any thread; this type
// only makes it current and releases it.
unsafe impl Send for Context {}
// SAFETY: see above.
unsafe impl Sync for Context {}

impl Context {
    /// Retains `dev`'s primary context and makes it current on this thread.
    pub(crate) fn retain(dev: CUdevice) -> Result<Arc<Self>, CallError> {
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: an initialized driver, a valid device and out-pointer.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        let this = Arc::new(Self { dev, ctx });
        this.bind()?;
        Ok(this)
    }

    /// The raw handle (for calls that name a context).
    pub(crate) fn raw(&self) -> CUcontext {
        self.ctx
    }

    /// Makes it the calling thread's current context (a no-op where it already is).
    pub(crate) fn bind(&self) -> Result<(), CallError> {
        let mut current: CUcontext = ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut current) })?;
        if current != self.ctx {
            // SAFETY: a context this value retains.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        }
        Ok(())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: retained in `retain`, released once. A failure here has no one
        // to report to: the context goes either way.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}
