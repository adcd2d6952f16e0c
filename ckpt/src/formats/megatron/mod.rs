//! Megatron-Core checkpoints, read without Megatron: `torch_dist` folders and legacy per-rank
//! saves.
//!
//! # On disk
//!
//! A Megatron-LM run saves into `SAVE/iter_NNNNNNN/` (seven digits; `release/` for a released
//! model) and then writes `SAVE/latest_checkpointed_iteration.txt`, the iteration as text (or
//! `release`). The iteration folder holds one of two layouts:
//!
//! - **`torch_dist`** (`--ckpt-format torch_dist`, the default): a torch DCP folder
//!   (`.metadata`, `__R_K.distcp`) plus `metadata.json`, `{"sharded_backend": "torch_dist", ...}`,
//!   which megatron writes after everything else: without it the save did not finish. Tensors
//!   are stored under megatron's checkpoint keys with their global shapes. Layers that are all
//!   alike are one stacked tensor per key without the layer number
//!   (`decoder.layers.self_attention.linear_qkv.weight`), its leading axis the global layer index
//!   across pipeline stages; norms that TransformerEngine fuses into the next linear are stored
//!   under TransformerEngine's names (`linear_qkv.layer_norm_weight` is the layer's
//!   `input_layernorm.weight`), whatever spec the model was built with. Tensor parallel pieces
//!   are DCP chunks of the global tensor; a SwiGLU `linear_fc1` rank writes its two halves as
//!   two chunks, so the global tensor is `[W; V]` as on one rank. Everything that is not a
//!   tensor (`args`, `iteration`, the optimizer's param groups, `_extra_state`) is a DCP bytes
//!   item `KEY/shard_<offsets>_<shape>`, a `torch.save` of the value; `common_state/shard_0_1`
//!   holds the rest of the saved dict. The `.metadata` pickle carries megatron's extra
//!   attribute `all_local_plans` (every rank's save plan), read here as opaque records.
//!   Mixture-of-experts layers store `SequentialMLP`'s experts with one more stacked axis, the
//!   global expert index (`decoder.layers.mlp.experts.experts.linear_fc1.weight` of shape
//!   `[L, E, 2f, h]`), each expert-parallel rank writing its experts at their global index; a
//!   model whose layers differ (a dense first layer, `--moe-layer-freq` as a list) stores every
//!   layer under its own number instead (`decoder.layers.3.mlp.router.weight`). The optimizer of
//!   an MoE run is chained: `chained_0.` before the dense optimizer's keys, `chained_1.` before
//!   the experts'.
//! - **legacy** (`--ckpt-format torch`): one `torch.save` per model-parallel rank,
//!   `mp_rank_TT/model_optim_rng.pt` (`_PPP` appended with pipeline parallelism, `_EEE` with
//!   expert parallelism), each holding that rank's local pieces under module names with
//!   chunk-local layer numbers (`model`, or `model0`, `model1`, ... with virtual pipeline
//!   stages) and rank-local expert numbers.
//!
//! With virtual pipeline stages or uneven first and last stages, a `torch_dist` save needs
//! nothing more: its stacked axis is already the global layer index megatron computed. A legacy
//! save's chunks are placed by megatron's `get_transformer_layer_offset` ([`stages`]).
//!
//! # Here
//!
//! [`detect`] accepts the run folder, an iteration folder, or the DCP folder itself. A
//! `torch_dist` checkpoint is read by the DCP reader into its stored tensors; the catalog then
//! shows the model as megatron holds it on one rank ([`names`]): layers unstacked by their
//! global index, norms under their module names, `_extra_state` left out. With
//! [`crate::OpenOptions::as_stored`] it shows the stored tensors under their stored keys, as
//! torch's `dcp_to_torch_save` gives them. Both views, and a legacy save's stitching of its
//! ranks' pieces, are model maps ([`crate::map::model`]) over the tensors as stored, applied
//! and checked like any other catalog.
//!
//! What model a save holds, format-neutral ([`crate::ModelConfig`]), comes from the saved `args`
//! ([`config`]); the architecture tables ([`crate::map::arch`]) turn the one-rank model into a
//! Hugging Face one from it (`convert --to hf`).
//!
//! [`save`] writes a Megatron-LM run folder (`convert --to megatron`): megatron's stored keys
//! and global shapes, each tensor whole, with the common state Megatron-LM's `load_checkpoint`
//! reads, so that megatron loads it at any parallel layout.

