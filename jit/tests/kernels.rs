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
    let sqrt =
        gantry_jit::from_opencl_c("kernel void k(global float* a) { a[0] = sqrt(a[1]); }", "k").unwrap();
    match compiler.compile(&sqrt, &Signature::new().global(AccessMode::ReadWrite)) {
        Err(JitError::Unsupported { function, .. }) => assert_eq!(function, "_Z4sqrtf"),
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
