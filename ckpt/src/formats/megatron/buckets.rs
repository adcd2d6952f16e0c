//! The `dp_reshardable` form of the distributed optimizer: one flat fp32 tensor per grad-buffer
//! bucket and state, each parameter a range of it, re-derived here from the model's tensors.
//!
//! # On disk
//!
//! `optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_D.bucket_idx_K.STATE` (`STATE` is
//! `param`, the fp32 main parameters, `exp_avg` or `exp_avg_sq`) is 1-D, of the bucket's size
//! without its end padding; each data-parallel rank writes the range it owns. The checkpoint
//! does not say where a parameter sits in its bucket: megatron's grad buffer decides
//! (`DistributedOptimizer._compute_per_buffer_param_layout`):
//!
//! - parameters are laid out in the reverse of their registration order (backprop order);
//! - each parameter starts on a multiple of 64 elements;
//! - a bucket closes after the parameter that fills it to its size (the bucket size is not
//!   saved, but where each bucket closes is: the stored tensor's length is the bucket's size up
//!   to the end of its last parameter), and the next bucket starts its own count at 0 (bucket
//!   starts are padded to a multiple of `lcm(dp, 128)`, itself a multiple of 64).
//!
//! Under tensor and pipeline parallelism each model-parallel rank `G` (tensor rank + tensor size
//! × pipeline stage: the rank in megatron's model-parallel group) has buckets of its own over its
//! stage's parameters (the layers as megatron places them over the stages, uneven first and last
//! stages included, the embeddings on the first, the final norm and output layer on the last) and
//! its pieces of them, laid out by the same rules; a parameter's state is its ranks' pieces put
//! back as megatron's parallel layers cut them ([`names::split_of`]): concatenated on dim 0, row
//! by row on dim 1, SwiGLU's two halves each concatenated, a replicated tensor taken from rank 0.
//!
//! With virtual pipeline stages each model chunk of a rank has a grad buffer of its own,
//! `gbuf_idx_<chunk>` under the rank's `dp_group_idx`, over the chunk's layers (the embeddings
//! in the first stage's first chunk, the final norm and output layer in the last stage's last
//! chunk), its buckets numbered from 0; `per_bucket_numel_unpadded` lists each buffer's sizes.
//!
//! A tied model under pipeline parallelism keeps the word embeddings on the first stage and a
//! copy as the last stage's `output_layer.weight`, each in a bucket of its own (megatron reduces
//! their gradients together, apart from the rest): the bucket before one closes where it would
//! have started, 64-aligned. The copy's state is the embeddings' own (the fixture checks it bit
//! for bit), so it is laid out but not written.
//!
//! The registration order is that of megatron's GPT model with the local layer spec
//! ([`REGISTRATION`]); a parameter whose place in it is not known, a bucket the derived layout
//! overfills or leaves unfilled, bucket sizes that disagree with the recorded
//! `per_bucket_numel_unpadded`, or more grad buffers than model chunks (a model of several dtypes,
//! which no save here was written with) are refused by name rather than guessed.

use std::collections::BTreeMap;

use super::info::{self, Megatron};
use super::names::{self, Split};
use super::optimizer::STATE_PREFIX;
use crate::error::{Error, Result};
use crate::formats::dcp::{DcpSource, DcpTensor};
use crate::read::catalog::{Checkpoint, Chunk, TensorBox, TensorInfo};
use crate::read::value::Leaf;

/// The prefix of the bucket tensors (`dp_group_idx_G`, G the model-parallel rank).
const BUCKET_PREFIX: &str = "optimizer.distributed.dp_group_idx_";
/// Each parameter's start in its bucket is a multiple of this many elements.
const PARAM_ALIGN: u64 = 64;

