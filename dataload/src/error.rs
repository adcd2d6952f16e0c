//! The one error type of this crate.

use thiserror::Error;

/// Everything that can go wrong while configuring, running or restoring a loader.
///
/// Messages are lowercase and name the offending values; they are part of the API and are
/// pinned by tests.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataloadError {
    /// A required builder field was never set.
    #[error("missing `{field}`: set it on the builder before `build()`")]
    Missing {
        /// Name of the builder field.
        field: &'static str,
    },
    /// A numeric setting is outside the range it can take.
    #[error("invalid `{field}`: {value} ({reason})")]
    InvalidValue {
        /// Name of the setting.
        field: &'static str,
        /// The value given, as text.
        value: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The rank is not smaller than the world size.
    #[error("rank {rank} is out of range for a world of {world_size} ranks")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world_size: usize,
    },
    /// accelerate refuses `split_batches` when the batch does not divide among the ranks.
    #[error(
        "`split_batches` needs the batch size ({batch_size}) to be a round multiple of the number of processes ({world_size})"
    )]
    SplitNotDivisible {
        /// Batch size of the underlying batch sampler.
        batch_size: usize,
        /// Number of ranks.
        world_size: usize,
    },
    /// accelerate refuses `split_batches` when batches have no fixed size.
    #[error("`split_batches` needs a fixed batch size, but the batches have varying sizes")]
    SplitNeedsBatchSize,
    /// accelerate refuses dispatching when batches are not placed on a device.
    #[error("`dispatch_batches = true` requires `put_on_device = true`")]
    DispatchWithoutDevicePlacement,
    /// Shuffling without `use_seedable_sampler` depends on torch's global generator, which
    /// nothing here can reproduce or resume.
    #[error(
        "shuffling needs `use_seedable_sampler = true`: without it the order comes from torch's global generator and cannot be reproduced"
    )]
    ShuffleNeedsSeedableSampler,
    /// A seedable sampler was asked for but no seed is known.
    #[error("shuffling needs a seed: set `data_seed` in the configuration or give the torch initial seed")]
    MissingSeed,
    /// The seed does not fit torch's `manual_seed` (`[-2^63, 2^64)`).
    #[error("seed {seed} is out of the range torch accepts ([-2^63, 2^64))")]
    SeedOutOfRange {
        /// The seed given.
        seed: i128,
    },
    /// `seed + epoch` passed 2^64 - 1, where torch's `manual_seed` raises an overflow error.
    #[error("seed {seed} + epoch {epoch} overflows the 64 bits torch's `manual_seed` accepts")]
    SeedOverflow {
        /// The sampler's initial seed.
        seed: i128,
        /// The epoch.
        epoch: u64,
    },
    /// The permutation does not fit in this machine's address space.
    #[error("dataset of {len} samples is too large to permute on this machine")]
    TooLarge {
        /// Dataset length.
        len: u64,
    },
    /// A saved state could not be parsed.
    #[error("malformed loader state: {reason}")]
    MalformedState {
        /// What the parser said.
        reason: String,
    },
    /// A saved state comes from a format version this build does not know.
    #[error("unsupported loader state version {found} (this build reads version {supported})")]
    UnsupportedVersion {
        /// Version in the state.
        found: u32,
        /// Version this build reads.
        supported: u32,
    },
    /// A saved state does not belong to this loader.
    #[error("loader state does not fit this loader: `{field}` was {saved} when saved, is {current} now")]
    StateMismatch {
        /// The field that differs.
        field: &'static str,
        /// Its value in the saved state.
        saved: String,
        /// Its value in the loader.
        current: String,
    },
    /// A saved state is internally inconsistent.
    #[error("inconsistent loader state: {reason}")]
    InconsistentState {
        /// What is inconsistent.
        reason: String,
    },
    /// A collective operation failed.
    #[error("collective `{op}` failed on rank {rank}: {reason}")]
    Collective {
        /// The operation (`broadcast`, `all_gather`, `barrier`).
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// What went wrong.
        reason: String,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = DataloadError> = std::result::Result<T, E>;
