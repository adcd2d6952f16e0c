//! A rank's share of the training state ([`RankState`]): its weights, the buffers a step moves
//! gradients and parameters through, and its checkpoint writer; with [`RankState::step`],
//! [`RankState::save`] and [`RankState::resume`].
//!
//! # Buffers
//!
//! Every host buffer a step needs (the whole model's gradients and parameters, the blocks the
//! collectives send and receive, the rank's own gradient) is allocated once, at the start:
//! a step allocates nothing of the model's size.
//!
//! # Two sets of weights
//!
//! The rank keeps two sets of parameters and moments. A step reads the current set and writes
//! its result into the other ([`AdamW::step_into`], the same bits as stepping in place), which
//! then becomes current. A save shares the current set with the writer (an `Arc`, no copy), so
//! an asynchronous save costs the loop no copy: the next step writes into the other set while
//! the writer reads. The step after that writes into the saved set again; if the writer still
//! holds it then, the step waits for the save to finish (counted as stall).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::args::Mode;
use crate::comm::{Comm, TensorComm};
use crate::model::Gpt;
use crate::optim::{clip_factor, AdamW};
use crate::saver::Saver;
use crate::shards::Shards;
use crate::state::{self, ParamMeta, Snapshot, TrainState, Weights};

/// Where a rank's loop spends its time, summed over its steps (seconds).
#[derive(Default, Debug)]
pub(crate) struct Times {
    pub(crate) step: f64,
    pub(crate) data: f64,
    pub(crate) compute: f64,
    pub(crate) comm: f64,
    /// The loop held up by checkpoints: synchronous saves, queueing asynchronous ones, and
    /// waiting for the writer to give a set of weights back.
    pub(crate) stall: f64,
    /// The part of `stall` spent waiting for the writer to give a set back.
    pub(crate) writer_wait: f64,
}

/// The optimizer's settings for one step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepSettings {
    pub(crate) adamw: AdamW,
    pub(crate) lr: f64,
    /// Clip to this global gradient norm (0: no clipping).
    pub(crate) grad_clip: f64,
}

/// What this rank's micro-batches of a step gave: the sum of their (accumulation-scaled)
/// losses and their token count.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LocalLoss {
    pub(crate) loss_sum: f64,
    pub(crate) tokens: u64,
}

/// One step over all ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepStats {
    /// The mean over ranks of their losses.
    pub(crate) loss: f64,
    /// Tokens trained on, all ranks.
    pub(crate) tokens: u64,
}

/// How a save went, for the log line.
#[derive(Debug)]
pub(crate) enum Saved {
    /// Handed to the writer thread after `stall` seconds.
    Queued { stall: f64 },
    /// Written and committed in `took` seconds.
    Written { dir: std::path::PathBuf, took: f64 },
}

/// A checkpoint to take: what the JSON says, and where.
#[derive(Debug)]
pub(crate) struct SaveRequest<'a> {
    pub(crate) dir: &'a Path,
    pub(crate) state: TrainState,
    pub(crate) lr: f64,
    pub(crate) keep_last: usize,
    pub(crate) pause_ms: u64,
    /// The run's last save: wait until an asynchronous one is committed.
    pub(crate) last: bool,
}

/// Host buffers of a step, allocated once.
#[derive(Debug)]
struct StepBuffers {
    /// The whole model's parameters (sharded: all-gathered each step).
    full: Vec<f32>,
    /// The whole model's gradients, from the device.
    grads: Vec<f32>,
    /// This rank's gradient, averaged over ranks (and clipped).
    grad_own: Vec<f32>,
    /// Sharded: this rank's parameters padded to the longest segment (all-gather's send).
    gather_send: Vec<f32>,
    /// Sharded: every rank's padded segment (all-gather's receive).
    gathered: Vec<f32>,
    /// Sharded: each rank's gradient segment, padded, back to back (reduce-scatter's send).
    scatter_send: Vec<f32>,
    /// Sharded: this rank's summed padded segment (reduce-scatter's receive).
    scattered: Vec<f32>,
}

/// A rank's share of the training state.
#[derive(Debug)]
pub(crate) struct RankState {
    mode: Mode,
    rank: u64,
    world: u64,
    shards: Shards,
    /// Optimizer steps taken.
    step: u64,
    /// The two sets of weights; `sets[current]` is the rank's state.
    sets: [Arc<Weights>; 2],
    current: usize,
    bufs: StepBuffers,
    saver: Option<Saver>,
}

