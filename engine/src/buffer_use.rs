//! One command's use of a buffer, as the submitting thread sees it, and the rule by
//! which one command depends on another through their buffers: the byte ranges they
//! use of one buffer overlap, and either writes (the rule the scheduler's memory
//! records apply, at the call). The active fusions (`fusing`) and the kernels a
//! window passed through (`passing`) both decide dependencies by it.

use gantry_components::{ByteRange, Requirement};

/// Which bytes of which buffer a requirement uses, and whether it writes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BufferUse {
    pub(crate) buffer: u64,
    pub(crate) range: ByteRange,
    pub(crate) writes: bool,
}

impl BufferUse {
    /// The use requirement `r` makes.
    pub(crate) fn of(r: &Requirement) -> Self {
        Self { buffer: r.buffer.id, range: r.range, writes: r.mode.writes() }
    }

    /// Whether a command making one of the two uses depends on (or is depended on by)
    /// one making the other.
    #[inline]
    pub(crate) fn conflicts(&self, other: &BufferUse) -> bool {
        self.buffer == other.buffer && self.range.overlaps(&other.range) && (self.writes || other.writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_conflict_on_overlapping_bytes_of_one_buffer_where_one_writes() {
        let use_ = |buffer, start, end, writes| BufferUse { buffer, range: ByteRange { start, end }, writes };
        assert!(use_(1, 0, 8, true).conflicts(&use_(1, 4, 12, false)));
        assert!(use_(1, 0, 8, false).conflicts(&use_(1, 4, 12, true)));
        assert!(!use_(1, 0, 8, false).conflicts(&use_(1, 4, 12, false)), "two reads");
        assert!(!use_(1, 0, 8, true).conflicts(&use_(1, 8, 12, true)), "adjacent bytes");
        assert!(!use_(1, 0, 8, true).conflicts(&use_(2, 0, 8, true)), "another buffer");
    }
}
