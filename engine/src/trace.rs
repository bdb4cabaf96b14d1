//! Chrome trace (Perfetto) output of a recorded [`Timeline`].
//!
//! One process per device, one thread track per driver lane (the submitting thread,
//! worker threads, host threads, engines), one complete slice per command with its
//! name, kind, queue and id, and a flow arrow from each predecessor to each dependent.
//! Timestamps are microseconds on each device's clock: real time for the CPU,
//! virtual time for the simulated device.

use std::collections::{BTreeSet, HashMap};

use gantry_components::{Slice, Timeline};
use gantry_driver::DeviceInfo;
use serde_json::{json, Value};

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

fn lane_name(lane: u32) -> String {
    if lane == 0 {
        "submitting thread".to_owned()
    } else {
        format!("lane {lane}")
    }
}

/// Builds the trace JSON.
pub(crate) fn chrome_trace(timeline: &Timeline, devices: &[DeviceInfo]) -> String {
    let mut events: Vec<Value> = Vec::with_capacity(timeline.slices.len() * 2 + devices.len());
    for (d, info) in devices.iter().enumerate() {
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": d,
            "args": { "name": format!("device {d}: {} ({:?})", info.name, info.kind) },
        }));
    }
    let tracks: BTreeSet<(u32, u32)> = timeline.slices.iter().map(|s| (s.device, s.lane)).collect();
    for (device, lane) in tracks {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": device, "tid": lane,
            "args": { "name": lane_name(lane) },
        }));
    }
    let by_id: HashMap<u64, &Slice> = timeline.slices.iter().map(|s| (s.id, s)).collect();
    let mut flow = 0u64;
    for s in &timeline.slices {
        let mut args =
            json!({ "id": s.id, "kind": s.kind.name(), "queue": s.queue, "preds": s.preds.as_slice() });
        if let Some(e) = &s.error {
            args["error"] = json!(e);
        }
        events.push(json!({
            "name": &*s.name, "cat": s.kind.name(), "ph": "X",
            "ts": us(s.start_ns), "dur": us(s.end_ns.saturating_sub(s.start_ns)),
            "pid": s.device, "tid": s.lane, "args": args,
        }));
        for p in s.preds.iter().filter_map(|p| by_id.get(p)) {
            flow += 1;
            // The start binds to the predecessor's slice, the end to this one.
            events.push(json!({
                "name": "dependency", "cat": "dependency", "ph": "s", "id": flow,
                "pid": p.device, "tid": p.lane, "ts": us(p.start_ns),
            }));
            events.push(json!({
                "name": "dependency", "cat": "dependency", "ph": "f", "bp": "e", "id": flow,
                "pid": s.device, "tid": s.lane, "ts": us(s.start_ns),
            }));
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ns" }).to_string()
}
