//! `dataload::PassState` for the Python sampler and loaders: when a pass continues the epoch
//! and when it starts it again. Python records the events; the rule is `dataload`'s.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors;

/// Where a loader stands between passes (`dataload::PassState`). Pickles (and copies) as its
/// state's name.
#[pyclass(module = "statekit._native", name = "PassState")]
#[derive(Debug, Default)]
pub(crate) struct PassState {
    inner: dataload::PassState,
}

fn name(state: dataload::PassState) -> &'static str {
    match state {
        dataload::PassState::Fresh => "fresh",
        dataload::PassState::Reading => "reading",
        dataload::PassState::Positioned => "positioned",
    }
}

#[pymethods]
impl PassState {
    #[new]
    #[pyo3(signature = (state="fresh"))]
    fn new(state: &str) -> PyResult<Self> {
        let inner = match state {
            "fresh" => dataload::PassState::Fresh,
            "reading" => dataload::PassState::Reading,
            "positioned" => dataload::PassState::Positioned,
            other => {
                return Err(errors::usage(format!(
                    "`state` must be \"fresh\", \"reading\" or \"positioned\", not {other:?}"
                )))
            }
        };
        Ok(Self { inner })
    }

    /// A pass begins: `"fresh"`, `"broken_off"` (start the epoch again) or `"from_position"`.
    fn begin(&mut self) -> &'static str {
        match self.inner.begin() {
            dataload::PassStart::Fresh => "fresh",
            dataload::PassStart::BrokenOff => "broken_off",
            dataload::PassStart::FromPosition => "from_position",
        }
    }

    /// A batch was handed out by the pass under way.
    fn batch_read(&mut self) {
        self.inner.batch_read();
    }

    /// The pass was read to its end.
    fn ended(&mut self) {
        self.inner.ended();
    }

    /// A position was set: the next pass continues from it.
    fn position_set(&mut self) {
        self.inner.position_set();
    }

    /// The loader moved to another epoch.
    fn epoch_set(&mut self) {
        self.inner.epoch_set();
    }

    /// Whether a set position stands (no batch read from it yet).
    #[getter]
    fn position_kept(&self) -> bool {
        self.inner.position_kept()
    }

    /// The state's name: `"fresh"`, `"reading"` or `"positioned"`.
    #[getter]
    fn state(&self) -> &'static str {
        name(self.inner)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let state = name(slf.borrow().inner);
        Ok((slf.get_type().into_any(), PyTuple::new(slf.py(), [state])?))
    }

    fn __repr__(&self) -> String {
        format!("PassState({:?})", name(self.inner))
    }
}
