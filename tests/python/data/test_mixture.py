"""`statekit.data.Mixture`: weighted mixtures of map-style datasets, one order that is a pure
function of (definition, position), read through `ShardedBatchSampler`.

The acceptance check of issue 30: a 3-source mixture (weights 0.6/0.3/0.1, one source read
once; the sources are lists of distinct ids) resumed at a random position on 2, 3 and 5 ranks
reads every remaining sample of the global order exactly once, and, on the world it was saved
on, the same batches as an uninterrupted run; in one process (ranks given by
`num_processes`/`process_index`), under torchrun with 2 gloo ranks (`mixture_job.py`), and
through `statekit.accelerate`. Also: a state of another mixture is refused by field, `locate`
past the end is a `ValueError`, `positions` agrees with counting `locate`, `Mixture.of`'s items.
"""

import json
import pickle
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import ROOT, torchrun
from statekit.data import Mixture, ShardedBatchSampler, TokenDataset
from statekit.errors import InvalidConfiguration, StateMismatch

HERE = ROOT / "tests" / "python" / "data"
SIZES, WEIGHTS, ONCE, LENGTH, SEED, BATCH = (50, 23, 31), (0.6, 0.3, 0.1), (1,), 301, 11, 4
OFFSETS = (0, 1000, 2000)


def datasets():
    return [list(range(o, o + n)) for o, n in zip(OFFSETS, SIZES)]


def mixture(weights=WEIGHTS, **kw):
    args = dict(seed=SEED, once=ONCE, length=LENGTH)
    args.update(kw)
    return Mixture.of(datasets(), weights, **args)


def sampler(m, world, rank, **kw):
    return ShardedBatchSampler(len(m), BATCH, num_processes=world, process_index=rank, even_batches=False, mixture=m,
                               **kw)


def read(m, s, stop=None):
    """The items of the batches `s` gives (up to `stop` of them), batch by batch."""
    out = []
    for batch in s:
        out.append(m.__getitems__(batch))
        if stop is not None and len(out) == stop:
            break
    return out


# --- the order ------------------------------------------------------------------------------


def test_locate_past_the_end_is_a_value_error_and_positions_stop_at_the_length():
    m = Mixture(SIZES, WEIGHTS, seed=SEED, once=ONCE, length=LENGTH)
    assert len(m) == LENGTH
    m.locate(LENGTH - 1)
    for bad in (LENGTH, LENGTH + 10, 2**70, -1):
        with pytest.raises(ValueError):
            m.locate(bad)
    assert sum(m.positions(LENGTH)) == LENGTH
    with pytest.raises(ValueError):
        m.positions(LENGTH + 1)
    with pytest.raises(ValueError):
        m.locate_many([0, LENGTH])


def test_positions_agree_with_counting_locate():
    m = Mixture(SIZES, WEIGHTS, seed=SEED, once=ONCE, length=LENGTH)
    counts = [0, 0, 0]
    sources, samples = m.locate_many(range(LENGTH))
    for i in range(LENGTH):
        assert m.positions(i) == counts, i
        s, j = m.locate(i)
        assert (s, j) == (sources[i], samples[i])
        counts[s] += 1
    assert m.positions(LENGTH) == counts


def test_proportions_are_exact_and_a_once_source_is_read_exactly_once():
    m = Mixture([1000, 200, 5000], [0.6, 0.3, 0.1], seed=3, once=[1], length=20_000)
    sources, samples = m.locate_many(range(len(m)))
    assert sorted(j for s, j in zip(sources, samples) if s == 1) == list(range(200))
    # before the once source runs out, every prefix holds each source within a block's share
    end = next(i for i in range(len(m)) if m.positions(i)[1] == 200)
    for k in range(0, end, 97):
        block = m.block_at(k)
        for s, (got, w) in enumerate(zip(m.positions(k), (0.6, 0.3, 0.1))):
            assert abs(got - k * w) <= block * w + 1, (k, s, got)
    # a repeated source goes through all its samples once per pass, in a new order each pass
    rep = [j for s, j in zip(sources, samples) if s == 0]
    assert sorted(rep[:1000]) == list(range(1000)) and rep[:1000] != rep[1000:2000]


