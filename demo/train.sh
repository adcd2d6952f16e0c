#!/usr/bin/env bash
# `make demo`: the training run. Two MPI ranks train the small transformer on the synthetic
# corpus (sharded mode), a SIGTERM part-way makes them save and stop, a second run resumes from
# the checkpoint and finishes, `ckpt merge` on the same two ranks turns the final checkpoint
# into one safetensors file (each rank writing its share of it, the bytes one process writes),
# `ckpt verify` checks both, and a short report says what happened.
#
#   demo/train.sh CKPT_BINARY TRAIN_BINARY      (DEMO_DIR to keep the run, DEMO_STEPS to size it)
set -euo pipefail
CKPT=$(realpath "${1:?usage: demo/train.sh CKPT_BINARY TRAIN_BINARY}")
TRAIN=$(realpath "${2:?}")
STEPS=${DEMO_STEPS:-400}
WORK=${DEMO_DIR:-$(mktemp -d)}
mkdir -p "$WORK"
cd "$WORK"
rm -rf ckpt run1.jsonl run2.jsonl run1.err run2.err model.safetensors optimizer.safetensors one merge.json

MPI=(mpirun --oversubscribe -np 2)
[ "$(id -u)" = 0 ] && MPI+=(--allow-run-as-root)
ARGS=(--mode sharded --steps "$STEPS" --save-every 100 --keep-last 2 --ckpt-dir ckpt --dim 128 --layers 4)

say() { printf '\n\033[1m%s\033[0m\n' "$*" >&2; }
last_step() { tail -n 1 "$1" 2>/dev/null | sed -n 's/.*"step":\([0-9]*\).*/\1/p'; }
field() { sed -n "s/.*\"$2\":\([-0-9.e]*\).*/\1/p" "$1" | sed -n "$3"; }

say "1. training on 2 ranks (${STEPS} steps); a SIGTERM will interrupt it part-way"
"${MPI[@]}" "$TRAIN" "${ARGS[@]}" > run1.jsonl 2> run1.err &
RUN=$!
stop_at=$((STEPS * 45 / 100))
until [ "$(last_step run1.jsonl)" -ge "$stop_at" ] 2>/dev/null; do
  kill -0 "$RUN" 2>/dev/null || { cat run1.err >&2; echo "demo: the run ended early" >&2; exit 1; }
  sleep 0.2
done
# The signal goes to the two ranks (mpirun's own children): they agree to stop, save, exit 0.
pkill -TERM -P "$RUN"
wait "$RUN"
grep -E "signal received|saved in" run1.err >&2 || true
interrupted=$(last_step run1.jsonl)

say "2. resuming from $(readlink ckpt/latest) on 2 ranks"
"${MPI[@]}" "$TRAIN" "${ARGS[@]}" --resume > run2.jsonl 2> run2.err
grep -E "resumed from|saved in|timing" run2.err >&2 || true

say "3. mpirun -np 2 ckpt merge ckpt/latest model.safetensors --optimizer (each rank writes its share)"
"${MPI[@]}" "$CKPT" merge ckpt/latest model.safetensors --optimizer --json > merge.json
mkdir -p one && "$CKPT" merge ckpt/latest one/model.safetensors --optimizer -q > /dev/null
cmp model.safetensors one/model.safetensors && cmp optimizer.safetensors one/optimizer.safetensors
echo "  the same bytes as one process writes" >&2
shares=$(python3 -c 'import json; print(", ".join("rank %d wrote %d B" % (r["rank"], r["bytes_written"]) for r in json.load(open("merge.json"))["ranks"]))')
say "4. ckpt verify"
"$CKPT" verify ckpt/latest >&2
"$CKPT" verify model.safetensors >&2

save_s=$(sed -n 's/.*saved in \([0-9.]*\)s.*/\1/p' run1.err run2.err | sort -n | tail -n 1)
resume_s=$(sed -n 's/.*in \([0-9.]*\)s$/\1/p' run2.err | head -n 1)
size=$(du -sh -L ckpt/latest | cut -f1)
printf '\n\033[1mreport\033[0m\n'
printf '  loss at step 1:            %s\n' "$(field run1.jsonl loss 1p)"
printf '  loss at the interruption:  %s (step %s, SIGTERM, saved and exited 0)\n' "$(field run1.jsonl loss '$p')" "$interrupted"
printf '  loss at the end:           %s (step %s)\n' "$(field run2.jsonl loss '$p')" "$(last_step run2.jsonl)"
printf '  checkpoint size:           %s (%s: model and optimizer, FSDP2 DCP, 2 rank files each)\n' "$size" "$(readlink ckpt/latest)"
printf '  slowest save:              %ss\n' "$save_s"
printf '  resume (load + reshard):   %ss\n' "$resume_s"
printf '  merged model:              %s/model.safetensors (%s)\n' "$WORK" "$(du -h model.safetensors | cut -f1)"
printf '  merge on 2 ranks:          %s; byte-identical to one process\n' "$shares"
