//! Pieces shared by Gantry's benchmark binaries.

pub mod eager;
