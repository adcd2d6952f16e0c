//! Saving a DCP folder from the ranks of a running job, each from its own memory.
//!
//! [`save_sharded`] is what a training loop calls at a checkpoint (and what the Python bindings
//! expose): every rank passes the tensors it holds, each a dim-0 slice of a global tensor (a
//! whole tensor is the slice at row 0 with every row), and the non-tensor values it owns. Nothing
//! is gathered onto one rank but the small descriptors.
//!
//! # Protocol
//!
//! Each step ends with the ranks' agreement (the one of `job.rs`): a step that failed anywhere
//! ends the save everywhere, and every rank returns the failure of the lowest rank that failed,
//! with its message, as [`Error::ShardedSave`].
//!
//! 1. Rank 0 stages the folder (a [`crate::StagedFolder`] beside `dir`, `.{name}.{random}.tmp`)
//!    and tells the others its name.
//! 2. Every rank writes its items as `__{rank}_0.distcp` into it (an empty file when it holds
//!    nothing, as torch writes one per rank) (each item a complete
//!    `torch.save` archive laid out by our torch writer, the same bytes [`crate::reshard`] writes),
//!    fsyncs it, and, once every rank has, contributes the items' descriptors (key, dtype,
//!    global shape, chunk box, byte range) to an all-gather.
//! 3. Rank 0 checks that the chunks of each tensor agree on dtype and shape and tile its rows
//!    exactly, writes `.metadata` (the commit marker torch reads, in the 2.13 form) and commits
//!    the staged folder (everything fsynced, renamed into place, its parent fsynced); all ranks
//!    return only once the folder is committed.
//!
//! A kill at any moment leaves either no `dir` or a complete one; a leftover temporary folder
//! has a name no reader takes for a checkpoint. `dir` must not exist yet.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

use collective::Collective;
use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result, SaveTensorProblem};
use crate::formats::dcp::encode::{self, OutChunk, OutItem, OutKind};
use crate::formats::dcp::metadata::PathElem;
use crate::formats::dcp::plan::RankFile;
use crate::formats::dcp::METADATA_NAME;
use crate::formats::torch::writer;
use crate::ops::outcome::Outcome;
use crate::read::dtype::Dtype;
use crate::read::io::fs_error;
use crate::read::shape::numel;
use crate::read::value::Leaf;
use crate::write::job::agree_with;
use crate::write::stage::Stage;
use crate::write::WriteOptions;

/// One element of a state-dict path: a dict key or a list index. The DCP key of an entry is
/// its path joined with `.` (`model.embed.weight`, `optimizer.param_groups.0.lr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyPart {
    /// A dict key.
    Key(String),
    /// A list index.
    Index(i64),
}

impl KeyPart {
    fn elem(&self) -> PathElem {
        match self {
            KeyPart::Key(k) => PathElem::Key(k.clone()),
            KeyPart::Index(i) => PathElem::Index(*i),
        }
    }
}

/// The key of an entry from its path parts, as DCP flattens it.
fn key_of(path: &[KeyPart]) -> String {
    path.iter().map(|p| p.elem().text()).collect::<Vec<_>>().join(".")
}

/// A rank's slice of a tensor: rows `dim0_offset..` of the row-major global tensor, as bytes.
/// A 0-d tensor is one value with `global_shape` empty and `dim0_offset` 0.
#[derive(Clone, Debug)]
pub struct LocalTensor<'a> {
    /// Where the tensor sits in the state dict.
    pub path: Vec<KeyPart>,
    /// Element type.
    pub dtype: Dtype,
    /// Shape of the whole tensor, across ranks.
    pub global_shape: Vec<u64>,
    /// First global row this rank holds.
    pub dim0_offset: u64,
    /// The rows, row-major, little-endian; their count is the byte length over a row's.
    pub bytes: &'a [u8],
}

/// A non-tensor entry (an optimizer's `param_groups` fields), pickled as Python values.
#[derive(Clone, Debug, PartialEq)]
pub enum LocalValue {
    /// `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<LocalValue>),
}

