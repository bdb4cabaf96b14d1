//! WGSL kernel fusion on a Vulkan device (lavapipe in CI), on real data: a fused
//! chain computes the unfused chain's bits, with and without barriers, its
//! intermediates internalized; refusals carry the shared rules' typed reasons;
//! a buffer reached other than by indexing is not internalized, with its warning,
//! and the result stays right. Each test says it was skipped, and why, where
//! there is no Vulkan.

mod common;

use common::{gpu, kernel, scalars};
use gantry_driver::fusion::{
    FusionArg, FusionCompiler, FusionError, FusionKernel, FusionRequest, FusionWarning, Promotion,
    PromotionMismatch,
};
use gantry_driver::{
    AccessMode::*, AllocId, Geometry, ImageKind, KernelRef, NdRange, Range, ScalarBlock, Signature,
};
use gantry_vulkan::WgslFusion;

use gantry_conformance::step_chain::{self, coefficients, WGSL as STEP};

/// A step that reads its input's length (`arrayLength`): not internalizable.
const STEP_LEN: &str = "
struct S { n: u32, a: f32, b: f32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn step_len(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < min(s.n, arrayLength(&x)) { y[id.x] = s.a * x[id.x] + s.b; }
}";

/// A kernel with a workgroup barrier.
const BARRIER: &str = "
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
var<workgroup> tile: array<f32, 64>;
@compute @workgroup_size(64)
fn with_barrier(@builtin(global_invocation_id) id: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>) {
    tile[l.x] = y[id.x];
    workgroupBarrier();
    y[id.x] = tile[63u - l.x];
}";

/// A step that reads its right neighbour: work-items share elements.
const NEIGHBOUR: &str = "
struct S { n: u32, a: f32, b: f32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn neighbour(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { y[id.x] = s.a * x[min(id.x + 1u, s.n - 1u)] + s.b; }
}";

fn step_kernel(name: &str, source: &str) -> KernelRef {
    kernel(name, step_chain::signature(), ImageKind::Wgsl, name, source)
}

fn step_scalars(n: usize, k: usize) -> ScalarBlock {
    let (a, b) = coefficients(k);
    let mut s = scalars(&[n as u32]);
    s.extend(a.to_ne_bytes());
    s.extend(b.to_ne_bytes());
    s
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

/// The request for `steps` chained steps over buffers `0..=steps` (ids 1..), the
/// intermediates promoted to private memory where `promote`.
fn chain(
    kernels: &[KernelRef],
    n: usize,
    geometry: Geometry,
    promote: bool,
    barriers: bool,
) -> FusionRequest {
    let steps = kernels.len();
    let slot = |buffer: usize, internal: bool| {
        let a = FusionArg::new(buffer as u64 + 1, 0..4 * n, 4);
        if internal && promote {
            a.promoted(Promotion::Private)
        } else {
            a
        }
    };
    FusionRequest {
        kernels: (0..steps)
            .map(|k| FusionKernel {
                kernel: kernels[k].clone(),
                geometry,
                args: [slot(k, k > 0), slot(k + 1, k + 1 < steps)].into_iter().collect(),
                scalars: step_scalars(n, k),
                deps: Default::default(),
            })
            .collect(),
        barriers,
    }
}

/// Barriers between kernels that each touch only their own elements are left out of
/// the fused shader (they change nothing, and on a GPU they hold every work-group
/// until its stores are done); a kernel reading its neighbour keeps them.
#[test]
fn barriers_between_own_element_kernels_are_elided() {
    let n = 4096;
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let step = step_kernel("step", STEP);
    let barriers_in = |request: &FusionRequest| {
        let fused = WgslFusion::new().fuse(request).unwrap();
        let image = fused.kernel.image(ImageKind::Wgsl).expect("a WGSL image");
        std::str::from_utf8(image.code()).unwrap().matches("workgroupBarrier").count()
    };
    assert_eq!(barriers_in(&chain(&vec![step.clone(); 4], n, geometry, true, true)), 0, "own elements only");
    let neighbour = step_kernel("neighbour", NEIGHBOUR);
    let mixed = [step.clone(), neighbour, step];
    assert_eq!(
        barriers_in(&chain(&mixed, n, geometry, false, true)),
        2,
        "one barrier between each two kernels"
    );
}

/// Runs the fused kernel of `request` over `table` (buffer id `i + 1` is
/// `table[i]`).
fn run_fused(g: &mut common::Gpu, fused: &gantry_driver::fusion::Fused, table: &[AllocId], n: usize) {
    let args: Vec<(AllocId, usize)> =
        fused.args.iter().map(|a| (table[a.buffer as usize - 1], 4 * n)).collect();
    let op = g.launch(&fused.kernel, fused.geometry, &args, fused.scalars.clone());
    let (_, id) = g.submit(op, &[]);
    g.ok(id);
}

/// Runs the chain's kernels one by one over `table`.
fn run_unfused(g: &mut common::Gpu, request: &FusionRequest, table: &[AllocId], n: usize) {
    for (k, fk) in request.kernels.iter().enumerate() {
        let op = g.launch(
            &fk.kernel,
            fk.geometry,
            &[(table[k], 4 * n), (table[k + 1], 4 * n)],
            fk.scalars.clone(),
        );
        let (_, id) = g.submit(op, &[]);
        g.ok(id);
    }
}

/// Eight steps fused into one kernel (the seven intermediates in private memory,
/// never written back) compute exactly the unfused chain's bits and the host
/// reference's, with and without barriers; fusing the same chain again is a
/// cache hit.
#[test]
fn a_fused_chain_computes_the_unfused_chain_bit_for_bit() {
    let Some(mut g) = gpu("a_fused_chain_computes_the_unfused_chain_bit_for_bit") else { return };
    let n = 100_003usize;
    let x: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 / 7.0).collect();
    let expected = step_chain::reference(&x, 8);
    let step = step_kernel("step", STEP);
    let kernels = vec![step; 8];
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let fusion = WgslFusion::new();
    let unfused_table: Vec<AllocId> = (0..9).map(|_| g.alloc(4 * n)).collect();
    g.upload(unfused_table[0], 0, &bytes_f32(&x));
    run_unfused(&mut g, &chain(&kernels, n, geometry, false, true), &unfused_table, n);
    let unfused = f32s(&g.download(unfused_table[8], 0, 4 * n));
    assert!(unfused.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "unfused vs the host");
    for barriers in [true, false] {
        let request = chain(&kernels, n, geometry, true, barriers);
        let fused = fusion.fuse(&request).unwrap();
        assert_eq!(fused.args.len(), 2, "input and output are the only global arguments");
        assert_eq!(fused.internal.len(), 7);
        assert!(fused.scalars.is_empty() && fused.warnings.is_empty(), "{:?}", fused.warnings);
        let table: Vec<AllocId> = (0..9).map(|_| g.alloc(4 * n)).collect();
        g.upload(table[0], 0, &bytes_f32(&x));
        let sentinel = vec![-1f32; n];
        g.upload(table[4], 0, &bytes_f32(&sentinel));
        run_fused(&mut g, &fused, &table, n);
        let got = f32s(&g.download(table[8], 0, 4 * n));
        let wrong = (0..n).filter(|&i| got[i].to_bits() != unfused[i].to_bits()).count();
        assert_eq!(wrong, 0, "barriers {barriers}: {wrong} elements differ from the unfused chain");
        assert_eq!(
            f32s(&g.download(table[4], 0, 4 * n)),
            sentinel,
            "an internalized intermediate is never written"
        );
    }
    let again = fusion.fuse(&chain(&kernels, n, geometry, true, true)).unwrap();
    assert!(again.cached);
    assert_eq!((fusion.stats().hits, fusion.stats().misses), (1, 2));
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_ne_bytes()).collect()
}

/// A step that passes its input to `arrayLength` keeps the promoted buffer in
/// global memory with `AccessNotRewritable`, and the fused result is still the
/// unfused one; other kernels' promoted buffers are internalized.
#[test]
fn a_buffer_reached_other_than_by_index_stays_global_with_its_warning() {
    let Some(mut g) = gpu("a_buffer_reached_other_than_by_index_stays_global_with_its_warning") else {
        return;
    };
    let n = 4096usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let step = step_kernel("step", STEP);
    let kernels = vec![step.clone(), step_kernel("step_len", STEP_LEN), step];
    let geometry = Geometry::for_range(Range::d1(n)).unwrap();
    let request = chain(&kernels, n, geometry, true, true);
    let fused = WgslFusion::new().fuse(&request).unwrap();
    assert_eq!(
        fused.warnings,
        [FusionWarning::PromotionDropped {
            buffer: 2,
            reason: PromotionMismatch::AccessNotRewritable { kernel: "step_len".into() }
        }]
    );
    assert_eq!((fused.args.len(), fused.internal.len()), (3, 1));
    let table: Vec<AllocId> = (0..4).map(|_| g.alloc(4 * n)).collect();
    g.upload(table[0], 0, &bytes_f32(&x));
    run_fused(&mut g, &fused, &table, n);
    let got = f32s(&g.download(table[3], 0, 4 * n));
    let unfused_table: Vec<AllocId> = (0..4).map(|_| g.alloc(4 * n)).collect();
    g.upload(unfused_table[0], 0, &bytes_f32(&x));
    run_unfused(&mut g, &request, &unfused_table, n);
    let want = f32s(&g.download(unfused_table[3], 0, 4 * n));
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Refusals carry the typed reasons of the shared rules (different local sizes;
/// barriers in partial work-groups) and of this compiler's limits (a plain-range
/// kernel whose work-groups matter; a kernel without a WGSL image).
#[test]
fn refusals_name_their_typed_reason() {
    let step = step_kernel("step", STEP);
    let n = 256usize;
    let nd = |g: usize, l: usize| NdRange::new(g, l).geometry().unwrap();
    let mut request = chain(&[step.clone(), step.clone()], n, nd(256, 64), false, true);
    request.kernels[1].geometry = nd(256, 32);
    assert!(matches!(WgslFusion::new().fuse(&request), Err(FusionError::DifferentLocalSizes { .. })));

    let barrier =
        kernel("with_barrier", Signature::new().global(ReadWrite), ImageKind::Wgsl, "with_barrier", BARRIER);
    let with = |geometry: Geometry| FusionKernel {
        kernel: barrier.clone(),
        geometry,
        args: [FusionArg::new(9, 0..4 * n, 4)].into_iter().collect(),
        scalars: ScalarBlock::new(),
        deps: Default::default(),
    };
    let plain = |n: usize| Geometry::for_range(Range::d1(n)).unwrap();
    // 96 work-items of a grid of groups of 64: its second group would be partial.
    let first = chain(std::slice::from_ref(&step), n, nd(256, 64), false, true).kernels.remove(0);
    let partial =
        WgslFusion::new().fuse(&FusionRequest { kernels: vec![first, with(plain(96))], barriers: true });
    assert!(
        matches!(&partial, Err(FusionError::BarriersInPartialGroups { kernel }) if kernel == "with_barrier"),
        "{partial:?}"
    );
    // Over a plain range of the grid's size, its groups are the driver's choice.
    let first = chain(std::slice::from_ref(&step), n, plain(n), false, true).kernels.remove(0);
    let groups =
        WgslFusion::new().fuse(&FusionRequest { kernels: vec![first, with(plain(n))], barriers: true });
    assert!(
        matches!(&groups, Err(FusionError::Code { kernel, reason }) if kernel == "with_barrier" && reason.contains("plain range")),
        "{groups:?}"
    );
    let spirv_only = kernel("spirv", Signature::new().global(ReadWrite), ImageKind::SpirV, "main", "");
    let missing = WgslFusion::new().fuse(&FusionRequest {
        kernels: vec![FusionKernel { kernel: spirv_only, ..with(nd(256, 64)) }],
        barriers: true,
    });
    assert!(matches!(missing, Err(FusionError::MissingImage { kind: ImageKind::Wgsl, .. })), "{missing:?}");
}

/// A kernel with barriers, remapped over whole work-groups of a larger ND-range
/// grid, runs guarded by work-group (its barriers stay in uniform control flow):
/// the fused result equals the unfused kernels'.
#[test]
fn a_remapped_kernel_with_barriers_runs_by_whole_groups() {
    let Some(mut g) = gpu("a_remapped_kernel_with_barriers_runs_by_whole_groups") else { return };
    let n = 256usize;
    let nd = |g: usize, l: usize| NdRange::new(g, l).geometry().unwrap();
    let step = step_kernel("step", STEP);
    let barrier =
        kernel("with_barrier", Signature::new().global(ReadWrite), ImageKind::Wgsl, "with_barrier", BARRIER);
    let mut request = chain(&[step], n, nd(n, 64), false, true);
    // The reversing kernel over the first 128 outputs only: two whole groups.
    request.kernels.push(FusionKernel {
        kernel: barrier,
        geometry: nd(128, 64),
        args: [FusionArg::new(2, 0..4 * n, 4)].into_iter().collect(),
        scalars: ScalarBlock::new(),
        deps: Default::default(),
    });
    let fused = WgslFusion::new().fuse(&request).unwrap();
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let table = [g.alloc(4 * n), g.alloc(4 * n)];
    g.upload(table[0], 0, &bytes_f32(&x));
    run_fused(&mut g, &fused, &table, n);
    let got = f32s(&g.download(table[1], 0, 4 * n));
    let (a, b) = coefficients(0);
    let y: Vec<f32> = x.iter().map(|&v| a * v + b).collect();
    let want: Vec<f32> =
        (0..n).map(|i| if i < 128 { y[(i / 64) * 64 + 63 - i % 64] } else { y[i] }).collect();
    assert_eq!(got, want);
}
