//! Where a recorded command buffer needs pipeline barriers, as data: one barrier
//! before an operation exactly where it depends (directly or through other
//! operations) on an earlier one whose buffer ranges conflict with its own, and
//! none between independent operations or operations that only read the same
//! bytes.
//!
//! The masks follow the read/write relation of the two operations' overlapping
//! ranges, as wgpu-core's tracker derives them: read after write makes the write
//! available and visible to the read (`src` access = the writer's write access,
//! `dst` = the reader's read access); write after write likewise for the second
//! write; write after read needs only an execution dependency (no access masks).
//! A kernel works in the compute-shader stage with shader reads and writes, a copy,
//! fill or memory buffer read/write in the transfer stage with transfer reads and
//! writes. A barrier before operation `j` orders everything recorded before it, so
//! a conflict is already covered where an earlier barrier between the two has
//! masks that contain its own; all of `j`'s uncovered conflicts share one barrier.

use ash::vk;
use gantry_driver::{Plan, RecordedArg, RecordedOp};

/// A pipeline barrier recorded before operation `before` of a plan: a global
/// memory barrier with these masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Barrier {
    /// The index of the operation it precedes.
    pub before: u32,
    /// Stages of the earlier operations it waits for.
    pub src_stage: vk::PipelineStageFlags,
    /// Stages of the operation it holds back.
    pub dst_stage: vk::PipelineStageFlags,
    /// Writes it makes available (empty for write-after-read).
    pub src_access: vk::AccessFlags,
    /// Accesses it makes them visible to (empty for write-after-read).
    pub dst_access: vk::AccessFlags,
}

/// The kind of hazard between an earlier and a later access of the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hazard {
    /// Read after write.
    Raw,
    /// Write after read.
    War,
    /// Write after write.
    Waw,
}

/// The pipeline stage and the read and write access of an operation.
fn stage_of(op: &RecordedOp) -> (vk::PipelineStageFlags, vk::AccessFlags, vk::AccessFlags) {
    match op {
        RecordedOp::Kernel { .. } => (
            vk::PipelineStageFlags::COMPUTE_SHADER,
            vk::AccessFlags::SHADER_READ,
            vk::AccessFlags::SHADER_WRITE,
        ),
        _ => (
            vk::PipelineStageFlags::TRANSFER,
            vk::AccessFlags::TRANSFER_READ,
            vk::AccessFlags::TRANSFER_WRITE,
        ),
    }
}

/// Each argument of `op` with whether it reads and whether it writes (a copy
/// reads its source and writes its destination whatever their recorded modes).
fn accesses(op: &RecordedOp) -> Vec<(RecordedArg, bool, bool)> {
    let mode = |a: &RecordedArg| (*a, a.mode.reads(), a.mode.writes());
    match op {
        RecordedOp::Kernel { args, .. } => args.iter().map(mode).collect(),
        RecordedOp::Copy { src, dst } => vec![(*src, true, false), (*dst, false, true)],
        RecordedOp::Write { dst, .. } | RecordedOp::Fill { dst, .. } => vec![(*dst, false, true)],
        RecordedOp::Read { src, .. } => vec![(*src, true, false)],
        // (Host tasks are refused when recorded.)
        RecordedOp::Marker | RecordedOp::HostTask { .. } => Vec::new(),
    }
}

/// The hazards between an earlier operation's accesses `a` and a later one's `b`
/// (at most one of each kind).
fn hazards(a: &[(RecordedArg, bool, bool)], b: &[(RecordedArg, bool, bool)]) -> [bool; 3] {
    let mut found = [false; 3];
    for (x, xr, xw) in a {
        for (y, yr, yw) in b {
            let overlap = x.entry == y.entry && x.offset < y.offset + y.len && y.offset < x.offset + x.len;
            if !overlap {
                continue;
            }
            found[0] |= *xw && *yr;
            found[1] |= *xr && *yw;
            found[2] |= *xw && *yw;
        }
    }
    found
}

