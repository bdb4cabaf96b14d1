//! The vector instruction set the runtime's own loops are compiled for, chosen at run
//! time.
//!
//! A GPU runtime compiles kernels for the device it finds; a Rust binary is compiled
//! for a baseline CPU (x86-64 with SSE2 unless the application sets `target-cpu`),
//! so a loop the runtime owns would use a quarter of an AVX-512 core's vector width.
//! The loops Gantry owns — the elementwise loop of [`map`](crate::elementwise::map_phase)
//! kernels, alone or inside a fused chain, the multi-input maps' and the interior
//! loop of [stencils](crate::stencil) — are therefore compiled once per instruction
//! set (`copy_for`) and dispatched on the one detected at first use. The user's
//! closure is inlined into each copy, so it is vectorized for the same width. Results
//! do not depend on the choice: the copies run the same IEEE operations (Rust never
//! contracts `a * b + c` into a fused multiply-add), only more lanes at a time.
//!
//! The same loops, streamed through a fused chain, also ask whether to request memory
//! ahead in software ([`stream_prefetch`]) and how many work-items a span holds
//! ([`stream_span`]): two more choices that depend on the CPU.
//!
//! `GANTRY_CPU_ISA=baseline|avx2|avx512` caps the choice (read once, at first use),
//! for reproducing a result or measuring one copy against another; a name the
//! machine cannot run falls back to the widest it can below it.
//!
//! ```
//! use gantry_host::isa::{self, Isa};
//! let isa = isa::active();
//! assert!(isa <= Isa::detected());
//! println!("elementwise loops run as {isa}");
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction set the runtime's loops have a copy for, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// What the binary was compiled for (SSE2 on a default x86-64 build).
    Baseline,
    /// x86-64 AVX2: 256-bit vectors.
    Avx2,
    /// x86-64 AVX-512 (foundation): 512-bit vectors.
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU runs (detected, not capped).
    pub fn detected() -> Isa {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }

    /// The instruction set named `name` (`baseline`, `avx2` or `avx512`, any case).
    pub fn parse(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "baseline" | "none" | "sse2" => Some(Isa::Baseline),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx512f" => Some(Isa::Avx512),
            _ => None,
        }
    }

    fn from_code(code: u8) -> Isa {
        match code {
            1 => Isa::Baseline,
            2 => Isa::Avx2,
            _ => Isa::Avx512,
        }
    }

    fn code(self) -> u8 {
        match self {
            Isa::Baseline => 1,
            Isa::Avx2 => 2,
            Isa::Avx512 => 3,
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        })
    }
}

/// The environment variable that caps [`active`].
pub const ISA_ENV: &str = "GANTRY_CPU_ISA";

/// A choice made at first use (it reads the environment and the CPU) and read with
/// one relaxed load after. It holds the choice's code; 0 means not yet decided.
struct Decided(AtomicU8);

impl Decided {
    const fn new() -> Self {
        Self(AtomicU8::new(0))
    }

    /// The code, deciding it with `decide` (which never answers 0) the first time.
    /// Racing first callers compute the same answer.
    #[inline]
    fn get(&self, decide: fn() -> u8) -> u8 {
        match self.0.load(Ordering::Relaxed) {
            0 => {
                let code = decide();
                self.0.store(code, Ordering::Relaxed);
                code
            }
            code => code,
        }
    }
}

static ACTIVE: Decided = Decided::new();

/// The instruction set the runtime's loops run with: [`Isa::detected`], capped by
/// `GANTRY_CPU_ISA` where that names a narrower one. Decided at the first call;
/// later calls are one relaxed load.
#[inline]
pub fn active() -> Isa {
    Isa::from_code(ACTIVE.get(decide))
}

#[cold]
fn decide() -> u8 {
    let cap = std::env::var(ISA_ENV).ok().as_deref().and_then(Isa::parse);
    choose(Isa::detected(), cap).code()
}

