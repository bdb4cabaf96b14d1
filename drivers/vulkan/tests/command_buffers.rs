//! Command buffers on a Vulkan device (lavapipe in CI): the barriers a recorded
//! partition places (read back from the recorded buffer as data), replays over
//! several argument bindings on real data, and the recording and replay figures
//! for the report. Each test says it was skipped, and why, where there is no Vulkan.

mod common;

use std::sync::Arc;

use common::{bytes, gpu, kernel, scalars, u32s, whole};
use gantry_driver::{
    AccessMode::{self, *},
    CommandBuffer, CommandBufferDesc, CommandBufferLaunch, DeviceOp, Geometry, ImageKind, KernelRef, MemArg,
    Range, RecordedArg, RecordedOp, SyncPoint,
};
use gantry_vulkan::{ash::vk, Hazard, VulkanCommandBuffer};

const N: usize = 1024;

const ADD: &str = "
struct S { n: u32, k: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> a: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
override wx: u32 = 64;
@compute @workgroup_size(wx)
fn add(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { out[id.x] = out[id.x] * 2u + a[id.x] + s.k; }
}";

fn add_kernel() -> KernelRef {
    let sig = gantry_driver::Signature::new().global(Read).global(ReadWrite).scalar::<u32>().scalar::<u32>();
    kernel("add", sig, ImageKind::Wgsl, "add", ADD)
}

fn arg(entry: u32, mode: AccessMode) -> RecordedArg {
    RecordedArg { entry, offset: 0, len: 4 * N, mode }
}

fn dispatch(k: &KernelRef, a: u32, out: u32, add: u32) -> RecordedOp {
    RecordedOp::Kernel {
        kernel: k.clone(),
        geometry: Geometry::for_range(Range::d1(N)).unwrap(),
        args: [arg(a, Read), arg(out, ReadWrite)].into_iter().collect(),
        scalars: scalars(&[N as u32, add]),
    }
}

fn record(g: &common::Gpu, entries: usize, ops: Vec<(RecordedOp, &[u32])>) -> CommandBuffer {
    let desc = CommandBufferDesc { entries, in_order: false, ops: ops.len() };
    let mut b = gantry_driver::Driver::create_command_buffer(&g.driver, desc).unwrap();
    for (op, deps) in ops {
        let deps: Vec<SyncPoint> = deps.iter().map(|&d| SyncPoint(d)).collect();
        b.append(op, &deps).unwrap();
    }
    b.finalize().unwrap()
}

fn barriers(buffer: &CommandBuffer) -> Vec<gantry_vulkan::Barrier> {
    buffer.downcast_ref::<VulkanCommandBuffer>().expect("a Vulkan command buffer").barriers().to_vec()
}

fn replay(g: &mut common::Gpu, buffer: &CommandBuffer, table: &[gantry_driver::AllocId]) -> u64 {
    let args = table.iter().map(|&id| MemArg { mem: whole(id, 4 * N), mode: ReadWrite }).collect();
    let (_, op) =
        g.submit(DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args }), &[]);
    op
}

