"""Shared helpers for the interop tests: they run the real `ckpt` binary against the real
Python tools (torch, safetensors, huggingface_hub) and compare bytes."""

import os
import subprocess
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


def files_of(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}
