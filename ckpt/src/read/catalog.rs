//! The catalog: every checkpoint, whatever its format, read into one view.
//!
//! A catalog lists logical tensors (name, dtype, shape), each described by where its bytes are
//! in the source files ([`TensorData`]): byte ranges whose concatenation is the row-major tensor
//! (a safetensors tensor, a ZeRO parameter's slices of the flat rank partitions), or *boxes*
//! ([`TensorBox`]): N-D regions of the tensor, each a strided view on a stored buffer. A torch
//! tensor is one box, the whole tensor, viewed through its strides; a DCP tensor is one box per
//! saved chunk, on any dims (FSDP2 on dim 0, tensor parallel on dim 1, both on a 2-D mesh), each
//! possibly strided itself (a `channels_last` chunk). [`Checkpoint::new`] checks that a tensor's
//! boxes tile it exactly, once for every format. Reading the tensor row-major merges the boxes'
//! runs in order ([`TensorInfo::runs`]). A tensor also says
//! the dtype its bytes are stored in, which may differ from the dtype it is written as (ZeRO's
//! bf16 frozen parameters merge to fp32). Operations never look inside a format's source again:
//! they plan copies from these descriptions, and ask the source's format (its `FormatOps`) for
//! what only the format knows (its merge, its reshard, its optimizer's state).
//!
//! This module is types only. Readers live in `formats/`; every one of them builds its
//! [`Checkpoint`] through [`Checkpoint::new`], the one place that checks the catalog's
//! invariants.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{BoxProblem, EntryProblem, Error, Result};
use crate::read::dtype::Dtype;
use crate::read::shape::{self, Walk};
use crate::read::value::Leaf;
use fsdp_state::Region;

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
    /// DCP's Hugging Face storage (`HuggingFaceStorageWriter(save_distributed=True)`): one
    /// `shard-R-model-K-of-N.safetensors` per rank and output file, each tensor's box offsets in
    /// `__metadata__`.
    DcpSafetensors,
    /// A DeepSpeed ZeRO checkpoint folder (`latest` and a tag folder of rank files), seen as
    /// its merged tensors: buffers, frozen params, fp32 master weights, aliases.
    DeepSpeed,
    /// An accelerate `save_state` folder: models, optimizers, schedulers, RNG and data
    /// position files; seen as its first model, every component in [`Checkpoint::save_state`].
    AccelerateState,
    /// A Megatron-Core `dist_checkpointing` folder (`--ckpt-format torch_dist`): DCP with
    /// megatron's keys and stacked layers, seen as the model megatron holds on one rank.
    MegatronTorchDist,
    /// A Megatron-LM legacy save (`--ckpt-format torch`): one `model_optim_rng.pt` per
    /// model-parallel rank, seen as the model megatron holds on one rank.
    MegatronLegacy,
    /// A transformers `Trainer` `checkpoint-N/` folder: a `save_state` folder with the
    /// `Trainer`'s own files (`trainer_state.json`, `rng_state_R.pth`, `optimizer.pt`, ...).
    Trainer,
}

impl Format {
    /// The name `inspect` and `verify` print.
    pub fn name(self) -> &'static str {
        match self {
            Format::Safetensors => "safetensors",
            Format::HfSharded => "hf-sharded-safetensors",
            Format::Torch => "torch",
            Format::TorchSharded => "hf-sharded-torch",
            Format::Dcp => "dcp",
            Format::DcpSafetensors => "dcp-safetensors",
            Format::DeepSpeed => "deepspeed-zero",
            Format::AccelerateState => "accelerate-state",
            Format::Trainer => "trainer",
            Format::MegatronTorchDist => "megatron-torch-dist",
            Format::MegatronLegacy => "megatron-legacy",
        }
    }
}

/// A source file of a checkpoint.
#[derive(Clone, Debug)]
pub struct SourceFile {
    /// Where it is.
    pub path: PathBuf,
    /// Its size in bytes when it was opened.
    pub len: u64,
    /// The file's `__metadata__` (safetensors), in file order.
    pub metadata: Vec<(String, String)>,
    /// The rank that wrote it, for the rank files of sharded checkpoints.
    pub rank: Option<u64>,
    /// The globals its pickle names (torch files), as written, in first-seen order.
    pub globals: Vec<String>,
    /// Bytes decoded from the file rather than stored in it (a torch file's numpy arrays),
    /// addressed from `len` on: `[len, len + inline.len())`.
    pub(crate) inline: Inline,
    /// The CRC-covered records its tensors read (zip storages), checked on first read.
    pub(crate) checks: crate::read::checksum::Checks,
}

