//! Copies and fills, recorded as transfer commands into an operation's command
//! buffer.
//!
//! * Device ↔ device: `vkCmdCopyBuffer`; ranges that overlap inside one buffer go
//!   through scratch device memory with a barrier between the two copies (Vulkan's
//!   copies do not allow overlap), which the operation keeps until it completes.
//! * Host → device: the host bytes are copied into host-visible staging memory of
//!   the operation's own when it is submitted (after everything it waits on has
//!   finished, so an earlier write into the same host memory is in), then copied on
//!   the device. Device → host: a device copy into staging memory, a barrier that
//!   makes it visible to the host, and a read-back into the host memory by the
//!   completion thread once the batch signalled, before the completion is reported.
//!   Host ↔ host and fills of host memory run on the host when submitted.
//! * Fills: a pattern whose smallest period is 1, 2 or 4 bytes over a range that
//!   starts and ends 4-aligned is one `vkCmdFillBuffer` (which takes nothing else).
//!   Any other pattern, width or alignment is written once into a staging tile (the
//!   pattern repeated to at most [`TILE_BYTES`]) and copied from it over the range,
//!   one copy region per tile: no alignment rules apply to copies, and every region
//!   reads the same source, so no barrier is needed between them (CUDA's driver
//!   doubles a filled prefix instead, which on Vulkan would need a barrier per step).

use std::any::Any;
use std::sync::Arc;

use ash::vk;
use gantry_driver::fill_bytes;

use crate::device::Device;
use crate::execution::Finish;
use crate::memory::{Buffer, MakeError, Place};

/// The longest staging tile a fill copies from.
pub(crate) const TILE_BYTES: usize = 64 << 10;

/// What recording a transfer leaves for the operation.
#[derive(Default)]
pub(crate) struct Recorded {
    /// Kept until the operation completes (staging and scratch memory, buffers).
    pub keep: Vec<Box<dyn Any + Send + Sync>>,
    /// Run by the completion thread after the device work.
    pub finish: Option<Finish>,
    /// Whether any command was recorded.
    pub device_work: bool,
}

/// Why a transfer could not be recorded.
#[derive(Debug)]
pub(crate) enum TransferError {
    /// Staging or scratch memory could not be allocated.
    OutOfMemory(usize),
    /// A Vulkan call failed.
    Call(crate::CallError),
}

fn staging(dev: &Arc<Device>, len: usize) -> Result<Buffer, TransferError> {
    Buffer::new(dev, len, true).map_err(|e| match e {
        MakeError::OutOfMemory => TransferError::OutOfMemory(len),
        MakeError::Call(e) => TransferError::Call(e),
    })
}

/// A raw pointer the completion thread carries.
struct SendPtr(*mut u8);
// SAFETY: the memory behind it is kept alive by the same closure (it holds the
// storage and the staging buffer) and touched only by it, after the device work.
unsafe impl Send for SendPtr {}

fn copy_region(
    dev: &Device,
    cmd: vk::CommandBuffer,
    src: vk::Buffer,
    src_at: usize,
    dst: vk::Buffer,
    dst_at: usize,
    len: usize,
) {
    let region = [vk::BufferCopy { src_offset: src_at as u64, dst_offset: dst_at as u64, size: len as u64 }];
    // SAFETY: both ranges lie inside their buffers (checked by the caller) and do not
    // overlap; the command buffer is recording.
    unsafe { dev.raw.cmd_copy_buffer(cmd, src, dst, &region) };
}

/// A barrier making transfer writes visible to `dst_access` at `dst_stage`.
pub(crate) fn after_transfer(
    dev: &Device,
    cmd: vk::CommandBuffer,
    dst_stage: vk::PipelineStageFlags,
    dst_access: vk::AccessFlags,
) {
    let barrier = [vk::MemoryBarrier::default()
        .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
        .dst_access_mask(dst_access)];
    // SAFETY: a recording command buffer.
    unsafe {
        dev.raw.cmd_pipeline_barrier(
            cmd,
            vk::PipelineStageFlags::TRANSFER,
            dst_stage,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        )
    };
}