/// The barriers `plan` needs (see the module docs), in operation order.
pub(crate) fn plan_barriers(plan: &Plan) -> Vec<Barrier> {
    // ancestors[j]: the operations `j` depends on, directly or not, as a bit set
    // only as long as its highest member needs (empty where it depends on none).
    let mut ancestors: Vec<Vec<u64>> = Vec::with_capacity(plan.ops.len());
    let info: Vec<_> = plan.ops.iter().map(|p| (stage_of(&p.op), accesses(&p.op))).collect();
    let mut barriers: Vec<Barrier> = Vec::new();
    for (j, planned) in plan.ops.iter().enumerate() {
        let mut mine: Vec<u64> = Vec::new();
        for &d in &planned.deps {
            let d = d as usize;
            if d >= j {
                continue; // the builder allows only earlier operations
            }
            let words = ancestors[d].len().max(d / 64 + 1);
            if mine.len() < words {
                mine.resize(words, 0);
            }
            mine[d / 64] |= 1 << (d % 64);
            for (w, a) in mine.iter_mut().zip(&ancestors[d]) {
                *w |= a;
            }
        }
        let ((stage_j, read_j, write_j), access_j) = &info[j];
        let mut needed: Option<Barrier> = None;
        if !access_j.is_empty() {
            let members = mine.iter().enumerate().flat_map(|(w, &bits)| {
                (0..64).filter(move |b| bits & (1 << b) != 0).map(move |b| w * 64 + b)
            });
            for i in members {
                let ((stage_i, _, write_i), access_i) = &info[i];
                let [raw, war, waw] = hazards(access_i, access_j);
                if !(raw || war || waw) {
                    continue;
                }
                let mut src_access = vk::AccessFlags::empty();
                let mut dst_access = vk::AccessFlags::empty();
                if raw {
                    src_access |= *write_i;
                    dst_access |= *read_j;
                }
                if waw {
                    src_access |= *write_i;
                    dst_access |= *write_j;
                }
                let want = Barrier {
                    before: j as u32,
                    src_stage: *stage_i,
                    dst_stage: *stage_j,
                    src_access,
                    dst_access,
                };
                let covered =
                    barriers.iter().rev().take_while(|b| b.before as usize > i).any(|b| contains(b, &want));
                if !covered {
                    needed = Some(match needed {
                        None => want,
                        Some(b) => Barrier {
                            before: b.before,
                            src_stage: b.src_stage | want.src_stage,
                            dst_stage: b.dst_stage | want.dst_stage,
                            src_access: b.src_access | want.src_access,
                            dst_access: b.dst_access | want.dst_access,
                        },
                    });
                }
            }
        }
        barriers.extend(needed);
        ancestors.push(mine);
    }
    barriers
}

/// Whether barrier `b` orders everything `want` asks for.
fn contains(b: &Barrier, want: &Barrier) -> bool {
    b.src_stage.contains(want.src_stage)
        && b.dst_stage.contains(want.dst_stage)
        && b.src_access.contains(want.src_access)
        && b.dst_access.contains(want.dst_access)
}

