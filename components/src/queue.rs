//! Queue entities: the state in-order queues and barriers depend on.

use std::sync::Arc;

use bevy_ecs::component::Component;
use bevy_ecs::entity::Entity;

use crate::handle::QueueCore;

/// Per-queue scheduling state.
#[derive(Component, Debug)]
pub struct QueueState {
    /// The queue.
    pub core: Arc<QueueCore>,
    /// The last command submitted (in-order queues depend on it).
    pub last: Option<Entity>,
    /// Commands submitted since the last barrier that may still be unfinished; a
    /// barrier depends on all of them and then replaces them.
    pub since_barrier: Vec<Entity>,
}

impl QueueState {
    /// Fresh state for a queue.
    pub fn new(core: Arc<QueueCore>) -> Self {
        Self { core, last: None, since_barrier: Vec::new() }
    }
}
