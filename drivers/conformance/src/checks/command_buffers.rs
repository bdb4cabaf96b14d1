//! Command buffers: recorded once over an argument table, replayed with the table
//! bound to other memory, patched.
//!
//! The recording, over entries `in` (read), `out` and `aux`, of `n` `u32`s each:
//!
//! | op | what | after |
//! |----|------|-------|
//! | 0 | fill `aux` with `0x01010101` | |
//! | 1 | kernel: `out[i] = f(in[i], i)` | |
//! | 2 | kernel: `aux[i] += out[i]` | 0, 1 |
//! | 3 | copy `aux[..n/2]` to `out[n/2..]` | 2 |
//! | 4 | fill `out`'s first 16 bytes with a 2-byte pattern | 2 |
//!
//! Everything in `out` and `aux` is written before it is read, so a replay computes
//! the same from the same `in` whatever the memory held. A driver that refuses to
//! create command buffers, or to record one of these operations, with
//! [`ExecError::Unsupported`] skips the checks.

use std::panic::{catch_unwind, AssertUnwindSafe};

use gantry_driver::AccessMode::{self, Read, ReadWrite};
use gantry_driver::{
    panic_message, CommandBuffer, CommandBufferDesc, CommandBufferLaunch, DeviceOp, ExecError, OpPatch,
    RecordedArg, RecordedOp, SyncPoint,
};
use smallvec::SmallVec;

use super::needs_kernels;
use crate::harness::{u32_bytes, Buf, Factory, Harness, Ticket};
use crate::kernels::{self, Kernel, Linear};
use crate::Outcome;

/// Elements per argument-table entry.
const N: usize = 1024;
/// What op 0 fills `aux` with.
const AUX_FILL: u32 = 0x0101_0101;
/// Op 4's pattern as recorded.
const PATTERN: [u8; 2] = [0x34, 0x12];
/// Op 4's pattern after [`command_buffer_patch`]'s patch.
const PATCHED_PATTERN: [u8; 2] = [0xCD, 0xAB];

/// Op 1's kernel as recorded: `3v + i`.
fn scale() -> (Kernel, Linear) {
    let f = Linear { a: 3, b: 0, c: 1 };
    (kernels::derive("conformance_cb_scale", N, f), f)
}

/// Op 1's kernel after the patch: `v + 7 + (i << 8)`.
fn offset() -> (Kernel, Linear) {
    let f = Linear { a: 1, b: 7, c: 1 << 8 };
    (kernels::derive("conformance_cb_offset", N, f), f)
}

fn entry(entry: u32, offset_elems: usize, elems: usize, mode: AccessMode) -> RecordedArg {
    RecordedArg { entry, offset: offset_elems * 4, len: elems * 4, mode }
}

/// Records the command buffer, or the skip of a driver that refuses it as
/// unsupported.
fn record(h: &Harness, op1: &Kernel) -> Result<CommandBuffer, Outcome> {
    let unsupported = |step: &str, e: &ExecError| match e {
        ExecError::Unsupported { what, .. } => Outcome::skipped(format!("{step}: unsupported ({what})")),
        e => panic!("{}: {step} failed: {e}", h.name()),
    };
    let desc = CommandBufferDesc { entries: 3, in_order: false, ops: 5 };
    let mut b =
        h.driver().create_command_buffer(desc).map_err(|e| unsupported("creating a command buffer", &e))?;
    let accumulate = kernels::accumulate("conformance_cb_accumulate", N);
    let ops: [(RecordedOp, &[u32]); 5] = [
        (
            RecordedOp::Fill {
                dst: entry(2, 0, N, ReadWrite),
                pattern: SmallVec::from_slice(&AUX_FILL.to_ne_bytes()),
            },
            &[],
        ),
        (op1.record(&[entry(0, 0, N, Read), entry(1, 0, N, ReadWrite)]), &[]),
        (accumulate.record(&[entry(1, 0, N, Read), entry(2, 0, N, ReadWrite)]), &[0, 1]),
        (RecordedOp::Copy { src: entry(2, 0, N / 2, Read), dst: entry(1, N / 2, N / 2, ReadWrite) }, &[2]),
        (RecordedOp::Fill { dst: entry(1, 0, 4, ReadWrite), pattern: SmallVec::from_slice(&PATTERN) }, &[2]),
    ];
    for (i, (op, deps)) in ops.into_iter().enumerate() {
        let label = op.label();
        let deps: Vec<SyncPoint> = deps.iter().map(|&d| SyncPoint(d)).collect();
        let point = b.append(op, &deps).map_err(|e| unsupported(&format!("recording a {label}"), &e))?;
        assert_eq!(point, SyncPoint(i as u32), "{}: sync points number the operations in order", h.name());
    }
    b.finalize().map_err(|e| unsupported("finalizing a command buffer", &e))
}

/// An argument table: `in`, `out`, `aux`.
struct Table {
    input: Vec<u32>,
    bufs: [Buf; 3],
}

