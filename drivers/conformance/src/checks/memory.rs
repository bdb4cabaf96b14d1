//! Memory: copies between host memory and the driver's memory and within it, fills
//! with every pattern width, operations that do not fit their memory, and
//! allocations the device cannot hold.
//!
//! "Device memory" is a device allocation where the driver has memory of its own,
//! and host memory where it shares it (it is then never asked to allocate).

use std::panic::{catch_unwind, AssertUnwindSafe};

use gantry_driver::AccessMode::{Read, ReadWrite};
use gantry_driver::{panic_message, MemArg, MemSlice};

use super::{copy, expect_typed_error, fill};
use crate::harness::{host_storage, Factory, Harness};
use crate::kernels;
use crate::Outcome;

/// Deterministic bytes that differ from their neighbours.
fn noise(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Panics naming the first byte where `got` differs from `expected`.
fn assert_bytes(h: &Harness, got: &[u8], expected: &[u8], what: &str) {
    assert_eq!(got.len(), expected.len(), "{}: {what}: lengths differ", h.name());
    if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
        panic!("{}: {what}: byte {i} is {:#04x}, expected {:#04x}", h.name(), got[i], expected[i]);
    }
}

/// Host → device → host, of an odd number of bytes at an offset inside the device
/// memory, the second copy waiting on the first: the bytes come back whole, and the
/// device memory around the copied range stays zero. Then the same at odd offsets on
/// both sides, into host memory whose other bytes stay zero.
pub fn copy_round_trip(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    const LEN: usize = 4099;
    let data = noise(LEN, 1);
    let src = host_storage(&data);
    let dev = h.alloc(LEN + 64);
    let back = host_storage(&[0; LEN]);
    let up = h.submit(copy(MemSlice::host(src.clone()), dev.slice(32, LEN)), &[]);
    let down = h.submit(copy(dev.slice(32, LEN), MemSlice::host(back.clone())), &[&up]);
    h.expect_ok(&down);
    let got = h.host_bytes(&back);
    assert_bytes(&h, &got, &data, "host -> device -> host");
    let mut expected = vec![0; LEN + 64];
    expected[32..32 + LEN].copy_from_slice(&data);
    let got = h.download(&dev);
    assert_bytes(&h, &got, &expected, "device memory after a copy into its middle");

    let dev2 = h.alloc(1024);
    let back2 = host_storage(&[0; 1024]);
    let slice = |s: &std::sync::Arc<gantry_driver::HostStorage>, at: usize| MemSlice {
        mem: gantry_driver::MemRef::Host(s.clone()),
        offset: at,
        len: 1001,
    };
    let up = h.submit(copy(slice(&src, 3), dev2.slice(1, 1001)), &[]);
    let down = h.submit(copy(dev2.slice(1, 1001), slice(&back2, 7)), &[&up]);
    h.expect_ok(&down);
    let mut expected = vec![0; 1024];
    expected[7..1008].copy_from_slice(&data[3..1004]);
    let got = h.host_bytes(&back2);
    assert_bytes(&h, &got, &expected, "host -> device -> host at odd offsets");
    h.finish()
}

/// Device → device: between two allocations at an offset, then within one
/// allocation between disjoint ranges and within the other, each copy waiting on the
/// ones whose bytes it reads or overwrites. Both allocations hold what the copies, in
/// that order, make of them.
pub fn copy_within_device_memory(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    let a_bytes = noise(4096, 2);
    let b_bytes = noise(4160, 3);
    let (a, b) = (h.buffer(&a_bytes), h.buffer(&b_bytes));
    let (mut a_model, mut b_model) = (a_bytes.clone(), b_bytes.clone());
    let across = h.submit(copy(a.slice(0, 4096), b.slice(64, 4096)), &[]);
    b_model[64..4160].copy_from_slice(&a_model[0..4096]);
    let within_a = h.submit(copy(a.slice(100, 500), a.slice(2000, 500)), &[&across]);
    a_model.copy_within(100..600, 2000);
    let within_b = h.submit(copy(b.slice(64, 64), b.slice(0, 64)), &[&across]);
    b_model.copy_within(64..128, 0);
    h.expect_ok(&within_a);
    h.expect_ok(&within_b);
    let got = h.download(&a);
    assert_bytes(&h, &got, &a_model, "the allocation copied from and within");
    let got = h.download(&b);
    assert_bytes(&h, &got, &b_model, "the allocation copied into and within");
    h.finish()
}