mod buckets;
mod chained;
mod config;
#[doc(hidden)]
pub(crate) mod fuzz;
mod info;
mod legacy;
mod legacy_save;
pub(crate) mod names;
mod optimizer;
mod rank_folders;
pub(crate) mod save;
mod stages;
mod torch_dist;

pub use info::MegatronInfo;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::formats::dcp;
use crate::read::catalog::{Checkpoint, Format, Scan, TensorInfo};
use crate::report::describe::Description;

/// The file a Megatron-LM run writes last, naming its newest complete iteration.
pub(crate) const TRACKER_NAME: &str = "latest_checkpointed_iteration.txt";
/// The file megatron writes last into a `dist_checkpointing` folder.
pub(crate) const CONFIG_NAME: &str = "metadata.json";
/// The longest tracker we read: an iteration number or `release`, and a newline.
const MAX_TRACKER_LEN: u64 = 64;
/// The longest `metadata.json` we read (megatron's is under 100 bytes).
const MAX_CONFIG_LEN: u64 = 1 << 16;

/// What a `torch_dist` folder pickles beyond a plain DCP folder: in `.metadata`, megatron's
/// `all_local_plans` (every rank's save plan, kept to check a later save against) and the
/// placeholder classes older megatron versions pickled there, records nobody reads; in its
/// values, the saved `args` ([`SAVE_GLOBALS`]). A plain DCP folder naming any of these is
/// refused.
const DCP_CLASSES: dcp::Classes = dcp::Classes {
    metadata: dcp::metadata_classes!(
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.WriteItemType",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
        "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
    ),
    values: SAVE_GLOBALS,
};

/// The globals a Megatron-LM save pickles besides torch's weights-only list: the saved
/// `args` and the enums its fields hold, all read as inert records.
pub(crate) const SAVE_GLOBALS: &[&str] = &[
    // `args`, and the enums Megatron-LM's arguments hold (`attention_backend`, `exit_signal`,
    // `fp8_recipe`, the CUDA graph scopes, ...).
    "argparse.Namespace",
    "signal.Signals",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    // The rerun state machine's saved state.
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunValidationStatus",
    // `rng_state`'s numpy generator state.
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "numpy.ndarray",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    // The rest of what megatron itself admits when it loads its own saves
    // (`megatron/core/safe_globals.py`): configs, paths, TransformerEngine's extra state as
    // bytes, generators.
    "types.SimpleNamespace",
    "pathlib.PosixPath",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "_io.BytesIO",
    "io.BytesIO",
    "torch._C.Generator",
];

/// Where a Megatron checkpoint is: the iteration folder, and the tracker that named it.
#[derive(Clone, Debug)]
pub(crate) struct Location {
    /// The folder holding the checkpoint itself (`iter_NNNNNNN/`, or the DCP folder).
    pub dir: PathBuf,
    /// The run's tracker, when the path named the run folder.
    pub tracker: Option<PathBuf>,
    /// The iteration the tracker or the folder's name gives.
    pub iteration: Option<u64>,
}

/// The Megatron `torch_dist` checkpoint `path` names: a run folder (with its tracker), an
/// iteration folder, or the DCP folder, holding `metadata.json` with backend `torch_dist`. A run
/// folder whose tracker leads nowhere complete is one too: reading it says what is wrong.
pub(crate) fn detect_torch_dist(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_dir() && path.join(TRACKER_NAME).is_file() {
        let legacy = locate(path).ok().flatten().is_some_and(|loc| legacy::is_legacy(&loc.dir));
        return Ok((!legacy).then(|| path.to_path_buf()));
    }
    Ok(is_torch_dist(path)?.then(|| path.to_path_buf()))
}

