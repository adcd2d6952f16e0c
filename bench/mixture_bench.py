"""Benchmark: weighted mixtures (issue 30), resume cost and read throughput.

    /opt/statekit-venv/bin/python bench/mixture_bench.py [--repeats 7] [--megatron-python PY]

(a) **Resume cost at k = 10^6, 10^9, 10^12** for one mixture: three sources of 4,000,000,
    1,000,000 and 200,000 samples, weights 0.6/0.3/0.1, all repeating, 10^12 + 10^6 samples long.
    * statekit: building the `Mixture`, `locate(k)`, `positions(k)`; then what a resumed rank
      does: a `ShardedBatchSampler(len(m), 32, num_processes=8, process_index=3, mixture=m)` and
      `load_state_dict` of the state a run saved at cursor k (the state is plain data: the
      cursor is set in it), then its first batch and the `locate_many` of it. Each the median
      of `--repeats` runs.
    * torchdata 0.11 `MultiNodeWeightedSampler` over the same three sources, each a
      `MapStyleWrapper(range(n), RandomSampler(range(n), generator))` (the documented way to put a
      map-style dataset under it; a source is reshuffled each time it runs out, as statekit's),
      `CYCLE_FOREVER`, restored with `reset(state)`: at k = 10^6 from the state it saved after
      reading 10^6 samples (the time to read them is shown); at 10^9 and 10^12 from that state
      with the counters a run could hold there written in (`num_yielded` = k; each source's count
      drawn as k·w_i plus a normal deviate of the multinomial's standard deviation, which gives
      its pass number and how far into that pass it is: what the restore costs depends on those,
      not on the generator state it also holds).
    * Megatron-Core 0.19.2's `build_blending_indices` (what `BlendedDataset` builds, once, for the
      whole run: 10 bytes per sample) for k samples, run by `--megatron-python` (an interpreter
      its compiled helper loads in, with numpy); k = 10^12 would need a 10 TB index and is not
      run, 10^9 only when the memory is there (10 GB).
(b) **Read throughput**: token windows of 1024+1 tokens, batch 32, 0 workers, read in the main
    thread by statekit's native reader: one token file (20M uint16 tokens, 40 MB, shuffled by the
    seedable sampler, `TokenDataset.get_batch`) against a mixture of three token files (12M, 6M
    and 2M tokens; weights 0.6/0.3/0.1; the mixture's own order through the sequential sampler;
    `Mixture.get_batch`, which locates the batch and reads each source's windows in one native
    call). Alternated runs of 400 batches each (`--pairs` of them), per-sample medians and the
    median of the pairs' ratios. Also the per-item path torch's `DataLoader` takes (default
    collate; the mixture's batches through its `__getitems__`).

Times are CPU time of the timing thread (`time.thread_time`), wall time beside it for the
throughput: the machine is shared and at times loaded far past its cores.

Writes bench/RESULTS-mixture.md. Never run by the tests.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from bench_common import token_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORK = os.path.join(ROOT, "bench", "work", "mixture")
SIZES, WEIGHTS, SEED = (4_000_000, 1_000_000, 200_000), (0.6, 0.3, 0.1), 0
LENGTH = 10**12 + 10**6
KS = (10**6, 10**9, 10**12)
BLOCK, BATCH, BATCHES = 1024, 32, 400
MCORE = "/opt/mcore"
HELPER = os.path.join(MCORE, "megatron", "core", "datasets", "helpers_cpp.cpython-312-x86_64-linux-gnu.so")


# The clock every time is read on: the timing thread's CPU time (user + system). The machine is
# shared with builds and benchmarks that load it far past its 2 cores at times, and a thread's CPU
# time is what such load disturbs least. Everything timed runs on the timing thread (torch with
# one thread; statekit's native calls run on the calling thread).
CLOCK = time.thread_time


def median_us(fn, repeats):
    times = []
    for _ in range(repeats):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    return statistics.median(times) * 1e6


def fmt_us(us):
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


# --- (a) resume cost ----------------------------------------------------------------------------


def statekit_resume(repeats):
    from statekit.data import Mixture, ShardedBatchSampler

    rows = []
    for once in ((), (2,)):
        m = Mixture(SIZES, WEIGHTS, seed=SEED, once=once, length=LENGTH)
        template = ShardedBatchSampler(len(m), BATCH, num_processes=8, process_index=0, mixture=m).state_dict()
        for k in KS:
            build = median_us(lambda: Mixture(SIZES, WEIGHTS, seed=SEED, once=once, length=LENGTH), repeats)
            locate = median_us(lambda: m.locate(k), repeats)
            positions = median_us(lambda: m.positions(k), repeats)
            state = dict(template, cursor=k, world_size=4)  # saved on 4 ranks, resumed on 8

            def resume():
                s = ShardedBatchSampler(len(m), BATCH, num_processes=8, process_index=3, mixture=m)
                s.load_state_dict(state)
                return s

            load = median_us(resume, repeats)

            def first():
                s = resume()
                batch = next(iter(s))
                m.locate_many(batch)

            first_batch = median_us(first, repeats)
            s = resume()
            batch = next(iter(s))
            assert batch[0] == k + 3 * BATCH, "rank 3 of 8 starts 3 batches past the cursor"
            rows.append({"once": bool(once), "k": k, "build": build, "locate": locate, "positions": positions,
                         "load": load, "first": first_batch, "located": m.locate(k), "counts": m.positions(k)})
    return rows


def torchdata_nodes():
    from torch.utils.data import RandomSampler
    from torchdata.nodes import MapStyleWrapper, MultiNodeWeightedSampler
    from torchdata.nodes.samplers.stop_criteria import StopCriteria

    def make():
        sources = {f"s{i}": MapStyleWrapper(range(n), RandomSampler(range(n), generator=torch.Generator().manual_seed(i)))
                   for i, n in enumerate(SIZES)}
        return MultiNodeWeightedSampler(sources, {f"s{i}": w for i, w in enumerate(WEIGHTS)},
                                        stop_criteria=StopCriteria.CYCLE_FOREVER, rank=0, world_size=1, seed=SEED)

    return make


def torchdata_resume(repeats):
    import copy

    from torchdata.nodes.samplers.multi_node_weighted_sampler import _WeightedSampler

    make = torchdata_nodes()
    node = make()
    node.reset()
    t = CLOCK()
    for _ in range(KS[0]):
        next(node)
    replay = CLOCK() - t
    real = node.state_dict()
    reps = max(3, repeats // 2)  # each restore draws the sources' permutations again: seconds
    rows = []
    rng = np.random.default_rng(0)
    for k in KS:
        state = copy.deepcopy(real)
        if k != KS[0]:
            # Each source's count after k multinomial draws: k·w_i give or take its standard
            # deviation (drawn here), so where each source is in its pass is where a run would be.
            counts = [int(round(k * w + rng.normal() * (k * w * (1 - w)) ** 0.5)) for w in WEIGHTS[1:]]
            counts.insert(0, k - sum(counts))
            state["num_yielded"] = k
            for i, (n, read) in enumerate(zip(SIZES, counts)):
                src = state["dataset_node_states"][f"s{i}"]["it_state"]["source"]
                src["_num_yielded"], src["_epoch"] = read % n, read // n

        def restore():
            fresh = make()
            fresh.reset(state)
            return fresh

        restore_us = median_us(restore, reps)
        first = median_us(lambda: next(restore()), reps)
        ws = state["weighted_sampler_state"]
        sampler_only = median_us(lambda: _WeightedSampler(dict(zip(("s0", "s1", "s2"), WEIGHTS)), SEED, 0, 1, 0,
                                                          initial_state=ws), repeats)
        in_pass = [state["dataset_node_states"][f"s{i}"]["it_state"]["source"]["_num_yielded"] for i in range(3)]
        rows.append({"k": k, "restore": restore_us, "first": first, "sampler_only": sampler_only, "in_pass": in_pass,
                     "state": "saved after reading 10^6 samples" if k == KS[0] else "10^6 state, k's counters"})
    return rows, replay


MEGATRON_SCRIPT = r"""
import importlib.util, json, sys, time
import numpy
spec = importlib.util.spec_from_file_location("helpers_cpp", sys.argv[1])
helpers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helpers)
weights = numpy.array(json.loads(sys.argv[2]), dtype=numpy.float64)
for size in map(int, sys.argv[3:]):
    t = time.thread_time()
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(weights), size, False)
    s = time.thread_time() - t
    counts = numpy.bincount(dataset_index, minlength=len(weights)).tolist()
    print(json.dumps({"size": size, "seconds": s, "bytes": dataset_index.nbytes + dataset_sample_index.nbytes,
                      "counts": counts}), flush=True)
    del dataset_index, dataset_sample_index
