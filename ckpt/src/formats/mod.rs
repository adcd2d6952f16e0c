//! On-disk formats. Each module opens with a description of its layout, and answers for its own
//! sources through one interface, [`FormatOps`]: what a source is (`detect`, in [`DETECTORS`],
//! and its catalog) and what it can produce (its merge, its reshard, its optimizer's state), as
//! an output the generic planner plans, as the format's own write, or as a typed refusal. The
//! operations (`ops/`) open a source, ask its format ([`Format::ops`]), plan and execute; they
//! name no format.
//!
//! It also says what it is for the edges: it describes its sources for `inspect`, `--json` and
//! an operation's summary ([`FormatOps::describe`]), and says which open options it takes
//! ([`FormatOps::takes`]); and it lays out its own target files ([`plan_state_dict`]).
//!
//! Adding a format is one module with a unit struct implementing [`FormatOps`], one line in
//! [`DETECTORS`] and one in [`ops_of`]. The rest of the crate asks this file (detect, catalog,
//! describe, plan a state dict, read a safetensors header or a shard index for the Hub) and
//! never names a format module.

pub(crate) mod accelerate;
pub(crate) mod dcp;
pub(crate) mod deepspeed;
pub(crate) mod hf_index;
pub(crate) mod megatron;
pub(crate) mod safetensors;
pub(crate) mod torch;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::ops::misuse::{Misuse, Opt};
use crate::ops::outcome::Outcome;
use crate::ops::request::{Merge, MergeOptions};
use crate::ops::{RunLayout, TargetFormat};
use crate::plan::{Dest, Meta, Out, Placed};
use crate::read::catalog::{Checkpoint, Format, Scan, SourceFile, TensorInfo};
use crate::read::value::Leaf;
use crate::read::OpenOptions;
use crate::report::describe::Description;
use crate::write::{Plan, WriteOptions};

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

/// What a format answers for its own sources. One unit struct per format implements it, and
/// [`ops_of`] finds it for a [`Format`]; only the format looks inside its source's detail.
///
/// What a format cannot produce it refuses by default, naming itself and what was asked (the
/// option asking for it: [`Misuse::OptionNotForFormat`]; a reshard: [`Error::NotReshardable`]),
/// so a format states only what it can do.
pub(crate) trait FormatOps: Sync {
    /// Reads a checkpoint detection found at `root` as `format` (one of this format's), as
    /// `options` say.
    fn catalog(&self, format: Format, root: PathBuf, options: &OpenOptions) -> Result<Scan>;

    /// What the format says of `ck`, one of its sources, for `inspect`, `--json` and an
    /// operation's summary. By default it names the source by its files and adds nothing.
    fn describe(&self, ck: &Checkpoint) -> Description {
        Description::of_files(ck)
    }

    /// Whether a source of `format` (one of this format's) takes the open `option` that only
    /// some formats take (`tag`, `allow_globals`, `as_stored`); opening refuses one it does not
    /// take. By default none.
    fn takes(&self, format: Format, option: Opt) -> bool {
        let _ = (format, option);
        false
    }

