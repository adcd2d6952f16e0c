//! Writing the `.metadata` pickle.
//!
//! torch reads it with a plain `pickle.load`, so any protocol works; we write protocol 2 (what
//! the rest of our torch writer speaks) with the same object graph torch builds: each dataclass
//! as `GLOBAL cls, EMPTY_TUPLE, NEWOBJ` then `BUILD` with its field dict; `TensorProperties`'
//! state as the 5-tuple `(dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(0), pin_memory)`
//! that every torch version unpacks (2.15 adds a sixth item, strides, that 2.14 and older
//! refuse); `torch.Size(tuple)` and `_get_layout("torch.strided")` as `REDUCE`. Class globals
//! are memoized after first use, as Python's pickler does, to keep the file small.

use std::collections::HashMap;
use std::path::Path;

use super::metadata::PathElem;
use crate::formats::torch::pickle::torch_dtype_name;
use crate::read::dtype::Dtype;

const MD: &str = "torch.distributed.checkpoint.metadata";

/// A chunk as written: its place in the global tensor and its item.
#[derive(Clone, Debug)]
pub(crate) struct OutChunk {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub file: String,
    pub offset: u64,
    pub length: u64,
}

#[derive(Clone, Debug)]
pub(crate) enum OutKind {
    Tensor { dtype: Dtype, size: Vec<u64>, chunks: Vec<OutChunk> },
    Bytes { file: String, offset: u64, length: u64 },
}

#[derive(Clone, Debug)]
pub(crate) struct OutItem {
    pub key: String,
    pub path: Vec<PathElem>,
    pub kind: OutKind,
}

struct Enc {
    p: Vec<u8>,
    memo: HashMap<(&'static str, String), u32>,
}

impl Enc {
    fn global(&mut self, module: &'static str, name: &str) {
        if let Some(&i) = self.memo.get(&(module, name.to_string())) {
            self.p.push(b'j'); // LONG_BINGET
            self.p.extend_from_slice(&i.to_le_bytes());
            return;
        }
        self.p.push(b'c');
        self.p.extend_from_slice(module.as_bytes());
        self.p.push(b'\n');
        self.p.extend_from_slice(name.as_bytes());
        self.p.push(b'\n');
        let i = self.memo.len() as u32;
        self.p.push(b'r'); // LONG_BINPUT
        self.p.extend_from_slice(&i.to_le_bytes());
        self.memo.insert((module, name.to_string()), i);
    }

    fn str(&mut self, s: &str) {
        self.p.push(b'X');
        self.p.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.p.extend_from_slice(s.as_bytes());
    }

    fn int(&mut self, v: u64) {
        if v <= 0xff {
            self.p.extend_from_slice(&[b'K', v as u8]);
        } else if v <= 0xffff {
            self.p.push(b'M');
            self.p.extend_from_slice(&(v as u16).to_le_bytes());
        } else if v <= i32::MAX as u64 {
            self.p.push(b'J');
            self.p.extend_from_slice(&(v as u32).to_le_bytes());
        } else {
            // LONG1, nine bytes: the top byte zero keeps it positive.
            self.p.extend_from_slice(&[0x8a, 9]);
            self.p.extend_from_slice(&v.to_le_bytes());
            self.p.push(0);
        }
    }

