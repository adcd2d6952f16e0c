//! Whole `accelerator.save_state` folders (format `accelerate-state`), written by real
//! accelerate 1.15 (`fixtures/gen/accelerate_state_fixtures.py`): what the folder holds, read
//! as data and compared with what `torch.load` gave the generator (`expected.json`), merging
//! any model of it, and the half-saved folders that `verify` reports and `merge`/`reshard`
//! refuse, one test per defect, each built at test time from a real folder.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use ckpt::accelerate::OptimizerState;
use ckpt::{Checkpoint, Format, MergeOptions, WriteOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/accelerate")
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("expected.json")).unwrap()).unwrap()
}

fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open(dir.to_str().unwrap()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Every folder the generator wrote, and the files it recorded for it.
fn folders() -> Vec<(String, serde_json::Map<String, serde_json::Value>)> {
    let all = expected();
    let mut out: Vec<_> = all
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "versions")
        .map(|(k, v)| (k.clone(), v.as_object().unwrap().clone()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 5, "the generator wrote five folders");
    out
}

#[test]
fn every_folder_opens_as_accelerate_state_with_each_component_listed() {
    for (name, files) in folders() {
        let dir = root().join(&name);
        let ck = open(&dir);
        assert_eq!(ck.format(), Format::AccelerateState, "{name}");
        let s = ck.save_state().expect("a save_state folder");
        let count = |pred: &dyn Fn(&str) -> bool| files.keys().filter(|f| pred(f)).count();
        let is_model = |f: &str| f.starts_with("model") || f.starts_with("pytorch_model");
        assert_eq!(s.models.len(), count(&is_model), "{name}: models");
        assert_eq!(s.optimizers.len(), count(&|f| f.starts_with("optimizer")), "{name}: optimizers");
        assert_eq!(s.schedulers.len(), count(&|f| f.starts_with("scheduler")), "{name}: schedulers");
        assert_eq!(s.custom.len(), count(&|f| f.starts_with("custom_checkpoint_")), "{name}: custom objects");
        assert_eq!(s.data.len(), count(&|f| f.starts_with("dl_state_dict") || f.starts_with("sampler")), "{name}");
        assert_eq!(s.rng.len(), count(&|f| f.starts_with("random_states_")), "{name}: rng files");
        assert_eq!(s.world_size, s.rng.len() as u64, "{name}: one process saved it");
        // The folder's own tensors are its first model's.
        let first = &s.models[0].checkpoint;
        assert_eq!(ck.tensors().len(), first.tensors().len(), "{name}");
        // Every file of the folder is protected from being written by an operation.
        for f in files.keys() {
            assert!(ck.members().contains(&dir.join(f)), "{name}: {f} is a member");
        }
    }
}

#[test]
fn component_values_are_what_torch_load_gives() {
    for (name, files) in folders() {
        let ck = open(&root().join(&name));
        let s = ck.save_state().unwrap();
        for r in &s.rng {
            let file = r.path.file_name().unwrap().to_str().unwrap();
            let want = &files[file]["rng"];
            assert_eq!(serde_json::json!(r.state.step), want["step"], "{name}/{file}");
            let generators: Vec<&serde_json::Value> =
                want["generators"].as_array().unwrap().iter().filter(|g| *g != "step").collect();
            assert_eq!(serde_json::json!(r.state.generators), serde_json::json!(generators), "{name}/{file}");
        }
        for c in s.schedulers.iter().chain(&s.custom).chain(s.data.iter().map(|(c, _)| c)) {
            let file = c.path.file_name().unwrap().to_str().unwrap();
            let want = files[file]["values"].as_object().unwrap();
            assert!(c.refused.is_none(), "{name}/{file}");
            for (k, v) in want {
                // The generator flattens lists into `name.i`; we keep a list whole.
                let (base, idx) = match k.rsplit_once('.') {
                    Some((b, i)) if i.parse::<usize>().is_ok() => (b, Some(i.parse::<usize>().unwrap())),
                    _ => (k.as_str(), None),
                };
                let got = c.values.iter().find(|(n, _)| n == k || n == base).map(|(_, v)| v).unwrap();
                let got = match idx {
                    Some(i) if got.is_array() => &got[i],
                    _ => got,
                };
                assert_eq!(got, v, "{name}/{file}: {k}");
            }
            for (t, _) in files[file]["tensors"].as_object().unwrap() {
                assert!(c.values.iter().any(|(n, _)| n == t), "{name}/{file}: tensor {t} listed");
            }
        }
        for o in &s.optimizers {
            let file = o.path.file_name().unwrap().to_str().unwrap();
            let want = &files[file];
            assert_eq!(o.state_tensors, want["tensors"].as_object().unwrap().len(), "{name}/{file}");
            let groups = want["values"].as_object().unwrap().keys().filter(|k| k.ends_with(".lr")).count();
            assert_eq!(o.param_groups, groups, "{name}/{file}");
            assert!(matches!(o.state, OptimizerState::Own(_)));
        }
    }
}

#[test]
fn the_stateful_loader_position_is_read_from_dl_state_dict() {
    let ck = open(&root().join("stateful"));
    let s = ck.save_state().unwrap();
    let want = &expected()["stateful"]["dl_state_dict.bin"]["values"];
    let p = s.data_position(0).expect("a position");
    assert_eq!(p.kind, "dl_state_dict");
    assert_eq!(serde_json::json!(p.batches_yielded), want["_num_yielded"]);
    assert_eq!(serde_json::json!(p.finished), want["_iterator_finished"]);
    assert_eq!(p.num_workers, Some(0));
    assert!(
        open(&root().join("one_model")).save_state().unwrap().data_position(0).is_none(),
        "map-style, not stateful"
    );
}

#[test]
fn merge_of_model_n_is_that_model_bit_for_bit() {
    let dir = root().join("two_models");
    let ck = open(&dir);
    let tmp = tempfile::tempdir().unwrap();
    for (n, file) in [(0, "model.safetensors"), (1, "model_1.safetensors")] {
        let out = tmp.path().join(format!("m{n}.safetensors"));
        let opts = MergeOptions { model: Some(n), ..Default::default() };
        ckpt::merge(&ck, &out, &opts, &WriteOptions::default()).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(dir.join(file)).unwrap(), "model {n}");
    }
    let err = ckpt::merge(
        &ck,
        &tmp.path().join("x.safetensors"),
        &MergeOptions { model: Some(2), ..Default::default() },
        &WriteOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("has no model 2") && err.contains("models: 0, 1"), "{err}");
}

