//! `dataload`'s sharded sampler as a Python object; `statekit.data` wraps it.

use dataload::{DataLoaderConfiguration, LoaderState, ShardedSampler};
use pyo3::prelude::*;

use crate::errors;

/// One rank's accelerate-prepared batch sampler (`dataload::ShardedSampler`).
#[pyclass(module = "statekit._native", name = "Sampler")]
#[derive(Debug)]
pub(crate) struct Sampler {
    inner: ShardedSampler,
}

fn config_from_json(text: &str) -> PyResult<DataLoaderConfiguration> {
    serde_json::from_str(text).map_err(|e| errors::usage(format!("bad `DataLoaderConfiguration`: {e}")))
}

fn state_from_json(text: &str) -> PyResult<LoaderState> {
    LoaderState::from_json(text).map_err(errors::dataload)
}

#[pymethods]
impl Sampler {
    /// `config` is accelerate's `DataLoaderConfiguration` as JSON (dataload's field names).
    #[new]
    #[pyo3(signature = (length, batch_size, world_size, rank, shuffle, drop_last, config, fingerprint=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        length: u64,
        batch_size: u64,
        world_size: u64,
        rank: u64,
        shuffle: bool,
        drop_last: bool,
        config: &str,
        fingerprint: Option<String>,
    ) -> PyResult<Self> {
        let config = config_from_json(config)?;
        // A dispatched loader puts its batches on the device in accelerate (it refuses
        // `dispatch_batches` otherwise); per-rank sharding does not depend on it.
        let put_on_device = config.dispatch_batches == Some(true);
        let mut b = ShardedSampler::builder()
            .dataset_len(length)
            .batch_size(batch_size)
            .world_size(world_size)
            .rank(rank)
            .shuffle(shuffle)
            .drop_last(drop_last)
            .put_on_device(put_on_device)
            .config(config);
        if let Some(f) = fingerprint {
            b = b.fingerprint(f);
        }
        Ok(Self { inner: b.build().map_err(errors::dataload)? })
    }

    /// A sampler for `rank` of `world_size` with the settings and position of a saved state.
    #[staticmethod]
    fn from_state(state: &str, world_size: u64, rank: u64) -> PyResult<Self> {
        let state = state_from_json(state)?;
        Ok(Self { inner: ShardedSampler::from_state(&state, world_size, rank).map_err(errors::dataload)? })
    }

    /// This rank's next batch, or `None` at the end of the epoch, after which the sampler is
    /// at the start of the next epoch.
    fn next_batch(&mut self, py: Python<'_>) -> PyResult<Option<Vec<u64>>> {
        let inner = &mut self.inner;
        py.detach(|| inner.next_batch()).map_err(errors::dataload)
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.inner.set_epoch(epoch)
    }

    fn skip_first_batches(&mut self, k: u64) {
        self.inner.skip_first_batches(k)
    }

    /// Continues where dataloader `dataloader` of the accelerate `save_state` folder `folder`
    /// stopped: its saved batches per rank (or `step`) on the folder's world, moved to this
    /// sampler's world by the elastic rule. A seed the folder's pickled sampler holds must be
    /// this sampler's.
    #[pyo3(signature = (folder, dataloader=0, step=None, epoch=None))]
    fn resume_from_accelerate(
        &mut self,
        py: Python<'_>,
        folder: &str,
        dataloader: usize,
        step: Option<u64>,
        epoch: Option<u64>,
    ) -> PyResult<()> {
        let point = py
            .detach(|| {
                let ck = ckpt::Checkpoint::open(folder)?;
                match ck.save_state() {
                    Some(s) => s.resume_point(dataloader, step, epoch).map(Some),
                    None => Ok(None),
                }
            })
            .map_err(errors::ckpt)?
            .ok_or_else(|| errors::usage(format!("{folder}: not an accelerate `save_state` folder")))?;
        let state = self.inner.state_dict();
        if let (Some(saved), dataload::SamplerSpec::SeedableRandom { seed }) = (point.seed, &state.sampler) {
            if i128::from(saved) != *seed {
                return Err(errors::usage(format!(
                    "{folder}: the saved sampler's seed is {saved}, this sampler's {seed}"
                )));
            }
        }
        let mut saved = ShardedSampler::from_state(&state, point.world_size, 0).map_err(errors::dataload)?;
        saved.set_epoch(point.epoch);
        saved.skip_steps(point.batches);
        self.inner.load_state_dict(&saved.state_dict()).map_err(errors::dataload)
    }

    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }

    #[getter]
    fn rank(&self) -> u64 {
        self.inner.rank()
    }

    #[getter]
    fn world_size(&self) -> u64 {
        self.inner.geometry().world_size
    }

    #[getter]
    fn cursor(&self) -> u64 {
        self.inner.cursor()
    }

    /// Batches this rank gets in a whole epoch (accelerate's `len`).
    fn epoch_len(&self, py: Python<'_>) -> PyResult<u64> {
        let (inner, rank) = (&self.inner, self.inner.rank());
        py.detach(|| inner.plan_for_epoch(inner.epoch()).map(|p| p.rank_len(rank))).map_err(errors::dataload)
    }

    /// Batches left for this rank in the current epoch.
    fn remaining(&mut self, py: Python<'_>) -> PyResult<u64> {
        let inner = &mut self.inner;
        py.detach(|| inner.remaining()).map_err(errors::dataload)
    }

    /// The `LoaderState`, as JSON.
    fn state_json(&self) -> PyResult<String> {
        self.inner.state_dict().to_json().map_err(errors::dataload)
    }

    /// Continues from a `LoaderState` given as JSON (elastic across world sizes).
    fn load_state_json(&mut self, state: &str) -> PyResult<()> {
        let state = state_from_json(state)?;
        self.inner.load_state_dict(&state).map_err(errors::dataload)
    }
}

/// accelerate's defaults, as JSON in dataload's field names.
#[pyfunction]
pub(crate) fn default_config_json() -> PyResult<String> {
    serde_json::to_string(&DataLoaderConfiguration::default()).map_err(|e| errors::usage(e.to_string()))
}
