//! Kernel launches: a launch's geometry as a CUDA grid and block, its arguments as
//! kernel parameters, its local memory as dynamic shared memory.
//!
//! The conventions a kernel image follows (also in the crate docs):
//!
//! * **Parameters**: one device pointer per global argument, in slot order, pointing
//!   at the first byte of the argument's range; then each scalar of the signature, in
//!   order, by value (the launch's scalar block, laid out by
//!   [`Signature::scalar_offset`](gantry_driver::Signature::scalar_offset)).
//! * **Dimensions**: the fastest-varying dimension (the last) is CUDA's `x`; a 2-D
//!   range `[rows, cols]` is `y = rows, x = cols`; 3-D `[a, b, c]` is `z, y, x`.
//! * **ND-ranges**: block = the local range, grid = the group counts.
//! * **Plain ranges**: blocks of up to [`PLAIN_BLOCK`] work-items along `x`, and as
//!   many blocks as cover the range, rounded up: the last block may run past the
//!   range's end, so a kernel launched over a plain range checks its index against
//!   the range's size (a scalar it is given). `y` and `z` are exact.
//! * **Local memory**: the signature's local memory is the block's dynamic shared
//!   memory (`extern __shared__`), uninitialized.
//! * A global offset is refused.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUdeviceptr};
use gantry_driver::{Geometry, Signature};

use crate::error::{check, CallError};
use crate::execution::Stream;
use crate::module::{Hidden, Loaded};

/// Work-items per block along `x` for a plain range.
pub const PLAIN_BLOCK: usize = 256;

/// A launch's grid and block, `x` first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// The grid and block of `geometry` (see the module docs), or why it cannot run.
pub(crate) fn dims(geometry: &Geometry) -> Result<Dims, String> {
    if geometry.offset() != [0; 3] {
        return Err(format!("a global offset ({:?}) is not supported by CUDA kernels", geometry.offset()));
    }
    let d = geometry.dims();
    let (global, local) = (geometry.global_range(), geometry.local_range());
    let mut grid = [1u32; 3];
    let mut block = [1u32; 3];
    let fit =
        |v: usize, what: &str| u32::try_from(v).map_err(|_| format!("{what} {v} exceeds CUDA's limits"));
    for (axis, dim) in (0..d).rev().enumerate() {
        let (g, l) = if geometry.is_nd() {
            (geometry.groups(dim), local[dim])
        } else if axis == 0 {
            let l = global[dim].min(PLAIN_BLOCK);
            (global[dim].div_ceil(l), l)
        } else {
            (global[dim], 1)
        };
        grid[axis] = fit(g, "a group count of")?;
        block[axis] = fit(l, "a work-group extent of")?;
    }
    Ok(Dims { grid, block })
}

/// Kernel parameters: each device pointer, then the scalar block, in storage that
/// stays put while `cuLaunchKernel` reads it.
pub(crate) struct Params {
    pointers: Vec<CUdeviceptr>,
    /// The scalar block, copied to 16-byte aligned storage.
    scalars: Vec<u128>,
    offsets: Vec<usize>,
    /// Hidden parameters after the scalars (PTX compiled from LLVM IR).
    hidden: Option<Hidden>,
}

impl Params {
    /// The parameters of a launch of a kernel with `signature` over `pointers` with
    /// the scalar block `block`.
    pub(crate) fn new(
        signature: &Signature,
        pointers: Vec<CUdeviceptr>,
        block: &[u8],
        hidden: Option<Hidden>,
    ) -> Result<Self, String> {
        let expected = signature.scalar_bytes();
        if block.len() != expected {
            return Err(format!("a scalar block of {} bytes, its signature has {expected}", block.len()));
        }
        let mut scalars = vec![0u128; expected.div_ceil(16)];
        // SAFETY: the storage holds at least `expected` bytes; u8 has no alignment.
        unsafe { std::ptr::copy_nonoverlapping(block.as_ptr(), scalars.as_mut_ptr().cast::<u8>(), expected) };
        let offsets = (0..signature.scalars.len()).map(|i| signature.scalar_offset(i)).collect();
        Ok(Self { pointers, scalars, offsets, hidden })
    }

