//! Reading a ZeRO checkpoint folder into named byte ranges (see the module docs for the layout).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fsdp_state::{Layout, TensorSpec, Zero12, Zero3};

use crate::error::{Error, IoContext, Result};
use crate::formats::torch::flatten::Leaf;
use crate::formats::torch::pickle::{Budget, Limits};
use crate::formats::torch::{self, TorchFile, TorchTensor};
use crate::read::catalog::{Chunk, SourceFile, TensorBox, TensorData};
use crate::read::dtype::Dtype;
use crate::read::shape::numel;
use std::rc::Rc;

/// The DeepSpeed classes an optim-states file may name (see the module docs for what each is).
pub(super) const OPTIM_CLASSES: &[&str] = &[
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
];
/// The largest world size we accept: far beyond any real run, small enough that a hostile
/// `partition_count` cannot make us allocate per-rank tables of absurd size.
const MAX_WORLD: u64 = 1 << 16;

/// A tensor of the checkpoint: where its bytes are in the rank files.
#[derive(Clone, Debug)]
pub(crate) struct ZeroTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Ranges of [`ZeroCheckpoint::files`] in order (stage-3 fragments), or the view a buffer
    /// or a frozen param was saved as, strides kept: a broadcast view of a few bytes must stay
    /// one box, for the catalog's broadcast rule, not become one range per element.
    pub data: TensorData,
}

/// A trainable parameter: fp32 master weights and Adam moments, each as ranges of the rank
/// optim files.
#[derive(Clone, Debug)]
pub(crate) struct ZeroParam {
    pub name: String,
    pub shape: Vec<u64>,
    /// Optimizer param group.
    pub group: usize,
    pub fp32: Vec<Chunk>,
    pub exp_avg: Vec<Chunk>,
    pub exp_avg_sq: Vec<Chunk>,
}

/// A ZeRO checkpoint (one tag), read and validated: every range lies in its storage record, the
/// partitions add up to the params of `param_shapes`, and every rank is present.
#[derive(Clone, Debug)]
pub(crate) struct ZeroCheckpoint {
    pub(crate) tag: String,
    pub(crate) stage: u8,
    pub(crate) world: u64,
    /// Every rank file read (model and optim states); chunks index into it.
    pub(crate) files: Vec<SourceFile>,
    /// Persistent buffers in `module` order, in their saved dtype.
    pub(crate) buffers: Vec<ZeroTensor>,
    /// Frozen params in `frozen_param_shapes` order, in the training dtype (none at stage 1).
    pub(crate) frozen: Vec<ZeroTensor>,
    pub(crate) params: Vec<ZeroParam>,
    /// `(alias, stored name)` from rank 0's `shared_params`.
    pub(crate) aliases: Vec<(String, String)>,
}

/// True when `dir` looks like a DeepSpeed checkpoint: a `latest` file beside a tag folder, or a
/// tag folder itself holding `*_optim_states.pt`.
pub(crate) fn is_zero_checkpoint(dir: &Path) -> bool {
    if !dir.is_dir() {
        return false;
    }
    // Any `latest`, not only a regular file: one planted as a FIFO must be refused by name
    // when it is read, not make the folder unrecognisable.
    if dir.join("latest").exists() {
        return true;
    }
    std::fs::read_dir(dir)
        .map(|it| it.flatten().any(|e| e.file_name().to_string_lossy().ends_with("_optim_states.pt")))
        .unwrap_or(false)
}

fn bad(path: &Path, rank: u64, tensor: &str, reason: impl Into<String>) -> Error {
    Error::BadZeroCheckpoint { path: path.to_path_buf(), rank, tensor: tensor.to_string(), reason: reason.into() }
}

/// One rank file, read through the restricted unpickler, with lookups by dotted name.
struct RankFile {
    rank: u64,
    index: usize,
    f: TorchFile,
    tensors: HashMap<String, usize>,
    leaves: HashMap<String, usize>,
}

