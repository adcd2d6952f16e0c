"""accelerate `save_state` folders: `ckpt inspect` and `ckpt merge` against `accelerate
merge-weights` (the tool a user runs today) and a durable `cp -r` of the folder (the disk's limit).

    /opt/statekit-venv/bin/python bench/accelerate_state_bench.py [--layers 15] [--pairs 3] [--warmup 1]
        [--ckpt target/release/ckpt] [--warm-cache] [--no-write]

1. Generates (once, cached under bench/work/accelerate_state/, git-ignored) a real accelerate 1.x
   `Accelerator.save_state(DIR)` folder from FSDP2 + SHARDED_STATE_DICT on 2 CPU ranks (torchrun,
   gloo): a stack of LAYERS Linear(4096, 4096) layers (15 = 252M fp32 parameters, 1.0 GB), one
   SGD step without momentum (so `optimizer_0/` exists but holds no per-parameter state and the
   folder stays ~1 GB). accelerate refuses FSDP on CPU by itself; the MULTI_CPU Accelerator's
   shared state is switched to FSDP with an FSDP2 plugin the way `AcceleratorState.__init__` does
   it (`make_accelerator` of fixtures/gen/accelerate_fsdp2_worker.py), so `prepare()` runs real
   `fully_shard` and `save_state()` runs accelerate's own `save_fsdp_model` / `save_fsdp_optimizer`.
2. Times, alternated in rounds after a warm-up round: `ckpt inspect DIR` / `ckpt inspect --json
   DIR` (pairs), then `ckpt merge DIR OUT/model.safetensors` / `accelerate merge-weights
   DIR/pytorch_model_fsdp_0 OUT2` / a durable `cp -r` of the folder (one `cp -r`, then an fsync of
   every copied file with `sync FILE...`). Every run gets a fresh output folder and a `sync`; as
   root the page cache is dropped before each run (cold cache) unless --warm-cache, which reads
   the folder before each run instead. Wall time is taken around the process, peak RSS from
   `/usr/bin/time -v`.
3. Checks once that ckpt's and accelerate's outputs are byte-identical (else tensor-identical),
   and writes bench/RESULTS-accelerate-state.md.
"""

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORK = os.path.join(HERE, "work", "accelerate_state")
sys.path.insert(0, os.path.join(HERE, "py"))
import timing  # noqa: E402
from digest import sha256_file  # noqa: E402
PY = sys.executable
BIN = os.path.dirname(PY)
WIDTH = 4096


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the input (torchrun worker)


