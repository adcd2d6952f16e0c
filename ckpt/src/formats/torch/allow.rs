//! The globals a pickle may name, one by one: exactly those that torch 2.13's weights-only
//! loader admits by default (`torch/_weights_only_unpickler.py`, `_get_allowed_globals`), no more.
//!
//! torch builds that list at run time from its dtype, storage and tensor classes; we keep it
//! written out, so that a review sees every name, and `fixtures/gen/torch_weights_only_globals.py`
//! regenerates the reference list from an installed torch for a test to compare with. Each name
//! maps to what it means here. Most become inert values (a dtype, an ordered dict, a set as a
//! list, a device as its name); the rebuild functions describe a tensor over a storage. A few are
//! admitted by torch but build something with no bytes we could read (meta, sparse, quantized,
//! nested tensors): they are [`Global::Unreadable`], resolved like the others so that the
//! refusal can say which global and why, instead of "not allowed".
//!
//! Like torch, a protocol-2 pickle's Python 2 module name `__builtin__` is read as `builtins`
//! (torch's `IMPORT_MAPPING`); the other renamings it applies lead to names outside the list.

use std::collections::HashMap;
use std::sync::OnceLock;

use super::pickle::{Global, StorageKind};
use crate::read::dtype::Dtype;

use Global as G;

