//! Why graph fusion left kernels unfused: the typed reasons an executable graph
//! keeps in [`crate::ExecPlan::not_fused`], one per chain end or refused chain.

use gantry_driver::fusion::FusionError;

use crate::graph::NodeId;

/// Why graph fusion did not fuse kernels it considered. The kernels still run,
/// unfused, with the results of running them one by one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotFused {
    /// The device's fusion compilers refused the chain (the shared rules' or the
    /// compiler's typed reason, or no compiler takes every kernel's images).
    #[error("kernels {kernels:?} not fused: {reason}")]
    Refused {
        /// The chain's nodes, in order.
        nodes: Vec<NodeId>,
        /// Their names, in order.
        kernels: Vec<String>,
        /// Why the compiler refused.
        reason: FusionError,
    },
    /// A kernel with dynamic parameters is not fused: its arguments change between
    /// submissions, a fused kernel's would not.
    #[error("kernel `{kernel}` has dynamic parameters and is not fused")]
    DynamicParameters {
        /// The kernel's node.
        node: NodeId,
        /// Its name.
        kernel: String,
    },
    /// A node that is not a kernel (a copy, fill or empty node) depends on a chain's
    /// kernel and a later kernel depends on it: the chain ends before that kernel.
    #[error("`{between}` orders between the kernels `{first}` and `{kernel}`")]
    OrderedBetween {
        /// The node between.
        between: String,
        /// The first kernel of the chain it ends.
        first: String,
        /// The kernel that starts the next chain.
        kernel: String,
    },
    /// A node of kind kernel carries no kernel launch (a malformed node list).
    #[error("node `{name}` is not a kernel launch")]
    NotAKernel {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
    },
}
