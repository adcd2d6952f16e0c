//! The chained distributed optimizer of a mixture-of-experts run, per parameter.
//!
//! # On disk
//!
//! Megatron-LM gives an MoE model two distributed optimizers and chains them
//! (`ChainedOptimizer`): the first over the dense parameters (everything but the experts: the
//! attention, the norms, the routers, the shared experts, the embeddings), the second over the
//! experts, which megatron's DDP keeps in grad buffers of their own (`expert_parallel_buffers`).
//! A `dp_reshardable` save stores each one's buckets as an unchained optimizer's
//! ([`super::buckets`]) under the prefix `chained_<i>.`:
//! `chained_0.optimizer.distributed.dp_group_idx_0.…` for the dense parameters, and
//! `chained_1.optimizer.distributed.dp_group_idx_<r>.…` for the experts of expert-parallel rank
//! `r` (its rank in the expert model-parallel group). Each buffer lays out its parameters as an
//! unchained one does: in the reverse of their registration order, each start on a multiple of
//! 64 elements, a bucket closing at its stored size. Expert-parallel rank `r` holds experts
//! `r·E/ep ..` of every MoE layer as its local experts `0 ..`, registered layer by layer, expert
//! by expert, `linear_fc1` before `linear_fc2`.
//!
//! Under pipeline parallelism each stage has buckets of its own over its stage's parameters
//! (megatron's placement of the layers, [`buckets::Stages`]): the dense optimizer's
//! `dp_group_idx_<stage>`, the experts' `dp_group_idx_<stage · ep + expert rank>`.
//!
//! # Here
//!
//! Tensor parallel 1 is read, at any pipeline and expert parallel size; the state of each
//! parameter comes out as the `fully_reshardable` form names it (`optimizer.state.<state>.<stored
//! key>`, the stored key's global shape, experts on their expert axis). Tensor or expert tensor
//! parallelism and a chain of other than two are refused by name: megatron's MoE layer does not
//! train under tensor parallelism without sequence parallelism, which the local spec's norms
//! refuse, so no such save could be written here to derive the layout from. Virtual pipeline
//! stages and tied embeddings under pipeline parallelism, which the dense optimizer reads
//! ([`buckets`]), are refused here too: no MoE save with them was written to check against.

use std::collections::BTreeMap;

use super::buckets::{self, Domain};
use super::info::Megatron;
use super::names;
use super::optimizer::STATE_PREFIX;
use crate::error::{Error, Result};
use crate::formats::dcp::{DcpSource, DcpTensor};
use crate::read::catalog::{Checkpoint, Chunk, TensorInfo};

/// One parameter's place: the stored tensor it is a slab of, where in it (a layer, an expert),
/// and its elements.
struct Slab<'a> {
    tensor: &'a DcpTensor,
    /// The indices of the stored tensor's leading axes (a stacked key's layer, an expert).
    held: Vec<u64>,
    numel: u64,
    /// Where it registers: before the layers (0), in layer `.1` (1), after them (2); which
    /// pipeline stage holds it follows.
    place: (u8, u64),
}

/// The router's saved buffers (`TopKRouter`: the expert bias of aux-loss-free balancing, quantile
/// balancing's bias): model tensors the optimizer holds no state for.
const ROUTER_BUFFERS: &[&str] = &["mlp.router.expert_bias", "mlp.router.qb_beta"];

/// Each stored key's byte ranges per state: by (stored key, state), the slabs (their leading
/// indices) and their ranges.
type States<'a> = BTreeMap<(&'a str, &'a str), Vec<(Vec<u64>, Vec<Chunk>)>>;

/// True when the checkpoint holds a chained optimizer's buckets.
pub(super) fn is_chained(dcp: &DcpSource) -> bool {
    dcp.tensors.iter().any(|t| t.key.starts_with("chained_") && t.key.contains(".optimizer.distributed."))
}

