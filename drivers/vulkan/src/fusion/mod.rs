//! Kernel fusion for WGSL kernels (the DPC++ kernel-fusion design, "Fusion
//! Process", on naga IR): [`WgslFusion`] turns a fusion list of
//! [`ImageKind::Wgsl`] kernels into one WGSL compute shader, which the driver
//! loads like any WGSL image.
//!
//! The steps, each in its own file:
//!
//! 1. the shared rules ([`gantry_driver::fusion::rules`]) give the fused grid, the
//!    remapped kernels and the identical-argument groups, exactly as for closure
//!    and LLVM IR kernels, so a list is refused for the same typed reason;
//! 2. each kernel's WGSL is parsed into naga IR and made a *part* (`kernel`):
//!    module-level names prefixed with its place in the list, each buffer named
//!    after the fused argument it becomes (identical buffers are one binding, in
//!    fused-argument order), its scalars folded into constants, its entry point a
//!    function of its built-ins;
//! 3. internalized buffers become private or workgroup arrays of the promoted size,
//!    indexed modulo that size (`internalize`); a buffer some kernel reaches other
//!    than by indexing stays global with
//!    [`PromotionMismatch::AccessNotRewritable`];
//! 4. the parts, written back as WGSL, are joined with the declarations made once
//!    and an entry point that calls each part in list order, guarding remapped ones
//!    past their range, with `storageBarrier(); workgroupBarrier();` between them
//!    where the request asks for barriers (`entry`), unless every kernel touches
//!    only its own elements, where they change nothing (`own_elements`);
//! 5. the whole is parsed and validated by naga (the driver compiles it to SPIR-V
//!    when it loads the image), and kept in a bounded cache.
//!
//! Limits, each refused with [`FusionError::Code`] naming it: a buffer that is not a
//! runtime-sized array of 32-bit scalars or vectors, slots of one buffer at
//! different offsets or with different element types, a reshaped (delinearized)
//! kernel, and a kernel over a plain range whose work-groups matter (work-group
//! built-ins, workgroup memory or barriers: the driver chooses a plain range's
//! groups). A kernel with barriers that would run for only part of a fused
//! work-group is refused with [`FusionError::BarriersInPartialGroups`]. The fused
//! kernel takes no scalars.

mod entry;
mod internalize;
mod kernel;
mod own_elements;

use std::sync::Mutex;

use gantry_driver::fusion::rules::{self, SlotPlace};
use gantry_driver::fusion::{fused_name, merged_mode, FusedModule};
use gantry_driver::fusion::{
    Fused, FusionCompiler, FusionError, FusionKernel, FusionRequest, Promotion, PromotionMismatch,
};
use gantry_driver::{CodeImage, Geometry, ImageKind, Scratch, ScratchKind, Signature};
use naga::AddressSpace;
use rustc_hash::FxHashMap;

use crate::execution::lock;
use entry::{ArgDecl, Call, Guard, InternalDecl};
use kernel::{Element, SlotAs};

/// The cache's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WgslFusionStats {
    /// Fusions answered from the cache.
    pub hits: u64,
    /// Fusions built.
    pub misses: u64,
}

/// The fusion compiler for WGSL kernels: under the shared fusion rules, it joins the
/// kernels' naga modules into one WGSL compute shader that runs each body in list
/// order (with work-group barriers between where asked), internalized buffers as
/// private or workgroup arrays. It keeps a bounded cache of fused modules keyed by
/// everything a fused module depends on. Shareable across threads.
pub struct WgslFusion {
    cache: Mutex<(FxHashMap<Vec<u8>, FusedModule>, WgslFusionStats)>,
}

impl std::fmt::Debug for WgslFusion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgslFusion").field("stats", &self.stats()).finish()
    }
}

impl Default for WgslFusion {
    /// [`WgslFusion::new`].
    fn default() -> Self {
        Self::new()
    }
}

impl WgslFusion {
    /// The most fused modules the cache keeps; past that it starts over, so a
    /// program fusing ever new chains holds bounded memory.
    pub const CAPACITY: usize = 256;

    /// A compiler with an empty cache.
    pub fn new() -> Self {
        Self { cache: Mutex::new((FxHashMap::default(), WgslFusionStats::default())) }
    }

    /// The cache's counters so far.
    pub fn stats(&self) -> WgslFusionStats {
        lock(&self.cache).1
    }
}

impl FusionCompiler for WgslFusion {
    fn image_kind(&self) -> ImageKind {
        ImageKind::Wgsl
    }

