//! The JSON documents of an opened checkpoint, a verify report and an operation's outcome: the
//! one rendering that `ckpt --json` prints and the Python bindings return, so the two edges
//! cannot drift apart (they did: `bytes` here, `nbytes` there).
//!
//! Each is a `serde::Serialize` impl on the library's own type, and each document names its
//! schema; within a version fields are only ever added, never renamed or removed (the README
//! documents them):
//! - `statekit.inspect/2` for a [`Checkpoint`]. Its tensors are written as they are serialized,
//!   one entry at a time, so the catalog of a million tensors never stands as one JSON tree;
//! - `statekit.verify/1` for a [`Report`];
//! - `statekit.outcome/2` for an [`Outcome`], what split, merge, convert and reshard wrote;
//! - inside the inspect document, the fields a format adds of its own (an accelerate folder's
//!   `components`, a Megatron run's `megatron`), as its [`crate::Description`] gives them.
//!
//! Paths are JSON strings; a name that is not UTF-8 (a file planted in a `save_state` folder)
//! is written with U+FFFD in place of its invalid bytes rather than failing the document.

use std::path::Path;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use serde_json::{json, Value};

use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, TensorBox, TensorInfo};
use crate::report::verify::Report;

/// The schema of [`Checkpoint`]'s document (`ckpt inspect --json`).
pub const INSPECT_SCHEMA: &str = "statekit.inspect/2";
/// The schema of [`Report`]'s document (`ckpt verify --json`).
pub const VERIFY_SCHEMA: &str = "statekit.verify/1";
/// The schema of [`Outcome`]'s document (`ckpt split|merge|convert|reshard --json`).
pub const OUTCOME_SCHEMA: &str = "statekit.outcome/2";

/// `statekit.inspect/2`: the catalog, its files, its non-tensor values and totals, and what
/// the format adds.
impl Serialize for Checkpoint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let values: serde_json::Map<String, Value> =
            self.values().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("schema", INSPECT_SCHEMA)?;
        map.serialize_entry("format", self.format().name())?;
        map.serialize_entry("path", &text(self.root()))?;
        map.serialize_entry("index_metadata", &self.index_metadata())?;
        map.serialize_entry("values", &values)?;
        map.serialize_entry("files", &Files(self))?;
        map.serialize_entry("tensors", &Tensors(self))?;
        let totals =
            json!({ "files": self.files().len(), "tensors": self.tensors().len(), "bytes": self.total_bytes() });
        map.serialize_entry("totals", &totals)?;
        map.serialize_entry("world_size", &self.world_size())?;
        map.serialize_entry("zero_stage", &self.zero_stage())?;
        // The files' `__metadata__` merged, as writers carry it; null where shards disagree on a
        // key (the document still shows each file's own, and `verify` names the conflict).
        let merged: Option<serde_json::Map<String, Value>> =
            self.file_metadata().ok().map(|m| m.into_iter().map(|(k, v)| (k, Value::String(v))).collect());
        map.serialize_entry("metadata", &merged)?;
        // What the format adds (an accelerate folder's `components`, a Megatron run's
        // `megatron`), as it describes itself.
        for (key, value) in self.describe().json {
            map.serialize_entry(key, &value)?;
        }
        map.end()
    }
}

/// The `files` array: path, size, own `__metadata__`, and for torch files the globals the
/// pickle names, allowed or not.
struct Files<'a>(&'a Checkpoint);

impl Serialize for Files<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.files().len()))?;
        for f in self.0.files() {
            let metadata: serde_json::Map<String, Value> =
                f.metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
            let mut entry = json!({ "path": text(&f.path), "bytes": f.len, "metadata": metadata });
            if let (false, Some(map)) = (f.globals.is_empty(), entry.as_object_mut()) {
                map.insert("globals".into(), f.globals.clone().into());
            }
            seq.serialize_element(&entry)?;
        }
        seq.end()
    }
}

/// The `tensors` array, each entry built as it is written.
struct Tensors<'a>(&'a Checkpoint);

impl Serialize for Tensors<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.tensors().iter().map(|t| tensor(self.0, t)))
    }
}

/// One tensor: name, dtype (safetensors' names), global shape, bytes, and where its first byte
/// is stored. `mappable` says that its bytes lie contiguous and uncast in `file` from `offset`,
/// so a reader may map them as they are.
fn tensor(ck: &Checkpoint, t: &TensorInfo) -> Value {
    let decoded = ck.is_decoded(t);
    let mappable = ck.mappable(t);
    let at = mappable.or_else(|| t.location());
    let file = at.and_then(|(f, _)| ck.files().get(f)).map(|f| text(&f.path));
    let offset = at.map(|(_, o)| o).filter(|_| !decoded);
    let mut entry = json!({
        "name": t.name, "dtype": t.dtype.safetensors_name(), "shape": t.shape, "file": file, "offset": offset,
        "bytes": t.byte_len(), "mappable": mappable.is_some(),
    });
    if let Some(map) = entry.as_object_mut() {
        if decoded {
            // A numpy array: its bytes are decoded from the file's pickle, not stored.
            map.insert("decoded".into(), true.into());
        } else if !t.boxes().is_empty() {
            map.insert("boxes".into(), t.boxes().iter().map(|b| tensor_box(ck, b)).collect());
        }
    }
    entry
}

/// One box of a tensor: where it sits in the tensor, and the strided view on the stored bytes
/// that holds it (storage `offset` is the absolute byte offset of its storage in `file`).
fn tensor_box(ck: &Checkpoint, b: &TensorBox) -> Value {
    let file = ck.files().get(b.file);
    json!({
        "offsets": b.region.offsets,
        "sizes": b.region.sizes,
        "file": file.map(|f| text(&f.path)),
        "rank": file.and_then(|f| f.rank),
        "storage_offset": b.base,
        "storage_bytes": b.len,
        "view_offset": b.offset,
        "strides": b.strides,
    })
}

/// `statekit.verify/1`: whether the checkpoint is valid, what was checked, every problem.
impl Serialize for Report {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        json!({
            "schema": VERIFY_SCHEMA,
            "valid": self.is_valid(),
            "path": text(&self.path),
            "format": self.format.map(|f| f.name()),
            "files": self.files,
            "tensors": self.tensors,
            "checksums_ok": self.checksums_ok,
            // The document is printed (the CLI's `--json`) and shown (the bindings' results): its
            // problems are escaped as every printed message is.
            "problems": self.problems.iter().map(|p| crate::escape_controls(&p.to_string()).into_owned()).collect::<Vec<_>>(),
            "warnings": self.warnings,
        })
        .serialize(s)
    }
}

/// `statekit.outcome/2`: the files written (the commit marker last), tensors and bytes, the
/// values carried over, the `[alias, kept]` pairs, the world size of a sharded output, and each
/// rank's share (`ranks`: rank, files, bytes read and written) with whether it was a dry run.
impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        json!({
            "schema": OUTCOME_SCHEMA,
            "files": self.files.iter().map(|p| text(p)).collect::<Vec<_>>(),
            "tensors": self.tensors,
            "bytes": self.bytes,
            "values": self.values,
            "aliases": self.aliases,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "dry_run": self.dry_run,
        })
        .serialize(s)
    }
}

/// A path as JSON text.
fn text(p: &Path) -> std::borrow::Cow<'_, str> {
    p.to_string_lossy()
}
