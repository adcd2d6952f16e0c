"""statekit.ckpt's operations called from every rank of a torchrun job (gloo, CPU): one
operation over the job's ranks, each writing its share, with the bytes one process writes."""

from pathlib import Path

import numpy as np
import pytest

from conftest import torchrun
from statekit import ckpt

HERE = Path(__file__).parent
FIXTURES = HERE.parent.parent.parent / "fixtures"


def tree(root: Path) -> dict:
    """Every file under `root` (a file: itself), by relative path, with its bytes; a DCP
    `.metadata`'s `save_id` (a fresh UUID per save) is left out of the comparison."""
    root = Path(root)
    if root.is_file():
        return {"": root.read_bytes()}
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == ".metadata":
                at = data.find(b"save_id")
                data = data[:at] if at >= 0 else data
            out[str(p.relative_to(root))] = data
    return out


@pytest.mark.parametrize("world", [2])
def test_every_rank_calls_the_operation_and_gets_the_one_process_bytes(tmp_path, world):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    src = tmp_path / "model.safetensors"
    save_file({f"layers.{i}.weight": rng.standard_normal((256, 512), dtype=np.float32) for i in range(12)}, str(src))
    dcp = FIXTURES / "dcp" / "fsdp2_w3_bf16" / "checkpoint"
    one = tmp_path / "one"
    ckpt.split(src, one / "split", max_shard_size="3MB")
    ckpt.merge(one / "split", one / "merged.safetensors")
    ckpt.reshard(dcp, one / "reshard", 3)
    ckpt.convert(src, one / "model.bin", to="torch")
    ckpt.merge(dcp, one / "dcp.safetensors")

    proc = torchrun(world, HERE / "ranks_job.py", src, dcp, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = tmp_path / "ranks"
    for name in ["split", "merged.safetensors", "model.bin", "dcp.safetensors"]:
        assert tree(ranks / name) == tree(one / name), name
    # The reshard's `.metadata` records its folder's path: the data files compare whole.
    got, want = tree(ranks / "reshard"), tree(one / "reshard")
    assert sorted(got) == sorted(want)
    assert all(got[k] == want[k] for k in want if k != ".metadata")
    assert ckpt.merge(ranks / "reshard", tmp_path / "a.safetensors") and ckpt.merge(one / "reshard", tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()

    import json

    docs = json.loads((tmp_path / "documents.json").read_text())
    for name, doc in docs.items():
        shares = doc["ranks"]
        assert [r["rank"] for r in shares] == list(range(world)), name
        assert sum(r["bytes_written"] for r in shares) > 0, name
        assert all(r["bytes_written"] > 0 for r in shares), f"{name}: every rank wrote its share"


def test_outside_a_job_an_operation_is_one_process(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones((4, 4), dtype=np.float32)}, str(src))
    from statekit.errors import UsageError

    doc = ckpt.merge(src, tmp_path / "o.safetensors").document
    assert doc["dry_run"] is False
    assert doc["ranks"] == [{"rank": 0, "files": 1, "bytes_read": 64, "bytes_written": (tmp_path / "o.safetensors").stat().st_size}]
    with pytest.raises(UsageError, match="process group"):
        ckpt.merge(src, tmp_path / "p.safetensors", group=object())
