//! `ckpt` as Python functions: an opened checkpoint, its catalog, reading tensors into buffers
//! the Python layer owns, and the operations. Every call that touches files runs with the GIL
//! released.

use std::path::PathBuf;

use ckpt::{Checkpoint, ConvertOptions, MergeOptions, OpenOptions, Outcome, TargetFormat, WriteOptions};

use crate::comm::PyCollective;
use pyo3::prelude::*;

use crate::args;
use crate::buffer::BytesMut;
use crate::errors;

/// An opened checkpoint (`ckpt::Checkpoint`): the catalog only; tensors are read on demand.
#[pyclass(module = "statekit._native", name = "Checkpoint", frozen)]
#[derive(Debug)]
pub(crate) struct PyCheckpoint {
    inner: Checkpoint,
}

/// How every function here opens its source: a DeepSpeed `tag`; `allow_globals`, the globals a
/// torch file may name beyond torch's weights-only list, read as inert data; and `as_stored`,
/// a Megatron `torch_dist` checkpoint's tensors under their stored keys instead of the model
/// megatron holds on one rank (refused, `BadOption` from `Error::Misuse`, for any other format).
///
/// An `hf://` source is downloaded into the Hugging Face cache (as huggingface_hub lays it out)
/// unless it is there already; [`PyCheckpoint::new`] with `headers_only` reads only its catalog,
/// by range requests on the Hub.
fn options(tag: Option<String>, allow_globals: Option<Vec<String>>, as_stored: bool) -> PyResult<OpenOptions> {
    let allow_globals = ckpt::AllowGlobals::new(allow_globals.unwrap_or_default()).map_err(errors::ckpt)?;
    Ok(OpenOptions { tag, allow_globals, as_stored, ..Default::default() })
}

fn open(
    py: Python<'_>,
    src: &str,
    tag: Option<String>,
    allow_globals: Option<Vec<String>>,
    as_stored: bool,
    headers_only: bool,
) -> PyResult<Checkpoint> {
    let opts = OpenOptions { headers_only, ..options(tag, allow_globals, as_stored)? };
    errors::unpanicked(&format!("`{src}`"), || py.detach(|| Checkpoint::open_with(src, &opts)).map_err(errors::ckpt))
}

#[pymethods]
impl PyCheckpoint {
    /// `headers_only`: the catalog alone; an `hf://` model not in the cache is read by range
    /// requests and its tensors cannot be read (what `inspect` needs).
    #[new]
    #[pyo3(signature = (src, tag=None, allow_globals=None, as_stored=false, headers_only=false))]
    fn new(
        py: Python<'_>,
        src: &str,
        tag: Option<String>,
        allow_globals: Option<Vec<String>>,
        as_stored: bool,
        headers_only: bool,
    ) -> PyResult<Self> {
        Ok(Self { inner: open(py, src, tag, allow_globals, as_stored, headers_only)? })
    }

    /// The catalog as `ckpt inspect --json` prints it (`statekit.inspect/2`).
    fn info_json(&self, py: Python<'_>) -> PyResult<String> {
        let ck = &self.inner;
        // Shards that disagree on a metadata key are refused, as every writer refuses them.
        ck.file_metadata().map_err(errors::ckpt)?;
        py.detach(|| serde_json::to_string(ck)).map_err(|e| errors::usage(e.to_string()))
    }

    /// Refuses, as `ckpt` does unless `allow_expanded` is given, a broadcast view that reading
    /// whole would take far more memory than its storage (a 4-byte file can announce 16 GiB).
    fn refuse_expanded(&self) -> PyResult<()> {
        self.inner.refuse_expanded_views().map_err(|e| errors::ckpt_doing(e, ("loading", "loads")))
    }

    /// Reads tensor `index` into `out`, a writable C-contiguous buffer of exactly its bytes.
    fn read_into(&self, py: Python<'_>, index: usize, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = self.tensor(index)?;
        let mut buf = BytesMut::get(out, "`out`", Some(byte_len(t)?))?;
        self.read(py, vec![(t, buf.as_mut_slice())])
    }

    /// Reads each `(tensor index, out)`, opening the source files once; the outputs must not
    /// share memory.
    fn read_many_into(&self, py: Python<'_>, jobs: Vec<(usize, Bound<'_, PyAny>)>) -> PyResult<()> {
        let mut plan = Vec::with_capacity(jobs.len());
        for (k, (index, out)) in jobs.iter().enumerate() {
            let t = self.tensor(*index)?;
            plan.push((t, BytesMut::get(out, &format!("`jobs[{k}]` (tensor {index})"), Some(byte_len(t)?))?));
        }
        crate::buffer::disjoint(plan.iter().enumerate().map(|(k, (_, b))| (b, format!("`jobs[{k}]`"))))?;
        self.read(py, plan.iter_mut().map(|(t, b)| (*t, b.as_mut_slice())).collect())
    }
}

