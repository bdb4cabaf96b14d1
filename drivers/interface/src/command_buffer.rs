//! Command buffers (the SYCL graph extension's implementation design, "UR
//! Command-Buffer Experimental Feature"): a series of device operations and their
//! dependencies, recorded once when a command graph is finalized and replayed on every
//! submission of the graph.
//!
//! A command buffer does not name memory directly. Its operations address an
//! *argument table*: entry `i` is bound at each submission to the memory of one buffer
//! ([`CommandBufferLaunch::args`]), and an operation's [`RecordedArg`] is a byte range
//! inside an entry. So the same command buffer replays after the scheduler moved a
//! buffer, and a dynamic parameter swaps the buffer behind an entry without
//! re-recording anything.
//!
//! The entry points mirror the UR command-buffer entry points of the SYCL graph
//! extension's implementation design: [`Driver::create_command_buffer`] (create),
//! [`CommandBufferBuilder::append`] (append kernel, copy, fill or marker with sync
//! points), [`CommandBufferBuilder::finalize`] and [`DeviceOp::CommandBuffer`]
//! (enqueue with a wait-list). The generic [`Plan`] is what the CPU and simulated
//! drivers record: a pre-validated list they walk in order at replay.
//!
//! [`Driver::create_command_buffer`]: crate::Driver::create_command_buffer
//! [`DeviceOp::CommandBuffer`]: crate::DeviceOp::CommandBuffer

use std::any::Any;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::error::ExecError;
use crate::kernel::{KernelRef, ScalarBlock};
use crate::memory::{AccessMode, Binding, HostStorage};
use crate::op::SharedHostFn;
use crate::op::{fill_fits, MemArg};
use crate::range::Geometry;

/// A byte range of one argument-table entry, as a recorded operation uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordedArg {
    /// The argument-table entry.
    pub entry: u32,
    /// First byte inside the entry's memory.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
    /// How the operation uses it.
    pub mode: AccessMode,
}

impl RecordedArg {
    /// Its bytes inside `entry`, the memory its argument-table entry is bound to; the
    /// reason when they lie outside it (the entry is shorter than when recorded).
    pub fn bind(&self, entry: Binding) -> Result<Binding, String> {
        let inside = self.offset.checked_add(self.len).is_some_and(|end| end <= entry.len);
        if !inside {
            return Err(format!(
                "recorded range {}..+{} outside argument entry {} of {} bytes",
                self.offset, self.len, self.entry, entry.len
            ));
        }
        // SAFETY: `offset + len` lies within the entry's memory (checked above).
        Ok(Binding::new(unsafe { entry.ptr.add(self.offset) }, self.len))
    }
}

/// A recorded host task's closure, shared with the graph node it came from.
#[derive(Clone)]
pub struct RecordedHostFn(pub SharedHostFn);

impl std::fmt::Debug for RecordedHostFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordedHostFn(..)")
    }
}

