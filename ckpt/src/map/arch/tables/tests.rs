#![allow(clippy::unwrap_used)]

use super::*;
use crate::map::arch::{MoeConfig, NormKind};
use crate::read::catalog::{Chunk, TensorData};
use crate::read::dtype::Dtype;

fn llama() -> ModelConfig {
    ModelConfig {
        num_layers: 3,
        hidden_size: 8,
        ffn_hidden_size: 12,
        num_attention_heads: 4,
        num_query_groups: 2,
        head_dim: 2,
        vocab_size: 16,
        unpadded_vocab_size: None,
        max_position_embeddings: 32,
        norm_eps: 1e-6,
        norm: NormKind::RmsNorm,
        rope_theta: 1e6,
        tied_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        swiglu: true,
        moe: None,
        dtype: Dtype::F32,
    }
}

fn moe(shared: bool, dense_first: bool) -> MoeConfig {
    MoeConfig {
        num_experts: 3,
        top_k: 2,
        ffn_hidden_size: 4,
        shared_expert_ffn_hidden_size: shared.then_some(6),
        shared_expert_gate: shared,
        moe_layers: vec![!dense_first, true, true],
        norm_topk_prob: true,
    }
}

/// Every case the tables cover: each family, tied and untied, stacked and per-layer keys.
fn cases() -> Vec<(&'static str, ModelConfig, Arch)> {
    vec![
        ("llama", llama(), Arch::Llama),
        ("tied llama", ModelConfig { tied_embeddings: true, ..llama() }, Arch::Llama),
        ("qwen2", ModelConfig { qkv_bias: true, ..llama() }, Arch::Qwen2),
        ("qwen3", ModelConfig { qk_norm: true, tied_embeddings: true, ..llama() }, Arch::Qwen3),
        ("mixtral", ModelConfig { moe: Some(moe(false, false)), ..llama() }, Arch::Mixtral),
        ("qwen2_moe", ModelConfig { qkv_bias: true, moe: Some(moe(true, true)), ..llama() }, Arch::Qwen2Moe),
        ("qwen3_moe", ModelConfig { qk_norm: true, moe: Some(moe(false, true)), ..llama() }, Arch::Qwen3Moe),
    ]
}

/// Tensors of the given names and shapes, each alone in its own file (file `i` for the `i`th),
/// so that an element's address names its tensor and index.
fn stored(tensors: &[(String, Vec<u64>)]) -> Vec<TensorInfo> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let len = shape.iter().product::<u64>() * 4;
            TensorInfo::ranges(name.clone(), Dtype::F32, shape.clone(), vec![Chunk { file: i, offset: 0, len }])
        })
        .collect()
}

/// Where each element of `t` is stored, in row-major order: (file, byte offset).
fn addresses(t: &TensorInfo) -> Vec<(usize, u64)> {
    let n: u64 = t.shape.iter().product();
    let mut out = vec![(usize::MAX, 0); n as usize];
    let strides = crate::read::shape::contiguous_strides(&t.shape).unwrap();
    match &t.data {
        TensorData::Ranges(chunks) => {
            let mut at = 0u64;
            for c in chunks {
                for k in 0..c.len / 4 {
                    out[(at + k) as usize] = (c.file, c.offset + 4 * k);
                }
                at += c.len / 4;
            }
        }
        TensorData::Boxes(boxes) => {
            for b in boxes {
                let count: u64 = b.region.sizes.iter().product();
                for k in 0..count {
                    let mut rest = k;
                    let mut idx = vec![0; b.region.sizes.len()];
                    for (i, &s) in idx.iter_mut().zip(&b.region.sizes).rev() {
                        *i = rest % s;
                        rest /= s;
                    }
                    let flat: u64 =
                        idx.iter().zip(&b.region.offsets).zip(&strides).map(|((i, o), s)| (i + o) * s).sum();
                    let elem: u64 = b.offset + idx.iter().zip(&b.strides).map(|(i, s)| i * s).sum::<u64>();
                    out[flat as usize] = (b.file, b.base + 4 * elem);
                }
            }
        }
    }
    out
}

