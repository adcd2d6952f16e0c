//! accelerate's `DataLoaderConfiguration` (accelerate 1.15), field for field.
//!
//! accelerate's class is a plain dataclass that validates nothing; its refusals happen later,
//! in `prepare_data_loader` and in the sharding classes. [`DataLoaderConfiguration::resolve`]
//! gathers those refusals in one place so an invalid setup is refused before any batch is
//! produced:
//!
//! * `dispatch_batches = true` with `put_on_device = false`;
//! * `split_batches` with a batch size that is not a round multiple of the number of
//!   processes. `prepare_data_loader` lets a batch size of 1 through; `BatchSamplerShard`
//!   (non-dispatched map-style loaders) and torch's `DataLoader` (non-dispatched iterable
//!   loaders, whose per-rank batch size would be 0) then refuse it anyway; only dispatching
//!   accepts it;
//! * `split_batches` when the batch sampler has no fixed batch size.
//!
//! `use_stateful_dataloader` and `non_blocking` are carried for fidelity (they are saved in the
//! state and compared on load) but change no index: every loader here is stateful, and device
//! copies are not this crate's business.

use serde::{Deserialize, Serialize};

use crate::error::{DataloadError, Result};
use crate::sampler::check_seed;

/// accelerate's `DataLoaderConfiguration`. `Default` gives accelerate's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataLoaderConfiguration {
    /// Split each batch of the underlying sampler across the ranks (global batch = batch size)
    /// instead of giving each rank whole batches (global batch = batch size × ranks).
    pub split_batches: bool,
    /// Rank 0 reads each global batch and broadcasts it. `None`: decided by the dataset kind.
    pub dispatch_batches: Option<bool>,
    /// Complete the last round with samples from the start of the epoch, so every rank gets
    /// the same number of full batches.
    pub even_batches: bool,
    /// Replace torch's `RandomSampler` by accelerate's `SeedableRandomSampler`.
    pub use_seedable_sampler: bool,
    /// Seed of the seedable sampler; `None` means `torch.initial_seed()`.
    #[serde(with = "crate::sampler::seed_serde::option")]
    pub data_seed: Option<i128>,
    /// Non-blocking host-to-device copies (no effect on indices).
    pub non_blocking: bool,
    /// Back the loader by torchdata's `StatefulDataLoader` (no effect on indices here).
    pub use_stateful_dataloader: bool,
}

impl Default for DataLoaderConfiguration {
    fn default() -> Self {
        Self {
            split_batches: false,
            dispatch_batches: None,
            even_batches: true,
            use_seedable_sampler: false,
            data_seed: None,
            non_blocking: false,
            use_stateful_dataloader: false,
        }
    }
}

/// Whether the dataset is indexable (`Dataset`) or a stream (`IterableDataset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetKind {
    /// Map-style: indexable, with a length.
    Map,
    /// Iterable: a stream.
    Iterable,
}

/// How the loader shards, once accelerate's defaults are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardMode {
    /// Every rank reads its own batches (`BatchSamplerShard` / `IterableDatasetShard`).
    PerRank,
    /// Rank 0 reads and broadcasts (`DataLoaderDispatcher`).
    Dispatch,
}

/// What [`DataLoaderConfiguration::resolve`] needs to know about the loader it configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderShape {
    /// Dataset kind.
    pub dataset: DatasetKind,
    /// Batch size of the underlying batch sampler; `None` for varying batch sizes.
    pub batch_size: Option<usize>,
    /// Number of ranks.
    pub world_size: usize,
    /// accelerate's `put_on_device` (`device_placement`, true by default).
    pub put_on_device: bool,
}

impl DataLoaderConfiguration {
    /// Applies accelerate's `prepare_data_loader` defaults and refusals.
    pub fn resolve(&self, shape: LoaderShape) -> Result<ShardMode> {
        if let Some(seed) = self.data_seed {
            check_seed(seed)?;
        }
        let dispatch = match self.dispatch_batches {
            Some(d) => d,
            None => shape.put_on_device && shape.dataset == DatasetKind::Iterable,
        };
        if dispatch && !shape.put_on_device {
            return Err(DataloadError::DispatchWithoutDevicePlacement);
        }
        if self.split_batches {
            let bs = shape.batch_size.ok_or(DataloadError::SplitNeedsBatchSize)?;
            let w = shape.world_size.max(1);
            // `prepare_data_loader` exempts a batch size of 1, but only dispatching survives
            // it: `BatchSamplerShard` refuses it, and an iterable per-rank loader would get a
            // per-rank batch size of 0, which torch's `DataLoader` refuses.
            if bs % w != 0 && (bs > 1 || !dispatch) {
                return Err(DataloadError::SplitNotDivisible { batch_size: bs, world_size: shape.world_size });
            }
        }
        Ok(if dispatch { ShardMode::Dispatch } else { ShardMode::PerRank })
    }
}
