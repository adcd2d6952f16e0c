//! The training state as the ranks hold it, and its checkpoints.
//!
//! # On disk
//!
//! ```text
//! DIR/
//!   step-0000040/                  one committed checkpoint (accelerate's `save_state` shape)
//!     pytorch_model_fsdp_0/        DCP folder: {"model": {fqn: tensor}}, FSDP2 dim-0 chunks
//!     optimizer_0/                 DCP folder: {"optimizer": {"state": {fqn: {exp_avg,
//!                                  exp_avg_sq, step}}, "param_groups": [{lr, betas, ...}]}}
//!     statekit_state.json          step, schedule, sizes, world size, loader state
//!   latest -> step-0000040         symlink, swapped atomically after the commit
//! ```
//!
//! A step folder is built as a [`ckpt::StagedFolder`] (`.step-0000040.<random>.tmp` beside
//! its place), its two DCP folders each committed by [`ckpt::save_sharded`] from every rank,
//! then the JSON; rank 0 then commits it, which moves `latest`, and only then does
//! `--keep-last` prune older step folders. Every rank writes only its own rows: in `ddp` mode,
//! where each rank holds the whole model, rank r still writes just FSDP2's r-th chunk, so both
//! modes save the same layout and resume either way.
//!
//! # Why no kill loses `latest`
//!
//! `latest` always names a complete step folder: a step folder appears under its name only by
//! the rename of a complete, fsynced temporary, and leaves it only by a rename (pruning goes
//! through [`ckpt::StagedFolder::discard`]), so no `step-N/` is ever partial; `latest` moves
//! by one rename, after the folder it will name is in place. A save of a step that is already
//! committed (a run that saves the step it resumed from, which `latest` names) does not remove
//! the old folder first: the new one is built beside it and the two are swapped in one
//! `renameat2(RENAME_EXCHANGE)`, so `step-N` goes from the old complete folder to the new one
//! with no moment in between. Where the filesystem cannot swap, `latest` is first pointed at
//! the newest other committed step (a complete checkpoint of the same run, from which a resume
//! reaches the same bits), and back once the new folder is in place; see
//! [`ckpt::StagedFolder`].

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use ckpt::{KeyPart, LocalTensor, LocalValue};
use collective::Collective;

pub(crate) use crate::state_file::{parse_step_dir_name, step_dir_name, ParamMeta, TrainState, STATE_FILE};

/// accelerate's model folder.
pub(crate) const MODEL_DIR: &str = "pytorch_model_fsdp_0";
/// accelerate's optimizer folder.
pub(crate) const OPTIM_DIR: &str = "optimizer_0";
/// The link to the last committed step folder.
pub(crate) const LATEST: &str = "latest";

/// A rank's master parameters and AdamW moments, element for element: the whole model in
/// `ddp` mode, its FSDP2 chunks (parameter after parameter) in `sharded` mode.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Weights {
    /// The parameters.
    pub(crate) params: Vec<f32>,
    /// AdamW's first moments.
    pub(crate) exp_avg: Vec<f32>,
    /// AdamW's second moments.
    pub(crate) exp_avg_sq: Vec<f32>,
}

impl Weights {
    /// `len` elements of zeros in each buffer.
    pub(crate) fn zeros(len: usize) -> Weights {
        Weights { params: vec![0.0; len], exp_avg: vec![0.0; len], exp_avg_sq: vec![0.0; len] }
    }
}

/// What a rank writes at a checkpoint: the weights as they were when the save was asked for
/// (shared, not copied: the loop writes the next step into its other set), the element range
/// of each parameter's rows this rank writes, and the JSON.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    pub(crate) step: u64,
    pub(crate) weights: Arc<Weights>,
    /// Per parameter, in order: this rank's rows of it, as a range of `weights`' elements.
    pub(crate) rows: Vec<Range<usize>>,
    pub(crate) state: TrainState,
    pub(crate) lr: f64,
    /// Test hook (`--pause-in-save-ms`): sleep this long between the model and the optimizer
    /// folder, so that a test can kill the ranks in the middle of a checkpoint write.
    pub(crate) pause_ms: u64,
}

fn key(parts: &[&str]) -> Vec<KeyPart> {
    parts.iter().map(|s| KeyPart::Key(s.to_string())).collect()
}

