//! Floating-point arithmetic as written: every floating-point add, subtract,
//! multiply, divide, remainder, negation and dot/vector product of a SPIR-V module
//! made from WGSL is decorated `NoContraction`, so no driver fuses a multiply and an
//! add into one FMA (which WGSL, and SPIR-V without the decoration, allow). A kernel
//! then computes the same bits on every Vulkan device and as the same arithmetic
//! written in Rust on the host; a kernel that wants a fused multiply-add says so with
//! WGSL's `fma`. SPIR-V images given by the user are left as their compiler made them
//! (GLSL's `precise` is the same decoration).
//!
//! Devices may also flush `f32` denormals to zero. Where the device can keep them
//! (`shaderDenormPreserveFloat32`), the module asks it to (the `DenormPreserve`
//! execution mode of `SPV_KHR_float_controls`), so results near zero match the
//! host's too; elsewhere they may not.

/// `OpDecorate` and the `NoContraction` decoration.
const OP_DECORATE: u32 = 71;
const NO_CONTRACTION: u32 = 42;

/// Opcodes whose result `NoContraction` keeps from being contracted, each with its
/// result id in word 2: `OpFNegate`, `OpFAdd`, `OpFSub`, `OpFMul`, `OpFDiv`,
/// `OpFRem`, `OpFMod`, `OpVectorTimesScalar`, `OpMatrixTimesScalar`,
/// `OpVectorTimesMatrix`, `OpMatrixTimesVector`, `OpMatrixTimesMatrix`, `OpDot`.
const ARITHMETIC: [u32; 13] = [127, 129, 131, 133, 136, 140, 141, 142, 143, 144, 145, 146, 148];

/// Whether `opcode` declares a type (`OpTypeVoid` … `OpTypeForwardPointer`): the
/// first one ends the annotations section, where decorations go.
fn declares_a_type(opcode: u32) -> bool {
    (19..=39).contains(&opcode)
}

/// Decorates every floating-point arithmetic result of `words` (a SPIR-V module)
/// `NoContraction`; returns how many. A malformed module is returned unchanged with
/// 0 (the driver's own checks report it).
pub(crate) fn forbid_contraction(words: &mut Vec<u32>) -> usize {
    const HEADER: usize = 5;
    let mut results = Vec::new();
    let mut types_at = None;
    let mut at = HEADER;
    while at < words.len() {
        let (count, opcode) = ((words[at] >> 16) as usize, words[at] & 0xFFFF);
        if count == 0 || at + count > words.len() {
            return 0;
        }
        if types_at.is_none() && declares_a_type(opcode) {
            types_at = Some(at);
        }
        if ARITHMETIC.contains(&opcode) && count >= 3 {
            results.push(words[at + 2]);
        }
        at += count;
    }
    let Some(types_at) = types_at else { return 0 };
    let decorations = results.iter().flat_map(|&id| [(3 << 16) | OP_DECORATE, id, NO_CONTRACTION]);
    words.splice(types_at..types_at, decorations);
    results.len()
}

/// `OpCapability`, `OpExtension`, `OpEntryPoint`, `OpExecutionMode`, the
/// `DenormPreserve` capability and execution mode.
const OP_CAPABILITY: u32 = 17;
const OP_EXTENSION: u32 = 10;
const OP_ENTRY_POINT: u32 = 15;
const OP_EXECUTION_MODE: u32 = 16;
const DENORM_PRESERVE: u32 = 4459;
const DENORM_PRESERVE_CAPABILITY: u32 = 4464;

