//! Rank-sharded, resumable, seedable data loading: the index side.
//!
//! This crate reproduces what a data-parallel run gets from Hugging Face accelerate
//! (1.15) on top of torch (2.13) — which rank reads which sample at which step — and makes
//! it resumable in O(1) and across world sizes.
//!
//! # Exact accelerate semantics
//!
//! * [`TorchGenerator`] is torch's CPU MT19937 and [`randperm`] is `torch.randperm` on the
//!   CPU, both algorithms and the switch between them ([`RandpermAlgorithm::for_len`]).
//! * [`SequentialSampler`] and [`SeedableRandomSampler`] order an epoch; the seedable sampler
//!   draws `randperm(n, manual_seed(seed + epoch))`. Without `use_seedable_sampler`
//!   (accelerate's default) a shuffled loader is torch's `RandomSampler` with the generator
//!   accelerate gives it ([`SamplerSpec::Random`]): each epoch is a `randperm` drawn from the
//!   generator's running state, which [`TorchGenerator`] takes from and gives back as torch's
//!   `get_state()` bytes, and which the [`LoaderState`] records at the epoch's start.
//! * [`DataLoaderConfiguration`] has accelerate's fields and defaults, and
//!   [`DataLoaderConfiguration::resolve`] accelerate's refusals.
//! * [`shard_batches`] is `BatchSamplerShard`, batch by batch (varying batch sizes included);
//!   [`IterableDatasetShard`] is accelerate's class of that name; [`Dispatcher`] is
//!   `DataLoaderDispatcher` over a [`Collective`].
//! * [`ShardedSampler`] is a prepared map-style loader, per-rank or dispatched, with
//!   [`ShardedSampler::skip_first_batches`]; [`PassState`] says when a new pass continues the
//!   epoch (a position was set) and when it starts it again (the last pass was broken off).
//!
//! Where accelerate's `len()` is wrong (split batches without even batches, and
//! `IterableDatasetShard` with split batches), the `len` functions here return the true
//! count and `accelerate_len` functions return accelerate's number.
//!
//! # The global cursor and O(1) resume
//!
//! An epoch's order depends only on (dataset length, sampler, seed, epoch). All ranks read
//! that one order in global batches of `G` samples (the batch size with `split_batches`,
//! batch size × ranks without), rank `p` taking the `p`-th slice of each (see [`EpochPlan`]).
//! A position is therefore one number per epoch, the *cursor*: how many samples of the
//! order the world has consumed. [`ShardedSampler::state_dict`] saves it in a versioned JSON
//! [`LoaderState`] with everything it is only valid with (dataset length and fingerprint,
//! sampler and seed, batch size, `drop_last`, accelerate's configuration, the world size at
//! save time); [`ShardedSampler::load_state_dict`] refuses a state that does not match and
//! otherwise continues from the cursor by computing, not replaying: no batch before it is
//! produced. (With shuffling, the epoch's permutation itself is drawn once, as at the start
//! of any epoch: resume costs the same as starting an epoch, whatever the position.)
//!
//! Compared with accelerate: `skip_first_batches(k)` walks and discards `k` batches (per rank:
//! `k × P` inner batches, and for iterable datasets it reads the data); restoring a state here
//! does not depend on `k`.
//!
//! # Elastic resume: N ranks → M ranks
//!
//! A state saved by `N` ranks loads on `M` ranks with the same batch size (the batch size of
//! the underlying sampler, as in accelerate). The rule:
//!
//! 1. The order of the interrupted epoch does not depend on the world size, so the samples
//!    before the cursor `c` are exactly those consumed, whatever `N` was.
//! 2. The rest of that epoch, `order[c..n]`, is cut into global batches of the new world's
//!    size `G'` starting at `c`; rank `p` of `M` takes the `p`-th slice of each. Every
//!    remaining sample is therefore handed out exactly once across the `M` ranks.
//! 3. The end of the epoch follows the new world's rules: with `drop_last` an incomplete last
//!    global batch is dropped (as it always is); with `even_batches` it is completed with
//!    samples from the start of the epoch's order — repeats, exactly as in any accelerate run,
//!    which `remainder`/`gather_for_metrics` can trim; otherwise the last step is uneven.
//! 4. From the next epoch on, the loader is exactly an `M`-rank run.
//!
//! When `M = N` the cut points of step 2 are the uninterrupted run's, so a resumed run equals
//! the remainder of the uninterrupted one, bit for bit.
//!
//! `split_batches` needs the batch size to divide by `M`, as it does in accelerate.
//!
//! # Mixtures
//!
//! A [`Mixture`] is many sources read as one dataset whose order is a pure function of its
//! [`MixtureSpec`] (sizes, weights, seed, `once` sources, length, weight changes) and the
//! position: exact proportions per block of positions, each source in its own keyed permutation,
//! `once` sources leaving when used up. It is read by the same sequential loader as any dataset,
//! so everything above (sharding, dispatching, O(1) and elastic resume) applies; the
//! [`LoaderState`] records the definition and refuses another. [`MixtureSource`] puts sources of
//! any kinds behind one [`Source`].
//!
//! # Reading the samples
//!
//! This part is the `sources` cargo feature, on by default. Without it the crate is the index
//! side alone (everything above), which builds without Arrow, Parquet, zstd or memory maps.
//!
//! A [`Source`] reads and collates a batch of samples by index: [`TokenWindows`]
//! (nanoGPT `.bin` and `.npy` token files cut in fixed windows), [`ArrowDataset`] (Arrow IPC
//! files and streams), [`ParquetDataset`] (by row, through a row-group index and a bounded
//! cache) and [`JsonlDataset`] (`.jsonl` and `.jsonl.zst` through a persisted line index).
//! Each opens a file, a directory or a glob of shards as one dataset and has a
//! [`Fingerprint`] of its files. Files are memory-mapped.
//!
//! [`DataLoader`] puts a [`ShardedSampler`] in front of a source and reads ahead with
//! background workers; its order and its [`LoaderState`] (which records the source's
//! fingerprint, so that resuming on other data is refused) do not depend on the number of
//! workers, and a state saved while batches are read ahead resumes at the first batch not
//! handed out.
#![warn(missing_docs, unreachable_pub)]

