//! From an unpickled object to state-dict entries.
//!
//! Nested dicts become dotted names, the way `state_dict()` keys read: `{"model": {"w": t}}`
//! gives `model.w`, an int key (optimizer state) gives `state.0.exp_avg`. A list or tuple that
//! holds tensors is numbered the same way. Everything else is a leaf value (a `step`, a config,
//! `param_groups`), kept with its dotted name. The walk is budgeted: a pickle that fetches the
//! same memoized list over and over (each level of a "billion laughs" doubling the last) is
//! refused once it has cost more nodes than a real state dict could, and every name, leaf and
//! tensor entry it builds is charged to the pickle's memory budget ([`Pickle::charge`]) as it is
//! built, so that copies of one memoized string or bytes object cannot add up to more memory
//! than the pickle is allowed. Each is charged for what it costs after the walk too: a value
//! for its JSON (the tree `inspect --json` holds, or the text the writers hold), a tensor for
//! its entry in the catalog ([`TENSOR`]).
//!
//! A record (an object of an allowed class, [`Obj::Instance`]) has up to five parts, named the
//! same way as a value (JSON) and as a prefix of the names below it: `__class__` (its class),
//! `args.N` (what `REDUCE`/`NEWOBJ` gave it), `state` (what `BUILD` gave it: a dict state
//! gives `state.KEY`), `list.N` and `items.KEY` (the items of a list or dict subclass). A
//! record that holds tensors is walked into, so a tensor in an object's attributes is named
//! `obj.state.attr`; one that holds none is one value. With numpy decoding on, a numpy array
//! is a tensor under its own name and a numpy scalar a plain value.
//!
//! Objects may refer to themselves (omegaconf's nodes keep their `_parent`): a reference back
//! to an object being walked is the value `{"__cycle__": "<its dotted name>"}`, never walked
//! again. Which objects lead to a tensor is worked out once for the whole pickle, iteratively.

use std::collections::HashSet;
use std::mem::size_of;

use super::numpy;
use super::pickle::{
    alloc_bytes, table_bytes, tensor_bytes, vec_bytes, Global, Obj, Pickle, StorageKind, StorageRef, TensorRef, V,
};

/// What a value's node costs once more as JSON: `inspect --json` holds every value's tree at
/// once, `convert` and `merge` every value's text (the longest scalar is 24 bytes, twice as a
/// text buffer grows by doubling), not both.
const JSON_NODE: usize = size_of::<serde_json::Value>();

/// What a named entry (a value or a tensor) costs besides its name and value, downstream of
/// the walk: its slot among the file's entries and in `inspect`'s or the writers' map (two
/// copies of the name are charged with it).
const ENTRY: usize = 2 * size_of::<String>() + size_of::<serde_json::Value>() + 48;

/// What a tensor costs in the catalog (its file's tensor, its catalog entry and box, with
/// their dims) besides its name: measured on a pickle of a million tensors (`fixtures/gen/
/// hostile_pickle_budget.py`, `tensor_names.pt`), with room.
const TENSOR: usize = 512;

/// The length of `s` as a JSON string: quotes, and the escapes serde_json writes.
fn json_text_len(s: &[u8]) -> usize {
    2 + s.len()
        + s.iter()
            .map(|&b| match b {
                b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 1,
                0..0x20 => 5,
                _ => 0,
            })
            .sum::<usize>()
}

/// Nodes the walk may visit in total.
pub(crate) const MAX_VISITS: u64 = 1 << 23;
/// Dict nesting the walk follows.
pub(crate) const MAX_NESTING: usize = 64;

pub(crate) use crate::read::value::Leaf;

/// A state dict: tensors and leaves by dotted name, in pickle order.
#[derive(Clone, Debug, Default)]
pub(crate) struct Flat {
    pub tensors: Vec<(String, TensorRef)>,
    pub leaves: Vec<(String, Leaf)>,
    /// The bytes of tensors decoded from the pickle (numpy arrays): the tensors over them have
    /// a storage of kind [`StorageKind::Inline`] whose key is the index here.
    pub inline: Vec<Vec<u8>>,
}

