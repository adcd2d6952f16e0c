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
//! A step folder is built under a temporary name (`.step-0000040.<random>.tmp`), its two DCP
//! folders each committed by [`ckpt::save_sharded`], then the JSON, then renamed into place by
//! rank 0; only then does `latest` move and `--keep-last` prune older step folders. Every rank
//! writes only its own rows: in `ddp` mode, where each rank holds the whole model, rank r still
//! writes just FSDP2's r-th chunk, so both modes save the same layout and resume either way.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use ckpt::{KeyPart, LocalTensor, LocalValue};
use collective::Collective;

pub use crate::state_file::{
    parse_step_dir_name, step_dir_name, ParamMeta, TrainState, MAX_STATE_LEN, MAX_STEP, STATE_FILE, STATE_FORMAT,
    STATE_VERSION,
};

/// accelerate's model folder.
pub const MODEL_DIR: &str = "pytorch_model_fsdp_0";
/// accelerate's optimizer folder.
pub const OPTIM_DIR: &str = "optimizer_0";
/// The link to the last committed step folder.
pub const LATEST: &str = "latest";

/// What a rank snapshots at a checkpoint: its rows of the parameters and moments (FSDP2
/// chunks, parameter after parameter, as little-endian `f32` bytes), and the JSON.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub step: u64,
    pub p: Vec<u8>,
    pub m: Vec<u8>,
    pub v: Vec<u8>,
    pub state: TrainState,
    pub lr: f64,
    /// Test hook (`--pause-in-save-ms`): sleep this long between the model and the optimizer
    /// folder, so that a test can kill the ranks in the middle of a checkpoint write.
    pub pause_ms: u64,
}

fn key(parts: &[&str]) -> Vec<KeyPart> {
    parts.iter().map(|s| KeyPart::Key(s.to_string())).collect()
}

/// Writes the checkpoint of step `snap.step` into `dir`, moves `latest`, prunes to `keep_last`
/// (0: keep all). Every rank calls it; returns once committed everywhere.
pub fn save(dir: &Path, snap: &Snapshot, keep_last: usize, comm: &dyn Collective) -> anyhow::Result<PathBuf> {
    let rank = comm.rank();
    let world = comm.world_size();
    let name = step_dir_name(snap.step);
    let final_dir = dir.join(&name);
    let staging = if rank == 0 {
        std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
        if final_dir.exists() {
            // A checkpoint of this step is committed already (a resumed run saving again).
            std::fs::remove_dir_all(&final_dir).ok();
        }
        let s = dir.join(format!(".{name}.{}.tmp", random_hex()));
        std::fs::create_dir(&s).with_context(|| format!("{}", s.display()))?;
        Some(s.to_string_lossy().into_owned().into_bytes())
    } else {
        None
    };
    let staging = PathBuf::from(String::from_utf8(comm.broadcast(0, staging)?)?);

    let params = &snap.state.params;
    let (pb, mb, vb) = (&snap.p, &snap.m, &snap.v);
    let step_bytes = (snap.step as f32).to_le_bytes();
    let mut model = Vec::new();
    let mut optim = Vec::new();
    let mut at = 0usize;
    for p in params {
        let rows = p.chunk(world, rank);
        let n = (rows.end - rows.start) as usize * p.row_len() * 4;
        model.push(LocalTensor {
            path: key(&["model", &p.name]),
            dtype: ckpt::Dtype::F32,
            global_shape: p.shape.clone(),
            dim0_offset: rows.start,
            bytes: &pb[at..at + n],
        });
        for (b, buf) in [("exp_avg", &mb), ("exp_avg_sq", &vb)] {
            optim.push(LocalTensor {
                path: key(&["optimizer", "state", &p.name, b]),
                dtype: ckpt::Dtype::F32,
                global_shape: p.shape.clone(),
                dim0_offset: rows.start,
                bytes: &buf[at..at + n],
            });
        }
        if rank == 0 {
            optim.push(LocalTensor {
                path: key(&["optimizer", "state", &p.name, "step"]),
                dtype: ckpt::Dtype::F32,
                global_shape: vec![],
                dim0_offset: 0,
                bytes: &step_bytes,
            });
        }
        at += n;
    }
    let mut values = Vec::new();
    if rank == 0 {
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
        values.push((group("lr"), LocalValue::Float(snap.lr)));
        values.push((
            group("betas"),
            LocalValue::List(vec![LocalValue::Float(dec(a.beta1)), LocalValue::Float(dec(a.beta2))]),
        ));
        values.push((group("eps"), LocalValue::Float(dec(a.eps))));
        values.push((group("weight_decay"), LocalValue::Float(dec(a.weight_decay))));
        values.push((group("amsgrad"), LocalValue::Bool(false)));
        values.push((group("maximize"), LocalValue::Bool(false)));
        values.push((group("foreach"), LocalValue::None));
        values.push((group("capturable"), LocalValue::Bool(false)));
        values.push((group("differentiable"), LocalValue::Bool(false)));
        values.push((group("fused"), LocalValue::None));
        values.push((group("decoupled_weight_decay"), LocalValue::Bool(true)));
        values.push((
            group("params"),
            LocalValue::List(params.iter().map(|p| LocalValue::Str(p.name.clone())).collect()),
        ));
    }
    let opts = ckpt::WriteOptions::default();
    ckpt::save_sharded(&staging.join(MODEL_DIR), &model, &[], comm, &opts)?;
    if snap.pause_ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(snap.pause_ms));
    }
    ckpt::save_sharded(&staging.join(OPTIM_DIR), &optim, &values, comm, &opts)?;

    let status = if rank == 0 {
        Some(match commit(dir, &staging, &final_dir, &snap.state, keep_last) {
            Ok(()) => b"ok".to_vec(),
            Err(e) => format!("{e:#}").into_bytes(),
        })
    } else {
        None
    };
    let status = String::from_utf8(comm.broadcast(0, status)?)?;
    if status != "ok" {
        bail!("checkpoint {}: {status}", final_dir.display());
    }
    Ok(final_dir)
}