/// Writes the checkpoint of step `snap.step` into `dir`, moves `latest`, prunes to `keep_last`
/// (0: keep all). Every rank calls it; returns once committed everywhere.
pub(crate) fn save(dir: &Path, snap: &Snapshot, keep_last: usize, comm: &dyn Collective) -> anyhow::Result<PathBuf> {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let rank = comm.rank();
    let final_dir = dir.join(step_dir_name(snap.step));
    // Rank 0 makes the folder under a temporary name; every rank writes into it.
    let stage = if rank == 0 { Some(ckpt::StagedFolder::new(&final_dir)?) } else { None };
    let path = stage.as_ref().map(|s| s.path().as_os_str().as_bytes().to_vec());
    let staging = PathBuf::from(std::ffi::OsString::from_vec(comm.broadcast(0, path)?));

    let step_bytes = (snap.step as f32).to_le_bytes();
    let (model, optim) = rank_tensors(snap, rank, &step_bytes);
    let values = if rank == 0 { param_group(snap) } else { Vec::new() };
    let opts = ckpt::WriteOptions::default();
    ckpt::save_sharded(&staging.join(MODEL_DIR), &model, &[], comm, &opts)?;
    if snap.pause_ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(snap.pause_ms));
    }
    ckpt::save_sharded(&staging.join(OPTIM_DIR), &optim, &values, comm, &opts)?;

    let status = stage.map(|stage| match commit(dir, stage, snap, keep_last) {
        Ok(()) => b"ok".to_vec(),
        Err(e) => format!("{e:#}").into_bytes(),
    });
    let status = String::from_utf8_lossy(&comm.broadcast(0, status)?).into_owned();
    if status != "ok" {
        bail!("checkpoint {}: {status}", final_dir.display());
    }
    Ok(final_dir)
}

/// This rank's tensors of the model folder and of the optimizer folder (rank 0 adds the
/// optimizer's `step` tensors), borrowing the snapshot's buffers.
fn rank_tensors<'a>(
    snap: &'a Snapshot,
    rank: u64,
    step_bytes: &'a [u8; 4],
) -> (Vec<LocalTensor<'a>>, Vec<LocalTensor<'a>>) {
    let w = &snap.weights;
    let mut model = Vec::new();
    let mut optim = Vec::new();
    for (p, rows) in snap.state.params.iter().zip(&snap.rows) {
        let dim0_offset = p.chunk(snap.state.world_size, rank).start;
        let tensor = |path: Vec<KeyPart>, buf: &'a [f32]| LocalTensor {
            path,
            dtype: ckpt::Dtype::F32,
            global_shape: p.shape.clone(),
            dim0_offset,
            bytes: crate::host::le_bytes(&buf[rows.clone()]),
        };
        model.push(tensor(key(&["model", &p.name]), &w.params));
        optim.push(tensor(key(&["optimizer", "state", &p.name, "exp_avg"]), &w.exp_avg));
        optim.push(tensor(key(&["optimizer", "state", &p.name, "exp_avg_sq"]), &w.exp_avg_sq));
        if rank == 0 {
            optim.push(LocalTensor {
                path: key(&["optimizer", "state", &p.name, "step"]),
                dtype: ckpt::Dtype::F32,
                global_shape: vec![],
                dim0_offset: 0,
                bytes: step_bytes.as_slice(),
            });
        }
    }
    (model, optim)
}

/// torch's AdamW `param_groups[0]`, as rank 0 writes it into the optimizer folder.
fn param_group(snap: &Snapshot) -> Vec<(Vec<KeyPart>, LocalValue)> {
    let a = &snap.state.adamw;
    // The decimal the flag gave (0.9), not the f32 nearest to it widened (0.8999999761…).
    let dec = |x: f32| x.to_string().parse::<f64>().unwrap_or(f64::from(x));
    let group = |k: &str| {
        vec![
            KeyPart::Key("optimizer".into()),
            KeyPart::Key("param_groups".into()),
            KeyPart::Index(0),
            KeyPart::Key(k.into()),
        ]
    };
    let names = snap.state.params.iter().map(|p| LocalValue::Str(p.name.clone())).collect();
    vec![
        (group("lr"), LocalValue::Float(snap.lr)),
        (group("betas"), LocalValue::List(vec![LocalValue::Float(dec(a.beta1)), LocalValue::Float(dec(a.beta2))])),
        (group("eps"), LocalValue::Float(dec(a.eps))),
        (group("weight_decay"), LocalValue::Float(dec(a.weight_decay))),
        (group("amsgrad"), LocalValue::Bool(false)),
        (group("maximize"), LocalValue::Bool(false)),
        (group("foreach"), LocalValue::None),
        (group("capturable"), LocalValue::Bool(false)),
        (group("differentiable"), LocalValue::Bool(false)),
        (group("fused"), LocalValue::None),
        (group("decoupled_weight_decay"), LocalValue::Bool(true)),
        (group("params"), LocalValue::List(names)),
    ]
}

