//! PTX (to be written).
/// x
pub struct PtxCompiler;
/// x
pub struct PtxKernel;
