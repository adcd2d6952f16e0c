"""Saves accelerate 1.15 `save_state` folders mid-epoch from stateful, seedable dataloaders
and records what each rank's loader yields next, for `test_accelerate_data_bridge.py`.

    torchrun --nproc_per_node P accelerate_data_job.py OUT_DIR CONFIGS_JSON

Each config: {"name", "len", "batch_size", "seed", "epoch", "k", "drop_last"[, "workers"]}: the loader
runs `epoch` whole epochs, then `k` batches, then `save_state(OUT_DIR/name)`; the rest of
that epoch is recorded per rank in OUT_DIR/name.rank{R}.json.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from torch.utils.data import DataLoader

from job_workers import workers


def main():
    out, configs = sys.argv[1], json.loads(sys.argv[2])
    for c in configs:
        cfg = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=c["seed"])
        acc = Accelerator(cpu=True, dataloader_config=cfg, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        base = DataLoader(list(range(c["len"])), batch_size=c["batch_size"], shuffle=True, drop_last=c["drop_last"],
                          **workers(c.get("workers", 0)))
        dl = acc.prepare(base)
        for _ in range(c["epoch"]):
            for _ in dl:
                pass
        it = iter(dl)
        for _ in range(c["k"]):
            next(it)
        acc.save_state(os.path.join(out, c["name"]))
        rest = [b.tolist() for b in it]
        with open(os.path.join(out, f"{c['name']}.rank{acc.process_index}.json"), "w") as f:
            json.dump({"rest": rest, "world": acc.num_processes}, f)
        acc.wait_for_everyone()
        acc.free_memory()
        del dl, acc
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


if __name__ == "__main__":
    main()
    # Everything is written and every rank past its last barrier: skip the interpreter's
    # teardown, where gloo's threads are sometimes destroyed unjoined on CPU and abort the
    # rank after the work is done (seen once in CI: "terminate called without an active
    # exception"), as the other jobs here do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