/// Rank 0, once every rank's files are in the staged folder: the JSON, the commit (which
/// moves `latest`), pruning, and the sweep of what killed saves left.
fn commit(dir: &Path, stage: ckpt::StagedFolder, snap: &Snapshot, keep_last: usize) -> anyhow::Result<()> {
    let json = serde_json::to_vec_pretty(&snap.state)?;
    stage.write_file(STATE_FILE, &json)?;
    let name = step_dir_name(snap.step);
    // Where `latest` waits if the folder it names is replaced and the filesystem cannot swap:
    // the newest committed step before this one, else any other.
    let others: Vec<(u64, String)> = committed(dir)?.into_iter().filter(|(_, n)| *n != name).collect();
    let interim = others.iter().rev().find(|(s, _)| *s < snap.step).or(others.last()).map(|(_, n)| n.as_str());
    stage.commit_and_link(LATEST, interim)?;
    if keep_last > 0 {
        // Never the folder just committed, whatever the steps of others left beside it.
        let older: Vec<String> = committed(dir)?.into_iter().map(|(_, n)| n).filter(|n| *n != name).collect();
        for n in &older[..older.len().saturating_sub(keep_last - 1)] {
            ckpt::StagedFolder::discard(dir.join(n)).with_context(|| format!("pruning {n}"))?;
        }
    }
    // Leftovers of killed saves: staged folders, and replaced ones not yet removed.
    ckpt::StagedFolder::sweep(dir, "step-")?;
    Ok(())
}

/// The committed step folders of `dir` (exactly the names [`step_dir_name`] writes), by step.
fn committed(dir: &Path) -> anyhow::Result<Vec<(u64, String)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let e = e.with_context(|| format!("{}", dir.display()))?;
        let n = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = parse_step_dir_name(&n) {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.push((step, n));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// A loaded checkpoint, cut to this rank's rows.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub(crate) state: TrainState,
    pub(crate) weights: Weights,
    /// The step folder it was read from.
    pub(crate) dir: PathBuf,
}

/// Reads `dir/latest` and cuts this rank's rows (`own(param) -> rows`) of every parameter and
/// moment; refuses, in one line naming the file and the rank, a checkpoint that does not match
/// `params`, is incomplete, or disagrees with itself: the folder's name, the JSON's `step` and
/// the optimizer's `step` tensors are one number.
pub(crate) fn load(
    dir: &Path,
    params: &[ParamMeta],
    rank: u64,
    own: &dyn Fn(&ParamMeta) -> std::ops::Range<u64>,
) -> anyhow::Result<Loaded> {
    let (step_dir, folder_step) = latest_step_dir(dir, rank)?;
    let json_path = step_dir.join(STATE_FILE);
    let state = crate::state_file::parse_file(&json_path, rank)?;
    if folder_step != state.step {
        bail!(
            "{}: rank {rank}: `step` is {}, but the folder is `{}`",
            json_path.display(),
            state.step,
            step_dir_name(folder_step)
        );
    }
    if state.params != params {
        let first = state.params.iter().zip(params).find(|(a, b)| a != b);
        let what = match first {
            Some((a, b)) => format!("`{}` has shape {:?} there, {:?} here", a.name, a.shape, b.shape),
            None => format!("{} parameters there, {} here", state.params.len(), params.len()),
        };
        bail!("{}: rank {rank}: the checkpoint is of another model: {what}", json_path.display());
    }
    let open = |sub: &str| -> anyhow::Result<ckpt::Checkpoint> {
        let d = step_dir.join(sub);
        // A missing rank file, a truncated one or a broken `.metadata`: ckpt names the file.
        let ck = ckpt::Checkpoint::open(&d.to_string_lossy()).map_err(|e| anyhow::anyhow!("{e} (rank {rank})"))?;
        let entries = std::fs::read_dir(&d).with_context(|| format!("{} (rank {rank})", d.display()))?;
        let files = entries.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".distcp")).count() as u64;
        if files != state.world_size {
            bail!(
                "{}: rank {rank}: {files} rank files, but the checkpoint was saved by {} ranks",
                d.display(),
                state.world_size
            );
        }
        Ok(ck)
    };
    let model = open(MODEL_DIR)?;
    let optim = open(OPTIM_DIR)?;
    check_step_tensors(&optim, params, state.step, rank)?;
    let mut out = Loaded { weights: Weights::default(), state, dir: step_dir.clone() };
    for (ck, name, target) in
        [(&model, String::new(), 0usize), (&optim, "state.".to_string(), 1), (&optim, "state.".to_string(), 2)]
    {
        for p in params {
            let full = match target {
                0 => p.name.clone(),
                1 => format!("{name}{}.exp_avg", p.name),
                _ => format!("{name}{}.exp_avg_sq", p.name),
            };
            let t = ck
                .tensors()
                .iter()
                .find(|t| t.name == full)
                .ok_or_else(|| anyhow::anyhow!("{}: rank {rank}: no tensor `{full}`", ck.root().display()))?;
            if t.shape != p.shape || t.dtype != ckpt::Dtype::F32 {
                bail!(
                    "{}: rank {rank}: `{full}` is {:?} {}, expected {:?} F32",
                    ck.root().display(),
                    t.shape,
                    t.dtype,
                    p.shape
                );
            }
            // Only this rank's rows are read.
            let rows = own(p);
            let row = p.row_len() as u64 * 4;
            let bytes = ck
                .read_tensor_range(t, rows.start * row..rows.end * row)
                .map_err(|e| anyhow::anyhow!("{e} (rank {rank})"))?;
            let (lo, hi) = (0, bytes.len());
            let dst = match target {
                0 => &mut out.weights.params,
                1 => &mut out.weights.exp_avg,
                _ => &mut out.weights.exp_avg_sq,
            };
            dst.extend(bytes[lo..hi].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        }
    }
    Ok(out)
}

