//! Kernel fusion on LLVM IR (`IrFusion`): OpenCL C kernels fused, the fused image
//! run with the host compiler, and compared with the kernels run unfused in order
//! and with Rust reference code.

use std::collections::HashMap;

use gantry_driver::fusion::{
    FusionArg, FusionCompiler, FusionError, FusionKernel, FusionRequest, FusionWarning, Promotion,
    PromotionMismatch,
};
use gantry_driver::{
    AccessMode, CodeImage, Geometry, ImageKind, Kernel, KernelRef, NdRange, Range, ScalarBlock, ScratchKind,
    Signature,
};
use gantry_jit::{HostCompiler, HostLaunch, IrFusion, PtxCompiler};

fn cl(source: &str, entry: &str) -> CodeImage {
    gantry_jit::from_opencl_c(source, entry).unwrap_or_else(|e| panic!("{e}"))
}

fn kernel(name: &str, source: &str, signature: Signature) -> KernelRef {
    Kernel::new(name, signature).with_image(cl(source, name)).into_ref()
}

fn range(r: impl Into<Range>) -> Geometry {
    Geometry::for_range(r.into()).unwrap()
}

fn nd(g: impl Into<Range>, l: impl Into<Range>) -> Geometry {
    NdRange::new(g, l).geometry().unwrap()
}

fn step(kernel: &KernelRef, geometry: Geometry, args: &[FusionArg], scalars: &[u8]) -> FusionKernel {
    FusionKernel {
        kernel: kernel.clone(),
        geometry,
        args: args.iter().cloned().collect(),
        scalars: scalars.iter().copied().collect::<ScalarBlock>(),
        deps: Default::default(),
    }
}

/// A buffer of `n` floats, all of `f32` elements here.
fn arg(buffer: u64, n: usize) -> FusionArg {
    FusionArg::new(buffer, 0..n * 4, 4)
}

type Buffers = HashMap<u64, Vec<f32>>;

/// Local memory for a signature's local slots (16-byte aligned).
fn locals(signature: &Signature) -> Vec<Vec<u128>> {
    signature
        .memory
        .iter()
        .filter(|s| s.kind == ScratchKind::Local)
        .map(|s| vec![0u128; s.bytes.div_ceil(16).max(1)])
        .collect()
}

fn run(
    host: &HostCompiler,
    image: &CodeImage,
    sig: &Signature,
    geometry: &Geometry,
    globals: &[*mut u8],
    scalars: &[u8],
) {
    let kernel = host.compile(image, sig).unwrap_or_else(|e| panic!("{e}"));
    let mut local = locals(sig);
    let local_ptrs: Vec<*mut u8> = local.iter_mut().map(|l| l.as_mut_ptr().cast()).collect();
    let launch = HostLaunch::from_geometry(geometry, globals, scalars, &local_ptrs);
    // SAFETY: every global points into a live buffer holding the slot's range,
    // which the test kernels index within; locals hold their slots' bytes.
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
}

fn at(bufs: &mut Buffers, buffer: u64, start: usize) -> *mut u8 {
    let b = bufs.get_mut(&buffer).expect("buffer");
    assert!(start <= b.len() * 4);
    // SAFETY: within the buffer (checked above).
    unsafe { b.as_mut_ptr().cast::<u8>().add(start) }
}

/// Runs the request's kernels one after the other.
fn run_unfused(host: &HostCompiler, request: &FusionRequest, bufs: &mut Buffers) {
    for k in &request.kernels {
        let globals: Vec<*mut u8> = k.args.iter().map(|a| at(bufs, a.buffer, a.start)).collect();
        let image = k.kernel.image(ImageKind::LlvmIr).unwrap();
        run(host, image, &k.kernel.signature, &k.geometry, &globals, &k.scalars);
    }
}

/// Runs a fused kernel.
fn run_fused(host: &HostCompiler, fused: &gantry_driver::fusion::Fused, bufs: &mut Buffers) {
    assert!(fused.scalars.is_empty());
    assert!(fused.kernel.signature.scalars.is_empty());
    let globals: Vec<*mut u8> = fused.args.iter().map(|a| at(bufs, a.buffer, a.start)).collect();
    let image = fused.kernel.image(ImageKind::LlvmIr).unwrap();
    run(host, image, &fused.kernel.signature, &fused.geometry, &globals, &[]);
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 100.0 - 5.0)
        .collect()
}

const AXPB: &str = "kernel void axpb(global float* x, float a, float b) {
    size_t i = get_global_id(0);
    x[i] = a * x[i] + b;
}";

fn axpb() -> KernelRef {
    kernel("axpb", AXPB, Signature::new().global(AccessMode::ReadWrite).scalar::<f32>().scalar::<f32>())
}

fn scalars(a: f32, b: f32) -> Vec<u8> {
    [a.to_ne_bytes(), b.to_ne_bytes()].concat()
}

