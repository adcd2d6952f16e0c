"""statekit.ckpt's errors speak Python: options are named by their keywords, never by the `ckpt`
CLI's flags, and the exception class follows the Rust error's kind (`ckpt::Error::kind`).

The checks of the options are the library's own (`ConvertOptions::check`), the same that refuse
the CLI's flags in `cli/tests/formats/dcp.rs`; only the wording differs by edge."""

from pathlib import Path

import pytest

from statekit import ckpt
from statekit.errors import BadOutput, CheckpointError, InvalidCheckpoint, NotACheckpoint

ROOT = Path(__file__).resolve().parents[3]
FX = ROOT / "fixtures"
MODEL = FX / "dcp" / "accelerate_w3_bf16" / "expected_model.safetensors"


@pytest.mark.parametrize(
    "kwargs, out, message",
    [
        ({"to": "dcp"}, "dcp", '`to="dcp"` needs `world_size=M`'),
        ({"world_size": 2}, "dcp", '`world_size` only applies to `to="dcp"`'),
        ({"to": "dcp", "world_size": 2, "dedupe": True}, "dcp", '`to="dcp"` takes only `world_size`'),
        ({"to": "torch"}, "x.safetensors", '`to="torch"` contradicts the `.safetensors` extension'),
        ({"max_shard_size": "1MB"}, "x.safetensors", "`max_shard_size` shards into a folder, not into a file name"),
        ({"dtype": "int8"}, "x.safetensors", "`dtype` must be a float dtype (f64, f32, f16, bf16 or FP8), not `I8`"),
    ],
)
def test_convert_options_that_do_not_combine_are_named_by_their_keywords(tmp_path, kwargs, out, message):
    with pytest.raises(BadOutput) as e:
        ckpt.convert(MODEL, tmp_path / out, **kwargs)
    assert str(e.value) == message
    assert "--" not in str(e.value)
    assert list(tmp_path.iterdir()) == [], "refused before anything is written"


def test_reshard_of_a_plain_file_hints_at_the_python_call(tmp_path):
    with pytest.raises(BadOutput) as e:
        ckpt.reshard(MODEL, tmp_path / "o", 2)
    text = str(e.value)
    assert "is not a DCP folder (no `.metadata`)" in text
    assert 'hint: `statekit.ckpt.convert(src, out, to="dcp", world_size=M)`' in text
    assert "--" not in text


def test_unknown_names_are_usage_errors_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype `float8`"):
        ckpt.convert(MODEL, tmp_path / "x.safetensors", dtype="float8")
    with pytest.raises(ValueError, match="the output format is `safetensors`, `torch`, `dcp`, `hf`, `megatron` or `megatron-legacy`, not `onnx`"):
        ckpt.convert(MODEL, tmp_path / "x.safetensors", to="onnx")


@pytest.mark.parametrize(
    "path, cls",
    [
        (FX / "hostile" / "safetensors" / "header_too_large.safetensors", InvalidCheckpoint),
        (FX / "hostile" / "safetensors" / "bad_json.safetensors", InvalidCheckpoint),
        (FX / "dcp", NotACheckpoint),
    ],
)
def test_the_class_follows_the_kind_of_the_error(path, cls):
    with pytest.raises(cls) as e:
        ckpt.inspect(path)
    assert isinstance(e.value, CheckpointError)
    assert e.value.variant, "the Rust variant is named"


def test_a_tensor_name_with_control_characters_reaches_python_escaped():
    # The fixture's one tensor is named "w\nok: forged\0\x1b[2J" and its size does not match its
    # shape, so every message quotes it. The Rust error keeps the name as it is; the exception's
    # message and verify's problems show it escaped, one line, with no NUL or ESC left.
    path = FX / "hostile" / "output" / "control_chars_name.safetensors"
    shown = r"tensor `w\nok: forged\0\u{1b}[2J`"
    expected = f"{path}: {shown}: shape [4] of `F32` needs 16 bytes but its offsets span 8"
    with pytest.raises(InvalidCheckpoint) as e:
        ckpt.load(path)
    assert str(e.value) == expected
    report = ckpt.verify(path)
    assert not report.valid
    assert report.problems == [expected]
    for text in [str(e.value), *report.problems]:
        assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text), repr(text)
