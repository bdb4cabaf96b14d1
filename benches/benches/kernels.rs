//! Each kernel form on the CPU driver against the plain Rust loop a user would write
//! instead, measured in the same run.
//!
//! Forms (`kernels/{form}/{size}/{variant}`):
//!
//! * `elementwise_for`: `cg.parallel_for(n, |it| *o.elem(it) = step(a.get(it, i)))`,
//!   a per-work-item closure over `f32`;
//! * `elementwise_for_twice`: the same kernel through `gantry::parallel_for!`, its
//!   input read with `a.at(it)` (the closure compiled twice, one copy for groups of
//!   ordinary memory, which the compiler vectorizes);
//! * `map`: the same arithmetic as `cg.map(&a, &o, step)`;
//! * `stencil`: the main job's 5-point stencil, a 2-D `parallel_for([n, n])` reading
//!   through `get` and writing through an element accessor (size `n` is the side);
//! * `stencil_twice`: the same body through `gantry::parallel_for!`;
//! * `stencil_primitive`: the same stencil as `cg.stencil`, whose body reads the
//!   cell's neighbourhood (`n.at(dy, dx)`) and keeps border cells;
//! * `particles_for`: a two-input particle step over 16-byte structs
//!   (`out[i] = integrate(p[i], f[i])`) as a per-work-item closure;
//! * `particles_for_twice`: the same step through `gantry::parallel_for!` and `at`;
//! * `particles_map2`: the same step as `cg.map2`;
//! * `reduce_sum`: the sum of `f32`s into one buffer element (`cg.reduce`, `Sum`);
//! * `map_reduce_sum`: the sum of `step(x)` (`cg.map_reduce`).
//!
//! Variants: `loop`, the hand-written serial loop over host slices (iterators, as a
//! user writes them, compiled for the binary's default target); `one_thread`, the
//! Gantry kernel on a runtime that runs kernels inline on the bench thread (manual
//! mode, `worker_threads(0)`): one thread, like the loop; `default_threads`, the
//! Gantry kernel on a runtime with its default worker threads (one per core) and a
//! scheduler thread. A Gantry round is a submit and a wait. Runtimes are built with
//! `preserve_on_failure(false)`: the loop keeps no copy of what it overwrites either.
//! Reductions sum in a different order than the loop (per work-group partials, then
//! the partials in group order), so their results are checked against the loop's
//! within a relative tolerance; every other form is checked bit for bit once before
//! it is measured.
//!
//! `cargo bench -p gantry-benches --bench kernels` (about two minutes on 2 cores);
//! `-- one_thread` or `-- stencil` filter as usual. The README's table of forms comes
//! from this bench: ratio = loop time / Gantry time (above 1: Gantry is faster).

use std::hint::black_box;
use std::time::Duration;

use bytemuck::{Pod, Zeroable};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, SamplingMode, Throughput};
use gantry::host::Sum;
use gantry::{Mode, Runtime};

/// One elementwise step.
#[inline(always)]
fn step(x: f32) -> f32 {
    x * 1.0001 + 0.5
}

/// A particle: position and velocity (16 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
#[repr(C)]
struct Particle {
    pos: [f32; 2],
    vel: [f32; 2],
}

/// Time step of the particle integration.
const DT: f32 = 0.01;

/// One particle's explicit Euler step under force `f`.
#[inline(always)]
fn integrate(p: Particle, f: [f32; 2]) -> Particle {
    let vel = [p.vel[0] + f[0] * DT, p.vel[1] + f[1] * DT];
    Particle { pos: [p.pos[0] + vel[0] * DT, p.pos[1] + vel[1] * DT], vel }
}

/// Diffusion coefficient of the stencil.
const ALPHA: f32 = 0.1;

/// The main job's stencil at an interior cell.
#[inline(always)]
fn stencil(c: f32, n: f32, s: f32, w: f32, e: f32) -> f32 {
    c + ALPHA * (n + s + w + e - 4.0 * c)
}

/// How a form's kernel is written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `cg.parallel_for` with a per-item closure.
    Closure,
    /// `gantry::parallel_for!`: the closure twice, own elements through `at`/`elem`.
    Twice,
    /// The runtime's own loop: `cg.map`, `cg.map2`, `cg.stencil`.
    Map,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    OneThread,
    DefaultThreads,
}