/// A literal string as SPIR-V words: UTF-8, NUL-terminated, padded to words.
fn string_words(s: &str) -> Vec<u32> {
    let mut bytes = s.as_bytes().to_vec();
    bytes.push(0);
    bytes.resize(bytes.len().next_multiple_of(4), 0);
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Asks every entry point of `words` to keep 32-bit float denormals: the
/// `DenormPreserve` capability after the module's capabilities, the
/// `SPV_KHR_float_controls` extension after it, and the execution mode after each
/// entry point's others. Returns whether it did (a malformed module, or one with
/// no entry point, is left unchanged).
pub(crate) fn preserve_denormals(words: &mut Vec<u32>) -> bool {
    const HEADER: usize = 5;
    let (mut after_capabilities, mut entries, mut after_modes) = (None, Vec::new(), None);
    let mut at = HEADER;
    while at < words.len() {
        let (count, opcode) = ((words[at] >> 16) as usize, words[at] & 0xFFFF);
        if count == 0 || at + count > words.len() {
            return false;
        }
        match opcode {
            OP_CAPABILITY => after_capabilities = Some(at + count),
            OP_ENTRY_POINT if count >= 3 => {
                entries.push(words[at + 2]);
                after_modes = Some(at + count);
            }
            OP_EXECUTION_MODE => after_modes = Some(at + count),
            _ => {}
        }
        at += count;
    }
    let (Some(capabilities_end), Some(modes_end)) = (after_capabilities, after_modes) else { return false };
    let modes: Vec<u32> =
        entries.iter().flat_map(|&e| [(4 << 16) | OP_EXECUTION_MODE, e, DENORM_PRESERVE, 32]).collect();
    words.splice(modes_end..modes_end, modes);
    let name = string_words("SPV_KHR_float_controls");
    let mut header = vec![(2 << 16) | OP_CAPABILITY, DENORM_PRESERVE_CAPABILITY];
    header.push((((1 + name.len()) as u32) << 16) | OP_EXTENSION);
    header.extend(name);
    words.splice(capabilities_end..capabilities_end, header);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-assembled module: header, a capability, a decoration, two types, an
    /// `OpFMul` and an `OpFAdd`: both results get decorated, between the existing
    /// decoration and the first type, and the instruction stream stays well formed.
    #[test]
    fn arithmetic_results_are_decorated_before_the_types() {
        let op = |count: u32, opcode: u32| (count << 16) | opcode;
        let mut words = vec![0x0723_0203, 0x0001_0300, 0, 20, 0];
        words.extend([op(2, 17), 1]); // OpCapability Shader
        words.extend([op(3, OP_DECORATE), 5, 2]); // an existing decoration
        words.extend([op(3, 22), 3, 32]); // %3 = OpTypeFloat 32
        words.extend([op(2, 19), 4]); // %4 = OpTypeVoid
        words.extend([op(5, 133), 3, 10, 8, 9]); // %10 = OpFMul %3 %8 %9
        words.extend([op(5, 129), 3, 11, 10, 9]); // %11 = OpFAdd %3 %10 %9
        words.extend([op(5, 128), 3, 12, 10, 9]); // %12 = OpIAdd: not decorated
        let before = words.len();
        assert_eq!(forbid_contraction(&mut words), 2);
        assert_eq!(words.len(), before + 6);
        assert_eq!(
            &words[10..16],
            &[op(3, OP_DECORATE), 10, NO_CONTRACTION, op(3, OP_DECORATE), 11, NO_CONTRACTION]
        );
        assert_eq!(words[16], op(3, 22), "the types follow the decorations");
        let mut broken = vec![0x0723_0203, 0, 0, 0, 0, op(9, 129)];
        assert_eq!(forbid_contraction(&mut broken), 0, "a truncated module is left alone");
    }

    /// The capability and extension follow the module's capabilities, and the
    /// execution mode follows the entry point's own modes.
    #[test]
    fn denormals_are_preserved_per_entry_point() {
        let op = |count: u32, opcode: u32| (count << 16) | opcode;
        let mut words = vec![0x0723_0203, 0x0001_0300, 0, 20, 0];
        words.extend([op(2, OP_CAPABILITY), 1]);
        words.extend([op(3, 14), 0, 1]); // OpMemoryModel
        words.extend([op(5, OP_ENTRY_POINT), 5, 7, 0x6E69_616D, 0]); // GLCompute %7 "main"
        words.extend([op(6, OP_EXECUTION_MODE), 7, 17, 64, 1, 1]); // LocalSize 64 1 1
        words.extend([op(2, 19), 4]);
        assert!(preserve_denormals(&mut words));
        assert_eq!(&words[7..9], &[op(2, OP_CAPABILITY), DENORM_PRESERVE_CAPABILITY]);
        assert_eq!(words[9] & 0xFFFF, OP_EXTENSION);
        let ext_len = (words[9] >> 16) as usize;
        let ext: Vec<u8> = words[10..9 + ext_len].iter().flat_map(|w| w.to_le_bytes()).collect();
        assert!(ext.starts_with(b"SPV_KHR_float_controls\0"));
        let mode_at = words.iter().position(|&w| w == op(4, OP_EXECUTION_MODE)).expect("the mode");
        assert_eq!(&words[mode_at..mode_at + 4], &[op(4, OP_EXECUTION_MODE), 7, DENORM_PRESERVE, 32]);
        assert_eq!(words[mode_at - 6], op(6, OP_EXECUTION_MODE), "after the entry's LocalSize");
        assert!(!preserve_denormals(&mut vec![0x0723_0203, 0, 0, 0, 0]), "no entry point: unchanged");
    }
}
