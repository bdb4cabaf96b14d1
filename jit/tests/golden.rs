//! Pass-level golden tests (issue #26, item 6): small LLVM IR inputs
//! (`tests/golden/*.ll`, each commented with what it exercises), one transformation
//! through the crate's public API, and properties of the output text checked by
//! patterns. Properties only, no whole-output files: those break with every LLVM
//! release. Each assertion's comment says what breakage it catches.

use gantry_driver::fusion::{FusionArg, FusionCompiler, FusionKernel, FusionRequest, Promotion};
use gantry_driver::{
    AccessMode, CodeImage, Geometry, ImageKind, Kernel, KernelRef, NdRange, Range, Signature,
};
use gantry_jit::{HostCompiler, IrFusion, PtxCompiler};
use inkwell::context::Context;
use inkwell::memory_buffer::MemoryBuffer;

fn golden(file: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(file);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn image(file: &str, entry: &str) -> CodeImage {
    gantry_jit::from_llvm_ir(&golden(file), entry).unwrap_or_else(|e| panic!("{e}"))
}

fn kernel(file: &str, entry: &str, signature: Signature) -> KernelRef {
    Kernel::new(entry, signature).with_image(image(file, entry)).into_ref()
}

/// The fused module as text (its image is bitcode).
fn text(image: &CodeImage) -> String {
    let context = Context::create();
    let buffer = MemoryBuffer::create_from_memory_range_copy(image.code(), "fused");
    let module = context.create_module_from_ir(buffer).unwrap_or_else(|e| panic!("{e}"));
    module.print_to_string().to_string()
}

/// The `define` line of function `name`.
fn define<'a>(ir: &'a str, name: &str) -> &'a str {
    let at = format!("@{name}(");
    let quoted = format!("@\"{name}\"(");
    ir.lines()
        .find(|l| l.starts_with("define") && (l.contains(&at) || l.contains(&quoted)))
        .unwrap_or_else(|| panic!("no definition of `{name}` in:\n{ir}"))
}

/// The number of parameters of the function `name` (one `%` each).
fn params(ir: &str, name: &str) -> usize {
    let line = define(ir, name);
    let open = line.find(&format!("{name}(")).or_else(|| line.find(&format!("{name}\"("))).unwrap();
    let list = &line[open..line.rfind(')').unwrap()];
    list.matches('%').count()
}

/// Calls of `callee` in `ir`.
fn calls(ir: &str, callee: &str) -> usize {
    ir.lines().filter(|l| !l.starts_with("declare") && l.contains(&format!("@{callee}("))).count()
}

/// The addresses in local memory (`getelementptr i8, ptr addrspace(3) %base, i64
/// %offset`), after asserting that each offset is wrapped to `bytes`: defined by
/// `urem i64 %x, bytes` or by `and i64 %x, mask` with `mask | 3 == bytes - 1`.
fn wrapped_local_accesses(ir: &str, bytes: u64) -> usize {
    let mut count = 0;
    for line in ir.lines().filter(|l| l.contains("getelementptr i8, ptr addrspace(3)")) {
        let offset = line.rsplit(' ').next().unwrap();
        let def = ir
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{offset} = ")))
            .unwrap_or_else(|| panic!("no definition of {offset}:\n{ir}"));
        let rhs = def.split(" = ").nth(1).unwrap();
        let constant: u64 = rhs.rsplit(", ").next().unwrap().trim().parse().unwrap_or(0);
        let wrapped = (rhs.starts_with("urem i64") && constant == bytes)
            || (rhs.starts_with("and i64") && constant | 3 == bytes - 1);
        assert!(wrapped, "an unwrapped local offset: `{def}` for `{line}`");
        count += 1;
    }
    count
}

/// Whether some instruction of `ir` is `op` (e.g. `udiv i64`) with the constant
/// `value` as its last operand.
fn has_op(ir: &str, op: &str, value: u64) -> bool {
    ir.lines().filter_map(|l| l.split(" = ").nth(1)).any(|rhs| {
        rhs.starts_with(op)
            && rhs.rsplit(", ").next().and_then(|c| c.trim().parse::<u64>().ok()) == Some(value)
    })
}

/// Vector types `<N x float>` with N >= 2 in `ir`.
fn float_vectors(ir: &str) -> usize {
    ir.match_indices(" x float>")
        .filter(|(at, _)| {
            let head = &ir[..*at];
            let digits = head.rsplit('<').next().unwrap_or_default();
            digits.parse::<u32>().is_ok_and(|n| n >= 2)
        })
        .count()
}

