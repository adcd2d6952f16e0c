"""The shares `mpirun -np N ckpt split|merge` deals out for a Llama-3.1-405B-shaped checkpoint, from
`--dry-run`, on a synthetic catalog that takes no disk.

    /opt/statekit-venv/bin/python bench/ranks_405b.py [--ranks 8,64,256,512] [--measure 8,64,512]
        [--measure-optimizer 8,64,256] [--tiny 8,64] [--no-optimizer] [--fresh] [--timeout 1500]
        [--ckpt target/release/ckpt] [--gbps 2] [--aggregate-gbps 100] [--no-write]

The catalog is a Hugging Face sharded folder (`model-0000X-of-000NN.safetensors` and
`model.safetensors.index.json`) whose headers are real: the tensor names and shapes of
Llama-3.1-405B (126 layers, hidden 16384, FFN 53248, 128 heads, 8 KV heads of 128, vocab 128256,
untied head, bf16), cut into 5 GB shards by huggingface_hub's greedy rule, each header written
as `safetensors` writes it (compact JSON, `__metadata__` first, tensors widest dtype first then
by name, spaces to a multiple of 8). The data regions are sparse: each file is its header
followed by a `truncate` to its full length, so 812 GB of shards occupy a few megabytes. A
second catalog, "weights + optimizer", adds three fp32 tensors per parameter (the master copy
and Adam's two moments, `optimizer.master.<name>`, `optimizer.exp_avg.<name>`,
`optimizer.exp_avg_sq.<name>`), 5.7 TB in all.

`--dry-run` plans the whole write on every rank and deals it out, and writes nothing: nothing
here ever runs without it (a real run would start writing terabytes), and the script checks that
no output appeared. For each catalog and each N, `mpirun -np N ckpt split SRC OUT
--max-shard-size 5GB --dry-run --json` and `ckpt merge SRC OUT.safetensors --dry-run --json`
run with every rank under `/usr/bin/time` (its wall, CPU and peak RSS), mpirun under `nice -n 19`
in a session of its own; rank 0 prints every rank's share. A dry run that fails (or runs past
`--timeout`) is tried once more, then at half the ranks until one runs; one that ran is kept in
bench/work/ranks-405b/dry-*.json and not run again with the same binary (`--fresh` runs it again:
at 512 ranks on 2 cores each takes 5 to 6 minutes, nearly all of it MPI start-up). The shares of
every N in the table (`--ranks`; the dry runs are `--measure` and `--measure-optimizer`) also
come from a replica of the planner's rule
(`ckpt/src/plan/shares.rs`: whole output files, largest first to the least loaded rank, kept when
the largest share is within 1.1x of the mean, else the data bytes laid end to end and cut into
N equal stretches), checked equal to every measured dry run, so the table says which numbers
were measured and which computed.

The metadata cost: the one-process dry run (open: the index and every header; plan; deal) is
timed without MPI, and under mpirun each rank's CPU is compared with the same job on a one-tensor
file (MPI start-up and a trivial open), the difference being the catalog's open and plan.

Results: the second section of bench/RESULTS-ranks.md (bench/ranks.py writes the first).
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

ROOT = ranks.ROOT
WORK = os.path.join(ROOT, "bench", "work", "ranks-405b")
MAX_SHARD = 5 * 10**9
SLACK = 1.1  # ckpt/src/plan/shares.rs WHOLE_FILE_SLACK
TINY = os.path.join(ROOT, "fixtures", "safetensors", "model_single", "model.safetensors")
log = ranks.log

# Llama-3.1-405B (config.json of meta-llama/Llama-3.1-405B)
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 126, 16384, 53248, 128, 8, 128256
HEAD_DIM = HIDDEN // HEADS


def llama_405b():
    """(name, shape) in the order the model's state dict holds them."""
    kv = KV_HEADS * HEAD_DIM
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN]),
            (p + "self_attn.k_proj.weight", [kv, HIDDEN]),
            (p + "self_attn.v_proj.weight", [kv, HIDDEN]),
            (p + "self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM]),
            (p + "mlp.gate_proj.weight", [FFN, HIDDEN]),
            (p + "mlp.up_proj.weight", [FFN, HIDDEN]),
            (p + "mlp.down_proj.weight", [HIDDEN, FFN]),
            (p + "input_layernorm.weight", [HIDDEN]),
            (p + "post_attention_layernorm.weight", [HIDDEN]),
        ]
    out += [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]
    return out


