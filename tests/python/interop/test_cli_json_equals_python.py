"""The CLI's `--json` and the Python package's results are one document: for each kind of
checkpoint, `ckpt inspect --json`, `ckpt verify --json` and each operation's `--json` parse to
exactly the `document` that `statekit.ckpt` returns for the same call, and the result objects'
attributes are read from it.

Both sides run the same call: the same absolute source, the same relative output path, each
from its own working directory, so every path in the two documents is the same text."""

import json
import os

import pytest

from conftest import FIXTURES, run_ckpt
from statekit import ckpt

SAFETENSORS = FIXTURES / "safetensors" / "model_single" / "model.safetensors"
SHARDED = FIXTURES / "safetensors" / "model_sharded"
TORCH_TIED = FIXTURES / "torch" / "tied.pt"
TORCH_VIEWS = FIXTURES / "torch" / "views.pt"
DCP = FIXTURES / "dcp" / "fsdp2_w2_f32" / "checkpoint"
DEEPSPEED = FIXTURES / "deepspeed" / "z2_bf16_ws3"
ACCELERATE = FIXTURES / "accelerate" / "fsdp2_w2"
MEGATRON = FIXTURES / "megatron" / "tp2" / "ckpt"
BROKEN = FIXTURES / "hostile" / "safetensors" / "missing_shard"

# (source, the CLI's arguments after `ckpt OP SRC OUT`, the Python call with the same options)
OPERATIONS = {
    "split-safetensors": ("split", SAFETENSORS, "shards", ["--max-shard-size", "2KB"], {"max_shard_size": "2KB"}),
    "merge-sharded": ("merge", SHARDED, "merged.safetensors", [], {}),
    "convert-sharded-to-torch": ("convert", SHARDED, "model.bin", [], {}),
    "convert-torch-dedupe": ("convert", TORCH_TIED, "tied.safetensors", ["--dedupe"], {"dedupe": True}),
    "convert-safetensors-to-dcp": (
        "convert", SAFETENSORS, "dcp", ["--to", "dcp", "--world-size", "2"], {"to": "dcp", "world_size": 2},
    ),
    "merge-dcp": ("merge", DCP, "merged.safetensors", [], {}),
    "reshard-dcp": ("reshard", DCP, "w3", ["--world-size", "3"], {"world_size": 3}),
    "merge-deepspeed": ("merge", DEEPSPEED, "merged.safetensors", ["--optimizer"], {"optimizer": True}),
    "reshard-deepspeed": ("reshard", DEEPSPEED, "w2", ["--world-size", "2"], {"world_size": 2}),
    "merge-accelerate": ("merge", ACCELERATE, "merged.safetensors", [], {}),
    "reshard-accelerate": ("reshard", ACCELERATE, "w3", ["--world-size", "3"], {"world_size": 3}),
    "merge-megatron": ("merge", MEGATRON, "merged.safetensors", [], {}),
    "merge-megatron-as-stored": ("merge", MEGATRON, "stored.safetensors", ["--as-stored"], {"as_stored": True}),
}


def cli_document(*args, cwd, check=True):
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return json.loads(run_ckpt(*args, "--json", check=check).stdout)
    finally:
        os.chdir(here)


@pytest.mark.parametrize("src", [SAFETENSORS, SHARDED, TORCH_TIED, TORCH_VIEWS, DCP, DEEPSPEED, ACCELERATE, MEGATRON])
def test_inspect_is_one_document(src, tmp_path):
    doc = cli_document("inspect", src, cwd=tmp_path)
    info = ckpt.inspect(src)
    assert info.document == doc
    assert doc["schema"] == "statekit.inspect/2"
    assert (info.format, info.root, info.total_bytes) == (doc["format"], doc["path"], doc["totals"]["bytes"])
    assert info.files == [f["path"] for f in doc["files"]]
    assert [(t.name, t.dtype, list(t.shape), t.nbytes) for t in info.tensors] == [
        (t["name"], t["dtype"], t["shape"], t["bytes"]) for t in doc["tensors"]
    ]
    assert (info.world_size, info.zero_stage, info.metadata) == (doc["world_size"], doc["zero_stage"], doc["metadata"])
    assert info.components == doc.get("components")
    assert info.megatron == doc.get("megatron")
    assert (info.megatron is not None) == (src == MEGATRON)


@pytest.mark.parametrize("src", [SAFETENSORS, SHARDED, TORCH_TIED, DCP, DEEPSPEED, ACCELERATE, MEGATRON, BROKEN])
def test_verify_is_one_document(src, tmp_path):
    doc = cli_document("verify", src, cwd=tmp_path, check=False)
    report = ckpt.verify(src)
    assert report.document == doc
    assert doc["schema"] == "statekit.verify/1"
    assert (report.valid, report.problems, report.tensors) == (doc["valid"], doc["problems"], doc["tensors"])
    assert report.valid == (src != BROKEN)


@pytest.mark.parametrize("case", sorted(OPERATIONS))
def test_each_operation_is_one_document(case, tmp_path, monkeypatch):
    op, src, out, args, kwargs = OPERATIONS[case]
    (tmp_path / "cli").mkdir()
    (tmp_path / "py").mkdir()
    doc = cli_document(op, src, out, *args, cwd=tmp_path / "cli")
    monkeypatch.chdir(tmp_path / "py")
    got = getattr(ckpt, op)(src, out, **kwargs)
    assert got.document == doc
    assert doc["schema"] == "statekit.outcome/2" and doc["files"]
    assert (got.files, got.tensors, got.bytes, got.world_size) == (doc["files"], doc["tensors"], doc["bytes"], doc["world_size"])
    assert got.aliases == [tuple(a) for a in doc["aliases"]] and got.values == doc["values"]
    # Both wrote the same files.
    assert sorted(p.relative_to(tmp_path / "cli") for p in (tmp_path / "cli").rglob("*")) == sorted(
        p.relative_to(tmp_path / "py") for p in (tmp_path / "py").rglob("*")
    )
