//! Entry points for the fuzz targets (`ckpt/fuzz`): each parser on arbitrary bytes. None may
//! panic, hang or allocate without bound, whatever the input; errors are the expected outcome.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::formats::megatron::fuzz as megatron;
pub use crate::formats::torch::fuzz::*;
use crate::read::catalog::{Checkpoint, Format, Parts, SourceFile};

/// The DCP `.metadata` reader: the restricted unpickler with DCP's classes, then the walk over
/// its dataclasses.
pub fn dcp_metadata(data: &[u8]) {
    let _ = crate::formats::dcp::metadata::parse(data, Path::new("fuzz/.metadata"));
}

/// A Hugging Face index (`model.safetensors.index.json`): JSON, `metadata`, `weight_map`
/// entries and their file-name check.
pub fn hf_index(data: &[u8]) {
    let _ = crate::formats::hf_index::Index::parse(data, Path::new("fuzz/model.safetensors.index.json"));
}

/// A safetensors header: the length prefix, the JSON, every entry and the offset rules, then
/// the catalog built on it.
pub fn safetensors_header(data: &[u8]) {
    let Some((n, json)) = data.split_first_chunk::<8>() else { return };
    let header_len = u64::from_le_bytes(*n);
    if header_len > crate::formats::safetensors::MAX_HEADER_LEN || header_len > json.len() as u64 {
        return;
    }
    let path = Path::new("fuzz.safetensors");
    let Some(json) = json.get(..header_len as usize) else { return };
    if let Ok(header) = crate::formats::safetensors::parse_header(json, header_len, path) {
        let _ = crate::formats::safetensors::header_tensors(header, 0);
    }
}

/// The check that a tensor's boxes tile it (every format's DCP chunks, shards, views): the
/// first byte is the number of dims (up to 4), then one byte per dim of the shape, then boxes
/// as one offset and one size byte per dim. It must answer, in bounded time and memory, for any
/// set of boxes.
pub fn tiling(data: &[u8]) {
    let Some((&dims, rest)) = data.split_first() else { return };
    let dims = usize::from(dims % 5);
    let Some((shape, rest)) = rest.split_at_checked(dims) else { return };
    let shape: Vec<u64> = shape.iter().map(|&d| u64::from(d % 64)).collect();
    let boxes: Vec<fsdp_state::Region> = rest
        .chunks_exact((2 * dims).max(1))
        .map(|b| {
            let (o, s) = b.split_at(dims.min(b.len()));
            fsdp_state::Region::new(
                o.iter().map(|&x| u64::from(x % 65)).collect::<Vec<_>>(),
                s.iter().map(|&x| u64::from(x % 65)).collect::<Vec<_>>(),
            )
        })
        .collect();
    let _ = fsdp_state::check_tiling(&shape, &boxes);
}

/// Megatron's `latest_checkpointed_iteration.txt`.
pub fn megatron_tracker(data: &[u8]) {
    megatron::tracker(data);
}

/// Megatron's `metadata.json`.
pub fn megatron_config(data: &[u8]) {
    megatron::config(data);
}

/// The names of a legacy save's iteration folder, one per line: its `mp_rank_*` folders.
pub fn megatron_rank_folders(data: &[u8]) {
    megatron::rank_folders(data);
}

/// A Megatron save's pickled state: `common_state`, a rank file's `args`.
pub fn megatron_saved_state(data: &[u8]) {
    megatron::saved_state(data);
}

