#!/usr/bin/env bash
# The quick suite on the lent GPU machine's software, on this CPU: Python 3.12, jax 0.11.2
# with its CUDA 13 plugin (compile-only here), Triton 3.6.0 and the jax-triton 0.3.1 wheel
# the device check carries, and XLA's float32 dots in TF32 as on the GPU. GPU time is
# rare; a break on that stack (jaxlib 0.11.2's CPU compiler segfaulted on a zero-size
# constant inside shard_map, 2026-11-28) should show here first, not in a device call.
# `make test-device-stack`; skipped (exit 0, said so) where no Python 3.12 is found.
# DEVICE_PYTHON names one.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-device

find_python() {
  local candidate
  for candidate in "${DEVICE_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if ! python=$(find_python); then
  echo "device stack: no Python 3.12 here (DEVICE_PYTHON=...): skipped"
  exit 0
fi
if [ ! -f "$venv/.installed-stamp" ] || [ pyproject.toml -nt "$venv/.installed-stamp" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # The device's versions, pinned; the rest of the project's dependencies and of its test
  # extra as pyproject.toml has them.
  # A command substitution, not a process one: set -e stops here if the reading fails.
  requirements=$("$python" - <<'EOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
    if name not in ("jax", "jaxlib", "jax-triton", "triton"):
        print(requirement)
EOF
  )
  mapfile -t rest <<<"$requirements"
  [ -n "$requirements" ] || { echo "device stack: no requirements read from pyproject.toml"; exit 1; }
  "$venv/bin/python" -m pip install --quiet "jax[cuda13-local]==0.11.2" "jax[tpu]==0.11.2" \
    "triton==3.6.0" bench/wheels/jax_triton-0.3.1-py3-none-any.whl "${rest[@]}"
  "$venv/bin/python" -m pip install --quiet --no-deps -e .
  touch "$venv/.installed-stamp"
fi
"$venv/bin/python" -c 'import jax, triton, jax_triton
print(f"device stack: jax {jax.__version__}, Triton {triton.__version__}, "
      f"jax-triton {jax_triton.__version__}")'
# With the device's float32 products too: XLA:GPU's TF32 below HIGHEST (tests/tf32.py).
"$venv/bin/python" -m pytest -n auto -q -m "not slow" -p no:cacheprovider --emulate-tf32
# What a device call would run, compiled for an H100 at the GPU's sizes (bench/preflight.py).
JAX_PLATFORMS=cpu "$venv/bin/python" -m bench gpu-check --compile-for h100
