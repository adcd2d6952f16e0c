//! PyTorch files (`torch.save`): read without executing anything, and written the way torch does.
//!
//! Since torch 1.6 a `torch.save` file is a zip archive (see [`zip`]) whose records all sit in one
//! folder, the archive name (`x/` for `x.pt`, or `archive/`):
//!
//! - `data.pkl`: a pickle of the saved object (see [`pickle`]). Tensor bytes are not in it: each
//!   storage is a persistent id `("storage", <class>, "<key>", "<device>", <numel>)`, and each
//!   tensor a call `_rebuild_tensor_v2(storage, offset, size, stride, …)` (or `_v3` with an
//!   explicit dtype over an untyped byte storage, for float8 and the unsigned types);
//! - `data/<key>`: the raw little-endian bytes of each distinct storage, one record each;
//! - `byteorder` (`little`), `version` (`3\n`, or `.data/version`), and since 2.7
//!   `.format_version` and `.storage_alignment`.
//!
//! Several tensors may share one storage (tied weights, views); a tensor may start at an offset
//! and have any strides. We keep each tensor as (storage record, offset, shape, strides) and
//! read it as runs of contiguous bytes ([`strided`]), so a view never drags its whole storage
//! along and a transpose comes out row-major.
//!
//! Before 1.6 (and with `_use_new_zipfile_serialization=False`) the file is a stream of pickles:
//! a magic number, a protocol version (1001), a system-info dict, the object (whose persistent
//! ids carry a sixth element: `None`, or for a slice of a storage, as pre-0.4 torch wrote them,
//! `(view key, offset, size)` in elements), the list of storage keys; then, for each key
//! in that list, an 8-byte little-endian element count followed by the raw bytes. We read that
//! too. The pre-1.0 tar format is refused as "legacy torch format".
//!
//! Files from older torch versions and other machines differ only inside the pickle, and we read
//! them as `torch.load(f, weights_only=True, map_location="cpu")` does:
//!
//! - the device in a persistent id (`cuda:0`, `cuda:1`, `mps`, `xpu:0`, …) says where torch
//!   would put the storage; the bytes in the file are the same wherever it was saved, so the
//!   location is not consulted, and the `torch.cuda.*Storage` classes of very old files mean
//!   the same as their CPU twins;
//! - before 1.0 a tensor was `_rebuild_tensor(storage, offset, size, stride)`, and before 0.4 an
//!   empty typed tensor (`torch.FloatTensor()`) given `(storage, offset, size, stride)` by
//!   `BUILD`; both describe the same window on a storage as `_rebuild_tensor_v2`;
//! - a tensor of a backend without storages (XLA, MTIA) is pickled as its CPU copy wrapped in
//!   `_rebuild_device_tensor_from_cpu_tensor`.
//!
//! A TorchScript archive (`torch.jit.save`) is the same zip around a pickle of module objects
//! and their compiled code; [`torchscript`] reads it and names its tensors the way its
//! `state_dict()` does.

//!
//! In the catalog view ([`crate::Checkpoint`]), non-tensor values appear as the file's metadata
//! with their dotted name and their value as JSON, so `inspect` reports them and `merge`/`split`
//! carry them into `__metadata__`.

pub(crate) mod allow;
pub(crate) mod flatten;
pub(crate) mod numpy;
pub(crate) mod pickle;
use crate::read::shape as strided;
pub(crate) mod torchscript;
pub(crate) mod writer;
pub(crate) mod zip;

use crate::read::io::ReadAt;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::error::{Error, IoContext, Result, TorchTensorProblem};
use crate::formats::hf_index::Index;
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, SourceFile, TensorBox, TensorData, TensorInfo};
use crate::read::checksum::{Checks, Record};
use crate::read::dtype::Dtype;
use crate::read::shape::Runs;
use flatten::Leaf;
use pickle::{AllowGlobals, Budget, Limits, Load, Obj, Refusal, StorageKind};

