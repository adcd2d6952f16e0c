//! `ckpt reshard DS_DIR OUT --world-size M`: a ZeRO checkpoint rewritten as the *universal*
//! checkpoint DeepSpeed 0.19.8 loads with `"checkpoint": {"load_universal": true}` on any number
//! of ranks (native ZeRO files are tied to their world size; DeepSpeed refuses them elsewhere).
//!
//! The layout is `ds_to_universal.py`'s, with what DeepSpeed's loader reads
//! (`load_hp_checkpoint_state_from_checkpoint_dir[_stage3]`):
//!
//! ```text
//! OUT/latest_universal              "<tag>_universal", written last (the commit marker)
//! OUT/<tag>_universal/*model_states.pt   byte copies of the source's model-states files
//! OUT/<tag>_universal/zero/optimizer_state.pt
//! OUT/<tag>_universal/zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt[, step.pt]
//! ```
//!
//! - stage 1/2: each state file is `{"param": tensor shaped like the param, "cat_dim": 0}`,
//!   `step.pt` the 0-d step tensor of the param's group;
//! - stage 3: bare 1-D fp32 tensors, no `step.pt` (the loader takes the step from
//!   `optimizer_state.pt`'s `optimizer_state_dict.state[0].step`).
//!
//! `optimizer_state.pt` holds rank 0's world-size-independent globals, with their DeepSpeed
//! classes (`LossScaler` as NEWOBJ + BUILD, `ZeroStageEnum` as REDUCE), and `param_groups`:
//! stage 1/2 `loss_scaler, dynamic_loss_scale, overflow, clip_grad, zero_stage, ds_version,
//! param_groups`; stage 3 `zero_stage, loss_scaler, dynamic_loss_scale, overflow,
//! optimizer_state_dict {state {0: {step}}, param_groups}, param_groups`. The per-rank
//! partition bookkeeping ds_to_universal also copies (`partition_count`, `group_paddings`,
//! rank 0's flat groups) is left out: it describes the old world size and the loader ignores it.
//! ds_to_universal's `--inject_missing_state` extras (`fp32.pt` for aliases, frozen params and
//! buffers) are left out too: the loader only visits optimizer params; the rest comes from the
//! model-states files.

use std::path::{Path, PathBuf};

use super::read::{ZeroCheckpoint, OPTIM_CLASSES};
use crate::error::{Error, Result};
use crate::formats::torch::flatten::Leaf;
use crate::formats::torch::writer::{self, TorchLayout, TorchSeal, WNode, WStorage, WTensor, WValue};
use crate::formats::torch::{self, TorchFile};
use crate::ops::outcome::Outcome;
use crate::read::catalog::{Checkpoint, Chunk};
use crate::read::dtype::Dtype;
use crate::read::shape::numel;
use crate::write::{Plan, RangeCopy, TargetFile, WriteOptions};

/// The file naming the universal tag, beside it.
pub(super) const LATEST_UNIVERSAL: &str = "latest_universal";

/// A torch file to write: its layout and where each storage's bytes come from.
struct TorchTarget {
    path: PathBuf,
    layout: TorchLayout,
    sources: Vec<Vec<Chunk>>,
}

impl TorchTarget {
    fn push(self, plan: &mut Plan) {
        let mut copies = Vec::new();
        for (chunks, &at) in self.sources.iter().zip(&self.layout.storage_offsets) {
            let mut dst = at;
            for c in chunks {
                if c.len > 0 {
                    copies.push(RangeCopy { src: c.file, src_off: c.offset, dst_off: dst, len: c.len });
                }
                dst += c.len;
            }
        }
        let mut target = TargetFile::new(self.path, Vec::new(), self.layout.file_len);
        target.copies = copies;
        target.seal = Some(Box::new(TorchSeal(vec![(0, self.layout)])));
        plan.targets.push(target);
    }
}

fn f32_tensor(shape: Vec<u64>) -> WTensor {
    WTensor { dtype: Dtype::F32, shape, storage: 0, offset: 0 }
}

fn f32_storage(numel: u64) -> WStorage {
    WStorage { dtype: Dtype::F32, byte_len: numel * 4 }
}

/// A leaf of rank 0's optim file as a pickle node: instances of the allow-listed DeepSpeed
/// classes get their class back (the reader keeps them as `{__class__, args, state}`), and
/// `betas` its tuple.
fn node_of(l: &Leaf, key: &str) -> WNode {
    match l {
        Leaf::Dict(items) => {
            if let Some((_, Leaf::Str(class))) = items.first().filter(|(k, _)| k == "__class__") {
                if let Some((module, name)) = class.rsplit_once('.').filter(|_| OPTIM_CLASSES.contains(&class.as_str()))
                {
                    let args = match items.iter().find(|(k, _)| k == "args") {
                        Some((_, Leaf::List(a))) => a.iter().map(|x| node_of(x, "")).collect(),
                        _ => Vec::new(),
                    };
                    let state = items.iter().find(|(k, _)| k == "state").map(|(_, s)| Box::new(node_of(s, "")));
                    return WNode::Instance { module: module.into(), name: name.into(), args, state };
                }
            }
            WNode::Dict(items.iter().map(|(k, v)| (WNode::Leaf(Leaf::Str(k.clone())), node_of(v, k))).collect())
        }
        Leaf::List(items) if key == "betas" => WNode::Tuple(items.iter().map(|x| node_of(x, "")).collect()),
        Leaf::List(items) => WNode::List(items.iter().map(|x| node_of(x, "")).collect()),
        other => WNode::Leaf(other.clone()),
    }
}