impl RankState {
    /// The state at step 0: the initial parameters `full` (the whole model, the same on every
    /// rank), zero moments.
    pub(crate) fn new(mode: Mode, comm: &Comm, params: Vec<ParamMeta>, full: Vec<f32>) -> Self {
        let (rank, world) = (TensorComm::rank(comm), comm.size());
        let shards = Shards::new(params, world);
        let own_len = match mode {
            Mode::Ddp => full.len(),
            Mode::Sharded => shards.len(rank),
        };
        let mut first = Weights::zeros(own_len);
        match mode {
            Mode::Ddp => first.params.copy_from_slice(&full),
            Mode::Sharded => shards.cut_into(&full, rank, &mut first.params),
        }
        let blocks = if mode == Mode::Sharded { shards.max() } else { 0 };
        let bufs = StepBuffers {
            grads: vec![0.0; full.len()],
            grad_own: vec![0.0; own_len],
            gather_send: vec![0.0; blocks],
            gathered: vec![0.0; blocks * world as usize],
            scatter_send: vec![0.0; blocks * world as usize],
            scattered: vec![0.0; blocks],
            full,
        };
        let sets = [Arc::new(first), Arc::new(Weights::zeros(own_len))];
        RankState { mode, rank, world, shards, step: 0, sets, current: 0, bufs, saver: None }
    }

    /// From now on, checkpoints are written by `saver`'s thread.
    pub(crate) fn attach_saver(&mut self, saver: Saver) {
        self.saver = Some(saver);
    }

    /// Optimizer steps taken.
    pub(crate) fn steps_taken(&self) -> u64 {
        self.step
    }

    /// Elements of parameters this rank keeps (and of each moment).
    pub(crate) fn own_len(&self) -> usize {
        self.bufs.grad_own.len()
    }

    /// Reads `dir/latest`, this rank's rows of it, into the current set; `check` may refuse the
    /// checkpoint before anything is taken from it. Returns the checkpoint's state and folder.
    pub(crate) fn resume(
        &mut self,
        dir: &Path,
        check: impl FnOnce(&state::Loaded) -> anyhow::Result<()>,
    ) -> anyhow::Result<(TrainState, std::path::PathBuf)> {
        let (mode, world, rank) = (self.mode, self.world, self.rank);
        let own = |pm: &ParamMeta| match mode {
            Mode::Ddp => 0..pm.rows(),
            Mode::Sharded => pm.chunk(world, rank),
        };
        let loaded = state::load(dir, self.shards_params(), rank, &own)?;
        check(&loaded)?;
        if loaded.weights.params.len() != self.own_len() {
            anyhow::bail!("{}: rank {rank}: the checkpoint holds another number of elements", loaded.dir.display());
        }
        self.sets[self.current] = Arc::new(loaded.weights);
        self.step = loaded.state.step;
        Ok((loaded.state, loaded.dir))
    }

    fn shards_params(&self) -> &[ParamMeta] {
        self.shards.params()
    }

    /// Writes the current parameters into the model: in `ddp` mode the rank's own (the whole
    /// model), in `sharded` mode every rank's, all-gathered.
    pub(crate) fn load_model(&mut self, gpt: &Gpt, comm: &Comm) {
        match self.mode {
            Mode::Ddp => write_params(gpt, &self.sets[self.current].params),
            Mode::Sharded => {
                let b = &mut self.bufs;
                let own = &self.sets[self.current].params;
                b.gather_send[..own.len()].copy_from_slice(own);
                comm.all_gather_f32(&b.gather_send, &mut b.gathered);
                let max = self.shards.max();
                for r in 0..self.world {
                    let seg = &b.gathered[r as usize * max..(r as usize + 1) * max];
                    self.shards.place(seg, r, &mut b.full);
                }
                write_params(gpt, &b.full);
            }
        }
    }

    /// One optimizer step from the gradients `gpt` holds (this rank's micro-batches, which gave
    /// `local`): gradients to the host, averaged over ranks, clipped, AdamW into the other set
    /// of weights, which becomes current. In `ddp` mode the model then holds the new
    /// parameters; in `sharded` mode [`load_model`](Self::load_model) gathers them before the
    /// next forward pass.
    pub(crate) fn step(
        &mut self,
        gpt: &Gpt,
        comm: &Comm,
        settings: &StepSettings,
        local: LocalLoss,
        times: &mut Times,
    ) -> anyhow::Result<StepStats> {
        let t = Instant::now();
        read_grads(gpt, &mut self.bufs.grads);
        let local_sq = self.average_grads(comm);
        // The loss and token count always need summing; the squared norm only where each rank
        // holds a part of the gradient.
        let mut sums = [local_sq, local.loss_sum, local.tokens as f64];
        match self.mode {
            Mode::Sharded => comm.all_reduce_sum_f64(&mut sums),
            Mode::Ddp => comm.all_reduce_sum_f64(&mut sums[1..]),
        }
        times.comm += t.elapsed().as_secs_f64();
        let [sq_norm, loss_sum, tokens] = sums;
        let grad_norm = sq_norm.sqrt();
        let c = clip_factor(grad_norm, settings.grad_clip);
        if c != 1.0 {
            self.bufs.grad_own.iter_mut().for_each(|g| *g *= c);
        }

        let waited = self.reclaim_next()?;
        times.stall += waited;
        times.writer_wait += waited;
        let (cur, next) = current_and_next(&mut self.sets, self.current)?;
        let from = [cur.params.as_slice(), &cur.exp_avg, &cur.exp_avg_sq];
        let to = [next.params.as_mut_slice(), &mut next.exp_avg, &mut next.exp_avg_sq];
        settings.adamw.step_into(self.step + 1, settings.lr as f32, &self.bufs.grad_own, from, to);
        self.current = 1 - self.current;
        self.step += 1;
        if self.mode == Mode::Ddp {
            write_params(gpt, &self.sets[self.current].params);
        }
        Ok(StepStats { loss: loss_sum / self.world as f64, tokens: tokens as u64 })
    }

