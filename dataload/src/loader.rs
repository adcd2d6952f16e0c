//! The rank-sharded index loader: accelerate's prepared map-style loader, as pure arithmetic.

use crate::config::{DataLoaderConfiguration, DatasetKind, LoaderShape, ShardMode};
use crate::error::{DataloadError, Result};
use crate::plan::{BatchGeometry, EpochPlan};
use crate::randperm::randperm;
use crate::randperm::TorchVersion;
use crate::sampler::{EpochOrder, IndexSampler, SeedableRandomSampler, SequentialSampler};
use crate::state::{EpochGenerator, LoaderState, SamplerSpec, STATE_FORMAT, STATE_VERSION};
use crate::torch_rng::TorchGenerator;

/// Builds a [`ShardedSampler`]; every check happens in [`ShardedSamplerBuilder::build`].
#[derive(Debug, Clone, Default)]
pub struct ShardedSamplerBuilder {
    dataset_len: Option<u64>,
    batch_size: Option<u64>,
    drop_last: bool,
    world_size: Option<u64>,
    rank: u64,
    shuffle: bool,
    torch_initial_seed: Option<i128>,
    config: DataLoaderConfiguration,
    put_on_device: bool,
    fingerprint: Option<String>,
    torch: TorchVersion,
    generator: Option<TorchGenerator>,
    mixture: Option<crate::MixtureSpec>,
}

impl ShardedSamplerBuilder {
    /// Number of samples in the (map-style) dataset.
    pub fn dataset_len(mut self, n: u64) -> Self {
        self.dataset_len = Some(n);
        self
    }

    /// Batch size of the underlying batch sampler, as given to torch's `DataLoader`.
    pub fn batch_size(mut self, b: u64) -> Self {
        self.batch_size = Some(b);
        self
    }

    /// torch `DataLoader`'s `drop_last`.
    pub fn drop_last(mut self, d: bool) -> Self {
        self.drop_last = d;
        self
    }

    /// Number of ranks.
    pub fn world_size(mut self, w: u64) -> Self {
        self.world_size = Some(w);
        self
    }

    /// This rank (default 0).
    pub fn rank(mut self, r: u64) -> Self {
        self.rank = r;
        self
    }

    /// torch `DataLoader`'s `shuffle` (a `RandomSampler`). With `use_seedable_sampler` the
    /// order is accelerate's `SeedableRandomSampler`'s; without (accelerate's default) it is
    /// torch's `RandomSampler` drawing from a running [`generator`](Self::generator).
    pub fn shuffle(mut self, s: bool) -> Self {
        self.shuffle = s;
        self
    }

    /// What `torch.initial_seed()` returns in the training processes (what `set_seed` set);
    /// used by the seedable sampler when `data_seed` is unset, as in accelerate.
    pub fn torch_initial_seed(mut self, s: i128) -> Self {
        self.torch_initial_seed = Some(s);
        self
    }

    /// accelerate's configuration.
    pub fn config(mut self, c: DataLoaderConfiguration) -> Self {
        self.config = c;
        self
    }

    /// accelerate's `put_on_device` (default true).
    pub fn put_on_device(mut self, p: bool) -> Self {
        self.put_on_device = p;
        self
    }

    /// Identity of the dataset, checked when a state is loaded.
    pub fn fingerprint(mut self, f: impl Into<String>) -> Self {
        self.fingerprint = Some(f.into());
        self
    }

    /// The generator a `RandomSampler` (shuffling without `use_seedable_sampler`) draws the
    /// first epoch from: the state of the `torch.Generator` accelerate gives the sampler (the
    /// user's, or a fresh one seeded from torch's global generator). Each epoch draws one
    /// `randperm` from it and the next epoch starts from where that left it.
    pub fn generator(mut self, g: TorchGenerator) -> Self {
        self.generator = Some(g);
        self
    }

    /// The torch whose `randperm` the order must equal (default: torch ≥ 2.6).
    pub fn torch_version(mut self, t: TorchVersion) -> Self {
        self.torch = t;
        self
    }

    /// The dataset is this mixture (its length is the dataset's): the state records its
    /// definition, and a state of another mixture is refused by field.
    pub fn mixture(mut self, spec: crate::MixtureSpec) -> Self {
        self.mixture = Some(spec);
        self
    }