/// Every admitted `module.name` and its meaning, sorted by name.
const ALLOWED: &[(&str, Global)] = &[
    ("_codecs.encode", G::CodecsEncode),
    ("builtins.bytearray", G::ByteArray),
    ("builtins.complex", G::Complex),
    ("builtins.set", G::Set),
    ("collections.Counter", G::Counter),
    ("collections.OrderedDict", G::OrderedDict),
    ("torch.BFloat16Storage", G::Storage(StorageKind::Typed(Dtype::BF16))),
    ("torch.BFloat16Tensor", G::LegacyTensor(Dtype::BF16)),
    ("torch.BoolStorage", G::Storage(StorageKind::Typed(Dtype::Bool))),
    ("torch.BoolTensor", G::LegacyTensor(Dtype::Bool)),
    ("torch.ByteStorage", G::Storage(StorageKind::Typed(Dtype::U8))),
    ("torch.ByteTensor", G::LegacyTensor(Dtype::U8)),
    ("torch.CharStorage", G::Storage(StorageKind::Typed(Dtype::I8))),
    ("torch.CharTensor", G::LegacyTensor(Dtype::I8)),
    ("torch.ComplexDoubleStorage", G::Storage(StorageKind::Typed(Dtype::C128))),
    ("torch.ComplexFloatStorage", G::Storage(StorageKind::Typed(Dtype::C64))),
    ("torch.DoubleStorage", G::Storage(StorageKind::Typed(Dtype::F64))),
    ("torch.DoubleTensor", G::LegacyTensor(Dtype::F64)),
    ("torch.FloatStorage", G::Storage(StorageKind::Typed(Dtype::F32))),
    ("torch.FloatTensor", G::LegacyTensor(Dtype::F32)),
    ("torch.HalfStorage", G::Storage(StorageKind::Typed(Dtype::F16))),
    ("torch.HalfTensor", G::LegacyTensor(Dtype::F16)),
    ("torch.IntStorage", G::Storage(StorageKind::Typed(Dtype::I32))),
    ("torch.IntTensor", G::LegacyTensor(Dtype::I32)),
    ("torch.LongStorage", G::Storage(StorageKind::Typed(Dtype::I64))),
    ("torch.LongTensor", G::LegacyTensor(Dtype::I64)),
    ("torch.QInt32Storage", G::Unreadable("torch.QInt32Storage", "a quantized storage")),
    ("torch.QInt8Storage", G::Unreadable("torch.QInt8Storage", "a quantized storage")),
    ("torch.QUInt2x4Storage", G::Unreadable("torch.QUInt2x4Storage", "a quantized storage")),
    ("torch.QUInt4x2Storage", G::Unreadable("torch.QUInt4x2Storage", "a quantized storage")),
    ("torch.QUInt8Storage", G::Unreadable("torch.QUInt8Storage", "a quantized storage")),
    ("torch.ShortStorage", G::Storage(StorageKind::Typed(Dtype::I16))),
    ("torch.ShortTensor", G::LegacyTensor(Dtype::I16)),
    ("torch.Size", G::Size),
    ("torch.Tensor", G::TensorClass),
    ("torch._tensor._rebuild_from_type_v2", G::RebuildFromTypeV2),
    ("torch._utils._rebuild_device_tensor_from_cpu_tensor", G::RebuildFromCpuTensor),
    (
        "torch._utils._rebuild_device_tensor_from_numpy",
        G::Unreadable("torch._utils._rebuild_device_tensor_from_numpy", "a tensor from a numpy array"),
    ),
    (
        "torch._utils._rebuild_meta_tensor_no_storage",
        G::Unreadable("torch._utils._rebuild_meta_tensor_no_storage", "a meta tensor (no data)"),
    ),
    ("torch._utils._rebuild_nested_tensor", G::Unreadable("torch._utils._rebuild_nested_tensor", "a nested tensor")),
    ("torch._utils._rebuild_parameter", G::RebuildParameter),
    ("torch._utils._rebuild_parameter_with_state", G::RebuildParameterWithState),
    ("torch._utils._rebuild_qtensor", G::Unreadable("torch._utils._rebuild_qtensor", "a quantized tensor")),
    ("torch._utils._rebuild_sparse_tensor", G::Unreadable("torch._utils._rebuild_sparse_tensor", "a sparse tensor")),
    ("torch._utils._rebuild_tensor", G::RebuildTensor),
    ("torch._utils._rebuild_tensor_v2", G::RebuildTensorV2),
    ("torch._utils._rebuild_tensor_v3", G::RebuildTensorV3),
    (
        "torch._utils._rebuild_wrapper_subclass",
        G::Unreadable("torch._utils._rebuild_wrapper_subclass", "a tensor subclass without storage"),
    ),
    ("torch.bfloat16", G::Dtype(Dtype::BF16)),
    ("torch.bits16", G::OtherDtype("torch.bits16")),
    ("torch.bits1x8", G::OtherDtype("torch.bits1x8")),
    ("torch.bits2x4", G::OtherDtype("torch.bits2x4")),
    ("torch.bits4x2", G::OtherDtype("torch.bits4x2")),
    ("torch.bits8", G::OtherDtype("torch.bits8")),
    ("torch.bool", G::Dtype(Dtype::Bool)),
    ("torch.complex128", G::Dtype(Dtype::C128)),
    ("torch.complex32", G::OtherDtype("torch.complex32")),
    ("torch.complex64", G::Dtype(Dtype::C64)),
    ("torch.cuda.BFloat16Storage", G::Storage(StorageKind::Typed(Dtype::BF16))),
    ("torch.cuda.BFloat16Tensor", G::LegacyTensor(Dtype::BF16)),
    ("torch.cuda.BoolStorage", G::Storage(StorageKind::Typed(Dtype::Bool))),
    ("torch.cuda.BoolTensor", G::LegacyTensor(Dtype::Bool)),
    ("torch.cuda.ByteStorage", G::Storage(StorageKind::Typed(Dtype::U8))),
    ("torch.cuda.ByteTensor", G::LegacyTensor(Dtype::U8)),
    ("torch.cuda.CharStorage", G::Storage(StorageKind::Typed(Dtype::I8))),
    ("torch.cuda.CharTensor", G::LegacyTensor(Dtype::I8)),
    ("torch.cuda.ComplexDoubleStorage", G::Storage(StorageKind::Typed(Dtype::C128))),
    ("torch.cuda.ComplexFloatStorage", G::Storage(StorageKind::Typed(Dtype::C64))),
    ("torch.cuda.DoubleStorage", G::Storage(StorageKind::Typed(Dtype::F64))),
    ("torch.cuda.DoubleTensor", G::LegacyTensor(Dtype::F64)),
    ("torch.cuda.FloatStorage", G::Storage(StorageKind::Typed(Dtype::F32))),
    ("torch.cuda.FloatTensor", G::LegacyTensor(Dtype::F32)),
    ("torch.cuda.HalfStorage", G::Storage(StorageKind::Typed(Dtype::F16))),
    ("torch.cuda.HalfTensor", G::LegacyTensor(Dtype::F16)),
    ("torch.cuda.IntStorage", G::Storage(StorageKind::Typed(Dtype::I32))),
    ("torch.cuda.IntTensor", G::LegacyTensor(Dtype::I32)),
    ("torch.cuda.LongStorage", G::Storage(StorageKind::Typed(Dtype::I64))),
    ("torch.cuda.LongTensor", G::LegacyTensor(Dtype::I64)),
    ("torch.cuda.ShortStorage", G::Storage(StorageKind::Typed(Dtype::I16))),
    ("torch.cuda.ShortTensor", G::LegacyTensor(Dtype::I16)),
    ("torch.cuda.sparse.BFloat16Tensor", G::Unreadable("torch.cuda.sparse.BFloat16Tensor", "a sparse tensor")),
    ("torch.cuda.sparse.ByteTensor", G::Unreadable("torch.cuda.sparse.ByteTensor", "a sparse tensor")),
    ("torch.cuda.sparse.CharTensor", G::Unreadable("torch.cuda.sparse.CharTensor", "a sparse tensor")),
    ("torch.cuda.sparse.DoubleTensor", G::Unreadable("torch.cuda.sparse.DoubleTensor", "a sparse tensor")),
    ("torch.cuda.sparse.FloatTensor", G::Unreadable("torch.cuda.sparse.FloatTensor", "a sparse tensor")),
    ("torch.cuda.sparse.HalfTensor", G::Unreadable("torch.cuda.sparse.HalfTensor", "a sparse tensor")),
    ("torch.cuda.sparse.IntTensor", G::Unreadable("torch.cuda.sparse.IntTensor", "a sparse tensor")),
    ("torch.cuda.sparse.LongTensor", G::Unreadable("torch.cuda.sparse.LongTensor", "a sparse tensor")),
    ("torch.cuda.sparse.ShortTensor", G::Unreadable("torch.cuda.sparse.ShortTensor", "a sparse tensor")),
    ("torch.device", G::Device),
    ("torch.float16", G::Dtype(Dtype::F16)),
    ("torch.float32", G::Dtype(Dtype::F32)),
    ("torch.float4_e2m1fn_x2", G::OtherDtype("torch.float4_e2m1fn_x2")),
    ("torch.float64", G::Dtype(Dtype::F64)),
    ("torch.float8_e4m3fn", G::Dtype(Dtype::F8E4M3)),
    ("torch.float8_e4m3fnuz", G::Dtype(Dtype::F8E4M3Fnuz)),
    ("torch.float8_e5m2", G::Dtype(Dtype::F8E5M2)),
    ("torch.float8_e5m2fnuz", G::Dtype(Dtype::F8E5M2Fnuz)),
    ("torch.float8_e8m0fnu", G::Dtype(Dtype::F8E8M0)),
    ("torch.int1", G::OtherDtype("torch.int1")),
    ("torch.int16", G::Dtype(Dtype::I16)),
    ("torch.int2", G::OtherDtype("torch.int2")),
    ("torch.int3", G::OtherDtype("torch.int3")),
    ("torch.int32", G::Dtype(Dtype::I32)),
    ("torch.int4", G::OtherDtype("torch.int4")),
    ("torch.int5", G::OtherDtype("torch.int5")),
    ("torch.int6", G::OtherDtype("torch.int6")),
    ("torch.int64", G::Dtype(Dtype::I64)),
    ("torch.int7", G::OtherDtype("torch.int7")),
    ("torch.int8", G::Dtype(Dtype::I8)),
    ("torch.nn.parameter.Parameter", G::ParameterClass),
    ("torch.per_channel_affine", G::QScheme("torch.per_channel_affine")),
    ("torch.per_channel_affine_float_qparams", G::QScheme("torch.per_channel_affine_float_qparams")),
    ("torch.per_channel_symmetric", G::QScheme("torch.per_channel_symmetric")),
    ("torch.per_tensor_affine", G::QScheme("torch.per_tensor_affine")),
    ("torch.per_tensor_symmetric", G::QScheme("torch.per_tensor_symmetric")),
    ("torch.qint32", G::OtherDtype("torch.qint32")),
    ("torch.qint8", G::OtherDtype("torch.qint8")),
    ("torch.quint2x4", G::OtherDtype("torch.quint2x4")),
    ("torch.quint4x2", G::OtherDtype("torch.quint4x2")),
    ("torch.quint8", G::OtherDtype("torch.quint8")),
    ("torch.serialization._get_layout", G::GetLayout),
    ("torch.sparse.BFloat16Tensor", G::Unreadable("torch.sparse.BFloat16Tensor", "a sparse tensor")),
    ("torch.sparse.ByteTensor", G::Unreadable("torch.sparse.ByteTensor", "a sparse tensor")),
    ("torch.sparse.CharTensor", G::Unreadable("torch.sparse.CharTensor", "a sparse tensor")),
    ("torch.sparse.DoubleTensor", G::Unreadable("torch.sparse.DoubleTensor", "a sparse tensor")),
    ("torch.sparse.FloatTensor", G::Unreadable("torch.sparse.FloatTensor", "a sparse tensor")),
    ("torch.sparse.HalfTensor", G::Unreadable("torch.sparse.HalfTensor", "a sparse tensor")),
    ("torch.sparse.IntTensor", G::Unreadable("torch.sparse.IntTensor", "a sparse tensor")),
    ("torch.sparse.LongTensor", G::Unreadable("torch.sparse.LongTensor", "a sparse tensor")),
    ("torch.sparse.ShortTensor", G::Unreadable("torch.sparse.ShortTensor", "a sparse tensor")),
    ("torch.storage.TypedStorage", G::Unreadable("torch.storage.TypedStorage", "a storage without its element type")),
    ("torch.storage.UntypedStorage", G::Storage(StorageKind::Untyped)),
    ("torch.uint1", G::OtherDtype("torch.uint1")),
    ("torch.uint16", G::Dtype(Dtype::U16)),
    ("torch.uint2", G::OtherDtype("torch.uint2")),
    ("torch.uint3", G::OtherDtype("torch.uint3")),
    ("torch.uint32", G::Dtype(Dtype::U32)),
    ("torch.uint4", G::OtherDtype("torch.uint4")),
    ("torch.uint5", G::OtherDtype("torch.uint5")),
    ("torch.uint6", G::OtherDtype("torch.uint6")),
    ("torch.uint64", G::Dtype(Dtype::U64)),
    ("torch.uint7", G::OtherDtype("torch.uint7")),
    ("torch.uint8", G::Dtype(Dtype::U8)),
];

