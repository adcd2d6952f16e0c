//! What applying an allowed global builds (`REDUCE` and `BUILD` of a global, persistent storage
//! ids): typed values (tensor descriptions, ordered dicts, dtypes), never a call into Python.

use super::*;

impl Machine<'_> {
    pub(super) fn global(&mut self, module: &str, name: &str) -> R<()> {
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
    pub(super) fn script_global(&mut self, module: &str, name: &str) -> R<Option<Global>> {
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

    pub(super) fn global_of(&self, v: V) -> Option<Global> {
        match v {
            V::Obj(i) => match self.objs.get(i) {
                Some(Obj::Global(g)) => Some(*g),
                _ => None,
            },
            _ => None,
        }
    }

    pub(super) fn int_of(&self, v: V, what: &str) -> R<u64> {
        match v {
            V::Int(i) if i >= 0 => Ok(i as u64),
            _ => self.bad(format!("{what} must be a non-negative int, found {}", self.describe(v))),
        }
    }

    pub(super) fn ints_of(&self, v: V, what: &str) -> R<Vec<u64>> {
        let Some(items) = self.items_of(v) else {
            return self.bad(format!("{what} must be a tuple, found {}", self.describe(v)));
        };
        self.afford(vec_bytes::<u64>(items.len()))?;
        items.iter().map(|&i| self.int_of(i, what)).collect()
    }

    pub(super) fn persistent(&mut self, pid: V) -> R<V> {
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

    pub(super) fn call(&mut self, func: V, args: V) -> R<V> {
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
            (
                Global::OrderedDict
                | Global::Counter
                | Global::Set
                | Global::ByteArray
                | Global::Complex
                | Global::CodecsEncode,
                _,
            ) => self.call_builtin(g, &a),
            _ => self.call_torch(g, &a),
        }
    }

    /// Calls one of Python's own globals (a collection, `complex`, `_codecs.encode`) with `a`.
    fn call_builtin(&mut self, g: Global, a: &[V]) -> R<V> {
        match (g, a) {
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
            (Global::CodecsEncode, [text, enc]) => self.latin1(*text, *enc, "_codecs.encode"),
            (g, _) => self.bad(format!("cannot call `{g:?}` with {} arguments", a.len())),
        }
    }

    /// Calls one of torch's globals (a tensor or parameter rebuild, a size, a device, a layout)
    /// with `a`.
    fn call_torch(&mut self, g: Global, a: &[V]) -> R<V> {
        match (g, a) {
            (Global::GetLayout, [name]) => match self.str_of(*name) {
                Some(s) => {
                    let s = s.to_string();
                    self.alloc(Obj::Str(s))
                }
                None => self.bad("layout name must be a string"),
            },
            (Global::LegacyTensor(d), []) => self.alloc(Obj::EmptyTensor(d)),
            (Global::ScriptIdentity, [v, ..]) => Ok(*v),
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

    pub(super) fn no_metadata(&self, rest: &[V]) -> R<()> {
        match rest {
            [] => Ok(()),
            [m] if matches!(self.obj_at(*m), Some(Obj::Dict(d)) if d.is_empty()) => Ok(()),
            _ => self.bad("tensors with conjugate or negative bits are not supported"),
        }
    }

    pub(super) fn obj_at(&self, v: V) -> Option<&Obj> {
        match v {
            V::Obj(i) => self.objs.get(i),
            _ => None,
        }
    }

    pub(super) fn expect_tensor(&self, t: V) -> R<V> {
        match self.obj_at(t) {
            Some(Obj::Tensor(_)) => Ok(t),
            _ => self.bad(format!("expected a tensor, found {}", self.describe(t))),
        }
    }

    /// The refusal for a global that torch admits but whose result we cannot represent; the
    /// message names it, so that a user knows what the file holds.
    pub(super) fn unreadable<T>(&self, global: &str, what: &str) -> R<T> {
        self.bad(format!("`{global}` builds {what}; only tensors over plain storages can be read"))
    }

    pub(super) fn dtype_of(&self, v: V) -> R<Dtype> {
        match self.global_of(v) {
            Some(Global::Dtype(d)) => Ok(d),
            Some(Global::OtherDtype(name)) => self.bad(format!("tensors of dtype `{name}` are not supported")),
            _ => self.bad(format!("tensor dtype is {}", self.describe(v))),
        }
    }

    pub(super) fn latin1(&mut self, text: V, enc: V, what: &str) -> R<V> {
        let (Some(text), Some("latin1" | "latin-1")) = (self.str_of(text), self.str_of(enc)) else {
            return self.bad(format!("`{what}` is only allowed on latin-1 text"));
        };
        let bytes: Option<Vec<u8>> = text.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
        match bytes {
            Some(b) => self.alloc(Obj::Bytes(b)),
            None => self.bad(format!("`{what}` text is not latin-1")),
        }
    }

    pub(super) fn tensor(&mut self, storage: V, offset: V, size: V, stride: V, dtype: Option<Dtype>) -> R<V> {
        let t = self.tensor_ref(storage, offset, size, stride, dtype)?;
        self.alloc(Obj::Tensor(t))
    }

    pub(super) fn tensor_ref(&self, storage: V, offset: V, size: V, stride: V, dtype: Option<Dtype>) -> R<TensorRef> {
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
            let fits = crate::read::shape::extent(offset, &shape, &strides).is_some_and(|e| e <= len);
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
