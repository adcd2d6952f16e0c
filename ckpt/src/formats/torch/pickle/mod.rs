//! A restricted unpickler: a symbolic pickle machine that never calls anything.
//!
//! A pickle is a program for a stack machine: opcodes push values (ints, strings, empty
//! containers), build containers from the values above the last `MARK`, store and fetch values in
//! a memo, name a global (`GLOBAL module name`) and apply it to an argument tuple (`REDUCE`).
//! Python's unpickler imports and calls whatever the pickle names, which is how a checkpoint can
//! run `os.system`. Here a global is resolved against a fixed table of the names torch's own
//! weights-only loader allows by default (`torch/_weights_only_unpickler.py`; the names are in
//! [`super::allow`]); anything else is refused at the `GLOBAL` opcode, before anything else
//! happens. Applying an allowed global builds a typed value (a tensor description, an ordered
//! dict, a dtype) without running code; a global torch admits whose result has no plain bytes
//! (a sparse or meta tensor) is refused when applied, by name.
//!
//! Objects live in an arena and values refer to them by index, so the memo shares containers the
//! way Python does (a dict memoized before it is filled is the same dict when fetched later) and
//! a hostile cycle costs nothing. Limits: the pickle length, the memo size, the stack size, the
//! nesting depth of containers, and every declared length checked against the bytes left.
//!
//! One memory budget bounds everything a pickle makes us hold ([`Budget`]): it grows with the
//! pickle's length ([`Limits::budget_per_byte`] bytes per byte, plus [`Limits::budget_per_pickle`] and a floor) up to a hard cap.
//! It counts what is really allocated, so that the peak RSS of a read stays within it: the
//! pickle's own bytes, every arena slot and stack slot (as the arena and the stack grow), every
//! buffer by its capacity and as the allocator's chunk ([`alloc_bytes`]), the memo and every
//! hash table by its buckets, and anything large is charged (or checked, [`Budget::afford`])
//! before it is allocated, not after; a memo fetch (`BINGET`) of an existing object pushes its
//! index and costs nothing new, and a long tuple is not copied to be refused. The walks that turn the arena into state-dict entries,
//! leaf values or DCP metadata charge what they build to the same budget as they build it, so a
//! DAG of memo references expanded into a tree ("billion laughs") runs out of budget instead of
//! memory.
//!
//! Opcodes of protocols 2 to 5 are understood (torch writes protocol 2; `pickle_protocol=4`
//! adds `FRAME`, `SHORT_BINUNICODE`, `MEMOIZE`, `STACK_GLOBAL`).

use std::collections::{HashMap, HashSet};
use std::mem::size_of;
use std::rc::Rc;

pub(crate) use super::allow::AllowGlobals;
use crate::read::dtype::Dtype;

mod budget;
mod calls;
mod ops;

pub(crate) use budget::{alloc_bytes, table_bytes, vec_bytes, Budget, Limits};

/// A value on the stack: scalars inline, everything else an arena index.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum V {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Obj(usize),
}

/// What a storage class global says about the storage's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StorageKind {
    /// A legacy typed class (`torch.FloatStorage`): numel counts elements of this dtype.
    Typed(Dtype),
    /// `torch.storage.UntypedStorage`: numel counts bytes.
    Untyped,
    /// Bytes decoded from the pickle itself (a numpy array), never named by one: numel counts
    /// bytes, and the key is an index into [`super::flatten::Flat::inline`].
    Inline,
}

impl StorageKind {
    pub(crate) fn elem_bytes(self) -> u64 {
        match self {
            StorageKind::Typed(d) => d.bits() / 8,
            StorageKind::Untyped | StorageKind::Inline => 1,
        }
    }
}

