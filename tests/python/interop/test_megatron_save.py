"""Megatron-LM run folders written by `ckpt convert SRC OUT --to megatron`, loaded by the real
megatron-core 0.19.2 (`make mcore` unpacks it at /opt/mcore; CPU, gloo, with
`fixtures/gen/megatron_cpu.py`'s patches).

A `torch_dist` source written again keeps every stored tensor and value bit for bit; megatron
then reads it at tensor parallel 2 (`megatron_load_check.py`): `dist_checkpointing.load` gives
the parameters megatron reads from its own save, and Megatron-LM's `load_checkpoint` with
`--finetune --no-load-optim --no-load-rng` starts from it at iteration 0 with the same ones.
A transformers folder written as a run is loaded the same way at tensor parallel 2 (MoE models:
expert parallel 1 and 2, and at TP 2 x EP 2) and gives the logits transformers recorded, and
comes back through `--to hf` bit for bit.

`--to megatron-legacy` cuts the same models into Megatron-LM's per-rank files (TP 2 x PP 2,
TP 2, MoE at TP 2 x EP 2), which only Megatron-LM's `load_checkpoint` reads: every rank's file
holds exactly its model's keys, and the parameters equal those `dist_checkpointing.load` gives
from the `torch_dist` run of the same folder.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURES, ROOT, run_ckpt, torchrun

MCORE = os.environ.get("STATEKIT_MCORE", "/opt/mcore")
CHECK = ROOT / "tests" / "python" / "interop" / "megatron_load_check.py"
RUN_TP2 = FIXTURES / "megatron" / "run_tp2"


def megatron_loads(tmp_path, case, ours, reference=None, tp=2, hf_logits=None):
    assert os.path.isdir(os.path.join(MCORE, "megatron")), f"megatron-core is not at {MCORE} (`make mcore`)"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"case": case, "tp": tp, "ours": str(ours),
                                "reference": str(reference) if reference else None,
                                "hf_logits": str(hf_logits) if hf_logits else None}))
    # Megatron-LM refuses tensor parallelism without this setting of its CUDA runs.
    env = {"PYTHONPATH": MCORE, "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = torchrun(tp, CHECK, spec, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"megatron_load_check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_a_torch_dist_run_written_again_keeps_its_stored_tensors_bit_for_bit(tmp_path):
    out = tmp_path / "run"
    run_ckpt("convert", RUN_TP2, out, "--to", "megatron")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    it = out / "iter_0000003"
    assert sorted(p.name for p in it.iterdir()) == [".metadata", "__0_0.distcp", "metadata.json"]
    assert (it / "metadata.json").read_text() == (RUN_TP2 / "iter_0000003" / "metadata.json").read_text()
    # What megatron stored, as torch's own dcp_to_torch_save reads each: the same tensors.
    run_ckpt("convert", it, tmp_path / "stored.safetensors", "--as-stored")
    got, want = load_file(tmp_path / "stored.safetensors"), load_file(RUN_TP2 / "expected_stored.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].reshape(-1).view(torch.uint8).equal(want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("case", ["run_tp2", "tp2pp2"])
def test_megatron_loads_a_rewritten_run_at_tp2_and_megatron_lm_finetunes_from_it(tmp_path, case):
    """`run_tp2` is a Megatron-LM run (fp32, LayerNorm, biases); `tp2pp2` a bare
    `dist_checkpointing.save` at TP 2 x PP 2 (bf16, SwiGLU, GQA, RMSNorm), which becomes a run
    with the common state Megatron-LM needs."""
    src = FIXTURES / "megatron" / case
    source = src if case == "run_tp2" else src / "ckpt"
    out = tmp_path / "run"
    run_ckpt("convert", source, out, "--to", "megatron")
    spec = json.loads((src / "case.json").read_text())
    stdout = megatron_loads(tmp_path, spec, out, reference=source)
    assert stdout.count(": ok") == 2, stdout


def hf_case(folder):
    """megatron_load_check.py's case for a transformers model folder, from its `config.json`."""
    c = json.loads((folder / "config.json").read_text())
    model_type = c["model_type"]
    heads = c["num_attention_heads"]
    return {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"], "ffn": c["intermediate_size"],
            "heads": heads, "query_groups": c.get("num_key_value_heads", heads),
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "vocab": c["vocab_size"],
            "seq_len": c["max_position_embeddings"], "swiglu": True, "tied": c.get("tie_word_embeddings", False),
            "dtype": c.get("dtype", "float32"), "norms_dtype": None, "normalization": "RMSNorm",
            "bias_linear": False, "position_embedding": "rope", "seed": 0,
            "rope_theta": c["rope_parameters"]["rope_theta"], "norm_eps": c["rms_norm_eps"],
            "qkv_bias": model_type == "qwen2", "qk_norm": model_type == "qwen3"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_hugging_face_model_converts_to_a_run_megatron_loads_at_tp2_with_its_logits(tmp_path, arch):
    """transformers 5.24 folders (`fixtures/megatron_arch/hf/`: Llama GQA in two shards, Qwen2
    with QKV biases and tied embeddings, Qwen3 with q/k norms) converted to a Megatron-LM run:
    megatron at tensor parallel 2 loads it (`dist_checkpointing.load`, and `load_checkpoint
    --finetune`) and its forward gives the logits transformers recorded (max |diff| < 1e-4)."""
    folder = FIXTURES / "megatron_arch" / "hf" / arch
    out = tmp_path / "run"
    run_ckpt("convert", folder, out, "--to", "megatron")
    stdout = megatron_loads(tmp_path, hf_case(folder), out, hf_logits=folder / "logits.safetensors")
    assert stdout.count(": ok") == 2 and stdout.count("logits max |diff|") == 2, stdout


def hub_tensors_come_back(folder, run, tmp_path):
    """`run` (a Megatron run written from the transformers folder `folder`) converted `--to hf`
    into `tmp_path/hf` holds the folder's tensors bit for bit (a tied model's `lm_head.weight`
    is not written, as `save_pretrained` leaves it out)."""
    run_ckpt("convert", run, tmp_path / "hf", "--to", "hf")
    run_ckpt("merge", folder, tmp_path / "want.safetensors")
    run_ckpt("merge", tmp_path / "hf", tmp_path / "got.safetensors")
    want, got = load_file(tmp_path / "want.safetensors"), load_file(tmp_path / "got.safetensors")
    if json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"):
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].reshape(-1).view(torch.uint8).equal(want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_hugging_face_model_comes_back_from_its_megatron_run_bit_for_bit(tmp_path, arch):
    """HF → `--to megatron` → `--to hf`: the Hub tensors come back bit for bit (a tied model's
    `lm_head.weight` is not written, as `save_pretrained` leaves it out), and transformers
    5.24 loads the folder with the logits it recorded."""
    from transformers import AutoModelForCausalLM

    folder = FIXTURES / "megatron_arch" / "hf" / arch
    run_ckpt("convert", folder, tmp_path / "run", "--to", "megatron")
    hub_tensors_come_back(folder, tmp_path / "run", tmp_path)
    recorded = load_file(folder / "logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(recorded["input_ids"]).logits
    assert (logits - recorded["logits"]).abs().max().item() < 1e-4


def moe_argv(folder, ep=1, tp=1):
    """Megatron-LM's command line of `fixtures/gen/megatron_moe_fixtures.py` (local spec,
    SequentialMLP experts) for a transformers MoE folder's config, on `ep · tp` ranks."""
    import sys

    sys.path.insert(0, str(FIXTURES / "gen"))
    import megatron_moe_fixtures as moe

    c = json.loads((folder / "config.json").read_text())
    # Qwen3-MoE is Mixtral's layout with q/k norms: no shared expert, no QKV bias, the top-k
    # weights renormalized (megatron's default order: top-k, then softmax).
    arch = "qwen2moe" if c["model_type"] == "qwen2_moe" else "mixtral"
    case = dict(moe.BASE, arch=arch, layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                ffn=c["intermediate_size"], heads=c["num_attention_heads"], query_groups=c["num_key_value_heads"],
                seq_len=c["max_position_embeddings"], vocab=c["vocab_size"],
                experts=c.get("num_local_experts") or c["num_experts"], topk=c["num_experts_per_tok"],
                moe_ffn=c.get("moe_intermediate_size") or c["intermediate_size"], eps=c["rms_norm_eps"],
                rope_theta=c["rope_parameters"]["rope_theta"], seed=1,
                layer_freq=[0 if i in c.get("mlp_only_layers", []) else 1 for i in range(c["num_hidden_layers"])],
                shared_ffn=c.get("shared_expert_intermediate_size"))
    argv = moe.argv_for(case, ep * tp, ep, tp)
    if c["model_type"] == "qwen3_moe":
        argv.append("--qk-layernorm")
    if arch != "mixtral" and not c.get("tie_word_embeddings"):
        argv.append("--untie-embeddings-and-output-weights")
    return argv


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_hugging_face_moe_model_converts_to_a_run_megatron_loads_with_its_logits(tmp_path, arch):
    """transformers 5.24's Mixtral (every layer MoE: experts stacked twice) and Qwen2-MoE (a
    dense first layer: per-layer keys; a gated shared expert; QKV biases) written as Megatron-LM
    runs: megatron's `dist_checkpointing.load` of an MoE GPTModel (`megatron_moe_worker.py`'s
    `logits` mode, one rank) reads every parameter and its forward gives transformers' logits."""
    from safetensors.torch import load_file as load

    folder = FIXTURES / "megatron_arch" / "hf" / arch
    run_ckpt("convert", folder, tmp_path / "run", "--to", "megatron")
    recorded = load(folder / "logits.safetensors")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"mode": "logits", "argv": moe_argv(folder), "ckpt": str(tmp_path / "run" / "iter_0000000"),
                                "out": str(tmp_path / "m.safetensors"), "out_extra": str(tmp_path / "m.json"),
                                "logits": str(tmp_path / "logits.safetensors"),
                                "tokens": recorded["input_ids"].tolist()}))
    env = {"PYTHONPATH": f"{MCORE}:{FIXTURES / 'gen'}", "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = torchrun(1, FIXTURES / "gen" / "megatron_moe_worker.py", spec, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"megatron_moe_worker exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    got = load(tmp_path / "logits.safetensors")["logits"]
    assert (got - recorded["logits"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_megatron_loads_a_converted_moe_model_at_expert_parallel_2_with_its_logits(tmp_path, arch):
    """The same runs read by megatron at expert parallel 2 (each rank builds two of the four
    experts; `megatron_load_check.py`'s MoE mode): every parameter found, transformers' logits."""
    folder = FIXTURES / "megatron_arch" / "hf" / arch
    out = tmp_path / "run"
    run_ckpt("convert", folder, out, "--to", "megatron")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"argv": moe_argv(folder, ep=2), "ours": str(out),
                                "hf_logits": str(folder / "logits.safetensors")}))
    env = {"PYTHONPATH": f"{MCORE}:{FIXTURES / 'gen'}", "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = torchrun(2, CHECK, spec, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"megatron_load_check exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    assert proc.stdout.count(": ok") == 2 and proc.stdout.count("logits max |diff|") == 2, proc.stdout


def legacy_ranks(tp, pp, ep=1):
    """megatron's rank folder names for a layout (`get_checkpoint_name`)."""
    return sorted(f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                  for t in range(tp) for p in range(pp) for e in range(ep))


@pytest.mark.parametrize("arch,pp", [("llama", 2), ("qwen2", 2), ("qwen3", 1)])
def test_a_hugging_face_model_in_megatrons_legacy_layout_is_what_megatron_lm_loads(tmp_path, arch, pp):
    """`--to megatron-legacy --tensor-parallel 2 --pipeline-parallel P` of transformers'
    folders (Llama and Qwen2 at TP 2 x PP 2, Qwen2's tied embeddings copied to the last stage;
    Qwen3 at TP 2): Megatron-LM's `load_checkpoint --finetune` at that layout reads, on every
    rank, a file holding exactly its model's keys and the parameters `dist_checkpointing.load`
    gives from the `--to megatron` run of the same folder, bit for bit; on one stage the
    forward gives transformers' logits. Read back by ckpt, the ranks are the Hub tensors."""
    folder = FIXTURES / "megatron_arch" / "hf" / arch
    dist, legacy = tmp_path / "dist", tmp_path / "legacy"
    run_ckpt("convert", folder, dist, "--to", "megatron")
    run_ckpt("convert", folder, legacy, "--to", "megatron-legacy", "--tensor-parallel", "2",
             "--pipeline-parallel", str(pp))
    assert (legacy / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert sorted(p.name for p in (legacy / "iter_0000000").iterdir()) == legacy_ranks(2, pp)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"case": hf_case(folder), "tp": 2, "pp": pp, "ours": str(legacy), "reference": str(dist),
                                "legacy": True, "hf_logits": str(folder / "logits.safetensors")}))
    env = {"PYTHONPATH": MCORE, "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = torchrun(2 * pp, CHECK, spec, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"megatron_load_check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count(": ok") == 2 * pp, proc.stdout
    assert proc.stdout.count("logits max |diff|") == (2 if pp == 1 else 0), proc.stdout

    hub_tensors_come_back(folder, legacy, tmp_path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_megatron_lm_loads_a_moe_model_at_tp2_ep2_from_either_layout_with_its_logits(tmp_path, arch):
    """transformers' Mixtral and Qwen2-MoE (a dense first layer, a gated shared expert) as a
    `torch_dist` run and as legacy ranks at TP 2 x EP 2, read by megatron at TP 2 x EP 2 (four
    ranks, two data-parallel): `dist_checkpointing.load` of the run finds every parameter,
    `load_checkpoint --finetune` of the legacy ranks gives the same ones bit for bit from files
    holding exactly each rank's keys, and the forward gives transformers' logits."""
    folder = FIXTURES / "megatron_arch" / "hf" / arch
    run, legacy = tmp_path / "run", tmp_path / "legacy"
    run_ckpt("convert", folder, run, "--to", "megatron")
    run_ckpt("convert", folder, legacy, "--to", "megatron-legacy", "--tensor-parallel", "2", "--expert-parallel", "2")
    assert sorted(p.name for p in (legacy / "iter_0000000").iterdir()) == legacy_ranks(2, 1, 2)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"argv": moe_argv(folder, ep=2, tp=2), "ours": str(run), "legacy": str(legacy),
                                "hf_logits": str(folder / "logits.safetensors")}))
    env = {"PYTHONPATH": f"{MCORE}:{FIXTURES / 'gen'}", "CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = torchrun(4, CHECK, spec, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"megatron_load_check exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    assert proc.stdout.count(": ok") == 4 and proc.stdout.count("logits max |diff|") == 4, proc.stdout
