//! Graph fusion: a partition's kernel chains ([`fusion_chains`]), fused through the
//! fusion compiler into the partition's steps.

use std::borrow::Cow;

use gantry_components::{
    fuse_with, warn_fusion, CommandKind, ExecPlan, FusedChain, GraphNode, NodeId, NodeUse, NodeWork,
    NotFused, Requirement,
};
use gantry_driver::fusion::{FusionError, FusionKernel, FusionRequest, Promotion};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::record::{Step, StepOp};
use super::Finalize;
use crate::fusion::{fused_requirements, fusion_arg};

/// Groups a partition's kernels into chains to fuse (in execution order). A copy,
/// fill or empty node that depends on a chain's kernel and that a later kernel
/// depends on ends the chain; one that does not depend on the chain is moved before
/// it. Returns the chains and, per chain end, why it ended early.
pub fn fusion_chains(nodes: &[NodeId], graph: &[GraphNode]) -> (Vec<Vec<NodeId>>, Vec<NotFused>) {
    let mut chains: Vec<Vec<NodeId>> = Vec::new();
    let mut why = Vec::new();
    let mut current: Vec<NodeId> = Vec::new();
    let mut after: FxHashMap<NodeId, bool> = FxHashMap::default();
    for &n in nodes {
        let node = &graph[n as usize];
        let in_chain = |p: &NodeId| current.contains(p);
        let depends_on_chain =
            node.preds.iter().any(|p| in_chain(p) || after.get(p).copied().unwrap_or(false));
        // Kernels with dynamic parameters stay unfused (their arguments change).
        if node.kind == CommandKind::Kernel && node.params.is_empty() {
            let through_other = node.preds.iter().find(|p| after.get(p).copied().unwrap_or(false));
            if let Some(&other) = through_other {
                why.push(NotFused::OrderedBetween {
                    between: graph[other as usize].name.to_string(),
                    first: graph[current[0] as usize].name.to_string(),
                    kernel: node.name.to_string(),
                });
                chains.push(std::mem::take(&mut current));
                after.clear();
            }
            current.push(n);
        } else {
            if node.kind == CommandKind::Kernel {
                why.push(NotFused::DynamicParameters { node: n, kernel: node.name.to_string() });
            }
            after.insert(n, depends_on_chain);
        }
    }
    chains.push(current);
    chains.retain(|c| c.len() > 1);
    (chains, why)
}

/// The bytes of global memory a chain's requirements span (each byte of a buffer
/// counted once, however many kernels use it), and whether any of them is promoted:
/// what [`WindowThresholds::judge_chain`](gantry_driver::fusion::WindowThresholds::judge_chain)
/// weighs.
pub(super) fn chain_memory(reqs: &[Vec<Requirement>]) -> (u64, bool) {
    let promotes = reqs.iter().flatten().any(|r| r.promotion != Promotion::None);
    let mut ranges: Vec<(u64, usize, usize)> =
        reqs.iter().flatten().map(|r| (r.buffer.id, r.range.start, r.range.end)).collect();
    ranges.sort_unstable();
    let mut footprint = 0u64;
    // The buffer last counted and the end of its bytes counted so far: sorted, a
    // range adds only its bytes past that end.
    let mut counted: Option<(u64, usize)> = None;
    for (buffer, start, end) in ranges {
        let covered = counted.filter(|&(b, _)| b == buffer).map_or(0, |(_, e)| e);
        footprint += end.saturating_sub(start.max(covered)) as u64;
        counted = Some((buffer, end.max(covered)));
    }
    (footprint, promotes)
}

