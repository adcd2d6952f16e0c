//! Rust errors as Python exceptions.
//!
//! The classes live in the pure-Python `statekit.errors`, one per variant of `ckpt::Error`,
//! `dataload::DataloadError` and `collective::CollectiveError`, under a parent per enum; this
//! module passes the enum, the variant, the message and the structured fields, and
//! `statekit.errors._from_native` builds the exception (an I/O error also subclasses the
//! matching `OSError`: `FileNotFoundError`, `PermissionError`, ...).

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The variant's name, from its `Debug` form (`Variant { .. }`, `Variant(..)` or `Variant`).
fn variant_of(debug: &str) -> String {
    debug.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
}

fn io_kind(e: &std::io::Error) -> (&'static str, Option<i32>) {
    use std::io::ErrorKind as K;
    let kind = match e.kind() {
        K::NotFound => "NotFound",
        K::PermissionDenied => "PermissionDenied",
        K::AlreadyExists => "AlreadyExists",
        K::IsADirectory => "IsADirectory",
        K::NotADirectory => "NotADirectory",
        K::Interrupted => "Interrupted",
        K::TimedOut => "TimedOut",
        _ => "Other",
    };
    (kind, e.raw_os_error())
}

fn build(
    domain: &str,
    variant: String,
    message: String,
    fill: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> PyErr {
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let fields = PyDict::new(py);
            fill(&fields)?;
            let errors = py.import("statekit.errors")?;
            let exc = errors.getattr("_from_native")?.call1((domain, variant.as_str(), message.as_str(), fields))?;
            Ok(PyErr::from_value(exc))
        })();
        made.unwrap_or_else(|e| e)
    })
}

/// A `ckpt` error.
pub(crate) fn ckpt(e: ckpt::Error) -> PyErr {
    let variant = variant_of(&format!("{e:?}"));
    let message = e.to_string();
    build("ckpt", variant, message, |d| {
        d.set_item("invalid_data", e.is_invalid_data())?;
        match &e {
            ckpt::Error::Io { path, source } => {
                let (kind, errno) = io_kind(source);
                d.set_item("path", path.display().to_string())?;
                d.set_item("io_kind", kind)?;
                d.set_item("errno", errno)?;
            }
            ckpt::Error::RefusedGlobal { path, global } => {
                d.set_item("path", path.display().to_string())?;
                d.set_item("global_name", global)?;
                d.set_item("globals", vec![global.clone()])?;
            }
            ckpt::Error::GlobalNotAllowed { path, globals, .. } => {
                d.set_item("path", path.display().to_string())?;
                d.set_item("global_name", globals.first().cloned().unwrap_or_default())?;
                d.set_item("globals", globals.clone())?;
            }
            ckpt::Error::Collective { source, .. } => {
                d.set_item("cause", source.to_string())?;
            }
            _ => {}
        }
        Ok(())
    })
}

/// A `ckpt` error of `variant` whose message the bindings word themselves (a hint that names
/// the Python argument instead of the CLI flag).
pub(crate) fn ckpt_variant(variant: &str, message: String) -> PyErr {
    build("ckpt", variant.into(), message, |d| d.set_item("invalid_data", true))
}

/// A `dataload` error.
pub(crate) fn dataload(e: dataload::DataloadError) -> PyErr {
    let variant = variant_of(&format!("{e:?}"));
    let message = e.to_string();
    build("dataload", variant, message, |d| {
        match &e {
            dataload::DataloadError::StateMismatch { field, saved, current } => {
                d.set_item("field", *field)?;
                d.set_item("saved", saved)?;
                d.set_item("current", current)?;
            }
            dataload::DataloadError::Io { path, source } => {
                let (kind, errno) = io_kind(source);
                d.set_item("path", path.display().to_string())?;
                d.set_item("io_kind", kind)?;
                d.set_item("errno", errno)?;
            }
            _ => {}
        }
        Ok(())
    })
}

/// A usage error found by the bindings themselves (`ValueError` under `StatekitError`).
pub(crate) fn usage(message: impl Into<String>) -> PyErr {
    build("bindings", "Usage".into(), message.into(), |_| Ok(()))
}

/// Runs `f` (a call into the libraries, usually with the GIL released), turning a panic into a
/// `StatekitError` naming `what` (the file or the operation): the last line behind the
/// libraries' own checks, so that no input makes a pyo3 `PanicException` reach Python.
pub(crate) fn unpanicked<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let reason = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(build(
            "dataload",
            "Internal".into(),
            format!("{what}: statekit failed on it ({reason}); this is a bug, please report it with the input"),
            |_| Ok(()),
        ))
    })
}
