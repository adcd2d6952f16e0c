"""`Trainer` checkpoint folders resharded by `ckpt`, resumed by transformers' real `Trainer`.

The fixtures are `fixtures/trainer/` (made by `fixtures/gen/trainer_fixtures.py` with
transformers 5.24; see its README). `ckpt reshard CHECKPOINT OUT --world-size M` lays the folder
out for M ranks and carries every `Trainer` file (`trainer_state.json`, `scheduler.pt`,
`training_args.bin`, `config.json`, the RNG files by the rule rank r gets rank r mod N's). The
real `Trainer` then resumes from OUT on M gloo ranks (`trainer_check.py resume`): the model it
loads is the reference bit for bit, `global_step` is kept, and the optimizer, scheduler and RNG
states load. A DeepSpeed folder becomes a universal checkpoint (`global_stepN_universal/`,
`latest_universal`), which the `Trainer` loads with DeepSpeed's `load_universal`; an FSDP2
folder becomes DCP folders for M ranks.
"""

import json
import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT, run_ckpt

TRAINER = FIXTURES / "trainer"
CHECK = ROOT / "tests" / "python" / "interop" / "trainer_check.py"
MANIFEST = json.loads((TRAINER / "expected.json").read_text())["cases"]


def checkpoint(case):
    return TRAINER / case / MANIFEST[case]["checkpoint"]


# (case, kind for trainer_check, new world size, DeepSpeed universal)
CASES = [
    ("zero2_w2", "zero2", 3, True),
    ("zero3_w2", "zero3", 3, True),
    ("zero3_w2", "zero3", 1, True),
    ("fsdp2_sharded_w2", "fsdp2", 3, False),
    ("ddp_w2", "ddp", 3, False),
]


@pytest.mark.parametrize("case,kind,m,universal", CASES, ids=[f"{c[0]}-to-{c[2]}" for c in CASES])
def test_real_trainer_resumes_the_resharded_folder(tmp_path, case, kind, m, universal):
    out = tmp_path / "resharded"
    run_ckpt("reshard", checkpoint(case), out, "--world-size", m)
    src = checkpoint(case)
    for name in ("trainer_state.json", "scheduler.pt", "training_args.bin", "config.json"):
        assert (out / name).exists() == (src / name).exists(), name
    args = [sys.executable, str(CHECK), "resume", str(out), "--world-size", str(m), "--kind", kind,
            "--reference", str(TRAINER / case / "expected_model.safetensors"),
            "--grad-accum", str(MANIFEST[case]["case"].get("grad_accum", 1))]
    if universal:
        args.append("--universal")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"trainer_check exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "OK" in proc.stdout and f"global_step {MANIFEST[case]['trainer_state']['global_step']}" in proc.stdout


def test_inspect_json_shows_the_trainer(tmp_path):
    for case in MANIFEST:
        doc = json.loads(run_ckpt("inspect", checkpoint(case), "--json").stdout)
        assert doc["format"] == "trainer"
        comp = doc["components"]
        assert comp["trainer"]["global_step"] == MANIFEST[case]["trainer_state"]["global_step"]
        assert comp["world_size"] == MANIFEST[case]["case"]["world_size"]
        assert [r["rank"] for r in comp["rng"]] == list(range(MANIFEST[case]["case"]["world_size"]))
        assert comp["optimizers"], case
        assert comp["schedulers"][0]["values"]["last_epoch"] == MANIFEST[case]["scheduler"]["last_epoch"]