fn range(n: usize) -> Geometry {
    Geometry::for_range(Range::d1(n)).unwrap()
}

fn nd(n: usize, group: usize) -> Geometry {
    NdRange::new(n, group).geometry().unwrap()
}

fn step(kernel: &KernelRef, geometry: Geometry, args: &[FusionArg], scalars: &[u8]) -> FusionKernel {
    FusionKernel {
        kernel: kernel.clone(),
        geometry,
        args: args.iter().cloned().collect(),
        scalars: scalars.iter().copied().collect(),
        deps: Default::default(),
    }
}

fn arg(buffer: u64, n: usize) -> FusionArg {
    FusionArg::new(buffer, 0..n * 4, 4)
}

const STUB: &str = "gantry_fused";
const WORK_GROUPS: &str = "gantry.work_groups";
const GLOBAL_ID: &str = "_Z13get_global_idj";
const BARRIER: &str = "_Z7barrierj";

/// The host work-group function of an elementwise kernel: built-ins replaced by
/// the loop counters, and the work-item loop vectorized.
#[test]
fn host_elementwise_work_group_loop_is_vectorized() {
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::ReadWrite).scalar::<f32>();
    let ir = HostCompiler::new().optimized_ir(&image("elementwise.ll", "saxpy"), &sig).unwrap();
    // The work-group function is generated, with the launch record and the group
    // range as parameters (catches a changed entry or calling convention).
    assert_eq!(params(&ir, WORK_GROUPS), 3, "{}", define(&ir, WORK_GROUPS));
    // Catches a built-in left for the linker (it would fail to resolve at run time).
    assert_eq!(calls(&ir, GLOBAL_ID), 0, "{ir}");
    // Catches a work-item loop the vectorizer no longer sees through (e.g. barrier
    // splitting or a per-work-item context applied to a barrier-free kernel).
    assert!(float_vectors(&ir) > 0, "no <N x float> in the work-group function:\n{ir}");
    // No region state machine for a kernel without barriers (catches barrier
    // handling applied where it costs the vectorization).
    assert!(!ir.contains("%state"), "{ir}");
    // The kernel's one multiply and add are not contracted into an FMA: the host
    // must compute what the IR says (catches fast-math flags added on the way).
    assert!(!ir.contains("llvm.fma") && !ir.contains("llvm.fmuladd"), "{ir}");
}

/// A kernel with a barrier on the host: cut into regions run for every work-item in
/// turn; the value live across the barrier (the work-item's index) kept per
/// work-item.
#[test]
fn host_barrier_kernel_is_split_into_regions() {
    let sig = Signature::new().global(AccessMode::Read).global(AccessMode::Write).local(256);
    let ir = HostCompiler::new().optimized_ir(&image("reverse.ll", "rev"), &sig).unwrap();
    // Catches a barrier left as a call (it would not resolve, or would be a no-op
    // that lets work-item 0 read before the others wrote).
    assert_eq!(calls(&ir, BARRIER), 0, "{ir}");
    assert_eq!(calls(&ir, GLOBAL_ID), 0, "{ir}");
    // The regions run as a state machine: the state (the barrier the work-items
    // stopped at) is a phi of the group loop, compared with region 1 (catches a
    // kernel not cut, or cut into one region).
    assert!(ir.contains("%state = phi i32"), "{ir}");
    assert!(ir.contains("%state, 1"), "{ir}");
    // What crosses the barrier (`l`, `n`, `i`) is reloaded from the work-item's
    // context record (`%item`) in the second region (catches values kept in one
    // register or slot for the whole group: every work-item would see the last
    // one's).
    let reloads = ir.lines().filter(|l| l.contains(".reload") && l.contains("= load i64, ptr %item")).count();
    assert!(reloads >= 1, "{ir}");
}

