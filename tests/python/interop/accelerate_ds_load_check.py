"""Loads an accelerate + DeepSpeed `save_state` folder with the real `Accelerator.load_state` on M
ranks (gloo, CPU, DS_ACCELERATOR=cpu) and checks what every rank ends up holding.

    torchrun --nproc_per_node M tests/python/interop/accelerate_ds_load_check.py --dir FOLDER \
        --case ds_z2_w2|ds_z3_w2|ds_two_models_w2 [--universal] [--results DIR]

The accelerator, DeepSpeed plugin(s), model(s), AdamW, StepLR (z2) and DataLoader are built and
prepared as `fixtures/gen/accelerate_more_worker.py` builds them (its `tiny`, `ds_config` and
transformers-less `set_deepspeed_weakref` patch are imported; `build` below follows its `main`
line by line). With `--universal` every plugin's DeepSpeed config gets
`"checkpoint": {"load_universal": true}` (DeepSpeed then reads `TAG/zero/<param>/*.pt` and
`TAG/zero/optimizer_state.pt` instead of the per-rank ZeRO files). Then
`accelerator.load_state(FOLDER)` (which calls `engine.load_checkpoint(FOLDER, "pytorch_model[_i]")`
per engine). Checked on every rank, per engine/tag:

- `fp32`: `deepspeed.utils.safe_get_full_fp32_param` of every parameter (the gathered fp32 master)
  equals expected_more.json's zero_to_fp32 tensor for that case/tag bit for bit (dtype, shape,
  SHA-256 of the raw bytes);
- `module`: the engine's module parameters (gathered with `deepspeed.zero.GatheredParameters`
  under ZeRO-3) equal the same tensors bit for bit (training is fp32, so lp == hp);
- `optim`: `safe_get_full_optimizer_state(p, "exp_avg" / "exp_avg_sq")` exists, is finite and not
  all zero for every parameter (their SHA-256s and the param groups' `lrs` are reported, so a
  caller can compare a resharded folder with the original one), and the base optimizer's Adam
  `step` equals the saved step. (ZeRO-2 after a native load exposes no optimizer-state views until
  the next step: see `relink_zero2_optim_fragments`.);
- `step`: `accelerator.step` equals the saved step (random_states_R.pkl);
- `sched` (z2 only): the AcceleratedScheduler's state equals FOLDER/scheduler.bin.

Each rank prints one JSON line (`{"accelerate_ds_load_check": ...}`) and, with `--results`, writes
it to `DIR/rank{r}.json`. A rank exits 1 when a check fails (or load_state raised).
"""

import argparse
import hashlib
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "fixtures", "gen"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import accelerate_more_worker as worker  # noqa: E402  (the one model / config definition; patches set_deepspeed_weakref)
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, set_seed  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

REFERENCE = os.path.join(ROOT, "fixtures", "accelerate", "expected_more.json")
CASES = {"ds_z2_w2": "z2", "ds_z3_w2": "z3", "ds_two_models_w2": "two"}
UNIVERSAL = {"load_universal": True}


def build(case, universal):
    """accelerate_more_worker.main up to the training loop; returns (accelerator, engines, scheduler)."""
    kwargs = [InitProcessGroupKwargs(backend="gloo")]
    if case == "two":
        cfgs = {"a": worker.ds_config(2), "b": worker.ds_config(3)}
        if universal:
            for c in cfgs.values():
                c["checkpoint"] = dict(UNIVERSAL)
        plugins = {k: DeepSpeedPlugin(hf_ds_config=c, zero3_init_flag=False) for k, c in cfgs.items()}
        acc = Accelerator(deepspeed_plugins=plugins, kwargs_handlers=kwargs)
    else:
        stage = 2 if case == "z2" else 3
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=1.0,
                                 zero3_init_flag=False)
        if universal:
            plugin.deepspeed_config["checkpoint"] = dict(UNIVERSAL)
        acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=kwargs)
    set_seed(21)
    data = TensorDataset(torch.randn(16, 4))
    dl = DataLoader(data, batch_size=2, shuffle=True)

    m1 = worker.tiny(1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    s1 = None
    if case == "z2":
        s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=1, gamma=0.5)
        m1, o1, s1, dl = acc.prepare(m1, o1, s1, dl)
    else:
        m1, o1, dl = acc.prepare(m1, o1, dl)
    engines = [m1]
    if case == "two":
        acc.state.select_deepspeed_plugin("b")
        m2 = worker.tiny(2)
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        m2, o2 = acc.prepare(m2, o2)
        engines.append(m2)
    return acc, engines, s1


def digest(t):
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "sha256": hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()}


