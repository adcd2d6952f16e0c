"""`ckpt merge` on DeepSpeed ZeRO checkpoints, checked against real DeepSpeed 0.19.8.

Two ways: the merged files must equal, byte for byte, what DeepSpeed's own `zero_to_fp32`
writes (run here on the fixture, untied cases, where `--safe_serialization` works); and real
DeepSpeed resuming the checkpoint on its ranks (`ds_check.py resume`) must hold exactly the
weights and Adam moments that `ckpt merge --optimizer` wrote. Each resume starts torchrun with
DeepSpeed on CPU, so only a few representative cases run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, files_of, run_ckpt

DS = FIXTURES / "deepspeed"
VENV_PY = "/opt/statekit-venv/bin/python"


def have_deepspeed() -> bool:
    if not os.path.exists(VENV_PY):
        return False
    probe = subprocess.run([VENV_PY, "-c", "import deepspeed"], capture_output=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return probe.returncode == 0


needs_ds = pytest.mark.skipif(not have_deepspeed(), reason="DeepSpeed 0.19.8 venv not present")


@needs_ds
@pytest.mark.parametrize("case,shard", [("z3_fp32_ws4_untied", None), ("z2_fp32_ws2_untied", "2KB")])
def test_merge_equals_zero_to_fp32_run_now(tmp_path, case, shard):
    ref = tmp_path / "ref"
    cmd = [VENV_PY, "-m", "deepspeed.utils.zero_to_fp32", str(DS / case), str(ref), "--safe_serialization"]
    if shard:
        cmd += ["--max_shard_size", shard]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    out = tmp_path / "ours"
    if shard:
        run_ckpt("merge", DS / case, out, "--max-shard-size", shard)
    else:
        out.mkdir()
        run_ckpt("merge", DS / case, out / "model.safetensors")
    assert files_of(out) == files_of(ref)


@needs_ds
@pytest.mark.parametrize(
    "case,stage,dtype,world,extra",
    [
        ("z2_bf16_ws3", 2, "bf16", 3, []),
        ("z3_fp32_ws4_sg50", 3, "fp32", 4, ["--sub-group-size", "50"]),
    ],
)
def test_deepspeed_resume_holds_what_merge_wrote(tmp_path, case, stage, dtype, world, extra):
    out = tmp_path / "model.safetensors"
    run_ckpt("merge", DS / case, out, "--optimizer")
    proc = subprocess.run(
        [VENV_PY, str(ROOT / "tests/python/interop/ds_check.py"), "resume", str(DS / case), "--world-size", str(world),
         "--stage", str(stage), "--dtype", dtype, "--reference", str(out),
         "--optim-reference", str(tmp_path / "optimizer.safetensors"), *extra],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_merge_refuses_a_foreign_global(tmp_path):
    bad = FIXTURES / "hostile/deepspeed/foreign_global"
    proc = run_ckpt("merge", bad, tmp_path / "m.safetensors", check=False)
    assert proc.returncode == 2
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: refusing global `posix.system`" in proc.stderr
    assert not (tmp_path / "m.safetensors").exists()


@needs_ds
@pytest.mark.parametrize(
    "case,stage,dtype,worlds,extra",
    [
        ("z2_bf16_ws3", 2, "bf16", [2, 4], []),
        ("z3_fp32_ws4_sg50", 3, "fp32", [3], ["--sub-group-size", "50"]),
        ("z1_fp32_ws4", 1, "fp32", [3], []),
    ],
)
def test_deepspeed_resumes_reshard_on_other_world_sizes(tmp_path, case, stage, dtype, worlds, extra):
    """`ckpt reshard` writes a universal checkpoint; real DeepSpeed resumes it on M ranks
    (`load_universal`) holding exactly the weights and Adam moments of `ckpt merge --optimizer`."""
    ref = tmp_path / "model.safetensors"
    run_ckpt("merge", DS / case, ref, "--optimizer")
    for world in worlds:
        uni = tmp_path / f"uni{world}"
        run_ckpt("reshard", DS / case, uni, "--world-size", str(world))
        assert (uni / "latest_universal").read_text() == "global_step2_universal"
        proc = subprocess.run(
            [VENV_PY, str(ROOT / "tests/python/interop/ds_check.py"), "resume", str(uni), "--world-size", str(world),
             "--stage", str(stage), "--dtype", dtype, "--reference", str(ref),
             "--optim-reference", str(tmp_path / "optimizer.safetensors"), "--universal", *extra],
            capture_output=True, text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
