//! The DCP fixture table for checkpoints sharded on any dims: every folder in
//! `fixtures/dcp_nd/` was saved by real torch 2.13 on 4 gloo ranks (one for `strided_w1`) by
//! `fixtures/gen/dcp_nd_fixtures.py`: FSDP2 + tensor parallel on a (2, 2) mesh, pure tensor
//! parallel, HSDP with `Shard(1)`, DTensors on dims 1 and 2 of every dtype, the async and
//! multi-file writers, `channels_last` and transposed items, and DCP's Hugging Face storage.
//! Beside each are torch's own results: `dcp_to_torch_save` (`expected_model.safetensors`,
//! `expected_optim.safetensors`, the non-tensor values in `expected_*.json`) and, for the
//! Hugging Face storage, `consolidate_safetensors_files`' folder. Each case merges the folder
//! and compares with them, tensor for tensor and value for value (types included), reshards it
//! to 1, 3 and 5 ranks and merges that back to the same bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::PathBuf;

use ckpt::{Checkpoint, WriteOptions};
use common::{load, merge, reference, reference_values, reshard_round_trip, values};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dcp_nd")
}

/// Every tensor of the merge has as many boxes as the metadata has chunks, and at least one
/// is cut on a dim other than 0 unless `dim0_only`.
fn boxes_described(case: &str, dim0_only: bool) {
    let ck = Checkpoint::open(root().join(case).join("checkpoint").to_str().unwrap()).unwrap();
    let cut_beyond_dim0 = ck.tensors().iter().any(|t| {
        t.boxes()
            .iter()
            .filter(|b| !b.region.is_empty())
            .any(|b| b.region.sizes.iter().zip(&t.shape).skip(1).any(|(a, b)| a != b))
    });
    assert_eq!(cut_beyond_dim0, !dim0_only, "{case}");
    for t in ck.tensors() {
        assert!(!t.boxes().is_empty(), "{case}: `{}` is read as boxes", t.name);
        let rank_files = t.boxes().iter().all(|b| ck.files()[b.file].rank.is_some());
        assert!(rank_files, "{case}: every box names the rank that saved it");
    }
}

/// A `{"model": …, "optim": …}` checkpoint: model and optimizer tensors, `param_groups` values.
fn combined(case: &str) {
    let dir = root().join(case);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged.safetensors");
    let (got, meta) = merge(&dir.join("checkpoint"), &out, "dcp");
    let mut want = reference(&dir.join("expected_model.safetensors"), "model.");
    want.extend(reference(&dir.join("expected_optim.safetensors"), "optim."));
    assert_eq!(got, want, "{case}");
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
    assert_eq!(values(&meta), reference_values(&dir.join("expected_optim.json"), "non_tensor_leaves", "optim."));
    reshard_round_trip(&dir.join("checkpoint"), &out, tmp.path());
    boxes_described(case, false);
}

/// A bare state dict: flat DCP keys, and its non-tensor values when it has some.
fn bare(case: &str, dim0_only: bool) {
    let dir = root().join(case);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("merged.safetensors");
    let (got, meta) = merge(&dir.join("checkpoint"), &out, "dcp");
    assert_eq!(got, reference(&dir.join("expected_model.safetensors"), ""), "{case}");
    let expected_values = dir.join("expected_values.json");
    let want = if expected_values.exists() { reference_values(&expected_values, "", "") } else { Default::default() };
    assert_eq!(values(&meta), want, "{case}");
    reshard_round_trip(&dir.join("checkpoint"), &out, tmp.path());
    boxes_described(case, dim0_only);
}

#[test]
fn tp_fsdp2_2x2() {
    combined("tp_fsdp2_2x2");
}

#[test]
fn tp_w4() {
    combined("tp_w4");
}

#[test]
fn hsdp_shard1_2x2() {
    combined("hsdp_shard1_2x2");
}

#[test]
fn dtensor_dims_w4() {
    bare("dtensor_dims_w4", false);
}

#[test]
fn async_w4() {
    bare("async_w4", false);
}

#[test]
fn multifile_w4() {
    bare("multifile_w4", false);
}

/// Items kept with their strides (`channels_last`, transposed) are read through them.
#[test]
fn strided_w1() {
    let ck = Checkpoint::open(root().join("strided_w1/checkpoint").to_str().unwrap()).unwrap();
    let strided = ck.tensors().iter().filter(|t| t.contiguous().is_none()).count();
    assert!(strided >= 2, "the channels_last and transposed items are views");
    bare("strided_w1", true);
}

/// The string `"1e-8"` and the float `1e-8` stay apart in a merged file's metadata.
#[test]
fn values_keep_their_json_types() {
    let dir = root().join("dtensor_dims_w4");
    let tmp = tempfile::tempdir().unwrap();
    let (_, meta) = merge(&dir.join("checkpoint"), &tmp.path().join("m.safetensors"), "dcp");
    assert_eq!(meta.get("extra.eps_str").map(String::as_str), Some("\"1e-8\""));
    assert_eq!(values(&meta).get("extra.eps"), Some(&serde_json::json!(1e-8)));
}

/// DCP's Hugging Face storage: merged into a folder it is what torch's consolidation writes for
/// the state dict's order, byte for byte; merged into a file, the same tensors; resharded, a DCP
/// folder that merges to that file.
#[test]
fn hf_storage_w4() {
    let dir = root().join("hf_storage_w4");
    let src = dir.join("checkpoint");
    let tmp = tempfile::tempdir().unwrap();
    let folder = tmp.path().join("consolidated");
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "dcp-safetensors");
    assert_eq!(ck.world_size(), Some(4));
    ckpt::merge(&ck, &folder, &Default::default(), &WriteOptions::default()).unwrap();
    let want = dir.join("expected_consolidated");
    let mut names: Vec<String> =
        std::fs::read_dir(&want).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let mut have: Vec<String> =
        std::fs::read_dir(&folder).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    have.sort();
    assert_eq!(have, names);
    for n in &names {
        assert!(std::fs::read(folder.join(n)).unwrap() == std::fs::read(want.join(n)).unwrap(), "{n} differs");
    }

    let file = tmp.path().join("merged.safetensors");
    let (got, meta) = merge(&src, &file, "dcp-safetensors");
    let mut consolidated = common::Tensors::new();
    for n in names.iter().filter(|n| n.ends_with(".safetensors")) {
        consolidated.extend(load(&want.join(n)).0);
    }
    assert_eq!(got, consolidated);
    assert_eq!(meta.keys().collect::<Vec<_>>(), vec!["format"]);
    reshard_round_trip(&src, &file, tmp.path());
    boxes_described("hf_storage_w4", false);
}

/// Every case of the manifest has a test above.
#[test]
fn every_case_is_covered() {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases: Vec<&String> = json["cases"].as_object().unwrap().keys().collect();
    let covered = [
        "async_w4",
        "dtensor_dims_w4",
        "hf_storage_w4",
        "hsdp_shard1_2x2",
        "multifile_w4",
        "strided_w1",
        "tp_fsdp2_2x2",
        "tp_w4",
    ];
    let mut sorted = cases.clone();
    sorted.sort();
    assert_eq!(sorted, covered);
}
