//! `convert`: any checkpoint we read to safetensors or torch files, one file or sharded.
//!
//! The source becomes a list of tensors, each either byte ranges of a file (safetensors) or a
//! strided window on a storage record (torch). The target is laid out first (a safetensors
//! header, or a torch archive with every header placed, see [`crate::formats::torch::writer`]); then each
//! tensor is either a plain range copy (contiguous and not cast, the common case, done by the
//! kernel) or a job that walks the tensor's runs through a fixed window, casting on the way.
//! Memory is bounded by that window per thread, whatever the model or tensor size; the source
//! pages a job touched are dropped once it is done. Outputs are written to temporaries and
//! renamed only when complete, the index last.
//!
//! Views and tied weights come out as contiguous tensors of their own. With `dedupe`, a tensor
//! that is an exact alias of another (same storage, offset, shape, strides and dtype) is dropped
//! in favour of the first name in sorted order, as safetensors' `save_model` picks it, and the
//! alias is recorded in the metadata (`alias: kept`, huggingface_hub's convention); in torch
//! output the alias is kept and shares the storage instead, as torch itself would save it.
//! Partial views are never dropped.
//!
//! Non-tensor values of a torch source (a `step`, a config) go into safetensors metadata as
//! JSON text (into the index metadata, as JSON values, when sharded), and into the pickle of a
//! torch target (of its first shard).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::cast::{cast_into, is_castable};
use crate::catalog::{Checkpoint, Chunk, Format, SourceFile};
use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::formats::hf_index::{self, Index};
use crate::formats::safetensors::{self as st, OutTensor};
use crate::sys::MappedFile;
use crate::formats::torch::flatten::Leaf;
use crate::formats::torch::writer::{self, TorchLayout, WStorage, WTensor, WValue};
use crate::formats::torch::{self, strided::Runs, TORCH_INDEX_NAME, TORCH_SINGLE_NAME};
use crate::write::{self, Plan, RangeCopy, TargetFile, WriteOptions};

/// The output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetFormat {
    Safetensors,
    Torch,
}

/// What to convert to.
#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// The format; by default from the destination's extension (`.safetensors`, `.bin`/`.pt`/
    /// `.pth`), safetensors for a folder.
    pub to: Option<TargetFormat>,
    /// Cast floating-point tensors (f64, f32, f16, bf16) to this dtype; others are kept.
    pub dtype: Option<Dtype>,
    /// Shard into a folder with files of at most this many bytes (huggingface_hub's layout).
    pub max_shard_size: Option<u64>,
    /// Drop exact aliases instead of writing a copy of each.
    pub dedupe: bool,
}

/// What a conversion wrote.
#[derive(Clone, Debug)]
pub struct ConvertOutcome {
    pub format: TargetFormat,
    pub files: Vec<PathBuf>,
    pub index: Option<PathBuf>,
    pub tensors: usize,
    /// Tensor bytes written (each storage once).
    pub bytes: u64,
    /// `(alias, kept)`: aliases dropped (safetensors) or tied to the kept tensor's storage (torch).
    pub aliases: Vec<(String, String)>,
    /// Names of the non-tensor values carried over.
    pub leaves: Vec<String>,
}

/// Where a source tensor's bytes are.
#[derive(Clone, Debug)]
enum Data {
    /// Row-major bytes: these ranges in order.
    Chunks(Vec<Chunk>),
    /// A strided window on a storage at `base` (absolute file offset) of `len` bytes.
    Strided { file: usize, base: u64, len: u64, offset: u64, strides: Vec<u64> },
}

/// File, storage base, offset, strides, shape, dtype: equal keys read the same bytes.
type AliasKey = (usize, u64, u64, Vec<u64>, Vec<u64>, Dtype);

#[derive(Clone, Debug)]
struct SrcTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    data: Data,
}

