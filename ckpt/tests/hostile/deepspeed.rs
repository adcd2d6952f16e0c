//! Malformed DeepSpeed checkpoints (`fixtures/hostile/deepspeed/`, made by
//! `fixtures/gen/deepspeed_hostile.py` from the real fixtures): each is refused with one line that
//! names the rank file, the key or tensor, and the rank.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use ckpt::{Checkpoint, OpenOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/deepspeed")
}

fn error_of(case: &str) -> String {
    let dir = root().join(case);
    let err = Checkpoint::open(dir.to_str().unwrap()).expect_err(case);
    let text = err.to_string();
    assert!(!text.contains('\n'), "not one line: {text}");
    let prefix = format!("{}/global_step2/", dir.display());
    text.strip_prefix(&prefix).unwrap_or_else(|| panic!("{text} does not start with {prefix}")).to_string()
}

#[test]
fn foreign_global_in_an_optim_file_is_refused_by_name() {
    assert_eq!(
        error_of("foreign_global"),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: refusing global `posix.system`: only the \
         tensor-rebuilding globals of torch's weights-only loader are allowed"
    );
}

#[test]
fn a_partition_shorter_than_the_layout_is_refused() {
    assert_eq!(
        error_of("partition_short"),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1, `optimizer_state_dict.single_partition_of_fp32_groups.0`: \
         holds 174 elements, but `param_shapes` group 0 on 2 ranks gives rank 1 176 (partition 178 minus trailing padding)"
    );
}

#[test]
fn a_missing_rank_file_is_named() {
    assert_eq!(
        error_of("missing_rank"),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: missing: the ZeRO checkpoint has 2 ranks but rank 1 wrote no such file"
    );
}

#[test]
fn ranks_disagreeing_on_partition_count_are_refused() {
    assert_eq!(
        error_of("partition_count"),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1, `optimizer_state_dict.partition_count`: says 4, rank 0 says 2"
    );
}

#[test]
fn stage3_sub_groups_that_do_not_add_up_are_refused() {
    assert_eq!(
        error_of("z3_subgroups_short"),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1, `optimizer_state_dict.fp32_flat_groups`: sub-groups hold \
         200 elements in all, but `param_shapes` on 2 ranks gives each rank 201 (ceil(numel / 2) per param)"
    );
}

#[test]
fn a_missing_tag_folder_is_an_io_error_naming_it() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/deepspeed/z1_fp32_ws2");
    let options = OpenOptions { tag: Some("global_step9".into()), ..OpenOptions::default() };
    let err = Checkpoint::open_with(dir.to_str().unwrap(), &options).expect_err("no such tag");
    assert_eq!(err.to_string(), format!("{}/global_step9: tag folder does not exist", dir.display()));
}