/// The largest `data.pkl` we read.
pub(crate) const MAX_PICKLE_LEN: u64 = 256 << 20;
/// The name huggingface_hub and transformers give an unsharded torch checkpoint.
pub(crate) const TORCH_SINGLE_NAME: &str = "pytorch_model.bin";
/// The index of a sharded torch checkpoint.
pub(crate) const TORCH_INDEX_NAME: &str = "pytorch_model.bin.index.json";

const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

/// One tensor of a torch file.
#[derive(Clone, Debug)]
pub(crate) struct TorchTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
    /// In elements of `dtype`.
    pub offset: u64,
    /// Index into [`TorchFile::storages`].
    pub storage: usize,
}

impl TorchTensor {
    pub(crate) fn runs(&self) -> Runs {
        Runs::new(self.offset, &self.shape, &self.strides, self.dtype.bits() / 8)
    }
}

/// A storage record: where its bytes are in the file.
#[derive(Clone, Debug)]
pub(crate) struct Storage {
    pub key: String,
    pub file_offset: u64,
    pub byte_len: u64,
    /// Its zip record's name and the CRC32 the archive carries for it (none in legacy files
    /// and for decoded arrays).
    pub record: Option<(String, u32)>,
}

/// A torch file, read and validated: every tensor lies inside its storage, every storage inside
/// the file.
#[derive(Clone, Debug)]
pub(crate) struct TorchFile {
    pub path: PathBuf,
    pub len: u64,
    pub tensors: Vec<TorchTensor>,
    pub storages: Vec<Storage>,
    pub leaves: Vec<(String, Leaf)>,
    /// Every global the file's pickle names, as written, in first-seen order.
    pub globals: Vec<String>,
    /// Bytes decoded from the pickle (numpy arrays), addressed past the end of the file: the
    /// storage of such a tensor starts at `len` + its offset here.
    pub inline: Vec<u8>,
}

impl TorchFile {
    /// The zip records its tensors read, each named by the first tensor that reads it.
    pub(crate) fn checks(&self) -> Checks {
        let mut first: Vec<Option<&str>> = vec![None; self.storages.len()];
        for t in &self.tensors {
            if let Some(slot) = first.get_mut(t.storage) {
                slot.get_or_insert(t.name.as_str());
            }
        }
        let records = self
            .storages
            .iter()
            .zip(first)
            .filter_map(|(s, tensor)| {
                let (name, crc) = s.record.clone()?;
                Some(Record {
                    offset: s.file_offset,
                    len: s.byte_len,
                    crc,
                    name,
                    item: None,
                    tensor: tensor?.to_string(),
                })
            })
            .collect();
        Checks::new(records)
    }
}

/// True when `path` starts like a torch file (a zip, or a legacy pickle stream).
pub(crate) fn sniff(path: &Path) -> bool {
    let Ok(f) = crate::read::io::open(path) else { return false };
    let mut head = [0u8; 4];
    if ReadAt::read_exact_at(&f, &mut head, 0).is_err() {
        return false;
    }
    head == *b"PK\x03\x04" || head[..3] == [0x80, 0x02, 0x8a]
}

pub(crate) fn refusal(path: &Path, record: &str, r: Refusal) -> Error {
    match r {
        Refusal::Global(global) => Error::RefusedGlobal { path: path.to_path_buf(), global },
        Refusal::Bad { at, reason } => Error::BadPickle { path: path.to_path_buf(), record: record.into(), at, reason },
    }
}

/// Bytes between the end of a file and the first array decoded from it.
const TAIL_GAP: usize = 8;

/// The most names a refusal lists.
const MAX_LISTED: usize = 16;