/// Every parameter's optimizer state, named as the `fully_reshardable` form names it.
pub(super) fn per_parameter(ck: &Checkpoint, m: &Megatron, dcp: &DcpSource) -> Result<Vec<TensorInfo>> {
    let refuse = |key: Option<&str>, reason: String| Error::BadMegatron {
        path: ck.root.clone(),
        key: key.map(str::to_string),
        rank: None,
        reason,
    };
    if let Some(t) = dcp
        .tensors
        .iter()
        .find(|t| t.key.starts_with("chained_") && !t.key.starts_with("chained_0.") && !t.key.starts_with("chained_1."))
    {
        return Err(refuse(Some(&t.key), "a chain of other than a dense and an expert optimizer is not read".into()));
    }
    let (tp, pp) = (m.meta.tensor_parallel.unwrap_or(1), m.meta.pipeline_parallel.unwrap_or(1).max(1));
    let etp = super::info::uint(super::info::arg(dcp, "expert_tensor_parallel_size")).unwrap_or(tp);
    if tp != 1 || etp != 1 {
        return Err(refuse(
            None,
            format!(
                "the chained optimizer of a mixture-of-experts run is read at tensor and expert tensor parallel 1 \
                 only (the run has {tp} and {etp}): megatron's MoE layer does not train under tensor parallelism \
                 without sequence parallelism on the CPU these layouts were derived on"
            ),
        ));
    }
    if pp > 1 && m.meta.tied_embeddings != Some(false) {
        let reason = "tied embeddings under pipeline parallelism in a mixture-of-experts run (the last stage's copy \
                      in the dense buckets) are not derived: no such save was written to check the layout against";
        return Err(refuse(None, reason.into()));
    }
    let dense = buckets::domains_under(dcp, "chained_0.").map_err(|(k, r)| refuse(Some(&k), r))?;
    let experts = buckets::domains_under(dcp, "chained_1.").map_err(|(k, r)| refuse(Some(&k), r))?;
    if dense.len() as u64 != pp || !(experts.len() as u64).is_multiple_of(pp) {
        let reason = format!(
            "the dense optimizer has {} bucket sets and the experts' {} for {pp} pipeline stage(s)",
            dense.len(),
            experts.len()
        );
        return Err(refuse(Some("chained_0.optimizer.distributed"), reason));
    }
    let stages = buckets::Stages::new(m, dcp, pp).map_err(|r| refuse(None, r))?;
    let (dense_params, expert_params) = slabs(dcp).map_err(|(k, r)| refuse(Some(&k), r))?;
    if stages.chunks() > 1 {
        let reason = "virtual pipeline stages in a mixture-of-experts run (a grad buffer per model chunk in each \
                      optimizer of the chain) are not derived: no such save was written to check the layout against";
        return Err(refuse(None, reason.into()));
    }
    let stage_of = |s: &Slab<'_>| stages.of_place(s.place.0, s.place.1).0;
    let mut states = States::new();
    // Each stage's dense optimizer over its own parameters (`dp_group_idx` = its stage).
    for (stage, domain) in dense.iter().enumerate() {
        let held: Vec<&Slab<'_>> = dense_params.iter().filter(|s| stage_of(s) == stage as u64).collect();
        let chain = format!("chained_0 stage {stage}");
        lay_out(domain, &held, &chain, &mut states).map_err(|(k, r)| refuse(k.as_deref(), r))?;
    }
    // Each expert rank's local experts of its stage's layers: the stored expert axis cut in
    // `ep` equal runs; `dp_group_idx` counts expert ranks within a stage, then stages (the
    // expert model-parallel group's ranks, pipeline outermost).
    let ep = experts.len() as u64 / pp;
    for (idx, domain) in experts.iter().enumerate() {
        let (stage, r) = (idx as u64 / ep, idx as u64 % ep);
        let mut local = Vec::new();
        for s in expert_params.iter().filter(|s| stage_of(s) == stage) {
            let count = s.tensor.shape.get(s.held.len()).copied().unwrap_or(0);
            if ep == 0 || !count.is_multiple_of(ep) {
                let reason = format!("{count} experts do not split over {ep} expert-parallel ranks");
                return Err(refuse(Some(&s.tensor.key), reason));
            }
            let per = count / ep;
            let first = r * per;
            local.extend((first..first + per).map(|e| {
                let mut held = s.held.clone();
                held.push(e);
                let numel = s.tensor.shape[held.len()..].iter().product();
                Slab { tensor: s.tensor, held, numel, place: s.place }
            }));
        }
        // Layer by layer, expert by expert, then by key (`linear_fc1` before `linear_fc2`).
        local.sort_by(|a, b| {
            (layer_of(a), a.held.last(), &a.tensor.key).cmp(&(layer_of(b), b.held.last(), &b.tensor.key))
        });
        let chain = format!("chained_1 stage {stage} expert rank {r}");
        lay_out(domain, &local, &chain, &mut states).map_err(|(k, r)| refuse(k.as_deref(), r))?;
    }
    let mut out = Vec::new();
    for t in dcp.tensors.iter().filter(|t| super::torch_dist::is_model_key(&t.key)) {
        for (state, dtype) in state_names(&dense[0]) {
            let Some(mut parts) = states.remove(&(t.key.as_str(), state)) else { continue };
            parts.sort_by(|a, b| a.0.cmp(&b.0));
            let chunks = parts.into_iter().flat_map(|(_, c)| c).collect();
            out.push(TensorInfo::ranges(format!("{STATE_PREFIX}{state}.{}", t.key), dtype, t.shape.clone(), chunks));
        }
    }
    if let Some(((key, _), _)) = states.into_iter().next() {
        return Err(refuse(Some(key), "the experts' optimizer holds a state the dense one does not".into()));
    }
    Ok(out)
}

