"""statekit.data against real accelerate 1.15, torch 2.13 and torchdata: the installed
`statekit` package (make test installs it through .ci/setup)."""

import json
import pickle
import random

import pytest
import torch
from torch.utils.data import DataLoader

from accelerate.data_loader import prepare_data_loader as accelerate_prepare

import statekit
from statekit.data import DataLoaderConfiguration, ShardedBatchSampler, prepare_data_loader
from statekit.errors import StateMismatch, StatekitError

CPU = torch.device("cpu")


def random_configs(count, seed):
    rnd = random.Random(seed)
    for _ in range(count):
        n = rnd.choice([0, 1, 2, 3, rnd.randrange(0, 40), rnd.randrange(0, 200)])
        P = rnd.randrange(1, 7)
        split = rnd.random() < 0.3
        bs = P * rnd.randrange(1, 4) if split else rnd.randrange(1, 9)
        even = rnd.random() < 0.6
        drop_last = rnd.random() < 0.3
        shuffle = rnd.random() < 0.7 and n > 0  # torch's RandomSampler refuses empty datasets
        seed_ = rnd.choice([0, 42, -5, rnd.randrange(0, 2**40), 2**63 + 11])
        yield dict(n=n, P=P, bs=bs, split=split, even=even, drop_last=drop_last, shuffle=shuffle, seed=seed_)


def accelerate_batches(c, p, epochs=2):
    dl = DataLoader(range(c["n"]), batch_size=c["bs"], shuffle=c["shuffle"], drop_last=c["drop_last"])
    d = accelerate_prepare(
        dl, device=CPU, num_processes=c["P"], process_index=p, split_batches=c["split"], put_on_device=False,
        dispatch_batches=False, even_batches=c["even"], use_seedable_sampler=True,
        data_seed=c["seed"] if c["shuffle"] else None,
    )
    return [[b.tolist() for b in d] for _ in range(epochs)], len(d)


def ours(c, p):
    return ShardedBatchSampler(
        c["n"], c["bs"], num_processes=c["P"], process_index=p, shuffle=c["shuffle"], seed=c["seed"],
        drop_last=c["drop_last"], split_batches=c["split"], even_batches=c["even"],
    )


CONFIGS = list(random_configs(240, 1315))


@pytest.mark.parametrize("chunk", range(8))
def test_sampler_equals_accelerate_over_240_random_configs(chunk):
    checked = 0
    for c in CONFIGS[chunk::8]:
        for p in range(c["P"]):
            try:
                expected, length = accelerate_batches(c, p)
            except ValueError:
                # accelerate refuses it (split batches not divisible ...): so must we.
                with pytest.raises(StatekitError):
                    ours(c, p)
                continue
            s = ours(c, p)
            got = [list(s), list(s)]
            assert got == expected, (c, p)
            if not (c["split"] and not c["even"]):  # where accelerate's len() is wrong
                assert len(s) == length, (c, p)
            checked += 1
    assert checked > 0


def test_sampler_in_torch_dataloader_with_workers_gives_the_same_batches():
    for c in CONFIGS[:12]:
        for p in range(c["P"]):
            try:
                expected, _ = accelerate_batches(c, p, epochs=1)
            except ValueError:
                continue
            for workers in (0, 2):
                loader = DataLoader(range(c["n"]), batch_sampler=ours(c, p), num_workers=workers)
                assert [b.tolist() for b in loader] == expected[0], (c, p, workers)


def test_prepare_data_loader_equals_accelerate():
    for c in CONFIGS[:30]:
        if c["split"] and c["bs"] % c["P"]:
            continue
        for p in range(c["P"]):
            dl = DataLoader(range(c["n"]), batch_size=c["bs"], shuffle=c["shuffle"], drop_last=c["drop_last"])
            try:
                expected, _ = accelerate_batches(c, p, epochs=1)
            except ValueError:
                continue
            cfg = DataLoaderConfiguration(split_batches=c["split"], even_batches=c["even"], use_seedable_sampler=True,
                                          data_seed=c["seed"] if c["shuffle"] else None)
            ours_dl = prepare_data_loader(dl, num_processes=c["P"], process_index=p, dataloader_config=cfg)
            assert [b.tolist() for b in ours_dl] == expected[0], (c, p)