/// The refusal of a torch file read with the user's `allow`: the global refused first, then
/// every other global of the pickle (`data`) that is not allowed either, so that one message
/// says all that `allow_globals` would need.
fn refusal_allowing(path: &Path, record: &str, r: Refusal, data: &[u8], allow: &AllowGlobals) -> Error {
    match r {
        Refusal::Global(global) => {
            let mut globals = vec![global];
            for g in pickle::globals_named(data, Limits::default()) {
                if globals.len() < MAX_LISTED && !globals.contains(&g) && !pickle::admitted(&g, &[], allow) {
                    globals.push(g);
                }
            }
            Error::GlobalNotAllowed { path: path.to_path_buf(), globals, allowing: !allow.is_empty() }
        }
        r => refusal(path, record, r),
    }
}

fn bad_file(path: &Path, reason: impl Into<String>) -> Error {
    Error::BadTorchFile { path: path.to_path_buf(), reason: reason.into() }
}

/// Reads a torch file, with the globals `allow` names read as inert records.
pub(crate) fn read(path: &Path, allow: &AllowGlobals) -> Result<TorchFile> {
    read_sharing(path, allow, &Budget::shared(Limits::default()))
}

/// Reads a torch file whose pickles charge `budget`, which the other files of its checkpoint
/// share: their values are kept together.
fn read_sharing(path: &Path, allow: &AllowGlobals, budget: &Rc<Budget>) -> Result<TorchFile> {
    let file = crate::read::io::open(path)?;
    let len = file.metadata().at(path)?.len();
    let mut head = [0u8; 8];
    let n = usize::try_from(len.min(8)).unwrap_or(0);
    ReadAt::read_exact_at(&file, head.get_mut(..n).unwrap_or_default(), 0).at(path)?;
    if head.starts_with(b"PK\x03\x04") {
        read_zip(&file, len, path, Admit::User(allow), budget)
    } else if head.starts_with(&[0x80, 0x02, 0x8a]) {
        read_legacy(&file, len, path, allow, budget)
    } else if head.starts_with(b"PYTORCH1") {
        Err(bad_file(path, "legacy torch format (the 1.x preview release) is not supported"))
    } else {
        let mut tar = [0u8; 5];
        if ReadAt::read_exact_at(&file, &mut tar, 257).is_ok() && &tar == b"ustar" {
            return Err(bad_file(
                path,
                "legacy torch format (pre-1.0 tar) is not supported; hint: load and re-save it with `torch.save`",
            ));
        }
        Err(bad_file(path, "not a torch file (no zip or pickle signature)"))
    }
}

/// Reads a zip-format torch file whose pickle may also name the classes in `classes` (a
/// format's own allow-list, e.g. DeepSpeed's enums); they come out as inert instances among the
/// leaves. Legacy (non-zip) files are refused: the formats that need this never wrote them.
pub(crate) fn read_with_classes(path: &Path, classes: &'static [&'static str]) -> Result<TorchFile> {
    read_with_classes_sharing(path, classes, &Budget::shared(Limits::default()))
}

/// [`read_with_classes`] for one of several files whose values are kept together (the rank
/// files of a ZeRO checkpoint, the value files of a `save_state` folder): their pickles charge
/// the one `budget`, so many files cannot add up to more memory than one large file may use.
pub(crate) fn read_with_classes_sharing(
    path: &Path,
    classes: &'static [&'static str],
    budget: &Rc<Budget>,
) -> Result<TorchFile> {
    let file = crate::read::io::open(path)?;
    let len = file.metadata().at(path)?.len();
    let mut head = [0u8; 4];
    let n = usize::try_from(len.min(4)).unwrap_or(0);
    ReadAt::read_exact_at(&file, head.get_mut(..n).unwrap_or_default(), 0).at(path)?;
    if head != *b"PK\x03\x04" {
        return Err(bad_file(path, "not a zip-format torch file"));
    }
    read_zip(&file, len, path, Admit::Format(classes), budget)
}

/// What a pickle may name beyond torch's weights-only list.
#[derive(Clone, Copy)]
enum Admit<'a> {
    /// A format's own classes (a refusal is [`Error::RefusedGlobal`]).
    Format(&'static [&'static str]),
    /// The user's `allow_globals` (a refusal lists what else is missing, and numpy arrays
    /// are decoded when anything is allowed).
    User(&'a AllowGlobals),
}

