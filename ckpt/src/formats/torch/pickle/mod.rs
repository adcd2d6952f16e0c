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
//! pickle's length ([`Limits::budget_per_byte`] bytes per byte, plus a floor) up to a hard cap.
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
use crate::dtype::Dtype;

mod budget;

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
    fn note_global(&mut self, full: &str) -> R<()> {
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
    fn class_of(&mut self, full: &str) -> R<Global> {
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
    fn instance(&mut self, class: u32, args: Vec<V>) -> R<V> {
        let class = self.class_names.get(class as usize).map_or_else(|| Rc::from("?"), Rc::clone);
        self.alloc(Obj::Instance { class, args, state: None, items: None })
    }

    fn bad<T>(&self, reason: impl Into<String>) -> R<T> {
        Err(Refusal::Bad { at: self.op_at, reason: reason.into() })
    }

    /// Charges `bytes` to the memory budget, refusing the pickle once it is spent.
    fn charge(&self, bytes: usize) -> R<()> {
        self.budget.charge(bytes).map_err(|reason| Refusal::Bad { at: self.op_at, reason })
    }

    /// Refuses the pickle when `bytes` more would not fit, before they are allocated.
    fn afford(&self, bytes: usize) -> R<()> {
        self.budget.afford(bytes).map_err(|reason| Refusal::Bad { at: self.op_at, reason })
    }

    /// [`Budget::grow_table`], as a refusal.
    fn grow_table<T>(&self, len: usize, cap: usize) -> R<Option<usize>> {
        self.budget.grow_table::<T>(len, cap).map_err(|reason| Refusal::Bad { at: self.op_at, reason })
    }

    /// [`Budget::grow`] on the vector `field` picks out of the machine.
    fn grow_vec<T>(&mut self, field: impl Fn(&mut Self) -> &mut Vec<T>, more: usize) -> R<()> {
        let budget = Rc::clone(&self.budget);
        let at = self.op_at;
        budget.grow(field(self), more).map_err(|reason| Refusal::Bad { at, reason })
    }

    fn take(&mut self, n: usize) -> R<&[u8]> {
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
    fn taken(&mut self, n: usize) -> R<&[u8]> {
        let at = self.pos;
        self.take(n)?;
        self.afford(alloc_bytes(n))?;
        Ok(self.data.get(at..at + n).unwrap_or_default())
    }
    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?.first().copied().unwrap_or(0))
    }
    fn arr<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        Ok(<[u8; N]>::try_from(s).unwrap_or([0; N]))
    }
    fn len_u32(&mut self) -> R<usize> {
        Ok(u32::from_le_bytes(self.arr()?) as usize)
    }
    fn len_u64(&mut self) -> R<usize> {
        let n = u64::from_le_bytes(self.arr()?);
        usize::try_from(n).or_else(|_| self.bad(format!("declared length {n} runs past the end of the pickle")))
    }
    fn line(&mut self) -> R<String> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let Some(nl) = rest.iter().take(1024).position(|&b| b == b'\n') else {
            return self.bad("unterminated line (more than 1024 bytes)");
        };
        let s = std::str::from_utf8(self.take(nl)?).map(str::to_string);
        self.pos += 1;
        s.or_else(|_| self.bad("line is not UTF-8"))
    }
    fn utf8(&mut self, n: usize) -> R<V> {
        let raw = self.taken(n)?;
        let s = std::str::from_utf8(raw).map(str::to_string);
        match s {
            Ok(s) => self.alloc(Obj::Str(s)),
            Err(_) => self.bad("string is not valid UTF-8"),
        }
    }

    fn depth_of(&self, v: V) -> u32 {
        match v {
            V::Obj(i) => self.depth.get(i).copied().unwrap_or(0),
            _ => 0,
        }
    }
    fn alloc(&mut self, o: Obj) -> R<V> {
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
    fn push(&mut self, v: V) -> R<()> {
        if self.stack.len() >= self.limits.max_stack {
            return self.bad(format!("stack grows past {} values", self.limits.max_stack));
        }
        self.grow_vec(|m| &mut m.stack, 1)?;
        self.stack.push(v);
        Ok(())
    }
    fn pop(&mut self) -> R<V> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return self.bad("pops past a mark");
        }
        match self.stack.pop() {
            Some(v) => Ok(v),
            None => self.bad("stack underflow"),
        }
    }
    fn top(&self) -> R<V> {
        match self.stack.last() {
            Some(&v) if self.marks.last().is_none_or(|&m| m < self.stack.len()) => Ok(v),
            _ => self.bad("stack underflow"),
        }
    }
    fn pop_mark(&mut self) -> R<Vec<V>> {
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
    fn added(&mut self, count: Option<usize>) -> R<(usize, V)> {
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
    fn memo_put(&mut self, idx: u32) -> R<()> {
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
    fn memo_get(&mut self, idx: u32) -> R<()> {
        match self.dense.get(idx as usize).or_else(|| self.memo.get(&idx)).copied() {
            Some(v) => self.push(v),
            None => self.bad(format!("memo slot {idx} is read before it is written")),
        }
    }
    fn global(&mut self, module: &str, name: &str) -> R<()> {
        let full = format!("{module}.{name}");
        self.note_global(&full)?;
        let found = match resolve_global(module, name) {
            Some(g) => Some(g),
            None if self.classes.contains(&full.as_str()) || self.allow.allows(&full) => Some(self.class_of(&full)?),
            None if self.script => self.script_global(module, name)?,
            None => None,
        };
        match found {
            Some(g) => {
                let v = self.alloc(Obj::Global(g))?;
                self.push(v)
            }
            None => Err(Refusal::Global(full)),
        }
    }
    /// The globals a TorchScript object pickle adds: its own classes and two kinds of helper.
    fn script_global(&mut self, module: &str, name: &str) -> R<Option<Global>> {
        if module == "torch.jit._pickle"
            && matches!(
                name,
                "restore_type_tag" | "build_intlist" | "build_doublelist" | "build_boollist" | "build_tensorlist"
            )
        {
            return Ok(Some(Global::ScriptIdentity));
        }
        if module != "__torch__" && !module.starts_with("__torch__.") {
            return Ok(None);
        }
        // Custom C++ classes (`torch.classes.…`, such as quantized packed weights) restore their
        // state by running their own `__setstate__`: nothing we can read as data.
        if module == "__torch__.torch.classes" || module.starts_with("__torch__.torch.classes.") {
            return self
                .bad(format!("`{module}.{name}` is a custom C++ class, whose state only its own code can restore"));
        }
        let full = format!("{module}.{name}");
        let idx = match self.script_classes.iter().position(|c| *c == full) {
            Some(i) => i,
            None => {
                if self.script_classes.len() >= self.limits.max_memo {
                    return self.bad("too many TorchScript classes");
                }
                self.grow_vec(|m| &mut m.script_classes, 1)?;
                self.charge(alloc_bytes(full.len()))?;
                self.script_classes.push(full);
                self.script_classes.len() - 1
            }
        };
        Ok(Some(Global::Script(idx)))
    }

    fn str_of(&self, v: V) -> Option<&str> {
        match v {
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Str(s)) => Some(s),
                _ => None,
            },
            _ => None,
        }
    }
    fn items_of(&self, v: V) -> Option<&[V]> {
        match v {
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Tuple(t)) | Some(Obj::List(t)) => Some(t),
                _ => None,
            },
            _ => None,
        }
    }
    fn describe(&self, v: V) -> String {
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

    /// One opcode of the stack and its marks: `PROTO`, `FRAME`, `MARK`, `POP`, `POP_MARK`, `DUP`.
    fn frame_op(&mut self, op: u8) -> R<()> {
        match op {
            0x80 => {
                let proto = self.u8()?;
                if proto > 5 {
                    return self.bad(format!("unsupported pickle protocol {proto}"));
                }
            }
            0x95 => {
                self.take(8)?;
            }
            b'(' => {
                if self.marks.len() >= self.limits.max_depth as usize {
                    return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
                }
                self.marks.push(self.stack.len());
            }
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?;
                self.push(v)?;
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of numbers and constants: `NONE`, the booleans, the integers in text and binary, `BINFLOAT`.
    fn scalar_op(&mut self, op: u8) -> R<()> {
        match op {
            b'N' => self.push(V::None)?,
            0x88 => self.push(V::Bool(true))?,
            0x89 => self.push(V::Bool(false))?,
            b'J' => {
                let v = i32::from_le_bytes(self.arr()?);
                self.push(V::Int(v.into()))?
            }
            b'K' => {
                let v = self.u8()?;
                self.push(V::Int(v.into()))?
            }
            b'M' => {
                let v = u16::from_le_bytes(self.arr()?);
                self.push(V::Int(v.into()))?
            }
            0x8a => {
                let n = usize::from(self.u8()?);
                self.long(n)?
            }
            0x8b => {
                let n = self.len_u32()?;
                self.long(n)?
            }
            b'G' => {
                let v = f64::from_be_bytes(self.arr()?);
                self.push(V::Float(v))?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of strings and bytes, in every width.
    fn text_op(&mut self, op: u8) -> R<()> {
        match op {
            b'X' => {
                let n = self.len_u32()?;
                let v = self.utf8(n)?;
                self.push(v)?
            }
            0x8c => {
                let n = usize::from(self.u8()?);
                let v = self.utf8(n)?;
                self.push(v)?
            }
            0x8d => {
                let n = self.len_u64()?;
                let v = self.utf8(n)?;
                self.push(v)?
            }
            // py2 byte strings: torch reads them as latin-1 text.
            b'U' | b'T' => {
                let n = if op == b'U' { usize::from(self.u8()?) } else { self.len_u32()? };
                let at = self.pos;
                let wide = self.take(n)?.iter().filter(|&&b| b >= 0x80).count();
                self.afford(alloc_bytes(n + wide))?;
                let mut s = String::with_capacity(n + wide);
                s.extend(self.data.get(at..at + n).unwrap_or_default().iter().map(|&b| char::from(b)));
                let v = self.alloc(Obj::Str(s))?;
                self.push(v)?
            }
            b'C' | b'B' | 0x8e | 0x96 => {
                let n = match op {
                    b'C' => usize::from(self.u8()?),
                    b'B' => self.len_u32()?,
                    _ => self.len_u64()?,
                };
                let b = self.taken(n)?.to_vec();
                let v = self.alloc(Obj::Bytes(b))?;
                self.push(v)?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of tuples, lists, dicts and sets, and the opcodes that fill them.
    fn container_op(&mut self, op: u8) -> R<()> {
        match op {
            b')' => {
                let v = self.alloc(Obj::Tuple(Vec::new()))?;
                self.push(v)?
            }
            b't' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::Tuple(items))?;
                self.push(v)?
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                let v = self.alloc(Obj::Tuple(items))?;
                self.push(v)?
            }
            b']' => {
                let v = self.alloc(Obj::List(Vec::new()))?;
                self.push(v)?
            }
            b'l' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::List(items))?;
                self.push(v)?
            }
            // Sets become lists: order is all a reader can observe.
            0x8f => {
                let v = self.alloc(Obj::List(Vec::new()))?;
                self.push(v)?
            }
            0x91 => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::List(items))?;
                self.push(v)?
            }
            b'a' | b'e' | 0x90 => {
                let (start, target) = self.added((op == b'a').then_some(1))?;
                self.extend_list(target, start)?
            }
            b'}' => {
                let v = self.alloc(Obj::Dict(Vec::new()))?;
                self.push(v)?
            }
            b'd' => {
                let Some(m) = self.marks.pop() else {
                    return self.bad("no mark on the stack");
                };
                let m = m.min(self.stack.len());
                if !(self.stack.len() - m).is_multiple_of(2) {
                    return self.bad("odd number of dict items");
                }
                self.afford(vec_bytes::<(V, V)>((self.stack.len() - m) / 2))?;
                let pairs = pairs(self.stack.drain(m..));
                let v = self.alloc(Obj::Dict(pairs))?;
                self.push(v)?
            }
            b's' | b'u' => {
                let (start, target) = self.added((op == b's').then_some(2))?;
                if !(self.stack.len() - start).is_multiple_of(2) {
                    return self.bad("odd number of dict items");
                }
                self.extend_dict(target, start)?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of the memo: `BINPUT`, `LONG_BINPUT`, `MEMOIZE`, `BINGET`, `LONG_BINGET`.
    fn memo_op(&mut self, op: u8) -> R<()> {
        match op {
            b'q' => {
                let i = self.u8()?;
                self.memo_put(i.into())?
            }
            b'r' => {
                let i = u32::from_le_bytes(self.arr()?);
                self.memo_put(i)?
            }
            0x94 => {
                let i = u32::try_from(self.dense.len() + self.memo.len()).unwrap_or(u32::MAX);
                self.memo_put(i)?
            }
            b'h' => {
                let i = self.u8()?;
                self.memo_get(i.into())?
            }
            b'j' => {
                let i = u32::from_le_bytes(self.arr()?);
                self.memo_get(i)?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of objects: globals (`GLOBAL`, `STACK_GLOBAL`), persistent ids, `REDUCE`, `NEWOBJ` and `BUILD`.
    fn object_op(&mut self, op: u8) -> R<()> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(&module, &name)?
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Some(module), Some(name)) = (self.str_of(module), self.str_of(name)) else {
                    return self.bad("STACK_GLOBAL needs two strings");
                };
                let (module, name) = (module.to_string(), name.to_string());
                self.global(&module, &name)?
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = self.persistent(pid)?;
                self.push(v)?
            }
            b'R' => {
                let args = self.pop()?;
                let func = self.pop()?;
                let v = self.call(func, args)?;
                self.push(v)?
            }
            0x81 => {
                let args = self.pop()?;
                let cls = self.pop()?;
                match self.global_of(cls) {
                    Some(Global::OrderedDict) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                        let v = self.alloc(Obj::Dict(Vec::new()))?;
                        self.push(v)?
                    }
                    Some(Global::Counter) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                        let v = self.alloc(Obj::Dict(Vec::new()))?;
                        self.push(v)?
                    }
                    Some(Global::Set) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                        let v = self.alloc(Obj::List(Vec::new()))?;
                        self.push(v)?
                    }
                    // torch applies `Parameter(*args)`: the data tensor, requires_grad aside.
                    Some(Global::ParameterClass) => match self.items_of(args) {
                        Some(&[t, ..]) => {
                            let v = self.expect_tensor(t)?;
                            self.push(v)?
                        }
                        _ => return self.bad("NEWOBJ of `Parameter` needs a tensor"),
                    },
                    Some(Global::Unreadable(global, what)) => return self.unreadable(global, what),
                    Some(Global::Class(class)) => {
                        self.afford(vec_bytes::<V>(self.items_of(args).map_or(0, <[V]>::len)))?;
                        let Some(args) = self.items_of(args).map(<[V]>::to_vec) else {
                            return self.bad("NEWOBJ arguments must be a tuple");
                        };
                        let v = self.instance(class, args)?;
                        self.push(v)?
                    }
                    Some(Global::Script(class)) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                        let v = self.alloc(Obj::Script { class, state: None })?;
                        self.push(v)?
                    }
                    _ => return self.bad(format!("NEWOBJ of {} is not allowed", self.describe(cls))),
                }
            }
            b'b' => {
                let state = self.pop()?;
                let target = self.top()?;
                // torch sets attributes of state dicts (`_metadata`) and of tensors this
                // way; neither carries tensor data, so the state is dropped. An allow-listed
                // instance keeps its state: that is where dataclasses keep their fields.
                let idx = match target {
                    V::Obj(i) => i,
                    _ => usize::MAX,
                };
                // A legacy tensor gets its storage here: torch calls
                // `set_(storage, offset, size, stride)` with the state.
                if let Some(Obj::EmptyTensor(d)) = self.objs.get(idx) {
                    let d = *d;
                    let t = match self.items_of(state) {
                        Some(&[storage, offset, size, stride]) => {
                            self.tensor_ref(storage, offset, size, stride, Some(d))?
                        }
                        _ => return self.bad("a legacy tensor's state must be (storage, offset, size, stride)"),
                    };
                    self.charge(tensor_bytes(&t))?;
                    if let Some(slot) = self.objs.get_mut(idx) {
                        *slot = Obj::Tensor(t);
                    }
                    return Ok(());
                }
                let dict_state = matches!(self.obj_at(state), Some(Obj::Dict(_)));
                let d = self.depth_of(state) + 1;
                if matches!(self.objs.get(idx), Some(Obj::Instance { state: None, .. })) {
                    if d > self.limits.max_depth {
                        return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
                    }
                    if let Some(slot) = self.depth.get_mut(idx) {
                        *slot = (*slot).max(d);
                    }
                }
                match self.objs.get_mut(idx) {
                    Some(Obj::Dict(_) | Obj::Tensor(_)) => {}
                    Some(Obj::Instance { state: slot @ None, .. }) => *slot = Some(state),
                    // A TorchScript object's state is its attribute dict, unless its class
                    // defines `__getstate__`; that state only its own code understands.
                    Some(Obj::Script { state: slot @ None, .. }) if dict_state => *slot = Some(state),
                    _ => return self.bad(format!("BUILD on {} is not allowed", self.describe(target))),
                }
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    fn long(&mut self, n: usize) -> R<()> {
        let bytes = self.taken(n)?.to_vec();
        if n <= 8 {
            let fill = if bytes.last().is_some_and(|&b| b & 0x80 != 0) { 0xff } else { 0 };
            let mut buf = [fill; 8];
            buf.get_mut(..n).unwrap_or_default().copy_from_slice(&bytes);
            self.push(V::Int(i64::from_le_bytes(buf)))
        } else {
            let v = self.alloc(Obj::BigInt(bytes))?;
            self.push(v)
        }
    }

    /// `APPEND`(S): the values from `start` up on the stack go to the list (or record of a list
    /// subclass) `target`, its buffer charged as it grows.
    fn extend_list(&mut self, target: V, start: usize) -> R<()> {
        let added = self.stack.get(start..).unwrap_or_default();
        let d = added.iter().map(|&v| self.depth_of(v) + 1).max().unwrap_or(0);
        if d > self.limits.max_depth {
            return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
        }
        let n = added.len();
        if let V::Obj(i) = target {
            let budget = Rc::clone(&self.budget);
            let at = self.op_at;
            let Machine { objs, stack, depth, .. } = self;
            // A record of a list subclass gets its items the way a list does.
            let list = match objs.get_mut(i) {
                Some(Obj::List(list)) => Some(list),
                Some(Obj::Instance { items, .. }) => {
                    if items.is_none() {
                        budget.charge(alloc_bytes(size_of::<Items>())).map_err(|reason| Refusal::Bad { at, reason })?;
                    }
                    Some(&mut items.get_or_insert_with(Box::default).list)
                }
                _ => None,
            };
            if let Some(list) = list {
                budget.grow(list, n).map_err(|reason| Refusal::Bad { at, reason })?;
                list.extend(stack.drain(start..));
                if let Some(slot) = depth.get_mut(i) {
                    *slot = (*slot).max(d);
                }
                return Ok(());
            }
        }
        self.bad(format!("APPEND to {}", self.describe(target)))
    }

    /// `SETITEM`(S): the key-value pairs from `start` up on the stack go to the dict (or record
    /// of a dict subclass) `target`, its buffer charged as it grows.
    fn extend_dict(&mut self, target: V, start: usize) -> R<()> {
        let added = self.stack.get(start..).unwrap_or_default();
        let d = added.iter().skip(1).step_by(2).map(|&v| self.depth_of(v) + 1).max().unwrap_or(0);
        if d > self.limits.max_depth {
            return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
        }
        let n = added.len() / 2;
        if let V::Obj(i) = target {
            let budget = Rc::clone(&self.budget);
            let at = self.op_at;
            let Machine { objs, stack, depth, .. } = self;
            // A record of a dict subclass (`defaultdict`, an `AttributeDict`) likewise.
            let dict = match objs.get_mut(i) {
                Some(Obj::Dict(dict)) => Some(dict),
                Some(Obj::Instance { items, .. }) => {
                    if items.is_none() {
                        budget.charge(alloc_bytes(size_of::<Items>())).map_err(|reason| Refusal::Bad { at, reason })?;
                    }
                    Some(&mut items.get_or_insert_with(Box::default).dict)
                }
                _ => None,
            };
            if let Some(dict) = dict {
                budget.grow(dict, n).map_err(|reason| Refusal::Bad { at, reason })?;
                // Repeated keys are kept here and refused when names are flattened.
                let mut it = stack.drain(start..);
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    dict.push((k, v));
                }
                if let Some(slot) = depth.get_mut(i) {
                    *slot = (*slot).max(d);
                }
                return Ok(());
            }
        }
        self.bad(format!("SETITEM on {}", self.describe(target)))
    }

    fn global_of(&self, v: V) -> Option<Global> {
        match v {
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Global(g)) => Some(*g),
                _ => None,
            },
            _ => None,
        }
    }

    fn int_of(&self, v: V, what: &str) -> R<u64> {
        match v {
            V::Int(i) if i >= 0 => Ok(i as u64),
            _ => self.bad(format!("{what} must be a non-negative int, found {}", self.describe(v))),
        }
    }

    fn ints_of(&self, v: V, what: &str) -> R<Vec<u64>> {
        let Some(items) = self.items_of(v) else {
            return self.bad(format!("{what} must be a tuple, found {}", self.describe(v)));
        };
        self.afford(vec_bytes::<u64>(items.len()))?;
        items.iter().map(|&i| self.int_of(i, what)).collect()
    }

    fn persistent(&mut self, pid: V) -> R<V> {
        // A storage tuple has five or six elements: a longer one is not copied to be refused.
        let items = self.items_of(pid).filter(|i| i.len() <= 6).map(<[V]>::to_vec).unwrap_or_default();
        // The location (`cpu`, `cuda:1`, `mps`, …) is where torch would put the storage; its
        // bytes in the file do not depend on it, so it is not read.
        let (tag, cls, key, numel, view) = match items.as_slice() {
            // ("storage", cls, key, location, numel) and the legacy form with a sixth element:
            // `None`, or `(view key, offset, size)` for a slice of the storage.
            [tag, cls, key, _location, numel] | [tag, cls, key, _location, numel, V::None] => {
                (*tag, *cls, *key, *numel, None)
            }
            [tag, cls, key, _location, numel, view] => (*tag, *cls, *key, *numel, Some(*view)),
            _ => return self.bad("persistent id is not a storage tuple"),
        };
        if self.str_of(tag) != Some("storage") {
            return self.bad("persistent id is not a storage tuple");
        }
        let kind = match self.global_of(cls) {
            Some(Global::Storage(kind)) => kind,
            Some(Global::Unreadable(global, what)) => return self.unreadable(global, what),
            _ => return self.bad(format!("persistent id names {} instead of a storage class", self.describe(cls))),
        };
        let key = match key {
            V::Int(i) => i.to_string(),
            other => match self.str_of(other) {
                Some(s) => {
                    self.afford(alloc_bytes(s.len()))?;
                    s.to_string()
                }
                None => return self.bad("storage key must be a string"),
            },
        };
        let numel = self.int_of(numel, "storage size")?;
        let storage = StorageRef { key, kind, numel };
        if self.view_keys.contains_key(&storage.key) {
            return self.bad(format!("storage key `{}` names both a storage and a view", storage.key));
        }
        if !self.root_keys.contains_key(&storage.key) {
            if let Some(more) = self.grow_table::<(String, ())>(self.root_keys.len(), self.root_keys.capacity())? {
                self.root_keys.reserve(more);
            }
            self.charge(alloc_bytes(storage.key.len()))?;
        }
        self.root_keys.insert(storage.key.clone(), ());
        let Some(view) = view else {
            return self.alloc(Obj::Storage(storage));
        };
        let (vkey, offset, len) = match self.items_of(view) {
            Some(&[k, o, n]) => {
                (self.str_of(k).map(str::to_string), self.int_of(o, "view offset")?, self.int_of(n, "view size")?)
            }
            _ => return self.bad("storage view must be (key, offset, size)"),
        };
        let Some(vkey) = vkey else {
            return self.bad("storage view key must be a string");
        };
        if matches!(kind, StorageKind::Untyped) {
            return self.bad("a view of an untyped storage");
        }
        if self.root_keys.contains_key(&vkey) {
            return self.bad(format!("storage key `{vkey}` names both a storage and a view"));
        }
        // torch keeps the first view made under a key and hands it out again for later ids.
        if !self.view_keys.contains_key(&vkey) {
            if let Some(more) =
                self.grow_table::<(String, (u64, u64))>(self.view_keys.len(), self.view_keys.capacity())?
            {
                self.view_keys.reserve(more);
            }
            self.charge(alloc_bytes(vkey.len()))?;
        }
        let (offset, len) = *self.view_keys.entry(vkey).or_insert((offset, len));
        if offset.checked_add(len).is_none_or(|end| end > numel) {
            return self
                .bad(format!("storage view of {len} elements at {offset} runs past its {numel}-element storage"));
        }
        self.alloc(Obj::StorageView { storage, offset, len })
    }

    fn call(&mut self, func: V, args: V) -> R<V> {
        let Some(g) = self.global_of(func) else {
            return self.bad(format!("REDUCE calls {}, not an allowed global", self.describe(func)));
        };
        let Some(n) = self.items_of(args).map(<[V]>::len) else {
            return self.bad("REDUCE arguments must be a tuple");
        };
        // Only a record keeps its arguments; the other globals take a few, and a long tuple
        // is refused before it is copied.
        if !matches!(g, Global::Class(_) | Global::Unreadable(..)) && n > 8 {
            return self.bad(format!("cannot call `{g:?}` with {n} arguments"));
        }
        self.afford(vec_bytes::<V>(n))?;
        let a = self.items_of(args).map(<[V]>::to_vec).unwrap_or_default();
        match (g, a.as_slice()) {
            (Global::Class(class), _) => self.instance(class, a),
            (Global::Unreadable(global, what), _) => self.unreadable(global, what),
            (Global::OrderedDict | Global::Counter, []) => self.alloc(Obj::Dict(Vec::new())),
            // `Counter(mapping)`, the way a Counter pickles itself.
            (Global::Counter, [items]) => match self.obj_at(*items) {
                Some(Obj::Dict(d)) => {
                    self.afford(vec_bytes::<(V, V)>(d.len()))?;
                    let d = d.clone();
                    self.alloc(Obj::Dict(d))
                }
                _ => self.bad(format!("`Counter` of {}", self.describe(*items))),
            },
            (Global::Set, []) => self.alloc(Obj::List(Vec::new())),
            (Global::Set, [items]) => match self.items_of(*items) {
                Some(items) => {
                    self.afford(vec_bytes::<V>(items.len()))?;
                    let items = items.to_vec();
                    self.alloc(Obj::List(items))
                }
                None => self.bad(format!("`set` of {}", self.describe(*items))),
            },
            (Global::ByteArray, []) => self.alloc(Obj::Bytes(Vec::new())),
            (Global::ByteArray, [b]) => match self.obj_at(*b) {
                Some(Obj::Bytes(b)) => {
                    self.afford(alloc_bytes(b.len()))?;
                    let b = b.clone();
                    self.alloc(Obj::Bytes(b))
                }
                _ => self.bad(format!("`bytearray` of {}", self.describe(*b))),
            },
            // Protocol 2 writes a bytearray as `bytearray(text, "latin-1")`.
            (Global::ByteArray, [text, enc]) => self.latin1(*text, *enc, "bytearray"),
            (Global::Complex, [re, im]) => {
                let num = |v: V| match v {
                    V::Float(f) => Some(f),
                    V::Int(i) => Some(i as f64),
                    _ => None,
                };
                match (num(*re), num(*im)) {
                    (Some(re), Some(im)) => self.alloc(Obj::Complex(re, im)),
                    _ => self.bad("`complex` needs two numbers"),
                }
            }
            (Global::GetLayout, [name]) => match self.str_of(*name) {
                Some(s) => {
                    let s = s.to_string();
                    self.alloc(Obj::Str(s))
                }
                None => self.bad("layout name must be a string"),
            },
            (Global::LegacyTensor(d), []) => self.alloc(Obj::EmptyTensor(d)),
            (Global::ScriptIdentity, [v, ..]) => Ok(*v),
            (Global::OrderedDict, [items]) => {
                let all = self.items_of(*items).unwrap_or_default();
                self.afford(vec_bytes::<(V, V)>(all.len()))?;
                let mut pairs = Vec::with_capacity(all.len());
                for &p in all {
                    match self.items_of(p) {
                        Some(&[k, v]) => pairs.push((k, v)),
                        _ => return self.bad("OrderedDict items must be pairs"),
                    }
                }
                self.alloc(Obj::Dict(pairs))
            }
            (Global::Size, [dims]) => {
                let dims = self.ints_of(*dims, "a size")?;
                self.afford(vec_bytes::<V>(dims.len()))?;
                self.alloc(Obj::Tuple(dims.into_iter().map(|d| V::Int(d as i64)).collect()))
            }
            // `torch.device("cuda:1")` or `torch.device("cuda", 1)`: kept as its name.
            (Global::Device, [kind, rest @ ..]) if rest.len() <= 1 => {
                let name = match (self.str_of(*kind), rest) {
                    (Some(s), []) | (Some(s), [V::None]) => s.to_string(),
                    (Some(s), [V::Int(i)]) if *i >= 0 && !s.contains(':') => format!("{s}:{i}"),
                    _ => return self.bad("device must be a name and an optional index"),
                };
                self.alloc(Obj::Str(name))
            }
            (Global::CodecsEncode, [text, enc]) => self.latin1(*text, *enc, "_codecs.encode"),
            (Global::RebuildTensor, [storage, offset, size, stride]) => {
                self.tensor(*storage, *offset, *size, *stride, None)
            }
            (Global::RebuildTensorV2, [storage, offset, size, stride, _rg, _hooks, rest @ ..]) if rest.len() <= 1 => {
                self.no_metadata(rest)?;
                self.tensor(*storage, *offset, *size, *stride, None)
            }
            (Global::RebuildTensorV3, [storage, offset, size, stride, _rg, _hooks, dtype, rest @ ..])
                if rest.len() <= 1 =>
            {
                self.no_metadata(rest)?;
                let d = self.dtype_of(*dtype)?;
                self.tensor(*storage, *offset, *size, *stride, Some(d))
            }
            // torch converts the CPU copy with `.to(dtype)`; it was written with that dtype, and a
            // cast here would be a guess.
            (Global::RebuildFromCpuTensor, [t, dtype, _device, _rg]) => {
                let d = self.dtype_of(*dtype)?;
                match self.obj_at(*t) {
                    Some(Obj::Tensor(inner)) if inner.dtype == d => Ok(*t),
                    Some(Obj::Tensor(_)) => self.bad("a device tensor's CPU copy has another dtype"),
                    _ => self.bad(format!("expected a tensor, found {}", self.describe(*t))),
                }
            }
            (Global::RebuildParameter, [t, _rg, _hooks]) | (Global::RebuildParameterWithState, [t, _rg, _hooks, _]) => {
                self.expect_tensor(*t)
            }
            (Global::RebuildFromTypeV2, [f, ty, inner, _state]) => {
                if !matches!(self.global_of(*ty), Some(Global::TensorClass | Global::ParameterClass)) {
                    if let Some(Global::Unreadable(global, what)) = self.global_of(*ty) {
                        return self.unreadable(global, what);
                    }
                    return self.bad(format!("tensor subclass {} is not supported", self.describe(*ty)));
                }
                self.call(*f, *inner)
            }
            (g, _) => self.bad(format!("cannot call `{g:?}` with {} arguments", a.len())),
        }
    }

    fn no_metadata(&self, rest: &[V]) -> R<()> {
        match rest {
            [] => Ok(()),
            [m] if matches!(self.obj_at(*m), Some(Obj::Dict(d)) if d.is_empty()) => Ok(()),
            _ => self.bad("tensors with conjugate or negative bits are not supported"),
        }
    }

    fn obj_at(&self, v: V) -> Option<&Obj> {
        match v {
            V::Obj(i) => self.objs.get(i),
            _ => None,
        }
    }

    fn expect_tensor(&self, t: V) -> R<V> {
        match self.obj_at(t) {
            Some(Obj::Tensor(_)) => Ok(t),
            _ => self.bad(format!("expected a tensor, found {}", self.describe(t))),
        }
    }

    /// The refusal for a global that torch admits but whose result we cannot represent; the
    /// message names it, so that a user knows what the file holds.
    fn unreadable<T>(&self, global: &str, what: &str) -> R<T> {
        self.bad(format!("`{global}` builds {what}; only tensors over plain storages can be read"))
    }

    fn dtype_of(&self, v: V) -> R<Dtype> {
        match self.global_of(v) {
            Some(Global::Dtype(d)) => Ok(d),
            Some(Global::OtherDtype(name)) => self.bad(format!("tensors of dtype `{name}` are not supported")),
            _ => self.bad(format!("tensor dtype is {}", self.describe(v))),
        }
    }

    fn latin1(&mut self, text: V, enc: V, what: &str) -> R<V> {
        let (Some(text), Some("latin1" | "latin-1")) = (self.str_of(text), self.str_of(enc)) else {
            return self.bad(format!("`{what}` is only allowed on latin-1 text"));
        };
        let bytes: Option<Vec<u8>> = text.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
        match bytes {
            Some(b) => self.alloc(Obj::Bytes(b)),
            None => self.bad(format!("`{what}` text is not latin-1")),
        }
    }

    fn tensor(&mut self, storage: V, offset: V, size: V, stride: V, dtype: Option<Dtype>) -> R<V> {
        let t = self.tensor_ref(storage, offset, size, stride, dtype)?;
        self.alloc(Obj::Tensor(t))
    }

    fn tensor_ref(&self, storage: V, offset: V, size: V, stride: V, dtype: Option<Dtype>) -> R<TensorRef> {
        if let Some(Obj::Storage(s) | Obj::StorageView { storage: s, .. }) = self.obj_at(storage) {
            self.afford(alloc_bytes(s.key.len()))?;
        }
        let (s, view) = match self.obj_at(storage) {
            Some(Obj::Storage(s)) => (s.clone(), None),
            Some(Obj::StorageView { storage, offset, len }) => (storage.clone(), Some((*offset, *len))),
            _ => return self.bad(format!("tensor storage is {}", self.describe(storage))),
        };
        let mut offset = self.int_of(offset, "storage offset")?;
        let shape = self.ints_of(size, "a size")?;
        let strides = self.ints_of(stride, "a stride")?;
        if shape.len() != strides.len() {
            return self.bad(format!("size has {} dims but stride has {}", shape.len(), strides.len()));
        }
        // A tensor on a storage view stays inside the view; from here on it is a tensor on the
        // whole storage, further in.
        if let Some((start, len)) = view {
            let fits = crate::shape::extent(offset, &shape, &strides).is_some_and(|e| e <= len);
            if !fits {
                return self.bad(format!("tensor reaches past its {len}-element storage view"));
            }
            offset += start;
        }
        let dtype = match (s.kind, dtype) {
            (StorageKind::Typed(d), None) => d,
            (StorageKind::Untyped, Some(d)) => d,
            (StorageKind::Typed(d), Some(t)) if d == t => d,
            _ => return self.bad("tensor dtype does not match its storage"),
        };
        Ok(TensorRef { storage: s, dtype, offset, shape, strides })
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
mod tests {
    use super::*;

    fn bad(data: &[u8], limits: Limits) -> String {
        match load(data, Load { limits, ..Load::default() }) {
            Err(Refusal::Bad { reason, .. }) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn one_memory_budget_scaled_to_the_pickle() {
        let tiny = Limits { budget_per_byte: 2, budget_floor: 10_000, budget_cap: 1 << 20, ..Limits::default() };
        // 64 arena slots fit in 10 000 bytes, 128 do not: the arena is charged as it grows.
        let lists = |n: usize| [&b"\x80\x02"[..], &vec![b']'; n], b"."].concat();
        assert!(load(&lists(64), Load { limits: tiny, ..Load::default() }).is_ok());
        assert_eq!(
            bad(&lists(65), tiny),
            "memory budget exceeded: the objects and values of 68 bytes of pickle need more than 10136 bytes"
        );
        // A memo fetch shares the object: a 4 KiB string fetched 3 000 times costs its index.
        let s = [&b"\x80\x02]X\x00\x10\x00\x00"[..], &[b'a'; 4096], b"q\x00a(", &b"h\x00".repeat(3000), b"e."].concat();
        let p = load(&s, Load::default()).unwrap_or_else(|e| panic!("{e:?}"));
        // Its index in the list and on the stack, and slots: not 3 000 copies (12 MB).
        assert!(p.budget.used() < 4096 + 3000 * 48 + 64 * 108, "{}", p.budget.used());
        // The cap holds whatever the length.
        let capped = Limits { budget_cap: 5_000, ..tiny };
        assert!(bad(&lists(64), capped).ends_with("need more than 5000 bytes"));
    }

    #[test]
    fn memo_is_bounded() {
        let small = Limits { max_memo: 2, ..Limits::default() };
        assert_eq!(bad(b"\x80\x02Nq\x00q\x01q\x02.", small), "memo grows past 2 entries");
        // Overwriting a slot does not grow the memo.
        assert!(load(b"\x80\x02Nq\x00q\x00q\x00.", Load { limits: small, ..Load::default() }).is_ok());
        assert_eq!(bad(b"\x80\x02h\x05.", Limits::default()), "memo slot 5 is read before it is written");
    }

    #[test]
    fn declared_lengths_are_checked_before_allocating() {
        assert_eq!(
            bad(b"\x80\x02X\xff\xff\xff\x7fabc", Limits::default()),
            "declared length 2147483647 runs past the end of the pickle"
        );
        assert_eq!(
            bad(b"\x80\x02\x8e\xff\xff\xff\xff\xff\xff\xff\x7f", Limits::default()),
            "declared length 9223372036854775807 runs past the end of the pickle"
        );
    }

    #[test]
    fn stack_and_marks_are_bounded() {
        let small = Limits { max_stack: 3, max_depth: 2, ..Limits::default() };
        assert_eq!(bad(b"\x80\x02NNNN.", small), "stack grows past 3 values");
        assert_eq!(bad(b"\x80\x02(((", small), "nesting deeper than 2 levels");
        assert_eq!(
            bad(b"\x80\x02]]]]aaa.", Limits { max_depth: 2, ..Limits::default() }),
            "nesting deeper than 2 levels"
        );
    }

    #[test]
    fn unknown_opcodes_and_calls_are_refused() {
        assert_eq!(bad(b"\x80\x02I1\n.", Limits::default()), "unsupported opcode 0x49");
        assert_eq!(bad(b"\x80\x02.", Limits::default()), "stack underflow");
        assert_eq!(bad(b"\x80\x02N)R.", Limits::default()), "REDUCE calls None, not an allowed global");
        let g = load(b"\x80\x02\x8c\x05torch\x8c\x0cFloatStorage\x93.", Load::default());
        assert!(
            matches!(g, Ok(p) if matches!(p.obj(p.root), Some(Obj::Global(Global::Storage(StorageKind::Typed(Dtype::F32))))))
        );
        assert_eq!(
            load(b"\x80\x04\x8c\x02os\x8c\x06system\x93.", Load::default()).err(),
            Some(Refusal::Global("os.system".into()))
        );
    }

    #[test]
    fn storage_views_stay_inside_their_storage() {
        let pid = |view: &[u8]| {
            [&b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x06\x00\x00\x00cuda:0K\x04"[..], view, b"tQ"].concat()
        };
        let past = [pid(b"X\x01\x00\x00\x001K\x02K\x03\x87"), b".".to_vec()].concat();
        assert_eq!(bad(&past, Limits::default()), "storage view of 3 elements at 2 runs past its 4-element storage");
        // `_rebuild_tensor(view, 1, (2,), (1,))` on a 2-element view: one element too far.
        let t = [
            &b"\x80\x02ctorch._utils\n_rebuild_tensor\n("[..],
            &pid(b"X\x01\x00\x00\x001K\x01K\x02\x87"),
            b"K\x01K\x02\x85K\x01\x85tR.",
        ]
        .concat();
        assert_eq!(bad(&t, Limits::default()), "tensor reaches past its 2-element storage view");
        let ok = [&t[..t.len() - 11], b"K\x00K\x02\x85K\x01\x85tR."].concat();
        let p = load(&ok, Load::default()).unwrap_or_else(|e| panic!("{e:?}"));
        let Some(Obj::Tensor(t)) = p.obj(p.root) else { panic!("not a tensor") };
        assert_eq!((t.offset, t.storage.numel), (1, 4), "offset into the whole storage");
    }

    #[test]
    fn format_classes_become_inert_instances_only_where_allowed() {
        // `pkg.Thing()` via NEWOBJ, then BUILD with `{"a": 5}`: how dataclasses are pickled.
        let data = b"\x80\x02cpkg\nThing\n)\x81}X\x01\x00\x00\x00aK\x05sb.";
        assert_eq!(load(data, Load::default()).err(), Some(Refusal::Global("pkg.Thing".into())));
        let p = load(data, Load::default().classes(&["pkg.Thing"])).unwrap_or_else(|e| panic!("{e:?}"));
        let Some(Obj::Instance { class, args, state: Some(state), .. }) = p.obj(p.root) else {
            panic!("not an instance")
        };
        assert_eq!((&**class, args.len()), ("pkg.Thing", 0));
        let Some(Obj::Dict(fields)) = p.obj(*state) else { panic!("state is not a dict") };
        assert_eq!(fields.len(), 1);
        assert_eq!(fields[0].1, V::Int(5));
        // A second BUILD on the same instance is refused: state is set once.
        let twice = b"\x80\x02cpkg\nThing\n)\x81}b}b.";
        assert!(load(twice, Load::default().classes(&["pkg.Thing"])).is_err());
    }
}
