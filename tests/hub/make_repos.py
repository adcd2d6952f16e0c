"""Writes the test Hub's fixture repositories, with the real tools (torch, safetensors through
huggingface_hub's `save_torch_state_dict`, which shards with `split_torch_state_dict_into_shards`),
into `OUT_ROOT/statekit-test/`, the layout tests/hub/server.py serves:

    tiny/      model.safetensors (one file, no index) and config.json; tag `v1` (`.refs.json`)
    sharded5/  model-0000{1..5}-of-00005.safetensors, model.safetensors.index.json, config.json:
               float32, bfloat16, float16 and int64 tensors, about 3 MB in all
    gated/     tiny's files and `.gated`
    hostile/   two shards and their index; the second shard's 8-byte header length points
               past the end of its file

    python tests/hub/make_repos.py OUT_ROOT

Every tensor is drawn from a seeded generator, so the bytes (and the commits the server derives
from them) are the same on every run. Each repository is written into a temporary folder
beside its place and renamed into it, so a repository is there whole or not at all; one that
is already there is kept. `many_shards` makes the benchmark's larger model the same way.
"""

import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards

ORG = "statekit-test"
CONFIG = {"architectures": ["StatekitTestModel"], "model_type": "statekit-test", "hidden_size": 64}


def tiny_state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(32, 16, generator=g),
        "layer.0.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.zeros(16, dtype=torch.float16),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def sharded_state_dict(seed=1):
    """Ten tensors of 256 KiB to 320 KiB: two to a shard at a 700 KB limit, so five shards."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(5):
        sd[f"layers.{i}.attn.weight"] = torch.randn(256, 256, generator=g)  # float32, 256 KiB
        dtype = (torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float16)[i]
        sd[f"layers.{i}.mlp.weight"] = torch.randn(320, 512 if dtype != torch.float32 else 256, generator=g).to(dtype)
    sd["layers.4.mlp.positions"] = torch.arange(64, dtype=torch.int64)
    return sd


SHARDED_LIMIT = 700_000


def write_config(folder, **extra):
    (folder / "config.json").write_text(json.dumps({**CONFIG, **extra}, indent=2, sort_keys=True) + "\n")


def save(state_dict, folder, max_shard_size, expect_files):
    """save_torch_state_dict into `folder`, checked to give `expect_files` shards (the split is
    the library's, so a change in its packing would show here first)."""
    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    if len(split.filename_to_tensors) != expect_files:
        raise SystemExit(f"make_repos.py: {folder.name}: huggingface_hub split the model into "
                         f"{len(split.filename_to_tensors)} files, not {expect_files}")
    save_torch_state_dict(state_dict, folder, max_shard_size=max_shard_size)


def fsync_tree(folder):
    for dirpath, _, filenames in os.walk(folder):
        for fn in filenames:
            with open(os.path.join(dirpath, fn), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def build(root, name, fill):
    """Runs `fill(folder)` on a temporary folder and renames it to ROOT/ORG/name."""
    dest = Path(root) / ORG / name
    if dest.exists():
        print(f"make_repos.py: {dest} exists, kept", file=sys.stderr)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        fill(tmp)
        fsync_tree(tmp)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def fill_tiny(folder):
    save(tiny_state_dict(), folder, "1GB", 1)
    write_config(folder)
    # A tag on the same tree, for `@v1` and `--revision v1`.
    (folder / ".refs.json").write_text(json.dumps({"v1": "."}) + "\n")


def fill_sharded5(folder):
    save(sharded_state_dict(), folder, SHARDED_LIMIT, 5)
    write_config(folder, num_hidden_layers=5)


def fill_gated(folder):
    save(tiny_state_dict(), folder, "1GB", 1)
    write_config(folder)
    (folder / ".gated").write_text("")


def fill_hostile(folder):
    sd = {"a": torch.arange(60_000, dtype=torch.float32), "b": torch.ones(60_000, dtype=torch.float32)}
    save(sd, folder, 300_000, 2)
    write_config(folder)
    shard = folder / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    # A header length that passes every size cap a reader might have but the file's own end.
    data[:8] = struct.pack("<Q", len(data) + 4096)
    shard.write_bytes(bytes(data))


def many_shards(root, name, shards, shard_bytes, seed=2):
    """A model of `shards` float32/bfloat16 shards of about `shard_bytes` each, saved by
    save_torch_state_dict, for the benchmark (bench/hub.py)."""

    def fill(folder):
        g = torch.Generator().manual_seed(seed)
        cols = 1024
        rows = max(1, shard_bytes // 2 // (cols * 4))
        sd = {}
        for i in range(shards):
            # Two tensors a shard: the limit below keeps each pair together and apart from the next.
            sd[f"model.layers.{i}.self_attn.weight"] = torch.randn(rows, cols, generator=g)
            sd[f"model.layers.{i}.mlp.weight"] = torch.randn(rows, cols * 2, generator=g).to(torch.bfloat16)
        per_shard = rows * cols * 4 * 2
        save(sd, folder, per_shard + per_shard // 4, shards)
        write_config(folder, num_hidden_layers=shards)

    return build(root, name, fill)


FIXTURES = {"tiny": fill_tiny, "sharded5": fill_sharded5, "gated": fill_gated, "hostile": fill_hostile}


def make_all(root):
    for name, fill in FIXTURES.items():
        build(root, name, fill)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_repos.py OUT_ROOT")
    make_all(sys.argv[1])
