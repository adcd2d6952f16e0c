//! Batches from `dataload`: the default synthetic corpus, the token source, the rank's sampler
//! and, with `--dispatch-batches`, rank 0 reading every rank's rows and broadcasting them.
//!
//! The loop keeps its own step counter within the epoch's plan instead of the sampler's, so
//! that every rank moves to the next epoch at the same step even when the last step of an
//! uneven epoch (`--no-even-batches`) gives some ranks nothing; the saved [`LoaderState`] is the
//! sampler's with the cursor after that many global batches.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use collective::Collective;
use dataload::{DataLoaderConfiguration, LoaderState, ShardedSampler, Source, TokenBatch, TokenDtype, TokenWindows};

/// The synthetic corpus' vocabulary.
pub(crate) const SYNTHETIC_VOCAB: i64 = 64;

/// Writes the deterministic synthetic corpus to `path` unless it is there: `n` `u16` tokens of
/// a noisy "counting" language (each token is mostly the previous plus a small step that
/// depends on the one before), learnable in a few hundred steps. Written atomically and
/// durably (`durable`: a temporary beside it, fsynced, renamed), so a concurrent reader never
/// sees half of it, nor a crash leaves half of it.
pub(crate) fn ensure_synthetic(path: &Path, n: usize) -> anyhow::Result<()> {
    if path.is_file() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
    }
    let mut state = 0x5eed_u64;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let v = SYNTHETIC_VOCAB as u64;
    let (mut a, mut b) = (0u64, 1u64);
    let mut bytes = Vec::with_capacity(n * 2);
    for _ in 0..n {
        let r = next();
        let c = if r % 10 == 0 { (r >> 8) % v } else { (b + 1 + a % 3) % v };
        bytes.extend_from_slice(&(c as u16).to_le_bytes());
        (a, b) = (b, c);
    }
    durable::write_atomic(path, &bytes)?;
    Ok(())
}

/// The data side of one rank.
pub(crate) struct Data {
    source: Arc<TokenWindows>,
    sampler: ShardedSampler,
    step: u64,
    dispatch: bool,
    /// The source's files, for messages.
    pub(crate) spec: PathBuf,
}

impl std::fmt::Debug for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Data").field("spec", &self.spec).field("step", &self.step).finish()
    }
}

/// How to build the loader.
#[derive(Debug, Clone)]
pub(crate) struct DataOptions {
    pub(crate) spec: PathBuf,
    pub(crate) block_size: usize,
    pub(crate) batch_size: u64,
    pub(crate) config: DataLoaderConfiguration,
    pub(crate) seed: i128,
}

impl Data {
    /// A loader at the start of epoch 0 for `rank` of `world`.
    pub(crate) fn new(o: &DataOptions, world: u64, rank: u64) -> anyhow::Result<Data> {
        let source = Arc::new(TokenWindows::open(&o.spec, o.block_size, TokenDtype::U16)?);
        let sampler = ShardedSampler::builder()
            .dataset_len(source.len())
            .batch_size(o.batch_size)
            .world_size(world)
            .rank(rank)
            .shuffle(true)
            .torch_initial_seed(o.seed)
            .config(o.config)
            .fingerprint(source.fingerprint().id())
            .build()?;
        let dispatch = o.config.dispatch_batches == Some(true);
        Ok(Data { source, sampler, step: 0, dispatch, spec: o.spec.clone() })
    }

    /// Continues from `state` (saved by any world size).
    pub(crate) fn load(&mut self, state: &LoaderState) -> anyhow::Result<()> {
        self.sampler.load_state_dict(state)?;
        self.step = 0;
        Ok(())
    }

    /// The position after the batches handed out so far.
    pub(crate) fn state(&mut self) -> anyhow::Result<LoaderState> {
        let mut st = self.sampler.state_dict();
        let step = self.step;
        let plan = self.sampler.current_plan()?;
        st.cursor = plan.cursor_after(step);
        st.padding_origin = plan.pad_origin().min(st.cursor);
        Ok(st)
    }

    /// This rank's next batch (possibly empty on the uneven last step of an epoch) and the
    /// sample indices it holds. Moves to the next epoch when the current one is done.
    pub(crate) fn next(&mut self, comm: &dyn Collective) -> anyhow::Result<(TokenBatch, Vec<u64>)> {
        loop {
            let step = self.step;
            let (num, rows) = {
                let rank = self.sampler.rank();
                let plan = self.sampler.current_plan()?;
                (plan.num_steps(), plan.rank_batch(step, rank))
            };
            if step >= num {
                let e = self.sampler.epoch();
                self.sampler.set_epoch(e + 1);
                self.step = 0;
                continue;
            }
            self.step += 1;
            if !self.dispatch {
                let rows = rows.unwrap_or_default();
                return Ok((self.source.read_batch(&rows)?, rows));
            }
            // Rank 0 reads every rank's rows and broadcasts the tokens; the others only decode.
            let world = comm.world_size();
            let msg = if comm.rank() == 0 {
                let plan = self.sampler.current_plan()?;
                let mut out = Vec::new();
                for r in 0..world {
                    let rows = plan.rank_batch(step, r).unwrap_or_default();
                    let b = self.source.read_batch(&rows)?;
                    encode(&mut out, &rows, &b);
                }
                Some(out)
            } else {
                None
            };
            let bytes = comm.broadcast(0, msg)?;
            return decode(&bytes, comm.rank(), self.source.block_size());
        }
    }
}

fn encode(out: &mut Vec<u8>, rows: &[u64], b: &TokenBatch) {
    out.extend_from_slice(&(rows.len() as u64).to_le_bytes());
    for r in rows {
        out.extend_from_slice(&r.to_le_bytes());
    }
    for t in b.inputs.iter().chain(&b.targets) {
        out.extend_from_slice(&t.to_le_bytes());
    }
}

fn decode(bytes: &[u8], rank: u64, t: usize) -> anyhow::Result<(TokenBatch, Vec<u64>)> {
    let mut at = 0usize;
    let mut take = |n: usize| -> anyhow::Result<&[u8]> {
        let s = bytes.get(at..at + n).ok_or_else(|| anyhow::anyhow!("malformed dispatched batch"))?;
        at += n;
        Ok(s)
    };
    let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
    for r in 0.. {
        let n = u64_of(take(8)?) as usize;
        let rows: Vec<u64> = (0..n).map(|_| take(8).map(u64_of)).collect::<anyhow::Result<_>>()?;
        let toks = take(n * t * 2 * 8)?;
        if r == rank {
            let all: Vec<i64> =
                toks.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
            let (inputs, targets) = all.split_at(n * t);
            let b = TokenBatch { batch: n, block_size: t, inputs: inputs.to_vec(), targets: targets.to_vec() };
            return Ok((b, rows));
        }
    }
    anyhow::bail!("no batch for rank {rank}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_synthetic_corpus_is_written_whole_and_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("data");
        let path = dir.join("synthetic.bin");
        ensure_synthetic(&path, 1000).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 2000);
        assert!(bytes.chunks_exact(2).all(|c| i64::from(u16::from_le_bytes([c[0], c[1]])) < SYNTHETIC_VOCAB));
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["synthetic.bin"], "no temporary is left beside it");
        // Already there: left as it is.
        std::fs::write(&path, b"kept").unwrap();
        ensure_synthetic(&path, 1000).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
    }
}
