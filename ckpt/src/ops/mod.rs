//! The operations: split, merge, convert, reshard. Each takes an opened [`Checkpoint`], asks its
//! format what it can produce (its `FormatOps`: an output to plan, the format's own write,
//! or a refusal), plans it with the target format's planner, and runs the plan. No operation
//! names a format.
//!
//! - `split` writes huggingface_hub's sharded safetensors layout.
//! - `merge` writes one state dict in one safetensors file: a DCP folder as `accelerate
//!   merge-weights` does, a ZeRO folder as `zero_to_fp32` does (optionally sharded, and with the
//!   Adam moments), anything else as `safetensors.torch.save_file` would.
//! - `convert` writes safetensors, torch or DCP files, with casts, dedupe and sharding.
//! - `reshard` writes a sharded checkpoint for another world size: DCP in FSDP2's layout, ZeRO as
//!   DeepSpeed's universal checkpoint.
//!
//! Each claims its destination first (`claim.rs`): a second writer of it is refused, and the
//! ranks of a job must all name it.
//!
//! A folder of parts (an accelerate `save_state` folder) answers a merge with its members, each
//! merged here as its own format merges it; its reshard rewrites the whole folder.

mod hf;
pub(crate) mod local;
pub(crate) mod misuse;
pub(crate) mod outcome;
pub(crate) mod request;
pub(crate) mod save;
pub(crate) mod sharded;

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::formats;
use crate::map::arch::Arch;
use crate::map::blockscale::{self, BlockScaling, Compute};
use crate::ops::misuse::{Misuse, Opt};
pub use crate::ops::outcome::Outcome;
use crate::ops::request::Merge;
pub use crate::ops::request::MergeOptions;
use crate::plan::{self, Dest, IndexStyle, Meta, Out};
use crate::read::catalog::{Checkpoint, TensorInfo};
use crate::read::dtype::Dtype;
use crate::write::claim::claim;
use crate::write::{Plan, WriteOptions};

/// The output format of [`convert`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TargetFormat {
    /// safetensors: one file, or huggingface_hub's sharded layout.
    Safetensors,
    /// `torch.save` files (`.bin`, `.pt`, `.pth`): one file, or sharded with
    /// `pytorch_model.bin.index.json`.
    Torch,
    /// A torch.distributed.checkpoint folder in FSDP2's layout (needs a world size).
    Dcp,
    /// A Hugging Face model folder (`config.json`, safetensors under the Hub's names) of a
    /// source that says what model it holds (a Megatron checkpoint).
    Hf,
    /// A Megatron-LM `torch_dist` run folder (tracker, `iter_NNNNNNN/`), which megatron-core
    /// loads at any parallel layout.
    Megatron,
    /// Megatron-LM's legacy per-rank layout (`--ckpt-format torch`: `mp_rank_TT[_PPP][_EEE]/`
    /// folders), for the tensor, pipeline and expert parallel sizes the options give.
    MegatronLegacy,
}

impl TargetFormat {
    /// The format's name: `safetensors`, `torch`, `dcp` or `hf` (what [`str::parse`] takes).
    pub fn name(self) -> &'static str {
        match self {
            TargetFormat::Safetensors => "safetensors",
            TargetFormat::Torch => "torch",
            TargetFormat::Dcp => "dcp",
            TargetFormat::Hf => "hf",
            TargetFormat::Megatron => "megatron",
            TargetFormat::MegatronLegacy => "megatron-legacy",
        }
    }
}

impl std::str::FromStr for TargetFormat {
    type Err = String;

    /// `safetensors`, `torch`, `dcp`, `hf`, `megatron` or `megatron-legacy`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [
            TargetFormat::Safetensors,
            TargetFormat::Torch,
            TargetFormat::Dcp,
            TargetFormat::Hf,
            TargetFormat::Megatron,
            TargetFormat::MegatronLegacy,
        ]
        .into_iter()
        .find(|f| f.name() == s)
        .ok_or_else(|| {
            format!(
                "the output format is `safetensors`, `torch`, `dcp`, `hf`, `megatron` or `megatron-legacy`, not `{s}`"
            )
        })
    }
}

