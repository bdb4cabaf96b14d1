//! Kernel shapes: 1–3-D ranges and ND-ranges, work-item ids, phases, local and
//! private memory, single tasks, copies, fills and readbacks.

use gantry::{NdRange, Range, Readback, Runtime};

/// Every work-item of a 3-D ND-range sees consistent global, local and group ids.
#[test]
fn nd_range_ids_are_consistent() {
    let rt = Runtime::builder().worker_threads(3).build();
    let (g, l) = ([4usize, 6, 8], [2usize, 3, 4]);
    let n = g[0] * g[1] * g[2];
    let out = rt.buffer_zeroed::<[u32; 4]>(n);
    rt.queue()
        .submit(|cg| {
            let o = cg.elements_out(&out);
            cg.parallel_for_nd(NdRange::new(g, l), move |it| {
                let mut ok = 1u32;
                for d in 0..3 {
                    ok &= (it.global_id(d) == it.group_id(d) * it.local_range(d) + it.local_id(d)) as u32;
                    ok &= (it.group_range(d) * it.local_range(d) == it.global_range(d)) as u32;
                }
                let lin = (it.global_id(0) * g[1] + it.global_id(1)) * g[2] + it.global_id(2);
                *o.elem(it) = [lin as u32, it.group_linear_id() as u32, it.local_linear_id() as u32, ok];
            });
        })
        .unwrap();
    let v = out.to_vec().unwrap();
    for (i, [lin, _group, local, ok]) in v.iter().enumerate() {
        assert_eq!(*lin as usize, i);
        assert_eq!(*ok, 1);
        assert!((*local as usize) < l.iter().product::<usize>());
    }
    assert_eq!(v.iter().map(|x| x[1]).max(), Some(2 * 2 * 2 - 1));
}

/// A 2-D plain range covers every element once, last dimension fastest.
#[test]
fn two_dimensional_range_covers_each_element_once() {
    let rt = Runtime::new();
    let (h, w) = (37, 3001); // not multiples of the driver's chunk
    let out = rt.buffer_zeroed::<u32>(h * w);
    rt.queue()
        .submit(|cg| {
            let o = cg.read_write(&out);
            cg.parallel_for(Range::d2(h, w), move |it| {
                let i = it.global_id(0) * w + it.global_id(1);
                assert_eq!(i, it.global_linear_id());
                o.set(it, i, o.get(it, i) + 1);
            });
        })
        .unwrap();
    assert!(out.to_vec().unwrap().iter().all(|&x| x == 1));
}

/// Global offsets shift ids but not linear ids.
#[test]
fn global_offset_shifts_ids() {
    let rt = Runtime::new();
    let out = rt.buffer_zeroed::<u32>(8);
    rt.queue()
        .submit(|cg| {
            let o = cg.elements_out(&out);
            cg.parallel_for_nd(NdRange::new(8, 4).with_offset([100, 0, 0]), move |it| {
                *o.elem(it) = it.global_id(0) as u32
            });
        })
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), (100..108).collect::<Vec<u32>>());
}

/// Private memory keeps per-work-item values across phases; local memory is shared
/// within a group and separate between groups.
#[test]
fn private_and_local_memory_across_phases() {
    let rt = Runtime::builder().worker_threads(2).build();
    let n = 256;
    let input = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
    let out = rt.buffer_zeroed::<u32>(n);
    rt.queue()
        .submit(|cg| {
            let x = cg.read(&input);
            let o = cg.write(&out);
            let mine = cg.private::<u32>(2);
            let shared = cg.local::<u32>(1);
            cg.parallel_for_work_group(NdRange::new(n, 16))
                .phase(move |it| {
                    let v = x.get(it, it.global_linear_id());
                    mine.set(it, 0, v);
                    mine.set(it, 1, v * 2);
                    // Sum of the group's inputs, accumulated in local memory.
                    shared.set(it, 0, shared.get(it, 0) + v);
                })
                .phase(move |it| {
                    let group_sum = shared.get(it, 0);
                    o.set(it, it.global_linear_id(), mine.get(it, 0) + mine.get(it, 1) + group_sum);
                });
        })
        .unwrap();
    let got = out.to_vec().unwrap();
    for (i, &g) in got.iter().enumerate() {
        let base = (i / 16) * 16;
        let group_sum: u32 = (base..base + 16).map(|v| v as u32).sum();
        assert_eq!(g, 3 * i as u32 + group_sum, "item {i}");
    }
}

#[test]
fn single_task_fill_copy_and_readback() {
    let rt = Runtime::new();
    let q = rt.in_order_queue();
    let a = rt.buffer_zeroed::<i32>(10);
    let b = rt.buffer_zeroed::<i32>(10);
    q.submit(|cg| cg.fill(&a, -1)).unwrap();
    q.submit(|cg| cg.fill_range(&a, 2..5, 7)).unwrap();
    q.submit(|cg| {
        let a = cg.read_write(&a);
        cg.single_task(move |it| a.set(it, 9, 42));
    })
    .unwrap();
    q.submit(|cg| cg.copy(&a, &b)).unwrap();
    q.submit(|cg| cg.copy_from_host(&[100, 101], &b, 0)).unwrap();
    q.submit(|cg| cg.copy_range(&b, 8, &b, 5, 2)).unwrap();
    let out = Readback::new();
    let ev = q.submit(|cg| cg.copy_to_host(&b, 4.., &out)).unwrap();
    ev.wait().unwrap();
    assert_eq!(b.to_vec().unwrap(), vec![100, 101, 7, 7, 7, -1, 42, -1, -1, 42]);
    assert_eq!(out.take(), Some(vec![7, -1, 42, -1, -1, 42]));
    assert_eq!(out.take(), None);
}

