//! The Megatron fixture table: every folder of `fixtures/megatron/` with a `case.json` was
//! saved by real megatron-core 0.19.2 on gloo ranks (`fixtures/gen/megatron_fixtures.py`),
//! beside what megatron and torch make of it: `expected_model.safetensors`, the `state_dict()`
//! of the same model built by megatron at tensor and pipeline parallel 1 after megatron's own
//! load, and `expected_stored.safetensors`, torch's `dcp_to_torch_save` of the folder. Each
//! case merges the checkpoint both ways and compares tensor for tensor (dtype, shape, bytes),
//! checks what `inspect` says against the case's settings, and converts the model to a DCP
//! folder for other world sizes and to a torch file, which must merge back to the same bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, ConvertOptions, OpenOptions, TargetFormat, WriteOptions};
use common::{load, reference};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron")
}

/// Every case folder: those with a `case.json` and megatron's one-rank reference.
fn cases() -> Vec<(PathBuf, serde_json::Value)> {
    let mut out: Vec<(PathBuf, serde_json::Value)> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").is_file() && p.join("expected_model.safetensors").is_file())
        // A training save in two optimizer forms has a test of its own.
        .filter(|p| !p.join("dp_reshardable").is_dir())
        .map(|p| {
            let case = serde_json::from_str(&std::fs::read_to_string(p.join("case.json")).unwrap()).unwrap();
            (p, case)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 4, "the fixture table lost its cases: {out:?}");
    out
}

/// The checkpoint of a case: a Megatron-LM run folder (read through its tracker), or the folder
/// `case.json` names.
fn source(dir: &Path, case: &serde_json::Value) -> PathBuf {
    if dir.join("latest_checkpointed_iteration.txt").is_file() {
        return dir.to_path_buf();
    }
    dir.join(case["checkpoint_dir"].as_str().unwrap())
}

fn open(src: &Path, as_stored: bool) -> Checkpoint {
    let options = OpenOptions { as_stored, ..OpenOptions::default() };
    Checkpoint::open_with(src.to_str().unwrap(), &options).unwrap()
}

fn merged(ck: &Checkpoint, out: &Path) -> common::Tensors {
    ckpt::merge(ck, out, &Default::default(), &WriteOptions::default()).unwrap();
    load(out).0
}

#[test]
fn merge_equals_megatrons_one_rank_state_dict() {
    for (dir, case) in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = open(&source(&dir, &case), false);
        let out = tmp.path().join("model.safetensors");
        let got = merged(&ck, &out);
        assert_eq!(got, reference(&dir.join("expected_model.safetensors"), ""), "{}", dir.display());
        // What `safetensors.torch.save_file` writes, and nothing of the run's values.
        let meta = load(&out).1;
        assert_eq!(meta.into_iter().collect::<Vec<_>>(), vec![("format".to_string(), "pt".to_string())]);
    }
}

#[test]
fn merge_as_stored_equals_dcp_to_torch_save() {
    for (dir, case) in cases() {
        let want = dir.join("expected_stored.safetensors");
        if !want.is_file() {
            continue;
        }
        let tmp = tempfile::tempdir().unwrap();
        let ck = open(&source(&dir, &case), true);
        let got = merged(&ck, &tmp.path().join("stored.safetensors"));
        assert_eq!(got, reference(&want, ""), "{}", dir.display());
    }
}

