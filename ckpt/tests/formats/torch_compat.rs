//! Torch files in the forms older torch versions and GPU machines wrote, and the rarer values
//! torch's weights-only loader admits (`fixtures/torch/compat/`, written by
//! `fixtures/gen/torch_compat_fixtures.py`). Storages saved on `cuda:0`, `cuda:1`, `mps`, `xpu`
//! and other devices come out as plain bytes, as `torch.load(f, weights_only=True,
//! map_location="cpu")` gives them; the generator recorded what torch loaded (names, dtypes,
//! shapes, sha256 of the row-major bytes, non-tensor values) and each test compares, through the
//! catalog and through a conversion to safetensors.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use crate::common;

use ckpt::Checkpoint;
use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/torch/compat")
}

fn expected(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = all[name].clone();
    assert!(case.is_object(), "{name} is not in expected.json");
    case
}

fn tensors(ck: &Checkpoint) -> Vec<serde_json::Value> {
    ck.tensors()
        .iter()
        .map(|t| {
            let bytes = ck.read_tensor(t).unwrap();
            let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            serde_json::json!({ "name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape, "device": "cpu", "sha256": sha })
        })
        .collect()
}

fn check(case: &str) {
    let want = expected(case);
    let src = root().join(case);
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "torch");
    assert_eq!(serde_json::Value::from(tensors(&ck)), want["tensors"], "{case}: tensors");
    let leaves: serde_json::Map<String, serde_json::Value> =
        ck.values().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    assert_eq!(serde_json::Value::from(leaves), want["leaves"], "{case}: values");

    let (_dir, st) = common::to_safetensors(&ck);
    let want = common::by_name(want["tensors"].as_array().unwrap().clone());
    assert_eq!(common::by_name(tensors(&st)), want, "{case}: converted to safetensors");
}

#[test]
fn legacy_stream_from_a_gpu_with_the_pre_1_0_rebuild_function() {
    // `torch.cuda.FloatStorage` on `cuda:0` and `cuda:1`, tensors through `_rebuild_tensor`.
    check("legacy_cuda_rebuild_tensor.pt");
}

#[test]
fn legacy_stream_from_a_gpu() {
    check("legacy_cuda_v2.pt");
}

#[test]
fn zip_from_a_gpu_with_the_pre_1_0_rebuild_function() {
    check("zip_cuda_rebuild_tensor.pt");
}

#[test]
fn storages_on_every_kind_of_device() {
    check("zip_devices.pt");
}

#[test]
fn untyped_storage_and_parameters_on_a_gpu() {
    check("zip_cuda_v3_parameter.pt");
}

#[test]
fn backend_without_storages_pickled_as_a_cpu_copy() {
    check("zip_xla_from_cpu.pt");
}

#[test]
fn pre_0_4_tensor_classes_set_by_build() {
    check("zip_legacy_tensor_classes.pt");
    check("legacy_tensor_classes.pt");
}

#[test]
fn legacy_storage_views() {
    check("legacy_storage_views.pt");
}

#[test]
fn sets_counters_bytearrays_complex_devices_and_dtypes_as_values() {
    check("values.pt");
}

#[test]
fn every_case_is_tested() {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let all: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    let mut on_disk: Vec<String> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".pt"))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = all.keys().cloned().collect();
    listed.sort();
    assert_eq!(on_disk, listed);
}
