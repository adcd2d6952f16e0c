//! Legacy Megatron saves whose rank folders, model chunks or experts do not fit the run their
//! saved `args` describe, one test per defect: each is refused with one line naming the file, the
//! key and the rank, by the reader and by `verify`. Each damages a copy of a real save
//! (`fixtures/megatron_legacy_moe/ep2`: 4 experts at expert parallel 2; `fixtures/megatron_stages/
//! pp2vpp2`: 2 stages of 2 virtual chunks), renaming a folder or putting in place one rank file
//! of `fixtures/hostile/megatron_legacy/` (`fixtures/gen/hostile_megatron_legacy.py`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::Checkpoint;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// A copy of the legacy run folder of the fixture `case`, and its iteration folder.
fn copy(case: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("save");
    common::copy_tree(&fixtures().join(case).join("torch"), &save);
    let iter = save.join("iter_0000001");
    (tmp, save, iter)
}

/// The copy with the rank file of `folder` replaced by the hostile one `attack`.
fn damaged(case: &str, folder: &str, attack: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (tmp, save, iter) = copy(case);
    let file = iter.join(folder).join("model_optim_rng.pt");
    std::fs::copy(fixtures().join("hostile/megatron_legacy").join(attack).join("model_optim_rng.pt"), &file).unwrap();
    (tmp, save, file)
}

fn refused(src: &Path, expected: &str) {
    let err = Checkpoint::open(src.to_str().unwrap()).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data(), "{expected}");
    let report = ckpt::verify(src.to_str().unwrap()).unwrap();
    assert_eq!(report.format.map(|f| f.name()), Some("megatron-legacy"));
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![expected.to_string()]);
}

#[test]
fn an_expert_folder_whose_rank_does_not_fit_the_args() {
    let (_tmp, save, iter) = copy("megatron_legacy_moe/ep2");
    std::fs::rename(iter.join("mp_rank_00_001"), iter.join("mp_rank_00_003")).unwrap();
    refused(
        &save,
        &format!(
            "{} (rank 0): the folder's name gives expert rank 3, but `args.expert_model_parallel_size` is 2",
            iter.join("mp_rank_00_003/model_optim_rng.pt").display()
        ),
    );
}

#[test]
fn a_rank_folder_naming_a_stage_the_args_do_not_have() {
    let (_tmp, save, iter) = copy("megatron_legacy_moe/ep2");
    std::fs::rename(iter.join("mp_rank_00_001"), iter.join("mp_rank_00_000_001")).unwrap();
    refused(
        &save,
        &format!(
            "{} (rank 0): the saved args (pipeline parallel 1, expert parallel 2) name rank folders \
             `mp_rank_TT_EEE`, not `mp_rank_00_000_001`",
            iter.join("mp_rank_00_000_001/model_optim_rng.pt").display()
        ),
    );
}

#[test]
fn an_expert_rank_missing() {
    let (_tmp, save, iter) = copy("megatron_legacy_moe/ep2");
    std::fs::remove_file(iter.join("mp_rank_00_001/model_optim_rng.pt")).unwrap();
    refused(
        &save,
        &format!(
            "{} (rank 0): missing: the save has 1 tensor-parallel × 1 pipeline × 2 expert ranks, but this rank's \
             file is not there",
            iter.join("mp_rank_00_001/model_optim_rng.pt").display()
        ),
    );
}

#[test]
fn a_model_chunk_beyond_the_virtual_stages() {
    let (_tmp, save, file) = damaged("megatron_stages/pp2vpp2", "mp_rank_00_001", "chunk_beyond_virtual");
    refused(
        &save,
        &format!(
            "{} (rank 0): `model2.decoder.layers.0.input_layernorm.weight`: model chunk 2, but the saved args give 2 \
             model chunk(s) per stage (`args.virtual_pipeline_model_parallel_size`)",
            file.display()
        ),
    );
}

#[test]
fn a_local_expert_beyond_its_ranks_share() {
    let (_tmp, save, file) = damaged("megatron_legacy_moe/ep2", "mp_rank_00_001", "expert_beyond_rank");
    refused(
        &save,
        &format!(
            "{} (rank 0): `model.decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight`: local expert 2, but \
             each expert rank holds 2 (`args.num_experts`)",
            file.display()
        ),
    );
}

#[test]
fn the_removed_grouped_mlps_fused_weights_are_refused_by_name() {
    let (_tmp, save, file) = damaged("megatron_legacy_moe/ep2", "mp_rank_00_000", "grouped_mlp");
    refused(
        &save,
        &format!(
            "{} (rank 0): `model.decoder.layers.0.mlp.experts.weight1`: the removed GroupedMLP's fused expert weights: \
             megatron-core 0.19.2 no longer documents their layout, so they are not read",
            file.display()
        ),
    );
}
