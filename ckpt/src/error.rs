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

mod kind;
mod problem;

use std::path::PathBuf;

pub use kind::ErrorKind;
pub use problem::{
    BlockScaleProblem, BoxProblem, ChunkProblem, EntryProblem, HeaderJsonProblem, HfConfigProblem, HubCorruption,
    HubUrlProblem, IndexProblem, JsonKind, ManifestProblem, MetadataProblem, SaveTensorProblem, SizeProblem,
    TorchTensorProblem, ZipProblem,
};

/// Everything that can go wrong while reading, planning or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file system call failed: opening, reading, mapping, writing, renaming or syncing a
    /// file or folder, or a source that ended while it was copied.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder the call was about.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file too short to hold the 8 bytes of its header length.
    #[error("{path}: file is {len} bytes, too short for a safetensors header (8 bytes)")]
    HeaderTooSmall {
        /// The safetensors file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
    },
    /// A safetensors header over the size allowed: one read from a file, or one about to be
    /// written.
    #[error("{path}: header length {header_len} is larger than the {max} bytes allowed")]
    HeaderTooLarge {
        /// The safetensors file read or written.
        path: PathBuf,
        /// The header's length in bytes (the file's first 8 bytes, or what would be written).
        header_len: u64,
        /// The largest header length allowed.
        max: u64,
    },
    /// A safetensors header length that reaches past the end of its file.
    #[error("{path}: header length {header_len} runs past the end of the {len}-byte file")]
    HeaderBeyondFile {
        /// The safetensors file.
        path: PathBuf,
        /// The header length its first 8 bytes give.
        header_len: u64,
        /// The file's length in bytes.
        len: u64,
    },
    /// A safetensors header that is not UTF-8 JSON object text, or one being written that
    /// cannot be serialised.
    #[error("{path}: header is not valid JSON: {problem}")]
    BadHeaderJson {
        /// The safetensors file read or written.
        path: PathBuf,
        /// What is wrong with it.
        problem: HeaderJsonProblem,
    },
    /// A tensor whose header entry does not parse, or whose shape and bytes cannot be
    /// reconciled: a shape that overflows, bytes past the end of its file, a byte count that
    /// is not what its shape needs.
    #[error("{path}: tensor `{tensor}`: {problem}")]
    BadTensorEntry {
        /// The file holding the tensor (the checkpoint's root when it has none).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        problem: EntryProblem,
    },
    /// A safetensors tensor whose `dtype` names no dtype safetensors defines.
    #[error("{path}: tensor `{tensor}` has unknown dtype `{dtype}`")]
    UnknownDtype {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype name the header gives.
        dtype: String,
    },
    /// Two tensors of one checkpoint with the same name, found as its catalog is built.
    #[error("{path}: tensor `{tensor}` appears twice")]
    DuplicateTensor {
        /// The checkpoint's root.
        path: PathBuf,
        /// The name that appears twice.
        tensor: String,
    },
    /// A safetensors header (read, or about to be written) that names one tensor twice.
    #[error("{path}: tensor `{tensor}` appears twice in the header")]
    DuplicateInFile {
        /// The safetensors file read or written.
        path: PathBuf,
        /// The name that appears twice.
        tensor: String,
    },
    /// A safetensors tensor whose `data_offsets` span another byte count than its shape and
    /// dtype need.
    #[error(
        "{path}: tensor `{tensor}`: shape {shape:?} of `{dtype}` needs {expected} bytes but its offsets span {found}"
    )]
    SizeMismatch {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The tensor's dtype.
        dtype: String,
        /// The tensor's shape.
        shape: Vec<u64>,
        /// Bytes the shape and dtype need.
        expected: u64,
        /// Bytes the offsets span.
        found: u64,
    },
    /// A safetensors tensor whose data does not start where the previous one's ends (in
    /// offset order), or ends before it starts.
    #[error(
        "{path}: tensor `{tensor}` starts at data offset {found}, expected {expected} (offsets overlap or leave a gap)"
    )]
    BadOffset {
        /// The safetensors file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The offset where the previous tensor's data ends.
        expected: u64,
        /// The offset its data starts at.
        found: u64,
    },
    /// A safetensors file whose length is not the one its header describes.
    #[error("{path}: file is {len} bytes but its header describes {expected} (truncated file or trailing bytes)")]
    LengthMismatch {
        /// The safetensors file.
        path: PathBuf,
        /// The file's length in bytes.
        len: u64,
        /// The length its header describes.
        expected: u64,
    },
    /// A safetensors `__metadata__` that is not an object of strings to strings.
    #[error("{path}: `__metadata__` must map strings to strings: {problem}")]
    BadMetadata {
        /// The safetensors file.
        path: PathBuf,
        /// What is wrong with it.
        problem: MetadataProblem,
    },
    /// A sharded checkpoint's index (`*.index.json`) that is not JSON or not shaped as one.
    #[error("{path}: index is invalid: {problem}")]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        problem: IndexProblem,
    },
    /// A shard named by an index (or a DCP `.metadata`) that is not in the folder.
    #[error("{index}: tensor `{tensor}` is mapped to `{file}`, which does not exist")]
    MissingShard {
        /// The index (or `.metadata`) file that names the shard.
        index: PathBuf,
        /// A tensor mapped to the shard.
        tensor: String,
        /// The shard's file name.
        file: String,
    },
    /// A tensor the index maps to a shard that does not hold it.
    #[error("{index}: tensor `{tensor}` is mapped to `{file}`, which does not hold it")]
    TensorNotInShard {
        /// The index file.
        index: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shard's file name, as the index gives it.
        file: String,
    },
    /// A tensor held by two shards of one sharded checkpoint.
    #[error("tensor `{tensor}` is in both {first} and {second}")]
    DuplicateAcrossShards {
        /// The tensor's name.
        tensor: String,
        /// The shard that holds it first.
        first: PathBuf,
        /// The other shard that holds it.
        second: PathBuf,
    },
    /// A tensor in a shard that the index's `weight_map` does not list.
    #[error("{index}: shard {file} holds tensor `{tensor}`, which the `weight_map` does not list")]
    UnlistedTensor {
        /// The index file.
        index: PathBuf,
        /// The shard holding the tensor.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// A `weight_map` entry whose shard is not a plain file name (it has a folder, `..`, or is
    /// absolute), refused before anything outside the index's folder is opened.
    #[error("{index}: `weight_map` entry `{tensor}` points at `{file}`, which is not a plain file name in the index's folder")]
    UnsafeShardPath {
        /// The index file.
        index: PathBuf,
        /// The entry's tensor name.
        tensor: String,
        /// The shard path the entry gives.
        file: String,
    },
    /// A path that is no checkpoint of a format this crate reads.
    #[error("{path}: no checkpoint found (expected a `.safetensors` file, a `model.safetensors.index.json`, or a folder holding one)")]
    NotACheckpoint {
        /// The path given.
        path: PathBuf,
    },
    /// A folder of `.safetensors` files that fit no layout: `found` names some of them.
    #[error("{path}: {count} `.safetensors` file(s) ({}) fit no checkpoint layout: expected \
        `model.safetensors`, a `*.safetensors.index.json` naming them, a single file, or DCP \
        shards `shard-NNNNN-model-NNNNN-of-NNNNN.safetensors`",
        quoted_names(.found, *.count))]
    UnknownSafetensorsLayout {
        /// The folder.
        path: PathBuf,
        /// How many `.safetensors` files it holds.
        count: usize,
        /// The names of the first few of them (at most 4).
        found: Vec<String>,
    },
    /// A shard size (`5GB`, `500MB`, a byte count) that does not parse.
    #[error("invalid size `{input}`: {problem}")]
    BadSize {
        /// The size as given.
        input: String,
        /// Why it does not parse.
        problem: SizeProblem,
    },
    /// An `hf://ORG/NAME[@REV][/PATH]` address that does not parse.
    #[error("invalid hub address `{input}`: {problem}")]
    BadHubUrl {
        /// The address as given.
        input: String,
        /// What is wrong with it.
        problem: HubUrlProblem,
    },
    /// An `hf://` address whose files are not in the local Hugging Face cache.
    #[error("`{repo}` (revision `{revision}`) has no `{file}` in the local Hugging Face cache {cache}")]
    NotInHubCache {
        /// The repository (`ORG/NAME`).
        repo: String,
        /// The revision asked for.
        revision: String,
        /// The file looked for (the candidates, joined by `or`).
        file: String,
        /// The cache folder searched.
        cache: PathBuf,
    },
    /// The Hub refused a request for want of a token (401), or refused the token given (403).
    /// The token itself is never part of the message.
    #[error("`{repo}`: the Hub answered {status} for `{file}`; {}", auth_advice(.token_source.as_deref(), *.write))]
    HubAuth {
        /// The repository (`ORG/NAME`).
        repo: String,
        /// The file, or the API call, that was refused.
        file: String,
        /// The HTTP status: 401 or 403.
        status: u16,
        /// Where the token sent came from (`HF_TOKEN`, the token file), `None` when none was sent.
        token_source: Option<String>,
        /// Whether the request was a write (`ckpt push`), which takes a token with write access.
        write: bool,
    },
    /// The Hub has no such repository or revision (`file` is `None`), or no such file in it.
    #[error("{}", not_found_text(.repo, .revision, .file.as_deref(), .endpoint))]
    HubNotFound {
        /// The repository (`ORG/NAME`).
        repo: String,
        /// The revision asked for.
        revision: String,
        /// The file, for a file the revision lacks.
        file: Option<String>,
        /// The Hub asked (`HF_ENDPOINT`).
        endpoint: String,
    },
    /// A request to the Hub that failed on the way: no connection, a timeout, a connection
    /// closed early (run again to resume a download), an answer the protocol does not allow.
    #[error("{url}: {reason}")]
    HubRequest {
        /// The URL asked, which names the repository, the revision and the file.
        url: String,
        /// What went wrong.
        // Free text: the HTTP client's and the Hub's own words (a transport error, an answer's body), which this
        // crate does not enumerate.
        reason: String,
    },
    /// A downloaded file that is not what the Hub announced: an LFS file whose SHA-256 is not its
    /// ETag, or a size other than the one announced. The bytes were discarded.
    #[error("`{file}` of `{repo}`: {problem}; the download was discarded")]
    HubCorrupt {
        /// The repository (`ORG/NAME`).
        repo: String,
        /// The file in the repository.
        file: String,
        /// What did not match.
        problem: HubCorruption,
    },
    /// An output file that is one of the files the checkpoint is read from.
    #[error("`{path}` is the source, refusing to overwrite it")]
    OutputIsSource {
        /// The output file.
        path: PathBuf,
    },
    /// A broadcast view whose written bytes would be far more than its storage's, refused
    /// without `allow_expanded`.
    #[error(
        "{path}: tensor `{tensor}` is a broadcast view: writing it takes {output} bytes from a \
        {storage}-byte storage"
    )]
    ExpandedView {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// Bytes the tensor takes when written whole.
        output: u64,
        /// Bytes of the storage it views.
        storage: u64,
    },
    /// A source path (after links) that is a folder, a FIFO, a socket or a device, refused
    /// before it is opened.
    #[error("{path}: is {kind}, not a regular file; refusing to read it")]
    NotARegularFile {
        /// The path.
        path: PathBuf,
        /// What it is (`a folder`, `a FIFO`, `a socket`, `a device`).
        kind: &'static str,
    },
    /// A symlink in place of an output file that the caller did not name as the output.
    #[error("`{path}` is a symlink that was not named as the output, refusing to replace it")]
    PlantedLink {
        /// The symlink.
        path: PathBuf,
    },
    /// Two shards with different values for one `__metadata__` key, where they are merged.
    #[error("shards disagree on `__metadata__` key `{key}`: {first:?} in {first_file}, {second:?} in {second_file}")]
    MetadataConflict {
        /// The key.
        key: String,
        /// Its value in the first shard.
        first: String,
        /// The first shard.
        first_file: PathBuf,
        /// Its value in the other shard.
        second: String,
        /// The other shard.
        second_file: PathBuf,
    },
    /// A file whose SHA-256 is not the one the checksum manifest gives (`verify`).
    #[error("{path}: checksum mismatch for `{file}`: manifest says {expected}, file has {found}")]
    ChecksumMismatch {
        /// The checksum manifest.
        path: PathBuf,
        /// The file's name, as the manifest gives it.
        file: String,
        /// The checksum in the manifest.
        expected: String,
        /// The checksum of the file's bytes.
        found: String,
    },
    /// A checksum manifest line that is not `<sha256>  <file>`.
    #[error("{path}: bad checksum manifest line {line}: {problem}")]
    BadManifest {
        /// The manifest file.
        path: PathBuf,
        /// The line number, from 1.
        line: usize,
        /// What is wrong with the line.
        problem: ManifestProblem,
    },
    /// A torch file (or a DCP item) that is not a readable zip archive, or holds a corrupt
    /// deflate stream.
    #[error("{path}: not a valid zip archive: {problem}")]
    BadZip {
        /// The file.
        path: PathBuf,
        /// What is wrong with the archive.
        problem: ZipProblem,
    },
    /// A zip record (or a legacy torch file's storage) whose declared bytes run past the end
    /// of its file.
    #[error(
        "{path}: record `{record}` declares {len} bytes at byte {offset}, past the end of the {file_len}-byte file"
    )]
    RecordBeyondFile {
        /// The file.
        path: PathBuf,
        /// The record's name (`storage KEY` for a legacy storage).
        record: String,
        /// Where its bytes start in the file.
        offset: u64,
        /// How many bytes it declares (`u64::MAX` when the count overflows).
        len: u64,
        /// The file's length in bytes.
        file_len: u64,
    },
    /// A record (or a whole file read into memory) larger than the limit on what is read.
    #[error("{path}: record `{record}` is {size} bytes, over the {limit}-byte limit")]
    RecordTooLarge {
        /// The file.
        path: PathBuf,
        /// The record's name (`the whole file` for a file read whole).
        record: String,
        /// Its size in bytes.
        size: u64,
        /// The largest size allowed.
        limit: u64,
    },
    /// Stored bytes whose CRC32 is not the one their zip record carries: the file changed after
    /// it was written (a flipped bit, a partial overwrite).
    #[error("{path}{}:{} record `{record}`{} fails its CRC32 check (the archive says {stored:08x}, \
        the bytes give {actual:08x}): the file was damaged after it was written",
        rank_note(.rank), tensor_note(.tensor), item_note(.item))]
    BadChecksum {
        /// The file holding the record.
        path: PathBuf,
        /// The tensor whose bytes they are; `None` for a record that is not a tensor's.
        tensor: Option<String>,
        /// The rank whose file it is, for a DCP data file.
        rank: Option<u64>,
        /// The record's name in its archive.
        record: String,
        /// The offset of the archive the record is in, for a DCP item.
        item: Option<u64>,
        /// The CRC32 the record carries.
        stored: u32,
        /// The CRC32 of the bytes.
        actual: u32,
    },
    /// A deflated zip record that inflates to more (or fewer) bytes than it declares.
    #[error("{path}: record `{record}` inflates past its declared {declared} bytes (a zip bomb?)")]
    InflateOverrun {
        /// The file.
        path: PathBuf,
        /// The record's name.
        record: String,
        /// The plain size the record declares.
        declared: u64,
    },
    /// A pickle naming a global outside what the format being read allows (torch's
    /// weights-only list and the format's own classes).
    #[error("{path}: refusing global `{global}`: only the tensor-rebuilding globals of torch's weights-only loader are allowed")]
    RefusedGlobal {
        /// The file holding the pickle.
        path: PathBuf,
        /// The global, as `module.name`.
        global: String,
    },
    /// A torch file naming globals outside torch's weights-only list and the option
    /// `allow_globals`: the one refused first, then the file's others (at most 16 in all).
    #[error("{path}: refusing global {}", globals_refusal(.globals, *.allowing))]
    GlobalNotAllowed {
        /// The torch file.
        path: PathBuf,
        /// The globals refused, as `module.name`, the first refused first.
        globals: Vec<String>,
        /// Whether `allow_globals` named anything.
        allowing: bool,
    },
    /// A pickle that does not decode: anything wrong with it but a refused global.
    #[error("{path}: `{record}` at byte {at}: {reason}")]
    BadPickle {
        /// The file holding the pickle.
        path: PathBuf,
        /// The record holding it (`data.pkl`, `.metadata`).
        record: String,
        /// The byte of the pickle where decoding stopped.
        at: usize,
        /// What is wrong.
        // Free text: the pickle machine stops on any of dozens of opcodes and stack states, and says which in its own
        // words; the typed part is where (`record`, `at`).
        reason: String,
    },
    /// A torch file whose structure cannot be read (or, when writing, holds what a torch file
    /// cannot store): its layout, its records, a TorchScript archive, an RNG state.
    #[error("{path}: {reason}")]
    BadTorchFile {
        /// The torch file read or written.
        path: PathBuf,
        /// What is wrong with it.
        // Free text: the findings of the torch readers walking a file's object graph (flattening, TorchScript, RNG
        // states), as open-ended as the graphs they walk.
        reason: String,
    },
    /// A tensor of a torch file that cannot be rebuilt: its storage, dtype, shape or strides
    /// do not hold together.
    #[error("{path}: tensor `{tensor}`: {problem}")]
    BadTorchTensor {
        /// The torch file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        // Boxed: its shapes and names would make every `Result` of the crate carry their size.
        problem: Box<TorchTensorProblem>,
    },
    /// A tensor to be written as safetensors whose dtype safetensors cannot store.
    #[error("tensor `{tensor}` has dtype `{dtype}`, which safetensors cannot store")]
    NotInSafetensors {
        /// The tensor's name.
        tensor: String,
        /// Its dtype.
        dtype: String,
    },
    /// Options that cannot be carried out as given: convert options that clash, a value out of
    /// range, an open option the source's format does not take, an `allow_globals` pattern that
    /// does not parse. The one variant for every option misuse; each edge words `misuse` with
    /// its own spelling of the options.
    #[error("{}", misuse_text(.path, .misuse))]
    Misuse {
        /// The output asked for, or the source when the misuse is about it (then `misuse`
        /// names it, see [`crate::Misuse::names_its_source`]); empty for an `allow_globals`
        /// pattern, checked before any file is named.
        path: PathBuf,
        /// Which options, and how.
        misuse: crate::Misuse,
    },
    /// An output that must be new (a sharded save's folder, a universal checkpoint) exists
    /// already, or appeared while it was being written.
    #[error("{path}: {}", match .appeared { false => "already exists; refusing to write over it", true => "appeared while the output was written; nothing was committed" })]
    OutputExists {
        /// The output.
        path: PathBuf,
        /// Whether it appeared during the write (another writer raced this one).
        appeared: bool,
    },
    /// A merge whose optimizer states would be written to the weights' own file.
    #[error(
        "cannot convert to {path}: the weights and the optimizer states would both be `{}`",
        crate::OPTIMIZER_NAME
    )]
    OptimizerCollides {
        /// The file both would be.
        path: PathBuf,
    },
    /// Quantizing a weight that has its block scales already.
    #[error("cannot convert to {dst}: `{scale}` already exists; `{weight}` is not quantized twice")]
    AlreadyQuantized {
        /// The output asked for.
        dst: PathBuf,
        /// The weight.
        weight: String,
        /// Its scales tensor, present in the source.
        scale: String,
    },
    /// A tensor to be written in a torch file (or a DCP folder) whose dtype torch cannot store.
    #[error("cannot convert to {dst}: tensor `{tensor}` has dtype `{dtype}`, which torch cannot store")]
    NotInTorch {
        /// The output asked for, or the file in it.
        dst: PathBuf,
        /// The tensor's name (`storage N` for a storage of no one tensor).
        tensor: String,
        /// Its dtype.
        dtype: crate::Dtype,
    },
    /// A buffer handed to [`crate::Checkpoint::read_tensor_into`] of another length than the
    /// tensor's bytes.
    #[error("{path}: the buffer for `{tensor}` has {found} bytes, not {expected}")]
    WrongBufferLen {
        /// The checkpoint's root.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The tensor's length in bytes.
        expected: u64,
        /// The buffer's.
        found: u64,
    },
    /// A push while `HF_HUB_OFFLINE` is set.
    #[error("cannot push to `{dst}`: `HF_HUB_OFFLINE` is set, and a push needs the Hub")]
    PushOffline {
        /// The `hf://` destination.
        dst: String,
    },
    /// A push of a folder that holds no file to push (hidden files stay behind).
    #[error("{path} holds no file to push")]
    NothingToPush {
        /// The folder.
        path: PathBuf,
    },
    /// `reshard` of a checkpoint that is not laid out for ranks (`convert` to DCP lays out any).
    #[error(
        "{path} is not a DCP folder (no `.metadata`), nor a DeepSpeed ZeRO, accelerate or Trainer folder: \
        reshard rewrites only checkpoints laid out for ranks"
    )]
    NotReshardable {
        /// The checkpoint's root.
        path: PathBuf,
    },
    /// A tensor handed to [`crate::save_safetensors`] or [`crate::save_sharded`] that cannot be
    /// saved as it is.
    #[error("cannot save {dst}: tensor `{tensor}` {problem}")]
    BadSaveTensor {
        /// The output asked for (a sharded save: this rank's file).
        dst: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        problem: SaveTensorProblem,
    },
    /// An FP8 weight whose block scales are missing or do not fit it.
    #[error("block-scaled weight `{weight}` with scales `{scale}`: {problem}")]
    BadBlockScale {
        /// The weight's name.
        weight: String,
        /// The name of its scales tensor.
        scale: String,
        /// What is wrong.
        // Boxed: its shapes and names would make every `Result` of the crate carry their size.
        problem: Box<BlockScaleProblem>,
    },
    /// A DeepSpeed ZeRO checkpoint whose rank file lacks or mangles an entry the merge needs.
    #[error("{path}: rank {rank}, `{tensor}`: {reason}")]
    BadZeroCheckpoint {
        /// The rank's file.
        path: PathBuf,
        /// The rank.
        rank: u64,
        /// The entry (a parameter or a dotted key of the state).
        tensor: String,
        /// What is wrong with it.
        // Free text: some thirty structural checks of DeepSpeed's nested state dicts, each naming its key; the typed
        // part is the file, the rank and the key.
        reason: String,
    },
    /// A DeepSpeed ZeRO rank file whose flat state vector is not of the dtype DeepSpeed keeps
    /// it in (fp32).
    #[error("{path}: rank {rank}, `{tensor}`: dtype is `{found}`, expected `{expected}`")]
    ZeroDtype {
        /// The rank's file.
        path: PathBuf,
        /// The rank.
        rank: u64,
        /// The dotted key of the vector.
        tensor: String,
        /// Its dtype.
        found: crate::Dtype,
        /// The dtype DeepSpeed keeps it in.
        expected: crate::Dtype,
    },
    /// A DeepSpeed ZeRO checkpoint missing the file of one of its ranks.
    #[error("{path}: missing: the ZeRO checkpoint has {world} ranks but rank {rank} wrote no such file")]
    MissingRankFile {
        /// The file the rank would have written.
        path: PathBuf,
        /// The rank.
        rank: u64,
        /// The checkpoint's world size.
        world: u64,
    },
    /// A DCP `.metadata` (or the sharding metadata of a DCP safetensors shard) that cannot be
    /// read or does not hold together.
    #[error("{path}: DCP metadata: {reason}")]
    BadDcpMetadata {
        /// The metadata file, or the shard.
        path: PathBuf,
        /// What is wrong with it.
        // Free text: the checks of the pickled `Metadata` object graph, one per field and class of torch's DCP
        // metadata.
        reason: String,
    },
    /// A DCP `.metadata` larger than what the items the folder's other files can hold need:
    /// refused before it is read, since it is read before it names its data files.
    #[error(
        "{path}: DCP metadata: `.metadata` is {len} bytes, over the {cap} bytes allowed: the folder's {files} other \
         files ({data_len} bytes) hold at most {items} items of {min_item_len} bytes or more, at {per_item} bytes \
         of metadata each ({min_cap} bytes at least)"
    )]
    DcpMetadataTooLarge {
        /// The `.metadata` file.
        path: PathBuf,
        /// Its length in bytes.
        len: u64,
        /// The largest length allowed for this folder.
        cap: u64,
        /// The folder's other plain files.
        files: u64,
        /// Their total length in bytes.
        data_len: u64,
        /// The most items they can hold.
        items: u64,
        /// The fewest bytes one item takes in a data file.
        min_item_len: u64,
        /// The most bytes of metadata one item takes.
        per_item: u64,
        /// The cap for a folder of few items.
        min_cap: u64,
    },
    /// A DCP item that cannot be read from its data file: past its end, not a `torch.save`
    /// archive, or not the tensor or value the metadata says.
    #[error("{path}{}: tensor `{tensor}`: {problem}", rank_note(.rank))]
    BadDcpChunk {
        /// The data file.
        path: PathBuf,
        /// The key of the item (a tensor's name, or a value's).
        tensor: String,
        /// The rank whose data file it is, when its name (`__R_N.distcp`) gives one.
        rank: Option<u64>,
        /// What is wrong with it.
        // Boxed: its shapes and names would make every `Result` of the crate carry their size.
        problem: Box<ChunkProblem>,
    },
    /// A DCP item holding a tensor of another dtype than the metadata gives its chunk.
    #[error(
        "{path}{}: tensor `{tensor}`: the item at byte {at} holds `{found}` where the metadata says `{expected}`",
        rank_note(.rank)
    )]
    DcpItemDtype {
        /// The data file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The rank whose data file it is, when its name (`__R_N.distcp`) gives one.
        rank: Option<u64>,
        /// The offset of the item in the data file.
        at: u64,
        /// The dtype the item holds.
        found: crate::Dtype,
        /// The dtype the metadata gives.
        expected: crate::Dtype,
    },
    /// A box of a tensor (a DCP chunk, a rank's shard) that does not fit the tensor or its file:
    /// out of bounds, overlapping another, or leaving part of the tensor uncovered.
    #[error("{path}{}: tensor `{tensor}`: {problem}", rank_note(.rank))]
    BadBox {
        /// The file holding the box (the checkpoint's root when it is not one file's).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The rank whose file holds the box, where known.
        rank: Option<u64>,
        /// What is wrong with it.
        // Boxed: its shapes and names would make every `Result` of the crate carry their size.
        problem: Box<BoxProblem>,
    },
    /// A tensor whose boxes, in the shards of one checkpoint, are of different dtypes.
    #[error("{path}{}: tensor `{tensor}`: its box is `{found}` where another shard's is `{other}`", rank_note(.rank))]
    BoxDtypeMismatch {
        /// The file holding the box.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The rank whose file holds the box, where known.
        rank: Option<u64>,
        /// The box's dtype.
        found: crate::Dtype,
        /// The dtype of the tensor's boxes read before it.
        other: crate::Dtype,
    },
    /// A collective operation between the ranks of a job (broadcast, gather) that failed.
    #[error("{dir}: {source}")]
    Collective {
        /// The output the job writes.
        dir: PathBuf,
        /// What the collective reported.
        #[source]
        source: collective::CollectiveError,
    },
    /// Another rank of a job failed a step of an operation and reported its error; nothing was
    /// committed.
    #[error("rank {rank} failed (it reports why); nothing was committed")]
    OtherRank {
        /// The lowest rank that failed.
        rank: u64,
    },
    /// This rank planned another output than rank 0 (their sources or options differ).
    #[error("{path}: rank {rank} planned a different output than rank 0 (were all ranks given the same source and options, on one shared filesystem?)")]
    PlanMismatch {
        /// The output the job writes.
        path: PathBuf,
        /// This rank.
        rank: u64,
    },
    /// Another process is writing the same destination: it holds the destination's lock (see
    /// `durable::DestLock`). Refused at once, before anything is planned or written.
    #[error(
        "{dst}: another process{} is writing it now (it holds `{lock}`); nothing was written",
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    DestinationLocked {
        /// The destination.
        dst: PathBuf,
        /// The lock file the other process holds.
        lock: PathBuf,
        /// That process's id, where it had written it into the lock file.
        pid: Option<u32>,
    },
    /// A rank of a job was given another destination than rank 0: the ranks would not write one
    /// output together but race over several.
    #[error(
        "{dst}: rank {rank} was given `{other}` as its destination; every rank of a job must name the destination \
         rank 0 names"
    )]
    DestinationsDiffer {
        /// Rank 0's destination.
        dst: PathBuf,
        /// The rank that named another.
        rank: u64,
        /// The destination it named.
        other: PathBuf,
    },
    /// A sharded save ([`crate::save_sharded`]) that failed on one of its ranks. Every rank of
    /// the job returns it, with the same kind and text: the rank that saw the error with the
    /// error itself as `source`, the others with what that rank reported of it
    /// ([`Error::Reported`]).
    #[error("sharded save failed on rank {rank}: {source}")]
    ShardedSave {
        /// The output folder.
        dir: PathBuf,
        /// The rank the error blames (the one whose part was at fault).
        rank: u64,
        /// What went wrong there.
        source: Box<Error>,
    },
    /// An error another rank of a job saw, as that rank reported it: its kind, the name of its
    /// variant and its message. The message is a string because the error crossed between
    /// processes as text; the kind and the name keep what the edges act on (an exit code, an
    /// exception class).
    #[error("{message}")]
    Reported {
        /// The error's kind.
        kind: crate::ErrorKind,
        /// Its variant's name ([`Error::variant_name`]).
        variant: String,
        /// Its message.
        // Free text: another rank's message, which crossed between processes as text.
        message: String,
    },
    /// An accelerate or Trainer `save_state` folder that cannot be read or does not hold
    /// together: a component, a model or optimizer asked for that it lacks, a part reshard
    /// cannot lay out.
    #[error("{path}{}: {reason}", rank_colon(.rank))]
    BadSaveState {
        /// The folder, or the file in it that is wrong.
        path: PathBuf,
        /// The rank whose file it is, where it is one rank's.
        rank: Option<u64>,
        /// What is wrong.
        // Free text: the cross-checks of a `save_state` folder's many component files (models, optimizers,
        // schedulers, RNG and position files).
        reason: String,
    },
    /// A `save_state` folder whose RNG files leave out one rank of the world that saved it.
    #[error("{path}: rank {rank}: missing: the folder was saved by {world} ranks and rank {rank} left no RNG file")]
    MissingRngFile {
        /// The file the rank would have written.
        path: PathBuf,
        /// The rank.
        rank: u64,
        /// The number of ranks that saved the folder.
        world: u64,
    },
    /// A rank file (an accelerate or `Trainer` RNG file) whose name gives a rank at or past the
    /// world-size limit: refused without reading it, before the rank sizes anything.
    #[error("{path}: the rank in this name is not below the world-size limit ({limit} ranks); the file is not read")]
    RankBeyondLimit {
        /// The file.
        path: PathBuf,
        /// The world-size limit, [`crate::MAX_WORLD_SIZE`].
        limit: u64,
    },
    /// A Megatron-Core checkpoint that does not hold together: its tracker, a rank's file, a
    /// stage that disagrees with the others, a tensor whose one-rank form cannot be derived.
    #[error("{path}{}:{} {reason}", rank_note(.rank), key_note(.key))]
    BadMegatron {
        /// The file or folder that is wrong.
        path: PathBuf,
        /// The key of the checkpoint it is about, where it is one key's.
        key: Option<String>,
        /// The tensor-parallel rank whose file it is, where it is one rank's.
        rank: Option<u64>,
        /// What is wrong.
        // Free text: Megatron's consistency checks across trackers, configs, ranks and stacked layers; the typed part
        // is the file, the key and the rank.
        reason: String,
    },
    /// A model map (the step between reading a checkpoint and planning its output: target
    /// tensors assembled from pieces of the source tensors) that does not assemble a target
    /// exactly, or that leaves a source tensor unplaced.
    #[error("{path}: tensor `{tensor}`: {problem}")]
    BadModelMap {
        /// The checkpoint the map was built for.
        path: PathBuf,
        /// The target tensor (a source tensor, for [`MapProblem::Unplaced`]).
        tensor: String,
        /// What does not fit (boxed: the tiling errors carry whole regions, and every `Result`
        /// of the crate would carry their size).
        problem: Box<MapProblem>,
    },
    /// A Megatron save missing the file of one of its tensor-parallel × pipeline ranks.
    #[error(
        "{path} (rank {rank}): missing: the save has {tp} tensor-parallel × {pp} pipeline ranks, but this rank's \
         file is not there"
    )]
    MissingMegatronRank {
        /// The file the rank would have written.
        path: PathBuf,
        /// Its tensor-parallel rank.
        rank: u64,
        /// The save's tensor-parallel ranks.
        tp: u64,
        /// The save's pipeline stages.
        pp: u64,
    },
    /// A Hugging Face `config.json` that does not say what the model is, or says something the
    /// model tables have no place for.
    #[error("{path}: `{key}` {problem}")]
    BadHfConfig {
        /// The `config.json`.
        path: PathBuf,
        /// The setting at fault (`config.json` itself when the file as a whole is).
        key: String,
        /// What is wrong with it.
        problem: HfConfigProblem,
    },
    /// A model no Hugging Face architecture of the tables describes: a setting of it that
    /// the closest family has no counterpart for.
    #[error(
        "{path}: no Hugging Face architecture holds this model: `{setting}` is {value}, and {}",
        arch_note(.arch)
    )]
    NoHfArchitecture {
        /// The checkpoint.
        path: PathBuf,
        /// The family asked (the closest one, or the one named); `None` when the setting is one
        /// no family has.
        arch: Option<&'static str>,
        /// The model's setting with no counterpart, under the source's own name.
        setting: &'static str,
        /// Its value in the model.
        value: String,
    },
}

