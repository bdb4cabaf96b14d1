//! What operations cost in virtual time: the device's [`CostModel`], the engines an
//! operation occupies and the link a copy crosses.

use crate::machine::{OpWork, SimDriver};

/// The simulated device's cost model. Zero means free (costs) or unlimited (engines).
///
/// ```
/// use gantry_sim::CostModel;
/// // A small discrete GPU: 64 lanes at 1 ns per work-item, 500 GB/s of memory,
/// // a 25 GB/s host link, one compute and two copy engines.
/// let gpu = CostModel {
///     item_ns: 1.0,
///     compute_units: 64,
///     memory_bytes_per_ns: 500.0,
///     link_bytes_per_ns: 25.0,
///     compute_engines: 1,
///     copy_engines: 2,
/// };
/// assert_eq!(gpu.kernel_ns(6400, &gantry_driver::ItemCost::default(), 0), 100);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostModel {
    /// Cost of one work-item when the kernel declares none, in nanoseconds.
    pub item_ns: f64,
    /// Work-items that run at once.
    pub compute_units: u32,
    /// Device memory bandwidth, in bytes per nanosecond (GB/s): bounds kernels (by the
    /// bytes their arguments span), fills and device-to-device copies.
    pub memory_bytes_per_ns: f64,
    /// Host↔device link bandwidth, in bytes per nanosecond: bounds copies with one
    /// side in host memory.
    pub link_bytes_per_ns: f64,
    /// Kernels and fills that may run at once.
    pub compute_engines: u32,
    /// Copies that may run at once.
    pub copy_engines: u32,
}

pub(crate) fn per(bytes: usize, bytes_per_ns: f64) -> f64 {
    if bytes_per_ns > 0.0 {
        bytes as f64 / bytes_per_ns
    } else {
        0.0
    }
}

impl CostModel {
    /// Virtual time of a kernel's work (beyond the fixed latency): compute or memory,
    /// whichever bounds it.
    pub fn kernel_ns(&self, items: usize, cost: &gantry_driver::ItemCost, bytes: usize) -> u64 {
        let lanes = self.compute_units.max(1) as f64;
        let compute = items as f64 * cost.resolve(self.item_ns) / lanes;
        compute.max(per(bytes, self.memory_bytes_per_ns)).ceil() as u64
    }
    /// Virtual time of a copy of `bytes`, over the link when one side is host memory.
    pub fn copy_ns(&self, bytes: usize, over_link: bool) -> u64 {
        let bw = if over_link { self.link_bytes_per_ns } else { self.memory_bytes_per_ns };
        per(bytes, bw).ceil() as u64
    }
    /// Virtual time of a fill of `bytes`.
    pub fn fill_ns(&self, bytes: usize) -> u64 {
        per(bytes, self.memory_bytes_per_ns).ceil() as u64
    }
}

/// Which engines an operation occupies.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Engine {
    Compute,
    Copy,
    #[default]
    None,
}

/// What a copy's bytes cross, which sets its bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Link {
    /// Within one device's memory (or within host memory on the host pool).
    Local,
    /// Between host and device memory.
    Host,
    /// From a peer device's memory, over the device-to-device link.
    Peer,
}

impl SimDriver {
    /// The engine class an operation occupies and its virtual work time.
    pub(crate) fn cost_of(&self, work: &OpWork) -> (Engine, u64) {
        match work {
            OpWork::Marker | OpWork::Invalid(_) => (Engine::None, 0),
            OpWork::Copy { src, link: Link::Peer, .. } => {
                (Engine::Copy, per(src.len, self.machine.config.peer_bytes_per_ns).ceil() as u64)
            }
            OpWork::Copy { src, link, .. } => (Engine::Copy, self.cost.copy_ns(src.len, *link == Link::Host)),
            OpWork::Host(task) => (Engine::Compute, task.ns),
            OpWork::Fill { dst, .. } => (Engine::Compute, self.cost.fill_ns(dst.len)),
            OpWork::Kernel(k) => {
                let bytes = k.args.iter().map(|(r, _)| r.len).sum();
                let items = k.geometry.global_size();
                (Engine::Compute, self.cost.kernel_ns(items, &k.kernel.cost, bytes))
            }
            OpWork::Plan(plan) => plan.cost,
        }
    }

    /// The cost of a replay of these steps: one engine for the whole replay (compute if
    /// anything needs it) and the sum of their times.
    pub(crate) fn replay_cost(steps: impl Iterator<Item = (Engine, u64)>) -> (Engine, u64) {
        steps.fold((Engine::None, 0u64), |(engine, ns), (e, t)| {
            let engine = match (engine, e) {
                (Engine::Compute, _) | (_, Engine::Compute) => Engine::Compute,
                (Engine::Copy, _) | (_, Engine::Copy) => Engine::Copy,
                _ => Engine::None,
            };
            (engine, ns.saturating_add(t))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// Copies cross the link at its bandwidth; one copy engine serializes independent
    /// copies, two let them overlap.
    #[test]
    fn copy_engines_limit_overlap() {
        for (engines, second) in [(1, (110, 220)), (2, (0, 110))] {
            let (d, rx) =
                costed(CostModel { link_bytes_per_ns: 10.0, copy_engines: engines, ..Default::default() });
            let a = d.alloc(1000).unwrap();
            let b = d.alloc(1000).unwrap();
            let src = HostStorage::zeroed(1000);
            let src = Arc::new(src);
            submit(&d, 1, copy(host(&src, 0, 1000), dev(a, 0, 1000)), &[]);
            submit(&d, 2, copy(host(&src, 0, 1000), dev(b, 0, 1000)), &[]);
            d.poll();
            assert_eq!(spans(&rx), vec![(1, 0, 110), (2, second.0, second.1)], "{engines} engines");
        }
    }

    /// Kernels take work-items over compute units at the declared or default per-item
    /// cost, or bytes over memory bandwidth when that is slower; kernels and copies use
    /// different engines and overlap.
    #[test]
    fn kernels_are_compute_or_memory_bound() {
        let model = CostModel {
            item_ns: 1.0,
            compute_units: 64,
            memory_bytes_per_ns: 100.0,
            link_bytes_per_ns: 10.0,
            compute_engines: 1,
            copy_engines: 1,
        };
        let (d, rx) = costed(model);
        let n = 6400;
        let buf = d.alloc(n * 4).unwrap();
        // 6,400 items / 64 lanes = 100 ns of compute; 25,600 bytes / 100 = 256 ns of memory.
        submit(&d, 1, add(n, dev(buf, 0, n * 4), 1), &[]);
        let mut heavy = add(n, dev(buf, 0, n * 4), 1);
        if let DeviceOp::Kernel(launch) = &mut heavy {
            // 1,000 ns of compute: compute-bound.
            launch.kernel = with_cost(&launch.kernel, gantry_driver::ItemCost::of(Some(10.0)));
        }
        submit(&d, 2, heavy, &[]);
        let other = d.alloc(100).unwrap();
        let src = Arc::new(HostStorage::zeroed(100));
        submit(&d, 3, copy(host(&src, 0, 100), dev(other, 0, 100)), &[]);
        d.poll();
        assert_eq!(spans(&rx), vec![(1, 0, 266), (2, 266, 1276), (3, 0, 20)]);
        assert_eq!(model.kernel_ns(n, &gantry_driver::ItemCost::default(), 0), 100);
    }
}
