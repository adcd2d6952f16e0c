"""A real accelerate 1.15 training script with the one `statekit.accelerate.patch` line
(`accelerate_dropin_job.py`), killed with SIGKILL mid-epoch on 2 ranks after a `save_state`,
resumed through `load_state` on 3, with the seedable sampler and with accelerate's default
shuffle (a `RandomSampler` and its generator): every sample of the epoch is trained on exactly
once (the samples trained after the save are lost with the kill and trained again). The folder it saved is
read by the `ckpt` CLI as it reads accelerate's own, and over whole evaluation epochs
`gather_for_metrics` gives what it gives over accelerate's own loaders (per rank and dispatched,
map-style datasets that do and do not divide by the global batch, streams with and without a
length).

torchrun with gloo on CPU, 100 samples, batch size 4, a linear model: a few seconds a run.
"""

import json
import os
import signal
import socket
import subprocess
import time

import pytest
import torch

from conftest import ROOT, VENV_BIN, run_ckpt, torchrun

JOB = ROOT / "tests" / "python" / "data" / "accelerate_dropin_job.py"
N, BATCH, SAVE_AT, SEED = 100, 4, 5, 1234


def start_torchrun(nproc, *args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(JOB), *map(str, args)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def trained(path, before=None):
    ids = []
    for line in path.read_text().splitlines():
        step, *batch = map(int, line.split())
        if before is None or step < before:
            ids += batch
    return ids


@pytest.mark.parametrize("shuffle", ["seedable", "default"])
def test_killed_on_2_ranks_resumed_on_3_trains_every_sample_once(tmp_path, shuffle):
    proc = start_torchrun(2, "train", tmp_path, SAVE_AT, shuffle)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "past_save").exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the training run never got past its save"
            time.sleep(0.2)
        for rank in range(2):  # torchrun's workers have sessions of their own: each is killed
            os.kill(int((tmp_path / f"pid.rank{rank}").read_text()), signal.SIGKILL)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    per_rank_steps = -(-N // (BATCH * 2))
    for rank in range(2):
        steps = [int(line.split()[0]) for line in (tmp_path / f"train.rank{rank}.txt").read_text().splitlines()]
        assert steps == list(range(SAVE_AT + 2)) and len(steps) < per_rank_steps, "killed mid-epoch, past the save"

    ckpt = tmp_path / "ckpt"
    saved = torch.load(ckpt / "dl_state_dict.bin", weights_only=True)
    assert saved["_num_yielded"] == SAVE_AT
    # the CLI reads the folder as it reads accelerate's: the same position, in batches and samples
    assert "dl_state_dict.bin (dl_state_dict: batches yielded 5, finished false)" in run_ckpt("inspect", ckpt).stdout
    if shuffle == "seedable":  # (the CLI's --shuffle is the seedable sampler's)
        state = json.loads(run_ckpt("data", "state", "--from-accelerate", ckpt, "--len", N, "--batch-size", BATCH,
                                    "--shuffle", "--seed", SEED, "--json").stdout)
        for key in ("epoch", "cursor", "world_size", "dataset_len", "batch_size", "sampler"):
            assert state[key] == saved["_index_sampler_state"][key], key

    # `ckpt reshard` rewrites accelerate's counts for 3 ranks and keeps statekit's position as it was
    run_ckpt("reshard", "--world-size", 3, ckpt, tmp_path / "ckpt3")
    resharded = torch.load(tmp_path / "ckpt3" / "dl_state_dict.bin", weights_only=True)
    assert resharded["_num_yielded"] == 2 * SAVE_AT // 3
    assert resharded["_index_sampler_state"] == saved["_index_sampler_state"]

    res = torchrun(3, JOB, "resume", tmp_path, ckpt, shuffle, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = [i for r in range(2) for i in trained(tmp_path / f"train.rank{r}.txt", before=SAVE_AT)]
    seen += [i for r in range(3) for i in trained(tmp_path / f"resume.rank{r}.txt")]
    assert sorted(seen) == list(range(N)), "every sample of the epoch once"

    if shuffle != "seedable":
        return
    cases = json.loads((tmp_path / "eval.json").read_text())
    assert len(cases) == 10
    for name, got in cases.items():
        assert got["statekit"] == got["accelerate"], name
        assert got["statekit len, steps"] == got["accelerate len, steps"], name
        if name.startswith("map") or "dispatch1" in name:
            # (a stream sharded per rank keeps its padding: accelerate's `remainder` is 0 there)
            n = int(name.split(" n")[1].split()[0])
            assert sorted(got["statekit"]) == list(range(n)), name
