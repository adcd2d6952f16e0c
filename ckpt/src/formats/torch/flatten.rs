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
//! than the pickle is allowed.

use std::collections::HashSet;
use std::mem::size_of;

use super::pickle::{tensor_bytes, Obj, Pickle, TensorRef, V};

/// Nodes the walk may visit in total.
pub(crate) const MAX_VISITS: u64 = 1 << 23;
/// Dict nesting the walk follows.
pub(crate) const MAX_NESTING: usize = 64;

pub(crate) use crate::value::Leaf;

/// A state dict: tensors and leaves by dotted name, in pickle order.
#[derive(Clone, Debug, Default)]
pub(crate) struct Flat {
    pub tensors: Vec<(String, TensorRef)>,
    pub leaves: Vec<(String, Leaf)>,
}

/// The pickle's root as one value (what `torch.save` of a non-tensor object holds, such as a
/// DCP bytes item), with the same budget as [`flatten`].
pub(crate) fn leaf_of(p: &Pickle) -> Result<Leaf, String> {
    let mut w = Walk { p, visits: 0, names: HashSet::new(), out: Flat::default() };
    w.leaf(p.root, 0)
}

struct Walk<'a> {
    p: &'a Pickle,
    visits: u64,
    names: HashSet<String>,
    out: Flat,
}

/// Flattens the pickle's root into named tensors and leaves; the error is a reason.
pub(crate) fn flatten(p: &Pickle) -> Result<Flat, String> {
    let mut w = Walk { p, visits: 0, names: HashSet::new(), out: Flat::default() };
    match p.obj(p.root) {
        Some(Obj::Dict(_) | Obj::List(_) | Obj::Tuple(_) | Obj::Instance { .. }) => w.node("", p.root, 0)?,
        Some(Obj::Tensor(_)) => return Err("the file holds a single tensor, not a state dict".into()),
        _ => return Err("the file holds no dict of tensors".into()),
    }
    Ok(w.out)
}