    /// Averages the host gradients over ranks into this rank's share (`grad_own`); returns the
    /// sum of squares of that share.
    fn average_grads(&mut self, comm: &Comm) -> f64 {
        let b = &mut self.bufs;
        match self.mode {
            Mode::Ddp => comm.all_reduce_sum_into(&b.grads, &mut b.grad_own),
            Mode::Sharded => {
                let max = self.shards.max();
                for r in 0..self.world {
                    let block = &mut b.scatter_send[r as usize * max..(r as usize + 1) * max];
                    self.shards.cut_into(&b.grads, r, block);
                }
                comm.reduce_scatter_sum(&b.scatter_send, &mut b.scattered);
                let n = b.grad_own.len();
                b.grad_own.copy_from_slice(&b.scattered[..n]);
            }
        }
        let inv = 1.0 / self.world as f32;
        b.grad_own.iter_mut().for_each(|g| *g *= inv);
        b.grad_own.iter().map(|&g| f64::from(g) * f64::from(g)).sum()
    }

    /// Makes sure the writer no longer holds the set the next step writes into (waiting for
    /// its save to finish if it does); returns the seconds waited.
    fn reclaim_next(&mut self) -> anyhow::Result<f64> {
        let next = 1 - self.current;
        if Arc::strong_count(&self.sets[next]) == 1 {
            return Ok(0.0);
        }
        let t = Instant::now();
        if let Some(s) = self.saver.as_mut() {
            s.wait()?;
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Checkpoints the current set: written now, or handed to the writer thread (which shares
    /// the set, no copy) when there is one.
    pub(crate) fn save(&mut self, req: SaveRequest<'_>, comm: &Comm) -> anyhow::Result<Saved> {
        let t = Instant::now();
        let rows = match self.mode {
            // A ddp rank keeps the whole model; it saves FSDP2's chunk of it.
            Mode::Ddp => self.shards.ranges(self.rank),
            Mode::Sharded => self.shards.local_ranges(self.rank),
        };
        let snap = Snapshot {
            step: self.step,
            weights: Arc::clone(&self.sets[self.current]),
            rows,
            state: req.state,
            lr: req.lr,
            pause_ms: req.pause_ms,
        };
        match self.saver.as_mut() {
            Some(sv) => {
                sv.submit(req.dir.to_path_buf(), snap, req.keep_last)?;
                let stall = t.elapsed().as_secs_f64();
                if req.last {
                    sv.wait()?;
                }
                Ok(Saved::Queued { stall })
            }
            None => {
                let dir = state::save(req.dir, &snap, req.keep_last, comm)?;
                Ok(Saved::Written { dir, took: t.elapsed().as_secs_f64() })
            }
        }
    }

    /// Waits for the last checkpoint and stops the writer thread.
    pub(crate) fn finish(&mut self) -> anyhow::Result<()> {
        match self.saver.take() {
            Some(s) => s.finish(),
            None => Ok(()),
        }
    }
}

/// The current set to read, and the other one to write (which nobody else may hold).
fn current_and_next(sets: &mut [Arc<Weights>; 2], current: usize) -> anyhow::Result<(&Weights, &mut Weights)> {
    let [a, b] = sets;
    let (cur, next) = if current == 0 { (a, b) } else { (b, a) };
    let next = Arc::get_mut(next).ok_or_else(|| anyhow::anyhow!("the checkpoint writer still holds the weights"))?;
    Ok((cur, next))
}

/// The model's gradients into `grads` (parameter after parameter; zeros for a parameter
/// without one).
fn read_grads(gpt: &Gpt, grads: &mut [f32]) {
    let mut at = 0;
    for (_, t) in &gpt.params {
        let n = t.numel();
        let g = t.grad();
        if g.defined() {
            g.to_kind(tch::Kind::Float)
                .to_device(tch::Device::Cpu)
                .contiguous()
                .view([-1])
                .copy_data(&mut grads[at..at + n], n);
        } else {
            grads[at..at + n].fill(0.0);
        }
        at += n;
    }
}

/// The whole model's parameters `full` into the model's tensors.
pub(crate) fn write_params(gpt: &Gpt, full: &[f32]) {
    let mut at = 0;
    for (_, t) in &gpt.params {
        let n = t.numel();
        crate::host::copy_to_tensor(t, &full[at..at + n]);
        at += n;
    }
}
