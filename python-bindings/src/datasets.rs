//! `dataload`'s sources as Python objects; `statekit.datasets` wraps them as map-style datasets.
//!
//! Token windows are handed out as locations (file, byte offset): the Python layer maps the
//! files itself and returns numpy views of each window, without a copy. Batches are read by
//! Rust with the GIL released into arrays the Python layer allocated (tokens), or returned as
//! one `bytes` per numeric column (tables) and as `str` records (JSON lines).

use std::path::PathBuf;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use dataload::{ArrowDataset, IndexPlacement, JsonlDataset, ParquetDataset, Source, TokenDtype, TokenWindows};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::args::{self, MAX_LEN};
use crate::buffer::BytesMut;
use crate::errors;

/// The longest window the bindings read (2^32 tokens): far past any context length, and small
/// enough that a batch's buffer sizes cannot overflow.
const MAX_BLOCK_SIZE: u64 = 1 << 32;

/// Where a dataset call happens, for the message of a panic caught at the boundary.
fn at(spec: &std::path::Path) -> String {
    format!("`{}`", spec.display())
}

fn token_dtype(name: &str) -> PyResult<TokenDtype> {
    Ok(match name {
        "uint8" => TokenDtype::U8,
        "uint16" => TokenDtype::U16,
        "uint32" => TokenDtype::U32,
        "int32" => TokenDtype::I32,
        "int64" => TokenDtype::I64,
        other => {
            return Err(errors::usage(format!("token dtype is uint8, uint16, uint32, int32 or int64, not `{other}`")))
        }
    })
}

fn numpy_name(d: TokenDtype) -> &'static str {
    match d {
        TokenDtype::U8 => "<u1",
        TokenDtype::U16 => "<u2",
        TokenDtype::U32 => "<u4",
        TokenDtype::I32 => "<i4",
        TokenDtype::I64 => "<i8",
        _ => "?",
    }
}

/// Fixed-length token windows (`dataload::TokenWindows`).
#[pyclass(module = "statekit._native", name = "TokenSource", frozen)]
#[derive(Debug)]
pub(crate) struct TokenSource {
    inner: TokenWindows,
}

impl TokenSource {
    /// The windows (a mixture of token sources reads them directly).
    pub(crate) fn windows(&self) -> &TokenWindows {
        &self.inner
    }
}

#[pymethods]
impl TokenSource {
    #[new]
    #[pyo3(signature = (spec, block_size, bin_dtype="uint16"))]
    fn new(py: Python<'_>, spec: PathBuf, block_size: &Bound<'_, PyAny>, bin_dtype: &str) -> PyResult<Self> {
        let block_size = args::size(block_size, "block_size", 1, MAX_BLOCK_SIZE)?;
        let dtype = token_dtype(bin_dtype)?;
        let inner = errors::unpanicked(&at(&spec), || {
            py.detach(|| TokenWindows::open(&spec, block_size, dtype)).map_err(errors::dataload)
        })?;
        Ok(Self { inner })
    }

