//! `dataload`'s sharded sampler as a Python object; `statekit.data` wraps it.

use dataload::{DataLoaderConfiguration, LoaderState, ShardedSampler, TorchGenerator};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::{self, MAX_LEN};
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

/// A saved state, refused when its dataset is longer than Python's `len` counts (a state is an
/// input: it must not make a sampler that fails only when its length is asked for).
fn state_from_json(text: &str) -> PyResult<LoaderState> {
    let state = LoaderState::from_json(text).map_err(errors::dataload)?;
    if state.dataset_len > MAX_LEN {
        return Err(errors::usage(format!(
            "the loader state's `dataset_len` is {}, more than the 2^63 - 1 samples Python's `len` counts",
            state.dataset_len
        )));
    }
    Ok(state)
}

#[pymethods]
impl Sampler {
    /// `config` is accelerate's `DataLoaderConfiguration` as JSON (dataload's field names).
    /// `generator` (a `torch.Generator`'s `get_state()` bytes) is what a shuffled loader without
    /// `use_seedable_sampler` draws its first epoch from.
    #[new]
    /// `mixture` (a `MixtureSpec` as JSON, `Mixture.spec_json()`) is the mixture the dataset's
    /// order is: the state records it, and a state of another mixture is refused by field.
    #[pyo3(signature = (length, batch_size, world_size, rank, shuffle, drop_last, config, fingerprint=None, generator=None, mixture=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        length: &Bound<'_, PyAny>,
        batch_size: &Bound<'_, PyAny>,
        world_size: &Bound<'_, PyAny>,
        rank: &Bound<'_, PyAny>,
        shuffle: bool,
        drop_last: bool,
        config: &str,
        fingerprint: Option<String>,
        generator: Option<&Bound<'_, PyBytes>>,
        mixture: Option<&str>,
    ) -> PyResult<Self> {
        let length = args::uint(length, "length", 0, MAX_LEN)?;
        // dataload's builder refuses what is out of its own ranges, by name.
        let batch_size = args::uint(batch_size, "batch_size", 0, u64::MAX)?;
        let world_size = args::uint(world_size, "world_size", 0, u64::MAX)?;
        let rank = args::uint(rank, "rank", 0, u64::MAX)?;
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
        if let Some(g) = generator {
            b = b.generator(TorchGenerator::from_state_bytes(g.as_bytes()).map_err(errors::dataload)?);
        }
        if let Some(m) = mixture {
            let spec: dataload::MixtureSpec =
                serde_json::from_str(m).map_err(|e| errors::usage(format!("bad mixture definition: {e}")))?;
            b = b.mixture(spec);
        }
        let inner = errors::unpanicked("the sampler's mixture", || b.build().map_err(errors::dataload))?;
        Ok(Self { inner })
    }

    /// A sampler for `rank` of `world_size` with the settings and position of a saved state.
    #[staticmethod]
    fn from_state(state: &str, world_size: &Bound<'_, PyAny>, rank: &Bound<'_, PyAny>) -> PyResult<Self> {
        let world_size = args::uint(world_size, "world_size", 0, u64::MAX)?;
        let rank = args::uint(rank, "rank", 0, u64::MAX)?;
        let state = state_from_json(state)?;
        Ok(Self { inner: ShardedSampler::from_state(&state, world_size, rank).map_err(errors::dataload)? })
    }

    /// This rank's next batch, or `None` at the end of the epoch, after which the sampler is
    /// at the start of the next epoch.
    fn next_batch(&mut self, py: Python<'_>) -> PyResult<Option<Vec<u64>>> {
        let inner = &mut self.inner;
        py.detach(|| inner.next_batch()).map_err(errors::dataload)
    }

    fn set_epoch(&mut self, epoch: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.set_epoch(args::uint(epoch, "epoch", 0, u64::MAX)?);
        Ok(())
    }

    fn skip_first_batches(&mut self, num_batches: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.skip_first_batches(args::uint(num_batches, "num_batches", 0, u64::MAX)?);
        Ok(())
    }

    /// Continues where dataloader `dataloader` of the accelerate `save_state` folder `folder`
    /// stopped: its saved batches per rank (or `step`) on the folder's world, moved to this
    /// sampler's world by the elastic rule. A seed the folder's pickled sampler holds must be
    /// this sampler's.
    #[pyo3(signature = (folder, dataloader=None, step=None, epoch=None))]
    fn resume_from_accelerate(
        &mut self,
        py: Python<'_>,
        folder: &str,
        dataloader: Option<&Bound<'_, PyAny>>,
        step: Option<&Bound<'_, PyAny>>,
        epoch: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let dataloader = args::opt_uint(dataloader, "dataloader", 0, usize::MAX as u64)?.unwrap_or(0) as usize;
        let step = args::opt_uint(step, "step", 0, u64::MAX)?;
        let epoch = args::opt_uint(epoch, "epoch", 0, u64::MAX)?;
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
        let saved = self
            .inner
            .state_at(point.world_size, point.epoch, point.batches, point.seed.map(i128::from))
            .map_err(errors::dataload)?;
        self.inner.load_state_dict(&saved).map_err(errors::dataload)
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
    fn epoch_len(&self) -> u64 {
        self.inner.epoch_len()
    }

    /// accelerate's `remainder` after a whole epoch (the rows of a dispatched loader's last
    /// global batch), `None` for accelerate's -1.
    fn epoch_remainder(&self) -> Option<u64> {
        self.inner.epoch_remainder()
    }

    /// Samples all ranks read per step (accelerate's `total_batch_size`).
    #[getter]
    fn global_batch(&self) -> u64 {
        self.inner.geometry().global_batch()
    }

    #[getter]
    fn split_batches(&self) -> bool {
        self.inner.geometry().split_batches
    }

    /// Whether the current epoch is drawn from a generator not drawn from yet (then
    /// `set_generator` may still give its running state).
    #[getter]
    fn needs_generator(&self) -> bool {
        self.inner.needs_generator()
    }

    /// The running state (`get_state()` bytes) of the generator the current epoch is drawn from.
    fn set_generator(&mut self, state: &Bound<'_, PyBytes>) -> PyResult<()> {
        let g = TorchGenerator::from_state_bytes(state.as_bytes()).map_err(errors::dataload)?;
        self.inner.set_generator(g).map_err(errors::dataload)
    }

    /// The generator's state as torch's would be now (after the current epoch's draw once it
    /// is drawn), as `get_state()` bytes; `None` unless the loader shuffles from a generator.
    fn running_generator<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let inner = &mut self.inner;
        let g = py.detach(|| inner.running_generator()).map_err(errors::dataload)?;
        Ok(g.map(|g| PyBytes::new(py, &g.state_bytes())))
    }

    /// `generator` (`get_state()` bytes) moved on as a rank that does not read a dispatched
    /// loader moves it when torch's workers prefetch `prefetched` batches at once.
    fn prefetch_advanced<'py>(
        &self,
        py: Python<'py>,
        generator: &Bound<'py, PyBytes>,
        prefetched: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let g = TorchGenerator::from_state_bytes(generator.as_bytes()).map_err(errors::dataload)?;
        let prefetched = args::uint(prefetched, "prefetched", 0, u64::MAX)?;
        let inner = &self.inner;
        let after = py.detach(|| inner.prefetch_advanced(&g, prefetched));
        Ok(PyBytes::new(py, &after.state_bytes()))
    }

    /// A new pass over the current epoch from its start (a random sampler draws a new order
    /// from its running generator), as torch's loaders make after a pass that was broken off.
    fn restart_epoch(&mut self, py: Python<'_>) -> PyResult<()> {
        let inner = &mut self.inner;
        py.detach(|| inner.restart_epoch()).map_err(errors::dataload)
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

    /// The `LoaderState` (JSON) of this sampler's settings at a position torchdata's own
    /// `BatchSampler` recorded (`samples_yielded`, and the generator state a shuffle was drawn
    /// from as `get_state()` bytes): one process, the current epoch.
    #[pyo3(signature = (samples_yielded, generator=None))]
    fn torchdata_state(
        &self,
        samples_yielded: &Bound<'_, PyAny>,
        generator: Option<&Bound<'_, PyBytes>>,
    ) -> PyResult<String> {
        crate::states::from_torchdata(&self.inner.state_dict(), samples_yielded, generator)
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