/// The globals we accept, by meaning (the names are in [`super::allow`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Global {
    OrderedDict,
    /// `collections.Counter`: a dict of counts.
    Counter,
    /// `builtins.set`: read as a list, in pickle order.
    Set,
    /// `builtins.bytearray`: read as bytes.
    ByteArray,
    /// `builtins.complex`.
    Complex,
    /// `torch._utils._rebuild_tensor`: the pre-1.0 form, `(storage, offset, size, stride)`.
    RebuildTensor,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    /// `_rebuild_device_tensor_from_cpu_tensor(cpu_tensor, dtype, device, requires_grad)`:
    /// tensors of backends without storages (XLA, MTIA) are pickled as a CPU copy.
    RebuildFromCpuTensor,
    TensorClass,
    /// A legacy typed tensor class (`torch.FloatTensor`, `torch.cuda.HalfTensor`): calling it
    /// with no argument makes an empty tensor that `BUILD` then points at a storage.
    LegacyTensor(Dtype),
    ParameterClass,
    Size,
    Device,
    CodecsEncode,
    /// `torch.serialization._get_layout`: a layout by name, kept as that name.
    GetLayout,
    Storage(StorageKind),
    Dtype(Dtype),
    /// A torch dtype with no equivalent here (`torch.int4`, `torch.complex32`, `torch.qint8`):
    /// a value only, by its full name; a tensor of it is refused.
    OtherDtype(&'static str),
    /// A quantization scheme (`torch.per_tensor_affine`), a value only.
    QScheme(&'static str),
    /// Admitted by torch, but what it builds has no bytes we can read: the full name, and
    /// what it builds.
    Unreadable(&'static str, &'static str),
    /// A class (or constructor function) from the caller's format-specific allow-list or from
    /// the user's `allow_globals`: an index into [`Pickle::classes`]. Applying it builds an
    /// [`Obj::Instance`] and runs nothing.
    Class(u32),
    /// A TorchScript class (`__torch__.…`), admitted only when reading a TorchScript archive:
    /// an index into [`Pickle::script_classes`]. Applying it builds an [`Obj::Script`].
    Script(usize),
    /// TorchScript's pickle helpers (`torch.jit._pickle`): `restore_type_tag(value, type)`
    /// and the `build_*list(list)` functions, each giving back its first argument.
    ScriptIdentity,
}

/// A persistent storage reference (`BINPERSID` of `("storage", cls, key, location, numel)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StorageRef {
    pub key: String,
    pub kind: StorageKind,
    pub numel: u64,
}

/// A tensor as described by a rebuild call: which storage, which elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TensorRef {
    pub storage: StorageRef,
    pub dtype: Dtype,
    /// In elements of `dtype`.
    pub offset: u64,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
}

/// An arena object.
#[derive(Clone, Debug)]
pub(crate) enum Obj {
    Str(String),
    Bytes(Vec<u8>),
    /// An integer wider than 64 bits, little-endian two's complement.
    BigInt(Vec<u8>),
    Tuple(Vec<V>),
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    Global(Global),
    Storage(StorageRef),
    Tensor(TensorRef),
    /// An object of an allow-listed [`Global::Class`] (a record): its class as Python names it,
    /// the constructor arguments (`REDUCE`, `NEWOBJ`), the state given to `BUILD`, and the
    /// items `APPENDS`/`SETITEMS` gave it (a list or dict subclass), kept as data.
    Instance {
        class: Rc<str>,
        args: Vec<V>,
        state: Option<V>,
        /// Boxed: few records have items, and every arena slot is as large as the largest.
        items: Option<Box<Items>>,
    },
    /// A TorchScript object: its class (an index into [`Pickle::script_classes`]) and the
    /// attribute dict that `BUILD` gave it.
    Script {
        class: usize,
        state: Option<V>,
    },
    /// A slice of a storage (legacy files: `offset` and `len` in elements of the storage).
    StorageView {
        storage: StorageRef,
        offset: u64,
        len: u64,
    },
    /// `builtins.complex(real, imag)`.
    Complex(f64, f64),
    /// An empty legacy tensor (`torch.FloatTensor()`) waiting for the `BUILD` that sets its
    /// storage; the dtype it was made with.
    EmptyTensor(Dtype),
}

/// The items of a record of a list or dict subclass.
#[derive(Clone, Debug, Default)]
pub(crate) struct Items {
    pub list: Vec<V>,
    pub dict: Vec<(V, V)>,
}