#[cfg(feature = "sources")]
mod arrow_file;
mod batch_shard;
mod config;
mod dispatch;
mod dispatch_steps;
mod error;
#[cfg(feature = "sources")]
mod fs;
#[doc(hidden)]
pub mod fuzz;
mod iterable_shard;
mod iterable_state;
#[cfg(feature = "sources")]
mod jsonl;
#[cfg(feature = "sources")]
mod line_index;
mod loader;
mod mixture;
#[cfg(feature = "sources")]
mod mixture_source;
#[cfg(feature = "sources")]
mod mmap;
#[cfg(feature = "sources")]
mod npy;
#[cfg(feature = "sources")]
mod parquet_rows;
mod pass_state;
mod plan;
#[cfg(feature = "sources")]
mod prefetch;
mod randperm;
mod sampler;
#[cfg(feature = "sources")]
mod source;
mod state;
mod state_report;
#[cfg(feature = "sources")]
mod table;
#[cfg(feature = "sources")]
mod tokens;
mod torch_rng;
mod torchdata;

/// The largest world size a loader or a saved state may have (a million ranks): larger values
/// are typos or forgeries that would size per-rank work by the billion.
pub const MAX_WORLD_SIZE: u64 = 1 << 20;

/// The largest batch size a loader or a saved state may have (4 Mi samples per batch): a batch
/// is materialised as a list of indices, so a forged state must not size one by the trillion.
pub const MAX_BATCH_SIZE: u64 = 1 << 22;

#[cfg(feature = "sources")]
pub use arrow_file::{ArrowDataset, ContiguousRows};
pub use batch_shard::{accelerate_shard_len, shard_batches, ShardParams};
pub use collective::{Collective, CollectiveError, InProcessCollective, InProcessGroup};
pub use config::{DataLoaderConfiguration, DatasetKind, LoaderShape, ResolvedLoader, ShardMode};
pub use dispatch::{
    base_batches, dispatch_len, dispatch_slice, gather_for_metrics, DispatchSlice, DispatchedBatch, Dispatcher,
};
pub use dispatch_steps::{DispatchAction, DispatchCut, DispatchSteps, Fetched};
pub use error::{DataloadError, ErrorKind, Result};
#[cfg(feature = "sources")]
pub use fs::open_regular;
pub use iterable_shard::{stream_accelerate_len, IterableDatasetShard, StreamPlan, TailItem};
pub use iterable_state::{IterableState, ITERABLE_STATE_FORMAT, ITERABLE_STATE_VERSION};
#[cfg(feature = "sources")]
pub use jsonl::{IndexPlacement, JsonlDataset, TextBatch, DEFAULT_FRAME_CACHE};
pub use loader::{ShardedSampler, ShardedSamplerBuilder};
pub use mixture::{Mixture, MixtureSpec, WeightChange};
#[cfg(feature = "sources")]
pub use mixture_source::{MixtureBatch, MixturePart, MixtureSource, MixtureSourceBuilder};
#[cfg(feature = "sources")]
pub use parquet_rows::{ParquetDataset, DEFAULT_ROW_GROUP_CACHE};
pub use pass_state::{PassStart, PassState};
pub use plan::{BatchGeometry, EpochPlan};
#[cfg(feature = "sources")]
pub use prefetch::{DataLoader, DataLoaderBuilder};
pub use randperm::{randperm, randperm_with, Permutation, RandpermAlgorithm, TorchVersion};
pub use sampler::{EpochOrder, IndexSampler, SeedableRandomSampler, SequentialSampler, MAX_SEED, MIN_SEED};
#[cfg(feature = "sources")]
pub use source::{FileFingerprint, Fingerprint, Source};
pub use state::{EpochGenerator, LoaderState, SamplerSpec, STATE_FORMAT, STATE_VERSION};
pub use state_report::{MixtureReport, RankReport, StateReport};
#[cfg(feature = "sources")]
pub use tokens::{TokenBatch, TokenDtype, TokenFile, TokenWindows};
pub use torch_rng::{TorchGenerator, STATE_BYTES as GENERATOR_STATE_BYTES};
pub use torchdata::TorchdataPosition;
