"""`ckpt convert --to hf` of Megatron-LM saves against transformers: the folder loads with
`AutoModelForCausalLM.from_pretrained` and gives the logits megatron's own forward gave (float32,
max |diff| < 1e-4), and its tensors are megatron's one-rank tensors under the Hub's names, bit for
bit (re-derived here from `expected_model.safetensors` by the Hub layout, independently of the
Rust tables).

The saves were written by megatron-core 0.19.2's Megatron-LM `save_checkpoint`
(`fixtures/gen/megatron_arch_fixtures.py`, `fixtures/gen/megatron_moe_fixtures.py`); each case's
`hf_config.json` is the config transformers 5.24 builds for the same model."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURES, run_ckpt

transformers = pytest.importorskip("transformers")

# (case, its run folder, the folder of its references)
CASES = {
    "llama_tp2pp2": "megatron_arch/llama_tp2pp2",
    "llama_tied_tp2": "megatron_arch/llama_tied_tp2",
    "qwen2_tp2": "megatron_arch/qwen2_tp2",
    "qwen3_tp2": "megatron_arch/qwen3_tp2",
    "llama_pp2_vpp2": "megatron_arch/llama_pp2_vpp2",
    "llama_legacy_tp2pp2": "megatron_arch/llama_legacy_tp2pp2",
    "llama_legacy_pp2_uneven": "megatron_arch/llama_legacy_pp2_uneven",
    "mixtral_ep2": "megatron_moe/mixtral_ep2",
    "mixtral_ep2dp2": "megatron_moe/mixtral_ep2dp2",
    "mixtral_pp2ep2": "megatron_moe/mixtral_pp2ep2",
    "mixtral_tp2ep2": "megatron_moe/mixtral_tp2ep2",
    "qwen2moe_ep2": "megatron_moe/qwen2moe_ep2",
}

# The settings a converted `config.json` must share with the one transformers built.
SETTINGS = [
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "intermediate_size",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "qkv_bias",
]


def case_dirs(case):
    ref = FIXTURES / CASES[case]
    run = ref / "run" if (ref / "run").is_dir() else ref
    return run, ref


def hub_names(sd, cfg):
    """Megatron's one-rank state dict under the Hub's names, as published checkpoints lay them
    out: `linear_qkv` rows per query group `[q_1..q_r, k, v]`, `linear_fc1` = `[gate; up]`,
    experts one by one (Mixtral `block_sparse_moe.experts.E.w1/w3/w2`, Qwen
    `mlp.experts.E.gate_proj/up_proj/down_proj`), Qwen2-MoE's shared expert and its gate."""
    hd, ng = cfg["head_dim"], cfg["num_key_value_heads"]
    r = cfg["num_attention_heads"] // ng
    moe = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
    gate_up_down = ("w1", "w3", "w2") if cfg["model_type"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for n in range(cfg["num_hidden_layers"]):
        m, h = f"decoder.layers.{n}.", f"model.layers.{n}."
        for suffix in ("weight", "bias"):
            qkv = sd.get(m + f"self_attention.linear_qkv.{suffix}")
            if qkv is None:
                continue
            g = qkv.reshape(ng, r + 2, hd, *qkv.shape[1:])
            out[h + f"self_attn.q_proj.{suffix}"] = g[:, :r].reshape(ng * r * hd, *qkv.shape[1:])
            out[h + f"self_attn.k_proj.{suffix}"] = g[:, r].reshape(ng * hd, *qkv.shape[1:])
            out[h + f"self_attn.v_proj.{suffix}"] = g[:, r + 1].reshape(ng * hd, *qkv.shape[1:])
        out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        for mine, hub in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if m + f"self_attention.{mine}.weight" in sd:
                out[h + f"self_attn.{hub}.weight"] = sd[m + f"self_attention.{mine}.weight"]
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        if m + "mlp.router.weight" not in sd:
            gate, up = sd[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
            continue
        out[h + f"{moe}.gate.weight"] = sd[m + "mlp.router.weight"]
        e = 0
        while m + f"mlp.experts.local_experts.{e}.linear_fc1.weight" in sd:
            x = m + f"mlp.experts.local_experts.{e}."
            gate, up = sd[x + "linear_fc1.weight"].chunk(2, dim=0)
            g_, u_, d_ = gate_up_down
            out[h + f"{moe}.experts.{e}.{g_}.weight"], out[h + f"{moe}.experts.{e}.{u_}.weight"] = gate, up
            out[h + f"{moe}.experts.{e}.{d_}.weight"] = sd[x + "linear_fc2.weight"]
            e += 1
        if m + "mlp.shared_experts.linear_fc1.weight" in sd:
            gate, up = sd[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2, dim=0)
            out[h + "mlp.shared_expert.gate_proj.weight"], out[h + "mlp.shared_expert.up_proj.weight"] = gate, up
            out[h + "mlp.shared_expert.down_proj.weight"] = sd[m + "mlp.shared_experts.linear_fc2.weight"]
        if m + "mlp.shared_experts.gate_weight" in sd:
            out[h + "mlp.shared_expert_gate.weight"] = sd[m + "mlp.shared_experts.gate_weight"]
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_converted_megatron_save_gives_megatrons_logits_in_transformers(case, tmp_path):
    run, ref = case_dirs(case)
    out = tmp_path / "hf"
    run_ckpt("convert", run, out, "--to", "hf")

    config = json.loads((out / "config.json").read_text())
    expected = json.loads((ref / "hf_config.json").read_text())
    for key in SETTINGS:
        if key in expected and expected[key] is not None:
            assert config.get(key) == expected[key], f"{case}: config.json `{key}`"
    theta = expected.get("rope_parameters", {}).get("rope_theta", expected.get("rope_theta"))
    assert config["rope_theta"] == theta, case

    written = load_file(out / "model.safetensors")
    reference = hub_names(load_file(ref / "expected_model.safetensors"), config)
    assert sorted(written) == sorted(reference), case
    for name, t in reference.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), f"{case}: {name}"

    recorded = load_file(ref / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"]).logits.float()
    diff = (logits - recorded["logits"]).abs().max().item()
    assert diff < 1e-4, f"{case}: max |diff| {diff}"


def test_vocab_size_keeps_the_first_rows_and_the_config_says_so(tmp_path):
    run, ref = case_dirs("qwen2_tp2")
    out = tmp_path / "hf"
    run_ckpt("convert", run, out, "--to", "hf", "--vocab-size", "60", "--max-shard-size", "20KB")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 60
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s.startswith("model-0000") for s in shards), shards
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    recorded = load_file(ref / "logits.safetensors")
    with torch.no_grad():
        logits = model(input_ids=recorded["input_ids"]).logits.float()
    diff = (logits - recorded["logits"][..., :60]).abs().max().item()
    assert diff < 1e-4, diff
