"""statekit.data.prepare_data_loader over torch ``IterableDataset``s against accelerate 1.15:
``IterableDatasetShard`` (dispatch_batches=False) compared with the real accelerate on many
configurations and ranks, over two epochs, and the vectors of the spec (§3, §4) without it."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from conftest import torchrun
from statekit.data import DataLoaderConfiguration, IterableDatasetShard, prepare_data_loader
from statekit.errors import UsageError

accelerate_data_loader = pytest.importorskip("accelerate.data_loader")


class Stream(IterableDataset):
    """0..n-1, sized."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


class UnsizedStream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class EpochStream(Stream):
    """Has ``set_epoch``: the order rotates with the epoch."""

    epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([(i + 3 * self.epoch) % self.n for i in range(self.n)])


class GeneratorStream(IterableDataset):
    """Has a torch ``generator`` attribute and no ``set_epoch``: the shard reseeds it per epoch."""

    def __init__(self, n):
        self.n = n
        self.generator = torch.Generator().manual_seed(1234)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


KINDS = {"sized": Stream, "unsized": UnsizedStream, "epoch": EpochStream, "generator": GeneratorStream}


def as_lists(batches):
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def two_epochs(dl, call_set_epoch):
    out = []
    for epoch in range(2):
        if call_set_epoch:
            dl.set_epoch(epoch)
        out.append(as_lists(list(dl)))
    return out


def length(dl):
    try:
        return len(dl)
    except TypeError as e:
        return type(e)


def accelerate_loader(kind, n, bs, drop_last, split, P, p):
    dl = DataLoader(KINDS[kind](n), batch_size=bs, drop_last=drop_last)
    return accelerate_data_loader.prepare_data_loader(
        dl, num_processes=P, process_index=p, put_on_device=False, split_batches=split, dispatch_batches=False)


def our_loader(kind, n, bs, drop_last, split, P, p):
    dl = DataLoader(KINDS[kind](n), batch_size=bs, drop_last=drop_last)
    cfg = DataLoaderConfiguration(split_batches=split, dispatch_batches=False)
    return prepare_data_loader(dl, num_processes=P, process_index=p, dataloader_config=cfg)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_per_rank_batches_equal_accelerates(P, kind):
    checked = 0
    for n, bs, drop_last, split in itertools.product(range(0, 14), [1, 2, 3, 4, 6], [False, True], [False, True]):
        for p in range(P):
            args = (kind, n, bs, drop_last, split, P, p)
            try:
                theirs = accelerate_loader(*args)
            except ValueError:
                with pytest.raises(UsageError):
                    our_loader(*args)
                continue
            ours = our_loader(*args)
            assert length(ours) == length(theirs), args
            call = (n + bs + p) % 2 == 0  # half with explicit set_epoch, half with the loaders' own count
            assert two_epochs(ours, call) == two_epochs(theirs, call), args
            if P > 1:
                assert len_or_type(ours.dataset) == len_or_type(theirs.dataset), args
            checked += 1
    assert checked > 100


def len_or_type(ds):
    try:
        return len(ds)
    except TypeError as e:
        return type(e)


def test_split_batches_needs_a_batch_size_divisible_by_the_world():
    dl = DataLoader(Stream(10), batch_size=3)
    with pytest.raises(UsageError, match="does not divide"):
        prepare_data_loader(dl, num_processes=2, process_index=0,
                            dataloader_config=DataLoaderConfiguration(split_batches=True, dispatch_batches=False))
    with pytest.raises(UsageError, match="does not divide"):
        IterableDatasetShard(Stream(10), batch_size=3, num_processes=2, split_batches=True)


def test_the_shard_is_a_torch_iterable_dataset_and_pickles():
    import pickle

    shard = IterableDatasetShard(Stream(10), batch_size=2, num_processes=2, process_index=1)
    assert isinstance(shard, IterableDataset)
    again = pickle.loads(pickle.dumps(shard))
    assert list(again) == [2, 3, 6, 7, 0, 1]


def test_the_loader_is_stateful_when_torchdata_is_installed():
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    dl = prepare_data_loader(DataLoader(Stream(10), batch_size=2), num_processes=2, process_index=0,
                             dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    assert isinstance(dl, tdl.StatefulDataLoader)
    assert dl.batch_size == 2


# Spec §3, generated with accelerate 1.15: (n, bs, drop_last, split, P, per-rank streams, len of the shard)
SPEC3 = [
    (8, 2, False, False, 2, [[0, 1, 4, 5], [2, 3, 6, 7]], 4),
    (8, 4, False, True, 2, [[0, 1, 4, 5], [2, 3, 6, 7]], 4),
    (10, 2, False, False, 2, [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]], 6),
    (10, 2, True, False, 2, [[0, 1, 4, 5], [2, 3, 6, 7]], 4),
    (10, 4, False, True, 2, [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]], 8),
    (10, 4, True, True, 2, [[0, 1, 4, 5], [2, 3, 6, 7]], 4),
    (3, 4, False, False, 2, [[0, 1, 2, 0], [1, 2, 0, 1]], 4),
    (3, 4, False, True, 2, [[0, 1], [2, 0]], 4),
    (3, 4, True, False, 2, [[], []], 0),
    (7, 2, False, False, 3, [[0, 1, 6, 0], [2, 3, 1, 2], [4, 5, 3, 4]], 4),
    (22, 4, False, True, 2, [[0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21], [2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 0, 1]], 12),
]


