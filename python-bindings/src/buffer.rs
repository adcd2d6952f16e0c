//! Borrowing the memory of a Python buffer (a numpy array, a `bytearray`, a `memoryview`)
//! through the buffer protocol: the only `unsafe` of the crate.
//!
//! A buffer is taken with `PyObject_GetBuffer` (pyo3's [`PyBuffer`]) and held until the call
//! returns, so its exporter keeps the memory alive and refuses to resize it meanwhile; every
//! check is made here, on the buffer that is kept, before a byte is touched: C-contiguous
//! (`TypeError` otherwise), writable for an output and of the expected length (`ValueError`),
//! each message naming the argument. Any item type is taken (an `int64` array is its bytes):
//! the buffer is seen through a `memoryview` cast to bytes. An output is lent as `&mut [u8]`
//! only through `&mut self` of the one owner of its export, and the calls that take several
//! outputs refuse ones that overlap ([`disjoint`]), so no two `&mut` ever alias.
#![allow(unsafe_code)]

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyMemoryView;

use crate::errors;

/// The C-contiguous buffer of `obj` (the argument `name`) as bytes, with the checks every
/// buffer gets; `writable` for an output.
fn get(obj: &Bound<'_, PyAny>, name: &str, writable: bool) -> PyResult<PyBuffer<u8>> {
    let kind = || obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    let view = PyMemoryView::from(obj).map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be a buffer (a numpy array, `bytearray` or `memoryview`), not `{}`",
            kind()
        ))
    })?;
    let not_contiguous =
        || PyTypeError::new_err(format!("{name} must be C-contiguous (hint: `numpy.ascontiguousarray`)"));
    if !view.getattr("c_contiguous")?.is_truthy()? {
        return Err(not_contiguous());
    }
    // Bytes whatever the item type: a C-contiguous view casts to `B` without a copy.
    let bytes = if view.getattr("format")?.extract::<String>()? == "B" {
        view
    } else {
        view.call_method1("cast", ("B",))?.cast_into()?
    };
    let buf = PyBuffer::<u8>::get(bytes.as_any())?;
    if !buf.is_c_contiguous() {
        return Err(not_contiguous());
    }
    if writable && buf.readonly() {
        return Err(errors::usage(format!("{name} is read-only: the output must be a writable buffer")));
    }
    Ok(buf)
}

fn check_len(buf: &PyBuffer<u8>, name: &str, len: Option<usize>) -> PyResult<()> {
    match len {
        Some(n) if buf.len_bytes() != n => {
            Err(errors::usage(format!("{name} has {} bytes, where {n} are needed", buf.len_bytes())))
        }
        _ => Ok(()),
    }
}

/// A Python buffer read for the length of a call.
#[derive(Debug)]
pub(crate) struct Bytes(PyBuffer<u8>);

impl Bytes {
    /// The buffer of `obj` (the argument `name`), of `len` bytes when given.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, name: &str, len: Option<usize>) -> PyResult<Bytes> {
        let buf = get(obj, name, false)?;
        check_len(&buf, name, len)?;
        Ok(Bytes(buf))
    }

    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the export is held as long as `self` (the exporter keeps the memory alive and
        // its size fixed), was checked C-contiguous, and spans `len_bytes` bytes from
        // `buf_ptr`. Python code running in another thread may still write to it meanwhile, as
        // it may while any extension reads a buffer without the GIL; the bytes read are then
        // torn, never out of bounds.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, len) }
    }
}

/// A writable Python buffer filled during a call.
#[derive(Debug)]
pub(crate) struct BytesMut(PyBuffer<u8>);

impl BytesMut {
    /// The writable buffer of `obj` (the argument `name`), of `len` bytes when given.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, name: &str, len: Option<usize>) -> PyResult<BytesMut> {
        let buf = get(obj, name, true)?;
        check_len(&buf, name, len)?;
        Ok(BytesMut(buf))
    }

    /// How many bytes it holds.
    pub(crate) fn len(&self) -> usize {
        self.0.len_bytes()
    }

    fn span(&self) -> (usize, usize) {
        let start = self.0.buf_ptr() as usize;
        (start, start.saturating_add(self.len()))
    }

    /// The bytes, to be filled.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &mut [];
        }
        // SAFETY: as for `Bytes::as_slice`, and checked writable; `&mut self` makes this the
        // only slice of this export, and the callers that hold several refuse overlapping ones
        // (`disjoint`) before lending any.
        unsafe { std::slice::from_raw_parts_mut(self.0.buf_ptr().cast::<u8>(), len) }
    }
}

/// Refuses outputs whose memory overlaps (the same array twice, two views of one): filling
/// them at once would alias. `names` name them in the message.
pub(crate) fn disjoint<'a>(outs: impl IntoIterator<Item = (&'a BytesMut, String)>) -> PyResult<()> {
    let mut spans: Vec<((usize, usize), String)> =
        outs.into_iter().filter(|(b, _)| b.len() > 0).map(|(b, n)| (b.span(), n)).collect();
    spans.sort_by_key(|(s, _)| *s);
    for pair in spans.windows(2) {
        let (((_, end), a), ((start, _), b)) = (&pair[0], &pair[1]);
        if start < end {
            return Err(errors::usage(format!("{a} and {b} share memory: each output must be a buffer of its own")));
        }
    }
    Ok(())
}