/// The detected instruction set, capped by `cap` if given.
fn choose(detected: Isa, cap: Option<Isa>) -> Isa {
    cap.map_or(detected, |cap| cap.min(detected))
}

/// A loop the runtime owns, with its types erased: `(ctx, src, dst, count)`, where
/// the loop defines what `ctx` points to and what the two runs hold. Every copy of a
/// loop ([`copy_for`]) has this shape, so a caller resolves the copy once and calls it
/// through one pointer.
pub(crate) type LoopFn = unsafe fn(*const (), *const u8, *mut u8, usize);

/// A loop compiled once per instruction set by [`copy_for`]. Implementations mark
/// [`OwnedLoop::run`] `#[inline(always)]`, so that each copy inlines it, and the
/// user's closure it calls, under that copy's target features.
pub(crate) trait OwnedLoop {
    /// The loop.
    ///
    /// # Safety
    /// The implementation's contract for `ctx`, `src`, `dst` and `count`.
    unsafe fn run(ctx: *const (), src: *const u8, dst: *mut u8, count: usize);
}

/// The copy of `L` compiled for `isa`, which must be one the CPU runs.
pub(crate) fn copy_for<L: OwnedLoop>(isa: Isa) -> LoopFn {
    match isa {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        Isa::Avx512 => copies::avx512::<L>,
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        Isa::Avx2 => copies::avx2::<L>,
        _ => copies::baseline::<L>,
    }
}

/// The copies [`copy_for`] hands out.
mod copies {
    use super::OwnedLoop;

    /// `L` for the binary's own target.
    ///
    /// # Safety
    /// `L`'s contract.
    pub(super) unsafe fn baseline<L: OwnedLoop>(ctx: *const (), src: *const u8, dst: *mut u8, count: usize) {
        // SAFETY: the caller's contract.
        unsafe { L::run(ctx, src, dst, count) }
    }

    /// `L` for x86-64 AVX2.
    ///
    /// # Safety
    /// `L`'s contract; and the CPU must run AVX2.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2<L: OwnedLoop>(ctx: *const (), src: *const u8, dst: *mut u8, count: usize) {
        // SAFETY: the caller's contract.
        unsafe { L::run(ctx, src, dst, count) }
    }

    /// `L` for x86-64 AVX-512F (and AVX2, which every AVX-512 CPU has).
    ///
    /// # Safety
    /// `L`'s contract; and the CPU must run AVX-512F.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn avx512<L: OwnedLoop>(ctx: *const (), src: *const u8, dst: *mut u8, count: usize) {
        // SAFETY: the caller's contract.
        unsafe { L::run(ctx, src, dst, count) }
    }
}

/// The environment variable that sets [`stream_prefetch`].
pub const STREAM_PREFETCH_ENV: &str = "GANTRY_STREAM_PREFETCH";

/// 1 (off) or 2 (on) once decided.
static STREAM_PREFETCH: Decided = Decided::new();

/// Whether a fused chain streamed span by span requests its global input and output
/// a few spans ahead in software. CPUs want opposite answers, by a wide margin: on
/// Intel the requests let a chain keep up with a hand-written loop, while AMD's
/// hardware prefetchers already run ahead and the requests fill the miss buffers
/// (figures: `docs/PERFORMANCE.md`). So: on for Intel, off elsewhere;
/// `GANTRY_STREAM_PREFETCH=1` or `0` decides instead (read once).
#[inline]
pub fn stream_prefetch() -> bool {
    STREAM_PREFETCH.get(decide_stream_prefetch) == 2
}

#[cold]
fn decide_stream_prefetch() -> u8 {
    let set = std::env::var(STREAM_PREFETCH_ENV).ok();
    let on = match set.as_deref().map(str::trim) {
        Some("1") | Some("on") => true,
        Some("0") | Some("off") => false,
        _ => cpu_vendor() == *b"GenuineIntel",
    };
    if on {
        2
    } else {
        1
    }
}

/// The environment variable that sets [`stream_span`].
pub const STREAM_SPAN_ENV: &str = "GANTRY_STREAM_SPAN";

