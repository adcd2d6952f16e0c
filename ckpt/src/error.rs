//! The one error type of the `ckpt` crate.
//!
//! Every variant names what a user needs to find the problem: the file, and where it applies
//! the tensor. Messages are lowercase, one line, and name literals in backticks.

use std::path::PathBuf;

/// Everything that can go wrong while reading, planning or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
// Each variant's fields are named for what they hold; its message is its documentation.
#[allow(missing_docs)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: file is {len} bytes, too short for a safetensors header (8 bytes)")]
    HeaderTooSmall { path: PathBuf, len: u64 },

    #[error("{path}: header length {header_len} is larger than the {max} bytes allowed")]
    HeaderTooLarge { path: PathBuf, header_len: u64, max: u64 },

    #[error("{path}: header length {header_len} runs past the end of the {len}-byte file")]
    HeaderBeyondFile { path: PathBuf, header_len: u64, len: u64 },

    #[error("{path}: header is not valid JSON: {reason}")]
    BadHeaderJson { path: PathBuf, reason: String },

    #[error("{path}: tensor `{tensor}`: {reason}")]
    BadTensorEntry { path: PathBuf, tensor: String, reason: String },

    #[error("{path}: tensor `{tensor}` has unknown dtype `{dtype}`")]
    UnknownDtype { path: PathBuf, tensor: String, dtype: String },

    #[error("{path}: tensor `{tensor}` appears twice")]
    DuplicateTensor { path: PathBuf, tensor: String },

    #[error("{path}: tensor `{tensor}` appears twice in the header")]
    DuplicateInFile { path: PathBuf, tensor: String },

    #[error(
        "{path}: tensor `{tensor}`: shape {shape:?} of `{dtype}` needs {expected} bytes but its offsets span {found}"
    )]
    SizeMismatch { path: PathBuf, tensor: String, dtype: String, shape: Vec<u64>, expected: u64, found: u64 },

    #[error(
        "{path}: tensor `{tensor}` starts at data offset {found}, expected {expected} (offsets overlap or leave a gap)"
    )]
    BadOffset { path: PathBuf, tensor: String, expected: u64, found: u64 },

    #[error("{path}: file is {len} bytes but its header describes {expected} (truncated file or trailing bytes)")]
    LengthMismatch { path: PathBuf, len: u64, expected: u64 },

    #[error("{path}: `__metadata__` must map strings to strings: {reason}")]
    BadMetadata { path: PathBuf, reason: String },

    #[error("{path}: index is invalid: {reason}")]
    BadIndex { path: PathBuf, reason: String },

    #[error("{index}: tensor `{tensor}` is mapped to `{file}`, which does not exist")]
    MissingShard { index: PathBuf, tensor: String, file: String },

    #[error("{index}: tensor `{tensor}` is mapped to `{file}`, which does not hold it")]
    TensorNotInShard { index: PathBuf, tensor: String, file: String },

    #[error("tensor `{tensor}` is in both {first} and {second}")]
    DuplicateAcrossShards { tensor: String, first: PathBuf, second: PathBuf },

    #[error("{index}: shard {file} holds tensor `{tensor}`, which the `weight_map` does not list")]
    UnlistedTensor { index: PathBuf, file: PathBuf, tensor: String },

    #[error("{index}: `weight_map` entry `{tensor}` points at `{file}`, which is not a plain file name in the index's folder")]
    UnsafeShardPath { index: PathBuf, tensor: String, file: String },

    #[error("{path}: no checkpoint found (expected a `.safetensors` file, a `model.safetensors.index.json`, or a folder holding one)")]
    NotACheckpoint { path: PathBuf },

    #[error("invalid size `{input}`: {reason}")]
    BadSize { input: String, reason: String },

    #[error("invalid hub address `{input}`: {reason}")]
    BadHubUrl { input: String, reason: String },

    #[error("`{repo}` (revision `{revision}`) has no `{file}` in the local Hugging Face cache {cache}")]
    NotInHubCache { repo: String, revision: String, file: String, cache: PathBuf },

    #[error("`{path}` is the source, refusing to overwrite it")]
    OutputIsSource { path: PathBuf },

    #[error("{path}: is {kind}, not a regular file; refusing to read it")]
    NotARegularFile { path: PathBuf, kind: &'static str },

    #[error("`{path}` is a symlink that was not named as the output, refusing to replace it")]
    PlantedLink { path: PathBuf },

    #[error("shards disagree on `__metadata__` key `{key}`: {first:?} in {first_file}, {second:?} in {second_file}")]
    MetadataConflict { key: String, first: String, first_file: PathBuf, second: String, second_file: PathBuf },

    #[error("{path}: checksum mismatch for `{file}`: manifest says {expected}, file has {found}")]
    ChecksumMismatch { path: PathBuf, file: String, expected: String, found: String },

    #[error("{path}: bad checksum manifest line {line}: {reason}")]
    BadManifest { path: PathBuf, line: usize, reason: String },

    #[error("{path}: not a valid zip archive: {reason}")]
    BadZip { path: PathBuf, reason: String },

    #[error(
        "{path}: record `{record}` declares {len} bytes at byte {offset}, past the end of the {file_len}-byte file"
    )]
    RecordBeyondFile { path: PathBuf, record: String, offset: u64, len: u64, file_len: u64 },

    #[error("{path}: record `{record}` is {size} bytes, over the {limit}-byte limit")]
    RecordTooLarge { path: PathBuf, record: String, size: u64, limit: u64 },

    #[error("{path}: record `{record}` inflates past its declared {declared} bytes (a zip bomb?)")]
    InflateOverrun { path: PathBuf, record: String, declared: u64 },

    #[error("{path}: refusing global `{global}`: only the tensor-rebuilding globals of torch's weights-only loader are allowed")]
    RefusedGlobal { path: PathBuf, global: String },

    #[error("{path}: `{record}` at byte {at}: {reason}")]
    BadPickle { path: PathBuf, record: String, at: usize, reason: String },

    #[error("{path}: {reason}")]
    BadTorchFile { path: PathBuf, reason: String },

    #[error("{path}: tensor `{tensor}`: {reason}")]
    BadTorchTensor { path: PathBuf, tensor: String, reason: String },

    #[error("tensor `{tensor}` has dtype `{dtype}`, which safetensors cannot store")]
    NotInSafetensors { tensor: String, dtype: String },

    #[error("cannot convert to {dst}: {reason}")]
    BadConvert { dst: PathBuf, reason: String },

    #[error("{path}: rank {rank}, `{tensor}`: {reason}")]
    BadZeroCheckpoint { path: PathBuf, rank: u64, tensor: String, reason: String },

    #[error("{path}: missing: the ZeRO checkpoint has {world} ranks but rank {rank} wrote no such file")]
    MissingRankFile { path: PathBuf, rank: u64, world: u64 },

    #[error("{path}: DCP metadata: {reason}")]
    BadDcpMetadata { path: PathBuf, reason: String },

    #[error("{path}{}: tensor `{tensor}`: {reason}", rank_note(*.rank))]
    BadDcpChunk { path: PathBuf, tensor: String, rank: Option<u64>, reason: String },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// ` (rank R)` for DCP errors whose data file is a rank's (`__R_0.distcp`).
fn rank_note(rank: Option<u64>) -> String {
    rank.map(|r| format!(" (rank {r})")).unwrap_or_default()
}

/// Attaches a path to an `io::Error`; every I/O error of this crate names its file.
pub(crate) trait IoContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| Error::Io { path: path.into(), source })
    }
}
