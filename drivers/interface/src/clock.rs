//! The runtime's clock, and the rule for the timestamps events record.

use std::time::Instant;

/// A runtime's clock: nanoseconds since its epoch, and the timestamps events record,
/// which read it only where the runtime profiles (`RuntimeBuilder::profiling`): an
/// eager command would otherwise read it several times for times nobody asks for.
///
/// ```
/// let clock = gantry_driver::Clock { epoch: std::time::Instant::now(), profiling: false };
/// assert_eq!(clock.stamp_ns(), 0);
/// let profiled = gantry_driver::Clock { profiling: true, ..clock };
/// assert!(profiled.stamp_ns() <= profiled.now_ns());
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// The time origin.
    pub epoch: Instant,
    /// Whether timestamps read the clock.
    pub profiling: bool,
}

impl Clock {
    /// A clock whose epoch is now.
    pub fn starting_now(profiling: bool) -> Self {
        Self { epoch: Instant::now(), profiling }
    }

    /// Nanoseconds since the epoch.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// A timestamp: [`Clock::now_ns`] where the runtime profiles, else 0 (no clock
    /// read).
    #[inline]
    pub fn stamp_ns(&self) -> u64 {
        if self.profiling {
            self.now_ns()
        } else {
            0
        }
    }
}
