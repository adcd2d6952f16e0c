//! A legacy save (`--ckpt-format torch`): one `torch.save` per model-parallel rank, stitched
//! into the one-rank model.
//!
//! `iter_N/mp_rank_TT/model_optim_rng.pt` (`_PPP` appended with pipeline parallelism, `_EEE`
//! with expert parallelism; [`super::rank_folders`] says which is which) holds
//! `{args, iteration, checkpoint_version, model, optimizer, rng_state, ...}`; `model` is the
//! rank's local module state under module names, with layer numbers counted within its
//! pipeline stage. With virtual pipeline stages the rank holds one model chunk per virtual
//! stage, `model0`, `model1`, ..., each numbering its layers from 0; where a chunk's layers sit
//! is megatron's rule, not the file's ([`super::stages`]). Nothing records how a tensor was
//! split; megatron's parallel layers decide:
//! the column-parallel linears (`linear_qkv`, `linear_fc1`, the word embeddings and the output
//! layer) cut their weight and bias on dim 0, the row-parallel ones (`linear_proj`,
//! `linear_fc2`) their weight on dim 1 and keep the bias whole, everything else is whole on
//! every rank. A SwiGLU `linear_fc1` rank holds `[W_r; V_r]`, so the one-rank `[W; V]` takes
//! each half of each rank to its own place. Grouped-query attention needs nothing more: each
//! rank holds whole query groups, in order, so `linear_qkv` is a plain concatenation. The last
//! stage of a tied model keeps a copy of the word embeddings as `output_layer.weight`, which
//! the one-rank tied model does not have.
//!
//! Mixture-of-experts layers: each expert rank holds its `num_experts / ep` experts under local
//! indices (SequentialMLP's `mlp.experts.local_experts.<e>.linear_fc1.weight`, TEGroupedMLP's
//! `mlp.experts.linear_fc1.weight<e>`), the one-rank model's expert `ep_rank · experts/ep + e`
//! under SequentialMLP's name; expert tensors split over tensor-parallel ranks like the dense
//! MLP's (expert tensor parallelism other than the dense one is refused). Everything else in the
//! layer (attention, norms, the router) is the same on every expert rank: expert rank 0's is
//! read. The removed GroupedMLP's `experts.weight1`/`weight2` are refused by name: megatron-core
//! 0.19.2's source no longer has their layout.
//!
//! The stitching is a model map ([`crate::map::model`]) over every rank's tensors, named
//! `mp_rank_TT[_PPP]/<name>`: each one-rank tensor is its ranks' row ranges, and every rank
//! tensor the map does not read is left out by name (the optimizer, RNG states, a tied output's
//! copy, the other ranks' copies of a whole tensor), so nothing is dropped by accident.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::info::{self, Megatron};
use super::names::{self, split_of, Split};
use super::optimizer::STATE_PREFIX;
use super::rank_folders::{rank_grid, ranks_of, Rank, Sizes};
use super::stages::Stages;
use super::Location;
use crate::error::{Error, Result};
use crate::formats::torch;
use crate::map::model::{self, ModelMap, Target};
use crate::read::catalog::{Checkpoint, Chunk, Format, Parts, Scan, SourceFile, TensorBox, TensorData, TensorInfo};
use crate::read::value::Leaf;
use crate::AllowGlobals;
use fsdp_state::Region;

/// The file of each model-parallel rank.
pub(crate) const RANK_FILE: &str = "model_optim_rng.pt";
/// The distributed optimizer's file beside it.
const DISTRIB_FILE: &str = "distrib_optim.pt";

/// True when `dir` holds megatron's per-rank folders.
pub(crate) fn is_legacy(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_str().and_then(ranks_of).is_some() && e.path().join(RANK_FILE).is_file())
    })
}

/// A rank's piece of a tensor: its tensor-parallel rank, its file's index among the ranks, and
/// the tensor in that file.
type Piece<'a> = (u64, usize, &'a TensorInfo);

/// The global index of the first layer of each (stage, model chunk).
type Offsets = BTreeMap<(u64, u64), u64>;

/// A one-rank tensor name, with the pipeline stage that holds it.
type StageName = (u64, String);

/// The optimizer states written per parameter: the fp32 main parameter and Adam's moments.
const STATES: [&str; 3] = ["param", "exp_avg", "exp_avg_sq"];

/// A legacy save's rank files as read, with what stitching their pieces needs.
#[derive(Debug)]
pub(crate) struct Ranks {
    ranks: Vec<RankFile>,
    /// The index of each rank's first file in the catalog's files.
    base_of: Vec<usize>,
    /// The index of each rank's `distrib_optim.pt` in the catalog's files.
    distrib_base: Vec<usize>,
    /// The grad buffers' bucket size on the first pipeline stage, as the saved `args` give it.
    bucket_size: std::result::Result<Option<u64>, String>,
    /// The global index of the first layer of each (stage, model chunk).
    layer_offset: Offsets,
    tp: u64,
    pp: u64,
    ep: u64,
    /// Model chunks per stage (virtual pipeline stages).
    chunks: u64,
    /// Experts each expert-parallel rank holds.
    local_experts: u64,
    swiglu: bool,
    tied: bool,
}

impl Ranks {
    /// The saved `args` (the first rank's; every rank saves the same), and the file they are in.
    pub(crate) fn args(&self) -> Option<(&Path, &Leaf)> {
        let first = self.ranks.first()?;
        first.ck.values.iter().find(|(k, _)| k == "args").map(|(_, v)| (first.ck.root.as_path(), v))
    }
}

