//! The architecture fixtures of `fixtures/megatron_arch/`: Megatron-LM training saves
//! (`torch_dist`, float32) of models built to be exactly a Hugging Face architecture (Llama
//! TP2 x PP2, tied Llama, Qwen2 with QKV bias and a padded vocabulary, Qwen3 with q/k norm and a
//! head dim other than hidden / heads), written by megatron-core 0.19.2's own `save_checkpoint`
//! (`fixtures/gen/megatron_arch_fixtures.py`), plus the same Llama at PP 2 with virtual pipeline
//! 2 and in the legacy per-rank format (TP 2 x PP 2, PP 2 x VPP 2, uneven stages). Each run folder
//! merges to megatron's one-rank state dict, `expected_model.safetensors`, tensor for tensor. (The `hf/` folders beside them
//! are transformers' own and are read by the conversion tests.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, WriteOptions};
use common::{load, reference};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron_arch")
}

/// The Megatron cases: folders with a `case.json` and a `run/` folder.
fn cases() -> Vec<(PathBuf, serde_json::Value)> {
    let mut out: Vec<(PathBuf, serde_json::Value)> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").is_file() && p.join("run").is_dir())
        .map(|p| {
            let case = serde_json::from_str(&std::fs::read_to_string(p.join("case.json")).unwrap()).unwrap();
            (p, case)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 4, "the architecture fixture table lost its cases: {out:?}");
    out
}

/// Layouts the reader may refuse, by name, but never merge to anything but megatron's state
/// dict. Empty: every case, the legacy virtual-chunk one included (its layers placed by
/// megatron's `get_transformer_layer_offset`), must merge.
const MAY_BE_REFUSED: &[&str] = &[];

/// Merges the case's run folder; `Err` is the error of `open` or `merge`.
fn merge(dir: &Path, case: &serde_json::Value, out: &Path) -> Result<(), ckpt::Error> {
    let src = dir.join(case["run_dir"].as_str().unwrap());
    let ck = Checkpoint::open(src.to_str().unwrap())?;
    ckpt::merge(&ck, out, &Default::default(), &WriteOptions::default()).map(|_| ())
}

#[test]
fn each_architecture_merges_to_megatrons_one_rank_state_dict() {
    for (dir, case) in cases() {
        let name = dir.file_name().unwrap().to_str().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model.safetensors");
        match merge(&dir, &case, &out) {
            Ok(()) => {
                assert_eq!(load(&out).0, reference(&dir.join("expected_model.safetensors"), ""), "{}", dir.display())
            }
            Err(e) if MAY_BE_REFUSED.contains(&name) => {
                assert!(
                    matches!(e, ckpt::Error::BadMegatron { .. }),
                    "{name}: refused, but not as a Megatron layout: {e}"
                );
                assert!(!out.exists(), "{name}: refused but wrote {}", out.display());
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

#[test]
fn the_fixtures_hold_what_their_case_says() {
    for (dir, case) in cases() {
        let model = reference(&dir.join("expected_model.safetensors"), "");
        let layers = case["num_layers"].as_u64().unwrap() as usize;
        let hidden = case["hidden_size"].as_u64().unwrap() as usize;
        let vocab = case["padded_vocab_size"].as_u64().unwrap() as usize;
        let (dtype, shape, _) = &model["embedding.word_embeddings.weight"];
        assert_eq!((dtype.as_str(), shape.as_slice()), ("F32", [vocab, hidden].as_slice()), "{}", dir.display());
        assert_eq!(model.contains_key("output_layer.weight"), !case["tied_embeddings"].as_bool().unwrap());
        assert_eq!(
            model.contains_key("decoder.layers.0.self_attention.linear_qkv.bias"),
            case["add_qkv_bias"].as_bool().unwrap()
        );
        assert_eq!(
            model.contains_key("decoder.layers.0.self_attention.q_layernorm.weight"),
            case["qk_layernorm"].as_bool().unwrap()
        );
        assert!(model.contains_key(&format!("decoder.layers.{}.mlp.linear_fc2.weight", layers - 1)));
        assert!(!model.contains_key(&format!("decoder.layers.{layers}.mlp.linear_fc2.weight")));
        let logits = reference(&dir.join("logits.safetensors"), "");
        assert_eq!(logits["input_ids"].1, vec![2, 8]);
        assert_eq!(logits["logits"].1, vec![2, 8, vocab]);
    }
}

/// Every case written again in each of Megatron-LM's layouts reads back as megatron's one-rank
/// state dict ([`common::through_megatron_layouts`]).
#[test]
fn each_architecture_written_in_either_megatron_layout_merges_to_the_same_state_dict() {
    for (dir, case) in cases() {
        let src = dir.join(case["run_dir"].as_str().unwrap());
        let want = reference(&dir.join("expected_model.safetensors"), "");
        common::through_megatron_layouts(&src, &want, case["num_layers"].as_u64().unwrap(), 1);
    }
}
