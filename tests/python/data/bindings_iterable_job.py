"""One rank of a torchrun job (gloo, CPU): statekit's prepare_data_loader over an iterable
dataset against accelerate 1.15's, dispatch_batches=True (its DataLoaderDispatcher: rank 0 reads
and broadcasts) and False (IterableDatasetShard), world taken from the process group. The stream
differs per rank (offset 1000 * rank), so only rank 0's may reach the batches in dispatch mode.

    torchrun --nproc-per-node W tests/python/data/bindings_iterable_job.py OUT_DIR
"""

import json
import os
import sys

import torch.distributed
from accelerate import PartialState
from accelerate.data_loader import prepare_data_loader as accelerate_prepare
from torch.utils.data import DataLoader, IterableDataset

from statekit.data import DataLoaderConfiguration, prepare_data_loader


class RankStream(IterableDataset):
    def __init__(self, n, rank):
        self.n, self.offset, self.epoch = n, 1000 * rank, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([self.offset + (i + 3 * self.epoch) % self.n for i in range(self.n)])

    def __len__(self):
        return self.n


CONFIGS = [(n, bs, drop_last, split) for n in (0, 1, 3, 7, 9, 10, 16) for bs in (1, 2, 4)
           for drop_last in (False, True) for split in (False, True)]


def run(dl):
    out = []
    for epoch in range(2):
        dl.set_epoch(epoch)
        out.append([b.tolist() for b in dl])
    try:
        n = len(dl)
    except TypeError:
        n = None
    return {"batches": out, "len": n}


def main(out):
    state = PartialState(cpu=True)
    rank = state.process_index
    results = []
    for n, bs, drop_last, split in CONFIGS:
        for dispatch in (True, False):
            # Keep the ranks in step: a loader that failed on one rank part-way through its
            # collectives must not pair its leftovers with the next loader's.
            torch.distributed.barrier()
            entry = {"config": [n, bs, drop_last, split, dispatch]}
            for who in ("accelerate", "statekit"):
                dl = DataLoader(RankStream(n, rank), batch_size=bs, drop_last=drop_last)
                try:
                    if who == "accelerate":
                        got = accelerate_prepare(dl, put_on_device=dispatch, split_batches=split, dispatch_batches=dispatch)
                    else:
                        got = prepare_data_loader(dl, dataloader_config=DataLoaderConfiguration(
                            split_batches=split, dispatch_batches=dispatch))
                    entry[who] = run(got)
                except (ValueError, TypeError, RuntimeError) as e:
                    entry[who] = {"error": type(e).__name__}
            results.append(entry)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
