"""`statekit-train` benchmark: step time and its breakdown (data, forward/backward,
collectives) in both modes against torch's step on the same model (`bench/train_step_torch.py`
under torchrun, gloo, same world size: DDP for `ddp`, FSDP2 for `sharded`), the two sides
alternated `--pairs` times, with each rank's peak RSS and minor page faults from
`/usr/bin/time`; checkpoint save and load time against torch's `dcp.save`/`dcp.load` of the
same state; the `--async-save` stall against a synchronous save. Writes bench/RESULTS-train.md
(everything below its `KEEP` line, written by hand, is kept).

    bench/train_bench.py [--train target/release/statekit-train] [--ckpt target/release/ckpt]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCH_LIB = Path(torch.__file__).resolve().parent / "lib"
SIZE = ["--dim", "384", "--layers", "6", "--heads", "6", "--block-size", "128", "--batch-size", "8"]
# statekit-train's default `--threads` (one intra-op thread per rank); torch's side is given the same.
THREADS = "1"
KEEP = "<!-- Below this line: written by hand; bench/train_bench.py keeps it. -->"
# Each rank under GNU time, its report in `PREFIX.RANK` (mpirun and torchrun each name the rank).
PER_RANK_TIME = 'exec /usr/bin/time -f "%R %M %U %S" -o "$0.${OMPI_COMM_WORLD_RANK:-$RANK}" "$@"'


def mpirun(world, train, args, cwd, timed=None):
    """stderr and stdout of statekit-train on `world` ranks; with `timed`, each rank runs under
    GNU time writing `timed.RANK`."""
    # OMP_NUM_THREADS as torchrun sets it for torch's workers, so that both sides run in the same
    # environment (statekit's `--threads` is libtorch's `set_num_threads`; torch's side gets both).
    env = dict(os.environ, LD_LIBRARY_PATH=f"{TORCH_LIB}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               OMP_NUM_THREADS=THREADS)
    # Unbound, as torchrun leaves its workers: OpenMPI would pin 2 ranks to a core each, torch's
    # side would not be, and the comparison would be of placements.
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-x", "OMP_NUM_THREADS", "-np", str(world)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if timed:
        cmd += ["sh", "-c", PER_RANK_TIME, str(timed)]
    p = subprocess.run(cmd + [train, *SIZE, *args], cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"statekit-train failed:\n{p.stderr[-3000:]}")
    return p.stderr, p.stdout


def torch_step(world, mode, steps, data, reference, timed):
    """torch's side of a step-time pair: bench/train_step_torch.py's JSON line."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={world}", "--no-python", "sh", "-c", PER_RANK_TIME,
           str(timed), sys.executable, str(ROOT / "bench/train_step_torch.py"), "--mode", mode, "--steps", str(steps),
           "--data", str(data), "--reference", str(reference), "--threads", THREADS, *SIZE]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"torch step side failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def per_rank(prefix, world):
    """[(minor page faults, peak RSS KiB, CPU seconds user + system)] of each rank, from GNU
    time's `prefix.RANK` files."""
    out = []
    for r in range(world):
        faults, rss, user, system = Path(f"{prefix}.{r}").read_text().split()[-4:]
        out.append((int(faults), int(rss), float(user) + float(system)))
    return out


def step_times(stdout):
    """Rank 0's wall time of each step: the differences of its log lines' `elapsed_s`."""
    elapsed = [json.loads(l)["elapsed_s"] for l in stdout.splitlines() if l.startswith("{")]
    return [b - a for a, b in zip([0.0] + elapsed, elapsed)]


