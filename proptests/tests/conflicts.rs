//! Accessor conflicts inside one command group.
//!
//! A command group whose accessors overlap on a buffer, one of them writing, must be
//! refused at `submit` with `Error::AccessorConflict` naming the buffer and the first
//! conflicting pair of slots (in declaration order), and nothing may run; any other
//! combination (disjoint ranges, overlapping reads) must be accepted and run. The
//! runtime stays usable after a refusal.
//!
//! `GANTRY_PROPTEST_CASES` sets the number of cases (see `tests/model.rs`).

mod common;

use gantry::{AccessMode, DiscardWrite, Error, Read, ReadWrite, Runtime, Write};
use proptest::prelude::*;

const CASES: u32 = 1000;
const MARK: u32 = 0xC0FFEE;

#[derive(Clone, Copy, Debug)]
struct Acc {
    buf: usize,
    start: usize,
    end: usize,
    mode: AccessMode,
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Kernel,
    HostTask,
}

fn mode() -> impl Strategy<Value = AccessMode> {
    prop_oneof![
        Just(AccessMode::Read),
        Just(AccessMode::Write),
        Just(AccessMode::ReadWrite),
        Just(AccessMode::DiscardWrite)
    ]
}

/// Two buffers of 1..=12 elements and 2..=4 accessors on them.
fn group() -> impl Strategy<Value = ([usize; 2], Vec<Acc>, Action)> {
    let action = prop_oneof![Just(Action::Kernel), Just(Action::HostTask)];
    (
        (1..=12usize, 1..=12usize),
        proptest::collection::vec((0..2usize, 0..12usize, 0..12usize, mode()), 2..=4),
        action,
    )
        .prop_map(|((l0, l1), raw, action)| {
            let lens = [l0, l1];
            let accs = raw
                .into_iter()
                .map(|(buf, a, n, mode)| {
                    let start = a % lens[buf];
                    let end = start + 1 + n % (lens[buf] - start);
                    Acc { buf, start, end, mode }
                })
                .collect();
            (lens, accs, action)
        })
}

/// The first pair of slots that must be refused.
fn expected_conflict(accs: &[Acc]) -> Option<(usize, usize)> {
    for i in 0..accs.len() {
        for j in i + 1..accs.len() {
            let (a, b) = (&accs[i], &accs[j]);
            if a.buf == b.buf && a.start < b.end && b.start < a.end && (a.mode.writes() || b.mode.writes()) {
                return Some((i, j));
            }
        }
    }
    None
}

