//! Injected faults: the [`FaultPlan`] of a device, planned and drawn from a seed, and
//! how operations count against it.

use gantry_driver::ExecError;

use crate::clock::State;
use crate::machine::SimDriver;

/// One planned fault. Counts start at 0 and count only this device's operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The `nth` kernel submitted fails without running. Kernels recorded in a command
    /// buffer count once per replay, at the replay's submission, in plan order; the
    /// faulted kernel fails inside the replay like a panicking one would.
    Kernel {
        /// Which kernel.
        nth: u64,
    },
    /// The `nth` copy (including memory moves) fails without copying. Copies recorded
    /// in a command buffer count like kernels recorded in one.
    Copy {
        /// Which copy.
        nth: u64,
    },
    /// The `nth` allocation fails with [`ExecError::OutOfMemory`].
    Alloc {
        /// Which allocation.
        nth: u64,
    },
    /// The device is lost when its `nth` operation executes: that operation and every
    /// later one fail with [`ExecError::DeviceLost`], and so do later submissions and
    /// allocations. A command-buffer replay is one operation.
    DeviceLost {
        /// Which operation.
        nth: u64,
    },
}

/// The classes of operations that fail by count (each with its own counter and its
/// own random draws).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Faulting {
    Kernel = 0,
    Copy = 1,
}

impl Faulting {
    /// The planned fault of the `nth` operation of the class.
    pub(crate) fn fault(self, nth: u64) -> Fault {
        match self {
            Faulting::Kernel => Fault::Kernel { nth },
            Faulting::Copy => Fault::Copy { nth },
        }
    }
    /// Whether a planned fault targets an operation of this class.
    pub(crate) fn targeted_by(self, fault: Fault) -> bool {
        matches!(
            (self, fault),
            (Faulting::Kernel, Fault::Kernel { .. }) | (Faulting::Copy, Fault::Copy { .. })
        )
    }
    pub(crate) fn what(self) -> &'static str {
        match self {
            Faulting::Kernel => "kernel launch failed",
            Faulting::Copy => "copy failed",
        }
    }
}

/// Which faults a simulated device injects: an explicit list, and optionally random
/// kernel and copy failures drawn from a seed (the same seed fails the same
/// operations).
///
/// ```
/// use gantry_sim::{Fault, FaultPlan};
/// let plan = FaultPlan::default().with(Fault::Kernel { nth: 2 }).seeded(7, 10, 0);
/// assert_eq!(plan.faults.len(), 1);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Planned faults.
    pub faults: Vec<Fault>,
    /// Seed of the random faults.
    pub seed: u64,
    /// Chance, in thousandths, that a kernel fails.
    pub kernel_per_mille: u32,
    /// Chance, in thousandths, that a copy fails.
    pub copy_per_mille: u32,
}

impl FaultPlan {
    /// Adds a planned fault.
    pub fn with(mut self, fault: Fault) -> Self {
        self.faults.push(fault);
        self
    }
    /// Adds random kernel and copy failures drawn from `seed`.
    pub fn seeded(mut self, seed: u64, kernel_per_mille: u32, copy_per_mille: u32) -> Self {
        self.seed = seed;
        self.kernel_per_mille = kernel_per_mille;
        self.copy_per_mille = copy_per_mille;
        self
    }
    pub(crate) fn has(&self, fault: Fault) -> bool {
        self.faults.contains(&fault)
    }
    /// Whether any operation of `class` can fail (else a replay only counts them).
    pub(crate) fn may_fail(&self, class: Faulting) -> bool {
        self.per_mille(class) > 0 || self.faults.iter().any(|&f| class.targeted_by(f))
    }
    pub(crate) fn per_mille(&self, class: Faulting) -> u32 {
        match class {
            Faulting::Kernel => self.kernel_per_mille,
            Faulting::Copy => self.copy_per_mille,
        }
    }
    /// Whether the `nth` operation of `class` fails: planned, or drawn.
    pub(crate) fn strikes(&self, class: Faulting, nth: u64) -> bool {
        self.has(class.fault(nth)) || self.draws(class as u64 + 1, nth, self.per_mille(class))
    }
    /// Whether the `nth` operation of a class (`salt`) draws a failure at `per_mille`.
    pub(crate) fn draws(&self, salt: u64, nth: u64, per_mille: u32) -> bool {
        if per_mille == 0 {
            return false;
        }
        // splitmix64 of (seed, class, index): independent, reproducible draws.
        let mut z =
            self.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ nth.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        z % 1000 < per_mille as u64
    }
}

impl SimDriver {
    /// Counts a kernel or copy against the fault plan and fails it if a fault targets
    /// it.
    pub(crate) fn count_fault(&self, state: &mut State, class: Faulting) -> Result<(), ExecError> {
        let nth = &mut state.counted[class as usize];
        *nth += 1;
        if self.faults.strikes(class, *nth - 1) {
            return Err(self.fault(class.what()));
        }
        Ok(())
    }
}
