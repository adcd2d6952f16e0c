//! The Megatron ⇄ Hugging Face tables: one list of links between a Megatron tensor (or a part
//! of one) and a Hub tensor, read one way as a map from Megatron's one-rank names to the Hub's
//! ([`to_hf`]), and the other way as a map from the Hub's names to the keys a `torch_dist` save
//! stores ([`from_hf`]).
//!
//! The parts are the reshapes between the two:
//!
//! - megatron's `linear_qkv` interleaves each query group's rows `[q_1..q_r, k, v]` (`r` heads
//!   per group, `d` rows each); Q is every group's first `r·d` rows, K the next `d`, V the last
//!   `d` (weights and Qwen2's biases alike): [`Part::Groups`];
//! - a SwiGLU `linear_fc1` is `[gate; up]`: the gate projection is its first `f` rows, up the
//!   rest: [`Part::Rows`]; so is a vocabulary kept to its first `N` rows;
//! - everything else is the same tensor under another name.
//!
//! Every link is a box of its source, so the conversion is planned and executed as a copy:
//! bounded memory, split over ranks by bytes.

use std::collections::HashMap;
use std::path::Path;

use super::names::{self, Hub};
use super::{Arch, ModelConfig};
use crate::error::{Error, MapProblem, Result};
use crate::map::model::{ModelMap, Piece, Target};
use crate::read::catalog::TensorInfo;

/// Which part of the Megatron tensor a Hub tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// All of it.
    Whole,
    /// Rows `start .. start + len` (dim 0).
    Rows { start: u64, len: u64 },
    /// For each of `groups` groups `g`, rows `g·period + start ..` of `len` rows, one group after
    /// the other.
    Groups { groups: u64, period: u64, start: u64, len: u64 },
}

/// Where a Megatron tensor sits: a model-wide tensor, one of a layer, one of an expert.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Mcore {
    Global(&'static str),
    Layer { layer: u64, within: String },
    Expert { layer: u64, expert: u64, param: &'static str },
}

impl Mcore {
    /// Megatron's one-rank name.
    pub(crate) fn one_rank(&self) -> String {
        match self {
            Mcore::Global(n) => (*n).to_string(),
            Mcore::Layer { layer, within } => names::mcore_layer(*layer, within),
            Mcore::Expert { layer, expert, param } => names::mcore_expert(*layer, *expert, param),
        }
    }
}

/// A Hub tensor and the Megatron tensor part it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub hf: String,
    pub hf_shape: Vec<u64>,
    pub mcore: Mcore,
    /// The Megatron tensor's whole shape (one layer's, one expert's).
    pub mcore_shape: Vec<u64>,
    pub part: Part,
}

