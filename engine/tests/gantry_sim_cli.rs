//! The `gantry-sim` CLI: shipped workloads run deterministically (the same report
//! twice), a policy system changes the schedule, traces are written, bad input is a
//! clear error, and the command line is a standard one (`--help`, `--version`, exit
//! status 2 for a bad option or value).

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_gantry-sim");

fn repo(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).args(args).output().expect("gantry-sim runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn makespan(report: &str) -> f64 {
    let line = report.lines().find(|l| l.starts_with("makespan:")).expect("makespan line");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn shipped_workloads_are_deterministic() {
    for (workload, machine) in [
        ("workloads/game_frame.json", "workloads/machines/gpu.json"),
        ("workloads/stencil.json", "workloads/machines/gpu.json"),
        ("workloads/multi_device.json", "workloads/machines/two_gpus.json"),
    ] {
        let args = [repo(workload), repo(machine)];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, first, err) = run(&args);
        assert_eq!(code, 0, "{workload}: {err}");
        assert!(first.contains("failed 0"), "{first}");
        assert!(makespan(&first) > 0.0);
        assert!(first.contains("compute engine 0: busy"), "{first}");
        // The wall-clock speed goes to stderr, so the report can be compared.
        assert!(err.contains("commands simulated in") && !first.contains("wall time"), "{err}");
        let (_, second, _) = run(&args);
        assert_eq!(first, second, "{workload}: same files, same report");
    }
}

#[test]
fn ready_order_policy_changes_the_schedule() {
    let (w, m) = (repo("workloads/game_frame.json"), repo("workloads/machines/gpu.json"));
    let (_, fifo, _) = run(&[&w, &m]);
    // The frame's fusion window fused its two particle kernels, every frame.
    assert!(line(&fifo, "fusions:").contains("8 fused, 0 cancelled"), "{fifo}");
    let (code, lifo, err) = run(&[&w, &m, "--ready", "lifo"]);
    assert_eq!(code, 0, "{err}");
    assert!(lifo.contains("ready order lifo"));
    assert_ne!(makespan(&fifo), makespan(&lifo), "{fifo}\n{lifo}");
}

