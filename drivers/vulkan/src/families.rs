//! Choosing the queue families a driver submits to: a compute family for kernels
//! and command buffers, and, where the device has one and the configuration allows
//! it, a transfer-only family for one-by-one copies, fills, uploads and downloads.
//! Kept apart from the probe as a function of the families' properties, so the
//! choice is tested over made-up family lists (lavapipe has one family).

use ash::vk;

/// Where one-by-one copies, fills, uploads and downloads run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransferQueue {
    /// On a queue of a family with transfer but neither compute nor graphics (a
    /// copy engine) where the device has one, else on the compute queue.
    #[default]
    Dedicated,
    /// Always on the compute queue (one queue family, exclusive buffers).
    ComputeQueue,
}

/// The queue families a driver uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueFamilies {
    /// The first family with compute support (every compute family supports
    /// transfers too): kernels, command buffers and, without `transfer`, transfers.
    pub compute: u32,
    /// The first family with transfer but neither compute nor graphics support and
    /// at least one queue, where one exists and [`TransferQueue::Dedicated`] asks
    /// for it.
    pub transfer: Option<u32>,
}

impl QueueFamilies {
    /// The families buffers are shared between: with a transfer family, buffers are
    /// `VK_SHARING_MODE_CONCURRENT` over both (no ownership transfers between the
    /// queues, which the timeline semaphores alone then order); with one family,
    /// exclusive.
    pub fn sharing(&self) -> Vec<u32> {
        match self.transfer {
            Some(t) => vec![self.compute, t],
            None => vec![self.compute],
        }
    }
}

/// The families to use among `families` (a physical device's, in index order), or
/// `None` where none has compute support and a queue.
pub fn choose_families(
    families: &[vk::QueueFamilyProperties],
    policy: TransferQueue,
) -> Option<QueueFamilies> {
    let has_queue = |f: &vk::QueueFamilyProperties| f.queue_count > 0;
    let compute =
        families.iter().position(|f| has_queue(f) && f.queue_flags.contains(vk::QueueFlags::COMPUTE))?;
    let transfer = match policy {
        TransferQueue::ComputeQueue => None,
        TransferQueue::Dedicated => families.iter().position(|f| {
            has_queue(f)
                && f.queue_flags.contains(vk::QueueFlags::TRANSFER)
                && !f.queue_flags.intersects(vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS)
        }),
    };
    Some(QueueFamilies { compute: compute as u32, transfer: transfer.map(|t| t as u32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn family(flags: vk::QueueFlags, count: u32) -> vk::QueueFamilyProperties {
        vk::QueueFamilyProperties { queue_flags: flags, queue_count: count, ..Default::default() }
    }

    const G: vk::QueueFlags = vk::QueueFlags::GRAPHICS;
    const C: vk::QueueFlags = vk::QueueFlags::COMPUTE;
    const T: vk::QueueFlags = vk::QueueFlags::TRANSFER;
    const S: vk::QueueFlags = vk::QueueFlags::SPARSE_BINDING;

    /// An NVIDIA-like list (graphics+compute, transfer-only, compute-only, video):
    /// compute is the first compute family, transfer the transfer-only one; forcing
    /// the compute queue drops it.
    #[test]
    fn a_transfer_only_family_is_chosen_unless_the_compute_queue_is_forced() {
        let video = vk::QueueFlags::from_raw(0x20);
        let families = [family(G | C | T | S, 16), family(T | S, 2), family(C | T | S, 8), family(video, 1)];
        let chosen = choose_families(&families, TransferQueue::Dedicated).unwrap();
        assert_eq!(chosen, QueueFamilies { compute: 0, transfer: Some(1) });
        assert_eq!(chosen.sharing(), vec![0, 1]);
        let forced = choose_families(&families, TransferQueue::ComputeQueue).unwrap();
        assert_eq!(forced, QueueFamilies { compute: 0, transfer: None });
        assert_eq!(forced.sharing(), vec![0]);
    }

    /// Lavapipe's single family, a compute family that is not the first, families
    /// with transfer plus compute or graphics (not dedicated), an empty family and a
    /// device without compute.
    #[test]
    fn without_a_transfer_only_family_everything_goes_to_the_compute_family() {
        let lavapipe = [family(G | C | T, 1)];
        assert_eq!(
            choose_families(&lavapipe, TransferQueue::Dedicated),
            Some(QueueFamilies { compute: 0, transfer: None })
        );
        let mixed = [family(G | T, 1), family(C | T, 2), family(G | T | S, 1)];
        assert_eq!(
            choose_families(&mixed, TransferQueue::Dedicated),
            Some(QueueFamilies { compute: 1, transfer: None })
        );
        let empty_transfer = [family(C | T, 1), family(T, 0), family(T, 1)];
        assert_eq!(
            choose_families(&empty_transfer, TransferQueue::Dedicated),
            Some(QueueFamilies { compute: 0, transfer: Some(2) })
        );
        let empty_compute = [family(C | T, 0), family(T, 1)];
        assert_eq!(choose_families(&empty_compute, TransferQueue::Dedicated), None);
        assert_eq!(choose_families(&[family(G | T, 1)], TransferQueue::Dedicated), None);
        assert_eq!(choose_families(&[], TransferQueue::Dedicated), None);
    }
}
