//! The safetensors file format.
//!
//! On disk a safetensors file is three parts, back to back:
//!
//! 1. `N`, the header length, as a little-endian u64;
//! 2. `N` bytes of UTF-8 JSON: an object whose keys are tensor names, each mapping to
//!    `{"dtype", "shape", "data_offsets": [begin, end]}`, plus an optional `__metadata__`
//!    object of string to string;
//! 3. the data buffer. Offsets are relative to its start (byte `8 + N` of the file), end-exclusive.
//!
//! A valid file has offsets that, sorted, start at 0 and follow each other with no gap and no
//! overlap, each span exactly `numel × element size` bytes, and the last one ends exactly at the
//! end of the file. We check the same rules as the `safetensors` crate's `Metadata::validate`
//! (a test pins the parity) and one more: a name may appear only once, where the crate silently
//! keeps the last.
//!
//! Writers sort tensors by dtype (widest first) then name, write the header as compact JSON
//! with `__metadata__` first, and pad it with spaces to a multiple of 8 bytes. We reproduce that
//! byte for byte, so our files equal what `safetensors.torch.save_file` writes.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::hf_index;
use crate::error::{EntryProblem, Error, HeaderJsonProblem, IoContext, JsonKind, MetadataProblem, Result};
use crate::plan::{cut, Dest, Meta, Out, Placed};
use crate::read::catalog::{Checkpoint, Chunk, Format, Parts, Scan, SourceFile, TensorInfo};
use crate::read::dtype::Dtype;
use crate::read::io;
use crate::read::shape::numel;
use crate::write::{Plan, TargetFile};

/// The largest header the `safetensors` crate accepts; we refuse the same.
pub(crate) const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor entry of a parsed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HeaderTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Offsets into the data buffer, end-exclusive.
    pub begin: u64,
    pub end: u64,
}

/// A validated safetensors header.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    /// `N`: the length of the JSON header (including any padding).
    pub header_len: u64,
    /// `__metadata__`, in file order.
    pub metadata: Option<Vec<(String, String)>>,
    /// Tensors sorted by data offset: the order `safetensors.torch.load_file` returns them.
    pub tensors: Vec<HeaderTensor>,
}

impl Header {
    /// Absolute offset in the file where the data buffer starts.
    pub(crate) fn data_start(&self) -> u64 {
        8 + self.header_len
    }

    /// Total file length the header describes.
    pub(crate) fn file_len(&self) -> u64 {
        self.data_start() + self.tensors.last().map_or(0, |t| t.end)
    }
}

/// Reads and validates a header from an open file of length `len`.
pub(crate) fn read_header_from(file: &File, len: u64, path: &Path) -> Result<Header> {
    read_header_with(len, path, |offset, n| io::read_at(file, path, offset, n))
}

/// Reads and validates the header of a file of `len` bytes through `read(offset, len)`: a local
/// file's `pread`, or a remote file's range requests (`hf://`). One set of checks for both, so a
/// hostile header is refused in the same words wherever it is; `read` is asked for the first
/// 8 bytes, then for the header once its length is known to be in bounds.
pub(crate) fn read_header_with(
    len: u64,
    path: &Path,
    mut read: impl FnMut(u64, u64) -> Result<Vec<u8>>,
) -> Result<Header> {
    let path_buf = || path.to_path_buf();
    if len < 8 {
        return Err(Error::HeaderTooSmall { path: path_buf(), len });
    }
    let n: [u8; 8] = read(0, 8)?.try_into().map_err(|_| Error::HeaderTooSmall { path: path_buf(), len })?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_LEN {
        return Err(Error::HeaderTooLarge { path: path_buf(), header_len, max: MAX_HEADER_LEN });
    }
    if header_len > len - 8 {
        return Err(Error::HeaderBeyondFile { path: path_buf(), header_len, len });
    }
    // Bounded by MAX_HEADER_LEN above, so the allocation is at most 100 MB.
    let json = read(8, header_len)?;
    let header = parse_header(&json, header_len, path)?;
    let expected = header.file_len();
    if expected != len {
        return Err(Error::LengthMismatch { path: path_buf(), len, expected });
    }
    Ok(header)
}

/// The name huggingface_hub gives an unsharded checkpoint.
pub(crate) const SINGLE_NAME: &str = "model.safetensors";

