#!/usr/bin/env bash
# `make bench`: every benchmark, each against the tool users would otherwise run, then
# bench/RESULTS.md assembled from the per-area results. Takes a while (2 GiB inputs are
# generated once into bench/work/, which git ignores); never part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${STATEKIT_VENV:-/opt/statekit-venv}/bin/python
# The venv's bin holds torchrun and ninja, which the DCP and DeepSpeed generators launch.
export PATH="$(dirname "$PY"):$PATH"
CKPT=target/release/ckpt

bash bench/safetensors.sh
CKPT_BIN=$PWD/$CKPT BENCH_DIR=bench/work/torch bash -c 'mkdir -p "$BENCH_DIR" && bash bench/torch_convert.sh'
"$PY" bench/dcp_bench.py --repeats 3 --write-results --rust "$CKPT merge {src} {out}/model.safetensors"
"$PY" bench/dcp_tp_bench.py --repeats 3 --write-results --ckpt "$CKPT"
"$PY" bench/ds_bench.py --ckpt "$CKPT"
"$PY" bench/vs_cp.py --ckpt "$CKPT" --pairs "${VS_CP_PAIRS:-7}"
# ckpt over 1, 2 and 4 MPI ranks against one process, on vs_cp.py's inputs (needs the mpi feature,
# which `make bench` builds). Its 405B projection, bench/ranks_405b.py, is run by hand: its dry runs
# on 512 oversubscribed ranks take a quarter of an hour on 2 cores.
"$PY" bench/ranks.py --ckpt "$CKPT"
# The CRC32 checks' cost: against this tree's ckpt built with the checks off (its own target folder).
# The switch is a `cfg` given in RUSTFLAGS, not a feature, so `--all-features` never reaches it.
BASE=bench/work/crc-base
RUSTFLAGS="${RUSTFLAGS:-} --cfg statekit_bench_unchecked" CARGO_TARGET_DIR="$BASE/target" \
    cargo build --release --locked -p statekit-cli
"$PY" bench/crc_cost.py --ckpt "$CKPT" --baseline "$BASE/target/release/ckpt" --pairs "${VS_CP_PAIRS:-7}"
"$PY" bench/fp8_bench.py --ckpt "$CKPT"
# hf://: remote inspect and download against huggingface_hub, both on the test Hub (tests/hub).
"$PY" bench/hub.py --ckpt "$CKPT" --write-results
"$PY" bench/dataload_bench.py
"$PY" bench/dataload_sources_bench.py
# Mixtures: resume cost against torchdata's MultiNodeWeightedSampler and, where MCORE_PYTHON names a
# CPython 3.12 with numpy (megatron-core's compiled helper loads in no other), Megatron's index build.
"$PY" bench/mixture_bench.py
"$PY" bench/python_bench.py
"$PY" bench/train_bench.py --train target/release/statekit-train --ckpt "$CKPT"
bash bench/assemble.sh
