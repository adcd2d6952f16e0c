//! Writing Megatron-LM's legacy per-rank layout (`--ckpt-format torch`) for a chosen tensor,
//! pipeline and expert parallel size: the one-rank model cut as megatron's parallel layers cut
//! it, the inverse of [`super::legacy`]'s stitching.
//!
//! # On disk
//!
//! ```text
//! OUT/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   one torch.save per rank
//! OUT/latest_checkpointed_iteration.txt                        the iteration, written last
//! ```
//!
//! `_PPP` is in the folder name only with pipeline parallelism, `_EEE` only with expert
//! parallelism (megatron's `get_checkpoint_name`). Each file is `{args, checkpoint_version,
//! iteration, model, num_floating_point_operations_so_far}`: `args` an `argparse.Namespace` of
//! the model and this layout, `checkpoint_version` 3.0 (below 2.0 megatron would reorder the
//! fused QKV rows), and `model` the rank's module state dict:
//!
//! - a pipeline stage holds `num_layers / P` consecutive layers, numbered from 0 within it;
//!   the first stage the word embeddings, the last the final norm and the output layer (a
//!   tied model's last stage a copy of the embeddings as `output_layer.weight`, unless it is
//!   also the first);
//! - tensor-parallel rank `r` holds rows `r/T` of the column-parallel weights and biases
//!   (`linear_qkv`, whose rows are whole query groups; `linear_fc1`, a SwiGLU one as
//!   `[gate_r; up_r]`; the word embeddings; the output layer) and columns `r/T` of the
//!   row-parallel weights (`linear_proj`, `linear_fc2`); everything else whole;
//! - expert-parallel rank `e` holds experts `e·n/E ..` under local indices
//!   (`mlp.experts.local_experts.<i>.…`, SequentialMLP's names), everything else of the layer
//!   whole;
//! - each parallel linear has an `_extra_state` of `None` (the local spec's
//!   `get_extra_state`), which a strict `load_state_dict` wants.
//!
//! Every rank tensor is a box of the one-rank model's, one model map for all ranks, so the
//! write is a copy planned like any other: bounded memory, split over `mpirun` ranks, staged
//! and committed with the tracker last.

use std::path::Path;

use super::info::MegatronInfo;
use super::legacy::{expert_of, RANK_FILE};
use super::names::{split_of, Split};
use super::rank_folders::Axes;
use super::save::{config_args, model_args, namespace, new_iteration, parallel_args, CHECKPOINT_VERSION};
use crate::error::{Error, Result};
use crate::formats::torch::writer::{self, TorchSeal, WNode, WStorage, WTensor, WValue};
use crate::map::arch::names::{MCORE_EMBEDDING, MCORE_OUTPUT};
use crate::map::arch::ModelConfig;
use crate::map::model::{ModelMap, Piece, Target};
use crate::ops::misuse::{Misuse, Opt};
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, TensorInfo};
use crate::read::value::Leaf;
use crate::write::{Plan, TargetFile, WriteOptions};
use crate::ModelParallel;

/// The modules megatron builds as `ColumnParallelLinear`/`RowParallelLinear`, each saving an
/// `_extra_state`.
const LINEARS: [&str; 5] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"];

/// Where a one-rank tensor sits in the pipeline.
enum Stage<'a> {
    /// On the first stage (the embeddings).
    First,
    /// On the last stage (the final norm, the output layer).
    Last,
    /// In layer `layer`, under `within`.
    Layer { layer: u64, within: &'a str },
}

/// Where the one-rank tensor `name` goes; `None` for a tensor of no part of megatron's GPT model.
fn stage_of(name: &str) -> Option<Stage<'_>> {
    if let Some(rest) = name.strip_prefix("decoder.layers.") {
        let (n, within) = rest.split_once('.')?;
        let layer = n.parse().ok().filter(|_| n.bytes().all(|b| b.is_ascii_digit()))?;
        return Some(Stage::Layer { layer, within });
    }
    if name.starts_with("embedding.") {
        return Some(Stage::First);
    }
    if name.starts_with("decoder.final_layernorm.") || name.starts_with("output_layer.") {
        return Some(Stage::Last);
    }
    None
}