/// The `*.safetensors.index.json` and `*.safetensors` files of a folder.
pub(crate) fn folder_files(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut indexes = Vec::new();
    let mut singles = Vec::new();
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors.index.json") {
            indexes.push(entry.path());
        } else if name.ends_with(".safetensors") {
            singles.push(entry.path());
        }
    }
    indexes.sort();
    singles.sort();
    Ok((indexes, singles))
}

/// A safetensors checkpoint root: any file not claimed by an earlier format, or a folder holding
/// `model.safetensors` or, with no index beside it, exactly one `.safetensors` file.
pub(crate) fn detect(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_file() {
        return Ok(Some(path.to_path_buf()));
    }
    let single = path.join(SINGLE_NAME);
    if single.is_file() {
        return Ok(Some(single));
    }
    let (indexes, singles) = folder_files(path)?;
    Ok(match (indexes.as_slice(), singles.as_slice()) {
        // A lone shard (`model-00001-of-00003.safetensors`) is part of a checkpoint whose index,
        // the commit marker, is missing: what a write interrupted between its renames and its
        // index leaves. It is not a checkpoint of its own.
        ([], [one]) if !is_lone_shard(one) => Some(one.clone()),
        _ => None,
    })
}

/// `<stem>-0000i-of-0000n.safetensors` with more than one shard.
fn is_lone_shard(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let Some(stem) = name.strip_suffix(".safetensors") else { return false };
    let Some((_, of)) = stem.rsplit_once("-of-") else { return false };
    of.len() == 5 && of.bytes().all(|b| b.is_ascii_digit()) && of != "00001"
}

/// One safetensors file: merged and converted as stored, not laid out for ranks.
pub(crate) struct SafetensorsFormat;

impl super::FormatOps for SafetensorsFormat {
    fn catalog(&self, _: Format, root: PathBuf, _: &crate::OpenOptions) -> Result<Scan> {
        catalog(root)
    }

    /// A Hugging Face model folder (its `config.json` beside the weights) as a Megatron-LM run.
    fn to_megatron(
        &self,
        ck: &Checkpoint,
        out: &Path,
        layout: crate::ops::RunLayout,
        opts: &crate::WriteOptions<'_>,
    ) -> Result<crate::Outcome> {
        super::megatron::save::from_hf(ck, out, layout, opts)
    }
}

/// The catalog of one safetensors file.
pub(crate) fn catalog(root: PathBuf) -> Result<Scan> {
    let (file, header) = read_file(&root)?;
    catalog_of(file, header)
}

/// The catalog of one safetensors file whose header was read (here, or by range requests).
pub(crate) fn catalog_of(file: SourceFile, header: Header) -> Result<Scan> {
    let root = file.path.clone();
    let tensors = header_tensors(header, 0);
    Ok(Scan::clean(Checkpoint::new(Parts::new(Format::Safetensors, root, vec![file], tensors))?))
}

/// Reads a file's header, and describes the file as a source.
pub(crate) fn read_file(path: &Path) -> Result<(SourceFile, Header)> {
    let file = io::open(path)?;
    let len = file.metadata().at(path)?.len();
    let header = read_header_from(&file, len, path)?;
    Ok(source_of(path, len, header))
}

/// The file at `path` of `len` bytes as a source, its `__metadata__` taken from `header`.
pub(crate) fn source_of(path: &Path, len: u64, mut header: Header) -> (SourceFile, Header) {
    let metadata = header.metadata.take().unwrap_or_default();
    (SourceFile { metadata, ..SourceFile::new(path.to_path_buf(), len) }, header)
}

/// The header's tensors as catalog entries of source file `file`.
pub(crate) fn header_tensors(header: Header, file: usize) -> Vec<TensorInfo> {
    let start = header.data_start();
    header
        .tensors
        .into_iter()
        .map(|t| {
            let chunk = Chunk { file, offset: start + t.begin, len: t.end - t.begin };
            TensorInfo::ranges(t.name, t.dtype, t.shape, vec![chunk])
        })
        .collect()
}

