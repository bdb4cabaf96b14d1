//! Every kernel the checks run, built here and nowhere else: the one file that knows
//! what a kernel is (a [`KernelRef`] with three images: a closure of phases over
//! accessors, for host drivers, CUDA C source, for the CUDA driver, and WGSL
//! source, for the Vulkan driver), so that a change
//! of the kernel type changes this file only. The checks see a [`Kernel`]: a name,
//! an iteration space and what it computes, which they launch over memory arguments,
//! record into a command buffer, or patch into one.
//!
//! Every kernel works on `u32` elements, indexed by the global linear id, and wraps
//! on overflow (an overflow panic would be a kernel failure the check did not ask
//! for). Its constants are also its scalar arguments (all `u32`, the element count
//! first), which the CUDA C and WGSL images read and the closure, having captured
//! them, ignores. Each CUDA C or WGSL source is one image shared by every kernel of
//! its kind, so a driver compiles it once. The CUDA C images follow the CUDA
//! driver's convention (one pointer per buffer slot, then the scalars), the WGSL
//! images the Vulkan driver's (binding `i` of group 0 per buffer slot, the scalars
//! as an immediate (push-constant) block, a workgroup size the launch sets through
//! the `override` `wx`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use gantry_driver::{
    AccessMode, Capabilities, CodeImage, DeviceOp, ExecError, Geometry, ImageKind, Kernel as KernelOf,
    KernelLaunch, KernelRef, MemArg, NdRange, OpPatch, RecordedArg, RecordedOp, ScalarBlock, Signature,
};
use gantry_host::{phase, Accessor, ClosureKernel, Phase, Read, ReadWrite, Write};

/// How the message of every panic the checks cause on purpose starts; the harness
/// keeps these from printing.
pub const DELIBERATE: &str = "conformance: deliberate panic";

/// The command-group tag every kernel's accessors carry.
const TAG: u64 = 0xC0F0;

/// Work-items per work-group: several groups for any kernel of more than this many
/// items, so a threaded driver spreads them.
const GROUP: usize = 64;

/// The image kinds every kernel here has.
const IMAGE_KINDS: [ImageKind; 3] = [ImageKind::Closure, ImageKind::CudaC, ImageKind::Wgsl];

/// Whether a driver with `caps` runs these kernels (it runs one of their images).
pub(crate) fn runnable(caps: &Capabilities) -> bool {
    caps.image_kinds.iter().any(|k| IMAGE_KINDS.contains(k))
}

/// A kernel, its iteration space and its scalar arguments.
#[derive(Clone)]
pub(crate) struct Kernel {
    kernel: KernelRef,
    geometry: Geometry,
    scalars: ScalarBlock,
}

impl Kernel {
    /// Its name, as failures must report it.
    pub(crate) fn name(&self) -> &str {
        &self.kernel.name
    }

    /// A launch over `args` (one per buffer slot, in slot order).
    pub(crate) fn launch(&self, args: impl IntoIterator<Item = MemArg>) -> DeviceOp {
        DeviceOp::Kernel(KernelLaunch {
            kernel: self.kernel.clone(),
            geometry: self.geometry,
            args: args.into_iter().collect(),
            scalars: self.scalars.clone(),
        })
    }

    /// The kernel recorded into a command buffer over `args`.
    pub(crate) fn record(&self, args: &[RecordedArg]) -> RecordedOp {
        RecordedOp::Kernel {
            kernel: self.kernel.clone(),
            geometry: self.geometry,
            args: args.into(),
            scalars: self.scalars.clone(),
        }
    }

    /// A patch that makes a recorded kernel this one.
    pub(crate) fn patch(&self) -> OpPatch<'_> {
        OpPatch::Kernel { kernel: &self.kernel, geometry: &self.geometry, scalars: &self.scalars }
    }
}

/// The name of a launch's kernel, for messages.
pub(crate) fn name_of(launch: &KernelLaunch) -> &str {
    &launch.kernel.name
}

/// `n` items in groups of [`GROUP`] where `n` divides so, else one group.
fn geometry(n: usize) -> Geometry {
    let local = if n.is_multiple_of(GROUP) { GROUP } else { n };
    NdRange::new(n, local).geometry().expect("a valid ND-range")
}

