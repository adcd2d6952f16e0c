//! From parsed metadata to boxes: every item opened as the `torch.save` zip it is, every chunk
//! located as a box of its tensor (the catalog checks that they tile it).

use crate::read::checksum::{Checks, Record};
use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;

use super::metadata::{self, ChunkMeta, Kind, PathElem, StorageInfo};
use crate::error::{ChunkProblem, Error, IoContext, Result};
use crate::formats::torch::flatten::{self, Leaf};
use crate::formats::torch::pickle::{self, Limits, Obj, Refusal};
use crate::formats::torch::zip;
use crate::read::catalog::{Chunk, SourceFile, TensorBox};
use crate::read::dtype::Dtype;
use fsdp_state::Region;

/// The smallest item a data file can hold: a `torch.save` archive, its `data.pkl` and its
/// zip records (torch's own are over 700 bytes, the payload aligned at 64).
const MIN_ITEM_LEN: u64 = 512;
/// What one item may take in a real `.metadata` (torch's take about 250 bytes: the key, a
/// chunk's offsets and sizes, its file, offset and length), with room for long keys.
const METADATA_PER_ITEM: u64 = 1024;
/// The `.metadata` a checkpoint of small data files may have whatever they hold.
const MIN_METADATA_CAP: u64 = 16 << 20;
/// The largest `.metadata` we read at all (a model with a million chunks stays well below).
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
    /// One box per chunk the metadata lists, empty ones included: more than one means the
    /// tensor was sharded (a DTensor), one means saved whole (a replicated tensor, or a world
    /// of 1).
    pub boxes: Vec<TensorBox>,
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
    read_with(dir, &[])
}

/// Reads the DCP folder `dir`, its non-tensor items admitting the format's own `classes` as
/// inert records besides torch's weights-only globals (Megatron pickles its `args` as an
/// `argparse.Namespace`).
pub(crate) fn read_with(dir: &Path, classes: &'static [&'static str]) -> Result<Dcp> {
    let meta_path = dir.join(super::METADATA_NAME);
    let data = read_metadata(dir, &meta_path)?;
    let md = metadata::parse(&data, &meta_path)?;

    let mut files =
        Files { dir, meta_path: &meta_path, list: Vec::new(), by_name: HashMap::new(), records: Vec::new() };
    let mut tensors = Vec::new();
    let mut bytes = Vec::new();
    // The values of all bytes items are kept together, and many items may name the same bytes:
    // they share one memory budget.
    let values_budget = pickle::Budget::shared(Limits::default());
    for item in md.items {
        match item.kind {
            Kind::Tensor { dtype, size, chunks } => {
                let boxes = tensor_boxes(&mut files, &item.key, dtype, &chunks)?;
                tensors.push(DcpTensor { key: item.key, path: item.path, dtype, shape: size, boxes });
            }
            Kind::Bytes { storage } => {
                let (fi, rank) = files.get(&item.key, &storage)?;
                let path = files.list[fi].path.clone();
                let (value, inner) = read_bytes_item(&path, fi, rank, &item.key, &storage, &values_budget, classes)?;
                for (t, record) in inner {
                    files.records[fi].push(record);
                    tensors.push(t);
                }
                let chunk = Chunk { file: fi, offset: storage.offset, len: storage.length };
                bytes.push(DcpBytes { key: item.key, path: item.path, chunk, value });
            }
        }
    }
    for (f, records) in files.list.iter_mut().zip(files.records) {
        f.checks = Checks::new(records);
    }
    Ok(Dcp { files: files.list, tensors, bytes })
}

/// Reads `.metadata`, refused past what a real one needs for the items the folder's other files
/// can hold: at most one per [`MIN_ITEM_LEN`] bytes, each taking at most [`METADATA_PER_ITEM`].
/// The metadata is read before it names its data files, so every other file of the folder is
/// counted as one.
fn read_metadata(dir: &Path, meta_path: &Path) -> Result<Vec<u8>> {
    let len = std::fs::metadata(meta_path).at(meta_path)?.len();
    let (files, data_len) = data_files(dir, meta_path)?;
    let items = data_len / MIN_ITEM_LEN;
    let cap = items.saturating_mul(METADATA_PER_ITEM).clamp(MIN_METADATA_CAP, MAX_METADATA_LEN);
    if len > cap {
        return Err(Error::DcpMetadataTooLarge {
            path: meta_path.to_path_buf(),
            len,
            cap,
            files,
            data_len,
            items,
            min_item_len: MIN_ITEM_LEN,
            per_item: METADATA_PER_ITEM,
            min_cap: MIN_METADATA_CAP,
        });
    }
    // The cap again, for a file that grows between the two looks.
    crate::read::io::read_capped(meta_path, cap)
}

