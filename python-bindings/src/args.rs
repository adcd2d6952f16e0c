//! Integer arguments, checked here rather than by pyo3's conversion: a Python int that does not
//! fit the Rust type (a negative count, a length of 2^64) is a `UsageError` (a `ValueError`)
//! that names the argument and its range, not a bare `OverflowError`, and a value the package
//! cannot later hand back (a length past what Python's `len` counts) is refused when given,
//! not when first used.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

use crate::errors;

/// 2^63 - 1: what Python's `len` (a `Py_ssize_t`) and torch's indices (`int64`) count.
pub(crate) const MAX_LEN: u64 = i64::MAX as u64;

/// How a bound reads in a message.
fn shown(v: u64) -> String {
    match v {
        u64::MAX => "2^64 - 1".into(),
        MAX_LEN => "2^63 - 1".into(),
        v if v >= 1 << 20 && v.is_power_of_two() => format!("2^{}", v.trailing_zeros()),
        v => v.to_string(),
    }
}

fn refuse(obj: &Bound<'_, PyAny>, name: &str, min: u64, max: u64) -> PyErr {
    let repr = obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
    errors::usage(format!("`{name}` must be an int in [{}, {}], not {repr}", shown(min), shown(max)))
}

/// The int `obj` (the argument `name`) when it lies in `[min, max]`.
pub(crate) fn uint(obj: &Bound<'_, PyAny>, name: &str, min: u64, max: u64) -> PyResult<u64> {
    if !obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyBool>() {
        return Err(refuse(obj, name, min, max));
    }
    match obj.extract::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(refuse(obj, name, min, max)),
    }
}

/// [`uint`] as a `usize`.
pub(crate) fn size(obj: &Bound<'_, PyAny>, name: &str, min: u64, max: u64) -> PyResult<usize> {
    let max = max.min(usize::MAX as u64);
    uint(obj, name, min, max).map(|v| v as usize)
}

/// [`uint`], `None` allowed.
pub(crate) fn opt_uint(obj: Option<&Bound<'_, PyAny>>, name: &str, min: u64, max: u64) -> PyResult<Option<u64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => uint(o, name, min, max).map(Some),
    }
}

/// A sequence of ints, each checked as [`uint`] (named `name[k]`).
pub(crate) fn uint_list(obj: &Bound<'_, PyAny>, name: &str, max: u64) -> PyResult<Vec<u64>> {
    let mut out = Vec::new();
    for (k, item) in
        obj.try_iter().map_err(|_| errors::usage(format!("`{name}` must be a sequence of ints")))?.enumerate()
    {
        out.push(uint(&item?, &format!("{name}[{k}]"), 0, max)?);
    }
    Ok(out)
}
