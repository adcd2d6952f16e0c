"""FP8 casts through the real `ckpt` binary against torch 2.13's `.to(dtype)` on CPU.

`convert --dtype` to and from every FP8 dtype, by torch's and by safetensors' name, on a
random plus edge-value sweep long enough to go through torch's vectorized kernels; the
exhaustive checks (every FP8 byte, every f16/bf16 pattern) live in `ckpt/src/map/cast.rs`.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_ckpt

FP8 = {
    "float8_e4m3fn": ("F8_E4M3", torch.float8_e4m3fn),
    "float8_e5m2": ("F8_E5M2", torch.float8_e5m2),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", torch.float8_e4m3fnuz),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", torch.float8_e5m2fnuz),
    "float8_e8m0fnu": ("F8_E8M0", torch.float8_e8m0fnu),
}
WIDE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sweep(dtype):
    g = torch.Generator().manual_seed(14)
    scales = torch.logspace(-12, 6, 64, dtype=torch.float64)
    rnd = torch.randn(8192, generator=g, dtype=torch.float64) * scales.repeat(128)
    edges = torch.tensor(
        [0.0, -0.0, 448, 449, 464, 465, 480, 57344, 61440, 65536, 1e9, float("inf"), -float("inf"),
         float("nan"), 2**-9, 2**-10, 2**-17, 2**-18, 1.5, 0.75, 3.0, -3.0, 240, 248, 2**-127, 3e38],
        dtype=torch.float64,
    )
    return torch.cat([edges.repeat(64), rnd, -rnd]).to(dtype)


def same_bits(got, want):
    as_int = BITS[want.element_size()]
    g, w = got.contiguous().view(as_int), want.contiguous().view(as_int)
    bad = (g != w).nonzero().flatten()[:5].tolist()
    return [(i, hex(g[i].item()), hex(w[i].item())) for i in bad]


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("src", list(WIDE))
def test_narrowing_to_fp8_matches_torch(tmp_path, name, src):
    st_name, target = FP8[name]
    x = sweep(WIDE[src])
    save_file({"x": x, "n": torch.arange(3)}, tmp_path / "in.safetensors")
    for i, spelled in enumerate([name, st_name]):
        out = tmp_path / f"out{i}.safetensors"
        run_ckpt("convert", tmp_path / "in.safetensors", out, "--dtype", spelled)
        got = load_file(out)
        assert got["x"].dtype == target
        assert not same_bits(got["x"], x.to(target)), same_bits(got["x"], x.to(target))
        assert torch.equal(got["n"], torch.arange(3)), "integer tensors are not cast"


@pytest.mark.parametrize("name", list(FP8))
@pytest.mark.parametrize("dst", list(WIDE))
def test_widening_from_fp8_torch_save_matches_torch(tmp_path, name, dst):
    _, dt = FP8[name]
    x = torch.arange(256, dtype=torch.uint8).repeat(16).view(dt)
    torch.save({"x": x}, tmp_path / "in.pt")
    out = tmp_path / "out.safetensors"
    run_ckpt("convert", tmp_path / "in.pt", out, "--dtype", dst)
    got = load_file(out)["x"]
    assert got.dtype == WIDE[dst]
    assert not same_bits(got, x.to(WIDE[dst])), same_bits(got, x.to(WIDE[dst]))


def test_an_unknown_or_integer_dtype_is_refused(tmp_path):
    save_file({"x": torch.ones(2)}, tmp_path / "in.safetensors")
    bad = run_ckpt("convert", tmp_path / "in.safetensors", tmp_path / "o.safetensors", "--dtype", "float8", check=False)
    assert bad.returncode == 2 and "unknown dtype `float8`" in bad.stderr, bad.stderr
    bad = run_ckpt("convert", tmp_path / "in.safetensors", tmp_path / "o.safetensors", "--dtype", "I32", check=False)
    assert bad.returncode == 2 and "`I32` is not a float dtype" in bad.stderr, bad.stderr