/// What to convert to.
#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// The format; by default from the destination's extension (`.safetensors`, `.bin`/`.pt`/
    /// `.pth`), safetensors for a folder.
    pub to: Option<TargetFormat>,
    /// Cast floating-point tensors (f64, f32, f16, bf16, FP8) to this dtype, with the bits
    /// torch's `.to(dtype)` gives on CPU; others are kept.
    pub dtype: Option<Dtype>,
    /// Shard into a folder with files of at most this many bytes (huggingface_hub's layout).
    pub max_shard_size: Option<u64>,
    /// Drop exact aliases instead of writing a copy of each.
    pub dedupe: bool,
    /// With [`TargetFormat::Dcp`]: the number of ranks to lay the checkpoint out for.
    pub world_size: Option<u64>,
    /// Dequantize or quantize block-scaled FP8 weights (not with `dtype`).
    pub blocks: Option<BlockScaling>,
    /// With [`TargetFormat::Hf`]: the family to write, instead of the one the source's
    /// configuration is recognized as.
    pub arch: Option<Arch>,
    /// With [`TargetFormat::Hf`]: keep the first this many rows of the vocabulary (the word
    /// embeddings and the output layer), instead of all the rows the checkpoint holds (padding
    /// included).
    pub vocab_size: Option<u64>,
    /// With [`TargetFormat::MegatronLegacy`]: the tensor-parallel ranks to cut the model for
    /// (1 when `None`).
    pub tensor_parallel: Option<u64>,
    /// With [`TargetFormat::MegatronLegacy`]: the pipeline stages (1 when `None`).
    pub pipeline_parallel: Option<u64>,
    /// With [`TargetFormat::MegatronLegacy`]: the expert-parallel ranks of a mixture-of-experts
    /// model (1 when `None`).
    pub expert_parallel: Option<u64>,
}

/// Which of Megatron-LM's layouts a run folder is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RunLayout {
    /// `torch_dist`: global tensors, loaded at any parallel layout.
    TorchDist,
    /// The legacy per-rank files, cut for this layout.
    Legacy(ModelParallel),
}

/// The model-parallel layout of a legacy Megatron output: tensor-parallel ranks, pipeline
/// stages, expert-parallel ranks (each at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelParallel {
    /// Tensor-parallel ranks.
    pub tensor: u64,
    /// Pipeline stages.
    pub pipeline: u64,
    /// Expert-parallel ranks.
    pub expert: u64,
}

impl ConvertOptions {
    /// The first option given that only shapes safetensors or torch output (a cast, shards,
    /// dropped aliases): what a DCP folder or a Megatron run folder, which keep the tensors as
    /// they lay them out, refuse.
    fn file_shaping_option(&self) -> Option<Opt> {
        [
            (self.dtype.is_some(), Opt::Dtype),
            (self.max_shard_size.is_some(), Opt::MaxShardSize),
            (self.dedupe, Opt::Dedupe),
        ]
        .into_iter()
        .find_map(|(given, o)| given.then_some(o))
    }

    /// The parallel sizes given, each with the option that gives it.
    fn parallel_options(&self) -> [(Option<u64>, Opt); 3] {
        [
            (self.tensor_parallel, Opt::TensorParallel),
            (self.pipeline_parallel, Opt::PipelineParallel),
            (self.expert_parallel, Opt::ExpertParallel),
        ]
    }

    /// The legacy layout these options give (every size 1 unless given).
    pub(crate) fn model_parallel(&self) -> ModelParallel {
        ModelParallel {
            tensor: self.tensor_parallel.unwrap_or(1),
            pipeline: self.pipeline_parallel.unwrap_or(1),
            expert: self.expert_parallel.unwrap_or(1),
        }
    }

