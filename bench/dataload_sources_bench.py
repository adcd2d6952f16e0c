"""Benchmark: statekit's prefetching loader vs torch's DataLoader over the same data.

    /opt/statekit-venv/bin/python bench/dataload_sources_bench.py

* tokens: a 40 MB nanoGPT-style uint16 `.bin`, windows of 1024 (+1) tokens, shuffled, batch 32,
  400 batches. torch: a map-style Dataset over `np.memmap` returning (x, y) int64 tensors,
  default collate. statekit: `TokenWindows` + `DataLoader` (i64 `[B, T]` inputs and targets).
* parquet: 200k rows (int64, string ~100 B, float64, int32) in row groups of 10k, one
  sequential epoch, batch 256. torch: a Dataset over `pq.read_table(memory_map=True)` whose
  `__getitems__` is `Table.take(indices)` (batched, no per-row Python), identity collate.
  statekit: `ParquetDataset` (row-group cache 8) + `DataLoader` (Arrow record batches).

Both with 0 and 2 workers. Writes bench/RESULTS-dataload-sources.md. Never run by the tests.
"""

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from bench_common import token_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORK = os.path.join(ROOT, "bench", "work", "dataload_sources")
BLOCK, TOKEN_BATCH, TOKEN_BATCHES = 1024, 32, 400
ROW_BATCH = 256


def make_data():
    os.makedirs(WORK, exist_ok=True)
    tok = token_file(os.path.join(WORK, "tokens.bin"), 20_000_000, seed=0)
    rows = os.path.join(WORK, "rows.parquet")
    if not os.path.exists(rows):
        n = 200_000
        rng = np.random.default_rng(1)
        words = np.array(["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"])
        text = [" ".join(words[rng.integers(0, 8, size=16)]) for _ in range(n)]
        t = pa.table({
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "text": pa.array(text),
            "score": pa.array(rng.normal(size=n)),
            "label": pa.array(rng.integers(0, 10, size=n, dtype=np.int32)),
        })
        pq.write_table(t, rows, row_group_size=10_000)
    return tok, rows


class Windows(Dataset):
    def __init__(self, path):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.n = (len(self.data) - 1) // BLOCK

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        w = torch.from_numpy(self.data[i * BLOCK : i * BLOCK + BLOCK + 1].astype(np.int64))
        return w[:-1], w[1:]


class Rows(Dataset):
    def __init__(self, path):
        self.table = pq.read_table(path, memory_map=True)

    def __len__(self):
        return self.table.num_rows

    def __getitems__(self, indices):
        return self.table.take(indices)


def torch_tokens(path, workers):
    ds = Windows(path)
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    n = 0
    nbytes = 0
    for x, y in DataLoader(ds, batch_size=TOKEN_BATCH, shuffle=True, generator=g, num_workers=workers):
        nbytes += x.numel() * 8 + y.numel() * 8
        n += 1
        if n == TOKEN_BATCHES:
            break
    s = time.perf_counter() - t
    return {"batches": n, "seconds": s, "batches_per_s": n / s, "gb_per_s": nbytes / s / 1e9}


def torch_rows(path, workers):
    ds = Rows(path)
    t = time.perf_counter()
    n = 0
    for b in DataLoader(ds, batch_size=ROW_BATCH, shuffle=False, num_workers=workers, collate_fn=lambda b: b):
        n += 1
    s = time.perf_counter() - t
    return {"batches": n, "seconds": s, "batches_per_s": n / s, "rows_per_s": len(ds) / s}


def main():
    tok, rows = make_data()
    meta = pq.ParquetFile(rows).metadata
    row_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) / meta.num_rows
    env = dict(os.environ, CARGO_TARGET_DIR=os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")))
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "dataload", "--example", "bench_sources"], cwd=ROOT, env=env, check=True)
    exe = os.path.join(env["CARGO_TARGET_DIR"], "release", "examples", "bench_sources")
    rust = {}
    for line in subprocess.run([exe, WORK], capture_output=True, text=True, check=True).stdout.splitlines():
        r = json.loads(line)
        rust[(r["bench"], r["workers"])] = r
    py = {}
    for w in (0, 2):
        py[("tokens", w)] = torch_tokens(tok, w)
        py[("parquet", w)] = torch_rows(rows, w)
    for r in list(rust.values()) + list(py.values()):
        if "rows_per_s" in r:
            r["gb_per_s"] = r["rows_per_s"] * row_bytes / 1e9

    lines = [
        "# dataload sources: statekit loader vs torch DataLoader",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, numpy {np.__version__}, pyarrow {pa.__version__}. "
        "Run: `/opt/statekit-venv/bin/python bench/dataload_sources_bench.py` (release build).",
        "",
        f"* **tokens**: 20M uint16 tokens (40 MB `.bin`), windows of {BLOCK}+1, shuffled, batch {TOKEN_BATCH}, "
        f"{TOKEN_BATCHES} batches; GB/s counts the collated int64 inputs + targets. torch: `np.memmap` Dataset, default collate.",
        f"* **parquet**: 200k rows (int64, ~100 B string, float64, int32), row groups of 10k, one sequential epoch, "
        f"batch {ROW_BATCH}; GB/s = rows/s × {row_bytes:.0f} B (uncompressed bytes per row from the file metadata). "
        "torch: Dataset over `pq.read_table(memory_map=True)` with batched `__getitems__` = `Table.take`.",
        "",
        "| bench | workers | statekit batches/s | torch batches/s | statekit GB/s | torch GB/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for bench in ("tokens", "parquet"):
        for w in (0, 2):
            r, p = rust[(bench, w)], py[(bench, w)]
            lines.append(
                f"| {bench} | {w} | {r['batches_per_s']:.0f} | {p['batches_per_s']:.0f} | {r['gb_per_s']:.2f} | "
                f"{p['gb_per_s']:.2f} | {r['batches_per_s'] / p['batches_per_s']:.1f}× |"
            )
    lines += [
        "",
        "Times include each loader's start (torch: worker processes; statekit: threads) and exclude opening the data. "
        "This machine has 2 cores, so 2 workers compete with the consumer; the ratio is what matters.",
    ]
    out = os.path.join(ROOT, "bench", "RESULTS-dataload-sources.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