/// Fills with patterns of 1, 2, 4, 8 and 16 bytes (uniform and not), each at an
/// offset that is a multiple of its width and over a different number of
/// repetitions, into memory holding other bytes: each range holds its pattern
/// repeated, and every byte outside them is untouched.
pub fn fill_patterns(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    let mut model = vec![0x5A_u8; 1024];
    let buf = h.buffer(&model);
    for (j, width) in [1usize, 2, 4, 8, 16].into_iter().enumerate() {
        let pattern: Vec<u8> = (0..width).map(|b| (b as u8 + 1).wrapping_mul(17) ^ j as u8).collect();
        let (start, len) = (j * 192 + width, width * (5 + j));
        for (k, byte) in model[start..start + len].iter_mut().enumerate() {
            *byte = pattern[k % width];
        }
        let t = h.submit(fill(buf.slice(start, len), &pattern), &[]);
        h.expect_ok(&t);
    }
    let got = h.download(&buf);
    assert_bytes(&h, &got, &model, "memory after fills of 1- to 16-byte patterns");
    h.finish()
}

/// A fill whose length is not a whole number of its pattern (10 bytes of a 4-byte
/// pattern, 24 of a 16-byte one) or whose pattern is empty is refused or fails with
/// an [`ExecError`](gantry_driver::ExecError), never a panic, and under
/// `preserve_on_failure` writes nothing; a good fill runs after them.
pub fn fill_length_mismatch(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    let before = vec![0x33_u8; 64];
    let buf = h.buffer(&before);
    for (len, width) in [(10, 4), (24, 16), (16, 0)] {
        let pattern = vec![0xEE; width];
        let what = format!("a fill of {len} bytes with a {width}-byte pattern");
        expect_typed_error(&mut h, fill(buf.slice(8, len), &pattern), &what);
    }
    let got = h.download(&buf);
    assert_bytes(&h, &got, &before, "memory after refused fills");
    let good = h.submit(fill(buf.slice(0, 16), &[1, 2, 3, 4]), &[]);
    h.expect_ok(&good);
    h.finish()
}

/// Operations that do not fit their memory are refused or fail with an
/// [`ExecError`](gantry_driver::ExecError), never a panic or a write outside the
/// memory, and under `preserve_on_failure` write nothing: a copy between ranges of
/// different lengths, a copy from and a fill into a range past the end of its
/// memory, and (where the driver runs kernels) a kernel given fewer arguments than
/// it has buffer slots and one whose argument lies past the end of its memory.
pub fn malformed_ops_are_errors(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    let (a_bytes, b_bytes) = (noise(256, 4), noise(128, 5));
    let (a, b) = (h.buffer(&a_bytes), h.buffer(&b_bytes));
    expect_typed_error(&mut h, copy(a.slice(0, 256), b.slice(0, 128)), "a copy of 256 bytes into 128");
    expect_typed_error(
        &mut h,
        copy(a.slice(200, 100), b.slice(0, 100)),
        "a copy from bytes 200..300 of a 256-byte memory",
    );
    expect_typed_error(
        &mut h,
        fill(b.slice(64, 128), &[9, 9, 9, 9]),
        "a fill of bytes 64..192 of a 128-byte memory",
    );
    if kernels::runnable(&h.caps()) {
        let two_slots = kernels::derive("conformance_two_slots", 32, kernels::Linear { a: 1, b: 0, c: 0 });
        let one_arg = two_slots.launch([MemArg { mem: a.slice(0, 128), mode: Read }]);
        expect_typed_error(&mut h, one_arg, "a kernel with 2 buffer slots given 1 argument");
        let wide = kernels::affine("conformance_past_end", 64, 1, 1);
        let past = wide.launch([MemArg { mem: b.slice(0, 256), mode: ReadWrite }]);
        expect_typed_error(&mut h, past, "a kernel argument of bytes 0..256 of a 128-byte memory");
    }
    let got = h.download(&a);
    assert_bytes(&h, &got, &a_bytes, "memory after refused operations");
    let got = h.download(&b);
    assert_bytes(&h, &got, &b_bytes, "memory after refused operations");
    let good = h.submit(copy(a.slice(0, 128), b.slice(0, 128)), &[]);
    h.expect_ok(&good);
    h.finish()
}

/// Allocations the device cannot hold (`usize::MAX / 2` and `usize::MAX` bytes) are
/// typed errors, never a panic or an abort; the driver then still allocates, and
/// what it allocates reads as zeros. Only for drivers with memory of their own.
pub fn allocation_limits(factory: &Factory) -> Outcome {
    let mut h = Harness::new(factory);
    if h.caps().shares_host_memory {
        return Outcome::skipped("the driver shares host memory: it is never asked to allocate");
    }
    for bytes in [usize::MAX / 2, usize::MAX] {
        let driver = h.driver().clone();
        match catch_unwind(AssertUnwindSafe(|| driver.alloc(bytes))) {
            Ok(Err(_)) => {}
            Ok(Ok(id)) => {
                driver.free(id);
                panic!("{}: alloc({bytes}) succeeded; a device cannot hold that", h.name());
            }
            Err(p) => panic!(
                "{}: alloc({bytes}) panicked ({}); it must return an ExecError",
                h.name(),
                panic_message(&*p)
            ),
        }
    }
    let buf = h.alloc(4096);
    let got = h.download(&buf);
    assert_bytes(&h, &got, &[0; 4096], "a fresh allocation after refused ones");
    h.finish()
}
