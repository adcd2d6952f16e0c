//! The dispatcher's steps as decisions, apart from the batches themselves.
//!
//! accelerate's `DataLoaderDispatcher` reads (on rank 0) one underlying batch per step with
//! `split_batches`, else `P` of them joined; broadcasts the global batch and whether the loader
//! ran out; reads one step ahead to know the last step; keeps the first rows of the first
//! global batch to pad an uneven last one; and cuts each global batch for every rank
//! ([`dispatch_slice`]). [`DispatchSteps`] is that sequence with the batches left out: it says
//! when to fetch, when to stop and how to cut and pad, from the row counts it is told. The
//! [`crate::Dispatcher`] drives it over index batches and a [`crate::Collective`]; the Python
//! package drives it over torch batches and torch.distributed.

use std::collections::VecDeque;

use crate::dispatch::{dispatch_slice, DispatchSlice};

/// What one fetch brought: the rows of a global batch (none once the loader is exhausted and
/// nothing is kept) and whether the underlying loader ran out during it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetched {
    /// Rows of the global batch, `None` when there is none.
    pub rows: Option<u64>,
    /// The underlying loader ran out.
    pub exhausted: bool,
}

/// One step's cut: of the oldest global batch fetched and not yet cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchCut {
    /// Rows of this global batch to keep (its first ones) for padding a last uneven step: set
    /// on the first step without `drop_last`, 0 otherwise.
    pub keep_first: u64,
    /// This rank's slice; with `padded`, of the batch extended by the kept rows.
    pub slice: DispatchSlice,
    /// The last step (accelerate's `end_of_dataloader`).
    pub last: bool,
    /// accelerate's `remainder` on the last step: the global batch's rows before padding.
    pub remainder: Option<u64>,
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchAction {
    /// Fetch the next global batch (rank 0 reads [`DispatchSteps::group`] underlying batches;
    /// every rank takes the broadcast) and report it with [`DispatchSteps::fetched`].
    Fetch,
    /// Hand out this rank's cut of the oldest global batch fetched, which is then done with.
    Cut(DispatchCut),
    /// The pass is over.
    Stop,
}

/// One rank's dispatcher, as decisions.
#[derive(Debug, Clone)]
pub struct DispatchSteps {
    world_size: u64,
    rank: u64,
    split_batches: bool,
    drop_last: bool,
    /// The fetched global batches not cut yet: the current one and the one read ahead.
    held: VecDeque<Fetched>,
    /// Rows kept from the first global batch for padding, once known.
    padding: Option<u64>,
    done: bool,
}

impl DispatchSteps {
    /// The dispatcher of `rank` of `world_size`, with the underlying loader's `drop_last`. A
    /// world of 0 counts as one rank, and a rank outside the world gets empty cuts (as
    /// [`dispatch_slice`] gives them): callers check their world where they take it.
    pub fn new(world_size: u64, rank: u64, split_batches: bool, drop_last: bool) -> Self {
        Self {
            world_size: world_size.max(1),
            rank,
            split_batches,
            drop_last,
            held: VecDeque::new(),
            padding: None,
            done: false,
        }
    }

    /// Underlying batches rank 0 reads for one global batch.
    pub fn group(&self) -> u64 {
        if self.split_batches {
            1
        } else {
            self.world_size
        }
    }

    /// Whether `taken` underlying batches, read before the loader ran out part-way through a
    /// group, are sent as a last, short global batch (accelerate's second broadcast): only
    /// without `drop_last`.
    pub fn keeps_partial(&self, taken: u64) -> bool {
        taken > 0 && !self.drop_last
    }

    /// What rank 0 sends for a fetch that read `taken` underlying batches of `rows` rows in all
    /// (`taken < group()`: the loader ran out).
    pub fn fetch_result(&self, taken: u64, rows: u64) -> Fetched {
        let exhausted = taken < self.group();
        let kept = taken > 0 && (!exhausted || self.keeps_partial(taken));
        Fetched { rows: kept.then_some(rows), exhausted }
    }

    /// Records what the fetch [`DispatchAction::Fetch`] asked for brought.
    pub fn fetched(&mut self, fetched: Fetched) {
        self.held.push_back(fetched);
    }

