//! End-to-end tests: OpenCL C through clang and the JIT, run on real data and
//! compared with Rust reference code.

use std::sync::RwLock;

use gantry_driver::{AccessMode, CodeImage, Signature};
use gantry_jit::{HostCompiler, HostLaunch, JitError};

/// Tests that run clang hold this shared; the one that points `GANTRY_CLANG`
/// elsewhere holds it exclusively.
static CLANG: RwLock<()> = RwLock::new(());

fn cl(source: &str, entry: &str) -> CodeImage {
    let _g = CLANG.read().unwrap_or_else(|e| e.into_inner());
    gantry_jit::from_opencl_c(source, entry).unwrap_or_else(|e| panic!("{e}"))
}

fn ptrs<T>(bufs: &mut [&mut [T]]) -> Vec<*mut u8> {
    bufs.iter_mut().map(|b| b.as_mut_ptr().cast()).collect()
}

const VADD: &str =
    "kernel void vadd(global const float* a, global const float* b, global float* c, float s) {
    size_t i = get_global_id(0);
    c[i] = a[i] + s * b[i];
}";

#[test]
fn vector_add_with_a_scalar() {
    let image = cl(VADD, "vadd");
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Write)
        .scalar::<f32>();
    assert_eq!(gantry_jit::signature_of(&image).unwrap(), sig);
    let kernel = HostCompiler::new().compile(&image, &sig).unwrap();
    let n = 1000;
    let mut a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut b: Vec<f32> = (0..n).map(|i| (i * 3 % 17) as f32).collect();
    let mut c = vec![0f32; n];
    let globals = ptrs(&mut [&mut a, &mut b, &mut c]);
    let scalars = 0.5f32.to_ne_bytes();
    // 1000 is not a multiple of 64: the last group is partial.
    let launch = HostLaunch::new(&globals, &scalars, &[], [n, 1, 1], [64, 1, 1]);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    for (i, ((c, a), b)) in c.iter().zip(&a).zip(&b).enumerate() {
        assert_eq!(*c, a + 0.5 * b, "element {i}");
    }
}

const REDUCE: &str = "kernel void reduce(global const int* in, global int* out, local int* tmp) {
    size_t l = get_local_id(0);
    tmp[l] = in[get_global_id(0)];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (l < s) tmp[l] += tmp[l + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (l == 0) out[get_group_id(0)] = tmp[0];
}";

#[test]
fn work_group_tree_reduction() {
    let image = cl(REDUCE, "reduce");
    let group = 128;
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(group * 4);
    let kernel = HostCompiler::new().compile(&image, &sig).unwrap();
    assert!(kernel.context_bytes() > 0);
    let groups = 37;
    let mut input: Vec<i32> = (0..(group * groups) as i32).map(|i| (i * 7919) % 1000 - 500).collect();
    let mut out = vec![0i32; groups];
    let mut tmp = vec![0i32; group];
    let globals = ptrs(&mut [&mut input[..], &mut out[..]]);
    let locals = [tmp.as_mut_ptr().cast::<u8>()];
    let launch = HostLaunch::new(&globals, &[], &locals, [group * groups, 1, 1], [group, 1, 1]);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    let expected: Vec<i32> = input.chunks(group).map(|c| c.iter().sum()).collect();
    assert_eq!(out, expected);
}

