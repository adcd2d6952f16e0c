//! Writing Python tensors: safetensors through `ckpt::save_safetensors` (one file or
//! huggingface_hub's sharded layout, the planner and write engine `ckpt split` uses) and the
//! per-rank DCP writer of `ckpt::save_sharded`.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::Bytes;
use crate::comm::PyCollective;
use crate::errors;

/// One tensor handed over by the Python layer: name, safetensors dtype name, shape, and its
/// bytes as a C-contiguous buffer.
type Entry<'py> = (String, String, Vec<u64>, Bound<'py, PyAny>);

/// Saves `entries`, in the order given, as safetensors at `path` (with `max_shard_size`: a
/// folder in huggingface_hub's layout, `model.safetensors` alone when everything fits one
/// shard), with `metadata` in its order after `format`. Returns the files written, index last.
#[pyfunction]
#[pyo3(signature = (entries, path, max_shard_size=None, metadata=None))]
pub(crate) fn save_safetensors(
    py: Python<'_>,
    entries: Vec<Entry<'_>>,
    path: PathBuf,
    max_shard_size: Option<&Bound<'_, PyAny>>,
    metadata: Option<&Bound<'_, PyDict>>,
) -> PyResult<Vec<String>> {
    let max_shard_size = crate::args::opt_uint(max_shard_size, "max_shard_size", 0, u64::MAX)?;
    let mut held = Vec::with_capacity(entries.len());
    for (name, dtype, _, data) in &entries {
        let dtype = ckpt::Dtype::from_safetensors_name(dtype)
            .ok_or_else(|| errors::usage(format!("safetensors has no dtype `{dtype}`")))?;
        held.push((dtype, Bytes::get(data, &format!("the data of tensor `{name}`"), None)?));
    }
    let mut meta = Vec::new();
    for (k, v) in metadata.iter().flat_map(|m| m.iter()) {
        meta.push((k.extract::<String>()?, v.extract::<String>()?));
    }
    let options = ckpt::SaveOptions { max_shard_size, metadata: meta };
    let tensors: Vec<ckpt::MemoryTensor<'_>> = entries
        .iter()
        .zip(&held)
        .map(|((name, _, shape, _), (dtype, data))| ckpt::MemoryTensor {
            name,
            dtype: *dtype,
            shape,
            bytes: data.as_slice(),
        })
        .collect();
    let outcome = py
        .detach(|| ckpt::save_safetensors(&tensors, &path, &options, &ckpt::WriteOptions::default()))
        .map_err(errors::ckpt)?;
    Ok(outcome.files.iter().map(|p| p.display().to_string()).collect())
}

fn key_parts(parts: &Bound<'_, PyAny>) -> PyResult<Vec<ckpt::KeyPart>> {
    let mut out = Vec::new();
    for p in parts.try_iter()? {
        let p = p?;
        if let Ok(i) = p.extract::<i64>() {
            out.push(ckpt::KeyPart::Index(i));
        } else {
            out.push(ckpt::KeyPart::Key(p.extract::<String>()?));
        }
    }
    Ok(out)
}

fn local_value(v: &Bound<'_, PyAny>) -> PyResult<ckpt::LocalValue> {
    use ckpt::LocalValue as L;
    if v.is_none() {
        return Ok(L::None);
    }
    if let Ok(b) = v.cast::<pyo3::types::PyBool>() {
        return Ok(L::Bool(b.is_true()));
    }
    if let Ok(i) = v.extract::<i64>() {
        return Ok(L::Int(i));
    }
    if let Ok(f) = v.extract::<f64>() {
        return Ok(L::Float(f));
    }
    if let Ok(s) = v.extract::<String>() {
        return Ok(L::Str(s));
    }
    if let Ok(items) = v.try_iter() {
        return Ok(L::List(items.map(|i| local_value(&i?)).collect::<PyResult<_>>()?));
    }
    Err(errors::usage(format!("`save_sharded` cannot store a value of type `{}`", v.get_type().name()?)))
}

/// A rank's slice of a tensor from Python: key path parts (str or int), dtype, global shape,
/// first global row, and its bytes as a C-contiguous buffer.
type Slice<'py> = (Bound<'py, PyAny>, String, Vec<u64>, u64, Bound<'py, PyAny>);

/// `ckpt::save_sharded` over torch.distributed (through `comm`). `tensors`: `(key parts,
/// dtype, global shape, dim0 offset, data)`; `values`: `(key parts, value)`.
#[pyfunction]
pub(crate) fn save_sharded(
    py: Python<'_>,
    dir: PathBuf,
    tensors: Vec<Slice<'_>>,
    values: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    comm: Bound<'_, PyAny>,
) -> PyResult<String> {
    let comm = PyCollective::new(&comm)?;
    let mut locals = Vec::with_capacity(tensors.len());
    for (k, (parts, dtype, global_shape, dim0_offset, data)) in tensors.iter().enumerate() {
        let dtype = ckpt::Dtype::from_safetensors_name(dtype)
            .ok_or_else(|| errors::usage(format!("unknown dtype `{dtype}`")))?;
        let data = Bytes::get(data, &format!("the data of `tensors[{k}]`"), None)?;
        locals.push((key_parts(parts)?, dtype, global_shape.clone(), *dim0_offset, data));
    }
    let mut vals = Vec::with_capacity(values.len());
    for (parts, v) in &values {
        vals.push((key_parts(parts)?, local_value(v)?));
    }
    let outcome = py
        .detach(|| {
            let ts: Vec<ckpt::LocalTensor<'_>> = locals
                .iter()
                .map(|(path, dtype, global_shape, dim0_offset, buf)| ckpt::LocalTensor {
                    path: path.clone(),
                    dtype: *dtype,
                    global_shape: global_shape.clone(),
                    dim0_offset: *dim0_offset,
                    bytes: buf.as_slice(),
                })
                .collect();
            ckpt::save_sharded(&dir, &ts, &vals, &comm, &ckpt::WriteOptions::default())
        })
        .map_err(|e| comm.take_error().unwrap_or_else(|| errors::ckpt(e)))?;
    // The document every operation returns (`statekit.outcome/2`).
    serde_json::to_string(&outcome).map_err(|e| errors::usage(e.to_string()))
}
