//! The one error type of this crate, shared by every implementation of the trait.

use thiserror::Error;

/// A collective operation that did not complete.
///
/// Every variant names the operation (`broadcast`, `all_gather`, `barrier`) and the rank that
/// reports it. Implementations outside this crate (MPI, torch.distributed) report their
/// transport's own failures as [`CollectiveError::Failed`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CollectiveError {
    /// The root of a broadcast is not a rank of the group.
    #[error("collective `{op}` failed on rank {rank}: root {root} is not a rank of a world of {world_size}")]
    NoSuchRoot {
        /// The operation.
        op: &'static str,
        /// The calling rank.
        rank: u64,
        /// The root asked for.
        root: u64,
        /// Number of ranks.
        world_size: u64,
    },
    /// Another rank of the group panicked, or dropped its handle, before the operation
    /// completed: the group can no longer meet.
    #[error("collective `{op}` failed on rank {rank}: {}", peer_reason(*.peer, *.panicked))]
    PeerGone {
        /// The operation.
        op: &'static str,
        /// The calling rank.
        rank: u64,
        /// The rank that left.
        peer: u64,
        /// Whether it left by panicking.
        panicked: bool,
    },
    /// Anything else the implementation or its transport reports.
    #[error("collective `{op}` failed on rank {rank}: {reason}")]
    Failed {
        /// The operation.
        op: &'static str,
        /// The calling rank.
        rank: u64,
        /// What went wrong.
        reason: String,
    },
}

fn peer_reason(peer: u64, panicked: bool) -> String {
    if panicked {
        format!("rank {peer} panicked")
    } else {
        format!("rank {peer} left the group")
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;
