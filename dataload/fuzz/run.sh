#!/usr/bin/env bash
# Builds and runs each dataload fuzz target for SECONDS (default 20), seeded from the fixtures.
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`) and runs on the stable toolchain with
# RUSTC_BOOTSTRAP=1 (libFuzzer's sanitizer flags are nightly-only otherwise).
# Exits non-zero when a target finds a crash; the reproducer is in dataload/fuzz/artifacts/.
set -euo pipefail
seconds="${1:-20}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
fixtures="$root/fixtures"

# The seeds are written by dataload itself (its line index builder, its loader states), with
# the workspace's own build, before this script switches to the fuzz build.
seeds() { (cd "$root" && cargo run --quiet --locked -p dataload --example fuzz_seeds -- "$@"); }

seed() { # seed TARGET: write a starting corpus from the fixtures
    local corpus="$here/corpus/$1"
    mkdir -p "$corpus"
    case "$1" in
        line_index)
            seeds lines "$corpus" "$fixtures"/dataload_sources/*.jsonl "$fixtures"/dataload_sources/*.jsonl.zst \
                "$fixtures"/hostile/dataload/*.jsonl "$fixtures"/hostile/dataload/*.jsonl.zst ;;
        loader_state | data_state)
            seeds states "$corpus" ;;
        mixture_spec)
            seeds mixtures "$corpus" ;;
        arrow_ipc)
            # The Arrow fixtures as they are: IPC files (plain, LZ4, zstd) and a stream.
            cp "$fixtures"/dataload_sources/*.arrow "$fixtures"/dataload_sources/*.arrows "$corpus"/ ;;
    esac
}

targets=(line_index loader_state arrow_ipc mixture_spec data_state)
for target in "${targets[@]}"; do
    seed "$target"
done

cd "$here"
export RUSTC_BOOTSTRAP=1
# One target folder for the three fuzz crates (ckpt, dataload, train): their sanitized builds of
# the same library crates are shared instead of built once per crate.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$here/../../target/fuzz}"
for target in "${targets[@]}"; do
    cargo fuzz build --release "$target"
    cargo fuzz run --release "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=512 -timeout=10 -print_final_stats=1
done
