//! Megatron saves whose layers or experts are spread in ways a plain TP × PP grid does not
//! tell: legacy mixture-of-experts saves at expert parallel 2 (`fixtures/megatron_legacy_moe/`:
//! `ep2`, whose `mp_rank_00_001` is expert rank 1, `pp2ep2` in `mp_rank_TT_PPP_EEE` folders, and
//! `tp2ep2`, experts cut by tensor parallelism), and pipeline stages with virtual chunks or an uneven first stage
//! (`fixtures/megatron_stages/`), each saved by megatron-core 0.19.2's `save_checkpoint` in the
//! legacy layout (`torch/`) and, for the stages, in `torch_dist` (`torch_dist/`) from the same
//! state (`fixtures/gen/megatron_stages_fixtures.py`). `expected_model.safetensors` is megatron's
//! own world-size-1 load of that state: a merge of either layout must give it bit for bit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, WriteOptions};
use common::{load, reference};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// Every (case folder, layout folder) of the table.
fn cases() -> Vec<(PathBuf, PathBuf, serde_json::Value)> {
    let mut out = Vec::new();
    for group in ["megatron_legacy_moe", "megatron_stages"] {
        for entry in std::fs::read_dir(fixtures().join(group)).unwrap() {
            let dir = entry.unwrap().path();
            let Ok(text) = std::fs::read_to_string(dir.join("case.json")) else { continue };
            let case: serde_json::Value = serde_json::from_str(&text).unwrap();
            for layout in case["formats"].as_array().unwrap() {
                out.push((dir.clone(), dir.join(layout.as_str().unwrap()), case.clone()));
            }
        }
    }
    out.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(out.len(), 8, "the table lost its cases: {out:?}");
    out
}

fn merged(src: &Path, out: &Path) -> common::Tensors {
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    ckpt::merge(&ck, out, &Default::default(), &WriteOptions::default()).unwrap();
    load(out).0
}

#[test]
fn merge_equals_megatrons_one_rank_state_dict() {
    for (dir, src, _) in cases() {
        let tmp = tempfile::tempdir().unwrap();
        let got = merged(&src, &tmp.path().join("model.safetensors"));
        assert_eq!(got, reference(&dir.join("expected_model.safetensors"), ""), "{}", src.display());
    }
}

/// Each save written again as a `torch_dist` run and as legacy ranks (TP 2, even stages, EP 2
/// for the MoE ones) merges to the same state dict: virtual chunks and uneven stages
/// included, since the one-rank model is what is cut.
#[test]
fn each_save_written_in_either_megatron_layout_merges_to_the_same_state_dict() {
    for (dir, src, case) in cases() {
        let want = reference(&dir.join("expected_model.safetensors"), "");
        let ep = if case["experts"].as_u64().is_some() { 2 } else { 1 };
        common::through_megatron_layouts(&src, &want, case["layers"].as_u64().unwrap(), ep);
    }
}

#[test]
fn inspect_tells_the_runs_layers_and_ranks() {
    for (_, src, case) in cases() {
        let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
        let m = ck.megatron().unwrap();
        assert_eq!(m.num_layers, case["layers"].as_u64(), "{}", src.display());
        assert_eq!(m.pipeline_parallel, case["pp"].as_u64(), "{}", src.display());
        assert_eq!(m.tensor_parallel, case["tp"].as_u64(), "{}", src.display());
        assert_eq!(ck.world_size(), case["world_size"].as_u64(), "{}", src.display());
        let report = ckpt::verify(src.to_str().unwrap()).unwrap();
        assert!(report.is_valid(), "{}: {:?}", src.display(), report.problems);
    }
}

/// These saves were written with `--no-save-optim`: asked for the optimizer, each says so, by
/// the first rank's file, rather than failing on what a missing optimizer does not hold.
#[test]
fn a_legacy_save_without_an_optimizer_says_so() {
    for (_, src, _) in cases().into_iter().filter(|c| c.1.ends_with("torch")) {
        let tmp = tempfile::tempdir().unwrap();
        let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
        let options = ckpt::MergeOptions { optimizer: true, ..Default::default() };
        let err = ckpt::merge(&ck, &tmp.path().join("m.safetensors"), &options, &WriteOptions::default()).unwrap_err();
        let first = ["mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"]
            .iter()
            .map(|n| src.join("iter_0000001").join(n).join("model_optim_rng.pt"))
            .find(|p| p.is_file())
            .unwrap();
        assert_eq!(err.to_string(), format!("{}: the checkpoint holds no optimizer state", first.display()));
    }
}
