"""`ckpt split` and `ckpt merge` against huggingface_hub and safetensors, byte for byte."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, files_of, run_ckpt

ST = FIXTURES / "safetensors"
SOURCES = {
    "all_dtypes": ST / "all_dtypes.safetensors",
    "single": ST / "model_single" / "model.safetensors",
    "sharded": ST / "model_sharded",
}
SIZES = ["100KB", "4KB", "1KB", "0.3KB", "200", "5GB"]


def same_safetensors(a: bytes, b: bytes) -> bool:
    if a == b or not (a[:8] == b[:8] and len(a) == len(b)):
        return a == b
    n = int.from_bytes(a[:8], "little") + 8
    ha, hb = json.loads(a[8:n]), json.loads(b[8:n])
    return ha == hb and [k for k in ha if k != "__metadata__"] == [k for k in hb if k != "__metadata__"] and a[n:] == b[n:]


def user_metadata(src: Path) -> dict:
    """What a Python user would pass as `metadata`: the source's extra metadata."""
    from safetensors import safe_open

    if src.is_file():
        with safe_open(src, "pt") as f:
            meta = dict(f.metadata() or {})
        meta.pop("format", None)
        return meta
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return {k: v for k, v in index.get("metadata", {}).items() if k != "total_size"}


def header_order(path: Path) -> list:
    """load_file's order: by data offset. Empty tensors can share an offset, and then
    safetensors' order comes from a hash map and changes from run to run; ckpt breaks such
    ties by header order, so the reference does the same."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: tuple(header[k]["data_offsets"]))


def load_file_ordered(path: Path) -> dict:
    loaded = load_file(path)
    order = header_order(path)
    assert set(order) == set(loaded)
    return {k: loaded[k] for k in order}


def load_source(src: Path) -> dict:
    """The state dict a Python user gets: load_file, or every shard in order for a folder."""
    if src.is_file():
        return load_file_ordered(src)
    index_path = src / "model.safetensors.index.json"
    if not index_path.exists():
        return load_file_ordered(src / "model.safetensors")
    index = json.loads(index_path.read_text())
    sd = {}
    for shard in sorted(set(index["weight_map"].values())):
        sd.update(load_file_ordered(src / shard))
    return sd


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_split_equals_save_torch_state_dict(tmp_path, name, size):
    src = SOURCES[name]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    theirs.mkdir()
    # A bare byte count is the Python API's integer argument.
    limit = int(size) if size.isdigit() else size
    save_torch_state_dict(load_source(src), theirs, max_shard_size=limit, metadata=user_metadata(src))
    run_ckpt("split", src, ours, "--max-shard-size", size)

    want, got = files_of(theirs), files_of(ours)
    assert sorted(got) == sorted(want)
    if "model.safetensors.index.json" in want:
        w = json.loads(want["model.safetensors.index.json"])
        g = json.loads(got["model.safetensors.index.json"])
        assert g["weight_map"] == w["weight_map"]
        assert list(g["weight_map"]) == list(w["weight_map"])
        assert g["metadata"] == w["metadata"]
    # Beyond the parity the issue asks for: every file, index included, is byte-identical,
    # except the order of `__metadata__` keys, which safetensors writes from a hash map.
    for fname in want:
        assert same_safetensors(got[fname], want[fname]), fname


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_split_output_loads_in_torch(tmp_path, name):
    src = SOURCES[name]
    run_ckpt("split", src, tmp_path, "--max-shard-size", "0.1KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    original = load_source(src)
    again = load_source(tmp_path)
    assert list(again) != [] and set(again) == set(original)
    for k, v in original.items():
        assert again[k].dtype == v.dtype and again[k].shape == v.shape
        assert torch.equal(again[k].view(-1).view(torch.uint8) if v.numel() else again[k], v.view(-1).view(torch.uint8) if v.numel() else v), k


def test_merge_equals_save_file(tmp_path):
    src = SOURCES["sharded"]
    ours = tmp_path / "ours.safetensors"
    theirs = tmp_path / "theirs.safetensors"
    save_file(load_source(src), theirs, metadata={"format": "pt"})
    run_ckpt("merge", src, ours)
    assert ours.read_bytes() == theirs.read_bytes()


def test_merge_accepts_the_index_file(tmp_path):
    out = tmp_path / "m.safetensors"
    run_ckpt("merge", SOURCES["sharded"] / "model.safetensors.index.json", out)
    assert out.read_bytes() == SOURCES["single"].read_bytes()


def test_merge_keeps_metadata(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    sd = load_file(SOURCES["all_dtypes"])
    run_ckpt("split", SOURCES["all_dtypes"], shards, "--max-shard-size", "0.5KB")
    out = tmp_path / "merged.safetensors"
    run_ckpt("merge", shards, out)
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "statekit fixture"}
    merged = load_file(out)
    assert set(merged) == set(sd)