/// Records (or, for host-only copies, performs) a copy of `len` bytes from `src` to
/// `dst`, both checked to hold them. Host memory read here must be final: the caller
/// has waited for everything the operation waits on.
pub(crate) fn copy(
    dev: &Arc<Device>,
    cmd: vk::CommandBuffer,
    src: Place,
    dst: Place,
    len: usize,
) -> Result<Recorded, TransferError> {
    let mut out = Recorded::default();
    if len == 0 {
        return Ok(out);
    }
    match (src, dst) {
        (Place::Device(a, s), Place::Device(b, d)) => {
            let same = Arc::ptr_eq(&a, &b);
            if same && s == d {
                return Ok(out);
            }
            if same && s < d + len && d < s + len {
                let scratch = Buffer::new(dev, len, false).map_err(|e| match e {
                    MakeError::OutOfMemory => TransferError::OutOfMemory(len),
                    MakeError::Call(e) => TransferError::Call(e),
                })?;
                copy_region(dev, cmd, a.raw, s, scratch.raw, 0, len);
                after_transfer(dev, cmd, vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_READ);
                copy_region(dev, cmd, scratch.raw, 0, b.raw, d, len);
                out.keep.push(Box::new(scratch));
            } else {
                copy_region(dev, cmd, a.raw, s, b.raw, d, len);
            }
            out.keep.push(Box::new(a));
            out.keep.push(Box::new(b));
            out.device_work = true;
        }
        (Place::Host(storage, s), Place::Device(b, d)) => {
            let stage = staging(dev, len)?;
            // SAFETY: the host range holds `len` bytes (checked) and is final (the
            // caller waited); the staging buffer is fresh, mapped and as long.
            unsafe { std::ptr::copy_nonoverlapping(storage.as_ptr().add(s), stage.mapped(), len) };
            copy_region(dev, cmd, stage.raw, 0, b.raw, d, len);
            out.keep.push(Box::new(stage));
            out.keep.push(Box::new(b));
            out.device_work = true;
        }
        (Place::Device(a, s), Place::Host(storage, d)) => {
            let stage = Arc::new(staging(dev, len)?);
            copy_region(dev, cmd, a.raw, s, stage.raw, 0, len);
            after_transfer(dev, cmd, vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ);
            let (from, keep) = (SendPtr(stage.mapped()), stage.clone());
            out.finish = Some(Box::new(move || {
                let from = from;
                // SAFETY: the device wrote the staging bytes and made them visible to
                // the host (the barrier, then the semaphore the caller waited on);
                // the host range holds `len` bytes (checked).
                unsafe { std::ptr::copy_nonoverlapping(from.0, storage.as_ptr().add(d), len) };
                drop(keep);
            }));
            out.keep.push(Box::new(a));
            out.keep.push(Box::new(stage));
            out.device_work = true;
        }
        (Place::Host(a, s), Place::Host(b, d)) => {
            // SAFETY: both ranges hold `len` bytes (checked); `copy` allows overlap;
            // the caller waited for what the operation waits on.
            unsafe { std::ptr::copy(a.as_ptr().add(s), b.as_ptr().add(d), len) };
        }
    }
    Ok(out)
}

/// The smallest period of `pattern`.
fn period(pattern: &[u8]) -> usize {
    let w = pattern.len();
    (1..=w)
        .find(|&p| w.is_multiple_of(p) && pattern.iter().enumerate().all(|(i, &b)| b == pattern[i % p]))
        .unwrap_or(w)
}

/// How a device fill is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FillPlan {
    /// One `vkCmdFillBuffer` of this word (native byte order).
    Word(u32),
    /// Copies from a staging tile of this many bytes.
    Tile(usize),
}

/// How to fill `len` bytes at byte `offset` of a buffer with `pattern` (not empty;
/// `len` a multiple of it).
pub(crate) fn plan_fill(offset: usize, len: usize, pattern: &[u8]) -> FillPlan {
    let p = period(pattern);
    if matches!(p, 1 | 2 | 4) && offset.is_multiple_of(4) && len.is_multiple_of(4) {
        let word = [pattern[0], pattern[1 % p], pattern[2 % p], pattern[3 % p]];
        return FillPlan::Word(u32::from_ne_bytes(word));
    }
    let w = pattern.len();
    FillPlan::Tile(w * (TILE_BYTES / w).clamp(1, len / w))
}

