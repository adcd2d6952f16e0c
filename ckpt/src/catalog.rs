//! The catalog: every checkpoint, whatever its format, read into one view.
//!
//! A catalog lists logical tensors (name, dtype, shape), each made of chunks: byte ranges of
//! source files whose concatenation is the tensor's row-major bytes. A safetensors tensor is one
//! chunk. Operations never look at formats again: they plan range copies from chunks.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::dtype::Dtype;
use crate::error::{Error, IoContext, Result};
use crate::formats::hf_index::{self, Index};
use crate::formats::safetensors::{self as st, Header};

/// The on-disk layout a checkpoint was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// One `.safetensors` file.
    Safetensors,
    /// `model-*.safetensors` shards with a `model.safetensors.index.json`.
    HfSharded,
    /// One `torch.save` file (`.bin`, `.pt`, `.pth`), zip or legacy.
    Torch,
    /// `pytorch_model-*.bin` shards with a `pytorch_model.bin.index.json`.
    TorchSharded,
    /// A `torch.distributed.checkpoint` folder: `.metadata` and `__R_0.distcp` rank files.
    Dcp,
    /// A DeepSpeed ZeRO checkpoint folder (`latest` and a tag folder of rank files), seen as
    /// its merged tensors: buffers, frozen params, fp32 master weights, aliases.
    DeepSpeed,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Safetensors => "safetensors",
            Format::HfSharded => "hf-sharded-safetensors",
            Format::Torch => "torch",
            Format::TorchSharded => "hf-sharded-torch",
            Format::Dcp => "dcp",
            Format::DeepSpeed => "deepspeed-zero",
        }
    }
}

/// A source file of a checkpoint.
#[derive(Clone, Debug)]
pub struct SourceFile {
    pub path: PathBuf,
    pub len: u64,
    /// The file's `__metadata__`, in file order.
    pub metadata: Vec<(String, String)>,
}

/// A byte range of a source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute offset in that file.
    pub offset: u64,
    pub len: u64,
}

/// A logical tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Concatenated in order, these are the tensor's row-major bytes.
    pub chunks: Vec<Chunk>,
}

impl TensorInfo {
    pub fn byte_len(&self) -> u64 {
        self.chunks.iter().map(|c| c.len).sum()
    }
}

/// A checkpoint read into a catalog. Validated: every tensor's bytes are in bounds and sized
/// for its dtype and shape, names are unique.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub(crate) format: Format,
    pub(crate) root: PathBuf,
    pub(crate) files: Vec<SourceFile>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) index: Option<Index>,
}

