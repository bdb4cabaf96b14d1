//! placeholder-build
