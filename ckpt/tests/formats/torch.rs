//! The torch fixture table: every file in `fixtures/torch/` was written by real torch 2.13
//! (`fixtures/gen/torch_fixtures.py`), which also recorded what `torch.load(weights_only=True)`
//! returns for it: each tensor's dtype, shape and row-major bytes, and each non-tensor value,
//! under dotted names. Each test reads one fixture three ways (the catalog, a conversion to
//! safetensors, a conversion to a torch file read back) and compares with that record.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use crate::common;

use ckpt::{Checkpoint, ConvertOptions, TargetFormat, WriteOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/torch")
}

fn expected(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    all[name].clone()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `(name, dtype, shape, hex)` of every tensor of a checkpoint, in load order.
fn tensors(ck: &Checkpoint) -> Vec<serde_json::Value> {
    ck.tensors()
        .iter()
        .map(|t| {
            let bytes = ck.read_tensor(t).unwrap();
            serde_json::json!({ "name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape, "hex": hex(&bytes) })
        })
        .collect()
}

fn leaves(ck: &Checkpoint) -> serde_json::Map<String, serde_json::Value> {
    ck.values().into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn check(case: &str, src: &Path) {
    let want = expected(case);
    let want_tensors = want["tensors"].as_array().unwrap().clone();
    let want_leaves = want["leaves"].as_object().unwrap().clone();

    // 1. The catalog view.
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    assert_eq!(tensors(&ck), want_tensors, "{case}: catalog");
    assert_eq!(leaves(&ck), want_leaves, "{case}: non-tensor values");

    // 2. Converted to one safetensors file: same tensors (in safetensors' order), values kept
    //    in `__metadata__` as JSON text.
    let (dir, st) = common::to_safetensors(&ck);
    assert_eq!(
        common::by_name(tensors(&st)),
        common::by_name(want_tensors.clone()),
        "{case}: converted to safetensors"
    );
    let meta: serde_json::Map<String, serde_json::Value> = st.files()[0]
        .metadata
        .iter()
        .filter(|(k, _)| k != "format")
        .map(|(k, v)| (k.clone(), serde_json::from_str(v).unwrap_or_else(|_| v.clone().into())))
        .collect();
    assert_eq!(meta, want_leaves, "{case}: metadata of the safetensors output");

    // 3. Converted to a torch file and read back: same tensors in the same order, same values.
    let pt = dir.path().join("out.pt");
    let opts = ConvertOptions { to: Some(TargetFormat::Torch), ..ConvertOptions::default() };
    ckpt::convert(&ck, &pt, &opts, &WriteOptions::default()).unwrap();
    let back = Checkpoint::open(pt.to_str().unwrap()).unwrap();
    assert_eq!(tensors(&back), want_tensors, "{case}: torch round trip");
    let mut want_back = want_leaves.clone();
    // Leaves are written back as values; dict keys come back as strings.
    for v in want_back.values_mut() {
        *v = serde_json::from_str(&v.to_string()).unwrap();
    }
    assert_eq!(leaves(&back), want_back, "{case}: torch round trip values");
}

macro_rules! fixture {
    ($test:ident, $file:literal) => {
        #[test]
        fn $test() {
            check($file, &root().join($file));
        }
    };
}

fixture!(basic, "basic.pt");
fixture!(views_with_storage_offsets, "views.pt");
fixture!(non_contiguous_strides, "strides.pt");
fixture!(tied_weights_and_shared_storage, "tied.pt");
fixture!(scalars_and_empty_tensors, "scalars_empty.pt");
fixture!(every_dtype, "dtypes.pt");
fixture!(nested_dicts_and_leaves, "nested.pt");
fixture!(parameters, "parameters.pt");
fixture!(module_state_dict_with_metadata_attribute, "module_state_dict.pt");
fixture!(legacy_pickle_stream, "legacy.pt");

#[test]
fn pickle_protocol_4() {
    // Same object as legacy.pt; torch's own weights-only loader refuses protocol 4.
    let want = expected("protocol4.pt");
    assert_eq!(want["source"], "legacy.pt (same object)");
    check("legacy.pt", &root().join("protocol4.pt"));
}

#[test]
fn sharded_pytorch_model_set() {
    let dir = root().join("sharded");
    let ck = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "hf-sharded-torch");
    assert_eq!(tensors(&ck), expected("sharded")["tensors"].as_array().unwrap().clone());
    check("sharded", &dir);
}

#[test]
fn dedupe_drops_exact_aliases_only() {
    let dir = tempfile::tempdir().unwrap();
    let tied = Checkpoint::open(root().join("tied.pt").to_str().unwrap()).unwrap();
    let out = dir.path().join("m.safetensors");
    let opts = ConvertOptions { dedupe: true, ..ConvertOptions::default() };
    let done = ckpt::convert(&tied, &out, &opts, &WriteOptions::default()).unwrap();
    assert_eq!(done.aliases, vec![("lm_head.weight".to_string(), "embed.weight".to_string())]);
    let st = Checkpoint::open(out.to_str().unwrap()).unwrap();
    let names: Vec<&str> = st.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names.len(), 2);
    assert!(names.contains(&"embed.weight") && names.contains(&"half_view"));
    assert!(st.files()[0].metadata.contains(&("lm_head.weight".into(), "embed.weight".into())));

    // In a torch file the alias stays and shares the storage: one storage record fewer.
    let pt = dir.path().join("m.pt");
    let opts = ConvertOptions { dedupe: true, ..ConvertOptions::default() };
    ckpt::convert(&tied, &pt, &opts, &WriteOptions::default()).unwrap();
    let back = Checkpoint::open(pt.to_str().unwrap()).unwrap();
    assert_eq!(tensors(&back), expected("tied.pt")["tensors"].as_array().unwrap().clone());
    let offsets: Vec<u64> = back.tensors().iter().take(2).map(|t| t.location().unwrap().1).collect();
    assert_eq!(offsets[0], offsets[1], "tied tensors share one storage");
}

#[test]
fn sharded_output_and_index() {
    let dir = tempfile::tempdir().unwrap();
    let src = Checkpoint::open(root().join("sharded").to_str().unwrap()).unwrap();
    for (to, index) in [
        (TargetFormat::Torch, "pytorch_model.bin.index.json"),
        (TargetFormat::Safetensors, "model.safetensors.index.json"),
    ] {
        let out = dir.path().join(format!("{to:?}"));
        let opts = ConvertOptions { to: Some(to), max_shard_size: Some(200), ..ConvertOptions::default() };
        let done = ckpt::convert(&src, &out, &opts, &WriteOptions::default()).unwrap();
        assert_eq!(done.files.last(), Some(&out.join(index)));
        assert!(done.files.len() >= 2);
        let ck = Checkpoint::open(out.to_str().unwrap()).unwrap();
        let mut got = tensors(&ck);
        let mut want = expected("sharded")["tensors"].as_array().unwrap().clone();
        let by_name = |v: &serde_json::Value| v["name"].as_str().unwrap().to_string();
        got.sort_by_key(by_name);
        want.sort_by_key(by_name);
        assert_eq!(got, want, "{to:?}");
    }
}

#[test]
fn errors_leave_no_partial_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.safetensors");
    // complex64 fits in safetensors; a cast target that is not a float dtype is refused up front.
    let opts = ConvertOptions { dtype: Some(ckpt::Dtype::I8), ..ConvertOptions::default() };
    let err = ckpt::convert(
        &ckpt::Checkpoint::open(root().join("basic.pt").to_str().unwrap()).unwrap(),
        &out,
        &opts,
        &WriteOptions::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "cannot convert to {}: `dtype` must be a float dtype (f64, f32, f16, bf16 or FP8), not `I8`",
            out.display()
        )
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
