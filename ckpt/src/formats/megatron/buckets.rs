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
//! The registration order is that of megatron's GPT model with the local layer spec
//! ([`REGISTRATION`]); a parameter whose place in it is not known, a bucket the derived layout
//! overfills or leaves unfilled, or a layout over several buffers or model-parallel domains is
//! refused by name rather than guessed.

use std::collections::BTreeMap;

use super::info::Megatron;
use super::names;
use super::optimizer::STATE_PREFIX;
use crate::catalog::{Checkpoint, Chunk, TensorBox, TensorInfo};
use crate::error::{Error, Result};
use crate::formats::dcp::DcpSource;
use crate::value::Leaf;

/// The prefix of the bucket tensors of the one layout read here.
const BUCKET_PREFIX: &str = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.";
/// Each parameter's start in its bucket is a multiple of this many elements.
const PARAM_ALIGN: u64 = 64;

/// Where each parameter of megatron's GPT model registers, outside the layers and within one
/// (local spec, `TransformerLayer`'s and `SelfAttention`'s construction order); weights before
/// biases.
const REGISTRATION: &[&str] = &["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"];
const LAYER_REGISTRATION: &[&str] = &[
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
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
];
const AFTER_LAYERS: &[&str] =
    &["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight", "output_layer.bias"];

/// A layer's byte ranges of one state of one stored key.
type LayerRanges = (u64, Vec<Chunk>);

/// One model parameter: its stored key, its layer within a stacked key, its element count.
#[derive(Debug)]
struct Param<'a> {
    key: &'a str,
    layer: Option<u64>,
    numel: u64,
    /// Where it registers: before the layers, in layer `n`, after them; then its index.
    order: (u8, u64, usize),
}

/// The optimizer state of every parameter, named as the `fully_reshardable` form names it.
pub(crate) fn per_parameter(ck: &Checkpoint, m: &Megatron, dcp: &DcpSource) -> Result<Vec<TensorInfo>> {
    let refuse = |key: Option<&str>, reason: String| Error::BadMegatron {
        path: ck.root.clone(),
        key: key.map(str::to_string),
        rank: None,
        reason,
    };
    if m.meta.tensor_parallel.is_some_and(|t| t > 1) || m.meta.pipeline_parallel.is_some_and(|p| p > 1) {
        return Err(refuse(
            None,
            "a `dp_reshardable` optimizer under tensor or pipeline parallelism is not derived yet".into(),
        ));
    }
    // The bucket tensors, by bucket index and state.
    let mut buckets: BTreeMap<u64, BTreeMap<&str, &crate::formats::dcp::DcpTensor>> = BTreeMap::new();
    for t in dcp.tensors.iter().filter(|t| t.key.starts_with("optimizer.distributed.")) {
        let Some(rest) = t.key.strip_prefix(BUCKET_PREFIX) else {
            return Err(refuse(
                Some(&t.key),
                "only one grad buffer of one data-parallel domain is derived yet (`dp_group_idx_0.gbuf_idx_0`)".into(),
            ));
        };
        let parsed = rest.split_once(".bucket_idx_").and_then(|(_, b)| b.split_once('.'));
        let Some((b, state)) = parsed.and_then(|(b, s)| Some((b.parse::<u64>().ok()?, s))) else {
            return Err(refuse(Some(&t.key), "not a bucket tensor (`...bucket_idx_K.STATE`)".into()));
        };
        if t.shape.len() != 1 {
            return Err(refuse(Some(&t.key), format!("a bucket tensor of shape {:?}, not 1-D", t.shape)));
        }
        buckets.entry(b).or_default().insert(state, t);
    }
    let sizes: Vec<u64> = buckets.values().map(|states| states.values().next().map_or(0, |t| t.shape[0])).collect();
    if buckets.keys().copied().ne(0..buckets.len() as u64) {
        return Err(refuse(None, "the bucket indices are not 0, 1, 2, ...".into()));
    }
    for states in buckets.values() {
        if let Some((key, t)) = states.iter().find(|(_, t)| t.shape != states.values().next().unwrap_or(t).shape) {
            return Err(refuse(
                Some(&t.key),
                format!("state `{key}` disagrees with the bucket's other states on its size"),
            ));
        }
    }

    if let Some((key, recorded)) = recorded_sizes(dcp) {
        if recorded != sizes {
            return Err(refuse(
                Some(&key),
                format!("records bucket sizes {recorded:?}, but the bucket tensors hold {sizes:?} elements"),
            ));
        }
    }

    // The model's parameters in registration order, and where the grad buffer puts each.
    let mut params = model_params(dcp).map_err(|(key, reason)| refuse(Some(&key), reason))?;
    params.sort_by_key(|p| p.order);
    let numels: Vec<u64> = params.iter().map(|p| p.numel).collect();
    let placed = place(&numels, &sizes).map_err(|m| match m {
        Misfit::Overfilled { param, bucket, size, end } => refuse(
            Some(params[param].key),
            format!(
                "bucket {bucket} holds {size} elements, but the derived layout fills it past that \
                 (to {end}) at this parameter: its layout is not megatron's default"
            ),
        ),
        Misfit::TooFewBuckets { param } => refuse(
            Some(params[param].key),
            format!("the derived layout needs more than the checkpoint's {} buckets", sizes.len()),
        ),
        Misfit::Unfilled { filled } => refuse(
            None,
            format!("the derived layout fills {filled} of the checkpoint's {} buckets and stops short", sizes.len()),
        ),
    })?;

    // Each stored key's state: its layers' ranges in layer order, the stacked tensor row-major.
    let mut ranges: BTreeMap<(&str, &str), Vec<LayerRanges>> = BTreeMap::new();
    for (i, (b, start)) in placed.into_iter().enumerate() {
        let p = &params[i];
        for (state, t) in &buckets[&b] {
            let chunks = flat_range(&t.boxes, start, start + p.numel, t.dtype.bits() / 8)
                .map_err(|r| refuse(Some(&t.key), r))?;
            ranges.entry((p.key, state)).or_default().push((p.layer.unwrap_or(0), chunks));
        }
    }
    let mut out = Vec::with_capacity(ranges.len());
    for t in dcp.tensors.iter().filter(|t| super::torch_dist::is_model_key(&t.key)) {
        for state in buckets.get(&0).map(|s| s.keys().copied().collect::<Vec<_>>()).unwrap_or_default() {
            let Some(mut parts) = ranges.remove(&(t.key.as_str(), state)) else { continue };
            parts.sort_by_key(|(layer, _)| *layer);
            let dtype = buckets[&0][state].dtype;
            let chunks = parts.into_iter().flat_map(|(_, c)| c).collect();
            out.push(TensorInfo::ranges(format!("{STATE_PREFIX}{state}.{}", t.key), dtype, t.shape.clone(), chunks));
        }
    }
    Ok(out)
}

