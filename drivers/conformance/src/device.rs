//! A driver of a known type under test through the driver contract alone, for a
//! backend's own tests beside the suite (`gantry-cuda`'s and `gantry-vulkan`'s
//! `tests/common`): the driver (or the reason there is none, which skips the test),
//! submissions, completions checked to arrive once, allocations, uploads, downloads
//! and launches over whole allocations. It is for drivers that complete every
//! operation on their own threads (GPU drivers): one that completes an operation
//! inside `submit` fails the test.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_driver::sync::channel::{unbounded, Receiver};
use gantry_driver::{
    Accepted, AccessMode, AllocId, CodeImage, Completion, DeviceOp, Driver, DriverContext, ExecError,
    Geometry, HostStorage, ImageKind, Kernel, KernelLaunch, KernelRef, MemArg, MemRef, MemSlice, OpHandle,
    OpId, ScalarBlock, Signature, Submission,
};

/// A driver of a known type under test, through the contract alone, and its
/// completions (each checked to arrive exactly once).
pub struct DeviceUnderTest<D> {
    /// The driver.
    pub driver: D,
    rx: Receiver<Completion>,
    next: u64,
    done: HashMap<u64, Completion>,
}

/// A device slice of a whole allocation.
pub fn whole(id: AllocId, len: usize) -> MemSlice {
    MemSlice { mem: MemRef::Device(id), offset: 0, len }
}

/// `u32`s from native-endian bytes.
pub fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Native-endian bytes of `u32`s.
pub fn bytes(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// `u32` scalars as a scalar block.
pub fn scalars(values: &[u32]) -> ScalarBlock {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

impl<D: Driver> DeviceUnderTest<D> {
    /// The driver `open` makes for a new completion channel, or `None` after saying
    /// on standard error (past the test harness's capture) that `test` was skipped
    /// because `backend` is unavailable. Any error other than
    /// [`ExecError::Unsupported`] is a failure: the backend is present and broken.
    pub fn open(
        backend: &str,
        test: &str,
        open: impl FnOnce(DriverContext) -> Result<D, ExecError>,
    ) -> Option<Self> {
        let (tx, rx) = unbounded();
        let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
        match open(ctx) {
            Ok(driver) => Some(Self { driver, rx, next: 0, done: HashMap::new() }),
            Err(e) => {
                assert!(
                    matches!(e, ExecError::Unsupported { .. }),
                    "{backend} is present but the driver did not start: {e}"
                );
                let _ = writeln!(std::io::stderr(), "`{test}` skipped: no {backend} device: {e}");
                None
            }
        }
    }

    /// Submits `op` after `waits`; the handle and the op's id.
    pub fn submit(&mut self, op: DeviceOp, waits: &[OpHandle]) -> (OpHandle, u64) {
        self.next += 1;
        let id = self.next;
        let sub = Submission { id: OpId(id), op, waits, preserve_on_failure: true, hint: None };
        match self.driver.submit(sub) {
            Ok(Accepted::Pending(h)) => (h, id),
            // Its handle could not be waited on: the harness is for drivers that
            // complete every operation on their own threads (GPU drivers).
            Ok(Accepted::Done(_)) => panic!("the driver completed an operation inside submit"),
            Err(e) => panic!("submit refused: {e}"),
        }
    }

    /// The completion of op `id`, waiting up to 30 s.
    pub fn completion(&mut self, id: u64) -> Completion {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(c) = self.done.get(&id) {
                return c.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let c = self.rx.recv_timeout(left).unwrap_or_else(|_| panic!("op {id} did not complete in 30 s"));
            assert!(self.done.insert(c.op.0, c.clone()).is_none(), "op {} completed twice", c.op.0);
        }
    }

    /// The result of op `id`, waiting for it.
    pub fn result(&mut self, id: u64) -> Result<(), ExecError> {
        self.completion(id).result
    }

    /// Panics unless op `id` succeeded.
    pub fn ok(&mut self, id: u64) {
        if let Err(e) = self.result(id) {
            panic!("op {id} failed: {e}");
        }
    }

    /// The driver and its completion channel, for a test that drops the driver.
    pub fn into_parts(self) -> (D, Receiver<Completion>) {
        (self.driver, self.rx)
    }

    /// A device allocation of `len` bytes (panics if refused).
    pub fn alloc(&mut self, len: usize) -> AllocId {
        self.driver.alloc(len).unwrap_or_else(|e| panic!("alloc({len}): {e}"))
    }

    /// Writes `data` at `offset` of `id` and waits.
    pub fn upload(&mut self, id: AllocId, offset: usize, data: &[u8]) {
        let src = MemSlice::host(Arc::new(HostStorage::from_bytes(data)));
        let dst = MemSlice { mem: MemRef::Device(id), offset, len: data.len() };
        let (_, op) = self.submit(DeviceOp::Copy { src, dst }, &[]);
        self.ok(op);
    }

    /// `len` bytes at `offset` of `id`, once everything submitted so far has run.
    pub fn download(&mut self, id: AllocId, offset: usize, len: usize) -> Vec<u8> {
        let host = Arc::new(HostStorage::zeroed(len));
        let src = MemSlice { mem: MemRef::Device(id), offset, len };
        let (_, op) = self.submit(DeviceOp::Copy { src, dst: MemSlice::host(host.clone()) }, &[]);
        self.ok(op);
        // SAFETY: the copy into it has completed; nothing else uses it.
        unsafe { host.bytes() }.to_vec()
    }

    /// A launch of `kernel` over whole allocations.
    pub fn launch(
        &self,
        kernel: &KernelRef,
        geometry: Geometry,
        args: &[(AllocId, usize)],
        scalars: ScalarBlock,
    ) -> DeviceOp {
        let modes = kernel.signature.globals.iter().copied().chain(std::iter::repeat(AccessMode::Read));
        DeviceOp::Kernel(KernelLaunch {
            kernel: kernel.clone(),
            geometry,
            args: args
                .iter()
                .zip(modes)
                .map(|(&(id, len), mode)| MemArg { mem: whole(id, len), mode })
                .collect(),
            scalars,
        })
    }
}

/// A kernel of one code image: `source` of `kind`, entry point `entry`.
pub fn kernel(name: &str, signature: Signature, kind: ImageKind, entry: &str, source: &str) -> KernelRef {
    let image = CodeImage::new(kind, entry, source.as_bytes());
    Kernel::new(name, signature).with_image(image).into_ref()
}
