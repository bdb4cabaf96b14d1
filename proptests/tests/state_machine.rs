//! Model-based test of the public API with `proptest-state-machine`.
//!
//! Each transition is a batch of operations (kernels, kernels that fail, copies, fills,
//! host tasks, host write guards) submitted together to CPU and simulated-device
//! queues, in-order and out-of-order, followed by a wait; or a buffer drop. The
//! reference state machine predicts every buffer's contents and which operations fail:
//! a failing kernel's writes are undone, and an operation that depends on a failed
//! one within the batch (through a buffer it wrote or read, or an in-order queue)
//! fails too, without running. Runs in manual mode, where that is deterministic.
//! Shrinking gives a minimal failing sequence of batches.
//!
//! `GANTRY_PROPTEST_CASES=N` runs N sequences instead of the default.

use std::sync::Once;

use gantry::{Buffer, Event, Mode, Queue, QueueOptions, Runtime, SimConfig};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

/// Queues: 0 CPU out-of-order, 1 CPU in-order, 2 sim out-of-order, 3 sim in-order.
const QUEUES: usize = 4;
const IN_ORDER: [bool; QUEUES] = [false, true, false, true];

#[derive(Clone, Debug)]
enum Op {
    /// `dst[i] = src[i % len] * 3 + k` for every element of `dst` (src may be dst).
    Kernel {
        queue: usize,
        src: usize,
        dst: usize,
        k: u32,
    },
    /// Writes `dst`, then panics: the writes are undone.
    FailingKernel {
        queue: usize,
        dst: usize,
    },
    Fill {
        queue: usize,
        dst: usize,
        value: u32,
    },
    /// `dst[..n] = src[..n]`, n the shorter length (src != dst).
    Copy {
        queue: usize,
        src: usize,
        dst: usize,
    },
    /// `dst[0] += sum(src)` on a host thread (src may be dst).
    HostTask {
        queue: usize,
        src: usize,
        dst: usize,
    },
    /// Host write guard: `buf[idx % len] = value`, after everything submitted before
    /// it has finished (a full synchronization point: earlier failures are retired,
    /// so they fail nothing after it).
    Guard {
        buf: usize,
        idx: usize,
        value: u32,
    },
}

#[derive(Clone, Debug)]
enum Transition {
    Batch(Vec<Op>),
    Drop(usize),
}

#[derive(Clone, Debug)]
struct Model {
    buffers: Vec<Option<Vec<u32>>>,
    /// For the last batch: which operations the model expects to fail.
    failed: Vec<bool>,
}

impl Model {
    fn live(&self) -> Vec<usize> {
        (0..self.buffers.len()).filter(|&b| self.buffers[b].is_some()).collect()
    }
}