/// The one-rank tensors of a model whose stored keys are `stored` (megatron's own unstacking,
/// written out here as the layout says: the layer axis, then the expert axis, taken out).
fn one_rank(config: &ModelConfig, stored: &[TensorInfo]) -> Vec<TensorInfo> {
    let module = |within: &str| {
        within
            .replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
            .replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    };
    let mut map = ModelMap::new("one-rank model");
    for t in stored {
        let name = t.name.as_str();
        if let Some(param) = name.strip_prefix("decoder.layers.mlp.experts.experts.") {
            for l in 0..t.shape[0] {
                for e in 0..t.shape[1] {
                    let target = names::mcore_expert(l, e, param);
                    map.push(Target::new(
                        target,
                        t.shape[2..].to_vec(),
                        vec![Piece::indices(name, &t.shape, &[(0, l), (1, e)])],
                    ));
                }
            }
        } else if let Some(rest) =
            name.strip_prefix("decoder.layers.").filter(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        {
            let (l, within) = rest.split_once('.').unwrap();
            if let Some(param) = within.strip_prefix("mlp.experts.experts.") {
                for e in 0..t.shape[0] {
                    let target = names::mcore_expert(l.parse().unwrap(), e, param);
                    map.push(Target::new(target, t.shape[1..].to_vec(), vec![Piece::index(name, &t.shape, 0, e)]));
                }
            } else {
                map.push(Target::renamed(format!("decoder.layers.{l}.{}", module(within)), name, &t.shape));
            }
        } else if let Some(within) = name.strip_prefix("decoder.layers.").filter(|_| name != names::MCORE_FINAL_NORM) {
            assert_eq!(t.shape[0], config.num_layers, "{name}");
            for l in 0..t.shape[0] {
                let target = names::mcore_layer(l, &module(within));
                map.push(Target::new(target, t.shape[1..].to_vec(), vec![Piece::index(name, &t.shape, 0, l)]));
            }
        } else {
            map.push(Target::renamed(name, name, &t.shape));
        }
    }
    map.apply(Path::new("stored"), stored).unwrap()
}

#[test]
fn hugging_face_to_megatron_and_back_reads_every_element_where_it_was() {
    for (case, config, arch) in cases() {
        let hf: Vec<(String, Vec<u64>)> = links(&config, arch, None).into_iter().map(|l| (l.hf, l.hf_shape)).collect();
        let hf = stored(&hf);
        let to_mcore = from_hf(Path::new("hf"), &config, arch, Keys::of(&config), &hf)
            .unwrap()
            .apply(Path::new("hf"), &hf)
            .unwrap();
        let per_layer = config.moe.as_ref().is_some_and(|m| m.moe_layers.contains(&false));
        assert_eq!(
            to_mcore.iter().any(|t| t.name.starts_with("decoder.layers.0.")),
            per_layer,
            "{case}: per-layer keys exactly when layers differ"
        );
        let mcore = one_rank(&config, &to_mcore);
        let back =
            to_hf(Path::new("mcore"), &config, arch, None, &mcore).unwrap().apply(Path::new("mcore"), &mcore).unwrap();
        assert_eq!(back.len(), hf.len(), "{case}");
        for (a, b) in hf.iter().zip(&back) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{case}");
            assert_eq!(addresses(a), addresses(b), "{case}: {}", a.name);
        }
    }
}