/// The 8-kernel chain: `x = a_k * x + b_k`, k = 0..8.
fn chain(k: &KernelRef, n: usize, buffer: u64, len: usize) -> FusionRequest {
    let kernels = (0..len)
        .map(|i| step(k, range(n), &[arg(buffer, n)], &scalars(1.0 + i as f32 * 0.125, i as f32 * 0.5 - 1.0)))
        .collect();
    FusionRequest { kernels, barriers: true }
}

/// Eight kernels with their own constants: the fused kernel equals them unfused and
/// the Rust reference, takes no scalars, and a second fusion is a cache hit.
#[test]
fn elementwise_chain_of_eight_with_constants() {
    let host = HostCompiler::new();
    let fusion = IrFusion::new();
    let k = axpb();
    let n = 10_000; // not a multiple of the plain range's group: a partial last group
    let request = chain(&k, n, 1, 8);
    let fused = fusion.fuse(&request).unwrap();
    assert!(!fused.cached);
    assert_eq!(fused.args.len(), 1);
    assert_eq!(fused.args[0].uses.len(), 8);
    assert_eq!(fused.geometry, range(n));
    assert!(fused.kernel.signature.scalars.is_empty());
    assert_eq!(fused.kernel.signature.globals.as_slice(), [AccessMode::ReadWrite]);
    assert!(fused.internal.is_empty() && fused.warnings.is_empty() && fused.kept_on_failure.is_none());

    let input = data(n, 7);
    let mut fused_bufs: Buffers = [(1, input.clone())].into();
    let mut unfused_bufs = fused_bufs.clone();
    run_fused(&host, &fused, &mut fused_bufs);
    run_unfused(&host, &request, &mut unfused_bufs);
    let reference: Vec<f32> = input
        .iter()
        .map(|&x| (0..8).fold(x, |x, i| (1.0 + i as f32 * 0.125) * x + (i as f32 * 0.5 - 1.0)))
        .collect();
    assert_eq!(fused_bufs[&1], unfused_bufs[&1], "fused = unfused");
    for (i, (got, want)) in fused_bufs[&1].iter().zip(&reference).enumerate() {
        assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "element {i}: {got} vs {want}");
    }
    // Every work-item touches only its own element: the seven barriers the request
    // asks for are left out, so the fused kernel has none (the PTX compiler then
    // guards it, which it does only for a kernel without barriers).
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 7);
    let ptx = ptx_of(&fused);
    assert!(!ptx.ptx.contains("bar.sync") && ptx.guarded, "{}", ptx.ptx);

    // The same chain over another buffer: the cached module.
    let again = fusion.fuse(&chain(&k, n, 99, 8)).unwrap();
    assert!(again.cached);
    assert_eq!(again.args[0].buffer, 99);
    assert_eq!(
        again.kernel.image(ImageKind::LlvmIr).unwrap().code(),
        fused.kernel.image(ImageKind::LlvmIr).unwrap().code()
    );
    let stats = fusion.stats();
    assert_eq!((stats.hits, stats.by_bytes, stats.misses, stats.len), (1, 0, 1, 1));
    // New images of the same bytes: found by the bytes once, then by their
    // identities.
    let fresh = chain(&axpb(), n, 1, 8);
    assert!(fusion.fuse(&fresh).unwrap().cached);
    assert!(fusion.fuse(&fresh).unwrap().cached);
    let stats = fusion.stats();
    assert_eq!((stats.hits, stats.by_bytes, stats.misses, stats.len), (3, 1, 1, 1));
    // Other constants are another module.
    let mut other = chain(&k, n, 1, 8);
    other.kernels[3].scalars = scalars(2.0, 0.0).into_iter().collect();
    assert!(!fusion.fuse(&other).unwrap().cached);
}

/// The cache is bounded: least recently used out first.
#[test]
fn cache_evicts_the_least_recently_used() {
    let fusion = IrFusion::with_capacity(2);
    let k = axpb();
    let (a, b, c) = (chain(&k, 64, 1, 2), chain(&k, 64, 1, 3), chain(&k, 64, 1, 4));
    assert!(!fusion.fuse(&a).unwrap().cached);
    assert!(!fusion.fuse(&b).unwrap().cached);
    assert!(fusion.fuse(&a).unwrap().cached); // a is now the most recent
    assert!(!fusion.fuse(&c).unwrap().cached); // evicts b
    assert!(fusion.fuse(&a).unwrap().cached);
    assert!(!fusion.fuse(&b).unwrap().cached);
    let s = fusion.stats();
    assert_eq!((s.hits, s.misses, s.evictions, s.len), (2, 4, 2, 2));
}

