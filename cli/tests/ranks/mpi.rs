//! One operation over the ranks of an MPI job (`mpirun -np N ckpt …`, the `mpi` feature): the
//! output is byte for byte what one process writes, at any N (also more ranks than output
//! files), every rank's share is reported, and a rank killed at any moment leaves the previous
//! output as it was, never a commit.
//!
//! Every case writes its one-process output and its N-rank outputs to the same path in turn (a
//! DCP `.metadata` records its folder's absolute path), so they compare whole; only the fresh
//! `save_id` torch gives every DCP save, and a staging folder's random name, are masked.
#![cfg(feature = "mpi")]
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

/// `ckpt args` as `n` ranks under `mpirun`.
fn mpirun(n: usize, args: &[&str]) -> Output {
    let mut cmd = Command::new("mpirun");
    // Root in containers; more ranks than cores on a 2-core runner.
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string(), env!("CARGO_BIN_EXE_ckpt")]);
    cmd.args(args).env("OMPI_MCA_rmaps_base_oversubscribe", "1").output().unwrap()
}

/// Every file under `root` (hidden ones too), by relative path, with its bytes.
fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, root, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().to_path_buf(), mask_save_id(std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    if root.is_file() {
        out.insert(PathBuf::new(), std::fs::read(root).unwrap());
    } else {
        walk(root, root, &mut out);
    }
    out
}

/// A DCP `.metadata`'s `save_id` (a random UUID per save, as torch writes it) zeroed, and the
/// random part of a staging folder's name where it records the folder it was written in (the
/// DCP folders of a whole `save_state` reshard).
fn mask_save_id(mut bytes: Vec<u8>) -> Vec<u8> {
    let mut at = 0;
    while let Some(i) = bytes[at..].windows(4).position(|w| w == b".tmp").map(|i| i + at) {
        if i >= 17 && bytes[i - 17] == b'.' && bytes[i - 16..i].iter().all(u8::is_ascii_hexdigit) {
            bytes[i - 16..i].fill(b'0');
        }
        at = i + 4;
    }
    let key = b"save_id";
    let Some(at) = bytes.windows(key.len()).position(|w| w == key) else { return bytes };
    let shape = |w: &[u8]| {
        w.iter().enumerate().all(|(i, &b)| if [8, 13, 18, 23].contains(&i) { b == b'-' } else { b.is_ascii_hexdigit() })
    };
    if let Some(u) = (at..bytes.len().saturating_sub(36)).find(|&i| shape(&bytes[i..i + 36])) {
        bytes[u..u + 36].fill(b'0');
    }
    bytes
}

fn remove(path: &Path) {
    if path.is_dir() {
        std::fs::remove_dir_all(path).unwrap();
    } else if path.exists() {
        std::fs::remove_file(path).unwrap();
    }
}

/// A 24 MiB source of 48 tensors, shared by the cases.
fn source(dir: &Path) -> PathBuf {
    let path = dir.join("model.safetensors");
    write_checkpoint(&path, 48, 128 << 10, 7);
    path
}

