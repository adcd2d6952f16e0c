# statekit: `make demo` and `make test` set up a fresh machine themselves (.ci/setup is
# idempotent and fast once done).

VENV ?= /opt/statekit-venv
PY := $(VENV)/bin/python
CARGO ?= cargo
export STATEKIT_VENV := $(VENV)

.PHONY: setup build demo test test-rust test-python fuzz bench fixtures

setup:
	@bash .ci/setup

build: setup
	$(CARGO) build --workspace --all-targets --locked

# fmt, clippy, every test (Rust unit, integration, CLI, kill; Python interop), then a bounded
# fuzzing run of every parser target.
test: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(MAKE) --no-print-directory test-rust test-python fuzz

# The second line checks that dataload's index side builds and passes without its `sources`
# feature (no Arrow, Parquet or zstd).
test-rust:
	$(CARGO) test --workspace --locked
	$(CARGO) test -p dataload --no-default-features --locked

test-python:
	$(CARGO) build --locked -p statekit-cli
	CKPT_BIN=$(CURDIR)/target/debug/ckpt $(PY) -m pytest -q -p no:cacheprovider tests/python

FUZZ_SECONDS ?= 20
fuzz:
	bash ckpt/fuzz/run.sh $(FUZZ_SECONDS)
	bash dataload/fuzz/run.sh $(FUZZ_SECONDS)

demo: setup
	$(CARGO) build --release --locked -p statekit-cli
	@bash demo/run.sh target/release/ckpt fixtures/safetensors/model_single/model.safetensors

bench: setup
	$(CARGO) build --release --locked -p statekit-cli
	@bash bench/all.sh

# Regenerates every fixture with the real tools (several minutes: DCP and DeepSpeed cases run
# multi-rank jobs under torchrun).
fixtures: setup
	$(PY) fixtures/gen/safetensors_fixtures.py
	python3 fixtures/gen/hostile_safetensors.py
	$(PY) fixtures/gen/torch_fixtures.py
	$(PY) fixtures/gen/fp8_fixtures.py
	$(PY) fixtures/gen/accelerate_state_fixtures.py
	$(PY) fixtures/gen/torch_weights_only_globals.py
	$(PY) fixtures/gen/torch_compat_fixtures.py
	$(PY) fixtures/gen/torchscript_fixtures.py
	$(PY) fixtures/gen/hostile_torch.py
	$(PY) fixtures/gen/hostile_accelerate.py
	$(PY) fixtures/gen/dataload_vectors.py
	$(PY) fixtures/gen/dataload_sources.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/dcp_fixtures.py
	$(PY) fixtures/gen/hostile_dcp.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/deepspeed_fixtures.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/deepspeed_hostile.py
	python3 fixtures/gen/hostile_outputs.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/fsdp_layouts.py
