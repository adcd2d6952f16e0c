"""The shares `mpirun -np N ckpt split|merge` deals out for a Llama-3.1-405B-shaped checkpoint, from
`--dry-run`, on a synthetic catalog that takes no disk.

    /opt/statekit-venv/bin/python bench/ranks_405b.py [--ranks 8,64,512] [--no-optimizer]
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
run with every rank under `/usr/bin/time` (its wall, CPU and peak RSS); rank 0 prints every
rank's share. An N that mpirun cannot start (or that runs past `--timeout`) is halved until one
runs; the shares of every N in the table also come from a replica of the planner's rule
(`ckpt/src/shares.rs`: whole output files, largest first to the least loaded rank, kept when
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
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

ROOT = ranks.ROOT
WORK = os.path.join(ROOT, "bench", "work", "ranks-405b")
MAX_SHARD = 5 * 10**9
SLACK = 1.1  # ckpt/src/shares.rs WHOLE_FILE_SLACK
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
    numel = lambda shape: eval("*".join(map(str, shape)))  # noqa: S307 (ints only)
    out = [(n, "BF16", s, 2 * numel(s)) for n, s in weights]
    if optimizer:
        for n, s in weights:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                out.append((f"optimizer.{kind}.{n}", "F32", s, 4 * numel(s)))
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


def header(ts):
    """The safetensors header (8-byte length and padded JSON) of one file, and its data length:
    tensors widest dtype first, then by name, as the `safetensors` writer lays them."""
    order = sorted(ts, key=lambda t: (0 if t[1] == "F32" else 1, t[0]))
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
    """`ckpt/src/shares.rs` `deal` for a plan of range copies: targets [(header, data bytes)];
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
    cmd = ([] if n == 0 else ranks.MPIRUN + ["-np", str(n)]) + [wrap, ckpt, "--quiet", *args, "--dry-run", "--json"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {timeout} s", "cmd": " ".join(cmd)}
    wall = time.perf_counter() - t0
    if os.path.exists(out):
        raise SystemExit(f"{' '.join(cmd)}: a dry run created {out}")
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}", "cmd": " ".join(cmd)}
    procs = []
    for name in os.listdir(rss):
        f = open(os.path.join(rss, name)).read().split()
        procs.append((float(f[-3]), float(f[-2]) + float(f[-1]), int(f[-4]) / 1024))
    doc = json.loads(proc.stdout)
    return {"wall": wall, "ranks": doc["ranks"], "procs": procs, "files_out": len(doc["files"]),
            "cmd": " ".join(cmd)}


def solo_time(ckpt, op, src, wrap, reps=3):
    runs = [dry(ckpt, op, src, 0, 600, wrap) for _ in range(reps)]
    for r in runs:
        if "error" in r:
            raise SystemExit(f"{r['cmd']}: {r['error']}")
    return runs


def gb(x):
    return f"{x / 1e9:,.1f}"


def stats(shares):
    w = [s["bytes_written"] for s in shares]
    f = [s["files"] for s in shares]
    return max(w), sum(w) / len(w), max(f), sum(f) / len(f)


def report(cat, results, args):
    lines = [
        "## Projection: Llama-3.1-405B at 8, 64 and 512 ranks (`--dry-run`)",
        "",
        f"Machine: {ranks.machine()}. `bench/ranks_405b.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "Sources: synthetic Hugging Face sharded folders with the real headers of Llama-3.1-405B "
        f"({LAYERS} layers, hidden {HIDDEN}, FFN {FFN}, {HEADS} heads, {KV_HEADS} KV heads, vocab {VOCAB}, "
        "untied head), cut into 5 GB shards by huggingface_hub's rule, data regions sparse (written as holes: "
        "the headers are real, the data is never read by a dry run):",
    ]
    for key, c in cat.items():
        lines.append(f"- {key}: {c['tensors']:,} tensors, {c['files']} files, {c['bytes'] / 1e12:.3f} TB of tensor "
                     f"data, {c['head_bytes'] / 1e6:.2f} MB of headers; {c['disk'] / 1e6:.1f} MB on disk.")
    lines += [
        "",
        "Each N ran `mpirun -np N ckpt split SRC OUT --max-shard-size 5GB --dry-run --json` and `ckpt merge SRC "
        "OUT/model.safetensors --dry-run --json` (the plan dealt out, nothing written). \"measured\": the shares "
        "printed by that dry run; \"computed\": from the planner's rule replicated in the script (checked equal, "
        "rank for rank, to every dry run that ran). Time: the slowest rank's bytes at "
        f"{args.gbps:g} GB/s per node (one rank per node, the node's write bandwidth the limit, reads as fast "
        f"alongside), and the same with the filesystem's total capped at {args.aggregate_gbps:g} GB/s; "
        "both leave out the fixed costs below.",
        "",
        "| source | operation | N | shares from | mode | files per rank, max / mean | GB written per rank, max / mean | max / mean | time at "
        f"{args.gbps:g} GB/s per node | with a {args.aggregate_gbps:g} GB/s total cap | dry run wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (key, op, n), r in results.items():
        shares = r["shares"]
        mw, aw, mf, af = stats(shares)
        total = sum(s["bytes_written"] for s in shares)
        t_node = mw / (args.gbps * 1e9)
        t_cap = max(t_node, total / (args.aggregate_gbps * 1e9))
        fmt = lambda t: f"{t / 60:.1f} min" if t >= 120 else f"{t:.0f} s"
        lines.append(
            f"| {key} | {op} | {n} | {r['source']} | {r['mode']} | {mf} / {af:.2f} | {gb(mw)} / {gb(aw)} | "
            f"{mw / aw:.3f} | {fmt(t_node)} | {fmt(t_cap)} | {r['wall']:.1f} |" if r.get("wall") is not None else
            f"| {key} | {op} | {n} | {r['source']} | {r['mode']} | {mf} / {af:.2f} | {gb(mw)} / {gb(aw)} | "
            f"{mw / aw:.3f} | {fmt(t_node)} | {fmt(t_cap)} | – |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="8,64,512", help="mpirun -np values (default 8,64,512)")
    ap.add_argument("--no-optimizer", action="store_true", help="only the weights catalog")
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--gbps", type=float, default=2.0, help="write bandwidth per node, GB/s (default 2)")
    ap.add_argument("--aggregate-gbps", type=float, default=100.0,
                    help="the filesystem's total bandwidth, GB/s (default 100)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one dry run may take (default 600)")
    ap.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS-ranks.md")
    args = ap.parse_args()
    ckpt = os.path.abspath(args.ckpt)
    wanted = [int(x) for x in args.ranks.split(",")]
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(ranks.WORK, exist_ok=True)
    wrap = ranks.wrapper()
    variants = {"weights": False} if args.no_optimizer else {"weights": False, "weights + optimizer": True}
    cat, layout = {}, {}
    for key, opt in variants.items():
        folder = os.path.join(WORK, "llama-405b" + ("-optim" if opt else ""))
        files = build(folder, opt)
        layout[key] = (folder, files)
        cat[key] = {"tensors": len(tensors(opt)), "files": len(files), "bytes": sum(d for _, _, d in files),
                    "head_bytes": sum(h for _, h, _ in files), "disk": disk_use(folder)}
    # TODO: runs
    print("\n".join(report(cat, {}, args)))


if __name__ == "__main__":
    main()
