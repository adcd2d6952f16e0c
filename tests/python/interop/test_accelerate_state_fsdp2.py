"""accelerate 1.15 FSDP2 `save_state` folders (fixtures/accelerate/fsdp2_w2, fsdp2_w3) loaded by
the real `Accelerator.load_state` on M gloo ranks (`accelerate_load_check.py`, which gathers the
model and optimizer and compares them bit for bit with the merged source folder, and checks the
scheduler, `accelerator.step`, each rank's RNG state and the DataLoader state).

- `ckpt reshard` of a whole save_state folder to M ranks, then the load check on M ranks;
- the original folders at their own world size (the control);
- the original folders loaded directly on another world size: DCP reshards the model and
  optimizer on load by itself, but ranks >= N find no `random_states_{r}.pkl` (RNG not restored,
  `accelerator.step` stays 0) — which is what a resharded folder must fix.

Each torchrun takes a few seconds (OMP_NUM_THREADS=1, a free port per run).
"""

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, run_ckpt, torchrun

ACC = FIXTURES / "accelerate"
EXPECTED = ACC / "expected_fsdp2.json"
CHECK = ROOT / "tests" / "python" / "interop" / "accelerate_load_check.py"
SOURCES = {"fsdp2_w2": 2, "fsdp2_w3": 3}


def load_check(folder, m, case, results, ignore=()):
    """Runs the checker on m ranks; returns (exit code, per-rank results, stderr tail)."""
    shutil.rmtree(results, ignore_errors=True)
    args = ["--dir", folder, "--reference", EXPECTED, "--case", case, "--results", results]
    if ignore:
        args += ["--ignore", ",".join(ignore)]
    proc = torchrun(m, CHECK, *args)
    ranks = []
    for r in range(m):
        p = Path(results) / f"rank{r}.json"
        ranks.append(json.loads(p.read_text())["accelerate_load_check"] if p.exists() else None)
    return proc.returncode, ranks, proc.stderr[-4000:]


def assert_all_pass(rc, ranks, err, n_source):
    assert all(r is not None for r in ranks), f"a rank gave no result (exit {rc}):\n{err}"
    for r in ranks:
        assert r["pass"], json.dumps(r, indent=1)
        assert r["rng_source_rank"] == r["rank"] % n_source, r["detail"]["rng"]
        assert r["detail"]["step"]["got"] == 3
    assert rc == 0, err


def reshard_layout_ok(out, m):
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    want = sorted(["dl_state_dict.bin", "scheduler.bin", "optimizer_0/.metadata", "pytorch_model_fsdp_0/.metadata"]
                  + [f"random_states_{r}.pkl" for r in range(m)])
    assert [n for n in names if not n.endswith(".distcp")] == want, names
    for d in ("pytorch_model_fsdp_0", "optimizer_0"):
        parts = sorted(p.name for p in (out / d).glob("*.distcp"))
        assert parts and all(p.startswith("__") and p.endswith("_0.distcp") for p in parts) and len(parts) <= m, parts


def test_fixture_files_are_the_recorded_ones():
    expected = json.loads(EXPECTED.read_text())
    for case, w in SOURCES.items():
        folder = ACC / case
        names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        assert names == expected[case]["files"]
        assert expected[case]["world_size"] == w


@pytest.mark.parametrize("case, m", [("fsdp2_w2", 3), ("fsdp2_w3", 2)])
def test_reshard_then_load_state(tmp_path, case, m):
    """(a) w2 -> 3 ranks, (b) w3 -> 2 ranks: `ckpt reshard` of the whole folder, then real
    load_state on m ranks gives the source's model, optimizer, scheduler, step, and rank r the
    RNG state of source rank r mod N."""
    out = tmp_path / f"{case}_to_{m}"
    run_ckpt("reshard", ACC / case, out, "--world-size", m)
    reshard_layout_ok(out, m)
    # The DataLoader state is checked on its own below (test_reshard_copies_dl_state).
    rc, ranks, err = load_check(out, m, case, tmp_path / "results", ignore=("dl",))
    assert_all_pass(rc, ranks, err, SOURCES[case])


@pytest.mark.parametrize("case, m", [("fsdp2_w2", 3), ("fsdp2_w3", 2)])
def test_reshard_copies_scheduler_and_moves_the_data_position(tmp_path, case, m):
    """scheduler.bin is copied as it is; dl_state_dict.bin is moved by the N -> M rule. accelerate
    1.15 saves `_num_yielded` = batches this rank yielded and hands it back unchanged on load,
    where `BatchSamplerShard` skips that many rounds of M batches: the N*k batches read before
    are floor(N*k/M) per rank on M ranks. Everything else in the state stays."""
    import torch

    n = SOURCES[case]
    out = tmp_path / f"{case}_to_{m}"
    run_ckpt("reshard", ACC / case, out, "--world-size", m)
    sched = torch.load(out / "scheduler.bin", weights_only=False)
    assert sched == torch.load(ACC / case / "scheduler.bin", weights_only=False)
    got = torch.load(out / "dl_state_dict.bin", weights_only=True)
    want = torch.load(ACC / case / "dl_state_dict.bin", weights_only=True)
    k = want["_num_yielded"]
    moved = dict(want, _num_yielded=n * k // m, _sampler_iter_yielded=n * want["_sampler_iter_yielded"] // m)
    assert got == moved, f"{got} != {moved}"


@pytest.mark.parametrize("case", sorted(SOURCES))
def test_original_folder_loads_at_its_world_size(tmp_path, case):
    """(c) the control: the folder accelerate wrote, loaded on as many ranks as wrote it."""
    rc, ranks, err = load_check(ACC / case, SOURCES[case], case, tmp_path / "results")
    assert_all_pass(rc, ranks, err, SOURCES[case])


def test_native_load_on_more_ranks_misses_rng(tmp_path):
    """Without a reshard: DCP reshards model and optimizer on load (2 -> 3 ranks works for them),
    but rank 2 has no random_states_2.pkl, so its RNG is not restored and its step stays 0
    (and accelerate's "Could not load random states" is logged by the main process only)."""
    rc, ranks, err = load_check(ACC / "fsdp2_w2", 3, "fsdp2_w2", tmp_path / "results", ignore=("rng", "step"))
    assert rc == 0 and all(r is not None for r in ranks), err
    for r in ranks:
        assert all(r["ok"][c] for c in ("model", "optim", "sched", "dl")), r["ok"]
        missing = r["rank"] >= 2
        assert r["detail"]["rng"]["file_present"] is not missing
        assert r["ok"]["rng"] is not missing and r["ok"]["step"] is not missing
        assert r["detail"]["step"]["got"] == (0 if missing else 3)
        assert not r["log_could_not_load_random_states"]