/// Multi-element plain-data types go through accessors and element views intact.
#[test]
fn struct_elements() {
    #[derive(Clone, Copy, Debug, PartialEq, gantry::Zeroable, gantry::Pod)]
    #[repr(C)]
    struct Particle {
        pos: [f32; 3],
        vel: [f32; 3],
    }
    let rt = Runtime::new();
    let n = 5000;
    let init: Vec<Particle> =
        (0..n).map(|i| Particle { pos: [i as f32, 0.0, 0.0], vel: [1.0, 2.0, 3.0] }).collect();
    let ps = rt.buffer(&init);
    for _ in 0..3 {
        rt.queue()
            .submit(|cg| {
                let p = cg.elements_mut(&ps);
                cg.parallel_for(n, move |it| {
                    let p = p.elem(it);
                    for d in 0..3 {
                        p.pos[d] += p.vel[d];
                    }
                });
            })
            .unwrap();
    }
    let got = ps.to_vec().unwrap();
    assert_eq!(got[10].pos, [13.0, 6.0, 9.0]);
    assert_eq!(got[n - 1].vel, [1.0, 2.0, 3.0]);
}

/// The `unsafe` slice path: each work-item writes only its own element through a raw
/// slice (the SYCL contract), reading another buffer as a slice.
#[test]
fn unsafe_slices_under_the_sycl_contract() {
    let rt = Runtime::builder().worker_threads(2).build();
    let n = 10_000;
    let input = rt.buffer(&(0..n as u32).collect::<Vec<_>>());
    let out = rt.buffer_zeroed::<u32>(n);
    rt.queue()
        .submit(|cg| {
            let x = cg.read(&input);
            let y = cg.write(&out);
            cg.parallel_for(n, move |it| {
                let i = it.global_linear_id();
                // SAFETY: nobody writes `input`; work-item `i` alone writes `out[i]`.
                let (x, y) = unsafe { (x.as_slice(it), y.as_slice_mut(it)) };
                y[i] = x[n - 1 - i] * 2;
            });
        })
        .unwrap();
    let expect: Vec<u32> = (0..n as u32).rev().map(|v| v * 2).collect();
    assert_eq!(out.to_vec().unwrap(), expect);
}

/// A host task's discard-write accessor overwrites the range; the runtime does not
/// need its previous contents on the host.
#[test]
fn host_discard_write() {
    let rt = Runtime::builder().sim(gantry::SimConfig::default()).build();
    let sim = rt.queue_with(gantry::QueueOptions { device: 1, in_order: true }).unwrap();
    let buf = rt.buffer(&[1u32; 8]);
    sim.submit(|cg| cg.fill(&buf, 5)).unwrap();
    let q = rt.queue();
    q.submit(|cg| {
        let mut o = cg.host_discard_write(&buf);
        cg.host_task(move |ctx| o.as_mut_slice(ctx).copy_from_slice(&[9; 8]));
    })
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(buf.to_vec().unwrap(), vec![9; 8]);
    assert_eq!(rt.stats().moves, 0, "nothing moved back for a discard-write");
}

/// A long plain range runs in larger groups (8,192 items here, the last one partial)
/// on several workers: every element is written once, ids agree with the group
/// layout, and a fused chain with its intermediate promoted to private memory gives
/// the serial result.
#[test]
fn long_ranges_run_in_larger_groups() {
    use gantry::{FusionProps, Promotion};
    let rt = Runtime::builder().worker_threads(3).build();
    let q = rt.queue();
    let n = 64 * 8192 + 123;
    let out = rt.buffer_zeroed::<[u32; 2]>(n);
    q.submit(|cg| {
        let o = cg.elements_out(&out);
        cg.parallel_for(n, move |it| {
            let consistent = it.global_id(0) == it.group_id(0) * it.local_range(0) + it.local_id(0);
            *o.elem(it) =
                [it.global_id(0) as u32 * 3 + 1, (it.local_range(0) as u32) << 1 | consistent as u32];
        });
    })
    .unwrap();
    let v = out.to_vec().unwrap();
    assert!(v.iter().enumerate().all(|(i, &[x, _])| x == i as u32 * 3 + 1));
    assert!(v.iter().all(|&[_, g]| g == 8192 << 1 | 1), "groups of 8,192 with consistent ids");

    let input: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
    let (x, tmp, y) = (rt.buffer(&input), rt.buffer_zeroed::<f32>(n), rt.buffer_zeroed::<f32>(n));
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let (a, t) = (cg.read(&x), cg.elements_out(&tmp));
        cg.promote(&t, Promotion::Private);
        cg.map(&a, &t, |v| v * 2.0 + 1.0);
    })
    .unwrap();
    q.submit(|cg| {
        let (t, b) = (cg.read(&tmp), cg.elements_out(&y));
        cg.promote(&t, Promotion::Private);
        cg.map(&t, &b, |v| v - 3.0);
    })
    .unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    assert!(matches!(q.fusion_outcome(), Some(gantry::FusionOutcome::Fused { kernels: 2, .. })));
    let want: Vec<f32> = input.iter().map(|v| v * 2.0 + 1.0 - 3.0).collect();
    assert_eq!(y.to_vec().unwrap(), want);
    assert!(tmp.to_vec().unwrap().iter().all(|&v| v == 0.0), "the promoted buffer is not written back");
}