/// A finished unpickling: the arena and the top value.
#[derive(Debug)]
pub(crate) struct Pickle {
    pub objs: Vec<Obj>,
    pub root: V,
    /// Bytes consumed, up to and including `STOP`.
    pub end: usize,
    /// The TorchScript classes the pickle named, by full name.
    pub script_classes: Vec<String>,
    /// The allow-listed classes ([`Global::Class`]), as Python names them.
    pub classes: Vec<Rc<str>>,
    /// Every global the pickle named, as written (`module.name`), in first-seen order.
    pub globals: Vec<String>,
    /// What is left of the memory budget, for the walks over the arena.
    pub budget: Rc<Budget>,
}

impl Pickle {
    pub(crate) fn obj(&self, v: V) -> Option<&Obj> {
        match v {
            V::Obj(i) => self.objs.get(i),
            _ => None,
        }
    }

    /// The name of an allow-listed class.
    pub(crate) fn class_name(&self, i: u32) -> &str {
        self.classes.get(i as usize).map_or("?", |c| c)
    }

    /// Charges `bytes` that a walk over the arena builds to the pickle's memory budget.
    pub(crate) fn charge(&self, bytes: usize) -> std::result::Result<(), String> {
        self.budget.charge(bytes)
    }
}

/// The memory a tensor description holds besides its slot: its storage key and dims, as
/// allocated.
pub(crate) fn tensor_bytes(t: &TensorRef) -> usize {
    alloc_bytes(t.storage.key.capacity())
        + vec_bytes::<u64>(t.shape.capacity())
        + vec_bytes::<u64>(t.strides.capacity())
}

/// The memory an arena object holds besides its slot, as allocated (capacities, not lengths).
fn heap_bytes(o: &Obj) -> usize {
    match o {
        Obj::Str(s) => alloc_bytes(s.capacity()),
        Obj::Bytes(b) | Obj::BigInt(b) => alloc_bytes(b.capacity()),
        Obj::Tuple(items) | Obj::List(items) => vec_bytes::<V>(items.capacity()),
        Obj::Instance { args, items, .. } => {
            vec_bytes::<V>(args.capacity())
                + items.as_ref().map_or(0, |i| {
                    alloc_bytes(size_of::<Items>())
                        + vec_bytes::<V>(i.list.capacity())
                        + vec_bytes::<(V, V)>(i.dict.capacity())
                })
        }
        Obj::Dict(items) => vec_bytes::<(V, V)>(items.capacity()),
        Obj::Storage(s) | Obj::StorageView { storage: s, .. } => alloc_bytes(s.key.capacity()),
        Obj::Tensor(t) => tensor_bytes(t),
        Obj::Global(_) | Obj::Script { .. } | Obj::Complex(..) | Obj::EmptyTensor(_) => 0,
    }
}

/// Why a pickle was refused.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Refusal {
    /// A global outside the allow-list, as `module.name`.
    Global(String),
    /// Anything else, at a byte offset.
    Bad { at: usize, reason: String },
}

/// Resolves `module.name` against the allow-list.
pub(crate) fn resolve_global(module: &str, name: &str) -> Option<Global> {
    super::allow::resolve(module, name)
}

/// The name torch gives a dtype (`torch.<name>`).
pub(crate) fn torch_dtype_name(d: Dtype) -> Option<&'static str> {
    Some(match d {
        Dtype::F64 => "float64",
        Dtype::F32 => "float32",
        Dtype::F16 => "float16",
        Dtype::BF16 => "bfloat16",
        Dtype::I64 => "int64",
        Dtype::I32 => "int32",
        Dtype::I16 => "int16",
        Dtype::I8 => "int8",
        Dtype::U8 => "uint8",
        Dtype::U16 => "uint16",
        Dtype::U32 => "uint32",
        Dtype::U64 => "uint64",
        Dtype::Bool => "bool",
        Dtype::C64 => "complex64",
        Dtype::C128 => "complex128",
        Dtype::F8E5M2 => "float8_e5m2",
        Dtype::F8E4M3 => "float8_e4m3fn",
        Dtype::F8E5M2Fnuz => "float8_e5m2fnuz",
        Dtype::F8E4M3Fnuz => "float8_e4m3fnuz",
        Dtype::F8E8M0 => "float8_e8m0fnu",
        _ => return None,
    })
}

