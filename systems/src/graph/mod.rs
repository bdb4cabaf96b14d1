//! The **partition** stage: finalizes command graphs (the SYCL graph extension's
//! implementation design, "Graph Partitioning"). For each finalize request it
//!
//! 1. checks the edges for cycles and linearizes the nodes with the
//!    [`GraphPolicy`]'s [`Linearizer`] ([`ReverseDfs`] by default, [`BreadthFirst`]
//!    to compare);
//! 2. assigns partitions with that design's two-step algorithm ([`assign_groups`]): host
//!    tasks are isolated, their predecessors and successors grouped around them, and
//!    groups merged when a `make_edge` back edge reaches a host task that was already
//!    processed; then each group is split where the device changes
//!    ([`split_at_device_changes`]), so a partition is one device's command buffer;
//! 3. tracks each partition's real predecessors, so independent roots run
//!    concurrently, and marks single-path partitions in-order;
//! 4. with the fusion property, fuses kernel chains inside each partition through the
//!    fusion compiler ([`fusion_chains`]);
//! 5. records one driver command buffer per partition over an argument table of the
//!    buffers it uses.
//!
//! One file per step: `linearize.rs` (the linearizers and the cycle check),
//! `partition.rs` (partition assignment and the layout), `chains.rs` (graph fusion),
//! `record.rs` (recording partitions into command buffers) and `patch.rs`
//! (whole-graph updates that patch a plan instead of recording it).

mod chains;
mod linearize;
mod partition;
mod patch;
mod record;

use std::sync::Arc;

use bevy_ecs::world::World;
use gantry_components::{
    Compilers, Devices, ExecPlan, FinalizeError, FinalizeJob, Finalizing, Fusions, GraphPolicy, Linearizer,
    NodeList, SchedulerConfig, WorkLists,
};
use gantry_driver::{DeviceInfo, Driver};

pub use chains::fusion_chains;
pub use linearize::{BreadthFirst, ReverseDfs};
pub use partition::{assign_groups, split_at_device_changes};
pub use patch::{check_topology, patch_plan, PatchOutcome};

use partition::Layout;

type Adjacency = Vec<NodeList>;

/// The partition stage system: serves every finalize request of this flush.
pub fn partition(world: &mut World) {
    let jobs = std::mem::take(&mut world.resource_mut::<WorkLists>().finalize);
    for e in jobs {
        let Some(job) = world.get::<Finalizing>(e).map(|f| f.0.clone()) else { continue };
        world.despawn(e);
        let result = {
            let devices: Vec<(Arc<dyn Driver>, DeviceInfo)> =
                world.resource::<Devices>().0.iter().map(|d| (d.driver.clone(), d.info.clone())).collect();
            let linearizer = world.resource::<GraphPolicy>().linearizer.clone();
            let fusions = world.resource::<Fusions>();
            let ctx = Finalize {
                devices: &devices,
                linearizer: &*linearizer,
                compilers: &fusions.compilers,
                thresholds: &fusions.thresholds,
                warnings: &fusions.warnings,
            };
            // The linearizer and the fusion compiler may be user code: a panic in
            // them fails this finalize only.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.run(&job)))
                .unwrap_or_else(|p| Err(FinalizeError::Panicked(gantry_driver::panic_message(&*p))))
        };
        *job.result.lock() = Some(result);
        let now = world.resource::<SchedulerConfig>().clock.stamp_ns();
        job.event.finish(Ok(()), now, now);
    }
}

/// What finalizing reads from the world.
struct Finalize<'a> {
    devices: &'a [(Arc<dyn Driver>, DeviceInfo)],
    linearizer: &'a dyn Linearizer,
    compilers: &'a [Compilers],
    /// From which size fusing pays, per device ([`Fusions::thresholds`]).
    thresholds: &'a [gantry_driver::fusion::WindowThresholds],
    warnings: &'a std::sync::atomic::AtomicUsize,
}

impl Finalize<'_> {
    fn run(&self, job: &FinalizeJob) -> Result<ExecPlan, FinalizeError> {
        let layout = match &job.reuse {
            // The update that sent it checked the topology, devices and properties,
            // and tried `patch_plan` first.
            Some(plan) => {
                debug_assert_eq!(plan.nodes.len(), job.nodes.len(), "a reused layout has the job's nodes");
                Layout::of(plan)
            }
            _ => self.layout(job)?,
        };
        self.record_all(job, layout)
    }
}

/// The predecessor and successor lists of `n` nodes joined by `edges` (the graphs of
/// the linearizer and partition tests).
#[cfg(test)]
fn adjacency(
    n: usize,
    edges: &[(gantry_components::NodeId, gantry_components::NodeId)],
) -> (Adjacency, Adjacency) {
    let mut preds: Adjacency = vec![smallvec::SmallVec::new(); n];
    let mut succs: Adjacency = vec![smallvec::SmallVec::new(); n];
    for &(a, b) in edges {
        preds[b as usize].push(a);
        succs[a as usize].push(b);
    }
    (preds, succs)
}
