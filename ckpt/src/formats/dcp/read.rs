//! From parsed metadata to byte ranges: every item opened as the `torch.save` zip it is, every
//! tensor's chunks checked to tile it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::metadata::{self, ChunkMeta, Kind, PathElem, StorageInfo};
use crate::catalog::{Chunk, SourceFile};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::formats::torch::flatten::{self, Leaf};
use crate::formats::torch::pickle::{self, Limits, Obj, Refusal};
use crate::formats::torch::zip;
use crate::shape::{self as strided, Runs};

/// The largest `.metadata` we read (a model with a million chunks stays well below).
const MAX_METADATA_LEN: u64 = 1 << 30;
/// The largest `data.pkl` of one item: a tensor item's is ~200 bytes, a bytes item holds one
/// small Python value.
const MAX_ITEM_PICKLE: u64 = 64 << 20;

/// A tensor of a DCP checkpoint.
#[derive(Clone, Debug)]
pub(crate) struct DcpTensor {
    pub key: String,
    pub path: Vec<PathElem>,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Non-empty chunks in dim-0 order: concatenated, the tensor's row-major bytes.
    pub chunks: Vec<Chunk>,
    /// How many chunks the metadata lists (empty ones included): more than one means the tensor
    /// was sharded (a DTensor), one means saved whole (a replicated tensor, or a world of 1).
    pub saved_chunks: usize,
}

/// A non-tensor value of a DCP checkpoint: its item, kept whole, and what it holds.
#[derive(Clone, Debug)]
pub(crate) struct DcpBytes {
    pub key: String,
    pub path: Vec<PathElem>,
    pub chunk: Chunk,
    pub value: Leaf,
}

/// A DCP folder read and validated.
#[derive(Clone, Debug)]
pub(crate) struct Dcp {
    pub files: Vec<SourceFile>,
    pub tensors: Vec<DcpTensor>,
    pub bytes: Vec<DcpBytes>,
}

/// Reads the DCP folder `dir`.
pub(crate) fn read(dir: &Path) -> Result<Dcp> {
    let meta_path = dir.join(super::METADATA_NAME);
    let data = crate::io::read_capped(&meta_path, MAX_METADATA_LEN)?;
    let md = metadata::parse(&data, &meta_path)?;

    let mut files = Files { dir, meta_path: &meta_path, list: Vec::new(), by_name: HashMap::new() };
    let mut tensors = Vec::new();
    let mut bytes = Vec::new();
    // The values of all bytes items are kept together, and many items may name the same bytes:
    // they share one memory budget.
    let values_budget = pickle::Budget::shared(Limits::default());
    for item in md.items {
        match item.kind {
            Kind::Tensor { dtype, size, chunks } => {
                let saved_chunks = chunks.len();
                let chunks = tensor_chunks(&mut files, &item.key, dtype, &size, chunks)?;
                tensors.push(DcpTensor { key: item.key, path: item.path, dtype, shape: size, chunks, saved_chunks });
            }
            Kind::Bytes { storage } => {
                let (fi, rank) = files.get(&item.key, &storage)?;
                let f = &files.list[fi];
                let value = read_bytes_item(&f.path, rank, &item.key, &storage, &values_budget)?;
                let chunk = Chunk { file: fi, offset: storage.offset, len: storage.length };
                bytes.push(DcpBytes { key: item.key, path: item.path, chunk, value });
            }
        }
    }
    Ok(Dcp { files: files.list, tensors, bytes })
}

/// The data files named by the metadata, opened once each.
struct Files<'a> {
    dir: &'a Path,
    meta_path: &'a Path,
    list: Vec<SourceFile>,
    by_name: HashMap<String, usize>,
}

impl Files<'_> {
    /// The file holding `storage` (opened on first use), checked to contain its byte range;
    /// with the rank its name says (`__R_*.distcp`).
    fn get(&mut self, key: &str, storage: &StorageInfo) -> Result<(usize, Option<u64>)> {
        let name = &storage.relative_path;
        let rank = rank_of(name);
        let fi = match self.by_name.get(name) {
            Some(&i) => i,
            None => {
                // torch joins `relative_path` to the folder; anything but a plain file name
                // there could reach outside it.
                if !crate::io::is_plain_file_name(name) {
                    return Err(Error::BadDcpMetadata {
                        path: self.meta_path.to_path_buf(),
                        reason: format!(
                            "`{key}` is stored in `{name}`, which is not a plain file name in the checkpoint's folder"
                        ),
                    });
                }
                let path = self.dir.join(name);
                let len = match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() => m.len(),
                    Ok(_) | Err(_) if !path.exists() => {
                        return Err(Error::MissingShard {
                            index: self.meta_path.to_path_buf(),
                            tensor: key.to_string(),
                            file: name.clone(),
                        })
                    }
                    Ok(_) => {
                        return Err(Error::BadDcpChunk {
                            path,
                            tensor: key.to_string(),
                            rank,
                            reason: "its data file is not a plain file".into(),
                        })
                    }
                    Err(e) => return Err(Error::Io { path, source: e }),
                };
                self.list.push(SourceFile { path, len, metadata: Vec::new() });
                self.by_name.insert(name.clone(), self.list.len() - 1);
                self.list.len() - 1
            }
        };
        let f = &self.list[fi];
        if storage.offset.checked_add(storage.length).is_none_or(|end| end > f.len) {
            return Err(Error::BadDcpChunk {
                path: f.path.clone(),
                tensor: key.to_string(),
                rank,
                reason: format!(
                    "item at byte {} of {} bytes runs past the end of the {}-byte file",
                    storage.offset, storage.length, f.len
                ),
            });
        }
        Ok((fi, rank))
    }
}

