//! Writing Python tensors: safetensors (one file or huggingface_hub's sharded layout) and the
//! per-rank DCP writer of `ckpt::save_sharded`.
//!
//! Files are written in a private staging folder beside their target (created exclusively,
//! mode 0700, under a name with 64 random bits from the kernel: nothing another user plants
//! beside the target, a link to a victim file least of all, is ever written through), fsynced
//! and renamed into place; with shards, the index is renamed last and the folder fsynced, so a
//! reader never sees a partial checkpoint under the final names. The staging folder is removed
//! whatever happens. (The `safetensors` crate writes a file by path, create-and-truncate; in a
//! folder only this process can enter, that path is ours.)

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

/// A private folder beside the files being written, removed when dropped (see the module docs).
struct Staging {
    dir: PathBuf,
}

impl Staging {
    /// Creates `.<name>.<random>.tmp/` in `parent`, exclusively (an existing entry of that name,
    /// a link included, is never used) and readable by this user only.
    fn new(parent: &Path, name: &str) -> PyResult<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let mut last = None;
        for _ in 0..8 {
            let dir = parent.join(format!(".{name}.{}.tmp", random_hex().map_err(|e| errors::io(parent, e))?));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(Self { dir }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((dir, e)),
                Err(e) => return Err(errors::io(&dir, e)),
            }
        }
        let (dir, e) = last.unwrap_or_else(|| (parent.to_path_buf(), std::io::ErrorKind::AlreadyExists.into()));
        Err(errors::io(&dir, e))
    }

    /// Where the file `target` is written before it is renamed into place.
    fn file_for(&self, target: &Path) -> PathBuf {
        self.dir.join(target.file_name().unwrap_or_default())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// 64 random bits as hex, from the kernel.
fn random_hex() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 8];
    File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn parent_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

fn sync_dir(dir: &Path) -> PyResult<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(|e| errors::io(dir, e))
}

/// Writes one safetensors file for `target` in `staging` and fsyncs it; returns its path there.
fn write_staged(
    staging: &Staging,
    target: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: &Option<HashMap<String, String>>,
) -> PyResult<PathBuf> {
    let tmp = staging.file_for(target);
    let data = tensors.iter().map(|(n, t)| (*n, *t));
    if let Err(e) = safetensors::serialize_to_file(data, metadata.clone(), &tmp) {
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
    max_shard_size: Option<&Bound<'_, PyAny>>,
    metadata: Option<HashMap<String, String>>,
) -> PyResult<Vec<String>> {
    let max_shard_size = crate::args::opt_uint(max_shard_size, "max_shard_size", 0, u64::MAX)?;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, dtype, shape, addr, len) in entries {
        tensors.push((name, Tensor { dtype: dtype_of(&dtype)?, shape, buf: RawBuf { addr, len } }));
    }
    py.detach(|| {
        let Some(max) = max_shard_size else {
            let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let staging = Staging::new(parent_of(&path), &name)?;
            let tmp = write_staged(&staging, &path, &refs, &metadata)?;
            std::fs::rename(&tmp, &path).map_err(|e| errors::io(&path, e))?;
            sync_dir(parent_of(&path))?;
            return Ok(vec![path.display().to_string()]);
        };
        std::fs::create_dir_all(&path).map_err(|e| errors::io(&path, e))?;
        let staging = Staging::new(&path, "save")?;
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
            staged.push((write_staged(&staging, &target, &refs, &metadata)?, target));
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
            let tmp = staging.file_for(&target);
            let text = serde_json::to_vec_pretty(&index).map_err(|e| errors::usage(e.to_string()))?;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .and_then(|mut f| std::io::Write::write_all(&mut f, &text).and_then(|_| f.sync_all()))
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
