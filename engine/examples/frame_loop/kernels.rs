//! The frame's two kernels given by code images instead of closures: CUDA C (for
//! `--device cuda`), WGSL (for `--device vulkan`) or OpenCL C (`--kernels opencl`, feature `jit`: compiled by clang at
//! start-up, then by the JIT into a native work-group function on the CPU or into PTX
//! on a CUDA device). Both have one signature per kernel and compute the serial
//! reference's arithmetic operation for operation, so their results are bit-identical
//! to it: the CUDA C rounds each step with the `__f*_rn` intrinsics, which keep the
//! compiler from contracting a multiply and an add into one FMA; the OpenCL C turns
//! contraction off with `FP_CONTRACT`.

use gantry::{AccessMode, Buffer, CodeImage, Event, ImageKind, Kernel, KernelRef, Queue, Signature};

const CUDA_C: &str = r#"
extern "C" __global__ void stencil(const float* cur, float* next, unsigned h, unsigned w, float alpha) {
    unsigned x = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned y = blockIdx.y;
    if (x >= w || y >= h) return;
    unsigned i = y * w + x;
    float c = cur[i];
    if (y == 0 || x == 0 || y == h - 1 || x == w - 1) { next[i] = c; return; }
    float s = __fadd_rn(__fadd_rn(__fadd_rn(cur[i - w], cur[i + w]), cur[i - 1]), cur[i + 1]);
    next[i] = __fadd_rn(c, __fmul_rn(alpha, __fsub_rn(s, __fmul_rn(4.0f, c))));
}

extern "C" __global__ void row_stats(const float* grid, float* rows, unsigned h, unsigned w) {
    unsigned y = blockIdx.x * blockDim.x + threadIdx.x;
    if (y >= h) return;
    float sum = 0.0f, mx = -3.40282347e+38f;
    for (unsigned x = 0; x < w; x++) {
        float v = grid[y * w + x];
        sum = __fadd_rn(sum, v);
        mx = fmaxf(mx, v);
    }
    rows[2 * y] = sum;
    rows[2 * y + 1] = mx;
}
"#;

/// The same kernels in OpenCL C. Dimension 0 is the fastest (the column).
#[cfg(feature = "jit")]
const OPENCL_C: &str = r#"
#pragma OPENCL FP_CONTRACT OFF
kernel void stencil(global const float* cur, global float* next, uint h, uint w, float alpha) {
    uint x = get_global_id(0), y = get_global_id(1);
    if (x >= w || y >= h) return;
    uint i = y * w + x;
    float c = cur[i];
    if (y == 0 || x == 0 || y == h - 1 || x == w - 1) { next[i] = c; return; }
    next[i] = c + alpha * (cur[i - w] + cur[i + w] + cur[i - 1] + cur[i + 1] - 4.0f * c);
}

kernel void row_stats(global const float* grid, global float* rows, uint h, uint w) {
    uint y = get_global_id(0);
    if (y >= h) return;
    float sum = 0.0f, mx = -FLT_MAX;
    for (uint x = 0; x < w; x++) {
        float v = grid[y * w + x];
        sum = sum + v;
        mx = fmax(mx, v);
    }
    rows[2 * y] = sum;
    rows[2 * y + 1] = mx;
}
"#;

/// The same kernels in WGSL (Vulkan): one module per kernel, scalars in a
/// push-constant block laid out as the signature's, `x` the fastest dimension.
const WGSL_STENCIL: &str = "struct P { h: u32, w: u32, alpha: f32 }
var<immediate> p: P;
@group(0) @binding(0) var<storage, read> cur: array<f32>;
@group(0) @binding(1) var<storage, read_write> next: array<f32>;
@compute @workgroup_size(64)
fn stencil(@builtin(global_invocation_id) g: vec3<u32>) {
    let x = g.x;
    let y = g.y;
    if x >= p.w || y >= p.h { return; }
    let i = y * p.w + x;
    let c = cur[i];
    if y == 0u || x == 0u || y == p.h - 1u || x == p.w - 1u { next[i] = c; return; }
    next[i] = c + p.alpha * (cur[i - p.w] + cur[i + p.w] + cur[i - 1u] + cur[i + 1u] - 4.0 * c);
}";

