//! The one error type of this crate.
//!
//! Paths stay [`PathBuf`]s and operating-system errors stay [`std::io::Error`]s (the
//! `#[source]` of [`DataloadError::Io`]), so that a caller can match on the file and on
//! [`std::io::Error::kind`] (the Python bindings map it to `FileNotFoundError` and friends)
//! instead of parsing text. Messages show paths with [`Path::display`](std::path::Path::display).

use std::path::PathBuf;

use collective::CollectiveError;
use thiserror::Error;

/// Everything that can go wrong while configuring, running or restoring a loader.
///
/// Messages are lowercase and name the offending values; they are part of the API and are
/// pinned by tests.
///
/// Two errors are equal when they are the same variant with the same message (every field
/// is part of the message) and, for I/O errors, the same [`std::io::ErrorKind`]:
/// `std::io::Error` itself has no equality.
#[derive(Debug, Error)]
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
    /// accelerate refuses `split_batches` when batches have no fixed size (an unbatched
    /// loader, or a batch sampler whose batches vary).
    #[error("`split_batches` needs a fixed batch size: the loader has no batch size to split (it is unbatched, or its batches vary in size)")]
    SplitNeedsBatchSize,
    /// An unbatched iterable loader cannot be sharded per rank: accelerate's
    /// `IterableDatasetShard` cuts the stream into batches of a size the loader does not have.
    #[error(
        "an unbatched loader (no `batch_size`) over an iterable dataset cannot be sharded per rank over {world_size} ranks; dispatch its batches (`dispatch_batches = true`) or give a batch size"
    )]
    ShardNeedsBatchSize {
        /// Number of ranks.
        world_size: usize,
    },
    /// accelerate refuses dispatching when batches are not placed on a device.
    #[error("`dispatch_batches = true` requires `put_on_device = true`")]
    DispatchWithoutDevicePlacement,
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
    /// A position torchdata recorded is of another order than the loader's (a generator for
    /// a loader that does not shuffle from one, or none for one that does).
    #[error("the torchdata state holds {saved}, this loader's order is {current}")]
    TorchdataMismatch {
        /// What the record holds.
        saved: &'static str,
        /// The loader's order.
        current: &'static str,
    },
    /// A saved state is internally inconsistent.
    #[error("inconsistent loader state: {reason}")]
    InconsistentState {
        /// What is inconsistent.
        reason: String,
    },
    /// A collective operation (broadcast, gather, barrier) did not complete.
    #[error("{source}")]
    Collective {
        /// What the collective reported.
        #[source]
        source: CollectiveError,
    },
    /// A dispatcher got or was given something it cannot use: a malformed message from rank
    /// 0, no underlying batches on rank 0, a gathered part that is not whole indices.
    #[error("collective `{op}` failed on rank {rank}: {reason}")]
    Dispatch {
        /// The operation (`broadcast`, `all_gather`).
        op: &'static str,
        /// The calling rank.
        rank: u64,
        /// What went wrong.
        reason: String,
    },
    /// A file could not be opened, read, mapped or listed.
    #[error("`{path}`: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// A data file (or what a link in its place points to) is not a regular file: a FIFO, a
    /// socket, a device or a directory, refused before it is read.
    #[error("`{path}`: is {kind}, not a regular file; refusing to read it")]
    NotARegularFile {
        /// The path given or found.
        path: PathBuf,
        /// What it is (`a FIFO`, `a socket`, `a device`, `a directory`).
        kind: &'static str,
    },
    /// A glob does not parse.
    #[error("`{pattern}`: {reason}")]
    BadPattern {
        /// The glob given.
        pattern: PathBuf,
        /// What the glob parser said.
        reason: String,
    },
    /// A data file's size changed between indexing it and mapping it, or since it was opened
    /// (a concurrent writer truncated it): refused rather than read past its new end.
    #[error("`{path}`: the file changed while opened")]
    FileChanged {
        /// The file.
        path: PathBuf,
    },
    /// A data file ends before a record its index points at.
    #[error("`{path}`: the file is shorter than its index")]
    ShorterThanIndex {
        /// The file.
        path: PathBuf,
    },
    /// A stored line index matches its data file's size and modification time but not its
    /// own rules; it is refused rather than trusted.
    #[error("`{path}`: corrupt line index of `{data}`: {reason}\nhint: delete the index file; it is rebuilt on the next open")]
    CorruptIndex {
        /// The index file.
        path: PathBuf,
        /// The data file it indexes.
        data: PathBuf,
        /// Which check failed.
        reason: String,
    },
    /// A path, directory or glob names no data file.
    #[error("`{pattern}` matches no data files (looked for {wanted})")]
    NoFiles {
        /// The path, directory or glob given.
        pattern: PathBuf,
        /// The file name endings looked for.
        wanted: String,
    },
    /// A file is shorter than its header or its element size says.
    #[error("`{path}` is truncated: {expected} bytes expected, {found} found")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header (or the element size) calls for.
        expected: u64,
        /// Bytes there are.
        found: u64,
    },
    /// A token file holds elements that are not integer tokens.
    #[error("`{path}` holds `{found}`, but token files must hold one of {expected}")]
    WrongDtype {
        /// The file.
        path: PathBuf,
        /// The element type found.
        found: String,
        /// The element types accepted.
        expected: &'static str,
    },
    /// A file's header or framing is malformed.
    #[error("`{path}`: malformed {format}: {reason}")]
    BadFormat {
        /// The file.
        path: PathBuf,
        /// Which format was expected (`npy`, `arrow ipc`, `parquet`, `line index`).
        format: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A selected column does not exist.
    #[error("`{path}` has no column `{column}` (it has: {available})")]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The column asked for.
        column: String,
        /// The columns there are, comma-separated.
        available: String,
    },
    /// Shards of one dataset disagree on their schema.
    #[error("`{path}` does not match the first shard `{first}`: {reason}")]
    SchemaMismatch {
        /// The shard that differs.
        path: PathBuf,
        /// The first shard.
        first: PathBuf,
        /// How it differs.
        reason: String,
    },
    /// Decoding records failed.
    #[error("`{path}`, row {row}, column `{column}`: {reason}")]
    BadRecord {
        /// The file.
        path: PathBuf,
        /// The first row (in the file) of the unit that failed to decode.
        row: u64,
        /// The column (`*` when the failure is not in one column).
        column: String,
        /// What the decoder said.
        reason: String,
    },
    /// A zstd frame does not decompress.
    #[error("`{path}`: corrupt zstd frame at byte {offset}: {reason}")]
    CorruptFrame {
        /// The file.
        path: PathBuf,
        /// Offset of the frame in the compressed file.
        offset: u64,
        /// What zstd said.
        reason: String,
    },
    /// A line of a JSON-lines file is not JSON.
    #[error("`{path}`, line {line}, column {column}: not JSON: {reason}")]
    NotJson {
        /// The file.
        path: PathBuf,
        /// Line number in the (decompressed) file, from 1.
        line: u64,
        /// Column in that line, from 1.
        column: u64,
        /// What the parser said.
        reason: String,
    },
    /// A mixture definition that does not hold together.
    #[error("invalid mixture `{field}`: {reason}")]
    BadMixture {
        /// The field of the definition.
        field: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// A sample index past the end of the dataset.
    #[error("sample {index} is out of range for a dataset of {len} samples")]
    IndexOutOfRange {
        /// The index asked for.
        index: u64,
        /// Dataset length.
        len: u64,
    },
    /// A state saved on other data.
    #[error(
        "the data changed since this loader state was saved: its fingerprint was `{saved}`, it is `{current}` now\nhint: resume on the files the state was saved with, or start the loader without the state"
    )]
    DataChanged {
        /// The fingerprint in the state (or `none`).
        saved: String,
        /// The fingerprint of the data now.
        current: String,
    },
    /// A prefetch worker died.
    #[error("prefetch worker failed: {reason}")]
    Worker {
        /// What happened.
        reason: String,
    },
}

