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
    for i in 0..n {
        assert_eq!(c[i], a[i] + 0.5 * b[i], "element {i}");
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
    // Compiling again is a lookup.
    compiler.compile(&cl(REDUCE, "reduce"), &sig).unwrap();
    assert_eq!(compiler.cache().compiles(), 2);
}
