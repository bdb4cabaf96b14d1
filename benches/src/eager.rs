//! Shapes of eager submission shared by the `scheduler` criterion bench and the
//! `eager_profile` binary (which runs one shape once, for instruction profiles).
//!
//! Each command is a single-work-item kernel doing nothing; its dependencies come
//! from accessors:
//! * `indep`: kernels with no accessors (no dependencies at all).
//! * `chain`: every kernel read-writes one buffer (one long dependency chain).
//! * `fan`: one writer, N-2 readers of its buffer each writing its own element of
//!   one large buffer (element accessors), and one kernel reading all of them.
//! * `wavefront`: an S×S grid (N = S²) in one buffer; cell (i, j) reads cells
//!   (i-1, j) and (i, j-1) and writes its own, three element accessors, submitted
//!   row by row.

use gantry::{Buffer, Mode, Queue, Runtime, Write};

/// Every shape, in report order.
pub const SHAPES: [Shape; 4] = [Shape::Indep, Shape::Chain, Shape::Fan, Shape::Wavefront];

/// Which dependency pattern a run submits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Shape {
    /// No dependencies.
    Indep,
    /// One read-write chain.
    Chain,
    /// One writer, N-2 readers, one reader of all.
    Fan,
    /// An S×S grid, each cell after its upper and left neighbours.
    Wavefront,
}

impl Shape {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Indep => "indep",
            Shape::Chain => "chain",
            Shape::Fan => "fan",
            Shape::Wavefront => "wavefront",
        }
    }

    /// The shape named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        SHAPES.into_iter().find(|s| s.name() == name)
    }

    /// The commands one iteration submits for size `n` (a wavefront's grid is square).
    pub fn commands(self, n: usize) -> usize {
        match self {
            Shape::Wavefront => side(n) * side(n),
            _ => n,
        }
    }
}

fn side(n: usize) -> usize {
    (n as f64).sqrt().round() as usize
}

/// `threaded` or `manual`.
pub fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Threaded => "threaded",
        Mode::Manual => "manual",
    }
}

/// The runtime each mode runs on: threaded with the default CPU workers, or manual
/// with none (everything on the calling thread).
pub fn runtime(mode: Mode) -> Runtime {
    match mode {
        Mode::Threaded => Runtime::builder().mode(Mode::Threaded).build(),
        Mode::Manual => Runtime::builder().mode(Mode::Manual).worker_threads(0).build(),
    }
}

/// A runtime and the buffers one benchmark uses, kept across its iterations.
pub struct Fixture {
    rt: Runtime,
    q: Queue,
    /// `chain`'s buffer and `fan`'s source.
    small: Buffer<u32>,
    /// `fan`'s per-reader slots (N-2 elements), or the wavefront's grid (S² elements).
    large: Option<Buffer<u32>>,
}

impl Fixture {
    /// A runtime in `mode` and the buffers `shape` needs for size `n`.
    pub fn new(mode: Mode, shape: Shape, n: usize) -> Self {
        let rt = runtime(mode);
        let q = rt.queue();
        let small = rt.buffer_zeroed::<u32>(16);
        let large = match shape {
            Shape::Fan => Some(rt.buffer_zeroed::<u32>(n - 2)),
            Shape::Wavefront => Some(rt.buffer_zeroed::<u32>(shape.commands(n))),
            _ => None,
        };
        Self { rt, q, small, large }
    }

    /// Submits the commands of `shape` for size `n`, then waits on the queue.
    pub fn run(&mut self, shape: Shape, n: usize) {
        match shape {
            Shape::Indep => (0..n).for_each(|_| self.indep_one()),
            Shape::Chain => (0..n).for_each(|_| self.chain_one()),
            Shape::Fan => (0..n).for_each(|i| self.fan_one(i, n)),
            Shape::Wavefront => {
                let s = side(n);
                for i in 0..s {
                    for j in 0..s {
                        self.wavefront_one(s, i, j);
                    }
                }
            }
        }
        self.q.wait().expect("queue wait");
    }

    fn indep_one(&self) {
        self.q.submit(|cg| cg.single_task(|_| {})).expect("submit");
    }

    fn chain_one(&self) {
        self.q
            .submit(|cg| {
                let _rw = cg.read_write(&self.small);
                cg.single_task(|_| {});
            })
            .expect("submit");
    }

    fn fan_one(&self, i: usize, n: usize) {
        let slots = self.large.as_ref().expect("fan slots");
        self.q
            .submit(|cg| {
                if i == 0 {
                    let _w = cg.write(&self.small);
                } else if i == n - 1 {
                    let _all = cg.read(slots);
                } else {
                    let _r = cg.read(&self.small);
                    let _slot = cg.access::<u32, Write>(slots, i - 1..i);
                }
                cg.single_task(|_| {});
            })
            .expect("submit");
    }

    fn wavefront_one(&self, s: usize, i: usize, j: usize) {
        let grid = self.large.as_ref().expect("wavefront grid");
        let cell = i * s + j;
        self.q
            .submit(|cg| {
                if i > 0 {
                    let _up = cg.access::<u32, gantry::Read>(grid, cell - s..cell - s + 1);
                }
                if j > 0 {
                    let _left = cg.access::<u32, gantry::Read>(grid, cell - 1..cell);
                }
                let _own = cg.access::<u32, Write>(grid, cell..cell + 1);
                cg.single_task(|_| {});
            })
            .expect("submit");
    }

    /// Memory stays flat: nothing is left alive once the last batch was waited for.
    /// Panics naming `label` otherwise.
    pub fn check_flat(&self, label: &str) {
        let stats = self.rt.stats();
        assert_eq!(stats.live_commands, 0, "{label}: commands left alive: {stats:?}");
        assert_eq!(stats.in_driver, 0, "{label}: operations left in the driver: {stats:?}");
        assert!(stats.live_records <= 3, "{label}: records grew: {stats:?}");
        assert_eq!(stats.failed, 0, "{label}: commands failed: {stats:?}");
    }
}
