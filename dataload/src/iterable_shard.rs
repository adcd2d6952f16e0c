//! accelerate's `IterableDatasetShard`: sharding a stream that every rank reads in full.
//!
//! The stream is cut in global chunks of `batch_size × P` items (`batch_size` with
//! `split_batches`); rank `p` keeps the `p`-th slice of `batch_size` (`batch_size / P`) items
//! of each chunk. A short last chunk is dropped with `drop_last`, otherwise completed with
//! whole copies of the first chunk (itself, when the stream is shorter than one chunk), so
//! every rank yields the same number of items.
//!
//! accelerate's `len()` ignores `split_batches` and is wrong in split mode;
//! [`IterableDatasetShard::len_for`] gives the true count.
//!
//! [`StreamPlan`] is the decision alone (which items of a chunk, and which items complete a
//! short last chunk), for callers that hold the items themselves: the Python package's
//! `IterableDatasetShard` moves Python objects by the positions it gives.

use crate::error::{DataloadError, Result};

/// Where an item of the completed last chunk comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailItem {
    /// Position in the short last chunk.
    Last(usize),
    /// Position in the first full chunk of the stream.
    First(usize),
}

/// Which items of each global chunk one rank keeps: accelerate's `IterableDatasetShard` as
/// positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPlan {
    global: usize,
    lo: usize,
    hi: usize,
    drop_last: bool,
}

impl StreamPlan {
    /// `batch_size` and `drop_last` are the original `DataLoader`'s.
    pub fn new(
        batch_size: usize,
        drop_last: bool,
        world_size: usize,
        rank: usize,
        split_batches: bool,
    ) -> Result<Self> {
        let (global, lo, hi) = geometry(batch_size, world_size, rank, split_batches)?;
        Ok(Self { global, lo, hi, drop_last })
    }

    /// Items per global chunk.
    pub fn chunk_len(&self) -> usize {
        self.global
    }

    /// This rank's positions in a full chunk.
    pub fn slice(&self) -> std::ops::Range<usize> {
        self.lo..self.hi
    }

    /// What this rank yields from the stream's short last chunk of `last_len` items (`0 <
    /// last_len < chunk_len`): nothing with `drop_last`; otherwise that chunk completed with
    /// whole copies of the first full chunk (of `first_len` items), or of itself when the
    /// stream had no full chunk, and cut like a full one.
    pub fn tail(&self, last_len: usize, first_len: Option<usize>) -> Vec<TailItem> {
        if self.drop_last || last_len == 0 {
            return Vec::new();
        }
        (self.lo..self.hi)
            .map(|pos| match (pos.checked_sub(last_len), first_len) {
                (None, _) => TailItem::Last(pos),
                (Some(past), Some(f)) if f > 0 => TailItem::First(past % f),
                (Some(past), _) => TailItem::Last(past % last_len),
            })
            .collect()
    }
}

/// accelerate's `IterableDatasetShard.__len__` over a stream of `n` items: whole chunks of
/// `batch_size × world_size` (a short last one counted unless `drop_last`), `batch_size` items
/// each. It ignores `split_batches`, as accelerate's does (too large in split mode).
pub fn stream_accelerate_len(n: usize, batch_size: usize, drop_last: bool, world_size: usize) -> usize {
    let global = batch_size.saturating_mul(world_size).max(1);
    let chunks = if drop_last { n / global } else { n.div_ceil(global) };
    chunks.saturating_mul(batch_size)
}

/// Wraps a stream of items; iterate it to get this rank's items.
#[derive(Debug, Clone)]
pub struct IterableDatasetShard<I: Iterator> {
    inner: I,
    plan: StreamPlan,
    first: Option<Vec<I::Item>>,
    out: std::collections::VecDeque<I::Item>,
    done: bool,
}

/// Global chunk size and this rank's slice of it.
fn geometry(batch_size: usize, world_size: usize, rank: usize, split_batches: bool) -> Result<(usize, usize, usize)> {
    if world_size == 0 {
        return Err(DataloadError::InvalidValue {
            field: "world_size",
            value: "0".into(),
            reason: "at least one rank is needed",
        });
    }
    if rank >= world_size {
        return Err(DataloadError::RankOutOfRange { rank, world_size });
    }
    if batch_size == 0 {
        return Err(DataloadError::InvalidValue { field: "batch_size", value: "0".into(), reason: "must be positive" });
    }
    if split_batches && batch_size > 1 && !batch_size.is_multiple_of(world_size) {
        return Err(DataloadError::SplitNotDivisible { batch_size, world_size });
    }
    let (global, local) = if split_batches {
        (batch_size, batch_size / world_size)
    } else {
        let global = batch_size.checked_mul(world_size).ok_or(DataloadError::InvalidValue {
            field: "batch_size",
            value: batch_size.to_string(),
            reason: "batch size times world size overflows",
        })?;
        (global, batch_size)
    };
    Ok((global, rank * local, (rank + 1) * local))
}

impl<I> IterableDatasetShard<I>
where
    I: Iterator,
    I::Item: Clone,
{
    /// `batch_size` and `drop_last` are the original `DataLoader`'s.
    pub fn new(
        inner: I,
        batch_size: usize,
        drop_last: bool,
        world_size: usize,
        rank: usize,
        split_batches: bool,
    ) -> Result<Self> {
        let plan = StreamPlan::new(batch_size, drop_last, world_size, rank, split_batches)?;
        Ok(Self { inner, plan, first: None, out: Default::default(), done: false })
    }

    /// Items rank `rank` really yields from a stream of `n` items.
    pub fn len_for(
        n: usize,
        batch_size: usize,
        drop_last: bool,
        world_size: usize,
        rank: usize,
        split_batches: bool,
    ) -> Result<usize> {
        let (global, lo, hi) = geometry(batch_size, world_size, rank, split_batches)?;
        let chunks = if drop_last || n == 0 { n / global } else { n.div_ceil(global) };
        Ok(chunks * (hi - lo))
    }

    /// What accelerate's `len()` says (ignores `split_batches`): [`stream_accelerate_len`].
    pub fn accelerate_len(n: usize, batch_size: usize, drop_last: bool, world_size: usize) -> usize {
        stream_accelerate_len(n, batch_size, drop_last, world_size)
    }
}

impl<I> Iterator for IterableDatasetShard<I>
where
    I: Iterator,
    I::Item: Clone,
{
    type Item = I::Item;

    fn next(&mut self) -> Option<I::Item> {
        loop {
            if let Some(x) = self.out.pop_front() {
                return Some(x);
            }
            if self.done {
                return None;
            }
            let global = self.plan.chunk_len();
            let mut cur: Vec<I::Item> = Vec::with_capacity(global);
            for x in self.inner.by_ref() {
                cur.push(x);
                if cur.len() == global {
                    break;
                }
            }
            if cur.len() == global {
                self.out.extend(cur[self.plan.slice()].iter().cloned());
                if self.first.is_none() {
                    self.first = Some(cur);
                }
                continue;
            }
            self.done = true;
            let first = self.first.take().unwrap_or_default();
            let tail = self.plan.tail(cur.len(), (!first.is_empty()).then_some(first.len()));
            self.out.extend(tail.into_iter().map(|t| match t {
                TailItem::Last(i) => cur[i].clone(),
                TailItem::First(i) => first[i].clone(),
            }));
        }
    }
}