/// Bytes held in memory for a source file, shared by the clones of its catalog.
#[derive(Clone, Default)]
pub(crate) struct Inline(pub Option<std::sync::Arc<[u8]>>);

impl std::fmt::Debug for Inline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Inline({} bytes)", self.len())
    }
}

impl Inline {
    pub(crate) fn len(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.len() as u64)
    }
}

impl SourceFile {
    /// A file of `len` bytes with no metadata and no rank.
    pub(crate) fn new(path: PathBuf, len: u64) -> SourceFile {
        SourceFile {
            path,
            len,
            metadata: Vec::new(),
            rank: None,
            globals: Vec::new(),
            inline: Inline::default(),
            checks: Default::default(),
        }
    }

    /// Holds `bytes` decoded from the file, addressed past its end.
    pub(crate) fn set_inline(&mut self, bytes: Vec<u8>) {
        self.inline = Inline((!bytes.is_empty()).then(|| std::sync::Arc::from(bytes)));
    }

    /// The end of what its tensors may address: the file, then the bytes decoded from it.
    pub(crate) fn extent(&self) -> u64 {
        self.len.saturating_add(self.inline.len())
    }
}

/// A byte range of a source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute offset in that file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Where a tensor's stored bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TensorData {
    /// The row-major bytes are these ranges, concatenated.
    Ranges(Vec<Chunk>),
    /// N-D boxes that tile the tensor, each a strided view on stored bytes.
    Boxes(Vec<TensorBox>),
}

/// A box of a tensor and where its elements are: the elements of `region` of the global tensor
/// are a strided view (`offset` and `strides` in elements, one stride per dim of the region) on
/// the storage of `len` bytes at absolute offset `base` of `file`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorBox {
    /// Where the box sits in the global tensor.
    pub region: Region,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute offset of its storage in that file.
    pub base: u64,
    /// Bytes of its storage.
    pub len: u64,
    /// Element offset of the view in the storage.
    pub offset: u64,
    /// Element strides of the view, one per dim.
    pub strides: Vec<u64>,
}

impl TensorBox {
    /// A box that is the whole tensor of `shape`: a torch tensor's view on its storage.
    pub(crate) fn whole(shape: &[u64], file: usize, base: u64, len: u64, offset: u64, strides: Vec<u64>) -> TensorBox {
        TensorBox { region: Region::whole(shape), file, base, len, offset, strides }
    }

    /// The box's runs placed in the row-major order of the tensor whose contiguous strides are
    /// `dst_strides`: `(tensor byte offset, byte offset from the storage start, length)`.
    fn walk(&self, dst_strides: &[u64], elem: u64) -> Walk {
        let dst_offset: u64 = self.region.offsets.iter().zip(dst_strides).map(|(&o, &s)| o * s).sum();
        Walk::new(self.offset, &self.region.sizes, &self.strides, dst_offset, dst_strides, elem)
    }
}

/// File, storage base, offset, strides, shape, dtype: equal keys read the same bytes.
pub(crate) type AliasKey<'a> = (usize, u64, u64, &'a [u64], &'a [u64], Dtype);

/// A logical tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Its name in the state dict.
    pub name: String,
    /// The dtype it has (and is written as, unless an operation casts it).
    pub dtype: Dtype,
    /// Its global shape.
    pub shape: Vec<u64>,
    /// The dtype its bytes are stored in; differs from `dtype` only where reading means casting.
    pub(crate) stored: Dtype,
    pub(crate) data: TensorData,
}

impl TensorInfo {
    /// A tensor whose stored bytes are `chunks`, concatenated.
    pub(crate) fn ranges(name: String, dtype: Dtype, shape: Vec<u64>, chunks: Vec<Chunk>) -> TensorInfo {
        TensorInfo { name, dtype, shape, stored: dtype, data: TensorData::Ranges(chunks) }
    }

    /// Elements in the tensor (the catalog's constructor checked that this fits).
    pub fn numel(&self) -> u64 {
        shape::numel(&self.shape).unwrap_or(0)
    }

