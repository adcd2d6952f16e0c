"""One rank of a torchrun job (gloo, CPU) reading a `statekit.data.Mixture` through
`statekit.data.prepare_data_loader` (torchdata's StatefulDataLoader over `ShardedBatchSampler`,
the world taken from torch.distributed):

* an uninterrupted epoch;
* the same epoch read to step STOP, its state taken, and the rest read by a new loader that
  loads it (the same world: it must read what the uninterrupted run read after STOP);
* the rest of the epoch from STATE_FILE, a state saved on another world size (elastic).

Every rank writes what it read to OUT/rank{r}.json.

    torchrun --nproc-per-node 2 tests/python/data/mixture_job.py OUT STOP STATE_FILE
"""

import json
import os
import sys

import torch.distributed as dist
from torch.utils.data import DataLoader

from statekit.data import DataLoaderConfiguration, Mixture, prepare_data_loader

# The mixture of the test (test_mixture.py builds the same one).
SIZES, WEIGHTS, ONCE, LENGTH, SEED, BATCH = (50, 23, 31), (0.6, 0.3, 0.1), (1,), 301, 11, 4
OFFSETS = (0, 1000, 2000)


def mixture():
    datasets = [list(range(o, o + n)) for o, n in zip(OFFSETS, SIZES)]
    return Mixture.of(datasets, WEIGHTS, seed=SEED, once=ONCE, length=LENGTH)


def loader():
    return prepare_data_loader(DataLoader(mixture(), batch_size=BATCH),
                               dataloader_config=DataLoaderConfiguration(even_batches=False))


def read(dl, stop=None):
    out = []
    for batch in dl:
        out.append(batch.tolist())
        if stop is not None and len(out) == stop:
            break
    return out


def main(out, stop, state_file):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = int(stop)
    whole = read(loader())
    first = loader()
    head = read(first, stop)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = read(resumed)
    with open(state_file) as f:
        elastic = loader()
        elastic.batch_sampler.load_state_dict(json.load(f))
        moved = read(elastic)
    recorded = first.batch_sampler.state_dict()["mixture"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"whole": whole, "head": head, "rest": rest, "elastic": moved, "mixture": recorded,
                   "world": dist.get_world_size()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # torch's gloo teardown at interpreter exit aborts now and then on this machine (see
    # bindings_sharded_job.py); everything is written and the group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
