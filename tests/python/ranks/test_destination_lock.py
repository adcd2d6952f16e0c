"""One writer per destination, from Python: a second process writing the destination another is
writing raises `DestinationLocked` with that process's pid, whichever of the two is `ckpt` or
Python; and the ranks of a torchrun job given different destinations are refused before any
writes, not left to race."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ckpt_bin, run_ckpt, torchrun
from statekit import ckpt
from statekit.errors import DestinationLocked, DestinationsDiffer, ShardedSaveError

HERE = Path(__file__).parent


def big_source(path: Path, mib: int = 16) -> Path:
    from safetensors.numpy import save_file

    n = mib << 18  # float32 elements in `mib` MiB, over four tensors
    save_file({f"layers.{i}.weight": np.full(n // 4, i + 1, dtype=np.float32) for i in range(4)}, str(path))
    return path


def stopped_holding(cmd, lock: Path) -> subprocess.Popen:
    """Starts `cmd` and stops it (SIGSTOP) while it holds the lock file `lock`: it names the
    process, also after the stop (a holder removes the file before it releases the lock)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    names_it = f"pid {proc.pid}\n"

    def holds() -> bool:
        try:
            return lock.read_text().endswith(names_it)
        except OSError:
            return False

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if holds():
            os.kill(proc.pid, signal.SIGSTOP)
            if holds():
                return proc
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is not None:
            pytest.fail(f"{cmd} finished (exit {proc.returncode}) before it was seen holding {lock}")
    proc.kill()
    pytest.fail(f"{cmd} never took {lock}")


def python_split(src: Path, out: Path) -> list:
    code = "import sys; from statekit import ckpt; ckpt.split(sys.argv[1], sys.argv[2], max_shard_size='5MB')"
    return [sys.executable, "-c", code, str(src), str(out)]


@pytest.mark.parametrize("first", ["python", "ckpt"])
def test_a_second_writer_of_one_destination_raises_with_the_first_ones_pid(tmp_path, first):
    src = big_source(tmp_path / "big.safetensors")
    out, lock = tmp_path / "out", tmp_path / ".out.lock"
    cmd = python_split(src, out) if first == "python" else [ckpt_bin(), "split", str(src), str(out), "--max-shard-size", "5MB"]
    holder = stopped_holding(cmd, lock)
    try:
        with pytest.raises(DestinationLocked) as refused:
            ckpt.split(src, out, max_shard_size="1MB")
        e = refused.value
        assert (e.pid, e.lock, e.path) == (holder.pid, str(lock), str(out))
        assert f"{out}: another process (pid {holder.pid}) is writing it now" in str(e)
        with pytest.raises(DestinationLocked):
            ckpt.merge(src, out)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert holder.wait(timeout=120) == 0
    assert ckpt.verify(out).valid
    assert len(list(out.glob("*.safetensors"))) == 4, "the first writer's 5 MB shards, not the refused 1 MB ones"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors", "out"], "no lock, no temporary left"


def test_a_killed_python_writers_lock_is_taken_over(tmp_path):
    src = big_source(tmp_path / "big.safetensors")
    merged, lock = tmp_path / "merged.safetensors", tmp_path / ".merged.safetensors.lock"
    code = "import sys; from statekit import ckpt; ckpt.merge(sys.argv[1], sys.argv[2])"
    holder = stopped_holding([sys.executable, "-c", code, str(src), str(merged)], lock)
    holder.kill()
    holder.wait()
    assert lock.read_text().endswith(f"pid {holder.pid}\n"), "left behind, naming a process that is gone"
    ckpt.merge(src, merged)
    assert run_ckpt("verify", merged).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors", "merged.safetensors"]


def test_torchrun_ranks_given_different_destinations_are_refused_before_writing(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "m.safetensors"
    save_file({f"w{i}": np.ones((16, 16), dtype=np.float32) for i in range(4)}, str(src))
    proc = torchrun(2, HERE / "destination_job.py", src, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = [json.loads((tmp_path / f"raised_{r}.json").read_text()) for r in range(2)]
    assert raised[1]["class"] == DestinationsDiffer.__name__, raised
    assert raised[1]["fields"] == {"path": str(tmp_path / "split0"), "rank": 1, "other": str(tmp_path / "split1")}
    assert raised[1]["message"] == (
        f"{tmp_path / 'split0'}: rank 1 was given `{tmp_path / 'split1'}` as its destination; every rank of a job "
        "must name the destination rank 0 names"
    )
    assert raised[0]["class"] == ShardedSaveError.__name__ and "rank 1 failed" in raised[0]["message"], raised
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["m.safetensors", "raised_0.json", "raised_1.json"], "nothing written, no lock left"
