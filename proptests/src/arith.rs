//! The arithmetic shared by the model and the Gantry closures: order-sensitive
//! ([`mix`]), so a missing dependency, a stale device copy or a lost partial write
//! shows up as wrong data.

/// An order-sensitive (non-commutative) 32-bit mixing step.
#[inline]
pub fn mix(a: u32, b: u32) -> u32 {
    let x = (a.rotate_left(5) ^ b).wrapping_mul(0x9E37_79B1);
    x ^ (x >> 15)
}

/// Initial contents of a buffer of `len` elements made from `seed`.
pub fn initial_contents(seed: u32, len: usize) -> Vec<u32> {
    (0..len).map(|i| mix(seed ^ 0x1234_5678, i as u32)).collect()
}

/// Work-item `i`'s starting value in an op with `salt`.
#[inline]
pub fn item_seed(salt: u32, i: usize) -> u32 {
    mix(salt, i as u32 ^ 0xA5A5_0000)
}

/// The value a `Write`/`DiscardWrite` accessor number `k` gets from accumulator `acc`.
#[inline]
pub fn out_value(acc: u32, k: usize) -> u32 {
    mix(acc, k as u32 + 1)
}

/// The value a `ReadWrite` accessor number `k` gets from `acc` and its old value.
#[inline]
pub fn rw_value(acc: u32, k: usize, old: u32) -> u32 {
    mix(out_value(acc, k), old)
}

/// Whether a `Write` accessor number `k` writes element `i` (it skips every third
/// element, so the unwritten elements must keep their values).
#[inline]
pub fn write_mask(salt: u32, k: usize, i: usize) -> bool {
    !(salt as usize).wrapping_add(k).wrapping_add(i).is_multiple_of(3)
}

/// Element `i` of a host-to-device copy's data with `salt`.
#[inline]
pub fn host_data(salt: u32, i: usize) -> u32 {
    mix(salt ^ 0x0F0F_0F0F, i as u32)
}
