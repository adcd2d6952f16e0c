//! `statekit_state.json`, the trainer's own file in a step folder: its types, its reading and
//! its checks. Nothing here links libtorch or MPI, so the crate's fuzz target
//! (`train/fuzz`, built with `--no-default-features`) runs this same code on arbitrary bytes.
//!
//! # On disk
//!
//! One pretty-printed JSON object (unknown fields refused): `format` (`statekit.train`),
//! `version` (1), `step` (optimizer steps taken), `world_size`, `mode` (`ddp` or `sharded`),
//! `model` (the sizes), `adamw`, `schedule`, `seed`, `batch_size`, `grad_accum`, `params`
//! (name and shape of each parameter, in the optimizer's order), `loader` (`dataload`'s
//! [`dataload::LoaderState`]) and `rank_rng` (one seed per rank).
//!
//! # What is checked
//!
//! [`parse`] reads the file only if it is a regular file of at most [`MAX_STATE_LEN`] bytes
//! ([`ckpt::read_small_file`]), then refuses, by field and value, anything the trainer would
//! misuse: a step past [`MAX_STEP`] (the last one the optimizer's `f32` `step` tensors hold
//! exactly) or past the schedule's own total, a world size out of `1..=`[`ckpt::MAX_WORLD_SIZE`]
//! or not the loader's, a batch size of 0 or not the loader's, a parameter whose element count
//! overflows, and so on; only values no run of the trainer writes, so that nothing it saved is
//! refused.
//! What only the rest of the folder can confirm (its name, the optimizer's `step` tensors, the
//! rank files) is checked by `state::load`.

use std::path::Path;

use anyhow::bail;
use serde::{Deserialize, Serialize};

use crate::optim::{AdamW, Schedule};

/// Format tag of our JSON.
pub(crate) const STATE_FORMAT: &str = "statekit.train";
/// Its version.
pub(crate) const STATE_VERSION: u32 = 1;
/// Our file in a step folder.
pub(crate) const STATE_FILE: &str = "statekit_state.json";
/// The largest `statekit_state.json` read (a real one is a few KiB per hundred parameters).
pub(crate) const MAX_STATE_LEN: u64 = 16 << 20;
/// The last step a run may reach: torch's AdamW keeps each parameter's `step` as an `f32`
/// tensor, which counts exactly up to 2^24 and no further.
pub(crate) const MAX_STEP: u64 = 1 << 24;
/// The most elements a parameter (and the model) may have: far beyond what this trainer
/// holds in host memory, and small enough that no byte count derived from it overflows.
pub(crate) const MAX_ELEMENTS: u64 = 1 << 40;

/// Model sizes. (Here rather than in `model`, which links libtorch, so that the state file
/// builds without it.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ModelConfig {
    /// Tokens in the vocabulary.
    pub(crate) vocab: i64,
    /// Context length.
    pub(crate) block_size: i64,
    /// Blocks.
    pub(crate) layers: i64,
    /// Attention heads per block.
    pub(crate) heads: i64,
    /// Width of the residual stream.
    pub(crate) dim: i64,
    /// Share the token embedding with the output head.
    pub(crate) tied: bool,
}

/// One parameter's geometry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ParamMeta {
    pub(crate) name: String,
    pub(crate) shape: Vec<u64>,
}

impl ParamMeta {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }
    pub(crate) fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }
    pub(crate) fn row_len(&self) -> usize {
        self.shape.get(1..).unwrap_or_default().iter().product::<u64>() as usize
    }
    /// FSDP2's rows of rank `r` of `w`.
    pub(crate) fn chunk(&self, w: u64, r: u64) -> std::ops::Range<u64> {
        fsdp_state::chunk_rows(self.rows(), w, r).unwrap_or(0..0)
    }
    /// The element count, when it is at most [`MAX_ELEMENTS`].
    fn checked_numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= MAX_ELEMENTS)
    }
}

/// Our JSON in a step folder.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TrainState {
    pub(crate) format: String,
    pub(crate) version: u32,
    /// Optimizer steps taken.
    pub(crate) step: u64,
    pub(crate) world_size: u64,
    pub(crate) mode: String,
    pub(crate) model: ModelConfig,
    pub(crate) adamw: AdamW,
    pub(crate) schedule: Schedule,
    pub(crate) seed: i64,
    pub(crate) batch_size: u64,
    pub(crate) grad_accum: u64,
    /// Parameter names and shapes, in the optimizer's order.
    pub(crate) params: Vec<ParamMeta>,
    /// The data position (one global cursor, the same on every rank).
    pub(crate) loader: dataload::LoaderState,
    /// The random state of each rank. The model has no random layers and the data order is a
    /// function of the loader state, so there is none to keep: each entry is the seed the
    /// rank's torch generator was started from, recorded so that a change can be refused.
    pub(crate) rank_rng: Vec<i64>,
}

