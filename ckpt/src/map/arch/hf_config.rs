//! A Hugging Face model folder's `config.json`, from a [`ModelConfig`]: what
//! `PretrainedConfig.save_pretrained` writes for the family, every hyperparameter the modeling
//! code reads. Both spellings transformers has used are written where they differ
//! (`rope_theta` and 5.x's `rope_parameters`, `torch_dtype` and 5.x's `dtype`), so that 4.x
//! and 5.x, vLLM and SGLang read the same model.

use serde_json::{json, Map, Value};

use super::{Arch, ModelConfig};
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
