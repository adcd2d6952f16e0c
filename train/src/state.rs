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
use serde::{Deserialize, Serialize};

use crate::model::ModelConfig;
use crate::optim::{AdamW, Schedule};

/// Format tag of our JSON.
pub const STATE_FORMAT: &str = "statekit.train";
/// Its version.
pub const STATE_VERSION: u32 = 1;
/// Our file in a step folder.
pub const STATE_FILE: &str = "statekit_state.json";
/// accelerate's model folder.
pub const MODEL_DIR: &str = "pytorch_model_fsdp_0";
/// accelerate's optimizer folder.
pub const OPTIM_DIR: &str = "optimizer_0";

/// One parameter's geometry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamMeta {
    pub name: String,
    pub shape: Vec<u64>,
}

impl ParamMeta {
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<u64>() as usize
    }
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }
    pub fn row_len(&self) -> usize {
        self.shape.get(1..).unwrap_or_default().iter().product::<u64>() as usize
    }
    /// FSDP2's rows of rank `r` of `w`.
    pub fn chunk(&self, w: u64, r: u64) -> std::ops::Range<u64> {
        fsdp_state::chunk_rows(self.rows(), w, r).unwrap_or(0..0)
    }
}

/// Our JSON in a step folder.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    pub format: String,
    pub version: u32,
    /// Optimizer steps taken.
    pub step: u64,
    pub world_size: u64,
    pub mode: String,
    pub model: ModelConfig,
    pub adamw: AdamW,
    pub schedule: Schedule,
    pub seed: i64,
    pub batch_size: u64,
    pub grad_accum: u64,
    /// Parameter names and shapes, in the optimizer's order.
    pub params: Vec<ParamMeta>,
    /// The data position (one global cursor, the same on every rank).
    pub loader: dataload::LoaderState,
    /// The random state of each rank. The model has no random layers and the data order is a
    /// function of the loader state, so there is none to keep: each entry is the seed the
    /// rank's torch generator was started from, recorded so that a change can be refused.
    pub rank_rng: Vec<i64>,
}

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
    let name = format!("step-{:07}", snap.step);
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
    std::fs::rename(&tmp, dir.join("latest"))?;
    std::fs::File::open(dir)?.sync_all()?;
    if keep_last > 0 {
        let mut steps = committed(dir)?;
        steps.sort();
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

/// The committed step folders of `dir`, by name.
pub fn committed(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("step-") && e.path().is_dir() {
            out.push(n);
        }
    }
    Ok(out)
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
/// moment; refuses a checkpoint that does not match `params` or is incomplete, naming the
/// file and the rank.
pub fn load(
    dir: &Path,
    params: &[ParamMeta],
    rank: u64,
    own: &dyn Fn(&ParamMeta) -> std::ops::Range<u64>,
) -> anyhow::Result<Loaded> {
    let step_dir = std::fs::canonicalize(dir.join("latest"))
        .with_context(|| format!("{}: no committed checkpoint (rank {rank})", dir.join("latest").display()))?;
    let json_path = step_dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&json_path).with_context(|| format!("{} (rank {rank})", json_path.display()))?;
    let state: TrainState =
        serde_json::from_str(&text).with_context(|| format!("{} (rank {rank})", json_path.display()))?;
    if state.format != STATE_FORMAT || state.version != STATE_VERSION {
        bail!("{}: rank {rank}: not a {STATE_FORMAT} v{STATE_VERSION} state", json_path.display());
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
