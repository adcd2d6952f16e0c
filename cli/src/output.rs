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

/// What `inspect` prints, after the first model's tensors, for a `save_state` folder.
pub fn components_text(out: &mut impl Write, s: &ckpt::accelerate::SaveState) -> anyhow::Result<()> {
    writeln!(out)?;
    match &s.trainer {
        Some(t) => {
            let epoch = t.epoch.map(|e| format!(", epoch {e}")).unwrap_or_default();
            let max = t.max_steps.map(|m| format!(" of {m}")).unwrap_or_default();
            writeln!(out, "Trainer checkpoint, saved by {} rank(s): step {}{max}{epoch}", s.world_size, t.global_step)?;
        }
        None => writeln!(out, "accelerate save_state, saved by {} rank(s):", s.world_size)?,
    }
    models_text(out, s)?;
    states_text(out, s)?;
    data_text(out, s)
}

/// A component's file name, as a line may show it.
fn file_name(p: &std::path::Path) -> String {
    let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    ckpt::escape_controls(&n).into_owned()
}

/// ` REFUSED: names `G``, when the component's pickle names a global that was refused.
fn refused(c: &ckpt::accelerate::Component) -> String {
    c.refused.as_ref().map(|g| format!(" REFUSED: names `{}`", ckpt::escape_controls(g))).unwrap_or_default()
}

/// `key=value, ...` for those of `keys` the component holds.
fn brief(c: &ckpt::accelerate::Component, keys: &[&str]) -> String {
    let shown: Vec<String> =
        keys.iter().filter_map(|k| c.values.iter().find(|(n, _)| n == k).map(|(n, v)| format!("{n}={v}"))).collect();
    shown.join(", ")
}

/// The models and optimizers, one line each.
fn models_text(out: &mut impl Write, s: &ckpt::accelerate::SaveState) -> anyhow::Result<()> {
    for m in &s.models {
        let ck = &m.checkpoint;
        let world = ck.world_size().map(|w| format!(", {w} ranks")).unwrap_or_default();
        writeln!(
            out,
            "  model {}: {} ({}, {} tensors, {} bytes{world})",
            m.index,
            file_name(&m.path),
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
                    file_name(&o.path),
                    ck.format().name(),
                    o.param_groups,
                    o.params,
                    o.state_tensors
                )?;
            }
            _ => writeln!(out, "  optimizer {}: inside {} (DeepSpeed)", o.index, file_name(&o.path))?,
        }
    }
    Ok(())
}

/// The schedulers, the scaler, the RNG states and the training arguments.
fn states_text(out: &mut impl Write, s: &ckpt::accelerate::SaveState) -> anyhow::Result<()> {
    for c in &s.schedulers {
        let shown = brief(c, &["last_epoch", "_last_lr"]);
        writeln!(out, "  scheduler {}: {} ({shown}){}", c.index, file_name(&c.path), refused(c))?;
    }
    if let Some(c) = &s.scaler {
        let shown = brief(c, &["scale", "_growth_tracker"]);
        writeln!(out, "  scaler: {} ({shown}){}", file_name(&c.path), refused(c))?;
    }
    for r in &s.rng {
        let step = r.state.step.map_or("-".into(), |s| s.to_string());
        let generators = r.state.generators.join(", ");
        writeln!(out, "  rng rank {}: {} (step {step}; {generators})", r.rank, file_name(&r.path))?;
    }
    if let Some(c) = &s.training_args {
        // Listed by the class it names; never read.
        let classes =
            c.refused.iter().chain(&c.classes).map(|g| format!("`{}`", ckpt::escape_controls(g))).collect::<Vec<_>>();
        writeln!(out, "  training args: {} (names {}; not read)", file_name(&c.path), classes.join(", "))?;
    }
    Ok(())
}

/// The data positions, the custom states and the other files.
fn data_text(out: &mut impl Write, s: &ckpt::accelerate::SaveState) -> anyhow::Result<()> {
    for (c, p) in &s.data {
        let what = p.as_ref().map_or_else(|| "not read".into(), position_text);
        writeln!(out, "  data {}: {} ({what}){}", c.index, file_name(&c.path), refused(c))?;
    }
    for c in &s.custom {
        let keys: Vec<&str> = c.values.iter().map(|(k, _)| k.as_str()).collect();
        let classes = if c.classes.is_empty() { String::new() } else { format!("; classes {}", c.classes.join(", ")) };
        writeln!(
            out,
            "  custom {}: {} (keys {}{classes}){}",
            c.index,
            file_name(&c.path),
            keys.join(", "),
            refused(c)
        )?;
    }
    for p in &s.other {
        writeln!(out, "  other: {}", file_name(p))?;
    }
    Ok(())
}

/// A data position: `dl_state_dict: epoch 1, batches yielded 3, ...`, the fields it has.
fn position_text(p: &ckpt::accelerate::DataPosition) -> String {
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
    if let Some(m) = ck.megatron() {
        megatron_text(out, m)?;
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

/// A Megatron checkpoint's run and model, the settings it does not record left out.
fn megatron_text(out: &mut impl Write, m: &ckpt::MegatronInfo) -> anyhow::Result<()> {
    let n = |label: &str, v: Option<u64>| v.map(|v| format!("{label} {v}"));
    let b = |label: &str, v: Option<bool>| v.map(|v| format!("{label} {}", if v { "yes" } else { "no" }));
    let run: Vec<String> = [
        n("iteration", m.iteration),
        n("tensor parallel", m.tensor_parallel),
        n("pipeline parallel", m.pipeline_parallel),
        m.optimizer.as_ref().map(|o| format!("optimizer {}", ckpt::escape_controls(o))),
    ]
    .into_iter()
    .flatten()
    .collect();
    let model: Vec<String> = [
        n("layers", m.num_layers),
        n("hidden", m.hidden_size),
        n("ffn", m.ffn_hidden_size),
        n("heads", m.num_attention_heads),
        n("query groups", m.num_query_groups),
        b("swiglu", m.swiglu),
        b("tied embeddings", m.tied_embeddings),
    ]
    .into_iter()
    .flatten()
    .collect();
    let run = if run.is_empty() { String::new() } else { format!(" ({})", run.join(", ")) };
    writeln!(out, "megatron: {}{run}", m.layout)?;
    writeln!(out, "model:   {}", model.join(", "))?;
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
