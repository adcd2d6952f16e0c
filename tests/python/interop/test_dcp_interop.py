"""DCP folders written by `ckpt reshard` and `ckpt convert --to dcp`, checked with real torch 2.13.

Each output is loaded by `torch.distributed.checkpoint.load` into an FSDP2 model on M gloo ranks
(`dcp_check.py load`, which gathers every tensor and compares its bytes with the reference), for
world sizes that divide the dims and ones that do not (3, 5: `embed.weight` has 37 rows and
`layers.1.weight` 3, so some ranks hold nothing), and M = 1. Optimizer state and the non-tensor
`param_groups` are checked through torch's own `dcp_to_torch_save` (`dcp_check.py merge`). Each
torch run takes 10-20 s, so only representative cases are here; the Rust fixture table covers
every fixture and world size without torch.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from conftest import FIXTURES, ROOT, run_ckpt

DCP = FIXTURES / "dcp"
CHECK = ROOT / "tests" / "python" / "interop" / "dcp_check.py"


def dcp_check(*args):
    proc = subprocess.run([sys.executable, str(CHECK), *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, f"dcp_check {args[0]} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def tensors(path, prefix=""):
    with safe_open(str(path), "pt") as f:
        return {prefix + k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        assert got[k].reshape(-1).view(torch.uint8).equal(want[k].reshape(-1).view(torch.uint8)), k


def torch_value_names(dcp_dir, strip=""):
    """The names torch gave the non-tensor values of a checkpoint it saved: the keys its
    `.metadata` lists as `BytesStorageMetadata` (DCP's own flattening), less `strip`."""
    md = FileSystemReader(str(dcp_dir)).read_metadata()
    names = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert names and all(n.startswith(strip) for n in names), sorted(names)[:5]
    return {n[len(strip):] for n in names}


def files_for(out, m):
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == ".metadata"
    assert all(n.startswith("__") and n.endswith("_0.distcp") for n in names[1:])
    assert len(names) - 1 <= m


@pytest.mark.parametrize("m", [3, 1])
def test_reshard_model_and_optimizer(tmp_path, m):
    """A `{model, optim}` checkpoint of 4 ranks, resharded: the model loads on m ranks, and
    torch's own merge of the result gives every optimizer tensor and `param_groups` value."""
    case = DCP / "fsdp2_w4_f32"
    out = tmp_path / f"w{m}"
    run_ckpt("reshard", case / "checkpoint", out, "--world-size", m)
    files_for(out, m)
    dcp_check("load", out, "--world-size", m, "--reference", case / "expected_model.safetensors")

    merged = tmp_path / "torch_merge.safetensors"
    dcp_check("merge", out, merged)
    got, meta = tensors(merged)
    want, _ = tensors(case / "expected_model.safetensors", "model.")
    want.update(tensors(case / "expected_optim.safetensors", "optim.")[0])
    assert_same(got, want)
    values = json.loads(meta["statekit.non_tensor"])
    assert set(values) == torch_value_names(case / "checkpoint")
    expected = json.loads((case / "expected_optim.json").read_text())["non_tensor_leaves"]
    assert values == {f"optim.{k}": v["value"] for k, v in expected.items()}


def test_reshard_accelerate_dirs(tmp_path):
    """accelerate's `pytorch_model_fsdp_0/` (bf16, 3 ranks) to 5 ranks, and its `optimizer_0/`."""
    case = DCP / "accelerate_w3_bf16"
    model = tmp_path / "pytorch_model_fsdp_0"
    run_ckpt("reshard", case / "checkpoint" / "pytorch_model_fsdp_0", model, "--world-size", 5)
    dcp_check("load", model, "--world-size", 5, "--reference", case / "expected_model.safetensors")

    optim = tmp_path / "optimizer_0"
    run_ckpt("reshard", case / "checkpoint" / "optimizer_0", optim, "--world-size", 2)
    merged = tmp_path / "optim.safetensors"
    dcp_check("merge", optim, merged)
    got, meta = tensors(merged)
    assert_same(got, tensors(case / "expected_optim.safetensors")[0])
    values = json.loads(meta["statekit.non_tensor"])
    # accelerate saved `{"optimizer": ...}`; the merge unwraps the single top-level key.
    assert set(values) == torch_value_names(case / "checkpoint" / "optimizer_0", strip="optimizer.")
    expected = json.loads((case / "expected_optim.json").read_text())["non_tensor_leaves"]
    assert values == {k: v["value"] for k, v in expected.items()}


@pytest.mark.parametrize("case,m", [("fsdp2_w4_mixed_bare", 5), ("fsdp2_w3_bf16", 2)])
def test_convert_safetensors_to_dcp(tmp_path, case, m):
    """A plain model file (mixed bf16/f32 with an int64 buffer; bf16) laid out for m ranks."""
    ref = DCP / case / "expected_model.safetensors"
    out = tmp_path / "dcp"
    run_ckpt("convert", ref, out, "--to", "dcp", "--world-size", m)
    files_for(out, m)
    dcp_check("load", out, "--world-size", m, "--reference", ref)


def test_merge_matches_torch_merge(tmp_path):
    """`ckpt merge` of a combined 8-rank bf16 checkpoint holds what torch's `dcp_to_torch_save`
    gives, tensor for tensor and value for value."""
    src = DCP / "fsdp2_w8_bf16" / "checkpoint"
    ours = tmp_path / "ours.safetensors"
    run_ckpt("merge", src, ours)
    theirs = tmp_path / "theirs.safetensors"
    dcp_check("merge", src, theirs)
    got, meta = tensors(ours)
    want, their_meta = tensors(theirs)
    assert_same(got, want)
    values = {k: json.loads(v) for k, v in meta.items() if k != "format"}
    assert set(values) == torch_value_names(src)
    assert values == json.loads(their_meta["statekit.non_tensor"])