    fn fuse(&self, request: &FusionRequest) -> Result<Fused, FusionError> {
        let mut images = Vec::with_capacity(request.kernels.len());
        for k in &request.kernels {
            images.push(k.kernel.image(ImageKind::Wgsl).ok_or_else(|| FusionError::MissingImage {
                kernel: k.kernel.name.to_string(),
                kind: ImageKind::Wgsl,
            })?);
        }
        let buffers = rules::buffers_in_order(&request.kernels);
        let key = cache_key(request, &images, &buffers);
        {
            let mut cache = lock(&self.cache);
            if let Some(hit) = cache.0.get(&key).cloned() {
                cache.1.hits += 1;
                return Ok(hit.answer(request, &buffers, true));
            }
        }
        let built = build(request, &images, &buffers)?;
        let mut cache = lock(&self.cache);
        cache.1.misses += 1;
        if cache.0.len() >= Self::CAPACITY {
            cache.0.clear();
        }
        cache.0.insert(key, built.clone());
        Ok(built.answer(request, &buffers, false))
    }
}

/// Everything a fused module depends on: the images, geometries, slots (buffers by
/// number), scalars and the barrier property.
fn cache_key(request: &FusionRequest, images: &[&CodeImage], buffers: &[u64]) -> Vec<u8> {
    let mut key = Vec::new();
    let mut put = |b: &[u8]| {
        key.extend_from_slice(&(b.len() as u64).to_le_bytes());
        key.extend_from_slice(b);
    };
    put(&[request.barriers as u8]);
    for (k, image) in request.kernels.iter().zip(images) {
        put(image.entry().as_bytes());
        put(image.code());
        put(format!("{:?}", k.geometry).as_bytes());
        put(&k.scalars);
        put(format!("{:?}", k.kernel.signature.globals).as_bytes());
        for a in &k.args {
            let number = buffers.iter().position(|&b| b == a.buffer).unwrap_or(usize::MAX);
            put(format!("{number} {} {} {} {:?}", a.start, a.end, a.elem_size, a.promotion).as_bytes());
        }
    }
    key
}

/// The work-group size a launch of a kernel over `g` gets (Vulkan order): the
/// local size of an ND-range, else the driver's plain-range group.
fn local_of(g: &Geometry) -> [u32; 3] {
    if !g.is_nd() {
        return [crate::PLAIN_GROUP, 1, 1];
    }
    let d = g.dims();
    let l = g.local_range();
    [0, 1, 2].map(|i| if i < d { l[d - 1 - i] as u32 } else { 1 })
}

