"""statekit.data's datasets over dataload's sources, against the values the fixture generator
(numpy, pyarrow, zstandard) recorded; token windows are views of the memory map."""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from statekit.data import ArrowDataset, JsonlDataset, ParquetDataset, ShardedBatchSampler, TokenDataset
from statekit.errors import DataError, StatekitError

FX = Path(__file__).resolve().parents[3] / "fixtures" / "dataload_sources"
EXPECTED = json.loads((FX / "expected.json").read_text())


def test_token_windows_are_views_of_the_memory_map():
    case = EXPECTED["tokens"]["tokens_u16.bin"]
    ds = TokenDataset(FX / "tokens_u16.bin", case["block_size"], dtype="uint16")
    assert len(ds) == case["windows"]
    for i, w in case["picked"].items():
        x, y = ds[int(i)]
        assert x.tolist() == w["input"] and y.tolist() == w["target"]
        assert not x.flags.owndata and x.base is not None
        assert torch.from_numpy(x).data_ptr() == x.ctypes.data  # the tensor is over the same memory
    idx = [int(i) for i in case["picked"]]
    xs, ys = ds.get_batch(idx)
    assert xs.dtype == np.int64 and xs.shape == (len(idx), case["block_size"])
    assert xs.tolist() == [w["input"] for w in case["picked"].values()]
    assert ys.tolist() == [w["target"] for w in case["picked"].values()]


def test_token_dataset_in_a_dataloader_with_workers_and_our_sampler():
    ds = TokenDataset(FX / "tokens_u16.bin", 16)
    want = [ds.get_batch(b)[0].tolist() for b in ShardedBatchSampler(len(ds), 4, num_processes=2, process_index=1, shuffle=True, seed=5)]
    for ctx in (None, "spawn"):
        sampler = ShardedBatchSampler(len(ds), 4, num_processes=2, process_index=1, shuffle=True, seed=5, fingerprint=ds.fingerprint)
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=ctx)
        got = [x.to(torch.int64).tolist() for x, _ in loader]
        assert got == want, ctx


def test_datasets_survive_pickle():
    ds = TokenDataset(FX / "token_shards", 16, dtype="uint16")
    back = pickle.loads(pickle.dumps(ds))
    assert len(back) == len(ds) and all((a == b).all() for a, b in zip(back[len(ds) - 1], ds[len(ds) - 1]))
    t = pickle.loads(pickle.dumps(ParquetDataset(FX / "table.parquet", columns=["id"])))
    assert list(t.get_batch([0])) == ["id"]


@pytest.mark.parametrize("cls, name", [(ArrowDataset, "table.arrow"), (ArrowDataset, "table.arrows"), (ParquetDataset, "table.parquet"),
                                       (ParquetDataset, "table_zstd.parquet"), (ParquetDataset, "parquet_shards")])
def test_tables_give_numeric_columns_as_numpy(cls, name):
    rows = EXPECTED["table"]["rows"]
    ds = cls(FX / name)
    assert len(ds) == len(rows)
    idx = [len(rows) - 1, 0, 5, 5]
    b = ds.get_batch(idx)
    assert b["id"].dtype == np.int64 and b["id"].tolist() == [rows[i]["id"] for i in idx]
    assert b["label"].dtype == np.int32 and b["label"].tolist() == [rows[i]["label"] for i in idx]
    score = np.ma.getdata(b["score"]).view(np.uint64).tolist()  # bits, as recorded
    assert [None if m else s for s, m in zip(score, np.ma.getmaskarray(b["score"]))] == [rows[i]["score"] for i in idx]
    assert b["text"] == [rows[i]["text"] for i in idx]
    assert ds[3]["text"] == rows[3]["text"]


@pytest.mark.parametrize("name", ["lines.jsonl", "lines.jsonl.zst", "lines_one_frame.jsonl.zst"])
def test_jsonl_records(tmp_path, name):
    import shutil

    shutil.copy(FX / name, tmp_path / name)  # the line index is written beside the file
    raw = EXPECTED["jsonl"]["raw"]
    ds = JsonlDataset(tmp_path / name)
    assert len(ds) == EXPECTED["jsonl"]["lines"]
    assert ds[7] == json.loads(raw[7])
    assert JsonlDataset(tmp_path / name, raw=True).get_batch([3, 1]) == [raw[3], raw[1]]