/// Globals a caller allows beyond torch's list, to be read as inert data (the option
/// `allow_globals`; `ckpt --allow-global`): each pattern is a dotted name
/// (`omegaconf.dictconfig.DictConfig`), a prefix ending in `.*` (`omegaconf.*`, which also
/// admits `omegaconf` itself), or `*` for any global. Parsed once, where the option enters
/// ([`AllowGlobals::new`]), so an invalid pattern never reaches a reader.
///
/// What an allowed global means is fixed and runs nothing: applied by `REDUCE` or `NEWOBJ` it
/// makes a record of its name and arguments, `BUILD` gives the record its state and
/// `APPENDS`/`SETITEMS` its items; nothing is imported or called. numpy's arrays and scalars
/// among such records are decoded as data (see the torch reader's module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllowGlobals {
    patterns: Vec<Pattern>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Pattern {
    /// `module.name`, matched whole.
    Name(String),
    /// `module.` of `module.*`: every global under it, and `module` itself.
    Prefix(String),
    Any,
}

impl AllowGlobals {
    /// Parses `patterns`; the error names the first invalid one.
    pub fn new<I, S>(patterns: I) -> crate::Result<AllowGlobals>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut out = Vec::new();
        for p in patterns {
            let p = p.as_ref();
            let parsed = if p == "*" {
                Pattern::Any
            } else if let Some(prefix) = p.strip_suffix(".*") {
                dotted(prefix, 1).then(|| Pattern::Prefix(format!("{prefix}."))).ok_or_else(|| bad_pattern(p))?
            } else {
                dotted(p, 2).then(|| Pattern::Name(p.to_string())).ok_or_else(|| bad_pattern(p))?
            };
            if !out.contains(&parsed) {
                out.push(parsed);
            }
        }
        Ok(AllowGlobals { patterns: out })
    }

    /// Every global (`*`).
    pub fn any() -> AllowGlobals {
        AllowGlobals { patterns: vec![Pattern::Any] }
    }

    /// True when no global is allowed beyond torch's list.
    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// True when `global` (`module.name`, as a pickle names it or as Python resolves it) is
    /// allowed as data.
    pub fn allows(&self, global: &str) -> bool {
        let fixed = python_name(global);
        self.patterns.iter().any(|p| {
            let hit = |g: &str| match p {
                Pattern::Any => true,
                Pattern::Name(n) => g == n,
                Pattern::Prefix(pre) => g.starts_with(pre.as_str()) || Some(g) == pre.strip_suffix('.'),
            };
            hit(global) || hit(&fixed)
        })
    }

    /// The patterns as they were given, in order.
    pub fn patterns(&self) -> Vec<String> {
        self.patterns
            .iter()
            .map(|p| match p {
                Pattern::Any => "*".to_string(),
                Pattern::Name(n) => n.clone(),
                Pattern::Prefix(pre) => format!("{pre}*"),
            })
            .collect()
    }
}

