//! The model a Megatron-LM save holds, as the format-neutral [`ModelConfig`]: read from the
//! `args` Megatron-LM's `save_checkpoint` saves (its command line after `validate_args`), the
//! vocabulary's padded rows and the dtype from the word embeddings as stored.
//!
//! Settings that change what the model computes and that no Hugging Face family of the tables
//! has (learned positions, partial or interleaved rotary embeddings, linear biases, sigmoid
//! routers, multi-latent attention, ...) are refused here by their argument's name, before any
//! family is asked; the families then refuse what tells them apart ([`Arch::mismatch`]).

use std::path::Path;

use crate::error::{Error, Result};
use crate::map::arch::{ModelConfig, MoeConfig, NormKind};
use crate::read::catalog::Checkpoint;
use crate::read::value::Leaf;

use super::info::{self, lookup, uint, Megatron};

/// The word embeddings' one-rank name, whose rows are the padded vocabulary.
const EMBEDDING: &str = "embedding.word_embeddings.weight";

/// The saved `args` of `ck`, a Megatron checkpoint, where Megatron-LM saved them, and the file
/// (a legacy rank's) or folder (a `torch_dist` iteration) they were read from.
fn args(ck: &Checkpoint) -> Option<(&Path, &Leaf)> {
    let m = ck.detail::<Megatron>()?;
    if let Some(dcp) = &m.dcp {
        return info::saved_args(dcp);
    }
    m.legacy.as_ref().and_then(|r| r.args())
}