impl Finalize<'_> {
    /// The steps of a partition with kernel chains fused (into `steps`, which is
    /// empty).
    pub(super) fn fused_steps<'a>(
        &self,
        members: &[NodeId],
        nodes: &'a [GraphNode],
        barriers: bool,
        plan: &mut ExecPlan,
        steps: &mut Vec<Step<'a>>,
        node_step: impl Fn(NodeId) -> Step<'a>,
    ) {
        // Which chain (by index) each fused node belongs to.
        let mut chain_of: FxHashMap<NodeId, usize> = FxHashMap::default();
        // The fused steps (their `nodes` are the chain), until emitted.
        let mut fused: Vec<Option<Step<'a>>> = Vec::new();
        let (chains, why) = fusion_chains(members, nodes);
        for w in why {
            warn_fusion(self.warnings, format_args!("graph fusion: chain not fused further: {w}"));
            plan.not_fused.push(w);
        }
        for chain in chains {
            match self.fuse(&chain, nodes, barriers) {
                Ok((step, chain_info)) => {
                    for &n in &chain {
                        chain_of.insert(n, fused.len());
                    }
                    fused.push(Some(step));
                    plan.fused.push(chain_info);
                }
                Err(why) => {
                    warn_fusion(self.warnings, format_args!("graph fusion: {why}"));
                    plan.not_fused.push(*why);
                }
            }
        }

        // Emit in order: a fused chain at its last kernel; a node that depends on
        // chains not emitted yet waits until all of them are (then in order).
        let mut depends_on: FxHashMap<NodeId, SmallVec<[usize; 2]>> = FxHashMap::default();
        for &n in members {
            if chain_of.contains_key(&n) {
                continue;
            }
            let mut chains: SmallVec<[usize; 2]> = SmallVec::new();
            for p in &nodes[n as usize].preds {
                let via: SmallVec<[usize; 2]> = match chain_of.get(p) {
                    Some(&c) => smallvec::smallvec![c],
                    None => depends_on.get(p).cloned().unwrap_or_default(),
                };
                for c in via {
                    if !chains.contains(&c) {
                        chains.push(c);
                    }
                }
            }
            if !chains.is_empty() {
                depends_on.insert(n, chains);
            }
        }
        let mut pending: Vec<NodeId> = Vec::new();
        let last_of: Vec<NodeId> =
            fused.iter().map(|f| *f.as_ref().expect("chain").nodes.last().expect("kernel")).collect();
        let mut emitted = vec![false; fused.len()];
        let ready =
            |n: &NodeId, emitted: &[bool]| depends_on.get(n).is_none_or(|cs| cs.iter().all(|&c| emitted[c]));
        for &n in members {
            if let Some(&c) = chain_of.get(&n) {
                if n == last_of[c] {
                    let step = fused[c].take().expect("chain emitted once");
                    steps.push(step);
                    emitted[c] = true;
                    // Waiting nodes whose chains are all out now follow, in order (a
                    // waiting node's own waiting predecessors wait for a subset).
                    let waiting = std::mem::take(&mut pending);
                    for d in waiting {
                        if ready(&d, &emitted) {
                            steps.push(node_step(d));
                        } else {
                            pending.push(d);
                        }
                    }
                }
                continue;
            }
            if ready(&n, &emitted) {
                steps.push(node_step(n));
            } else {
                pending.push(n);
            }
        }
        // Every chain is emitted at its last kernel, so nothing is left waiting; should
        // a node be, it still runs (the driver checks its sync points).
        steps.extend(pending.into_iter().map(node_step));
    }

    /// Fuses one chain through the fusion compiler.
    fn fuse(
        &self,
        chain: &[NodeId],
        nodes: &[GraphNode],
        barriers: bool,
    ) -> Result<(Step<'static>, FusedChain), Box<NotFused>> {
        // The fusion rules read requirements (placed nowhere: no resolution state).
        let reqs: Vec<Vec<Requirement>> = chain
            .iter()
            .map(|&n| nodes[n as usize].uses.iter().map(NodeUse::requirement).collect())
            .collect();
        let device = nodes[chain[0] as usize].device as usize;
        let refused = |reason| {
            Box::new(NotFused::Refused {
                nodes: chain.to_vec(),
                kernels: chain.iter().map(|&n| nodes[n as usize].name.to_string()).collect(),
                reason,
            })
        };
        // Judged before the compilers see it: a chain fusing would not speed up costs
        // no fusion request.
        let (footprint, promotes) = chain_memory(&reqs);
        if let Some(reason) = self.thresholds[device].judge_chain(footprint, promotes) {
            let kernel = nodes[chain[0] as usize].name.to_string();
            return Err(refused(FusionError::Unprofitable { kernel, reason }));
        }
        let mut request = FusionRequest { kernels: Vec::with_capacity(chain.len()), barriers };
        for (i, (&n, reqs)) in chain.iter().zip(&reqs).enumerate() {
            let node = &nodes[n as usize];
            let NodeWork::Kernel { kernel, geometry, scalars } = &node.work else {
                return Err(Box::new(NotFused::NotAKernel { node: n, name: node.name.to_string() }));
            };
            let args = reqs.iter().map(fusion_arg).collect();
            // Its predecessors in the chain (a chain has no path between its kernels
            // through other nodes: `fusion_chains` ends it before one).
            let earlier = &chain[..i];
            let deps = node
                .preds
                .iter()
                .filter_map(|p| earlier.iter().position(|e| e == p).map(|j| j as u32))
                .collect();
            request.kernels.push(FusionKernel {
                kernel: kernel.clone(),
                geometry: *geometry,
                args,
                deps,
                scalars: scalars.clone(),
            });
        }
        let fused =
            fuse_with(&self.compilers[device], &self.devices[device].1.name, &request).map_err(refused)?;
        let reqs: Vec<&[Requirement]> = reqs.iter().map(|r| &r[..]).collect();
        let uses = fused_requirements(&fused, &reqs).into_iter().map(NodeUse::from).collect();
        let info =
            FusedChain { nodes: chain.to_vec(), name: fused.kernel.name.clone(), warnings: fused.warnings };
        let step = Step {
            nodes: chain.iter().copied().collect(),
            uses: Cow::Owned(uses),
            params: &[],
            op: StepOp::Fused { kernel: fused.kernel, geometry: fused.geometry, scalars: fused.scalars },
            deps: SmallVec::new(),
        };
        Ok((step, info))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gantry_components::{BufferCore, ByteRange};
    use gantry_driver::AccessMode;

    use super::*;
    use crate::testing::Harness;

    /// A chain's footprint counts each byte of a buffer once, whichever kernels read
    /// or write it, and adds disjoint buffers and ranges; any promoted accessor marks
    /// the chain as promoting.
    #[test]
    fn a_chain_spans_each_byte_once() {
        let h = Harness::new(false);
        let buffer = |id| Arc::new(BufferCore { id, ..Arc::into_inner(h.buffer(4096)).unwrap() });
        let (a, b, c) = (buffer(1), buffer(2), buffer(3));
        let req = |buf: &Arc<BufferCore>, mode, start, end| {
            Requirement::new(buf.clone(), mode, ByteRange { start, end })
        };
        // a → b → c over 1 KiB each, then a kernel reading b's second half and a's
        // bytes 512..2048 (overlapping a's first use).
        let mut chain = vec![
            vec![req(&a, AccessMode::Read, 0, 1024), req(&b, AccessMode::DiscardWrite, 0, 1024)],
            vec![req(&b, AccessMode::Read, 0, 1024), req(&c, AccessMode::DiscardWrite, 0, 1024)],
            vec![req(&b, AccessMode::Read, 512, 1024), req(&a, AccessMode::ReadWrite, 512, 2048)],
        ];
        assert_eq!(chain_memory(&chain), (2048 + 1024 + 1024, false));
        // A disjoint range of c counts on its own.
        chain[1].push(req(&c, AccessMode::Read, 3072, 4096));
        assert_eq!(chain_memory(&chain), (2048 + 1024 + 2048, false));
        chain[0][1].promotion = Promotion::Private;
        assert_eq!(chain_memory(&chain), (2048 + 1024 + 2048, true));
    }
}
