use super::*;

/// A tiny Llama-style model: RMSNorm, SwiGLU, grouped-query attention, no biases.
pub(crate) fn llama() -> ModelConfig {
    ModelConfig {
        num_layers: 4,
        hidden_size: 64,
        ffn_hidden_size: 128,
        num_attention_heads: 8,
        num_query_groups: 2,
        head_dim: 8,
        vocab_size: 128,
        unpadded_vocab_size: None,
        max_position_embeddings: 256,
        norm_eps: 1e-5,
        norm: NormKind::RmsNorm,
        rope_theta: 10000.0,
        tied_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        swiglu: true,
        moe: None,
        dtype: Dtype::F32,
    }
}

fn moe(shared: bool) -> MoeConfig {
    MoeConfig {
        num_experts: 4,
        top_k: 2,
        ffn_hidden_size: 32,
        shared_expert_ffn_hidden_size: shared.then_some(64),
        shared_expert_gate: shared,
        moe_layers: vec![true; 4],
        norm_topk_prob: true,
    }
}

#[test]
fn each_family_is_recognized_from_the_settings_that_pick_it() {
    let cases: Vec<(ModelConfig, Arch)> = vec![
        (llama(), Arch::Llama),
        (ModelConfig { qkv_bias: true, ..llama() }, Arch::Qwen2),
        (ModelConfig { qk_norm: true, ..llama() }, Arch::Qwen3),
        (ModelConfig { moe: Some(moe(false)), ..llama() }, Arch::Mixtral),
        (ModelConfig { moe: Some(moe(true)), qkv_bias: true, ..llama() }, Arch::Qwen2Moe),
        (ModelConfig { moe: Some(moe(false)), qk_norm: true, ..llama() }, Arch::Qwen3Moe),
    ];
    for (config, arch) in cases {
        assert_eq!(Arch::recognize(&config), Ok(arch), "{arch}");
        assert_eq!(arch.mismatch(&config), None, "{arch}");
    }
}

/// The setting a model no family holds is refused for.
fn recognize(config: &ModelConfig) -> std::result::Result<Arch, (&'static str, String)> {
    Arch::recognize(config).map_err(|(_, setting, value)| (setting, value))
}

#[test]
fn a_model_no_family_holds_is_refused_naming_the_setting() {
    let layer_norm = ModelConfig { norm: NormKind::LayerNorm, ..llama() };
    assert_eq!(recognize(&layer_norm), Err(("normalization", "LayerNorm".to_string())));
    let gelu = ModelConfig { swiglu: false, ..llama() };
    assert_eq!(recognize(&gelu), Err(("swiglu", "off".to_string())));
    let both = ModelConfig { qkv_bias: true, qk_norm: true, ..llama() };
    assert_eq!(recognize(&both), Err(("add_qkv_bias", "on".to_string())));
    let mut dense_first = moe(false);
    dense_first.moe_layers[0] = false;
    // A dense first layer is Qwen-MoE's, which has q/k norm or QKV bias; Mixtral has neither.
    let mixtral_dense = ModelConfig { moe: Some(dense_first), ..llama() };
    assert_eq!(recognize(&mixtral_dense), Err(("moe_layer_freq", "a dense layer".to_string())));
    let shared_mixtral = ModelConfig { moe: Some(moe(true)), ..llama() };
    assert_eq!(recognize(&shared_mixtral), Err(("moe_shared_expert_intermediate_size", "set".to_string())));
}

#[test]
fn a_named_family_says_what_it_cannot_hold() {
    assert_eq!(Arch::Mixtral.mismatch(&llama()), Some(("num_experts", "none".to_string())));
    assert_eq!(
        Arch::Llama.mismatch(&ModelConfig { moe: Some(moe(false)), ..llama() }),
        Some(("num_experts", "4".into()))
    );
    assert_eq!(Arch::Qwen2.mismatch(&llama()), Some(("add_qkv_bias", "off".to_string())));
}

#[test]
fn arch_names_are_hugging_faces_model_types() {
    for a in Arch::ALL {
        assert_eq!(Arch::from_name(a.name()), Some(a));
    }
    assert_eq!(Arch::from_name("Qwen2-MoE"), Some(Arch::Qwen2Moe));
    assert_eq!(Arch::from_name("gpt2"), None);
    assert_eq!(Arch::Qwen3Moe.class(), "Qwen3MoeForCausalLM");
}

#[test]
fn layers_are_moe_where_the_config_says() {
    let mut m = moe(false);
    m.moe_layers[0] = false;
    let c = ModelConfig { moe: Some(m), ..llama() };
    assert!(!c.is_moe_layer(0));
    assert!(c.is_moe_layer(1));
    assert!(!c.is_moe_layer(9));
    assert!(!llama().is_moe_layer(1));
    assert_eq!(llama().heads_per_group(), 4);
}
