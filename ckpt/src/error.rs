//! The one error type of the `ckpt` crate.
//!
//! Every variant names what a user needs to find the problem: the file, and where it applies
//! the tensor. Messages are lowercase, one line, and name literals in backticks.
//!
//! Messages quote names and paths read from files, and a hostile file can hold a tensor named
//! with a newline, a NUL or an escape sequence. Such a name must not forge a second line of
//! output nor drive a terminal, but the place to stop it is where text reaches a person, not
//! here: an error's `Display` (its `#[error]` message) keeps every field as it is, so a caller
//! matching or comparing a name sees the name the file holds. Each edge escapes the message
//! with [`escape_controls`] as it prints it: the `ckpt` CLI (errors and `verify`'s problems),
//! `statekit-train`, the Python exceptions, and the JSON view of a [`crate::Report`].

use std::path::PathBuf;

/// Everything that can go wrong while reading, planning or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
// Each variant's fields are named for what they hold; its `#[error]` message says the rest.
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
    /// A folder of `.safetensors` files that fit no layout: `found` names some of them.
    #[error("{path}: {count} `.safetensors` file(s) ({}) fit no checkpoint layout: expected \
        `model.safetensors`, a `*.safetensors.index.json` naming them, a single file, or DCP \
        shards `shard-NNNNN-model-NNNNN-of-NNNNN.safetensors`",
        quoted_names(.found, *.count))]
    UnknownSafetensorsLayout { path: PathBuf, count: usize, found: Vec<String> },
    #[error("invalid size `{input}`: {reason}")]
    BadSize { input: String, reason: String },
    #[error("invalid hub address `{input}`: {reason}")]
    BadHubUrl { input: String, reason: String },
    #[error("`{repo}` (revision `{revision}`) has no `{file}` in the local Hugging Face cache {cache}")]
    NotInHubCache { repo: String, revision: String, file: String, cache: PathBuf },
    #[error("`{path}` is the source, refusing to overwrite it")]
    OutputIsSource { path: PathBuf },
    #[error(
        "{path}: tensor `{tensor}` is a broadcast view: writing it takes {output} bytes from a \
        {storage}-byte storage"
    )]
    ExpandedView { path: PathBuf, tensor: String, output: u64, storage: u64 },
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
    /// Stored bytes whose CRC32 is not the one their zip record carries: the file changed after
    /// it was written (a flipped bit, a partial overwrite).
    #[error("{path}{}:{} record `{record}`{} fails its CRC32 check (the archive says {stored:08x}, \
        the bytes give {actual:08x}): the file was damaged after it was written",
        rank_note(.rank), tensor_note(.tensor), item_note(.item))]
    BadChecksum {
        path: PathBuf,
        /// The tensor whose bytes they are; `None` for a record that is not a tensor's.
        tensor: Option<String>,
        rank: Option<u64>,
        record: String,
        /// The offset of the archive the record is in, for a DCP item.
        item: Option<u64>,
        stored: u32,
        actual: u32,
    },
    #[error("{path}: record `{record}` inflates past its declared {declared} bytes (a zip bomb?)")]
    InflateOverrun { path: PathBuf, record: String, declared: u64 },
    #[error("{path}: refusing global `{global}`: only the tensor-rebuilding globals of torch's weights-only loader are allowed")]
    RefusedGlobal { path: PathBuf, global: String },
    /// A torch file naming globals outside torch's weights-only list and the option
    /// `allow_globals`: the one refused first, then the file's others (at most 16 in all).
    #[error("{path}: refusing global {}", globals_refusal(.globals, *.allowing))]
    GlobalNotAllowed {
        path: PathBuf,
        globals: Vec<String>,
        /// Whether `allow_globals` named anything.
        allowing: bool,
    },
    /// An option's value that cannot be used.
    #[error("`{option}`: {reason}")]
    BadOption { option: &'static str, reason: String },
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
    /// Convert options that cannot be carried out together ([`crate::ConvertOptions::check`]);
    /// each edge words `misuse` with its own spelling of the options.
    #[error("cannot convert to {dst}: {misuse}")]
    Misuse { dst: PathBuf, misuse: crate::Misuse },
    /// `reshard` of a checkpoint that is not laid out for ranks (`convert` to DCP lays out any).
    #[error(
        "{path} is not a DCP folder (no `.metadata`), nor a DeepSpeed ZeRO, accelerate or Trainer folder: \
        reshard rewrites only checkpoints laid out for ranks"
    )]
    NotReshardable { path: PathBuf },
    /// A tensor handed to [`crate::save_safetensors`] that cannot be saved as it is.
    #[error("cannot save {dst}: tensor `{tensor}` {reason}")]
    BadSaveTensor { dst: PathBuf, tensor: String, reason: String },
    #[error("block-scaled weight `{weight}` with scales `{scale}`: {reason}")]
    BadBlockScale { weight: String, scale: String, reason: String },
    #[error("{path}: rank {rank}, `{tensor}`: {reason}")]
    BadZeroCheckpoint { path: PathBuf, rank: u64, tensor: String, reason: String },
    #[error("{path}: missing: the ZeRO checkpoint has {world} ranks but rank {rank} wrote no such file")]
    MissingRankFile { path: PathBuf, rank: u64, world: u64 },
    #[error("{path}: DCP metadata: {reason}")]
    BadDcpMetadata { path: PathBuf, reason: String },
    #[error("{path}{}: tensor `{tensor}`: {reason}", rank_note(.rank))]
    BadDcpChunk { path: PathBuf, tensor: String, rank: Option<u64>, reason: String },
    /// A box of a tensor (a DCP chunk, a rank's shard) that does not fit the tensor or its file:
    /// out of bounds, overlapping another, or leaving part of the tensor uncovered.
    #[error("{path}{}: tensor `{tensor}`: {reason}", rank_note(.rank))]
    BadBox { path: PathBuf, tensor: String, rank: Option<u64>, reason: String },
    #[error("{dir}: {source}")]
    Collective {
        dir: PathBuf,
        #[source]
        source: collective::CollectiveError,
    },
    /// Another rank of a job failed a step of an operation and reported its error; nothing was
    /// committed.
    #[error("rank {rank} failed (it reports why); nothing was committed")]
    OtherRank { rank: u64 },
    /// This rank planned another output than rank 0 (their sources or options differ).
    #[error("{path}: rank {rank} planned a different output than rank 0 (were all ranks given the same source and options, on one shared filesystem?)")]
    PlanMismatch { path: PathBuf, rank: u64 },
    #[error("{dir}: sharded save failed on rank {rank}: {reason}")]
    ShardedSave { dir: PathBuf, rank: u64, reason: String },
    #[error("{path}{}: {reason}", rank_colon(.rank))]
    BadSaveState { path: PathBuf, rank: Option<u64>, reason: String },
    /// A Megatron-Core checkpoint that does not hold together: its tracker, a rank's file, a
    /// stage that disagrees with the others, a tensor whose one-rank form cannot be derived.
    #[error("{path}{}:{} {reason}", rank_note(.rank), key_note(.key))]
    BadMegatron { path: PathBuf, key: Option<String>, rank: Option<u64>, reason: String },
}

