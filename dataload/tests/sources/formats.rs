//! One test per fixture format: what the Rust sources read equals what numpy, pyarrow and
//! json read from the same files (fixtures/gen/dataload_sources.py wrote both).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use arrow_array::{Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray};
use dataload::{
    ArrowDataset, IndexPlacement, JsonlDataset, ParquetDataset, Source, TokenDtype, TokenFile, TokenWindows,
};
use serde_json::{Map, Value};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dataload_sources")
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap()).unwrap()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

#[test]
fn token_files_match_numpy() {
    let exp = expected();
    for name in ["tokens_u16.bin", "tokens_u32.npy", "tokens_i64.npy"] {
        let e = &exp["tokens"][name];
        let file = TokenFile::open(dir().join(name), TokenDtype::U16).unwrap();
        let n = e["tokens"].as_u64().unwrap();
        assert_eq!(file.len(), n, "{name}");
        let mut all = vec![0i64; n as usize];
        file.read_into(0, &mut all).unwrap();
        assert_eq!(all.iter().sum::<i64>(), e["sum"].as_i64().unwrap(), "{name}");
        assert_eq!(all[..8], ints(&e["first"])[..], "{name}");
        assert_eq!(all[all.len() - 8..], ints(&e["last"])[..], "{name}");

        let windows = TokenWindows::open(dir().join(name), 16, TokenDtype::U16).unwrap();
        assert_eq!(windows.len(), e["windows"].as_u64().unwrap(), "{name}");
        let picked = e["picked"].as_object().unwrap();
        let indices: Vec<u64> = picked.keys().map(|k| k.parse().unwrap()).collect();
        let batch = windows.read_batch(&indices).unwrap();
        assert_eq!((batch.batch, batch.block_size), (indices.len(), 16));
        for (r, k) in picked.keys().enumerate() {
            assert_eq!(batch.input(r), ints(&picked[k]["input"]), "{name} window {k}");
            assert_eq!(batch.target(r), ints(&picked[k]["target"]), "{name} window {k}");
        }
    }
}

#[test]
fn token_shards_are_one_dataset_by_dir_and_by_glob() {
    let e = &expected()["tokens"]["token_shards"];
    let by_dir = TokenWindows::open(dir().join("token_shards"), 16, TokenDtype::U16).unwrap();
    let by_glob = TokenWindows::open(dir().join("token_shards/shard_*.npy"), 16, TokenDtype::U16).unwrap();
    assert_eq!(by_dir.len(), e["windows"].as_u64().unwrap());
    assert_eq!(by_dir.fingerprint(), by_glob.fingerprint());
    let names: Vec<&str> = by_dir.fingerprint().files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["shard_000.npy", "shard_001.npy", "shard_002.npy"]);
    let picked = e["picked"].as_object().unwrap();
    let indices: Vec<u64> = picked.keys().map(|k| k.parse().unwrap()).collect();
    for source in [&by_dir, &by_glob] {
        let batch = source.read_batch(&indices).unwrap();
        for (r, k) in picked.keys().enumerate() {
            assert_eq!(batch.input(r), ints(&picked[k]["input"]), "window {k}");
            assert_eq!(batch.target(r), ints(&picked[k]["target"]), "window {k}");
        }
    }
    assert!(by_dir.read_batch(&[by_dir.len()]).unwrap_err().to_string().contains("out of range"));
}

/// Rows of a record batch as JSON objects, the way pyarrow's `to_pylist` gives them (floats
/// as their bits, as the generator writes them).
fn rows(batch: &RecordBatch) -> Vec<Value> {
    let schema = batch.schema();
    (0..batch.num_rows())
        .map(|r| {
            let mut row = Map::new();
            for (c, field) in schema.fields().iter().enumerate() {
                let col = batch.column(c);
                let v = if col.is_null(r) {
                    Value::Null
                } else if let Some(a) = col.as_any().downcast_ref::<Int64Array>() {
                    a.value(r).into()
                } else if let Some(a) = col.as_any().downcast_ref::<Int32Array>() {
                    a.value(r).into()
                } else if let Some(a) = col.as_any().downcast_ref::<Float64Array>() {
                    a.value(r).to_bits().into()
                } else if let Some(a) = col.as_any().downcast_ref::<StringArray>() {
                    a.value(r).into()
                } else {
                    panic!("unexpected type {}", field.data_type())
                };
                row.insert(field.name().clone(), v);
            }
            Value::Object(row)
        })
        .collect()
}

fn expected_rows(columns: &[&str]) -> Vec<Value> {
    expected()["table"]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| Value::Object(columns.iter().map(|c| (c.to_string(), r[c].clone())).collect()))
        .collect()
}

