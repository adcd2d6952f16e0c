//! What `inspect` and `verify` print, as text and as JSON.
//!
//! The JSON documents are `ckpt`'s own views (`ckpt::INSPECT_SCHEMA`, ...), the ones the Python
//! bindings return: fields are only ever added within a version. The README documents them.

use std::io::Write;

/// A document of `ckpt`'s JSON views (`statekit.inspect/2`, `statekit.verify/1`,
/// `statekit.outcome/2`), pretty-printed, then a newline.
pub fn json(out: &mut impl Write, doc: &impl serde::Serialize) -> anyhow::Result<()> {
    // As an `io::Error` when writing failed, so a closed pipe (`| head`) is seen as one.
    serde_json::to_writer_pretty(&mut *out, doc).map_err(std::io::Error::from)?;
    writeln!(out)?;
    Ok(())
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

/// `label: value`, the values aligned after the longest of the catalog's labels.
fn fact(out: &mut impl Write, label: &str, value: &str) -> anyhow::Result<()> {
    writeln!(out, "{:<8} {value}", format!("{label}:"))?;
    Ok(())
}

/// What `inspect` prints: the catalog's facts and the format's, the tensors, then the
/// format's sections (an accelerate folder's components), as the format describes them.
pub fn inspect_text(out: &mut impl Write, ck: &ckpt::Checkpoint) -> anyhow::Result<()> {
    let described = ck.describe();
    fact(out, "format", ck.format().name())?;
    fact(out, "path", &ckpt::escape_controls(&ck.root().display().to_string()))?;
    fact(out, "files", &ck.files().len().to_string())?;
    fact(out, "tensors", &ck.tensors().len().to_string())?;
    fact(out, "bytes", &format!("{} ({})", ck.total_bytes(), human(ck.total_bytes())))?;
    let mut globals: Vec<&str> = Vec::new();
    for g in ck.files().iter().flat_map(|f| &f.globals) {
        if !globals.contains(&g.as_str()) {
            globals.push(g);
        }
    }
    if !globals.is_empty() {
        let globals = ckpt::escape_controls(&globals.join(", ")).into_owned();
        fact(out, "globals", &globals)?;
    }
    for (label, value) in &described.facts {
        fact(out, label, value)?;
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
    for section in &described.sections {
        writeln!(out)?;
        writeln!(out, "{}", section.heading)?;
        for line in &section.lines {
            writeln!(out, "  {line}")?;
        }
    }
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
            writeln!(out, "  problem: {}", ckpt::escape_controls(&p.to_string()))?;
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

/// A dry run's plan as text: one line per rank (its files, and bytes read and written).
pub fn shares_text(out: &mut impl Write, done: &ckpt::Outcome) -> anyhow::Result<()> {
    writeln!(out, "dry run: {} file(s), {} tensor bytes; nothing written", done.files.len(), done.bytes)?;
    for r in &done.ranks {
        writeln!(
            out,
            "rank {}: {} file(s), {} bytes read, {} bytes written",
            r.rank, r.files, r.bytes_read, r.bytes_written
        )?;
    }
    Ok(())
}
