//! The `Trainer` fixture table: every `checkpoint-N/` folder in `fixtures/trainer/` was written
//! by transformers' real `Trainer` (`fixtures/gen/trainer_fixtures.py`: one process, DDP on 2
//! ranks, gradient accumulation, FSDP2 sharded and full state dict, DeepSpeed ZeRO-2 and ZeRO-3),
//! beside the live model's full state dict (`expected_model.safetensors`) and what the generator
//! recorded (`expected.json`). Each case opens the folder as a whole (step, epoch, ranks, RNG
//! files decoded as data, `training_args.bin` named and not read), merges its model against the
//! reference, and reshards it to 3 and 1 ranks: every `Trainer` file carried, rank r's RNG file
//! from rank r mod N, DeepSpeed's universal checkpoint under DeepSpeed's own names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::path::{Path, PathBuf};

use ckpt::{Checkpoint, WriteOptions};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/trainer")
}

fn manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("expected.json")).unwrap()).unwrap()
}

fn folder(case: &str, m: &Value) -> PathBuf {
    root().join(case).join(m["cases"][case]["checkpoint"].as_str().unwrap())
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn check(case: &str) {
    let m = manifest();
    let want = &m["cases"][case];
    let dir = folder(case, &m);
    let ck = Checkpoint::open(dir.to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "trainer", "{case}");
    let state = ck.save_state().expect("a save_state view");
    let world = want["case"]["world_size"].as_u64().unwrap();
    assert_eq!(state.world_size, world, "{case}");

    let t = state.trainer.as_ref().expect("trainer_state.json read");
    assert_eq!(t.global_step, want["trainer_state"]["global_step"].as_u64().unwrap(), "{case}");
    assert_eq!(t.epoch, want["trainer_state"]["epoch"].as_f64(), "{case}");

    // One RNG file per rank, each with the numpy key decoded and the torch state read.
    assert_eq!(state.rng.iter().map(|r| r.rank).collect::<Vec<_>>(), (0..world).collect::<Vec<_>>(), "{case}");
    for r in &state.rng {
        let np = r.state.numpy.as_ref().expect("numpy state decoded");
        assert_eq!((np.kind.as_str(), np.key.len()), ("MT19937", 624), "{case}");
        for g in ["python", "numpy", "cpu"] {
            assert!(r.state.generators.iter().any(|x| x == g), "{case}: rank {} lacks `{g}`", r.rank);
        }
        assert_eq!(r.state.torch_state_len, Some(5056), "{case}");
    }
    if dir.join("training_args.bin").exists() {
        let args = state.training_args.as_ref().expect("training_args.bin listed");
        assert_eq!(args.refused.as_deref(), Some("transformers.training_args.TrainingArguments"), "{case}");
    }
    assert_eq!(state.models.iter().filter(|m| m.index == 0).count(), 1, "{case}: one model 0");

    // The merged model is the live model's state dict (the tied `lm_head.weight` is left out of
    // `save_pretrained`'s file, as transformers does).
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.safetensors");
    ckpt::merge(&ck, &out, &Default::default(), &WriteOptions::default()).unwrap();
    let (got, _) = common::load(&out);
    let reference = common::reference(&root().join(case).join("expected_model.safetensors"), "");
    for (name, t) in &got {
        assert_eq!(Some(t), reference.get(name), "{case}: `{name}`");
    }
    let missing: Vec<&String> = reference.keys().filter(|k| !got.contains_key(*k)).collect();
    assert!(missing.iter().all(|k| k.as_str() == "lm_head.weight"), "{case}: missing {missing:?}");

    for m in [3u64, 1] {
        let out = tmp.path().join(format!("w{m}"));
        ckpt::reshard(&ck, &out, m, &WriteOptions::default()).unwrap();
        let have = names(&out);
        for f in ["trainer_state.json", "scheduler.pt", "training_args.bin", "config.json"] {
            assert_eq!(have.contains(&f.to_string()), dir.join(f).exists(), "{case} on {m}: `{f}` carried");
        }
        assert!(
            std::fs::read(out.join("trainer_state.json")).unwrap()
                == std::fs::read(dir.join("trainer_state.json")).unwrap()
        );
        // Rank r continues rank r mod N's generators, under the `Trainer`'s names.
        for r in 0..m {
            let name = if m > 1 { format!("rng_state_{r}.pth") } else { "rng_state.pth".into() };
            let src = &state.rng[(r % world) as usize].path;
            assert!(std::fs::read(out.join(&name)).unwrap() == std::fs::read(src).unwrap(), "{case} on {m}: `{name}`");
        }
        let tag = dir.join("latest");
        if tag.exists() {
            let tag = std::fs::read_to_string(tag).unwrap();
            let universal = format!("{}_universal", tag.trim());
            assert!(out.join(&universal).is_dir(), "{case} on {m}: `{universal}/`");
            assert_eq!(std::fs::read_to_string(out.join("latest_universal")).unwrap(), universal);
            assert!(
                !out.join(tag.trim()).exists() && !out.join("latest").exists(),
                "{case}: the old tag is not carried"
            );
        }
        let again = Checkpoint::open(out.to_str().unwrap()).unwrap();
        let s = again.save_state().unwrap();
        assert_eq!((s.world_size, s.rng.len() as u64), (m, m), "{case} on {m}");
        assert_eq!(s.trainer.as_ref().map(|t| t.global_step), Some(t.global_step));
    }
}

#[test]
fn single() {
    check("single");
}

#[test]
fn ddp_w2() {
    check("ddp_w2");
}

#[test]
fn grad_accum() {
    check("grad_accum");
}

#[test]
fn fsdp2_sharded_w2() {
    check("fsdp2_sharded_w2");
}

#[test]
fn fsdp2_full_w2() {
    check("fsdp2_full_w2");
}

#[test]
fn zero2_w2() {
    check("zero2_w2");
}

#[test]
fn zero3_w2() {
    check("zero3_w2");
}

/// The data position: where the real `Trainer` resumed (the first batch it trained on, recorded
/// by the generator) is where `resume_point` says, on every case.
#[test]
fn resume_points_match_the_trainers_rule() {
    let m = manifest();
    for (case, want) in m["cases"].as_object().unwrap() {
        let ck = Checkpoint::open(folder(case, &m).to_str().unwrap()).unwrap();
        let t = ck.save_state().unwrap().trainer.clone().unwrap();
        let pos = &want["data_position"];
        let ga = want["case"]["grad_accum"].as_u64().unwrap_or(1);
        let point = t.resume_point(pos["batches_per_epoch_per_rank"].as_u64().unwrap(), ga).unwrap();
        assert_eq!(point.epoch, pos["epochs_trained"].as_u64().unwrap(), "{case}");
        assert_eq!(point.batches, pos["batches_skipped_in_current_epoch"].as_u64().unwrap(), "{case}");
    }
}

/// What `Trainer.save_model` leaves at the end of a run (the model, its config and
/// `training_args.bin`) is a model, not a `Trainer` checkpoint.
#[test]
fn a_final_save_model_folder_is_just_a_model() {
    let m = manifest();
    let src = folder("single", &m);
    let tmp = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "config.json", "training_args.bin"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let ck = Checkpoint::open(tmp.path().to_str().unwrap()).unwrap();
    assert_eq!(ck.format().name(), "safetensors");
}

/// Every case of the manifest has a test above.
#[test]
fn every_case_is_covered() {
    let m = manifest();
    let mut cases: Vec<&String> = m["cases"].as_object().unwrap().keys().collect();
    cases.sort();
    assert_eq!(cases, ["ddp_w2", "fsdp2_full_w2", "fsdp2_sharded_w2", "grad_accum", "single", "zero2_w2", "zero3_w2"]);
}
