//! The linearizers a [`GraphPolicy`](gantry_components::GraphPolicy) picks from
//! ([`ReverseDfs`], [`BreadthFirst`]) and the checks on the order one returns: that it
//! is topological, and else a node on a cycle.

use std::collections::VecDeque;

use gantry_components::{GraphNode, Linearizer, NodeId, NodeList};
use smallvec::SmallVec;

use super::Adjacency;

/// The SYCL graph extension's implementation design's default: reverse post-order of a
/// depth-first walk from the roots (in insertion order).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReverseDfs;

impl Linearizer for ReverseDfs {
    fn name(&self) -> &str {
        "reverse-dfs"
    }

    fn order(&self, preds: &[NodeList], succs: &[NodeList]) -> Vec<NodeId> {
        let n = preds.len();
        let mut visited = vec![false; n];
        let mut post = Vec::with_capacity(n);
        let mut stack: Vec<(NodeId, usize)> = Vec::new();
        for root in (0..n as NodeId).filter(|&i| preds[i as usize].is_empty()) {
            if visited[root as usize] {
                continue;
            }
            visited[root as usize] = true;
            stack.push((root, 0));
            while let Some((node, next)) = stack.last_mut() {
                let node = *node;
                match succs[node as usize].get(*next) {
                    Some(&s) => {
                        *next += 1;
                        if !visited[s as usize] {
                            visited[s as usize] = true;
                            stack.push((s, 0));
                        }
                    }
                    None => {
                        post.push(node);
                        stack.pop();
                    }
                }
            }
        }
        post.reverse();
        post
    }
}

/// Breadth-first (Kahn) order: a node as soon as all its predecessors are placed,
/// roots in insertion order. The alternative the SYCL graph extension's
/// implementation design names.
#[derive(Clone, Copy, Debug, Default)]
pub struct BreadthFirst;

impl Linearizer for BreadthFirst {
    fn name(&self) -> &str {
        "breadth-first"
    }

    fn order(&self, preds: &[NodeList], succs: &[NodeList]) -> Vec<NodeId> {
        let mut pending: Vec<usize> = preds.iter().map(|p| p.len()).collect();
        let mut queue: VecDeque<NodeId> =
            (0..preds.len() as NodeId).filter(|&i| pending[i as usize] == 0).collect();
        let mut order = Vec::with_capacity(preds.len());
        while let Some(n) = queue.pop_front() {
            order.push(n);
            for &s in &succs[n as usize] {
                pending[s as usize] -= 1;
                if pending[s as usize] == 0 {
                    queue.push_back(s);
                }
            }
        }
        order
    }
}

/// The successor lists of `nodes`.
pub(super) fn successors(nodes: &[GraphNode]) -> Adjacency {
    let mut succs: Adjacency = vec![SmallVec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        for &p in &n.preds {
            succs[p as usize].push(i as NodeId);
        }
    }
    succs
}

/// A node on a cycle, if the edges have one (Kahn's algorithm leaves it unplaced).
pub(super) fn find_cycle(preds: &Adjacency, succs: &Adjacency) -> Option<NodeId> {
    let order = BreadthFirst.order(preds, succs);
    if order.len() == preds.len() {
        return None;
    }
    let mut placed = vec![false; preds.len()];
    for n in order {
        placed[n as usize] = true;
    }
    placed.iter().position(|p| !p).map(|n| n as NodeId)
}

/// Checks that `order` is a topological order of every node.
pub(super) fn check_order(order: &[NodeId], preds: &Adjacency) -> Result<(), String> {
    if order.len() != preds.len() {
        return Err(format!("{} nodes ordered, the graph has {}", order.len(), preds.len()));
    }
    let mut pos = vec![usize::MAX; preds.len()];
    for (i, &n) in order.iter().enumerate() {
        match pos.get_mut(n as usize) {
            Some(p) if *p == usize::MAX => *p = i,
            _ => return Err(format!("node {n} is out of range or placed twice")),
        }
    }
    for (n, ps) in preds.iter().enumerate() {
        if let Some(p) = ps.iter().find(|&&p| pos[p as usize] > pos[n]) {
            return Err(format!("node {n} is placed before its predecessor {p}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::adjacency;

    #[test]
    fn linearizers_give_topological_orders() {
        // 0 → 1 → 3, 0 → 2 → 3, 4 alone.
        let (p, s) = adjacency(5, &[(0, 1), (0, 2), (1, 3), (2, 3)]);
        let dfs = ReverseDfs.order(&p, &s);
        let bfs = BreadthFirst.order(&p, &s);
        assert!(check_order(&dfs, &p).is_ok(), "{dfs:?}");
        assert!(check_order(&bfs, &p).is_ok(), "{bfs:?}");
        assert_eq!(bfs, vec![0, 4, 1, 2, 3]);
        assert_eq!(dfs, vec![4, 0, 2, 1, 3]);
        assert!(check_order(&[1, 0, 2, 3, 4], &p).is_err());
        assert!(check_order(&[0, 1, 2, 3], &p).is_err());
    }

    #[test]
    fn cycles_are_found() {
        let (p, s) = adjacency(3, &[(0, 1), (1, 2), (2, 1)]);
        assert!(find_cycle(&p, &s).is_some());
        let (p, s) = adjacency(3, &[(0, 1), (1, 2)]);
        assert_eq!(find_cycle(&p, &s), None);
    }
}