def test_mixture_of_indexes_its_datasets():
    import torch

    m = mixture()
    assert isinstance(m, Mixture) and isinstance(m, torch.utils.data.Dataset)
    ds = datasets()
    for i in range(0, LENGTH, 7):
        s, j = m.locate(i)
        assert m[i] == ds[s][j] and m[i - LENGTH] == m[i]
    assert m.__getitems__([5, 0, 300, 5]) == [m[5], m[0], m[300], m[5]]
    with pytest.raises(IndexError):
        m[LENGTH]
    copy = pickle.loads(pickle.dumps(m))
    assert type(copy) is type(m) and [copy[i] for i in range(LENGTH)] == [m[i] for i in range(LENGTH)]
    plain = pickle.loads(pickle.dumps(Mixture(SIZES, WEIGHTS, seed=SEED, once=ONCE, length=LENGTH)))
    assert plain.spec == m.spec and plain.datasets is None
    # every source read once: the length is their total
    assert len(Mixture.of([[1, 2], [3]], [1, 1], once=[0, 1])) == 3
    with pytest.raises(InvalidConfiguration, match="length"):
        Mixture.of(datasets(), WEIGHTS)  # a source repeats: the length is needed


def test_a_mixture_of_token_datasets_reads_batches_as_its_sources(tmp_path):
    files = []
    for k, n in enumerate((600, 400, 300)):
        path = tmp_path / f"s{k}.bin"
        (np.arange(n, dtype=np.uint16) + 10_000 * k).tofile(path)
        files.append(TokenDataset(path, 8))
    m = Mixture.of(files, [0.5, 0.3, 0.2], seed=1, once=[2], length=200)
    idx = [3, 0, 199, 57, 58, 59]
    inputs, targets = m.get_batch(idx)
    for row, i in enumerate(idx):
        x, y = m[i]
        assert inputs[row].tolist() == x.tolist() and targets[row].tolist() == y.tolist()


def test_the_package_imports_and_mixes_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from statekit.data import Mixture\n"
            "m = Mixture.of([[1, 2, 3], ['a', 'b']], [2, 1], length=10)\n"
            "print(len(m), m[0], type(m).__mro__[-1].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "10"


def test_weights_go_through_states_and_pickles_unchanged():
    # floats a parser without exact round trips reads back one unit in the last place off
    w = [0.9492279489729363, 0.36489180394089316, 0.0009410135113054549]
    m = Mixture.of(datasets(), w, seed=SEED, once=ONCE, length=LENGTH)
    assert m.weights == w
    state = json.loads(json.dumps(sampler(m, 2, 0).state_dict()))
    assert state["mixture"]["weights"] == w
    copy = pickle.loads(pickle.dumps(m))
    assert copy.spec == m.spec
    sampler(copy, 3, 1).load_state_dict(state)


