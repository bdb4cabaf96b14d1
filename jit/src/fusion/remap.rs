//! Work-item remapping (the DPC++ kernel-fusion design, "Work-item remapping"): a
//! kernel whose geometry is not the fused grid's sees its own ids and sizes.
//!
//! The fused grid's work-items keep their global linear id (`GLID`); a remapped
//! kernel runs only for `GLID` below its own global size (the stub guards its call,
//! [`super::stub`]), and its built-ins become (OpenCL dimension order, `GS` its own
//! global size, `GO` its offset):
//!
//! * `get_global_size(d)` = `GS(d)`, `get_work_dim()` = its dimension count;
//! * `get_num_groups(d)` = `GS(d) / LS(d)` for a kernel with a work-group size
//!   (the rules give it the grid's local size); a kernel without one sees the
//!   grid's groups, as it sees the grid's local sizes and ids;
//! * where the kernel is reshaped (another dimension count, or another extent in a
//!   dimension but OpenCL's last): `get_global_id(d)` is `GLID` delinearized in its
//!   own range plus `GO(d)`, and `get_global_linear_id()` is `GLID`. Otherwise its
//!   ids are the grid's (only work-items past its range differ, and they skip it).
//!
//! Local and group ids are never remapped: the rules keep them invariant.

use gantry_driver::Geometry;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::values::{FunctionValue, IntValue};

use crate::builtins::{classify, Call, WorkItem};
use crate::error::{codegen, JitError};
use crate::raw;
use crate::transplant::select_dimension;

/// A Gantry triple (dimension 0 slowest) in OpenCL order (dimension 0 fastest) for
/// `dims` dimensions; dimensions past `dims` get `pad`.
pub(super) fn opencl_order(v: [usize; 3], dims: usize, pad: u64) -> [u64; 3] {
    let mut out = [pad; 3];
    for (i, o) in out.iter_mut().enumerate().take(dims) {
        *o = v[dims - 1 - i] as u64;
    }
    out
}

/// What a remapped kernel sees.
#[derive(Clone, Copy, Debug)]
pub(super) struct Remap {
    /// Its global size, OpenCL order.
    pub global: [u64; 3],
    /// Its dimension count.
    pub dims: u64,
    /// Its offset, OpenCL order.
    pub offset: [u64; 3],
    /// Its group counts, where it has a work-group size.
    pub groups: Option<[u64; 3]>,
    /// Whether its global ids are delinearized from the grid's linear id.
    pub reshaped: bool,
    /// The fused grid's global size, OpenCL order.
    pub grid: [u64; 3],
}

impl Remap {
    /// The remapping of a kernel over `own` in the grid `grid`.
    pub(super) fn new(own: &Geometry, grid: &Geometry, reshaped: bool) -> Self {
        let dims = own.dims();
        let global = opencl_order(own.global_range(), dims, 1);
        let local = opencl_order(own.local_range(), dims, 1);
        Self {
            global,
            dims: dims as u64,
            offset: opencl_order(own.offset(), dims, 0),
            groups: own.is_nd().then(|| [0, 1, 2].map(|d| global[d] / local[d].max(1))),
            reshaped,
            grid: opencl_order(grid.global_range(), grid.dims(), 1),
        }
    }

    /// Its global size in all.
    pub(super) fn total(&self) -> u64 {
        self.global.iter().product()
    }
}

/// Calls of the OpenCL built-ins the remapped values are built from.
pub(super) struct Builtins<'a, 'ctx> {
    pub module: &'a Module<'ctx>,
    pub context: &'ctx Context,
}

impl<'ctx> Builtins<'_, 'ctx> {
    /// `name(d)` as an `i64` (a `size_t` function of one `uint` argument).
    pub(super) fn call(&self, b: &Builder<'ctx>, name: &str, d: u64) -> Result<IntValue<'ctx>, JitError> {
        let (i64t, i32t) = (self.context.i64_type(), self.context.i32_type());
        let f = self
            .module
            .get_function(name)
            .unwrap_or_else(|| self.module.add_function(name, i64t.fn_type(&[i32t.into()], false), None));
        let v = b.build_call(f, &[i32t.const_int(d, false).into()], "").map_err(codegen)?;
        let v = v.try_as_basic_value().basic().ok_or_else(|| codegen("a built-in returned nothing"))?;
        Ok(v.into_int_value())
    }

    /// The grid's global linear id (offset excluded), with the grid's sizes `grid`
    /// (OpenCL order) as constants.
    pub(super) fn linear_id(&self, b: &Builder<'ctx>, grid: [u64; 3]) -> Result<IntValue<'ctx>, JitError> {
        let i64t = self.context.i64_type();
        let rel = |d: u64| -> Result<IntValue<'ctx>, JitError> {
            let id = self.call(b, "_Z13get_global_idj", d)?;
            let offset = self.call(b, "_Z17get_global_offsetj", d)?;
            b.build_int_sub(id, offset, "").map_err(codegen)
        };
        let mut v = rel(2)?;
        for d in [1u64, 0] {
            v = b.build_int_mul(v, i64t.const_int(grid[d as usize], false), "").map_err(codegen)?;
            v = b.build_int_add(v, rel(d)?, "").map_err(codegen)?;
        }
        Ok(v)
    }
}

