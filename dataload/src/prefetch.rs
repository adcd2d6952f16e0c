//! The loader: a [`ShardedSampler`] that says which samples, a [`Source`] that reads them,
//! and background workers that read ahead.
//!
//! # Order and state do not depend on the workers
//!
//! Only the calling thread touches the sampler. It *issues* batches in the sampler's order,
//! numbering them, up to `prefetch` ahead of what was consumed; workers read them in any
//! order and send them back tagged with their number; the calling thread hands them out by
//! number. So the order is the sampler's whatever the number of workers (0 reads in the
//! calling thread, on demand).
//!
//! Each issued batch carries the sampler's state as it was right after that batch was
//! produced. Handing a batch out makes that the loader's state, so [`DataLoader::state_dict`]
//! describes what was *consumed*: batches read ahead but not handed out are not in it, and a
//! loader restored from it starts at the first of them. The end of an epoch is issued like a
//! batch (a marker), so prefetching runs on into the next epoch and the state at an epoch's
//! end is still exact.
//!
//! A batch that fails to read is handed out as an error at its place and counts as consumed;
//! the loader then goes on with the next batch.

use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{DataloadError, Result};
use crate::loader::{ShardedSampler, ShardedSamplerBuilder};
use crate::source::Source;
use crate::state::LoaderState;

/// How a loader starts.
#[derive(Debug)]
enum Start {
    Fresh(ShardedSamplerBuilder),
    Resume { state: LoaderState, world_size: u64, rank: u64 },
}

/// Builds a [`DataLoader`]; every check happens in [`DataLoaderBuilder::build`].
#[derive(Debug)]
pub struct DataLoaderBuilder<S> {
    source: Arc<S>,
    start: Start,
    workers: usize,
    prefetch: Option<usize>,
}

impl<S: Source> DataLoaderBuilder<S> {
    /// Background workers (0: read in the calling thread; default 0).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Batches read ahead of the consumer (default: twice the workers, like torch's
    /// `prefetch_factor = 2`). Ignored without workers.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// Validates and starts the workers.
    pub fn build(self) -> Result<DataLoader<S>> {
        let current = self.source.fingerprint().id();
        let sampler = match self.start {
            Start::Fresh(b) => {
                let b = b.dataset_len(self.source.len()).fingerprint(current);
                match self.source.mixture() {
                    Some(spec) => b.mixture(spec.clone()).build()?,
                    None => b.build()?,
                }
            }
            Start::Resume { state, world_size, rank } => {
                if state.fingerprint.as_deref() != Some(current.as_str()) {
                    return Err(DataloadError::DataChanged {
                        saved: state.fingerprint.clone().unwrap_or_else(|| "none".into()),
                        current,
                    });
                }
                // A mixture may have gained weight changes since (a curriculum decided
                // mid-run): checked field by field, then continued with the source's.
                let mut state = state;
                match (self.source.mixture(), &state.mixture) {
                    (Some(now), Some(saved)) => {
                        now.check_resumes(saved, state.cursor)?;
                        state.mixture = Some(now.clone());
                    }
                    (None, None) => {}
                    (now, saved) => {
                        let shown = |m: Option<&crate::MixtureSpec>| {
                            m.map_or("null".into(), |m| serde_json::to_string(m).unwrap_or_default())
                        };
                        return Err(DataloadError::StateMismatch {
                            field: "mixture",
                            saved: shown(saved.as_ref()),
                            current: shown(now),
                        });
                    }
                }
                ShardedSampler::from_state(&state, world_size, rank)?
            }
        };
        if sampler.dataset_len() != self.source.len() {
            return Err(DataloadError::StateMismatch {
                field: "dataset_len",
                saved: sampler.dataset_len().to_string(),
                current: self.source.len().to_string(),
            });
        }
        let prefetch = if self.workers == 0 { 1 } else { self.prefetch.unwrap_or(2 * self.workers) };
        if prefetch == 0 {
            return Err(DataloadError::InvalidValue {
                field: "prefetch",
                value: "0".into(),
                reason: "workers need at least one batch to read ahead",
            });
        }
        let pool = (self.workers > 0).then(|| Pool::start(self.source.clone(), self.workers, prefetch));
        Ok(DataLoader {
            consumed: sampler.state_dict(),
            source: self.source,
            sampler,
            pool,
            prefetch,
            pending: VecDeque::new(),
            ready: BTreeMap::new(),
            next_seq: 0,
            generation: 0,
        })
    }
}

/// What was issued and not yet consumed.
#[derive(Debug)]
struct Pending {
    seq: u64,
    /// `None`: the end of an epoch. Without workers the indices wait here to be read.
    batch: Option<Option<Vec<u64>>>,
    state_after: LoaderState,
}

struct Job {
    generation: u64,
    seq: u64,
    indices: Vec<u64>,
}

type Done<B> = (u64, u64, Result<B>);

#[derive(Debug)]
struct Pool<B> {
    jobs: Option<SyncSender<Job>>,
    results: Receiver<Done<B>>,
    handles: Vec<JoinHandle<()>>,
}

impl<B: Send + 'static> Pool<B> {
    fn start<S: Source<Batch = B>>(source: Arc<S>, workers: usize, depth: usize) -> Self {
        let (jobs, job_rx) = sync_channel::<Job>(depth);
        let (done_tx, results) = channel::<Done<B>>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let handles = (0..workers)
            .map(|_| {
                let (source, job_rx, done_tx): (Arc<S>, _, Sender<Done<B>>) =
                    (source.clone(), job_rx.clone(), done_tx.clone());
                std::thread::spawn(move || loop {
                    let job = match job_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    let Ok(job) = job else { return };
                    let result = catch_unwind(AssertUnwindSafe(|| source.read_batch(&job.indices)))
                        .unwrap_or_else(|_| Err(DataloadError::Worker { reason: "reading a batch panicked".into() }));
                    if done_tx.send((job.generation, job.seq, result)).is_err() {
                        return;
                    }
                })
            })
            .collect();
        Self { jobs: Some(jobs), results, handles }
    }
}