/// The links of a model of `config` as family `arch`, keeping `vocab` rows of the vocabulary
/// (all of them when `None`). In Hub order: embeddings, layers, final norm, output layer.
pub(crate) fn links(config: &ModelConfig, arch: Arch, vocab: Option<u64>) -> Vec<Link> {
    let hub = Hub { arch };
    let c = config;
    let (h, d, g, r) = (c.hidden_size, c.head_dim, c.num_query_groups, c.heads_per_group());
    let mut out = Vec::new();
    let rows = vocab.unwrap_or(c.vocab_size);
    let vocab_part = match vocab {
        Some(n) if n != c.vocab_size => Part::Rows { start: 0, len: n },
        _ => Part::Whole,
    };
    let global = |hf: String, name: &'static str, hf_shape: Vec<u64>, shape: Vec<u64>, part| Link {
        hf,
        hf_shape,
        mcore: Mcore::Global(name),
        mcore_shape: shape,
        part,
    };
    out.push(global(hub.embedding(), names::MCORE_EMBEDDING, vec![rows, h], vec![c.vocab_size, h], vocab_part));
    for l in 0..c.num_layers {
        let layer = |hf: &str, within: &str, hf_shape: Vec<u64>, shape: Vec<u64>, part| Link {
            hf: hub.layer(l, hf),
            hf_shape,
            mcore: Mcore::Layer { layer: l, within: within.to_string() },
            mcore_shape: shape,
            part,
        };
        out.push(layer("input_layernorm.weight", "input_layernorm.weight", vec![h], vec![h], Part::Whole));
        let qkv_rows = g * (r + 2) * d;
        let period = (r + 2) * d;
        let q = Part::Groups { groups: g, period, start: 0, len: r * d };
        let k = Part::Groups { groups: g, period, start: r * d, len: d };
        let v = Part::Groups { groups: g, period, start: (r + 1) * d, len: d };
        for (name, part, n) in [("q_proj", q, g * r * d), ("k_proj", k, g * d), ("v_proj", v, g * d)] {
            let w = format!("self_attn.{name}.weight");
            out.push(layer(&w, "self_attention.linear_qkv.weight", vec![n, h], vec![qkv_rows, h], part));
            if c.qkv_bias {
                let b = format!("self_attn.{name}.bias");
                out.push(layer(&b, "self_attention.linear_qkv.bias", vec![n], vec![qkv_rows], part));
            }
        }
        if c.qk_norm {
            out.push(layer(
                "self_attn.q_norm.weight",
                "self_attention.q_layernorm.weight",
                vec![d],
                vec![d],
                Part::Whole,
            ));
            out.push(layer(
                "self_attn.k_norm.weight",
                "self_attention.k_layernorm.weight",
                vec![d],
                vec![d],
                Part::Whole,
            ));
        }
        let heads = c.num_attention_heads * d;
        out.push(layer(
            "self_attn.o_proj.weight",
            "self_attention.linear_proj.weight",
            vec![h, heads],
            vec![h, heads],
            Part::Whole,
        ));
        out.push(layer("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", vec![h], vec![h], Part::Whole));
        match (&c.moe, c.is_moe_layer(l)) {
            (Some(m), true) => {
                let e_count = m.num_experts;
                out.push(Link {
                    hf: hub.router(l),
                    hf_shape: vec![e_count, h],
                    mcore: Mcore::Layer { layer: l, within: "mlp.router.weight".into() },
                    mcore_shape: vec![e_count, h],
                    part: Part::Whole,
                });
                let f = m.ffn_hidden_size;
                for e in 0..e_count {
                    let [gate, up, down] = hub.expert(l, e);
                    let expert = |hf: String, param: &'static str, hf_shape: Vec<u64>, shape: Vec<u64>, part| Link {
                        hf,
                        hf_shape,
                        mcore: Mcore::Expert { layer: l, expert: e, param },
                        mcore_shape: shape,
                        part,
                    };
                    out.push(expert(
                        gate,
                        "linear_fc1.weight",
                        vec![f, h],
                        vec![2 * f, h],
                        Part::Rows { start: 0, len: f },
                    ));
                    out.push(expert(
                        up,
                        "linear_fc1.weight",
                        vec![f, h],
                        vec![2 * f, h],
                        Part::Rows { start: f, len: f },
                    ));
                    out.push(expert(down, "linear_fc2.weight", vec![h, f], vec![h, f], Part::Whole));
                }
                if let Some(fs) = m.shared_expert_ffn_hidden_size {
                    let [gate, up, down] = hub.shared_expert(l);
                    let shared = |hf: String, within: &str, hf_shape: Vec<u64>, shape: Vec<u64>, part| Link {
                        hf,
                        hf_shape,
                        mcore: Mcore::Layer { layer: l, within: within.to_string() },
                        mcore_shape: shape,
                        part,
                    };
                    let fc1 = "mlp.shared_experts.linear_fc1.weight";
                    out.push(shared(gate, fc1, vec![fs, h], vec![2 * fs, h], Part::Rows { start: 0, len: fs }));
                    out.push(shared(up, fc1, vec![fs, h], vec![2 * fs, h], Part::Rows { start: fs, len: fs }));
                    out.push(shared(
                        down,
                        "mlp.shared_experts.linear_fc2.weight",
                        vec![h, fs],
                        vec![h, fs],
                        Part::Whole,
                    ));
                    if m.shared_expert_gate {
                        let gate = hub.shared_expert_gate(l);
                        out.push(shared(gate, "mlp.shared_experts.gate_weight", vec![1, h], vec![1, h], Part::Whole));
                    }
                }
            }
            _ => {
                let f = c.ffn_hidden_size;
                out.push(layer(
                    "mlp.gate_proj.weight",
                    "mlp.linear_fc1.weight",
                    vec![f, h],
                    vec![2 * f, h],
                    Part::Rows { start: 0, len: f },
                ));
                out.push(layer(
                    "mlp.up_proj.weight",
                    "mlp.linear_fc1.weight",
                    vec![f, h],
                    vec![2 * f, h],
                    Part::Rows { start: f, len: f },
                ));
                out.push(layer("mlp.down_proj.weight", "mlp.linear_fc2.weight", vec![h, f], vec![h, f], Part::Whole));
            }
        }
    }
    out.push(global(hub.final_norm(), names::MCORE_FINAL_NORM, vec![h], vec![h], Part::Whole));
    if !c.tied_embeddings {
        out.push(global(hub.lm_head(), names::MCORE_OUTPUT, vec![rows, h], vec![c.vocab_size, h], vocab_part));
    }
    out
}