def timing(err):
    m = re.search(r"per step ([\d.]+)s \(data ([\d.]+)s, forward/backward ([\d.]+)s, collectives ([\d.]+)s", err)
    rss = re.search(r"parameters \+ moments (\d+) bytes.*peak RSS (\d+) KiB", err)
    return [float(x) for x in m.groups()], int(rss.group(1)), int(rss.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default=str(ROOT / "target/release/statekit-train"))
    ap.add_argument("--ckpt", default=str(ROOT / "target/release/ckpt"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3, help="alternated statekit/torch step-time runs per mode")
    a = ap.parse_args()
    load_start = os.getloadavg()[0]
    work = ROOT / "bench/work/train"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = os.path.abspath(a.train)
    saves, stalls = {}, {}
    for mode in ["ddp", "sharded"]:
        base = ["--mode", mode, "--steps", str(a.steps), "--threads", THREADS]
        # A synchronous and an asynchronous save every 5 steps.
        err, _ = mpirun(a.world, train, base + ["--save-every", "5", "--ckpt-dir", f"{mode}-sync"], work)
        saves[mode] = [float(x) for x in re.findall(r"saved in ([\d.]+)s", err)]
        err, _ = mpirun(a.world, train, base + ["--save-every", "5", "--ckpt-dir", f"{mode}-async", "--async-save"],
                        work)
        stalls[mode] = [float(x) for x in re.findall(r"stall ([\d.]+)s\)", err)]
    # The merged checkpoint: torch's step side checks its model against it, the DCP side copies its shapes.
    subprocess.run([a.ckpt, "merge", str(work / "sharded-sync/latest"), str(work / "ref.safetensors")], check=True,
                   capture_output=True)
    data = work / "statekit-data/synthetic.bin"

    # Step time: statekit and torch alternated, mode by mode, `--pairs` times (no checkpoints).
    load_pairs = os.getloadavg()[0]
    runs = {m: {"ours": [], "torch": []} for m in ["ddp", "sharded"]}
    for i in range(a.pairs):
        for mode in ["ddp", "sharded"]:
            timed = work / f"time-{mode}-statekit-{i}"
            err, out = mpirun(a.world, train, ["--mode", mode, "--steps", str(a.steps), "--threads", THREADS], work,
                              timed=timed)
            runs[mode]["ours"].append({"steps": step_times(out), "timing": timing(err), "ranks": per_rank(timed, a.world)})
            timed = work / f"time-{mode}-torch-{i}"
            t = torch_step(a.world, mode, a.steps, data, work / "ref.safetensors", timed)
            t["ranks"] = per_rank(timed, a.world)
            runs[mode]["torch"].append(t)
    load_pairs_end = os.getloadavg()[0]

    # Load: resume the sharded checkpoint (read, cut to this rank's chunks, the loader state).
    loads = []
    for _ in range(3):
        err, _ = mpirun(a.world, train, ["--mode", "sharded", "--steps", str(a.steps), "--ckpt-dir", "sharded-sync",
                                         "--resume"], work)
        loads.append(float(re.search(r"resumed from .* in ([\d.]+)s", err).group(1)))
    resume_rss = timing(err)[2]
    size = sum(p.stat().st_size for p in (work / "sharded-sync/latest").resolve().rglob("*") if p.is_file())
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={a.world}", str(ROOT / "bench/train_dcp_torch.py"),
                        "--reference", str(work / "ref.safetensors"), "--out", str(work / "torch")],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"torch side failed:\n{p.stderr[-3000:]}")
    t = json.loads(p.stdout.strip().splitlines()[-1])
    load_end = os.getloadavg()[0]

    med = statistics.median
    ms = lambda s: f"{s * 1000:.1f} ms"
    mib = lambda kib: f"{kib / 1024:.0f}"
    kilo = lambda n: f"{n / 1000:.0f}k"
    out = ["# Training core (`statekit-train`)", "",
           f"{a.world} ranks on this machine's CPUs, one intra-op thread each, model `{' '.join(SIZE)}` (synthetic "
           f"corpus, f32, head tied to the token embedding), {a.steps} steps, release build. Checkpoint: "
           f"{size / 2**20:.1f} MiB (model + AdamW moments, f32). Produced by `bench/train_bench.py`; torch's step "
           "by `bench/train_step_torch.py` and its checkpoint side by `bench/train_dcp_torch.py`, under torchrun "
           "(gloo), in the same run.", "",
           "## Step time against torch on the same model", "",
           f"statekit-train (MPI ranks) and torch (torchrun, gloo) train the same model (torch's parameter names and "
           f"shapes are checked against this run's merged checkpoint) with the same AdamW (betas 0.9/0.95, eps "
           f"1e-8, weight decay 0.1), schedule and clip norm 1.0, {a.steps} steps each, run alternately "
           f"({a.pairs} pair(s) per mode; MPI's ranks unbound and given `OMP_NUM_THREADS=1`, as torchrun's "
           "are). "
           "A step is rank 0's wall time from one step's end to the next (statekit: "
           "its log lines' `elapsed_s`; torch: around data, forward, backward, clip, `AdamW.step` and the "
           "loss all-reduce); each run gives the median of its steps. Peak RSS and minor page faults are each "
           "rank's, from `/usr/bin/time -f '%R %M %U %S'` around it, as is its CPU time (user + system, the "
           "whole process: start-up, the steps, the exit).", "",
           "| mode | statekit step, each run | torch step, each run | statekit / torch (median of pair ratios) "
           "| peak RSS per rank, statekit / torch | minor page faults per rank, statekit / torch "
           "| CPU time per rank, statekit / torch |",
           "|---|---|---|---|---|---|---|"]
    for mode, r in runs.items():
        ours = [med(x["steps"]) for x in r["ours"]]
        theirs = [x["median_step_s"] for x in r["torch"]]
        ratios = [o / t for o, t in zip(ours, theirs)]
        rss = lambda xs: " + ".join(mib(med([x["ranks"][k][1] for x in xs])) for k in range(a.world))
        faults = lambda xs: " + ".join(kilo(med([x["ranks"][k][0] for x in xs])) for k in range(a.world))
        cpu = lambda xs: " + ".join(f"{med([x['ranks'][k][2] for x in xs]):.1f}" for k in range(a.world))
        out.append(f"| {mode} | {', '.join(ms(x) for x in ours)} | {', '.join(ms(x) for x in theirs)} | "
                   f"{med(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) | {rss(r['ours'])} / "
                   f"{rss(r['torch'])} MiB | {faults(r['ours'])} / {faults(r['torch'])} | {cpu(r['ours'])} / "
                   f"{cpu(r['torch'])} s |")
    out += ["", "RSS, faults and CPU time are medians over the runs, rank 0 + rank 1. Where the time goes, medians over the "
            "runs (statekit: its `timing:` line, means over a run's steps; torch: medians over a run's steps):", "",
            "| mode | side | step | data | forward + backward | collectives | optimizer and the rest |",
            "|---|---|---|---|---|---|---|"]
    for mode, r in runs.items():
        tm = [x["timing"][0] for x in r["ours"]]
        step, data_s, fb, coll = (med([x[k] for x in tm]) for k in range(4))
        out.append(f"| {mode} | statekit | {ms(step)} | {data_s * 1e6:.0f} µs | {ms(fb)} | {ms(coll)} (gradients "
                   f"to the host, {'all-reduce' if mode == 'ddp' else 'all-gather, reduce-scatter'}, the "
                   f"loss/norm all-reduce) | {ms(step - data_s - fb - coll)} (AdamW, parameters into the model) |")
        tr = r["torch"]
        step, data_s, fb, opt = (med([x[k] for x in tr]) for k in
                                 ("median_step_s", "median_data_s", "median_fwd_bwd_s", "median_opt_s"))
        how = ("DDP's bucketed all-reduce runs inside the backward pass" if mode == "ddp" else
               "FSDP2's all-gather and reduce-scatter run inside the forward and backward passes")
        out.append(f"| {mode} | torch | {ms(step)} | {data_s * 1e6:.0f} µs | {ms(fb)} | (included: {how}) | "
                   f"{ms(opt)} (`clip_grad_norm_`, `AdamW.step`, the loss all-reduce) |")
    state = {m: r["ours"][0]["timing"][1] for m, r in runs.items()}
    out += ["", "Parameters + moments per rank (statekit): " +
            ", ".join(f"{m} {s / 2**20:.1f} MiB" for m, s in state.items()) +
            f". torch's AdamW runs with `foreach`={runs['ddp']['torch'][0]['adamw']['foreach']}, "
            f"`fused`={runs['ddp']['torch'][0]['adamw']['fused']} (its default on CPU: the per-tensor loop).", ""]

    out += ["## Checkpoint save and load vs torch `dcp.save` / `dcp.load`", "",
            "| | statekit (`ckpt::save_sharded`, 2 DCP folders + JSON, fsynced, renamed) | torch `dcp.save`/`dcp.load` (accelerate's FSDP2 layout) |",
            "|---|---|---|"]
    s_ours = med(saves["sharded"])
    out.append(f"| save (median) | {ms(s_ours)} (ddp mode: {ms(med(saves['ddp']))}) | {ms(t['save_s'])} |")
    out.append(f"| load (median of 3) | {ms(med(loads))} (`--resume`: read, cut to the rank's rows, loader state) | {ms(t['load_s'])} |")
    out.append(f"| peak RSS per rank | {mib(resume_rss)} MiB (resume run, libtorch loaded) | "
               f"{', '.join(mib(r) for r in t['peak_rss_kib'])} MiB (torch imported) |")
    out += ["", "## `--async-save`", "",
            "| mode | synchronous save (median) | async stall (median) | stall / save |", "|---|---|---|---|"]
    for mode in ["ddp", "sharded"]:
        s, st = med(saves[mode]), med(stalls[mode])
        out.append(f"| {mode} | {ms(s)} | {ms(st)} | {100 * st / s:.1f}% |")
    out += ["", "Targets: data loading under 1% of step time; a save no slower than `dcp.save`; the async stall "
            "under 10% of a synchronous save.", "",
            f"The machine is shared with other work (2 cores). 1-minute load average: {load_start:.1f} at the start, "
            f"{load_pairs:.1f} and {load_pairs_end:.1f} at the start and end of the step-time pairs, {load_end:.1f} at "
            "the end. Save medians are over each run's "
            f"{len(saves['sharded'])} save(s), torch's `dcp` ones over 3 repeats."]
    old = ROOT / "bench/RESULTS-train.md"
    kept = old.read_text().split(KEEP, 1)[1] if old.exists() and KEEP in old.read_text() else "\n"
    old.write_text("\n".join(out) + "\n\n" + KEEP + kept)
    print("\n".join(out))
    json.dump({"runs": runs, "saves": saves, "stalls": stalls, "loads": loads,
               "load_avg": [load_start, load_pairs, load_pairs_end, load_end]},
              open(work / "train_bench.json", "w"), indent=1)


if __name__ == "__main__":
    main()