/// The pickle's root as one value (what `torch.save` of a non-tensor object holds, such as a
/// DCP bytes item), with the same budget as [`flatten`].
pub(crate) fn leaf_of(p: &Pickle) -> Result<Leaf, String> {
    let mut w = Walk::new(p, false, Vec::new());
    w.leaf(p.root, 0)
}

/// [`leaf_of`] for values that may hold tensors (Megatron's `rng_state`, a list of dicts of
/// generator states): each tensor becomes `{"__tensor__": {"dtype": …, "shape": […]}}`, a
/// description without its data, so that the rest of the value can be read.
pub(crate) fn leaf_of_describing_tensors(p: &Pickle) -> Result<Leaf, String> {
    let mut w = Walk::new(p, false, Vec::new());
    w.describe_tensors = true;
    w.leaf(p.root, 0)
}

struct Walk<'a> {
    p: &'a Pickle,
    visits: u64,
    names: HashSet<String>,
    out: Flat,
    /// Decode numpy arrays and scalars.
    numpy: bool,
    /// A tensor met inside a value is described rather than refused.
    describe_tensors: bool,
    /// Whether each arena object leads to a tensor.
    reach: Vec<bool>,
    /// The objects being walked, with the number of path segments leading to each.
    chain: Vec<(usize, usize)>,
    /// The path to the current value, one segment per level (at most [`MAX_NESTING`] or so).
    segs: Vec<Seg>,
}

/// A segment of a value's path.
enum Seg {
    Key(String),
    Index(usize),
}

impl std::fmt::Display for Seg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Seg::Key(k) => f.write_str(k),
            Seg::Index(i) => write!(f, "{i}"),
        }
    }
}

/// Flattens the pickle's root into named tensors and leaves; the error is a reason.
pub(crate) fn flatten(p: &Pickle) -> Result<Flat, String> {
    flatten_with(p, false)
}

/// [`flatten`], decoding numpy arrays into tensors and numpy scalars into values when `numpy`.
pub(crate) fn flatten_with(p: &Pickle, numpy: bool) -> Result<Flat, String> {
    let reach = reach(p, numpy)?;
    let mut w = Walk::new(p, numpy, reach);
    match p.obj(p.root) {
        Some(Obj::Instance { .. }) if numpy && numpy::is_array(p, p.root) => {
            return Err("the file holds a single numpy array, not a state dict".into())
        }
        Some(Obj::Dict(_) | Obj::List(_) | Obj::Tuple(_) | Obj::Instance { .. }) => w.node("", p.root, 0)?,
        Some(Obj::Tensor(_)) => return Err("the file holds a single tensor, not a state dict".into()),
        _ => return Err("the file holds no dict of tensors".into()),
    }
    Ok(w.out)
}

/// The values directly inside an object.
fn children(o: &Obj) -> impl Iterator<Item = V> + '_ {
    let (a, b, c): (&[V], &[(V, V)], Option<V>) = match o {
        Obj::Tuple(items) | Obj::List(items) => (items, &[], None),
        Obj::Dict(items) => (&[], items, None),
        Obj::Instance { args, state, items, .. } => {
            let (list, dict) = items.as_deref().map_or((&[][..], &[][..]), |i| (&i.list[..], &i.dict[..]));
            return Box::new(args.iter().chain(list).copied().chain(dict.iter().map(|&(_, v)| v)).chain(*state))
                as Box<dyn Iterator<Item = V>>;
        }
        _ => (&[], &[], None),
    };
    Box::new(a.iter().copied().chain(b.iter().map(|&(_, v)| v)).chain(c))
}

