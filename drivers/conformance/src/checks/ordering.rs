//! Ordering: an operation starts after everything in its wait-list ended and sees
//! what it wrote; independent operations each complete exactly once, in whatever
//! order the driver finishes them.
//!
//! Where the driver has in-driver waits, a whole dependent batch is handed over
//! before any of it completes, so the driver orders it itself; otherwise the harness
//! submits each operation once its dependencies completed. Dependencies are made
//! larger than their dependents where that helps: a driver that ignored a wait-list
//! would finish the small dependent first.

use gantry_driver::AccessMode::{Read, ReadWrite, Write};
use gantry_driver::{Completion, MemArg};

use super::{copy, fill, fill_u32};
use crate::harness::{Factory, Harness, Ticket};
use crate::kernels;
use crate::Outcome;

/// What a dependent must see of its dependency's start and end: it starts no
/// earlier than the dependency ended.
fn assert_after(h: &Harness, before: (&Ticket, &Completion), after: (&Ticket, &Completion)) {
    assert!(
        after.1.started_ns >= before.1.ended_ns,
        "{}: {} waits on {} but started at {} ns, before it ended at {} ns",
        h.name(),
        after.0.label(),
        before.0.label(),
        after.1.started_ns,
        before.1.ended_ns
    );
}

/// Read after write, write after read, across kinds of operation: A writes `x` (a
/// large kernel, or a fill where the driver runs no kernels); B waits on A and
/// derives a small `y` from the start of `x`; C waits on B and copies `y` to `z`; D
/// waits on C and overwrites `y`. `z` must hold what B computed from A's values, `y`
/// D's, and each must start no earlier than its dependency ended.
pub fn wait_list_order(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    const BIG: usize = 1 << 14;
    const SMALL: usize = 256;
    const A: u32 = 0x0A0A;
    let (x, y, z) = (h.alloc(BIG * 4), h.alloc(SMALL * 4), h.alloc(SMALL * 4));
    let x_head = MemArg { mem: x.slice(0, SMALL * 4), mode: Read };
    let (a, b, expected) = if kernels::runnable(&h.caps()) {
        let a = h.submit(kernels::affine("conformance_writer", BIG, 0, A).launch([x.arg(Write)]), &[]);
        let derive = kernels::derive("conformance_reader", SMALL, kernels::Linear { a: 3, b: 0, c: 1 });
        let b = h.submit(derive.launch([x_head, y.arg(Write)]), &[&a]);
        (a, b, (0..SMALL as u32).map(|i| A * 3 + i).collect::<Vec<_>>())
    } else {
        let a = h.submit(fill_u32(&x, A), &[]);
        let b = h.submit(copy(x_head.mem, y.whole()), &[&a]);
        (a, b, vec![A; SMALL])
    };
    let c = h.submit(copy(y.whole(), z.whole()), &[&b]);
    let d = h.submit(fill_u32(&y, u32::MAX), &[&c]);
    let done: Vec<Completion> = [&a, &b, &c, &d].iter().map(|t| h.expect_ok(t)).collect();
    let got = h.download_u32(&z);
    if got != expected {
        let i = (0..SMALL).find(|&i| got[i] != expected[i]).expect("a difference");
        panic!(
            "{}: z[{i}] is {:#x}, expected {:#x}: A ({}) -> B ({}) -> C ({}) -> D ({}), each \
             waiting on the one before, did not run in that order (a later one read before the \
             one it waits on wrote, or overwrote what it read)",
            h.name(),
            got[i],
            expected[i],
            a.label(),
            b.label(),
            c.label(),
            d.label()
        );
    }
    let y_now = h.download_u32(&y);
    assert!(
        y_now.iter().all(|&v| v == u32::MAX),
        "{}: {} waits on {} (which reads what it overwrites) but its writes were lost",
        h.name(),
        d.label(),
        c.label()
    );
    for (pair, ts) in done.windows(2).zip([(&a, &b), (&b, &c), (&c, &d)]) {
        assert_after(&h, (ts.0, &pair[0]), (ts.1, &pair[1]));
    }
    h.finish()
}

