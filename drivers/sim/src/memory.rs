//! Device memory: allocations in the machine's table (which every device of the
//! machine reaches), and the bounds-checked regions operations resolve their
//! memory to at submission.

use std::sync::Arc;

use gantry_driver::sync::MutexGuard;
use gantry_driver::{AllocId, Binding, ExecError, HostStorage, MemRef, MemSlice};
use rustc_hash::FxHashMap;

use crate::faults::Fault;
use crate::machine::SimDriver;

/// One device allocation, reachable from every device of the machine.
pub(crate) struct Allocation {
    /// The device instance that allocated it.
    pub(crate) owner: u64,
    pub(crate) storage: Arc<HostStorage>,
}

/// A byte range of memory, bounds-checked when resolved. The `Arc` keeps it alive
/// until the operation that uses it has executed, even if it is freed meanwhile.
pub(crate) struct Region {
    pub(crate) storage: Arc<HostStorage>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl Region {
    pub(crate) fn binding(&self) -> Binding {
        // SAFETY: `offset + len <= storage.len()` was checked when the region was
        // resolved, so the pointer stays within (or one past the end of) the allocation.
        let ptr = unsafe { self.storage.as_ptr().add(self.offset) };
        Binding::new(ptr, self.len)
    }
}

impl SimDriver {
    /// Bytes held by live (allocated and not freed) device allocations.
    pub fn allocated_bytes(&self) -> usize {
        self.state.lock().allocated
    }

    /// Resolves a slice to a bounds-checked region. Host memory is accepted only when
    /// `host` is `None`; otherwise it is refused as unsupported `host`. Device memory
    /// must be this device's; the host pool has none.
    pub(crate) fn resolve(&self, slice: &MemSlice, host: Option<&'static str>) -> Result<Region, ExecError> {
        self.locate(slice, host, false).map(|(region, _)| region)
    }

    /// [`SimDriver::resolve`], where device memory may also be a peer's when `peer`
    /// (the source of a copy over a device-to-device link); says whether it was.
    pub(crate) fn locate(
        &self,
        slice: &MemSlice,
        host: Option<&'static str>,
        peer: bool,
    ) -> Result<(Region, bool), ExecError> {
        self.locate_in(&mut None, slice, host, peer)
    }

    /// [`SimDriver::locate`] with the machine's allocation table locked in `memory`
    /// (locked here if it is not yet), so that an operation with several arguments
    /// locks it once.
    pub(crate) fn locate_in<'m>(
        &'m self,
        memory: &mut Option<MutexGuard<'m, FxHashMap<AllocId, Allocation>>>,
        slice: &MemSlice,
        host: Option<&'static str>,
        peer: bool,
    ) -> Result<(Region, bool), ExecError> {
        let mut from_peer = false;
        let storage = match &slice.mem {
            MemRef::Host(storage) => match host {
                None => storage.clone(),
                Some(what) => return Err(self.unsupported(what)),
            },
            MemRef::Device(_) if self.host_pool => return Err(self.unsupported("device memory")),
            MemRef::Device(id) => {
                let memory = memory.get_or_insert_with(|| self.machine.memory.lock());
                let unknown = || self.driver_error(format!("unknown allocation {}", id.0));
                let a = memory.get(id).ok_or_else(unknown)?;
                from_peer = a.owner != self.instance;
                if from_peer && !(peer && self.info.caps.peer_group != 0) {
                    return Err(unknown());
                }
                a.storage.clone()
            }
        };
        if slice.offset.checked_add(slice.len).is_none_or(|end| end > storage.len()) {
            let (len, offset, size) = (slice.len, slice.offset, storage.len());
            let message =
                format!("slice of {len} bytes at offset {offset} is outside its {size}-byte allocation");
            return Err(self.driver_error(message));
        }
        Ok((Region { storage, offset: slice.offset, len: slice.len }, from_peer))
    }

