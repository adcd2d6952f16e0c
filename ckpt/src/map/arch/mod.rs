//! Model architectures: what a decoder-only transformer is, said once for every framework, and
//! the tables that name its tensors in each.
//!
//! A [`ModelConfig`] is the model as its hyperparameters say it (layers, widths, heads, which
//! norms and biases exist, the experts), derived by each format from what it saved: a Megatron
//! run from its `args`, a Hugging Face folder from its `config.json`. Nothing in it is a
//! framework's name. An [`Arch`] is one family of Hugging Face models (Llama, Qwen2, Qwen3,
//! Mixtral, Qwen2-MoE, Qwen3-MoE): the Hub names its tensors take, the `config.json` it reads.
//! Which family a model is follows from its config ([`Arch::recognize`]), or is named
//! (`--arch`, [`Arch::from_name`]); a model no family describes is refused naming the setting
//! that has no counterpart ([`crate::Error::NoHfArchitecture`]).

pub(crate) mod hf_config;
pub(crate) mod names;
pub(crate) mod tables;

use crate::read::dtype::Dtype;

/// The norm a model uses before attention, before the MLP and at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// Root-mean-square norm, a weight and no bias (Llama, Qwen, Mixtral).
    RmsNorm,
    /// Layer norm, a weight and a bias (GPT-2 style).
    LayerNorm,
}

/// The mixture-of-experts part of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub num_experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// The hidden size of one expert's MLP.
    pub ffn_hidden_size: u64,
    /// The hidden size of the shared expert's MLP, where the model has one (Qwen2-MoE).
    pub shared_expert_ffn_hidden_size: Option<u64>,
    /// The shared expert's output is scaled by a learned sigmoid gate (Qwen2-MoE's
    /// `shared_expert_gate`).
    pub shared_expert_gate: bool,
    /// Per layer, whether it is an MoE layer (false: a dense MLP of the model's
    /// `ffn_hidden_size`); one entry per layer.
    pub moe_layers: Vec<bool>,
    /// The router's top-k weights are renormalized to sum to one (`norm_topk_prob`).
    pub norm_topk_prob: bool,
}

/// A decoder-only transformer's hyperparameters, format-neutral.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Transformer layers.
    pub num_layers: u64,
    /// Hidden size.
    pub hidden_size: u64,
    /// The dense MLP's hidden size.
    pub ffn_hidden_size: u64,
    /// Attention heads.
    pub num_attention_heads: u64,
    /// Key/value heads (query groups); equal to the heads without grouped-query attention.
    pub num_query_groups: u64,
    /// The width of one head (megatron's `kv_channels`).
    pub head_dim: u64,
    /// Rows of the word embeddings as stored, padding included.
    pub vocab_size: u64,
    /// The vocabulary the tokenizer has, where known (rows past it are padding).
    pub unpadded_vocab_size: Option<u64>,
    /// The longest sequence the position encoding was set up for.
    pub max_position_embeddings: u64,
    /// The norms' epsilon.
    pub norm_eps: f64,
    /// The norms' kind.
    pub norm: NormKind,
    /// The rotary embedding's base.
    pub rope_theta: f64,
    /// The output layer is the word embeddings.
    pub tied_embeddings: bool,
    /// The query/key/value projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Queries and keys are normed per head before the rotary embedding (Qwen3).
    pub qk_norm: bool,
    /// The MLP is gated (SwiGLU: `silu(gate) * up`).
    pub swiglu: bool,
    /// The mixture-of-experts part, for an MoE model.
    pub moe: Option<MoeConfig>,
    /// The weights' dtype as stored.
    pub dtype: Dtype,
}

impl ModelConfig {
    /// Query heads per key/value group.
    pub fn heads_per_group(&self) -> u64 {
        self.num_attention_heads.checked_div(self.num_query_groups).unwrap_or(0)
    }

    /// Whether layer `layer` is an MoE layer.
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        self.moe.as_ref().is_some_and(|m| usize::try_from(layer).ok().and_then(|l| m.moe_layers.get(l)) == Some(&true))
    }
}

/// A family of Hugging Face models, with the Hub names its tensors take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// Llama (and Mistral without sliding windows): RMSNorm, SwiGLU, RoPE, grouped-query
    /// attention, no biases.
    Llama,
    /// Qwen2: Llama with biases on the query, key and value projections.
    Qwen2,
    /// Qwen3: Llama with per-head RMSNorm of queries and keys.
    Qwen3,
    /// Mixtral: Llama's attention, every MLP a mixture of experts (`block_sparse_moe`).
    Mixtral,
    /// Qwen2-MoE: Qwen2's attention, experts with a gated shared expert, dense layers allowed.
    Qwen2Moe,
    /// Qwen3-MoE: Qwen3's attention, experts, dense layers allowed.
    Qwen3Moe,
}