impl Admit<'_> {
    fn is_format(self) -> bool {
        matches!(self, Admit::Format(c) if !c.is_empty())
    }

    /// Runs the pickle `data` (record `record`) and flattens it; also the globals it names.
    fn flatten(
        self,
        data: &[u8],
        path: &Path,
        record: &str,
        budget: &Rc<Budget>,
    ) -> Result<(flatten::Flat, Vec<String>)> {
        let (p, numpy) = match self {
            Admit::Format(classes) => {
                let p = pickle::load(data, Load::default().classes(classes).charging(budget))
                    .map_err(|r| refusal(path, record, r))?;
                (p, false)
            }
            Admit::User(allow) => {
                let p = pickle::load(data, Load::default().allowing(allow).charging(budget))
                    .map_err(|r| refusal_allowing(path, record, r, data, allow))?;
                (p, !allow.is_empty())
            }
        };
        let flat = flatten::flatten_with(&p, numpy).map_err(|reason| bad_file(path, reason))?;
        Ok((flat, p.globals))
    }
}

fn read_zip(file: &File, len: u64, path: &Path, admit: Admit<'_>, budget: &Rc<Budget>) -> Result<TorchFile> {
    let archive = zip::Archive::open(file, len, path)?;
    let Some(first) = archive.entries.first() else {
        return Err(bad_file(path, "empty archive"));
    };
    let Some((prefix, _)) = first.name.split_once('/') else {
        return Err(bad_file(path, format!("record `{}` is not in a folder", first.name)));
    };
    let prefix = format!("{prefix}/");
    if let Some(e) = archive.entries.iter().find(|e| !e.name.starts_with(&prefix)) {
        return Err(bad_file(path, format!("record `{}` is outside the archive folder `{prefix}`", e.name)));
    }
    let has = |n: &str| archive.find(&format!("{prefix}{n}")).is_some();
    let script = torchscript::is_torchscript(&archive, &prefix);
    if script && admit.is_format() {
        return Err(bad_file(path, "a TorchScript archive (`torch.jit.save`), not a `torch.save` file"));
    }
    if !has("version") && !has(".data/version") {
        return Err(bad_file(path, format!("no `{prefix}version` record")));
    }
    if let Some(bo) = archive.find(&format!("{prefix}byteorder")) {
        let text = archive.read_entry(file, bo, 64)?;
        if text != b"little" {
            return Err(bad_file(path, format!("byte order `{}` is not supported", String::from_utf8_lossy(&text))));
        }
    }
    let pkl_name = format!("{prefix}data.pkl");
    let Some(pkl) = archive.find(&pkl_name) else {
        return Err(bad_file(path, format!("no `{pkl_name}` record")));
    };
    let (flat, globals) = if script {
        // A TorchScript archive: the state dict is what its module tree declares.
        let tensors = torchscript::tensors(file, &archive, &prefix, path, budget)?;
        (flatten::Flat { tensors, ..flatten::Flat::default() }, Vec::new())
    } else {
        let data = archive.read_entry(file, pkl, MAX_PICKLE_LEN)?;
        admit.flatten(&data, path, &pkl_name, budget)?
    };
    let mut storages: Vec<Storage> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let mut tensors = Vec::with_capacity(flat.tensors.len());
    let (inline, at) = inline_storages(&flat.inline, len, &mut storages);
    for (name, t) in flat.tensors {
        if t.storage.kind == StorageKind::Inline {
            let si = t.storage.key.parse::<usize>().ok().and_then(|k| at.get(k).copied()).unwrap_or(usize::MAX);
            tensors.push(check_tensor(path, name, t, si, &storages)?);
            continue;
        }
        let si = match by_key.get(&t.storage.key) {
            Some(&i) => i,
            None => {
                let rec = format!("{prefix}data/{}", t.storage.key);
                let Some(e) = archive.find(&rec) else {
                    return Err(bad_tensor(path, &name, TorchTensorProblem::MissingRecord { record: rec }));
                };
                if e.method != zip::Method::Stored {
                    return Err(bad_tensor(path, &name, TorchTensorProblem::CompressedRecord { record: rec }));
                }
                storages.push(Storage {
                    key: t.storage.key.clone(),
                    file_offset: e.data_offset,
                    byte_len: e.size,
                    record: Some((rec, e.crc)),
                });
                by_key.insert(t.storage.key.clone(), storages.len() - 1);
                storages.len() - 1
            }
        };
        tensors.push(check_tensor(path, name, t, si, &storages)?);
    }
    Ok(TorchFile { path: path.to_path_buf(), len, tensors, storages, leaves: flat.leaves, globals, inline })
}