fn leaf<'a>(f: &'a TorchFile, key: &str) -> Option<&'a Leaf> {
    f.leaves.iter().find(|(k, _)| k == key).map(|(_, l)| l)
}

/// A 0-d fp32 tensor of rank 0's optim file (a `step`), as one range of source file 0.
fn scalar(f: &TorchFile, key: &str) -> Result<Chunk> {
    let bad = |reason: &str| Error::BadZeroCheckpoint {
        path: f.path.clone(),
        rank: 0,
        tensor: key.to_string(),
        reason: reason.to_string(),
    };
    let t = f.tensors.iter().find(|t| t.name == key).ok_or_else(|| bad("missing"))?;
    if t.dtype != Dtype::F32 || numel(&t.shape) != Some(1) {
        return Err(bad(&format!("expected a one-element fp32 tensor, found `{}` {:?}", t.dtype, t.shape)));
    }
    let s = f.storages.get(t.storage).ok_or_else(|| bad("names no storage"))?;
    if t.offset.saturating_add(1).saturating_mul(4) > s.byte_len {
        return Err(bad("lies past its storage"));
    }
    Ok(Chunk { file: 0, offset: s.file_offset + t.offset * 4, len: 4 })
}

/// The tag folder's name of `ck`'s universal checkpoint: `<tag>_universal`, as DeepSpeed's
/// `ds_to_universal.py` names it.
pub(super) fn tag_of(ck: &ZeroCheckpoint) -> String {
    format!("{}_universal", ck.tag)
}

/// Writes `ck` as a universal checkpoint under `out` for resuming on `world` ranks (any world
/// size loads the same files; `world` is checked, not encoded).
pub(crate) fn reshard_zero(
    source: &Checkpoint,
    ck: &ZeroCheckpoint,
    out: &Path,
    world: u64,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    write_universal(source, ck, &out.join(tag_of(ck)), Some(&out.join(LATEST_UNIVERSAL)), world, opts)
}

/// Writes `ck` as a universal checkpoint whose tag folder is `dir`, with `latest` (a
/// `latest_universal`) naming it when given, in one plan: the tag folder and its pointer are
/// committed together, the pointer last.
pub(crate) fn write_universal(
    source: &Checkpoint,
    ck: &ZeroCheckpoint,
    dir: &Path,
    latest: Option<&Path>,
    world: u64,
    opts: &WriteOptions<'_>,
) -> Result<Outcome> {
    for p in std::iter::once(dir).chain(latest) {
        if p.exists() {
            return Err(Error::OutputExists { path: p.to_path_buf(), appeared: false });
        }
    }
    let r0_path = ck.files.first().map(|s| s.path.clone()).ok_or_else(|| Error::MissingRankFile {
        path: source.root.join(&ck.tag),
        rank: 0,
        world: ck.world,
    })?;
    let r0 = torch::read_with_classes(&r0_path, OPTIM_CLASSES)?;
    let zero = dir.join("zero");
    let mut plan = Plan::default();
    plan_model_states(ck, dir, &mut plan);
    let bytes = plan_param_states(ck, &r0, &r0_path, &zero, &mut plan)?;
    plan_optimizer_state(ck, &r0, &r0_path, &zero, &mut plan)?;
    if let Some(latest) = latest {
        let tag = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        plan.trailers.push((latest.to_path_buf(), tag.into_bytes()));
    }
    crate::write::execute::execute(&plan, source, opts)?;
    let mut files: Vec<PathBuf> = plan.targets.iter().map(|t| t.path.clone()).collect();
    files.extend(latest.map(Path::to_path_buf));
    Ok(Outcome { files, tensors: ck.params.len(), bytes, world_size: Some(world), ..Outcome::default() })
}

/// The model states, copied byte for byte.
fn plan_model_states(ck: &ZeroCheckpoint, dir: &Path, plan: &mut Plan) {
    for (i, s) in ck.files.iter().enumerate() {
        let Some(name) = s.path.file_name().filter(|n| n.to_string_lossy().ends_with("_model_states.pt")) else {
            continue;
        };
        let copies = vec![RangeCopy { src: i, src_off: 0, dst_off: 0, len: s.len }];
        let mut target = TargetFile::new(dir.join(name), Vec::new(), s.len);
        target.copies = copies;
        plan.targets.push(target);
    }
}