    /// The format [`convert`] writes to `dst` with these options, or the [`Misuse`] that makes
    /// them impossible, found before anything is read: the one check of these options, for
    /// every caller.
    pub fn check(&self, dst: &Path) -> Result<TargetFormat> {
        let misuse = |misuse| Error::Misuse { path: dst.to_path_buf(), misuse };
        let file = file_format(dst);
        let single = file.is_some();
        let format = match (self.to, file) {
            (Some(TargetFormat::Dcp), _) => TargetFormat::Dcp,
            (Some(TargetFormat::Megatron), _) => TargetFormat::Megatron,
            (Some(TargetFormat::MegatronLegacy), _) => TargetFormat::MegatronLegacy,
            (Some(a), Some((b, ext))) if a != b => {
                return Err(misuse(Misuse::ToContradictsExtension { to: a.name(), ext }));
            }
            (Some(a), _) => a,
            (None, Some((b, _))) => b,
            (None, None) => TargetFormat::Safetensors,
        };
        let blocks = self.blocks.map(|b| match b {
            BlockScaling::Dequantize { .. } => Opt::Dequantize,
            BlockScaling::Quantize { .. } => Opt::Quantize,
        });
        if format != TargetFormat::MegatronLegacy {
            if let Some((_, option)) = self.parallel_options().into_iter().find(|(given, _)| given.is_some()) {
                return Err(misuse(Misuse::OnlyForMegatronLegacy { option }));
            }
        }
        if format != TargetFormat::Hf {
            let hf_only = [(self.arch.is_some(), Opt::Arch), (self.vocab_size.is_some(), Opt::VocabSize)];
            if let Some((_, option)) = hf_only.into_iter().find(|(given, _)| *given) {
                return Err(misuse(Misuse::OnlyForHf { option }));
            }
        }
        if format == TargetFormat::Hf {
            // A Hugging Face model is a folder: a file name already contradicted `to` above.
            let extra = [(self.dedupe, Opt::Dedupe), (self.world_size.is_some(), Opt::WorldSize)]
                .into_iter()
                .find_map(|(given, o)| given.then_some(o))
                .or(blocks);
            if let Some(extra) = extra {
                return Err(misuse(Misuse::NotForHf { extra }));
            }
            if let Some(dtype) = self.dtype.filter(|d| !crate::map::cast::is_castable(*d)) {
                return Err(misuse(Misuse::NotAFloatDtype { dtype }));
            }
            return Ok(format);
        }
        if format == TargetFormat::Dcp {
            let extra = self.file_shaping_option().or(blocks);
            if let Some(extra) = extra {
                return Err(misuse(Misuse::DcpTakesOnlyWorldSize { extra }));
            }
            if self.world_size.is_none() {
                return Err(misuse(Misuse::DcpNeedsWorldSize));
            }
            return Ok(format);
        }
        if self.world_size.is_some() {
            return Err(misuse(Misuse::WorldSizeWithoutDcp));
        }
        if matches!(format, TargetFormat::Megatron | TargetFormat::MegatronLegacy) {
            // A run folder keeps the tensors as megatron stores them.
            let extra = self.file_shaping_option().or(blocks);
            if let Some(option) = extra {
                return Err(misuse(Misuse::NotForTarget { option, to: format.name() }));
            }
            for (size, option) in self.parallel_options() {
                if let Some(size) = size.filter(|s| *s == 0 || *s > MAX_WORLD_SIZE) {
                    return Err(misuse(Misuse::ParallelOutOfRange { option, size }));
                }
            }
            return Ok(format);
        }
        if single && self.max_shard_size.is_some() {
            return Err(misuse(Misuse::ShardsNeedAFolder));
        }
        if let Some(dtype) = self.dtype.filter(|d| !crate::map::cast::is_castable(*d)) {
            return Err(misuse(Misuse::NotAFloatDtype { dtype }));
        }
        match (self.blocks, blocks) {
            (Some(_), Some(blocks)) if self.dtype.is_some() => Err(misuse(Misuse::CastWithBlocks { blocks })),
            (Some(BlockScaling::Dequantize { to, .. }), _) if !crate::map::cast::is_wide(to) => {
                Err(misuse(Misuse::DequantizeToNarrow { dtype: to }))
            }
            _ => Ok(format),
        }
    }
}

