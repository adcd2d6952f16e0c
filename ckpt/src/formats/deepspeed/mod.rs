//! DeepSpeed ZeRO checkpoints (stages 1, 2 and 3, as DeepSpeed 0.19.8 writes them), read without
//! running DeepSpeed or any pickle.
//!
//! # On disk
//!
//! A checkpoint folder holds a `latest` file naming a tag (`global_step2`, no newline) and one
//! folder per tag. In the tag folder every data-parallel rank `r` wrote
//! `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` (the `bf16_` prefix on every bf16 run).
//! The model state is `mp_rank_00_model_states.pt` (stage 1/2, written by rank 0 alone) or one
//! `zero_pp_rank_{r}_mp_rank_00_model_states.pt` per rank (stage 3). All are `torch.save` zips.
//!
//! The model-states file carries `module` (the `state_dict`, with full buffers; at stage 1/2 full
//! params in the training dtype, at stage 3 every param a 0-element placeholder), `buffer_names`
//! (persistent buffers), `param_shapes` (one ordered `{name: Size}` per optimizer param group,
//! trainable params only), `frozen_param_shapes` / `frozen_param_fragments` (stage ≥ 2; at stage 3
//! each rank holds a `ceil(n / world)` piece of each frozen param, the last zero-padded) and
//! `shared_params` (`{alias: stored name}`, on rank 0's file only at stage 3).
//!
//! The optim-states file carries the fp32 master weights and the Adam moments of the rank:
//!
//! - **stage 1/2**: each param group is flattened in `param_shapes` order (plus optional per-param
//!   alignment zeros, `param_alignment_paddings`), padded to a multiple of `2 × world` and cut
//!   into `world` equal partitions. `single_partition_of_fp32_groups[g]` is this rank's partition
//!   with the trailing padding cut off (`group_paddings[g]` elements, only ever on the last rank),
//!   saved as a view, so its storage record still holds the padded partition. The moments
//!   (`base_optimizer_state.state[g].exp_avg`, `.exp_avg_sq`) keep the padded length.
//! - **stage 3**: each param is cut alone into `ceil(n / world)` pieces, the last zero-padded;
//!   rank `r` holds piece `r` of every param in `param_shapes` order (all groups in turn), spread
//!   over the sub-group tensors `fp32_flat_groups[i]` (sub-groups hold whole params). The moments
//!   (`optimizer_state_dict.state[i]`) are keyed by sub-group and sized like `fp32_flat_groups[i]`.
//!
//! `zero_stage` is a `ZeroStageEnum`, `partition_count` the world size (a list per group at stage
//! 1/2). Mapping partitions back to params is [`fsdp_state::Zero12`] / [`fsdp_state::Zero3`].
//!
//! # Reading
//!
//! Only the pickles are read; every tensor becomes byte ranges of the rank files' storage records
//! (a param spanning partitions is several ranges, in rank order), so merging is a plan of range
//! copies, run in parallel over the rank files, with memory bounded by the copy window. The few
//! tensors that need a cast (bf16 frozen params and floating buffers, which `zero_to_fp32` turns
//! into fp32) are read and cast one at a time.
//!
//! The unpickler allows, beyond torch's tensor globals, exactly the three DeepSpeed classes these
//! files contain, each kept as inert data: `ZeroStageEnum` (an `int` enum, `REDUCE(cls, (n,))`),
//! `LossScaler` (the static scaler: `NEWOBJ` + `BUILD {cur_scale, dynamic}`) and
//! `fragment_address` (a dataclass `{numel, start}`: where a param's piece sits in a partition).
//! Anything else, `DynamicLossScaler` of fp16 runs included, is refused by name.
//!
//! # Resharding
//!
//! [`reshard`] writes the checkpoint as DeepSpeed's *universal* checkpoint (the layout of
//! `ds_to_universal.py`), which DeepSpeed loads with `load_universal` on any world size; see
//! `universal.rs`. The catalog ([`catalog`]) is the merged state dict, so `inspect`, `verify`
//! and `merge` all see what `zero_to_fp32` gives.

mod read;
mod universal;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::Result;
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, TensorInfo};
use crate::read::dtype::Dtype;
use crate::write::WriteOptions;
pub(crate) use read::is_zero_checkpoint;
pub(crate) use read::ZeroCheckpoint;

/// A ZeRO checkpoint folder (with `latest`, or a tag folder of rank files).
pub(crate) fn detect(path: &Path) -> Result<Option<PathBuf>> {
    Ok(is_zero_checkpoint(path).then(|| path.to_path_buf()))
}

