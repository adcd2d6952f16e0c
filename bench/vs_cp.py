"""Each copy-shaped ckpt operation against a durable `cp` of the same bytes, paired and alternated.

    /opt/statekit-venv/bin/python bench/vs_cp.py [--pairs 7] [--warmup 1] [--trace 3]
        [--ops split,merge,convert,dcp,zero,dcp_tp,megatron,megatron_moe_hf] [--ckpt target/release/ckpt]
        [--no-write]

The redesign's target is that split, merge, convert and the DCP and ZeRO merges each take at most
1.1x the time of copying the same bytes with `cp` and fsyncing the copies, at under 64 MiB peak
RSS; the merge of a DCP checkpoint sharded on two dims (FSDP2 + tensor parallel, `dcp_tp`), whose
row-wise shards are gathered row by row, at most 1.2x; the merge of a Megatron-Core `torch_dist`
checkpoint (`megatron`: tensor parallel 2, whose row-parallel weights, split on their input dim,
are gathered row by row too, into the model megatron holds on one rank, layers unstacked) has the
same 1.2x target, and so has the conversion of a Megatron-LM mixture-of-experts run to a Hugging
Face folder (`megatron_moe_hf`: `ckpt convert RUN OUT --to hf`, which splits the fused QKV rows
per query group, so part of it is copied as row ranges rather than whole chunks). Timings on a
shared 2-core machine drift by more than that margin over a minute, so the two sides are never
measured in separate batches: every operation runs as pairs, A (the
ckpt command) then B (the baseline), A, B, ... and the table reports the medians of each side and
the median of the per-pair ratios (a drift that hits one pair hits both of its halves).

Every run gets a fresh, empty output folder, then `sync` (so the previous run's write-back and
deletion are not billed to this one), then a read of the sources (so both sides start with them in
the page cache). Both sides run under `/usr/bin/time -v`, which gives the peak RSS; wall time is
taken around the process. With strace on the machine, a few more runs of each side (not timed
into the medians) split the time into phases: planning, copies, fsyncs.

The baselines, B, copy the bytes the operation moves:
- split: the output shards of the same split (`shards/`, which is also the merge input), copied as
  separate files by one `cp`, then each fsynced (`sync FILE...` calls fsync per file).
- merge, convert, DCP and Megatron merges, the Megatron MoE conversion: the input data files
  (`*.safetensors`, the `.bin`, the `*.distcp`), copied into the output folder by one `cp`, then
  each fsynced.
- ZeRO merge: the merge reads only the fp32 master partitions from `*_optim_states.pt`, a third of
  those files (the rest is Adam's two moments), so copying the input files would triple the bytes.
  The baseline copies, per rank, a file holding exactly that partition's bytes (cut once from the
  rank's optimizer file into `zero-ref/`).

Inputs are generated once under bench/work/vs-cp/ (git-ignored) with the real tools: safetensors
`save_file`, `torch.save`, torch DCP from FSDP2 on 2 gloo ranks (bench/py/make_dcp_checkpoint.py),
torch DCP from FSDP2 + TP on a (dp=2, tp=2) mesh of 4 gloo ranks (bench/py/make_tp_checkpoint.py),
DeepSpeed ZeRO-3 on 2 CPU ranks (bench/ds_bench.py's worker), megatron-core 0.19.2's
`dist_checkpointing.save` of a GPTModel at tensor parallel 2 on 2 gloo ranks
(bench/py/make_megatron_checkpoint.py; needs megatron-core unpacked at /opt/mcore, see that file,
and the op is skipped without it), and Megatron-LM's `save_checkpoint` of a Qwen2-MoE-style
GPTModel at expert parallel 2 on 2 gloo ranks (bench/py/make_megatron_moe_checkpoint.py, same
requirement; its `--check` compares a converted folder with megatron's one-rank load). Results:
bench/RESULTS-vs-cp.md.
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "bench", "work", "vs-cp")
PY = sys.executable
BIN = os.path.dirname(PY)
SHARD = "200MB"
DCP_LAYERS = 8  # 196 MiB embedding + 8 blocks of 96 MiB: 1.01 GB of bf16
ZERO_GIB = 2.8  # ds_bench's size knob counts the optimizer files: 15 layers, 1.0 GB of fp32 params
TP_LAYERS = 3  # blocks of 320 MiB (dim 4096, FFN 8192): 1.007 GB of bf16, on a (dp=2, tp=2) mesh
MEGATRON_LAYERS = 7  # layers of 100.7 MB (hidden 2048, FFN 8192) + 2 x 131 MB vocab: 0.967 GB of bf16
# megatron_moe_hf's run: 1 dense + 4 MoE layers (8 experts + a shared one), 1.057 GB of bf16; its
# sizes are in bench/py/make_megatron_moe_checkpoint.py.
# A/B targets; an op not named here has 1.1.
TARGET = {"dcp_tp": 1.2, "megatron": 1.2, "megatron_moe_hf": 1.2}
TIME_FILE = os.path.join(WORK, "time.txt")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw):
    subprocess.run(cmd, check=True, **kw)


def env_for_tools():
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


# ---------------------------------------------------------------- inputs, written once


def make_torch_bin(path, gib):
    """A `torch.save` file of f32 and bf16 matrices with no shared storage, so that converting it
    is a pure copy (no tie to dedupe or duplicate)."""
    import torch

    g = torch.Generator().manual_seed(0)
    sd, total, i = {}, 0, 0
    while total < gib * 2**30:
        t = torch.randn(2048, 4096, generator=g)
        t = t.bfloat16() if i % 2 else t
        sd[f"model.layers.{i}.weight"] = t
        sd[f"model.layers.{i}.bias"] = torch.randn(4096, generator=g)
        total += t.numel() * t.element_size() + 4096 * 4
        i += 1
    torch.save(sd, path + ".part")
    os.replace(path + ".part", path)


def zero_ref(ck, out_dir):
    """Cuts each rank's fp32 master partition (the bytes `ckpt merge` reads) out of its optimizer
    file into `out_dir/rankN.bin`. torch.save stores tensors uncompressed as zip entries, so the
    partition is one entry, found by its size and confirmed by its first bytes (the Adam moments
    have the same size)."""
    import zipfile

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    tmp = out_dir + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tag = open(os.path.join(ck, "latest")).read().strip()
    files = sorted(glob.glob(os.path.join(ck, tag, "*_optim_states.pt")))
    for r, f in enumerate(files):
        sd = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        groups = sd["optimizer_state_dict"]["fp32_flat_groups"]
        want = [g.numel() * g.element_size() for g in groups]
        with zipfile.ZipFile(f) as z, open(f, "rb") as src, open(os.path.join(tmp, f"rank{r}.bin"), "wb") as dst:
            entries = [i for i in z.infolist() if "/data/" in i.filename and i.compress_type == zipfile.ZIP_STORED]

            def start_of(e):
                src.seek(e.header_offset)
                local = src.read(30)
                return e.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")

            for grp, size in zip(groups, want):
                head = grp.reshape(-1).view(torch.uint8)[:4096].numpy().tobytes()
                matches = []
                for e in entries:
                    if e.file_size == size:
                        src.seek(start_of(e))
                        if src.read(len(head)) == head:
                            matches.append(e)
                if len(matches) != 1:
                    raise SystemExit(f"{f}: {len(matches)} zip entries hold the fp32 partition, expected 1")
                src.seek(start_of(matches[0]))
                left = size
                while left:
                    chunk = src.read(min(left, 1 << 24))
                    dst.write(chunk)
                    left -= len(chunk)
    os.replace(tmp, out_dir)


def inputs(ckpt, ops):
    os.makedirs(WORK, exist_ok=True)
    env = env_for_tools()
    p = {}
    p["st"] = os.path.join(WORK, "model-1GiB.safetensors")
    p["shards"] = os.path.join(WORK, "shards")
    if {"split", "merge"} & set(ops):
        if not os.path.exists(p["st"]):
            log(f"writing {p['st']} ...")
            run([PY, os.path.join(ROOT, "bench", "py", "make_checkpoint.py"), p["st"] + ".part", "1.0"])
            os.replace(p["st"] + ".part", p["st"])
        if not os.path.exists(os.path.join(p["shards"], "model.safetensors.index.json")):
            log(f"writing {p['shards']} with ckpt split ...")
            run([ckpt, "--quiet", "split", p["st"], p["shards"], "--max-shard-size", SHARD],
                stdout=subprocess.DEVNULL)
    if "convert" in ops:
        p["bin"] = os.path.join(WORK, "pytorch_model-1GiB.bin")
        if not os.path.exists(p["bin"]):
            log(f"writing {p['bin']} with torch.save ...")
            run([PY, os.path.abspath(__file__), "--make-torch", p["bin"]])
    if "dcp" in ops:
        base = os.path.join(WORK, f"dcp-L{DCP_LAYERS}")
        p["dcp"] = os.path.join(base, "pytorch_model_fsdp_0")
        if not os.path.exists(os.path.join(p["dcp"], ".metadata")):
            log(f"writing {p['dcp']} with torch DCP (FSDP2, 2 gloo ranks) ...")
            shutil.rmtree(base, ignore_errors=True)
            run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2",
                 os.path.join(ROOT, "bench", "py", "make_dcp_checkpoint.py"), base, str(DCP_LAYERS)], env=env)
    if "dcp_tp" in ops:
        sys.path.insert(0, os.path.join(ROOT, "bench", "py"))
        import make_tp_checkpoint

        p["dcp_tp"] = make_tp_checkpoint.ensure(os.path.join(WORK, f"dcp-tp-L{TP_LAYERS}"), TP_LAYERS, env=env)
    if "megatron" in ops:
        sys.path.insert(0, os.path.join(ROOT, "bench", "py"))
        import make_megatron_checkpoint

        if make_megatron_checkpoint.available():
            p["megatron"] = make_megatron_checkpoint.ensure(os.path.join(WORK, f"megatron-L{MEGATRON_LAYERS}"),
                                                            MEGATRON_LAYERS, env=env)
        else:
            log(f"skipping megatron: megatron-core is not unpacked at {make_megatron_checkpoint.MCORE} "
                "(see the docstring of bench/py/make_megatron_checkpoint.py for the pip command)")
    if "megatron_moe_hf" in ops:
        sys.path.insert(0, os.path.join(ROOT, "bench", "py"))
        import make_megatron_moe_checkpoint

        if make_megatron_moe_checkpoint.available():
            p["megatron_moe"] = make_megatron_moe_checkpoint.ensure(os.path.join(WORK, "megatron-moe"), env=env)
        else:
            log(f"skipping megatron_moe_hf: megatron-core is not unpacked at {make_megatron_moe_checkpoint.MCORE}")
    if "zero" in ops:
        p["zero"] = os.path.join(WORK, f"zero3-{ZERO_GIB}GiB")
        if not os.path.exists(os.path.join(p["zero"], "latest")):
            log(f"writing {p['zero']} with DeepSpeed ZeRO-3 (2 CPU ranks) ...")
            shutil.rmtree(p["zero"], ignore_errors=True)
            run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 os.path.join(ROOT, "bench", "ds_bench.py"), "--worker", "--gib", str(ZERO_GIB), "--out", p["zero"]],
                env=env)
        for extra in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(p["zero"], extra)):
                os.remove(os.path.join(p["zero"], extra))
        p["zero_ref"] = os.path.join(WORK, "zero-ref")
        if not os.path.isdir(p["zero_ref"]):
            log(f"cutting the fp32 partitions into {p['zero_ref']} ...")
            zero_ref(p["zero"], p["zero_ref"])
    return p


# ---------------------------------------------------------------- the pairs


def files_in(d, pattern):
    return sorted(glob.glob(os.path.join(d, pattern)))


def durable_cp(files, out):
    """One `cp` of `files` into the folder `out`, then an fsync of each copy."""
    copies = [os.path.join(out, os.path.basename(f)) for f in files]
    return ["bash", "-c", 'cp -- "${@:2}" "$1"/ && cd "$1" && sync -- *', "durable-cp", out, *files], copies


def operations(ckpt, p, ops):
    """name -> (description, A command template, B files, files A reads). `{out}` is the run's
    output folder."""
    st_shards = files_in(p["shards"], "*.safetensors") if {"split", "merge"} & set(ops) else []
    table = {}
    if "split" in ops:
        table["split"] = ("`ckpt split` 1 GiB safetensors into 200 MB shards",
                          [ckpt, "--quiet", "split", p["st"], "{out}", "--max-shard-size", SHARD],
                          st_shards + files_in(p["shards"], "*.json"), [p["st"]])
    if "merge" in ops:
        table["merge"] = ("`ckpt merge` of those 200 MB shards into one file",
                          [ckpt, "--quiet", "merge", p["shards"], "{out}/model.safetensors"],
                          st_shards, st_shards)
    if "convert" in ops:
        table["convert"] = ("`ckpt convert` 1 GiB torch `.bin` to safetensors (no cast)",
                            [ckpt, "--quiet", "convert", p["bin"], "{out}/model.safetensors"],
                            [p["bin"]], [p["bin"]])
    if "dcp" in ops:
        distcp = files_in(p["dcp"], "*.distcp")
        table["dcp"] = (f"`ckpt merge` of a DCP folder (FSDP2, 2 ranks, {DCP_LAYERS} layers, bf16)",
                        [ckpt, "--quiet", "merge", p["dcp"], "{out}/model.safetensors"],
                        distcp, distcp + [os.path.join(p["dcp"], ".metadata")])
    if "zero" in ops:
        tag = open(os.path.join(p["zero"], "latest")).read().strip()
        reads = files_in(os.path.join(p["zero"], tag), "*_optim_states.pt") + \
            files_in(os.path.join(p["zero"], tag), "*_model_states.pt")
        table["zero"] = ("`ckpt merge` of a DeepSpeed ZeRO-3 checkpoint (2 ranks, fp32)",
                         [ckpt, "--quiet", "merge", p["zero"], "{out}/model.safetensors"],
                         files_in(p["zero_ref"], "*.bin"), reads)
    if "dcp_tp" in ops:
        distcp = files_in(p["dcp_tp"], "*.distcp")
        table["dcp_tp"] = (f"`ckpt merge` of a DCP folder (FSDP2 + TP, dp=2 x tp=2 ranks, {TP_LAYERS} blocks, bf16)",
                           [ckpt, "--quiet", "merge", p["dcp_tp"], "{out}/model.safetensors"],
                           distcp, distcp + [os.path.join(p["dcp_tp"], ".metadata")])
    if "megatron" in p:
        distcp = files_in(p["megatron"], "*.distcp")
        table["megatron"] = (f"`ckpt merge` of a Megatron-Core torch_dist checkpoint (GPTModel, TP 2 ranks, "
                             f"{MEGATRON_LAYERS} layers, bf16) into the one-rank model",
                             [ckpt, "--quiet", "merge", p["megatron"], "{out}/model.safetensors"],
                             distcp, distcp + [os.path.join(p["megatron"], n) for n in (".metadata", "metadata.json")])
    if "megatron_moe" in p:
        it = os.path.join(p["megatron_moe"], "iter_0000002")
        distcp = files_in(it, "*.distcp")
        table["megatron_moe_hf"] = ("`ckpt convert --to hf` of a Megatron-LM MoE run (Qwen2-MoE-style GPTModel, "
                                    "EP 2 ranks, 1 dense + 4 MoE layers of 8 experts + a shared one, bf16) "
                                    "into a Hugging Face folder",
                                    [ckpt, "--quiet", "convert", p["megatron_moe"], "{out}", "--to", "hf"],
                                    distcp, distcp + [os.path.join(it, n) for n in (".metadata", "metadata.json")])
    return table


def warm(files):
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def timed_run(cmd, out, sources):
    """One run from a fresh output folder, after a `sync` and with warm sources, under
    `/usr/bin/time -v`: its wall time and what `time` reported."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run(["sync"])
    warm(sources)
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "-o", TIME_FILE, *cmd], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return wall, open(TIME_FILE).read()


