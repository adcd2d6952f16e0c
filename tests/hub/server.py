"""A local Hugging Face Hub for tests and benchmarks: it serves the repositories found under a
folder with the endpoints, headers and error codes the real Hub answers with, so that
huggingface_hub, hf-hub and `ckpt` can download from it, read headers with range requests, and
push to it, all on 127.0.0.1. Standard library only.

    python tests/hub/server.py --root ROOT [--port 0] [--log LOG.jsonl] [--token TOKEN]

prints `PORT <n>` as its first line on stdout once it listens, then serves until killed.

Repositories. `ROOT/<org>/<name>/` is a model repository whose files are the files under it,
except the control files at its top: `.gated` (the repository is gated: reading a file takes
`Authorization: Bearer TOKEN`; none gives 401, another token 403, both with huggingface_hub's
`X-Error-Code: GatedRepo`) and `.refs.json` (`{"v1": "."}` names the tree as it is `v1`;
`{"v0": "old"}` makes the subfolder `old/` the tree of revision `v0`, and leaves it out of
`main`). Folders whose name starts with a dot at ROOT (`ROOT/.lfs-uploads/ORG/NAME/`, where
pushed LFS objects wait for their commit) are no repositories. A revision's commit is a SHA-1 over its
files' paths and git object ids, so it is stable while the files stay, and changes when they
do; a 40-hex revision equal to a commit of the repository names that commit's tree.

Which files are LFS files: `*.safetensors`, `*.bin`, `*.pt`, and any file over 10 MiB, as the
Hub's default `.gitattributes` and its 10 MiB limit on regular files have them. For those,
`/resolve` answers `302` with `X-Linked-Etag` (the quoted SHA-256), `X-Linked-Size` and
`X-Repo-Commit`, and a `Location` on a second port of this server (`/_lfs/<sha256>`): on the
real Hub the bytes come from a CDN on another host, and clients rely on that. huggingface_hub
follows a redirect on the same origin and reads the metadata from the last response, but stops
at one to another origin (and drops the token there); hf-hub follows only relative redirects.
A second port is another origin to both, so they read `X-Linked-*` from the `302` as they do on
the real Hub. `/_lfs/<sha256>` is served on the main port too. Other files are served by
`/resolve` itself, with their git blob SHA-1 as the quoted `ETag`. Both honour one `Range`
(`206` with `Content-Range`, `416` with `Content-Range: bytes */SIZE`).

`--resolve-cache` serves regular files as huggingface.co does today for public repositories:
`/resolve` answers `307` with `X-Repo-Commit` and a relative `Location` to
`/api/resolve-cache/models/{org}/{name}/{commit}/{path}?...&etag=...`, which serves the bytes
with the `ETag` (gated repositories and empty files are served directly, as on the Hub). A
client that reads the `ETag` from the first answer, or does not follow a relative redirect,
fails there as it would on the Hub. Off by default, the layout above being the fixed interface.

Endpoints (as the Hub speaks them; see huggingface_hub's file_download.py, hf_api.py,
_commit_api.py, lfs.py and utils/_http.py):

    HEAD|GET /{org}/{name}/resolve/{rev}/{path}      file bytes, or 302 for an LFS file
    HEAD|GET /_lfs/{sha256}                          LFS bytes (both ports)
    HEAD|GET /api/resolve-cache/models/{org}/{name}/{commit}/{path}
                                                     a regular file (--resolve-cache)
    GET  /api/models/{org}/{name}[/revision/{rev}]   {"id", "sha", "siblings", ...}; ?blobs=true
                                                     adds "size", "blobId" and "lfs"
    GET  /api/models/{org}/{name}/tree/{rev}[/{path}] the tree listing (?recursive=true), which
                                                     snapshot_download reads
    POST /api/models/{org}/{name}/preupload/{rev}    regular or lfs per file, and the remote oid
    POST /{org}/{name}.git/info/lfs/objects/batch    basic transfer: an upload action for each
                                                     object the repository lacks, none for one
                                                     it has (the client then skips it)
    PUT  /_lfs_upload/{sha256}?repo={org}/{name}     the object (the action's href, on the
                                                     second port), checked against its SHA-256
    POST /api/models/{org}/{name}/commit/{rev}       NDJSON: header, file, lfsFile,
                                                     deletedFile, deletedFolder; writes ROOT
    POST /api/repos/create                           an empty repository (409 if it exists)

Reading a gated repository's information and tree listing takes no token, as on the Hub; its
files do. Writes (preupload, batch, commit, create) take `Authorization: Bearer TOKEN`, as the
Hub takes a write token: none gives 401 "Invalid username or password.", another token 401
"Invalid credentials in Authorization header" (the Hub's own messages). TOKEN defaults to
`hf_statekit_test_token`. Errors carry the Hub's `X-Error-Code` (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo) and `X-Error-Message`, which huggingface_hub maps
to its exception classes; an EntryNotFound also carries `X-Repo-Commit`, as on the Hub.

Test control (not logged):

    POST /_control {"drop_after": N}   the next data response closes its connection after N
                                       body bytes
    POST /_control {"corrupt": true}   the next data response has one byte flipped (its middle)
    POST /_control {"delay": S}        every data response sleeps S seconds before each 64 KiB
                                       chunk, until cleared
    POST /_control {}                  clears all faults (each POST replaces the set)
    GET  /_log                         the request log, JSON lines of {"method", "path",
                                       "range", "status", "bytes"}

A data response is a GET that sends file bytes (`/resolve` of a regular file, `/_lfs/`,
`/api/resolve-cache/`), never a HEAD, a redirect or a JSON answer. `path` is the request path without its query; `bytes`
counts the body bytes actually sent. `--log` appends the same lines to a file as they happen.

Every write into ROOT is a temporary file in the target's folder, fsynced, then renamed.
"""

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

