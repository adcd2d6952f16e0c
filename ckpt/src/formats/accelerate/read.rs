//! Reading the folder's files: the models (opened as checkpoints, a DeepSpeed tag as its merged
//! view), the optimizers (summarized), and every other `torch.save` zip as plain values under
//! its kind's allow-list, all pickles of one folder sharing one budget.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::names::{classify, priority, Kind};
use super::position::position;
use super::{bad, rng, trainer, Component, Model, Optimizer, OptimizerState, Rng, SaveState};
use crate::error::{Error, IoContext, Result};
use crate::formats::torch;
use crate::formats::torch::pickle::{Budget, Limits};
use crate::read::catalog::Checkpoint;
use crate::read::value::Leaf;

/// The classes `sampler.bin` may name besides torch's weights-only globals: the sampler itself,
/// its generator, and the `range` a dataset of indices pickles as (`xrange` in protocol 2).
const SAMPLER_CLASSES: &[&str] = &[
    "accelerate.data_loader.SeedableRandomSampler",
    "torch._C.Generator",
    "torch.Generator",
    "__builtin__.xrange",
    "builtins.range",
];

impl SaveState {
    /// Reads every entry of the folder in index order (models first within an index), then
    /// settles the world size and checks the references between components.
    pub(super) fn read(root: &Path) -> Result<(SaveState, Vec<Error>)> {
        let (entries, other) = entries(root)?;
        let mut problems = Vec::new();
        // Every value file's values are kept together: their pickles share one budget, so a
        // folder of many files cannot hold more than one large file could.
        let budget = Budget::shared(Limits::default());
        let mut state = SaveState::empty(root, other);
        for (kind, i, path) in entries {
            state.read_entry(kind, i, path, &budget, &mut problems);
        }
        state.rng.sort_by_key(|r| r.rank);
        state.world_size = state.saved_world_size();
        problems.extend(state.cross_check());
        Ok((state, problems))
    }

    fn empty(root: &Path, other: Vec<PathBuf>) -> SaveState {
        SaveState {
            root: root.to_path_buf(),
            models: Vec::new(),
            optimizers: Vec::new(),
            schedulers: Vec::new(),
            scaler: None,
            rng: Vec::new(),
            data: Vec::new(),
            custom: Vec::new(),
            other,
            trainer: None,
            training_args: None,
            world_size: 0,
        }
    }

    /// Reads the entry `path`, of `kind` and index `i`, into its place; what cannot be read is a
    /// problem.
    fn read_entry(&mut self, kind: Kind, i: usize, path: PathBuf, budget: &Rc<Budget>, problems: &mut Vec<Error>) {
        match kind {
            Kind::Safetensors | Kind::TorchBin | Kind::FsdpFull | Kind::FsdpSharded | Kind::Index => {
                self.read_model(i, path, problems)
            }
            Kind::TrainerState => match trainer::read_state(&path) {
                Ok(t) => self.trainer = Some(t),
                Err(e) => problems.push(e),
            },
            Kind::TrainingArgs => {
                // Named, never read: the pickle is a `TrainingArguments` object.
                let mut one = Vec::new();
                push_component(&mut one, component(i, &path, &[], budget), problems);
                self.training_args = one.pop();
            }
            Kind::TrainerRng | Kind::Rng if i as u64 >= crate::MAX_WORLD_SIZE => {
                problems.push(rank_beyond_limit(&path))
            }
            Kind::TrainerRng => match rng::read_sharing(&path, rng::Keys::TRAINER, budget) {
                Ok(s) => self.rng.push(Rng { rank: i as u64, path, state: s }),
                Err(e) => problems.push(e),
            },
            Kind::DeepSpeed => self.read_deepspeed(i, path, problems),
            Kind::Optimizer | Kind::OptimizerSharded => {
                match Checkpoint::open(&path.to_string_lossy()).and_then(|ck| optimizer(i, path, ck)) {
                    Ok(o) => self.optimizers.push(o),
                    Err(e) => problems.push(e),
                }
            }
            Kind::Scheduler => push_component(&mut self.schedulers, component(i, &path, &[], budget), problems),
            Kind::Scaler => {
                let mut one = Vec::new();
                push_component(&mut one, component(i, &path, &[], budget), problems);
                self.scaler = one.pop();
            }
            Kind::Custom => push_component(&mut self.custom, component(i, &path, &[], budget), problems),
            Kind::DataLoader | Kind::Sampler => {
                let classes = if kind == Kind::Sampler { SAMPLER_CLASSES } else { &[] };
                match component(i, &path, classes, budget) {
                    Ok(c) => {
                        // A position that cannot be read is kept as none here (the folder's
                        // models still open and merge); `resume_point` refuses it by name.
                        let pos = position(&c, kind).ok();
                        self.data.push((c, pos));
                    }
                    Err(e) => problems.push(e),
                }
            }
            Kind::Rng => match rng::read_sharing(&path, rng::Keys::ACCELERATE, budget) {
                Ok(s) => self.rng.push(Rng { rank: i as u64, path, state: s }),
                Err(e) => problems.push(e),
            },
        }
    }

