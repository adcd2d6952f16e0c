//! On-disk formats. Each module opens with a description of its layout, and offers the same
//! three things: `detect` (is this path, file or folder, a checkpoint of mine, and where is its
//! root?), `catalog` (read it into a [`crate::Checkpoint`]) and `describe` (what it says of a
//! checkpoint it read, for `inspect` and `--json`). Adding a format is one module and one line
//! in [`DETECTORS`], [`catalog`] and [`describe`].

pub(crate) mod accelerate;
pub(crate) mod dcp;
pub(crate) mod deepspeed;
pub(crate) mod hf_index;
pub(crate) mod megatron;
pub(crate) mod safetensors;
pub(crate) mod torch;

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::read::catalog::{Checkpoint, Format, Scan};
use crate::report::describe::Description;

/// A format's detector: the checkpoint root `path` names, if it is one of the format's.
type Detect = fn(&Path) -> Result<Option<PathBuf>>;

/// Detection order. Folders that hold several formats resolve to the first that matches: a DCP
/// or ZeRO folder is itself, a torch file is sniffed before the safetensors fallback for files,
/// and a folder's safetensors win over its torch files.
pub(crate) const DETECTORS: &[(Format, Detect)] = &[
    (Format::AccelerateState, accelerate::detect),
    (Format::MegatronTorchDist, megatron::detect_torch_dist),
    (Format::MegatronLegacy, megatron::detect_legacy),
    (Format::Dcp, dcp::detect),
    (Format::DeepSpeed, deepspeed::detect),
    (Format::TorchSharded, torch::detect_sharded_file),
    (Format::Torch, torch::detect_file),
    (Format::HfSharded, hf_index::detect),
    (Format::DcpSafetensors, dcp::hf_storage::detect),
    (Format::Safetensors, safetensors::detect),
    (Format::TorchSharded, torch::detect_sharded_folder),
    (Format::Torch, torch::detect_folder),
];

/// Reads a checkpoint whose format detection decided, as `options` say.
pub(crate) fn catalog(format: Format, root: PathBuf, options: &crate::OpenOptions) -> Result<Scan> {
    let (tag, allow) = (options.tag.as_deref(), &options.allow_globals);
    match format {
        Format::Safetensors => safetensors::catalog(root),
        Format::HfSharded => hf_index::catalog(root),
        Format::Torch | Format::TorchSharded => torch::catalog(root, format, allow),
        Format::Dcp => dcp::catalog(root),
        Format::DcpSafetensors => dcp::hf_storage::catalog(root),
        Format::DeepSpeed => deepspeed::catalog(root, tag),
        Format::AccelerateState | Format::Trainer => accelerate::catalog(root),
        Format::MegatronTorchDist => megatron::catalog_torch_dist(root, options.as_stored),
        Format::MegatronLegacy => megatron::catalog_legacy(root),
    }
}

impl Checkpoint {
    /// What the checkpoint's format says about it (see [`Description`]).
    pub fn describe(&self) -> Description {
        describe(self)
    }
}

/// What a checkpoint's format says of it, for `inspect`, `--json` and an operation's summary.
pub(crate) fn describe(ck: &Checkpoint) -> Description {
    match ck.format() {
        Format::Safetensors | Format::HfSharded | Format::Torch | Format::TorchSharded => Description::of_files(ck),
        Format::Dcp | Format::DcpSafetensors => dcp::describe(ck),
        Format::DeepSpeed => deepspeed::describe(ck),
        Format::AccelerateState | Format::Trainer => accelerate::describe(ck),
        Format::MegatronTorchDist | Format::MegatronLegacy => megatron::describe(ck),
    }
}
