//! accelerate's `DataLoaderDispatcher`, over a [`Collective`]: rank 0 reads each global batch
//! and broadcasts it, every rank keeps its slice.
//!
//! Per step rank 0 takes one batch of the underlying loader (`split_batches`) or `P` of them,
//! concatenated; when the underlying loader ends part-way through the `P`, the batches
//! already taken form a last, short global batch (unless `drop_last`). Every rank looks one
//! step ahead to know whether the current step is the last. On the last step, if its `r`
//! rows do not divide by `P`, the first `P` rows of the iteration's first global batch are
//! appended and each rank takes `r / P + 1` rows; otherwise `r / P`. `remainder` is `r` on
//! the last step, which lets [`gather_for_metrics`] drop the padding rows.
//!
//! [`crate::EpochPlan`] computes the same slices without communication; tests check that both
//! agree with each other and with real accelerate.

use collective::Collective;

use crate::error::{DataloadError, Result};
use crate::sampler::EpochOrder;

/// One rank's batch from the dispatcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchedBatch {
    /// This rank's rows (possibly empty: accelerate yields empty slices too).
    pub rows: Vec<u64>,
    /// accelerate's `end_of_dataloader`: true on the last step only.
    pub end_of_dataloader: bool,
    /// accelerate's `remainder` on the last step (rows of the last global batch before
    /// padding); `None` (accelerate's -1) before.
    pub remainder: Option<u64>,
}

/// Which rows of a dispatched global batch one rank takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchSlice {
    /// The global batch is first extended with the first `world_size` rows of the iteration's
    /// first global batch (the last, uneven step without `drop_last`).
    pub padded: bool,
    /// First row of this rank's slice (in the extended batch), clipped to its length.
    pub start: u64,
    /// One past the last row, clipped to the extended batch's length.
    pub end: u64,
}

/// accelerate's cut of a global batch of `rows` rows (the dispatcher's `observed_batch_size`)
/// for `rank` of `world_size`: `rows / P` rows each, or on the `last` step, when `P` does not
/// divide `rows` and without `drop_last`, `rows / P + 1` rows of the batch extended by
/// `padding` rows (the first `P` rows of the first global batch, fewer when it had fewer).
pub fn dispatch_slice(
    rows: u64,
    padding: u64,
    world_size: u64,
    rank: u64,
    last: bool,
    drop_last: bool,
) -> DispatchSlice {
    let p = world_size.max(1);
    let padded = !drop_last && last && !rows.is_multiple_of(p);
    let per = rows / p + u64::from(padded);
    let len = rows + if padded { padding } else { 0 };
    let at = |k: u64| k.saturating_mul(per).min(len);
    DispatchSlice { padded, start: at(rank), end: at(rank.saturating_add(1)) }
}

/// accelerate's `len()` of a `DataLoaderDispatcher` whose underlying loader has `base_batches`
/// batches: one step per batch with `split_batches`, else one per `world_size` of them, a
/// last partial group counted unless `drop_last`.
pub fn dispatch_len(base_batches: u64, world_size: u64, split_batches: bool, drop_last: bool) -> u64 {
    let p = world_size.max(1);
    if split_batches {
        base_batches
    } else if drop_last {
        base_batches / p
    } else {
        base_batches.div_ceil(p)
    }
}

/// Batches of the underlying torch `BatchSampler` over an epoch order: chunks of
/// `batch_size`, the last one short unless `drop_last`.
pub fn base_batches(order: EpochOrder, batch_size: u64, drop_last: bool) -> impl Iterator<Item = Vec<u64>> {
    let n = order.len();
    let bs = batch_size.max(1);
    let count = if drop_last { n / bs } else { n.div_ceil(bs) };
    (0..count).map(move |i| order.range(i * bs, (i + 1) * bs))
}

/// The dispatcher of one rank.
pub struct Dispatcher<'a, C: Collective + ?Sized> {
    comm: &'a C,
    source: Option<Box<dyn Iterator<Item = Vec<u64>> + 'a>>,
    split_batches: bool,
    drop_last: bool,
    skip_batches: u64,
    first_keep: Option<Vec<u64>>,
    next: Option<Fetched>,
    step: u64,
    done: bool,
}

impl<C: Collective + ?Sized> std::fmt::Debug for Dispatcher<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("rank", &self.comm.rank())
            .field("step", &self.step)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct Fetched {
    batch: Option<Vec<u64>>,
    exhausted: bool,
}

impl Fetched {
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![u8::from(self.batch.is_some()), u8::from(self.exhausted)];
        for x in self.batch.iter().flatten() {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8], rank: u64) -> Result<Self> {
        let bad = || DataloadError::Dispatch {
            op: "broadcast",
            rank,
            reason: format!("malformed dispatch message of {} bytes", bytes.len()),
        };
        let (head, body) = bytes.split_at_checked(2).ok_or_else(bad)?;
        if body.len() % 8 != 0 || head[0] > 1 || head[1] > 1 {
            return Err(bad());
        }
        let batch = (head[0] == 1).then(|| {
            body.chunks_exact(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(c);
                    u64::from_le_bytes(w)
                })
                .collect()
        });
        Ok(Self { batch, exhausted: head[1] == 1 })
    }
}

