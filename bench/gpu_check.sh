#!/usr/bin/env bash
# The whole device check, one command, under 8 minutes on one H100:
#   bash bench/gpu_check.sh            (from anywhere; OUT=<dir> to choose where results go)
# 1. installs the carried jax-triton wheel (bench/wheels/, committed: 17 KB) if jax_triton
#    does not import (the GPU machine has no network: nothing is downloaded);
# 2. `python -m bench gpu-check`: every GPU row with its anchors, JSON under
#    $OUT/bench/results/ (copy it to bench/results/: the README's figures come from there);
# 3. one Nsight Compute profile per op (ours on one attention and one grouped matmul row):
#    time per kernel, ours against the XLA work around them;
# 4. the GPU conformance tests.
# Before 2: kernels with tensor descriptors (TMA) alone; if they run, 2 also times them.
# Every step has its own time limit and its own log under $OUT; a step failing does not
# stop the next. BENCH_COMMIT=<hash> names the commit where the copy has no .git;
# GPU_CHECK_ARGS adds arguments to gpu-check (on a CPU: "--dry-run --rows m64").
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
PY="${PYTHON:-python3}"
# JAX and PyTorch (the anchors) share the GPU in one process: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/bench/results"
summary="$OUT/summary.txt"
note() { echo "[gpu_check $(date -u +%T)] $*" | tee -a "$summary"; }

note "start on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
if ! "$PY" -c "import jax_triton" 2>/dev/null; then
  "$PY" -m pip install --no-deps --no-index bench/wheels/jax_triton-0.3.1-py3-none-any.whl \
    >"$OUT/pip.txt" 2>&1
  rc=$?
  note "installed the carried jax-triton wheel: exit $rc"
fi

# Kernels with device-side tensor descriptors (TMA) first, in their own process: a copy,
# then our attention and gmm kernels with `tma` against their references. Only if the copy
# ran on the device (not skipped) and all passed do the bench rows time the TMA kernels:
# a kernel that faults on the device ends its process.
timeout 75 "$PY" -m pytest -x -q -rA tests/launch/test_global_scratch.py \
  tests/attention/test_triton.py tests/grouped_matmul/test_triton.py -k "tma or hopper" \
  >"$OUT/tma.txt" 2>&1
rc=$?
note "TMA kernels (tma.txt): exit $rc -- $(tail -1 "$OUT/tma.txt")"
tma_flag=""
if [ "$rc" -eq 0 ] && grep -q "^PASSED .*test_a_descriptor_kernel_copies_on_a_hopper_gpu" "$OUT/tma.txt"; then
  tma_flag="--tma"
fi

stamp="$(date -u +%Y%m%dT%H%MZ)"
json="$OUT/bench/results/gpu-check-$stamp.json"
timeout 220 "$PY" -m bench gpu-check --budget-s 170 --json "$json" $tma_flag ${GPU_CHECK_ARGS:-} \
  >"$OUT/gpu_check.txt" 2>&1
rc=$?
note "bench rows (gpu_check.txt, $(basename "$json")): exit $rc"
if [ "$rc" -gt 1 ] && [ "$rc" -ne 124 ]; then
  # A crash, not a failed check or the time limit: again without PyTorch in the process.
  timeout 150 "$PY" -m bench gpu-check --no-torch --budget-s 110 --json "${json%.json}-no-torch.json" \
    ${GPU_CHECK_ARGS:-} >"$OUT/gpu_check_no_torch.txt" 2>&1
  rc=$?
  note "bench rows without PyTorch (gpu_check_no_torch.txt): exit $rc"
fi

if command -v ncu >/dev/null; then
  for key in "16x1024 causal" "m8192 G64"; do
    name="ncu_${key// /_}"
    # Autotuning off: under ncu every candidate kernel XLA tries would be profiled.
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout 50 \
      ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
      "$PY" -m bench gpu-check --profile "$key" >"$OUT/$name.txt" 2>&1
    rc=$?
    note "ncu $key ($name.txt): exit $rc"
    "$PY" -m bench gpu-check --ncu-summary "$OUT/$name.txt" >"$OUT/${name}_summary.txt" 2>&1
  done
else
  note "ncu not found: no kernel profile"
fi

timeout 90 "$PY" -m pytest -n 4 -x -q \
  tests/attention/test_conformance.py tests/grouped_matmul/test_conformance.py \
  tests/block_sparse/test_conformance.py >"$OUT/tests.txt" 2>&1
rc=$?
note "GPU tests (tests.txt): exit $rc -- $(tail -1 "$OUT/tests.txt")"
note "done"
