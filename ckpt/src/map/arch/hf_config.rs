//! A Hugging Face model folder's `config.json`, both ways.
//!
//! Written from a [`ModelConfig`] ([`config_json`]): what `PretrainedConfig.save_pretrained`
//! writes for the family, every hyperparameter the modeling code reads. Both spellings
//! transformers has used are written where they differ (`rope_theta` and 5.x's
//! `rope_parameters`, `torch_dtype` and 5.x's `dtype`), so that 4.x and 5.x, vLLM and SGLang read
//! the same model.
//!
//! Read into a [`ModelConfig`] ([`parse`]), as transformers 5.x writes it for the families of
//! [`Arch`] (4.x's top-level `rope_theta` and `torch_dtype` are read too). The family is the
//! config's `model_type`; what the family implies and the config does not spell out (Qwen2's QKV
//! biases, Qwen3's q/k norms) comes from it. A setting the family has with no counterpart in the
//! model tables (an activation other than SiLU, Llama's `attention_bias`, sliding windows) is
//! refused naming it.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::{Arch, ModelConfig, MoeConfig, NormKind};
use crate::error::{Error, HfConfigProblem as P, Result};
use crate::read::dtype::Dtype;

/// torch's name of a dtype, as `config.json` spells it.
fn torch_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F64 => "float64",
        Dtype::F16 => "float16",
        Dtype::BF16 => "bfloat16",
        _ => "float32",
    }
}

/// The `config.json` of family `arch` for a model of `config` with `vocab` rows of vocabulary,
/// its weights written as `dtype`.
pub(crate) fn config_json(config: &ModelConfig, arch: Arch, vocab: u64, dtype: Dtype) -> Value {
    let c = config;
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("architectures", json!([arch.class()]));
    put("model_type", json!(arch.name()));
    put("vocab_size", json!(vocab));
    put("hidden_size", json!(c.hidden_size));
    put("num_hidden_layers", json!(c.num_layers));
    put("num_attention_heads", json!(c.num_attention_heads));
    put("num_key_value_heads", json!(c.num_query_groups));
    put("head_dim", json!(c.head_dim));
    put("hidden_act", json!("silu"));
    put("max_position_embeddings", json!(c.max_position_embeddings));
    put("rms_norm_eps", json!(c.norm_eps));
    put("rope_theta", json!(c.rope_theta));
    put("rope_parameters", json!({"rope_type": "default", "rope_theta": c.rope_theta}));
    put("rope_scaling", Value::Null);
    put("tie_word_embeddings", json!(c.tied_embeddings));
    put("attention_dropout", json!(0.0));
    put("initializer_range", json!(0.02));
    put("use_cache", json!(true));
    put("torch_dtype", json!(torch_name(dtype)));
    put("dtype", json!(torch_name(dtype)));
    let dense_layers: Vec<u64> = (0..c.num_layers).filter(|l| !c.is_moe_layer(*l)).collect();
    match arch {
        Arch::Llama => {
            put("intermediate_size", json!(c.ffn_hidden_size));
            put("attention_bias", json!(false));
            put("mlp_bias", json!(false));
            put("pretraining_tp", json!(1));
        }
        Arch::Qwen2 | Arch::Qwen3 => {
            put("intermediate_size", json!(c.ffn_hidden_size));
            put("use_sliding_window", json!(false));
            put("sliding_window", Value::Null);
            put("max_window_layers", json!(c.num_layers));
            if arch == Arch::Qwen3 {
                put("attention_bias", json!(false));
            }
        }
        Arch::Mixtral => {
            if let Some(moe) = &c.moe {
                put("intermediate_size", json!(moe.ffn_hidden_size));
                put("num_local_experts", json!(moe.num_experts));
                put("num_experts_per_tok", json!(moe.top_k));
            }
            put("sliding_window", Value::Null);
            put("router_aux_loss_coef", json!(0.0));
            put("output_router_logits", json!(false));
        }
        Arch::Qwen2Moe | Arch::Qwen3Moe => {
            put("intermediate_size", json!(c.ffn_hidden_size));
            if let Some(moe) = &c.moe {
                put("moe_intermediate_size", json!(moe.ffn_hidden_size));
                put("num_experts", json!(moe.num_experts));
                put("num_experts_per_tok", json!(moe.top_k));
                put("norm_topk_prob", json!(moe.norm_topk_prob));
                if let Some(shared) = moe.shared_expert_ffn_hidden_size {
                    put("shared_expert_intermediate_size", json!(shared));
                }
            }
            put("decoder_sparse_step", json!(1));
            put("mlp_only_layers", json!(dense_layers));
            put("use_sliding_window", json!(false));
            put("sliding_window", Value::Null);
            put("max_window_layers", json!(c.num_layers));
            put("router_aux_loss_coef", json!(0.0));
            put("output_router_logits", json!(false));
            if arch == Arch::Qwen2Moe {
                put("qkv_bias", json!(true));
            } else {
                put("attention_bias", json!(false));
            }
        }
    }
    Value::Object(m)
}

