//! The CUDA driver on a GPU, through the driver contract: PTX and CUDA C kernels, the
//! parameter and geometry conventions, local memory, copies and fills beyond what the
//! conformance suite covers, waits across streams, typed failures. On a machine
//! without CUDA each test says it was skipped and why.

mod common;

use std::sync::Arc;

use common::{bytes, gpu, kernel, scalars, u32s, whole};
use gantry_driver::AccessMode::{Read, ReadWrite, Write};
use gantry_driver::{
    DeviceOp, Driver, ExecError, Geometry, HostStorage, ImageKind, MemRef, MemSlice, NdRange, Range,
    Signature,
};
use smallvec::SmallVec;

/// `y[i] = a * x[i] + y[i]` for `i < n`, written by hand in PTX.
const SAXPY_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry saxpy_u32(
    .param .u64 x,
    .param .u64 y,
    .param .u32 n,
    .param .u32 a
)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [x];
    ld.param.u64 %rd2, [y];
    ld.param.u32 %r1, [n];
    ld.param.u32 %r2, [a];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p, %r6, %r1;
    @%p bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r6, 4;
    add.s64 %rd6, %rd3, %rd5;
    add.s64 %rd7, %rd4, %rd5;
    ld.global.u32 %r7, [%rd6];
    ld.global.u32 %r3, [%rd7];
    mad.lo.u32 %r7, %r7, %r2, %r3;
    st.global.u32 [%rd7], %r7;
DONE:
    ret;
}
"#;

fn saxpy_signature() -> Signature {
    Signature::new().global(Read).global(ReadWrite).scalar::<u32>().scalar::<u32>()
}

/// A PTX kernel over a plain range of 1000 items (blocks of 256, the last one
/// guarded by the kernel), its scalars after its pointers; three launches of one
/// image, the third after a fourth kernel's on another allocation.
#[test]
fn a_ptx_kernel_runs_over_a_plain_range_with_its_scalars() {
    let Some(mut g) = gpu("a_ptx_kernel_runs_over_a_plain_range_with_its_scalars") else { return };
    let n = 1000usize;
    let saxpy = kernel("saxpy", saxpy_signature(), ImageKind::Ptx, "saxpy_u32", SAXPY_PTX);
    let (x, y) = (g.alloc(n * 4), g.alloc((n + 24) * 4));
    g.upload(x, 0, &bytes(&(0..n as u32).collect::<Vec<_>>()));
    g.upload(y, 0, &bytes(&vec![1u32; n + 24]));
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let mut prev = Vec::new();
    let mut last = 0;
    for a in [2u32, 3, 5] {
        let op = g.launch(&saxpy, geometry, &[(x, n * 4), (y, n * 4)], scalars(&[n as u32, a]));
        let (h, id) = g.submit(op, &prev);
        prev = vec![h];
        last = id;
    }
    g.ok(last);
    let got = u32s(&g.download(y, 0, (n + 24) * 4));
    let expected: Vec<u32> = (0..n as u32).map(|i| 1 + 10 * i).chain([1; 24]).collect();
    assert_eq!(got, expected, "the tail past n is untouched: the kernel's guard held");
    assert_eq!(g.driver.loaded_images(), 1, "one image loaded for three launches");
}

const TILE_C: &str = r#"
extern "C" __global__ void tile(const unsigned int* in, unsigned int* out, unsigned int width) {
    extern __shared__ unsigned int shared[];
    unsigned int row = blockIdx.y * blockDim.y + threadIdx.y;
    unsigned int col = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int local = threadIdx.y * blockDim.x + threadIdx.x;
    unsigned int size = blockDim.x * blockDim.y;
    shared[local] = in[row * width + col];
    __syncthreads();
    out[row * width + col] = shared[size - 1 - local] + 1000 * blockIdx.y + blockIdx.x;
}
"#;

