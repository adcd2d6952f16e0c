"""Block-scaled FP8 dequantize benchmark: `ckpt convert --dequantize bf16` against the torch
loop users run today (load each shard, multiply each FP8 weight by its block scales, narrow to
bf16, `save_file`), timed with /usr/bin/time -v (wall clock, peak RSS) in the same run.

    /opt/statekit-venv/bin/python bench/fp8_bench.py [--gib 1.0] [--repeats 1] [--ckpt target/release/ckpt]

1. Generates (once, cached under bench/work/fp8/, never committed) a block-scaled checkpoint
   of about GIB GiB of FP8 weights with torch: Linear weights of 8000 x 8100 (partial 128-blocks
   at both edges) as F8_E4M3 with an F32 `weight_scale_inv`, sharded by huggingface_hub.
2. Times the torch loop (`--torch-loop`, this file) and `ckpt convert SRC OUT --dequantize
   bf16`, checks that both outputs hold the same bytes, and writes bench/RESULTS-accelerate.md.
"""

import argparse
import glob
import hashlib
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

WORK = os.path.join(HERE, "work", "fp8")
PY = sys.executable
ROWS, COLS, BLOCK = 8000, 8100, 128


def generate(path, gib):
    import torch
    from huggingface_hub import save_torch_state_dict

    n = max(1, round(gib * 2**30 / (ROWS * COLS)))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(n):
        w = torch.randint(0, 256, (ROWS, COLS), generator=g, dtype=torch.uint8)
        w[(w & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        sd[f"model.layers.{i}.mlp.weight"] = w.view(torch.float8_e4m3fn)
        rb, cb = -(-ROWS // BLOCK), -(-COLS // BLOCK)
        sd[f"model.layers.{i}.mlp.weight_scale_inv"] = torch.rand(rb, cb, generator=g) * 1e-3
        sd[f"model.layers.{i}.norm.weight"] = torch.ones(COLS, dtype=torch.bfloat16)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_torch_state_dict(sd, tmp, max_shard_size="400MB")
    os.rename(tmp, path)


def torch_loop(src, out):
    """What users run today: per shard, load, dequantize each FP8 weight, save_file."""
    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    scales = {k: f for k, f in index["weight_map"].items() if k.endswith("_scale_inv")}
    weight_map = {}
    for f in sorted(set(index["weight_map"].values())):
        sd = load_file(os.path.join(src, f))
        res = {}
        for k, v in sd.items():
            if k.endswith("_scale_inv"):
                continue
            if v.dtype == torch.float8_e4m3fn:
                sk = k + "_scale_inv"
                s = sd[sk] if sk in sd else load_file(os.path.join(src, scales[sk]))[sk]
                r, c = v.shape
                full = s.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
                v = (v.to(torch.float32) * full).to(torch.bfloat16)
            res[k] = v
            weight_map[k] = f
        save_file(res, os.path.join(out, f), metadata={"format": "pt"})
    total = sum(os.path.getsize(os.path.join(out, f)) for f in set(weight_map.values()))
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=2)


def timed(cmd):
    return timing.timed(cmd, WORK)


def digest(out):
    """SHA-256 of every tensor's bytes, by name, whatever the shard layout."""
    from safetensors import safe_open

    sums = {}
    for f in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                sums[k] = (str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest())
    return sums


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--torch-loop", nargs=2, metavar=("SRC", "OUT"))
    args = ap.parse_args()
    if args.torch_loop:
        torch_loop(*args.torch_loop)
        return
    os.makedirs(WORK, exist_ok=True)
    src = os.path.join(WORK, f"blockscaled-{args.gib}GiB")
    if not os.path.isdir(src):
        generate(src, args.gib)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(src, "*")))
    rows = []
    sums = {}
    for name, cmd in [
        ("torch loop (load_file, multiply, save_file)", [PY, __file__, "--torch-loop", src, "{out}"]),
        ("ckpt convert --dequantize bf16", [args.ckpt, "convert", "-q", src, "{out}", "--dequantize", "bf16", "--max-shard-size", "400MB"]),
    ]:
        best_wall, peak = None, 0
        for _ in range(args.repeats):
            out = os.path.join(WORK, "out")
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"])
            wall, rss = timed([c.replace("{out}", out) for c in cmd])
            best_wall = wall if best_wall is None else min(best_wall, wall)
            peak = max(peak, rss)
        sums[name] = digest(out)
        shutil.rmtree(out, ignore_errors=True)
        rows.append((name, best_wall, peak))
        print(f"{name}: {best_wall:.2f} s, {peak / 2**20:.0f} MiB", file=sys.stderr)
    a, b = sums.values()
    if a != b:
        raise SystemExit("the outputs differ")
    base_wall, base_rss = rows[0][1], rows[0][2]
    lines = [
        "# accelerate 1.x and FP8: block-scaled FP8 dequantize benchmark",
        "",
        f"Checkpoint: `{os.path.relpath(src, ROOT)}`, {size / 2**30:.2f} GiB on disk, FP8 (F8_E4M3) Linear weights "
        f"of {ROWS} x {COLS} with F32 scales per {BLOCK}x{BLOCK} block, sharded at 400 MB; generated by `bench/fp8_bench.py` with torch.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Best wall of {args.repeats}, largest peak RSS (`/usr/bin/time -v`). "
        "Both outputs checked equal, tensor by tensor (SHA-256 of the bytes).",
        "",
        "| command | wall (s) | peak RSS (MiB) | time vs torch loop | RSS vs torch loop |",
        "|---|---|---|---|---|",
    ]
    for name, wall, rss in rows:
        lines.append(f"| {name} | {wall:.1f} | {rss / 2**20:.0f} | {wall / base_wall:.2f} | {rss / base_rss:.2f} |")
    with open(os.path.join(HERE, "RESULTS-accelerate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