/// Where each parameter of megatron's GPT model registers, outside the layers and within one
/// (local spec, `TransformerLayer`'s and `SelfAttention`'s construction order); weights before
/// biases.
pub(super) const REGISTRATION: &[&str] = &["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"];
pub(super) const LAYER_REGISTRATION: &[&str] = &[
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    // A mixture-of-experts layer's dense parameters (`MoELayer`: the router, then the experts,
    // which live in a grad buffer of their own, then the shared experts; a module's own
    // parameters come before its children's, so the shared experts' gate before their linears).
    "mlp.router.weight",
    "mlp.shared_experts.gate_weight",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc2.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
];
/// The word embeddings' stored key.
const EMBEDDING: &str = "embedding.word_embeddings.weight";
pub(super) const AFTER_LAYERS: &[&str] =
    &["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight", "output_layer.bias"];

/// A layer's byte ranges of one state of one stored key.
type LayerRanges = (u64, Vec<Chunk>);

/// One model parameter: its stored key, its layer within a stacked key, its global shape, and
/// how tensor parallelism splits it.
#[derive(Debug)]
struct Param<'a> {
    key: &'a str,
    layer: Option<u64>,
    shape: Vec<u64>,
    /// Its element count on one tensor-parallel rank.
    local: u64,
    split: Split,
    /// Where it registers: before the layers, in layer `n`, after them; then its index.
    order: (u8, u64, usize),
    /// A tied model's last stage's copy of the word embeddings (its `output_layer.weight`): it
    /// takes its room in the last stage's buckets, but its state is the embeddings' own.
    copy: bool,
}

/// One model-parallel rank's buckets (`dp_group_idx_G`): by bucket index, by state.
pub(super) type Domain<'a> = BTreeMap<u64, BTreeMap<&'a str, &'a DcpTensor>>;

