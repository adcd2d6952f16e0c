//! Hostile accelerate and `Trainer` folders (`fixtures/gen/hostile_accelerate_positions.py`):
//! a data position file that cannot be read is refused naming the file and the global or the
//! value, never replaced by a default; a rank taken from a file name never sizes an allocation
//! or a loop, and missing ranks are one problem, as ranges, at the file responsible. One test per
//! class, each pinning the message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ckpt::Checkpoint;
use common::copy_tree;

fn hostile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/accelerate_positions").join(name)
}

fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// The resume point's error for dataloader 0, with no flags and with both `step` and `epoch`
/// given: a position file that is there is never overridden by a guess or by the caller. The
/// same error is `verify`'s one problem, and `reshard` refuses with it, writing nothing (a copy
/// would carry the unreadable file along as if it were a position).
fn resume_refusal(dir: &Path) -> String {
    let ck = open(dir);
    let s = ck.save_state().expect("a save_state folder");
    let bare = s.resume_point(0, None, None).unwrap_err().to_string();
    let given = s.resume_point(0, Some(1), Some(0)).unwrap_err().to_string();
    assert_eq!(bare, given, "{}", dir.display());
    let report = ckpt::verify(dir.to_str().unwrap()).unwrap();
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![bare.clone()]);
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("resharded");
    let err = ckpt::reshard(&ck, &dst, 3, &ckpt::WriteOptions::default()).unwrap_err();
    assert_eq!(err.to_string(), bare);
    assert!(std::fs::read_dir(out.path()).unwrap().next().is_none(), "reshard left output behind");
    bare
}

const REFUSED: &str = "outside what this kind of file may hold; the data position is not read, and none is guessed";

#[test]
fn hostile_a_sampler_naming_posix_system_is_refused_by_name_not_read_as_sequential() {
    let dir = hostile("sampler_system");
    let want = format!("{}: its pickle names `posix.system`, {REFUSED}", dir.join("sampler.bin").display());
    assert_eq!(resume_refusal(&dir), want);
    let ck = open(&dir);
    assert!(ck.save_state().unwrap().data_position(0).is_none(), "no position made up");
}

#[test]
fn hostile_a_sampler_naming_builtins_eval_is_refused_by_name() {
    let dir = hostile("sampler_eval");
    let want = format!("{}: its pickle names `builtins.eval`, {REFUSED}", dir.join("sampler.bin").display());
    assert_eq!(resume_refusal(&dir), want);
}

#[test]
fn hostile_a_negative_sampler_epoch_is_refused_by_name() {
    let dir = hostile("sampler_negative_epoch");
    let want = format!("{}: `state.epoch` is -1, not an epoch (a count from 0)", dir.join("sampler.bin").display());
    assert_eq!(resume_refusal(&dir), want);
}

#[test]
fn hostile_a_refused_dataloader_state_is_refused_by_name() {
    let dir = hostile("dl_system");
    let want = format!("{}: its pickle names `posix.system`, {REFUSED}", dir.join("dl_state_dict.bin").display());
    assert_eq!(resume_refusal(&dir), want);
}

#[test]
fn hostile_a_dataloader_state_without_a_batch_count_is_refused_by_name() {
    let dir = hostile("dl_no_count");
    let want = format!(
        "{}: holds no batch count (`_num_yielded`, or `_snapshot._snapshot_step` with workers); \
         the data position is not read, and none is guessed",
        dir.join("dl_state_dict.bin").display()
    );
    assert_eq!(resume_refusal(&dir), want);
}

#[test]
fn hostile_a_negative_batch_count_is_refused_by_name() {
    let dir = hostile("dl_negative_count");
    let want = format!("{}: `_num_yielded` is -1, not a batch count", dir.join("dl_state_dict.bin").display());
    assert_eq!(resume_refusal(&dir), want);
}

/// `verify`'s problems and what opening (which `merge`, `reshard` and `data state` start with)
/// says, in well under a second.
fn refusals(dir: &Path) -> (Vec<String>, String) {
    let start = Instant::now();
    let report = ckpt::verify(dir.to_str().unwrap()).unwrap();
    let problems = report.problems.iter().map(ToString::to_string).collect();
    let refused = Checkpoint::open(dir.to_str().unwrap()).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(5), "{}: {:?}", dir.display(), start.elapsed());
    (problems, refused)
}

fn beyond_limit(file: &Path) -> String {
    format!(
        "{}: the rank in this name is not below the world-size limit (1048576 ranks); the file is not read",
        file.display()
    )
}

#[test]
fn hostile_a_rank_file_named_for_rank_10_to_the_12_is_refused_without_sizing_anything() {
    let dir = hostile("rank_huge");
    let want = beyond_limit(&dir.join("random_states_1000000000000.pkl"));
    assert_eq!(refusals(&dir), (vec![want.clone()], want));
}

#[test]
fn hostile_a_rank_file_named_for_rank_u64_max_names_itself_and_does_not_wrap() {
    let dir = hostile("rank_u64_max");
    let want = beyond_limit(&dir.join("random_states_18446744073709551615.pkl"));
    assert_eq!(refusals(&dir), (vec![want.clone()], want));
}

#[test]
fn hostile_a_rank_file_named_past_u64_is_a_rank_file_refused_not_a_stray_file() {
    let dir = hostile("rank_past_u64");
    let want = beyond_limit(&dir.join("random_states_18446744073709551616.pkl"));
    assert_eq!(refusals(&dir), (vec![want.clone()], want));
}

#[test]
fn hostile_a_trainer_rank_file_named_for_rank_10_to_the_12_is_refused() {
    let dir = hostile("trainer_rank_huge");
    let want = beyond_limit(&dir.join("rng_state_1000000000000.pth"));
    assert_eq!(refusals(&dir), (vec![want.clone()], want));
}

#[test]
fn hostile_missing_ranks_are_one_problem_as_ranges_at_the_highest_rank_file() {
    let dir = hostile("rank_gaps");
    let want = format!(
        "{}: rank 1048575: missing: the folder was saved by 1048576 ranks, as this file's name says, \
         and ranks 1-2, 5-1048574 left no RNG file",
        dir.join("random_states_1048575.pkl").display()
    );
    assert_eq!(refusals(&dir), (vec![want.clone()], want));
}

#[test]
fn hostile_missing_ranks_of_a_sharded_model_are_one_problem_at_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fsdp2_w3");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/accelerate/fsdp2_w3");
    copy_tree(&src, &dir);
    std::fs::remove_file(dir.join("random_states_1.pkl")).unwrap();
    std::fs::remove_file(dir.join("random_states_2.pkl")).unwrap();
    let want = format!(
        "{}: missing: the folder was saved by 3 ranks, as this model says, and ranks 1-2 left no RNG file",
        dir.join("pytorch_model_fsdp_0").display()
    );
    assert_eq!(refusals(&dir), (vec![want.clone()], want));
}