fn check_table<S: Source<Batch = RecordBatch>>(source: &S, what: &str) {
    let all = ["id", "text", "score", "label"];
    let want = expected_rows(&all);
    assert_eq!(source.len(), want.len() as u64, "{what}");
    let indices: Vec<u64> = (0..source.len()).collect();
    assert_eq!(rows(&source.read_batch(&indices).unwrap()), want, "{what}: all rows in order");
    // A shuffled batch across record batches / row groups / files, with repeats.
    let picks = [129u64, 0, 37, 36, 80, 79, 4, 4, 111];
    let got = rows(&source.read_batch(&picks).unwrap());
    let want_picked: Vec<Value> = picks.iter().map(|&i| want[i as usize].clone()).collect();
    assert_eq!(got, want_picked, "{what}: shuffled rows");
    assert_eq!(source.read_batch(&[]).unwrap().num_rows(), 0);
}

#[test]
fn arrow_ipc_file_and_stream_match_pyarrow() {
    let exp = expected();
    let file = ArrowDataset::open(dir().join("table.arrow"), None).unwrap();
    assert_eq!(file.num_record_batches() as u64, exp["table"]["arrow_file_batches"].as_u64().unwrap());
    check_table(&file, "arrow file");
    let stream = ArrowDataset::open(dir().join("table.arrows"), None).unwrap();
    check_table(&stream, "arrow stream");
    let cols = ["text".to_string(), "id".to_string()];
    let projected = ArrowDataset::open(dir().join("table.arrow"), Some(&cols)).unwrap();
    let got = rows(&projected.read_batch(&[3, 4, 100]).unwrap());
    let want = expected_rows(&["text", "id"]);
    assert_eq!(got, vec![want[3].clone(), want[4].clone(), want[100].clone()]);
    assert_eq!(projected.schema().field(0).name(), "text");
    assert_ne!(projected.fingerprint().id(), file.fingerprint().id());
}

#[test]
fn parquet_matches_pyarrow_through_the_row_group_index() {
    let exp = &expected()["table"];
    for name in ["table.parquet", "table_zstd.parquet"] {
        let ds = ParquetDataset::open(dir().join(name), None, 2).unwrap();
        let groups = exp["parquet_row_groups"][name].as_array().unwrap().len();
        assert_eq!(ds.num_row_groups(), groups, "{name}");
        check_table(&ds, name);
    }
    let shards = ParquetDataset::open(dir().join("parquet_shards"), None, 1).unwrap();
    assert_eq!(shards.num_row_groups(), 5);
    check_table(&shards, "parquet shards");
    let rows_per_file: Vec<u64> = shards.fingerprint().files.iter().map(|f| f.rows).collect();
    assert_eq!(rows_per_file, [80, 50]);
    let cols = ["score".to_string(), "id".to_string()];
    let projected = ParquetDataset::open(dir().join("table.parquet"), Some(&cols), 4).unwrap();
    let got = rows(&projected.read_batch(&[3, 40, 129]).unwrap());
    let want = expected_rows(&["score", "id"]);
    assert_eq!(got, vec![want[3].clone(), want[40].clone(), want[129].clone()]);
}

#[test]
fn jsonl_plain_and_zstd_match_python() {
    let exp = &expected()["jsonl"];
    let raw: Vec<&str> = exp["raw"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["lines.jsonl", "lines.jsonl.zst", "lines_one_frame.jsonl.zst"] {
        let ds = JsonlDataset::open(dir().join(name), IndexPlacement::Dir(tmp.path().to_path_buf()), 2).unwrap();
        assert_eq!(ds.len(), exp["lines"].as_u64().unwrap(), "{name}");
        assert_eq!(ds.index_persisted(), [true]);
        let all: Vec<u64> = (0..ds.len()).collect();
        let batch = ds.read_batch(&all).unwrap();
        for (i, want) in raw.iter().enumerate() {
            let got = batch.get(i).unwrap();
            assert_eq!(got, *want, "{name} record {i}");
            assert_eq!(serde_json::from_str::<Value>(got).unwrap(), exp["parsed"][i], "{name} record {i}");
        }
        let picks = [59u64, 0, 17, 31, 30, 17];
        let batch = ds.read_batch(&picks).unwrap();
        let got: Vec<&str> = (0..picks.len()).map(|r| batch.get(r).unwrap()).collect();
        let want: Vec<&str> = picks.iter().map(|&i| raw[i as usize]).collect();
        assert_eq!(got, want, "{name}");
        assert_eq!(ds.fingerprint().files[0].size, exp["sizes"][name].as_u64().unwrap());
    }
    assert!(tmp.path().join("lines.jsonl.zst.lines.idx").is_file());
}

#[test]
fn line_index_is_reused_and_rebuilt_when_the_file_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("data.jsonl");
    std::fs::copy(dir().join("lines.jsonl"), &path).unwrap();
    let first = JsonlDataset::open(&path, IndexPlacement::Beside, 2).unwrap();
    let idx = tmp.path().join("data.jsonl.lines.idx");
    let built = std::fs::read(&idx).unwrap();
    // Reopening reads the stored index: damage it in a way only a rescan would not see.
    let again = JsonlDataset::open(&path, IndexPlacement::Beside, 2).unwrap();
    assert_eq!(again.fingerprint(), first.fingerprint());
    assert_eq!(std::fs::read(&idx).unwrap(), built);
    // Appending changes size (and mtime): the index is rebuilt, the fingerprint changes.
    let mut text = std::fs::read(&path).unwrap();
    text.extend_from_slice(b"{\"appended\": true}\n");
    std::fs::write(&path, &text).unwrap();
    let changed = JsonlDataset::open(&path, IndexPlacement::Beside, 2).unwrap();
    assert_eq!(changed.len(), first.len() + 1);
    assert_ne!(changed.fingerprint().id(), first.fingerprint().id());
    assert_eq!(changed.read_batch(&[first.len()]).unwrap().get(0), Some("{\"appended\": true}"));
    assert_ne!(std::fs::read(&idx).unwrap(), built);
    // A damaged index is rebuilt, never trusted.
    std::fs::write(&idx, b"SKLINES\0garbage").unwrap();
    let rebuilt = JsonlDataset::open(&path, IndexPlacement::Beside, 2).unwrap();
    assert_eq!(rebuilt.len(), changed.len());
    let memory = JsonlDataset::open(&path, IndexPlacement::Memory, 2).unwrap();
    assert_eq!(memory.index_persisted(), [false]);
}

