"""accelerate 1.15 + DeepSpeed 0.19.8 `save_state` folders (fixtures/accelerate/ds_z2_w2, ds_z3_w2,
ds_two_models_w2: ZeRO-2 / ZeRO-3 / one ZeRO-2 and one ZeRO-3 engine, written on 2 ranks) loaded by
the real `Accelerator.load_state` on M gloo ranks (`accelerate_ds_load_check.py`: builds the
generator worker's model(s) and plugin(s), loads, then gathers every parameter's fp32 master and
module weight and compares them bit for bit with DeepSpeed's own zero_to_fp32 output recorded in
expected_more.json, and checks exp_avg / exp_avg_sq, the Adam step, `accelerator.step` and the
scheduler).

- the control: each original folder at its own world size (2 ranks, DeepSpeed's native ZeRO files);
- `ckpt reshard DIR OUT --world-size M` (M = 3 and 1), then the checker on M ranks with
  `"checkpoint": {"load_universal": true}`: DeepSpeed reads OUT/<tag>/zero/ (the universal
  checkpoint) for every engine; the optimizer moments and learning rates must also equal the
  control's bit for bit;
- a negative control: a resharded folder with one fp32.pt changed must fail the checker.

Each torchrun takes ~7 s (OMP_NUM_THREADS=1, a free port per run, DS_ACCELERATOR=cpu).
"""

import json
import shutil
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, run_ckpt, torchrun

ACC = FIXTURES / "accelerate"
EXPECTED = ACC / "expected_more.json"
CHECK = ROOT / "tests" / "python" / "interop" / "accelerate_ds_load_check.py"
CASES = ("ds_z2_w2", "ds_z3_w2", "ds_two_models_w2")
SOURCE_WORLD = 2

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")


def load_check(folder, m, case, results, universal):
    """Runs the checker on m ranks; returns (exit code, per-rank results, output tail)."""
    shutil.rmtree(results, ignore_errors=True)
    args = ["--dir", folder, "--case", case, "--results", results] + (["--universal"] if universal else [])
    proc = torchrun(m, CHECK, *args, env={"DS_ACCELERATOR": "cpu"}, cwd=str(results.parent))
    ranks = []
    for r in range(m):
        p = Path(results) / f"rank{r}.json"
        ranks.append(json.loads(p.read_text())["accelerate_ds_load_check"] if p.exists() else None)
    return proc.returncode, ranks, (proc.stdout[-2000:] + proc.stderr[-4000:])


def assert_all_pass(rc, ranks, out, universal):
    assert all(r is not None for r in ranks), f"a rank gave no result (exit {rc}):\n{out}"
    for r in ranks:
        assert r["pass"], json.dumps(r, indent=1)
        assert r["step"]["got"] == 2
        for e in r["engines"].values():
            assert e["load_universal"] is universal
            assert e["global_steps"] == 2 and e["adam_steps"] == [2.0]
    assert rc == 0, out


_controls = {}


def control(case, tmp_path_factory):
    """The original folder on its own 2 ranks (run once per case and kept for comparisons)."""
    if case not in _controls:
        results = tmp_path_factory.mktemp(f"control_{case}") / "results"
        _controls[case] = load_check(ACC / case, SOURCE_WORLD, case, results, universal=False)
    return _controls[case]


def reshard_layout_ok(case, out, m):
    expected = json.loads(EXPECTED.read_text())[case]
    src = ACC / case
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert sorted(n for n in names if n.startswith("random_states_")) == [f"random_states_{r}.pkl" for r in range(m)]
    for r in range(m):
        assert (out / f"random_states_{r}.pkl").read_bytes() == (src / f"random_states_{r % SOURCE_WORLD}.pkl").read_bytes()
    assert (out / "latest").read_text() == expected["latest"]
    if (src / "scheduler.bin").exists():
        assert (out / "scheduler.bin").read_bytes() == (src / "scheduler.bin").read_bytes()
    for tag, z in expected["zero_to_fp32"].items():
        assert f"{tag}/zero/optimizer_state.pt" in names, sorted(names)
        for param in z["key_order"]:
            for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
                assert f"{tag}/zero/{param}/{f}" in names, (tag, param, f)
        # the model-states files DeepSpeed's _load_checkpoint globs for (ZeRO-2: mp_rank_00_model_states.pt,
        # ZeRO-3 universal: zero_pp_rank_0_mp_rank_*_model_states.pt), copied from the source
        for rel in expected["files"]:
            if rel.startswith(f"{tag}/") and rel.endswith("_model_states.pt"):
                assert (out / rel).read_bytes() == (src / rel).read_bytes(), rel


@pytest.mark.parametrize("case", CASES)
def test_original_folder_loads_at_its_world_size(tmp_path_factory, case):
    """The control: the folder accelerate wrote, loaded on the 2 ranks that wrote it (native ZeRO files)."""
    rc, ranks, out = control(case, tmp_path_factory)
    assert_all_pass(rc, ranks, out, universal=False)


@pytest.mark.parametrize("m", [3, 1])
@pytest.mark.parametrize("case", CASES)
def test_reshard_then_universal_load(tmp_path, tmp_path_factory, case, m):
    """`ckpt reshard` to m ranks, then real load_state with load_universal on m ranks: every engine's
    fp32 master and module weights equal zero_to_fp32's bit for bit, the Adam moments and learning
    rates equal the control's bit for bit, accelerator.step and the scheduler are restored."""
    out = tmp_path / f"{case}_to_{m}"
    run_ckpt("reshard", ACC / case, out, "--world-size", m)
    reshard_layout_ok(case, out, m)
    rc, ranks, log = load_check(out, m, case, tmp_path / "results", universal=True)
    assert_all_pass(rc, ranks, log, universal=True)
    _, want, _ = control(case, tmp_path_factory)
    assert want[0] is not None and want[0]["pass"], "the control failed"
    for r in ranks:
        assert sorted(r["engines"]) == sorted(want[0]["engines"])
        for tag, e in r["engines"].items():
            assert e["optim_sha256"] == want[0]["engines"][tag]["optim_sha256"], tag
            assert e["lrs"] == want[0]["engines"][tag]["lrs"], tag
        if "sched" in want[0]:
            assert r["sched"] == want[0]["sched"]


def test_checker_rejects_a_changed_weight(tmp_path):
    """Not vacuous: one element of one universal fp32.pt changed -> that parameter mismatches."""
    import torch

    out = tmp_path / "ds_z3_w2_to_3"
    run_ckpt("reshard", ACC / "ds_z3_w2", out, "--world-size", 3)
    f = out / "pytorch_model" / "zero" / "lin2.bias" / "fp32.pt"
    sd = torch.load(f, weights_only=False)  # ZeRO-3 universal: a plain tensor; ZeRO-2: {"param", "cat_dim"}
    t = (sd["param"] if isinstance(sd, dict) else sd).clone()
    t[0] += 1.0
    torch.save(dict(sd, param=t) if isinstance(sd, dict) else t, f)
    rc, ranks, log = load_check(out, 3, "ds_z3_w2", tmp_path / "results", universal=True)
    assert rc != 0 and all(r is not None for r in ranks), log
    for r in ranks:
        assert not r["pass"]
        e = r["engines"]["pytorch_model"]
        assert e["fp32_mismatch"] == ["lin2.bias"] and e["module_mismatch"] == ["lin2.bias"], e
