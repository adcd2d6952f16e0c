"""`statekit.ckpt` with `hf://` sources against the test Hub (tests/hub/server.py): `inspect`
reads a model's headers by range requests and writes nothing; `load` downloads into the cache
huggingface_hub uses; the Hub's refusals are `HubError`s that name what to do.

The bindings read HF_ENDPOINT, HF_HUB_CACHE and HF_TOKEN from the process environment at each
call, so `monkeypatch.setenv` is enough here (no subprocess)."""

import os
import sys

import numpy as np
import pytest
from conftest import ROOT
from statekit import ckpt
from statekit.errors import HubError

sys.path.insert(0, str(ROOT / "tests" / "hub"))
from harness import ORG, HubServer, make_repos


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    return make_repos(tmp_path_factory.mktemp("hub-root"))


@pytest.fixture(scope="module")
def hub(hub_root):
    with HubServer(hub_root) as server:
        yield server


@pytest.fixture
def cache(hub, tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    return tmp_path / "cache"


def test_inspect_reads_a_remote_model_by_its_headers(hub, hub_root, cache):
    remote = ckpt.inspect(f"hf://{ORG}/sharded5")
    local = ckpt.inspect(hub_root / ORG / "sharded5")
    assert remote.tensors == local.tensors
    assert remote.total_bytes == local.total_bytes
    assert [f.rsplit("/", 1)[-1] for f in remote.files] == [os.path.basename(f) for f in local.files]
    assert remote.root.startswith(f"hf://{ORG}/sharded5@{hub.commit('sharded5')}/")
    assert not cache.exists()
    assert ckpt.verify(f"hf://{ORG}/sharded5", headers_only=True).valid
    assert not cache.exists()


def test_load_downloads_into_the_shared_cache(hub_root, cache):
    loaded = ckpt.load(f"hf://{ORG}/tiny")
    expected = ckpt.load(hub_root / ORG / "tiny" / "model.safetensors")
    assert sorted(loaded) == sorted(expected)
    assert all(np.ascontiguousarray(loaded[k]).tobytes() == np.ascontiguousarray(expected[k]).tobytes() for k in expected)
    snapshots = list((cache / f"models--{ORG}--tiny" / "snapshots").iterdir())
    assert [p.name for p in snapshots[0].iterdir()] == ["model.safetensors"]
    assert (snapshots[0] / "model.safetensors").is_symlink()


def test_the_hubs_refusals_are_hub_errors(cache):
    with pytest.raises(HubError, match=r"answered 401 for `model.safetensors`.*set `HF_TOKEN`") as gated:
        ckpt.inspect(f"hf://{ORG}/gated")
    assert (gated.value.variant, gated.value.status, gated.value.repo) == ("HubAuth", 401, f"{ORG}/gated")
    with pytest.raises(HubError, match=r"has no `absent.safetensors`") as missing:
        ckpt.load(f"hf://{ORG}/tiny/absent.safetensors")
    assert (missing.value.variant, missing.value.file) == ("HubNotFound", "absent.safetensors")
