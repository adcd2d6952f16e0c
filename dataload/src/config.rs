//! accelerate's `DataLoaderConfiguration` (accelerate 1.15), field for field, and what
//! `prepare_data_loader` makes of it.
//!
//! accelerate's class is a plain dataclass that validates nothing; its defaults are filled in
//! and its refusals happen later, in `prepare_data_loader` and in the sharding classes
//! (`BatchSamplerShard`, `IterableDatasetShard`, torch's `DataLoader` given the per-rank batch
//! size). [`DataLoaderConfiguration::resolve`] does all of it in one place, for every edge (the
//! Rust loader, the Python loaders, the CLI), so an invalid setup is refused before any batch is
//! produced and no edge keeps its own copy of a rule:
//!
//! * `dispatch_batches = None` becomes `put_on_device && dataset is iterable`;
//! * `dispatch_batches = true` with `put_on_device = false` is refused;
//! * the rank must lie in the world;
//! * `split_batches` needs a batch size that is a round multiple of the number of processes.
//!   `prepare_data_loader` lets a batch size of 1 through; `BatchSamplerShard` (non-dispatched
//!   map-style loaders) and torch's `DataLoader` (non-dispatched iterable loaders, whose
//!   per-rank batch size would be 0) then refuse it anyway; only dispatching accepts it;
//! * `split_batches` when the loader has no fixed batch size is refused;
//! * an unbatched iterable loader cannot be sharded per rank on more than one rank
//!   (accelerate's `IterableDatasetShard` fails on it at the first batch).
//!
//! The result, a [`ResolvedLoader`], says how the loader shards and the batch size each
//! rank's loader is built with (the batch size over the ranks with `split_batches` per rank).
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
    /// Batch size of the underlying batch sampler; `None` for an unbatched loader or varying
    /// batch sizes.
    pub batch_size: Option<usize>,
    /// Number of ranks.
    pub world_size: usize,
    /// This process's rank.
    pub rank: usize,
    /// accelerate's `put_on_device` (`device_placement`, true by default).
    pub put_on_device: bool,
}

/// A configuration resolved for one loader: accelerate's defaults filled in, its checks
/// passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedLoader {
    /// Per-rank sharding or dispatching (`dispatch_batches` with its default applied).
    pub mode: ShardMode,
    /// accelerate's `split_batches`.
    pub split_batches: bool,
    /// accelerate's `even_batches`; accelerate's dispatcher ignores it (its last step is
    /// always padded), so it is `false` when dispatching.
    pub even_batches: bool,
    /// The batch size the rank's own loader is built with: the batch size divided by the
    /// ranks with `split_batches` and per-rank sharding (accelerate's `IterableDatasetShard`
    /// and `BatchSamplerShard` give each rank its slice of one underlying batch), else the
    /// batch size (a dispatcher's rank 0 reads whole batches). `None` where the loader has none.
    pub loader_batch_size: Option<usize>,
    /// Samples of the global order one step consumes: the batch size with `split_batches`,
    /// else the batch size times the ranks. `None` where the loader has no batch size.
    pub global_batch_size: Option<usize>,
}

impl ResolvedLoader {
    /// Whether rank 0 reads and the others get their slice (`DataLoaderDispatcher`).
    pub fn dispatches(&self) -> bool {
        self.mode == ShardMode::Dispatch
    }
}