/// The Megatron source tensor of a link, checked: there, and of the shape the config gives.
fn source_shape<'a>(
    root: &Path,
    by_name: &HashMap<&str, &'a TensorInfo>,
    name: &str,
    expected: &[u64],
    target: &str,
) -> Result<&'a TensorInfo> {
    let bad = |problem| Error::BadModelMap {
        path: root.to_path_buf(),
        tensor: target.to_string(),
        problem: Box::new(problem),
    };
    let Some(t) = by_name.get(name) else {
        return Err(bad(MapProblem::UnknownSource { source_name: name.to_string() }));
    };
    if t.shape != expected {
        return Err(bad(MapProblem::SourceShape {
            source_name: name.to_string(),
            expected: expected.to_vec(),
            found: t.shape.clone(),
        }));
    }
    Ok(t)
}

/// The Hugging Face model of family `arch`, from Megatron's one-rank tensors `sources` of a
/// model of `config`, keeping `vocab` rows of the vocabulary. A source missing, or of another
/// shape than the config gives, is refused naming it; a source no Hub tensor reads is refused by
/// [`ModelMap::apply`] (the tied output layer a last pipeline stage keeps is left out).
pub(crate) fn to_hf(
    root: &Path,
    config: &ModelConfig,
    arch: Arch,
    vocab: Option<u64>,
    sources: &[TensorInfo],
) -> Result<ModelMap> {
    let by_name: HashMap<&str, &TensorInfo> = sources.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut map = ModelMap::new("Hugging Face model");
    for link in links(config, arch, vocab) {
        let name = link.mcore.one_rank();
        let src = source_shape(root, &by_name, &name, &link.mcore_shape, &link.hf)?;
        let piece = match link.part {
            Part::Whole => vec![Piece::whole(name, &src.shape)],
            Part::Rows { start, len } => vec![Piece::range(name, &src.shape, 0, start..start + len, 0)],
            Part::Groups { groups, period, start, len } => {
                Piece::groups(&name, &src.shape, groups, period, start, len, 0)
            }
        };
        map.push(Target::new(link.hf, link.hf_shape, piece));
    }
    if config.tied_embeddings && by_name.contains_key(names::MCORE_OUTPUT) {
        map.leave_out(names::MCORE_OUTPUT);
    }
    Ok(map)
}

/// How the layers of a `torch_dist` save are keyed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    /// One key per tensor with a leading layer axis (experts: a layer and an expert axis).
    Stacked,
    /// One key per layer (`decoder.layers.N.…`; experts with an expert axis), as megatron
    /// writes layers that differ.
    PerLayer,
    /// The one-rank model's names, every layer and expert a tensor of its own: what a legacy
    /// save's ranks are cut from.
    OneRank,
}

impl Keys {
    /// How megatron keys the layers of a model of `config`: stacked when every layer is alike.
    pub(crate) fn of(config: &ModelConfig) -> Keys {
        match &config.moe {
            Some(m) if m.moe_layers.iter().any(|x| *x) && m.moe_layers.iter().any(|x| !x) => Keys::PerLayer,
            _ => Keys::Stacked,
        }
    }
}

/// The stored key of a link's Megatron tensor, and the layer/expert indices it is put at
/// (leading axes, in order), with the stored tensor's leading dims.
fn stored_of(mcore: &Mcore, keys: Keys, config: &ModelConfig) -> (String, Vec<u64>, Vec<u64>) {
    let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    match (mcore, keys) {
        (Mcore::Global(n), _) => ((*n).to_string(), vec![], vec![]),
        (_, Keys::OneRank) => (mcore.one_rank(), vec![], vec![]),
        (Mcore::Layer { within, .. }, Keys::Stacked) => {
            (names::stored_stacked(within), vec![config.num_layers], vec![layer_of(mcore)])
        }
        (Mcore::Layer { layer, within }, Keys::PerLayer) => (names::stored_layer(*layer, within), vec![], vec![]),
        (Mcore::Expert { layer, expert, param }, Keys::Stacked) => {
            (names::stored_experts(param), vec![config.num_layers, experts], vec![*layer, *expert])
        }
        (Mcore::Expert { layer, expert, param }, Keys::PerLayer) => {
            (names::stored_layer_experts(*layer, param), vec![experts], vec![*expert])
        }
    }
}

fn layer_of(mcore: &Mcore) -> u64 {
    match mcore {
        Mcore::Global(_) => 0,
        Mcore::Layer { layer, .. } | Mcore::Expert { layer, .. } => *layer,
    }
}