/// A chain of 16 dependent kernels, submitted at once where the driver waits
/// in-driver, that pass data back and forth between two buffers: link `k` reads one
/// in reverse and writes `3x + k + 1` to the other (so each link reads what the one
/// before wrote last, and overwrites what it read), alternately over all of them and
/// over their first eighth. Both buffers must hold the serial result, and each link
/// must start no earlier than the previous one ended. Without kernels, a chain of
/// copies carries a fill from region to region instead.
pub fn dependent_chain(factory: &Factory) -> Outcome {
    const LINKS: usize = 16;
    let mut h = Harness::new(factory);
    let mut tickets: Vec<Ticket> = Vec::new();
    let (bufs, expected) = if kernels::runnable(&h.caps()) {
        let n = 4096;
        let mut model: [Vec<u32>; 2] = [(0..n as u32).collect(), vec![0; n]];
        let bufs = [h.buffer_u32(&model[0]), h.alloc(n * 4)];
        for k in 0..LINKS {
            let (from, to) = (k % 2, (k + 1) % 2);
            let len = if k % 2 == 0 { n } else { n / 8 };
            let b = k as u32 + 1;
            let link = kernels::reverse_affine(&format!("conformance_link_{k}"), len, 3, b);
            let args = [
                MemArg { mem: bufs[from].slice(0, len * 4), mode: Read },
                MemArg { mem: bufs[to].slice(0, len * 4), mode: Write },
            ];
            let deps: Vec<&Ticket> = tickets.last().into_iter().collect();
            tickets.push(h.submit(link.launch(args), &deps));
            let src = model[from].clone();
            for (i, v) in model[to][..len].iter_mut().enumerate() {
                *v = src[len - 1 - i].wrapping_mul(3).wrapping_add(b);
            }
        }
        (bufs.into_iter().collect::<Vec<_>>(), model.concat())
    } else {
        const REGION: usize = 64; // u32s
        let x = h.alloc((LINKS + 1) * REGION * 4);
        let region = |k: usize| x.slice(k * REGION * 4, REGION * 4);
        tickets.push(h.submit(fill(region(0), &0xC4A1_u32.to_ne_bytes()), &[]));
        for k in 1..=LINKS {
            let deps = [tickets.last().expect("the fill")];
            let t = h.submit(copy(region(k - 1), region(k)), &deps);
            tickets.push(t);
        }
        (vec![x], vec![0xC4A1; (LINKS + 1) * REGION])
    };
    let done: Vec<Completion> = tickets.iter().map(|t| h.expect_ok(t)).collect();
    let got: Vec<u32> = bufs.iter().flat_map(|b| h.download_u32(b)).collect();
    if let Some(i) = (0..expected.len()).find(|&i| got[i] != expected[i]) {
        panic!(
            "{}: a chain of {} dependent operations is not the serial result: element {i} is {:#x}, \
             expected {:#x} (a link ran before the one it waits on, or twice, or not at all)",
            h.name(),
            tickets.len(),
            got[i],
            expected[i]
        );
    }
    for (k, pair) in done.windows(2).enumerate() {
        assert_after(&h, (&tickets[k], &pair[0]), (&tickets[k + 1], &pair[1]));
    }
    h.finish()
}

/// 48 independent operations (kernels of different sizes, fills, markers), each on
/// its own region of one buffer and with an id of its own: each completes exactly
/// once under its id (the harness fails a second report, a report of an unknown id
/// or one missing at the deadline), successfully, and each region holds what its
/// operation alone computes.
pub fn independent_ops_complete_once(factory: &Factory) -> Outcome {
    const OPS: usize = 48;
    const REGION: usize = 512; // u32s
    let mut h = Harness::new(factory);
    let kernels = kernels::runnable(&h.caps());
    let mut model: Vec<u32> = (0..(OPS * REGION) as u32).collect();
    let buf = h.buffer_u32(&model);
    let mut tickets = Vec::new();
    for k in 0..OPS {
        let at = k * REGION;
        let op = match k % 3 {
            0 if kernels => {
                let len = REGION >> (k % 4);
                for v in &mut model[at..at + len] {
                    *v = v.wrapping_add(k as u32);
                }
                let kernel = kernels::affine(&format!("conformance_independent_{k}"), len, 1, k as u32);
                kernel.launch([MemArg { mem: buf.slice(at * 4, len * 4), mode: ReadWrite }])
            }
            0 | 1 => {
                let value = 0x1000_0000 | k as u32;
                model[at..at + REGION].fill(value);
                fill(buf.slice(at * 4, REGION * 4), &value.to_ne_bytes())
            }
            _ => gantry_driver::DeviceOp::Marker,
        };
        tickets.push(h.submit(op, &[]));
    }
    h.settle();
    for t in &tickets {
        h.expect_ok(t);
    }
    let got = h.download_u32(&buf);
    if let Some(i) = (0..model.len()).find(|&i| got[i] != model[i]) {
        panic!(
            "{}: independent operations computed the wrong thing: element {i} (region {}) is {:#x}, \
             expected {:#x}",
            h.name(),
            i / REGION,
            got[i],
            model[i]
        );
    }
    h.finish()
}
