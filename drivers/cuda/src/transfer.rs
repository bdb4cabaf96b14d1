//! Copies and fills, enqueued on a lane's stream.
//!
//! * Device ↔ device: `cuMemcpyDtoDAsync`; ranges that overlap inside one
//!   allocation go through scratch device memory (CUDA's copies do not allow
//!   overlap), which the operation keeps until it completes.
//! * Host ↔ device: through the lane's pinned staging memory, a chunk at a time. The
//!   copy between the caller's host memory and the staging memory is a host function
//!   (`cuLaunchHostFunc`) in the stream, so it happens in stream order: after what the
//!   operation waits on (an earlier copy into the same host memory included), before
//!   what waits on it. Pageable memory given straight to `cuMemcpy*Async` would be
//!   read or written when CUDA chooses, possibly at the call.
//! * Host ↔ host: one host function.
//! * Fills: a pattern whose smallest period is 1, 2 or 4 bytes (and an address
//!   aligned to it) is one `cuMemsetD8/D16/D32Async`; any other pattern is written
//!   once with a few small memsets, then doubled by copies of the filled prefix
//!   (`⌈log2(len / width)⌉` of them).

use std::any::Any;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use gantry_driver::{fill_bytes, HostStorage};

use crate::context::Context;
use crate::error::{check, CallError};
use crate::execution::{Lane, Stream};
use crate::memory::{DeviceBox, Place};

/// Bytes of pinned staging memory per lane: host copies move this much per step.
pub(crate) const STAGING_BYTES: usize = 8 << 20;

/// A raw pointer a host function carries to its thread.
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);
// SAFETY: the memory behind it is kept alive by the same host function (it holds the
// storage) and touched only by it, in stream order.
unsafe impl Send for SendPtr {}

type HostJob = Box<dyn FnOnce() + Send>;

unsafe extern "C" fn run_host_job(data: *mut c_void) {
    // SAFETY: `data` is the box `enqueue_host` leaked for this call, run once.
    let job = unsafe { Box::from_raw(data.cast::<HostJob>()) };
    // A panic must not unwind into CUDA's thread; the jobs here do not panic.
    let _ = catch_unwind(AssertUnwindSafe(job));
}

/// Enqueues `job` to run on a host thread when `stream` reaches it; the stream waits
/// for it to return.
fn enqueue_host(stream: &Stream, job: impl FnOnce() + Send + 'static) -> Result<(), CallError> {
    let raw = Box::into_raw(Box::new(Box::new(job) as HostJob));
    // SAFETY: a live stream; CUDA calls `run_host_job` once with `raw`.
    let r = check("cuLaunchHostFunc", unsafe {
        sys::cuLaunchHostFunc(stream.raw, Some(run_host_job), raw.cast())
    });
    if r.is_err() {
        // SAFETY: not enqueued, so never run: reclaim it.
        drop(unsafe { Box::from_raw(raw) });
    }
    r
}

fn host_ptr(storage: &Arc<HostStorage>, offset: usize) -> SendPtr {
    // SAFETY: the offset was checked to lie inside the storage.
    SendPtr(unsafe { storage.as_ptr().add(offset) })
}

