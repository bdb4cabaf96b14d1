//! Partition assignment: the group numbers of the SYCL graph extension's implementation
//! design ([`assign_groups`]), the partitions built from them with their real
//! predecessors, and a graph's [`Layout`] (its linearization and partitions), which
//! recording reads.

use std::collections::VecDeque;
use std::sync::Arc;

use gantry_components::{ExecPlan, FinalizeError, FinalizeJob, GraphNode, NodeId};
use smallvec::SmallVec;

use super::linearize::{check_order, find_cycle, successors};
use super::{Adjacency, Finalize};

/// The SYCL graph extension's implementation design's partition annotation ("Graph
/// Partitioning", the worked examples): returns a group number per node; nodes with
/// equal numbers share a partition and groups run in increasing order. `isolated[n]`
/// marks host tasks; [`split_at_device_changes`] then separates the devices in a group.
///
/// Isolated nodes are processed in insertion order. For each, its predecessors
/// (upwards, stopping at isolated nodes and at nodes already in a lower group) take a
/// new group, the node takes the next, and its successors (downwards, stopping at
/// isolated nodes) the one after. A successor walk that reaches an isolated node
/// already processed (possible only through a `make_edge` back edge) queues it again
/// at the front, and the predecessors of the node just processed are merged into the
/// group of that node's predecessors, so both feed it together.
///
/// Unlike that design's recursive version, the walks are iterative (no stack overflow on
/// long chains), the downward walk visits each node once per pass, and a node is
/// queued again only once at a time.
pub fn assign_groups(preds: &Adjacency, succs: &Adjacency, isolated: &[bool]) -> Vec<i64> {
    let n = preds.len();
    let mut group = vec![-1i64; n];
    let mut queue: VecDeque<NodeId> = (0..n as NodeId).filter(|&i| isolated[i as usize]).collect();
    let mut current = -1i64;
    let mut seen = vec![u64::MAX; n];
    let mut pass = 0u64;
    let mut stack: Vec<NodeId> = Vec::new();
    while let Some(ht) = queue.pop_front() {
        let h = ht as usize;
        current += 1;
        stack.extend(preds[h].iter().copied());
        while let Some(x) = stack.pop() {
            let x = x as usize;
            if isolated[x] || (group[x] != -1 && group[x] <= current) {
                continue;
            }
            group[x] = current;
            stack.extend(preds[x].iter().copied());
        }
        current += 1;
        group[h] = current;
        current += 1;
        pass += 1;
        let queued_before = queue.len();
        stack.extend(succs[h].iter().copied());
        while let Some(x) = stack.pop() {
            let xi = x as usize;
            if seen[xi] == pass {
                continue;
            }
            seen[xi] = pass;
            if isolated[xi] {
                if group[xi] != -1 && !queue.contains(&x) {
                    queue.push_front(x);
                }
                continue;
            }
            group[xi] = current;
            stack.extend(succs[xi].iter().copied());
        }
        if queue.len() > queued_before {
            // Merge: this node's predecessors join the group of the predecessors of
            // each already-processed node it reached (which runs again).
            let from = group[h] - 1;
            for &other in queue.iter() {
                let g = group[other as usize];
                if g == -1 {
                    break;
                }
                for x in group.iter_mut() {
                    if *x == from {
                        *x = g - 1;
                    }
                }
            }
        }
    }
    group
}

/// Partitions of contiguous runs of `order`, split around isolated nodes: the
/// fallback when group merging produced partitions that depend on each other both
/// ways (the SYCL graph extension's implementation design leaves that case open).
fn contiguous_groups(order: &[NodeId], isolated: &[bool]) -> Vec<i64> {
    let mut group = vec![0i64; order.len()];
    let (mut g, mut open) = (0i64, false);
    for &n in order {
        if isolated[n as usize] {
            g += i64::from(open);
            group[n as usize] = g;
            g += 1;
            open = false;
        } else {
            group[n as usize] = g;
            open = true;
        }
    }
    group
}

/// Group numbers with each group split where the device changes along `order`: a
/// group's nodes, taken in the linearization, form runs of one device, and each run
/// becomes a group of its own (numbered after the group, then the run), so a partition
/// is one device's command buffer. Edges inside a group go forward in `order`, so they
/// go from a run to the same or a later one: the split adds no cycle between
/// partitions. Returns dense numbers in the same relative order.
pub fn split_at_device_changes(group: &[i64], order: &[NodeId], device: impl Fn(NodeId) -> u32) -> Vec<i64> {
    // Per group: the device of its last node seen and its run count so far.
    let mut last: rustc_hash::FxHashMap<i64, (u32, u32)> = rustc_hash::FxHashMap::default();
    let mut keyed = vec![(0i64, 0u32); group.len()];
    for &n in order {
        let (g, d) = (group[n as usize], device(n));
        let run = match last.get_mut(&g) {
            Some((seen, run)) => {
                if *seen != d {
                    *seen = d;
                    *run += 1;
                }
                *run
            }
            None => {
                last.insert(g, (d, 0));
                0
            }
        };
        keyed[n as usize] = (g, run);
    }
    let mut keys = keyed.clone();
    keys.sort_unstable();
    keys.dedup();
    keyed.iter().map(|k| keys.binary_search(k).expect("a key") as i64).collect()
}

