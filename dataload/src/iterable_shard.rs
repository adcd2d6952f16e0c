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

use crate::error::{DataloadError, Result};

/// Wraps a stream of items; iterate it to get this rank's items.
#[derive(Debug, Clone)]
pub struct IterableDatasetShard<I: Iterator> {
    inner: I,
    global: usize,
    lo: usize,
    hi: usize,
    drop_last: bool,
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
        let (global, lo, hi) = geometry(batch_size, world_size, rank, split_batches)?;
        Ok(Self { inner, global, lo, hi, drop_last, first: None, out: Default::default(), done: false })
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

    /// What accelerate's `len()` says (ignores `split_batches`).
    pub fn accelerate_len(n: usize, batch_size: usize, drop_last: bool, world_size: usize) -> usize {
        let global = batch_size.saturating_mul(world_size).max(1);
        let chunks = if drop_last { n / global } else { n.div_ceil(global) };
        chunks * batch_size
    }

    fn emit(&mut self, chunk: &[I::Item]) {
        self.out.extend(chunk[self.lo..self.hi].iter().cloned());
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
            let mut cur: Vec<I::Item> = Vec::with_capacity(self.global);
            for x in self.inner.by_ref() {
                cur.push(x);
                if cur.len() == self.global {
                    break;
                }
            }
            if cur.len() == self.global {
                self.emit(&cur);
                if self.first.is_none() {
                    self.first = Some(cur);
                }
                continue;
            }
            self.done = true;
            if self.drop_last || cur.is_empty() {
                continue;
            }
            let first = self.first.take().unwrap_or_else(|| cur.clone());
            while cur.len() < self.global {
                cur.extend(first.iter().cloned());
            }
            self.emit(&cur);
        }
    }
}