def relink_zero2_optim_fragments(engine):
    """ZeRO-1/2: a plain (non-universal) load_checkpoint re-links every param's `_hp_mapping`
    (`_link_all_hp_params`) without the optimizer-state views; DeepSpeed re-attaches them only after
    the next optimizer step (`_lazy_init_hp_params_optimizer_state`), so until then
    `safe_get_full_optimizer_state` raises on `optim_fragment = None`. Attach them now with
    DeepSpeed's own `lazy_init_hp_params_optimizer_state` (local, no collective). Returns whether it did."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    opt = engine.optimizer
    if engine.zero_optimization_stage() >= 3 or not hasattr(opt, "bit16_groups"):
        return False
    missing = any(p._hp_mapping is not None and p._hp_mapping.optim_fragment is None
                  for g in opt.bit16_groups for p in g)
    if missing:
        for i, _ in enumerate(opt.optimizer.param_groups):
            lazy_init_hp_params_optimizer_state(opt.bit16_groups[i], opt.single_partition_of_fp32_groups[i],
                                                opt.optimizer.state)
    return missing


def check_engine(engine, want, want_step):
    """Collective: every rank must call it for the same engines in the same order."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    named = list(engine.module.named_parameters())
    out = {"zero_stage": engine.zero_optimization_stage(), "global_steps": engine.global_steps,
           "load_universal": bool(engine.load_universal_checkpoint()), "fp32_mismatch": [],
           "module_mismatch": [], "optim_problems": [], "optim_sha256": {}}
    out["relinked_optim_fragments"] = relink_zero2_optim_fragments(engine)
    got_names = [n for n, _ in named]
    if sorted(got_names) != sorted(want):
        out["fp32_mismatch"].append(f"names {got_names} != {sorted(want)}")
    for name, p in named:
        full = safe_get_full_fp32_param(p)
        if full is None or digest(full) != want.get(name):
            out["fp32_mismatch"].append(name)
        states = {}
        for key in ("exp_avg", "exp_avg_sq"):
            s = safe_get_full_optimizer_state(p, key)
            if s is None:
                out["optim_problems"].append(f"{name}.{key}: not exposed")
                continue
            states[key] = digest(s)["sha256"]
            if not bool(torch.isfinite(s).all()):
                out["optim_problems"].append(f"{name}.{key}: not finite")
            if not bool((s != 0).any()):
                out["optim_problems"].append(f"{name}.{key}: all zero")
        out["optim_sha256"][name] = states
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        for name, p in named:
            if digest(p.data) != want.get(name):
                out["module_mismatch"].append(name)
    steps = sorted({float(st["step"]) for st in engine.optimizer.optimizer.state.values() if "step" in st})
    out["adam_steps"] = steps
    out["lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
    if steps != [float(want_step)]:
        out["optim_problems"].append(f"adam step {steps} != [{want_step}]")
    out["ok"] = {"fp32": not out["fp32_mismatch"], "module": not out["module_mismatch"],
                 "optim": not out["optim_problems"]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--universal", action="store_true")
    ap.add_argument("--reference", default=REFERENCE)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    with open(args.reference) as f:
        ref = json.load(f)[args.case]
    tags = sorted(ref["zero_to_fp32"])  # "pytorch_model"[, "pytorch_model_1"]: engine i <-> tag
    want_step = ref["random_states"]["random_states_0.pkl"]["step"]

    acc, engines, sched = build(CASES[args.case], args.universal)
    rank, world = acc.process_index, acc.num_processes
    res = {"rank": rank, "world_size": world, "dir": args.dir, "case": args.case, "universal": args.universal,
           "ok": {}, "engines": {}}
    try:
        acc.load_state(args.dir)
    except Exception as e:  # report it like any other failed check
        res["load_state_error"] = f"{type(e).__name__}: {e}"[-3000:]
        res["load_state_traceback"] = traceback.format_exc()[-6000:]
    if "load_state_error" in res:
        res["ok"]["load_state"] = False
    else:
        for tag, engine in zip(tags, engines):
            r = check_engine(engine, ref["zero_to_fp32"][tag]["tensors"], want_step)
            res["engines"][tag] = r
            for c, ok in r["ok"].items():
                res["ok"][f"{tag}.{c}"] = ok
        res["ok"]["engines"] = len(engines) == len(tags)
        res["step"] = {"got": acc.step, "want": want_step}
        res["ok"]["step"] = acc.step == want_step
        if sched is not None:
            saved = torch.load(os.path.join(args.dir, "scheduler.bin"), weights_only=False)
            got = sched.scheduler.state_dict()
            res["sched"] = {"got_last_epoch": got.get("last_epoch"), "want_last_epoch": saved.get("last_epoch")}
            res["ok"]["sched"] = got == saved
    res["pass"] = bool(res["ok"]) and all(res["ok"].values())
    line = json.dumps({"accelerate_ds_load_check": res}, sort_keys=True)
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
            f.write(line + "\n")
    sys.stdout.write(line + "\n")  # one write, so ranks do not interleave within a line
    sys.stdout.flush()
    try:
        acc.wait_for_everyone()
    finally:
        # Tearing the gloo process group down sometimes aborts on CPU; skip interpreter teardown.
        sys.stderr.flush()
        os._exit(0 if res["pass"] else 1)


if __name__ == "__main__":
    main()
