"""`statekit-train` benchmark: step time and its breakdown (data, forward/backward,
collectives, checkpoint stall) in both modes; checkpoint save and load time and peak RSS per
rank against torch's `dcp.save`/`dcp.load` of the same state under torchrun (gloo, same world
size); the `--async-save` stall against a synchronous save. Writes bench/RESULTS-train.md.

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


def mpirun(world, train, args, cwd):
    env = dict(os.environ, LD_LIBRARY_PATH=f"{TORCH_LIB}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    cmd = ["mpirun", "--oversubscribe", "-np", str(world)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    p = subprocess.run(cmd + [train, *SIZE, *args], cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"statekit-train failed:\n{p.stderr[-3000:]}")
    return p.stderr


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
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    work = ROOT / "bench/work/train"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = os.path.abspath(a.train)
    rows, saves, stalls = {}, {}, {}
    for mode in ["ddp", "sharded"]:
        base = ["--mode", mode, "--steps", str(a.steps)]
        # Step time without checkpoints, then with a synchronous and an asynchronous save every 5.
        rows[mode] = timing(mpirun(a.world, train, base, work))
        err = mpirun(a.world, train, base + ["--save-every", "5", "--ckpt-dir", f"{mode}-sync"], work)
        saves[mode] = [float(x) for x in re.findall(r"saved in ([\d.]+)s", err)]
        err = mpirun(a.world, train, base + ["--save-every", "5", "--ckpt-dir", f"{mode}-async", "--async-save"], work)
        stalls[mode] = [float(x) for x in re.findall(r"stall ([\d.]+)s\)", err)]
    # Load: resume the sharded checkpoint (read, cut to this rank's chunks, the loader state).
    loads = []
    for _ in range(3):
        err = mpirun(a.world, train, ["--mode", "sharded", "--steps", str(a.steps), "--ckpt-dir", "sharded-sync",
                                      "--resume"], work)
        loads.append(float(re.search(r"resumed from .* in ([\d.]+)s", err).group(1)))
    resume_rss = timing(err)[2]
    subprocess.run([a.ckpt, "merge", str(work / "sharded-sync/latest"), str(work / "ref.safetensors")], check=True,
                   capture_output=True)
    size = sum(p.stat().st_size for p in (work / "sharded-sync/latest").resolve().rglob("*") if p.is_file())
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={a.world}", str(ROOT / "bench/train_dcp_torch.py"),
                        "--reference", str(work / "ref.safetensors"), "--out", str(work / "torch")],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"torch side failed:\n{p.stderr[-3000:]}")
    t = json.loads(p.stdout.strip().splitlines()[-1])

    ms = lambda s: f"{s * 1000:.1f} ms"
    out = ["# Training core (`statekit-train`)", "",
           f"{a.world} MPI ranks on this machine's CPUs, model `{' '.join(SIZE)}` (synthetic corpus), {a.steps} steps, "
           f"release build. Checkpoint: {size / 2**20:.1f} MiB (model + AdamW moments, f32). Produced by "
           "`bench/train_bench.py`; torch's side by `bench/train_dcp_torch.py` under torchrun (gloo) in the same run.",
           "", "## Step time", "",
           "| mode | step | data | forward/backward | collectives | data share | params + moments per rank | peak RSS per rank |",
           "|---|---|---|---|---|---|---|---|"]
    for mode, ((step, data, fb, coll), state, rss) in rows.items():
        out.append(f"| {mode} | {ms(step)} | {data * 1e6:.0f} µs | {ms(fb)} | {ms(coll)} | {100 * data / step:.3f}% | "
                   f"{state / 2**20:.1f} MiB | {rss / 1024:.0f} MiB |")
    out += ["", "## Checkpoint save and load vs torch `dcp.save` / `dcp.load`", "",
            "| | statekit (`ckpt::save_sharded`, 2 DCP folders + JSON, fsynced, renamed) | torch `dcp.save`/`dcp.load` (accelerate's FSDP2 layout) |",
            "|---|---|---|"]
    s_ours = statistics.median(saves["sharded"])
    out.append(f"| save (median) | {ms(s_ours)} (ddp mode: {ms(statistics.median(saves['ddp']))}) | {ms(t['save_s'])} |")
    out.append(f"| load (median of 3) | {ms(statistics.median(loads))} (`--resume`: read, cut to the rank's rows, loader state) | {ms(t['load_s'])} |")
    out.append(f"| peak RSS per rank | {resume_rss / 1024:.0f} MiB (resume run, libtorch loaded) | "
               f"{', '.join(f'{r / 1024:.0f}' for r in t['peak_rss_kib'])} MiB (torch imported) |")
    out += ["", "## `--async-save`", "",
            "| mode | synchronous save (median) | async stall (median) | stall / save |", "|---|---|---|---|"]
    for mode in ["ddp", "sharded"]:
        s, st = statistics.median(saves[mode]), statistics.median(stalls[mode])
        out.append(f"| {mode} | {ms(s)} | {ms(st)} | {100 * st / s:.1f}% |")
    out += ["", "Targets: data loading under 1% of step time; a save no slower than `dcp.save`; the async stall "
            "under 10% of a synchronous save.", "",
            f"The machine is shared (1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at "
            "the end, on 2 cores), so single timings swing by 2x between runs: the ddp and sharded saves write the "
            "same bytes per rank and differ here only by that noise. Save medians are over the run's 4 saves, "
            "torch's over 3 repeats."]
    (ROOT / "bench/RESULTS-train.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
