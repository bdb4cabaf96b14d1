//! Kernel fusion on LLVM IR (the DPC++ kernel-fusion design, "Fusion Process"):
//! [`IrFusion`] turns a fusion list of [`ImageKind::LlvmIr`] kernels into one
//! kernel whose image is one module, compiled by [`HostCompiler`](crate::HostCompiler)
//! and [`PtxCompiler`](crate::PtxCompiler) like any other.
//!
//! The steps, each in its own file:
//!
//! 1. the shared rules ([`gantry_driver::fusion::rules`]) give the fused grid, the
//!    remapped kernels and the identical-argument groups, exactly as for closure
//!    kernels;
//! 2. each listed kernel is loaded into a module of its own, its definitions renamed
//!    after its place in the list and its calls inlined (`load`);
//! 3. its accesses through internalized buffers are rewritten (`internalize`);
//!    a buffer some kernel reaches in a way that cannot be rewritten stays in
//!    global memory, with [`PromotionMismatch::AccessNotRewritable`];
//! 4. its built-ins are remapped where its geometry is not the grid's (`remap`);
//! 5. the barriers between kernels that cannot matter are left out: where two
//!    adjacent kernels provably touch, in every work-item, only that work-item's
//!    own elements of what they write (`private_access`);
//! 6. the modules are linked, the stub kernel calling each kernel in order is built
//!    (`stub`), everything is inlined into it, and the post-fusion pipeline runs
//!    (`passes`);
//! 7. the module is kept in a bounded cache (`cache`).
//!
//! A kernel with barriers that would run for only some work-items of a fused
//! work-group is refused ([`FusionError::BarriersInPartialGroups`]): the others
//! would never reach its barriers. Scalars are constants of the fused module, so
//! the fused kernel takes none.

mod cache;
mod internalize;
mod load;
mod passes;
mod private_access;
mod remap;
mod stub;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gantry_driver::fusion::rules::{self, SlotPlace};
use gantry_driver::fusion::{fused_name, merged_mode, FusedModule};
use gantry_driver::fusion::{
    Fused, FusionCompiler, FusionError, FusionKernel, FusionRequest, Promotion, PromotionMismatch,
};
use gantry_driver::{CodeImage, Geometry, ImageKind, Scratch, ScratchKind, Signature};
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::context::Context;
use inkwell::module::Linkage;
use inkwell::targets::TargetData;
use inkwell::values::{AsValueRef, BasicValue};
use inkwell::AddressSpace;
use parking_lot::Mutex;

pub use cache::FusionCacheStats;
use cache::{FusionKey, IdKey, Lru};
use remap::Remap;

use crate::error::{codegen, JitError};
use crate::raw;
use crate::signature::Binding;

/// Where a fusion's build time went (a cache hit builds nothing), and what the
/// build decided beyond the [`Fused`] answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FusionTimings {
    /// Loading the kernels, rewriting them, linking and building the stub.
    pub build: Duration,
    /// Inlining into the stub and the post-fusion pipeline, to bitcode.
    pub optimize: Duration,
    /// Barriers between kernels that the request asked for and the fused kernel
    /// leaves out, because no work-item could observe them (see the
    /// [module docs](self)).
    pub barriers_elided: usize,
}

/// A fused module and what the rules decided, with buffers by number.
#[derive(Debug)]
struct Built {
    module: FusedModule,
    timings: FusionTimings,
}