/// An operation recorded into a command buffer.
#[derive(Clone, Debug)]
pub enum RecordedOp {
    /// A kernel launch; one argument per global accessor slot.
    Kernel {
        /// The kernel.
        kernel: KernelRef,
        /// Its iteration space.
        geometry: Geometry,
        /// Its arguments.
        args: SmallVec<[RecordedArg; 4]>,
        /// Its scalar arguments, laid out by its signature.
        scalars: ScalarBlock,
    },
    /// A buffer-to-buffer copy of equal lengths.
    Copy {
        /// Source bytes.
        src: RecordedArg,
        /// Destination bytes.
        dst: RecordedArg,
    },
    /// A copy of host data (captured when recorded) into a buffer: the "memory buffer
    /// write" of the SYCL graph extension's implementation design, which some backends
    /// cannot record.
    Write {
        /// The bytes.
        src: Arc<HostStorage>,
        /// Destination bytes.
        dst: RecordedArg,
    },
    /// A copy from a buffer into host memory: the "memory buffer read" of the SYCL
    /// graph extension's implementation design.
    Read {
        /// Source bytes.
        src: RecordedArg,
        /// Where they go.
        dst: Arc<HostStorage>,
    },
    /// A fill with a repeated element pattern.
    Fill {
        /// Destination bytes (a multiple of the pattern's length).
        dst: RecordedArg,
        /// One element's bytes.
        pattern: SmallVec<[u8; 16]>,
    },
    /// Nothing: a synchronization point (empty nodes, barriers).
    Marker,
    /// A host task run in place, between the operations it depends on and those that
    /// depend on it: what a driver whose command buffers run on host threads can
    /// record ([`Capabilities::records_host_tasks`](crate::Capabilities)). Other
    /// drivers refuse it, and a graph gives each host task a partition of its own.
    HostTask {
        /// Its name, in errors.
        name: Arc<str>,
        /// The closure, shared by every replay.
        run: RecordedHostFn,
        /// Its command group's tag.
        tag: u64,
        /// One argument per host accessor slot.
        args: SmallVec<[RecordedArg; 4]>,
    },
}

impl RecordedOp {
    /// A short name for errors: `kernel`, `copy`, `memory buffer write`, …
    pub fn label(&self) -> &'static str {
        match self {
            RecordedOp::Kernel { .. } => "kernel",
            RecordedOp::Copy { .. } => "copy",
            RecordedOp::Write { .. } => "memory buffer write",
            RecordedOp::Read { .. } => "memory buffer read",
            RecordedOp::Fill { .. } => "fill",
            RecordedOp::Marker => "marker",
            RecordedOp::HostTask { .. } => "host task",
        }
    }

    /// Its name in errors: the kernel's, or what kind of operation it is.
    fn name(&self) -> Arc<str> {
        match self {
            RecordedOp::Kernel { kernel, .. } => kernel.name.clone(),
            RecordedOp::HostTask { name, .. } => name.clone(),
            op => op.label().into(),
        }
    }

    /// What it counts for in [`Plan::work_items`]: a kernel its work-items, anything
    /// else one.
    fn work_items(&self) -> usize {
        match self {
            RecordedOp::Kernel { geometry, .. } => geometry.global_size(),
            _ => 1,
        }
    }

    /// Its buffer arguments, in order (no copy).
    pub fn args(&self) -> impl Iterator<Item = &RecordedArg> {
        use std::slice::from_ref;
        let slices: [&[RecordedArg]; 2] = match self {
            RecordedOp::Kernel { args, .. } | RecordedOp::HostTask { args, .. } => [args, &[]],
            RecordedOp::Copy { src, dst } => [from_ref(src), from_ref(dst)],
            RecordedOp::Write { dst, .. } | RecordedOp::Fill { dst, .. } => [from_ref(dst), &[]],
            RecordedOp::Read { src, .. } => [from_ref(src), &[]],
            RecordedOp::Marker => [&[], &[]],
        };
        slices.into_iter().flatten()
    }
}

/// Names an appended operation, so later ones can depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SyncPoint(pub u32);

/// How to create a command buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommandBufferDesc {
    /// Size of the argument table.
    pub entries: usize,
    /// Every operation depends on the one before it (the SYCL graph extension's
    /// implementation design, "In-Order Graph Partitions"): a hint that the backend
    /// needs no synchronization inside.
    pub in_order: bool,
    /// How many operations will be appended: a capacity hint.
    pub ops: usize,
}

/// A finalized command buffer: the driver's own representation, replayed by
/// [`DeviceOp::CommandBuffer`](crate::DeviceOp::CommandBuffer).
pub type CommandBuffer = Arc<dyn Any + Send + Sync>;

