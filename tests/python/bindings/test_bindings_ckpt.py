"""statekit.ckpt (the installed package) against the real tools: what torch, accelerate (FSDP2
DCP) and DeepSpeed saved loads to the same bits; what statekit saves loads in safetensors and
torch; hostile files raise the right exception and nothing they ask for happens."""

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import statekit
from statekit import ckpt
from statekit.errors import (
    CheckpointError,
    InvalidCheckpoint,
    NotACheckpoint,
    StatekitError,
    StatekitOSError,
    UnsafePickle,
)

ROOT = Path(__file__).resolve().parents[3]
FX = ROOT / "fixtures"


def hexes(d):
    return {k: np.ascontiguousarray(v).tobytes().hex() for k, v in d.items()}


# -- reading what the real tools wrote ------------------------------------------------------


@pytest.mark.parametrize("case", sorted(json.loads((FX / "torch" / "expected.json").read_text())))
def test_torch_files_load_to_torchs_bits(case):
    expected = json.loads((FX / "torch" / "expected.json").read_text())[case]
    got = ckpt.load(FX / "torch" / case)
    assert sorted(got) == sorted(t["name"] for t in expected["tensors"])
    for t in expected["tensors"]:
        assert got.dtypes[t["name"]] == t["dtype"], t["name"]
        assert list(got[t["name"]].shape) == t["shape"], t["name"]
        assert got[t["name"]].tobytes().hex() == t["hex"], t["name"]


def test_torch_framework_equals_torch_load():
    want = torch.load(FX / "torch" / "dtypes.pt", weights_only=True)
    got = ckpt.load(FX / "torch" / "dtypes.pt", framework="torch")
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("case", ["fsdp2_w2_f32", "fsdp2_w4_f32", "fsdp2_w3_bf16", "fsdp2_w8_bf16"])
def test_fsdp2_dcp_loads_to_the_same_bits(case):
    root = FX / "dcp" / case
    want = safetensors.torch.load_file(root / "expected_model.safetensors")
    got = ckpt.load(root / "checkpoint", framework="torch")
    got = {k.removeprefix("model."): v for k, v in got.items() if k.startswith("model.")}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("case", ["accelerate_w2_f32", "accelerate_w3_bf16"])
def test_accelerate_fsdp2_save_state_loads_to_the_same_bits(case):
    root = FX / "dcp" / case
    want = safetensors.torch.load_file(root / "expected_model.safetensors")
    got = ckpt.load(root / "checkpoint" / "pytorch_model_fsdp_0", framework="torch")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("case", ["z1_fp32_ws2", "z2_bf16_ws3", "z3_fp32_ws4_sg50", "z3_bf16_ws4"])
def test_deepspeed_zero_loads_to_zero_to_fp32s_bits(case):
    root = FX / "deepspeed" / case
    want = safetensors.torch.load_file(root / "expected" / "model.safetensors")
    got = ckpt.load(root, framework="torch")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_safetensors_load_views_the_memory_map_without_copies():
    path = FX / "safetensors" / "model_single" / "model.safetensors"
    want = {k: v.contiguous().reshape(-1).view(torch.uint8).numpy() for k, v in safetensors.torch.load_file(path).items()}
    got = ckpt.load(path)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
    big = max(got.values(), key=lambda a: a.nbytes)
    assert not big.flags.owndata
    base = big
    while getattr(base, "base", None) is not None:
        base = base.base
    assert isinstance(base, memoryview) and type(base.obj).__name__ == "mmap"
    t = torch.from_numpy(big)
    assert t.data_ptr() == big.ctypes.data  # the tensor is over the same memory
    before = path.read_bytes()
    big.reshape(-1)[:1] = 0  # private mapping: the file is untouched
    assert path.read_bytes() == before


def test_bf16_is_raw_uint16_in_numpy_and_bfloat16_in_torch(tmp_path):
    x = torch.randn(5, 3).to(torch.bfloat16)
    f8 = torch.randn(4).to(torch.float8_e4m3fn)
    safetensors.torch.save_file({"x": x, "f8": f8}, tmp_path / "m.safetensors")
    got = ckpt.load(tmp_path / "m.safetensors")
    assert got["x"].dtype == np.uint16 and got.dtypes["x"] == "BF16"
    assert got["f8"].dtype == np.uint8 and got.dtypes["f8"] == "F8_E4M3"
    assert np.array_equal(got["x"], x.view(torch.uint16).numpy())
    t = ckpt.load(tmp_path / "m.safetensors", framework="torch")
    assert t["x"].dtype == torch.bfloat16 and torch.equal(t["x"], x)
    assert t["f8"].dtype == torch.float8_e4m3fn and torch.equal(t["f8"].view(torch.uint8), f8.view(torch.uint8))


# -- writing --------------------------------------------------------------------------------


