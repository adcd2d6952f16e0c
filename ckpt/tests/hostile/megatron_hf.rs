//! Megatron-LM saves whose saved `args` lie about the model, converted to a Hugging Face folder:
//! each is a copy of the real legacy run `fixtures/megatron_arch/llama_legacy_tp2pp2` (megatron-core
//! 0.19.2, TP 2 × PP 2, 4 heads in 2 query groups) with the first rank's file replaced by the one of
//! `fixtures/hostile/megatron_hf/<attack>/` (`fixtures/gen/hostile_megatron_hf.py`: the same file
//! with one `args` field changed). The save still opens and merges (its tensors are whole); the
//! conversion is refused with one line naming the file or tensor, and writes nothing.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, ConvertOptions, TargetFormat, WriteOptions};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The conversion of the attack's run folder fails with exactly `expected` (given the folder).
fn refused(attack: &str, expected: impl Fn(&Path) -> String) -> ckpt::Error {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    common::copy_tree(&fixtures().join("megatron_arch/llama_legacy_tp2pp2/run"), &run);
    let rank0 = "iter_0000002/mp_rank_00_000/model_optim_rng.pt";
    let attack_file = fixtures().join("hostile/megatron_hf").join(attack).join("mp_rank_00_000/model_optim_rng.pt");
    std::fs::copy(attack_file, run.join(rank0)).unwrap();
    let ck = Checkpoint::open(run.to_str().unwrap()).unwrap();
    let out = tmp.path().join("hf");
    let options = ConvertOptions { to: Some(TargetFormat::Hf), ..Default::default() };
    let err = ckpt::convert(&ck, &out, &options, &WriteOptions::default()).unwrap_err();
    assert_eq!(err.to_string(), expected(&run));
    assert!(!err.to_string().contains('\n'));
    assert!(!out.exists(), "{attack}: a refusal writes nothing");
    err
}

#[test]
fn args_that_give_more_heads_than_the_fused_qkv_holds() {
    let err = refused("heads_lie", |run| {
        format!(
            "{}: tensor `model.layers.0.self_attn.q_proj.weight`: it is made from \
             `decoder.layers.0.self_attention.linear_qkv.weight`, of shape [32, 16], but the model's configuration gives \
             it [48, 16]",
            run.display()
        )
    });
    assert!(err.is_invalid_data());
}

#[test]
fn query_groups_that_do_not_divide_the_heads() {
    let err = refused("groups_do_not_divide", |run| {
        format!(
            "{}: `args.num_query_groups` (3) does not divide `args.num_attention_heads` (4)",
            run.join("iter_0000002/mp_rank_00_000/model_optim_rng.pt").display()
        )
    });
    assert!(err.is_invalid_data());
}

#[test]
fn a_position_embedding_no_hugging_face_family_has() {
    let err = refused("alibi", |run| {
        format!(
            "{}: no Hugging Face architecture holds this model: `position_embedding_type` is `alibi`, and no family of \
             the tables has a counterpart for it",
            run.join("iter_0000002/mp_rank_00_000/model_optim_rng.pt").display()
        )
    });
    assert_eq!(err.kind(), ckpt::ErrorKind::Usage);
}
