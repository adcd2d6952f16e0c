//! A `torch_dist` folder: read by the DCP reader into its stored tensors, then seen through a
//! model map ([`crate::map::model`]): the identity (as stored), or the one-rank model
//! ([`super::names`]).

use std::path::PathBuf;
use std::sync::Arc;

use super::info::{self, Megatron};
use super::names;
use super::Location;
use crate::error::{Error, Result};
use crate::formats::dcp::{self, DcpSource, DcpTensor};
use crate::map::model::{ModelMap, Piece, Target};
use crate::read::catalog::{Checkpoint, Format, Parts, Scan, TensorData, TensorInfo};

/// The catalog of the `torch_dist` checkpoint at `loc`, named by `root`: its stored tensors,
/// seen through a model map (the identity with `as_stored`, else the one-rank model).
pub(super) fn catalog(root: PathBuf, loc: Location, as_stored: bool) -> Result<Scan> {
    let dcp = dcp::read_folder_with(&loc.dir, super::DCP_CLASSES)?;
    let meta = info::describe(&loc, &dcp);
    let sources: Vec<TensorInfo> = dcp.tensors.iter().map(self::as_stored).collect();
    let map = if as_stored { ModelMap::identity("stored view", &sources) } else { one_rank(&dcp, &loc)? };
    let tensors = map.apply(&root, &sources)?;
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

/// A stored tensor under its stored key and global shape, as `dcp_to_torch_save` gives it.
pub(super) fn as_stored(t: &DcpTensor) -> TensorInfo {
    TensorInfo {
        name: t.key.clone(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        stored: t.dtype,
        data: TensorData::Boxes(t.boxes.clone()),
    }
}

/// True for the keys of the model's tensors: not the optimizer's state, and not a tensor kept
/// inside a non-tensor value (`rng_state/shard_…`; megatron's own keys have no `/`).
pub(super) fn is_model_key(key: &str) -> bool {
    !key.starts_with("optimizer.") && !key.contains('/')
}

/// The model as megatron holds it on one rank, as a map of the stored tensors: every stacked
/// key cut into its layers, named by their global index, norms under their module names; the
/// optimizer's tensors are left out, as is a stacked key of no layers.
fn one_rank(dcp: &DcpSource, loc: &Location) -> Result<ModelMap> {
    let mut map = ModelMap::new("one-rank model");
    // The stacked keys, laid out layer by layer where the first of them stood, as the
    // model's `state_dict()` orders them.
    let mut stacked = Vec::new();
    let mut layers_at = None;
    for t in &dcp.tensors {
        if !is_model_key(&t.key) {
            map.leave_out(t.key.clone());
            continue;
        }
        let bad = |reason: String| Error::BadMegatron {
            path: loc.dir.join(dcp::METADATA_NAME),
            key: Some(t.key.clone()),
            rank: None,
            reason,
        };
        let Some(s) = names::stacked(&t.key) else {
            map.push(Target::renamed(t.key.clone(), t.key.clone(), &t.shape));
            continue;
        };
        if s.within.contains("experts.") {
            return Err(bad("mixture-of-experts layers (a second stacked axis) are not read yet".into()));
        }
        let Some(&count) = t.shape.first() else {
            return Err(bad("a stacked layer key holds a 0-d tensor, with no layer axis".into()));
        };
        if count == 0 {
            // No layer to cut out, no element to lose.
            map.leave_out(t.key.clone());
        }
        layers_at.get_or_insert(map.len());
        stacked.push((s, t));
    }
    let layers = stacked.iter().map(|(_, t)| t.shape[0]).max().unwrap_or(0);
    let mut per_layer = Vec::new();
    for layer in 0..layers {
        for (s, t) in stacked.iter().filter(|(_, t)| layer < t.shape[0]) {
            let piece = Piece::index(t.key.clone(), &t.shape, 0, layer);
            per_layer.push(Target::new(names::layer_name(*s, layer), t.shape[1..].to_vec(), vec![piece]));
        }
    }
    let at = layers_at.unwrap_or(map.len());
    map.splice(at, per_layer);
    Ok(map)
}
