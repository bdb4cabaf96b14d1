//! `--device cuda`: the frame's two kernels as CUDA C images on an NVIDIA GPU (feature
//! `cuda`). The probe copy and the snapshot run on the GPU too; the host task, which
//! reads the row results, runs on the CPU, and the scheduler moves `rows` to host
//! memory for it. The arithmetic is the serial reference's, operation for operation:
//! the `__f*_rn` intrinsics round each step as Rust does and keep the compiler from
//! contracting a multiply and an add into one FMA, so the GPU's results are
//! bit-identical to the serial run's.

use gantry::{AccessMode, Buffer, CodeImage, Event, ImageKind, Kernel, KernelRef, Queue, Signature};

const SOURCE: &str = r#"
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

/// The frame's kernels as CUDA C images (compiled by NVRTC on first launch).
pub struct GpuKernels {
    stencil: KernelRef,
    row_stats: KernelRef,
}

impl GpuKernels {
    pub fn new() -> Self {
        let image = |entry: &str| CodeImage::new(ImageKind::CudaC, entry, SOURCE.as_bytes());
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
        Self {
            stencil: Kernel::new("stencil", stencil).with_image(image("stencil")).into_ref(),
            row_stats: Kernel::new("row_stats", row_stats).with_image(image("row_stats")).into_ref(),
        }
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
