//! accelerate's `save_state` folder (`Accelerator.save_state(dir)`, accelerate 1.x).
//!
//! One folder holds every piece of a run's state, each in a file named by its kind and its
//! index among the prepared objects (the index goes before the extension, and the first object
//! has none: `model.safetensors`, `model_1.safetensors`):
//! - models: `model[_i].safetensors` (or `pytorch_model[_i].bin` without safe serialization);
//!   under FSDP `pytorch_model_fsdp[_i].bin` (full state dict) or the DCP folder
//!   `pytorch_model_fsdp_i/` (sharded, one `__R_0.distcp` per rank, `{"model": …}`); under
//!   DeepSpeed the engine's own checkpoint, a tag folder `pytorch_model[_i]/` beside `latest`
//!   (which names only the engine saved last);
//! - optimizers: `optimizer[_i].bin`, under sharded FSDP the DCP folder `optimizer_i/`
//!   (`{"optimizer": …}`); DeepSpeed keeps them inside its tag folder;
//! - `scheduler[_i].bin`, `scaler.pt` (a `GradScaler` state dict), `custom_checkpoint_i.pkl`
//!   (`register_for_checkpointing` objects' state dicts);
//! - data position: `dl_state_dict[_i].bin` (torchdata `StatefulDataLoader.state_dict()`, written
//!   by every rank to the same path) and `sampler[_i].bin` (a pickled `SeedableRandomSampler`,
//!   only for iterable datasets);
//! - `random_states_R.pkl`, one per rank: accelerate's step counter and the Python, numpy and
//!   torch generator states (see [`rng`]).
//!
//! Every `.bin`, `.pt` and `.pkl` is a `torch.save` zip. Each kind of file is read with its own
//! allow-list (torch's weights-only globals, plus numpy's array reconstruction for the RNG
//! files and accelerate's sampler, `torch.Generator` and `range` for `sampler.bin`); what those
//! name is kept as inert data. Nothing is imported or called.
//!
//! The folder opens as a [`Checkpoint`] of its first model (so `convert` and `split` apply to
//! it), with the whole [`SaveState`] as its detail.
//!
//! transformers' `Trainer` folders (`checkpoint-N/`) are read the same way, with the
//! `Trainer`'s own names beside accelerate's ([`trainer`]).

pub(crate) mod rng;
pub(crate) mod trainer;

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use crate::catalog::{Checkpoint, Format, Parts, Scan};
use crate::error::{Error, IoContext, Result};
use crate::formats::torch::pickle::{Budget, Limits};
use crate::formats::{dcp, torch};
use crate::value::Leaf;
use rng::RngState;

/// What an index-numbered file of the folder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Safetensors,
    TorchBin,
    FsdpFull,
    FsdpSharded,
    DeepSpeed,
    Optimizer,
    OptimizerSharded,
    Scheduler,
    Sampler,
    DataLoader,
    Scaler,
    Rng,
    Custom,
    /// A sharded model's index (`model.safetensors.index.json`, `pytorch_model.bin.index.json`).
    Index,
    /// The `Trainer`'s `rng_state[_R].pth`.
    TrainerRng,
    /// The `Trainer`'s `trainer_state.json`.
    TrainerState,
    /// The `Trainer`'s pickled `TrainingArguments`.
    TrainingArgs,
}

/// `stem[_i]ext` → `Some(i)` (no index is 0), for the names accelerate numbers from the second.
fn numbered(name: &str, stem: &str, ext: &str) -> Option<usize> {
    let mid = name.strip_prefix(stem)?.strip_suffix(ext)?;
    if mid.is_empty() {
        return Some(0);
    }
    index(mid.strip_prefix('_')?).filter(|&i| i > 0)
}

/// `stem_i ext` → `Some(i)`, for the names that always carry their index.
fn always_numbered(name: &str, stem: &str, ext: &str) -> Option<usize> {
    index(name.strip_prefix(stem)?.strip_suffix(ext)?)
}

/// `stem_R ext` → `Some(R)` for a rank, which saturates: a rank past `usize` is still a rank
/// file, refused for its rank (see [`rank_beyond_limit`]), not a stray file copied along.
fn ranked(name: &str, stem: &str, ext: &str) -> Option<usize> {
    let digits = name.strip_prefix(stem)?.strip_suffix(ext)?;
    let canonical =
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (digits == "0" || !digits.starts_with('0'));
    canonical.then(|| digits.parse().unwrap_or(usize::MAX))
}

fn index(digits: &str) -> Option<usize> {
    let canonical =
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (digits == "0" || !digits.starts_with('0'));
    canonical.then(|| digits.parse().ok()).flatten()
}

/// The order entries of one index are read in. Of two copies of a model, the first is the model
/// and the other a plain file: a DeepSpeed tag (which holds the optimizer and reshards to a
/// universal checkpoint) before accelerate's FSDP files, before the `Trainer`'s
/// `save_pretrained` copy. Models come before the components checked against them.
fn priority(kind: Kind) -> u8 {
    match kind {
        Kind::DeepSpeed => 0,
        Kind::FsdpSharded => 1,
        Kind::FsdpFull => 2,
        Kind::Safetensors => 3,
        Kind::Index => 4,
        Kind::TorchBin => 5,
        other => 6 + other as u8,
    }
}