#[test]
fn writes_a_trace() {
    let path = std::env::temp_dir().join(format!("gantry-sim-trace-{}.json", std::process::id()));
    let (w, m) = (repo("workloads/multi_device.json"), repo("workloads/machines/two_gpus.json"));
    let (code, _, err) = run(&[&w, &m, "--frames", "2", "--trace", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().unwrap().iter().any(|e| e["name"] == "score"));
    let _ = std::fs::remove_file(path);
}

#[test]
fn bad_input_is_a_clear_error() {
    let m = repo("workloads/machines/gpu.json");
    let (code, _, err) = run(&["/nonexistent.json", &m]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent.json"), "{err}");
    let bad = std::env::temp_dir().join(format!("gantry-sim-bad-{}.json", std::process::id()));
    std::fs::write(
        &bad,
        r#"{"buffers": [], "queues": [{"name": "q", "device": 0}],
            "commands": [{"op": "fill", "queue": "q", "dst": "missing", "value": 1}]}"#,
    )
    .unwrap();
    let (code, _, err) = run(&[bad.to_str().unwrap(), &m]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown buffer `missing`"), "{err}");
    let (code, _, err) = run(&[]);
    assert_eq!(code, 2);
    assert!(err.contains("Usage: gantry-sim") && err.contains("<WORKLOAD.json>"), "{err}");
    let _ = std::fs::remove_file(bad);
}

fn line<'a>(report: &'a str, prefix: &str) -> &'a str {
    report.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` line in {report}"))
}

fn bytes_moved(report: &str) -> u64 {
    line(report, "bytes moved:").split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// Recording the frame into a command graph and replaying it computes the same data
/// (the checksum) in fewer launches; graph fusion fuses the stencil's kernel chain,
/// still with the same data. Graph runs are deterministic too.
#[test]
fn graph_modes_replay_the_frame_with_the_same_data() {
    let (w, m) = (repo("workloads/stencil.json"), repo("workloads/machines/gpu.json"));
    let (code, eager, err) = run(&[&w, &m]);
    assert_eq!(code, 0, "{err}");
    let (_, graph, _) = run(&[&w, &m, "--mode", "graph"]);
    let (_, fused, _) = run(&[&w, &m, "--mode", "fused-graph"]);
    assert!(eager.contains(", eager,") && graph.contains(", graph,") && fused.contains(", fused-graph,"));
    assert_eq!(line(&eager, "checksum:"), line(&graph, "checksum:"));
    assert_eq!(line(&eager, "checksum:"), line(&fused, "checksum:"));
    assert!(line(&graph, "graph:").contains("0 fused chains"), "{graph}");
    assert!(line(&fused, "graph:").contains("1 fused chains"), "{fused}");
    assert!(graph.contains("command_buffer") && !graph.contains("kernel "), "{graph}");
    assert!(makespan(&fused) < makespan(&graph) && makespan(&graph) < makespan(&eager));
    assert_eq!(run(&[&w, &m, "--mode", "graph"]).1, graph);
    let (_, breadth, _) = run(&[&w, &m, "--mode", "graph", "--linearizer", "breadth-first"]);
    assert!(breadth.contains("graph order breadth-first"), "{breadth}");
    assert_eq!(line(&breadth, "checksum:"), line(&graph, "checksum:"));
}

/// The machine file's host pool runs the host tasks in virtual time, and its
/// device-to-device link carries the data between the two GPUs: without the link the
/// same data goes through host memory, moving more bytes.
#[test]
fn machine_file_host_pool_and_peer_links() {
    let w = repo("workloads/multi_device.json");
    let linked = repo("workloads/machines/two_gpus.json");
    let (code, with_link, err) = run(&[&w, &linked]);
    assert_eq!(code, 0, "{err}");
    assert!(with_link.contains("device 3 host pool: 6 commands"), "{with_link}");
    let text = std::fs::read_to_string(&linked)
        .unwrap()
        .replace("\"peer_bytes_per_ns\": 50.0", "\"peer_bytes_per_ns\": 0");
    let unlinked = std::env::temp_dir().join(format!("gantry-sim-unlinked-{}.json", std::process::id()));
    std::fs::write(&unlinked, text).unwrap();
    let (code, without, err) = run(&[&w, unlinked.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(line(&with_link, "checksum:"), line(&without, "checksum:"));
    assert!(bytes_moved(&without) > bytes_moved(&with_link), "{with_link}\n{without}");
    let _ = std::fs::remove_file(unlinked);
}

/// `--timing-only` models time without computing data: every shipped workload, eager
/// and replayed as a graph, gives the full run's report (timeline, makespan, engine
/// use, bytes, counts) line for line, but for the checksum it leaves out.
#[test]
fn timing_only_reports_the_full_runs_timeline() {
    for (workload, machine) in [
        ("workloads/game_frame.json", "workloads/machines/gpu.json"),
        ("workloads/stencil.json", "workloads/machines/gpu.json"),
        ("workloads/multi_device.json", "workloads/machines/two_gpus.json"),
    ] {
        let (w, m) = (repo(workload), repo(machine));
        for mode in ["eager", "graph"] {
            let (code, full, err) = run(&[&w, &m, "--mode", mode, "--frames", "3"]);
            assert_eq!(code, 0, "{workload} {mode}: {err}");
            let (code, timed, err) = run(&[&w, &m, "--mode", mode, "--frames", "3", "--timing-only"]);
            assert_eq!(code, 0, "{workload} {mode} --timing-only: {err}");
            assert_eq!(without_checksum(&timed), without_checksum(&full), "{workload} {mode}");
            assert!(line(&full, "checksum:") != line(&timed, "checksum:"), "{timed}");
            assert!(line(&timed, "checksum:").contains("timing only"), "{timed}");
            assert!(makespan(&timed) > 0.0);
        }
    }
}

fn without_checksum(report: &str) -> Vec<&str> {
    report.lines().filter(|l| !l.starts_with("checksum:")).collect()
}

/// `--help` prints the usage with every option and the values of the enumerated ones,
/// and exits 0.
#[test]
fn help_lists_every_option() {
    let (code, out, err) = run(&["--help"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Usage: gantry-sim"), "{out}");
    for item in [
        "<WORKLOAD.json>",
        "<MACHINE.json>",
        "--frames <N>",
        "--mode <MODE>",
        "--ready <READY>",
        "--linearizer <LINEARIZER>",
        "--trace <OUT.json>",
        "--timing-only",
        "--help",
        "--version",
    ] {
        assert!(out.contains(item), "no `{item}` in\n{out}");
    }
    for value in ["eager", "graph", "fused-graph", "fifo", "lifo", "reverse-dfs", "breadth-first"] {
        assert!(out.contains(value), "no `{value}` in\n{out}");
    }
}

/// `--version` prints the crate's version and exits 0.
#[test]
fn version_prints_the_crate_version() {
    let (code, out, err) = run(&["--version"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("gantry-sim {}", env!("CARGO_PKG_VERSION")));
}

/// An unknown option or a bad value exits 2 with an error naming it, before any
/// file is read.
#[test]
fn bad_options_exit_2_naming_them() {
    let (w, m) = (repo("workloads/stencil.json"), repo("workloads/machines/gpu.json"));
    for (args, names) in [
        (vec!["--bogus"], vec!["--bogus"]),
        (vec!["--mode", "lazy"], vec!["lazy", "--mode"]),
        (vec!["--ready", "random"], vec!["random", "--ready"]),
        (vec!["--linearizer", "dfs"], vec!["dfs", "--linearizer"]),
        (vec!["--frames", "many"], vec!["many", "--frames"]),
    ] {
        let args: Vec<&str> = [w.as_str(), m.as_str()].into_iter().chain(args).collect();
        let (code, out, err) = run(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
        for name in names {
            assert!(err.contains(name), "{args:?}: no `{name}` in {err}");
        }
    }
    // The workload file's spelling of a mode is still accepted on the command line.
    let (code, out, err) = run(&[&w, &m, "--mode", "fused_graph", "--frames", "1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(", fused-graph,"), "{out}");
}