impl DataLoaderConfiguration {
    /// Applies accelerate's `prepare_data_loader` defaults and refusals (see the module docs).
    pub fn resolve(&self, shape: LoaderShape) -> Result<ResolvedLoader> {
        if let Some(seed) = self.data_seed {
            check_seed(seed)?;
        }
        if shape.rank >= shape.world_size {
            return Err(DataloadError::RankOutOfRange { rank: shape.rank, world_size: shape.world_size });
        }
        let dispatch = match self.dispatch_batches {
            Some(d) => d,
            None => shape.put_on_device && shape.dataset == DatasetKind::Iterable,
        };
        if dispatch && !shape.put_on_device {
            return Err(DataloadError::DispatchWithoutDevicePlacement);
        }
        let w = shape.world_size;
        if self.split_batches {
            let bs = shape.batch_size.ok_or(DataloadError::SplitNeedsBatchSize)?;
            // `prepare_data_loader` exempts a batch size of 1, but only dispatching survives
            // it: `BatchSamplerShard` refuses it, and an iterable per-rank loader would get a
            // per-rank batch size of 0, which torch's `DataLoader` refuses.
            if bs % w != 0 && (bs > 1 || !dispatch) {
                return Err(DataloadError::SplitNotDivisible { batch_size: bs, world_size: w });
            }
        }
        if shape.dataset == DatasetKind::Iterable && !dispatch && w > 1 && shape.batch_size.is_none() {
            return Err(DataloadError::ShardNeedsBatchSize { world_size: w });
        }
        let split = self.split_batches;
        let loader_batch_size = shape.batch_size.map(|bs| if split && !dispatch { bs / w } else { bs });
        let global_batch_size = shape.batch_size.map(|bs| {
            let g = fsdp_state::stream::global_batch(bs as u64, w as u64, split);
            usize::try_from(g).unwrap_or(usize::MAX)
        });
        Ok(ResolvedLoader {
            mode: if dispatch { ShardMode::Dispatch } else { ShardMode::PerRank },
            split_batches: split,
            even_batches: self.even_batches && !dispatch,
            loader_batch_size,
            global_batch_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(split: bool, dispatch: Option<bool>) -> DataLoaderConfiguration {
        DataLoaderConfiguration {
            split_batches: split,
            dispatch_batches: dispatch,
            ..DataLoaderConfiguration::default()
        }
    }

    fn shape(
        dataset: DatasetKind,
        batch_size: Option<usize>,
        world_size: usize,
        rank: usize,
        put: bool,
    ) -> LoaderShape {
        LoaderShape { dataset, batch_size, world_size, rank, put_on_device: put }
    }

    use DatasetKind::{Iterable, Map};

    /// (split, dispatch, dataset, batch size, world, rank, put_on_device) → (dispatches,
    /// loader batch size, global batch size) or the error, as accelerate 1.15's
    /// `prepare_data_loader` (and the classes and torch loader it builds) decide.
    #[test]
    #[allow(clippy::type_complexity)]
    fn resolves_as_accelerate_prepares() {
        let ok = |d: bool, l: Option<usize>, g: Option<usize>| Ok::<_, DataloadError>((d, l, g));
        let cases: &[(
            (bool, Option<bool>, DatasetKind, Option<usize>, usize, usize, bool),
            Result<_, DataloadError>,
        )] = &[
            // dispatch_batches = None: dispatch iterable datasets placed on a device
            ((false, None, Map, Some(4), 2, 1, true), ok(false, Some(4), Some(8))),
            ((false, None, Iterable, Some(4), 2, 1, true), ok(true, Some(4), Some(8))),
            ((false, None, Iterable, Some(4), 2, 1, false), ok(false, Some(4), Some(8))),
            ((false, Some(true), Map, Some(4), 2, 0, false), Err(DataloadError::DispatchWithoutDevicePlacement)),
            ((false, Some(true), Map, Some(4), 2, 0, true), ok(true, Some(4), Some(8))),
            // split: each rank's loader gets its slice of one batch, a dispatcher whole batches
            ((true, Some(false), Iterable, Some(4), 2, 0, false), ok(false, Some(2), Some(4))),
            ((true, Some(true), Iterable, Some(4), 2, 0, true), ok(true, Some(4), Some(4))),
            ((true, Some(false), Map, Some(6), 3, 2, false), ok(false, Some(2), Some(6))),
            (
                (true, Some(false), Iterable, Some(3), 2, 0, false),
                Err(DataloadError::SplitNotDivisible { batch_size: 3, world_size: 2 }),
            ),
            // a batch size of 1: accelerate lets it through, only its dispatcher survives it
            ((true, Some(true), Map, Some(1), 2, 0, true), ok(true, Some(1), Some(1))),
            (
                (true, Some(false), Map, Some(1), 2, 0, false),
                Err(DataloadError::SplitNotDivisible { batch_size: 1, world_size: 2 }),
            ),
            ((true, Some(false), Iterable, None, 2, 0, false), Err(DataloadError::SplitNeedsBatchSize)),
            // unbatched: read as it comes by one rank or a dispatcher, never sharded per rank
            ((false, Some(false), Iterable, None, 1, 0, false), ok(false, None, None)),
            ((false, Some(true), Iterable, None, 2, 1, true), ok(true, None, None)),
            (
                (false, Some(false), Iterable, None, 2, 1, false),
                Err(DataloadError::ShardNeedsBatchSize { world_size: 2 }),
            ),
            ((false, Some(false), Map, None, 2, 1, false), ok(false, None, None)),
            // the rank lies in the world
            (
                (false, Some(false), Map, Some(4), 2, 2, false),
                Err(DataloadError::RankOutOfRange { rank: 2, world_size: 2 }),
            ),
            (
                (false, Some(false), Map, Some(4), 0, 0, false),
                Err(DataloadError::RankOutOfRange { rank: 0, world_size: 0 }),
            ),
        ];
        for ((split, dispatch, dataset, bs, world, rank, put), want) in cases {
            let got = config(*split, *dispatch)
                .resolve(shape(*dataset, *bs, *world, *rank, *put))
                .map(|r| (r.dispatches(), r.loader_batch_size, r.global_batch_size));
            assert_eq!(
                &got, want,
                "split={split} dispatch={dispatch:?} {dataset:?} bs={bs:?} {rank}/{world} put={put}"
            );
        }
    }

    #[test]
    fn a_dispatcher_ignores_even_batches() {
        let even = DataLoaderConfiguration { dispatch_batches: Some(true), ..DataLoaderConfiguration::default() };
        let r = even.resolve(shape(Map, Some(2), 2, 0, true)).expect("a dispatcher of 2 ranks");
        assert!(!r.even_batches);
        let r = config(false, Some(false)).resolve(shape(Map, Some(2), 2, 0, true)).expect("per rank over 2 ranks");
        assert!(r.even_batches);
    }

    #[test]
    fn refusals_name_the_setting() {
        let e = |c: DataLoaderConfiguration, s| c.resolve(s).expect_err("refused").to_string();
        assert_eq!(
            e(config(true, Some(false)), shape(Iterable, Some(3), 2, 0, false)),
            "`split_batches` needs the batch size (3) to be a round multiple of the number of processes (2)"
        );
        assert_eq!(
            e(config(false, Some(false)), shape(Iterable, None, 2, 0, false)),
            "an unbatched loader (no `batch_size`) over an iterable dataset cannot be sharded per rank over 2 ranks; \
             dispatch its batches (`dispatch_batches = true`) or give a batch size"
        );
        assert_eq!(
            e(config(true, Some(true)), shape(Iterable, None, 2, 0, true)),
            "`split_batches` needs a fixed batch size: the loader has no batch size to split (it is unbatched, or its \
             batches vary in size)"
        );
        assert_eq!(
            e(config(false, Some(false)), shape(Map, Some(2), 2, 5, false)),
            "rank 5 is out of range for a world of 2 ranks"
        );
    }
}