/// The name of the step folder of `step`: `step-0000040`.
pub(crate) fn step_dir_name(step: u64) -> String {
    format!("step-{step:07}")
}

/// The step a step folder's name gives, when it is exactly what [`step_dir_name`] writes.
pub(crate) fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step = digits.parse().ok()?;
    (step_dir_name(step) == name).then_some(step)
}

/// Reads and checks the state file at `path` on `rank`: every refusal is one line naming the
/// file, the rank, the field and its value.
pub(crate) fn parse_file(path: &Path, rank: u64) -> anyhow::Result<TrainState> {
    let bytes = ckpt::read_small_file(path, MAX_STATE_LEN).map_err(|e| anyhow::anyhow!("{e} (rank {rank})"))?;
    parse(&bytes, path, rank)
}

/// Parses and checks the bytes of a state file (named `path` in errors).
pub(crate) fn parse(bytes: &[u8], path: &Path, rank: u64) -> anyhow::Result<TrainState> {
    let at = path.display();
    // The tag first: a file of another kind or version is named as such, not by its first
    // unexpected field.
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| anyhow::anyhow!("{at}: rank {rank}: {e}"))?;
    let tag = (value.get("format").and_then(|v| v.as_str()), value.get("version").and_then(|v| v.as_u64()));
    if tag != (Some(STATE_FORMAT), Some(u64::from(STATE_VERSION))) {
        bail!("{at}: rank {rank}: not a {STATE_FORMAT} v{STATE_VERSION} state");
    }
    let state: TrainState = serde_json::from_value(value).map_err(|e| anyhow::anyhow!("{at}: rank {rank}: {e}"))?;
    if let Err(what) = state.check() {
        bail!("{at}: rank {rank}: {what}");
    }
    Ok(state)
}

