//! What a device that simulates time needs to know of an operation beyond the
//! operation itself, in one optional hint that real-time drivers ignore.

/// Timing for devices on a virtual clock
/// ([`Capabilities::virtual_time`](crate::Capabilities)): the scheduler attaches it
/// to their submissions only ([`Submission::hint`](crate::Submission)). A kernel's
/// declared cost per work-item travels with the kernel
/// ([`Kernel::cost`](crate::Kernel)), since command buffers and fused kernels carry
/// kernels without a submission of their own.
///
/// ```
/// use gantry_driver::SimHint;
/// let hint = SimHint { not_before_ns: 1_500, ..Default::default() };
/// assert_eq!(hint.host_task_ns, None, "the device's default duration");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SimHint {
    /// When, in virtual time, the dependencies not in the wait-list ended (0 when none
    /// did): the operation must not start earlier.
    pub not_before_ns: u64,
    /// A host task's declared duration on a simulated host thread pool, in
    /// nanoseconds (`item_cost_ns` on its command group); `None`: the pool's default.
    pub host_task_ns: Option<f64>,
}
