//! What a Megatron checkpoint says about its run: parallel sizes, iteration, the model's
//! settings (from the saved `args` where Megatron-LM saved them, else from the tensors), and
//! the optimizer's form.

use super::{names, Location};
use crate::formats::dcp::DcpSource;
use crate::read::value::Leaf;
use crate::report::describe::Description;

/// A Megatron checkpoint as the catalog's detail: the summary, and what the reader kept.
#[derive(Debug)]
pub(crate) struct Megatron {
    pub meta: MegatronInfo,
    /// The DCP folder of a `torch_dist` checkpoint.
    pub dcp: Option<DcpSource>,
    /// The rank files of a legacy save.
    pub legacy: Option<super::legacy::Ranks>,
}

/// A Megatron-Core checkpoint's run and model, as far as the checkpoint tells them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MegatronInfo {
    /// `torch_dist` or `legacy`.
    pub layout: &'static str,
    /// The iteration, from the saved state or the folder's name.
    pub iteration: Option<u64>,
    /// Tensor parallel size.
    pub tensor_parallel: Option<u64>,
    /// Pipeline parallel size.
    pub pipeline_parallel: Option<u64>,
    /// Transformer layers (the stacked axis of a `torch_dist` save).
    pub num_layers: Option<u64>,
    /// Hidden size.
    pub hidden_size: Option<u64>,
    /// The MLP's hidden size.
    pub ffn_hidden_size: Option<u64>,
    /// Attention heads.
    pub num_attention_heads: Option<u64>,
    /// Key/value groups (grouped-query attention); the number of heads without it.
    pub num_query_groups: Option<u64>,
    /// Gated linear units (SwiGLU) in the MLP.
    pub swiglu: Option<bool>,
    /// The output layer shares the word embeddings.
    pub tied_embeddings: Option<bool>,
    /// The distributed optimizer's form (`dp_reshardable`, `fully_reshardable`), when the
    /// checkpoint holds an optimizer.
    pub optimizer: Option<String>,
    /// Experts per mixture-of-experts layer (`args.num_experts`); absent for a dense model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_experts: Option<u64>,
    /// Experts each token is routed to (`args.moe_router_topk`), for a mixture-of-experts model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_router_topk: Option<u64>,
    /// Expert parallel size, for a mixture-of-experts model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_parallel: Option<u64>,
}

/// The value at `path` (dict keys) in `leaf`; a record is looked into through its `state`.
pub(crate) fn lookup<'a>(leaf: &'a Leaf, path: &[&str]) -> Option<&'a Leaf> {
    let Some((first, rest)) = path.split_first() else { return Some(leaf) };
    let Leaf::Dict(items) = leaf else { return None };
    let get = |k: &str| items.iter().find(|(key, _)| key == k).map(|(_, v)| v);
    match get(first) {
        Some(v) => lookup(v, rest),
        // A record (`argparse.Namespace`): its attributes are its `BUILD` state.
        None => get("state").and_then(|s| lookup(s, path)),
    }
}

/// A whole, non-negative number of the saved state (megatron saves some as floats).
pub(crate) fn uint(leaf: Option<&Leaf>) -> Option<u64> {
    match leaf? {
        Leaf::Int(i) => u64::try_from(*i).ok(),
        Leaf::Float(f) if f.fract() == 0.0 && *f >= 0.0 => Some(*f as u64),
        _ => None,
    }
}

fn flag(leaf: Option<&Leaf>) -> Option<bool> {
    match leaf? {
        Leaf::Bool(b) => Some(*b),
        _ => None,
    }
}

/// The saved dict megatron puts in `common_state` (a one-item list around it in some
/// versions).
fn common(dcp: &DcpSource) -> Option<&Leaf> {
    let v = &dcp.bytes.iter().find(|b| b.key.split('/').next() == Some("common_state"))?.value;
    Some(saved_dict(v))
}

/// The saved dict of a `common_state` value: the value, or the one item of a one-item list.
pub(crate) fn saved_dict(v: &Leaf) -> &Leaf {
    match v {
        Leaf::List(items) => match items.as_slice() {
            [only] => only,
            _ => v,
        },
        other => other,
    }
}

/// What a `torch_dist` checkpoint's saved dict (`common_state`) says of the run: its `args`,
/// its iteration, and its distributed optimizer's form.
pub(crate) fn from_saved(common: Option<&Leaf>) -> MegatronInfo {
    let mut m = from_args("torch_dist", common.and_then(|c| lookup(c, &["args"])));
    m.iteration = uint(common.and_then(|c| lookup(c, &["iteration"])));
    m.optimizer = common.and_then(|c| lookup(c, &["optimizer", "param_state_sharding_type"])).and_then(|v| {
        if let Leaf::Str(s) = v {
            Some(s.clone())
        } else {
            None
        }
    });
    m
}

