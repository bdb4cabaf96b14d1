//! Every kernel the checks run, built here and nowhere else: the one file that knows
//! what a kernel is (a [`KernelRef`] whose image is a closure of phases over accessors), so
//! that a change of the kernel type changes this file only. The checks see a
//! [`Kernel`]: a name, an iteration space and what it computes, which they launch
//! over memory arguments, record into a command buffer, or patch into one.
//!
//! Every kernel works on `u32` elements, indexed by the global linear id, and wraps
//! on overflow (an overflow panic would be a kernel failure the check did not ask
//! for).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gantry_driver::{
    AccessMode, DeviceOp, Geometry, ItemCost, KernelLaunch, KernelRef, MemArg, NdRange, OpPatch, RecordedArg,
    RecordedOp,
};
use gantry_host::{phase, Accessor, ClosureKernel, Phase, Read, ReadWrite, Write};

/// How the message of every panic the checks cause on purpose starts; the harness
/// keeps these from printing.
pub const DELIBERATE: &str = "conformance: deliberate panic";

/// The command-group tag every kernel's accessors carry.
const TAG: u64 = 0xC0F0;

/// Work-items per work-group: several groups for any kernel of more than this many
/// items, so a threaded driver spreads them.
const GROUP: usize = 64;

/// A kernel and its iteration space.
#[derive(Clone)]
pub(crate) struct Kernel {
    kernel: KernelRef,
    geometry: Geometry,
}

impl Kernel {
    /// Its name, as failures must report it.
    pub(crate) fn name(&self) -> &str {
        &self.kernel.name
    }

    /// A launch over `args` (one per buffer slot, in slot order).
    pub(crate) fn launch(&self, args: impl IntoIterator<Item = MemArg>) -> DeviceOp {
        DeviceOp::Kernel(KernelLaunch {
            kernel: self.kernel.clone(),
            geometry: self.geometry,
            args: args.into_iter().collect(),
            scalars: Default::default(),
        })
    }

    /// The kernel recorded into a command buffer over `args`.
    pub(crate) fn record(&self, args: &[RecordedArg]) -> RecordedOp {
        RecordedOp::Kernel {
            kernel: self.kernel.clone(),
            geometry: self.geometry,
            args: args.into(),
            scalars: Default::default(),
        }
    }

    /// A patch that makes a recorded kernel this one.
    pub(crate) fn patch(&self) -> OpPatch<'_> {
        OpPatch::Kernel { kernel: &self.kernel, geometry: &self.geometry, scalars: &[] }
    }
}

/// The name of a launch's kernel, for messages.
pub(crate) fn name_of(launch: &KernelLaunch) -> &str {
    &launch.kernel.name
}

/// `n` items in groups of [`GROUP`] where `n` divides so, else one group.
fn geometry(n: usize) -> Geometry {
    let local = if n.is_multiple_of(GROUP) { GROUP } else { n };
    NdRange::new(n, local).geometry().expect("a valid ND-range")
}

fn build(name: &str, geometry: Geometry, modes: &[AccessMode], body: Phase) -> Kernel {
    let closure = ClosureKernel {
        tag: TAG,
        phases: smallvec::smallvec![body],
        global_slots: modes.len(),
        scratch: vec![],
        unfused: None,
    };
    Kernel { kernel: closure.into_kernel(name, modes.iter().copied(), ItemCost::default()), geometry }
}

/// `x[i] = a * x[i] + b` over `n` elements of slot 0 (read-write). Two of these with
/// different `b` do not commute, so a chain of them tells the order they ran in.
pub(crate) fn affine(name: &str, n: usize, a: u32, b: u32) -> Kernel {
    let x = Accessor::<u32, ReadWrite>::new(0, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        x.set(it, i, x.get(it, i).wrapping_mul(a).wrapping_add(b))
    });
    build(name, geometry(n), &[AccessMode::ReadWrite], body)
}

/// `dst[i] = f(src[i], i)` over `n` elements: slot 0 is `src` (read), slot 1 `dst`
/// (write).
pub(crate) fn derive(name: &str, n: usize, f: impl Fn(u32, u32) -> u32 + Send + Sync + 'static) -> Kernel {
    let src = Accessor::<u32, Read>::new(0, TAG, n);
    let dst = Accessor::<u32, Write>::new(1, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        dst.set(it, i, f(src.get(it, i), i as u32))
    });
    build(name, geometry(n), &[AccessMode::Read, AccessMode::Write], body)
}

/// `dst[i] = a * src[n - 1 - i] + b` over `n` elements: slot 0 is `src` (read), slot 1
/// `dst` (write). Its first work-items read what a kernel in the same order writes
/// last, and it overwrites the source of the kernel before it: one that overlapped
/// either neighbour in a chain of these would read or clobber unfinished data.
pub(crate) fn reverse_affine(name: &str, n: usize, a: u32, b: u32) -> Kernel {
    let src = Accessor::<u32, Read>::new(0, TAG, n);
    let dst = Accessor::<u32, Write>::new(1, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        dst.set(it, i, src.get(it, n - 1 - i).wrapping_mul(a).wrapping_add(b))
    });
    build(name, geometry(n), &[AccessMode::Read, AccessMode::Write], body)
}

/// `acc[i] += src[i]` over `n` elements: slot 0 is `src` (read), slot 1 `acc`
/// (read-write).
pub(crate) fn accumulate(name: &str, n: usize) -> Kernel {
    let src = Accessor::<u32, Read>::new(0, TAG, n);
    let acc = Accessor::<u32, ReadWrite>::new(1, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        acc.set(it, i, acc.get(it, i).wrapping_add(src.get(it, i)))
    });
    build(name, geometry(n), &[AccessMode::Read, AccessMode::ReadWrite], body)
}

/// `x[i] = value` over `n` elements of slot 0 (write), counting its work-items in
/// `ran`: a kernel that must not run shows that it did not.
pub(crate) fn counted_store(name: &str, n: usize, value: u32, ran: Arc<AtomicUsize>) -> Kernel {
    let x = Accessor::<u32, Write>::new(0, TAG, n);
    let body = phase(move |it| {
        ran.fetch_add(1, Ordering::Relaxed);
        x.set(it, it.global_linear_id(), value)
    });
    build(name, geometry(n), &[AccessMode::Write], body)
}

/// Writes `value` to each of the `n` elements of slot 0 (write), in order in one
/// work-group, and panics (a message starting with [`DELIBERATE`]) at the last one,
/// after it wrote: everything written before it failed.
pub(crate) fn write_then_panic(name: &str, n: usize, value: u32) -> Kernel {
    let x = Accessor::<u32, Write>::new(0, TAG, n);
    let body = phase(move |it| {
        let i = it.global_linear_id();
        x.set(it, i, value);
        if i == n - 1 {
            panic!("{DELIBERATE} in a kernel");
        }
    });
    let one_group = NdRange::new(n, n).geometry().expect("a valid ND-range");
    build(name, one_group, &[AccessMode::Write], body)
}

/// The message [`write_then_panic`]'s kernels panic with.
pub(crate) fn kernel_panic_message() -> String {
    format!("{DELIBERATE} in a kernel")
}
