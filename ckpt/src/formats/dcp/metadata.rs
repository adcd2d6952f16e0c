//! The `.metadata` pickle of a DCP folder, read into plain structs.
//!
//! torch writes it with `pickle.dump` (protocol 4 on Python 3.8–3.13) and reads it back with a
//! plain `pickle.load`, so it is a code-execution surface in torch itself. Here it goes through
//! the restricted unpickler with exactly the classes DCP pickles allow-listed; each comes out as
//! an inert instance (constructor arguments plus `BUILD` state) that this module interprets:
//!
//! - `Metadata`: `BUILD` dict with `state_dict_metadata` (flat key → tensor or bytes entry),
//!   `planner_data` (flat key → the original path as a tuple of str/int), `storage_data`
//!   (`MetadataIndex` → `_StorageInfo`), `storage_meta`, `version`. Fields a version does not
//!   write are optional.
//! - `TensorStorageMetadata`: `properties` (a `TensorProperties` whose `BUILD` state is a tuple
//!   starting with the dtype; 5 items up to torch 2.14, 6 in 2.15), `size` (a `torch.Size`,
//!   which the unpickler turns into a tuple of ints) and `chunks` (`ChunkStorageMetadata` with
//!   `offsets` and `sizes`).
//! - `BytesStorageMetadata`: no state at all.
//! - `MetadataIndex`: `fqn`, `offset` (absent for bytes items), `index` (a hint we ignore:
//!   storage is matched on `(fqn, offset)` as torch's `__eq__` does).
//! - `_StorageInfo`: `relative_path`, `offset`, `length`, and since 2.7 an optional list of
//!   `transform_descriptors` (stream transforms such as zstd), which we refuse when non-empty.
//!
//! Everything built here (strings, int lists, paths, items, chunks) is charged to the pickle's
//! memory budget as it is built, so that objects shared through the memo (one chunk list or
//! path under many keys) cannot be copied into more memory than the pickle is allowed.

use std::collections::HashMap;
use std::mem::size_of;
use std::path::Path;

use crate::error::{Error, Result};
use crate::formats::torch::pickle::{self, Global, Obj, Pickle, Refusal, V};
use crate::read::dtype::Dtype;

const MD: &str = "torch.distributed.checkpoint.metadata.";

/// The classes a DCP `.metadata` pickle names besides torch dtypes and `torch.Size`, followed
/// by the `extra` ones a format that writes DCP folders adds to its metadata (Megatron's, see
/// `formats::megatron`); nothing else is accepted (fixtures/dcp/README.md lists what torch 2.13
/// writes). A macro, because the unpickler takes one static list.
macro_rules! metadata_classes {
    ($($extra:literal),* $(,)?) => {
        &[
            "torch.distributed.checkpoint.metadata.Metadata",
            "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
            "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
            "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
            "torch.distributed.checkpoint.metadata.TensorProperties",
            "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
            "torch.distributed.checkpoint.metadata.MetadataIndex",
            "torch.distributed.checkpoint.metadata.StorageMeta",
            "torch.distributed.checkpoint.filesystem._StorageInfo",
            "torch.serialization._get_layout",
            "pathlib.PosixPath",
            $($extra),*
        ]
    };
}
pub(crate) use metadata_classes;

/// The classes of a plain DCP folder's `.metadata`.
pub(crate) const CLASSES: &[&str] = metadata_classes!();

/// One element of a state-dict path: a dict key or a list index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PathElem {
    Key(String),
    Index(i64),
}

impl PathElem {
    pub(crate) fn text(&self) -> String {
        match self {
            PathElem::Key(k) => k.clone(),
            PathElem::Index(i) => i.to_string(),
        }
    }
}

/// Where an item's bytes are: a byte range of a data file named relative to the folder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StorageInfo {
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
}

/// One saved chunk of a tensor: its position in the global tensor and its item.
#[derive(Clone, Debug)]
pub(crate) struct ChunkMeta {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub storage: StorageInfo,
}

#[derive(Clone, Debug)]
pub(crate) enum Kind {
    Tensor { dtype: Dtype, size: Vec<u64>, chunks: Vec<ChunkMeta> },
    Bytes { storage: StorageInfo },
}

/// An entry of `state_dict_metadata`, with its `planner_data` path.
#[derive(Clone, Debug)]
pub(crate) struct Item {
    /// The flat key (`model.embed.weight`).
    pub key: String,
    /// The original nesting (`["model", "embed.weight"]`); the flat key alone when the
    /// metadata has no `planner_data` for it.
    pub path: Vec<PathElem>,
    pub kind: Kind,
}