/// What Megatron-LM's saved `args` (an `argparse.Namespace` record) say of the run and model.
pub(crate) fn from_args(layout: &'static str, args: Option<&Leaf>) -> MegatronInfo {
    let arg = |name: &str| args.and_then(|a| lookup(a, &[name]));
    let experts = uint(arg("num_experts")).filter(|&n| n > 0);
    MegatronInfo {
        layout,
        iteration: None,
        tensor_parallel: uint(arg("tensor_model_parallel_size")),
        pipeline_parallel: uint(arg("pipeline_model_parallel_size")),
        num_layers: uint(arg("num_layers")),
        hidden_size: uint(arg("hidden_size")),
        ffn_hidden_size: uint(arg("ffn_hidden_size")),
        num_attention_heads: uint(arg("num_attention_heads")),
        // Megatron-LM keeps its default `num_query_groups` (1) unless grouped-query attention
        // is on; without it every head is its own group.
        num_query_groups: match flag(arg("group_query_attention")) {
            Some(false) => uint(arg("num_attention_heads")),
            _ => uint(arg("num_query_groups")).or(uint(arg("num_attention_heads"))),
        },
        swiglu: flag(arg("swiglu")),
        tied_embeddings: flag(arg("untie_embeddings_and_output_weights")).map(|untied| !untied),
        optimizer: None,
        // Megatron-LM keeps `moe_router_topk` (2) and the expert parallel size (1) in the args
        // of dense runs too: they say something only where there are experts.
        num_experts: experts,
        moe_router_topk: experts.and(uint(arg("moe_router_topk"))),
        expert_parallel: experts.and(uint(arg("expert_model_parallel_size"))),
    }
}

/// The saved `args` of a `torch_dist` checkpoint, where Megatron-LM saved them, and the rank
/// file that holds them.
pub(crate) fn saved_args(dcp: &DcpSource) -> Option<(&std::path::Path, &Leaf)> {
    let item = dcp.bytes.iter().find(|b| b.key.split('/').next() == Some("common_state"))?;
    let file = dcp.files.get(item.chunk.file)?;
    Some((file.path.as_path(), lookup(saved_dict(&item.value), &["args"])?))
}

/// The saved `args.NAME` of a `torch_dist` checkpoint, where Megatron-LM saved them.
pub(crate) fn arg<'a>(dcp: &'a DcpSource, name: &str) -> Option<&'a Leaf> {
    lookup(common(dcp)?, &["args", name])
}

/// The summary of a `torch_dist` checkpoint: the saved `args` where Megatron-LM saved them,
/// the rest from the tensors.
pub(crate) fn describe(loc: &Location, dcp: &DcpSource) -> MegatronInfo {
    let key_shape = |key: &str| dcp.tensors.iter().find(|t| t.key == key).map(|t| t.shape.clone());
    let stacked_layers = dcp
        .tensors
        .iter()
        .find(|t| names::stacked(&t.key).is_some_and(|s| s.block == "decoder.layers."))
        .and_then(|t| t.shape.first().copied());
    let mut m = from_saved(common(dcp));
    m.optimizer = m.optimizer.or_else(|| {
        dcp.tensors.iter().any(|t| t.key.starts_with("optimizer.state.")).then(|| "fully_reshardable".to_string())
    });
    // A chained optimizer (a mixture-of-experts run's) records no form in `common_state`; its
    // flat buckets are the `dp_reshardable` form.
    m.optimizer = m.optimizer.or_else(|| super::chained::is_chained(dcp).then(|| "dp_reshardable".to_string()));
    m.iteration = m.iteration.or(loc.iteration);
    m.num_layers = m.num_layers.or(stacked_layers);
    m.hidden_size =
        m.hidden_size.or_else(|| key_shape("embedding.word_embeddings.weight").and_then(|s| s.get(1).copied()));
    m.tied_embeddings = m.tied_embeddings.or_else(|| Some(key_shape("output_layer.weight").is_none()));
    m
}

/// What `inspect` shows of a Megatron checkpoint: its run and model as two facts (the
/// settings it does not record left out), and the whole [`MegatronInfo`] as the inspect
/// document's `megatron`.
pub(crate) fn description(m: &MegatronInfo) -> Description {
    let n = |label: &str, v: Option<u64>| v.map(|v| format!("{label} {v}"));
    let b = |label: &str, v: Option<bool>| v.map(|v| format!("{label} {}", if v { "yes" } else { "no" }));
    let run: Vec<String> = [
        n("iteration", m.iteration),
        n("tensor parallel", m.tensor_parallel),
        n("pipeline parallel", m.pipeline_parallel),
        n("expert parallel", m.expert_parallel),
        m.optimizer.as_ref().map(|o| format!("optimizer {}", crate::escape_controls(o))),
    ]
    .into_iter()
    .flatten()
    .collect();
    let model: Vec<String> = [
        n("layers", m.num_layers),
        n("hidden", m.hidden_size),
        n("ffn", m.ffn_hidden_size),
        n("heads", m.num_attention_heads),
        n("query groups", m.num_query_groups),
        b("swiglu", m.swiglu),
        b("tied embeddings", m.tied_embeddings),
        n("experts", m.num_experts),
        n("top-k", m.moe_router_topk),
    ]
    .into_iter()
    .flatten()
    .collect();
    let run = if run.is_empty() { String::new() } else { format!(" ({})", run.join(", ")) };
    Description {
        title: format!("a Megatron {} checkpoint{run}", m.layout),
        facts: vec![("megatron", format!("{}{run}", m.layout)), ("model", model.join(", "))],
        json: vec![("megatron", serde_json::json!(m))],
        ..Description::default()
    }
}
