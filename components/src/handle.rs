//! The shared halves of user handles: what a user thread and the scheduler both see.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use bevy_ecs::entity::Entity;
use gantry_driver::fusion::Promotion;
use gantry_driver::HostStorage;

use crate::resources::DeviceId;

/// An entity id that user threads can hold and the scheduler fills in lazily.
#[derive(Debug)]
pub struct EntitySlot(AtomicU64);

impl Default for EntitySlot {
    fn default() -> Self {
        Self(AtomicU64::new(Entity::PLACEHOLDER.to_bits()))
    }
}

impl EntitySlot {
    /// The entity, if set.
    #[inline]
    pub fn get(&self) -> Option<Entity> {
        let bits = self.0.load(Ordering::Acquire);
        (bits != Entity::PLACEHOLDER.to_bits()).then(|| Entity::from_bits(bits))
    }
    /// Sets the entity.
    #[inline]
    pub fn set(&self, e: Entity) {
        self.0.store(e.to_bits(), Ordering::Release);
    }
    /// Clears it.
    pub fn clear(&self) {
        self.0.store(Entity::PLACEHOLDER.to_bits(), Ordering::Release);
    }
}

/// The scheduler's view of a buffer: its host storage, size and memory record.
///
/// Aligned to 128 bytes (a pair of cache lines, which x86 prefetches together), so
/// inside its `Arc` the fields start apart from the reference counts: user threads
/// move the counts every command (each requirement clones the handle) while the
/// scheduler's thread reads the fields, and on a shared line each count change would
/// make that read a miss.
#[derive(Debug)]
#[repr(align(128))]
pub struct BufferCore {
    /// Unique within the runtime; names the buffer in errors.
    pub id: u64,
    /// Host copy of the contents (always allocated).
    pub storage: Arc<HostStorage>,
    /// Size in bytes.
    pub bytes: usize,
    /// The memory record entity, created at first use.
    pub record: EntitySlot,
    /// The scheduler has ingested the drop of the last user handle (set in message
    /// order): the record goes once no command uses it.
    pub dropped: AtomicBool,
    /// The promotion hint its accessors inherit (a [`Promotion`] as `u8`).
    pub promotion: AtomicU8,
    /// How many graphs being recorded use it (host access is refused meanwhile).
    pub recorded: std::sync::atomic::AtomicU32,
}

impl BufferCore {
    /// The promotion hint its accessors inherit.
    pub fn promotion(&self) -> Promotion {
        match self.promotion.load(Ordering::Relaxed) {
            1 => Promotion::Local,
            2 => Promotion::Private,
            _ => Promotion::None,
        }
    }
    /// Sets the promotion hint its accessors inherit.
    pub fn set_promotion(&self, p: Promotion) {
        let v = match p {
            Promotion::None => 0,
            Promotion::Local => 1,
            Promotion::Private => 2,
        };
        self.promotion.store(v, Ordering::Relaxed);
    }

    /// Whether the user dropped the last handle.
    pub fn is_dropped(&self) -> bool {
        self.dropped.load(Ordering::Acquire)
    }
}

/// The scheduler's view of a queue. Aligned as [`BufferCore`] is, for the same reason
/// (every command holds its queue).
#[derive(Debug)]
#[repr(align(128))]
pub struct QueueCore {
    /// Unique within the runtime.
    pub id: u64,
    /// The device its commands run on.
    pub device: DeviceId,
    /// Whether each command depends on the previous one.
    pub in_order: bool,
    /// The queue-state entity, created at first use.
    pub entity: EntitySlot,
}
