//! What `inspect` and `verify` print, as text and as JSON.
//!
//! The JSON documents carry `"schema": "statekit.inspect/2"` or `"statekit.verify/1"`; fields are
//! only ever added within a version. The README documents both.

use std::io::Write;

use serde_json::json;

pub fn inspect_json(out: &mut impl Write, ck: &ckpt::Checkpoint) -> anyhow::Result<()> {
    let files: Vec<serde_json::Value> = ck
        .files()
        .iter()
        .map(|f| {
            let meta: serde_json::Map<String, serde_json::Value> =
                f.metadata.iter().map(|(k, v)| (k.clone(), v.clone().into())).collect();
            let mut entry = json!({ "path": f.path, "bytes": f.len, "metadata": meta });
            // A pickle's globals, allowed or not (torch files).
            if let (false, Some(map)) = (f.globals.is_empty(), entry.as_object_mut()) {
                map.insert("globals".into(), f.globals.clone().into());
            }
            entry
        })
        .collect();
    // Each tensor's entry is built as it is written: a million tensors never stand as one tree.
    let tensors = Lazy::new(ck.tensors().iter().map(|t| {
        let file = t.location().map(|(f, _)| &ck.files()[f].path);
        let offset = t.location().map(|(_, o)| o);
        let decoded = ck.is_decoded(t);
        let offset = offset.filter(|_| !decoded);
        let mut entry = json!({ "name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape, "file": file, "offset": offset, "bytes": t.byte_len() });
        if let Some(map) = entry.as_object_mut() {
            if decoded {
                // A numpy array: its bytes are decoded from the file's pickle, not stored.
                map.insert("decoded".into(), true.into());
            } else if !t.boxes().is_empty() {
                map.insert("boxes".into(), t.boxes().iter().map(|b| box_json(ck, b)).collect());
            }
        }
        entry
    }));
    let head = json!({
        "schema": "statekit.inspect/2",
        "format": ck.format().name(),
        "path": ck.root(),
        "index_metadata": ck.index_metadata(),
        "values": ck.values().into_iter().map(|(k, v)| (k.to_string(), v)).collect::<serde_json::Map<_, _>>(),
        "files": files,
    });
    let mut tail = json!({
        "totals": { "files": ck.files().len(), "tensors": ck.tensors().len(), "bytes": ck.total_bytes() },
    });
    if let (Some(state), Some(map)) = (ck.save_state(), tail.as_object_mut()) {
        map.insert("components".into(), state.to_json());
    }
    let doc = Doc { head: &head, tensors: &tensors, tail: &tail };
    serde_json::to_writer_pretty(&mut *out, &doc)?;
    writeln!(out)?;
    Ok(())
}

/// The `inspect` document: the fields of `head`, `tensors`, then the fields of `tail`.
struct Doc<'a, I> {
    head: &'a serde_json::Value,
    tensors: &'a Lazy<I>,
    tail: &'a serde_json::Value,
}

impl<I: Iterator<Item = serde_json::Value>> serde::Serialize for Doc<'_, I> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (k, v) in self.head.as_object().into_iter().flatten() {
            map.serialize_entry(k, v)?;
        }
        map.serialize_entry("tensors", self.tensors)?;
        for (k, v) in self.tail.as_object().into_iter().flatten() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// A JSON array written from an iterator, each element built as it is written.
struct Lazy<I>(std::cell::RefCell<Option<I>>);

impl<I> Lazy<I> {
    fn new(items: I) -> Self {
        Lazy(std::cell::RefCell::new(Some(items)))
    }
}

impl<I: Iterator<Item = serde_json::Value>> serde::Serialize for Lazy<I> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.borrow_mut().take() {
            Some(items) => s.collect_seq(items),
            None => s.collect_seq(std::iter::empty::<serde_json::Value>()),
        }
    }
}

/// One box of a tensor: where it sits in the tensor, and the strided view on the stored bytes
/// that holds it (storage `offset` is the absolute byte offset of its storage in `file`).
fn box_json(ck: &ckpt::Checkpoint, b: &ckpt::TensorBox) -> serde_json::Value {
    let file = ck.files().get(b.file);
    json!({
        "offsets": b.region.offsets,
        "sizes": b.region.sizes,
        "file": file.map(|f| &f.path),
        "rank": file.and_then(|f| f.rank),
        "storage_offset": b.base,
        "storage_bytes": b.len,
        "view_offset": b.offset,
        "strides": b.strides,
    })
}

