//! Command buffers as CUDA graphs, through the driver contract: every kind of
//! recorded operation (kernels, fills of any width, copies that overlap, memory
//! buffer writes and reads), replayed over argument tables bound to other memory,
//! patched, and refused with typed errors. The graph counters show which path each
//! submission took: built once, launched as is while nothing changes, kernel nodes
//! set one by one, whole-graph updates. On a machine without CUDA each test says it
//! was skipped.

mod common;

use std::sync::Arc;

use common::{bytes, gpu, kernel, scalars, u32s, whole, Gpu};
use gantry_cuda::GraphCounts;
use gantry_driver::AccessMode::{Read, ReadWrite, Write};
use gantry_driver::{
    AllocId, CommandBuffer, CommandBufferDesc, CommandBufferLaunch, DeviceOp, Driver, ExecError, Geometry,
    HostStorage, ImageKind, KernelRef, MemArg, OpPatch, Range, RecordedArg, RecordedOp, ScalarBlock,
    Signature, SyncPoint,
};
use smallvec::SmallVec;

const AXPY_C: &str = r#"
extern "C" __global__ void axpy(const unsigned int* x, unsigned int* y, unsigned int n, unsigned int a) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

/// Elements per entry.
const N: usize = 4099;

fn axpy() -> KernelRef {
    let sig = Signature::new().global(Read).global(ReadWrite).scalar::<u32>().scalar::<u32>();
    kernel("axpy", sig, ImageKind::CudaC, "axpy", AXPY_C)
}

fn arg(entry: u32, offset_elems: usize, elems: usize, mode: gantry_driver::AccessMode) -> RecordedArg {
    RecordedArg { entry, offset: offset_elems * 4, len: elems * 4, mode }
}

/// The recording, over entries `x` (0) and `y` (1):
///
/// | op | what | after |
/// |----|------|-------|
/// | 0 | write `input` into `x` | |
/// | 1 | fill `y` with 1 | |
/// | 2 | `y = a·x + y` | 0, 1 |
/// | 3 | copy `y[0..N-1]` to `y[1..N]` (overlapping) | 2 |
/// | 4 | read `y` into `out` | 3 |
/// | 5 | fill `x` with a 12-byte pattern | 4 |
struct Recording {
    buffer: CommandBuffer,
    kernel: KernelRef,
    out: Arc<HostStorage>,
}

const PATTERN: [u32; 3] = [7, 8, 9];

fn record(g: &Gpu, input: &[u32], a: u32) -> Recording {
    let desc = CommandBufferDesc { entries: 2, in_order: false, ops: 6 };
    let mut b = g.driver.create_command_buffer(desc).expect("the CUDA driver records command buffers");
    let kernel = axpy();
    let out = Arc::new(HostStorage::zeroed(N * 4));
    let ops: [(RecordedOp, &[u32]); 6] = [
        (
            RecordedOp::Write {
                src: Arc::new(HostStorage::from_bytes(&bytes(input))),
                dst: arg(0, 0, N, Write),
            },
            &[],
        ),
        (
            RecordedOp::Fill { dst: arg(1, 0, N, Write), pattern: SmallVec::from_slice(&1u32.to_ne_bytes()) },
            &[],
        ),
        (
            RecordedOp::Kernel {
                kernel: kernel.clone(),
                geometry: Geometry::for_range(Range::d1(N)).unwrap(),
                args: [arg(0, 0, N, Read), arg(1, 0, N, ReadWrite)].into_iter().collect(),
                scalars: scalars(&[N as u32, a]),
            },
            &[0, 1],
        ),
        (RecordedOp::Copy { src: arg(1, 0, N - 1, Read), dst: arg(1, 1, N - 1, Write) }, &[2]),
        (RecordedOp::Read { src: arg(1, 0, N, Read), dst: out.clone() }, &[3]),
        (
            RecordedOp::Fill {
                dst: arg(0, 0, N - 1, Write),
                pattern: SmallVec::from_slice(&bytes(&PATTERN)),
            },
            &[4],
        ),
    ];
    for (i, (op, deps)) in ops.into_iter().enumerate() {
        let deps: Vec<SyncPoint> = deps.iter().map(|&d| SyncPoint(d)).collect();
        assert_eq!(b.append(op, &deps).unwrap(), SyncPoint(i as u32));
    }
    Recording { buffer: b.finalize().expect("finalize"), kernel, out }
}

/// `y` after a replay with `input` and `a`; `x` after it.
fn model(input: &[u32], a: u32) -> (Vec<u32>, Vec<u32>) {
    let computed: Vec<u32> = input.iter().map(|&v| a.wrapping_mul(v).wrapping_add(1)).collect();
    let mut y = computed.clone();
    y[1..].copy_from_slice(&computed[..N - 1]);
    let mut x: Vec<u32> = (0..N - 1).map(|i| PATTERN[i % 3]).collect();
    x.push(input[N - 1]);
    (y, x)
}

