//! The closed form: which rank gets which indices at which step, computed, never walked.
//!
//! Within an epoch, all ranks read one global stream: the epoch's order (see
//! [`crate::EpochOrder`]). Step `t` of a plan that starts at cursor `s` covers the global
//! batch `order[s + t·G .. s + (t+1)·G]`, where `G` is the global batch size (the batch size
//! with `split_batches`, batch size × ranks without). Rank `p`'s share is the `p`-th slice of
//! `L = G / P` positions. accelerate's whole-batch and split-batch sharding both reduce to
//! this: rank `p` of round `r` gets inner batch `r·P + p`, which is the same slice.
//!
//! What happens at the end of the epoch is where the modes differ:
//!
//! * `drop_last`: only complete global batches; the tail is dropped.
//! * per-rank sharding with `even_batches`: positions past the end wrap to the start of the
//!   epoch's order (the first `min(G, n)` positions, repeated), which is accelerate's
//!   completion from "the first batches" of the epoch.
//! * per-rank sharding without `even_batches`: slices are cut at the end; ranks whose slice
//!   starts past it get nothing in the last step.
//! * dispatching: the last global batch of `r` rows is cut in `r / P` rows per rank, or, when
//!   `P` does not divide `r`, extended with the first `P` rows of the first global batch and
//!   cut in `r / P + 1` rows (accelerate's `DataLoaderDispatcher`). Every rank gets a batch
//!   every step, possibly empty.
//!
//! Finding rank `p`'s batch at step `t` is O(L), whatever `t` is: this is what makes resume
//! O(1) in the position.

use serde::{Deserialize, Serialize};

use crate::config::ShardMode;
use crate::sampler::EpochOrder;

/// How global batches are formed and cut, independent of the epoch and the position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchGeometry {
    /// Batch size of the underlying batch sampler (accelerate's `batch_size`).
    pub batch_size: u64,
    /// Number of ranks.
    pub world_size: u64,
    /// accelerate's `split_batches`.
    pub split_batches: bool,
    /// accelerate's `even_batches` (ignored when dispatching, as in accelerate).
    pub even_batches: bool,
    /// The underlying sampler's `drop_last`.
    pub drop_last: bool,
    /// Per-rank sharding or dispatching.
    pub mode: ShardMode,
}

impl BatchGeometry {
    /// Samples consumed from the global stream per step.
    pub fn global_batch(&self) -> u64 {
        fsdp_state::stream::global_batch(self.batch_size, self.world_size, self.split_batches)
    }

    /// Whether per-rank sharding completes the last step with wrap-around samples.
    /// accelerate only installs `BatchSamplerShard` when there is more than one process, so a
    /// one-rank loader never pads, whatever `even_batches` says.
    pub fn pads(&self) -> bool {
        self.even_batches && self.world_size > 1
    }

    /// Positions per rank per step (before the dispatcher's last-step adjustment).
    pub fn local_batch(&self) -> u64 {
        self.global_batch() / self.world_size.max(1)
    }
}

/// One epoch of one world: the order plus where this world started reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    order: EpochOrder,
    geometry: BatchGeometry,
    start: u64,
    pad_origin: u64,
}

impl EpochPlan {
    /// The plan that reads `order` from position `start`. `pad_origin` is where the
    /// dispatcher's padding rows come from (0, the start of the epoch, except after
    /// accelerate's `skip_first_batches` on a dispatched map-style loader).
    pub fn new(order: EpochOrder, geometry: BatchGeometry, start: u64, pad_origin: u64) -> Self {
        let n = order.len();
        Self { order, geometry, start: start.min(n), pad_origin: pad_origin.min(n) }
    }

    /// The epoch's order.
    pub fn order(&self) -> &EpochOrder {
        &self.order
    }

    /// The geometry.
    pub fn geometry(&self) -> &BatchGeometry {
        &self.geometry
    }

    /// Cursor the plan starts at.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Where dispatcher padding comes from.
    pub fn pad_origin(&self) -> u64 {
        self.pad_origin
    }

    fn len(&self) -> u64 {
        self.order.len()
    }

    fn remaining(&self) -> u64 {
        self.len() - self.start
    }

    /// Number of steps (global batches) in this plan.
    pub fn num_steps(&self) -> u64 {
        let g = self.geometry.global_batch();
        if g == 0 {
            return 0;
        }
        let m = self.remaining();
        if self.geometry.drop_last {
            m / g
        } else {
            m.div_ceil(g)
        }
    }

    /// Global cursor once `steps` steps are consumed (capped at the dataset length).
    pub fn cursor_after(&self, steps: u64) -> u64 {
        fsdp_state::stream::cursor_after(self.start, steps, self.geometry.global_batch()).min(self.len())
    }