#[test]
fn inspect_names_the_format_and_the_model() {
    for (dir, case) in cases() {
        let src = source(&dir, &case);
        let ck = open(&src, false);
        let legacy = case["ckpt_format"] == "torch";
        let (format, layout) =
            if legacy { ("megatron-legacy", "legacy") } else { ("megatron-torch-dist", "torch_dist") };
        assert_eq!(ck.format().name(), format, "{}", dir.display());
        let m = ck.megatron().unwrap();
        assert_eq!(m.layout, layout);
        assert_eq!(m.num_layers, case["layers"].as_u64(), "{}", dir.display());
        assert_eq!(m.hidden_size, case["hidden"].as_u64(), "{}", dir.display());
        assert_eq!(m.tied_embeddings, case["tied"].as_bool(), "{}", dir.display());
        assert_eq!(ck.world_size(), case["world_size"].as_u64(), "{}", dir.display());
        let report = ckpt::verify(src.to_str().unwrap()).unwrap();
        assert!(report.is_valid(), "{}: {:?}", dir.display(), report.problems);
        let doc = serde_json::to_value(&ck).unwrap();
        assert_eq!(doc["format"], format);
        if legacy || dir.join("latest_checkpointed_iteration.txt").is_file() {
            // Megatron-LM saved its `args`: the run's settings are all known.
            assert_eq!((m.tensor_parallel, m.pipeline_parallel), (case["tp"].as_u64(), case["pp"].as_u64()));
            assert_eq!(m.num_attention_heads, case["heads"].as_u64(), "{}", dir.display());
            assert_eq!(m.num_query_groups, case["query_groups"].as_u64(), "{}", dir.display());
            assert_eq!(m.swiglu, case["swiglu"].as_bool(), "{}", dir.display());
            assert_eq!(m.iteration, case["iteration"].as_u64(), "{}", dir.display());
        }
        assert_eq!(doc["megatron"]["num_layers"], case["layers"]);
    }
}

#[test]
fn a_megatron_checkpoint_describes_its_run_and_model_and_names_itself_by_its_layout() {
    for (dir, case) in cases() {
        let ck = open(&source(&dir, &case), false);
        let m = ck.megatron().unwrap();
        let d = ck.describe();
        assert!(d.title.starts_with(&format!("a Megatron {} checkpoint", m.layout)), "{}: {}", dir.display(), d.title);
        let labels: Vec<&str> = d.facts.iter().map(|(label, _)| *label).collect();
        assert_eq!(labels, ["megatron", "model"], "{}", dir.display());
        assert!(d.facts[0].1.starts_with(m.layout), "{}: {:?}", dir.display(), d.facts);
        if let Some(layers) = m.num_layers {
            assert!(d.facts[1].1.starts_with(&format!("layers {layers}, ")), "{}: {:?}", dir.display(), d.facts);
        }
        assert!(d.sections.is_empty(), "{}", dir.display());
        assert_eq!(d.json, vec![("megatron", serde_json::to_value(m).unwrap())], "{}", dir.display());
    }
}

#[test]
fn the_model_converts_to_dcp_and_torch_and_merges_back_to_the_same_bytes() {
    for (dir, case) in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = open(&source(&dir, &case), false);
        let model = tmp.path().join("model.safetensors");
        let want = merged(&ck, &model);
        for world in [1u64, 3] {
            let out = tmp.path().join(format!("dcp-{world}"));
            let options = ConvertOptions { to: Some(TargetFormat::Dcp), world_size: Some(world), ..Default::default() };
            ckpt::convert(&ck, &out, &options, &WriteOptions::default()).unwrap();
            let again =
                merged(&Checkpoint::open(out.to_str().unwrap()).unwrap(), &tmp.path().join("again.safetensors"));
            assert_eq!(again, want, "{}: through DCP for {world} ranks", dir.display());
        }
        let torch = tmp.path().join("model.pt");
        ckpt::convert(&ck, &torch, &ConvertOptions::default(), &WriteOptions::default()).unwrap();
        let again = merged(&Checkpoint::open(torch.to_str().unwrap()).unwrap(), &tmp.path().join("t.safetensors"));
        assert_eq!(again, want, "{}: through a torch file", dir.display());
    }
}

