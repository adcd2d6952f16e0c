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
//! # Here
//!
//! Tensor and pipeline parallel 1 are read (each optimizer then has one bucket set per rank
//! of its parallel group); the state of each parameter comes out as the `fully_reshardable` form
//! names it (`optimizer.state.<state>.<stored key>`, the stored key's global shape, experts on
//! their expert axis). Anything else (tensor or pipeline parallelism, a chain of other than two,
//! expert tensor parallelism) is refused by name.

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
    let (tp, pp) = (m.meta.tensor_parallel.unwrap_or(1), m.meta.pipeline_parallel.unwrap_or(1));
    let etp = super::info::uint(super::info::arg(dcp, "expert_tensor_parallel_size")).unwrap_or(tp);
    if tp != 1 || pp != 1 || etp != 1 {
        return Err(refuse(
            None,
            format!(
                "the chained optimizer of a mixture-of-experts run is read at tensor, expert tensor and pipeline \
                 parallel 1 only (the run has {tp}, {etp} and {pp})"
            ),
        ));
    }
    let dense = buckets::domains_under(dcp, "chained_0.").map_err(|(k, r)| refuse(Some(&k), r))?;
    let experts = buckets::domains_under(dcp, "chained_1.").map_err(|(k, r)| refuse(Some(&k), r))?;
    if dense.len() != 1 {
        let reason = format!("the dense optimizer has {} bucket sets at tensor and pipeline parallel 1", dense.len());
        return Err(refuse(Some("chained_0.optimizer.distributed"), reason));
    }
    let (dense_params, expert_params) = slabs(dcp).map_err(|(k, r)| refuse(Some(&k), r))?;
    let ep = experts.len() as u64;
    let mut states = States::new();
    lay_out(&dense[0], &dense_params, "chained_0", &mut states).map_err(|(k, r)| refuse(k.as_deref(), r))?;
    // Each expert rank's local experts: the stored expert axis cut in `ep` equal runs.
    for (r, domain) in experts.iter().enumerate() {
        let mut local = Vec::new();
        for s in &expert_params {
            let count = s.tensor.shape.get(s.held.len()).copied().unwrap_or(0);
            if ep == 0 || !count.is_multiple_of(ep) {
                let reason = format!("{count} experts do not split over {ep} expert-parallel ranks");
                return Err(refuse(Some(&s.tensor.key), reason));
            }
            let per = count / ep;
            let first = r as u64 * per;
            local.extend((first..first + per).map(|e| {
                let mut held = s.held.clone();
                held.push(e);
                let numel = s.tensor.shape[held.len()..].iter().product();
                Slab { tensor: s.tensor, held, numel }
            }));
        }
        // Layer by layer, expert by expert, then by key (`linear_fc1` before `linear_fc2`).
        local.sort_by(|a, b| {
            (layer_of(a), a.held.last(), &a.tensor.key).cmp(&(layer_of(b), b.held.last(), &b.tensor.key))
        });
        let chain = format!("chained_1 rank {r}");
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
fn lay_out<'a>(
    domain: &Domain<'a>,
    params: &[Slab<'a>],
    what: &str,
    states: &mut States<'a>,
) -> std::result::Result<(), (Option<String>, String)> {
    let sizes: Vec<u64> = domain.values().map(|s| s.values().next().map_or(0, |t| t.shape[0])).collect();
    let numels: Vec<u64> = params.iter().map(|p| p.numel).collect();
    let placed = buckets::place(&numels, &sizes).map_err(|m| {
        (
            None,
            format!("the buckets of {what} ({sizes:?} elements) do not fit megatron's layout of its parameters: {m:?}"),
        )
    })?;
    for (p, (b, start)) in params.iter().zip(placed) {
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
                dense.push((order, Slab { tensor: t, held: vec![], numel: t.shape.iter().product() }));
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
                experts.push(Slab { tensor: t, held: l.iter().copied().collect(), numel: 0 });
            }
            continue;
        }
        let index =
            buckets::LAYER_REGISTRATION.iter().position(|n| *n == names::module_name(within)).ok_or_else(unknown)?;
        for l in layers {
            let number = l.or(names::per_layer(&t.key).map(|p| p.layer)).unwrap_or(0);
            let held: Vec<u64> = l.into_iter().collect();
            let numel = t.shape[held.len()..].iter().product();
            dense.push(((1, number, index), Slab { tensor: t, held, numel }));
        }
    }
    dense.sort_by_key(|(order, _)| *order);
    Ok((dense.into_iter().map(|(_, s)| s).collect(), experts))
}