/// Each module keeps a bounded number of identity keys: new images of equal bytes
/// hit by their bytes, and the oldest identities are forgotten (then found by the
/// bytes again).
#[test]
fn identity_keys_are_bounded() {
    let fusion = IrFusion::new();
    let chains: Vec<FusionRequest> = (0..10).map(|_| chain(&axpb(), 64, 1, 2)).collect();
    assert!(!fusion.fuse(&chains[0]).unwrap().cached);
    for c in &chains[1..] {
        assert!(fusion.fuse(c).unwrap().cached);
    }
    assert_eq!(fusion.stats().by_bytes, 9);
    // Ten identities for one module, which keeps the last eight.
    for c in &chains[2..] {
        assert!(fusion.fuse(c).unwrap().cached);
    }
    assert_eq!(fusion.stats().by_bytes, 9, "the last eight by identity");
    assert!(fusion.fuse(&chains[0]).unwrap().cached);
    assert_eq!(fusion.stats().by_bytes, 10, "the first one forgotten");
    assert_eq!((fusion.stats().len, fusion.stats().misses), (1, 1));
}

const TWICE: &str = "kernel void twice(global const float* x, global float* t) {
    size_t i = get_global_id(0);
    t[i] = x[i] * 2.0f;
}";
const PLUS: &str = "kernel void plus(global const float* t, global float* y, float c) {
    size_t i = get_global_id(0);
    y[i] = t[i] + c;
}";

/// A private intermediate: the result is right and the buffer is never written.
#[test]
fn private_internalization_keeps_the_buffer_untouched() {
    let host = HostCompiler::new();
    let n = 4096;
    let twice = kernel("twice", TWICE, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let plus = kernel(
        "plus",
        PLUS,
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).scalar::<f32>(),
    );
    let t = arg(2, n).promoted(Promotion::Private);
    let request = FusionRequest {
        kernels: vec![
            step(&twice, range(n), &[arg(1, n), t.clone()], &[]),
            step(&plus, range(n), &[t, arg(3, n)], &1.5f32.to_ne_bytes()),
        ],
        barriers: true,
    };
    let fusion = IrFusion::new();
    let fused = fusion.fuse(&request).unwrap();
    // Private to each work-item: no barrier needed for it.
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 1);
    assert_eq!(fused.internal.len(), 1);
    assert_eq!(
        (fused.internal[0].buffer, fused.internal[0].kind, fused.internal[0].bytes),
        (2, Promotion::Private, 4)
    );
    assert_eq!(fused.args.iter().map(|a| a.buffer).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(fused.kernel.signature.globals.as_slice(), [AccessMode::Read, AccessMode::Write]);
    let x = data(n, 3);
    let sentinel = vec![-12345.0f32; n];
    let mut bufs: Buffers = [(1, x.clone()), (2, sentinel.clone()), (3, vec![0.0; n])].into();
    run_fused(&host, &fused, &mut bufs);
    assert_eq!(bufs[&2], sentinel, "the internalized buffer is not written");
    let expected: Vec<f32> = x.iter().map(|v| v * 2.0 + 1.5).collect();
    assert_eq!(bufs[&3], expected);
    // The fused IR keeps no access to it: only two global pointers.
    let ir = String::from_utf8_lossy(fused.kernel.image(ImageKind::LlvmIr).unwrap().code()).into_owned();
    assert!(!ir.is_empty());
}