impl Checkpoint {
    /// Opens a checkpoint: a `.safetensors` file, an index file, a folder holding either, or an
    /// `hf://ORG/NAME[@REV][/PATH]` address resolved in the local Hugging Face cache.
    pub fn open(src: &str) -> Result<Checkpoint> {
        let scan = scan(src)?;
        match scan.problems.into_iter().next() {
            Some(first) => Err(first),
            None => Ok(scan.checkpoint),
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }
    /// The path the checkpoint was opened from (after `hf://` resolution).
    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }
    /// Tensors in load order: shard by shard, each in data-offset order, which is the order
    /// `safetensors.torch.load_file` returns them.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    /// The index's `metadata` when the checkpoint is sharded.
    pub fn index_metadata(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.index.as_ref().map(|i| &i.metadata)
    }
    /// Sum of the tensors' byte sizes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::byte_len).sum()
    }

    /// Reads a tensor's bytes into memory (row-major, little-endian). For inspection and tests;
    /// operations never hold whole tensors.
    pub fn read_tensor(&self, tensor: &TensorInfo) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut out = Vec::with_capacity(usize::try_from(tensor.byte_len()).unwrap_or(0));
        for c in &tensor.chunks {
            let path = &self.files[c.file].path;
            let f = File::open(path).at(path)?;
            let start = out.len();
            out.resize(start + usize::try_from(c.len).unwrap_or(0), 0);
            f.read_exact_at(&mut out[start..], c.offset).at(path)?;
        }
        Ok(out)
    }

    /// The files' `__metadata__`, merged in file order. Shards that disagree on a key are refused.
    pub fn file_metadata(&self) -> Result<Vec<(String, String)>> {
        let mut out: Vec<(String, String)> = Vec::new();
        let mut from: HashMap<String, usize> = HashMap::new();
        for (i, f) in self.files.iter().enumerate() {
            for (k, v) in &f.metadata {
                match from.get(k) {
                    None => {
                        from.insert(k.clone(), i);
                        out.push((k.clone(), v.clone()));
                    }
                    Some(&j) => {
                        let first = out.iter().find(|(kk, _)| kk == k).map(|(_, vv)| vv.clone()).unwrap_or_default();
                        if &first != v {
                            return Err(Error::MetadataConflict {
                                key: k.clone(),
                                first,
                                first_file: self.files[j].path.clone(),
                                second: v.clone(),
                                second_file: f.path.clone(),
                            });
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A catalog plus the problems found while building it. Verification reports all problems;
/// opening fails on the first.
#[derive(Debug)]
pub(crate) struct Scan {
    pub checkpoint: Checkpoint,
    pub problems: Vec<Error>,
}

/// Resolves `src` and reads it. Errors that leave nothing to scan (missing source, unreadable
/// index, bad single file) are returned as `Err`; problems between index and shards are
/// collected so that `verify` can list them all.
pub(crate) fn scan(src: &str) -> Result<Scan> {
    let (format, root) = detect(&crate::hub::resolve(src)?)?;
    scan_detected(format, root)
}

/// Reads a checkpoint whose format [`detect`] already decided.
pub(crate) fn scan_detected(format: Format, root: PathBuf) -> Result<Scan> {
    match format {
        Format::Safetensors => {
            let (file, header) = read_file(&root)?;
            let tensors = header_tensors(&header, 0);
            let checkpoint = Checkpoint { format, root, files: vec![file], tensors, index: None };
            Ok(Scan { checkpoint, problems: Vec::new() })
        }
        Format::HfSharded => scan_index(root),
        Format::Torch | Format::TorchSharded => {
            Ok(Scan { checkpoint: crate::formats::torch::checkpoint(root, format)?, problems: Vec::new() })
        }
        Format::Dcp => Ok(Scan { checkpoint: crate::formats::dcp::checkpoint(&root)?, problems: Vec::new() }),
        Format::DeepSpeed => Ok(Scan { checkpoint: crate::formats::deepspeed::checkpoint(&root)?, problems: Vec::new() }),
    }
}

/// Decides what `path` is: a safetensors file, an index, or a folder holding one of them.
pub(crate) fn detect(path: &Path) -> Result<(Format, PathBuf)> {
    let meta = std::fs::metadata(path).at(path)?;
    if let Some(dir) = crate::formats::dcp::detect(path) {
        return Ok((Format::Dcp, dir));
    }
    if crate::formats::deepspeed::is_zero_checkpoint(path) {
        return Ok((Format::DeepSpeed, path.to_path_buf()));
    }
    if meta.is_file() {
        if let Some(torch) = crate::formats::torch::detect(path) {
            return Ok(torch);
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        return if name.ends_with(".index.json") {
            Ok((Format::HfSharded, path.to_path_buf()))
        } else {
            Ok((Format::Safetensors, path.to_path_buf()))
        };
    }
    let index = path.join(hf_index::INDEX_NAME);
    if index.is_file() {
        return Ok((Format::HfSharded, index));
    }
    let single = path.join(hf_index::SINGLE_NAME);
    if single.is_file() {
        return Ok((Format::Safetensors, single));
    }
    // Any other lone index or lone safetensors file in the folder.
    let mut indexes = Vec::new();
    let mut singles = Vec::new();
    for entry in std::fs::read_dir(path).at(path)? {
        let entry = entry.at(path)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors.index.json") {
            indexes.push(entry.path());
        } else if name.ends_with(".safetensors") {
            singles.push(entry.path());
        }
    }
    match (indexes.as_slice(), singles.as_slice()) {
        ([one], _) => Ok((Format::HfSharded, one.clone())),
        ([], [one]) => Ok((Format::Safetensors, one.clone())),
        _ => crate::formats::torch::detect(path).ok_or_else(|| Error::NotACheckpoint { path: path.to_path_buf() }),
    }
}

fn read_file(path: &Path) -> Result<(SourceFile, Header)> {
    let file = File::open(path).at(path)?;
    let len = file.metadata().at(path)?.len();
    let header = st::read_header_from(&file, len, path)?;
    let metadata = header.metadata.clone().unwrap_or_default();
    Ok((SourceFile { path: path.to_path_buf(), len, metadata }, header))
}

fn header_tensors(header: &Header, file: usize) -> Vec<TensorInfo> {
    let start = header.data_start();
    header
        .tensors
        .iter()
        .map(|t| TensorInfo {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            chunks: vec![Chunk { file, offset: start + t.begin, len: t.end - t.begin }],
        })
        .collect()
}

fn scan_index(index_path: PathBuf) -> Result<Scan> {
    let index = Index::read(&index_path)?;
    let dir = index.dir().to_path_buf();
    let mut problems = Vec::new();

    // Shards in sorted name order: for huggingface_hub's names that is shard order.
    let mut names: Vec<&str> = index.shard_names();
    names.sort_unstable();
    let mut files = Vec::new();
    let mut tensors = Vec::new();
    let mut holder: HashMap<String, usize> = HashMap::new();
    let mut file_of_name: HashMap<&str, usize> = HashMap::new();
    for name in names {
        let path = dir.join(name);
        if !path.exists() {
            // Reported once per missing file, naming the first tensor that needs it.
            if let Some((tensor, _)) = index.weight_map.iter().find(|(_, f)| f == name) {
                problems.push(Error::MissingShard {
                    index: index_path.clone(),
                    tensor: tensor.clone(),
                    file: name.into(),
                });
            }
            continue;
        }
        let (file, header) = match read_file(&path) {
            Ok(x) => x,
            Err(e) => {
                problems.push(e);
                continue;
            }
        };
        let fi = files.len();
        file_of_name.insert(name, fi);
        for t in header_tensors(&header, fi) {
            if let Some(&prev) = holder.get(&t.name) {
                problems.push(Error::DuplicateAcrossShards {
                    tensor: t.name.clone(),
                    first: files.get(prev).map(|f: &SourceFile| f.path.clone()).unwrap_or_default(),
                    second: path.clone(),
                });
                continue;
            }
            holder.insert(t.name.clone(), fi);
            tensors.push(t);
        }
        files.push(file);
    }

    let listed: HashMap<&str, &str> = index.weight_map.iter().map(|(t, f)| (t.as_str(), f.as_str())).collect();
    for (tensor, fname) in &index.weight_map {
        let Some(&fi) = file_of_name.get(fname.as_str()) else {
            continue;
        };
        if holder.get(tensor) != Some(&fi) {
            problems.push(Error::TensorNotInShard {
                index: index_path.clone(),
                tensor: tensor.clone(),
                file: fname.clone(),
            });
        }
    }
    // A tensor listed under another shard is reported above (that shard is missing or lacks
    // it); here only tensors the index does not list at all.
    for t in tensors.iter().filter(|t| !listed.contains_key(t.name.as_str())) {
        let file = t.chunks.first().and_then(|c| files.get(c.file)).map(|f| f.path.clone()).unwrap_or_default();
        problems.push(Error::UnlistedTensor { index: index_path.clone(), file, tensor: t.name.clone() });
    }
    let checkpoint = Checkpoint { format: Format::HfSharded, root: index_path, files, tensors, index: Some(index) };
    Ok(Scan { checkpoint, problems })
}
