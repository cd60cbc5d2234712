# Two entry points for a fresh machine: `make bench` (the main job) and `make test`.
# Each creates .venv and installs the project on first use: with the `test` extra
# everywhere, plus the `gpu` extra (CUDA jax, jax-triton) where an NVIDIA driver is present.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
EXTRAS := $(if $(shell command -v nvidia-smi 2>/dev/null),gpu$(comma)test,test)
comma := ,

.PHONY: bench test lint

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"ragged-kernels needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/python -m bench

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -n auto

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