    /// The next action.
    pub fn next_action(&mut self) -> DispatchAction {
        if self.done {
            return DispatchAction::Stop;
        }
        let Some(&current) = self.held.front() else {
            return DispatchAction::Fetch;
        };
        let Some(rows) = current.rows else {
            // accelerate raises on an empty underlying loader; there is nothing to hand out.
            self.done = true;
            self.held.clear();
            return DispatchAction::Stop;
        };
        let mut last = current.exhausted;
        if !last {
            match self.held.get(1) {
                None => return DispatchAction::Fetch,
                Some(ahead) => last = ahead.exhausted && ahead.rows.is_none(),
            }
        }
        let mut keep_first = 0;
        if !self.drop_last && self.padding.is_none() {
            keep_first = rows.min(self.world_size);
            self.padding = Some(keep_first);
        }
        let slice = dispatch_slice(rows, self.padding.unwrap_or(0), self.world_size, self.rank, last, self.drop_last);
        self.held.pop_front();
        self.done = last;
        DispatchAction::Cut(DispatchCut { keep_first, slice, last, remainder: last.then_some(rows) })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The cuts of one rank over underlying batches of `sizes` rows, with every fetch done
    /// here as rank 0 does it: `(keep_first, padded, start, end, last, remainder)`.
    fn run(sizes: &[u64], world: u64, rank: u64, split: bool, drop_last: bool) -> Vec<(u64, bool, u64, u64, bool)> {
        let mut steps = DispatchSteps::new(world, rank, split, drop_last);
        let mut it = sizes.iter();
        let mut out = Vec::new();
        loop {
            match steps.next_action() {
                DispatchAction::Fetch => {
                    let got: Vec<u64> = it.by_ref().take(steps.group() as usize).copied().collect();
                    steps.fetched(steps.fetch_result(got.len() as u64, got.iter().sum()));
                }
                DispatchAction::Cut(c) => {
                    out.push((c.keep_first, c.slice.padded, c.slice.start, c.slice.end, c.last));
                    if c.last && !drop_last {
                        assert_eq!(
                            c.remainder,
                            Some(sizes.iter().sum::<u64>() - fetched_before_last(sizes, world, split))
                        );
                    }
                }
                DispatchAction::Stop => return out,
            }
        }
    }

    /// Rows of all global batches before the last, without `drop_last` (for the remainder check).
    fn fetched_before_last(sizes: &[u64], world: u64, split: bool) -> u64 {
        let group = if split { 1 } else { world as usize };
        let groups = sizes.len().div_ceil(group);
        sizes.iter().take((groups - 1) * group).sum()
    }

    #[test]
    fn uneven_last_step_is_padded_with_the_first_rows() {
        // 7 rows in batches of 2 over 2 ranks (test_bindings_dispatch): global batches of 4, 3.
        let sizes = [2, 2, 2, 1];
        assert_eq!(run(&sizes, 2, 0, false, false), vec![(2, false, 0, 2, false), (0, true, 0, 2, true)]);
        assert_eq!(run(&sizes, 2, 1, false, false), vec![(2, false, 2, 4, false), (0, true, 2, 4, true)]);
    }

    #[test]
    fn split_batches_cut_each_underlying_batch() {
        let sizes = [4, 4, 2];
        assert_eq!(
            run(&sizes, 2, 1, true, false),
            vec![(2, false, 2, 4, false), (0, false, 2, 4, false), (0, false, 1, 2, true)]
        );
    }

    #[test]
    fn drop_last_sends_no_partial_group() {
        let steps = DispatchSteps::new(2, 0, false, true);
        assert_eq!(steps.fetch_result(1, 3), Fetched { rows: None, exhausted: true });
        let sizes = [3, 3, 3];
        assert_eq!(run(&sizes, 2, 0, false, true), vec![(0, false, 0, 3, true)]);
    }

    #[test]
    fn an_empty_loader_stops_at_once() {
        assert_eq!(run(&[], 3, 2, false, false), vec![]);
        assert_eq!(run(&[], 1, 0, true, true), vec![]);
    }

    #[test]
    fn a_rank_outside_the_world_gets_empty_cuts() {
        assert_eq!(run(&[2, 2], 2, 5, false, false), vec![(2, false, 4, 4, true)]);
        assert_eq!(run(&[2], 0, 0, true, false), vec![(1, false, 0, 2, true)]);
    }
}
