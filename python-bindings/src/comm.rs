//! The `Collective` trait over Python callables (torch.distributed, from `statekit._dist`).
//!
//! The object passed in has `rank`, `world_size` and three methods: `broadcast(root, data)`,
//! `all_gather(data)` and `barrier()`, on `bytes`. Each trait call takes the GIL back for the
//! Python call; the Python exception that made one fail is kept and re-raised as it is.

use std::sync::Mutex;

use collective::{Collective, CollectiveError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

#[derive(Debug)]
pub(crate) struct PyCollective {
    rank: u64,
    world_size: u64,
    obj: Py<PyAny>,
    error: Mutex<Option<PyErr>>,
}

impl PyCollective {
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self {
            rank: obj.getattr("rank")?.extract()?,
            world_size: obj.getattr("world_size")?.extract()?,
            obj: obj.clone().unbind(),
            error: Mutex::new(None),
        })
    }

    /// The Python exception behind the last failed call, if any.
    pub(crate) fn take_error(&self) -> Option<PyErr> {
        self.error.lock().ok().and_then(|mut e| e.take())
    }

    fn call<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>,
    ) -> collective::Result<T> {
        Python::attach(|py| {
            f(py, self.obj.bind(py)).map_err(|e| {
                let reason = format!("torch.distributed: {e}");
                if let Ok(mut slot) = self.error.lock() {
                    *slot = Some(e);
                }
                CollectiveError::Failed { op, rank: self.rank, reason }
            })
        })
    }
}

impl Collective for PyCollective {
    fn rank(&self) -> u64 {
        self.rank
    }

    fn world_size(&self) -> u64 {
        self.world_size
    }

    fn broadcast(&self, root: u64, data: Option<Vec<u8>>) -> collective::Result<Vec<u8>> {
        self.call("broadcast", |py, obj| {
            let arg = data.map(|d| PyBytes::new(py, &d));
            obj.call_method1("broadcast", (root, arg))?.extract::<Vec<u8>>()
        })
    }

    fn all_gather(&self, data: Vec<u8>) -> collective::Result<Vec<Vec<u8>>> {
        self.call("all_gather", |py, obj| {
            obj.call_method1("all_gather", (PyBytes::new(py, &data),))?.extract::<Vec<Vec<u8>>>()
        })
    }

    fn barrier(&self) -> collective::Result<()> {
        self.call("barrier", |_, obj| obj.call_method0("barrier").map(|_| ()))
    }
}
