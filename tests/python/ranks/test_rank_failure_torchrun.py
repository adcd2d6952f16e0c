"""A rank of a torchrun job (gloo, CPU) that fails alone inside `statekit.ckpt.merge`, while
opening its source or while planning: every other rank raises a statekit error naming it
(`OtherRank`), none waits for it, nothing is written, and the ranks stay in step for the next
operation."""

import json
from pathlib import Path

import numpy as np

from conftest import torchrun
from statekit import ckpt

HERE = Path(__file__).parent


def test_a_rank_failing_alone_makes_the_others_raise_naming_it(tmp_path):
    from safetensors.numpy import save_file

    world = 3
    src = tmp_path / "model.safetensors"
    save_file({f"w{i}": np.full((64, 64), i, dtype=np.float32) for i in range(6)}, str(src))
    out = tmp_path / "out"
    out.mkdir()
    # Each operation takes well under a second: a rank left waiting would hold the job past this.
    proc = torchrun(world, HERE / "rank_failure_job.py", src, out, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    causes = [("open", "missing.safetensors"), ("plan", "`model` applies to accelerate `save_state` folders only")]
    for phase, cause in causes:
        failed = done[1][phase]
        assert not failed["ok"] and failed["statekit"], (phase, failed)
        assert cause in failed["message"], (phase, failed)
        for r in (0, 2):
            other = done[r][phase]
            assert not other["ok"] and other["statekit"], (phase, r, other)
            assert other["variant"] == "OtherRank" and "rank 1 failed" in other["message"], (phase, r, other)
        assert not (out / f"{phase}.safetensors").exists(), phase
    assert all(d["after"]["ok"] for d in done), done
    ckpt.merge(src, tmp_path / "one.safetensors")
    assert (out / "after.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["after.safetensors", "rank0.json", "rank1.json", "rank2.json"]
