#!/usr/bin/env python
"""Checks a torch.distributed.checkpoint (DCP) directory with the real torch, for the Rust tests.

    dcp_check.py load DCP_DIR --world-size M --reference REF.safetensors [--key model|--no-key]
                 [--buffers a,b] [--timeout 600]
    dcp_check.py merge DCP_DIR OUT.safetensors

`load` launches `torchrun --standalone --nproc_per_node M` (gloo, CPU) running this file. Every
rank builds an FSDP2 model from REF alone: one tensor per REF key, with REF's shape and dtype,
dotted names becoming nested modules, `fully_shard` on a 1-D CPU mesh of M ranks, so any M works
(dims need not divide M; ranks may hold empty shards). The model starts filled with a sentinel,
`torch.distributed.checkpoint.load` fills its SHARDED state dict (DTensor values) from DCP_DIR,
`set_model_state_dict` puts it into the module, and each parameter/buffer is gathered with
`full_tensor()` and compared with REF's tensor byte for byte (dtype, shape and raw data: a DCP
folder and a safetensors file have no bytes in common to compare). Exit 0 when everything is equal; exit 1 with
one line per difference otherwise; exit 2 when torch itself failed (the message says where).

Where the tensors sit in the checkpoint: under one top-level key (`model.<fqn>`, as accelerate's
`pytorch_model_fsdp_0/` and `{"model": ..., "optim": ...}` checkpoints have them) or at the top
(`<fqn>`). By default this is read from the checkpoint's `.metadata` (planner_data); `--key K` or
`--no-key` force it. Which REF tensors are buffers (plain tensors, not DTensors): `--buffers`, else
REF's `__metadata__["statekit.buffers"]` (a JSON list, as the fixtures write it), else none. It
only changes how the tensor is held on the ranks; DCP reshards either way.

`merge` is the reference side for any DCP dir (for example a Rust-written one): torch's
`dcp_to_torch_save`, then accelerate's naming (a single top-level key is unwrapped), nested dicts
flattened to dotted keys by DCP's own `flatten_state_dict`, tensors into OUT.safetensors and the
non-tensor leaves as JSON in its `__metadata__["statekit.non_tensor"]`.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import traceback

SENTINEL = -12345


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ld = sub.add_parser("load", help="load DCP_DIR into an FSDP2 model on M ranks and compare with REF")
    ld.add_argument("dcp_dir")
    ld.add_argument("--world-size", "-m", type=int, required=True)
    ld.add_argument("--reference", "-r", required=True)
    g = ld.add_mutually_exclusive_group()
    g.add_argument("--key", help="top-level key the model sits under in the checkpoint (e.g. model)")
    g.add_argument("--no-key", action="store_true", help="the model's FQNs are the checkpoint's top-level keys")
    ld.add_argument("--buffers", help="comma-separated REF keys to hold as buffers (plain tensors)")
    ld.add_argument("--timeout", type=float, default=600.0)
    mg = sub.add_parser("merge", help="dcp_to_torch_save DCP_DIR, written as one safetensors file")
    mg.add_argument("dcp_dir")
    mg.add_argument("out")
    wk = sub.add_parser("_worker")
    wk.add_argument("config")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# parent side


def detect_key(dcp_dir, names):
    """Returns the top-level key the REF names sit under, or "" for none, from planner_data."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(dcp_dir).read_metadata()
    paths = {tuple(v) for v in (md.planner_data or {}).values()}
    flat = set(md.state_dict_metadata)
    if all((n,) in paths or (not paths and n in flat) for n in names):
        return ""
    tops = {p[0] for p in paths if len(p) >= 2}
    for top in sorted(tops):
        if all((top, n) in paths for n in names):
            return top
    missing = [n for n in names if (n,) not in paths and not any((t, n) in paths for t in tops)]
    raise SystemExit(f"dcp_check: cannot place the reference's tensors in {dcp_dir}: not found at the top or under "
                     f"one key ({sorted(tops)}); missing e.g. {missing[:5]}. Pass --key or --no-key.")