/// The optimizer state of every parameter, named as the `fully_reshardable` form names it.
pub(crate) fn per_parameter(ck: &Checkpoint, m: &Megatron, dcp: &DcpSource) -> Result<Vec<TensorInfo>> {
    let refuse = |key: Option<&str>, reason: String| Error::BadMegatron {
        path: ck.root.clone(),
        key: key.map(str::to_string),
        rank: None,
        reason,
    };
    let buffers = buffers_under(dcp, "").map_err(|(key, reason)| refuse(Some(&key), reason))?;
    let pp = m.meta.pipeline_parallel.unwrap_or(1).max(1);
    let tp = buffers.len() as u64 / pp;
    if tp * pp != buffers.len() as u64 || m.meta.tensor_parallel.is_some_and(|t| t != tp) {
        return Err(refuse(
            None,
            format!(
                "the optimizer has {} model-parallel bucket sets for tensor parallel {:?} and pipeline parallel {pp}",
                buffers.len(),
                m.meta.tensor_parallel
            ),
        ));
    }
    let swiglu = match (tp, m.meta.swiglu) {
        (1, s) => s.unwrap_or(false),
        (_, Some(s)) => s,
        (_, None) => {
            return Err(refuse(
                None,
                "under tensor parallelism the layout needs the saved `args` (`swiglu`), which are not there".into(),
            ))
        }
    };
    let stages = Stages::new(m, dcp, pp).map_err(|r| refuse(None, r))?;
    if let Some((g, b)) = buffers.iter().enumerate().find(|(_, b)| b.len() as u64 != stages.chunks()) {
        return Err(refuse(
            None,
            format!(
                "model-parallel rank {g} has {} grad buffers for {} model chunk(s): a model of several dtypes \
                 (a grad buffer per dtype) is not derived yet",
                b.len(),
                stages.chunks()
            ),
        ));
    }

    // The model's parameters in registration order, as each tensor-parallel rank holds them.
    let mut params = model_params(dcp, swiglu, tp).map_err(|(key, reason)| refuse(Some(&key), reason))?;
    let tied = pp > 1 && m.meta.tied_embeddings != Some(false);
    if tied {
        // The last stage's output layer is a parameter of its own there, registered where an
        // untied one is, whose state megatron keeps equal to the embeddings'.
        let at = AFTER_LAYERS.iter().position(|n| *n == "output_layer.weight").unwrap_or(AFTER_LAYERS.len());
        let copy = params.iter().find(|p| p.key == EMBEDDING).map(|e| Param {
            key: e.key,
            layer: None,
            shape: e.shape.clone(),
            local: e.local,
            split: e.split,
            order: (2, 0, at),
            copy: true,
        });
        let Some(copy) = copy else {
            return Err(refuse(None, "a tied model under pipeline parallelism without its word embeddings".into()));
        };
        params.push(copy);
    }
    params.sort_by_key(|p| p.order);
    // Where each model-parallel rank's grad buffers put the pieces of their chunk's parameters;
    // rank `G` is tensor-parallel rank `G % tp` of stage `G / tp`, its buffer `B` model chunk
    // `B`. Each parameter: its buffer, bucket and start there.
    let mut placed: Vec<Vec<(usize, u64, u64)>> = vec![vec![(0, 0, 0); params.len()]; buffers.len()];
    for (g, chunks) in buffers.iter().enumerate() {
        let stage = g as u64 / tp;
        for (b, domain) in chunks.iter().enumerate() {
            let members: Vec<usize> =
                (0..params.len()).filter(|&i| stages.holding(&params[i]) == (stage, b as u64)).collect();
            let numels: Vec<u64> = members.iter().map(|&i| params[i].local).collect();
            // A tied embedding (either copy) takes a bucket of its own, so that its gradient can
            // be reduced with the other stage's copy alone.
            let own: Vec<bool> = members.iter().map(|&i| tied && params[i].key == EMBEDDING).collect();
            let sizes: Vec<u64> =
                domain.values().map(|states| states.values().next().map_or(0, |t| t.shape[0])).collect();
            if let Some((key, recorded)) = recorded_sizes(dcp, g, b) {
                if recorded != sizes {
                    return Err(refuse(
                        Some(&key),
                        format!("records bucket sizes {recorded:?}, but the bucket tensors hold {sizes:?} elements"),
                    ));
                }
            }
            let at = place(&numels, &own, &sizes).map_err(|m| {
                let members: Vec<&Param<'_>> = members.iter().map(|&i| &params[i]).collect();
                misfit(&refuse, &members, &sizes, g, m)
            })?;
            for (&i, (bucket, start)) in members.iter().zip(at) {
                placed[g][i] = (b, bucket, start);
            }
        }
    }

    // Each stored key's state: its layers' pieces, the ranks' pieces of each put in row-major
    // order of the global tensor.
    let states: Vec<&str> = buffers[0][0].get(&0).map(|s| s.keys().copied().collect()).unwrap_or_default();
    let mut ranges: BTreeMap<(&str, &str), Vec<LayerRanges>> = BTreeMap::new();
    for (i, p) in params.iter().enumerate().filter(|(_, p)| !p.copy) {
        for &state in &states {
            let mut pieces = Vec::with_capacity(tp as usize);
            let first = (stages.holding(p).0 * tp) as usize;
            for g in first..first + tp as usize {
                let (b, bucket, start) = placed[g][i];
                let t = buffers[g][b].get(&bucket).and_then(|s| s.get(state)).ok_or_else(|| {
                    refuse(None, format!("bucket {bucket} of model-parallel rank {g} has no `{state}` tensor"))
                })?;
                pieces.push((*t, start));
            }
            let chunks = assemble(p, &pieces, tp).map_err(|(key, r)| refuse(Some(&key), r))?;
            ranges.entry((p.key, state)).or_default().push((p.layer.unwrap_or(0), chunks));
        }
    }
    let mut out = Vec::with_capacity(ranges.len());
    for t in dcp.tensors.iter().filter(|t| super::torch_dist::is_model_key(&t.key)) {
        for &state in &states {
            let Some(mut parts) = ranges.remove(&(t.key.as_str(), state)) else { continue };
            parts.sort_by_key(|(layer, _)| *layer);
            let dtype = buffers[0][0][&0][state].dtype;
            let chunks = parts.into_iter().flat_map(|(_, c)| c).collect();
            out.push(TensorInfo::ranges(format!("{STATE_PREFIX}{state}.{}", t.key), dtype, t.shape.clone(), chunks));
        }
    }
    Ok(out)
}