impl Table {
    fn new(h: &mut Harness, seed: u32) -> Self {
        let input: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(seed).wrapping_add(seed >> 3)).collect();
        let bufs = [h.buffer_u32(&input), h.alloc(N * 4), h.buffer_u32(&[0xFFFF_FFFF; N])];
        Self { input, bufs }
    }

    fn replay(&self, h: &mut Harness, buffer: &CommandBuffer) -> Ticket {
        let modes = [Read, ReadWrite, ReadWrite];
        let args = self.bufs.iter().zip(modes).map(|(b, mode)| b.arg(mode)).collect();
        h.submit(DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args }), &[])
    }

    /// `out` and `aux` after a replay with op 1 computing `f` and op 4 filling
    /// `pattern`.
    fn model(&self, f: Linear, pattern: [u8; 2]) -> (Vec<u32>, Vec<u32>) {
        let mut out: Vec<u32> = self.input.iter().enumerate().map(|(i, &v)| f.at(v, i as u32)).collect();
        let aux: Vec<u32> = out.iter().map(|&o| AUX_FILL.wrapping_add(o)).collect();
        out[N / 2..].copy_from_slice(&aux[..N / 2]);
        let word = u32::from_ne_bytes([pattern[0], pattern[1], pattern[0], pattern[1]]);
        out[..4].fill(word);
        (out, aux)
    }

    fn check(&self, h: &mut Harness, f: Linear, pattern: [u8; 2], what: &str) {
        let (out, aux) = self.model(f, pattern);
        for (buf, expected, name) in [(&self.bufs[1], out, "out"), (&self.bufs[2], aux, "aux")] {
            let got = h.download_u32(buf);
            if let Some(i) = (0..N).find(|&i| got[i] != expected[i]) {
                panic!(
                    "{}: {what}: entry `{name}` element {i} is {:#x}, expected {:#x}",
                    h.name(),
                    got[i],
                    expected[i]
                );
            }
        }
    }

    fn set_input(&mut self, h: &mut Harness, input: Vec<u32>) {
        h.upload(&self.bufs[0], 0, &u32_bytes(&input));
        self.input = input;
    }
}

/// Records kernels, a copy and fills with sync points; replays the buffer with two
/// argument tables at once, then with the first table's input changed: each replay
/// computes from the memory bound at its submission.
pub fn command_buffer_replay(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if let Some(skip) = needs_kernels(&h) {
        return skip;
    }
    let (op1, f) = scale();
    let buffer = match record(&h, &op1) {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let (mut a, b) = (Table::new(&mut h, 3), Table::new(&mut h, 7919));
    let (ra, rb) = (a.replay(&mut h, &buffer), b.replay(&mut h, &buffer));
    h.expect_ok(&ra);
    h.expect_ok(&rb);
    a.check(&mut h, f, PATTERN, "replay with table A");
    b.check(&mut h, f, PATTERN, "replay with table B");
    a.set_input(&mut h, (0..N as u32).rev().collect());
    let again = a.replay(&mut h, &buffer);
    h.expect_ok(&again);
    a.check(&mut h, f, PATTERN, "a second replay with table A after its input changed");
    b.check(&mut h, f, PATTERN, "table B after another table's replay");
    h.finish()
}

/// Patches the recorded kernel (another kernel over the same arguments) and fill
/// pattern while a replay of the original is in flight, then replays: the replay
/// already submitted computes the original, the later one the patch. A patch that
/// does not fit (one entry for five operations) is refused without panicking and
/// changes nothing; patching the original payloads back restores the original.
pub fn command_buffer_patch(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if let Some(skip) = needs_kernels(&h) {
        return skip;
    }
    let (op1, f) = scale();
    let mut buffer = match record(&h, &op1) {
        Ok(b) => b,
        Err(skip) => return skip,
    };
    let (patched, g) = offset();
    let tables: Vec<Table> = [3, 5, 11, 13].into_iter().map(|s| Table::new(&mut h, s)).collect();
    let in_flight = tables[0].replay(&mut h, &buffer);
    let patch =
        [OpPatch::Keep, patched.patch(), OpPatch::Keep, OpPatch::Keep, OpPatch::Fill(&PATCHED_PATTERN)];
    match h.driver().patch_command_buffer(&mut buffer, &patch) {
        Ok(()) => {}
        Err(ExecError::Unsupported { what, .. }) => {
            h.settle();
            return Outcome::skipped(format!("patching command buffers: unsupported ({what})"));
        }
        Err(e) => panic!("{}: a patch of a kernel and a fill pattern was refused: {e}", h.name()),
    }
    let after = tables[1].replay(&mut h, &buffer);
    h.expect_ok(&in_flight);
    h.expect_ok(&after);
    tables[0].check(&mut h, f, PATTERN, "a replay submitted before the patch");
    tables[1].check(&mut h, g, PATCHED_PATTERN, "a replay after the patch");

    let driver = h.driver().clone();
    let refused =
        catch_unwind(AssertUnwindSafe(|| driver.patch_command_buffer(&mut buffer, &[OpPatch::Keep])));
    match refused {
        Ok(Err(_)) => {}
        Ok(Ok(())) => panic!("{}: a patch of 1 entry for 5 operations was accepted", h.name()),
        Err(p) => panic!("{}: a patch of the wrong length panicked ({})", h.name(), panic_message(&*p)),
    }
    let unchanged = tables[2].replay(&mut h, &buffer);
    h.expect_ok(&unchanged);
    tables[2].check(&mut h, g, PATCHED_PATTERN, "a replay after a refused patch");

    let back = [OpPatch::Keep, op1.patch(), OpPatch::Keep, OpPatch::Keep, OpPatch::Fill(&PATTERN)];
    if let Err(e) = h.driver().patch_command_buffer(&mut buffer, &back) {
        panic!("{}: patching the original payloads back was refused: {e}", h.name());
    }
    let restored = tables[3].replay(&mut h, &buffer);
    h.expect_ok(&restored);
    tables[3].check(&mut h, f, PATTERN, "a replay after patching the original payloads back");
    h.finish()
}
