"""Loads an accelerate FSDP2 `save_state` folder with the real `Accelerator.load_state` on M ranks
(gloo, CPU) and checks what every rank ends up holding against a reference.

    torchrun --standalone --nproc_per_node M tests/python/interop/accelerate_load_check.py \
        --dir FOLDER --reference fixtures/accelerate/expected_fsdp2.json --case fsdp2_w2 \
        [--ignore rng,step,dl] [--results DIR]

The model, AdamW, StepLR and stateful DataLoader are built and prepared exactly as the fixture
generator built them (`fixtures/gen/accelerate_fsdp2_worker.py`: the same code, imported), then
`accelerator.load_state(FOLDER)`. Checked on every rank:

- `model`: the gathered full model state dict (`get_model_state_dict(full_state_dict=True)`;
  buffers are each rank's local copy) equals the case's `merge_model` tensors bit for bit
  (dtype, shape, SHA-256 of the raw little-endian bytes; the merged model of the source folder);
- `optim`: the gathered full optimizer state dict (`get_optimizer_state_dict(full_state_dict=True)`),
  flattened like the fixture's `leaves`, equals `merge_optimizer_unsafe` (tensors and the plain
  `param_groups` values);
- `sched`: the scheduler's state dict equals the saved `scheduler.bin` values (last_epoch, _last_lr, ...);
- `step`: `accelerator.step` equals the saved step;
- `rng`: the torch / numpy / python RNG states right after `load_state` equal this rank's
  `FOLDER/random_states_{rank}.pkl` (a missing file means accelerate skipped it: it only logs
  "Could not load random states", and only on the main process). `rng_source_rank` says which of
  the reference's ranks the state matches (by SHA-256), so a resharded folder can be checked for
  "rank r got source rank r mod N";
- `dl`: the state the StatefulDataLoader will resume from (`next_iter_state`, set by its
  `load_state_dict`) equals the saved `dl_state_dict.bin` values.

Each rank prints one JSON line (`{"accelerate_load_check": ...}`) and, with `--results`, writes
it to `DIR/rank{r}.json`. A rank exits 1 when a check not named in `--ignore` fails.
"""

import argparse
import json
import logging
import os
import random
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "fixtures", "gen"))

import accelerate_fsdp2_worker as worker  # noqa: E402  (the one model/optimizer/scheduler/dataloader definition)
from accelerate_state_fixtures import leaves  # noqa: E402  (the fixtures' flattening and SHA-256)

CHECKS = ("model", "optim", "sched", "step", "rng", "dl")


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def flat(obj):
    tensors, values = {}, {}
    leaves("", obj, tensors, values)
    return tensors, values