/// What cutting a model into ranks needs to know of it.
pub(super) struct Model {
    layers: u64,
    experts: u64,
    swiglu: bool,
    tied: bool,
    /// What megatron splits over the tensor-parallel ranks, and how many of each the model has.
    tensor_cuts: Vec<(&'static str, u64)>,
    /// Megatron-LM's `args` for the model, but for the parallel sizes.
    args: Vec<(String, Leaf)>,
}

impl Model {
    /// A model of a Hugging Face family's configuration.
    pub(super) fn of_config(c: &ModelConfig) -> Model {
        let moe = c.moe.as_ref();
        let dense = (0..c.num_layers).any(|l| !c.is_moe_layer(l));
        let cuts = [
            ("attention heads", Some(c.num_attention_heads)),
            ("query groups", Some(c.num_query_groups)),
            ("vocabulary rows", Some(c.vocab_size)),
            ("MLP hidden units", dense.then_some(c.ffn_hidden_size)),
            ("expert hidden units", moe.map(|m| m.ffn_hidden_size)),
            ("shared-expert hidden units", moe.and_then(|m| m.shared_expert_ffn_hidden_size)),
        ];
        Model {
            layers: c.num_layers,
            experts: moe.map_or(0, |m| m.num_experts),
            swiglu: c.swiglu,
            tied: c.tied_embeddings,
            tensor_cuts: cuts.into_iter().filter_map(|(what, n)| n.map(|n| (what, n))).collect(),
            args: config_args(c),
        }
    }

    /// A Megatron checkpoint's model as its saved `args` and its one-rank tensors `one_rank`
    /// say, for one no Hugging Face family describes (learned positions, biases): the heads and
    /// query groups must be known, since tensor parallelism cuts the fused QKV by whole query
    /// groups; every other cut is checked on the tensors themselves.
    pub(super) fn of_megatron(ck: &Checkpoint, meta: &MegatronInfo, one_rank: &[TensorInfo]) -> Result<Model> {
        let bad = |reason: String| Error::BadMegatron { path: ck.root.clone(), key: None, rank: None, reason };
        let counted = one_rank
            .iter()
            .filter_map(|t| match stage_of(&t.name) {
                Some(Stage::Layer { layer, .. }) => Some(layer + 1),
                _ => None,
            })
            .max();
        let Some(layers) = meta.num_layers.or(counted) else {
            return Err(bad("the checkpoint says of no layers, so they cannot be placed on stages".into()));
        };
        let Some(heads) = meta.num_attention_heads else {
            return Err(bad(
                "the saved `args` do not give `num_attention_heads`, by which tensor parallelism cuts the \
                 fused QKV rows"
                    .into(),
            ));
        };
        let groups = meta.num_query_groups.unwrap_or(heads);
        // The vocabulary rows as stored, padding included.
        let rows = one_rank.iter().find(|t| t.name == MCORE_EMBEDDING).and_then(|e| e.shape.first().copied());
        let mut cuts = vec![("attention heads", heads), ("query groups", groups)];
        cuts.extend(rows.map(|rows| ("vocabulary rows", rows)));
        let mut args = model_args(meta);
        args.extend(
            rows.map(|rows| ("padded_vocab_size".to_string(), Leaf::Int(i64::try_from(rows).unwrap_or(i64::MAX)))),
        );
        Ok(Model {
            layers,
            experts: meta.num_experts.unwrap_or(0),
            swiglu: meta.swiglu.unwrap_or(false),
            tied: meta.tied_embeddings.unwrap_or_else(|| !one_rank.iter().any(|t| t.name == MCORE_OUTPUT)),
            tensor_cuts: cuts,
            args,
        })
    }