fn commit(dir: &Path, staging: &Path, final_dir: &Path, state: &TrainState, keep_last: usize) -> anyhow::Result<()> {
    let json = serde_json::to_vec_pretty(state)?;
    let path = staging.join(STATE_FILE);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&path)?;
        f.write_all(&json)?;
        f.sync_all()?;
    }
    std::fs::File::open(staging)?.sync_all()?;
    std::fs::rename(staging, final_dir)?;
    std::fs::File::open(dir)?.sync_all()?;
    // `latest`: a new link under a temporary name, renamed over the old one.
    let name = final_dir.file_name().unwrap_or_default();
    let tmp = dir.join(format!(".latest.{}.tmp", random_hex()));
    std::os::unix::fs::symlink(name, &tmp)?;
    std::fs::rename(&tmp, dir.join(LATEST))?;
    std::fs::File::open(dir)?.sync_all()?;
    if keep_last > 0 {
        let steps = committed(dir)?;
        let drop = steps.len().saturating_sub(keep_last);
        for s in &steps[..drop] {
            std::fs::remove_dir_all(dir.join(s)).with_context(|| format!("pruning {s}"))?;
        }
    }
    // Leftover staging folders of killed saves.
    for e in std::fs::read_dir(dir)?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(".step-") && n.ends_with(".tmp") && e.path() != staging {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    Ok(())
}

/// The committed step folders of `dir` (exactly the names [`step_dir_name`] writes), by step.
pub fn committed(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = parse_step_dir_name(&n) {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.push((step, n));
            }
        }
    }
    out.sort();
    Ok(out.into_iter().map(|(_, n)| n).collect())
}

fn random_hex() -> String {
    use std::io::Read;
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_err() {
        b = (std::process::id() as u64 ^ 0x9e37).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A loaded checkpoint, cut to this rank's rows.
#[derive(Debug)]
pub struct Loaded {
    pub state: TrainState,
    pub p: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub dir: PathBuf,
}

/// Reads `dir/latest` and cuts this rank's rows (`own(param) -> rows`) of every parameter and
/// moment; refuses, in one line naming the file and the rank, a checkpoint that does not match
/// `params`, is incomplete, or disagrees with itself: the folder's name, the JSON's `step` and
/// the optimizer's `step` tensors are one number.
pub fn load(
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
        let files =
            std::fs::read_dir(&d)?.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".distcp")).count()
                as u64;
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
    let mut out = Loaded { p: Vec::new(), m: Vec::new(), v: Vec::new(), state, dir: step_dir.clone() };
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
                0 => &mut out.p,
                1 => &mut out.m,
                _ => &mut out.v,
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