#[test]
fn fingerprint_survives_a_move_and_sees_a_changed_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("moved");
    std::fs::create_dir(&copy).unwrap();
    for f in ["shard_000.npy", "shard_001.npy", "shard_002.npy"] {
        std::fs::copy(dir().join("token_shards").join(f), copy.join(f)).unwrap();
    }
    let orig = TokenWindows::open(dir().join("token_shards"), 16, TokenDtype::U16).unwrap();
    let moved = TokenWindows::open(&copy, 16, TokenDtype::U16).unwrap();
    assert_eq!(orig.fingerprint().id(), moved.fingerprint().id());
    assert!(orig.fingerprint().id().starts_with("tokens:3files:36rows:sha256-"));
    std::fs::remove_file(copy.join("shard_001.npy")).unwrap();
    let fewer = TokenWindows::open(&copy, 16, TokenDtype::U16).unwrap();
    assert_ne!(orig.fingerprint().id(), fewer.fingerprint().id());
    let other_block = TokenWindows::open(dir().join("token_shards"), 8, TokenDtype::U16).unwrap();
    assert_ne!(orig.fingerprint().id(), other_block.fingerprint().id());
}

#[test]
fn compressed_arrow_ipc_files_match_pyarrow_and_are_never_taken_for_views() {
    for codec in ["zstd", "lz4"] {
        let file = ArrowDataset::open(dir().join(format!("table_{codec}.arrow")), None).unwrap();
        check_table(&file, codec);
        // The buffers are decoded into fresh memory: no column is located in the file.
        let rows = file.contiguous_rows(52, 8).unwrap().unwrap();
        assert_eq!(rows.batch.num_rows(), 8);
        assert!(rows.in_file.iter().all(Option::is_none), "{codec}: {:?}", rows.in_file);
    }
}

#[test]
fn arrow_contiguous_rows_are_located_in_the_file() {
    let path = dir().join("table.arrow");
    let file = ArrowDataset::open(&path, None).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let want = expected_rows(&["id", "label"]);
    // Rows 52..60 lie in the second record batch (rows 50..90).
    let rows = file.contiguous_rows(52, 8).unwrap().unwrap();
    assert_eq!(rows.batch.num_rows(), 8);
    assert_eq!(file.file_paths(), vec![path.as_path()]);
    let (k, at) = rows.in_file[0].unwrap(); // id: int64 without nulls
    assert_eq!(k, 0);
    let ids: Vec<i64> = bytes[at..at + 64].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ids, (52..60).map(|i| want[i]["id"].as_i64().unwrap()).collect::<Vec<_>>());
    let (_, at) = rows.in_file[3].unwrap(); // label: int32 without nulls
    let labels: Vec<i64> =
        bytes[at..at + 32].chunks_exact(4).map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap()))).collect();
    assert_eq!(labels, (52..60).map(|i| want[i]["label"].as_i64().unwrap()).collect::<Vec<_>>());
    assert!(rows.in_file[1].is_none(), "strings are not fixed-width");
    // Across two record batches, or empty: not one contiguous range.
    assert!(file.contiguous_rows(48, 4).unwrap().is_none());
    assert!(file.contiguous_rows(0, 0).unwrap().is_none());
    assert!(file.contiguous_rows(125, 10).is_err());
}
