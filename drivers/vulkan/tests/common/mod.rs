//! What the Vulkan tests share: a driver on physical device 0 (or the reason there is none), and
//! submissions, uploads and downloads through the driver contract alone.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_driver::sync::channel::{unbounded, Receiver};
use gantry_driver::{
    AccessMode, AllocId, Completion, DeviceOp, Driver, DriverContext, ExecError, Geometry, HostStorage,
    Kernel, KernelLaunch, KernelRef, MemArg, MemRef, MemSlice, OpHandle, OpId, ScalarBlock, Submission,
};
use gantry_vulkan::{VulkanConfig, VulkanDriver};

/// The driver under test and its completions.
pub struct Gpu {
    pub driver: VulkanDriver,
    rx: Receiver<Completion>,
    next: u64,
    done: HashMap<u64, Completion>,
}

/// Device 0, or `None` after saying on standard error (past the test harness's
/// capture) that `test` was skipped and why.
pub fn gpu(test: &str) -> Option<Gpu> {
    let (tx, rx) = unbounded();
    let ctx = DriverContext { completions: tx, epoch: Instant::now() };
    match VulkanDriver::new(VulkanConfig::default(), ctx) {
        Ok(driver) => Some(Gpu { driver, rx, next: 0, done: HashMap::new() }),
        Err(e) => {
            assert!(
                matches!(e, ExecError::Unsupported { .. }),
                "Vulkan is present but the driver did not start: {e}"
            );
            let _ = writeln!(std::io::stderr(), "`{test}` skipped: no Vulkan device: {e}");
            None
        }
    }
}

/// A device slice of a whole allocation.
pub fn whole(id: AllocId, len: usize) -> MemSlice {
    MemSlice { mem: MemRef::Device(id), offset: 0, len }
}

pub fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub fn bytes(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// `u32` scalars as a scalar block.
pub fn scalars(values: &[u32]) -> ScalarBlock {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

impl Gpu {
    /// Submits `op` after `waits`; the handle and the op's id.
    pub fn submit(&mut self, op: DeviceOp, waits: &[OpHandle]) -> (OpHandle, u64) {
        self.next += 1;
        let id = self.next;
        let sub = Submission { id: OpId(id), op, waits, preserve_on_failure: true, hint: None };
        match self.driver.submit(sub) {
            Ok(gantry_driver::Accepted::Pending(h)) => (h, id),
            Ok(gantry_driver::Accepted::Done(_)) => {
                panic!("the Vulkan driver completes nothing inside submit")
            }
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

    pub fn result(&mut self, id: u64) -> Result<(), ExecError> {
        self.completion(id).result
    }

    pub fn ok(&mut self, id: u64) {
        if let Err(e) = self.result(id) {
            panic!("op {id} failed: {e}");
        }
    }

    /// The driver and its completion channel, for a test that drops the driver.
    pub fn into_parts(self) -> (VulkanDriver, Receiver<Completion>) {
        (self.driver, self.rx)
    }

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
pub fn kernel(
    name: &str,
    signature: gantry_driver::Signature,
    kind: gantry_driver::ImageKind,
    entry: &str,
    source: &str,
) -> KernelRef {
    let image = gantry_driver::CodeImage::new(kind, entry, source.as_bytes());
    Kernel::new(name, signature).with_image(image).into_ref()
}