def worker(out, layers):
    """One rank: FSDP2 via accelerate on CPU, one SGD step, `save_state(out)`."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "fixtures", "gen"))
    from accelerate_fsdp2_worker import finish, make_accelerator
    from accelerate.utils import set_seed

    acc = make_accelerator()
    set_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.0)  # no per-parameter state
    model, optim = acc.prepare(model, optim)
    x = torch.randn(2, WIDTH)
    loss = model(x).pow(2).mean()
    acc.backward(loss)
    optim.step()
    optim.zero_grad()
    acc.save_state(out)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
    finish(0)


def generate(layers):
    path = os.path.join(WORK, f"state-L{layers}")
    if os.path.exists(os.path.join(path, "pytorch_model_fsdp_0", ".metadata")):
        return path
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"writing {path} with accelerate save_state (FSDP2, 2 gloo ranks) ...")
    t = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "2", __file__,
                    "--worker", tmp, "--layers", str(layers)], check=True, env=env)
    os.rename(tmp, path)
    log(f"  done in {time.time() - t:.0f} s")
    return path


# ---------------------------------------------------------------- timing


def files_under(d):
    return sorted(p for p in glob.glob(os.path.join(d, "**"), recursive=True) if os.path.isfile(p))


def tree_bytes(d):
    return sum(os.path.getsize(p) for p in files_under(d))


def prepare_cache(src, cold):
    subprocess.run(["sync"], check=True)
    if cold:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    else:
        for p in files_under(src):
            with open(p, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def timed(cmd, out, src, cold):
    if out:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
    prepare_cache(src, cold)
    wall, rss = timing.timed(list(cmd), WORK)
    return wall, rss / (1 << 20)


def rounds(cmds, src, pairs, warmup, cold):
    """cmds: name -> (argv, output folder or None). Runs them in turn, round after round."""
    res = {n: {"walls": [], "rss": []} for n in cmds}
    for i in range(warmup + pairs):
        tag = "warm-up" if i < warmup else f"round {i - warmup + 1}"
        parts = []
        for name, (argv, out) in cmds.items():
            w, r = timed(argv, out, src, cold)
            parts.append(f"{name} {w:.2f} s {r:.0f} MiB")
            if i >= warmup:
                res[name]["walls"].append(w)
                res[name]["rss"].append(r)
        log(f"{tag:8s} " + " | ".join(parts))
    for r in res.values():
        r["median"] = statistics.median(r["walls"])
        r["max_rss"] = max(r["rss"])
    return res


def tensors_equal(a_file, b_file):
    import torch
    from safetensors import safe_open

    with safe_open(a_file, "pt") as a, safe_open(b_file, "pt") as b:
        if sorted(a.keys()) != sorted(b.keys()):
            return False
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                    x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
    return True


def loadavg():
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--warm-cache", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", metavar="OUT")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.layers)
        return

    load_start = loadavg()
    os.makedirs(WORK, exist_ok=True)
    src = generate(args.layers)
    cold = not args.warm_cache and os.geteuid() == 0
    listing = {os.path.relpath(p, src): os.path.getsize(p) for p in files_under(src)}
    size = sum(listing.values())
    model_dir = os.path.join(src, "pytorch_model_fsdp_0")
    log(f"input: {src}, {size / 2**30:.2f} GiB in {len(listing)} files; "
        f"{'cold' if cold else 'warm'} cache; load {load_start}")

    ck = args.ckpt
    insp = rounds({
        "ckpt inspect": ([ck, "inspect", src], None),
        "ckpt inspect --json": ([ck, "inspect", "--json", src], None),
    }, src, args.pairs, args.warmup, cold)

    out_ck = os.path.join(WORK, "out-ckpt")
    out_acc = os.path.join(WORK, "out-accelerate")
    out_cp = os.path.join(WORK, "out-cp")
    cp_cmd = ["bash", "-c", 'cp -r -- "$1" "$2"/copy && find "$2"/copy -type f -exec sync -- {} +',
              "durable-cp", src, out_cp]
    merge = rounds({
        "ckpt merge": ([ck, "--quiet", "merge", src, os.path.join(out_ck, "model.safetensors")], out_ck),
        "accelerate merge-weights": ([os.path.join(BIN, "accelerate"), "merge-weights", model_dir, out_acc], out_acc),
        "durable cp -r": (cp_cmd, out_cp),
    }, src, args.pairs, args.warmup, cold)

    a_file = os.path.join(out_ck, "model.safetensors")
    b_file = os.path.join(out_acc, "model.safetensors")
    byte_same = sha256_file(a_file) == sha256_file(b_file)
    tensor_same = byte_same or tensors_equal(a_file, b_file)
    out_size = os.path.getsize(a_file)
    # The listing, cut to the totals, the first tensor rows and the component summary.
    inspect_text = subprocess.run([ck, "inspect", os.path.relpath(src, ROOT)], capture_output=True,
                                  text=True, check=True, cwd=ROOT).stdout
    head, _, summary = inspect_text.partition("\naccelerate save_state")
    rows = head.rstrip().splitlines()
    cut = next(i for i, l in enumerate(rows) if l.startswith("NAME")) + 5
    inspect_text = "\n".join(rows[:cut] + (["..."] if len(rows) > cut else [])) + \
        "\n\naccelerate save_state" + summary
    for d in (out_ck, out_acc, out_cp):
        shutil.rmtree(d, ignore_errors=True)
    load_end = loadavg()

    import accelerate
    import torch

    m = merge
    ck_m, acc_m, cp_m = m["ckpt merge"], m["accelerate merge-weights"], m["durable cp -r"]
    n = len(ck_m["walls"])
    pair_vs_acc = statistics.median(ck_m["walls"][i] / acc_m["walls"][i] for i in range(n))
    pair_vs_cp = statistics.median(ck_m["walls"][i] / cp_m["walls"][i] for i in range(n))
    comps = sorted({p.split("/")[0] for p in listing})
    lines = [
        "# accelerate save_state folders: inspect and merge",
        "",
        f"Input: a real accelerate {accelerate.__version__} `Accelerator.save_state(DIR)` folder (torch {torch.__version__}), "
        f"FSDP2 + SHARDED_STATE_DICT on 2 CPU ranks (torchrun, gloo; a MULTI_CPU Accelerator whose shared state is "
        f"switched to FSDP with an FSDP2 plugin, so `prepare()` runs real `fully_shard` and `save_state()` accelerate's "
        f"own `save_fsdp_model` / `save_fsdp_optimizer`). Model: {args.layers} x `Linear({WIDTH}, {WIDTH})`, "
        f"{args.layers * (WIDTH * WIDTH + WIDTH) / 1e6:.0f}M fp32 parameters; one SGD step without momentum, so "
        f"`optimizer_0/` holds only the param groups (AdamW's two moments would triple the folder). "
        f"{size / 2**30:.2f} GiB in {len(listing)} files: {', '.join(f'`{c}`' for c in comps)}. "
        f"Generated once by `bench/accelerate_state_bench.py` under bench/work/ (not committed).",
        "",
        f"Machine: {platform.machine()}, nproc {os.cpu_count()}, shared with other builds; load average "
        f"(1/5/15 min) {load_start} at start, {load_end} at end. "
        + ("Cold cache: `sync; echo 3 > /proc/sys/vm/drop_caches` before every run. " if cold else
           "Warm cache: every file of the folder is read before every run. ")
        + f"After {args.warmup} warm-up round, {args.pairs} rounds, each running the commands of a group in turn "
        "(A, B, C, A, B, C, ...); median wall (around the process), largest peak RSS (`/usr/bin/time -v`). "
        "Each run writes into a fresh, empty folder after a `sync`.",
        "",
        "| command | median wall (s) | peak RSS (MiB) | wall vs accelerate merge-weights | wall vs durable cp -r |",
        "|---|---|---|---|---|",
    ]
    for name, r in insp.items():
        lines.append(f"| `{name} DIR` | {r['median']:.3f} | {r['max_rss']:.1f} | | |")
    cmd_names = {
        "ckpt merge": "ckpt merge DIR OUT/model.safetensors",
        "accelerate merge-weights": "accelerate merge-weights DIR/pytorch_model_fsdp_0 OUT",
        "durable cp -r": "cp -r DIR OUT && sync each file",
    }
    for name, r in m.items():
        lines.append(f"| `{cmd_names[name]}` | {r['median']:.2f} | {r['max_rss']:.1f} | "
                     f"{r['median'] / acc_m['median']:.2f} | {r['median'] / cp_m['median']:.2f} |")
    lines += [
        "",
        f"- ckpt merge vs accelerate merge-weights: {ck_m['median'] / acc_m['median']:.2f}x the wall "
        f"(median of per-round ratios {pair_vs_acc:.2f}), {ck_m['max_rss']:.0f} MiB peak RSS vs {acc_m['max_rss']:.0f} MiB "
        f"({ck_m['max_rss'] / acc_m['max_rss']:.3f}x).",
        f"- ckpt merge vs durable cp -r of the folder: {ck_m['median'] / cp_m['median']:.2f}x "
        f"(median of per-round ratios {pair_vs_cp:.2f}). The cp copies the whole folder ({size / 2**30:.2f} GiB); "
        f"the merge writes {out_size / 2**30:.2f} GiB.",
        f"- Outputs: `model.safetensors` of {out_size} bytes; ckpt's and accelerate's are "
        + ("byte-identical (SHA-256)." if byte_same else
           ("tensor-identical (same names, dtypes, shapes, bytes) but not byte-identical." if tensor_same else "DIFFERENT.")),
        "- Caveats: one machine, 2 shared cores (see the load averages), a fast virtual disk (the cold-cache "
        "durable cp moves the folder at over 1 GB/s), so sub-second walls carry scheduling noise; "
        "accelerate merge-weights' wall includes importing torch and accelerate (a few seconds of its time, "
        "and part of its RSS), which is what a user pays for the command. The folder's `optimizer_0/` is "
        "near-empty (SGD without momentum), so neither merge is timed on optimizer state.",
    ]
    for name, r in list(insp.items()) + list(m.items()):
        lines.append(f"- `{name}` runs (s): {', '.join(f'{w:.2f}' for w in r['walls'])}")
    lines += ["", "`ckpt inspect DIR` on this folder (tensor rows cut after the first four):", "", "```", inspect_text.rstrip(), "```", ""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(WORK, "results.json"), "w") as f:
        json.dump({"inspect": insp, "merge": m, "size": size, "files": listing}, f, indent=1)
    if not tensor_same:
        raise SystemExit("ckpt merge and accelerate merge-weights outputs differ")
    if not args.no_write:
        with open(os.path.join(HERE, "RESULTS-accelerate-state.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