    /// How `merge` writes `ck` into `out`. By default its catalog as stored, with the optimizer's
    /// state beside it where [`FormatOps::optimizer_state`] gives one, and in one file unless
    /// [`FormatOps::merges_into_shards`].
    fn merge<'a>(&self, ck: &'a Checkpoint, _out: &Path, options: &MergeOptions) -> Result<Merge<'a>> {
        merge_as_stored(self, ck, options)
    }

    /// The optimizer's state per parameter (`<param>.exp_avg`, …), as tensors of `ck`'s files,
    /// which a merge writes beside the weights. By default refused: the source holds none.
    fn optimizer_state(&self, ck: &Checkpoint) -> Result<Vec<TensorInfo>> {
        Err(not_for_format(Opt::Optimizer, ck))
    }

    /// The model `ck` holds, format-neutral, for the architecture tables (a conversion to a
    /// Hugging Face folder). By default refused: the source does not say what model it is.
    fn model_config(&self, ck: &Checkpoint) -> Result<crate::map::arch::ModelConfig> {
        let misuse = Misuse::HfFromFormat { source: ck.root.clone(), format: ck.format };
        Err(Error::Misuse { path: ck.root.clone(), misuse })
    }

    /// Whether a merge of this format may be sharded into a folder, as `zero_to_fp32
    /// --max_shard_size` does. By default not: `split` shards a checkpoint.
    fn merges_into_shards(&self) -> bool {
        false
    }

    /// Writes `ck` again for `world` ranks into `out` (checked to be a valid world size), as
    /// `reshard` does. By default refused: only checkpoints laid out for ranks are resharded.
    fn reshard(&self, ck: &Checkpoint, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
        let _ = (out, world, opts);
        Err(Error::NotReshardable { path: ck.root.clone() })
    }

    /// Writes `ck` as a DCP folder for `world` ranks into `out` (`convert` to DCP). By default
    /// as FSDP2 saves a model's state dict; a DCP source is resharded.
    fn to_dcp(&self, ck: &Checkpoint, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
        dcp::write(ck, out, world, opts)
    }

    /// Writes `ck` as a Megatron-LM run folder `out` in `layout` (`convert` to Megatron). By
    /// default refused: only a source whose tensors are megatron's own, or a Hugging Face
    /// model's, is written so.
    fn to_megatron(&self, ck: &Checkpoint, out: &Path, layout: RunLayout, opts: &WriteOptions<'_>) -> Result<Outcome> {
        let _ = (out, layout, opts);
        Err(not_for_format(Opt::To, ck))
    }
}

/// The interface of each format.
pub(crate) fn ops_of(format: Format) -> &'static dyn FormatOps {
    match format {
        Format::Safetensors => &safetensors::SafetensorsFormat,
        Format::HfSharded => &hf_index::HfShardedFormat,
        Format::Torch | Format::TorchSharded => &torch::TorchFormat,
        Format::Dcp => &dcp::DcpFormat,
        Format::DcpSafetensors => &dcp::hf_storage::DcpSafetensorsFormat,
        Format::DeepSpeed => &deepspeed::DeepSpeedFormat,
        Format::AccelerateState | Format::Trainer => &accelerate::AccelerateFormat,
        Format::MegatronTorchDist | Format::MegatronLegacy => &megatron::MegatronFormat,
    }
}

impl Format {
    /// What this format answers for its sources (see [`FormatOps`]).
    pub(crate) fn ops(self) -> &'static dyn FormatOps {
        ops_of(self)
    }
}

/// Reads a checkpoint whose format detection decided, as `options` say.
pub(crate) fn catalog(format: Format, root: PathBuf, options: &OpenOptions) -> Result<Scan> {
    ops_of(format).catalog(format, root, options)
}

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
/// otherwise (a DCP target is laid out for its ranks by `dcp::write`, and a Megatron run folder by
/// `FormatOps::to_megatron`, never as one state dict).
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
        TargetFormat::Safetensors
        | TargetFormat::Dcp
        | TargetFormat::Hf
        | TargetFormat::Megatron
        | TargetFormat::MegatronLegacy => safetensors::plan(outs, meta, dest, plan),
    }
}

// What the Hub reads of a repository's checkpoint by range requests, before (or instead of)
// downloading it, with the local readers' caps and checks: a safetensors file's header and a
// shard index. `hub/` reaches the layouts through these alone.
/// The format [`crate::save_sharded`] writes (DCP): each rank's file laid out from its memory,
/// and the folder planned from every rank's descriptors.
pub(crate) use dcp::save::{lay_out_rank as lay_out_sharded_rank, plan_folder as plan_sharded_folder};
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

/// Whether `format` takes the open `option` (see [`FormatOps::takes`]).
pub(crate) fn takes(format: Format, option: Opt) -> bool {
    ops_of(format).takes(format, option)
}

impl Checkpoint {
    /// What the checkpoint's format says about it (see [`Description`]).
    pub fn describe(&self) -> Description {
        ops_of(self.format).describe(self)
    }
}