/// `convert --to megatron` of a `torch_dist` save: a Megatron-LM run folder (tracker last,
/// `iter_NNNNNNN/` with megatron's `metadata.json`) holding every stored tensor bit for bit, which
/// reads back as the same one-rank model; a bare `dist_checkpointing.save` folder gets the
/// common state Megatron-LM's `load_checkpoint` needs (`checkpoint_version` 3.0).
#[test]
fn a_torch_dist_save_converts_to_a_megatron_run_with_the_same_stored_tensors() {
    for (dir, case) in cases().into_iter().filter(|(_, c)| c["ckpt_format"] != "torch") {
        let tmp = tempfile::tempdir().unwrap();
        let src = source(&dir, &case);
        let out = tmp.path().join("run");
        let options = ConvertOptions { to: Some(TargetFormat::Megatron), ..Default::default() };
        ckpt::convert(&open(&src, false), &out, &options, &WriteOptions::default()).unwrap();
        let iteration = case["iteration"].as_u64().unwrap_or(0);
        let tracker = std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap();
        assert_eq!(tracker, iteration.to_string(), "{}", dir.display());
        let it = out.join(format!("iter_{iteration:07}"));
        let config = std::fs::read_to_string(it.join("metadata.json")).unwrap();
        assert_eq!(config, r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#);
        let stored = |p: &Path, name: &str| merged(&open(p, true), &tmp.path().join(name));
        assert_eq!(stored(&out, "ours.safetensors"), stored(&src, "theirs.safetensors"), "{}", dir.display());
        let model = |p: &Path, name: &str| merged(&open(p, false), &tmp.path().join(name));
        assert_eq!(model(&out, "a.safetensors"), reference(&dir.join("expected_model.safetensors"), ""));
        let m = open(&out, false).megatron().unwrap().clone();
        assert_eq!((m.num_layers, m.hidden_size), (case["layers"].as_u64(), case["hidden"].as_u64()));
        assert_eq!(m.iteration, Some(iteration), "{}", dir.display());
    }
}

#[test]
fn a_megatron_run_is_not_written_over_an_existing_iteration() {
    let (dir, case) = cases().into_iter().find(|(d, _)| d.ends_with("run_tp2")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    std::fs::create_dir_all(out.join("iter_0000003")).unwrap();
    let options = ConvertOptions { to: Some(TargetFormat::Megatron), ..Default::default() };
    let err = ckpt::convert(&open(&source(&dir, &case), false), &out, &options, &WriteOptions::default()).unwrap_err();
    assert!(err.to_string().contains("iter_0000003"), "{err}");
    assert!(!out.join("latest_checkpointed_iteration.txt").exists());
}

#[test]
fn megatron_output_keeps_tensors_as_stored_and_refuses_a_cast() {
    let options =
        ConvertOptions { to: Some(TargetFormat::Megatron), dtype: Some(ckpt::Dtype::BF16), ..Default::default() };
    let err = options.check(Path::new("out")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot convert to out: `dtype` does not apply to `to` = `megatron`, which keeps the tensors as the tool stores them"
    );
}

#[test]
fn as_stored_applies_to_torch_dist_checkpoints_only() {
    let other = root().join("../safetensors");
    let file = std::fs::read_dir(&other)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let options = OpenOptions { as_stored: true, ..OpenOptions::default() };
    let err = Checkpoint::open_with(file.to_str().unwrap(), &options).unwrap_err();
    assert_eq!(err.kind(), ckpt::ErrorKind::Usage);
    assert!(err.to_string().contains("applies to Megatron `torch_dist` checkpoints only"), "{err}");
}

/// Megatron-LM training saves (the distributed optimizer, Adam, on 2 data-parallel ranks, and
/// on tensor parallel 2 × data parallel 2 and pipeline parallel 2 × data parallel 2, even and with
/// an uneven first stage of 1 layer of 3), each saved twice from the same state: once
/// `dp_reshardable` (flat buckets per model-parallel rank), once `fully_reshardable` (per
/// parameter). `merge --optimizer` reads either with no option to say how. From the
/// `fully_reshardable` save it gives what megatron stored; from the `dp_reshardable` one the
/// optimizer's live state (`expected_optimizer_live` where megatron 0.19.2's `fully_reshardable`
/// save stored some parameters' state shifted, a bug fixed upstream after it; else the same
/// tensors as the `fully_reshardable` save).
#[test]
fn both_optimizer_forms_merge_to_the_per_parameter_state() {
    for case in ["train_dp2", "train_tp2dp2", "train_pp2dp2", "train_uneven_pp2dp2", "train_pp2_tied", "train_pp2_vpp2"]
    {
        let dir = root().join(case);
        let spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("case.json")).unwrap()).unwrap();
        let want_model = reference(&dir.join("expected_model.safetensors"), "");
        let stored_optimizer = reference(&dir.join("expected_optimizer.safetensors"), "");
        let live = dir.join("expected_optimizer_live.safetensors");
        let live_optimizer = if live.is_file() { reference(&live, "") } else { stored_optimizer.clone() };
        for (form, paths) in spec["forms"].as_object().unwrap() {
            let run = dir.join(paths["run_dir"].as_str().unwrap());
            let tmp = tempfile::tempdir().unwrap();
            let ck = open(&run, false);
            let m = ck.megatron().unwrap();
            assert_eq!(m.optimizer.as_deref(), Some(form.as_str()));
            assert_eq!(m.iteration, spec["iteration"].as_u64());
            assert_eq!((m.tensor_parallel, m.pipeline_parallel), (spec["tp"].as_u64(), spec["pp"].as_u64()));
            assert_eq!(m.num_attention_heads, spec["heads"].as_u64());
            assert_eq!(m.num_query_groups, spec["query_groups"].as_u64());
            assert_eq!(m.ffn_hidden_size, spec["ffn"].as_u64());
            assert_eq!(m.swiglu, spec["swiglu"].as_bool());
            let out = tmp.path().join("model.safetensors");
            let options = ckpt::MergeOptions { optimizer: true, ..Default::default() };
            ckpt::merge(&ck, &out, &options, &WriteOptions::default()).unwrap();
            assert_eq!(load(&out).0, want_model, "{case} {form}: the model");
            let got = load(&tmp.path().join("optimizer.safetensors")).0;
            let want = if form == "dp_reshardable" { &live_optimizer } else { &stored_optimizer };
            assert!(got == *want, "{case} {form}: the optimizer");
            let stored = merged(&open(&run, true), &tmp.path().join("stored.safetensors"));
            let want = reference(&dir.join(paths["expected_stored"].as_str().unwrap()), "");
            assert!(stored == want, "{case} {form}: as stored");
        }
    }
}

