//! `kill -9` at any moment never leaves a checkpoint that `verify` accepts but that is not a
//! complete copy, and never touches the source.
//!
//! Each round starts `ckpt split` (or `merge`) over a folder that already holds a different,
//! valid checkpoint, kills it after a varying delay, and then requires one of exactly three
//! outcomes: the old checkpoint intact, the new one complete, or nothing `verify` accepts.
//!
//! The kill moments are fractions of how long the same command takes when left alone on this
//! machine (the fastest undisturbed run so far; one more is timed before every round, so the
//! estimate follows the machine's load as it changes), so they fall inside the operation on a
//! fast laptop and on a loaded 2-core runner alike. The two tests take turns, so neither slows
//! the other down between timing and killing. A round counts as killed mid-operation only when
//! the process died of the SIGKILL (its exit status says so), not when it had already exited;
//! each test requires that most rounds, including some in the second half of the operation,
//! really were.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use common::*;

const SIGKILL: i32 = 9;

/// Kill moments, as fractions of an undisturbed run: from before `main` to the last writes,
/// then two that usually come after the end (the new checkpoint must then be complete).
const FRACTIONS: [f64; 14] = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.5, 3.0];

/// Starts `ckpt args`, sends SIGKILL after `delay`, and returns how the process ended.
fn kill_after(args: &[&str], delay: Duration) -> ExitStatus {
    let mut child = ckpt().args(args).stdout(std::process::Stdio::null()).spawn().unwrap();
    std::thread::sleep(delay);
    let _ = child.kill(); // SIGKILL on Unix; fails only if the child was already reaped
    child.wait().unwrap()
}

/// One test at a time: a merge running beside a split would skew the timings of both.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The fastest undisturbed run of a command seen so far.
struct Fastest {
    args: Vec<String>,
    best: Option<Duration>,
}

impl Fastest {
    fn new(args: &[&str]) -> Fastest {
        Fastest { args: args.iter().map(|a| a.to_string()).collect(), best: None }
    }

    /// Runs the command to completion once more and returns the fastest run so far.
    fn measure(&mut self) -> Duration {
        let start = Instant::now();
        let out = ckpt().args(&self.args).stdout(std::process::Stdio::null()).output().unwrap();
        let took = start.elapsed();
        assert!(out.status.success(), "{:?}: {}", self.args, stderr(&out));
        *self.best.insert(self.best.map_or(took, |b| b.min(took)))
    }
}

/// Requires that the kills really interrupted the operation: of the rounds killed before an
/// undisturbed run would have ended, at least two thirds died of SIGKILL, among them one in
/// the second half of the run. `killed[i]` is whether the round at `FRACTIONS[i]` did.
fn assert_killed_mid_operation(what: &str, full: Duration, killed: &[bool]) {
    let during: Vec<(f64, bool)> =
        FRACTIONS.into_iter().zip(killed.iter().copied()).filter(|(f, _)| *f < 1.0).collect();
    let count = during.iter().filter(|(_, k)| *k).count();
    let late = during.iter().any(|&(f, k)| k && f >= 0.5);
    eprintln!("{what}: {count} of {} kills landed while the process ran (undisturbed run: {full:?})", during.len());
    assert!(
        count * 3 >= during.len() * 2 && late,
        "{what}: only {count} of {} kills landed while the process ran (undisturbed run: {full:?}); \
         (fraction, killed) per round: {during:?}",
        during.len()
    );
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
    let put_old_checkpoint = || {
        let _ = std::fs::remove_dir_all(&out);
        assert!(run(&["split", old_src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "5KB"])
            .status
            .success());
    };
    let args = ["--quiet", "split", new_src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "4MB"];
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut fastest = Fastest::new(&args);

    let mut killed = Vec::new();
    let mut full = Duration::ZERO;
    for (round, fraction) in FRACTIONS.into_iter().enumerate() {
        put_old_checkpoint();
        full = fastest.measure();
        put_old_checkpoint();
        let delay = full.mul_f64(fraction);
        killed.push(kill_after(&args, delay).signal() == Some(SIGKILL));
        match accepted_content(&out, &scratch) {
            None => {}
            Some(content) => assert!(
                content == old_bytes || content == new_bytes,
                "round {round} ({delay:?}): verify accepts a checkpoint that is neither the old nor the new one"
            ),
        }
        assert_eq!(std::fs::read(&new_src).unwrap(), new_bytes, "source changed");
    }
    assert_killed_mid_operation("split", full, &killed);
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
    let remove_out = || {
        let _ = std::fs::remove_file(&out);
    };
    let args = ["--quiet", "merge", shards.to_str().unwrap(), out.to_str().unwrap()];
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut fastest = Fastest::new(&args);

    let mut killed = Vec::new();
    let mut full = Duration::ZERO;
    for fraction in FRACTIONS {
        remove_out();
        full = fastest.measure();
        remove_out();
        let delay = full.mul_f64(fraction);
        killed.push(kill_after(&args, delay).signal() == Some(SIGKILL));
        if out.exists() {
            // The final name appears only by rename after fsync: it is complete.
            assert_eq!(accepted_content(&out, &scratch), Some(bytes.clone()), "{delay:?}");
        }
        assert!(ckpt::verify(shards.to_str().unwrap()).unwrap().is_valid(), "source shards changed");
    }
    assert_killed_mid_operation("merge", full, &killed);
}