/// Partitions built from group numbers.
struct Partitions {
    /// Each partition's nodes, in execution order.
    members: Vec<Vec<NodeId>>,
    /// Each partition's predecessor partitions.
    preds: Vec<SmallVec<[u32; 2]>>,
    /// The partition of each node.
    part_of: Vec<u32>,
}

/// Partitions from group numbers: nodes grouped by number (in increasing order), each
/// partition's nodes in `order`; then the partitions' predecessors. `None` if the
/// partitions depend on each other in a cycle.
fn build_partitions(group: &[i64], order: &[NodeId], preds: &Adjacency) -> Option<Partitions> {
    let mut numbers: Vec<i64> = group.to_vec();
    numbers.sort_unstable();
    numbers.dedup();
    let count = numbers.len();
    let mut part_of: Vec<u32> =
        group.iter().map(|g| numbers.binary_search(g).expect("a group number") as u32).collect();
    let mut part_preds: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); count];
    for (n, ps) in preds.iter().enumerate() {
        for &p in ps {
            let (a, b) = (part_of[p as usize], part_of[n]);
            if a != b && !part_preds[b as usize].contains(&a) {
                part_preds[b as usize].push(a);
            }
        }
    }
    // Topological order of the partitions, stable by group number.
    let mut succ: Vec<Vec<u32>> = vec![Vec::new(); count];
    let mut pending: Vec<usize> = part_preds.iter().map(|p| p.len()).collect();
    for (b, ps) in part_preds.iter().enumerate() {
        for &a in ps {
            succ[a as usize].push(b as u32);
        }
    }
    let mut ready: std::collections::BTreeSet<u32> =
        (0..count as u32).filter(|&p| pending[p as usize] == 0).collect();
    let mut rank = vec![u32::MAX; count];
    let mut next = 0u32;
    while let Some(p) = ready.pop_first() {
        rank[p as usize] = next;
        next += 1;
        for &s in &succ[p as usize] {
            pending[s as usize] -= 1;
            if pending[s as usize] == 0 {
                ready.insert(s);
            }
        }
    }
    if (next as usize) < count {
        return None;
    }
    for p in part_of.iter_mut() {
        *p = rank[*p as usize];
    }
    let mut parts: Vec<Vec<NodeId>> = vec![Vec::new(); count];
    for &n in order {
        parts[part_of[n as usize] as usize].push(n);
    }
    let mut ranked_preds: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); count];
    for (old, ps) in part_preds.into_iter().enumerate() {
        let mut ps: SmallVec<[u32; 2]> = ps.into_iter().map(|p| rank[p as usize]).collect();
        ps.sort_unstable();
        ranked_preds[rank[old] as usize] = ps;
    }
    Some(Partitions { members: parts, preds: ranked_preds, part_of })
}

/// Whether `nodes` (in order) form one path: each depends on the one before, and on
/// nothing else inside the partition.
fn is_single_path(nodes: &[NodeId], preds: &Adjacency, part_of: &[u32]) -> bool {
    nodes.windows(2).all(|w| {
        let mut inside =
            preds[w[1] as usize].iter().filter(|&&p| part_of[p as usize] == part_of[w[1] as usize]);
        inside.next() == Some(&w[0]) && inside.next().is_none()
    })
}

/// A partition laid out but not recorded yet.
pub(super) struct Laid {
    pub(super) name: Arc<str>,
    pub(super) nodes: Vec<NodeId>,
    pub(super) preds: SmallVec<[u32; 2]>,
    pub(super) in_order: bool,
}

/// Where every node runs, before anything is recorded.
pub(super) struct Layout {
    /// The linearization.
    pub(super) order: Vec<NodeId>,
    /// The partition of each node.
    pub(super) part_of: Vec<u32>,
    /// The partitions, dependencies first.
    pub(super) parts: Vec<Laid>,
}

