//! `kill -9` at any moment never leaves a checkpoint that `verify` accepts but that is not a
//! complete copy, and never touches the source.
//!
//! Each round starts `ckpt split` (or `merge`) over a folder that already holds a different,
//! valid checkpoint, kills it after a varying delay, and then requires one of exactly three
//! outcomes: the old checkpoint intact, the new one complete, or nothing `verify` accepts.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

/// The bytes a checkpoint folder or file merges to, or `None` when `verify` rejects it.
fn accepted_content(path: &Path, scratch: &Path) -> Option<Vec<u8>> {
    let v = run(&["verify", path.to_str().unwrap()]);
    if v.status.code() != Some(0) {
        return None;
    }
    let merged = scratch.join("check.safetensors");
    let _ = std::fs::remove_file(&merged);
    let m = run(&["merge", path.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(m.status.success(), "verify accepted {} but merge failed: {}", path.display(), stderr(&m));
    Some(std::fs::read(&merged).unwrap())
}

fn kill_after(args: &[&str], delay: Duration) -> bool {
    let mut child = ckpt().args(args).stdout(std::process::Stdio::null()).spawn().unwrap();
    std::thread::sleep(delay);
    let finished = child.try_wait().unwrap().is_some();
    let _ = child.kill(); // SIGKILL on Unix
    child.wait().unwrap();
    !finished
}

#[test]
fn killed_split_leaves_old_or_new_never_a_mix() {
    let dir = tempfile::tempdir().unwrap();
    let scratch = dir.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let new_src = dir.path().join("new.safetensors");
    let new_bytes = write_checkpoint(&new_src, 24, 400_000, 11); // ~38 MB
    let old_src = dir.path().join("old.safetensors");
    let old_bytes = write_checkpoint(&old_src, 6, 1000, 22);
    let out = dir.path().join("out");

    let mut interrupted = 0;
    for (round, ms) in [0u64, 1, 3, 6, 10, 15, 25, 40, 60, 90, 140, 200].into_iter().enumerate() {
        let _ = std::fs::remove_dir_all(&out);
        assert!(run(&["split", old_src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "5KB"])
            .status
            .success());
        let args = ["--quiet", "split", new_src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "4MB"];
        if kill_after(&args, Duration::from_millis(ms)) {
            interrupted += 1;
        }
        match accepted_content(&out, &scratch) {
            None => {}
            Some(content) => assert!(
                content == old_bytes || content == new_bytes,
                "round {round} ({ms} ms): verify accepts a checkpoint that is neither the old nor the new one"
            ),
        }
        assert_eq!(std::fs::read(&new_src).unwrap(), new_bytes, "source changed");
    }
    eprintln!("{interrupted} of 12 rounds were killed mid-run");
}

#[test]
fn killed_merge_leaves_no_accepted_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let scratch = dir.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let src = dir.path().join("src.safetensors");
    let bytes = write_checkpoint(&src, 24, 400_000, 5);
    let shards = dir.path().join("shards");
    assert!(run(&["split", src.to_str().unwrap(), shards.to_str().unwrap(), "--max-shard-size", "4MB"])
        .status
        .success());
    let out = dir.path().join("merged.safetensors");
    for ms in [0u64, 2, 5, 10, 20, 40, 80, 150] {
        let _ = std::fs::remove_file(&out);
        kill_after(&["--quiet", "merge", shards.to_str().unwrap(), out.to_str().unwrap()], Duration::from_millis(ms));
        if out.exists() {
            // The final name appears only by rename after fsync: it is complete.
            assert_eq!(accepted_content(&out, &scratch), Some(bytes.clone()), "{ms} ms");
        }
        assert!(ckpt::verify(shards.to_str().unwrap()).unwrap().is_valid(), "source shards changed");
    }
}
