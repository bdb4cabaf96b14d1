//! Where a compilation's time went.

use std::time::{Duration, Instant};

/// The phases of one compilation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompileTimings {
    /// Reading the image into LLVM.
    pub parse: Duration,
    /// Binding, retargeting, inlining and building the target's function around the
    /// kernel (for the host, the work-group function with its barrier regions).
    pub transform: Duration,
    /// LLVM's optimization pipeline.
    pub optimize: Duration,
    /// Machine code or PTX generation.
    pub codegen: Duration,
}

impl CompileTimings {
    /// The sum of the phases.
    pub fn total(&self) -> Duration {
        self.parse + self.transform + self.optimize + self.codegen
    }
}

/// Times phases one after the other.
pub(crate) struct Clock(Instant);

impl Clock {
    pub(crate) fn start() -> Self {
        Self(Instant::now())
    }
    /// The time since the last lap (or the start).
    pub(crate) fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let d = now - self.0;
        self.0 = now;
        d
    }
}