    /// Bytes of the tensor in its dtype (what an operation writes, uncast).
    pub fn byte_len(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.bits() / 8)
    }

    /// Bytes it occupies as stored.
    pub(crate) fn stored_len(&self) -> u64 {
        self.numel().saturating_mul(self.stored.bits() / 8)
    }

    /// The source file and offset of its first byte, when it has bytes.
    pub fn location(&self) -> Option<(usize, u64)> {
        match &self.data {
            TensorData::Ranges(c) => c.iter().find(|c| c.len > 0).or(c.first()).map(|c| (c.file, c.offset)),
            TensorData::Boxes(b) => b
                .iter()
                .find(|b| !b.region.is_empty())
                .or(b.first())
                .map(|b| (b.file, b.base.saturating_add(b.offset.saturating_mul(self.stored.bits() / 8)))),
        }
    }

    /// The boxes it is made of, when it is read as boxes (torch views, DCP chunks).
    pub fn boxes(&self) -> &[TensorBox] {
        match &self.data {
            TensorData::Boxes(b) => b,
            TensorData::Ranges(_) => &[],
        }
    }

    /// The source file and offset of its bytes when they lie in one contiguous run, stored in
    /// its own dtype: what a reader can map without copying (safetensors tensors, contiguous
    /// torch tensors). `None` when reading it means gathering runs or casting.
    pub fn contiguous(&self) -> Option<(usize, u64)> {
        if self.stored != self.dtype {
            return None;
        }
        let mut runs = self.runs();
        match (runs.next(), runs.next()) {
            (None, _) => self.location(),
            (Some((file, offset, len)), None) if len == self.byte_len() => Some((file, offset)),
            _ => None,
        }
    }

    /// The stored bytes as absolute `(file, offset, len)` runs, in row-major order; adjacent
    /// runs of one range or box are merged. Several boxes are merged by their place in the
    /// tensor: the boxes tile it, so the runs follow each other with no gap.
    pub(crate) fn runs(&self) -> Box<dyn Iterator<Item = (usize, u64, u64)> + Send + '_> {
        match &self.data {
            TensorData::Ranges(c) => Box::new(c.iter().filter(|c| c.len > 0).map(|c| (c.file, c.offset, c.len))),
            TensorData::Boxes(boxes) => {
                let elem = self.stored.bits() / 8;
                let dst = shape::contiguous_strides(&self.shape).unwrap_or_else(|| vec![0; self.shape.len()]);
                let mut live = boxes.iter().filter(|b| !b.region.is_empty());
                match (live.next(), live.next()) {
                    (None, _) => Box::new(std::iter::empty()),
                    (Some(b), None) => {
                        let (file, base) = (b.file, b.base);
                        Box::new(b.walk(&dst, elem).map(move |(_, off, len)| (file, base + off, len)))
                    }
                    _ => Box::new(MergedRuns::new(boxes, &dst, elem)),
                }
            }
        }
    }

    /// The stretches of its files it reads from, `(file, offset, len)`: its ranges, or the
    /// storages its boxes view.
    pub(crate) fn extents(&self) -> Box<dyn Iterator<Item = (usize, u64, u64)> + '_> {
        match &self.data {
            TensorData::Ranges(c) => Box::new(c.iter().map(|c| (c.file, c.offset, c.len))),
            TensorData::Boxes(b) => Box::new(b.iter().map(|b| (b.file, b.base, b.len))),
        }
    }

    /// How many runs [`TensorInfo::runs`] yields (at most; boxes that happen to abut in one file
    /// are counted apart).
    pub(crate) fn run_count(&self) -> u64 {
        match &self.data {
            TensorData::Ranges(c) => c.iter().filter(|c| c.len > 0).count() as u64,
            TensorData::Boxes(boxes) => {
                let elem = self.stored.bits() / 8;
                let dst = shape::contiguous_strides(&self.shape).unwrap_or_else(|| vec![0; self.shape.len()]);
                boxes.iter().filter(|b| !b.region.is_empty()).map(|b| b.walk(&dst, elem).total()).sum()
            }
        }
    }

    /// For a view that reads its storage's bytes many times over (a broadcast), the bytes it
    /// would write and the size of the storage behind it. Writing one costs time and space in
    /// proportion to the output, which a tiny file can make arbitrarily large.
    pub(crate) fn expansion(&self) -> Option<(u64, u64)> {
        /// Views up to this size are written whatever their storage.
        const SMALL: u64 = 64 << 20;
        /// How much larger than its storage a view may be before it counts as a broadcast.
        const FACTOR: u64 = 16;
        match &self.data {
            TensorData::Boxes(boxes) => {
                let len = boxes.iter().map(|b| b.len).fold(0u64, u64::saturating_add);
                let out = self.byte_len().max(self.stored_len());
                (out > SMALL && out > len.saturating_mul(FACTOR)).then_some((out, len))
            }
            TensorData::Ranges(_) => None,
        }
    }

    /// The stored bytes as ranges, adjacent runs merged, for writers that slice tensors by byte
    /// (DCP rows). One range per run: callers bound [`TensorInfo::run_count`] first (tensors of
    /// many runs are gathered instead).
    pub(crate) fn byte_ranges(&self) -> Vec<Chunk> {
        let mut out: Vec<Chunk> = Vec::new();
        for (file, offset, len) in self.runs() {
            match out.last_mut() {
                Some(c) if c.file == file && c.offset + c.len == offset => c.len += len,
                _ => out.push(Chunk { file, offset, len }),
            }
        }
        out
    }

    /// Identity of the bytes it reads: tensors with equal keys are exact aliases (torch's tied
    /// weights). Only whole views have one; ranges and tensors of several boxes never alias.
    pub(crate) fn alias_key(&self) -> Option<AliasKey<'_>> {
        match self.boxes() {
            [b] if b.region.is_whole(&self.shape) => {
                Some((b.file, b.base, b.offset, b.strides.as_slice(), self.shape.as_slice(), self.dtype))
            }
            _ => None,
        }
    }
}

