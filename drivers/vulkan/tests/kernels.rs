//! Kernels on a Vulkan device (lavapipe in CI), on real data: WGSL compiled by
//! naga (scalars in push constants, a plain range with a guarded tail, a 2-D
//! ND-range with workgroup memory and barriers), SPIR-V built from GLSL by
//! glslangValidator at test time, and the typed errors of kernels the driver
//! refuses. Each test says it was skipped, and why, where there is no Vulkan.

mod common;

use common::{bytes, gpu, kernel, scalars, u32s, whole};
use gantry_driver::{
    AccessMode, DeviceOp, ExecError, Geometry, ImageKind, KernelLaunch, MemArg, MemRef, MemSlice, NdRange,
    Range, ScalarBlock, Signature,
};

const SCALE: &str = "
struct S { n: u32, a: f32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<u32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn scale(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = s.a * f32(x[id.x]); }
}";

/// A WGSL kernel with a `u32` and an `f32` scalar over a plain range of 1,000
/// items: 16 groups of 64 run 1,024 invocations, the guard keeps the last 24 from
/// writing, and the elements past the range keep their sentinel.
#[test]
fn wgsl_scalars_over_a_plain_range_with_a_guarded_tail() {
    let Some(mut g) = gpu("wgsl_scalars_over_a_plain_range_with_a_guarded_tail") else { return };
    let sig =
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).scalar::<u32>().scalar::<f32>();
    let k = kernel("scale", sig, ImageKind::Wgsl, "scale", SCALE);
    let (n, len) = (1000usize, 1024usize);
    let (x, y) = (g.alloc(4 * len), g.alloc(4 * len));
    g.upload(x, 0, &bytes(&(0..len as u32).collect::<Vec<_>>()));
    let (_, fill) = g.submit(
        DeviceOp::Fill { dst: whole(y, 4 * len), pattern: (-1.0f32).to_ne_bytes().as_slice().into() },
        &[],
    );
    g.ok(fill);
    let mut block: ScalarBlock = (n as u32).to_ne_bytes().into_iter().collect();
    block.extend_from_slice(&2.5f32.to_ne_bytes());
    let launch =
        g.launch(&k, Geometry::for_range(Range::d1(n)).unwrap(), &[(x, 4 * len), (y, 4 * len)], block);
    let (_, op) = g.submit(launch, &[]);
    g.ok(op);
    let got: Vec<f32> = u32s(&g.download(y, 0, 4 * len)).into_iter().map(f32::from_bits).collect();
    for (i, v) in got.iter().enumerate() {
        let expected = if i < n { 2.5 * i as f32 } else { -1.0 };
        assert_eq!(*v, expected, "element {i}");
    }
}