/// The PTX entry follows the CUDA driver's convention (pointers, scalars, four
/// hidden parameters), reads special registers, uses `bar.sync` and dynamic shared
/// memory for barrier kernels, and guards only the barrier-free kernel.
#[test]
fn ptx_entries_follow_the_cuda_convention() {
    let compiler = gantry_jit::PtxCompiler::new();
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Write)
        .scalar::<f32>();
    let vadd = compiler.compile(&cl(VADD, "vadd"), &sig).unwrap();
    let ptx = &vadd.ptx;
    assert!(ptx.contains(".visible .entry vadd("), "{ptx}");
    assert_eq!(vadd.params, 3 + 1 + 4);
    assert_eq!(ptx.matches(".param .u64 vadd_param_").count(), 6, "3 pointers and 3 hidden sizes: {ptx}");
    assert!(ptx.contains(".param .f32 vadd_param_3") && ptx.contains(".param .u32 vadd_param_7"), "{ptx}");
    assert!(ptx.contains("%tid.x") && ptx.contains("%ctaid.x") && ptx.contains("%ntid.x"), "{ptx}");
    assert!(ptx.contains("st.global.f32") && !ptx.contains("bar.sync"), "{ptx}");
    assert!(vadd.guarded && vadd.shared_bytes == 0);

    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(510);
    let reduce = compiler.compile(&cl(REDUCE, "reduce"), &sig).unwrap();
    let ptx = &reduce.ptx;
    assert!(ptx.contains(".visible .entry reduce("), "{ptx}");
    assert_eq!(reduce.params, 2 + 4);
    assert!(ptx.contains("bar.sync"), "{ptx}");
    assert!(ptx.contains(".extern .shared .align 16 .b8 gantry_shared[]"), "{ptx}");
    assert!(ptx.contains("st.shared") && ptx.contains("ld.shared"), "{ptx}");
    assert!(!reduce.guarded);
    assert_eq!(reduce.shared_bytes, 510);
    let two = sig.clone().local(8);
    assert_eq!(gantry_jit::ptx::local_offsets(&two), [0, 512]);
    assert_eq!(gantry_jit::ptx::shared_bytes(&two), 520);
    // For running them on a GPU: `GANTRY_PTX_DIR=/some/dir cargo test --release -p gantry-jit ptx_`.
    if let Some(dir) = std::env::var_os("GANTRY_PTX_DIR") {
        std::fs::write(std::path::Path::new(&dir).join("vadd.ptx"), &vadd.ptx).unwrap();
        std::fs::write(std::path::Path::new(&dir).join("reduce.ptx"), ptx).unwrap();
    }
    // Compiling again is a lookup.
    compiler.compile(&cl(REDUCE, "reduce"), &sig).unwrap();
    assert_eq!(compiler.cache().compiles(), 2);
}

#[test]
fn five_point_stencil_over_a_2d_nd_range() {
    let src = "kernel void stencil(global const float* in, global float* out) {
        size_t x = get_global_id(0), y = get_global_id(1);
        size_t w = get_global_size(0), h = get_global_size(1);
        size_t i = y * w + x;
        if (x == 0 || y == 0 || x == w - 1 || y == h - 1) { out[i] = in[i]; return; }
        out[i] = 4.0f * in[i] - in[i - 1] - in[i + 1] - in[i - w] - in[i + w];
    }";
    let (w, h) = (48usize, 20usize);
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write);
    let kernel = HostCompiler::new().compile(&cl(src, "stencil"), &sig).unwrap();
    let mut input: Vec<f32> = (0..w * h).map(|i| ((i * 37) % 101) as f32 * 0.25).collect();
    let mut out = vec![0f32; w * h];
    let globals = ptrs(&mut [&mut input[..], &mut out[..]]);
    let launch = HostLaunch::new(&globals, &[], &[], [w, h, 1], [16, 4, 1]);
    assert_eq!((launch.work_dim, launch.group_count()), (2, 15));
    // Two calls covering the groups, as two worker threads would run them.
    unsafe {
        kernel.run_groups(&launch, 0, 7).unwrap();
        kernel.run_groups(&launch, 7, 100).unwrap();
    }
    for y in 0..h {
        for x in 0..w {
            let i = y * w + x;
            let expected = if x == 0 || y == 0 || x == w - 1 || y == h - 1 {
                input[i]
            } else {
                4.0 * input[i] - input[i - 1] - input[i + 1] - input[i - w] - input[i + w]
            };
            assert_eq!(out[i], expected, "({x}, {y})");
        }
    }
}