    /// Validates everything and builds the loader, at epoch 0, position 0.
    pub fn build(self) -> Result<ShardedSampler> {
        let dataset_len = self.dataset_len.ok_or(DataloadError::Missing { field: "dataset_len" })?;
        let batch_size = self.batch_size.ok_or(DataloadError::Missing { field: "batch_size" })?;
        let world_size = self.world_size.ok_or(DataloadError::Missing { field: "world_size" })?;
        if let Some(spec) = &self.mixture {
            let len = crate::Mixture::new(spec.clone())?.len();
            if len != dataset_len {
                return Err(DataloadError::BadMixture {
                    field: "length",
                    reason: format!("the mixture has {len} samples, the loader's dataset {dataset_len}"),
                });
            }
        }
        if batch_size == 0 {
            return Err(DataloadError::InvalidValue {
                field: "batch_size",
                value: "0".into(),
                reason: "must be positive",
            });
        }
        if world_size == 0 {
            return Err(DataloadError::InvalidValue {
                field: "world_size",
                value: "0".into(),
                reason: "at least one rank is needed",
            });
        }
        if batch_size > crate::MAX_BATCH_SIZE {
            return Err(DataloadError::InvalidValue {
                field: "batch_size",
                value: batch_size.to_string(),
                reason: "more samples than a batch may hold (the limit is 2^22)",
            });
        }
        if world_size > crate::MAX_WORLD_SIZE {
            return Err(DataloadError::InvalidValue {
                field: "world_size",
                value: world_size.to_string(),
                reason: "more ranks than any run has (the limit is 2^20)",
            });
        }
        if self.rank >= world_size {
            return Err(DataloadError::RankOutOfRange {
                rank: usize::try_from(self.rank).unwrap_or(usize::MAX),
                world_size: usize::try_from(world_size).unwrap_or(usize::MAX),
            });
        }
        if batch_size.checked_mul(world_size).is_none() {
            return Err(DataloadError::InvalidValue {
                field: "batch_size",
                value: batch_size.to_string(),
                reason: "batch size times world size overflows 64 bits",
            });
        }
        let mode = self
            .config
            .resolve(LoaderShape {
                dataset: DatasetKind::Map,
                batch_size: usize::try_from(batch_size).ok(),
                world_size: usize::try_from(world_size).unwrap_or(usize::MAX),
                rank: usize::try_from(self.rank).unwrap_or(usize::MAX),
                put_on_device: self.put_on_device,
            })?
            .mode;
        let mut generator = None;
        let sampler = if self.shuffle && !self.config.use_seedable_sampler {
            // Dispatched, accelerate's rank 0 alone draws the order: every rank computes its
            // slice from rank 0's generator, which the caller gives each rank at the start of
            // each epoch ([`ShardedSampler::set_generator`]) through its collective.
            generator = Some(self.generator.ok_or(DataloadError::Missing { field: "generator" })?);
            SamplerSpec::Random
        } else if self.shuffle {
            let seed = self.config.data_seed.or(self.torch_initial_seed).ok_or(DataloadError::MissingSeed)?;
            // Validates the seed range.
            SeedableRandomSampler::new(dataset_len, seed, self.torch)?;
            SamplerSpec::SeedableRandom { seed }
        } else {
            SamplerSpec::Sequential
        };
        Ok(ShardedSampler {
            dataset_len,
            sampler,
            torch: self.torch,
            config: self.config,
            geometry: BatchGeometry {
                batch_size,
                world_size,
                split_batches: self.config.split_batches,
                even_batches: self.config.even_batches,
                drop_last: self.drop_last,
                mode,
            },
            rank: self.rank,
            fingerprint: self.fingerprint,
            mixture: self.mixture,
            epoch: 0,
            start: 0,
            pad_origin: 0,
            step: 0,
            plan: None,
            generator,
            drawn: false,
            after: None,
        })
    }
}

