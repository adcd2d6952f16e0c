//! Megatron's checkpoint keys and the names of the model megatron holds on one rank.
//!
//! A `torch_dist` checkpoint stores a block of alike layers as one tensor per key with the layer
//! number taken out and a leading layer axis put in (`decoder.layers.mlp.linear_fc2.weight` of
//! shape `[L, h, f]`); the model's `state_dict()` names each layer
//! (`decoder.layers.3.mlp.linear_fc2.weight` of shape `[h, f]`). The layer specs map two norm
//! names to TransformerEngine's, so that checkpoints of the local and the TransformerEngine
//! spec are interchangeable (megatron's `sharded_state_dict_keys_map`): the checkpoint's
//! `self_attention.linear_qkv.layer_norm_weight` is the local model's
//! `input_layernorm.weight`, `mlp.linear_fc1.layer_norm_*` its `pre_mlp_layernorm.*`.

/// TransformerEngine's prefixes of the norms fused into the next linear, and the module
/// prefixes megatron's local spec gives them.
const FUSED_NORMS: &[(&str, &str)] = &[
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
];

/// The stored key within a layer of a local spec's module name (the inverse of [`module_name`]):
/// what a legacy save's module names are called in a `torch_dist` save.
pub(crate) fn stored_within(module: &str) -> String {
    for (te, local) in FUSED_NORMS {
        if let Some(rest) = module.strip_prefix(local) {
            return format!("{te}{rest}");
        }
    }
    module.to_string()
}

/// A checkpoint key split at its block of stacked layers: `decoder.layers.` and the rest of
/// the key within a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stacked<'a> {
    /// The block's prefix, ending in `layers.`.
    pub block: &'a str,
    /// The key within one layer, as stored (TransformerEngine's norm names).
    pub within: &'a str,
}

/// Where `key` is a stacked layer key: a `layers` segment followed by a name rather than a
/// layer number. `decoder.layers.0.x` (a model of unlike layers numbers them) is not stacked.
pub(crate) fn stacked(key: &str) -> Option<Stacked<'_>> {
    let mut at = 0;
    for seg in key.split('.') {
        let end = at + seg.len();
        if seg == "layers" {
            let rest = key.get(end + 1..).filter(|r| !r.is_empty())?;
            let next = rest.split('.').next().unwrap_or_default();
            if next.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            return Some(Stacked { block: &key[..end + 1], within: rest });
        }
        at = end + 1;
    }
    None
}

/// A per-layer key of a model of unlike layers: `decoder.layers.3.mlp.router.weight` (megatron
/// numbers each layer by its global index when the layers differ, as a dense first layer or
/// `moe_layer_freq` makes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PerLayer<'a> {
    /// The block's prefix, ending in `layers.`.
    pub block: &'a str,
    /// The global layer number.
    pub layer: u64,
    /// The key within the layer, as stored (TransformerEngine's norm names).
    pub within: &'a str,
}

/// Where `key` is a per-layer key: a `layers` segment, a layer number, and a name within it.
pub(crate) fn per_layer(key: &str) -> Option<PerLayer<'_>> {
    let mut at = 0;
    for seg in key.split('.') {
        let end = at + seg.len();
        if seg == "layers" {
            let rest = key.get(end + 1..)?;
            let (number, within) = rest.split_once('.')?;
            if within.is_empty() || number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let layer = number.parse().ok()?;
            return Some(PerLayer { block: &key[..end + 1], layer, within });
        }
        at = end + 1;
    }
    None
}

/// What megatron's `SequentialMLP` stores stacked on an expert axis, within a layer: the
/// experts' module prefix (`mlp.experts.`) and the key within one expert (`linear_fc1.weight`).
/// Megatron writes its local experts `local_experts.<l>.linear_fc1.weight` as
/// `experts.linear_fc1.weight` of the experts module, one more leading axis for the global
/// expert index (`sharded_state_dict` of `SequentialMLP`), hence `mlp.experts.experts.`.
pub(crate) fn expert_axis(within: &str) -> Option<(&str, &str)> {
    const STACKED: &str = "experts.experts.";
    let at = within.match_indices(STACKED).map(|(i, _)| i).find(|&i| i == 0 || within.as_bytes()[i - 1] == b'.')?;
    let rest = &within[at + STACKED.len()..];
    (!rest.is_empty()).then(|| (&within[..at + "experts.".len()], rest))
}

/// The one-rank model's name, within a layer, of expert `expert`'s `rest` under the experts
/// module `prefix` (see [`expert_axis`]).
pub(crate) fn expert_name(prefix: &str, expert: u64, rest: &str) -> String {
    format!("{prefix}local_experts.{expert}.{rest}")
}

/// The name a key within a layer has in the local spec's module tree.
pub(crate) fn module_name(within: &str) -> String {
    for (te, local) in FUSED_NORMS {
        if let Some(rest) = within.strip_prefix(te) {
            return format!("{local}{rest}");
        }
    }
    within.to_string()
}