    /// Opens model `i`. One model per index: a second copy (the `Trainer` under FSDP saves both
    /// its own `model.safetensors` and accelerate's `pytorch_model_fsdp.bin`) is kept as a file
    /// of the folder.
    fn read_model(&mut self, i: usize, path: PathBuf, problems: &mut Vec<Error>) {
        if self.models.iter().any(|m| m.index == i) {
            self.other.push(path);
            return;
        }
        match Checkpoint::open(&path.to_string_lossy()) {
            Ok(checkpoint) => self.models.push(Model { index: i, path, checkpoint }),
            Err(e) => problems.push(e),
        }
    }

    /// Opens the DeepSpeed tag folder of model `i`: the model and, inside it, its optimizer.
    fn read_deepspeed(&mut self, i: usize, path: PathBuf, problems: &mut Vec<Error>) {
        if self.models.iter().any(|m| m.index == i) {
            self.other.push(path);
            return;
        }
        let tag = path.file_name().map(|n| n.to_string_lossy().into_owned());
        match crate::formats::deepspeed::catalog(self.root.clone(), tag.as_deref()) {
            Ok(scan) => {
                problems.extend(scan.problems);
                self.models.push(Model { index: i, path: path.clone(), checkpoint: scan.checkpoint });
                self.optimizers.push(Optimizer {
                    index: i,
                    path,
                    state: OptimizerState::InModel,
                    param_groups: 0,
                    params: 0,
                    state_tensors: 0,
                    step: None,
                });
            }
            Err(e) => problems.push(e),
        }
    }

    /// The sharded models' world size, else one past the highest rank of the RNG files (sorted).
    fn saved_world_size(&self) -> u64 {
        // Every rank read is below `MAX_WORLD_SIZE`, so this neither wraps nor exceeds it.
        self.models
            .iter()
            .filter_map(|m| m.checkpoint.world_size())
            .max()
            .unwrap_or_else(|| self.rng.last().map_or(1, |r| r.rank.saturating_add(1)))
    }
}

/// A file of `save_state`: its kind, its index, its path.
type Entry = (Kind, usize, PathBuf);

