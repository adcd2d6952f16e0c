"""Resume a Hugging Face `Trainer` checkpoint folder with the real Trainer and compare what it loaded.

    trainer_check.py resume CHECKPOINT_DIR --world-size M --kind {single,ddp,fsdp2,zero2,zero3} \
        --reference REF.safetensors [--universal] [--grad-accum N] [--trainer-state FILE] \
        [--fsdp-state-dict-type SHARDED_STATE_DICT|FULL_STATE_DICT] [--json OUT.json] [--timeout S]

Launches M CPU ranks (torchrun + gloo; a plain process for `--kind single` on 1 rank), rebuilds
the tiny model, data and TrainingArguments of fixtures/gen/trainer_worker.py (the same builders
the fixtures were written with; max_steps, save_steps and logging_steps from the folder's
trainer_state.json, gradient_accumulation_steps from its training_args.bin when there is one,
else 1, else --grad-accum), and calls `trainer.train(resume_from_checkpoint=CHECKPOINT_DIR)`.
The Trainer loads the folder its own way (model, optimizer, scheduler, trainer_state.json, RNG
files; DeepSpeed through `engine.load_checkpoint`, with `"checkpoint": {"load_universal": true}`
in the DeepSpeed config when --universal, so the tag comes from `latest_universal`). Then:

- at `on_train_begin` (after every load, before any step) each rank gathers the full model state
  dict (FSDP2 DTensors -> full_tensor(); ZeRO-3 under GatheredParameters) and, under DeepSpeed,
  the fp32 master of each param (`safe_get_full_fp32_param`): every tensor of REF must be there
  under its name, same dtype, shape and bytes;
- `trainer.state.global_step` must equal the folder's `global_step`;
- the optimizer must hold loaded state: the innermost torch optimizer's Adam `step` counts must
  all equal global_step (a fresh optimizer has none: the Trainer skips optimizer AND scheduler
  silently when either optimizer.pt / optimizer.bin / optimizer_0 or scheduler.pt is missing);
  for single / ddp folders also `optimizer.state_dict()` == optimizer.pt, bit for bit;
- the loaded LR scheduler's state must equal scheduler.pt (when the folder has one);
- at the first `training_step` (the batch the resumed run trains on first, after the Trainer's
  data skip and RNG restore) the rank's python / numpy / torch CPU RNG states must equal its
  RNG file (rng_state.pth on 1 rank, rng_state_{rank}.pth on more; a rank without its file is
  reported, not failed: the Trainer then keeps its own RNG), and the batch's sample indices are
  reported; then training stops (nothing is trained, nothing is saved).

Exit 0 when everything is equal; 1 with one line per mismatch; 2 when the Trainer could not
resume at all (the traceback is printed). --json writes the full result (per rank: sample
indices of the first batch, RNG comparison, scheduler state, ...).

Run with the reference venv: /opt/statekit-venv/bin/python tests/python/interop/trainer_check.py ...
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
KINDS = ("single", "ddp", "fsdp2", "zero2", "zero3")


def parse(argv):
    ap = argparse.ArgumentParser(prog="trainer_check.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("resume", "_worker"):
        p = sub.add_parser(name)
        p.add_argument("checkpoint_dir")
        p.add_argument("--world-size", type=int, required=True)
        p.add_argument("--kind", required=True, choices=KINDS)
        p.add_argument("--reference", required=True)
        p.add_argument("--universal", action="store_true")
        p.add_argument("--grad-accum", type=int, help="when the folder has no training_args.bin (default 1)")
        p.add_argument("--fsdp-state-dict-type", choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"],
                       help="--kind fsdp2: the plugin's state_dict_type (default: SHARDED_STATE_DICT when the "
                            "folder has pytorch_model_fsdp_0/, else FULL_STATE_DICT)")
        p.add_argument("--trainer-state", help="read max_steps/save_steps/global_step from this file instead of "
                                               "CHECKPOINT_DIR/trainer_state.json (for folders without one)")
        p.add_argument("--json", help="also write the full result as JSON here")
        p.add_argument("--timeout", type=int, default=900, help="seconds before giving up (exit 2)")
        if name == "_worker":
            p.add_argument("--result-dir", required=True)
    return ap.parse_args(argv)


# ---------------------------------------------------------------- parent

def launch(args) -> int:
    for path in (args.checkpoint_dir, args.reference):
        if not os.path.exists(path):
            print(f"trainer_check: {path} does not exist", file=sys.stderr)
            return 2
    state_file = args.trainer_state or os.path.join(args.checkpoint_dir, "trainer_state.json")
    if not os.path.isfile(state_file):
        print(f"trainer_check: {state_file} does not exist (see --trainer-state)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    for k, v in (("DS_ACCELERATOR", "cpu"), ("OMP_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"),
                 ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(k, v)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # ninja, torchrun
    with tempfile.TemporaryDirectory(prefix="trainer_check_") as tmp:
        res_dir = os.path.join(tmp, "results")
        os.makedirs(res_dir)
        wargs = ["_worker", os.path.abspath(args.checkpoint_dir), "--world-size", str(args.world_size),
                 "--kind", args.kind, "--reference", os.path.abspath(args.reference), "--result-dir", res_dir]
        if args.universal:
            wargs.append("--universal")
        if args.grad_accum:
            wargs += ["--grad-accum", str(args.grad_accum)]
        wargs += ["--trainer-state", os.path.abspath(state_file)]
        if args.fsdp_state_dict_type:
            wargs += ["--fsdp-state-dict-type", args.fsdp_state_dict_type]
        if args.kind == "single" and args.world_size == 1:
            cmd = [sys.executable, os.path.abspath(__file__)] + wargs
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(args.world_size), os.path.abspath(__file__)] + wargs
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            tail = "\n".join(out.splitlines()[-40:])
            print(f"trainer_check: the Trainer did not finish within {args.timeout}s:\n{tail}", file=sys.stderr)
            return 2
        ranks = []
        for r in range(args.world_size):
            p = os.path.join(res_dir, f"rank{r}.json")
            if os.path.exists(p):
                with open(p) as f:
                    ranks.append(json.load(f))
        if len(ranks) != args.world_size and not any(r["status"] == "error" for r in ranks):
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
            print(f"trainer_check: the Trainer did not finish (exit {proc.returncode}, "
                  f"{len(ranks)} of {args.world_size} rank results):\n{tail}", file=sys.stderr)
            return 2
    res = {"checkpoint_dir": args.checkpoint_dir, "world_size": args.world_size, "kind": args.kind,
           "universal": args.universal, "ranks": ranks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    errors = [r for r in ranks if r["status"] == "error"]
    if errors:
        for r in errors:
            print(f"trainer_check: rank {r['rank']}: resume failed: {r['error']}\n{r['traceback']}", file=sys.stderr)
        for r in errors:
            print(f"trainer_check: rank {r['rank']}: resume failed: {r['error']}", file=sys.stderr)
        return 2
    mismatches = [f"rank {r['rank']}: {m}" for r in ranks for m in r["mismatches"]]
    if mismatches:
        for m in mismatches:
            print(f"trainer_check: MISMATCH {m}", file=sys.stderr)
        print(f"trainer_check: {len(mismatches)} mismatches", file=sys.stderr)
        return 1
    r0 = ranks[0]
    notes = sorted({n for r in ranks for n in r["notes"]})
    for n in notes:
        print(f"trainer_check: note: {n}", file=sys.stderr)
    first = [r["first_batch_samples"] for r in ranks]
    print(f"trainer_check: OK, {r0['compared']} tensors equal bit for bit after resuming {args.checkpoint_dir} "
          f"on {args.world_size} ranks ({args.kind}{', universal' if args.universal else ''}), "
          f"global_step {r0['global_step']}, first batch samples per rank {first}")
    return 0


# ---------------------------------------------------------------- worker

class StopAfterLoad(Exception):
    """Raised from the first training_step: everything is loaded, nothing is trained."""


def describe_diff(name, got, want):
    import torch

    if got is None:
        return f"{name}: not found in the resumed model"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != reference {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    g = got.contiguous().reshape(-1).view(torch.uint8)
    w = want.contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(g, w):
        return None
    es = want.element_size()
    bad = (g.reshape(-1, es) != w.reshape(-1, es)).any(dim=1).nonzero().reshape(-1)
    i = int(bad[0])
    return (f"{name}: {bad.numel()} of {want.numel()} elements differ, first at flat index {i}: "
            f"got {got.reshape(-1)[i].item()!r}, reference {want.reshape(-1)[i].item()!r}")


def adam_steps(opt):
    """The sorted distinct `step` values in the innermost torch optimizer's state."""
    seen = set()
    while opt is not None:
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    for st in opt.state.values():
        if "step" in st:
            v = st["step"]
            if hasattr(v, "full_tensor"):
                v = v.full_tensor()
            seen.add(int(float(v)))
    return sorted(seen)