/// What the entry `name` of a save_state folder is, and its index (a rank for RNG files).
fn classify(name: &str, is_dir: bool) -> Option<(Kind, usize)> {
    if is_dir {
        return always_numbered(name, "pytorch_model_fsdp_", "")
            .map(|i| (Kind::FsdpSharded, i))
            .or_else(|| always_numbered(name, "optimizer_", "").map(|i| (Kind::OptimizerSharded, i)))
            .or_else(|| numbered(name, "pytorch_model", "").map(|i| (Kind::DeepSpeed, i)))
            // The `Trainer`'s DeepSpeed tag (a universal checkpoint, `global_stepN_universal`, is
            // written for another world size, not read).
            .or_else(|| always_numbered(name, "global_step", "").map(|_| (Kind::DeepSpeed, 0)));
    }
    let trainer = match name {
        "optimizer.pt" => Some((Kind::Optimizer, 0)),
        "scheduler.pt" => Some((Kind::Scheduler, 0)),
        "rng_state.pth" => Some((Kind::TrainerRng, 0)),
        "model.safetensors.index.json" | "pytorch_model.bin.index.json" => Some((Kind::Index, 0)),
        trainer::STATE_NAME => Some((Kind::TrainerState, 0)),
        trainer::ARGS_NAME => Some((Kind::TrainingArgs, 0)),
        _ => ranked(name, "rng_state_", ".pth").map(|r| (Kind::TrainerRng, r)),
    };
    if trainer.is_some() {
        return trainer;
    }
    let table: [(&str, &str, Kind); 8] = [
        ("model", ".safetensors", Kind::Safetensors),
        ("pytorch_model_fsdp", ".bin", Kind::FsdpFull),
        ("pytorch_model", ".bin", Kind::TorchBin),
        ("optimizer", ".bin", Kind::Optimizer),
        ("scheduler", ".bin", Kind::Scheduler),
        ("sampler", ".bin", Kind::Sampler),
        ("dl_state_dict", ".bin", Kind::DataLoader),
        ("scaler", ".pt", Kind::Scaler),
    ];
    for (stem, ext, kind) in table {
        if let Some(i) = numbered(name, stem, ext) {
            if kind == Kind::Scaler && i > 0 {
                return None;
            }
            return Some((kind, i));
        }
    }
    ranked(name, "random_states_", ".pkl")
        .map(|r| (Kind::Rng, r))
        .or_else(|| always_numbered(name, "custom_checkpoint_", ".pkl").map(|i| (Kind::Custom, i)))
}

/// The classes `sampler.bin` may name besides torch's weights-only globals: the sampler itself,
/// its generator, and the `range` a dataset of indices pickles as (`xrange` in protocol 2).
const SAMPLER_CLASSES: &[&str] = &[
    "accelerate.data_loader.SeedableRandomSampler",
    "torch._C.Generator",
    "torch.Generator",
    "__builtin__.xrange",
    "builtins.range",
];

/// A model of the folder.
#[derive(Debug)]
#[non_exhaustive]
pub struct Model {
    /// Its index among the prepared models.
    pub index: usize,
    /// Its file or folder.
    pub path: PathBuf,
    /// The model, opened (a DeepSpeed model is the merged view of its tag).
    pub checkpoint: Checkpoint,
}

/// Where an optimizer's state is.
#[derive(Debug)]
#[non_exhaustive]
pub enum OptimizerState {
    /// An `optimizer[_i].bin` or a DCP `optimizer_i/`, opened.
    Own(Box<Checkpoint>),
    /// Inside the DeepSpeed checkpoint of the model of the same index.
    InModel,
}

/// An optimizer of the folder.
#[derive(Debug)]
#[non_exhaustive]
pub struct Optimizer {
    /// Its index among the prepared optimizers.
    pub index: usize,
    /// Its file or folder.
    pub path: PathBuf,
    /// Its state.
    pub state: OptimizerState,
    /// Number of `param_groups`.
    pub param_groups: usize,
    /// Parameters listed in the groups.
    pub params: usize,
    /// State tensors (`exp_avg`, `exp_avg_sq`, `step`, …).
    pub state_tensors: usize,
    /// The optimizer step of its first parameter's state, where it keeps one.
    pub step: Option<f64>,
}

/// A file read as plain values (a scheduler, the scaler, a custom object, a data position).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Component {
    /// Its index among objects of its kind (the rank, for RNG files).
    pub index: usize,
    /// The file.
    pub path: PathBuf,
    /// Its values by dotted name; tensors as `{"dtype", "shape"}`.
    pub values: Vec<(String, serde_json::Value)>,
    /// The classes its pickle names beyond plain data (`accelerate.data_loader.SeedableRandomSampler`).
    pub classes: Vec<String>,
    /// The global its pickle names that this file kind's allow-list refuses: the file's values
    /// are then not read, and nothing that needs them runs.
    pub refused: Option<String>,
}

