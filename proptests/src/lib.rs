//! # gantry-proptests
//!
//! Property tests of Gantry against a reference model.
//!
//! * [`Program`]: buffers of `u32` and a list of [`Op`]s (kernels, host tasks, copies,
//!   fills, host transfers, waits, host accesses), each submission on one of a few
//!   queues and on the CPU or the simulated device, optionally with explicit
//!   `depends_on` edges to earlier submissions.
//! * [`RawProgram`] + [`Program::decode`]: the generator. A raw program is plain
//!   numbers (what proptest generates and shrinks); decoding turns any raw program into
//!   a *valid* program (ranges in bounds, no conflicting accessors in one command
//!   group, waits only on earlier submissions), under [`GenOptions`].
//! * [`run_model`]: executes a program serially, in submission order, on plain `Vec`s.
//!   Its [`Outcome`] holds the final buffers, every mid-program `to_vec` snapshot,
//!   every `copy_to_host` readback and a digest of what every host task read.
//! * [`run_gantry`] / [`run_gantry_watched`] / [`Session`]: executes it through Gantry
//!   under a [`Config`]; [`check`] compares the two, reporting a hang (with the
//!   scheduler's live commands) after [`hang_timeout`].
//! * [`Program::parse`]: reads a program back from its `Debug` form, so a failing
//!   case printed by a property can be pasted into a regression test.
//!
//! The arithmetic of kernels and host tasks is order-sensitive ([`mix`]): a missing
//! dependency, a stale device copy or a lost partial write shows up as wrong data.
//!
//! Environment: `GANTRY_PROPTEST_CASES=N` runs `N` cases per property (the tests'
//! defaults total about 10,000 cases); `GANTRY_PROPTEST_TIMEOUT_MS` sets the hang
//! timeout (default 10 s).
//!
//! One file per concept: `program.rs` (the program types and their `Debug` form),
//! `generator.rs` (raw programs decoded into valid ones), `model.rs` (the reference
//! model), `runner.rs` (running through Gantry and comparing), `watch.rs` (hang
//! detection and reports), `parse.rs` (the `Debug` form read back) and `arith.rs`
//! (the arithmetic of kernels and host tasks).

mod arith;
mod generator;
mod model;
mod parse;
mod program;
mod runner;
mod watch;

pub mod fusion;
pub mod graph;

pub use arith::{host_data, initial_contents, item_seed, mix, out_value, rw_value, write_mask};
pub use generator::{GenOptions, RawOp, RawProgram, RawSpan, MAX_BUFFERS, MAX_LEN, MAX_QUEUES};
pub use model::{digest, run_model, Outcome};
pub use program::{BufferSpec, Cmd, Dev, Launch, Op, Program, Span, WMode};
pub use runner::{check, run_gantry, run_gantry_outcome, run_gantry_watched, Config, Session};
pub use watch::{dump_world, hang_timeout};

// The helpers the fusion and graph programs share with plain ones.
pub(crate) use generator::{accessors, decode_buffers, host_op, pick, plain_cmd, Kind, Live, KINDS};
pub(crate) use parse::{num, parse_header, parse_list, parse_op};
pub(crate) use program::{dev_name, write_header};
pub(crate) use runner::{build, Bufs};
pub(crate) use watch::run_watched;
