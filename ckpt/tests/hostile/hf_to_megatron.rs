//! Hugging Face folders that `convert --to megatron` cannot write as a Megatron run, one test
//! per defect: each is refused with one line naming `config.json` (or the tensor) and the
//! setting, and nothing is written. Each damages a copy of a real fixture
//! (`fixtures/megatron_arch/hf/llama`, saved by transformers 5.24) at test time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, ConvertOptions, TargetFormat, WriteOptions};

/// A copy of the Llama folder whose `config.json` `edit` changes (or removes, returning false).
fn llama_with(edit: impl FnOnce(&mut serde_json::Value) -> bool) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama");
    common::copy_tree(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron_arch/hf/llama"), &dir);
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    if edit(&mut json) {
        std::fs::write(&path, json.to_string()).unwrap();
    } else {
        std::fs::remove_file(&path).unwrap();
    }
    (tmp, dir)
}

/// Converting `dir` to a Megatron run is refused with exactly `expected` (after the folder's
/// path), and no run folder appears.
fn refused(dir: &Path, expected: &str) {
    let ck = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    let out = dir.parent().unwrap().join("run");
    let options = ConvertOptions { to: Some(TargetFormat::Megatron), ..Default::default() };
    let err = ckpt::convert(&ck, &out, &options, &WriteOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert_eq!(msg.replace(&dir.display().to_string(), "DIR"), expected);
    assert!(!msg.contains('\n'), "{msg}");
    assert!(!out.exists(), "{msg}");
}

#[test]
fn an_unknown_architecture_is_refused_naming_model_type() {
    let (_tmp, dir) = llama_with(|j| {
        j["model_type"] = "gpt2".into();
        true
    });
    refused(
        &dir,
        "DIR/config.json: `model_type` is `gpt2`, not one of the families read (`llama`, `qwen2`, `qwen3`, `mixtral`, \
         `qwen2_moe`, `qwen3_moe`)",
    );
}

#[test]
fn an_activation_other_than_silu_is_refused() {
    let (_tmp, dir) = llama_with(|j| {
        j["hidden_act"] = "gelu".into();
        true
    });
    refused(&dir, "DIR/config.json: `hidden_act` is `gelu`; the tables read SiLU-gated MLPs");
}

#[test]
fn llamas_attention_bias_has_no_place_in_megatrons_layout() {
    let (_tmp, dir) = llama_with(|j| {
        j["attention_bias"] = true.into();
        true
    });
    refused(&dir, "DIR/config.json: `attention_bias` is on, which megatron's llama layout has no place for");
}

#[test]
fn key_value_heads_that_do_not_divide_the_heads_are_refused() {
    let (_tmp, dir) = llama_with(|j| {
        j["num_key_value_heads"] = 3.into();
        true
    });
    refused(&dir, "DIR/config.json: `num_key_value_heads` is 3, which does not divide the heads");
}

#[test]
fn a_folder_without_config_json_is_refused() {
    let (_tmp, dir) = llama_with(|_| false);
    refused(
        &dir,
        "DIR/config.json: `config.json` is missing: a Hugging Face folder's `config.json` says what the model is",
    );
}

#[test]
fn a_config_that_disagrees_with_the_tensors_is_refused_naming_the_tensor() {
    let (_tmp, dir) = llama_with(|j| {
        j["intermediate_size"] = 48.into();
        true
    });
    let ck = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    let options = ConvertOptions { to: Some(TargetFormat::Megatron), ..Default::default() };
    let err = ckpt::convert(&ck, &dir.parent().unwrap().join("run"), &options, &WriteOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("model.layers.0.mlp.gate_proj.weight"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}
