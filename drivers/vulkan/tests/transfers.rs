//! Copies, fills and wait-lists on a Vulkan device (lavapipe in CI), on real data.
//! Each test says it was skipped, and why, where there is no Vulkan.

mod common;

use std::time::Instant;

use common::{bytes, gpu, kernel, scalars, u32s, whole};
use gantry_driver::{
    AccessMode, DeviceOp, Geometry, ImageKind, KernelRef, MemRef, MemSlice, Range, Signature,
};

fn noise(len: usize, seed: u32) -> Vec<u8> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as u8
        })
        .collect()
}

/// 64 MiB up, across the device, and back, byte for byte; and copies that overlap
/// inside one allocation, forwards and backwards (through scratch memory).
#[test]
fn large_and_overlapping_copies() {
    let Some(mut g) = gpu("large_and_overlapping_copies") else { return };
    let len = 64 << 20;
    let data = noise(len, 7);
    let (a, b) = (g.alloc(len), g.alloc(len));
    let start = Instant::now();
    g.upload(a, 0, &data);
    let up = start.elapsed();
    let start = Instant::now();
    let (_, op) = g.submit(DeviceOp::Copy { src: whole(a, len), dst: whole(b, len) }, &[]);
    g.ok(op);
    let across = start.elapsed();
    let start = Instant::now();
    let got = g.download(b, 0, len);
    let down = start.elapsed();
    assert!(got == data, "64 MiB round trip");
    let gbs = |d: std::time::Duration| len as f64 / d.as_secs_f64() / 1e9;
    eprintln!(
        "64 MiB: host→device {:.2} GB/s, device→device {:.2} GB/s, device→host {:.2} GB/s",
        gbs(up),
        gbs(across),
        gbs(down)
    );
    let small = noise(4096, 3);
    let c = g.alloc(4096);
    for (from, to) in [(0usize, 1000usize), (1000, 3)] {
        g.upload(c, 0, &small);
        let n = 3000;
        let src = MemSlice { mem: MemRef::Device(c), offset: from, len: n };
        let dst = MemSlice { mem: MemRef::Device(c), offset: to, len: n };
        let (_, op) = g.submit(DeviceOp::Copy { src, dst }, &[]);
        g.ok(op);
        let mut expected = small.clone();
        expected.copy_within(from..from + n, to);
        assert!(g.download(c, 0, 4096) == expected, "overlapping copy {from} -> {to}");
    }
}

/// Fills with patterns of every width from 1 to 16 bytes at odd offsets (which
/// `vkCmdFillBuffer` cannot take) and at aligned ones, long and short, leave the
/// bytes around them alone.
#[test]
fn fills_of_every_width_at_odd_offsets() {
    let Some(mut g) = gpu("fills_of_every_width_at_odd_offsets") else { return };
    let size = 1 << 20;
    let buf = g.alloc(size);
    let base = vec![0xEEu8; size];
    for width in 1usize..=16 {
        for (offset, reps) in [(1usize, 3usize), (3, 1000), (4, 17), (8, 5000), (7, 40_000)] {
            let len = width * reps;
            if offset + len + 16 > size {
                continue;
            }
            g.upload(buf, 0, &base);
            let pattern: Vec<u8> =
                (0..width).map(|i| (i as u8).wrapping_mul(29).wrapping_add(width as u8)).collect();
            let dst = MemSlice { mem: MemRef::Device(buf), offset, len };
            let (_, op) = g.submit(DeviceOp::Fill { dst, pattern: pattern.as_slice().into() }, &[]);
            g.ok(op);
            let got = g.download(buf, 0, offset + len + 16);
            let mut expected = base[..offset + len + 16].to_vec();
            for (i, b) in expected[offset..offset + len].iter_mut().enumerate() {
                *b = pattern[i % width];
            }
            assert!(got == expected, "width {width}, offset {offset}, {reps} repetitions");
        }
    }
}

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

/// [`ADD`] as a kernel.
fn add_kernel() -> KernelRef {
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::ReadWrite)
        .scalar::<u32>()
        .scalar::<u32>();
    kernel("add", sig, ImageKind::Wgsl, "add", ADD)
}