/// A checkpoint read into a catalog. Valid by construction (one validating constructor): every
/// tensor's bytes are in bounds of its files and sized for its dtype and shape, names are unique.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub(crate) format: Format,
    pub(crate) root: PathBuf,
    pub(crate) files: Vec<SourceFile>,
    pub(crate) tensors: Vec<TensorInfo>,
    /// The index's `metadata`, for sharded checkpoints.
    pub(crate) index_metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Non-tensor values (a torch file's `step`, a DCP optimizer's `param_groups`), by dotted name.
    pub(crate) values: Vec<(String, Leaf)>,
    /// For sharded checkpoints: the number of ranks that saved it.
    pub(crate) world_size: Option<u64>,
    /// For DeepSpeed checkpoints: the ZeRO stage.
    pub(crate) zero_stage: Option<u8>,
    /// Every file the source consists of, which no operation may write, replace or delete.
    pub(crate) members: Vec<PathBuf>,
    /// What the format keeps of its source for the operations that are more than copying the
    /// catalog (resharding, the ZeRO optimizer states). Only the format that put it there looks
    /// inside, so the catalog need not know the formats' types.
    pub(crate) detail: Option<Detail>,
}

/// A format's own view of its source, see [`Checkpoint::detail`].
pub(crate) type Detail = Arc<dyn Any + Send + Sync>;

/// The parts a reader hands to [`Checkpoint::new`].
#[derive(Debug)]
pub(crate) struct Parts {
    pub format: Format,
    pub root: PathBuf,
    pub files: Vec<SourceFile>,
    pub tensors: Vec<TensorInfo>,
    pub index_metadata: Option<serde_json::Map<String, serde_json::Value>>,
    pub values: Vec<(String, Leaf)>,
    pub world_size: Option<u64>,
    pub zero_stage: Option<u8>,
    pub detail: Option<Detail>,
    /// Files the source consists of beyond its data files and root (`.metadata`, `latest`,
    /// helper files).
    pub members: Vec<PathBuf>,
}

impl Parts {
    pub(crate) fn new(format: Format, root: PathBuf, files: Vec<SourceFile>, tensors: Vec<TensorInfo>) -> Parts {
        Parts {
            format,
            root,
            files,
            tensors,
            index_metadata: None,
            values: Vec::new(),
            world_size: None,
            zero_stage: None,
            detail: None,
            members: Vec::new(),
        }
    }
}

