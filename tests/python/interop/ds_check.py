"""Resume a DeepSpeed ZeRO checkpoint with real DeepSpeed and compare the weights it loaded.

    ds_check.py resume CHECKPOINT_DIR --world-size M --stage S --dtype fp32|bf16 \
        --reference REF.safetensors [--optim-reference OPT.safetensors] [--universal] \
        [--tag TAG] [--untied] [--sub-group-size K] [--json OUT.json] [--timeout SECONDS]

Launches M CPU ranks with torchrun (gloo), builds the fixture model of
fixtures/gen/deepspeed_model.py (tied unless --untied), calls
`engine.load_checkpoint(CHECKPOINT_DIR)` (with `"checkpoint": {"load_universal": true}` when
--universal, so the tag comes from `latest_universal`), and then gathers what DeepSpeed holds:

- trainable params: the full fp32 master via `deepspeed.utils.safe_get_full_fp32_param`;
- frozen params: the module tensor (inside `deepspeed.zero.GatheredParameters` at stage 3),
  cast to fp32 like zero_to_fp32 does;
- buffers: the module buffer, floating ones cast to fp32;
- with --optim-reference: `safe_get_full_optimizer_state(p, "exp_avg" | "exp_avg_sq")`, compared
  with the tensors named `<param>.exp_avg` / `<param>.exp_avg_sq` in that file.

Every tensor in REF must exist under that name (aliases of tied params included) and be equal bit
for bit (same dtype, shape and bytes). Exit 0 on equality; 1 with one line per difference; 2 when
DeepSpeed could not resume at all (no checkpoint found, load error).

Run with the reference venv: /opt/statekit-venv/bin/python tests/python/interop/ds_check.py ...
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
GEN = os.path.join(ROOT, "fixtures", "gen")


def parse(argv):
    ap = argparse.ArgumentParser(prog="ds_check.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("resume", "_worker"):
        p = sub.add_parser(name)
        p.add_argument("checkpoint_dir")
        p.add_argument("--world-size", type=int, required=True)
        p.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
        p.add_argument("--dtype", required=True, choices=["fp32", "bf16"])
        p.add_argument("--reference", required=True)
        p.add_argument("--optim-reference")
        p.add_argument("--universal", action="store_true")
        p.add_argument("--tag")
        p.add_argument("--untied", action="store_true")
        p.add_argument("--sub-group-size", type=int)
        p.add_argument("--json", help="also write the result as JSON here")
        p.add_argument("--timeout", type=int, default=900, help="seconds before giving up (exit 2)")
        if name == "_worker":
            p.add_argument("--result", required=True)
    return ap.parse_args(argv)


def launch(args) -> int:
    """Parent: run M ranks of this script's _worker under torchrun, then report."""
    for path in (args.checkpoint_dir, args.reference, args.optim_reference):
        if path and not os.path.exists(path):
            print(f"ds_check: {path} does not exist", file=sys.stderr)
            return 2
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    venv_bin = os.path.dirname(sys.executable)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")  # ninja, torchrun
    with tempfile.TemporaryDirectory(prefix="ds_check_") as tmp:
        result = os.path.join(tmp, "result.json")
        worker_args = ["_worker", os.path.abspath(args.checkpoint_dir),
                       "--world-size", str(args.world_size), "--stage", str(args.stage),
                       "--dtype", args.dtype, "--reference", os.path.abspath(args.reference),
                       "--result", result]
        if args.optim_reference:
            worker_args += ["--optim-reference", os.path.abspath(args.optim_reference)]
        if args.universal:
            worker_args.append("--universal")
        if args.tag:
            worker_args += ["--tag", args.tag]
        if args.untied:
            worker_args.append("--untied")
        if args.sub_group_size:
            worker_args += ["--sub-group-size", str(args.sub_group_size)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(args.world_size), os.path.abspath(__file__)] + worker_args
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            tail = "\n".join(out.splitlines()[-40:])
            print(f"ds_check: DeepSpeed did not finish within {args.timeout}s:\n{tail}", file=sys.stderr)
            return 2
        if not os.path.exists(result):
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            print(f"ds_check: DeepSpeed did not finish (torchrun exit {proc.returncode}):\n{tail}",
                  file=sys.stderr)
            return 2
        with open(result) as f:
            res = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if res["status"] == "error":
        print(f"ds_check: resume failed: {res['error']}", file=sys.stderr)
        return 2
    if res["mismatches"]:
        for m in res["mismatches"]:
            print(f"ds_check: MISMATCH {m}", file=sys.stderr)
        print(f"ds_check: {len(res['mismatches'])} of {res['compared']} tensors differ", file=sys.stderr)
        return 1
    if res.get("unchecked"):
        print(f"ds_check: note: not in the reference, not compared: {res['unchecked']}", file=sys.stderr)
    print(f"ds_check: OK, {res['compared']} tensors equal bit for bit after resuming "
          f"{args.checkpoint_dir} (tag {res['tag']}, global_steps {res['global_steps']}) "
          f"on {args.world_size} ranks, stage {args.stage}, {args.dtype}"
          f"{', universal' if args.universal else ''}")
    return 0


