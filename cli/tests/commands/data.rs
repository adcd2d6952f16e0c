//! `ckpt data plan` / `ckpt data state`, end to end through the binary.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use dataload::{DataLoaderConfiguration, ShardedSampler};
use serde_json::{json, Value};

fn ckpt(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ckpt")).args(args).output().unwrap();
    (out.status.code().unwrap(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn plan_json_reproduces_accelerate_test_vectors() {
    // accelerate tests/test_data_loader.py, test_batch_sampler_shards_with_no_splits, n=22, bs=3.
    let (code, out, err) = ckpt(&["data", "plan", "--len", "22", "--batch-size", "3", "--world-size", "2", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        json!({"ranks": [
            {"rank": 0, "batches": [[0,1,2],[6,7,8],[12,13,14],[18,19,20]]},
            {"rank": 1, "batches": [[3,4,5],[9,10,11],[15,16,17],[21,0,1]]}
        ]})
    );
    // …_with_splits_no_even, n=21, bs=4, rank 0 only.
    let (code, out, _) = ckpt(&[
        "data",
        "plan",
        "--len",
        "21",
        "--batch-size",
        "4",
        "--world-size",
        "2",
        "--split-batches",
        "--no-even-batches",
        "--rank",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v, json!({"ranks": [{"rank": 0, "batches": [[0,1],[4,5],[8,9],[12,13],[16,17],[20]]}]}));
    // test_skip_first_batches: range(16), bs 4, skip 2.
    let (_, out, _) = ckpt(&[
        "data",
        "plan",
        "--len",
        "16",
        "--batch-size",
        "4",
        "--world-size",
        "1",
        "--skip-batches",
        "2",
        "--json",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ranks"][0]["batches"], json!([[8, 9, 10, 11], [12, 13, 14, 15]]));
}

#[test]
fn plan_text_and_shuffle_agree_with_the_library() {
    let (code, out, _) = ckpt(&[
        "data",
        "plan",
        "--len",
        "10",
        "--batch-size",
        "2",
        "--world-size",
        "2",
        "--shuffle",
        "--seed",
        "42",
        "--epoch",
        "1",
    ]);
    assert_eq!(code, 0);
    let mut l = ShardedSampler::builder()
        .dataset_len(10)
        .batch_size(2)
        .world_size(2)
        .rank(1)
        .shuffle(true)
        .config(DataLoaderConfiguration { use_seedable_sampler: true, data_seed: Some(42), ..Default::default() })
        .build()
        .unwrap();
    l.set_epoch(1);
    let rank1 = l.rest_of_epoch().unwrap();
    assert!(out.starts_with("rank 0: 3 batches\n"), "{out}");
    let tail: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("rank 1")).skip(1).collect();
    let want: Vec<String> =
        rank1.iter().map(|b| format!("  [{}]", b.iter().map(u64::to_string).collect::<Vec<_>>().join(", "))).collect();
    assert_eq!(tail, want);
}

#[test]
fn plan_refusals_exit_2_with_a_message() {
    let (code, out, err) =
        ckpt(&["data", "plan", "--len", "10", "--batch-size", "3", "--world-size", "2", "--split-batches"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert_eq!(
        err.trim(),
        "error: `split_batches` needs the batch size (3) to be a round multiple of the number of processes (2)"
    );
    let (code, _, _) = ckpt(&["data", "plan", "--len", "10", "--batch-size", "2", "--world-size", "2", "--shuffle"]);
    assert_eq!(code, 2, "--shuffle without --seed is a usage error");
}

#[test]
fn state_explains_position_and_next_batches() {
    let dir = tempfile::tempdir().unwrap();
    let config = DataLoaderConfiguration { use_seedable_sampler: true, data_seed: Some(7), ..Default::default() };
    let build = |rank| {
        ShardedSampler::builder()
            .dataset_len(50)
            .batch_size(4)
            .world_size(3)
            .rank(rank)
            .shuffle(true)
            .config(config)
            .fingerprint("demo")
            .build()
            .unwrap()
    };
    let mut l = build(0);
    l.set_epoch(2);
    l.next_batch().unwrap();
    l.next_batch().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, l.state_dict().to_json().unwrap()).unwrap();

    let (code, out, err) = ckpt(&["data", "state", path.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["epoch"], 2);
    assert_eq!(v["cursor"], 24);
    assert_eq!(v["steps_done"], 2);
    for rank in 0..3u64 {
        let mut expect = build(rank);
        expect.set_epoch(2);
        expect.next_batch().unwrap();
        expect.next_batch().unwrap();
        let next = expect.next_batch().unwrap().unwrap();
        assert_eq!(v["ranks"][rank as usize]["next_batch"], json!(next));
    }

    let (code, out, _) = ckpt(&["data", "state", path.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.starts_with("epoch 2: 24 of 50 samples consumed"), "{out}");

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"format\": \"statekit.dataload\", \"version\": 9}").unwrap();
    let (code, _, err) = ckpt(&["data", "state", bad.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("unsupported loader state version 9 (this build reads version 1)"), "{err}");
}

#[test]
fn state_explains_a_mixture_at_a_cursor() {
    let tmp = tempfile::tempdir().unwrap();
    let mix = tmp.path().join("mix.json");
    let spec = r#"{"sizes": [1000, 200, 5000], "weights": [0.6, 0.3, 0.1], "seed": 3, "once": [1], "length": 4000}"#;
    std::fs::write(&mix, spec).unwrap();
    let m = dataload::Mixture::new(serde_json::from_str(spec).unwrap()).unwrap();
    let args = ["data", "state", "--mixture", mix.to_str().unwrap(), "--cursor", "1234", "--batch-size", "4"];
    let (code, out, err) = ckpt(&[&args[..], &["--world-size", "3", "--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let doc: Value = serde_json::from_str(&out).unwrap();
    let positions: Vec<u64> =
        doc["mixture"]["positions"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(positions, m.positions(1234).unwrap());
    assert_eq!(positions[1], 200, "the source read once is used up by then");
    for (r, rank) in doc["ranks"].as_array().unwrap().iter().enumerate() {
        let next: Vec<u64> = rank["next_batch"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(next, (1234 + 4 * r as u64..1238 + 4 * r as u64).collect::<Vec<_>>());
        let samples: Vec<(usize, u64)> = serde_json::from_value(rank["next_samples"].clone()).unwrap();
        assert_eq!(samples, m.locate_many(&next).unwrap(), "rank {r}");
    }
    // The text form says the same, source by source.
    let (_, text, _) = ckpt(&[&args[..], &["--world-size", "2"]].concat());
    assert!(text.contains(&format!("source 0: {}, source 1: 200", positions[0])), "{text}");
    assert!(text.lines().any(|l| l.starts_with("rank 1: next [")), "{text}");
    // Past the end: refused by name.
    let (code, _, err) =
        ckpt(&["data", "state", "--mixture", mix.to_str().unwrap(), "--cursor", "4001", "--batch-size", "4"]);
    assert_eq!(code, 2);
    assert!(err.contains("`--cursor 4001` is past the end"), "{err}");
}

#[test]
fn state_refuses_loader_flags_beside_a_state_file() {
    // A state FILE holds its own loader: a flag describing another one would be ignored.
    let dir = tempfile::tempdir().unwrap();
    let l = ShardedSampler::builder().dataset_len(10).batch_size(2).world_size(1).rank(0).build().unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, l.state_dict().to_json().unwrap()).unwrap();
    let (code, out, err) = ckpt(&["data", "state", path.to_str().unwrap(), "--drop-last", "--split-batches"]);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    assert_eq!(
        err,
        "error: `--split-batches`, `--drop-last` describe the loader of `--from-accelerate`, `--from-trainer` or \
         `--mixture`; a state FILE holds its own\n"
    );
}

#[test]
fn state_reads_user_files_with_a_cap() {
    let dir = tempfile::tempdir().unwrap();
    // Sparse: over the cap by its length alone, refused before a byte is read.
    let big = dir.path().join("big.json");
    std::fs::File::create(&big).unwrap().set_len((64 << 20) + 1).unwrap();
    let (code, _, err) = ckpt(&["data", "state", big.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert_eq!(
        err,
        format!("error: {}: record `the whole file` is 67108865 bytes, over the 67108864-byte limit\n", big.display())
    );
    let (code, _, err) = ckpt(&["data", "state", "--mixture", big.to_str().unwrap(), "--batch-size", "4"]);
    assert_eq!(code, 2);
    assert!(err.contains("over the 67108864-byte limit"), "{err}");
    // A device given by mistake is refused by name, not read without end.
    let (code, _, err) = ckpt(&["data", "state", "/dev/zero"]);
    assert_eq!(code, 2);
    assert!(err.contains("/dev/zero: is a device, not a regular file"), "{err}");
}
