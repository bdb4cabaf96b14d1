//! Peer copies between two GPUs of one process (`cuMemcpyPeerAsync`): each driver
//! resolves the other's allocation, both directions, overlapping sizes and offsets;
//! copies of peer memory other than to or from the driver's own are typed errors.
//! Skipped, saying why, on a machine with fewer than two CUDA devices.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use gantry_cuda::{device_count, CudaConfig, CudaDriver, PEER_GROUP};
use gantry_driver::sync::channel::{unbounded, Receiver};
use gantry_driver::{
    Accepted, AllocId, Completion, DeviceOp, Driver, DriverContext, ExecError, HostStorage, MemRef, MemSlice,
    OpId, Submission,
};

struct Dev {
    driver: CudaDriver,
    rx: Receiver<Completion>,
}

fn open(ordinal: usize) -> Dev {
    let (tx, rx) = unbounded();
    let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
    let driver =
        CudaDriver::new(CudaConfig { ordinal, ..Default::default() }, ctx).expect("the device opens");
    Dev { driver, rx }
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Dev {
    fn run(&self, op: DeviceOp) -> Result<(), ExecError> {
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sub = Submission { id: OpId(id), op, waits: &[], preserve_on_failure: false, hint: None };
        match self.driver.submit(sub)? {
            Accepted::Done(c) => c.result,
            Accepted::Pending(_) => {
                let c = self.rx.recv_timeout(Duration::from_secs(30)).expect("a completion");
                assert_eq!(c.op.0, id);
                c.result
            }
        }
    }
    fn slice(id: AllocId, offset: usize, len: usize) -> MemSlice {
        MemSlice { mem: MemRef::Device(id), offset, len }
    }
    fn upload(&self, id: AllocId, data: &[u8]) {
        let src = MemSlice::host(Arc::new(HostStorage::from_bytes(data)));
        self.run(DeviceOp::Copy { src, dst: Self::slice(id, 0, data.len()) }).unwrap();
    }
    fn download(&self, id: AllocId, len: usize) -> Vec<u8> {
        let host = Arc::new(HostStorage::zeroed(len));
        self.run(DeviceOp::Copy { src: Self::slice(id, 0, len), dst: MemSlice::host(host.clone()) }).unwrap();
        // SAFETY: the copy completed; nothing else uses it.
        unsafe { host.bytes() }.to_vec()
    }
}

#[test]
fn peer_devices_copy_into_each_other() {
    let count = device_count().unwrap_or(0);
    if count < 2 {
        let _ = writeln!(
            std::io::stderr(),
            "`peer_devices_copy_into_each_other` skipped: {count} CUDA device(s)"
        );
        return;
    }
    let (a, b) = (open(0), open(1));
    let (ga, gb) = (a.driver.info().caps.peer_group, b.driver.info().caps.peer_group);
    if ga == 0 || gb == 0 {
        let _ = writeln!(std::io::stderr(), "`peer_devices_copy_into_each_other` skipped: no peer access");
        return;
    }
    assert_eq!((ga, gb), (PEER_GROUP, PEER_GROUP));
    let n = (64 << 20) + 12;
    let data: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    let (xa, xb) = (a.driver.alloc(n).unwrap(), b.driver.alloc(n).unwrap());
    a.upload(xa, &data);
    // B pulls from A's allocation, then A pulls a part back from B's at an offset.
    b.run(DeviceOp::Copy { src: Dev::slice(xa, 0, n), dst: Dev::slice(xb, 0, n) }).unwrap();
    assert_eq!(b.download(xb, n), data, "A to B");
    let ya = a.driver.alloc(n).unwrap();
    a.run(DeviceOp::Copy { src: Dev::slice(xb, 4, n - 8), dst: Dev::slice(ya, 8, n - 8) }).unwrap();
    let back = a.download(ya, n);
    assert_eq!(&back[8..], &data[4..n - 4], "B to A at offsets");
    // B pushes into A's memory.
    let za = a.driver.alloc(16).unwrap();
    b.run(DeviceOp::Copy { src: Dev::slice(xb, 0, 16), dst: Dev::slice(za, 0, 16) }).unwrap();
    assert_eq!(a.download(za, 16), &data[..16], "B pushes into A");

    // A fill of the other device's memory, and a copy between two of its
    // allocations, are not this driver's to run.
    let fill = DeviceOp::Fill { dst: Dev::slice(xa, 0, 16), pattern: [1u8, 2, 3, 4].into_iter().collect() };
    assert!(matches!(b.run(fill), Err(ExecError::Driver { .. })));
    let foreign = DeviceOp::Copy { src: Dev::slice(xa, 0, 16), dst: Dev::slice(za, 0, 16) };
    assert!(matches!(b.run(foreign), Err(ExecError::Driver { .. })));
    // Freed: no longer resolvable by the peer.
    a.driver.free(za);
    let gone = DeviceOp::Copy { src: Dev::slice(za, 0, 16), dst: Dev::slice(xb, 0, 16) };
    assert!(matches!(b.run(gone), Err(ExecError::Driver { .. })));
}