impl TrainState {
    /// The checks of the module docs; the error says which field holds what.
    pub(crate) fn check(&self) -> Result<(), String> {
        let s = self;
        if s.step > MAX_STEP {
            return Err(format!(
                "`step` is {}, past {MAX_STEP}, the last step the optimizer's `f32` `step` tensors hold exactly",
                s.step
            ));
        }
        if s.step > s.schedule.total {
            return Err(format!("`step` is {}, past the schedule's `total` of {} steps", s.step, s.schedule.total));
        }
        // (Only what no run of the trainer writes is refused: a warmup longer than the run, a
        // negative rate or decay are odd flags, not a damaged file.)
        for (field, x) in [("schedule.lr", s.schedule.lr), ("schedule.min_lr", s.schedule.min_lr)] {
            if !x.is_finite() {
                return Err(format!("`{field}` is {x}, not a finite learning rate"));
            }
        }
        let a = &s.adamw;
        for (field, x) in [("adamw.beta1", a.beta1), ("adamw.beta2", a.beta2)] {
            if !(0.0..1.0).contains(&x) {
                return Err(format!("`{field}` is {x}, outside [0, 1)"));
            }
        }
        if !a.eps.is_finite() || a.eps <= 0.0 {
            return Err(format!("`adamw.eps` is {}, not a finite positive number", a.eps));
        }
        if !a.weight_decay.is_finite() {
            return Err(format!("`adamw.weight_decay` is {}, not a finite number", a.weight_decay));
        }
        if !(1..=ckpt::MAX_WORLD_SIZE).contains(&s.world_size) {
            return Err(format!("`world_size` is {}, outside 1..={}", s.world_size, ckpt::MAX_WORLD_SIZE));
        }
        if s.loader.world_size != s.world_size {
            return Err(format!(
                "`world_size` is {}, but the loader state was saved by {} ranks",
                s.world_size, s.loader.world_size
            ));
        }
        if s.rank_rng.len() as u64 != s.world_size {
            return Err(format!("`rank_rng` holds {} seeds for {} ranks", s.rank_rng.len(), s.world_size));
        }
        if s.mode != "ddp" && s.mode != "sharded" {
            return Err(format!("`mode` is `{}`, not `ddp` or `sharded`", s.mode.escape_debug()));
        }
        if !(1..=u64::from(u32::MAX)).contains(&s.batch_size) {
            return Err(format!("`batch_size` is {}, outside 1..={}", s.batch_size, u32::MAX));
        }
        if s.grad_accum > u64::from(u32::MAX) {
            return Err(format!("`grad_accum` is {}, outside 0..={}", s.grad_accum, u32::MAX));
        }
        if s.loader.batch_size != s.batch_size {
            return Err(format!("`batch_size` is {}, but the loader state's is {}", s.batch_size, s.loader.batch_size));
        }
        let m = &s.model;
        for (field, x, min) in [
            ("model.vocab", m.vocab, 1),
            ("model.block_size", m.block_size, 1),
            ("model.layers", m.layers, 0),
            ("model.heads", m.heads, 1),
            ("model.dim", m.dim, 1),
        ] {
            if !(min..=i64::from(u32::MAX)).contains(&x) {
                return Err(format!("`{field}` is {x}, outside {min}..={}", u32::MAX));
            }
        }
        if m.dim % m.heads != 0 {
            return Err(format!("`model.dim` {} does not divide into `model.heads` {}", m.dim, m.heads));
        }
        let mut names = std::collections::BTreeSet::new();
        let mut total = 0u64;
        for p in &s.params {
            let name = p.name.escape_debug();
            if p.name.is_empty() || !names.insert(p.name.as_str()) {
                return Err(format!("`params` names `{name}` twice or empty"));
            }
            let n = p
                .checked_numel()
                .ok_or_else(|| format!("`params`: `{name}` has shape {:?}, over {MAX_ELEMENTS} elements", p.shape))?;
            total = total.saturating_add(n);
        }
        if total > MAX_ELEMENTS {
            return Err(format!("`params` hold {total} elements, over {MAX_ELEMENTS}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_the_trainer_writes_are_accepted_and_edited_ones_refused_by_field() {
        let seeds = crate::fuzz::state_json_seeds();
        assert_eq!(seeds.len(), 3);
        let path = Path::new("ck/step-0000006/statekit_state.json");
        for (name, json) in &seeds {
            let state = parse(json, path, 0).unwrap_or_else(|e| panic!("{name}: {e}"));
            // Odd flags are not damage: a warmup longer than the run, a negative decay.
            let mut odd = state.clone();
            odd.schedule.warmup = odd.schedule.total + 10;
            odd.adamw.weight_decay = -0.5;
            odd.grad_accum = 0;
            assert!(odd.check().is_ok(), "{name}");
        }
        let state = parse(&seeds[1].1, path, 1).expect("seed");
        let refused = |edit: &dyn Fn(&mut TrainState)| {
            let mut s = state.clone();
            edit(&mut s);
            let json = serde_json::to_vec(&s).expect("json");
            parse(&json, path, 1).expect_err("refused").to_string()
        };
        let at = "ck/step-0000006/statekit_state.json: rank 1";
        assert_eq!(refused(&|s| s.step = 41), format!("{at}: `step` is 41, past the schedule's `total` of 40 steps"));
        assert_eq!(
            refused(&|s| s.world_size = 3),
            format!("{at}: `world_size` is 3, but the loader state was saved by 2 ranks")
        );
        assert_eq!(refused(&|s| s.rank_rng.push(1)), format!("{at}: `rank_rng` holds 3 seeds for 2 ranks"));
        assert_eq!(refused(&|s| s.mode = "zero".into()), format!("{at}: `mode` is `zero`, not `ddp` or `sharded`"));
        assert_eq!(
            refused(&|s| s.params[0].shape = vec![1 << 21, 1 << 20]),
            format!("{at}: `params`: `h.0.attn.c_attn.bias` has shape [2097152, 1048576], over 1099511627776 elements")
        );
        assert_eq!(
            refused(&|s| s.model.heads = 3),
            format!("{at}: `model.dim` 32 does not divide into `model.heads` 3")
        );
        assert_eq!(
            parse(b"{\"format\": \"other\"}", path, 1).expect_err("refused").to_string(),
            format!("{at}: not a statekit.train v1 state")
        );
    }

    #[test]
    fn step_folder_names_are_exactly_what_the_trainer_writes() {
        assert_eq!(parse_step_dir_name("step-0000040"), Some(40));
        assert_eq!(parse_step_dir_name(&step_dir_name(MAX_STEP)), Some(MAX_STEP));
        assert_eq!(parse_step_dir_name("step-18446744073709551615"), Some(u64::MAX));
        for bad in ["step-40", "step-00000040", "step-+000040", "step-000004a", "step-", "latest", "../step-0000040"] {
            assert_eq!(parse_step_dir_name(bad), None, "{bad}");
        }
    }
}