def compare(got_tensors, got_values, want_tensors, want_values):
    """Names that differ (missing, extra or different bits/values)."""
    bad = []
    for k in sorted(set(got_tensors) | set(want_tensors)):
        if got_tensors.get(k) != want_tensors.get(k):
            bad.append(k)
    for k in sorted(set(got_values) | set(want_values)):
        if json.dumps(got_values.get(k, "<missing>")) != json.dumps(want_values.get(k, "<missing>")):
            bad.append(k)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--reference", required=True, help="expected_fsdp2.json")
    ap.add_argument("--case", required=True, help="the case in the reference (the source folder's)")
    ap.add_argument("--ignore", default="", help="comma-separated checks that do not fail the run")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    ignore = {x for x in args.ignore.split(",") if x}
    unknown = ignore - set(CHECKS)
    if unknown:
        raise SystemExit(f"unknown checks in --ignore: {sorted(unknown)}")
    with open(args.reference) as f:
        ref = json.load(f)[args.case]

    capture = Capture()
    for name in ("accelerate", "accelerate.checkpointing"):
        logging.getLogger(name).addHandler(capture)
        logging.getLogger(name).setLevel(logging.INFO)

    acc = worker.make_accelerator()
    model, optim, sched, dl = worker.build_all(acc)
    rank, world = acc.process_index, acc.num_processes

    error = None
    try:
        acc.load_state(args.dir)
    except Exception as e:  # report it like any other failed check
        error = f"{type(e).__name__}: {e}"
    # RNG right after load_state, before anything else can draw from it.
    now_rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    res = {"rank": rank, "world_size": world, "dir": args.dir, "case": args.case, "ok": {}, "detail": {}}
    if error is not None:
        res["load_state_error"] = error[-2000:]
        for c in CHECKS:
            res["ok"][c] = False
    else:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        msd = get_model_state_dict(model, options=opts)
        osd = get_optimizer_state_dict(model, optim, options=opts)

        t, v = flat(msd)
        bad = compare(t, v, ref["merge_model"]["tensors"], {})
        res["ok"]["model"] = not bad
        res["detail"]["model_mismatch"] = bad

        t, v = flat(osd)
        want = ref["merge_optimizer_unsafe"]
        bad = compare(t, v, want["tensors"], want["values"])
        res["ok"]["optim"] = not bad
        res["detail"]["optim_mismatch"] = bad

        t, v = flat(sched.state_dict())
        bad = compare(t, v, ref["scheduler"]["tensors"], ref["scheduler"]["values"])
        res["ok"]["sched"] = not bad
        res["detail"]["sched"] = {"last_epoch": v.get("last_epoch"), "last_lr": v.get("_last_lr.0"),
                                  "mismatch": bad}

        want_step = ref["random_states"]["0"]["step"]
        res["ok"]["step"] = acc.step == want_step
        res["detail"]["step"] = {"got": acc.step, "want": want_step}

        # accelerate's `dl.state_dict()` is a snapshot refreshed only while iterating; what
        # `load_state_dict` handed the StatefulDataLoader waits in `next_iter_state` for the next iter().
        t, v = flat(getattr(dl.base_dataloader, "next_iter_state", None) or {})
        bad = compare(t, v, ref["dl_state_dict"]["tensors"], ref["dl_state_dict"]["values"])
        res["ok"]["dl"] = not bad
        res["detail"]["dl_mismatch"] = bad

        rng_file = os.path.join(args.dir, f"random_states_{rank}.pkl")
        digest = worker.rng_digest(*now_rng)
        rng = {"file": os.path.basename(rng_file), "file_present": os.path.exists(rng_file),
               "source_rank": [int(r) for r, d in sorted(ref["random_states"].items(), key=lambda x: int(x[0]))
                               if d["torch_sha256"] == digest["torch_sha256"]
                               and d["numpy"]["key_sha256"] == digest["numpy"]["key_sha256"]
                               and d["numpy"]["pos"] == digest["numpy"]["pos"]
                               and d["python"] == digest["python"]]}
        if rng["file_present"]:
            saved = torch.load(rng_file, weights_only=False)
            rng["loaded"] = {
                "torch": torch.equal(now_rng[0], saved["torch_manual_seed"]),
                "numpy": worker.rng_digest(saved["torch_manual_seed"], saved["numpy_random_seed"],
                                    saved["random_state"])["numpy"] == digest["numpy"],
                "python": now_rng[2] == saved["random_state"],
            }
        else:
            rng["loaded"] = {"torch": False, "numpy": False, "python": False}
        res["ok"]["rng"] = all(rng["loaded"].values())
        res["detail"]["rng"] = rng
        res["rng_source_rank"] = rng["source_rank"][0] if len(rng["source_rank"]) == 1 else rng["source_rank"]

    res["log_could_not_load_random_states"] = any("Could not load random states" in m for m in capture.messages)
    res["ignored"] = sorted(ignore)
    res["pass"] = all(ok for c, ok in res["ok"].items() if c not in ignore)
    line = json.dumps({"accelerate_load_check": res}, sort_keys=True)
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
            f.write(line + "\n")
    sys.stdout.write(line + "\n")  # one write, so ranks do not interleave within a line
    sys.stdout.flush()
    acc.wait_for_everyone()
    worker.finish(0 if res["pass"] else 1)


if __name__ == "__main__":
    main()
