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

#![warn(missing_docs, unreachable_pub)]

mod blockscale;
mod cast;
mod catalog;
mod checksum;
mod claim;
mod crc_pass;
mod dtype;
mod error;
mod execute;
mod fault;
mod formats;
mod hub;
mod io;
mod job;
mod manifest;
mod misuse;
mod open;
mod ops;
mod outcome;
mod plan;
mod save;
mod shape;
mod sharded;
mod shares;
mod size;
mod stage;
mod staged;
mod sys;
mod value;
mod verify;
mod view;
mod write;

pub use blockscale::BlockScaling;
pub use catalog::{Checkpoint, Chunk, Format, SourceFile, TensorBox, TensorInfo};
pub use dtype::Dtype;
pub use error::{escape_controls, Error, ErrorKind, Result};
pub use formats::megatron::MegatronInfo;
pub use formats::torch::allow::AllowGlobals;
pub use fsdp_state::Region;
pub use hub::{push, DownloadProgress, Pushed};
pub use job::Job;
pub use misuse::{Misuse, Opt};
pub use open::OpenOptions;
pub use ops::{
    convert, merge, reshard, split, ConvertOptions, MergeOptions, Outcome, TargetFormat, MAX_WORLD_SIZE, OPTIMIZER_NAME,
};
pub use save::{save_safetensors, MemoryTensor, SaveOptions};
pub use sharded::{save_sharded, KeyPart, LocalTensor, LocalValue};
pub use shares::RankShare;
pub use size::{parse_size, DEFAULT_MAX_SHARD_SIZE};
pub use staged::StagedFolder;
pub use verify::{verify, verify_with, Report};
pub use view::{INSPECT_SCHEMA, OUTCOME_SCHEMA, VERIFY_SCHEMA};
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
    io::read_capped(path.as_ref(), max)
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
