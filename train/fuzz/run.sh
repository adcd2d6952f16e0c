#!/usr/bin/env bash
# Builds and runs the train fuzz target (`statekit_state.json`) for SECONDS (default 20), seeded
# with states as the trainer writes them. The fuzz build links train without its `trainer`
# feature: no libtorch, no MPI.
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`) and runs on the stable toolchain with
# RUSTC_BOOTSTRAP=1 (libFuzzer's sanitizer flags are nightly-only otherwise).
# Exits non-zero when the target finds a crash; the reproducer is in train/fuzz/artifacts/.
# Runs under a 512 MiB memory limit (resident, and any single allocation).
set -euo pipefail
seconds="${1:-20}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."

# The seeds are written by train itself, with the workspace's own build (without libtorch),
# before this script switches to the fuzz build.
seed() { # seed TARGET: write a starting corpus
    local corpus="$here/corpus/$1"
    mkdir -p "$corpus"
    case "$1" in
        state_json)
            (cd "$root" && cargo run --quiet --locked -p train --no-default-features --example fuzz_seeds -- "$corpus") ;;
    esac
}

targets=(state_json)
for target in "${targets[@]}"; do
    seed "$target"
done

cd "$here"
export RUSTC_BOOTSTRAP=1
# One target folder for the three fuzz crates (ckpt, dataload, train): their sanitized builds of
# the same library crates are shared instead of built once per crate.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$here/../../target/fuzz}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-quarantine_size_mb=64}"
for target in "${targets[@]}"; do
    cargo fuzz build --release "$target"
    cargo fuzz run --release "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=512 -malloc_limit_mb=512 -timeout=10 -print_final_stats=1
done