/// Every entry of `dir` (hidden ones too) with its bytes; a folder inside is an error.
fn folder_files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            assert!(p.is_file(), "{} is not a file", p.display());
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect()
}

/// Whether `name` is what a killed run leaves beside the folder `out`, for the next run to
/// sweep or take over: `.out.<16 hex>.tmp` (a staged folder, or the old folder a swap
/// replaced), or `.out.lock`.
fn is_leftover_of_out(name: &str) -> bool {
    // The destination's lock, which a killed run leaves and the next one takes over.
    if name == ".out.lock" {
        return true;
    }
    let Some(hex) = name.strip_prefix(".out.").and_then(|r| r.strip_suffix(".tmp")) else { return false };
    hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A resplit over a folder that holds only the previous checkpoint, killed at 50 random
/// moments: the folder is then exactly the old set or exactly the new one, file for file and
/// byte for byte, never a mix and never a temporary; what a kill leaves beside it is a
/// temporary folder of ours, which the next run removes.
#[test]
fn killed_resplit_leaves_the_old_folder_or_the_new_one_whole() {
    let dir = tempfile::tempdir().unwrap();
    let new_src = dir.path().join("new.safetensors");
    let new_bytes = write_checkpoint(&new_src, 16, 20_000, 11); // ~1.3 MB
    let old_src = dir.path().join("old.safetensors");
    write_checkpoint(&old_src, 6, 1000, 22);
    let out = dir.path().join("out");
    let split =
        |src: &Path, max: &str| run(&["split", src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", max]);
    assert!(split(&old_src, "5KB").status.success());
    let old_files = folder_files(&out);
    let put_old = || {
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir(&out).unwrap();
        for (name, bytes) in &old_files {
            std::fs::write(out.join(name), bytes).unwrap();
        }
    };
    let args = ["--quiet", "split", new_src.to_str().unwrap(), out.to_str().unwrap(), "--max-shard-size", "200KB"];
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut fastest = Fastest::new(&args);
    let mut full = Duration::ZERO;
    for _ in 0..3 {
        put_old();
        full = fastest.measure();
    }
    let new_files = folder_files(&out);
    assert!(new_files.keys().all(|n| !old_files.contains_key(n) || n.ends_with(".index.json")), "{new_files:?}");

    // Random moments from before `main` to a little after an undisturbed run would end; the
    // seed is printed so that a failure can be replayed.
    let mut seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    eprintln!("resplit kills: seed {seed}");
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let (mut killed, mut old_seen, mut new_seen, mut leftovers) = (0, 0, 0, 0);
    for round in 0..50 {
        if round % 10 == 5 {
            put_old();
            full = fastest.measure();
        }
        put_old();
        let delay = full.mul_f64(next() * 1.2);
        killed += usize::from(kill_after(&args, delay).signal() == Some(SIGKILL));
        let now = folder_files(&out);
        if now == old_files {
            old_seen += 1;
        } else if now == new_files {
            new_seen += 1;
        } else {
            let names: Vec<&String> = now.keys().collect();
            panic!("round {round} ({delay:?}): the folder is neither the old set nor the new one: {names:?}");
        }
        for e in std::fs::read_dir(dir.path()).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            let known = ["out", "new.safetensors", "old.safetensors"].contains(&name.as_str());
            assert!(known || is_leftover_of_out(&name), "round {round} ({delay:?}): `{name}` left beside the folder");
            leftovers += usize::from(!known);
        }
        assert_eq!(std::fs::read(&new_src).unwrap(), new_bytes, "source changed");
    }
    eprintln!(
        "resplit: {killed} of 50 kills landed while the process ran (undisturbed run: {full:?}); \
         old set {old_seen} times, new set {new_seen} times, {leftovers} leftover(s) beside it"
    );
    assert!(killed >= 25, "only {killed} of 50 kills landed while the process ran (undisturbed run: {full:?})");
    // The next run sweeps what the killed ones left.
    put_old();
    fastest.measure();
    assert_eq!(folder_files(&out), new_files);
    let mut names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["new.safetensors", "old.safetensors", "out"]);
}
