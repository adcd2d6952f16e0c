"""Benchmark: merging a >= 2 GiB torch.distributed.checkpoint (DCP) checkpoint into one
safetensors file, `accelerate merge-weights` (the path users run today) against a Rust command.

    /opt/statekit-venv/bin/python bench/dcp_bench.py [--layers 22] [--repeats 1]
        [--rust "target/release/ckpt merge {src} {out}/model.safetensors"] [--write-results]

1. If missing, writes bench/work/dcp-L<layers>/pytorch_model_fsdp_0/ with real torch DCP from an
   FSDP2 model on 2 gloo ranks (bench/py/make_dcp_checkpoint.py; bf16; 22 layers = 2.24 GiB of
   parameters). bench/work/ is git-ignored: never commit it.
2. Times each command with `/usr/bin/time -v` (wall clock, peak RSS), after dropping the previous
   output; median wall over the repeats, largest peak RSS.
3. With --rust, also checks that the Rust output's tensors equal accelerate's bit for bit (and
   reports whether the files are byte-identical).
4. With --write-results, writes the table to bench/RESULTS-dcp.md.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "py"))
from digest import sha256_file  # noqa: E402
WORK = os.path.join(ROOT, "bench", "work")
BIN = os.path.dirname(sys.executable)


def checkpoint(layers):
    base = os.path.join(WORK, f"dcp-L{layers}")
    src = os.path.join(base, "pytorch_model_fsdp_0")
    if os.path.exists(os.path.join(src, ".metadata")):
        return src
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    print(f"writing {src} with torch DCP on 2 gloo ranks ...", flush=True)
    t = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2",
                    os.path.join(ROOT, "bench", "py", "make_dcp_checkpoint.py"), base, str(layers)],
                   check=True, env=env)
    print(f"  done in {time.time() - t:.0f} s", flush=True)
    return src


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def timed(cmd, out_dir):
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)  # an empty output directory for every run
    subprocess.run(["sync"])
    tfile = os.path.join(WORK, "time-dcp.txt")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(["/usr/bin/time", "-v", "-o", tfile, *cmd], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    text = open(tfile).read()
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", text).group(1)
    secs = 0.0
    for part in wall.split(":"):
        secs = secs * 60 + float(part)
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return secs, rss_kib


def measure(name, cmd, out_dir, repeats):
    walls, rss = [], 0
    for _ in range(repeats):
        w, r = timed(cmd, out_dir)
        walls.append(w)
        rss = max(rss, r)
    med = statistics.median(walls)
    print(f"{name:24s} median {med:8.2f} s   peak RSS {rss / 1024:9.1f} MiB", flush=True)
    return {"wall_s": med, "walls": walls, "peak_rss_mib": rss / 1024}


def same_bits(x, y):
    import torch

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rust", help="command template with {src} and {out} (an output directory)")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()

    os.makedirs(WORK, exist_ok=True)
    src = checkpoint(args.layers)
    size = dir_bytes(src)
    print(f"checkpoint: {src}, {size / 2**30:.2f} GiB in {len(os.listdir(src))} files", flush=True)

    results = {}
    acc_out = os.path.join(WORK, "dcp-out-accelerate")
    results["accelerate merge-weights"] = measure(
        "accelerate merge-weights", [os.path.join(BIN, "accelerate"), "merge-weights", src, acc_out], acc_out, args.repeats)
    acc_file = os.path.join(acc_out, "model.safetensors")
    acc_sha = sha256_file(acc_file)

    notes = [f"accelerate's output: {os.path.getsize(acc_file)} bytes, sha256 {acc_sha}"]
    if args.rust:
        rust_out = os.path.join(WORK, "dcp-out-rust")
        cmd = shlex.split(args.rust.format(src=src, out=rust_out))
        r = measure("rust", cmd, rust_out, args.repeats)
        results["rust: " + args.rust] = r
        produced = [os.path.join(rust_out, f) for f in os.listdir(rust_out) if f.endswith(".safetensors")] \
            if os.path.isdir(rust_out) else []
        if len(produced) == 1:
            from safetensors import safe_open

            same = True
            with safe_open(acc_file, "pt") as a, safe_open(produced[0], "pt") as b:
                if sorted(a.keys()) != sorted(b.keys()):
                    same = False
                else:
                    for k in a.keys():
                        x, y = a.get_tensor(k), b.get_tensor(k)
                        if not same_bits(x, y):
                            same = False
                            break
            notes.append(f"rust output tensors equal accelerate's bit for bit: {same}; "
                         f"file byte-identical: {sha256_file(produced[0]) == acc_sha}")
            r["ratio_vs_accelerate"] = r["wall_s"] / results["accelerate merge-weights"]["wall_s"]
        else:
            notes.append(f"rust output: expected one .safetensors in {rust_out}, found {produced}")
        shutil.rmtree(rust_out, ignore_errors=True)
    shutil.rmtree(acc_out, ignore_errors=True)

    import torch
    import accelerate

    lines = [
        "# DCP merge benchmark",
        "",
        f"Machine: {os.uname().machine}, {os.cpu_count()} CPU(s); torch {torch.__version__}, accelerate {accelerate.__version__}.",
        f"Checkpoint: accelerate FSDP layout (`pytorch_model_fsdp_0/`) written by real torch DCP from FSDP2 on 2 gloo ranks, "
        f"bf16, {args.layers} layers, {size / 2**30:.2f} GiB on disk. Generated by `bench/dcp_bench.py`; "
        f"{args.repeats} run(s) per command, `/usr/bin/time -v`.",
        "",
        "| command | median wall (s) | peak RSS (MiB) | time ratio vs accelerate |",
        "|---|---|---|---|",
    ]
    base = results["accelerate merge-weights"]["wall_s"]
    for name, r in results.items():
        lines.append(f"| `{name}` | {r['wall_s']:.2f} | {r['peak_rss_mib']:.1f} | {r['wall_s'] / base:.2f} |")
    for name, r in results.items():
        notes.append(f"`{name}` runs (s): {', '.join(f'{w:.2f}' for w in r['walls'])}")
    notes.append("Rerun with a Rust merge: `bench/dcp_bench.py --repeats 3 --write-results "
                 "--rust \"target/release/ckpt merge {src} {out}/model.safetensors\"` (the command template "
                 "gets the DCP dir and an empty output dir; the tensors are compared with accelerate's).")
    lines += [""] + [f"- {n}" for n in notes] + [""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(WORK, "dcp-results.json"), "w") as f:
        json.dump({"size_bytes": size, "results": results, "notes": notes}, f, indent=1)
    if args.write_results:
        with open(os.path.join(ROOT, "bench", "RESULTS-dcp.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
