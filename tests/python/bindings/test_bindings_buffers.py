"""Bytes cross into Rust through the buffer protocol, never as address integers: every buffer
`statekit._native` takes is checked in Rust before a byte is touched, C-contiguous or
`TypeError`, an output writable, of the expected length and not sharing memory with another
output or `ValueError`, each message naming the argument; an integer is not a buffer."""

import json
from pathlib import Path

import numpy as np
import pytest

import statekit._native as native
from statekit import ckpt
from statekit.errors import UsageError

FX = Path(__file__).resolve().parents[3] / "fixtures" / "dataload_sources"


@pytest.fixture()
def checkpoint(tmp_path):
    """A checkpoint whose tensor 0 is 8 float32 and tensor 1 is 4 int32."""
    ckpt.save({"a": np.arange(8, dtype=np.float32), "b": np.arange(4, dtype=np.int32)}, tmp_path / "m.safetensors")
    ck = native.Checkpoint(str(tmp_path / "m.safetensors"))
    assert [t["name"] for t in json.loads(ck.info_json())["tensors"]] == ["a", "b"]
    return ck


def test_outputs_are_read_into_when_contiguous_writable_and_of_the_right_length(checkpoint):
    a = np.zeros(8, np.float32)
    checkpoint.read_into(0, a)
    assert np.array_equal(a, np.arange(8, dtype=np.float32))
    raw = bytearray(16)  # any writable buffer, any item type: its bytes
    checkpoint.read_into(1, raw)
    assert np.array_equal(np.frombuffer(raw, np.int32), np.arange(4))
    b = np.zeros((2, 2), np.int32)
    checkpoint.read_many_into([(0, a), (1, b)])
    assert np.array_equal(b.reshape(-1), np.arange(4))


def test_a_non_contiguous_output_is_a_type_error(checkpoint):
    strided = np.zeros(16, np.float32)[::2]
    with pytest.raises(TypeError, match="`out` must be C-contiguous"):
        checkpoint.read_into(0, strided)
    with pytest.raises(TypeError, match=r"`jobs\[1\]` \(tensor 0\) must be C-contiguous"):
        checkpoint.read_many_into([(1, np.zeros(4, np.int32)), (0, strided)])
    fortran = np.zeros((2, 4), np.float32, order="F")
    with pytest.raises(TypeError, match="`out` must be C-contiguous"):
        checkpoint.read_into(0, fortran)
    assert not strided.any()


def test_a_read_only_output_is_a_value_error(checkpoint):
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="`out` is read-only") as e:
        checkpoint.read_into(0, ro)
    assert isinstance(e.value, UsageError)
    with pytest.raises(ValueError, match="`out` is read-only"):
        checkpoint.read_into(0, bytes(32))
    assert not ro.any()


def test_a_wrong_length_and_shared_outputs_are_value_errors(checkpoint):
    with pytest.raises(ValueError, match="`out` has 28 bytes, where 32 are needed"):
        checkpoint.read_into(0, np.zeros(7, np.float32))
    whole = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match=r"`jobs\[0\]` and `jobs\[1\]` share memory"):
        checkpoint.read_many_into([(0, whole[:8]), (1, whole[4:8])])
    with pytest.raises(ValueError, match="share memory"):
        checkpoint.read_many_into([(0, whole[:8]), (0, whole[:8])])
    assert not whole.any()


def test_an_address_is_not_a_buffer(checkpoint):
    a = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="`out` must be a buffer .* not `int`"):
        checkpoint.read_into(0, a.ctypes.data)
    with pytest.raises(TypeError):
        checkpoint.read_into(0, a.ctypes.data, a.nbytes)
    with pytest.raises(TypeError, match="must be a buffer"):
        native.save_safetensors([("a", "F32", [8], a.ctypes.data)], "/nonexistent/x.safetensors")


def test_token_batches_check_both_outputs():
    src = native.TokenSource(str(FX / "tokens_u16.bin"), 16)
    good = lambda: np.zeros((2, 16), np.int64)  # noqa: E731
    src.read_batch_into([0, 1], good(), good())
    with pytest.raises(TypeError, match="`targets` must be C-contiguous"):
        src.read_batch_into([0, 1], good(), np.zeros((2, 32), np.int64)[:, ::2])
    ro = good()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="`inputs` is read-only"):
        src.read_batch_into([0, 1], ro, good())
    with pytest.raises(ValueError, match="`inputs` has 128 bytes, where 256 are needed"):
        src.read_batch_into([0, 1], np.zeros(16, np.int64), good())
    same = good()
    with pytest.raises(ValueError, match="`inputs` and `targets` share memory"):
        src.read_batch_into([0, 1], same, same)


def test_save_inputs_may_be_read_only_but_must_be_contiguous(tmp_path):
    ro = np.arange(6, dtype=np.float32)
    ro.flags.writeable = False
    native.save_safetensors([("w", "F32", [6], ro)], str(tmp_path / "a.safetensors"))
    assert np.array_equal(ckpt.load(tmp_path / "a.safetensors")["w"], ro)
    strided = np.arange(12, dtype=np.float32)[::2]
    with pytest.raises(TypeError, match="the data of tensor `w` must be C-contiguous"):
        native.save_safetensors([("w", "F32", [6], strided)], str(tmp_path / "b.safetensors"))
    # The Python layer makes any array contiguous first.
    ckpt.save({"w": strided}, tmp_path / "c.safetensors")
    assert np.array_equal(ckpt.load(tmp_path / "c.safetensors")["w"], strided)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "c.safetensors"]