impl Checkpoint {
    /// The one validating constructor: names unique, sizes computable without overflow, every
    /// byte in bounds of its file.
    pub(crate) fn new(p: Parts) -> Result<Checkpoint> {
        let mut seen = HashSet::with_capacity(p.tensors.len());
        for t in &p.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(Error::DuplicateTensor { path: p.root.clone(), tensor: t.name.clone() });
            }
            check_tensor(&p, t)?;
        }
        let mut members = own_members(&p);
        members.extend(p.members);
        Ok(Checkpoint {
            members,
            format: p.format,
            root: p.root,
            files: p.files,
            tensors: p.tensors,
            index_metadata: p.index_metadata,
            values: p.values,
            world_size: p.world_size,
            zero_stage: p.zero_stage,
            detail: p.detail,
        })
    }

    /// The parts of this checkpoint's tensors, values and files, as `format` at `root` (a
    /// folder seen as one of its members). The format's own detail is not carried over.
    pub(crate) fn parts_copy(&self, format: Format, root: PathBuf) -> Parts {
        let mut p = Parts::new(format, root, self.files.clone(), self.tensors.clone());
        p.index_metadata = self.index_metadata.clone();
        p.values = self.values.clone();
        p.world_size = self.world_size;
        p.zero_stage = self.zero_stage;
        p
    }

    /// Every file the checkpoint consists of (data files, index or metadata, manifests, helper
    /// files): no operation writes, replaces or deletes any of them.
    pub fn members(&self) -> &[PathBuf] {
        &self.members
    }

    /// The format it was read as.
    pub fn format(&self) -> Format {
        self.format
    }
    /// The path the checkpoint was opened from (after `hf://` resolution and detection).
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// The files its tensors are read from.
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }
    /// Tensors in load order: for safetensors shard by shard, each in data-offset order, which
    /// is the order `safetensors.torch.load_file` returns them.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    /// The index's `metadata` when the checkpoint is sharded.
    pub fn index_metadata(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.index_metadata.as_ref()
    }
    /// The non-tensor values it holds (a torch file's `step`, optimizer `param_groups`), by dotted
    /// name, as JSON.
    pub fn values(&self) -> Vec<(&str, serde_json::Value)> {
        self.values.iter().map(|(k, v)| (k.as_str(), v.to_json())).collect()
    }
    /// The number of ranks a sharded checkpoint was saved by (DCP: its rank files; ZeRO: its
    /// data-parallel world).
    pub fn world_size(&self) -> Option<u64> {
        self.world_size
    }
    /// The ZeRO stage (1, 2 or 3) of a DeepSpeed checkpoint.
    pub fn zero_stage(&self) -> Option<u8> {
        self.zero_stage
    }

    /// The format's own view of its source, when it is a `T`.
    pub(crate) fn detail<T: Any>(&self) -> Option<&T> {
        self.detail.as_deref().and_then(|d| d.downcast_ref::<T>())
    }
    /// Sum of the tensors' byte sizes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::byte_len).sum()
    }

    /// The file and offset of a tensor's bytes when a reader may map them from the file as they
    /// are: [`TensorInfo::contiguous`], and stored in the file rather than decoded from its
    /// pickle (a numpy array in a torch file is read with [`Checkpoint::read_tensor_into`]).
    pub fn mappable(&self, tensor: &TensorInfo) -> Option<(usize, u64)> {
        tensor
            .contiguous()
            .filter(|&(f, off)| self.files.get(f).is_some_and(|f| off.saturating_add(tensor.byte_len()) <= f.len))
    }

    /// True when the tensor's bytes are decoded from its file's pickle (a numpy array) rather
    /// than stored in the file.
    pub fn is_decoded(&self, tensor: &TensorInfo) -> bool {
        tensor.location().is_some_and(|(f, off)| self.files.get(f).is_some_and(|f| off >= f.len && f.inline.len() > 0))
    }

    /// Reads a tensor's bytes into memory (row-major, little-endian, in its dtype). For
    /// inspection and tests; operations never hold whole tensors.
    pub fn read_tensor(&self, tensor: &TensorInfo) -> Result<Vec<u8>> {
        let sources = crate::read::io::Sources::of(&self.files)?;
        let mut raw = Vec::with_capacity(usize::try_from(tensor.stored_len()).unwrap_or(0));
        for (file, offset, len) in tensor.runs() {
            raw.extend_from_slice(sources.read(file, offset, len)?);
        }
        if tensor.stored == tensor.dtype {
            return Ok(raw);
        }
        let mut out = Vec::with_capacity(usize::try_from(tensor.byte_len()).unwrap_or(0));
        crate::map::cast::cast_into(&raw, tensor.stored, tensor.dtype, &mut out);
        Ok(out)
    }

    /// Reads a tensor's bytes into `out`, which must be exactly [`TensorInfo::byte_len`] long
    /// (row-major, little-endian, in its dtype): [`Checkpoint::read_tensor`] into a buffer the
    /// caller owns (the Python bindings read into a numpy array this way).
    pub fn read_tensor_into(&self, tensor: &TensorInfo, out: &mut [u8]) -> Result<()> {
        self.read_tensors_into(&mut [(tensor, out)])
    }

    /// [`Checkpoint::read_tensor_into`] for many tensors, opening the source files once.
    pub fn read_tensors_into(&self, jobs: &mut [(&TensorInfo, &mut [u8])]) -> Result<()> {
        let sources = crate::read::io::Sources::of(&self.files)?;
        for (tensor, out) in jobs.iter_mut() {
            let have = out.len();
            let wrong = || Error::WrongBufferLen {
                path: self.root.clone(),
                tensor: tensor.name.clone(),
                expected: tensor.byte_len(),
                found: have as u64,
            };
            if u64::try_from(have).ok() != Some(tensor.byte_len()) {
                return Err(wrong());
            }
            if tensor.stored != tensor.dtype {
                let bytes = self.read_tensor(tensor)?;
                if bytes.len() != have {
                    return Err(wrong());
                }
                out.copy_from_slice(&bytes);
                continue;
            }
            let mut at = 0usize;
            for (file, offset, len) in tensor.runs() {
                let piece = sources.read(file, offset, len)?;
                let end = at.checked_add(piece.len()).filter(|e| *e <= have).ok_or_else(wrong)?;
                out[at..end].copy_from_slice(piece);
                at = end;
            }
            if at != have {
                return Err(wrong());
            }
        }
        Ok(())
    }

    /// Reads bytes `range` of a tensor (row-major, little-endian, in its dtype): a rank's rows
    /// of a sharded tensor without reading the others'. Only the source runs that overlap the
    /// range are read.
    pub fn read_tensor_range(&self, tensor: &TensorInfo, range: std::ops::Range<u64>) -> Result<Vec<u8>> {
        if tensor.stored != tensor.dtype {
            let all = self.read_tensor(tensor)?;
            let (lo, hi) =
                (usize::try_from(range.start).unwrap_or(usize::MAX), usize::try_from(range.end).unwrap_or(usize::MAX));
            return Ok(all.get(lo..hi.min(all.len())).unwrap_or_default().to_vec());
        }
        let sources = crate::read::io::Sources::of(&self.files)?;
        let mut out = Vec::with_capacity(usize::try_from(range.end.saturating_sub(range.start)).unwrap_or(0));
        let mut at = 0u64;
        for (file, offset, len) in tensor.runs() {
            let (lo, hi) = (at.max(range.start), (at + len).min(range.end));
            if lo < hi {
                out.extend_from_slice(sources.read(file, offset + (lo - at), hi - lo)?);
            }
            at += len;
            if at >= range.end {
                break;
            }
        }
        Ok(out)
    }

    /// The files' `__metadata__`, merged in file order. Shards that disagree on a key are refused.
    pub fn file_metadata(&self) -> Result<Vec<(String, String)>> {
        let mut out: Vec<(String, String)> = Vec::new();
        // First value and file of each key, so every shard's keys are checked in O(1).
        let mut first: HashMap<&str, (&str, usize)> = HashMap::new();
        for (i, f) in self.files.iter().enumerate() {
            for (k, v) in &f.metadata {
                match first.get(k.as_str()) {
                    None => {
                        first.insert(k, (v, i));
                        out.push((k.clone(), v.clone()));
                    }
                    Some(&(seen, j)) if seen != v => {
                        return Err(Error::MetadataConflict {
                            key: k.clone(),
                            first: seen.to_string(),
                            first_file: self.files[j].path.clone(),
                            second: v.clone(),
                            second_file: f.path.clone(),
                        });
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(out)
    }

    /// Everything the checkpoint says beyond its tensors, folded once for every writer: the
    /// files' `__metadata__` (with `format`), then the index's metadata other than `total_size`
    /// (which writers recompute), then the non-tensor values, each as its JSON text. A key seen
    /// earlier wins.
    ///
    /// Metadata is text (safetensors' `__metadata__` maps strings to strings), so a value is
    /// carried as JSON text even where it is itself a string: the string `"1e-8"` and the float
    /// `1e-8` stay apart (`"\"1e-8\""` and `"1e-8"`), and every value reads back with its type.
    pub(crate) fn metadata(&self) -> Result<Vec<(String, serde_json::Value)>> {
        let mut out: Vec<(String, serde_json::Value)> =
            self.file_metadata()?.into_iter().map(|(k, v)| (k, serde_json::Value::String(v))).collect();
        let mut seen: HashSet<String> = out.iter().map(|(k, _)| k.clone()).collect();
        let index = self.index_metadata.iter().flat_map(|m| m.iter()).filter(|(k, _)| *k != "total_size");
        for (k, v) in index
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(self.values.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.to_json().to_string()))))
        {
            if seen.insert(k.clone()) {
                out.push((k, v));
            }
        }
        Ok(out)
    }
}