/// Independent dispatches record no barrier; a read after write, a write after
/// read and a write after write on dependency edges record one each, before the
/// later dispatch, with the masks of their relation; and the recorded buffers run.
#[test]
fn barriers_sit_exactly_on_conflicting_edges() {
    let Some(g) = gpu("barriers_sit_exactly_on_conflicting_edges") else { return };
    let k = add_kernel();
    // Four dispatches over four disjoint outputs, all reading entry 0.
    let independent = record(&g, 5, (1..5).map(|out| (dispatch(&k, 0, out, out), &[][..])).collect());
    assert_eq!(barriers(&independent), [], "independent dispatches need no barrier");
    // 0 writes entry 1; 1 reads it (RAW); 2 writes entry 0, which 1 read (WAR);
    // 3 writes entry 1 again after 2 (WAW with 0 and 1's... only 0 wrote it: WAW).
    let chain = record(
        &g,
        3,
        vec![(dispatch(&k, 0, 1, 1), &[]), (dispatch(&k, 1, 2, 2), &[0]), (dispatch(&k, 2, 0, 3), &[1])],
    );
    let b = barriers(&chain);
    assert_eq!(b.iter().map(|b| b.before).collect::<Vec<_>>(), [1, 2], "{b:?}");
    assert_eq!(b[0].hazards(), [Hazard::Raw]);
    assert_eq!(
        (b[0].src_access, b[0].dst_access),
        (vk::AccessFlags::SHADER_WRITE, vk::AccessFlags::SHADER_READ)
    );
    // Before 2: it reads entry 2 (written by 1: RAW) and writes entry 0 (read by 0
    // and 1: WAR): one barrier carrying both.
    assert!(b[1].hazards().contains(&Hazard::Raw), "{:?}", b[1]);
    let war = record(&g, 2, vec![(dispatch(&k, 0, 1, 1), &[]), (dispatch(&k, 1, 0, 1), &[0])]);
    let b = barriers(&war);
    // 1 reads entry 1 (written by 0: RAW) and writes entry 0 (read by 0: WAR).
    assert_eq!(b.len(), 1, "{b:?}");
    let only_war = record(
        &g,
        3,
        vec![
            (dispatch(&k, 0, 1, 1), &[]),
            (RecordedOp::Fill { dst: arg(0, Write), pattern: [7u8; 4].into_iter().collect() }, &[0]),
        ],
    );
    let b = barriers(&only_war);
    assert_eq!(b.len(), 1, "{b:?}");
    assert_eq!(b[0].hazards(), [Hazard::War]);
    assert_eq!(
        (b[0].src_stage, b[0].dst_stage),
        (vk::PipelineStageFlags::COMPUTE_SHADER, vk::PipelineStageFlags::TRANSFER)
    );
    let waw = record(
        &g,
        3,
        vec![
            (dispatch(&k, 0, 1, 1), &[]),
            (RecordedOp::Copy { src: arg(2, Read), dst: arg(1, Write) }, &[0]),
        ],
    );
    let b = barriers(&waw);
    assert_eq!(b.len(), 1, "{b:?}");
    assert_eq!(b[0].hazards(), [Hazard::Waw]);
}

/// A recorded chain (dispatches, a fill, a copy) replays over two argument tables
/// and again over the first after its input changed, matching the host's model;
/// each binding records once.
#[test]
fn replays_over_several_bindings_compute_the_model() {
    let Some(mut g) = gpu("replays_over_several_bindings_compute_the_model") else { return };
    let k = add_kernel();
    let buffer = record(
        &g,
        3,
        vec![
            (RecordedOp::Fill { dst: arg(1, Write), pattern: 3u32.to_ne_bytes().into_iter().collect() }, &[]),
            (dispatch(&k, 0, 1, 10), &[0]),
            (dispatch(&k, 1, 2, 20), &[1]),
            (RecordedOp::Copy { src: arg(2, Read), dst: arg(0, Write) }, &[2]),
            (dispatch(&k, 0, 1, 30), &[3]),
        ],
    );
    // What a replay leaves, from the input and the previous contents of entry 2.
    let model = |input: &[u32], z0: &[u32]| -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let mut x = input.to_vec();
        let mut y = vec![3u32; N];
        let mut z = z0.to_vec();
        for i in 0..N {
            y[i] = y[i].wrapping_mul(2).wrapping_add(x[i]).wrapping_add(10);
            z[i] = z[i].wrapping_mul(2).wrapping_add(y[i]).wrapping_add(20);
            x[i] = z[i];
            y[i] = y[i].wrapping_mul(2).wrapping_add(x[i]).wrapping_add(30);
        }
        (x, y, z)
    };
    let mut tables = Vec::new();
    for seed in [3u32, 7919] {
        let input: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(seed)).collect();
        let t = [g.alloc(4 * N), g.alloc(4 * N), g.alloc(4 * N)];
        g.upload(t[0], 0, &bytes(&input));
        tables.push((t, input));
    }
    let ops: Vec<u64> = tables.iter().map(|(t, _)| replay(&mut g, &buffer, t)).collect();
    for op in ops {
        g.ok(op);
    }
    for (t, input) in &tables {
        let (x, y, z) = model(input, &[0; N]);
        assert_eq!(u32s(&g.download(t[0], 0, 4 * N)), x);
        assert_eq!(u32s(&g.download(t[1], 0, 4 * N)), y);
        assert_eq!(u32s(&g.download(t[2], 0, 4 * N)), z);
    }
    let (t, _) = &tables[0];
    let input: Vec<u32> = (0..N as u32).rev().collect();
    g.upload(t[0], 0, &bytes(&input));
    let z0 = u32s(&g.download(t[2], 0, 4 * N));
    let again = replay(&mut g, &buffer, t);
    g.ok(again);
    let (x, y, z) = model(&input, &z0);
    assert_eq!(u32s(&g.download(t[0], 0, 4 * N)), x);
    assert_eq!(u32s(&g.download(t[1], 0, 4 * N)), y);
    assert_eq!(u32s(&g.download(t[2], 0, 4 * N)), z);
    let recorded = buffer.downcast_ref::<VulkanCommandBuffer>().unwrap();
    assert_eq!(recorded.instances(), 2, "one recording per binding, reused by the third replay");
}