/// A CUDA C kernel over a 2-D ND-range: the fastest dimension is `x`, groups are
/// blocks, and the signature's local memory is the block's shared memory, shared by
/// its work-items across a barrier.
#[test]
fn a_cuda_c_kernel_runs_over_a_2d_nd_range_with_local_memory() {
    let Some(mut g) = gpu("a_cuda_c_kernel_runs_over_a_2d_nd_range_with_local_memory") else { return };
    if let Some(why) = g.driver.cuda_c_unavailable() {
        panic!("the device runs but CUDA C does not compile: {why}");
    }
    let (rows, cols, lr, lc) = (8usize, 64usize, 2usize, 32usize);
    let sig = Signature::new().global(Read).global(Write).scalar::<u32>().local(lr * lc * 4);
    let tile = kernel("tile", sig, ImageKind::CudaC, "tile", TILE_C);
    let input: Vec<u32> = (0..(rows * cols) as u32).map(|v| v.wrapping_mul(2_654_435_761)).collect();
    let (a, b) = (g.alloc(rows * cols * 4), g.alloc(rows * cols * 4));
    g.upload(a, 0, &bytes(&input));
    let geometry = NdRange::new([rows, cols], [lr, lc]).geometry().unwrap();
    let op =
        g.launch(&tile, geometry, &[(a, rows * cols * 4), (b, rows * cols * 4)], scalars(&[cols as u32]));
    let (_, id) = g.submit(op, &[]);
    g.ok(id);
    let got = u32s(&g.download(b, 0, rows * cols * 4));
    for row in 0..rows {
        for col in 0..cols {
            let (group_row, group_col) = (row / lr, col / lc);
            let local = (row % lr) * lc + col % lc;
            let mirror = lr * lc - 1 - local;
            let (mr, mc) = (group_row * lr + mirror / lc, group_col * lc + mirror % lc);
            let expected = input[mr * cols + mc] + 1000 * group_row as u32 + group_col as u32;
            assert_eq!(got[row * cols + col], expected, "row {row}, col {col}");
        }
    }
}

const BIG_SHARED_C: &str = r#"
extern "C" __global__ void big_shared(unsigned int* out, unsigned int words) {
    extern __shared__ unsigned int shared[];
    for (unsigned int j = threadIdx.x; j < words; j += blockDim.x) shared[j] = j * 3u;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = shared[words - 1 - threadIdx.x];
}
"#;

/// Local memory past the 48 KiB every kernel gets: the driver opts the kernel in.
#[test]
fn local_memory_beyond_48_kib_is_granted() {
    let Some(mut g) = gpu("local_memory_beyond_48_kib_is_granted") else { return };
    let words = 100 * 1024 / 4;
    assert!(g.driver.info().caps.max_local_memory >= words * 4, "{:?}", g.driver.info().caps);
    let sig = Signature::new().global(Write).scalar::<u32>().local(words * 4);
    let k = kernel("big_shared", sig, ImageKind::CudaC, "big_shared", BIG_SHARED_C);
    let out = g.alloc(512 * 4);
    let geometry = NdRange::new(512, 256).geometry().unwrap();
    let op = g.launch(&k, geometry, &[(out, 512 * 4)], scalars(&[words as u32]));
    let (_, id) = g.submit(op, &[]);
    g.ok(id);
    let got = u32s(&g.download(out, 0, 512 * 4));
    let expected: Vec<u32> = (0..512u32).map(|i| (words as u32 - 1 - i % 256) * 3).collect();
    assert_eq!(got, expected);
}

