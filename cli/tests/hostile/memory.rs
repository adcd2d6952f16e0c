//! The files of `fixtures/hostile/pickle_budget/` (a few kilobytes each, gigabytes if read
//! naively) through the real binary under an address-space limit (`prlimit --as`): each is
//! refused with its one-line error and exit code 2, instead of aborting on a failed allocation
//! or swapping, and its peak RSS (`VmHWM`, polled while it runs) stays within the unpickler's
//! budget that the message states, plus what the binary holds reading a real file. The limit
//! is 512 MiB, or the budget and room for the binary where the budget is larger (the 1 GiB cap).
//! The exact messages are pinned in `ckpt/tests/hostile/pickle_budget.rs`.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

const LIMIT: u64 = 512 << 20;
/// What the binary holds besides the pickle's budget: itself, the allocator, a real file.
const BASE: u64 = 48 << 20;
/// Address space the binary takes besides what it holds (its mappings, thread stacks, arenas).
const ROOM: u64 = 384 << 20;

/// Runs the binary under `limit` bytes of address space: its output and its peak RSS in bytes.
fn limited(args: &[&str], limit: u64) -> (Output, u64) {
    let mut child = Command::new("prlimit")
        .arg(format!("--as={limit}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("`prlimit` (util-linux) runs the binary under a memory limit");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            r.read_to_end(&mut v).unwrap();
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    // `prlimit` execs the binary: the same process, whose high-water mark only grows.
    let status = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    let code = loop {
        if let Ok(text) = std::fs::read_to_string(&status) {
            let kb = text.lines().find_map(|l| l.strip_prefix("VmHWM:")).map(|v| v.trim().trim_end_matches(" kB"));
            if let Some(kb) = kb.and_then(|kb| kb.trim().parse::<u64>().ok()) {
                peak = peak.max(kb << 10);
            }
        }
        if let Some(code) = child.try_wait().unwrap() {
            break code;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let output = Output { status: code, stdout: out.join().unwrap(), stderr: err.join().unwrap() };
    (output, peak)
}

/// The budget a refusal names (`… need more than N bytes`), or the floor of 16 MiB.
fn budget_of(reason: &str) -> u64 {
    reason
        .split_once("need more than ")
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(16 << 20)
}

/// Runs `inspect --json` and `convert` on the case under the limit; both must fail cleanly with
/// `reason` in their one error line, within the budget it names.
fn refused_within_limit(case: &str, reason: &str) {
    let src = fixtures().join("hostile/pickle_budget").join(case);
    let src = src.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let budget = budget_of(reason);
    let limit = LIMIT.max(budget + ROOM);
    for args in [vec!["inspect", "--json", src], vec!["convert", src, out.to_str().unwrap()]] {
        let (o, peak) = limited(&args, limit);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{case} {}: {err}", args[0]);
        assert!(stdout(&o).is_empty(), "{case} {}: no data on stdout", args[0]);
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{case} {}: one error line: {err}", args[0]);
        assert!(lines[0].starts_with("error: ") && lines[0].ends_with(reason), "{case} {}: {err}", args[0]);
        assert!(peak <= budget + BASE, "{case} {}: peak RSS {peak} bytes, over the {budget}-byte budget", args[0]);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{case}: no output left behind");
}

#[test]
fn memo_reuse_of_one_big_bytes_object() {
    refused_within_limit("memo_bytes_reuse.pt", "need more than 115903872 bytes");
}

#[test]
fn billion_laughs_through_nested_dicts() {
    refused_within_limit("dict_laughs.pt", "need more than 17021248 bytes");
}

#[test]
fn declared_lengths_beyond_the_pickle() {
    refused_within_limit("declared_unicode.pt", "declared length 4294967280 runs past the end of the pickle");
    refused_within_limit("declared_bytes8.pt", "declared length 4611686018427387904 runs past the end of the pickle");
}

#[test]
fn arena_flood_of_empty_lists() {
    refused_within_limit("arena_flood.pt", "need more than 272793792 bytes");
}

#[test]
fn dcp_metadata_path_shared_by_every_key() {
    refused_within_limit("dcp_shared_path", "need more than 19286592 bytes");
}

#[test]
fn a_real_checkpoint_reads_within_the_same_limit() {
    let src = fixtures().join("torch/basic.pt");
    let (o, peak) = limited(&["inspect", "--json", src.to_str().unwrap()], LIMIT);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(peak < BASE, "peak RSS {peak} bytes");
}

#[test]
fn dcp_bytes_items_that_all_name_one_item() {
    refused_within_limit("dcp_shared_item", "need more than 18313984 bytes");
}

#[test]
fn torch_shards_each_within_budget_but_not_together() {
    refused_within_limit("sharded_values", "need more than 18331904 bytes");
}

#[test]
fn memo_bomb_of_one_string_in_a_list() {
    // Accepted at 1.1 GB (convert) and 2.1 GB (inspect --json) before.
    refused_within_limit("memo_bomb.pt", "need more than 1040796544 bytes");
}

#[test]
fn arena_bomb_of_the_longest_pickle() {
    // Refused at 1.3 GB before, past its own budget.
    refused_within_limit("arena_bomb.pt", "need more than 1073741824 bytes");
}

#[test]
fn short_strings_charged_as_allocated() {
    // Refused at 1.5 GB before.
    refused_within_limit("short_strings.pt", "need more than 1073741824 bytes");
}

#[test]
fn tensor_names_on_one_memoized_tensor() {
    // Accepted at 1.7 GB (inspect --json) before.
    refused_within_limit("tensor_names.pt", "need more than 169691200 bytes");
}