/// The one-rank model's name of layer `layer` of the stacked key `s`.
pub(crate) fn layer_name(s: Stacked<'_>, layer: u64) -> String {
    format!("{}{layer}.{}", s.block, module_name(s.within))
}

/// How a rank's piece of a parameter sits in the one-rank tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// The same on every rank.
    Whole,
    /// Concatenated on this dim.
    Dim(usize),
    /// SwiGLU's `[W_r; V_r]`: each half concatenated with the other ranks' on dim 0.
    Gated,
}

/// How megatron's parallel layers split the tensor at `name` (a module name).
pub(crate) fn split_of(name: &str, swiglu: bool) -> Split {
    let (module, param) = name.rsplit_once('.').unwrap_or(("", name));
    let leaf = module.rsplit('.').next().unwrap_or(module);
    match (leaf, param) {
        ("linear_fc1", "weight" | "bias") if swiglu => Split::Gated,
        ("linear_qkv" | "linear_fc1" | "word_embeddings" | "output_layer", "weight" | "bias") => Split::Dim(0),
        ("linear_proj" | "linear_fc2", "weight") => Split::Dim(1),
        _ => Split::Whole,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatrons_parallel_layers_decide_the_split() {
        let cases = [
            ("decoder.layers.0.self_attention.linear_qkv.weight", false, Split::Dim(0)),
            ("decoder.layers.0.self_attention.linear_qkv.bias", false, Split::Dim(0)),
            ("decoder.layers.0.self_attention.linear_proj.weight", false, Split::Dim(1)),
            ("decoder.layers.0.self_attention.linear_proj.bias", false, Split::Whole),
            ("decoder.layers.0.mlp.linear_fc1.weight", false, Split::Dim(0)),
            ("decoder.layers.0.mlp.linear_fc1.weight", true, Split::Gated),
            ("decoder.layers.0.mlp.linear_fc2.weight", true, Split::Dim(1)),
            ("decoder.layers.0.input_layernorm.weight", true, Split::Whole),
            ("embedding.word_embeddings.weight", false, Split::Dim(0)),
            ("embedding.position_embeddings.weight", false, Split::Whole),
            ("output_layer.weight", false, Split::Dim(0)),
            ("decoder.final_layernorm.weight", false, Split::Whole),
        ];
        for (name, swiglu, split) in cases {
            assert_eq!(split_of(name, swiglu), split, "{name}");
        }
    }

    #[test]
    fn a_layers_segment_followed_by_a_name_is_a_stacked_key() {
        let s = stacked("decoder.layers.self_attention.linear_qkv.weight");
        assert_eq!(s, Some(Stacked { block: "decoder.layers.", within: "self_attention.linear_qkv.weight" }));
        assert_eq!(stacked("decoder.layers.0.self_attention.linear_qkv.weight"), None);
        assert_eq!(stacked("embedding.word_embeddings.weight"), None);
        assert_eq!(stacked("decoder.final_layernorm.weight"), None);
        assert_eq!(stacked("decoder.layers"), None);
        assert_eq!(stacked("decoder.layers."), None);
        let mtp = stacked("mtp.layers.0.x");
        assert_eq!(mtp, None);
    }

    #[test]
    fn a_layers_segment_followed_by_a_number_is_a_per_layer_key() {
        let p = per_layer("decoder.layers.12.mlp.router.weight");
        assert_eq!(p, Some(PerLayer { block: "decoder.layers.", layer: 12, within: "mlp.router.weight" }));
        assert_eq!(per_layer("decoder.layers.mlp.router.weight"), None);
        assert_eq!(per_layer("decoder.layers.3"), None);
        assert_eq!(per_layer("decoder.layers.3."), None);
        assert_eq!(per_layer("embedding.word_embeddings.weight"), None);
    }

    #[test]
    fn sequential_experts_are_stacked_under_experts_experts() {
        let e = expert_axis("mlp.experts.experts.linear_fc1.weight");
        assert_eq!(e, Some(("mlp.experts.", "linear_fc1.weight")));
        assert_eq!(
            expert_name("mlp.experts.", 3, "linear_fc2.weight"),
            "mlp.experts.local_experts.3.linear_fc2.weight"
        );
        assert_eq!(expert_axis("mlp.shared_experts.linear_fc1.weight"), None);
        assert_eq!(expert_axis("mlp.router.weight"), None);
        assert_eq!(expert_axis("mlp.experts.experts."), None);
        assert_eq!(expert_axis("mlp.xexperts.experts.linear_fc1.weight"), None);
    }

    #[test]
    fn fused_norms_take_their_module_names() {
        let cases = [
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
            ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
            ("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias"),
        ];
        for (stored, module) in cases {
            assert_eq!(module_name(stored), module);
            assert_eq!(stored_within(module), stored);
        }
        let s = stacked("decoder.layers.mlp.linear_fc1.layer_norm_weight").map(|s| layer_name(s, 7));
        assert_eq!(s.as_deref(), Some("decoder.layers.7.pre_mlp_layernorm.weight"));
    }
}