/// The rank in torch's default data file name `__{rank}_{n}.distcp`.
fn rank_of(name: &str) -> Option<u64> {
    name.strip_prefix("__")?.split('_').next()?.parse().ok()
}

/// What an item's `data.pkl` holds, with the archive it came from.
fn open_item(
    path: &Path,
    rank: Option<u64>,
    key: &str,
    storage: &StorageInfo,
    budget: Option<&Rc<pickle::Budget>>,
) -> Result<(zip::Archive, String, pickle::Pickle)> {
    let bad = |reason: String| Error::BadDcpChunk { path: path.to_path_buf(), tensor: key.to_string(), rank, reason };
    let file = crate::io::open(path)?;
    // An item is a byte range of its data file, read as a zip archive of its own.
    let item = crate::io::Window { file: &file, base: storage.offset };
    let archive = zip::Archive::open(&item, storage.length, path).map_err(|e| {
        bad(format!("item at byte {} is not a `torch.save` archive: {}", storage.offset, strip_path(&e, path)))
    })?;
    // torch names the records `archive/…`; any one-level folder is accepted, as `torch.load` does.
    let found = archive.entries.iter().find_map(|e| match e.name.split_once('/') {
        Some((folder, "data.pkl")) => Some((e, format!("{folder}/"))),
        _ => None,
    });
    let Some((pkl, prefix)) = found else {
        return Err(bad(format!("item at byte {} has no `data.pkl` record", storage.offset)));
    };
    let data = archive.read_entry(&item, pkl, MAX_ITEM_PICKLE).map_err(|e| bad(strip_path(&e, path)))?;
    let p = match budget {
        Some(b) => pickle::load_shared(&data, Limits::default(), &[], b),
        None => pickle::load(&data, Limits::default()),
    };
    let p = p.map_err(|r| match r {
        Refusal::Global(global) => Error::RefusedGlobal { path: path.to_path_buf(), global },
        Refusal::Bad { at, reason } => {
            bad(format!("`{}` of the item at byte {}: byte {at}: {reason}", pkl.name, storage.offset))
        }
    })?;
    Ok((archive, prefix, p))
}

/// An error's message without its leading `path: ` (the caller names the file itself).
fn strip_path(e: &Error, path: &Path) -> String {
    let text = e.to_string();
    text.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(text)
}

fn read_bytes_item(
    path: &Path,
    rank: Option<u64>,
    key: &str,
    storage: &StorageInfo,
    budget: &Rc<pickle::Budget>,
) -> Result<Leaf> {
    let (_, _, p) = open_item(path, rank, key, storage, Some(budget))?;
    flatten::leaf_of(&p).map_err(|reason| Error::BadDcpChunk {
        path: path.to_path_buf(),
        tensor: key.to_string(),
        rank,
        reason: format!("non-tensor item at byte {}: {reason}", storage.offset),
    })
}

