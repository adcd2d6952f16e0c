//! `ckpt convert SRC OUT --to hf` of Megatron-LM saves, through the binary: the folder's files
//! and tensors (megatron's one-rank tensors under the Hub's names, re-derived here from the
//! `expected_model.safetensors` megatron wrote), `--dry-run --json`, and the refusals, one per
//! reason, each naming what has no counterpart. That transformers loads the folders with
//! megatron's logits is `tests/python/interop/test_megatron_to_hf.py`.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;

/// Every tensor of a safetensors file: name → (dtype, shape, bytes).
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// Rows `rows` of a row-major tensor of `shape` and 4-byte elements.
fn rows(t: &(String, Vec<usize>, Vec<u8>), rows: impl Iterator<Item = usize>) -> Vec<u8> {
    let row: usize = t.1[1..].iter().product::<usize>() * 4;
    rows.flat_map(|r| t.2[r * row..(r + 1) * row].to_vec()).collect()
}

#[test]
fn a_llama_run_becomes_a_hub_folder_of_megatrons_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let case = fixtures().join("megatron_arch/llama_tp2pp2");
    let out = tmp.path().join("hf");
    let o = run(&["convert", case.join("run").to_str().unwrap(), out.to_str().unwrap(), "--to", "hf"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut files: Vec<String> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    assert_eq!(files, ["config.json", "model.safetensors"]);
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    assert_eq!((config["num_attention_heads"].as_u64(), config["num_key_value_heads"].as_u64()), (Some(4), Some(2)));
    assert_eq!(config["rope_theta"].as_f64(), Some(500000.0));
    assert_eq!(config["tie_word_embeddings"], false);

    let hf = tensors(&out.join("model.safetensors"));
    let mc = tensors(&case.join("expected_model.safetensors"));
    // 4 heads in 2 query groups, 2 heads per group: each group's rows are [q1, q2, k, v].
    let d = config["head_dim"].as_u64().unwrap() as usize;
    for layer in 0..4 {
        let qkv = &mc[&format!("decoder.layers.{layer}.self_attention.linear_qkv.weight")];
        let group_rows = |g: usize, from: usize, n: usize| g * 4 * d + from..g * 4 * d + from + n;
        let q: Vec<u8> = (0..2).flat_map(|g| rows(qkv, group_rows(g, 0, 2 * d))).collect();
        let k: Vec<u8> = (0..2).flat_map(|g| rows(qkv, group_rows(g, 2 * d, d))).collect();
        let v: Vec<u8> = (0..2).flat_map(|g| rows(qkv, group_rows(g, 3 * d, d))).collect();
        let hub = |n: &str| &hf[&format!("model.layers.{layer}.{n}")].2;
        assert_eq!(*hub("self_attn.q_proj.weight"), q, "layer {layer}");
        assert_eq!(*hub("self_attn.k_proj.weight"), k, "layer {layer}");
        assert_eq!(*hub("self_attn.v_proj.weight"), v, "layer {layer}");
        let fc1 = &mc[&format!("decoder.layers.{layer}.mlp.linear_fc1.weight")];
        let f = fc1.1[0] / 2;
        assert_eq!(*hub("mlp.gate_proj.weight"), rows(fc1, 0..f), "layer {layer}");
        assert_eq!(*hub("mlp.up_proj.weight"), rows(fc1, f..2 * f), "layer {layer}");
        let same = [
            ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
            ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
            ("input_layernorm.weight", "input_layernorm.weight"),
            ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
        ];
        for (hub_name, mc_name) in same {
            assert_eq!(*hub(hub_name), mc[&format!("decoder.layers.{layer}.{mc_name}")].2, "layer {layer} {hub_name}");
        }
    }
    assert_eq!(hf["model.embed_tokens.weight"].2, mc["embedding.word_embeddings.weight"].2);
    assert_eq!(hf["lm_head.weight"].2, mc["output_layer.weight"].2);
    assert_eq!(hf["model.norm.weight"].2, mc["decoder.final_layernorm.weight"].2);
    assert_eq!(hf.len(), 3 + 4 * 9);
}

#[test]
fn a_dry_run_plans_the_folder_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron_moe/mixtral_ep2");
    let out = tmp.path().join("hf");
    let args = ["convert", src.to_str().unwrap(), out.to_str().unwrap(), "--to", "hf", "--max-shard-size", "15KB"];
    let o = run(&[&args[..], &["--dry-run", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.exists(), "a dry run writes nothing");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let files: Vec<String> = doc["files"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_owned()).collect();
    assert!(files.iter().any(|f| f.ends_with("model-00001-of-00003.safetensors")), "{files:?}");
    assert!(files[files.len() - 2].ends_with("config.json"), "{files:?}");
    assert!(files[files.len() - 1].ends_with("model.safetensors.index.json"), "{files:?}");

    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(
        index["weight_map"]["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
            .as_str()
            .map(|s| s.ends_with(".safetensors")),
        Some(true)
    );
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "mixtral");
    assert_eq!(config["num_local_experts"], 4);
}

#[test]
fn what_no_hugging_face_family_holds_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    let f = |p: &str| fixtures().join(p).to_str().unwrap().to_owned();
    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec![f("megatron/train_tp2dp2/fully_reshardable")],
            format!(
                "{}: no Hugging Face architecture holds this model: `swiglu` is off, and `llama` has no counterpart for it",
                f("megatron/train_tp2dp2/fully_reshardable")
            ),
        ),
        (
            vec![f("megatron/run_tp2")],
            format!(
                "{}: no Hugging Face architecture holds this model: `position_embedding_type` is `learned_absolute`, and \
                 no family of the tables has a counterpart for it",
                f("megatron/run_tp2/iter_0000003/__0_0.distcp")
            ),
        ),
        (
            vec![f("megatron_arch/llama_tp2pp2/run"), "--arch".into(), "qwen2".into()],
            format!(
                "{}: no Hugging Face architecture holds this model: `add_qkv_bias` is off, and `qwen2` has no counterpart \
                 for it",
                f("megatron_arch/llama_tp2pp2/run")
            ),
        ),
        (
            vec![f("megatron/tp2pp2/ckpt")],
            format!(
                "{}: the checkpoint holds no saved `args` (Megatron-LM's `save_checkpoint` saves them; a bare \
                 `dist_checkpointing.save` does not), so its heads, query groups and norms are not known",
                f("megatron/tp2pp2/ckpt")
            ),
        ),
        (
            vec![f("megatron_arch/hf/llama")],
            format!(
                "`--to hf` converts Megatron checkpoints (whose saved `args` say what model they hold) only; {}/\
                 model.safetensors.index.json is hf-sharded-safetensors",
                f("megatron_arch/hf/llama")
            ),
        ),
        (
            vec![f("megatron_arch/llama_tp2pp2/run"), "--vocab-size".into(), "65".into()],
            "`--vocab-size` keeps the first rows of the word embeddings: from 1 to 64 here, not 65".into(),
        ),
        (
            vec![f("megatron_arch/llama_tp2pp2/run"), "--dedupe".into()],
            "`--to hf` does not take `--dedupe`".into(),
        ),
        (
            vec![f("megatron_arch/llama_tp2pp2/run"), "--as-stored".into()],
            "`--to hf` does not take `--as-stored`".into(),
        ),
    ];
    for (args, message) in cases {
        let mut all =
            vec!["convert".to_string(), args[0].clone(), out.to_str().unwrap().to_owned(), "--to".into(), "hf".into()];
        all.extend(args[1..].iter().cloned());
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let o = run(&all);
        assert_eq!(o.status.code(), Some(2), "{all:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains(&message), "{all:?}:\n{err}\nwants: {message}");
        assert!(!out.exists(), "{all:?}: a refusal writes nothing");
    }
    let o = run(&["convert", &f("megatron_arch/llama_tp2pp2/run"), out.to_str().unwrap(), "--arch", "llama"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("`--arch` only applies to `--to hf`"), "{}", stderr(&o));
}

#[test]
fn dtype_casts_every_weight_and_the_config_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron_arch/qwen3_tp2/run");
    let out = tmp.path().join("hf");
    let o = run(&["convert", src.to_str().unwrap(), out.to_str().unwrap(), "--to", "hf", "--dtype", "bf16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!((config["dtype"].as_str(), config["torch_dtype"].as_str()), (Some("bfloat16"), Some("bfloat16")));
    assert_eq!(config["model_type"], "qwen3");
    let hf = tensors(&out.join("model.safetensors"));
    assert!(hf.values().all(|t| t.0 == "BF16"), "every tensor is bf16");
    assert!(
        hf.contains_key("model.layers.1.self_attn.q_norm.weight")
            && hf.contains_key("model.layers.1.self_attn.k_norm.weight")
    );
}

/// `--to megatron-legacy`: a dry run lists megatron's rank files, the tracker last, and writes
/// nothing; the run then writes them.
#[test]
fn legacy_ranks_are_planned_by_a_dry_run_then_written() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron_moe/mixtral_ep2");
    let out = tmp.path().join("legacy");
    let args = [
        "convert",
        src.to_str().unwrap(),
        out.to_str().unwrap(),
        "--to",
        "megatron-legacy",
        "--tensor-parallel",
        "2",
        "--pipeline-parallel",
        "2",
        "--expert-parallel",
        "2",
    ];
    let o = run(&[&args[..], &["--dry-run", "--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.exists(), "a dry run writes nothing");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let files: Vec<String> = doc["files"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_owned()).collect();
    assert_eq!(files.len(), 9, "{files:?}");
    assert!(files[0].ends_with("iter_0000002/mp_rank_00_000_000/model_optim_rng.pt"), "{files:?}");
    assert!(files[7].ends_with("iter_0000002/mp_rank_01_001_001/model_optim_rng.pt"), "{files:?}");
    assert!(files[8].ends_with("latest_checkpointed_iteration.txt"), "{files:?}");

    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in &files {
        assert!(Path::new(f).is_file(), "{f}");
    }
}

/// A layout megatron could not build, and the parallel sizes given to another output, are
/// refused in one line naming the flag, before anything is written.
#[test]
fn a_legacy_layout_that_does_not_cut_the_model_is_refused_by_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron_arch/hf/qwen2_moe");
    let out = tmp.path().join("legacy");
    let cases: [(&[&str], &str); 4] = [
        (
            &["--to", "megatron-legacy", "--pipeline-parallel", "2"],
            "`--pipeline-parallel 2` cannot cut the model: its 3 layers",
        ),
        (
            &["--to", "megatron-legacy", "--tensor-parallel", "3"],
            "`--tensor-parallel 3` cannot cut the model: its 4 attention heads",
        ),
        (&["--to", "megatron-legacy", "--expert-parallel", "0"], "`--expert-parallel` must be from 1 to"),
        (&["--to", "megatron", "--tensor-parallel", "2"], "`--tensor-parallel` only applies to `--to megatron-legacy`"),
    ];
    for (flags, want) in cases {
        let o = run(&[&["convert", src.to_str().unwrap(), out.to_str().unwrap()][..], flags].concat());
        assert!(!o.status.success(), "{flags:?}");
        let err = stderr(&o);
        assert!(err.contains(want), "{flags:?}: {err}");
        assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{err}");
        assert!(!out.exists(), "{flags:?}: refused but wrote {}", out.display());
    }
}