impl Layout {
    /// The layout of an earlier plan (see [`FinalizeJob::reuse`]).
    pub(super) fn of(plan: &ExecPlan) -> Self {
        let parts = plan
            .partitions
            .iter()
            .map(|p| Laid {
                name: p.name.clone(),
                nodes: p.nodes.clone(),
                preds: p.preds.clone(),
                in_order: p.in_order,
            })
            .collect();
        Layout { order: plan.order.clone(), part_of: plan.partition_of.clone(), parts }
    }
}

impl Finalize<'_> {
    /// Linearizes the nodes and assigns partitions.
    pub(super) fn layout(&self, job: &FinalizeJob) -> Result<Layout, FinalizeError> {
        let nodes = &job.nodes;
        let preds: Adjacency = nodes.iter().map(|n| n.preds.clone()).collect();
        let succs = successors(nodes);
        let order = self.linearizer.order(&preds, &succs);
        if let Err(why) = check_order(&order, &preds) {
            // No order is valid on a cycle: name a node on it; otherwise the policy erred.
            return Err(match find_cycle(&preds, &succs) {
                Some(node) => FinalizeError::Cycle { node },
                None => FinalizeError::BadOrder { policy: self.linearizer.name().to_string(), why },
            });
        }
        let records_host_tasks = |n: &GraphNode| {
            self.devices.get(n.device as usize).is_some_and(|(_, info)| info.caps.records_host_tasks)
        };
        let isolated: Vec<bool> = nodes.iter().map(|n| n.is_isolated(records_host_tasks(n))).collect();
        let device = |n: NodeId| nodes[n as usize].device;
        let groups = split_at_device_changes(&assign_groups(&preds, &succs, &isolated), &order, device);
        let Partitions { members, preds: part_preds, part_of } =
            match build_partitions(&groups, &order, &preds) {
                Some(p) => p,
                None => {
                    tracing::warn!(
                        "graph partitions formed a cycle after group merging; using contiguous partitions"
                    );
                    let contiguous = contiguous_groups(&order, &isolated);
                    build_partitions(&split_at_device_changes(&contiguous, &order, device), &order, &preds)
                        .expect("contiguous partitions of a topological order are acyclic")
                }
            };
        let parts = members
            .into_iter()
            .zip(part_preds)
            .enumerate()
            .map(|(p, (nodes, preds_of))| Laid {
                name: format!("partition {p}").into(),
                in_order: is_single_path(&nodes, &preds, &part_of),
                nodes,
                preds: preds_of,
            })
            .collect();
        Ok(Layout { order, part_of, parts })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::adjacency;

    /// Normalizes group numbers to partition indexes in increasing order.
    fn partitions(groups: &[i64]) -> Vec<u32> {
        let mut g: Vec<i64> = groups.to_vec();
        g.sort_unstable();
        g.dedup();
        groups.iter().map(|x| g.iter().position(|y| y == x).unwrap() as u32).collect()
    }

    #[test]
    fn a_host_task_splits_before_itself_and_after() {
        // A → B → HT → C → D, E → HT
        let (p, s) = adjacency(6, &[(0, 1), (1, 2), (2, 3), (3, 4), (5, 2)]);
        let iso = [false, false, true, false, false, false];
        assert_eq!(partitions(&assign_groups(&p, &s, &iso)), vec![0, 0, 1, 2, 2, 0]);
    }

    #[test]
    fn contiguous_fallback_splits_around_isolated_nodes() {
        let iso = [false, true, false, false];
        let g = contiguous_groups(&[0, 1, 2, 3], &iso);
        assert_eq!(partitions(&g), vec![0, 1, 2, 2]);
    }

    #[test]
    fn a_group_splits_where_the_device_changes_and_stays_whole_on_one_device() {
        // One group: A(dev 1) → B(dev 1) → C(dev 0) → D(dev 1), E(dev 1) alone; a
        // second group F(dev 1) → G(dev 1).
        let group = [0, 0, 0, 0, 0, 3, 3];
        let device = [1, 1, 0, 1, 1, 1, 1];
        let order = [0, 1, 2, 3, 4, 5, 6];
        let split = split_at_device_changes(&group, &order, |n| device[n as usize]);
        assert_eq!(partitions(&split), vec![0, 0, 1, 2, 2, 3, 3]);
        // A whole group on a device other than the graph's is one partition.
        let same = split_at_device_changes(&[0, 0, 0], &[0, 1, 2], |_| 1);
        assert_eq!(partitions(&same), vec![0, 0, 0]);
        // Runs follow the linearization, not the node numbers.
        let reordered = split_at_device_changes(&[0, 0, 0], &[2, 0, 1], |n| [0, 0, 1][n as usize]);
        assert_eq!(partitions(&reordered), vec![1, 1, 0]);
    }
}
