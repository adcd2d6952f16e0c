//! The one error type of the `ckpt` crate.
//!
//! Every variant names what a user needs to find the problem: the file, and where it applies
//! the tensor. Messages are lowercase, one line, and name literals in backticks.

use std::path::PathBuf;

/// Everything that can go wrong while reading, planning or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
// Each variant's fields are named for what they hold; its message (`Error::raw`) says the rest.
#[allow(missing_docs)]
pub enum Error {
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    HeaderTooSmall {
        path: PathBuf,
        len: u64,
    },
    HeaderTooLarge {
        path: PathBuf,
        header_len: u64,
        max: u64,
    },
    HeaderBeyondFile {
        path: PathBuf,
        header_len: u64,
        len: u64,
    },
    BadHeaderJson {
        path: PathBuf,
        reason: String,
    },
    BadTensorEntry {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    UnknownDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    DuplicateTensor {
        path: PathBuf,
        tensor: String,
    },
    DuplicateInFile {
        path: PathBuf,
        tensor: String,
    },
    SizeMismatch {
        path: PathBuf,
        tensor: String,
        dtype: String,
        shape: Vec<u64>,
        expected: u64,
        found: u64,
    },
    BadOffset {
        path: PathBuf,
        tensor: String,
        expected: u64,
        found: u64,
    },
    LengthMismatch {
        path: PathBuf,
        len: u64,
        expected: u64,
    },
    BadMetadata {
        path: PathBuf,
        reason: String,
    },
    BadIndex {
        path: PathBuf,
        reason: String,
    },
    MissingShard {
        index: PathBuf,
        tensor: String,
        file: String,
    },
    TensorNotInShard {
        index: PathBuf,
        tensor: String,
        file: String,
    },
    DuplicateAcrossShards {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    UnlistedTensor {
        index: PathBuf,
        file: PathBuf,
        tensor: String,
    },
    UnsafeShardPath {
        index: PathBuf,
        tensor: String,
        file: String,
    },
    NotACheckpoint {
        path: PathBuf,
    },
    /// A folder of `.safetensors` files that fit no layout: `found` names some of them.
    UnknownSafetensorsLayout {
        path: PathBuf,
        count: usize,
        found: Vec<String>,
    },
    BadSize {
        input: String,
        reason: String,
    },
    BadHubUrl {
        input: String,
        reason: String,
    },
    NotInHubCache {
        repo: String,
        revision: String,
        file: String,
        cache: PathBuf,
    },
    OutputIsSource {
        path: PathBuf,
    },
    ExpandedView {
        path: PathBuf,
        tensor: String,
        output: u64,
        storage: u64,
    },
    NotARegularFile {
        path: PathBuf,
        kind: &'static str,
    },
    PlantedLink {
        path: PathBuf,
    },
    MetadataConflict {
        key: String,
        first: String,
        first_file: PathBuf,
        second: String,
        second_file: PathBuf,
    },
    ChecksumMismatch {
        path: PathBuf,
        file: String,
        expected: String,
        found: String,
    },
    BadManifest {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    BadZip {
        path: PathBuf,
        reason: String,
    },
    RecordBeyondFile {
        path: PathBuf,
        record: String,
        offset: u64,
        len: u64,
        file_len: u64,
    },
    RecordTooLarge {
        path: PathBuf,
        record: String,
        size: u64,
        limit: u64,
    },
    /// Stored bytes whose CRC32 is not the one their zip record carries: the file changed after
    /// it was written (a flipped bit, a partial overwrite).
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
    InflateOverrun {
        path: PathBuf,
        record: String,
        declared: u64,
    },
    RefusedGlobal {
        path: PathBuf,
        global: String,
    },
    /// A torch file naming globals outside torch's weights-only list and the option
    /// `allow_globals`: the one refused first, then the file's others (at most 16 in all).
    GlobalNotAllowed {
        path: PathBuf,
        globals: Vec<String>,
        /// Whether `allow_globals` named anything.
        allowing: bool,
    },
    /// An option's value that cannot be used.
    BadOption {
        option: &'static str,
        reason: String,
    },
    BadPickle {
        path: PathBuf,
        record: String,
        at: usize,
        reason: String,
    },
    BadTorchFile {
        path: PathBuf,
        reason: String,
    },
    BadTorchTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    NotInSafetensors {
        tensor: String,
        dtype: String,
    },
    BadConvert {
        dst: PathBuf,
        reason: String,
    },
    /// Convert options that cannot be carried out together ([`crate::ConvertOptions::check`]);
    /// each edge words `misuse` with its own spelling of the options.
    Misuse {
        dst: PathBuf,
        misuse: crate::Misuse,
    },
    /// `reshard` of a checkpoint that is not laid out for ranks (`convert` to DCP lays out any).
    NotReshardable {
        path: PathBuf,
    },
    /// A tensor handed to [`crate::save_safetensors`] that cannot be saved as it is.
    BadSaveTensor {
        dst: PathBuf,
        tensor: String,
        reason: String,
    },
    BadBlockScale {
        weight: String,
        scale: String,
        reason: String,
    },
    BadZeroCheckpoint {
        path: PathBuf,
        rank: u64,
        tensor: String,
        reason: String,
    },
    MissingRankFile {
        path: PathBuf,
        rank: u64,
        world: u64,
    },
    BadDcpMetadata {
        path: PathBuf,
        reason: String,
    },
    BadDcpChunk {
        path: PathBuf,
        tensor: String,
        rank: Option<u64>,
        reason: String,
    },
    /// A box of a tensor (a DCP chunk, a rank's shard) that does not fit the tensor or its file:
    /// out of bounds, overlapping another, or leaving part of the tensor uncovered.
    BadBox {
        path: PathBuf,
        tensor: String,
        rank: Option<u64>,
        reason: String,
    },
    Collective {
        dir: PathBuf,
        #[source]
        source: collective::CollectiveError,
    },
    ShardedSave {
        dir: PathBuf,
        rank: u64,
        reason: String,
    },
    BadSaveState {
        path: PathBuf,
        rank: Option<u64>,
        reason: String,
    },
}

/// `Result` with this crate's [`Error`].
impl Error {
    /// The message as the fields make it, before control characters are escaped.
    fn raw(&self) -> String {
        match self {
            Error::Io { path, source } => {
                let path = path.display();
                format!("{path}: {source}")
            }
            Error::HeaderTooSmall { path, len } => {
                let path = path.display();
                format!("{path}: file is {len} bytes, too short for a safetensors header (8 bytes)")
            }
            Error::HeaderTooLarge { path, header_len, max } => {
                let path = path.display();
                format!("{path}: header length {header_len} is larger than the {max} bytes allowed")
            }
            Error::HeaderBeyondFile { path, header_len, len } => {
                let path = path.display();
                format!("{path}: header length {header_len} runs past the end of the {len}-byte file")
            }
            Error::BadHeaderJson { path, reason } => {
                let path = path.display();
                format!("{path}: header is not valid JSON: {reason}")
            }
            Error::BadTensorEntry { path, tensor, reason } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}`: {reason}")
            }
            Error::UnknownDtype { path, tensor, dtype } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}` has unknown dtype `{dtype}`")
            }
            Error::DuplicateTensor { path, tensor } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}` appears twice")
            }
            Error::DuplicateInFile { path, tensor } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}` appears twice in the header")
            }
            Error::SizeMismatch { path, tensor, dtype, shape, expected, found } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}`: shape {shape:?} of `{dtype}` needs {expected} bytes but its offsets span {found}")
            }
            Error::BadOffset { path, tensor, expected, found } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}` starts at data offset {found}, expected {expected} (offsets overlap or leave a gap)")
            }
            Error::LengthMismatch { path, len, expected } => {
                let path = path.display();
                format!("{path}: file is {len} bytes but its header describes {expected} (truncated file or trailing bytes)")
            }
            Error::BadMetadata { path, reason } => {
                let path = path.display();
                format!("{path}: `__metadata__` must map strings to strings: {reason}")
            }
            Error::BadIndex { path, reason } => {
                let path = path.display();
                format!("{path}: index is invalid: {reason}")
            }
            Error::MissingShard { index, tensor, file } => {
                let index = index.display();
                format!("{index}: tensor `{tensor}` is mapped to `{file}`, which does not exist")
            }
            Error::TensorNotInShard { index, tensor, file } => {
                let index = index.display();
                format!("{index}: tensor `{tensor}` is mapped to `{file}`, which does not hold it")
            }
            Error::DuplicateAcrossShards { tensor, first, second } => {
                let first = first.display();
                let second = second.display();
                format!("tensor `{tensor}` is in both {first} and {second}")
            }
            Error::UnlistedTensor { index, file, tensor } => {
                let index = index.display();
                let file = file.display();
                format!("{index}: shard {file} holds tensor `{tensor}`, which the `weight_map` does not list")
            }
            Error::UnsafeShardPath { index, tensor, file } => {
                let index = index.display();
                format!("{index}: `weight_map` entry `{tensor}` points at `{file}`, which is not a plain file name in the index's folder")
            }
            Error::UnknownSafetensorsLayout { path, count, found } => {
                let path = path.display();
                let more = if *count > found.len() { ", …" } else { "" };
                let names: Vec<String> = found.iter().map(|n| format!("`{}`", escape_controls(n))).collect();
                format!(
                    "{path}: {count} `.safetensors` file(s) ({}{more}) fit no checkpoint layout: expected \
                     `model.safetensors`, a `*.safetensors.index.json` naming them, a single file, or DCP \
                     shards `shard-NNNNN-model-NNNNN-of-NNNNN.safetensors`",
                    names.join(", ")
                )
            }
            Error::NotACheckpoint { path } => {
                let path = path.display();
                format!("{path}: no checkpoint found (expected a `.safetensors` file, a `model.safetensors.index.json`, or a folder holding one)")
            }
            Error::BadSize { input, reason } => format!("invalid size `{input}`: {reason}"),
            Error::BadHubUrl { input, reason } => format!("invalid hub address `{input}`: {reason}"),
            Error::NotInHubCache { repo, revision, file, cache } => {
                let cache = cache.display();
                format!("`{repo}` (revision `{revision}`) has no `{file}` in the local Hugging Face cache {cache}")
            }
            Error::OutputIsSource { path } => {
                let path = path.display();
                format!("`{path}` is the source, refusing to overwrite it")
            }
            Error::ExpandedView { path, tensor, output, storage } => {
                let path = path.display();
                format!(
                    "{path}: tensor `{tensor}` is a broadcast view: writing it takes {output} bytes from a \
                     {storage}-byte storage"
                )
            }
            Error::NotARegularFile { path, kind } => {
                let path = path.display();
                format!("{path}: is {kind}, not a regular file; refusing to read it")
            }
            Error::PlantedLink { path } => {
                let path = path.display();
                format!("`{path}` is a symlink that was not named as the output, refusing to replace it")
            }
            Error::MetadataConflict { key, first, first_file, second, second_file } => {
                let first_file = first_file.display();
                let second_file = second_file.display();
                format!("shards disagree on `__metadata__` key `{key}`: {first:?} in {first_file}, {second:?} in {second_file}")
            }
            Error::ChecksumMismatch { path, file, expected, found } => {
                let path = path.display();
                format!("{path}: checksum mismatch for `{file}`: manifest says {expected}, file has {found}")
            }
            Error::BadManifest { path, line, reason } => {
                let path = path.display();
                format!("{path}: bad checksum manifest line {line}: {reason}")
            }
            Error::BadZip { path, reason } => {
                let path = path.display();
                format!("{path}: not a valid zip archive: {reason}")
            }
            Error::RecordBeyondFile { path, record, offset, len, file_len } => {
                let path = path.display();
                format!("{path}: record `{record}` declares {len} bytes at byte {offset}, past the end of the {file_len}-byte file")
            }
            Error::RecordTooLarge { path, record, size, limit } => {
                let path = path.display();
                format!("{path}: record `{record}` is {size} bytes, over the {limit}-byte limit")
            }
            Error::BadChecksum { path, tensor, rank, record, item, stored, actual } => {
                let path = path.display();
                let tensor = tensor.as_ref().map(|t| format!(" tensor `{}`:", escape_controls(t))).unwrap_or_default();
                let item = item.map(|at| format!(" of the item at byte {at}")).unwrap_or_default();
                format!(
                    "{path}{}:{tensor} record `{record}`{item} fails its CRC32 check (the archive says {stored:08x}, \
                     the bytes give {actual:08x}): the file was damaged after it was written",
                    rank_note(*rank)
                )
            }
            Error::InflateOverrun { path, record, declared } => {
                let path = path.display();
                format!("{path}: record `{record}` inflates past its declared {declared} bytes (a zip bomb?)")
            }
            Error::RefusedGlobal { path, global } => {
                let path = path.display();
                format!("{path}: refusing global `{global}`: only the tensor-rebuilding globals of torch's weights-only loader are allowed")
            }
            Error::GlobalNotAllowed { path, globals, allowing } => {
                let path = path.display();
                let (first, rest) = globals.split_first().map_or(("", &[][..]), |(f, r)| (f.as_str(), r));
                let others = if rest.is_empty() {
                    String::new()
                } else {
                    let names: Vec<String> = rest.iter().map(|g| format!("`{g}`")).collect();
                    format!(" (and {})", names.join(", "))
                };
                let them = if rest.is_empty() { "it" } else { "them" };
                if *allowing {
                    format!("{path}: refusing global `{first}`{others}: only the tensor-rebuilding globals of torch's weights-only loader and those `allow_globals` names are allowed")
                } else {
                    format!("{path}: refusing global `{first}`{others}: only the tensor-rebuilding globals of torch's weights-only loader are allowed; `allow_globals` reads {them} as inert data, nothing imported or called")
                }
            }
            Error::BadOption { option, reason } => format!("`{option}`: {reason}"),
            Error::BadPickle { path, record, at, reason } => {
                let path = path.display();
                format!("{path}: `{record}` at byte {at}: {reason}")
            }
            Error::BadTorchFile { path, reason } => {
                let path = path.display();
                format!("{path}: {reason}")
            }
            Error::BadTorchTensor { path, tensor, reason } => {
                let path = path.display();
                format!("{path}: tensor `{tensor}`: {reason}")
            }
            Error::NotInSafetensors { tensor, dtype } => {
                format!("tensor `{tensor}` has dtype `{dtype}`, which safetensors cannot store")
            }
            Error::BadConvert { dst, reason } => {
                let dst = dst.display();
                format!("cannot convert to {dst}: {reason}")
            }
            Error::Misuse { dst, misuse } => {
                let dst = dst.display();
                format!("cannot convert to {dst}: {misuse}")
            }
            Error::NotReshardable { path } => {
                let path = path.display();
                format!(
                    "{path} is not a DCP folder (no `.metadata`), nor a DeepSpeed ZeRO, accelerate or Trainer folder: \
                     reshard rewrites only checkpoints laid out for ranks"
                )
            }
            Error::BadSaveTensor { dst, tensor, reason } => {
                let dst = dst.display();
                format!("cannot save {dst}: tensor `{tensor}` {reason}")
            }
            Error::BadBlockScale { weight, scale, reason } => {
                format!("block-scaled weight `{weight}` with scales `{scale}`: {reason}")
            }
            Error::BadZeroCheckpoint { path, rank, tensor, reason } => {
                let path = path.display();
                format!("{path}: rank {rank}, `{tensor}`: {reason}")
            }
            Error::BadSaveState { path, rank, reason } => match rank {
                Some(r) => format!("{}: rank {r}: {reason}", path.display()),
                None => format!("{}: {reason}", path.display()),
            },
            Error::MissingRankFile { path, rank, world } => {
                let path = path.display();
                format!("{path}: missing: the ZeRO checkpoint has {world} ranks but rank {rank} wrote no such file")
            }
            Error::BadDcpMetadata { path, reason } => {
                let path = path.display();
                format!("{path}: DCP metadata: {reason}")
            }
            Error::BadDcpChunk { path, tensor, rank, reason } | Error::BadBox { path, tensor, rank, reason } => {
                let path = path.display();
                format!("{path}{}: tensor `{tensor}`: {reason}", rank_note(*rank))
            }
            Error::Collective { dir, source } => {
                let dir = dir.display();
                format!("{dir}: sharded save: {source}")
            }
            Error::ShardedSave { dir, rank, reason } => {
                let dir = dir.display();
                format!("{dir}: sharded save failed on rank {rank}: {reason}")
            }
        }
    }
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
            | Error::BadSaveState { .. } => ErrorKind::InvalidData,
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
            Error::Collective { .. } | Error::ShardedSave { .. } => ErrorKind::Collective,
        }
    }
}

/// Messages quote names and paths read from files: a tensor named with a newline must not forge
/// a second line of output, nor a NUL or an escape sequence reach a terminal. Every control
/// character is shown escaped (`\n`, `\u{1b}`); the message stays one line.
impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&escape_controls(&self.raw()))
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
