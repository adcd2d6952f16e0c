//! Writing a checkpoint over a previous one in the same folder: the previous one stays whole
//! until the new index replaces its index, so an operation that stops part-way (here: a folder
//! in the way of one of the new shards, whose rename fails after the first shard is in place)
//! leaves the previous checkpoint readable. Its files that nothing replaced go once the new index is in.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/safetensors/model_single/model.safetensors")
}

fn open(p: &Path) -> ckpt::Checkpoint {
    ckpt::Checkpoint::open(p.to_str().unwrap()).unwrap()
}

/// Every tensor of `ck` by name, with its bytes.
fn contents(ck: &ckpt::Checkpoint) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = ck.tensors().iter().map(|t| (t.name.clone(), ck.read_tensor(t).unwrap())).collect();
    out.sort();
    out
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}

#[test]
fn a_resplit_that_stops_part_way_leaves_the_previous_shards_readable() {
    let src = open(&fixture());
    let want = contents(&src);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let w = ckpt::WriteOptions::default();
    // The previous checkpoint: shards of at most 4 KB.
    ckpt::split(&src, &out, 4000, &w).unwrap();
    let before = names(&out);
    assert!(before.len() > 3, "{before:?}");

    // The new one, in 8 KB shards, whose names differ from the old ones (`-of-N`); a folder
    // holds its second shard's name, so it stops after placing the first.
    let fewer = tempfile::tempdir().unwrap();
    ckpt::split(&src, fewer.path(), 8000, &w).unwrap();
    let new_names: Vec<String> = names(fewer.path()).into_iter().filter(|n| n.ends_with(".safetensors")).collect();
    assert!(new_names.iter().all(|n| !before.contains(n)), "{new_names:?} vs {before:?}");
    let blocker = out.join(&new_names[1]);
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("keep"), b"x").unwrap();
    let err = ckpt::split(&src, &out, 8000, &w).unwrap_err();
    assert!(err.to_string().starts_with(&blocker.display().to_string()), "{err}");

    // The previous checkpoint is whole: its index and every shard it names.
    let index = out.join("model.safetensors.index.json");
    assert_eq!(contents(&open(&index)), want);

    // Once the folder is gone the new checkpoint replaces it, and the old shards are removed.
    std::fs::remove_dir_all(&blocker).unwrap();
    ckpt::split(&src, &out, 8000, &w).unwrap();
    assert_eq!(names(&out), names(fewer.path()));
    assert_eq!(contents(&open(&index)), want);
}