/// The members every checkpoint has (besides what its reader named): its data files, the root,
/// and a checksum manifest beside the root.
fn own_members(p: &Parts) -> Vec<PathBuf> {
    let mut members: Vec<PathBuf> = p.files.iter().map(|f| f.path.clone()).collect();
    members.push(p.root.clone());
    let folder = if p.root.is_dir() { Some(p.root.as_path()) } else { p.root.parent() };
    if let Some(manifest) = folder.map(|d| d.join(crate::write::manifest::MANIFEST_NAME)).filter(|m| m.is_file()) {
        members.push(manifest);
    }
    members
}

/// A tensor entry that does not hold, at the file of its first byte (else the root).
fn entry_error(p: &Parts, t: &TensorInfo, problem: EntryProblem) -> Error {
    let path = t.location().and_then(|(f, _)| p.files.get(f)).map_or(p.root.clone(), |f| f.path.clone());
    Error::BadTensorEntry { path, tensor: t.name.clone(), problem }
}

/// One tensor's sizes computable without overflow (stored and as its dtype) and its bytes in
/// bounds of their files.
fn check_tensor(p: &Parts, t: &TensorInfo) -> Result<()> {
    let elem = t.stored.bits() / 8;
    let Some(need) = shape::numel(&t.shape).and_then(|n| n.checked_mul(elem)) else {
        return Err(entry_error(p, t, EntryProblem::ShapeOverflows { shape: t.shape.clone() }));
    };
    if shape::numel(&t.shape).and_then(|n| n.checked_mul(t.dtype.bits() / 8)).is_none() {
        return Err(entry_error(p, t, EntryProblem::ShapeOverflows { shape: t.shape.clone() }));
    }
    match &t.data {
        TensorData::Ranges(chunks) => check_ranges(p, t, chunks, need),
        TensorData::Boxes(boxes) => check_boxes(p, t, boxes, elem),
    }
}