    fn __len__(&self) -> usize {
        usize::try_from(self.inner.len()).unwrap_or(usize::MAX)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn fingerprint(&self) -> String {
        self.inner.fingerprint().id()
    }

    /// `(path, data offset, numpy dtype)` of each file.
    fn files(&self) -> Vec<(String, usize, &'static str)> {
        self.inner
            .files()
            .iter()
            .map(|f| (f.path().display().to_string(), f.data_offset(), numpy_name(f.dtype())))
            .collect()
    }

    /// `(file, byte offset)` of window `i`'s first token.
    fn locate(&self, i: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
        let i = args::uint(i, "i", 0, MAX_LEN)?;
        let (k, row) = self.inner.locate(i).map_err(errors::dataload)?;
        let f = &self.inner.files()[k];
        let start = usize::try_from(row).unwrap_or(usize::MAX).saturating_mul(self.inner.block_size());
        Ok((k, f.data_offset() + start * f.dtype().size()))
    }

    /// Reads the windows at `indices` into `inputs` and `targets`: two writable C-contiguous
    /// buffers of `len(indices) × block_size` int64 tokens each, not sharing memory.
    fn read_batch_into(
        &self,
        py: Python<'_>,
        indices: &Bound<'_, PyAny>,
        inputs: &Bound<'_, PyAny>,
        targets: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let indices = args::uint_list(indices, "indices", MAX_LEN)?;
        let inner = &self.inner;
        let want = indices.len().checked_mul(inner.block_size()).and_then(|n| n.checked_mul(8));
        let Some(want) = want else {
            return Err(errors::usage(format!(
                "{} windows of {} tokens are too many",
                indices.len(),
                inner.block_size()
            )));
        };
        let mut inputs = BytesMut::get(inputs, "`inputs`", Some(want))?;
        let mut targets = BytesMut::get(targets, "`targets`", Some(want))?;
        crate::buffer::disjoint([(&inputs, "`inputs`".to_string()), (&targets, "`targets`".to_string())])?;
        let (inputs, targets) = (inputs.as_mut_slice(), targets.as_mut_slice());
        let files = inner.files().first().map(|f| f.path().to_path_buf()).unwrap_or_default();
        errors::unpanicked(&at(&files), || {
            py.detach(|| {
                let batch = inner.read_batch(&indices)?;
                for (src, dst) in [(&batch.inputs, inputs), (&batch.targets, targets)] {
                    for (d, v) in dst.chunks_exact_mut(8).zip(src.iter()) {
                        d.copy_from_slice(&v.to_le_bytes());
                    }
                }
                Ok(())
            })
            .map_err(errors::dataload)
        })
    }
}

fn column_to_py<'py>(py: Python<'py>, name: &str, col: &dyn Array) -> PyResult<Bound<'py, PyAny>> {
    macro_rules! primitive {
        ($t:ty, $np:literal) => {{
            let a = col.as_primitive::<$t>();
            let values = a.values();
            // The scalar buffer is already sliced to the array's rows.
            let data: &[u8] = values.inner().as_slice();
            let valid: Option<Vec<bool>> = (a.null_count() > 0).then(|| (0..a.len()).map(|i| a.is_valid(i)).collect());
            Ok((PyBytes::new(py, data), $np, valid).into_pyobject(py)?.into_any())
        }};
    }
    match col.data_type() {
        DataType::Int8 => primitive!(Int8Type, "<i1"),
        DataType::Int16 => primitive!(Int16Type, "<i2"),
        DataType::Int32 => primitive!(Int32Type, "<i4"),
        DataType::Int64 => primitive!(Int64Type, "<i8"),
        DataType::UInt8 => primitive!(UInt8Type, "<u1"),
        DataType::UInt16 => primitive!(UInt16Type, "<u2"),
        DataType::UInt32 => primitive!(UInt32Type, "<u4"),
        DataType::UInt64 => primitive!(UInt64Type, "<u8"),
        DataType::Float32 => primitive!(Float32Type, "<f4"),
        DataType::Float64 => primitive!(Float64Type, "<f8"),
        DataType::Utf8 => {
            let a = col.as_string::<i32>();
            let items: Vec<Option<&str>> = (0..a.len()).map(|i| a.is_valid(i).then(|| a.value(i))).collect();
            Ok(PyList::new(py, items)?.into_any())
        }
        DataType::LargeUtf8 => {
            let a = col.as_string::<i64>();
            let items: Vec<Option<&str>> = (0..a.len()).map(|i| a.is_valid(i).then(|| a.value(i))).collect();
            Ok(PyList::new(py, items)?.into_any())
        }
        other => Err(errors::usage(format!("column `{name}` has type {other}, which the bindings do not convert"))),
    }
}

fn batch_to_py<'py>(py: Python<'py>, batch: &RecordBatch) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (field, col) in batch.schema().fields().iter().zip(batch.columns()) {
        out.set_item(field.name(), column_to_py(py, field.name(), col.as_ref())?)?;
    }
    Ok(out)
}

#[derive(Debug)]
enum Table {
    Arrow(ArrowDataset),
    Parquet(ParquetDataset),
}

/// Rows of Arrow IPC or Parquet files (`dataload::ArrowDataset`, `dataload::ParquetDataset`).
#[pyclass(module = "statekit._native", name = "TableSource", frozen)]
#[derive(Debug)]
pub(crate) struct TableSource {
    inner: Table,
}