/// A value computed before a barrier and used after it stays each work-item's own,
/// as does a private array; local memory written before the barrier is seen after it.
#[test]
fn private_values_live_across_barriers() {
    let src = "kernel void k(global const int* in, global int* out, local int* tmp) {
        size_t l = get_local_id(0), n = get_local_size(0);
        int v = in[get_global_id(0)] * 3 + (int)l;
        int arr[4];
        for (int j = 0; j < 4; j++) arr[j] = v + j;
        tmp[l] = v;
        barrier(CLK_LOCAL_MEM_FENCE);
        int next = tmp[(l + 1) % n];
        barrier(CLK_LOCAL_MEM_FENCE);
        out[get_global_id(0)] = v * 1000 + next + arr[(l + 2) % 4];
    }";
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(64 * 4);
    let kernel = HostCompiler::new().compile(&cl(src, "k"), &sig).unwrap();
    let (n, group) = (256usize, 64usize);
    let mut input: Vec<i32> = (0..n as i32).map(|i| (i * 13) % 29 - 7).collect();
    let mut out = vec![0i32; n];
    let mut tmp = vec![0i32; group];
    let globals = ptrs(&mut [&mut input[..], &mut out[..]]);
    let locals = [tmp.as_mut_ptr().cast::<u8>()];
    let launch = HostLaunch::new(&globals, &[], &locals, [n, 1, 1], [group, 1, 1]);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    let v = |g: usize| input[g] * 3 + (g % group) as i32;
    for (g, &got) in out.iter().enumerate() {
        let l = g % group;
        let next = v(g - l + (l + 1) % group);
        let arr = v(g) + ((l + 2) % 4) as i32;
        assert_eq!(got, v(g) * 1000 + next + arr, "work-item {g}");
    }
}

/// A 3-D ND-range with a global offset: every built-in, per work-item.
#[test]
fn three_dimensional_range_with_offset() {
    let src = "kernel void ids(global ulong* out) {
        size_t x = get_global_id(0) - get_global_offset(0);
        size_t y = get_global_id(1) - get_global_offset(1);
        size_t z = get_global_id(2) - get_global_offset(2);
        size_t i = (z * get_global_size(1) + y) * get_global_size(0) + x;
        out[4 * i] = get_global_id(0) + 100 * get_global_id(1) + 10000 * get_global_id(2);
        out[4 * i + 1] = get_local_id(0) + 100 * get_local_id(1) + 10000 * get_local_id(2);
        out[4 * i + 2] = get_group_id(0) + 100 * get_group_id(1) + 10000 * get_group_id(2)
            + 1000000 * get_work_dim();
        out[4 * i + 3] = get_num_groups(0) + 100 * get_num_groups(1) + 10000 * get_num_groups(2)
            + 1000000 * (get_local_size(0) + 10 * get_local_size(1) + 100 * get_local_size(2))
            + 1000000000 * get_global_linear_id() + 1000000000000 * get_local_linear_id();
    }";
    let sig = Signature::new().global(AccessMode::Write);
    let kernel = HostCompiler::new().compile(&cl(src, "ids"), &sig).unwrap();
    let (g, l, off) = ([4usize, 6, 8], [2usize, 3, 4], [1usize, 2, 3]);
    let mut out = vec![0u64; 4 * g.iter().product::<usize>()];
    let globals = ptrs(&mut [&mut out[..]]);
    let launch = HostLaunch::new(&globals, &[], &[], g, l).with_offset(off);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    for z in 0..g[2] {
        for y in 0..g[1] {
            for x in 0..g[0] {
                let i = (z * g[1] + y) * g[0] + x;
                let id = [x, y, z];
                let pack = |v: [usize; 3]| (v[0] + 100 * v[1] + 10000 * v[2]) as u64;
                let lid = [0, 1, 2].map(|d| id[d] % l[d]);
                let grp = [0, 1, 2].map(|d| id[d] / l[d]);
                let linear_local = (lid[2] * l[1] + lid[1]) * l[0] + lid[0];
                assert_eq!(out[4 * i], pack([0, 1, 2].map(|d| id[d] + off[d])), "{id:?}");
                assert_eq!(out[4 * i + 1], pack(lid), "{id:?}");
                assert_eq!(out[4 * i + 2], pack(grp) + 3_000_000, "{id:?}");
                let sizes = (l[0] + 10 * l[1] + 100 * l[2]) as u64;
                let expected = pack([2, 2, 2])
                    + 1_000_000 * sizes
                    + 1_000_000_000 * i as u64
                    + 1_000_000_000_000 * linear_local as u64;
                assert_eq!(out[4 * i + 3], expected, "{id:?}");
            }
        }
    }
}