#[test]
fn the_stored_keys_have_megatrons_stacked_shapes() {
    let config = ModelConfig { moe: Some(moe(false, false)), ..llama() };
    let hf: Vec<(String, Vec<u64>)> =
        links(&config, Arch::Mixtral, None).into_iter().map(|l| (l.hf, l.hf_shape)).collect();
    let hf = stored(&hf);
    let out = from_hf(Path::new("hf"), &config, Arch::Mixtral, Keys::of(&config), &hf)
        .unwrap()
        .apply(Path::new("hf"), &hf)
        .unwrap();
    let shape = |n: &str| out.iter().find(|t| t.name == n).map(|t| t.shape.clone());
    assert_eq!(shape("decoder.layers.mlp.experts.experts.linear_fc1.weight"), Some(vec![3, 3, 8, 8]));
    assert_eq!(shape("decoder.layers.mlp.experts.experts.linear_fc2.weight"), Some(vec![3, 3, 8, 4]));
    assert_eq!(shape("decoder.layers.mlp.router.weight"), Some(vec![3, 3, 8]));
    assert_eq!(shape("decoder.layers.self_attention.linear_qkv.weight"), Some(vec![3, 16, 8]));
    assert_eq!(shape("decoder.layers.self_attention.linear_qkv.layer_norm_weight"), Some(vec![3, 8]));
    assert_eq!(shape("decoder.layers.mlp.linear_fc1.layer_norm_weight"), Some(vec![3, 8]));
    assert_eq!(shape("embedding.word_embeddings.weight"), Some(vec![16, 8]));
    assert_eq!(shape("output_layer.weight"), Some(vec![16, 8]));
}

#[test]
fn q_k_and_v_are_each_query_groups_rows_in_order() {
    // Two groups of two heads, one row per head: the fused rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    let config = ModelConfig { num_layers: 1, hidden_size: 1, num_attention_heads: 4, head_dim: 1, ..llama() };
    let sources = stored(&[("decoder.layers.0.self_attention.linear_qkv.weight".into(), vec![8, 1])]);
    let mut map = ModelMap::new("test");
    for link in links(&config, Arch::Llama, None)
        .into_iter()
        .filter(|l| l.hf.contains("_proj.weight") && l.hf.contains("self_attn.") && !l.hf.contains("o_proj"))
    {
        let Part::Groups { groups, period, start, len } = link.part else { panic!("{link:?}") };
        let name = link.mcore.one_rank();
        map.push(Target::new(link.hf, link.hf_shape, Piece::groups(&name, &[8, 1], groups, period, start, len, 0)));
    }
    let out = map.apply(Path::new("qkv"), &sources).unwrap();
    let rows = |t: &TensorInfo| addresses(t).into_iter().map(|(_, b)| b / 4).collect::<Vec<u64>>();
    let got: Vec<(&str, Vec<u64>)> = out.iter().map(|t| (t.name.as_str(), rows(t))).collect();
    assert_eq!(
        got,
        vec![
            ("model.layers.0.self_attn.q_proj.weight", vec![0, 1, 4, 5]),
            ("model.layers.0.self_attn.k_proj.weight", vec![2, 6]),
            ("model.layers.0.self_attn.v_proj.weight", vec![3, 7]),
        ]
    );
}

#[test]
fn gate_and_up_are_the_halves_of_fc1_and_the_vocabulary_its_first_rows() {
    let config = llama();
    let names: Vec<(String, Vec<u64>)> = links(&config, Arch::Llama, None)
        .into_iter()
        .map(|l| (l.mcore.one_rank(), l.mcore_shape))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into_iter()
        .collect();
    let mcore = stored(&names);
    let out =
        to_hf(Path::new("m"), &config, Arch::Llama, Some(10), &mcore).unwrap().apply(Path::new("m"), &mcore).unwrap();
    let get = |n: &str| out.iter().find(|t| t.name == n).unwrap();
    let file_of = |n: &str| mcore.iter().position(|t| t.name == n).unwrap();
    let fc1 = file_of("decoder.layers.1.mlp.linear_fc1.weight");
    let gate = addresses(get("model.layers.1.mlp.gate_proj.weight"));
    let up = addresses(get("model.layers.1.mlp.up_proj.weight"));
    assert_eq!(gate.first(), Some(&(fc1, 0)));
    assert_eq!(up.first(), Some(&(fc1, 12 * 8 * 4)), "up starts after the gate's 12 rows");
    assert_eq!(get("model.embed_tokens.weight").shape, vec![10, 8]);
    assert_eq!(get("lm_head.weight").shape, vec![10, 8]);
    assert_eq!(addresses(get("lm_head.weight")).last(), Some(&(file_of("output_layer.weight"), (10 * 8 - 1) * 4)));
}