/// A kernel or host-task accessor, writing `MARK` to every element when it can write.
enum Declared {
    Kernel(Box<dyn Fn(&mut gantry::Item<'_>) + Send + Sync>),
    Host(Box<dyn FnMut(&gantry::HostCtx<'_>) + Send>),
}

/// Declares accessor `$a` of mode `$m` on `$buf` for `$action` (the accessor mode
/// trait is not exported, so no generic function can do this).
macro_rules! declare {
    ($cg:expr, $buf:expr, $a:expr, $action:expr, $m:ty, $write:expr, $host_write:expr) => {
        match $action {
            Action::Kernel => {
                let acc = $cg.access::<u32, $m>($buf, $a.start..$a.end);
                Declared::Kernel(Box::new(move |it| $write(&acc, it)))
            }
            Action::HostTask => {
                let mut acc = $cg.host_access::<u32, $m>($buf, $a.start..$a.end);
                Declared::Host(Box::new(move |ctx| $host_write(&mut acc, ctx)))
            }
        }
    };
}

macro_rules! writers {
    ($kernel:ident, $host:ident, $m:ty) => {
        fn $kernel(acc: &gantry::Accessor<u32, $m>, it: &gantry::Item<'_>) {
            for i in 0..acc.len() {
                acc.set(it, i, MARK);
            }
        }
        fn $host(acc: &mut gantry::HostAccessor<u32, $m>, ctx: &gantry::HostCtx<'_>) {
            acc.as_mut_slice(ctx).fill(MARK);
        }
    };
}
writers!(kernel_w, host_w, Write);
writers!(kernel_rw, host_rw, ReadWrite);
writers!(kernel_d, host_d, DiscardWrite);

fn kernel_r(acc: &gantry::Accessor<u32, Read>, it: &gantry::Item<'_>) {
    let _ = acc.get(it, 0);
}
fn host_r(acc: &mut gantry::HostAccessor<u32, Read>, ctx: &gantry::HostCtx<'_>) {
    let _ = acc.as_slice(ctx)[0];
}

fn run(lens: [usize; 2], accs: &[Acc], action: Action) -> Result<(), TestCaseError> {
    let rt = Runtime::builder().mode(gantry::Mode::Manual).worker_threads(0).host_threads(0).build();
    let init: Vec<Vec<u32>> = lens.iter().map(|&l| (0..l as u32).collect()).collect();
    let bufs: Vec<_> = init.iter().map(|v| rt.buffer(v)).collect();
    let q = rt.queue();
    let result = q.submit(|cg| {
        let parts: Vec<Declared> = accs
            .iter()
            .map(|a| {
                let b = &bufs[a.buf];
                match a.mode {
                    AccessMode::Read => declare!(cg, b, a, action, Read, kernel_r, host_r),
                    AccessMode::Write => declare!(cg, b, a, action, Write, kernel_w, host_w),
                    AccessMode::ReadWrite => declare!(cg, b, a, action, ReadWrite, kernel_rw, host_rw),
                    AccessMode::DiscardWrite => declare!(cg, b, a, action, DiscardWrite, kernel_d, host_d),
                }
            })
            .collect();
        match action {
            Action::Kernel => {
                let ks: Vec<_> = parts
                    .into_iter()
                    .map(|p| if let Declared::Kernel(k) = p { k } else { unreachable!() })
                    .collect();
                cg.single_task(move |it| ks.iter().for_each(|k| k(it)));
            }
            Action::HostTask => {
                let mut hs: Vec<_> = parts
                    .into_iter()
                    .map(|p| if let Declared::Host(h) = p { h } else { unreachable!() })
                    .collect();
                cg.host_task(move |ctx| hs.iter_mut().for_each(|h| h(ctx)));
            }
        }
    });
    let mut expect = init.clone();
    match expected_conflict(accs) {
        Some((first, second)) => {
            let buffer = bufs[accs[first].buf].id();
            prop_assert_eq!(result.err(), Some(Error::AccessorConflict { buffer, first, second }));
        }
        None => {
            prop_assert!(result.is_ok(), "refused: {:?}", result.err());
            result.unwrap().wait().map_err(|e| TestCaseError::fail(format!("failed: {e}")))?;
            for a in accs.iter().filter(|a| a.mode.writes()) {
                expect[a.buf][a.start..a.end].fill(MARK);
            }
        }
    }
    // Nothing ran after a refusal, and the runtime still works.
    for (b, e) in bufs.iter().zip(&expect) {
        prop_assert_eq!(&b.to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?, e);
    }
    q.submit(|cg| cg.fill(&bufs[0], 1)).map_err(|e| TestCaseError::fail(e.to_string()))?.wait().unwrap();
    prop_assert_eq!(bufs[0].to_vec().unwrap(), vec![1; lens[0]]);
    Ok(())
}

proptest! {
    #![proptest_config(common::config(CASES))]

    #[test]
    fn conflicting_accessors_are_refused((lens, accs, action) in group()) {
        run(lens, &accs, action)?;
    }

    /// A copy within one buffer: refused exactly when source and destination overlap.
    #[test]
    fn copy_within_a_buffer(len in 2..=24usize, so in 0..24usize, dof in 0..24usize, n in 1..=12usize) {
        let n = 1 + (n - 1) % (len / 2 + 1).min(len);
        let (so, dof) = (so % (len - n + 1), dof % (len - n + 1));
        let rt = Runtime::builder().mode(gantry::Mode::Manual).worker_threads(0).build();
        let init: Vec<u32> = (0..len as u32).collect();
        let b = rt.buffer(&init);
        let r = rt.queue().submit(|cg| cg.copy_range(&b, so, &b, dof, n));
        let mut expect = init.clone();
        if so < dof + n && dof < so + n {
            prop_assert_eq!(r.err(), Some(Error::AccessorConflict { buffer: b.id(), first: 0, second: 1 }));
        } else {
            r.map_err(|e| TestCaseError::fail(e.to_string()))?.wait().unwrap();
            expect.copy_within(so..so + n, dof);
        }
        prop_assert_eq!(b.to_vec().unwrap(), expect);
    }
}