/// How many plain files besides `.metadata` the folder holds, and their total length.
fn data_files(dir: &Path, meta_path: &Path) -> Result<(u64, u64)> {
    let (mut n, mut total) = (0u64, 0u64);
    for entry in std::fs::read_dir(dir).at(dir)? {
        let entry = entry.at(dir)?;
        if entry.path() == meta_path {
            continue;
        }
        // `DirEntry::metadata` does not follow links; a data file may be one.
        match std::fs::metadata(entry.path()) {
            Ok(m) if m.is_file() => {
                n += 1;
                total = total.saturating_add(m.len());
            }
            _ => {}
        }
    }
    Ok((n, total))
}

/// The data files named by the metadata, opened once each.
struct Files<'a> {
    dir: &'a Path,
    meta_path: &'a Path,
    list: Vec<SourceFile>,
    by_name: HashMap<String, usize>,
    /// The storage records of each file's tensor items, for the CRC checks.
    records: Vec<Vec<Record>>,
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
                if !crate::read::io::is_plain_file_name(name) {
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
                            problem: ChunkProblem::NotAPlainFile,
                        })
                    }
                    Err(e) => return Err(Error::Io { path, source: e }),
                };
                self.list.push(SourceFile { rank, ..SourceFile::new(path, len) });
                self.records.push(Vec::new());
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
                problem: ChunkProblem::PastFile { at: storage.offset, len: storage.length, file_len: f.len },
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
    classes: &'static [&'static str],
) -> Result<(zip::Archive, String, pickle::Pickle)> {
    let bad = |problem| Error::BadDcpChunk { path: path.to_path_buf(), tensor: key.to_string(), rank, problem };
    let file = crate::read::io::open(path)?;
    // An item is a byte range of its data file, read as a zip archive of its own.
    let item = crate::read::io::Window { file: &file, base: storage.offset };
    let archive = zip::Archive::open(&item, storage.length, path)
        .map_err(|e| bad(ChunkProblem::NotAnArchive { at: storage.offset, cause: strip_path(&e, path) }))?;
    // torch names the records `archive/…`; any one-level folder is accepted, as `torch.load` does.
    let found = archive.entries.iter().find_map(|e| match e.name.split_once('/') {
        Some((folder, "data.pkl")) => Some((e, format!("{folder}/"))),
        _ => None,
    });
    let Some((pkl, prefix)) = found else {
        return Err(bad(ChunkProblem::NoDataPkl { at: storage.offset }));
    };
    let data = archive
        .read_entry(&item, pkl, MAX_ITEM_PICKLE)
        .map_err(|e| bad(ChunkProblem::Unreadable { cause: strip_path(&e, path) }))?;
    let how = pickle::Load::default().classes(classes);
    let p = match budget {
        Some(b) => pickle::load(&data, how.charging(b)),
        None => pickle::load(&data, how),
    };
    let p = p.map_err(|r| match r {
        Refusal::Global(global) => Error::RefusedGlobal { path: path.to_path_buf(), global },
        Refusal::Bad { at, reason } => {
            bad(ChunkProblem::Pickle { record: pkl.name.clone(), at: storage.offset, byte: at, cause: reason })
        }
    })?;
    Ok((archive, prefix, p))
}

/// An error's message without its leading `path: ` (the caller names the file itself).
fn strip_path(e: &Error, path: &Path) -> String {
    let text = e.to_string();
    text.strip_prefix(&format!("{}: ", path.display())).map(str::to_string).unwrap_or(text)
}

/// A non-tensor item's value. A format that pickles its own classes there also keeps tensors
/// in its values (Megatron's `rng_state`, a list of dicts of generator states): they are
/// described in the value and read as tensors of their own, named `KEY.<path in the value>`, as
/// torch's `dcp_to_torch_save` gives them. A plain DCP value holds none.
fn read_bytes_item(
    path: &Path,
    fi: usize,
    rank: Option<u64>,
    key: &str,
    storage: &StorageInfo,
    budget: &Rc<pickle::Budget>,
    classes: &'static [&'static str],
) -> Result<(Leaf, Vec<(DcpTensor, Record)>)> {
    let bad = |problem| Error::BadDcpChunk { path: path.to_path_buf(), tensor: key.to_string(), rank, problem };
    let value_bad = |cause| bad(ChunkProblem::Value { at: storage.offset, cause });
    let (archive, prefix, p) = open_item(path, rank, key, storage, Some(budget), classes)?;
    if classes.is_empty() {
        return Ok((flatten::leaf_of(&p).map_err(value_bad)?, Vec::new()));
    }
    let value = flatten::leaf_of_describing_tensors(&p).map_err(value_bad)?;
    let mut inner = Vec::new();
    for (name, t) in flatten::flatten(&p).map_err(value_bad)?.tensors {
        let name = if name.is_empty() { key.to_string() } else { format!("{key}.{name}") };
        let (b, record) = stored_view(&archive, &prefix, &t, fi, storage.offset).map_err(|cause| {
            bad(ChunkProblem::ValueTensor { at: storage.offset, name: name.clone(), cause: Box::new(cause) })
        })?;
        let record = Record { tensor: name.clone(), ..record };
        let tensor = DcpTensor {
            key: name.clone(),
            path: vec![PathElem::Key(name)],
            dtype: t.dtype,
            shape: t.shape,
            boxes: vec![b],
        };
        inner.push((tensor, record));
    }
    Ok((value, inner))
}