/// Records (or, for host memory, performs) a fill of `len` bytes at `dst` with
/// `pattern`.
pub(crate) fn fill(
    dev: &Arc<Device>,
    cmd: vk::CommandBuffer,
    dst: Place,
    len: usize,
    pattern: &[u8],
) -> Result<Recorded, TransferError> {
    let mut out = Recorded::default();
    if len == 0 {
        return Ok(out);
    }
    let (buffer, at) = match dst {
        Place::Host(storage, at) => {
            // SAFETY: the range holds `len` bytes (checked), a whole number of
            // patterns; the caller waited for what the operation waits on.
            unsafe { fill_bytes(storage.as_ptr().add(at), len, pattern) };
            return Ok(out);
        }
        Place::Device(b, at) => (b, at),
    };
    match plan_fill(at, len, pattern) {
        FillPlan::Word(word) => {
            // SAFETY: a 4-aligned range inside the buffer; recording.
            unsafe { dev.raw.cmd_fill_buffer(cmd, buffer.raw, at as u64, len as u64, word) };
        }
        FillPlan::Tile(tile) => {
            let stage = staging(dev, tile)?;
            // SAFETY: the staging buffer is fresh, mapped and `tile` bytes long, a
            // multiple of the pattern.
            unsafe { fill_bytes(stage.mapped(), tile, pattern) };
            let regions: Vec<vk::BufferCopy> = (0..len)
                .step_by(tile)
                .map(|k| vk::BufferCopy {
                    src_offset: 0,
                    dst_offset: (at + k) as u64,
                    size: tile.min(len - k) as u64,
                })
                .collect();
            // SAFETY: the regions lie inside the range and do not overlap; recording.
            unsafe { dev.raw.cmd_copy_buffer(cmd, stage.raw, buffer.raw, &regions) };
            out.keep.push(Box::new(stage));
        }
    }
    out.keep.push(Box::new(buffer));
    out.device_work = true;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a plan on host memory, as the device would.
    fn simulate(offset: usize, len: usize, pattern: &[u8]) -> Vec<u8> {
        let mut m = vec![0xEEu8; len];
        match plan_fill(offset, len, pattern) {
            FillPlan::Word(w) => {
                assert!(offset.is_multiple_of(4) && len.is_multiple_of(4), "a misaligned vkCmdFillBuffer");
                for c in m.chunks_exact_mut(4) {
                    c.copy_from_slice(&w.to_ne_bytes());
                }
            }
            FillPlan::Tile(tile) => {
                assert!(tile.is_multiple_of(pattern.len()) && tile <= TILE_BYTES.max(pattern.len()));
                let t: Vec<u8> = pattern.iter().copied().cycle().take(tile).collect();
                for k in (0..len).step_by(tile) {
                    let n = tile.min(len - k);
                    m[k..k + n].copy_from_slice(&t[..n]);
                }
            }
        }
        m
    }

    #[test]
    fn every_width_and_alignment_fills_its_pattern() {
        for width in 1usize..=16 {
            for offset in [0usize, 1, 2, 3, 4, 8] {
                for reps in [1usize, 2, 3, 7, 64, 1000, 70_000] {
                    let pattern: Vec<u8> =
                        (0..width).map(|b| (b as u8).wrapping_mul(37).wrapping_add(11)).collect();
                    let got = simulate(offset, width * reps, &pattern);
                    let expected: Vec<u8> = pattern.iter().copied().cycle().take(width * reps).collect();
                    assert!(got == expected, "width {width}, offset {offset}, {reps} repetitions");
                }
            }
        }
    }

    #[test]
    fn periodic_aligned_patterns_are_one_fill_command() {
        assert_eq!(plan_fill(0, 64, &[7; 16]), FillPlan::Word(0x0707_0707));
        assert_eq!(plan_fill(4, 64, &[1, 2, 1, 2]), FillPlan::Word(u32::from_ne_bytes([1, 2, 1, 2])));
        assert!(
            matches!(plan_fill(2, 64, &[1, 2]), FillPlan::Tile(_)),
            "vkCmdFillBuffer needs 4-aligned offsets"
        );
        assert!(matches!(plan_fill(0, 6, &[1, 2]), FillPlan::Tile(6)), "and 4-aligned sizes");
    }
}