/// What a model map gets wrong about one tensor, for [`Error::BadModelMap`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MapProblem {
    /// The pieces overlap, leave a hole, or reach outside the target.
    #[error("its pieces do not tile it: {0}")]
    Tiling(#[source] fsdp_state::TilingError),
    /// A piece reads a tensor the source does not have.
    #[error("a piece reads `{source_name}`, which the source does not hold")]
    UnknownSource {
        /// The source tensor named.
        source_name: String,
    },
    /// A piece's dims do not match its target's or its source's.
    #[error("a piece at offsets {at:?} walks {found} dims of `{source_name}` where {expected} are needed")]
    PieceRank {
        /// The source tensor.
        source_name: String,
        /// The piece's offsets in the target.
        at: Vec<u64>,
        /// The dims needed.
        expected: usize,
        /// The dims the piece has.
        found: usize,
    },
    /// A piece reads past the end of its source on some dim, or walks one of its dims twice.
    #[error("a piece at offsets {at:?} with sizes {sizes:?} reads outside `{source_name}` of shape {shape:?}")]
    PieceOutside {
        /// The source tensor.
        source_name: String,
        /// The piece's offsets in the target.
        at: Vec<u64>,
        /// The piece's sizes.
        sizes: Vec<u64>,
        /// The source's shape.
        shape: Vec<u64>,
    },
    /// Its pieces read sources of different dtypes.
    #[error("its pieces read `{first}` of dtype `{first_dtype}` and `{other}` of dtype `{other_dtype}`")]
    MixedDtypes {
        /// The first piece's source.
        first: String,
        /// Its dtype.
        first_dtype: crate::Dtype,
        /// A source of another dtype.
        other: String,
        /// That dtype.
        other_dtype: crate::Dtype,
    },
    /// It is cast to a dtype its stored one does not convert to.
    #[error("it is stored as `{stored}`, which does not cast to `{to}`")]
    BadCast {
        /// The dtype its bytes are stored in.
        stored: crate::Dtype,
        /// The dtype asked for.
        to: crate::Dtype,
    },
    /// Its stored dtype is not a whole number of bytes, so it cannot be cut into pieces.
    #[error("its dtype `{dtype}` is not a whole number of bytes per element")]
    SubByte {
        /// The dtype.
        dtype: crate::Dtype,
    },
    /// A target made of no piece at all: it would have no dtype.
    #[error("it is made of no piece of any source")]
    NoPieces,
    /// A source tensor no target reads and the format does not drop: a merge would lose it.
    #[error("no tensor of the {view} is made from it, and it is not one the format leaves out")]
    Unplaced {
        /// What the map builds (`one-rank model`, ...).
        view: &'static str,
    },
    /// A source tensor of another shape than the model's configuration gives it.
    #[error(
        "it is made from `{source_name}`, of shape {found:?}, but the model's configuration gives it {expected:?}"
    )]
    SourceShape {
        /// The source tensor.
        source_name: String,
        /// The shape the configuration gives.
        expected: Vec<u64>,
        /// The shape stored.
        found: Vec<u64>,
    },
}

