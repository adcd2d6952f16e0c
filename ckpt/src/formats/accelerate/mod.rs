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

mod check;
mod names;
mod position;
mod produce;
mod read;
pub(crate) mod rng;
pub(crate) mod trainer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, IoContext, Result};
use crate::formats::dcp;
use crate::ops::outcome::Outcome;
use crate::ops::request::{Merge, MergeOptions};
use crate::read::catalog::{Checkpoint, Format, Parts, Scan};
use crate::write::WriteOptions;
use names::{classify, Kind};
use rng::RngState;

pub(crate) use position::write_loader_state;

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
    parts.members = crate::read::io::files_under(&root)?;
    parts.detail = Some(Arc::new(state));
    Ok(Scan { checkpoint: Checkpoint::new(parts)?, problems })
}

/// accelerate's `save_state` folders and `Trainer` folders: a merge is one of its models (and
/// its optimizer) merged as that model's own format merges it; a reshard rewrites the whole
/// folder for another world size ([`produce`]).
pub(crate) struct AccelerateFormat;

impl super::FormatOps for AccelerateFormat {
    fn catalog(&self, _: Format, root: PathBuf, _: &crate::OpenOptions) -> Result<Scan> {
        catalog(root)
    }

    fn merge<'a>(&self, ck: &'a Checkpoint, _: &Path, options: &MergeOptions) -> Result<Merge<'a>> {
        match ck.save_state() {
            Some(state) => produce::merge(state, options),
            None => super::merge_as_stored(self, ck, options),
        }
    }

    fn reshard(&self, ck: &Checkpoint, out: &Path, world: u64, opts: &WriteOptions<'_>) -> Result<Outcome> {
        match ck.save_state() {
            Some(state) => produce::reshard(state, out, world, opts),
            None => Err(Error::NotReshardable { path: ck.root.clone() }),
        }
    }
}

impl SaveState {
    /// The model of index `n`.
    pub fn model(&self, n: usize) -> Option<&Model> {
        self.models.iter().find(|m| m.index == n)
    }

    /// The optimizer of index `n`.
    pub fn optimizer(&self, n: usize) -> Option<&Optimizer> {
        self.optimizers.iter().find(|o| o.index == n)
    }
}

impl Checkpoint {
    /// The components of an accelerate `save_state` folder, when this is one.
    pub fn save_state(&self) -> Option<&SaveState> {
        self.detail::<SaveState>()
    }
}
