//! Loader states in the forms the Python package saves besides `dataload`'s own: torchdata's
//! record of a one-process position, and the iterable loader's `"statekit.iterable"` header.
//! `dataload` owns the schemas; Python only moves the values in and out of its dicts.

use dataload::{IterableState, LoaderState, TorchGenerator};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::args::{self, MAX_LEN};
use crate::errors;

/// A `LoaderState` (JSON) in torchdata's words, `(samples_yielded, generator)` (the generator's
/// `get_state()` bytes, `None` for a sequential sampler), or `None` where they do not say it all.
#[pyfunction]
pub(crate) fn torchdata_position<'py>(
    py: Python<'py>,
    state: &str,
) -> PyResult<Option<(u64, Option<Bound<'py, PyBytes>>)>> {
    let state = LoaderState::from_json(state).map_err(errors::dataload)?;
    Ok(state.to_torchdata().map(|p| (p.samples_yielded, p.generator.map(|g| PyBytes::new(py, &g.state_bytes())))))
}

/// The epoch a loader state (JSON) is in, or `None` when it is not a `LoaderState` this build
/// reads (loading it says why).
#[pyfunction]
pub(crate) fn state_epoch(state: &str) -> Option<u64> {
    LoaderState::from_json(state).ok().map(|s| s.epoch)
}

/// An iterable loader's state header, as JSON.
#[pyfunction]
pub(crate) fn iterable_state_json(epoch: &Bound<'_, PyAny>, batches: &Bound<'_, PyAny>) -> PyResult<String> {
    let epoch = args::uint(epoch, "epoch", 0, MAX_LEN)?;
    let batches = args::uint(batches, "batches", 0, MAX_LEN)?;
    Ok(IterableState { epoch, batches }.to_json())
}

/// `(epoch, batches)` of an iterable loader's state header given as JSON.
#[pyfunction]
pub(crate) fn parse_iterable_state(state: &str) -> PyResult<(u64, u64)> {
    let s = IterableState::from_json(state).map_err(errors::dataload)?;
    Ok((s.epoch, s.batches))
}

/// The `LoaderState` (JSON) of `sampler`'s settings at the position torchdata recorded.
pub(crate) fn from_torchdata(
    mine: &LoaderState,
    samples_yielded: &Bound<'_, PyAny>,
    generator: Option<&Bound<'_, PyBytes>>,
) -> PyResult<String> {
    let samples_yielded = args::uint(samples_yielded, "samples_yielded", 0, u64::MAX)?;
    let generator =
        generator.map(|g| TorchGenerator::from_state_bytes(g.as_bytes())).transpose().map_err(errors::dataload)?;
    let state =
        mine.with_torchdata(dataload::TorchdataPosition { samples_yielded, generator }).map_err(errors::dataload)?;
    state.to_json().map_err(errors::dataload)
}
