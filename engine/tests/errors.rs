//! Bad input is a typed error from `submit`, never a panic or a hang, and nothing runs.

use gantry::{Error, NdRange, QueueOptions, Range, Runtime};
use gantry_driver::RangeError;

fn rt() -> Runtime {
    Runtime::new()
}

#[test]
fn zero_and_mismatched_ranges() {
    let rt = rt();
    let q = rt.queue();
    let e = q.submit(|cg| cg.parallel_for(0, |_| {})).unwrap_err();
    assert_eq!(e, Error::Range(RangeError::ZeroExtent { dim: 0 }));
    let e = q.submit(|cg| cg.parallel_for(Range::d2(4, 0), |_| {})).unwrap_err();
    assert_eq!(e, Error::Range(RangeError::ZeroExtent { dim: 1 }));
    let e = q.submit(|cg| cg.parallel_for_nd(NdRange::new(10, 4), |_| {})).unwrap_err();
    assert_eq!(e, Error::Range(RangeError::LocalDoesNotDivide { dim: 0, global: 10, local: 4 }));
    let e = q.submit(|cg| cg.parallel_for_nd(NdRange::new([8, 8], 8), |_| {})).unwrap_err();
    assert_eq!(e, Error::Range(RangeError::DimensionMismatch { global: 2, local: 1 }));
    let e = q.submit(|cg| cg.parallel_for(Range::d3(usize::MAX, 2, 2), |_| {})).unwrap_err();
    assert_eq!(e, Error::Range(RangeError::Overflow));
    assert_eq!(rt.stats().submitted, 0);
}

#[test]
fn out_of_bounds_accessors_and_copies() {
    let rt = rt();
    let q = rt.queue();
    let a = rt.buffer_zeroed::<u32>(8);
    let b = rt.buffer_zeroed::<u32>(4);
    let id = a.id();
    let e = q.submit(|cg| {
        cg.access::<u32, gantry::Read>(&a, 4..9);
    });
    assert_eq!(e.unwrap_err(), Error::OutOfBounds { what: "accessor", buffer: id, start: 4, end: 9, len: 8 });
    let e = q.submit(|cg| cg.copy_range(&a, 6, &b, 0, 4)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { what: "copy source", start: 6, end: 10, .. }));
    let e = q.submit(|cg| cg.copy_range(&a, 0, &b, 2, 4)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { what: "copy destination", .. }));
    let e = q.submit(|cg| cg.copy(&a, &b)).unwrap_err();
    assert_eq!(e, Error::LengthMismatch { src: 8, dst: 4 });
    let e = q.submit(|cg| cg.copy_from_host(&[1u32; 5], &b, 0)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { what: "copy destination", .. }));
    #[allow(clippy::reversed_empty_ranges)] // on purpose: bad input
    let e = q.submit(|cg| cg.fill_range(&b, 3..2, 1)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { what: "fill", .. }));
    let e = q.submit(|cg| cg.fill_range(&b, 2..2, 1)).unwrap_err();
    assert!(matches!(e, Error::EmptyRange { what: "fill", .. }));
    let out = gantry::Readback::new();
    let e = q.submit(|cg| cg.copy_to_host(&a, 0..=8, &out)).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { what: "copy source", end: 9, .. }));
    assert_eq!(out.take(), None);
    assert_eq!(rt.stats().submitted, 0);
}

#[test]
fn accessor_conflicts_inside_one_group() {
    let rt = rt();
    let q = rt.queue();
    let a = rt.buffer_zeroed::<u32>(8);
    let id = a.id();
    let e = q.submit(|cg| {
        cg.read(&a);
        cg.write(&a);
    });
    assert_eq!(e.unwrap_err(), Error::AccessorConflict { buffer: id, first: 0, second: 1 });
    let e = q.submit(|cg| cg.copy_range(&a, 0, &a, 2, 4)).unwrap_err();
    assert!(matches!(e, Error::AccessorConflict { .. }));
    // Two readers, or disjoint ranges, are fine.
    q.submit(|cg| {
        cg.read(&a);
        cg.read(&a);
    })
    .unwrap();
    q.submit(|cg| cg.copy_range(&a, 0, &a, 4, 4)).unwrap().wait().unwrap();
}

#[test]
fn one_action_per_group() {
    let rt = rt();
    let q = rt.queue();
    let a = rt.buffer_zeroed::<u32>(8);
    let e = q.submit(|cg| {
        cg.fill(&a, 1);
        cg.single_task(|_| {});
    });
    assert_eq!(e.unwrap_err(), Error::MultipleActions { first: "fill", second: "kernel" });
    let e = q.submit(|cg| {
        cg.single_task(|_| {});
        cg.parallel_for_work_group(NdRange::new(4, 4)).phase(|_| {});
    });
    assert_eq!(e.unwrap_err(), Error::MultipleActions { first: "kernel", second: "kernel" });
    let e = q.submit(|cg| {
        cg.parallel_for_work_group(NdRange::new(4, 4));
    });
    assert!(matches!(e.unwrap_err(), Error::NoPhases(_)));
}

#[test]
fn kernel_shape_rules() {
    let rt = rt();
    let q = rt.queue();
    let a = rt.buffer_zeroed::<u32>(8);
    let id = a.id();
    let e = q.submit(|cg| {
        let out = cg.elements_out(&a);
        cg.parallel_for(4, move |it| *out.elem(it) = 1);
    });
    assert_eq!(e.unwrap_err(), Error::ElementAccessorSize { buffer: id, len: 8, global: 4 });
    let e = q.submit(|cg| {
        let l = cg.local::<u32>(4);
        cg.parallel_for(4, move |it| l.set(it, 0, 1));
    });
    assert_eq!(e.unwrap_err(), Error::LocalMemoryNeedsNdRange);
    let e = q.submit(|cg| {
        let l = cg.local::<u64>(1 << 20);
        cg.parallel_for_nd(NdRange::new(4, 4), move |it| l.set(it, 0, 1));
    });
    assert!(matches!(e.unwrap_err(), Error::LocalMemoryTooLarge { requested, .. } if requested == 8 << 20));
}

#[test]
fn foreign_objects_and_devices() {
    let (rt1, rt2) = (rt(), rt());
    let a = rt1.buffer_zeroed::<u32>(4);
    let q2 = rt2.queue();
    let e = q2.submit(|cg| cg.fill(&a, 1)).unwrap_err();
    assert_eq!(e, Error::ForeignObject("a buffer"));
    let ev = rt1.queue().submit(|cg| cg.fill(&a, 1)).unwrap();
    let e = q2.submit(|cg| {
        cg.depends_on(&ev);
    });
    assert_eq!(e.unwrap_err(), Error::ForeignObject("an event"));
    assert_eq!(
        rt1.queue_with(QueueOptions { device: 7, in_order: false }).err(),
        Some(Error::UnknownDevice(7))
    );
}

#[test]
fn errors_name_the_problem() {
    let msg = Error::Range(RangeError::LocalDoesNotDivide { dim: 1, global: 10, local: 3 }).to_string();
    assert_eq!(msg, "invalid range: local size 3 does not divide global size 10 in dimension 1");
    let msg = Error::AccessorConflict { buffer: 3, first: 0, second: 2 }.to_string();
    assert!(msg.contains("overlap on buffer 3"));
}