/// The legacy typed storage class of a dtype, when it has one (such dtypes are written with
/// `_rebuild_tensor_v2`; the others with `_rebuild_tensor_v3` over an untyped storage).
pub(crate) fn storage_class(d: Dtype) -> Option<&'static str> {
    Some(match d {
        Dtype::F64 => "DoubleStorage",
        Dtype::F32 => "FloatStorage",
        Dtype::F16 => "HalfStorage",
        Dtype::BF16 => "BFloat16Storage",
        Dtype::I64 => "LongStorage",
        Dtype::I32 => "IntStorage",
        Dtype::I16 => "ShortStorage",
        Dtype::I8 => "CharStorage",
        Dtype::U8 => "ByteStorage",
        Dtype::Bool => "BoolStorage",
        Dtype::C64 => "ComplexFloatStorage",
        Dtype::C128 => "ComplexDoubleStorage",
        _ => return None,
    })
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    /// Start of the opcode being run, for messages.
    op_at: usize,
    limits: Limits,
    classes: &'static [&'static str],
    /// The user's globals allowed as data.
    allow: &'a AllowGlobals,
    /// Allow-listed classes met so far ([`Global::Class`]), and their index by written name.
    class_names: Vec<Rc<str>>,
    class_index: HashMap<String, u32>,
    /// Every global named, as written, and the set of them.
    globals: Vec<String>,
    seen_globals: HashSet<String>,
    /// Whether TorchScript's own globals are admitted (a `torch.jit.save` archive).
    script: bool,
    script_classes: Vec<String>,
    /// Storage keys seen, and legacy storage views by key (offset and size, in elements).
    root_keys: HashMap<String, ()>,
    view_keys: HashMap<String, (u64, u64)>,
    objs: Vec<Obj>,
    depth: Vec<u32>,
    stack: Vec<V>,
    marks: Vec<usize>,
    /// The memo: slots `0..dense.len()` (pickles number them in order), and any others.
    dense: Vec<V>,
    memo: HashMap<u32, V>,
    budget: Rc<Budget>,
}

type R<T> = std::result::Result<T, Refusal>;

/// How a pickle is run: what it may name, and what it is charged to. The default is torch's
/// `weights_only` list, the default [`Limits`] and a budget of its own.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Load<'a> {
    pub limits: Limits,
    /// Classes of a format that pickles its own types (DCP's metadata dataclasses, DeepSpeed's
    /// enums), admitted as opaque data: each is understood by the caller, none is ever
    /// imported or called.
    pub classes: &'static [&'static str],
    /// The user's allow-list: more globals admitted as inert records.
    pub allow: Option<&'a AllowGlobals>,
    /// The object pickle of a TorchScript archive: classes under `__torch__.` become inert
    /// [`Obj::Script`] objects and TorchScript's list and type-tag helpers give back their
    /// argument. Nothing is imported or called here either.
    pub script: bool,
    /// A budget the other pickles of a checkpoint share (see [`Budget`]); `limits` other than
    /// the budget's own apply to this pickle.
    pub budget: Option<&'a Rc<Budget>>,
}

impl<'a> Load<'a> {
    /// With the format's own `classes` admitted.
    pub(crate) fn classes(self, classes: &'static [&'static str]) -> Self {
        Load { classes, ..self }
    }

    /// With the user's `allow` list.
    pub(crate) fn allowing(self, allow: &'a AllowGlobals) -> Self {
        Load { allow: Some(allow), ..self }
    }

    /// Charging the shared `budget`.
    pub(crate) fn charging(self, budget: &'a Rc<Budget>) -> Self {
        Load { budget: Some(budget), ..self }
    }

    /// As a TorchScript archive's object pickle.
    pub(crate) fn script(self) -> Self {
        Load { script: true, ..self }
    }
}

/// Runs the pickle at the start of `data` until `STOP`, as `how` says.
pub(crate) fn load(data: &[u8], how: Load<'_>) -> R<Pickle> {
    run(data, how).0
}