#[test]
fn merge_with_the_optimizer_writes_its_state_beside_the_model() {
    let dir = root().join("bin");
    let ck = open(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.safetensors");
    let done =
        ckpt::merge(&ck, &out, &MergeOptions { optimizer: true, ..Default::default() }, &WriteOptions::default())
            .unwrap();
    let optim = tmp.path().join(ckpt::OPTIMIZER_NAME);
    assert!(done.files.contains(&optim));
    let merged = open(&optim);
    let source = open(&dir.join("optimizer.bin"));
    assert_eq!(merged.tensors().len(), source.tensors().len());
    for t in source.tensors() {
        let m = merged.tensors().iter().find(|x| x.name == t.name).unwrap();
        assert_eq!(merged.read_tensor(m).unwrap(), source.read_tensor(t).unwrap(), "{}", t.name);
    }
    let model = open(&out);
    let bin = open(&dir.join("pytorch_model.bin"));
    for t in bin.tensors() {
        let m = model.tensors().iter().find(|x| x.name == t.name).unwrap();
        assert_eq!(model.read_tensor(m).unwrap(), bin.read_tensor(t).unwrap(), "{}", t.name);
    }
}

#[test]
fn a_whole_folder_reshards_with_every_file_carried_over() {
    let dir = root().join("stateful");
    let ck = open(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("w3");
    ckpt::reshard(&ck, &out, 3, &WriteOptions::default()).unwrap();
    let re = open(&out);
    let s = re.save_state().unwrap();
    assert_eq!(s.rng.len(), 3, "one RNG file per new rank");
    for r in &s.rng {
        // Rank r takes the source's rank r mod 1.
        assert_eq!(std::fs::read(&r.path).unwrap(), std::fs::read(dir.join("random_states_0.pkl")).unwrap());
    }
    for f in ["model.safetensors", "optimizer.bin"] {
        assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(dir.join(f)).unwrap(), "{f} copied");
    }
    // 1 rank had read k batches; on 3 ranks that is ⌊k/3⌋ each.
    let k = ck.save_state().unwrap().data_position(0).unwrap().batches_yielded.unwrap();
    let p = s.data_position(0).unwrap();
    assert_eq!(p.batches_yielded, Some(k / 3));
    let c = &s.data[0].0;
    let get = |n: &str| c.values.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap();
    assert_eq!(get("_sampler_iter_yielded"), serde_json::json!(k / 3));
    assert_eq!(get("_iterator_finished"), serde_json::json!(false));
    assert!(ckpt::reshard(&ck, &out, 3, &WriteOptions::default()).is_err(), "an existing output is refused");
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary folder left: {leftovers:?}");
}

#[test]
fn an_fsdp2_folder_merges_as_accelerate_merge_weights_does() {
    let case = root().join("../dcp/accelerate_w2_f32");
    let ck = open(&case.join("checkpoint"));
    assert_eq!(ck.save_state().unwrap().world_size, 2);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model.safetensors");
    ckpt::merge(&ck, &out, &MergeOptions { optimizer: true, ..Default::default() }, &WriteOptions::default()).unwrap();
    let theirs = case.join("accelerate_merge/model.safetensors");
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(theirs).unwrap(), "byte for byte");
    let optim = open(&tmp.path().join(ckpt::OPTIMIZER_NAME));
    let want = open(&case.join("expected_optim.safetensors"));
    assert_eq!(optim.tensors().len(), want.tensors().len());
    for t in want.tensors() {
        let o = optim.tensors().iter().find(|x| x.name == t.name).unwrap();
        assert_eq!(optim.read_tensor(o).unwrap(), want.read_tensor(t).unwrap(), "{}", t.name);
    }
}