#[pymethods]
impl TableSource {
    #[new]
    #[pyo3(signature = (kind, spec, columns=None, cache_row_groups=None))]
    fn new(
        py: Python<'_>,
        kind: &str,
        spec: PathBuf,
        columns: Option<Vec<String>>,
        cache_row_groups: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let cache_row_groups = args::opt_uint(cache_row_groups, "cache_row_groups", 0, usize::MAX as u64)?
            .map_or(dataload::DEFAULT_ROW_GROUP_CACHE, |n| n as usize);
        let cols = columns.as_deref();
        let inner = errors::unpanicked(&at(&spec), || {
            Ok(match kind {
                "arrow" => Table::Arrow(py.detach(|| ArrowDataset::open(&spec, cols)).map_err(errors::dataload)?),
                "parquet" => Table::Parquet(
                    py.detach(|| ParquetDataset::open(&spec, cols, cache_row_groups)).map_err(errors::dataload)?,
                ),
                other => return Err(errors::usage(format!("table kind is `arrow` or `parquet`, not `{other}`"))),
            })
        })?;
        Ok(Self { inner })
    }

    fn __len__(&self) -> usize {
        let n = match &self.inner {
            Table::Arrow(a) => a.len(),
            Table::Parquet(p) => p.len(),
        };
        usize::try_from(n).unwrap_or(usize::MAX)
    }

    #[getter]
    fn fingerprint(&self) -> String {
        match &self.inner {
            Table::Arrow(a) => a.fingerprint().id(),
            Table::Parquet(p) => p.fingerprint().id(),
        }
    }

    /// The rows at `indices`, as a dict of columns: numeric ones as `(bytes, numpy dtype,
    /// validity or None)`, strings as lists (`None` for nulls).
    fn read_batch<'py>(&self, py: Python<'py>, indices: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let indices = args::uint_list(indices, "indices", MAX_LEN)?;
        let inner = &self.inner;
        let batch = errors::unpanicked("a table dataset", || {
            py.detach(|| match inner {
                Table::Arrow(a) => a.read_batch(&indices),
                Table::Parquet(p) => p.read_batch(&indices),
            })
            .map_err(errors::dataload)
        })?;
        errors::unpanicked("a table dataset", || batch_to_py(py, &batch))
    }

    /// The paths of the files, in dataset order (Arrow only; Parquet: empty).
    fn files(&self) -> Vec<String> {
        match &self.inner {
            Table::Arrow(a) => a.file_paths().iter().map(|p| p.display().to_string()).collect(),
            Table::Parquet(_) => Vec::new(),
        }
    }

    /// Rows `start..start + n` when they lie in one record batch of an Arrow dataset (`None`
    /// otherwise, and for Parquet): a dict of columns as `read_batch` gives them, except that
    /// a column whose values lie in the file is `("map", file index, byte offset, numpy
    /// dtype)`, for the Python layer to view in its own map of the file.
    fn read_range<'py>(
        &self,
        py: Python<'py>,
        start: &Bound<'py, PyAny>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let (start, n) = (args::uint(start, "start", 0, MAX_LEN)?, args::uint(n, "n", 0, MAX_LEN)?);
        let Table::Arrow(a) = &self.inner else { return Ok(None) };
        let rows = errors::unpanicked("an Arrow dataset", || {
            py.detach(|| a.contiguous_rows(start, n)).map_err(errors::dataload)
        })?;
        let Some(rows) = rows else {
            return Ok(None);
        };
        let out = PyDict::new(py);
        let schema = rows.batch.schema();
        for ((field, col), at) in schema.fields().iter().zip(rows.batch.columns()).zip(&rows.in_file) {
            let value = match (at, numpy_dtype(col.data_type())) {
                (Some((file, offset)), Some(dtype)) => ("map", *file, *offset, dtype).into_pyobject(py)?.into_any(),
                _ => column_to_py(py, field.name(), col.as_ref())?,
            };
            out.set_item(field.name(), value)?;
        }
        Ok(Some(out))
    }
}

/// The numpy dtype of a numeric Arrow type the bindings convert.
fn numpy_dtype(t: &DataType) -> Option<&'static str> {
    Some(match t {
        DataType::Int8 => "<i1",
        DataType::Int16 => "<i2",
        DataType::Int32 => "<i4",
        DataType::Int64 => "<i8",
        DataType::UInt8 => "<u1",
        DataType::UInt16 => "<u2",
        DataType::UInt32 => "<u4",
        DataType::UInt64 => "<u8",
        DataType::Float32 => "<f4",
        DataType::Float64 => "<f8",
        _ => return None,
    })
}