/// The format `dst`'s extension names (`.safetensors`; `.bin`, `.pt`, `.pth`) and that
/// extension, when `dst` names one file rather than a folder.
fn file_format(dst: &Path) -> Option<(TargetFormat, String)> {
    let ext = dst.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
    let format = match ext.as_str() {
        "safetensors" => TargetFormat::Safetensors,
        "bin" | "pt" | "pth" => TargetFormat::Torch,
        _ => return None,
    };
    (!dst.is_dir()).then_some((format, ext))
}

/// The largest world size an operation lays a checkpoint out for (a million ranks): larger
/// values are typos that would size per-rank tables by the billion.
pub const MAX_WORLD_SIZE: u64 = 1 << 20;

fn check_world(world: u64, out: &Path) -> Result<()> {
    if world == 0 || world > MAX_WORLD_SIZE {
        return Err(Error::Misuse { path: out.to_path_buf(), misuse: Misuse::WorldSizeOutOfRange { world } });
    }
    Ok(())
}

/// The name of the merged optimizer file written beside the weights.
pub const OPTIMIZER_NAME: &str = "optimizer.safetensors";

/// Every tensor of `ck` written as it is, sharing storages as the data says.
fn as_stored(ck: &Checkpoint) -> Vec<Out<'_>> {
    let tensors: Vec<&TensorInfo> = ck.tensors.iter().collect();
    let keys = plan::storage_keys(&tensors);
    tensors
        .into_iter()
        .zip(keys)
        .map(|(t, key)| Out { tensor: t, dtype: t.dtype, key, tied_to: None, compute: None })
        .collect()
}

/// Runs operation `f` writing `out` as [`in_operation`] does, with `out` claimed for it first
/// and held until it is done (`claim.rs`).
fn with_ranks(opts: &WriteOptions<'_>, out: &Path, f: impl FnOnce() -> Result<Outcome>) -> Result<Outcome> {
    in_operation(opts, out, || {
        let _held = claim(out, opts)?;
        f()
    })
}

/// Runs operation `f` writing `out`, as one operation of the job when it runs as a
/// [`crate::Job`] (a rank that fails alone in it ends every rank's: [`crate::Job::operation`]),
/// and returns it with every rank's share.
fn in_operation(opts: &WriteOptions<'_>, out: &Path, f: impl FnOnce() -> Result<Outcome>) -> Result<Outcome> {
    let Some(job) = opts.job else { return f() };
    let mut done = job.operation(out, f)?;
    done.ranks = job.shares();
    done.dry_run = job.is_dry_run();
    Ok(done)
}

/// Splits `ck` into huggingface_hub-style shards of at most `max_shard_size` bytes in `out_dir`.
///
/// The shards, their names, the `weight_map` and `total_size` are what
/// `huggingface_hub.save_torch_state_dict(load_file(src), out_dir, max_shard_size=…)` writes,
/// and so is every shard's content.
pub fn split(ck: &Checkpoint, out_dir: &Path, max_shard_size: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
    with_ranks(opts, out_dir, || split_here(ck, out_dir, max_shard_size, opts))
}

fn split_here(ck: &Checkpoint, out_dir: &Path, max_shard_size: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
    let outs = as_stored(ck);
    let mut meta = Meta::from_folded(ck.metadata()?);
    meta.format.get_or_insert_with(|| "pt".into());
    let dest = Dest::Shards { dir: out_dir.to_path_buf(), max: max_shard_size, style: IndexStyle::Hub };
    write_state_dict(ck, &outs, &meta, &dest, TargetFormat::Safetensors, opts)
}