    /// [`Driver::alloc`](gantry_driver::Driver::alloc): a zeroed allocation in the
    /// machine's table, within the device's capacity and its fault plan.
    pub(crate) fn allocate(&self, bytes: usize) -> Result<AllocId, ExecError> {
        let mut state = self.state.lock();
        if state.lost {
            return Err(self.lost());
        }
        let nth = state.allocs;
        state.allocs += 1;
        if self.faults.has(Fault::Alloc { nth }) {
            return Err(ExecError::OutOfMemory { device: self.info.name.clone(), requested: bytes });
        }
        let total = state.allocated.checked_add(bytes);
        if total.is_none_or(|t| t > self.memory_bytes) {
            return Err(ExecError::OutOfMemory { device: self.info.name.clone(), requested: bytes });
        }
        let id = self.machine.next_alloc();
        state.allocated += bytes;
        let allocation = Allocation { owner: self.instance, storage: Arc::new(HostStorage::zeroed(bytes)) };
        self.machine.memory.lock().insert(id, allocation);
        Ok(id)
    }
    /// [`Driver::free`](gantry_driver::Driver::free): `id` leaves the table (if this
    /// device allocated it) and stops counting against the capacity.
    pub(crate) fn release(&self, id: AllocId) {
        let mut state = self.state.lock();
        let mut memory = self.machine.memory.lock();
        if memory.get(&id).is_some_and(|a| a.owner == self.instance) {
            let freed = memory.remove(&id).expect("checked above");
            state.allocated -= freed.storage.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// Host → device, a kernel on device memory, device → host: the host output holds
    /// the result, and nothing moves before `poll`.
    #[test]
    pub(crate) fn round_trip_through_device_memory() {
        let (d, rx) = sim();
        let n = 3000; // three work-groups
        let input = host_u32(&(0..n as u32).collect::<Vec<_>>());
        let output = Arc::new(HostStorage::zeroed(n * 4));
        let buf = d.alloc(n * 4).unwrap();
        let up = submit(&d, 0, copy(host(&input, 0, n * 4), dev(buf, 0, n * 4)), &[]);
        let k = submit(&d, 1, map_kernel("square", n, dev(buf, 0, n * 4), |x, _| x * x), &[up]);
        submit(&d, 2, copy(dev(buf, 0, n * 4), host(&output, 0, n * 4)), &[k]);

        assert!(drain(&rx).is_empty(), "nothing runs before poll");
        assert!(read_u32(&output).iter().all(|&x| x == 0), "host untouched before poll");

        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2]);
        assert!(done.iter().all(|c| c.result.is_ok()));
        let expect: Vec<u32> = (0..n as u32).map(|x| x * x).collect();
        assert_eq!(read_u32(&output), expect);
        assert_eq!(read_u32(&input), (0..n as u32).collect::<Vec<_>>(), "input unchanged");
        assert_eq!(d.now_ns(), 3_000);
    }