#[derive(Clone, Debug)]
pub(crate) struct Metadata {
    pub items: Vec<Item>,
}

/// Parses the `.metadata` bytes read from `path`, a plain DCP folder's.
pub(crate) fn parse(data: &[u8], path: &Path) -> Result<Metadata> {
    parse_with(data, path, CLASSES)
}

/// Parses the `.metadata` bytes read from `path`, admitting `classes` (a [`metadata_classes`]
/// list) and nothing else.
pub(crate) fn parse_with(data: &[u8], path: &Path, classes: &'static [&'static str]) -> Result<Metadata> {
    let bad = |reason: String| Error::BadDcpMetadata { path: path.to_path_buf(), reason };
    if data.first() == Some(&b'{') {
        return Err(bad("this is the JSON metadata of torch's Hugging Face storage writer, not a pickle; \
                        hint: its files are safetensors, open them directly"
            .into()));
    }
    let p = pickle::load(data, pickle::Load::default().classes(classes)).map_err(|r| match r {
        Refusal::Global(global) => Error::RefusedGlobal { path: path.to_path_buf(), global },
        Refusal::Bad { at, reason } => {
            Error::BadPickle { path: path.to_path_buf(), record: ".metadata".into(), at, reason }
        }
    })?;
    Reader { p: &p, path }.metadata()
}

struct Reader<'a> {
    p: &'a Pickle,
    path: &'a Path,
}

type Fields = Vec<(String, V)>;
/// `storage_data` by `(fqn, chunk offsets)`; bytes items have no offsets.
type StorageMap = HashMap<(String, Option<Vec<u64>>), StorageInfo>;

