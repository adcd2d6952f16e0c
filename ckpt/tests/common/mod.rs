//! Helpers shared by the fixture tables: convert a checkpoint the way a user would, compare
//! tensor lists whatever order a format stores them in, merge and reshard DCP folders.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;

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

/// `name → (dtype, shape, bytes)` of a safetensors file.
pub type Tensors = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

/// The tensors of a safetensors file, and its `__metadata__`.
pub fn load(path: &Path) -> (Tensors, BTreeMap<String, String>) {
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

/// The reference tensors of a safetensors file, each name prefixed by `prefix`.
pub fn reference(file: &Path, prefix: &str) -> Tensors {
    load(file).0.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)).collect()
}

/// Merges the checkpoint at `src` (of format `format`) into one safetensors file `out`.
pub fn merge(src: &Path, out: &Path, format: &str) -> (Tensors, BTreeMap<String, String>) {
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), format);
    ckpt::merge(&ck, out, &Default::default(), &WriteOptions::default()).unwrap();
    load(out)
}

/// The non-tensor values of a merged file's `__metadata__` (all but `format`), parsed.
pub fn values(meta: &BTreeMap<String, String>) -> BTreeMap<String, serde_json::Value> {
    meta.iter().filter(|(k, _)| *k != "format").map(|(k, v)| (k.clone(), serde_json::from_str(v).unwrap())).collect()
}

/// The `non_tensor_leaves`-style values of a generator's JSON (`{key: {python_type, value}}`
/// under `field`, or at the top when `field` is empty), each key prefixed.
pub fn reference_values(file: &Path, field: &str, prefix: &str) -> BTreeMap<String, serde_json::Value> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let leaves = if field.is_empty() { &json } else { &json[field] };
    leaves.as_object().unwrap().iter().map(|(k, v)| (format!("{prefix}{k}"), v["value"].clone())).collect()
}

/// Reshards `src` to 1, 3 and 5 ranks and checks that merging each result gives the file
/// `merged`, and that each verifies.
pub fn reshard_round_trip(src: &Path, merged: &Path, dir: &Path) {
    let want = std::fs::read(merged).unwrap();
    let source = Checkpoint::open(src.to_str().unwrap()).unwrap();
    for m in [1u64, 3, 5] {
        let out = dir.join(format!("resharded-{m}"));
        let done = ckpt::reshard(&source, &out, m, &WriteOptions::default()).unwrap();
        assert!(done.files.len() as u64 <= m + 1, "at most one file per rank, then `.metadata`");
        let again = dir.join(format!("resharded-{m}.safetensors"));
        let ck = Checkpoint::open(out.to_str().unwrap()).unwrap();
        ckpt::merge(&ck, &again, &Default::default(), &WriteOptions::default()).unwrap();
        assert!(std::fs::read(&again).unwrap() == want, "{}: resharded to {m} ranks", src.display());
        let report = ckpt::verify(out.to_str().unwrap()).unwrap();
        assert!(report.is_valid(), "{:?}", report.problems);
    }
}

/// A hostile checkpoint folder `dir` of format `format`, refused with exactly `expected` by the
/// catalog reader (as invalid data), by `verify` (as its one problem) and by `reshard` (leaving no
/// output). Returns the temporary folder the reshard wrote into, for checks of its own.
pub fn refused_everywhere(dir: &Path, format: &str, expected: &str) -> tempfile::TempDir {
    let src = dir.to_str().unwrap();
    let err = Checkpoint::open(src).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data(), "{src}: verify should report it as a problem");

    let report = ckpt::verify(src).unwrap();
    assert_eq!(report.format.map(|f| f.name()), Some(format));
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![expected.to_string()]);

    let out = tempfile::tempdir().unwrap();
    let target = out.path().join("resharded");
    let err =
        Checkpoint::open(src).and_then(|ck| ckpt::reshard(&ck, &target, 2, &WriteOptions::default())).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(!target.exists(), "{src}: no output left behind");
    out
}

/// Copies the file or folder tree `src` to `dst`: a checkpoint to damage at test time.
pub fn copy_tree(src: &Path, dst: &Path) {
    if src.is_file() {
        std::fs::copy(src, dst).unwrap();
        return;
    }
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        copy_tree(&e.path(), &dst.join(e.file_name()));
    }
}

/// Writes the Megatron checkpoint `src` again in each of Megatron-LM's layouts (a `torch_dist`
/// run, and legacy ranks at tensor parallel 2, pipeline parallel 2 where its `layers` halve,
/// expert parallel `ep`) and checks that each merges to `want` (megatron's one-rank state dict)
/// at the source's iteration: a legacy source stacked into `torch_dist`'s global keys, a
/// `torch_dist` one cut into ranks.
pub fn through_megatron_layouts(src: &Path, want: &Tensors, layers: u64, ep: u64) {
    use ckpt::TargetFormat;
    let ck = Checkpoint::open(src.to_str().unwrap()).unwrap();
    let iteration = ck.megatron().unwrap().iteration.unwrap_or(0);
    let pp = if layers.is_multiple_of(2) { 2 } else { 1 };
    let layouts = [
        ConvertOptions { to: Some(TargetFormat::Megatron), ..Default::default() },
        ConvertOptions {
            to: Some(TargetFormat::MegatronLegacy),
            tensor_parallel: Some(2),
            pipeline_parallel: Some(pp),
            expert_parallel: Some(ep),
            ..Default::default()
        },
    ];
    for options in layouts {
        let what = format!("{} {:?}", src.display(), options.to);
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        ckpt::convert(&ck, &run, &options, &WriteOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
        let tracker = std::fs::read_to_string(run.join("latest_checkpointed_iteration.txt")).unwrap();
        assert_eq!(tracker, iteration.to_string(), "{what}");
        let out = tmp.path().join("model.safetensors");
        let back = Checkpoint::open(run.to_str().unwrap()).unwrap();
        ckpt::merge(&back, &out, &Default::default(), &WriteOptions::default()).unwrap();
        assert!(load(&out).0 == *want, "{what}: the tensors");
    }
}