/// Runs `args` (with `{out}` standing for the output) in one process and on 2, 3 and 4 ranks,
/// and requires the same bytes from each; returns the ranks' `--json` shares of the last run.
fn same_at_every_n(name: &str, out: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    let with = |extra: &[&str]| -> Vec<String> {
        args.iter()
            .map(|a| a.replace("{out}", out.to_str().unwrap()))
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    remove(out);
    let one = ckpt().args(with(&[])).output().unwrap();
    assert!(one.status.success(), "{name}: one process: {}", stderr(&one));
    let want = tree(out);
    assert!(!want.is_empty());
    let mut shares = Vec::new();
    for n in [2, 3, 4] {
        remove(out);
        let args = with(&["--json"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = mpirun(n, &args);
        assert!(o.status.success(), "{name}: {n} ranks: {}", stderr(&o));
        let got = tree(out);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}: {n} ranks: the same files"
        );
        for (file, bytes) in &want {
            assert!(got[file] == *bytes, "{name}: {n} ranks: {} differs from one process's", file.display());
        }
        // One document, from rank 0, with every rank's share.
        let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let ranks = doc["ranks"].as_array().unwrap().clone();
        assert_eq!(ranks.len(), n, "{name}: a share per rank");
        assert_eq!(doc["schema"], "statekit.outcome/2");
        shares = ranks;
    }
    shares
}

#[test]
fn every_operation_writes_the_one_process_bytes_at_any_number_of_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let src = src.to_str().unwrap();
    let shards = tmp.path().join("shards");
    let s = ckpt().args(["split", src, shards.to_str().unwrap(), "--max-shard-size", "5MB"]).output().unwrap();
    assert!(s.status.success(), "{}", stderr(&s));
    let shards = shards.to_str().unwrap();
    let f = |p: &str| fixtures().join(p).to_str().unwrap().to_owned();
    let out = tmp.path().join("out");
    let out_file = tmp.path().join("out.safetensors");
    let cases: Vec<(&str, &Path, Vec<String>)> = vec![
        (
            "split into shards",
            &out,
            vec!["split".into(), src.into(), "{out}".into(), "--max-shard-size".into(), "3MB".into()],
        ),
        (
            "split with a manifest",
            &out,
            vec![
                "split".into(),
                src.into(),
                "{out}".into(),
                "--max-shard-size".into(),
                "7MB".into(),
                "--checksums".into(),
            ],
        ),
        ("merge into one file", &out_file, vec!["merge".into(), shards.into(), "{out}".into()]),
        (
            "convert to one torch file",
            &out,
            vec!["convert".into(), shards.into(), "{out}".into(), "--to".into(), "torch".into()],
        ),
        (
            "convert with a cast",
            &out_file,
            vec!["convert".into(), src.into(), "{out}".into(), "--dtype".into(), "bf16".into()],
        ),
        (
            "quantize to FP8 blocks",
            &out_file,
            vec!["convert".into(), src.into(), "{out}".into(), "--quantize".into(), "fp8-e4m3".into()],
        ),
        (
            "convert to DCP",
            &out,
            vec![
                "convert".into(),
                src.into(),
                "{out}".into(),
                "--to".into(),
                "dcp".into(),
                "--world-size".into(),
                "5".into(),
            ],
        ),
        (
            "reshard DCP",
            &out,
            vec![
                "reshard".into(),
                f("dcp/fsdp2_w3_bf16/checkpoint"),
                "{out}".into(),
                "--world-size".into(),
                "4".into(),
            ],
        ),
        ("merge DCP", &out_file, vec!["merge".into(), f("dcp/fsdp2_w3_bf16/checkpoint"), "{out}".into()]),
        ("merge ZeRO-2", &out_file, vec!["merge".into(), f("deepspeed/z2_bf16_ws3"), "{out}".into()]),
        ("merge ZeRO-3", &out_file, vec!["merge".into(), f("deepspeed/z3_bf16_ws2_sg30"), "{out}".into()]),
        (
            "reshard ZeRO to universal",
            &out,
            vec!["reshard".into(), f("deepspeed/z2_bf16_ws3"), "{out}".into(), "--world-size".into(), "2".into()],
        ),
        (
            "reshard an accelerate FSDP2 folder",
            &out,
            vec!["reshard".into(), f("accelerate/fsdp2_w2"), "{out}".into(), "--world-size".into(), "3".into()],
        ),
        (
            "reshard an accelerate DeepSpeed folder",
            &out,
            vec!["reshard".into(), f("accelerate/ds_z2_w2"), "{out}".into(), "--world-size".into(), "3".into()],
        ),
        ("merge Megatron torch_dist", &out_file, vec!["merge".into(), f("megatron/tp2pp2/ckpt"), "{out}".into()]),
        ("merge Megatron legacy", &out_file, vec!["merge".into(), f("megatron/legacy_tp2pp2"), "{out}".into()]),
        (
            "convert a Megatron MoE save to a Hugging Face folder",
            &out,
            vec![
                "convert".into(),
                f("megatron_moe/mixtral_ep2"),
                "{out}".into(),
                "--to".into(),
                "hf".into(),
                "--max-shard-size".into(),
                "15KB".into(),
            ],
        ),
        (
            "convert a Megatron-LM run to a Megatron run",
            &out,
            vec!["convert".into(), f("megatron/run_tp2"), "{out}".into(), "--to".into(), "megatron".into()],
        ),
        (
            "convert a Hugging Face MoE folder to a Megatron run",
            &out,
            vec!["convert".into(), f("megatron_arch/hf/qwen2_moe"), "{out}".into(), "--to".into(), "megatron".into()],
        ),
        (
            "convert a Megatron MoE run to legacy ranks",
            &out,
            ["convert", &f("megatron_moe/mixtral_ep2"), "{out}", "--to", "megatron-legacy"]
                .into_iter()
                .chain(["--tensor-parallel", "2", "--pipeline-parallel", "2", "--expert-parallel", "2"])
                .map(String::from)
                .collect(),
        ),
    ];
    for (name, out, args) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let shares = same_at_every_n(name, out, &args);
        let written: u64 = shares.iter().map(|r| r["bytes_written"].as_u64().unwrap()).sum();
        assert!(written > 0, "{name}: the shares account for the bytes written");
    }
}