def describe_diff(name, got, want):
    import torch
    if got is None:
        return f"{name}: not found in the resumed model"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != reference {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    g = got.reshape(-1).view(torch.int32 if got.element_size() == 4 else torch.uint8)
    w = want.reshape(-1).view(torch.int32 if want.element_size() == 4 else torch.uint8)
    bad = (g != w).nonzero().reshape(-1)
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    return (f"{name}: {bad.numel()} of {want.numel()} elements differ, first at flat index {i}: "
            f"got {got.reshape(-1)[i].item()!r}, reference {want.reshape(-1)[i].item()!r}")


def worker(args) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, GEN)
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import load_file

    from deepspeed_model import build_model, ds_config, make_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    res = {"status": "ok", "mismatches": [], "compared": 0}
    try:
        model = build_model(tie=not args.untied)
        opt = make_optimizer(model)
        cfg = ds_config(args.stage, args.dtype, args.sub_group_size, universal=args.universal)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        load_path, _ = engine.load_checkpoint(args.checkpoint_dir, tag=args.tag)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint to load in {args.checkpoint_dir}")
        res["load_path"] = str(load_path)
        res["tag"] = os.path.basename(os.path.dirname(str(load_path)))
        res["global_steps"] = engine.global_steps

        if args.optim_reference and hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
            # ZeRO 1/2 link the optimizer-state fragments to the params lazily (at the first
            # step); after a native load they are not linked yet and
            # safe_get_full_optimizer_state would fail, so link them now (no-op if done).
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        module = engine.module
        ref = load_file(args.reference)
        oref = load_file(args.optim_reference) if args.optim_reference else {}
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers())
        got = {}
        # every rank walks the same names in the same order: the gathers are collective
        for name in sorted(set(ref) | {k.rsplit(".", 1)[0] for k in oref}):
            if name in params:
                p = params[name]
                if p.requires_grad:
                    full = safe_get_full_fp32_param(p)
                    got[name] = None if full is None else full.detach().float().cpu().clone()
                    for key in ("exp_avg", "exp_avg_sq"):
                        if f"{name}.{key}" in oref:
                            st = safe_get_full_optimizer_state(p, key)
                            got[f"{name}.{key}"] = None if st is None else st.detach().cpu().clone()
                else:
                    with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                        got[name] = p.detach().float().cpu().clone()
            elif name in buffers:
                b = buffers[name].detach().cpu()
                got[name] = b.float().clone() if b.is_floating_point() else b.clone()
        if rank == 0:
            for name, want in list(ref.items()) + list(oref.items()):
                res["compared"] += 1
                d = describe_diff(name, got.get(name), want)
                if d:
                    res["mismatches"].append(d)
            # zero_to_fp32 leaves frozen params out at stage 1 (no frozen_param_shapes there),
            # so names the reference lacks are reported, not failed
            res["unchecked"] = sorted(n for n in module.state_dict().keys() if n not in ref)
    except Exception as e:  # reported by the parent as exit 2
        import traceback
        res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f, indent=2)
    torch.distributed.barrier()
    # no destroy_process_group: its teardown sometimes aborts on CPU after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    args = parse(sys.argv[1:])
    if args.cmd == "_worker":
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