def test_save_loads_in_safetensors_with_strides_tied_weights_and_bf16(tmp_path):
    w = torch.randn(6, 4)
    sd = {
        "embed.weight": w,
        "head.weight": w,  # tied, as save_model sees it
        "t": torch.randn(4, 6).t(),  # strided
        "bf": torch.randn(3, 3).to(torch.bfloat16),
        "n": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # strided numpy
        "be": np.arange(4, dtype=">f4"),
        "empty": torch.empty(0, 3),
    }
    out = ckpt.save(sd, tmp_path / "m.safetensors", metadata={"format": "pt"})
    assert out.files == [str(tmp_path / "m.safetensors")]
    assert out.aliases == [("head.weight", "embed.weight")]
    back = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert sorted(back) == sorted(set(sd) - {"head.weight"})
    for k, v in sd.items():
        if k == "head.weight":
            continue
        ref = torch.from_numpy(np.ascontiguousarray(v.astype(v.dtype.newbyteorder("<")))) if isinstance(v, np.ndarray) else v
        assert torch.equal(back[k], ref), k
    with safetensors.safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporaries left


def test_save_sharded_layout_is_huggingface_hubs(tmp_path):
    sd = {f"layer.{i}.weight": torch.full((256,), float(i)) for i in range(10)}
    out = ckpt.save(sd, tmp_path / "m", max_shard_size=3 * 1024)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert out.files[-1].endswith("model.safetensors.index.json")
    assert index["metadata"]["total_size"] == 10 * 1024
    assert sorted(index["weight_map"]) == sorted(sd)
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05}-of-00004.safetensors" for i in range(1, 5)]
    merged = {}
    for s in shards:
        merged.update(safetensors.torch.load_file(tmp_path / "m" / s))
    assert all(torch.equal(merged[k], v) for k, v in sd.items())
    got = ckpt.load(tmp_path / "m", framework="torch")
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_convert_to_torch_loads_with_weights_only(tmp_path):
    sd = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(2).to(torch.bfloat16)}
    ckpt.save(sd, tmp_path / "m.safetensors")
    out = ckpt.convert(tmp_path / "m.safetensors", tmp_path / "m.bin")
    assert out.tensors == 3 and out.files == [str(tmp_path / "m.bin")]
    back = torch.load(tmp_path / "m.bin", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_operations_return_result_objects(tmp_path):
    src = FX / "safetensors" / "model_single" / "model.safetensors"
    info = ckpt.inspect(src)
    assert info.format == "safetensors" and len(info.tensors) > 0
    split = ckpt.split(src, tmp_path / "shards", max_shard_size="1KB")
    assert split.tensors == len(info.tensors) and split.bytes == info.total_bytes
    assert split.files[-1].endswith("model.safetensors.index.json")
    merged = ckpt.merge(tmp_path / "shards", tmp_path / "merged.safetensors")
    assert merged.files == [str(tmp_path / "merged.safetensors")]
    assert hexes(ckpt.load(tmp_path / "merged.safetensors")) == hexes(ckpt.load(src))
    report = ckpt.verify(tmp_path / "shards")
    assert report.valid and report.problems == [] and report.tensors == len(info.tensors)
    dcp = FX / "dcp" / "fsdp2_w2_f32" / "checkpoint"
    out = ckpt.reshard(dcp, tmp_path / "w3", 3)
    assert out.world_size == 3 and (tmp_path / "w3" / ".metadata").exists()
    assert hexes(ckpt.load(tmp_path / "w3")) == hexes(ckpt.load(dcp))


# -- hostile files and errors ------------------------------------------------------------------


def test_a_malicious_pickle_raises_before_any_effect(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("os_system.pt", "builtins_eval.pt", "build_arbitrary_class.pt"):
        with pytest.raises(UnsafePickle, match="refusing global") as e:
            ckpt.load(FX / "hostile" / "torch" / name)
        assert e.value.global_name in str(e.value)
        assert isinstance(e.value, InvalidCheckpoint) and isinstance(e.value, StatekitError)
    assert list(tmp_path.iterdir()) == []  # `statekit-pwned` was not created
    with pytest.raises(UnsafePickle, match="posix.system"):
        ckpt.load(FX / "hostile" / "torch" / "os_system.pt")


@pytest.mark.parametrize("name", sorted(os.listdir(FX / "hostile" / "safetensors")))
def test_hostile_safetensors_are_invalid_checkpoints(name):
    with pytest.raises(CheckpointError) as e:
        ckpt.load(FX / "hostile" / "safetensors" / name)
    assert str(e.value)
    assert not ckpt.verify(FX / "hostile" / "safetensors" / name).valid if isinstance(e.value, InvalidCheckpoint) else True


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        ckpt.load(tmp_path / "nope.safetensors")
    assert isinstance(e.value, StatekitOSError) and isinstance(e.value, StatekitError)
    assert e.value.filename == str(tmp_path / "nope.safetensors")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_permission_error(tmp_path):
    p = tmp_path / "m.safetensors"
    ckpt.save({"a": np.zeros(3, np.float32)}, p)
    p.chmod(0)
    with pytest.raises(PermissionError):
        ckpt.load(p)


def test_not_a_checkpoint_and_a_truncated_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpoint):
        ckpt.load(tmp_path / "empty")
    (tmp_path / "x.safetensors").write_bytes(b"hello")
    with pytest.raises(InvalidCheckpoint, match="too short for a safetensors header") as e:
        ckpt.load(tmp_path / "x.safetensors")
    assert e.value.variant == "HeaderTooSmall"


def test_shards_that_disagree_on_metadata_are_refused_by_inspect_as_by_verify(tmp_path):
    """`inspect` once showed no metadata for shards whose `__metadata__` conflict; it refuses
    them as the library refuses them everywhere, naming both files, and verify reports it."""
    d = tmp_path / "sharded"
    d.mkdir()
    safetensors.numpy.save_file({"a": np.zeros(2, np.float32)}, d / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    safetensors.numpy.save_file({"b": np.ones(2, np.float32)}, d / "model-00002-of-00002.safetensors", metadata={"format": "np"})
    index = {"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidCheckpoint) as e:
        ckpt.inspect(d)
    assert e.value.variant == "MetadataConflict"
    assert "model-00001-of-00002.safetensors" in str(e.value) and "model-00002-of-00002.safetensors" in str(e.value)
    report = ckpt.verify(d)
    assert not report.valid
    assert [str(p) for p in report.problems] == [str(e.value)]


# -- the GIL ----------------------------------------------------------------------------------


def test_another_thread_runs_while_a_long_merge_runs(tmp_path):
    # ~400 MB in 16 shards: the merge takes a while; the counting thread must keep running.
    sd = {f"w{i}": np.full(25 * 1024 * 1024 // 4, i, np.float32) for i in range(16)}
    ckpt.save(sd, tmp_path / "src", max_shard_size="30MB")
    del sd
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    done = {}

    def merge():
        done["t0"] = time.perf_counter()
        ckpt.merge(tmp_path / "src", tmp_path / "out.safetensors")
        done["t1"] = time.perf_counter()

    counter = threading.Thread(target=count)
    counter.start()
    m = threading.Thread(target=merge)
    m.start()
    m.join()
    stop.set()
    counter.join()
    during = [t for t in ticks if done["t0"] < t < done["t1"]]
    span = done["t1"] - done["t0"]
    # With the GIL held through the merge the counter would not tick at all in between (the
    # bound is loose: on a loaded 2-core machine the merge's own threads take the CPUs).
    assert len(during) >= max(3, int(span / 0.001 * 0.02)), (len(during), span)


# -- the package ------------------------------------------------------------------------------


def test_stubs_name_exactly_what_the_native_module_exports():
    import ast

    import statekit._native as native

    pkg = Path(statekit.__file__).parent
    assert (pkg / "py.typed").exists()
    tree = ast.parse((pkg / "_native.pyi").read_text())
    stub = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stub[node.name] = node
        elif isinstance(node, ast.AnnAssign):
            stub[node.target.id] = node
    exported = {n for n in dir(native) if not n.startswith("__")} | {"__version__"}
    assert set(stub) == exported
    for name, node in stub.items():
        if isinstance(node, ast.ClassDef):
            cls = getattr(native, name)
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")}
            assert methods == {n for n in dir(cls) if not n.startswith("__")}, name


def test_native_module_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, statekit; from statekit import ckpt, data; ckpt.load(sys.argv[1]); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, str(FX / "torch" / "basic.pt")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_hf_address_loads_from_the_local_cache(tmp_path, monkeypatch):
    import hashlib

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--statekit--tiny"
    src = FX / "safetensors" / "model_single" / "model.safetensors"
    data = src.read_bytes()
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    link = repo / "snapshots" / commit / "model.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hexes(ckpt.load("hf://statekit/tiny")) == hexes(ckpt.load(src))


def test_merge_picks_a_model_of_an_accelerate_save_state_folder(tmp_path):
    folder = FX / "accelerate" / "two_models"
    info = ckpt.inspect(folder)
    assert info.format == "accelerate-state"
    assert [m["path"].rsplit("/", 1)[-1] for m in info.components["models"]] == ["model.safetensors", "model_1.safetensors"]
    assert info.components["schedulers"][0]["values"]["last_epoch"] == 1
    assert ckpt.inspect(folder / "model.safetensors").components is None
    out = tmp_path / "m1.safetensors"
    ckpt.merge(folder, out, model=1)
    assert out.read_bytes() == (folder / "model_1.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="has no model 5"):
        ckpt.merge(folder, tmp_path / "x.safetensors", model=5)
