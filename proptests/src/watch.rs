//! Hang detection: a run on a helper thread with a timeout ([`hang_timeout`]), and a
//! report of where it is blocked and what the scheduler still holds ([`dump_world`]).

use gantry::Runtime;

use crate::model::Outcome;
use crate::runner::{Config, Session};

/// How long [`check`](crate::check) lets one program run before it reports a hang: 10 s (programs
/// take milliseconds), or `GANTRY_PROPTEST_TIMEOUT_MS` milliseconds.
pub fn hang_timeout() -> std::time::Duration {
    let ms = std::env::var("GANTRY_PROPTEST_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(10_000);
    std::time::Duration::from_millis(ms)
}

/// Runs a session on a helper thread: `start` builds it, `run` drives it to its
/// outcome. A run that takes longer than `timeout` is reported as a hang naming the
/// step it is blocked in, the live commands and `context()` (the helper thread and
/// its runtime are leaked).
pub(crate) fn run_watched(
    config: Config,
    timeout: std::time::Duration,
    thread: &str,
    start: impl FnOnce() -> Session + Send + 'static,
    run: impl FnOnce(Session) -> Result<Outcome, String> + Send + 'static,
    context: impl FnOnce() -> String,
) -> Result<Outcome, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (rt_tx, rt_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let s = start();
                let progress = s.progress_handle();
                let _ = rt_tx.send((s.runtime_handle(), progress.clone()));
                let out = run(s);
                *progress.lock().unwrap_or_else(|e| e.into_inner()) = "dropping the runtime".into();
                out
            }));
            let _ = tx.send(result.unwrap_or_else(|e| Err(format!("panicked: {}", panic_text(&*e)))));
        })
        .expect("spawn");
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(_) => {
            let Ok((rt, progress)) = rt_rx.try_recv() else {
                return Err(format!("{config:?}: hang: building the runtime took over {timeout:?}"));
            };
            let at = progress.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let world = dump_world(&rt);
            let stats = rt.stats();
            let diagnosis = if stats.live_commands == 0 && stats.in_driver == 0 {
                "\nnothing is left in the scheduler: the blocked call waits for an event that has already \
                 finished (a lost wakeup, see regressions::event_wait_never_misses_completion)"
            } else {
                ""
            };
            Err(format!(
                "{config:?}: hang: blocked for {timeout:?} in {at}{diagnosis}\nlive commands:\n{world}{}",
                context()
            ))
        }
    }
}

/// The scheduler's live commands (kind, name, device, status, blockers, predecessors
/// and successors by sequence number) and counters, for hang reports.
pub fn dump_world(rt: &Runtime) -> String {
    use gantry::components::{Command, CommandKind, Edges, Execution};
    use gantry::ecs::entity::Entity;
    rt.with_world(|w| {
        let mut q = w.query::<(Entity, &Command, &Edges, &Execution)>();
        // User commands (host accesses and barriers included) by sequence number,
        // memory moves by entity.
        let label_of: std::collections::HashMap<Entity, String> = q
            .iter(w)
            .map(|(e, c, _, _)| {
                (
                    e,
                    if c.kind == CommandKind::MemoryMove {
                        format!("move {e}")
                    } else {
                        format!("seq {}", c.seq)
                    },
                )
            })
            .collect();
        let label = |e: &Entity| label_of.get(e).cloned().unwrap_or_else(|| format!("gone {e}"));
        let mut rows: Vec<((u64, bool), String)> = Vec::new();
        for (e, c, ed, x) in q.iter(w) {
            let preds: Vec<String> = ed.preds.iter().map(label).collect();
            let succs: Vec<String> = ed
                .succs
                .iter()
                .map(|s| format!("{}{}", label(&s.entity), if s.on_submit { " (on submit)" } else { "" }))
                .collect();
            rows.push((
                (c.seq, c.kind == CommandKind::MemoryMove),
                format!(
                    "  {} {:?} `{}` device {} {:?}, event {:?}, blockers {}, preds [{}], succs [{}]",
                    label(&e),
                    c.kind,
                    c.name,
                    c.device,
                    x.status,
                    x.event.status(),
                    ed.blockers,
                    preds.join(", "),
                    succs.join(", ")
                ),
            ));
        }
        rows.sort_by_key(|r| r.0);
        let stats = *w.resource::<gantry::Stats>();
        rows.into_iter().map(|r| r.1).chain([format!("  {stats:?}")]).collect::<Vec<_>>().join("\n")
    })
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}