/// The longest `config.json` read (a real one is a few KiB).
pub(crate) const MAX_CONFIG_LEN: u64 = 1 << 20;

/// The model `config.json` (its bytes `data`, read from `path`) describes, and its family.
pub(crate) fn parse(path: &Path, data: &[u8]) -> Result<(ModelConfig, Arch)> {
    let bad = |key: &str, problem: P| Error::BadHfConfig { path: path.to_path_buf(), key: key.into(), problem };
    let json: Value =
        serde_json::from_slice(data).map_err(|e| bad("config.json", P::NotJson { cause: e.to_string() }))?;
    let get = |key: &str| json.get(key).filter(|v| !v.is_null());
    let uint = |key: &str| -> Result<Option<u64>> {
        match get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| bad(key, P::NotANumber { found: v.to_string() })),
        }
    };
    let need = |key: &str| -> Result<u64> { uint(key)?.ok_or_else(|| bad(key, P::Missing)) };
    let float = |key: &str| get(key).and_then(Value::as_f64);
    let flag = |key: &str| get(key).and_then(Value::as_bool);

    let model_type = get("model_type").and_then(Value::as_str).unwrap_or_default();
    let arch = Arch::from_name(model_type)
        .ok_or_else(|| bad("model_type", P::UnknownFamily { found: model_type.to_string(), known: families() }))?;
    if let Some(act) = get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu") {
        return Err(bad("hidden_act", P::Activation { found: act.to_string() }));
    }
    for key in ["attention_bias", "mlp_bias", "use_sliding_window"] {
        if flag(key) == Some(true) {
            return Err(bad(key, P::NoPlace { family: arch.name() }));
        }
    }
    let hidden_size = need("hidden_size")?;
    let num_attention_heads = need("num_attention_heads")?;
    if num_attention_heads == 0 {
        return Err(bad("num_attention_heads", P::Heads { found: 0 }));
    }
    let num_query_groups = uint("num_key_value_heads")?.unwrap_or(num_attention_heads);
    if num_query_groups == 0 || !num_attention_heads.is_multiple_of(num_query_groups) {
        return Err(bad("num_key_value_heads", P::Heads { found: num_query_groups }));
    }
    let num_layers = need("num_hidden_layers")?;
    let rope = get("rope_parameters").and_then(|r| r.get("rope_theta")).and_then(Value::as_f64);
    let dtype_name = get("dtype").or_else(|| get("torch_dtype")).and_then(Value::as_str).unwrap_or("float32");
    let dtype = match dtype_name {
        "float32" => Dtype::F32,
        "bfloat16" => Dtype::BF16,
        "float16" => Dtype::F16,
        other => return Err(bad("dtype", P::Dtype { found: other.to_string() })),
    };
    let moe = match arch {
        Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe => Some(moe_of(&json, arch, num_layers, path)?),
        _ => None,
    };
    let config = ModelConfig {
        num_layers,
        hidden_size,
        ffn_hidden_size: need("intermediate_size")?,
        num_attention_heads,
        num_query_groups,
        head_dim: uint("head_dim")?.unwrap_or(hidden_size / num_attention_heads),
        vocab_size: need("vocab_size")?,
        unpadded_vocab_size: None,
        max_position_embeddings: uint("max_position_embeddings")?.unwrap_or(4096),
        norm_eps: float("rms_norm_eps").unwrap_or(1e-6),
        norm: NormKind::RmsNorm,
        rope_theta: rope.or_else(|| float("rope_theta")).unwrap_or(10000.0),
        tied_embeddings: flag("tie_word_embeddings").unwrap_or(false),
        qkv_bias: matches!(arch, Arch::Qwen2 | Arch::Qwen2Moe),
        qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
        swiglu: true,
        moe,
        dtype,
    };
    Ok((config, arch))
}

fn families() -> String {
    Arch::ALL.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", ")
}