/// Parses and validates header JSON; everything but the file-length check.
pub(crate) fn parse_header(json: &[u8], header_len: u64, path: &Path) -> Result<Header> {
    let bad_json = |problem| Error::BadHeaderJson { path: path.to_path_buf(), problem };
    let text = std::str::from_utf8(json).map_err(|e| bad_json(HeaderJsonProblem::NotUtf8(e)))?;
    let entries: Entries<&serde_json::value::RawValue> =
        serde_json::from_str(text).map_err(|_| {
            // The raw pass stops at the same byte; the message of a full parse names what it
            // expected there more precisely (an object, not any value).
            let full = serde_json::from_str::<Entries<serde_json::Value>>(text).err();
            bad_json(full.map_or_else(
                || HeaderJsonProblem::Json { parser: "invalid JSON".into() },
                |e| HeaderJsonProblem::json(&e),
            ))
        })?;

    let mut metadata = None;
    let mut tensors = Vec::with_capacity(entries.0.len());
    let mut seen = std::collections::HashSet::with_capacity(entries.0.len());
    for (name, _) in &entries.0 {
        if !seen.insert(name.as_str()) {
            return Err(Error::DuplicateInFile { path: path.to_path_buf(), tensor: name.clone() });
        }
    }
    drop(seen);
    for (name, raw) in entries.0 {
        // Each entry is parsed only now, one at a time.
        let value: serde_json::Value =
            serde_json::from_str(raw.get()).map_err(|e| bad_json(HeaderJsonProblem::json(&e)))?;
        if name == "__metadata__" {
            metadata = Some(parse_metadata(value, path)?);
        } else {
            tensors.push(parse_tensor(name, value, path)?);
        }
    }
    validate_offsets(&mut tensors, path)?;
    Ok(Header { header_len, metadata, tensors })
}

fn parse_metadata(value: serde_json::Value, path: &Path) -> Result<Vec<(String, String)>> {
    let bad = |problem| Error::BadMetadata { path: path.to_path_buf(), problem };
    let serde_json::Value::Object(map) = value else {
        return Err(bad(MetadataProblem::NotAnObject { found: JsonKind::of(&value) }));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            other => Err(bad(MetadataProblem::NotAString { found: JsonKind::of(&other), key: k })),
        })
        .collect()
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

fn parse_tensor(name: String, value: serde_json::Value, path: &Path) -> Result<HeaderTensor> {
    let raw: RawTensor = serde_json::from_value(value).map_err(|e| Error::BadTensorEntry {
        path: path.to_path_buf(),
        tensor: name.clone(),
        problem: EntryProblem::NotParsed { parser: e.to_string() },
    })?;
    let Some(dtype) = Dtype::from_safetensors_name(&raw.dtype) else {
        return Err(Error::UnknownDtype { path: path.to_path_buf(), tensor: name, dtype: raw.dtype });
    };
    let (begin, end) = raw.data_offsets;
    Ok(HeaderTensor { name, dtype, shape: raw.shape, begin, end })
}

/// Sorts by offsets and checks contiguity and sizes, as `safetensors::Metadata::validate` does.
fn validate_offsets(tensors: &mut [HeaderTensor], path: &Path) -> Result<()> {
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut next = 0u64;
    for t in tensors.iter() {
        if t.begin != next || t.end < t.begin {
            return Err(Error::BadOffset {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                expected: next,
                found: t.begin,
            });
        }
        let expected = numel(&t.shape).and_then(|n| t.dtype.byte_len(n)).ok_or_else(|| Error::BadTensorEntry {
            path: path.to_path_buf(),
            tensor: t.name.clone(),
            problem: EntryProblem::ShapeBytes { shape: t.shape.clone(), dtype: t.dtype },
        })?;
        let found = t.end - t.begin;
        if expected != found {
            return Err(Error::SizeMismatch {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                expected,
                found,
            });
        }
        next = t.end;
    }
    Ok(())
}

/// A JSON object read as its entries in file order, duplicates kept, so that we can refuse them
/// (a plain map would silently keep one). Values stay what `V` makes of them: a header keeps
/// each entry as its raw JSON text and parses it only when it is validated, so a header of a
/// million tensors never holds a million parsed JSON trees at once.
pub(crate) struct Entries<V>(pub Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Entries<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Walk<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Walk<V> {
            type Value = Entries<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entries<V>, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((k, v)) = map.next_entry::<String, V>()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Walk(std::marker::PhantomData)).map_err(de::Error::custom)
    }
}

/// One tensor to be written: its name, dtype, shape and byte length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    pub len: u64,
}

/// The layout of a file to write: the encoded header, and each tensor's absolute file offset.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// `N` as 8 little-endian bytes followed by the padded JSON header.
    pub head: Vec<u8>,
    /// The absolute file offset of each tensor, in the order they were given.
    pub offsets: Vec<u64>,
    pub file_len: u64,
}