@pytest.mark.parametrize("name", ["dispatch_batches", "split_batches", "even_batches", "use_seedable_sampler"])
def test_prepare_data_loader_refuses_the_spellings_accelerate_moved(name):
    dl = DataLoader(range(10), batch_size=2)
    with pytest.raises(TypeError, match=rf"`{name}`.*DataLoaderConfiguration\({name}="):
        prepare_data_loader(dl, num_processes=1, process_index=0, **{name: True})


def test_configuration_has_accelerates_fields_and_defaults():
    import dataclasses

    import accelerate

    theirs = {f.name: f.default for f in dataclasses.fields(accelerate.DataLoaderConfiguration)}
    mine = {f.name: f.default for f in dataclasses.fields(DataLoaderConfiguration)}
    assert mine == theirs


def test_state_is_plain_data(tmp_path):
    s = ShardedBatchSampler(100, 4, num_processes=3, process_index=1, shuffle=True, seed=2**64 - 5)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    assert pickle.loads(pickle.dumps(state)) == state
    assert json.loads(json.dumps(state)) == state
    torch.save(state, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == state
    t = ShardedBatchSampler(100, 4, num_processes=3, process_index=1, shuffle=True, seed=2**64 - 5)
    t.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert list(t) == list(it)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(length=101), "dataset_len"),
        (dict(seed=8), "sampler"),
        (dict(batch_size=5), "batch_size"),
        (dict(drop_last=True), "drop_last"),
        (dict(even_batches=False), "config"),
        (dict(fingerprint="other"), "fingerprint"),
    ],
)
def test_a_state_from_other_settings_is_refused_naming_the_field(change, field):
    base = dict(length=100, batch_size=4, shuffle=True, seed=7, num_processes=2, process_index=0)
    s = ShardedBatchSampler(**base)
    next(iter(s))
    args = {**base, **change}
    other = ShardedBatchSampler(args.pop("length"), args.pop("batch_size"), **args)
    with pytest.raises(StateMismatch, match=f"`{field}`") as e:
        other.load_state_dict(s.state_dict())
    assert e.value.field == field
    assert isinstance(e.value, statekit.StatekitError)


def test_set_epoch_moves_and_keeps_a_resumed_position():
    s = ShardedBatchSampler(50, 5, shuffle=True, seed=3)
    e0 = list(s)
    s.set_epoch(0)
    assert list(s) == e0
    s.set_epoch(0)
    it = iter(s)
    first = next(it)
    state = s.state_dict()
    r = ShardedBatchSampler(50, 5, shuffle=True, seed=3)
    r.load_state_dict(state)
    r.set_epoch(0)  # the usual loop calls it; it must not rewind the resume
    assert [first] + list(r) == e0


def test_sampler_survives_pickle_mid_epoch():
    s = ShardedBatchSampler(77, 4, num_processes=3, process_index=2, shuffle=True, seed=9, drop_last=True)
    it = iter(s)
    next(it)
    c = pickle.loads(pickle.dumps(s))
    assert (c.num_processes, c.process_index, len(c)) == (3, 2, len(s))
    assert list(c) == list(it)


def test_world_defaults_to_one_rank_without_a_process_group():
    s = ShardedBatchSampler(10, 2)
    assert (s.num_processes, s.process_index) == (1, 0)


def test_dataload_errors_map_to_the_hierarchy():
    from statekit.errors import DataloadError, InvalidConfiguration, MalformedState, StateError

    with pytest.raises(InvalidConfiguration) as e:
        ShardedBatchSampler(10, 3, num_processes=2, process_index=0, split_batches=True)
    assert e.value.variant == "SplitNotDivisible" and isinstance(e.value, (DataloadError, ValueError))
    with pytest.raises(InvalidConfiguration, match="rank"):
        ShardedBatchSampler(10, 3, num_processes=2, process_index=2)
    s = ShardedBatchSampler(10, 3)
    with pytest.raises(MalformedState) as e:
        s.load_state_dict({"format": "something else"})
    assert isinstance(e.value, StateError)
    state = s.state_dict()
    state["version"] = 99
    with pytest.raises(MalformedState, match="99"):
        s.load_state_dict(state)