/// The bucket tensors of each rank's optimizer whose keys start with `chain` (`chained_1.` for
/// the second optimizer of a chain, empty for an unchained one), in `dp_group_idx` order, each
/// rank's one grad buffer (`gbuf_idx_0`): what an optimizer of one model chunk and one dtype
/// saves.
pub(super) fn domains_under<'a>(
    dcp: &'a DcpSource,
    chain: &str,
) -> std::result::Result<Vec<Domain<'a>>, (String, String)> {
    let mut out = Vec::new();
    for (g, mut buffers) in buffers_under(dcp, chain)?.into_iter().enumerate() {
        if buffers.len() != 1 {
            let key = format!("{chain}{BUCKET_PREFIX}{g}");
            return Err((
                key,
                "only one grad buffer per rank (`gbuf_idx_0`) is derived here: a model of several \
                 dtypes or model chunks"
                    .into(),
            ));
        }
        out.extend(buffers.pop());
    }
    Ok(out)
}

/// The bucket tensors of each rank's optimizer whose keys start with `chain`, in `dp_group_idx`
/// order, each rank's grad buffers in `gbuf_idx` order (one per model chunk and dtype).
fn buffers_under<'a>(dcp: &'a DcpSource, chain: &str) -> std::result::Result<Vec<Vec<Domain<'a>>>, (String, String)> {
    let prefix = format!("{chain}{BUCKET_PREFIX}");
    let mut by_group: BTreeMap<u64, BTreeMap<u64, Domain<'_>>> = BTreeMap::new();
    for t in dcp.tensors.iter().filter(|t| t.key.starts_with(&prefix)) {
        let bad = |reason: &str| (t.key.clone(), reason.to_string());
        let rest = &t.key[prefix.len()..];
        let (group, rest) =
            rest.split_once(".gbuf_idx_").ok_or_else(|| bad("not a bucket tensor (`...gbuf_idx_I...`)"))?;
        let group: u64 = group.parse().map_err(|_| bad("its `dp_group_idx` is not a number"))?;
        let (gbuf, rest) =
            rest.split_once('.').ok_or_else(|| bad("not a bucket tensor (`...gbuf_idx_I.dtype_...`)"))?;
        let gbuf: u64 = gbuf.parse().map_err(|_| bad("its `gbuf_idx` is not a number"))?;
        let parsed = rest.split_once(".bucket_idx_").and_then(|(_, b)| b.split_once('.'));
        let Some((b, state)) = parsed.and_then(|(b, s)| Some((b.parse::<u64>().ok()?, s))) else {
            return Err(bad("not a bucket tensor (`...bucket_idx_K.STATE`)"));
        };
        if t.shape.len() != 1 {
            return Err(bad("a bucket tensor that is not 1-D"));
        }
        by_group.entry(group).or_default().entry(gbuf).or_default().entry(b).or_default().insert(state, t);
    }
    if by_group.keys().copied().ne(0..by_group.len() as u64) || by_group.is_empty() {
        return Err(("optimizer.distributed".into(), "the `dp_group_idx` values are not 0, 1, 2, ...".into()));
    }
    for buffers in by_group.values() {
        if buffers.keys().copied().ne(0..buffers.len() as u64) {
            return Err(("optimizer.distributed".into(), "the `gbuf_idx` values are not 0, 1, 2, ...".into()));
        }
        for domain in buffers.values() {
            if domain.keys().copied().ne(0..domain.len() as u64) {
                return Err(("optimizer.distributed".into(), "the bucket indices are not 0, 1, 2, ...".into()));
            }
            for states in domain.values() {
                let first = states.values().next().map(|t| &t.shape);
                if let Some((_, t)) = states.iter().find(|(_, t)| Some(&t.shape) != first) {
                    return Err((t.key.clone(), "disagrees with the bucket's other states on its size".into()));
                }
            }
        }
    }
    Ok(by_group.into_values().map(|b| b.into_values().collect()).collect())
}