/// One rank's view of an accelerate-prepared map-style loader: which dataset indices it gets,
/// batch by batch, epoch after epoch; resumable in O(1) from a [`LoaderState`], also on
/// another number of ranks.
#[derive(Debug, Clone)]
pub struct ShardedSampler {
    dataset_len: u64,
    sampler: SamplerSpec,
    torch: TorchVersion,
    config: DataLoaderConfiguration,
    geometry: BatchGeometry,
    rank: u64,
    fingerprint: Option<String>,
    mixture: Option<crate::MixtureSpec>,
    epoch: u64,
    /// Cursor where the current epoch's plan starts (0 unless resumed or skipped).
    start: u64,
    pad_origin: u64,
    /// Steps consumed since `start`.
    step: u64,
    /// The current epoch's plan, built on first use: building it costs the permutation.
    plan: Option<EpochPlan>,
    /// [`SamplerSpec::Random`] only: the generator the current epoch is (or will be) drawn from.
    generator: Option<TorchGenerator>,
    /// Whether the current epoch's permutation has been drawn from `generator`: from then on it
    /// is the epoch's, whatever happens to the caller's generator.
    drawn: bool,
    /// The generator once the current epoch's permutation is drawn (built with the plan).
    after: Option<TorchGenerator>,
}

impl ShardedSampler {
    /// A builder (`put_on_device` defaults to true, like accelerate).
    pub fn builder() -> ShardedSamplerBuilder {
        ShardedSamplerBuilder { put_on_device: true, ..ShardedSamplerBuilder::default() }
    }

    /// A loader for `rank` of `world_size` ranks with the settings recorded in `state`,
    /// positioned where the state says (`world_size` may differ from the saved one: see the
    /// crate docs for elastic resume).
    pub fn from_state(state: &LoaderState, world_size: u64, rank: u64) -> Result<Self> {
        state.check_consistent()?;
        let mut b = Self::builder()
            .dataset_len(state.dataset_len)
            .batch_size(state.batch_size)
            .drop_last(state.drop_last)
            .world_size(world_size)
            .rank(rank)
            .config(state.config)
            .torch_version(state.torch);
        if let Some(f) = &state.fingerprint {
            b = b.fingerprint(f.clone());
        }
        if let Some(m) = &state.mixture {
            b = b.mixture(m.clone());
        }
        if let SamplerSpec::SeedableRandom { seed } = state.sampler {
            b = b.shuffle(true).torch_initial_seed(seed);
        }
        if let Some(g) = &state.generator {
            b = b.shuffle(true).generator(g.state.clone());
        }
        let mut loader = b.build()?;
        loader.load_state_dict(state)?;
        Ok(loader)
    }

    /// The epoch being read.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This rank.
    pub fn rank(&self) -> u64 {
        self.rank
    }

    /// The geometry (batch size, world size, flags, mode).
    pub fn geometry(&self) -> &BatchGeometry {
        &self.geometry
    }

    /// The sampler.
    pub fn sampler(&self) -> SamplerSpec {
        self.sampler
    }

    /// Dataset length.
    pub fn dataset_len(&self) -> u64 {
        self.dataset_len
    }

    /// Global cursor: samples of this epoch's order consumed by all ranks together.
    pub fn cursor(&self) -> u64 {
        fsdp_state::stream::cursor_after(self.start, self.step, self.geometry.global_batch()).min(self.dataset_len)
    }

    /// The order of `epoch`, computed from scratch. A [`SamplerSpec::Random`] sampler knows the
    /// generator of its current epoch only: another epoch's order depends on what draws from
    /// the generator in between, so it is refused.
    pub fn order(&self, epoch: u64) -> Result<EpochOrder> {
        Ok(self.draw(epoch)?.0)
    }

    /// The order of `epoch` and, for a `random` sampler, its generator after the draw.
    fn draw(&self, epoch: u64) -> Result<(EpochOrder, Option<TorchGenerator>)> {
        match self.sampler {
            SamplerSpec::Sequential => Ok((SequentialSampler::new(self.dataset_len).order(epoch)?, None)),
            SamplerSpec::SeedableRandom { seed } => {
                Ok((SeedableRandomSampler::new(self.dataset_len, seed, self.torch)?.order(epoch)?, None))
            }
            SamplerSpec::Random => {
                if epoch != self.epoch {
                    return Err(DataloadError::InvalidValue {
                        field: "epoch",
                        value: epoch.to_string(),
                        reason: "a `random` sampler's order is known for its current epoch only",
                    });
                }
                let mut g = self.generator.clone().ok_or(DataloadError::Missing { field: "generator" })?;
                let perm = randperm(self.dataset_len, &mut g, self.torch)?;
                Ok((EpochOrder::Shuffled(std::sync::Arc::new(perm)), Some(g)))
            }
        }
    }