/// Fusing two in-place kernels with scalars: the stub takes one global and no
/// scalars (they are constants of the fused module), and the barrier between the
/// kernels is elided (each work-item touches only its own element).
#[test]
fn fused_stub_folds_scalars_and_elides_the_barrier() {
    let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<f32>();
    let scale = kernel("chain.ll", "scale", sig);
    let n = 1024;
    let request = FusionRequest {
        kernels: vec![
            step(&scale, range(n), &[arg(1, n)], &2.5f32.to_ne_bytes()),
            step(&scale, range(n), &[arg(1, n)], &(-0.75f32).to_ne_bytes()),
        ],
        barriers: true,
    };
    let fusion = IrFusion::new();
    let fused = fusion.fuse(&request).unwrap();
    let ir = text(fused.kernel.image(ImageKind::LlvmIr).unwrap());
    // One buffer, one parameter: catches identical arguments not merged, or a
    // scalar block still passed in.
    assert_eq!(params(&ir, STUB), 1, "{}", define(&ir, STUB));
    // The constants are in the code (catches scalars read from the wrong offset or
    // the wrong kernel's block).
    assert!(ir.contains("2.500000e+00") && ir.contains("-7.500000e-01"), "{ir}");
    // The kernels are inlined into the stub (catches calls left to the renamed
    // kernels, which the host would then compile as separate kernels).
    assert_eq!(ir.lines().filter(|l| l.starts_with("define")).count(), 1, "{ir}");
    // Barrier elision: catches a kept barrier (no vectorization on the host).
    assert_eq!(calls(&ir, BARRIER), 0, "{ir}");
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 1);
}

/// A kernel reading its neighbour's element of what the kernel before wrote keeps
/// the barrier between them, in the fused module and in its PTX.
#[test]
fn fused_neighbour_read_keeps_one_barrier() {
    let scale = kernel("chain.ll", "scale", Signature::new().global(AccessMode::ReadWrite).scalar::<f32>());
    let next =
        kernel("chain.ll", "next", Signature::new().global(AccessMode::Read).global(AccessMode::Write));
    let (n, group) = (256, 64);
    let request = FusionRequest {
        kernels: vec![
            step(&scale, nd(n, group), &[arg(1, n)], &2.0f32.to_ne_bytes()),
            step(&next, nd(n, group), &[arg(1, n), arg(2, n)], &[]),
        ],
        barriers: true,
    };
    let fusion = IrFusion::new();
    let fused = fusion.fuse(&request).unwrap();
    let image = fused.kernel.image(ImageKind::LlvmIr).unwrap();
    let ir = text(image);
    // Catches an elided barrier that a work-item could observe.
    assert_eq!(calls(&ir, BARRIER), 1, "{ir}");
    assert_eq!(fusion.last_timings().unwrap().barriers_elided, 0);
    let ptx = PtxCompiler::new().compile(image, &fused.kernel.signature).unwrap();
    // One barrier, one bar.sync; a kernel with barriers is not guarded (a guard
    // would let some threads skip the barrier).
    assert_eq!(ptx.ptx.matches("bar.sync").count(), 1, "{}", ptx.ptx);
    assert!(!ptx.guarded);
}

/// Local internalization: the intermediate buffer leaves the stub's parameters and
/// every access to it goes to local memory at its offset modulo the group's bytes.
#[test]
fn fused_local_internalization_wraps_offsets() {
    let io = Signature::new().global(AccessMode::Read).global(AccessMode::Write);
    let tile = kernel("chain.ll", "tile", io.clone());
    let rotate = kernel("chain.ll", "rotate", io);
    let (n, group) = (512, 64);
    let t = arg(2, n).promoted(Promotion::Local);
    let request = FusionRequest {
        kernels: vec![
            step(&tile, nd(n, group), &[arg(1, n), t.clone()], &[]),
            step(&rotate, nd(n, group), &[t, arg(3, n)], &[]),
        ],
        barriers: true,
    };
    let fused = IrFusion::new().fuse(&request).unwrap();
    assert_eq!(fused.internal.len(), 1);
    let ir = text(fused.kernel.image(ImageKind::LlvmIr).unwrap());
    // Two globals and the local buffer: catches the internalized buffer still
    // passed (and written) as a global.
    assert_eq!(params(&ir, STUB), 3, "{}", define(&ir, STUB));
    assert!(define(&ir, STUB).contains("addrspace(3)"), "{}", define(&ir, STUB));
    // The `% size` rewrite: 256 bytes a group, so every address in the local
    // buffer is the byte offset `urem 256`, or once simplified `and 252` (catches
    // an offset used unwrapped: the global index, past the group's 256 bytes).
    assert_eq!(wrapped_local_accesses(&ir, 256), 2, "a store (tile) and a load (rotate):\n{ir}");
    // The only store to global memory is the output (catches a store left to the
    // internalized buffer).
    let global_stores =
        ir.lines().filter(|l| l.contains("store float") && l.contains("addrspace(1)")).count();
    assert_eq!(global_stores, 1, "{ir}");
    assert_eq!(calls(&ir, BARRIER), 1, "the barrier before the neighbour's read stays:\n{ir}");
}