/// The family a [`Error::NoHfArchitecture`] names, or that it is none of them.
fn arch_note(arch: &Option<&'static str>) -> String {
    match arch {
        Some(a) => format!("`{a}` has no counterpart for it"),
        None => "no family of the tables has a counterpart for it".into(),
    }
}

/// [`Error::Misuse`]'s message: the misuse, after the destination unless it names its source.
fn misuse_text(path: &std::path::Path, misuse: &crate::Misuse) -> String {
    if misuse.names_its_source() {
        misuse.to_string()
    } else {
        format!("cannot convert to {}: {misuse}", path.display())
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
/// What to do about a refused token, for [`Error::HubAuth`].
fn auth_advice(token_source: Option<&str>, write: bool) -> String {
    match (token_source, write) {
        (None, false) => "the repository is gated or private: set `HF_TOKEN` (or save a token in `$HF_HOME/token`) to a token that may read it".into(),
        (None, true) => "pushing takes a token: set `HF_TOKEN` (or save a token in `$HF_HOME/token`) to a token with write access".into(),
        (Some(from), false) => format!(
            "the token from {from} may not read it (a gated repository: accept its conditions on the Hub with that account; a private one: use a token of an account that has access)"
        ),
        (Some(from), true) => format!("the token from {from} may not write to it (it needs write access to the repository)"),
    }
}

/// [`Error::HubNotFound`]'s message: the repository or revision, or a file of it.
fn not_found_text(repo: &str, revision: &str, file: Option<&str>, endpoint: &str) -> String {
    match file {
        Some(file) => format!("`{repo}` (revision `{revision}`) has no `{file}` on {endpoint}"),
        None => format!(
            "`{repo}` (revision `{revision}`) was not found on {endpoint}; a private repository answers the same to a request without a token: set `HF_TOKEN`"
        ),
    }
}

pub(crate) trait IoContext<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|source| Error::Io { path: path.into(), source })
    }
}

#[cfg(test)]
mod tests;
