"""`statekit.accelerate` against accelerate 1.15 itself, in one process (each rank of a world
given by `num_processes`/`process_index`, as accelerate's own tests do): the batches every rank
gets over several epochs, `skip_first_batches`, the attributes `GradientState` and
`gather_for_metrics` read, a state moved from 2 ranks to 3, a broken-off pass, and `patch` with
`save_state`/`load_state`. The torchrun runs are in `test_accelerate_dropin_resume.py`.
"""

import itertools

import pytest
import torch
from accelerate import Accelerator
from accelerate import data_loader as acc
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import statekit.accelerate as ours
from statekit.data import ShardedBatchSampler


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def batches(dl):
    return [b.tolist() for b in dl]


def both(n, batch_size, world, rank, *, shuffle=False, drop_last=False, **kw):
    """(ours, accelerate's) prepared loaders of rank `rank` of `world` over range(n)."""
    if shuffle:
        kw = {"use_seedable_sampler": True, "data_seed": 7, **kw}
    made = []
    for prepare in (ours.prepare_data_loader, acc.prepare_data_loader):
        dl = DataLoader(list(range(n)), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
        made.append(prepare(dl, num_processes=world, process_index=rank, **kw))
    return made


GRID = [
    dict(n=n, batch_size=bs, world=w, shuffle=sh, drop_last=dl, split_batches=sp, even_batches=ev)
    for n, bs, w, sh, dl, sp, ev in itertools.product(
        (23, 24, 2), (4,), (2, 3), (False, True), (False, True), (False, True), (True, False))
    if not (sp and bs % w)
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(f"{k}{int(v)}" for k, v in c.items()))
def test_every_rank_gets_accelerates_batches_over_three_epochs(case):
    case = dict(case)
    world = case.pop("world")
    for rank in range(world):
        mine, theirs = both(world=world, rank=rank, **case)
        assert isinstance(mine, ours.DataLoaderShard) and isinstance(mine.batch_sampler, ShardedBatchSampler)
        for epoch in range(3):
            got, want = batches(mine), batches(theirs)
            assert got == want, f"rank {rank} epoch {epoch}"
            assert len(mine) == len(got)
            # accelerate's len() with split_batches is the underlying loader's, even for a rank
            # that even_batches=False leaves without a last batch (one too many there)
            overstated = case["split_batches"] and not case["even_batches"] and len(theirs) == len(want) + 1
            assert len(theirs) == len(want) or overstated
            assert mine.iteration == theirs.iteration  # (an empty pass does not count, in accelerate)


def test_the_attributes_accelerate_reads_are_accelerates():
    for rank in range(3):
        mine, theirs = both(23, 4, 3, rank, shuffle=True)
        assert isinstance(mine, acc.DataLoaderShard) and isinstance(mine, DataLoader)
        assert isinstance(mine, acc.DataLoaderStateMixin)
        assert mine.use_stateful_dataloader is theirs.use_stateful_dataloader is False
        assert mine.total_batch_size == theirs.total_batch_size == 12
        assert mine.total_dataset_length == theirs.total_dataset_length == 23
        flags = []
        for a, b in zip(mine, theirs):
            flags.append((mine.end_of_dataloader, mine.remainder, theirs.end_of_dataloader, theirs.remainder))
        assert [f[:2] for f in flags] == [f[2:] for f in flags]
        assert flags[-1][:2] == (True, 23 % 12), "gather_for_metrics keeps the 11 real rows of the last step"
    split = ours.prepare_data_loader(DataLoader(list(range(10)), batch_size=4), num_processes=2, process_index=0,
                                     split_batches=True)
    assert split.total_batch_size == 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_skip_first_batches_is_accelerates_without_replaying(shuffle):
    for rank in range(2):
        mine, theirs = both(37, 3, 2, rank, shuffle=shuffle)
        mine.set_epoch(1)
        theirs.set_epoch(1)
        for k in (0, 1, 4, len(theirs)):
            a, b = ours.skip_first_batches(mine, k), acc.skip_first_batches(theirs, k)
            assert isinstance(a, ours.DataLoaderShard)
            assert a.iteration == b.iteration == 1
            assert len(a) == len(b)
            for epoch in (1, 2):  # accelerate's skipped loader skips on every pass
                assert batches(a) == batches(b), f"rank {rank} skip {k} epoch {epoch}"


class Numbers(torch.utils.data.Dataset):
    """range(n) for an n no loop over the epoch could walk."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def test_skip_first_batches_moves_the_position_it_does_not_walk_to_it():
    k, bs, world = 10**7, 4, 2
    dl = ours.prepare_data_loader(DataLoader(Numbers(10**12), batch_size=bs), num_processes=world, process_index=1)
    skipped = ours.skip_first_batches(dl, k)
    first = next(iter(skipped)).tolist()
    assert first == list(range(k * bs * world + bs, k * bs * world + 2 * bs))


def test_a_state_saved_on_2_ranks_loads_on_3_and_deals_out_the_rest_once():
    n, bs, read = 60, 2, 3
    cfg = dict(shuffle=True, use_stateful_dataloader=True)
    seen, states = [], []
    for rank in range(2):
        dl = both(n, bs, 2, rank, **cfg)[0]
        it = iter(dl)
        for _ in range(read):
            seen += next(it).tolist()
        states.append(dl.state_dict())
    assert states[0]["_index_sampler_state"] == states[1]["_index_sampler_state"], "the same on every rank"
    assert states[0]["_num_yielded"] == read
    for rank in range(3):
        dl = both(n, bs, 3, rank, **cfg)[0]
        dl.load_state_dict(states[rank % 2])
        seen += [i for b in dl for i in b.tolist()]
        assert dl.iteration == 1, "the epoch read to its end"
    assert sorted(seen) == list(range(n))


def test_a_pass_broken_off_starts_the_epoch_again_as_accelerates_does():
    mine, theirs = both(20, 2, 2, 0, shuffle=True)
    for dl in (mine, theirs):
        for i, _ in enumerate(dl):
            if i == 1:
                break
    assert batches(mine) == batches(theirs)
    assert mine.iteration == theirs.iteration == 1


def test_a_batch_sampler_statekit_does_not_model_stays_accelerates():
    class EveryOther(BatchSampler):
        def __iter__(self):
            yield from list(super().__iter__())[::2]

    dl = DataLoader(list(range(16)), batch_sampler=EveryOther(SequentialSampler(range(16)), 2, False))
    prepared = ours.prepare_data_loader(dl, num_processes=2, process_index=0)
    assert type(prepared) is acc.DataLoaderShard
    assert batches(prepared) == [[0, 1], [8, 9]]


def test_patch_routes_prepare_and_skip_and_save_state_restores_the_position(tmp_path):
    cfg = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=3)
    accelerator = ours.patch(Accelerator(cpu=True, dataloader_config=cfg))
    assert isinstance(accelerator, Accelerator)
    dl = accelerator.prepare(DataLoader(list(range(30)), batch_size=4, shuffle=True))
    assert isinstance(dl, ours.DataLoaderShard) and dl in accelerator._dataloaders
    assert isinstance(accelerator.skip_first_batches(dl, 2), ours.DataLoaderShard)
    it = iter(dl)
    head = [next(it).tolist() for _ in range(3)]
    accelerator.save_state(tmp_path / "ckpt")
    rest = [b.tolist() for b in it]
    assert (tmp_path / "ckpt" / "dl_state_dict.bin").is_file()
    assert type(Accelerator(cpu=True)).prepare_data_loader is Accelerator.prepare_data_loader, "one accelerator only"

    AcceleratorState._reset_state(True)
    again = ours.patch(Accelerator(cpu=True, dataloader_config=cfg))
    dl2 = again.prepare(DataLoader(list(range(30)), batch_size=4, shuffle=True))
    again.load_state(tmp_path / "ckpt")
    assert batches(dl2) == rest
    assert len(head) + len(rest) == len(dl)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("user_generator", [False, True])
def test_accelerates_default_shuffle_over_three_epochs(world, user_generator):
    """`use_seedable_sampler=False` (accelerate's default): the `RandomSampler` keeps a
    generator (a fresh one seeded from torch's global generator when prepared on several
    processes, else the user's) and every epoch is a randperm from its running state."""
    for rank in range(world):
        made = []
        for prepare in (ours.prepare_data_loader, acc.prepare_data_loader):
            torch.manual_seed(11)
            gen = torch.Generator().manual_seed(5) if user_generator else None
            dl = DataLoader(list(range(23)), batch_size=3, shuffle=True, generator=gen)
            made.append(prepare(dl, num_processes=world, process_index=rank))
        mine, theirs = made
        assert isinstance(mine.batch_sampler, ShardedBatchSampler)
        for epoch in range(3):
            torch.manual_seed(100 + epoch)  # what a pass draws from the global generator, the same for both
            got = batches(mine)
            torch.manual_seed(100 + epoch)
            assert got == batches(theirs), f"rank {rank} epoch {epoch}"


class Stream(torch.utils.data.IterableDataset):
    """0, 1, ..., n - 1, counting the items it produced; with `stateful`, torchdata's
    `Stateful` protocol (its position is the next item)."""

    def __init__(self, n, stateful=False):
        self.n, self.produced, self.start = n, 0, 0
        if stateful:
            self.state_dict = lambda: {"next": self.start + self.taken}
            self.load_state_dict = lambda st: setattr(self, "start", st["next"])

    def __iter__(self):
        self.taken = 0
        for i in range(self.start, self.n):
            self.produced += 1
            self.taken += 1
            yield i
        self.start = 0


@pytest.mark.parametrize("stateful", [False, True])
def test_an_iterable_dataset_resumes_mid_epoch(stateful):
    """Every rank's iterable loader (statekit's `IterableDatasetShard`) continues after the
    batches it had read: by replaying them, or in O(1) through the dataset's own state."""
    world, n, bs, read = 2, 40, 2, 3
    for rank in range(world):
        def prepared():
            return ours.prepare_data_loader(DataLoader(Stream(n, stateful), batch_size=bs), num_processes=world,
                                            process_index=rank, use_stateful_dataloader=True)
        whole = batches(prepared())
        first = prepared()
        it = iter(first)
        head = [next(it).tolist() for _ in range(read)]
        assert head == whole[:read]
        again = prepared()
        again.load_state_dict(first.state_dict())
        assert batches(again) == whole[read:], f"rank {rank}"
        skipped = ours.skip_first_batches(prepared(), read)
        assert batches(skipped) == whole[read:], f"rank {rank}: skip_first_batches replays"
        if stateful:
            stream = again.dataset.dataset
            assert stream.produced == n - read * bs * world, "resumed from the dataset's state, nothing replayed"


def test_a_loader_pickles_as_accelerates_does_and_the_copy_goes_on_from_its_epoch():
    import pickle

    mine, theirs = both(10, 2, 2, 1, shuffle=True)
    assert batches(mine) == batches(theirs)
    for cls, dl in ((ours.DataLoaderShard, mine), (acc.DataLoaderShard, theirs)):
        copy = pickle.loads(pickle.dumps(dl))
        assert type(copy) is cls and copy.iteration == 1
    assert batches(pickle.loads(pickle.dumps(mine))) == batches(theirs)
    dispatcher = ours.DataLoaderDispatcher(list(range(8)), batch_size=2)
    assert batches(pickle.loads(pickle.dumps(dispatcher))) == batches(dispatcher)


def test_bad_input_is_refused_by_name():
    from statekit.errors import StateMismatch, UsageError

    dl = both(20, 2, 2, 0, use_stateful_dataloader=True)[0]
    with pytest.raises(UsageError, match="`num_batches` must be an int in \\[0, 2\\^64 - 1\\], not -1"):
        ours.skip_first_batches(dl, -1)
    other = both(21, 2, 2, 0, use_stateful_dataloader=True)[0]
    other.load_state_dict(dl.state_dict())
    with pytest.raises(StateMismatch) as refused:
        next(iter(other))
    assert refused.value.field == "dataset_len"