impl PyCheckpoint {
    fn tensor(&self, index: usize) -> PyResult<&ckpt::TensorInfo> {
        self.inner.tensors().get(index).ok_or_else(|| errors::usage(format!("no tensor {index}")))
    }

    /// Fills each buffer with its tensor, the GIL released.
    fn read(&self, py: Python<'_>, mut jobs: Vec<(&ckpt::TensorInfo, &mut [u8])>) -> PyResult<()> {
        let ck = &self.inner;
        let root = format!("`{}`", ck.root().display());
        errors::unpanicked(&root, || py.detach(|| ck.read_tensors_into(&mut jobs)).map_err(errors::ckpt))
    }
}

/// The bytes of `t`, as a buffer length.
fn byte_len(t: &ckpt::TensorInfo) -> PyResult<usize> {
    usize::try_from(t.byte_len()).map_err(|_| errors::usage(format!("tensor `{}` is too large to read", t.name)))
}

/// What an operation wrote, as `ckpt OP --json` prints it (`statekit.outcome/2`).
fn outcome_json(o: &Outcome) -> PyResult<String> {
    serde_json::to_string(o).map_err(|e| errors::usage(e.to_string()))
}

/// Runs a write operation on the open `ck`: in this process alone, or with `comm` (a
/// torch.distributed group, from `statekit._dist`) as one rank of the job, which writes its
/// share while rank 0 commits. The ranks first agree that each could open the source, and
/// afterwards on how the operation went, so an error is raised with its message on the rank
/// that saw it (rank 0 when all did) and as `OtherRank` on the others; none waits forever for
/// one that left.
fn operate(
    py: Python<'_>,
    ck: PyResult<Checkpoint>,
    comm: Option<&Bound<'_, PyAny>>,
    (checksums, allow_expanded): (bool, bool),
    op: impl Fn(&Checkpoint, &WriteOptions<'_>) -> ckpt::Result<Outcome> + Send + Sync,
) -> PyResult<String> {
    let Some(comm) = comm else {
        let ck = ck?;
        let done = py.detach(|| {
            let job = ckpt::Job::solo();
            op(&ck, &WriteOptions { job: Some(&job), checksums, allow_expanded, ..WriteOptions::default() })
        });
        return outcome_json(&done.map_err(errors::ckpt)?);
    };
    let comm = PyCollective::new(comm)?;
    let at = std::path::Path::new("");
    let failed = |e: ckpt::Error| comm.take_error().unwrap_or_else(|| errors::ckpt(e));
    let other = |e: &ckpt::Error| matches!(e, ckpt::Error::OtherRank { .. });
    let ck = ckpt::Job::new(&comm).agree(at, ck, |_| false, failed)?;
    let done = py.detach(|| {
        let job = ckpt::Job::new(&comm);
        let opts = WriteOptions { job: Some(&job), checksums, allow_expanded, ..WriteOptions::default() };
        job.agree(at, op(&ck, &opts), other, |e| e)
    });
    outcome_json(&done.map_err(failed)?)
}

/// `ckpt verify`: the report as `ckpt verify --json` prints it (`statekit.verify/1`).
#[pyfunction]
#[pyo3(signature = (src, *, allow_globals=None, as_stored=false, headers_only=false))]
pub(crate) fn verify(
    py: Python<'_>,
    src: &str,
    allow_globals: Option<Vec<String>>,
    as_stored: bool,
    headers_only: bool,
) -> PyResult<String> {
    let opts = OpenOptions { headers_only, ..options(None, allow_globals, as_stored)? };
    let report = py.detach(|| ckpt::verify_with(src, &opts)).map_err(errors::ckpt)?;
    serde_json::to_string(&report).map_err(|e| errors::usage(e.to_string()))
}

/// `ckpt split`.
#[pyfunction]
#[pyo3(signature = (src, out, max_shard_size, *, tag=None, checksums=false, allow_expanded=false, allow_globals=None, as_stored=false, comm=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn split(
    py: Python<'_>,
    src: &str,
    out: PathBuf,
    max_shard_size: &Bound<'_, PyAny>,
    tag: Option<String>,
    checksums: bool,
    allow_expanded: bool,
    allow_globals: Option<Vec<String>>,
    as_stored: bool,
    comm: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    let max_shard_size = args::uint(max_shard_size, "max_shard_size", 0, u64::MAX)?;
    let ck = open(py, src, tag, allow_globals, as_stored, false);
    operate(py, ck, comm.as_ref(), (checksums, allow_expanded), |ck, opts| ckpt::split(ck, &out, max_shard_size, opts))
}

