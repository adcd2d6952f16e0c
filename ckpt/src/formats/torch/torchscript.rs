//! TorchScript archives (`torch.jit.save`, `torch.jit.script` or `torch.jit.trace` output): the
//! tensors of the module, named as its `state_dict()` names them, without running any of it.
//!
//! The archive is the same zip container as a `torch.save` file (see [`super::zip`]), all records
//! in one folder named after the file, but it holds a program rather than a state dict:
//!
//! - `data.pkl`: a pickle of the module tree. Each module is an object of a class under
//!   `__torch__.` (`__torch__.Model`, `__torch__.torch.nn.modules.linear.Linear`, with a
//!   `___torch_mangle_N` segment in the module path when two classes would share a name), made
//!   with an empty `NEWOBJ` and given its attributes by `BUILD` as one dict, in the class's
//!   attribute order: tensors (written exactly as in `torch.save`: persistent storage ids and
//!   `_rebuild_tensor_v2`), submodules, `training`, plain values. Typed lists and dicts pass
//!   through `torch.jit._pickle` helpers (`build_intlist`, `restore_type_tag`) that return their
//!   first argument;
//! - `data/<key>`: the storages, stored uncompressed, as in `torch.save`;
//! - `code/<module path>.py` (deflated): the compiled classes printed as Python source. A module
//!   class reads `class Linear(Module):` and its body starts with two declarations,
//!   `__parameters__ = ["weight", "bias", ]` and `__buffers__ = [...]`, naming which attributes
//!   are parameters and buffers; `.debug_pkl` files beside them map code to source lines;
//! - `constants.pkl` and `constants/<key>`: tensors baked into the code (not part of the state
//!   dict), `version`, `byteorder`, and for a traced module `traced_inputs.pkl`.
//!
//! We run the object pickle with `__torch__` classes admitted as inert objects (only here: a
//! `torch.save` file naming one is refused), read the two declarations of each class from the
//! code text (parsed as text, never evaluated), and walk the tree the way `state_dict()` does:
//! each module gives its parameters, then its buffers, in attribute order, skipping `None`, then
//! each submodule under its attribute name. Two facts differ from `nn.Module.state_dict()`:
//! TorchScript has no notion of a non-persistent buffer, so such buffers are listed too, and a
//! tied parameter appears under every name that holds it (both as `torch.jit.load(f)
//! .state_dict()` gives them). Custom C++ classes (`__torch__.torch.classes.…`) restore their
//! state with their own code and are refused, as is the pre-1.4 layout with `model.json`.

use std::collections::{HashMap, HashSet};

use super::pickle::{self, Obj, Pickle, TensorRef, V};
use super::zip::{Archive, ReadAt};
use crate::error::{Error, Result};

/// The largest code file we read, and the total over all of them.
const MAX_CODE_FILE: u64 = 16 << 20;
const MAX_CODE_TOTAL: u64 = 256 << 20;
/// Submodule nesting the walk follows.
const MAX_DEPTH: usize = 64;

/// True when the records of `archive` under `prefix` are a TorchScript archive.
pub(crate) fn is_torchscript(archive: &Archive, prefix: &str) -> bool {
    let code = format!("{prefix}code/");
    archive.find(&format!("{prefix}constants.pkl")).is_some()
        || archive.entries.iter().any(|e| e.name.starts_with(&code))
        || archive.find(&format!("{prefix}model.json")).is_some()
}

/// What the code declares about one class.
#[derive(Debug, Default)]
pub(crate) struct Class {
    is_module: bool,
    parameters: Vec<String>,
    buffers: Vec<String>,
}

/// The state-dict tensors of a TorchScript archive, by name in `state_dict()` order.
pub(crate) fn tensors(
    file: &(impl ReadAt + ?Sized),
    archive: &Archive,
    prefix: &str,
    path: &std::path::Path,
    budget: &std::rc::Rc<pickle::Budget>,
) -> Result<Vec<(String, TensorRef)>> {
    let bad =
        |reason: String| Error::BadTorchFile { path: path.to_path_buf(), reason: format!("TorchScript: {reason}") };
    if archive.find(&format!("{prefix}model.json")).is_some() {
        return Err(bad(
            "the pre-1.4 layout (`model.json`) is not supported; hint: load and re-save it with a recent torch".into(),
        ));
    }
    let classes = declarations(file, archive, prefix).map_err(|e| match e {
        Decl::Io(e) => e,
        Decl::Bad(reason) => bad(reason),
    })?;
    let pkl_name = format!("{prefix}data.pkl");
    let Some(pkl) = archive.find(&pkl_name) else {
        return Err(bad(format!("no `{pkl_name}` record")));
    };
    let data = archive.read_entry(file, pkl, super::MAX_PICKLE_LEN)?;
    let p = pickle::load(&data, pickle::Load::default().script().charging(budget))
        .map_err(|r| super::refusal(path, &pkl_name, r))?;
    let mut walk = Walk { p: &p, classes: &classes, names: HashSet::new(), out: Vec::new(), visits: 0 };
    walk.module("", p.root, 0).map_err(bad)?;
    Ok(walk.out)
}