/// A kernel of all three images: the closure `body`, the CUDA C `source` and the
/// WGSL `wgsl` (one each per kind of kernel, see [`cuda_image`]), over `modes` and
/// the `u32` `scalars`.
fn build(
    name: &str,
    geometry: Geometry,
    modes: &[AccessMode],
    body: Phase,
    (source, wgsl): (&'static CudaSource, &'static CudaSource),
    scalars: &[u32],
) -> Kernel {
    let closure = ClosureKernel {
        tag: TAG,
        phases: smallvec::smallvec![body],
        global_slots: modes.len(),
        scratch: vec![],
        unfused: None,
    };
    let signature = scalars.iter().fold(Signature::new(), |s, _| s.scalar::<u32>());
    let signature = modes.iter().fold(signature, |s, &m| s.global(m));
    let kernel = KernelOf::with_native(name, signature, Some(ImageKind::Closure), closure)
        .with_image(cuda_image(source))
        .with_image(wgsl.image(ImageKind::Wgsl))
        .into_ref();
    // u32 scalars lie one after the other, each at its alignment.
    let scalars = scalars.iter().flat_map(|v| v.to_ne_bytes()).collect();
    Kernel { kernel, geometry, scalars }
}

/// A GPU kernel's entry point and source (CUDA C or WGSL), and its image once made.
struct CudaSource {
    entry: &'static str,
    code: &'static str,
    image: OnceLock<CodeImage>,
}

impl CudaSource {
    const fn new(entry: &'static str, code: &'static str) -> Self {
        Self { entry, code, image: OnceLock::new() }
    }
}

impl CudaSource {
    /// Its image of `kind`: one for the process, so a driver loads it once however
    /// many kernels of its kind the checks make.
    fn image(&'static self, kind: ImageKind) -> CodeImage {
        self.image.get_or_init(|| CodeImage::new(kind, self.entry, self.code.as_bytes())).clone()
    }
}

/// The CUDA C image of `source` (see [`CudaSource::image`]).
fn cuda_image(source: &'static CudaSource) -> CodeImage {
    source.image(ImageKind::CudaC)
}

static AFFINE: CudaSource = CudaSource::new(
    "conformance_affine",
    r#"extern "C" __global__ void conformance_affine(unsigned int* x, unsigned int n, unsigned int a, unsigned int b) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}"#,
);

static DERIVE: CudaSource = CudaSource::new(
    "conformance_derive",
    r#"extern "C" __global__ void conformance_derive(const unsigned int* src, unsigned int* dst, unsigned int n,
                                              unsigned int a, unsigned int b, unsigned int c) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = a * src[i] + b + c * i;
}"#,
);

static REVERSE_AFFINE: CudaSource = CudaSource::new(
    "conformance_reverse_affine",
    r#"extern "C" __global__ void conformance_reverse_affine(const unsigned int* src, unsigned int* dst,
                                                      unsigned int n, unsigned int a, unsigned int b) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = a * src[n - 1 - i] + b;
}"#,
);

static ACCUMULATE: CudaSource = CudaSource::new(
    "conformance_accumulate",
    r#"extern "C" __global__ void conformance_accumulate(const unsigned int* src, unsigned int* acc, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += src[i];
}"#,
);

static STORE: CudaSource = CudaSource::new(
    "conformance_store",
    r#"extern "C" __global__ void conformance_store(unsigned int* x, unsigned int n, unsigned int value) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}"#,
);

/// A GPU kernel cannot fail part-way and leave its device usable (a fault inside a
/// kernel loses the context), so this one fails the only way that can: its launch
/// is refused, before it runs, because it allows blocks of at most 32 work-items and
/// [`write_then_panic`] launches one group of more.
static REFUSED: CudaSource = CudaSource::new(
    "conformance_refused",
    r#"extern "C" __global__ void __launch_bounds__(32) conformance_refused(unsigned int* x, unsigned int n,
                                                                          unsigned int value) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}"#,
);

/// The WGSL images: the same computations as the CUDA C ones above, each over its
/// scalars (an immediate block of `u32`s, the element count first) with a guarded
/// index, in workgroups of `wx` work-items that the launch sets.
static AFFINE_WGSL: CudaSource = CudaSource::new(
    "conformance_affine",
    "struct S { n: u32, a: u32, b: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read_write> x: array<u32>;
override wx: u32 = 64;
@compute @workgroup_size(wx)
fn conformance_affine(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if i < s.n { x[i] = s.a * x[i] + s.b; }
}",
);