impl Set {
    fn name(self) -> &'static str {
        match self {
            Set::OneThread => "one_thread",
            Set::DefaultThreads => "default_threads",
        }
    }
    fn runtime(self) -> Runtime {
        match self {
            Set::OneThread => {
                Runtime::builder().preserve_on_failure(false).mode(Mode::Manual).worker_threads(0).build()
            }
            Set::DefaultThreads => Runtime::builder().preserve_on_failure(false).mode(Mode::Threaded).build(),
        }
    }
}

const SETS: [Set; 2] = [Set::OneThread, Set::DefaultThreads];

fn size_name(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n.is_multiple_of(1 << 20) => format!("{}M", n >> 20),
        n if n >= 1 << 10 && n.is_multiple_of(1 << 10) => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

fn configure(group: &mut BenchmarkGroup<'_, WallTime>, elements: usize) {
    group.throughput(Throughput::Elements(elements as u64));
    if elements >= 1 << 22 {
        group
            .sample_size(10)
            .measurement_time(Duration::from_millis(1_500))
            .warm_up_time(Duration::from_millis(300))
            .sampling_mode(SamplingMode::Flat);
    } else {
        group
            .sample_size(20)
            .measurement_time(Duration::from_millis(1_000))
            .warm_up_time(Duration::from_millis(300))
            .sampling_mode(SamplingMode::Auto);
    }
}

/// Bit-for-bit equality of two `Pod` slices, with the first difference in the panic.
fn assert_same<T: Pod + std::fmt::Debug>(label: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{label}: length");
    let bytes = |v: &T| bytemuck::bytes_of(v).to_vec();
    if let Some(i) = got.iter().zip(want).position(|(a, b)| bytes(a) != bytes(b)) {
        panic!("{label}: element {i} is {:?} but should be {:?}", got[i], want[i]);
    }
}

/// A form's round (`submit`: a submit and a wait) and its check: a round, then the
/// output compared bit for bit with `want`.
fn round_and_check<T: Pod + std::fmt::Debug, R: Fn() + Clone + 'static>(
    label: &'static str,
    submit: R,
    out: gantry::Buffer<T>,
    want: Vec<T>,
) -> (R, Box<dyn Fn()>) {
    let round = submit.clone();
    let check = Box::new(move || {
        submit();
        assert_same(label, &out.to_vec().expect("read"), &want);
    });
    (round, check)
}

fn input(n: usize) -> Vec<f32> {
    (0..n).map(|j| (j % 1000) as f32 * 0.001 - 0.25).collect()
}

fn particles(n: usize) -> (Vec<Particle>, Vec<[f32; 2]>) {
    let p = (0..n)
        .map(|i| {
            let x = (i % 977) as f32;
            Particle { pos: [x, x * 0.5], vel: [1.0 - x * 0.001, 0.25] }
        })
        .collect();
    let f = (0..n).map(|i| [(i % 13) as f32 * 0.1 - 0.6, -0.98]).collect();
    (p, f)
}

/// `loop` and the two Gantry variants of one form and size: `setup` builds the
/// Gantry side on a runtime (returning the round to time and a check of its
/// output), `hand` runs the loop.
fn form<S, R>(c: &mut Criterion, form: &str, size: usize, elements: usize, mut hand: impl FnMut(), setup: S)
where
    S: Fn(&Runtime) -> (R, Box<dyn Fn()>),
    R: FnMut(),
{
    let mut group = c.benchmark_group(format!("kernels/{form}/{}", size_name(size)));
    configure(&mut group, elements);
    group.bench_function("loop", |b| b.iter(&mut hand));
    for set in SETS {
        let mut state = None;
        group.bench_function(set.name(), |b| {
            let (_, (round, _)) = state.get_or_insert_with(|| {
                let rt = set.runtime();
                let (round, check) = setup(&rt);
                // Checked once, before the first measurement.
                check();
                (rt, (round, ()))
            });
            b.iter(&mut *round);
        });
        if let Some((rt, _)) = &state {
            rt.wait_idle().expect("wait_idle");
            let stats = rt.stats();
            assert_eq!(stats.failed, 0, "{form}/{}: commands failed: {stats:?}", set.name());
        }
    }
    group.finish();
}

