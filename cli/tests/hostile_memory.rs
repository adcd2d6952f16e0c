//! The files of `fixtures/hostile/pickle_budget/` (a few kilobytes each, gigabytes if read
//! naively) through the real binary under a 512 MiB address-space limit (`prlimit --as`): each
//! is refused with its one-line error and exit code 2, instead of aborting on a failed
//! allocation or swapping. The exact messages are pinned in `ckpt/tests/hostile_pickle_budget.rs`.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Output};

use common::*;

const LIMIT: u64 = 512 << 20;

fn limited(args: &[&str]) -> Output {
    Command::new("prlimit")
        .arg(format!("--as={LIMIT}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .output()
        .expect("`prlimit` (util-linux) runs the binary under a memory limit")
}

/// Runs `inspect --json` and `convert` on the case under the limit; both must fail cleanly with
/// `reason` in their one error line.
fn refused_within_limit(case: &str, reason: &str) {
    let src = fixtures().join("hostile/pickle_budget").join(case);
    let src = src.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    for args in [vec!["inspect", "--json", src], vec!["convert", src, out.to_str().unwrap()]] {
        let o = limited(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{case} {}: {err}", args[0]);
        assert!(stdout(&o).is_empty(), "{case} {}: no data on stdout", args[0]);
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{case} {}: one error line: {err}", args[0]);
        assert!(lines[0].starts_with("error: ") && lines[0].ends_with(reason), "{case} {}: {err}", args[0]);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{case}: no output left behind");
}

#[test]
fn memo_reuse_of_one_big_bytes_object() {
    refused_within_limit("memo_bytes_reuse.pt", "need more than 115887488 bytes");
}

#[test]
fn billion_laughs_through_nested_dicts() {
    refused_within_limit("dict_laughs.pt", "need more than 17004864 bytes");
}

#[test]
fn declared_lengths_beyond_the_pickle() {
    refused_within_limit("declared_unicode.pt", "declared length 4294967280 runs past the end of the pickle");
    refused_within_limit("declared_bytes8.pt", "declared length 4611686018427387904 runs past the end of the pickle");
}

#[test]
fn arena_flood_of_empty_lists() {
    refused_within_limit("arena_flood.pt", "need more than 272777408 bytes");
}

#[test]
fn dcp_metadata_path_shared_by_every_key() {
    refused_within_limit("dcp_shared_path", "need more than 19270208 bytes");
}

#[test]
fn a_real_checkpoint_reads_within_the_same_limit() {
    let src = fixtures().join("torch/basic.pt");
    let o = limited(&["inspect", "--json", src.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn dcp_bytes_items_that_all_name_one_item() {
    refused_within_limit("dcp_shared_item", "need more than 18729216 bytes");
}

#[test]
fn torch_shards_each_within_budget_but_not_together() {
    refused_within_limit("sharded_values", "need more than 18747136 bytes");
}
