//! A `torch_dist` folder: read by the DCP reader, then seen either as stored or as the one-rank
//! model ([`super::names`]).

use std::path::PathBuf;
use std::sync::Arc;

use super::info::{self, Megatron};
use super::names;
use super::Location;
use crate::error::{Error, Result};
use crate::formats::dcp::{self, DcpSource, DcpTensor};
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, TensorBox, TensorData, TensorInfo};

/// The catalog of the `torch_dist` checkpoint at `loc`, named by `root`.
pub(super) fn catalog(root: PathBuf, loc: Location, as_stored: bool) -> Result<Scan> {
    let dcp = dcp::read_folder_with(&loc.dir, super::DCP_CLASSES)?;
    let meta = info::describe(&loc, &dcp);
    let tensors = if as_stored { stored(&dcp) } else { one_rank(&dcp, &loc)? };
    let files = dcp::save_file_sources(&dcp, &loc.dir);
    let mut parts = Parts::new(Format::MegatronTorchDist, root, files, tensors);
    // The stored view carries every non-tensor value as DCP's own view does; the model has none.
    if as_stored {
        parts.values = dcp.bytes.iter().map(|b| (b.key.clone(), b.value.clone())).collect();
    }
    parts.world_size = Some(dcp.files.len() as u64);
    parts.members = crate::read::io::regular_files(&loc.dir)?;
    parts.members.extend(loc.tracker.clone());
    parts.detail = Some(Arc::new(Megatron { meta, dcp: Some(dcp), legacy: None }));
    Ok(Scan::clean(Checkpoint::new(parts)?))
}

/// Every tensor under its stored key and global shape, as `dcp_to_torch_save` gives them.
fn stored(dcp: &DcpSource) -> Vec<TensorInfo> {
    dcp.tensors.iter().map(as_stored).collect()
}

/// A stored tensor under its stored key and global shape.
pub(super) fn as_stored(t: &DcpTensor) -> TensorInfo {
    TensorInfo { name: t.key.clone(), dtype: t.dtype, shape: t.shape.clone(), stored: t.dtype, data: data(&t.boxes) }
}

/// True for the keys of the model's tensors: not the optimizer's state, and not a tensor kept
/// inside a non-tensor value (`rng_state/shard_…`; megatron's own keys have no `/`).
pub(super) fn is_model_key(key: &str) -> bool {
    !key.starts_with("optimizer.") && !key.contains('/')
}

/// The model as megatron holds it on one rank: every stacked key cut into its layers, named by
/// their global index, norms under their module names; the optimizer's tensors are not the
/// model's.
fn one_rank(dcp: &DcpSource, loc: &Location) -> Result<Vec<TensorInfo>> {
    let mut out = Vec::new();
    // The stacked keys, laid out layer by layer where the first of them stood, as the
    // model's `state_dict()` orders them.
    let mut stacked = Vec::new();
    let mut layers_at = None;
    for t in dcp.tensors.iter().filter(|t| is_model_key(&t.key)) {
        let bad = |reason: String| Error::BadMegatron {
            path: loc.dir.join(dcp::METADATA_NAME),
            key: Some(t.key.clone()),
            rank: None,
            reason,
        };
        let Some(s) = names::stacked(&t.key) else {
            out.push(as_stored(t));
            continue;
        };
        if s.within.contains("experts.") {
            return Err(bad("mixture-of-experts layers (a second stacked axis) are not read yet".into()));
        }
        if t.shape.is_empty() {
            return Err(bad("a stacked layer key holds a 0-d tensor, with no layer axis".into()));
        }
        layers_at.get_or_insert(out.len());
        stacked.push((s, t));
    }
    let layers = stacked.iter().map(|(_, t)| t.shape[0]).max().unwrap_or(0);
    let mut per_layer = Vec::new();
    for layer in 0..layers {
        for (s, t) in stacked.iter().filter(|(_, t)| layer < t.shape[0]) {
            let boxes: Vec<TensorBox> = t.boxes.iter().filter_map(|b| layer_box(b, layer)).collect();
            let (name, shape) = (names::layer_name(*s, layer), t.shape[1..].to_vec());
            per_layer.push(TensorInfo { name, dtype: t.dtype, shape, stored: t.dtype, data: data(&boxes) });
        }
    }
    let at = layers_at.unwrap_or(out.len());
    out.splice(at..at, per_layer);
    Ok(out)
}

fn data(boxes: &[TensorBox]) -> TensorData {
    TensorData::Boxes(boxes.to_vec())
}

/// The part of box `b` of a stacked tensor that is layer `layer`, as a box of that layer's
/// tensor: the same storage, one layer's stride further in, without the layer axis.
pub(super) fn layer_box(b: &TensorBox, layer: u64) -> Option<TensorBox> {
    let (&first, offsets) = b.region.offsets.split_first()?;
    let (&count, sizes) = b.region.sizes.split_first()?;
    let (&stride, strides) = b.strides.split_first()?;
    let within = layer.checked_sub(first).filter(|&i| i < count)?;
    Some(TensorBox {
        region: fsdp_state::Region::new(offsets.to_vec(), sizes.to_vec()),
        file: b.file,
        base: b.base,
        len: b.len,
        offset: b.offset + within * stride,
        strides: strides.to_vec(),
    })
}