impl DataloadError {
    /// An I/O error on `path`.
    #[cfg(feature = "sources")]
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io { path: path.to_path_buf(), source }
    }
}

/// What kind of failure a [`DataloadError`] is: what the Python package's exception class and
/// a caller's handling follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A sampler or loader configuration that cannot be run (accelerate refuses it too), or
    /// values out of range.
    Configuration,
    /// A loader state that cannot be loaded: malformed, of another version, or inconsistent.
    State,
    /// A loader state saved with other settings than the current ones.
    StateMismatch,
    /// A dataset file that is defective, or changed under its index.
    Data,
    /// The file system failed.
    Io,
    /// A collective operation between ranks failed.
    Collective,
}

impl DataloadError {
    /// The kind of this error. Every variant names its kind here, so a new variant decides
    /// what it is instead of falling into a default.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Missing { .. }
            | Self::InvalidValue { .. }
            | Self::RankOutOfRange { .. }
            | Self::SplitNotDivisible { .. }
            | Self::SplitNeedsBatchSize
            | Self::ShardNeedsBatchSize { .. }
            | Self::DispatchWithoutDevicePlacement
            | Self::MissingSeed
            | Self::SeedOutOfRange { .. }
            | Self::SeedOverflow { .. }
            | Self::TooLarge { .. }
            | Self::BadMixture { .. } => ErrorKind::Configuration,
            Self::MalformedState { .. } | Self::UnsupportedVersion { .. } | Self::InconsistentState { .. } => {
                ErrorKind::State
            }
            Self::StateMismatch { .. } | Self::TorchdataMismatch { .. } => ErrorKind::StateMismatch,
            Self::Collective { .. } | Self::Dispatch { .. } => ErrorKind::Collective,
            Self::Io { .. } => ErrorKind::Io,
            Self::NotARegularFile { .. }
            | Self::BadPattern { .. }
            | Self::FileChanged { .. }
            | Self::ShorterThanIndex { .. }
            | Self::CorruptIndex { .. }
            | Self::NoFiles { .. }
            | Self::Truncated { .. }
            | Self::WrongDtype { .. }
            | Self::BadFormat { .. }
            | Self::MissingColumn { .. }
            | Self::SchemaMismatch { .. }
            | Self::BadRecord { .. }
            | Self::CorruptFrame { .. }
            | Self::NotJson { .. }
            | Self::IndexOutOfRange { .. }
            | Self::DataChanged { .. }
            | Self::Worker { .. } => ErrorKind::Data,
        }
    }

    /// The variant's name, as the Python bindings expose it (`.variant`). Every variant is
    /// named here, so a new variant must be given its name.
    pub fn variant_name(&self) -> &'static str {
        match self {
            Self::Missing { .. } => "Missing",
            Self::InvalidValue { .. } => "InvalidValue",
            Self::RankOutOfRange { .. } => "RankOutOfRange",
            Self::SplitNotDivisible { .. } => "SplitNotDivisible",
            Self::SplitNeedsBatchSize => "SplitNeedsBatchSize",
            Self::ShardNeedsBatchSize { .. } => "ShardNeedsBatchSize",
            Self::DispatchWithoutDevicePlacement => "DispatchWithoutDevicePlacement",
            Self::MissingSeed => "MissingSeed",
            Self::SeedOutOfRange { .. } => "SeedOutOfRange",
            Self::SeedOverflow { .. } => "SeedOverflow",
            Self::TooLarge { .. } => "TooLarge",
            Self::MalformedState { .. } => "MalformedState",
            Self::UnsupportedVersion { .. } => "UnsupportedVersion",
            Self::StateMismatch { .. } => "StateMismatch",
            Self::TorchdataMismatch { .. } => "TorchdataMismatch",
            Self::InconsistentState { .. } => "InconsistentState",
            Self::Collective { .. } => "Collective",
            Self::Dispatch { .. } => "Dispatch",
            Self::Io { .. } => "Io",
            Self::NotARegularFile { .. } => "NotARegularFile",
            Self::BadPattern { .. } => "BadPattern",
            Self::FileChanged { .. } => "FileChanged",
            Self::ShorterThanIndex { .. } => "ShorterThanIndex",
            Self::CorruptIndex { .. } => "CorruptIndex",
            Self::NoFiles { .. } => "NoFiles",
            Self::Truncated { .. } => "Truncated",
            Self::WrongDtype { .. } => "WrongDtype",
            Self::BadFormat { .. } => "BadFormat",
            Self::MissingColumn { .. } => "MissingColumn",
            Self::SchemaMismatch { .. } => "SchemaMismatch",
            Self::BadRecord { .. } => "BadRecord",
            Self::CorruptFrame { .. } => "CorruptFrame",
            Self::NotJson { .. } => "NotJson",
            Self::BadMixture { .. } => "BadMixture",
            Self::IndexOutOfRange { .. } => "IndexOutOfRange",
            Self::DataChanged { .. } => "DataChanged",
            Self::Worker { .. } => "Worker",
        }
    }
}