/// A whole dependent batch handed over at once, nothing waited for in between:
/// two independent chains (on different lanes) of kernels, uploads and fills, then
/// a kernel waiting on both chains' ends, then the read-back waiting on it. The
/// result is what running them one after the other computes.
#[test]
fn waits_across_operations_and_lanes() {
    let Some(mut g) = gpu("waits_across_operations_and_lanes") else { return };
    let k = add_kernel();
    let n = 4096usize;
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let (x, y, z) = (g.alloc(4 * n), g.alloc(4 * n), g.alloc(4 * n));
    let xs: Vec<u32> = (0..n as u32).collect();
    let src = MemSlice::host(std::sync::Arc::new(gantry_driver::HostStorage::from_bytes(&bytes(&xs))));
    let (up, _) = g.submit(DeviceOp::Copy { src, dst: whole(x, 4 * n) }, &[]);
    let (fill, _) =
        g.submit(DeviceOp::Fill { dst: whole(y, 4 * n), pattern: 5u32.to_ne_bytes().as_slice().into() }, &[]);
    // Chain 1: y = 2y + x + k, four times (each waits on the one before).
    let mut last_y = fill.clone();
    for step in 0..4u32 {
        let (h, _) = g.submit(
            g.launch(&k, geometry, &[(x, 4 * n), (y, 4 * n)], scalars(&[n as u32, step])),
            &[up.clone(), last_y.clone()],
        );
        last_y = h;
    }
    // Chain 2: z = 2z + x + 100, three times.
    let mut last_z = up.clone();
    for _ in 0..3 {
        let (h, _) = g.submit(
            g.launch(&k, geometry, &[(x, 4 * n), (z, 4 * n)], scalars(&[n as u32, 100])),
            &[last_z.clone()],
        );
        last_z = h;
    }
    // Join: z = 2z + y + 7, after both chains.
    let (join, _) = g.submit(
        g.launch(&k, geometry, &[(y, 4 * n), (z, 4 * n)], scalars(&[n as u32, 7])),
        &[last_y, last_z],
    );
    let host = std::sync::Arc::new(gantry_driver::HostStorage::zeroed(4 * n));
    let (_, read) =
        g.submit(DeviceOp::Copy { src: whole(z, 4 * n), dst: MemSlice::host(host.clone()) }, &[join]);
    g.ok(read);
    // SAFETY: the read-back completed; nothing else uses the storage.
    let got = u32s(unsafe { host.bytes() });
    for (i, v) in got.iter().enumerate() {
        let xi = i as u32;
        let mut yv = 5u32;
        for step in 0..4 {
            yv = yv.wrapping_mul(2).wrapping_add(xi).wrapping_add(step);
        }
        let mut zv = 0u32;
        for _ in 0..3 {
            zv = zv.wrapping_mul(2).wrapping_add(xi).wrapping_add(100);
        }
        zv = zv.wrapping_mul(2).wrapping_add(yv).wrapping_add(7);
        assert_eq!(*v, zv, "element {i}");
    }
}

/// Host memory passed along a chain handed over at once: a device → host read-back
/// into host memory, a host → device copy out of the same host memory waiting on
/// it (its bytes are staged only once the read-back has landed), then a kernel on
/// the copy and a second read-back. The result shows each step saw the one before.
#[test]
fn host_memory_between_operations_keeps_their_order() {
    let Some(mut g) = gpu("host_memory_between_operations_keeps_their_order") else { return };
    let k = add_kernel();
    let n = 1 << 16;
    let (a, b) = (g.alloc(4 * n), g.alloc(4 * n));
    let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    g.upload(a, 0, &bytes(&data));
    let host = std::sync::Arc::new(gantry_driver::HostStorage::zeroed(4 * n));
    let out = std::sync::Arc::new(gantry_driver::HostStorage::zeroed(4 * n));
    let (down, _) = g.submit(DeviceOp::Copy { src: whole(a, 4 * n), dst: MemSlice::host(host.clone()) }, &[]);
    let (up, _) =
        g.submit(DeviceOp::Copy { src: MemSlice::host(host.clone()), dst: whole(b, 4 * n) }, &[down]);
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let (add, _) =
        g.submit(g.launch(&k, geometry, &[(a, 4 * n), (b, 4 * n)], scalars(&[n as u32, 1])), &[up]);
    let (_, last) =
        g.submit(DeviceOp::Copy { src: whole(b, 4 * n), dst: MemSlice::host(out.clone()) }, &[add]);
    g.ok(last);
    // SAFETY: every operation completed; nothing else uses the storage.
    let got = u32s(unsafe { out.bytes() });
    for (i, v) in got.iter().enumerate() {
        let expected = data[i].wrapping_mul(2).wrapping_add(data[i]).wrapping_add(1);
        assert_eq!(*v, expected, "element {i}");
    }
}

