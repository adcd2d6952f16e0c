//! The Megatron mixture-of-experts fixture table: every folder of `fixtures/megatron_moe/` is a
//! Megatron-LM run folder that megatron-core 0.19.2's `save_checkpoint` wrote at expert parallel
//! 2 (`fixtures/gen/megatron_moe_fixtures.py`; `mixtral_tp2ep2` also at tensor parallel 2, experts
//! included; `mixtral_pp2ep2` over two pipeline stages, trained), beside `expected_model.safetensors`, the
//! `state_dict()` of the same model built by megatron on one rank after its own load. Merging
//! must give that state dict bit for bit: experts cut out of their expert axis, per-layer keys
//! of a model whose first layer is dense, shared experts and their gate, routers. The chained
//! optimizer of an MoE run merges to every parameter's state.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::PathBuf;

use ckpt::{Checkpoint, MergeOptions, WriteOptions};
use common::{load, reference};

fn cases() -> Vec<(PathBuf, serde_json::Value)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron_moe");
    let mut out: Vec<(PathBuf, serde_json::Value)> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").is_file())
        .map(|p| {
            let case = serde_json::from_str(&std::fs::read_to_string(p.join("case.json")).unwrap()).unwrap();
            (p, case)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<_> = out.iter().map(|(p, _)| p.file_name().unwrap().to_str().unwrap().to_string()).collect();
    assert_eq!(names, ["mixtral_ep2", "mixtral_ep2dp2", "mixtral_pp2ep2", "mixtral_tp2ep2", "qwen2moe_ep2"]);
    out
}

fn open(dir: &std::path::Path) -> Checkpoint {
    Checkpoint::open(dir.to_str().unwrap()).unwrap()
}

#[test]
fn merge_equals_megatrons_one_rank_state_dict_experts_included() {
    for (dir, case) in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model.safetensors");
        ckpt::merge(&open(&dir), &out, &Default::default(), &WriteOptions::default()).unwrap();
        let got = load(&out).0;
        let want = reference(&dir.join("expected_model.safetensors"), "");
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{}", dir.display());
        assert!(got == want, "{}: the tensors", dir.display());
        // The one-rank names megatron's model has, experts under their global index.
        let keys: Vec<&str> = case["one_rank_keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
        let experts = case["experts"].as_u64().unwrap();
        for e in 0..experts {
            let name = format!("decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight");
            assert!(keys.contains(&name.as_str()) && got.contains_key(&name), "{}: {name}", dir.display());
        }
    }
}

/// Each run written again as a `torch_dist` run and as legacy ranks at TP 2 x EP 2 merges to the
/// same state dict.
#[test]
fn each_run_written_in_either_megatron_layout_merges_to_the_same_state_dict() {
    for (dir, case) in cases() {
        let want = reference(&dir.join("expected_model.safetensors"), "");
        common::through_megatron_layouts(&dir, &want, case["layers"].as_u64().unwrap(), 2);
    }
}

#[test]
fn inspect_says_how_many_experts_and_how_they_are_spread() {
    for (dir, case) in cases() {
        let ck = open(&dir);
        let m = ck.megatron().unwrap();
        assert_eq!(m.num_experts, case["experts"].as_u64(), "{}", dir.display());
        assert_eq!(m.moe_router_topk, case["topk"].as_u64(), "{}", dir.display());
        assert_eq!(m.expert_parallel, case["ep"].as_u64(), "{}", dir.display());
        assert_eq!(m.num_layers, case["layers"].as_u64(), "{}", dir.display());
        assert_eq!(m.tied_embeddings, case["tied"].as_bool(), "{}", dir.display());
        assert_eq!(ck.world_size(), case["world"].as_u64(), "{}", dir.display());
        let d = ck.describe();
        assert!(d.facts[0].1.contains("expert parallel 2"), "{}: {:?}", dir.display(), d.facts);
        assert!(d.facts[1].1.ends_with(", experts 4, top-k 2"), "{}: {:?}", dir.display(), d.facts);
        let report = ckpt::verify(dir.to_str().unwrap()).unwrap();
        assert!(report.is_valid(), "{}: {:?}", dir.display(), report.problems);
    }
}

#[test]
fn a_dense_runs_megatron_info_names_no_experts() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron/train_dp2/dp_reshardable");
    let ck = open(&dir);
    let m = ck.megatron().unwrap();
    assert_eq!((m.num_experts, m.moe_router_topk, m.expert_parallel), (None, None, None));
    let doc = serde_json::to_value(m).unwrap();
    assert!(doc.get("num_experts").is_none(), "{doc}");
}