/// log2 of the span once decided.
static STREAM_SPAN: Decided = Decided::new();

/// How many work-items a fused chain streamed span by span runs each kernel over
/// before the next (at most: a chain whose intermediates would not fit in L1 at this
/// span takes a shorter one): 256 where the chain requests memory ahead in software
/// ([`stream_prefetch`], whose distance was tuned with it), 512 where the hardware
/// prefetchers run alone (figures: `docs/PERFORMANCE.md`).
///
/// `GANTRY_STREAM_SPAN` (a power of two from 64 to 4096) decides instead (read once).
///
/// ```
/// let span = gantry_host::isa::stream_span();
/// assert!(span.is_power_of_two() && (64..=4096).contains(&span));
/// ```
#[inline]
pub fn stream_span() -> usize {
    1 << STREAM_SPAN.get(decide_stream_span)
}

#[cold]
fn decide_stream_span() -> u8 {
    let set = std::env::var(STREAM_SPAN_ENV).ok();
    set.as_deref().and_then(parse_span).unwrap_or(if stream_prefetch() { 8 } else { 9 })
}

/// log2 of a span named in `GANTRY_STREAM_SPAN`: a power of two from 64 to 4096.
fn parse_span(text: &str) -> Option<u8> {
    let span: usize = text.trim().parse().ok()?;
    (span.is_power_of_two() && (64..=4096).contains(&span)).then(|| span.trailing_zeros() as u8)
}

/// The CPU vendor string (`GenuineIntel`, `AuthenticAMD`, …), or zeros where there
/// is none to read.
fn cpu_vendor() -> [u8; 12] {
    let mut vendor = [0u8; 12];
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 processor.
        #[allow(unused_unsafe)]
        let r = unsafe { std::arch::x86_64::__cpuid(0) };
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
    }
    vendor
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names parse in any case; a cap never raises the choice above what the CPU runs.
    #[test]
    fn a_cap_only_narrows() {
        assert_eq!(Isa::parse("AVX2"), Some(Isa::Avx2));
        assert_eq!(Isa::parse(" avx512 "), Some(Isa::Avx512));
        assert_eq!(Isa::parse("baseline"), Some(Isa::Baseline));
        assert_eq!(Isa::parse("neon"), None);
        assert_eq!(choose(Isa::Avx2, Some(Isa::Avx512)), Isa::Avx2);
        assert_eq!(choose(Isa::Avx512, Some(Isa::Baseline)), Isa::Baseline);
        assert_eq!(choose(Isa::Avx512, None), Isa::Avx512);
        assert!(active() <= Isa::detected());
        assert_eq!(active(), active(), "decided once");
    }

    /// The vendor string reads as text on x86-64, and the prefetch policy is decided
    /// once.
    #[test]
    fn the_vendor_decides_stream_prefetch_once() {
        let vendor = cpu_vendor();
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        assert!(vendor.iter().all(|b| b.is_ascii_graphic()), "{vendor:?}");
        let first = stream_prefetch();
        assert_eq!(stream_prefetch(), first);
        if std::env::var_os(STREAM_PREFETCH_ENV).is_none() {
            assert_eq!(first, vendor == *b"GenuineIntel");
        }
    }

    /// A span named in the environment is a power of two from 64 to 4096; without
    /// one, the span follows the prefetch policy.
    #[test]
    fn stream_spans_are_powers_of_two_and_follow_prefetching() {
        assert_eq!(parse_span("512"), Some(9));
        assert_eq!(parse_span(" 64 "), Some(6));
        assert_eq!(parse_span("4096"), Some(12));
        for bad in ["0", "32", "300", "8192", "big", ""] {
            assert_eq!(parse_span(bad), None, "{bad:?}");
        }
        let span = stream_span();
        assert_eq!(stream_span(), span, "decided once");
        if std::env::var_os(STREAM_SPAN_ENV).is_none() {
            assert_eq!(span, if stream_prefetch() { 256 } else { 512 });
        }
    }
}
