//! On-disk formats. Each module opens with a description of its layout, and offers the same
//! three things: `detect` (is this path, file or folder, a checkpoint of mine, and where is its
//! root?), `catalog` (read it into a [`crate::Checkpoint`]) and `describe` (what it says of a
//! checkpoint it read, for `inspect` and `--json`). Adding a format is one module and one line
//! in [`DETECTORS`], [`catalog`] and [`describe`] (and in [`takes`] when it takes an open
//! option of its own).
//!
//! The rest of the crate asks this file (detect, catalog, describe, which open options a
//! format takes, plan a state dict as a target format's files, read a safetensors header or a
//! shard index for the Hub) rather than a format module (only `ops/` still reaches into some,
//! for their merges and reshards), so each table here can become a method of one format trait
//! without touching its callers.

pub(crate) mod accelerate;
pub(crate) mod dcp;
pub(crate) mod deepspeed;
pub(crate) mod hf_index;
pub(crate) mod megatron;
pub(crate) mod safetensors;
pub(crate) mod torch;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::ops::misuse::Opt;
use crate::ops::TargetFormat;
use crate::plan::{Dest, Meta, Out, Placed};
use crate::read::catalog::{Checkpoint, Format, Scan, SourceFile};
use crate::read::value::Leaf;
use crate::report::describe::Description;
use crate::write::Plan;

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

/// The format and root of the checkpoint at `path` (a folder when `is_dir`), the first of
/// [`DETECTORS`] that matches.
pub(crate) fn detect(path: &Path, is_dir: bool) -> Result<(Format, PathBuf)> {
    for (format, detect) in DETECTORS {
        if let Some(root) = detect(path)? {
            return Ok((*format, root));
        }
    }
    if is_dir {
        // Say what is there when it looks like a checkpoint but fits no layout.
        let (_, singles) = safetensors::folder_files(path)?;
        if !singles.is_empty() {
            let found = singles.iter().take(4).filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned());
            return Err(Error::UnknownSafetensorsLayout {
                path: path.to_path_buf(),
                count: singles.len(),
                found: found.collect(),
            });
        }
    }
    Err(Error::NotACheckpoint { path: path.to_path_buf() })
}

/// Plans a state dict as `to`'s files at `dest`, with the non-tensor `values` where the format
/// keeps them (a torch file's pickle): torch files for [`TargetFormat::Torch`], safetensors
/// otherwise (a DCP target is laid out for its ranks by `dcp::write`, never as one state dict).
pub(crate) fn plan_state_dict(
    to: TargetFormat,
    outs: &[Out<'_>],
    values: &[(String, Leaf)],
    meta: &Meta,
    dest: &Dest,
    plan: &mut Plan,
) -> Result<Placed> {
    match to {
        TargetFormat::Torch => torch::writer::plan(outs, values, meta, dest, plan),
        TargetFormat::Safetensors | TargetFormat::Dcp => safetensors::plan(outs, meta, dest, plan),
    }
}

// What the Hub reads of a repository's checkpoint by range requests, before (or instead of)
// downloading it, with the local readers' caps and checks: a safetensors file's header and a
// shard index. `hub/` reaches the layouts through these alone.
pub(crate) use hf_index::{Index as ShardIndex, MAX_INDEX_LEN};
pub(crate) use safetensors::Header as SafetensorsHeader;

/// The names huggingface_hub gives a repository's safetensors checkpoint, its shard index first.
pub(crate) const SAFETENSORS_NAMES: [&str; 2] = [hf_index::INDEX_NAME, safetensors::SINGLE_NAME];
/// The names transformers gives a repository's torch checkpoint, its shard index first.
pub(crate) const TORCH_NAMES: [&str; 2] = [torch::TORCH_INDEX_NAME, torch::TORCH_SINGLE_NAME];

/// A safetensors file of `len` bytes at `path`, its header read through `read(offset, len)`
/// (range requests): the file as a source, and its validated header.
pub(crate) fn file_header(
    path: &Path,
    len: u64,
    read: impl FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<(SourceFile, SafetensorsHeader)> {
    let header = safetensors::read_header_with(len, path, read)?;
    Ok(safetensors::source_of(path, len, header))
}

/// The catalog of one safetensors file, from its header alone.
pub(crate) fn file_catalog(file: SourceFile, header: SafetensorsHeader) -> Result<Scan> {
    safetensors::catalog_of(file, header)
}

/// The catalog of the sharded safetensors checkpoint `index` describes, each shard's header
/// read by `read_shard(name)` (`None`: the shard is missing).
pub(crate) fn sharded_catalog(
    index: &ShardIndex,
    read_shard: impl FnMut(&str) -> Option<Result<(SourceFile, SafetensorsHeader)>>,
) -> Result<Scan> {
    hf_index::catalog_of(index, read_shard)
}

/// Whether `format` takes the open `option` that only some formats take (`tag`,
/// `allow_globals`, `as_stored`); opening refuses an option its format does not take.
pub(crate) fn takes(format: Format, option: Opt) -> bool {
    let takes: &[Opt] = match format {
        Format::DeepSpeed => &[Opt::Tag],
        Format::Torch | Format::TorchSharded => &[Opt::AllowGlobals],
        Format::MegatronTorchDist => &[Opt::AsStored],
        Format::Safetensors
        | Format::HfSharded
        | Format::Dcp
        | Format::DcpSafetensors
        | Format::AccelerateState
        | Format::Trainer
        | Format::MegatronLegacy => &[],
    };
    takes.contains(&option)
}

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
