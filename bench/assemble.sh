#!/usr/bin/env bash
# Builds bench/RESULTS.md from the per-area result files the benchmarks write.
set -euo pipefail
cd "$(dirname "$0")"
{
  echo "# Benchmark results"
  echo
  echo "Each section is written by its benchmark (\`make bench\` runs them all, then this file is"
  echo "assembled by \`bench/assemble.sh\`). The first section times each copy-shaped operation against"
  echo "a durable \`cp\` of the same bytes (the disk's limit), in alternated pairs; every other row"
  echo "compares statekit with the tool a user would otherwise run, in the same session on the same"
  echo "input. Timings come from a 2-core machine shared with other work, so single runs are noisy;"
  echo "ratios are the point."
  for area in vs-cp crc ranks megatron-plan safetensors torch dcp dcp-tp deepspeed accelerate accelerate-state hub dataload dataload-sources mixture python train; do
    f="RESULTS-$area.md"
    [ -f "$f" ] || continue
    echo
    if grep -qx '<!-- summary-end -->' "$f"; then
      # A long result file gives its summary here and a link to the rest.
      sed -e '/^<!-- summary-end -->$/,$d' -e 's/^# /## /' "$f"
      echo "Tables, method and the full reading: [$f]($f)."
    else
      sed 's/^# /## /' "$f"
    fi
  done
} > RESULTS.md
echo "bench/RESULTS.md assembled" >&2