/// Lays out a file the way the `safetensors` crate's `serialize` does: tensors sorted by dtype
/// (widest first) then by name, the header compact JSON padded with spaces to a multiple of 8.
///
/// The header is written as it goes, not built as a JSON tree first: a file of a million
/// tensors needs its header and a few words per tensor, not a map of maps ten times its size.
pub(crate) fn layout(tensors: &[OutTensor<'_>], metadata: &[(String, String)], out: &Path) -> Result<Layout> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&tensors[a], &tensors[b]);
        b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(b.name))
    });
    if let Some(tensor) = duplicate(tensors, !metadata.is_empty()) {
        return Err(Error::DuplicateInFile { path: out.to_path_buf(), tensor: tensor.to_string() });
    }
    let json_err =
        |e: serde_json::Error| Error::BadHeaderJson { path: out.to_path_buf(), problem: HeaderJsonProblem::json(&e) };
    // The 8 bytes of `N` first, filled in once the header is written.
    let mut head = vec![0u8; 8];
    head.push(b'{');
    if !metadata.is_empty() {
        let meta: serde_json::Map<String, serde_json::Value> =
            metadata.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
        head.extend_from_slice(b"\"__metadata__\":");
        serde_json::to_writer(&mut head, &meta).map_err(json_err)?;
    }
    let mut offsets = vec![0u64; tensors.len()];
    let mut offset = 0u64;
    for (k, &i) in order.iter().enumerate() {
        let t = &tensors[i];
        if k > 0 || !metadata.is_empty() {
            head.push(b',');
        }
        serde_json::to_writer(&mut head, t.name).map_err(json_err)?;
        head.extend_from_slice(b":{\"dtype\":");
        serde_json::to_writer(&mut head, t.dtype.safetensors_name()).map_err(json_err)?;
        head.extend_from_slice(b",\"shape\":");
        serde_json::to_writer(&mut head, t.shape).map_err(json_err)?;
        let end = offset + t.len;
        head.extend_from_slice(format!(",\"data_offsets\":[{offset},{end}]}}").as_bytes());
        offsets[i] = offset;
        offset = end;
    }
    head.push(b'}');
    head.resize(8 + (head.len() - 8).next_multiple_of(8), b' ');
    let n = head.len() as u64 - 8;
    if n > MAX_HEADER_LEN {
        return Err(Error::HeaderTooLarge { path: out.to_path_buf(), header_len: n, max: MAX_HEADER_LEN });
    }
    head[..8].copy_from_slice(&n.to_le_bytes());
    let data_start = 8 + n;
    for o in &mut offsets {
        *o += data_start;
    }
    Ok(Layout { head, offsets, file_len: data_start + offset })
}

/// A name given twice (or `__metadata__` beside the metadata), if any.
fn duplicate<'a>(tensors: &[OutTensor<'a>], metadata: bool) -> Option<&'a str> {
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name).collect();
    names.sort_unstable();
    if metadata && names.binary_search(&"__metadata__").is_ok() {
        return Some("__metadata__");
    }
    names.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// Plans `outs` as safetensors files at `dest`: one file, or huggingface_hub's shards and index.
pub(crate) fn plan(outs: &[Out<'_>], meta: &Meta, dest: &Dest, plan: &mut Plan) -> Result<Placed> {
    for o in outs {
        if !o.dtype.in_safetensors() {
            return Err(Error::NotInSafetensors { tensor: o.tensor.name.clone(), dtype: o.dtype.to_string() });
        }
    }
    let (files, total) = cut(outs, dest, SINGLE_NAME, "model", ".safetensors");
    let one = files.len() == 1;
    for (path, members) in &files {
        let tensors: Vec<OutTensor<'_>> = members
            .iter()
            .map(|&i| {
                let o = &outs[i];
                OutTensor { name: &o.tensor.name, dtype: o.dtype, shape: &o.tensor.shape, len: o.byte_len() }
            })
            .collect();
        let layout = layout(&tensors, &meta.file(one), path)?;
        drop(tensors);
        let mut target = TargetFile::new(path.clone(), layout.head, layout.file_len);
        for (&i, &at) in members.iter().zip(&layout.offsets) {
            let o = &outs[i];
            target.place(o.tensor, o.dtype, at, o.compute.clone());
        }
        plan.targets.push(target);
    }
    hf_index::finish_sharded(plan, &files, outs, dest, meta, total, ("model", ".safetensors", hf_index::INDEX_NAME))
}
