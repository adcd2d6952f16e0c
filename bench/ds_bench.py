"""DeepSpeed ZeRO-3 merge benchmark: `zero_to_fp32.py` (and `ckpt merge` when given) on a
checkpoint of at least 2 GiB, timed with /usr/bin/time -v (wall clock, peak RSS).

    /opt/statekit-venv/bin/python bench/ds_bench.py [--gib 2.2] [--repeats 1] [--ckpt target/release/ckpt]

1. Generates (once, cached under bench/work/deepspeed/, never committed) a ZeRO-3 fp32
   checkpoint on 2 CPU ranks with real DeepSpeed: a stack of Linear layers built under
   deepspeed.zero.Init (so no rank ever holds the full model), one AdamW step, then
   engine.save_checkpoint. Sizes are odd on purpose (padding on the last rank). The model is
   untied, so zero_to_fp32 --safe_serialization works on it.
2. Times `python -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization` and, with
   --ckpt, `ckpt merge CKPT OUT.safetensors`, checks that both outputs hold the same tensors,
   and writes the table to bench/RESULTS-deepspeed.md.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "py"))
import timing  # noqa: E402

WORK = os.path.join(HERE, "work", "deepspeed")
PY = sys.executable

WIDTH = 4093  # odd: every Linear weight is 4093 x 4093 (+ bias 4093), not divisible by 2


def layers_for(gib: float) -> int:
    # optim files hold fp32 master + exp_avg + exp_avg_sq = 12 bytes per param
    per_layer = WIDTH * WIDTH + WIDTH
    return max(1, int(-(-gib * 2**30 // (12 * per_layer))))


def worker(args):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 100000,
    }
    n = layers_for(args.gib)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randn(1, WIDTH)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out)
    torch.distributed.barrier()


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(cmd, env=None):
    return timing.timed(cmd, WORK, env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ckpt", help="a ckpt binary whose `merge` reads DeepSpeed dirs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(PY) + os.pathsep + env.get("PATH", "")
    ck = os.path.join(WORK, f"zero3-{args.gib}GiB")
    os.makedirs(WORK, exist_ok=True)
    if not os.path.exists(os.path.join(ck, "latest")):
        shutil.rmtree(ck, ignore_errors=True)
        print(f"generating {ck} ({layers_for(args.gib)} layers of {WIDTH}x{WIDTH}) ...", flush=True)
        gen_wall, gen_rss = timed([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                   os.path.abspath(__file__), "--worker", "--gib", str(args.gib), "--out", ck], env=env)
        print(f"  generated in {gen_wall:.0f} s", flush=True)
    for extra in ("zero_to_fp32.py", "zero_to_torch.py"):
        if os.path.exists(os.path.join(ck, extra)):
            os.remove(os.path.join(ck, extra))
    size = dir_bytes(ck)
    rows = []
    ref_out = os.path.join(WORK, "out-zero_to_fp32")
    for _ in range(args.repeats):
        shutil.rmtree(ref_out, ignore_errors=True)
        subprocess.run(["sync"])
        rows.append(("zero_to_fp32.py --safe_serialization",) + timed(
            [PY, "-m", "deepspeed.utils.zero_to_fp32", ck, ref_out, "--safe_serialization"], env=env))
    if args.ckpt:
        out = os.path.join(WORK, "out-ckpt.safetensors")
        for _ in range(args.repeats):
            if os.path.exists(out):
                os.remove(out)
            subprocess.run(["sync"])
            rows.append(("ckpt merge",) + timed([args.ckpt, "merge", ck, out], env=env))
        from safetensors.torch import load_file
        import glob
        want = {}
        for f in sorted(glob.glob(os.path.join(ref_out, "*.safetensors"))):
            want.update(load_file(f))
        got = load_file(out)
        same = set(got) == set(want) and all(got[k].equal(want[k]) for k in want)
        print(f"ckpt merge output equal to zero_to_fp32's: {same}")
    best = {}
    for name, wall, rss in rows:
        w, r = best.get(name, (float("inf"), 0))
        best[name] = (min(w, wall), max(r, rss))
    ref_wall, ref_rss = best["zero_to_fp32.py --safe_serialization"]
    lines = [
        "# DeepSpeed ZeRO-3 merge benchmark",
        "",
        f"Checkpoint: `{os.path.relpath(ck, ROOT)}`, {size / 2**30:.2f} GiB on disk, 2 ranks, fp32, "
        f"{layers_for(args.gib)} x Linear({WIDTH}, {WIDTH}); generated by `bench/ds_bench.py` with "
        f"DeepSpeed {__import__('deepspeed').__version__} on CPU.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Best wall of {args.repeats}, largest peak RSS "
        "(`/usr/bin/time -v`).",
        "",
        "| command | wall (s) | peak RSS (MiB) | time vs zero_to_fp32 | RSS vs zero_to_fp32 |",
        "|---|---|---|---|---|",
    ]
    for name, (wall, rss) in best.items():
        lines.append(f"| {name} | {wall:.1f} | {rss / 2**20:.0f} | {wall / ref_wall:.2f} | {rss / ref_rss:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(HERE, "RESULTS-deepspeed.md"), "w") as f:
        f.write(text)
    with open(os.path.join(WORK, "results.json"), "w") as f:
        json.dump({"bytes": size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