impl Walk<'_> {
    /// `prefix.key`, charged to the budget.
    fn join(&self, prefix: &str, key: &str) -> Result<String, String> {
        self.p.charge(size_of::<String>() + prefix.len() + 1 + key.len())?;
        Ok(if prefix.is_empty() { key.to_string() } else { format!("{prefix}.{key}") })
    }

    fn tick(&mut self) -> Result<(), String> {
        self.visits += 1;
        if self.visits > MAX_VISITS {
            return Err(format!("the object expands past {MAX_VISITS} values (memo reused to inflate it?)"));
        }
        Ok(())
    }

    fn claim(&mut self, name: &str) -> Result<(), String> {
        // The copy in `names` (a set entry) and the one kept with the value.
        self.p.charge(3 * size_of::<String>() + 2 * name.len())?;
        if self.names.insert(name.to_string()) {
            Ok(())
        } else {
            Err(format!("name `{name}` appears twice after flattening"))
        }
    }

    fn node(&mut self, name: &str, v: V, depth: usize) -> Result<(), String> {
        self.tick()?;
        if depth > MAX_NESTING {
            return Err(format!("`{name}` is nested deeper than {MAX_NESTING} levels"));
        }
        match self.p.obj(v) {
            Some(Obj::Tensor(t)) => {
                self.claim(name)?;
                self.p.charge(size_of::<TensorRef>() + tensor_bytes(t))?;
                self.out.tensors.push((name.to_string(), t.clone()));
                Ok(())
            }
            Some(Obj::Dict(items)) if !items.is_empty() => {
                for &(k, val) in items {
                    let key = self.key(k)?;
                    self.node(&self.join(name, &key)?, val, depth + 1)?;
                }
                Ok(())
            }
            Some(Obj::List(items) | Obj::Tuple(items)) if self.holds_tensor(v, 0)? => {
                for (i, &val) in items.iter().enumerate() {
                    self.node(&self.join(name, &i.to_string())?, val, depth + 1)?;
                }
                Ok(())
            }
            // An allow-listed object whose state holds tensors (accelerate's pickled
            // `SeedableRandomSampler` and its `torch.Generator`): its class, arguments and state
            // under its name, the tensors among them as entries of their own.
            Some(Obj::Instance { class, args, state }) if name.is_empty() || self.holds_tensor(v, 0)? => {
                let (class, args, state) = (*class, args.clone(), *state);
                let at = self.join(name, "__class__")?;
                self.claim(&at)?;
                self.out.leaves.push((at, Leaf::Str(class.to_string())));
                for (i, &val) in args.iter().enumerate() {
                    self.node(&self.join(&self.join(name, "args")?, &i.to_string())?, val, depth + 1)?;
                }
                if let Some(st) = state {
                    self.node(&self.join(name, "state")?, st, depth + 1)?;
                }
                Ok(())
            }
            _ => {
                let leaf = self.leaf(v, depth)?;
                self.claim(name)?;
                self.out.leaves.push((name.to_string(), leaf));
                Ok(())
            }
        }
    }

    fn key(&self, k: V) -> Result<String, String> {
        match k {
            V::Int(i) => Ok(i.to_string()),
            _ => match self.p.obj(k) {
                Some(Obj::Str(s)) => {
                    self.p.charge(size_of::<String>() + s.len())?;
                    Ok(s.clone())
                }
                _ => Err("dict keys must be strings or ints".into()),
            },
        }
    }

    fn holds_tensor(&mut self, v: V, depth: usize) -> Result<bool, String> {
        self.tick()?;
        if depth > MAX_NESTING {
            return Err(format!("a value is nested deeper than {MAX_NESTING} levels"));
        }
        Ok(match self.p.obj(v) {
            Some(Obj::Tensor(_)) => true,
            Some(Obj::List(items) | Obj::Tuple(items)) => {
                for &i in items {
                    if self.holds_tensor(i, depth + 1)? {
                        return Ok(true);
                    }
                }
                false
            }
            Some(Obj::Dict(items)) => {
                for &(_, i) in items {
                    if self.holds_tensor(i, depth + 1)? {
                        return Ok(true);
                    }
                }
                false
            }
            Some(Obj::Instance { args, state, .. }) => {
                for &i in args.iter().chain(state.iter()) {
                    if self.holds_tensor(i, depth + 1)? {
                        return Ok(true);
                    }
                }
                false
            }
            _ => false,
        })
    }

    fn leaf(&mut self, v: V, depth: usize) -> Result<Leaf, String> {
        self.tick()?;
        if depth > MAX_NESTING {
            return Err(format!("a value is nested deeper than {MAX_NESTING} levels"));
        }
        let payload = match self.p.obj(v) {
            Some(Obj::Str(s)) => s.len(),
            Some(Obj::Bytes(b)) => b.len(),
            _ => 0,
        };
        self.p.charge(size_of::<Leaf>() + payload)?;
        Ok(match v {
            V::None => Leaf::None,
            V::Bool(b) => Leaf::Bool(b),
            V::Int(i) => Leaf::Int(i),
            V::Float(f) => Leaf::Float(f),
            V::Obj(_) => match self.p.obj(v) {
                Some(Obj::Str(s)) => Leaf::Str(s.clone()),
                Some(Obj::Bytes(b)) => Leaf::Bytes(b.clone()),
                Some(Obj::List(items) | Obj::Tuple(items)) => {
                    let mut out = Vec::with_capacity(items.len());
                    for &i in items {
                        out.push(self.leaf(i, depth + 1)?);
                    }
                    Leaf::List(out)
                }
                Some(Obj::Dict(items)) => {
                    let mut out = Vec::with_capacity(items.len());
                    for &(k, i) in items {
                        out.push((self.key(k)?, self.leaf(i, depth + 1)?));
                    }
                    Leaf::Dict(out)
                }
                Some(Obj::BigInt(_)) => return Err("integers wider than 64 bits are not supported".into()),
                // A dtype stored as a value (a config's `torch_dtype`): kept as its name.
                Some(Obj::Global(super::pickle::Global::Dtype(d))) => {
                    Leaf::Str(format!("torch.{}", super::pickle::torch_dtype_name(*d).unwrap_or("unknown")))
                }
                Some(Obj::Global(super::pickle::Global::OtherDtype(name) | super::pickle::Global::QScheme(name))) => {
                    Leaf::Str((*name).to_string())
                }
                // A format's own class passed as an argument (numpy's `ndarray` to its
                // `_reconstruct`): kept as its name, never imported.
                Some(Obj::Global(super::pickle::Global::Class(name))) => {
                    Leaf::Dict(vec![("__class__".to_string(), Leaf::Str((*name).to_string()))])
                }
                Some(Obj::Global(g)) => return Err(format!("a bare `{g:?}` is not a value")),
                // JSON has no complex numbers; the two parts keep the value exact.
                Some(Obj::Complex(re, im)) => {
                    Leaf::Dict(vec![("real".into(), Leaf::Float(*re)), ("imag".into(), Leaf::Float(*im))])
                }
                Some(Obj::EmptyTensor(_)) => return Err("a legacy tensor was never given its storage".into()),
                Some(Obj::Script { .. }) => return Err("a TorchScript object outside a TorchScript archive".into()),
                Some(Obj::Storage(_) | Obj::StorageView { .. }) => return Err("a bare storage is not supported".into()),
                // An allow-listed object of a format's own class (a DeepSpeed enum, a DCP
                // dataclass) is kept as data: its class, constructor arguments and state.
                Some(Obj::Instance { class, args, state }) => {
                    let mut fields = vec![("__class__".to_string(), Leaf::Str((*class).to_string()))];
                    let mut list = Vec::with_capacity(args.len());
                    for &a in args {
                        list.push(self.leaf(a, depth + 1)?);
                    }
                    fields.push(("args".to_string(), Leaf::List(list)));
                    if let Some(st) = state {
                        fields.push(("state".to_string(), self.leaf(*st, depth + 1)?));
                    }
                    Leaf::Dict(fields)
                }
                Some(Obj::Tensor(_)) | None => return Err("unexpected tensor".into()),
            },
        })
    }
}