#[test]
fn a_large_merge_is_shared_evenly() {
    // One output file: every rank writes a byte range of it, within 1.3x of the mean.
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = tmp.path().join("merged.safetensors");
    let o = mpirun(3, &["merge", src.to_str().unwrap(), out.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let written: Vec<u64> =
        doc["ranks"].as_array().unwrap().iter().map(|r| r["bytes_written"].as_u64().unwrap()).collect();
    let mean = written.iter().sum::<u64>() as f64 / written.len() as f64;
    assert!(written.iter().all(|&w| w as f64 <= 1.3 * mean && w > 0), "{written:?}");
    assert_eq!(written.iter().sum::<u64>(), std::fs::metadata(&out).unwrap().len(), "every byte of the file once");
}

#[test]
fn a_dry_run_prints_the_shares_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let out = tmp.path().join("shards");
    let o = mpirun(4, &["split", src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "2MB", "--dry-run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert_eq!(text.lines().filter(|l| l.starts_with("rank ")).count(), 4, "{text}");
    assert!(!out.exists(), "a dry run writes nothing");
    let dcp = tmp.path().join("dcp");
    let o = mpirun(
        2,
        &[
            "convert",
            src.to_str().unwrap(),
            dcp.to_str().unwrap(),
            "--to",
            "dcp",
            "--world-size",
            "4",
            "--dry-run",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["dry_run"], true);
    assert_eq!(doc["ranks"].as_array().unwrap().len(), 2);
    assert!(!dcp.exists(), "not even the folder");
    let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "no temporaries either: {names:?}");
}

#[test]
fn an_error_is_reported_once_by_the_rank_that_saw_it() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    // Every rank refuses it alike (an unknown size): rank 0 alone says so.
    let o = mpirun(
        3,
        &["split", src.to_str().unwrap(), tmp.path().join("o").to_str().unwrap(), "--max-shard-size", "lots"],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert_eq!(err.matches("error:").count(), 1, "{err}");
    assert!(err.contains("rank 0: error:"), "{err}");
    // A source only some ranks can read: the first of them says so, with its rank.
    let o = mpirun(
        2,
        &["merge", tmp.path().join("missing").to_str().unwrap(), tmp.path().join("m.safetensors").to_str().unwrap()],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert_eq!(err.matches("error:").count(), 1, "{err}");
    assert!(!tmp.path().join("m.safetensors").exists());
}

/// Waits for a killed job's `mpirun`. Open MPI 4.1 has been seen (once, on an overloaded machine)
/// to stay blocked on an internal lock after every rank had exited; after two minutes it and any
/// rank left are killed, which is one more kill at a random moment for the assertions after.
fn wait_or_reap(child: &mut std::process::Child, marker: &str) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while std::time::Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in ranks_of(marker) {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    let _ = child.kill();
    child.wait().unwrap()
}

#[test]
fn a_rank_killed_at_any_moment_leaves_the_previous_output_or_the_whole_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("big.safetensors");
    write_checkpoint(&src, 64, 1 << 19, 11); // 128 MiB: the split takes a while
    let src = src.to_str().unwrap();
    let out = tmp.path().join("kill-target");
    let o = out.to_str().unwrap();
    // The new output, for reference, and the previous one, which each round starts from.
    let o1 = ckpt().args(["split", src, o, "--max-shard-size", "20MB"]).output().unwrap();
    assert!(o1.status.success());
    let new = tree(&out);
    remove(&out);
    assert!(ckpt().args(["split", src, o, "--max-shard-size", "50MB"]).output().unwrap().status.success());
    let old = tree(&out);
    let mut killed = 0;
    for round in 0..6u64 {
        let mut child = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "3", env!("CARGO_BIN_EXE_ckpt")])
            .args(["split", src, o, "--max-shard-size", "20MB"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the ranks, then kill one of them a little later each round.
        let mut pids = Vec::new();
        for _ in 0..200 {
            pids = ranks_of(o);
            if pids.len() == 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(60 * round));
        if let Some(&pid) = pids.get(round as usize % 3) {
            if Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success() {
                killed += 1;
            }
        }
        let status = wait_or_reap(&mut child, o);
        let now: BTreeMap<PathBuf, Vec<u8>> =
            tree(&out).into_iter().filter(|(p, _)| !p.to_string_lossy().contains(".tmp")).collect();
        if status.success() {
            assert!(now == new, "round {round}: a finished run left the new output whole");
        } else {
            assert!(
                now == old || now == new,
                "round {round}: the previous output intact, or the new one whole: {:?}",
                now.keys().collect::<Vec<_>>()
            );
        }
        if round == 5 {
            break; // what the last round left is for the next run to clear
        }
        // Start the next round from the previous output again.
        remove(&out);
        assert!(ckpt().args(["split", src, o, "--max-shard-size", "50MB"]).output().unwrap().status.success());
    }
    assert!(killed >= 3, "most rounds killed a rank mid-run ({killed})");
    // A killed job's temporaries are gone after the next run into the same place.
    let o2 = mpirun(2, &["split", src, o, "--max-shard-size", "20MB"]);
    assert!(o2.status.success(), "{}", stderr(&o2));
    let left: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(tree(&out) == new);
}
