//! TorchScript archives written by real torch (`fixtures/torch/script/`, from
//! `fixtures/gen/torchscript_fixtures.py`), which also recorded what `torch.jit.load(f)
//! .state_dict()` gives: each entry's name in order, dtype, shape and the sha256 of its bytes.
//! Each test reads an archive through the catalog and through a conversion to safetensors and
//! compares; the hostile archives pin our refusal and check that nothing ran.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use crate::common;

use ckpt::{Checkpoint, ConvertOptions, WriteOptions};
use sha2::{Digest, Sha256};

const MARKER: &str = "statekit-pwned";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/torch/script")
}

fn expected(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    all[name]["tensors"].clone()
}

fn tensors(ck: &Checkpoint) -> Vec<serde_json::Value> {
    ck.tensors()
        .iter()
        .map(|t| {
            let bytes = ck.read_tensor(t).unwrap();
            let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            serde_json::json!({ "name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape, "sha256": sha })
        })
        .collect()
}

fn check(case: &str) {
    let want = expected(case);
    let src = root().join(case);
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "torch", "{case}: a TorchScript archive is a torch file");
    assert_eq!(serde_json::Value::from(tensors(&ck)), want, "{case}: state_dict");
    assert!(ck.files().iter().all(|f| f.metadata.is_empty()), "{case}: a state_dict holds tensors only");

    let (_dir, st) = common::to_safetensors(&ck);
    let want = common::by_name(want.as_array().unwrap().clone());
    assert_eq!(common::by_name(tensors(&st)), want, "{case}: converted to safetensors");
}

#[test]
fn scripted_module_with_nested_submodules_buffers_and_a_tied_parameter() {
    check("scripted.pt");
    let names: Vec<String> =
        expected("scripted.pt").as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap().to_string()).collect();
    // TorchScript keeps the buffer that `nn.Module.state_dict()` leaves out, and the tied weight
    // under both names; a `None` bias, a plain tensor attribute and a dict of tensors are not in it.
    assert!(names.contains(&"block.scratch".to_string()));
    assert!(names.contains(&"emb.weight".to_string()) && names.contains(&"head.weight".to_string()));
    assert!(!names.iter().any(|n| n == "layers.1.bias" || n == "block.plain" || n.starts_with("block.table")));
}

#[test]
fn scripted_module_saved_on_a_gpu() {
    check("scripted_cuda.pt");
    assert_eq!(expected("scripted_cuda.pt"), expected("scripted.pt"));
}

#[test]
fn traced_sequential() {
    check("traced.pt");
}

#[test]
fn traced_module_with_a_tied_parameter() {
    check("traced_tied.pt");
}

#[test]
fn half_bfloat16_bool_and_buffers_that_are_views() {
    check("mixed.pt");
}

#[test]
fn tied_parameters_share_one_storage() {
    let ck = Checkpoint::open(root().join("scripted.pt").to_str().unwrap()).unwrap();
    let at = |name: &str| ck.tensors().iter().find(|t| t.name == name).unwrap().location();
    assert_eq!(at("emb.weight"), at("head.weight"));
}

fn refused(name: &str, reason: &str) {
    let path = root().join(name);
    let src = path.to_str().unwrap();
    let expected = format!("{src}: {reason}");
    let err = Checkpoint::open(src).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let err = Checkpoint::open(src)
        .and_then(|ck| ckpt::convert(&ck, &out, &ConvertOptions::default(), &WriteOptions::default()))
        .unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{name}: no output left behind");
    for d in [Path::new("."), path.parent().unwrap(), dir.path()] {
        assert!(!d.join(MARKER).exists(), "{name}: the payload ran");
    }
}

#[test]
fn hostile_archive_with_a_forbidden_global() {
    refused(
        "hostile_system.pt",
        "refusing global `posix.system`: only the tensor-rebuilding globals of torch's weights-only loader are allowed",
    );
}

#[test]
fn torchscript_classes_are_refused_outside_an_archive() {
    refused(
        "hostile_class_in_torch_save.pt",
        "refusing global `__torch__.Model`: only the tensor-rebuilding globals of torch's weights-only loader are allowed; \
         `allow_globals` reads it as inert data, nothing imported or called",
    );
}

#[test]
fn custom_cpp_classes_are_refused_by_name() {
    refused(
        "hostile_cpp_class.pt",
        "`traced/data.pkl` at byte 413: `__torch__.torch.classes.quantized.LinearPackedParamsBase` is a custom C++ \
         class, whose state only its own code can restore",
    );
}
