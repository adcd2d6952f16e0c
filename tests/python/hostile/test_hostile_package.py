"""The Python package on hostile inputs (issue 22, section 4): one test per class, the refusal
pinned. Inputs come from fixtures/gen/hostile_package.py (stdlib only) or are made here in
temporary folders. Cases that could crash or hang the interpreter (a panic, SIGBUS, a FIFO) run
in a subprocess under a timeout, which must exit normally; nothing outside a test's own output
changes."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT

PACKAGE = FIXTURES / "hostile" / "package"
DATALOAD = FIXTURES / "hostile" / "dataload"
SOURCES = FIXTURES / "dataload_sources"


def snapshot(d: Path) -> dict:
    """Every file under `d`: its bytes' digest and its kind (a link is its own entry)."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        if p.is_symlink():
            out[str(p)] = ("link", os.readlink(p))
        elif p.is_file():
            out[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def run_py(code: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (the same `statekit`); it must exit 0, not by a signal
    or a timeout. Its stdout is its result."""
    env = {**os.environ, "RUST_BACKTRACE": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode >= 0, f"killed by {signal.Signals(-proc.returncode).name}: {proc.stderr}"
    assert proc.returncode == 0, proc.stderr
    return proc


def errors_of(code: str, timeout: int = 60) -> list:
    """`code` (in a subprocess) prints a JSON list of `[exception class, message]`."""
    return json.loads(run_py(code, timeout).stdout.strip().splitlines()[-1])


# --- 1. a planted link never makes a write land on a victim ---------------------------------------

def test_a_link_planted_at_the_line_index_temporary_does_not_overwrite_its_victim(tmp_path):
    from statekit.data import JsonlDataset

    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    # The name the index used to be written through (predictable, create-and-truncate).
    planted = tmp_path / f"data.jsonl.lines.idx.tmp{os.getpid()}"
    planted.symlink_to(victim)
    before = snapshot(tmp_path)
    ds = JsonlDataset(data)
    assert ds.get_batch([0, 1]) == [{"a": 1}, {"b": 2}]
    after = snapshot(tmp_path)
    assert victim.read_bytes() == b"precious"
    new = {k: v for k, v in after.items() if k not in before}
    assert list(new) == [str(tmp_path / "data.jsonl.lines.idx")], new
    assert all(after[k] == v for k, v in before.items()), "nothing already there changed"


def test_save_writes_only_its_targets_through_private_temporaries(tmp_path):
    import numpy as np
    from statekit import ckpt

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    state = {"a": np.arange(6, dtype=np.float32), "b": np.ones((4, 4), dtype=np.int64)}
    out = tmp_path / "one.safetensors"
    # Any name a writer could once predict, planted as links to the victim.
    for guess in [f".one.safetensors.{os.getpid()}.0.tmp", "one.safetensors.tmp", ".one.safetensors.tmp"]:
        (tmp_path / guess).symlink_to(victim)
    before = snapshot(tmp_path)
    ckpt.save(state, out)
    sharded = tmp_path / "sharded"
    ckpt.save(state, sharded, max_shard_size=64)
    after = snapshot(tmp_path)
    assert victim.read_bytes() == b"precious"
    assert all(after[k] == v for k, v in before.items())
    new = sorted(Path(k).relative_to(tmp_path).as_posix() for k in after if k not in before)
    assert new == ["one.safetensors", "sharded/model-00001-of-00002.safetensors",
                   "sharded/model-00002-of-00002.safetensors", "sharded/model.safetensors.index.json"], new
    assert not [p for p in tmp_path.rglob("*.tmp") if not p.is_symlink()], "no staging folder is left"


# --- 2. a bad Arrow file is an error naming it, never a PanicException --------------------------

@pytest.mark.parametrize("name,reason", [
    ("arrow_buffer_2_62.arrow", "buffer 1 at body offset 0 (4611686018427387904 bytes) lies outside the 1896-byte body"),
    ("arrow_offset_wraps.arrow",
     "buffer 1 at body offset 9223372036854775807 (9223372036854775807 bytes) lies outside the 1896-byte body"),
    ("arrow_offset_negative.arrow", "buffer 1 at body offset -8 (400 bytes) lies outside the 1896-byte body"),
    ("arrow_buffer_2_62.arrows", "buffer 1 at body offset 0 (4611686018427387904 bytes) lies outside the 1896-byte body"),
])
def test_an_arrow_buffer_outside_its_body_is_refused_by_name(name, reason):
    path = PACKAGE / name
    got = errors_of(f"""
        import json
        from statekit.data import ArrowDataset
        try:
            ArrowDataset({str(path)!r})
            print(json.dumps([]))
        except BaseException as e:
            print(json.dumps([[type(e).__name__, str(e)]]))
    """)
    assert got == [["DataError", f"`{path}`: malformed arrow ipc: {reason}"]]


def test_no_hostile_dataload_fixture_lets_a_panic_reach_python(tmp_path):
    """Every hostile dataset file, through every dataset class: opened and read, or refused with
    a statekit error; never a PanicException, a signal or a hang."""
    copies = tmp_path / "copies"
    copies.mkdir()
    names = []
    for d in (DATALOAD, PACKAGE):
        for p in sorted(d.iterdir()):
            if p.is_file():
                shutil.copy(p, copies / f"{d.name}__{p.name}")
                names.append(f"{d.name}__{p.name}")
    before = {d: snapshot(d) for d in (DATALOAD, PACKAGE)}
    got = errors_of(f"""
        import json
        from statekit.data import ArrowDataset, JsonlDataset, ParquetDataset, TokenDataset
        from statekit.errors import StatekitError
        out = []
        for name in {names!r}:
            path = {str(copies)!r} + "/" + name
            for cls in (lambda p: TokenDataset(p, 4), ArrowDataset, ParquetDataset, JsonlDataset):
                try:
                    ds = cls(path)
                    n = len(ds)
                    if n:
                        ds.get_batch(range(min(n, 64)))
                        ds[n - 1]
                except StatekitError as e:
                    pass
                except BaseException as e:
                    out.append([type(e).__name__, name + ": " + str(e)])
        print(json.dumps(out))
    """, timeout=300)
    assert got == []
    assert {d: snapshot(d) for d in (DATALOAD, PACKAGE)} == before


# --- 3. a token file truncated while open is an error, not SIGBUS ---------------------------------

def test_a_token_file_truncated_after_open_is_a_clean_error(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(bytes(range(256)) * 64)
    got = errors_of(f"""
        import json, os
        from statekit.data import TokenDataset
        ds = TokenDataset({str(path)!r}, 16)
        x, y = ds[3]
        first = (int(x[0]), int(y[0]))
        b = ds.get_batch([0, 10])
        os.truncate({str(path)!r}, 100)
        out = []
        for access in (lambda: ds[200], lambda: ds.get_batch([200]), lambda: ds[0]):
            try:
                access()
                out.append(["ok", ""])
            except BaseException as e:
                out.append([type(e).__name__, str(e)])
        print(json.dumps(out))
    """)
    changed = ["DataError", f"`{path}`: the file changed while opened"]
    # A view is refused once its file shrank (reading the map past the end would fault);
    # get_batch reads with pread, which reads what is still there and refuses what is not.
    assert got == [changed, changed, changed]


# --- 4. only regular files are read ---------------------------------------------------------------

def test_special_files_are_refused_by_name_without_hanging(tmp_path):
    fifo = tmp_path / "tokens.bin"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.bin"
    zero.symlink_to("/dev/zero")
    got = errors_of(f"""
        import json
        from statekit.data import ArrowDataset, JsonlDataset, ParquetDataset, TokenDataset
        out = []
        for path in ({str(fifo)!r}, {str(zero)!r}):
            for cls in (lambda p: TokenDataset(p, 4), ArrowDataset, ParquetDataset, JsonlDataset):
                try:
                    cls(path)
                    out.append(["ok", path])
                except BaseException as e:
                    out.append([type(e).__name__, str(e)])
        print(json.dumps(out))
    """, timeout=30)
    expected = [["DataError", f"`{fifo}`: is a FIFO, not a regular file; refusing to read it"]] * 4
    expected += [["DataError", f"`{zero}`: is a device, not a regular file; refusing to read it"]] * 4
    assert got == expected


# --- 5. load refuses a broadcast view unless allowed ----------------------------------------------

def test_load_refuses_a_broadcast_view_by_default():
    from statekit import ckpt
    from statekit.errors import InvalidCheckpoint

    path = PACKAGE / "broadcast_16gib.pt"
    assert path.stat().st_size < 1024
    assert ckpt.inspect(path).tensors[0].nbytes == 16 << 30
    with pytest.raises(InvalidCheckpoint) as e:
        ckpt.load(path)
    assert str(e.value) == (
        f"{path}: tensor `w` is a broadcast view: loading it takes 17179869184 bytes from a 4-byte storage; "
        "hint: `allow_expanded=True` loads it anyway"
    )
    assert e.value.variant == "ExpandedView"


# --- 6. bad arguments are UsageErrors naming the argument and its range ---------------------------

def test_out_of_range_arguments_name_the_argument_and_its_range(tmp_path):
    from statekit import _native, ckpt
    from statekit.data import JsonlDataset, ParquetDataset, ShardedBatchSampler, TokenDataset
    from statekit.errors import DataError, UsageError

    tokens = tmp_path / "t.bin"
    tokens.write_bytes(bytes(64))
    src = FIXTURES / "hostile" / "package" / "absent.safetensors"
    s = ShardedBatchSampler(10, 3)
    cases = [
        (lambda: ShardedBatchSampler(2**64, 4), "`length` must be an int in [0, 2^63 - 1], not 18446744073709551616"),
        (lambda: ShardedBatchSampler(2**63, 1), "`length` must be an int in [0, 2^63 - 1], not 9223372036854775808"),
        (lambda: ShardedBatchSampler(-1, 1), "`length` must be an int in [0, 2^63 - 1], not -1"),
        (lambda: ShardedBatchSampler(10, 2**64), "`batch_size` must be an int in [0, 2^64 - 1], not 18446744073709551616"),
        (lambda: ShardedBatchSampler(10, 2, num_processes=-1, process_index=0),
         "`num_processes` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: ShardedBatchSampler(10, 2, shuffle=True, seed=2**64),
         "`seed` must be an int in [-2^63, 2^64 - 1], not 18446744073709551616"),
        (lambda: s.set_epoch(-1), "`epoch` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: s.skip_first_batches(2**64), "`num_batches` must be an int in [0, 2^64 - 1], not 18446744073709551616"),
        (lambda: s.resume_from_accelerate(tmp_path, dataloader=-1), "`dataloader` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: _native.Sampler(-1, 1, 1, 0, False, False, _native.default_config_json()),
         "`length` must be an int in [0, 2^63 - 1], not -1"),
        (lambda: _native.Sampler(1, 1, 1, 0.5, False, False, _native.default_config_json()),
         "`rank` must be an int in [0, 2^64 - 1], not 0.5"),
        (lambda: ckpt.reshard(src, tmp_path / "o", world_size=-1), "`world_size` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: ckpt.merge(src, tmp_path / "o", model=2**64), "`model` must be an int in [0, 2^64 - 1], not 18446744073709551616"),
        (lambda: ckpt.split(src, tmp_path / "o", max_shard_size=-5), "`max_shard_size` must be an int in [0, 2^64 - 1], not -5"),
        (lambda: ckpt.convert(src, tmp_path / "o", world_size=-2), "`world_size` must be an int in [0, 2^64 - 1], not -2"),
        (lambda: ckpt.save({}, tmp_path / "o.safetensors", max_shard_size=-1),
         "`max_shard_size` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: ckpt.save_sharded({}, tmp_path / "d", rank=-1, world_size=1), "`rank` must be an int in [0, 0], not -1"),
        (lambda: ckpt.save_sharded({}, tmp_path / "d", rank=0, world_size=0), "`world_size` must be an int in [1, 1048576], not 0"),
        (lambda: TokenDataset(tokens, 2**64), "`block_size` must be an int in [1, 2^32], not 18446744073709551616"),
        (lambda: TokenDataset(tokens, -1), "`block_size` must be an int in [1, 2^32], not -1"),
        (lambda: _native.TokenSource(str(tokens), 4).locate(-1), "`i` must be an int in [0, 2^63 - 1], not -1"),
        (lambda: _native.JsonlSource(str(tokens), -1), "`cache_frames` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: _native.TableSource("arrow", str(SOURCES / "table.arrow"), None, -1),
         "`cache_row_groups` must be an int in [0, 2^64 - 1], not -1"),
        (lambda: _native.TableSource("arrow", str(SOURCES / "table.arrow")).read_batch([0, -1]),
         "`indices[1]` must be an int in [0, 2^63 - 1], not -1"),
        (lambda: _native.TableSource("arrow", str(SOURCES / "table.arrow")).read_range(0, 2**64),
         "`n` must be an int in [0, 2^63 - 1], not 18446744073709551616"),
    ]
    for call, message in cases:
        with pytest.raises(UsageError) as e:
            call()
        assert str(e.value) == message
        assert isinstance(e.value, ValueError) and not isinstance(e.value, OverflowError)
    assert s.epoch == 0 and s.state_dict() == ShardedBatchSampler(10, 3).state_dict(), "nothing moved"
    # A count a file declares is checked when the dataset is opened, not at len().
    with pytest.raises(DataError) as e:
        ParquetDataset(PACKAGE / "parquet_rows_2_62.parquet")
    assert str(e.value) == (f"`{PACKAGE / 'parquet_rows_2_62.parquet'}`: malformed parquet: row group 0 declares "
                            "4611686018427387904 rows, but its column `\"id\"` holds 37 values")
    # A saved state is an input too: one longer than `len` counts is refused when loaded.
    state = s.state_dict()
    state["dataset_len"] = 2**63
    with pytest.raises(UsageError, match=r"`dataset_len` is 9223372036854775808, more than the 2\^63 - 1"):
        s.load_state_dict(state)
    del JsonlDataset


# --- 7. every record error names the file and the line --------------------------------------------

@pytest.mark.parametrize("name,what", [
    ("deep.jsonl", "line 2, column 129: not JSON: nested more than 128 levels deep"),
    ("bad_utf8.jsonl", "line 2, column 8: not JSON: invalid UTF-8"),
    ("big_int.jsonl", "line 3: Python's `json` cannot read the record: Exceeds the limit (4300 digits) for integer "
                      "string conversion: value has 100000 digits; use sys.set_int_max_str_digits() to increase the limit"),
])
def test_json_lines_errors_name_the_file_and_the_line(tmp_path, name, what):
    from statekit.data import JsonlDataset
    from statekit.errors import DataError

    path = tmp_path / name
    shutil.copy(PACKAGE / name, path)
    with pytest.raises(DataError) as e:
        JsonlDataset(path).get_batch([0, 1])
    assert str(e.value) == f"`{path}`, {what}"
    assert e.value.variant == "NotJson"
    assert JsonlDataset(path, raw=True).get_batch([0]) == ['{"a": 1}'] if name == "big_int.jsonl" else True


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sparse_tensors_are_refused_by_save_with_our_message(tmp_path):
    torch = pytest.importorskip("torch")
    from statekit import ckpt
    from statekit.errors import UsageError

    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    for value, layout in [(sparse, "torch.sparse_coo"), (torch.eye(3).to_sparse_csr(), "torch.sparse_csr")]:
        with pytest.raises(UsageError) as e:
            ckpt.save({"w": value}, tmp_path / "o.safetensors")
        assert str(e.value) == (
            f"tensor `w` is sparse (`{layout}`): safetensors stores dense tensors only; "
            "hint: save `w.to_dense()`, or its indices and values as tensors of their own"
        )
    assert list(tmp_path.iterdir()) == []
