//! The DCP fixture table: every folder in `fixtures/dcp/` was saved by real torch 2.13 from
//! FSDP2 (`fixtures/gen/dcp_fixtures.py`), beside what the real tools made of it:
//! `expected_model.safetensors` / `expected_optim.safetensors` from `dcp_to_torch_save`,
//! `expected_optim.json` (the optimizer's non-tensor values) and, where accelerate can merge at
//! all, `accelerate_merge/model.safetensors` from `accelerate merge-weights`. Each case merges
//! every DCP folder of the fixture and compares with those references: byte for byte with
//! accelerate's file, tensor for tensor (dtype, shape, bytes) with torch's, value for value with
//! the optimizer's `param_groups`. Then it reshards the folder to other world sizes and checks
//! that merging the result gives the very same file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, WriteOptions};
use common::{reference, reshard_round_trip, values};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dcp")
}

fn merge(src: &Path, out: &Path) -> (common::Tensors, std::collections::BTreeMap<String, String>) {
    common::merge(src, out, "dcp")
}

/// The optimizer's non-tensor values as `expected_optim.json` records them, prefixed.
fn reference_values(case: &Path, prefix: &str) -> std::collections::BTreeMap<String, serde_json::Value> {
    common::reference_values(&case.join("expected_optim.json"), "non_tensor_leaves", prefix)
}

/// A `{"model": …, "optim": …}` checkpoint: two top-level keys, so nothing is stripped.
fn combined(case: &str) {
    let dir = root().join(case);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged.safetensors");
    let (got, meta) = merge(&dir.join("checkpoint"), &out);
    let mut want = reference(&dir.join("expected_model.safetensors"), "model.");
    want.extend(reference(&dir.join("expected_optim.safetensors"), "optim."));
    assert_eq!(got, want, "{case}");
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
    assert_eq!(values(&meta), reference_values(&dir, "optim."), "{case}");
    reshard_round_trip(&dir.join("checkpoint"), &out, tmp.path());
}

/// A bare model state dict: keys are FQNs; accelerate merges it too, to the same bytes.
fn bare(case: &str) {
    let dir = root().join(case);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged.safetensors");
    let (got, meta) = merge(&dir.join("checkpoint"), &out);
    assert_eq!(got, reference(&dir.join("expected_model.safetensors"), ""), "{case}");
    assert!(values(&meta).is_empty());
    let accelerate = std::fs::read(dir.join("accelerate_merge/model.safetensors")).unwrap();
    assert!(std::fs::read(&out).unwrap() == accelerate, "{case}: differs from `accelerate merge-weights`");
    reshard_round_trip(&dir.join("checkpoint"), &out, tmp.path());
}

/// accelerate's `pytorch_model_fsdp_0/` (`{"model": …}`) and `optimizer_0/` (`{"optimizer": …}`):
/// the single top-level key is dropped.
fn accelerate(case: &str) {
    let dir = root().join(case);
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model.safetensors");
    let (got, _) = merge(&dir.join("checkpoint/pytorch_model_fsdp_0"), &model);
    assert_eq!(got, reference(&dir.join("expected_model.safetensors"), ""), "{case}");
    let accelerate = std::fs::read(dir.join("accelerate_merge/model.safetensors")).unwrap();
    assert!(std::fs::read(&model).unwrap() == accelerate, "{case}: differs from `accelerate merge-weights`");
    reshard_round_trip(&dir.join("checkpoint/pytorch_model_fsdp_0"), &model, tmp.path());

    let optim = tmp.path().join("optim.safetensors");
    let (got, meta) = merge(&dir.join("checkpoint/optimizer_0"), &optim);
    assert_eq!(got, reference(&dir.join("expected_optim.safetensors"), ""), "{case}: optimizer");
    assert_eq!(values(&meta), reference_values(&dir, ""), "{case}: optimizer values");
    let sub = tmp.path().join("optim");
    std::fs::create_dir(&sub).unwrap();
    reshard_round_trip(&dir.join("checkpoint/optimizer_0"), &optim, &sub);
}

#[test]
fn fsdp2_w2_f32() {
    combined("fsdp2_w2_f32");
}

#[test]
fn fsdp2_w3_bf16() {
    combined("fsdp2_w3_bf16");
}

#[test]
fn fsdp2_w4_f32() {
    combined("fsdp2_w4_f32");
}

#[test]
fn fsdp2_w8_bf16() {
    combined("fsdp2_w8_bf16");
}

#[test]
fn fsdp2_w8_f32_bare() {
    bare("fsdp2_w8_f32_bare");
}

#[test]
fn fsdp2_w4_mixed_bare() {
    bare("fsdp2_w4_mixed_bare");
}

#[test]
fn accelerate_w2_f32() {
    accelerate("accelerate_w2_f32");
}

#[test]
fn accelerate_w3_bf16() {
    accelerate("accelerate_w3_bf16");
}

/// Every case of the manifest has a test above.
#[test]
fn every_case_is_covered() {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<&String> = json["cases"].as_object().unwrap().keys().collect();
    let covered = [
        "accelerate_w2_f32",
        "accelerate_w3_bf16",
        "fsdp2_w2_f32",
        "fsdp2_w3_bf16",
        "fsdp2_w4_f32",
        "fsdp2_w4_mixed_bare",
        "fsdp2_w8_bf16",
        "fsdp2_w8_f32_bare",
    ];
    assert_eq!(cases, covered);
}

/// A plain checkpoint laid out for M ranks and merged back is the same file.
#[test]
fn safetensors_to_dcp_and_back() {
    let src = root().join("fsdp2_w4_mixed_bare/accelerate_merge/model.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    for m in [1u64, 2, 5, 8] {
        let out = tmp.path().join(format!("dcp-{m}"));
        let opts =
            ckpt::ConvertOptions { to: Some(ckpt::TargetFormat::Dcp), world_size: Some(m), ..Default::default() };
        let done =
            ckpt::convert(&Checkpoint::open(src.to_str().unwrap()).unwrap(), &out, &opts, &WriteOptions::default())
                .unwrap();
        // `embed.weight` has 37 rows: every rank holds a piece of it (and `.metadata` comes last).
        assert_eq!(done.files.len() as u64, m + 1);
        let merged = tmp.path().join(format!("dcp-{m}.safetensors"));
        let ck = Checkpoint::open(out.to_str().unwrap()).unwrap();
        ckpt::merge(&ck, &merged, &Default::default(), &WriteOptions::default()).unwrap();
        assert!(std::fs::read(&merged).unwrap() == std::fs::read(&src).unwrap(), "{m} ranks");
    }
}