/// Records of JSON-lines files (`dataload::JsonlDataset`), plain or zstd-compressed.
#[pyclass(module = "statekit._native", name = "JsonlSource", frozen)]
#[derive(Debug)]
pub(crate) struct JsonlSource {
    inner: JsonlDataset,
}

#[pymethods]
impl JsonlSource {
    #[new]
    #[pyo3(signature = (spec, cache_frames=None))]
    fn new(py: Python<'_>, spec: PathBuf, cache_frames: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let cache_frames = args::opt_uint(cache_frames, "cache_frames", 0, usize::MAX as u64)?
            .map_or(dataload::DEFAULT_FRAME_CACHE, |n| n as usize);
        let inner = errors::unpanicked(&at(&spec), || {
            py.detach(|| JsonlDataset::open(&spec, IndexPlacement::default(), cache_frames)).map_err(errors::dataload)
        })?;
        Ok(Self { inner })
    }

    fn __len__(&self) -> usize {
        usize::try_from(self.inner.len()).unwrap_or(usize::MAX)
    }

    #[getter]
    fn fingerprint(&self) -> String {
        self.inner.fingerprint().id()
    }

    /// The raw JSON text of the records at `indices`.
    fn read_batch(&self, py: Python<'_>, indices: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let indices = args::uint_list(indices, "indices", MAX_LEN)?;
        let inner = &self.inner;
        let batch = errors::unpanicked("a JSON-lines dataset", || {
            py.detach(|| inner.read_batch(&indices)).map_err(errors::dataload)
        })?;
        // dataload hands out UTF-8 only (a record that is not is an error naming its line).
        (0..batch.len())
            .map(|r| batch.get(r).map(str::to_owned).ok_or_else(|| errors::usage(format!("record {r} is not text"))))
            .collect()
    }

    /// `(path, line)` of record `i`: its file, and its line there (from 1), for an error about
    /// the record that the Python layer found.
    fn record_line(&self, py: Python<'_>, i: &Bound<'_, PyAny>) -> PyResult<(String, u64)> {
        let i = args::uint(i, "i", 0, MAX_LEN)?;
        let inner = &self.inner;
        let (path, line) = py.detach(|| inner.record_line(i)).map_err(errors::dataload)?;
        Ok((path.display().to_string(), line))
    }

    /// The error for record `i` when Python's `json` refuses it (`reason`: what it said; the
    /// index already checked it is JSON, so what is left is what Python's parser will not read,
    /// an integer past its digit limit): `dataload`'s `NotJson`, naming the file and the line.
    fn not_json(&self, py: Python<'_>, i: &Bound<'_, PyAny>, reason: String) -> PyResult<Py<PyAny>> {
        let (path, line) = self.record_line(py, i)?;
        let message = format!("`{path}`, line {line}: Python's `json` cannot read the record: {reason}");
        let e = dataload::DataloadError::NotJson { path: path.into(), line, column: 0, reason };
        Ok(errors::dataload_worded(e, message).into_value(py).into_any())
    }
}

/// Opens the regular file `path` for reading, as `dataload` opens every data file (a FIFO, a
/// socket, a device or a directory in its place is refused by name, never waited on), and
/// hands its descriptor to the caller, who maps it and closes it: the Python layer's views of
/// token and Arrow files.
#[pyfunction]
pub(crate) fn open_regular(py: Python<'_>, path: PathBuf) -> PyResult<i32> {
    use std::os::fd::IntoRawFd;
    let file = py.detach(|| dataload::open_regular(&path)).map_err(errors::dataload)?;
    Ok(file.into_raw_fd())
}

/// Refuses a map of `mapped` bytes of `path` once the file is `size` bytes, fewer than mapped
/// (`dataload`'s `FileChanged`): reading a map past the end of its file kills the process.
#[pyfunction]
pub(crate) fn check_mapped(path: PathBuf, size: u64, mapped: u64) -> PyResult<()> {
    if size < mapped {
        return Err(errors::dataload(dataload::DataloadError::FileChanged { path }));
    }
    Ok(())
}
