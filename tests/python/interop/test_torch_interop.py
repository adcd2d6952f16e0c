"""`ckpt convert` against real torch and safetensors: what we write, torch and safetensors load
bit for bit; what torch wrote, we convert bit for bit; and a `--dtype` cast gives the bits of
torch's own `.to(dtype)`.

"Bit for bit" here is about tensors (dtype, shape and raw bytes of every tensor), not files: a
`.pt` we write is not the bytes `torch.save` writes for the same dict, even under the same file
name (torch adds a `.data/serialization_id` record, and pickles a plain dict with memo entries
where we write an `OrderedDict` without them), and a `.safetensors` converted from a `.pt`
carries the non-tensor values as metadata that no torch or safetensors call writes, so there is
no file of the real tools to compare with. Where such a file exists (split/merge against
safetensors and huggingface_hub, DeepSpeed's `zero_to_fp32`, accelerate's merge), the other
interop tests compare the bytes."""

import base64
import json
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, run_ckpt

TORCH_FX = FIXTURES / "torch"
CASES = sorted(p.name for p in TORCH_FX.glob("*.pt")) + ["sharded"]


def flatten(obj, prefix=""):
    """torch's object as our dotted names: tensors and other values."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        if not obj and prefix:
            out[prefix] = {}
    elif isinstance(obj, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix] = obj
    return out


def load_source(case):
    path = TORCH_FX / case
    if case == "sharded":
        index = json.loads((path / "pytorch_model.bin.index.json").read_text())
        sd = {}
        for f in sorted(set(index["weight_map"].values())):
            sd.update(torch.load(path / f, weights_only=True))
        return sd
    if case == "protocol4.pt":
        # torch's weights-only loader refuses protocol 4; the generator saved the same object
        # as legacy.pt.
        path = TORCH_FX / "legacy.pt"
    return flatten(torch.load(path, weights_only=True))


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_tensor(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def assert_same_dict(got, want, check_leaves=True):
    want_t = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    got_t = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
    assert list(got_t) == list(want_t) or sorted(got_t) == sorted(want_t)
    for k, t in want_t.items():
        assert same_tensor(got_t[k], t), k
        assert got_t[k].is_contiguous(), k
    if check_leaves:
        norm = lambda v: json.loads(json.dumps(v, default=list))  # noqa: E731
        want_l = {k: norm(v) for k, v in want.items() if k not in want_t}
        got_l = {k: norm(v) for k, v in got.items() if k not in got_t}
        assert got_l == want_l


@pytest.mark.parametrize("case", CASES)
def test_torch_to_torch_loads_in_torch(tmp_path, case):
    out = tmp_path / "out.pt"
    run_ckpt("convert", TORCH_FX / case, out, "--to", "torch")
    want = load_source(case)
    for mmap in (False, True):
        got = torch.load(out, weights_only=True, mmap=mmap)
        assert isinstance(got, dict)
        assert_same_dict(dict(got), want)
    # torch's layout: stored records, each payload 64-byte aligned, CRCs valid.
    data = out.read_bytes()
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        names = [i.filename for i in z.infolist()]
        assert names[:4] == ["out/data.pkl", "out/.format_version", "out/.storage_alignment", "out/byteorder"]
        assert names[-1] == "out/version"
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            n, m = struct.unpack_from("<HH", data, info.header_offset + 26)
            assert (info.header_offset + 30 + n + m) % 64 == 0, info.filename
        assert z.read("out/version") == b"3\n"


def bytes_json(v):
    """A byte string the way `ckpt` renders it in JSON: one base64 string (ckpt/src/read/value.rs)."""
    if isinstance(v, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(v)).decode("ascii")}
    raise TypeError(f"not JSON: {type(v).__name__}")


@pytest.mark.parametrize("case", CASES)
def test_torch_to_safetensors(tmp_path, case):
    out = tmp_path / "out.safetensors"
    proc = run_ckpt("convert", TORCH_FX / case, out)
    want = load_source(case)
    got = load_file(out)
    assert_same_dict(got, want, check_leaves=False)
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    leaves = {k: v for k, v in want.items() if not isinstance(v, torch.Tensor)}
    for k, v in leaves.items():
        # Every value as its JSON text, strings included, so each reads back with its type.
        assert json.loads(meta[k]) == json.loads(json.dumps(v, default=bytes_json)), k
    if leaves:
        assert "non-tensor value" in proc.stderr


def test_safetensors_to_torch(tmp_path):
    src = FIXTURES / "safetensors" / "all_dtypes.safetensors"
    out = tmp_path / "all.bin"
    run_ckpt("convert", src, out)
    want = load_file(src)
    got = torch.load(out, weights_only=True)
    assert_same_dict(dict(got), want)


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_sharded_output_with_index(tmp_path, to):
    out = tmp_path / "shards"
    run_ckpt("convert", TORCH_FX / "sharded", out, "--to", to, "--max-shard-size", "200")
    want = load_source("sharded")
    index_name = "pytorch_model.bin.index.json" if to == "torch" else "model.safetensors.index.json"
    index = json.loads((out / index_name).read_text())
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        part = torch.load(out / f, weights_only=True) if to == "torch" else load_file(out / f)
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert_same_dict(got, want)
    if to == "safetensors":
        # The same split huggingface_hub makes.
        from huggingface_hub import split_torch_state_dict_into_shards

        split = split_torch_state_dict_into_shards(want, max_shard_size=200)
        assert split.tensor_to_filename == index["weight_map"]


def test_dedupe_matches_save_model(tmp_path):
    out = tmp_path / "tied.safetensors"
    proc = run_ckpt("convert", TORCH_FX / "tied.pt", out, "--dedupe")
    assert "`lm_head.weight` dropped, alias of `embed.weight`" in proc.stderr
    got = load_file(out)
    assert set(got) == {"embed.weight", "half_view"}
    # safetensors' own choice of the name to keep, on the same tied module.
    from safetensors.torch import _remove_duplicate_names

    sd = torch.load(TORCH_FX / "tied.pt", weights_only=True)
    removed = _remove_duplicate_names({k: sd[k] for k in ("embed.weight", "lm_head.weight")})
    assert removed == {"embed.weight": ["lm_head.weight"]}
    # Torch output keeps the alias, sharing one storage, as torch saves tied weights.
    pt = tmp_path / "tied.pt"
    run_ckpt("convert", TORCH_FX / "tied.pt", pt, "--dedupe")
    back = torch.load(pt, weights_only=True)
    assert back["embed.weight"].untyped_storage().data_ptr() == back["lm_head.weight"].untyped_storage().data_ptr()
    assert_same_dict(dict(back), load_source("tied.pt"))


def edge_values(dtype):
    """Values that exercise rounding: ties, carries into the exponent, overflow, subnormals,
    signed zeros, infinities and NaNs with payloads, then random values at many scales."""
    if dtype == torch.float32:
        bits = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000,
                0xFFFFFFFF, 0x7FFFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x33000000, 0x33000001,
                0x387FC000, 0x38800000, 0x477FE000, 0x477FF000, 0x477FEFFF, 0x7F7FFFFF, 0x3F801000, 0x3F803000,
                0x3F808000, 0x3F818000, 0x3F8FFFFF, 0x3F7FFF80]
        signed = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
        base = torch.tensor(signed, dtype=torch.int32).view(torch.float32)
    elif dtype == torch.float64:
        vals = [0x7FF0000000000001, 0xFFF8000000000001, 0x3FF0000000000001, 0x3FF0010000000000,
                0x3FF0010000000001, 0x47EFFFFFF0000000, 0x36A0000000000000, 0x0000000000000001]
        base = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in vals], dtype=torch.int64).view(torch.float64)
    elif dtype == torch.float16:
        vals = [0x7C01, 0x7E00, 0xFE01, 0x7C00, 0xFC00, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x3C01, 0x3C03, 0x8000]
        base = torch.tensor([v - (1 << 16) if v >= 1 << 15 else v for v in vals], dtype=torch.int16).view(torch.float16)
    else:
        vals = [0x7F81, 0xFFC1, 0x7F80, 0x0001, 0x007F, 0x0080, 0x7F7F, 0x3F81, 0x8000]
        base = torch.tensor([v - (1 << 16) if v >= 1 << 15 else v for v in vals], dtype=torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    scales = torch.logspace(-45, 38, 64, dtype=torch.float64)
    rnd = (torch.randn(4096, generator=g, dtype=torch.float64) * scales.repeat(64)).to(dtype)
    # Repeat the edges so the whole tensor goes through torch's vectorized kernels.
    return torch.cat([base.repeat(64), rnd])


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dst", ["f32", "f16", "bf16"])
def test_dtype_cast_matches_torch_bits(tmp_path, src, dst):
    target = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dst]
    x = edge_values(src)
    torch.save({"x": x, "n": torch.arange(3)}, tmp_path / "in.pt")
    out = tmp_path / "out.safetensors"
    run_ckpt("convert", tmp_path / "in.pt", out, "--dtype", dst)
    got = load_file(out)
    want = x.to(target)
    assert got["x"].dtype == target
    as_int = {2: torch.int16, 4: torch.int32}[target.itemsize]
    got_bits, want_bits = got["x"].view(as_int), want.view(as_int)
    bad = (got_bits != want_bits).nonzero().flatten()[:5].tolist()
    assert not bad, [(x[i].item(), hex(got_bits[i].item()), hex(want_bits[i].item())) for i in bad]
    assert same_tensor(got["n"], torch.arange(3)), "integer tensors are not cast"


def test_hostile_file_is_refused_and_nothing_runs(tmp_path):
    proc = run_ckpt("convert", FIXTURES / "hostile" / "torch" / "os_system.pt", tmp_path / "o.safetensors", check=False)
    assert proc.returncode == 2
    assert "refusing global `posix.system`" in proc.stderr
    assert not (Path.cwd() / "statekit-pwned").exists()
    assert list(tmp_path.iterdir()) == []


def test_inspect_torch_json():
    proc = run_ckpt("inspect", "--json", TORCH_FX / "nested.pt")
    doc = json.loads(proc.stdout)
    assert doc["format"] == "torch"
    want = load_source("nested.pt")
    assert [t["name"] for t in doc["tensors"]] == [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    values = doc["values"]
    assert values["step"] == want["step"] and values["name"] == want["name"]


@pytest.mark.skipif(not os.environ.get("STATEKIT_SLOW_TESTS"), reason="writes 8.6 GB; set STATEKIT_SLOW_TESTS=1")
def test_zip64_over_4gib(tmp_path):
    """A record of 4 GiB + 123 bytes, and one whose local header starts past 4 GiB: torch writes
    zip64 extras and 24-byte descriptors; we read them, and write them so torch reads ours."""
    a = torch.zeros((4 << 30) + 123, dtype=torch.uint8)
    a[:: 1 << 20] = 7
    b = torch.arange(10, dtype=torch.float32)
    torch.save({"a": a, "b": b}, tmp_path / "big.pt")
    del a
    run_ckpt("convert", "-q", tmp_path / "big.pt", tmp_path / "out.pt")
    (tmp_path / "big.pt").unlink()
    with zipfile.ZipFile(tmp_path / "out.pt") as z:
        offsets = {i.filename: i.header_offset for i in z.infolist()}
    assert offsets["out/data/1"] > 1 << 32
    out = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    assert torch.equal(out["b"], b)
    assert out["a"].shape == ((4 << 30) + 123,)
    assert bool((out["a"][:: 1 << 20] == 7).all()) and int(out["a"][1 : 1 << 20].max()) == 0