/// A copy of fixture folder `name` to damage.
fn copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(name);
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(root().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    (tmp, dst)
}

/// The folder's problems as `verify` reports them, and what `merge` and `reshard` say.
fn refusals(dir: &Path) -> (Vec<String>, String) {
    let report = ckpt::verify(dir.to_str().unwrap()).unwrap();
    assert_eq!(report.format, Some(Format::AccelerateState));
    let problems = report.problems.iter().map(ToString::to_string).collect();
    // Opening, which `merge` and `reshard` start with, stops at the first problem.
    let refused = Checkpoint::open(dir.to_str().unwrap()).unwrap_err().to_string();
    (problems, refused)
}

#[test]
fn hostile_a_missing_rank_file_is_reported_with_its_rank() {
    let (_t, dir) = copy("one_model");
    std::fs::rename(dir.join("random_states_0.pkl"), dir.join("random_states_1.pkl")).unwrap();
    let (problems, merge) = refusals(&dir);
    assert!(problems.iter().any(|p| p.contains("random_states_0.pkl") && p.contains("rank 0")), "{problems:?}");
    assert!(merge.contains("random_states_0.pkl") && !merge.contains('\n'), "{merge}");
}

#[test]
fn hostile_an_optimizer_of_another_model_is_reported() {
    let (_t, dir) = copy("one_model");
    // Another model's weights (the DCP fixtures' model, whose shapes differ) beside this
    // model's optimizer.
    let other = root().join("../dcp/accelerate_w2_f32/expected_model.safetensors");
    std::fs::copy(other, dir.join("model.safetensors")).unwrap();
    let (problems, merge) = refusals(&dir);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("optimizer.bin") && p.contains("does not match") && p.contains("model.safetensors")),
        "{problems:?}"
    );
    assert!(merge.contains("optimizer.bin"), "{merge}");
}