fn replay(g: &mut Gpu, buffer: &CommandBuffer, table: [AllocId; 2]) -> u64 {
    let args = [(table[0], Read), (table[1], ReadWrite)]
        .into_iter()
        .map(|(id, mode)| MemArg { mem: whole(id, N * 4), mode })
        .collect();
    g.submit(DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args }), &[]).1
}

fn check(g: &mut Gpu, r: &Recording, table: [AllocId; 2], input: &[u32], a: u32, what: &str) {
    let (y, x) = model(input, a);
    assert_eq!(u32s(&g.download(table[1], 0, N * 4)), y, "{what}: y");
    assert_eq!(u32s(&g.download(table[0], 0, N * 4)), x, "{what}: x");
    // SAFETY: the replay that read into it has completed; nothing else uses it.
    assert_eq!(u32s(unsafe { r.out.bytes() }), y, "{what}: the memory buffer read");
}

/// A patch of the recording's kernel (op 2) alone.
fn kernel_patch<'a>(
    kernel: &'a KernelRef,
    geometry: &'a Geometry,
    scalars: &'a ScalarBlock,
) -> [OpPatch<'a>; 6] {
    let k = OpPatch::Kernel { kernel, geometry, scalars };
    [OpPatch::Keep, OpPatch::Keep, k, OpPatch::Keep, OpPatch::Keep, OpPatch::Keep]
}

fn counts(g: &Gpu) -> GraphCounts {
    g.driver.graph_counts()
}

/// Every kind of operation in one graph, replayed: the first replay instantiates;
/// replays over the same table launch as is (no update); another table updates the
/// graph whole; a patch of the kernel's scalars sets one kernel node; a patch of the
/// written bytes updates the graph; each replay computes what the model says.
#[test]
fn every_operation_kind_replays_patches_and_rebinds() {
    let Some(mut g) = gpu("every_operation_kind_replays_patches_and_rebinds") else { return };
    let input: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut r = record(&g, &input, 3);
    let table_a = [g.alloc(N * 4), g.alloc(N * 4)];
    let table_b = [g.alloc(N * 4), g.alloc(N * 4)];
    let before = counts(&g);

    let first = replay(&mut g, &r.buffer, table_a);
    g.ok(first);
    check(&mut g, &r, table_a, &input, 3, "first replay");
    let c = counts(&g);
    assert_eq!((c.instantiated - before.instantiated, c.launched - before.launched), (1, 1));

    let ids: Vec<u64> = (0..20).map(|_| replay(&mut g, &r.buffer, table_a)).collect();
    for id in ids {
        g.ok(id);
    }
    check(&mut g, &r, table_a, &input, 3, "20 replays over the same table");
    let same = counts(&g);
    assert_eq!(
        (same.instantiated, same.updated, same.kernel_nodes_set, same.launched - c.launched),
        (c.instantiated, c.updated, c.kernel_nodes_set, 20),
        "replays over the same memory launch the instance as it is"
    );

    let id = replay(&mut g, &r.buffer, table_b);
    g.ok(id);
    check(&mut g, &r, table_b, &input, 3, "a replay over another table");
    let rebound = counts(&g);
    assert_eq!(rebound.updated, same.updated + 1, "other memory: one whole-graph update");
    assert_eq!(rebound.instantiated, same.instantiated, "and no new instance");

    // The kernel's scalars: its node alone changes.
    let geometry = Geometry::for_range(Range::d1(N)).unwrap();
    let five: ScalarBlock = scalars(&[N as u32, 5]);
    let kernel = r.kernel.clone();
    g.driver.patch_command_buffer(&mut r.buffer, &kernel_patch(&kernel, &geometry, &five)).unwrap();
    let id = replay(&mut g, &r.buffer, table_b);
    g.ok(id);
    check(&mut g, &r, table_b, &input, 5, "after patching the kernel's scalars");
    let set = counts(&g);
    assert_eq!(set.kernel_nodes_set, rebound.kernel_nodes_set + 1, "one kernel node set");
    assert_eq!((set.updated, set.instantiated), (rebound.updated, rebound.instantiated));

    // Other bytes for the memory buffer write: a whole-graph update.
    let other: Vec<u32> = (0..N as u32).map(|i| i ^ 0x5555).collect();
    let data = Arc::new(HostStorage::from_bytes(&bytes(&other)));
    let keep =
        [OpPatch::Write(&data), OpPatch::Keep, OpPatch::Keep, OpPatch::Keep, OpPatch::Keep, OpPatch::Keep];
    g.driver.patch_command_buffer(&mut r.buffer, &keep).unwrap();
    let id = replay(&mut g, &r.buffer, table_a);
    g.ok(id);
    check(&mut g, &r, table_a, &other, 5, "after patching the written bytes");
    assert_eq!(counts(&g).instantiated, set.instantiated, "updated, not instantiated again");
}

