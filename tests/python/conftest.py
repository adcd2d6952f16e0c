"""Shared helpers for the interop tests: they run the real `ckpt` binary against the real
Python tools (torch, safetensors, huggingface_hub) and compare bytes."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"


def ckpt_bin() -> str:
    path = os.environ.get("CKPT_BIN") or str(ROOT / "target" / "debug" / "ckpt")
    if not os.path.exists(path):
        pytest.fail(f"ckpt binary not found at {path}; build it first (make test does)")
    return path


def run_ckpt(*args, check=True, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([ckpt_bin(), *map(str, args)], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckpt {' '.join(map(str, args))} exited {proc.returncode}: {proc.stderr}")
    return proc


VENV_BIN = Path(sys.executable).parent


def torchrun(nproc: int, script, *args, env=None, timeout: int = 300, cwd=None) -> subprocess.CompletedProcess:
    """Runs `script ARGS...` on `nproc` local ranks under the venv's torchrun (gloo on CPU): a
    free port on 127.0.0.1, the venv's bin first on PATH (ninja for DeepSpeed), one OpenMP
    thread per rank, and `env` added to the environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(script), *map(str, args)]
    # A session of its own, so that a job past its timeout is killed whole: killing torchrun
    # alone would leave its ranks running (and holding their port) after the test failed. The
    # ranks are in sessions of their own too (torch's elastic agent starts them so): they are
    # found under torchrun and killed by pid first.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full, cwd=cwd,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid: int) -> list:
    """Every process under `pid` (children, theirs, ...), from /proc."""
    children: dict = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except (OSError, ValueError):
            continue
        # `pid (comm) state ppid ...`; the command name may hold spaces and parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(p.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def files_of(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}