impl<B> Drop for Pool<B> {
    fn drop(&mut self) {
        self.jobs.take();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Batches of a [`Source`] in a [`ShardedSampler`]'s order, read ahead by background workers,
/// with an exact, worker-independent state (see the module docs).
pub struct DataLoader<S: Source> {
    source: Arc<S>,
    /// Where issuing is: ahead of the consumer by the pending batches.
    sampler: ShardedSampler,
    /// The state after the last batch handed out.
    consumed: LoaderState,
    pool: Option<Pool<S::Batch>>,
    prefetch: usize,
    pending: VecDeque<Pending>,
    ready: BTreeMap<u64, Result<S::Batch>>,
    next_seq: u64,
    /// Bumped when the pipeline is reset; results of older generations are dropped.
    generation: u64,
}

impl<S: Source> std::fmt::Debug for DataLoader<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("source", &self.source)
            .field("state", &self.consumed)
            .field("workers", &self.pool.as_ref().map_or(0, |p| p.handles.len()))
            .field("prefetch", &self.prefetch)
            .field("prefetched", &self.pending.len())
            .finish()
    }
}

impl<S: Source> DataLoader<S> {
    /// A loader over `source` with the sampler settings of `sampler` (its dataset length,
    /// fingerprint and mixture are taken from the source).
    pub fn builder(source: Arc<S>, sampler: ShardedSamplerBuilder) -> DataLoaderBuilder<S> {
        DataLoaderBuilder { source, start: Start::Fresh(sampler), workers: 0, prefetch: None }
    }

    /// A loader over `source` continuing from `state` (saved on any world size) as `rank` of
    /// `world_size`; refused when the source's fingerprint is not the one saved.
    pub fn resume(source: Arc<S>, state: LoaderState, world_size: u64, rank: u64) -> DataLoaderBuilder<S> {
        DataLoaderBuilder { source, start: Start::Resume { state, world_size, rank }, workers: 0, prefetch: None }
    }

    /// The source.
    pub fn source(&self) -> &Arc<S> {
        &self.source
    }

    /// The epoch of the next batch handed out.
    pub fn epoch(&self) -> u64 {
        self.consumed.epoch
    }

    /// The state after the last batch handed out: what to save.
    pub fn state_dict(&self) -> LoaderState {
        self.consumed.clone()
    }

    /// Continues from `state` (the prefetched batches are dropped).
    pub fn load_state_dict(&mut self, state: &LoaderState) -> Result<()> {
        let current = self.source.fingerprint().id();
        if state.fingerprint.as_deref() != Some(current.as_str()) {
            return Err(DataloadError::DataChanged {
                saved: state.fingerprint.clone().unwrap_or_else(|| "none".into()),
                current,
            });
        }
        self.sampler.load_state_dict(state)?;
        self.reset();
        Ok(())
    }

    /// Moves to the start of `epoch` (the prefetched batches are dropped).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler.set_epoch(epoch);
        self.reset();
    }

    /// Batches read ahead and not yet handed out.
    pub fn prefetched(&self) -> usize {
        self.pending.len()
    }

    fn reset(&mut self) {
        self.generation += 1;
        self.pending.clear();
        self.ready.clear();
        self.consumed = self.sampler.state_dict();
    }

    /// The next batch of this rank, or `None` at the end of an epoch (the loader is then at
    /// the start of the next one).
    pub fn next_batch(&mut self) -> Result<Option<S::Batch>> {
        self.fill()?;
        let p = self.pending.pop_front().ok_or(DataloadError::Worker { reason: "nothing issued".into() })?;
        let result = match p.batch {
            None => None,
            Some(Some(indices)) => Some(self.source.read_batch(&indices)),
            Some(None) => Some(self.wait_for(p.seq)),
        };
        self.consumed = p.state_after;
        self.fill()?;
        result.transpose()
    }

    /// Issues batches until `prefetch` are pending.
    fn fill(&mut self) -> Result<()> {
        while self.pending.len() < self.prefetch {
            let seq = self.next_seq;
            self.next_seq += 1;
            let indices = self.sampler.next_batch()?;
            let state_after = self.sampler.state_dict();
            let batch = match (indices, &self.pool) {
                (None, _) => None,
                (Some(indices), None) => Some(Some(indices)),
                (Some(indices), Some(pool)) => {
                    let job = Job { generation: self.generation, seq, indices };
                    pool.jobs
                        .as_ref()
                        .and_then(|j| j.send(job).ok())
                        .ok_or(DataloadError::Worker { reason: "the workers are gone".into() })?;
                    Some(None)
                }
            };
            self.pending.push_back(Pending { seq, batch, state_after });
        }
        Ok(())
    }

    fn wait_for(&mut self, seq: u64) -> Result<S::Batch> {
        loop {
            if let Some(r) = self.ready.remove(&seq) {
                return r;
            }
            let pool = self.pool.as_ref().ok_or(DataloadError::Worker { reason: "no workers".into() })?;
            let (generation, got, result) =
                pool.results.recv().map_err(|_| DataloadError::Worker { reason: "the workers are gone".into() })?;
            if generation == self.generation {
                self.ready.insert(got, result);
            }
        }
    }
}
