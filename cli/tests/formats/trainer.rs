//! `ckpt` on transformers `Trainer` folders end to end: `inspect` names the step and the
//! components, and `data state --from-trainer` gives the loader state whose next batches are the
//! ones the real `Trainer` trained on after resuming (recorded by `fixtures/gen/trainer_fixtures.py`).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use dataload::{LoaderState, ShardedSampler};
use serde_json::Value;

fn ckpt(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ckpt")).args(args).output().unwrap();
    (out.status.code().unwrap(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/trainer")
}

fn manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("expected.json")).unwrap()).unwrap()
}

#[test]
fn data_state_from_trainer_continues_where_the_trainer_resumed() {
    let m = manifest();
    let (len, seed) = (m["data"]["samples"].as_u64().unwrap(), m["data"]["data_seed"].as_u64().unwrap());
    for (case, want) in m["cases"].as_object().unwrap() {
        let dir = root().join(case).join(want["checkpoint"].as_str().unwrap());
        let world = want["case"]["world_size"].as_u64().unwrap();
        let native = format!("native_ws{world}");
        let Some(first) = want["resume_checks"][&native]["first_batch_samples"].as_array() else { continue };
        let (bs, ga) = (
            want["args"]["per_device_train_batch_size"].to_string(),
            want["args"]["gradient_accumulation_steps"].to_string(),
        );
        let (code, out, err) = ckpt(&[
            "data",
            "state",
            "--from-trainer",
            dir.to_str().unwrap(),
            "--len",
            &len.to_string(),
            "--batch-size",
            &bs,
            "--shuffle",
            "--seed",
            &seed.to_string(),
            "--gradient-accumulation-steps",
            &ga,
            "--json",
        ]);
        assert_eq!(code, 0, "{case}: {err}");
        let st = LoaderState::from_json(&out).unwrap();
        assert_eq!(st.world_size, world, "{case}");
        for (rank, batch) in first.iter().enumerate() {
            let mut l = ShardedSampler::from_state(&st, world, rank as u64).unwrap();
            let want: Vec<u64> = batch.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            assert_eq!(l.next_batch().unwrap(), Some(want), "{case}: rank {rank}");
        }
    }
}

#[test]
fn inspect_names_the_trainer_and_its_components() {
    let dir = root().join("zero2_w2/checkpoint-2");
    let (code, out, err) = ckpt(&["inspect", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("format:  trainer"), "{out}");
    assert!(out.contains("Trainer checkpoint, saved by 2 rank(s): step 2 of 3, epoch 0.4"), "{out}");
    assert!(out.contains("  model 0: global_step2 (deepspeed-zero, "), "{out}");
    assert!(out.contains("  rng rank 1: rng_state_1.pth (step -; python, numpy, cpu)"), "{out}");
    assert!(
        out.contains(
            "  training args: training_args.bin (names `transformers.training_args.TrainingArguments`; not read)"
        ),
        "{out}"
    );
    let (code, _, err) = ckpt(&[
        "data",
        "state",
        "--from-trainer",
        root().join("..").to_str().unwrap(),
        "--len",
        "4",
        "--batch-size",
        "2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("no checkpoint found") || err.contains("not a `Trainer` checkpoint folder"), "{err}");
}