/// Records operations into a command buffer.
pub trait CommandBufferBuilder: Send {
    /// Appends `op`, ordered after the operations named in `deps`. Refuses operations
    /// the backend cannot record ([`ExecError::Unsupported`]) and malformed ones.
    fn append(&mut self, op: RecordedOp, deps: &[SyncPoint]) -> Result<SyncPoint, ExecError>;
    /// Ends recording.
    fn finalize(self: Box<Self>) -> Result<CommandBuffer, ExecError>;
}

/// A submission of a command buffer, with its argument table bound to memory.
#[derive(Clone, Debug)]
pub struct CommandBufferLaunch {
    /// The command buffer.
    pub buffer: CommandBuffer,
    /// One per argument-table entry: the whole memory of the buffer behind it.
    pub args: SmallVec<[MemArg; 4]>,
}

/// One operation of a [`Plan`].
#[derive(Clone, Debug)]
pub struct PlannedOp {
    /// The operation.
    pub op: RecordedOp,
    /// Earlier operations it depends on (indexes into [`Plan::ops`]; four inline take
    /// no more room than two).
    pub deps: SmallVec<[u32; 4]>,
}

/// The generic recorded form of a command buffer: operations in an order that respects
/// their dependencies, validated against the argument table when appended. Replaying
/// it in order is always correct; a driver may overlap independent operations.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Size of the argument table.
    pub entries: usize,
    /// Whether each operation depends on the previous one.
    pub in_order: bool,
    /// The operations, dependencies first.
    pub ops: Vec<PlannedOp>,
    /// Total work-items of its kernels, plus one per other operation: drivers use it
    /// to decide where to run a replay.
    pub work_items: usize,
}

impl Plan {
    /// Replays the operations in order through `run` and returns each one's error
    /// (empty when none failed). An operation whose dependency failed, directly or
    /// not, is not run: it fails with a dependency error naming the failed one, and
    /// independent operations still run. Both drivers' replays go through here.
    /// Dependencies must point to earlier operations, as [`PlanBuilder`] makes them.
    pub fn replay(
        &self,
        mut run: impl FnMut(usize, &RecordedOp) -> Result<(), ExecError>,
    ) -> Vec<Option<ExecError>> {
        // `failed[i]`: operation `i`'s error and the one its dependents get;
        // allocated at the first failure.
        let mut failed: Vec<Option<(ExecError, ExecError)>> = Vec::new();
        for (i, planned) in self.ops.iter().enumerate() {
            let blocked = if failed.is_empty() {
                None // the common case: nothing failed, no dependency to look at
            } else {
                planned.deps.iter().find_map(|&d| failed[d as usize].as_ref().map(|f| f.1.clone()))
            };
            let result = match blocked {
                Some(e) => Err(e),
                None => run(i, &planned.op),
            };
            if let Err(e) = result {
                if failed.is_empty() {
                    failed = vec![None; self.ops.len()];
                }
                let for_dependents = e.as_dependency_of(planned.op.name());
                failed[i] = Some((e, for_dependents));
            }
        }
        failed.into_iter().map(|f| f.map(|(own, _)| own)).collect()
    }