#[test]
fn hostile_rng_files_of_another_world_size_are_reported() {
    let (_t, dir) = copy("one_model");
    // A second RNG file in a folder whose sharded model says one rank: here no model is
    // sharded, so the RNG files set the world, and a gap (ranks 0 and 2) is the defect.
    std::fs::copy(dir.join("random_states_0.pkl"), dir.join("random_states_2.pkl")).unwrap();
    let (problems, _) = refusals(&dir);
    assert!(problems.iter().any(|p| p.contains("random_states_1.pkl") && p.contains("rank 1")), "{problems:?}");
}

#[test]
fn hostile_a_custom_object_naming_a_foreign_class_is_reported_by_name_and_never_run() {
    let (_t, dir) = copy("custom");
    std::fs::copy(root().join("../hostile/accelerate/system.pkl"), dir.join("custom_checkpoint_0.pkl")).unwrap();
    let ck = open(&dir);
    let s = ck.save_state().unwrap();
    let refused = s.custom[0].refused.as_deref().unwrap();
    assert!(refused.contains("system"), "{refused}");
    assert!(s.custom[0].values.is_empty(), "no value read from a refused pickle");
    // The model does not need the object's value: it still merges.
    let tmp = tempfile::tempdir().unwrap();
    ckpt::merge(&ck, &tmp.path().join("m.safetensors"), &MergeOptions::default(), &WriteOptions::default()).unwrap();
}

fn expected_more() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("expected_more.json")).unwrap()).unwrap()
}

fn sha(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn deepspeed_models_merge_as_zero_to_fp32_does_for_each_tag() {
    let all = expected_more();
    let cases = [
        ("ds_z2_w2", 0, "pytorch_model"),
        ("ds_z3_w2", 0, "pytorch_model"),
        ("ds_two_models_w2", 0, "pytorch_model"),
        ("ds_two_models_w2", 1, "pytorch_model_1"),
    ];
    for (case, n, tag) in cases {
        let ck = open(&root().join(case));
        let s = ck.save_state().unwrap();
        assert_eq!(s.world_size, 2, "{case}");
        assert!(matches!(s.optimizer(n).unwrap().state, OptimizerState::InModel), "{case}");
        let want = &all[case]["zero_to_fp32"][tag];
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("m.safetensors");
        let opts = MergeOptions { model: Some(n), optimizer: true, ..Default::default() };
        ckpt::merge(&ck, &out, &opts, &WriteOptions::default()).unwrap();
        let merged = open(&out);
        let names: Vec<&str> = merged.tensors().iter().map(|t| t.name.as_str()).collect();
        let order: Vec<&str> = want["key_order"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted, "{case} {tag}: the tensors zero_to_fp32 writes");
        for t in merged.tensors() {
            let e = &want["tensors"][&t.name];
            assert_eq!(serde_json::json!(t.shape), e["shape"], "{case} {tag}: {}", t.name);
            assert_eq!(sha(&merged.read_tensor(t).unwrap()), e["sha256"], "{case} {tag}: {}", t.name);
        }
        let moments = open(&tmp.path().join(ckpt::OPTIMIZER_NAME));
        assert_eq!(moments.tensors().len(), 2 * order.len(), "{case} {tag}: exp_avg and exp_avg_sq per param");
    }
}

#[test]
fn a_pickled_seedable_sampler_gives_epoch_and_seed_as_data() {
    let want = &expected_more()["sampler"]["sampler"];
    let ck = open(&root().join("sampler"));
    let s = ck.save_state().unwrap();
    let p = s.data_position(0).unwrap();
    assert_eq!(p.kind, "sampler");
    assert_eq!(serde_json::json!(p.epoch), want["epoch"]);
    assert_eq!(serde_json::json!(p.seed), want["initial_seed"]);
    let c = &s.data[0].0;
    assert!(c.classes.iter().any(|k| k == "accelerate.data_loader.SeedableRandomSampler"), "{:?}", c.classes);
    assert!(c.classes.iter().any(|k| k == "torch._C.Generator"), "{:?}", c.classes);
    // The generator's 5056-byte state is a tensor of the sampler's state.
    // `torch.Generator.__setstate__` takes (seed, offset, state): the 5056-byte state is a
    // tensor among the sampler's values.
    let g = c
        .values
        .iter()
        .find(|(k, _)| k.starts_with("state.generator.state.") && k.ends_with(".2"))
        .map(|(_, v)| v)
        .unwrap();
    assert_eq!(g["shape"], serde_json::json!([want["generator_state"]["len"]]));
}

#[test]
fn a_grad_scaler_state_is_listed_with_its_values() {
    let want = expected_more()["scaler"]["state"].clone();
    let ck = open(&root().join("scaler"));
    let c = ck.save_state().unwrap().scaler.clone().unwrap();
    assert!(c.refused.is_none());
    for (k, v) in want.as_object().unwrap() {
        let got = c.values.iter().find(|(n, _)| n == k).map(|(_, v)| v).unwrap();
        assert_eq!(got, v, "{k}");
    }
}

#[test]
fn a_deepspeed_folder_reshards_to_universal_under_the_tags_accelerate_loads() {
    let ck = open(&root().join("ds_two_models_w2"));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("w3");
    ckpt::reshard(&ck, &out, 3, &WriteOptions::default()).unwrap();
    assert_eq!(std::fs::read_to_string(out.join("latest")).unwrap(), "pytorch_model_1");
    for tag in ["pytorch_model", "pytorch_model_1"] {
        assert!(out.join(tag).join("zero").join("optimizer_state.pt").is_file(), "{tag}: universal layout");
    }
    assert_eq!(
        std::fs::read_dir(&out)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("random_states_"))
            .count(),
        3
    );
    assert!(!out.join(".universal_0").exists() && !out.join("latest_universal").exists());
}

