//! `ckpt` on DeepSpeed ZeRO folders: inspect lists the merged tensors, verify reports defective
//! partitions as problems, reshard writes ds_to_universal's layout (resumed by real DeepSpeed in
//! `tests/python/interop/test_deepspeed_interop.py`).
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;

use common::*;

fn ds(case: &str) -> std::path::PathBuf {
    fixtures().join("deepspeed").join(case)
}

fn tree(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

#[test]
fn inspect_lists_merged_tensors_with_rank_files() {
    let out = run(&["inspect", "--json", ds("z3_bf16_ws4").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["format"], "deepspeed-zero");
    // 4 optim + 4 model-states rank files.
    assert_eq!(doc["files"].as_array().unwrap().len(), 8);
    let tensors = doc["tensors"].as_array().unwrap();
    let embed = tensors.iter().find(|t| t["name"] == "embed.weight").unwrap();
    assert_eq!(embed["dtype"], "F32");
    assert_eq!(embed["shape"], serde_json::json!([37, 6]));
    let names: Vec<&str> = tensors.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "scale",
            "counter",
            "frozen",
            "embed.weight",
            "lin1.weight",
            "out.weight",
            "tiny",
            "gate",
            "lin1.bias",
            "norm.weight",
            "norm.bias",
            "out.bias",
            "lm_head.weight"
        ]
    );
    let text = stdout(&run(&["inspect", ds("z3_bf16_ws4").to_str().unwrap()]));
    assert!(text.contains("format:  deepspeed-zero"), "{text}");
    assert!(text.contains("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"), "{text}");
}

#[test]
fn verify_passes_real_folders_and_reports_short_partitions() {
    let out = run(&["verify", ds("z2_fp32_ws2").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stdout(&out));
    let bad = fixtures().join("hostile/deepspeed/partition_short");
    let out = run(&["verify", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    assert!(text.contains("problem:") && text.contains("zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1"), "{text}");
    let out = run(&["verify", fixtures().join("hostile/deepspeed/missing_rank").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
}

#[test]
fn reshard_writes_ds_to_universal_layout() {
    for case in ["z2_fp32_ws2", "z3_fp32_ws4_sg50"] {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("uni");
        let out = run(&["reshard", ds(case).to_str().unwrap(), dst.to_str().unwrap(), "--world-size", "3"]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stdout(&out).ends_with("latest_universal\n"));
        assert_eq!(std::fs::read(dst.join("latest_universal")).unwrap(), b"global_step2_universal");
        let ours = tree(&dst.join("global_step2_universal"));
        let theirs = tree(&ds(case).join("global_step2_universal"));
        // Everything we write, ds_to_universal wrote; it adds only `--inject_missing_state`
        // extras (fp32.pt of aliases, frozen params and buffers) at stage 1/2.
        assert!(ours.is_subset(&theirs), "{:?}", ours.difference(&theirs).collect::<Vec<_>>());
        for extra in theirs.difference(&ours) {
            assert!(extra.ends_with("/fp32.pt"), "{extra}");
        }
        // Model-states files are byte copies.
        for f in ours.iter().filter(|f| f.ends_with("_model_states.pt")) {
            assert_eq!(
                std::fs::read(dst.join("global_step2_universal").join(f)).unwrap(),
                std::fs::read(ds(case).join("global_step2").join(f)).unwrap()
            );
        }
        // No temporaries left.
        assert!(!ours.iter().any(|f| f.contains(".tmp.")), "{ours:?}");
    }
}

#[test]
fn reshard_refuses_world_size_zero_and_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("uni");
    let src = ds("z2_fp32_ws2");
    let out = run(&["reshard", src.to_str().unwrap(), dst.to_str().unwrap(), "--world-size", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("0 is not in 1..=1048576"), "{}", stderr(&out));
    assert!(!dst.exists());
    let ok = run(&["reshard", src.to_str().unwrap(), dst.to_str().unwrap(), "--world-size", "2"]);
    assert!(ok.status.success(), "{}", stderr(&ok));
    let again = run(&["reshard", src.to_str().unwrap(), dst.to_str().unwrap(), "--world-size", "2"]);
    assert_eq!(again.status.code(), Some(2));
    assert!(stderr(&again).contains("already exists"), "{}", stderr(&again));
    let bad = fixtures().join("hostile/deepspeed/partition_short");
    let out = run(&["reshard", bad.to_str().unwrap(), dir.path().join("b").to_str().unwrap(), "--world-size", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("rank 1, `optimizer_state_dict.single_partition_of_fp32_groups.0`"));
    assert!(!dir.path().join("b").exists());
}
