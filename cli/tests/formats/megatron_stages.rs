//! `ckpt` on legacy Megatron saves spread over expert ranks and virtual pipeline chunks, through
//! the binary: `merge` writes megatron's own world-size-1 model (`expected_model.safetensors`,
//! written beside each fixture by `fixtures/gen/megatron_stages_fixtures.py`), `inspect` names
//! the run, and a damaged save is refused with one line and exit code 2.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

/// Each tensor's name, dtype, shape and bytes, sorted: two files alike here hold the same tensors.
fn tensors(p: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (format!("{n} {:?} {:?}", v.dtype(), v.shape()), v.data().to_vec()))
        .collect();
    out.sort();
    out
}

fn copy_tree(src: &std::path::Path, dst: &std::path::Path) {
    if src.is_file() {
        std::fs::copy(src, dst).unwrap();
        return;
    }
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        copy_tree(&e.path(), &dst.join(e.file_name()));
    }
}

#[test]
fn merge_a_legacy_moe_save_at_expert_parallel_2_and_a_virtual_pipeline_save() {
    for case in ["megatron_legacy_moe/ep2", "megatron_stages/pp2vpp2"] {
        let dir = tempfile::tempdir().unwrap();
        let src = fixtures().join(case).join("torch");
        let merged = dir.path().join("model.safetensors");
        let out = run(&["merge", src.to_str().unwrap(), merged.to_str().unwrap()]);
        assert!(out.status.success(), "{case}: {}", stderr(&out));
        assert_eq!(stdout(&out), format!("{}\n", merged.display()));
        assert_eq!(tensors(&merged), tensors(&fixtures().join(case).join("expected_model.safetensors")), "{case}");
    }
}

#[test]
fn inspect_a_legacy_moe_save_shows_the_experts_under_their_global_index() {
    let src = fixtures().join("megatron_legacy_moe/ep2/torch");
    let out = run(&["inspect", src.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("format:  megatron-legacy\n"), "{text}");
    assert!(text.contains("megatron: legacy (iteration 1, tensor parallel 1, pipeline parallel 1"), "{text}");
    // Expert rank 1's local expert 1 is the model's expert 3.
    assert!(text.contains("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"), "{text}");
}

#[test]
fn an_expert_folder_past_the_args_is_refused_with_exit_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("save");
    copy_tree(&fixtures().join("megatron_legacy_moe/ep2/torch"), &save);
    let iter = save.join("iter_0000001");
    std::fs::rename(iter.join("mp_rank_00_001"), iter.join("mp_rank_00_002")).unwrap();
    let out = run(&["merge", save.to_str().unwrap(), dir.path().join("m.safetensors").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(
            "mp_rank_00_002/model_optim_rng.pt (rank 0): the folder's name gives expert rank 2, but \
                      `args.expert_model_parallel_size` is 2"
        ),
        "{err}"
    );
}
