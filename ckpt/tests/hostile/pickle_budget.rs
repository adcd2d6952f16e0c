//! Files of a few kilobytes whose pickle, read naively, needs gigabytes (`fixtures/hostile/
//! pickle_budget/`, written by `fixtures/gen/hostile_pickle_budget.py`): one per attack, each
//! refused with its exact message, through the catalog reader, `convert` and `verify`.
//!
//! The unpickler has one memory budget, 64 bytes per byte of pickle plus 16 MiB, at most 1 GiB,
//! and the walks over its objects charge what they build to it, as allocated (the pickle itself,
//! buffers by capacity and allocator chunk, hash tables, each value's JSON and each tensor's
//! catalog entry). The same files are read by the `ckpt` binary under an address-space limit in
//! `cli/tests/hostile/memory.rs`, which checks that its peak RSS stays within the budget.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

fn hostile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/pickle_budget").join(name)
}

/// `file` is what the message names (the case itself, or a file in its folder); `reason`
/// follows it.
fn refused(name: &str, file: &str, reason: &str) {
    let path = hostile(name);
    let src = path.to_str().unwrap();
    let named = if file.is_empty() { path.clone() } else { path.join(file) };
    let expected = format!("{}{reason}", named.display());
    let start = Instant::now();
    let err = ckpt::Checkpoint::open(src).unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert!(err.is_invalid_data(), "{name}: verify should report it as a problem");

    let report = ckpt::verify(src).unwrap();
    assert_eq!(report.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), vec![expected.clone()]);

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let err = ckpt::Checkpoint::open(src)
        .and_then(|ck| ckpt::convert(&ck, &out, &ckpt::ConvertOptions::default(), &ckpt::WriteOptions::default()))
        .unwrap_err();
    assert_eq!(err.to_string(), expected);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{name}: no output left behind");
    // Three reads; a 256 MiB pickle takes seconds each in a debug build.
    assert!(start.elapsed() < Duration::from_secs(60), "{name}: refusal took {:?}", start.elapsed());
}

#[test]
fn memo_reuse_of_one_big_bytes_object() {
    // 1 MiB of bytes fetched from the memo 100 000 times: the arena holds it once, and the
    // leaves built from it are charged per copy (100 GiB) until the budget runs out.
    refused(
        "memo_bytes_reuse.pt",
        "",
        ": memory budget exceeded: the objects and values of 1548598 bytes of pickle need more than 115903872 bytes",
    );
}

#[test]
fn billion_laughs_through_nested_dicts() {
    // 10^30 dotted names if expanded; the names and leaves are charged as they are built.
    refused(
        "dict_laughs.pt",
        "",
        ": memory budget exceeded: the objects and values of 3557 bytes of pickle need more than 17021248 bytes",
    );
}

#[test]
fn declared_lengths_beyond_the_pickle() {
    refused(
        "declared_unicode.pt",
        "",
        ": `archive/data.pkl` at byte 9: declared length 4294967280 runs past the end of the pickle",
    );
    refused(
        "declared_bytes8.pt",
        "",
        ": `archive/data.pkl` at byte 9: declared length 4611686018427387904 runs past the end of the pickle",
    );
}

#[test]
fn arena_flood_of_empty_lists() {
    // 4 million one-byte EMPTY_LIST opcodes: the arena doubles to 2^21 slots within the
    // 272 MB budget of a 4 MB pickle, and the next doubling is refused.
    refused(
        "arena_flood.pt",
        "",
        ": `archive/data.pkl` at byte 2097154: memory budget exceeded: the objects and values of 4000003 bytes of \
         pickle need more than 272793792 bytes",
    );
}

#[test]
fn dcp_metadata_path_shared_by_every_key() {
    // 1024 `planner_data` keys naming one memoized path of 4096 references to a 4 KiB string.
    refused(
        "dcp_shared_path",
        ".metadata",
        ": DCP metadata: memory budget exceeded: the objects and values of 38953 bytes of pickle need more than \
         19286592 bytes",
    );
}

#[test]
fn dcp_bytes_items_that_all_name_one_item() {
    // 256 bytes items on the same 3 MB value: each within one pickle's budget, together not,
    // since the items of one checkpoint share one budget.
    refused(
        "dcp_shared_item",
        "__0_0.distcp",
        " (rank 0): tensor `v1`: non-tensor item at byte 0: memory budget exceeded: the objects and values of 23500 \
         bytes of pickle need more than 18313984 bytes",
    );
}

#[test]
fn torch_shards_each_within_budget_but_not_together() {
    // 64 shards of one tensor and a 3 MB value each: the shards of one checkpoint share one
    // budget, so the second shard's value runs out of it.
    refused(
        "sharded_values",
        "pytorch_model-00002-of-00064.bin",
        ": memory budget exceeded: the objects and values of 23780 bytes of pickle need more than 18331904 bytes",
    );
}

#[test]
fn save_state_value_files_each_within_budget_but_not_together() {
    // A real accelerate folder with 64 custom objects of a 3 MB value each: a folder's value
    // files (RNG, schedulers, scaler, data position, custom objects) share one budget, so the
    // second object runs out of it instead of the folder holding 640 MB.
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("state");
    std::fs::create_dir(&folder).unwrap();
    let real = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/accelerate/one_model");
    for src in [real, hostile("save_state_values")] {
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), folder.join(e.file_name())).unwrap();
        }
    }
    let err = ckpt::Checkpoint::open(folder.to_str().unwrap()).unwrap_err().to_string();
    let named = folder.join("custom_checkpoint_1.pkl");
    assert!(err.starts_with(&format!("{}: ", named.display())) && err.contains("memory budget exceeded"), "{err}");
    let report = ckpt::verify(folder.to_str().unwrap()).unwrap();
    assert!(report.problems.iter().any(|p| p.to_string() == err), "{:?}", report.problems);
}

#[test]
fn memo_bomb_of_one_string_in_a_list() {
    // 8 million fetches of one 24-byte string, a 16 MB pickle in a 16 KB file: accepted at 1.1
    // to 2.1 GB before its values were charged for their JSON and the allocator's chunks.
    refused(
        "memo_bomb.pt",
        "",
        ": memory budget exceeded: the objects and values of 16000046 bytes of pickle need more than 1040796544 bytes",
    );
}

#[test]
fn arena_bomb_of_the_longest_pickle() {
    // 256 MiB of EMPTY_LIST in a 255 KB file: the inflated pickle is charged, so the arena's
    // next doubling is refused within the 1 GiB cap (it was refused at 1.3 GB).
    refused(
        "arena_bomb.pt",
        "",
        ": `archive/data.pkl` at byte 4194306: memory budget exceeded: the objects and values of 268435456 bytes of \
         pickle need more than 1073741824 bytes",
    );
}

#[test]
fn short_strings_charged_as_allocated() {
    // 89 million one-character strings: each a 32-byte chunk, once charged as one byte.
    refused(
        "short_strings.pt",
        "",
        ": `archive/data.pkl` at byte 12582914: memory budget exceeded: the objects and values of 268435455 bytes of \
         pickle need more than 1073741824 bytes",
    );
}

#[test]
fn tensor_names_on_one_memoized_tensor() {
    // 250 000 names on one tensor: each entry charged for what the catalog holds of it (the
    // catalog and `inspect --json` took 1.7 GB before).
    refused(
        "tensor_names.pt",
        "",
        ": memory budget exceeded: the objects and values of 2389025 bytes of pickle need more than 169691200 bytes",
    );
}