/// The layer of a slab, for ordering: a stacked key's first index, or a per-layer key's number.
fn layer_of(s: &Slab<'_>) -> u64 {
    match names::per_layer(&s.tensor.key) {
        Some(p) => p.layer,
        None => s.held.first().copied().unwrap_or(0),
    }
}

/// The states an optimizer's buckets hold (`param`, `exp_avg`, `exp_avg_sq`) and their dtype.
fn state_names<'a>(domain: &Domain<'a>) -> Vec<(&'a str, crate::Dtype)> {
    domain.get(&0).map(|s| s.iter().map(|(k, t)| (*k, t.dtype)).collect()).unwrap_or_default()
}

/// Places `params` (registration order) in one rank's buckets and records each one's byte
/// ranges per state.
fn lay_out<'a, S: std::borrow::Borrow<Slab<'a>>>(
    domain: &Domain<'a>,
    params: &[S],
    what: &str,
    states: &mut States<'a>,
) -> std::result::Result<(), (Option<String>, String)> {
    let sizes: Vec<u64> = domain.values().map(|s| s.values().next().map_or(0, |t| t.shape[0])).collect();
    let numels: Vec<u64> = params.iter().map(|p| p.borrow().numel).collect();
    let placed = buckets::place(&numels, &[], &sizes).map_err(|m| {
        (
            None,
            format!("the buckets of {what} ({sizes:?} elements) do not fit megatron's layout of its parameters: {m:?}"),
        )
    })?;
    for (p, (b, start)) in params.iter().map(|p| p.borrow()).zip(placed) {
        for (&state, t) in domain.get(&b).into_iter().flatten() {
            let elem = t.dtype.bits() / 8;
            let chunks =
                buckets::flat_range(&t.boxes, start, start + p.numel, elem).map_err(|r| (Some(t.key.clone()), r))?;
            states.entry((p.tensor.key.as_str(), state)).or_default().push((p.held.clone(), chunks));
        }
    }
    Ok(())
}

/// The model's parameters: the dense ones in registration order, each a slab of its stored
/// tensor; and the stored expert tensors, each with its layer held where it is stacked.
fn slabs(dcp: &DcpSource) -> std::result::Result<(Vec<Slab<'_>>, Vec<Slab<'_>>), (String, String)> {
    let mut dense: Vec<((u8, u64, usize), Slab<'_>)> = Vec::new();
    let mut experts = Vec::new();
    for t in dcp.tensors.iter().filter(|t| super::torch_dist::is_model_key(&t.key)) {
        let unknown = || {
            (t.key.clone(), "its place in megatron's parameter registration order is not known; refusing to guess the bucket layout".to_string())
        };
        let (layers, within): (Vec<Option<u64>>, &str) = match (names::stacked(&t.key), names::per_layer(&t.key)) {
            (Some(s), _) if s.block == "decoder.layers." => {
                ((0..t.shape.first().copied().unwrap_or(0)).map(Some).collect(), s.within)
            }
            (None, Some(p)) if p.block == "decoder.layers." => (vec![None], p.within),
            (None, None) => {
                let order = match buckets::REGISTRATION.iter().position(|n| *n == t.key) {
                    Some(i) => (0, 0, i),
                    None => (2, 0, buckets::AFTER_LAYERS.iter().position(|n| *n == t.key).ok_or_else(unknown)?),
                };
                let place = (order.0, 0);
                dense.push((order, Slab { tensor: t, held: vec![], numel: t.shape.iter().product(), place }));
                continue;
            }
            _ => return Err(unknown()),
        };
        if ROUTER_BUFFERS.contains(&within) {
            // Updated by the router itself, not by the optimizer: no state to find.
            continue;
        }
        if names::expert_axis(within).is_some() {
            for l in &layers {
                let layer = l.or(names::per_layer(&t.key).map(|p| p.layer)).unwrap_or(0);
                experts.push(Slab { tensor: t, held: l.iter().copied().collect(), numel: 0, place: (1, layer) });
            }
            continue;
        }
        let index =
            buckets::LAYER_REGISTRATION.iter().position(|n| *n == names::module_name(within)).ok_or_else(unknown)?;
        for l in layers {
            let number = l.or(names::per_layer(&t.key).map(|p| p.layer)).unwrap_or(0);
            let held: Vec<u64> = l.into_iter().collect();
            let numel = t.shape[held.len()..].iter().product();
            dense.push(((1, number, index), Slab { tensor: t, held, numel, place: (1, number) }));
        }
    }
    dense.sort_by_key(|(order, _)| *order);
    Ok((dense.into_iter().map(|(_, s)| s).collect(), experts))
}
