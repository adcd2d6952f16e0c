//! `ckpt` on DCP folders end to end: inspect, merge (byte-identical to `accelerate
//! merge-weights`), reshard and convert `--to dcp`, and how usage mistakes are refused.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

fn accelerate_model() -> std::path::PathBuf {
    fixtures().join("dcp/accelerate_w3_bf16/checkpoint/pytorch_model_fsdp_0")
}

#[test]
fn inspect_names_the_format_and_strips_accelerates_key() {
    let out = run(&["inspect", "--json", accelerate_model().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["format"], "dcp");
    assert_eq!(doc["files"].as_array().unwrap().len(), 3);
    let names: Vec<&str> = doc["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"embed.weight") && names.contains(&"norm.running_mean"), "{names:?}");
}

#[test]
fn merge_reshard_merge_is_byte_identical_to_accelerate() {
    let dir = tempfile::tempdir().unwrap();
    let merged = dir.path().join("model.safetensors");
    let out = run(&["merge", accelerate_model().to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{}\n", merged.display()));
    let accelerate =
        std::fs::read(fixtures().join("dcp/accelerate_w3_bf16/accelerate_merge/model.safetensors")).unwrap();
    assert!(std::fs::read(&merged).unwrap() == accelerate);

    let resharded = dir.path().join("w5");
    let out = run(&["reshard", accelerate_model().to_str().unwrap(), resharded.to_str().unwrap(), "--world-size", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let listed: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    let mut want: Vec<String> =
        (0..5).map(|r| resharded.join(format!("__{r}_0.distcp")).display().to_string()).collect();
    want.push(resharded.join(".metadata").display().to_string());
    assert_eq!(listed, want);

    let again = dir.path().join("again.safetensors");
    let out = run(&["merge", resharded.to_str().unwrap(), again.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::read(&again).unwrap() == accelerate);
    let out = run(&["verify", resharded.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
}

#[test]
fn convert_to_dcp_needs_a_world_size_and_nothing_else() {
    let src = fixtures().join("dcp/accelerate_w3_bf16/expected_model.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("dcp");
    let out = run(&["convert", src.to_str().unwrap(), dst.to_str().unwrap(), "--to", "dcp"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr(&out), "error: `--to dcp` needs `--world-size M`\n");
    let out = run(&["convert", src.to_str().unwrap(), dst.to_str().unwrap(), "--world-size", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr(&out), "error: `--world-size` only applies to `--to dcp`\n");
    let out = run(&["convert", src.to_str().unwrap(), dst.to_str().unwrap(), "--to", "dcp", "--world-size", "0"]);
    assert_eq!(out.status.code(), Some(2));
    // Refused at the edge, as a usage error, before anything is read.
    assert!(
        stderr(&out).starts_with("error: invalid value '0' for '--world-size <WORLD_SIZE>': 0 is not in 1..=1048576\n"),
        "{}",
        stderr(&out)
    );
    assert!(!dst.exists());

    let out = run(&["convert", src.to_str().unwrap(), dst.to_str().unwrap(), "--to", "dcp", "--world-size", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dst.join(".metadata").is_file() && dst.join("__1_0.distcp").is_file());
}

#[test]
fn reshard_refuses_its_own_source_and_non_dcp_input() {
    let src = fixtures().join("dcp/fsdp2_w3_bf16/checkpoint");
    let out = run(&["reshard", src.to_str().unwrap(), src.to_str().unwrap(), "--world-size", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).ends_with("is the source, refusing to overwrite it\n"), "{}", stderr(&out));

    let plain = fixtures().join("dcp/fsdp2_w3_bf16/expected_model.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let out = run(&["reshard", plain.to_str().unwrap(), dir.path().join("o").to_str().unwrap(), "--world-size", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is not a DCP folder (no `.metadata`)"), "{}", stderr(&out));
}