impl LocalValue {
    fn leaf(&self) -> Leaf {
        match self {
            LocalValue::None => Leaf::None,
            LocalValue::Bool(b) => Leaf::Bool(*b),
            LocalValue::Int(i) => Leaf::Int(*i),
            LocalValue::Float(f) => Leaf::Float(*f),
            LocalValue::Str(s) => Leaf::Str(s.clone()),
            LocalValue::List(l) => Leaf::List(l.iter().map(LocalValue::leaf).collect()),
        }
    }
}

/// What a rank wrote, as the all-gather carries it.
#[derive(Serialize, Deserialize, Debug)]
struct Desc {
    key: String,
    path: Vec<(Option<String>, i64)>,
    /// `None` for a value.
    dtype: Option<String>,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    file: String,
    offset: u64,
    length: u64,
}

/// Saves this rank's `tensors` and `values` into the DCP folder `dir`, with every other rank of
/// `comm` doing the same; returns once `dir` is committed (see the module docs). Every rank
/// must call it, with the same `dir`. `values` should come from one rank only (any one).
pub fn save_sharded(
    dir: &Path,
    tensors: &[LocalTensor<'_>],
    values: &[(Vec<KeyPart>, LocalValue)],
    comm: &dyn Collective,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    let rank = comm.rank();
    let coll = |source| Error::Collective { dir: dir.to_path_buf(), source };
    let failed = |rank: u64| move |e: Error| sharded_failure(dir, rank, e.to_string());

    // 1. The staged folder, made by rank 0 and heard by the others. Rank 0 holds the folder's
    // lock until the commit (see `claim.rs`): another process saving there is refused by it.
    let mut _held = None;
    let made = match rank {
        0 => durable::DestLock::acquire(dir).map_err(crate::read::io::fs_error).and_then(|lock| {
            _held = lock;
            refuse_existing(dir).and_then(|()| Stage::folder(dir)).map_err(failed(0))
        }),
        _ => Ok(Stage::default()),
    };
    let said = made.as_ref().map(Stage::said).unwrap_or_default();
    let said = comm.broadcast(0, (rank == 0).then_some(said)).map_err(coll)?;
    let made = agree_sharded(comm, dir, made)?;
    let stage = if rank == 0 { made } else { Stage::heard(&said) };

    // 2. This rank's file, then everyone's descriptors.
    let descs = write_rank(stage.path(), rank, tensors, values, opts).map_err(failed(rank));
    let descs = agree_sharded(comm, dir, descs)?;
    let gathered = comm.all_gather(serde_json::to_vec(&descs).unwrap_or_default()).map_err(coll)?;

    // 3. Rank 0 commits; every rank returns once it did.
    let committed = match rank {
        0 => commit(dir, &stage, &gathered).map_err(|(r, reason)| sharded_failure(dir, r, reason)),
        _ => Ok(()),
    };
    agree_sharded(comm, dir, committed)?;
    Ok(outcome_of(dir, &gathered, comm.world_size()))
}

/// A step of the save that failed, blaming rank `rank`.
fn sharded_failure(dir: &Path, rank: u64, reason: String) -> Error {
    Error::ShardedSave { dir: dir.to_path_buf(), rank, reason }
}

/// The ranks' agreement on a step (`crate::write::job`'s), where every rank returns the failure of the
/// lowest rank that failed with its message: a training loop's every rank raises it. The note
/// each failing rank sends is the rank its error blames (rank 0's commit blames the rank whose
/// chunks did not fit) and the reason.
fn agree_sharded<T>(comm: &dyn Collective, dir: &Path, mine: Result<T>) -> Result<T> {
    let say = |e: &Error| {
        let (rank, reason) = match e {
            Error::ShardedSave { rank, reason, .. } => (*rank, reason.clone()),
            e => (comm.rank(), e.to_string()),
        };
        Some(serde_json::to_vec(&(rank, reason)).unwrap_or_default())
    };
    let other = |first: u64, note: &[u8]| {
        let (rank, reason) = serde_json::from_slice(note).unwrap_or((first, "malformed report".into()));
        sharded_failure(dir, rank, reason)
    };
    agree_with(&crate::Job::new(comm), dir, mine, say, other, |e| e)
}

/// Refuses a `dir` that exists: a sharded save makes a new folder.
fn refuse_existing(dir: &Path) -> Result<()> {
    match std::fs::symlink_metadata(dir) {
        Ok(_) => Err(Error::OutputExists { path: dir.to_path_buf(), appeared: false }),
        Err(_) => Ok(()),
    }
}

/// Step 2 on one rank: its items laid out, written into its file in the staged folder `tmp`,
/// sealed and made durable; returns their descriptors.
fn write_rank(
    tmp: &Path,
    rank: u64,
    tensors: &[LocalTensor<'_>],
    values: &[(Vec<KeyPart>, LocalValue)],
    opts: &WriteOptions<'_>,
) -> Result<Vec<Desc>> {
    let mut file = RankFile::new(tmp, rank);
    let mut descs = Vec::new();
    // Per item, in layout order: its storage bytes (a tensor) or none (a value).
    let mut payloads: Vec<Option<(u64, &[u8])>> = Vec::new();
    for t in tensors {
        let Some((desc, data_at)) = lay_out_tensor(&mut file, t)? else { continue };
        descs.push(desc);
        payloads.push(Some((data_at, t.bytes)));
    }
    for (p, v) in values {
        let layout = writer::layout_value("archive", &v.leaf(), &file.path)?;
        let (offset, length) = file.push_layout(layout);
        descs.push(Desc {
            key: key_of(p),
            path: path_of(p),
            dtype: None,
            shape: vec![],
            offsets: vec![],
            sizes: vec![],
            file: file.name.clone(),
            offset,
            length,
        });
        payloads.push(None);
    }
    write_file(&file, &payloads, opts)?;
    Ok(descs)
}

/// Checks this rank's slice of a tensor and lays it out as the next item of `file`: its
/// descriptor and where its bytes go, or `None` for a slice of no rows.
fn lay_out_tensor(file: &mut RankFile, t: &LocalTensor<'_>) -> Result<Option<(Desc, u64)>> {
    let key = key_of(&t.path);
    let bad = |problem| Error::BadSaveTensor { dst: file.path.clone(), tensor: key.clone(), problem };
    if !t.dtype.bits().is_multiple_of(8) || !t.dtype.in_safetensors() {
        return Err(bad(SaveTensorProblem::Dtype { dtype: t.dtype }));
    }
    let row = numel(t.global_shape.get(1..).unwrap_or_default())
        .and_then(|n| n.checked_mul(t.dtype.bits() / 8))
        .ok_or_else(|| bad(SaveTensorProblem::RowTooLarge))?;
    let len = t.bytes.len() as u64;
    let at = t.dim0_offset;
    let rows = if t.global_shape.is_empty() {
        if len != row || at != 0 {
            return Err(bad(SaveTensorProblem::ScalarBytes { row, len, at }));
        }
        1
    } else {
        if row == 0 || !len.is_multiple_of(row) {
            return Err(bad(SaveTensorProblem::PartialRows { len, row }));
        }
        let rows = len / row;
        let n0 = t.global_shape[0];
        if at.checked_add(rows).is_none_or(|end| end > n0) {
            return Err(bad(SaveTensorProblem::RowsBeyond { at, rows, n0 }));
        }
        rows
    };
    if rows == 0 {
        return Ok(None);
    }
    let item = file.push_rows(t.dtype, &t.global_shape, t.dim0_offset, rows, row)?;
    let c = item.chunk;
    let desc = Desc {
        key,
        path: path_of(&t.path),
        dtype: Some(t.dtype.safetensors_name().to_string()),
        shape: t.global_shape.clone(),
        offsets: c.offsets,
        sizes: c.sizes,
        file: c.file,
        offset: c.offset,
        length: c.length,
    };
    Ok(Some((desc, item.data_at)))
}

/// Writes the laid-out `file`: each tensor's bytes from memory where `payloads` puts them, then
/// every archive's headers and CRCs (computed from the bytes in memory, not read back), then an
/// fsync.
fn write_file(file: &RankFile, payloads: &[Option<(u64, &[u8])>], opts: &WriteOptions<'_>) -> Result<()> {
    let path = &file.path;
    let f = durable::create_temp(path).map_err(fs_error)?;
    f.set_len(file.len).at(path)?;
    for (at, bytes) in payloads.iter().flatten() {
        f.write_all_at(bytes, *at).at(path)?;
        if let Some(progress) = opts.progress {
            progress(bytes.len() as u64);
        }
    }
    for ((base, layout), payload) in file.layouts.iter().zip(payloads) {
        layout.write_fixed_at(&f, path, *base)?;
        let storages: Vec<&[u8]> = payload.iter().map(|(_, b)| *b).collect();
        layout.finish_from(&f, path, *base, &storages)?;
    }
    f.sync_all().at(path)
}

/// A key's path parts as the descriptors carry them.
fn path_of(p: &[KeyPart]) -> Vec<(Option<String>, i64)> {
    p.iter()
        .map(|k| match k {
            KeyPart::Key(s) => (Some(s.clone()), 0),
            KeyPart::Index(i) => (None, *i),
        })
        .collect()
}

type Failure = (u64, String);

/// A key's path, its tensor dtype and shape (`None` for a value), and each rank's pieces.
type Entry = (Vec<PathElem>, Option<(Dtype, Vec<u64>)>, Vec<(u64, Desc)>);

/// Rank 0's commit: the chunks checked, `.metadata` written into the staged folder, and the
/// folder committed. A failure blames the rank whose descriptors were at fault.
fn commit(dir: &Path, stage: &Stage, gathered: &[Vec<u8>]) -> std::result::Result<(), Failure> {
    let mut per_key: BTreeMap<String, Entry> = BTreeMap::new();
    let mut order = Vec::new();
    for (r, bytes) in gathered.iter().enumerate() {
        let r = r as u64;
        let descs: Vec<Desc> = serde_json::from_slice(bytes).map_err(|e| (r, format!("malformed descriptors: {e}")))?;
        for d in descs {
            let dtype = match &d.dtype {
                Some(n) => Some(Dtype::from_safetensors_name(n).ok_or_else(|| (r, format!("unknown dtype `{n}`")))?),
                None => None,
            };
            let path = d.path.iter().map(|(k, i)| k.clone().map_or(PathElem::Index(*i), PathElem::Key)).collect();
            let entry = per_key.entry(d.key.clone()).or_insert_with(|| {
                order.push(d.key.clone());
                (path, dtype.map(|t| (t, d.shape.clone())), Vec::new())
            });
            if entry.1 != dtype.map(|t| (t, d.shape.clone())) {
                return Err((r, format!("`{}` has another dtype, shape or kind than on another rank", d.key)));
            }
            if dtype.is_none() && !entry.2.is_empty() {
                return Err((r, format!("value `{}` is saved by two ranks", d.key)));
            }
            entry.2.push((r, d));
        }
    }
    let mut items = Vec::with_capacity(order.len());
    for key in order {
        let Some((path, kind, mut chunks)) = per_key.remove(&key) else { continue };
        match kind {
            Some((dtype, size)) => {
                chunks.sort_by_key(|(_, d)| d.offsets.first().copied().unwrap_or(0));
                let mut next = 0u64;
                let total = size.first().copied().unwrap_or(1);
                for (r, d) in &chunks {
                    let at = d.offsets.first().copied().unwrap_or(0);
                    if at < next {
                        return Err((*r, format!("tensor `{key}`: rows {at}..{next} are on two ranks")));
                    }
                    if at > next {
                        return Err((*r, format!("tensor `{key}`: rows {next}..{at} are on no rank")));
                    }
                    next = at + d.sizes.first().copied().unwrap_or(1);
                }
                if next != total {
                    let r = chunks.last().map_or(0, |(r, _)| *r);
                    return Err((r, format!("tensor `{key}`: rows {next}..{total} are on no rank")));
                }
                let chunks = chunks
                    .into_iter()
                    .map(|(_, d)| OutChunk {
                        offsets: d.offsets,
                        sizes: d.sizes,
                        file: d.file,
                        offset: d.offset,
                        length: d.length,
                    })
                    .collect();
                items.push(OutItem { key, path, kind: OutKind::Tensor { dtype, size, chunks } });
            }
            None => {
                let Some((_, d)) = chunks.pop() else { continue };
                items.push(OutItem {
                    key,
                    path,
                    kind: OutKind::Bytes { file: d.file, offset: d.offset, length: d.length },
                });
            }
        }
    }
    let io = |e: Error| (0u64, e.to_string());
    let abs = std::fs::canonicalize(dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
        .map(|p| p.join(dir.file_name().unwrap_or_default()))
        .at(dir)
        .map_err(io)?;
    let meta = encode::encode(&items, &abs, &encode::uuid4());
    let meta_path = stage.path().join(METADATA_NAME);
    let write_meta = || -> Result<()> {
        crate::write::write_small(&meta_path, &meta)?;
        refuse_existing(dir).map_err(|_| Error::OutputExists { path: dir.to_path_buf(), appeared: true })?;
        stage.commit_ref()
    };
    write_meta().map_err(io)
}

/// What the ranks wrote together, from the descriptors.
fn outcome_of(dir: &Path, gathered: &[Vec<u8>], world: u64) -> Outcome {
    let mut files = Vec::new();
    let mut keys = BTreeMap::new();
    let mut values = Vec::new();
    let mut bytes = 0;
    for (r, g) in gathered.iter().enumerate() {
        files.push(dir.join(format!("__{r}_0.distcp")));
        let Ok(descs) = serde_json::from_slice::<Vec<Desc>>(g) else { continue };
        for d in descs {
            match d.dtype.as_deref().and_then(Dtype::from_safetensors_name) {
                Some(t) => {
                    bytes += numel(&d.sizes).unwrap_or(0) * (t.bits() / 8);
                    keys.insert(d.key, ());
                }
                None => values.push(d.key),
            }
        }
    }
    files.push(dir.join(METADATA_NAME));
    Outcome { files, tensors: keys.len(), bytes, values, world_size: Some(world), ..Outcome::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use collective::InProcessGroup;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn key(parts: &[&str]) -> Vec<KeyPart> {
        parts.iter().map(|p| KeyPart::Key(p.to_string())).collect()
    }

    /// Each rank of `world` saves FSDP2's dim-0 chunk of a 5×3 tensor and a whole 0-d one.
    fn save(dir: &Path, world: u64, overlap: bool) -> Vec<Result<Outcome>> {
        let full: Vec<f32> = (0..15).map(|i| i as f32).collect();
        let handles = InProcessGroup::new(world);
        std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .into_iter()
                .map(|comm| {
                    let full = &full;
                    s.spawn(move || {
                        let r = comm.rank();
                        let mut rows = fsdp_state::chunk_rows(5, world, r).unwrap_or(0..0);
                        if overlap && r == 1 {
                            rows.start -= 1;
                        }
                        let bytes = f32_bytes(&full[rows.start as usize * 3..rows.end as usize * 3]);
                        let step = f32_bytes(&[7.0]);
                        let mut tensors = vec![LocalTensor {
                            path: key(&["model", "w"]),
                            dtype: Dtype::F32,
                            global_shape: vec![5, 3],
                            dim0_offset: rows.start,
                            bytes: &bytes,
                        }];
                        let mut values = Vec::new();
                        if r == 0 {
                            tensors.push(LocalTensor {
                                path: key(&["model", "step"]),
                                dtype: Dtype::F32,
                                global_shape: vec![],
                                dim0_offset: 0,
                                bytes: &step,
                            });
                            values.push((key(&["model", "lr"]), LocalValue::Float(0.5)));
                        }
                        save_sharded(dir, &tensors, &values, &comm, &WriteOptions::default())
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn ranks_write_a_folder_that_merges_back() {
        for world in [1, 2, 3, 4] {
            let tmp = tempfile::tempdir().expect("tempdir");
            let dir = tmp.path().join("pytorch_model_fsdp_0");
            for out in save(&dir, world, false) {
                let out = out.expect("save");
                assert_eq!(out.tensors, 2);
                assert_eq!(out.values, vec!["model.lr".to_string()]);
            }
            let ck = crate::Checkpoint::open(&dir.to_string_lossy()).expect("open");
            // A rank that holds no rows (the 4th of 4 for 5 rows) writes an empty file that
            // the metadata never names, so the catalog counts the files that hold data.
            assert_eq!(ck.world_size(), Some(world.min(3)));
            let report = crate::verify(&dir.to_string_lossy()).expect("verify");
            assert!(report.problems.is_empty(), "{:?}", report.problems);
            let merged = tmp.path().join("m.safetensors");
            crate::merge(&ck, &merged, &Default::default(), &Default::default()).expect("merge");
            let bytes = std::fs::read(&merged).expect("read");
            let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
            let w = st.tensor("w").expect("w");
            assert_eq!(w.shape(), &[5, 3]);
            assert_eq!(w.data(), &f32_bytes(&(0..15).map(|i| i as f32).collect::<Vec<_>>())[..]);
            assert_eq!(st.tensor("step").expect("step").data(), &f32_bytes(&[7.0])[..]);
            // A rank's rows alone, across the rank files' boundaries.
            let t = ck.tensors().iter().find(|t| t.name == "w").expect("w");
            let rows = ck.read_tensor_range(t, 2 * 12..4 * 12).expect("range");
            assert_eq!(rows, f32_bytes(&(6..12).map(|i| i as f32).collect::<Vec<_>>()));
            // Nothing but the committed folder is left.
            let names: Vec<_> = std::fs::read_dir(tmp.path()).expect("ls").map(|e| e.expect("e").file_name()).collect();
            assert_eq!(names.len(), 2, "{names:?}");
        }
    }

    #[test]
    fn a_save_state_folder_opens_as_its_model() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("pytorch_model_fsdp_0");
        for out in save(&dir, 2, false) {
            out.expect("save");
        }
        let ck = crate::Checkpoint::open(&tmp.path().to_string_lossy()).expect("open");
        assert_eq!(ck.format(), crate::Format::AccelerateState);
        assert_eq!(ck.save_state().expect("components").models[0].path, dir);
        assert_eq!(ck.tensors().len(), 2);
    }

    #[test]
    fn an_optimizer_folder_without_param_groups_is_refused_by_name() {
        let tmp = tempfile::tempdir().expect("tempdir");
        for sub in ["pytorch_model_fsdp_0", "optimizer_0"] {
            for out in save(&tmp.path().join("state").join(sub), 2, false) {
                out.expect("save");
            }
        }
        let e = crate::Checkpoint::open(&tmp.path().join("state").to_string_lossy()).expect_err("no param_groups");
        let e = e.to_string();
        assert!(e.contains("optimizer_0") && e.contains("param_groups"), "{e}");
    }

    #[test]
    fn overlapping_rows_fail_on_every_rank_and_leave_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("d");
        for out in save(&dir, 2, true) {
            let e = out.expect_err("overlap").to_string();
            assert!(e.contains("sharded save failed on rank 1: tensor `model.w`: rows 2..3 are on two ranks"), "{e}");
        }
        assert_eq!(std::fs::read_dir(tmp.path()).expect("ls").count(), 0);
    }

    #[test]
    fn an_existing_folder_is_refused() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).expect("mkdir");
        for out in save(&dir, 2, false) {
            let e = out.expect_err("exists").to_string();
            assert!(e.contains("already exists; refusing to write over it"), "{e}");
        }
    }
}
