//! Memory records: one entity per buffer, holding the leaves dependency resolution
//! reads (the unfinished commands that last read or wrote each range) and where valid
//! copies of the contents live.

use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::entity::Entity;
use gantry_driver::{AllocId, MemSpace};
use smallvec::SmallVec;

use crate::handle::BufferCore;
use crate::resources::DeviceId;

/// A half-open byte range `[start, end)` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ByteRange {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl ByteRange {
    /// `[start, start + len)`.
    pub fn new(start: usize, len: usize) -> Self {
        Self { start, end: start + len }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
    /// Whether the two ranges share a byte.
    #[inline]
    pub fn overlaps(&self, other: &ByteRange) -> bool {
        self.start < other.end && other.start < self.end
    }
    /// Whether `self` contains all of `other`.
    #[inline]
    pub fn covers(&self, other: &ByteRange) -> bool {
        self.start <= other.start && other.end <= self.end
    }
}

/// An unfinished command that read or wrote a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// The command.
    pub cmd: Entity,
    /// The range it accessed.
    pub range: ByteRange,
}

/// One memory space's copy of a buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The memory space.
    pub space: MemSpace,
    /// The device owning the allocation (none for host memory).
    pub device: Option<DeviceId>,
    /// The allocation (none for host memory).
    pub alloc: Option<AllocId>,
    /// Whether it holds the current contents (once `producer` has finished).
    pub valid: bool,
    /// The unfinished memory move that fills it, if any.
    pub producer: Option<Entity>,
}

/// The memory record of one buffer.
#[derive(Component, Debug)]
pub struct MemoryRecord {
    /// The buffer.
    pub buffer: Arc<BufferCore>,
    /// Unfinished readers, by range.
    pub reads: SmallVec<[Leaf; 4]>,
    /// Unfinished writers, by range.
    pub writes: SmallVec<[Leaf; 2]>,
    /// Copies of the contents; the host copy is always first.
    pub locations: SmallVec<[Location; 2]>,
}

impl MemoryRecord {
    /// A record whose only (valid) copy is the host storage.
    pub fn new(buffer: Arc<BufferCore>) -> Self {
        Self {
            buffer,
            reads: SmallVec::new(),
            writes: SmallVec::new(),
            locations: SmallVec::from_iter([Location {
                space: MemSpace::Host,
                device: None,
                alloc: None,
                valid: true,
                producer: None,
            }]),
        }
    }

    /// The location for `space`, if any.
    pub fn location(&self, space: MemSpace) -> Option<&Location> {
        self.locations.iter().find(|l| l.space == space)
    }

    /// The location for `space`, mutably.
    pub fn location_mut(&mut self, space: MemSpace) -> Option<&mut Location> {
        self.locations.iter_mut().find(|l| l.space == space)
    }

    /// Forgets `cmd` as a leaf and as a producer: it has finished.
    pub fn release(&mut self, cmd: Entity) {
        self.reads.retain(|l| l.cmd != cmd);
        self.writes.retain(|l| l.cmd != cmd);
        for loc in &mut self.locations {
            if loc.producer == Some(cmd) {
                loc.producer = None;
            }
        }
    }

    /// Whether any unfinished command still uses the buffer.
    pub fn is_idle(&self) -> bool {
        self.reads.is_empty() && self.writes.is_empty() && self.locations.iter().all(|l| l.producer.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_overlap_and_cover() {
        let a = ByteRange::new(0, 8);
        let b = ByteRange::new(8, 8);
        assert!(!a.overlaps(&b));
        assert!(a.overlaps(&ByteRange::new(7, 2)));
        assert!(ByteRange::new(0, 16).covers(&b));
        assert!(!b.covers(&a));
    }
}