def test_hostile_sources_raise_data_errors():
    hostile = FX.parent / "hostile" / "dataload"
    with pytest.raises(DataError):
        TokenDataset(hostile / "truncated.npy", 4)
    with pytest.raises(StatekitError, match="dtype"):
        TokenDataset(hostile / "wrong_dtype.npy", 4)
    with pytest.raises(IndexError):
        TokenDataset(FX / "tokens_u16.bin", 16)[100]


def _write_ipc(path, *, compression=None, stream=False):
    import pyarrow as pa

    schema = pa.schema([("x", pa.int64()), ("y", pa.float32()), ("n", pa.int32()), ("s", pa.string())])
    batches = [
        pa.record_batch([pa.array(np.arange(lo, lo + 10, dtype=np.int64)), pa.array(np.arange(lo, lo + 10, dtype=np.float32) / 2),
                         pa.array([None if i % 3 == 0 else i for i in range(lo, lo + 10)], pa.int32()),
                         pa.array([f"r{i}" for i in range(lo, lo + 10)])], schema=schema)
        for lo in (0, 10, 20)
    ]
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(str(path), schema, options=opts) as w:
        for b in batches:
            w.write_batch(b)
    return path


@pytest.mark.parametrize("name, stream", [("t.arrow", False), ("t.arrows", True)])
def test_arrow_numeric_columns_are_views_of_the_memory_map(tmp_path, name, stream):
    ds = ArrowDataset(_write_ipc(tmp_path / name, stream=stream))
    a = ds.get_batch(range(12, 17))  # inside the second record batch
    assert a["x"].tolist() == list(range(12, 17)) and a["y"].tolist() == [i / 2 for i in range(12, 17)]
    assert a["s"] == [f"r{i}" for i in range(12, 17)]
    b = ds[14:20]  # a slice with step 1 is a contiguous range too
    for col in ("x", "y"):
        assert not a[col].flags.owndata and np.shares_memory(a[col], b[col]), col
    assert b["x"].tolist() == list(range(14, 20))
    assert torch.from_numpy(a["x"]).data_ptr() == a["x"].ctypes.data  # a tensor over the same memory
    a["x"][0] = -1  # a private map: writes never reach the file
    assert ArrowDataset(tmp_path / name).get_batch([12])["x"].tolist() == [12]
    # A column with nulls is a (copied) masked array, whatever the range.
    assert isinstance(a["n"], np.ma.MaskedArray) and np.ma.getmaskarray(a["n"]).tolist() == [i % 3 == 0 for i in range(12, 17)]


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_compressed_arrow_ipc_reads_as_pyarrow_does_and_is_copied(tmp_path, codec, stream):
    import pyarrow as pa

    path = _write_ipc(tmp_path / ("t.arrows" if stream else "t.arrow"), compression=codec, stream=stream)
    want = (pa.ipc.open_stream if stream else pa.ipc.open_file)(str(path)).read_all()
    ds = ArrowDataset(path)
    assert len(ds) == want.num_rows
    picks = [29, 0, 14, 15, 3]
    got = ds.get_batch(picks)
    for col in ("x", "y", "s"):
        assert list(got[col]) == [want.column(col)[i].as_py() for i in picks], col
    # Rows of one record batch, but decompressed: copied, not a view of the file.
    a, b = ds.get_batch(range(12, 17))["x"], ds.get_batch(range(12, 17))["x"]
    assert a.tolist() == list(range(12, 17)) and not np.shares_memory(a, b)


def test_arrow_copies_where_a_view_is_impossible(tmp_path):
    ds = ArrowDataset(_write_ipc(tmp_path / "t.arrow"))
    view = ds.get_batch(range(10, 20))["x"]
    across = ds.get_batch(range(8, 13))["x"]  # two record batches: gathered
    gathered = ds.get_batch([11, 13, 12])["x"]  # not consecutive: gathered
    assert across.tolist() == list(range(8, 13)) and gathered.tolist() == [11, 13, 12]
    assert not np.shares_memory(view, across) and not np.shares_memory(view, gathered)
    p = ParquetDataset(FX / "table.parquet")
    pa_, pb = p.get_batch(range(0, 4))["id"], p.get_batch(range(0, 4))["id"]
    assert not np.shares_memory(pa_, pb)
    assert ds.get_batch([])["x"].tolist() == []
