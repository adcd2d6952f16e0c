"""statekit.ckpt.save_sharded from a real FSDP2 job (torchrun, gloo, CPU): the DCP folder it
writes is read by torch's dcp.load, accelerate merge-weights and ckpt merge, to the same bits."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

from conftest import VENV_BIN, torchrun
from statekit import ckpt
from statekit.errors import ShardedSaveError

HERE = Path(__file__).resolve().parent


def run_job(tmp_path, world):
    proc = torchrun(world, HERE / "bindings_sharded_job.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "expected.pt", weights_only=True)


@pytest.mark.parametrize("world", [2, 3])
def test_save_sharded_from_fsdp2_reads_everywhere(tmp_path, world):
    expected = run_job(tmp_path, world)
    full = expected["full"]
    folder = tmp_path / "ckpt"
    assert sorted(os.listdir(folder)) == sorted([".metadata"] + [f"__{r}_0.distcp" for r in range(world)])

    # torch's own reader, in one process
    target = {"model": {k: torch.empty_like(v) for k, v in full.items()}}
    dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    for k, v in full.items():
        assert torch.equal(target["model"][k], v), k

    # statekit's reader and ckpt merge (a folder holding only `model` is opened as the model,
    # as accelerate's save_state folders are)
    got = ckpt.load(folder, framework="torch")
    assert sorted(got) == sorted(full)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    out = ckpt.merge(folder, tmp_path / "merged.safetensors")
    merged = safetensors.torch.load_file(tmp_path / "merged.safetensors")
    assert out.tensors == len(full)
    for k, v in full.items():
        assert torch.equal(merged[k], v), k

    # accelerate merge-weights
    proc = subprocess.run([str(VENV_BIN / "accelerate"), "merge-weights", str(folder), str(tmp_path / "acc")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = safetensors.torch.load_file(tmp_path / "acc" / "model.safetensors")
    assert sorted(acc) == sorted(full)
    for k, v in full.items():
        assert torch.equal(acc[k], v), k


def test_save_sharded_on_one_rank_without_a_process_group_keeps_values(tmp_path):
    sd = {"model": {"w": torch.randn(5, 3), "b": torch.arange(4)}, "optim": {"param_groups": [{"lr": 0.5, "params": [0, 1], "name": "g"}]}}
    out = ckpt.save_sharded(sd, tmp_path / "c", rank=0, world_size=1)
    assert out.tensors == 2
    target = {"model": {"w": torch.empty(5, 3), "b": torch.empty(4, dtype=torch.int64)}, "optim": {"param_groups": [{"lr": 0.0, "params": [], "name": ""}]}}
    dcp.load(target, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert torch.equal(target["model"]["w"], sd["model"]["w"]) and torch.equal(target["model"]["b"], sd["model"]["b"])
    assert target["optim"]["param_groups"] == sd["optim"]["param_groups"]
    with pytest.raises(ShardedSaveError, match="already exists"):
        ckpt.save_sharded(sd, tmp_path / "c", rank=0, world_size=1)


def test_a_save_failing_on_one_rank_raises_the_same_exception_on_every_rank(tmp_path):
    world = 3
    proc = torchrun(world, HERE / "sharded_failure_job.py", tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    raised = [json.loads((tmp_path / f"raised{r}.json").read_text()) for r in range(world)]
    for case, cls, cause in [("tensor", "BadOutput", "BadSaveTensor"), ("destination", "DestinationsDiffer", "DestinationsDiffer")]:
        first = raised[0][case]
        assert not first["ok"], (case, first)
        assert "ShardedSaveError" in first["bases"] and cls in first["bases"], (case, first)
        assert (first["variant"], first["rank"], first["cause"]) == ("ShardedSave", 1, cause), (case, first)
        assert first["message"].startswith("sharded save failed on rank 1: "), (case, first)
        for r in range(1, world):
            assert raised[r][case] == first, (case, r, raised[r][case], first)
    assert "whole rows" in raised[0]["tensor"]["message"], raised[0]
    assert all(r["after"]["ok"] for r in raised), raised
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["after"], "nothing else committed"