impl SrcTensor {
    fn byte_len(&self) -> u64 {
        torch::strided::numel(&self.shape).unwrap_or(0) * (self.dtype.bits() / 8)
    }
    /// Identity of the bytes it reads: equal keys mean exact aliases.
    fn alias_key(&self) -> Option<AliasKey> {
        match &self.data {
            Data::Strided { file, base, offset, strides, .. } => {
                Some((*file, *base, *offset, strides.clone(), self.shape.clone(), self.dtype))
            }
            Data::Chunks(_) => None,
        }
    }
    /// The runs to read, as absolute `(file, offset, len)`.
    fn runs(&self) -> Box<dyn Iterator<Item = (usize, u64, u64)> + '_> {
        match &self.data {
            Data::Chunks(c) => Box::new(c.iter().map(|c| (c.file, c.offset, c.len))),
            Data::Strided { file, base, offset, strides, .. } => {
                let (file, base) = (*file, *base);
                Box::new(
                    Runs::new(*offset, &self.shape, strides, self.dtype.bits() / 8)
                        .map(move |(o, l)| (file, base + o, l)),
                )
            }
        }
    }
    fn is_single_run(&self) -> bool {
        match &self.data {
            Data::Chunks(c) => c.len() <= 1,
            Data::Strided { offset, strides, .. } => {
                Runs::new(*offset, &self.shape, strides, self.dtype.bits() / 8).total() <= 1
            }
        }
    }
}

struct Source {
    root: PathBuf,
    files: Vec<SourceFile>,
    tensors: Vec<SrcTensor>,
    leaves: Vec<(String, Leaf)>,
    /// safetensors `__metadata__` (and index metadata) beyond `format` and `total_size`.
    metadata: Vec<(String, serde_json::Value)>,
}

fn load_source(src: &str) -> Result<Source> {
    let path = crate::hub::resolve(src)?;
    let (format, root) = crate::catalog::detect(&path)?;
    if matches!(format, Format::Torch | Format::TorchSharded) {
        let set = torch::read_set(&root, format)?;
        let mut files = Vec::new();
        let mut tensors = Vec::new();
        let mut leaves = Vec::new();
        for (fi, f) in set.files.into_iter().enumerate() {
            for t in f.tensors {
                let s = f.storages.get(t.storage).cloned().unwrap_or(torch::Storage {
                    key: String::new(),
                    file_offset: 0,
                    byte_len: 0,
                });
                tensors.push(SrcTensor {
                    name: t.name,
                    dtype: t.dtype,
                    shape: t.shape,
                    data: Data::Strided {
                        file: fi,
                        base: s.file_offset,
                        len: s.byte_len,
                        offset: t.offset,
                        strides: t.strides,
                    },
                });
            }
            leaves.extend(f.leaves);
            files.push(SourceFile { path: f.path, len: f.len, metadata: Vec::new() });
        }
        let metadata = set.index.map(|i| index_extras(&i)).unwrap_or_default();
        return Ok(Source { root, files, tensors, leaves, metadata });
    }
    let ck = Checkpoint::open(src)?;
    let mut metadata: Vec<(String, serde_json::Value)> =
        ck.file_metadata()?.into_iter().filter(|(k, _)| k != "format").map(|(k, v)| (k, v.into())).collect();
    if let Some(m) = ck.index_metadata() {
        for (k, v) in m.iter().filter(|(k, _)| *k != "total_size") {
            if !metadata.iter().any(|(kk, _)| kk == k) {
                metadata.push((k.clone(), v.clone()));
            }
        }
    }
    let tensors = ck
        .tensors()
        .iter()
        .map(|t| SrcTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data: Data::Chunks(t.chunks.clone()),
        })
        .collect();
    Ok(Source { root: ck.root().to_path_buf(), files: ck.files().to_vec(), tensors, leaves: Vec::new(), metadata })
}