def peak_rss_mib(time_text):
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_text).group(1)) / 1024


def timed(cmd, out, sources):
    wall, text = timed_run(cmd, out, sources)
    return wall, peak_rss_mib(text)


def traced(cmd, out, sources):
    """One run under `strace -f --seccomp-bpf` (only the calls below are stopped, so the run keeps
    its pace): the times of the phase boundaries, the threads, and how the bytes moved."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run(["sync"])
    warm(sources)
    log_file = os.path.join(WORK, "strace.txt")
    calls = "execve,clone,clone3,ftruncate,copy_file_range,pwrite64,write,fsync,fdatasync,rename,exit_group"
    run(["strace", "-f", "--seccomp-bpf", "-qq", "-ttt", "-e", f"trace={calls}", "-o", log_file, *cmd],
        stdout=subprocess.DEVNULL)
    events = []
    for line in open(log_file):
        parts = line.split(None, 2)
        if len(parts) == 3 and not parts[2].startswith("<..."):
            events.append((float(parts[1]), parts[2].split("(", 1)[0], parts[2]))
    return events


def phases(a_cmd, b_cmd, out, sources):
    """A: start to the first `ftruncate` (reading and planning), to the first fsync (the copies),
    to the exit (fsyncs, renames, the index). B: start to the `sync` exec (the `cp`), to the exit."""
    ev = traced(a_cmd, out, sources)
    t0, end = ev[0][0], ev[-1][0]
    first = lambda name: next(t for t, n, _ in ev if n == name)
    cfr = [line for _, n, line in ev if n == "copy_file_range"]
    a = {
        "plan_ms": (first("ftruncate") - t0) * 1e3,
        "copy_ms": (first("fsync") - first("ftruncate")) * 1e3,
        "sync_ms": (end - first("fsync")) * 1e3,
        "threads": 1 + sum(n in ("clone", "clone3") for _, n, _ in ev),
        "cfr_calls": len(cfr),
        "pwrite_calls": sum(n == "pwrite64" for _, n, _ in ev),
        "fsyncs": sum(n in ("fsync", "fdatasync") for _, n, _ in ev),
    }
    ev = traced(b_cmd, out, sources)
    t0, end = ev[0][0], ev[-1][0]
    execs = [t for t, n, line in ev if n == "execve" and "sync" in line.split(",", 1)[0]]
    b = {"copy_ms": (execs[0] - t0) * 1e3, "sync_ms": (end - execs[0]) * 1e3}
    return a, b


def out_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def measure(name, spec, pairs, warmup, trace):
    desc, a_tmpl, b_files, a_reads = spec
    out = os.path.join(WORK, "out")
    a_cmd = [s.replace("{out}", out) for s in a_tmpl]
    b_cmd, _ = durable_cp(b_files, out)
    # Both sides start with every file either reads in the page cache.
    sources = sorted(set(a_reads) | set(b_files))
    a, b, a_rss, b_rss = [], [], [], []
    a_bytes = b_bytes = 0
    for i in range(warmup + pairs):
        wa, ra = timed(a_cmd, out, sources)
        a_bytes = out_bytes(out)
        wb, rb = timed(b_cmd, out, sources)
        b_bytes = out_bytes(out)
        tag = "warm-up" if i < warmup else f"pair {i - warmup + 1}"
        log(f"{name:8s} {tag:8s} A {wa:6.2f} s ({ra:5.1f} MiB)  B {wb:6.2f} s  A/B {wa / wb:.2f}")
        if i >= warmup:
            a.append(wa), b.append(wb), a_rss.append(ra), b_rss.append(rb)
    split_phases = []
    for _ in range(trace):
        split_phases.append(phases(a_cmd, b_cmd, out, sources))
    shutil.rmtree(out, ignore_errors=True)
    ma, mb = statistics.median(a), statistics.median(b)
    return {
        "desc": desc, "a_cmd": a_tmpl, "b_files": [os.path.relpath(f, ROOT) for f in b_files],
        "a": a, "b": b, "a_rss_mib": a_rss, "b_rss_mib": b_rss, "a_bytes": a_bytes, "b_bytes": b_bytes,
        "median_a": ma, "median_b": mb, "ratio": ma / mb,
        "median_pair_ratio": statistics.median(x / y for x, y in zip(a, b)),
        "pair_ratio_quartiles": statistics.quantiles([x / y for x, y in zip(a, b)], n=4) if pairs > 1 else [],
        "phases": split_phases,
    }


def quart(r):
    q = r["pair_ratio_quartiles"]
    return f" ({q[0]:.2f}–{q[2]:.2f})" if q else ""


def report(results, pairs, warmup, load=None):
    import platform

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cp_ver = subprocess.run(["cp", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    lines = [
        "# Copy-shaped operations against a durable `cp` of the same bytes",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, {mem:.0f} GiB RAM, "
        f"kernel {platform.release()}, {cp_ver}. `bench/vs_cp.py --pairs {pairs} --warmup {warmup}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
        + (f" Load average (1, 5, 15 min) {' '.join(f'{x:.2f}' for x in load[0])} at the start, "
           f"{' '.join(f'{x:.2f}' for x in load[1])} at the end." if load else ""),
        "",
        f"Each operation ran as {pairs} pairs (after {warmup} discarded warm-up pair(s)), alternated: A = the ckpt command, "
        "B = one `cp` of the same bytes into an empty folder followed by an fsync of each copy (`sync FILE...`). "
        "Every run starts from a fresh output folder, after a `sync` and a read of every file either side touches, "
        "so both find their sources in the page cache. Wall time around the process; peak RSS from "
        "`/usr/bin/time -v`. Target: A/B ≤ 1.1 at under 64 MiB"
        + ("".join(f" ({name}: ≤ {TARGET[name]})" for name in results if name in TARGET)) + ".",
        "",
        "| operation | bytes written A / B | median A (s) | median B (s) | A/B of medians | median of pair ratios (quartiles) | peak RSS A (MiB) | ≤ 1.1× |"
        if not any(name in TARGET for name in results) else
        "| operation | bytes written A / B | median A (s) | median B (s) | A/B of medians | median of pair ratios (quartiles) | peak RSS A (MiB) | within target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        target = TARGET.get(name, 1.1)
        ok = "yes" if r["median_pair_ratio"] <= target and r["ratio"] <= target else \
            f"no (+{(max(r['ratio'], r['median_pair_ratio']) - target) * 100:.0f} points)"
        if name in TARGET:
            ok += f" (≤ {target}×)"
        lines.append(
            f"| {name}: {r['desc']} | {r['a_bytes'] / 1e9:.3f} / {r['b_bytes'] / 1e9:.3f} GB | {r['median_a']:.2f} | "
            f"{r['median_b']:.2f} | {r['ratio']:.2f} | {r['median_pair_ratio']:.2f}{quart(r)} | {max(r['a_rss_mib']):.1f} | {ok} |")
    traced_runs = [r for r in results.values() if r["phases"]]
    if traced_runs:
        n = len(traced_runs[0]["phases"])
        med = lambda r, side, key: statistics.median(p[side][key] for p in r["phases"])
        lines += [
            "",
            f"Where the time goes: medians of {n} more run(s) of each side under `strace -f --seccomp-bpf` "
            "(only the listed calls stop, so the pace is close to the untraced one). A: start to the first "
            "`ftruncate` (open, parse, plan), to the first `fsync` (the range copies), to the exit (fsyncs, "
            "renames, index, folder fsync). B: start to the `sync` exec (the `cp`), to the exit (the fsyncs).",
            "",
            "| operation | A plan (ms) | A copy (ms) | A fsync and commit (ms) | A threads | A `copy_file_range` calls | A `pwrite64` calls | A fsyncs | B cp (ms) | B fsyncs (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in results.items():
            if not r["phases"]:
                continue
            lines.append(
                f"| {name} | {med(r, 0, 'plan_ms'):.0f} | {med(r, 0, 'copy_ms'):.0f} | {med(r, 0, 'sync_ms'):.0f} | "
                f"{med(r, 0, 'threads'):.0f} | {med(r, 0, 'cfr_calls'):.0f} | {med(r, 0, 'pwrite_calls'):.0f} | "
                f"{med(r, 0, 'fsyncs'):.0f} | {med(r, 1, 'copy_ms'):.0f} | {med(r, 1, 'sync_ms'):.0f} |")
    lines += ["", "Baselines (B copies these files):"]
    for name, r in results.items():
        shown = r["b_files"] if len(r["b_files"]) <= 3 else r["b_files"][:2] + [f"... {len(r['b_files'])} files"]
        lines.append(f"- {name}: {', '.join(f'`{f}`' for f in shown)}")
    lines += ["", "Runs (s), A / B in pair order, and the largest peak RSS of each side (B's is `sync`'s or `cp`'s):"]
    for name, r in results.items():
        lines.append(f"- {name}: A {' '.join(f'{x:.2f}' for x in r['a'])}; B {' '.join(f'{x:.2f}' for x in r['b'])}; "
                     f"peak RSS A {max(r['a_rss_mib']):.1f} MiB, B {max(r['b_rss_mib']):.1f} MiB")
    lines += [
        "",
        "The split baseline copies the output shards of the same split as separate files (so its bytes are the "
        "split's output); the ZeRO baseline copies, per rank, the fp32 master partition that the merge reads, cut "
        "once from the rank's `*_optim_states.pt` (the optimizer files also hold Adam's two moments, twice as many "
        "bytes, which the merge never reads). See the docstring of `bench/vs_cp.py`.",
        "",
        "On this shared machine whole invocations differ from each other by more than the 10% margin (the "
        "quartiles show the spread within one); judge the target on the ratios of several invocations.",
        "",
    ]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7, help="timed A,B pairs per operation (default 7)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed pairs first (default 1)")
    ap.add_argument("--ops", default="split,merge,convert,dcp,zero,dcp_tp,megatron,megatron_moe_hf")
    ap.add_argument("--trace", type=int, default=3,
                    help="extra runs of each side under strace for the phase table (default 3; 0 skips it)")
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS-vs-cp.md")
    ap.add_argument("--make-torch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_torch:
        return make_torch_bin(args.make_torch, 1.0)
    ops = args.ops.split(",")
    ckpt = os.path.abspath(args.ckpt)
    p = inputs(ckpt, ops)
    table = operations(ckpt, p, ops)
    ops = [name for name in ops if name in table]  # an op whose input could not be made is skipped
    if not ops:
        raise SystemExit("nothing to measure")
    results = {}
    # Other work on the machine shows here first: the load average, at both ends.
    load_start = os.getloadavg()
    t0 = time.time()
    for name in ops:
        results[name] = measure(name, table[name], args.pairs, args.warmup, args.trace if shutil.which("strace") else 0)
    log(f"measured in {time.time() - t0:.0f} s")
    load = (load_start, os.getloadavg())
    text = report(results, args.pairs, args.warmup, load)
    print(text)
    with open(os.path.join(WORK, "results.json"), "w") as f:
        json.dump(dict(results, load_average=load), f, indent=1)
    if not args.no_write:
        with open(os.path.join(ROOT, "bench", "RESULTS-vs-cp.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