    /// The rows of global batch `step` before any padding: what rank 0 broadcasts when
    /// dispatching.
    pub fn global_rows(&self, step: u64) -> Vec<u64> {
        if step >= self.num_steps() {
            return Vec::new();
        }
        let g = self.geometry.global_batch();
        let lo = self.start + step * g;
        self.order.range(lo, lo + g)
    }

    /// Rank `rank`'s batch at `step`, or `None` when it has none (past the end, or the short
    /// last step of uneven per-rank sharding).
    pub fn rank_batch(&self, step: u64, rank: u64) -> Option<Vec<u64>> {
        if step >= self.num_steps() || rank >= self.geometry.world_size {
            return None;
        }
        match self.geometry.mode {
            ShardMode::PerRank => self.per_rank_batch(step, rank),
            ShardMode::Dispatch => Some(self.dispatched_batch(step, rank)),
        }
    }

    fn per_rank_batch(&self, step: u64, rank: u64) -> Option<Vec<u64>> {
        let n = self.len();
        let (g, l) = (self.geometry.global_batch(), self.geometry.local_batch());
        let lo = self.start + step * g + rank * l;
        let hi = lo + l;
        if hi <= n {
            return Some(self.order.range(lo, hi));
        }
        if !self.geometry.pads() {
            return (lo < n).then(|| self.order.range(lo, n));
        }
        // Wrap-around: past the end, the stream continues with the first min(G, n) positions.
        let wrap = g.min(n);
        Some(
            (lo..hi)
                .filter_map(|pos| {
                    let pos = if pos < n { pos } else { (pos - n) % wrap };
                    self.order.get(pos)
                })
                .collect(),
        )
    }

    fn dispatched_batch(&self, step: u64, rank: u64) -> Vec<u64> {
        let p = self.geometry.world_size;
        let mut rows = self.global_rows(step);
        let last = step + 1 == self.num_steps();
        // accelerate keeps the first P rows of the first global batch of the iteration.
        let first_len = self.geometry.global_batch().min(self.len() - self.pad_origin);
        let keep = p.min(first_len);
        let cut = crate::dispatch::dispatch_slice(rows.len() as u64, keep, p, rank, last, self.geometry.drop_last);
        if cut.padded {
            rows.extend(self.order.range(self.pad_origin, self.pad_origin + keep));
        }
        // Both are at most the rows' length, which is a usize.
        rows[cut.start as usize..cut.end as usize].to_vec()
    }

    /// How many batches `rank` really gets from this plan.
    pub fn rank_len(&self, rank: u64) -> u64 {
        let t = self.num_steps();
        if t == 0 || rank >= self.geometry.world_size {
            return 0;
        }
        match self.geometry.mode {
            ShardMode::Dispatch => t,
            ShardMode::PerRank if self.geometry.drop_last || self.geometry.pads() => t,
            ShardMode::PerRank => {
                let lo = self.start + (t - 1) * self.geometry.global_batch() + rank * self.geometry.local_batch();
                (t - 1) + u64::from(lo < self.len())
            }
        }
    }

    /// What accelerate's `len()` says for a whole epoch on `rank` (`start` must be 0 for this
    /// to mean anything). Differs from [`EpochPlan::rank_len`] in split mode without
    /// `even_batches`, where accelerate counts the short last batch on every rank.
    pub fn accelerate_len(&self, rank: u64) -> u64 {
        let n = self.len();
        let geo = &self.geometry;
        let bs = geo.batch_size.max(1);
        let p = geo.world_size.max(1);
        let inner = if geo.drop_last { n / bs } else { n.div_ceil(bs) };
        match geo.mode {
            ShardMode::Dispatch => crate::dispatch::dispatch_len(inner, p, geo.split_batches, geo.drop_last),
            ShardMode::PerRank => {
                if geo.split_batches {
                    inner
                } else if inner.is_multiple_of(p) || geo.drop_last {
                    inner / p
                } else if geo.even_batches || rank < inner % p {
                    inner / p + 1
                } else {
                    inner / p
                }
            }
        }
    }

    /// accelerate's `GradientState.remainder` at the last step: how many rows of the last
    /// global batch are real. `None` is accelerate's `-1` (nothing to trim).
    pub fn remainder(&self) -> Option<u64> {
        match self.geometry.mode {
            ShardMode::Dispatch => {
                // The rows `global_rows(t - 1)` would hold, counted rather than listed.
                let (t, g) = (self.num_steps(), self.geometry.global_batch());
                (t > 0).then(|| g.min(self.remaining() - (t - 1) * g))
            }
            ShardMode::PerRank => (!self.geometry.drop_last).then(|| self.len() % self.geometry.global_batch().max(1)),
        }
    }
}