/// The step folder `dir/latest` names: `latest` must be a link whose target is exactly a
/// `step-N` name, a real folder directly inside `dir` (not a path, not a link itself), so a
/// link to a copy elsewhere or to another name is refused rather than followed. Returns the
/// folder and the step its name gives.
fn latest_step_dir(dir: &Path, rank: u64) -> anyhow::Result<(PathBuf, u64)> {
    let latest = dir.join(LATEST);
    let meta = std::fs::symlink_metadata(&latest)
        .with_context(|| format!("{}: no committed checkpoint (rank {rank})", latest.display()))?;
    if !meta.file_type().is_symlink() {
        bail!(
            "{}: rank {rank}: not a link; `{LATEST}` must be a link to a `step-N` folder beside it",
            latest.display()
        );
    }
    let target = std::fs::read_link(&latest).with_context(|| format!("{} (rank {rank})", latest.display()))?;
    let named = target.to_str().and_then(|t| Some((t, parse_step_dir_name(t)?)));
    let (name, step) = named.ok_or_else(|| {
        anyhow::anyhow!(
            "{}: rank {rank}: names `{}`, not a `step-N` folder inside `{}`",
            latest.display(),
            target.display().to_string().escape_debug(),
            dir.display()
        )
    })?;
    let step_dir = dir.join(name);
    let kind = std::fs::symlink_metadata(&step_dir)
        .with_context(|| format!("{}: rank {rank}: `{LATEST}` names a missing folder", step_dir.display()))?
        .file_type();
    if !kind.is_dir() {
        bail!("{}: rank {rank}: `{LATEST}` names this, which is not a folder (a link or a file)", step_dir.display());
    }
    Ok((step_dir, step))
}

/// Each parameter's `step` tensor in the optimizer folder (a 0-d `f32`, as torch's AdamW keeps
/// it) must hold `step` exactly.
fn check_step_tensors(optim: &ckpt::Checkpoint, params: &[ParamMeta], step: u64, rank: u64) -> anyhow::Result<()> {
    let root = optim.root().display();
    for p in params {
        let name = format!("state.{}.step", p.name);
        let t = optim
            .tensors()
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| anyhow::anyhow!("{root}: rank {rank}: no tensor `{name}`"))?;
        if !t.shape.is_empty() || t.dtype != ckpt::Dtype::F32 {
            bail!("{root}: rank {rank}: `{name}` is {:?} {}, expected a 0-d F32", t.shape, t.dtype);
        }
        let bytes = optim.read_tensor_range(t, 0..4).map_err(|e| anyhow::anyhow!("{e} (rank {rank})"))?;
        let got = match bytes.first_chunk::<4>() {
            Some(b) => f32::from_le_bytes(*b),
            None => bail!("{root}: rank {rank}: `{name}` holds {} bytes, not 4", bytes.len()),
        };
        if f64::from(got) != step as f64 {
            bail!("{root}: rank {rank}: `{name}` is {got}, but `{STATE_FILE}` says step {step}");
        }
    }
    Ok(())
}