/// How a tensor of several boxes is cut: `4 (dims 0, 1)`, the dims some box does not span.
fn cut(t: &ckpt::TensorInfo) -> String {
    let live: Vec<&ckpt::TensorBox> = t.boxes().iter().filter(|b| !b.region.is_empty()).collect();
    if live.len() <= 1 {
        return String::new();
    }
    let dims: Vec<String> = (0..t.shape.len())
        .filter(|&d| live.iter().any(|b| b.region.sizes.get(d) != t.shape.get(d)))
        .map(|d| d.to_string())
        .collect();
    format!("{} (dim{} {})", live.len(), if dims.len() == 1 { "" } else { "s" }, dims.join(", "))
}

/// What `inspect` prints, after the first model's tensors, for a `save_state` folder.
pub fn components_text(out: &mut impl Write, s: &ckpt::accelerate::SaveState) -> anyhow::Result<()> {
    let name = |p: &std::path::Path| {
        let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        ckpt::escape_controls(&n).into_owned()
    };
    writeln!(out)?;
    match &s.trainer {
        Some(t) => {
            let epoch = t.epoch.map(|e| format!(", epoch {e}")).unwrap_or_default();
            let max = t.max_steps.map(|m| format!(" of {m}")).unwrap_or_default();
            writeln!(out, "Trainer checkpoint, saved by {} rank(s): step {}{max}{epoch}", s.world_size, t.global_step)?;
        }
        None => writeln!(out, "accelerate save_state, saved by {} rank(s):", s.world_size)?,
    }
    for m in &s.models {
        let ck = &m.checkpoint;
        let world = ck.world_size().map(|w| format!(", {w} ranks")).unwrap_or_default();
        writeln!(
            out,
            "  model {}: {} ({}, {} tensors, {} bytes{world})",
            m.index,
            name(&m.path),
            ck.format().name(),
            ck.tensors().len(),
            ck.total_bytes()
        )?;
    }
    for o in &s.optimizers {
        match &o.state {
            ckpt::accelerate::OptimizerState::Own(ck) => {
                let step = o.step.map(|s| format!(", step {s}")).unwrap_or_default();
                writeln!(
                    out,
                    "  optimizer {}: {} ({}, {} param group(s), {} params, {} state tensors{step})",
                    o.index,
                    name(&o.path),
                    ck.format().name(),
                    o.param_groups,
                    o.params,
                    o.state_tensors
                )?;
            }
            _ => writeln!(out, "  optimizer {}: inside {} (DeepSpeed)", o.index, name(&o.path))?,
        }
    }
    let refused = |c: &ckpt::accelerate::Component| {
        c.refused.as_ref().map(|g| format!(" REFUSED: names `{}`", ckpt::escape_controls(g))).unwrap_or_default()
    };
    let brief = |c: &ckpt::accelerate::Component, keys: &[&str]| -> String {
        let shown: Vec<String> = keys
            .iter()
            .filter_map(|k| c.values.iter().find(|(n, _)| n == k).map(|(n, v)| format!("{n}={v}")))
            .collect();
        shown.join(", ")
    };
    for c in &s.schedulers {
        writeln!(
            out,
            "  scheduler {}: {} ({}){}",
            c.index,
            name(&c.path),
            brief(c, &["last_epoch", "_last_lr"]),
            refused(c)
        )?;
    }
    if let Some(c) = &s.scaler {
        writeln!(out, "  scaler: {} ({}){}", name(&c.path), brief(c, &["scale", "_growth_tracker"]), refused(c))?;
    }
    for r in &s.rng {
        let step = r.state.step.map_or("-".into(), |s| s.to_string());
        writeln!(out, "  rng rank {}: {} (step {step}; {})", r.rank, name(&r.path), r.state.generators.join(", "))?;
    }
    if let Some(c) = &s.training_args {
        // Listed by the class it names; never read.
        let classes =
            c.refused.iter().chain(&c.classes).map(|g| format!("`{}`", ckpt::escape_controls(g))).collect::<Vec<_>>();
        writeln!(out, "  training args: {} (names {}; not read)", name(&c.path), classes.join(", "))?;
    }
    for (c, p) in &s.data {
        let what = match p {
            Some(p) => {
                let opt = |label: &str, v: Option<String>| v.map(|v| format!("{label} {v}"));
                let parts: Vec<String> = [
                    opt("epoch", p.epoch.map(|e| e.to_string())),
                    opt("seed", p.seed.map(|e| e.to_string())),
                    opt("batches yielded", p.batches_yielded.map(|e| e.to_string())),
                    opt("samples yielded", p.samples_yielded.map(|e| e.to_string())),
                    opt("finished", p.finished.map(|e| e.to_string())),
                ]
                .into_iter()
                .flatten()
                .collect();
                format!("{}: {}", p.kind, parts.join(", "))
            }
            None => "not read".into(),
        };
        writeln!(out, "  data {}: {} ({what}){}", c.index, name(&c.path), refused(c))?;
    }
    for c in &s.custom {
        let keys: Vec<&str> = c.values.iter().map(|(k, _)| k.as_str()).collect();
        let classes = if c.classes.is_empty() { String::new() } else { format!("; classes {}", c.classes.join(", ")) };
        writeln!(out, "  custom {}: {} (keys {}{classes}){}", c.index, name(&c.path), keys.join(", "), refused(c))?;
    }
    for p in &s.other {
        writeln!(out, "  other: {}", name(p))?;
    }
    Ok(())
}