/// The folder's entries that are files of `save_state`, by index then by [`priority`], and the
/// others, by name.
fn entries(root: &Path) -> Result<(Vec<Entry>, Vec<PathBuf>)> {
    let mut entries: Vec<Entry> = Vec::new();
    let mut other = Vec::new();
    let mut names: Vec<(String, bool, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(root).at(root)? {
        let entry = entry.at(root)?;
        let is_dir = entry.file_type().at(root)?.is_dir();
        names.push((entry.file_name().to_string_lossy().into_owned(), is_dir, entry.path()));
    }
    names.sort();
    for (name, is_dir, path) in names {
        match classify(&name, is_dir) {
            Some((kind, i)) => entries.push((kind, i, path)),
            None => other.push(path),
        }
    }
    entries.sort_by_key(|(k, i, _)| (*i, priority(*k)));
    Ok((entries, other))
}

fn push_component(into: &mut Vec<Component>, c: Result<Component>, problems: &mut Vec<Error>) {
    match c {
        Ok(c) => into.push(c),
        Err(e) => problems.push(e),
    }
}

/// Reads a values file with the allow-list `classes` added to torch's; a refused global makes
/// the component `refused`, not an error, so `inspect` can name it.
fn component(index: usize, path: &Path, classes: &'static [&'static str], budget: &Rc<Budget>) -> Result<Component> {
    let mut c = Component { index, path: path.to_path_buf(), values: Vec::new(), classes: Vec::new(), refused: None };
    let f = match torch::read_with_classes_sharing(path, classes, budget) {
        Ok(f) => f,
        Err(Error::RefusedGlobal { global, .. }) => {
            c.refused = Some(global);
            return Ok(c);
        }
        Err(e) => return Err(e),
    };
    for (name, leaf) in &f.leaves {
        collect_classes(leaf, &mut c.classes);
        if name.ends_with("__class__") {
            if let Leaf::Str(s) = leaf {
                if !c.classes.contains(s) {
                    c.classes.push(s.clone());
                }
            }
        }
        c.values.push((name.clone(), leaf.to_json()));
    }
    for t in &f.tensors {
        c.values.push((t.name.clone(), serde_json::json!({ "dtype": t.dtype.to_string(), "shape": t.shape })));
    }
    Ok(c)
}

fn collect_classes(leaf: &Leaf, out: &mut Vec<String>) {
    match leaf {
        Leaf::Dict(d) => {
            for (k, v) in d {
                if let (true, Leaf::Str(s)) = (k == "__class__", v) {
                    if !out.contains(s) {
                        out.push(s.clone());
                    }
                }
                collect_classes(v, out);
            }
        }
        Leaf::List(l) => l.iter().for_each(|v| collect_classes(v, out)),
        _ => {}
    }
}

pub(super) fn value<'a>(c: &'a Component, name: &str) -> Option<&'a serde_json::Value> {
    c.values.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// An RNG file whose name gives a rank no world this library reads has: refused without reading
/// it, before the rank sizes anything.
pub(super) fn rank_beyond_limit(path: &Path) -> Error {
    Error::RankBeyondLimit { path: path.to_path_buf(), limit: crate::MAX_WORLD_SIZE }
}

/// Summarizes an opened optimizer file or folder.
fn optimizer(index: usize, path: PathBuf, ck: Checkpoint) -> Result<Optimizer> {
    let values = ck.values();
    // `param_groups` is one list (a torch file) or flattened per group (DCP).
    let (groups, params) = match values.iter().find(|(k, _)| *k == "param_groups") {
        Some((_, serde_json::Value::Array(gs))) => {
            (gs.len(), gs.iter().filter_map(|g| g.get("params")?.as_array().map(Vec::len)).sum())
        }
        _ => {
            let mut groups = 0;
            let mut params = 0;
            for (k, v) in &values {
                if let Some(rest) = k.strip_prefix("param_groups.") {
                    if rest.ends_with(".params") {
                        groups += 1;
                        params += v.as_array().map_or(0, Vec::len);
                    }
                }
            }
            (groups, params)
        }
    };
    if groups == 0 {
        return Err(bad(&path, None, "not an optimizer state dict: no `param_groups`"));
    }
    let step = ck
        .tensors()
        .iter()
        .find(|t| t.name.starts_with("state.") && t.name.ends_with(".step") && t.numel() == 1)
        .map(|t| ck.read_tensor(t).map(|b| scalar(t.dtype, &b)))
        .transpose()?
        .flatten();
    Ok(Optimizer {
        index,
        path,
        param_groups: groups,
        params,
        state_tensors: ck.tensors().len(),
        step,
        state: OptimizerState::Own(Box::new(ck)),
    })
}

fn scalar(dtype: crate::Dtype, b: &[u8]) -> Option<f64> {
    use crate::Dtype as D;
    Some(match (dtype, b.len()) {
        (D::F32, 4) => f64::from(f32::from_le_bytes(b.try_into().ok()?)),
        (D::F64, 8) => f64::from_le_bytes(b.try_into().ok()?),
        (D::I64, 8) => i64::from_le_bytes(b.try_into().ok()?) as f64,
        _ => return None,
    })
}