/// The checkpoint (at `tag`, by default `latest`'s) as the state dict `zero_to_fp32` builds, in
/// its order: persistent buffers and frozen params (floating ones as fp32, cast from how they
/// were saved), trainable params as their fp32 master weights (ranges across the rank files),
/// then the aliases of `shared_params` (an alias of a key that exists replaces it in place, as
/// a Python dict keeps an overwritten key where it was).
pub(crate) fn catalog(dir: PathBuf, tag: Option<&str>) -> Result<Scan> {
    let zero = ZeroCheckpoint::open(&dir, tag)?;
    let as_fp32 = |d: Dtype| if crate::map::cast::is_wide(d) { Dtype::F32 } else { d };
    let mut tensors: Vec<TensorInfo> = Vec::new();
    for t in zero.buffers.iter().chain(&zero.frozen) {
        let (name, shape, data) = (t.name.clone(), t.shape.clone(), t.data.clone());
        tensors.push(TensorInfo { name, dtype: as_fp32(t.dtype), shape, stored: t.dtype, data });
    }
    for p in &zero.params {
        tensors.push(TensorInfo::ranges(p.name.clone(), Dtype::F32, p.shape.clone(), p.fp32.clone()));
    }
    for (alias, target) in &zero.aliases {
        let Some(t) = tensors.iter().find(|t| &t.name == target).cloned() else { continue };
        let entry = TensorInfo { name: alias.clone(), ..t };
        match tensors.iter_mut().find(|t| &t.name == alias) {
            Some(slot) => *slot = entry,
            None => tensors.push(entry),
        }
    }
    let mut files = zero.files.clone();
    if let Some(f) = files.first_mut() {
        // zero_to_fp32 saves with `{"format": "pt"}`.
        f.metadata = vec![("format".to_string(), "pt".to_string())];
    }
    let mut parts = Parts::new(Format::DeepSpeed, dir, files, tensors);
    parts.world_size = Some(zero.world);
    // `latest`, DeepSpeed's `zero_to_fp32.py` beside it, and every file of the tag folder.
    parts.members = crate::read::io::regular_files(&parts.root)?;
    if let Some(tag_dir) = zero.files.first().and_then(|f| f.path.parent()).filter(|d| *d != parts.root) {
        parts.members.extend(crate::read::io::regular_files(tag_dir)?);
    }
    parts.zero_stage = Some(zero.stage);
    parts.detail = Some(Arc::new(zero));
    Ok(Scan::clean(Checkpoint::new(parts)?))
}

/// A DeepSpeed ZeRO checkpoint: merged as `zero_to_fp32` merges it (optionally into its shards,
/// with the Adam moments beside the weights), resharded as DeepSpeed's universal checkpoint.
pub(crate) struct DeepSpeedFormat;

impl super::FormatOps for DeepSpeedFormat {
    fn catalog(&self, _: Format, root: PathBuf, options: &crate::OpenOptions) -> Result<Scan> {
        catalog(root, options.tag.as_deref())
    }

    fn optimizer_state(&self, ck: &Checkpoint) -> Result<Vec<TensorInfo>> {
        Ok(ck.detail::<ZeroCheckpoint>().map(moments).unwrap_or_default())
    }

    fn merges_into_shards(&self) -> bool {
        true
    }

    fn reshard(&self, ck: &Checkpoint, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
        match ck.detail::<ZeroCheckpoint>() {
            Some(zero) => universal::reshard_zero(ck, zero, out, world, opts),
            None => Err(crate::Error::NotReshardable { path: ck.root.clone() }),
        }
    }
}

/// The merged Adam moments: for each trainable param, `.exp_avg` then `.exp_avg_sq`.
fn moments(zero: &ZeroCheckpoint) -> Vec<TensorInfo> {
    let mut out = Vec::with_capacity(zero.params.len() * 2);
    for p in &zero.params {
        for (suffix, chunks) in [("exp_avg", &p.exp_avg), ("exp_avg_sq", &p.exp_avg_sq)] {
            out.push(TensorInfo::ranges(format!("{}.{suffix}", p.name), Dtype::F32, p.shape.clone(), chunks.clone()));
        }
    }
    out
}

/// Writes the universal checkpoint of `source` (a ZeRO checkpoint) for `world` ranks with its
/// tag folder at `dir` and, when given, `latest_universal` naming it at `latest`: where a
/// folder that holds it lays it out (an accelerate `save_state` folder, a `Trainer` folder).
pub(crate) fn write_universal(
    source: &Checkpoint,
    dir: &Path,
    latest: Option<&Path>,
    world: u64,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    match source.detail::<ZeroCheckpoint>() {
        Some(zero) => universal::write_universal(source, zero, dir, latest, world, opts),
        None => Err(crate::Error::NotReshardable { path: source.root.clone() }),
    }
}

/// The name of the universal checkpoint's tag folder for a ZeRO checkpoint's tag `tag`.
pub(crate) fn universal_tag(source: &Checkpoint) -> Option<String> {
    source.detail::<ZeroCheckpoint>().map(universal::tag_of)
}
