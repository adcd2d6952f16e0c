"""`hf://` benchmark: ckpt against huggingface_hub on the same local Hub (tests/hub/server.py),
the same many-shard model, each client in a fresh cache.

    /opt/statekit-venv/bin/python bench/hub.py [--ckpt target/release/ckpt] [--shards 50]
        [--shard-mb 6] [--delay 0] [--download "merge {address} {out}/model.safetensors"]
        [--write-results]

1. Generates (once, under bench/work/hub/, never committed) a model of SHARDS safetensors shards
   of about SHARD_MB MB each with torch and huggingface_hub's save_torch_state_dict
   (tests/hub/make_repos.py's `many_shards`), and serves it with the test Hub.
2. Remote inspect: `ckpt inspect hf://ORG/NAME --json` against huggingface_hub's
   `get_safetensors_metadata`: wall time and peak RSS of each process, and from the server's
   log the requests and the bytes served; both tensor lists checked equal.
3. Download: `ckpt DOWNLOAD` (by default a merge, which downloads every shard and then writes the
   merged file; `--download` names another command, `{address}` and `{out}` filled in) against
   `snapshot_download` of the same files (the shards and the index): wall time, peak RSS, bytes
   served and MB/s of model bytes; both caches checked to hold the same snapshot (same paths,
   link targets and blob bytes).

Both clients talk to one Python server on 127.0.0.1, so the numbers measure the clients' request
patterns and the server's pace, not a network; `--delay S` makes the server sleep S seconds
before each 64 KiB it sends, a stand-in for a far server's latency. Prints a markdown table;
`--write-results` also writes bench/RESULTS-hub.md.
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "py"))
sys.path.insert(0, os.path.join(ROOT, "tests", "hub"))
import timing
from harness import ORG, HubServer, client_env

WORK = os.path.join(HERE, "work", "hub")
PY = sys.executable


def client(mode, repo):
    """The huggingface_hub side, run in its own process under the bench's environment (the
    library reads HF_ENDPOINT and HF_HUB_CACHE when imported); prints the call's own seconds."""
    from huggingface_hub import get_safetensors_metadata, snapshot_download

    t0 = time.perf_counter()
    if mode == "inspect":
        m = get_safetensors_metadata(repo)
        out = {t: [i.dtype, i.shape] for fm in m.files_metadata.values() for t, i in fm.tensors.items()}
    else:
        # The files a merge reads (the shards and their index), not config.json.
        out = snapshot_download(repo, allow_patterns=["*.safetensors", "*.safetensors.index.json"])
    print(json.dumps({"seconds": time.perf_counter() - t0, "result": out}))


def served(entries):
    return len(entries), sum(e["bytes"] for e in entries)


def snapshot_of(cache, name):
    """{path in snapshot: (link target, SHA-256 of the blob)} of a cache's one snapshot of `name`."""
    snaps = os.path.join(cache, f"models--{ORG}--{name}", "snapshots")
    (commit,) = os.listdir(snaps)
    out = {}
    for dirpath, _, files in os.walk(os.path.join(snaps, commit)):
        for f in files:
            p = os.path.join(dirpath, f)
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
            out[os.path.relpath(p, os.path.join(snaps, commit))] = (os.readlink(p), h.hexdigest())
    return out