/// An RNG file.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Rng {
    /// The rank that wrote it.
    pub rank: u64,
    /// The file.
    pub path: PathBuf,
    /// What it holds.
    pub state: RngState,
}

/// Where the data stream was, as accelerate saved it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DataPosition {
    /// The file it comes from.
    pub path: PathBuf,
    /// `dl_state_dict` (a stateful dataloader) or `sampler` (a pickled seedable sampler).
    pub kind: &'static str,
    /// The sampler's epoch (`sampler.bin` only: a stateful dataloader does not keep it).
    pub epoch: Option<u64>,
    /// The sampler's seed (`sampler.bin`).
    pub seed: Option<i64>,
    /// Batches this rank's loader had yielded in the epoch.
    pub batches_yielded: Option<u64>,
    /// Samples the index sampler had yielded, where its state keeps the count.
    pub samples_yielded: Option<u64>,
    /// Whether the epoch was exhausted.
    pub finished: Option<bool>,
    /// The loader's worker processes (0: the main process loaded).
    pub num_workers: Option<u64>,
}

/// Where a run accelerate saved continues in its data stream (see [`SaveState::resume_point`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ResumePoint {
    /// Batches (steps) every rank had read in the epoch.
    pub batches: u64,
    /// The epoch.
    pub epoch: u64,
    /// The sampler's seed, where the folder holds a pickled `SeedableRandomSampler`.
    pub seed: Option<i64>,
    /// The ranks that saved it, whose batches `batches` counts.
    pub world_size: u64,
}

/// An accelerate `save_state` folder, every component read as data.
#[derive(Debug)]
#[non_exhaustive]
pub struct SaveState {
    /// The folder.
    pub root: PathBuf,
    /// Models, by index.
    pub models: Vec<Model>,
    /// Optimizers, by index.
    pub optimizers: Vec<Optimizer>,
    /// Schedulers, by index.
    pub schedulers: Vec<Component>,
    /// The gradient scaler's state.
    pub scaler: Option<Component>,
    /// RNG files, by rank.
    pub rng: Vec<Rng>,
    /// Stateful dataloader states and pickled samplers, by index.
    pub data: Vec<(Component, Option<DataPosition>)>,
    /// `register_for_checkpointing` objects, by index.
    pub custom: Vec<Component>,
    /// Entries of the folder that are none of the above (`latest`, `zero_to_fp32.py`,
    /// `config.json`), and second copies of a model (a `Trainer` under FSDP writes both
    /// `model.safetensors` and `pytorch_model_fsdp.bin`).
    pub other: Vec<PathBuf>,
    /// The `Trainer`'s `trainer_state.json`, when the folder is a `Trainer` checkpoint.
    pub trainer: Option<trainer::TrainerState>,
    /// The `Trainer`'s `training_args.bin`: the classes it names, never read.
    pub training_args: Option<Component>,
    /// The number of ranks that saved it: the sharded models' world size, else one past the
    /// highest rank of the RNG files (a rank file named for a rank of `MAX_WORLD_SIZE` or more is
    /// a problem, not read).
    pub world_size: u64,
}

/// The save_state folder `path` names: a folder holding at least one RNG file, optimizer,
/// scheduler, sharded model or other component only accelerate writes. A DCP or ZeRO folder
/// itself is not one.
pub(crate) fn detect(path: &Path) -> Result<Option<PathBuf>> {
    if !path.is_dir() || path.join(dcp::METADATA_NAME).is_file() {
        return Ok(None);
    }
    for entry in std::fs::read_dir(path).at(path)? {
        let entry = entry.at(path)?;
        let is_dir = entry.file_type().at(path)?.is_dir();
        let name = entry.file_name();
        let Some((kind, _)) = name.to_str().and_then(|n| classify(n, is_dir)) else { continue };
        // A model file alone is just a model; a DeepSpeed tag folder alone is a ZeRO checkpoint; a
        // sharded model's index, a lone `optimizer.pt`, or what `Trainer.save_model` writes at the
        // end (the model, its config and `training_args.bin`) is not a `Trainer` checkpoint.
        if !matches!(
            kind,
            Kind::Safetensors | Kind::TorchBin | Kind::DeepSpeed | Kind::Index | Kind::Optimizer | Kind::TrainingArgs
        ) || name == "optimizer.bin"
        {
            return Ok(Some(path.to_path_buf()));
        }
    }
    Ok(None)
}

fn bad(path: &Path, rank: Option<u64>, reason: impl Into<String>) -> Error {
    Error::BadSaveState { path: path.to_path_buf(), rank, reason: reason.into() }
}

