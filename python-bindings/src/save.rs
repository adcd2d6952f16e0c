//! Writing Python tensors: safetensors (one file or huggingface_hub's sharded layout) and the
//! per-rank DCP writer of `ckpt::save_sharded`.
//!
//! Files are written beside their target under a temporary name, fsynced and renamed; with
//! shards, the index is renamed last and the folder fsynced, so a reader never sees a partial
//! checkpoint under the final names.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use safetensors::tensor::View;

use crate::comm::PyCollective;
use crate::errors;
use crate::raw::RawBuf;

/// One tensor handed over by the Python layer: name, safetensors dtype name, shape, bytes.
type Entry = (String, String, Vec<usize>, usize, usize);

struct Tensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    buf: RawBuf,
}

impl View for &Tensor {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.buf.bytes())
    }
    fn data_len(&self) -> usize {
        self.buf.len
    }
}

fn dtype_of(name: &str) -> PyResult<safetensors::Dtype> {
    serde_json::from_value(serde_json::Value::String(name.to_owned()))
        .map_err(|_| errors::usage(format!("safetensors has no dtype `{name}`")))
}

fn tmp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    path.with_file_name(format!(".{name}.{}.{nonce}.tmp", std::process::id()))
}

fn sync_dir(dir: &Path) -> PyResult<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(|e| errors::io(dir, e))
}

/// Writes one safetensors file to a temporary beside `target` and fsyncs it; returns the
/// temporary's path.
fn write_staged(
    target: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: &Option<HashMap<String, String>>,
) -> PyResult<PathBuf> {
    let tmp = tmp_beside(target);
    let data = tensors.iter().map(|(n, t)| (*n, *t));
    if let Err(e) = safetensors::serialize_to_file(data, metadata.clone(), &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(match e {
            safetensors::SafeTensorError::IoError(io) => errors::io(target, io),
            other => errors::usage(format!("{}: {other}", target.display())),
        });
    }
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| errors::io(&tmp, e))?;
    Ok(tmp)
}

/// Greedy shards in order, as huggingface_hub's `split_torch_state_dict_into_shards`: a new
/// shard starts when the next tensor would overflow the current one.
fn plan_shards(sizes: &[usize], max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        let size = size as u64;
        match shards.last_mut() {
            Some(last) if !last.is_empty() && current + size <= max => {
                last.push(i);
                current += size;
            }
            _ => {
                shards.push(vec![i]);
                current = size;
            }
        }
    }
    shards
}

/// Saves `entries` as safetensors at `path` (with `max_shard_size`: a folder in
/// huggingface_hub's layout, `model.safetensors` alone when everything fits one shard).
/// Returns the files written, index last.
#[pyfunction]
#[pyo3(signature = (entries, path, max_shard_size=None, metadata=None))]
pub(crate) fn save_safetensors(
    py: Python<'_>,
    entries: Vec<Entry>,
    path: PathBuf,
    max_shard_size: Option<u64>,
    metadata: Option<HashMap<String, String>>,
) -> PyResult<Vec<String>> {
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, dtype, shape, addr, len) in entries {
        tensors.push((name, Tensor { dtype: dtype_of(&dtype)?, shape, buf: RawBuf { addr, len } }));
    }
    py.detach(|| {
        let Some(max) = max_shard_size else {
            let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let tmp = write_staged(&path, &refs, &metadata)?;
            std::fs::rename(&tmp, &path).map_err(|e| errors::io(&path, e))?;
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent)?;
            }
            return Ok(vec![path.display().to_string()]);
        };
        std::fs::create_dir_all(&path).map_err(|e| errors::io(&path, e))?;
        let sizes: Vec<usize> = tensors.iter().map(|(_, t)| t.buf.len).collect();
        let shards = plan_shards(&sizes, max);
        let n = shards.len();
        let name_of = |i: usize| {
            if n == 1 {
                "model.safetensors".to_owned()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            }
        };
        let mut staged = Vec::with_capacity(n);
        let mut weight_map = serde_json::Map::new();
        for (i, shard) in shards.iter().enumerate() {
            let target = path.join(name_of(i));
            let refs: Vec<(&str, &Tensor)> = shard.iter().map(|&j| (tensors[j].0.as_str(), &tensors[j].1)).collect();
            for (name, _) in &refs {
                weight_map.insert((*name).to_owned(), serde_json::Value::String(name_of(i)));
            }
            match write_staged(&target, &refs, &metadata) {
                Ok(tmp) => staged.push((tmp, target)),
                Err(e) => {
                    for (tmp, _) in &staged {
                        let _ = std::fs::remove_file(tmp);
                    }
                    return Err(e);
                }
            }
        }
        let mut written = Vec::new();
        for (tmp, target) in &staged {
            std::fs::rename(tmp, target).map_err(|e| errors::io(target, e))?;
            written.push(target.display().to_string());
        }
        if n > 1 {
            let total: u64 = sizes.iter().map(|s| *s as u64).sum();
            let mut meta = serde_json::Map::new();
            meta.insert("total_size".into(), total.into());
            if let Some(m) = &metadata {
                for (k, v) in m {
                    meta.insert(k.clone(), serde_json::Value::String(v.clone()));
                }
            }
            let index = serde_json::json!({"metadata": meta, "weight_map": weight_map});
            let target = path.join("model.safetensors.index.json");
            let tmp = tmp_beside(&target);
            let text = serde_json::to_vec_pretty(&index).map_err(|e| errors::usage(e.to_string()))?;
            std::fs::write(&tmp, text)
                .and_then(|_| File::open(&tmp).and_then(|f| f.sync_all()))
                .and_then(|_| std::fs::rename(&tmp, &target))
                .map_err(|e| errors::io(&target, e))?;
            written.push(target.display().to_string());
        }
        sync_dir(&path)?;
        Ok(written)
    })
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
/// first global row, address and length of its bytes.
type Slice<'py> = (Bound<'py, PyAny>, String, Vec<u64>, u64, usize, usize);

/// `ckpt::save_sharded` over torch.distributed (through `comm`). `tensors`: `(key parts,
/// dtype, global shape, dim0 offset, address, length)`; `values`: `(key parts, value)`.
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
    for (parts, dtype, global_shape, dim0_offset, addr, len) in &tensors {
        let dtype = ckpt::Dtype::from_safetensors_name(dtype)
            .ok_or_else(|| errors::usage(format!("unknown dtype `{dtype}`")))?;
        locals.push((key_parts(parts)?, dtype, global_shape.clone(), *dim0_offset, RawBuf { addr: *addr, len: *len }));
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
                    bytes: buf.bytes(),
                })
                .collect();
            ckpt::save_sharded(&dir, &ts, &vals, &comm, &ckpt::WriteOptions::default())
        })
        .map_err(|e| comm.take_error().unwrap_or_else(|| errors::ckpt(e)))?;
    Ok(serde_json::json!({
        "files": outcome.files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "tensors": outcome.tensors,
        "bytes": outcome.bytes,
        "values": outcome.values,
        "world_size": outcome.world_size,
    })
    .to_string())
}