/// The Megatron legacy save `path` names: a run folder whose tracker names one, or an
/// iteration folder holding `mp_rank_*/model_optim_rng.pt`.
pub(crate) fn detect_legacy(path: &Path) -> Result<Option<PathBuf>> {
    let Some(loc) = locate(path).ok().flatten() else { return Ok(None) };
    Ok(legacy::is_legacy(&loc.dir).then(|| path.to_path_buf()))
}

/// Resolves a run folder through its tracker; any other folder is the checkpoint folder.
pub(crate) fn locate(path: &Path) -> Result<Option<Location>> {
    if !path.is_dir() {
        return Ok(None);
    }
    let tracker = path.join(TRACKER_NAME);
    if !tracker.is_file() {
        let iteration = path.file_name().and_then(|n| n.to_str()).and_then(iteration_of);
        return Ok(Some(Location { dir: path.to_path_buf(), tracker: None, iteration }));
    }
    let text = crate::read::io::read_capped(&tracker, MAX_TRACKER_LEN)?;
    let Tracked { named, folder, iteration } = parse_tracker(&text, &tracker)?;
    let dir = path.join(&folder);
    if !dir.is_dir() {
        let reason = format!("the tracker names iteration `{named}`, but `{folder}` is not there");
        return Err(Error::BadMegatron { path: tracker, key: None, rank: None, reason });
    }
    Ok(Some(Location { dir, tracker: Some(tracker), iteration }))
}

/// What a tracker names.
#[derive(Debug)]
pub(super) struct Tracked {
    /// The iteration as the tracker writes it (`7`, `release`).
    pub named: String,
    /// The folder it names: `iter_NNNNNNN` or `release`.
    pub folder: String,
    pub iteration: Option<u64>,
}

/// The tracker's text read: an iteration number or `release`, around which only whitespace.
pub(super) fn parse_tracker(text: &[u8], tracker: &Path) -> Result<Tracked> {
    let bad = |reason: String| Error::BadMegatron { path: tracker.to_path_buf(), key: None, rank: None, reason };
    let text = std::str::from_utf8(text).map_err(|_| bad("the tracker is not text".into()))?.trim();
    let named = text.to_string();
    match text {
        "release" => Ok(Tracked { named, folder: "release".to_string(), iteration: None }),
        n => match n.parse::<u64>() {
            Ok(i) => Ok(Tracked { named, folder: format!("iter_{i:07}"), iteration: Some(i) }),
            Err(_) => {
                Err(bad(format!("the tracker holds `{}`, not an iteration number or `release`", n.escape_debug())))
            }
        },
    }
}

/// The iteration of a folder named `iter_NNNNNNN`.
pub(super) fn iteration_of(name: &str) -> Option<u64> {
    name.strip_prefix("iter_").filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))?.parse().ok()
}

/// True when `dir` holds megatron's `metadata.json` naming the `torch_dist` backend.
fn is_torch_dist(dir: &Path) -> Result<bool> {
    let config = dir.join(CONFIG_NAME);
    if !config.is_file() {
        return Ok(false);
    }
    let data = crate::read::io::read_capped(&config, MAX_CONFIG_LEN)?;
    parse_config(&data, &config)
}