/// Private internalization: no parameter, no memory at all once optimized (one
/// float per work-item lives in a register).
#[test]
fn fused_private_internalization_needs_no_memory() {
    let io = Signature::new().global(AccessMode::Read).global(AccessMode::Write);
    let twice = kernel("chain.ll", "twice", io.clone());
    let tile = kernel("chain.ll", "tile", io);
    let n = 1000;
    let t = arg(2, n).promoted(Promotion::Private);
    let request = FusionRequest {
        kernels: vec![
            step(&twice, range(n), &[arg(1, n), t.clone()], &[]),
            step(&tile, range(n), &[t, arg(3, n)], &[]),
        ],
        barriers: true,
    };
    let fused = IrFusion::new().fuse(&request).unwrap();
    assert_eq!(fused.internal.len(), 1);
    let ir = text(fused.kernel.image(ImageKind::LlvmIr).unwrap());
    // Catches the buffer kept as a parameter.
    assert_eq!(params(&ir, STUB), 2, "{}", define(&ir, STUB));
    // One store (the output), no alloca: catches the private copy kept in memory
    // (or written through to the global buffer).
    assert_eq!(ir.matches("store float").count(), 1, "{ir}");
    assert!(!ir.contains("alloca"), "{ir}");
    // 2 x then 3 x: both multiplies remain, in order (catches a kernel dropped).
    assert!(ir.contains("2.000000e+00") && ir.contains("3.000000e+00"), "{ir}");
    assert_eq!(calls(&ir, BARRIER), 0, "private data needs no barrier:\n{ir}");
}

/// A 2-D kernel in a 1-D grid: its ids are the grid's linear id delinearized in
/// its own range (a division and a remainder by its row length) and its global size
/// is its own, a constant.
#[test]
fn fused_remapping_delinearizes_a_2d_kernel() {
    let io = Signature::new().global(AccessMode::Read).global(AccessMode::Write);
    let twice = kernel("chain.ll", "twice", io.clone());
    let grid2 = kernel("chain.ll", "grid2", io);
    let (rows, cols) = (25, 40);
    let n = rows * cols;
    let request = FusionRequest {
        kernels: vec![
            step(&twice, range(n), &[arg(1, n), arg(2, n)], &[]),
            step(&grid2, Geometry::for_range(Range::d2(rows, cols)).unwrap(), &[arg(2, n), arg(3, n)], &[]),
        ],
        barriers: false,
    };
    let fused = IrFusion::new().fuse(&request).unwrap();
    assert_eq!(fused.geometry.dims(), 1);
    let ir = text(fused.kernel.image(ImageKind::LlvmIr).unwrap());
    // Column = linear id % 40, row = linear id / 40 (catches ids not remapped, or
    // delinearized with the grid's sizes instead of the kernel's).
    assert!(has_op(&ir, "urem i64", 40), "{ir}");
    assert!(has_op(&ir, "udiv i64", 40), "{ir}");
    // Its own global size is a constant: no call asks the grid for it (catches
    // `get_global_size` left to report the grid's 1000).
    assert_eq!(calls(&ir, "_Z15get_global_sizej"), 0, "{ir}");
}

/// PTX of a kernel with `.` in its helper's and its table's names, and two
/// barriers: no `.` in any PTX identifier, one `bar.sync` per barrier.
#[test]
fn ptx_names_and_barriers() {
    let sig = Signature::new().global(AccessMode::ReadWrite);
    let ptx = PtxCompiler::new().compile(&image("dotted.ll", "dotted"), &sig).unwrap();
    let text = &ptx.ptx;
    // Catches a barrier lost or duplicated by the lowering.
    assert_eq!(text.matches("bar.sync").count(), 2, "{text}");
    assert!(text.contains(".visible .entry dotted("), "{text}");
    // ptxas refuses `.` in identifiers: every declared name of a function, entry or
    // global is letters, digits, `_` and `$` (catches names copied from the IR).
    let mut names = 0;
    for line in text.lines().map(str::trim_start) {
        if !(line.starts_with(".visible")
            || line.starts_with(".func")
            || line.starts_with(".global")
            || line.starts_with(".entry")
            || line.starts_with(".extern"))
        {
            continue;
        }
        let name = line
            .split_whitespace()
            .filter(|w| !w.starts_with('.') && !w.chars().all(|c| c.is_ascii_digit()))
            .map(|w| w.split(['(', '[', ';', ',']).next().unwrap_or_default())
            .find(|w| !w.is_empty());
        let Some(name) = name else { continue };
        names += 1;
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$'),
            "`{name}` in `{line}`"
        );
    }
    assert!(names >= 2, "the entry and the table at least:\n{text}");
}