/// Memory buffer writes and reads in a recorded buffer: host bytes captured when
/// appended go in, a kernel works on them, and a read copies the result out to host
/// memory after each replay. A second replay handed over while the first may be in
/// flight (it waits on it) reads back its own result.
#[test]
fn memory_buffer_writes_and_reads_replay() {
    let Some(mut g) = gpu("memory_buffer_writes_and_reads_replay") else { return };
    let k = add_kernel();
    let input: Vec<u32> = (0..N as u32).map(|i| i * 5 + 1).collect();
    let host_in = Arc::new(gantry_driver::HostStorage::from_bytes(&bytes(&input)));
    let host_out = Arc::new(gantry_driver::HostStorage::zeroed(4 * N));
    let buffer = record(
        &g,
        2,
        vec![
            (RecordedOp::Write { src: host_in, dst: arg(0, Write) }, &[]),
            (dispatch(&k, 0, 1, 9), &[0]),
            (RecordedOp::Read { src: arg(1, Read), dst: host_out.clone() }, &[1]),
        ],
    );
    let t = [g.alloc(4 * N), g.alloc(4 * N)];
    let args = || t.iter().map(|&id| MemArg { mem: whole(id, 4 * N), mode: ReadWrite }).collect();
    let (first, _) =
        g.submit(DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args: args() }), &[]);
    let (_, second) = g.submit(
        DeviceOp::CommandBuffer(CommandBufferLaunch { buffer: buffer.clone(), args: args() }),
        &[first],
    );
    g.ok(second);
    // out = 2 * out + in + 9, twice, from 0.
    let once: Vec<u32> = input.iter().map(|&v| v + 9).collect();
    let twice: Vec<u32> = once.iter().zip(&input).map(|(&o, &v)| 2 * o + v + 9).collect();
    // SAFETY: both replays completed; nothing else uses the storage.
    assert_eq!(u32s(unsafe { host_out.bytes() }), twice);
    assert_eq!(u32s(&g.download(t[1], 0, 4 * N)), twice);
}

