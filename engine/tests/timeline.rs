//! Timelines: every finished command is recorded, slices respect dependencies, and
//! the Chrome trace is valid JSON with one slice per command and a flow per edge.

use std::collections::HashMap;

use gantry::{Mode, QueueOptions, Runtime, SimConfig, Slice};
use serde_json::Value;

fn workload(rt: &Runtime, device: u32) {
    let q = rt.queue_with(QueueOptions { device, in_order: false }).unwrap();
    let n = 50_000;
    let a = rt.buffer(&vec![1u32; n]);
    let b = rt.buffer_zeroed::<u32>(n);
    for round in 0..4u32 {
        q.submit(|cg| {
            cg.name(format!("scale {round}"));
            let a = cg.read(&a);
            let b = cg.elements_out(&b);
            cg.parallel_for(n, move |it| *b.elem(it) = a.get(it, it.global_linear_id()) * 2 + round);
        })
        .unwrap();
        q.submit(|cg| {
            cg.name(format!("accumulate {round}"));
            let b = cg.read(&b);
            let a = cg.elements_mut(&a);
            cg.parallel_for(n, move |it| *a.elem(it) += b.get(it, it.global_linear_id()) % 7);
        })
        .unwrap();
    }
    q.submit(|cg| cg.fill(&b, 0)).unwrap();
    q.wait().unwrap();
}

#[test]
fn slices_respect_dependencies_and_trace_is_valid() {
    let rt = Runtime::builder().worker_threads(2).host_threads(2).timeline(true).build();
    workload(&rt, 0);
    rt.queue().submit(|cg| cg.host_task(|_| {})).unwrap().wait().unwrap();
    rt.wait_idle().unwrap();
    let timeline = rt.timeline().expect("recording");
    let stats = rt.stats();
    assert_eq!(timeline.slices.len() as u64, stats.completed + stats.failed);
    let by_id: HashMap<u64, &Slice> = timeline.slices.iter().map(|s| (s.id, s)).collect();
    let mut edges = 0;
    for s in &timeline.slices {
        assert!(s.start_ns <= s.end_ns, "{s:?}");
        for p in s.preds.iter().filter_map(|p| by_id.get(p)) {
            assert!(p.end_ns <= s.start_ns, "{} started before its dependency {} ended", s.name, p.name);
            edges += 1;
        }
    }
    assert!(edges >= 8, "the chain's edges are recorded ({edges})");
    assert!(timeline.slices.iter().any(|s| s.lane != 0), "pool threads get their own tracks");

    let trace: Value = serde_json::from_str(&rt.chrome_trace().unwrap()).expect("valid JSON");
    let events = trace["traceEvents"].as_array().unwrap();
    let slices: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(slices.len(), timeline.slices.len());
    assert!(slices.iter().any(|e| e["name"] == "accumulate 3" && e["cat"] == "kernel"));
    let mut flows: HashMap<u64, (f64, f64)> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "s" || e["ph"] == "f") {
        let entry = flows.entry(e["id"].as_u64().unwrap()).or_insert((f64::NAN, f64::NAN));
        let ts = e["ts"].as_f64().unwrap();
        if e["ph"] == "s" {
            entry.0 = ts;
        } else {
            entry.1 = ts;
        }
    }
    assert_eq!(flows.len(), edges);
    assert!(flows.values().all(|(s, f)| s <= f), "flows point forward in time");
    let path = std::env::temp_dir().join(format!("gantry-trace-{}.json", std::process::id()));
    rt.write_chrome_trace(&path).unwrap();
    assert!(std::fs::metadata(&path).unwrap().len() > 100);
    let _ = std::fs::remove_file(path);
}

/// On the simulated device the timeline is virtual time: the same program gives the
/// same slices, bit for bit.
#[test]
fn sim_timelines_are_deterministic() {
    let run = || {
        let rt = Runtime::builder()
            .mode(Mode::Manual)
            .worker_threads(0)
            .sim(SimConfig::default())
            .timeline(true)
            .build();
        workload(&rt, 1);
        let t = rt.timeline().unwrap();
        t.slices
            .into_iter()
            .filter(|s| s.device == 1)
            .map(|s| (s.name, s.kind, s.start_ns, s.end_ns, s.preds.len()))
            .collect::<Vec<_>>()
    };
    let first = run();
    assert!(first.len() >= 9, "{first:?}");
    assert_eq!(first, run());
}

#[test]
fn no_timeline_unless_asked() {
    let rt = Runtime::new();
    assert!(rt.timeline().is_none() && rt.chrome_trace().is_none());
    assert!(rt.write_chrome_trace(std::env::temp_dir().join("never.json")).is_err());
}