def cmd_load(args):
    from safetensors import safe_open

    ref = os.path.abspath(args.reference)
    dcp_dir = os.path.abspath(args.dcp_dir)
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        print(f"dcp_check: {dcp_dir} has no .metadata", file=sys.stderr)
        return 2
    with safe_open(ref, "pt") as f:
        names = list(f.keys())
        meta = f.metadata() or {}
    if args.buffers is not None:
        buffers = [b for b in args.buffers.split(",") if b]
    else:
        buffers = json.loads(meta.get("statekit.buffers", "[]"))
    unknown = sorted(set(buffers) - set(names))
    if unknown:
        print(f"dcp_check: buffers not in the reference: {unknown}", file=sys.stderr)
        return 2
    key = args.key if args.key is not None else ("" if args.no_key else detect_key(dcp_dir, names))

    bin_dir = os.path.dirname(sys.executable)
    torchrun = os.path.join(bin_dir, "torchrun")
    with tempfile.TemporaryDirectory(prefix="dcp_check.") as tmp:
        cfg = os.path.join(tmp, "config.json")
        result = os.path.join(tmp, "result.json")
        with open(cfg, "w") as f:
            json.dump({"dcp_dir": dcp_dir, "reference": ref, "key": key, "buffers": buffers, "result": result}, f)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [torchrun, "--standalone", "--nproc_per_node", str(args.world_size), os.path.abspath(__file__),
               "_worker", cfg]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"dcp_check: torchrun with {args.world_size} ranks timed out after {args.timeout}s", file=sys.stderr)
            return 2
        if not os.path.exists(result):
            print(f"dcp_check: torchrun exited {proc.returncode} without a result\n{proc.stderr[-6000:]}", file=sys.stderr)
            return 2
        res = json.load(open(result))
    where = f"{args.dcp_dir} on {args.world_size} ranks (key {key!r})"
    if res.get("error"):
        print(f"dcp_check: torch failed to load {where}:\n{res['error']}", file=sys.stderr)
        return 2
    if res["mismatches"]:
        for m in res["mismatches"]:
            print(f"dcp_check: MISMATCH {m}", file=sys.stderr)
        print(f"dcp_check: {len(res['mismatches'])} of {len(names)} tensors differ after loading {where}",
              file=sys.stderr)
        return 1
    print(f"dcp_check: OK, {len(names)} tensors of {os.path.basename(ref)} equal bit for bit after loading {where}")
    return 0


def cmd_merge(args):
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="dcp_check.") as tmp:
        pt = os.path.join(tmp, "merged.pt")
        dcp_to_torch_save(args.dcp_dir, pt)
        sd = torch.load(pt, weights_only=True)
    if len(sd) == 1:  # accelerate's merge unwraps a single top-level key
        sd = next(iter(sd.values()))
    tensors, other = {}, {}
    # The dotted names are torch's own: DCP's `flatten_state_dict` is what names the keys of a
    # checkpoint when `dcp.save` writes it (the default planners flatten with it).
    flat, _ = flatten_state_dict(sd)
    for k, v in flat.items():
        if torch.is_tensor(v):
            tensors[k] = v.contiguous()
        else:
            other[k] = v
    meta = {"format": "pt"}
    if other:
        meta["statekit.non_tensor"] = json.dumps(other, default=list, sort_keys=True)
    save_file(tensors, args.out, metadata=meta)
    print(f"dcp_check: merged {len(tensors)} tensors ({len(other)} non-tensor leaves) into {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# rank side


def build_model(ref, buffers):
    """A module tree holding REF's tensors under REF's names, filled with a sentinel."""
    import torch

    root = torch.nn.Module()
    for name, t in ref.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        value = torch.full(t.shape, SENTINEL, dtype=t.dtype)
        if name in buffers:
            mod.register_buffer(leaf, value, persistent=True)
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=t.dtype.is_floating_point))
    return root


def same_bytes(a, b):
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def worker(cfg_path):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    cfg = json.load(open(cfg_path))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"error": None, "mismatches": []}
    try:
        ref = load_file(cfg["reference"])
        buffers = set(cfg["buffers"])
        model = build_model(ref, buffers)
        mesh = init_device_mesh("cpu", (world,))
        # One FSDP group per module that owns parameters (deepest first), then the root.
        owners = [m for _, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        for m in reversed(owners):
            if m is not model:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)

        sd = get_model_state_dict(model)  # SHARDED: DTensor values for parameters
        missing = sorted(set(ref) - set(sd))
        if missing:
            raise RuntimeError(f"model state dict lacks {missing}")
        state = {cfg["key"]: sd} if cfg["key"] else sd
        dcp.load(state, checkpoint_id=cfg["dcp_dir"])
        set_model_state_dict(model, sd)

        live = dict(model.named_parameters())
        live.update(dict(model.named_buffers()))
        for name in ref:  # same order on every rank: full_tensor() is a collective
            v = live[name]
            full = v.full_tensor() if isinstance(v, DTensor) else v
            full = full.detach()
            if not same_bytes(full, ref[name]):
                how = (f"dtype/shape {full.dtype}{list(full.shape)} vs {ref[name].dtype}{list(ref[name].shape)}"
                       if full.dtype != ref[name].dtype or full.shape != ref[name].shape
                       else f"{int((full != ref[name]).sum())} of {full.numel()} elements differ"
                       + (" (sentinel left: not loaded)" if bool((full == SENTINEL).any()) else ""))
                result["mismatches"].append(f"{name}: {how}")
    except BaseException:  # DCP's CheckpointException derives from BaseException
        result["error"] = f"rank {rank}: {traceback.format_exc()}"
    if rank == 0 or result["error"]:
        # Rank 0 reports; another rank only overwrites the file with its own error.
        if rank == 0 or not os.path.exists(cfg["result"]):
            with open(cfg["result"] + f".{rank}", "w") as f:
                json.dump(result, f)
            os.replace(cfg["result"] + f".{rank}", cfg["result"])
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written; skip interpreter teardown (see fixtures/gen/dcp_worker.py)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "_worker":
        worker(args.config)
        return 0
    if args.cmd == "load":
        return cmd_load(args)
    return cmd_merge(args)


if __name__ == "__main__":
    sys.exit(main())
