//! Torch files that only `torch.load(weights_only=False)` opens (`fixtures/torch_unsafe/`,
//! written by `fixtures/gen/unsafe_torch_fixtures.py` with the real Lightning, omegaconf, numpy
//! and transformers): a Lightning `.ckpt` with omegaconf hyper-parameters, checkpoints holding
//! numpy arrays (numpy 2's and numpy 1's module names) and a `torch.device`, a
//! `training_args.bin`, and a payload that would create `statekit-pwned` if anything ran it.
//!
//! Each file is refused by name without `allow_globals`, and with it reads to exactly what
//! `torch.load(weights_only=False)` gives (the reference beside it: tensors in
//! `NAME.expected.safetensors`, values and the globals the pickle names in
//! `NAME.expected.json`), through the catalog and through `convert`.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{AllowGlobals, Checkpoint, ConvertOptions, OpenOptions, WriteOptions};

const MARKER: &str = "statekit-pwned";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/torch_unsafe").join(name)
}

fn allowing(patterns: &[&str]) -> OpenOptions {
    OpenOptions { allow_globals: AllowGlobals::new(patterns).unwrap(), ..OpenOptions::default() }
}

fn open(name: &str, patterns: &[&str]) -> ckpt::Result<Checkpoint> {
    Checkpoint::open_with(fixture(name).to_str().unwrap(), &allowing(patterns))
}

