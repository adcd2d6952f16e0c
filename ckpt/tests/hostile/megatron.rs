//! Megatron checkpoints that do not hold together, one test per defect: each is refused with
//! one line naming the file (and the key or rank where there is one), by the reader and by
//! `verify`, which reports it as the checkpoint's problem. Each damages a copy of a real
//! fixture (`fixtures/megatron/tp2`, saved by megatron-core 0.19.2 on 2 ranks) at test time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::Checkpoint;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron/tp2/ckpt")
}

/// A Megatron-LM run folder around a copy of the fixture: `SAVE/iter_0000003/` and the tracker.
fn run_folder(tracker: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("save");
    common::copy_tree(&fixture(), &save.join("iter_0000003"));
    std::fs::write(save.join("latest_checkpointed_iteration.txt"), tracker).unwrap();
    (tmp, save)
}

/// `src` is refused with exactly `expected` when opened, and `verify` reports that one problem
/// of a checkpoint of `format`.
fn refused_as(src: &Path, format: &str, expected: &str) {
    let err = Checkpoint::open(src.to_str().unwrap()).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data(), "{expected}");
    let report = ckpt::verify(src.to_str().unwrap()).unwrap();
    assert_eq!(report.format.map(|f| f.name()), Some(format));
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![expected.to_string()]);
}

fn refused(src: &Path, expected: &str) {
    refused_as(src, "megatron-torch-dist", expected);
}

#[test]
fn a_run_folder_is_read_through_its_tracker() {
    let (_tmp, save) = run_folder("3\n");
    let ck = Checkpoint::open(save.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "megatron-torch-dist");
    assert_eq!(ck.megatron().unwrap().iteration, Some(3));
    let direct = Checkpoint::open(fixture().to_str().unwrap()).unwrap();
    let names = |c: &Checkpoint| c.tensors().iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&ck), names(&direct));
    // The tracker is the run's; no operation may write over it.
    assert!(ck.members().iter().any(|m| m.ends_with("latest_checkpointed_iteration.txt")));
}

#[test]
fn a_tracker_naming_a_missing_iteration() {
    let (_tmp, save) = run_folder("7");
    let tracker = save.join("latest_checkpointed_iteration.txt");
    refused(&save, &format!("{}: the tracker names iteration `7`, but `iter_0000007` is not there", tracker.display()));
}

#[test]
fn a_tracker_that_is_not_an_iteration() {
    let (_tmp, save) = run_folder("latest\n");
    let tracker = save.join("latest_checkpointed_iteration.txt");
    refused(&save, &format!("{}: the tracker holds `latest`, not an iteration number or `release`", tracker.display()));
}

#[test]
fn a_tracker_naming_a_save_that_did_not_finish() {
    let (_tmp, save) = run_folder("3");
    let dir = save.join("iter_0000003");
    std::fs::remove_file(dir.join("metadata.json")).unwrap();
    let tracker = save.join("latest_checkpointed_iteration.txt");
    refused(
        &save,
        &format!(
            "{}: the tracker names `{}`, which has no `metadata.json`: its save did not finish",
            tracker.display(),
            dir.display()
        ),
    );
}

#[test]
fn a_rank_file_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    common::copy_tree(&fixture(), &dir);
    std::fs::remove_file(dir.join("__1_0.distcp")).unwrap();
    let err = Checkpoint::open(dir.to_str().unwrap()).unwrap_err().to_string();
    assert!(err.starts_with(&format!("{}: tensor `", dir.join(".metadata").display())), "{err}");
    assert!(err.ends_with("is mapped to `__1_0.distcp`, which does not exist"), "{err}");
    let report = ckpt::verify(dir.to_str().unwrap()).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
}

#[test]
fn another_backend_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    common::copy_tree(&fixture(), &dir);
    std::fs::write(dir.join("metadata.json"), r#"{"sharded_backend": "zarr", "sharded_backend_version": 1}"#).unwrap();
    let err = Checkpoint::open(dir.to_str().unwrap()).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: the checkpoint's backend is `zarr`; only `torch_dist` is read",
            dir.join("metadata.json").display()
        )
    );
}

/// A copy of the legacy fixture (`fixtures/megatron/legacy_tp2pp2`: tensor parallel 2 ×
/// pipeline parallel 2, written by Megatron-LM's own `save_checkpoint`).
fn legacy_copy() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("save");
    common::copy_tree(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/megatron/legacy_tp2pp2"), &save);
    (tmp, save)
}

fn refused_legacy(src: &Path, expected: &str) {
    refused_as(src, "megatron-legacy", expected);
}

#[test]
fn a_legacy_rank_missing() {
    let (_tmp, save) = legacy_copy();
    let gone = save.join("iter_0000001/mp_rank_01_001");
    std::fs::remove_dir_all(&gone).unwrap();
    refused_legacy(
        &save,
        &format!(
            "{} (rank 1): missing: the save has 2 tensor-parallel × 2 pipeline ranks, but this rank's file is not there",
            gone.join("model_optim_rng.pt").display()
        ),
    );
}

#[test]
fn a_legacy_stage_missing_disagrees_with_the_layer_count() {
    let (_tmp, save) = legacy_copy();
    for r in ["mp_rank_00_001", "mp_rank_01_001"] {
        std::fs::remove_dir_all(save.join("iter_0000001").join(r)).unwrap();
    }
    refused_legacy(
        &save,
        &format!(
            "{}: the stages hold 2 layers in all, but `args.num_layers` is 4",
            save.join("iter_0000001").display()
        ),
    );
}

/// Found writing the `megatron_rank_folders` fuzz target: a rank folder's name claiming the
/// last rank a `u64` holds sized the grid of ranks as that rank + 1, which overflowed (a panic
/// in a debug build; in a release build the save was "not a checkpoint"). A name is an input:
/// it is checked against the number of rank folders first.
#[test]
fn a_legacy_rank_folder_naming_rank_2_pow_64_minus_1() {
    let (_tmp, save) = legacy_copy();
    let iter = save.join("iter_0000001");
    let forged = iter.join("mp_rank_18446744073709551615_000");
    common::copy_tree(&iter.join("mp_rank_00_000"), &forged);
    refused_legacy(
        &save,
        &format!(
            "{} (rank 18446744073709551615): the folder's name gives tensor-parallel rank 18446744073709551615, but \
             the iteration holds 5 rank folders",
            forged.display()
        ),
    );
}

/// Found writing the `megatron_rank_folders` fuzz target: `mp_rank_1_000` and `mp_rank_01_000`
/// are both rank 1 of stage 0. Which one Megatron wrote is not ours to guess; it used to be
/// the one spelled as the reader spells it, the other ignored.
#[test]
fn two_legacy_rank_folders_naming_the_same_rank() {
    let (_tmp, save) = legacy_copy();
    let iter = save.join("iter_0000001");
    common::copy_tree(&iter.join("mp_rank_01_000"), &iter.join("mp_rank_1_000"));
    refused_legacy(
        &save,
        &format!(
            "{} (rank 1): the rank folders `mp_rank_01_000` and `mp_rank_1_000` name the same rank",
            iter.display()
        ),
    );
}