/// The fusion compiler for LLVM IR kernels (see the [module docs](self)), with a
/// bounded cache of fused modules. Shareable across threads.
///
/// ```no_run
/// use gantry_driver::fusion::{FusionArg, FusionCompiler, FusionKernel, FusionRequest};
/// use gantry_driver::{AccessMode, Geometry, Kernel, Range, Signature};
/// let image = gantry_jit::from_opencl_c(
///     "kernel void axpb(global float* x, float a, float b) {
///          size_t i = get_global_id(0); x[i] = a * x[i] + b; }",
///     "axpb",
/// )?;
/// let sig = Signature::new().global(AccessMode::ReadWrite).scalar::<f32>().scalar::<f32>();
/// let kernel = Kernel::new("axpb", sig).with_image(image).into_ref();
/// let geometry = Geometry::for_range(Range::d1(1024)).unwrap();
/// let step = |a: f32, b: f32| FusionKernel {
///     kernel: kernel.clone(),
///     geometry,
///     args: [FusionArg::new(1, 0..4096, 4)].into_iter().collect(),
///     scalars: [a.to_ne_bytes(), b.to_ne_bytes()].concat().into_iter().collect(),
///     deps: Default::default(),
/// };
/// let request = FusionRequest { kernels: vec![step(2.0, 1.0), step(0.5, 3.0)], barriers: true };
/// let fused = gantry_jit::IrFusion::new().fuse(&request).unwrap();
/// assert_eq!(fused.args.len(), 1);
/// assert!(fused.scalars.is_empty(), "the scalars are constants of the fused module");
/// # Ok::<(), gantry_jit::JitError>(())
/// ```
pub struct IrFusion {
    cache: Mutex<Lru<Built>>,
    last: Mutex<Option<FusionTimings>>,
}

impl std::fmt::Debug for IrFusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IrFusion").field("stats", &self.stats()).finish()
    }
}

impl Default for IrFusion {
    /// [`IrFusion::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl IrFusion {
    /// The module capacity of [`IrFusion::new`]: room for the distinct chains a
    /// program fuses again and again, while one that fuses ever new chains holds a
    /// bounded amount of memory.
    pub const DEFAULT_CAPACITY: usize = 256;