const TILE: &str = "kernel void tile(global const float* in, global float* tile) {
    size_t i = get_global_id(0);
    tile[i] = in[i] * 3.0f;
}";
/// Reads a neighbour's element in the group: needs the barrier fusion inserts.
const ROTATE: &str = "kernel void rotate(global const float* tile, global float* out) {
    size_t l = get_local_id(0), n = get_local_size(0), g = get_group_id(0);
    out[get_global_id(0)] = tile[g * n + (l + 1) % n];
}";
const REDUCE: &str = "kernel void reduce(global const float* in, global float* sums, local float* tmp) {
    size_t l = get_local_id(0);
    tmp[l] = in[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (l < s) tmp[l] += tmp[l + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (l == 0) sums[get_group_id(0)] = tmp[0];
}";

/// A local intermediate written per group and read across work-items after the
/// fusion's barrier, then a kernel with its own barriers and local slot.
#[test]
fn local_internalization_with_barriers() {
    let host = HostCompiler::new();
    let (n, group) = (1024, 64);
    let groups = n / group;
    let tile = kernel("tile", TILE, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let rotate =
        kernel("rotate", ROTATE, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let reduce = kernel(
        "reduce",
        REDUCE,
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(group * 4),
    );
    let g = nd(n, group);
    let t = arg(2, n).promoted(Promotion::Local);
    let request = FusionRequest {
        kernels: vec![
            step(&tile, g, &[arg(1, n), t.clone()], &[]),
            step(&rotate, g, &[t, arg(3, n)], &[]),
            step(&reduce, g, &[arg(3, n), arg(4, groups)], &[]),
        ],
        barriers: true,
    };
    let fusion = IrFusion::new();
    let fused = fusion.fuse(&request).unwrap();
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 0, "local memory keeps them");
    assert_eq!(fused.internal.len(), 1);
    assert_eq!((fused.internal[0].kind, fused.internal[0].bytes), (Promotion::Local, group * 4));
    let locals: Vec<usize> = fused.kernel.signature.memory.iter().map(|s| s.bytes).collect();
    assert_eq!(locals, [group * 4, group * 4], "the internal buffer, then reduce's slot");
    let input = data(n, 11);
    let sentinel = vec![7.0f32; n];
    let mut bufs: Buffers =
        [(1, input.clone()), (2, sentinel.clone()), (3, vec![0.0; n]), (4, vec![0.0; groups])].into();
    let mut unfused = bufs.clone();
    run_fused(&host, &fused, &mut bufs);
    run_unfused(&host, &request, &mut unfused);
    assert_eq!(bufs[&2], sentinel, "the local-internalized buffer is not written");
    let rotated: Vec<f32> =
        (0..n).map(|i| input[i / group * group + (i % group + 1) % group] * 3.0).collect();
    assert_eq!(bufs[&3], rotated);
    assert_eq!(bufs[&3], unfused[&3]);
    let sums: Vec<f32> = rotated
        .chunks(group)
        .map(|c| {
            // The tree's order of additions.
            let mut v = c.to_vec();
            let mut s = group / 2;
            while s > 0 {
                for l in 0..s {
                    v[l] += v[l + s];
                }
                s /= 2;
            }
            v[0]
        })
        .collect();
    assert_eq!(bufs[&4], sums);

    // PTX: the stub's barriers and the reduction's become `bar.sync`.
    let ptx = PtxCompiler::new()
        .compile(fused.kernel.image(ImageKind::LlvmIr).unwrap(), &fused.kernel.signature)
        .unwrap();
    assert!(ptx.ptx.contains("bar.sync"), "{}", ptx.ptx);
    assert!(ptx.ptx.contains(".entry"));
    // ptxas takes identifiers of letters, digits, `_` and `$` only (no `.`).
    let declarations = ptx.ptx.lines().filter(|l| l.trim_start().starts_with('.'));
    for line in declarations.filter(|l| l.contains(".entry") || l.contains(".func") || l.contains(".global"))
    {
        let name = line.split_whitespace().find(|w| !w.starts_with('.')).unwrap_or_default();
        let name = name.trim_end_matches(['(', ';', ',']).split(['[', '(']).next().unwrap_or_default();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$'),
            "a PTX name ptxas refuses: `{name}` in `{line}`"
        );
    }
    assert_eq!(ptx.shared_bytes, 16 * (group * 4).div_ceil(16) + group * 4);
}

const INC: &str = "kernel void inc(global float* x) { x[get_global_id(0)] += 1.0f; }";
const HALF: &str = "kernel void half_(global const float* x, global float* y) {
    size_t i = get_global_id(0);
    y[i] = x[i] * 0.5f + (float)get_global_size(0);
}";
/// A 2-D kernel over the 1-D grid's work-items: its ids are delinearized.
const IDS2: &str = "kernel void ids2(global const float* x, global float* z) {
    size_t c = get_global_id(0), r = get_global_id(1), w = get_global_size(0);
    z[r * w + c] = x[r * w + c] + (float)(c + 1000 * r) + (float)(get_work_dim() * 100000);
}";

