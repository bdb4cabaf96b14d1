//! Cached queries for the stage systems' random access to entities.
//!
//! `World::get` looks a component's id up by `TypeId` on every call, and
//! `QueryState::get` re-checks the world's archetypes; these lookups do neither. Each
//! stage system keeps one `Queries` in a `Local`, calls [`Queries::refresh`] when it
//! starts and after it spawns an entity, and looks entities up in O(1) between.

use bevy_ecs::entity::Entity;
use bevy_ecs::prelude::Mut;
use bevy_ecs::query::QueryState;
use bevy_ecs::world::{FromWorld, World};
use gantry_components::{
    Command, Edges, Execution, FusionList, InFusion, MemoryRecord, QueueState, Requirements,
};

/// One cached query per component the stages touch by entity.
pub struct Queries {
    archetypes: usize,
    command: QueryState<&'static Command>,
    edges: QueryState<&'static mut Edges>,
    execution: QueryState<&'static mut Execution>,
    requirements: QueryState<&'static mut Requirements>,
    record: QueryState<&'static mut MemoryRecord>,
    queue: QueryState<&'static mut QueueState>,
    list: QueryState<&'static mut FusionList>,
    in_fusion: QueryState<&'static InFusion>,
}

impl FromWorld for Queries {
    fn from_world(world: &mut World) -> Self {
        Self {
            archetypes: 0,
            command: world.query(),
            edges: world.query(),
            execution: world.query(),
            requirements: world.query(),
            record: world.query(),
            queue: world.query(),
            list: world.query(),
            in_fusion: world.query(),
        }
    }
}

macro_rules! access {
    ($get:ident, $get_mut:ident, $field:ident, $t:ty) => {
        /// The component of `e`, if it has one.
        #[inline]
        pub fn $get<'w>(&mut self, world: &'w World, e: Entity) -> Option<&'w $t> {
            self.$field.get_manual(world, e).ok()
        }
        /// The component of `e`, mutably.
        #[inline]
        pub fn $get_mut<'w>(&mut self, world: &'w mut World, e: Entity) -> Option<Mut<'w, $t>> {
            // SAFETY: `&mut World` is exclusive for 'w, and this query is its only
            // user while the returned borrow lives.
            unsafe { self.$field.query_unchecked_manual(world.as_unsafe_world_cell()).get_inner(e).ok() }
        }
    };
}

impl Queries {
    /// Brings the archetype caches up to date with `world` (free when no archetype was
    /// added since the last refresh).
    pub fn refresh(&mut self, world: &World) {
        let archetypes = world.archetypes().len();
        if archetypes == self.archetypes {
            return;
        }
        self.archetypes = archetypes;
        self.command.update_archetypes(world);
        self.edges.update_archetypes(world);
        self.execution.update_archetypes(world);
        self.requirements.update_archetypes(world);
        self.record.update_archetypes(world);
        self.queue.update_archetypes(world);
        self.list.update_archetypes(world);
        self.in_fusion.update_archetypes(world);
    }

    /// The command of `e`.
    #[inline]
    pub fn command<'w>(&mut self, world: &'w World, e: Entity) -> Option<&'w Command> {
        self.command.get_manual(world, e).ok()
    }
    access!(edges, edges_mut, edges, Edges);
    access!(execution, execution_mut, execution, Execution);
    access!(requirements, requirements_mut, requirements, Requirements);
    access!(record, record_mut, record, MemoryRecord);
    access!(queue, queue_mut, queue, QueueState);
    access!(list, list_mut, list, FusionList);

    /// The fusion list `e` belongs to (a listed kernel, the fused kernel or a
    /// cancelled list's marker).
    #[inline]
    pub fn in_fusion(&mut self, world: &World, e: Entity) -> Option<Entity> {
        self.in_fusion.get_manual(world, e).ok().map(|f| f.list)
    }
}