#[test]
fn bad_inputs_give_typed_errors() {
    {
        let _g = CLANG.write().unwrap_or_else(|e| e.into_inner());
        std::env::set_var("GANTRY_CLANG", "/nonexistent/gantry-test-clang");
        let r = gantry_jit::from_opencl_c(VADD, "vadd");
        std::env::remove_var("GANTRY_CLANG");
        match r {
            Err(JitError::MissingTool { binary, env, .. }) => {
                assert_eq!(binary, std::path::Path::new("/nonexistent/gantry-test-clang"));
                assert_eq!(env, "GANTRY_CLANG");
            }
            other => panic!("{other:?}"),
        }
    }
    let _g = CLANG.read().unwrap_or_else(|e| e.into_inner());
    match gantry_jit::from_opencl_c("kernel void k(global int* a) { a[0] = ; }", "k") {
        Err(JitError::OpenClCompile { stderr }) => {
            assert!(stderr.contains("expected expression"), "{stderr}")
        }
        other => panic!("{other:?}"),
    }
    match gantry_jit::from_opencl_c(VADD, "nope") {
        Err(JitError::EntryNotFound { entry, available }) => {
            assert_eq!((entry.as_str(), available), ("nope", vec!["vadd".to_string()]))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(gantry_jit::from_llvm_ir(b"not IR at all", "k"), Err(JitError::IrParse { .. })));
    let image = gantry_jit::from_opencl_c(VADD, "vadd").unwrap();
    let compiler = HostCompiler::new();
    let three = Signature::new().global(AccessMode::Read).global(AccessMode::Read).global(AccessMode::Write);
    let param = |sig: &Signature| match compiler.compile(&image, sig) {
        Err(JitError::SignatureMismatch { param, .. }) => param,
        other => panic!("{other:?}"),
    };
    assert_eq!(param(&three), 3, "the kernel's scalar is not in the signature");
    assert_eq!(param(&three.clone().scalar::<f64>()), 3, "8 bytes for a float");
    assert_eq!(param(&three.clone().scalar::<f32>().scalar::<u32>()), 4, "a scalar the kernel lacks");
    assert_eq!(param(&Signature::new().global(AccessMode::Read)), 1);
    // `exp` is not one of the math built-ins translated to an intrinsic.
    let exp = gantry_jit::from_opencl_c("kernel void k(global float* a) { a[0] = exp(a[1]); }", "k").unwrap();
    match compiler.compile(&exp, &Signature::new().global(AccessMode::ReadWrite)) {
        Err(JitError::Unsupported { function, .. }) => assert_eq!(function, "_Z3expf"),
        other => panic!("{other:?}"),
    }
    let kernel = compiler.compile(&image, &three.clone().scalar::<f32>()).unwrap();
    let launch = HostLaunch::new(&[], &[0; 4], &[], [4, 1, 1], [4, 1, 1]);
    assert!(matches!(unsafe { kernel.run_groups(&launch, 0, 1) }, Err(JitError::Launch { .. })));
}

/// The barrier-free elementwise kernel's work-item loop is vectorized, and
/// compiling it again is a cache lookup.
#[test]
fn elementwise_loop_vectorizes_and_compiles_once() {
    let image = cl(VADD, "vadd");
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Write)
        .scalar::<f32>();
    let compiler = HostCompiler::new();
    let ir = compiler.optimized_ir(&image, &sig).unwrap();
    assert!(ir.contains(" x float>"), "no vector of floats in:\n{ir}");
    let a = compiler.compile(&image, &sig).unwrap();
    let b = compiler.compile(&cl(VADD, "vadd"), &sig).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(compiler.cache().compiles(), 1);
}

