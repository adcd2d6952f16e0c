"""`statekit.ckpt.save(d, p, max_shard_size=S)` writes, byte for byte, the files
`huggingface_hub.save_torch_state_dict(d, p2, max_shard_size=S)` writes: the same file names,
the same index text and the same shard bytes, for random state dicts (shapes, dtypes, sizes,
empty tensors, key order and shard limits drawn from a seeded generator). Both go through
`ckpt::save_safetensors`, which plans with `ckpt split`'s planner, so this pins the bindings,
the planner and the writer together against the reference."""

import random

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from statekit import ckpt

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


def random_state_dict(rng: random.Random):
    names = [f"layers.{i}.{part}" for i in range(rng.randint(1, 6)) for part in ("weight", "bias", "norm.scale")]
    rng.shuffle(names)  # not in sorted order: the caller's order decides the shards
    sd = {}
    for name in names[: rng.randint(1, len(names))]:
        dims = rng.randint(0, 3)
        # One dim in eight is 0: empty tensors, which huggingface_hub counts as one storage.
        shape = [0 if rng.random() < 0.125 else rng.randint(1, 48) for _ in range(dims)]
        dtype = rng.choice(DTYPES)
        g = torch.Generator().manual_seed(rng.randint(0, 2**31))
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        elif dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        else:
            t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
        sd[name] = t
    return sd


def files_of(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("seed", range(40))
def test_save_writes_save_torch_state_dicts_files(tmp_path, seed):
    rng = random.Random(seed)
    sd = random_state_dict(rng)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    # From one byte (every tensor over the limit) to more than everything (one file).
    limit = rng.choice([1, rng.randint(1, max(total, 1)), rng.randint(1, max(total // 3, 1)), total + 1])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    theirs.mkdir()
    save_torch_state_dict(sd, theirs, max_shard_size=limit)
    out = ckpt.save(sd, ours, max_shard_size=limit)

    want, got = files_of(theirs), files_of(ours)
    assert list(got) == list(want), (limit, total)
    for name in want:
        assert got[name] == want[name], name
    index = "model.safetensors.index.json"
    assert [p.rsplit("/", 1)[-1] for p in out.files] == [n for n in want if n != index] + ([index] if index in want else [])


def test_metadata_goes_where_huggingface_hub_puts_it(tmp_path):
    sd = {f"w{i}": torch.full((64,), float(i)) for i in (3, 1, 2)}
    meta = {"zeta": "1", "alpha": "2"}
    for limit, sharded in ((256, True), (10_000, False)):
        ours, theirs = tmp_path / f"ours{limit}", tmp_path / f"theirs{limit}"
        theirs.mkdir()
        save_torch_state_dict(sd, theirs, max_shard_size=limit, metadata=dict(meta))
        ckpt.save(sd, ours, max_shard_size=limit, metadata=meta)
        want, got = files_of(theirs), files_of(ours)
        assert list(got) == list(want)
        for name in want:
            if sharded or name.endswith(".json"):
                # The index carries the metadata after `total_size`, in the caller's order.
                assert got[name] == want[name], name
            else:
                # One file carries it in `__metadata__`, whose members safetensors writes from a
                # hash map (any order): the same members, the same tensors.
                from safetensors import safe_open

                with safe_open(ours / name, "pt") as a, safe_open(theirs / name, "pt") as b:
                    assert a.metadata() == b.metadata() == {"format": "pt", **meta}
                    assert list(a.keys()) == list(b.keys())
                    assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
                assert len(got[name]) == len(want[name])
