"""How long `ckpt` takes to open and plan a DeepSeek-V3-sized Megatron-LM run (issue 37), with
`--dry-run`, on a synthetic run folder whose data bytes are holes.

    /opt/statekit-venv/bin/python bench/megatron_plan.py [--runs 3] [--fresh]
        [--ckpt target/release/ckpt] [--no-write]

The run folder (bench/work/dsv3-plan/run, written once, `--fresh` writes it again) is
bench/py/make_dsv3_catalog.py's: a Qwen2-MoE-family GPTModel with DeepSeek-V3's sizes (61 layers,
the first 3 dense, 256 routed experts + 1 shared, hidden 7168, 128 heads; 675 B parameters,
1.35 TB of bf16) as Megatron-LM's `save_checkpoint` would lay it out at pipeline parallel 16 x
data parallel 64 x expert parallel 64 (1024 `.distcp` files), with real metadata, real item zip
records and real saved `args`, and sparse data (see that file for what is real and why it is not
DeepSeek-V3's attention). Its template is bench/py/make_megatron_moe_checkpoint.py's run, written
by megatron-core 0.19.2 (needs /opt/mcore), and the script first checks the synthetic layout's
rule against that real save (`make_dsv3_catalog.py --validate`). A second folder,
bench/work/dsv3-plan/run-noextra, is the same without the experts' 29,696 `_extra_state` items
(`--no-expert-extra-state`), which megatron does write: statekit at 75ecbae refused the full folder
(its non-tensor items share one unpickling budget, which then grew with their bytes alone; each
pickle brings an allowance of its own since b46f562), and the second folder shows what those
items cost. Both are timed and reported, a refusal with its message.

Timed, each `--runs` times in turn, every process under `/usr/bin/time -v` (wall around the
process, user + system CPU, peak RSS):
- `ckpt convert RUN OUT --to hf --dry-run --json`: open (the `.metadata` pickle, every item's zip
  records, every non-tensor item's pickle, the saved `args`), recognize the architecture, map
  Megatron's names to the Hub's, plan the shards and every range copy, write nothing;
- `ckpt merge RUN OUT.safetensors --dry-run --json`: the same catalog, merged into megatron's
  one-rank model (the layers and experts unstacked) as one file.
Runs alternate between the operations; the table gives the median of all runs and each run. The
script checks that no output appeared.

Results: bench/RESULTS-megatron-plan.md (and bench/RESULTS.md through bench/assemble.sh).
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "bench", "work", "dsv3-plan")
PY = sys.executable
sys.path.insert(0, os.path.join(ROOT, "bench", "py"))
import make_megatron_moe_checkpoint as template  # noqa: E402


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def mcore_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([template.MCORE] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def ensure_catalog(name, fresh, *flags):
    """The template run and the synthetic run folder WORK/NAME; the writer's summary (tensors,
    chunks, parameters, files, bytes on disk) and the check of the layout rule."""
    base = os.path.join(ROOT, "bench", "work", "vs-cp", "megatron-moe")
    tpl = template.ensure(base)
    maker = os.path.join(ROOT, "bench", "py", "make_dsv3_catalog.py")
    check = subprocess.run([PY, maker, "--validate", tpl], env=mcore_env(), capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"the synthetic layout's rule does not match megatron's save:\n{check.stdout}{check.stderr[-3000:]}")
    run = os.path.join(WORK, name)
    summary = os.path.join(WORK, name + ".json")
    if fresh or not os.path.exists(summary):
        log(f"writing {run} (synthetic, sparse) ...")
        os.makedirs(WORK, exist_ok=True)
        out = subprocess.run([PY, maker, run, tpl, *flags], env=mcore_env(), capture_output=True, text=True, check=True)
        with open(summary, "w") as f:
            f.write(out.stdout)
    return run, json.load(open(summary)), check.stdout.strip()


def timed(cmd):
    """Exit status, wall (s), CPU (s), peak RSS (MiB), stdout and stderr of one run under
    `/usr/bin/time -v`."""
    tf = os.path.join(WORK, "time.txt")
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "-o", tf, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = open(tf).read()
    grab = lambda pat: float(re.search(pat, text).group(1))
    cpu = grab(r"User time \(seconds\): ([\d.]+)") + grab(r"System time \(seconds\): ([\d.]+)")
    rss = grab(r"Maximum resident set size \(kbytes\): (\d+)") / 1024
    return proc.returncode, wall, cpu, rss, proc.stdout, proc.stderr


def loadavg():
    return open("/proc/loadavg").read().split()[:3]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="write the synthetic run folders again")
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS-megatron-plan.md")
    args = ap.parse_args()
    ckpt = os.path.abspath(args.ckpt)
    full, full_facts, validation = ensure_catalog("run", args.fresh)
    lean, lean_facts, _ = ensure_catalog("run-noextra", args.fresh, "--no-expert-extra-state")
    out_hf, out_st = os.path.join(WORK, "out-hf"), os.path.join(WORK, "out.safetensors")
    ops = lambda run: {
        "convert --to hf": [ckpt, "--quiet", "convert", run, out_hf, "--to", "hf", "--dry-run", "--json"],
        "merge": [ckpt, "--quiet", "merge", run, out_st, "--dry-run", "--json"],
    }
    load_start = loadavg()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {}
    for label, run in (("full", full), ("lean", lean)):
        for i in range(args.runs):
            for name, cmd in ops(run).items():
                rc, wall, cpu, rss, stdout, stderr = timed(cmd)
                r = results.setdefault((label, name), {"cmd": cmd, "runs": [], "rc": rc, "doc": None, "error": None})
                r["runs"].append((wall, cpu, rss))
                r["rc"] = rc
                if rc == 0:
                    r["doc"] = json.loads(stdout)
                else:
                    r["error"] = stderr.strip().splitlines()[0] if stderr.strip() else f"exit {rc}"
                log(f"{label} {name:16s} run {i + 1}: exit {rc}, {wall:6.2f} s wall, {cpu:6.2f} s CPU, {rss:7.1f} MiB")
                for p in (out_hf, out_st):
                    if os.path.exists(p):
                        raise SystemExit(f"a dry run wrote {p}")
    load_end = loadavg()
    with open(os.path.join(WORK, "results.json"), "w") as f:
        json.dump({"facts": {"full": full_facts, "lean": lean_facts}, "load": [load_start, load_end],
                   "results": {f"{k[0]} {k[1]}": v for k, v in results.items()}}, f, indent=1)
    text = report(args, ckpt, full_facts, lean_facts, validation, results, load_start, load_end, stamp)
    print(text)
    if not args.no_write:
        with open(os.path.join(ROOT, "bench", "RESULTS-megatron-plan.md"), "w") as f:
            f.write(text)


def report(args, ckpt, full, lean, validation, results, load_start, load_end, stamp):
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    rel = lambda p: os.path.relpath(p, ROOT)
    lines = [
        "# Planning a DeepSeek-V3-sized Megatron-LM run (`--dry-run`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, {mem:.0f} GiB RAM, kernel "
        f"{platform.release()}. `bench/megatron_plan.py --runs {args.runs}` with `{rel(ckpt)}` on {stamp}; load "
        f"average (1, 5, 15 min) {' '.join(load_start)} at the start, {' '.join(load_end)} at the end.",
        "",
        f"The run folder is synthetic (bench/py/make_dsv3_catalog.py): DeepSeek-V3-sized, not DeepSeek-V3's "
        f"attention. DeepSeek-V3's multi-latent attention has no Hugging Face family in statekit's tables (a run "
        f"with `multi_latent_attention` is refused by name), so the model is of the Qwen2-MoE family (grouped-query "
        f"attention with QKV bias, a gated shared expert, dense layers by `moe_layer_freq`) at DeepSeek-V3's sizes: "
        f"61 layers, the first 3 dense (FFN 18432), 58 MoE layers of 256 routed experts (FFN 2048, top 8) and one "
        f"shared expert (FFN 2048), hidden 7168, 128 heads of 128 in 8 query groups, vocab 129280, untied output "
        f"layer, bf16: {full['parameters'] / 1e9:.1f} B parameters, {full['tensor_bytes'] / 1e12:.2f} TB. "
        f"Laid out as Megatron-LM's `save_checkpoint` would write it at pipeline parallel 16 x data parallel 64 x "
        f"expert parallel 64 (tensor parallel 1): {full['files']} `.distcp` files, {full['tensors']} tensors in "
        f"{full['chunks']:,} chunks, {full['bytes_items']:,} non-tensor items (the `_extra_state` of every linear "
        f"layer, one per expert for the experts; `common_state` with the saved `args`; `rng_state`), a "
        f"{full['metadata_bytes'] / 1e6:.1f} MB `.metadata`. The metadata, every item's `torch.save` zip records "
        f"and the non-tensor items are real bytes; the tensors' payloads are holes (sparse files: "
        f"{full['file_bytes'] / 1e12:.2f} TB of file length, {full['disk_bytes'] / 1e6:.0f} MB on disk). The dry "
        f"runs read the metadata and each item's zip records; looking for an item's end-of-central-directory "
        f"record they also read its last 64 KiB, which for a tensor item is mostly the payload's tail (zeros "
        f"here, see the reading below). The layout rule was checked "
        f"against megatron-core 0.19.2's own save of a small run of the same family first: "
        f"{validation.removeprefix('PASS: ').replace(ROOT + os.sep, '')}.",
        "",
        "| folder | operation (`--dry-run --json`) | result | median wall (s) | median CPU (s) | peak RSS (MiB) | runs, wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    folder = {"full": f"as megatron writes it ({full['bytes_items']:,} non-tensor items)",
              "lean": f"without the experts' `_extra_state` ({lean['bytes_items']:,} non-tensor items)"}
    for (label, name), r in results.items():
        if r["rc"] == 0:
            d = r["doc"]
            shards = sum(1 for f in d["files"] if f.endswith(".safetensors"))
            what = f"plans {d['tensors']:,} tensors, {d['bytes'] / 1e12:.2f} TB, in {shards} safetensors file(s)"
        else:
            what = f"refused (exit {r['rc']})"
        lines.append(f"| {folder[label]} | `ckpt {name}` | {what} | {med(r['runs'], 0):.2f} | {med(r['runs'], 1):.2f} | "
                     f"{max(x[2] for x in r['runs']):.1f} | {' '.join(f'{x[0]:.2f}' for x in r['runs'])} |")
    errors = {r["error"] for r in results.values() if r["error"]}
    if errors:
        lines += ["", "The refusals, verbatim (paths relative to the repository):", ""]
        lines += [f"- `` {e.replace(ROOT + os.sep, '')} ``" for e in sorted(errors)]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
