//! The arithmetic of accelerate's iterable loaders (`IterableDatasetShard` and
//! `DataLoaderDispatcher`), for the Python classes that hold the items: `dataload` decides which
//! positions, lengths and cuts; Python moves the objects.

use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::args::{self, MAX_LEN};
use crate::errors;

/// accelerate's `IterableDatasetShard` as positions (`dataload::StreamPlan`), for the Python
/// shard that holds the items: `(chunk_len, start, end)` of this rank in each full chunk, and
/// what it yields from a short last chunk of `last_len` items, as `(from_first, position)`
/// (`from_first`: a position in the first full chunk, of `first_len` items).
#[pyfunction]
#[pyo3(signature = (batch_size, drop_last, world_size, rank, split_batches, last_len=0, first_len=None))]
#[allow(clippy::type_complexity)]
pub(crate) fn stream_plan(
    batch_size: &Bound<'_, PyAny>,
    drop_last: bool,
    world_size: &Bound<'_, PyAny>,
    rank: &Bound<'_, PyAny>,
    split_batches: bool,
    last_len: usize,
    first_len: Option<usize>,
) -> PyResult<((usize, usize, usize), Vec<(bool, usize)>)> {
    let batch_size = args::size(batch_size, "batch_size", 0, dataload::MAX_BATCH_SIZE)?;
    let world_size = args::size(world_size, "num_processes", 0, dataload::MAX_WORLD_SIZE)?;
    let rank = args::size(rank, "process_index", 0, u64::MAX)?;
    let plan =
        dataload::StreamPlan::new(batch_size, drop_last, world_size, rank, split_batches).map_err(errors::dataload)?;
    let tail = plan.tail(last_len.min(plan.chunk_len() - 1), first_len).into_iter().map(|t| match t {
        dataload::TailItem::Last(i) => (false, i),
        dataload::TailItem::First(i) => (true, i),
    });
    Ok(((plan.chunk_len(), plan.slice().start, plan.slice().end), tail.collect()))
}

/// accelerate's dispatcher cut of a global batch of `rows` rows (`dataload::dispatch_slice`):
/// `(padded, start, end)`.
#[pyfunction]
pub(crate) fn dispatch_slice(
    rows: u64,
    padding: u64,
    world_size: u64,
    rank: u64,
    last: bool,
    drop_last: bool,
) -> (bool, u64, u64) {
    let cut = dataload::dispatch_slice(rows, padding, world_size, rank, last, drop_last);
    (cut.padded, cut.start, cut.end)
}

/// accelerate's `IterableDatasetShard.__len__` over a stream of `length` items
/// (`dataload::stream_accelerate_len`).
#[pyfunction]
pub(crate) fn stream_len(
    length: &Bound<'_, PyAny>,
    batch_size: &Bound<'_, PyAny>,
    drop_last: bool,
    world_size: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    let length = args::size(length, "length", 0, MAX_LEN)?;
    let batch_size = args::size(batch_size, "batch_size", 1, dataload::MAX_BATCH_SIZE)?;
    let world_size = args::size(world_size, "num_processes", 1, dataload::MAX_WORLD_SIZE)?;
    Ok(dataload::stream_accelerate_len(length, batch_size, drop_last, world_size))
}

/// accelerate's `DataLoaderDispatcher.__len__` over an underlying loader of `base_batches`
/// batches (`dataload::dispatch_len`).
#[pyfunction]
pub(crate) fn dispatch_len(
    base_batches: &Bound<'_, PyAny>,
    world_size: &Bound<'_, PyAny>,
    split_batches: bool,
    drop_last: bool,
) -> PyResult<u64> {
    let base_batches = args::uint(base_batches, "base_batches", 0, MAX_LEN)?;
    let world_size = args::uint(world_size, "num_processes", 1, dataload::MAX_WORLD_SIZE)?;
    Ok(dataload::dispatch_len(base_batches, world_size, split_batches, drop_last))
}

/// accelerate's dispatcher as decisions (`dataload::DispatchSteps`): the Python dispatcher
/// fetches, broadcasts, joins and slices the batches it says.
#[pyclass(module = "statekit._native", name = "DispatchSteps")]
#[derive(Debug)]
pub(crate) struct DispatchSteps {
    inner: dataload::DispatchSteps,
}

#[pymethods]
impl DispatchSteps {
    #[new]
    fn new(
        world_size: &Bound<'_, PyAny>,
        rank: &Bound<'_, PyAny>,
        split_batches: bool,
        drop_last: bool,
    ) -> PyResult<Self> {
        let world_size = args::uint(world_size, "num_processes", 1, dataload::MAX_WORLD_SIZE)?;
        let rank = args::uint(rank, "process_index", 0, world_size - 1)?;
        Ok(Self { inner: dataload::DispatchSteps::new(world_size, rank, split_batches, drop_last) })
    }

    /// Underlying batches rank 0 reads per fetch.
    #[getter]
    fn group(&self) -> u64 {
        self.inner.group()
    }

    /// For a fetch that read `taken` underlying batches: `(kept, exhausted)`, whether they are
    /// sent as a global batch and whether the loader ran out.
    fn fetch_result(&self, taken: u64) -> (bool, bool) {
        let f = self.inner.fetch_result(taken, 0);
        (f.rows.is_some(), f.exhausted)
    }

    /// What the fetch brought: the global batch's rows (`None`: no batch), and whether the
    /// loader ran out.
    fn fetched(&mut self, rows: Option<u64>, exhausted: bool) {
        self.inner.fetched(dataload::Fetched { rows, exhausted });
    }

    /// `"fetch"`; a cut of the oldest batch fetched, `(keep_first, padded, start, end)`; or
    /// `None` once the pass is over.
    fn next_action<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(match self.inner.next_action() {
            dataload::DispatchAction::Fetch => Some(PyString::new(py, "fetch").into_any()),
            dataload::DispatchAction::Cut(c) => Some(
                PyTuple::new(
                    py,
                    [
                        c.keep_first.into_pyobject(py)?.into_any(),
                        pyo3::types::PyBool::new(py, c.slice.padded).to_owned().into_any(),
                        c.slice.start.into_pyobject(py)?.into_any(),
                        c.slice.end.into_pyobject(py)?.into_any(),
                    ],
                )?
                .into_any(),
            ),
            dataload::DispatchAction::Stop => None,
        })
    }
}
