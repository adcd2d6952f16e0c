//! `ckpt data state --from-accelerate` and `ckpt inspect` on the hostile folders of
//! `fixtures/gen/hostile_accelerate_positions.py`: a position file that cannot be read is exit 2
//! with one line naming the file and the global or value (never a sequential order at epoch 0,
//! never the `--step K` way out); a rank in a file name is one line naming that file, at once.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

fn hostile(name: &str) -> std::path::PathBuf {
    fixtures().join("hostile").join("accelerate_positions").join(name)
}

/// `data state --from-accelerate DIR --json` for a 12-sample loader of batch 4, plus `extra`.
fn data_state(dir: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut args =
        vec!["data", "state", "--from-accelerate", dir.to_str().unwrap(), "--len", "12", "--batch-size", "4"];
    args.extend_from_slice(extra);
    args.push("--json");
    run(&args)
}

/// Refused with exit 2 and exactly `error: {reason at file}`, nothing on stdout, with no flags and
/// with `--step`, `--epoch` and `--seed` given.
fn assert_refused(dir: &std::path::Path, file: &str, reason: &str) {
    let want = format!("error: {}: {reason}\n", dir.join(file).display());
    for extra in [&[][..], &["--step", "1", "--epoch", "0", "--shuffle", "--seed", "77"][..]] {
        let out = data_state(dir, extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stdout(&out));
        assert_eq!(stdout(&out), "", "{extra:?}");
        assert_eq!(stderr(&out), want, "{extra:?}");
    }
}

const REFUSED: &str = "outside what this kind of file may hold; the data position is not read, and none is guessed";

#[test]
fn hostile_data_state_refuses_a_sampler_naming_posix_system() {
    let reason = format!("its pickle names `posix.system`, {REFUSED}");
    assert_refused(&hostile("sampler_system"), "sampler.bin", &reason);
}

#[test]
fn hostile_data_state_refuses_a_sampler_naming_builtins_eval() {
    let reason = format!("its pickle names `builtins.eval`, {REFUSED}");
    assert_refused(&hostile("sampler_eval"), "sampler.bin", &reason);
}

#[test]
fn hostile_data_state_refuses_a_negative_sampler_epoch() {
    assert_refused(
        &hostile("sampler_negative_epoch"),
        "sampler.bin",
        "`state.epoch` is -1, not an epoch (a count from 0)",
    );
}

#[test]
fn hostile_data_state_refuses_a_refused_dataloader_state() {
    let reason = format!("its pickle names `posix.system`, {REFUSED}");
    assert_refused(&hostile("dl_system"), "dl_state_dict.bin", &reason);
}

#[test]
fn hostile_data_state_refuses_a_dataloader_state_without_a_count() {
    assert_refused(
        &hostile("dl_no_count"),
        "dl_state_dict.bin",
        "holds no batch count (`_num_yielded`, or `_snapshot._snapshot_step` with workers); \
         the data position is not read, and none is guessed",
    );
    assert_refused(&hostile("dl_negative_count"), "dl_state_dict.bin", "`_num_yielded` is -1, not a batch count");
}

#[test]
fn data_state_still_offers_step_where_only_a_sampler_was_saved() {
    let dir = fixtures().join("accelerate").join("sampler");
    let out = data_state(&dir, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("accelerate saved no data position for dataloader 0") && err.ends_with("(`--step K`)\n"),
        "{err}"
    );
    let out = data_state(&dir, &["--step", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((&st["epoch"], &st["sampler"]["seed"]), (&serde_json::json!(2), &serde_json::json!(1234)), "{st}");
}

#[test]
fn hostile_a_rank_in_a_file_name_is_one_line_naming_the_file() {
    let limit = "the rank in this name is not below the world-size limit (1048576 ranks); the file is not read";
    let cases = [
        ("rank_huge", "random_states_1000000000000.pkl", limit.to_string()),
        ("rank_u64_max", "random_states_18446744073709551615.pkl", limit.to_string()),
        ("trainer_rank_huge", "rng_state_1000000000000.pth", limit.to_string()),
        (
            "rank_gaps",
            "random_states_1048575.pkl",
            "rank 1048575: missing: the folder was saved by 1048576 ranks, as this file's name says, \
             and ranks 1-2, 5-1048574 left no RNG file"
                .to_string(),
        ),
    ];
    for (name, file, reason) in cases {
        let dir = hostile(name);
        let want = format!("error: {}: {reason}\n", dir.join(file).display());
        let start = std::time::Instant::now();
        let out = data_state(&dir, &["--step", "1"]);
        assert_eq!((out.status.code(), stderr(&out)), (Some(2), want.clone()), "{name}");
        let out = run(&["inspect", dir.to_str().unwrap()]);
        assert_eq!((out.status.code(), stderr(&out)), (Some(2), want.clone()), "{name}");
        let out = run(&["verify", dir.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let text = stdout(&out);
        let problems: Vec<&str> = text.lines().filter(|l| l.contains("problem: ")).map(str::trim).collect();
        assert_eq!(problems, [format!("problem: {}", want.trim_start_matches("error: ").trim_end())], "{name}");
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "{name}: {:?}", start.elapsed());
    }
}