/// Kernels over other ranges: a smaller one skips the work-items past its size and
/// sees its own global size; a 2-D one sees its own ids; a buffer used by three
/// kernels is one fused argument.
#[test]
fn different_ranges_remap_and_identical_arguments() {
    let host = HostCompiler::new();
    let n = 2048;
    let inc = kernel("inc", INC, Signature::new().global(AccessMode::ReadWrite));
    let half = kernel("half_", HALF, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let ids2 = kernel("ids2", IDS2, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let request = FusionRequest {
        kernels: vec![
            step(&inc, range(n), &[arg(1, n)], &[]),
            step(&half, range(n / 2), &[arg(1, n / 2), arg(2, n / 2)], &[]),
            step(&ids2, range([16, n / 16]), &[arg(1, n), arg(3, n)], &[]),
        ],
        barriers: true,
    };
    let fused = IrFusion::new().fuse(&request).unwrap();
    assert_eq!(fused.geometry.global_range(), [n, 1, 1]);
    assert_eq!(fused.args.len(), 3);
    assert_eq!(fused.args[0].buffer, 1);
    assert_eq!(fused.args[0].uses.as_slice(), [(0, 0), (1, 0), (2, 0)], "one argument for three kernels");
    assert_eq!(fused.kernel.signature.globals[0], AccessMode::ReadWrite);
    let x = data(n, 5);
    let mut bufs: Buffers = [(1, x.clone()), (2, vec![-1.0; n / 2]), (3, vec![-1.0; n])].into();
    let mut unfused = bufs.clone();
    run_fused(&host, &fused, &mut bufs);
    run_unfused(&host, &request, &mut unfused);
    assert_eq!(bufs, unfused);
    let x1: Vec<f32> = x.iter().map(|v| v + 1.0).collect();
    assert_eq!(bufs[&1], x1);
    let y: Vec<f32> = x1[..n / 2].iter().map(|v| v * 0.5 + (n / 2) as f32).collect();
    assert_eq!(bufs[&2], y);
    let w = n / 16;
    let z: Vec<f32> = (0..n).map(|i| x1[i] + ((i % w) + 1000 * (i / w)) as f32 + 200000.0).collect();
    assert_eq!(bufs[&3], z);
}

/// Writes its two elements through a generic pointer in a pointer loop (a phi and
/// a pointer comparison), in a helper it calls.
const SPREAD: &str = "void put(float* p, float v) { *p = v; }
kernel void spread(global const float* x, global float* t) {
    size_t i = get_global_id(0);
    float k = 1.0f;
    for (global float* q = t + 2 * i; q < t + 2 * i + 2; ++q) {
        put((float*)q, x[i] * k);
        k += 1.0f;
    }
}";
/// Reads through a pointer chosen by a select.
const PICK: &str = "kernel void pick(global const float* t, global float* y) {
    size_t i = get_global_id(0);
    global const float* p = (i & 1) ? t + 2 * i + 1 : t + 2 * i;
    y[i] = p[0] * 10.0f + t[2 * i + 1];
}";

/// The same two kernels as LLVM IR written by hand, with what clang's `-O1` turns
/// into integer indexes: a pointer induction variable (a phi) compared with a
/// pointer, and a select between two pointers.
const WALK_CHOOSE_IR: &str = r#"
target datalayout = "e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-G1"
target triple = "spir64-unknown-unknown"

declare i64 @_Z13get_global_idj(i32)

define spir_kernel void @walk(ptr addrspace(1) %x, ptr addrspace(1) %t) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %xi = getelementptr inbounds float, ptr addrspace(1) %x, i64 %i
  %v = load float, ptr addrspace(1) %xi
  %two = shl i64 %i, 1
  %start = getelementptr inbounds float, ptr addrspace(1) %t, i64 %two
  %end = getelementptr inbounds float, ptr addrspace(1) %start, i64 2
  br label %loop
loop:
  %q = phi ptr addrspace(1) [ %start, %entry ], [ %next, %loop ]
  %k = phi float [ 1.0, %entry ], [ %k1, %loop ]
  %g = addrspacecast ptr addrspace(1) %q to ptr addrspace(4)
  %val = fmul float %v, %k
  store float %val, ptr addrspace(4) %g
  %k1 = fadd float %k, 1.0
  %next = getelementptr inbounds float, ptr addrspace(1) %q, i64 1
  %more = icmp ult ptr addrspace(1) %next, %end
  br i1 %more, label %loop, label %done
done:
  ret void
}

define spir_kernel void @choose(ptr addrspace(1) %t, ptr addrspace(1) %y) {
entry:
  %i = call i64 @_Z13get_global_idj(i32 0)
  %two = shl i64 %i, 1
  %a = getelementptr inbounds float, ptr addrspace(1) %t, i64 %two
  %b = getelementptr inbounds float, ptr addrspace(1) %a, i64 1
  %odd = trunc i64 %i to i1
  %p = select i1 %odd, ptr addrspace(1) %b, ptr addrspace(1) %a
  %pv = load float, ptr addrspace(1) %p
  %bv = load float, ptr addrspace(1) %b
  %m = fmul float %pv, 10.0
  %r = fadd float %m, %bv
  %yi = getelementptr inbounds float, ptr addrspace(1) %y, i64 %i
  store float %r, ptr addrspace(1) %yi
  ret void
}
"#;