"""


def megatron_in_venv():
    """Whether megatron-core's helper imports in this interpreter (the statekit venv)."""
    proc = subprocess.run([sys.executable, "-c", "from megatron.core.datasets import helpers"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=MCORE))
    last = (proc.stderr.strip().splitlines() or ["(no error)"])[-1]
    return proc.returncode == 0, last


def available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def megatron_build(python):
    sizes = [10**6, 10**8]
    if available_bytes() > 2 * 10 * 10**9:
        sizes.append(10**9)
    proc = subprocess.run([python, "-c", MEGATRON_SCRIPT, HELPER, json.dumps(list(WEIGHTS)), *map(str, sizes)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc.stderr.strip().splitlines()[-1:]
    version = subprocess.run([python, "-c", "import sys, numpy; print(sys.version.split()[0], numpy.__version__)"],
                             capture_output=True, text=True).stdout.split()
    return [json.loads(line) for line in proc.stdout.splitlines()], version


# --- (b) throughput -----------------------------------------------------------------------------


def token_files():
    os.makedirs(WORK, exist_ok=True)
    single = token_file(os.path.join(WORK, "single.bin"), 20_000_000, seed=0)
    parts = [token_file(os.path.join(WORK, f"part{i}.bin"), n, seed=10 + i)
             for i, n in enumerate((12_000_000, 6_000_000, 2_000_000))]
    return single, parts


def throughput(repeats):
    from torch.utils.data import DataLoader

    from statekit.data import Mixture, ShardedBatchSampler, TokenDataset

    single_path, part_paths = token_files()
    single = TokenDataset(single_path, BLOCK)
    parts = [TokenDataset(p, BLOCK) for p in part_paths]
    mix = Mixture.of(parts, WEIGHTS, seed=SEED, length=len(single))

    def batches_single():
        return ShardedBatchSampler(len(single), BATCH, num_processes=1, process_index=0, shuffle=True, seed=0)

    def batches_mix():
        return ShardedBatchSampler(len(mix), BATCH, num_processes=1, process_index=0, mixture=mix)

    def clocked(read_all):
        """(CPU, wall) seconds per sample of `read_all()`, which returns the samples it read."""
        c, w = CLOCK(), time.perf_counter()
        n = read_all()
        return (CLOCK() - c) / n, (time.perf_counter() - w) / n

    def run(ds, sampler):
        def read_all():
            n = 0
            for b in sampler:
                x, y = ds.get_batch(b)
                n += len(b)
                if n >= BATCHES * BATCH:
                    break
            return n
        return clocked(read_all)

    def run_torch(ds, sampler):
        def read_all():
            n = 0
            for x, y in DataLoader(ds, batch_sampler=sampler, num_workers=0):
                n += len(x)
                if n >= BATCHES * BATCH:
                    break
            return n
        return clocked(read_all)

    def locate_only(sampler):
        def read_all():
            n = 0
            for b in sampler:
                mix.locate_many(b)
                n += len(b)
                if n >= BATCHES * BATCH:
                    break
            return n
        return clocked(read_all)

    # warm the page cache and both paths
    run(single, batches_single())
    run(mix, batches_mix())
    out = {"batch": ([], []), "torch": ([], []), "locate": []}
    for _ in range(repeats):
        out["batch"][0].append(run(single, batches_single()))
        out["batch"][1].append(run(mix, batches_mix()))
    for _ in range(max(3, repeats // 2)):
        out["torch"][0].append(run_torch(single, batches_single()))
        out["torch"][1].append(run_torch(mix, batches_mix()))
    for _ in range(repeats):
        out["locate"].append(locate_only(batches_mix()))
    # the two read the same kind of windows: check the mixture's rows are its sources'
    b = next(iter(batches_mix()))
    x, _ = mix.get_batch(b)
    s, j = mix.locate(b[0])
    assert x[0].tolist() == parts[s][j][0].tolist()
    return out, len(single)


# --- report -------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=15, help="alternated runs of each side in the throughput part")
    ap.add_argument("--megatron-python", default=os.environ.get("MCORE_PYTHON"),
                    help="an interpreter megatron-core's compiled helper (CPython 3.12) loads in, with numpy")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # The throughput comparison first: it is the one a busy machine spoils most.
    load_before = os.getloadavg()[0]
    tp, single_len = throughput(args.pairs)
    load_tp = os.getloadavg()[0]
    ours = statekit_resume(args.repeats)
    td, replay = torchdata_resume(args.repeats)
    in_venv, venv_error = megatron_in_venv()
    mega, mega_info = (None, None)
    if args.megatron_python:
        mega, mega_info = megatron_build(args.megatron_python)
    load_after = os.getloadavg()[0]

    import statekit
    import torchdata

    lines = [
        "# Weighted mixtures: resume cost and read throughput",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, kernel {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, torchdata {torchdata.__version__}, "
        f"numpy {np.__version__}, statekit {statekit.__version__} (release build, installed with pip). "
        f"Run: `/opt/statekit-venv/bin/python bench/mixture_bench.py --repeats {args.repeats} --pairs {args.pairs}"
        + (f" --megatron-python {args.megatron_python}`" if args.megatron_python else "`")
        + f" on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average (1 min) {load_before:.1f} at the "
        f"start, {load_tp:.1f} after the throughput runs (the first part), {load_after:.1f} at the end.",
        "",
        f"The mixture: sources of {', '.join(f'{n:,}' for n in SIZES)} samples, weights "
        f"{'/'.join(map(str, WEIGHTS))}, seed {SEED}, all repeating (reshuffled each pass), {LENGTH:,} samples long. "
        "Times are medians of repeated runs in one process, in CPU time of the timing thread (`time.thread_time`: "
        "the machine is shared, and its load went far past its 2 cores during some runs; wall time is shown beside "
        "it for the throughput runs).",
        "",
        "SUMMARY",
        "",
        "<!-- summary-end -->",
        "",
        "## Resume at position k",
        "",
        "statekit: what a rank resuming at k does. `Mixture(...)` builds the definition (its segments; nothing per "
        "sample); `locate(k)` and `positions(k)` are the O(1) look-ups; *sampler + load* is "
        "`ShardedBatchSampler(len(m), 32, num_processes=8, process_index=3, mixture=m)` and `load_state_dict` of a "
        "state saved at cursor k on 4 ranks (elastic: 4 → 8); *first batch* adds that rank's first batch of indices and "
        "their `locate_many`.",
        "",
        "| k | sources read once | `Mixture(...)` | `locate(k)` | `positions(k)` | sampler + load | + first batch located | "
        "each source's samples before k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ours:
        lines.append(f"| 10^{len(str(r['k'])) - 1} | {'source 2' if r['once'] else 'none'} | {fmt_us(r['build'])} | "
                     f"{fmt_us(r['locate'])} | {fmt_us(r['positions'])} | {fmt_us(r['load'])} | {fmt_us(r['first'])} | "
                     f"{', '.join(f'{c:,}' for c in r['counts'])} |")
    lines += [
        "",
        f"torchdata {torchdata.__version__} `MultiNodeWeightedSampler` (per-rank state; see the module docstring for "
        f"the sources): reading the first 10^6 samples to have a state to restore took {replay:.1f} s. *restore* is "
        "`reset(state)` on a freshly built node, *first item* adds the `next()` after it; *weighted sampler alone* is "
        "the restore of its own part of the state (a `torch.Generator` state and an offset into a batch of 1000 "
        "draws), what the restore would cost if the sources' restores were free.",
        "",
        "| k | state | each source's position in its pass | restore | restore + first item | weighted sampler alone |",
        "|---|---|---|---|---|---|",
    ]
    for r in td:
        lines.append(f"| 10^{len(str(r['k'])) - 1} | {r['state']} | {', '.join(f'{c:,}' for c in r['in_pass'])} | "
                     f"{fmt_us(r['restore'])} | {fmt_us(r['first'])} | {fmt_us(r['sampler_only'])} |")
    lines += [
        "",
        "The torchdata restore is O(size of the sources), not O(k): each `SamplerWrapper` over a `RandomSampler` draws its "
        "current pass's permutation again (`randperm` of the source's length and its `tolist`) and walks it to the "
        "position it had reached in that pass (a source at the start of a pass defers the draw to its first item, "
        "hence the last two columns). It is the same at 10^9 and 10^12 as at 10^6 up to where in its pass "
        "each source is. What it cannot do at any k is move to another world size: the state is one rank's, its "
        "draws seeded by `seed * world_size + rank`, so a run saved on N ranks resumes on N ranks only. statekit's "
        "state is one cursor for all ranks.",
        "",
    ]
    if in_venv:
        lines.append("Megatron-Core's helper imported in the statekit venv.")
    else:
        lines.append(f"Megatron-Core 0.19.2 (`PYTHONPATH={MCORE}`): its blended-index helper does not load in the "
                     f"statekit venv (Python {platform.python_version()}): it is compiled for CPython 3.12 only "
                     f"(`helpers_cpp.cpython-312-x86_64-linux-gnu.so`); the import fails with `{venv_error}`. "
                     "No number from the venv.")
    if mega:
        lines += [
            "",
            f"Run instead by `{args.megatron_python}` (Python {mega_info[0]}, numpy {mega_info[1]}: a separate "
            "interpreter, with the helper loaded from its file), `build_blending_indices` for a `BlendedDataset` of "
            "k samples: what Megatron builds (or reads back from its cache) before a run of k samples, and again for "
            "another blend or size. Its index is 10 bytes per sample.",
            "",
            "| k | build | index size | samples per source |",
            "|---|---|---|---|",
        ]
        for r in mega:
            lines.append(f"| 10^{len(str(r['size'])) - 1} | {fmt_us(r['seconds'] * 1e6)} | {r['bytes'] / 1e9:.2f} GB | "
                         f"{', '.join(f'{c:,}' for c in r['counts'])} |")
        if not any(r["size"] == 10**9 for r in mega):
            lines.append("| 10^9 | not run: 10 GB of index, more than half the memory available | 10 GB | |")
        lines.append("| 10^12 | not run: a 10 TB index | 10 TB | |")
    elif args.megatron_python:
        lines.append(f"The helper did not run under `{args.megatron_python}` either: {mega_info}.")
    def stats(path, clock):
        """Medians (µs/sample) of one source and of the mixture, and the median of the pair ratios."""
        c = 0 if clock == "cpu" else 1
        one = [r[c] * 1e6 for r in tp[path][0]]
        mix = [r[c] * 1e6 for r in tp[path][1]]
        return statistics.median(one), statistics.median(mix), statistics.median(b / a for a, b in zip(one, mix))

    med = {(p, c): stats(p, c) for p in ("batch", "torch") for c in ("cpu", "wall")}
    locate_us = statistics.median(r[0] for r in tp["locate"]) * 1e6
    names = {"batch": "`get_batch` (the native batch read)",
             "torch": "torch `DataLoader` per item (views of the map, default collate)"}
    lines += [
        "",
        "## Read throughput: a 3-source mixture against one source",
        "",
        f"Token windows of {BLOCK}+1 tokens (uint16 files, int64 batches), batch {BATCH}, {BATCHES} batches a run, "
        f"0 workers, page cache warm. One source: a 20M-token file ({single_len:,} windows), shuffled (seedable "
        "sampler). Mixture: files of 12M, 6M and 2M tokens, weights 0.6/0.3/0.1, all repeating, as long as the "
        "single source, in its own order (sequential sampler). Both read by statekit's native token reader "
        "(`TokenDataset.get_batch`; `Mixture.get_batch` locates the batch and reads each source's windows in one "
        "native call, GIL released). Runs alternate one source and the mixture; per-sample medians, and the median "
        "of the pairs' ratios (what the 5% target is read on), in CPU time of the reading thread and in wall time.",
        "",
        "| path | clock | one source (µs/sample) | mixture (µs/sample) | mixture / one (medians) | median of pair ratios "
        "| pairs |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in ("batch", "torch"):
        for c in ("cpu", "wall"):
            one, mix, ratio = med[(p, c)]
            lines.append(f"| {names[p]} | {c} | {one:.2f} | {mix:.2f} | {mix / one:.3f} | {ratio:.3f} | "
                         f"{len(tp[p][0])} |")
    lines += [
        "",
        f"Of the mixture's time, locating the samples (`locate_many` of each batch alone, from Python) is "
        f"{locate_us:.3f} µs of CPU per sample.",
        "",
        "Where the mixture's extra time goes: locating. A `perf record` of the Rust `Mixture::locate_many` alone over "
        "the same batches (a scratch program, 2026-12-03: 10 µs of CPU per batch of 32, about 0.3 µs a sample) "
        "puts 69% of it in `Permutation::round`: six Feistel rounds of two splitmix64 each, run for every position of "
        "the 64-sample block a batch falls in (each of the two batches of a block draws the whole block again), and "
        "1.4 to 2.8 times per sample for its source's permutation (cycle walking, the domain rounded up to an even "
        "number of bits: 4096 or 16384 positions for sources of 1,953 and 5,859 windows). A copy of that round "
        "function timed alone: four rounds of one splitmix64 each take 40% of the time of six of two.",
        "",
        "Runs (µs/sample, CPU), one source / mixture: get_batch "
        + ", ".join(f"{a[0] * 1e6:.2f}/{b[0] * 1e6:.2f}" for a, b in zip(*tp["batch"]))
        + "; DataLoader " + ", ".join(f"{a[0] * 1e6:.2f}/{b[0] * 1e6:.2f}" for a, b in zip(*tp["torch"])) + ".",
    ]
    # The summary RESULTS.md shows (bench/assemble.sh keeps what is above the marker).
    top = {r["k"]: r for r in ours if not r["once"]}
    tdk = {r["k"]: r for r in td}
    big = KS[-1]
    summary = (
        f"Resume at k = 10^12: statekit builds the mixture, a sampler for rank 3 of 8 and loads a state saved on 4 "
        f"ranks in {fmt_us(top[big]['build'] + top[big]['load'])} (first batch located: {fmt_us(top[big]['first'])}; "
        f"`locate(k)` {fmt_us(top[big]['locate'])}, `positions(k)` {fmt_us(top[big]['positions'])}), the same at "
        f"10^6 and 10^9 ({fmt_us(top[KS[0]]['build'] + top[KS[0]]['load'])}, "
        f"{fmt_us(top[KS[1]]['build'] + top[KS[1]]['load'])}). torchdata's `MultiNodeWeightedSampler` restores its "
        f"state and gives its first item in {fmt_us(tdk[KS[0]]['first'])}, {fmt_us(tdk[KS[1]]['first'])} and "
        f"{fmt_us(tdk[big]['first'])} (it redraws and walks each source's pass; on the saving world size only)."
    )
    if mega:
        built = ", ".join(f"{fmt_us(r['seconds'] * 1e6)} at 10^{len(str(r['size'])) - 1}" for r in mega)
        summary += (f" Megatron-Core's blended index build (run by a separate Python 3.12: its helper does not load in "
                    f"the 3.11 venv) takes {built}, 10 bytes per sample; 10^12 is out of reach (10 TB).")
    elif not in_venv:
        summary += " Megatron-Core's blended index helper does not load in the 3.11 venv (CPython 3.12 only): no number."
    one, mix, ratio = med[("batch", "cpu")]
    summary += (f" Reading token windows through a 3-source mixture costs {ratio:.3f}× the CPU time per sample of one "
                f"source (median of {len(tp['batch'][0])} alternated pairs; medians {mix:.2f} against {one:.2f} µs; "
                f"native batch reads; target under 1.05), {med[('torch', 'cpu')][2]:.3f}× through torch's "
                "`DataLoader` per item.")
    lines[lines.index("SUMMARY")] = summary
    out = os.path.join(ROOT, "bench", "RESULTS-mixture.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