/// True when megatron's `metadata.json` (read from `config`) names the `torch_dist` backend.
pub(super) fn parse_config(data: &[u8], config: &Path) -> Result<bool> {
    let bad = |reason: String| Error::BadMegatron { path: config.to_path_buf(), key: None, rank: None, reason };
    let json: serde_json::Value = serde_json::from_slice(data).map_err(|e| bad(format!("not JSON: {e}")))?;
    match json.get("sharded_backend").and_then(|b| b.as_str()) {
        Some("torch_dist") => Ok(true),
        // A DCP folder with someone else's `metadata.json` is still a DCP folder.
        None => Ok(false),
        Some(other) => {
            Err(bad(format!("the checkpoint's backend is `{}`; only `torch_dist` is read", other.escape_debug())))
        }
    }
}

/// Megatron's checkpoints, `torch_dist` and legacy: merged as the model one rank holds (the
/// catalog as stored), with the distributed optimizer's state per parameter beside it; not
/// laid out for ranks again.
pub(crate) struct MegatronFormat;

impl super::FormatOps for MegatronFormat {
    fn describe(&self, ck: &Checkpoint) -> Description {
        describe(ck)
    }

    /// A `torch_dist` save stores its tensors other than as the model (stacked layers, its own
    /// keys), which `as_stored` shows; a legacy save stores the ranks' own pieces.
    fn takes(&self, format: Format, option: crate::Opt) -> bool {
        format == Format::MegatronTorchDist && option == crate::Opt::AsStored
    }

    fn catalog(&self, format: Format, root: PathBuf, options: &crate::OpenOptions) -> Result<Scan> {
        match format {
            Format::MegatronLegacy => catalog_legacy(root),
            _ => catalog_torch_dist(root, options.as_stored),
        }
    }

    fn optimizer_state(&self, ck: &Checkpoint) -> Result<Vec<TensorInfo>> {
        optimizer::optimizer_state(ck)
    }

    /// A `torch_dist` save is written again as stored; a legacy save's one-rank model is stacked
    /// into megatron's global keys; either is cut into a legacy layout's ranks.
    fn to_megatron(
        &self,
        ck: &Checkpoint,
        out: &Path,
        layout: crate::ops::RunLayout,
        opts: &crate::WriteOptions<'_>,
    ) -> Result<crate::Outcome> {
        save::from_megatron(ck, out, layout, opts)
    }

    fn model_config(&self, ck: &Checkpoint) -> Result<crate::map::arch::ModelConfig> {
        config::model_config(ck)
    }
}

/// The catalog view of the `torch_dist` checkpoint `root` names.
pub(crate) fn catalog_torch_dist(root: PathBuf, as_stored: bool) -> Result<Scan> {
    let Some(loc) = locate(&root)? else {
        return Err(Error::NotACheckpoint { path: root });
    };
    if !is_torch_dist(&loc.dir)? {
        let what = if loc.dir.join(crate::formats::dcp::METADATA_NAME).is_file() {
            format!("has no `{CONFIG_NAME}`: its save did not finish")
        } else {
            "holds neither a `torch_dist` nor a legacy checkpoint".to_string()
        };
        let path = loc.tracker.clone().unwrap_or_else(|| loc.dir.clone());
        let reason = format!("the tracker names `{}`, which {what}", loc.dir.display());
        return Err(Error::BadMegatron { path, key: None, rank: None, reason });
    }
    torch_dist::catalog(root, loc, as_stored)
}

/// The catalog view of the legacy save `root` names.
pub(crate) fn catalog_legacy(root: PathBuf) -> Result<Scan> {
    let Some(loc) = locate(&root)? else {
        return Err(Error::NotACheckpoint { path: root });
    };
    legacy::catalog(root, loc)
}

/// What `inspect` shows of a Megatron checkpoint (see [`info::description`]).
pub(crate) fn describe(ck: &crate::Checkpoint) -> Description {
    match ck.megatron() {
        Some(m) => info::description(m),
        None => Description::of_files(ck),
    }
}

impl crate::Checkpoint {
    /// What a Megatron-Core checkpoint says of its run and model, when this is one.
    pub fn megatron(&self) -> Option<&MegatronInfo> {
        self.detail::<info::Megatron>().map(|m| &m.meta)
    }
}
