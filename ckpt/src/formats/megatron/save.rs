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
//! `--finetune --no-load-optim --no-load-rng` reads nothing else of it; megatron's loader also
//! wants every `_extra_state` item the model's sharded state dict names (the local spec's are
//! `[None]`), and refuses a checkpoint without one.
//!
//! Two sources are written so: a `torch_dist` save again, as stored ([`rewrite_torch_dist`]), and
//! a Hugging Face folder, its `config.json` read into a [`crate::map::arch::ModelConfig`] and its
//! tensors mapped to megatron's stored keys by the family's table ([`from_hf`]).
//!
//! The order is megatron's: the DCP files, `.metadata`, then `metadata.json` (without which megatron
//! calls the save unfinished), then the tracker, which names the iteration only once it is whole.
//! All of it is one plan, staged and committed like every output: a kill leaves no folder or a
//! complete one.

use std::path::{Path, PathBuf};

use super::{CONFIG_NAME, TRACKER_NAME};
use crate::error::{Error, Result};
use crate::formats::dcp::metadata::PathElem;
use crate::formats::dcp::plan::{self, SrcBytes, SrcTensor, ValueData};
use crate::formats::torch::writer::{self, WNode};
use crate::ops::outcome::Outcome;
use crate::ops::RunLayout;
use crate::read::catalog::{Checkpoint, TensorInfo};
use crate::read::value::Leaf;
use crate::write::WriteOptions;

/// `metadata.json` exactly as megatron-core 0.19.2 writes it (63 bytes, no newline).
pub(crate) const CONFIG_JSON: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#;

/// The `checkpoint_version` Megatron-LM writes, and the lowest at which it loads the fused QKV
/// rows as they are.
pub(super) const CHECKPOINT_VERSION: f64 = 3.0;

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