const GROUP_SUMS: &str = "
struct S { cols: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> m: array<u32>;
@group(0) @binding(1) var<storage, read_write> sums: array<u32>;
override wx: u32;
override wy: u32;
var<workgroup> tile: array<u32, 64>;
@compute @workgroup_size(wx, wy)
fn group_sums(@builtin(global_invocation_id) g: vec3<u32>,
              @builtin(local_invocation_index) li: u32,
              @builtin(workgroup_id) wg: vec3<u32>,
              @builtin(num_workgroups) nw: vec3<u32>) {
    tile[li] = m[g.y * s.cols + g.x];
    workgroupBarrier();
    for (var step = 32u; step > 0u; step = step / 2u) {
        if li < step { tile[li] = tile[li] + tile[li + step]; }
        workgroupBarrier();
    }
    if li == 0u { sums[wg.y * nw.x + wg.x] = tile[0]; }
}";

/// A 2-D ND-range `[32, 128]` in groups of `[4, 16]`: Vulkan's `x` is the column
/// (the fastest dimension), each group sums its 64 elements through workgroup
/// memory with barriers between the steps of a tree reduction, and the 64 sums
/// match the host's.
#[test]
fn a_2d_nd_range_reduces_through_workgroup_memory_and_barriers() {
    let Some(mut g) = gpu("a_2d_nd_range_reduces_through_workgroup_memory_and_barriers") else { return };
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write).scalar::<u32>().local(256);
    let k = kernel("group_sums", sig, ImageKind::Wgsl, "group_sums", GROUP_SUMS);
    let (rows, cols, lr, lc) = (32usize, 128usize, 4usize, 16usize);
    let data: Vec<u32> = (0..(rows * cols) as u32).map(|i| i.wrapping_mul(2_654_435_761) >> 8).collect();
    let groups = (rows / lr) * (cols / lc);
    let (m, sums) = (g.alloc(4 * data.len()), g.alloc(4 * groups));
    g.upload(m, 0, &bytes(&data));
    let geometry = NdRange::new([rows, cols], [lr, lc]).geometry().unwrap();
    let launch = g.launch(&k, geometry, &[(m, 4 * data.len()), (sums, 4 * groups)], scalars(&[cols as u32]));
    let (_, op) = g.submit(launch, &[]);
    g.ok(op);
    let got = u32s(&g.download(sums, 0, 4 * groups));
    let mut expected = vec![0u32; groups];
    for r in 0..rows {
        for c in 0..cols {
            let group = (r / lr) * (cols / lc) + c / lc;
            expected[group] = expected[group].wrapping_add(data[r * cols + c]);
        }
    }
    assert_eq!(got, expected);
}

const GLSL: &str = "#version 450
layout(local_size_x_id = 0) in;
layout(push_constant) uniform S { uint n; uint add; } s;
layout(std430, set = 0, binding = 0) buffer X { uint x[]; };
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < s.n) x[i] = x[i] * 3u + s.add;
}
";