/// Opens the folder: every component, then the cross-references between them. Components that
/// cannot be read and references that do not hold are the scan's problems, each naming its file
/// and rank.
pub(crate) fn catalog(root: PathBuf) -> Result<Scan> {
    let (state, problems) = SaveState::read(&root)?;
    let format = if state.trainer.is_some() { Format::Trainer } else { Format::AccelerateState };
    let mut parts = match state.models.first() {
        Some(m) => m.checkpoint.parts_copy(format, root.clone()),
        None => Parts::new(format, root.clone(), Vec::new(), Vec::new()),
    };
    parts.world_size = Some(state.world_size);
    parts.members = crate::io::files_under(&root)?;
    parts.detail = Some(Arc::new(state));
    Ok(Scan { checkpoint: Checkpoint::new(parts)?, problems })
}

impl SaveState {
    fn read(root: &Path) -> Result<(SaveState, Vec<Error>)> {
        let mut entries: Vec<(Kind, usize, PathBuf)> = Vec::new();
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
        let mut problems = Vec::new();
        // Every value file's values are kept together: their pickles share one budget, so a
        // folder of many files cannot hold more than one large file could.
        let budget = Budget::shared(Limits::default());
        let mut state = SaveState {
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
        };
        for (kind, i, path) in entries {
            let text = path.to_string_lossy().into_owned();
            match kind {
                Kind::Safetensors | Kind::TorchBin | Kind::FsdpFull | Kind::FsdpSharded | Kind::Index => {
                    // One model per index: a second copy (the `Trainer` under FSDP saves both its
                    // own `model.safetensors` and accelerate's `pytorch_model_fsdp.bin`) is kept
                    // as a file of the folder.
                    if state.models.iter().any(|m| m.index == i) {
                        state.other.push(path);
                        continue;
                    }
                    match Checkpoint::open(&text) {
                        Ok(checkpoint) => state.models.push(Model { index: i, path, checkpoint }),
                        Err(e) => problems.push(e),
                    }
                }
                Kind::TrainerState => match trainer::read_state(&path) {
                    Ok(t) => state.trainer = Some(t),
                    Err(e) => problems.push(e),
                },
                Kind::TrainingArgs => {
                    // Named, never read: the pickle is a `TrainingArguments` object.
                    let mut one = Vec::new();
                    push_component(&mut one, component(i, &path, &[], &budget), &mut problems);
                    state.training_args = one.pop();
                }
                Kind::TrainerRng | Kind::Rng if i as u64 >= crate::MAX_WORLD_SIZE => {
                    problems.push(rank_beyond_limit(&path))
                }
                Kind::TrainerRng => match rng::read_sharing(&path, rng::Keys::TRAINER, &budget) {
                    Ok(s) => state.rng.push(Rng { rank: i as u64, path, state: s }),
                    Err(e) => problems.push(e),
                },
                Kind::DeepSpeed => {
                    if state.models.iter().any(|m| m.index == i) {
                        state.other.push(path);
                        continue;
                    }
                    let tag = path.file_name().map(|n| n.to_string_lossy().into_owned());
                    match crate::formats::deepspeed::catalog(root.to_path_buf(), tag.as_deref()) {
                        Ok(scan) => {
                            problems.extend(scan.problems);
                            state.models.push(Model { index: i, path: path.clone(), checkpoint: scan.checkpoint });
                            state.optimizers.push(Optimizer {
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
                Kind::Optimizer | Kind::OptimizerSharded => {
                    match Checkpoint::open(&text).and_then(|ck| optimizer(i, path, ck)) {
                        Ok(o) => state.optimizers.push(o),
                        Err(e) => problems.push(e),
                    }
                }
                Kind::Scheduler => {
                    push_component(&mut state.schedulers, component(i, &path, &[], &budget), &mut problems)
                }
                Kind::Scaler => {
                    let mut one = Vec::new();
                    push_component(&mut one, component(i, &path, &[], &budget), &mut problems);
                    state.scaler = one.pop();
                }
                Kind::Custom => push_component(&mut state.custom, component(i, &path, &[], &budget), &mut problems),
                Kind::DataLoader | Kind::Sampler => {
                    let classes = if kind == Kind::Sampler { SAMPLER_CLASSES } else { &[] };
                    match component(i, &path, classes, &budget) {
                        Ok(c) => {
                            // A position that cannot be read is kept as none here (the folder's
                            // models still open and merge); `resume_point` refuses it by name.
                            let pos = position(&c, kind).ok();
                            state.data.push((c, pos));
                        }
                        Err(e) => problems.push(e),
                    }
                }
                Kind::Rng => match rng::read_sharing(&path, rng::Keys::ACCELERATE, &budget) {
                    Ok(s) => state.rng.push(Rng { rank: i as u64, path, state: s }),
                    Err(e) => problems.push(e),
                },
            }
        }
        state.rng.sort_by_key(|r| r.rank);
        // Every rank read is below `MAX_WORLD_SIZE`, so this neither wraps nor exceeds it.
        state.world_size = state
            .models
            .iter()
            .filter_map(|m| m.checkpoint.world_size())
            .max()
            .unwrap_or_else(|| state.rng.last().map_or(1, |r| r.rank.saturating_add(1)));
        problems.extend(state.cross_check());
        Ok((state, problems))
    }

    /// The references between components that `load_state` relies on.
    fn cross_check(&self) -> Vec<Error> {
        let mut out = Vec::new();
        // One RNG file per rank of the world that saved the sharded models. A folder with none
        // at all is what accelerate's `save_fsdp_model`/`save_fsdp_optimizer` leave (and what
        // `load_state` tolerates, keeping the current generators); one with some is half saved.
        // The ranks missing are found from the files present, never by counting up to the
        // world size, and reported as ranges in one problem.
        let w = self.world_size;
        if let Some(p) = self.missing_rng() {
            out.push(p);
        }
        for f in self.rng.iter().filter(|f| f.rank >= w) {
            out.push(bad(
                &f.path,
                Some(f.rank),
                format!("an RNG file for rank {} but the models were saved by {w} ranks", f.rank),
            ));
        }
        for m in &self.models {
            if let Some(mw) = m.checkpoint.world_size().filter(|&mw| mw != w) {
                out.push(bad(&m.path, None, format!("saved by {mw} ranks, but another model by {w}")));
            }
        }
        for o in &self.optimizers {
            let OptimizerState::Own(ock) = &o.state else { continue };
            match self.models.iter().find(|m| m.index == o.index) {
                None => {
                    out.push(bad(&o.path, None, format!("optimizer {} has no model {} beside it", o.index, o.index)))
                }
                Some(m) => {
                    if let Err(reason) = matches_model(ock, &m.checkpoint) {
                        out.push(bad(&o.path, None, format!("does not match {}: {reason}", m.path.display())));
                    }
                }
            }
        }
        out
    }

    /// The one problem that names the ranks of the world without an RNG file, where some RNG
    /// files are there: a single rank at its file's name, several as ranges at the file that
    /// sets the world size (the model saved by that many ranks, else the highest rank's file).
    fn missing_rng(&self) -> Option<Error> {
        if self.rng.is_empty() {
            return None;
        }
        let w = self.world_size;
        // At most one gap per file present, plus one.
        let mut gaps: Vec<(u64, u64)> = Vec::new();
        let mut next = 0u64;
        for r in self.rng.iter().map(|f| f.rank).filter(|&r| r < w).chain([w]) {
            if r > next {
                gaps.push((next, r - 1));
            }
            next = next.max(r.saturating_add(1));
        }
        match gaps.as_slice() {
            [] => None,
            [(a, b)] if a == b => Some(bad(
                &self.root.join(self.rng_name(*a, w)),
                Some(*a),
                format!("missing: the folder was saved by {w} ranks and rank {a} left no RNG file"),
            )),
            _ => {
                const SHOWN: usize = 8;
                let mut list: Vec<String> = gaps
                    .iter()
                    .take(SHOWN)
                    .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
                    .collect();
                if gaps.len() > SHOWN {
                    list.push(format!("and {} more ranges", gaps.len() - SHOWN));
                }
                let list = list.join(", ");
                Some(match self.models.iter().find(|m| m.checkpoint.world_size() == Some(w)) {
                    Some(m) => bad(
                        &m.path,
                        None,
                        format!("missing: the folder was saved by {w} ranks, as this model says, and ranks {list} left no RNG file"),
                    ),
                    None => {
                        let last = self.rng.iter().rfind(|f| f.rank < w)?;
                        bad(
                            &last.path,
                            Some(last.rank),
                            format!(
                                "missing: the folder was saved by {w} ranks, as this file's name says, and ranks {list} left no RNG file"
                            ),
                        )
                    }
                })
            }
        }
    }

    /// The name of rank `rank`'s RNG file in a folder of this kind saved by `world` ranks.
    pub(crate) fn rng_name(&self, rank: u64, world: u64) -> String {
        match self.trainer {
            Some(_) => trainer::rng_name(rank, world),
            None => format!("random_states_{rank}.pkl"),
        }
    }

    /// The model of index `n`.
    pub fn model(&self, n: usize) -> Option<&Model> {
        self.models.iter().find(|m| m.index == n)
    }

    /// The optimizer of index `n`.
    pub fn optimizer(&self, n: usize) -> Option<&Optimizer> {
        self.optimizers.iter().find(|o| o.index == n)
    }

    /// Where dataloader `n` continues: the batches every rank had read from its stateful state
    /// (`_num_yielded`), else `step` (accelerate's resume recipe: the caller's own count, as
    /// passed to `skip_first_batches`); the epoch and seed from a pickled sampler, else
    /// `epoch` (default 0). A `step` that contradicts the saved position, or no position and no
    /// `step`, is refused naming the file.
    ///
    /// A position file that is there but cannot be read (its pickle names a global outside its
    /// allow-list, a value is out of range, a stateful state holds no batch count) is refused
    /// naming the file, whatever `step` and `epoch` say: it is never replaced by a default.
    pub fn resume_point(&self, n: usize, step: Option<u64>, epoch: Option<u64>) -> Result<ResumePoint> {
        if let Some(e) = self.unreadable_positions(Some(n)).into_iter().next() {
            return Err(e);
        }
        let (stateful, sampler) = (self.position_of(n, "dl_state_dict"), self.position_of(n, "sampler"));
        let batches = match (stateful.and_then(|p| p.batches_yielded), step) {
            (Some(k), None) => k,
            (Some(k), Some(s)) if k == s => k,
            (Some(k), Some(s)) => {
                let path = stateful.map_or(self.root.as_path(), |p| p.path.as_path());
                return Err(bad(
                    path,
                    None,
                    format!("saved the position ({k} batches per rank), which step {s} contradicts"),
                ));
            }
            (None, Some(s)) => s,
            (None, None) => {
                return Err(bad(
                    &self.root,
                    None,
                    format!(
                        "accelerate saved no data position for dataloader {n} (a map-style loader without \
                         `use_stateful_dataloader`); give the step, the batches each rank had read in the epoch, \
                         as accelerate's resume recipe passes to `skip_first_batches`"
                    ),
                ))
            }
        };
        let epoch = sampler.and_then(|p| p.epoch).or(epoch).unwrap_or(0);
        Ok(ResumePoint { batches, epoch, seed: sampler.and_then(|p| p.seed), world_size: self.world_size })
    }

    /// Why the stateful state at `p` gives no batch count.
    fn no_batch_count(&self, p: &DataPosition) -> Error {
        const COUNTS: [&str; 3] = ["_num_yielded", "_snapshot._snapshot_step", "_steps_since_snapshot"];
        let c = self.data.iter().map(|(c, _)| c).find(|c| c.path == p.path);
        let wrong =
            c.and_then(|c| COUNTS.iter().find_map(|k| value(c, k).filter(|v| v.as_u64().is_none()).map(|v| (k, v))));
        match wrong {
            Some((key, v)) => bad(&p.path, None, format!("`{key}` is {v}, not a batch count")),
            None => bad(
                &p.path,
                None,
                "holds no batch count (`_num_yielded`, or `_snapshot._snapshot_step` with workers); \
                 the data position is not read, and none is guessed",
            ),
        }
    }

    /// Why each data position file (of dataloader `n`, or of all) that is there cannot be read:
    /// its pickle names a global outside its allow-list, a value is out of range, or a stateful
    /// state holds no batch count. `verify` reports these, and `reshard` and
    /// [`SaveState::resume_point`] refuse them.
    pub(crate) fn unreadable_positions(&self, n: Option<usize>) -> Vec<Error> {
        self.data
            .iter()
            .filter(|(c, _)| n.is_none_or(|n| c.index == n))
            .filter_map(|(c, p)| match p {
                None => {
                    let kind = c.path.file_name().and_then(|f| classify(&f.to_string_lossy(), false));
                    position(c, kind.map_or(Kind::DataLoader, |(k, _)| k)).err()
                }
                Some(p) if p.kind == "dl_state_dict" && p.batches_yielded.is_none() => Some(self.no_batch_count(p)),
                Some(_) => None,
            })
            .collect()
    }

    /// The data position of dataloader `n`: its stateful state, else its pickled sampler.
    pub fn data_position(&self, n: usize) -> Option<&DataPosition> {
        self.position_of(n, "dl_state_dict").or_else(|| self.position_of(n, "sampler"))
    }

    /// Dataloader `n`'s position from the file of `kind` (`dl_state_dict` or `sampler`).
    fn position_of(&self, n: usize, kind: &str) -> Option<&DataPosition> {
        self.data.iter().filter(|(c, _)| c.index == n).find_map(|(_, p)| p.as_ref().filter(|p| p.kind == kind))
    }
}

impl Checkpoint {
    /// The components of an accelerate `save_state` folder, when this is one.
    pub fn save_state(&self) -> Option<&SaveState> {
        self.detail::<SaveState>()
    }
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

fn value<'a>(c: &'a Component, name: &str) -> Option<&'a serde_json::Value> {
    c.values.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// torchdata's `StatefulDataLoader.state_dict()`: flat with no workers, under `_snapshot` with.
fn loader_position(c: &Component) -> DataPosition {
    let u = |n: &str| value(c, n).and_then(serde_json::Value::as_u64);
    let (batches, workers) = match u("_num_yielded") {
        Some(n) => (Some(n), Some(0)),
        None => (
            u("_snapshot._snapshot_step").map(|s| s + u("_steps_since_snapshot").unwrap_or(0)),
            u("_snapshot._main_snapshot._num_workers"),
        ),
    };
    let samples = [
        "_index_sampler_state.samples_yielded",
        "_sampler_iter_state.samples_yielded",
        "_snapshot._main_snapshot._index_sampler_state.samples_yielded",
    ]
    .iter()
    .find_map(|n| u(n));
    DataPosition {
        path: c.path.clone(),
        kind: "dl_state_dict",
        batches_yielded: batches,
        samples_yielded: samples,
        finished: value(c, "_iterator_finished").and_then(serde_json::Value::as_bool),
        num_workers: workers,
        ..DataPosition::default()
    }
}

/// The data position the file `c` of `kind` saved: refused by name where its pickle names a
/// global outside its allow-list, or where a value it needs is out of range.
fn position(c: &Component, kind: Kind) -> Result<DataPosition> {
    if let Some(global) = &c.refused {
        return Err(bad(
            &c.path,
            None,
            format!(
                "its pickle names `{global}`, outside what this kind of file may hold; \
                 the data position is not read, and none is guessed"
            ),
        ));
    }
    match kind {
        Kind::Sampler => sampler_position(c),
        _ => Ok(loader_position(c)),
    }
}

/// A pickled `SeedableRandomSampler`: its epoch and seed (`set_epoch` reseeds with their sum),
/// both required, the epoch a count from 0 and the seed a 64-bit signed integer.
fn sampler_position(c: &Component) -> Result<DataPosition> {
    let field = |name: &str, what: &str, ok: fn(&serde_json::Value) -> bool| -> Result<&serde_json::Value> {
        match value(c, name) {
            None => {
                Err(bad(&c.path, None, format!("has no `{name}`; the data position is not read, and none is guessed")))
            }
            Some(v) if !ok(v) => Err(bad(&c.path, None, format!("`{name}` is {v}, not {what}"))),
            Some(v) => Ok(v),
        }
    };
    let epoch = field("state.epoch", "an epoch (a count from 0)", |v| v.as_u64().is_some())?.as_u64();
    let seed = field("state.initial_seed", "a seed (a 64-bit signed integer)", |v| v.as_i64().is_some())?.as_i64();
    Ok(DataPosition { path: c.path.clone(), kind: "sampler", epoch, seed, ..DataPosition::default() })
}

/// An RNG file whose name gives a rank no world this library reads has: refused without reading
/// it, before the rank sizes anything.
fn rank_beyond_limit(path: &Path) -> Error {
    bad(
        path,
        None,
        format!(
            "the rank in this name is not below the world-size limit ({} ranks); the file is not read",
            crate::MAX_WORLD_SIZE
        ),
    )
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

/// Whether an optimizer's state fits its model: for a DCP optimizer every parameter it names is
/// a model tensor of the same shape; for a torch file, whose state is keyed by position in
/// `model.parameters()`, the parameters' shapes appear in the model's state dict in order (its
/// buffers, which have no optimizer state, in between).
fn matches_model(optim: &Checkpoint, model: &Checkpoint) -> std::result::Result<(), String> {
    let shape_of = |name: &str| model.tensors().iter().find(|t| t.name == name).map(|t| &t.shape);
    // The state tensors shaped like their parameter, by parameter key, in file order.
    let mut keyed: Vec<(&str, &Vec<u64>)> = Vec::new();
    for t in optim.tensors() {
        let Some(rest) = t.name.strip_prefix("state.") else { continue };
        let Some((key, _)) = rest.rsplit_once('.') else { continue };
        if t.shape.is_empty() {
            continue;
        }
        match keyed.iter().find(|(k, _)| *k == key) {
            Some((_, s)) if *s != &t.shape => return Err(format!("the states of parameter `{key}` differ in shape")),
            Some(_) => {}
            None => keyed.push((key, &t.shape)),
        }
    }
    let positional = keyed.iter().all(|(k, _)| k.bytes().all(|b| b.is_ascii_digit()));
    if !positional {
        for (key, shape) in &keyed {
            match shape_of(key) {
                None => return Err(format!("it has state for `{key}`, which the model does not have")),
                Some(s) if s != *shape => {
                    return Err(format!("`{key}` is {s:?} in the model but its optimizer state is {shape:?}"))
                }
                Some(_) => {}
            }
        }
        return Ok(());
    }
    // Positions cannot be named without the module tree, and safetensors files keep tensors
    // sorted by name, not in `parameters()` order: each shape must have at least as many model
    // tensors as parameters with state.
    keyed.sort_by_key(|(k, _)| k.parse::<u64>().unwrap_or(u64::MAX));
    for (key, shape) in &keyed {
        let need = keyed.iter().filter(|(_, s)| s == shape).count();
        let have = model.tensors().iter().filter(|t| &t.shape == *shape).count();
        if have < need {
            return Err(format!(
                "{need} parameter(s) with state are shaped {shape:?} (parameter {key} among them) but the model has {have} such tensor(s)"
            ));
        }
    }
    let listed: usize = optim
        .values()
        .iter()
        .filter(|(k, _)| *k == "param_groups")
        .filter_map(|(_, v)| {
            v.as_array().map(|gs| gs.iter().filter_map(|g| g.get("params")?.as_array().map(Vec::len)).sum::<usize>())
        })
        .sum();
    if listed > model.tensors().len() {
        return Err(format!("its groups list {listed} parameters; the model has {} tensors", model.tensors().len()));
    }
    Ok(())
}

/// Writes the stateful dataloader state `src`, saved by `from` ranks, for `to` ranks at `dst`
/// (a new file). Every rank had read `k` batches, `from·k` in all; on `to` ranks that is
/// `⌊from·k/to⌋` each (accelerate's `BatchSamplerShard` deals whole rounds of batches, so the
/// remainder of a round is read again). Only the main-process form is moved: the multi-worker
/// form's per-worker snapshots describe the old round-robin.
pub(crate) fn write_loader_state(src: &Path, dst: &Path, from: u64, to: u64) -> Result<()> {
    let f = torch::read_with_classes(src, &[])?;
    if from == to {
        return crate::write::copy_durable(src, dst);
    }
    if let Some(t) = f.tensors.first() {
        return Err(bad(
            src,
            None,
            format!(
                "holds the tensor `{}` (a stateful sampler's own state), which cannot be moved to another world size",
                t.name
            ),
        ));
    }
    let yielded = |name: &str| f.leaves.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let Some(Leaf::Int(k)) = yielded("_num_yielded") else {
        return Err(bad(
            src,
            None,
            "is a multi-worker (`num_workers > 0`) or unknown dataloader state; only the main-process form moves to another world size",
        ));
    };
    let k = u64::try_from(k).map_err(|_| bad(src, None, "`_num_yielded` is negative"))?;
    let moved = i64::try_from(u128::from(from) * u128::from(k) / u128::from(to)).unwrap_or(i64::MAX);
    let mut root: Vec<(String, Leaf)> = Vec::new();
    for (name, leaf) in &f.leaves {
        let leaf = match name.as_str() {
            "_num_yielded" | "_sampler_iter_yielded" => Leaf::Int(moved),
            _ => leaf.clone(),
        };
        insert(&mut root, name, leaf);
    }
    let layout = crate::formats::torch::writer::layout_value(
        &crate::formats::torch::writer::archive_name(dst),
        &Leaf::Dict(root),
        dst,
    )?;
    let file = crate::write::create_new(dst)?;
    file.set_len(layout.file_len).at(dst)?;
    layout.write_fixed_at(&file, dst, 0)?;
    layout.finish_at(&file, dst, 0)?;
    file.sync_all().at(dst)
}

/// Puts `leaf` at the dotted `name` of a nested dict (the inverse of flattening string keys).
fn insert(into: &mut Vec<(String, Leaf)>, name: &str, leaf: Leaf) {
    match name.split_once('.') {
        None => into.push((name.to_string(), leaf)),
        Some((head, rest)) => {
            if !into.iter().any(|(k, _)| k == head) {
                into.push((head.to_string(), Leaf::Dict(Vec::new())));
            }
            if let Some((_, Leaf::Dict(d))) = into.iter_mut().find(|(k, _)| k == head) {
                insert(d, rest, leaf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_accelerates_numbering() {
        assert_eq!(classify("model.safetensors", false), Some((Kind::Safetensors, 0)));
        assert_eq!(classify("model_1.safetensors", false), Some((Kind::Safetensors, 1)));
        assert_eq!(classify("model_0.safetensors", false), None, "the first model has no index");
        assert_eq!(classify("model_01.safetensors", false), None);
        assert_eq!(classify("pytorch_model_fsdp_0", true), Some((Kind::FsdpSharded, 0)));
        assert_eq!(classify("pytorch_model_fsdp.bin", false), Some((Kind::FsdpFull, 0)));
        assert_eq!(classify("pytorch_model_2.bin", false), Some((Kind::TorchBin, 2)));
        assert_eq!(classify("pytorch_model", true), Some((Kind::DeepSpeed, 0)));
        assert_eq!(classify("pytorch_model_1", true), Some((Kind::DeepSpeed, 1)));
        assert_eq!(classify("optimizer_0", true), Some((Kind::OptimizerSharded, 0)));
        assert_eq!(classify("optimizer_1.bin", false), Some((Kind::Optimizer, 1)));
        assert_eq!(classify("random_states_12.pkl", false), Some((Kind::Rng, 12)));
        // A rank past `usize` is a rank file all the same (refused for its rank), not a stray file.
        assert_eq!(classify("random_states_18446744073709551616.pkl", false), Some((Kind::Rng, usize::MAX)));
        assert_eq!(classify("rng_state_99999999999999999999.pth", false), Some((Kind::TrainerRng, usize::MAX)));
        assert_eq!(classify("random_states_01.pkl", false), None);
        assert_eq!(classify("custom_checkpoint_0.pkl", false), Some((Kind::Custom, 0)));
        assert_eq!(classify("dl_state_dict_1.bin", false), Some((Kind::DataLoader, 1)));
        assert_eq!(classify("scaler.pt", false), Some((Kind::Scaler, 0)));
        assert_eq!(classify("scaler_1.pt", false), None);
        assert_eq!(classify("latest", false), None);
    }
}
