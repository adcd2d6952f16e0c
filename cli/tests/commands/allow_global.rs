//! `--allow-global PATTERN` end to end: torch files that only `torch.load(weights_only=False)`
//! opens (`fixtures/torch_unsafe/`), refused by name with a `hint:` line without it, read as
//! data with it by every command that opens a source, and the payload never run.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::{fixtures, run, stderr, stdout};

fn unsafe_fixture(name: &str) -> String {
    fixtures().join("torch_unsafe").join(name).to_str().unwrap().to_string()
}

const OMEGACONF: [&str; 6] =
    ["omegaconf.*", "typing.Any", "builtins.dict", "builtins.list", "builtins.int", "collections.defaultdict"];

fn with_globals<'a>(args: &[&'a str], patterns: &[&'a str]) -> Vec<&'a str> {
    let mut v = args.to_vec();
    for p in patterns {
        v.extend(["--allow-global", p]);
    }
    v
}

#[test]
fn refusal_names_every_missing_global_and_the_flag() {
    let path = unsafe_fixture("payload.pt");
    let out = run(&["inspect", &path]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        format!(
            "error: {path}: refusing global `posix.system` (and `__builtin__.eval`): only the tensor-rebuilding globals \
             of torch's weights-only loader are allowed; `allow_globals` reads them as inert data, nothing imported or \
             called\nhint: `--allow-global posix.system --allow-global __builtin__.eval` reads them as inert data (a \
             prefix such as `--allow-global 'omegaconf.*'` admits a module, `'*'` any global); nothing is imported or \
             called\n"
        )
    );
    assert!(stdout(&out).is_empty());
    // `convert` refuses the same way, writing nothing.
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("out.safetensors");
    let out = run(&["convert", &path, dst.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("\nhint: `--allow-global posix.system --allow-global __builtin__.eval`"));
    assert!(!dst.exists());
}

#[test]
fn a_bad_pattern_is_a_usage_error() {
    let out = run(&["inspect", &unsafe_fixture("payload.pt"), "--allow-global", "posix*"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        "error: `--allow-global`: `posix*` is not a dotted name (`omegaconf.dictconfig.DictConfig`), a prefix ending in \
         `.*` (`omegaconf.*`), or `*`\nhint: `--allow-global` applies to torch files and takes a dotted name, a prefix \
         ending in `.*` (quoted: `'omegaconf.*'`), or `'*'`\n"
    );
}

#[test]
fn inspect_json_lists_the_globals_and_decoded_arrays() {
    let path = unsafe_fixture("numpy_arrays.pt");
    let out = run(&[
        "inspect",
        "--json",
        &path,
        "--allow-global",
        "numpy.*",
        "--allow-global",
        "builtins.bytes",
        "--allow-global",
        "torch.nn.*",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{path}.expected.json")).unwrap()).unwrap();
    assert_eq!(doc["schema"], "statekit.inspect/2");
    assert_eq!(doc["files"][0]["globals"], expected["globals"]);
    let tensors = doc["tensors"].as_array().unwrap();
    let f32s = tensors.iter().find(|t| t["name"] == "arrays.f32").unwrap();
    assert_eq!((f32s["decoded"].as_bool(), f32s["offset"].is_null(), f32s.get("boxes")), (Some(true), true, None));
    let weight = tensors.iter().find(|t| t["name"] == "model.weight").unwrap();
    assert!(weight.get("decoded").is_none() && weight["offset"].is_u64());
    assert_eq!(doc["values"]["device"], "cuda:1");

    // The text form has one line of globals, allowed or not.
    let out = run(&[
        "inspect",
        &path,
        "--allow-global",
        "numpy.*",
        "--allow-global",
        "builtins.bytes",
        "--allow-global",
        "torch.nn.*",
    ]);
    let globals = expected["globals"].as_array().unwrap().iter().map(|g| g.as_str().unwrap()).collect::<Vec<_>>();
    assert!(stdout(&out).contains(&format!("\nglobals: {}\n", globals.join(", "))), "{}", stdout(&out));
}

#[test]
fn lightning_converts_to_what_torch_load_gives() {
    let path = unsafe_fixture("lightning.ckpt");
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("model.safetensors");
    let out = run(&with_globals(&["-q", "convert", &path, dst.to_str().unwrap()], &OMEGACONF));
    assert!(out.status.success(), "{}", stderr(&out));
    let (got, meta) = common_load(&dst);
    let (want, _) = common_load(std::path::Path::new(&format!("{path}.expected.safetensors")));
    assert_eq!(got, want);
    // Non-tensor values travel as metadata, each as its JSON text.
    assert_eq!(
        meta.get("hparams_type").map(String::as_str),
        Some(r#"{"__class__":"omegaconf.dictconfig.DictConfig"}"#)
    );

    let report = run(&with_globals(&["verify", &path], &OMEGACONF));
    assert_eq!(report.status.code(), Some(0), "{}", stderr(&report));
    let shards = dir.path().join("shards");
    let out = run(&with_globals(&["split", &path, shards.to_str().unwrap(), "--max-shard-size", "64"], &["*"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let merged = dir.path().join("merged.safetensors");
    let out = run(&["merge", shards.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(common_load(&merged).0, want);
}

#[test]
fn the_payload_never_runs_under_any() {
    let path = unsafe_fixture("payload.pt");
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("out.safetensors");
    let out = common::ckpt()
        .current_dir(dir.path())
        .args(["convert", &path, dst.to_str().unwrap(), "--allow-global", "*"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let (_, meta) = common_load(&dst);
    assert_eq!(
        meta.get("run").map(String::as_str),
        Some(r#"{"__class__":"posix.system","args":["touch statekit-pwned"]}"#)
    );
    for d in [dir.path(), std::path::Path::new("."), fixtures().join("torch_unsafe").as_path()] {
        assert!(!d.join("statekit-pwned").exists(), "the payload ran in {}", d.display());
    }
}

#[test]
fn inspect_help_shows_the_flag() {
    let out = run(&["inspect", "--help"]);
    assert!(out.status.success());
    let snapshot = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/inspect-help.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&snapshot, stdout(&out)).unwrap();
    }
    assert_eq!(stdout(&out), std::fs::read_to_string(&snapshot).unwrap());
}

/// `name → (dtype, shape, bytes)` of a safetensors file.
type Tensors = std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

/// The tensors and the `__metadata__` of a safetensors file.
fn common_load(path: &std::path::Path) -> (Tensors, std::collections::BTreeMap<String, String>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    (tensors, meta.metadata().clone().unwrap_or_default().into_iter().collect())
}
