//! `ckpt` on Megatron-Core checkpoints end to end, through the binary: inspect a training run
//! folder, merge its model and (`--optimizer`) its distributed optimizer's state from either
//! form, merge `--as-stored`, convert to a DCP folder for other world sizes, and read a legacy
//! save. The references are the files megatron and torch wrote beside each fixture.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::*;

fn train(form: &str) -> std::path::PathBuf {
    fixtures().join("megatron/train_dp2").join(form)
}

fn same_file_bytes(a: &std::path::Path, b: &std::path::Path) -> bool {
    let load = |p: &std::path::Path| {
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut out: Vec<(String, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (format!("{n} {:?} {:?}", v.dtype(), v.shape()), v.data().to_vec()))
            .collect();
        out.sort();
        out
    };
    load(a) == load(b)
}

#[test]
fn inspect_a_training_run_folder() {
    let out = run(&["inspect", train("dp_reshardable").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("format:  megatron-torch-dist\n"), "{text}");
    assert!(
        text.contains(
            "megatron: torch_dist (iteration 2, tensor parallel 1, pipeline parallel 1, optimizer dp_reshardable)\n"
        ),
        "{text}"
    );
    assert!(text.contains("decoder.layers.1.pre_mlp_layernorm.weight"), "{text}");

    let out = run(&["inspect", "--json", train("dp_reshardable").to_str().unwrap()]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["format"], "megatron-torch-dist");
    assert_eq!(doc["megatron"]["optimizer"], "dp_reshardable");
    assert_eq!(doc["megatron"]["num_layers"], 2);
}

#[test]
fn merge_with_the_optimizer_from_either_form() {
    let want = fixtures().join("megatron/train_dp2/expected_optimizer.safetensors");
    for form in ["dp_reshardable", "fully_reshardable"] {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.safetensors");
        let out = run(&["merge", "--optimizer", train(form).to_str().unwrap(), model.to_str().unwrap()]);
        assert!(out.status.success(), "{form}: {}", stderr(&out));
        let optimizer = dir.path().join("optimizer.safetensors");
        assert_eq!(stdout(&out), format!("{}\n{}\n", model.display(), optimizer.display()));
        assert!(same_file_bytes(&optimizer, &want), "{form}");
        assert!(same_file_bytes(&model, &fixtures().join("megatron/train_dp2/expected_model.safetensors")), "{form}");
    }
}

#[test]
fn merge_as_stored_and_convert_to_dcp() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron/tp2pp2/ckpt");
    let stored = dir.path().join("stored.safetensors");
    let out = run(&["merge", "--as-stored", src.to_str().unwrap(), stored.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(same_file_bytes(&stored, &fixtures().join("megatron/tp2pp2/expected_stored.safetensors")));

    let dcp = dir.path().join("w3");
    let out = run(&["convert", src.to_str().unwrap(), dcp.to_str().unwrap(), "--to", "dcp", "--world-size", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let merged = dir.path().join("model.safetensors");
    let out = run(&["merge", dcp.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(same_file_bytes(&merged, &fixtures().join("megatron/tp2pp2/expected_model.safetensors")));
}

#[test]
fn convert_a_training_run_to_a_megatron_run_folder() {
    let dir = tempfile::tempdir().unwrap();
    let src = train("fully_reshardable");
    let run_dir = dir.path().join("run");
    let out = run(&["convert", src.to_str().unwrap(), run_dir.to_str().unwrap(), "--to", "megatron"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(run_dir.join("latest_checkpointed_iteration.txt")).unwrap(), "2");
    let merged = dir.path().join("model.safetensors");
    let out = run(&["merge", run_dir.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(same_file_bytes(&merged, &fixtures().join("megatron/train_dp2/expected_model.safetensors")));
    // The optimizer's state came along, bit for bit.
    let opt = dir.path().join("o/model.safetensors");
    let out = run(&["merge", run_dir.to_str().unwrap(), opt.to_str().unwrap(), "--optimizer"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let want = fixtures().join("megatron/train_dp2/expected_optimizer.safetensors");
    assert!(same_file_bytes(&dir.path().join("o/optimizer.safetensors"), &want));
    // Written again over the same iteration: refused, naming it, exit 2.
    let out = run(&["convert", src.to_str().unwrap(), run_dir.to_str().unwrap(), "--to", "megatron"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("iter_0000002"), "{}", stderr(&out));
}

#[test]
fn merge_a_legacy_save() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron/legacy_tp2pp2");
    let merged = dir.path().join("model.safetensors");
    let out = run(&["merge", src.to_str().unwrap(), merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(same_file_bytes(&merged, &fixtures().join("megatron/legacy_tp2pp2/expected_model.safetensors")));
    let out = run(&["verify", src.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
}

#[test]
fn as_stored_on_another_format_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("megatron/tp2/expected_model.safetensors");
    let out = run(&["merge", "--as-stored", src.to_str().unwrap(), dir.path().join("m.safetensors").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("applies to Megatron `torch_dist` checkpoints only"), "{}", stderr(&out));
}

#[test]
fn merge_a_mixture_of_experts_run_with_its_chained_optimizer() {
    for case in ["mixtral_ep2", "qwen2moe_ep2"] {
        let dir = tempfile::tempdir().unwrap();
        let src = fixtures().join("megatron_moe").join(case);
        let out = run(&["inspect", src.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        assert!(text.contains("expert parallel 2, optimizer dp_reshardable)"), "{text}");
        assert!(text.contains("experts 4, top-k 2"), "{text}");
        assert!(text.contains("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"), "{text}");

        let merged = dir.path().join("model.safetensors");
        let out = run(&["merge", "--optimizer", src.to_str().unwrap(), merged.to_str().unwrap()]);
        assert!(out.status.success(), "{case}: {}", stderr(&out));
        assert!(same_file_bytes(&merged, &src.join("expected_model.safetensors")), "{case}");
        let bytes = std::fs::read(dir.path().join("optimizer.safetensors")).unwrap();
        let optimizer = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let key = "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight";
        let key = if case == "qwen2moe_ep2" { key.replace("layers.mlp", "layers.2.mlp") } else { key.to_string() };
        assert!(optimizer.tensor(&key).is_ok(), "{case}: {:?}", optimizer.names());
    }
}