static DERIVE_WGSL: CudaSource = CudaSource::new(
    "conformance_derive",
    "struct S { n: u32, a: u32, b: u32, c: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
override wx: u32 = 64;
@compute @workgroup_size(wx)
fn conformance_derive(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if i < s.n { dst[i] = s.a * src[i] + s.b + s.c * i; }
}",
);

static REVERSE_AFFINE_WGSL: CudaSource = CudaSource::new(
    "conformance_reverse_affine",
    "struct S { n: u32, a: u32, b: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
override wx: u32 = 64;
@compute @workgroup_size(wx)
fn conformance_reverse_affine(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if i < s.n { dst[i] = s.a * src[s.n - 1u - i] + s.b; }
}",
);

static ACCUMULATE_WGSL: CudaSource = CudaSource::new(
    "conformance_accumulate",
    "struct S { n: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> acc: array<u32>;
override wx: u32 = 64;
@compute @workgroup_size(wx)
fn conformance_accumulate(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if i < s.n { acc[i] = acc[i] + src[i]; }
}",
);

static STORE_WGSL: CudaSource = CudaSource::new(
    "conformance_store",
    "struct S { n: u32, value: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read_write> x: array<u32>;
override wx: u32 = 64;
@compute @workgroup_size(wx)
fn conformance_store(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { x[id.x] = s.value; }
}",
);

/// [`REFUSED`] in WGSL: a fixed workgroup size of 32, which the Vulkan driver
/// refuses to launch over [`write_then_panic`]'s one group of more.
static REFUSED_WGSL: CudaSource = CudaSource::new(
    "conformance_refused",
    "struct S { n: u32, value: u32 }
var<immediate> s: S;
@group(0) @binding(0) var<storage, read_write> x: array<u32>;
@compute @workgroup_size(32)
fn conformance_refused(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < s.n { x[id.x] = s.value; }
}",
);

/// `x[i] = a * x[i] + b` over `n` elements of slot 0 (read-write). Two of these with
/// different `b` do not commute, so a chain of them tells the order they ran in.
pub(crate) fn affine(name: &str, n: usize, a: u32, b: u32) -> Kernel {
    let x = Accessor::<u32, ReadWrite>::new(0, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        x.set(it, i, x.get(it, i).wrapping_mul(a).wrapping_add(b))
    });
    build(name, geometry(n), &[AccessMode::ReadWrite], body, (&AFFINE, &AFFINE_WGSL), &[n as u32, a, b])
}

/// What [`derive`] computes: `a * v + b + c * i` for element `v` at index `i`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear {
    pub a: u32,
    pub b: u32,
    pub c: u32,
}

impl Linear {
    /// Its value for element `v` at index `i`.
    pub(crate) fn at(self, v: u32, i: u32) -> u32 {
        v.wrapping_mul(self.a).wrapping_add(self.b).wrapping_add(i.wrapping_mul(self.c))
    }
}

/// `dst[i] = f.at(src[i], i)` over `n` elements: slot 0 is `src` (read), slot 1 `dst`
/// (write).
pub(crate) fn derive(name: &str, n: usize, f: Linear) -> Kernel {
    let src = Accessor::<u32, Read>::new(0, TAG, n);
    let dst = Accessor::<u32, Write>::new(1, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        dst.set(it, i, f.at(src.get(it, i), i as u32))
    });
    let scalars = [n as u32, f.a, f.b, f.c];
    build(name, geometry(n), &[AccessMode::Read, AccessMode::Write], body, (&DERIVE, &DERIVE_WGSL), &scalars)
}

