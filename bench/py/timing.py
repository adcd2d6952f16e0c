"""Runs a command under `/usr/bin/time -v`: its wall time and peak RSS, for the benchmarks."""

import os
import subprocess
import time


def timed(cmd, work, env=None):
    """Runs `cmd` (failing loudly), returns (wall seconds, peak RSS in bytes); the time report
    goes to `work/time.txt`."""
    tfile = os.path.join(work, "time.txt")
    t0 = time.time()
    p = subprocess.run(["/usr/bin/time", "-v", "-o", tfile] + cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    rss_kb = 0
    with open(tfile) as f:
        for line in f:
            if "Maximum resident set size" in line:
                rss_kb = int(line.split(":")[1])
    return wall, rss_kb * 1024