/// One rank's file, read.
#[derive(Debug)]
struct RankFile {
    tp: u64,
    pp: u64,
    ep: u64,
    ck: Checkpoint,
    /// The distributed optimizer's `distrib_optim.pt` beside it, read.
    distrib: Option<Checkpoint>,
}

impl RankFile {
    /// The rank's model parameters, in the order its module registers them.
    fn parameters(&self) -> Vec<&TensorInfo> {
        self.ck.tensors.iter().filter(|t| t.name.starts_with("model.") && !t.name.ends_with("_extra_state")).collect()
    }

    fn bad(&self, key: Option<&str>, reason: String) -> Error {
        Error::BadMegatron { path: self.ck.root.clone(), key: key.map(str::to_string), rank: Some(self.tp), reason }
    }
}

/// The model chunk of a rank file's tensor and its name within the chunk: `model.X` is the one
/// chunk of a save without virtual stages, `model<k>.X` chunk `k` of one with them.
pub(super) fn chunk_of(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix("model")?;
    let (k, local) = rest.split_once('.')?;
    if k.is_empty() {
        return Some((0, local));
    }
    let k = k.parse().ok().filter(|_| k.bytes().all(|b| b.is_ascii_digit()))?;
    Some((k, local))
}

/// An expert's tensor within a layer: the spec's own name, read as its local index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Expert<'a> {
    /// The expert's index among its rank's experts (`u64::MAX` for the removed GroupedMLP's
    /// `weight1`/`weight2`, which hold every local expert at once).
    pub local: u64,
    /// The name within the expert's MLP (`linear_fc1.weight`).
    pub within: &'a str,
}

impl Expert<'_> {
    /// The one-rank model's name of this expert on expert rank `ep` (SequentialMLP's).
    pub(super) fn global_name(&self, ep: u64, local_experts: u64) -> String {
        let e = ep.saturating_mul(local_experts).saturating_add(self.local);
        format!("mlp.experts.local_experts.{e}.{}", self.within)
    }
}

/// The expert a layer's tensor belongs to: SequentialMLP's `mlp.experts.local_experts.<e>.X`,
/// TEGroupedMLP's `mlp.experts.linear_fc1.weight<e>`, or GroupedMLP's `mlp.experts.weight1`.
pub(super) fn expert_of(within: &str) -> Option<Expert<'_>> {
    let rest = within.strip_prefix("mlp.experts.")?;
    if let Some(r) = rest.strip_prefix("local_experts.") {
        let (e, within) = r.split_once('.')?;
        let local = e.parse().ok().filter(|_| e.bytes().all(|b| b.is_ascii_digit()))?;
        return Some(Expert { local, within });
    }
    if rest == "weight1" || rest == "weight2" {
        return Some(Expert { local: u64::MAX, within: rest });
    }
    // TEGroupedMLP: a parameter per expert, its local index at the end of the name.
    let digits = rest.len() - rest.bytes().rev().take_while(|b| b.is_ascii_digit()).count();
    let (stem, e) = rest.split_at(digits);
    let stem = stem.strip_suffix("weight").map(|_| stem).or_else(|| stem.strip_suffix("bias").map(|_| stem))?;
    if e.is_empty() || !stem.contains('.') {
        return None;
    }
    Some(Expert { local: e.parse().ok()?, within: stem })
}

/// The catalog of the legacy save at `loc`, named by `root`.
pub(super) fn catalog(root: PathBuf, loc: Location) -> Result<Scan> {
    let ranks = read_ranks(&loc.dir)?;
    let args = ranks[0].ck.values.iter().find(|(k, _)| k == "args").map(|(_, v)| v);
    let mut meta = info::from_args("legacy", args);
    // The run's ranks (data-parallel ones too), as the saved `args` give them; the files alone
    // tell only the model-parallel ranks.
    let world = info::uint(args.and_then(|a| info::lookup(a, &["world_size"])));
    let iteration = info::uint(ranks[0].ck.values.iter().find(|(k, _)| k == "iteration").map(|(_, v)| v));
    let iteration = iteration.or(loc.iteration);
    let swiglu = meta.swiglu.unwrap_or(false);
    let tied = meta.tied_embeddings.unwrap_or(true);
    let tp = ranks.iter().map(|r| r.tp).max().unwrap_or(0) + 1;
    let pp = ranks.iter().map(|r| r.pp).max().unwrap_or(0) + 1;
    let ep = ranks.iter().map(|r| r.ep).max().unwrap_or(0) + 1;
    let bad = |reason: String| Error::BadMegatron { path: loc.dir.clone(), key: None, rank: None, reason };
    let stages = Stages::from_args(args).map_err(bad)?;
    let chunks = stages.as_ref().map_or(1, Stages::chunks);
    let local_experts = experts_per_rank(args, tp, ep).map_err(bad)?;

    // Every file's tensors become boxes of the one catalog: their file indices shift.
    let mut files: Vec<SourceFile> = Vec::new();
    let (mut base_of, mut distrib_base) = (Vec::with_capacity(ranks.len()), Vec::with_capacity(ranks.len()));
    for r in &ranks {
        base_of.push(files.len());
        files.extend(r.ck.files.iter().cloned());
        distrib_base.push(files.len());
        files.extend(r.distrib.iter().flat_map(|d| d.files.iter().cloned()));
    }
    let bucket_size = bucket_size(args);
    check_chunks_and_experts(&ranks, chunks, local_experts)?;
    let (layer_offset, total_layers) = stage_offsets(&ranks, pp, chunks, stages.as_ref())?;
    if let Some(n) = meta.num_layers.filter(|&n| n != total_layers) {
        return Err(bad(format!("the stages hold {total_layers} layers in all, but `args.num_layers` is {n}")));
    }
    let legacy = Ranks {
        ranks,
        base_of,
        distrib_base,
        layer_offset,
        tp,
        pp,
        ep,
        chunks,
        local_experts,
        swiglu,
        tied,
        bucket_size,
    };
    let tensors = legacy.one_rank(&root)?;
    meta.iteration = iteration;
    meta.tensor_parallel = Some(tp);
    meta.pipeline_parallel = Some(pp);
    meta.num_layers = Some(total_layers);
    meta.swiglu = Some(swiglu);
    meta.tied_embeddings = Some(tied);
    if let Some(f) = files.first_mut() {
        f.metadata = vec![("format".to_string(), "pt".to_string())];
    }
    let mut parts = Parts::new(Format::MegatronLegacy, root, files, tensors);
    parts.world_size = Some(world.unwrap_or(tp * pp * ep));
    parts.members.extend(loc.tracker.clone());
    parts.detail = Some(Arc::new(Megatron { meta, dcp: None, legacy: Some(legacy) }));
    Ok(Scan::clean(Checkpoint::new(parts)?))
}

