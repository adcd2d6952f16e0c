//! Writing a Megatron-LM `torch_dist` run folder, which megatron-core loads at any tensor,
//! pipeline and expert parallel size.
//!
//! # On disk
//!
//! ```text
//! OUT/iter_NNNNNNN/__0_0.distcp      the DCP items: each tensor whole, then the values
//! OUT/iter_NNNNNNN/.metadata         torch's DCP `Metadata` pickle
//! OUT/iter_NNNNNNN/metadata.json     {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
//! OUT/latest_checkpointed_iteration.txt   the iteration as text, no newline
//! ```
//!
//! The tensors are megatron's stored keys with their global shapes (a stacked layer axis for a
//! block of alike layers), each saved whole as one chunk: DCP's loader reads any region of any
//! chunk, so every parallel layout megatron builds finds its slices, and nothing of one layout
//! is baked in. The values are DCP bytes items under megatron's `ShardedObject` keys
//! (`KEY/shard_<offsets>_<shape>`), each a `torch.save` of a one-item list; `common_state/shard_0_1`
//! holds what Megatron-LM's `load_checkpoint` reads besides the model: `checkpoint_version` (3.0:
//! an absent version makes it reorder the fused QKV rows of checkpoints older than 2.0),
//! `iteration`, `args` (an `argparse.Namespace`) and `content_metadata`. A run started with
//! `--finetune --no-load-optim --no-load-rng` reads nothing else.
//!
//! The order is megatron's: the DCP files, `.metadata`, then `metadata.json` (without which megatron
//! calls the save unfinished), then the tracker, which names the iteration only once it is whole.
//! All of it is one plan, staged and committed like every output: a kill leaves no folder or a
//! complete one.

use std::path::{Path, PathBuf};

use super::{CONFIG_NAME, TRACKER_NAME};
use crate::error::{Error, IoContext, Result};
use crate::formats::dcp::metadata::PathElem;
use crate::formats::dcp::plan::{self, SrcBytes, SrcTensor, ValueData};
use crate::formats::torch::writer::{self, WNode};
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, TensorInfo};
use crate::read::value::Leaf;
use crate::write::WriteOptions;

/// `metadata.json` exactly as megatron-core 0.19.2 writes it (63 bytes, no newline).
pub(crate) const CONFIG_JSON: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#;

/// The `checkpoint_version` Megatron-LM writes, and the lowest at which it loads the fused QKV
/// rows as they are.
const CHECKPOINT_VERSION: f64 = 3.0;

/// The key of megatron's common state item.
pub(crate) const COMMON_STATE_KEY: &str = "common_state/shard_0_1";

/// A tensor of the run: its stored key, and the catalog tensor whose bytes it is.
pub(crate) struct RunTensor {
    pub key: String,
    pub info: TensorInfo,
}

/// A value of the run, under its `ShardedObject` key.
pub(crate) enum RunValue {
    /// A bytes item of a `torch_dist` source, copied byte for byte.
    Copied { key: String, chunk: crate::read::catalog::Chunk },
    /// A value written here.
    Written { key: String, value: WNode },
}

/// The iteration folder of `iteration` in the run folder `out`.
pub(crate) fn iteration_dir(out: &Path, iteration: u64) -> PathBuf {
    out.join(format!("iter_{iteration:07}"))
}

/// Writes `tensors` and `values` (bytes read from `ck`'s files) as the Megatron-LM run folder
/// `out` at `iteration`. A run folder that already has this iteration or a tracker is refused:
/// a run's history is not ours to replace.
pub(crate) fn write_run(
    ck: &Checkpoint,
    tensors: Vec<RunTensor>,
    values: Vec<RunValue>,
    out: &Path,
    iteration: u64,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let dir = iteration_dir(out, iteration);
    let tracker = out.join(TRACKER_NAME);
    for p in [&dir, &tracker] {
        if std::fs::symlink_metadata(p).is_ok() {
            return Err(Error::OutputExists { path: p.clone(), appeared: false });
        }
    }
    let tensors: Vec<SrcTensor> = tensors
        .into_iter()
        .map(|t| SrcTensor {
            path: vec![PathElem::Key(t.key.clone())],
            key: t.key,
            // Bytes are written as stored.
            info: TensorInfo { dtype: t.info.stored, ..t.info },
            sharded: false,
        })
        .collect();
    let mut items = Vec::with_capacity(values.len());
    for v in values {
        let (key, data) = match v {
            RunValue::Copied { key, chunk } => (key, ValueData::Copied(chunk)),
            RunValue::Written { key, value } => {
                let layout = writer::layout_node("archive", &value, &dir)?;
                (key, ValueData::Pickled(layout))
            }
        };
        items.push(SrcBytes { path: vec![PathElem::Key(key.clone())], key, data });
    }
    let abs = absolute(&dir)?;
    let plan::Planned { mut plan, bytes } = plan::plan_dcp(&tensors, &items, &dir, &abs, 1)?;
    plan.trailers.push((dir.join(CONFIG_NAME), CONFIG_JSON.as_bytes().to_vec()));
    plan.trailers.push((tracker, iteration.to_string().into_bytes()));
    crate::write::execute::execute(&plan, ck, opts)?;
    Ok(Outcome {
        files: plan.outputs(),
        tensors: tensors.len(),
        bytes,
        values: items.iter().map(|v| v.key.clone()).collect(),
        world_size: Some(1),
        ..Outcome::default()
    })
}