/// Enqueues a copy of `len` bytes from `src` to `dst` (both checked to hold them).
/// Returns what the operation must keep until it completes.
pub(crate) fn copy(
    ctx: &Arc<Context>,
    lane: &Lane,
    src: Place,
    dst: Place,
    len: usize,
) -> Result<Option<Box<dyn Any + Send + Sync>>, CallError> {
    let stream = &lane.stream;
    if len == 0 {
        return Ok(None);
    }
    match (src, dst) {
        (Place::Device { ptr: s, alloc: a }, Place::Device { ptr: d, alloc: b }) => {
            let overlap = a == b && s < d + len as u64 && d < s + len as u64;
            if s == d {
                Ok(None)
            } else if overlap {
                let scratch = DeviceBox::new(ctx, len)?;
                dtod(stream, s, scratch.ptr, len)?;
                dtod(stream, scratch.ptr, d, len)?;
                Ok(Some(Box::new(scratch)))
            } else {
                dtod(stream, s, d, len)?;
                Ok(None)
            }
        }
        (Place::Host(storage, at), Place::Device { ptr: d, .. }) => {
            let staging = lane.staging(ctx, STAGING_BYTES)?;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(staging.len());
                let (from, to) = (host_ptr(&storage, at + done), SendPtr(staging.as_ptr()));
                let (keep, pin) = (storage.clone(), staging.clone());
                enqueue_host(stream, move || {
                    let (from, to) = (from, to);
                    // SAFETY: both ranges hold `n` bytes (checked), kept alive by the
                    // captures; stream order makes this the only access.
                    unsafe { std::ptr::copy_nonoverlapping(from.0, to.0, n) };
                    drop((keep, pin));
                })?;
                // SAFETY: pinned memory and a device range of `n` bytes.
                check("cuMemcpyHtoDAsync", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(d + done as u64, staging.as_ptr().cast(), n, stream.raw)
                })?;
                done += n;
            }
            Ok(None)
        }
        (Place::Device { ptr: s, .. }, Place::Host(storage, at)) => {
            let staging = lane.staging(ctx, STAGING_BYTES)?;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(staging.len());
                // SAFETY: pinned memory and a device range of `n` bytes.
                check("cuMemcpyDtoHAsync", unsafe {
                    sys::cuMemcpyDtoHAsync_v2(staging.as_ptr().cast(), s + done as u64, n, stream.raw)
                })?;
                let (from, to) = (SendPtr(staging.as_ptr()), host_ptr(&storage, at + done));
                let (keep, pin) = (storage.clone(), staging.clone());
                enqueue_host(stream, move || {
                    let (from, to) = (from, to);
                    // SAFETY: as for the upload.
                    unsafe { std::ptr::copy_nonoverlapping(from.0, to.0, n) };
                    drop((keep, pin));
                })?;
                done += n;
            }
            Ok(None)
        }
        (Place::Peer { ptr: s, owner }, Place::Device { ptr: d, .. }) => {
            crate::peer::enable(&owner, ctx, ctx)?;
            // SAFETY: device ranges of `len` bytes in the two contexts, peer access
            // enabled; the operation keeps the other context until it completes.
            check("cuMemcpyPeerAsync", unsafe {
                sys::cuMemcpyPeerAsync(d, ctx.raw(), s, owner.raw(), len, stream.raw)
            })?;
            Ok(Some(Box::new(owner)))
        }
        (Place::Device { ptr: s, .. }, Place::Peer { ptr: d, owner }) => {
            crate::peer::enable(ctx, &owner, ctx)?;
            // SAFETY: as above.
            check("cuMemcpyPeerAsync", unsafe {
                sys::cuMemcpyPeerAsync(d, owner.raw(), s, ctx.raw(), len, stream.raw)
            })?;
            Ok(Some(Box::new(owner)))
        }
        (Place::Peer { .. }, _) | (_, Place::Peer { .. }) => {
            unreachable!("the driver refuses copies of peer memory other than to or from its own")
        }
        (Place::Host(a, at_a), Place::Host(b, at_b)) => {
            let (from, to) = (host_ptr(&a, at_a), host_ptr(&b, at_b));
            enqueue_host(stream, move || {
                let (from, to) = (from, to);
                // SAFETY: both ranges hold `len` bytes (checked); `copy` allows overlap.
                unsafe { std::ptr::copy(from.0, to.0, len) };
                drop((a, b));
            })?;
            Ok(None)
        }
    }
}

fn dtod(stream: &Stream, src: CUdeviceptr, dst: CUdeviceptr, len: usize) -> Result<(), CallError> {
    // SAFETY: device ranges of `len` bytes that do not overlap.
    check("cuMemcpyDtoDAsync", unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.raw) })
}

/// One step of a device fill, at a byte offset from the fill's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FillStep {
    /// `count` bytes of `value`.
    D8 { at: usize, value: u8, count: usize },
    /// `count` 2-byte words of `value` (`at` 2-aligned in memory).
    D16 { at: usize, value: u16, count: usize },
    /// `count` 4-byte words of `value` (`at` 4-aligned in memory).
    D32 { at: usize, value: u32, count: usize },
    /// Copy the first `len` bytes to `at` (`len <= at`: no overlap).
    Double { at: usize, len: usize },
}

/// The steps that fill `len` bytes at device address `addr` with `pattern` (not
/// empty; `len` a multiple of it).
pub(crate) fn plan_fill(addr: u64, len: usize, pattern: &[u8]) -> Vec<FillStep> {
    if len == 0 || pattern.is_empty() {
        return Vec::new();
    }
    let w = pattern.len();
    let period = (1..=w)
        .find(|&p| w.is_multiple_of(p) && pattern.iter().enumerate().all(|(i, &b)| b == pattern[i % p]))
        .unwrap_or(w);
    let unit = &pattern[..period];
    // Native byte order: the words' bytes land in memory as the pattern has them.
    let w16 = |at: usize| u16::from_ne_bytes([unit[at], unit[at + 1]]);
    let w32 = |at: usize| u32::from_ne_bytes([unit[at], unit[at + 1], unit[at + 2], unit[at + 3]]);
    match period {
        1 => return vec![FillStep::D8 { at: 0, value: unit[0], count: len }],
        2 if addr.is_multiple_of(2) => return vec![FillStep::D16 { at: 0, value: w16(0), count: len / 2 }],
        4 if addr.is_multiple_of(4) => return vec![FillStep::D32 { at: 0, value: w32(0), count: len / 4 }],
        _ => {}
    }
    let size = [4usize, 2, 1]
        .into_iter()
        .find(|&s| period.is_multiple_of(s) && addr.is_multiple_of(s as u64))
        .unwrap_or(1);
    let mut steps: Vec<FillStep> = (0..period / size)
        .map(|k| {
            let at = k * size;
            match size {
                4 => FillStep::D32 { at, value: w32(at), count: 1 },
                2 => FillStep::D16 { at, value: w16(at), count: 1 },
                _ => FillStep::D8 { at, value: unit[at], count: 1 },
            }
        })
        .collect();
    let mut filled = period;
    while filled < len {
        let n = filled.min(len - filled);
        steps.push(FillStep::Double { at: filled, len: n });
        filled += n;
    }
    steps
}