/// Which arena objects lead to a tensor (or, decoding numpy, to an array): a breadth-first
/// walk back from each tensor along reversed references, so shared and cyclic objects cost
/// one visit each. Its tables are charged to the pickle's budget.
fn reach(p: &Pickle, numpy: bool) -> Result<Vec<bool>, String> {
    let n = p.objs.len();
    let idx = |v: V| match v {
        V::Obj(i) if i < n => Some(i),
        _ => None,
    };
    // Reversed references as offsets into one edge array (compressed rows).
    // Two offset arrays, the flags and the queue.
    p.charge(2 * vec_bytes::<u32>(n + 1) + alloc_bytes(n) + vec_bytes::<u32>(n))?;
    let mut count = vec![0u32; n + 1];
    let mut edges = 0usize;
    for o in &p.objs {
        for c in children(o).filter_map(idx) {
            count[c + 1] += 1;
            edges += 1;
        }
    }
    p.charge(vec_bytes::<u32>(edges))?;
    for i in 0..n {
        count[i + 1] += count[i];
    }
    let mut fill = count.clone();
    let mut parents = vec![0u32; edges];
    for (i, o) in p.objs.iter().enumerate() {
        for c in children(o).filter_map(idx) {
            parents[fill[c] as usize] = i as u32;
            fill[c] += 1;
        }
    }
    drop(fill);
    let mut reach = vec![false; n];
    let mut queue: Vec<usize> = Vec::with_capacity(n);
    for (i, o) in p.objs.iter().enumerate() {
        let sink = match o {
            Obj::Tensor(_) => true,
            Obj::Instance { .. } => numpy && numpy::is_array(p, V::Obj(i)),
            _ => false,
        };
        if sink {
            reach[i] = true;
            queue.push(i);
        }
    }
    while let Some(i) = queue.pop() {
        for &parent in &parents[count[i] as usize..count[i + 1] as usize] {
            if !reach[parent as usize] {
                reach[parent as usize] = true;
                queue.push(parent as usize);
            }
        }
    }
    Ok(reach)
}

