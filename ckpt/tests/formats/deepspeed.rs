//! The DeepSpeed fixture table: every case in `fixtures/deepspeed/` is a real DeepSpeed 0.19.8
//! checkpoint (`fixtures/gen/deepspeed_fixtures.py`) with what DeepSpeed's own tools made of it
//! in `expected/`: `model.safetensors` (zero_to_fp32 `--safe_serialization`, or for tied models
//! its `.bin` with the alias as a copy), `optimizer.safetensors` (the merged Adam moments) and,
//! for the untied cases, `sharded/` (`--max_shard_size 2KB`). Every case must merge to exactly
//! those bytes, file for file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, MergeOptions, OpenOptions, WriteOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/deepspeed")
}

fn same_file(got: &Path, want: &Path) {
    let (g, w) = (std::fs::read(got).unwrap(), std::fs::read(want).unwrap());
    assert!(g == w, "{} differs from {} ({} vs {} bytes)", got.display(), want.display(), g.len(), w.len());
}

fn case(name: &str) {
    let dir = root().join(name);
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("expected.json")).unwrap()).unwrap();
    let meta = &expected["cases"][name];
    let ck = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    assert_eq!(ck.zero_stage().map(u64::from), meta["stage"].as_u64());
    assert_eq!(ck.world_size(), meta["world_size"].as_u64());
    let tag = ck.files()[0].path.parent().and_then(|p| p.file_name()).unwrap();
    assert_eq!(tag, "global_step2");

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.safetensors");
    let done =
        ckpt::merge(&ck, &out, &MergeOptions { optimizer: true, ..Default::default() }, &WriteOptions::default())
            .unwrap();
    assert_eq!(done.files, vec![out.clone(), tmp.path().join("optimizer.safetensors")]);
    same_file(&out, &dir.join("expected/model.safetensors"));
    same_file(&tmp.path().join("optimizer.safetensors"), &dir.join("expected/optimizer.safetensors"));

    let sharded = dir.join("expected/sharded");
    if sharded.is_dir() {
        let out = tmp.path().join("sharded");
        let opts = MergeOptions { max_shard_size: Some(ckpt::parse_size("2KB").unwrap()), ..Default::default() };
        let done = ckpt::merge(&ck, &out, &opts, &WriteOptions::default()).unwrap();
        let mut want: Vec<String> = std::fs::read_dir(&sharded)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        want.sort();
        let mut got: Vec<String> =
            done.files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        got.sort();
        assert_eq!(got, want);
        for f in &want {
            same_file(&out.join(f), &sharded.join(f));
        }
    }
}

/// One test per case, and `COVERED`: the names of those tests, in the order listed.
macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                case(stringify!($name));
            }
        )*
        const COVERED: &[&str] = &[$(stringify!($name)),*];
    };
}

cases!(
    z1_bf16_ws2,
    z1_bf16_ws4,
    z1_fp32_ws2,
    z1_fp32_ws4,
    z2_bf16_ws2,
    z2_bf16_ws3,
    z2_bf16_ws4,
    z2_fp32_ws2,
    z2_fp32_ws2_untied,
    z2_fp32_ws4,
    z3_bf16_ws1,
    z3_bf16_ws2_sg30,
    z3_bf16_ws4,
    z3_fp32_ws2,
    z3_fp32_ws3,
    z3_fp32_ws4_sg50,
    z3_fp32_ws4_untied,
);

/// The folders of `fixtures/deepspeed/` that hold a checkpoint and the cases of `expected.json`
/// are exactly the cases tested above, so a fixture that the generator adds or drops cannot go
/// untested.
#[test]
fn every_fixture_case_has_a_test() {
    let mut covered = COVERED.to_vec();
    covered.sort_unstable();
    let mut dirs: Vec<String> = std::fs::read_dir(root())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("latest").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(dirs, covered, "checkpoint folders in fixtures/deepspeed/");

    let text = std::fs::read_to_string(root().join("expected.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut cases: Vec<&str> = json["cases"].as_object().unwrap().keys().map(String::as_str).collect();
    cases.sort_unstable();
    assert_eq!(cases, covered, "cases of fixtures/deepspeed/expected.json");
}

#[test]
fn tied_alias_is_a_copy_and_frozen_is_dropped_at_stage_1() {
    let ck = Checkpoint::open(root().join("z1_fp32_ws2").to_str().unwrap()).unwrap();
    let find = |ck: &Checkpoint, name: &str| ck.tensors().iter().find(|t| t.name == name).cloned();
    let (alias, target) = (find(&ck, "lm_head.weight").unwrap(), find(&ck, "embed.weight").unwrap());
    assert_eq!(alias.location(), target.location(), "the alias reads its target's bytes");
    assert!(find(&ck, "frozen").is_none());
    let ck = Checkpoint::open_with(
        root().join("z3_bf16_ws4").to_str().unwrap(),
        &OpenOptions { tag: Some("global_step2".into()), ..OpenOptions::default() },
    )
    .unwrap();
    assert_eq!(find(&ck, "frozen").unwrap().shape, vec![3, 7]);
}
