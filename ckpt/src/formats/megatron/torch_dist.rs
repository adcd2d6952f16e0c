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

/// True for the keys of the model's tensors: not the optimizer's state (`optimizer.…`, and a
/// chained optimizer's `chained_<i>.optimizer.…`, which an MoE run saves: one optimizer over the
/// dense parameters, one over the experts), and not a tensor kept inside a non-tensor value
/// (`rng_state/shard_…`; megatron's own keys have no `/`).
pub(super) fn is_model_key(key: &str) -> bool {
    !is_optimizer_key(key) && !key.contains('/')
}

/// True for the keys of the optimizer's state, chained or not.
pub(super) fn is_optimizer_key(key: &str) -> bool {
    let unchained = match key.strip_prefix("chained_").and_then(|r| r.split_once('.')) {
        Some((i, rest)) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => rest,
        _ => key,
    };
    unchained.starts_with("optimizer.")
}

/// One stored key of the decoder's layers: its block, where its layer axis is (a stacked key's
/// leading axis) or which layer it is (a per-layer key), the key within a layer, and where the
/// expert axis is when it holds `SequentialMLP`'s experts.
struct LayerKey<'a> {
    tensor: &'a DcpTensor,
    block: &'a str,
    layer: Layer,
    /// The experts' module prefix and the key within one expert.
    experts: Option<(&'a str, &'a str)>,
    within: &'a str,
}

#[derive(Clone, Copy)]
enum Layer {
    /// Axis 0 holds the layers.
    Stacked,
    /// A per-layer key of this layer.
    One(u64),
}

impl LayerKey<'_> {
    /// The axes before the tensor as one layer (one expert) holds it.
    fn lead(&self) -> usize {
        usize::from(matches!(self.layer, Layer::Stacked)) + usize::from(self.experts.is_some())
    }

    /// The layers it holds.
    fn layers(&self) -> std::ops::Range<u64> {
        match self.layer {
            Layer::Stacked => 0..self.tensor.shape.first().copied().unwrap_or(0),
            Layer::One(n) => n..n + 1,
        }
    }

    /// The experts it holds (0 for a key without an expert axis).
    fn experts(&self) -> u64 {
        match self.experts {
            Some(_) => self.tensor.shape.get(self.lead() - 1).copied().unwrap_or(0),
            None => 0,
        }
    }

    /// The one-rank model's tensors of layer `layer`: the key's slice of it, or one per expert.
    fn targets(&self, layer: u64) -> Vec<Target> {
        let t = self.tensor;
        let shape = t.shape[self.lead()..].to_vec();
        let mut held = Vec::new();
        if matches!(self.layer, Layer::Stacked) {
            held.push((0, layer));
        }
        match self.experts {
            None => {
                let name = names::layer_name(names::Stacked { block: self.block, within: self.within }, layer);
                let piece = match self.layer {
                    Layer::Stacked => Piece::index(t.key.clone(), &t.shape, 0, layer),
                    Layer::One(_) => Piece::whole(t.key.clone(), &t.shape),
                };
                vec![Target::new(name, shape, vec![piece])]
            }
            Some((prefix, rest)) => (0..self.experts())
                .map(|e| {
                    let mut held = held.clone();
                    held.push((held.len(), e));
                    let name = format!("{}{layer}.{}", self.block, names::expert_name(prefix, e, rest));
                    Target::new(name, shape.clone(), vec![Piece::indices(t.key.clone(), &t.shape, &held)])
                })
                .collect(),
        }
    }
}

/// The model as megatron holds it on one rank, as a map of the stored tensors: every stacked
/// key cut into its layers, named by their global index, per-layer keys under their module
/// names, `SequentialMLP`'s experts cut out of their expert axis
/// (`decoder.layers.mlp.experts.experts.linear_fc1.weight` `[L, E, 2f, h]` →
/// `decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight`), fused norms under their
/// module names; the optimizer's tensors are left out, as is a stacked key of no layers. Experts
/// stored any other way (grouped GEMM's fused weights) are refused by name, as is a router whose
/// expert count is not its layer's.
fn one_rank(dcp: &DcpSource, loc: &Location) -> Result<ModelMap> {
    let mut map = ModelMap::new("one-rank model");
    let mut keys = Vec::new();
    let mut layers_at = None;
    let num_experts = info::uint(info::arg(dcp, "num_experts"));
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
        let (block, layer, within) = match (names::stacked(&t.key), names::per_layer(&t.key)) {
            (Some(s), _) => (s.block, Layer::Stacked, s.within),
            (None, Some(p)) => (p.block, Layer::One(p.layer), p.within),
            (None, None) => {
                map.push(Target::renamed(t.key.clone(), t.key.clone(), &t.shape));
                continue;
            }
        };
        let experts = names::expert_axis(within);
        if experts.is_none() && within.contains("experts.") && !within.contains("shared_experts.") {
            return Err(bad("experts stored other than as `SequentialMLP`'s `experts.experts.` (grouped GEMM's fused weights) are not read yet".into()));
        }
        let key = LayerKey { tensor: t, block, layer, experts, within };
        if t.shape.len() < key.lead() {
            let axes = if experts.is_some() { "a layer and an expert axis" } else { "a layer axis" };
            return Err(bad(format!("a {}-d tensor has no room for {axes}", t.shape.len())));
        }
        if let (Some((_, _)), Some(n)) = (experts, num_experts) {
            if key.experts() != n {
                return Err(bad(format!(
                    "the expert axis holds {} experts, but args.num_experts is {n}",
                    key.experts()
                )));
            }
        }
        if key.layers().is_empty() || (experts.is_some() && key.experts() == 0) {
            // No layer (no expert) to cut out, no element to lose.
            map.leave_out(t.key.clone());
        }
        layers_at.get_or_insert(map.len());
        keys.push(key);
    }
    check_routers(&keys, loc)?;
    let layers = keys.iter().map(|k| k.layers().end).max().unwrap_or(0);
    let mut per_layer = Vec::new();
    for layer in 0..layers {
        let (plain, experts): (Vec<_>, Vec<_>) =
            keys.iter().filter(|k| k.layers().contains(&layer)).partition(|k| k.experts.is_none());
        for k in plain {
            per_layer.extend(k.targets(layer));
        }
        // The experts one after the other, as the module tree holds them.
        let mut by_expert: Vec<Target> = experts.iter().flat_map(|k| k.targets(layer)).collect();
        by_expert.sort_by_key(|t| expert_of(&t.name));
        per_layer.extend(by_expert);
    }
    let at = layers_at.unwrap_or(map.len());
    map.splice(at, per_layer);
    Ok(map)
}

