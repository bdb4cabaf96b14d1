//! The fusion compiler for closure kernels (the DPC++ kernel-fusion design, "Fusion
//! Process"): the ND-range rules and work-item remapping, internalization, the fused
//! kernel's body and the kernels it stands for. The request and answer types, and
//! the [`FusionCompiler`] trait it implements, are the driver contract's
//! ([`gantry_driver::fusion`]).
//!
//! [`ClosureFusion`] fuses closure kernels: the fused kernel runs, per work-group,
//! each kernel's phases in list order (the group barrier between phases is the barrier
//! fusion inserts), or, without barriers, each work-item's bodies back to back. Its
//! plans are cached by the kernels' code, ranges and argument layout, so fusing the
//! same chain every frame costs a lookup; the cache holds a bounded number of plans
//! and evicts the least recently used one first
//! ([`ClosureFusion::with_capacity`]). Scalars are baked in already: a closure
//! captures its arguments by value, so the runtime constants that the DPC++
//! kernel-fusion design propagates have nothing left to propagate here; the LLVM JIT
//! will take them through this same request.
//!
//! ```
//! use std::sync::Arc;
//! use gantry_driver::fusion::{FusionArg, FusionCompiler, FusionKernel, FusionRequest};
//! use gantry_driver::{AccessMode, Binding, Geometry, ItemCost, Range};
//! use gantry_host::fusion::ClosureFusion;
//! use gantry_host::{phase, Accessor, Arena, ClosureImage, ClosureKernel, ReadWrite};
//!
//! // Two kernels over one buffer: x = x + 1, then x = x * 2.
//! let kernel = |tag: u64, f: fn(u32) -> u32| {
//!     let acc = Accessor::<u32, ReadWrite>::new(0, tag, 8);
//!     let closure = ClosureKernel {
//!         tag,
//!         phases: smallvec::smallvec![phase(move |it| {
//!             let i = it.global_linear_id();
//!             acc.set(it, i, f(acc.get(it, i)))
//!         })],
//!         global_slots: 1,
//!         scratch: vec![],
//!         unfused: None,
//!     };
//!     closure.into_kernel("step", [AccessMode::ReadWrite], ItemCost::default())
//! };
//! let geometry = Geometry::for_range(Range::d1(8)).unwrap();
//! let arg = FusionArg::new(1, 0..32, 4);
//! let request = FusionRequest {
//!     kernels: vec![
//!         FusionKernel {
//!             kernel: kernel(1, |x| x + 1),
//!             geometry,
//!             args: smallvec::smallvec![arg.clone()],
//!             deps: smallvec::smallvec![],
//!             scalars: Default::default(),
//!         },
//!         // It depends on the first kernel (through the buffer).
//!         FusionKernel {
//!             kernel: kernel(2, |x| x * 2),
//!             geometry,
//!             args: smallvec::smallvec![arg],
//!             deps: smallvec::smallvec![0],
//!             scalars: Default::default(),
//!         },
//!     ],
//!     barriers: true,
//! };
//! let fused = ClosureFusion::new().fuse(&request).unwrap();
//! assert_eq!(fused.args.len(), 1, "one argument per buffer");
//! let mut data = [1u32; 8];
//! let globals = [Binding::new(data.as_mut_ptr().cast(), 32)];
//! fused.kernel.closure().unwrap().run_group(&fused.geometry, 0, &globals, &mut Arena::default());
//! assert_eq!(data, [4; 8]);
//! ```

use rustc_hash::{FxHashMap, FxHasher};
use std::any::TypeId;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use gantry_driver::fusion::{
    Fused, FusedArg, FusionCompiler, FusionError, FusionRequest, FusionWarning, InternalArg, KeptOnFailure,
    Promotion, Unprofitable,
};
use gantry_driver::{AccessMode, Geometry, ImageKind, KernelRef, ScalarBlock, Scratch};
use smallvec::SmallVec;

use crate::closure::{ClosureImage, ClosureKernel, Elementwise, Phase};
use crate::item::GroupCtx;