/// Images that do not compile, do not load or lack their entry point, and a launch
/// the device refuses, fail their operation with the backend's call and status;
/// their dependents fail with a dependency error and run nothing; the device goes on
/// (none of these is sticky).
#[test]
fn broken_images_and_refused_launches_are_typed_and_not_sticky() {
    let Some(mut g) = gpu("broken_images_and_refused_launches_are_typed_and_not_sticky") else { return };
    let n = 256usize;
    let (x, y) = (g.alloc(n * 4), g.alloc(n * 4));
    g.upload(y, 0, &bytes(&vec![9u32; n]));
    let sig = saxpy_signature();
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let cases = [
        (
            kernel("typo", sig.clone(), ImageKind::CudaC, "typo", "extern \"C\" __global__ void typo( {"),
            "nvrtcCompileProgram",
            "NVRTC_ERROR_COMPILATION",
        ),
        (
            kernel("garbage", sig.clone(), ImageKind::Ptx, "garbage", "this is not PTX"),
            "cuModuleLoadDataEx",
            "CUDA_ERROR_INVALID_",
        ),
        (
            kernel("absent", sig.clone(), ImageKind::Ptx, "no_such_entry", SAXPY_PTX),
            "cuModuleGetFunction",
            "CUDA_ERROR_NOT_FOUND",
        ),
    ];
    for (k, call, status) in &cases {
        let op = g.launch(k, geometry, &[(x, n * 4), (y, n * 4)], scalars(&[n as u32, 2]));
        let (h, id) = g.submit(op, &[]);
        let fill = DeviceOp::Fill { dst: whole(y, n * 4), pattern: SmallVec::from_slice(&[0xAB]) };
        let (_, dependent) = g.submit(fill, &[h]);
        match g.result(id) {
            Err(ExecError::Backend { call: c, status: s, message, .. }) => {
                assert_eq!(c, *call, "{message}");
                assert!(s.name.starts_with(status), "{} is not {status}: {message}", s.name);
                assert!(message.contains(&*k.name), "{message}");
            }
            other => panic!("kernel `{}`: {other:?}", k.name),
        }
        assert!(matches!(g.result(dependent), Err(ExecError::DependencyFailed { .. })));
    }
    // A block of 2048 work-items: more than any CUDA device allows.
    let saxpy = kernel("saxpy", sig, ImageKind::Ptx, "saxpy_u32", SAXPY_PTX);
    let too_wide = NdRange::new(2048, 2048).geometry().unwrap();
    let big = g.alloc(2048 * 4);
    let op = g.launch(&saxpy, too_wide, &[(big, 2048 * 4), (big, 2048 * 4)], scalars(&[2048, 2]));
    let (_, id) = g.submit(op, &[]);
    match g.result(id) {
        Err(ExecError::Backend { call: "cuLaunchKernel", message, .. }) => assert!(message.contains("2048")),
        other => panic!("a block of 2048: {other:?}"),
    }
    assert_eq!(u32s(&g.download(y, 0, n * 4)), vec![9; n], "no dependent ran");
    let op = g.launch(&saxpy, geometry, &[(x, n * 4), (y, n * 4)], scalars(&[n as u32, 2]));
    let (_, id) = g.submit(op, &[]);
    g.ok(id);
    assert_eq!(u32s(&g.download(y, 0, n * 4)), vec![9; n], "x is zero: y = 2 * 0 + 9");
}

/// Noise bytes.
fn noise(len: usize, seed: u32) -> Vec<u8> {
    let mut v = seed.wrapping_mul(2_654_435_761) | 1;
    (0..len)
        .map(|_| {
            v ^= v << 13;
            v ^= v >> 17;
            v ^= v << 5;
            v as u8
        })
        .collect()
}