#[test]
fn fsdp2_folders_merge_as_accelerate_merge_weights_and_keep_the_saved_buffers() {
    let all: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("expected_fsdp2.json")).unwrap()).unwrap();
    for case in ["fsdp2_w2", "fsdp2_w3"] {
        let want = &all[case];
        let ck = open(&root().join(case));
        assert_eq!(serde_json::json!(ck.save_state().unwrap().world_size), want["world_size"], "{case}");
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("model.safetensors");
        ckpt::merge(&ck, &out, &MergeOptions { optimizer: true, ..Default::default() }, &WriteOptions::default())
            .unwrap();
        for (file, theirs) in [
            (out.clone(), &want["merge_model"]["tensors"]),
            (tmp.path().join(ckpt::OPTIMIZER_NAME), &want["merge_optimizer_unsafe"]["tensors"]),
        ] {
            let merged = open(&file);
            let theirs = theirs.as_object().unwrap();
            assert_eq!(merged.tensors().len(), theirs.len(), "{case}: {}", file.display());
            for t in merged.tensors() {
                let e = &theirs[&t.name];
                assert_eq!(serde_json::json!(t.shape), e["shape"], "{case}: {}", t.name);
                assert_eq!(sha(&merged.read_tensor(t).unwrap()), e["sha256"], "{case}: {}", t.name);
            }
        }
        // The BatchNorm statistics differ per rank; the merge has the copy DCP kept.
        let merged = open(&out);
        for (name, b) in want["buffers"].as_object().unwrap() {
            let t = merged.tensors().iter().find(|t| &t.name == name).unwrap();
            let got = sha(&merged.read_tensor(t).unwrap());
            let kept = b["checkpoint_equals_rank"][0].as_u64().unwrap() as usize;
            assert_eq!(got, b["per_rank_sha256"][kept], "{case}: {name}");
        }
    }
}
