#!/usr/bin/env bash
# The demo: the CLI on a bundled checkpoint. Inspect it, split it into huggingface_hub-style
# shards, verify them, merge them back, and check the round trip is bit-exact.
set -euo pipefail
CKPT=${1:?usage: demo/run.sh CKPT_BINARY SOURCE.safetensors}
SRC=${2:?}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step "$CKPT" inspect "$SRC"
step "$CKPT" split "$SRC" "$WORK/shards" --max-shard-size 4KB --checksums
step "$CKPT" verify "$WORK/shards"
step "$CKPT" merge "$WORK/shards" "$WORK/merged.safetensors"
step "$CKPT" verify "$WORK/merged.safetensors"
step cmp "$SRC" "$WORK/merged.safetensors"
printf '\nround trip is bit-exact: %s == merged\n' "$SRC"