/// Legacy saves' optimizers, put back per parameter and named as the `fully_reshardable` form
/// names them, equal to the live state of each run (`expected_optimizer.safetensors`, from
/// megatron's own resume): without the distributed optimizer (`legacy_tp2pp2`: TP2 × PP2,
/// SwiGLU, GQA, tied embeddings; each rank's state by index and its fp32 master copies), and
/// with it (`legacy_dp2_distopt`: TP2 × DP2; each rank's `distrib_optim.pt`, flat buffers whose
/// layout is derived from the bucket size in `args`).
#[test]
fn a_legacy_saves_optimizer_merges_per_parameter() {
    for case in ["legacy_tp2pp2", "legacy_dp2_distopt"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = root().join(case);
        let ck = open(&dir, false);
        let options = ckpt::MergeOptions { optimizer: true, ..Default::default() };
        ckpt::merge(&ck, &tmp.path().join("model.safetensors"), &options, &WriteOptions::default()).unwrap();
        let got = load(&tmp.path().join("optimizer.safetensors")).0;
        assert!(got == reference(&dir.join("expected_optimizer.safetensors"), ""), "{case}: the optimizer");
    }
}

/// Every case cut into legacy ranks (TP 2, PP 2 where the layers halve) merges back to
/// megatron's one-rank state dict, models no Hugging Face family describes included (learned
/// positions, LayerNorm, biases); a bare `dist_checkpointing.save`, whose missing `args` do
/// not say how the fused QKV's query groups fall, is refused saying so, writing nothing.
#[test]
fn each_case_cut_into_legacy_ranks_merges_back_to_the_same_state_dict() {
    use ckpt::{ConvertOptions, TargetFormat};
    for (dir, case) in cases() {
        let ck = open(&source(&dir, &case), false);
        let layers = ck.megatron().and_then(|m| m.num_layers).unwrap_or(0);
        let options = ConvertOptions {
            to: Some(TargetFormat::MegatronLegacy),
            tensor_parallel: Some(2),
            pipeline_parallel: Some(if layers.is_multiple_of(2) { 2 } else { 1 }),
            ..Default::default()
        };
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        match ckpt::convert(&ck, &run, &options, &WriteOptions::default()) {
            Ok(_) => {
                let back = open(&run, false);
                let got = merged(&back, &tmp.path().join("model.safetensors"));
                assert_eq!(got, reference(&dir.join("expected_model.safetensors"), ""), "{}", dir.display());
            }
            Err(e) => {
                assert!(e.to_string().contains("num_attention_heads"), "{}: {e}", dir.display());
                assert!(!run.exists(), "{}: refused but wrote", dir.display());
            }
        }
    }
}