fn index_extras(i: &Index) -> Vec<(String, serde_json::Value)> {
    i.metadata.iter().filter(|(k, _)| *k != "total_size").map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// One output tensor.
#[derive(Clone, Debug)]
struct Out {
    src: usize,
    dtype: Dtype,
    /// For a torch target with `dedupe`: the output tensor whose storage this one shares.
    tied_to: Option<usize>,
}

impl Out {
    fn byte_len(&self, s: &Source) -> u64 {
        s.tensors.get(self.src).map_or(0, |t| torch::strided::numel(&t.shape).unwrap_or(0) * (self.dtype.bits() / 8))
    }
}

/// A tensor to gather (and cast) into a target at `dst_off`.
#[derive(Clone, Copy, Debug)]
struct Job {
    src: usize,
    to: Dtype,
    dst_off: u64,
}

/// Converts `src` into `dst`.
pub fn convert(src: &str, dst: &Path, opts: &ConvertOptions, wopts: &WriteOptions<'_>) -> Result<ConvertOutcome> {
    let source = load_source(src)?;
    let bad = |reason: String| Error::BadConvert { dst: dst.to_path_buf(), reason };
    let ext = dst.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
    let by_ext = match ext.as_str() {
        "safetensors" => Some(TargetFormat::Safetensors),
        "bin" | "pt" | "pth" => Some(TargetFormat::Torch),
        _ => None,
    };
    let single = by_ext.is_some() && !dst.is_dir();
    let format = match (opts.to, by_ext) {
        (Some(a), Some(b)) if single && a != b => {
            return Err(bad(format!("`--to {}` contradicts the `.{ext}` extension", name_of(a))))
        }
        (Some(a), _) => a,
        (None, Some(b)) if single => b,
        _ => TargetFormat::Safetensors,
    };
    if single && opts.max_shard_size.is_some() {
        return Err(bad("sharded output needs a folder, not a file name".into()));
    }
    if let Some(d) = opts.dtype {
        if !matches!(d, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(bad(format!("`--dtype` must be f32, f16 or bf16, not `{d}`")));
        }
    }

    // Output tensors, with aliases resolved.
    let mut order: Vec<usize> = (0..source.tensors.len()).collect();
    let mut aliases = Vec::new();
    let mut outs: Vec<Out> = Vec::with_capacity(order.len());
    let mut tie_of: HashMap<usize, usize> = HashMap::new();
    if opts.dedupe {
        let mut groups: HashMap<_, Vec<usize>> = HashMap::new();
        for (i, t) in source.tensors.iter().enumerate() {
            if let Some(k) = t.alias_key().filter(|_| t.byte_len() > 0) {
                groups.entry(k).or_default().push(i);
            }
        }
        for members in groups.values().filter(|g| g.len() > 1) {
            let keep = members.iter().copied().min_by(|&a, &b| source.tensors[a].name.cmp(&source.tensors[b].name));
            let Some(keep) = keep else { continue };
            for &m in members.iter().filter(|&&m| m != keep) {
                tie_of.insert(m, keep);
            }
        }
        if format == TargetFormat::Safetensors {
            order.retain(|i| !tie_of.contains_key(i));
        }
        let mut pairs: Vec<(String, String)> =
            tie_of.iter().map(|(&a, &k)| (source.tensors[a].name.clone(), source.tensors[k].name.clone())).collect();
        pairs.sort();
        aliases = pairs;
    }
    let mut out_of_src: HashMap<usize, usize> = HashMap::new();
    for &i in &order {
        let t = &source.tensors[i];
        let dtype = match opts.dtype {
            Some(d) if is_castable(t.dtype) => d,
            _ => t.dtype,
        };
        if format == TargetFormat::Safetensors && !dtype.in_safetensors() {
            return Err(Error::NotInSafetensors { tensor: t.name.clone(), dtype: dtype.to_string() });
        }
        out_of_src.insert(i, outs.len());
        outs.push(Out { src: i, dtype, tied_to: None });
    }
    for o in &mut outs {
        if let Some(k) = tie_of.get(&o.src) {
            o.tied_to = out_of_src.get(k).copied();
        }
    }

    // Shards: tied tensors count once and follow their storage.
    let items: Vec<(usize, u64)> =
        outs.iter().enumerate().map(|(i, o)| (o.tied_to.unwrap_or(i), o.byte_len(&source))).collect();
    let (shards, total) = if single {
        let unique: u64 = items.iter().enumerate().filter(|(i, (k, _))| i == k).map(|(_, (_, s))| s).sum();
        (vec![(0..outs.len()).collect::<Vec<_>>()], unique)
    } else {
        let max = match opts.max_shard_size {
            Some(m) => m,
            None => crate::size::parse_size(crate::size::DEFAULT_MAX_SHARD_SIZE)?,
        };
        crate::ops::assign_shards(&items, max)
    };
    let shards = if shards.is_empty() { vec![Vec::new()] } else { shards };
    let n = shards.len();
    let names: Vec<PathBuf> = (0..n)
        .map(|i| {
            if single {
                dst.to_path_buf()
            } else {
                dst.join(match (format, n) {
                    (TargetFormat::Safetensors, 1) => hf_index::SINGLE_NAME.to_string(),
                    (TargetFormat::Safetensors, _) => hf_index::shard_name(i + 1, n),
                    (TargetFormat::Torch, 1) => TORCH_SINGLE_NAME.to_string(),
                    (TargetFormat::Torch, _) => format!("pytorch_model-{:05}-of-{:05}.bin", i + 1, n),
                })
            }
        })
        .collect();

    let leaf_names: Vec<String> = source.leaves.iter().map(|(k, _)| k.clone()).collect();
    let mut plan = Plan::default();
    let mut jobs: Vec<Vec<Job>> = Vec::with_capacity(n);
    let mut torch_layouts: Vec<Option<TorchLayout>> = Vec::with_capacity(n);
    let mut weight_map = Vec::new();
    for (si, shard) in shards.iter().enumerate() {
        let path = &names[si];
        let mut target_jobs = Vec::new();
        let mut copies = Vec::new();
        let place = |o: &Out, dst_off: u64, copies: &mut Vec<RangeCopy>, jobs: &mut Vec<Job>| {
            let t = &source.tensors[o.src];
            if o.dtype == t.dtype && t.is_single_run() {
                let mut at = dst_off;
                for (file, off, len) in t.runs() {
                    if len > 0 {
                        copies.push(RangeCopy { src: file, src_off: off, dst_off: at, len });
                    }
                    at += len;
                }
            } else if o.byte_len(&source) > 0 {
                jobs.push(Job { src: o.src, to: o.dtype, dst_off });
            }
        };
        match format {
            TargetFormat::Safetensors => {
                let mut meta = vec![("format".to_string(), "pt".to_string())];
                if n == 1 {
                    meta.extend(user_metadata(&source, &aliases).into_iter().map(|(k, v)| (k, json_text(&v))));
                }
                let tensors: Vec<OutTensor> = shard
                    .iter()
                    .map(|&i| {
                        let o = &outs[i];
                        let t = &source.tensors[o.src];
                        OutTensor {
                            name: t.name.clone(),
                            dtype: o.dtype,
                            shape: t.shape.clone(),
                            len: o.byte_len(&source),
                        }
                    })
                    .collect();
                let layout = st::layout(tensors, &meta, path)?;
                let at: HashMap<&str, u64> = layout.tensors.iter().map(|(t, off)| (t.name.as_str(), *off)).collect();
                for &i in shard {
                    let o = &outs[i];
                    let name = source.tensors[o.src].name.as_str();
                    place(o, at.get(name).copied().unwrap_or(0), &mut copies, &mut target_jobs);
                }
                plan.targets.push(TargetFile { path: path.clone(), head: layout.head, len: layout.file_len, copies });
                torch_layouts.push(None);
            }
            TargetFormat::Torch => {
                let mut storages: Vec<WStorage> = Vec::new();
                let mut storage_of: HashMap<usize, usize> = HashMap::new();
                let mut entries = Vec::with_capacity(shard.len());
                for &i in shard {
                    let o = &outs[i];
                    let t = &source.tensors[o.src];
                    let owner = o.tied_to.filter(|k| shard.contains(k)).unwrap_or(i);
                    let sidx = *storage_of.entry(owner).or_insert_with(|| {
                        storages.push(WStorage { dtype: o.dtype, byte_len: o.byte_len(&source) });
                        storages.len() - 1
                    });
                    entries.push((
                        t.name.clone(),
                        WValue::Tensor(WTensor { dtype: o.dtype, shape: t.shape.clone(), storage: sidx, offset: 0 }),
                    ));
                }
                if si == 0 {
                    entries.extend(source.leaves.iter().map(|(k, v)| (k.clone(), WValue::Leaf(v.clone()))));
                }
                let layout = writer::layout(&writer::archive_name(path), &entries, &storages, path)?;
                for &i in shard {
                    let o = &outs[i];
                    let owner = o.tied_to.filter(|k| shard.contains(k)).unwrap_or(i);
                    if owner != i {
                        continue;
                    }
                    let off = storage_of.get(&i).and_then(|&s| layout.storage_offsets.get(s)).copied().unwrap_or(0);
                    place(o, off, &mut copies, &mut target_jobs);
                }
                plan.targets.push(TargetFile { path: path.clone(), head: Vec::new(), len: layout.file_len, copies });
                torch_layouts.push(Some(layout));
            }
        }
        let fname = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        weight_map.extend(shard.iter().map(|&i| (source.tensors[outs[i].src].name.clone(), fname.clone())));
        jobs.push(target_jobs);
    }
    let mut index = None;
    if !single && n > 1 {
        let mut meta = serde_json::Map::new();
        meta.insert("total_size".into(), total.into());
        for (k, v) in user_metadata(&source, &aliases) {
            meta.insert(k, v);
        }
        let index_path = dst.join(if format == TargetFormat::Torch { TORCH_INDEX_NAME } else { hf_index::INDEX_NAME });
        plan.trailers.push((index_path.clone(), hf_index::render(&meta, &weight_map)));
        index = Some(index_path);
    }
    if !single {
        let (stem, ext) = match format {
            TargetFormat::Safetensors => ("model", ".safetensors"),
            TargetFormat::Torch => ("pytorch_model", ".bin"),
        };
        plan.stale =
            write::stale_files(dst, |n| hf_index::is_managed_name(n, stem, ext), |n| n.ends_with(".index.json"))?;
    }
    plan.protected.push(source.root.clone());

    let maps: Vec<OnceLock<std::result::Result<MappedFile, String>>> =
        source.files.iter().map(|_| OnceLock::new()).collect();
    let finish = |ti: usize, file: &File, tmp: &Path| -> Result<()> {
        let layout = torch_layouts.get(ti).and_then(Option::as_ref);
        if let Some(l) = layout {
            l.write_fixed(file, tmp)?;
        }
        for job in jobs.get(ti).map(Vec::as_slice).unwrap_or_default() {
            run_job(&source, &maps, job, file, tmp, wopts)?;
        }
        if let Some(l) = layout {
            l.finish(file, tmp)?;
        }
        Ok(())
    };
    write::execute_with(&plan, &source.files, wopts, &finish)?;
    Ok(ConvertOutcome { format, files: names, index, tensors: outs.len(), bytes: total, aliases, leaves: leaf_names })
}

fn name_of(f: TargetFormat) -> &'static str {
    match f {
        TargetFormat::Safetensors => "safetensors",
        TargetFormat::Torch => "torch",
    }
}

