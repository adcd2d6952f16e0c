#!/usr/bin/env bash
# Builds and runs each fuzz target for SECONDS (default 20), seeded with the torch fixtures.
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`) and runs on the stable toolchain with
# RUSTC_BOOTSTRAP=1 (libFuzzer's sanitizer flags are nightly-only otherwise).
# Exits non-zero when a target finds a crash; the reproducer is in ckpt/fuzz/artifacts/.
# Each target runs under a 512 MiB memory limit (resident, and any single allocation): every
# parser bounds what an input makes it hold, so going past it is a finding too.
set -euo pipefail
seconds="${1:-20}"
here="$(cd "$(dirname "$0")" && pwd)"
fixtures="$here/../../fixtures"
cd "$here"
export RUSTC_BOOTSTRAP=1
# One target folder for the three fuzz crates (ckpt, dataload, train): their sanitized builds of
# the same library crates are shared instead of built once per crate.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$here/../../target/fuzz}"
# AddressSanitizer keeps 256 MiB of freed memory in quarantine by default, which alone puts a
# target near the limit; 64 MiB still catches a use after free and leaves the rest to us.
export ASAN_OPTIONS="${ASAN_OPTIONS:-quarantine_size_mb=64}"

seed() { # seed TARGET: copy a starting corpus from the fixtures
    local corpus="$here/corpus/$1"
    mkdir -p "$corpus"
    case "$1" in
        torch_zip)
            find "$fixtures/torch" "$fixtures/hostile/torch" "$fixtures/hostile/pickle_budget" -name '*.pt' -size -80k \
                ! -name memo_abuse.pt -exec cp {} "$corpus/" \; ;;
        unpickle)
                for f in "$fixtures"/torch/*.pt "$fixtures"/hostile/pickle_budget/*.pt; do
                python3 - "$f" "$corpus" <<'PY' || true
import sys, zipfile, pathlib
src, out = sys.argv[1], pathlib.Path(sys.argv[2])
try:
    z = zipfile.ZipFile(src)
except zipfile.BadZipFile:
    sys.exit(0)
for n in z.namelist():
    if n.endswith("data.pkl"):
        (out / (pathlib.Path(src).stem + ".pkl")).write_bytes(z.read(n))
PY
            done ;;
        dcp_metadata)
            for f in "$fixtures"/dcp/*/checkpoint/.metadata "$fixtures"/dcp/*/checkpoint/*/.metadata \
                     "$fixtures"/dcp_nd/*/checkpoint/.metadata \
                     "$fixtures"/hostile/dcp/*/.metadata "$fixtures"/hostile/pickle_budget/*/.metadata; do
                cp "$f" "$corpus/$(echo "$f" | sha1sum | cut -c1-16)"
            done ;;
        hf_index)
            find "$fixtures" -name '*.index.json' -size -64k -exec sh -c 'cp "$1" "$2/$(echo "$1" | sha1sum | cut -c1-16)"' _ {} "$corpus" \; ;;
        safetensors_header)
            # The length prefix and header of each fixture (the data is not parsed).
            for f in $(find "$fixtures/safetensors" "$fixtures/hostile/safetensors" -name '*.safetensors' -size -256k); do
                python3 - "$f" "$corpus" <<'PY' || true
import sys, struct, pathlib, hashlib
src, out = sys.argv[1], pathlib.Path(sys.argv[2])
b = pathlib.Path(src).read_bytes()
if len(b) >= 8:
    n = struct.unpack("<Q", b[:8])[0]
    head = b[: 8 + min(n, 65536)]
    (out / hashlib.sha1(src.encode()).hexdigest()[:16]).write_bytes(head)
PY
            done ;;
    esac
}

for target in unpickle torch_zip dcp_metadata hf_index safetensors_header tiling; do
    seed "$target"
    cargo fuzz build --release "$target"
    cargo fuzz run --release "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=512 -malloc_limit_mb=512 -timeout=10 -print_final_stats=1
done