/// `path` made absolute through its nearest existing folder's real path, as `.metadata`
/// records the folder (which does not exist yet).
fn absolute(path: &Path) -> Result<PathBuf> {
    let abs = std::path::absolute(path).at(path)?;
    let mut rest = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            return Ok(rest.iter().rev().fold(real, |p, n| p.join(n)));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return Ok(abs),
        }
    }
}

/// Megatron-LM's common state for a run that starts from these weights: `[{"args": Namespace,
/// "checkpoint_version": 3.0, "iteration": N, "num_floating_point_operations_so_far": 0,
/// "content_metadata": {...}}]`, as `save_checkpoint` pickles it (`args` as `argparse.Namespace`
/// with the settings `args` gives, in order).
pub(crate) fn common_state(args: &[(String, Leaf)], iteration: u64) -> WNode {
    let s = |x: &str| WNode::Leaf(Leaf::Str(x.into()));
    let namespace = WNode::Instance {
        module: "argparse".into(),
        name: "Namespace".into(),
        args: Vec::new(),
        state: Some(Box::new(WNode::Dict(args.iter().map(|(k, v)| (s(k), WNode::Leaf(v.clone()))).collect()))),
    };
    // What megatron-core 0.19.2's Megatron-LM saves; it decides how the model's and the
    // optimizer's sharded state dicts are built on load.
    let content = WNode::Dict(vec![
        (s("singleton_local_shards"), WNode::Leaf(Leaf::Bool(false))),
        (s("chained_optim_avoid_prefix"), WNode::Leaf(Leaf::Bool(true))),
    ]);
    let iteration = i64::try_from(iteration).unwrap_or(i64::MAX);
    WNode::List(vec![WNode::Dict(vec![
        (s("args"), namespace),
        (s("checkpoint_version"), WNode::Leaf(Leaf::Float(CHECKPOINT_VERSION))),
        (s("iteration"), WNode::Leaf(Leaf::Int(iteration))),
        (s("num_floating_point_operations_so_far"), WNode::Leaf(Leaf::Int(0))),
        (s("content_metadata"), content),
    ])])
}

/// A `torch_dist` source written again as a run folder: every stored tensor and value as
/// stored, bit for bit, at the source's iteration (0 when it names none). A folder that
/// `dist_checkpointing.save` wrote alone, not Megatron-LM's `save_checkpoint`, has a
/// `common_state` without `checkpoint_version` (`[{}]`), which would make Megatron-LM reorder the
/// fused QKV rows as a pre-2.0 checkpoint's: it gets the common state of a run instead, its
/// `args` what the tensors say of the model.
pub(crate) fn rewrite_torch_dist(ck: &Checkpoint, out: &Path, opts: &WriteOptions<'_>) -> Result<Outcome> {
    let Some(m) = ck.detail::<super::info::Megatron>() else {
        return Err(crate::formats::not_for_format(crate::Opt::To, ck));
    };
    let Some(dcp) = &m.dcp else {
        return Err(crate::formats::not_for_format(crate::Opt::To, ck));
    };
    let iteration = m.meta.iteration.unwrap_or(0);
    // The tensors a value holds (`rng_state`'s generator states) are read as tensors of their
    // own, named under the value's key; they are written inside the value, as they came.
    let keys: std::collections::HashSet<&str> = dcp.bytes.iter().map(|b| b.key.as_str()).collect();
    let in_value = |key: &str| key.match_indices('.').any(|(i, _)| keys.contains(&key[..i]));
    let tensors = dcp
        .tensors
        .iter()
        .filter(|t| !in_value(&t.key))
        .map(|t| RunTensor { key: t.key.clone(), info: super::torch_dist::as_stored(t) });
    let is_run = |v: &Leaf| super::info::lookup(super::info::saved_dict(v), &["checkpoint_version"]).is_some();
    let mut values: Vec<RunValue> = dcp
        .bytes
        .iter()
        .filter(|b| b.key != COMMON_STATE_KEY || is_run(&b.value))
        .map(|b| RunValue::Copied { key: b.key.clone(), chunk: b.chunk })
        .collect();
    if !dcp.bytes.iter().any(|b| b.key == COMMON_STATE_KEY && is_run(&b.value)) {
        let value = common_state(&model_args(&m.meta), iteration);
        values.push(RunValue::Written { key: COMMON_STATE_KEY.to_string(), value });
    }
    write_run(ck, tensors.collect(), values, out, iteration, opts)
}

/// Megatron-LM's `args` for what `meta` knows of the model, under Megatron-LM's names.
pub(crate) fn model_args(meta: &super::MegatronInfo) -> Vec<(String, Leaf)> {
    let int = |v: u64| Leaf::Int(i64::try_from(v).unwrap_or(i64::MAX));
    let mut args = Vec::new();
    let mut put = |name: &str, v: Option<Leaf>| {
        if let Some(v) = v {
            args.push((name.to_string(), v));
        }
    };
    put("num_layers", meta.num_layers.map(int));
    put("hidden_size", meta.hidden_size.map(int));
    put("ffn_hidden_size", meta.ffn_hidden_size.map(int));
    put("num_attention_heads", meta.num_attention_heads.map(int));
    let gqa = meta.num_query_groups.zip(meta.num_attention_heads).map(|(g, h)| g != h);
    put("group_query_attention", gqa.map(Leaf::Bool));
    put("num_query_groups", meta.num_query_groups.map(int));
    put("swiglu", meta.swiglu.map(Leaf::Bool));
    put("untie_embeddings_and_output_weights", meta.tied_embeddings.map(|t| Leaf::Bool(!t)));
    args
}
