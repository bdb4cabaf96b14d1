//! Runs one eager-submission shape once, for instruction profiles of the per-command
//! path (`valgrind --tool=callgrind`): the difference between runs of N and 2N
//! commands, divided by N, is the cost of one command without the set-up.
//!
//! ```text
//! cargo build --release -p gantry-benches --bin eager_profile
//! valgrind --tool=callgrind target/release/eager_profile chain manual 20000
//! ```

use gantry::Mode;
use gantry_benches::eager::{Fixture, Shape, SHAPES};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        let names: Vec<&str> = SHAPES.iter().map(|s| s.name()).collect();
        eprintln!("usage: eager_profile <{}> <threaded|manual> <commands>", names.join("|"));
        std::process::exit(2);
    };
    let [shape, mode, n] = &args[..] else { usage() };
    let Some(shape) = Shape::from_name(shape) else { usage() };
    let mode = match mode.as_str() {
        "threaded" => Mode::Threaded,
        "manual" => Mode::Manual,
        _ => usage(),
    };
    let Ok(n) = n.parse::<usize>() else { usage() };
    let mut fixture = Fixture::new(mode, shape, n);
    let start = std::time::Instant::now();
    fixture.run(shape, n);
    let elapsed = start.elapsed();
    fixture.check_flat(shape.name());
    let commands = shape.commands(n);
    println!(
        "{} {commands} commands: {:.0} ns/command",
        shape.name(),
        elapsed.as_nanos() as f64 / commands as f64
    );
}