/// Merges `ck` into one state dict in the safetensors file `out` (with
/// [`MergeOptions::max_shard_size`], a folder of shards).
///
/// A DeepSpeed ZeRO checkpoint gives exactly what `zero_to_fp32 --safe_serialization` writes; a
/// DCP folder what `accelerate merge-weights` writes; any other checkpoint what
/// `safetensors.torch.save_file` writes for its tensors, `__metadata__` kept and index metadata
/// folded into it.
pub fn merge(ck: &Checkpoint, out: &Path, options: &MergeOptions, opts: &WriteOptions<'_>) -> Result<Outcome> {
    with_ranks(opts, out, || {
        // The optimizer's states beside a merged file are a second destination of the operation.
        let beside = out.parent().unwrap_or(Path::new("")).join(OPTIMIZER_NAME);
        let _beside = match options.optimizer && options.max_shard_size.is_none() && beside != out {
            true => Some(claim(&beside, opts)?),
            false => None,
        };
        merge_here(ck, out, options, opts)
    })
}

/// [`merge`] into a destination already claimed (a `save_state` folder's model and optimizer).
fn merge_claimed(ck: &Checkpoint, out: &Path, options: &MergeOptions, opts: &WriteOptions<'_>) -> Result<Outcome> {
    in_operation(opts, out, || merge_here(ck, out, options, opts))
}

fn merge_here(ck: &Checkpoint, out: &Path, options: &MergeOptions, opts: &WriteOptions<'_>) -> Result<Outcome> {
    match ck.format().ops().merge(ck, out, options)? {
        Merge::Catalog { optimizer } => merge_catalog(ck, out, options.max_shard_size, optimizer, opts),
        Merge::Members { model, options: inner, optimizer } => {
            merge_members(model, &inner, optimizer, out, options.max_shard_size.is_some(), opts)
        }
        Merge::Own(write) => write(opts),
    }
}

/// A folder's members merged in its place: `model` into `out` with `options`, and `optimizer`
/// (its optimizer's own checkpoint) into `optimizer.safetensors` beside it (inside `out` when
/// `sharded`).
fn merge_members(
    model: &Checkpoint,
    options: &MergeOptions,
    optimizer: Option<&Checkpoint>,
    out: &Path,
    sharded: bool,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let Some(ock) = optimizer else { return merge_claimed(model, out, options, opts) };
    // Two plans write into one folder: each would leave a manifest of its own files only, the
    // second replacing the first, so the manifest of both is written once both are in place.
    let plans = WriteOptions { checksums: false, ..opts.clone() };
    let mut done = merge_claimed(model, out, options, &plans)?;
    let dir = if sharded { out.to_path_buf() } else { out.parent().map(Path::to_path_buf).unwrap_or_default() };
    let path = dir.join(OPTIMIZER_NAME);
    if done.files.contains(&path) {
        return Err(Error::OptimizerCollides { path });
    }
    let o = merge_claimed(ock, &path, &MergeOptions::default(), &plans)?;
    done.files.extend(o.files);
    done.tensors += o.tensors;
    done.bytes += o.bytes;
    if opts.checksums && !opts.job.is_some_and(crate::Job::is_dry_run) {
        // The tensor files, as a plan's manifest lists them (an index is not among them).
        let listed: Vec<std::path::PathBuf> =
            done.files.iter().filter(|f| f.extension().is_some_and(|e| e == "safetensors")).cloned().collect();
        crate::write::execute::on_root(opts.job, out, || crate::write::write_manifest(&dir, &listed))?;
    }
    Ok(done)
}