/// Private internalization through generic pointers, a pointer loop and a select:
/// every access is rewritten (the buffer is internalized, never written) and the
/// results equal the unfused kernels'.
#[test]
fn internalization_through_generic_pointers_loops_and_selects() {
    let host = HostCompiler::new();
    let n = 1024;
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write);
    let ir = |entry: &str| {
        let image = gantry_jit::from_llvm_ir(WALK_CHOOSE_IR.as_bytes(), entry).unwrap();
        Kernel::new(entry, sig.clone()).with_image(image).into_ref()
    };
    let pairs = [
        (kernel("spread", SPREAD, sig.clone()), kernel("pick", PICK, sig.clone())),
        (ir("walk"), ir("choose")),
    ];
    for (spread, pick) in &pairs {
        let t = arg(2, 2 * n).promoted(Promotion::Private);
        let request = FusionRequest {
            kernels: vec![
                step(spread, range(n), &[arg(1, n), t.clone()], &[]),
                step(pick, range(n), &[t, arg(3, n)], &[]),
            ],
            barriers: true,
        };
        let fused = IrFusion::new().fuse(&request).unwrap();
        assert!(fused.warnings.is_empty(), "{:?}", fused.warnings);
        assert_eq!((fused.internal.len(), fused.internal[0].bytes), (1, 8));
        let x = data(n, 9);
        let sentinel = vec![3.0f32; 2 * n];
        let mut bufs: Buffers = [(1, x.clone()), (2, sentinel.clone()), (3, vec![0.0; n])].into();
        let mut unfused = bufs.clone();
        run_fused(&host, &fused, &mut bufs);
        run_unfused(&host, &request, &mut unfused);
        assert_eq!(bufs[&2], sentinel);
        assert_eq!(bufs[&3], unfused[&3]);
        // (clang contracts `p[0] * 10 + t`: compared within a rounding.)
        for (i, got) in bufs[&3].iter().enumerate() {
            let want = if i & 1 == 1 { x[i] * 2.0 * 10.0 } else { x[i] * 10.0 } + x[i] * 2.0;
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "element {i}: {got} vs {want}");
        }
    }
}

const STASH: &str = "kernel void stash(global float* t, global ulong* out) {
    size_t i = get_global_id(0);
    t[i] = 1.0f;
    out[i] = (ulong)(t + i) >> 2;
}";

/// Refusals: the shared rules' typed reasons, a kernel without an IR image, a
/// kernel with barriers in partial groups; a buffer whose pointer escapes stays in
/// global memory with a warning.
#[test]
fn refusals_and_warnings_are_typed() {
    let fusion = IrFusion::new();
    let inc = kernel("inc", INC, Signature::new().global(AccessMode::ReadWrite));
    let x = [arg(1, 64)];
    let err =
        |kernels: Vec<FusionKernel>| fusion.fuse(&FusionRequest { kernels, barriers: true }).unwrap_err();
    assert_eq!(err(vec![]), FusionError::Empty);
    assert!(matches!(
        err(vec![step(&inc, nd(64, 8), &x, &[]), step(&inc, nd(64, 16), &x, &[])]),
        FusionError::DifferentLocalSizes { .. }
    ));
    assert!(matches!(
        err(vec![step(&inc, nd(8, 8), &x, &[]), step(&inc, range(12), &x, &[])]),
        FusionError::NonUniformWorkGroups { .. }
    ));
    assert!(matches!(
        err(vec![step(&inc, nd(8, 8), &x, &[]), step(&inc, range([4, 4]), &x, &[])]),
        FusionError::DifferentDimensions { .. }
    ));
    assert!(matches!(
        err(vec![step(&inc, nd([2, 8], [1, 8]), &x, &[]), step(&inc, range([2, 16]), &x, &[])]),
        FusionError::DifferentGlobalSizes { .. }
    ));
    let shifted = Geometry::for_range_with_offset(Range::d1(8), [4, 0, 0]).unwrap();
    assert!(matches!(
        err(vec![step(&inc, shifted, &x, &[]), step(&inc, range(8), &x, &[])]),
        FusionError::DifferentOffsets { .. }
    ));
    let no_ir = Kernel::new("closure_only", Signature::new().global(AccessMode::ReadWrite)).into_ref();
    assert_eq!(
        err(vec![step(&inc, range(8), &x, &[]), step(&no_ir, range(8), &x, &[])]),
        FusionError::MissingImage { kernel: "closure_only".into(), kind: ImageKind::LlvmIr }
    );
    // A reduction (barriers) over 96 work-items of a plain grid of 128 with one
    // group: the last 32 work-items would skip its barriers.
    let reduce = kernel(
        "reduce",
        REDUCE,
        Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(512),
    );
    assert_eq!(
        err(vec![
            step(&inc, range(128), &[arg(1, 128)], &[]),
            step(&reduce, range(96), &[arg(1, 96), arg(2, 1)], &[]),
        ]),
        FusionError::BarriersInPartialGroups { kernel: "reduce".into() }
    );

    // The kernel converts its pointer to an integer: not rewritable, kept global.
    let host = HostCompiler::new();
    let stash =
        kernel("stash", STASH, Signature::new().global(AccessMode::ReadWrite).global(AccessMode::Write));
    let n = 256;
    let t = arg(1, n).promoted(Promotion::Private);
    let request = FusionRequest {
        kernels: vec![
            step(&stash, range(n), &[t.clone(), FusionArg::new(2, 0..n * 8, 8)], &[]),
            step(&inc, range(n), &[t], &[]),
        ],
        barriers: true,
    };
    let fused = fusion.fuse(&request).unwrap();
    assert!(fused.internal.is_empty());
    assert_eq!(
        fused.warnings,
        [FusionWarning::PromotionDropped {
            buffer: 1,
            reason: PromotionMismatch::AccessNotRewritable { kernel: "stash".into() }
        }]
    );
    let mut bufs: Buffers = [(1, vec![0.0; n]), (2, vec![0.0; n * 2])].into();
    run_fused(&host, &fused, &mut bufs);
    assert_eq!(bufs[&1], vec![2.0; n], "kept in global memory, written as unfused");
}

