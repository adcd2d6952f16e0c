# statekit: `make demo` and `make test` set up a fresh machine themselves (.ci/setup is
# idempotent and fast once done).

VENV ?= /opt/statekit-venv
PY := $(VENV)/bin/python
CARGO ?= cargo
export STATEKIT_VENV := $(VENV)

.PHONY: setup build demo test test-rust test-python lint bench fixtures

setup:
	@bash .ci/setup

build: setup
	$(CARGO) build --workspace --all-targets --locked

# fmt, clippy, then every test: Rust (unit, integration, CLI, kill) and Python interop.
test: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(MAKE) --no-print-directory test-rust test-python

test-rust:
	$(CARGO) test --workspace --locked

test-python:
	$(CARGO) build --locked -p statekit-cli
	CKPT_BIN=$(CURDIR)/target/debug/ckpt $(PY) -m pytest -q -p no:cacheprovider tests/python

demo: setup
	$(CARGO) build --release --locked -p statekit-cli
	@bash demo/run.sh target/release/ckpt fixtures/safetensors/model_single/model.safetensors

bench: setup
	$(CARGO) build --release --locked -p statekit-cli
	@bash bench/run.sh

fixtures: setup
	$(PY) fixtures/gen/safetensors_fixtures.py
	python3 fixtures/gen/hostile_safetensors.py
