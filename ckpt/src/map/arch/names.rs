//! The tensor names of each side: Megatron-Core's (the model megatron holds on one rank, and
//! the keys a `torch_dist` save stores) and the Hugging Face Hub's, per family.
//!
//! Megatron's one-rank names are its `model.state_dict()` keys of a world-size-1 `GPTModel`
//! built with the local layer spec (`get_gpt_layer_local_spec`; experts as `SequentialMLP`),
//! `_extra_state` left out. Its `torch_dist` saves store alike layers as one tensor per key with
//! a leading layer axis (`decoder.layers.<within>`), norms under TransformerEngine's names
//! (`input_layernorm.weight` is `self_attention.linear_qkv.layer_norm_weight`,
//! `pre_mlp_layernorm.weight` is `mlp.linear_fc1.layer_norm_weight`, in MoE layers too), and
//! experts stacked a second time (`decoder.layers.mlp.experts.experts.linear_fc1.weight`,
//! `[layers, experts, rows, cols]`).
//!
//! The Hub names are those published checkpoints use, which transformers 4.x and 5.x, vLLM and
//! SGLang load (5.x fuses experts on load from these per-expert names):
//! `model.layers.N.self_attn.q_proj.weight`, Mixtral's
//! `model.layers.N.block_sparse_moe.experts.E.w1.weight`, Qwen-MoE's
//! `model.layers.N.mlp.experts.E.gate_proj.weight` and `mlp.shared_expert_gate.weight`.

use super::Arch;

/// Megatron's one-rank name of `within` (a module path and parameter) in layer `layer`.
pub(crate) fn mcore_layer(layer: u64, within: &str) -> String {
    format!("decoder.layers.{layer}.{within}")
}

/// Megatron's one-rank name of expert `expert`'s `param` (`linear_fc1.weight`) in layer `layer`.
pub(crate) fn mcore_expert(layer: u64, expert: u64, param: &str) -> String {
    format!("decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{param}")
}

/// Megatron's word embeddings, output layer and final norm (one-rank and stored alike).
pub(crate) const MCORE_EMBEDDING: &str = "embedding.word_embeddings.weight";
pub(crate) const MCORE_OUTPUT: &str = "output_layer.weight";
pub(crate) const MCORE_FINAL_NORM: &str = "decoder.final_layernorm.weight";

/// The stored key within a layer of a one-rank module path: TransformerEngine's names of the
/// norms fused into the next linear, the rest as they are.
pub(crate) fn stored_within(module: &str) -> String {
    const FUSED: &[(&str, &str)] = &[
        ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
        ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ];
    for (local, te) in FUSED {
        if let Some(rest) = module.strip_prefix(local) {
            return format!("{te}{rest}");
        }
    }
    module.to_string()
}

/// A stored key of a block of alike layers: `decoder.layers.<within>` (`within` as stored).
pub(crate) fn stored_stacked(within: &str) -> String {
    format!("decoder.layers.{}", stored_within(within))
}

/// A stored key of one layer of a model whose layers differ: `decoder.layers.N.<within>`.
pub(crate) fn stored_layer(layer: u64, within: &str) -> String {
    format!("decoder.layers.{layer}.{}", stored_within(within))
}

/// The stored key of the experts' `param` (`linear_fc1.weight`) stacked over layers and experts.
pub(crate) fn stored_experts(param: &str) -> String {
    format!("decoder.layers.mlp.experts.experts.{param}")
}

/// The stored key of the experts' `param` of layer `layer`, stacked over experts (per-layer keys).
pub(crate) fn stored_layer_experts(layer: u64, param: &str) -> String {
    format!("decoder.layers.{layer}.mlp.experts.experts.{param}")
}

/// The Hub's names of one family.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hub {
    pub arch: Arch,
}

impl Hub {
    pub(crate) fn embedding(self) -> String {
        "model.embed_tokens.weight".into()
    }
    pub(crate) fn lm_head(self) -> String {
        "lm_head.weight".into()
    }
    pub(crate) fn final_norm(self) -> String {
        "model.norm.weight".into()
    }
    /// A tensor of layer `layer` under the layer's prefix (`self_attn.q_proj.weight`).
    pub(crate) fn layer(self, layer: u64, within: &str) -> String {
        format!("model.layers.{layer}.{within}")
    }
    /// The MoE block of layer `layer`: Mixtral's `block_sparse_moe`, Qwen's `mlp`.
    fn moe(self, layer: u64) -> String {
        match self.arch {
            Arch::Mixtral => format!("model.layers.{layer}.block_sparse_moe"),
            _ => format!("model.layers.{layer}.mlp"),
        }
    }
    /// The router of layer `layer`.
    pub(crate) fn router(self, layer: u64) -> String {
        format!("{}.gate.weight", self.moe(layer))
    }
    /// Expert `expert`'s gate, up and down projections in layer `layer` (Mixtral's w1, w3, w2).
    pub(crate) fn expert(self, layer: u64, expert: u64) -> [String; 3] {
        let p = format!("{}.experts.{expert}", self.moe(layer));
        match self.arch {
            Arch::Mixtral => [format!("{p}.w1.weight"), format!("{p}.w3.weight"), format!("{p}.w2.weight")],
            _ => [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight"), format!("{p}.down_proj.weight")],
        }
    }
    /// The shared expert's gate, up and down projections in layer `layer` (Qwen2-MoE).
    pub(crate) fn shared_expert(self, layer: u64) -> [String; 3] {
        let p = format!("{}.shared_expert", self.moe(layer));
        [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight"), format!("{p}.down_proj.weight")]
    }
    /// The shared expert's sigmoid gate in layer `layer` (Qwen2-MoE).
    pub(crate) fn shared_expert_gate(self, layer: u64) -> String {
        format!("{}.shared_expert_gate.weight", self.moe(layer))
    }
}