/// Lays the decoded arrays end to end past the end of the file (`len`), one storage each:
/// the bytes, and each array's index in `storages`. They start after a gap of [`TAIL_GAP`]
/// bytes, so that no run of the file's own bytes ever abuts one of them (a copy plan merges
/// adjacent runs, and these are read from memory, those from the file).
fn inline_storages(arrays: &[Vec<u8>], len: u64, storages: &mut Vec<Storage>) -> (Vec<u8>, Vec<usize>) {
    if arrays.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut tail = vec![0u8; TAIL_GAP];
    tail.reserve(arrays.iter().map(Vec::len).sum());
    let mut at = Vec::with_capacity(arrays.len());
    for (i, a) in arrays.iter().enumerate() {
        at.push(storages.len());
        storages.push(Storage {
            key: format!("<numpy array {i}>"),
            file_offset: len + tail.len() as u64,
            byte_len: a.len() as u64,
            record: None,
        });
        tail.extend_from_slice(a);
    }
    (tail, at)
}

fn bad_tensor(path: &Path, tensor: &str, problem: TorchTensorProblem) -> Error {
    Error::BadTorchTensor { path: path.to_path_buf(), tensor: tensor.to_string(), problem }
}

fn check_tensor(
    path: &Path,
    name: String,
    t: pickle::TensorRef,
    si: usize,
    storages: &[Storage],
) -> Result<TorchTensor> {
    let s = storages.get(si).ok_or_else(|| bad_tensor(path, &name, TorchTensorProblem::StorageVanished))?;
    let declared = t.storage.numel.checked_mul(t.storage.kind.elem_bytes());
    if declared != Some(s.byte_len) {
        let problem = TorchTensorProblem::StorageSize {
            key: s.key.clone(),
            numel: t.storage.numel,
            elem: t.storage.kind.elem_bytes(),
            len: s.byte_len,
        };
        return Err(bad_tensor(path, &name, problem));
    }
    if !t.dtype.bits().is_multiple_of(8) {
        return Err(bad_tensor(path, &name, TorchTensorProblem::Dtype { dtype: t.dtype }));
    }
    let elem = t.dtype.bits() / 8;
    let needed = strided::extent(t.offset, &t.shape, &t.strides)
        .and_then(|e| e.checked_mul(elem))
        .filter(|_| strided::numel(&t.shape).and_then(|n| n.checked_mul(elem)).is_some());
    match needed {
        Some(n) if n <= s.byte_len => {}
        _ => {
            let problem = TorchTensorProblem::PastStorage {
                offset: t.offset,
                shape: t.shape,
                strides: t.strides,
                len: s.byte_len,
                key: s.key.clone(),
            };
            return Err(bad_tensor(path, &name, problem));
        }
    }
    Ok(TorchTensor { name, dtype: t.dtype, shape: t.shape, strides: t.strides, offset: t.offset, storage: si })
}