    /// Batches this rank gets in a whole epoch (accelerate's `len`), without drawing any
    /// permutation: the count depends on the dataset length only.
    pub fn epoch_len(&self) -> u64 {
        EpochPlan::new(EpochOrder::Sequential { len: self.dataset_len }, self.geometry, 0, 0).rank_len(self.rank)
    }

    /// accelerate's `remainder` at the end of a whole epoch (see [`EpochPlan::remainder`]),
    /// from the dataset length alone: the rows of the last global batch of a dispatched loader.
    pub fn epoch_remainder(&self) -> Option<u64> {
        EpochPlan::new(EpochOrder::Sequential { len: self.dataset_len }, self.geometry, 0, 0).remainder()
    }

    /// A `random` sampler whose current epoch is not drawn yet: its generator may still be
    /// replaced ([`ShardedSampler::set_generator`]), as the caller's `torch.Generator` may
    /// have been drawn from since.
    pub fn needs_generator(&self) -> bool {
        self.sampler == SamplerSpec::Random && !self.drawn
    }

    /// `generator` moved on as on a rank that does not read a dispatched loader but makes its
    /// iterator anyway, with torch's workers prefetching `prefetched` underlying batches at once
    /// (accelerate's other ranks): their `RandomSampler` draws one permutation, and a second
    /// when the prefetch runs into the pull that finds the sampler empty (the one after the
    /// last batch, unless a short last batch already emptied it).
    pub fn prefetch_advanced(&self, generator: &TorchGenerator, prefetched: u64) -> TorchGenerator {
        let (n, b) = (self.dataset_len, self.geometry.batch_size.max(1));
        let mut g = generator.clone();
        if prefetched == 0 {
            return g;
        }
        let batches = if self.geometry.drop_last { n / b } else { n.div_ceil(b) };
        let emptying = batches + u64::from(self.geometry.drop_last || n.is_multiple_of(b));
        let perms = if prefetched >= emptying { 2 } else { 1 };
        g.discard(perms * crate::randperm::randperm_draws(n, self.torch));
        g
    }

    /// Sets the generator the current epoch of a `random` sampler is drawn from (the running
    /// state of the caller's `torch.Generator`). Refused once the epoch is drawn, and for other
    /// samplers.
    pub fn set_generator(&mut self, g: TorchGenerator) -> Result<()> {
        let reason = if self.sampler != SamplerSpec::Random {
            "only a `random` sampler (shuffling without `use_seedable_sampler`) draws from a generator"
        } else if self.drawn {
            "the current epoch's permutation is already drawn"
        } else {
            self.generator = Some(g);
            self.plan = None;
            return Ok(());
        };
        Err(DataloadError::InvalidValue {
            field: "generator",
            value: format!("for a {} sampler", self.sampler),
            reason,
        })
    }

    /// A `random` sampler's generator as torch's would be now: after the current epoch's
    /// draw once it is drawn, else the running state the epoch will be drawn from. `None` for
    /// other samplers.
    pub fn running_generator(&mut self) -> Result<Option<TorchGenerator>> {
        if self.sampler != SamplerSpec::Random {
            return Ok(None);
        }
        if self.drawn {
            self.current_plan()?;
            return Ok(self.after.clone());
        }
        Ok(self.generator.clone())
    }

    /// The whole plan of `epoch` from its start, for any rank (what a fresh loader would do).
    pub fn plan_for_epoch(&self, epoch: u64) -> Result<EpochPlan> {
        Ok(EpochPlan::new(self.order(epoch)?, self.geometry, 0, 0))
    }

    /// The plan of the current epoch from where this loader started reading it.
    pub fn current_plan(&mut self) -> Result<&EpochPlan> {
        if self.plan.is_none() {
            let (order, after) = self.draw(self.epoch)?;
            if after.is_some() {
                self.drawn = true;
                self.after = after;
            }
            self.plan = Some(EpochPlan::new(order, self.geometry, self.start, self.pad_origin));
        }
        self.plan.as_ref().ok_or(DataloadError::InconsistentState { reason: "plan vanished".into() })
    }