impl RankFile {
    fn read(
        path: &Path,
        rank: u64,
        index: usize,
        classes: &'static [&'static str],
        budget: &Rc<Budget>,
    ) -> Result<RankFile> {
        let f = torch::read_with_classes_sharing(path, classes, budget)?;
        let tensors = f.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let leaves = f.leaves.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        Ok(RankFile { rank, index, f, tensors, leaves })
    }
    fn err(&self, key: &str, reason: impl Into<String>) -> Error {
        bad(&self.f.path, self.rank, key, reason)
    }
    fn leaf(&self, key: &str) -> Option<&Leaf> {
        self.leaves.get(key).and_then(|&i| self.f.leaves.get(i)).map(|(_, l)| l)
    }
    fn need_leaf(&self, key: &str) -> Result<&Leaf> {
        self.leaf(key).ok_or_else(|| self.err(key, "missing"))
    }
    /// A dict without tensors: the walk keeps an empty one (or `None`) as one leaf, and spreads
    /// a filled one over dotted leaves `key.<name>`, in pickle order. `None` when absent or
    /// `None`; names may contain dots, which is why the prefix is stripped and not split.
    fn dict(&self, key: &str) -> Option<Vec<(String, Leaf)>> {
        match self.leaf(key) {
            Some(Leaf::Dict(d)) => return Some(d.clone()),
            Some(_) => return None,
            None => {}
        }
        let prefix = format!("{key}.");
        let items: Vec<(String, Leaf)> = self
            .f
            .leaves
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|n| (n.to_string(), v.clone())))
            .collect();
        (!items.is_empty()).then_some(items)
    }
    fn tensor(&self, key: &str) -> Option<&TorchTensor> {
        self.tensors.get(key).and_then(|&i| self.f.tensors.get(i))
    }
    fn need_tensor(&self, key: &str) -> Result<&TorchTensor> {
        self.tensor(key).ok_or_else(|| self.err(key, "tensor is missing"))
    }
    /// Ranges of a tensor of any layout, in row-major order: one per run, so only for layouts
    /// checked to have few (a flat vector).
    fn chunks(&self, t: &TorchTensor) -> Vec<Chunk> {
        let base = self.f.storages.get(t.storage).map_or(0, |s| s.file_offset);
        let mut out: Vec<Chunk> = Vec::new();
        for (off, len) in t.runs() {
            match out.last_mut() {
                Some(c) if c.offset + c.len == base + off => c.len += len,
                _ => out.push(Chunk { file: self.index, offset: base + off, len }),
            }
        }
        out
    }
    /// A tensor of any layout as the view it is on its storage, like a torch file's tensors.
    fn view(&self, t: &TorchTensor) -> TensorData {
        let (base, len) = self.f.storages.get(t.storage).map_or((0, 0), |s| (s.file_offset, s.byte_len));
        TensorData::Boxes(vec![TensorBox::whole(&t.shape, self.index, base, len, t.offset, t.strides.clone())])
    }
    /// A 1-D contiguous fp32 vector: its start in the file and its element count.
    fn flat_f32(&self, key: &str) -> Result<(u64, u64)> {
        let t = self.need_tensor(key)?;
        if t.dtype != Dtype::F32 {
            return Err(Error::ZeroDtype {
                path: self.f.path.clone(),
                rank: self.rank,
                tensor: key.to_string(),
                found: t.dtype,
                expected: Dtype::F32,
            });
        }
        if t.shape.len() != 1 || (t.shape[0] > 1 && t.strides.first() != Some(&1)) {
            return Err(self.err(key, format!("shape {:?} strides {:?}: expected a flat vector", t.shape, t.strides)));
        }
        let base = self.f.storages.get(t.storage).map_or(0, |s| s.file_offset);
        Ok((base + t.offset * 4, t.shape[0]))
    }
}

fn leaf_int(l: &Leaf) -> Option<i64> {
    match l {
        Leaf::Int(i) => Some(*i),
        _ => None,
    }
}

fn leaf_u64(l: &Leaf) -> Option<u64> {
    leaf_int(l).and_then(|i| u64::try_from(i).ok())
}

fn leaf_list(l: &Leaf) -> Option<&[Leaf]> {
    match l {
        Leaf::List(v) => Some(v),
        _ => None,
    }
}

fn leaf_dict(l: &Leaf) -> Option<&[(String, Leaf)]> {
    match l {
        Leaf::Dict(v) => Some(v),
        // An empty dict is flattened as a leaf dict too; `None` stands for a missing mapping.
        _ => None,
    }
}

