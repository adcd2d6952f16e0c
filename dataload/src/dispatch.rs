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

use std::collections::VecDeque;

use collective::Collective;

use crate::dispatch_steps::{DispatchAction, DispatchSteps, Fetched};
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

/// The dispatcher of one rank: [`DispatchSteps`] over index batches, rank 0's broadcast
/// through a [`Collective`].
pub struct Dispatcher<'a, C: Collective + ?Sized> {
    comm: &'a C,
    source: Option<Box<dyn Iterator<Item = Vec<u64>> + 'a>>,
    steps: DispatchSteps,
    skip_batches: u64,
    /// The global batches fetched and not cut yet (as many as `steps` holds).
    held: VecDeque<Vec<u64>>,
    first_keep: Vec<u64>,
    step: u64,
}

impl<C: Collective + ?Sized> std::fmt::Debug for Dispatcher<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("rank", &self.comm.rank())
            .field("step", &self.step)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

/// What rank 0 broadcasts for one fetch.
#[derive(Debug, Clone)]
struct Message {
    batch: Option<Vec<u64>>,
    exhausted: bool,
}

impl Message {
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
        let steps = DispatchSteps::new(comm.world_size(), comm.rank(), split_batches, drop_last);
        Self { comm, source, steps, skip_batches, held: VecDeque::new(), first_keep: Vec::new(), step: 0 }
    }

    /// Fetches the next global batch: rank 0 reads it and broadcasts it; every rank holds it.
    fn fetch(&mut self) -> Result<()> {
        let rank = self.comm.rank();
        let msg = if rank == 0 {
            let source = self.source.as_mut().ok_or(DataloadError::Dispatch {
                op: "broadcast",
                rank,
                reason: "rank 0 needs the underlying batches".into(),
            })?;
            let mut rows = Vec::new();
            let mut taken = 0;
            for b in source.by_ref().take(usize::try_from(self.steps.group()).unwrap_or(usize::MAX)) {
                rows.extend(b);
                taken += 1;
            }
            let fetched = self.steps.fetch_result(taken, rows.len() as u64);
            Some(Message { batch: fetched.rows.map(|_| rows), exhausted: fetched.exhausted }.encode())
        } else {
            None
        };
        let msg = Message::decode(&self.comm.broadcast(0, msg)?, rank)?;
        self.steps.fetched(Fetched { rows: msg.batch.as_ref().map(|b| b.len() as u64), exhausted: msg.exhausted });
        self.held.push_back(msg.batch.unwrap_or_default());
        Ok(())
    }

    /// This rank's next batch, or `None` once the underlying loader is exhausted.
    pub fn next_batch(&mut self) -> Result<Option<DispatchedBatch>> {
        loop {
            let cut = match self.steps.next_action() {
                DispatchAction::Fetch => {
                    self.fetch()?;
                    continue;
                }
                DispatchAction::Stop => return Ok(None),
                DispatchAction::Cut(cut) => cut,
            };
            let mut batch = self.held.pop_front().unwrap_or_default();
            if cut.keep_first > 0 {
                self.first_keep =
                    batch.iter().take(usize::try_from(cut.keep_first).unwrap_or(usize::MAX)).copied().collect();
            }
            if cut.slice.padded {
                batch.extend(self.first_keep.iter().copied());
            }
            // Both are at most the batch's length, which is a usize.
            let (start, end) = (cut.slice.start as usize, cut.slice.end as usize);
            let out = DispatchedBatch {
                rows: batch.get(start..end).map(<[u64]>::to_vec).unwrap_or_default(),
                end_of_dataloader: cut.last,
                remainder: cut.remainder,
            };
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