/// Byte ranges: each inside its file, together exactly the `need` bytes of the shape.
fn check_ranges(p: &Parts, t: &TensorInfo, chunks: &[Chunk], need: u64) -> Result<()> {
    let mut total = 0u64;
    for c in chunks {
        let file = p.files.get(c.file).ok_or_else(|| entry_error(p, t, EntryProblem::UnknownFile))?;
        if c.offset.checked_add(c.len).is_none_or(|end| end > file.extent()) {
            let problem =
                EntryProblem::PastFile { start: c.offset, end: c.offset.saturating_add(c.len), file_len: file.len };
            return Err(entry_error(p, t, problem));
        }
        total = total.checked_add(c.len).ok_or_else(|| entry_error(p, t, EntryProblem::CountOverflows))?;
    }
    if total != need {
        return Err(entry_error(p, t, EntryProblem::ByteCount { total, need }));
    }
    Ok(())
}

/// Boxes: each one's storage inside its file and its strided view inside its storage, and the
/// boxes together tiling the tensor.
fn check_boxes(p: &Parts, t: &TensorInfo, boxes: &[TensorBox], elem: u64) -> Result<()> {
    for b in boxes {
        let at = |problem| box_error(p, t, b, problem);
        let f = p.files.get(b.file).ok_or_else(|| entry_error(p, t, EntryProblem::UnknownFile))?;
        if b.base.checked_add(b.len).is_none_or(|end| end > f.extent()) {
            return Err(at(BoxProblem::StoragePastFile { offsets: b.region.offsets.clone() }));
        }
        if b.strides.len() != b.region.sizes.len() {
            return Err(at(BoxProblem::StrideCount {
                offsets: b.region.offsets.clone(),
                strides: b.strides.len(),
                dims: b.region.sizes.len(),
            }));
        }
        let extent = shape::extent(b.offset, &b.region.sizes, &b.strides).and_then(|e| e.checked_mul(elem));
        if extent.is_none_or(|e| e > b.len) {
            return Err(at(BoxProblem::ViewPastStorage { offsets: b.region.offsets.clone() }));
        }
    }
    // One box that is the whole tensor (every torch tensor) tiles it trivially.
    let trivial = matches!(boxes, [b] if b.region.is_whole(&t.shape));
    if !trivial {
        let regions: Vec<Region> = boxes.iter().map(|b| b.region.clone()).collect();
        if let Err(e) = fsdp_state::check_tiling(&t.shape, &regions) {
            return Err(match e.index().and_then(|i| boxes.get(i)) {
                Some(b) => box_error(p, t, b, BoxProblem::Tiling(e)),
                None => Error::BadBox {
                    path: p.root.clone(),
                    tensor: t.name.clone(),
                    rank: None,
                    problem: BoxProblem::Tiling(e),
                },
            });
        }
    }
    Ok(())
}