/// Metadata for the outputs beyond `format`: the source's own, the non-tensor values, and the
/// dropped aliases.
fn user_metadata(s: &Source, aliases: &[(String, String)]) -> Vec<(String, serde_json::Value)> {
    let mut out: Vec<(String, serde_json::Value)> = s.metadata.clone();
    for (k, v) in &s.leaves {
        if k != "format" && k != "total_size" {
            out.push((k.clone(), v.to_json()));
        }
    }
    for (a, k) in aliases {
        out.push((a.clone(), k.clone().into()));
    }
    out
}

fn json_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Gathers one tensor through a bounded window, casting, and writes it at `job.dst_off`.
fn run_job(
    s: &Source,
    maps: &[OnceLock<std::result::Result<MappedFile, String>>],
    job: &Job,
    dst: &File,
    dst_path: &Path,
    wopts: &WriteOptions<'_>,
) -> Result<()> {
    const WINDOW: usize = 8 << 20;
    let Some(t) = s.tensors.get(job.src) else { return Ok(()) };
    let mut inbuf: Vec<u8> = Vec::with_capacity(WINDOW);
    let mut outbuf: Vec<u8> = Vec::new();
    let mut at = job.dst_off;
    let mut touched: Vec<(usize, u64, u64)> = Vec::new();
    let mut flush = |inbuf: &mut Vec<u8>, at: &mut u64| -> Result<()> {
        outbuf.clear();
        cast_into(inbuf, t.dtype, job.to, &mut outbuf);
        dst.write_all_at(&outbuf, *at).at(dst_path)?;
        *at += outbuf.len() as u64;
        if let Some(p) = wopts.progress {
            p(outbuf.len() as u64);
        }
        inbuf.clear();
        Ok(())
    };
    for (file, off, len) in t.runs() {
        let map = map_of(s, maps, file)?;
        let path = &s.files[file].path;
        match touched.last_mut() {
            Some((f, o, l)) if *f == file && *o + *l == off => *l += len,
            _ => touched.push((file, off, len)),
        }
        let mut done = 0u64;
        while done < len {
            let room = (WINDOW - inbuf.len()) as u64;
            let n = (len - done).min(room);
            let bytes = map.get(off + done, n).ok_or_else(|| Error::Io {
                path: path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "tensor bytes past the end of the file"),
            })?;
            inbuf.extend_from_slice(bytes);
            done += n;
            if inbuf.len() == WINDOW {
                flush(&mut inbuf, &mut at)?;
            }
        }
        if touched.len() > 4096 {
            release(s, maps, &mut touched, t);
        }
    }
    if !inbuf.is_empty() {
        flush(&mut inbuf, &mut at)?;
    }
    release(s, maps, &mut touched, t);
    Ok(())
}