    fn signed(&mut self, v: i64) {
        match u64::try_from(v) {
            Ok(u) => self.int(u),
            Err(_) => {
                self.p.extend_from_slice(&[0x8a, 8]);
                self.p.extend_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// `cls()` with the field dict as state: `GLOBAL, EMPTY_TUPLE, NEWOBJ, {…}, BUILD`. The
    /// closure writes the fields as key/value pairs.
    fn dataclass(&mut self, module: &'static str, class: &str, fields: impl FnOnce(&mut Enc)) {
        self.global(module, class);
        self.p.extend_from_slice(&[b')', 0x81, b'}', b'(']);
        fields(self);
        self.p.extend_from_slice(b"ub");
    }

    fn size(&mut self, dims: &[u64]) {
        self.global("torch", "Size");
        self.p.push(b'(');
        for &d in dims {
            self.int(d);
        }
        self.p.extend_from_slice(&[b't', 0x85, b'R']); // TUPLE, TUPLE1, REDUCE
    }

    fn properties(&mut self, dtype: Dtype) {
        self.global(MD, "TensorProperties");
        self.p.extend_from_slice(&[b')', 0x81, b'(']);
        self.global("torch", torch_dtype_name(dtype).unwrap_or("uint8"));
        self.global("torch.serialization", "_get_layout");
        self.str("torch.strided");
        self.p.extend_from_slice(&[0x85, b'R', 0x89]); // layout; requires_grad = False
        self.global(MD, "_MEM_FORMAT_ENCODING");
        self.int(0);
        self.p.extend_from_slice(&[0x85, b'R', 0x89, b't', b'b']); // contiguous; pin_memory = False
    }

    fn storage_info(&mut self, file: &str, offset: u64, length: u64) {
        self.dataclass("torch.distributed.checkpoint.filesystem", "_StorageInfo", |e| {
            e.str("relative_path");
            e.str(file);
            e.str("offset");
            e.int(offset);
            e.str("length");
            e.int(length);
        });
    }
}

/// The `.metadata` pickle for `items`, saved into `dir` under the id `save_id`: torch's
/// `Metadata` dataclass, its fields in torch's order.
pub(crate) fn encode(items: &[OutItem], dir: &Path, save_id: &str) -> Vec<u8> {
    let mut e = Enc { p: Vec::with_capacity(256 + items.len() * 512), memo: HashMap::new() };
    e.p.extend_from_slice(&[0x80, 2]);
    e.dataclass(MD, "Metadata", |e| {
        state_dict_metadata(e, items);
        planner_data(e, items);
        storage_data(e, items);
        storage_meta(e, dir, save_id);
        e.str("version");
        e.str("1.0.0");
    });
    e.p.push(b'.');
    e.p
}

/// `state_dict_metadata`: each item's key to its tensor's dtype, size and chunks, or to
/// `BytesStorageMetadata`.
fn state_dict_metadata(e: &mut Enc, items: &[OutItem]) {
    e.str("state_dict_metadata");
    e.p.extend_from_slice(b"}(");
    for it in items {
        e.str(&it.key);
        match &it.kind {
            OutKind::Tensor { dtype, size, chunks } => e.dataclass(MD, "TensorStorageMetadata", |e| {
                e.str("properties");
                e.properties(*dtype);
                e.str("size");
                e.size(size);
                e.str("chunks");
                e.p.extend_from_slice(b"](");
                for c in chunks {
                    e.dataclass(MD, "ChunkStorageMetadata", |e| {
                        e.str("offsets");
                        e.size(&c.offsets);
                        e.str("sizes");
                        e.size(&c.sizes);
                    });
                }
                e.p.push(b'e');
            }),
            OutKind::Bytes { .. } => {
                // torch pickles it with no state at all.
                e.global(MD, "BytesStorageMetadata");
                e.p.extend_from_slice(&[b')', 0x81]);
            }
        }
    }
    e.p.push(b'u');
}

/// `planner_data`: each item's key to its path in the nested state dict.
fn planner_data(e: &mut Enc, items: &[OutItem]) {
    e.str("planner_data");
    e.p.extend_from_slice(b"}(");
    for it in items {
        e.str(&it.key);
        e.p.push(b'(');
        for el in &it.path {
            match el {
                PathElem::Key(k) => e.str(k),
                PathElem::Index(i) => e.signed(*i),
            }
        }
        e.p.push(b't');
    }
    e.p.push(b'u');
}

/// `storage_data`: each chunk's (or value's) `MetadataIndex` to where its bytes are.
fn storage_data(e: &mut Enc, items: &[OutItem]) {
    e.str("storage_data");
    e.p.extend_from_slice(b"}(");
    for it in items {
        match &it.kind {
            OutKind::Tensor { chunks, .. } => {
                for (i, c) in chunks.iter().enumerate() {
                    e.dataclass(MD, "MetadataIndex", |e| {
                        e.str("fqn");
                        e.str(&it.key);
                        e.str("offset");
                        e.size(&c.offsets);
                        e.str("index");
                        e.int(i as u64);
                    });
                    e.storage_info(&c.file, c.offset, c.length);
                }
            }
            OutKind::Bytes { file, offset, length } => {
                e.dataclass(MD, "MetadataIndex", |e| {
                    e.str("fqn");
                    e.str(&it.key);
                    e.str("index");
                    e.p.push(b'N');
                });
                e.storage_info(file, *offset, *length);
            }
        }
    }
    e.p.push(b'u');
}

/// `storage_meta`: the checkpoint id (the folder) and the save id.
fn storage_meta(e: &mut Enc, dir: &Path, save_id: &str) {
    e.str("storage_meta");
    e.dataclass(MD, "StorageMeta", |e| {
        e.str("checkpoint_id");
        // A `PosixPath` pickles as the path's parts; torch keeps it for information only.
        e.global("pathlib", "PosixPath");
        e.p.push(b'(');
        for part in dir.components() {
            e.str(&part.as_os_str().to_string_lossy());
        }
        e.p.extend_from_slice(b"tR");
        e.str("save_id");
        e.str(save_id);
        e.str("load_id");
        e.p.push(b'N');
        e.str("modules");
        e.p.push(b']');
    });
}

/// A random version-4 UUID string, as torch's `save_id` (seeded by the standard library's
/// per-process random hasher keys; no cryptographic quality is needed).
pub(crate) fn uuid4() -> String {
    use std::hash::{BuildHasher, Hasher};
    let word = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(salt);
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        h.finish()
    };
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&word(1).to_le_bytes());
    b[8..].copy_from_slice(&word(2).to_le_bytes());
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}
