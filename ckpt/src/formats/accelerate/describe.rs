//! What an accelerate `save_state` or `Trainer` folder describes of itself: its components, as
//! the lines `ckpt inspect` prints after the first model's tensors and as the `components`
//! field of the inspect document (the README documents its schema).

use std::path::Path;

use serde::{Serialize, Serializer};
use serde_json::{json, Value};

use super::trainer::TrainerState;
use super::{Component, DataPosition, OptimizerState, SaveState};
use crate::read::catalog::Checkpoint;
use crate::report::describe::{Description, Section};

/// The folder's description: named by its kind and world, its components as one section and
/// as the inspect document's `components`.
pub(crate) fn describe(ck: &Checkpoint) -> Description {
    let Some(s) = ck.save_state() else { return Description::of_files(ck) };
    let title = match s.trainer {
        Some(_) => format!("a Trainer checkpoint of {} rank(s)", s.world_size),
        None => format!("an accelerate save_state folder of {} ranks", s.world_size),
    };
    let heading = match &s.trainer {
        Some(t) => {
            let epoch = t.epoch.map(|e| format!(", epoch {e}")).unwrap_or_default();
            let max = t.max_steps.map(|m| format!(" of {m}")).unwrap_or_default();
            format!("Trainer checkpoint, saved by {} rank(s): step {}{max}{epoch}", s.world_size, t.global_step)
        }
        None => format!("accelerate save_state, saved by {} rank(s):", s.world_size),
    };
    let mut lines = models_lines(s);
    lines.extend(states_lines(s));
    lines.extend(data_lines(s));
    Description {
        title,
        sections: vec![Section::new(heading, lines)],
        json: vec![("components", s.to_json())],
        ..Description::default()
    }
}

/// A component's file name, as a line may show it.
fn file_name(p: &Path) -> String {
    let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    crate::escape_controls(&n).into_owned()
}

/// ` REFUSED: names `G``, when the component's pickle names a global that was refused.
fn refused(c: &Component) -> String {
    c.refused.as_ref().map(|g| format!(" REFUSED: names `{}`", crate::escape_controls(g))).unwrap_or_default()
}

/// `key=value, ...` for those of `keys` the component holds.
fn brief(c: &Component, keys: &[&str]) -> String {
    let shown: Vec<String> =
        keys.iter().filter_map(|k| c.values.iter().find(|(n, _)| n == k).map(|(n, v)| format!("{n}={v}"))).collect();
    shown.join(", ")
}

/// The models and optimizers, one line each.
fn models_lines(s: &SaveState) -> Vec<String> {
    let mut lines = Vec::new();
    for m in &s.models {
        let ck = &m.checkpoint;
        let world = ck.world_size().map(|w| format!(", {w} ranks")).unwrap_or_default();
        lines.push(format!(
            "model {}: {} ({}, {} tensors, {} bytes{world})",
            m.index,
            file_name(&m.path),
            ck.format().name(),
            ck.tensors().len(),
            ck.total_bytes()
        ));
    }
    for o in &s.optimizers {
        lines.push(match &o.state {
            OptimizerState::Own(ck) => {
                let step = o.step.map(|s| format!(", step {s}")).unwrap_or_default();
                format!(
                    "optimizer {}: {} ({}, {} param group(s), {} params, {} state tensors{step})",
                    o.index,
                    file_name(&o.path),
                    ck.format().name(),
                    o.param_groups,
                    o.params,
                    o.state_tensors
                )
            }
            OptimizerState::InModel => format!("optimizer {}: inside {} (DeepSpeed)", o.index, file_name(&o.path)),
        });
    }
    lines
}

/// The schedulers, the scaler, the RNG states and the training arguments.
fn states_lines(s: &SaveState) -> Vec<String> {
    let mut lines = Vec::new();
    for c in &s.schedulers {
        let shown = brief(c, &["last_epoch", "_last_lr"]);
        lines.push(format!("scheduler {}: {} ({shown}){}", c.index, file_name(&c.path), refused(c)));
    }
    if let Some(c) = &s.scaler {
        let shown = brief(c, &["scale", "_growth_tracker"]);
        lines.push(format!("scaler: {} ({shown}){}", file_name(&c.path), refused(c)));
    }
    for r in &s.rng {
        let step = r.state.step.map_or("-".into(), |s| s.to_string());
        let generators = r.state.generators.join(", ");
        lines.push(format!("rng rank {}: {} (step {step}; {generators})", r.rank, file_name(&r.path)));
    }
    if let Some(c) = &s.training_args {
        // Listed by the class it names; never read.
        let classes =
            c.refused.iter().chain(&c.classes).map(|g| format!("`{}`", crate::escape_controls(g))).collect::<Vec<_>>();
        lines.push(format!("training args: {} (names {}; not read)", file_name(&c.path), classes.join(", ")));
    }
    lines
}