def tensors(optimizer):
    """(name, dtype, shape, bytes) of the catalog."""
    weights = llama_405b()
    out = [(n, "BF16", s, 2 * math.prod(s)) for n, s in weights]
    if optimizer:
        for n, s in weights:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                out.append((f"optimizer.{kind}.{n}", "F32", s, 4 * math.prod(s)))
    return out


def shards(ts):
    """huggingface_hub's `split_torch_state_dict_into_shards`: greedy in order, a new shard when
    the next tensor does not fit, a tensor larger than the limit alone in its own."""
    out, cur, size = [], [], 0
    for t in ts:
        if t[3] > MAX_SHARD:
            out.append([t])
            continue
        if cur and size + t[3] > MAX_SHARD:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t[3]
    if cur:
        out.append(cur)
    return out


def file_order(ts):
    """Tensors as the `safetensors` writer lays them out in a file: widest dtype first, then by name."""
    return sorted(ts, key=lambda t: (0 if t[1] == "F32" else 1, t[0]))


def header(ts):
    """The safetensors header (8-byte length and padded JSON) of one file, and its data length."""
    order = file_order(ts)
    parts, off = ['"__metadata__":{"format":"pt"}'], 0
    for name, dtype, shape, nbytes in order:
        parts.append(json.dumps(name) + ':{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'
                     % (dtype, ",".join(map(str, shape)), off, off + nbytes))
        off += nbytes
    js = ("{" + ",".join(parts) + "}").encode()
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js, off


