"""`hf://` addresses resolve in a Hugging Face cache laid out the way huggingface_hub lays one
out, offline. huggingface_hub itself (with local_files_only) checks the layout first, so the
test cannot pass on a layout only we understand."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download, snapshot_download

from conftest import FIXTURES, run_ckpt

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_file(repo_dir: Path, commit: str, rel: str, src: Path) -> None:
    """Blob named by content hash, snapshot entry as a relative symlink, like the hub."""
    data = src.read_bytes()
    blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = repo_dir / "snapshots" / commit / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.fixture
def cache(tmp_path):
    root = tmp_path / "hub"
    repo = root / "models--statekit--tiny"
    sharded = FIXTURES / "safetensors" / "model_sharded"
    for f in sharded.iterdir():
        add_file(repo, COMMIT, f.name, f)
    add_file(repo, COMMIT, "single/model.safetensors", FIXTURES / "safetensors" / "model_single" / "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    return root


def env_for(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HUB_OFFLINE"] = "1"
    env.update({k: str(v) for k, v in kw.items()})
    return env


def inspect_path(address: str, env: dict) -> str:
    out = run_ckpt("inspect", "--json", address, env=env)
    return json.loads(out.stdout)["path"]


@pytest.mark.parametrize("rev", [None, "main", "v1", COMMIT])
def test_index_resolves_where_huggingface_hub_finds_it(cache, rev):
    theirs = hf_hub_download("statekit/tiny", "model.safetensors.index.json", revision=rev, cache_dir=cache, local_files_only=True)
    address = "hf://statekit/tiny" + (f"@{rev}" if rev else "")
    assert inspect_path(address, env_for(HF_HUB_CACHE=cache)) == theirs


def test_hf_home_is_honoured(cache):
    home = cache.parent / "home"
    home.mkdir()
    shutil.move(str(cache), home / "hub")
    theirs = snapshot_download("statekit/tiny", cache_dir=home / "hub", local_files_only=True)
    assert inspect_path("hf://statekit/tiny", env_for(HF_HOME=home)) == os.path.join(theirs, "model.safetensors.index.json")


def test_path_inside_the_repo(cache, tmp_path):
    theirs = hf_hub_download("statekit/tiny", "single/model.safetensors", cache_dir=cache, local_files_only=True)
    env = env_for(HF_HUB_CACHE=cache)
    assert inspect_path("hf://statekit/tiny/single/model.safetensors", env) == theirs
    # Operations read through the cache's symlinks like any other path.
    out = tmp_path / "merged.safetensors"
    run_ckpt("merge", "hf://statekit/tiny", out, env=env)
    assert out.read_bytes() == Path(theirs).read_bytes()
    assert run_ckpt("verify", "hf://statekit/tiny@v1", env=env).returncode == 0


def test_missing_repo_says_where_it_looked(cache):
    proc = run_ckpt("inspect", "hf://statekit/absent", env=env_for(HF_HUB_CACHE=cache), check=False)
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: `statekit/absent` (revision `main`) has no `model.safetensors.index.json` or `model.safetensors` "
        f"in the local Hugging Face cache {cache}\n"
    )
