"""The test Hub (tests/hub/server.py) against the real client: huggingface_hub, pointed at it with
HF_ENDPOINT, downloads, lays out its cache, reads headers by range, meets a gated repository,
missing repositories and files, pushes, and lives through a dropped connection and a flipped
byte, as it does against huggingface.co. What ckpt's own tests assert of the server holds only
if huggingface_hub finds it faithful first.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported, so every
client call runs in a fresh interpreter with its environment set (harness.client_env).
"""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "hub"))
from harness import DEFAULT_TOKEN, ORG, HubServer, client_env, make_repos

SHARDS = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory):
    return make_repos(tmp_path_factory.mktemp("hub-root"))


@pytest.fixture(scope="module")
def hub(hub_root):
    with HubServer(hub_root) as server:
        yield server


@pytest.fixture
def env_for(hub, tmp_path):
    """client_env with a fresh cache and HF_HOME for this test; keyword arguments added."""

    def make(**extra):
        return client_env(hub, tmp_path / "cache", tmp_path / "home", **extra)

    return make


def client(code: str, env: dict) -> dict:
    """Runs `code` (huggingface_hub calls that print one JSON line last) in a fresh
    interpreter under `env`, and returns what it printed."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
                          env=env, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f"client exited {proc.returncode}:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def new_entries(hub, before):
    return hub.log()[before:]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def git_blob_sha1(path: Path) -> str:
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def assert_cached(cache, hub, hub_root, name, files):
    """`cache` holds `files` of ORG/name at the server's commit, laid out as huggingface_hub
    lays out what it downloads from huggingface.co."""
    repo = cache / f"models--{ORG}--{name}"
    commit = hub.commit(name)
    assert (repo / "refs" / "main").read_text() == commit
    snapshot = repo / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(files)
    for f in files:
        source = hub_root / ORG / name / f
        # An LFS file's blob is named by its SHA-256, a regular file's by its git blob id: the
        # ETag each gets from the server, as on the Hub.
        etag = sha256_of(source) if f.endswith(".safetensors") else git_blob_sha1(source)
        link = snapshot / f
        assert link.is_symlink() and os.readlink(link) == f"../../blobs/{etag}"
        assert link.read_bytes() == source.read_bytes()
    assert not list(repo.rglob("*.incomplete"))


def test_snapshot_and_file_downloads_lay_out_the_cache_as_on_the_hub(hub, hub_root, env_for, tmp_path):
    out = client("""
        import json
        from huggingface_hub import hf_hub_download, snapshot_download
        snap = snapshot_download("statekit-test/sharded5")
        one = hf_hub_download("statekit-test/tiny", "model.safetensors")
        print(json.dumps({"snapshot": snap, "file": one}))
    """, env_for())
    cache = tmp_path / "cache"
    assert_cached(cache, hub, hub_root, "sharded5", [*SHARDS, "model.safetensors.index.json", "config.json"])
    assert_cached(cache, hub, hub_root, "tiny", ["model.safetensors"])
    assert out["snapshot"] == str(cache / f"models--{ORG}--sharded5" / "snapshots" / hub.commit("sharded5"))
    assert out["file"] == str(cache / f"models--{ORG}--tiny" / "snapshots" / hub.commit("tiny") / "model.safetensors")

    # Offline, the same call finds everything in the cache and asks the server nothing.
    before = len(hub.log())
    offline = client("""
        import json
        from huggingface_hub import snapshot_download
        print(json.dumps(snapshot_download("statekit-test/sharded5")))
    """, env_for(HF_HUB_OFFLINE=1))
    assert offline == out["snapshot"]
    assert new_entries(hub, before) == []


def test_the_hubs_resolve_cache_redirect_leaves_the_same_cache(hub_root, tmp_path):
    with HubServer(hub_root, resolve_cache=True) as hub:
        env = client_env(hub, tmp_path / "cache", tmp_path / "home")
        client("""
            import json
            from huggingface_hub import snapshot_download
            print(json.dumps(snapshot_download("statekit-test/tiny")))
        """, env)
        assert_cached(tmp_path / "cache", hub, hub_root, "tiny", ["config.json", "model.safetensors"])
        config = [(e["method"], e["path"].split("/")[1:3], e["status"]) for e in hub.log() if "config.json" in e["path"]]
    # huggingface_hub follows the relative 307 for the metadata, then fetches the pinned URL.
    assert config == [("HEAD", [ORG, "tiny"], 307), ("HEAD", ["api", "resolve-cache"], 200),
                      ("GET", ["api", "resolve-cache"], 200)]


def test_safetensors_metadata_comes_from_range_reads_of_each_shard(hub, hub_root, env_for, tmp_path):
    before = len(hub.log())
    out = client("""
        import json
        from huggingface_hub import get_safetensors_metadata
        m = get_safetensors_metadata("statekit-test/sharded5")
        print(json.dumps({f: {t: [i.dtype, i.shape] for t, i in fm.tensors.items()}
                          for f, fm in m.files_metadata.items()}))
    """, env_for())
    from safetensors import safe_open

    local = {}
    for f in SHARDS:
        with safe_open(hub_root / ORG / "sharded5" / f, "pt") as st:
            slices = {t: st.get_slice(t) for t in st.keys()}  # noqa: SIM118 - safe_open is no mapping
            local[f] = {t: [s.get_dtype(), list(s.get_shape())] for t, s in slices.items()}
    assert out == local

    log = new_entries(hub, before)
    lfs = {sha256_of(hub_root / ORG / "sharded5" / f): f for f in SHARDS}
    reads = [e for e in log if e["method"] == "GET" and e["path"].startswith("/_lfs/")]
    assert sorted(lfs[e["path"].removeprefix("/_lfs/")] for e in reads) == SHARDS
    for e in reads:
        # huggingface_hub's first read asks for the first 100,000 bytes (hf_api.py: most headers
        # fit, and one request beats two); the shards are about 590 KB, so this is no download.
        assert (e["range"], e["status"], e["bytes"]) == ("bytes=0-100000", 206, 100_001)
    # Nothing of a shard is kept: only the index, which it downloads whole, reaches the cache.
    repo = tmp_path / "cache" / f"models--{ORG}--sharded5"
    assert sorted(p.name for p in (repo / "snapshots" / hub.commit("sharded5")).iterdir()) == [
        "model.safetensors.index.json"]


def test_a_gated_repository_wants_hf_token(hub, hub_root, env_for):
    code = """
        import json, os
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import GatedRepoError
        try:
            path = hf_hub_download("statekit-test/gated", "config.json")
            print(json.dumps({"ok": open(path).read()}))
        except GatedRepoError as e:
            print(json.dumps({"error": type(e).__name__, "status": e.response.status_code}))
    """
    assert client(code, env_for()) == {"error": "GatedRepoError", "status": 401}
    assert client(code, env_for(HF_TOKEN="hf_wrong")) == {"error": "GatedRepoError", "status": 403}
    config = (hub_root / ORG / "gated" / "config.json").read_text()
    assert client(code, env_for(HF_TOKEN=DEFAULT_TOKEN)) == {"ok": config}


def test_a_tag_and_a_commit_name_revisions_as_on_the_hub(hub, hub_root, env_for, tmp_path):
    commit = hub.commit("tiny")
    out = client(f"""
        import json
        from huggingface_hub import hf_hub_download
        print(json.dumps([hf_hub_download("statekit-test/tiny", "config.json", revision=rev)
                          for rev in ("v1", {commit!r})]))
    """, env_for())
    repo = tmp_path / "cache" / f"models--{ORG}--tiny"
    assert out == [str(repo / "snapshots" / commit / "config.json")] * 2
    # A tag gets its ref file, as a branch does; a commit needs none.
    assert sorted(p.name for p in (repo / "refs").iterdir()) == ["v1"]
    assert (repo / "refs" / "v1").read_text() == commit

    # A tag naming a subfolder has that folder's tree, and `main` leaves the folder out.
    tagged = hub_root / ORG / "tagged"
    (tagged / "old").mkdir(parents=True)
    (tagged / "config.json").write_text('{"new": true}')
    (tagged / "old" / "config.json").write_text('{"old": true}')
    (tagged / ".refs.json").write_text('{"v0": "old"}')
    files = {rev: [s["rfilename"] for s in json.loads(hub.request("GET", f"/api/models/{ORG}/tagged/revision/{rev}"))
                   ["siblings"]] for rev in ("main", "v0")}
    assert files == {"main": ["config.json"], "v0": ["config.json"]}
    assert hub.request("GET", f"/{ORG}/tagged/resolve/v0/config.json") == b'{"old": true}'
    assert hub.commit("tagged", "v0") != hub.commit("tagged")


def test_missing_repositories_files_and_revisions_are_the_hub_errors(hub, env_for):
    out = client("""
        import json
        from huggingface_hub import hf_hub_download, get_safetensors_metadata
        def error_of(call):
            try:
                call()
                return None
            except Exception as e:
                return type(e).__name__
        print(json.dumps({
            "repo": error_of(lambda: hf_hub_download("statekit-test/absent", "config.json")),
            "file": error_of(lambda: hf_hub_download("statekit-test/tiny", "absent.json")),
            "revision": error_of(lambda: hf_hub_download("statekit-test/tiny", "config.json", revision="v9")),
            "hostile": error_of(lambda: get_safetensors_metadata("statekit-test/hostile")),
        }))
    """, env_for())
    # The hostile shard's header length points past its end: the server answers the clipped
    # range (206), and huggingface_hub refuses what it got.
    assert out == {"repo": "RepositoryNotFoundError", "file": "RemoteEntryNotFoundError",
                   "revision": "RevisionNotFoundError", "hostile": "SafetensorsParsingError"}


def test_upload_folder_and_create_commit_land_files_and_move_the_commit(hub, hub_root, env_for, tmp_path):
    folder = tmp_path / "to-push"
    folder.mkdir()
    tiny = hub_root / ORG / "tiny"
    (folder / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (folder / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    before = len(hub.log())
    # The test Hub speaks the LFS basic transfer, not Xet; with hf_xet installed huggingface_hub
    # would upload through Xet unless told not to.
    out = client(f"""
        import json
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
        api = HfApi()
        api.create_repo("statekit-test/pushed")
        first = api.upload_folder(repo_id="statekit-test/pushed", folder_path={str(folder)!r}).oid
        again = api.upload_folder(repo_id="statekit-test/pushed", folder_path={str(folder)!r}).oid
        second = api.create_commit("statekit-test/pushed", commit_message="more", operations=[
            CommitOperationAdd("notes/readme.txt", b"small and regular"),
            CommitOperationAdd("extra.bin", b"large in spirit" * 1000),
            CommitOperationDelete("config.json"),
        ]).oid
        print(json.dumps([first, again, second]))
    """, env_for(HF_TOKEN=DEFAULT_TOKEN, HF_HUB_DISABLE_XET=1))
    first, again, second = out
    pushed = hub_root / ORG / "pushed"
    assert second == hub.commit("pushed") and first != second
    # The same folder again is no commit: huggingface_hub compares the oids preupload returns.
    assert again == first
    assert sorted(str(p.relative_to(pushed)) for p in pushed.rglob("*") if p.is_file()) == [
        "extra.bin", "model.safetensors", "notes/readme.txt"]
    assert (pushed / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert (pushed / "notes" / "readme.txt").read_bytes() == b"small and regular"
    assert (pushed / "extra.bin").read_bytes() == b"large in spirit" * 1000

    log = new_entries(hub, before)
    puts = [e["path"] for e in log if e["method"] == "PUT"]
    # LFS bytes go through the batch API's upload action, once each; regular files ride inline.
    assert puts == [f"/_lfs_upload/{sha256_of(tiny / 'model.safetensors')}",
                    f"/_lfs_upload/{hashlib.sha256(b'large in spirit' * 1000).hexdigest()}"]
    commits = [e for e in log if e["path"] == f"/api/models/{ORG}/pushed/commit/main"]
    assert [e["status"] for e in commits] == [200, 200]

    # A write without the token is refused with the Hub's 401. On huggingface.co huggingface_hub
    # would name it RepositoryNotFoundError, but the pattern it tells Hub URLs by
    # (utils/_http.py, REPO_API_REGEX) wants https, so on http://127.0.0.1 it stays the plain
    # HfHubHTTPError.
    refused = client("""
        import json
        from huggingface_hub import HfApi
        try:
            HfApi().upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="statekit-test/pushed")
            print(json.dumps(None))
        except Exception as e:
            print(json.dumps([type(e).__name__, e.response.status_code]))
    """, env_for(HF_HUB_DISABLE_XET=1))
    assert refused == ["HfHubHTTPError", 401]
    assert hub.commit("pushed") == second


def test_a_dropped_connection_is_resumed_by_huggingface_hub(hub, hub_root, env_for, tmp_path):
    shard = hub_root / ORG / "sharded5" / SHARDS[0]
    hub.control(drop_after=100_000)
    before = len(hub.log())
    out = client(f"""
        import json
        from huggingface_hub import hf_hub_download
        print(json.dumps(hf_hub_download("statekit-test/sharded5", {SHARDS[0]!r})))
    """, env_for())
    hub.control()
    gets = [(e["range"], e["status"], e["bytes"]) for e in new_entries(hub, before)
            if e["method"] == "GET" and e["path"].startswith("/_lfs/")]
    # huggingface_hub's http_get takes the early end for a network error, waits a second and
    # tries again within the same call, with a Range from the bytes it has written. It reads
    # the body in 10 MiB pieces (constants.DOWNLOAD_CHUNK_SIZE), so the 100,000 bytes that came
    # before the break were never written: the retry asks for the whole file again.
    size = shard.stat().st_size
    assert gets == [(None, 200, 100_000), (None, 200, size)]
    assert Path(out).read_bytes() == shard.read_bytes()


def test_a_flipped_byte_is_not_noticed_by_huggingface_hub(hub, hub_root, env_for, tmp_path):
    source = hub_root / ORG / "tiny" / "model.safetensors"
    hub.control(corrupt=True)
    out = client("""
        import json
        from huggingface_hub import hf_hub_download
        print(json.dumps(hf_hub_download("statekit-test/tiny", "model.safetensors")))
    """, env_for())
    hub.control()
    # huggingface_hub checks an HTTP download's size, never its hash (file_download.http_get):
    # the flipped byte lands in the cache under the name of a SHA-256 it does not have. ckpt
    # must refuse such a blob (issue 38); this pins that the client it is compared with does not.
    got, want = Path(out).read_bytes(), source.read_bytes()
    assert len(got) == len(want)
    assert [i for i in range(len(got)) if got[i] != want[i]] == [len(want) // 2]
    blob = Path(os.path.realpath(out))
    assert blob.name == sha256_of(source) != sha256_of(blob)


def test_faults_are_one_shot_but_delay_stays_until_cleared(hub, hub_root):
    path = f"/{ORG}/sharded5/resolve/main/config.json"
    want = (hub_root / ORG / "sharded5" / "config.json").read_bytes()
    hub.control(corrupt=True)
    assert hub.request("GET", path) != want
    assert hub.request("GET", path) == want
    hub.control(delay=0.3)
    t0 = time.monotonic()
    assert hub.request("GET", path) == want
    assert hub.request("GET", path, headers={"Range": "bytes=0-9"}) == want[:10]
    assert time.monotonic() - t0 >= 0.6
    hub.control()
    t0 = time.monotonic()
    hub.request("GET", path)
    assert time.monotonic() - t0 < 0.3
    last = hub.log()[-1]
    assert last == {"method": "GET", "path": path, "range": None, "status": 200, "bytes": len(want)}


def answer(hub, method, path, headers=None, body=None):
    """(status, headers, body) of one request, errors included."""
    req = urllib.request.Request(hub.url + path, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_ranges_and_paths_that_leave_the_repository(hub, hub_root):
    path = f"/{ORG}/tiny/resolve/main/config.json"
    data = (hub_root / ORG / "tiny" / "config.json").read_bytes()
    status, headers, body = answer(hub, "GET", path, {"Range": "bytes=10-19"})
    assert (status, headers["Content-Range"], body) == (206, f"bytes 10-19/{len(data)}", data[10:20])
    status, headers, body = answer(hub, "GET", path, {"Range": "bytes=-5"})
    assert (status, body) == (206, data[-5:])
    status, headers, _ = answer(hub, "GET", path, {"Range": f"bytes={len(data)}-"})
    assert (status, headers["Content-Range"]) == (416, f"bytes */{len(data)}")

    # A path is looked up in the revision's file list, never joined onto the disk.
    status, headers, _ = answer(hub, "GET", f"/{ORG}/tiny/resolve/main/..%2F..%2F{ORG}%2Fgated%2Fconfig.json")
    assert (status, headers["X-Error-Code"]) == (404, "EntryNotFound")
    # A commit that would write outside the repository, or over its control files, writes nothing.
    auth = {"Authorization": f"Bearer {DEFAULT_TOKEN}", "Content-Type": "application/x-ndjson"}
    for bad in ["../escaped.txt", ".gated", "a/../../escaped.txt"]:
        lines = [{"key": "header", "value": {"summary": "x"}},
                 {"key": "file", "value": {"path": bad, "content": "eA==", "encoding": "base64"}}]
        payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
        status, _, body = answer(hub, "POST", f"/api/models/{ORG}/tiny/commit/main", auth, payload)
        assert (status, json.loads(body)["error"]) == (400, f"invalid path in repository: `{bad}`")
    assert not (hub_root / ORG / "escaped.txt").exists() and not (hub_root / "escaped.txt").exists()
    assert (hub_root / ORG / "tiny" / ".refs.json").exists() and not (hub_root / ORG / "tiny" / ".gated").exists()
