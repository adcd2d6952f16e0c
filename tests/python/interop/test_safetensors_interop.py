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


def metadata_members(raw: bytes):
    """The `__metadata__` object of a safetensors file: its byte span in the file and the raw
    text of each `"key":"value"` member, as written."""
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].decode()
    tag = '"__metadata__":'
    at = header.find(tag)
    if at < 0:
        return None, []
    dec = json.JSONDecoder()
    i = at + len(tag)
    start = i
    assert header[i] == "{", header[:80]
    i += 1
    members = []
    while header[i] != "}":
        _, j = dec.raw_decode(header, i)  # the key
        assert header[j] == ":", header[i:j + 1]
        _, k = dec.raw_decode(header, j + 1)  # the value
        members.append(header[i:k])
        i = k + (header[k] == ",")
    # Byte offsets into the file (the header may hold UTF-8 beyond ASCII).
    return (8 + len(header[:start].encode()), 8 + len(header[: i + 1].encode())), members


def same_safetensors(a: bytes, b: bytes) -> bool:
    """Byte-identical files, except that the members of `__metadata__` may come in another
    order: safetensors writes them from a hash map, so their order changes from run to run.
    Everything else (the tensor entries, their order, the padding, the data) must be the same
    bytes, and so must each metadata member's text."""
    if a == b:
        return True
    (span_a, members_a), (span_b, members_b) = metadata_members(a), metadata_members(b)
    if span_a is None or span_a != span_b:
        return False
    (s, e) = span_a
    return a[:s] == b[:s] and a[e:] == b[e:] and sorted(members_a) == sorted(members_b)


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
    # except the order of the `__metadata__` members, which safetensors writes from a hash map.
    for fname in want:
        if fname.endswith(".json"):
            assert got[fname] == want[fname], fname
        else:
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
    # Split then merge is the identity: the very bytes of the source, metadata order included.
    assert out.read_bytes() == SOURCES["all_dtypes"].read_bytes()