impl<'a, C: Collective + ?Sized> Dispatcher<'a, C> {
    /// `source` is the underlying loader's batches and is read on rank 0 only (other ranks
    /// may pass `None`). `skip_batches` steps are produced and discarded, as accelerate does
    /// for iterable datasets in `skip_first_batches`.
    pub fn new(
        comm: &'a C,
        source: Option<Box<dyn Iterator<Item = Vec<u64>> + 'a>>,
        split_batches: bool,
        drop_last: bool,
        skip_batches: u64,
    ) -> Self {
        Self {
            comm,
            source,
            split_batches,
            drop_last,
            skip_batches,
            first_keep: None,
            next: None,
            step: 0,
            done: false,
        }
    }

    fn fetch(&mut self) -> Result<Fetched> {
        let rank = self.comm.rank();
        let msg = if rank == 0 {
            let source = self.source.as_mut().ok_or(DataloadError::Dispatch {
                op: "broadcast",
                rank,
                reason: "rank 0 needs the underlying batches".into(),
            })?;
            let fetched = if self.split_batches {
                let batch = source.next();
                Fetched { exhausted: batch.is_none(), batch }
            } else {
                let mut rows = Vec::new();
                let mut taken = 0;
                let mut exhausted = false;
                for _ in 0..self.comm.world_size() {
                    match source.next() {
                        Some(b) => {
                            rows.extend(b);
                            taken += 1;
                        }
                        None => {
                            exhausted = true;
                            break;
                        }
                    }
                }
                // A partial group is only kept without drop_last (accelerate's second
                // broadcast).
                let keep = taken > 0 && (!exhausted || !self.drop_last);
                Fetched { batch: keep.then_some(rows), exhausted }
            };
            Some(fetched.encode())
        } else {
            None
        };
        let bytes = self.comm.broadcast(0, msg)?;
        Fetched::decode(&bytes, rank)
    }

    /// This rank's next batch, or `None` once the underlying loader is exhausted.
    pub fn next_batch(&mut self) -> Result<Option<DispatchedBatch>> {
        loop {
            if self.done {
                return Ok(None);
            }
            let current = match self.next.take() {
                Some(f) => f,
                None => self.fetch()?,
            };
            let Some(mut batch) = current.batch else {
                // accelerate raises on an empty underlying loader; there is nothing to yield.
                self.done = true;
                return Ok(None);
            };
            let p = self.comm.world_size();
            if !self.drop_last && self.first_keep.is_none() {
                self.first_keep = Some(batch.iter().take(usize::try_from(p).unwrap_or(usize::MAX)).copied().collect());
            }
            let obs = batch.len() as u64;
            let mut last = current.exhausted;
            if !last {
                let ahead = self.fetch()?;
                if ahead.exhausted && ahead.batch.is_none() {
                    last = true;
                }
                self.next = Some(ahead);
            }
            let padding = self.first_keep.as_ref().map_or(0, |f| f.len() as u64);
            let cut = dispatch_slice(obs, padding, p, self.comm.rank(), last, self.drop_last);
            if cut.padded {
                batch.extend(self.first_keep.iter().flatten().copied());
            }
            // Both are at most the batch's length, which is a usize.
            let out = DispatchedBatch {
                rows: batch[cut.start as usize..cut.end as usize].to_vec(),
                end_of_dataloader: last,
                remainder: last.then_some(obs),
            };
            self.done = last;
            let step = self.step;
            self.step += 1;
            if step >= self.skip_batches {
                return Ok(Some(out));
            }
        }
    }

    /// All remaining batches of this rank.
    pub fn collect_all(&mut self) -> Result<Vec<DispatchedBatch>> {
        let mut out = Vec::new();
        while let Some(b) = self.next_batch()? {
            out.push(b);
        }
        Ok(out)
    }
}

/// accelerate's `gather_for_metrics` for index rows: gathers every rank's rows in rank
/// order and, on the last step, keeps only the first `remainder` (dropping padding).
pub fn gather_for_metrics<C: Collective + ?Sized>(
    comm: &C,
    rows: &[u64],
    end_of_dataloader: bool,
    remainder: Option<u64>,
) -> Result<Vec<u64>> {
    let bytes: Vec<u8> = rows.iter().flat_map(|x| x.to_le_bytes()).collect();
    let gathered = comm.all_gather(bytes)?;
    let mut all = Vec::new();
    for part in gathered {
        if part.len() % 8 != 0 {
            return Err(DataloadError::Dispatch {
                op: "all_gather",
                rank: comm.rank(),
                reason: format!("a rank sent {} bytes, not whole indices", part.len()),
            });
        }
        all.extend(part.chunks_exact(8).map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        }));
    }
    if end_of_dataloader {
        if let Some(r) = remainder.filter(|&r| r > 0) {
            all.truncate(usize::try_from(r).unwrap_or(usize::MAX));
        }
    }
    Ok(all)
}