/// Locates the payload of a tensor item: the bytes, in the data file, of the chunk as a
/// row-major tensor.
fn tensor_item(path: &Path, rank: Option<u64>, key: &str, dtype: Dtype, c: &ChunkMeta) -> Result<Chunk> {
    let bad = |reason: String| Error::BadDcpChunk { path: path.to_path_buf(), tensor: key.to_string(), rank, reason };
    let at = c.storage.offset;
    let (archive, prefix, p) = open_item(path, rank, key, &c.storage, None)?;
    let Some(Obj::Tensor(t)) = p.obj(p.root) else {
        return Err(bad(format!("the item at byte {at} does not hold a tensor")));
    };
    if t.dtype != dtype {
        return Err(bad(format!("the item at byte {at} holds `{}` where the metadata says `{dtype}`", t.dtype)));
    }
    if t.shape != c.sizes {
        return Err(bad(format!(
            "the item at byte {at} holds shape {:?} where the chunk at offsets {:?} has sizes {:?}",
            t.shape, c.offsets, c.sizes
        )));
    }
    let rec = format!("{prefix}data/{}", t.storage.key);
    let Some(e) = archive.find(&rec) else {
        return Err(bad(format!("the item at byte {at} has no storage record `{rec}`")));
    };
    if e.method != zip::Method::Stored {
        return Err(bad(format!("storage record `{rec}` of the item at byte {at} is compressed")));
    }
    let elem = dtype.bits() / 8;
    if t.storage.numel.checked_mul(t.storage.kind.elem_bytes()) != Some(e.size) {
        return Err(bad(format!(
            "storage `{rec}` of the item at byte {at} declares {} elements but holds {} bytes",
            t.storage.numel, e.size
        )));
    }
    let numel = strided::numel(&t.shape);
    let needed = strided::extent(t.offset, &t.shape, &t.strides).and_then(|x| x.checked_mul(elem));
    if !dtype.bits().is_multiple_of(8)
        || numel.and_then(|n| n.checked_mul(elem)).is_none()
        || needed.is_none_or(|n| n > e.size)
    {
        return Err(bad(format!("the tensor of the item at byte {at} reaches past its storage")));
    }
    let len = numel.unwrap_or(0) * elem;
    let mut runs = Runs::new(t.offset, &t.shape, &t.strides, elem);
    // torch saves each chunk compact; a strided view would need a gather, so it is refused.
    let start = match (runs.total(), runs.next()) {
        (0, _) => 0,
        (1, Some((off, l))) if l == len => off,
        _ => return Err(bad(format!("the tensor of the item at byte {at} is not contiguous"))),
    };
    Ok(Chunk { file: usize::MAX, offset: at + e.data_offset + start, len })
}

/// Validates a tensor's chunks (dim-0 slices that tile it exactly) and locates their bytes.
fn tensor_chunks(
    files: &mut Files<'_>,
    key: &str,
    dtype: Dtype,
    size: &[u64],
    chunks: Vec<ChunkMeta>,
) -> Result<Vec<Chunk>> {
    let meta = files.meta_path.to_path_buf();
    let bad = |path: PathBuf, rank: Option<u64>, reason: String| Error::BadDcpChunk {
        path,
        tensor: key.to_string(),
        rank,
        reason,
    };
    if !dtype.bits().is_multiple_of(8) {
        return Err(bad(meta, None, format!("dtype `{dtype}` is not supported")));
    }
    let elem = dtype.bits() / 8;
    let row_bytes = size.iter().skip(1).try_fold(elem, |a, &d| a.checked_mul(d));
    let total = size.first().and_then(|&n| row_bytes.and_then(|r| r.checked_mul(n)));
    let (Some(row_bytes), Some(_)) = (row_bytes, if size.is_empty() { Some(elem) } else { total }) else {
        return Err(bad(meta, None, format!("size {size:?} overflows")));
    };
    let mut placed: Vec<(u64, u64, Chunk, PathBuf, Option<u64>)> = Vec::with_capacity(chunks.len());
    for c in &chunks {
        let (fi, rank) = files.get(key, &c.storage)?;
        let path = files.list[fi].path.clone();
        let dim0_slice = c.offsets.len() == size.len()
            && c.sizes.len() == size.len()
            && c.offsets.iter().skip(1).all(|&o| o == 0)
            && c.sizes.iter().zip(size).skip(1).all(|(a, b)| a == b);
        if !dim0_slice {
            return Err(bad(
                path,
                rank,
                format!(
                    "chunk at offsets {:?} with sizes {:?} is not a dim-0 slice of size {size:?} \
                     (2-D or other sharding is not supported)",
                    c.offsets, c.sizes
                ),
            ));
        }
        let (start, rows) = match (c.offsets.first(), c.sizes.first()) {
            (Some(&o), Some(&n)) => (o, n),
            _ => (0, 1), // a 0-d tensor: one chunk, the whole value
        };
        let end = start.checked_add(rows);
        let limit = size.first().copied().unwrap_or(1);
        if end.is_none_or(|e| e > limit) {
            return Err(bad(
                path,
                rank,
                format!("chunk at offsets {:?} with sizes {:?} lies outside size {size:?}", c.offsets, c.sizes),
            ));
        }
        let mut chunk = tensor_item(&path, rank, key, dtype, c)?;
        chunk.file = fi;
        if rows > 0 && row_bytes > 0 {
            placed.push((start, rows, chunk, path, rank));
        }
    }
    placed.sort_by_key(|&(start, ..)| start);
    let n = size.first().copied().unwrap_or(1);
    let mut next = 0u64;
    let mut out = Vec::with_capacity(placed.len());
    for (start, rows, chunk, path, rank) in placed {
        if start != next {
            let what = if start < next { "overlaps the previous chunk" } else { "leaves a gap before it" };
            return Err(bad(
                path,
                rank,
                format!("chunk at row {start} ({rows} rows) {what} (rows covered so far: {next})"),
            ));
        }
        next = start + rows;
        out.push(chunk);
    }
    if next != n && row_bytes > 0 {
        return Err(bad(meta, None, format!("chunks cover rows [0, {next}) of {n}")));
    }
    Ok(out)
}