# --- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("saved_on", [2, 3, 5])
@pytest.mark.parametrize("loaded_on", [2, 3, 5])
def test_resumed_at_a_random_position_every_remaining_sample_is_read_once(saved_on, loaded_on):
    m = mixture()
    order = [m[i] for i in range(LENGTH)]
    rng = random.Random(saved_on * 10 + loaded_on)
    steps = -(-LENGTH // (BATCH * saved_on))
    stop = rng.randrange(1, steps - 1)
    # each rank of the saving world reads `stop` batches; the state is the same on every rank
    head, states = [], []
    for rank in range(saved_on):
        s = sampler(m, saved_on, rank)
        head += [x for b in read(m, s, stop) for x in b]
        states.append(s.state_dict())
    assert all(st == states[0] for st in states)
    state = json.loads(json.dumps(states[0]))  # plain data
    assert state["mixture"] == m.spec and state["cursor"] == stop * BATCH * saved_on
    assert Counter(head) == Counter(order[: state["cursor"]])
    rest = {}
    for rank in range(loaded_on):
        s = sampler(m, loaded_on, rank)
        s.load_state_dict(state)
        rest[rank] = read(m, s)
    got = [x for r in rest.values() for b in r for x in b]
    assert Counter(got) == Counter(order[state["cursor"]:]), "every remaining sample of the order exactly once"
    if loaded_on == saved_on:
        for rank in range(loaded_on):
            whole = read(m, sampler(m, loaded_on, rank))
            assert rest[rank] == whole[stop:], "the same batches as an uninterrupted run"


def test_a_state_of_another_mixture_is_refused_by_field():
    m = mixture()
    s = sampler(m, 2, 0)
    read(m, s, 5)
    state = s.state_dict()
    others = {
        "mixture.weights": mixture(weights=(0.5, 0.3, 0.2)),
        "mixture.seed": mixture(seed=SEED + 1),
        "mixture.once": mixture(once=()),
        "mixture.sizes": Mixture.of([list(range(51)), list(range(23)), list(range(30))], WEIGHTS, seed=SEED,
                                    once=ONCE, length=LENGTH),
        "mixture.changes": m.reweighted(10, [0.1, 0.1, 0.8]),  # a change before the cursor
    }
    for field, other in others.items():
        with pytest.raises(StateMismatch) as e:
            sampler(other, 2, 0).load_state_dict(state)
        assert e.value.field == field
    with pytest.raises(StateMismatch) as e:
        ShardedBatchSampler(LENGTH, BATCH, num_processes=2, process_index=0, even_batches=False).load_state_dict(state)
    assert e.value.field == "mixture"
    # another length is another dataset length, refused before the mixture is looked at
    longer = mixture(length=LENGTH + 1)
    with pytest.raises(StateMismatch) as e:
        sampler(longer, 2, 0).load_state_dict(state)
    assert e.value.field == "dataset_len"
    # a sampler whose length is not the mixture's
    with pytest.raises(InvalidConfiguration, match="length"):
        ShardedBatchSampler(LENGTH + 1, BATCH, mixture=m)


def test_weights_changed_from_the_cursor_on_continue_the_run():
    m = mixture()
    s = sampler(m, 2, 0)
    read(m, s, 5)
    state = s.state_dict()
    at = state["cursor"]
    curriculum = m.reweighted(at, [0.1, 0.1, 0.8])
    assert [curriculum[i] for i in range(at)] == [m[i] for i in range(at)], "the positions before `at` are kept"
    resumed = sampler(curriculum, 2, 0)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["mixture"]["changes"] == [{"at": at, "weights": [0.1, 0.1, 0.8]}]
    after = curriculum.positions(len(curriculum))
    before = curriculum.positions(at)
    assert after[2] - before[2] > after[0] - before[0], "the new weights hold from the cursor on"


# --- torchrun and statekit.accelerate -------------------------------------------------------


def test_under_torchrun_on_2_gloo_ranks(tmp_path):
    m = mixture()
    order = [m[i] for i in range(LENGTH)]
    # a state saved on 3 ranks at step 4 by the job's loader (statekit.data.prepare_data_loader),
    # loaded by the 2 ranks of the job
    from torch.utils.data import DataLoader

    from statekit.data import DataLoaderConfiguration, prepare_data_loader

    saved = prepare_data_loader(DataLoader(m, batch_size=BATCH), num_processes=3, process_index=0,
                                dataloader_config=DataLoaderConfiguration(even_batches=False))
    it = iter(saved)
    for _ in range(4):
        next(it)
    (tmp_path / "state.json").write_text(json.dumps(saved.batch_sampler.state_dict()))
    stop = 6
    proc = torchrun(2, HERE / "mixture_job.py", tmp_path, stop, tmp_path / "state.json", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    whole = [x for r in ranks for b in r["whole"] for x in b]
    assert Counter(whole) == Counter(order), "the uninterrupted epoch reads the order once"
    for rank, r in enumerate(ranks):
        assert r["world"] == 2 and r["mixture"] == m.spec
        assert r["head"] == r["whole"][:stop] and r["rest"] == r["whole"][stop:]
        assert r["whole"] == [[order[i] for i in b] for b in sampler(m, 2, rank)], "the sampler's batches"
    moved = [x for r in ranks for b in r["elastic"] for x in b]
    assert Counter(moved) == Counter(order[4 * BATCH * 3:])


def test_through_statekit_accelerate_saved_on_2_ranks_resumed_on_3_and_5():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    import statekit.accelerate as ours

    def prepared(m, world, rank):
        dl = ours.prepare_data_loader(DataLoader(m, batch_size=BATCH), num_processes=world, process_index=rank,
                                      even_batches=False, use_stateful_dataloader=True)
        assert isinstance(dl, ours.DataLoaderShard)
        return dl

    try:
        m = mixture()
        order = [m[i] for i in range(LENGTH)]
        head, states = [], []
        for rank in range(2):
            dl = prepared(m, 2, rank)
            it = iter(dl)
            for _ in range(9):
                head += next(it).tolist()
            states.append(dl.state_dict())
        sampler_state = states[0]["_index_sampler_state"]
        assert sampler_state["mixture"] == m.spec, "the mixture is recorded without being asked for"
        cursor = sampler_state["cursor"]
        assert Counter(head) == Counter(order[:cursor])
        for world in (3, 5):
            rest = []
            for rank in range(world):
                dl = prepared(m, world, rank)
                dl.load_state_dict(states[rank % 2])
                rest += [x for b in dl for x in b.tolist()]
            assert Counter(rest) == Counter(order[cursor:])
        other = prepared(mixture(seed=SEED + 1), 3, 0)
        with pytest.raises(StateMismatch) as e:
            other.load_state_dict(states[0])
            next(iter(other))  # (torchdata's loader restores the state it was given at `iter()`)
        assert e.value.field == "mixture.seed"
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
