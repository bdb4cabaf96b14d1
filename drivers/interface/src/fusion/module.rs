//! What a code-generating fusion compiler (LLVM IR, WGSL) keeps of a fused module
//! and how it answers from it: the module's image and signature with the rules'
//! decisions, buffers by number, so one cached module answers every request that
//! differs only in which buffers it names.

use crate::fusion::rules::{ArgGroup, InternalGroup};
use crate::fusion::Fused;
use crate::fusion::{FusedArg, FusionRequest, FusionWarning, InternalArg, PromotionMismatch};
use crate::image::CodeImage;
use crate::kernel::{Kernel, ScalarBlock, Signature};
use crate::memory::AccessMode;
use crate::range::Geometry;

/// A fused module and what the rules decided, with buffers by their number in
/// [`rules::buffers_in_order`](crate::fusion::rules::buffers_in_order).
#[derive(Clone, Debug)]
pub struct FusedModule {
    /// The fused kernel's code.
    pub image: CodeImage,
    /// Its signature: one global per argument group, no scalars (the kernels'
    /// scalars are constants of the module).
    pub signature: Signature,
    /// The fused grid.
    pub geometry: Geometry,
    /// The arguments kept in global memory.
    pub args: Vec<ArgGroup>,
    /// The internalized buffers.
    pub internal: Vec<InternalGroup>,
    /// Promotions dropped, by buffer number, and why.
    pub warnings: Vec<(usize, PromotionMismatch)>,
}

impl FusedModule {
    /// The [`Fused`] answer to `request`, whose buffers (in
    /// [`rules::buffers_in_order`](crate::fusion::rules::buffers_in_order)) are
    /// `buffers`; `cached` says whether the module came from a cache.
    pub fn answer(&self, request: &FusionRequest, buffers: &[u64], cached: bool) -> Fused {
        let kernel = Kernel::new(fused_name(request), self.signature.clone()).with_image(self.image.clone());
        Fused {
            kernel: kernel.into_ref(),
            geometry: self.geometry,
            scalars: ScalarBlock::new(),
            args: self
                .args
                .iter()
                .map(|a| FusedArg {
                    buffer: buffers[a.buffer],
                    start: a.start,
                    end: a.end,
                    uses: a.uses.clone(),
                })
                .collect(),
            internal: self
                .internal
                .iter()
                .map(|g| InternalArg {
                    buffer: buffers[g.buffer],
                    kind: g.kind,
                    bytes: g.bytes,
                    uses: g.uses.clone(),
                })
                .collect(),
            warnings: self
                .warnings
                .iter()
                .map(|(c, reason)| FusionWarning::PromotionDropped {
                    buffer: buffers[*c],
                    reason: reason.clone(),
                })
                .collect(),
            cached,
            kept_on_failure: None,
        }
    }
}

/// `fused(a+b+…)`: the fused kernel's name, from the request's kernels.
pub fn fused_name(request: &FusionRequest) -> String {
    let names: Vec<&str> = request.kernels.iter().map(|k| &*k.kernel.name).collect();
    format!("fused({})", names.join("+"))
}

/// The mode of a fused argument whose slots are `uses` (kernel, slot): read-write if
/// any slot reads and any writes, write if they only write, else read. A slot past
/// its kernel's signature counts as read-write.
pub fn merged_mode(request: &FusionRequest, uses: &[(u32, u32)]) -> AccessMode {
    let mode = |&(k, s): &(u32, u32)| {
        let sig = &request.kernels[k as usize].kernel.signature;
        sig.globals.get(s as usize).copied().unwrap_or(AccessMode::ReadWrite)
    };
    match (uses.iter().any(|u| mode(u).reads()), uses.iter().any(|u| mode(u).writes())) {
        (true, true) => AccessMode::ReadWrite,
        (false, true) => AccessMode::Write,
        _ => AccessMode::Read,
    }
}