    /// Allocations beyond the device's capacity fail; freeing makes room again.
    #[test]
    pub(crate) fn out_of_memory() {
        let (d, _rx) = driver(SimConfig { memory_bytes: 1000, ..Default::default() });
        let a = d.alloc(600).unwrap();
        assert_eq!(d.allocated_bytes(), 600);
        match d.alloc(500) {
            Err(ExecError::OutOfMemory { device, requested }) => {
                assert_eq!(&*device, "sim");
                assert_eq!(requested, 500);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
        assert!(matches!(d.alloc(usize::MAX), Err(ExecError::OutOfMemory { .. })));
        let b = d.alloc(400).unwrap();
        assert_ne!(a, b);
        assert_eq!(d.allocated_bytes(), 1000);
        d.free(a);
        assert_eq!(d.allocated_bytes(), 400);
        d.alloc(600).unwrap();
    }

    /// Devices of one machine share an allocation table, but a device reaches another's
    /// memory only as the source of a copy, and only over a peer link.
    #[test]
    pub(crate) fn peer_memory_is_reachable_only_by_copies_over_a_link() {
        for peer_bytes_per_ns in [0.0, 8.0] {
            let (tx, rx) = unbounded();
            let ctx = DriverContext { completions: tx, clock: gantry_driver::Clock::starting_now(true) };
            let machine = SimMachine::new(MachineConfig { peer_bytes_per_ns, host: None });
            let a = machine.device(SimConfig { latency_ns: 10, ..Default::default() }, ctx.clone());
            let b = machine.device(SimConfig { latency_ns: 10, ..Default::default() }, ctx);
            let (src, dst) = (a.alloc(64).unwrap(), b.alloc(64).unwrap());
            let input = host_u32(&[7; 16]);
            submit(&a, 0, copy(host(&input, 0, 64), dev(src, 0, 64)), &[]);
            a.poll();
            submit(&b, 1, copy(dev(src, 0, 64), dev(dst, 0, 64)), &[]);
            submit(&b, 2, add(16, dev(src, 0, 64), 1), &[]);
            b.poll();
            let done = drain(&rx);
            assert!(done[0].result.is_ok());
            let by_id = |id| done.iter().find(|c| c.op.0 == id).unwrap();
            let unknown = |c: &Completion| matches!(&c.result, Err(ExecError::Driver { message, .. }) if message.contains("unknown allocation"));
            assert!(unknown(by_id(2)), "kernels never bind a peer's memory: {:?}", by_id(2));
            if peer_bytes_per_ns > 0.0 {
                let c = by_id(1);
                assert!(c.result.is_ok(), "{c:?}");
                assert_eq!(c.ended_ns - c.started_ns, 10 + 8, "64 bytes at 8 B/ns, plus latency");
                let out = Arc::new(HostStorage::zeroed(64));
                submit(&b, 3, copy(dev(dst, 0, 64), host(&out, 0, 64)), &[]);
                b.poll();
                assert_eq!(read_u32(&out), [7; 16]);
            } else {
                assert!(unknown(by_id(1)), "no link: {:?}", by_id(1));
            }
        }
    }

    /// Kernels and fills may bind only device memory; the failure is the operation's
    /// completion result and its dependents do not run.
    #[test]
    pub(crate) fn kernels_and_fills_refuse_host_memory() {
        let (d, rx) = sim();
        let storage = host_u32(&[1, 2, 3, 4]);
        let k = submit(&d, 0, add(4, host(&storage, 0, 16), 1), &[]);
        submit(&d, 1, DeviceOp::Fill { dst: host(&storage, 0, 16), pattern: [9].into_iter().collect() }, &[]);
        submit(&d, 2, DeviceOp::Marker, &[k]);
        d.poll();
        let done = drain(&rx);
        assert!(matches!(
            &done[0].result,
            Err(ExecError::Unsupported { what: "kernel arguments in host memory", .. })
        ));
        assert!(matches!(&done[1].result, Err(ExecError::Unsupported { what: "fills of host memory", .. })));
        assert!(matches!(&done[2].result, Err(ExecError::DependencyFailed { .. })));
        assert_eq!(read_u32(&storage), [1, 2, 3, 4]);
    }

    /// Bad slices fail their operation at its virtual time instead of being refused.
    #[test]
    pub(crate) fn invalid_memory_fails_the_operation() {
        let (d, rx) = sim();
        let buf = d.alloc(16).unwrap();
        let gone = d.alloc(16).unwrap();
        d.free(gone);
        submit(&d, 0, copy(dev(buf, 0, 16), dev(buf, 8, 16)), &[]); // out of bounds
        submit(&d, 1, copy(dev(buf, 0, 8), dev(buf, 0, 16)), &[]); // lengths differ
        submit(&d, 2, copy(dev(gone, 0, 16), dev(buf, 0, 16)), &[]); // freed
        submit(
            &d,
            3,
            DeviceOp::Fill { dst: dev(buf, 0, 10), pattern: [1, 2, 3, 4].into_iter().collect() },
            &[],
        );
        d.poll();
        let done = drain(&rx);
        assert_eq!(order(&done), [0, 1, 2, 3]);
        assert!(done.iter().all(|c| matches!(c.result, Err(ExecError::Driver { .. }))), "{done:?}");
    }

    /// Copies of sub-ranges in every direction move exactly the bytes named.
    #[test]
    pub(crate) fn sub_range_copies() {
        let (d, rx) = sim();
        let input = host_u32(&(1..=8).collect::<Vec<_>>());
        let out = host_u32(&[0xff; 8]);
        let a = d.alloc(32).unwrap();
        let b = d.alloc(32).unwrap();
        // a[2..6] = input[1..5]
        let h2d = submit(&d, 0, copy(host(&input, 4, 16), dev(a, 8, 16)), &[]);
        // b[0..3] = a[3..6] = input[2..5]
        let d2d = submit(&d, 1, copy(dev(a, 12, 12), dev(b, 0, 12)), std::slice::from_ref(&h2d));
        // within one allocation, overlapping: a[1..5] = a[2..6]
        let inner = submit(&d, 2, copy(dev(a, 8, 16), dev(a, 4, 16)), std::slice::from_ref(&d2d));
        // out[4..8] = b[0..4]; out[0..2] = a[0..2]
        submit(&d, 3, copy(dev(b, 0, 16), host(&out, 16, 16)), &[d2d]);
        submit(&d, 4, copy(dev(a, 0, 8), host(&out, 0, 8)), &[inner]);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [0, 2, 0xff, 0xff, 3, 4, 5, 0]);
        assert_eq!(read_u32(&input), (1..=8).collect::<Vec<_>>());
    }

    /// Fills write repetitions of the pattern to a device range.
    #[test]
    pub(crate) fn fill_device_range() {
        let (d, rx) = sim();
        let out = Arc::new(HostStorage::zeroed(32));
        let buf = d.alloc(32).unwrap();
        let pattern = 0xdead_beef_u32.to_ne_bytes().into_iter().collect();
        let f = submit(&d, 0, DeviceOp::Fill { dst: dev(buf, 8, 16), pattern }, &[]);
        submit(&d, 1, copy(dev(buf, 0, 32), host(&out, 0, 32)), &[f]);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [0, 0, 0xdead_beef, 0xdead_beef, 0xdead_beef, 0xdead_beef, 0, 0]);
    }

    /// Memory freed while a submitted operation still uses it stays valid for that
    /// operation.
    #[test]
    pub(crate) fn free_keeps_memory_of_submitted_work() {
        let (d, rx) = sim();
        let input = host_u32(&[1, 2, 3, 4]);
        let out = Arc::new(HostStorage::zeroed(16));
        let buf = d.alloc(16).unwrap();
        let up = submit(&d, 0, copy(host(&input, 0, 16), dev(buf, 0, 16)), &[]);
        let k = submit(&d, 1, add(4, dev(buf, 0, 16), 10), &[up]);
        submit(&d, 2, copy(dev(buf, 0, 16), host(&out, 0, 16)), &[k]);
        d.free(buf);
        assert_eq!(d.allocated_bytes(), 0);
        d.poll();
        assert!(drain(&rx).iter().all(|c| c.result.is_ok()));
        assert_eq!(read_u32(&out), [11, 12, 13, 14]);
    }
}