    /// A compiler with an empty cache of [`IrFusion::DEFAULT_CAPACITY`] modules.
    pub fn new() -> Self {
        Self::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// A compiler whose cache keeps at most `modules` fused modules, evicting the
    /// least recently used (built or hit) one to make room; 0 caches nothing.
    pub fn with_capacity(modules: usize) -> Self {
        Self { cache: Mutex::new(Lru::new(modules)), last: Mutex::new(None) }
    }

    /// The most modules the cache keeps.
    pub fn capacity(&self) -> usize {
        self.cache.lock().capacity()
    }

    /// The cache's counters so far.
    pub fn stats(&self) -> FusionCacheStats {
        self.cache.lock().stats
    }

    /// Where the last fusion that was built (not a cache hit) spent its time.
    pub fn last_timings(&self) -> Option<FusionTimings> {
        *self.last.lock()
    }
}

impl FusionCompiler for IrFusion {
    fn image_kind(&self) -> ImageKind {
        ImageKind::LlvmIr
    }

    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError> {
        let mut images = Vec::with_capacity(request.kernels.len());
        for k in &request.kernels {
            images.push(k.kernel.image(ImageKind::LlvmIr).ok_or_else(|| FusionError::MissingImage {
                kernel: k.kernel.name.to_string(),
                kind: ImageKind::LlvmIr,
            })?);
        }
        let buffers = rules::buffers_in_order(&request.kernels);
        // By identities first: no image bytes hashed (see the cache's docs).
        let id_hash = IdKey::hash_of(request, &images, &buffers);
        if let Some(hit) = self.cache.lock().get_by_identity(id_hash, request, &images, &buffers) {
            return Ok(hit.module.answer(request, &buffers, true));
        }
        let ids = IdKey::new(request, &images, &buffers, id_hash);
        let key = FusionKey::new(request, &images, &buffers);
        if let Some(hit) = self.cache.lock().get(&key, ids.clone()) {
            return Ok(hit.module.answer(request, &buffers, true));
        }
        self.cache.lock().miss();
        let built = Arc::new(build(request, &images, &buffers)?);
        *self.last.lock() = Some(built.timings);
        self.cache.lock().insert(key, ids, built.clone());
        Ok(built.module.answer(request, &buffers, false))
    }
}

/// A kernel's JIT error as a fusion refusal.
fn refusal(kernel: &FusionKernel, error: JitError) -> FusionError {
    FusionError::Code { kernel: kernel.kernel.name.to_string(), reason: error.to_string() }
}

/// The parameter of a kernel bound to global slot `slot`.
fn param_of(bindings: &[Binding], slot: usize) -> Option<u32> {
    bindings.iter().position(|b| *b == Binding::Global(slot)).map(|p| p as u32)
}

/// Whether kernel `k`, with barriers, keeps every work-item of each fused
/// work-group together: all of them run it or none does.
fn whole_groups(k: &FusionKernel, grid: &Geometry, reshaped: bool) -> bool {
    let own = &k.geometry;
    own.global_size() == grid.global_size()
        || (!reshaped && own.global_range()[0].is_multiple_of(grid.local_range()[0]))
}

fn build(request: &FusionRequest, images: &[&CodeImage], buffers: &[u64]) -> Result<Built, FusionError> {
    let start = Instant::now();
    let kernels = &request.kernels;
    let grid = rules::fused_geometry(kernels)?;
    let context = Context::create();
    let mut loaded = Vec::with_capacity(kernels.len());
    for (i, (k, image)) in kernels.iter().zip(images).enumerate() {
        loaded.push(load::load(&context, image, &k.kernel.signature, i).map_err(|e| refusal(k, e))?);
    }
    // Which parameters each kernel touches in its own elements only: read before
    // any rewrite, on the kernel as written (only where barriers could be elided).
    let accesses: Vec<Option<Vec<private_access::ParamAccess>>> = kernels
        .iter()
        .zip(&loaded)
        .enumerate()
        .map(|(i, (k, l))| {
            let local = k.kernel.signature.memory.iter().any(|m| m.kind == ScratchKind::Local);
            if !request.barriers || grid.geometry.dims() != 1 || grid.remap[i] || local || l.barriers > 0 {
                return None;
            }
            let function = l.module.get_function(&l.entry).expect("loaded entry");
            let data = TargetData::create(&l.module.get_data_layout().as_str().to_string_lossy());
            private_access::analyze(function, &l.bindings, &data)
        })
        .collect();
    for (i, k) in kernels.iter().enumerate() {
        let reshaped = rules::reshaped(&k.geometry, &grid.geometry);
        if loaded[i].barriers > 0 && grid.remap[i] && !whole_groups(k, &grid.geometry, reshaped) {
            return Err(FusionError::BarriersInPartialGroups { kernel: k.kernel.name.to_string() });
        }
    }
    // Internalization needs every access through every slot on the buffer rewritten.
    let mut not_rewritable: Vec<(usize, String)> = Vec::new();
    for (canon, &buffer) in buffers.iter().enumerate() {
        for (k, kd) in kernels.iter().enumerate() {
            for (s, a) in kd.args.iter().enumerate() {
                if a.buffer != buffer || a.promotion == Promotion::None {
                    continue;
                }
                let function = loaded[k].module.get_function(&loaded[k].entry).expect("loaded entry");
                let ok =
                    param_of(&loaded[k].bindings, s).is_some_and(|p| internalize::rewritable(function, p));
                if !ok && !not_rewritable.iter().any(|(c, _)| *c == canon) {
                    not_rewritable.push((canon, kd.kernel.name.to_string()));
                }
            }
        }
    }
    let groups = rules::group_slots(kernels, buffers, |c| not_rewritable.iter().any(|(n, _)| *n == c));
    let mut warnings = groups.warnings.clone();
    let barrier_after = private_access::elide(request.barriers, &touches(&accesses, &loaded, &groups));
    let barriers_elided =
        if request.barriers { kernels.len() - 1 - barrier_after.iter().filter(|&&b| b).count() } else { 0 };
    for (canon, kernel) in not_rewritable {
        // Only where the rules would have internalized it: a dropped hint already
        // has its warning.
        let uses: Vec<(u32, u32)> =
            groups.args.iter().find(|a| a.buffer == canon).map(|a| a.uses.to_vec()).unwrap_or_default();
        if matches!(rules::promotion_of(kernels, &uses), Ok(Some(_))) {
            warnings.push((canon, PromotionMismatch::AccessNotRewritable { kernel }));
        }
    }

    // Rewrite each kernel: internalized accesses, then remapped built-ins.
    for (k, kd) in kernels.iter().enumerate() {
        let l = &loaded[k];
        let function = l.module.get_function(&l.entry).expect("loaded entry");
        for (s, place) in groups.slots[k].iter().enumerate() {
            let SlotPlace::Internal { index } = *place else { continue };
            let g = &groups.internal[index as usize];
            let space = if g.kind == Promotion::Local { 3u16 } else { 0 };
            let marker = marker(&context, &l.module, index, space);
            let first = function.get_first_basic_block().and_then(|b| b.get_first_instruction());
            let builder = context.create_builder();
            builder.position_before(&first.ok_or_else(|| refusal(kd, codegen("an empty kernel")))?);
            let base =
                builder.build_call(marker, &[], "internal.base").map_err(|e| refusal(kd, codegen(e)))?;
            let base = base.try_as_basic_value().basic().expect("a pointer").as_value_ref();
            let param = param_of(&l.bindings, s).expect("a global slot has its parameter");
            internalize::rewrite(function, param, g.bytes as u64, base).map_err(|e| refusal(kd, e))?;
        }
        if grid.remap[k] {
            let reshaped = rules::reshaped(&kd.geometry, &grid.geometry);
            let r = Remap::new(&kd.geometry, &grid.geometry, reshaped);
            remap::remap(&context, &l.module, function, &r).map_err(|e| refusal(kd, e))?;
        }
    }

    // The fused signature: one global per argument, the local internal buffers, then
    // each kernel's own local slots.
    let mut signature = Signature::new();
    for a in &groups.args {
        signature = signature.global(merged_mode(request, &a.uses));
    }
    for g in groups.internal.iter().filter(|g| g.kind == Promotion::Local) {
        signature.memory.push(Scratch::new(ScratchKind::Local, g.bytes));
    }
    let mut first_local = Vec::with_capacity(kernels.len());
    for kd in kernels {
        first_local.push(signature.memory.len());
        signature
            .memory
            .extend(kd.kernel.signature.memory.iter().copied().filter(|s| s.kind == ScratchKind::Local));
    }

    // One module: the kernels linked, then the stub.
    let module = context.create_module("fused");
    module.set_triple(&loaded[0].module.get_triple());
    module.set_data_layout(&loaded[0].module.get_data_layout());
    let mut entries = Vec::with_capacity(loaded.len());
    let mut rest = Vec::with_capacity(loaded.len());
    for l in loaded {
        entries.push(l.entry.clone());
        module.link_in_module(l.module).map_err(|e| FusionError::Code {
            kernel: fused_name(request),
            reason: format!("linking the kernels: {}", e.to_string_lossy()),
        })?;
        rest.push((l.bindings, l.barriers));
    }
    let grid_cl = remap::opencl_order(grid.geometry.global_range(), grid.geometry.dims(), 1);
    let mut parts = Vec::with_capacity(kernels.len());
    for (k, kd) in kernels.iter().enumerate() {
        let function = module.get_function(&entries[k]).expect("linked entry");
        parts.push(stub::Part {
            function,
            bindings: &rest[k].0,
            slots: &groups.slots[k],
            scalars: &kd.scalars,
            first_local: first_local[k],
            remapped: grid.remap[k].then(|| Remap::new(&kd.geometry, &grid.geometry, false).total()),
            barriers: rest[k].1 > 0,
        });
    }
    let layout = stub::Layout {
        args: groups.args.len(),
        locals: signature.memory.len(),
        internal: &groups.internal,
        grid: grid_cl,
        barriers: &barrier_after,
    };
    let whole = |e: JitError| FusionError::Code { kernel: fused_name(request), reason: e.to_string() };
    let bases = stub::build(&context, &module, &layout, &parts).map_err(whole)?;
    let build_time = start.elapsed();

    // Inline the kernels into the stub; point the internal buffers' markers at the
    // stub's buffers; optimize.
    let always = Attribute::get_named_enum_kind_id("alwaysinline");
    for part in &parts {
        part.function.set_linkage(Linkage::Internal);
        part.function.add_attribute(AttributeLoc::Function, context.create_enum_attribute(always, 0));
    }
    passes::run(&module, "always-inline").map_err(whole)?;
    for (index, base) in bases.iter().enumerate() {
        let Some(m) = module.get_function(&marker_name(index as u32)) else { continue };
        for call in raw::instructions(module.get_function(stub::STUB).expect("the stub")) {
            if raw::callee_name(call).as_deref() == Some(&*marker_name(index as u32)) {
                raw::replace_uses(call, base.as_basic_value_enum());
                call.erase_from_basic_block();
            }
        }
        if m.as_global_value().as_pointer_value().get_first_use().is_some() {
            return Err(whole(codegen("an internal buffer's accesses were not all inlined into the stub")));
        }
        raw::delete_function(m);
    }
    passes::run(&module, passes::FUSION_PIPELINE).map_err(whole)?;
    module.verify().map_err(|e| whole(codegen(format!("the fused module is invalid: {e}"))))?;
    let bitcode = module.write_bitcode_to_memory();
    let image = CodeImage::new(ImageKind::LlvmIr, stub::STUB, bitcode.as_slice().to_vec());
    let optimize = start.elapsed() - build_time;
    Ok(Built {
        module: FusedModule {
            image,
            signature,
            geometry: grid.geometry,
            args: groups.args,
            internal: groups.internal,
            warnings,
        },
        timings: FusionTimings { build: build_time, optimize, barriers_elided },
    })
}

/// Per kernel, the fused arguments it touches and how, for
/// [`private_access::elide`]; `None` for a kernel that is not analyzable or touches
/// a locally internalized buffer (local memory). Privately internalized buffers
/// are left out: each work-item has its own.
fn touches(
    accesses: &[Option<Vec<private_access::ParamAccess>>],
    loaded: &[load::Loaded],
    groups: &rules::SlotGroups,
) -> Vec<Option<Vec<private_access::Touch>>> {
    accesses
        .iter()
        .enumerate()
        .map(|(k, access)| {
            let access = access.as_ref()?;
            let mut out = Vec::new();
            for (s, place) in groups.slots[k].iter().enumerate() {
                let param = param_of(&loaded[k].bindings, s)?;
                let a = access[param as usize];
                match *place {
                    SlotPlace::Internal { index }
                        if groups.internal[index as usize].kind == Promotion::Local =>
                    {
                        return None
                    }
                    SlotPlace::Internal { .. } => {}
                    SlotPlace::Arg { index, offset, .. } => {
                        if a.reads || a.writes {
                            out.push(private_access::Touch { arg: index, offset, access: a });
                        }
                    }
                }
            }
            Some(out)
        })
        .collect()
}

/// The marker function standing for internal buffer `index`'s base until the
/// kernels are inlined into the stub, which has the buffer.
fn marker_name(index: u32) -> String {
    format!("gantry_fuse_internal_{index}")
}

fn marker<'ctx>(
    context: &'ctx Context,
    module: &inkwell::module::Module<'ctx>,
    index: u32,
    space: u16,
) -> inkwell::values::FunctionValue<'ctx> {
    let name = marker_name(index);
    module.get_function(&name).unwrap_or_else(|| {
        let ptr = context.ptr_type(AddressSpace::from(space));
        module.add_function(&name, ptr.fn_type(&[], false), None)
    })
}