    /// What megatron cuts over each kind of rank, checked to divide: a layout it could not
    /// build is refused before anything is read.
    fn check_divides(&self, p: ModelParallel, out: &Path) -> Result<()> {
        let mut cuts: Vec<(Opt, u64, &str, u64)> =
            self.tensor_cuts.iter().map(|&(what, n)| (Opt::TensorParallel, p.tensor, what, n)).collect();
        cuts.push((Opt::PipelineParallel, p.pipeline, "layers", self.layers));
        // A model without experts is cut over one expert rank, which divides its none.
        if p.expert > 1 || self.experts > 0 {
            cuts.push((Opt::ExpertParallel, p.expert, "experts", self.experts));
        }
        for (option, size, what, count) in cuts {
            if count == 0 || !count.is_multiple_of(size) {
                let misuse = Misuse::DoesNotSplit { option, size, what, count };
                return Err(Error::Misuse { path: out.to_path_buf(), misuse });
            }
        }
        Ok(())
    }
}

/// The rank folder's name: megatron's `mp_rank_TT`, `_PPP` with pipeline stages, `_EEE` with
/// expert ranks.
fn folder(t: u64, pp: u64, e: u64, p: ModelParallel) -> String {
    Axes { pipeline: p.pipeline > 1, expert: p.expert > 1 }.folder(t, pp, e)
}

/// Tensor-parallel rank `r`'s piece of the one-rank tensor `source` of `shape`, split as
/// `split` over `tp` ranks: the piece's shape and where it reads.
fn cut(
    source: &str,
    shape: &[u64],
    split: Split,
    r: u64,
    tp: u64,
) -> std::result::Result<(Vec<u64>, Vec<Piece>), String> {
    let mut local = shape.to_vec();
    match split {
        Split::Whole => Ok((local, vec![Piece::whole(source, shape)])),
        Split::Dim(d) => {
            let Some(&n) = shape.get(d) else { return Err(format!("it has no dim {d} to cut")) };
            if !n.is_multiple_of(tp) {
                return Err(format!("its {n} rows on dim {d} do not divide over {tp} tensor-parallel ranks"));
            }
            let k = n / tp;
            local[d] = k;
            Ok((local, vec![Piece::range(source, shape, d, r * k..(r + 1) * k, 0)]))
        }
        Split::Gated => {
            let n = shape.first().copied().unwrap_or(0);
            if !n.is_multiple_of(2 * tp) {
                return Err(format!("its {n} SwiGLU rows do not halve and divide over {tp} tensor-parallel ranks"));
            }
            let (half, k) = (n / 2, n / 2 / tp);
            local[0] = 2 * k;
            let gate = Piece::range(source, shape, 0, r * k..(r + 1) * k, 0);
            let up = Piece::range(source, shape, 0, half + r * k..half + (r + 1) * k, k);
            Ok((local, vec![gate, up]))
        }
    }
}

/// One rank's file: its folder and its model's entries in order (a tensor's local name, or an
/// `_extra_state`).
struct RankPlan {
    folder: String,
    entries: Vec<Entry>,
}

enum Entry {
    /// A tensor: its local name, and its index among the map's targets.
    Tensor(String, usize),
    /// An `_extra_state` key.
    Extra(String),
}

/// Writes the one-rank model `one_rank` of `model` (boxes of `ck`'s files) as the
/// legacy layout `parallel` in the run folder `out`, at `iteration`. A run folder that already
/// has this iteration or a tracker is refused, as for `torch_dist`.
pub(crate) fn write(
    ck: &Checkpoint,
    model: &Model,
    one_rank: &[TensorInfo],
    parallel: ModelParallel,
    iteration: u64,
    out: &Path,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    model.check_divides(parallel, out)?;
    let (dir, tracker) = new_iteration(out, iteration)?;
    let bad = |key: &str, reason: String| Error::BadMegatron {
        path: ck.root.clone(),
        key: Some(key.to_string()),
        rank: None,
        reason,
    };
    let per_stage = model.layers / parallel.pipeline;
    let local_experts = model.experts / parallel.expert;
    let last = parallel.pipeline - 1;
    // A tied model's last stage keeps its own copy of the embeddings as the output layer.
    let embedding = one_rank.iter().find(|t| t.name == MCORE_EMBEDDING);
    let has_output = one_rank.iter().any(|t| t.name == MCORE_OUTPUT);
    let tied_copy = (model.tied && parallel.pipeline > 1 && !has_output).then_some(embedding).flatten();

    // Each one-rank tensor's stage and local name, once: the dense ones of each stage, which
    // every expert rank of it holds, and the experts of each (stage, expert rank).
    let mut local_names = Vec::with_capacity(one_rank.len());
    let mut dense: Vec<Vec<usize>> = vec![Vec::new(); parallel.pipeline as usize];
    let mut experts: Vec<Vec<usize>> = vec![Vec::new(); (parallel.pipeline * parallel.expert) as usize];
    for (i, src) in one_rank.iter().enumerate() {
        let Some(stage) = stage_of(&src.name) else {
            return Err(bad(&src.name, "not a tensor of megatron's GPT model, so no rank holds it".into()));
        };
        let (p, expert, local) = match stage {
            Stage::First => (0, None, src.name.clone()),
            Stage::Last => (last, None, src.name.clone()),
            Stage::Layer { layer, within } => {
                let (p, l) = (layer / per_stage, layer % per_stage);
                match expert_of(within) {
                    Some(x) if local_experts > 0 => {
                        let (e, i) = (x.local / local_experts, x.local % local_experts);
                        (p, Some(e), format!("decoder.layers.{l}.mlp.experts.local_experts.{i}.{}", x.within))
                    }
                    _ => (p, None, format!("decoder.layers.{l}.{within}")),
                }
            }
        };
        local_names.push(local);
        // A layer or expert past the model's is held by no rank: the map refuses it unplaced.
        let list = match expert {
            None => dense.get_mut(p as usize),
            Some(e) if e < parallel.expert => experts.get_mut((p * parallel.expert + e) as usize),
            Some(_) => None,
        };
        list.into_iter().for_each(|l| l.push(i));
    }

    let mut map = ModelMap::new("Megatron legacy ranks");
    let mut ranks = Vec::new();
    for t in 0..parallel.tensor {
        for p in 0..parallel.pipeline {
            for e in 0..parallel.expert {
                let folder = folder(t, p, e, parallel);
                let mut held: Vec<usize> = dense[p as usize].clone();
                held.extend(&experts[(p * parallel.expert + e) as usize]);
                held.sort_unstable();
                let mut names: Vec<(String, &TensorInfo)> =
                    held.into_iter().map(|i| (local_names[i].clone(), &one_rank[i])).collect();
                if p == last {
                    if let Some(emb) = tied_copy {
                        names.push(("output_layer.weight".to_string(), emb));
                    }
                }
                // A linear's `_extra_state` follows its last parameter, as its module saves it
                // (a source may hold a module's weight and bias apart).
                let module_of = |name: &str| name.rsplit_once('.').map_or("", |m| m.0).to_string();
                let last_of: std::collections::HashMap<String, usize> =
                    names.iter().enumerate().map(|(i, (n, _))| (module_of(n), i)).collect();
                let mut entries = Vec::with_capacity(names.len() * 2);
                for (i, (local, src)) in names.iter().enumerate() {
                    let split = split_of(local, model.swiglu);
                    let (shape, pieces) = cut(&src.name, &src.shape, split, t, parallel.tensor)
                        .map_err(|reason| bad(&src.name, reason))?;
                    entries.push(Entry::Tensor(local.clone(), map.len()));
                    map.push(Target::new(format!("{folder}/{local}"), shape, pieces));
                    let module = module_of(local);
                    if is_linear(&module) && last_of.get(&module) == Some(&i) {
                        entries.push(Entry::Extra(format!("{module}._extra_state")));
                    }
                }
                // The output layer of a tied model on one stage has no weight of its own, but
                // its module saves its `_extra_state` all the same.
                let extra = "output_layer._extra_state";
                if p == last && !entries.iter().any(|x| matches!(x, Entry::Extra(k) if k == extra)) {
                    entries.push(Entry::Extra(extra.to_string()));
                }
                ranks.push(RankPlan { folder, entries });
            }
        }
    }
    let tensors = map.apply(&ck.root, one_rank)?;

    let args: Vec<_> = model.args.iter().cloned().chain(parallel_args(parallel)).collect();
    let namespace = namespace(&args);
    let mut plan = Plan::default();
    let mut bytes = 0u64;
    for rank in &ranks {
        let path = dir.join(&rank.folder).join(RANK_FILE);
        let mut storages = Vec::new();
        let mut placed: Vec<&TensorInfo> = Vec::new();
        let mut model = Vec::with_capacity(rank.entries.len());
        for entry in &rank.entries {
            let (name, value) = match entry {
                Entry::Tensor(name, i) => {
                    let t = &tensors[*i];
                    let w = WTensor { dtype: t.dtype, shape: t.shape.clone(), storage: storages.len(), offset: 0 };
                    storages.push(WStorage { dtype: t.dtype, byte_len: t.byte_len() });
                    placed.push(t);
                    (name, WNode::Tensor(w))
                }
                Entry::Extra(name) => (name, WNode::Leaf(Leaf::None)),
            };
            model.push((WNode::Leaf(Leaf::Str(name.clone())), value));
        }
        let iteration = i64::try_from(iteration).unwrap_or(i64::MAX);
        let entries = vec![
            ("args".to_string(), WValue::Node(namespace.clone())),
            ("checkpoint_version".to_string(), WValue::Leaf(Leaf::Float(CHECKPOINT_VERSION))),
            ("iteration".to_string(), WValue::Leaf(Leaf::Int(iteration))),
            ("model".to_string(), WValue::Node(WNode::Dict(model))),
            ("num_floating_point_operations_so_far".to_string(), WValue::Leaf(Leaf::Int(0))),
        ];
        let layout = writer::layout(&writer::archive_name(&path), &entries, &storages, &path)?;
        let mut target = TargetFile::new(path, Vec::new(), layout.file_len);
        for (t, off) in placed.iter().zip(&layout.storage_offsets) {
            target.place(t, t.dtype, *off, None);
            bytes += t.byte_len();
        }
        target.seal = Some(Box::new(TorchSeal(vec![(0, layout)])));
        plan.targets.push(target);
    }
    plan.trailers.push((tracker, iteration.to_string().into_bytes()));
    crate::write::execute::execute(&plan, ck, opts)?;
    let n = u64::try_from(ranks.len()).unwrap_or(u64::MAX);
    Ok(Outcome { files: plan.outputs(), tensors: tensors.len(), bytes, world_size: Some(n), ..Outcome::default() })
}

/// Whether `module` (a local module path) is one of megatron's parallel linears.
fn is_linear(module: &str) -> bool {
    let leaf = module.rsplit('.').next().unwrap_or(module);
    LINEARS.contains(&leaf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_folders_name_only_the_parallelism_there_is() {
        let p = |tensor, pipeline, expert| ModelParallel { tensor, pipeline, expert };
        assert_eq!(folder(1, 0, 0, p(2, 1, 1)), "mp_rank_01");
        assert_eq!(folder(1, 1, 0, p(2, 2, 1)), "mp_rank_01_001");
        assert_eq!(folder(0, 0, 1, p(1, 1, 2)), "mp_rank_00_001");
        assert_eq!(folder(1, 2, 3, p(2, 3, 4)), "mp_rank_01_002_003");
    }

    #[test]
    fn a_swiglu_fc1_rank_holds_its_gate_rows_then_its_up_rows() {
        // 8 rows: gate 0..4, up 4..8; rank 1 of 2 holds gate 2..4 then up 6..8.
        let (shape, pieces) = cut("fc1", &[8, 3], Split::Gated, 1, 2).unwrap_or_default();
        assert_eq!(shape, vec![4, 3]);
        assert_eq!(
            pieces.iter().map(|p| (p.from[0], p.at.offsets[0], p.at.sizes[0])).collect::<Vec<_>>(),
            vec![(2, 0, 2), (6, 2, 2)]
        );
        let (shape, pieces) = cut("proj", &[3, 8], Split::Dim(1), 1, 4).unwrap_or_default();
        assert_eq!(shape, vec![3, 2]);
        assert_eq!((pieces[0].from.clone(), pieces[0].at.sizes.clone()), (vec![0, 2], vec![3, 2]));
        assert!(cut("qkv", &[6, 3], Split::Dim(0), 0, 4).is_err());
    }

    #[test]
    fn only_parallel_linears_save_an_extra_state() {
        for m in [
            "decoder.layers.0.self_attention.linear_qkv",
            "output_layer",
            "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2",
        ] {
            assert!(is_linear(m), "{m}");
        }
        for m in ["decoder.layers.0.mlp.router", "embedding.word_embeddings", "decoder.final_layernorm"] {
            assert!(!is_linear(m), "{m}");
        }
    }
}