/// The same dependent mix of uploads, fills, device copies, kernels and read-backs,
/// handed over at once, on a driver that uses a transfer-only queue where the device
/// has one and on one forced onto the compute queue: both compute what running the
/// operations one after the other does. With a transfer family, the transfers ran
/// on it (batches counted there) and the kernels on the compute queue, ordered
/// across the queues by the timeline semaphores alone; forced, or on a device
/// without one (lavapipe), no batch goes to a transfer queue.
#[test]
fn transfers_run_on_the_transfer_queue_where_there_is_one_ordered_against_kernels() {
    use gantry_vulkan::{TransferQueue, VulkanConfig, VulkanDriver};
    let test = "transfers_run_on_the_transfer_queue_where_there_is_one_ordered_against_kernels";
    for policy in [TransferQueue::Dedicated, TransferQueue::ComputeQueue] {
        let config = VulkanConfig { transfer_queue: policy, ..Default::default() };
        let Some(mut g) = common::Gpu::open("Vulkan", test, |ctx| VulkanDriver::new(config, ctx)) else {
            return;
        };
        let k = add_kernel();
        let n = 1 << 16;
        let geometry = Geometry::for_range(Range::d1(n)).unwrap();
        let (x, y, z) = (g.alloc(4 * n), g.alloc(4 * n), g.alloc(4 * n));
        let xs: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let src = MemSlice::host(std::sync::Arc::new(gantry_driver::HostStorage::from_bytes(&bytes(&xs))));
        // upload x; fill y with 3; y = 2y + x + 1 (kernel after both transfers);
        // copy y → z (transfer after the kernel); z = 2z + y + 2; fill the first
        // quarter of y with 9 (transfer after the kernel that reads y); read z and y.
        let (up, _) = g.submit(DeviceOp::Copy { src, dst: whole(x, 4 * n) }, &[]);
        let fill =
            |v: u32| DeviceOp::Fill { dst: whole(y, 4 * n), pattern: v.to_ne_bytes().as_slice().into() };
        let (three, _) = g.submit(fill(3), &[]);
        let (k1, _) = g
            .submit(g.launch(&k, geometry, &[(x, 4 * n), (y, 4 * n)], scalars(&[n as u32, 1])), &[up, three]);
        let (copy, _) = g.submit(DeviceOp::Copy { src: whole(y, 4 * n), dst: whole(z, 4 * n) }, &[k1]);
        let (k2, _) =
            g.submit(g.launch(&k, geometry, &[(y, 4 * n), (z, 4 * n)], scalars(&[n as u32, 2])), &[copy]);
        let quarter = MemSlice { mem: MemRef::Device(y), offset: 0, len: n };
        let (nine, _) = g.submit(
            DeviceOp::Fill { dst: quarter, pattern: 9u32.to_ne_bytes().as_slice().into() },
            std::slice::from_ref(&k2),
        );
        let (zh, yh) = (
            std::sync::Arc::new(gantry_driver::HostStorage::zeroed(4 * n)),
            std::sync::Arc::new(gantry_driver::HostStorage::zeroed(4 * n)),
        );
        let (_, read_z) =
            g.submit(DeviceOp::Copy { src: whole(z, 4 * n), dst: MemSlice::host(zh.clone()) }, &[k2]);
        let (_, read_y) =
            g.submit(DeviceOp::Copy { src: whole(y, 4 * n), dst: MemSlice::host(yh.clone()) }, &[nine]);
        g.ok(read_z);
        g.ok(read_y);
        // SAFETY: both read-backs completed; nothing else uses the storage.
        let (gz, gy) = (u32s(unsafe { zh.bytes() }), u32s(unsafe { yh.bytes() }));
        for i in 0..n {
            let y1 = 3u32.wrapping_mul(2).wrapping_add(xs[i]).wrapping_add(1);
            let z1 = y1.wrapping_mul(2).wrapping_add(y1).wrapping_add(2);
            assert_eq!(gz[i], z1, "{policy:?}: z[{i}]");
            assert_eq!(gy[i], if i < n / 4 { 9 } else { y1 }, "{policy:?}: y[{i}]");
        }
        let (driver, _) = g.into_parts();
        let stats = driver.queue_stats();
        match (policy, driver.transfer_family()) {
            (TransferQueue::Dedicated, Some(family)) => {
                assert_ne!(family, driver.compute_family());
                // Six transfers (an upload, two fills, a copy, two read-backs) and two
                // kernels.
                assert_eq!((stats.transfer_batches, stats.compute_batches), (6, 2), "{stats:?}");
                eprintln!("{test}: transfers on family {family}: {stats:?}");
            }
            (TransferQueue::ComputeQueue, Some(_)) => {
                panic!("forced onto the compute queue, yet a transfer family")
            }
            (_, None) => {
                assert_eq!((stats.transfer_batches, stats.compute_batches), (0, 8), "{policy:?}: {stats:?}");
            }
        }
    }
}