/// Which pipeline stage and model chunk holds each parameter: the embeddings the first stage's
/// first chunk, the final norm and the output layer the last stage's last chunk, the layers as
/// megatron places them ([`super::stages`]: evenly, with an uneven first or last stage, or over
/// virtual pipeline stages, each model chunk with grad buffers of its own).
pub(super) struct Stages {
    count: u64,
    chunks: u64,
    /// The first global layer of each (stage, chunk), in layer order.
    starts: Vec<(u64, (u64, u64))>,
}

impl Stages {
    pub(super) fn new(m: &Megatron, dcp: &DcpSource, pp: u64) -> std::result::Result<Stages, String> {
        let layers = m.meta.num_layers.unwrap_or(0);
        if pp == 1 {
            return Ok(Stages { count: 1, chunks: 1, starts: vec![(0, (0, 0))] });
        }
        let placement = super::stages::Stages::from_lookup(|name| info::arg(dcp, name))?;
        let placement = placement.filter(|s| s.pipeline == pp && s.num_layers == layers);
        let Some(placement) = placement else {
            // Without the args' placement, megatron's default: the layers split evenly.
            if layers == 0 || !layers.is_multiple_of(pp) {
                return Err(format!("{layers} layers do not split evenly over {pp} pipeline stages"));
            }
            let starts = (0..pp).map(|s| (s * (layers / pp), (s, 0))).collect();
            return Ok(Stages { count: pp, chunks: 1, starts });
        };
        let chunks = placement.chunks();
        let mut starts = Vec::new();
        for stage in 0..pp {
            for chunk in 0..chunks {
                if placement.layers(stage, chunk)? == 0 {
                    continue;
                }
                let start = placement.offset(stage, chunk).ok_or("megatron's layer offsets overflow")?;
                starts.push((start, (stage, chunk)));
            }
        }
        starts.sort_unstable();
        Ok(Stages { count: pp, chunks, starts })
    }

    /// The model chunks of each stage.
    pub(super) fn chunks(&self) -> u64 {
        self.chunks
    }

    /// The stage and chunk holding `p`.
    fn holding(&self, p: &Param<'_>) -> (u64, u64) {
        self.of_place(p.order.0, p.layer.unwrap_or(0))
    }

    /// The stage and chunk holding a parameter registered before the layers (`place` 0), in
    /// layer `layer` (1), or after them (2).
    pub(super) fn of_place(&self, place: u8, layer: u64) -> (u64, u64) {
        match place {
            0 => (0, 0),
            1 => {
                let at = self.starts.iter().rposition(|&(s, _)| s <= layer).unwrap_or(0);
                self.starts.get(at).map_or((0, 0), |&(_, sc)| sc)
            }
            _ => (self.count - 1, self.chunks - 1),
        }
    }
}