/// `n` or more dot-separated Python identifiers.
fn dotted(s: &str, n: usize) -> bool {
    let parts: Vec<&str> = s.split('.').collect();
    parts.len() >= n
        && parts.iter().all(|p| {
            let mut c = p.chars();
            c.next().is_some_and(|f| f == '_' || f.is_alphabetic()) && c.all(|c| c == '_' || c.is_alphanumeric())
        })
}

fn bad_pattern(p: &str) -> crate::Error {
    let misuse = crate::Misuse::BadGlobalPattern { pattern: p.to_string() };
    crate::Error::Misuse { path: std::path::PathBuf::new(), misuse }
}

/// The name Python 3 resolves a global to: protocol 2 writes builtins under their Python 2
/// names (`__builtin__.long` for `int`), which the unpickler maps back (`_compat_pickle`).
pub(crate) fn python_name(global: &str) -> String {
    let (module, name) = global.rsplit_once('.').unwrap_or(("", global));
    let module = match module {
        "__builtin__" => "builtins",
        "copy_reg" => "copyreg",
        m => m,
    };
    let name = match (module, name) {
        ("builtins", "long") => "int",
        ("builtins", "unicode" | "basestring") => "str",
        ("builtins", "xrange") => "range",
        ("builtins", "unichr") => "chr",
        (_, n) => n,
    };
    format!("{module}.{name}")
}