fn leaf_get<'a>(l: &'a Leaf, key: &str) -> Option<&'a Leaf> {
    leaf_dict(l)?.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// `ZeroStageEnum(n)`, as the unpickler keeps it: `{__class__, args: [n]}`.
fn zero_stage(l: &Leaf) -> Option<u8> {
    let class = leaf_get(l, "__class__")?;
    if *class != Leaf::Str(OPTIM_CLASSES[0].into()) {
        return None;
    }
    match leaf_list(leaf_get(l, "args")?)? {
        [n] => leaf_int(n).and_then(|n| u8::try_from(n).ok()).filter(|n| (1..=3).contains(n)),
        _ => None,
    }
}

/// `{name: Size}` mappings, as (name, shape) in order.
fn shapes(l: &Leaf) -> Option<Vec<(String, Vec<u64>)>> {
    leaf_dict(l)?
        .iter()
        .map(|(k, v)| Some((k.clone(), leaf_list(v)?.iter().map(leaf_u64).collect::<Option<Vec<u64>>>()?)))
        .collect()
}

/// Finds the rank files of a tag folder: `(rank, path)` sorted by rank, for names
/// `{prefix}zero_pp_rank_{r}_mp_rank_{mp}_{suffix}`.
fn rank_files(dir: &Path, suffix: &str) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(suffix) else { continue };
        let Some(at) = stem.find("zero_pp_rank_") else { continue };
        let rest = &stem[at + "zero_pp_rank_".len()..];
        let Some((r, mp)) = rest.split_once("_mp_rank_") else { continue };
        let Ok(r) = r.parse::<u64>() else { continue };
        if mp != "00" {
            return Err(bad(
                &e.path(),
                r,
                "mp_rank",
                format!("model-parallel rank `{mp}`: only checkpoints without tensor/pipeline parallelism (mp_rank_00) are supported"),
            ));
        }
        out.push((r, e.path()));
    }
    out.sort();
    Ok(out)
}

impl ZeroCheckpoint {
    /// Opens the checkpoint in `dir` at `tag` (default: the content of `dir/latest`). `dir` may
    /// also be the tag folder itself.
    pub(crate) fn open(dir: &Path, tag: Option<&str>) -> Result<ZeroCheckpoint> {
        let (tag_dir, tag) = match tag {
            Some(t) => (dir.join(t), t.to_string()),
            None if dir.join("latest").exists() => {
                let latest = dir.join("latest");
                // `latest` holds a tag name; anything longer than a path is not one.
                let text = String::from_utf8_lossy(&crate::read::io::read_capped(&latest, 4096)?).into_owned();
                let t = text.trim().to_string();
                if !crate::read::io::is_plain_file_name(&t) {
                    return Err(bad(&latest, 0, "latest", format!("`{t}` is not a tag folder name")));
                }
                (dir.join(&t), t)
            }
            None => (dir.to_path_buf(), dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()),
        };
        if !tag_dir.is_dir() {
            return Err(Error::Io {
                path: tag_dir,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "tag folder does not exist"),
            });
        }
        read_tag(tag_dir, tag)
    }
}