/// The expert number in a one-rank expert name (`…local_experts.<e>.…`), for ordering.
fn expert_of(name: &str) -> u64 {
    name.split_once("local_experts.").and_then(|(_, r)| r.split('.').next()).and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// Each layer's router scores as many experts as the layer's expert axis holds (`router.weight`
/// `[E, h]`, `router.expert_bias` `[E]`): a router of another count would route tokens to experts
/// that are not there, or never to some that are.
fn check_routers(keys: &[LayerKey<'_>], loc: &Location) -> Result<()> {
    for router in keys.iter().filter(|k| k.experts.is_none() && k.within.contains("router.")) {
        let Some(&count) = router.tensor.shape.get(router.lead()) else { continue };
        for layer in router.layers() {
            let held = keys
                .iter()
                .filter(|k| k.experts.is_some() && k.block == router.block && k.layers().contains(&layer))
                .map(LayerKey::experts)
                .find(|&e| e != count);
            if let Some(experts) = held {
                let reason = format!("layer {layer}'s router scores {count} experts, but the layer holds {experts}");
                return Err(Error::BadMegatron {
                    path: loc.dir.join(dcp::METADATA_NAME),
                    key: Some(router.tensor.key.clone()),
                    rank: None,
                    reason,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    fn tensor(key: &str, shape: &[u64]) -> DcpTensor {
        DcpTensor { key: key.into(), path: vec![], dtype: Dtype::F32, shape: shape.to_vec(), boxes: vec![] }
    }

    fn layer_key(t: &DcpTensor) -> LayerKey<'_> {
        let (block, layer, within) = match (names::stacked(&t.key), names::per_layer(&t.key)) {
            (Some(s), _) => (s.block, Layer::Stacked, s.within),
            (None, Some(p)) => (p.block, Layer::One(p.layer), p.within),
            (None, None) => unreachable!("a layer key"),
        };
        LayerKey { tensor: t, block, layer, experts: names::expert_axis(within), within }
    }

    fn routers(tensors: &[DcpTensor]) -> std::result::Result<(), String> {
        let keys: Vec<LayerKey<'_>> = tensors.iter().map(layer_key).collect();
        let loc = Location { dir: "iter".into(), tracker: None, iteration: None };
        check_routers(&keys, &loc).map_err(|e| e.to_string())
    }

    #[test]
    fn a_router_scores_as_many_experts_as_its_layer_holds() {
        let fc1 = tensor("decoder.layers.mlp.experts.experts.linear_fc1.weight", &[2, 4, 32, 16]);
        assert_eq!(routers(&[fc1, tensor("decoder.layers.mlp.router.weight", &[2, 4, 16])]), Ok(()));
        let fc1 = tensor("decoder.layers.mlp.experts.experts.linear_fc1.weight", &[2, 4, 32, 16]);
        let err = routers(&[fc1, tensor("decoder.layers.mlp.router.weight", &[2, 3, 16])])
            .expect_err("a router of 3 experts");
        assert_eq!(
            err,
            "iter/.metadata: `decoder.layers.mlp.router.weight`: layer 0's router scores 3 experts, but the layer holds 4"
        );
        // Per-layer keys: each layer's router against that layer's experts.
        let fc2 = tensor("decoder.layers.2.mlp.experts.experts.linear_fc2.weight", &[8, 16, 16]);
        let bias = tensor("decoder.layers.2.mlp.router.expert_bias", &[6]);
        let err = routers(&[fc2, bias]).expect_err("a router of 3 experts");
        assert!(err.ends_with("layer 2's router scores 6 experts, but the layer holds 8"), "{err}");
    }
}
