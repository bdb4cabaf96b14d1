//! What the driver reads from a SPIR-V image: its compute entry point's workgroup
//! size, fixed (`OpExecutionMode LocalSize`, or a constant `WorkgroupSize` built-in)
//! or set per launch through specialization constants (GLSL's
//! `layout(local_size_x_id = 0) in;`: a `WorkgroupSize` built-in made of
//! `OpSpecConstant`s with `SpecId` decorations).

use std::collections::HashMap;

use crate::wgsl::CompileError;

/// One dimension of a SPIR-V shader's workgroup size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dim {
    /// Fixed at this many invocations.
    Fixed(u32),
    /// A specialization constant of this id (its default is ignored: the launch
    /// sets it).
    Spec(u32),
}

const MAGIC: u32 = 0x0723_0203;
const OP_ENTRY_POINT: u32 = 15;
const OP_EXECUTION_MODE: u32 = 16;
const OP_EXECUTION_MODE_ID: u32 = 331;
const OP_DECORATE: u32 = 71;
const OP_CONSTANT: u32 = 43;
const OP_SPEC_CONSTANT: u32 = 50;
const OP_CONSTANT_COMPOSITE: u32 = 44;
const OP_SPEC_CONSTANT_COMPOSITE: u32 = 51;
const EXEC_GLCOMPUTE: u32 = 5;
const MODE_LOCAL_SIZE: u32 = 17;
const MODE_LOCAL_SIZE_ID: u32 = 38;
const DECORATION_BUILTIN: u32 = 11;
const DECORATION_SPEC_ID: u32 = 1;
const BUILTIN_WORKGROUP_SIZE: u32 = 25;

/// The words of a SPIR-V image's bytes (little-endian, as compilers write them).
pub(crate) fn words(bytes: &[u8]) -> Result<Vec<u32>, CompileError> {
    if !bytes.len().is_multiple_of(4) || bytes.len() < 20 {
        return Err(CompileError::SpirV(format!("{} bytes is not a SPIR-V module", bytes.len())));
    }
    let words: Vec<u32> =
        bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if words[0] != MAGIC {
        return Err(CompileError::SpirV("no SPIR-V magic number (a big-endian module is not taken)".into()));
    }
    Ok(words)
}

/// The workgroup size of compute entry point `entry` (Vulkan order: x first).
pub(crate) fn workgroup_size(words: &[u32], entry: &str) -> Result<[Dim; 3], CompileError> {
    let mut entry_id = None;
    let mut local_size = None;
    let mut builtin = None;
    let mut spec_ids: HashMap<u32, u32> = HashMap::new();
    let mut constants: HashMap<u32, Dim> = HashMap::new();
    let mut composites: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut local_size_id = false;
    let mut at = 5;
    while at < words.len() {
        let (op, count) = (words[at] & 0xffff, (words[at] >> 16) as usize);
        if count == 0 || at + count > words.len() {
            return Err(CompileError::SpirV(format!("malformed instruction at word {at}")));
        }
        let args = &words[at + 1..at + count];
        match op {
            OP_ENTRY_POINT if args.len() >= 3 && args[0] == EXEC_GLCOMPUTE && string(&args[2..]) == entry => {
                entry_id = Some(args[1]);
            }
            OP_EXECUTION_MODE if args.len() >= 5 && args[1] == MODE_LOCAL_SIZE => {
                local_size = Some((args[0], [args[2], args[3], args[4]]));
            }
            OP_EXECUTION_MODE_ID if args.len() >= 2 && args[1] == MODE_LOCAL_SIZE_ID => local_size_id = true,
            OP_DECORATE
                if args.len() >= 3 && args[1] == DECORATION_BUILTIN && args[2] == BUILTIN_WORKGROUP_SIZE =>
            {
                builtin = Some(args[0]);
            }
            OP_DECORATE if args.len() >= 3 && args[1] == DECORATION_SPEC_ID => {
                spec_ids.insert(args[0], args[2]);
            }
            OP_CONSTANT if args.len() >= 3 => {
                constants.insert(args[1], Dim::Fixed(args[2]));
            }
            OP_SPEC_CONSTANT if args.len() >= 3 => {
                let dim = spec_ids.get(&args[1]).map_or(Dim::Fixed(args[2]), |&id| Dim::Spec(id));
                constants.insert(args[1], dim);
            }
            OP_CONSTANT_COMPOSITE | OP_SPEC_CONSTANT_COMPOSITE if args.len() >= 5 => {
                composites.insert(args[1], args[2..].to_vec());
            }
            _ => {}
        }
        at += count;
    }
    let Some(entry_id) = entry_id else { return Err(CompileError::NoEntry(entry.to_owned())) };
    if let Some(parts) = builtin.and_then(|b| composites.get(&b)) {
        let dim = |i: usize| {
            constants
                .get(&parts[i])
                .copied()
                .ok_or_else(|| CompileError::SpirV("WorkgroupSize built-in of non-constants".into()))
        };
        return Ok([dim(0)?, dim(1)?, dim(2)?]);
    }
    if local_size_id {
        return Err(CompileError::SpirV(
            "LocalSizeId workgroup sizes are not taken (use a WorkgroupSize built-in)".into(),
        ));
    }
    match local_size {
        Some((id, s)) if id == entry_id => Ok(s.map(Dim::Fixed)),
        _ => Err(CompileError::SpirV(format!("entry point `{entry}` has no LocalSize"))),
    }
}

/// A SPIR-V literal string (NUL-terminated, packed little-endian).
fn string(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// naga's SPIR-V (fixed size) reads back as its workgroup size.
    #[test]
    fn reads_a_fixed_local_size() {
        let w = crate::wgsl::Wgsl::parse("@compute @workgroup_size(8, 4) fn k() {}", "k").unwrap();
        let words = w.spirv([8, 4, 1], false).unwrap();
        assert_eq!(workgroup_size(&words, "k").unwrap(), [Dim::Fixed(8), Dim::Fixed(4), Dim::Fixed(1)]);
        assert!(matches!(workgroup_size(&words, "nope"), Err(CompileError::NoEntry(_))));
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(super::words(&bytes).unwrap(), words);
        assert!(super::words(&bytes[..7]).is_err());
    }
}