/// Reads a tag folder: the optimizer rank files (which say the stage and the world size), the
/// model states, the layout they give, and each parameter's pieces placed.
fn read_tag(tag_dir: PathBuf, tag: String) -> Result<ZeroCheckpoint> {
    // All rank files' values are kept together, under one pickle budget.
    let budget = Budget::shared(Limits::default());
    let (files, stage, world) = read_optim_files(&tag_dir, &budget)?;
    let models = read_model_files(&tag_dir, stage, world, files.len(), &budget)?;
    let m0 = &models[0];
    let buffers = buffers(m0)?;
    let param_shapes: Vec<Vec<(String, Vec<u64>)>> = match m0.need_leaf("param_shapes")? {
        Leaf::List(groups) => groups
            .iter()
            .map(|g| shapes(g).ok_or_else(|| m0.err("param_shapes", "expected a list of `{name: Size}` dicts")))
            .collect::<Result<_>>()?,
        _ => return Err(m0.err("param_shapes", "expected a list of `{name: Size}` dicts")),
    };
    let frozen_shapes = match m0.dict("frozen_param_shapes") {
        None => None,
        Some(d) => Some(
            shapes(&Leaf::Dict(d)).ok_or_else(|| m0.err("frozen_param_shapes", "expected a `{name: Size}` dict"))?,
        ),
    };
    let aliases = aliases(m0)?;
    let (mut params, tensors) = new_params(&param_shapes);
    let frozen: Vec<ZeroTensor> = if stage <= 2 {
        place_zero12(&files, &param_shapes, tensors, world, &mut params)?;
        match &frozen_shapes {
            None => Vec::new(),
            Some(fs) => frozen_zero12(m0, fs)?,
        }
    } else {
        place_zero3(&files, tensors, world, &mut params)?;
        match &frozen_shapes {
            None => Vec::new(),
            Some(fs) => frozen_zero3(&models, fs, world)?,
        }
    };

    // Aliases that name nothing are dropped, like zero_to_fp32 (`if pair[1] in state_dict`).
    let known = |n: &str| {
        params.iter().any(|p| p.name == n) || frozen.iter().any(|t| t.name == n) || buffers.iter().any(|t| t.name == n)
    };
    let aliases: Vec<(String, String)> = aliases.into_iter().filter(|(_, to)| known(to)).collect();

    let mut sources = Vec::with_capacity(files.len() + models.len());
    for f in files.iter().chain(&models) {
        sources.push(SourceFile {
            rank: Some(f.rank),
            checks: f.f.checks(),
            ..SourceFile::new(f.f.path.clone(), f.f.len)
        });
    }
    Ok(ZeroCheckpoint { tag, stage, world, files: sources, buffers, frozen, params, aliases })
}

/// The optimizer rank files, one per rank of the world, in rank order, with the stage and the
/// world size. Rank 0 says the stage and the world size; every rank file must agree.
fn read_optim_files(tag_dir: &Path, budget: &Rc<Budget>) -> Result<(Vec<RankFile>, u8, u64)> {
    let optim = rank_files(tag_dir, "_optim_states.pt")?;
    let Some((first_rank, first_path)) = optim.first().cloned() else {
        return Err(bad(tag_dir, 0, "optim_states", "no `*_optim_states.pt` file in the tag folder"));
    };
    let mut files: Vec<RankFile> = Vec::new();
    let r0 = RankFile::read(&first_path, first_rank, 0, OPTIM_CLASSES, budget)?;
    if first_rank != 0 {
        let missing = tag_dir.join(file_name(&first_path).replacen(&format!("rank_{first_rank}_"), "rank_0_", 1));
        return Err(Error::MissingRankFile { path: missing, rank: 0, world: optim.len() as u64 });
    }
    let stage_key = "optimizer_state_dict.zero_stage";
    let stage = zero_stage(r0.need_leaf(stage_key)?)
        .ok_or_else(|| r0.err(stage_key, "expected a `ZeroStageEnum` of 1, 2 or 3"))?;
    let world = partition_count(&r0)?;
    files.push(r0);
    for r in 0..world {
        let Some((_, path)) = optim.iter().find(|(rr, _)| *rr == r) else {
            let missing = tag_dir.join(file_name(&first_path).replacen("rank_0_", &format!("rank_{r}_"), 1));
            return Err(Error::MissingRankFile { path: missing, rank: r, world });
        };
        if r > 0 {
            let f = RankFile::read(path, r, files.len(), OPTIM_CLASSES, budget)?;
            if partition_count(&f)? != world {
                return Err(f.err(
                    "optimizer_state_dict.partition_count",
                    format!("says {}, rank 0 says {world}", partition_count(&f)?),
                ));
            }
            let s = f.leaf(stage_key).and_then(zero_stage);
            if s != Some(stage) {
                return Err(f.err(stage_key, format!("stage {s:?} differs from rank 0's {stage}")));
            }
            files.push(f);
        }
    }
    if let Some((r, path)) = optim.iter().find(|(r, _)| *r >= world) {
        return Err(bad(
            path,
            *r,
            "optimizer_state_dict.partition_count",
            format!("rank file beyond the world size {world} given by `partition_count` (a leftover of another run?)"),
        ));
    }
    Ok((files, stage, world))
}

