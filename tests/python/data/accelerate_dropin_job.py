"""An accelerate 1.15 training script with the one `statekit.accelerate.patch` line, for
`test_accelerate_dropin_resume.py`. Run under torchrun (gloo, CPU):

    accelerate_dropin_job.py train  OUT SAVE_AT SHUFFLE  # train, save_state after SAVE_AT steps, go
                                                         # on 2 steps, write OUT/past_save, then wait
                                                         # to be killed
    accelerate_dropin_job.py resume OUT CKPT SHUFFLE     # load_state(CKPT), train the rest of the
                                                         # epoch, then the evaluation epochs

SHUFFLE is `seedable` (`use_seedable_sampler=True, data_seed=1234`) or `default` (accelerate's
default configuration: a `RandomSampler` and a generator); the loader is stateful in both.

Every rank writes its pid to OUT/pid.rank<R> (the test kills each rank by it) and appends the
sample ids of each batch it trains on to OUT/<mode>.rank<R>.txt (`step id id ...`, flushed and
fsynced before the optimizer step, so a kill loses nothing written). The evaluation (resume
mode) gathers ids with `gather_for_metrics` over whole epochs, through the patched
accelerator's loaders and through accelerate's own `prepare_data_loader`, and writes both per
case to OUT/eval.json (rank 0).
"""

import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader as accelerates_prepare
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader, TensorDataset

import statekit.accelerate

N, BATCH, SEED = 100, 4, 1234


def dataset(n):
    ids = torch.arange(n)
    return TensorDataset(ids, torch.randn(n, 3, generator=torch.Generator().manual_seed(0)))


def main():
    mode, out, arg, shuffle = sys.argv[1:5]
    set_seed(SEED)
    if shuffle == "seedable":
        config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=SEED)
    else:
        config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    accelerator = statekit.accelerate.patch(accelerator)  # the one line

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = DataLoader(dataset(N), batch_size=BATCH, shuffle=True)
    model, optimizer, train = accelerator.prepare(model, optimizer, train)
    assert isinstance(train, statekit.accelerate.DataLoaderShard), type(train)

    if mode == "resume":
        accelerator.load_state(arg)
    save_at = int(arg) if mode == "train" else None
    with open(os.path.join(out, f"pid.rank{accelerator.process_index}"), "w") as f:
        f.write(str(os.getpid()))
    log = open(os.path.join(out, f"{mode}.rank{accelerator.process_index}.txt"), "a")
    for step, (ids, x) in enumerate(train):
        log.write(f"{step} {' '.join(map(str, ids.tolist()))}\n")
        log.flush()
        os.fsync(log.fileno())
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(os.path.join(out, "ckpt"))
        if save_at is not None and step + 1 == save_at + 2:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                open(os.path.join(out, "past_save"), "w").close()
            while True:  # mid-epoch, until the test kills every rank with SIGKILL
                time.sleep(1)
    log.close()
    if mode == "resume" and shuffle == "seedable":  # (the evaluation loaders do not shuffle: once is enough)
        evaluate(accelerator, out)
    accelerator.wait_for_everyone()


class Stream(torch.utils.data.IterableDataset):
    """The samples of `dataset(n)` as a stream."""

    def __init__(self, n):
        self.items = dataset(n)

    def __iter__(self):
        return iter(self.items)


class SizedStream(Stream):
    def __len__(self):
        return len(self.items)


def evaluate(accelerator, out):
    """`gather_for_metrics` over whole evaluation epochs, ours against accelerate's own loader."""
    cases = {}
    for n, kind in ((50, "map"), (48, "map"), (7, "map"), (50, "stream"), (7, "sized stream")):
        for dispatch in (False, True):
            # even_batches stays on: with uneven counts some ranks would gather on steps others
            # never take (accelerate's gather then hangs)
            kw = dict(device=accelerator.device, num_processes=accelerator.num_processes,
                      process_index=accelerator.process_index, put_on_device=True, dispatch_batches=dispatch)
            got = {}
            for who, prepare in (("statekit", statekit.accelerate.prepare_data_loader), ("accelerate", accelerates_prepare)):
                data = {"map": dataset, "stream": Stream, "sized stream": SizedStream}[kind](n)
                dl = prepare(DataLoader(data, batch_size=BATCH), **kw)
                ids, steps = [], 0
                for batch_ids, _ in dl:
                    ids += accelerator.gather_for_metrics(batch_ids).tolist()
                    steps += 1
                got[who] = ids
                got[f"{who} len, steps"] = [len(dl), steps] if kind != "stream" else [None, steps]
            cases[f"{kind} n{n} dispatch{int(dispatch)}"] = got
    if accelerator.is_main_process:
        with open(os.path.join(out, "eval.json"), "w") as f:
            json.dump(cases, f)


if __name__ == "__main__":
    main()
    # Everything is written and every rank past its last barrier: skip the interpreter's
    # teardown, where gloo's threads are sometimes destroyed unjoined on CPU and abort the
    # rank after the work is done (seen once in CI: "terminate called without an active
    # exception"), as the other jobs here do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
