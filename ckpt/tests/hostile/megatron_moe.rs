//! Mixture-of-experts Megatron `torch_dist` saves that do not hold together, one test per
//! attack: each is a copy of the real run folder `fixtures/megatron_moe/mixtral_ep2` (megatron-core
//! 0.19.2, EP 2, 2 layers × 4 experts) with the damaged `.metadata` of
//! `fixtures/hostile/megatron_moe/<attack>/` (`fixtures/gen/hostile_megatron_moe.py`) in place of
//! its own. Each is refused when opened and by `verify` with one line naming the file and the key.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::PathBuf;

use ckpt::Checkpoint;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// A copy of the run folder with the attack's `.metadata`.
fn damaged(attack: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    common::copy_tree(&fixtures().join("megatron_moe/mixtral_ep2"), &run);
    let metadata = fixtures().join("hostile/megatron_moe").join(attack).join(".metadata");
    std::fs::copy(metadata, run.join("iter_0000002/.metadata")).unwrap();
    (tmp, run)
}

/// The attack's run folder is refused with exactly `expected` (given the folder), by `open` and
/// as `verify`'s one problem.
fn refused(attack: &str, expected: impl Fn(&std::path::Path) -> String) {
    let (_tmp, run) = damaged(attack);
    let expected = expected(&run);
    let err = Checkpoint::open(run.to_str().unwrap()).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data(), "{expected}");
    assert!(!expected.contains('\n'));
    let report = ckpt::verify(run.to_str().unwrap()).unwrap();
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![expected]);
}

#[test]
fn a_router_of_the_wrong_shape() {
    // The shape lies about bytes that hold the true one: the stored item says [1, 4, 16].
    refused("router_wrong_shape", |run| {
        format!(
            "{} (rank 1): tensor `decoder.layers.mlp.router.weight`: the item at byte 29093 holds shape [1, 4, 16] \
             where the chunk at offsets [0, 0, 0] has sizes [1, 2, 32]",
            run.join("iter_0000002/__1_0.distcp").display()
        )
    });
}

#[test]
fn an_expert_axis_with_a_gap() {
    refused("expert_axis_gap", |run| {
        format!(
            "{}: tensor `decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight`: the boxes leave elements \
             of size [16, 16] uncovered, from offsets [0, 0]",
            run.display()
        )
    });
}

#[test]
fn an_expert_axis_longer_than_the_runs_experts() {
    refused("expert_count_mismatch", |run| {
        format!(
            "{}: `decoder.layers.mlp.experts.experts.linear_fc2.weight`: the expert axis holds 5 experts, but \
             args.num_experts is 4",
            run.join("iter_0000002/.metadata").display()
        )
    });
}
