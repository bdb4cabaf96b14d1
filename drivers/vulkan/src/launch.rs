//! A kernel launch's shape on Vulkan: the workgroup size and the group counts of
//! its geometry, checked against the shader and the device's limits.

use gantry_driver::Geometry;

use crate::device::Limits;
use crate::spirv::Dim;

/// Work-items per workgroup along `x` that a plain range gets where the shader
/// lets the launch set it: 256, since 64-wide groups leave half an NVIDIA GPU's
/// memory bandwidth unused on elementwise kernels (docs/PERFORMANCE.md, "Workgroup
/// width of WGSL kernels on the H100").
pub const PLAIN_GROUP: u32 = 256;

/// A launch's workgroup size and group counts (Vulkan order: `x` is the range's
/// last, fastest dimension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub size: [u32; 3],
    pub groups: [u32; 3],
}

/// The shape of a launch over `geometry` of a shader whose workgroup dimensions
/// are `dims`; the error says why it cannot run.
pub(crate) fn shape(geometry: &Geometry, dims: &[Dim; 3], limits: &Limits) -> Result<Shape, String> {
    let d = geometry.dims();
    let flip = |v: [usize; 3]| [0, 1, 2].map(|i| if i < d { v[d - 1 - i] } else { 1 });
    let (global, local) = (flip(geometry.global_range()), flip(geometry.local_range()));
    let mut size = [1u32; 3];
    for i in 0..3 {
        size[i] = match (dims[i], geometry.is_nd()) {
            (Dim::Fixed(f), true) if f as usize != local[i] => {
                return Err(format!(
                "the ND-range's local size {:?} (x, y, z) does not match the shader's workgroup size {:?}",
                local,
                dims.map(|d| match d {
                    Dim::Fixed(f) => f as usize,
                    Dim::Spec(_) => 0,
                })
            ))
            }
            (Dim::Fixed(f), _) => f,
            (Dim::Spec(_), true) => {
                u32::try_from(local[i]).map_err(|_| format!("local size {} is too large", local[i]))?
            }
            (Dim::Spec(_), false) if i == 0 => PLAIN_GROUP,
            (Dim::Spec(_), false) => 1,
        };
    }
    let invocations = size.iter().map(|&s| s as u64).product::<u64>();
    if size.iter().zip(limits.max_group).any(|(&s, m)| s > m) || invocations > limits.max_invocations as u64 {
        return Err(format!(
            "a workgroup of {size:?} exceeds the device's limits ({:?}, {} invocations)",
            limits.max_group, limits.max_invocations
        ));
    }
    let mut groups = [1u32; 3];
    for i in 0..3 {
        let n = global[i].div_ceil(size[i] as usize);
        groups[i] = u32::try_from(n).ok().filter(|&g| g <= limits.max_groups[i]).ok_or_else(|| {
            format!("{n} groups in dimension {i} exceed the device's {}", limits.max_groups[i])
        })?;
    }
    Ok(Shape { size, groups })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gantry_driver::{NdRange, Range};

    fn limits() -> Limits {
        Limits {
            max_shared: 32768,
            max_group: [1024, 1024, 64],
            max_invocations: 1024,
            max_groups: [65535; 3],
            max_push: 128,
            storage_align: 16,
            max_storage_range: 1 << 30,
            denorm_preserve_f32: false,
        }
    }

    #[test]
    fn the_last_dimension_is_x_and_sizes_must_match() {
        let spec = [Dim::Spec(0), Dim::Spec(1), Dim::Spec(2)];
        let nd = NdRange::new([64, 32], [4, 16]).geometry().unwrap();
        assert_eq!(shape(&nd, &spec, &limits()).unwrap(), Shape { size: [16, 4, 1], groups: [2, 16, 1] });
        let fixed = [Dim::Fixed(16), Dim::Fixed(4), Dim::Fixed(1)];
        assert!(shape(&nd, &fixed, &limits()).is_ok());
        let other = [Dim::Fixed(8), Dim::Fixed(8), Dim::Fixed(1)];
        assert!(shape(&nd, &other, &limits()).unwrap_err().contains("does not match"));
        let plain = Geometry::for_range(Range::d1(1000)).unwrap();
        let groups = 1000usize.div_ceil(PLAIN_GROUP as usize) as u32;
        assert_eq!(
            shape(&plain, &spec, &limits()).unwrap().groups,
            [groups, 1, 1],
            "ceil(1000 / PLAIN_GROUP)"
        );
        let big = NdRange::new(4096, 2048).geometry().unwrap();
        assert!(shape(&big, &spec, &limits()).unwrap_err().contains("limits"));
    }
}