fn elementwise(c: &mut Criterion) {
    for n in [1 << 16, 1 << 22] {
        let x = input(n);
        let want: Vec<f32> = x.iter().map(|&v| step(v)).collect();
        let mut out = vec![0f32; n];
        let hand = |out: &mut Vec<f32>| {
            for (o, &v) in black_box(out).iter_mut().zip(black_box(&x)) {
                *o = step(v);
            }
        };
        let setup = |form: Form| {
            let (x, want) = (x.clone(), want.clone());
            move |rt: &Runtime| {
                let q = rt.queue();
                let (a, o) = (rt.buffer(&x), rt.buffer_zeroed::<f32>(n));
                let submit = {
                    let (q, a, o) = (q.clone(), a.clone(), o.clone());
                    move || {
                        q.submit(|cg| {
                            let (a, o) = (cg.read(&a), cg.elements_out(&o));
                            match form {
                                Form::Closure => cg.parallel_for(n, move |it| {
                                    *o.elem(it) = step(a.get(it, it.global_linear_id()))
                                }),
                                Form::Twice => {
                                    gantry::parallel_for!(cg, n, move |it| *o.elem(it) = step(a.at(it)))
                                }
                                Form::Map => cg.map(&a, &o, step),
                            }
                        })
                        .expect("submit")
                        .wait()
                        .expect("wait")
                    }
                };
                round_and_check("elementwise", submit, o, want.clone())
            }
        };
        form(c, "elementwise_for", n, n, || hand(&mut out), setup(Form::Closure));
        form(c, "elementwise_for_twice", n, n, || hand(&mut out), setup(Form::Twice));
        form(c, "map", n, n, || hand(&mut out), setup(Form::Map));
    }
}

/// The serial stencil over a `side × side` grid (edges kept).
fn stencil_loop(cur: &[f32], next: &mut [f32], side: usize) {
    let (h, w) = (side, side);
    for y in 0..h {
        for x in 0..w {
            let i = y * w + x;
            let c = cur[i];
            next[i] = if y == 0 || x == 0 || y == h - 1 || x == w - 1 {
                c
            } else {
                stencil(c, cur[i - w], cur[i + w], cur[i - 1], cur[i + 1])
            };
        }
    }
}

fn stencil_bench(c: &mut Criterion) {
    for side in [512usize, 2048] {
        let n = side * side;
        let cur: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 * 0.01).collect();
        let mut want = vec![0f32; n];
        stencil_loop(&cur, &mut want, side);
        let mut next = vec![0f32; n];
        let setup = |form: Form| {
            let (cur, want) = (cur.clone(), want.clone());
            move |rt: &Runtime| {
                let q = rt.queue();
                let (a, o) = (rt.buffer(&cur), rt.buffer_zeroed::<f32>(n));
                let submit = {
                    let (q, a, o) = (q.clone(), a.clone(), o.clone());
                    move || {
                        q.submit(|cg| {
                            let (src, dst) = (cg.read(&a), cg.elements_out(&o));
                            let (h, w) = (side, side);
                            // The body as a macro: each expansion is a closure type of
                            // its own, so the plain kernel and the two copies of
                            // `parallel_for!` each have one call site.
                            macro_rules! body {
                                () => {
                                    move |it: &mut gantry::Item<'_>| {
                                        let (y, x) = (it.global_id(0), it.global_id(1));
                                        let i = y * w + x;
                                        let c = src.get(it, i);
                                        *dst.elem(it) = if y == 0 || x == 0 || y == h - 1 || x == w - 1 {
                                            c
                                        } else {
                                            let (n, s) = (src.get(it, i - w), src.get(it, i + w));
                                            stencil(c, n, s, src.get(it, i - 1), src.get(it, i + 1))
                                        };
                                    }
                                };
                            }
                            match form {
                                Form::Closure => cg.parallel_for([h, w], body!()),
                                Form::Twice => gantry::parallel_for!(cg, [h, w], body!()),
                                Form::Map => cg.stencil(&src, &dst, [h, w], |n| {
                                    let c = n.center();
                                    match n.is_border() {
                                        true => c,
                                        false => stencil(c, n.at(-1, 0), n.at(1, 0), n.at(0, -1), n.at(0, 1)),
                                    }
                                }),
                            }
                        })
                        .expect("submit")
                        .wait()
                        .expect("wait")
                    }
                };
                round_and_check("stencil", submit, o, want.clone())
            }
        };
        form(
            c,
            "stencil",
            side,
            n,
            || stencil_loop(black_box(&cur), black_box(&mut next), side),
            setup(Form::Closure),
        );
        form(
            c,
            "stencil_twice",
            side,
            n,
            || stencil_loop(black_box(&cur), black_box(&mut next), side),
            setup(Form::Twice),
        );
        form(
            c,
            "stencil_primitive",
            side,
            n,
            || stencil_loop(black_box(&cur), black_box(&mut next), side),
            setup(Form::Map),
        );
    }
}

