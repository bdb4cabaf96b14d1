//! The closure fusion compiler's tests.

use std::collections::HashMap;
use std::sync::Mutex;

use super::body::span_within;
use super::*;
use crate::access::{Accessor, DiscardWrite, ElemAccessor, LocalAccessor, Read, ReadWrite, Write};
use crate::closure::{phase, Arena};
use crate::elementwise::map_phase;
use crate::item::Item;
use crate::snapshot::SnapshotPool;
use gantry_driver::fusion::{FusionArg, FusionKernel, PromotionMismatch, Unprofitable};
use gantry_driver::RANGE_CHUNK;
use gantry_driver::{panic_message, Binding, ExecError, ItemCost, NdRange, Range, ScratchKind};

/// A single-phase kernel named `name` whose one-slot-per-buffer accessors are
/// built by the test.
fn kernel(
    name: &str,
    tag: u64,
    slots: usize,
    f: impl Fn(&mut Item<'_>) + Send + Sync + 'static,
) -> KernelRef {
    ClosureKernel {
        tag,
        phases: smallvec::smallvec![phase(f)],
        global_slots: slots,
        scratch: vec![],
        unfused: None,
    }
    .into_kernel(name, vec![AccessMode::ReadWrite; slots], ItemCost::default())
}

fn range(n: usize) -> Geometry {
    Geometry::for_range(Range::d1(n)).unwrap()
}

fn nd(global: impl Into<Range>, local: impl Into<Range>) -> Geometry {
    NdRange::new(global, local).geometry().unwrap()
}

/// Runs a fused kernel over host vectors, one per buffer id.
fn run(fused: &Fused, buffers: &mut HashMap<u64, Vec<u32>>) {
    run_with(fused, buffers, &mut Arena::default())
}

/// [`run`] on a thread's arena that earlier kernels used.
fn run_with(fused: &Fused, buffers: &mut HashMap<u64, Vec<u32>>, arena: &mut Arena) {
    let globals: Vec<Binding> = fused
        .args
        .iter()
        .map(|a| {
            let v = buffers.get_mut(&a.buffer).unwrap();
            // SAFETY: the hull lies inside the vector.
            Binding::new(unsafe { v.as_mut_ptr().cast::<u8>().add(a.start) }, a.end - a.start)
        })
        .collect();
    for g in 0..fused.geometry.group_count() {
        fused.kernel.closure().unwrap().run_group(&fused.geometry, g, &globals, arena);
    }
}

fn request(kernels: Vec<FusionKernel>) -> FusionRequest {
    FusionRequest { kernels, barriers: true }
}

fn whole(buffer: u64, n: usize) -> FusionArg {
    FusionArg::new(buffer, 0..n * 4, 4)
}

fn error_of(geometries: &[Geometry]) -> FusionError {
    let kernels = geometries
        .iter()
        .enumerate()
        .map(|(i, g)| FusionKernel {
            kernel: kernel(&format!("k{i}"), i as u64, 0, |_| {}),
            geometry: *g,
            args: smallvec::smallvec![],
            deps: Default::default(),
            scalars: Default::default(),
        })
        .collect();
    ClosureFusion::new().fuse(&request(kernels)).unwrap_err()
}

#[test]
fn illegal_nd_range_combinations_name_the_reason() {
    assert_eq!(ClosureFusion::new().fuse(&request(vec![])).unwrap_err(), FusionError::Empty);
    assert!(matches!(error_of(&[nd(16, 4), nd(16, 8)]), FusionError::DifferentLocalSizes { .. }));
    // A plain range of 18 is the largest launch: 18 items in groups of 4 do not divide.
    assert!(matches!(error_of(&[nd(16, 4), range(18)]), FusionError::NonUniformWorkGroups { .. }));
    assert!(matches!(
        error_of(&[nd([4, 4], [2, 2]), nd([2, 4], [2, 2]), range(32)]),
        FusionError::DifferentDimensions { .. }
    ));
    assert!(matches!(
        error_of(&[nd([4, 8], [2, 2]), nd([2, 4], [2, 2])]),
        FusionError::DifferentGlobalSizes { .. }
    ));
    let shifted = NdRange::new(16, 4).with_offset([4, 0, 0]).geometry().unwrap();
    assert!(matches!(error_of(&[nd(16, 4), shifted]), FusionError::DifferentOffsets { .. }));
    // Equal non-zero offsets are fine when no ids are remapped.
    let plain_shifted = Geometry::for_range_with_offset(Range::d1(8), [2, 0, 0]).unwrap();
    let ok = [plain_shifted, plain_shifted];
    let kernels = ok.iter().map(|g| FusionKernel {
        kernel: kernel("k", 0, 0, |_| {}),
        geometry: *g,
        args: smallvec::smallvec![],
        deps: Default::default(),
        scalars: Default::default(),
    });
    assert!(ClosureFusion::new().fuse(&request(kernels.collect())).is_ok());
    // Remapping a reshaped plain kernel with non-zero offsets is not.
    let a = Geometry::for_range_with_offset(Range::d2(2, 4), [1, 1, 0]).unwrap();
    let b = Geometry::for_range_with_offset(Range::d1(8), [1, 1, 0]).unwrap();
    assert!(matches!(error_of(&[a, b]), FusionError::DifferentOffsets { .. }));
}

/// Kernels of different shapes fuse into the largest grid; each sees its own ids
/// and ranges, and work-items past a kernel's range skip it.
#[test]
fn work_items_are_remapped_per_kernel() {
    type Seen = Vec<(usize, [usize; 3], usize, usize)>;
    let seen: Arc<Mutex<Seen>> = Default::default();
    let log = |k: usize| {
        let seen = seen.clone();
        move |it: &mut Item<'_>| {
            seen.lock().unwrap().push((
                k,
                [it.global_id(0), if it.dims() > 1 { it.global_id(1) } else { 0 }, 0],
                it.global_linear_id(),
                it.global_range(0),
            ))
        }
    };
    let kernels = vec![
        FusionKernel {
            kernel: kernel("line", 1, 0, log(0)),
            geometry: range(10),
            args: smallvec::smallvec![],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: kernel("grid", 2, 0, log(1)),
            geometry: Geometry::for_range(Range::d2(3, 8)).unwrap(),
            args: smallvec::smallvec![],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: kernel("cube", 3, 0, log(2)),
            geometry: Geometry::for_range(Range::d3(2, 2, 3)).unwrap(),
            args: smallvec::smallvec![],
            deps: Default::default(),
            scalars: Default::default(),
        },
    ];
    let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
    assert_eq!(fused.geometry.global_range(), [3, 8, 1], "the largest kernel's grid");
    run(&fused, &mut HashMap::new());
    let seen = seen.lock().unwrap();
    for (k, total, dims_range0) in [(0, 10, 10), (1, 24, 3), (2, 12, 2)] {
        let mut lin: Vec<usize> = seen.iter().filter(|s| s.0 == k).map(|s| s.2).collect();
        lin.sort();
        assert_eq!(lin, (0..total).collect::<Vec<_>>(), "kernel {k} runs each of its items once");
        assert!(seen.iter().filter(|s| s.0 == k).all(|s| s.3 == dims_range0));
    }
    // The 1-D kernel's global id is the global linear id.
    assert!(seen.iter().filter(|s| s.0 == 0).all(|s| s.1[0] == s.2));
    // The 2-D kernel keeps its own (row, column).
    assert!(seen.iter().filter(|s| s.0 == 1).all(|s| s.1[0] * 8 + s.1[1] == s.2));
}