def fresh(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def run(hub, cmd, cache, env_extra=None):
    """Runs `cmd` against `hub` in the fresh cache `cache`: (wall, peak RSS, log entries, stdout)."""
    env = client_env(hub, fresh(cache), fresh(os.path.join(WORK, "home")), **(env_extra or {}))
    before = len(hub.log())
    out = os.path.join(WORK, "stdout.txt")
    wall, rss = timing.timed(["sh", "-c", 'exec "$@" > "$0"', out, *cmd], WORK, env=env)
    with open(out) as f:
        text = f.read()
    return wall, rss, hub.log()[before:], text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=os.path.join(ROOT, "target", "release", "ckpt"))
    ap.add_argument("--shards", type=int, default=50)
    ap.add_argument("--shard-mb", type=float, default=6.0)
    ap.add_argument("--delay", type=float, default=0.0, help="server seconds before each 64 KiB sent")
    ap.add_argument("--download", default="merge {address} {out}/model.safetensors",
                    help="the ckpt arguments that download the model ({address}, {out} filled in)")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--client", nargs=2, metavar=("MODE", "REPO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client(*args.client)
    if not os.path.exists(args.ckpt):
        sys.exit(f"bench/hub.py: no ckpt binary at {args.ckpt} (cargo build --release -p statekit-cli)")

    from make_repos import many_shards

    os.makedirs(WORK, exist_ok=True)
    root = os.path.join(WORK, "root")
    name = f"many{args.shards}x{args.shard_mb:g}mb"
    model = many_shards(root, name, args.shards, int(args.shard_mb * 1e6))
    model_bytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if ".safetensors" in f)
    repo = f"{ORG}/{name}"
    address = f"hf://{repo}"
    rows = []
    with HubServer(root, log=os.path.join(WORK, "server-log.jsonl")) as hub:
        hub.commit(name)  # the server hashes the files once, before anything is timed
        if args.delay:
            hub.control(delay=args.delay)

        # 1. Remote inspect.
        wall, rss, log, out = run(hub, [args.ckpt, "inspect", address, "--json"], os.path.join(WORK, "cache-ckpt"))
        ours = {t["name"]: [t["dtype"], t["shape"]] for t in json.loads(out)["tensors"]}
        ckpt_cached = sum(len(fs) for _, _, fs in os.walk(os.path.join(WORK, "cache-ckpt")))
        rows.append(("remote inspect", f"`ckpt inspect {address} --json`", wall, rss, *served(log), None))
        wall, rss, log, out = run(hub, [PY, __file__, "--client", "inspect", repo], os.path.join(WORK, "cache-hf"))
        theirs = json.loads(out)
        rows.append(("remote inspect", "huggingface_hub `get_safetensors_metadata`", wall, rss, *served(log),
                     theirs["seconds"]))
        if ours != theirs["result"]:
            sys.exit("bench/hub.py: ckpt and huggingface_hub list different tensors")

        # 2. Download.
        out_dir = fresh(os.path.join(WORK, "out"))
        cmd = [args.ckpt, *[a.format(address=address, out=out_dir) for a in args.download.split()]]
        wall, rss, log, _ = run(hub, cmd, os.path.join(WORK, "cache-ckpt"))
        rows.append(("download", f"`ckpt {args.download.split()[0]} {address} …`", wall, rss, *served(log), None))
        ours = snapshot_of(os.path.join(WORK, "cache-ckpt"), name)
        wall, rss, log, out = run(hub, [PY, __file__, "--client", "download", repo], os.path.join(WORK, "cache-hf"))
        rows.append(("download", "huggingface_hub `snapshot_download`", wall, rss, *served(log),
                     json.loads(out)["seconds"]))
        theirs = snapshot_of(os.path.join(WORK, "cache-hf"), name)
        if ours != theirs:
            sys.exit("bench/hub.py: the two caches hold different snapshots")
        hub.control()
    for d in ("cache-ckpt", "cache-hf", "out", "home"):
        shutil.rmtree(os.path.join(WORK, d), ignore_errors=True)

    lines = [
        "# `hf://`: remote inspect and download against huggingface_hub",
        "",
        (f"Model: {args.shards} safetensors shards, {model_bytes / 1e6:.0f} MB in all (float32 and bfloat16, "
        "written by huggingface_hub's `save_torch_state_dict`), served by the test Hub (`tests/hub/server.py`, "
        f"one Python process on 127.0.0.1{f', {args.delay} s before each 64 KiB' if args.delay else ''}). "
        "Each command in a fresh cache; requests (the 302s to the LFS origin among them) and bytes from the "
        "server's log. Both tensor lists checked equal, and both downloads checked to leave the same snapshot "
        "(paths, link targets, blob bytes). MB/s: the shards' and index's bytes over the wall time"
        f"{'; a merge also writes the merged file, so its rate is a floor of its download rate' if args.download.startswith('merge') else ''}."),
        (f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. One run each; the wall time is the whole process "
        "(for huggingface_hub, Python's start and imports included; the call alone in the last column)."),
        f"Files in ckpt's cache after its remote inspect: {ckpt_cached}.",
        "",
        "| operation | command | wall (s) | peak RSS (MiB) | requests | bytes served | MB/s of model | call alone (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for op, name_, wall, rss, n, nbytes, alone in rows:
        rate = f"{model_bytes / 1e6 / wall:.0f}" if op == "download" else ""
        lines.append(f"| {op} | {name_} | {wall:.2f} | {rss / 2**20:.0f} | {n} | {nbytes:,} | {rate} | "
                     f"{'' if alone is None else f'{alone:.2f}'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        with open(os.path.join(HERE, "RESULTS-hub.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