/// Every global the pickle at the start of `data` names, as written, in first-seen order: the
/// pickle run with every global admitted as a record (nothing is called either way), up to
/// its end or the first defect.
pub(crate) fn globals_named(data: &[u8], limits: Limits) -> Vec<String> {
    let any = AllowGlobals::any();
    run(data, Load { limits, ..Load::default() }.allowing(&any)).1
}

/// True when `global` (`module.name` as written) is admitted by torch's list, `classes` or
/// `allow`.
pub(crate) fn admitted(global: &str, classes: &[&str], allow: &AllowGlobals) -> bool {
    let (module, name) = global.rsplit_once('.').unwrap_or(("", global));
    resolve_global(module, name).is_some() || classes.contains(&global) || allow.allows(global)
}

/// Runs the machine; also gives back the globals it saw, whatever the outcome.
fn run(data: &[u8], how: Load<'_>) -> (R<Pickle>, Vec<String>) {
    let Load { limits, classes, allow, script, budget: shared } = how;
    let none = AllowGlobals::default();
    let allow = allow.unwrap_or(&none);
    let budget = shared.map_or_else(|| Budget::shared(limits), Rc::clone);
    let before = budget.len.get();
    let used_before = budget.used.get();
    budget.len.set(before.saturating_add(data.len()));
    budget.pickles.set(budget.pickles.get().saturating_add(1));
    let mut m = Machine {
        data,
        pos: 0,
        op_at: 0,
        limits,
        classes,
        allow,
        class_names: Vec::new(),
        class_index: HashMap::new(),
        globals: Vec::new(),
        seen_globals: HashSet::new(),
        script,
        script_classes: Vec::new(),
        root_keys: HashMap::new(),
        view_keys: HashMap::new(),
        objs: Vec::new(),
        depth: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        dense: Vec::new(),
        memo: HashMap::new(),
        budget,
    };
    // The pickle's own bytes are held while it runs (and, a record inflated from a zip,
    // until its walks are done).
    let root = match m.charge(data.len()).and_then(|()| m.run()) {
        Ok(root) => root,
        Err(e) => {
            // Everything the run built is dropped with it: a caller that runs the same bytes
            // again (to list their globals), or reads the next file, has the budget back.
            m.budget.len.set(before);
            m.budget.pickles.set(m.budget.pickles.get().saturating_sub(1));
            m.budget.used.set(used_before);
            return (Err(e), m.globals);
        }
    };
    // A pickle read from a stream (a legacy file) is only as long as what was consumed: the
    // walks over it get the budget of that length, and the bytes past it are not its own.
    m.budget.len.set(before.saturating_add(m.pos));
    m.budget.used.set(m.budget.used.get().saturating_sub(data.len() - m.pos));
    if let Err(e) = m.charge(0) {
        return (Err(e), m.globals);
    }
    let globals = m.globals.clone();
    let p = Pickle {
        objs: m.objs,
        root,
        end: m.pos,
        script_classes: m.script_classes,
        classes: m.class_names,
        globals: m.globals,
        budget: m.budget,
    };
    (Ok(p), globals)
}