    /// Gives each operation the payload of `patch[i]`: operation `i` takes its
    /// kernel, host data or fill pattern over the same arguments and dependencies
    /// (see [`Driver::patch_command_buffer`](crate::Driver::patch_command_buffer)).
    /// A patch of another length, one that does not match its operation's kind, or a
    /// kernel with another number of buffer slots is refused with the reason, and
    /// nothing changes: every operation is checked before any changes.
    pub fn apply_patches(&mut self, patch: &[OpPatch<'_>]) -> Result<(), String> {
        if patch.len() != self.ops.len() {
            return Err(format!("{} patches for {} operations", patch.len(), self.ops.len()));
        }
        for (i, (planned, change)) in self.ops.iter().zip(patch).enumerate() {
            patch_fits(&planned.op, change).map_err(|e| format!("operation {i}{e}"))?;
        }
        let mut work_items = 0;
        for (planned, change) in self.ops.iter_mut().zip(patch) {
            apply_patch(&mut planned.op, change);
            work_items += planned.op.work_items();
        }
        self.work_items = work_items;
        Ok(())
    }
}

/// Why `change` does not fit `op`, if it does not.
fn patch_fits(op: &RecordedOp, change: &OpPatch<'_>) -> Result<(), String> {
    let fits = match (op, change) {
        (_, OpPatch::Keep) => true,
        (RecordedOp::Kernel { args, .. }, OpPatch::Kernel { kernel, scalars, .. }) => {
            if kernel.signature.globals.len() != args.len() {
                return Err(format!(
                    ": kernel `{}` has {} buffer slots, the recorded one {}",
                    kernel.name,
                    kernel.signature.globals.len(),
                    args.len()
                ));
            }
            if kernel.signature.scalar_bytes() != scalars.len() {
                return Err(format!(
                    ": kernel `{}` takes {} bytes of scalars, the patch gives {}",
                    kernel.name,
                    kernel.signature.scalar_bytes(),
                    scalars.len()
                ));
            }
            true
        }
        (RecordedOp::Write { dst, .. }, OpPatch::Write(data)) => data.len() == dst.len,
        (RecordedOp::Read { src, .. }, OpPatch::Read(out)) => out.len() == src.len,
        (RecordedOp::Fill { dst, .. }, OpPatch::Fill(p)) => fill_fits(dst.len, p),
        _ => false,
    };
    match fits {
        true => Ok(()),
        false => Err(format!(" is a {}; the patch {change:?} does not fit it", op.label())),
    }
}

/// Gives `op` the payload of `change`, which [`patch_fits`] accepted.
fn apply_patch(op: &mut RecordedOp, change: &OpPatch<'_>) {
    match (op, *change) {
        (
            RecordedOp::Kernel { kernel, geometry, scalars, .. },
            OpPatch::Kernel { kernel: k, geometry: g, scalars: s },
        ) => {
            if !Arc::ptr_eq(kernel, k) {
                *kernel = k.clone();
            }
            *geometry = *g;
            if scalars[..] != *s {
                *scalars = SmallVec::from_slice(s);
            }
        }
        (RecordedOp::Write { src, .. }, OpPatch::Write(data)) => *src = data.clone(),
        (RecordedOp::Read { dst, .. }, OpPatch::Read(out)) => *dst = out.clone(),
        (RecordedOp::Fill { pattern, .. }, OpPatch::Fill(p)) => *pattern = SmallVec::from_slice(p),
        _ => {} // `Keep`
    }
}

/// Runs `patch` on the driver's command-buffer type `T` behind `buffer`: in place
/// where nothing else holds the buffer, else on a copy made with `copy` that then
/// replaces it, so submissions already made keep the original. `None` when `buffer`
/// is not a `T`. When `patch` fails on a copy, `buffer` is left as it was; in place,
/// `patch` must leave it so itself.
pub fn patch_buffer<T: Any + Send + Sync, E>(
    buffer: &mut CommandBuffer,
    copy: impl FnOnce(&T) -> T,
    patch: impl FnOnce(&mut T) -> Result<(), E>,
) -> Option<Result<(), E>> {
    if let Some(unique) = Arc::get_mut(buffer) {
        return Some(patch(unique.downcast_mut::<T>()?));
    }
    let mut copied = copy(buffer.downcast_ref::<T>()?);
    Some(patch(&mut copied).map(|()| *buffer = Arc::new(copied)))
}

/// What patching a command buffer changes in one operation
/// ([`Driver::patch_command_buffer`](crate::Driver::patch_command_buffer)): its
/// payload, never its arguments or dependencies. It borrows the payload from where
/// the caller keeps it (a graph's nodes), so building a patch moves no reference
/// counts; the operation clones what it takes.
#[derive(Clone, Copy, Debug)]
pub enum OpPatch<'a> {
    /// Nothing.
    Keep,
    /// Another kernel with as many buffer slots, its iteration space and scalars.
    Kernel {
        /// The kernel.
        kernel: &'a KernelRef,
        /// Its iteration space.
        geometry: &'a Geometry,
        /// Its scalar block.
        scalars: &'a [u8],
    },
    /// Other host bytes for a memory buffer write (of the same length).
    Write(&'a Arc<HostStorage>),
    /// Other host memory for a memory buffer read (of the same length).
    Read(&'a Arc<HostStorage>),
    /// Another fill pattern (dividing the destination's length).
    Fill(&'a [u8]),
}

/// Records a [`Plan`], refusing what the backend's `accepts` says it cannot run, and
/// finalizes it into the backend's command-buffer type with `wrap`.
pub struct PlanBuilder {
    plan: Plan,
    device: Arc<str>,
    accepts: fn(&RecordedOp) -> bool,
    wrap: fn(Plan) -> CommandBuffer,
}

impl PlanBuilder {
    /// Starts a plan for `device`; `accepts` says which operations it can record,
    /// `wrap` makes the finished plan a command buffer.
    pub fn new(
        desc: CommandBufferDesc,
        device: Arc<str>,
        accepts: fn(&RecordedOp) -> bool,
        wrap: fn(Plan) -> CommandBuffer,
    ) -> Self {
        let plan = Plan {
            entries: desc.entries,
            in_order: desc.in_order,
            ops: Vec::with_capacity(desc.ops),
            work_items: 0,
        };
        Self { plan, device, accepts, wrap }
    }

    fn invalid(&self, message: String) -> ExecError {
        ExecError::Driver { device: self.device.clone(), message }
    }
}

impl CommandBufferBuilder for PlanBuilder {
    fn append(&mut self, op: RecordedOp, deps: &[SyncPoint]) -> Result<SyncPoint, ExecError> {
        if !(self.accepts)(&op) {
            return Err(ExecError::Unsupported { device: self.device.clone(), what: op.label() });
        }
        let index = self.plan.ops.len() as u32;
        if let Some(d) = deps.iter().find(|d| d.0 >= index) {
            return Err(self.invalid(format!("sync point {} names no earlier command", d.0)));
        }
        for a in op.args() {
            if a.entry as usize >= self.plan.entries {
                return Err(self.invalid(format!(
                    "argument entry {} outside a table of {}",
                    a.entry, self.plan.entries
                )));
            }
        }
        match &op {
            RecordedOp::Kernel { kernel, args, .. } if args.len() != kernel.signature.globals.len() => {
                return Err(self.invalid(format!(
                    "kernel `{}` has {} buffer slots but {} arguments",
                    kernel.name,
                    kernel.signature.globals.len(),
                    args.len()
                )));
            }
            RecordedOp::Kernel { kernel, scalars, .. }
                if scalars.len() != kernel.signature.scalar_bytes() =>
            {
                return Err(self.invalid(format!(
                    "kernel `{}` takes {} bytes of scalars but {} are recorded",
                    kernel.name,
                    kernel.signature.scalar_bytes(),
                    scalars.len()
                )));
            }
            RecordedOp::Copy { src, dst } if src.len != dst.len => {
                return Err(self.invalid(format!("copy of {} bytes into {} bytes", src.len, dst.len)));
            }
            RecordedOp::Fill { dst, pattern } if !fill_fits(dst.len, pattern) => {
                return Err(self.invalid(format!(
                    "fill of {} bytes with a {}-byte pattern",
                    dst.len,
                    pattern.len()
                )));
            }
            _ => {}
        }
        let mut deps: SmallVec<[u32; 4]> = deps.iter().map(|d| d.0).collect();
        if self.plan.in_order && index > 0 && !deps.contains(&(index - 1)) {
            deps.push(index - 1);
        }
        self.plan.work_items += op.work_items();
        self.plan.ops.push(PlannedOp { op, deps });
        Ok(SyncPoint(index))
    }

    fn finalize(self: Box<Self>) -> Result<CommandBuffer, ExecError> {
        Ok((self.wrap)(self.plan))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Plan {
        /// The plan behind a test builder's command buffer.
        fn of(buffer: &CommandBuffer) -> Option<&Plan> {
            buffer.downcast_ref::<Plan>()
        }
    }

    fn arg(entry: u32, len: usize) -> RecordedArg {
        RecordedArg { entry, offset: 0, len, mode: AccessMode::ReadWrite }
    }

    fn builder(in_order: bool) -> Box<dyn CommandBufferBuilder> {
        let accepts = |op: &RecordedOp| !matches!(op, RecordedOp::Read { .. });
        let desc = CommandBufferDesc { entries: 2, in_order, ops: 0 };
        Box::new(PlanBuilder::new(desc, "test".into(), accepts, |plan| Arc::new(plan)))
    }

    fn test_kernel(name: &str, slots: usize) -> KernelRef {
        let mut signature = crate::kernel::Signature::new();
        for _ in 0..slots {
            signature = signature.global(AccessMode::ReadWrite);
        }
        Arc::new(crate::kernel::Kernel::new(name, signature))
    }

    fn geometry(n: usize) -> Geometry {
        Geometry::for_range(crate::range::Range::d1(n)).unwrap()
    }

    /// A kernel "a" over 4 items, a fill and a copy.
    fn recorded() -> CommandBuffer {
        let mut b = builder(true);
        let args: SmallVec<[RecordedArg; 4]> = smallvec::smallvec![arg(0, 8), arg(1, 8)];
        let kernel = RecordedOp::Kernel {
            kernel: test_kernel("a", 2),
            geometry: geometry(4),
            args,
            scalars: SmallVec::new(),
        };
        b.append(kernel, &[]).unwrap();
        b.append(RecordedOp::Fill { dst: arg(1, 8), pattern: [1, 2].into_iter().collect() }, &[]).unwrap();
        b.append(RecordedOp::Copy { src: arg(0, 8), dst: arg(1, 8) }, &[]).unwrap();
        b.finalize().unwrap()
    }

    fn kernel_name(plan: &Plan) -> (&str, usize) {
        match &plan.ops[0].op {
            RecordedOp::Kernel { kernel, geometry, .. } => (&kernel.name, geometry.global_size()),
            op => panic!("{op:?}"),
        }
    }

    /// A patch replaces payloads and keeps arguments and dependencies; patching with
    /// the original payloads undoes it. A patch that does not fit its operation is
    /// refused with the operation named, and nothing changes, also where earlier
    /// operations fit.
    #[test]
    fn patches_replace_payloads_only() {
        let buffer = recorded();
        let original = Plan::of(&buffer).unwrap();
        let mut plan = original.clone();
        let (b, g16, fill) = (test_kernel("b", 2), geometry(16), [7u8; 4]);
        let patch = [
            OpPatch::Kernel { kernel: &b, geometry: &g16, scalars: &[] },
            OpPatch::Fill(&fill),
            OpPatch::Keep,
        ];
        plan.apply_patches(&patch).unwrap();
        assert_eq!(kernel_name(&plan), ("b", 16));
        let args =
            |p: &Plan| p.ops.iter().map(|o| o.op.args().copied().collect::<Vec<_>>()).collect::<Vec<_>>();
        assert_eq!(args(&plan), args(original), "arguments kept");
        assert!(matches!(&plan.ops[1].op, RecordedOp::Fill { pattern, .. } if pattern.as_slice() == [7; 4]));
        assert!(matches!(plan.ops[2].op, RecordedOp::Copy { .. }));
        let deps = |p: &Plan| p.ops.iter().map(|o| o.deps.clone()).collect::<Vec<_>>();
        assert_eq!(deps(&plan), deps(original), "in-order dependencies kept");
        assert_eq!(plan.work_items, 16 + 1 + 1);

        let RecordedOp::Kernel { kernel: a, geometry: g4, .. } = &original.ops[0].op else { unreachable!() };
        let back = [
            OpPatch::Kernel { kernel: a, geometry: g4, scalars: &[] },
            OpPatch::Fill(&[1, 2]),
            OpPatch::Keep,
        ];
        plan.apply_patches(&back).unwrap();
        assert_eq!(kernel_name(&plan), ("a", 4), "the original payloads undo it");
        assert!(matches!(&plan.ops[1].op, RecordedOp::Fill { pattern, .. } if pattern.as_slice() == [1, 2]));
        assert_eq!(plan.work_items, original.work_items);

        let mut refused = |patch: &[OpPatch<'_>]| {
            let e = plan.apply_patches(patch).unwrap_err();
            assert_eq!(kernel_name(&plan), ("a", 4), "unchanged after `{e}`");
            assert!(
                matches!(&plan.ops[1].op, RecordedOp::Fill { pattern, .. } if pattern.as_slice() == [1, 2])
            );
            e
        };
        assert!(refused(&[OpPatch::Keep]).contains("1 patches for 3 operations"));
        let (c, g4) = (test_kernel("c", 3), geometry(4));
        let wrong_slots = OpPatch::Kernel { kernel: &c, geometry: &g4, scalars: &[] };
        assert!(refused(&[wrong_slots, OpPatch::Keep, OpPatch::Keep]).contains("3 buffer slots"));
        let d = test_kernel("d", 2);
        let fine = OpPatch::Kernel { kernel: &d, geometry: &g4, scalars: &[] };
        let fill_of_3 = OpPatch::Fill(&[1, 2, 3]);
        assert!(refused(&[fine, fill_of_3, OpPatch::Keep]).contains("operation 1 is a fill"));
        let host = Arc::new(HostStorage::zeroed(8));
        let write = OpPatch::Write(&host);
        assert!(refused(&[fine, OpPatch::Fill(&fill), write]).contains("operation 2 is a copy"));
    }

    /// A kernel's scalar arguments are patched like its other payloads, and must
    /// fill the kernel's scalar block: recording and patching check their size.
    #[test]
    fn scalars_are_recorded_and_patched_by_size() {
        use crate::kernel::{Kernel, Signature};
        let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<u32>();
        let kernel = Kernel::new("scaled", sig).into_ref();
        let op = |scalars: &[u8]| RecordedOp::Kernel {
            kernel: kernel.clone(),
            geometry: geometry(4),
            args: smallvec::smallvec![arg(0, 8)],
            scalars: SmallVec::from_slice(scalars),
        };
        let mut b = builder(true);
        let e = b.append(op(&[1, 0]), &[]).unwrap_err();
        assert!(e.to_string().contains("takes 4 bytes of scalars but 2 are recorded"), "{e}");
        b.append(op(&2u32.to_ne_bytes()), &[]).unwrap();
        let mut plan = Plan::of(&b.finalize().unwrap()).unwrap().clone();
        let g4 = geometry(4);
        let patch = |scalars| OpPatch::Kernel { kernel: &kernel, geometry: &g4, scalars };
        let e = plan.apply_patches(&[patch(&[0; 8])]).unwrap_err();
        assert!(e.contains("takes 4 bytes of scalars, the patch gives 8"), "{e}");
        plan.apply_patches(&[patch(&7u32.to_ne_bytes())]).unwrap();
        let RecordedOp::Kernel { scalars, .. } = &plan.ops[0].op else { unreachable!() };
        assert_eq!(scalars[..], 7u32.to_ne_bytes());
    }

    /// `patch_buffer` patches a command buffer nothing else holds in place, and a
    /// shared one in a copy that leaves the original to its other holders.
    #[test]
    fn buffers_are_patched_in_place_unless_shared() {
        let g8 = geometry(8);
        let swap = |kernel: KernelRef| {
            move |plan: &mut Plan| {
                plan.apply_patches(&[
                    OpPatch::Kernel { kernel: &kernel, geometry: &g8, scalars: &[] },
                    OpPatch::Keep,
                    OpPatch::Keep,
                ])
            }
        };
        let mut buffer = recorded();
        let at = Arc::as_ptr(&buffer) as *const u8;
        patch_buffer(&mut buffer, Plan::clone, swap(test_kernel("b", 2))).unwrap().unwrap();
        assert_eq!(Arc::as_ptr(&buffer) as *const u8, at, "in place");
        assert_eq!(kernel_name(Plan::of(&buffer).unwrap()), ("b", 8));

        let held = buffer.clone(); // a submission holding it
        patch_buffer(&mut buffer, Plan::clone, swap(test_kernel("c", 2))).unwrap().unwrap();
        assert_ne!(Arc::as_ptr(&buffer) as *const u8, at, "a copy");
        assert_eq!(kernel_name(Plan::of(&buffer).unwrap()), ("c", 8));
        assert_eq!(kernel_name(Plan::of(&held).unwrap()), ("b", 8), "the held one is unchanged");

        let mut failing = held.clone();
        let refused = patch_buffer(&mut failing, Plan::clone, |_: &mut Plan| Err("no"));
        assert_eq!(refused, Some(Err("no")));
        assert!(Arc::ptr_eq(&failing, &held), "a failed patch of a copy leaves the buffer as it was");
        let other: CommandBuffer = Arc::new(0u32);
        assert!(
            patch_buffer(&mut other.clone(), Plan::clone, swap(test_kernel("d", 2))).is_none(),
            "not a plan"
        );
    }

    #[test]
    fn appends_validate_entries_dependencies_and_support() {
        let mut b = builder(false);
        let a =
            b.append(RecordedOp::Fill { dst: arg(0, 8), pattern: [1, 2, 3, 4].into_iter().collect() }, &[]);
        assert_eq!(a, Ok(SyncPoint(0)));
        assert!(matches!(b.append(RecordedOp::Marker, &[SyncPoint(5)]), Err(ExecError::Driver { .. })));
        assert!(matches!(
            b.append(RecordedOp::Copy { src: arg(0, 8), dst: arg(2, 8) }, &[]),
            Err(ExecError::Driver { .. })
        ));
        assert!(matches!(
            b.append(RecordedOp::Copy { src: arg(0, 8), dst: arg(1, 4) }, &[]),
            Err(ExecError::Driver { .. })
        ));
        let read = RecordedOp::Read { src: arg(0, 4), dst: Arc::new(HostStorage::zeroed(4)) };
        assert!(matches!(
            b.append(read, &[]),
            Err(ExecError::Unsupported { what: "memory buffer read", .. })
        ));
        assert_eq!(
            b.append(RecordedOp::Copy { src: arg(0, 8), dst: arg(1, 8) }, &[SyncPoint(0)]),
            Ok(SyncPoint(1))
        );
        let plan = b.finalize().unwrap();
        let plan = Plan::of(&plan).unwrap();
        assert_eq!(plan.ops.len(), 2);
        assert_eq!(plan.ops[1].deps.as_slice(), &[0]);
    }

    #[test]
    fn in_order_buffers_chain_every_operation() {
        let mut b = builder(true);
        for _ in 0..3 {
            b.append(RecordedOp::Marker, &[]).unwrap();
        }
        let plan = b.finalize().unwrap();
        let deps: Vec<Vec<u32>> = Plan::of(&plan).unwrap().ops.iter().map(|o| o.deps.to_vec()).collect();
        assert_eq!(deps, vec![vec![], vec![0], vec![1]]);
    }
}
