//! The shape of the crate, checked: no two modules of `ckpt/src` import each other, directly or
//! through others (the catalog is a leaf, formats never import the operations), and no module
//! but `write/sys.rs` uses `unsafe`.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module a file belongs to, at the granularity the rule is about: a file at the top of
/// `src`, or a module inside one of its folders (`read::catalog`, `write::stage`,
/// `formats::dcp`, and `read` itself for `read/mod.rs`). `lib` and `fuzz` are the crate's face
/// and are left out.
fn module_of(file: &Path) -> String {
    let rel = file.strip_prefix(src()).unwrap().with_extension("");
    let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    match parts.as_slice() {
        [folder, m, ..] if m != "mod" => format!("{folder}::{m}"),
        [first, ..] => first.clone(),
        [] => String::new(),
    }
}

/// Whether `folder/m` is a module of `src` (a file or a folder), so that `crate::folder::m::…`
/// names it rather than an item of `folder`.
fn is_submodule(folder: &str, m: &str) -> bool {
    let dir = src().join(folder);
    dir.join(format!("{m}.rs")).is_file() || dir.join(m).is_dir()
}

/// Every `crate::…` module a file names, at the same granularity.
fn imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let path: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
        let mut segs = path.split("::").filter(|s| !s.is_empty());
        let Some(first) = segs.next() else { continue };
        let module = match segs.next() {
            Some(m) if is_submodule(first, m) => format!("{first}::{m}"),
            _ => first.to_string(),
        };
        // Re-exported names at the root (`crate::Error`) are not modules.
        if module.chars().next().is_some_and(char::is_lowercase) {
            out.insert(module);
        }
    }
    out
}

#[test]
fn no_module_imports_itself_through_another() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let m = module_of(f);
        if m == "lib" || m == "fuzz" {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        let deps = graph.entry(m.clone()).or_default();
        deps.extend(imports(&text).into_iter().filter(|d| *d != m && d != "formats"));
    }
    assert!(graph.len() > 15, "the scan found the modules: {:?}", graph.keys());
    for (m, deps) in &graph {
        for d in deps {
            // Is `m` reachable from `d`?
            let mut seen = BTreeSet::new();
            let mut todo = vec![d.clone()];
            while let Some(x) = todo.pop() {
                assert_ne!(&x, m, "`{m}` imports `{d}`, which leads back to `{m}`");
                if seen.insert(x.clone()) {
                    todo.extend(graph.get(&x).into_iter().flatten().cloned());
                }
            }
        }
    }
}

#[test]
fn only_sys_uses_unsafe() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let uses = text.lines().any(|l| {
            let code = l.split("//").next().unwrap_or_default();
            code.contains("unsafe {") || code.contains("unsafe fn") || code.contains("allow(unsafe_code)")
        });
        assert_eq!(uses, f.ends_with("sys.rs"), "{}", f.display());
    }
}

/// The format modules: every folder and file of `src/formats` but its `mod.rs`.
fn format_modules() -> BTreeSet<String> {
    let dir = src().join("formats");
    std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() || p.extension().is_some_and(|x| x == "rs"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|m| m != "mod")
        .collect()
}

/// The names a `crate::formats::` path reaches: the segment after it, or each name of a
/// `{…}` group.
fn formats_paths(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("formats::") {
        let rest = &text[i + "formats::".len()..];
        let group = match rest.strip_prefix('{') {
            Some(g) => &g[..g.find('}').unwrap_or(g.len())],
            None => rest,
        };
        let first_names = group.split(',').map(|s| s.trim());
        for name in first_names {
            let id: String = name.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            out.insert(id);
            if rest.starts_with(|c: char| c != '{') {
                break;
            }
        }
    }
    out
}

/// The seam: operations, planning, writing, reading and reports are generic; only a format's
/// own module knows its layout. Outside `src/formats` (the crate's face, `lib.rs` and `fuzz.rs`,
/// aside) no file names a format module or looks inside a source's detail.
#[test]
fn only_formats_name_a_format() {
    let formats = format_modules();
    assert!(formats.len() >= 7 && formats.contains("megatron"), "{formats:?}");
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut checked = 0;
    for f in files {
        let rel = f.strip_prefix(src()).unwrap();
        if rel.starts_with("formats") || rel == Path::new("lib.rs") || rel == Path::new("fuzz.rs") {
            continue;
        }
        checked += 1;
        let text = std::fs::read_to_string(&f).unwrap();
        let named: Vec<String> = formats_paths(&text).intersection(&formats).cloned().collect();
        assert!(named.is_empty(), "{} names the format module(s) {named:?}", rel.display());
        assert!(!text.contains("detail::<"), "{} looks inside a source's detail", rel.display());
    }
    assert!(checked > 20, "the scan found {checked} files");
}