/// The keys a Megatron `torch_dist` save of a model of `config` stores, with their global
/// shapes, from the Hub tensors `sources` of family `arch` (all of the vocabulary's rows); with
/// [`Keys::OneRank`], the one-rank model's tensors instead. A Hub tensor missing or of another
/// shape is refused naming it; the tied `lm_head.weight` some folders keep and the rotary
/// `inv_freq` buffers older ones saved are left out.
pub(crate) fn from_hf(
    root: &Path,
    config: &ModelConfig,
    arch: Arch,
    keys: Keys,
    sources: &[TensorInfo],
) -> Result<ModelMap> {
    let by_name: HashMap<&str, &TensorInfo> = sources.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut stored = Stored::default();
    for link in links(config, arch, None) {
        let src = source_shape(root, &by_name, &link.hf, &link.hf_shape, &link.hf)?;
        let pieces = match link.part {
            Part::Whole => vec![Piece::whole(link.hf.clone(), &src.shape)],
            Part::Rows { start, .. } => {
                let mut by = vec![0; src.shape.len()];
                by[0] = start;
                vec![Piece::whole(link.hf.clone(), &src.shape).shifted(&by)]
            }
            Part::Groups { groups, period, start, len } => {
                Piece::interleaved(&link.hf, &src.shape, groups, period, start, len)
            }
        };
        stored.put(&link, keys, config, pieces);
    }
    let mut map = stored.into_map("Megatron torch_dist model");
    let hub = Hub { arch };
    if config.tied_embeddings && by_name.contains_key(hub.lm_head().as_str()) {
        map.leave_out(hub.lm_head());
    }
    for t in sources.iter().filter(|t| t.name.ends_with(".rotary_emb.inv_freq")) {
        map.leave_out(t.name.clone());
    }
    Ok(map)
}

/// The keys a Megatron `torch_dist` save of a model of `config` stores, from the one-rank
/// model's tensors `sources` (what a legacy save's ranks stitch into): each layer's tensor put
/// at its index of the stacked key, each expert's at its layer's and its own. A tensor missing
/// or of another shape is refused naming it; the tied output layer's copy is left out.
pub(crate) fn from_one_rank(root: &Path, config: &ModelConfig, arch: Arch, sources: &[TensorInfo]) -> Result<ModelMap> {
    let by_name: HashMap<&str, &TensorInfo> = sources.iter().map(|t| (t.name.as_str(), t)).collect();
    let keys = Keys::of(config);
    let mut stored = Stored::default();
    let mut seen = std::collections::HashSet::new();
    // A Megatron tensor several Hub tensors are parts of (the fused QKV) is one link per part.
    for link in links(config, arch, None).into_iter().filter(|l| seen.insert(l.mcore.clone())) {
        let name = link.mcore.one_rank();
        let src = source_shape(root, &by_name, &name, &link.mcore_shape, &name)?;
        let piece = Piece::whole(name, &src.shape);
        stored.put(&link, keys, config, vec![piece]);
    }
    let mut map = stored.into_map("Megatron torch_dist model");
    if config.tied_embeddings && by_name.contains_key(names::MCORE_OUTPUT) {
        map.leave_out(names::MCORE_OUTPUT);
    }
    Ok(map)
}

/// Stored keys in the order first met, each with its shape and pieces.
#[derive(Default)]
struct Stored {
    order: Vec<String>,
    targets: HashMap<String, (Vec<u64>, Vec<Piece>)>,
}

impl Stored {
    /// `pieces` (of one layer's, one expert's tensor) put where `link`'s Megatron tensor is
    /// stored under `keys`.
    fn put(&mut self, link: &Link, keys: Keys, config: &ModelConfig, mut pieces: Vec<Piece>) {
        let (key, lead, at) = stored_of(&link.mcore, keys, config);
        for (axis, &index) in at.iter().enumerate() {
            pieces = pieces.into_iter().map(|p| p.lifted(axis, index)).collect();
        }
        let entry = self.targets.entry(key.clone()).or_insert_with(|| {
            self.order.push(key);
            let mut shape = lead.clone();
            shape.extend(&link.mcore_shape);
            (shape, Vec::new())
        });
        entry.1.extend(pieces);
    }

    fn into_map(mut self, view: &'static str) -> ModelMap {
        let mut map = ModelMap::new(view);
        for key in self.order {
            if let Some((shape, pieces)) = self.targets.remove(&key) {
                map.push(Target::new(key, shape, pieces));
            }
        }
        map
    }
}

#[cfg(test)]
mod tests;
