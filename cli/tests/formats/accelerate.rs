//! `ckpt` on whole accelerate `save_state` folders: inspect lists every component (text and
//! the JSON schema the README documents), merge picks a model, verify reports a half-saved
//! folder with one line per problem and exit 1, reshard refuses it, and the folder's files are
//! never written.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

fn folder(name: &str) -> std::path::PathBuf {
    fixtures().join("accelerate").join(name)
}

#[test]
fn inspect_lists_every_component_of_an_fsdp2_folder() {
    let out = run(&["inspect", folder("fsdp2_w3").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("format:  accelerate-state\n"), "{text}");
    for line in [
        "accelerate save_state, saved by 3 rank(s):",
        "model 0: pytorch_model_fsdp_0 (dcp,",
        "optimizer 0: optimizer_0 (dcp, 1 param group(s)",
        "scheduler 0: scheduler.bin (last_epoch=",
        "rng rank 2: random_states_2.pkl (step ",
        "data 0: dl_state_dict.bin (dl_state_dict: batches yielded ",
    ] {
        assert!(text.contains(line), "missing `{line}` in\n{text}");
    }
}

#[test]
fn inspect_json_has_the_documented_components() {
    let out = run(&["inspect", "--json", folder("ds_two_models_w2").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["schema"], "statekit.inspect/2");
    assert_eq!(doc["format"], "accelerate-state");
    let c = &doc["components"];
    assert_eq!(c["world_size"], 2);
    let models = c["models"].as_array().unwrap();
    assert_eq!(models.len(), 2);
    assert_eq!(models[1]["format"], "deepspeed-zero");
    assert_eq!(models[1]["zero_stage"], 3, "the second plugin was ZeRO-3");
    assert_eq!(c["optimizers"][0]["format"], "in-model");
    assert_eq!(c["rng"].as_array().unwrap().len(), 2);
    for key in ["schedulers", "scaler", "data", "custom", "other_files"] {
        assert!(c.get(key).is_some(), "{key}");
    }
}

#[test]
fn merge_model_n_only_applies_to_save_state_folders() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("m.safetensors");
    let file = folder("two_models").join("model.safetensors");
    let out = run(&["merge", file.to_str().unwrap(), out_path.to_str().unwrap(), "--model", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("applies to accelerate `save_state` folders"), "{}", stderr(&out));
    let out = run(&["merge", folder("two_models").to_str().unwrap(), out_path.to_str().unwrap(), "--model", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&out_path).unwrap(),
        std::fs::read(folder("two_models").join("model_1.safetensors")).unwrap()
    );
}

/// A copy of an FSDP2 fixture with its rank 1 RNG file removed.
fn half_saved() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("half");
    copy_tree(&folder("fsdp2_w2"), &dst);
    std::fs::remove_file(dst.join("random_states_1.pkl")).unwrap();
    (tmp, dst)
}

fn copy_tree(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn hostile_a_half_saved_folder_is_reported_by_verify_and_refused_by_merge_and_reshard() {
    let (tmp, dir) = half_saved();
    let out = run(&["verify", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    assert!(text.contains("problem: ") && text.contains("random_states_1.pkl: rank 1: missing"), "{text}");
    let dst = tmp.path().join("m.safetensors");
    for args in [
        vec!["merge", dir.to_str().unwrap(), dst.to_str().unwrap()],
        vec!["reshard", dir.to_str().unwrap(), tmp.path().join("w3").to_str().unwrap(), "--world-size", "3"],
    ] {
        let out = run(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(err.contains("random_states_1.pkl") && err.contains("rank 1"), "{err}");
    }
    assert!(!dst.exists() && !tmp.path().join("w3").exists(), "nothing written");
}

#[test]
fn hostile_reshard_into_the_source_folder_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("src");
    copy_tree(&folder("fsdp2_w2"), &dir);
    let before = std::fs::read(dir.join("random_states_0.pkl")).unwrap();
    let inside = dir.join("pytorch_model_fsdp_0");
    let out = run(&["reshard", dir.to_str().unwrap(), inside.to_str().unwrap(), "--world-size", "3"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("already exists"), "{}", stderr(&out));
    assert_eq!(std::fs::read(dir.join("random_states_0.pkl")).unwrap(), before);
    assert!(run(&["verify", dir.to_str().unwrap()]).status.success());
}

#[test]
fn hostile_rng_files_of_another_world_size_are_reported_with_the_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("extra");
    copy_tree(&folder("fsdp2_w2"), &dir);
    std::fs::copy(dir.join("random_states_1.pkl"), dir.join("random_states_2.pkl")).unwrap();
    let out = run(&["verify", "--json", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems: Vec<&str> = doc["problems"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    assert!(
        problems.iter().any(|p| p.contains("random_states_2.pkl: rank 2") && p.contains("saved by 2 ranks")),
        "{problems:?}"
    );
}