#[test]
fn a_megatron_tensor_of_the_wrong_shape_is_refused_naming_it() {
    let config = ModelConfig { moe: Some(moe(false, false)), ..llama() };
    let mut names: Vec<(String, Vec<u64>)> =
        links(&config, Arch::Mixtral, None).into_iter().map(|l| (l.mcore.one_rank(), l.mcore_shape)).collect();
    names.dedup();
    for (n, shape) in names.iter_mut() {
        if n == "decoder.layers.1.mlp.router.weight" {
            *shape = vec![4, 8];
        }
    }
    let mcore = stored(&names);
    let err = to_hf(Path::new("ckpt"), &config, Arch::Mixtral, None, &mcore).unwrap_err();
    assert_eq!(
        err.to_string(),
        "ckpt: tensor `model.layers.1.block_sparse_moe.gate.weight`: it is made from \
         `decoder.layers.1.mlp.router.weight`, of shape [4, 8], but the model's configuration gives it [3, 8]"
    );
    let whole: Vec<(String, Vec<u64>)> =
        links(&config, Arch::Mixtral, None).into_iter().map(|l| (l.mcore.one_rank(), l.mcore_shape)).collect();
    let missing = stored(&whole.into_iter().filter(|(n, _)| n != "decoder.final_layernorm.weight").collect::<Vec<_>>());
    let err = to_hf(Path::new("ckpt"), &config, Arch::Mixtral, None, &missing).unwrap_err();
    assert!(err.to_string().contains("`decoder.final_layernorm.weight`, which the source does not hold"), "{err}");
}

#[test]
fn a_megatron_tensor_no_hub_tensor_reads_is_refused() {
    let config = llama();
    let mut names: Vec<(String, Vec<u64>)> =
        links(&config, Arch::Llama, None).into_iter().map(|l| (l.mcore.one_rank(), l.mcore_shape)).collect();
    names.dedup();
    names.push(("decoder.layers.0.mlp.router.expert_bias".into(), vec![3]));
    let mcore = stored(&names);
    let err = to_hf(Path::new("ckpt"), &config, Arch::Llama, None, &mcore)
        .unwrap()
        .apply(Path::new("ckpt"), &mcore)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ckpt: tensor `decoder.layers.0.mlp.router.expert_bias`: no tensor of the Hugging Face model is made from it, \
         and it is not one the format leaves out"
    );
}

#[test]
fn the_one_rank_model_is_the_stored_keys_cut_and_stacks_back_into_them() {
    for (case, config, arch) in cases() {
        let hf: Vec<(String, Vec<u64>)> = links(&config, arch, None).into_iter().map(|l| (l.hf, l.hf_shape)).collect();
        let hf = stored(&hf);
        let at = Path::new("hf");
        let keys = from_hf(at, &config, arch, Keys::of(&config), &hf).unwrap().apply(at, &hf).unwrap();
        let mut cut = one_rank(&config, &keys);
        let mut direct = from_hf(at, &config, arch, Keys::OneRank, &hf).unwrap().apply(at, &hf).unwrap();
        cut.sort_by(|a, b| a.name.cmp(&b.name));
        direct.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(cut.len(), direct.len(), "{case}");
        for (a, b) in cut.iter().zip(&direct) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{case}");
            assert_eq!(addresses(a), addresses(b), "{case}: {}", a.name);
        }
        let back = from_one_rank(at, &config, arch, &direct).unwrap().apply(at, &direct).unwrap();
        assert_eq!(back.len(), keys.len(), "{case}");
        for (a, b) in keys.iter().zip(&back) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{case}");
            assert_eq!(addresses(a), addresses(b), "{case}: {}", a.name);
        }
    }
}
