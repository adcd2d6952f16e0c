"""``allow_globals`` in Python: the torch files only ``torch.load(weights_only=False)`` opens
(``fixtures/torch_unsafe/``) load with ``statekit.ckpt.load(path, allow_globals=[...])`` to the
references stored beside them (what ``torch.load`` gave when they were written), and are
refused by name without it. Neither Lightning nor omegaconf is needed here."""

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from statekit import ckpt
from statekit.errors import BadOption, UnsafePickle

FX = Path(__file__).resolve().parents[3] / "fixtures" / "torch_unsafe"
OMEGACONF = ["omegaconf.*", "typing.Any", "builtins.dict", "builtins.list", "builtins.int", "collections.defaultdict"]

CASES = [
    ("lightning.ckpt", OMEGACONF),
    ("numpy_arrays.pt", ["numpy.*", "builtins.bytes", "torch.nn.*"]),
    ("numpy1_arrays.pt", ["numpy.*"]),
    ("training_args.bin", ["transformers.*", "accelerate.*"]),
    ("payload.pt", ["*"]),
]


def expected(name):
    return safetensors.torch.load_file(str(FX / f"{name}.expected.safetensors")), json.loads((FX / f"{name}.expected.json").read_text())


@pytest.mark.parametrize("name,patterns", CASES)
def test_load_with_allow_globals_equals_the_reference(name, patterns, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want, doc = expected(name)
    got = ckpt.load(FX / name, framework="torch", allow_globals=patterns)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        # Bit for bit (NaNs and -0.0 included), whatever the dtype.
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    as_numpy = ckpt.load(FX / name, allow_globals=patterns)
    assert sorted(as_numpy) == sorted(want)
    info = ckpt.inspect(FX / name, allow_globals=patterns)
    assert info.values == doc["values"]
    assert info.globals == {str(FX / name): doc["globals"]}
    assert list(tmp_path.iterdir()) == []  # nothing ran: no `statekit-pwned`


@pytest.mark.parametrize("name,patterns", CASES)
def test_refused_by_name_without_it(name, patterns, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafePickle) as e:
        ckpt.load(FX / name)
    assert e.value.global_name == e.value.globals[0]
    assert f"refusing global `{e.value.global_name}`" in str(e.value)
    assert "`allow_globals` reads" in str(e.value)
    assert all(g in doc_globals(name) for g in e.value.globals)
    assert list(tmp_path.iterdir()) == []


def doc_globals(name):
    return expected(name)[1]["globals"]


def test_numpy_arrays_come_back_as_arrays():
    got = ckpt.load(FX / "numpy_arrays.pt", allow_globals=["numpy.*", "builtins.bytes", "torch.nn.*"])
    assert np.array_equal(got["arrays.fortran"], np.arange(12, dtype=np.int32).reshape(3, 4))
    assert np.array_equal(got["arrays.big_endian"], np.arange(4, dtype=np.float32))
    assert got["arrays.f64_0d"].shape == () and got["arrays.f64_0d"] == 3.25


def test_patterns_are_checked():
    with pytest.raises(BadOption, match=r"`allow_globals`: `om\*` is not a dotted name"):
        ckpt.load(FX / "lightning.ckpt", allow_globals=["om*"])
    with pytest.raises(Exception, match="list of patterns"):
        ckpt.load(FX / "lightning.ckpt", allow_globals="*")
    st = Path(__file__).resolve().parents[3] / "fixtures" / "safetensors" / "model_single" / "model.safetensors"
    with pytest.raises(BadOption, match="applies to torch files"):
        ckpt.load(st, allow_globals=["*"])


def test_operations_take_it_too(tmp_path):
    out = ckpt.convert(FX / "lightning.ckpt", tmp_path / "m.safetensors", allow_globals=OMEGACONF)
    want, _ = expected("lightning.ckpt")
    assert out.tensors == len(want)
    assert ckpt.verify(FX / "lightning.ckpt", allow_globals=OMEGACONF).valid
    assert not ckpt.verify(FX / "lightning.ckpt").valid
    split = ckpt.split(FX / "lightning.ckpt", tmp_path / "shards", max_shard_size=64, allow_globals=["*"])
    merged = ckpt.merge(tmp_path / "shards", tmp_path / "merged.safetensors")
    assert merged.tensors == split.tensors == len(want)
