//! accelerate's `prepare_data_loader` decisions for the Python loaders
//! (`dataload::DataLoaderConfiguration::resolve`): the Python package asks here how a loader
//! shards and with which batch size, and keeps no copy of those rules.

use pyo3::prelude::*;

use crate::args;
use crate::errors;

/// How a loader over a map-style (`iterable = False`) or iterable dataset of `batch_size`
/// (`None`: unbatched, or no fixed size) is prepared on rank `rank` of `world_size`:
/// `(dispatches, loader_batch_size)`, accelerate's defaults applied (`dispatch_batches=None`)
/// and its refusals raised as `InvalidConfiguration` (a `ValueError`).
#[pyfunction]
#[pyo3(signature = (iterable, batch_size, world_size, rank, put_on_device, split_batches, dispatch_batches, even_batches=true))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve_loader(
    iterable: bool,
    batch_size: Option<&Bound<'_, PyAny>>,
    world_size: &Bound<'_, PyAny>,
    rank: &Bound<'_, PyAny>,
    put_on_device: bool,
    split_batches: bool,
    dispatch_batches: Option<bool>,
    even_batches: bool,
) -> PyResult<(bool, Option<usize>)> {
    let batch_size = batch_size.map(|b| args::size(b, "batch_size", 0, dataload::MAX_BATCH_SIZE)).transpose()?;
    let world_size = args::size(world_size, "num_processes", 0, dataload::MAX_WORLD_SIZE)?;
    let rank = args::size(rank, "process_index", 0, u64::MAX)?;
    let config = dataload::DataLoaderConfiguration {
        split_batches,
        dispatch_batches,
        even_batches,
        ..dataload::DataLoaderConfiguration::default()
    };
    let dataset = if iterable { dataload::DatasetKind::Iterable } else { dataload::DatasetKind::Map };
    let shape = dataload::LoaderShape { dataset, batch_size, world_size, rank, put_on_device };
    let resolved = config.resolve(shape).map_err(errors::dataload)?;
    Ok((resolved.dispatches(), resolved.loader_batch_size))
}
