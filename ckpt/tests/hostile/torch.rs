//! Hostile torch files (`fixtures/hostile/torch/`, written by `fixtures/gen/hostile_torch.py`):
//! one per attack. Each payload, if anything executed it, would create `statekit-pwned` in the
//! working directory. Every test pins our exact refusal, through both the catalog reader and
//! `convert`, checks that no output appeared, and that the marker file does not exist.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MARKER: &str = "statekit-pwned";

fn hostile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/torch").join(name)
}

fn refused(name: &str, reason: &str) {
    let path = hostile(name);
    let src = path.to_str().unwrap();
    let expected = format!("{src}: {reason}");
    let start = Instant::now();
    let err = ckpt::Checkpoint::open(src).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data(), "{name}: verify should report it as a problem");

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let err = ckpt::Checkpoint::open(src)
        .and_then(|ck| ckpt::convert(&ck, &out, &ckpt::ConvertOptions::default(), &ckpt::WriteOptions::default()))
        .unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{name}: no output left behind");
    assert!(start.elapsed() < Duration::from_secs(20), "{name}: refusal took {:?}", start.elapsed());

    for d in [Path::new("."), path.parent().unwrap(), dir.path()] {
        assert!(!d.join(MARKER).exists(), "{name}: the payload ran");
    }
}

#[test]
fn os_system_global_and_reduce() {
    refused(
        "os_system.pt",
        "refusing global `posix.system`: only the tensor-rebuilding globals of torch's weights-only loader are allowed; \
         `allow_globals` reads it as inert data, nothing imported or called",
    );
}

#[test]
fn builtins_eval() {
    // Protocol 2 names the builtins module by its Python 2 name.
    refused(
        "builtins_eval.pt",
        "refusing global `__builtin__.eval`: only the tensor-rebuilding globals of torch's weights-only loader are allowed; \
         `allow_globals` reads it as inert data, nothing imported or called",
    );
}

#[test]
fn build_on_an_arbitrary_class() {
    refused(
        "build_arbitrary_class.pt",
        "refusing global `__main__.Payload`: only the tensor-rebuilding globals of torch's weights-only loader are allowed; \
         `allow_globals` reads it as inert data, nothing imported or called",
    );
}

#[test]
fn deep_nesting() {
    refused("deep_nesting.pt", "`archive/data.pkl` at byte 259: nesting deeper than 256 levels");
}

#[test]
fn memo_abuse_billion_laughs() {
    // Every copy the expansion would build is charged: the budget runs out first.
    refused(
        "memo_abuse.pt",
        "memory budget exceeded: the objects and values of 804 bytes of pickle need more than 16845056 bytes",
    );
}

#[test]
fn declared_size_beyond_the_file() {
    refused(
        "size_beyond_file.pt",
        "record `archive/data/0` declares 4294967280 bytes at byte 704, past the end of the 1577-byte file",
    );
}

#[test]
fn zip_bomb() {
    refused("zip_bomb.pt", "record `archive/data.pkl` inflates past its declared 563 bytes (a zip bomb?)");
}

#[test]
fn verify_reports_each_as_a_problem() {
    for entry in std::fs::read_dir(hostile("")).unwrap() {
        let path = entry.unwrap().path();
        let report = ckpt::verify(path.to_str().unwrap()).unwrap();
        assert_eq!(report.problems.len(), 1, "{}", path.display());
        assert!(!report.is_valid());
    }
}