#[cfg(not(gantry_jit_no_prebuilt))]
#[test]
fn build_time_bitcode_runs() {
    static SAXPY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/saxpy.bc"));
    let image = gantry_jit::from_llvm_ir(SAXPY, "saxpy").unwrap();
    let sig = gantry_jit::signature_of(&image).unwrap();
    assert_eq!(sig, Signature::new().global(AccessMode::Read).global(AccessMode::ReadWrite).scalar::<f32>());
    let kernel = HostCompiler::new().compile(&image, &sig).unwrap();
    let mut x: Vec<f32> = (0..300).map(|i| i as f32).collect();
    let mut y = vec![1f32; 300];
    let globals = ptrs(&mut [&mut x[..], &mut y[..]]);
    let scalars = 2f32.to_ne_bytes();
    let launch = HostLaunch::new(&globals, &scalars, &[], [300, 1, 1], [128, 1, 1]);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    assert!(y.iter().enumerate().all(|(i, &v)| v == 2.0 * i as f32 + 1.0));
}

/// Every math built-in translated to an LLVM intrinsic, on `float` (four per
/// work-item, one call at a time) and on `float4`, plus `fmin`/`fmax` of a vector
/// and a scalar. Output `k` of element `j` is at `k * len + j`.
const MATH: &str = "kernel void math(global const float* a, global const float* b, global const float* c,
                                     global float* s, global float4* v) {
    size_t i = get_global_id(0), len = 4 * get_global_size(0), n = get_global_size(0);
    for (size_t j = 4 * i; j < 4 * i + 4; j++) {
        float x = a[j], y = b[j], z = c[j];
        s[0 * len + j] = fabs(x);
        s[1 * len + j] = sqrt(x);
        s[2 * len + j] = floor(x);
        s[3 * len + j] = ceil(x);
        s[4 * len + j] = trunc(x);
        s[5 * len + j] = rint(x);
        s[6 * len + j] = round(x);
        s[7 * len + j] = fmin(x, y);
        s[8 * len + j] = fmax(x, y);
        s[9 * len + j] = copysign(x, y);
        s[10 * len + j] = fma(x, y, z);
        s[11 * len + j] = mad(x, y, z);
    }
    float4 x = ((global const float4*)a)[i], y = ((global const float4*)b)[i], z = ((global const float4*)c)[i];
    v[0 * n + i] = fabs(x);
    v[1 * n + i] = sqrt(x);
    v[2 * n + i] = floor(x);
    v[3 * n + i] = ceil(x);
    v[4 * n + i] = trunc(x);
    v[5 * n + i] = rint(x);
    v[6 * n + i] = round(x);
    v[7 * n + i] = fmin(x, y);
    v[8 * n + i] = fmax(x, y);
    v[9 * n + i] = copysign(x, y);
    v[10 * n + i] = fma(x, y, z);
    v[11 * n + i] = mad(x, y, z);
    v[12 * n + i] = fmin(x, y.s2);
    v[13 * n + i] = fmax(x, y.s2);
}";

/// The math kernel's inputs: the edge cases (NaN, infinities, signed zeros,
/// subnormals, halfway cases for `rint`/`round`, values past 2^23 that are already
/// integral, a product `fma` and `mad` round differently) crossed with each other,
/// then pseudo-random values.
fn math_inputs() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let edge = [
        0.0,
        -0.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.5,
        -0.5,
        1.5,
        -1.5,
        2.5,
        -2.5,
        -0.4,
        0.49999997,
        8388607.5,
        -8388609.0,
        1e30,
        -3.75,
        f32::MIN_POSITIVE / 8.0,
        -f32::MIN_POSITIVE / 8.0,
        f32::MAX,
        -1.0,
        1.0 + 1.0 / 4096.0,
    ];
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for &x in &edge {
        for &y in &edge {
            a.push(x);
            b.push(y);
            c.push(if x == 1.0 + 1.0 / 4096.0 { -1.0 } else { edge[(a.len() * 7) % edge.len()] });
        }
    }
    let mut seed = 0x2545_f491_u32;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32 - 0.5) * 200.0
    };
    while a.len() % 64 != 0 || a.len() < 1024 {
        a.push(next());
        b.push(next());
        c.push(next());
    }
    (a, b, c)
}