/// Model states: one file at stage 1/2, one per rank at stage 3, numbered as sources after the
/// `first` optimizer files.
fn read_model_files(tag_dir: &Path, stage: u8, world: u64, first: usize, budget: &Rc<Budget>) -> Result<Vec<RankFile>> {
    let mut models: Vec<RankFile> = Vec::new();
    if stage <= 2 {
        let path = tag_dir.join("mp_rank_00_model_states.pt");
        if !path.is_file() {
            return Err(Error::MissingRankFile { path, rank: 0, world });
        }
        models.push(RankFile::read(&path, 0, first, &[], budget)?);
    } else {
        let found = rank_files(tag_dir, "_model_states.pt")?;
        for r in 0..world {
            let path = match found.iter().find(|(rr, _)| *rr == r) {
                Some((_, p)) => p.clone(),
                None => {
                    let path = tag_dir.join(format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt"));
                    return Err(Error::MissingRankFile { path, rank: r, world });
                }
            };
            models.push(RankFile::read(&path, r, first + models.len(), &[], budget)?);
        }
    }
    Ok(models)
}

/// The buffers `buffer_names` lists, in `module` order, like zero_to_fp32's dict comprehension
/// over `module`.
fn buffers(m0: &RankFile) -> Result<Vec<ZeroTensor>> {
    let buffer_names: Vec<String> = match m0.need_leaf("buffer_names")? {
        Leaf::List(l) => l
            .iter()
            .map(|x| match x {
                Leaf::Str(s) => Ok(s.clone()),
                _ => Err(m0.err("buffer_names", "expected a list of names")),
            })
            .collect::<Result<_>>()?,
        _ => return Err(m0.err("buffer_names", "expected a list of names")),
    };
    let mut buffers = Vec::new();
    for t in &m0.f.tensors {
        let Some(name) = t.name.strip_prefix("module.") else { continue };
        if buffer_names.iter().any(|b| b == name) {
            buffers.push(ZeroTensor {
                name: name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: m0.view(t),
            });
        }
    }
    Ok(buffers)
}

/// `shared_params`: each alias and the parameter it names.
fn aliases(m0: &RankFile) -> Result<Vec<(String, String)>> {
    m0.dict("shared_params")
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| match v {
            Leaf::Str(s) => Ok((k, s)),
            _ => Err(m0.err("shared_params", format!("alias `{k}` does not name a parameter"))),
        })
        .collect()
}

/// The parameters `param_shapes` lists, by group, with no pieces placed yet, and their specs.
fn new_params(param_shapes: &[Vec<(String, Vec<u64>)>]) -> (Vec<ZeroParam>, Vec<TensorSpec>) {
    let specs: Vec<(usize, TensorSpec)> = param_shapes
        .iter()
        .enumerate()
        .flat_map(|(g, ps)| ps.iter().map(move |(n, s)| (g, TensorSpec::new(n.clone(), s.clone()))))
        .collect();
    let params: Vec<ZeroParam> = specs
        .iter()
        .map(|(g, s)| ZeroParam {
            name: s.name.clone(),
            shape: s.shape.clone(),
            group: *g,
            fp32: Vec::new(),
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
        })
        .collect();
    let tensors: Vec<TensorSpec> = specs.into_iter().map(|(_, s)| s).collect();
    (params, tensors)
}

/// Frozen parameters at stage 1/2: whole, in the model states' `frozen_param_fragments`.
fn frozen_zero12(m0: &RankFile, shapes: &[(String, Vec<u64>)]) -> Result<Vec<ZeroTensor>> {
    shapes
        .iter()
        .map(|(name, shape)| {
            let key = format!("frozen_param_fragments.{name}");
            let t = m0.need_tensor(&key)?;
            let n = numel(shape).ok_or_else(|| m0.err(&key, "shape overflows"))?;
            if numel(&t.shape) != Some(n) {
                return Err(m0.err(&key, format!("holds shape {:?}, `frozen_param_shapes` says {shape:?}", t.shape)));
            }
            Ok(ZeroTensor { name: name.clone(), dtype: t.dtype, shape: shape.clone(), data: m0.view(t) })
        })
        .collect()
}

fn file_name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// `partition_count`: an int (stage 3) or one int per group (stage 1/2), the world size. With
/// expert parallelism groups may differ; zero_to_fp32 takes the largest, and so do we.
fn partition_count(f: &RankFile) -> Result<u64> {
    let key = "optimizer_state_dict.partition_count";
    let l = f.need_leaf(key)?;
    let n = match l {
        Leaf::Int(_) => leaf_u64(l),
        Leaf::List(v) => v.iter().map(leaf_u64).collect::<Option<Vec<u64>>>().and_then(|v| v.into_iter().max()),
        _ => None,
    };
    n.filter(|&n| (1..=MAX_WORLD).contains(&n))
        .ok_or_else(|| f.err(key, format!("expected a world size between 1 and {MAX_WORLD}")))
}