impl Barrier {
    /// The kinds of hazard it orders, read back from its masks (for tests and
    /// traces): read after write where it makes writes visible to reads, write after
    /// write where to writes, write after read where it has no access masks.
    pub fn hazards(&self) -> Vec<Hazard> {
        let b = self;
        let mut out = Vec::new();
        let reads = vk::AccessFlags::SHADER_READ | vk::AccessFlags::TRANSFER_READ;
        let writes = vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE;
        if b.dst_access.intersects(reads) {
            out.push(Hazard::Raw);
        }
        if b.dst_access.intersects(writes) {
            out.push(Hazard::Waw);
        }
        if b.src_access.is_empty() {
            out.push(Hazard::War);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::{
        AccessMode::{self, *},
        CommandBufferBuilder, CommandBufferDesc, Geometry, Kernel, PlanBuilder, Range, Signature, SyncPoint,
    };
    use std::sync::Arc;

    fn arg(entry: u32, offset: usize, len: usize, mode: AccessMode) -> RecordedArg {
        RecordedArg { entry, offset, len, mode }
    }

    fn kernel(args: &[RecordedArg]) -> RecordedOp {
        let sig = args.iter().fold(Signature::new(), |s, a| s.global(a.mode));
        RecordedOp::Kernel {
            kernel: Kernel::new("k", sig).into_ref(),
            geometry: Geometry::for_range(Range::d1(64)).unwrap(),
            args: args.iter().copied().collect(),
            scalars: Default::default(),
        }
    }

    fn plan(ops: Vec<(RecordedOp, &[u32])>) -> Plan {
        let desc = CommandBufferDesc { entries: 4, in_order: false, ops: ops.len() };
        let mut b = PlanBuilder::new(desc, "test".into(), |_| true, |p| Arc::new(p));
        for (op, deps) in ops {
            let deps: Vec<SyncPoint> = deps.iter().map(|&d| SyncPoint(d)).collect();
            b.append(op, &deps).unwrap();
        }
        let buffer = Box::new(b).finalize().unwrap();
        buffer.downcast_ref::<Plan>().unwrap().clone()
    }

    /// Dispatches over different buffers, or reading the same one, record no
    /// barrier, with or without dependency edges between them.
    #[test]
    fn independent_dispatches_record_no_barrier() {
        let p = plan(vec![
            (kernel(&[arg(0, 0, 64, ReadWrite)]), &[]),
            (kernel(&[arg(1, 0, 64, ReadWrite)]), &[]),
            (kernel(&[arg(2, 0, 64, Read), arg(3, 0, 64, Write)]), &[]),
            (kernel(&[arg(2, 0, 64, Read)]), &[2]),
            (kernel(&[arg(0, 64, 64, Write)]), &[0]),
        ]);
        assert_eq!(plan_barriers(&p), [], "disjoint ranges and shared reads need no barrier");
    }

    /// Each kind of conflict on a dependency edge records exactly one barrier,
    /// before the later operation, with the masks its relation asks for.
    #[test]
    fn raw_war_and_waw_edges_record_one_barrier_each() {
        let compute = vk::PipelineStageFlags::COMPUTE_SHADER;
        let raw = plan(vec![(kernel(&[arg(0, 0, 64, Write)]), &[]), (kernel(&[arg(0, 0, 64, Read)]), &[0])]);
        assert_eq!(
            plan_barriers(&raw),
            [Barrier {
                before: 1,
                src_stage: compute,
                dst_stage: compute,
                src_access: vk::AccessFlags::SHADER_WRITE,
                dst_access: vk::AccessFlags::SHADER_READ
            }]
        );
        let war = plan(vec![(kernel(&[arg(0, 0, 64, Read)]), &[]), (kernel(&[arg(0, 0, 64, Write)]), &[0])]);
        let b = plan_barriers(&war);
        assert_eq!(b.len(), 1);
        assert_eq!((b[0].src_access, b[0].dst_access), (vk::AccessFlags::empty(), vk::AccessFlags::empty()));
        assert_eq!(b[0].hazards(), [Hazard::War]);
        let waw = plan(vec![
            (kernel(&[arg(0, 0, 64, Write)]), &[]),
            (RecordedOp::Fill { dst: arg(0, 32, 64, Write), pattern: [1u8].into_iter().collect() }, &[0]),
        ]);
        assert_eq!(
            plan_barriers(&waw),
            [Barrier {
                before: 1,
                src_stage: compute,
                dst_stage: vk::PipelineStageFlags::TRANSFER,
                src_access: vk::AccessFlags::SHADER_WRITE,
                dst_access: vk::AccessFlags::TRANSFER_WRITE
            }]
        );
    }

    /// A conflict reached through other operations still gets its barrier; one
    /// already covered by a barrier between the two does not get another; an
    /// operation with several conflicts gets one barrier with the masks' union.
    #[test]
    fn transitive_covered_and_merged_conflicts() {
        // 0 writes A; 1 (after 0, no conflict) writes B; 2 (after 1) reads A.
        let p = plan(vec![
            (kernel(&[arg(0, 0, 64, Write)]), &[]),
            (kernel(&[arg(1, 0, 64, Write)]), &[0]),
            (kernel(&[arg(0, 0, 64, Read)]), &[1]),
        ]);
        assert_eq!(plan_barriers(&p).iter().map(|b| b.before).collect::<Vec<_>>(), [2]);
        // 0 writes A; 1 reads A (barrier); 2 reads A after 1: covered by that barrier.
        let p = plan(vec![
            (kernel(&[arg(0, 0, 64, Write)]), &[]),
            (kernel(&[arg(0, 0, 64, Read)]), &[0]),
            (kernel(&[arg(0, 0, 64, Read)]), &[1]),
        ]);
        assert_eq!(plan_barriers(&p).len(), 1);
        // 0 writes A, 1 writes B, 2 reads A and copies over B: one merged barrier.
        let p = plan(vec![
            (kernel(&[arg(0, 0, 64, Write)]), &[]),
            (kernel(&[arg(1, 0, 64, Write)]), &[]),
            (RecordedOp::Copy { src: arg(0, 0, 64, Read), dst: arg(1, 0, 64, Write) }, &[0, 1]),
        ]);
        let b = plan_barriers(&p);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].dst_access, vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE);
    }
}