fn read_legacy(file: &File, len: u64, path: &Path, allow: &AllowGlobals, budget: &Rc<Budget>) -> Result<TorchFile> {
    let legacy = |reason: String| bad_file(path, format!("legacy torch format: {reason}"));
    let map = crate::read::io::map(file, path)?;
    let all = map.get(0, len).ok_or_else(|| legacy("cannot map the file".into()))?;
    let mut pos = 0usize;
    // Only the object pickle may name the globals `allow` admits.
    let mut next = |what: &str, allow: &AllowGlobals| -> Result<pickle::Pickle> {
        let rest = all.get(pos..).unwrap_or_default();
        let window = rest.get(..usize::try_from(MAX_PICKLE_LEN).unwrap_or(usize::MAX)).unwrap_or(rest);
        let p = pickle::load(window, Load::default().allowing(allow).charging(budget))
            .map_err(|r| refusal_allowing(path, what, r, window, allow))?;
        pos += p.end;
        Ok(p)
    };
    let none = AllowGlobals::default();
    let magic = next("magic number", &none)?;
    if !matches!(magic.obj(magic.root), Some(Obj::BigInt(b)) if b[..] == LEGACY_MAGIC) {
        return Err(legacy("bad magic number".into()));
    }
    let proto = next("protocol version", &none)?;
    if proto.root != pickle::V::Int(1001) {
        return Err(legacy("unknown protocol version".into()));
    }
    let info = next("system info", &none)?;
    let little = match info.obj(info.root) {
        Some(Obj::Dict(items)) => items.iter().any(|&(k, v)| {
            matches!(info.obj(k), Some(Obj::Str(s)) if s == "little_endian") && v == pickle::V::Bool(true)
        }),
        _ => false,
    };
    if !little {
        return Err(legacy("only little-endian files are supported".into()));
    }
    let obj = next("data pickle", allow)?;
    let flat = flatten::flatten_with(&obj, !allow.is_empty()).map_err(|reason| bad_file(path, reason))?;
    let mut kinds: HashMap<&str, StorageKind> = HashMap::new();
    for o in &obj.objs {
        if let Obj::Storage(s) | Obj::StorageView { storage: s, .. } = o {
            kinds.insert(&s.key, s.kind);
        }
    }
    let keys = next("storage keys", &none)?;
    let Some(Obj::List(key_list)) = keys.obj(keys.root) else {
        return Err(legacy("storage key list is missing".into()));
    };
    let mut storages = Vec::with_capacity(key_list.len());
    let mut by_key = HashMap::new();
    let mut at = pos as u64;
    for &k in key_list {
        let Some(Obj::Str(key)) = keys.obj(k) else {
            return Err(legacy("storage keys must be strings".into()));
        };
        let Some(kind) = kinds.get(key.as_str()) else {
            return Err(legacy(format!("storage `{key}` is listed but never used")));
        };
        let count = map.get(at, 8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(u64::from_le_bytes);
        let byte_len = count.and_then(|c| c.checked_mul(kind.elem_bytes()));
        let end = byte_len.and_then(|b| b.checked_add(at + 8)).filter(|&e| e <= len);
        let (Some(byte_len), Some(end)) = (byte_len, end) else {
            return Err(Error::RecordBeyondFile {
                path: path.to_path_buf(),
                record: format!("storage {key}"),
                offset: at,
                len: byte_len.unwrap_or(u64::MAX),
                file_len: len,
            });
        };
        by_key.insert(key.clone(), storages.len());
        storages.push(Storage { key: key.clone(), file_offset: at + 8, byte_len, record: None });
        at = end;
    }
    let mut tensors = Vec::with_capacity(flat.tensors.len());
    let (inline, at_inline) = inline_storages(&flat.inline, len, &mut storages);
    for (name, t) in flat.tensors {
        if t.storage.kind == StorageKind::Inline {
            let si = t.storage.key.parse::<usize>().ok().and_then(|k| at_inline.get(k).copied()).unwrap_or(usize::MAX);
            tensors.push(check_tensor(path, name, t, si, &storages)?);
            continue;
        }
        let Some(&si) = by_key.get(&t.storage.key) else {
            return Err(bad_tensor(path, &name, TorchTensorProblem::MissingStorage { key: t.storage.key }));
        };
        tensors.push(check_tensor(path, name, t, si, &storages)?);
    }
    let globals = obj.globals.clone();
    Ok(TorchFile { path: path.to_path_buf(), len, tensors, storages, leaves: flat.leaves, globals, inline })
}

/// Entry points for the fuzz targets (`ckpt/fuzz`): run a parser on arbitrary bytes. Never panic,
/// whatever the input; errors are the expected outcome.
#[doc(hidden)]
pub(crate) mod fuzz {
    use super::*;

    /// The restricted unpickler, then the state-dict walk; then the same with every global
    /// admitted as a record (`allow_globals = ["*"]`) and numpy decoding on, and the scan
    /// that lists a refused file's globals.
    pub fn unpickle(data: &[u8]) {
        if let Ok(p) = pickle::load(data, Load::default()) {
            let _ = flatten::flatten(&p);
        }
        let budget = Budget::shared(Limits::default());
        let any = AllowGlobals::any();
        if let Ok(p) = pickle::load(data, Load::default().allowing(&any).charging(&budget)) {
            let _ = flatten::flatten_with(&p, true);
        }
        let _ = pickle::globals_named(data, Limits::default());
    }

    /// The values a torch file's pickle holds besides its tensors, as the catalog keeps them
    /// (every global admitted as a record); none when it is refused.
    pub(crate) fn values(data: &[u8]) -> Vec<(String, crate::read::value::Leaf)> {
        let any = AllowGlobals::any();
        let Ok(p) = pickle::load(data, Load::default().allowing(&any)) else { return Vec::new() };
        flatten::flatten(&p).map(|f| f.leaves).unwrap_or_default()
    }

    /// The reader of a TorchScript code record's `__parameters__`/`__buffers__` declarations.
    pub(crate) fn torchscript_code(data: &[u8]) {
        if let Ok(text) = std::str::from_utf8(data) {
            let _ = torchscript::parse_code(text, "__torch__", &mut std::collections::HashMap::new());
        }
    }

    /// The zip reader on an in-memory archive, then every record it would read.
    pub fn torch_zip(data: &[u8]) {
        let path = Path::new("fuzz.pt");
        let Ok(archive) = zip::Archive::open(data, data.len() as u64, path) else { return };
        for e in &archive.entries {
            if let Ok(bytes) = archive.read_entry(data, e, 1 << 20) {
                if e.name.ends_with("data.pkl") {
                    unpickle(&bytes);
                    let _ = pickle::load(&bytes, Load::default().script());
                } else if e.name.ends_with(".py") {
                    torchscript_code(&bytes);
                }
            }
        }
    }
}

/// A sharded torch checkpoint: its index and its files, in shard order.
#[derive(Debug)]
pub(crate) struct TorchSet {
    pub index: Option<Index>,
    pub files: Vec<TorchFile>,
}

/// Reads a torch file, or an index and its shards, checking that the index and the shards
/// agree.
pub(crate) fn read_set(path: &Path, format: Format, allow: &AllowGlobals) -> Result<TorchSet> {
    if format == Format::Torch {
        return Ok(TorchSet { index: None, files: vec![read(path, allow)?] });
    }
    let index = Index::read(path)?;
    let dir = index.dir().to_path_buf();
    // The shards' values are kept together: one memory budget for all their pickles.
    let budget = Budget::shared(Limits::default());
    let mut names = index.shard_names();
    names.sort_unstable();
    let mut files = Vec::with_capacity(names.len());
    let mut holder: HashMap<String, usize> = HashMap::new();
    for name in &names {
        let shard = dir.join(name);
        if !shard.exists() {
            let tensor = index.weight_map.iter().find(|(_, f)| f == name).map(|(t, _)| t.clone()).unwrap_or_default();
            return Err(Error::MissingShard { index: path.to_path_buf(), tensor, file: name.to_string() });
        }
        let f = read_sharing(&shard, allow, &budget)?;
        for t in &f.tensors {
            if let Some(&prev) = holder.get(&t.name) {
                let first: &TorchFile = &files[prev];
                return Err(Error::DuplicateAcrossShards {
                    tensor: t.name.clone(),
                    first: first.path.clone(),
                    second: shard,
                });
            }
            holder.insert(t.name.clone(), files.len());
        }
        files.push(f);
    }
    for (tensor, fname) in &index.weight_map {
        let Some(fi) = names.iter().position(|n| n == fname) else { continue };
        if holder.get(tensor) != Some(&fi) {
            return Err(Error::TensorNotInShard {
                index: path.to_path_buf(),
                tensor: tensor.clone(),
                file: fname.clone(),
            });
        }
    }
    let listed: HashMap<&str, ()> = index.weight_map.iter().map(|(t, _)| (t.as_str(), ())).collect();
    for f in &files {
        if let Some(t) = f.tensors.iter().find(|t| !listed.contains_key(t.name.as_str())) {
            return Err(Error::UnlistedTensor {
                index: path.to_path_buf(),
                file: f.path.clone(),
                tensor: t.name.clone(),
            });
        }
    }
    Ok(TorchSet { index: Some(index), files })
}

/// A `*.bin.index.json` / `*.pt.index.json` file.
pub(crate) fn detect_sharded_file(path: &Path) -> Result<Option<PathBuf>> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let is_index = name.ends_with(".bin.index.json") || name.ends_with(".pt.index.json");
    Ok((path.is_file() && is_index).then(|| path.to_path_buf()))
}

