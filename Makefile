# Entry points for a fresh machine: `make bench` (the main job), `make test` (the quick
# suite: every op x backend x feature once, minutes on 2 cores) and `make test-all` (the
# quick suite, then the tests marked `slow` and a longer hypothesis search: what CI runs).
# Each creates .venv and installs the project on first use: with the `test` extra
# everywhere, plus the `gpu` extra (CUDA jax, jax-triton) where an NVIDIA driver is present.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
EXTRAS := $(if $(shell command -v nvidia-smi 2>/dev/null),gpu$(comma)test,test)
comma := ,

.PHONY: bench test test-all test-device-stack lint gpu-check gpu-tests gpu-check-dry gpu-preflight gpu-ptx-cache

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"ragged-kernels needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/python -m bench

# Each run ends with its 25 slowest tests, so that the time budget stays visible.
PYTEST := $(VENV)/bin/python -m pytest -n auto --durations=25

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PYTEST) -m "not slow"

# The rest: the `slow` tests (larger shapes, full compile grids, every target compiled) and
# the property tests again under the `thorough` hypothesis profile (more examples).
test-all: test
	HYPOTHESIS_PROFILE=thorough $(PYTEST) -m "slow or hypothesis"

# The quick suite again on the GPU machine's software (Python 3.12, jax 0.11.2, Triton 3.6,
# jax-triton 0.3.1) in .venv-device, on the CPU; skipped where no Python 3.12 is found.
test-device-stack:
	bash .ci/device_stack.sh

# On a GPU machine: the TMA and warp-specialized kernels' tests, the bench rows against their
# anchors and the Nsight profiles, 8-9 minutes (bench/gpu_check.sh, which says how to split
# it in two device calls; results under $$OUT). It uses the
# machine's own python3 and installs nothing but the carried jax-triton wheel (no network there), so
# it does not build .venv. The dry run is the same command at toy sizes on a CPU.
gpu-check:
	bash bench/gpu_check.sh

# Every GPU conformance test on the device (about 5 minutes; its own device call).
gpu-tests:
	bash bench/gpu_check.sh tests

gpu-check-dry: $(STAMP)
	$(VENV)/bin/python -m bench gpu-check --dry-run

# Every GPU row (ours and our A/B anchors) compiled for an H100 here, not run
# (bench/preflight.py, about 7 minutes on 2 cores): on the device's software where
# .venv-device exists (make test-device-stack builds it, and runs this after its tests).
PREFLIGHT_VENV := $(if $(wildcard .venv-device/bin/python),.venv-device,$(VENV))
gpu-preflight: $(if $(wildcard .venv-device/bin/python),,$(STAMP))
	JAX_PLATFORMS=cpu $(PREFLIGHT_VENV)/bin/python -m bench gpu-check --compile-for h100

# The PTX of every kernel the device run's rows launch, compiled here by the device's Triton
# (3.6, in .venv-device: make test-device-stack builds it) into .ptx-cache/, which a device
# call carries (run's carry=[".ptx-cache"]): there bench/gpu_check.sh's bench rows use it and
# compile none of those kernels again (jax_bridge/launch/ptx_cache.py). Refilled whole: a
# changed kernel gets a new key, and stale entries would only grow the carry.
gpu-ptx-cache:
	@test -x .venv-device/bin/python || { echo "make gpu-ptx-cache needs .venv-device (make test-device-stack)"; exit 2; }
	rm -rf .ptx-cache
	RAGGED_KERNELS_PTX_CACHE_DIR=$(CURDIR)/.ptx-cache JAX_PLATFORMS=cpu .venv-device/bin/python -m bench gpu-check --compile-for h100

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