enum Decl {
    Io(Error),
    Bad(String),
}

/// Reads every `code/**.py` record and the classes it declares, keyed by full name.
fn declarations(
    file: &(impl ReadAt + ?Sized),
    archive: &Archive,
    prefix: &str,
) -> std::result::Result<HashMap<String, Class>, Decl> {
    let code = format!("{prefix}code/");
    let mut classes = HashMap::new();
    let mut total = 0u64;
    for e in &archive.entries {
        let Some(rel) = e.name.strip_prefix(&code).and_then(|r| r.strip_suffix(".py")) else { continue };
        total = total.saturating_add(e.size);
        if total > MAX_CODE_TOTAL {
            return Err(Decl::Bad(format!("code records exceed {MAX_CODE_TOTAL} bytes")));
        }
        let bytes = archive.read_entry(file, e, MAX_CODE_FILE).map_err(Decl::Io)?;
        let text = std::str::from_utf8(&bytes).map_err(|_| Decl::Bad(format!("`{}` is not UTF-8", e.name)))?;
        let module = rel.replace('/', ".");
        parse_code(text, &module, &mut classes).map_err(|r| Decl::Bad(format!("`{}`: {r}", e.name)))?;
    }
    Ok(classes)
}

/// Collects the class declarations of one code file into `out`, as `module.Class`.
pub(crate) fn parse_code(
    text: &str,
    module: &str,
    out: &mut HashMap<String, Class>,
) -> std::result::Result<(), String> {
    let mut current: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        if let Some(rest) = line.strip_prefix("class ") {
            let end = rest.find(['(', ':']).ok_or_else(|| format!("line {}: unreadable class header", n + 1))?;
            let name = rest.get(..end).unwrap_or_default().trim();
            let bases = rest.get(end..).unwrap_or_default();
            let full = format!("{module}.{name}");
            let class = Class { is_module: bases.starts_with("(Module)"), ..Class::default() };
            if out.insert(full.clone(), class).is_some() {
                return Err(format!("class `{full}` is declared twice"));
            }
            current = Some(full);
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(' ') {
            current = None;
            continue;
        }
        // The declarations sit in the class body (two spaces in); deeper lines are method code.
        let Some(decl) = line.strip_prefix("  ").filter(|d| !d.starts_with(' ')) else { continue };
        let Some(class) = current.as_ref().and_then(|c| out.get_mut(c)) else { continue };
        let (slot, list) = if let Some(l) = decl.strip_prefix("__parameters__ = ") {
            (&mut class.parameters, l)
        } else if let Some(l) = decl.strip_prefix("__buffers__ = ") {
            (&mut class.buffers, l)
        } else {
            continue;
        };
        *slot = parse_names(list).ok_or_else(|| format!("line {}: unreadable declaration `{}`", n + 1, decl))?;
    }
    Ok(())
}

/// Parses `["a", "b", ]` (the printer's form: double quotes, a trailing comma, no escapes).
fn parse_names(list: &str) -> Option<Vec<String>> {
    let inner = list.trim_end().strip_prefix('[')?.strip_suffix(']')?;
    let mut names = Vec::new();
    let mut rest = inner.trim_start();
    while !rest.is_empty() {
        let body = rest.strip_prefix('"')?;
        let end = body.find('"')?;
        let name = body.get(..end)?;
        if name.contains('\\') {
            return None;
        }
        names.push(name.to_string());
        rest = body.get(end + 1..)?.trim_start();
        if !rest.is_empty() {
            rest = rest.strip_prefix(',')?.trim_start();
        }
    }
    Some(names)
}