/// The experts of an MoE family's config: Mixtral's `num_local_experts` in every layer; Qwen's
/// `num_experts`, with dense layers where `mlp_only_layers` lists them or `decoder_sparse_step`
/// skips them, and Qwen2-MoE's gated shared expert.
fn moe_of(json: &Value, arch: Arch, num_layers: u64, path: &Path) -> Result<MoeConfig> {
    let bad = |key: &str, problem: P| Error::BadHfConfig { path: path.to_path_buf(), key: key.into(), problem };
    let uint = |key: &str| json.get(key).and_then(Value::as_u64);
    let need = |key: &str| match json.get(key) {
        None => Err(bad(key, P::Missing)),
        Some(v) => v.as_u64().ok_or_else(|| bad(key, P::NotANumber { found: v.to_string() })),
    };
    // Mixtral says `num_local_experts`; Qwen's MoE configs `num_experts`, except transformers
    // 5.x's Qwen3-MoE, which writes Mixtral's name.
    let (first, other) = match arch {
        Arch::Mixtral => ("num_local_experts", "num_experts"),
        _ => ("num_experts", "num_local_experts"),
    };
    let num_experts = need(if json.get(first).is_some() || json.get(other).is_none() { first } else { other })?;
    let top_k = need("num_experts_per_tok")?;
    let ffn_key = if arch == Arch::Mixtral { "intermediate_size" } else { "moe_intermediate_size" };
    let ffn_hidden_size = need(ffn_key)?;
    let step = uint("decoder_sparse_step").unwrap_or(1).max(1);
    let dense: Vec<u64> = json
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let moe_layers = (0..num_layers).map(|l| !dense.contains(&l) && (l + 1).is_multiple_of(step)).collect();
    let shared = match arch {
        Arch::Qwen2Moe => uint("shared_expert_intermediate_size").filter(|s| *s > 0),
        _ => None,
    };
    Ok(MoeConfig {
        num_experts,
        top_k,
        ffn_hidden_size,
        shared_expert_ffn_hidden_size: shared,
        shared_expert_gate: shared.is_some(),
        moe_layers,
        norm_topk_prob: json.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(arch == Arch::Mixtral),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn config(arch: &str) -> (std::path::PathBuf, Vec<u8>) {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/megatron_arch/hf")
            .join(arch)
            .join("config.json");
        let data = std::fs::read(&path).unwrap();
        (path, data)
    }

    #[test]
    fn transformers_configs_give_the_model_and_its_family() {
        let (path, data) = config("llama");
        let (c, arch) = parse(&path, &data).unwrap();
        assert_eq!(arch, Arch::Llama);
        assert_eq!((c.num_layers, c.hidden_size, c.ffn_hidden_size), (2, 32, 64));
        assert_eq!((c.num_attention_heads, c.num_query_groups, c.head_dim), (4, 2, 8));
        assert_eq!((c.vocab_size, c.rope_theta, c.norm_eps), (128, 500000.0, 1e-6));
        assert!(!c.tied_embeddings && !c.qkv_bias && !c.qk_norm && c.moe.is_none());
        assert_eq!(Arch::recognize(&c), Ok(Arch::Llama));
        for (name, family) in [("qwen2", Arch::Qwen2), ("qwen3", Arch::Qwen3), ("mixtral", Arch::Mixtral)] {
            let (path, data) = config(name);
            let (c, arch) = parse(&path, &data).unwrap();
            assert_eq!(arch, family);
            assert_eq!(arch.mismatch(&c), None, "{name}");
        }
        let (path, data) = config("qwen2_moe");
        let (c, arch) = parse(&path, &data).unwrap();
        assert_eq!(arch.mismatch(&c), None);
        let moe = c.moe.unwrap();
        assert!(moe.shared_expert_gate && moe.moe_layers.first() == Some(&false), "{moe:?}");
    }

    #[test]
    fn a_setting_the_tables_have_no_place_for_is_refused_naming_it() {
        let (path, data) = config("llama");
        let mut json: serde_json::Value = serde_json::from_slice(&data).unwrap();
        json["hidden_act"] = "gelu".into();
        let err = parse(&path, json.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().ends_with("`hidden_act` is `gelu`; the tables read SiLU-gated MLPs"), "{err}");
        json["hidden_act"] = "silu".into();
        json["model_type"] = "gpt2".into();
        let err = parse(&path, json.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().contains("`model_type` is `gpt2`, not one of the families read"), "{err}");
        json["model_type"] = "llama".into();
        json["num_key_value_heads"] = 3.into();
        let err = parse(&path, json.to_string().as_bytes()).unwrap_err();
        assert!(err.to_string().contains("`num_key_value_heads` is 3, which does not divide the heads"), "{err}");
    }
}