/// The experts each expert-parallel rank holds (`args.num_experts` / `ep`), 0 without experts;
/// refused where the experts do not tile the ranks, or where expert tensor parallelism differs
/// from the dense one (a rank folder's tensor rank would then not say the expert's).
fn experts_per_rank(args: Option<&Leaf>, tp: u64, ep: u64) -> std::result::Result<u64, String> {
    let arg = |name: &str| info::uint(args.and_then(|a| info::lookup(a, &[name])));
    let Some(experts) = arg("num_experts") else { return Ok(0) };
    if !experts.is_multiple_of(ep) {
        return Err(format!("`args.num_experts` {experts} does not divide over the {ep} expert ranks"));
    }
    if let Some(etp) = arg("expert_tensor_parallel_size").filter(|&etp| etp != tp) {
        return Err(format!(
            "`args.expert_tensor_parallel_size` {etp} differs from the tensor parallel size {tp}: not read yet"
        ));
    }
    Ok(experts / ep)
}

/// Every model tensor is in a chunk the virtual stages have, and every expert's local index is
/// one its rank holds; the removed GroupedMLP's fused `weight1`/`weight2` is refused by name.
fn check_chunks_and_experts(ranks: &[RankFile], chunks: u64, local_experts: u64) -> Result<()> {
    for r in ranks {
        for t in &r.ck.tensors {
            let Some((k, local)) = chunk_of(&t.name) else { continue };
            if k >= chunks {
                return Err(r.bad(
                    Some(&t.name),
                    format!(
                        "model chunk {k}, but the saved args give {chunks} model chunk(s) per stage \
                         (`args.virtual_pipeline_model_parallel_size`)"
                    ),
                ));
            }
            let Some((_, _, within)) = local_layer(local) else { continue };
            let Some(e) = expert_of(within) else { continue };
            if e.local == u64::MAX {
                return Err(r.bad(
                    Some(&t.name),
                    "the removed GroupedMLP's fused expert weights: megatron-core 0.19.2 no longer documents \
                     their layout, so they are not read"
                        .into(),
                ));
            }
            if e.local >= local_experts {
                return Err(r.bad(
                    Some(&t.name),
                    format!(
                        "local expert {}, but each expert rank holds {local_experts} (`args.num_experts`)",
                        e.local
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The global index of each (stage, chunk)'s first layer, and the layers in all. With the saved
/// `args`, megatron's own placement ([`Stages`]), each chunk checked to hold the layers it
/// gives, numbered from 0; without, each stage's layers (on its first rank) follow the last.
fn stage_offsets(ranks: &[RankFile], pp: u64, chunks: u64, stages: Option<&Stages>) -> Result<(Offsets, u64)> {
    let mut offsets = BTreeMap::new();
    let mut total = 0u64;
    let mut counted = Vec::new();
    for stage in 0..pp {
        let Some(r) = ranks.iter().find(|r| r.pp == stage && r.tp == 0 && r.ep == 0) else { continue };
        for chunk in 0..chunks {
            let layers: BTreeSet<u64> =
                r.ck.tensors
                    .iter()
                    .filter_map(|t| chunk_of(&t.name).filter(|c| c.0 == chunk))
                    .filter_map(|(_, local)| local_layer(local).map(|(_, l, _)| l))
                    .collect();
            if let Some((i, l)) = layers.iter().enumerate().find(|(i, l)| *i as u64 != **l) {
                let at = if chunks > 1 { format!(" of model chunk {chunk}") } else { String::new() };
                return Err(r.bad(None, format!("its layers{at} are not numbered from 0 (layer {l} is its {i}th)")));
            }
            offsets.insert((stage, chunk), total);
            total += layers.len() as u64;
            counted.push((r, stage, chunk, layers.len() as u64));
        }
    }
    let Some(stages) = stages else { return Ok((offsets, total)) };
    if stages.num_layers != total {
        // Said by the caller, as a count.
        return Ok((offsets, total));
    }
    for (r, stage, chunk, n) in counted {
        let want = stages.layers(stage, chunk).map_err(|reason| r.bad(None, reason))?;
        let Some(offset) = stages.offset(stage, chunk) else {
            return Err(r.bad(None, format!("megatron's layer offset of stage {stage}, chunk {chunk} overflows")));
        };
        if n != want {
            return Err(r.bad(
                None,
                format!(
                    "pipeline stage {stage}, model chunk {chunk} holds {n} layers, where megatron's placement from \
                     the saved args gives {want}"
                ),
            ));
        }
        offsets.insert((stage, chunk), offset);
    }
    Ok((offsets, total))
}

/// `decoder.layers.3.mlp.linear_fc1.weight` → (`decoder.layers.`, 3, `mlp.linear_fc1.weight`).
pub(super) fn local_layer(name: &str) -> Option<(&str, u64, &str)> {
    let name = name.strip_prefix("model.").unwrap_or(name);
    let at = name.find("layers.")? + "layers.".len();
    let (block, rest) = name.split_at(at);
    let (num, within) = rest.split_once('.')?;
    let layer = num.parse().ok().filter(|_| num.bytes().all(|b| b.is_ascii_digit()))?;
    Some((block, layer, within))
}

/// The one-rank tensor `name` as a target of a model map, from the pieces of its stage's
/// tensor-parallel ranks (each with the name its rank's tensor has among the map's sources):
/// the pieces concatenated on dim `d`, SwiGLU's halves each concatenated with the other
/// ranks', or rank 0's piece where every rank holds the whole tensor.
fn stitch(
    name: &str,
    split: Split,
    tp: u64,
    pieces: &[(u64, String, &TensorInfo)],
) -> std::result::Result<Target, String> {
    let mut by_rank: Vec<&(u64, String, &TensorInfo)> = pieces.iter().collect();
    by_rank.sort_by_key(|p| p.0);
    let t0 = by_rank[0].2;
    let local = t0.shape.clone();
    for (_, _, t) in &by_rank {
        if t.shape != local || t.dtype != t0.dtype {
            return Err(format!(
                "tensor-parallel ranks disagree on its piece: {:?} `{}` and {:?} `{}`",
                local, t0.dtype, t.shape, t.dtype
            ));
        }
        if t.boxes().len() != 1 {
            return Err("a rank's piece is not one tensor of its file".into());
        }
    }
    let (shape, parts) = match split {
        Split::Whole => (local.clone(), vec![model::Piece::whole(by_rank[0].1.clone(), &local)]),
        Split::Dim(d) => {
            let Some(&n) = local.get(d) else { return Err(format!("its piece has no dim {d} to split on")) };
            let mut shape = local.clone();
            shape[d] = n * tp;
            let parts =
                by_rank.iter().map(|(r, source, _)| model::Piece::range(source.clone(), &local, d, 0..n, r * n));
            (shape, parts.collect())
        }
        Split::Gated => {
            let Some(&n) = local.first() else { return Err("its piece is 0-d".into()) };
            if n % 2 != 0 {
                return Err(format!("a SwiGLU piece has {n} rows, not an even number"));
            }
            let half = n / 2;
            let mut shape = local.clone();
            shape[0] = n * tp;
            let mut parts = Vec::new();
            for (r, source, _) in &by_rank {
                parts.push(model::Piece::range(source.clone(), &local, 0, 0..half, r * half));
                parts.push(model::Piece::range(source.clone(), &local, 0, half..n, tp * half + r * half));
            }
            (shape, parts)
        }
    };
    Ok(Target::new(name, shape, parts))
}

/// `t` as a tensor of the catalog whose files are its file's followed by others: its file
/// indices moved by `by`.
fn moved(t: &TensorInfo, name: String, by: usize) -> TensorInfo {
    let data = match &t.data {
        TensorData::Boxes(b) => {
            TensorData::Boxes(b.iter().map(|b| TensorBox { file: b.file + by, ..b.clone() }).collect())
        }
        TensorData::Ranges(c) => TensorData::Ranges(c.iter().map(|c| Chunk { file: c.file + by, ..*c }).collect()),
    };
    TensorInfo { name, data, ..t.clone() }
}

/// The reason a map built from a save's own tensors does not fit, for [`Error::BadMegatron`].
fn map_reason(e: Error) -> String {
    match e {
        Error::BadModelMap { problem, .. } => problem.to_string(),
        other => other.to_string(),
    }
}

/// Every rank's file, each read once, checked to form a whole grid of tensor × pipeline ×
/// expert ranks. What a folder name's numbers mean is the saved `args`' to say (see
/// [`rank_folders`]): they are read from the first rank folder's file.
fn read_ranks(dir: &Path) -> Result<Vec<RankFile>> {
    let allow = AllowGlobals::new(super::SAVE_GLOBALS.iter().copied())?;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::Io { path: dir.to_path_buf(), source: e })? {
        let entry = entry.map_err(|e| Error::Io { path: dir.to_path_buf(), source: e })?;
        // A name that is not UTF-8 is no rank folder, as `ranks_of` would say of it.
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    let first = names.iter().map(|n| dir.join(n).join(RANK_FILE)).find(|p| {
        p.parent().and_then(|d| d.file_name()).and_then(|n| n.to_str()).and_then(ranks_of).is_some() && p.is_file()
    });
    let mut read: BTreeMap<PathBuf, Checkpoint> = BTreeMap::new();
    let mut sizes = Sizes::default();
    if let Some(path) = first {
        let ck = torch::catalog(path.clone(), Format::Torch, &allow)?.checkpoint;
        let args = ck.values.iter().find(|(k, _)| k == "args").map(|(_, v)| v);
        let arg = |name: &str| info::uint(args.and_then(|a| info::lookup(a, &[name])));
        sizes = Sizes { pipeline: arg("pipeline_model_parallel_size"), expert: arg("expert_model_parallel_size") };
        read.insert(path, ck);
    }
    let grid = rank_grid(dir, &names, sizes)?;
    let last = grid.last().map_or((0, 0, 0), |r| (r.tp + 1, r.pp + 1, r.ep + 1));
    let mut ranks = Vec::with_capacity(grid.len());
    for Rank { tp, pp, ep, file } in grid {
        if !file.is_file() {
            if last.2 > 1 {
                let reason = format!(
                    "missing: the save has {} tensor-parallel × {} pipeline × {} expert ranks, but this rank's file \
                     is not there",
                    last.0, last.1, last.2
                );
                return Err(Error::BadMegatron { path: file, key: None, rank: Some(tp), reason });
            }
            return Err(Error::MissingMegatronRank { path: file, rank: tp, tp: last.0, pp: last.1 });
        }
        let distrib_path = file.with_file_name(DISTRIB_FILE);
        let ck = match read.remove(&file) {
            Some(ck) => ck,
            None => torch::catalog(file, Format::Torch, &allow)?.checkpoint,
        };
        let distrib = if distrib_path.is_file() {
            Some(torch::catalog(distrib_path, Format::Torch, &allow)?.checkpoint)
        } else {
            None
        };
        ranks.push(RankFile { tp, pp, ep, ck, distrib });
    }
    Ok(ranks)
}

impl Ranks {
    /// The ranks' model tensors by (stage, one-rank name), in the order first met, each with
    /// its tensor-parallel pieces.
    fn pieces_by_name(&self) -> (Vec<StageName>, BTreeMap<StageName, Vec<Piece<'_>>>) {
        let mut pieces: BTreeMap<StageName, Vec<Piece<'_>>> = BTreeMap::new();
        let mut order = Vec::new();
        for (ri, r) in self.ranks.iter().enumerate() {
            for t in &r.ck.tensors {
                let Some(name) = self.one_rank_name(r, &t.name) else { continue };
                if self.is_copy(r, &name) {
                    continue;
                }
                let key = (r.pp, name);
                if !pieces.contains_key(&key) {
                    order.push(key.clone());
                }
                pieces.entry(key).or_default().push((r.tp, ri, t));
            }
        }
        (order, pieces)
    }

    /// The name a rank's tensor has among a map's sources: its rank folder, then its name.
    fn source_name(&self, ri: usize, name: &str) -> String {
        let folder = self.ranks[ri].ck.root.parent().and_then(|d| d.file_name()).map(|n| n.to_string_lossy());
        format!("{}/{name}", folder.unwrap_or_default())
    }

    /// The one-rank model: every rank's tensors, seen through one model map that stitches each
    /// tensor from its stage's tensor-parallel pieces and leaves out what the one-rank model
    /// does not hold (the optimizer, RNG states, `_extra_state`, a tied output's copy, the
    /// other ranks' copies of a tensor every rank holds whole, and the other expert ranks'
    /// copies of the layers' dense tensors).
    fn one_rank(&self, root: &Path) -> Result<Vec<TensorInfo>> {
        let mut sources = Vec::new();
        let mut map = ModelMap::new("one-rank model");
        for (ri, r) in self.ranks.iter().enumerate() {
            for t in &r.ck.tensors {
                let source = self.source_name(ri, &t.name);
                if self.one_rank_name(r, &t.name).is_none_or(|name| self.is_copy(r, &name)) {
                    map.leave_out(source.clone());
                }
                sources.push(moved(t, source, self.base_of[ri]));
            }
        }
        let (order, pieces) = self.pieces_by_name();
        let mut seen = BTreeSet::new();
        for key in &order {
            let (stage, name) = key;
            let list = &pieces[key];
            let r = &self.ranks[list[0].1];
            let bad = |reason: String| Error::BadMegatron {
                path: r.ck.root.clone(),
                key: Some(name.clone()),
                rank: Some(r.tp),
                reason,
            };
            if !seen.insert(name.clone()) {
                // The stages share nothing but a tied output's copy, left out above.
                return Err(bad(format!("pipeline stage {stage} holds it, and so does an earlier one")));
            }
            if list.len() as u64 != self.tp {
                return Err(bad(format!("{} of the stage's {} tensor-parallel ranks hold it", list.len(), self.tp)));
            }
            let split = split_of(name, self.swiglu);
            let named: Vec<(u64, String, &TensorInfo)> =
                list.iter().map(|&(tp, ri, t)| (tp, self.source_name(ri, &t.name), t)).collect();
            if split == Split::Whole {
                // Every rank holds it whole: rank 0's is the one read.
                named.iter().filter(|p| p.0 != 0).for_each(|p| map.leave_out(p.1.clone()));
            }
            map.push(stitch(name, split, self.tp, &named).map_err(bad)?);
        }
        map.apply(root, &sources)
    }

    /// True when the save's optimizer is the distributed one, in `distrib_optim.pt` beside
    /// each rank's file.
    pub(crate) fn has_distributed_optimizer(&self) -> bool {
        self.ranks.iter().any(|r| r.distrib.is_some())
    }

    /// The one-rank name of a rank's model tensor (`model.` or `model<k>.` taken off, layers
    /// numbered globally by megatron's placement of the chunk, experts by their global index),
    /// or `None` for what the one-rank model does not hold.
    fn one_rank_name(&self, r: &RankFile, name: &str) -> Option<String> {
        let (chunk, local) = chunk_of(name)?;
        if local.ends_with("_extra_state") || (self.tied && local == "output_layer.weight") {
            return None;
        }
        Some(match local_layer(local) {
            Some((block, l, rest)) => {
                let layer = self.layer_offset.get(&(r.pp, chunk))? + l;
                match expert_of(rest) {
                    Some(e) => format!("{block}{layer}.{}", e.global_name(r.ep, self.local_experts)),
                    None => format!("{block}{layer}.{rest}"),
                }
            }
            None => local.to_string(),
        })
    }

    /// True when the one-rank tensor `name` of rank `r` is a copy: every expert rank holds the
    /// layers' other tensors (they are data-parallel there), expert rank 0's is the one read.
    fn is_copy(&self, r: &RankFile, name: &str) -> bool {
        r.ep != 0 && !name.contains(".mlp.experts.local_experts.")
    }

    /// The optimizer state per parameter of a save without the distributed optimizer, named as
    /// the distributed optimizer's `fully_reshardable` form names it
    /// (`optimizer.state.{param,exp_avg,exp_avg_sq}.<stored key>`, layers stacked).
    ///
    /// Each rank's `optimizer` holds torch's optimizer state keyed by index and megatron's fp32
    /// master copies (`fp32_from_fp16_params`, per param group). Megatron puts the model's
    /// parameters into two groups, in their order: weight decay (the rest), then none (biases
    /// and 1-D parameters); torch numbers them across the groups in order.
    pub(crate) fn optimizer_state(&self) -> Result<Vec<TensorInfo>> {
        let refuse = |what: &str| Error::BadMegatron {
            path: self.ranks[0].ck.root.clone(),
            key: Some("optimizer".into()),
            rank: None,
            reason: format!("{what}: the optimizer's layout per rank is not derived yet"),
        };
        // Megatron-LM saved without `--no-save-optim` writes `optimizer` into every rank's file.
        let has_optimizer = |r: &RankFile| {
            r.distrib.is_some()
                || r.ck.tensors.iter().any(|t| t.name.starts_with("optimizer."))
                || r.ck.values.iter().any(|(k, _)| k.starts_with("optimizer"))
        };
        if !self.ranks.iter().any(has_optimizer) {
            return Err(Error::BadMegatron {
                path: self.ranks[0].ck.root.clone(),
                key: None,
                rank: None,
                reason: "the checkpoint holds no optimizer state".into(),
            });
        }
        if self.chunks > 1 {
            return Err(refuse("virtual pipeline chunks (`model0`, `model1`, ...)"));
        }
        if self.ep > 1 {
            return Err(refuse("expert parallelism (a chained optimizer per expert rank)"));
        }
        if self.has_distributed_optimizer() {
            return self.distributed_state();
        }
        let mut pieces: BTreeMap<(String, &str), Vec<Piece<'_>>> = BTreeMap::new();
        for (ri, r) in self.ranks.iter().enumerate() {
            let bad = |reason: String| Error::BadMegatron {
                path: r.ck.root.clone(),
                key: Some("optimizer".into()),
                rank: Some(r.tp),
                reason,
            };
            let by_name: BTreeMap<&str, &TensorInfo> = r.ck.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
            let params = r.parameters();
            let no_decay = |t: &TensorInfo| t.shape.len() <= 1 || t.name.ends_with(".bias");
            let groups: [Vec<&TensorInfo>; 2] = [
                params.iter().copied().filter(|t| !no_decay(t)).collect(),
                params.iter().copied().filter(|t| no_decay(t)).collect(),
            ];
            let recorded = group_sizes(&r.ck);
            let derived = vec![groups[0].len() as u64, groups[1].len() as u64];
            if recorded.as_ref() != Some(&derived) {
                return Err(bad(format!(
                    "its param groups hold {recorded:?} parameters, where megatron's grouping of the model gives {derived:?}; \
                     refusing to guess which state is whose"
                )));
            }
            for (g, group) in groups.iter().enumerate() {
                for (j, t) in group.iter().enumerate() {
                    let i = if g == 0 { j } else { groups[0].len() + j };
                    let Some(name) = self.one_rank_name(r, &t.name) else { continue };
                    for state in STATES {
                        let key = match state {
                            "param" => format!("optimizer.fp32_from_fp16_params.{g}.{j}"),
                            s => format!("optimizer.optimizer.state.{i}.{s}"),
                        };
                        let Some(&found) = by_name.get(key.as_str()) else {
                            return Err(bad(format!("`{key}` (the `{state}` of `{}`) is not there", t.name)));
                        };
                        if found.shape != t.shape {
                            return Err(bad(format!(
                                "`{key}` has shape {:?}, but `{}` is {:?}",
                                found.shape, t.name, t.shape
                            )));
                        }
                        pieces.entry((name.clone(), state)).or_default().push((r.tp, ri, found));
                    }
                }
            }
        }
        self.per_parameter(&pieces, &self.base_of)
    }

    /// Each one-rank tensor's state stitched from its ranks' pieces (`base_of`: where each
    /// rank's files start among the catalog's), then the layers of a stored key stacked on a
    /// leading axis.
    fn per_parameter(
        &self,
        pieces: &BTreeMap<(String, &str), Vec<Piece<'_>>>,
        base_of: &[usize],
    ) -> Result<Vec<TensorInfo>> {
        let mut plain = Vec::new();
        let mut layers: BTreeMap<(String, &str), Vec<(u64, TensorInfo)>> = BTreeMap::new();
        for ((name, state), list) in pieces {
            let split = split_of(name, self.swiglu);
            let r = &self.ranks[list[0].1];
            let bad = |reason: String| Error::BadMegatron {
                path: r.ck.root.clone(),
                key: Some(name.clone()),
                rank: Some(r.tp),
                reason: format!("its optimizer `{state}`: {reason}"),
            };
            // The pieces as the sources of a map of this one tensor.
            let sources: Vec<TensorInfo> = list
                .iter()
                .map(|&(tp, ri, t)| moved(t, format!("{}/{tp}", self.source_name(ri, name)), base_of[ri]))
                .collect();
            let named: Vec<(u64, String, &TensorInfo)> =
                list.iter().zip(&sources).map(|(&(tp, _, _), s)| (tp, s.name.clone(), s)).collect();
            let mut map = ModelMap::new("parameter's optimizer state");
            map.push(stitch(name, split, self.tp, &named).map_err(&bad)?);
            if split == Split::Whole {
                named.iter().filter(|p| p.0 != 0).for_each(|p| map.leave_out(p.1.clone()));
            }
            let t = map.apply(&r.ck.root, &sources).map_err(|e| bad(map_reason(e)))?.remove(0);
            match local_layer(name) {
                Some((block, l, rest)) => {
                    let stored = format!("{block}{}", names::stored_within(rest));
                    layers.entry((stored, *state)).or_default().push((l, t));
                }
                None => plain.push(TensorInfo { name: format!("{STATE_PREFIX}{state}.{name}"), ..t }),
            }
        }
        for ((stored, state), mut per_layer) in layers {
            per_layer.sort_by_key(|(l, _)| *l);
            let name = format!("{STATE_PREFIX}{state}.{stored}");
            let stacked =
                stack(&name, per_layer.into_iter().map(|(_, t)| t).collect()).map_err(|e| Error::BadMegatron {
                    path: self.ranks[0].ck.root.clone(),
                    key: Some(stored.clone()),
                    rank: None,
                    reason: format!("its optimizer `{state}`: {}", map_reason(e)),
                })?;
            plain.push(stacked);
        }
        Ok(plain)
    }

    /// The distributed optimizer's state per parameter, from each rank's `distrib_optim.pt`:
    /// per state one flat fp32 tensor of the rank's grad buffer, its buckets back to back
    /// without their end padding (`get_parameter_state_dp_zero`). The file records only the
    /// total, so the layout is megatron's, derived from the rank's parameters and the bucket
    /// size (`--ddp-bucket-size` with `--overlap-grad-reduce`, on the first stage only), and
    /// must come to that total.
    fn distributed_state(&self) -> Result<Vec<TensorInfo>> {
        let mut owned: Vec<(String, &str, u64, usize, TensorInfo)> = Vec::new();
        let stages = self.pp;
        for (ri, r) in self.ranks.iter().enumerate() {
            let bad = |reason: String| Error::BadMegatron {
                path: r.ck.root.with_file_name(DISTRIB_FILE),
                key: None,
                rank: Some(r.tp),
                reason,
            };
            let Some(d) = &r.distrib else {
                return Err(bad("missing, where the other ranks have theirs".into()));
            };
            let params = r.parameters();
            if params.windows(2).any(|w| w[0].dtype != w[1].dtype) {
                return Err(bad(
                    "the model's parameters are of several dtypes (several grad buffers): not derived yet".into(),
                ));
            }
            if self.tied && stages > 1 {
                // The embeddings' copy on the last stage gets a bucket of its own there.
                return Err(bad("tied embeddings under pipeline parallelism: not derived yet".into()));
            }
            let bucket_size = if r.pp == 0 { self.bucket_size.clone().map_err(&bad)? } else { None };
            let numels: Vec<u64> = params.iter().map(|t| t.numel()).collect();
            let (placed, sizes) = super::buckets::place_by_size(&numels, bucket_size);
            let total: u64 = sizes.iter().sum();
            for state in STATES {
                let suffix = format!(".{state}");
                let found: Vec<&TensorInfo> = d.tensors.iter().filter(|t| t.name.ends_with(&suffix)).collect();
                let [flat] = found.as_slice() else {
                    return Err(bad(format!("holds {} `{state}` buffers; one grad buffer is derived", found.len())));
                };
                if flat.shape != [total] {
                    return Err(bad(format!(
                        "`{}` holds {:?} elements, but megatron's layout of this rank's parameters gives {total} \
                         (buckets {sizes:?}): refusing to guess",
                        flat.name, flat.shape
                    )));
                }
                let [b] = flat.boxes() else { return Err(bad(format!("`{}` is not one stored tensor", flat.name))) };
                for (t, &(bucket, start)) in params.iter().zip(&placed) {
                    let Some(name) = self.one_rank_name(r, &t.name) else { continue };
                    let at: u64 = sizes[..bucket as usize].iter().sum::<u64>() + start;
                    let Some(strides) = crate::read::shape::contiguous_strides(&t.shape) else {
                        return Err(bad(format!("`{}` has a shape too large to address", t.name)));
                    };
                    let step = b.strides.first().copied().unwrap_or(1);
                    let view = TensorBox {
                        region: Region::whole(&t.shape),
                        offset: b.offset + at * step,
                        strides,
                        ..b.clone()
                    };
                    let info = TensorInfo {
                        name: name.clone(),
                        dtype: flat.dtype,
                        shape: t.shape.clone(),
                        stored: flat.stored,
                        data: TensorData::Boxes(vec![view]),
                    };
                    owned.push((name, state, r.tp, ri, info));
                }
            }
        }
        let mut pieces: BTreeMap<(String, &str), Vec<Piece<'_>>> = BTreeMap::new();
        for (name, state, tp, ri, info) in &owned {
            pieces.entry((name.clone(), *state)).or_default().push((*tp, *ri, info));
        }
        self.per_parameter(&pieces, &self.distrib_base)
    }
}

/// The bucket size of a first stage's grad buffers, as Megatron-LM resolves it from its
/// arguments (`resolve_ddp_bucket_size`): none without `overlap_grad_reduce`, else
/// `ddp_bucket_size`, by default the larger of 40M and 1M × the data-and-context-parallel size.
pub(super) fn bucket_size(args: Option<&Leaf>) -> std::result::Result<Option<u64>, String> {
    let arg = |name: &str| args.and_then(|a| info::lookup(a, &[name]));
    let int = |name: &str| info::uint(arg(name));
    if args.is_none() {
        return Err("the save has no `args` to take its bucket size from".into());
    }
    if !matches!(arg("ddp_num_buckets"), None | Some(Leaf::None)) {
        return Err("`args.ddp_num_buckets` is set: that bucket size is not derived yet".into());
    }
    if !matches!(arg("overlap_grad_reduce"), Some(Leaf::Bool(true))) {
        return Ok(None);
    }
    Ok(Some(int("ddp_bucket_size").unwrap_or_else(|| {
        let dp_cp = int("data_parallel_size").unwrap_or(1) * int("context_parallel_size").unwrap_or(1);
        (1_000_000 * dp_cp).max(40_000_000)
    })))
}

/// How many parameters each param group of a rank's optimizer holds (`param_groups[g].params`).
fn group_sizes(ck: &Checkpoint) -> Option<Vec<u64>> {
    let (_, groups) = ck.values.iter().find(|(k, _)| k == "optimizer.optimizer.param_groups")?;
    let Leaf::List(groups) = groups else { return None };
    groups
        .iter()
        .map(|g| match info::lookup(g, &["params"]) {
            Some(Leaf::List(p)) => Some(p.len() as u64),
            _ => None,
        })
        .collect()
}

/// The tensors of `layers` (one per layer, in order, alike in shape) as one tensor `name`
/// with a leading layer axis: a model map whose pieces put each layer at its index.
fn stack(name: &str, layers: Vec<TensorInfo>) -> Result<TensorInfo> {
    let shape = layers.first().map(|t| t.shape.clone()).unwrap_or_default();
    let sources: Vec<TensorInfo> =
        layers.into_iter().enumerate().map(|(l, t)| TensorInfo { name: l.to_string(), ..t }).collect();
    let pieces =
        sources.iter().enumerate().map(|(l, t)| model::Piece::stacked(t.name.clone(), &shape, 0, l as u64)).collect();
    let mut stacked_shape = vec![sources.len() as u64];
    stacked_shape.extend(&shape);
    let mut map = ModelMap::new("stacked layers");
    map.push(Target::new(name, stacked_shape, pieces));
    Ok(map.apply(Path::new(name), &sources)?.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_files_tensors_name_their_chunk_and_layer() {
        assert_eq!(chunk_of("model.decoder.final_layernorm.weight"), Some((0, "decoder.final_layernorm.weight")));
        assert_eq!(chunk_of("model1.decoder.layers.0.x"), Some((1, "decoder.layers.0.x")));
        assert_eq!(chunk_of("optimizer.state.0.exp_avg"), None);
        assert_eq!(chunk_of("model_x.y"), None);
        assert_eq!(
            local_layer("decoder.layers.3.mlp.linear_fc1.weight"),
            Some(("decoder.layers.", 3, "mlp.linear_fc1.weight"))
        );
        assert_eq!(local_layer("decoder.final_layernorm.weight"), None);
    }

    #[test]
    fn experts_of_either_spec_take_their_global_sequential_names() {
        let cases = [
            ("mlp.experts.local_experts.1.linear_fc1.weight", 1, Some("mlp.experts.local_experts.3.linear_fc1.weight")),
            ("mlp.experts.linear_fc2.weight0", 1, Some("mlp.experts.local_experts.2.linear_fc2.weight")),
            ("mlp.experts.linear_fc1.bias1", 0, Some("mlp.experts.local_experts.1.linear_fc1.bias")),
            ("mlp.router.weight", 1, None),
            ("mlp.shared_experts.linear_fc1.weight", 1, None),
        ];
        for (within, ep, want) in cases {
            assert_eq!(expert_of(within).map(|e| e.global_name(ep, 2)), want.map(str::to_string), "{within}");
        }
        assert_eq!(expert_of("mlp.experts.weight1").map(|e| e.local), Some(u64::MAX));
    }
}
