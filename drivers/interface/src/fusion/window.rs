//! When a fusion window pays on a device: the cost model `submit` applies to the
//! first kernel of a window (`start_fusion` … `complete_fusion`).
//!
//! A window's kernels are either listed (held back until `complete_fusion` fuses
//! them) or run as they come, and that is decided at its first kernel: the later
//! ones are not known yet. On a device where fusing a chain of small kernels costs
//! more than it saves (the CPU driver: a kernel's launch costs about what a fused
//! kernel's does, and the window itself costs more), the window then runs its
//! kernels as they are submitted, and its outcome names the reason.
//!
//! A chain recorded in a command graph has no window: it is fused once, at finalize,
//! and a replay launches its kernels, fused or not, from one command buffer, so
//! fusing saves the host little. There only the memory rule applies, judged over the
//! whole chain ([`WindowThresholds::judge_chain`]).

use super::Unprofitable;

/// From which size a kernel chain fused in a window runs faster than unfused on a
/// device, judged by the window's first kernel ([`WindowThresholds::judge`]).
///
/// ```
/// use gantry_driver::fusion::{Unprofitable, WindowThresholds};
/// let cpu = WindowThresholds { min_items: 32_768, min_global_bytes: 1 << 20 };
/// // A launch-bound kernel: its window runs its kernels unfused.
/// assert_eq!(
///     cpu.judge(4_096, 32_768, true),
///     Some(Unprofitable::LaunchBound { items: 4_096, min_items: 32_768 })
/// );
/// // Private intermediates over 64K items: fusing saves their memory traffic.
/// assert_eq!(cpu.judge(65_536, 262_144, true), None);
/// // Global intermediates the caches hold: fused, the chain moves the same bytes.
/// assert!(matches!(cpu.judge(65_536, 524_288, false), Some(Unprofitable::CacheResident { .. })));
/// assert_eq!(WindowThresholds::ALWAYS.judge(1, 4, false), None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WindowThresholds {
    /// The fewest work-items a window's first kernel must have for the window to
    /// fuse: below it, the window's fixed cost outweighs what fusing saves.
    pub min_items: u64,
    /// The fewest bytes of global memory (its accessors' ranges) a first kernel that
    /// promotes none of its accessors must touch for the window to fuse, and a
    /// recorded chain that promotes none must span: a chain whose intermediates stay
    /// in global memory saves only the trips to memory the caches would not have
    /// saved anyway.
    pub min_global_bytes: u64,
}

impl WindowThresholds {
    /// Every window fuses: devices where each fused kernel saves a launch whatever
    /// its size (GPUs), or whose cost model counts launches (the simulator).
    pub const ALWAYS: Self = Self { min_items: 0, min_global_bytes: 0 };

    /// Why a window whose first kernel has `items` work-items and touches
    /// `global_bytes` bytes of global memory, promoting some accessor (`promotes`)
    /// or none, would run slower fused than unfused; `None` where it should fuse.
    pub fn judge(&self, items: u64, global_bytes: u64, promotes: bool) -> Option<Unprofitable> {
        if items < self.min_items {
            return Some(Unprofitable::LaunchBound { items, min_items: self.min_items });
        }
        if !promotes && global_bytes < self.min_global_bytes {
            return Some(Unprofitable::CacheResident {
                bytes: global_bytes,
                min_bytes: self.min_global_bytes,
            });
        }
        None
    }

    /// Why a chain recorded in a command graph, which spans `footprint` bytes of
    /// global memory (its accessors' ranges, each byte counted once) and promotes
    /// some accessor (`promotes`) or none, would run slower fused than unfused;
    /// `None` where it should fuse. A recorded chain costs no window and a replay
    /// launches its kernels from one command buffer, so its size in work-items does
    /// not count: fusing it pays where its intermediates leave global memory or its
    /// memory outgrows the caches.
    ///
    /// ```
    /// use gantry_driver::fusion::{Unprofitable, WindowThresholds};
    /// let cpu = WindowThresholds { min_items: 32_768, min_global_bytes: 1 << 20 };
    /// // Four kernels chained over five 64 KiB buffers: the caches hold all of it.
    /// assert_eq!(
    ///     cpu.judge_chain(5 << 16, false),
    ///     Some(Unprofitable::CacheResident { bytes: 5 << 16, min_bytes: 1 << 20 })
    /// );
    /// // The same chain with its intermediates promoted, or over 1 MiB buffers, fuses.
    /// assert_eq!(cpu.judge_chain(2 << 16, true), None);
    /// assert_eq!(cpu.judge_chain(5 << 20, false), None);
    /// ```
    pub fn judge_chain(&self, footprint: u64, promotes: bool) -> Option<Unprofitable> {
        if !promotes && footprint < self.min_global_bytes {
            return Some(Unprofitable::CacheResident { bytes: footprint, min_bytes: self.min_global_bytes });
        }
        None
    }
}