fn ptx_of(fused: &gantry_driver::fusion::Fused) -> std::sync::Arc<gantry_jit::PtxKernel> {
    PtxCompiler::new()
        .compile(fused.kernel.image(ImageKind::LlvmIr).unwrap(), &fused.kernel.signature)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// An elementwise chain fused with barriers asked for is the chain fused without
/// them (its barriers are all elided): the same PTX, with no `bar.sync`, guarded by
/// the PTX compiler.
#[test]
fn ptx_of_fused_chains() {
    let k = axpb();
    let fusion = IrFusion::new();
    let mut request = chain(&k, 1 << 12, 1, 4);
    let with = fusion.fuse(&request).unwrap();
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 3);
    request.barriers = false;
    let without = fusion.fuse(&request).unwrap();
    assert!(!without.cached, "another request, another module");
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 0, "none asked for");
    let (with, without) = (ptx_of(&with), ptx_of(&without));
    assert!(!with.ptx.contains("bar.sync") && with.guarded, "{}", with.ptx);
    assert_eq!(with.ptx, without.ptx);
    assert_eq!(with.params, 1 + 4, "one global, then the hidden parameters");
}

/// Runs `request` fused and unfused on copies of `bufs`; asserts the results are
/// bit-identical and returns the fused kernel's barriers in its PTX (`bar.sync`)
/// and the barriers elided.
fn fused_equals_unfused(request: &FusionRequest, bufs: &Buffers) -> (usize, usize) {
    let host = HostCompiler::new();
    let fusion = IrFusion::new();
    let fused = fusion.fuse(request).unwrap_or_else(|e| panic!("{e}"));
    let (mut a, mut b) = (bufs.clone(), bufs.clone());
    run_fused(&host, &fused, &mut a);
    run_unfused(&host, request, &mut b);
    assert_eq!(a, b, "fused = unfused");
    let elided = fusion.last_timings().unwrap().barriers_elided;
    (ptx_of(&fused).ptx.matches("bar.sync").count(), elided)
}

/// Reads the next work-item's element of `x` (within its group), which the kernel
/// before wrote: needs the barrier between them.
const NEXT: &str = "kernel void next(global const float* x, global float* y) {
    size_t i = get_global_id(0);
    y[i] = get_local_id(0) + 1 < get_local_size(0) ? x[i + 1] : -1.0f;
}";

/// A kernel that reads `x[i + 1]` after one that wrote it keeps the barrier
/// between them; without it (asked for no barriers) the host's result differs.
/// Where no kernel writes `x`, the barrier goes.
#[test]
fn a_neighbours_element_keeps_the_barrier() {
    let (n, group) = (1024, 64);
    let inc = kernel("inc", INC, Signature::new().global(AccessMode::ReadWrite));
    let next = kernel("next", NEXT, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let g = nd(n, group);
    let request = FusionRequest {
        kernels: vec![step(&inc, g, &[arg(1, n)], &[]), step(&next, g, &[arg(1, n), arg(2, n)], &[])],
        barriers: true,
    };
    let bufs: Buffers = [(1, data(n, 4)), (2, vec![0.0; n])].into();
    assert_eq!(fused_equals_unfused(&request, &bufs), (1, 0));
    // The barrier is what makes it right: without it a work-item reads its
    // neighbour's element before the neighbour incremented it.
    let free = IrFusion::new().fuse(&FusionRequest { barriers: false, ..request.clone() }).unwrap();
    let host = HostCompiler::new();
    let (mut a, mut b) = (bufs.clone(), bufs.clone());
    run_fused(&host, &free, &mut a);
    run_unfused(&host, &request, &mut b);
    assert_eq!(a[&1], b[&1]);
    assert_ne!(a[&2], b[&2]);
    // Neighbours' elements of a buffer no kernel writes need no barrier.
    let read_only = FusionRequest {
        kernels: vec![step(&next, g, &[arg(1, n), arg(2, n)], &[]), step(&inc, g, &[arg(2, n)], &[])],
        barriers: true,
    };
    assert_eq!(fused_equals_unfused(&read_only, &bufs), (0, 1));
}

/// Uses local memory, though only its own work-item's element of it.
const SCRATCH: &str = "kernel void scratch(global float* x, local float* t) {
    size_t i = get_global_id(0), l = get_local_id(0);
    t[l] = x[i] * 2.0f;
    x[i] = t[l] + 1.0f;
}";
/// Has a barrier of its own.
const SYNC: &str = "kernel void sync_(global float* x) {
    size_t i = get_global_id(0);
    float v = x[i];
    barrier(CLK_GLOBAL_MEM_FENCE);
    x[i] = v * 0.5f;
}";

