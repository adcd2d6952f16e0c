//! accelerate's `BatchSamplerShard`, as a streaming reference over explicit inner batches.
//!
//! The loader ([`crate::ShardedSampler`]) never walks batches: it computes them from the global
//! cursor (see [`crate::EpochPlan`]). This module keeps the batch-by-batch walk of
//! accelerate for two reasons: it is the only way to shard batch samplers of *varying* batch
//! size (a list of lists), and it is the oracle that the closed form is property-tested
//! against.
//!
//! The walk, per rank `p` of `P` (accelerate's `_iter_with_no_split` / `_iter_with_split`):
//!
//! * whole batches: rank `p` takes inner batches `p, p + P, …`, but only hands out a round once
//!   its last batch is complete; with `even_batches` the unfinished last round is completed with
//!   indices from the first `P` batches of the epoch (whole batches when the size varies),
//!   repeated as often as needed;
//! * split batches: every full inner batch is cut in `P` slices of `batch_size / P`; a short last
//!   batch is padded from the first batch of the epoch (`even_batches`) or sliced as it is.
//!
//! `drop_last` is the inner sampler's: with it the inner sampler never produces a short batch,
//! and nothing is padded.

use crate::error::{DataloadError, Result};

/// Parameters of one `BatchSamplerShard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardParams {
    /// The inner sampler's batch size; `None` when batches vary in size.
    pub batch_size: Option<usize>,
    /// The inner sampler's `drop_last`.
    pub drop_last: bool,
    /// Number of ranks.
    pub world_size: usize,
    /// This rank.
    pub rank: usize,
    /// accelerate's `split_batches`.
    pub split_batches: bool,
    /// accelerate's `even_batches`.
    pub even_batches: bool,
}

impl ShardParams {
    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(DataloadError::InvalidValue {
                field: "world_size",
                value: "0".into(),
                reason: "at least one rank is needed",
            });
        }
        if self.rank >= self.world_size {
            return Err(DataloadError::RankOutOfRange { rank: self.rank, world_size: self.world_size });
        }
        if self.split_batches {
            match self.batch_size {
                None => return Err(DataloadError::SplitNeedsBatchSize),
                Some(bs) if bs % self.world_size != 0 => {
                    return Err(DataloadError::SplitNotDivisible { batch_size: bs, world_size: self.world_size })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// The batches rank `params.rank` gets from `inner`, exactly as accelerate yields them.
pub fn shard_batches<T: Clone>(inner: &[Vec<T>], params: ShardParams) -> Result<Vec<Vec<T>>> {
    params.validate()?;
    if let Some(bs) = params.batch_size {
        // torch's BatchSampler never yields more than `batch_size`; the padding arithmetic
        // relies on it.
        if inner.iter().any(|b| b.len() > bs) {
            return Err(DataloadError::InvalidValue {
                field: "batch_size",
                value: bs.to_string(),
                reason: "an inner batch is larger than the batch size",
            });
        }
    }
    Ok(if params.split_batches { with_split(inner, params) } else { without_split(inner, params) })
}

/// accelerate's `len(BatchSamplerShard)` for an inner sampler of `inner_len` batches. It is
/// wrong in split mode without `even_batches` (ranks that get nothing from the short last
/// batch are told one batch too many); [`shard_batches`]`.len()` is the true count.
pub fn accelerate_shard_len(inner_len: usize, params: ShardParams) -> Result<usize> {
    params.validate()?;
    let p = params.world_size;
    if params.split_batches {
        return Ok(inner_len);
    }
    if inner_len.is_multiple_of(p) {
        return Ok(inner_len / p);
    }
    let q = inner_len / p;
    Ok(if params.drop_last {
        q
    } else if params.even_batches || params.rank < inner_len % p {
        q + 1
    } else {
        q
    })
}

fn without_split<T: Clone>(inner: &[Vec<T>], sp: ShardParams) -> Vec<Vec<T>> {
    let (p_count, rank) = (sp.world_size, sp.rank);
    let full = |b: &Vec<T>| sp.batch_size.is_none_or(|bs| b.len() == bs);
    let mut out = Vec::new();
    // Padding source: the first P batches, flattened when the size is fixed.
    let mut initial_flat: Vec<T> = Vec::new();
    let mut initial_batches: Vec<Vec<T>> = Vec::new();
    let mut pending: Option<Vec<T>> = None;
    for (idx, b) in inner.iter().enumerate() {
        if !sp.drop_last && idx < p_count {
            if sp.batch_size.is_some() {
                initial_flat.extend(b.iter().cloned());
            } else {
                initial_batches.push(b.clone());
            }
        }
        if idx % p_count == rank {
            pending = Some(b.clone());
        }
        if idx % p_count == p_count - 1 && full(b) {
            if let Some(batch) = pending.take() {
                out.push(batch);
            }
        }
    }
    let initial_empty = initial_flat.is_empty() && initial_batches.is_empty();
    let Some(last) = inner.last() else {
        return out;
    };
    if sp.drop_last || initial_empty {
        return out;
    }
    if !sp.even_batches {
        out.extend(pending);
        return out;
    }
    if let Some(batch) = pending.take() {
        if full(&batch) {
            out.push(batch);
        }
    }
    let mut idx = inner.len() - 1;
    let mut b: Vec<T> = last.clone();
    if full(&b) {
        b.clear();
        idx += 1;
    }
    match sp.batch_size {
        Some(bs) => {
            let need = p_count * bs;
            let mut pad = initial_flat;
            while pad.len() < need {
                pad.extend_from_within(..);
            }
            let mut cursor = 0;
            while !idx.is_multiple_of(p_count) || !b.is_empty() {
                let k = bs - b.len();
                b.extend(pad[cursor..cursor + k].iter().cloned());
                cursor += k;
                if idx % p_count == rank {
                    out.push(std::mem::take(&mut b));
                }
                b.clear();
                idx += 1;
            }
        }
        None => {
            let mut pad = initial_batches;
            while pad.len() < p_count {
                pad.extend_from_within(..);
            }
            let mut cursor = 0;
            while !idx.is_multiple_of(p_count) || !b.is_empty() {
                b = pad[cursor].clone();
                cursor += 1;
                if idx % p_count == rank {
                    out.push(std::mem::take(&mut b));
                }
                b.clear();
                idx += 1;
            }
        }
    }
    out
}

fn with_split<T: Clone>(inner: &[Vec<T>], sp: ShardParams) -> Vec<Vec<T>> {
    // validate() guarantees a batch size in split mode.
    let bs = sp.batch_size.unwrap_or(0);
    let per = bs / sp.world_size;
    let lo = per * sp.rank;
    let mut out = Vec::new();
    for b in inner.iter().filter(|b| b.len() == bs) {
        out.push(b[lo..lo + per].to_vec());
    }
    let (Some(first), Some(last)) = (inner.first(), inner.last()) else {
        return out;
    };
    if sp.drop_last || first.is_empty() || last.len() >= bs {
        return out;
    }
    if !sp.even_batches {
        if last.len() > lo {
            out.push(last[lo..(lo + per).min(last.len())].to_vec());
        }
    } else {
        let mut pad = first.clone();
        while pad.len() < bs {
            pad.extend_from_within(..);
        }
        let mut c = last.clone();
        c.extend(pad);
        out.push(c[lo..lo + per].to_vec());
    }
    out
}
