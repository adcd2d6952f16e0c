"""One rank of a torchrun job (gloo, CPU): statekit's prepare_data_loader(dispatch_batches=True)
against accelerate's (its DataLoaderDispatcher) over the same datasets; each rank writes what
both gave, and what a loader resumed mid-epoch gave, for the test to compare.

    torchrun --nproc-per-node W tests/python/data/bindings_dispatch_job.py OUT_DIR [tiny]

`tiny` runs the datasets smaller than a global batch, where some rank's slice of the last one
is empty (accelerate gives it an empty batch).
"""

import json
import os
import sys

import torch
from accelerate import PartialState
from accelerate.data_loader import prepare_data_loader as accelerate_prepare
from torch.utils.data import DataLoader

from statekit.data import DataLoaderConfiguration, prepare_data_loader

from job_workers import workers

# n, batch size, split_batches, shuffle, drop_last, even_batches, seed (per rank: seed + rank *
# seed_step, which only rank 0's counts in accelerate), workers
CONFIGS = [
    dict(n=11, bs=3, split=False, shuffle=False, drop_last=False, even=True, seed=0, seed_step=0, workers=0),
    dict(n=37, bs=4, split=False, shuffle=True, drop_last=False, even=True, seed=42, seed_step=7, workers=0),
    dict(n=37, bs=4, split=False, shuffle=True, drop_last=True, even=False, seed=5, seed_step=0, workers=2),
    dict(n=29, bs=6, split=True, shuffle=True, drop_last=False, even=True, seed=2**40 + 3, seed_step=1, workers=0),
    dict(n=29, bs=4, split=True, shuffle=False, drop_last=True, even=False, seed=0, seed_step=0, workers=0),
    dict(n=40, bs=5, split=False, shuffle=True, drop_last=False, even=False, seed=9, seed_step=0, workers=0),
    dict(n=3, bs=2, split=False, shuffle=False, drop_last=False, even=True, seed=0, seed_step=0, workers=0),
]

TINY = [
    dict(n=1, bs=1, split=False, shuffle=False, drop_last=False, even=True, seed=0, seed_step=0, workers=0),
    dict(n=2, bs=1, split=False, shuffle=True, drop_last=False, even=True, seed=3, seed_step=0, workers=0),
    dict(n=1, bs=2, split=False, shuffle=False, drop_last=False, even=False, seed=0, seed_step=0, workers=0),
    dict(n=1, bs=3, split=True, shuffle=False, drop_last=False, even=True, seed=0, seed_step=0, workers=0),
    dict(n=4, bs=1, split=False, shuffle=False, drop_last=False, even=True, seed=0, seed_step=0, workers=2),
]


def loader(c):
    return DataLoader(range(c["n"]), batch_size=c["bs"], shuffle=c["shuffle"], drop_last=c["drop_last"],
                      **workers(c["workers"]))


def main(out, configs):
    state = PartialState(cpu=True)  # the gloo process group, from torchrun's environment
    rank = state.process_index
    results = []
    for c in configs:
        seed = c["seed"] + rank * c["seed_step"] if c["shuffle"] else None
        acc = accelerate_prepare(
            loader(c), device=torch.device("cpu"), put_on_device=True, dispatch_batches=True, split_batches=c["split"],
            even_batches=c["even"], use_seedable_sampler=True, data_seed=seed,
        )
        expected = [[b.tolist() for b in acc] for _ in range(2)]
        cfg = DataLoaderConfiguration(dispatch_batches=True, split_batches=c["split"], even_batches=c["even"],
                                      use_seedable_sampler=True, data_seed=seed)
        ours = prepare_data_loader(loader(c), dataloader_config=cfg)
        got = [[b.tolist() for b in ours] for _ in range(2)]
        # Interrupted after k batches of the first epoch, resumed in a fresh loader.
        k = len(expected[0]) // 2
        first = prepare_data_loader(loader(c), dataloader_config=cfg)
        it = iter(first)
        head = [next(it).tolist() for _ in range(k)]
        saved = json.loads(json.dumps(first.state_dict()))
        del it
        resumed = prepare_data_loader(loader(c), dataloader_config=cfg)
        resumed.load_state_dict(saved)
        tail = [b.tolist() for b in resumed]
        results.append(dict(config=c, expected=expected, got=got, len_ours=len(ours), head=head, tail=tail))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], TINY if sys.argv[2:] == ["tiny"] else CONFIGS)