/// Rewrites the built-in calls of `entry` (a flattened kernel of `module`) as
/// `remap` says (see the module docs).
pub(super) fn remap<'ctx>(
    context: &'ctx Context,
    module: &Module<'ctx>,
    entry: FunctionValue<'ctx>,
    remap: &Remap,
) -> Result<(), JitError> {
    let builder = context.create_builder();
    let builtins = Builtins { module, context };
    let i64t = context.i64_type();
    let constant = |v: u64| i64t.const_int(v, false);
    for call in raw::instructions(entry) {
        let Some(name) = raw::callee_name(call) else { continue };
        let Call::WorkItem(item) = classify(&name) else { continue };
        builder.position_before(&call);
        let b = &builder;
        // Per constant dimension: the remapped value, or None to keep the call.
        let per_dim = |d: u64| -> Result<Option<IntValue<'ctx>>, JitError> {
            let d3 = d.min(3) as usize;
            Ok(match item {
                WorkItem::GlobalSize => Some(constant(if d < 3 { remap.global[d3] } else { 1 })),
                WorkItem::NumGroups => remap.groups.map(|g| constant(if d < 3 { g[d3] } else { 1 })),
                WorkItem::GlobalId if remap.reshaped => {
                    if d >= 3 {
                        return Ok(Some(constant(0)));
                    }
                    let glid = builtins.linear_id(b, remap.grid)?;
                    let mut v = glid;
                    for below in 0..d as usize {
                        v = b
                            .build_int_unsigned_div(v, constant(remap.global[below]), "")
                            .map_err(codegen)?;
                    }
                    let v = b.build_int_unsigned_rem(v, constant(remap.global[d3]), "").map_err(codegen)?;
                    Some(b.build_int_add(v, constant(remap.offset[d3]), "").map_err(codegen)?)
                }
                _ => None,
            })
        };
        let value = match item {
            WorkItem::WorkDim => Some(context.i32_type().const_int(remap.dims, false)),
            WorkItem::GlobalLinearId if remap.reshaped => Some(builtins.linear_id(b, remap.grid)?),
            WorkItem::GlobalSize | WorkItem::NumGroups | WorkItem::GlobalId => {
                match raw::const_arg(call, 0) {
                    Some(d) => per_dim(d)?,
                    None => {
                        // A dimension known only at run time: select among the three.
                        let Some(outside) = per_dim(3)? else { continue };
                        let each =
                            |d: usize| Ok(per_dim(d as u64)?.expect("remapped in every dimension or none"));
                        Some(select_dimension(b, call, outside, each)?)
                    }
                }
            }
            _ => None,
        };
        if let Some(v) = value {
            let ty = call.get_type().into_int_type();
            let v = b.build_int_cast(v, ty, "").map_err(codegen)?;
            raw::replace_uses(call, v);
            call.erase_from_basic_block();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::{NdRange, Range};

    /// Gantry's slowest-first triples become OpenCL's fastest-first ones; an ND
    /// kernel's group counts are its own.
    #[test]
    fn orders_and_counts() {
        assert_eq!(opencl_order([4, 8, 1], 2, 1), [8, 4, 1]);
        assert_eq!(opencl_order([3, 5, 7], 3, 1), [7, 5, 3]);
        let own = NdRange::new([2, 64], [1, 16]).geometry().unwrap();
        let grid = NdRange::new([4, 64], [1, 16]).geometry().unwrap();
        let r = Remap::new(&own, &grid, false);
        assert_eq!((r.global, r.groups, r.grid, r.total()), ([64, 2, 1], Some([4, 2, 1]), [64, 4, 1], 128));
        let plain = Geometry::for_range(Range::d1(10)).unwrap();
        assert_eq!(Remap::new(&plain, &grid, true).groups, None);
    }
}