    /// This rank's next batch, or `None` at the end of the epoch, after which the loader is
    /// at the start of the next epoch (accelerate increments its `iteration` the same way,
    /// only when an epoch is read to the end).
    pub fn next_batch(&mut self) -> Result<Option<Vec<u64>>> {
        let (step, rank) = (self.step, self.rank);
        match self.current_plan()?.rank_batch(step, rank) {
            Some(batch) => {
                self.step += 1;
                Ok(Some(batch))
            }
            None => {
                // torch's RandomSampler, read to its end, evaluates a second `randperm(n)`
                // for the `num_samples % n` (= 0) samples after the first: its generator
                // moves on by the draws of two permutations per epoch.
                if let (true, Some(g)) = (self.drawn, self.after.as_mut()) {
                    g.discard(crate::randperm::randperm_draws(self.dataset_len, self.torch));
                }
                self.set_epoch(self.epoch + 1);
                Ok(None)
            }
        }
    }

    /// All remaining batches of this rank in the current epoch; the loader ends at the start
    /// of the next epoch.
    pub fn rest_of_epoch(&mut self) -> Result<Vec<Vec<u64>>> {
        let mut out = Vec::new();
        while let Some(b) = self.next_batch()? {
            out.push(b);
        }
        Ok(out)
    }