/// What an [`Error`] is about, for the edges that act on it: the CLI's exit code, the Python
/// bindings' exception class, and `verify`, which reports [`ErrorKind::InvalidData`] as the
/// checkpoint's problems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The checkpoint is defective or hostile: a reader would trip on it.
    InvalidData,
    /// The source is not there, or is not a checkpoint this library reads.
    NotFound,
    /// What was asked cannot be done with this input: an option, a size, a dtype the output
    /// format cannot store, an output that is the source.
    Usage,
    /// The file system failed under a valid request.
    Io,
    /// Another rank of a sharded save failed, or the collective between them did.
    Collective,
}

impl Error {
    /// The kind of this error. Every variant names its kind here, so a new variant decides
    /// what it is instead of falling into a default.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::HeaderTooSmall { .. }
            | Error::HeaderTooLarge { .. }
            | Error::HeaderBeyondFile { .. }
            | Error::BadHeaderJson { .. }
            | Error::BadTensorEntry { .. }
            | Error::UnknownDtype { .. }
            | Error::DuplicateTensor { .. }
            | Error::DuplicateInFile { .. }
            | Error::SizeMismatch { .. }
            | Error::BadOffset { .. }
            | Error::LengthMismatch { .. }
            | Error::BadMetadata { .. }
            | Error::BadIndex { .. }
            | Error::MissingShard { .. }
            | Error::TensorNotInShard { .. }
            | Error::DuplicateAcrossShards { .. }
            | Error::UnlistedTensor { .. }
            | Error::UnsafeShardPath { .. }
            | Error::ExpandedView { .. }
            | Error::NotARegularFile { .. }
            | Error::PlantedLink { .. }
            | Error::MetadataConflict { .. }
            | Error::ChecksumMismatch { .. }
            | Error::BadManifest { .. }
            | Error::BadZip { .. }
            | Error::RecordBeyondFile { .. }
            | Error::RecordTooLarge { .. }
            | Error::BadChecksum { .. }
            | Error::InflateOverrun { .. }
            | Error::RefusedGlobal { .. }
            | Error::GlobalNotAllowed { .. }
            | Error::BadPickle { .. }
            | Error::BadTorchFile { .. }
            | Error::BadTorchTensor { .. }
            | Error::BadBlockScale { .. }
            | Error::BadZeroCheckpoint { .. }
            | Error::MissingRankFile { .. }
            | Error::BadDcpMetadata { .. }
            | Error::BadDcpChunk { .. }
            | Error::BadBox { .. }
            | Error::BadSaveState { .. }
            | Error::BadMegatron { .. } => ErrorKind::InvalidData,
            Error::NotACheckpoint { .. } | Error::UnknownSafetensorsLayout { .. } | Error::NotInHubCache { .. } => {
                ErrorKind::NotFound
            }
            Error::BadSize { .. }
            | Error::BadHubUrl { .. }
            | Error::OutputIsSource { .. }
            | Error::BadOption { .. }
            | Error::NotInSafetensors { .. }
            | Error::BadConvert { .. }
            | Error::Misuse { .. }
            | Error::NotReshardable { .. }
            | Error::BadSaveTensor { .. } => ErrorKind::Usage,
            Error::Io { .. } => ErrorKind::Io,
            Error::Collective { .. }
            | Error::ShardedSave { .. }
            | Error::OtherRank { .. }
            | Error::PlanMismatch { .. } => ErrorKind::Collective,
        }
    }
}