impl<'a> Walk<'a> {
    fn new(p: &'a Pickle, numpy: bool, reach: Vec<bool>) -> Walk<'a> {
        Walk {
            p,
            visits: 0,
            names: HashSet::new(),
            out: Flat::default(),
            numpy,
            describe_tensors: false,
            reach,
            chain: Vec::new(),
            segs: Vec::new(),
        }
    }

    /// `prefix.key`, charged to the budget.
    fn join(&self, prefix: &str, key: &str) -> Result<String, String> {
        let len = if prefix.is_empty() { key.len() } else { prefix.len() + 1 + key.len() };
        self.p.charge(alloc_bytes(len))?;
        let mut s = String::with_capacity(len);
        if !prefix.is_empty() {
            s.push_str(prefix);
            s.push('.');
        }
        s.push_str(key);
        Ok(s)
    }

    fn tick(&mut self) -> Result<(), String> {
        self.visits += 1;
        if self.visits > MAX_VISITS {
            return Err(format!("the object expands past {MAX_VISITS} values (memo reused to inflate it?)"));
        }
        Ok(())
    }

    /// Takes `name` for an entry: its copy in `names`, and what the entry costs downstream
    /// besides its value ([`ENTRY`], the name's copies there).
    fn claim(&mut self, name: &str) -> Result<(), String> {
        if let Some(more) = self.p.budget.grow_table::<String>(self.names.len(), self.names.capacity())? {
            self.names.reserve(more);
        }
        self.p.charge(ENTRY + 4 * alloc_bytes(name.len()))?;
        if self.names.insert(name.to_string()) {
            Ok(())
        } else {
            Err(format!("name `{name}` appears twice after flattening"))
        }
    }

    fn holds_tensor(&self, v: V) -> bool {
        matches!(v, V::Obj(i) if self.reach.get(i).copied().unwrap_or(false))
    }

    /// The value that stands for `v` when it is an object being walked: a reference back.
    fn cycle(&self, v: V) -> Result<Option<Leaf>, String> {
        let V::Obj(i) = v else { return Ok(None) };
        let Some(&(_, at)) = self.chain.iter().find(|(o, _)| *o == i) else { return Ok(None) };
        let path = self.segs.get(..at).unwrap_or_default().iter().map(Seg::to_string).collect::<Vec<_>>().join(".");
        self.p.charge(
            vec_bytes::<(String, Leaf)>(1) + 2 * alloc_bytes(path.len()) + alloc_bytes(9) + 3 * JSON_NODE + path.len(),
        )?;
        Ok(Some(Leaf::Dict(vec![("__cycle__".into(), Leaf::Str(path))])))
    }

    /// Runs `f` with `v` marked as being walked.
    fn within<T>(&mut self, v: V, f: impl FnOnce(&mut Self) -> Result<T, String>) -> Result<T, String> {
        if let V::Obj(i) = v {
            self.chain.push((i, self.segs.len()));
        }
        let r = f(self);
        if matches!(v, V::Obj(_)) {
            self.chain.pop();
        }
        r
    }

    /// Runs `f` with `seg` pushed on the path (a stack as deep as the walk: not charged).
    fn at<T>(&mut self, seg: Seg, f: impl FnOnce(&mut Self) -> Result<T, String>) -> Result<T, String> {
        self.segs.push(seg);
        let r = f(self);
        self.segs.pop();
        r
    }

    fn push_leaf(&mut self, name: &str, leaf: Leaf) -> Result<(), String> {
        self.claim(name)?;
        self.p.budget.grow(&mut self.out.leaves, 1)?;
        self.out.leaves.push((name.to_string(), leaf));
        Ok(())
    }

    fn node(&mut self, name: &str, v: V, depth: usize) -> Result<(), String> {
        self.tick()?;
        if depth > MAX_NESTING {
            return Err(format!("`{name}` is nested deeper than {MAX_NESTING} levels"));
        }
        if let Some(back) = self.cycle(v)? {
            return self.push_leaf(name, back);
        }
        let p = self.p;
        match p.obj(v) {
            Some(Obj::Tensor(t)) => {
                self.claim(name)?;
                p.charge(TENSOR + tensor_bytes(t))?;
                p.budget.grow(&mut self.out.tensors, 1)?;
                self.out.tensors.push((name.to_string(), t.clone()));
                Ok(())
            }
            Some(Obj::Instance { .. }) if self.numpy && numpy::is_array(p, v) => {
                let Some(a) = numpy::array(p, v).map_err(|r| format!("`{name}`: {r}"))? else {
                    return Err(format!("`{name}`: not a numpy array"));
                };
                self.claim(name)?;
                let key = self.out.inline.len().to_string();
                let numel = a.bytes.len() as u64;
                let storage = StorageRef { key, kind: StorageKind::Inline, numel };
                let t = TensorRef { storage, dtype: a.dtype, offset: 0, shape: a.shape, strides: a.strides };
                p.charge(TENSOR + tensor_bytes(&t) + a.bytes.len())?;
                p.budget.grow(&mut self.out.tensors, 1)?;
                p.budget.grow(&mut self.out.inline, 1)?;
                self.out.inline.push(a.bytes);
                self.out.tensors.push((name.to_string(), t));
                Ok(())
            }
            Some(Obj::Dict(items)) if !items.is_empty() => self.within(v, |w| {
                for &(k, val) in items {
                    let key = w.key(k)?;
                    let full = w.join(name, &key)?;
                    w.at(Seg::Key(key), |w| w.node(&full, val, depth + 1))?;
                }
                Ok(())
            }),
            Some(Obj::List(items) | Obj::Tuple(items)) if self.holds_tensor(v) => self.within(v, |w| {
                for (i, &val) in items.iter().enumerate() {
                    let full = w.join(name, &i.to_string())?;
                    w.at(Seg::Index(i), |w| w.node(&full, val, depth + 1))?;
                }
                Ok(())
            }),
            // A record whose parts hold tensors (accelerate's pickled `SeedableRandomSampler`
            // and its `torch.Generator`, an object of a class the user allowed): its class,
            // arguments, state and items under its name, the tensors among them as entries of
            // their own.
            Some(Obj::Instance { class, args, state, items: more }) if name.is_empty() || self.holds_tensor(v) => {
                let (list, items) = more.as_deref().map_or((&[][..], &[][..]), |i| (&i.list[..], &i.dict[..]));
                self.within(v, |w| {
                    let at = w.join(name, "__class__")?;
                    w.push_leaf(&at, Leaf::Str(class.to_string()))?;
                    let parts = [("args", args.as_slice()), ("list", list)];
                    for (part, vals) in parts {
                        let prefix = w.join(name, part)?;
                        w.at(Seg::Key(part.into()), |w| {
                            for (i, &val) in vals.iter().enumerate() {
                                let full = w.join(&prefix, &i.to_string())?;
                                w.at(Seg::Index(i), |w| w.node(&full, val, depth + 1))?;
                            }
                            Ok(())
                        })?;
                    }
                    if !items.is_empty() {
                        let prefix = w.join(name, "items")?;
                        w.at(Seg::Key("items".into()), |w| {
                            for &(k, val) in items {
                                let key = w.key(k)?;
                                let full = w.join(&prefix, &key)?;
                                w.at(Seg::Key(key), |w| w.node(&full, val, depth + 1))?;
                            }
                            Ok(())
                        })?;
                    }
                    if let Some(st) = *state {
                        let full = w.join(name, "state")?;
                        w.at(Seg::Key("state".into()), |w| w.node(&full, st, depth + 1))?;
                    }
                    Ok(())
                })
            }
            _ => {
                let leaf = self.leaf(v, depth)?;
                self.push_leaf(name, leaf)
            }
        }
    }

    fn key(&self, k: V) -> Result<String, String> {
        match k {
            V::Int(i) => Ok(i.to_string()),
            _ => match self.p.obj(k) {
                Some(Obj::Str(s)) => {
                    self.p.charge(alloc_bytes(s.len()))?;
                    Ok(s.clone())
                }
                // A tuple key (megatron's `(param_dtype, grad_dtype)`): Python's repr of it.
                Some(Obj::Tuple(items)) => {
                    let parts = items.iter().map(|&i| self.key_part(i)).collect::<Result<Vec<_>, _>>()?;
                    let text =
                        if parts.len() == 1 { format!("({},)", parts[0]) } else { format!("({})", parts.join(", ")) };
                    self.p.charge(alloc_bytes(text.len()))?;
                    Ok(text)
                }
                _ => Err("dict keys must be strings, ints or tuples of them".into()),
            },
        }
    }

    /// An element of a tuple key, as Python's repr writes it.
    fn key_part(&self, v: V) -> Result<String, String> {
        match (v, self.p.obj(v)) {
            (V::Int(i), _) => Ok(i.to_string()),
            (V::Bool(b), _) => Ok(if b { "True" } else { "False" }.to_string()),
            (V::None, _) => Ok("None".to_string()),
            (_, Some(Obj::Str(s))) => Ok(format!("'{s}'")),
            (_, Some(Obj::Global(Global::Dtype(d)))) => {
                Ok(format!("torch.{}", super::pickle::torch_dtype_name(*d).unwrap_or("unknown")))
            }
            _ => Err("dict keys must be strings, ints or tuples of them".into()),
        }
    }

    fn leaf(&mut self, v: V, depth: usize) -> Result<Leaf, String> {
        self.tick()?;
        if depth > MAX_NESTING {
            return Err(format!("a value is nested deeper than {MAX_NESTING} levels"));
        }
        let p = self.p;
        // The copy of a string or bytes, and the node as JSON: a string once more and as
        // text; bytes as base64 text (in a one-key object), held as a string and as text.
        let cost = match p.obj(v) {
            Some(Obj::Str(s)) => alloc_bytes(s.len()) + alloc_bytes(s.len()).max(2 * json_text_len(s.as_bytes())),
            Some(Obj::Bytes(b)) => {
                let b64 = b.len().div_ceil(3) * 4;
                let tree = alloc_bytes(b64)
                    + vec_bytes::<(usize, String, serde_json::Value)>(1)
                    + table_bytes::<usize>(1)
                    + JSON_NODE;
                alloc_bytes(b.len()) + tree.max(2 * (b64 + 16))
            }
            Some(Obj::Instance { .. }) => {
                // Its fields, as a dict of up to five, and their names.
                vec_bytes::<(String, Leaf)>(5) + 5 * (alloc_bytes(9) + 2 * JSON_NODE + 24) + table_bytes::<usize>(5)
            }
            Some(Obj::Global(_) | Obj::Complex(..)) => {
                vec_bytes::<(String, Leaf)>(2) + 4 * alloc_bytes(32) + 3 * JSON_NODE
            }
            _ => 0,
        };
        p.charge(JSON_NODE + cost)?;
        if let Some(back) = self.cycle(v)? {
            return Ok(back);
        }
        if let Some(s) = self.numpy.then(|| numpy::scalar(p, v)).flatten() {
            return Ok(s);
        }
        Ok(match v {
            V::None => Leaf::None,
            V::Bool(b) => Leaf::Bool(b),
            V::Int(i) => Leaf::Int(i),
            V::Float(f) => Leaf::Float(f),
            V::Obj(_) => match p.obj(v) {
                Some(Obj::Str(s)) => Leaf::Str(s.clone()),
                Some(Obj::Bytes(b)) => Leaf::Bytes(b.clone()),
                Some(Obj::List(items) | Obj::Tuple(items)) => self.within(v, |w| w.list(items, depth))?,
                Some(Obj::Dict(items)) => self.within(v, |w| w.dict(items, depth))?,
                Some(Obj::BigInt(_)) => return Err("integers wider than 64 bits are not supported".into()),
                // A dtype stored as a value (a config's `torch_dtype`): kept as its name.
                Some(Obj::Global(Global::Dtype(d))) => {
                    Leaf::Str(format!("torch.{}", super::pickle::torch_dtype_name(*d).unwrap_or("unknown")))
                }
                Some(Obj::Global(Global::OtherDtype(name) | Global::QScheme(name))) => Leaf::Str((*name).to_string()),
                // An allowed class passed as a value (numpy's `ndarray` to its `_reconstruct`,
                // Lightning's `hparams_type`): kept as its name, never imported.
                Some(Obj::Global(Global::Class(c))) => {
                    Leaf::Dict(vec![("__class__".to_string(), Leaf::Str(p.class_name(*c).to_string()))])
                }
                Some(Obj::Global(g)) => return Err(format!("a bare `{g:?}` is not a value")),
                // JSON has no complex numbers; the two parts keep the value exact.
                Some(Obj::Complex(re, im)) => {
                    Leaf::Dict(vec![("real".into(), Leaf::Float(*re)), ("imag".into(), Leaf::Float(*im))])
                }
                Some(Obj::EmptyTensor(_)) => return Err("a legacy tensor was never given its storage".into()),
                Some(Obj::Script { .. }) => return Err("a TorchScript object outside a TorchScript archive".into()),
                Some(Obj::Storage(_) | Obj::StorageView { .. }) => return Err("a bare storage is not supported".into()),
                // A record (a DeepSpeed enum, a DCP dataclass, an object of a class the user
                // allowed) is kept as data: its class, constructor arguments, state and items.
                Some(Obj::Instance { class, args, state, items: more }) => self.within(v, |w| {
                    let (list, items) = more.as_deref().map_or((&[][..], &[][..]), |i| (&i.list[..], &i.dict[..]));
                    let mut fields = vec![("__class__".to_string(), Leaf::Str(class.to_string()))];
                    fields.push(("args".to_string(), w.at(Seg::Key("args".into()), |w| w.list(args, depth))?));
                    if !list.is_empty() {
                        fields.push(("list".to_string(), w.at(Seg::Key("list".into()), |w| w.list(list, depth))?));
                    }
                    if !items.is_empty() {
                        fields.push(("items".to_string(), w.at(Seg::Key("items".into()), |w| w.dict(items, depth))?));
                    }
                    if let Some(st) = *state {
                        fields.push(("state".to_string(), w.at(Seg::Key("state".into()), |w| w.leaf(st, depth + 1))?));
                    }
                    Ok(Leaf::Dict(fields))
                })?,
                Some(Obj::Tensor(t)) if self.describe_tensors => {
                    p.charge(vec_bytes::<(String, Leaf)>(3) + vec_bytes::<Leaf>(t.shape.len()) + 3 * JSON_NODE)?;
                    let dtype = super::pickle::torch_dtype_name(t.dtype).unwrap_or("unknown");
                    let shape = t.shape.iter().map(|&d| Leaf::Int(i64::try_from(d).unwrap_or(i64::MAX))).collect();
                    let about =
                        vec![("dtype".to_string(), Leaf::Str(dtype.to_string())), ("shape".into(), Leaf::List(shape))];
                    Leaf::Dict(vec![("__tensor__".to_string(), Leaf::Dict(about))])
                }
                Some(Obj::Tensor(_)) | None => return Err("unexpected tensor".into()),
            },
        })
    }

    fn list(&mut self, items: &[V], depth: usize) -> Result<Leaf, String> {
        // The list, and its array as JSON.
        self.p.charge(vec_bytes::<Leaf>(items.len()) + vec_bytes::<serde_json::Value>(items.len()))?;
        let mut out = Vec::with_capacity(items.len());
        for (i, &item) in items.iter().enumerate() {
            out.push(self.at(Seg::Index(i), |w| w.leaf(item, depth + 1))?);
        }
        Ok(Leaf::List(out))
    }

    fn dict(&mut self, items: &[(V, V)], depth: usize) -> Result<Leaf, String> {
        // The dict, and its object as JSON (entries and their index).
        let n = items.len();
        self.p.charge(
            vec_bytes::<(String, Leaf)>(n)
                + vec_bytes::<(usize, String, serde_json::Value)>(n)
                + table_bytes::<usize>(n),
        )?;
        let mut out = Vec::with_capacity(items.len());
        for &(k, item) in items {
            let key = self.key(k)?;
            // Its copy as a JSON key, or as text.
            self.p.charge(alloc_bytes(key.len()).max(2 * json_text_len(key.as_bytes())))?;
            let val = self.at(Seg::Key(key.clone()), |w| w.leaf(item, depth + 1))?;
            out.push((key, val));
        }
        Ok(Leaf::Dict(out))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::formats::torch::pickle::{load, AllowGlobals, Budget, Limits, Load};

    fn read(data: &[u8]) -> Flat {
        let (any, budget) = (AllowGlobals::any(), Budget::shared(Limits::default()));
        let p = load(data, Load::default().allowing(&any).charging(&budget)).unwrap_or_else(|e| panic!("{e:?}"));
        flatten_with(&p, true).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_reference_back_is_a_cycle_value() {
        // `d = {}; d["me"] = d`, and a record whose state points at it: `{"me": d, "r": R(state={"up": d})}`.
        let data =
            b"\x80\x02}q\x00X\x02\x00\x00\x00meh\x00sX\x01\x00\x00\x00rcpkg\nR\n)\x81}X\x02\x00\x00\x00uph\x00sbs.";
        let flat = read(data);
        assert_eq!(flat.leaves[0], ("me".into(), Leaf::Dict(vec![("__cycle__".into(), Leaf::Str(String::new()))])));
        let Leaf::Dict(r) = &flat.leaves[1].1 else { panic!("{:?}", flat.leaves) };
        assert_eq!(flat.leaves[1].0, "r");
        assert_eq!(r[0], ("__class__".into(), Leaf::Str("pkg.R".into())));
        let state = Leaf::Dict(vec![("up".into(), Leaf::Dict(vec![("__cycle__".into(), Leaf::Str(String::new()))]))]);
        assert_eq!(r.last(), Some(&("state".into(), state)));
    }

    #[test]
    fn records_of_dict_and_list_subclasses_keep_their_items() {
        // `defaultdict(dict, {"a": 1})` and a list subclass `pkg.L([2])`, as protocol 2 pickles them.
        let data = b"\x80\x02}(X\x01\x00\x00\x00dccollections\ndefaultdict\nc__builtin__\ndict\n\x85R(X\x01\x00\x00\x00aK\x01uX\x01\x00\x00\x00lcpkg\nL\n)\x81(K\x02eu.";
        let flat = read(data);
        let json: Vec<(String, serde_json::Value)> =
            flat.leaves.iter().map(|(k, v)| (k.clone(), v.to_json())).collect();
        assert_eq!(
            json,
            [
                (
                    "d".to_string(),
                    serde_json::json!({ "__class__": "collections.defaultdict", "args": [{ "__class__": "builtins.dict" }], "items": { "a": 1 } })
                ),
                ("l".to_string(), serde_json::json!({ "__class__": "pkg.L", "args": [], "list": [2] })),
            ]
        );
    }
}