/// GLSL compiled to SPIR-V by glslangValidator at test time (skipped where it is
/// not installed): its workgroup size is a specialization constant, set to the
/// ND-range's local size (32) and to the plain-range default (64), one pipeline
/// each.
#[test]
fn spirv_from_glsl_with_a_specialized_workgroup_size() {
    let Some(mut g) = gpu("spirv_from_glsl_with_a_specialized_workgroup_size") else { return };
    let dir = std::env::temp_dir().join(format!("gantry-vulkan-glsl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, spv) = (dir.join("k.comp"), dir.join("k.spv"));
    std::fs::write(&src, GLSL).unwrap();
    let built = std::process::Command::new("glslangValidator")
        .args(["-V", "--target-env", "vulkan1.2", "-o"])
        .arg(&spv)
        .arg(&src)
        .output();
    let words = match built {
        Ok(out) if out.status.success() => std::fs::read(&spv).unwrap(),
        Ok(out) => panic!("glslangValidator failed: {}", String::from_utf8_lossy(&out.stdout)),
        Err(e) => {
            eprintln!(
                "`spirv_from_glsl_with_a_specialized_workgroup_size` skipped: no glslangValidator: {e}"
            );
            return;
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>().scalar::<u32>();
    let image = gantry_driver::CodeImage::new(ImageKind::SpirV, "main", words);
    let k = gantry_driver::Kernel::new("triple_add", sig).with_image(image).into_ref();
    let len = 256usize;
    let x = g.alloc(4 * len);
    g.upload(x, 0, &bytes(&(0..len as u32).collect::<Vec<_>>()));
    let before = g.driver.pipeline_stats().created;
    let nd = NdRange::new(len, 32).geometry().unwrap();
    let (_, a) = g.submit(g.launch(&k, nd, &[(x, 4 * len)], scalars(&[len as u32, 1])), &[]);
    g.ok(a);
    let plain = Geometry::for_range(Range::d1(100)).unwrap();
    let (_, b) = g.submit(g.launch(&k, plain, &[(x, 4 * len)], scalars(&[100, 0])), &[]);
    g.ok(b);
    let got = u32s(&g.download(x, 0, 4 * len));
    for (i, v) in got.iter().enumerate() {
        let once = 3 * i as u32 + 1;
        assert_eq!(*v, if i < 100 { 3 * once } else { once }, "element {i}");
    }
    assert_eq!(g.driver.pipeline_stats().created - before, 2, "a pipeline per workgroup size");
}

/// WGSL images that do not compile (a syntax error, a type error, no entry point of
/// the image's name) fail their launch with the driver's error naming the kernel
/// and naga's message; the driver goes on.
#[test]
fn broken_wgsl_is_a_typed_error_naming_the_naga_error() {
    let Some(mut g) = gpu("broken_wgsl_is_a_typed_error_naming_the_naga_error") else { return };
    let x = g.alloc(256);
    let cases = [
        (
            "unparsable",
            "@compute @workgroup_size(64) fn main() { let v: u32 = ; }",
            "does not parse",
            "expected",
        ),
        (
            "mistyped",
            "@compute @workgroup_size(64) fn main() { let v: u32 = 1.5; }",
            "does not parse",
            "AbstractFloat",
        ),
        ("entryless", "@compute @workgroup_size(64) fn other() {}", "no compute entry point `main`", "main"),
    ];
    for (name, source, what, naga) in cases {
        let k = kernel(name, Signature::new().global(AccessMode::ReadWrite), ImageKind::Wgsl, "main", source);
        let (_, op) = g.submit(
            g.launch(&k, Geometry::for_range(Range::d1(64)).unwrap(), &[(x, 256)], ScalarBlock::new()),
            &[],
        );
        match g.result(op) {
            Err(ExecError::Driver { message, .. }) => {
                assert!(message.contains(&format!("kernel `{name}`")) && message.contains(what), "{message}");
                assert!(message.contains(naga), "naga's message is kept: {message}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    g.upload(x, 0, &[1; 256]);
}

/// An ND-range whose local size is not the shader's fixed workgroup size, and a
/// buffer range at an offset the device cannot bind, are refused with errors that
/// say so; nothing runs.
#[test]
fn mismatched_local_sizes_and_unaligned_ranges_are_refused() {
    let Some(mut g) = gpu("mismatched_local_sizes_and_unaligned_ranges_are_refused") else { return };
    let sig =
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).scalar::<u32>().scalar::<f32>();
    let k = kernel("scale", sig, ImageKind::Wgsl, "scale", SCALE);
    let (x, y) = (g.alloc(4096), g.alloc(4096));
    let mut block: ScalarBlock = 256u32.to_ne_bytes().into_iter().collect();
    block.extend_from_slice(&1.0f32.to_ne_bytes());
    let nd = NdRange::new(256, 32).geometry().unwrap();
    let (_, op) = g.submit(g.launch(&k, nd, &[(x, 1024), (y, 1024)], block.clone()), &[]);
    match g.result(op) {
        Err(ExecError::Driver { message, .. }) => {
            assert!(message.contains("kernel `scale`") && message.contains("does not match"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let align = g.driver.limits().storage_align as usize;
    let offset = if align > 4 { 4 } else { return };
    let args = [
        MemArg { mem: MemSlice { mem: MemRef::Device(x), offset, len: 1024 }, mode: AccessMode::Read },
        MemArg { mem: whole(y, 1024), mode: AccessMode::Write },
    ];
    let launch = DeviceOp::Kernel(KernelLaunch {
        kernel: k.clone(),
        geometry: Geometry::for_range(Range::d1(256)).unwrap(),
        args: args.into_iter().collect(),
        scalars: block,
    });
    let (_, op) = g.submit(launch, &[]);
    match g.result(op) {
        Err(ExecError::Driver { message, .. }) => {
            assert!(message.contains("minStorageBufferOffsetAlignment"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(g.download(y, 0, 1024), vec![0; 1024], "nothing ran");
}
