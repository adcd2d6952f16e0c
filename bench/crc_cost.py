"""What the CRC32 checks cost: each merge and convert that reads torch zip records, run by the
current `ckpt` (which checks every record it reads) and by a `ckpt` without the checks, paired and
alternated on the same inputs as bench/vs_cp.py.

    /opt/statekit-venv/bin/python bench/crc_cost.py --baseline bench/work/crc-base/target/release/ckpt [--pairs 7]
        [--ops convert,dcp,zero,dcp_tp] [--ckpt target/release/ckpt] [--no-write]

The baseline binary is the same tree with the checks turned off by the `statekit_bench_unchecked`
cfg, which only RUSTFLAGS sets (no cargo feature reaches it, so `--all-features` builds check
every record; bench/all.sh builds it so):

    RUSTFLAGS="--cfg statekit_bench_unchecked" CARGO_TARGET_DIR=bench/work/crc-base/target \
        cargo build --release -p statekit-cli

(copying `target/release` there first saves rebuilding the dependencies). Runs before 2026-12-04
used `ckpt` built at the commit before the checks landed (f1f2783), which differs in more than
the checks, or a copy of the tree with the checks edited out by hand.
Both sides read the same files, warm in the page cache, and write to a fresh folder, as in
vs_cp.py (whose inputs, timing and fresh-folder rules this reuses). The table gives the medians
of wall time and of CPU time (user + system, from `/usr/bin/time -v`): the check's cost is the
CPU it adds (it hashes every byte of every record the operation reads once, where the memory map
has them), which the wall time shows only in part on two cores. Results: bench/RESULTS-crc.md,
and the ratios against a durable `cp` are vs_cp.py's, measured with the checks.
"""

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_cp  # noqa: E402

OPS = ("convert", "dcp", "zero", "dcp_tp")


def timed(cmd, out, sources):
    """Wall and CPU seconds and peak RSS of one run (vs_cp.py's fresh-folder, warm-source rules)."""
    wall, text = vs_cp.timed_run(cmd, out, sources)
    user = float(re.search(r"User time \(seconds\): ([\d.]+)", text).group(1))
    system = float(re.search(r"System time \(seconds\): ([\d.]+)", text).group(1))
    return wall, user + system, vs_cp.peak_rss_mib(text)


def measure(name, a_spec, c_spec, pairs, warmup):
    out = os.path.join(vs_cp.WORK, "out")
    a_cmd = [s.replace("{out}", out) for s in a_spec[1]]
    c_cmd = [s.replace("{out}", out) for s in c_spec[1]]
    sources = sorted(set(a_spec[3]))
    rows = {"a": [], "c": []}
    for i in range(warmup + pairs):
        a = timed(a_cmd, out, sources)
        c = timed(c_cmd, out, sources)
        tag = "warm-up" if i < warmup else f"pair {i - warmup + 1}"
        vs_cp.log(f"{name:8s} {tag:8s} checked {a[0]:5.2f} s ({a[1]:5.2f} s CPU)  unchecked {c[0]:5.2f} s "
                  f"({c[1]:5.2f} s CPU)")
        if i >= warmup:
            rows["a"].append(a)
            rows["c"].append(c)
    shutil.rmtree(out, ignore_errors=True)
    med = lambda side, k: statistics.median(r[k] for r in rows[side])
    return {
        "desc": a_spec[0], "pairs": pairs, "rows": rows,
        "wall_a": med("a", 0), "wall_c": med("c", 0), "cpu_a": med("a", 1), "cpu_c": med("c", 1),
        "rss_a": max(r[2] for r in rows["a"]), "rss_c": max(r[2] for r in rows["c"]),
        "cpu_extra": statistics.median(a[1] - c[1] for a, c in zip(rows["a"], rows["c"])),
        "read_gb": sum(os.path.getsize(f) for f in a_spec[2]) / 1e9,
    }


def report(results, pairs, warmup, baseline, loads):
    lines = [
        "# What the CRC32 checks cost",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, kernel {platform.release()}. "
        f"`bench/crc_cost.py --pairs {pairs} --warmup {warmup}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"load average (1 min) {loads[0]:.1f} at the start, {loads[1]:.1f} at the end.",
        "",
        "Each operation ran as alternated pairs on the inputs of `bench/vs_cp.py`: the current `ckpt`, which checks "
        "the CRC32 of every zip record it reads (torch storages, DCP items), then `ckpt` without the checks "
        f"(`{baseline}`, see the script's docstring). CPU is user + system time. The bytes are the records the operation reads "
        "(the baseline files of vs_cp.py), each hashed once.",
        "",
        "| operation | bytes checked (GB) | median wall, checked / unchecked (s) | median CPU, checked / unchecked (s) "
        "| median extra CPU per pair (s) | extra CPU per GB (s) | peak RSS checked / unchecked (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        per_gb = r["cpu_extra"] / r["read_gb"] if r["read_gb"] else 0.0
        lines.append(
            f"| {name}: {r['desc']} | {r['read_gb']:.3f} | {r['wall_a']:.2f} / {r['wall_c']:.2f} | "
            f"{r['cpu_a']:.2f} / {r['cpu_c']:.2f} | {r['cpu_extra']:.2f} | {per_gb:.2f} | "
            f"{r['rss_a']:.1f} / {r['rss_c']:.1f} |")
    lines += ["", "Runs (s), wall / CPU, checked then unchecked in pair order:"]
    for name, r in results.items():
        a = " ".join(f"{w:.2f}/{c:.2f}" for w, c, _ in r["rows"]["a"])
        c = " ".join(f"{w:.2f}/{c:.2f}" for w, c, _ in r["rows"]["c"])
        lines.append(f"- {name}: checked {a}; unchecked {c}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="ckpt built with RUSTFLAGS='--cfg statekit_bench_unchecked'")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--ckpt", default=os.path.join(vs_cp.ROOT, "target", "release", "ckpt"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        raise SystemExit(f"not an operation that reads zip records: {', '.join(sorted(unknown))}")
    p = vs_cp.inputs(args.ckpt, ops)
    load_start = os.getloadavg()[0]
    checked = vs_cp.operations(args.ckpt, p, ops)
    unchecked = vs_cp.operations(args.baseline, p, ops)
    results = {name: measure(name, checked[name], unchecked[name], args.pairs, args.warmup) for name in ops}
    text = report(results, args.pairs, args.warmup, args.baseline, (load_start, os.getloadavg()[0]))
    print(text)
    if not args.no_write:
        with open(os.path.join(vs_cp.ROOT, "bench", "RESULTS-crc.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