/// A plan of kernels only, replayed over more bindings than a command buffer keeps
/// instances: the first [`gantry_vulkan::INSTANCES`] bindings record, each later
/// one rewrites the descriptor sets of the oldest idle instance without recording
/// (a binding seen before included, once its instance was rebound), and every
/// replay computes the model over its own buffers. Dispatches over the same slots
/// share one descriptor set. A plan with a fill (whose command names its buffer)
/// records for every new binding instead, as does any plan on a device without
/// storage-buffer update-after-bind (lavapipe and NVIDIA's driver have it).
#[test]
fn new_bindings_past_the_kept_instances_rebind_without_recording() {
    let Some(mut g) = gpu("new_bindings_past_the_kept_instances_rebind_without_recording") else { return };
    let k = add_kernel();
    // out(1) = 2 out(1) + in(0) + 5, twice over the same slots, then out(2) from 1.
    let buffer = record(
        &g,
        3,
        vec![(dispatch(&k, 0, 1, 5), &[]), (dispatch(&k, 0, 1, 5), &[0]), (dispatch(&k, 1, 2, 7), &[1])],
    );
    let recorded = buffer.downcast_ref::<VulkanCommandBuffer>().unwrap();
    eprintln!("rebinding by rewriting descriptor sets: {}", recorded.rebindable());
    assert_eq!(recorded.descriptor_sets(), 2, "the two dispatches over the same slots share a set");
    let model = |input: &[u32]| -> (Vec<u32>, Vec<u32>) {
        let y: Vec<u32> = input.iter().map(|&x| (x + 5).wrapping_mul(2).wrapping_add(x + 5)).collect();
        let z: Vec<u32> = y.iter().map(|&y| y + 7).collect();
        (y, z)
    };
    let bindings = gantry_vulkan::INSTANCES + 2;
    let mut tables = Vec::new();
    for b in 0..bindings {
        let input: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(31 + b as u32)).collect();
        let t = [g.alloc(4 * N), g.alloc(4 * N), g.alloc(4 * N)];
        g.upload(t[0], 0, &bytes(&input));
        tables.push((t, input));
    }
    let check = |g: &mut common::Gpu, t: &[gantry_driver::AllocId; 3], input: &[u32], what: &str| {
        let (y, z) = model(input);
        for (entry, want) in [(1, y), (2, z)] {
            let got = u32s(&g.download(t[entry], 0, 4 * N));
            let wrong = (0..N).filter(|&i| got[i] != want[i]).count();
            assert_eq!(wrong, 0, "{what}: {wrong} elements of entry {entry} differ from the model");
        }
    };
    for (b, (t, input)) in tables.iter().enumerate() {
        let op = replay(&mut g, &buffer, t);
        g.ok(op);
        check(&mut g, t, input, &format!("binding {b}"));
        // Without update-after-bind a rewrite would invalidate the recording: the
        // driver records instead (and still gives the model's results).
        let (recordings, rebinds) = if recorded.rebindable() {
            ((b + 1).min(gantry_vulkan::INSTANCES), (b + 1).saturating_sub(gantry_vulkan::INSTANCES))
        } else {
            (b + 1, 0)
        };
        assert_eq!(recorded.recordings(), recordings, "binding {b}");
        assert_eq!(recorded.rebinds(), rebinds, "binding {b}");
    }
    assert_eq!(recorded.instances(), gantry_vulkan::INSTANCES);
    // Binding 0's instance was rebound away: binding 0 again rebinds, over fresh
    // contents of its buffers.
    let (t, _) = &tables[0];
    let input: Vec<u32> = (0..N as u32).map(|i| i ^ 0x5a5a).collect();
    g.upload(t[0], 0, &bytes(&input));
    g.upload(t[1], 0, &[0; 4 * N]);
    g.upload(t[2], 0, &[0; 4 * N]);
    let op = replay(&mut g, &buffer, t);
    g.ok(op);
    check(&mut g, t, &input, "binding 0 again");
    let again =
        if recorded.rebindable() { (gantry_vulkan::INSTANCES, 3) } else { (gantry_vulkan::INSTANCES + 3, 0) };
    assert_eq!((recorded.recordings(), recorded.rebinds()), again);

    let with_fill = record(
        &g,
        3,
        vec![
            (RecordedOp::Fill { dst: arg(1, Write), pattern: 0u32.to_ne_bytes().into_iter().collect() }, &[]),
            (dispatch(&k, 0, 1, 5), &[0]),
        ],
    );
    for (t, _) in &tables {
        let op = replay(&mut g, &with_fill, t);
        g.ok(op);
    }
    let recorded = with_fill.downcast_ref::<VulkanCommandBuffer>().unwrap();
    assert_eq!(
        (recorded.recordings(), recorded.rebinds()),
        (bindings, 0),
        "a fill's command names its buffer"
    );
}