/// Whether `got` is what OpenCL C requires for `op` where Rust computes `expected`:
/// the same bits, except that a NaN produced by arithmetic may have any payload
/// (neither OpenCL nor Rust fixes it; `fabs` and `copysign` only touch the sign bit,
/// so theirs are compared bit for bit), `fmin`/`fmax` of two zeros may return either
/// (both leave the sign of `fmin(-0.0, +0.0)` unspecified), and `mad` may be fused
/// or not.
fn math_matches(op: usize, x: f32, y: f32, z: f32, got: f32, expected: f32) -> bool {
    const FABS: usize = 0;
    const FMIN: usize = 7;
    const FMAX: usize = 8;
    const COPYSIGN: usize = 9;
    const MAD: usize = 11;
    if got.to_bits() == expected.to_bits() {
        return true;
    }
    match op {
        FABS | COPYSIGN => false,
        FMIN | FMAX if x == 0.0 && y == 0.0 => got == 0.0,
        MAD => got.to_bits() == (x * y + z).to_bits() || (got.is_nan() && expected.is_nan()),
        _ => got.is_nan() && expected.is_nan(),
    }
}

fn math_expected(op: usize, x: f32, y: f32, z: f32) -> f32 {
    [
        x.abs(),
        x.sqrt(),
        x.floor(),
        x.ceil(),
        x.trunc(),
        x.round_ties_even(),
        x.round(),
        x.min(y),
        x.max(y),
        x.copysign(y),
        x.mul_add(y, z),
        x.mul_add(y, z),
    ][op]
}

#[test]
fn math_builtins_match_rust() {
    let image = cl(MATH, "math");
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Write)
        .global(AccessMode::Write);
    let kernel = HostCompiler::new().compile(&image, &sig).unwrap();
    let (mut a, mut b, mut c) = math_inputs();
    let len = a.len();
    let mut s = vec![0f32; 12 * len];
    let mut v = vec![0f32; 14 * len];
    let globals = ptrs(&mut [&mut a[..], &mut b[..], &mut c[..], &mut s[..], &mut v[..]]);
    let launch = HostLaunch::new(&globals, &[], &[], [len / 4, 1, 1], [16, 1, 1]);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    let names =
        ["fabs", "sqrt", "floor", "ceil", "trunc", "rint", "round", "fmin", "fmax", "copysign", "fma", "mad"];
    for j in 0..len {
        let (x, y, z) = (a[j], b[j], c[j]);
        for (op, name) in names.iter().enumerate() {
            let expected = math_expected(op, x, y, z);
            for (kind, got) in [("float", s[op * len + j]), ("float4", v[op * len + j])] {
                assert!(
                    math_matches(op, x, y, z, got, expected),
                    "{kind} {name}({x:e}, {y:e}, {z:e}) = {got:e} ({:#x}), Rust gives {expected:e} ({:#x})",
                    got.to_bits(),
                    expected.to_bits()
                );
            }
        }
        // fmin/fmax(float4, float): the scalar is element 2 of `b`'s vector.
        let y2 = b[j / 4 * 4 + 2];
        for (op, k) in [(7, 12), (8, 13)] {
            let got = v[k * len + j];
            assert!(
                math_matches(op, x, y2, z, got, math_expected(op, x, y2, z)),
                "{} {x:e} {y2:e}: {got:e}",
                names[op]
            );
        }
    }
    // The `fma` case that rounds differently from a product then a sum is in the data.
    let r = 1.0 + 1.0f32 / 4096.0;
    assert_ne!(r.mul_add(r, -1.0), r * r - 1.0);
    assert!(a.iter().zip(&c).any(|(&x, &z)| x == r && z == -1.0));
}