fn particles_bench(c: &mut Criterion) {
    for n in [1 << 16, 1 << 22] {
        let (p, f) = particles(n);
        let want: Vec<Particle> = p.iter().zip(&f).map(|(&p, &f)| integrate(p, f)).collect();
        let mut out = vec![Particle::zeroed(); n];
        let mut hand = || {
            for ((o, &p), &f) in black_box(&mut out).iter_mut().zip(black_box(&p)).zip(black_box(&f)) {
                *o = integrate(p, f);
            }
        };
        let setup = |form: Form| {
            let (p, f, want) = (p.clone(), f.clone(), want.clone());
            move |rt: &Runtime| {
                let q = rt.queue();
                let (pb, fb, o) = (rt.buffer(&p), rt.buffer(&f), rt.buffer_zeroed::<Particle>(n));
                let submit = {
                    let (q, pb, fb, o) = (q.clone(), pb.clone(), fb.clone(), o.clone());
                    move || {
                        q.submit(|cg| {
                            let (p, f, o) = (cg.read(&pb), cg.read(&fb), cg.elements_out(&o));
                            match form {
                                Form::Map => cg.map2(&p, &f, &o, integrate),
                                Form::Closure => cg.parallel_for(n, move |it| {
                                    let i = it.global_linear_id();
                                    *o.elem(it) = integrate(p.get(it, i), f.get(it, i));
                                }),
                                Form::Twice => gantry::parallel_for!(cg, n, move |it| {
                                    *o.elem(it) = integrate(p.at(it), f.at(it))
                                }),
                            }
                        })
                        .expect("submit")
                        .wait()
                        .expect("wait")
                    }
                };
                round_and_check("particles", submit, o, want.clone())
            }
        };
        form(c, "particles_for", n, n, &mut hand, setup(Form::Closure));
        form(c, "particles_for_twice", n, n, &mut hand, setup(Form::Twice));
        form(c, "particles_map2", n, n, &mut hand, setup(Form::Map));
    }
}

/// The reduction's check: the loop's sum within a relative tolerance (the orders of
/// addition differ).
fn close(label: &str, got: f32, want: f32) {
    let tolerance = 1e-3 * want.abs().max(1.0);
    assert!((got - want).abs() <= tolerance, "{label}: {got} against the loop's {want}");
}

fn reduce_bench(c: &mut Criterion) {
    for n in [1 << 16, 1 << 24] {
        let x = input(n);
        let sum = |x: &[f32]| x.iter().sum::<f32>();
        let map_sum = |x: &[f32]| x.iter().map(|&v| step(v)).sum::<f32>();
        let (want, want_map) = (sum(&x), map_sum(&x));
        for mapped in [false, true] {
            let setup = |rt: &Runtime| {
                let q = rt.queue();
                let (a, o) = (rt.buffer(&x), rt.buffer_zeroed::<f32>(1));
                let submit = {
                    let (q, a, o) = (q.clone(), a.clone(), o.clone());
                    move || {
                        q.submit(|cg| {
                            let (a, out) = (cg.read(&a), cg.write(&o));
                            if mapped {
                                cg.map_reduce(&a, &out, step, Sum);
                            } else {
                                cg.reduce(&a, &out, Sum);
                            }
                        })
                        .expect("submit")
                        .wait()
                        .expect("wait")
                    }
                };
                let check: Box<dyn Fn()> = {
                    let submit = submit.clone();
                    Box::new(move || {
                        submit();
                        let got = o.to_vec().expect("read")[0];
                        close("reduce", got, if mapped { want_map } else { want });
                    })
                };
                (submit, check)
            };
            let name = if mapped { "map_reduce_sum" } else { "reduce_sum" };
            if mapped {
                form(
                    c,
                    name,
                    n,
                    n,
                    || {
                        black_box(map_sum(black_box(&x)));
                    },
                    setup,
                );
            } else {
                form(
                    c,
                    name,
                    n,
                    n,
                    || {
                        black_box(sum(black_box(&x)));
                    },
                    setup,
                );
            }
        }
    }
}

criterion_group!(benches, elementwise, stencil_bench, particles_bench, reduce_bench);
criterion_main!(benches);