/// The data positions, the custom states and the other files.
fn data_lines(s: &SaveState) -> Vec<String> {
    let mut lines = Vec::new();
    for (c, p) in &s.data {
        let what = p.as_ref().map_or_else(|| "not read".into(), position_text);
        lines.push(format!("data {}: {} ({what}){}", c.index, file_name(&c.path), refused(c)));
    }
    for c in &s.custom {
        let keys: Vec<&str> = c.values.iter().map(|(k, _)| k.as_str()).collect();
        let classes = if c.classes.is_empty() { String::new() } else { format!("; classes {}", c.classes.join(", ")) };
        lines.push(format!(
            "custom {}: {} (keys {}{classes}){}",
            c.index,
            file_name(&c.path),
            keys.join(", "),
            refused(c)
        ));
    }
    for p in &s.other {
        lines.push(format!("other: {}", file_name(p)));
    }
    lines
}

/// A data position: `dl_state_dict: epoch 1, batches yielded 3, ...`, the fields it has.
fn position_text(p: &DataPosition) -> String {
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

/// The `components` of the inspect document (the README documents the schema).
impl Serialize for SaveState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl SaveState {
    /// The components as the JSON `ckpt inspect --json` prints under `components`.
    pub fn to_json(&self) -> Value {
        let models: Vec<_> = self
            .models
            .iter()
            .map(|m| {
                let ck = &m.checkpoint;
                json!({ "index": m.index, "path": text(&m.path), "format": ck.format().name(), "tensors": ck.tensors().len(),
                        "bytes": ck.total_bytes(), "world_size": ck.world_size(), "zero_stage": ck.zero_stage() })
            })
            .collect();
        let optimizers: Vec<_> = self
            .optimizers
            .iter()
            .map(|o| {
                let format = match &o.state {
                    OptimizerState::Own(ck) => ck.format().name(),
                    _ => "in-model",
                };
                json!({ "index": o.index, "path": text(&o.path), "format": format, "param_groups": o.param_groups, "params": o.params,
                        "state_tensors": o.state_tensors, "step": o.step })
            })
            .collect();
        let rng: Vec<_> = self
            .rng
            .iter()
            .map(|r| json!({ "rank": r.rank, "path": text(&r.path), "step": r.state.step, "generators": r.state.generators }))
            .collect();
        let data: Vec<_> = self
            .data
            .iter()
            .map(|(c, p)| {
                let mut v = component(c);
                if let (Some(p), Some(m)) = (p, v.as_object_mut()) {
                    m.insert(
                        "position".into(),
                        json!({ "kind": p.kind, "epoch": p.epoch, "seed": p.seed, "batches_yielded": p.batches_yielded,
                        "samples_yielded": p.samples_yielded, "finished": p.finished, "num_workers": p.num_workers }),
                    );
                }
                v
            })
            .collect();
        json!({
            "world_size": self.world_size,
            "models": models,
            "optimizers": optimizers,
            "schedulers": self.schedulers.iter().map(component).collect::<Vec<_>>(),
            "scaler": self.scaler.as_ref().map(component),
            "rng": rng,
            "data": data,
            "custom": self.custom.iter().map(component).collect::<Vec<_>>(),
            "other_files": self.other.iter().map(|p| text(p)).collect::<Vec<_>>(),
            "trainer": self.trainer.as_ref().map(trainer),
            "training_args": self.training_args.as_ref().map(component),
        })
    }
}

/// A values file: its values, the classes it names, and the global a refused pickle names.
fn component(c: &Component) -> Value {
    let values: serde_json::Map<String, Value> = c.values.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    json!({ "index": c.index, "path": text(&c.path), "values": values, "classes": c.classes, "refused": c.refused })
}

/// `components.trainer`: what `trainer_state.json` says.
fn trainer(t: &TrainerState) -> Value {
    json!({
        "path": text(&t.path),
        "global_step": t.global_step,
        "epoch": t.epoch,
        "max_steps": t.max_steps,
        "train_batch_size": t.train_batch_size,
        "num_train_epochs": t.num_train_epochs,
        "log_entries": t.log_entries,
        "last_log": t.last_log,
    })
}

/// A path as JSON text: a name that is not UTF-8 gets U+FFFD in place of its invalid bytes.
fn text(p: &Path) -> std::borrow::Cow<'_, str> {
    p.to_string_lossy()
}