impl Arch {
    /// Every family, in the order recognition tries them.
    pub const ALL: [Arch; 6] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Mixtral, Arch::Qwen2Moe, Arch::Qwen3Moe];

    /// The name `--arch` takes, which is Hugging Face's `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mixtral => "mixtral",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The family named `name` (its `model_type`; `-` taken as `_`), if one is.
    pub fn from_name(name: &str) -> Option<Arch> {
        let name = name.trim().to_ascii_lowercase().replace('-', "_");
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The class transformers loads it with (`architectures` in `config.json`).
    pub fn class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Mixtral => "MixtralForCausalLM",
            Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The family's model has experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe)
    }

    /// Why this family cannot hold `config`: the setting it has no counterpart for and the
    /// value the model gives it; `None` when it can.
    pub fn mismatch(self, config: &ModelConfig) -> Option<(&'static str, String)> {
        let yes_no = |b: bool| if b { "on" } else { "off" }.to_string();
        if config.norm != NormKind::RmsNorm {
            return Some(("normalization", "LayerNorm".into()));
        }
        if !config.swiglu {
            return Some(("swiglu", yes_no(false)));
        }
        let qkv_bias = matches!(self, Arch::Qwen2 | Arch::Qwen2Moe);
        if config.qkv_bias != qkv_bias {
            return Some(("add_qkv_bias", yes_no(config.qkv_bias)));
        }
        let qk_norm = matches!(self, Arch::Qwen3 | Arch::Qwen3Moe);
        if config.qk_norm != qk_norm {
            return Some(("qk_layernorm", yes_no(config.qk_norm)));
        }
        match (&config.moe, self.is_moe()) {
            (Some(m), false) => return Some(("num_experts", m.num_experts.to_string())),
            (None, true) => return Some(("num_experts", "none".into())),
            _ => {}
        }
        if let Some(m) = &config.moe {
            let shared = m.shared_expert_ffn_hidden_size.is_some();
            let dense_layers = m.moe_layers.iter().any(|l| !l);
            match self {
                Arch::Mixtral | Arch::Qwen3Moe if shared => {
                    return Some(("moe_shared_expert_intermediate_size", "set".into()))
                }
                Arch::Mixtral if dense_layers => return Some(("moe_layer_freq", "a dense layer".into())),
                // Qwen2-MoE's block always has a shared expert and its sigmoid gate.
                Arch::Qwen2Moe if !shared => return Some(("moe_shared_expert_intermediate_size", "none".into())),
                Arch::Qwen2Moe if !m.shared_expert_gate => return Some(("moe_shared_expert_gate", yes_no(false))),
                // Mixtral weighs the chosen experts to one.
                Arch::Mixtral if !m.norm_topk_prob => return Some(("moe_router_pre_softmax", yes_no(true))),
                _ => {}
            }
        }
        None
    }

    /// The family that holds `config`: the first of [`Arch::ALL`] that does, or the closest
    /// family and the setting (with its value) it has no counterpart for.
    pub fn recognize(config: &ModelConfig) -> std::result::Result<Arch, (Arch, &'static str, String)> {
        if let Some(a) = Arch::ALL.into_iter().find(|a| a.mismatch(config).is_none()) {
            return Ok(a);
        }
        let first = if config.moe.is_some() { Arch::Mixtral } else { Arch::Llama };
        // Biases and q/k norms pick a family; the first family's complaint about them would
        // name a setting that another family has. Ask the closest family instead.
        let closest = match (config.moe.is_some(), config.qkv_bias, config.qk_norm) {
            (false, true, false) => Arch::Qwen2,
            (false, false, true) => Arch::Qwen3,
            (true, true, false) => Arch::Qwen2Moe,
            (true, false, true) => Arch::Qwen3Moe,
            _ => first,
        };
        let (setting, value) = closest.mismatch(config).unwrap_or(("architecture", "unknown".into()));
        Err((closest, setting, value))
    }

    /// [`Arch::recognize`] of the model of the checkpoint at `path`, its refusal the error that
    /// names the checkpoint, the closest family and the setting.
    pub(crate) fn recognized(config: &ModelConfig, path: &std::path::Path) -> crate::Result<Arch> {
        Arch::recognize(config).map_err(|(a, setting, value)| crate::Error::NoHfArchitecture {
            path: path.to_path_buf(),
            arch: Some(a.name()),
            setting,
            value,
        })
    }
}

impl std::str::FromStr for Arch {
    type Err = String;

    /// A family by its `model_type` (`llama`, `qwen2_moe`; `-` taken as `_`).
    fn from_str(s: &str) -> std::result::Result<Arch, String> {
        Arch::from_name(s).ok_or_else(|| {
            let names: Vec<String> = Arch::ALL.iter().map(|a| format!("`{a}`")).collect();
            format!("the architecture is one of {}, not `{}`", names.join(", "), s.escape_debug())
        })
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests;