mod body;
mod plan;
#[cfg(test)]
mod tests;

pub use body::Unfused;
use body::{FusedBody, Part};
use plan::{plan, FusionPlan};

/// The closure image of a kernel [`ClosureFusion::fuse`] has checked.
fn closure_of(kernel: &KernelRef) -> &ClosureKernel {
    kernel.closure().expect("checked by ClosureFusion::fuse")
}

/// One item of a plan's cache key. A request's key is the sequence [`key_parts`]
/// yields: the barrier flag, then per kernel its shape, its phases' code (with what
/// an elementwise phase touches), its geometry, its scratch, and per slot the
/// canonical buffer, byte range, element size and promotion. A lookup hashes and
/// collects that sequence on the stack, so a cache hit allocates nothing. (Hashed in
/// part, by [`key_hash`].)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyPart {
    Barriers(bool),
    Kernel { phases: usize, scratch: usize, slots: usize },
    Phase(TypeId, Option<Elementwise>),
    Geometry(Geometry),
    Scratch(Scratch),
    Slot { buffer: usize, start: usize, end: usize, elem_size: usize, promotion: Promotion },
}

/// The request's cache key, buffers numbered by `buffers` (see [`KeyPart`]), written
/// into `key`. (Plain loops: the same sequence as a chain of iterators costs several
/// times the instructions, a good part of a cache hit; figures: `docs/PERFORMANCE.md`.)
fn key_parts(request: &FusionRequest, buffers: &[u64], key: &mut SmallVec<[KeyPart; 16]>) {
    key.push(KeyPart::Barriers(request.barriers));
    for k in &request.kernels {
        let kernel = closure_of(&k.kernel);
        key.push(KeyPart::Kernel {
            phases: kernel.phases.len(),
            scratch: kernel.scratch.len(),
            slots: k.args.len(),
        });
        for p in &kernel.phases {
            key.push(KeyPart::Phase(p.code, p.elementwise.as_ref().map(|e| e.touches)));
        }
        key.push(KeyPart::Geometry(k.geometry));
        for &s in &kernel.scratch {
            key.push(KeyPart::Scratch(s));
        }
        for a in &k.args {
            let buffer = buffers.iter().position(|&x| x == a.buffer).expect("buffer numbered");
            key.push(KeyPart::Slot {
                buffer,
                start: a.start,
                end: a.end,
                elem_size: a.elem_size,
                promotion: a.promotion,
            });
        }
    }
}

/// The hash a key is filed under: its length, its phases' code and its slots' byte
/// ranges. Equal keys hash equally; keys that differ only elsewhere (geometry,
/// scratch, element sizes) share a bucket and are told apart by comparison, which
/// stops at the first differing part. Hashing every part, the 80-byte geometries
/// most of all, cost more than the comparison of a hit.
fn key_hash(key: &[KeyPart]) -> u64 {
    let mut h = FxHasher::default();
    h.write_usize(key.len());
    for part in key {
        match part {
            KeyPart::Phase(code, _) => code.hash(&mut h),
            KeyPart::Slot { start, end, .. } => {
                h.write_usize(*start);
                h.write_usize(*end);
            }
            _ => {}
        }
    }
    h.finish()
}

/// A cached plan, with the fused kernel's name for the kernel names it was last
/// asked for (names are not part of the key: the same code may run under others).
struct Cached {
    key: Box<[KeyPart]>,
    plan: Arc<FusionPlan>,
    names: Vec<Arc<str>>,
    name: Arc<str>,
    /// The cache's tick when the plan was last inserted or hit: the plan with the
    /// smallest is the least recently used.
    used: u64,
}

/// `fused(a+b+…)` for the request's kernels.
fn fused_name(request: &FusionRequest) -> Arc<str> {
    let mut name = String::from("fused(");
    for (i, k) in request.kernels.iter().enumerate() {
        if i > 0 {
            name.push('+');
        }
        name.push_str(&k.kernel.name);
    }
    name.push(')');
    name.into()
}

