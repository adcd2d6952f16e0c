//! The saved position of a loader, as versioned JSON.
//!
//! ```json
//! {
//!   "format": "statekit.dataload",
//!   "version": 1,
//!   "epoch": 3,               // epoch being read
//!   "cursor": 4096,           // samples of the epoch's global order consumed (all ranks)
//!   "padding_origin": 0,      // where dispatcher padding rows come from (0 = epoch start)
//!   "dataset_len": 100000,
//!   "fingerprint": "sha256:…",// caller-chosen identity of the dataset, or null
//!   "sampler": {"kind": "seedable_random", "seed": 42},   // or {"kind": "random"}
//!   "generator": {"state": "…", "drawn": true},          // with "random" only, see below
//!   "torch": "torch2_6_plus", // which torch's randperm the order reproduces
//!   "batch_size": 8, "drop_last": false,
//!   "world_size": 4,          // world at save time; loading on another world is elastic
//!   "mode": "per_rank",       // or "dispatch"
//!   "config": { …accelerate's DataLoaderConfiguration… }
//! }
//! ```
//!
//! The state is the same on every rank: a position is global, which is what lets a state
//! saved by N ranks be loaded by M.
//!
//! With the `random` sampler (torch's `RandomSampler`, accelerate's default) an epoch's order is
//! `torch.randperm` drawn from a generator's running state, so the state records that
//! generator: torch's `get_state()` bytes in hex. With `drawn` the current epoch's permutation
//! was drawn from it (resuming redraws the same one, whatever the position); without, the
//! epoch has not started and the generator is its running state, from which the next
//! permutation will be drawn.

use serde::{Deserialize, Serialize};

use crate::config::{DataLoaderConfiguration, ShardMode};
use crate::error::{DataloadError, Result};
use crate::randperm::TorchVersion;
use crate::torch_rng::TorchGenerator;

/// Value of the `format` field.
pub const STATE_FORMAT: &str = "statekit.dataload";
/// The state version this build writes and reads.
pub const STATE_VERSION: u32 = 1;

/// Which sampler orders the epochs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum SamplerSpec {
    /// `0..n` every epoch.
    Sequential,
    /// accelerate's `SeedableRandomSampler` with this initial seed.
    SeedableRandom {
        /// `data_seed`, or torch's initial seed.
        #[serde(with = "crate::sampler::seed_serde")]
        seed: i128,
    },
    /// torch's `RandomSampler` with a generator: each epoch is one `randperm` drawn from the
    /// generator's running state ([`LoaderState::generator`]).
    Random,
}

impl std::fmt::Display for SamplerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sequential => f.write_str("sequential"),
            Self::SeedableRandom { seed } => write!(f, "seedable random (seed {seed})"),
            Self::Random => f.write_str("random (a running torch generator)"),
        }
    }
}

/// A loader's saved position and the settings it is only valid with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderState {
    /// Always [`STATE_FORMAT`].
    pub format: String,
    /// Always [`STATE_VERSION`] for states written by this build.
    pub version: u32,
    /// Epoch being read.
    pub epoch: u64,
    /// Samples of the epoch's global order already consumed by all ranks together.
    pub cursor: u64,
    /// Where the dispatcher's padding rows come from.
    pub padding_origin: u64,
    /// Dataset length.
    pub dataset_len: u64,
    /// Caller-chosen dataset identity.
    pub fingerprint: Option<String>,
    /// The sampler.
    pub sampler: SamplerSpec,
    /// The generator of a [`SamplerSpec::Random`] sampler; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<EpochGenerator>,
    /// Which torch's `randperm` the order reproduces.
    pub torch: TorchVersion,
    /// Batch size of the underlying batch sampler.
    pub batch_size: u64,
    /// The underlying sampler's `drop_last`.
    pub drop_last: bool,
    /// Number of ranks when saved.
    pub world_size: u64,
    /// Per-rank sharding or dispatching.
    pub mode: ShardMode,
    /// accelerate's configuration.
    pub config: DataLoaderConfiguration,
    /// The mixture the dataset's order is, when it is one: its definition, which a resume
    /// against another mixture is refused on, field by field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixture: Option<crate::MixtureSpec>,
}

/// The generator an epoch of a [`SamplerSpec::Random`] sampler is drawn from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpochGenerator {
    /// torch's generator state (its `get_state()` bytes, in hex in the JSON).
    #[serde(with = "crate::torch_rng::hex_serde")]
    pub state: TorchGenerator,
    /// Whether the epoch's permutation has been drawn from `state`; if not, `state` is the
    /// running state the next permutation will be drawn from.
    pub drawn: bool,
}

impl LoaderState {
    /// Pretty JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| DataloadError::MalformedState { reason: e.to_string() })
    }

    /// Parses JSON, refusing other formats and versions before looking at the rest.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| DataloadError::MalformedState { reason: e.to_string() })?;
        let format = value.get("format").and_then(|f| f.as_str());
        if format != Some(STATE_FORMAT) {
            return Err(DataloadError::MalformedState { reason: format!("`format` is not `{STATE_FORMAT}`") });
        }
        let version = value
            .get("version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| DataloadError::MalformedState { reason: "`version` is missing or not a number".into() })?;
        if version != u64::from(STATE_VERSION) {
            return Err(DataloadError::UnsupportedVersion {
                found: u32::try_from(version).unwrap_or(u32::MAX),
                supported: STATE_VERSION,
            });
        }
        let state: Self =
            serde_json::from_str(text).map_err(|e| DataloadError::MalformedState { reason: e.to_string() })?;
        state.check_consistent()?;
        Ok(state)
    }

    /// Refuses states whose numbers contradict one another.
    pub fn check_consistent(&self) -> Result<()> {
        let bad = |reason: String| Err(DataloadError::InconsistentState { reason });
        if self.cursor > self.dataset_len {
            return bad(format!("cursor {} is past the dataset length {}", self.cursor, self.dataset_len));
        }
        if self.padding_origin > self.cursor {
            return bad(format!("padding origin {} is past the cursor {}", self.padding_origin, self.cursor));
        }
        match (&self.sampler, &self.generator) {
            (SamplerSpec::Random, None) => return bad("a `random` sampler needs its `generator`".into()),
            (SamplerSpec::Random, Some(_)) | (_, None) => {}
            (_, Some(_)) => return bad(format!("a {} sampler has no `generator`", self.sampler)),
        }
        if self.batch_size == 0 || self.world_size == 0 {
            return bad("batch size and world size must be positive".into());
        }
        if self.batch_size > crate::MAX_BATCH_SIZE {
            return bad(format!(
                "batch size {} is more than the {} samples a batch may hold",
                self.batch_size,
                crate::MAX_BATCH_SIZE
            ));
        }
        if self.world_size > crate::MAX_WORLD_SIZE {
            return bad(format!(
                "world size {} is more than the {} ranks any run has",
                self.world_size,
                crate::MAX_WORLD_SIZE
            ));
        }
        Ok(())
    }
}

/// Refuses a state whose `field` was `saved` but is `current` now. Values are shown as the state
/// file writes them (JSON), so the message can be read against the file.
pub(crate) fn differ<T: PartialEq + Serialize>(field: &'static str, saved: &T, current: &T) -> Result<()> {
    if saved == current {
        return Ok(());
    }
    let shown = |v: &T| serde_json::to_string(v).unwrap_or_else(|e| format!("<{e}>"));
    Err(DataloadError::StateMismatch { field, saved: shown(saved), current: shown(current) })
}