const WGSL_ROW_STATS: &str = "struct P { h: u32, w: u32 }
var<immediate> p: P;
@group(0) @binding(0) var<storage, read> grid: array<f32>;
@group(0) @binding(1) var<storage, read_write> rows: array<f32>;
@compute @workgroup_size(64)
fn row_stats(@builtin(global_invocation_id) g: vec3<u32>) {
    let y = g.x;
    if y >= p.h { return; }
    var sum = 0.0;
    var mx = -3.40282347e+38;
    for (var x = 0u; x < p.w; x++) {
        let v = grid[y * p.w + x];
        sum = sum + v;
        mx = select(mx, v, v > mx);
    }
    rows[2u * y] = sum;
    rows[2u * y + 1u] = mx;
}";

/// The frame's kernels as code images.
pub struct ImageKernels {
    stencil: KernelRef,
    row_stats: KernelRef,
}

impl ImageKernels {
    fn signatures() -> (Signature, Signature) {
        let stencil = Signature::new()
            .global(AccessMode::Read)
            .global(AccessMode::DiscardWrite)
            .scalar::<u32>()
            .scalar::<u32>()
            .scalar::<f32>();
        let row_stats = Signature::new()
            .global(AccessMode::Read)
            .global(AccessMode::DiscardWrite)
            .scalar::<u32>()
            .scalar::<u32>();
        (stencil, row_stats)
    }

    /// CUDA C, compiled by NVRTC on the first launch.
    pub fn cuda_c() -> Self {
        let image = |entry: &str| CodeImage::new(ImageKind::CudaC, entry, CUDA_C.as_bytes());
        let (stencil, row_stats) = Self::signatures();
        Self {
            stencil: Kernel::new("stencil", stencil).with_image(image("stencil")).into_ref(),
            row_stats: Kernel::new("row_stats", row_stats).with_image(image("row_stats")).into_ref(),
        }
    }

    /// WGSL, compiled to SPIR-V by naga on the first launch.
    pub fn wgsl() -> Self {
        let (stencil, row_stats) = Self::signatures();
        let image = |entry: &str, source: &str| CodeImage::new(ImageKind::Wgsl, entry, source.as_bytes());
        Self {
            stencil: Kernel::new("stencil", stencil).with_image(image("stencil", WGSL_STENCIL)).into_ref(),
            row_stats: Kernel::new("row_stats", row_stats)
                .with_image(image("row_stats", WGSL_ROW_STATS))
                .into_ref(),
        }
    }

    /// OpenCL C, compiled to LLVM IR by clang now (the JIT compiles it on first launch).
    #[cfg(feature = "jit")]
    pub fn opencl_c() -> Result<Self, gantry::jit::JitError> {
        let (stencil, row_stats) = Self::signatures();
        Ok(Self {
            stencil: Kernel::new("stencil", stencil)
                .with_image(gantry::jit::from_opencl_c(OPENCL_C, "stencil")?)
                .into_ref(),
            row_stats: Kernel::new("row_stats", row_stats)
                .with_image(gantry::jit::from_opencl_c(OPENCL_C, "row_stats")?)
                .into_ref(),
        })
    }

    /// Submits the stencil (`next = diffuse(cur)`), then the per-row sum and maximum
    /// of `next`, on queue `q`.
    pub fn submit(
        &self,
        q: &Queue,
        (cur, next, rows): (&Buffer<f32>, &Buffer<f32>, &Buffer<[f32; 2]>),
        (h, w): (usize, usize),
        alpha: f32,
        events: &mut Vec<Event>,
    ) -> gantry::Result<()> {
        let (hu, wu) = (h as u32, w as u32);
        events.push(q.submit(|cg| {
            cg.name("stencil");
            cg.read(cur);
            cg.discard_write(next);
            cg.launch(&self.stencil, [h, w]).scalar(0, hu).scalar(1, wu).scalar(2, alpha);
        })?);
        events.push(q.submit(|cg| {
            cg.name("row_stats");
            cg.read(next);
            cg.discard_write(rows);
            cg.launch(&self.row_stats, h).scalar(0, hu).scalar(1, wu);
        })?);
        Ok(())
    }
}