/// `dst[i] = a * src[n - 1 - i] + b` over `n` elements: slot 0 is `src` (read), slot 1
/// `dst` (write). Its first work-items read what a kernel in the same order writes
/// last, and it overwrites the source of the kernel before it: one that overlapped
/// either neighbour in a chain of these would read or clobber unfinished data.
pub(crate) fn reverse_affine(name: &str, n: usize, a: u32, b: u32) -> Kernel {
    let src = Accessor::<u32, Read>::new(0, TAG, n);
    let dst = Accessor::<u32, Write>::new(1, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        dst.set(it, i, src.get(it, n - 1 - i).wrapping_mul(a).wrapping_add(b))
    });
    let scalars = [n as u32, a, b];
    build(
        name,
        geometry(n),
        &[AccessMode::Read, AccessMode::Write],
        body,
        (&REVERSE_AFFINE, &REVERSE_AFFINE_WGSL),
        &scalars,
    )
}

/// `acc[i] += src[i]` over `n` elements: slot 0 is `src` (read), slot 1 `acc`
/// (read-write).
pub(crate) fn accumulate(name: &str, n: usize) -> Kernel {
    let src = Accessor::<u32, Read>::new(0, TAG, n);
    let acc = Accessor::<u32, ReadWrite>::new(1, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        acc.set(it, i, acc.get(it, i).wrapping_add(src.get(it, i)))
    });
    build(
        name,
        geometry(n),
        &[AccessMode::Read, AccessMode::ReadWrite],
        body,
        (&ACCUMULATE, &ACCUMULATE_WGSL),
        &[n as u32],
    )
}

/// `x[i] = value` over `n` elements of slot 0 (write), counting its work-items in
/// `ran`: a kernel that must not run shows that it did not. (Only the closure image
/// counts; what the CUDA C image wrote shows in the memory.)
pub(crate) fn counted_store(name: &str, n: usize, value: u32, ran: Arc<AtomicUsize>) -> Kernel {
    let x = Accessor::<u32, Write>::new(0, TAG, n);
    let body = phase(move |it| {
        ran.fetch_add(1, Ordering::Relaxed);
        x.set(it, it.global_linear_id(), value)
    });
    build(name, geometry(n), &[AccessMode::Write], body, (&STORE, &STORE_WGSL), &[n as u32, value])
}

/// Writes `value` to each of the `n` elements of slot 0 (write), in order in one
/// work-group, and panics (a message starting with [`DELIBERATE`]) at the last one,
/// after it wrote: everything written before it failed. Its CUDA C image's launch is
/// refused instead (see [`REFUSED`]; `n` is more than 32).
pub(crate) fn write_then_panic(name: &str, n: usize, value: u32) -> Kernel {
    let x = Accessor::<u32, Write>::new(0, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        x.set(it, i, value);
        if i == n - 1 {
            panic!("{DELIBERATE} in a kernel");
        }
    });
    let one_group = NdRange::new(n, n).geometry().expect("a valid ND-range");
    build(name, one_group, &[AccessMode::Write], body, (&REFUSED, &REFUSED_WGSL), &[n as u32, value])
}

/// The message [`write_then_panic`]'s kernels panic with.
pub(crate) fn kernel_panic_message() -> String {
    format!("{DELIBERATE} in a kernel")
}

/// Whether `error` is how a driver with `caps` reports [`write_then_panic`]'s
/// `kernel` failing: running its closure, [`ExecError::KernelPanicked`] naming it
/// with the panic's message; running its CUDA C or WGSL image, whose launch is refused, the
/// driver's own error naming it (not a dependency's failure or a lost device: the
/// driver goes on). `Err` says what was wrong.
pub(crate) fn expected_failure(
    kernel: &Kernel,
    caps: &Capabilities,
    error: &ExecError,
) -> Result<(), String> {
    let name = kernel.name();
    if caps.image_kinds.contains(&ImageKind::Closure) {
        return match error {
            ExecError::KernelPanicked { kernel, message } if &**kernel == name => {
                if *message == kernel_panic_message() {
                    Ok(())
                } else {
                    Err(format!("the panic's message is lost: {message:?}"))
                }
            }
            e => Err(format!("a panicking kernel must fail with KernelPanicked naming `{name}`, not: {e:?}")),
        };
    }
    match error {
        ExecError::DependencyFailed { .. }
        | ExecError::DeviceLost { .. }
        | ExecError::KernelPanicked { .. } => Err(format!(
            "a kernel whose launch is refused must fail with the driver's own error, not: {error:?}"
        )),
        e if e.to_string().contains(name) => Ok(()),
        e => Err(format!("the error of a refused launch must name the kernel `{name}`: {e}")),
    }
}