/// Enqueues a fill of `len` bytes at `dst` with `pattern`.
pub(crate) fn fill(stream: &Stream, dst: Place, len: usize, pattern: &[u8]) -> Result<(), CallError> {
    let ptr = match dst {
        Place::Device { ptr, .. } => ptr,
        Place::Peer { .. } => unreachable!("the driver refuses fills of peer memory"),
        Place::Host(storage, at) => {
            let (to, pattern) = (host_ptr(&storage, at), pattern.to_vec());
            return enqueue_host(stream, move || {
                let to = to;
                // SAFETY: the range holds `len` bytes (checked), a whole number of
                // patterns; kept alive by the capture.
                unsafe { fill_bytes(to.0, len, &pattern) };
                drop(storage);
            });
        }
    };
    for step in plan_fill(ptr, len, pattern) {
        let s = stream.raw;
        // SAFETY (all): ranges inside the checked `len` bytes at `ptr`, aligned as
        // the plan requires.
        match step {
            FillStep::D8 { at, value, count } => {
                check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(ptr + at as u64, value, count, s) })
            }
            FillStep::D16 { at, value, count } => {
                check("cuMemsetD16Async", unsafe { sys::cuMemsetD16Async(ptr + at as u64, value, count, s) })
            }
            FillStep::D32 { at, value, count } => {
                check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(ptr + at as u64, value, count, s) })
            }
            FillStep::Double { at, len } => dtod(stream, ptr, ptr + at as u64, len),
        }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a plan on host memory, as the device would.
    fn simulate(addr: u64, len: usize, pattern: &[u8]) -> Vec<u8> {
        let mut m = vec![0xEEu8; len];
        for step in plan_fill(addr, len, pattern) {
            match step {
                FillStep::D8 { at, value, count } => m[at..at + count].fill(value),
                FillStep::D16 { at, value, count } => {
                    assert!((addr + at as u64).is_multiple_of(2), "a misaligned D16");
                    for k in 0..count {
                        m[at + 2 * k..at + 2 * k + 2].copy_from_slice(&value.to_ne_bytes());
                    }
                }
                FillStep::D32 { at, value, count } => {
                    assert!((addr + at as u64).is_multiple_of(4), "a misaligned D32");
                    for k in 0..count {
                        m[at + 4 * k..at + 4 * k + 4].copy_from_slice(&value.to_ne_bytes());
                    }
                }
                FillStep::Double { at, len } => {
                    assert!(len <= at, "an overlapping copy");
                    m.copy_within(0..len, at);
                }
            }
        }
        m
    }

    #[test]
    fn every_width_and_alignment_fills_its_pattern() {
        for width in [1usize, 2, 3, 4, 5, 8, 12, 16, 24, 64] {
            for addr in [0u64, 1, 2, 3, 4, 8] {
                for reps in [1usize, 2, 3, 7, 64, 1000] {
                    let pattern: Vec<u8> =
                        (0..width).map(|b| (b as u8).wrapping_mul(37).wrapping_add(11)).collect();
                    let got = simulate(addr, width * reps, &pattern);
                    let expected: Vec<u8> = pattern.iter().copied().cycle().take(width * reps).collect();
                    assert_eq!(got, expected, "width {width}, address {addr}, {reps} repetitions");
                }
            }
        }
    }

    #[test]
    fn periodic_patterns_are_one_memset() {
        assert_eq!(plan_fill(0, 64, &[7; 16]), [FillStep::D8 { at: 0, value: 7, count: 64 }]);
        let p = [1u8, 2, 3, 4, 1, 2, 3, 4];
        assert!(matches!(plan_fill(0, 64, &p)[..], [FillStep::D32 { count: 16, .. }]));
        assert!(matches!(plan_fill(2, 64, &[5, 6, 5, 6])[..], [FillStep::D16 { count: 32, .. }]));
        // A 16-byte pattern over 1 MiB: 4 seeds and 16 doublings.
        assert_eq!(plan_fill(0, 1 << 20, &(0..16).collect::<Vec<u8>>()).len(), 4 + 16);
    }
}