/// The refusal of an `option` asking `ck`'s format for an output it cannot make of it.
pub(crate) fn not_for_format(option: Opt, ck: &Checkpoint) -> Error {
    let misuse = Misuse::OptionNotForFormat { option, source: ck.root.clone(), format: ck.format };
    Error::Misuse { path: ck.root.clone(), misuse }
}

/// Refuses [`MergeOptions::model`], which picks a model of a folder of several, for a source
/// that is one model.
pub(crate) fn refuse_model(ck: &Checkpoint, options: &MergeOptions) -> Result<()> {
    match options.model {
        Some(_) => Err(not_for_format(Opt::Model, ck)),
        None => Ok(()),
    }
}

/// The merge of a format whose merged state dict is its catalog as stored (see
/// [`FormatOps::merge`]): every option checked against what `format` can do before anything is
/// read.
pub(crate) fn merge_as_stored<'a, F: FormatOps + ?Sized>(
    format: &F,
    ck: &'a Checkpoint,
    options: &MergeOptions,
) -> Result<Merge<'a>> {
    refuse_model(ck, options)?;
    if options.max_shard_size.is_some() && !format.merges_into_shards() {
        return Err(not_for_format(Opt::MaxShardSize, ck));
    }
    let optimizer = match options.optimizer {
        true => Some(format.optimizer_state(ck)?),
        false => None,
    };
    Ok(Merge::Catalog { optimizer })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A one-tensor safetensors file, opened.
    fn safetensors_source(dir: &Path) -> Checkpoint {
        let data = vec![1u8; 8];
        let view = ::safetensors::tensor::TensorView::new(::safetensors::Dtype::F32, vec![2], &data).unwrap();
        let path = dir.join("m.safetensors");
        ::safetensors::serialize_to_file([("w", view)], None, &path).unwrap();
        Checkpoint::open(path.to_str().unwrap()).unwrap()
    }

    #[test]
    fn a_format_asked_for_an_output_it_cannot_make_refuses_naming_itself_and_the_output() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = safetensors_source(tmp.path());
        let out = tmp.path().join("merged.safetensors");

        let asked = MergeOptions { optimizer: true, ..MergeOptions::default() };
        let err = ck.format.ops().merge(&ck, &out, &asked).unwrap_err();
        let Error::Misuse { misuse: Misuse::OptionNotForFormat { option, source, format }, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!((*option, source, *format), (Opt::Optimizer, &ck.root, Format::Safetensors));
        let text = err.to_string();
        assert!(text.contains("`optimizer` applies to merges of DeepSpeed and Megatron checkpoints"), "{text}");
        assert!(text.ends_with("is safetensors"), "{text}");
        assert_eq!(err.kind(), crate::ErrorKind::Usage);

        let sharded = MergeOptions { max_shard_size: Some(1 << 20), ..MergeOptions::default() };
        let err = ck.format.ops().merge(&ck, &out, &sharded).unwrap_err();
        assert!(
            matches!(err, Error::Misuse { misuse: Misuse::OptionNotForFormat { option: Opt::MaxShardSize, .. }, .. }),
            "{err:?}"
        );

        let err = ck.format.ops().reshard(&ck, &tmp.path().join("r"), 2, &WriteOptions::default()).unwrap_err();
        assert!(matches!(&err, Error::NotReshardable { path } if *path == ck.root), "{err:?}");
        assert!(!tmp.path().join("r").exists(), "a refusal writes nothing");
    }

    #[test]
    fn what_a_format_can_make_it_answers_as_an_output_to_plan() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = safetensors_source(tmp.path());
        let merge = ck.format.ops().merge(&ck, &tmp.path().join("o.safetensors"), &MergeOptions::default()).unwrap();
        assert!(matches!(merge, Merge::Catalog { optimizer: None }), "{merge:?}");
        assert!(!ck.format.ops().merges_into_shards(), "`split` shards a safetensors checkpoint");
        assert!(ops_of(Format::DeepSpeed).merges_into_shards(), "as `zero_to_fp32 --max_shard_size` does");
    }
}