    /// The array of argument addresses `cuLaunchKernel` takes (valid while `self`
    /// lives and is not moved).
    pub(crate) fn addresses(&mut self) -> Vec<*mut c_void> {
        let base = self.scalars.as_mut_ptr().cast::<u8>();
        let mut out: Vec<*mut c_void> =
            self.pointers.iter_mut().map(|p| (p as *mut CUdeviceptr).cast()).collect();
        // SAFETY: each offset lies inside the block (the signature laid it out).
        out.extend(self.offsets.iter().map(|&o| unsafe { base.add(o) }.cast::<c_void>()));
        if let Some(h) = &mut self.hidden {
            out.extend(h.global.iter_mut().map(|g| (g as *mut u64).cast::<c_void>()));
            out.push((&mut h.work_dim as *mut u32).cast());
        }
        out
    }
}

/// Enqueues `function` on `stream`.
pub(crate) fn launch(
    stream: &Stream,
    loaded: &Loaded,
    dims: Dims,
    signature: &Signature,
    mut params: Params,
) -> Result<(), CallError> {
    let shared = loaded.shared_bytes(signature);
    loaded.allow_shared(shared)?;
    let shared = u32::try_from(shared).unwrap_or(u32::MAX);
    let mut args = params.addresses();
    let (g, b) = (dims.grid, dims.block);
    // SAFETY: a live function and stream of the current context; `args` holds one
    // address per parameter, each valid for the duration of the call (CUDA copies
    // the values before it returns).
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            loaded.function,
            g[0],
            g[1],
            g[2],
            b[0],
            b[1],
            b[2],
            shared,
            stream.raw,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::{AccessMode, NdRange, Range};

    #[test]
    fn nd_ranges_map_the_fastest_dimension_to_x() {
        let g = NdRange::new([8, 6], [2, 3]).geometry().unwrap();
        assert_eq!(dims(&g).unwrap(), Dims { grid: [2, 4, 1], block: [3, 2, 1] });
        let g = NdRange::new([4, 6, 8], [2, 3, 4]).geometry().unwrap();
        assert_eq!(dims(&g).unwrap(), Dims { grid: [2, 2, 2], block: [4, 3, 2] });
        let g = NdRange::new(1024, 64).geometry().unwrap();
        assert_eq!(dims(&g).unwrap(), Dims { grid: [16, 1, 1], block: [64, 1, 1] });
    }

    #[test]
    fn plain_ranges_round_x_up_to_whole_blocks() {
        let g = Geometry::for_range(Range::d1(1000)).unwrap();
        assert_eq!(dims(&g).unwrap(), Dims { grid: [4, 1, 1], block: [256, 1, 1] });
        let g = Geometry::for_range(Range::d2(3, 10)).unwrap();
        assert_eq!(dims(&g).unwrap(), Dims { grid: [1, 3, 1], block: [10, 1, 1] });
        let g = Geometry::for_range(Range::d3(2, 5, 300)).unwrap();
        assert_eq!(dims(&g).unwrap(), Dims { grid: [2, 5, 2], block: [256, 1, 1] });
        let g = Geometry::for_range_with_offset(Range::d1(10), [1, 0, 0]).unwrap();
        assert!(dims(&g).unwrap_err().contains("offset"));
    }

    /// Pointers come first, then each scalar at its offset in aligned storage.
    #[test]
    fn parameters_are_pointers_then_scalars() {
        let sig = Signature::new().global(AccessMode::Read).scalar::<u8>().scalar::<f64>();
        let mut block = vec![0u8; sig.scalar_bytes()];
        block[0] = 7;
        block[8..16].copy_from_slice(&2.5f64.to_ne_bytes());
        let mut p = Params::new(&sig, vec![0xABCD], &block, None).unwrap();
        let a = p.addresses();
        assert_eq!(a.len(), 3);
        // SAFETY: the addresses point into `p`, alive here.
        unsafe {
            assert_eq!(*a[0].cast::<u64>(), 0xABCD);
            assert_eq!(*a[1].cast::<u8>(), 7);
            assert_eq!(*a[2].cast::<f64>(), 2.5);
            assert_eq!(a[2] as usize % 8, 0, "an f64 at its alignment");
        }
        assert!(Params::new(&sig, vec![0], &block[..8], None).is_err(), "a block of the wrong size");
        let hidden = Hidden { global: [10, 4, 1], work_dim: 2 };
        let mut p = Params::new(&sig, vec![1], &block, Some(hidden)).unwrap();
        let a = p.addresses();
        assert_eq!(a.len(), 3 + 4, "then the global size in OpenCL order and the work dimension");
        // SAFETY: as above.
        unsafe {
            assert_eq!([*a[3].cast::<u64>(), *a[4].cast::<u64>(), *a[5].cast::<u64>()], [10, 4, 1]);
            assert_eq!(*a[6].cast::<u32>(), 2);
        }
    }
}