fn op(live: Vec<usize>) -> impl Strategy<Value = Op> {
    let pick = proptest::sample::select(live);
    let queue = 0..QUEUES;
    prop_oneof![
        4 => (queue.clone(), pick.clone(), pick.clone(), 0..100u32)
            .prop_map(|(queue, src, dst, k)| Op::Kernel { queue, src, dst, k }),
        1 => (queue.clone(), pick.clone()).prop_map(|(queue, dst)| Op::FailingKernel { queue, dst }),
        2 => (queue.clone(), pick.clone(), 0..1000u32).prop_map(|(queue, dst, value)| Op::Fill { queue, dst, value }),
        2 => (queue.clone(), pick.clone(), pick.clone()).prop_map(|(queue, src, dst)| Op::Copy { queue, src, dst }),
        2 => (queue, pick.clone(), pick.clone()).prop_map(|(queue, src, dst)| Op::HostTask { queue, src, dst }),
        1 => (pick, 0..64usize, 0..1000u32).prop_map(|(buf, idx, value)| Op::Guard { buf, idx, value }),
    ]
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        proptest::collection::vec(proptest::collection::vec(0..50u32, 1..24), 2..5)
            .prop_map(|bufs| Model { buffers: bufs.into_iter().map(Some).collect(), failed: vec![] })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Transition> {
        let live = state.live();
        let batch = proptest::collection::vec(op(live.clone()), 1..8).prop_map(Transition::Batch);
        if live.len() > 2 {
            prop_oneof![6 => batch, 1 => proptest::sample::select(live).prop_map(Transition::Drop)].boxed()
        } else {
            batch.boxed()
        }
    }

    fn preconditions(state: &Model, t: &Transition) -> bool {
        let live = |b: &usize| state.buffers.get(*b).is_some_and(Option::is_some);
        match t {
            Transition::Drop(b) => live(b) && state.live().len() > 2,
            Transition::Batch(ops) => ops.iter().all(|op| match op {
                Op::Kernel { src, dst, .. } | Op::HostTask { src, dst, .. } => live(src) && live(dst),
                Op::Copy { src, dst, .. } => live(src) && live(dst) && src != dst,
                Op::FailingKernel { dst, .. } | Op::Fill { dst, .. } => live(dst),
                Op::Guard { buf, .. } => live(buf),
            }),
        }
    }

    fn apply(mut state: Model, t: &Transition) -> Model {
        match t {
            Transition::Drop(b) => {
                state.buffers[*b] = None;
                state.failed.clear();
            }
            Transition::Batch(ops) => {
                let n = state.buffers.len();
                // A failed command's writes make later accesses fail; its reads make
                // later writes fail; its queue, if in-order, fails what follows.
                let (mut wrote, mut read, mut queue_failed) =
                    (vec![false; n], vec![false; n], [false; QUEUES]);
                state.failed.clear();
                for op in ops {
                    let (queue, reads, writes): (Option<usize>, Vec<usize>, Vec<usize>) = match *op {
                        Op::Kernel { queue, src, dst, .. } | Op::HostTask { queue, src, dst } => {
                            (Some(queue), vec![src], vec![dst])
                        }
                        Op::Copy { queue, src, dst } => (Some(queue), vec![src], vec![dst]),
                        Op::FailingKernel { queue, dst } | Op::Fill { queue, dst, .. } => {
                            (Some(queue), vec![], vec![dst])
                        }
                        Op::Guard { buf, .. } => (None, vec![], vec![buf]),
                    };
                    if matches!(op, Op::Guard { .. }) {
                        (wrote, read, queue_failed) = (vec![false; n], vec![false; n], [false; QUEUES]);
                    }
                    let poisoned = queue.is_some_and(|q| IN_ORDER[q] && queue_failed[q])
                        || reads.iter().any(|&b| wrote[b])
                        || writes.iter().any(|&b| wrote[b] || read[b]);
                    let fails = poisoned || matches!(op, Op::FailingKernel { .. });
                    state.failed.push(fails);
                    if fails {
                        for &b in &writes {
                            wrote[b] = true;
                        }
                        for &b in &reads {
                            read[b] = true;
                        }
                        if let Some(q) = queue {
                            queue_failed[q] = true;
                        }
                        continue;
                    }
                    let bufs = &mut state.buffers;
                    match *op {
                        Op::Kernel { src, dst, k, .. } => {
                            let s = bufs[src].clone().unwrap();
                            let d = bufs[dst].as_mut().unwrap();
                            for (i, x) in d.iter_mut().enumerate() {
                                *x = s[i % s.len()].wrapping_mul(3).wrapping_add(k);
                            }
                        }
                        Op::Fill { dst, value, .. } => bufs[dst].as_mut().unwrap().fill(value),
                        Op::Copy { src, dst, .. } => {
                            let s = bufs[src].clone().unwrap();
                            let d = bufs[dst].as_mut().unwrap();
                            let len = s.len().min(d.len());
                            d[..len].copy_from_slice(&s[..len]);
                        }
                        Op::HostTask { src, dst, .. } => {
                            let sum =
                                bufs[src].as_ref().unwrap().iter().fold(0u32, |a, &x| a.wrapping_add(x));
                            let d = bufs[dst].as_mut().unwrap();
                            d[0] = d[0].wrapping_add(sum);
                        }
                        Op::Guard { buf, idx, value } => {
                            let d = bufs[buf].as_mut().unwrap();
                            let len = d.len();
                            d[idx % len] = value;
                        }
                        Op::FailingKernel { .. } => unreachable!(),
                    }
                }
            }
        }
        state
    }
}

struct Gantry {
    rt: Runtime,
    queues: Vec<Queue>,
    buffers: Vec<Option<Buffer<u32>>>,
}

/// An operation's outcome: an event to wait on, or (host write guards) whether it
/// failed at once.
enum Outcome {
    Event(Event),
    Done { failed: bool },
}