/// The JSON documents `ckpt --json` prints (`inspect`, `verify`, an operation's outcome),
/// built from arbitrary input and rendered by the library's own `Serialize` impls: the text
/// must parse back as JSON holding the same document, the names, paths and metadata as the
/// catalog has them, every problem on one line. The input: a length byte and a path of that
/// many bytes (any bytes: a name need not be UTF-8), a little-endian `u16` length and a
/// safetensors header of that many bytes (names, dtypes, shapes, `__metadata__`), then a pickle
/// of values.
pub fn json_documents(data: &[u8]) {
    use std::os::unix::ffi::OsStrExt;
    let Some((&n, rest)) = data.split_first() else { return };
    let Some((root, rest)) = rest.split_at_checked(usize::from(n)) else { return };
    let root = PathBuf::from(std::ffi::OsStr::from_bytes(root));
    let Some((len, rest)) = rest.split_first_chunk::<2>() else { return };
    let (header, pickled) = rest.split_at(usize::from(u16::from_le_bytes(*len)).min(rest.len()));
    let file = root.join("model.safetensors");
    let values = crate::formats::torch::fuzz::values(pickled);

    let mut problems = Vec::new();
    let mut names = Vec::new();
    match crate::formats::safetensors::parse_header(header, header.len() as u64, &file) {
        Ok(mut h) => {
            let metadata = h.metadata.take().unwrap_or_default();
            let source = SourceFile { metadata, ..SourceFile::new(file.clone(), h.file_len()) };
            let tensors = crate::formats::safetensors::header_tensors(h, 0);
            names = tensors.iter().map(|t| t.name.clone()).collect();
            let mut parts = Parts::new(Format::Safetensors, root.clone(), vec![source], tensors);
            let optimizer = parts.files.iter().flat_map(|f| &f.metadata).map(|(_, v)| v.clone()).next();
            parts.values = values.clone();
            parts.detail = Some(megatron::summary(optimizer));
            match Checkpoint::new(parts) {
                Ok(ck) => inspected(&ck),
                Err(e) => problems.push(e),
            }
        }
        Err(e) => problems.push(e),
    }

    let report = crate::Report {
        path: root.clone(),
        format: Some(Format::Safetensors),
        files: 1,
        tensors: names.len(),
        problems,
        warnings: names.clone(),
        checksums_ok: 0,
    };
    let doc = round_trip(&report);
    let problems = doc["problems"].as_array().expect("`problems` is a list");
    assert_eq!(problems.len(), report.problems.len());
    for (p, e) in problems.iter().zip(&report.problems) {
        let text = p.as_str().expect("a problem is text");
        assert!(!text.chars().any(char::is_control), "a problem that is not one clean line: {text:?}");
        assert_eq!(text, crate::escape_controls(&e.to_string()));
    }
    assert_eq!(doc["warnings"], Value::from(names.clone()));

    let outcome = crate::Outcome {
        files: names.iter().map(|n| root.join(n)).chain([file]).collect(),
        tensors: names.len(),
        bytes: u64::from(n) << 40,
        values: values.iter().map(|(k, _)| k.clone()).collect(),
        aliases: names.iter().zip(names.iter().rev()).map(|(a, b)| (a.clone(), b.clone())).collect(),
        world_size: Some(u64::MAX),
        ranks: vec![crate::RankShare { rank: u64::MAX, files: 1, bytes_read: u64::MAX, bytes_written: 0 }],
        dry_run: n % 2 == 0,
    };
    let doc = round_trip(&outcome);
    let files: Vec<String> = outcome.files.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    assert_eq!(doc["files"], Value::from(files));
    assert_eq!(doc["values"], Value::from(outcome.values.clone()));
}

/// `ck`'s inspect document: it round-trips, and says what the catalog says.
fn inspected(ck: &Checkpoint) {
    let doc = round_trip(ck);
    assert_eq!(doc["path"], Value::from(ck.root().to_string_lossy()));
    let tensors = doc["tensors"].as_array().expect("`tensors` is a list");
    let names: Vec<&Value> = tensors.iter().map(|t| &t["name"]).collect();
    let expected: Vec<Value> = ck.tensors().iter().map(|t| Value::from(t.name.as_str())).collect();
    assert!(names.iter().copied().eq(expected.iter()), "the document's tensors are not the catalog's");
    for (t, entry) in ck.tensors().iter().zip(tensors) {
        assert_eq!(entry["dtype"], Value::from(t.dtype.safetensors_name()));
        assert_eq!(entry["shape"], Value::from(t.shape.clone()));
    }
    for (k, v) in &ck.files()[0].metadata {
        assert_eq!(doc["files"][0]["metadata"][k.as_str()], Value::from(v.as_str()), "metadata `{k:?}`");
    }
    let keys: std::collections::BTreeSet<&str> = ck.values().into_iter().map(|(k, _)| k).collect();
    let shown = doc["values"].as_object().expect("`values` is an object");
    assert_eq!(shown.keys().map(String::as_str).collect::<std::collections::BTreeSet<_>>(), keys);
}

/// `doc` rendered as `ckpt --json` prints it, parsed back: the same JSON as the document
/// itself.
fn round_trip(doc: &impl serde::Serialize) -> Value {
    let mut text = Vec::new();
    serde_json::to_writer_pretty(&mut text, doc).expect("the document renders");
    let parsed: Value = serde_json::from_slice(&text).expect("the printed document is JSON");
    assert_eq!(parsed, serde_json::to_value(doc).expect("the document renders"), "the document changed in print");
    parsed
}