/// The model `ck` (a Megatron checkpoint) holds, from its saved `args`.
pub(super) fn model_config(ck: &Checkpoint) -> Result<ModelConfig> {
    // The tables read the model as megatron holds it on one rank; `as_stored` shows the stored
    // keys (stacked layers) instead.
    if ck.tensors.iter().any(|t| super::names::stacked(&t.name).is_some()) {
        let misuse = crate::Misuse::NotForHf { extra: crate::Opt::AsStored };
        return Err(Error::Misuse { path: ck.root.clone(), misuse });
    }
    let Some((args_path, args)) = args(ck) else {
        let path = ck.root.clone();
        return Err(Error::BadMegatron {
            path,
            key: None,
            rank: None,
            reason: "the checkpoint holds no saved `args` (Megatron-LM's `save_checkpoint` saves them; a bare \
             `dist_checkpointing.save` does not), so its heads, query groups and norms are not known"
                .into(),
        });
    };
    // Settings are refused naming the file that saved them.
    let path = args_path.to_path_buf();
    let bad = |key: Option<String>, reason: String| Error::BadMegatron { path: path.clone(), key, rank: None, reason };
    let arg = |name: &str| lookup(args, &[name]);
    let num = |name: &str| uint(arg(name));
    let need = |name: &str| {
        num(name)
            .filter(|n| *n > 0)
            .ok_or_else(|| bad(None, format!("the saved `args.{name}` is missing or not a positive number")))
    };
    let text = |name: &str| match arg(name) {
        Some(Leaf::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let on = |name: &str| matches!(arg(name), Some(Leaf::Bool(true)));
    let set = |name: &str| !matches!(arg(name), None | Some(Leaf::None) | Some(Leaf::Bool(false)));
    let float = |name: &str| match arg(name) {
        Some(Leaf::Float(f)) => Some(*f),
        Some(Leaf::Int(i)) => Some(*i as f64),
        _ => None,
    };
    let refuse = |setting: &'static str, value: String| Error::NoHfArchitecture {
        path: path.clone(),
        arch: None,
        setting,
        value,
    };

    // What no family has.
    if let Some(p) = text("position_embedding_type").filter(|p| p != "rope") {
        return Err(refuse("position_embedding_type", format!("`{}`", p.escape_debug())));
    }
    if let Some(p) = float("rotary_percent").filter(|p| *p != 1.0) {
        return Err(refuse("rotary_percent", p.to_string()));
    }
    for flag in [
        "rotary_interleaved",
        "use_rope_scaling",
        "add_bias_linear",
        "apply_layernorm_1p",
        "multi_latent_attention",
        "qk_l2_norm",
        "attention_output_gate",
        "squared_relu",
        "moe_router_enable_expert_bias",
    ] {
        if on(flag) {
            return Err(refuse(flag, "on".into()));
        }
    }
    for setting in [
        "window_size",
        "mtp_num_layers",
        "experimental_attention_variant",
        "heterogeneous_layers_config_path",
        "mrope_section",
        "moe_router_num_groups",
    ] {
        if set(setting) {
            return Err(refuse(setting, "set".into()));
        }
    }
    if let Some(f) = text("moe_router_score_function").filter(|f| f != "softmax").filter(|_| set("num_experts")) {
        return Err(refuse("moe_router_score_function", format!("`{}`", f.escape_debug())));
    }
    if let Some(s) = float("moe_router_topk_scaling_factor").filter(|s| *s != 1.0) {
        return Err(refuse("moe_router_topk_scaling_factor", s.to_string()));
    }

    let num_layers = need("num_layers")?;
    let hidden_size = need("hidden_size")?;
    let num_attention_heads = need("num_attention_heads")?;
    let num_query_groups = match arg("group_query_attention") {
        Some(Leaf::Bool(false)) => num_attention_heads,
        _ => num("num_query_groups").unwrap_or(num_attention_heads),
    };
    if num_query_groups == 0 || num_attention_heads % num_query_groups != 0 {
        return Err(bad(
            None,
            format!("`args.num_query_groups` ({num_query_groups}) does not divide `args.num_attention_heads` ({num_attention_heads})"),
        ));
    }
    let head_dim = num("kv_channels").unwrap_or(hidden_size / num_attention_heads);
    let ffn_hidden_size = num("ffn_hidden_size").unwrap_or(4 * hidden_size);
    let Some(embedding) = ck.tensors.iter().find(|t| t.name == EMBEDDING) else {
        return Err(bad(Some(EMBEDDING.into()), "the checkpoint holds no word embeddings".into()));
    };
    let vocab_size = embedding.shape.first().copied().unwrap_or(0);
    let norm = match text("normalization").as_deref() {
        None | Some("LayerNorm") => NormKind::LayerNorm,
        Some("RMSNorm") => NormKind::RmsNorm,
        Some(other) => return Err(refuse("normalization", format!("`{}`", other.escape_debug()))),
    };
    let moe = match num("num_experts").filter(|e| *e > 0) {
        None => None,
        Some(num_experts) => Some(MoeConfig {
            num_experts,
            top_k: num("moe_router_topk").unwrap_or(2),
            ffn_hidden_size: num("moe_ffn_hidden_size").unwrap_or(ffn_hidden_size),
            shared_expert_ffn_hidden_size: num("moe_shared_expert_intermediate_size").filter(|n| *n > 0),
            shared_expert_gate: on("moe_shared_expert_gate"),
            moe_layers: moe_layers(arg("moe_layer_freq"), num_layers)
                .map_err(|reason| bad(None, format!("`args.moe_layer_freq`: {reason}")))?,
            // Top-k then softmax (megatron's default) weighs the chosen experts to one; softmax
            // first (`moe_router_pre_softmax`) keeps their share of all experts.
            norm_topk_prob: !on("moe_router_pre_softmax"),
        }),
    };
    Ok(ModelConfig {
        num_layers,
        hidden_size,
        ffn_hidden_size,
        num_attention_heads,
        num_query_groups,
        head_dim,
        vocab_size,
        unpadded_vocab_size: num("vocab_size"),
        max_position_embeddings: num("max_position_embeddings").or(num("seq_length")).unwrap_or(4096),
        norm_eps: float("norm_epsilon").or(float("layernorm_epsilon")).unwrap_or(1e-5),
        norm,
        rope_theta: float("rotary_base").unwrap_or(10000.0),
        tied_embeddings: !on("untie_embeddings_and_output_weights"),
        qkv_bias: on("add_qkv_bias"),
        qk_norm: on("qk_layernorm"),
        swiglu: on("swiglu"),
        moe,
        dtype: embedding.dtype,
    })
}

/// Which layers are MoE layers, from `moe_layer_freq`: every `k`th layer from the first, or a
/// list of one 0/1 per layer (what `--moe-layer-freq` parses into).
fn moe_layers(freq: Option<&Leaf>, layers: u64) -> std::result::Result<Vec<bool>, String> {
    match freq {
        None | Some(Leaf::None) => Ok(vec![true; layers as usize]),
        Some(Leaf::Int(k)) if *k > 0 => Ok((0..layers).map(|l| l % (*k as u64) == 0).collect()),
        Some(Leaf::List(items)) if items.len() as u64 == layers => items
            .iter()
            .map(|i| match i {
                Leaf::Int(0) => Ok(false),
                Leaf::Int(1) => Ok(true),
                _ => Err("the list holds something other than 0 and 1".to_string()),
            })
            .collect(),
        Some(Leaf::List(items)) => Err(format!("the list has {} entries for {layers} layers", items.len())),
        Some(_) => Err("neither a positive number nor a list of 0 and 1".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moe_layer_freq_is_a_step_or_a_list() {
        assert_eq!(moe_layers(Some(&Leaf::Int(1)), 3), Ok(vec![true, true, true]));
        assert_eq!(moe_layers(Some(&Leaf::Int(2)), 4), Ok(vec![true, false, true, false]));
        let list = Leaf::List(vec![Leaf::Int(0), Leaf::Int(1), Leaf::Int(1)]);
        assert_eq!(moe_layers(Some(&list), 3), Ok(vec![false, true, true]));
        assert!(moe_layers(Some(&list), 4).is_err());
        assert!(moe_layers(Some(&Leaf::Int(0)), 4).is_err());
    }
}