/// A kernel with local memory or with a barrier of its own keeps the barriers
/// around it; the barrier between the last two elementwise kernels goes.
#[test]
fn local_memory_and_own_barriers_keep_the_barriers_around_them() {
    let (n, group) = (1024, 64);
    let rw = Signature::new().global(AccessMode::ReadWrite);
    let inc = kernel("inc", INC, rw.clone());
    let scratch = kernel("scratch", SCRATCH, rw.clone().local(group * 4));
    let sync = kernel("sync_", SYNC, rw);
    let g = nd(n, group);
    let x = [arg(1, n)];
    let request = FusionRequest {
        kernels: [&inc, &scratch, &inc, &sync, &inc, &inc].iter().map(|k| step(k, g, &x, &[])).collect(),
        barriers: true,
    };
    let bufs: Buffers = [(1, data(n, 6))].into();
    // Four of the stub's five barriers stay, and the kernel's own.
    assert_eq!(fused_equals_unfused(&request, &bufs), (4 + 1, 1));
}

/// Indexes its 2-D range by both ids.
const INC2: &str = "kernel void inc2(global float* x) {
    x[get_global_id(1) * get_global_size(0) + get_global_id(0)] += 1.0f;
}";

/// 2-D kernels keep their barriers: a remapped one in a 1-D grid, and kernels over
/// a 2-D grid (even one whose first dimension alone tells work-items apart).
#[test]
fn two_dimensional_kernels_keep_the_barriers() {
    let n = 2048;
    let rw = Signature::new().global(AccessMode::ReadWrite);
    let inc = kernel("inc", INC, rw.clone());
    let inc2 = kernel("inc2", INC2, rw);
    let ids2 = kernel("ids2", IDS2, Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let bufs: Buffers = [(1, data(n, 8)), (2, vec![0.0; n])].into();
    let remapped = FusionRequest {
        kernels: vec![
            step(&inc, range(n), &[arg(1, n)], &[]),
            step(&ids2, range([16, n / 16]), &[arg(1, n), arg(2, n)], &[]),
            step(&inc, range(n), &[arg(1, n)], &[]),
        ],
        barriers: true,
    };
    assert_eq!(fused_equals_unfused(&remapped, &bufs), (2, 0));
    let grid2 = |k: &KernelRef, r: Range| FusionRequest {
        kernels: (0..3).map(|_| step(k, range(r), &[arg(1, n)], &[])).collect(),
        barriers: true,
    };
    assert_eq!(fused_equals_unfused(&grid2(&inc2, Range::d2(16, n / 16)), &bufs), (2, 0));
    assert_eq!(fused_equals_unfused(&grid2(&inc, Range::d2(1, n)), &bufs), (2, 0));
}

const CLAMP: &str = "kernel void clamp_sqrt(global float* x) {
    size_t i = get_global_id(0);
    x[i] = sqrt(fmax(fabs(x[i]), 0.25f));
}";

/// Kernels calling math built-ins fuse like any other: the built-ins are
/// intrinsics by the time the barrier analysis runs, so the barrier between two
/// elementwise kernels is elided, and the fused result is the unfused one.
#[test]
fn math_built_ins_do_not_keep_barriers() {
    let k = kernel("clamp_sqrt", CLAMP, Signature::new().global(AccessMode::ReadWrite));
    let n = 4096;
    let request = FusionRequest {
        kernels: (0..3).map(|_| step(&k, range(n), &[arg(1, n)], &[])).collect(),
        barriers: true,
    };
    let fusion = IrFusion::new();
    let fused = fusion.fuse(&request).unwrap();
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 2, "both barriers elided");
    let host = HostCompiler::new();
    let input = data(n, 3);
    let mut fused_bufs: Buffers = [(1, input.clone())].into();
    let mut unfused_bufs = fused_bufs.clone();
    run_fused(&host, &fused, &mut fused_bufs);
    run_unfused(&host, &request, &mut unfused_bufs);
    assert_eq!(fused_bufs[&1], unfused_bufs[&1]);
    let once = |v: f32| v.abs().max(0.25).sqrt();
    let want: Vec<f32> = input.iter().map(|&v| once(once(once(v)))).collect();
    assert_eq!(fused_bufs[&1], want, "sqrt and fmax are exact: the Rust reference, bit for bit");
}
