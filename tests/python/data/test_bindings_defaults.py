"""accelerate's defaults that `statekit.data` used to refuse.

The default shuffle (`use_seedable_sampler=False`): torch's `RandomSampler` drawing each epoch
from a running generator, reproduced bit for bit and resumed without replay.

Against real accelerate 1.15 under torchrun (gloo, CPU, 2 ranks, one launch for every case):
every rank's batches over 3 epochs equal accelerate's `prepare_data_loader` (with the
`rng_types=["generator"]` an `Accelerator` passes), with and without a user generator, per rank
and dispatched (rank 0's draw sliced on every rank), and the
user's generator and torch's global one end in the states accelerate leaves them in; a loader
saved mid-epoch and resumed in a fresh loader yields exactly the rest. A pass broken off and
iterated again gives accelerate's new draw (its seedable sampler's same order), through
statekit.data and statekit.accelerate alike. In-process: the native
generator takes and gives back torch's full `get_state()` (MT19937 words, position and the
cached normal samples), and equals `torch.randperm` from arbitrary running states.

Unbatched iterable loaders (`batch_size=None`): dispatched from rank 0 against accelerate under
the same torchrun launch, and on one process in-process; per-rank sharding, where accelerate's
`IterableDatasetShard` fails with a `TypeError`, is refused with a clear error.

Iterable loaders resumed mid-epoch: by replay (accelerate's `skip_first_batches`, against the
real one), and through a torchdata `Stateful` dataset's own state in O(1) (nothing re-read).
"""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from conftest import torchrun
from statekit import _native
from statekit.data import DataLoaderConfiguration, ShardedBatchSampler, prepare_data_loader
from statekit.errors import InvalidConfiguration, UsageError

