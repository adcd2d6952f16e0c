"""Block-scaled FP8 through the real `ckpt` binary against the torch computation users run
(`blockscale_reference.py`): `convert --dequantize` and `--quantize fp8-e4m3 --block-size`,
bit for bit, on the torch-made fixture in `fixtures/fp8/blockscaled` and on fresh models."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockscale_reference import dequantize, quantize
from conftest import FIXTURES, run_ckpt

SRC = FIXTURES / "fp8" / "blockscaled"


def load_dir(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    bad = (bits(got) != bits(want)).nonzero()[:5].tolist()
    assert not bad, (name, bad)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "float16"), (torch.float32, "F32")])
def test_dequantize_fixture_equals_the_torch_loop(tmp_path, dtype, name):
    out = tmp_path / "out"
    run_ckpt("convert", SRC, out, "--dequantize", name, "--max-shard-size", "100KB")
    src, got = load_dir(SRC), load_dir(out)
    weights = [k for k in src if not k.endswith("_scale_inv")]
    assert sorted(got) == sorted(weights), "the scales are dropped, nothing else"
    for k in weights:
        if src[k].dtype == torch.float8_e4m3fn:
            want = dequantize(src[k], src[k + "_scale_inv"], 128, dtype)
        else:
            want = src[k]
        assert_same(got[k], want, k)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())


def test_dequantize_one_file(tmp_path):
    out = tmp_path / "out.safetensors"
    run_ckpt("convert", SRC, out, "--dequantize", "bf16")
    got, src = load_file(out), load_dir(SRC)
    w = "model.layers.2.proj.weight"
    assert_same(got[w], dequantize(src[w], src[w + "_scale_inv"], 128), w)


def model(gen, with_edges=False):
    sd = {"model.embed_tokens.weight": torch.randn(50, 96, generator=gen).to(torch.bfloat16)}
    for i, (r, c) in enumerate([(300, 200), (256, 128), (1, 129), (97, 64)]):
        w = torch.randn(r, c, generator=gen) * 10 ** torch.randint(-6, 3, (1,), generator=gen).item()
        sd[f"model.layers.{i}.mlp.weight"] = w.to(torch.bfloat16)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(c, dtype=torch.bfloat16)
    if with_edges:
        w = sd["model.layers.0.mlp.weight"].clone()
        w[:128, :128] = 0  # an all-zero block: scale 1
        w[200, 150] = float("nan")  # a NaN block: NaN scale, NaN weights
        w[5, 190] = float("inf")
        sd["model.layers.0.mlp.weight"] = w
    sd["lm_head.weight"] = torch.randn(50, 96, generator=gen).to(torch.bfloat16)
    return sd


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("block", [128, 64])
def test_quantize_equals_torch(tmp_path, src_dtype, block):
    gen = torch.Generator().manual_seed(block)
    sd = {k: v.to(src_dtype) for k, v in model(gen, with_edges=True).items()}
    save_file(sd, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    run_ckpt("convert", tmp_path / "in.safetensors", out, "--quantize", "fp8-e4m3", "--block-size", block)
    got = load_file(out)
    for k, v in sd.items():
        if ".mlp." in k:
            q, s = quantize(v, block)
            assert_same(got[k], q, k)
            assert_same(got[k + "_scale_inv"], s, k + "_scale_inv")
        else:
            assert_same(got[k], v, k)  # embeddings, norms and the head are kept
    assert len(got) == len(sd) + 4


def test_quantize_all_takes_embeddings_and_head(tmp_path):
    sd = model(torch.Generator().manual_seed(3))
    save_file(sd, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    run_ckpt("convert", tmp_path / "in.safetensors", out, "--quantize", "fp8-e4m3", "--quantize-all")
    got = load_file(out)
    for k in ["model.embed_tokens.weight", "lm_head.weight"]:
        q, s = quantize(sd[k], 128)
        assert_same(got[k], q, k)
        assert_same(got[k + "_scale_inv"], s, k)
    assert got["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16


def test_quantize_then_dequantize_is_the_torch_round_trip(tmp_path):
    sd = model(torch.Generator().manual_seed(5))
    save_file(sd, tmp_path / "in.safetensors")
    run_ckpt("convert", tmp_path / "in.safetensors", tmp_path / "q.safetensors", "--quantize", "fp8-e4m3")
    run_ckpt("convert", tmp_path / "q.safetensors", tmp_path / "d.safetensors", "--dequantize", "bf16")
    got = load_file(tmp_path / "d.safetensors")
    k = "model.layers.1.mlp.weight"
    q, s = quantize(sd[k], 128)
    assert_same(got[k], dequantize(q, s, 128), k)


def test_a_scale_of_the_wrong_shape_is_refused_with_both_names(tmp_path):
    w = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    save_file({"a.weight": w, "a.weight_scale_inv": torch.ones(2, 2)}, tmp_path / "bad.safetensors")
    proc = run_ckpt("convert", tmp_path / "bad.safetensors", tmp_path / "o.safetensors", "--dequantize", "bf16", check=False)
    assert proc.returncode == 2
    assert (
        "block-scaled weight `a.weight` with scales `a.weight_scale_inv`: the scales have shape [2, 2], "
        "but a weight of shape [300, 200] in blocks of 128 needs [3, 2]"
    ) in proc.stderr, proc.stderr
    assert not (tmp_path / "o.safetensors").exists()
    save_file({"a.weight": w}, tmp_path / "noscale.safetensors")
    proc = run_ckpt("convert", tmp_path / "noscale.safetensors", tmp_path / "o.safetensors", "--dequantize", "bf16", check=False)
    assert proc.returncode == 2 and "`a.weight_scale_inv`" in proc.stderr and "no such scales" in proc.stderr, proc.stderr
