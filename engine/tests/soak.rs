//! Soak: memory stays flat under sustained use. Ten million commands, a hundred
//! thousand queues created, used and dropped, and a hundred thousand distinct fusions
//! (each over another range, so each misses the plan cache). After a warm-up round,
//! the process's resident memory and the scheduler's entity count must not grow with
//! the number of rounds.
//!
//! Minutes of work, so ignored by default; CI runs it with
//! `cargo test --release -p gantry --test soak -- --ignored`.

use gantry::{FusionProps, Runtime};

/// Resident memory is the process's: the soaks take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Waits for the other soaks to finish, runtime teardown included.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Resident memory of this process, in bytes (Linux), after glibc's allocator has
/// returned the free memory it keeps to the system: a leak stays resident, freed
/// memory that the allocator would reuse does not count.
fn resident_bytes() -> usize {
    trim();
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Returns the free memory glibc's allocator keeps to the system.
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only releases free memory; no pointer is invalidated.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Entities alive in the scheduler's world (counted by a query: the entity
/// allocator's own count includes ids it has reserved in bulk).
fn entities(rt: &Runtime) -> u32 {
    rt.with_world(|w| w.query::<gantry::ecs::entity::Entity>().iter(w).count() as u32)
}

/// Runs `round` `rounds` times after a warm-up of a fifth as many (at least one:
/// allocators and the world's tables reach their working size); returns the growth
/// of resident memory and of the scheduler's entities from after the warm-up to the
/// end.
fn growth(rt: &Runtime, rounds: usize, mut round: impl FnMut(usize)) -> (isize, i64) {
    for r in 0..(rounds / 5).max(1) {
        round(r);
    }
    rt.wait_idle().unwrap();
    let (mem, ents) = (resident_bytes(), entities(rt));
    for r in 1..=rounds {
        round(r);
    }
    rt.wait_idle().unwrap();
    let grown = (resident_bytes() as isize - mem as isize, i64::from(entities(rt)) - i64::from(ents));
    eprintln!("after {rounds} rounds: resident memory {:+} KiB, entities {:+}", grown.0 / 1024, grown.1);
    grown
}

const MIB: isize = 1 << 20;

#[test]
#[ignore = "a soak: run with --ignored"]
fn ten_million_commands_keep_memory_flat() {
    let _turn = turn();
    let rt = Runtime::new();
    let q = rt.queue();
    let buf = rt.buffer_zeroed::<u32>(64);
    // 100 rounds of 100,000 commands: fills, kernels and barriers.
    let (mem, ents) = growth(&rt, 99, |r| {
        for i in 0..100_000u32 {
            match i % 3 {
                0 => drop(q.submit(|cg| cg.fill(&buf, i)).unwrap()),
                1 => drop(
                    q.submit(|cg| {
                        let b = cg.elements_mut(&buf);
                        cg.parallel_for(64, move |it| *b.elem(it) += 1);
                    })
                    .unwrap(),
                ),
                _ => drop(q.barrier().unwrap()),
            }
        }
        if r % 10 == 0 {
            q.wait().unwrap();
        }
    });
    assert!(mem < 64 * MIB, "resident memory grew by {} MiB", mem / MIB);
    assert!(ents <= 0, "{ents} more entities");
}

#[test]
#[ignore = "a soak: run with --ignored"]
fn a_hundred_thousand_queues_keep_memory_flat() {
    let _turn = turn();
    let rt = Runtime::new();
    let buf = rt.buffer_zeroed::<u32>(4);
    let (mem, ents) = growth(&rt, 10, |_| {
        for _ in 0..10_000 {
            let q = rt.in_order_queue();
            q.submit(|cg| cg.fill(&buf, 1)).unwrap();
        }
    });
    // The allocator's working set for queue churn settles near 18 MiB whatever the
    // number of rounds (docs/PERFORMANCE.md, "Soak limits"); a leak of a queue's
    // scheduler state is caught exactly by the entity count.
    assert!(mem < 32 * MIB, "resident memory grew by {} MiB", mem / MIB);
    assert!(ents <= 0, "{ents} more entities");
}

#[test]
#[ignore = "a soak: run with --ignored"]
fn a_hundred_thousand_distinct_fusions_keep_memory_flat() {
    let _turn = turn();
    // Every window fuses, small ones too (the CPU driver would run them unfused).
    let rt = Runtime::builder().fusion_warnings(0).fusion_window(gantry::WindowThresholds::ALWAYS).build();
    let q = rt.in_order_queue();
    let buf = rt.buffer_zeroed::<u32>(1 << 17);
    let mut n = 0usize;
    let (mem, ents) = growth(&rt, 9, |_| {
        for _ in 0..10_000 {
            n += 1;
            let len = 1 + n % (1 << 17);
            q.start_fusion().unwrap();
            for _ in 0..2 {
                q.submit(|cg| {
                    let b = cg.elements::<u32, gantry::ReadWrite>(&buf, ..len);
                    cg.parallel_for(len, move |it| *b.elem(it) += 1);
                })
                .unwrap();
            }
            q.complete_fusion(FusionProps::default()).unwrap();
        }
        q.wait().unwrap();
    });
    let stats = rt.fusion_cache_stats().unwrap();
    assert!(stats.len <= gantry::ClosureFusion::DEFAULT_CAPACITY, "{stats:?}");
    assert!(stats.evictions > 0, "{stats:?}");
    assert!(mem < 32 * MIB, "resident memory grew by {} MiB", mem / MIB);
    assert!(ents <= 0, "{ents} more entities");
}
