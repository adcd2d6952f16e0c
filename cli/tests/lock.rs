//! One writer per destination: a second `ckpt` writing the destination another is writing is
//! refused at once with that one's pid, and the first one's output verifies; a lock left by a
//! killed `ckpt` is taken over. And a `ckpt` built without MPI refuses to run as the ranks of a
//! launcher, each of which would write the whole output on its own.
//!
//! The races are made deterministic by stopping the first `ckpt` (SIGSTOP) as soon as its lock
//! file names it, and checking after the stop that it still does: it is then caught holding the
//! lock mid-operation, for as long as the test needs.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::*;

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(signal: &str, pid: u32) {
    assert!(Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().unwrap().success());
}

/// Starts `ckpt args` and stops it while it holds the lock file `lock`: `None` when it finished
/// before it was seen holding it (the caller tries again with more to do).
fn stopped_holding(args: &[&str], lock: &Path) -> Option<Child> {
    let mut child = ckpt().args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let names_it = format!("pid {}\n", child.id());
    let holds = || std::fs::read_to_string(lock).is_ok_and(|t| t.ends_with(&names_it));
    loop {
        if holds() {
            signal("STOP", child.id());
            // Still named after the stop: the file is removed before the lock is released, so
            // the stopped process holds it.
            if holds() {
                return Some(child);
            }
            signal("CONT", child.id());
        }
        if child.try_wait().unwrap().is_some() {
            return None;
        }
        std::thread::yield_now();
    }
}

/// A first writer of `out` (a `ckpt` with `args`, where `SRC` stands for a source it takes long
/// enough to copy) caught holding `out`'s lock.
fn first_writer(dir: &Path, args: &[&str], lock: &Path, out: &Path) -> Child {
    for floats in [1 << 20, 1 << 22, 1 << 24] {
        let src = dir.join("big.safetensors");
        write_checkpoint(&src, 4, floats, 1);
        let args: Vec<&str> = args.iter().map(|a| if *a == "SRC" { src.to_str().unwrap() } else { a }).collect();
        if let Some(child) = stopped_holding(&args, lock) {
            return child;
        }
        // Done before it was caught: again, from nothing, with four times the bytes.
        let _ = std::fs::remove_dir_all(out);
        let _ = std::fs::remove_file(out);
    }
    panic!("`ckpt {}` never held {} long enough to be stopped", args.join(" "), lock.display());
}

/// What `dir` holds, by name, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_second_split_into_the_same_folder_is_refused_with_the_first_ones_pid() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let lock = tmp.path().join(".out.lock");
    let o = out.to_str().unwrap();
    let mut first = first_writer(tmp.path(), &["split", "SRC", o, "--max-shard-size", "5MB"], &lock, &out);

    // Another source for the same destination, as two jobs would.
    let other = tmp.path().join("other.safetensors");
    write_checkpoint(&other, 2, 16, 2);
    let second = run(&["split", other.to_str().unwrap(), o]);
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    assert_eq!(
        stderr(&second),
        format!(
            "error: splitting {}: {o}: another process (pid {}) is writing it now (it holds `{}`); nothing was written\n",
            other.display(),
            first.id(),
            lock.display()
        )
    );

    signal("CONT", first.id());
    assert!(first.wait().unwrap().success(), "the first writer finishes undisturbed");
    let v = run(&["verify", o]);
    assert_eq!(v.status.code(), Some(0), "{}{}", stdout(&v), stderr(&v));
    let index = std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap();
    assert!(index.contains("layers.3.weight"), "the output is the first writer's four tensors: {index}");
    assert_eq!(names(tmp.path()), ["big.safetensors", "other.safetensors", "out"], "no lock, no temporary left");
}

