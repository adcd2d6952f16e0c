"""`statekit.accelerate`'s loaders on one process against torchdata 0.11's `StatefulDataLoader`
and accelerate 1.15's own classes: made directly (`DataLoaderShard(ds, batch_size=..,
shuffle=.., use_stateful_dataloader=True)`), they give the same batches over two epochs, a
`state_dict()` equal key for key (the generator state tensor included), and the same batches
after loading it, the next epoch too. torchdata's record of one process loads on two (every
remaining sample once), accelerate's own record of a batch sampler without state continues as
accelerate continues it, and a record of another order is refused by name.
"""

import pytest
import torch
from accelerate import data_loader as acc
from accelerate.state import AcceleratorState, GradientState, PartialState
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import statekit.accelerate as ours
from statekit.errors import MalformedState, StateMismatch

MAKERS = {
    "torchdata": lambda ds, **kw: StatefulDataLoader(ds, **kw),
    "accelerate": lambda ds, **kw: acc.DataLoaderShard(ds, use_stateful_dataloader=True, **kw),
    "shard": lambda ds, **kw: ours.DataLoaderShard(ds, use_stateful_dataloader=True, **kw),
    "dispatcher": lambda ds, **kw: ours.DataLoaderDispatcher(ds, use_stateful_dataloader=True, **kw),
}


@pytest.fixture(autouse=True)
def one_process():
    PartialState()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def same(a, b):
    """Equality of loader states, tensors compared by value."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def run(kind, shuffle, generator, num_workers, read=5):
    """The first `read` batches, the state then, and after loading that state into a new loader
    the rest of the epoch and the next epoch."""
    def make():
        torch.manual_seed(7)  # the seed torchdata's RandomSampler draws without a generator
        kw = {"generator": torch.Generator().manual_seed(42)} if generator else {}
        return MAKERS[kind](list(range(48)), batch_size=4, shuffle=shuffle, num_workers=num_workers, **kw)

    dl = make()
    first = []
    for b in dl:
        first.append(b.tolist())
        if len(first) == read:
            break
    state = dl.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    following = [b.tolist() for b in resumed]
    return first, state, rest, following


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle,generator", [(False, False), (True, True), (True, False)],
                         ids=["sequential", "shuffle-generator", "shuffle-global"])
@pytest.mark.parametrize("kind", ["shard", "dispatcher"])
def test_one_process_is_torchdatas_batches_state_and_resume(kind, shuffle, generator, num_workers):
    want = run("torchdata", shuffle, generator, num_workers)
    assert same(run("accelerate", shuffle, generator, num_workers)[1], want[1]), "accelerate's own is torchdata's"
    first, state, rest, following = run(kind, shuffle, generator, num_workers)
    assert first == want[0]
    assert same(state, want[1]), f"{state} != {want[1]}"
    assert rest == want[2], "the rest of the epoch after load_state_dict"
    assert following == want[3], "the epoch after"
    assert sorted(x for b in want[0] + want[2] for x in b) == list(range(48))


def test_a_one_process_record_loads_on_two_processes_and_deals_out_the_rest_once():
    ds = list(range(40))

    def prepared(world, rank):
        dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
        return ours.prepare_data_loader(dl, num_processes=world, process_index=rank, use_stateful_dataloader=True)

    one = prepared(1, 0)
    seen = []
    for i, b in enumerate(one):
        seen += b.tolist()
        if i == 3:
            break
    state = one.state_dict()
    assert state["_index_sampler_state"] is None and state["_sampler_iter_state"]["samples_yielded"] == 16
    for rank in range(2):
        dl = prepared(2, rank)
        dl.load_state_dict(state)
        seen += [x for b in dl for x in b.tolist()]
    assert sorted(seen) == ds


def test_accelerates_own_record_continues_as_accelerates_loader_continues():
    """accelerate's prepared loader keeps torch's batch sampler, which keeps no state: its record
    is the batches handed out (`_sampler_iter_yielded`), which torchdata fast-forwards over."""
    ds = list(range(40))

    def prepared(prepare):
        dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
        return prepare(dl, use_stateful_dataloader=True)

    theirs = prepared(acc.prepare_data_loader)
    for i, _ in enumerate(theirs):
        if i == 3:
            break
    state = theirs.state_dict()
    assert state["_index_sampler_state"] is None and state["_sampler_iter_state"] is None
    want = prepared(acc.prepare_data_loader)
    want.load_state_dict(state)
    mine = prepared(ours.prepare_data_loader)
    mine.load_state_dict(state)
    assert [b.tolist() for b in mine] == [b.tolist() for b in want]
    dispatched = ours.DataLoaderDispatcher(ds, batch_size=4, use_stateful_dataloader=True)
    with pytest.raises(MalformedState, match="no position a dispatched loader can continue from"):
        dispatched.load_state_dict(state)


def test_a_record_of_another_order_is_refused_by_name():
    shuffled = run("torchdata", True, True, 0)[1]
    sequential = run("torchdata", False, False, 0)[1]
    for state, kw, what in ((shuffled, {}, "holds a RandomSampler's generator"),
                            (sequential, {"shuffle": True, "generator": torch.Generator()}, "holds no generator")):
        dl = ours.DataLoaderShard(list(range(48)), batch_size=4, use_stateful_dataloader=True, **kw)
        dl.load_state_dict(state)
        with pytest.raises(StateMismatch, match=what) as e:
            next(iter(dl))
        assert e.value.field == "sampler"