/// Places every stage 1/2 param in the rank partitions, checking each partition's size against
/// the layout DeepSpeed would have made.
fn place_zero12(
    files: &[RankFile],
    param_shapes: &[Vec<(String, Vec<u64>)>],
    tensors: Vec<TensorSpec>,
    world: u64,
    params: &mut [ZeroParam],
) -> Result<()> {
    let mut groups = Vec::with_capacity(param_shapes.len());
    let mut at = 0;
    for g in param_shapes {
        groups.push((at..at + g.len()).collect::<Vec<usize>>());
        at += g.len();
    }
    let r0 = &files[0];
    let pad_key = "optimizer_state_dict.param_alignment_paddings";
    let paddings: Option<Vec<Vec<u64>>> = match r0.leaf(pad_key) {
        None | Some(Leaf::None) => None,
        Some(Leaf::List(gs)) => Some(
            gs.iter()
                .map(|g| leaf_list(g).and_then(|l| l.iter().map(leaf_u64).collect::<Option<Vec<u64>>>()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| r0.err(pad_key, "expected a list of integer lists"))?,
        ),
        Some(_) => return Err(r0.err(pad_key, "expected a list of integer lists")),
    };
    let layout = Zero12::new(tensors, groups, paddings, world).map_err(|e| r0.err("param_shapes", e.to_string()))?;
    for f in files {
        let r = f.rank;
        let fp32_groups = (0..)
            .take_while(|g| f.tensor(&format!("optimizer_state_dict.single_partition_of_fp32_groups.{g}")).is_some())
            .count();
        if fp32_groups != param_shapes.len() {
            return Err(f.err(
                "optimizer_state_dict.single_partition_of_fp32_groups",
                format!("{fp32_groups} partitions for {} param groups in `param_shapes`", param_shapes.len()),
            ));
        }
        let mut starts = Vec::with_capacity(param_shapes.len());
        for g in 0..param_shapes.len() {
            let key = format!("optimizer_state_dict.single_partition_of_fp32_groups.{g}");
            let (start, n) = f.flat_f32(&key)?;
            let expected = layout.saved_len(g, r).unwrap_or(0);
            if n != expected {
                return Err(f.err(
                    &key,
                    format!(
                        "holds {n} elements, but `param_shapes` group {g} on {world} ranks gives rank {r} {expected} (partition {} minus trailing padding)",
                        layout.partition_len(g).unwrap_or(0)
                    ),
                ));
            }
            let mut moments = Vec::with_capacity(2);
            for m in ["exp_avg", "exp_avg_sq"] {
                let key = format!("optimizer_state_dict.base_optimizer_state.state.{g}.{m}");
                let (s, len) = f.flat_f32(&key)?;
                // Saved untrimmed (the padded partition); a trimmed one would do as well.
                let part = layout.partition_len(g).unwrap_or(0);
                if len != part && len != expected {
                    return Err(f.err(&key, format!("holds {len} elements, expected the partition's {part}")));
                }
                moments.push(s);
            }
            starts.push((start, moments[0], moments[1]));
        }
        for p in layout.pieces(r) {
            let (fp32, avg, sq) = starts[p.slot];
            let param = &mut params[p.tensor];
            let len = p.len() * 4;
            let at = p.local * 4;
            param.fp32.push(Chunk { file: f.index, offset: fp32 + at, len });
            param.exp_avg.push(Chunk { file: f.index, offset: avg + at, len });
            param.exp_avg_sq.push(Chunk { file: f.index, offset: sq + at, len });
        }
    }
    Ok(())
}

/// One rank's stage-3 buffer: its sub-group tensors, concatenated.
struct Segments(Vec<(u64, u64, u64)>);

impl Segments {
    /// Ranges covering `n` elements from element `local` of the concatenation.
    fn chunks(&self, file: usize, local: u64, n: u64, out: &mut Vec<Chunk>) {
        let mut at = local;
        let end = local + n;
        for &(lo, len, byte_start) in &self.0 {
            if at >= end {
                break;
            }
            if at < lo || at >= lo + len {
                continue;
            }
            let take = (lo + len).min(end) - at;
            out.push(Chunk { file, offset: byte_start + (at - lo) * 4, len: take * 4 });
            at += take;
        }
    }
}

fn place_zero3(files: &[RankFile], tensors: Vec<TensorSpec>, world: u64, params: &mut [ZeroParam]) -> Result<()> {
    let layout = Zero3::new(tensors, world).map_err(|e| files[0].err("param_shapes", e.to_string()))?;
    for f in files {
        let count =
            (0..).take_while(|i| f.tensor(&format!("optimizer_state_dict.fp32_flat_groups.{i}")).is_some()).count();
        let mut segs = [Segments(Vec::new()), Segments(Vec::new()), Segments(Vec::new())];
        let mut total = 0u64;
        for i in 0..count {
            let key = format!("optimizer_state_dict.fp32_flat_groups.{i}");
            let (start, n) = f.flat_f32(&key)?;
            segs[0].0.push((total, n, start));
            for (j, m) in ["exp_avg", "exp_avg_sq"].iter().enumerate() {
                let key = format!("optimizer_state_dict.optimizer_state_dict.state.{i}.{m}");
                let (s, len) = f.flat_f32(&key)?;
                if len != n {
                    return Err(f.err(&key, format!("holds {len} elements, its sub-group `fp32_flat_groups.{i}` {n}")));
                }
                segs[j + 1].0.push((total, n, s));
            }
            total += n;
        }
        if total != layout.rank_len() {
            return Err(f.err(
                "optimizer_state_dict.fp32_flat_groups",
                format!(
                    "sub-groups hold {total} elements in all, but `param_shapes` on {world} ranks gives each rank {} (ceil(numel / {world}) per param)",
                    layout.rank_len()
                ),
            ));
        }
        for p in layout.pieces(f.rank) {
            let param = &mut params[p.tensor];
            segs[0].chunks(f.index, p.local, p.len(), &mut param.fp32);
            segs[1].chunks(f.index, p.local, p.len(), &mut param.exp_avg);
            segs[2].chunks(f.index, p.local, p.len(), &mut param.exp_avg_sq);
        }
    }
    Ok(())
}

/// Stage-3 frozen params: each rank's `ceil(n / world)` fragment, concatenated and cut to `n`.
fn frozen_zero3(models: &[RankFile], shapes: &[(String, Vec<u64>)], world: u64) -> Result<Vec<ZeroTensor>> {
    let mut out = Vec::with_capacity(shapes.len());
    for (name, shape) in shapes {
        let key = format!("frozen_param_fragments.{name}");
        let n = numel(shape).ok_or_else(|| models[0].err(&key, "shape overflows"))?;
        let part = n.div_ceil(world);
        let mut chunks = Vec::new();
        let mut dtype = None;
        for m in models {
            let t = m.need_tensor(&key)?;
            if numel(&t.shape) != Some(part) {
                return Err(m.err(&key, format!("holds {:?}, expected {part} elements (ceil({n} / {world}))", t.shape)));
            }
            if *dtype.get_or_insert(t.dtype) != t.dtype {
                return Err(m.err(&key, format!("dtype `{}` differs from rank 0's", t.dtype)));
            }
            // DeepSpeed saves each fragment as a slice of a flat partition: any other layout (a
            // broadcast view above all) is not one it wrote.
            if t.shape.len() != 1 || (t.shape[0] > 1 && t.strides.first() != Some(&1)) {
                return Err(m.err(&key, format!("shape {:?} strides {:?}: expected a flat vector", t.shape, t.strides)));
            }
            let keep = n.saturating_sub(m.rank * part).min(part) * (t.dtype.bits() / 8);
            let mut left = keep;
            for c in m.chunks(t) {
                if left == 0 {
                    break;
                }
                let len = c.len.min(left);
                chunks.push(Chunk { len, ..c });
                left -= len;
            }
        }
        let data = TensorData::Ranges(chunks);
        out.push(ZeroTensor { name: name.clone(), dtype: dtype.unwrap_or(Dtype::F32), shape: shape.clone(), data });
    }
    Ok(out)
}
