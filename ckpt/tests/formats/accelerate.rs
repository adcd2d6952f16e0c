//! `accelerator.save_state` folders written by real accelerate 1.15 on CPU
//! (`fixtures/gen/accelerate_state_fixtures.py`): each model, optimizer, scheduler, data
//! position and custom-object file, opened on its own, reads back to the tensors and values
//! `torch.load` gives (recorded in `expected.json`). The RNG files reference numpy's array
//! reconstruction: the plain torch reader refuses it by name, and `read_rng_state`, whose
//! allow-list admits exactly numpy's reconstruction as inert data, decodes them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use ckpt::Checkpoint;
use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/accelerate")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("expected.json")).unwrap()).unwrap()
}

/// Nested values under dotted names (list items by index), as the generator records them.
fn flatten(prefix: &str, v: &serde_json::Value, out: &mut serde_json::Map<String, serde_json::Value>) {
    match v {
        serde_json::Value::Object(m) => m.iter().for_each(|(k, x)| flatten(&format!("{prefix}.{k}"), x, out)),
        serde_json::Value::Array(a) => {
            a.iter().enumerate().for_each(|(i, x)| flatten(&format!("{prefix}.{i}"), x, out))
        }
        leaf => {
            out.insert(prefix.to_string(), leaf.clone());
        }
    }
}

const FOLDERS: [&str; 5] = ["one_model", "two_models", "bin", "stateful", "custom"];

#[test]
fn every_component_file_reads_back_as_torch_loads_it() {
    let all = expected();
    let mut checked = 0;
    for folder in FOLDERS {
        for (file, want) in all[folder].as_object().unwrap() {
            if file.starts_with("random_states_") {
                continue;
            }
            let path = root().join(folder).join(file);
            let ck = Checkpoint::open(path.to_str().unwrap()).unwrap_or_else(|e| panic!("{folder}/{file}: {e}"));
            let want_t = want["tensors"].as_object().unwrap();
            assert_eq!(ck.tensors().len(), want_t.len(), "{folder}/{file}");
            for t in ck.tensors() {
                let e = &want_t[&t.name];
                assert_eq!(t.dtype.torch_name(), e["dtype"], "{folder}/{file}: {}", t.name);
                assert_eq!(serde_json::json!(t.shape), e["shape"], "{folder}/{file}: {}", t.name);
                let sha: String =
                    Sha256::digest(ck.read_tensor(t).unwrap()).iter().map(|b| format!("{b:02x}")).collect();
                assert_eq!(sha, e["sha256"], "{folder}/{file}: {}", t.name);
            }
            let mut got = serde_json::Map::new();
            for (k, v) in ck.values() {
                flatten(k, &v, &mut got);
            }
            for (k, v) in want["values"].as_object().unwrap() {
                assert_eq!(got.get(k), Some(v), "{folder}/{file}: value `{k}`");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 15, "every model, optimizer, scheduler, data and custom file");
}

#[test]
fn the_folders_hold_what_accelerate_1_15_names_them() {
    let all = expected();
    let names = |f: &str| -> Vec<String> { all[f].as_object().unwrap().keys().cloned().collect() };
    assert_eq!(
        names("two_models"),
        [
            "model.safetensors",
            "model_1.safetensors",
            "optimizer.bin",
            "optimizer_1.bin",
            "random_states_0.pkl",
            "scheduler.bin"
        ]
    );
    assert!(names("bin").contains(&"pytorch_model.bin".to_string()));
    assert!(names("stateful").contains(&"dl_state_dict.bin".to_string()));
    assert!(names("custom").contains(&"custom_checkpoint_0.pkl".to_string()));
    // The saved `step` counts `accumulate()` calls (3, with 2 accumulation steps: one
    // optimizer step), and the stateful loader saved its position after 3 batches.
    assert_eq!(all["stateful"]["random_states_0.pkl"]["values"]["step"], 3);
    assert_eq!(all["stateful"]["dl_state_dict.bin"]["values"]["_num_yielded"], 3);
}

#[test]
fn the_plain_torch_reader_refuses_rng_files_by_the_name_of_numpys_reconstruction() {
    for folder in FOLDERS {
        let path = root().join(folder).join("random_states_0.pkl");
        let err = Checkpoint::open(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("refusing global `numpy._core.multiarray._reconstruct`"), "{folder}: {err}");
    }
}

#[test]
fn rng_files_decode_as_data_with_numpys_key() {
    let all = expected();
    for folder in FOLDERS {
        let want = &all[folder]["random_states_0.pkl"]["rng"];
        let got = ckpt::accelerate::read_rng_state(&root().join(folder).join("random_states_0.pkl")).unwrap();
        assert_eq!(serde_json::json!(got.step), want["step"], "{folder}");
        let gens: Vec<&str> = want["generators"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g.as_str().unwrap())
            .filter(|g| *g != "step")
            .collect();
        assert_eq!(got.generators, gens, "{folder}");
        let np = got.numpy.as_ref().expect("numpy state");
        assert_eq!(np.kind, want["numpy"]["kind"], "{folder}");
        assert_eq!(serde_json::json!(np.pos), want["numpy"]["pos"], "{folder}");
        assert_eq!(serde_json::json!(np.key.len()), want["numpy"]["key_len"], "{folder}");
        assert_eq!(serde_json::json!(np.key[..4]), want["numpy"]["key_first"], "{folder}");
        let bytes: Vec<u8> = np.key.iter().flat_map(|w| w.to_le_bytes()).collect();
        let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(sha, want["numpy"]["key_sha256"], "{folder}");
        assert_eq!(serde_json::json!(got.torch_state_len), want["torch_state_len"], "{folder}");
    }
}

#[test]
fn the_rng_reader_admits_numpys_reconstruction_and_nothing_else() {
    let hostile = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/torch/os_system.pt");
    let err = ckpt::accelerate::read_rng_state(&hostile).unwrap_err().to_string();
    assert!(err.contains("refusing global `posix.system`"), "{err}");
}

#[test]
fn hostile_rng_files_are_refused_with_the_reason() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/accelerate");
    let err = |f: &str| ckpt::accelerate::read_rng_state(&dir.join(f)).unwrap_err().to_string();
    let short = err("key_short.pkl");
    assert!(short.ends_with("key_short.pkl: `numpy_random_seed`: the key has 100 bytes, not 2496"), "{short}");
    let big = err("key_big_endian.pkl");
    assert!(
        big.contains("key_big_endian.pkl: `numpy_random_seed`: the key is not a little-endian `u4` array"),
        "{big}"
    );
    let system = err("system.pkl");
    assert!(system.contains("refusing global `posix.system`"), "{system}");
}