HERE = Path(__file__).resolve().parent
accelerate_data_loader = pytest.importorskip("accelerate.data_loader")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("random")
    proc = torchrun(2, HERE / "bindings_defaults_job.py", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def shuffle(job):
    return [j["shuffle"] for j in job]


@pytest.mark.parametrize("rank", [0, 1])
def test_every_epoch_equals_accelerates_default_shuffle(shuffle, rank):
    for r in shuffle[rank]:
        assert r["got"] == r["expected"], r["config"]
        assert r["len_ours"] == len(r["expected"][0]), r["config"]
        # The epochs differ: each is a new draw from the running generator.
        assert r["expected"][0] != r["expected"][1], r["config"]


@pytest.mark.parametrize("rank", [0, 1])
def test_generators_end_where_accelerate_leaves_them(shuffle, rank):
    for r in shuffle[rank]:
        assert r["got_states"] == r["expected_states"], r["config"]


def test_ranks_share_rank_zeros_order(shuffle):
    """Different seeds on every rank, yet the ranks' batches of an epoch never overlap."""
    for r0, r1 in zip(shuffle[0], shuffle[1]):
        if r0["config"]["world"] is None and not r0["config"]["even"]:
            seen0 = {i for b in r0["got"][0] for i in b}
            seen1 = {i for b in r1["got"][0] for i in b}
            assert not seen0 & seen1, r0["config"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_resumed_loader_yields_the_rest(shuffle, rank):
    for r in shuffle[rank]:
        exp = r["expected"]
        assert r["head"] + r["tail"][0] == exp[1], r["config"]
        if (r["config"]["world"] == 1 or r["config"].get("dispatch")) and not r["config"]["user_gen"]:
            # One rank or dispatched, no generator: each epoch's seed is drawn from (rank 0's)
            # torch global generator, which the resumed process has elsewhere (accelerate's
            # save_state keeps it apart).
            continue
        assert r["tail"][1] == exp[2], r["config"]
        if r["config"]["user_gen"] and not (r["config"].get("dispatch") and rank != 0):
            # The resumed loader's own generator ends where the uninterrupted run left its
            # (dispatched, rank 0's only: the others' are never drawn from, nor saved).
            assert r["resumed_user"] == r["expected_states"]["user"], r["config"]


def _state(g):
    return g.get_state().numpy().tobytes()


def _sampler(n, g, world=1, rank=0):
    cfg = DataLoaderConfiguration(dispatch_batches=False)
    return _native.Sampler(n, 1, world, rank, True, False, cfg._json(), None, _state(g))


@pytest.mark.parametrize("draws", [0, 1, 623, 624, 1001])
def test_the_native_generator_is_torchs_whole_state(draws):
    g = torch.Generator().manual_seed(2024)
    torch.randint(0, 10, (draws,), generator=g)
    torch.randn(1, generator=g)  # a cached normal sample in the state
    torch.randn(1, generator=g, dtype=torch.float64)
    before = _state(g)
    s = _sampler(100, g)
    order = [s.next_batch()[0] for _ in range(100)]
    assert order == torch.randperm(100, generator=g).tolist()
    assert s.running_generator() == _state(g)
    # The state given back is one torch takes, and it continues torch's stream.
    h = torch.Generator()
    h.set_state(torch.frombuffer(bytearray(s.running_generator()), dtype=torch.uint8))
    assert torch.rand(5, generator=h).tolist() == torch.rand(5, generator=g).tolist()
    assert before != s.running_generator()


def test_a_sampler_with_a_generator_advances_it_epoch_by_epoch():
    g = torch.Generator().manual_seed(5)
    ref = torch.Generator().manual_seed(5)
    bs = ShardedBatchSampler(10, 5, num_processes=1, process_index=0, shuffle=True, generator=g)
    torch_batches = BatchSampler(RandomSampler(range(10), generator=ref), 5, False)
    for _ in range(3):
        assert list(bs) == list(torch_batches)
        assert _state(g) == _state(ref)
    # The state is plain data: saved mid-epoch, it resumes on a sampler with another generator.
    it = iter(bs)
    next(it)
    saved = json.loads(json.dumps(bs.state_dict()))
    rest = [i for b in it for i in b]
    other = ShardedBatchSampler(10, 5, num_processes=1, process_index=0, shuffle=True, generator=torch.Generator())
    other.load_state_dict(saved)
    assert [i for b in other for i in b] == rest


def test_bad_generators_are_refused_by_name():
    with pytest.raises(UsageError, match="`generator` must be a CPU `torch.Generator`"):
        ShardedBatchSampler(10, 2, num_processes=1, process_index=0, shuffle=True, generator=42)
    with pytest.raises(InvalidConfiguration, match=r"invalid `generator`: a state of 3 bytes"):
        _native.Sampler(10, 1, 1, 0, True, False, DataLoaderConfiguration()._json(), None, b"abc")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dispatched_default_shuffle_is_rank_zeros_on_every_rank(shuffle, rank):
    """Dispatched, the ranks' own generators and global seeds differ, yet each rank's slices
    are accelerate's (rank 0's draw); rank 1's user generator is left as it was, as accelerate's
    other ranks never draw from theirs."""
    dispatched = [r for r in shuffle[rank] if r["config"].get("dispatch")]
    assert len(dispatched) == 3
    for r in dispatched:
        assert r["got"] == r["expected"], r["config"]
        assert r["got_states"] == r["expected_states"], r["config"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pass_broken_off_then_iterated_again_is_accelerates(job, rank):
    """`break` after k batches, then whole `for` loops: accelerate draws a new order from the
    running generator at the next `iter()` (the broken-off pass's draw taken), with or without
    `set_epoch`; the seedable sampler starts its epoch's order again. statekit.data's and
    statekit.accelerate's loaders do the same, and leave the generators where accelerate does."""
    for r in job[rank]["broken"]:
        exp = r["accelerate"]
        assert len(exp["head"]) == r["config"]["k"]
        if not r["config"].get("seedable"):
            assert exp["passes"][0][: r["config"]["k"]] != exp["head"], r["config"]  # a new draw
        for who in ("statekit", "statekit.accelerate"):
            got = r[who]
            assert (got["head"], got["passes"]) == (exp["head"], exp["passes"]), (who, r["config"])
            assert got["global_"] == exp["global_"], (who, r["config"])
            if not r["config"].get("seedable"):  # accelerate's seedable sampler reseeds the user's generator
                assert got["user"] == exp["user"], (who, r["config"])


def test_a_loaded_or_skipped_position_survives_iter():
    """The one case a new `iter()` continues: a position set by `load_state_dict` or
    `skip_first_batches`, with the default shuffle."""
    def loader():
        return prepare_data_loader(DataLoader(range(20), batch_size=2, shuffle=True,
                                              generator=torch.Generator().manual_seed(3)),
                                   num_processes=1, process_index=0)

    whole = [b.tolist() for b in loader()]
    dl = loader()
    it = iter(dl)
    head = [next(it).tolist() for _ in range(3)]
    saved = dl.batch_sampler.state_dict()
    del it
    resumed = loader()
    resumed.batch_sampler.load_state_dict(saved)
    assert head + [b.tolist() for b in resumed] == whole
    skipped = loader()
    skipped.batch_sampler.skip_first_batches(4)
    assert [b.tolist() for b in skipped] == whole[4:]


# --- unbatched iterable loaders -------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_unbatched_dispatch_equals_accelerate(job, rank):
    cases = job[rank]["unbatched"]
    for c in cases:
        assert c["statekit"] == c["accelerate"], c["n"]
    # Most cases yield samples (the dispatcher joins one per rank and cuts them).
    assert sum(isinstance(c["accelerate"], list) for c in cases) >= 3


class Numbers(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_an_unbatched_loader_on_one_process_yields_the_samples_as_accelerate_does():
    acc = accelerate_data_loader.prepare_data_loader(DataLoader(Numbers(5), batch_size=None), num_processes=1,
                                                     process_index=0, put_on_device=False, dispatch_batches=False)
    ours = prepare_data_loader(DataLoader(Numbers(5), batch_size=None), num_processes=1, process_index=0,
                               dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    expected = [[int(x) for x in acc] for _ in range(2)]
    assert [[int(x) for x in ours] for _ in range(2)] == expected == [[0, 1, 2, 3, 4]] * 2


def test_unbatched_per_rank_sharding_is_refused_where_accelerate_fails():
    acc = accelerate_data_loader.prepare_data_loader(DataLoader(Numbers(5), batch_size=None), num_processes=2,
                                                     process_index=0, put_on_device=False, dispatch_batches=False)
    with pytest.raises(TypeError):
        list(acc)
    with pytest.raises(UsageError, match=r"an unbatched loader \(`batch_size=None`\) over an iterable dataset cannot be "
                                         r"sharded per rank"):
        prepare_data_loader(DataLoader(Numbers(5), batch_size=None), num_processes=2, process_index=0,
                            dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    with pytest.raises(UsageError, match="no batch size to split"):
        prepare_data_loader(DataLoader(Numbers(5), batch_size=None), num_processes=2, process_index=0,
                            dataloader_config=DataLoaderConfiguration(split_batches=True))


# --- iterable loaders resumed mid-epoch -----------------------------------------------------

class Counted(IterableDataset):
    """0..n-1, counting the items it hands out (to tell a replay from a restore)."""

    def __init__(self, n):
        self.n, self.read = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.read += 1
            yield i


class StatefulStream(Counted):
    """torchdata's ``Stateful`` protocol: the dataset holds its position; ``iter`` resumes it."""

    def __init__(self, n):
        super().__init__(n)
        self.pos = 0

    def __iter__(self):
        start, self.pos = self.pos, 0
        for i in range(start, self.n):
            self.read += 1
            self.pos = i + 1
            yield i
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def _iterable(ds, P, p, bs=3, drop_last=False, dispatch=False):
    return prepare_data_loader(DataLoader(ds, batch_size=bs, drop_last=drop_last), num_processes=P, process_index=p,
                               dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))


def _lists(batches):
    return [b.tolist() for b in batches]


@pytest.mark.parametrize("P,p,drop_last", [(1, 0, False), (2, 0, False), (2, 1, False), (3, 2, True), (2, 1, True)])
def test_skip_first_batches_of_an_iterable_loader_equals_accelerates(P, p, drop_last):
    from statekit.data import skip_first_batches

    for k in (0, 1, 2, 5):
        acc = accelerate_data_loader.prepare_data_loader(DataLoader(Counted(23), batch_size=3, drop_last=drop_last),
                                                         num_processes=P, process_index=p, put_on_device=False,
                                                         dispatch_batches=False)
        expected = _lists(accelerate_data_loader.skip_first_batches(acc, k))
        ours = skip_first_batches(_iterable(Counted(23), P, p, drop_last=drop_last), k)
        assert _lists(ours) == expected, k
        # The skip is for one pass: the next epoch is whole.
        assert _lists(ours) == _lists(acc), k


@pytest.mark.parametrize("dispatch", [False, True])
@pytest.mark.parametrize("P,p", [(1, 0), (2, 0), (2, 1), (3, 1)])
def test_a_stream_without_state_resumes_by_replay(P, p, dispatch):
    if dispatch and p != 0:
        pytest.skip("without a process group a dispatched loader is rank 0's")
    full = _iterable(Counted(20), P, p, dispatch=dispatch)
    expected = [_lists(full), _lists(full)]
    for k in range(len(expected[0]) + 1):
        first = _iterable(Counted(20), P, p, dispatch=dispatch)
        it = iter(first)
        head = [next(it).tolist() for _ in range(k)]
        saved = json.loads(json.dumps(first.state_dict()))
        assert saved["stream"] is None and saved["batches"] == k
        ds = Counted(20)
        resumed = _iterable(ds, P, p, dispatch=dispatch)
        resumed.load_state_dict(saved)
        assert head + _lists(resumed) == expected[0], k
        assert ds.read == 20, "the stream was read from its start (the skipped batches replayed)"
        assert _lists(resumed) == expected[1]


@pytest.mark.parametrize("P,p,drop_last", [(1, 0, False), (2, 0, False), (2, 1, False), (3, 2, False), (2, 1, True)])
def test_a_stateful_stream_resumes_through_its_state_without_rereading(P, p, drop_last):
    full = _iterable(StatefulStream(20), P, p, drop_last=drop_last)
    expected = [_lists(full), _lists(full)]
    chunk = 3 * P
    for k in range(1, len(expected[0])):
        first = _iterable(StatefulStream(20), P, p, drop_last=drop_last)
        it = iter(first)
        head = [next(it).tolist() for _ in range(k)]
        saved = first.state_dict()
        assert saved["stream"] is not None and saved["batches"] == k
        ds = StatefulStream(20)
        resumed = _iterable(ds, P, p, drop_last=drop_last)
        resumed.load_state_dict(saved)
        rest = _lists(resumed)
        assert head + rest == expected[0], k
        # Only what follows the k chunks already read is read again: no replay.
        assert ds.read == 20 - k * chunk, k
        assert _lists(resumed) == expected[1]
        assert resumed.state_dict()["batches"] == 0


def test_a_loader_state_of_another_kind_is_refused():
    from statekit.errors import MalformedState

    with pytest.raises(MalformedState, match="not an iterable loader state"):
        _iterable(Counted(5), 1, 0).load_state_dict({"format": "statekit.dataload"})


@pytest.mark.parametrize("num_processes", [1, 2])
def test_reproducible_under_a_global_seed_as_in_accelerate(num_processes):
    """accelerate's `test_reproducibility`: under `set_seed(s)` the default shuffle gives the same
    order each time and another order under another seed; here also the order accelerate gives."""
    from accelerate.utils import set_seed

    def run(prepare, seed, **kw):
        set_seed(seed)
        dl = prepare(DataLoader(list(range(6)), batch_size=1, shuffle=True), num_processes=num_processes,
                     process_index=0, **kw)
        return [[b.tolist() for b in dl] for _ in range(2)]

    ours = run(prepare_data_loader, 21)
    assert ours == run(accelerate_data_loader.prepare_data_loader, 21, put_on_device=False)
    assert ours == run(prepare_data_loader, 21)
    assert ours != run(prepare_data_loader, 42)