#[test]
fn a_merge_into_a_file_being_written_is_refused_and_a_killed_writers_lock_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let merged = tmp.path().join("merged.safetensors");
    let lock = tmp.path().join(".merged.safetensors.lock");
    let m = merged.to_str().unwrap();
    let mut first = first_writer(tmp.path(), &["merge", "SRC", m], &lock, &merged);
    let pid = first.id();

    let other = tmp.path().join("other.safetensors");
    write_checkpoint(&other, 2, 16, 2);
    let second = run(&["merge", other.to_str().unwrap(), m]);
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    assert!(
        stderr(&second).contains(&format!(": another process (pid {pid}) is writing it now")),
        "{}",
        stderr(&second)
    );
    assert!(!merged.exists(), "the refused merge wrote nothing");

    // Killed while holding it: the lock file stays, naming a process that is gone.
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(std::fs::read_to_string(&lock).unwrap().ends_with(&format!("pid {pid}\n")));
    let third = run(&["merge", other.to_str().unwrap(), m]);
    assert!(third.status.success(), "{}", stderr(&third));
    let v = run(&["verify", m]);
    assert_eq!(v.status.code(), Some(0), "{}{}", stdout(&v), stderr(&v));
    assert_eq!(std::fs::read(&merged).unwrap(), std::fs::read(&other).unwrap(), "the merge of one file is that file");
    assert_eq!(
        names(tmp.path()),
        ["big.safetensors", "merged.safetensors", "other.safetensors"],
        "the lock was taken over and removed, the killed writer's temporaries swept"
    );
}

/// Only a `ckpt` without the `mpi` feature has this check: one with it runs as the job's ranks
/// (cli/tests/ranks/mpi.rs). `make test` builds with MPI, so this runs in `cargo test -p
/// statekit-cli` (the launchers' variables themselves are tested in the `collective` crate).
#[cfg(not(feature = "mpi"))]
#[test]
fn a_build_without_mpi_refuses_to_write_as_one_of_several_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src.safetensors");
    write_checkpoint(&src, 2, 16, 1);
    let out = tmp.path().join("out");
    let split = ["split", src.to_str().unwrap(), out.to_str().unwrap()];
    let launched =
        [("OMPI_COMM_WORLD_SIZE", "2"), ("PMI_SIZE", "4"), ("SLURM_STEP_NUM_TASKS", "2"), ("PMIX_RANK", "1")];
    for (var, value) in launched {
        let o = ckpt().args(split).env(var, value).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {}", stderr(&o));
        let at_least = if var == "PMIX_RANK" { "at least " } else { "" };
        let ranks = if var == "PMIX_RANK" { "2" } else { value };
        assert_eq!(
            stderr(&o),
            format!(
                "error: started by a launcher as one of {at_least}{ranks} ranks (`{var}={value}`), but this `ckpt` was \
                 built without MPI, so each rank would write the whole output on its own; hint: build it with \
                 `--features mpi` (`cargo build -p statekit-cli --features mpi`), or run it once, outside the launcher\n"
            )
        );
        assert!(!out.exists());
    }
    // Reading is harmless at any count; an `sbatch` script is one process; a world of one is one.
    let o = ckpt().args(["inspect", src.to_str().unwrap()]).env("OMPI_COMM_WORLD_SIZE", "2").output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    for (var, value) in [("SLURM_NTASKS", "4"), ("OMPI_COMM_WORLD_SIZE", "1")] {
        let _ = std::fs::remove_dir_all(&out);
        let o = ckpt().args(split).env(var, value).output().unwrap();
        assert!(o.status.success(), "{var}={value}: {}", stderr(&o));
    }

    // And under a real `mpirun`, where there is one.
    let _ = std::fs::remove_dir_all(&out);
    let Ok(o) = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", env!("CARGO_BIN_EXE_ckpt")])
        .args(split)
        .output()
    else {
        return;
    };
    let said = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "mpirun passes on the ranks' exit status: {said}");
    assert_eq!(
        said.matches("error: started by a launcher as one of 2 ranks (`OMPI_COMM_WORLD_SIZE=2`)").count(),
        2,
        "{said}"
    );
    assert!(!out.exists(), "neither rank wrote anything");
}
