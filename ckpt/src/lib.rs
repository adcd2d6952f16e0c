//! Checkpoint formats and operations.
//!
//! Every format is read into one view, a [`Checkpoint`]: a catalog of logical tensors, each
//! described by where its bytes are in the source files. Operations take an opened checkpoint,
//! plan copies into target files and run the plan streaming, in parallel, with resident memory
//! bounded by a fixed window, writing atomically with the index last.
//!
//! ```no_run
//! let ck = ckpt::Checkpoint::open("ds_checkpoint/")?; // safetensors, torch, DCP, ZeRO, hf://
//! let done = ckpt::merge(&ck, "model.safetensors".as_ref(), &Default::default(), &Default::default())?;
//! println!("{} tensors, {} bytes", done.tensors, done.bytes);
//! # Ok::<(), ckpt::Error>(())
//! ```
//!
//! - [`split`], [`merge`], [`convert`], [`reshard`]: the operations, each returning an [`Outcome`];
//!   each holds its destination for its whole run: another process writing it meanwhile is
//!   refused ([`Error::DestinationLocked`], with that process's id), and the ranks of a job
//!   must all name it ([`Error::DestinationsDiffer`]);
//! - [`save_safetensors`]: tensors held in memory as one safetensors file or huggingface_hub's
//!   shards, through the same planner and write engine as [`split`];
//! - [`save_sharded`]: a DCP folder written by the ranks of a running job, each from memory;
//! - [`StagedFolder`]: a folder built under a temporary name and committed whole, then named by
//!   a `latest` link, replacing a folder of the same name without a moment where the link dangles;
//! - [`verify`]: every defect a reader would trip on, in a [`Report`];
//! - [`WriteOptions`]: progress, checksums and the copy method, shared by every operation;
//! - JSON: [`Checkpoint`], [`Report`] and [`Outcome`] are `serde::Serialize` as the versioned
//!   documents `ckpt --json` prints and the Python bindings return ([`INSPECT_SCHEMA`],
//!   [`VERIFY_SCHEMA`], [`OUTCOME_SCHEMA`]).
//!
//! Readers never execute anything from a checkpoint, and every error names its file and, where
//! it applies, its tensor and rank.
//!
//! # How it is built
//!
//! Every operation runs the same pipeline, and the folders follow it:
//!
//! ```text
//!  open ──▶ catalog ──▶ map ──▶ plan ──▶ execute ──▶ commit
//!  read/    formats/    map/    plan/    write/      write/
//! ```
//!
//! - `read/`: opening a source (a path or `hf://`), detecting its format, and the catalog every
//!   format is read into: logical tensors made of boxes of stored bytes (`read::catalog`); the
//!   byte-source seam every read goes through (`read::io`), dtypes, strided shapes, non-tensor
//!   values, and the CRC checks of zip records.
//! - `formats/`: one module per format. Each states its on-disk layout in its opening comment,
//!   detects its sources, catalogs them, describes them for `inspect` and `--json` (a
//!   [`Description`]), and says what it can produce through one interface,
//!   `formats::FormatOps` (its merge, reshard and optimizer outputs: an output the planner
//!   plans, the format's own write, or a refusal naming the format and the output); it also
//!   lays out its own target files. A new format is one module with a unit struct implementing
//!   it, a line in `formats::DETECTORS` and one in `formats::ops_of`. Nothing outside
//!   `formats/` names a format module: `formats/mod.rs` is the way in.
//! - `map/`: what happens to a tensor between reading and writing: model maps (`map::model`:
//!   the tensors written, each assembled from boxes of the tensors stored, such as a format's
//!   one-rank or logical view; a new model architecture is one such map), float casts with
//!   torch's bits, block-scaled FP8.
//! - `plan/`: what the target planners share (the tensors to write, destinations, the
//!   sharding), shard sizes, and the dealing of one plan to the ranks of a job.
//! - `write/`: the executor (streaming range copies, gathers, computed bytes), where outputs are
//!   staged, the commit (index or metadata last), the destination lock, the ranks of a job and
//!   how they agree, and the only `unsafe` (`write::sys`).
//! - `ops/`: the public operations (split, merge, convert, reshard, saves from memory), their
//!   options and what they report. They open, ask the source's format, plan and execute, and
//!   name no format; what they ask and the answers are `ops::request`.
//! - `report/`: what a format describes ([`Description`]), verify's report and the versioned
//!   JSON documents.
//! - `hub/`: `hf://` sources and pushes.

