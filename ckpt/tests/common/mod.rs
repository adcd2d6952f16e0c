//! Helpers shared by the torch fixture tables: convert a checkpoint the way a user would, and
//! compare tensor lists whatever order a format stores them in.
#![allow(dead_code, clippy::unwrap_used)]

use ckpt::{Checkpoint, ConvertOptions, WriteOptions};

/// `ck` converted to one safetensors file with default options, reopened. The folder lives as
/// long as the returned guard.
pub fn to_safetensors(ck: &Checkpoint) -> (tempfile::TempDir, Checkpoint) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.safetensors");
    ckpt::convert(ck, &out, &ConvertOptions::default(), &WriteOptions::default()).unwrap();
    let st = Checkpoint::open(out.to_str().unwrap()).unwrap();
    (dir, st)
}

/// Tensor records (`{"name": …, …}`) sorted by name: safetensors stores them by dtype and
/// name, torch in state-dict order.
pub fn by_name(mut records: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    records.sort_by_key(|v| v["name"].as_str().unwrap().to_string());
    records
}