/// The error for a layout that does not fit the buckets of model-parallel rank `g`.
fn misfit(
    refuse: &impl Fn(Option<&str>, String) -> Error,
    params: &[&Param<'_>],
    sizes: &[u64],
    g: usize,
    m: Misfit,
) -> Error {
    match m {
        Misfit::Overfilled { param, bucket, size, end } => refuse(
            Some(params[param].key),
            format!(
                "bucket {bucket} of model-parallel rank {g} holds {size} elements, but the derived layout fills \
                 it past that (to {end}) at this parameter: its layout is not megatron's default"
            ),
        ),
        Misfit::TooFewBuckets { param } => refuse(
            Some(params[param].key),
            format!("the derived layout needs more than the {} buckets of model-parallel rank {g}", sizes.len()),
        ),
        Misfit::Unfilled { filled } => refuse(
            None,
            format!(
                "the derived layout fills {filled} of the {} buckets of model-parallel rank {g} and stops short",
                sizes.len()
            ),
        ),
    }
}

/// The byte ranges of one layer's state of `p`, row-major in the global tensor, from the
/// tensor-parallel ranks' pieces (each a bucket tensor and the piece's start in it).
fn assemble(p: &Param<'_>, pieces: &[(&DcpTensor, u64)], tp: u64) -> std::result::Result<Vec<Chunk>, (String, String)> {
    let local = p.local;
    let mut out: Vec<Chunk> = Vec::new();
    let mut take = |(t, start): (&DcpTensor, u64), from: u64, to: u64| -> std::result::Result<(), (String, String)> {
        let elem = t.dtype.bits() / 8;
        for c in flat_range(&t.boxes, start + from, start + to, elem).map_err(|r| (t.key.clone(), r))? {
            match out.last_mut() {
                Some(last) if last.file == c.file && last.offset + last.len == c.offset => last.len += c.len,
                _ => out.push(c),
            }
        }
        Ok(())
    };
    match p.split {
        _ if tp == 1 => take(pieces[0], 0, local)?,
        Split::Whole => take(pieces[0], 0, local)?,
        Split::Dim(0) => {
            for &piece in pieces {
                take(piece, 0, local)?;
            }
        }
        Split::Dim(1) => {
            let rows = p.shape.first().copied().filter(|_| p.shape.len() == 2).unwrap_or(0);
            let cols = local.checked_div(rows).unwrap_or(0);
            for row in 0..rows {
                for &piece in pieces {
                    take(piece, row * cols, (row + 1) * cols)?;
                }
            }
        }
        Split::Gated => {
            let half = local / 2;
            for part in 0..2 {
                for &piece in pieces {
                    take(piece, part * half, (part + 1) * half)?;
                }
            }
        }
        Split::Dim(d) => return Err((p.key.to_string(), format!("a tensor-parallel split on dim {d} is not derived"))),
    }
    Ok(out)
}

/// The bucket sizes megatron recorded beside the buckets (`per_bucket_numel_unpadded`: per
/// grad buffer, a dict from its dtype pair to one size per bucket), for grad buffer `gbuf` of
/// model-parallel rank `group`, with the key they were read from.
fn recorded_sizes(dcp: &DcpSource, group: usize, gbuf: usize) -> Option<(String, Vec<u64>)> {
    let key = format!("optimizer.distributed.dp_group_idx_{group}.per_bucket_numel_unpadded");
    let item = dcp.bytes.iter().find(|b| b.key.split('/').next() == Some(key.as_str()))?;
    // One-item lists (the sharded object) around the list of grad buffers.
    let mut v = &item.value;
    let buffers = loop {
        match v {
            Leaf::List(items) if items.len() == 1 && matches!(items[0], Leaf::List(_)) => v = &items[0],
            Leaf::List(items) => break items,
            _ => return None,
        }
    };
    let Leaf::Dict(by_dtype) = buffers.get(gbuf)? else { return None };
    let (_, Leaf::List(sizes)) = by_dtype.first()? else { return None };
    let sizes: Option<Vec<u64>> =
        sizes.iter().map(|s| if let Leaf::Int(i) = s { u64::try_from(*i).ok() } else { None }).collect();
    Some((item.key.clone(), sizes?))
}

/// Why the parameters do not fit the checkpoint's buckets.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Misfit {
    /// Parameter `param` (registration index) ends at `end`, past its bucket's `size`.
    Overfilled { param: usize, bucket: usize, size: u64, end: u64 },
    /// Parameter `param` is left when every bucket is full.
    TooFewBuckets { param: usize },
    /// The parameters end after `filled` buckets, the last of them not full.
    Unfilled { filled: usize },
}