impl Machine<'_> {
    /// Notes a global the pickle names, once.
    pub(super) fn note_global(&mut self, full: &str) -> R<()> {
        if !self.seen_globals.contains(full) {
            if let Some(more) = self.grow_table::<String>(self.seen_globals.len(), self.seen_globals.capacity())? {
                self.seen_globals.reserve(more);
            }
            self.charge(size_of::<String>() + 2 * alloc_bytes(full.len()))?;
            self.grow_vec(|m| &mut m.globals, 1)?;
            self.seen_globals.insert(full.to_string());
            self.globals.push(full.to_string());
        }
        Ok(())
    }

    /// The [`Global::Class`] of an allow-listed `full` name, registered on first use.
    pub(super) fn class_of(&mut self, full: &str) -> R<Global> {
        if let Some(&i) = self.class_index.get(full) {
            return Ok(Global::Class(i));
        }
        let Ok(i) = u32::try_from(self.class_names.len()) else {
            return self.bad("too many classes");
        };
        let python = super::allow::python_name(full);
        if let Some(more) = self.grow_table::<(String, u32)>(self.class_index.len(), self.class_index.capacity())? {
            self.class_index.reserve(more);
        }
        self.grow_vec(|m| &mut m.class_names, 1)?;
        self.charge(alloc_bytes(full.len()) + alloc_bytes(python.len() + 16))?;
        self.class_names.push(Rc::from(python.as_str()));
        self.class_index.insert(full.to_string(), i);
        Ok(Global::Class(i))
    }

    /// A fresh record of class `class`.
    pub(super) fn instance(&mut self, class: u32, args: Vec<V>) -> R<V> {
        let class = self.class_names.get(class as usize).map_or_else(|| Rc::from("?"), Rc::clone);
        self.alloc(Obj::Instance { class, args, state: None, items: None })
    }

    pub(super) fn bad<T>(&self, reason: impl Into<String>) -> R<T> {
        Err(Refusal::Bad { at: self.op_at, reason: reason.into() })
    }

    /// Charges `bytes` to the memory budget, refusing the pickle once it is spent.
    pub(super) fn charge(&self, bytes: usize) -> R<()> {
        self.budget.charge(bytes).map_err(|reason| Refusal::Bad { at: self.op_at, reason })
    }

    /// Refuses the pickle when `bytes` more would not fit, before they are allocated.
    pub(super) fn afford(&self, bytes: usize) -> R<()> {
        self.budget.afford(bytes).map_err(|reason| Refusal::Bad { at: self.op_at, reason })
    }

    /// [`Budget::grow_table`], as a refusal.
    pub(super) fn grow_table<T>(&self, len: usize, cap: usize) -> R<Option<usize>> {
        self.budget.grow_table::<T>(len, cap).map_err(|reason| Refusal::Bad { at: self.op_at, reason })
    }

    /// [`Budget::grow`] on the vector `field` picks out of the machine.
    pub(super) fn grow_vec<T>(&mut self, field: impl Fn(&mut Self) -> &mut Vec<T>, more: usize) -> R<()> {
        let budget = Rc::clone(&self.budget);
        let at = self.op_at;
        budget.grow(field(self), more).map_err(|reason| Refusal::Bad { at, reason })
    }

    pub(super) fn take(&mut self, n: usize) -> R<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = self.data.get(self.pos..end).unwrap_or_default();
                self.pos = end;
                Ok(s)
            }
            None => Err(Refusal::Bad {
                at: self.op_at,
                reason: format!("declared length {n} runs past the end of the pickle"),
            }),
        }
    }

    /// [`Machine::take`] of bytes to be copied, refused when their copy would not fit in the
    /// budget.
    pub(super) fn taken(&mut self, n: usize) -> R<&[u8]> {
        let at = self.pos;
        self.take(n)?;
        self.afford(alloc_bytes(n))?;
        Ok(self.data.get(at..at + n).unwrap_or_default())
    }

    pub(super) fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?.first().copied().unwrap_or(0))
    }

    pub(super) fn arr<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        Ok(<[u8; N]>::try_from(s).unwrap_or([0; N]))
    }

    pub(super) fn len_u32(&mut self) -> R<usize> {
        Ok(u32::from_le_bytes(self.arr()?) as usize)
    }

    pub(super) fn len_u64(&mut self) -> R<usize> {
        let n = u64::from_le_bytes(self.arr()?);
        usize::try_from(n).or_else(|_| self.bad(format!("declared length {n} runs past the end of the pickle")))
    }

    pub(super) fn line(&mut self) -> R<String> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let Some(nl) = rest.iter().take(1024).position(|&b| b == b'\n') else {
            return self.bad("unterminated line (more than 1024 bytes)");
        };
        let s = std::str::from_utf8(self.take(nl)?).map(str::to_string);
        self.pos += 1;
        s.or_else(|_| self.bad("line is not UTF-8"))
    }

    pub(super) fn utf8(&mut self, n: usize) -> R<V> {
        let raw = self.taken(n)?;
        let s = std::str::from_utf8(raw).map(str::to_string);
        match s {
            Ok(s) => self.alloc(Obj::Str(s)),
            Err(_) => self.bad("string is not valid UTF-8"),
        }
    }

    pub(super) fn depth_of(&self, v: V) -> u32 {
        match v {
            V::Obj(i) => self.depth.get(i).copied().unwrap_or(0),
            _ => 0,
        }
    }

    pub(super) fn alloc(&mut self, o: Obj) -> R<V> {
        let d = match &o {
            Obj::Tuple(items) | Obj::List(items) | Obj::Instance { args: items, .. } => {
                items.iter().map(|&v| self.depth_of(v) + 1).max().unwrap_or(1)
            }
            Obj::Dict(items) => items.iter().map(|&(_, v)| self.depth_of(v) + 1).max().unwrap_or(1),
            _ => 0,
        };
        if d > self.limits.max_depth {
            return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
        }
        if self.objs.len() == self.objs.capacity() {
            // The arena grows by doubling; its slots are charged when they are reserved.
            let more = self.objs.capacity().max(64);
            self.charge(more * (size_of::<Obj>() + size_of::<u32>()))?;
            self.objs.reserve_exact(more);
            self.depth.reserve_exact(more);
        }
        self.charge(heap_bytes(&o))?;
        self.objs.push(o);
        self.depth.push(d);
        Ok(V::Obj(self.objs.len() - 1))
    }

    pub(super) fn push(&mut self, v: V) -> R<()> {
        if self.stack.len() >= self.limits.max_stack {
            return self.bad(format!("stack grows past {} values", self.limits.max_stack));
        }
        self.grow_vec(|m| &mut m.stack, 1)?;
        self.stack.push(v);
        Ok(())
    }

    pub(super) fn pop(&mut self) -> R<V> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return self.bad("pops past a mark");
        }
        match self.stack.pop() {
            Some(v) => Ok(v),
            None => self.bad("stack underflow"),
        }
    }

    pub(super) fn top(&self) -> R<V> {
        match self.stack.last() {
            Some(&v) if self.marks.last().is_none_or(|&m| m < self.stack.len()) => Ok(v),
            _ => self.bad("stack underflow"),
        }
    }

    pub(super) fn pop_mark(&mut self) -> R<Vec<V>> {
        let Some(m) = self.marks.pop() else {
            return self.bad("no mark on the stack");
        };
        let m = m.min(self.stack.len());
        self.afford(vec_bytes::<V>(self.stack.len() - m))?;
        Ok(self.stack.split_off(m))
    }

    /// For `APPEND`(S) and `SETITEM`(S): where the `count` values they add start on the stack
    /// (`None`: those above the last mark, which is popped), and the container below them. The
    /// values stay on the stack, for the container to take without a copy.
    pub(super) fn added(&mut self, count: Option<usize>) -> R<(usize, V)> {
        let start = match count {
            Some(k) => {
                for i in 0..k {
                    let len = self.stack.len() - i.min(self.stack.len());
                    if self.marks.last().is_some_and(|&m| m >= len) {
                        return self.bad("pops past a mark");
                    }
                    if len == 0 {
                        return self.bad("stack underflow");
                    }
                }
                self.stack.len() - k
            }
            None => match self.marks.pop() {
                Some(m) => m.min(self.stack.len()),
                None => return self.bad("no mark on the stack"),
            },
        };
        let target = match start.checked_sub(1).and_then(|i| self.stack.get(i)) {
            Some(&v) if self.marks.last().is_none_or(|&m| m < start) => v,
            _ => return self.bad("stack underflow"),
        };
        Ok((start, target))
    }

    pub(super) fn memo_put(&mut self, idx: u32) -> R<()> {
        let v = self.top()?;
        let i = idx as usize;
        if let Some(slot) = self.dense.get_mut(i) {
            *slot = v;
            return Ok(());
        }
        if let Some(slot) = self.memo.get_mut(&idx) {
            *slot = v;
            return Ok(());
        }
        if self.dense.len() + self.memo.len() >= self.limits.max_memo {
            return self.bad(format!("memo grows past {} entries", self.limits.max_memo));
        }
        if i == self.dense.len() {
            self.grow_vec(|m| &mut m.dense, 1)?;
            self.dense.push(v);
        } else {
            if let Some(more) = self.grow_table::<(u32, V)>(self.memo.len(), self.memo.capacity())? {
                self.memo.reserve(more);
            }
            self.memo.insert(idx, v);
        }
        Ok(())
    }

    pub(super) fn memo_get(&mut self, idx: u32) -> R<()> {
        match self.dense.get(idx as usize).or_else(|| self.memo.get(&idx)).copied() {
            Some(v) => self.push(v),
            None => self.bad(format!("memo slot {idx} is read before it is written")),
        }
    }

    pub(super) fn str_of(&self, v: V) -> Option<&str> {
        match v {
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Str(s)) => Some(s),
                _ => None,
            },
            _ => None,
        }
    }

    pub(super) fn items_of(&self, v: V) -> Option<&[V]> {
        match v {
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Tuple(t)) | Some(Obj::List(t)) => Some(t),
                _ => None,
            },
            _ => None,
        }
    }

    pub(super) fn describe(&self, v: V) -> String {
        match v {
            V::None => "None".into(),
            V::Bool(_) => "a bool".into(),
            V::Int(_) => "an int".into(),
            V::Float(_) => "a float".into(),
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Str(_)) => "a string".into(),
                Some(Obj::Bytes(_)) => "bytes".into(),
                Some(Obj::BigInt(_)) => "an int".into(),
                Some(Obj::Tuple(_)) => "a tuple".into(),
                Some(Obj::List(_)) => "a list".into(),
                Some(Obj::Dict(_)) => "a dict".into(),
                Some(Obj::Global(Global::Script(c))) => {
                    format!("`{}`", self.script_classes.get(*c).map_or("?", String::as_str))
                }
                Some(Obj::Global(Global::Unreadable(name, _) | Global::OtherDtype(name) | Global::QScheme(name))) => {
                    format!("`{name}`")
                }
                Some(Obj::Global(Global::Class(c))) => {
                    format!("`{}`", self.class_names.get(*c as usize).map_or("?", |c| c))
                }
                Some(Obj::Global(g)) => format!("`{g:?}`"),
                Some(Obj::Storage(_) | Obj::StorageView { .. }) => "a storage".into(),
                Some(Obj::Tensor(_)) => "a tensor".into(),
                Some(Obj::Instance { class, .. }) => format!("a `{class}`"),
                Some(Obj::Script { class, .. }) => {
                    format!("a `{}`", self.script_classes.get(*class).map_or("?", String::as_str))
                }
                Some(Obj::Complex(..)) => "a complex".into(),
                Some(Obj::EmptyTensor(_)) => "an empty legacy tensor".into(),
                None => "nothing".into(),
            },
        }
    }

    fn run(&mut self) -> R<V> {
        loop {
            self.op_at = self.pos;
            let op = self.u8()?;
            match op {
                b'.' => {
                    let v = self.pop()?;
                    return Ok(v);
                }
                0x80 | 0x95 | b'(' | b'0' | b'1' | b'2' => self.frame_op(op)?,
                b'N' | 0x88 | 0x89 | b'J' | b'K' | b'M' | 0x8a | 0x8b | b'G' => self.scalar_op(op)?,
                b'X' | 0x8c | 0x8d | b'U' | b'T' | b'C' | b'B' | 0x8e | 0x96 => self.text_op(op)?,
                b')'
                | b't'
                | 0x85..=0x87
                | b']'
                | b'l'
                | 0x8f
                | 0x91
                | b'a'
                | b'e'
                | 0x90
                | b'}'
                | b'd'
                | b's'
                | b'u' => self.container_op(op)?,
                b'q' | b'r' | 0x94 | b'h' | b'j' => self.memo_op(op)?,
                b'c' | 0x93 | b'Q' | b'R' | 0x81 | b'b' => self.object_op(op)?,
                other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
            }
        }
    }
}

/// Values taken two by two, as key-value pairs (an even number of them).
fn pairs(items: impl ExactSizeIterator<Item = V>) -> Vec<(V, V)> {
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items;
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    out
}

#[cfg(test)]
mod tests;