    /// Moves to the start of `epoch` (accelerate's `set_epoch`). A `random` sampler whose
    /// current epoch was drawn goes on from the generator that draw left (torch's
    /// `RandomSampler` ignores the epoch number: its next iteration draws from the running
    /// generator); staying in the same epoch keeps its permutation.
    pub fn set_epoch(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.plan = None;
            if self.drawn {
                self.generator = self.after.take();
                self.drawn = false;
            }
        }
        self.epoch = epoch;
        if self.start != 0 || self.pad_origin != 0 {
            self.plan = None;
        }
        self.start = 0;
        self.pad_origin = 0;
        self.step = 0;
    }

    /// A new pass over the current epoch from its start, as torch's loaders make at each
    /// `iter()` after a pass that was broken off: a sampler whose order follows from the epoch
    /// number gives the same order again; a `random` one draws a new permutation from its
    /// running generator, which the broken-off pass advanced by its draw (torch's
    /// `RandomSampler` draws at every `iter()`; the epoch number stays, as accelerate's
    /// `iteration` does).
    pub fn restart_epoch(&mut self) -> Result<()> {
        if self.drawn {
            self.current_plan()?;
            self.generator = self.after.take();
            self.drawn = false;
        }
        self.plan = None;
        self.start = 0;
        self.pad_origin = 0;
        self.step = 0;
        Ok(())
    }

    /// accelerate's `skip_first_batches(loader, k)` for the current epoch: the epoch is read
    /// from its start, minus this rank's first `k` batches. As in accelerate, a dispatched
    /// loader counts `k` in batches of the *underlying* sampler (not in steps: with `P` ranks
    /// and no `split_batches` a step is `P` of them), and its padding rows then come from
    /// the first batch after the skipped ones. Costs nothing: no batch is produced.
    pub fn skip_first_batches(&mut self, k: u64) {
        self.set_epoch(self.epoch);
        match self.geometry.mode {
            ShardMode::PerRank => self.step = k,
            ShardMode::Dispatch => {
                let s = k.saturating_mul(self.geometry.batch_size).min(self.dataset_len);
                self.start = s;
                self.pad_origin = s;
                self.plan = None;
            }
        }
    }

    /// Continues after `k` steps of the current epoch, counted as accelerate's loaders count
    /// what they yielded (a stateful loader's `_num_yielded`): `k` of this rank's batches, or
    /// for a dispatched loader `k` global steps, each `world_size` underlying batches (one
    /// with `split_batches`).
    pub fn skip_steps(&mut self, k: u64) {
        let per_step = match self.geometry.mode {
            ShardMode::Dispatch if !self.config.split_batches => self.geometry.world_size,
            _ => 1,
        };
        self.skip_first_batches(k.saturating_mul(per_step));
    }

    /// Batches this rank really gets in the current epoch, from where it started reading it.
    pub fn len(&mut self) -> Result<u64> {
        let rank = self.rank;
        Ok(self.current_plan()?.rank_len(rank))
    }

    /// Whether the current epoch gives this rank nothing.
    pub fn is_empty(&mut self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Batches left for this rank in the current epoch.
    pub fn remaining(&mut self) -> Result<u64> {
        let (rank, step) = (self.rank, self.step);
        Ok(self.current_plan()?.rank_len(rank).saturating_sub(step))
    }

    /// The state a loader with these settings has once each of `world_size` ranks took
    /// `steps` steps of `epoch` ([`ShardedSampler::skip_steps`]): where a run that stopped there
    /// continues, on any world size, from plain numbers (an accelerate folder's saved position).
    /// Nothing is replayed. `saved_seed` is the seed the run's sampler held, where it saved
    /// one (an accelerate folder's pickled `SeedableRandomSampler`): it must be this loader's.
    pub fn state_at(&self, world_size: u64, epoch: u64, steps: u64, saved_seed: Option<i128>) -> Result<LoaderState> {
        if let (Some(saved), SamplerSpec::SeedableRandom { seed }) = (saved_seed, self.sampler) {
            if saved != seed {
                return Err(DataloadError::StateMismatch {
                    field: "seed",
                    saved: saved.to_string(),
                    current: seed.to_string(),
                });
            }
        }
        let mut there = ShardedSampler::from_state(&self.state_dict(), world_size, 0)?;
        there.set_epoch(epoch);
        there.skip_steps(steps);
        Ok(there.state_dict())
    }

    /// The position and settings, to be saved (identical on every rank that has taken the
    /// same number of steps).
    pub fn state_dict(&self) -> LoaderState {
        LoaderState {
            format: STATE_FORMAT.to_owned(),
            version: STATE_VERSION,
            epoch: self.epoch,
            cursor: self.cursor(),
            padding_origin: self.pad_origin.min(self.cursor()),
            dataset_len: self.dataset_len,
            fingerprint: self.fingerprint.clone(),
            sampler: self.sampler,
            generator: self.generator.clone().map(|state| EpochGenerator { state, drawn: self.drawn }),
            torch: self.torch,
            batch_size: self.geometry.batch_size,
            drop_last: self.geometry.drop_last,
            world_size: self.geometry.world_size,
            mode: self.geometry.mode,
            config: self.config,
            mixture: self.mixture.clone(),
        }
    }

    /// Continues from `state`, which may come from another world size (see the crate docs
    /// for the elastic rule). Everything else must match; nothing is replayed.
    pub fn load_state_dict(&mut self, state: &LoaderState) -> Result<()> {
        if state.format != STATE_FORMAT {
            return Err(DataloadError::MalformedState { reason: format!("`format` is not `{STATE_FORMAT}`") });
        }
        if state.version != STATE_VERSION {
            return Err(DataloadError::UnsupportedVersion { found: state.version, supported: STATE_VERSION });
        }
        state.check_consistent()?;
        use crate::state::differ;
        differ("dataset_len", &state.dataset_len, &self.dataset_len)?;
        differ("fingerprint", &state.fingerprint, &self.fingerprint)?;
        differ("sampler", &state.sampler, &self.sampler)?;
        differ("torch", &state.torch, &self.torch)?;
        differ("batch_size", &state.batch_size, &self.geometry.batch_size)?;
        differ("drop_last", &state.drop_last, &self.geometry.drop_last)?;
        differ("mode", &state.mode, &self.geometry.mode)?;
        differ("config", &state.config, &self.config)?;
        match (&state.mixture, &self.mixture) {
            (Some(saved), Some(now)) => now.check_resumes(saved, state.cursor)?,
            (saved, now) => differ("mixture", saved, now)?,
        }
        self.epoch = state.epoch;
        self.start = state.cursor;
        self.pad_origin = state.padding_origin;
        self.step = 0;
        self.plan = None;
        if let Some(g) = &state.generator {
            self.generator = Some(g.state.clone());
            self.drawn = g.drawn;
            self.after = None;
        }
        Ok(())
    }
}