/// Copies larger than the staging memory (several chunks) at odd offsets both ways,
/// overlapping copies inside one allocation in both directions, a host-to-host copy,
/// and fills of widths 1 to 24 at unaligned offsets over a megabyte.
#[test]
fn large_copies_overlapping_copies_and_fills_of_any_width() {
    let Some(mut g) = gpu("large_copies_overlapping_copies_and_fills_of_any_width") else { return };
    let len = 20 * 1024 * 1024 + 3;
    let data = noise(len, 7);
    let dev = g.alloc(len + 16);
    let src = Arc::new(HostStorage::from_bytes(&data));
    let back = Arc::new(HostStorage::zeroed(len + 5));
    let up = DeviceOp::Copy {
        src: MemSlice::host(src.clone()),
        dst: MemSlice { mem: MemRef::Device(dev), offset: 9, len },
    };
    let (h, _) = g.submit(up, &[]);
    let down = DeviceOp::Copy {
        src: MemSlice { mem: MemRef::Device(dev), offset: 9, len },
        dst: MemSlice { mem: MemRef::Host(back.clone()), offset: 5, len },
    };
    let (_, id) = g.submit(down, &[h]);
    g.ok(id);
    // SAFETY: the copy into it has completed.
    let got = unsafe { back.bytes() };
    assert!(got[..5].iter().all(|&b| b == 0), "bytes before the copied range untouched");
    assert!(got[5..] == data[..], "20 MiB through the staging memory, in chunks");

    // Overlapping copies within one allocation, forwards and backwards.
    let m = 1 << 20;
    let base = noise(m, 11);
    let a = g.alloc(m);
    g.upload(a, 0, &base);
    let mut model = base.clone();
    let forward = DeviceOp::Copy {
        src: MemSlice { mem: MemRef::Device(a), offset: 0, len: m - 4096 },
        dst: MemSlice { mem: MemRef::Device(a), offset: 1, len: m - 4096 },
    };
    let (h, _) = g.submit(forward, &[]);
    model.copy_within(0..m - 4096, 1);
    let backward = DeviceOp::Copy {
        src: MemSlice { mem: MemRef::Device(a), offset: 777, len: 300_000 },
        dst: MemSlice { mem: MemRef::Device(a), offset: 13, len: 300_000 },
    };
    let (_, id) = g.submit(backward, &[h]);
    model.copy_within(777..777 + 300_000, 13);
    g.ok(id);
    assert!(g.download(a, 0, m) == model, "overlapping copies as memmove would make them");

    // Host to host, in stream order after a download into the source.
    let staged = Arc::new(HostStorage::zeroed(4096));
    let copied = Arc::new(HostStorage::zeroed(4096));
    let into = DeviceOp::Copy {
        src: MemSlice { mem: MemRef::Device(a), offset: 0, len: 4096 },
        dst: MemSlice::host(staged.clone()),
    };
    let (h, _) = g.submit(into, &[]);
    let across = DeviceOp::Copy { src: MemSlice::host(staged.clone()), dst: MemSlice::host(copied.clone()) };
    let (_, id) = g.submit(across, &[h]);
    g.ok(id);
    // SAFETY: completed.
    assert!(unsafe { copied.bytes() } == &model[..4096], "host-to-host after the download it waits on");

    // Fills of every width at offsets that are and are not multiples of it.
    let f = g.alloc(m + 64);
    g.upload(f, 0, &vec![0x5A; m + 64]);
    let mut model = vec![0x5A; m + 64];
    let mut at = 1;
    for width in [1usize, 2, 3, 4, 5, 8, 12, 16, 24] {
        let pattern: Vec<u8> = (0..width).map(|b| (b as u8 + 1).wrapping_mul(29) ^ width as u8).collect();
        let reps = (m / 16) / width;
        let range = width * reps;
        for (k, byte) in model[at..at + range].iter_mut().enumerate() {
            *byte = pattern[k % width];
        }
        let fill = DeviceOp::Fill {
            dst: MemSlice { mem: MemRef::Device(f), offset: at, len: range },
            pattern: SmallVec::from_slice(&pattern),
        };
        let (_, id) = g.submit(fill, &[]);
        g.ok(id);
        at += range + width % 3;
    }
    let got = g.download(f, 0, m + 64);
    if let Some(i) = (0..got.len()).find(|&i| got[i] != model[i]) {
        panic!("fills: byte {i} is {:#x}, expected {:#x}", got[i], model[i]);
    }
}

const ADD_C: &str = r#"
extern "C" __global__ void add(const unsigned int* a, const unsigned int* b, unsigned int* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
"#;

const SET_C: &str = r#"
extern "C" __global__ void set(unsigned int* x, unsigned int n, unsigned int value, unsigned int spin) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int v = value;
    for (unsigned int k = 0; k < spin; k++) v = v * 1664525u + 1013904223u;
    if (i < n) x[i] = v;
}
"#;

/// 40 rounds of two independent kernels (on different streams: nothing to wait on)
/// and a third that waits on both (a wait across streams): every sum is right, and
/// each completion starts no earlier than what it waited on ended.
#[test]
fn waits_across_streams_order_dependent_kernels() {
    let Some(mut g) = gpu("waits_across_streams_order_dependent_kernels") else { return };
    let n = 1 << 16;
    let set_sig = Signature::new().global(Write).scalar::<u32>().scalar::<u32>().scalar::<u32>();
    let set = kernel("set", set_sig, ImageKind::CudaC, "set", SET_C);
    let add_sig = Signature::new().global(Read).global(Read).global(Write).scalar::<u32>();
    let add = kernel("add", add_sig, ImageKind::CudaC, "add", ADD_C);
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let lcg = |mut v: u32, spin: u32| {
        for _ in 0..spin {
            v = v.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        }
        v
    };
    for round in 0..40u32 {
        let (a, b, out) = (g.alloc(n * 4), g.alloc(n * 4), g.alloc(n * 4));
        // The first kernel is slow (a long loop per item): an unordered sum would
        // read its output before it is written.
        let (ha, ia) =
            g.submit(g.launch(&set, geometry, &[(a, n * 4)], scalars(&[n as u32, round, 4000])), &[]);
        let (hb, ib) = g.submit(g.launch(&set, geometry, &[(b, n * 4)], scalars(&[n as u32, 7, 1])), &[]);
        let sum = g.launch(&add, geometry, &[(a, n * 4), (b, n * 4), (out, n * 4)], scalars(&[n as u32]));
        let (_, is) = g.submit(sum, &[ha, hb]);
        let (ca, cb, cs) = (g.completion(ia), g.completion(ib), g.completion(is));
        assert!(cs.result.is_ok(), "{:?}", cs.result);
        assert!(ca.lane != cb.lane, "independent kernels go to different streams");
        assert!(cs.started_ns >= ca.ended_ns.max(cb.ended_ns), "round {round}: {ca:?} {cb:?} {cs:?}");
        let expected = lcg(round, 4000).wrapping_add(lcg(7, 1));
        let got = u32s(&g.download(out, 0, n * 4));
        assert!(got.iter().all(|&v| v == expected), "round {round}: {:#x} != {expected:#x}", got[0]);
        for id in [a, b, out] {
            g.driver.free(id);
        }
    }
}

