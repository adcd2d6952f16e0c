//! The names in a `save_state` folder: each entry is a kind of file (or folder) and an index,
//! `stem[_i]ext` where accelerate numbers from the second object (`model.safetensors`,
//! `model_1.safetensors`), `stem_i` where the index is always written (`optimizer_0/`,
//! `custom_checkpoint_0.pkl`), and `stem_R ext` for the one file per rank (`random_states_3.pkl`,
//! the `Trainer`'s `rng_state_3.pth`).

use super::trainer;

/// What an index-numbered file of the folder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
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
/// file, refused for its rank (see [`super::read::rank_beyond_limit`]), not a stray file copied along.
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
pub(super) fn priority(kind: Kind) -> u8 {
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
pub(super) fn classify(name: &str, is_dir: bool) -> Option<(Kind, usize)> {
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