/// A file that starts like a torch file (a zip, or a legacy pickle stream).
pub(crate) fn detect_file(path: &Path) -> Result<Option<PathBuf>> {
    Ok((path.is_file() && sniff(path)).then(|| path.to_path_buf()))
}

/// A folder holding `pytorch_model.bin.index.json`.
pub(crate) fn detect_sharded_folder(path: &Path) -> Result<Option<PathBuf>> {
    let index = path.join(TORCH_INDEX_NAME);
    Ok(index.is_file().then_some(index))
}

/// A folder holding `pytorch_model.bin`.
pub(crate) fn detect_folder(path: &Path) -> Result<Option<PathBuf>> {
    let single = path.join(TORCH_SINGLE_NAME);
    Ok((path.is_dir() && single.is_file()).then_some(single))
}

/// `torch.save` files, one or sharded (and TorchScript archives, read as their weights): merged
/// and converted as stored, not laid out for ranks.
pub(crate) struct TorchFormat;

impl super::FormatOps for TorchFormat {
    fn catalog(&self, format: Format, root: PathBuf, options: &crate::OpenOptions) -> Result<Scan> {
        catalog(root, format, &options.allow_globals)
    }
}

/// The catalog view of a torch checkpoint: every tensor a strided view on its storage record
/// (a numpy array decoded from the pickle: on its bytes, held past the end of the file), every
/// non-tensor value by its dotted name.
pub(crate) fn catalog(root: PathBuf, format: Format, allow: &AllowGlobals) -> Result<Scan> {
    let set = read_set(&root, format, allow)?;
    let mut files = Vec::with_capacity(set.files.len());
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    for (fi, f) in set.files.into_iter().enumerate() {
        let checks = f.checks();
        for t in f.tensors {
            let (base, len) = f.storages.get(t.storage).map_or((0, 0), |s| (s.file_offset, s.byte_len));
            let data = TensorData::Boxes(vec![TensorBox::whole(&t.shape, fi, base, len, t.offset, t.strides)]);
            tensors.push(TensorInfo { name: t.name, dtype: t.dtype, shape: t.shape, stored: t.dtype, data });
        }
        values.extend(f.leaves);
        let mut source = SourceFile::new(f.path, f.len);
        source.globals = f.globals;
        source.set_inline(f.inline);
        source.checks = checks;
        files.push(source);
    }
    let mut parts = Parts::new(format, root, files, tensors);
    parts.index_metadata = set.index.map(|i| i.metadata);
    parts.values = values;
    Ok(Scan::clean(Checkpoint::new(parts)?))
}