fn submit(g: &Gantry, op: &Op) -> Outcome {
    let buf = |b: usize| g.buffers[b].as_ref().unwrap();
    let event = match *op {
        Op::Kernel { queue, src, dst, k } => g.queues[queue].submit(|cg| {
            let d = buf(dst);
            if src == dst {
                let a = cg.read_write(d);
                cg.parallel_for(d.len(), move |it| {
                    let i = it.global_linear_id();
                    a.set(it, i, a.get(it, i).wrapping_mul(3).wrapping_add(k))
                });
            } else {
                let (s, slen) = (cg.read(buf(src)), buf(src).len());
                let o = cg.elements_out(d);
                cg.parallel_for(d.len(), move |it| {
                    *o.elem(it) = s.get(it, it.global_linear_id() % slen).wrapping_mul(3).wrapping_add(k)
                });
            }
        }),
        Op::FailingKernel { queue, dst } => g.queues[queue].submit(|cg| {
            let o = cg.read_write(buf(dst));
            cg.single_task(move |it| {
                o.set(it, 0, 12345);
                panic!("{INTENDED}");
            });
        }),
        Op::Fill { queue, dst, value } => g.queues[queue].submit(|cg| cg.fill(buf(dst), value)),
        Op::Copy { queue, src, dst } => {
            let len = buf(src).len().min(buf(dst).len());
            g.queues[queue].submit(|cg| cg.copy_range(buf(src), 0, buf(dst), 0, len))
        }
        Op::HostTask { queue, src, dst } => g.queues[queue].submit(|cg| {
            if src == dst {
                let mut d = cg.host_read_write(buf(dst));
                cg.host_task(move |ctx| {
                    let d = d.as_mut_slice(ctx);
                    let sum = d.iter().fold(0u32, |a, &x| a.wrapping_add(x));
                    d[0] = d[0].wrapping_add(sum);
                });
            } else {
                let s = cg.host_read(buf(src));
                let mut d = cg.host_read_write(buf(dst));
                cg.host_task(move |ctx| {
                    let sum = s.as_slice(ctx).iter().fold(0u32, |a, &x| a.wrapping_add(x));
                    let d = d.as_mut_slice(ctx);
                    d[0] = d[0].wrapping_add(sum);
                });
            }
        }),
        Op::Guard { buf: b, idx, value } => {
            g.rt.wait_idle().unwrap();
            return match buf(b).write() {
                Ok(mut guard) => {
                    let len = guard.len();
                    guard[idx % len] = value;
                    Outcome::Done { failed: false }
                }
                Err(_) => Outcome::Done { failed: true },
            };
        }
    };
    Outcome::Event(event.expect("valid command group"))
}

const INTENDED: &str = "intended state-machine failure";

impl StateMachineTest for Gantry {
    type SystemUnderTest = Gantry;
    type Reference = Reference;

    fn init_test(model: &Model) -> Gantry {
        static QUIET: Once = Once::new();
        QUIET.call_once(|| {
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                if info.payload().downcast_ref::<String>().is_none_or(|m| m != INTENDED) {
                    default(info)
                }
            }));
        });
        let rt = Runtime::builder()
            .mode(Mode::Manual)
            .worker_threads(0)
            .host_threads(0)
            .sim(SimConfig::default())
            .build();
        let queues = (0..QUEUES)
            .map(|q| rt.queue_with(QueueOptions { device: (q / 2) as u32, in_order: IN_ORDER[q] }).unwrap())
            .collect();
        let buffers = model.buffers.iter().map(|b| b.as_ref().map(|v| rt.buffer(v))).collect();
        Gantry { rt, queues, buffers }
    }

    fn apply(mut g: Gantry, model: &Model, t: Transition) -> Gantry {
        match t {
            Transition::Drop(b) => {
                g.buffers[b] = None;
            }
            Transition::Batch(ops) => {
                let outcomes: Vec<Outcome> = ops.iter().map(|op| submit(&g, op)).collect();
                g.rt.wait_idle().unwrap();
                for (i, (outcome, expect_fail)) in outcomes.iter().zip(&model.failed).enumerate() {
                    let failed = match outcome {
                        Outcome::Event(ev) => ev.wait().is_err(),
                        Outcome::Done { failed } => *failed,
                    };
                    assert_eq!(failed, *expect_fail, "op {i} ({:?})", ops[i]);
                }
            }
        }
        g
    }

    fn check_invariants(g: &Gantry, model: &Model) {
        for (b, expect) in model.buffers.iter().enumerate() {
            if let (Some(buf), Some(expect)) = (&g.buffers[b], expect) {
                assert_eq!(&buf.to_vec().unwrap(), expect, "buffer {b}");
            }
        }
        g.rt.wait_idle().unwrap();
        let stats = g.rt.stats();
        let live = model.buffers.iter().filter(|b| b.is_some()).count() as u64;
        assert_eq!(stats.live_commands, 0);
        assert!(stats.live_records <= live, "records of dropped buffers are released: {stats:?}");
    }
}

fn cases() -> u32 {
    std::env::var("GANTRY_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn api_matches_the_reference_state_machine(sequential 1..16 => Gantry);
}
