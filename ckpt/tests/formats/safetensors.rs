//! The fixture table: every checkpoint in `fixtures/safetensors/` was written by the real tools
//! (`fixtures/gen/safetensors_fixtures.py`), which also recorded what torch reads back from it.
//! Each test opens one fixture and compares the catalog with that record, tensor by tensor.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/safetensors")
}

fn expected(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    all["fixtures"][name].clone()
}

/// Names, dtypes, shapes and content hashes, in load order, as torch reported them. Ties in
/// load order (empty tensors sharing an offset) come out of a hash map in Python, so the
/// comparison is on the multiset of entries plus the order of everything non-empty.
fn check(name: &str, path: PathBuf, format: &str) {
    let want = expected(name);
    assert_eq!(want["format"], format, "{name}");
    let ck = ckpt::Checkpoint::open(path.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), format);
    let mut got = Vec::new();
    for t in ck.tensors() {
        let bytes = ck.read_tensor(t).unwrap();
        let sum: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        got.push(serde_json::json!({ "name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape, "sha256": sum }));
    }
    let want: Vec<serde_json::Value> = want["tensors"].as_array().unwrap().clone();
    let key = |v: &serde_json::Value| v.to_string();
    let mut a: Vec<String> = got.iter().map(key).collect();
    let mut b: Vec<String> = want.iter().map(key).collect();
    let non_empty = |v: &Vec<serde_json::Value>| -> Vec<String> {
        v.iter().filter(|t| !t["shape"].as_array().unwrap().iter().any(|d| d == 0)).map(key).collect()
    };
    assert_eq!(non_empty(&got), non_empty(&want), "{name}: load order");
    a.sort();
    b.sort();
    assert_eq!(a, b, "{name}: tensors");
}

#[test]
fn every_dtype_scalars_and_empties() {
    check("all_dtypes.safetensors", root().join("all_dtypes.safetensors"), "safetensors");
}

#[test]
fn unsharded_checkpoint_from_huggingface_hub() {
    check("model_single", root().join("model_single"), "safetensors");
}

#[test]
fn sharded_checkpoint_from_huggingface_hub() {
    check("model_sharded", root().join("model_sharded"), "hf-sharded-safetensors");
    let ck = ckpt::Checkpoint::open(root().join("model_sharded").to_str().unwrap()).unwrap();
    let index = &expected("model_sharded")["index"];
    assert_eq!(ck.index_metadata().unwrap()["total_size"], index["metadata"]["total_size"]);
    assert_eq!(ck.total_bytes(), index["metadata"]["total_size"].as_u64().unwrap());
}

#[test]
fn metadata_survives() {
    let ck = ckpt::Checkpoint::open(root().join("all_dtypes.safetensors").to_str().unwrap()).unwrap();
    let meta = ck.file_metadata().unwrap();
    assert!(meta.contains(&("format".into(), "pt".into())));
    assert!(meta.contains(&("note".into(), "statekit fixture".into())));
}