/// `ckpt merge`.
#[pyfunction]
#[pyo3(signature = (src, out, *, tag=None, max_shard_size=None, optimizer=false, checksums=false, allow_expanded=false, model=None, allow_globals=None, as_stored=false, comm=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn merge(
    py: Python<'_>,
    src: &str,
    out: PathBuf,
    tag: Option<String>,
    max_shard_size: Option<&Bound<'_, PyAny>>,
    optimizer: bool,
    checksums: bool,
    allow_expanded: bool,
    model: Option<&Bound<'_, PyAny>>,
    allow_globals: Option<Vec<String>>,
    as_stored: bool,
    comm: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    let max_shard_size = args::opt_uint(max_shard_size, "max_shard_size", 0, u64::MAX)?;
    let model = args::opt_uint(model, "model", 0, usize::MAX as u64)?.map(|m| m as usize);
    let ck = open(py, src, tag, allow_globals, as_stored, false);
    let options = MergeOptions { max_shard_size, optimizer, model };
    operate(py, ck, comm.as_ref(), (checksums, allow_expanded), |ck, opts| ckpt::merge(ck, &out, &options, opts))
}

/// `ckpt convert`.
#[pyfunction]
#[pyo3(signature = (src, out, *, to=None, dtype=None, max_shard_size=None, dedupe=false, world_size=None, arch=None, vocab_size=None, tensor_parallel=None, pipeline_parallel=None, expert_parallel=None, tag=None, checksums=false, allow_expanded=false, allow_globals=None, as_stored=false, comm=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn convert(
    py: Python<'_>,
    src: &str,
    out: PathBuf,
    to: Option<&str>,
    dtype: Option<&str>,
    max_shard_size: Option<&Bound<'_, PyAny>>,
    dedupe: bool,
    world_size: Option<&Bound<'_, PyAny>>,
    arch: Option<&str>,
    vocab_size: Option<&Bound<'_, PyAny>>,
    tensor_parallel: Option<&Bound<'_, PyAny>>,
    pipeline_parallel: Option<&Bound<'_, PyAny>>,
    expert_parallel: Option<&Bound<'_, PyAny>>,
    tag: Option<String>,
    checksums: bool,
    allow_expanded: bool,
    allow_globals: Option<Vec<String>>,
    as_stored: bool,
    comm: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    let max_shard_size = args::opt_uint(max_shard_size, "max_shard_size", 0, u64::MAX)?;
    let world_size = args::opt_uint(world_size, "world_size", 0, u64::MAX)?;
    let vocab_size = args::opt_uint(vocab_size, "vocab_size", 0, u64::MAX)?;
    let arch = arch.map(str::parse::<ckpt::Arch>).transpose().map_err(errors::usage)?;
    let to = to.map(str::parse::<TargetFormat>).transpose().map_err(errors::usage)?;
    let dtype = dtype.map(str::parse::<ckpt::Dtype>).transpose().map_err(errors::usage)?;
    let tensor_parallel = args::opt_uint(tensor_parallel, "tensor_parallel", 0, u64::MAX)?;
    let pipeline_parallel = args::opt_uint(pipeline_parallel, "pipeline_parallel", 0, u64::MAX)?;
    let expert_parallel = args::opt_uint(expert_parallel, "expert_parallel", 0, u64::MAX)?;
    let options = ConvertOptions {
        to,
        dtype,
        max_shard_size,
        dedupe,
        world_size,
        blocks: None,
        arch,
        vocab_size,
        tensor_parallel,
        pipeline_parallel,
        expert_parallel,
    };
    // The library's check of the options, before anything is read.
    options.check(&out).map_err(errors::ckpt)?;
    let ck = open(py, src, tag, allow_globals, as_stored, false);
    operate(py, ck, comm.as_ref(), (checksums, allow_expanded), |ck, opts| ckpt::convert(ck, &out, &options, opts))
}

/// `ckpt reshard`.
#[pyfunction]
#[pyo3(signature = (src, out, world_size, *, tag=None, checksums=false, allow_expanded=false, allow_globals=None, as_stored=false, comm=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn reshard(
    py: Python<'_>,
    src: &str,
    out: PathBuf,
    world_size: &Bound<'_, PyAny>,
    tag: Option<String>,
    checksums: bool,
    allow_expanded: bool,
    allow_globals: Option<Vec<String>>,
    as_stored: bool,
    comm: Option<Bound<'_, PyAny>>,
) -> PyResult<String> {
    let world_size = args::uint(world_size, "world_size", 0, u64::MAX)?;
    let ck = open(py, src, tag, allow_globals, as_stored, false);
    operate(py, ck, comm.as_ref(), (checksums, allow_expanded), |ck, opts| ckpt::reshard(ck, &out, world_size, opts))
}

/// `ckpt::parse_size` (`5GB`, `500MiB`, a number of bytes).
#[pyfunction]
pub(crate) fn parse_size(text: &str) -> PyResult<u64> {
    ckpt::parse_size(text).map_err(errors::ckpt)
}