/// `ck`'s catalog as stored merged into `out` (into `zero_to_fp32`'s shards with
/// `max_shard_size`), and `moments`, the optimizer's state per parameter, into
/// `optimizer.safetensors` beside it.
fn merge_catalog(
    ck: &Checkpoint,
    out: &Path,
    max_shard_size: Option<u64>,
    moments: Option<Vec<TensorInfo>>,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let outs = as_stored(ck);
    let meta = Meta::from_folded(ck.metadata()?);
    let dest = match max_shard_size {
        Some(max) => Dest::Shards { dir: out.to_path_buf(), max, style: IndexStyle::ZeroToFp32 },
        None => Dest::File(out.to_path_buf()),
    };
    plan::refuse_expanded(&outs, &ck.files, opts.allow_expanded)?;
    let mut plan = Plan::default();
    let placed = formats::plan_state_dict(TargetFormat::Safetensors, &outs, &[], &meta, &dest, &mut plan)?;
    let mut files = placed.files;
    files.extend(placed.index);
    let mut outcome = Outcome { tensors: outs.len(), bytes: ck.total_bytes(), ..Outcome::default() };
    if let Some(moments) = moments {
        let dir = match &dest {
            Dest::File(p) => p.parent().map(Path::to_path_buf).unwrap_or_default(),
            Dest::Shards { dir, .. } => dir.clone(),
        };
        let path = dir.join(OPTIMIZER_NAME);
        if files.contains(&path) {
            return Err(Error::OptimizerCollides { path });
        }
        let refs: Vec<&TensorInfo> = moments.iter().collect();
        let outs: Vec<Out> = refs
            .iter()
            .enumerate()
            .map(|(i, t)| Out { tensor: t, dtype: t.dtype, key: i, tied_to: None, compute: None })
            .collect();
        let meta = Meta { format: Some("pt".into()), user: Vec::new() };
        let mut extra = Plan::default();
        formats::plan_state_dict(TargetFormat::Safetensors, &outs, &[], &meta, &Dest::File(path.clone()), &mut extra)?;
        plan.targets.extend(extra.targets);
        files.push(path);
        outcome.tensors += moments.len();
        outcome.bytes += moments.iter().map(TensorInfo::byte_len).sum::<u64>();
    }
    if let Dest::File(p) = &dest {
        plan.named.push(p.clone());
    }
    crate::write::execute::execute(&plan, ck, opts)?;
    outcome.files = files;
    Ok(outcome)
}