/// The one-rank model's name of slab `index` (its layer where the key is stacked, then its
/// expert where it has an expert axis) of the stored key `key`, written out here from megatron's
/// naming rather than taken from the reader.
fn one_rank_name(key: &str, index: &[usize]) -> String {
    let Some(rest) = key.strip_prefix("decoder.layers.") else { return key.to_string() };
    let (layer, within, mut index) = match rest.split_once('.') {
        Some((n, within)) if n.bytes().all(|b| b.is_ascii_digit()) => (n.parse().unwrap(), within, index),
        _ => (index[0], rest, &index[1..]),
    };
    let within = within
        .replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
        .replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.");
    let within = match within.split_once("experts.experts.") {
        Some((head, tail)) => {
            let e = index[0];
            index = &index[1..];
            format!("{head}experts.local_experts.{e}.{tail}")
        }
        None => within,
    };
    assert!(index.is_empty());
    format!("decoder.layers.{layer}.{within}")
}

/// `merge --optimizer` gives every parameter's fp32 main parameter and Adam moments, named as
/// the `fully_reshardable` form names them (`optimizer.state.<state>.<stored key>`, experts on
/// their expert axis), read from the two chained optimizers' flat buckets (`mixtral_pp2ep2`:
/// each of two pipeline stages with its own dense and expert buckets): each slab equals what
/// the ranks held in memory when megatron saved (`expected_optimizer.safetensors`, by one-rank
/// name).
#[test]
fn the_chained_optimizer_merges_per_parameter() {
    // `mixtral_tp2ep2` was saved without an optimizer.
    for (dir, _) in cases().into_iter().filter(|(d, _)| d.join("expected_optimizer.safetensors").is_file()) {
        let tmp = tempfile::tempdir().unwrap();
        let ck = open(&dir);
        assert_eq!(ck.megatron().unwrap().optimizer.as_deref(), Some("dp_reshardable"));
        let options = MergeOptions { optimizer: true, ..Default::default() };
        ckpt::merge(&ck, &tmp.path().join("model.safetensors"), &options, &WriteOptions::default()).unwrap();
        let got = load(&tmp.path().join("optimizer.safetensors")).0;
        let want = reference(&dir.join("expected_optimizer.safetensors"), "");
        let mut seen = std::collections::BTreeSet::new();
        for (name, (dtype, shape, bytes)) in &got {
            let (state, key) = name.strip_prefix("optimizer.state.").unwrap().split_once('.').unwrap();
            let stacked =
                key.strip_prefix("decoder.layers.").is_some_and(|r| !r.starts_with(|c: char| c.is_ascii_digit()));
            let lead = usize::from(stacked) + usize::from(key.contains("experts.experts."));
            let slab: usize = shape[lead..].iter().product::<usize>() * 4;
            let count: usize = shape[..lead].iter().product();
            for i in 0..count {
                let index: Vec<usize> = match lead {
                    0 => vec![],
                    1 => vec![i],
                    _ => vec![i / shape[1], i % shape[1]],
                };
                let one = format!("{}.{state}", one_rank_name(key, &index));
                let (wdtype, wshape, wbytes) = &want[&one];
                assert_eq!((dtype, &shape[lead..]), (wdtype, &wshape[..]), "{}: {one}", dir.display());
                assert!(bytes[i * slab..(i + 1) * slab] == wbytes[..], "{}: {one}", dir.display());
                seen.insert(one);
            }
        }
        assert_eq!(seen.len(), want.len(), "{}: every parameter's state", dir.display());
    }
}