impl From<CollectiveError> for DataloadError {
    fn from(source: CollectiveError) -> Self {
        Self::Collective { source }
    }
}

impl PartialEq for DataloadError {
    fn eq(&self, other: &Self) -> bool {
        let kinds = match (self, other) {
            (Self::Io { source: a, .. }, Self::Io { source: b, .. }) => a.kind() == b.kind(),
            _ => true,
        };
        std::mem::discriminant(self) == std::mem::discriminant(other) && kinds && self.to_string() == other.to_string()
    }
}

impl Eq for DataloadError {}

/// Shorthand used throughout the crate.
pub type Result<T, E = DataloadError> = std::result::Result<T, E>;

/// The text a caught panic carries (`panic!`'s message), for the errors that replace panics
/// of the Arrow and Parquet decoders.
#[cfg(feature = "sources")]
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variant's name as `Debug` writes it: what precedes its fields.
    fn debug_head(e: &DataloadError) -> String {
        let debug = format!("{e:?}");
        debug.split([' ', '{', '(']).next().unwrap_or_default().to_string()
    }

    #[test]
    fn variant_name_is_the_debug_name() {
        let errors = [
            DataloadError::Missing { field: "dataset" },
            DataloadError::SplitNeedsBatchSize,
            DataloadError::ShardNeedsBatchSize { world_size: 2 },
            DataloadError::MissingSeed,
            DataloadError::SeedOverflow { seed: 1, epoch: 2 },
            DataloadError::Collective {
                source: CollectiveError::NoSuchRoot { op: "broadcast", rank: 0, root: 3, world_size: 2 },
            },
            DataloadError::Io { path: "a.bin".into(), source: std::io::Error::other("boom") },
            DataloadError::NotJson { path: "a.jsonl".into(), line: 1, column: 2, reason: "eof".into() },
            DataloadError::Worker { reason: "panicked".into() },
        ];
        for e in &errors {
            assert_eq!(e.variant_name(), debug_head(e), "{e:?}");
        }
    }
}
