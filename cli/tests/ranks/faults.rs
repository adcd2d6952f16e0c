//! One rank of an MPI job failing alone, at every phase of the multi-rank protocol: the fault
//! switch of test builds (`STATEKIT_FAULT=RANK:PHASE`, `ckpt/src/write/fault.rs`) makes rank K fail at
//! phase P, and for every (K, P) at 2 and 3 ranks, for a merge into a file and a split into a
//! folder that each hold an older checkpoint, the job ends within a bounded time with a failure,
//! the older checkpoint is as it was, no temporary or staging folder is left, and the error is
//! printed once, by the rank that failed, with its rank.
//!
//! `plan` is a rank that fails after planning, before the others hear from it: before the
//! operation said how it left ([`ckpt::Job`]'s exchanges), the others waited for it forever.
#![cfg(all(feature = "mpi", debug_assertions))]
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;

/// Where a rank can be made to fail, in the order a write goes through them. Only rank 0
/// commits: `commit` applies to it alone.
const PHASES: [&str; 8] = ["open", "plan", "stage", "create", "copy", "fsync", "seal", "commit"];

/// A job that has not ended by then is taken to hang (each ends in about a second).
const LIMIT: Duration = Duration::from_secs(60);

/// Every file under `root` (or `root` itself), by relative path, with its bytes.
fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    if root.is_file() {
        out.insert(PathBuf::new(), std::fs::read(root).unwrap());
        return out;
    }
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        out.insert(p.strip_prefix(root).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
    }
    out
}

/// Every name under `dir`, at any depth, that is one of our temporaries (`.NAME.TOKEN.tmp`, a
/// file or a staging folder).
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap().to_string_lossy().ends_with(".tmp") {
            out.push(p.clone());
        }
        if p.is_dir() {
            out.extend(temporaries(&p));
        }
    }
    out
}

/// `ckpt args` on `n` ranks with rank `k` failing at `phase`: its exit status and its combined
/// output, or `None` when it had not ended within [`LIMIT`] (it and its ranks are killed then).
/// `marker` is a path only this job's command line names.
fn with_fault(n: usize, k: usize, phase: &str, args: &[&str], marker: &str) -> Option<(bool, String)> {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string(), "-x", "STATEKIT_FAULT"])
        .arg(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .env("STATEKIT_FAULT", format!("{k}:{phase}"))
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            for pid in ranks_of(marker) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&out).unwrap() + &std::fs::read_to_string(&err).unwrap();
    status.map(|s| (s.success(), text))
}

/// One (operation, N, K, P) of the matrix: what went wrong, if anything.
fn case(op: &str, n: usize, k: usize, phase: &str, src: &Path) -> Option<String> {
    let tmp = tempfile::tempdir().unwrap();
    let src = src.to_str().unwrap();
    let dst = tmp.path().join(if op == "merge" { "merged.safetensors" } else { "shards" });
    let d = dst.to_str().unwrap();
    // The older checkpoint the destination holds, and the operation that would replace it.
    let (older, args): (Vec<&str>, Vec<&str>) = match op {
        "merge" => (vec!["convert", src, d, "--dtype", "bf16"], vec!["merge", src, d]),
        _ => (vec!["split", src, d, "--max-shard-size", "1MB"], vec!["split", src, d, "--max-shard-size", "600KB"]),
    };
    let o = ckpt().args(&older).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let before = tree(&dst);
    let name = format!("{op} on {n} ranks, rank {k} failing at {phase}");
    let Some((ok, text)) = with_fault(n, k, phase, &args, d) else {
        return Some(format!("{name}: still running after {LIMIT:?}"));
    };
    let fault = format!("injected fault at {phase}");
    let problem = if ok {
        "the job succeeded".to_string()
    } else if tree(&dst) != before {
        "the older checkpoint changed".to_string()
    } else if !temporaries(tmp.path()).is_empty() {
        format!("temporaries left: {:?}", temporaries(tmp.path()))
    } else if text.matches("error:").count() != 1 || text.matches(&fault).count() != 1 {
        "not one error".to_string()
    } else if !text.lines().any(|l| l.starts_with(&format!("rank {k}: error: ")) && l.contains(&fault)) {
        format!("the error does not name rank {k}")
    } else {
        return None;
    };
    Some(format!("{name}: {problem}:\n{text}"))
}

#[test]
fn a_rank_failing_alone_at_any_phase_ends_the_job_and_commits_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("model.safetensors");
    // 2 MiB in 8 tensors: a merge gives every rank a range of the one file, a split at 600 KB
    // four shards, so that each of 3 ranks owns one and copies into it.
    write_checkpoint(&src, 8, 64 << 10, 5);
    let mut cases = Vec::new();
    for op in ["merge", "split"] {
        for n in [2, 3] {
            for k in 0..n {
                for phase in PHASES.iter().filter(|p| **p != "commit" || k == 0) {
                    cases.push((op, n, k, *phase));
                }
            }
        }
    }
    // A few jobs at a time: each is mostly `mpirun` starting its ranks.
    let next = AtomicUsize::new(0);
    let problems = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                while let Some(&(op, n, k, phase)) = cases.get(next.fetch_add(1, Ordering::SeqCst)) {
                    if let Some(p) = case(op, n, k, phase, &src) {
                        problems.lock().unwrap().push(p);
                    }
                }
            });
        }
    });
    let problems = problems.into_inner().unwrap();
    assert!(problems.is_empty(), "{} of {} cases:\n{}", problems.len(), cases.len(), problems.join("\n"));
}