/// The iteration folder and the tracker of a run folder `out` that is to get `iteration`,
/// refused where either is already there: a run's history is not ours to replace.
pub(super) fn new_iteration(out: &Path, iteration: u64) -> Result<(PathBuf, PathBuf)> {
    let dir = iteration_dir(out, iteration);
    let tracker = out.join(TRACKER_NAME);
    for p in [&dir, &tracker] {
        if std::fs::symlink_metadata(p).is_ok() {
            return Err(Error::OutputExists { path: p.clone(), appeared: false });
        }
    }
    Ok((dir, tracker))
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
    let (dir, tracker) = new_iteration(out, iteration)?;
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
    let abs = crate::formats::dcp::save::absolute(&dir)?;
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

/// Megatron-LM's `args` as it pickles them: an `argparse.Namespace` of these settings, in order.
pub(super) fn namespace(args: &[(String, Leaf)]) -> WNode {
    let settings = args.iter().map(|(k, v)| (WNode::Leaf(Leaf::Str(k.clone())), WNode::Leaf(v.clone())));
    WNode::Instance {
        module: "argparse".into(),
        name: "Namespace".into(),
        args: Vec::new(),
        state: Some(Box::new(WNode::Dict(settings.collect()))),
    }
}

/// Megatron-LM's common state for a run that starts from these weights: `[{"args": Namespace,
/// "checkpoint_version": 3.0, "iteration": N, "num_floating_point_operations_so_far": 0,
/// "content_metadata": {...}}]`, as `save_checkpoint` pickles it (`args` as `argparse.Namespace`
/// with the settings `args` gives, in order).
pub(crate) fn common_state(args: &[(String, Leaf)], iteration: u64) -> WNode {
    let s = |x: &str| WNode::Leaf(Leaf::Str(x.into()));
    // What megatron-core 0.19.2's Megatron-LM saves; it decides how the model's and the
    // optimizer's sharded state dicts are built on load.
    let content = WNode::Dict(vec![
        (s("singleton_local_shards"), WNode::Leaf(Leaf::Bool(false))),
        (s("chained_optim_avoid_prefix"), WNode::Leaf(Leaf::Bool(true))),
    ]);
    let iteration = i64::try_from(iteration).unwrap_or(i64::MAX);
    WNode::List(vec![WNode::Dict(vec![
        (s("args"), namespace(args)),
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

/// The keys of the (empty) `_extra_state` megatron's local spec saves for each linear of a model
/// of `config`, as megatron-core 0.19.2 keys them: per layer (and per expert) `ShardedObject`s
/// under the stacked key (`shard_<layer>_<layers>`, experts `shard_<layer>.<expert>_<layers>.<experts>`)
/// or, when layers differ, under each layer's key (`shard_0_1`, experts `shard_<expert>_<experts>`).
/// Its loader refuses a checkpoint that lacks one.
fn extra_state_keys(config: &crate::map::arch::ModelConfig) -> Vec<String> {
    use crate::map::arch::tables::Keys;
    let (layers, experts) = (config.num_layers, config.moe.as_ref().map_or(0, |m| m.num_experts));
    let shared = config.moe.as_ref().is_some_and(|m| m.shared_expert_ffn_hidden_size.is_some());
    let per_layer = Keys::of(config) == Keys::PerLayer;
    let mut keys = Vec::new();
    for layer in 0..layers {
        let (block, one) = match per_layer {
            true => (format!("decoder.layers.{layer}."), "0_1".to_string()),
            false => ("decoder.layers.".to_string(), format!("{layer}_{layers}")),
        };
        let mut put = |linear: &str, shard: &str| keys.push(format!("{block}{linear}._extra_state/shard_{shard}"));
        put("self_attention.linear_proj", &one);
        put("self_attention.linear_qkv", &one);
        if !config.is_moe_layer(layer) {
            put("mlp.linear_fc1", &one);
            put("mlp.linear_fc2", &one);
            continue;
        }
        for fc in ["linear_fc1", "linear_fc2"] {
            for expert in 0..experts {
                let shard = match per_layer {
                    true => format!("{expert}_{experts}"),
                    false => format!("{layer}.{expert}_{layers}.{experts}"),
                };
                put(&format!("mlp.experts.experts.{fc}"), &shard);
            }
        }
        if shared {
            put("mlp.shared_experts.linear_fc1", &one);
            put("mlp.shared_experts.linear_fc2", &one);
        }
    }
    keys
}

/// A Hugging Face folder (its `config.json` beside the weights) written as a Megatron-LM run
/// folder at iteration 0: the family's tables map the Hub tensors to megatron's stored keys
/// (fused QKV per query group, `[gate; up]`, stacked layers; [`crate::map::arch::tables`]), the
/// `args` say the model under Megatron-LM's names, and each linear gets the empty `_extra_state`
/// megatron's local spec saves ([`extra_state_keys`]). In the legacy layout, the tables map the
/// Hub tensors to the one-rank model's names instead, which [`super::legacy_save`] cuts.
pub(crate) fn from_hf(ck: &Checkpoint, out: &Path, layout: RunLayout, opts: &WriteOptions<'_>) -> Result<Outcome> {
    use crate::map::arch::{hf_config, tables};
    let folder =
        if ck.root.is_dir() { ck.root.clone() } else { ck.root.parent().unwrap_or(Path::new(".")).to_path_buf() };
    let path = folder.join("config.json");
    if !path.is_file() {
        let problem = crate::HfConfigProblem::NoConfig;
        return Err(Error::BadHfConfig { path, key: "config.json".into(), problem });
    }
    let data = crate::read::io::read_capped(&path, hf_config::MAX_CONFIG_LEN)?;
    let (config, arch) = hf_config::parse(&path, &data)?;
    if let Some((setting, value)) = arch.mismatch(&config) {
        return Err(Error::NoHfArchitecture { path, arch: Some(arch.name()), setting, value });
    }
    let keys = match layout {
        RunLayout::TorchDist => tables::Keys::of(&config),
        RunLayout::Legacy(_) => tables::Keys::OneRank,
    };
    let mapped = tables::from_hf(&ck.root, &config, arch, keys, &ck.tensors)?.apply(&ck.root, &ck.tensors)?;
    match layout {
        RunLayout::TorchDist => write_model_run(ck, &config, mapped, 0, out, opts),
        RunLayout::Legacy(parallel) => {
            let model = super::legacy_save::Model::of_config(&config);
            super::legacy_save::write(ck, &model, &mapped, parallel, 0, out, opts)
        }
    }
}

/// A Megatron checkpoint written as a run folder in `layout`, at its own iteration: a
/// `torch_dist` save as stored ([`rewrite_torch_dist`]); a legacy save's one-rank model stacked
/// into the keys a `torch_dist` save of its model stores, or either cut into legacy ranks. The
/// latter two need the model its saved `args` describe ([`super::config::model_config`]).
pub(crate) fn from_megatron(
    ck: &Checkpoint,
    out: &Path,
    layout: RunLayout,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    if layout == RunLayout::TorchDist && ck.format == crate::read::catalog::Format::MegatronTorchDist {
        return rewrite_torch_dist(ck, out, opts);
    }
    let Some(m) = ck.detail::<super::info::Megatron>() else {
        return Err(crate::formats::not_for_format(crate::Opt::To, ck));
    };
    let iteration = m.meta.iteration.unwrap_or(0);
    match layout {
        RunLayout::TorchDist => {
            use crate::map::arch::{tables, Arch};
            let config = super::config::model_config(ck)?;
            let arch = Arch::recognized(&config, &ck.root)?;
            let map = tables::from_one_rank(&ck.root, &config, arch, &ck.tensors)?;
            let stored = map.apply(&ck.root, &ck.tensors)?;
            write_model_run(ck, &config, stored, iteration, out, opts)
        }
        RunLayout::Legacy(parallel) => {
            use super::legacy_save::{write, Model};
            // The saved `args` as a family reads them where one does (norms, rotary base, MoE
            // settings), else what megatron's own keys and `args` say of the layout.
            let model = match super::config::model_config(ck) {
                Ok(config) => Model::of_config(&config),
                Err(_) => Model::of_megatron(ck, &m.meta, &ck.tensors)?,
            };
            write(ck, &model, &ck.tensors, parallel, iteration, out, opts)
        }
    }
}

/// The stored tensors of a model of `config` written as a run folder at `iteration`, with the
/// common state of a run (`args` from `config`) and the `_extra_state` items megatron's loader
/// wants.
fn write_model_run(
    ck: &Checkpoint,
    config: &crate::map::arch::ModelConfig,
    stored: Vec<TensorInfo>,
    iteration: u64,
    out: &Path,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let tensors = stored.into_iter().map(|t| RunTensor { key: t.name.clone(), info: t }).collect();
    let one = crate::ModelParallel { tensor: 1, pipeline: 1, expert: 1 };
    let args: Vec<_> = config_args(config).into_iter().chain(parallel_args(one)).collect();
    let mut values =
        vec![RunValue::Written { key: COMMON_STATE_KEY.to_string(), value: common_state(&args, iteration) }];
    for key in extra_state_keys(config) {
        values.push(RunValue::Written { key, value: WNode::List(vec![WNode::Leaf(Leaf::None)]) });
    }
    write_run(ck, tensors, values, out, iteration, opts)
}

/// Megatron-LM's `args` for the model-parallel sizes `parallel`.
pub(crate) fn parallel_args(parallel: crate::ModelParallel) -> Vec<(String, Leaf)> {
    let int = |v: u64| Leaf::Int(i64::try_from(v).unwrap_or(i64::MAX));
    vec![
        ("tensor_model_parallel_size".to_string(), int(parallel.tensor)),
        ("pipeline_model_parallel_size".to_string(), int(parallel.pipeline)),
        ("expert_model_parallel_size".to_string(), int(parallel.expert)),
    ]
}

/// Megatron-LM's `args` for a model of `config`, under its argument names (the parallel sizes
/// are [`parallel_args`]).
pub(crate) fn config_args(c: &crate::map::arch::ModelConfig) -> Vec<(String, Leaf)> {
    use crate::map::arch::NormKind;
    let int = |v: u64| Leaf::Int(i64::try_from(v).unwrap_or(i64::MAX));
    let s = |v: &str| Leaf::Str(v.to_string());
    let mut args = vec![
        ("num_layers", int(c.num_layers)),
        ("hidden_size", int(c.hidden_size)),
        ("ffn_hidden_size", int(c.ffn_hidden_size)),
        ("num_attention_heads", int(c.num_attention_heads)),
        ("group_query_attention", Leaf::Bool(c.num_query_groups != c.num_attention_heads)),
        ("num_query_groups", int(c.num_query_groups)),
        ("kv_channels", int(c.head_dim)),
        ("max_position_embeddings", int(c.max_position_embeddings)),
        ("padded_vocab_size", int(c.vocab_size)),
        ("normalization", s(if c.norm == NormKind::RmsNorm { "RMSNorm" } else { "LayerNorm" })),
        ("norm_epsilon", Leaf::Float(c.norm_eps)),
        ("swiglu", Leaf::Bool(c.swiglu)),
        ("untie_embeddings_and_output_weights", Leaf::Bool(!c.tied_embeddings)),
        ("add_bias_linear", Leaf::Bool(false)),
        ("add_qkv_bias", Leaf::Bool(c.qkv_bias)),
        ("qk_layernorm", Leaf::Bool(c.qk_norm)),
        ("position_embedding_type", s("rope")),
        ("rotary_base", Leaf::Float(c.rope_theta)),
        ("bf16", Leaf::Bool(c.dtype == crate::Dtype::BF16)),
        ("fp16", Leaf::Bool(c.dtype == crate::Dtype::F16)),
    ];
    if let Some(m) = &c.moe {
        args.extend([
            ("num_experts", int(m.num_experts)),
            ("moe_router_topk", int(m.top_k)),
            ("moe_ffn_hidden_size", int(m.ffn_hidden_size)),
            ("moe_layer_freq", Leaf::List(m.moe_layers.iter().map(|&x| int(u64::from(x))).collect())),
            // Softmax over every expert before the top-k keeps each one's share of all of them:
            // the top-k weights are not renormalized (`norm_topk_prob` off).
            ("moe_router_pre_softmax", Leaf::Bool(!m.norm_topk_prob)),
        ]);
        if let Some(shared) = m.shared_expert_ffn_hidden_size {
            args.push(("moe_shared_expert_intermediate_size", int(shared)));
            args.push(("moe_shared_expert_gate", Leaf::Bool(m.shared_expert_gate)));
        }
    }
    args.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::path::PathBuf;

    use super::*;
    use crate::map::arch::{hf_config, tables};

    fn hf(arch: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron_arch/hf").join(arch)
    }

    /// transformers' folders written as Megatron runs and read back through the tables'
    /// Megatron → Hub map: every Hub tensor bit for bit, under its own name.
    #[test]
    fn a_hugging_face_model_comes_back_from_its_megatron_run_bit_for_bit() {
        for arch in ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"] {
            let tmp = tempfile::tempdir().unwrap();
            let src = Checkpoint::open(hf(arch).to_str().unwrap()).unwrap();
            let out = tmp.path().join("run");
            let options = crate::ConvertOptions { to: Some(crate::TargetFormat::Megatron), ..Default::default() };
            crate::convert(&src, &out, &options, &WriteOptions::default()).unwrap();
            let run = Checkpoint::open(out.to_str().unwrap()).unwrap();
            let config = hf(arch).join("config.json");
            let (model, family) = hf_config::parse(&config, &std::fs::read(&config).unwrap()).unwrap();
            let map = tables::to_hf(&run.root, &model, family, None, &run.tensors).unwrap();
            let back = map.apply(&run.root, &run.tensors).unwrap();
            let tied = model.tied_embeddings.then_some("lm_head.weight");
            let want: Vec<&TensorInfo> = src.tensors.iter().filter(|t| Some(t.name.as_str()) != tied).collect();
            assert_eq!(back.len(), want.len(), "{arch}");
            for t in want {
                let got = back.iter().find(|b| b.name == t.name).unwrap_or_else(|| panic!("{arch}: {}", t.name));
                assert_eq!((got.dtype, &got.shape), (t.dtype, &t.shape), "{arch}: {}", t.name);
                assert_eq!(run.read_tensor(got).unwrap(), src.read_tensor(t).unwrap(), "{arch}: {}", t.name);
            }
            // The run says the model under Megatron-LM's names.
            let m = run.megatron().unwrap();
            assert_eq!(m.num_layers, Some(model.num_layers), "{arch}");
            assert_eq!(m.num_query_groups, Some(model.num_query_groups), "{arch}");
            assert_eq!(m.tied_embeddings, Some(model.tied_embeddings), "{arch}");
        }
    }

    #[test]
    fn a_folder_without_config_json_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("model.safetensors");
        std::fs::copy(hf("qwen3").join("model.safetensors"), &file).unwrap();
        let src = Checkpoint::open(file.to_str().unwrap()).unwrap();
        let options = crate::ConvertOptions { to: Some(crate::TargetFormat::Megatron), ..Default::default() };
        let err = crate::convert(&src, &tmp.path().join("run"), &options, &WriteOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("config.json") && msg.contains("is missing"), "{msg}");
        assert!(!tmp.path().join("run").exists());
    }
}