fn expected_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(&format!("{name}.expected.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `name → (dtype, shape, bytes)` of a catalog, read through the catalog.
fn tensors_of(ck: &Checkpoint) -> common::Tensors {
    ck.tensors()
        .iter()
        .map(|t| {
            let shape = t.shape.iter().map(|&d| d as usize).collect();
            (t.name.clone(), (t.dtype.safetensors_name().to_string(), shape, ck.read_tensor(t).unwrap()))
        })
        .collect()
}

fn st_dtype_names(t: common::Tensors) -> common::Tensors {
    // safetensors' crate spells dtypes as its enum's Debug; ours as the format's names.
    t.into_iter().map(|(k, (d, s, b))| (k, (d.to_uppercase(), s, b))).collect()
}

/// The file read with `patterns` equals its reference: tensors, values, globals; and a
/// conversion to safetensors and to torch keeps every tensor.
fn matches_reference(name: &str, patterns: &[&str]) -> Checkpoint {
    let ck = open(name, patterns).unwrap_or_else(|e| panic!("{name}: {e}"));
    let (want, _) = common::load(&fixture(&format!("{name}.expected.safetensors")));
    let want = st_dtype_names(want);
    let got = tensors_of(&ck);
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}: tensor names");
    for (k, w) in &want {
        assert_eq!(&got[k], w, "{name}: tensor `{k}`");
    }
    let doc = expected_json(name);
    let values: serde_json::Map<String, serde_json::Value> =
        ck.values().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let want_values = doc["values"].as_object().unwrap();
    assert_eq!(values.keys().collect::<Vec<_>>().len(), want_values.len(), "{name}: value count");
    for (k, w) in want_values {
        assert_eq!(values.get(k), Some(w), "{name}: value `{k}`");
    }
    let globals: Vec<&str> = doc["globals"].as_array().unwrap().iter().map(|g| g.as_str().unwrap()).collect();
    assert_eq!(ck.files()[0].globals, globals, "{name}: globals");

    for out in ["out.safetensors", "out.pt"] {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join(out);
        ckpt::convert(&ck, &dst, &ConvertOptions::default(), &WriteOptions::default()).unwrap();
        let back = Checkpoint::open(dst.to_str().unwrap()).unwrap();
        assert_eq!(tensors_of(&back), got, "{name}: tensors after convert to {out}");
    }
    ck
}

fn refused(name: &str, patterns: &[&str], reason: &str) {
    let path = fixture(name);
    let err = open(name, patterns).unwrap_err();
    assert_eq!(err.to_string(), format!("{}: {reason}", path.display()));
    assert!(err.is_invalid_data());
    let report = ckpt::verify_with(path.to_str().unwrap(), &allowing(patterns)).unwrap();
    assert_eq!(report.problems.len(), 1, "{name}: verify reports the refusal");
}

const OMEGACONF: &str = "`omegaconf.dictconfig.DictConfig` (and `omegaconf.base.ContainerMetadata`, `typing.Any`, \
    `__builtin__.dict`, `collections.defaultdict`, `omegaconf.nodes.AnyNode`, `omegaconf.base.Metadata`, \
    `omegaconf.listconfig.ListConfig`, `__builtin__.list`, `__builtin__.long`)";
const WEIGHTS_ONLY: &str = "only the tensor-rebuilding globals of torch's weights-only loader are allowed";

#[test]
fn lightning_checkpoint_with_omegaconf_hyper_parameters() {
    refused(
        "lightning.ckpt",
        &[],
        &format!(
            "refusing global {OMEGACONF}: {WEIGHTS_ONLY}; `allow_globals` reads them as inert data, nothing imported or called"
        ),
    );
    // A prefix admits a module; what it leaves out is still named.
    refused(
        "lightning.ckpt",
        &["omegaconf.*"],
        "refusing global `typing.Any` (and `__builtin__.dict`, `collections.defaultdict`, `__builtin__.list`, \
         `__builtin__.long`): only the tensor-rebuilding globals of torch's weights-only loader and those \
         `allow_globals` names are allowed",
    );
    // Python 3's names for protocol 2's builtins are understood too.
    let patterns =
        ["omegaconf.*", "typing.Any", "builtins.dict", "builtins.list", "builtins.int", "collections.defaultdict"];
    let ck = matches_reference("lightning.ckpt", &patterns);
    let names: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
    assert!(names.contains(&"state_dict.layer.weight"), "{names:?}");
    assert!(names.contains(&"optimizer_states.0.state.0.exp_avg"), "{names:?}");
    let values: std::collections::HashMap<&str, serde_json::Value> = ck.values().into_iter().collect();
    assert_eq!(values["hparams_type"], serde_json::json!({ "__class__": "omegaconf.dictconfig.DictConfig" }));
    assert_eq!(values["hyper_parameters"]["__class__"], "omegaconf.dictconfig.DictConfig");
    matches_reference("lightning.ckpt", &["*"]);
}

#[test]
fn numpy_arrays_scalars_and_a_device() {
    refused(
        "numpy_arrays.pt",
        &[],
        &format!(
            "refusing global `numpy._core.multiarray._reconstruct` (and `numpy.ndarray`, `numpy.dtype`, \
             `__builtin__.bytes`, `numpy._core.multiarray.scalar`, `torch.nn.modules.linear.Linear`): {WEIGHTS_ONLY}; \
             `allow_globals` reads them as inert data, nothing imported or called"
        ),
    );
    let ck = matches_reference("numpy_arrays.pt", &["numpy.*", "builtins.bytes", "torch.nn.*"]);
    // A whole module's parameters are in its record's state.
    assert!(ck.tensors().iter().any(|t| t.name == "module.state._parameters.weight"));
    let t = |n: &str| ck.tensors().iter().find(|t| t.name == n).unwrap().clone();
    // Fortran order is kept as strides and read row-major; big-endian elements are swapped.
    assert_eq!(t("arrays.fortran").shape, [3, 4]);
    assert!(ck.is_decoded(&t("arrays.fortran")));
    assert_eq!(ck.mappable(&t("arrays.f32")), None, "decoded bytes are not in the file");
    assert!(ck.mappable(&t("model.weight")).is_some());
    let values: std::collections::HashMap<&str, serde_json::Value> = ck.values().into_iter().collect();
    assert_eq!(values["device"], "cuda:1");
    assert_eq!(values["scalars.f32"], 1.5);
    // A string array has no tensor equivalent: it stays a record.
    assert_eq!(values["strings"]["__class__"], "numpy._core.multiarray._reconstruct");
}

#[test]
fn numpy_1_module_names() {
    refused(
        "numpy1_arrays.pt",
        &[],
        &format!(
            "refusing global `numpy.core.multiarray._reconstruct` (and `numpy.ndarray`, `numpy.dtype`, \
             `numpy.core.multiarray.scalar`): {WEIGHTS_ONLY}; `allow_globals` reads them as inert data, nothing \
             imported or called"
        ),
    );
    matches_reference("numpy1_arrays.pt", &["numpy.*"]);
}

#[test]
fn transformers_training_args() {
    let err = open("training_args.bin", &[]).unwrap_err().to_string();
    assert!(err.contains("refusing global `transformers.training_args.TrainingArguments` (and "), "{err}");
    let ck = matches_reference("training_args.bin", &["transformers.*", "accelerate.*"]);
    assert!(ck.tensors().is_empty());
}

/// Every place the payload could have run: the working directory, the fixture folder, the
/// output folder.
fn never_ran(out: &Path) {
    for d in [Path::new("."), fixture("").as_path(), out] {
        assert!(!d.join(MARKER).exists(), "the payload ran in {}", d.display());
    }
}

#[test]
fn payload_is_read_as_data_and_never_run() {
    refused(
        "payload.pt",
        &[],
        &format!(
            "refusing global `posix.system` (and `__builtin__.eval`): {WEIGHTS_ONLY}; `allow_globals` reads them as \
             inert data, nothing imported or called"
        ),
    );
    let ck = matches_reference("payload.pt", &["*"]);
    let values: std::collections::HashMap<&str, serde_json::Value> = ck.values().into_iter().collect();
    assert_eq!(values["run"], serde_json::json!({ "__class__": "posix.system", "args": ["touch statekit-pwned"] }));
    let dir = tempfile::tempdir().unwrap();
    ckpt::convert(&ck, &dir.path().join("out.safetensors"), &ConvertOptions::default(), &WriteOptions::default())
        .unwrap();
    never_ran(dir.path());
}

#[test]
fn the_budget_bounds_records_under_any() {
    // 40 records, each holding the one before twice: 2^40 nodes as a tree.
    refused(
        "record_bomb.pt",
        &["*"],
        "memory budget exceeded: the objects and values of 434 bytes of pickle need more than 16821376 bytes",
    );
    // Records nested past the machine's depth bound (nothing recursive can be made to blow).
    refused("record_chain.pt", &["*"], "`archive/data.pkl` at byte 2536: nesting deeper than 256 levels");
}

#[test]
fn patterns_are_checked_where_they_enter() {
    for bad in ["om*", "omegaconf", "*.x", "", "a..b", "a.b.", " a.b", "a.*.b"] {
        let err = AllowGlobals::new([bad]).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "`allow_globals`: `{bad}` is not a dotted name (`omegaconf.dictconfig.DictConfig`), a prefix ending in \
                 `.*` (`omegaconf.*`), or `*`"
            )
        );
    }
    let a = AllowGlobals::new(["omegaconf.*", "typing.Any", "builtins.int"]).unwrap();
    assert!(a.allows("omegaconf.nodes.AnyNode") && a.allows("typing.Any") && a.allows("__builtin__.long"));
    assert!(!a.allows("omegaconfx.A") && !a.allows("typing.Anything") && !a.allows("posix.system"));
    assert_eq!(a.patterns(), ["omegaconf.*", "typing.Any", "builtins.int"]);
    assert!(AllowGlobals::any().allows("anything.at.all"));
    // The option belongs to torch files.
    let st = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/safetensors/model_single/model.safetensors");
    let err = Checkpoint::open_with(st.to_str().unwrap(), &allowing(&["*"])).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "`allow_globals` applies to torch files (`.bin`, `.pt`, `.ckpt`, and their sharded sets) only; {} is safetensors",
            st.display()
        )
    );
}

#[test]
fn weights_only_files_list_their_globals_and_read_as_before() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/torch/basic.pt");
    let plain = Checkpoint::open(path.to_str().unwrap()).unwrap();
    let any = Checkpoint::open_with(path.to_str().unwrap(), &allowing(&["*"])).unwrap();
    assert!(plain.files()[0].globals.contains(&"torch._utils._rebuild_tensor_v2".to_string()));
    assert_eq!(plain.files()[0].globals, any.files()[0].globals);
    assert_eq!(tensors_of(&plain), tensors_of(&any));
}