/// The box of a tensor `t` pickled in the item at byte `at` of file `fi`: the whole tensor, a
/// view on its storage record, which must be stored uncompressed and hold the elements the
/// pickle declares.
fn stored_view(
    archive: &zip::Archive,
    prefix: &str,
    t: &pickle::TensorRef,
    fi: usize,
    at: u64,
) -> std::result::Result<(TensorBox, Record), ChunkProblem> {
    let rec = format!("{prefix}data/{}", t.storage.key);
    let Some(e) = archive.find(&rec) else {
        return Err(ChunkProblem::NoStorageRecord { at, record: rec });
    };
    if e.method != zip::Method::Stored {
        return Err(ChunkProblem::CompressedStorage { at, record: rec });
    }
    if t.storage.numel.checked_mul(t.storage.kind.elem_bytes()) != Some(e.size) {
        return Err(ChunkProblem::StorageSize { at, record: rec, numel: t.storage.numel, size: e.size });
    }
    // The catalog checks that the view stays inside the storage record.
    let b = TensorBox {
        region: Region::whole(&t.shape),
        file: fi,
        base: at + e.data_offset,
        len: e.size,
        offset: t.offset,
        strides: t.strides.clone(),
    };
    let record = Record { offset: b.base, len: b.len, crc: e.crc, name: rec, item: Some(at), tensor: String::new() };
    Ok((b, record))
}

/// Locates the payload of a tensor item: the chunk's box, viewed through the strides the item
/// keeps (torch saves a chunk whose storage is exactly its bytes as it is, `channels_last` or
/// transposed included).
fn tensor_item(
    path: &Path,
    fi: usize,
    rank: Option<u64>,
    key: &str,
    dtype: Dtype,
    c: &ChunkMeta,
) -> Result<(TensorBox, Record)> {
    let bad = |problem| Error::BadDcpChunk { path: path.to_path_buf(), tensor: key.to_string(), rank, problem };
    let at = c.storage.offset;
    let (archive, prefix, p) = open_item(path, rank, key, &c.storage, None, &[])?;
    let Some(Obj::Tensor(t)) = p.obj(p.root) else {
        return Err(bad(ChunkProblem::NotATensor { at }));
    };
    if t.dtype != dtype {
        return Err(Error::DcpItemDtype {
            path: path.to_path_buf(),
            tensor: key.to_string(),
            rank,
            at,
            found: t.dtype,
            expected: dtype,
        });
    }
    if t.shape != c.sizes {
        return Err(bad(ChunkProblem::Shape {
            at,
            shape: t.shape.clone(),
            offsets: c.offsets.clone(),
            sizes: c.sizes.clone(),
        }));
    }
    let (mut b, record) = stored_view(&archive, &prefix, t, fi, at).map_err(bad)?;
    b.region = Region::new(c.offsets.clone(), c.sizes.clone());
    let record = Record { tensor: key.to_string(), ..record };
    Ok((b, record))
}

/// Locates every chunk of a tensor as a box; the catalog checks that they tile it.
fn tensor_boxes(files: &mut Files<'_>, key: &str, dtype: Dtype, chunks: &[ChunkMeta]) -> Result<Vec<TensorBox>> {
    if !dtype.bits().is_multiple_of(8) {
        return Err(Error::BadDcpChunk {
            path: files.meta_path.to_path_buf(),
            tensor: key.to_string(),
            rank: None,
            problem: ChunkProblem::Dtype { dtype },
        });
    }
    let mut out = Vec::with_capacity(chunks.len());
    for c in chunks {
        let (fi, rank) = files.get(key, &c.storage)?;
        let path = files.list[fi].path.clone();
        let (b, record) = tensor_item(&path, fi, rank, key, dtype, c)?;
        files.records[fi].push(record);
        out.push(b);
    }
    Ok(out)
}