#![warn(missing_docs, unreachable_pub)]

mod error;
mod formats;
mod hub;
mod map;
mod ops;
mod plan;
mod read;
mod report;
mod write;

pub use error::{
    escape_controls, BlockScaleProblem, BoxProblem, ChunkProblem, EntryProblem, Error, ErrorKind, HeaderJsonProblem,
    HfConfigProblem, HubCorruption, HubUrlProblem, IndexProblem, JsonKind, ManifestProblem, MapProblem,
    MetadataProblem, Result, SaveTensorProblem, SizeProblem, TorchTensorProblem, ZipProblem,
};
pub use formats::megatron::MegatronInfo;
pub use formats::torch::allow::AllowGlobals;
pub use fsdp_state::Region;
pub use hub::{push, DownloadProgress, Pushed};
pub use map::arch::{Arch, ModelConfig, MoeConfig, NormKind};
pub use map::blockscale::BlockScaling;
pub use ops::local::{KeyPart, LocalTensor, LocalValue};
pub use ops::misuse::{Misuse, Opt};
pub use ops::save::{save_safetensors, MemoryTensor, SaveOptions};
pub use ops::sharded::save_sharded;
pub use ops::{
    convert, merge, reshard, split, ConvertOptions, MergeOptions, ModelParallel, Outcome, TargetFormat, MAX_WORLD_SIZE,
    OPTIMIZER_NAME,
};
pub use plan::shares::RankShare;
pub use plan::size::{parse_size, DEFAULT_MAX_SHARD_SIZE};
pub use read::catalog::{Checkpoint, Chunk, Format, SourceFile, TensorBox, TensorInfo};
pub use read::dtype::Dtype;
pub use read::OpenOptions;
pub use report::describe::{Description, Section};
pub use report::verify::{verify, verify_with, Report};
pub use report::view::{INSPECT_SCHEMA, OUTCOME_SCHEMA, VERIFY_SCHEMA};
pub use write::job::Job;
pub use write::staged::StagedFolder;
pub use write::{CopyMethod, WriteOptions};

/// accelerate's `save_state` folders and transformers' `Trainer` folders as read: their
/// components, data positions and RNG states ([`Checkpoint::save_state`]).
pub mod accelerate {
    pub use crate::formats::accelerate::rng::{read_rng_state, NumpyRng, RngState};
    pub use crate::formats::accelerate::trainer::{TrainerResume, TrainerState};
    pub use crate::formats::accelerate::{
        Component, DataPosition, Model, Optimizer, OptimizerState, ResumePoint, Rng, SaveState,
    };
}

#[doc(hidden)]
pub mod fuzz;

/// Reads the whole of a small file that is not a checkpoint component (a training loop's own
/// state JSON, a manifest of its own) the way `ckpt` reads its indexes and `latest`: only a
/// regular file (after links) is opened, so a FIFO, a socket or a device planted in its place
/// is refused by name before it could block or read without end, and a file over `max` bytes
/// is refused before it is read (and a file that grows while it is read, at `max`).
pub fn read_small_file(path: impl AsRef<std::path::Path>, max: u64) -> Result<Vec<u8>> {
    read::io::read_capped(path.as_ref(), max)
}

impl Error {
    /// True when the error describes a defective checkpoint (as opposed to a missing path, a
    /// usage mistake or an I/O failure). `verify` reports these as problems.
    pub fn is_invalid_data(&self) -> bool {
        self.kind() == ErrorKind::InvalidData
    }

    /// The globals a torch file was refused for, when `allow_globals` could admit them: the one
    /// refused first, then the file's others. For edges to say how to allow them.
    pub fn unallowed_globals(&self) -> Option<&[String]> {
        match self {
            Error::GlobalNotAllowed { globals, .. } => Some(globals),
            _ => None,
        }
    }
}