DEFAULT_TOKEN = "hf_statekit_test_token"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt")
# The Hub refuses regular (non-LFS) files over 10 MiB.
LFS_THRESHOLD = 10 * 1024 * 1024
CHUNK = 64 * 1024
# Request bodies other than LFS uploads (commit payloads carry regular files, at most 10 MiB
# each, base64) are read whole; this bounds what one request can make the server hold.
MAX_JSON_BODY = 256 * 1024 * 1024
CONTROL_FILES = (".gated", ".refs.json")
UPLOADS = ".lfs-uploads"
TMP_PREFIX = ".hubtmp-"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
SHA1 = re.compile(r"^[0-9a-f]{40}$")


class HubError(Exception):
    """An answer other than success: status, the Hub's X-Error-Code (if any) and message."""

    def __init__(self, status, message, code=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


def lfs_pointer(sha256, size):
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def is_lfs(path, size):
    return path.endswith(LFS_SUFFIXES) or size > LFS_THRESHOLD


class FileInfo:
    """One file of a revision: where it lies and the ids the Hub gives it."""

    __slots__ = ("abspath", "blob_sha1", "lfs", "sha256", "size")

    def __init__(self, abspath, size, blob_sha1, sha256, lfs):
        self.abspath = abspath
        self.size = size
        self.blob_sha1 = blob_sha1
        self.sha256 = sha256
        self.lfs = lfs

    @property
    def pointer(self):
        return lfs_pointer(self.sha256, self.size)

    @property
    def oid(self):
        """The git object id the Hub lists: an LFS file's is its pointer's blob id."""
        if self.lfs:
            p = self.pointer
            return hashlib.sha1(b"blob %d\0" % len(p) + p).hexdigest()
        return self.blob_sha1


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(dest, chunks):
    """Writes the byte strings `chunks` to `dest` through a temporary beside it, fsynced and
    renamed, so a reader sees the old file or the new one, never a part."""
    folder = os.path.dirname(dest)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def file_chunks(path):
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


class Hub:
    """The state the handlers share: ROOT, the hash cache, the faults and the log."""

    def __init__(self, root, token, log_path, resolve_cache=False):
        self.root = os.path.abspath(root)
        self.token = token
        self.resolve_cache = resolve_cache
        self.base_url = ""
        self.lfs_url = ""
        self.write_lock = threading.Lock()
        self._hash_lock = threading.Lock()
        self._hashes = {}
        self._by_sha256 = {}
        self._fault_lock = threading.Lock()
        self._faults = {}
        self._log_lock = threading.Lock()
        self._log = []
        self._log_path = log_path

    # ---- faults and log -------------------------------------------------------------------

    def set_faults(self, faults):
        allowed = {"drop_after", "corrupt", "delay"}
        if not isinstance(faults, dict) or set(faults) - allowed:
            raise HubError(400, f"_control takes a JSON object with keys among {sorted(allowed)}")
        if "drop_after" in faults and not (isinstance(faults["drop_after"], int) and faults["drop_after"] >= 0):
            raise HubError(400, "drop_after must be a non-negative integer")
        if "delay" in faults and not (isinstance(faults["delay"], (int, float)) and faults["delay"] >= 0):
            raise HubError(400, "delay must be a non-negative number of seconds")
        with self._fault_lock:
            self._faults = dict(faults)

    def take_faults(self):
        """The faults for the data response about to start: drop_after and corrupt are used up
        by it, delay stays until cleared."""
        with self._fault_lock:
            drop = self._faults.pop("drop_after", None)
            corrupt = bool(self._faults.pop("corrupt", False))
            delay = float(self._faults.get("delay", 0))
        return drop, corrupt, delay

    def record(self, entry):
        line = json.dumps(entry)
        with self._log_lock:
            self._log.append(line)
            if self._log_path is not None:
                # Opened per line, so the file is complete whenever the server is killed.
                with open(self._log_path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")

    def log_text(self):
        with self._log_lock:
            return "".join(line + "\n" for line in self._log)

    # ---- files and revisions --------------------------------------------------------------

    def hashes(self, abspath, st):
        """(git blob sha1, sha256) of a file, computed in one read and kept while its size,
        mtime and inode stay (a push replaces a file by rename, so a new inode)."""
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._hash_lock:
            hit = self._hashes.get(abspath)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        sha1 = hashlib.sha1(b"blob %d\0" % st.st_size)
        sha256 = hashlib.sha256()
        with open(abspath, "rb") as f:
            while chunk := f.read(1 << 20):
                sha1.update(chunk)
                sha256.update(chunk)
        value = (key, sha1.hexdigest(), sha256.hexdigest())
        with self._hash_lock:
            self._hashes[abspath] = value
            self._by_sha256[value[2]] = abspath
        return value[1], value[2]

    def repo_dir(self, org, name):
        if not (NAME.match(org) and NAME.match(name)) or ".." in org or ".." in name:
            raise HubError(404, "Repository not found", "RepoNotFound")
        path = os.path.join(self.root, org, name)
        if not os.path.isdir(path):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return path

    def refs(self, repo):
        path = os.path.join(repo, ".refs.json")
        if not os.path.exists(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                refs = json.load(f)
        except (OSError, ValueError) as e:
            raise HubError(500, f"{path}: not a JSON object of revision names to folders: {e}") from None
        if not isinstance(refs, dict) or not all(isinstance(v, str) for v in refs.values()):
            raise HubError(500, f"{path}: not a JSON object of revision names to folders")
        return refs

    def list_tree(self, top, skip_top):
        """{relative path: FileInfo} of the files under `top`, control and temporary files
        and the top-level folders in `skip_top` left out."""
        files = {}
        for dirpath, dirnames, filenames in os.walk(top):
            rel_dir = os.path.relpath(dirpath, top)
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if d not in skip_top and d != ".git"]
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.startswith(TMP_PREFIX) or (rel_dir == "." and fn in CONTROL_FILES):
                    continue
                abspath = os.path.join(dirpath, fn)
                st = os.stat(abspath)
                rel = fn if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{fn}"
                blob_sha1, sha256 = self.hashes(abspath, st)
                files[rel] = FileInfo(abspath, st.st_size, blob_sha1, sha256, is_lfs(rel, st.st_size))
        return files

    @staticmethod
    def commit_of(files):
        h = hashlib.sha1(b"statekit test hub commit\n")
        for rel in sorted(files):
            h.update(f"{rel}\0{files[rel].oid}\n".encode())
        return h.hexdigest()

    def revisions(self, repo):
        """{revision name: (commit, files)} for `main` and every name in `.refs.json`."""
        refs = self.refs(repo)
        subfolders = {v for v in refs.values() if v not in (".", "")}
        out = {}
        main = self.list_tree(repo, subfolders)
        out["main"] = (self.commit_of(main), main)
        for name, folder in refs.items():
            if folder in (".", ""):
                out[name] = out["main"]
                continue
            top = os.path.join(repo, folder)
            if os.path.isabs(folder) or ".." in folder.split("/") or not os.path.isdir(top):
                raise HubError(500, f"{repo}/.refs.json: revision `{name}` names `{folder}`, not a folder of the repository")
            files = self.list_tree(top, set())
            out[name] = (self.commit_of(files), files)
        return out

    def revision(self, repo, rev):
        revs = self.revisions(repo)
        if rev in revs:
            return revs[rev]
        if SHA1.match(rev):
            for commit, files in revs.values():
                if commit == rev:
                    return commit, files
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def staged(self, org, name, sha256):
        return os.path.join(self.root, UPLOADS, org, name, sha256)

    def find_lfs(self, sha256, org=None, name=None):
        """The path of a file whose SHA-256 is `sha256`. For a repository (`org`, `name`): one
        of its files or an object uploaded to it and waiting for its commit, as an LFS store
        keeps objects per repository. Without: any repository's or upload's (what `/_lfs/`
        serves, as a CDN would)."""
        if org is not None:
            staged = self.staged(org, name, sha256)
            if os.path.exists(staged):
                return staged
            repos = [os.path.join(self.root, org, name)]
        else:
            with self._hash_lock:
                known = self._by_sha256.get(sha256)
            if known is not None and os.path.exists(known):
                return known
            uploads = os.path.join(self.root, UPLOADS)
            if os.path.isdir(uploads):
                for o in sorted(os.listdir(uploads)):
                    for n in sorted(os.listdir(os.path.join(uploads, o))):
                        if os.path.exists(self.staged(o, n, sha256)):
                            return self.staged(o, n, sha256)
            # Not seen since the server started (or moved since): hash every repository once.
            repos = [os.path.join(self.root, o, n)
                     for o in sorted(os.listdir(self.root)) if not o.startswith(".")
                     and os.path.isdir(os.path.join(self.root, o))
                     for n in sorted(os.listdir(os.path.join(self.root, o)))]
        for repo in repos:
            if os.path.isdir(repo):
                for _, files in self.revisions(repo).values():
                    for info in files.values():
                        if info.sha256 == sha256:
                            return info.abspath
        return None


def parse_range(header, size):
    """(start, end inclusive) for one `bytes=` range, None without a header; HubError(416)
    for one that selects nothing."""
    if header is None:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or (m.group(1) == "" and m.group(2) == ""):
        raise HubError(416, f"unsupported Range `{header}`", headers={"Content-Range": f"bytes */{size}"})
    if m.group(1) == "":
        n = int(m.group(2))
        if n == 0 or size == 0:
            raise HubError(416, "range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
        return max(0, size - n), size - 1
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if start >= size or end < start:
        raise HubError(416, "range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
    return start, min(end, size - 1)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "statekit-test-hub/1"
    hub: Hub  # set on the subclass main() makes

    # ---- plumbing -------------------------------------------------------------------------

    def log_message(self, format, *args):
        """The request log is /_log; the base class's stderr lines would only be noise."""

    def do_GET(self):
        self.dispatch("GET")

    def do_HEAD(self):
        self.dispatch("HEAD")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    def dispatch(self, method):
        self._status = 0
        self._sent = 0
        self._started = False
        split = urlsplit(self.path)
        self._query = parse_qs(split.query)
        raw = split.path
        try:
            self.route(method, raw)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - any failure is an answer, and the server goes on
            if not isinstance(e, HubError):
                # The server keeps serving; the client sees a 500 that names the cause.
                e = HubError(500, f"{type(e).__name__}: {e}")
            if self._started:
                # Half an answer is out: all the client can be told is that it ends here.
                self.close_connection = True
            else:
                self.send_error_answer(e)
        if raw not in ("/_log", "/_control"):
            self.hub.record({"method": method, "path": raw, "range": self.headers.get("Range"),
                             "status": self._status, "bytes": self._sent})

    def start(self, status, headers, length):
        self._status = status
        self._started = True
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def send_bytes(self, status, body, headers=None):
        self.start(status, headers or {}, len(body))
        if self.command != "HEAD" and body:
            self.wfile.write(body)
            self._sent += len(body)

    def send_json(self, value, status=200, headers=None):
        self.send_bytes(status, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

    def send_error_answer(self, e):
        headers = {"Content-Type": "application/json", **e.headers}
        if e.code:
            headers["X-Error-Code"] = e.code
        headers["X-Error-Message"] = e.message.replace("\n", " ")
        # A request body the handler did not read would be taken for the next request.
        self.close_connection = True
        headers["Connection"] = "close"
        try:
            self.send_bytes(e.status, json.dumps({"error": e.message}).encode(), headers)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def read_body(self, limit=MAX_JSON_BODY):
        """The request body, whole: Content-Length or chunked (httpx streams file objects
        chunked when it cannot tell their size)."""
        return b"".join(self.body_chunks(limit))

    def body_chunks(self, limit=None):
        total = 0
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                line = self.rfile.readline(1024)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                total += size
                if limit is not None and total > limit:
                    raise HubError(413, f"request body over {limit} bytes")
                yield self.rfile.read(size)
                self.rfile.readline(8)
        length = int(self.headers.get("Content-Length") or 0)
        if limit is not None and length > limit:
            raise HubError(413, f"request body over {limit} bytes")
        while total < length:
            chunk = self.rfile.read(min(1 << 20, length - total))
            if not chunk:
                raise HubError(400, "request body shorter than its Content-Length")
            total += len(chunk)
            yield chunk

    def read_json(self):
        try:
            return json.loads(self.read_body() or b"null")
        except ValueError as e:
            raise HubError(400, f"request body is not JSON: {e}") from None

    def bearer(self):
        auth = self.headers.get("Authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def check_read(self, repo, org, name):
        if not os.path.exists(os.path.join(repo, ".gated")):
            return
        token = self.bearer()
        if token is None:
            raise HubError(401, f"Access to model {org}/{name} is restricted. You must have access to it and be "
                           "authenticated to access it. Please log in.", "GatedRepo")
        if token != self.hub.token:
            raise HubError(403, f"Access to model {org}/{name} is restricted and you are not in the authorized "
                           "list.", "GatedRepo")

    def check_write(self):
        token = self.bearer()
        if token is None:
            raise HubError(401, "Invalid username or password.")
        if token != self.hub.token:
            raise HubError(401, "Invalid credentials in Authorization header")

    # ---- routes ---------------------------------------------------------------------------

    def route(self, method, raw):
        parts = [unquote(p) for p in raw.split("/")[1:]]
        n = len(parts)
        if raw == "/_control" and method == "POST":
            self.hub.set_faults(self.read_json())
            return self.send_json({"ok": True})
        if raw == "/_log" and method == "GET":
            return self.send_bytes(200, self.hub.log_text().encode(), {"Content-Type": "application/x-ndjson"})
        if n == 2 and parts[0] == "_lfs" and method in ("GET", "HEAD"):
            return self.serve_lfs(parts[1])
        if n == 2 and parts[0] == "_lfs_upload" and method == "PUT":
            return self.lfs_upload(parts[1])
        if parts[:3] == ["api", "repos", "create"] and n == 3 and method == "POST":
            return self.create_repo()
        if n >= 7 and parts[:3] == ["api", "resolve-cache", "models"] and method in ("GET", "HEAD"):
            return self.resolve_cached(parts[3], parts[4], parts[5], parts[6:])
        if n >= 4 and parts[:2] == ["api", "models"]:
            org, name, rest = parts[2], parts[3], parts[4:]
            repo = self.hub.repo_dir(org, name)
            if not rest and method in ("GET", "HEAD"):
                return self.model_info(repo, org, name, "main")
            if len(rest) == 2 and rest[0] == "revision" and method in ("GET", "HEAD"):
                return self.model_info(repo, org, name, rest[1])
            if len(rest) >= 2 and rest[0] == "tree" and method in ("GET", "HEAD"):
                return self.tree(repo, rest[1], "/".join(rest[2:]))
            if len(rest) == 2 and rest[0] == "preupload" and method == "POST":
                return self.preupload(repo, rest[1])
            if len(rest) == 2 and rest[0] == "commit" and method == "POST":
                return self.commit(repo, org, name, rest[1])
        if n == 6 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"] and method == "POST":
            return self.lfs_batch(parts[0], parts[1][: -len(".git")])
        if n >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self.resolve(parts[0], parts[1], parts[3], parts[4:])
        raise HubError(404, f"no such endpoint: {method} {raw}")

    def resolve(self, org, name, rev, path_parts):
        repo = self.hub.repo_dir(org, name)
        self.check_read(repo, org, name)
        commit, files = self.hub.revision(repo, rev)
        path = "/".join(path_parts)
        info = files.get(path)
        if info is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit})
        gated = os.path.exists(os.path.join(repo, ".gated"))
        if self.hub.resolve_cache and not info.lfs and not gated and info.size > 0:
            # The Hub's answer for a regular file of a public repository: a relative redirect to
            # a commit-pinned URL, whose response carries the ETag (the 307 only the commit).
            original = quote(f"/{org}/{name}/resolve/{rev}/{path}", safe="")
            location = (f"/api/resolve-cache/models/{org}/{name}/{commit}/{quote(path)}"
                        f"?{original}=&etag=%22{info.blob_sha1}%22")
            return self.send_bytes(307, b"", {"Location": location, "X-Repo-Commit": commit})
        if info.lfs:
            headers = {
                "Location": f"{self.hub.lfs_url}/_lfs/{info.sha256}",
                "ETag": f'"{info.sha256}"',
                "X-Linked-Etag": f'"{info.sha256}"',
                "X-Linked-Size": str(info.size),
                "X-Repo-Commit": commit,
            }
            return self.send_bytes(302, b"", headers)
        self.send_file(info.abspath, info.size, f'"{info.blob_sha1}"', {"X-Repo-Commit": commit})

    def resolve_cached(self, org, name, commit, path_parts):
        repo = self.hub.repo_dir(org, name)
        self.check_read(repo, org, name)
        if not SHA1.match(commit):
            raise HubError(400, f"resolve-cache takes a commit, not `{commit}`")
        commit, files = self.hub.revision(repo, commit)
        info = files.get("/".join(path_parts))
        if info is None or info.lfs:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit})
        self.send_file(info.abspath, info.size, f'"{info.blob_sha1}"', {"X-Repo-Commit": commit})

    def serve_lfs(self, sha256):
        path = self.hub.find_lfs(sha256) if SHA256.match(sha256) else None
        if path is None:
            raise HubError(404, "Entry not found", "EntryNotFound")
        self.send_file(path, os.path.getsize(path), f'"{sha256}"', {})

    def send_file(self, path, size, etag, headers):
        rng = parse_range(self.headers.get("Range"), size)
        headers = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **headers}
        if rng is None:
            start, end, status = 0, size - 1, 200
        else:
            start, end = rng
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = end - start + 1
        self.start(status, headers, length)
        if self.command == "HEAD" or length == 0:
            return
        drop, corrupt, delay = self.hub.take_faults()
        flip_at = length // 2 if corrupt else -1
        budget = length if drop is None else min(drop, length)
        done = 0
        with open(path, "rb") as f:
            f.seek(start)
            while done < budget:
                if delay:
                    time.sleep(delay)
                chunk = f.read(min(CHUNK, budget - done))
                if not chunk:
                    break
                if done <= flip_at < done + len(chunk):
                    b = bytearray(chunk)
                    b[flip_at - done] ^= 0xFF
                    chunk = bytes(b)
                self.wfile.write(chunk)
                done += len(chunk)
                self._sent = done
        if drop is not None:
            # The client sees the body end early, as when a connection breaks half-way.
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def model_info(self, repo, org, name, rev):
        commit, files = self.hub.revision(repo, rev)
        blobs = self._query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for rel, info in sorted(files.items()):
            sib = {"rfilename": rel}
            if blobs:
                sib["blobId"] = info.oid
                sib["size"] = info.size
                if info.lfs:
                    sib["lfs"] = {"sha256": info.sha256, "size": info.size, "pointerSize": len(info.pointer)}
            siblings.append(sib)
        gated = os.path.exists(os.path.join(repo, ".gated"))
        self.send_json({
            "_id": commit[:24], "id": f"{org}/{name}", "modelId": f"{org}/{name}", "author": org, "sha": commit,
            "private": False, "gated": "manual" if gated else False, "disabled": False,
            "downloads": 0, "likes": 0, "tags": [], "library_name": None, "siblings": siblings,
        })

    def tree(self, repo, rev, prefix):
        commit, files = self.hub.revision(repo, rev)
        recursive = self._query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = prefix.strip("/")
        base = prefix + "/" if prefix else ""
        entries = {}
        for rel, info in sorted(files.items()):
            if not rel.startswith(base):
                continue
            parts = rel[len(base):].split("/")
            # The folders on the way, listed once each (all of them when recursive).
            for depth in range(1, len(parts)):
                if not recursive and depth > 1:
                    break
                d = base + "/".join(parts[:depth])
                entries.setdefault(d, {"type": "directory", "oid": hashlib.sha1(f"{commit}:{d}".encode()).hexdigest(),
                                       "size": 0, "path": d})
            if recursive or len(parts) == 1:
                entry = {"type": "file", "oid": info.oid, "size": info.size, "path": rel}
                if info.lfs:
                    entry["lfs"] = {"oid": info.sha256, "size": info.size, "pointerSize": len(info.pointer)}
                entries[rel] = entry
        if prefix and not entries:
            raise HubError(404, f"Entry not found: {prefix}", "EntryNotFound", {"X-Repo-Commit": commit})
        self.send_json(list(entries.values()))

    # ---- writes ---------------------------------------------------------------------------

    def writable_main(self, repo, rev):
        if rev != "main":
            self.hub.revision(repo, rev)  # 404 RevisionNotFound for an unknown one
            raise HubError(400, f"the test Hub commits to `main` only, not `{rev}`")

    def preupload(self, repo, rev):
        self.check_write()
        self.writable_main(repo, rev)
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("files"), list):
            raise HubError(400, "preupload takes {\"files\": [{\"path\", \"size\", \"sample\"}, ...]}")
        _, files = self.hub.revision(repo, "main")
        out = []
        for f in body["files"]:
            if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)):
                raise HubError(400, "each preupload file needs a string `path` and an integer `size`")
            path = checked_repo_path(f["path"])
            lfs = is_lfs(path, f["size"])
            have = files.get(path)
            # The remote oid in the convention huggingface_hub compares with its own: SHA-256
            # for an LFS file, the git blob SHA-1 for a regular one.
            oid = None if have is None else (have.sha256 if lfs else have.blob_sha1)
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self.send_json({"files": out, "commitOid": self.hub.revision(repo, "main")[0]})

    def lfs_batch(self, org, name):
        self.check_write()
        self.hub.repo_dir(org, name)
        body = self.read_json()
        if not isinstance(body, dict) or body.get("operation") != "upload" or not isinstance(body.get("objects"), list):
            raise HubError(400, "the LFS batch endpoint takes {\"operation\": \"upload\", \"objects\": [...]}")
        transfers = body.get("transfers") or ["basic"]
        if "basic" not in transfers:
            raise HubError(400, f"the test Hub speaks the `basic` LFS transfer only, not {transfers}")
        objects = []
        for o in body["objects"]:
            if not (isinstance(o, dict) and isinstance(o.get("oid"), str) and SHA256.match(o["oid"])
                    and isinstance(o.get("size"), int) and o["size"] >= 0):
                raise HubError(400, "each LFS object needs a 64-hex `oid` and an integer `size`")
            entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            # An object the repository already holds gets no actions: the client skips its upload.
            if self.hub.find_lfs(o["oid"], org, name) is None:
                href = f"{self.hub.lfs_url}/_lfs_upload/{o['oid']}?repo={org}/{name}"
                entry["actions"] = {"upload": {"href": href, "header": {}, "expires_in": 3600}}
            objects.append(entry)
        self.send_bytes(200, json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode(),
                        {"Content-Type": "application/vnd.git-lfs+json"})

    def lfs_upload(self, sha256):
        if not SHA256.match(sha256):
            raise HubError(400, "an LFS upload is named by its 64-hex SHA-256")
        # The batch answer's href names the repository, as a signed storage URL would.
        org, _, name = self._query.get("repo", [""])[0].partition("/")
        self.hub.repo_dir(org, name)
        folder = os.path.dirname(self.hub.staged(org, name, sha256))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=folder)
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in self.body_chunks():
                    h.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if h.hexdigest() != sha256:
                raise HubError(400, f"uploaded bytes have SHA-256 {h.hexdigest()}, not {sha256}")
            os.replace(tmp, os.path.join(folder, sha256))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fsync_dir(folder)
        self.send_bytes(200, b"")

    def commit(self, repo, org, name, rev):
        self.check_write()
        self.writable_main(repo, rev)
        if self._query.get("create_pr", ["0"])[0] in ("1", "true"):
            raise HubError(400, "the test Hub does not open pull requests")
        lines = [ln for ln in self.read_body().split(b"\n") if ln.strip()]
        try:
            items = [json.loads(ln) for ln in lines]
        except ValueError as e:
            raise HubError(400, f"commit payload line is not JSON: {e}") from None
        if not items or not isinstance(items[0], dict) or items[0].get("key") != "header":
            raise HubError(400, "a commit payload starts with its `header` line")
        with self.hub.write_lock:
            commit, files = self.hub.revision(repo, "main")
            parent = items[0].get("value", {}).get("parentCommit")
            if parent is not None and parent != commit:
                raise HubError(412, f"A commit has happened since. Please refresh and try again. (parent {parent}, "
                               f"head {commit})")
            # Everything checked before the first write, so a bad line changes nothing.
            plan = []
            for item in items[1:]:
                key, value = item.get("key"), item.get("value")
                if not isinstance(value, dict) or not isinstance(value.get("path"), str):
                    raise HubError(400, f"commit line `{key}` needs a `value` with a `path`")
                path = checked_repo_path(value["path"].rstrip("/") if key == "deletedFolder" else value["path"])
                dest = os.path.join(repo, *path.split("/"))
                parts = path.split("/")
                if key in ("file", "lfsFile") and (os.path.isdir(dest) or any(
                        os.path.isfile(os.path.join(repo, *parts[:i])) for i in range(1, len(parts)))):
                    raise HubError(400, f"`{path}` would put a file where a folder is, or a folder where a file is")
                if key == "file":
                    if value.get("encoding", "base64") != "base64" or not isinstance(value.get("content"), str):
                        raise HubError(400, f"file `{path}`: inline content must be base64")
                    data = base64.b64decode(value["content"], validate=True)
                    plan.append(("write", dest, [data]))
                elif key == "lfsFile":
                    oid = value.get("oid")
                    ok = isinstance(oid, str) and SHA256.match(oid)
                    src = self.hub.find_lfs(oid, org, name) if ok else None
                    if src is None:
                        raise HubError(400, f"lfsFile `{path}`: no uploaded object with SHA-256 {oid}")
                    if value.get("size") is not None and os.path.getsize(src) != value["size"]:
                        raise HubError(400, f"lfsFile `{path}`: object {oid} has {os.path.getsize(src)} bytes, not "
                                       f"{value['size']}")
                    plan.append(("copy", dest, src))
                elif key == "deletedFile":
                    if path not in files:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    plan.append(("delete", dest, None))
                elif key == "deletedFolder":
                    if not any(rel.startswith(path + "/") for rel in files):
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    plan.append(("rmtree", dest, None))
                else:
                    raise HubError(400, f"the test Hub does not take commit lines of kind `{key}`")
            for op, dest, arg in plan:
                if op == "write":
                    write_atomic(dest, arg)
                elif op == "copy":
                    write_atomic(dest, file_chunks(arg))
                elif op == "delete":
                    os.unlink(dest)
                    fsync_dir(os.path.dirname(dest))
                else:
                    shutil.rmtree(dest)
                    fsync_dir(os.path.dirname(dest))
            new_commit, _ = self.hub.revision(repo, "main")
        self.send_json({"success": True, "commitOid": new_commit, "commitMessage": items[0].get("value", {}).get("summary"),
                        "commitUrl": f"{self.hub.base_url}/{org}/{name}/commit/{new_commit}",
                        "hookOutput": "", "pullRequestUrl": None})

    def create_repo(self):
        self.check_write()
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise HubError(400, "create takes {\"name\", \"organization\", \"type\"}")
        if body.get("type", "model") not in (None, "model"):
            raise HubError(400, f"the test Hub holds model repositories only, not `{body.get('type')}`")
        org, name = body.get("organization"), body["name"]
        if org is None and "/" in name:
            org, name = name.split("/", 1)
        if not (isinstance(org, str) and NAME.match(org) and NAME.match(name)) or ".." in org + name:
            raise HubError(400, f"invalid repository name `{org}/{name}`")
        url = f"{self.hub.base_url}/{org}/{name}"
        path = os.path.join(self.hub.root, org, name)
        with self.hub.write_lock:
            if os.path.isdir(path):
                raise HubError(409, "You already created this model repo", headers={})
            os.makedirs(path)
            fsync_dir(os.path.dirname(path))
        self.send_json({"url": url, "name": f"{org}/{name}", "id": f"{org}/{name}"})


