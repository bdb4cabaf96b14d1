//! The kernel forms against serial references: multi-input maps (`map2`..`map4`, over
//! scalars and structs) bit for bit, reductions (`reduce`, `map_reduce`) against the
//! same fixed-order fold computed serially and against a serial left fold within
//! rounding, per-work-item stencils through direct accessor access bit for bit, on
//! inline and threaded runtimes (the result must not depend on the thread count).

use gantry::host::reduce::{reduce_slice, Custom};
use gantry::host::{Max, Min, Sum};
use gantry::{Mode, Runtime, Write};
use proptest::prelude::*;

fn runtimes() -> [Runtime; 2] {
    [
        Runtime::builder().mode(Mode::Manual).worker_threads(0).build(),
        Runtime::builder().mode(Mode::Threaded).worker_threads(3).build(),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct P {
    pos: [f32; 2],
    vel: [f32; 2],
}

fn step(p: P, f: [f32; 2], m: f32) -> P {
    let vel = [p.vel[0] + f[0] / m, p.vel[1] + f[1] / m];
    P { pos: [p.pos[0] + vel[0], p.pos[1] + vel[1]], vel }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// `map2`, `map3` and `map4` give the serial results bit for bit, over lengths
    /// with partial groups, inputs longer than the output, and struct elements.
    #[test]
    fn multi_input_maps_equal_serial_loops(
        n in 1usize..5000,
        extra in 0usize..40,
        seed in any::<u32>(),
    ) {
        let x: Vec<f32> = (0..n + extra).map(|i| ((i as u32).wrapping_mul(seed | 1) % 1000) as f32 * 0.37).collect();
        let ps: Vec<P> = x.iter().map(|&v| P { pos: [v, -v], vel: [v * 0.5, 1.0] }).collect();
        let fs: Vec<[f32; 2]> = x.iter().map(|&v| [v.sin(), v.cos()]).collect();
        let ms: Vec<f32> = x.iter().map(|&v| 1.0 + v).collect();
        let want2: Vec<P> = (0..n).map(|i| step(ps[i], fs[i], 1.0)).collect();
        let want3: Vec<P> = (0..n).map(|i| step(ps[i], fs[i], ms[i])).collect();
        let want4: Vec<f32> = (0..n).map(|i| x[i] * ms[i] + fs[i][0] - ps[i].vel[0]).collect();
        for rt in runtimes() {
            let q = rt.queue();
            let (pb, fb, mb, xb) = (rt.buffer(&ps), rt.buffer(&fs), rt.buffer(&ms), rt.buffer(&x));
            let (o2, o3, o4) = (rt.buffer_zeroed::<P>(n), rt.buffer_zeroed::<P>(n), rt.buffer_zeroed::<f32>(n));
            q.submit(|cg| {
                let (p, f, o) = (cg.read(&pb), cg.read(&fb), cg.elements_out(&o2));
                cg.map2(&p, &f, &o, |p, f| step(p, f, 1.0));
            }).unwrap();
            q.submit(|cg| {
                let (p, f, m, o) = (cg.read(&pb), cg.read(&fb), cg.read(&mb), cg.elements_out(&o3));
                cg.map3(&p, &f, &m, &o, step);
            }).unwrap();
            q.submit(|cg| {
                let (a, m, f, p) = (cg.read(&xb), cg.read(&mb), cg.read(&fb), cg.read(&pb));
                let o = cg.elements_out(&o4);
                cg.map4(&a, &m, &f, &p, &o, |a, m, f: [f32; 2], p: P| a * m + f[0] - p.vel[0]);
            }).unwrap();
            q.wait().unwrap();
            let bits = |v: &[P]| v.iter().flat_map(|p| [p.pos, p.vel].concat()).map(f32::to_bits).collect::<Vec<_>>();
            prop_assert_eq!(bits(&o2.to_vec().unwrap()), bits(&want2));
            prop_assert_eq!(bits(&o3.to_vec().unwrap()), bits(&want3));
            let got4: Vec<u32> = o4.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(got4, want4.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    /// Reductions: integer sums, minima, maxima and a custom operator equal the serial
    /// fold exactly; a float sum equals the fixed-order fold bit for bit on every
    /// runtime (whatever its threads) and a serial left fold within rounding.
    #[test]
    fn reductions_equal_serial_folds(n in 1usize..200_000, seed in any::<u64>()) {
        let ints: Vec<u64> = (0..n as u64).map(|i| (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20).collect();
        let floats: Vec<f32> = ints.iter().map(|&v| (v % 10_000) as f32 * 0.001 - 3.0).collect();
        let want_sum = ints.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        let want_min = *ints.iter().min().unwrap();
        let want_max = floats.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let want_xor = ints.iter().fold(0u64, |a, &b| a ^ (b >> 3));
        let fixed_order = reduce_slice(&floats, &|v: f32| v * 2.0, &Sum);
        let serial: f64 = floats.iter().map(|&v| f64::from(v * 2.0)).sum();
        for rt in runtimes() {
            let q = rt.queue();
            let (ib, fb) = (rt.buffer(&ints), rt.buffer(&floats));
            let (iout, fout) = (rt.buffer_zeroed::<u64>(3), rt.buffer_zeroed::<f32>(2));
            q.submit(|cg| {
                let (x, o) = (cg.read(&ib), cg.access::<u64, Write>(&iout, 0..1));
                cg.reduce(&x, &o, Sum);
            }).unwrap();
            q.submit(|cg| {
                let (x, o) = (cg.read(&ib), cg.access::<u64, Write>(&iout, 1..2));
                cg.reduce(&x, &o, Min);
            }).unwrap();
            q.submit(|cg| {
                let (x, o) = (cg.read(&ib), cg.access::<u64, Write>(&iout, 2..3));
                cg.map_reduce(&x, &o, |v| v >> 3, Custom::new(0u64, |a: u64, b: u64| a ^ b));
            }).unwrap();
            q.submit(|cg| {
                let (x, o) = (cg.read(&fb), cg.access::<f32, Write>(&fout, 0..1));
                cg.map_reduce(&x, &o, |v| v * 2.0, Sum);
            }).unwrap();
            q.submit(|cg| {
                let (x, o) = (cg.read(&fb), cg.access::<f32, Write>(&fout, 1..2));
                cg.reduce(&x, &o, Max);
            }).unwrap();
            q.wait().unwrap();
            prop_assert_eq!(iout.to_vec().unwrap(), vec![want_sum, want_min, want_xor]);
            let f = fout.to_vec().unwrap();
            prop_assert_eq!(f[0].to_bits(), fixed_order.to_bits());
            prop_assert!((f64::from(f[0]) - serial).abs() <= 1e-4 * serial.abs().max(1.0) + 1e-2,
                "sum {} against {}", f[0], serial);
            prop_assert_eq!(f[1].to_bits(), want_max.to_bits());
        }
    }

    /// A 2-D stencil through `get` and an element accessor (the direct access path)
    /// equals the serial stencil bit for bit, on any grid shape.
    #[test]
    fn stencil_through_accessors_equals_serial(h in 3usize..90, w in 3usize..90, seed in any::<u32>()) {
        let cur: Vec<f32> = (0..h * w).map(|i| ((i as u32 ^ seed) % 997) as f32 * 0.01).collect();
        let mut want = cur.clone();
        for y in 1..h - 1 {
            for x in 1..w - 1 {
                let i = y * w + x;
                want[i] = cur[i] + 0.1 * (cur[i - w] + cur[i + w] + cur[i - 1] + cur[i + 1] - 4.0 * cur[i]);
            }
        }
        for rt in runtimes() {
            let (a, o) = (rt.buffer(&cur), rt.buffer_zeroed::<f32>(h * w));
            rt.queue().submit(|cg| {
                let (src, dst) = (cg.read(&a), cg.elements_out(&o));
                cg.parallel_for([h, w], move |it| {
                    let (y, x) = (it.global_id(0), it.global_id(1));
                    let i = y * w + x;
                    let c = src.get(it, i);
                    *dst.elem(it) = if y == 0 || x == 0 || y == h - 1 || x == w - 1 {
                        c
                    } else {
                        c + 0.1 * (src.get(it, i - w) + src.get(it, i + w) + src.get(it, i - 1) + src.get(it, i + 1) - 4.0 * c)
                    };
                });
            }).unwrap().wait().unwrap();
            let got: Vec<u32> = o.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(got, want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }
}

/// A reduction is not fused: the fusion outcome names the reason, and the kernels
/// run unfused with the right result.
#[test]
fn a_reduction_refuses_fusion_with_a_reason() {
    use gantry::{CancelReason, FusionError, FusionOutcome, FusionProps, Unprofitable, WindowThresholds};
    // Four elements: the window must fuse whatever its size to reach the compiler.
    let rt = Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .fusion_window(WindowThresholds::ALWAYS)
        .build();
    let q = rt.in_order_queue();
    let x = rt.buffer(&[1.0f32, 2.0, 3.0, 4.0]);
    let (y, out) = (rt.buffer_zeroed::<f32>(4), rt.buffer_zeroed::<f32>(1));
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let (x, y) = (cg.read(&x), cg.elements_out(&y));
        cg.map(&x, &y, |v| v * 10.0);
    })
    .unwrap();
    q.submit(|cg| {
        let (y, o) = (cg.read(&y), cg.write(&out));
        cg.reduce(&y, &o, Sum);
    })
    .unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    match q.fusion_outcome() {
        Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
            reason, ..
        }))) => {
            assert_eq!(reason, Unprofitable::Reduction)
        }
        other => panic!("expected an unprofitable refusal, got {other:?}"),
    }
    assert_eq!(out.to_vec().unwrap(), vec![100.0]);
}

/// A kernel with more accessors than the group loop keeps in its own table (16)
/// reaches the others through the general path: every slot reads its own buffer.
#[test]
fn kernels_with_many_accessors_reach_every_slot() {
    for rt in runtimes() {
        let n = 3000;
        let inputs: Vec<_> = (0..20u32).map(|k| rt.buffer(&vec![k + 1; n])).collect();
        let out = rt.buffer_zeroed::<u32>(n);
        rt.queue()
            .submit(|cg| {
                let xs: Vec<_> = inputs.iter().map(|b| cg.read(b)).collect();
                let o = cg.elements_out(&out);
                cg.parallel_for(n, move |it| {
                    let i = it.global_linear_id();
                    // Weighted, so that a slot read through another's binding shows.
                    *o.elem(it) = xs.iter().enumerate().map(|(k, x)| x.get(it, i) * (k as u32 + 1)).sum();
                });
            })
            .unwrap()
            .wait()
            .unwrap();
        let want: u32 = (0..20u32).map(|k| (k + 1) * (k + 1)).sum();
        assert_eq!(out.to_vec().unwrap(), vec![want; n]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// `parallel_for!` (the body compiled twice) gives what the plain closure gives,
    /// bit for bit: own elements through `at` and `elem`, a neighbour through `get`,
    /// over 1-D and 2-D ranges with partial groups; fused with a private intermediate
    /// (the general copy of the body, `fuse_unprofitable`) too.
    #[test]
    fn twice_compiled_bodies_equal_plain_closures(n in 1usize..6000, w in 1usize..70, seed in any::<u32>()) {
        let x: Vec<f32> = (0..n).map(|i| ((i as u32).wrapping_mul(seed | 1) % 997) as f32 * 0.25).collect();
        let want: Vec<f32> = (0..n).map(|i| x[i] * 1.5 + x[(i + 1) % n]).collect();
        let h = n.div_ceil(w);
        let want2: Vec<f32> = (0..h * w).map(|i| x[i % n] - (i / w) as f32 + (i % w) as f32).collect();
        for rt in runtimes() {
            let q = rt.queue();
            let (xb, yb, y2) = (rt.buffer(&x), rt.buffer_zeroed::<f32>(n), rt.buffer_zeroed::<f32>(h * w));
            q.submit(|cg| {
                let (a, y) = (cg.read(&xb), cg.elements_out(&yb));
                gantry::parallel_for!(cg, n, move |it| {
                    *y.elem(it) = a.at(it) * 1.5 + a.get(it, (it.global_linear_id() + 1) % n)
                });
            }).unwrap();
            q.submit(|cg| {
                let (a, y) = (cg.read(&xb), cg.elements_out(&y2));
                gantry::parallel_for!(cg, [h, w], move |it| {
                    let (r, c) = (it.global_id(0), it.global_id(1));
                    *y.elem(it) = a.get(it, (r * w + c) % n) - r as f32 + c as f32
                });
            }).unwrap();
            q.wait().unwrap();
            prop_assert_eq!(yb.to_vec().unwrap(), want.clone());
            prop_assert_eq!(y2.to_vec().unwrap(), want2.clone());
        }
        // Fused with a private intermediate: the groups run the general copy.
        let rt = Runtime::builder().mode(Mode::Manual).worker_threads(0).fuse_unprofitable(true).build();
        let q = rt.queue();
        let (xb, tb, yb) = (rt.buffer(&x), rt.buffer(&vec![-1.0f32; n]), rt.buffer_zeroed::<f32>(n));
        q.start_fusion().unwrap();
        q.submit(|cg| {
            let (a, t) = (cg.read(&xb), cg.elements_out(&tb));
            cg.promote(&t, gantry::Promotion::Private);
            gantry::parallel_for!(cg, n, move |it| *t.elem(it) = a.at(it) * 1.5);
        }).unwrap();
        q.submit(|cg| {
            let (t, y) = (cg.read(&tb), cg.elements_out(&yb));
            cg.promote(&t, gantry::Promotion::Private);
            gantry::parallel_for!(cg, n, move |it| *y.elem(it) = t.at(it) + 1.0);
        }).unwrap();
        q.complete_fusion(gantry::FusionProps::default()).unwrap().wait().unwrap();
        let fused = matches!(q.fusion_outcome(), Some(gantry::FusionOutcome::Fused { kernels: 2, .. }));
        prop_assert!(fused, "fused: {:?}", q.fusion_outcome());
        prop_assert_eq!(yb.to_vec().unwrap(), x.iter().map(|v| v * 1.5 + 1.0).collect::<Vec<_>>());
        prop_assert_eq!(tb.to_vec().unwrap(), vec![-1.0f32; n], "internalized");
    }
}