struct Walk<'a> {
    p: &'a Pickle,
    classes: &'a HashMap<String, Class>,
    names: HashSet<String>,
    out: Vec<(String, TensorRef)>,
    visits: u64,
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// The class and attributes of a TorchScript object.
fn object(p: &Pickle, v: V) -> Option<(&str, &[(V, V)])> {
    let Some(Obj::Script { class, state }) = p.obj(v) else { return None };
    let name = p.script_classes.get(*class)?;
    let attrs = match state.and_then(|s| p.obj(s)) {
        Some(Obj::Dict(items)) => items.as_slice(),
        _ => &[],
    };
    Some((name.as_str(), attrs))
}

impl<'a> Walk<'a> {
    fn module(&mut self, prefix: &str, v: V, depth: usize) -> std::result::Result<(), String> {
        self.visits += 1;
        if depth > MAX_DEPTH || self.visits > super::flatten::MAX_VISITS {
            return Err(format!("modules nest deeper than {MAX_DEPTH} levels (or loop)"));
        }
        let what = if prefix.is_empty() { "the root".to_string() } else { format!("`{prefix}`") };
        let (p, classes) = (self.p, self.classes);
        let Some((class_name, attrs)) = object(p, v) else {
            return Err(format!("{what} is not a TorchScript module object"));
        };
        let Some(class) = classes.get(class_name) else {
            return Err(format!("class `{class_name}` of {what} has no declaration under `code/`"));
        };
        if !class.is_module {
            return Err(format!("{what} is a `{class_name}`, not a module"));
        }
        if let Some(Obj::Script { state: None, .. }) = p.obj(v) {
            return Err(format!("{what} has no attributes"));
        }
        p.charge(attrs.len() * std::mem::size_of::<(&str, V)>())?;
        let mut named: Vec<(&str, V)> = Vec::with_capacity(attrs.len());
        for &(k, val) in attrs {
            let Some(Obj::Str(key)) = p.obj(k) else {
                return Err(format!("an attribute name of {what} is not a string"));
            };
            named.push((key.as_str(), val));
        }
        for (kind, declared) in [("parameter", &class.parameters), ("buffer", &class.buffers)] {
            for d in declared {
                if !named.iter().any(|(k, _)| k == d) {
                    return Err(format!("`{class_name}` declares {kind} `{d}` but {what} has no such attribute"));
                }
            }
            for &(key, val) in &named {
                if !declared.iter().any(|d| d == key) {
                    continue;
                }
                let name = join(prefix, key);
                match (val, p.obj(val)) {
                    (V::None, _) => {}
                    (_, Some(Obj::Tensor(t))) => {
                        // The name twice (the set and the entry) and the tensor description.
                        let size = 2 * name.len() + std::mem::size_of::<(String, TensorRef)>();
                        p.charge(size + pickle::tensor_bytes(t))?;
                        // Each name costs a visit: a module fetched from the memo under many
                        // names must not multiply its tensors without bound.
                        self.visits += 1;
                        if self.visits > super::flatten::MAX_VISITS {
                            return Err(format!("the module tree expands past {} values", super::flatten::MAX_VISITS));
                        }
                        if !self.names.insert(name.clone()) {
                            return Err(format!("name `{name}` appears twice"));
                        }
                        self.out.push((name, t.clone()));
                    }
                    _ => return Err(format!("{kind} `{name}` is not a tensor")),
                }
            }
        }
        for &(key, val) in &named {
            let child = object(p, val).and_then(|(c, _)| classes.get(c));
            if child.is_some_and(|c| c.is_module) {
                let name = join(prefix, key);
                p.charge(name.len())?;
                self.module(&name, val, depth + 1)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn declarations_are_read_as_text() {
        let code = "class Linear(Module):\n  __parameters__ = [\"weight\", \"bias\", ]\n  __buffers__ = []\n  \
                    weight : Tensor\n  def forward(self: __torch__.Linear) -> Tensor:\n    \
                    __parameters__ = [\"not\", ]\n    return self.weight\nclass Point:\n  x : int\n";
        let mut out = HashMap::new();
        parse_code(code, "__torch__.m", &mut out).unwrap();
        let lin = &out["__torch__.m.Linear"];
        assert!(lin.is_module);
        assert_eq!(lin.parameters, ["weight", "bias"]);
        assert!(lin.buffers.is_empty());
        assert!(!out["__torch__.m.Point"].is_module);
        assert_eq!(parse_names("[\"a\", \"b\"]"), Some(vec!["a".into(), "b".into()]));
        assert_eq!(parse_names("[\"a\\\"\", ]"), None);
        assert_eq!(parse_names("[x]"), None);
    }
}