def checked_repo_path(path):
    """A path inside a repository as the client gave it, refused if it could leave the
    repository, name a control file, or is not a plain relative path."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) for p in parts)
            or parts[0] in CONTROL_FILES or parts[0] == ".git"):
        raise HubError(400, f"invalid path in repository: `{path}`")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="folder of ORG/NAME repositories")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    ap.add_argument("--log", help="append the request log (JSON lines) to this file")
    ap.add_argument("--token", default=DEFAULT_TOKEN, help="the token gated reads and all writes take")
    ap.add_argument("--resolve-cache", action="store_true",
                    help="redirect regular files of public repositories to /api/resolve-cache/ (the Hub's way)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.root):
        sys.exit(f"server.py: --root {args.root}: not a folder")
    hub = Hub(args.root, args.token, args.log, args.resolve_cache)
    handler = type("BoundHandler", (Handler,), {"hub": hub})
    main_server = ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    lfs_server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for s in (main_server, lfs_server):
        s.daemon_threads = True
    hub.base_url = f"http://127.0.0.1:{main_server.server_address[1]}"
    hub.lfs_url = f"http://127.0.0.1:{lfs_server.server_address[1]}"
    threading.Thread(target=lfs_server.serve_forever, daemon=True).start()
    print(f"PORT {main_server.server_address[1]}", flush=True)
    try:
        main_server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
