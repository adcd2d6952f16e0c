//! Checkpoint formats and operations.
//!
//! Every format is read into one view, a [`Checkpoint`]: a catalog of logical tensors, each
//! made of byte ranges (chunks) of source files. Operations ([`split`], [`merge`]) compute a
//! plan of range copies into target files and run it streaming, in parallel, with resident
//! memory bounded by a fixed window, writing atomically with the index last. [`verify`] reports
//! every defect a reader would trip on.
//!
//! Readers never execute anything from a checkpoint, and every error names its file and, where
//! it applies, its tensor.

mod cast;
mod catalog;
mod convert;
mod dtype;
mod error;
mod formats;
mod hub;
mod manifest;
mod ops;
mod size;
mod sys;
mod verify;
mod write;

pub use cast::{cast_into, is_castable};
pub use catalog::{Checkpoint, Chunk, Format, SourceFile, TensorInfo};
pub use convert::{convert, ConvertOptions, ConvertOutcome, TargetFormat};
pub use formats::dcp::{reshard, to_dcp, DcpOutcome};
pub use formats::deepspeed::{
    is_zero_checkpoint, merge_zero, reshard_zero, ZeroCheckpoint, ZeroMergeOptions, ZeroMergeOutcome, ZeroParam,
    ZeroReshardOutcome, ZeroTensor, OPTIMIZER_NAME as ZERO_OPTIMIZER_NAME,
};
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use formats::hf_index::{INDEX_NAME, SINGLE_NAME};
pub use formats::safetensors::{read_header, Header, HeaderTensor, MAX_HEADER_LEN};
pub use hub::{cache_dir as hub_cache_dir, resolve as resolve_source, HubAddress};
pub use manifest::MANIFEST_NAME;
pub use ops::{assign_shards, merge, split, MergeOutcome, SplitOutcome};
pub use size::{parse_size, DEFAULT_MAX_SHARD_SIZE};
#[doc(hidden)]
pub use formats::torch::fuzz;
pub use formats::torch::{MAX_PICKLE_LEN, TORCH_INDEX_NAME, TORCH_SINGLE_NAME};
pub use verify::{verify, Report};
pub use write::{CopyMethod, WriteOptions};

impl Error {
    /// True when the error describes a defective checkpoint (as opposed to a missing path, a
    /// usage mistake or an I/O failure). `verify` reports these as problems.
    pub fn is_invalid_data(&self) -> bool {
        !matches!(
            self,
            Error::Io { .. }
                | Error::NotACheckpoint { .. }
                | Error::BadSize { .. }
                | Error::BadHubUrl { .. }
                | Error::NotInHubCache { .. }
                | Error::OutputIsSource { .. }
                | Error::BadConvert { .. }
                | Error::NotInSafetensors { .. }
        )
    }
}