/// A problem with one box of `t`, named by the file that holds it and the rank that saved it.
fn box_error(p: &Parts, t: &TensorInfo, b: &TensorBox, problem: BoxProblem) -> Error {
    let file = p.files.get(b.file);
    Error::BadBox {
        path: file.map_or_else(|| p.root.clone(), |f| f.path.clone()),
        tensor: t.name.clone(),
        rank: file.and_then(|f| f.rank),
        problem,
    }
}

/// The row-major runs of a tensor made of several boxes: each box's walk yields its runs in
/// increasing tensor offset, and a min-heap on that offset interleaves them.
struct MergedRuns {
    walks: Vec<(usize, Walk, u64)>,
    heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>>,
    heads: Vec<Option<(u64, u64, u64)>>,
}

impl MergedRuns {
    fn new(boxes: &[TensorBox], dst_strides: &[u64], elem: u64) -> MergedRuns {
        let mut walks: Vec<(usize, Walk, u64)> = boxes
            .iter()
            .filter(|b| !b.region.is_empty())
            .map(|b| (b.file, b.walk(dst_strides, elem), b.base))
            .collect();
        let mut heads = Vec::with_capacity(walks.len());
        let mut heap = std::collections::BinaryHeap::with_capacity(walks.len());
        for (i, (_, w, _)) in walks.iter_mut().enumerate() {
            let head = w.next();
            if let Some((dst, _, _)) = head {
                heap.push(std::cmp::Reverse((dst, i)));
            }
            heads.push(head);
        }
        MergedRuns { walks, heap, heads }
    }
}

impl Iterator for MergedRuns {
    type Item = (usize, u64, u64);
    fn next(&mut self) -> Option<(usize, u64, u64)> {
        let std::cmp::Reverse((_, i)) = self.heap.pop()?;
        let (_, src, len) = self.heads.get_mut(i)?.take()?;
        let (file, walk, base) = self.walks.get_mut(i)?;
        let (file, base) = (*file, *base);
        let next = walk.next();
        if let Some((dst, _, _)) = next {
            self.heap.push(std::cmp::Reverse((dst, i)));
        }
        self.heads[i] = next;
        Some((file, base + src, len))
    }
}

/// A catalog plus the problems found while building it. Verification reports all problems;
/// opening fails on the first.
#[derive(Debug)]
pub(crate) struct Scan {
    pub checkpoint: Checkpoint,
    pub problems: Vec<Error>,
}

impl Scan {
    pub(crate) fn clean(checkpoint: Checkpoint) -> Scan {
        Scan { checkpoint, problems: Vec::new() }
    }
}

#[cfg(test)]
mod tests;