/// Plans and writes one state dict.
fn write_state_dict(
    ck: &Checkpoint,
    outs: &[Out<'_>],
    meta: &Meta,
    dest: &Dest,
    format: TargetFormat,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    plan::refuse_expanded(outs, &ck.files, opts.allow_expanded)?;
    let mut plan = Plan::default();
    let placed = formats::plan_state_dict(format, outs, &ck.values, meta, dest, &mut plan)?;
    if let Dest::File(p) = dest {
        plan.named.push(p.clone());
    }
    crate::write::execute::execute(&plan, ck, opts)?;
    let mut files = placed.files;
    files.extend(placed.index);
    Ok(Outcome { files, tensors: outs.len(), bytes: placed.bytes, ..Outcome::default() })
}

/// Converts `ck` into `dst`: safetensors or torch files (one file, or a sharded folder), or a
/// DCP folder for [`ConvertOptions::world_size`] ranks.
///
/// Views and tied weights come out as contiguous tensors of their own. With `dedupe`, a tensor
/// that is an exact alias of another (same storage, offset, shape, strides and dtype) is dropped
/// in favour of the first name in sorted order, as safetensors' `save_model` picks it, and the
/// alias is recorded in the metadata (`alias: kept`, huggingface_hub's convention); in torch
/// output the alias is kept and shares the storage instead, as torch itself would save it.
/// Non-tensor values go into safetensors metadata as JSON text (into the index metadata, as
/// JSON values, when sharded), and into the pickle of a torch target (of its first shard).
pub fn convert(ck: &Checkpoint, dst: &Path, options: &ConvertOptions, opts: &WriteOptions<'_>) -> Result<Outcome> {
    with_ranks(opts, dst, || convert_here(ck, dst, options, opts))
}

fn convert_here(ck: &Checkpoint, dst: &Path, options: &ConvertOptions, opts: &WriteOptions<'_>) -> Result<Outcome> {
    let format = options.check(dst)?;
    let single = file_format(dst).is_some();
    if format == TargetFormat::Dcp {
        let world = options.world_size.unwrap_or_default();
        check_world(world, dst)?;
        return ck.format().ops().to_dcp(ck, dst, world, opts);
    }
    if format == TargetFormat::Hf {
        return hf::convert(ck, dst, options, opts);
    }
    if format == TargetFormat::Megatron {
        return ck.format().ops().to_megatron(ck, dst, RunLayout::TorchDist, opts);
    }
    if format == TargetFormat::MegatronLegacy {
        return ck.format().ops().to_megatron(ck, dst, RunLayout::Legacy(options.model_parallel()), opts);
    }
    let blocks = match options.blocks {
        Some(b) => Some(block_plan(ck, b, dst)?),
        None => None,
    };

    // Exact aliases: grouped by the bytes they read, the first name in sorted order kept.
    let mut tie_of: HashMap<usize, usize> = HashMap::new();
    if options.dedupe {
        let mut groups: HashMap<_, Vec<usize>> = HashMap::new();
        for (i, t) in ck.tensors.iter().enumerate() {
            if let Some(k) = t.alias_key().filter(|_| t.byte_len() > 0) {
                groups.entry(k).or_default().push(i);
            }
        }
        for members in groups.values().filter(|g| g.len() > 1) {
            let keep = members.iter().copied().min_by(|&a, &b| ck.tensors[a].name.cmp(&ck.tensors[b].name));
            let Some(keep) = keep else { continue };
            for &m in members.iter().filter(|&&m| m != keep) {
                tie_of.insert(m, keep);
            }
        }
    }
    let mut aliases: Vec<(String, String)> =
        tie_of.iter().map(|(&a, &k)| (ck.tensors[a].name.clone(), ck.tensors[k].name.clone())).collect();
    aliases.sort();

    let mut outs: Vec<Out> = Vec::with_capacity(ck.tensors.len());
    let mut out_of_src: HashMap<usize, usize> = HashMap::new();
    for (i, t) in ck.tensors.iter().enumerate() {
        if format == TargetFormat::Safetensors && tie_of.contains_key(&i) {
            continue;
        }
        let dtype = match options.dtype {
            Some(d) if crate::map::cast::is_castable(t.dtype) => d,
            _ => t.dtype,
        };
        let mut compute = None;
        let mut dtype = dtype;
        if let Some(b) = &blocks {
            if b.dropped.contains(&i) {
                continue;
            }
            if let Some((d, c)) = b.computed.get(&i) {
                (dtype, compute) = (*d, Some(c.clone()));
            }
        }
        out_of_src.insert(i, outs.len());
        let key = outs.len();
        outs.push(Out { tensor: t, dtype, key, tied_to: None, compute });
        if let Some((scale, c)) = blocks.as_ref().and_then(|b| b.added.get(&i)) {
            let key = outs.len();
            outs.push(Out { tensor: scale, dtype: Dtype::F32, key, tied_to: None, compute: Some(c.clone()) });
        }
    }
    // Tied tensors count once and follow their storage.
    for (i, k) in &tie_of {
        if let (Some(&o), Some(&kept)) = (out_of_src.get(i), out_of_src.get(k)) {
            outs[o].tied_to = Some(kept);
            outs[o].key = kept;
        }
    }

    let mut meta = Meta::from_folded(ck.metadata()?);
    meta.format = Some("pt".into());
    meta.user.retain(|(k, _)| k != "total_size");
    meta.user.extend(aliases.iter().map(|(a, k)| (a.clone(), serde_json::Value::String(k.clone()))));
    let dest = if single {
        Dest::File(dst.to_path_buf())
    } else {
        let max = match options.max_shard_size {
            Some(m) => m,
            None => crate::plan::size::parse_size(crate::plan::size::DEFAULT_MAX_SHARD_SIZE)?,
        };
        Dest::Shards { dir: dst.to_path_buf(), max, style: IndexStyle::Hub }
    };
    let mut outcome = write_state_dict(ck, &outs, &meta, &dest, format, opts)?;
    outcome.aliases = aliases;
    outcome.values = ck.values.iter().map(|(k, _)| k.clone()).collect();
    Ok(outcome)
}

/// What block scaling does to a checkpoint's tensors, by index.
struct BlockPlan {
    /// Tensors whose bytes are computed: the dtype they are written as and how.
    computed: HashMap<usize, (Dtype, blockscale::SharedCompute)>,
    /// Tensors left out (the scales of dequantized weights).
    dropped: std::collections::HashSet<usize>,
    /// Tensors written right after a source tensor (the scales of quantized weights).
    added: HashMap<usize, (TensorInfo, blockscale::SharedCompute)>,
}

fn block_plan(ck: &Checkpoint, scaling: BlockScaling, dst: &Path) -> Result<BlockPlan> {
    let mut p = BlockPlan { computed: HashMap::new(), dropped: Default::default(), added: HashMap::new() };
    let index: HashMap<&str, usize> = ck.tensors.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
    let srcs = crate::read::io::Sources::of(&ck.files)?;
    let blocks = match scaling {
        BlockScaling::Dequantize { .. } => Opt::Dequantize,
        BlockScaling::Quantize { .. } => Opt::Quantize,
    };
    let check_block = |b: u64| match b {
        0 => Err(Error::Misuse { path: dst.to_path_buf(), misuse: Misuse::ZeroBlock { blocks } }),
        b => Ok(b),
    };
    match scaling {
        BlockScaling::Dequantize { to, block } => {
            let block = check_block(block)?;
            for (i, t) in ck.tensors.iter().enumerate() {
                if crate::map::cast::fp8::Format::of(t.stored).is_none() || t.name.ends_with(blockscale::SCALE_SUFFIX) {
                    continue;
                }
                let scale_name = format!("{}{}", t.name, blockscale::SCALE_SUFFIX);
                let Some(&si) = index.get(scale_name.as_str()) else {
                    return Err(Error::BadBlockScale {
                        weight: t.name.clone(),
                        scale: scale_name,
                        problem: Box::new(crate::error::BlockScaleProblem::Missing),
                    });
                };
                let scale = blockscale::read_scales(&srcs, t, &ck.tensors[si], block)?;
                let cols = t.shape.get(1).copied().unwrap_or(0);
                p.computed.insert(i, (to, std::sync::Arc::new(Compute::Dequantize { scale, cols, block })));
                p.dropped.insert(si);
            }
        }
        BlockScaling::Quantize { block, all_2d } => {
            let block = check_block(block)?;
            for (i, t) in ck.tensors.iter().enumerate() {
                let scale_name = format!("{}{}", t.name, blockscale::SCALE_SUFFIX);
                if !blockscale::quantizable(t, all_2d) || t.numel() == 0 {
                    continue;
                }
                if index.contains_key(scale_name.as_str()) {
                    return Err(Error::AlreadyQuantized {
                        dst: dst.to_path_buf(),
                        weight: t.name.clone(),
                        scale: scale_name,
                    });
                }
                let scale = blockscale::quantize_scales(&srcs, t, block)?;
                let shape = blockscale::scale_shape(&t.shape, block).unwrap_or_default();
                let bytes: Vec<u8> = scale.iter().flat_map(|s| s.to_le_bytes()).collect();
                let cols = t.shape[1];
                p.computed.insert(i, (Dtype::F8E4M3, std::sync::Arc::new(Compute::Quantize { scale, cols, block })));
                let info = TensorInfo::ranges(scale_name, Dtype::F32, shape, Vec::new());
                p.added.insert(i, (info, std::sync::Arc::new(Compute::Bytes(bytes))));
            }
        }
    }
    Ok(p)
}

/// Writes `ck` again for `world_size` ranks into `out`: a DCP folder in FSDP2's layout (every
/// tensor the source held sharded, on any dims, is cut on dim 0 by `torch.chunk` rules, tensors
/// saved whole stay whole, non-tensor values are carried byte for byte; DCP's safetensors
/// shards come out as such a folder too), or a ZeRO checkpoint as DeepSpeed's
/// universal checkpoint, which DeepSpeed loads with `load_universal` on any world size.
pub fn reshard(ck: &Checkpoint, out: &Path, world_size: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
    with_ranks(opts, out, || reshard_here(ck, out, world_size, opts))
}

fn reshard_here(ck: &Checkpoint, out: &Path, world_size: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
    check_world(world_size, out)?;
    ck.format().ops().reshard(ck, out, world_size, opts)
}