def build(folder, optimizer):
    """Writes the sparse catalog into `folder` (once): returns [(file, header bytes, data bytes)]."""
    groups = shards(tensors(optimizer))
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = []
    stamp = os.path.join(folder, "model.safetensors.index.json")
    fresh = not os.path.exists(stamp)
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder + ".part", exist_ok=True)
    weight_map, total = {}, 0
    for name, group in zip(names, groups):
        head, data = header(group)
        files.append((name, len(head), data))
        total += data
        for t in group:
            weight_map[t[0]] = name
        if fresh:
            path = os.path.join(folder + ".part", name)
            with open(path, "wb") as f:
                f.write(head)
            os.truncate(path, len(head) + data)  # the data region: a hole
    if fresh:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(folder + ".part", "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(folder + ".part", folder)
        log(f"wrote {folder}: {n} files, {total / 1e12:.3f} TB of sparse data")
    return files


def disk_use(folder):
    return int(subprocess.run(["du", "-sk", folder], capture_output=True, text=True).stdout.split()[0]) * 1024


# ---------------------------------------------------------------- the planner's rule, replicated


def deal(targets, n):
    """`ckpt/src/plan/shares.rs` `deal` for a plan of range copies: targets [(header, data bytes)];
    returns ([{rank, files, bytes_read, bytes_written}], mode)."""
    sizes = [h + d for h, d in targets]
    if n == 1 or len(sizes) >= n:
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        load, count, read = [0] * n, [0] * n, [0] * n
        import heapq

        heap = [(0, r) for r in range(n)]
        for i in order:
            l, r = heapq.heappop(heap)
            load[r] += sizes[i]
            count[r] += 1
            read[r] += targets[i][1]
            heapq.heappush(heap, (load[r], r))
        total = sum(load)
        if n == 1 or total == 0 or max(load) <= total / n * SLACK:
            return [{"rank": r, "files": count[r], "bytes_read": read[r], "bytes_written": load[r]}
                    for r in range(n)], "whole files"
    total = sum(d for _, d in targets)
    cuts = [total * r // n for r in range(n + 1)]
    out = [{"rank": r, "files": 0, "bytes_read": cuts[r + 1] - cuts[r], "bytes_written": cuts[r + 1] - cuts[r]}
           for r in range(n)]
    import bisect

    at = 0
    for h, d in targets:
        owner = bisect.bisect_right(cuts, at, 1, n) - 1
        out[owner]["bytes_written"] += h
        touched = {owner}
        lo = bisect.bisect_right(cuts, at, 1, n) - 1
        for r in range(lo, n):
            if cuts[r] >= at + d:
                break
            if max(at, cuts[r]) < min(at + d, cuts[r + 1]):
                touched.add(r)
        for r in touched:
            out[r]["files"] += 1
        at += d
    return out, "byte ranges"


# ---------------------------------------------------------------- the dry runs


def dry(ckpt, op, src, n, timeout, wrap):
    """`ckpt OP SRC ... --dry-run --json` on N ranks (N = 0: one process, no mpirun). Returns
    wall, the ranks array, per-process (wall, CPU, RSS MiB), or an error text."""
    out = os.path.join(WORK, "out")
    shutil.rmtree(out, ignore_errors=True)
    rss = os.path.join(ranks.WORK, "rss")
    shutil.rmtree(rss, ignore_errors=True)
    os.makedirs(rss)
    args = {"split": ["split", src, out, "--max-shard-size", "5GB"],
            "merge": ["merge", src, os.path.join(out, "model.safetensors")]}[op]
    # Under nice: hundreds of oversubscribed ranks must not starve the machine's other work.
    cmd = ([] if n == 0 else ["nice", "-n", "19"] + ranks.MPIRUN + ["-np", str(n)]) + \
        [wrap, ckpt, "--quiet", *args, "--dry-run", "--json"]
    t0 = time.perf_counter()
    # In a session of its own: a launcher that fails signals its group, not this script, and on a
    # timeout the whole group (mpirun and its ranks, all started here) is ended.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.communicate(timeout=20)
                break
            except subprocess.TimeoutExpired:
                continue
        return {"error": f"ran past {timeout} s", "cmd": " ".join(cmd)}
    wall = time.perf_counter() - t0
    if os.path.exists(out):
        raise SystemExit(f"{' '.join(cmd)}: a dry run created {out}")
    if proc.returncode != 0:
        # ckpt's own message when a rank printed one, else the launcher's first words.
        said = [l for l in stderr.splitlines() if "error:" in l] or \
            [l for l in stderr.splitlines() if l.strip() and not l.startswith("---")]
        return {"error": f"exit {proc.returncode}: " + " ".join(said[:3])[:600], "stderr": stderr,
                "cmd": " ".join(cmd)}
    procs = []
    for name in os.listdir(rss):
        f = open(os.path.join(rss, name)).read().split()
        procs.append((float(f[-3]), float(f[-2]) + float(f[-1]), int(f[-4]) / 1024))
    doc = json.loads(stdout)
    return {"wall": wall, "ranks": doc["ranks"], "procs": procs, "files_out": len(doc["files"]),
            "cmd": " ".join(cmd)}


def cache_path(key, op, n):
    return os.path.join(WORK, f"dry-{key.replace(' + ', '-')}-{op}-{n}.json")


def cached(ckpt, key, op, n):
    """A dry run of this binary (by size and mtime) measured before, or None."""
    try:
        r = json.load(open(cache_path(key, op, n)))
    except (OSError, ValueError):
        return None
    st = os.stat(ckpt)
    return r if r.get("binary") == [st.st_size, st.st_mtime] else None


def cache(ckpt, key, op, n, r):
    st = os.stat(ckpt)
    r.setdefault("at", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(cache_path(key, op, n), "w") as f:
        json.dump({**r, "binary": [st.st_size, st.st_mtime]}, f)


def solo_time(ckpt, op, src, reps=5):
    """One process, no MPI, `reps` dry runs: the ranks array, and the median wall and CPU seconds
    (the process's own rusage, `wait4`)."""
    out = os.path.join(WORK, "out")
    args = {"split": ["split", src, out, "--max-shard-size", "5GB"],
            "merge": ["merge", src, os.path.join(out, "model.safetensors")]}[op]
    cmd = [ckpt, "--quiet", *args, "--dry-run", "--json"]
    walls, cpus, doc = [], [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = proc.stdout.read(), proc.stderr.read()
        _, status, ru = os.wait4(proc.pid, 0)
        walls.append(time.perf_counter() - t0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0 or os.path.exists(out):
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode} (or wrote {out}): {stderr.decode()[-1500:]}")
        cpus.append(ru.ru_utime + ru.ru_stime)
        doc = json.loads(stdout)
    return {"ranks": doc["ranks"], "wall": statistics.median(walls), "cpu": statistics.median(cpus)}


def gb(x):
    return f"{x / 1e9:,.1f}"


def stats(shares):
    w = [s["bytes_written"] for s in shares]
    f = [s["files"] for s in shares]
    return max(w), sum(w) / len(w), max(f), sum(f) / len(f)


def fmt_t(t):
    return f"{t / 60:.1f} min" if t >= 120 else f"{t:.1f} s" if t < 10 else f"{t:.0f} s"


def report(cat, results, solo, tiny, args, measured_at):
    lines = [
        "## Projection: a Llama-3.1-405B checkpoint over "
        + ", ".join(str(n) for n in sorted({k[2] for k in results})[:-1]) + f" and {max(k[2] for k in results)} "
        "ranks (`--dry-run`)",
        "",
        f"Machine: {ranks.machine()}. `bench/ranks_405b.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}` "
        f"on {measured_at}"
        + (lambda ats: f" (its mpirun dry runs measured {min(ats)} to {max(ats)}, those of earlier invocations of "
           "the same binary kept)." if ats and min(ats) < measured_at else ".")(
            sorted(r["at"] for r in results.values() if r.get("at"))),
        "",
        "Sources: synthetic Hugging Face sharded folders with the real headers of Llama-3.1-405B "
        f"({LAYERS} layers, hidden {HIDDEN}, FFN {FFN}, {HEADS} heads, {KV_HEADS} KV heads, vocab {VOCAB}, "
        "untied head, bf16), cut into 5 GB shards by huggingface_hub's greedy rule (which gives the 191 files "
        "of the published checkpoint: two 1.74 GB FFN matrices fill a shard), data regions sparse (holes: "
        "the headers are real, a dry run never reads the data):",
    ]
    for key, c in cat.items():
        lines.append(f"- {key}: {c['tensors']:,} tensors in {c['files']:,} files, {c['bytes'] / 1e12:.3f} TB of "
                     f"tensor data, {c['head_bytes'] / 1e6:.2f} MB of headers and a {c['index_bytes'] / 1e6:.2f} MB "
                     f"index; {c['disk'] / 1e6:.1f} MB on disk.")
    lines += [
        "",
        "For each N, `mpirun -np N ckpt split SRC OUT --max-shard-size 5GB --dry-run --json` and `ckpt merge SRC "
        "OUT/model.safetensors --dry-run --json`: every rank opens the source and plans, the plan is dealt out, "
        "nothing is written, rank 0 prints every rank's share. *measured*: the shares that dry run printed; "
        "*computed*: the planner's rule (`ckpt/src/plan/shares.rs`) replicated in the script, which gave the same "
        "shares, rank for rank, as every dry run that ran "
        f"({sum(1 for r in results.values() if r['source'] == 'measured')} of them). Time: the slowest rank's "
        f"bytes at {args.gbps:g} GB/s per node (an assumption: one rank per node, the node's write bandwidth the "
        f"limit, its reads as fast alongside), and the same with the filesystem's total capped at "
        f"{args.aggregate_gbps:g} GB/s (also an assumption); neither includes the fixed costs below.",
        "",
        "| source | operation | N | shares | mode | files per rank, max / mean | GB written per rank, max / mean | "
        f"slowest / mean | time at {args.gbps:g} GB/s per node | with a {args.aggregate_gbps:g} GB/s total cap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (key, op, n), r in results.items():
        shares = r["shares"]
        mw, aw, mf, af = stats(shares)
        total = sum(s["bytes_written"] for s in shares)
        t_node = mw / (args.gbps * 1e9)
        t_cap = max(t_node, total / (args.aggregate_gbps * 1e9))
        lines.append(f"| {key} | {op} | {n} | {r['source']} | {r['mode']} | {mf} / {af:.2f} | {gb(mw)} / {gb(aw)} | "
                     f"{mw / aw:.4f} | {fmt_t(t_node)} | {fmt_t(t_cap)} |")
    lines += [
        "",
        "### The fixed costs: start-up, the open on every rank, the commit",
        "",
        "Open and plan (the metadata cost each rank pays once): one process, no MPI, the median of 5 dry runs "
        "(reading the index and every header from the page cache, building the plan, dealing it out). Under "
        "mpirun every rank pays it again, on top of MPI's start-up; the second table gives the whole dry run "
        "under mpirun, the same job on a one-tensor file (MPI start-up and a trivial open, the difference being "
        "the catalog), and each rank's CPU from `/usr/bin/time`. On this machine those N processes share 2 cores "
        "(oversubscribed, under `nice -n 19` so the machine's other work comes first), and Open MPI's ranks poll "
        "while they wait, so the walls and CPU there are start-up and contention, not what a rank on its own node "
        "pays.",
        "",
        "| source | operation | open + plan, one process (ms) | CPU (ms) | peak RSS (MiB) | files opened per rank | header bytes read per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for (key, op), s in solo.items():
        c = cat[key]
        lines.append(f"| {key} | {op} | {s['wall'] * 1e3:.0f} | {s['cpu'] * 1e3:.0f} | {s['rss']:.1f} | "
                     f"{c['files'] + 1:,} | {(c['head_bytes'] + c['index_bytes']) / 1e6:.2f} MB |")
    lines += [
        "",
        "| source | operation | N | dry run under mpirun (s) | one-tensor file, same N (s) | CPU per rank, median / max (s) | one-tensor file: CPU per rank, median (s) | peak RSS per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (key, op, n), r in results.items():
        if r["source"] != "measured":
            continue
        cpu = [p[1] for p in r["procs"]]
        t = tiny.get(n)
        lines.append(f"| {key} | {op} | {n} | {r['wall']:.1f} | {t['wall']:.1f} | "
                     if t else f"| {key} | {op} | {n} | {r['wall']:.1f} | – | ")
        lines[-1] += (f"{statistics.median(cpu):.2f} / {max(cpu):.2f} | "
                      + (f"{statistics.median(p[1] for p in t['procs']):.2f}" if t else "–")
                      + f" | {max(p[2] for p in r['procs']):.1f} |")
    lines += ["", "The commit, on rank 0 alone once every rank's share is durable: for a split, one rename per "
              "output file (" + ", ".join(f"{cat[key]['files']:,} for {key}" for key in cat) + "), then the index "
              "(written to a temporary, fsynced, renamed) and an fsync of the folder; for a merge, one rename and "
              "the folder's fsync."]
    lines += ["", "Dry runs that failed (each is tried twice before the script halves N):" if any(r.get("failed") for r in results.values()) else ""]
    for (key, op, n), r in results.items():
        for f in r.get("failed", []):
            lines.append(f"- {key} {op} at N = {f['n']}: {f['error']}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,256,512", help="N of the table (default 8,64,256,512)")
    ap.add_argument("--measure", default="8,64,512",
                    help="N run as a dry run for the weights catalog (default 8,64,512; the rest computed)")
    ap.add_argument("--measure-optimizer", default="8,64,256",
                    help="N run as a dry run for the weights + optimizer catalog (default 8,64,256: at 512 "
                    "ranks it did not complete on a 2-core machine)")
    ap.add_argument("--tiny", default="8,64", help="N at which the one-tensor job is timed (default 8,64)")
    ap.add_argument("--no-optimizer", action="store_true", help="only the weights catalog")
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--gbps", type=float, default=2.0, help="write bandwidth per node, GB/s (default 2)")
    ap.add_argument("--aggregate-gbps", type=float, default=100.0,
                    help="the filesystem's total bandwidth, GB/s (default 100)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds one dry run may take (default 1500)")
    ap.add_argument("--fresh", action="store_true", help="run every dry run again (else one measured before "
                    "with the same binary is kept)")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS-ranks.md")
    args = ap.parse_args()
    ckpt = os.path.abspath(args.ckpt)
    table_n = [int(x) for x in args.ranks.split(",")]
    measure = {"weights": [int(x) for x in args.measure.split(",") if x],
               "weights + optimizer": [int(x) for x in args.measure_optimizer.split(",") if x]}
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(ranks.WORK, exist_ok=True)
    wrap = ranks.wrapper()
    variants = {"weights": False} if args.no_optimizer else {"weights": False, "weights + optimizer": True}
    cat, plans = {}, {}
    for key, opt in variants.items():
        folder = os.path.join(WORK, "llama-405b" + ("-optim" if opt else ""))
        files = build(folder, opt)
        cat[key] = {"folder": folder, "tensors": len(tensors(opt)), "files": len(files),
                    "bytes": sum(d for _, _, d in files), "head_bytes": sum(h for _, h, _ in files),
                    "index_bytes": os.path.getsize(os.path.join(folder, "model.safetensors.index.json")),
                    "disk": disk_use(folder)}
        merged_head, merged_data = header(tensors(opt))
        # The split's output: huggingface_hub's rule over the tensors in load order (file by
        # file, each in data-offset order), which regroups them.
        load_order = [t for group in shards(tensors(opt)) for t in file_order(group)]
        plans[(key, "split")] = [(len(h), d) for h, d in (header(g) for g in shards(load_order))]
        plans[(key, "merge")] = [(len(merged_head), merged_data)]
    t_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.time()
    # One process: open + plan, and the check that the replica's targets are ckpt's.
    solo = {}
    for key in variants:
        for op in ("split", "merge"):
            solo[(key, op)] = s = solo_time(ckpt, op, cat[key]["folder"])
            # wait4's ru_maxrss starts from the forking Python's; /usr/bin/time's from its own.
            s["rss"] = dry(ckpt, op, cat[key]["folder"], 0, 600, wrap)["procs"][0][2]
            want, _ = deal(plans[(key, op)], 1)
            if s["ranks"] != want:
                raise SystemExit(f"{key} {op}: one process planned {s['ranks']}, the replica {want}: "
                                 "the script's headers are not the ones ckpt writes")
            log(f"{key} {op}: one process {solo[(key, op)]['wall'] * 1e3:.0f} ms")
    tiny = {}
    for n in [int(x) for x in args.tiny.split(",") if x]:
        r = dry(ckpt, "split", TINY, n, args.timeout, wrap)
        if "error" not in r:
            tiny[n] = r
            log(f"one-tensor file at N = {n}: {r['wall']:.1f} s")
    results = {}
    for key in variants:
        for op in ("split", "merge"):
            for n in table_n:
                want, mode = deal(plans[(key, op)], n)
                entry = {"shares": want, "mode": mode, "source": "computed", "failed": []}
                if n in measure[key]:
                    m = n
                    while True:
                        # A dry run already measured with this binary is kept (bench/work/ranks-405b/
                        # dry-*.json); one that fails is tried once more, then at half the ranks.
                        r = cached(ckpt, key, op, m) if not args.fresh else None
                        hit = r is not None
                        for _ in range(2):
                            if r is not None and "error" not in r:
                                break
                            if r is not None:
                                entry["failed"].append({"n": m, **r})
                                log(f"{key} {op} at N = {m}: {r['error']}")
                            r = dry(ckpt, op, cat[key]["folder"], m, args.timeout, wrap)
                        if "error" not in r:
                            if not hit:
                                cache(ckpt, key, op, m, r)
                            break
                        entry["failed"].append({"n": m, **r})
                        log(f"{key} {op} at N = {m}: {r['error']}")
                        m //= 2
                        if m < 2:
                            r = None
                            break
                    if r is not None:
                        got, mode_m = r["ranks"], deal(plans[(key, op)], m)
                        if got != mode_m[0]:
                            raise SystemExit(f"{key} {op} at N = {m}: the dry run's shares differ from the replica's")
                        if m == n:
                            entry.update(source="measured", wall=r["wall"], procs=r["procs"], at=r.get("at"))
                        else:
                            results[(key, op, m)] = {"shares": got, "mode": mode_m[1], "source": "measured",
                                                     "wall": r["wall"], "procs": r["procs"], "failed": []}
                        log(f"{key} {op} at N = {m}: {r['wall']:.1f} s, shares as computed")
                results[(key, op, n)] = entry
    log(f"measured in {time.time() - t0:.0f} s")
    results = dict(sorted(results.items(), key=lambda kv: (list(variants).index(kv[0][0]), kv[0][1] != "split",
                                                           kv[0][2])))
    with open(os.path.join(WORK, "results.json"), "w") as f:
        json.dump({"cat": cat, "solo": {f"{k[0]}/{k[1]}": v for k, v in solo.items()},
                   "tiny": {str(n): {"wall": t["wall"], "procs": t["procs"]} for n, t in tiny.items()},
                   "results": [{"source_ckpt": k[0], "op": k[1], "n": k[2], **v} for k, v in results.items()]},
                  f, indent=1)
    text = "\n".join(report(cat, results, solo, tiny, args, t_start)).rstrip() + "\n"
    print(text)
    if not args.no_write:
        ranks.write_section("ranks_405b.py", text)


if __name__ == "__main__":
    main()