/// An allocation the device cannot hold is `OutOfMemory`; host tasks are refused as
/// unsupported; a kernel argument in host memory is a typed
/// error; the driver goes on.
#[test]
fn what_the_driver_does_not_do_is_a_typed_error() {
    let Some(mut g) = gpu("what_the_driver_does_not_do_is_a_typed_error") else { return };
    assert!(
        matches!(g.driver.alloc(1 << 50), Err(ExecError::OutOfMemory { requested, .. }) if requested == 1 << 50)
    );
    let task =
        gantry_driver::HostTask { name: "task".into(), tag: 0, run: Box::new(|_| {}), args: SmallVec::new() };
    let (_, id) = g.submit(DeviceOp::HostTask(task), &[]);
    assert!(matches!(g.result(id), Err(ExecError::Unsupported { what: "host tasks", .. })));
    let saxpy = kernel("saxpy", saxpy_signature(), ImageKind::Ptx, "saxpy_u32", SAXPY_PTX);
    let host = Arc::new(HostStorage::zeroed(64));
    let y = g.alloc(64);
    let op = DeviceOp::Kernel(gantry_driver::KernelLaunch {
        kernel: saxpy,
        geometry: Geometry::for_range(Range::d1(16)).unwrap(),
        args: [
            gantry_driver::MemArg { mem: MemSlice::host(host), mode: Read },
            gantry_driver::MemArg { mem: whole(y, 64), mode: ReadWrite },
        ]
        .into_iter()
        .collect(),
        scalars: scalars(&[16, 1]),
    });
    let (_, id) = g.submit(op, &[]);
    match g.result(id) {
        Err(ExecError::Driver { message, .. }) => assert!(message.contains("host memory"), "{message}"),
        other => panic!("{other:?}"),
    }
    let after = g.alloc(1 << 20);
    assert_eq!(g.download(after, 0, 1 << 20), vec![0; 1 << 20], "a fresh allocation reads as zeros");
}

/// Dropping the driver with a chain in flight completes every operation, exactly
/// once, before the drop returns.
#[test]
fn dropping_the_driver_completes_what_is_in_flight() {
    let Some(mut g) = gpu("dropping_the_driver_completes_what_is_in_flight") else { return };
    let n = 1 << 16;
    let set_sig = Signature::new().global(Write).scalar::<u32>().scalar::<u32>().scalar::<u32>();
    let set = kernel("set", set_sig, ImageKind::CudaC, "set", SET_C);
    let x = g.alloc(n * 4);
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let mut prev = Vec::new();
    let mut ids = Vec::new();
    for k in 0..20u32 {
        let (h, id) = g.submit(g.launch(&set, geometry, &[(x, n * 4)], scalars(&[n as u32, k, 2000])), &prev);
        prev = vec![h];
        ids.push(id);
    }
    let (driver, rx) = g.into_parts();
    drop(driver);
    // Every completion was sent before the drop returned.
    let mut got: Vec<(u64, bool)> = rx.try_iter().map(|c| (c.op.0, c.result.is_ok())).collect();
    got.sort();
    assert_eq!(got, ids.iter().map(|&id| (id, true)).collect::<Vec<_>>());
}