/// Drops the source pages a job read: the storage span for strided tensors, else the ranges.
fn release(
    s: &Source,
    maps: &[OnceLock<std::result::Result<MappedFile, String>>],
    touched: &mut Vec<(usize, u64, u64)>,
    t: &SrcTensor,
) {
    if let Data::Strided { file, base, len, .. } = &t.data {
        if let Some(Some(Ok(m))) = maps.get(*file).map(OnceLock::get) {
            m.release(*base, *len);
        }
        touched.clear();
        return;
    }
    for (file, off, len) in touched.drain(..) {
        if let Some(Some(Ok(m))) = maps.get(file).map(OnceLock::get) {
            m.release(off, len);
        }
    }
    let _ = s;
}

fn map_of<'m>(
    s: &Source,
    maps: &'m [OnceLock<std::result::Result<MappedFile, String>>],
    file: usize,
) -> Result<&'m MappedFile> {
    let (Some(slot), Some(sf)) = (maps.get(file), s.files.get(file)) else {
        return Err(Error::BadConvert { dst: PathBuf::new(), reason: "source file index out of range".into() });
    };
    let m = slot.get_or_init(|| File::open(&sf.path).and_then(|f| MappedFile::open(&f)).map_err(|e| e.to_string()));
    m.as_ref().map_err(|e| Error::Io { path: sf.path.clone(), source: std::io::Error::other(e.clone()) })
}
