//! The reference model: a program run serially, in program order, on plain vectors
//! ([`run_model`]), and what a run produces ([`Outcome`]).

use crate::arith::{host_data, item_seed, mix, out_value, rw_value, write_mask};
use crate::program::{BufferSpec, Cmd, Launch, Op, Program, Span, WMode};

/// What a run of a program produces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Final contents of every buffer (empty for dropped ones).
    pub buffers: Vec<Vec<u32>>,
    /// `(op index, contents)` of every [`Op::Snapshot`].
    pub snapshots: Vec<(usize, Vec<u32>)>,
    /// `(op index, data)` of every [`Cmd::ReadBack`].
    pub readbacks: Vec<(usize, Vec<u32>)>,
    /// `(op index, digest)` of what every [`Cmd::HostTask`] read ([`digest`] of its
    /// read ranges, in order), sorted by op index.
    pub host_reads: Vec<(usize, u32)>,
}

fn first_diff(a: &[u32], b: &[u32]) -> String {
    if a.len() != b.len() {
        return format!("lengths {} vs {}", a.len(), b.len());
    }
    let bad: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
    let shown: Vec<String> =
        bad.iter().take(6).map(|&i| format!("[{i}] model {:#010x} gantry {:#010x}", a[i], b[i])).collect();
    format!(
        "{} of {} elements differ at {:?}: {}",
        bad.len(),
        a.len(),
        &bad[..bad.len().min(16)],
        shown.join(", ")
    )
}

impl Outcome {
    /// `None` if `got` equals this (the model's) outcome, else a readable description
    /// of the differences.
    pub fn mismatch(&self, got: &Outcome) -> Option<String> {
        let mut out = Vec::new();
        for (i, (m, g)) in self.buffers.iter().zip(&got.buffers).enumerate() {
            if m != g {
                out.push(format!("final b{i}: {}", first_diff(m, g)));
            }
        }
        for ((op, m), (_, g)) in self.snapshots.iter().zip(&got.snapshots) {
            if m != g {
                out.push(format!("snapshot at #{op}: {}", first_diff(m, g)));
            }
        }
        for ((op, m), (_, g)) in self.readbacks.iter().zip(&got.readbacks) {
            if m != g {
                out.push(format!("readback of #{op}: {}", first_diff(m, g)));
            }
        }
        if self.host_reads != got.host_reads {
            let bad: Vec<String> = self
                .host_reads
                .iter()
                .zip(&got.host_reads)
                .filter(|(m, g)| m != g)
                .map(|(m, g)| if m.0 == g.0 { format!("#{}", m.0) } else { format!("#{} vs #{}", m.0, g.0) })
                .collect();
            out.push(format!(
                "host tasks read different data: {} (model {} tasks, gantry {})",
                bad.join(", "),
                self.host_reads.len(),
                got.host_reads.len()
            ));
        }
        if self.buffers.len() != got.buffers.len()
            || self.snapshots.len() != got.snapshots.len()
            || self.readbacks.len() != got.readbacks.len()
        {
            out.push("different numbers of buffers, snapshots or readbacks".into());
        }
        (!out.is_empty()).then(|| out.join("\n"))
    }
}

/// Order-sensitive digest of the read ranges of a host task.
pub fn digest<'a>(reads: impl IntoIterator<Item = &'a [u32]>) -> u32 {
    reads.into_iter().fold(0x5EED, |acc, r| r.iter().fold(mix(acc, r.len() as u32), |a, &x| mix(a, x)))
}

/// Kernel/host-task semantics on plain vectors.
/// What a kernel or host task computes; a [`Launch::Map`] kernel seeds every
/// work-item with `item_seed(salt, 0)`.
fn model_compute(bufs: &mut [Vec<u32>], reads: &[Span], writes: &[(Span, WMode)], salt: u32, map: bool) {
    let read_data: Vec<Vec<u32>> = reads.iter().map(|s| bufs[s.buf][s.start..s.end].to_vec()).collect();
    for (k, (w, mode)) in writes.iter().enumerate() {
        for i in 0..w.len() {
            let mut acc = item_seed(salt, if map { 0 } else { i });
            for r in &read_data {
                acc = mix(acc, r[i % r.len()]);
            }
            let slot = &mut bufs[w.buf][w.start + i];
            match mode {
                WMode::Write => {
                    if write_mask(salt, k, i) {
                        *slot = out_value(acc, k);
                    }
                }
                WMode::DiscardWrite => *slot = out_value(acc, k),
                WMode::ReadWrite => *slot = rw_value(acc, k, *slot),
            }
        }
    }
}

/// Runs a program serially, in program order, on plain vectors.
pub fn run_model(p: &Program) -> Outcome {
    let mut bufs: Vec<Vec<u32>> = p.buffers.iter().map(BufferSpec::contents).collect();
    let mut out = Outcome::default();
    let mut dropped = Vec::new();
    for (i, op) in p.ops.iter().enumerate() {
        match op {
            Op::Submit { cmd, .. } => match cmd {
                Cmd::Kernel { reads, writes, salt, launch, .. } => {
                    model_compute(&mut bufs, reads, writes, *salt, *launch == Launch::Map)
                }
                Cmd::HostTask { reads, writes, salt } => {
                    out.host_reads.push((i, digest(reads.iter().map(|s| &bufs[s.buf][s.start..s.end]))));
                    model_compute(&mut bufs, reads, writes, *salt, false)
                }
                Cmd::Copy { src, dst } => {
                    let data = bufs[src.buf][src.start..src.end].to_vec();
                    bufs[dst.buf][dst.start..dst.end].copy_from_slice(&data);
                }
                Cmd::Fill { span, value } => bufs[span.buf][span.start..span.end].fill(*value),
                Cmd::CopyFromHost { dst, salt } => {
                    for k in 0..dst.len() {
                        bufs[dst.buf][dst.start + k] = host_data(*salt, k);
                    }
                }
                Cmd::ReadBack { src } => out.readbacks.push((i, bufs[src.buf][src.start..src.end].to_vec())),
            },
            Op::Snapshot(b) => out.snapshots.push((i, bufs[*b].clone())),
            Op::HostUpdate { buf, salt } => {
                for (k, x) in bufs[*buf].iter_mut().enumerate() {
                    *x = mix(item_seed(*salt, k), *x);
                }
            }
            Op::Drop(b) => dropped.push(*b),
            Op::Wait(_)
            | Op::QueueWait(_)
            | Op::Flush
            | Op::StartFusion { .. }
            | Op::CompleteFusion { .. }
            | Op::CancelFusion { .. }
            | Op::SetPromotion { .. } => {}
        }
    }
    for b in dropped {
        bufs[b].clear();
    }
    out.buffers = bufs;
    out
}
