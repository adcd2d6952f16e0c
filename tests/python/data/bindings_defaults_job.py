"""One rank of a torchrun job (gloo, CPU): accelerate's defaults through statekit's
prepare_data_loader against accelerate 1.15's own. (1) The default shuffle
(`use_seedable_sampler=False`) over 3 epochs, with and without a user generator: each rank
writes both sides' batches, the generators' states after them, and what a loader saved
mid-epoch and resumed in a fresh loader gave; per rank and dispatched. A pass broken off and
iterated again, on both sides and through statekit.accelerate. (2) Unbatched iterable loaders (`batch_size=None`)
dispatched from rank 0 (accelerate's default for iterable datasets): both sides' samples over
2 epochs.

    torchrun --nproc-per-node 2 tests/python/data/bindings_defaults_job.py OUT_DIR

Every rank seeds torch's global generator and its own user generator differently, so that the
batches only agree if rank 0's generator is the one each epoch is drawn from (accelerate
synchronizes it at each `__iter__`, as `Accelerator` asks with `rng_types=["generator"]`).
"""

import hashlib
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader as accelerate_prepare
from torch.utils.data import DataLoader, IterableDataset

from statekit.data import DataLoaderConfiguration, prepare_data_loader

from job_workers import workers

EPOCHS = 3
# world None: torchrun's; 1: a one-process loader on each rank (no generator given: torch's
# RandomSampler draws each epoch's seed from the global generator)
CONFIGS = [
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=False, workers=0, world=None),
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=True, workers=0, world=None),
    dict(n=29, bs=6, split=True, drop_last=False, even=True, user_gen=True, workers=0, world=None),
    dict(n=40, bs=3, split=False, drop_last=True, even=False, user_gen=False, workers=2, world=None),
    dict(n=23, bs=5, split=False, drop_last=False, even=False, user_gen=True, workers=2, world=None),
    dict(n=17, bs=4, split=False, drop_last=False, even=True, user_gen=False, workers=0, world=1),
    dict(n=17, bs=4, split=False, drop_last=False, even=True, user_gen=True, workers=0, world=1),
    # dispatched (accelerate's DataLoaderDispatcher): rank 0 alone draws the order
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=False, workers=0, world=None, dispatch=True),
    dict(n=29, bs=6, split=True, drop_last=False, even=True, user_gen=True, workers=0, world=None, dispatch=True),
    dict(n=23, bs=5, split=False, drop_last=True, even=True, user_gen=True, workers=2, world=None, dispatch=True),
]
# A pass broken off after `k` batches, then whole passes (`set_epoch` before them or not): the
# default shuffle per rank (with and without a user generator), dispatched, and the seedable sampler.
BROKEN = [
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=True, workers=0, world=None, k=2, set_epoch=False),
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=False, workers=0, world=None, k=3, set_epoch=True),
    dict(n=17, bs=4, split=False, drop_last=False, even=True, user_gen=False, workers=0, world=1, k=1, set_epoch=False),
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=True, workers=0, world=None, k=2, set_epoch=False,
         dispatch=True),
    dict(n=37, bs=4, split=False, drop_last=False, even=True, user_gen=True, workers=0, world=None, k=2, set_epoch=True,
         seedable=True),
]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def fresh(c, rank, salt=0):
    """The same starting point on both sides: the global generator and the user's seeded per rank."""
    torch.manual_seed(1000 + 17 * rank + salt)
    g = torch.Generator().manual_seed(77 + 5 * rank + salt) if c["user_gen"] else None
    dl = DataLoader(range(c["n"]), batch_size=c["bs"], shuffle=True, drop_last=c["drop_last"], generator=g,
                    **workers(c["workers"]))
    return dl, g


class Vectors(IterableDataset):
    """n samples, each a tensor of 2 values; offset per rank, so only rank 0's can reach the batches."""

    def __init__(self, n, rank):
        self.n, self.offset = n, 1000 * rank

    def __iter__(self):
        return iter([torch.tensor([self.offset + i, self.offset + 100 + i]) for i in range(self.n)])


