"""Benchmark: merging a ~1 GB DCP checkpoint sharded on two dims (FSDP2 + tensor parallel) into
one file, torch's `dcp_to_torch_save` (what a user runs today) against `ckpt merge`.

    /opt/statekit-venv/bin/python bench/dcp_tp_bench.py [--repeats 3] [--ckpt target/release/ckpt]
        [--write-results]

1. If missing, writes bench/work/vs-cp/dcp-tp-L3/dcp/ (the same checkpoint as `bench/vs_cp.py
   --ops dcp_tp`) with real torch DCP from FSDP2 + TP on a (dp=2, tp=2) mesh of 4 gloo ranks, and
   torch's reference merge of it, ref.pt (bench/py/make_tp_checkpoint.py). bench/work/ is
   git-ignored: never commit it.
2. Checks once that `ckpt merge`'s output holds exactly ref.pt's tensors (names, dtypes, shapes,
   bytes), and that the timed `dcp_to_torch_save` run's output does too.
3. Times both commands in alternated pairs (ckpt, torch, ckpt, torch, ...) in one session, under
   `/usr/bin/time -v` (peak RSS), each from a fresh output folder after a `sync` and a read of the
   sources (both start from the page cache); medians of wall time, largest peak RSS.
   torch's side is its command-line form, `python -m torch.distributed.checkpoint.format_utils
   dcp_to_torch SRC DST`, which calls `dcp_to_torch_save`; the time to start Python and import it
   is measured apart and reported. `ckpt merge` fsyncs its output; torch's `torch.save` does not.
   Then `ckpt merge`'s peak RSS under RAYON_NUM_THREADS=1, 2, 4, 8 (its gathers hold a window per
   thread, so machines with more cores use more).
4. With --write-results, writes bench/RESULTS-dcp-tp.md.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "py"))
import make_tp_checkpoint  # noqa: E402

WORK = os.path.join(ROOT, "bench", "work", "vs-cp")  # shared with bench/vs_cp.py's dcp_tp op
LAYERS = 3
TIME_FILE = os.path.join(WORK, "time-dcp-tp.txt")
THREADS = (1, 2, 4, 8)  # rayon pool sizes for the peak-RSS row


def env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def warm(files):
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def timed(cmd, out_dir, sources, extra_env=None):
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    subprocess.run(["sync"], check=True)
    warm(sources)
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "-o", TIME_FILE, *cmd], capture_output=True, text=True,
                          env=dict(env(), **(extra_env or {})))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    text = open(TIME_FILE).read()
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return wall, rss_kib / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each command (default 3)")
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()

    base = os.path.join(WORK, f"dcp-tp-L{LAYERS}")
    src = make_tp_checkpoint.ensure(base, LAYERS)
    sources = sorted(os.path.join(src, f) for f in os.listdir(src))
    size = sum(os.path.getsize(f) for f in sources)
    print(f"checkpoint: {src}, {size / 1e9:.3f} GB in {len(sources)} files", flush=True)

    ckpt = os.path.abspath(args.ckpt)
    ck_out = os.path.join(WORK, "dcp-tp-out-ckpt")
    th_out = os.path.join(WORK, "dcp-tp-out-torch")
    cmds = {
        "ckpt merge": [ckpt, "--quiet", "merge", src, os.path.join(ck_out, "model.safetensors")],
        "dcp_to_torch_save": [sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                              src, os.path.join(th_out, "model.pt")],
    }
    outs = {"ckpt merge": ck_out, "dcp_to_torch_save": th_out}

    # One untimed run of each, checked against the reference.
    for name, cmd in cmds.items():
        timed(cmd, outs[name], sources)
    merged_ok = make_tp_checkpoint.check(os.path.join(ck_out, "model.safetensors"), base)
    # torch.save names its zip records after the file, so compare tensors, not files.
    torch_same = make_tp_checkpoint.check(os.path.join(th_out, "model.pt"), base, "the timed dcp_to_torch_save output")
    out_bytes = {name: os.path.getsize(os.path.join(outs[name], os.listdir(outs[name])[0])) for name in cmds}

    runs = {name: {"walls": [], "rss": []} for name in cmds}
    for i in range(args.repeats):
        for name, cmd in cmds.items():
            w, r = timed(cmd, outs[name], sources)
            runs[name]["walls"].append(w)
            runs[name]["rss"].append(r)
            print(f"run {i + 1}: {name:18s} {w:6.2f} s  {r:8.1f} MiB", flush=True)
    # The merge's gathers hold a window per thread: its peak RSS by rayon thread count, as on
    # machines with more cores than this one.
    by_threads = {}
    for n in THREADS:
        w, r = timed(cmds["ckpt merge"], outs["ckpt merge"], sources, {"RAYON_NUM_THREADS": str(n)})
        by_threads[n] = r
        print(f"RAYON_NUM_THREADS={n}: ckpt merge {w:6.2f} s  {r:8.1f} MiB", flush=True)
    # Starting Python and importing format_utils: part of torch's wall time, not of the merge.
    imports = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch.distributed.checkpoint.format_utils"], check=True, env=env())
        imports.append(time.perf_counter() - t0)
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)

    import platform

    import torch

    med = {name: statistics.median(r["walls"]) for name, r in runs.items()}
    peak = {name: max(r["rss"]) for name, r in runs.items()}
    base_t = med["dcp_to_torch_save"]
    rows = make_tp_checkpoint.layout(src)
    gathered = [r for r in rows if len(r[1]) > 1 and not r[6]]
    whole_rows = [r for r in rows if len(r[1]) > 1 and r[6]]
    mib = lambda shape: (shape[0] * (shape[1] if len(shape) > 1 else 1)) * 2 / 2**20
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        "# DCP merge of an FSDP2 + tensor-parallel checkpoint",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, {mem:.0f} GiB RAM, "
        f"kernel {platform.release()}; torch {torch.__version__}. `bench/dcp_tp_bench.py --repeats {args.repeats}` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Checkpoint: torch DCP (`dcp.save` of `get_model_state_dict`) from FSDP2 + TP on a (dp=2, tp=2) mesh of 4 gloo "
        f"ranks (`bench/py/make_tp_checkpoint.py`), bf16, {len(rows)} tensors, {size / 1e9:.3f} GB in 4 `.distcp` files. "
        f"{len(whole_rows)} weights are `ColwiseParallel` (placements (_StridedShard(0), Shard(0)): 4 chunks of whole rows, "
        f"one run each); {len(gathered)} are `RowwiseParallel` (placements (Shard(0), Shard(1)): 4 chunks split on dims 0 "
        f"and 1, so a merged row is 2 runs from 2 files: "
        + ", ".join(sorted({f"{r[1][0]}x{r[1][1]} in runs of {r[5] // 1024} KiB" for r in gathered}))
        + f"; {sum(mib(r[1]) for r in gathered):.0f} of {sum(mib(r[1]) for r in rows):.0f} MiB); the rest are 1-D "
        "(wq's bias Shard(0) on tp, norms Shard(0) on dp).",
        "",
        f"The two commands ran alternated, {args.repeats} time(s) each after one untimed checked run of each, every run "
        "from a fresh output folder after a `sync` and a read of the `.distcp` files (both start from the page cache). "
        "Wall time around the process; peak RSS from `/usr/bin/time -v`. torch's side is `python -m "
        "torch.distributed.checkpoint.format_utils dcp_to_torch SRC DST` (it calls `dcp_to_torch_save`); "
        "`ckpt merge` fsyncs its output, `torch.save` does not.",
        "",
        "| command | output | median wall (s) | peak RSS (MiB) | time ratio vs dcp_to_torch_save |",
        "|---|---|---|---|---|",
    ]
    for name in cmds:
        kind = "safetensors" if name == "ckpt merge" else "torch.save zip"
        lines.append(f"| `{name}` | {out_bytes[name] / 1e9:.3f} GB {kind} | {med[name]:.2f} | {peak[name]:.1f} | "
                     f"{med[name] / base_t:.2f} |")
    lines += [
        "",
        f"- `ckpt merge` output tensors equal `dcp_to_torch_save`'s (ref.pt) bit for bit: {merged_ok} "
        f"({len(rows)} tensors: names, dtypes, shapes, bytes); so does the output of the timed `dcp_to_torch_save` "
        f"command: {torch_same}",
        f"- Starting Python and importing `torch.distributed.checkpoint.format_utils` alone (no merge): median "
        f"{statistics.median(imports):.2f} s, part of torch's wall time above; less that, torch's merge takes about "
        f"{base_t - statistics.median(imports):.2f} s and `ckpt merge` "
        f"{med['ckpt merge'] / (base_t - statistics.median(imports)):.2f}x that",
    ]
    lines.append("- Peak RSS of `ckpt merge` by rayon thread count (`RAYON_NUM_THREADS`; by default one per CPU): "
                 + ", ".join(f"{n}: {r:.1f} MiB" for n, r in by_threads.items()))
    for name in cmds:
        lines.append(f"- `{name}` runs (s): {', '.join(f'{w:.2f}' for w in runs[name]['walls'])}; peak RSS (MiB): "
                     f"{', '.join(f'{r:.1f}' for r in runs[name]['rss'])}")
    lines += [f"- `ckpt merge` against a durable `cp` of the same `.distcp` files: the `dcp_tp` row of "
              "`bench/vs_cp.py` (RESULTS-vs-cp.md)", ""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(WORK, "dcp-tp-results.json"), "w") as f:
        json.dump({"size_bytes": size, "runs": runs, "imports": imports, "rss_by_threads": by_threads, "merged_ok": merged_ok,
                   "torch_same": torch_same}, f, indent=1)
    if args.write_results:
        with open(os.path.join(ROOT, "bench", "RESULTS-dcp-tp.md"), "w") as f:
            f.write(text)
    if not (merged_ok and torch_same):
        sys.exit(1)


if __name__ == "__main__":
    main()