pub fn inspect_text(out: &mut impl Write, ck: &ckpt::Checkpoint) -> anyhow::Result<()> {
    writeln!(out, "format:  {}", ck.format().name())?;
    writeln!(out, "path:    {}", ckpt::escape_controls(&ck.root().display().to_string()))?;
    writeln!(out, "files:   {}", ck.files().len())?;
    writeln!(out, "tensors: {}", ck.tensors().len())?;
    writeln!(out, "bytes:   {} ({})", ck.total_bytes(), human(ck.total_bytes()))?;
    let mut globals: Vec<&str> = Vec::new();
    for g in ck.files().iter().flat_map(|f| &f.globals) {
        if !globals.contains(&g.as_str()) {
            globals.push(g);
        }
    }
    if !globals.is_empty() {
        let globals = ckpt::escape_controls(&globals.join(", ")).into_owned();
        writeln!(out, "globals: {globals}")?;
    }
    writeln!(out)?;
    // A BOXES column when some tensor is cut into several boxes (DCP, on any dims).
    let boxed = ck.tensors().iter().any(|t| !cut(t).is_empty());
    let rows: Vec<Vec<String>> = ck
        .tensors()
        .iter()
        .map(|t| {
            let file = t
                .location()
                .and_then(|(f, _)| ck.files()[f].path.file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            // Names come from the file: a newline in one must not forge a row.
            let name = ckpt::escape_controls(&t.name).into_owned();
            let file = ckpt::escape_controls(&file).into_owned();
            let mut row = vec![name, t.dtype.to_string(), format!("{:?}", t.shape), file, t.byte_len().to_string()];
            if boxed {
                row.push(cut(t));
            }
            row
        })
        .collect();
    let mut header: Vec<String> = ["NAME", "DTYPE", "SHAPE", "FILE", "BYTES"].map(String::from).to_vec();
    if boxed {
        header.push("BOXES".into());
    }
    let mut widths: Vec<usize> = header.iter().map(String::len).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    for r in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, &w))| if i == 4 { format!("{c:>w$}") } else { format!("{c:<w$}") })
            .collect();
        writeln!(out, "{}", line.join("  ").trim_end())?;
    }
    Ok(())
}

pub fn verify_json(out: &mut impl Write, r: &ckpt::Report) -> anyhow::Result<()> {
    let doc = json!({
        "schema": "statekit.verify/1",
        "valid": r.is_valid(),
        "path": r.path,
        "format": r.format.map(|f| f.name()),
        "files": r.files,
        "tensors": r.tensors,
        "checksums_ok": r.checksums_ok,
        "problems": r.problems.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "warnings": r.warnings,
    });
    serde_json::to_writer_pretty(&mut *out, &doc)?;
    writeln!(out)?;
    Ok(())
}

pub fn verify_text(out: &mut impl Write, r: &ckpt::Report) -> anyhow::Result<()> {
    let what = format!(
        "{} ({}, {} file(s), {} tensor(s), {} checksum(s) matched)",
        ckpt::escape_controls(&r.path.display().to_string()),
        r.format.map_or("unknown format", |f| f.name()),
        r.files,
        r.tensors,
        r.checksums_ok
    );
    if r.is_valid() {
        writeln!(out, "ok: {what}")?;
    } else {
        writeln!(out, "invalid: {what}: {} problem(s)", r.problems.len())?;
        for p in &r.problems {
            writeln!(out, "  problem: {p}")?;
        }
    }
    for w in &r.warnings {
        writeln!(out, "  warning: {}", ckpt::escape_controls(w))?;
    }
    Ok(())
}

/// Sizes in binary units, as `ls -h` shows them.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
