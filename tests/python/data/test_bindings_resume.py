"""A small torch training loop over statekit's sampler in torchdata's StatefulDataLoader,
interrupted mid-epoch and resumed (with and without workers, on the same and on another world
size)."""

import io
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from statekit.data import ShardedBatchSampler


class Squares(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.tensor([float(i)])
        return {"idx": i, "x": x, "y": 2 * x + 1}


def loader_for(n, bs, world, rank, workers, **kw):
    sampler = ShardedBatchSampler(n, bs, num_processes=world, process_index=rank, shuffle=True, seed=1234, **kw)
    return StatefulDataLoader(Squares(n), batch_sampler=sampler, num_workers=workers)


def train(loader, steps=None, model=None, epochs=1):
    """Runs SGD steps over the loader; returns the sample indices seen, in order."""
    model = model or torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    seen = []
    for epoch in range(epochs):
        loader.batch_sampler.set_epoch(loader.batch_sampler.epoch)
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(batch["idx"].tolist())
            if steps is not None and len(seen) == steps:
                return seen
    return seen


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [1, 7, 12])
def test_interrupted_and_resumed_sees_what_an_uninterrupted_run_sees(workers, stop):
    n, bs, world = 103, 4, 2
    for rank in range(world):
        full = train(loader_for(n, bs, world, rank, workers), epochs=2)
        first = loader_for(n, bs, world, rank, workers)
        head = train(first, steps=stop)
        state = roundtrip(first.state_dict())
        second = loader_for(n, bs, world, rank, workers)
        second.load_state_dict(state)
        tail = train(second, epochs=2)[: len(full) - stop]
        assert head + tail == full, (rank, workers, stop)


@pytest.mark.parametrize("workers", [0, 2])
def test_resumed_on_another_world_size_every_sample_is_seen_once(workers):
    n, bs, stop = 101, 3, 5
    for old, new in [(2, 3), (4, 1), (3, 5)]:
        seen = Counter()
        state = None
        for rank in range(old):
            loader = loader_for(n, bs, old, rank, workers, even_batches=False)
            for b in train(loader, steps=stop):
                seen.update(b)
            state = roundtrip(loader.state_dict()) if rank == 0 else state
        for rank in range(new):
            loader = loader_for(n, bs, new, rank, workers, even_batches=False)
            loader.load_state_dict(state)
            for b in train(loader):
                seen.update(b)
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, (old, new)


def test_restoring_costs_the_same_far_into_an_epoch():
    import time

    n, bs = 10**9, 8
    s = ShardedBatchSampler(n, bs, num_processes=4, process_index=1)
    s.skip_first_batches(10**7)
    state = s.state_dict()
    assert state["cursor"] == 10**7 * bs * 4
    t0 = time.perf_counter()
    r = ShardedBatchSampler(n, bs, num_processes=4, process_index=1)
    r.load_state_dict(state)
    first = next(iter(r))
    assert time.perf_counter() - t0 < 1.0
    assert first == [10**7 * bs * 4 + bs * 1 + i for i in range(bs)]