def compare_tree(path, got, want):
    """First difference between two nested state dicts (tensors bit for bit), or None."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: not a tensor"
        return describe_diff(path, got.detach().cpu(), want)
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{path}: keys {sorted(map(str, got)) if isinstance(got, dict) else type(got)} != {sorted(map(str, want))}"
        for k in want:
            d = compare_tree(f"{path}.{k}", got[k], want[k])
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{path}: length differs"
        for i, (g, w) in enumerate(zip(got, want)):
            d = compare_tree(f"{path}.{i}", g, w)
            if d:
                return d
        return None
    return None if got == want else f"{path}: {got!r} != {want!r}"


def plain(x):
    """JSON-comparable form of a scheduler state value."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def worker(args) -> None:
    sys.path.insert(0, GEN)
    import random

    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    import trainer_worker as tw

    ck = args.checkpoint_dir
    rank = int(os.environ.get("RANK", "0"))
    res = {"rank": rank, "status": "ok", "mismatches": [], "notes": [], "compared": 0,
           "first_batch_samples": None}
    try:
        with open(args.trainer_state or os.path.join(ck, "trainer_state.json")) as f:
            saved_state = json.load(f)
        grad_accum = args.grad_accum or 1
        args_bin = os.path.join(ck, "training_args.bin")
        if os.path.isfile(args_bin):
            saved_args = torch.load(args_bin, weights_only=False)
            grad_accum = int(saved_args.gradient_accumulation_steps)
            res["training_args_bin_gradient_accumulation_steps"] = grad_accum
        state_dict_type = None
        if args.kind == "fsdp2":
            # what the folder was written with: accelerate's SHARDED_STATE_DICT writes a DCP folder
            # pytorch_model_fsdp_0/, FULL_STATE_DICT a pytorch_model_fsdp.bin
            state_dict_type = args.fsdp_state_dict_type or (
                "SHARDED_STATE_DICT" if os.path.isdir(os.path.join(ck, "pytorch_model_fsdp_0")) else "FULL_STATE_DICT")
            res["fsdp_state_dict_type"] = state_dict_type
        out_dir = os.path.join(os.path.dirname(args.result_dir), "output")
        targs = tw.make_args(args.kind, out_dir, grad_accum=grad_accum, max_steps=saved_state["max_steps"],
                             save_steps=saved_state["save_steps"], state_dict_type=state_dict_type,
                             universal=args.universal)
        targs.logging_steps = saved_state.get("logging_steps", targs.logging_steps)
        world = targs.world_size
        if world != args.world_size:
            raise RuntimeError(f"the Trainer sees world size {world}, asked for {args.world_size}")
        data = tw.Tokens()
        model = tw.build_model()
        ref = load_file(args.reference)
        captured = {}

        class Capture(TrainerCallback):
            def on_train_begin(self, a, state, control, **kw):
                m = trainer.model
                captured["model"] = tw.full_state_dict(args.kind, m)
                if args.kind in ("zero2", "zero3"):
                    captured["fp32"] = tw.fp32_masters(args.kind, m)
                captured["global_step"] = state.global_step
                captured["epoch"] = state.epoch
                captured["adam_steps"] = adam_steps(trainer.optimizer)
                if os.path.isfile(os.path.join(ck, "optimizer.pt")) and args.kind in ("single", "ddp"):
                    captured["optimizer_state"] = trainer.optimizer.state_dict()
                if trainer.lr_scheduler is not None:
                    captured["scheduler"] = plain({k: v for k, v in trainer.lr_scheduler.state_dict().items()
                                                   if k != "lr_lambdas"})

        class Stopping(tw.trainer_class(args.kind)):
            def training_step(self, model, inputs, num_items_in_batch=None):
                res["first_batch_samples"] = data.sample_indices(inputs["input_ids"])
                captured["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(),
                                   "cpu": torch.random.get_rng_state().clone()}
                raise StopAfterLoad()

        trainer = Stopping(model=model, args=targs, train_dataset=data, callbacks=[Capture()])
        res["distributed_type"] = str(trainer.accelerator.distributed_type)
        res["len_train_dataloader"] = len(trainer.get_train_dataloader())
        try:
            trainer.train(resume_from_checkpoint=ck)
            res["notes"].append("the resumed run had no step left to train (no first batch)")
        except StopAfterLoad:
            pass
        if "model" not in captured:
            raise RuntimeError("on_train_begin was never called")

        # model weights
        got = captured["model"]
        for name, want in ref.items():
            res["compared"] += 1
            d = describe_diff(name, got.get(name), want)
            if d:
                res["mismatches"].append(d)
        res["unchecked"] = sorted(set(got) - set(ref))
        for name in captured.get("fp32", {}):
            full = captured["fp32"][name]
            if name in ref:
                res["compared"] += 1
                d = describe_diff(f"{name} (DeepSpeed fp32 master)", full, ref[name])
                if d:
                    res["mismatches"].append(d)
        # global step
        res["global_step"] = captured["global_step"]
        res["epoch"] = captured["epoch"]
        if captured["global_step"] != saved_state["global_step"]:
            res["mismatches"].append(f"global_step {captured['global_step']} != folder's {saved_state['global_step']}")
        # optimizer
        res["adam_steps"] = captured["adam_steps"]
        if captured["adam_steps"] != [captured["global_step"]]:
            res["mismatches"].append(f"optimizer: Adam step counts {captured['adam_steps']} after the load, "
                                     f"expected [{captured['global_step']}] (optimizer state not loaded?)")
        if "optimizer_state" in captured:
            want = torch.load(os.path.join(ck, "optimizer.pt"), weights_only=True)
            d = compare_tree("optimizer", captured["optimizer_state"], want)
            res["optimizer_pt_compared"] = True
            if d:
                res["mismatches"].append(f"optimizer state != optimizer.pt: {d}")
        # scheduler
        sched_file = os.path.join(ck, "scheduler.pt")
        if os.path.isfile(sched_file) and "scheduler" in captured:
            want = plain({k: v for k, v in torch.load(sched_file, weights_only=True).items() if k != "lr_lambdas"})
            res["scheduler"] = captured["scheduler"]
            if captured["scheduler"] != want:
                res["mismatches"].append(f"lr scheduler state {captured['scheduler']} != scheduler.pt {want}")
        # RNG at the first step
        if "rng" in captured:
            rng_name = "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"
            rng_file = os.path.join(ck, rng_name)
            res["rng_file"] = rng_name
            if not os.path.isfile(rng_file):
                res["notes"].append(f"no {rng_name}: the Trainer kept its own RNG on that rank")
                res["rng_equal"] = None
            else:
                saved = torch.load(rng_file, weights_only=False)
                live = captured["rng"]
                same = {
                    "python": tuple(saved["python"]) == tuple(live["python"]),
                    "numpy": (saved["numpy"][0] == live["numpy"][0]
                              and np.array_equal(saved["numpy"][1], live["numpy"][1])
                              and tuple(saved["numpy"][2:]) == tuple(live["numpy"][2:])),
                    "cpu": torch.equal(saved["cpu"], live["cpu"]),
                }
                res["rng_equal"] = same
                for k, ok in same.items():
                    if not ok:
                        res["mismatches"].append(f"{k} RNG state at the first step != {rng_name}")
    except BaseException as e:  # reported by the parent as exit 2 (DCP's CheckpointException is a BaseException)
        if isinstance(e, KeyboardInterrupt):
            raise
        import traceback

        res = {"rank": rank, "status": "error", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(), "mismatches": [], "notes": []}
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and res["status"] == "ok":
        dist.barrier()
    # no destroy_process_group: its teardown sometimes aborts on CPU after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if res["status"] == "ok" else 1)  # non-zero: torchrun ends the other ranks


def main():
    args = parse(sys.argv[1:])
    if args.cmd == "_worker":
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
