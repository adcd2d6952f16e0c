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

/// How a bound reads in a message: the limits of Python's and torch's integers by name, large
/// powers of two as such, anything else in decimal.
fn shown(v: i128) -> String {
    const U64_MAX: i128 = u64::MAX as i128;
    const LEN_MAX: i128 = MAX_LEN as i128;
    const I64_MIN: i128 = i64::MIN as i128;
    match v {
        U64_MAX => "2^64 - 1".into(),
        LEN_MAX => "2^63 - 1".into(),
        I64_MIN => "-2^63".into(),
        v if v >= 1 << 32 && v.count_ones() == 1 => format!("2^{}", v.trailing_zeros()),
        v => v.to_string(),
    }
}

fn refuse(obj: &Bound<'_, PyAny>, name: &str, min: i128, max: i128) -> PyErr {
    let repr = obj.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
    errors::usage(format!("`{name}` must be an int in [{}, {}], not {repr}", shown(min), shown(max)))
}

/// The int `obj` (the argument `name`) when it lies in `[min, max]`.
pub(crate) fn uint(obj: &Bound<'_, PyAny>, name: &str, min: u64, max: u64) -> PyResult<u64> {
    if !obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyBool>() {
        return Err(refuse(obj, name, min.into(), max.into()));
    }
    match obj.extract::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(refuse(obj, name, min.into(), max.into())),
    }
}

/// The integer `value` (the argument `name`: an int or anything with `__index__`, numpy's
/// integers included, but not a bool) when it lies in `[lo, hi]`, else a `UsageError` naming
/// the argument and its range: the Python package's check of its own arguments, worded as the
/// native calls word theirs.
#[pyfunction]
pub(crate) fn check_int(name: &str, value: &Bound<'_, PyAny>, lo: i128, hi: i128) -> PyResult<i128> {
    if value.is_instance_of::<PyBool>() {
        return Err(refuse(value, name, lo, hi));
    }
    // pyo3 converts through `__index__`: floats and strings are refused here.
    match value.extract::<i128>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(refuse(value, name, lo, hi)),
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