/// Each parameter's folder under `zero/`: its fp32 weights and Adam moments (with its group's
/// step at stage 1/2), read from the ranks' pieces. Returns the bytes of state moved.
fn plan_param_states(ck: &ZeroCheckpoint, r0: &TorchFile, r0_path: &Path, zero: &Path, plan: &mut Plan) -> Result<u64> {
    let mut bytes = 0u64;
    for p in &ck.params {
        if !crate::read::io::is_plain_file_name(&p.name) {
            return Err(Error::BadZeroCheckpoint {
                path: r0_path.to_path_buf(),
                rank: 0,
                tensor: p.name.clone(),
                reason: "parameter name cannot be a folder name".into(),
            });
        }
        let pdir = zero.join(&p.name);
        let count = numel(&p.shape).unwrap_or(u64::MAX);
        let want = count.checked_mul(4);
        for (key, chunks) in [("fp32", &p.fp32), ("exp_avg", &p.exp_avg), ("exp_avg_sq", &p.exp_avg_sq)] {
            let have: u64 = chunks.iter().map(|c| c.len).sum();
            if Some(have) != want {
                return Err(Error::BadZeroCheckpoint {
                    path: r0_path.to_path_buf(),
                    rank: 0,
                    tensor: p.name.clone(),
                    reason: format!("{key}: {have} bytes for {count} fp32 elements"),
                });
            }
            let path = pdir.join(format!("{key}.pt"));
            let prefix = writer::archive_name(&path);
            let layout = if ck.stage <= 2 {
                let entries = vec![
                    ("param".to_string(), WValue::Tensor(f32_tensor(p.shape.clone()))),
                    ("cat_dim".to_string(), WValue::Leaf(Leaf::Int(0))),
                ];
                writer::layout(&prefix, &entries, &[f32_storage(count)], &path)?
            } else {
                writer::layout_tensor(&prefix, &f32_tensor(vec![count]), f32_storage(count), &path)?
            };
            bytes += have;
            TorchTarget { path, layout, sources: vec![chunks.clone()] }.push(plan);
        }
        if ck.stage <= 2 {
            let step = scalar(r0, &step_key(ck.stage, p.group))?;
            let path = pdir.join("step.pt");
            let layout =
                writer::layout_tensor(&writer::archive_name(&path), &f32_tensor(Vec::new()), f32_storage(1), &path)?;
            TorchTarget { path, layout, sources: vec![vec![step]] }.push(plan);
        }
    }
    Ok(bytes)
}

/// The key of the `step` of group `g` in rank 0's optim file (stage 3 keeps one for all).
fn step_key(stage: u8, g: usize) -> String {
    if stage <= 2 {
        format!("optimizer_state_dict.base_optimizer_state.state.{g}.step")
    } else {
        "optimizer_state_dict.optimizer_state_dict.state.0.step".to_string()
    }
}

/// `zero/optimizer_state.pt`: the global optimizer state (loss scaling, param groups, and at
/// stage 3 the step), from rank 0's optim file.
fn plan_optimizer_state(
    ck: &ZeroCheckpoint,
    r0: &TorchFile,
    r0_path: &Path,
    zero: &Path,
    plan: &mut Plan,
) -> Result<()> {
    let need = |key: &str| -> Result<WNode> {
        leaf(r0, key).map(|l| node_of(l, "")).ok_or_else(|| Error::BadZeroCheckpoint {
            path: r0_path.to_path_buf(),
            rank: 0,
            tensor: key.to_string(),
            reason: "missing".into(),
        })
    };
    let mut entries: Vec<(String, WValue)> = Vec::new();
    let mut sources = Vec::new();
    let mut storages = Vec::new();
    if ck.stage <= 2 {
        for k in ["loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "zero_stage", "ds_version"] {
            entries.push((k.into(), WValue::Node(need(&format!("optimizer_state_dict.{k}"))?)));
        }
        entries.push((
            "param_groups".into(),
            WValue::Node(need("optimizer_state_dict.base_optimizer_state.param_groups")?),
        ));
    } else {
        for k in ["zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow"] {
            entries.push((k.into(), WValue::Node(need(&format!("optimizer_state_dict.{k}"))?)));
        }
        let groups = need("optimizer_state_dict.optimizer_state_dict.param_groups")?;
        sources.push(vec![scalar(r0, &step_key(ck.stage, 0))?]);
        storages.push(f32_storage(1));
        let s = |x: &str| WNode::Leaf(Leaf::Str(x.into()));
        let state = WNode::Dict(vec![(
            WNode::Leaf(Leaf::Int(0)),
            WNode::Dict(vec![(s("step"), WNode::Tensor(f32_tensor(Vec::new())))]),
        )]);
        entries.push((
            "optimizer_state_dict".into(),
            WValue::Node(WNode::Dict(vec![(s("state"), state), (s("param_groups"), groups.clone())])),
        ));
        entries.push(("param_groups".into(), WValue::Node(groups)));
    }
    let path = zero.join("optimizer_state.pt");
    let layout = writer::layout(&writer::archive_name(&path), &entries, &storages, &path)?;
    TorchTarget { path, layout, sources }.push(plan);
    Ok(())
}