/// Where megatron's grad buffer puts each parameter (`numels` in registration order): its
/// bucket and its start in it, laid out in reverse, each start on a multiple of
/// [`PARAM_ALIGN`], a bucket closing when it reaches its stored size (`sizes`, without the end
/// padding). A parameter marked `own` (a tied embedding under pipeline parallelism) takes a
/// bucket of its own: the bucket before it closes where it would have started (at most the
/// stored size, what is past its parameters being padding), and it fills its own.
pub(super) fn place(numels: &[u64], own: &[bool], sizes: &[u64]) -> std::result::Result<Vec<(u64, u64)>, Misfit> {
    let mut placed = vec![(0, 0); numels.len()];
    let (mut bucket, mut at) = (0usize, 0u64);
    for (param, &numel) in numels.iter().enumerate().rev() {
        let alone = own.get(param).copied().unwrap_or(false);
        if alone && at > 0 {
            let Some(&size) = sizes.get(bucket) else { return Err(Misfit::TooFewBuckets { param }) };
            let start = at.div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
            if start > size {
                return Err(Misfit::Overfilled { param, bucket, size, end: start });
            }
            bucket += 1;
            at = 0;
        }
        let Some(&size) = sizes.get(bucket) else { return Err(Misfit::TooFewBuckets { param }) };
        let start = at.div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
        at = start + numel;
        if at > size || (alone && at != size) {
            return Err(Misfit::Overfilled { param, bucket, size, end: at });
        }
        placed[param] = (bucket as u64, start);
        if at == size {
            bucket += 1;
            at = 0;
        }
    }
    if bucket != sizes.len() || at != 0 {
        return Err(Misfit::Unfilled { filled: bucket });
    }
    Ok(placed)
}

/// Where megatron's grad buffer puts each parameter (`numels` in registration order) when the
/// bucket size is what decides (a legacy save records no bucket sizes): laid out in reverse,
/// each start on a multiple of [`PARAM_ALIGN`], a bucket closing after the parameter that brings
/// it to `bucket_size` or more (`None`: one bucket). Gives each parameter's bucket and start in
/// it, and each bucket's size without its end padding.
pub(super) fn place_by_size(numels: &[u64], bucket_size: Option<u64>) -> (Vec<(u64, u64)>, Vec<u64>) {
    let mut placed = vec![(0, 0); numels.len()];
    let mut sizes = Vec::new();
    let (mut at, mut open) = (0u64, false);
    for (param, &numel) in numels.iter().enumerate().rev() {
        let start = at.div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
        placed[param] = (sizes.len() as u64, start);
        at = start + numel;
        open = true;
        if bucket_size.is_some_and(|b| at >= b) {
            sizes.push(at);
            (at, open) = (0, false);
        }
    }
    if open {
        sizes.push(at);
    }
    (placed, sizes)
}

/// Every model parameter of the checkpoint, a plain key as one, a stacked key as one per layer;
/// each split as megatron's parallel layers split it over `tp` ranks.
fn model_params(dcp: &DcpSource, swiglu: bool, tp: u64) -> std::result::Result<Vec<Param<'_>>, (String, String)> {
    let mut out = Vec::new();
    for t in dcp.tensors.iter().filter(|t| super::torch_dist::is_model_key(&t.key)) {
        let bad = |reason: &str| (t.key.clone(), reason.to_string());
        let unknown = || {
            bad("its place in megatron's parameter registration order is not known; refusing to guess the bucket layout")
        };
        let (name, layers, order, shape) = match names::stacked(&t.key) {
            Some(s) if s.block == "decoder.layers." => {
                let within = names::module_name(s.within);
                let index = LAYER_REGISTRATION.iter().position(|n| *n == within).ok_or_else(unknown)?;
                let (&layers, shape) = t.shape.split_first().ok_or_else(unknown)?;
                (within, Some(layers), (1, index), shape)
            }
            Some(_) => return Err(unknown()),
            None => {
                let (group, index) = match REGISTRATION.iter().position(|n| *n == t.key) {
                    Some(i) => (0, i),
                    None => (2, AFTER_LAYERS.iter().position(|n| *n == t.key).ok_or_else(unknown)?),
                };
                (t.key.clone(), None, (group, index), &t.shape[..])
            }
        };
        let split = names::split_of(&name, swiglu);
        let numel: u64 = shape.iter().product();
        let cut = match split {
            Split::Whole => None,
            Split::Dim(d) => Some(shape.get(d).copied().unwrap_or(0)),
            Split::Gated => Some(shape.first().copied().unwrap_or(0) / 2),
        };
        if cut.is_some_and(|c| c == 0 || c % tp != 0) {
            return Err(bad(&format!("its {split:?} split does not divide over {tp} tensor-parallel ranks")));
        }
        let local = if cut.is_some() { numel / tp } else { numel };
        let param = |layer: Option<u64>| Param {
            key: &t.key,
            layer,
            shape: shape.to_vec(),
            local,
            split,
            order: (order.0, layer.unwrap_or(0), order.1),
            copy: false,
        };
        match layers {
            Some(n) => out.extend((0..n).map(|l| param(Some(l)))),
            None => out.push(param(None)),
        }
    }
    Ok(out)
}