/// x -> tmp -> out with tmp private: the output is right and tmp is not touched.
#[test]
fn private_internalization_keeps_values_per_work_item() {
    let n = 2048;
    let (x, tmp, out) = (
        Accessor::<u32, Read>::new(0, 1, n),
        Accessor::<u32, Write>::new(1, 1, n),
        Accessor::<u32, Write>::new(1, 2, n),
    );
    let tmp_in = Accessor::<u32, Read>::new(0, 2, n);
    let k1 = kernel("double", 1, 2, move |it| {
        let i = it.global_linear_id();
        tmp.set(it, i, x.get(it, i) * 2)
    });
    let k2 = kernel("inc", 2, 2, move |it| {
        let i = it.global_linear_id();
        out.set(it, i, tmp_in.get(it, i) + 1)
    });
    let kernels = vec![
        FusionKernel {
            kernel: k1,
            geometry: range(n),
            args: smallvec::smallvec![whole(10, n), whole(11, n).promoted(Promotion::Private)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: k2,
            geometry: range(n),
            args: smallvec::smallvec![whole(11, n).promoted(Promotion::Private), whole(12, n)],
            deps: Default::default(),
            scalars: Default::default(),
        },
    ];
    let fused = ClosureFusion::new().fusing_unprofitable().fuse(&request(kernels)).unwrap();
    assert_eq!(fused.internal.len(), 1);
    assert_eq!(
        (fused.internal[0].buffer, fused.internal[0].kind, fused.internal[0].bytes),
        (11, Promotion::Private, 4)
    );
    assert_eq!(fused.args.iter().map(|a| a.buffer).collect::<Vec<_>>(), vec![10, 12]);
    let mut bufs = HashMap::from([(10, (0..n as u32).collect()), (11, vec![7; n]), (12, vec![0; n])]);
    run(&fused, &mut bufs);
    assert_eq!(bufs[&12], (0..n as u32).map(|v| v * 2 + 1).collect::<Vec<_>>());
    assert_eq!(bufs[&11], vec![7; n], "not written back");
}

/// A private intermediate that an elementwise kernel writes whole before anything
/// reads it is not cleared for every group; one that a kernel may read first is,
/// so what that kernel reads is zero, not what earlier kernels left in the
/// thread's arena.
#[test]
fn only_private_buffers_written_first_skip_clearing() {
    let n = 2048;
    let map = |name: &str, tag: u64, f: fn(u32) -> u32| {
        let (input, output) =
            (Accessor::<u32, Read>::new(0, tag, n), ElemAccessor::<u32, DiscardWrite>::new(1, tag, n));
        ClosureKernel {
            tag,
            phases: smallvec::smallvec![map_phase(input, output, f)],
            global_slots: 2,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel(name, vec![AccessMode::ReadWrite; 2], ItemCost::default())
    };
    let (peek_in, peek_out) = (Accessor::<u32, Read>::new(0, 3, n), Accessor::<u32, Write>::new(1, 3, n));
    let peek = kernel("peek", 3, 2, move |it| {
        let i = it.global_linear_id();
        peek_out.set(it, i, peek_in.get(it, i))
    });
    let private = |b: u64| whole(b, n).promoted(Promotion::Private);
    // x -> 11 -> 12 through maps; `peek` copies 13 to 14 before a map writes 13.
    let kernels = vec![
        FusionKernel {
            kernel: map("double", 1, |v| v * 2),
            geometry: range(n),
            args: smallvec::smallvec![whole(10, n), private(11)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: map("inc", 2, |v| v + 1),
            geometry: range(n),
            args: smallvec::smallvec![private(11), whole(12, n)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: peek,
            geometry: range(n),
            args: smallvec::smallvec![private(13), whole(14, n)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: map("triple", 4, |v| v * 3),
            geometry: range(n),
            args: smallvec::smallvec![whole(10, n), private(13)],
            deps: Default::default(),
            scalars: Default::default(),
        },
    ];
    let fused = ClosureFusion::new().fusing_unprofitable().fuse(&request(kernels)).unwrap();
    assert_eq!(fused.internal.iter().map(|i| i.buffer).collect::<Vec<_>>(), vec![11, 13]);
    let zeroed: Vec<bool> = fused.kernel.closure().unwrap().scratch.iter().map(|s| s.zeroed).collect();
    assert_eq!(zeroed, vec![false, true]);

    // An arena that a kernel with a large local region filled with ones.
    let mut arena = Arena::default();
    let tile = LocalAccessor::<u32>::new(0, 5, 1 << 14);
    let dirty = ClosureKernel {
        tag: 5,
        phases: smallvec::smallvec![phase(move |it| (0..tile.len()).for_each(|j| tile.set(it, j, !0)))],
        global_slots: 0,
        scratch: vec![Scratch::new(ScratchKind::Local, 4 << 14)],
        unfused: None,
    };
    dirty.run_group(&range(1), 0, &[], &mut arena);

    let mut bufs = HashMap::from([
        (10, (0..n as u32).collect()),
        (11, vec![7; n]),
        (12, vec![0; n]),
        (13, vec![9; n]),
        (14, vec![5; n]),
    ]);
    run_with(&fused, &mut bufs, &mut arena);
    assert_eq!(bufs[&12], (0..n as u32).map(|v| v * 2 + 1).collect::<Vec<_>>());
    assert_eq!(bufs[&14], vec![0; n], "read before written: cleared");
    assert_eq!((&bufs[&11], &bufs[&13]), (&vec![7; n], &vec![9; n]), "not written back");
}

/// Element counters shared by the kernels of [`counted_map`]: per kernel, how many
/// elements it mapped, and how many its predecessor had mapped when it started.
#[derive(Default)]
struct Counters {
    calls: [std::sync::atomic::AtomicUsize; 4],
    started: [std::sync::atomic::AtomicUsize; 4],
}

impl Counters {
    fn reset(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.iter().chain(&self.started).for_each(|c| c.store(0, Relaxed));
    }
    fn calls(&self) -> Vec<usize> {
        self.calls.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect()
    }
    fn started(&self) -> Vec<usize> {
        self.started.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect()
    }
}

/// Map kernel `k` (tag `k`, `n` elements, slots 0 and 1) of `f`, counted in `counters`.
fn counted_map(k: usize, n: usize, f: fn(u32) -> u32, counters: &Arc<Counters>) -> KernelRef {
    use std::sync::atomic::Ordering::Relaxed;
    let (input, output) =
        (Accessor::<u32, Read>::new(0, k as u64, n), ElemAccessor::<u32, DiscardWrite>::new(1, k as u64, n));
    let c = counters.clone();
    let counted = move |v: u32| {
        if k > 0 && c.calls[k].load(Relaxed) == 0 {
            c.started[k].store(c.calls[k - 1].load(Relaxed), Relaxed);
        }
        c.calls[k].fetch_add(1, Relaxed);
        f(v)
    };
    ClosureKernel {
        tag: k as u64,
        phases: smallvec::smallvec![map_phase(input, output, counted)],
        global_slots: 2,
        scratch: vec![],
        unfused: None,
    }
    .into_kernel(format!("k{k}"), vec![AccessMode::ReadWrite; 2], ItemCost::default())
}

/// A chain of elementwise kernels runs span by span (`FusedBody::stream`), with
/// or without barriers, over global and private intermediates, a partial last
/// group and a partial last span: each kernel maps each element exactly once and
/// the results are the serial ones. With a private intermediate of two elements
/// per work-item, its runs are not contiguous and each kernel's own phase runs
/// per span instead (over one run for kernels 0 and 1, per work-item for 2 and
/// 3); the same holds.
#[test]
fn elementwise_chains_stream_span_by_span() {
    let n = 10_000; // groups of 4,096: the last holds 1,808, a partial last span
    let counters = Arc::new(Counters::default());
    // `wide`: private buffer 13 holds two elements per work-item.
    let kernels = |wide: usize| {
        let private = |b: u64| {
            let elems = if b == 13 { wide * n } else { n };
            FusionArg::new(b, 0..elems * 4, 4).promoted(Promotion::Private)
        };
        // 10 -> 11 (private) -> 12 -> 13 (private) -> 14
        let fs: [fn(u32) -> u32; 4] = [|v| v * 2, |v| v + 1, |v| v * 3, |v| v + 7];
        let args = [
            vec![whole(10, n), private(11)],
            vec![private(11), whole(12, n)],
            vec![whole(12, n), private(13)],
            vec![private(13), whole(14, n)],
        ];
        fs.into_iter()
            .zip(args)
            .enumerate()
            .map(|(k, (f, args))| FusionKernel {
                kernel: counted_map(k, n, f, &counters),
                geometry: range(n),
                args: args.into(),
                deps: Default::default(),
                scalars: Default::default(),
            })
            .collect::<Vec<_>>()
    };
    for (wide, barriers) in [(1, true), (1, false), (2, true)] {
        let fused = ClosureFusion::new().fuse(&FusionRequest { kernels: kernels(wide), barriers });
        let fused = fused.unwrap();
        assert_eq!(fused.internal.iter().map(|i| i.buffer).collect::<Vec<_>>(), vec![11, 13]);
        counters.reset();
        let mut bufs = HashMap::from([
            (10, (0..n as u32).collect()),
            (11, vec![5; n]),
            (12, vec![0; n]),
            (13, vec![6; wide * n]),
            (14, vec![0; n]),
        ]);
        run(&fused, &mut bufs);
        let label = format!("{wide} private element(s) per work-item in 13, barriers {barriers}");
        assert_eq!(counters.calls(), vec![n; 4], "{label}: each kernel maps each element once");
        let started = counters.started();
        // (Spans of 1,024 at most here: a group holds two at the default ones.)
        let span = span_within(crate::isa::stream_span(), if wide == 1 { 8 } else { 4 }).min(1024);
        assert_eq!(started[1..], [span; 3], "{label}: each kernel starts one span after the last");
        let want12: Vec<u32> = (0..n as u32).map(|v| v * 2 + 1).collect();
        let want14: Vec<u32> = want12.iter().map(|v| v * 3 + 7).collect();
        assert!(bufs[&12] == want12 && bufs[&14] == want14, "{label}: wrong results");
        assert!(bufs[&11] == vec![5; n] && bufs[&13] == vec![6; wide * n], "{label}: written back");
    }
}

/// A chain's span-local intermediates keep to the L1 budget: the span halves
/// until they fit, never below 64 work-items.
#[test]
fn spans_shrink_to_keep_intermediates_in_l1() {
    assert_eq!(span_within(512, 0), 512, "no intermediate");
    assert_eq!(span_within(512, 4), 512, "one f32 intermediate: 2 KiB");
    assert_eq!(span_within(512, 7 * 4), 512, "seven: 14 KiB");
    assert_eq!(span_within(1024, 7 * 4), 512, "seven in 1,024 would take 28 KiB");
    assert_eq!(span_within(512, 15 * 4), 256, "fifteen: 30 KiB at 512");
    assert_eq!(span_within(256, 15 * 4), 256);
    assert_eq!(span_within(512, 1 << 12), 64, "never below 64");
}

/// Streamed private intermediates live in one span of their region
/// (`FusionPlan::span_local`), except one that a kernel outside the streamed run also
/// reads: that one keeps a whole region per group, or the later kernel would read
/// elements no span left there. Both give the serial results, on an arena that an
/// earlier run filled (so nothing passes by finding zeros).
#[test]
fn a_private_intermediate_read_after_the_stream_keeps_its_whole_region() {
    let n = 10_000; // groups of 4,096, the last group and span partial
    let counters = Arc::new(Counters::default());
    let private = |b: u64| FusionArg::new(b, 0..n * 4, 4).promoted(Promotion::Private);
    // 10 -> 11 (private) -> 12 (private) -> 13, streamed; then a per-item kernel
    // reads 11 again and writes 14.
    let late = Accessor::<u32, Read>::new(0, 9, n);
    let out = Accessor::<u32, crate::access::Write>::new(1, 9, n);
    let reader = kernel("late", 9, 2, move |it| {
        let i = it.global_linear_id();
        out.set(it, i, late.get(it, i) + 1000)
    });
    let kernels = vec![
        FusionKernel {
            kernel: counted_map(0, n, |v| v * 2, &counters),
            geometry: range(n),
            args: smallvec::smallvec![whole(10, n), private(11)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: counted_map(1, n, |v| v + 1, &counters),
            geometry: range(n),
            args: smallvec::smallvec![private(11), private(12)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: counted_map(2, n, |v| v * 3, &counters),
            geometry: range(n),
            args: smallvec::smallvec![private(12), whole(13, n)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: reader,
            geometry: range(n),
            args: smallvec::smallvec![private(11), whole(14, n)],
            deps: Default::default(),
            scalars: Default::default(),
        },
    ];
    let fused = ClosureFusion::new().fusing_unprofitable().fuse(&request(kernels)).unwrap();
    assert_eq!(fused.internal.iter().map(|i| i.buffer).collect::<Vec<_>>(), vec![11, 12]);
    let mut arena = Arena::default();
    for round in 0..2 {
        let mut bufs = HashMap::from([
            (10, (0..n as u32).collect()),
            (11, vec![5; n]),
            (12, vec![6; n]),
            (13, vec![0; n]),
            (14, vec![0; n]),
        ]);
        run_with(&fused, &mut bufs, &mut arena);
        let want13: Vec<u32> = (0..n as u32).map(|v| (v * 2 + 1) * 3).collect();
        let want14: Vec<u32> = (0..n as u32).map(|v| v * 2 + 1000).collect();
        assert_eq!(bufs[&13], want13, "round {round}: the streamed chain");
        assert_eq!(bufs[&14], want14, "round {round}: the kernel after the stream reads every element");
        assert!(bufs[&11] == vec![5; n] && bufs[&12] == vec![6; n], "round {round}: written back");
    }
}

/// A kernel that reads a shifted view of what the kernel before it wrote
/// (`x[i + 100]` after `x[i]`) depends on other work-items of the group: the
/// chain runs kernel after kernel over the group, not span by span, and gives
/// the serial result.
#[test]
fn chains_over_shifted_views_do_not_stream() {
    let (n, shift) = (1024, 100); // one group
    let counters = Arc::new(Counters::default());
    // 10 -> 11 (doubled, n elements), then `m` elements of 11 from `args` -> 12 (+ 1).
    let chain = |n: usize, m: usize, args: Vec<FusionArg>| {
        let kernels = vec![
            FusionKernel {
                kernel: counted_map(0, n, |v| v * 2, &counters),
                geometry: range(n),
                args: smallvec::smallvec![whole(10, n), whole(11, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: counted_map(1, m, |v| v + 1, &counters),
                geometry: range(m),
                args: args.into(),
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        ClosureFusion::new().fuse(&request(kernels)).unwrap()
    };
    // 11[shift..shift + n] -> 12
    let fused = chain(n, n, vec![FusionArg::new(11, shift * 4..(shift + n) * 4, 4), whole(12, n)]);
    let mut bufs = HashMap::from([(10, (0..n as u32).collect()), (11, vec![7; n + shift]), (12, vec![0; n])]);
    run(&fused, &mut bufs);
    assert_eq!(counters.started()[1], n, "kernel 1 starts after kernel 0's whole group");
    let x: Vec<u32> = (0..n as u32).map(|v| v * 2).chain([7; 100]).collect();
    let want: Vec<u32> = (0..n).map(|i| x[i + shift] + 1).collect();
    assert!(bufs[&12] == want, "the serial result");

    // Nor does a kernel over a smaller range than the grid's (remapped: it skips
    // work-items).
    let (n, short) = (8192, 6000);
    let fused = chain(n, short, vec![whole(11, short), whole(12, short)]);
    let mut bufs = HashMap::from([(10, (0..n as u32).collect()), (11, vec![7; n]), (12, vec![0; short])]);
    counters.reset();
    run(&fused, &mut bufs);
    assert_eq!(counters.started()[1], RANGE_CHUNK, "a shorter kernel starts after the whole group");
    assert_eq!(counters.calls()[1], short, "and maps only its range");
    assert!(bufs[&12] == (0..short as u32).map(|v| v * 2 + 1).collect::<Vec<_>>(), "the serial result");
}

/// Local internalization of an ND-range chain: each group's slice lives in local
/// memory of elements / groups.
#[test]
fn local_internalization_uses_group_scratch() {
    let n = 64;
    let (x, tmp) = (Accessor::<u32, Read>::new(0, 1, n), Accessor::<u32, Write>::new(1, 1, n));
    let (tmp_in, out) = (Accessor::<u32, Read>::new(0, 2, n), Accessor::<u32, Write>::new(1, 2, n));
    let k1 = kernel("load", 1, 2, move |it| {
        let i = it.global_linear_id();
        tmp.set(it, i, x.get(it, i) + 100)
    });
    // Reads a neighbour inside the group: needs the barrier and group-shared memory.
    let k2 = kernel("rotate", 2, 2, move |it| {
        let l = it.local_range(0);
        let j = it.group_id(0) * l + (it.local_id(0) + 1) % l;
        out.set(it, it.global_linear_id(), tmp_in.get(it, j))
    });
    let kernels = vec![
        FusionKernel {
            kernel: k1,
            geometry: nd(n, 8),
            args: smallvec::smallvec![whole(1, n), whole(2, n).promoted(Promotion::Local)],
            deps: Default::default(),
            scalars: Default::default(),
        },
        FusionKernel {
            kernel: k2,
            geometry: nd(n, 8),
            args: smallvec::smallvec![whole(2, n).promoted(Promotion::Local), whole(3, n)],
            deps: Default::default(),
            scalars: Default::default(),
        },
    ];
    let fused = ClosureFusion::new().fusing_unprofitable().fuse(&request(kernels)).unwrap();
    assert_eq!(
        (fused.internal[0].kind, fused.internal[0].bytes),
        (Promotion::Local, 32),
        "64 elements / 8 groups"
    );
    let mut bufs = HashMap::from([(1, (0..n as u32).collect()), (2, vec![0; n]), (3, vec![0; n])]);
    run(&fused, &mut bufs);
    let expect: Vec<u32> = (0..n).map(|i| (i / 8 * 8 + (i % 8 + 1) % 8) as u32 + 100).collect();
    assert_eq!(bufs[&3], expect);
    assert_eq!(bufs[&2], vec![0; n], "not written back");
}

/// Mismatched hints fall back to global memory with a warning naming the reason.
#[test]
fn promotion_mismatches_fall_back_with_warnings() {
    let n = 16;
    let noop = || kernel("k", 0, 1, |_| {});
    let case = |a: FusionArg, ga: Geometry, b: FusionArg, gb: Geometry| {
        let kernels = vec![
            FusionKernel {
                kernel: noop(),
                geometry: ga,
                args: smallvec::smallvec![a],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: noop(),
                geometry: gb,
                args: smallvec::smallvec![b],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused = ClosureFusion::new().fuse(&request(kernels)).unwrap();
        assert!(fused.internal.is_empty());
        assert_eq!(fused.args.len(), 1);
        match &fused.warnings[..] {
            [FusionWarning::PromotionDropped { buffer: 5, reason }] => reason.clone(),
            w => panic!("expected one warning, got {w:?}"),
        }
    };
    let (p, l) = (whole(5, n).promoted(Promotion::Private), whole(5, n).promoted(Promotion::Local));
    assert_eq!(case(p.clone(), range(n), whole(5, n), range(n)), PromotionMismatch::NotAllPromoted);
    assert_eq!(case(p.clone(), nd(n, 4), l.clone(), nd(n, 4)), PromotionMismatch::LocalAndPrivate);
    assert!(matches!(
        case(l.clone(), range(n), l.clone(), range(n)),
        PromotionMismatch::NoWorkGroupSize { .. }
    ));
    assert_eq!(case(p.clone(), range(n), p.clone(), range(8)), PromotionMismatch::Sizes);
    let half = FusionArg::new(5, 0..32, 4).promoted(Promotion::Private);
    assert_eq!(case(p, range(n), half, range(n)), PromotionMismatch::DifferentRanges);
    assert_eq!(
        case(
            whole(5, 6).promoted(Promotion::Private),
            range(4),
            whole(5, 6).promoted(Promotion::Private),
            range(4)
        ),
        PromotionMismatch::Sizes
    );
}

/// A pair exchanging data inside a work-group: with the fusion barrier the second
/// kernel sees the first's writes of other work-items; without it, each work-item
/// runs both bodies before the next work-item starts.
#[test]
fn no_barriers_runs_bodies_back_to_back() {
    let n = 16;
    let make = |barriers: bool| {
        let a = Accessor::<u32, Write>::new(0, 1, n);
        let (a_in, b) = (Accessor::<u32, Read>::new(0, 2, n), Accessor::<u32, Write>::new(1, 2, n));
        let k1 = kernel("write", 1, 1, move |it| {
            a.set(it, it.global_linear_id(), 1 + it.global_linear_id() as u32)
        });
        let k2 = kernel("neighbour", 2, 2, move |it| {
            let l = it.local_range(0);
            let j = it.group_id(0) * l + (it.local_id(0) + 1) % l;
            b.set(it, it.global_linear_id(), a_in.get(it, j))
        });
        let kernels = vec![
            FusionKernel {
                kernel: k1,
                geometry: nd(n, 4),
                args: smallvec::smallvec![whole(1, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: k2,
                geometry: nd(n, 4),
                args: smallvec::smallvec![whole(1, n), whole(2, n)],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ];
        let fused =
            ClosureFusion::new().fusing_unprofitable().fuse(&FusionRequest { kernels, barriers }).unwrap();
        let mut bufs = HashMap::from([(1, vec![0; n]), (2, vec![0; n])]);
        run(&fused, &mut bufs);
        bufs.remove(&2).unwrap()
    };
    let with: Vec<u32> = (0..n).map(|i| (i / 4 * 4 + (i % 4 + 1) % 4) as u32 + 1).collect();
    assert_eq!(make(true), with);
    // Without the barrier only the last work-item of each group finds its
    // neighbour (the group's first) already written.
    let without: Vec<u32> = (0..n).map(|i| if i % 4 == 3 { (i - 3) as u32 + 1 } else { 0 }).collect();
    assert_eq!(make(false), without);
}

/// The same chain (same code, ranges and layout; new closures and buffers) is
/// planned once.
#[test]
fn plans_are_cached_by_code_and_layout() {
    let fusion = ClosureFusion::new();
    let chain = |tag: u64, b: u64| {
        let acc = Accessor::<u32, ReadWrite>::new(0, tag, 8);
        let k = kernel("inc", tag, 1, move |it| {
            acc.set(it, it.global_linear_id(), acc.get(it, it.global_linear_id()) + 1)
        });
        request(vec![
            FusionKernel {
                kernel: k.clone(),
                geometry: range(8),
                args: smallvec::smallvec![whole(b, 8)],
                deps: Default::default(),
                scalars: Default::default(),
            },
            FusionKernel {
                kernel: k,
                geometry: range(8),
                args: smallvec::smallvec![whole(b, 8)],
                deps: Default::default(),
                scalars: Default::default(),
            },
        ])
    };
    let first = fusion.fuse(&chain(1, 100)).unwrap();
    let second = fusion.fuse(&chain(2, 200)).unwrap();
    assert!(!first.cached && second.cached);
    assert_eq!(fusion.stats(), CacheStats { hits: 1, misses: 1, evictions: 0, len: 1 });
    let mut bufs = HashMap::from([(200, vec![5; 8])]);
    run(&second, &mut bufs);
    assert_eq!(bufs[&200], vec![7; 8], "the cached plan runs the new closures on the new buffer");
    let other_range = request(vec![FusionKernel {
        kernel: kernel("inc", 3, 1, |_| {}),
        geometry: range(16),
        args: smallvec::smallvec![whole(1, 16)],
        deps: Default::default(),
        scalars: Default::default(),
    }]);
    assert!(!fusion.fuse(&other_range).unwrap().cached);
}

/// `Unfused::rerun` runs the listed kernels one by one: a failed kernel's writes
/// are undone and its dependents (by `deps`, transitively) skipped, independent
/// kernels keep their writes, and an internalized buffer is memory of its own
/// for the rerun. Without a failure it gives the serial result.
#[test]
fn a_rerun_keeps_what_unfused_kernels_would() {
    let n = 8;
    let one = |tag: u64, name: &str, f: fn(u32) -> u32| {
        let acc = Accessor::<u32, ReadWrite>::new(0, tag, n);
        kernel(name, tag, 1, move |it| {
            acc.set(it, it.global_linear_id(), f(acc.get(it, it.global_linear_id())))
        })
    };
    // `dst = f(src)`; with `fail`, panics after the last work-item's write.
    let two = |tag: u64, name: &str, f: fn(u32) -> u32, fail: bool| {
        let src = Accessor::<u32, Read>::new(0, tag, n);
        let dst = Accessor::<u32, Write>::new(1, tag, n);
        kernel(name, tag, 2, move |it| {
            let i = it.global_linear_id();
            dst.set(it, i, f(src.get(it, i)));
            if fail && i == n - 1 {
                panic!("rerun test");
            }
        })
    };
    let private = |b| whole(b, n).promoted(Promotion::Private);
    for fail in [true, false] {
        let k = |kernel, args: &[FusionArg], deps: &[u32]| FusionKernel {
            kernel,
            geometry: range(n),
            args: args.iter().cloned().collect(),
            deps: deps.iter().copied().collect(),
            scalars: Default::default(),
        };
        let fused = ClosureFusion::new()
            .fusing_unprofitable()
            .fuse(&request(vec![
                k(one(1, "inc", |v| v + 1), &[whole(1, n)], &[]),
                k(two(2, "double", |v| v * 2, false), &[whole(1, n), private(2)], &[0]),
                k(two(3, "add", |v| v + 10, fail), &[private(2), whole(3, n)], &[1]),
                k(two(4, "copy", |v| v, false), &[whole(3, n), whole(4, n)], &[2]),
                k(one(5, "side", |v| v + 5), &[whole(5, n)], &[]),
            ]))
            .unwrap();
        assert_eq!(fused.internal.len(), 1);
        let mut bufs: HashMap<u64, Vec<u32>> = (1..=5).map(|b| (b, vec![b as u32; n])).collect();
        let globals: Vec<Binding> = fused
            .args
            .iter()
            .map(|a| Binding::new(bufs.get_mut(&a.buffer).unwrap().as_mut_ptr().cast(), a.end - a.start))
            .collect();
        let launch = |k: &KernelRef, g: &Geometry, b: &[Binding]| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for group in 0..g.group_count() {
                    k.closure().unwrap().run_group(g, group, b, &mut Arena::default());
                }
            }))
            .map_err(|p| ExecError::KernelPanicked { kernel: k.name.clone(), message: panic_message(&*p) })
        };
        let unfused =
            fused.kernel.closure().unwrap().unfused.as_ref().expect("a fused kernel can run unfused");
        assert_eq!(unfused.len(), 5);
        let pool = Arc::new(SnapshotPool::default());
        // SAFETY (both): the vectors outlive the call, and nothing else touches them.
        let short = unsafe { unfused.rerun(&globals[1..], &pool, launch) };
        assert!(short.is_none(), "bindings that are not the fused kernel's run nothing");
        assert!(!unfused.kept(0), "no rerun yet");
        let result = unsafe { unfused.rerun(&globals, &pool, launch) }.unwrap();
        let got: Vec<u32> = (1..=5).map(|b| bufs[&b][0]).collect();
        let kept: Vec<(u64, bool)> =
            fused.args.iter().enumerate().map(|(i, a)| (a.buffer, unfused.kept(i))).collect();
        if fail {
            match result {
                Err(ExecError::KernelPanicked { kernel, .. }) => assert_eq!(&*kernel, "add"),
                r => panic!("{r:?}"),
            }
            assert_eq!(got, vec![2, 2, 3, 4, 10], "add undone, copy skipped, side kept");
            assert_eq!(kept, vec![(1, true), (3, false), (4, false), (5, true)]);
        } else {
            result.unwrap();
            assert_eq!(got, vec![2, 2, 14, 14, 10], "the serial result; the intermediate stays");
        }
    }
}

/// Everything in a plan's key tells plans apart; kernel names are not in it, and
/// a hit names the fused kernel after the request's kernels.
#[test]
fn cache_keys_cover_the_layout_and_names_follow_the_request() {
    let fusion = ClosureFusion::new().fusing_unprofitable();
    let acc = Accessor::<u32, ReadWrite>::new(0, 1, 8);
    let inc =
        move |it: &mut Item<'_>| acc.set(it, it.global_linear_id(), acc.get(it, it.global_linear_id()) + 1);
    let chain = |names: [&str; 2], buffers: [u64; 2], promotion: Promotion, barriers: bool| FusionRequest {
        kernels: names
            .iter()
            .zip(buffers)
            .map(|(name, b)| FusionKernel {
                kernel: kernel(name, 1, 1, inc),
                geometry: range(8),
                args: smallvec::smallvec![whole(b, 8).promoted(promotion)],
                deps: Default::default(),
                scalars: Default::default(),
            })
            .collect(),
        barriers,
    };
    let fuse = |r: &FusionRequest| {
        let f = fusion.fuse(r).unwrap();
        (f.cached, f.kernel.name.to_string())
    };
    let none = Promotion::None;
    assert_eq!(fuse(&chain(["a", "b"], [1, 1], none, true)), (false, "fused(a+b)".into()));
    assert_eq!(fuse(&chain(["a", "b"], [5, 5], none, true)), (true, "fused(a+b)".into()));
    assert_eq!(fuse(&chain(["c", "d"], [5, 5], none, true)), (true, "fused(c+d)".into()));
    assert!(!fuse(&chain(["a", "b"], [1, 2], none, true)).0, "two buffers, not one");
    assert!(!fuse(&chain(["a", "b"], [1, 1], Promotion::Private, true)).0, "promoted");
    assert!(!fuse(&chain(["a", "b"], [1, 1], none, false)).0, "without barriers");
    assert_eq!(fusion.stats(), CacheStats { hits: 2, misses: 4, evictions: 0, len: 4 });
    // Those keys differ only in parts the hash leaves out, so they share a bucket:
    // each hit must still find its own plan.
    let layout = |r: &FusionRequest| {
        let f = fusion.fuse(r).unwrap();
        (f.cached, f.args.len(), f.internal.len())
    };
    assert_eq!(layout(&chain(["a", "b"], [1, 2], none, true)), (true, 2, 0));
    assert_eq!(layout(&chain(["a", "b"], [1, 1], Promotion::Private, true)), (true, 0, 1));
    assert_eq!(layout(&chain(["a", "b"], [3, 3], none, true)), (true, 1, 0));
    assert_eq!(fusion.stats(), CacheStats { hits: 5, misses: 4, evictions: 0, len: 4 });
}

/// A one-kernel request over `n` elements of buffer `b` that adds 1 to each:
/// requests of different `n` have different plans.
fn inc_over(n: usize, b: u64) -> FusionRequest {
    let acc = Accessor::<u32, ReadWrite>::new(0, 1, n);
    let k = kernel("inc", 1, 1, move |it| {
        acc.set(it, it.global_linear_id(), acc.get(it, it.global_linear_id()) + 1)
    });
    request(vec![FusionKernel {
        kernel: k,
        geometry: range(n),
        args: smallvec::smallvec![whole(b, n)],
        deps: Default::default(),
        scalars: Default::default(),
    }])
}

/// More distinct plans than the capacity: the cache keeps at most its capacity,
/// counting each plan it evicts, and the oldest plans are the ones gone.
#[test]
fn the_cache_keeps_at_most_its_capacity() {
    let fusion = ClosureFusion::with_capacity(4);
    assert_eq!(fusion.capacity(), 4);
    for n in 1..=10 {
        assert!(!fusion.fuse(&inc_over(n, 1)).unwrap().cached, "{n}: a new plan");
        let stats = fusion.stats();
        assert_eq!(stats.len, n.min(4), "{n}");
        assert_eq!(stats.evictions, n.saturating_sub(4) as u64, "{n}");
    }
    assert!(fusion.fuse(&inc_over(10, 2)).unwrap().cached, "the newest plan is kept");
    assert!(!fusion.fuse(&inc_over(1, 2)).unwrap().cached, "the oldest plan was evicted");
    let stats = fusion.stats();
    assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len), (1, 11, 7, 4));
    assert_eq!(ClosureFusion::new().capacity(), ClosureFusion::DEFAULT_CAPACITY);
}

/// Eviction takes the least recently used plan, not the oldest inserted: a plan
/// hit since survives while one inserted after it but not used since goes.
#[test]
fn a_recently_hit_plan_survives_eviction() {
    let fusion = ClosureFusion::with_capacity(2);
    let (a, b, c) = (inc_over(8, 1), inc_over(16, 1), inc_over(32, 1));
    assert!(!fusion.fuse(&a).unwrap().cached);
    assert!(!fusion.fuse(&b).unwrap().cached);
    assert!(fusion.fuse(&a).unwrap().cached, "a, hit: b is now the least recently used");
    assert!(!fusion.fuse(&c).unwrap().cached, "c evicts b");
    assert!(fusion.fuse(&a).unwrap().cached, "a survived");
    assert!(fusion.fuse(&c).unwrap().cached, "c was kept");
    assert!(!fusion.fuse(&b).unwrap().cached, "b was evicted");
    let stats = fusion.stats();
    assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len), (3, 4, 2, 2));
}

/// A capacity of 0 caches nothing, and every fusion is still planned and runs
/// correctly.
#[test]
fn capacity_zero_never_caches_but_still_fuses() {
    let fusion = ClosureFusion::with_capacity(0);
    let twice = |b: u64| {
        let mut r = inc_over(8, b);
        let again = r.kernels[0].clone();
        r.kernels.push(again);
        r
    };
    for round in 0..3u32 {
        let fused = fusion.fuse(&twice(7)).unwrap();
        assert!(!fused.cached, "round {round}");
        let mut bufs = HashMap::from([(7, vec![round; 8])]);
        run(&fused, &mut bufs);
        assert_eq!(bufs[&7], vec![round + 2; 8], "round {round}: both kernels ran");
    }
    let stats = fusion.stats();
    assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len), (0, 3, 0, 0));
}

/// A kernel that reads a fused argument another kernel of the chain writes has that
/// slot bound as shared memory (its reads stay relaxed atomics: other groups may be
/// writing it); a chain of streamed elementwise kernels, whose groups each touch
/// only their own elements, has none, and the reading kernel's other slots are not
/// shared either.
#[test]
fn reads_of_what_another_kernel_writes_are_shared() {
    let n = 2048;
    let with_modes = |name: &str, tag: u64, modes: Vec<AccessMode>, f: Phase| {
        let slots = modes.len();
        ClosureKernel {
            tag,
            phases: smallvec::smallvec![f],
            global_slots: slots,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel(name, modes, ItemCost::default())
    };
    let x = Accessor::<u32, ReadWrite>::new(0, 1, n);
    let writer = with_modes(
        "writer",
        1,
        vec![AccessMode::ReadWrite],
        phase(move |it| x.set(it, it.global_linear_id(), 7)),
    );
    let (xr, y) = (Accessor::<u32, Read>::new(0, 2, n), ElemAccessor::<u32, DiscardWrite>::new(1, 2, n));
    let reader = with_modes(
        "reader",
        2,
        vec![AccessMode::Read, AccessMode::DiscardWrite],
        phase(move |it| *y.elem(it) = xr.get(it, (it.global_linear_id() + 1024) % n)),
    );
    let k = |kernel: KernelRef, args: smallvec::SmallVec<[FusionArg; 4]>, deps: &[u32]| FusionKernel {
        kernel,
        geometry: range(n),
        args: args.into_iter().collect(),
        deps: deps.iter().copied().collect(),
        scalars: Default::default(),
    };
    let req = request(vec![
        k(writer, smallvec::smallvec![whole(1, n)], &[]),
        k(reader, smallvec::smallvec![whole(1, n), whole(2, n)], &[0]),
    ]);
    let buffers = gantry_driver::fusion::rules::buffers_in_order(&req.kernels);
    let plan = plan::plan(&req, &buffers).unwrap();
    let shared = body::shared_reads(&req, &plan);
    assert_eq!(shared.iter().map(|s| s.to_vec()).collect::<Vec<_>>(), vec![vec![true], vec![true, false]]);
    // It runs through the shared binding's general path.
    let fused = ClosureFusion::new().fusing_unprofitable().fuse(&req).unwrap();
    let mut data: HashMap<u64, Vec<u32>> = [(1, vec![0; n]), (2, vec![0; n])].into();
    run(&fused, &mut data);
    assert_eq!(data[&1], vec![7; n]);

    // A writer through an element accessor would hold a `&mut` to memory that other
    // work-groups read: it panics instead (the driver then runs the kernels unfused).
    let xe = ElemAccessor::<u32, DiscardWrite>::new(0, 5, n);
    let elem_writer =
        with_modes("elem_writer", 5, vec![AccessMode::DiscardWrite], phase(move |it| *xe.elem(it) = 7));
    let (xr, y) = (Accessor::<u32, Read>::new(0, 6, n), ElemAccessor::<u32, DiscardWrite>::new(1, 6, n));
    let reader = with_modes(
        "reader",
        6,
        vec![AccessMode::Read, AccessMode::DiscardWrite],
        phase(move |it| *y.elem(it) = xr.get(it, (it.global_linear_id() + 1024) % n)),
    );
    let req = request(vec![
        k(elem_writer, smallvec::smallvec![whole(1, n)], &[]),
        k(reader, smallvec::smallvec![whole(1, n), whole(2, n)], &[0]),
    ]);
    let fused = ClosureFusion::new().fusing_unprofitable().fuse(&req).unwrap();
    let mut data: HashMap<u64, Vec<u32>> = [(1, vec![0; n]), (2, vec![0; n])].into();
    let message = panic_message(
        &*std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&fused, &mut data))).unwrap_err(),
    );
    assert!(message.contains("element accessor slot 0 is memory other work-groups"), "{message}");

    // A streamed chain of maps through a global intermediate shares nothing.
    let map = |name: &str, tag: u64| {
        let (a, o) =
            (Accessor::<u32, Read>::new(0, tag, n), ElemAccessor::<u32, DiscardWrite>::new(1, tag, n));
        with_modes(
            name,
            tag,
            vec![AccessMode::Read, AccessMode::DiscardWrite],
            map_phase(a, o, |v: u32| v + 1),
        )
    };
    let req = request(vec![
        k(map("a", 3), smallvec::smallvec![whole(1, n), whole(2, n)], &[]),
        k(map("b", 4), smallvec::smallvec![whole(2, n), whole(3, n)], &[0]),
    ]);
    let buffers = gantry_driver::fusion::rules::buffers_in_order(&req.kernels);
    let plan = plan::plan(&req, &buffers).unwrap();
    assert_eq!(plan.streams, vec![true, true]);
    assert!(body::shared_reads(&req, &plan).iter().flatten().all(|&s| !s));
}

/// By default the compiler refuses the per-work-item forms measured slower fused
/// than unfused, naming the kernel and the reason, and fuses what pays: closures
/// that share only what they read, and elementwise chains through private memory.
#[test]
fn forms_slower_fused_are_refused_with_their_reason() {
    let n = 64;
    let fk = |kernel: KernelRef, args: smallvec::SmallVec<[FusionArg; 4]>| FusionKernel {
        kernel,
        geometry: nd(n, 16),
        args,
        deps: Default::default(),
        scalars: Default::default(),
    };
    let step = |name: &str, tag: u64| {
        let (a, b) = (Accessor::<u32, ReadWrite>::new(0, tag, n), Accessor::<u32, ReadWrite>::new(1, tag, n));
        kernel(name, tag, 2, move |it| {
            let i = it.global_linear_id();
            b.set(it, i, a.get(it, i) + 1)
        })
    };
    let refused = |kernels: Vec<FusionKernel>, barriers: bool| match ClosureFusion::new()
        .fuse(&FusionRequest { kernels, barriers })
    {
        Err(FusionError::Unprofitable { kernel, reason }) => (kernel, reason),
        other => panic!("expected a refusal, got {other:?}"),
    };
    // A closure intermediate promoted to private memory.
    let private = || {
        vec![
            fk(step("first", 1), smallvec::smallvec![whole(1, n), whole(2, n).promoted(Promotion::Private)]),
            fk(step("second", 2), smallvec::smallvec![whole(2, n).promoted(Promotion::Private), whole(3, n)]),
        ]
    };
    assert_eq!(refused(private(), true), ("first".into(), Unprofitable::MappedAccess));
    assert!(ClosureFusion::new().fusing_unprofitable().fuse(&request(private())).is_ok());
    // Closures without barriers would interleave item by item.
    let apart = || {
        vec![
            fk(step("left", 1), smallvec::smallvec![whole(1, n), whole(2, n)]),
            fk(step("right", 2), smallvec::smallvec![whole(3, n), whole(4, n)]),
        ]
    };
    assert_eq!(refused(apart(), false), ("left".into(), Unprofitable::ItemByItem));
    // With barriers, closures over separate buffers fuse.
    assert!(ClosureFusion::new().fuse(&request(apart())).is_ok());
    // A closure reading what another writes binds it as shared memory.
    let (x, y) = (Accessor::<u32, Read>::new(0, 2, n), Accessor::<u32, Write>::new(1, 2, n));
    let reader = ClosureKernel {
        tag: 2,
        phases: smallvec::smallvec![phase(move |it| y.set(it, it.global_linear_id(), x.get(it, 0)))],
        global_slots: 2,
        scratch: vec![],
        unfused: None,
    }
    .into_kernel("reader", [AccessMode::Read, AccessMode::Write], ItemCost::default());
    let shared = vec![
        fk(step("writer", 1), smallvec::smallvec![whole(5, n), whole(1, n)]),
        fk(reader, smallvec::smallvec![whole(1, n), whole(6, n)]),
    ];
    assert_eq!(refused(shared, true), ("writer".into(), Unprofitable::MappedAccess));
    // Elementwise kernels through private memory stream in runs and fuse.
    let map = |tag: u64| {
        let (a, o) =
            (Accessor::<u32, Read>::new(0, tag, n), ElemAccessor::<u32, DiscardWrite>::new(1, tag, n));
        ClosureKernel {
            tag,
            phases: smallvec::smallvec![map_phase(a, o, |v: u32| v * 3)],
            global_slots: 2,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel("map", [AccessMode::Read, AccessMode::DiscardWrite], ItemCost::default())
    };
    let maps = vec![
        fk(map(1), smallvec::smallvec![whole(1, n), whole(2, n).promoted(Promotion::Private)]),
        fk(map(2), smallvec::smallvec![whole(2, n).promoted(Promotion::Private), whole(3, n)]),
    ];
    for barriers in [true, false] {
        let fused = ClosureFusion::new().fuse(&FusionRequest { kernels: maps.clone(), barriers }).unwrap();
        let mut bufs = HashMap::from([(1, (0..n as u32).collect()), (3, vec![0; n])]);
        run(&fused, &mut bufs);
        assert_eq!(bufs[&3], (0..n as u32).map(|v| v * 9).collect::<Vec<_>>());
    }
}

/// A failed fused kernel restores only the slots its kernels write, never its
/// arguments whole: an argument is the hull of its slots, and other commands may
/// write the gaps meanwhile (the scheduler orders them by the kernels' own ranges).
/// Here the kernel reads `b[0..4]` and writes `b[12..16]` of one buffer (one
/// argument over `b[0..16]`), and a write to `b[8]` while it runs stands for an
/// independent command's: it survives the fused kernel's failure and rerun.
#[test]
fn a_failed_fused_kernel_restores_only_the_slots_it_writes() {
    let mut data: Vec<u32> = (0..16).collect();
    let base = data.as_mut_ptr();
    let gap = base.wrapping_add(8) as usize;
    let meanwhile = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (src, dst) = (Accessor::<u32, Read>::new(0, 1, 4), Accessor::<u32, Write>::new(1, 1, 4));
    let once = meanwhile.clone();
    let body = move |it: &mut Item<'_>| {
        let i = it.global_linear_id();
        dst.set(it, i, src.get(it, i) + 100);
        if i == 3 {
            if !once.swap(true, std::sync::atomic::Ordering::Relaxed) {
                // SAFETY: `data` outlives the kernel, and nothing else touches `b[8]`.
                unsafe { (gap as *mut u32).write(77) };
            }
            panic!("after the other command's write");
        }
    };
    let modes = [AccessMode::Read, AccessMode::Write];
    let closure = ClosureKernel {
        tag: 1,
        phases: smallvec::smallvec![phase(body)],
        global_slots: 2,
        scratch: vec![],
        unfused: None,
    };
    let args = [FusionArg::new(0, 0..16, 4), FusionArg::new(0, 48..64, 4)];
    let fused = ClosureFusion::new()
        .fusing_unprofitable()
        .fuse(&request(vec![FusionKernel {
            kernel: closure.into_kernel("gap", modes, ItemCost::default()),
            geometry: range(4),
            args: args.into_iter().collect(),
            deps: Default::default(),
            scalars: Default::default(),
        }]))
        .unwrap();
    assert_eq!((fused.args.len(), fused.args[0].start, fused.args[0].end), (1, 0, 64), "one hull");
    let globals = [Binding::new(base.cast(), 64)];
    let unfused = fused.kernel.closure().unwrap().unfused.as_ref().unwrap();
    let written = unfused.written(&globals).unwrap();
    assert_eq!(written.len(), 1);
    assert_eq!((written[0].ptr as usize - base as usize, written[0].len), (48, 16), "only b[12..16]");
    assert!(unfused.written(&[]).is_none(), "bindings that are not the fused kernel's");

    let runner = crate::Runner::new("test".into());
    let call = crate::KernelCall { kernel: &fused.kernel, geometry: &fused.geometry, scalars: &[] };
    let modes = [AccessMode::ReadWrite].into_iter();
    // SAFETY: `data` is live; what the kernel writes, nothing else touches.
    let result = unsafe { runner.run_kernel(call, modes, &globals, true, &mut Arena::default()) };
    assert!(matches!(result, Err(ExecError::KernelPanicked { .. })), "{result:?}");
    assert!(meanwhile.load(std::sync::atomic::Ordering::Relaxed));
    let mut want: Vec<u32> = (0..16).collect();
    want[8] = 77;
    assert_eq!(data, want, "the written slot restored, the other command's write kept");
}

/// `Unfused::written` gives each written slot once, overlapping and adjacent slots
/// merged, over every argument, and leaves out read-only slots: kernel 0 writes
/// `a[0..8]` and reads `a[20..24]`, kernel 1 writes `a[4..12]` and `a[12..14]` (which
/// touch the first run) and `b[2..4]`.
#[test]
fn written_slots_are_merged_and_read_only_slots_left_out() {
    let body = |slots: usize, modes: Vec<AccessMode>| {
        ClosureKernel {
            tag: 1,
            phases: smallvec::smallvec![phase(|_| {})],
            global_slots: slots,
            scratch: vec![],
            unfused: None,
        }
        .into_kernel("k", modes, ItemCost::default())
    };
    let words = |buffer: u64, r: std::ops::Range<usize>| FusionArg::new(buffer, r.start * 4..r.end * 4, 4);
    let k = |kernel, args: Vec<FusionArg>| FusionKernel {
        kernel,
        geometry: range(2),
        args: args.into_iter().collect(),
        deps: Default::default(),
        scalars: Default::default(),
    };
    use AccessMode::{Read as R, ReadWrite as RW, Write as W};
    let fused = ClosureFusion::new()
        .fusing_unprofitable()
        .fuse(&request(vec![
            k(body(2, vec![W, R]), vec![words(1, 0..8), words(1, 20..24)]),
            k(body(3, vec![RW, W, W]), vec![words(1, 4..12), words(1, 12..14), words(2, 2..4)]),
        ]))
        .unwrap();
    let (mut a, mut b) = (vec![0u32; 24], vec![0u32; 4]);
    let globals: Vec<Binding> = fused
        .args
        .iter()
        .map(|arg| {
            let v = if arg.buffer == 1 { &mut a } else { &mut b };
            Binding::new(v.as_mut_ptr().cast::<u8>().wrapping_add(arg.start), arg.end - arg.start)
        })
        .collect();
    let unfused = fused.kernel.closure().unwrap().unfused.as_ref().unwrap();
    // Each written range as (buffer, words of the buffer), found through the argument
    // whose binding holds it.
    let locate = |w: &Binding| {
        let holds = |g: &&Binding| (g.ptr as usize..g.ptr as usize + g.len).contains(&(w.ptr as usize));
        let (arg, g) = fused.args.iter().zip(&globals).find(|(_, g)| holds(g)).unwrap();
        let start = (arg.start + (w.ptr as usize - g.ptr as usize)) / 4;
        (arg.buffer, start..start + w.len / 4)
    };
    let mut got: Vec<(u64, std::ops::Range<usize>)> =
        unfused.written(&globals).unwrap().iter().map(locate).collect();
    got.sort_by_key(|(buffer, r)| (*buffer, r.start));
    assert_eq!(got, vec![(1, 0..14), (2, 2..4)]);
}