/// The same kernel as PTX: every built-in is an instruction (`sqrt` the correctly
/// rounded one), none a call.
#[test]
fn math_builtins_are_ptx_instructions() {
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Write)
        .global(AccessMode::Write);
    let kernel = gantry_jit::PtxCompiler::new().compile(&cl(MATH, "math"), &sig).unwrap();
    let ptx = &kernel.ptx;
    for instruction in
        ["max.f32", "min.f32", "sqrt.rn.f32", "abs.f32", "fma.rn.f32", "cvt.rmi.f32.f32", "cvt.rpi.f32.f32"]
    {
        assert!(ptx.contains(instruction), "no {instruction} in:\n{ptx}");
    }
    assert!(!ptx.contains("call") && !ptx.contains("sqrt.approx") && !ptx.contains(".extern"), "{ptx}");
    if let Some(dir) = std::env::var_os("GANTRY_PTX_DIR") {
        std::fs::write(std::path::Path::new(&dir).join("math.ptx"), ptx).unwrap();
    }
}

/// A built-in that would need libm or libdevice is refused by both compilers, by
/// its name, as are the math built-ins on types their names do not say.
#[test]
fn untranslated_math_builtins_are_refused_by_name() {
    let image = cl("kernel void k(global float* a) { a[0] = exp(a[1]) + fmax(a[2], a[3]); }", "k");
    let sig = Signature::new().global(AccessMode::ReadWrite);
    for r in [
        HostCompiler::new().compile(&image, &sig).map(|_| ()),
        gantry_jit::PtxCompiler::new().compile(&image, &sig).map(|_| ()),
    ] {
        match r {
            Err(JitError::Unsupported { function, what }) => {
                assert_eq!(function, "_Z3expf", "{what}");
                assert!(what.contains("neither defined in the module nor a built-in"), "{what}");
            }
            other => panic!("{other:?}"),
        }
    }
    // IR whose `fabs` declaration has the wrong type for its name stays a call.
    let ir = b"define spir_kernel void @k(ptr addrspace(1) %a) {
  %x = load i32, ptr addrspace(1) %a
  %y = call spir_func i32 @_Z4fabsf(i32 %x)
  store i32 %y, ptr addrspace(1) %a
  ret void
}
declare spir_func i32 @_Z4fabsf(i32)
";
    let image = gantry_jit::from_llvm_ir(ir, "k").unwrap();
    match HostCompiler::new().compile(&image, &sig) {
        Err(JitError::Unsupported { function, .. }) => assert_eq!(function, "_Z4fabsf"),
        other => panic!("{other:?}"),
    }
}

