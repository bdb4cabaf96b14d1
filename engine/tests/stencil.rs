//! Stencil kernels (`Handler::stencil`): results against a serial loop on every kind
//! of runtime, typed errors for grids that do not match their buffers, fusion's
//! refusal with its reason, and a failing body.

use gantry::{
    CancelReason, Error, FusionError, FusionOutcome, FusionProps, Mode, Neighborhood, QueueOptions, Runtime,
    SimConfig, Unprofitable,
};

/// The main job's diffusion step, with fixed borders.
fn diffuse(c: f32, n: f32, s: f32, w: f32, e: f32) -> f32 {
    c + 0.1 * (n + s + w + e - 4.0 * c)
}

/// The main job's stencil body: border cells keep their value.
fn diffuse_cell(n: &Neighborhood<'_, f32>) -> f32 {
    let c = n.center();
    match n.is_border() {
        true => c,
        false => diffuse(c, n.at(-1, 0), n.at(1, 0), n.at(0, -1), n.at(0, 1)),
    }
}

/// A distinct weight per neighbour, so that a wrong neighbour anywhere shows.
fn weight(dy: isize, dx: isize) -> f32 {
    (3 * (dy + 1) + dx + 2) as f32
}

fn grid(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 * 0.01).collect()
}

/// The serial loop a user would write: border cells keep their value; interior ones
/// diffuse. A second output weighs the clamped 3×3 neighbourhood of every cell,
/// border included, so that a wrong neighbour anywhere shows.
fn serial(input: &[f32], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let at = |y: usize, x: usize, dy: isize, dx: isize| {
        let yy = (y as isize + dy).clamp(0, rows as isize - 1) as usize;
        let xx = (x as isize + dx).clamp(0, cols as isize - 1) as usize;
        input[yy * cols + xx]
    };
    let (mut diffused, mut weighed) = (Vec::new(), Vec::new());
    for y in 0..rows {
        for x in 0..cols {
            let c = at(y, x, 0, 0);
            let border = y == 0 || x == 0 || y == rows - 1 || x == cols - 1;
            diffused.push(match border {
                true => c,
                false => diffuse(c, at(y, x, -1, 0), at(y, x, 1, 0), at(y, x, 0, -1), at(y, x, 0, 1)),
            });
            let mut s = 0.0;
            for dy in -1..=1 {
                for dx in -1..=1 {
                    s += at(y, x, dy, dx) * weight(dy, dx);
                }
            }
            weighed.push(s);
        }
    }
    (diffused, weighed)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// On one inline thread, the scheduler thread with the default workers, three
/// workers, and a simulated device (device-resident buffers), the stencil gives the
/// serial loop's results bit for bit: grids of one row or column, smaller than the
/// neighbourhood, of many groups, and with rows longer than a work-group.
#[test]
fn a_stencil_matches_the_serial_loop_on_every_runtime() {
    let runtimes = [
        (Runtime::builder().mode(Mode::Manual).worker_threads(0).build(), 0),
        (Runtime::new(), 0),
        (Runtime::builder().worker_threads(3).build(), 0),
        (Runtime::builder().mode(Mode::Manual).sim(SimConfig::default()).build(), 1),
    ];
    for (rt, device) in &runtimes {
        let q = rt.queue_with(QueueOptions { device: *device, in_order: false }).unwrap();
        for (rows, cols) in [(1, 1), (1, 7), (7, 1), (2, 3), (37, 130), (300, 257), (5, 9000)] {
            let input = grid(rows, cols);
            let src = rt.buffer(&input);
            let (diffused, weighed) =
                (rt.buffer_zeroed::<f32>(rows * cols), rt.buffer_zeroed::<f32>(rows * cols));
            q.submit(|cg| {
                let (s, d) = (cg.read(&src), cg.elements_out(&diffused));
                cg.stencil(&s, &d, [rows, cols], diffuse_cell);
            })
            .unwrap();
            q.submit(|cg| {
                let (s, w) = (cg.read(&src), cg.elements_out(&weighed));
                cg.stencil(&s, &w, [rows, cols], |n| {
                    let mut s = 0.0;
                    for dy in -1..=1 {
                        for dx in -1..=1 {
                            s += n.at(dy, dx) * weight(dy, dx);
                        }
                    }
                    s
                });
            })
            .unwrap();
            let (want_d, want_w) = serial(&input, rows, cols);
            assert_eq!(bits(&diffused.to_vec().unwrap()), bits(&want_d), "diffusion, {rows} × {cols}");
            assert_eq!(bits(&weighed.to_vec().unwrap()), bits(&want_w), "weights, {rows} × {cols}");
        }
    }
}

/// The cell's position reaches the body; a stencil's output may be of another type.
#[test]
fn positions_reach_the_body() {
    let rt = Runtime::new();
    let (rows, cols) = (6, 11);
    let src = rt.buffer_zeroed::<u8>(rows * cols);
    let out = rt.buffer_zeroed::<[u32; 2]>(rows * cols);
    rt.queue()
        .submit(|cg| {
            let (s, o) = (cg.read(&src), cg.elements_out(&out));
            cg.stencil(&s, &o, [rows, cols], |n| {
                let (y, x) = n.position();
                [y as u32, x as u32]
            });
        })
        .unwrap()
        .wait()
        .unwrap();
    let want: Vec<[u32; 2]> = (0..rows * cols).map(|i| [(i / cols) as u32, (i % cols) as u32]).collect();
    assert_eq!(out.to_vec().unwrap(), want);
}

/// A grid whose cells are not exactly the output's elements, or more than the
/// input's, is refused at submit with the numbers; nothing runs, and the runtime
/// goes on.
#[test]
fn a_grid_that_does_not_match_its_buffers_is_a_typed_error() {
    let rt = Runtime::new();
    let q = rt.queue();
    let (small, out) = (rt.buffer(&[1.0f32; 11]), rt.buffer(&[9.0f32; 12]));
    for ([rows, cols], input) in [([3, 5], 12), ([3, 4], 11), ([usize::MAX, 2], 12)] {
        let src = if input == 12 { out.clone() } else { small.clone() };
        let dst = rt.buffer(&[9.0f32; 12]);
        let err = q
            .submit(|cg| {
                let (s, d) = (cg.read(&src), cg.elements_out(&dst));
                cg.stencil(&s, &d, [rows, cols], |n| n.center());
            })
            .unwrap_err();
        match err {
            Error::StencilGrid { rows: r, cols: c, input: i, output: o } => {
                assert_eq!((r, c, i, o), (rows, cols, input, 12))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(dst.to_vec().unwrap(), vec![9.0; 12], "nothing ran");
    }
    let fine = rt.buffer_zeroed::<f32>(11);
    q.submit(|cg| {
        let (s, d) = (cg.read(&small), cg.elements_out(&fine));
        cg.stencil(&s, &d, [1, 11], |n| n.center() + 1.0);
    })
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(fine.to_vec().unwrap(), vec![2.0; 11]);
    // In place, cells would read neighbours other work-groups overwrite: the two
    // accessors conflict.
    let err = q
        .submit(|cg| {
            let (s, d) = (cg.read(&fine), cg.elements_out(&fine));
            cg.stencil(&s, &d, [1, 11], |n| n.center());
        })
        .unwrap_err();
    assert!(matches!(err, Error::AccessorConflict { .. }), "{err:?}");
    // A grid of no cells is refused, whose buffers are empty too.
    let (empty_in, empty_out) = (rt.buffer_zeroed::<f32>(0), rt.buffer_zeroed::<f32>(0));
    let err = q
        .submit(|cg| {
            let (s, d) = (cg.read(&empty_in), cg.elements_out(&empty_out));
            cg.stencil(&s, &d, [0, 5], |n| n.center());
        })
        .unwrap_err();
    assert!(matches!(err, Error::EmptyRange { .. } | Error::Range(_)), "{err:?}");
}

/// The buffers of a two-kernel chain over a `rows × cols` grid: the input (and its
/// values), the intermediate and the output.
struct Chain {
    input: Vec<f32>,
    x: gantry::Buffer<f32>,
    tmp: gantry::Buffer<f32>,
    out: gantry::Buffer<f32>,
}

impl Chain {
    fn new(rt: &Runtime, rows: usize, cols: usize) -> Self {
        let input = grid(rows, cols);
        let x = rt.buffer(&input);
        let (tmp, out) = (rt.buffer_zeroed::<f32>(rows * cols), rt.buffer_zeroed::<f32>(rows * cols));
        Self { input, x, tmp, out }
    }
}

/// A fusion with a stencil is cancelled with the stencil's name and the reason, and
/// its kernels run unfused with the serial results. (Its window fuses whatever its
/// size, so that the stencil reaches the fusion compiler.)
#[test]
fn a_stencil_is_not_fused_and_says_why() {
    let rt = Runtime::builder()
        .mode(Mode::Manual)
        .worker_threads(0)
        .fusion_warnings(0)
        .fusion_window(gantry::WindowThresholds::ALWAYS)
        .build();
    let q = rt.queue();
    let (rows, cols) = (20, 30);
    let Chain { input, x, tmp, out } = Chain::new(&rt, rows, cols);
    q.start_fusion().unwrap();
    q.submit(|cg| {
        let (x, t) = (cg.read(&x), cg.elements_out(&tmp));
        cg.map(&x, &t, |v| v);
    })
    .unwrap();
    q.submit(|cg| {
        let (t, o) = (cg.read(&tmp), cg.elements_out(&out));
        cg.stencil(&t, &o, [rows, cols], diffuse_cell);
    })
    .unwrap();
    q.complete_fusion(FusionProps::default()).unwrap().wait().unwrap();
    match q.fusion_outcome() {
        Some(FusionOutcome::Cancelled(CancelReason::Failed(FusionError::Unprofitable {
            kernel,
            reason,
        }))) => {
            assert_eq!((kernel.as_str(), reason), ("stencil", Unprofitable::Neighborhood))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(bits(&out.to_vec().unwrap()), bits(&serial(&input, rows, cols).0));
}

/// A body that asks for a neighbour past the 3×3 neighbourhood, or panics, fails its
/// command with the message; its dependents fail with it, and other work goes on.
#[test]
fn a_failing_body_fails_its_command_only() {
    // Manual: the dependent is submitted before the stencil runs (on a threaded
    // runtime the stencil may have failed and retired first, and a command submitted
    // after that depends on nothing).
    let rt = Runtime::builder().mode(Mode::Manual).build();
    let q = rt.queue();
    let (rows, cols) = (8, 8);
    let src = rt.buffer(&grid(rows, cols));
    let (out, after) = (rt.buffer_zeroed::<f32>(rows * cols), rt.buffer_zeroed::<f32>(rows * cols));
    for (far, message) in [(true, "outside the 3×3 neighbourhood"), (false, "cell (4, 5)")] {
        let failed = q
            .submit(|cg| {
                let (s, o) = (cg.read(&src), cg.elements_out(&out));
                cg.stencil(&s, &o, [rows, cols], move |n| match (far, n.position()) {
                    (true, _) => n.at(0, 2),
                    (false, (4, 5)) => panic!("cell (4, 5)"),
                    _ => n.center(),
                });
            })
            .unwrap();
        let dependent = q
            .submit(|cg| {
                let (o, a) = (cg.read(&out), cg.elements_out(&after));
                cg.map(&o, &a, |v| v);
            })
            .unwrap();
        let err = failed.wait().unwrap_err().to_string();
        assert!(err.contains(message), "{err}");
        assert!(dependent.wait().is_err(), "a dependent of the failed stencil fails too");
    }
    let fine = rt.buffer_zeroed::<f32>(rows * cols);
    q.submit(|cg| {
        let (s, o) = (cg.read(&src), cg.elements_out(&fine));
        cg.stencil(&s, &o, [rows, cols], |n| n.center());
    })
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(fine.to_vec().unwrap(), grid(rows, cols));
}

/// Fused anyway (`fuse_unprofitable`), a stencil that reads the chain's input runs
/// inside the fused kernel through its per-work-item path, with and without
/// barriers, and gives the unfused results.
#[test]
fn fused_anyway_a_stencil_first_in_its_chain_gives_the_same_results() {
    for barriers in [true, false] {
        let rt = Runtime::builder()
            .mode(Mode::Manual)
            .worker_threads(0)
            .fusion_warnings(0)
            .fuse_unprofitable(true)
            .build();
        let q = rt.queue();
        let (rows, cols) = (16, 24);
        let Chain { input, x, tmp, out } = Chain::new(&rt, rows, cols);
        q.start_fusion().unwrap();
        q.submit(|cg| {
            let (x, t) = (cg.read(&x), cg.elements_out(&tmp));
            cg.stencil(&x, &t, [rows, cols], diffuse_cell);
        })
        .unwrap();
        q.submit(|cg| {
            let (t, o) = (cg.read(&tmp), cg.elements_out(&out));
            cg.map(&t, &o, |v| v * 2.0);
        })
        .unwrap();
        q.complete_fusion(FusionProps { barriers }).unwrap().wait().unwrap();
        assert!(
            matches!(q.fusion_outcome(), Some(FusionOutcome::Fused { kernels: 2, .. })),
            "{:?}",
            q.fusion_outcome()
        );
        let want = serial(&input, rows, cols).0;
        assert_eq!(bits(&tmp.to_vec().unwrap()), bits(&want), "barriers: {barriers}");
        let doubled: Vec<f32> = want.iter().map(|v| v * 2.0).collect();
        assert_eq!(bits(&out.to_vec().unwrap()), bits(&doubled), "barriers: {barriers}");
    }
}
