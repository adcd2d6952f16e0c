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
        megatron_tracker)
            find "$fixtures/megatron" -name latest_checkpointed_iteration.txt \
                -exec sh -c 'cp "$1" "$2/$(echo "$1" | sha1sum | cut -c1-16)"' _ {} "$corpus" \;
            printf 'release\n' > "$corpus/release" ;;
        megatron_config)
            find "$fixtures/megatron" -name metadata.json \
                -exec sh -c 'cp "$1" "$2/$(echo "$1" | sha1sum | cut -c1-16)"' _ {} "$corpus" \; ;;
        megatron_rank_folders)
            # What each iteration folder of the fixtures holds, one name per line.
            for d in "$fixtures"/megatron/*/iter_* "$fixtures"/megatron/*/*/iter_* "$fixtures"/megatron/*/ckpt; do
                [ -d "$d" ] && ls -A "$d" > "$corpus/$(echo "$d" | sha1sum | cut -c1-16)"
            done ;;
        megatron_saved_state)
            # The pickles of the saved state: each legacy rank file's `data.pkl` (`args` and
            # all), and the non-tensor items of the `torch_dist` saves (`common_state`, the
            # optimizer's groups, `rng_state`), each a `torch.save` archive inside a `.distcp`.
            python3 - "$corpus" $(find "$fixtures/megatron" -name '*.pt' -o -name '*.distcp') <<'PY'
import sys, zipfile, pathlib, hashlib, struct, pickletools, io
out = pathlib.Path(sys.argv[1])
def keep(pkl):
    if len(pkl) <= 65536 and any(w in pkl for w in (b"argparse", b"iteration", b"param_groups", b"rng")):
        (out / hashlib.sha1(pkl).hexdigest()[:16]).write_bytes(pkl)
for src in sys.argv[2:]:
    if src.endswith(".pt"):
        z = zipfile.ZipFile(src)
        for n in z.namelist():
            if n.endswith("data.pkl"):
                keep(z.read(n))
        continue
    # A `.distcp` is `torch.save` archives back to back, written with data descriptors (no
    # sizes in the local headers): each `data.pkl` ends where its pickle stops.
    b = pathlib.Path(src).read_bytes()
    i = b.find(b"PK\x03\x04")
    while i >= 0:
        nl, el = struct.unpack("<HH", b[i + 26 : i + 30])
        if b[i + 30 : i + 30 + nl].endswith(b"data.pkl"):
            at = i + 30 + nl + el
            f = io.BytesIO(b[at : at + (1 << 20)])
            try:
                for op, _, pos in pickletools.genops(f):
                    pass
                keep(b[at : at + f.tell()])
            except Exception:
                pass
        i = b.find(b"PK\x03\x04", i + 4)
PY
            ;;
        json_documents)
            # A path, a fixture's safetensors header and a small torch file's pickle, in the
            # target's input format.
            for f in $(find "$fixtures/safetensors" "$fixtures/hostile/safetensors" -name '*.safetensors' -size -256k); do
                python3 - "$f" "$corpus" "$fixtures/torch" <<'PY' || true
import sys, struct, pathlib, hashlib, zipfile
src, out, torch = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
b = pathlib.Path(src).read_bytes()
if len(b) < 8:
    sys.exit(0)
n = struct.unpack("<Q", b[:8])[0]
head = b[8 : 8 + n]
if len(head) != n or n > 0xFFFF:
    sys.exit(0)
pkls = []
for t in sorted(torch.glob("*.pt")):
    try:
        z = zipfile.ZipFile(t)
    except zipfile.BadZipFile:
        continue
    pkls += [z.read(x) for x in z.namelist() if x.endswith("data.pkl") and z.getinfo(x).file_size < 4096]
path = pathlib.Path(src).parent.name.encode()[:255]
key = hashlib.sha1(src.encode()).digest()
pkl = pkls[key[0] % len(pkls)] if pkls else b""
seed = bytes([len(path)]) + path + struct.pack("<H", n) + head + pkl
(out / key.hex()[:16]).write_bytes(seed)
PY
            done ;;
    esac
}

# Megatron's tracker, `metadata.json` and rank folder names are a few lines of parsing each,
# which the fuzzer covers within seconds (half a million runs in 20 s): a quarter of the time.
quick="megatron_tracker megatron_config megatron_rank_folders"

for target in unpickle torch_zip dcp_metadata hf_index safetensors_header tiling \
    megatron_tracker megatron_config megatron_rank_folders megatron_saved_state json_documents; do
    seed "$target"
    time="$seconds"
    case " $quick " in *" $target "*) time=$(( (seconds + 3) / 4 )) ;; esac
    cargo fuzz build --release "$target"
    cargo fuzz run --release "$target" "corpus/$target" -- \
        -max_total_time="$time" -max_len=65536 -rss_limit_mb=512 -malloc_limit_mb=512 -timeout=10 -print_final_stats=1
done