/// The same translation on `double` and `double2` (scalars and vectors of f64).
#[test]
fn math_builtins_on_doubles() {
    let src =
        "kernel void k(global const double* a, global const double* b, global double* s, global double2* v) {
        size_t i = get_global_id(0), n = get_global_size(0);
        for (size_t j = 2 * i; j < 2 * i + 2; j++) {
            s[j] = fma(sqrt(fabs(a[j])), b[j], fmax(a[j], b[j]));
            s[2 * n + j] = copysign(rint(a[j]) + round(b[j]) + floor(a[j]) - ceil(b[j]) + trunc(a[j]), b[j]);
        }
        double2 x = ((global const double2*)a)[i], y = ((global const double2*)b)[i];
        v[i] = fma(sqrt(fabs(x)), y, fmax(x, y));
        v[n + i] = copysign(rint(x) + round(y) + floor(x) - ceil(y) + trunc(x), y) + fmin(x, y.s1);
    }";
    let image = cl(src, "k");
    let sig = Signature::new()
        .global(AccessMode::Read)
        .global(AccessMode::Read)
        .global(AccessMode::Write)
        .global(AccessMode::Write);
    let kernel = HostCompiler::new().compile(&image, &sig).unwrap();
    let len = 256;
    let mut a: Vec<f64> = (0..len).map(|i| (i as f64 - 128.0) * 0.75 + 0.25 * (i % 3) as f64).collect();
    let mut b: Vec<f64> = (0..len).map(|i| (i as f64 * 1.37).sin() * 50.0).collect();
    let mut s = vec![0f64; 2 * len];
    let mut v = vec![0f64; 2 * len];
    let globals = ptrs(&mut [&mut a[..], &mut b[..], &mut s[..], &mut v[..]]);
    let launch = HostLaunch::new(&globals, &[], &[], [len / 2, 1, 1], [16, 1, 1]);
    unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
    for j in 0..len {
        let (x, y) = (a[j], b[j]);
        let first = x.abs().sqrt().mul_add(y, x.max(y));
        let second = (x.round_ties_even() + y.round() + x.floor() - y.ceil() + x.trunc()).copysign(y);
        assert_eq!(s[j].to_bits(), first.to_bits(), "double {x} {y}");
        assert_eq!(s[len + j].to_bits(), second.to_bits(), "double {x} {y}");
        assert_eq!(v[j].to_bits(), first.to_bits(), "double2 {x} {y}");
        let y1 = b[j / 2 * 2 + 1];
        assert_eq!(v[len + j].to_bits(), (second + x.min(y1)).to_bits(), "double2 {x} {y}");
    }
    let ptx = gantry_jit::PtxCompiler::new().compile(&image, &sig).unwrap().ptx.clone();
    for instruction in ["sqrt.rn.f64", "fma.rn.f64", "max.f64", "min.f64", "abs.f64"] {
        assert!(ptx.contains(instruction), "no {instruction} in:\n{ptx}");
    }
    assert!(!ptx.contains("call"), "{ptx}");
}

const BY_DIMENSION: &str = "kernel void by_dimension(global uint* out, uint d) {
    size_t i = (get_global_id(2) * get_global_size(1) + get_global_id(1)) * get_global_size(0) + get_global_id(0);
    out[4 * i] = get_global_id(d);
    out[4 * i + 1] = get_global_size(d);
    out[4 * i + 2] = get_local_id(d);
    out[4 * i + 3] = get_num_groups(d);
}";

/// Built-ins whose dimension is known only at run time (a scalar here) select
/// among the three dimensions on the host, and give the values OpenCL defines past
/// dimension 2 (ids 0, sizes 1); the PTX selects among the special registers.
#[test]
fn a_dimension_known_at_run_time() {
    let image = cl(BY_DIMENSION, "by_dimension");
    let sig = Signature::new().global(AccessMode::Write).scalar::<u32>();
    let kernel = HostCompiler::new().compile(&image, &sig).unwrap();
    let (global, local) = ([4usize, 6, 2], [2usize, 3, 1]);
    let items: usize = global.iter().product();
    for d in 0..5u32 {
        let mut out = vec![u32::MAX; 4 * items];
        let globals = [out.as_mut_ptr().cast::<u8>()];
        let scalars = d.to_ne_bytes();
        let launch = HostLaunch::new(&globals, &scalars, &[], global, local);
        // SAFETY: `out` holds 4 values per work-item, which the kernel writes.
        unsafe { kernel.run_groups(&launch, 0, launch.group_count()).unwrap() };
        for (i, v) in out.chunks(4).enumerate() {
            let id = [i % global[0], i / global[0] % global[1], i / (global[0] * global[1])];
            let expect = match d as usize {
                d @ 0..=2 => [id[d], global[d], id[d] % local[d], global[d] / local[d]],
                _ => [0, 1, 0, 1],
            };
            assert_eq!(v, expect.map(|x| x as u32), "dimension {d}, work-item {i}");
        }
    }
    let ptx = gantry_jit::PtxCompiler::new().compile(&image, &sig).unwrap();
    assert!(ptx.ptx.contains("selp"), "a run-time choice among dimensions: {}", ptx.ptx);
}