/// The byte ranges of elements `start..end` of a 1-D tensor made of `boxes`.
pub(super) fn flat_range(
    boxes: &[TensorBox],
    start: u64,
    end: u64,
    elem: u64,
) -> std::result::Result<Vec<Chunk>, String> {
    let mut sorted: Vec<&TensorBox> = boxes.iter().collect();
    sorted.sort_by_key(|b| b.region.offsets[0]);
    let mut out = Vec::new();
    let mut next = start;
    for b in sorted {
        let (o, n) = (b.region.offsets[0], b.region.sizes[0]);
        let (lo, hi) = (next.max(o), end.min(o + n));
        if lo >= hi {
            continue;
        }
        if lo != next {
            return Err(format!("elements {next}..{lo} are in no saved range"));
        }
        if b.strides[0] != 1 && hi - lo > 1 {
            return Err(format!("the saved range at {o} is strided ({}), not a flat buffer", b.strides[0]));
        }
        out.push(Chunk { file: b.file, offset: b.base + (b.offset + (lo - o)) * elem, len: (hi - lo) * elem });
        next = hi;
    }
    if next != end {
        return Err(format!("elements {next}..{end} are in no saved range"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The training save of `fixtures/megatron/train_dp2` (2 layers, hidden 8, 2 data-parallel
    /// ranks, bucket size 600): megatron's own layout, as its `param_index_map` reported it.
    #[test]
    fn the_layout_megatron_reported_for_a_real_save() {
        // Registration order: embedding, per layer input norm, proj, qkv, mlp norm, fc1, fc2;
        // final norm, output layer.
        let layer = [8, 64, 128, 8, 128, 128];
        let numels: Vec<u64> = std::iter::once(256).chain(layer).chain(layer).chain([8, 256]).collect();
        let placed = place(&numels, &[], &[768, 640, 320]);
        let want = vec![
            (2, 64), // embedding
            (2, 0),  // layer 0
            (1, 576),
            (1, 448),
            (1, 384),
            (1, 256),
            (1, 128),
            (1, 64), // layer 1
            (1, 0),
            (0, 640),
            (0, 576),
            (0, 448),
            (0, 320),
            (0, 256), // final norm
            (0, 0),   // output layer
        ];
        assert_eq!(placed, Ok(want));
    }

    /// The same layout from the bucket size (600) megatron was given, as a legacy save must
    /// derive it.
    #[test]
    fn the_bucket_size_closes_the_same_buckets() {
        let layer = [8, 64, 128, 8, 128, 128];
        let numels: Vec<u64> = std::iter::once(256).chain(layer).chain(layer).chain([8, 256]).collect();
        let (placed, sizes) = place_by_size(&numels, Some(600));
        assert_eq!(sizes, vec![768, 640, 320]);
        assert_eq!(Ok(placed), place(&numels, &[], &sizes));
        let (one, sizes) = place_by_size(&[10, 20], None);
        assert_eq!((one, sizes), (vec![(0, 64), (0, 0)], vec![74]));
    }

    #[test]
    fn a_layout_that_does_not_fit_is_refused_not_guessed() {
        // A parameter megatron would not close the bucket on: it runs past the stored size.
        assert_eq!(
            place(&[64, 100], &[], &[120]),
            Err(Misfit::Overfilled { param: 0, bucket: 0, size: 120, end: 192 })
        );
        assert_eq!(place(&[64, 64], &[], &[64]), Err(Misfit::TooFewBuckets { param: 0 }));
        assert_eq!(place(&[64], &[], &[64, 64]), Err(Misfit::Unfilled { filled: 1 }));
        assert_eq!(place(&[10, 20], &[], &[74]), Ok(vec![(0, 64), (0, 0)]));
    }
}
