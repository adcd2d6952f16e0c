"""A checkpoint written by `statekit-train` (2 MPI ranks, each writing its own shard through
`ckpt::save_sharded`) read by the tools users already have: `accelerate merge-weights` gives
the same bytes as `ckpt merge`, torch's `dcp.load` fills a state dict of the right shapes with
the same values (in one process, and into a real FSDP2 model on 3 ranks under torchrun), and
the optimizer folder unpacks into torch's optimizer state-dict structure."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import ROOT, run_ckpt

VENV = Path(sys.prefix)
TORCH_LIB = Path(torch.__file__).resolve().parent / "lib"
CHECK = ROOT / "tests" / "python" / "interop" / "dcp_check.py"


def train_bin() -> str:
    path = os.environ.get("TRAIN_BIN") or str(ROOT / "target" / "debug" / "statekit-train")
    if not os.path.exists(path):
        pytest.fail(f"statekit-train not found at {path}; build it first (make test does)")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{TORCH_LIB}:{env.get('LD_LIBRARY_PATH', '')}"
    args = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", train_bin(), "--mode", "sharded",
            "--steps", "6", "--save-every", "3", "--ckpt-dir", "ck", "--layers", "1", "--dim", "32",
            "--heads", "2", "--block-size", "16", "--untied"]
    proc = subprocess.run(args, cwd=d, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (d / "ck" / "latest").resolve().name == "step-0000006"
    return d / "ck"


def tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_ckpt_merge_equals_accelerate_merge_weights(run_dir, tmp_path):
    ours = tmp_path / "model.safetensors"
    run_ckpt("merge", run_dir / "latest", ours)
    out = tmp_path / "accelerate"
    proc = subprocess.run([str(VENV / "bin" / "accelerate"), "merge-weights", str(run_dir / "latest" / "pytorch_model_fsdp_0"),
                           str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors").read_bytes() == ours.read_bytes()
    t = tensors(ours)
    assert t["wte.weight"].shape == (64, 32) and t["lm_head.weight"].shape == (64, 32)
    assert "h.0.attn.c_attn.weight" in t


def test_dcp_load_fills_a_state_dict_of_the_right_shapes(run_dir, tmp_path):
    merged = tmp_path / "m.safetensors"
    run_ckpt("merge", run_dir / "latest", merged)
    want = tensors(merged)
    sd = {"model": {k: torch.full_like(v, -1.0) for k, v in want.items()}}
    dcp.load(sd, checkpoint_id=str(run_dir / "latest" / "pytorch_model_fsdp_0"), no_dist=True)
    for k, v in want.items():
        assert sd["model"][k].shape == v.shape
        assert torch.equal(sd["model"][k], v), k


def test_dcp_load_into_fsdp2_on_3_ranks(run_dir, tmp_path):
    ref = tmp_path / "ref.safetensors"
    run_ckpt("merge", run_dir / "latest", ref)
    proc = subprocess.run([sys.executable, str(CHECK), "load", str(run_dir / "latest" / "pytorch_model_fsdp_0"),
                           "--world-size", "3", "--reference", str(ref)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


def test_optimizer_folder_is_torch_optimizer_state(run_dir, tmp_path):
    out = tmp_path / "optim.pt"
    dcp_to_torch_save(str(run_dir / "latest" / "optimizer_0"), str(out))
    sd = torch.load(str(out), weights_only=True)["optimizer"]
    group = sd["param_groups"][0]
    assert group["betas"] == [0.9, 0.95] and group["weight_decay"] == pytest.approx(0.1)
    assert sorted(group["params"]) == sorted(sd["state"])
    w = sd["state"]["wte.weight"]
    assert w["exp_avg"].shape == (64, 32) and w["exp_avg_sq"].shape == (64, 32)
    assert w["step"].item() == 6.0
    assert (w["exp_avg_sq"] >= 0).all() and w["exp_avg_sq"].abs().sum() > 0


def test_ckpt_merge_optimizer_writes_the_moments_beside_the_model(run_dir, tmp_path):
    run_ckpt("merge", run_dir / "latest", tmp_path / "model.safetensors", "--optimizer")
    optim = tensors(tmp_path / "optimizer.safetensors")
    ref = tmp_path / "ref.pt"
    dcp_to_torch_save(str(run_dir / "latest" / "optimizer_0"), str(ref))
    state = torch.load(str(ref), weights_only=True)["optimizer"]["state"]
    for fqn, moments in state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim[f"state.{fqn}.{k}"], moments[k]), (fqn, k)
