# statekit: `make demo` and `make test` set up a fresh machine themselves (.ci/setup is
# idempotent and fast once done); `make demo` installs only what the demo runs.

VENV ?= /opt/statekit-venv
PY := $(VENV)/bin/python
CARGO ?= cargo
export STATEKIT_VENV := $(VENV)
# The Python bindings (pyo3, abi3) find their interpreter here, in clippy as in maturin.
export PYO3_PYTHON := $(PY)
# `train` links libtorch from the venv's torch (tch's `LIBTORCH_USE_PYTORCH`); only its
# targets get this environment, so the rest of the workspace builds without torch.
TORCH_ENV := LIBTORCH_USE_PYTORCH=1 PATH=$(VENV)/bin:$$PATH \
	LD_LIBRARY_PATH=$(VENV)/lib/python3.11/site-packages/torch/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}

.PHONY: setup setup-demo build demo test lint-python test-rust test-train test-python soak fuzz bench fixtures mcore

setup:
	@bash .ci/setup test

# The demo's share of the setup: the Debian packages and torch (no test tools, no cargo-fuzz).
setup-demo:
	@bash .ci/setup demo

build: setup
	$(TORCH_ENV) $(CARGO) build --workspace --all-targets --locked

# fmt, clippy, the library docs (a broken link is an error), the Python package's lint, every
# test (Rust unit, integration, CLI, kill; Python interop), then a bounded fuzzing run of every
# parser target.
test: setup mcore
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --exclude train --all-targets --features statekit-cli/mpi --locked -- -D warnings
	$(TORCH_ENV) $(CARGO) clippy -p train --all-targets --locked -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --exclude train --exclude statekit-python --no-deps --lib --locked
	$(MAKE) --no-print-directory lint-python test-rust test-train test-python fuzz

# ruff and mypy --strict on the Python package; their settings (and the files left out) are in
# python-bindings/pyproject.toml.
lint-python:
	cd python-bindings && $(VENV)/bin/ruff check && $(VENV)/bin/mypy

# The second line checks that dataload's index side builds and passes without its `sources`
# feature (no Arrow, Parquet or zstd); the third that a `ckpt` built without MPI refuses to run
# as one of several ranks under `mpirun` (and takes the destination lock as the MPI build does).
# python-bindings is a cdylib that only links inside Python: pytest tests it, installed.
test-rust:
	$(CARGO) test --workspace --exclude train --exclude statekit-python --features statekit-cli/mpi --locked
	$(CARGO) test -p dataload --no-default-features --locked
	$(CARGO) test -p statekit-cli --locked --test lock

# The training core: built once, then its unit tests and the multi-rank kill/resume tests
# (mpirun, 2 to 4 ranks, oversubscribed on small machines).
test-train:
	$(TORCH_ENV) $(CARGO) test -p train --locked -- --test-threads=1

test-python:
	$(CARGO) build --locked -p statekit-cli --features mpi
	$(TORCH_ENV) $(CARGO) build --locked -p train
	CKPT_BIN=$(CURDIR)/target/debug/ckpt TRAIN_BIN=$(CURDIR)/target/debug/statekit-train \
		$(PY) -m pytest -q -p no:cacheprovider tests/python

# The kill soak in full: 200 SIGKILLs at random moments over split, merge, convert and reshard,
# in place, swapped and new, of one process, a 2-rank job or one of its ranks (`make test` runs
# 24 of them; STATEKIT_SOAK_SEED=N replays a run).
SOAK_ROUNDS ?= 200
soak: setup
	STATEKIT_SOAK_ROUNDS=$(SOAK_ROUNDS) $(CARGO) test -p statekit-cli --features mpi --test kill_soak --locked -- --nocapture

FUZZ_SECONDS ?= 20
fuzz:
	bash ckpt/fuzz/run.sh $(FUZZ_SECONDS)
	bash dataload/fuzz/run.sh $(FUZZ_SECONDS)
	bash train/fuzz/run.sh $(FUZZ_SECONDS)

# The training run: 2 ranks, interrupted by a SIGTERM, resumed, merged, verified, reported.
# (`demo/run.sh` is the CLI tour on a bundled checkpoint.)
demo: setup-demo
	$(TORCH_ENV) $(CARGO) build --release --locked -p statekit-cli -p train --features statekit-cli/mpi
	@$(TORCH_ENV) bash demo/train.sh target/release/ckpt target/release/statekit-train

bench: setup mcore
	$(TORCH_ENV) $(CARGO) build --release --locked -p statekit-cli -p train --features statekit-cli/mpi
	@$(TORCH_ENV) bash bench/all.sh

# megatron-core 0.19.2 (for the Megatron fixtures, the benchmark, and the interop test that loads
# the run folders `ckpt convert --to megatron` writes): its wheels declare Python
# >= 3.12, and its pure-Python code runs on the venv's 3.11; unpacked beside the venv, not into it.
MCORE ?= /opt/mcore
mcore: setup
	@test -d $(MCORE)/megatron || $(VENV)/bin/pip install -q --python-version 3.12 --ignore-requires-python \
		--no-deps --only-binary :all: --target $(MCORE) megatron-core==0.19.2

# Regenerates every fixture with the real tools (several minutes: DCP and DeepSpeed cases run
# multi-rank jobs under torchrun).
fixtures: setup mcore
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
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/dcp_nd_fixtures.py
	$(PY) fixtures/gen/hostile_dcp_nd.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/dtensor_layouts.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/deepspeed_fixtures.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/deepspeed_hostile.py
	python3 fixtures/gen/hostile_outputs.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/fsdp_layouts.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/accelerate_fsdp2_fixtures.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/accelerate_more_fixtures.py
	PATH=$(VENV)/bin:$$PATH $(PY) fixtures/gen/trainer_fixtures.py
	$(PY) fixtures/gen/unsafe_torch_fixtures.py
	python3 fixtures/gen/hostile_accelerate_positions.py
	python3 fixtures/gen/hostile_pickle_budget.py
	python3 fixtures/gen/hostile_broadcast_buffer.py
	python3 fixtures/gen/hostile_package.py
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_stages_fixtures.py
	PYTHONPATH=$(MCORE) $(PY) fixtures/gen/hostile_megatron_legacy.py
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_train_fixtures.py train_uneven_pp2dp2
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_fixtures.py
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_train_fixtures.py train_dp2 train_tp2dp2
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_legacy_fixtures.py
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_arch_fixtures.py
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/hostile_megatron_hf.py
	PATH=$(VENV)/bin:$$PATH PYTHONPATH=$(MCORE) $(PY) fixtures/gen/megatron_moe_fixtures.py
	$(PY) fixtures/gen/megatron_moe_hf_check.py
	PYTHONPATH=$(MCORE) $(PY) fixtures/gen/hostile_megatron_moe.py