fn table() -> &'static HashMap<&'static str, Global> {
    static TABLE: OnceLock<HashMap<&'static str, Global>> = OnceLock::new();
    TABLE.get_or_init(|| ALLOWED.iter().copied().collect())
}

/// Resolves the global `module.name` as torch's weights-only loader would, `None` when it is
/// not admitted.
pub(crate) fn resolve(module: &str, name: &str) -> Option<Global> {
    let module = if module == "__builtin__" { "builtins" } else { module };
    table().get(format!("{module}.{name}").as_str()).copied()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::formats::torch::pickle::{load, Load, Refusal};

    #[test]
    fn admits_exactly_what_torch_admits() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/torch/weights_only_globals.json");
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let torch: Vec<&str> = doc["globals"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let ours: Vec<&str> = ALLOWED.iter().map(|(n, _)| *n).collect();
        assert_eq!(ours, torch, "the allow-list differs from torch {}'s", doc["torch"]);
        for name in &torch {
            let (module, name) = name.rsplit_once('.').unwrap();
            assert!(resolve(module, name).is_some(), "{module}.{name}");
        }
    }

    #[test]
    fn refuses_everything_else() {
        for (module, name) in [
            ("posix", "system"),
            ("os", "system"),
            ("builtins", "eval"),
            ("__builtin__", "eval"),
            ("builtins", "frozenset"),
            ("builtins", "getattr"),
            ("torch", "float"),
            ("torch", "load"),
            ("torch.cuda", "QInt8Storage"),
            ("torch._utils", "_rebuild_tensor_v4"),
            ("collections", "defaultdict"),
            ("torch.nn.parameter", "Buffer"),
        ] {
            assert_eq!(resolve(module, name), None, "{module}.{name}");
        }
        // Python 2's name for the builtins module is understood, as torch does.
        assert_eq!(resolve("__builtin__", "set"), Some(G::Set));
        // And the machine refuses at the `GLOBAL` opcode, naming it as written.
        let r = load(b"\x80\x02cbuiltins\neval\n.", Load::default());
        assert_eq!(r.err(), Some(Refusal::Global("builtins.eval".into())));
        let r = load(b"\x80\x02cposix\nsystem\n.", Load::default());
        assert_eq!(r.err(), Some(Refusal::Global("posix.system".into())));
    }

    fn reason(data: &[u8]) -> String {
        match load(data, Load::default()) {
            Err(Refusal::Bad { reason, .. }) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn admitted_but_unreadable_globals_are_refused_by_name() {
        // `_rebuild_meta_tensor_no_storage(torch.float32, (2,), (1,), False)`.
        let meta = [
            &b"\x80\x02ctorch._utils\n_rebuild_meta_tensor_no_storage\n("[..],
            b"ctorch\nfloat32\nK\x02\x85K\x01\x85\x89tR.",
        ]
        .concat();
        assert_eq!(
            reason(&meta),
            "`torch._utils._rebuild_meta_tensor_no_storage` builds a meta tensor (no data); \
             only tensors over plain storages can be read"
        );
        let pid = |class: &str| {
            [&b"(X\x07\x00\x00\x00storagec"[..], class.as_bytes(), b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"]
                .concat()
        };
        // A quantized storage in a persistent id.
        let q = [&b"\x80\x02"[..], &pid("torch\nQInt8Storage\n"), b"."].concat();
        assert_eq!(
            reason(&q),
            "`torch.QInt8Storage` builds a quantized storage; only tensors over plain storages can be read"
        );
        // A dtype torch has and we do not, as a tensor's dtype (as a value it reads as its name).
        let v3 = [
            &b"\x80\x02ctorch._utils\n_rebuild_tensor_v3\n("[..],
            &pid("torch.storage\nUntypedStorage\n"),
            b"K\x00K\x04\x85K\x01\x85\x89Nctorch\nint4\ntR.",
        ]
        .concat();
        assert_eq!(reason(&v3), "tensors of dtype `torch.int4` are not supported");
    }
}
