#!/usr/bin/env bash
# Split and merge of a synthetic checkpoint (default 2.2 GiB of bf16), timed against the Python
# path users run today and against `cp` of the same bytes (the disk's limit). Every command
# runs under /usr/bin/time -v in the same session; results go to bench/RESULTS-safetensors.md.
#
#   bench/safetensors.sh [GIB] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
GIB=${1:-2.2}
REPS=${2:-3}
PY=${STATEKIT_VENV:-/opt/statekit-venv}/bin/python
CKPT=target/release/ckpt
WORK=bench/work
SHARD=500MB
mkdir -p "$WORK"
SRC=$WORK/model-${GIB}GiB.safetensors
[ -f "$SRC" ] || "$PY" bench/py/make_checkpoint.py "$SRC" "$GIB"
BYTES=$(stat -c %s "$SRC")

# measure NAME CMD...: runs CMD REPS times after a cleanup, keeps the median wall time and the
# largest peak RSS.
declare -A WALL RSS
measure() {
  local name=$1; shift
  local walls=() rss=0
  for _ in $(seq "$REPS"); do
    rm -rf "$WORK/out" "$WORK/out.safetensors"; mkdir -p "$WORK/out"
    sync
    /usr/bin/time -v -o "$WORK/time.txt" "$@" >/dev/null
    walls+=("$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; print s}' "$WORK/time.txt")")
    local r; r=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$WORK/time.txt")
    (( r > rss )) && rss=$r
  done
  WALL[$name]=$(printf '%s\n' "${walls[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  RSS[$name]=$rss
  printf '%-16s median %6.2f s  peak RSS %7.1f MiB\n' "$name" "${WALL[$name]}" "$(echo "$rss/1024" | bc -l)" >&2
}

# The shards the merge benchmarks start from, written once by us (byte-identical to the hub's).
SHARDS=$WORK/shards
[ -f "$SHARDS/model.safetensors.index.json" ] || $CKPT --quiet split "$SRC" "$SHARDS" --max-shard-size $SHARD >/dev/null

measure cp           bash -c "cp '$SRC' '$WORK/out/copy' && sync '$WORK/out/copy'"
measure ckpt-split   $CKPT --quiet split "$SRC" "$WORK/out" --max-shard-size $SHARD
measure py-split     "$PY" bench/py/split.py "$SRC" "$WORK/out" $SHARD
measure ckpt-split-mmap $CKPT --quiet --copy-method mmap split "$SRC" "$WORK/out" --max-shard-size $SHARD
measure ckpt-merge   $CKPT --quiet merge "$SHARDS" "$WORK/out.safetensors"
measure ckpt-merge-mmap $CKPT --quiet --copy-method mmap merge "$SHARDS" "$WORK/out.safetensors"
measure py-merge     "$PY" bench/py/merge.py "$SHARDS" "$WORK/out.safetensors"
rm -rf "$WORK/out" "$WORK/out.safetensors"

gbs() { printf '%.2f' "$(echo "$BYTES / ${WALL[$1]} / 1000000000" | bc -l)"; }
ratio() { printf '%.2f' "$(echo "${WALL[$1]} / ${WALL[$2]}" | bc -l)"; }
mib() { printf '%.1f' "$(echo "${RSS[$1]} / 1024" | bc -l)"; }
{
  echo "| command | median wall (s) | GB/s | peak RSS (MiB) |"
  echo "|---|---|---|---|"
  for n in cp ckpt-split ckpt-split-mmap py-split ckpt-merge ckpt-merge-mmap py-merge; do
    echo "| \`$n\` | ${WALL[$n]} | $(gbs $n) | $(mib $n) |"
  done
  echo
  echo "- split: ckpt takes $(ratio ckpt-split py-split)× the time of the Python path and reaches $(ratio cp ckpt-split)× the throughput of \`cp\` ($(ratio cp ckpt-split-mmap)× through the memory map)."
  echo "- merge: ckpt takes $(ratio ckpt-merge py-merge)× the time of the Python path and reaches $(ratio cp ckpt-merge)× the throughput of \`cp\` ($(ratio cp ckpt-merge-mmap)× through the memory map)."
} > "$WORK/table.md"
{
  echo "# safetensors split and merge"
  echo
  echo "Checkpoint: $(basename "$SRC"), $(printf '%.2f' "$(echo "$BYTES / 2^30" | bc -l)") GiB of bf16 tensors (bench/py/make_checkpoint.py); shards of $SHARD."
  echo "Machine: $(uname -m), $(nproc) CPUs; median of $REPS runs, largest peak RSS (\`/usr/bin/time -v\`). The source is in the page cache;"
  echo "\`cp\` is followed by \`sync\` of the copy because ckpt fsyncs every file it writes. Python path: \`load_file\` +"
  echo "\`save_torch_state_dict\` (split), every shard's \`load_file\` + \`save_file\` (merge). \`-mmap\` rows force the user-space"
  echo "copy through the memory map instead of \`copy_file_range\`."
  echo
  cat "$WORK/table.md"
} | tee bench/RESULTS-safetensors.md