fn build(
    request: &FusionRequest,
    images: &[&CodeImage],
    buffers: &[u64],
) -> Result<FusedModule, FusionError> {
    let kernels = &request.kernels;
    let grid = rules::fused_geometry(kernels)?;
    let code =
        |k: &FusionKernel, reason: String| FusionError::Code { kernel: k.kernel.name.to_string(), reason };
    let mut parsed = Vec::with_capacity(kernels.len());
    for (k, image) in kernels.iter().zip(images) {
        let p = kernel::parse(image.code(), image.entry()).map_err(|e| code(k, e))?;
        if p.module.entry_points[p.entry].workgroup_size_overrides.is_none() && k.geometry.is_nd() {
            let size = p.module.entry_points[p.entry].workgroup_size;
            if size != local_of(&k.geometry) {
                return Err(code(k, format!("its workgroup size {size:?} is not its ND-range's local size")));
            }
        }
        parsed.push(p);
    }
    // Each slot's buffer declaration and element.
    let mut elements: Vec<Vec<Element>> = Vec::with_capacity(kernels.len());
    let mut not_rewritable: Vec<(usize, String)> = Vec::new();
    for (k, p) in kernels.iter().zip(&parsed) {
        let mut mine = Vec::with_capacity(k.args.len());
        for (s, a) in k.args.iter().enumerate() {
            let Some(g) = kernel::slot_global(&p.module, s as u32) else {
                return Err(code(k, format!("slot {s} has no storage buffer at @group(0) @binding({s})")));
            };
            mine.push(kernel::element(&p.module, g).map_err(|e| code(k, e))?);
            let canon = buffers.iter().position(|&b| b == a.buffer).expect("numbered");
            if a.promotion != Promotion::None
                && !kernel::rewritable(&p.module, g)
                && !not_rewritable.iter().any(|(c, _)| *c == canon)
            {
                not_rewritable.push((canon, k.kernel.name.to_string()));
            }
        }
        elements.push(mine);
    }
    let groups = rules::group_slots(kernels, buffers, |c| not_rewritable.iter().any(|(n, _)| *n == c));
    let mut warnings = groups.warnings.clone();
    for (canon, kernel) in not_rewritable {
        let uses: Vec<(u32, u32)> =
            groups.args.iter().find(|a| a.buffer == canon).map(|a| a.uses.to_vec()).unwrap_or_default();
        if matches!(rules::promotion_of(kernels, &uses), Ok(Some(_))) {
            warnings.push((canon, PromotionMismatch::AccessNotRewritable { kernel }));
        }
    }
    // The declarations: one element type per buffer, every slot at its start.
    let element_of = |uses: &[(u32, u32)]| -> Result<Element, FusionError> {
        let (k0, s0) = uses[0];
        let first = elements[k0 as usize][s0 as usize].clone();
        for &(k, s) in uses {
            if elements[k as usize][s as usize] != first {
                return Err(code(
                    &kernels[k as usize],
                    format!(
                        "slot {s} holds {} where another kernel's slot on the same buffer holds {}",
                        elements[k as usize][s as usize].wgsl, first.wgsl
                    ),
                ));
            }
        }
        Ok(first)
    };
    let mut arg_decls = Vec::with_capacity(groups.args.len());
    for a in &groups.args {
        let element = element_of(&a.uses)?;
        arg_decls.push(ArgDecl { element, writes: merged_mode(request, &a.uses).writes() });
    }
    let mut internal_decls = Vec::with_capacity(groups.internal.len());
    for g in &groups.internal {
        let element = element_of(&g.uses)?;
        let space = if g.kind == Promotion::Local { AddressSpace::WorkGroup } else { AddressSpace::Private };
        let elements = (g.bytes / element.bytes) as u32;
        if g.bytes % element.bytes != 0 || elements == 0 {
            let (k, _) = g.uses[0];
            return Err(code(
                &kernels[k as usize],
                format!("{} promoted bytes are not whole {}-byte elements", g.bytes, element.bytes),
            ));
        }
        internal_decls.push(InternalDecl { element, elements, space });
    }
    // Barriers that change nothing are left out (`own_elements`): every kernel over
    // the fused 1-D grid unremapped, each reaching memory only at its own element.
    let elide_barriers = request.barriers
        && grid.geometry.dims() == 1
        && !grid.remap.iter().any(|&r| r)
        && parsed.iter().all(|p| own_elements::own_elements_only(&p.module, p.entry));
    // Each kernel a part.
    let mut parts = Vec::with_capacity(kernels.len());
    let mut calls = Vec::with_capacity(kernels.len());
    let grid_local = local_of(&grid.geometry);
    for (i, (k, p)) in kernels.iter().zip(parsed).enumerate() {
        let mut slots = Vec::with_capacity(k.args.len());
        for (s, place) in groups.slots[i].iter().enumerate() {
            slots.push(match *place {
                SlotPlace::Arg { index, offset, .. } => {
                    if offset != 0 {
                        return Err(code(
                            k,
                            format!("slot {s} starts {offset} bytes into its buffer's fused argument (slots of one buffer must start together)"),
                        ));
                    }
                    SlotAs::Arg(index)
                }
                SlotPlace::Internal { index } => {
                    let d = &internal_decls[index as usize];
                    SlotAs::Internal { index, elements: d.elements, space: d.space }
                }
            });
        }
        let part =
            kernel::make_part(i, p, &slots, &k.scalars, local_of(&k.geometry)).map_err(|e| code(k, e))?;
        let guard = if grid.remap[i] {
            if rules::reshaped(&k.geometry, &grid.geometry) {
                return Err(code(
                    k,
                    "its range would be delinearized from the fused grid's, which WGSL fusion does not do"
                        .into(),
                ));
            }
            let own = k.geometry.global_range()[0];
            let dim = grid.geometry.dims() - 1;
            if part.barriers {
                let local = grid_local[dim] as usize;
                if !own.is_multiple_of(local) {
                    return Err(FusionError::BarriersInPartialGroups { kernel: k.kernel.name.to_string() });
                }
                Some(Guard { dim, limit: (own / local) as u32, by_group: true })
            } else {
                Some(Guard { dim, limit: own as u32, by_group: false })
            }
        } else {
            None
        };
        if part.uses_groups && !k.geometry.is_nd() {
            return Err(code(
                k,
                "it uses work-group built-ins, workgroup memory or barriers over a plain range, whose work-groups the \
                 driver chooses"
                    .into(),
            ));
        }
        calls.push(Call {
            guard,
            barrier_after: request.barriers && !elide_barriers && i + 1 < kernels.len(),
        });
        parts.push(part);
    }
    let text = entry::module_text(&arg_decls, &internal_decls, &parts, &calls);
    let whole = |reason: String| FusionError::Code { kernel: fused_name(request), reason };
    let module = naga::front::wgsl::parse_str(&text).map_err(|e| whole(e.emit_to_string(&text)))?;
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::IMMEDIATES)
        .validate(&module)
        .map_err(|e| whole(e.emit_to_string(&text)))?;
    let mut signature = Signature::new();
    for a in &groups.args {
        signature = signature.global(merged_mode(request, &a.uses));
    }
    for g in groups.internal.iter().filter(|g| g.kind == Promotion::Local) {
        signature.memory.push(Scratch::new(ScratchKind::Local, g.bytes));
    }
    for k in kernels {
        signature
            .memory
            .extend(k.kernel.signature.memory.iter().copied().filter(|s| s.kind == ScratchKind::Local));
    }
    Ok(FusedModule {
        image: CodeImage::new(ImageKind::Wgsl, entry::ENTRY, text.into_bytes()),
        signature,
        geometry: grid.geometry,
        args: groups.args,
        internal: groups.internal,
        warnings,
    })
}