impl Reader<'_> {
    fn bad<T>(&self, reason: impl Into<String>) -> Result<T> {
        Err(Error::BadDcpMetadata { path: self.path.to_path_buf(), reason: reason.into() })
    }

    /// Charges `bytes` built from the pickle to its memory budget.
    fn charge(&self, bytes: usize) -> Result<()> {
        self.p.charge(bytes).or_else(|reason| self.bad(reason))
    }

    /// Charges a copy of `s`.
    fn charge_str(&self, s: &str) -> Result<()> {
        self.charge(size_of::<String>() + s.len())
    }

    fn storage_bytes(&self, s: &StorageInfo) -> Result<()> {
        self.charge(size_of::<StorageInfo>() + s.relative_path.len())
    }

    /// The `BUILD` state of an instance of `class` (the short name after the module).
    fn instance(&self, v: V, class: &str, what: &str) -> Result<Option<V>> {
        match self.p.obj(v) {
            Some(Obj::Instance { class: c, state, .. }) if c.rsplit('.').next() == Some(class) => Ok(*state),
            _ => self.bad(format!("{what} is not a `{class}`")),
        }
    }

    /// The fields of a dataclass instance (its `BUILD` dict), by name.
    fn fields(&self, v: V, class: &str, what: &str) -> Result<Fields> {
        let Some(state) = self.instance(v, class, what)? else {
            return Ok(Vec::new());
        };
        let Some(Obj::Dict(items)) = self.p.obj(state) else {
            return self.bad(format!("{what}: the `{class}` state is not a dict"));
        };
        self.charge(what.len() + items.len() * size_of::<(String, V)>())?;
        let mut out = Vec::with_capacity(items.len());
        for &(k, val) in items {
            match self.p.obj(k) {
                Some(Obj::Str(s)) => {
                    self.charge(s.len())?;
                    out.push((s.clone(), val))
                }
                _ => return self.bad(format!("{what}: a `{class}` field name is not a string")),
            }
        }
        Ok(out)
    }

    fn str_of(&self, v: V, what: &str) -> Result<String> {
        match self.p.obj(v) {
            Some(Obj::Str(s)) => {
                self.charge_str(s)?;
                Ok(s.clone())
            }
            _ => self.bad(format!("{what} is not a string")),
        }
    }

    fn uint(&self, v: V, what: &str) -> Result<u64> {
        match v {
            V::Int(i) if i >= 0 => Ok(i as u64),
            _ => self.bad(format!("{what} is not a non-negative int")),
        }
    }

    fn ints(&self, v: V, what: &str) -> Result<Vec<u64>> {
        match self.p.obj(v) {
            Some(Obj::Tuple(items) | Obj::List(items)) => {
                self.charge(what.len() + size_of::<Vec<u64>>() + items.len() * size_of::<u64>())?;
                items.iter().map(|&i| self.uint(i, what)).collect()
            }
            _ => self.bad(format!("{what} is not a sequence of ints")),
        }
    }

    fn metadata(&self) -> Result<Metadata> {
        let root = self.fields(self.p.root, "Metadata", "the pickle's root")?;
        let field = |name: &str| root.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
        if let Some(v) = field("version") {
            if !matches!(v, V::None) {
                let version = self.str_of(v, "`version`")?;
                if version.split('.').next() != Some("1") {
                    return self.bad(format!("version `{version}` is not supported (only 1.x)"));
                }
            }
        }
        let storage = self.storage_data(field("storage_data"))?;
        let planner = self.planner_data(field("planner_data"))?;
        let Some(Obj::Dict(entries)) = field("state_dict_metadata").and_then(|v| self.p.obj(v)) else {
            return self.bad("`state_dict_metadata` is missing or not a dict");
        };
        let mut items = Vec::with_capacity(entries.len());
        let mut seen = std::collections::HashSet::new();
        for &(k, v) in entries {
            let key = self.str_of(k, "a `state_dict_metadata` key")?;
            if !seen.insert(key.clone()) {
                return self.bad(format!("key `{key}` appears twice"));
            }
            let kind = self.entry(&key, v, &storage)?;
            let path = planner.get(&key).cloned().unwrap_or_else(|| vec![PathElem::Key(key.clone())]);
            self.charge(size_of::<Item>())?;
            for e in &path {
                self.charge(size_of::<PathElem>() + if let PathElem::Key(k) = e { k.len() } else { 0 })?;
            }
            items.push(Item { key, path, kind });
        }
        Ok(Metadata { items })
    }

    fn entry(&self, key: &str, v: V, storage: &StorageMap) -> Result<Kind> {
        let class = match self.p.obj(v) {
            Some(Obj::Instance { class, .. }) => class.strip_prefix(MD).unwrap_or(class),
            _ => return self.bad(format!("entry `{key}` is not a storage metadata object")),
        };
        let find = |offsets: Option<Vec<u64>>| storage.get(&(key.to_string(), offsets));
        match class {
            "BytesStorageMetadata" => match find(None) {
                Some(s) => {
                    self.storage_bytes(s)?;
                    Ok(Kind::Bytes { storage: s.clone() })
                }
                None => self.bad(format!("bytes entry `{key}` has no `storage_data` entry")),
            },
            "TensorStorageMetadata" => {
                let what = format!("tensor `{key}`");
                let f = self.fields(v, "TensorStorageMetadata", &what)?;
                let get = |n: &str| f.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
                let (Some(props), Some(size), Some(chunks)) = (get("properties"), get("size"), get("chunks")) else {
                    return self.bad(format!("{what}: `properties`, `size` or `chunks` is missing"));
                };
                let dtype = self.dtype(props, &what)?;
                let size = self.ints(size, &format!("{what}: `size`"))?;
                let Some(Obj::List(list)) = self.p.obj(chunks) else {
                    return self.bad(format!("{what}: `chunks` is not a list"));
                };
                let mut out = Vec::with_capacity(list.len());
                for (i, &c) in list.iter().enumerate() {
                    self.charge(size_of::<ChunkMeta>() + what.len())?;
                    let cw = format!("{what}: chunk {i}");
                    let cf = self.fields(c, "ChunkStorageMetadata", &cw)?;
                    let get = |n: &str| cf.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
                    let (Some(o), Some(s)) = (get("offsets"), get("sizes")) else {
                        return self.bad(format!("{cw}: `offsets` or `sizes` is missing"));
                    };
                    let offsets = self.ints(o, &format!("{cw}: `offsets`"))?;
                    let sizes = self.ints(s, &format!("{cw}: `sizes`"))?;
                    let Some(st) = find(Some(offsets.clone())) else {
                        return self.bad(format!("{cw} at offsets {offsets:?} has no `storage_data` entry"));
                    };
                    self.storage_bytes(st)?;
                    out.push(ChunkMeta { offsets, sizes, storage: st.clone() });
                }
                Ok(Kind::Tensor { dtype, size, chunks: out })
            }
            other => self.bad(format!("entry `{key}` is a `{other}`, not tensor or bytes metadata")),
        }
    }

    /// The dtype of a `TensorProperties`: first item of its state tuple (or its `dtype` field,
    /// should a version pickle it as a dict).
    fn dtype(&self, props: V, what: &str) -> Result<Dtype> {
        let state = self.instance(props, "TensorProperties", &format!("{what}: `properties`"))?;
        let dtype = match state.and_then(|s| self.p.obj(s)) {
            Some(Obj::Tuple(items)) => items.first().copied(),
            Some(Obj::Dict(items)) => {
                items.iter().find(|(k, _)| matches!(self.p.obj(*k), Some(Obj::Str(s)) if s == "dtype")).map(|(_, v)| *v)
            }
            _ => None,
        };
        match dtype.and_then(|d| self.p.obj(d)) {
            Some(Obj::Global(Global::Dtype(d))) => Ok(*d),
            _ => self.bad(format!("{what}: no dtype in its `TensorProperties`")),
        }
    }

    fn storage_data(&self, v: Option<V>) -> Result<StorageMap> {
        let Some(Obj::Dict(entries)) = v.and_then(|v| self.p.obj(v)) else {
            return self.bad("`storage_data` is missing or not a dict");
        };
        let mut out = HashMap::with_capacity(entries.len());
        for &(k, v) in entries {
            let idx = self.fields(k, "MetadataIndex", "a `storage_data` key")?;
            let get = |n: &str| idx.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
            let Some(fqn) = get("fqn") else {
                return self.bad("a `MetadataIndex` has no `fqn`");
            };
            let fqn = self.str_of(fqn, "a `MetadataIndex` fqn")?;
            let offset = match get("offset") {
                None | Some(V::None) => None,
                Some(o) => Some(self.ints(o, &format!("`{fqn}`: `MetadataIndex.offset`"))?),
            };
            let what = format!("the storage of `{fqn}`");
            let info = self.fields(v, "_StorageInfo", &what)?;
            let get = |n: &str| info.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
            let (Some(rel), Some(off), Some(len)) = (get("relative_path"), get("offset"), get("length")) else {
                return self.bad(format!("{what}: `relative_path`, `offset` or `length` is missing"));
            };
            if let Some(t) = get("transform_descriptors") {
                let empty = match self.p.obj(t) {
                    Some(Obj::List(l) | Obj::Tuple(l)) => l.is_empty(),
                    _ => matches!(t, V::None),
                };
                if !empty {
                    return self.bad(format!(
                        "{what} uses `transform_descriptors` (a compressed item), which is not supported"
                    ));
                }
            }
            let s = StorageInfo {
                relative_path: self.str_of(rel, &format!("{what}: `relative_path`"))?,
                offset: self.uint(off, &format!("{what}: `offset`"))?,
                length: self.uint(len, &format!("{what}: `length`"))?,
            };
            self.charge_str(&fqn)?;
            self.charge(2 * size_of::<((String, Option<Vec<u64>>), StorageInfo)>())?;
            if out.insert((fqn.clone(), offset.clone()), s).is_some() {
                return self.bad(format!("`{fqn}` at offsets {offset:?} has two `storage_data` entries"));
            }
        }
        Ok(out)
    }

    fn planner_data(&self, v: Option<V>) -> Result<HashMap<String, Vec<PathElem>>> {
        let mut out = HashMap::new();
        // Custom planners may store anything here; only the default planner's dict of paths
        // is understood, and without it keys are used as they are.
        let Some(Obj::Dict(entries)) = v.and_then(|v| self.p.obj(v)) else {
            return Ok(out);
        };
        for &(k, v) in entries {
            let Some(Obj::Str(key)) = self.p.obj(k) else { continue };
            let Some(Obj::Tuple(elems) | Obj::List(elems)) = self.p.obj(v) else { continue };
            self.charge_str(key)?;
            self.charge(elems.len() * size_of::<PathElem>())?;
            let mut path = Vec::with_capacity(elems.len());
            for &e in elems {
                match (e, self.p.obj(e)) {
                    (V::Int(i), _) => path.push(PathElem::Index(i)),
                    (_, Some(Obj::Str(s))) => {
                        self.charge(s.len())?;
                        path.push(PathElem::Key(s.clone()))
                    }
                    _ => return self.bad(format!("`planner_data` path of `{key}` holds a non-str, non-int element")),
                }
            }
            if path.is_empty() {
                return self.bad(format!("`planner_data` path of `{key}` is empty"));
            }
            out.insert(key.clone(), path);
        }
        Ok(out)
    }
}