/// `text` with every control character escaped as Rust's `escape_debug` writes it.
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error for a source that ended early: it was changed while we read it.
pub(crate) fn short_source(path: &std::path::Path, at: u64) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("file ended at byte {at} while copying (was it changed during the copy?)"),
        ),
    }
}

/// ` (rank R)` for errors whose data file is a rank's (`__R_0.distcp`).
fn rank_note(rank: &Option<u64>) -> String {
    rank.map(|r| format!(" (rank {r})")).unwrap_or_default()
}

/// `: rank R` for a save-state file that is a rank's.
fn rank_colon(rank: &Option<u64>) -> String {
    rank.map(|r| format!(": rank {r}")).unwrap_or_default()
}

/// ` tensor `NAME`:` for a record that holds a tensor's bytes.
fn tensor_note(tensor: &Option<String>) -> String {
    tensor.as_ref().map(|t| format!(" tensor `{t}`:")).unwrap_or_default()
}

/// ` `KEY`:` for a Megatron error about one key of the checkpoint.
fn key_note(key: &Option<String>) -> String {
    key.as_ref().map(|k| format!(" `{k}`:")).unwrap_or_default()
}

/// ` of the item at byte N` for a record inside a DCP item.
fn item_note(item: &Option<u64>) -> String {
    item.map(|at| format!(" of the item at byte {at}")).unwrap_or_default()
}

/// `found` quoted and joined, with `, …` when the folder holds more (`count`) than it names.
fn quoted_names(found: &[String], count: usize) -> String {
    let names: Vec<String> = found.iter().map(|n| format!("`{n}`")).collect();
    let more = if count > found.len() { ", …" } else { "" };
    format!("{}{more}", names.join(", "))
}

/// What follows `refusing global ` for [`Error::GlobalNotAllowed`]: the first global, the
/// others, and what lets them through.
fn globals_refusal(globals: &[String], allowing: bool) -> String {
    let (first, rest) = globals.split_first().map_or(("", &[][..]), |(f, r)| (f.as_str(), r));
    let others = if rest.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = rest.iter().map(|g| format!("`{g}`")).collect();
        format!(" (and {})", names.join(", "))
    };
    let them = if rest.is_empty() { "it" } else { "them" };
    if allowing {
        format!(
            "`{first}`{others}: only the tensor-rebuilding globals of torch's weights-only loader and those \
             `allow_globals` names are allowed"
        )
    } else {
        format!(
            "`{first}`{others}: only the tensor-rebuilding globals of torch's weights-only loader are allowed; \
             `allow_globals` reads {them} as inert data, nothing imported or called"
        )
    }
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