/// The bucket sizes megatron recorded beside the buckets (`per_bucket_numel_unpadded`: per
/// grad buffer, a dict from its dtype pair to one size per bucket), for grad buffer 0, with the
/// key they were read from.
fn recorded_sizes(dcp: &DcpSource) -> Option<(String, Vec<u64>)> {
    let item = dcp.bytes.iter().find(|b| {
        b.key.split('/').next() == Some("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded")
    })?;
    // A one-item list (the sharded object) around the list of grad buffers.
    let mut v = &item.value;
    while let Leaf::List(items) = v {
        v = items.first()?;
    }
    let Leaf::Dict(by_dtype) = v else { return None };
    let (_, Leaf::List(sizes)) = by_dtype.first()? else { return None };
    let sizes: Option<Vec<u64>> =
        sizes.iter().map(|s| if let Leaf::Int(i) = s { u64::try_from(*i).ok() } else { None }).collect();
    Some((item.key.clone(), sizes?))
}

/// Why the parameters do not fit the checkpoint's buckets.
#[derive(Debug, PartialEq, Eq)]
enum Misfit {
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
/// padding).
fn place(numels: &[u64], sizes: &[u64]) -> std::result::Result<Vec<(u64, u64)>, Misfit> {
    let mut placed = vec![(0, 0); numels.len()];
    let (mut bucket, mut at) = (0usize, 0u64);
    for (param, &numel) in numels.iter().enumerate().rev() {
        let Some(&size) = sizes.get(bucket) else { return Err(Misfit::TooFewBuckets { param }) };
        let start = at.div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
        at = start + numel;
        if at > size {
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

/// Every model parameter of the checkpoint: a plain key is one, a stacked key one per layer.
fn model_params(dcp: &DcpSource) -> std::result::Result<Vec<Param<'_>>, (String, String)> {
    let mut out = Vec::new();
    for t in dcp.tensors.iter().filter(|t| super::torch_dist::is_model_key(&t.key)) {
        let unknown = || {
            (t.key.clone(), "its place in megatron's parameter registration order is not known; refusing to guess the bucket layout".to_string())
        };
        match names::stacked(&t.key) {
            Some(s) if s.block == "decoder.layers." => {
                let within = names::module_name(s.within);
                let index = LAYER_REGISTRATION.iter().position(|n| *n == within).ok_or_else(unknown)?;
                let (&layers, shape) = t.shape.split_first().ok_or_else(unknown)?;
                let numel = shape.iter().product();
                for layer in 0..layers {
                    out.push(Param { key: &t.key, layer: Some(layer), numel, order: (1, layer, index) });
                }
            }
            Some(_) => return Err(unknown()),
            None => {
                let (group, index) = match REGISTRATION.iter().position(|n| *n == t.key) {
                    Some(i) => (0, i),
                    None => (2, AFTER_LAYERS.iter().position(|n| *n == t.key).ok_or_else(unknown)?),
                };
                out.push(Param { key: &t.key, layer: None, numel: t.shape.iter().product(), order: (group, 0, index) });
            }
        }
    }
    Ok(out)
}

/// The byte ranges of elements `start..end` of a 1-D tensor made of `boxes`.
fn flat_range(boxes: &[TensorBox], start: u64, end: u64, elem: u64) -> std::result::Result<Vec<Chunk>, String> {
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
        let placed = place(&numels, &[768, 640, 320]);
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

    #[test]
    fn a_layout_that_does_not_fit_is_refused_not_guessed() {
        // A parameter megatron would not close the bucket on: it runs past the stored size.
        assert_eq!(place(&[64, 100], &[120]), Err(Misfit::Overfilled { param: 0, bucket: 0, size: 120, end: 192 }));
        assert_eq!(place(&[64, 64], &[64]), Err(Misfit::TooFewBuckets { param: 0 }));
        assert_eq!(place(&[64], &[64, 64]), Err(Misfit::Unfilled { filled: 1 }));
        assert_eq!(place(&[10, 20], &[74]), Ok(vec![(0, 64), (0, 0)]));
    }
}