/// Counters of a [`ClosureFusion`]'s plan cache.
///
/// Non-exhaustive: read its fields; more counters may be added.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Fusions answered from the cache.
    pub hits: u64,
    /// Fusions planned anew.
    pub misses: u64,
    /// Plans evicted to keep the cache within its capacity.
    pub evictions: u64,
    /// Plans cached now (at most the capacity).
    pub len: usize,
}

/// The fusion compiler for closure kernels, with a plan cache bounded to a number
/// of plans ([`ClosureFusion::with_capacity`]).
pub struct ClosureFusion {
    /// The most plans `cache` keeps; 0 keeps none.
    capacity: usize,
    cache: Mutex<PlanCache>,
    /// Whether chains measured to run slower fused are fused anyway.
    unprofitable: bool,
}

/// A [`ClosureFusion`]'s cached plans and counters (counted under the cache's lock,
/// which a fusion takes anyway: an atomic counter would add a locked operation).
///
/// Least recently used first out: a hit stamps its plan with the next tick (no
/// allocation, no reordering), and an insertion into a full cache scans the plans
/// for the oldest stamp. The scan is linear in the capacity but only runs on a miss,
/// which plans a chain anyway.
struct PlanCache {
    /// Plans by the Fx hash of their key (hashed on every fusion, hit or not; no
    /// untrusted keys here), equal hashes compared part by part.
    plans: FxHashMap<u64, SmallVec<[Cached; 1]>>,
    /// `stats.len` counts the plans in `plans`.
    stats: CacheStats,
    /// Advanced on every hit and insertion: the recency order of [`Cached::used`].
    tick: u64,
}

impl PlanCache {
    /// Removes the least recently used plan, if any.
    fn evict_oldest(&mut self) {
        let oldest = self
            .plans
            .iter()
            .flat_map(|(&hash, entries)| entries.iter().enumerate().map(move |(i, c)| (c.used, hash, i)))
            .min();
        let Some((_, hash, i)) = oldest else { return };
        let entries = self.plans.get_mut(&hash).expect("bucket of the oldest plan");
        entries.swap_remove(i);
        if entries.is_empty() {
            self.plans.remove(&hash);
        }
        self.stats.len -= 1;
        self.stats.evictions += 1;
    }
}