/// A replay in flight keeps what it was submitted with while the buffer is patched
/// (the patch goes to a copy), and two tables replayed back to back each get their
/// own memory.
#[test]
fn a_patch_leaves_the_replay_in_flight_alone() {
    let Some(mut g) = gpu("a_patch_leaves_the_replay_in_flight_alone") else { return };
    let input: Vec<u32> = (0..N as u32).collect();
    let mut r = record(&g, &input, 2);
    let tables: Vec<[AllocId; 2]> = (0..3).map(|_| [g.alloc(N * 4), g.alloc(N * 4)]).collect();
    let original = r.buffer.clone();
    let in_flight = replay(&mut g, &r.buffer, tables[0]);
    let geometry = Geometry::for_range(Range::d1(N)).unwrap();
    let seven = scalars(&[N as u32, 7]);
    let kernel = r.kernel.clone();
    g.driver.patch_command_buffer(&mut r.buffer, &kernel_patch(&kernel, &geometry, &seven)).unwrap();
    assert!(!Arc::ptr_eq(&original, &r.buffer), "a buffer a submission holds is patched in a copy");
    let after = replay(&mut g, &r.buffer, tables[1]);
    let old_again = replay(&mut g, &original, tables[2]);
    for id in [in_flight, after, old_again] {
        g.ok(id);
    }
    let check_y = |g: &mut Gpu, t: [AllocId; 2], a: u32, what: &str| {
        assert_eq!(u32s(&g.download(t[1], 0, N * 4)), model(&input, a).0, "{what}");
    };
    check_y(&mut g, tables[0], 2, "the replay submitted before the patch");
    check_y(&mut g, tables[1], 7, "the replay after it");
    check_y(&mut g, tables[2], 2, "the original buffer replayed after the patch");
}

/// Bad input is a typed error and the driver goes on: a table entry shorter than the
/// recording, host memory in the table, a patch that does not fit, a kernel image
/// that does not compile (at finalize).
#[test]
fn bad_tables_patches_and_images_are_typed_errors() {
    let Some(mut g) = gpu("bad_tables_patches_and_images_are_typed_errors") else { return };
    let input: Vec<u32> = (0..N as u32).collect();
    let mut r = record(&g, &input, 2);
    let short = [g.alloc(N * 4), g.alloc(16)];
    let args = [(short[0], N * 4), (short[1], 16)]
        .into_iter()
        .map(|(id, len)| MemArg { mem: whole(id, len), mode: ReadWrite })
        .collect();
    let (_, id) =
        g.submit(DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: r.buffer.clone(), args }), &[]);
    match g.result(id) {
        Err(ExecError::Driver { message, .. }) => {
            assert!(message.contains("outside argument entry 1"), "{message}")
        }
        other => panic!("a table entry shorter than recorded: {other:?}"),
    }
    let host = Arc::new(HostStorage::zeroed(N * 4));
    let args = [
        MemArg { mem: gantry_driver::MemSlice::host(host), mode: Read },
        MemArg { mem: whole(short[0], N * 4), mode: ReadWrite },
    ]
    .into_iter()
    .collect();
    let (_, id) =
        g.submit(DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: r.buffer.clone(), args }), &[]);
    assert!(
        matches!(g.result(id), Err(ExecError::Driver { message, .. }) if message.contains("host memory"))
    );
    assert!(matches!(
        g.driver.patch_command_buffer(&mut r.buffer, &[OpPatch::Keep]),
        Err(ExecError::Driver { .. })
    ));

    let broken =
        kernel("broken", Signature::new().global(ReadWrite), ImageKind::CudaC, "broken", "this is not C");
    let mut b =
        g.driver.create_command_buffer(CommandBufferDesc { entries: 1, in_order: true, ops: 1 }).unwrap();
    b.append(
        RecordedOp::Kernel {
            kernel: broken,
            geometry: Geometry::for_range(Range::d1(4)).unwrap(),
            args: [arg(0, 0, 4, ReadWrite)].into_iter().collect(),
            scalars: SmallVec::new(),
        },
        &[],
    )
    .unwrap();
    match b.finalize() {
        Err(ExecError::Backend { message, .. }) => assert!(message.contains("broken"), "{message}"),
        Err(e) => panic!("a CUDA C image that does not compile: {e}"),
        Ok(_) => panic!("a CUDA C image that does not compile was finalized"),
    }

    let table = [g.alloc(N * 4), g.alloc(N * 4)];
    let id = replay(&mut g, &r.buffer, table);
    g.ok(id);
    check(&mut g, &r, table, &input, 2, "after the refusals");
}
