//! transformers' `Trainer` checkpoint folders (`checkpoint-N/`, transformers 4.x and 5.x).
//!
//! The `Trainer` saves through accelerate, so its folder is read as a `save_state` folder
//! (see the parent module), with the `Trainer`'s own names beside accelerate's:
//! - the model as `save_pretrained` writes it: `model.safetensors` (or sharded with
//!   `model.safetensors.index.json`, or `pytorch_model.bin`), with `config.json` and
//!   `generation_config.json`; under FSDP also accelerate's `pytorch_model_fsdp_0/` (sharded) or
//!   `pytorch_model_fsdp.bin` (full state dict), under DeepSpeed the engine's tag folder
//!   `global_stepN/` beside `latest` (with the optimizer inside);
//! - `optimizer.pt` (or FSDP's `optimizer.bin` / `optimizer_0/`), `scheduler.pt`, `scaler.pt`;
//! - `rng_state.pth` (one process) or `rng_state_{rank}.pth`: the Python, numpy, CPU and
//!   accelerator generators (read as data, numpy's array decoded, never called);
//! - `trainer_state.json`: `global_step` (optimizer steps), `epoch` (fractional), `max_steps`,
//!   `train_batch_size`, `log_history` and the rest of `TrainerState`;
//! - `training_args.bin`: a pickled `TrainingArguments`, which names the class: it is listed with
//!   the class and never read.
//!
//! On resume the `Trainer` skips, in the epoch it resumes in, `global_step mod
//! steps_per_epoch` optimizer steps' worth of batches, `gradient_accumulation_steps` batches
//! each, where `steps_per_epoch = max(ceil(batches_per_epoch / gradient_accumulation_steps), 1)`
//! and the epoch is `global_step div steps_per_epoch` ([`TrainerState::resume_point`]).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The `Trainer`'s state file.
pub(crate) const STATE_NAME: &str = "trainer_state.json";
/// The pickled `TrainingArguments`.
pub(crate) const ARGS_NAME: &str = "training_args.bin";
/// The largest `trainer_state.json` read: its `log_history` grows with the run, a few hundred
/// bytes per logged step.
const MAX_STATE_LEN: u64 = 256 << 20;

/// What `trainer_state.json` says.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TrainerState {
    /// The file.
    pub path: PathBuf,
    /// Optimizer steps taken.
    pub global_step: u64,
    /// The epoch reached, fractional.
    pub epoch: Option<f64>,
    /// The run's planned steps.
    pub max_steps: Option<u64>,
    /// Samples per step on one device (`per_device_train_batch_size` times the devices of one
    /// process).
    pub train_batch_size: Option<u64>,
    /// The run's planned epochs.
    pub num_train_epochs: Option<u64>,
    /// Entries of `log_history`.
    pub log_entries: usize,
    /// The last entry of `log_history` (the latest loss, learning rate, ...).
    pub last_log: Option<serde_json::Value>,
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::BadSaveState { path: path.to_path_buf(), rank: None, reason: reason.into() }
}

/// Reads `trainer_state.json` (capped, regular files only).
pub(crate) fn read_state(path: &Path) -> Result<TrainerState> {
    let data = crate::read::io::read_capped(path, MAX_STATE_LEN)?;
    let json: serde_json::Value = serde_json::from_slice(&data).map_err(|e| bad(path, format!("is not JSON: {e}")))?;
    let Some(obj) = json.as_object() else { return Err(bad(path, "is not a JSON object")) };
    let count = |key: &str| -> Result<Option<u64>> {
        match obj.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| bad(path, format!("`{key}` is {v}, not a step count"))),
        }
    };
    let global_step = count("global_step")?.ok_or_else(|| bad(path, "has no `global_step`"))?;
    let epoch = match obj.get("epoch") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(
            v.as_f64().filter(|e| e.is_finite() && *e >= 0.0).ok_or_else(|| bad(path, format!("`epoch` is {v}")))?,
        ),
    };
    let log = obj.get("log_history").and_then(serde_json::Value::as_array);
    Ok(TrainerState {
        path: path.to_path_buf(),
        global_step,
        epoch,
        max_steps: count("max_steps")?,
        train_batch_size: count("train_batch_size")?,
        num_train_epochs: count("num_train_epochs")?,
        log_entries: log.map_or(0, Vec::len),
        last_log: log.and_then(|l| l.last()).cloned(),
    })
}

/// The `Trainer`'s name for rank `rank`'s RNG file in a world of `world` processes.
pub(crate) fn rng_name(rank: u64, world: u64) -> String {
    if world > 1 {
        format!("rng_state_{rank}.pth")
    } else {
        "rng_state.pth".to_string()
    }
}

/// Where the `Trainer` continues in its data stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TrainerResume {
    /// The epoch it resumes in.
    pub epoch: u64,
    /// Batches of that epoch each rank skips.
    pub batches: u64,
}

impl TrainerState {
    /// Where a `Trainer` resuming from this state continues, for a loader of
    /// `batches_per_epoch` batches per rank and `gradient_accumulation_steps` batches per
    /// optimizer step (transformers' `_init_training_state`).
    pub fn resume_point(&self, batches_per_epoch: u64, gradient_accumulation_steps: u64) -> Result<TrainerResume> {
        if gradient_accumulation_steps == 0 {
            return Err(bad(&self.path, "`gradient_accumulation_steps` must be at least 1"));
        }
        let steps_per_epoch = batches_per_epoch.div_ceil(gradient_accumulation_steps).max(1);
        let batches = (self.global_step % steps_per_epoch)
            .checked_mul(gradient_accumulation_steps)
            .ok_or_else(|| bad(&self.path, "`global_step` times `gradient_accumulation_steps` overflows"))?;
        Ok(TrainerResume { epoch: self.global_step / steps_per_epoch, batches })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(global_step: u64) -> TrainerState {
        TrainerState {
            path: PathBuf::from("trainer_state.json"),
            global_step,
            epoch: None,
            max_steps: None,
            train_batch_size: None,
            num_train_epochs: None,
            log_entries: 0,
            last_log: None,
        }
    }

    #[test]
    fn resume_skips_whole_steps_of_accumulated_batches() {
        // 10 batches an epoch, 3 per step: 4 steps an epoch (the last of one batch).
        let r = state(6).resume_point(10, 3).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r, TrainerResume { epoch: 1, batches: 6 });
        assert_eq!(state(4).resume_point(10, 3).ok(), Some(TrainerResume { epoch: 1, batches: 0 }));
        assert_eq!(state(5).resume_point(0, 1).ok(), Some(TrainerResume { epoch: 5, batches: 0 }));
        assert!(state(1).resume_point(10, 0).is_err());
        assert_eq!(rng_name(0, 1), "rng_state.pth");
        assert_eq!(rng_name(2, 3), "rng_state_2.pth");
    }
}
