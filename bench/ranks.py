"""`ckpt` over the ranks of an MPI job against one process, on the 1 GB inputs of bench/vs_cp.py.

    /opt/statekit-venv/bin/python bench/ranks.py [--reps 5] [--warmup 1] [--ranks 1,2,4]
        [--ops split,merge,dcp,zero,reshard] [--ckpt target/release/ckpt] [--no-write] [--report-only]

`ckpt` built with `--features mpi` (`make bench` builds it so) runs one operation on every rank
of `mpirun -np N ckpt ...`: every rank opens the same source, the copy plan is dealt out by bytes
(whole output files when they balance, else byte ranges of one file), each rank writes and
fsyncs its share, and rank 0 commits. This runs each operation as one process (no launcher) and
as `mpirun -np N` for each N of `--ranks`, all of them in every repetition, the order reversed
from one repetition to the next (one process, 1, 2, 4, then 4, 2, 1, one process, ...), so that a
drift of the shared machine hits every configuration alike. The table gives the median wall time
of each and the median over repetitions of the ratio N ranks / one process.

Every run starts as vs_cp.py's do: a fresh output folder, a `sync`, then a read of every source
file (the page cache cannot be dropped here, so every run finds its sources warm). Wall time is
taken around the whole command, `mpirun` included. After the runs of a repetition, each
configuration runs once more with `--dry-run` (launch, MPI start-up, every rank opening the
source and planning, the barriers, nothing written): that is the fixed cost of the job, and its
planned shares must equal the ones the run reported. Each process, the one-process run
and every rank, runs under `/usr/bin/time`, which writes its peak RSS, wall and CPU seconds to a
file named by `$OMPI_COMM_WORLD_RANK`. Every command runs with `--json`: rank 0 prints the
per-rank shares (`ranks: [{rank, files, bytes_read, bytes_written}]`), from which the table
gives the largest share over the mean share of bytes written.

The first one-process run of each operation is kept as the reference; every later run's output
(the N-rank ones included) is compared with it byte for byte (`cmp`), every file of it. The one
exception is a DCP `.metadata` (the reshard's), whose pickled `save_id` is a fresh UUID per run:
it is compared with that UUID masked (same length, and the same bytes elsewhere). Every run
writes to the same output path, which the `.metadata` also records.

Operations (inputs from vs_cp.py's `inputs`, generated once under bench/work/vs-cp/ with the
real tools):
- split: 1 GiB safetensors into 200 MB shards (7 files: byte ranges at 4 ranks)
- merge: those shards into one file (byte ranges of one file)
- dcp: merge of a DCP folder saved by FSDP2 on 2 ranks
- zero: merge of a DeepSpeed ZeRO-3 checkpoint (2 ranks, fp32 master weights)
- reshard: that DCP folder resharded for 4 ranks (4 files of equal size: whole files)

Results: the first section of bench/RESULTS-ranks.md (bench/ranks_405b.py writes the second);
the text between this script's markers is replaced, the rest of the file (its summary and the
readings, written by hand) is kept. About 7 minutes on a quiet 2-core machine with the defaults;
`--report-only` rewrites the section from the last run's bench/work/ranks/results.json.
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_cp  # noqa: E402

ROOT = vs_cp.ROOT
WORK = os.path.join(ROOT, "bench", "work", "ranks")
RESULTS = os.path.join(ROOT, "bench", "RESULTS-ranks.md")
TITLE = "# `ckpt` over MPI ranks (`mpirun -np N ckpt ...`)"
OPS = ("split", "merge", "dcp", "zero", "reshard")
RESHARD_WORLD = 4
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
log = vs_cp.log


# ---------------------------------------------------------------- the results file, shared with ranks_405b.py


def write_section(marker, text):
    """Replaces the text between `<!-- marker -->` and `<!-- /marker -->` in RESULTS-ranks.md (or
    appends it), keeping the rest of the file: each script owns its own section."""
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = open(RESULTS).read() if os.path.exists(RESULTS) else TITLE + "\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    with open(RESULTS + ".part", "w") as f:
        f.write(new)
    os.replace(RESULTS + ".part", RESULTS)


def machine():
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    disk = subprocess.run(["df", "--output=source", ROOT], capture_output=True, text=True).stdout.split()[-1]
    return (f"{platform.machine()}, {os.cpu_count()} CPUs shared with other work, {mem:.0f} GiB RAM, one disk "
            f"({disk}), kernel {platform.release()}, {mpi}")


# ---------------------------------------------------------------- the runs


def operations(ckpt, ops):
    """name -> (description, command template with `{out}`, source files to warm)."""
    p = vs_cp.inputs(ckpt, [o if o != "reshard" else "dcp" for o in ops])
    base = vs_cp.operations(ckpt, p, [o for o in ops if o != "reshard"])
    table = {}
    for name in ops:
        if name == "reshard":
            if "dcp" not in p or not os.path.exists(os.path.join(p["dcp"], ".metadata")):
                log("skipping reshard: the DCP input could not be made")
                continue
            reads = vs_cp.files_in(p["dcp"], "*.distcp") + [os.path.join(p["dcp"], ".metadata")]
            table[name] = (f"`ckpt reshard` of that DCP folder (FSDP2, 2 ranks) for {RESHARD_WORLD} ranks",
                           [ckpt, "--quiet", "reshard", p["dcp"], "{out}", "--world-size", str(RESHARD_WORLD)],
                           reads)
        elif name in base:
            desc, cmd, _, reads = base[name]
            table[name] = (desc, cmd, reads)
        else:
            log(f"skipping {name}: its input could not be made")
    return table


def wrapper():
    """A script that runs its arguments under `/usr/bin/time`, writing peak RSS (KiB), wall, user
    and system seconds to WORK/rss/<rank> (`solo` outside mpirun)."""
    path = os.path.join(WORK, "per-rank-time.sh")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                f"exec /usr/bin/time -f '%M %e %U %S' -o '{WORK}/rss/'\"${{OMPI_COMM_WORLD_RANK:-solo}}\" \"$@\"\n")
    os.chmod(path, 0o755)
    return path


def one_run(cmd, n, out, sources, wrap):
    """One run from a fresh output folder, after a `sync` and with warm sources: its wall time,
    the `--json` document, and each process's (peak RSS MiB, wall s, CPU s)."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(os.path.join(WORK, "rss"), ignore_errors=True)
    os.makedirs(os.path.join(WORK, "rss"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if "{out}/" in " ".join(cmd):
        os.makedirs(out)  # merges write {out}/model.safetensors
    full = ([] if n == 0 else MPIRUN + ["-np", str(n)]) + [wrap] + [s.replace("{out}", out) for s in cmd] + ["--json"]
    subprocess.run(["sync"], check=True)
    vs_cp.warm(sources)
    t0 = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(full)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    doc = json.loads(proc.stdout)
    procs = {}
    for name in os.listdir(os.path.join(WORK, "rss")):
        text = open(os.path.join(WORK, "rss", name)).read().split()
        rss, w, u, s = int(text[-4]), float(text[-3]), float(text[-2]), float(text[-1])
        procs[name] = (rss / 1024, w, u + s)
    expect = 1 if n == 0 else n
    if len(procs) != expect:
        raise SystemExit(f"{' '.join(full)}: {len(procs)} per-rank time files, expected {expect}")
    return wall, doc, procs, " ".join(full)


def dry_run(cmd, n, out):
    """The same command with `--dry-run` (launch, MPI start, every rank opening the source and
    planning, no write): its wall time and the `--json` shares it planned."""
    shutil.rmtree(out, ignore_errors=True)
    if "{out}/" in " ".join(cmd):
        os.makedirs(out)
    full = ([] if n == 0 else MPIRUN + ["-np", str(n)]) + [s.replace("{out}", out) for s in cmd] + ["--json", "--dry-run"]
    t0 = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(full)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    if os.path.exists(out) and any(os.scandir(out)):
        raise SystemExit(f"{' '.join(full)} wrote into {out}")
    return wall, json.loads(proc.stdout)["ranks"]


def same_output(ref, out):
    """Whether the folder `out` holds the same files as `ref`, byte for byte; a DCP `.metadata`
    with its `save_id` UUID masked. Returns (ok, what differs, masked files)."""
    listing = lambda d: sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)
    a, b = listing(ref), listing(out)
    if a != b:
        return False, f"files differ: {sorted(set(a) ^ set(b))}", []
    masked = []
    for rel in a:
        fa, fb = os.path.join(ref, rel), os.path.join(out, rel)
        if os.path.basename(rel) == ".metadata":
            x, y = open(fa, "rb").read(), open(fb, "rb").read()
            if len(x) != len(y) or UUID.sub(b"0" * 36, x) != UUID.sub(b"0" * 36, y) or len(UUID.findall(x)) != 1:
                return False, f"{rel} differs beyond its save_id", masked
            masked.append(rel)
        elif subprocess.run(["cmp", "-s", fa, fb]).returncode != 0:
            return False, f"{rel} differs", masked
    return True, "", masked


def out_bytes(d):
    """Bytes of the data files of an output (the commit files, index and `.metadata`, apart)."""
    data = commit = 0
    for r, _, fs in os.walk(d):
        for f in fs:
            size = os.path.getsize(os.path.join(r, f))
            if f.endswith(".json") or f == ".metadata":
                commit += size
            else:
                data += size
    return data, commit


def measure(name, spec, ranks, reps, warmup, wrap):
    desc, cmd, sources = spec
    out = os.path.join(WORK, "out")
    ref = os.path.join(WORK, "ref")
    shutil.rmtree(ref, ignore_errors=True)
    configs = [0] + ranks  # 0: one process, no launcher
    runs = {n: [] for n in configs}
    dry = {n: [] for n in configs}
    checked, masked_all = 0, set()
    for i in range(warmup + reps):
        order = configs if i % 2 == 0 else configs[::-1]
        row = {}
        for n in order:
            wall, doc, procs, full = one_run(cmd, n, out, sources, wrap)
            if not os.path.exists(ref):
                if n != 0:
                    raise SystemExit("the reference must be a one-process run")
                data, commit = out_bytes(out)
                os.replace(out, ref)
            else:
                ok, why, masked = same_output(ref, out)
                if not ok:
                    raise SystemExit(f"{name}: `{full}` wrote other bytes than one process: {why}")
                checked += 1
                masked_all.update(masked)
            row[n] = wall
            if i >= warmup:
                runs[n].append({"wall": wall, "ranks": doc["ranks"], "procs": procs})
        for n in order:
            t, planned = dry_run(cmd, n, out)
            if i >= warmup and planned != runs[n][-1]["ranks"]:
                raise SystemExit(f"{name}: at -np {n} --dry-run planned {planned}, the run reported "
                                 f"{runs[n][-1]['ranks']}")
            if i >= warmup:
                dry[n].append(t)
        tag = "warm-up" if i < warmup else f"rep {i - warmup + 1}"
        log(f"{name:8s} {tag:8s} " + "  ".join(
            f"{'1 proc' if n == 0 else f'np {n}'} {row[n]:5.2f} s" for n in configs))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    return {"desc": desc, "cmd": cmd, "runs": {str(n): v for n, v in runs.items()},
            "dry": {str(n): v for n, v in dry.items()}, "checked": checked,
            "masked": sorted(masked_all), "out_data_bytes": data, "out_commit_bytes": commit}


# ---------------------------------------------------------------- the report


def summary(r, n):
    runs = r["runs"][str(n)]
    solo = r["runs"]["0"]
    ratios = [x["wall"] / y["wall"] for x, y in zip(runs, solo)]
    shares = runs[-1]["ranks"]
    written = [s["bytes_written"] for s in shares]
    files = [s["files"] for s in shares]
    mean = sum(written) / len(written)
    rss = [max(p[0] for p in x["procs"].values()) for x in runs]
    rank_wall = [max(p[1] for p in x["procs"].values()) for x in runs]
    cpu = [sum(p[2] for p in x["procs"].values()) for x in runs]
    return {
        "wall": statistics.median(x["wall"] for x in runs),
        "ratio": statistics.median(ratios) if n else 1.0,
        "ratio_q": statistics.quantiles(ratios, n=4) if n and len(ratios) > 1 else [],
        "balance": max(written) / mean if mean else 1.0,
        "files": f"{min(files)}–{max(files)}" if min(files) != max(files) else str(files[0]),
        "written": sum(written),
        "read": sum(s["bytes_read"] for s in shares),
        "rss": max(rss),
        "rss_ranks": [round(runs[-1]["procs"][k][0], 1) for k in sorted(runs[-1]["procs"])],
        "rank_wall": statistics.median(rank_wall),
        "cpu": statistics.median(cpu),
        "dry": statistics.median(r["dry"][str(n)]),
    }


def report(results, ranks, reps, warmup, argv, at, machine_text):
    label = lambda n: "1 process" if n == 0 else f"`-np {n}`"
    lines = [
        "## The 1 GB operations at 1, 2 and 4 ranks on one machine",
        "",
        f"Machine: {machine_text}. `bench/ranks.py{' ' + argv if argv else ''}` on {at}.",
        "",
        f"**What this measures.** {len(ranks)} rank counts on one {os.cpu_count()}-core machine with one disk: "
        "the ranks share the cores, the page cache and the disk, so this measures the overhead of running "
        "as an MPI job (launch, every rank opening the source, the barrier, rank 0's commit) and how evenly "
        "the plan is dealt out, not scaling. Scaling needs ranks on nodes with their own bandwidth to a "
        "parallel filesystem; see the 405B projection below for the shares at that size.",
        "",
        f"Each operation ran {reps} times (after {warmup} discarded warm-up round(s)) as one process and as "
        f"`mpirun --allow-run-as-root --oversubscribe --bind-to none -np N` for N = {', '.join(map(str, ranks))}, "
        "all in every round, the order reversed each round. Every run starts from a fresh output folder, "
        "after a `sync` and a read of its sources (warm page cache). Wall time around the whole command "
        "(mpirun included). Fixed cost: the same command with `--dry-run` (launch, MPI start-up, every rank "
        "opening the source and planning, nothing written; its planned shares equal the run's), and the median "
        "wall less that. Ratio: the "
        "median over rounds of N ranks / one process in the same round (quartiles). Balance: the largest "
        "rank's bytes written (`--json` `ranks`) over the mean. Peak RSS: the largest of any rank in any "
        "round, `/usr/bin/time` per process. Slowest process: the median over rounds of the longest wall "
        "time `/usr/bin/time` gave any rank (its MPI start-up included, mpirun's own not). CPU: user + "
        "system of all ranks together.",
        "",
        "| operation | ranks | median wall (s) | fixed cost: `--dry-run` (s) | wall − fixed cost (s) | N / one process (quartiles) | files per rank | balance (max / mean written) | slowest process (s) | peak RSS per rank (MiB) | CPU, all ranks (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, r in results.items():
        for n in [0] + ranks:
            s = summary(r, n)
            q = f" ({s['ratio_q'][0]:.2f}–{s['ratio_q'][2]:.2f})" if s["ratio_q"] else ""
            lines.append(
                f"| {name if n == 0 else ''} | {label(n)} | {s['wall']:.2f} | "
                f"{s['dry']:.2f} | {s['wall'] - s['dry']:.2f} | {s['ratio']:.2f}{q} | {s['files']} | {s['balance']:.3f} | "
                f"{s['rank_wall']:.2f} | {s['rss']:.1f} | {s['cpu']:.2f} |" if n else
                f"| {name} | {label(n)} | {s['wall']:.2f} | {s['dry']:.2f} | {s['wall'] - s['dry']:.2f} | 1 | {s['files']} | – | "
                f"{s['rank_wall']:.2f} | {s['rss']:.1f} | {s['cpu']:.2f} |")
        solo = summary(r, 0)
        if solo["written"] != r["out_data_bytes"]:
            notes.append(f"- {name}: the ranks' `bytes_written` add up to {solo['written']:,} while the data "
                         f"files written hold {r['out_data_bytes']:,} bytes (the commit files, "
                         f"{r['out_commit_bytes']:,} bytes, apart); the difference, "
                         f"{r['out_data_bytes'] - solo['written']:,} bytes, is the torch zip archive around the tensor "
                         "data (record headers, the small pickle and version records, descriptors, central "
                         "directories), which a file's owner writes when it seals the file and the counts leave out.")
    lines += ["", "Operations:"]
    for name, r in results.items():
        lines.append(f"- {name}: {r['desc']}; output {r['out_data_bytes'] / 1e9:.3f} GB of data files. "
                     f"{r['checked']} later outputs (one-process and N-rank) compared with the first "
                     f"one-process output: all byte-identical"
                     + (f" ({', '.join('`' + m + '`' for m in r['masked'])} with its `save_id` UUID masked)"
                        if r["masked"] else "") + ".")
    lines += ["", "Per-rank shares of the last round (`--json`), bytes written:"]
    for name, r in results.items():
        for n in ranks:
            shares = r["runs"][str(n)][-1]["ranks"]
            lines.append(f"- {name}, {n} rank(s): " + ", ".join(
                f"rank {s['rank']} {s['files']} file(s) {s['bytes_written'] / 1e6:.1f} MB" for s in shares))
    if notes:
        lines += ["", "Counts:"] + notes
    lines += ["", "Runs (s), wall in round order:"]
    for name, r in results.items():
        lines.append(f"- {name}: " + "; ".join(
            label(n) + " " + " ".join(f"{x['wall']:.2f}" for x in r["runs"][str(n)]) for n in [0] + ranks))
    # The reading, from the numbers.
    worst = {n: max(summary(r, n)["ratio"] for r in results.values()) for n in ranks}
    best = {n: min(summary(r, n)["ratio"] for r in results.values()) for n in ranks}
    dry = {n: statistics.median(x for r in results.values() for x in r["dry"][str(n)]) for n in [0] + ranks}
    lines += [
        "",
        "Reading (generated from the numbers above): the N-rank runs take "
        + "; ".join(f"{best[n]:.2f}–{worst[n]:.2f}× the one-process time at {n} rank(s) "
                    f"(its fixed cost, a dry run, {dry[n]:.2f} s against {dry[0]:.2f} s)" for n in ranks)
        + ". On this machine every extra rank competes for the same two cores and the same disk, so the "
        "launch, MPI start-up and the per-rank open are paid and no bandwidth is added: the one-process "
        "time plus the difference in fixed cost is the expected result, not a failure to scale.",
    ]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per operation (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--ranks", default="1,2,4", help="mpirun -np values (default 1,2,4)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS-ranks.md")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: write the report again from bench/work/ranks/results.json")
    args = ap.parse_args()
    if args.report_only:
        saved = json.load(open(os.path.join(WORK, "results.json")))
        results, meta = saved["results"], saved["meta"]
        text = report(results, meta["ranks"], meta["reps"], meta["warmup"], meta["argv"], meta["at"], meta["machine"])
        print(text)
        if not args.no_write:
            write_section("ranks.py", text)
        return
    ops = args.ops.split(",")
    unknown = set(ops) - set(OPS)
    if unknown:
        raise SystemExit(f"unknown ops {sorted(unknown)}; known: {','.join(OPS)}")
    ranks = [int(x) for x in args.ranks.split(",")]
    ckpt = os.path.abspath(args.ckpt)
    os.makedirs(WORK, exist_ok=True)
    # A binary without the mpi feature would run N independent copies, each writing everything.
    probe = subprocess.run(MPIRUN + ["-np", "2", ckpt, "merge", "--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"mpirun cannot start {ckpt}:\n{probe.stderr[-2000:]}")
    table = operations(ckpt, ops)
    if not table:
        raise SystemExit("nothing to measure")
    wrap = wrapper()
    results = {}
    t0 = time.time()
    for name, spec in table.items():
        results[name] = measure(name, spec, ranks, args.reps, args.warmup, wrap)
    for name, r in results.items():
        for n in ranks:
            if len(r["runs"][str(n)][-1]["ranks"]) != n:
                raise SystemExit(f"{name}: `--json` lists {len(r['runs'][str(n)][-1]['ranks'])} ranks at -np {n}: "
                                 "is the binary built with --features mpi?")
    log(f"measured in {time.time() - t0:.0f} s")
    meta = {"ranks": ranks, "reps": args.reps, "warmup": args.warmup, "argv": " ".join(sys.argv[1:]),
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine()}
    text = report(results, ranks, args.reps, args.warmup, meta["argv"], meta["at"], meta["machine"])
    print(text)
    with open(os.path.join(WORK, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    if not args.no_write:
        write_section("ranks.py", text)


if __name__ == "__main__":
    main()