impl std::fmt::Debug for ClosureFusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClosureFusion")
            .field("capacity", &self.capacity)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for ClosureFusion {
    /// [`ClosureFusion::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl ClosureFusion {
    /// The plan capacity of [`ClosureFusion::new`]: room for the distinct chains a
    /// program fuses again and again, while a program that fuses ever new ranges
    /// holds a bounded amount of memory.
    pub const DEFAULT_CAPACITY: usize = 1_024;

    /// A compiler with an empty cache of [`ClosureFusion::DEFAULT_CAPACITY`] plans.
    pub fn new() -> Self {
        Self::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// A compiler with an empty cache that keeps at most `plans` plans, evicting the
    /// least recently used (planned or hit) one to make room for a new one. A
    /// capacity of 0 caches nothing: every fusion is planned anew.
    pub fn with_capacity(plans: usize) -> Self {
        let cache = PlanCache { plans: FxHashMap::default(), stats: CacheStats::default(), tick: 0 };
        Self { capacity: plans, cache: Mutex::new(cache), unprofitable: false }
    }

    /// The same compiler, fusing chains it would refuse as slower than their kernels
    /// unfused ([`FusionError::Unprofitable`]): for tests of those fused forms, and for
    /// a caller that fuses for what internalization saves (the intermediates' global
    /// memory traffic on a device with other costs) rather than for CPU time.
    ///
    /// ```
    /// # use gantry_host::fusion::ClosureFusion;
    /// let compiler = ClosureFusion::new().fusing_unprofitable();
    /// assert!(compiler.fuses_unprofitable());
    /// ```
    pub fn fusing_unprofitable(mut self) -> Self {
        self.unprofitable = true;
        self
    }

    /// Whether it fuses chains measured to be slower fused ([`Self::fusing_unprofitable`]).
    pub fn fuses_unprofitable(&self) -> bool {
        self.unprofitable
    }

    /// This compiler, with its cache, fusing every form it accepts: for devices whose
    /// time is not the host's (the simulated device models a GPU's), where the CPU's
    /// measurements say nothing.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use gantry_host::fusion::ClosureFusion;
    /// let compiler = Arc::new(ClosureFusion::new());
    /// let everything = ClosureFusion::every_form(&compiler);
    /// # drop(everything);
    /// ```
    pub fn every_form(this: &Arc<Self>) -> Arc<dyn FusionCompiler> {
        Arc::new(EveryForm(this.clone()))
    }

    /// The most plans the cache keeps (0: caching is off).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The cache's counters so far, and the plans it holds now.
    pub fn stats(&self) -> CacheStats {
        self.cache.lock().expect("fusion cache").stats
    }

    /// The request's plan and fused kernel name, and whether the plan was cached.
    fn plan_for(
        &self,
        request: &FusionRequest,
        buffers: &[u64],
    ) -> Result<(Arc<FusionPlan>, Arc<str>, bool), FusionError> {
        let mut key: SmallVec<[KeyPart; 16]> = SmallVec::new();
        key_parts(request, buffers, &mut key);
        let hash = key_hash(&key);
        let same_names =
            |names: &[Arc<str>]| names.iter().zip(&request.kernels).all(|(n, k)| *n == k.kernel.name);
        let mut guard = self.cache.lock().expect("fusion cache");
        let cache = &mut *guard;
        if let Some(hit) =
            cache.plans.get_mut(&hash).and_then(|entries| entries.iter_mut().find(|c| c.key[..] == key[..]))
        {
            cache.stats.hits += 1;
            cache.tick += 1;
            hit.used = cache.tick;
            if !same_names(&hit.names) {
                hit.names = request.kernels.iter().map(|k| k.kernel.name.clone()).collect();
                hit.name = fused_name(request);
            }
            return Ok((hit.plan.clone(), hit.name.clone(), true));
        }
        drop(guard);
        let plan = Arc::new(plan(request, buffers)?);
        let name = fused_name(request);
        // Built before the lock is taken again, so other fusions wait on none of it.
        let cached = (self.capacity > 0).then(|| Cached {
            key: key.into_iter().collect(),
            plan: plan.clone(),
            names: request.kernels.iter().map(|k| k.kernel.name.clone()).collect(),
            name: name.clone(),
            used: 0,
        });
        let mut guard = self.cache.lock().expect("fusion cache");
        let cache = &mut *guard;
        cache.stats.misses += 1;
        if let Some(mut cached) = cached {
            // (Another thread may have planned the same chain meanwhile.)
            let present =
                cache.plans.get(&hash).is_some_and(|entries| entries.iter().any(|c| c.key == cached.key));
            if !present {
                if cache.stats.len >= self.capacity {
                    cache.evict_oldest();
                }
                cache.tick += 1;
                cached.used = cache.tick;
                cache.plans.entry(hash).or_default().push(cached);
                cache.stats.len += 1;
            }
        }
        Ok((plan, name, false))
    }
}

/// A [`ClosureFusion`] (sharing its cache) that fuses every form it accepts
/// ([`ClosureFusion::every_form`]).
struct EveryForm(Arc<ClosureFusion>);

impl FusionCompiler for EveryForm {
    fn image_kind(&self) -> ImageKind {
        ImageKind::Closure
    }

    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError> {
        self.0.fuse_forms(request, true)
    }
}

impl FusionCompiler for ClosureFusion {
    fn image_kind(&self) -> ImageKind {
        ImageKind::Closure
    }

    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError> {
        self.fuse_forms(request, self.unprofitable)
    }
}

impl ClosureFusion {
    /// [`FusionCompiler::fuse`], fusing chains measured slower fused if `unprofitable`.
    fn fuse_forms(&self, request: &FusionRequest, unprofitable: bool) -> Result<Fused, FusionError> {
        if let Some(k) = request.kernels.iter().find(|k| k.kernel.closure().is_none()) {
            return Err(FusionError::MissingImage {
                kernel: k.kernel.name.to_string(),
                kind: ImageKind::Closure,
            });
        }
        // A phase that makes any chain slower (a reduction's) refuses the chain: its
        // kernels run unfused.
        for k in request.kernels.iter().filter(|_| !unprofitable) {
            if let Some(reason) =
                closure_of(&k.kernel).phases.iter().find_map(|p| p.unprofitable.map(Unprofitable::from))
            {
                return Err(FusionError::Unprofitable { kernel: k.kernel.name.to_string(), reason });
            }
        }
        let buffers = gantry_driver::fusion::rules::buffers_in_order(&request.kernels);
        let (plan, name, cached) = self.plan_for(request, &buffers)?;
        // Plain loops: collecting these short lists through `SmallVec`'s `extend` cost
        // more than the pushes themselves (a cache hit builds all of them).
        let mut parts = SmallVec::new();
        let shared = body::shared_reads(request, &plan);
        for (k, shared) in request.kernels.iter().zip(shared) {
            parts.push(Part { kernel: k.kernel.clone(), geometry: k.geometry, deps: k.deps.clone(), shared });
        }
        if let Some((k, reason)) =
            body::unprofitable(&parts, &plan, request.barriers).filter(|_| !unprofitable)
        {
            return Err(FusionError::Unprofitable {
                kernel: request.kernels[k].kernel.name.to_string(),
                reason,
            });
        }
        let mut args = SmallVec::new();
        for (c, start, end, uses) in &plan.args {
            args.push(FusedArg { buffer: buffers[*c], start: *start, end: *end, uses: uses.clone() });
        }
        let mut internal = SmallVec::new();
        for (c, kind, bytes, uses) in &plan.internal {
            internal.push(InternalArg {
                buffer: buffers[*c],
                kind: *kind,
                bytes: *bytes,
                uses: uses.clone(),
            });
        }
        let warnings = plan
            .warnings
            .iter()
            .map(|(c, reason)| FusionWarning::PromotionDropped {
                buffer: buffers[*c],
                reason: reason.clone(),
            })
            .collect();
        let (global_slots, scratch, cost, geometry) =
            (plan.args.len(), plan.scratch.clone(), plan.cost, plan.geometry);
        // The closure and the kernel's fallback share the body, and the body owns the
        // plan.
        // Each argument's mode in the fused kernel's signature: whether any slot on it
        // reads, and whether any writes.
        let modes = args.iter().map(|a: &FusedArg| {
            let mode = |&(k, s): &(u32, u32)| {
                let sig = &request.kernels[k as usize].kernel.signature;
                sig.globals.get(s as usize).copied().unwrap_or(AccessMode::ReadWrite)
            };
            let (reads, writes) =
                (a.uses.iter().any(|u| mode(u).reads()), a.uses.iter().any(|u| mode(u).writes()));
            match (reads, writes) {
                (true, true) => AccessMode::ReadWrite,
                (false, true) => AccessMode::Write,
                _ => AccessMode::Read,
            }
        });
        let modes: SmallVec<[AccessMode; 4]> = modes.collect();
        let body =
            Arc::new(FusedBody { parts, plan, barriers: request.barriers, completed: Mutex::new(None) });
        let unfused = Unfused(body.clone());
        let kept_on_failure: Arc<dyn KeptOnFailure> = body.clone();
        let kernel = ClosureKernel {
            tag: 0,
            phases: smallvec::smallvec![Phase {
                group: Arc::new(move |ctx: &GroupCtx<'_>| body.run_group(ctx)),
                per_item: false,
                code: TypeId::of::<FusedBody>(),
                elementwise: None,
                unprofitable: None,
                runs: true,
            }],
            global_slots,
            scratch,
            unfused: Some(unfused),
        };
        let kernel = kernel.into_kernel(name, modes, cost);
        Ok(Fused {
            kernel,
            geometry,
            scalars: ScalarBlock::new(),
            args,
            internal,
            warnings,
            cached,
            kept_on_failure: Some(kept_on_failure),
        })
    }
}
