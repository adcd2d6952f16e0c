#!/usr/bin/env bash
# Builds bench/RESULTS.md from the per-area result files the benchmarks write.
set -euo pipefail
cd "$(dirname "$0")"
{
  echo "# Benchmark results"
  echo
  echo "Each section is written by its benchmark (\`make bench\` runs them all, then this file is"
  echo "assembled by \`bench/assemble.sh\`). Every row compares statekit with the tool a user would"
  echo "otherwise run, in the same session on the same input; the safetensors section also compares"
  echo "with \`cp\` of the same bytes, the disk's limit. Timings come from a 2-core machine shared"
  echo "with other work, so single runs are noisy; ratios are the point."
  for area in safetensors torch dcp deepspeed dataload dataload-sources train; do
    f="RESULTS-$area.md"
    [ -f "$f" ] || continue
    echo
    sed 's/^# /## /' "$f"
  done
} > RESULTS.md
echo "bench/RESULTS.md assembled" >&2