@pytest.mark.parametrize("n,bs,drop_last,split,P,streams,shard_len", SPEC3)
def test_spec_vectors_iterable_dataset_shard(n, bs, drop_last, split, P, streams, shard_len):
    for p in range(P):
        cfg = DataLoaderConfiguration(split_batches=split, dispatch_batches=False)
        dl = prepare_data_loader(DataLoader(Stream(n), batch_size=bs, drop_last=drop_last),
                                 num_processes=P, process_index=p, dataloader_config=cfg)
        assert [x for b in dl for x in b.tolist()] == streams[p]
        assert len(dl.dataset) == shard_len
        shard = IterableDatasetShard(Stream(n), batch_size=bs, drop_last=drop_last, num_processes=P,
                                     process_index=p, split_batches=split)
        assert list(shard) == streams[p]


def test_docstring_example():
    assert list(IterableDatasetShard(Stream(8), batch_size=4, num_processes=2, process_index=0)) == [0, 1, 2, 3]
    assert list(IterableDatasetShard(Stream(8), batch_size=4, num_processes=2, process_index=1)) == [4, 5, 6, 7]
    assert list(IterableDatasetShard(Stream(8), batch_size=4, num_processes=2, process_index=1, split_batches=True)) == [2, 3, 6, 7]


# Spec §4 (DataLoaderDispatcher, accelerate 1.15, 2 ranks; the iterable version gives the same batches):
# (n, bs, drop_last, split, len, rank 0, rank 1)
SPEC4 = [
    (16, 4, False, False, 2, [[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]),
    (10, 2, False, False, 3, [[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]),
    (9, 4, False, True, 3, [[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0]]),
    (9, 4, True, True, 2, [[0, 1], [4, 5]], [[2, 3], [6, 7]]),
    (2, 4, False, True, 1, [[0]], [[1]]),
    (9, 2, False, False, 3, [[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0]]),
    (9, 2, True, False, 2, [[0, 1], [4, 5]], [[2, 3], [6, 7]]),
    (7, 4, False, True, 2, [[0, 1], [4, 5]], [[2, 3], [6, 0]]),
    (7, 4, True, True, 1, [[0, 1]], [[2, 3]]),
    (3, 2, False, False, 1, [[0, 1]], [[2, 0]]),
    (5, 4, False, False, 1, [[0, 1, 2]], [[3, 4, 0]]),
]


@pytest.mark.parametrize("n,bs,drop_last,split,expected_len,rank0,rank1", SPEC4)
@pytest.mark.parametrize("dispatch", [True, None])  # None resolves to True for an iterable dataset
def test_spec_vectors_dispatch_without_a_process_group(n, bs, drop_last, split, expected_len, rank0, rank1, dispatch):
    for p, expected in enumerate([rank0, rank1]):
        cfg = DataLoaderConfiguration(split_batches=split, dispatch_batches=dispatch)
        dl = prepare_data_loader(DataLoader(Stream(n), batch_size=bs, drop_last=drop_last),
                                 num_processes=2, process_index=p, dataloader_config=cfg)
        assert len(dl) == expected_len
        assert two_epochs(dl, True) == [expected, expected]


def test_dispatch_slices_nested_batches_and_forwards_set_epoch():
    class Pairs(EpochStream):
        def __iter__(self):
            return iter({"x": i, "y": (i, -i)} for i in super().__iter__())

    cfg = DataLoaderConfiguration(dispatch_batches=True)
    dl = prepare_data_loader(DataLoader(Pairs(6), batch_size=2), num_processes=2, process_index=1, dataloader_config=cfg)
    dl.set_epoch(1)
    got = [{"x": b["x"].tolist(), "y": [t.tolist() for t in b["y"]]} for b in dl]
    assert got == [{"x": [5, 0], "y": [[5, 0], [-5, 0]]}, {"x": [2], "y": [[2], [-2]]}]  # rotated by 3; the last global batch [1, 2] splits evenly
    assert dl.iteration == 2


def test_dispatch_one_process_is_the_plain_loader():
    cfg = DataLoaderConfiguration(dispatch_batches=True)
    dl = prepare_data_loader(DataLoader(Stream(7), batch_size=3), num_processes=1, process_index=0, dataloader_config=cfg)
    assert as_lists(dl) == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(dl) == 3


# --- in a real torchrun job (gloo, CPU, 2 ranks), against accelerate's own loaders ---------------

@pytest.fixture(scope="module")
def job(tmp_path_factory):
    import json
    from pathlib import Path

    out = tmp_path_factory.mktemp("iterable")
    proc = torchrun(2, Path(__file__).resolve().parent / "bindings_iterable_job.py", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("rank", [0, 1])
def test_in_a_process_group_batches_equal_accelerates(job, rank):
    compared = 0
    for e in job[rank]:
        theirs, ours = e["accelerate"], e["statekit"]
        if "error" in theirs:
            if theirs["error"] == "ValueError":
                assert ours == {"error": "UsageError"}, e  # UsageError is a ValueError
            else:
                # accelerate's dispatcher fails (TypeError) on a stream with no batch at all;
                # statekit yields nothing there
                assert theirs["error"] == "TypeError" and e["config"][4], e
                assert ours["batches"] == [[], []], e
            continue
        assert ours == theirs, e
        compared += 1
    assert compared > 100
    # dispatch mode: every rank's batches come from rank 0's stream (offset 0), never its own
    if rank == 1:
        for e in job[rank]:
            if e["config"][4] and "batches" in e["statekit"]:
                assert all(x < 1000 for ep in e["statekit"]["batches"] for b in ep for x in b), e
