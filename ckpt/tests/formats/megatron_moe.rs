//! The Megatron mixture-of-experts fixture table: every folder of `fixtures/megatron_moe/` is a
//! Megatron-LM run folder that megatron-core 0.19.2's `save_checkpoint` wrote at expert parallel
//! 2 (`fixtures/gen/megatron_moe_fixtures.py`), beside `expected_model.safetensors`, the
//! `state_dict()` of the same model built by megatron on one rank after its own load. Merging
//! must give that state dict bit for bit: experts cut out of their expert axis, per-layer keys
//! of a model whose first layer is dense, shared experts and their gate, routers. The chained
//! optimizer of an MoE run is refused by name rather than read as a dense run's.
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
    assert_eq!(names, ["mixtral_ep2", "mixtral_ep2dp2", "qwen2moe_ep2"]);
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

#[test]
fn the_chained_optimizer_is_refused_by_name_not_written_as_model_tensors() {
    for (dir, _) in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let options = MergeOptions { optimizer: true, ..Default::default() };
        let err = ckpt::merge(&open(&dir), &tmp.path().join("model.safetensors"), &options, &WriteOptions::default())
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("chained_"), "{text}");
        assert!(text.contains("the chained optimizer of a mixture-of-experts run is not read yet"), "{text}");
        assert!(!text.contains('\n'), "{text}");
    }
}
