"""Starting and driving tests/hub/server.py from Python (the pytest files and bench/hub.py):

    with HubServer(root) as hub:
        env = {"HF_ENDPOINT": hub.url, ...}
        hub.control(drop_after=100_000)
        entries = hub.log()

The server runs as its own process, as the Rust and CLI tests run it, so a client in the test
process and one in a subprocess see the same server.
"""

import json
import os
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = HERE / "server.py"
MAKE_REPOS = HERE / "make_repos.py"
DEFAULT_TOKEN = "hf_statekit_test_token"
ORG = "statekit-test"


def make_repos(root: Path, timeout: float = 300) -> Path:
    """The fixture repositories (make_repos.py) under `root`, written by a subprocess so the
    caller need not import torch."""
    subprocess.run([sys.executable, str(MAKE_REPOS), str(root)], check=True, timeout=timeout)
    return root


class HubServer:
    def __init__(self, root, token: str = DEFAULT_TOKEN, log=None, resolve_cache: bool = False,
                 start_timeout: float = 60):
        cmd = [sys.executable, str(SERVER), "--root", str(root), "--port", "0", "--token", token]
        if log is not None:
            cmd += ["--log", str(log)]
        if resolve_cache:
            cmd.append("--resolve-cache")
        self.token = token
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._first_line(start_timeout)
        if not line.startswith("PORT "):
            self.close()
            raise RuntimeError(f"tests/hub/server.py printed {line!r} instead of `PORT <n>`: "
                               f"{self.proc.stderr.read() if self.proc.stderr else ''}")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _first_line(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                return self.proc.stdout.readline().strip()
            if self.proc.poll() is not None:
                return ""
        return ""

    def request(self, method, path, body=None, headers=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def control(self, **faults):
        """Sets the faults for the next requests (server.py's /_control); no argument clears them."""
        self.request("POST", "/_control", faults)

    def log(self):
        """The request log so far, one dict per request, in order."""
        return [json.loads(line) for line in self.request("GET", "/_log").decode().splitlines()]

    def commit(self, name, rev="main"):
        """The commit the server gives `ORG/name` at `rev` now."""
        return json.loads(self.request("GET", f"/api/models/{ORG}/{name}/revision/{rev}"))["sha"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def client_env(hub: HubServer, cache: Path, home: Path, **extra) -> dict:
    """The environment a Hub client runs in against `hub`: no HF_* variable from outside (a
    token, an offline switch or an endpoint of the machine's own), the cache at `cache`, HF_HOME
    (and so the token file) in `home`, no telemetry and no progress bars."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update({
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env