def unbatched(n, rank):
    out = {}
    for who in ("accelerate", "statekit"):
        dl = DataLoader(Vectors(n, rank), batch_size=None)
        try:
            if who == "accelerate":
                got = accelerate_prepare(dl, device=torch.device("cpu"), put_on_device=True, dispatch_batches=True)
            else:
                got = prepare_data_loader(dl, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
            out[who] = [[b.tolist() for b in got] for _ in range(2)]
        except (ValueError, TypeError, RuntimeError) as e:
            out[who] = type(e).__name__
    return out


def broken(c, world, rank):
    """A `for` loop left with `break` after k batches, then EPOCHS whole `for` loops over the same
    prepared loader: accelerate's, statekit.data's and statekit.accelerate's, from one start."""
    from statekit import accelerate as sk_accelerate

    w, r = (world, rank) if c["world"] is None else (1, 0)
    kw = dict(split_batches=c["split"], even_batches=c["even"], dispatch_batches=c.get("dispatch", False),
              use_seedable_sampler=c.get("seedable", False))
    out = {}
    for who in ("accelerate", "statekit", "statekit.accelerate"):
        dl, g = fresh(c, rank)
        if who == "statekit":
            loader = prepare_data_loader(dl, num_processes=w, process_index=r, dataloader_config=DataLoaderConfiguration(**kw))
            set_epoch = loader.batch_sampler.set_epoch
        else:
            prep = accelerate_prepare if who == "accelerate" else sk_accelerate.prepare_data_loader
            loader = prep(dl, device=torch.device("cpu"), put_on_device=True, rng_types=["generator"], num_processes=w,
                          process_index=r, **kw)
            set_epoch = loader.set_epoch
        head = []
        for b in loader:
            head.append(b.tolist())
            if len(head) == c["k"]:
                break
        passes = []
        for e in range(EPOCHS):
            if c["set_epoch"]:
                set_epoch(e + 1)
            passes.append([b.tolist() for b in loader])
        out[who] = dict(head=head, passes=passes, **states(g))
    return out


def states(g):
    return dict(user=None if g is None else digest(g.get_state()), global_=digest(torch.get_rng_state()))


def main(out):
    state = Accelerator(cpu=True).state  # the gloo group; synchronize_rng_states needs the full state
    rank, world = state.process_index, state.num_processes
    results = []
    for c in configs():
        w, r = (world, rank) if c["world"] is None else (1, 0)
        dl, g = fresh(c, rank)
        acc = accelerate_prepare(dl, device=torch.device("cpu"), put_on_device=True, split_batches=c["split"],
                                 even_batches=c["even"], rng_types=["generator"], num_processes=w, process_index=r,
                                 dispatch_batches=c.get("dispatch", False))
        expected = [[b.tolist() for b in acc] for _ in range(EPOCHS)]
        expected_states = states(g)

        cfg = DataLoaderConfiguration(split_batches=c["split"], even_batches=c["even"],
                                      dispatch_batches=c.get("dispatch", False))
        dl, g = fresh(c, rank)
        ours = prepare_data_loader(dl, num_processes=w, process_index=r, dataloader_config=cfg)
        got = [[b.tolist() for b in ours] for _ in range(EPOCHS)]
        got_states = states(g)

        # Saved after epoch 0 and k batches of epoch 1, resumed by a fresh loader whose own
        # generators start elsewhere (salt): the saved state alone decides the rest.
        k = len(expected[1]) // 2
        dl, g = fresh(c, rank)
        first = prepare_data_loader(dl, num_processes=w, process_index=r, dataloader_config=cfg)
        list(first)
        it = iter(first)
        head = [next(it).tolist() for _ in range(k)]
        saved = json.loads(json.dumps(first.state_dict()))
        del it
        dl, g2 = fresh(c, rank, salt=1)
        resumed = prepare_data_loader(dl, num_processes=w, process_index=r, dataloader_config=cfg)
        resumed.load_state_dict(saved)
        tail = [[b.tolist() for b in resumed] for _ in range(EPOCHS - 1)]
        results.append(dict(config=c, expected=expected, got=got, head=head, tail=tail,
                            expected_states=expected_states, got_states=got_states,
                            resumed_user=None if g2 is None else digest(g2.get_state()),
                            len_ours=len(ours)))
    broken_results = [dict(config=c, **broken(c, world, rank)) for c in BROKEN]
    unbatched_results = []
    for n in (1, 2, 5, 6):
        torch.distributed.barrier()
        unbatched_results.append(dict(n=n, **unbatched(n, rank)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"shuffle": results, "unbatched": unbatched_results, "broken": broken_results}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def configs():
    return CONFIGS


if __name__ == "__main__":
    main(sys.argv[1])
